/*
 * kv_store: the full-precision row store (f32/f16/bf16) the policies keep
 * their K/V rows in, and the gathered attention over a subset of its rows
 * that every subset policy (sparse, streaming, dsq's pruned tokens) uses.
 */
#include <stdlib.h>
#include <string.h>

#include "attn/kv_attn.h"
#include "common/kv_half.h"
#include "policy/kv_policy_int.h"

// --- row store ----------------------------------------------------------

kv_status kv_store_init(kv_store *s, kv_dtype dt, int nkv, int cap, int dim)
{
    if (dt != KV_DT_F32 && dt != KV_DT_F16 && dt != KV_DT_BF16)
        return kv_fail(KV_E_USAGE, "KV store of %s: f32, f16 or bf16 only", kv_dtype_name(dt));
    s->dt = dt;
    s->nkv = nkv;
    s->cap = cap;
    s->dim = dim;
    s->data = calloc((size_t)nkv * (size_t)cap * (size_t)dim, kv_dtype_size(dt));
    if (!s->data) return kv_fail(KV_E_NOMEM, "KV store of %d x %d x %d", nkv, cap, dim);
    return KV_OK;
}

void kv_store_clear(kv_store *s)
{
    free(s->data);
    s->data = NULL;
}

static inline size_t store_off(const kv_store *s, int h, int t)
{
    return ((size_t)h * (size_t)s->cap + (size_t)t) * (size_t)s->dim;
}

void kv_store_put(kv_store *s, int h, int t, const float *x)
{
    size_t o = store_off(s, h, t);
    switch (s->dt) {
    case KV_DT_F32: memcpy((float *)s->data + o, x, (size_t)s->dim * sizeof(float)); break;
    case KV_DT_F16:
        for (int c = 0; c < s->dim; c++) ((kv_half *)s->data)[o + (size_t)c] = kv_f32_to_half(x[c]);
        break;
    case KV_DT_BF16:
        for (int c = 0; c < s->dim; c++) ((kv_bf16 *)s->data)[o + (size_t)c] = kv_f32_to_bf16(x[c]);
        break;
    default: break; /* kv_store_init took only f32, f16 and bf16 */
    }
}

void kv_store_get(const kv_store *s, int h, int t, float *x)
{
    size_t o = store_off(s, h, t);
    switch (s->dt) {
    case KV_DT_F32: memcpy(x, (const float *)s->data + o, (size_t)s->dim * sizeof(float)); break;
    case KV_DT_F16:
        for (int c = 0; c < s->dim; c++) x[c] = kv_half_to_f32(((const kv_half *)s->data)[o + (size_t)c]);
        break;
    case KV_DT_BF16:
        for (int c = 0; c < s->dim; c++) x[c] = kv_bf16_to_f32(((const kv_bf16 *)s->data)[o + (size_t)c]);
        break;
    default: break; /* kv_store_init took only f32, f16 and bf16 */
    }
}

float kv_store_at(const kv_store *s, int h, int t, int c)
{
    size_t o = store_off(s, h, t) + (size_t)c;
    switch (s->dt) {
    case KV_DT_F16: return kv_half_to_f32(((const kv_half *)s->data)[o]);
    case KV_DT_BF16: return kv_bf16_to_f32(((const kv_bf16 *)s->data)[o]);
    default: return ((const float *)s->data)[o];
    }
}

const float *kv_store_f32(const kv_store *s, int h, int t)
{
    return s->dt == KV_DT_F32 ? (const float *)s->data + store_off(s, h, t) : NULL;
}

void kv_attend_gather(const kv_policy_geom *g, const kv_store *K, const kv_store *V,
                      const int *idx, int n, const float *q, float *out, float *scratch,
                      float *probs)
{
    const int D = g->head_dim, grp = g->n_heads / g->n_kv_heads;
    float *kb = scratch, *vb = scratch + (size_t)n * (size_t)D;
    for (int kh = 0; kh < g->n_kv_heads; kh++) {
        const int *ix = idx + (size_t)kh * (size_t)n;
        for (int i = 0; i < n; i++) {
            kv_store_get(K, kh, ix[i], kb + (size_t)i * (size_t)D);
            kv_store_get(V, kh, ix[i], vb + (size_t)i * (size_t)D);
        }
        size_t qo = (size_t)kh * (size_t)grp * (size_t)D;
        kv_attend_core(q + qo, kb, vb, n, n, grp, 1, D, out + qo,
                       probs ? probs + (size_t)kh * (size_t)grp * (size_t)n : NULL);
    }
}
