/*
 * KIVI codec on the CPU: asymmetric min/max quantization of keys per
 * channel over token groups and of values per token over channel groups,
 * in the planar layout of lib/common/kv_layout.h (exact rounding in
 * kv_kivi.h), and decode attention straight from the packed planes (the
 * reference of kernels/attn_kivi.cu).  The inner loops are written so that
 * gcc vectorizes them at -O2 -march=x86-64-v2 (min/max, divide, roundps,
 * clamp), and bit packing is specialised per bit width: packing must run at
 * >= 1 GB/s of fp16 input per core (docs/BENCHMARKS.md, CPU packing).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant/kv_kivi.h"

kv_status kv_kivi_check(const kv_kivi_params *prm, int head_dim)
{
    if (prm->bits != 1 && prm->bits != 2 && prm->bits != 4)
        return kv_fail(KV_E_USAGE, "KIVI bits must be 1, 2 or 4, not %d", prm->bits);
    if (prm->group < 1 || prm->group > 65536)
        return kv_fail(KV_E_USAGE, "KIVI group must be 1..65536, not %d", prm->group);
    if (prm->residual < 0)
        return kv_fail(KV_E_USAGE, "KIVI residual must be >= 0, not %d", prm->residual);
    if (head_dim < 1 || head_dim > KV_QUANT_MAX_DIM)
        return kv_fail(KV_E_USAGE, "head dim %d outside 1..%d", head_dim, KV_QUANT_MAX_DIM);
    if (head_dim * prm->bits % 8)
        return kv_fail(KV_E_USAGE, "head dim %d times %d bits is not a whole number of bytes",
                       head_dim, prm->bits);
    int gv = kv_kivi_vgroup(prm->group, head_dim);
    if (head_dim % gv)
        return kv_fail(KV_E_USAGE, "head dim %d is not a multiple of the value group %d",
                       head_dim, gv);
    return KV_OK;
}

// --- scale, zero and codes -------------------------------------------------

/* fp16 scale and zero of a group with float32 extremes mn, mx; sdiv is the
 * divisor the code loop uses: the scale, or +inf (codes 0) when the scale
 * is 0 or not finite. */
static inline void group_params(float mn, float mx, float maxq, kv_half *hs, kv_half *hz,
                                float *sdiv, float *z)
{
    *hs = kv_f32_to_half((mx - mn) / maxq);
    *hz = kv_f32_to_half(mn);
    float s = kv_half_to_f32(*hs);
    *sdiv = (s > 0.0f && s < INFINITY) ? s : INFINITY;
    *z = kv_half_to_f32(*hz);
}

/* Codes of n values with per-element divisor/zero; NaN goes to 0 because
 * `v > 0 ? v : 0` is false for NaN (and compiles to maxps). */
static inline void codes_of(const float *x, const float *sdiv, const float *z, int n,
                            float maxq, uint8_t *q)
{
#pragma omp simd
    for (int c = 0; c < n; c++) {
        float v = rintf((x[c] - z[c]) / sdiv[c]);
        v = v > 0.0f ? v : 0.0f;
        v = v < maxq ? v : maxq;
        q[c] = (uint8_t)(int)v;
    }
}

/* Pack n codes (n*bits a multiple of 8), least significant bits first.
 * Codes are read as little-endian words so that the shifts act on 32- and
 * 64-bit lanes (x86 has no byte shifts): with v the word holding codes
 * q0.., q0 | q1 << b | ... equals a few shifts of v, or for 1 bit one
 * multiplication that gathers the low bit of each byte into the top byte. */
static inline void pack_bits(const uint8_t *q, int n, int bits, uint8_t *out)
{
    switch (bits) {
    case 1:
        for (int j = 0; j < n / 8; j++) {
            uint64_t v;
            memcpy(&v, q + 8 * j, 8);
            out[j] = (uint8_t)((v * 0x0102040810204080ull) >> 56);
        }
        break;
    case 2:
#pragma omp simd
        for (int j = 0; j < n / 4; j++) {
            uint32_t v;
            memcpy(&v, q + 4 * j, 4);
            out[j] = (uint8_t)(v | v >> 6 | v >> 12 | v >> 18);
        }
        break;
    default:
#pragma omp simd
        for (int j = 0; j < n / 2; j++) {
            uint16_t v;
            memcpy(&v, q + 2 * j, 2);
            out[j] = (uint8_t)(v | v >> 4);
        }
        break;
    }
}

// --- low level ---------------------------------------------------------------

void kv_kivi_pack_key_group(const float *x, size_t ld, int G, int head_dim, int bits,
                            uint8_t *codes, size_t code_ld, kv_half *scale, kv_half *zero)
{
    float mn[KV_QUANT_MAX_DIM], mx[KV_QUANT_MAX_DIM];
    float sdiv[KV_QUANT_MAX_DIM], z[KV_QUANT_MAX_DIM];
    uint8_t q[KV_QUANT_MAX_DIM];
    const float maxq = (float)((1 << bits) - 1);
    const int D = head_dim;

    memcpy(mn, x, (size_t)D * sizeof(float));
    memcpy(mx, x, (size_t)D * sizeof(float));
    for (int t = 1; t < G; t++) {
        const float *r = x + (size_t)t * ld;
#pragma omp simd
        for (int c = 0; c < D; c++) {
            mn[c] = r[c] < mn[c] ? r[c] : mn[c];
            mx[c] = r[c] > mx[c] ? r[c] : mx[c];
        }
    }
    for (int c = 0; c < D; c++) group_params(mn[c], mx[c], maxq, &scale[c], &zero[c], &sdiv[c], &z[c]);
    for (int t = 0; t < G; t++) {
        codes_of(x + (size_t)t * ld, sdiv, z, D, maxq, q);
        pack_bits(q, D, bits, codes + (size_t)t * code_ld);
    }
}

void kv_kivi_pack_value_row(const float *x, int head_dim, int gv, int bits, uint8_t *codes,
                            kv_half *scale, kv_half *zero)
{
    float sdiv[KV_QUANT_MAX_DIM], z[KV_QUANT_MAX_DIM];
    uint8_t q[KV_QUANT_MAX_DIM];
    const float maxq = (float)((1 << bits) - 1);

    for (int g = 0; g < head_dim / gv; g++) {
        const float *r = x + (size_t)g * gv;
        float mn = r[0], mx = r[0];
#pragma omp simd reduction(min : mn) reduction(max : mx)
        for (int c = 1; c < gv; c++) {
            mn = r[c] < mn ? r[c] : mn;
            mx = r[c] > mx ? r[c] : mx;
        }
        float sd, zz;
        group_params(mn, mx, maxq, &scale[g], &zero[g], &sd, &zz);
        for (int c = 0; c < gv; c++) {
            sdiv[g * gv + c] = sd;
            z[g * gv + c] = zz;
        }
    }
    codes_of(x, sdiv, z, head_dim, maxq, q);
    pack_bits(q, head_dim, bits, codes);
}

void kv_kivi_dequant_row(const uint8_t *row, const kv_half *scale, const kv_half *zero,
                         int head_dim, int bits, int sgroup, float *out)
{
    if (sgroup == 1) {
        for (int c = 0; c < head_dim; c++)
            out[c] = kv_half_to_f32(zero[c]) +
                     kv_half_to_f32(scale[c]) * (float)kv_code_get(row, c, bits);
        return;
    }
    for (int g = 0; g < head_dim / sgroup; g++) {
        float s = kv_half_to_f32(scale[g]), z = kv_half_to_f32(zero[g]);
        for (int c = g * sgroup; c < (g + 1) * sgroup; c++)
            out[c] = z + s * (float)kv_code_get(row, c, bits);
    }
}

// --- a whole layer -------------------------------------------------------------

size_t kv_kivi_codes_bytes(kv_kivi_axis axis, const kv_kivi_params *prm, int H, int T, int D)
{
    (void)axis;
    int nq = kv_kivi_nquant(T, prm->group, prm->residual);
    return (size_t)H * (size_t)nq * kv_kivi_row_bytes(D, prm->bits);
}

size_t kv_kivi_scale_count(kv_kivi_axis axis, const kv_kivi_params *prm, int H, int T, int D)
{
    int nq = kv_kivi_nquant(T, prm->group, prm->residual);
    if (axis == KV_KIVI_KEYS) return (size_t)H * (size_t)(nq / prm->group) * (size_t)D;
    return (size_t)H * (size_t)nq * (size_t)(D / kv_kivi_vgroup(prm->group, D));
}

size_t kv_kivi_resid_count(const kv_kivi_params *prm, int H, int T, int D)
{
    int nq = kv_kivi_nquant(T, prm->group, prm->residual);
    return (size_t)H * (size_t)(T - nq) * (size_t)D;
}

size_t kv_kivi_bytes(kv_kivi_axis axis, const kv_kivi_params *prm, int H, int T, int D)
{
    return kv_kivi_codes_bytes(axis, prm, H, T, D) +
           2 * 2 * kv_kivi_scale_count(axis, prm, H, T, D) +
           2 * kv_kivi_resid_count(prm, H, T, D);
}

void kv_kivi_clear(kv_kivi_packed *p)
{
    if (!p) return;
    free(p->codes);
    free(p->scale);
    free(p->zero);
    free(p->resid);
    memset(p, 0, sizeof *p);
}

kv_status kv_kivi_init(kv_kivi_packed *p, kv_kivi_axis axis, const kv_kivi_params *prm,
                        int H, int T, int D)
{
    memset(p, 0, sizeof *p);
    kv_status st = kv_kivi_check(prm, D);
    if (st) return st;
    if (H < 1 || T < 0) return kv_fail(KV_E_USAGE, "bad KIVI geometry: %d heads, %d tokens", H, T);
    p->axis = axis;
    p->prm = *prm;
    p->n_kv_heads = H;
    p->T = T;
    p->head_dim = D;
    p->nq = kv_kivi_nquant(T, prm->group, prm->residual);
    size_t nc = kv_kivi_codes_bytes(axis, prm, H, T, D);
    size_t ns = kv_kivi_scale_count(axis, prm, H, T, D);
    size_t nr = kv_kivi_resid_count(prm, H, T, D);
    /* +1 so that empty parts still get a distinct non-NULL pointer */
    p->codes = calloc(nc + 1, 1);
    p->scale = malloc((ns + 1) * sizeof(kv_half));
    p->zero = malloc((ns + 1) * sizeof(kv_half));
    p->resid = malloc((nr + 1) * sizeof(kv_half));
    if (!p->codes || !p->scale || !p->zero || !p->resid) {
        kv_kivi_clear(p);
        return kv_fail(KV_E_NOMEM, "KIVI buffers for %d heads x %d tokens", H, T);
    }
    return KV_OK;
}

kv_status kv_kivi_pack(const float *x, kv_kivi_axis axis, const kv_kivi_params *prm, int H,
                       int T, int D, kv_kivi_packed *out)
{
    kv_status st = kv_kivi_init(out, axis, prm, H, T, D);
    if (st) return st;
    const int G = prm->group, b = prm->bits, nq = out->nq;
    const int gv = kv_kivi_vgroup(G, D);
    const size_t rb = kv_kivi_row_bytes(D, b);
    const int units = axis == KV_KIVI_KEYS ? nq / G : nq; /* per head */

#pragma omp parallel for schedule(static) if ((size_t)H * nq * D > 65536)
    for (long u = 0; u < (long)H * units; u++) {
        int h = (int)(u / units), i = (int)(u % units);
        const float *xh = x + (size_t)h * T * D;
        uint8_t *ch = out->codes + (size_t)h * nq * rb;
        if (axis == KV_KIVI_KEYS) {
            size_t so = ((size_t)h * (nq / G) + i) * D;
            kv_kivi_pack_key_group(xh + (size_t)i * G * D, (size_t)D, G, D, b,
                                   ch + (size_t)i * G * rb, rb, out->scale + so, out->zero + so);
        } else {
            size_t so = ((size_t)h * nq + i) * (D / gv);
            kv_kivi_pack_value_row(xh + (size_t)i * D, D, gv, b, ch + (size_t)i * rb,
                                   out->scale + so, out->zero + so);
        }
    }
    const int nr = T - nq;
    for (int h = 0; h < H; h++) {
        const float *src = x + ((size_t)h * T + nq) * D;
        kv_half *dst = out->resid + (size_t)h * nr * D;
        for (size_t k = 0; k < (size_t)nr * D; k++) dst[k] = kv_f32_to_half(src[k]);
    }
    return KV_OK;
}

void kv_kivi_unpack(const kv_kivi_packed *p, float *out)
{
    const int H = p->n_kv_heads, T = p->T, D = p->head_dim, nq = p->nq;
    const int G = p->prm.group, b = p->prm.bits;
    const int gv = kv_kivi_vgroup(G, D);
    const size_t rb = kv_kivi_row_bytes(D, b);
#pragma omp parallel for schedule(static) if ((size_t)H * T * D > 65536)
    for (long u = 0; u < (long)H * T; u++) {
        int h = (int)(u / T), t = (int)(u % T);
        float *o = out + ((size_t)h * T + t) * D;
        if (t >= nq) {
            const kv_half *r = p->resid + ((size_t)h * (T - nq) + (t - nq)) * D;
            for (int c = 0; c < D; c++) o[c] = kv_half_to_f32(r[c]);
            continue;
        }
        const uint8_t *row = p->codes + ((size_t)h * nq + t) * rb;
        if (p->axis == KV_KIVI_KEYS) {
            size_t so = ((size_t)h * (nq / G) + t / G) * D;
            kv_kivi_dequant_row(row, p->scale + so, p->zero + so, D, b, 1, o);
        } else {
            size_t so = ((size_t)h * nq + t) * (D / gv);
            kv_kivi_dequant_row(row, p->scale + so, p->zero + so, D, b, gv, o);
        }
    }
}

// --- packed layers in .kvc files ---------------------------------------------------


// --- attention from the packed planes ------------------------------------

static kv_status kivi_match(const kv_attn_dims *d, const kv_kivi_packed *K,
                            const kv_kivi_packed *V)
{
    if (K->axis != KV_KIVI_KEYS || V->axis != KV_KIVI_VALUES)
        return kv_fail(KV_E_USAGE, "packed keys and values given in the wrong order");
    if (K->n_kv_heads != d->n_kv_heads || V->n_kv_heads != d->n_kv_heads || K->T != d->T ||
        V->T != d->T || K->head_dim != d->head_dim || V->head_dim != d->head_dim)
        return kv_fail(KV_E_USAGE, "packed K/V shapes do not match the attention geometry");
    if (K->prm.bits != V->prm.bits || K->prm.group != V->prm.group ||
        K->prm.residual != V->prm.residual || K->nq != V->nq)
        return kv_fail(KV_E_USAGE, "packed keys and values use different KIVI parameters");
    return KV_OK;
}

kv_status kv_attn_decode_kivi(const kv_attn_dims *d, const kv_half *q, const kv_kivi_packed *K,
                              const kv_kivi_packed *V, float *out)
{
    kv_status st = kv_attn_check(d);
    if (!st) st = kivi_match(d, K, V);
    if (st) return st;
    const int D = d->head_dim, T = d->T, nq = K->nq, G = K->prm.group, b = K->prm.bits;
    const int gv = kv_kivi_vgroup(G, D), ngv = D / gv, rep = d->n_heads / d->n_kv_heads;
    const size_t rb = kv_kivi_row_bytes(D, b);
    float *s = malloc((size_t)T * sizeof(float));
    float *qs = malloc((size_t)D * sizeof(float));
    float *zacc = malloc((size_t)ngv * sizeof(float));
    if (!s || !qs || !zacc) {
        free(s), free(qs), free(zacc);
        return kv_fail(KV_E_NOMEM, "attention scratch of %d tokens", T);
    }
    for (int h = 0; h < d->n_heads; h++) {
        const int kh = h / rep;
        const kv_half *qh = q + (size_t)h * D;
        const uint8_t *kc = K->codes + (size_t)kh * nq * rb;
        const uint8_t *vc = V->codes + (size_t)kh * nq * rb;
        const kv_half *ks = K->scale + (size_t)kh * (nq / (G ? G : 1)) * D;
        const kv_half *kz = K->zero + (size_t)kh * (nq / (G ? G : 1)) * D;
        const kv_half *vs = V->scale + (size_t)kh * nq * ngv;
        const kv_half *vz = V->zero + (size_t)kh * nq * ngv;
        const kv_half *kr = K->resid + (size_t)kh * (T - nq) * D;
        const kv_half *vr = V->resid + (size_t)kh * (T - nq) * D;

        /* Scores of quantized tokens: the query folded once per key group. */
        for (int g = 0; g < nq / G; g++) {
            float qz = 0.0f;
            for (int c = 0; c < D; c++) {
                float qc = kv_half_to_f32(qh[c]);
                qs[c] = qc * kv_half_to_f32(ks[(size_t)g * D + c]);
                qz += qc * kv_half_to_f32(kz[(size_t)g * D + c]);
            }
            for (int t = g * G; t < (g + 1) * G; t++) {
                float acc = 0.0f;
                for (int c = 0; c < D; c++)
                    acc += qs[c] * (float)kv_code_get(kc + (size_t)t * rb, c, b);
                s[t] = (qz + acc) * d->scale;
            }
        }
        /* Scores of the fp16 residual tokens. */
        for (int t = nq; t < T; t++) {
            float acc = 0.0f;
            for (int c = 0; c < D; c++)
                acc += kv_half_to_f32(qh[c]) * kv_half_to_f32(kr[(size_t)(t - nq) * D + c]);
            s[t] = acc * d->scale;
        }
        float l = kv_softmax_unnormalized(s, T);

        /* Values: probabilities folded with each token's group scales. */
        float *o = out + (size_t)h * D;
        memset(o, 0, (size_t)D * sizeof(float));
        memset(zacc, 0, (size_t)ngv * sizeof(float));
        for (int t = 0; t < nq; t++) {
            const uint8_t *row = vc + (size_t)t * rb;
            for (int g = 0; g < ngv; g++) {
                float ps = s[t] * kv_half_to_f32(vs[(size_t)t * ngv + g]);
                zacc[g] += s[t] * kv_half_to_f32(vz[(size_t)t * ngv + g]);
                for (int c = g * gv; c < (g + 1) * gv; c++) o[c] += ps * (float)kv_code_get(row, c, b);
            }
        }
        for (int c = 0; c < D; c++) o[c] += zacc[c / gv];
        for (int t = nq; t < T; t++)
            for (int c = 0; c < D; c++) o[c] += s[t] * kv_half_to_f32(vr[(size_t)(t - nq) * D + c]);
        for (int c = 0; c < D; c++) o[c] /= l;
    }
    free(s), free(qs), free(zacc);
    return KV_OK;
}

