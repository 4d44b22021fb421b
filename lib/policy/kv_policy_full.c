/*
 * The `full` policy: every token's K and V kept in fast memory in f32, f16
 * or bf16 (prm.dtype).  In f32 it attends with kv_attend_dense on its own
 * storage, so it is the exact reference the other policies are judged by.
 */
#include <stdlib.h>

#include "policy/kv_policy_int.h"

typedef struct {
    kv_policy base;
    kv_store k, v; /* (n_kv_heads, max_tokens, head_dim) each */
} full_policy;

static kv_status full_append(kv_policy *p, int pos, const float *k, const float *v)
{
    full_policy *f = (full_policy *)p;
    const int D = p->g.head_dim;
    if (pos != p->n_tokens)
        return kv_fail(KV_E_INTERNAL, "append at position %d, but %d tokens are held", pos,
                       p->n_tokens);
    if (p->n_tokens >= p->g.max_tokens)
        return kv_fail(KV_E_USAGE, "KV cache full (%d tokens)", p->g.max_tokens);
    for (int h = 0; h < p->g.n_kv_heads; h++) {
        kv_store_put(&f->k, h, p->n_tokens, k + (size_t)h * (size_t)D);
        kv_store_put(&f->v, h, p->n_tokens, v + (size_t)h * (size_t)D);
    }
    p->n_tokens++;
    return KV_OK;
}

static kv_status full_ingest(kv_policy *p, const float *k, const float *v, int T)
{
    full_policy *f = (full_policy *)p;
    const int D = p->g.head_dim;
    if (T < 0 || T > p->g.max_tokens)
        return kv_fail(KV_E_USAGE, "prompt of %d tokens exceeds the KV capacity %d", T,
                       p->g.max_tokens);
    for (int h = 0; h < p->g.n_kv_heads; h++)
        for (int t = 0; t < T; t++) {
            size_t o = ((size_t)h * (size_t)T + (size_t)t) * (size_t)D;
            kv_store_put(&f->k, h, t, k + o);
            kv_store_put(&f->v, h, t, v + o);
        }
    p->n_tokens = T;
    return KV_OK;
}

static kv_status full_attend(kv_policy *p, const float *q, float *out)
{
    full_policy *f = (full_policy *)p;
    const kv_policy_geom *g = &p->g;
    const int T = p->n_tokens;
    if (f->k.dt == KV_DT_F32) {
        kv_attend_dense(q, f->k.data, f->v.data, T, g->max_tokens, g->n_heads, g->n_kv_heads,
                        g->head_dim, out);
        return KV_OK;
    }
    float *scratch = malloc(((size_t)2 * (size_t)T + 1) * (size_t)g->head_dim * sizeof(float));
    int *idx = malloc(((size_t)g->n_kv_heads * (size_t)T + 1) * sizeof(int));
    if (!scratch || !idx) {
        free(scratch);
        free(idx);
        return kv_fail(KV_E_NOMEM, "attention scratch for %d tokens", T);
    }
    for (int h = 0; h < g->n_kv_heads; h++)
        for (int t = 0; t < T; t++) idx[(size_t)h * (size_t)T + (size_t)t] = t;
    kv_attend_gather(g, &f->k, &f->v, idx, T, q, out, scratch, NULL);
    free(idx);
    free(scratch);
    return KV_OK;
}

static void full_bytes(const kv_policy *p, kv_bytes *b)
{
    const full_policy *f = (const full_policy *)p;
    *b = (kv_bytes){0};
    b->resident = 2u * (uint64_t)p->g.n_kv_heads * (uint64_t)p->n_tokens *
                  (uint64_t)p->g.head_dim * kv_dtype_size(f->k.dt);
}

static void full_destroy(kv_policy *p)
{
    full_policy *f = (full_policy *)p;
    kv_store_clear(&f->v);
    kv_store_clear(&f->k);
    free(f);
}

static const kv_policy_ops full_ops = {
    .ingest = full_ingest,
    .append = full_append,
    .attend = full_attend,
    .predict = NULL,
    .bytes = full_bytes,
    .destroy = full_destroy,
};

kv_status kv_policy_full_new(const kv_policy_geom *g, const kv_policy_params *prm,
                                kv_policy **out)
{
    full_policy *f = calloc(1, sizeof *f);
    if (!f) return kv_fail(KV_E_NOMEM, "full policy");
    kv_status st = kv_store_init(&f->k, prm->dtype, g->n_kv_heads, g->max_tokens, g->head_dim);
    if (st == KV_OK)
        st = kv_store_init(&f->v, prm->dtype, g->n_kv_heads, g->max_tokens, g->head_dim);
    if (st) {
        kv_store_clear(&f->k);
        free(f);
        return st;
    }
    f->base.ops = &full_ops;
    *out = &f->base;
    return KV_OK;
}
