/*
 * DSQ packing (layout in lib/common/kv_layout.h) and HCAP decisions.  Non-salient
 * rows reuse the KIVI value-row quantizer, so the same rounding rules hold
 * and one numpy re-implementation checks both (tests/interop).
 */
#include "quant/kv_dsq.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "quant/kv_quant.h"

void kv_dsq_params_default(kv_dsq_params *p)
{
    p->window = KV_DSQ_DEFAULT_WINDOW;
    p->salient = kv_dsq_salient_count(KV_DSQ_DEFAULT_WINDOW, KV_DSQ_DEFAULT_SALIENT_FRAC);
    p->bits = KV_DSQ_DEFAULT_BITS;
    p->group = KV_DSQ_DEFAULT_GROUP;
    p->base = KV_DSQ_DEFAULT_BASE;
}

const char *kv_dsq_base_name(int base)
{
    return base == KV_DSQ_BASE_REST ? "rest" : base == KV_DSQ_BASE_SALIENT ? "salient" : "?";
}

kv_status kv_dsq_base_parse(const char *s, int *out)
{
    if (!strcmp(s, "salient")) *out = KV_DSQ_BASE_SALIENT;
    else if (!strcmp(s, "rest")) *out = KV_DSQ_BASE_REST;
    else return kv_fail(KV_E_USAGE, "DSQ key base: '%s' (salient or rest)", s);
    return KV_OK;
}

int kv_dsq_salient_count(int window, double frac)
{
    if (!(frac > 0)) return 0;
    double s = floor(frac * window + 0.5);
    return s > window ? window : (int)s;
}

kv_status kv_dsq_check(const kv_dsq_params *p, int head_dim)
{
    if (p->window < 8 || p->window > 4096 || p->window % 8)
        return kv_fail(KV_E_USAGE, "DSQ window must be a multiple of 8 in 8..4096, not %d", p->window);
    if (p->salient < 0 || p->salient > p->window)
        return kv_fail(KV_E_USAGE, "DSQ salient count %d outside 0..%d", p->salient, p->window);
    if (p->base != KV_DSQ_BASE_SALIENT && p->base != KV_DSQ_BASE_REST)
        return kv_fail(KV_E_USAGE, "DSQ key base %d is not salient (0) or rest (1)", p->base);
    /* the rows' codes are KIVI's: its check covers the head dim; bits and
     * group first with DSQ's own names */
    if (p->bits != 1 && p->bits != 2 && p->bits != 4)
        return kv_fail(KV_E_USAGE, "DSQ bits must be 1, 2 or 4, not %d", p->bits);
    if (p->group < 1 || p->group > 65536)
        return kv_fail(KV_E_USAGE, "DSQ group must be 1..65536, not %d", p->group);
    kv_kivi_params k = {p->bits, p->group, 0};
    return kv_kivi_check(&k, head_dim);
}

static inline float imp_of(const float *imp, int t)
{
    return isnan(imp[t]) ? -INFINITY : imp[t];
}

void kv_dsq_select(const float *imp, int W, int S, uint8_t *mask)
{
    /* The S largest, NaN counted as -inf, the earlier of equal values
     * first (the documented tie rule).  One pass in token order keeps the
     * best so far sorted, best first: a later token enters only when
     * strictly larger than the last kept, and goes after every kept value
     * it does not exceed, so equal values stay in token order.  Same set as
     * S passes of "largest not yet taken", at about W compares instead of
     * W*S (it was ~10% of the packing time). */
    float kv[4096];
    int kt[4096];
    int n = 0;
    memset(mask, 0, (size_t)W / 8);
    if (S <= 0) return;
    for (int t = 0; t < W; t++) {
        float v = imp_of(imp, t);
        if (n == S && !(v > kv[n - 1])) continue;
        int i = n < S ? n++ : n - 1;
        for (; i > 0 && v > kv[i - 1]; i--) {
            kv[i] = kv[i - 1];
            kt[i] = kt[i - 1];
        }
        kv[i] = v;
        kt[i] = t;
    }
    for (int i = 0; i < n; i++) mask[kt[i] >> 3] |= (uint8_t)(1u << (kt[i] & 7));
}

// --- one window -------------------------------------------------------------

/* Bits of n codes, least significant first; the same word tricks as
 * kv_quant.c's pack_bits, which is private to that file. */
static inline void dsq_pack_bits(const uint8_t *q, int n, int bits, uint8_t *out)
{
    if (bits == 1) {
        for (int j = 0; j < n / 8; j++) {
            uint64_t v;
            memcpy(&v, q + 8 * j, 8);
            out[j] = (uint8_t)((v * 0x0102040810204080ull) >> 56);
        }
    } else if (bits == 2) {
#pragma omp simd
        for (int j = 0; j < n / 4; j++) {
            uint32_t v;
            memcpy(&v, q + 4 * j, 4);
            out[j] = (uint8_t)(v | v >> 6 | v >> 12 | v >> 18);
        }
    } else {
#pragma omp simd
        for (int j = 0; j < n / 2; j++) {
            uint16_t v;
            memcpy(&v, q + 2 * j, 2);
            out[j] = (uint8_t)(v | v >> 4);
        }
    }
}

/* kv_kivi_pack_value_row, byte for byte, without its per-element divisor
 * and zero arrays and with the group extremes taken 8 lanes at a time
 * (gcc leaves the library's reduction scalar).  Lane order can change
 * which of two equal values is the extreme, which matters only for -0 vs
 * +0 or NaN: a row with a NaN or with a zero extreme goes to the library
 * routine, so the bytes never differ. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void dsq_pack_row(const float *x, int D, int gd, int bits, uint8_t *codes,
                         kv_half *scale, kv_half *zero)
{
    const float maxq = (float)((1 << bits) - 1);
    float mn[KV_QUANT_MAX_DIM], mx[KV_QUANT_MAX_DIM];
    uint8_t q[KV_QUANT_MAX_DIM];
    const int ng = D / gd;
    int nan = 0;
    if (gd % 8) goto slow;
    for (int g = 0; g < ng; g++) {
        const float *r = x + (size_t)g * gd;
        float lo[8], hi[8];
        int bad[8];
        for (int l = 0; l < 8; l++) {
            lo[l] = hi[l] = r[l];
            bad[l] = 0;
        }
        for (int c = 0; c < gd; c += 8)
#pragma omp simd
            for (int l = 0; l < 8; l++) {
                float v = r[c + l];
                lo[l] = v < lo[l] ? v : lo[l];
                hi[l] = v > hi[l] ? v : hi[l];
                bad[l] |= v != v;
            }
        float a = lo[0], b = hi[0];
        for (int l = 0; l < 8; l++) {
            a = lo[l] < a ? lo[l] : a;
            b = hi[l] > b ? hi[l] : b;
            nan |= bad[l];
        }
        if (nan || a == 0.0f || b == 0.0f) goto slow;
        mn[g] = a;
        mx[g] = b;
    }
    for (int g = 0; g < ng; g++) {
        /* the library's group_params */
        scale[g] = kv_f32_to_half((mx[g] - mn[g]) / maxq);
        zero[g] = kv_f32_to_half(mn[g]);
        float s = kv_half_to_f32(scale[g]);
        const float sd = (s > 0.0f && s < INFINITY) ? s : INFINITY;
        const float z = kv_half_to_f32(zero[g]);
        const float *r = x + (size_t)g * gd;
        uint8_t *o = q + (size_t)g * gd;
#pragma omp simd
        for (int c = 0; c < gd; c++) {
            float v = rintf((r[c] - z) / sd);
            v = v > 0.0f ? v : 0.0f;
            v = v < maxq ? v : maxq;
            o[c] = (uint8_t)(int)v;
        }
    }
    dsq_pack_bits(q, D, bits, codes);
    return;
slow:
    kv_kivi_pack_value_row(x, D, gd, bits, codes, scale, zero);
}

/* Built twice, SSE4.2 (the Makefile's x86-64-v2) and AVX2, the loader
 * picking one by CPU: the loops are the same IEEE operations (no FMA, and
 * -std=c11 keeps gcc from contracting), so both give the same bytes, and
 * 8-float vectors nearly halve the divide and round work. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void kv_dsq_pack_window(const float *x, size_t ld, kv_kivi_axis axis, const kv_dsq_params *p,
                        int D, const uint8_t *mask, int8_t *sal, kv_half *sscale, kv_half *base,
                        uint8_t *codes, kv_half *scale, kv_half *zero)
{
    const int W = p->window, S = p->salient;
    const int gd = kv_kivi_vgroup(p->group, D);
    const size_t rb = kv_kivi_row_bytes(D, p->bits);
    float amax[KV_QUANT_MAX_DIM], sdiv[KV_QUANT_MAX_DIM], bf[KV_QUANT_MAX_DIM];
    double sum[KV_QUANT_MAX_DIM];
    float d[KV_QUANT_MAX_DIM];

    /* The salient pass below reads S scattered rows first, which the
     * hardware prefetcher cannot follow: one cache-miss stall per row was
     * ~45% of this function.  Asking for the whole window up front (it is
     * 32 KiB at W 64, D 128) overlaps those misses. */
    for (int t = 0; t < W; t++)
        for (int c = 0; c < D; c += 16) __builtin_prefetch(x + (size_t)t * ld + c, 0, 3);
    for (int c = 0; c < D; c++) {
        amax[c] = 0;
        sum[c] = 0;
    }
    for (int t = 0; t < W; t++) {
        if (!kv_dsq_mask_get(mask, t)) continue;
        const float *r = x + (size_t)t * ld;
#pragma omp simd
        for (int c = 0; c < D; c++) {
            float a = fabsf(r[c]);
            amax[c] = a > amax[c] ? a : amax[c];
            sum[c] += r[c];
        }
    }
    for (int c = 0; c < D; c++) {
        sscale[c] = kv_f32_to_half(amax[c] / 127.0f);
        float s = kv_half_to_f32(sscale[c]);
        sdiv[c] = (s > 0.0f && s < INFINITY) ? s : INFINITY;
    }
    if (axis == KV_KIVI_KEYS) {
        /* the mean of the salient keys (summed above) or of the others, in
         * token order; of every key when the chosen set is empty */
        const bool rest = p->base == KV_DSQ_BASE_REST && S < W;
        int nb = rest ? W - S : S;
        if (rest || S == 0) {
            for (int c = 0; c < D; c++) sum[c] = 0;
            for (int t = 0; t < W; t++) {
                if (rest && kv_dsq_mask_get(mask, t)) continue;
                const float *r = x + (size_t)t * ld;
                for (int c = 0; c < D; c++) sum[c] += r[c];
            }
            if (!rest) nb = W;
        }
        for (int c = 0; c < D; c++) {
            base[c] = kv_f32_to_half((float)(sum[c] / nb));
            bf[c] = kv_half_to_f32(base[c]);
        }
    }
    int is = 0, in = 0;
    for (int t = 0; t < W; t++) {
        const float *r = x + (size_t)t * ld;
        if (kv_dsq_mask_get(mask, t)) {
            int8_t *o = sal + (size_t)is++ * D;
#pragma omp simd
            for (int c = 0; c < D; c++) {
                float v = rintf(r[c] / sdiv[c]);
                v = v > -127.0f ? v : -127.0f;
                v = v < 127.0f ? v : 127.0f;
                o[c] = (int8_t)(int)v;
            }
        } else {
            const float *src = r;
            if (axis == KV_KIVI_KEYS) {
#pragma omp simd
                for (int c = 0; c < D; c++) d[c] = r[c] - bf[c];
                src = d;
            }
            size_t so = (size_t)in * (D / gd);
            dsq_pack_row(src, D, gd, p->bits, codes + (size_t)in * rb, scale + so, zero + so);
            in++;
        }
    }
}

void kv_dsq_unpack_window(kv_kivi_axis axis, const kv_dsq_params *p, int D, const uint8_t *mask,
                          const int8_t *sal, const kv_half *sscale, const kv_half *base,
                          const uint8_t *codes, const kv_half *scale, const kv_half *zero,
                          float *out)
{
    const int W = p->window;
    const int gd = kv_kivi_vgroup(p->group, D);
    const size_t rb = kv_kivi_row_bytes(D, p->bits);
    int is = 0, in = 0;
    for (int t = 0; t < W; t++) {
        float *o = out + (size_t)t * D;
        if (kv_dsq_mask_get(mask, t)) {
            const int8_t *r = sal + (size_t)is++ * D;
            for (int c = 0; c < D; c++) o[c] = kv_half_to_f32(sscale[c]) * (float)r[c];
        } else {
            size_t so = (size_t)in * (D / gd);
            kv_kivi_dequant_row(codes + (size_t)in * rb, scale + so, zero + so, D, p->bits, gd, o);
            in++;
            if (axis == KV_KIVI_KEYS)
                for (int c = 0; c < D; c++) o[c] = kv_half_to_f32(base[c]) + o[c];
        }
    }
}

// --- a whole layer ----------------------------------------------------------------

void kv_dsq_part_sizes(kv_kivi_axis axis, const kv_dsq_params *p, int H, int T, int D,
                       kv_dsq_sizes *s)
{
    size_t nw = (size_t)kv_dsq_nwindows(T, p->window);
    size_t hw = (size_t)H * nw, ns = (size_t)p->salient, nn = (size_t)(p->window - p->salient);
    int gd = kv_kivi_vgroup(p->group, D);
    s->mask = hw * (size_t)(p->window / 8);
    s->sal = hw * ns * (size_t)D;
    s->sscale = hw * (size_t)D;
    s->base = axis == KV_KIVI_KEYS ? hw * (size_t)D : 0;
    s->codes = hw * nn * kv_kivi_row_bytes(D, p->bits);
    s->scale = hw * nn * (size_t)(D / gd);
    s->resid = (size_t)H * (size_t)(T - (int)nw * p->window) * (size_t)D;
}

size_t kv_dsq_bytes(kv_kivi_axis axis, const kv_dsq_params *p, int H, int T, int D)
{
    kv_dsq_sizes s;
    kv_dsq_part_sizes(axis, p, H, T, D, &s);
    return s.mask + s.sal + s.codes + 2 * (s.sscale + s.base + 2 * s.scale + s.resid);
}

void kv_dsq_clear(kv_dsq_packed *d)
{
    if (!d) return;
    free(d->mask);
    free(d->sal);
    free(d->sscale);
    free(d->base);
    free(d->codes);
    free(d->scale);
    free(d->zero);
    free(d->resid);
    memset(d, 0, sizeof *d);
}

kv_status kv_dsq_init(kv_dsq_packed *d, kv_kivi_axis axis, const kv_dsq_params *p, int H,
                       int T, int D)
{
    memset(d, 0, sizeof *d);
    kv_status st = kv_dsq_check(p, D);
    if (st) return st;
    if (H < 1 || T < 0) return kv_fail(KV_E_USAGE, "bad DSQ geometry: %d heads, %d tokens", H, T);
    kv_dsq_sizes s;
    kv_dsq_part_sizes(axis, p, H, T, D, &s);
    d->axis = axis;
    d->prm = *p;
    d->n_kv_heads = H;
    d->T = T;
    d->head_dim = D;
    d->nw = kv_dsq_nwindows(T, p->window);
    d->mask = calloc(s.mask + 1, 1);
    d->sal = calloc(s.sal + 1, 1);
    d->sscale = malloc((s.sscale + 1) * 2);
    d->base = axis == KV_KIVI_KEYS ? malloc((s.base + 1) * 2) : NULL;
    d->codes = calloc(s.codes + 1, 1);
    d->scale = malloc((s.scale + 1) * 2);
    d->zero = malloc((s.scale + 1) * 2);
    d->resid = malloc((s.resid + 1) * 2);
    if (!d->mask || !d->sal || !d->sscale || (axis == KV_KIVI_KEYS && !d->base) || !d->codes ||
        !d->scale || !d->zero || !d->resid) {
        kv_dsq_clear(d);
        return kv_fail(KV_E_NOMEM, "DSQ buffers for %d heads x %d tokens", H, T);
    }
    return KV_OK;
}

/* Pointers to window w of head h. */
typedef struct {
    uint8_t *mask;
    int8_t *sal;
    kv_half *sscale, *base;
    uint8_t *codes;
    kv_half *scale, *zero;
} win_view;

static win_view window_at(const kv_dsq_packed *d, int h, int w)
{
    const int W = d->prm.window, S = d->prm.salient, D = d->head_dim;
    const size_t hw = (size_t)h * d->nw + (size_t)w;
    const int gd = kv_kivi_vgroup(d->prm.group, D);
    win_view v;
    v.mask = d->mask + hw * (size_t)(W / 8);
    v.sal = d->sal + hw * (size_t)S * D;
    v.sscale = d->sscale + hw * D;
    v.base = d->base ? d->base + hw * D : NULL;
    v.codes = d->codes + hw * (size_t)(W - S) * kv_kivi_row_bytes(D, d->prm.bits);
    v.scale = d->scale + hw * (size_t)(W - S) * (size_t)(D / gd);
    v.zero = d->zero + hw * (size_t)(W - S) * (size_t)(D / gd);
    return v;
}

kv_status kv_dsq_pack(const float *x, const float *imp, kv_kivi_axis axis,
                      const kv_dsq_params *p, int H, int T, int D, kv_dsq_packed *out)
{
    kv_status st = kv_dsq_init(out, axis, p, H, T, D);
    if (st) return st;
    const int W = p->window, nw = out->nw;
#pragma omp parallel for schedule(static) if ((size_t)H * T * D > 65536)
    for (long u = 0; u < (long)H * nw; u++) {
        int h = (int)(u / nw), w = (int)(u % nw);
        const float *xw = x + ((size_t)h * T + (size_t)w * W) * D;
        float nrm[4096];
        const float *iw;
        if (imp) {
            iw = imp + (size_t)h * T + (size_t)w * W;
        } else {
            for (int t = 0; t < W; t++) {
                double s2 = 0;
                for (int c = 0; c < D; c++) s2 += (double)xw[(size_t)t * D + c] * xw[(size_t)t * D + c];
                nrm[t] = (float)sqrt(s2);
            }
            iw = nrm;
        }
        win_view v = window_at(out, h, w);
        kv_dsq_select(iw, W, p->salient, v.mask);
        kv_dsq_pack_window(xw, (size_t)D, axis, p, D, v.mask, v.sal, v.sscale, v.base, v.codes,
                           v.scale, v.zero);
    }
    const int nr = T - nw * W;
    for (int h = 0; h < H; h++) {
        const float *src = x + ((size_t)h * T + (size_t)nw * W) * D;
        kv_half *dst = out->resid + (size_t)h * nr * D;
        for (size_t k = 0; k < (size_t)nr * D; k++) dst[k] = kv_f32_to_half(src[k]);
    }
    return KV_OK;
}

void kv_dsq_unpack(const kv_dsq_packed *d, float *out)
{
    const int H = d->n_kv_heads, T = d->T, D = d->head_dim, W = d->prm.window, nw = d->nw;
#pragma omp parallel for schedule(static) if ((size_t)H * T * D > 65536)
    for (long u = 0; u < (long)H * nw; u++) {
        int h = (int)(u / nw), w = (int)(u % nw);
        win_view v = window_at(d, h, w);
        kv_dsq_unpack_window(d->axis, &d->prm, D, v.mask, v.sal, v.sscale, v.base, v.codes,
                             v.scale, v.zero, out + ((size_t)h * T + (size_t)w * W) * D);
    }
    const int nr = T - nw * W;
    for (int h = 0; h < H; h++) {
        const kv_half *src = d->resid + (size_t)h * nr * D;
        float *dst = out + ((size_t)h * T + (size_t)nw * W) * D;
        for (size_t k = 0; k < (size_t)nr * D; k++) dst[k] = kv_half_to_f32(src[k]);
    }
}

kv_status kv_dsq_importance(const float *q, int n_heads, int n_q, const float *k, int H, int T,
                            int D, float *imp)
{
    if (n_heads < H || n_heads % H)
        return kv_fail(KV_E_DATA, "%d query heads is not a multiple of %d KV heads", n_heads, H);
    if (n_q > T) return kv_fail(KV_E_DATA, "%d queries but only %d tokens", n_q, T);
    memset(imp, 0, (size_t)H * T * sizeof *imp);
    float *p = malloc((size_t)T * sizeof *p);
    if (!p) return kv_fail(KV_E_NOMEM, "importance");
    const float sc = 1.0f / sqrtf((float)D);
    for (int qh = 0; qh < n_heads; qh++) {
        int h = qh / (n_heads / H);
        const float *kh = k + (size_t)h * T * D;
        for (int j = 0; j < n_q; j++) {
            const float *qv = q + ((size_t)qh * n_q + j) * D;
            int n = T - n_q + j + 1;
            float mx = -INFINITY;
            for (int t = 0; t < n; t++) {
                float s = 0;
                for (int c = 0; c < D; c++) s += qv[c] * kh[(size_t)t * D + c];
                p[t] = s * sc;
                if (p[t] > mx) mx = p[t];
            }
            double z = 0;
            for (int t = 0; t < n; t++) z += (p[t] = expf(p[t] - mx));
            for (int t = 0; t < n; t++) imp[(size_t)h * T + t] += (float)(p[t] / z);
        }
    }
    free(p);
    return KV_OK;
}

// --- HCAP -------------------------------------------------------------------------

int kv_hcap_channels(const float *contrib, int D, double thresh, uint8_t *keep)
{
    double sum = 0;
    int best = 0;
    for (int c = 0; c < D; c++) {
        sum += contrib[c];
        if (contrib[c] > contrib[best]) best = c;
    }
    int n = 0;
    for (int c = 0; c < D; c++) {
        keep[c] = thresh <= 0 || !(sum > 0) || contrib[c] >= thresh * sum || c == best;
        n += keep[c];
    }
    return n;
}

/* Order token indices by score, best first, ties to the earlier; NaN last. */
static int cmp_score(const void *a, const void *b, void *ctx)
{
    const float *s = ctx;
    int i = *(const int *)a, j = *(const int *)b;
    float x = isnan(s[i]) ? -INFINITY : s[i], y = isnan(s[j]) ? -INFINITY : s[j];
    if (x != y) return x > y ? -1 : 1;
    return (i > j) - (i < j);
}

/* Mark up to want more tokens, best score first.  order: (T) scratch. */
static int take_top(const float *score, int T, int want, uint8_t *keep, int *order)
{
    for (int t = 0; t < T; t++) order[t] = t;
    qsort_r(order, (size_t)T, sizeof *order, cmp_score, (void *)score);
    int got = 0;
    for (int i = 0; i < T && got < want; i++)
        if (!keep[order[i]]) {
            keep[order[i]] = 1;
            got++;
        }
    return got;
}

int kv_hcap_tokens(const float *hist, const float *pred, int T, double keep_frac, int sink,
                   int window, uint8_t *keep)
{
    memset(keep, 0, (size_t)T);
    int n = 0;
    for (int t = 0; t < T; t++)
        if (t < sink || t >= T - window) {
            keep[t] = 1;
            n++;
        }
    double b = ceil((keep_frac >= 1 ? 1.0 : keep_frac < 0 ? 0.0 : keep_frac) * T);
    int budget = (int)b;
    if (budget <= n) return n;
    int *order = malloc((size_t)T * sizeof *order);
    if (!order) { /* no scratch: keep everything rather than guess */
        memset(keep, 1, (size_t)T);
        return T;
    }
    if (pred) n += take_top(pred, T, (budget - n + 1) / 2, keep, order);
    n += take_top(hist, T, budget - n, keep, order);
    free(order);
    return n;
}
