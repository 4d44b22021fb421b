/*
 * kv_attn_prefill: the CPU reference of a prefill chunk's causal attention
 * (kernels/prefill_attn.cu): queries at positions [p0, p0 + n) over the cached
 * keys [0, p0 + n), query i seeing keys [0, p0 + i].  The arithmetic of
 * lib/engine/kv_engine.c's prefill_attention (float32 dot products, a
 * max-shifted softmax, float32 sums), written plainly over row-major K/V.
 */
#include "attn/kv_attn.h"

#include <math.h>
#include <stdlib.h>

kv_status kv_attn_prefill(const kv_attn_prefill_dims *d, const float *q, const float *k,
                          const float *v, float *o)
{
    const int H = d->n_heads, G = d->n_kv_heads, D = d->head_dim;
    if (H < 1 || G < 1 || H % G || D < 1 || d->p0 < 0 || d->n < 0 || d->ldq < (long)H * D ||
        d->ldo < (long)H * D || d->kv_stride < (long)(d->p0 + d->n) * D)
        return kv_fail(KV_E_USAGE, "prefill attention: bad geometry (%d heads, %d KV heads, "
                       "head dim %d, p0 %d, n %d)", H, G, D, d->p0, d->n);
    const int grp = H / G, Tk = d->p0 + d->n;
    float *sc = malloc((size_t)(Tk > 0 ? Tk : 1) * sizeof(float));
    if (!sc) return kv_fail(KV_E_NOMEM, "out of memory for %d attention scores", Tk);
    for (int i = 0; i < d->n; i++)
        for (int h = 0; h < H; h++) {
            const float *qv = q + (size_t)i * d->ldq + (size_t)h * D;
            const float *K = k + (size_t)(h / grp) * d->kv_stride;
            const float *V = v + (size_t)(h / grp) * d->kv_stride;
            const int ns = d->p0 + i + 1;
            float mx = -INFINITY;
            for (int t = 0; t < ns; t++) {
                float s = 0.0f;
                for (int c = 0; c < D; c++) s += qv[c] * K[(size_t)t * D + c];
                sc[t] = s * d->scale;
                if (sc[t] > mx) mx = sc[t];
            }
            float sum = 0.0f;
            for (int t = 0; t < ns; t++) {
                sc[t] = expf(sc[t] - mx);
                sum += sc[t];
            }
            float *ov = o + (size_t)i * d->ldo + (size_t)h * D;
            for (int c = 0; c < D; c++) ov[c] = 0.0f;
            for (int t = 0; t < ns; t++)
                for (int c = 0; c < D; c++) ov[c] += sc[t] * V[(size_t)t * D + c];
            for (int c = 0; c < D; c++) ov[c] /= sum;
        }
    free(sc);
    return KV_OK;
}
