/*
 * CPU reference decode attention (see kv_attn.h).  Written for clarity, not
 * speed: one query head at a time, scores into a scratch row, a max-shifted
 * softmax, then the weighted value sum, all in float32 like the kernels.
 */
#include "kv_attn.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

kv_status kv_attn_check(const kv_attn_dims *d)
{
    if (d->n_heads < 1 || d->kv_heads < 1 || d->n_heads % d->kv_heads)
        return kv_fail(KV_E_USAGE, "%d query heads are not a multiple of %d KV heads",
                       d->n_heads, d->kv_heads);
    if (d->head_dim < 1 || d->head_dim > KV_QUANT_MAX_DIM)
        return kv_fail(KV_E_USAGE, "head dim %d outside 1..%d", d->head_dim, KV_QUANT_MAX_DIM);
    if (d->T < 1) return kv_fail(KV_E_USAGE, "attention over %d tokens", d->T);
    if (!(d->scale > 0.0f) || !isfinite(d->scale))
        return kv_fail(KV_E_USAGE, "softmax scale %g is not a positive number", (double)d->scale);
    return KV_OK;
}

/* p[t] = exp(s[t] - max) in place; returns the sum. */
static float softmax_unnormalized(float *s, int T)
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
        const int D = d->head_dim, T = d->T, rep = d->n_heads / d->kv_heads;         \
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
            float l = softmax_unnormalized(s, T);                                    \
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

static kv_status kivi_match(const kv_attn_dims *d, const kv_kivi_packed *K,
                            const kv_kivi_packed *V)
{
    if (K->axis != KV_KIVI_KEYS || V->axis != KV_KIVI_VALUES)
        return kv_fail(KV_E_USAGE, "packed keys and values given in the wrong order");
    if (K->n_kv_heads != d->kv_heads || V->n_kv_heads != d->kv_heads || K->T != d->T ||
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
    const int gv = kv_kivi_vgroup(G, D), ngv = D / gv, rep = d->n_heads / d->kv_heads;
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
        float l = softmax_unnormalized(s, T);

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
