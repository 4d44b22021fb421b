/*
 * kv_quants: reference dequantization, quantization and dot products for
 * ggml weight types (see kv_quants.h).  The quantizer is this project's:
 * each group of values gets a least-squares fit of its scale (and offset),
 * started from the min/max fit and refined by alternating "round the codes"
 * and "solve the scale" a few times, keeping the fit of least squared
 * error; the group scales are then quantized against the super-block scale
 * and the codes rounded once more against the scales actually stored.
 */
#include "model/kv_quants.h"

#include <math.h>
#include <string.h>

#include "common/kv_half.h"

bool kv_quant_supported(uint32_t t)
{
    switch (t) {
    case KV_GGML_F32: case KV_GGML_F16: case KV_GGML_BF16:
    case KV_GGML_Q4_0: case KV_GGML_Q4_1: case KV_GGML_Q5_0: case KV_GGML_Q5_1: case KV_GGML_Q8_0:
    case KV_GGML_Q2_K: case KV_GGML_Q3_K: case KV_GGML_Q4_K: case KV_GGML_Q5_K: case KV_GGML_Q6_K:
        return true;
    default:
        return false;
    }
}

bool kv_quant_is_block(uint32_t t)
{
    return kv_quant_supported(t) && t != KV_GGML_F32 && t != KV_GGML_F16 && t != KV_GGML_BF16;
}

int kv_quant_block(uint32_t t)
{
    const kv_ggml_type_info *i = kv_quant_supported(t) ? kv_ggml_type_info_of(t) : NULL;
    return i ? i->block : 0;
}

size_t kv_quant_row_bytes(uint32_t t, int64_t n)
{
    const kv_ggml_type_info *i = kv_quant_supported(t) ? kv_ggml_type_info_of(t) : NULL;
    return i ? (size_t)(n / i->block) * (size_t)i->bytes : 0;
}

// --- dequantization --------------------------------------------------------------

void kv_quant_dequant_row(uint32_t t, const void *src, float *y, int64_t n)
{
    const uint8_t *p = src;
    switch (t) {
    case KV_GGML_F32:
        memcpy(y, src, (size_t)n * 4);
        return;
    case KV_GGML_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            y[i] = kv_half_to_f32(h);
        }
        return;
    case KV_GGML_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            y[i] = kv_bf16_to_f32(h);
        }
        return;
    default:
        break;
    }
    /* blocks may sit at any byte offset of an mmapped file: copy each one */
    const int64_t nb = n / kv_quant_block(t);
#define DQ(T, fn)                                                   \
    for (int64_t b = 0; b < nb; b++) {                              \
        T blk;                                                      \
        memcpy(&blk, p + (size_t)b * sizeof blk, sizeof blk);       \
        fn(&blk, y + b * (int64_t)(n / nb));                        \
    }                                                               \
    return;
    switch (t) {
    case KV_GGML_Q4_0: DQ(kv_block_q4_0, kv_ggml_dequant_q4_0)
    case KV_GGML_Q4_1: DQ(kv_block_q4_1, kv_ggml_dequant_q4_1)
    case KV_GGML_Q5_0: DQ(kv_block_q5_0, kv_ggml_dequant_q5_0)
    case KV_GGML_Q5_1: DQ(kv_block_q5_1, kv_ggml_dequant_q5_1)
    case KV_GGML_Q8_0: DQ(kv_block_q8_0, kv_ggml_dequant_q8_0)
    case KV_GGML_Q2_K: DQ(kv_block_q2_k, kv_ggml_dequant_q2_k)
    case KV_GGML_Q3_K: DQ(kv_block_q3_k, kv_ggml_dequant_q3_k)
    case KV_GGML_Q4_K: DQ(kv_block_q4_k, kv_ggml_dequant_q4_k)
    case KV_GGML_Q5_K: DQ(kv_block_q5_k, kv_ggml_dequant_q5_k)
    case KV_GGML_Q6_K: DQ(kv_block_q6_k, kv_ggml_dequant_q6_k)
    default: return;
    }
#undef DQ
}

// --- fitting one group ---------------------------------------------------------

static int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* x ≈ s * q + off with q in [0, nmax], off <= 0 (the K-quant mins subtract),
 * s >= 0.  Returns the squared error. */
static float fit_asym(const float *x, int n, int nmax, float *s_out, float *off_out)
{
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; i++) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
    }
    if (lo > 0) lo = 0;
    if (hi <= lo) {
        *s_out = 0;
        *off_out = lo;
        float e = 0;
        for (int i = 0; i < n; i++) e += (x[i] - lo) * (x[i] - lo);
        return e;
    }
    float s = (hi - lo) / (float)nmax, off = lo, best_e = INFINITY, bs = s, bo = off;
    for (int it = 0; it < 6; it++) {
        /* codes for (s, off), then the least-squares (s, off) for those codes */
        double sq = 0, sqq = 0, sx = 0, sxq = 0, e = 0;
        for (int i = 0; i < n; i++) {
            int q = s > 0 ? clampi((int)lrintf((x[i] - off) / s), 0, nmax) : 0;
            float r = x[i] - (s * (float)q + off);
            e += (double)r * r;
            sq += q, sqq += (double)q * q, sx += x[i], sxq += (double)x[i] * q;
        }
        if (e < best_e) best_e = (float)e, bs = s, bo = off;
        double det = n * sqq - sq * sq;
        if (det <= 0) break;
        double ns = (n * sxq - sq * sx) / det, no = (sx - ns * sq) / n;
        if (no > 0) { /* the offset must stay <= 0: refit the scale alone */
            no = 0;
            ns = sqq > 0 ? sxq / sqq : 0;
        }
        if (!(ns > 0)) break;
        s = (float)ns, off = (float)no;
    }
    *s_out = bs;
    *off_out = bo;
    return best_e;
}

/* x ≈ s * q with q in [-nneg, npos]; s may be negative (so the value of
 * largest magnitude can use the longer side).  Returns the squared error. */
static float fit_sym(const float *x, int n, int nneg, int npos, float *s_out)
{
    float amax = 0, mx = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), mx = x[i];
    if (amax == 0) {
        *s_out = 0;
        return 0;
    }
    float s = mx / -(float)nneg, best_e = INFINITY, bs = s;
    for (int it = 0; it < 6; it++) {
        double sxq = 0, sqq = 0, e = 0;
        for (int i = 0; i < n; i++) {
            int q = clampi((int)lrintf(x[i] / s), -nneg, npos);
            float r = x[i] - s * (float)q;
            e += (double)r * r;
            sxq += (double)x[i] * q, sqq += (double)q * q;
        }
        if (e < best_e) best_e = (float)e, bs = s;
        if (sqq <= 0) break;
        float ns = (float)(sxq / sqq);
        if (ns == 0 || ns == s) break;
        s = ns;
    }
    *s_out = bs;
    return best_e;
}

static uint16_t f16(float f) { return kv_f32_to_half(f); }
static float f16r(float f) { return kv_half_to_f32(kv_f32_to_half(f)); }

// --- the 32-value types ----------------------------------------------------------

static void put_nibbles(uint8_t *qs, const int *q) /* q (32), 0..15 */
{
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)(q[j] | q[j + 16] << 4);
}

static void put_qh(uint8_t *qh, const int *q) /* fifth bits of q (32) */
{
    uint32_t h = 0;
    for (int j = 0; j < 32; j++) h |= (uint32_t)((q[j] >> 4) & 1) << j;
    for (int k = 0; k < 4; k++) qh[k] = (uint8_t)(h >> (8 * k));
}

static void quant_sym32(const float *x, int nneg, int npos, uint16_t *d_out, int *q)
{
    float s;
    fit_sym(x, 32, nneg, npos, &s);
    float d = f16r(s), id = d != 0 ? 1.0f / d : 0;
    *d_out = f16(d);
    for (int j = 0; j < 32; j++) q[j] = clampi((int)lrintf(x[j] * id), -nneg, npos);
}

static void quant_asym32(const float *x, int nmax, uint16_t *d_out, uint16_t *m_out, int *q)
{
    float s, off;
    fit_asym(x, 32, nmax, &s, &off);
    float d = f16r(s), m = f16r(off);
    *d_out = f16(d);
    *m_out = f16(m);
    for (int j = 0; j < 32; j++) q[j] = d > 0 ? clampi((int)lrintf((x[j] - m) / d), 0, nmax) : 0;
}

static void q_q4_0(const float *x, uint8_t *out)
{
    kv_block_q4_0 b;
    int q[32];
    quant_sym32(x, 8, 7, &b.d, q);
    for (int j = 0; j < 32; j++) q[j] += 8;
    put_nibbles(b.qs, q);
    memcpy(out, &b, sizeof b);
}

static void q_q4_1(const float *x, uint8_t *out)
{
    kv_block_q4_1 b;
    int q[32];
    quant_asym32(x, 15, &b.d, &b.m, q);
    put_nibbles(b.qs, q);
    memcpy(out, &b, sizeof b);
}

static void q_q5_0(const float *x, uint8_t *out)
{
    kv_block_q5_0 b;
    int q[32], lo[32];
    quant_sym32(x, 16, 15, &b.d, q);
    for (int j = 0; j < 32; j++) q[j] += 16, lo[j] = q[j] & 0xF;
    put_nibbles(b.qs, lo);
    put_qh(b.qh, q);
    memcpy(out, &b, sizeof b);
}

static void q_q5_1(const float *x, uint8_t *out)
{
    kv_block_q5_1 b;
    int q[32], lo[32];
    quant_asym32(x, 31, &b.d, &b.m, q);
    for (int j = 0; j < 32; j++) lo[j] = q[j] & 0xF;
    put_nibbles(b.qs, lo);
    put_qh(b.qh, q);
    memcpy(out, &b, sizeof b);
}

static void q_q8_0(const float *x, uint8_t *out)
{
    kv_block_q8_0 b;
    float amax = 0;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = f16r(amax / 127.0f), id = d != 0 ? 1.0f / d : 0;
    b.d = f16(d);
    for (int j = 0; j < 32; j++) b.qs[j] = (int8_t)clampi((int)lrintf(x[j] * id), -127, 127);
    memcpy(out, &b, sizeof b);
}

// --- K-quants ----------------------------------------------------------------------

/* Codes of asymmetric groups given the stored scale/min of each group. */
static void codes_asym(const float *x, int n, int nmax, float d, float m, int *q)
{
    for (int j = 0; j < n; j++) q[j] = d > 0 ? clampi((int)lrintf((x[j] + m) / d), 0, nmax) : 0;
}

/* The 6-bit scales and mins of Q4_K/Q5_K: inverse of kv_ggml_k4_scale_min. */
static void put_k4_scales(uint8_t *s, const int *sc, const int *mn)
{
    memset(s, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            s[j] |= (uint8_t)(sc[j] & 63);
            s[j + 4] |= (uint8_t)(mn[j] & 63);
        } else {
            s[j + 4] |= (uint8_t)((sc[j] & 0xF) | (mn[j] & 0xF) << 4);
            s[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
            s[j] |= (uint8_t)((mn[j] >> 4) << 6);
        }
    }
}

/* Groups of gsize values, codes 0..nmax, scales/mins quantized to sbits. */
static void k_asym(const float *x, int ngroups, int gsize, int nmax, int smax, float *d_out,
                   float *dmin_out, int *sc, int *mn, int *q)
{
    float s[16], off[16], smx = 0, omx = 0;
    for (int g = 0; g < ngroups; g++) {
        fit_asym(x + g * gsize, gsize, nmax, &s[g], &off[g]);
        smx = fmaxf(smx, s[g]);
        omx = fmaxf(omx, -off[g]);
    }
    float d = f16r(smx / (float)smax), dmin = f16r(omx / (float)smax);
    for (int g = 0; g < ngroups; g++) {
        sc[g] = d > 0 ? clampi((int)lrintf(s[g] / d), 0, smax) : 0;
        mn[g] = dmin > 0 ? clampi((int)lrintf(-off[g] / dmin), 0, smax) : 0;
        codes_asym(x + g * gsize, gsize, nmax, d * (float)sc[g], dmin * (float)mn[g], q + g * gsize);
    }
    *d_out = d;
    *dmin_out = dmin;
}

static void q_q4_k(const float *x, uint8_t *out)
{
    kv_block_q4_k b;
    int sc[8], mn[8], q[256];
    float d, dmin;
    k_asym(x, 8, 32, 15, 63, &d, &dmin, sc, mn, q);
    b.d = f16(d);
    b.dmin = f16(dmin);
    put_k4_scales(b.scales, sc, mn);
    for (int p = 0; p < 4; p++)
        for (int l = 0; l < 32; l++) b.qs[32 * p + l] = (uint8_t)(q[64 * p + l] | q[64 * p + 32 + l] << 4);
    memcpy(out, &b, sizeof b);
}

static void q_q5_k(const float *x, uint8_t *out)
{
    kv_block_q5_k b;
    int sc[8], mn[8], q[256];
    float d, dmin;
    k_asym(x, 8, 32, 31, 63, &d, &dmin, sc, mn, q);
    b.d = f16(d);
    b.dmin = f16(dmin);
    put_k4_scales(b.scales, sc, mn);
    memset(b.qh, 0, sizeof b.qh);
    for (int p = 0; p < 4; p++)
        for (int l = 0; l < 32; l++) {
            int q0 = q[64 * p + l], q1 = q[64 * p + 32 + l];
            b.qs[32 * p + l] = (uint8_t)((q0 & 0xF) | (q1 & 0xF) << 4);
            b.qh[l] |= (uint8_t)(((q0 >> 4) & 1) << (2 * p) | ((q1 >> 4) & 1) << (2 * p + 1));
        }
    memcpy(out, &b, sizeof b);
}

/* Q2_K/Q3_K share the 2-bit placement: value 128h + 32s + l in bits 2s of
 * qs[32h + l]. */
static void put_2bit(uint8_t *qs, const int *q)
{
    memset(qs, 0, 64);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) qs[32 * h + l] |= (uint8_t)((q[128 * h + 32 * s + l] & 3) << (2 * s));
}

static void q_q2_k(const float *x, uint8_t *out)
{
    kv_block_q2_k b;
    int sc[16], mn[16], q[256];
    float d, dmin;
    k_asym(x, 16, 16, 3, 15, &d, &dmin, sc, mn, q);
    b.d = f16(d);
    b.dmin = f16(dmin);
    for (int k = 0; k < 16; k++) b.scales[k] = (uint8_t)(sc[k] | mn[k] << 4);
    put_2bit(b.qs, q);
    memcpy(out, &b, sizeof b);
}

/* Symmetric groups: codes -nneg..npos, signed scales stored in [-sneg, spos]. */
static float k_sym(const float *x, int ngroups, int gsize, int nneg, int npos, int sneg, int spos,
                   int *sc, int *q)
{
    float s[16], amax = 0, mx = 0;
    for (int g = 0; g < ngroups; g++) {
        fit_sym(x + g * gsize, gsize, nneg, npos, &s[g]);
        if (fabsf(s[g]) > amax) amax = fabsf(s[g]), mx = s[g];
    }
    float d = f16r(mx / -(float)sneg);
    for (int g = 0; g < ngroups; g++) {
        sc[g] = d != 0 ? clampi((int)lrintf(s[g] / d), -sneg, spos) : 0;
        float dl = d * (float)sc[g];
        for (int j = 0; j < gsize; j++)
            q[g * gsize + j] = dl != 0 ? clampi((int)lrintf(x[g * gsize + j] / dl), -nneg, npos) : 0;
    }
    return d;
}

static void q_q3_k(const float *x, uint8_t *out)
{
    kv_block_q3_k b;
    int sc[16], q[256];
    float d = k_sym(x, 16, 16, 4, 3, 32, 31, sc, q);
    b.d = f16(d);
    memset(b.scales, 0, 12);
    for (int i = 0; i < 16; i++) { /* inverse of kv_ggml_q3k_scales */
        int v = sc[i] + 32;
        if (i < 8) b.scales[i] |= (uint8_t)(v & 0xF);
        else b.scales[i - 8] |= (uint8_t)((v & 0xF) << 4);
        b.scales[8 + i % 4] |= (uint8_t)(((v >> 4) & 3) << (2 * (i / 4)));
    }
    memset(b.hmask, 0, sizeof b.hmask);
    for (int i = 0; i < 256; i++) {
        int v = q[i] + 4; /* 0..7: bit 2 set means "no -4" */
        int h = i / 128, s = (i % 128) / 32, l = i % 32;
        if (v & 4) b.hmask[l] |= (uint8_t)(1 << (4 * h + s));
        q[i] = v & 3;
    }
    put_2bit(b.qs, q);
    memcpy(out, &b, sizeof b);
}

static void q_q6_k(const float *x, uint8_t *out)
{
    kv_block_q6_k b;
    int sc[16], q[256];
    float d = k_sym(x, 16, 16, 32, 31, 128, 127, sc, q);
    b.d = f16(d);
    for (int k = 0; k < 16; k++) b.scales[k] = (int8_t)sc[k];
    memset(b.ql, 0, sizeof b.ql);
    memset(b.qh, 0, sizeof b.qh);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                int v = q[128 * h + 32 * s + l] + 32; /* 0..63 */
                b.ql[64 * h + 32 * (s % 2) + l] |= (uint8_t)((v & 0xF) << (s < 2 ? 0 : 4));
                b.qh[32 * h + l] |= (uint8_t)((v >> 4) << (2 * s));
            }
    memcpy(out, &b, sizeof b);
}

kv_status kv_quant_quantize_row(uint32_t t, const float *x, void *dst, int64_t n)
{
    char tb[16];
    if (!kv_quant_supported(t))
        return kv_fail(KV_E_UNSUPPORTED, "cannot write %s weights", kv_ggml_type_name(t, tb));
    int bl = kv_quant_block(t);
    if (n <= 0 || n % bl)
        return kv_fail(KV_E_USAGE, "%s rows need a multiple of %d values, not %lld",
                       kv_ggml_type_name(t, tb), bl, (long long)n);
    uint8_t *o = dst;
    if (t == KV_GGML_F32) {
        memcpy(o, x, (size_t)n * 4);
        return KV_OK;
    }
    if (t == KV_GGML_F16 || t == KV_GGML_BF16) {
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = t == KV_GGML_F16 ? kv_f32_to_half(x[i]) : kv_f32_to_bf16(x[i]);
            memcpy(o + 2 * i, &h, 2);
        }
        return KV_OK;
    }
    void (*fn)(const float *, uint8_t *) = NULL;
    switch (t) {
    case KV_GGML_Q4_0: fn = q_q4_0; break;
    case KV_GGML_Q4_1: fn = q_q4_1; break;
    case KV_GGML_Q5_0: fn = q_q5_0; break;
    case KV_GGML_Q5_1: fn = q_q5_1; break;
    case KV_GGML_Q8_0: fn = q_q8_0; break;
    case KV_GGML_Q2_K: fn = q_q2_k; break;
    case KV_GGML_Q3_K: fn = q_q3_k; break;
    case KV_GGML_Q4_K: fn = q_q4_k; break;
    case KV_GGML_Q5_K: fn = q_q5_k; break;
    case KV_GGML_Q6_K: fn = q_q6_k; break;
    }
    size_t bb = (size_t)kv_ggml_type_info_of(t)->bytes;
    for (int64_t b = 0; b < n / bl; b++) fn(x + b * bl, o + (size_t)b * bb);
    return KV_OK;
}

// --- activations ------------------------------------------------------------------

uint32_t kv_quant_vec_type(uint32_t t)
{
    switch (t) {
    case KV_GGML_Q4_0: case KV_GGML_Q5_0: case KV_GGML_Q8_0: return KV_GGML_Q8_0;
    case KV_GGML_Q4_1: case KV_GGML_Q5_1: return KV_GGML_Q8_1;
    case KV_GGML_Q2_K: case KV_GGML_Q3_K: case KV_GGML_Q4_K: case KV_GGML_Q5_K: case KV_GGML_Q6_K:
        return KV_GGML_Q8_K;
    default: return KV_GGML_F32;
    }
}

size_t kv_quant_vec_bytes(uint32_t vt, int64_t n)
{
    switch (vt) {
    case KV_GGML_Q8_0: return (size_t)(n / 32) * sizeof(kv_block_q8_0);
    case KV_GGML_Q8_1: return (size_t)(n / 32) * sizeof(kv_block_q8_1);
    case KV_GGML_Q8_K: return (size_t)(n / 256) * sizeof(kv_block_q8_k);
    default: return (size_t)n * 4;
    }
}

void kv_quant_activations(uint32_t vt, const float *x, void *dst, int64_t n)
{
    if (vt == KV_GGML_Q8_0 || vt == KV_GGML_Q8_1) {
        for (int64_t b = 0; b < n / 32; b++) {
            const float *xb = x + 32 * b;
            float amax = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f, id = amax != 0 ? 127.0f / amax : 0.0f;
            int8_t qs[32];
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                qs[j] = (int8_t)lrintf(xb[j] * id);
                sum += qs[j];
            }
            if (vt == KV_GGML_Q8_0) {
                kv_block_q8_0 *o = (kv_block_q8_0 *)dst + b;
                o->d = kv_f32_to_half(d);
                memcpy(o->qs, qs, 32);
            } else {
                kv_block_q8_1 *o = (kv_block_q8_1 *)dst + b;
                o->d = kv_f32_to_half(d);
                o->s = kv_f32_to_half(d * (float)sum);
                memcpy(o->qs, qs, 32);
            }
        }
        return;
    }
    if (vt == KV_GGML_Q8_K) {
        for (int64_t b = 0; b < n / 256; b++) {
            const float *xb = x + 256 * b;
            kv_block_q8_k *o = (kv_block_q8_k *)dst + b;
            float amax = 0, mx = 0;
            for (int j = 0; j < 256; j++)
                if (fabsf(xb[j]) > amax) amax = fabsf(xb[j]), mx = xb[j];
            if (amax == 0) {
                memset(o, 0, sizeof *o);
                continue;
            }
            /* the value of largest magnitude maps to -127 */
            const float iscale = -127.0f / mx;
            for (int j = 0; j < 256; j++) {
                int v = (int)lrintf(iscale * xb[j]);
                o->qs[j] = (int8_t)(v > 127 ? 127 : v);
            }
            for (int k = 0; k < 16; k++) {
                int s = 0;
                for (int j = 0; j < 16; j++) s += o->qs[16 * k + j];
                o->bsums[k] = (int16_t)s;
            }
            o->d = 1.0f / iscale;
        }
        return;
    }
    memcpy(dst, x, (size_t)n * 4);
}

// --- reference dot products --------------------------------------------------------

#define LOAD(T, var, base, i) T var; memcpy(&var, (const uint8_t *)(base) + (size_t)(i) * sizeof(T), sizeof(T))

float kv_quant_dot_ref(uint32_t t, const void *row, const void *xq, int64_t n)
{
    float sum = 0;
    switch (t) {
    case KV_GGML_Q4_0:
        for (int64_t b = 0; b < n / 32; b++) {
            LOAD(kv_block_q4_0, w, row, b);
            const kv_block_q8_0 *y = (const kv_block_q8_0 *)xq + b;
            int s = 0;
            for (int j = 0; j < 16; j++)
                s += ((w.qs[j] & 0xF) - 8) * y->qs[j] + ((w.qs[j] >> 4) - 8) * y->qs[j + 16];
            sum += (float)s * (kv_ggml_f16(w.d) * kv_ggml_f16(y->d));
        }
        return sum;
    case KV_GGML_Q4_1:
        for (int64_t b = 0; b < n / 32; b++) {
            LOAD(kv_block_q4_1, w, row, b);
            const kv_block_q8_1 *y = (const kv_block_q8_1 *)xq + b;
            int s = 0;
            for (int j = 0; j < 16; j++) s += (w.qs[j] & 0xF) * y->qs[j] + (w.qs[j] >> 4) * y->qs[j + 16];
            sum += (float)s * (kv_ggml_f16(w.d) * kv_ggml_f16(y->d)) + kv_ggml_f16(w.m) * kv_ggml_f16(y->s);
        }
        return sum;
    case KV_GGML_Q5_0:
    case KV_GGML_Q5_1:
        for (int64_t b = 0; b < n / 32; b++) {
            float v[32];
            int s = 0;
            if (t == KV_GGML_Q5_0) {
                LOAD(kv_block_q5_0, w, row, b);
                const kv_block_q8_0 *y = (const kv_block_q8_0 *)xq + b;
                uint32_t qh = kv_ggml_qh32(w.qh);
                for (int j = 0; j < 16; j++) {
                    int q0 = ((w.qs[j] & 0xF) | ((qh >> j) & 1) << 4) - 16;
                    int q1 = ((w.qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16;
                    s += q0 * y->qs[j] + q1 * y->qs[j + 16];
                }
                sum += (float)s * (kv_ggml_f16(w.d) * kv_ggml_f16(y->d));
            } else {
                LOAD(kv_block_q5_1, w, row, b);
                const kv_block_q8_1 *y = (const kv_block_q8_1 *)xq + b;
                uint32_t qh = kv_ggml_qh32(w.qh);
                for (int j = 0; j < 16; j++) {
                    int q0 = (w.qs[j] & 0xF) | ((qh >> j) & 1) << 4;
                    int q1 = (w.qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
                    s += q0 * y->qs[j] + q1 * y->qs[j + 16];
                }
                sum += (float)s * (kv_ggml_f16(w.d) * kv_ggml_f16(y->d)) + kv_ggml_f16(w.m) * kv_ggml_f16(y->s);
            }
            (void)v;
        }
        return sum;
    case KV_GGML_Q8_0:
        for (int64_t b = 0; b < n / 32; b++) {
            LOAD(kv_block_q8_0, w, row, b);
            const kv_block_q8_0 *y = (const kv_block_q8_0 *)xq + b;
            int s = 0;
            for (int j = 0; j < 32; j++) s += w.qs[j] * y->qs[j];
            sum += (float)s * (kv_ggml_f16(w.d) * kv_ggml_f16(y->d));
        }
        return sum;
    default:
        break;
    }
    /* K-quants: integer codes of each 16- or 32-value group against Q8_K */
    const int64_t nb = n / 256;
    for (int64_t b = 0; b < nb; b++) {
        const kv_block_q8_k *y = (const kv_block_q8_k *)xq + b;
        int q[256], sc[16], mn[16] = {0}, ng, gs;
        float d, dmin = 0;
        switch (t) {
        case KV_GGML_Q2_K: {
            LOAD(kv_block_q2_k, w, row, b);
            for (int i = 0; i < 256; i++) q[i] = (w.qs[32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3;
            for (int k = 0; k < 16; k++) sc[k] = w.scales[k] & 0xF, mn[k] = w.scales[k] >> 4;
            d = kv_ggml_f16(w.d), dmin = kv_ggml_f16(w.dmin), ng = 16, gs = 16;
            break;
        }
        case KV_GGML_Q3_K: {
            LOAD(kv_block_q3_k, w, row, b);
            for (int i = 0; i < 256; i++) {
                int h = i / 128, s = (i % 128) / 32, l = i % 32;
                q[i] = ((w.qs[32 * h + l] >> (2 * s)) & 3) - (((w.hmask[l] >> (4 * h + s)) & 1) ? 0 : 4);
            }
            kv_ggml_q3k_scales(w.scales, sc);
            d = kv_ggml_f16(w.d), ng = 16, gs = 16;
            break;
        }
        case KV_GGML_Q4_K:
        case KV_GGML_Q5_K: {
            const uint8_t *qs, *scales, *qh = NULL;
            kv_block_q4_k w4;
            kv_block_q5_k w5;
            if (t == KV_GGML_Q4_K) {
                memcpy(&w4, (const uint8_t *)row + (size_t)b * sizeof w4, sizeof w4);
                qs = w4.qs, scales = w4.scales, d = kv_ggml_f16(w4.d), dmin = kv_ggml_f16(w4.dmin);
            } else {
                memcpy(&w5, (const uint8_t *)row + (size_t)b * sizeof w5, sizeof w5);
                qs = w5.qs, scales = w5.scales, qh = w5.qh, d = kv_ggml_f16(w5.d), dmin = kv_ggml_f16(w5.dmin);
            }
            for (int i = 0; i < 256; i++) {
                int p = i / 64, hi = (i % 64) >= 32, l = i % 32;
                q[i] = hi ? qs[32 * p + l] >> 4 : qs[32 * p + l] & 0xF;
                if (qh) q[i] |= ((qh[l] >> (2 * p + hi)) & 1) << 4;
            }
            for (int k = 0; k < 8; k++) kv_ggml_k4_scale_min(k, scales, &sc[k], &mn[k]);
            ng = 8, gs = 32;
            break;
        }
        case KV_GGML_Q6_K: {
            LOAD(kv_block_q6_k, w, row, b);
            for (int i = 0; i < 256; i++) {
                int h = i / 128, s = (i % 128) / 32, l = i % 32;
                uint8_t lo = w.ql[64 * h + 32 * (s % 2) + l];
                q[i] = ((s < 2 ? lo & 0xF : lo >> 4) | ((w.qh[32 * h + l] >> (2 * s)) & 3) << 4) - 32;
            }
            for (int k = 0; k < 16; k++) sc[k] = w.scales[k];
            d = kv_ggml_f16(w.d), ng = 16, gs = 16;
            break;
        }
        default:
            return 0;
        }
        int isum = 0, msum = 0;
        for (int g = 0; g < ng; g++) {
            int s = 0;
            for (int j = 0; j < gs; j++) s += q[g * gs + j] * y->qs[g * gs + j];
            isum += sc[g] * s;
            int bs = gs == 16 ? y->bsums[g] : y->bsums[2 * g] + y->bsums[2 * g + 1];
            msum += mn[g] * bs;
        }
        sum += y->d * (d * (float)isum - dmin * (float)msum);
    }
    return sum;
}
