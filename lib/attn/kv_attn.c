/*
 * CPU reference decode attention (see kv_attn.h).  Written for clarity, not
 * speed: one query head at a time, scores into a scratch row, a max-shifted
 * softmax, then the weighted value sum, all in float32 like the kernels.
 */
#include "attn/kv_attn.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

kv_status kv_attn_check(const kv_attn_dims *d)
{
    if (d->n_heads < 1 || d->n_kv_heads < 1 || d->n_heads % d->n_kv_heads)
        return kv_fail(KV_E_USAGE, "%d query heads are not a multiple of %d KV heads",
                       d->n_heads, d->n_kv_heads);
    if (d->head_dim < 1 || d->head_dim > KV_QUANT_MAX_DIM)
        return kv_fail(KV_E_USAGE, "head dim %d outside 1..%d", d->head_dim, KV_QUANT_MAX_DIM);
    if (d->T < 1) return kv_fail(KV_E_USAGE, "attention over %d tokens", d->T);
    if (d->head_stride && d->head_stride != (long long)d->T * d->head_dim)
        return kv_fail(KV_E_USAGE, "head stride %lld: the CPU attention takes [kv_heads, T, head_dim]", d->head_stride);
    if (!(d->scale > 0.0f) || !isfinite(d->scale))
        return kv_fail(KV_E_USAGE, "softmax scale %g is not a positive number", (double)d->scale);
    return KV_OK;
}

/* p[t] = exp(s[t] - max) in place; returns the sum. */
float kv_softmax_unnormalized(float *s, int T)
{
    float m = -INFINITY;
    for (int t = 0; t < T; t++) m = s[t] > m ? s[t] : m;
    float l = 0.0f;
    for (int t = 0; t < T; t++) {
        s[t] = expf(s[t] - m);
        l += s[t];
    }
    return l;
}

// --- dense -----------------------------------------------------------------

/* One layout-agnostic loop for both element types: get(p, i) reads element i. */
#define DENSE_BODY(get)                                                              \
    do {                                                                             \
        const int D = d->head_dim, T = d->T, rep = d->n_heads / d->n_kv_heads;         \
        float *s = malloc((size_t)T * sizeof(float));                                \
        if (!s) return kv_fail(KV_E_NOMEM, "attention scratch of %d tokens", T);     \
        for (int h = 0; h < d->n_heads; h++) {                                       \
            size_t kvo = (size_t)(h / rep) * T * D;                                  \
            for (int t = 0; t < T; t++) {                                            \
                float acc = 0.0f;                                                    \
                for (int c = 0; c < D; c++)                                          \
                    acc += get(q, (size_t)h * D + c) * get(k, kvo + (size_t)t * D + c); \
                s[t] = acc * d->scale;                                               \
            }                                                                        \
            float l = kv_softmax_unnormalized(s, T);                                    \
            float *o = out + (size_t)h * D;                                          \
            memset(o, 0, (size_t)D * sizeof(float));                                 \
            for (int t = 0; t < T; t++)                                              \
                for (int c = 0; c < D; c++) o[c] += s[t] * get(v, kvo + (size_t)t * D + c); \
            for (int c = 0; c < D; c++) o[c] /= l;                                   \
        }                                                                            \
        free(s);                                                                     \
        return KV_OK;                                                                \
    } while (0)

#define GET_F32(p, i) ((p)[i])
#define GET_F16(p, i) kv_half_to_f32((p)[i])

kv_status kv_attn_decode_f32(const kv_attn_dims *d, const float *q, const float *k,
                             const float *v, float *out)
{
    kv_status st = kv_attn_check(d);
    if (st) return st;
    DENSE_BODY(GET_F32);
}

kv_status kv_attn_decode_f16(const kv_attn_dims *d, const kv_half *q, const kv_half *k,
                             const kv_half *v, float *out)
{
    kv_status st = kv_attn_check(d);
    if (st) return st;
    DENSE_BODY(GET_F16);
}

// --- KIVI packed -------------------------------------------------------------
