/*
 * KIVI quantization on the CPU (see kv_quant.h for the exact rounding and
 * lib/kv_layout.h for the layout).  The inner loops are written so that gcc
 * vectorizes them at -O2 -march=x86-64-v2 (min/max, divide, roundps, clamp),
 * and bit packing is specialised per bit width: packing must run at >= 1 GB/s
 * of fp16 input per core (docs/BENCHMARKS.md, CPU packing).
 */
#include "kv_quant.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_json.h"
#include "kv_profile.h"

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

void kv_kivi_free(kv_kivi_packed *p)
{
    if (!p) return;
    free(p->codes);
    free(p->scale);
    free(p->zero);
    free(p->resid);
    memset(p, 0, sizeof *p);
}

kv_status kv_kivi_alloc(kv_kivi_packed *p, kv_kivi_axis axis, const kv_kivi_params *prm,
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
        kv_kivi_free(p);
        return kv_fail(KV_E_NOMEM, "KIVI buffers for %d heads x %d tokens", H, T);
    }
    return KV_OK;
}

kv_status kv_kivi_pack(const float *x, kv_kivi_axis axis, const kv_kivi_params *prm, int H,
                       int T, int D, kv_kivi_packed *out)
{
    kv_status st = kv_kivi_alloc(out, axis, prm, H, T, D);
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

const char *kv_encoding_name(kv_encoding e)
{
    return e == KV_ENC_KIVI ? "kivi" : e == KV_ENC_DSQ ? "dsq" : "plain";
}

static kv_status add_part(kvc_writer *w, int layer, char which, const char *part, kv_dtype dt,
                          int ndim, const int64_t *shape, const void *data)
{
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c.%s", layer, which, part);
    return kvc_writer_add_copy(w, name, dt, ndim, shape, data);
}

static kv_status add_meta_int(kvc_writer *w, int layer, char which, const char *key, int v)
{
    char name[KVC_NAME_MAX], val[32];
    snprintf(name, sizeof name, "layers.%d.%c.%s", layer, which, key);
    snprintf(val, sizeof val, "%d", v);
    return kvc_writer_meta(w, name, val);
}

static kv_status add_encoding(kvc_writer *w, int layer, char which, kv_encoding e)
{
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c.encoding", layer, which);
    return kvc_writer_meta(w, name, kv_encoding_name(e));
}

kv_status kv_kivi_write(kvc_writer *w, int layer, char which, const kv_kivi_packed *p)
{
    const int64_t H = p->n_kv_heads, D = p->head_dim, nq = p->nq, G = p->prm.group;
    const int64_t sc1 = p->axis == KV_KIVI_KEYS ? nq / G : nq;
    const int64_t sc2 = p->axis == KV_KIVI_KEYS ? D : D / kv_kivi_vgroup((int)G, (int)D);
    const int64_t codes[3] = {H, nq, (int64_t)kv_kivi_row_bytes((int)D, p->prm.bits)};
    const int64_t sz[3] = {H, sc1, sc2};
    const int64_t rs[3] = {H, p->T - nq, D};
    kv_status st;
    if ((st = add_encoding(w, layer, which, KV_ENC_KIVI)) ||
        (st = add_meta_int(w, layer, which, "bits", p->prm.bits)) ||
        (st = add_meta_int(w, layer, which, "group", p->prm.group)) ||
        (st = add_meta_int(w, layer, which, "residual", p->prm.residual)) ||
        (st = add_part(w, layer, which, "codes", KV_DT_U8, 3, codes, p->codes)) ||
        (st = add_part(w, layer, which, "scale", KV_DT_F16, 3, sz, p->scale)) ||
        (st = add_part(w, layer, which, "zero", KV_DT_F16, 3, sz, p->zero)) ||
        (st = add_part(w, layer, which, "resid", KV_DT_F16, 3, rs, p->resid)))
        return st;
    return KV_OK;
}

kv_status kv_dsq_write(kvc_writer *w, int layer, char which, const kv_dsq_packed *p)
{
    const int64_t H = p->n_kv_heads, D = p->head_dim, nw = p->nw, W = p->prm.window;
    const int64_t S = p->prm.salient;
    const int64_t gd = kv_kivi_vgroup(p->prm.group, (int)D);
    const int64_t mask[3] = {H, nw, W / 8}, sal[4] = {H, nw, S, D}, hd[3] = {H, nw, D};
    const int64_t codes[4] = {H, nw, W - S, (int64_t)kv_kivi_row_bytes((int)D, p->prm.bits)};
    const int64_t sz[4] = {H, nw, W - S, D / gd}, rs[3] = {H, p->T - nw * W, D};
    kv_status st;
    if ((st = add_encoding(w, layer, which, KV_ENC_DSQ)) ||
        (st = add_meta_int(w, layer, which, "window", p->prm.window)) ||
        (st = add_meta_int(w, layer, which, "salient", p->prm.salient)) ||
        (st = add_meta_int(w, layer, which, "bits", p->prm.bits)) ||
        (st = add_meta_int(w, layer, which, "group", p->prm.group)) ||
        (st = add_part(w, layer, which, "mask", KV_DT_U8, 3, mask, p->mask)) ||
        (st = add_part(w, layer, which, "sal", KV_DT_I8, 4, sal, p->sal)) ||
        (st = add_part(w, layer, which, "sscale", KV_DT_F16, 3, hd, p->sscale)) ||
        (p->base && (st = add_part(w, layer, which, "base", KV_DT_F16, 3, hd, p->base))) ||
        (st = add_part(w, layer, which, "codes", KV_DT_U8, 4, codes, p->codes)) ||
        (st = add_part(w, layer, which, "scale", KV_DT_F16, 4, sz, p->scale)) ||
        (st = add_part(w, layer, which, "zero", KV_DT_F16, 4, sz, p->zero)) ||
        (st = add_part(w, layer, which, "resid", KV_DT_F16, 3, rs, p->resid)))
        return st;
    return KV_OK;
}

static const char *layer_meta(const kvc_file *f, int layer, char which, const char *key)
{
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c.%s", layer, which, key);
    return kvc_meta(f, name);
}

static kv_status meta_int(const kvc_file *f, int layer, char which, const char *key, int lo,
                          int hi, int *out)
{
    const char *s = layer_meta(f, layer, which, key);
    if (!s) return kv_fail(KV_E_DATA, "layers.%d.%c: metadata %s missing", layer, which, key);
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > hi)
        return kv_fail(KV_E_DATA, "layers.%d.%c.%s: \"%s\" is not an integer in %d..%d", layer,
                       which, key, s, lo, hi);
    *out = (int)v;
    return KV_OK;
}

kv_status kv_layer_encoding(const kvc_file *f, int layer, char which, kv_encoding *enc)
{
    const char *e = layer_meta(f, layer, which, "encoding");
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c", layer, which);
    if (!e || !strcmp(e, "plain") || !strcmp(e, "f16") || !strcmp(e, "bf16") || !strcmp(e, "f32")) {
        if (!kvc_find(f, name)) return kv_fail(KV_E_DATA, "tensor %s missing", name);
        *enc = KV_ENC_PLAIN;
    } else if (!strcmp(e, "kivi")) {
        *enc = KV_ENC_KIVI;
    } else if (!strcmp(e, "dsq")) {
        *enc = KV_ENC_DSQ;
    } else {
        return kv_fail(KV_E_DATA, "%s: unknown encoding \"%s\"", name, e);
    }
    return KV_OK;
}

/* Copy part `part` after checking its dtype and shape. */
static kv_status get_part(const kvc_file *f, int layer, char which, const char *part,
                          kv_dtype dt, int ndim, const int64_t *shape, void *dst)
{
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c.%s", layer, which, part);
    const kvc_tensor *t = kvc_find(f, name);
    if (!t) return kv_fail(KV_E_DATA, "tensor %s missing", name);
    if (t->dtype != dt)
        return kv_fail(KV_E_DATA, "tensor %s: dtype %s, expected %s", name, kv_dtype_name(t->dtype),
                       kv_dtype_name(dt));
    bool same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (!same) {
        char want[96] = "", *w = want;
        for (int i = 0; i < ndim; i++)
            w += snprintf(w, sizeof want - (size_t)(w - want), "%s%lld", i ? ", " : "[",
                          (long long)shape[i]);
        return kv_fail(KV_E_DATA, "tensor %s: shape does not match its encoding (expected %s])",
                       name, want);
    }
    uint64_t n = kv_dtype_size(dt);
    for (int i = 0; i < ndim; i++) n *= (uint64_t)shape[i];
    if (t->nbytes != n) return kv_fail(KV_E_DATA, "tensor %s: %llu bytes, expected %llu", name,
                                       (unsigned long long)t->nbytes, (unsigned long long)n);
    if (n) memcpy(dst, t->data, n);
    return KV_OK;
}

static kv_status file_geom(const kvc_file *f, int *H, int *T, int *D)
{
    const kv_geom *g = kvc_geom(f);
    *H = g->n_kv_heads;
    *T = g->n_tokens;
    *D = g->head_dim;
    if (*H < 1 || *T < 0 || *D < 1 || *D > KV_QUANT_MAX_DIM)
        return kv_fail(KV_E_DATA, "geometry %d KV heads x %d tokens x head dim %d unsupported", *H,
                       *T, *D);
    return KV_OK;
}

kv_status kv_kivi_read(const kvc_file *f, int layer, char which, kv_kivi_packed *p)
{
    memset(p, 0, sizeof *p);
    int H, T, D;
    kv_kivi_params prm;
    kv_status st;
    if ((st = file_geom(f, &H, &T, &D)) ||
        (st = meta_int(f, layer, which, "bits", 1, 4, &prm.bits)) ||
        (st = meta_int(f, layer, which, "group", 1, 65536, &prm.group)) ||
        (st = meta_int(f, layer, which, "residual", 0, 1 << 30, &prm.residual)))
        return st;
    kv_kivi_axis axis = which == 'k' ? KV_KIVI_KEYS : KV_KIVI_VALUES;
    if ((st = kv_kivi_check(&prm, D))) {
        kv_errcontext("layers.%d.%c", layer, which);
        return kv_fail(KV_E_DATA, "%s", kv_errdetail());
    }
    if ((st = kv_kivi_alloc(p, axis, &prm, H, T, D))) return st;
    const int64_t nq = p->nq, G = prm.group;
    const int64_t codes[3] = {H, nq, (int64_t)kv_kivi_row_bytes(D, prm.bits)};
    const int64_t sz[3] = {H, axis == KV_KIVI_KEYS ? nq / G : nq,
                           axis == KV_KIVI_KEYS ? D : D / kv_kivi_vgroup((int)G, D)};
    const int64_t rs[3] = {H, T - nq, D};
    if ((st = get_part(f, layer, which, "codes", KV_DT_U8, 3, codes, p->codes)) ||
        (st = get_part(f, layer, which, "scale", KV_DT_F16, 3, sz, p->scale)) ||
        (st = get_part(f, layer, which, "zero", KV_DT_F16, 3, sz, p->zero)) ||
        (st = get_part(f, layer, which, "resid", KV_DT_F16, 3, rs, p->resid))) {
        kv_kivi_free(p);
        return st;
    }
    return KV_OK;
}

kv_status kv_dsq_read(const kvc_file *f, int layer, char which, kv_dsq_packed *p)
{
    memset(p, 0, sizeof *p);
    int H, T, D;
    kv_dsq_params prm;
    kv_status st;
    if ((st = file_geom(f, &H, &T, &D)) ||
        (st = meta_int(f, layer, which, "window", 8, 4096, &prm.window)) ||
        (st = meta_int(f, layer, which, "salient", 0, 4096, &prm.salient)) ||
        (st = meta_int(f, layer, which, "bits", 1, 4, &prm.bits)) ||
        (st = meta_int(f, layer, which, "group", 1, 65536, &prm.group)))
        return st;
    kv_kivi_axis axis = which == 'k' ? KV_KIVI_KEYS : KV_KIVI_VALUES;
    if ((st = kv_dsq_check(&prm, D))) {
        kv_errcontext("layers.%d.%c", layer, which);
        return kv_fail(KV_E_DATA, "%s", kv_errdetail());
    }
    if ((st = kv_dsq_alloc(p, axis, &prm, H, T, D))) return st;
    const int64_t nw = p->nw, W = prm.window, S = prm.salient;
    const int64_t gd = kv_kivi_vgroup(prm.group, D);
    const int64_t mask[3] = {H, nw, W / 8}, sal[4] = {H, nw, S, D}, hd[3] = {H, nw, D};
    const int64_t codes[4] = {H, nw, W - S, (int64_t)kv_kivi_row_bytes(D, prm.bits)};
    const int64_t sz[4] = {H, nw, W - S, D / gd}, rs[3] = {H, T - nw * W, D};
    if ((st = get_part(f, layer, which, "mask", KV_DT_U8, 3, mask, p->mask)) ||
        (st = get_part(f, layer, which, "sal", KV_DT_I8, 4, sal, p->sal)) ||
        (st = get_part(f, layer, which, "sscale", KV_DT_F16, 3, hd, p->sscale)) ||
        (p->base && (st = get_part(f, layer, which, "base", KV_DT_F16, 3, hd, p->base))) ||
        (st = get_part(f, layer, which, "codes", KV_DT_U8, 4, codes, p->codes)) ||
        (st = get_part(f, layer, which, "scale", KV_DT_F16, 4, sz, p->scale)) ||
        (st = get_part(f, layer, which, "zero", KV_DT_F16, 4, sz, p->zero)) ||
        (st = get_part(f, layer, which, "resid", KV_DT_F16, 3, rs, p->resid))) {
        kv_dsq_free(p);
        return st;
    }
    /* a mask with the wrong number of salient tokens would misplace rows */
    for (int64_t i = 0; i < H * nw; i++) {
        int n = 0;
        for (int t = 0; t < W; t++) n += kv_dsq_mask_get(p->mask + i * (W / 8), t);
        if (n != S) {
            kv_dsq_free(p);
            return kv_fail(KV_E_DATA, "layers.%d.%c.mask: window %lld marks %d salient tokens, not %lld",
                           layer, which, (long long)i, n, (long long)S);
        }
    }
    return KV_OK;
}

kv_status kv_layer_decode(const kvc_file *f, int layer, char which, float *out)
{
    kv_encoding enc;
    kv_status st = kv_layer_encoding(f, layer, which, &enc);
    if (st) return st;
    if (enc == KV_ENC_KIVI) {
        kv_kivi_packed p;
        if ((st = kv_kivi_read(f, layer, which, &p))) return st;
        kv_kivi_unpack(&p, out);
        kv_kivi_free(&p);
        return KV_OK;
    }
    if (enc == KV_ENC_DSQ) {
        kv_dsq_packed p;
        if ((st = kv_dsq_read(f, layer, which, &p))) return st;
        kv_dsq_unpack(&p, out);
        kv_dsq_free(&p);
        return KV_OK;
    }
    int H, T, D;
    if ((st = file_geom(f, &H, &T, &D))) return st;
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c", layer, which);
    const kvc_tensor *t = kvc_find(f, name);
    if (t->ndim != 3 || t->shape[0] != H || t->shape[1] != T || t->shape[2] != D)
        return kv_fail(KV_E_DATA, "tensor %s: shape is not [%d, %d, %d]", name, H, T, D);
    if (t->dtype != KV_DT_F32 && t->dtype != KV_DT_F16 && t->dtype != KV_DT_BF16)
        return kv_fail(KV_E_DATA, "tensor %s: dtype %s is not F32, F16 or BF16", name,
                       kv_dtype_name(t->dtype));
    return kvc_tensor_to_f32(t, out);
}

uint64_t kv_layer_bytes(const kvc_file *f, int layer, char which)
{
    char pre[KVC_NAME_MAX];
    int n = snprintf(pre, sizeof pre, "layers.%d.%c", layer, which);
    uint64_t b = 0;
    for (int i = 0; i < kvc_n_tensors(f); i++) {
        const kvc_tensor *t = kvc_tensor_at(f, i);
        if (!strncmp(t->name, pre, (size_t)n) && (t->name[n] == 0 || t->name[n] == '.'))
            b += t->nbytes;
    }
    return b;
}

// --- transcoding a whole file ----------------------------------------------------

static double clock_seconds(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Wall and CPU (all threads) seconds, so that throughput per core can be
 * told apart from a busy machine's wall time. */
typedef struct {
    double wall, cpu;
} stamp;

static stamp stamp_now(void)
{
    return (stamp){clock_seconds(CLOCK_MONOTONIC), clock_seconds(CLOCK_PROCESS_CPUTIME_ID)};
}

static void stamp_add(kv_quant_report *r, stamp t0)
{
    stamp t1 = stamp_now();
    r->pack_seconds += t1.wall - t0.wall;
    r->pack_cpu_seconds += t1.cpu - t0.cpu;
}

/* Layer of a "layers.{i}.k..." / "layers.{i}.v..." name (i in canonical
 * decimal, as kvc.c spells layer numbers), or -1. */
static int kv_name_layer(const char *name)
{
    if (strncmp(name, "layers.", 7)) return -1;
    const char *p = name + 7;
    if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] >= '0' && p[1] <= '9')) return -1;
    long layer = 0;
    while (*p >= '0' && *p <= '9' && layer <= 1000000) layer = layer * 10 + (*p++ - '0');
    if (layer > 1000000 || p[0] != '.' || (p[1] != 'k' && p[1] != 'v')) return -1;
    return p[2] == 0 || p[2] == '.' ? (int)layer : -1;
}

void kv_quant_report_free(kv_quant_report *r)
{
    if (!r) return;
    free(r->enc_k);
    free(r->enc_v);
    free(r->k_mse);
    free(r->k_max);
    free(r->v_mse);
    free(r->v_max);
    free(r->attn_err);
    memset(r, 0, sizeof *r);
}

static void diff_stats(const float *a, const float *b, size_t n, double *mse, double *mx)
{
    double s = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        s += d * d;
        m = d > m ? d : m;
    }
    *mse = n ? s / (double)n : 0;
    *mx = m;
}

/* Re-encode one layer part x (H, T, D): add it to w, decode the result into y. */
static kv_status encode_part(kvc_writer *w, int l, char which, const float *x, const float *imp,
                             const kv_quant_opts *o, const kv_geom *g, float *y, uint64_t *bytes,
                             kv_encoding *enc, kv_quant_report *rep)
{
    const int H = g->n_kv_heads, T = g->n_tokens, D = g->head_dim;
    const size_t n = (size_t)H * T * D;
    kv_kivi_axis axis = which == 'k' ? KV_KIVI_KEYS : KV_KIVI_VALUES;
    kv_status st;
    stamp t0 = stamp_now();
    if (o->decode) {
        kv_half *h = malloc((n + 1) * sizeof *h);
        if (!h) return kv_fail(KV_E_NOMEM, "layer %d: F16 buffer", l);
        for (size_t i = 0; i < n; i++) {
            h[i] = kv_f32_to_half(x[i]);
            y[i] = kv_half_to_f32(h[i]);
        }
        char name[KVC_NAME_MAX];
        const int64_t shape[3] = {H, T, D};
        snprintf(name, sizeof name, "layers.%d.%c", l, which);
        st = kvc_writer_add_copy(w, name, KV_DT_F16, 3, shape, h);
        free(h);
        snprintf(name, sizeof name, "layers.%d.%c.encoding", l, which);
        if (!st) st = kvc_writer_meta(w, name, "f16");
        *bytes = 2 * n;
        *enc = KV_ENC_PLAIN;
    } else if (o->method == KV_ENC_DSQ) {
        kv_dsq_packed p;
        if ((st = kv_dsq_pack(x, imp, axis, &o->dsq, H, T, D, &p))) return st;
        stamp_add(rep, t0);
        kv_dsq_unpack(&p, y);
        st = kv_dsq_write(w, l, which, &p);
        kv_dsq_free(&p);
        *bytes = kv_dsq_bytes(axis, &o->dsq, H, T, D);
        *enc = KV_ENC_DSQ;
        return st;
    } else {
        kv_kivi_packed p;
        if ((st = kv_kivi_pack(x, axis, &o->kivi, H, T, D, &p))) return st;
        stamp_add(rep, t0);
        kv_kivi_unpack(&p, y);
        st = kv_kivi_write(w, l, which, &p);
        kv_kivi_free(&p);
        *bytes = kv_kivi_bytes(axis, &o->kivi, H, T, D);
        *enc = KV_ENC_KIVI;
        return st;
    }
    stamp_add(rep, t0);
    return st;
}

static kv_status report_alloc(kv_quant_report *r, int L)
{
    memset(r, 0, sizeof *r);
    r->n_layers = L;
    size_t n = (size_t)L + 1;
    r->enc_k = calloc(n, sizeof *r->enc_k);
    r->enc_v = calloc(n, sizeof *r->enc_v);
    r->k_mse = calloc(n, sizeof(double));
    r->k_max = calloc(n, sizeof(double));
    r->v_mse = calloc(n, sizeof(double));
    r->v_max = calloc(n, sizeof(double));
    r->attn_err = calloc(n, sizeof(double));
    if (!r->enc_k || !r->enc_v || !r->k_mse || !r->k_max || !r->v_mse || !r->v_max || !r->attn_err)
        return kv_fail(KV_E_NOMEM, "report");
    return KV_OK;
}

kv_status kv_quant_file(const kvc_file *in, const kv_quant_opts *o, kvc_writer *w,
                        kv_quant_report *rep)
{
    const kv_geom *g = kvc_geom(in);
    const int L = g->n_layers, H = g->n_kv_heads, T = g->n_tokens, D = g->head_dim;
    const int NH = g->n_heads, nq = g->n_q;
    kv_status st = KV_OK;
    kv_quant_report local;
    if (!rep) rep = &local;
    if ((st = report_alloc(rep, L))) goto out_rep;
    if (!o->decode) {
        st = o->method == KV_ENC_DSQ ? kv_dsq_check(&o->dsq, D) : kv_kivi_check(&o->kivi, D);
        if (st) goto out_rep;
    }
    bool *sel = calloc((size_t)L + 1, sizeof *sel);
    if (!sel) {
        st = kv_fail(KV_E_NOMEM, "layer table");
        goto out_rep;
    }
    for (int l = 0; l < L; l++) sel[l] = o->decode || !o->layers || o->layers[l];

    /* metadata and tensors of layers left alone, borrowed from the input */
    for (int i = 0; i < kvc_n_meta(in) && !st; i++) {
        const char *key, *val;
        kvc_meta_at(in, i, &key, &val);
        int l = kv_name_layer(key);
        if (l >= 0 && l < L && sel[l]) continue;
        st = kvc_writer_meta(w, key, val);
    }
    if (!st) st = kvc_writer_geom(w, g);
    for (int i = 0; i < kvc_n_tensors(in) && !st; i++) {
        const kvc_tensor *t = kvc_tensor_at(in, i);
        int l = kv_name_layer(t->name);
        if (l >= 0 && l < L && sel[l]) continue;
        st = kvc_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data);
    }
    const size_t n = (size_t)H * T * D;
    float *k = malloc((n + 1) * sizeof *k), *v = malloc((n + 1) * sizeof *v);
    float *k2 = malloc((n + 1) * sizeof *k2), *v2 = malloc((n + 1) * sizeof *v2);
    float *imp = malloc(((size_t)H * T + 1) * sizeof *imp);
    float *q = nq > 0 && NH > 0 ? malloc((size_t)NH * nq * D * sizeof *q) : NULL;
    if (!st && (!k || !v || !k2 || !v2 || !imp || (nq > 0 && NH > 0 && !q)))
        st = kv_fail(KV_E_NOMEM, "buffers for a layer of %d tokens", T);
    for (int l = 0; l < L && !st; l++) {
        uint64_t bk = kv_layer_bytes(in, l, 'k'), bv = kv_layer_bytes(in, l, 'v');
        rep->kv_bytes_in += bk + bv;
        rep->f16_bytes += 4 * n;
        if (!sel[l]) {
            rep->kv_bytes_out += bk + bv;
            kv_layer_encoding(in, l, 'k', &rep->enc_k[l]);
            kv_layer_encoding(in, l, 'v', &rep->enc_v[l]);
            continue;
        }
        if ((st = kv_layer_decode(in, l, 'k', k)) || (st = kv_layer_decode(in, l, 'v', v))) break;
        bool have_q = false;
        const kvc_tensor *qt = q ? kvc_layer(in, l, "q") : NULL;
        if (qt && qt->ndim == 3 && qt->shape[0] == NH && qt->shape[1] == nq && qt->shape[2] == D &&
            NH % H == 0 && nq <= T)
            have_q = kvc_tensor_to_f32(qt, q) == KV_OK;
        const float *ip = NULL;
        if (!o->decode && o->method == KV_ENC_DSQ && have_q) {
            if ((st = kv_dsq_importance(q, NH, nq, k, H, T, D, imp))) break;
            ip = imp;
        }
        uint64_t ok_bytes = 0, ov_bytes = 0;
        if ((st = encode_part(w, l, 'k', k, ip, o, g, k2, &ok_bytes, &rep->enc_k[l], rep)) ||
            (st = encode_part(w, l, 'v', v, ip, o, g, v2, &ov_bytes, &rep->enc_v[l], rep))) {
            kv_errcontext("layer %d", l);
            break;
        }
        rep->kv_bytes_out += ok_bytes + ov_bytes;
        diff_stats(k, k2, n, &rep->k_mse[l], &rep->k_max[l]);
        diff_stats(v, v2, n, &rep->v_mse[l], &rep->v_max[l]);
        rep->attn_err[l] = have_q ? kv_attn_rel_error(q, NH, nq, k, v, k2, v2, H, T, D, NULL) : NAN;
    }
    free(q);
    free(imp);
    free(v2);
    free(k2);
    free(v);
    free(k);
    free(sel);
out_rep:
    if (rep == &local) kv_quant_report_free(&local);
    return st;
}

void kv_quant_report_json(const kv_quant_report *r, const kv_quant_opts *o, FILE *f)
{
    fprintf(f, "{\n  \"method\": \"%s\",\n", o->decode ? "decode" : kv_encoding_name(o->method));
    if (!o->decode && o->method == KV_ENC_KIVI)
        fprintf(f, "  \"bits\": %d,\n  \"group\": %d,\n  \"residual\": %d,\n", o->kivi.bits,
                o->kivi.group, o->kivi.residual);
    else if (!o->decode)
        fprintf(f, "  \"window\": %d,\n  \"salient\": %d,\n  \"bits\": %d,\n  \"group\": %d,\n",
                o->dsq.window, o->dsq.salient, o->dsq.bits, o->dsq.group);
    fprintf(f, "  \"bytes_before\": %llu,\n  \"bytes_after\": %llu,\n  \"bytes_f16\": %llu,\n",
            (unsigned long long)r->kv_bytes_in, (unsigned long long)r->kv_bytes_out,
            (unsigned long long)r->f16_bytes);
    fputs("  \"ratio\": ", f);
    kv_json_number(f, r->kv_bytes_out ? (double)r->kv_bytes_in / (double)r->kv_bytes_out : NAN);
    fputs(",\n  \"ratio_vs_f16\": ", f);
    kv_json_number(f, r->kv_bytes_out ? (double)r->f16_bytes / (double)r->kv_bytes_out : NAN);
    fputs(",\n  \"pack_seconds\": ", f);
    kv_json_number(f, r->pack_seconds);
    fputs(",\n  \"pack_cpu_seconds\": ", f);
    kv_json_number(f, r->pack_cpu_seconds);
    fputs(",\n  \"layers\": [\n", f);
    for (int l = 0; l < r->n_layers; l++) {
        fprintf(f, "    {\"layer\": %d, \"k_encoding\": \"%s\", \"v_encoding\": \"%s\", \"k_mse\": ",
                l, kv_encoding_name(r->enc_k[l]), kv_encoding_name(r->enc_v[l]));
        kv_json_number(f, r->k_mse[l]);
        fputs(", \"k_max_err\": ", f);
        kv_json_number(f, r->k_max[l]);
        fputs(", \"v_mse\": ", f);
        kv_json_number(f, r->v_mse[l]);
        fputs(", \"v_max_err\": ", f);
        kv_json_number(f, r->v_max[l]);
        fputs(", \"attn_rel_err\": ", f);
        kv_json_number(f, r->attn_err[l]);
        fprintf(f, "}%s\n", l + 1 < r->n_layers ? "," : "");
    }
    fputs("  ]\n}\n", f);
}
