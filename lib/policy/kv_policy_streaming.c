/*
 * The `streaming` policy (StreamingLLM baseline): only the first S "sink"
 * tokens and the W most recent tokens are kept; everything in between is
 * dropped for good.  Keys keep their original RoPE positions (they arrive
 * rotated), so unlike StreamingLLM no positions are re-assigned inside the
 * cache.  Storage: S sink rows, then a ring of W rows; attention gathers
 * sink then window in token order, so while the context fits (T <= S + W)
 * the result equals kv_attend_dense bit for bit.
 */
#include <stdlib.h>

#include "policy/kv_policy_int.h"

typedef struct {
    kv_policy base;
    kv_store k, v; /* (n_kv_heads, S + W, head_dim): sink rows, then the ring */
    int S, W;
} stream_policy;

/* Slot of token t (t must be held). */
static int slot_of(const stream_policy *s, int t)
{
    return t < s->S ? t : s->S + (t - s->S) % s->W;
}

/* Tokens held after T tokens: min(T, S) sinks + up to W recent. */
static int held(const stream_policy *s, int T)
{
    int sink = T < s->S ? T : s->S;
    int rest = T - sink;
    return sink + (rest < s->W ? rest : s->W);
}

static void put_token(stream_policy *s, int t, const float *k, const float *v, size_t stride)
{
    if (t >= s->S && s->W == 0) return;
    int slot = slot_of(s, t);
    for (int h = 0; h < s->base.g.n_kv_heads; h++) {
        kv_store_put(&s->k, h, slot, k + (size_t)h * stride);
        kv_store_put(&s->v, h, slot, v + (size_t)h * stride);
    }
}

static kv_status stream_ingest(kv_policy *p, const float *k, const float *v, int T)
{
    stream_policy *s = (stream_policy *)p;
    const int D = p->g.head_dim;
    if (T < 0 || T > p->g.max_tokens)
        return kv_fail(KV_E_USAGE, "prompt of %d tokens exceeds the context %d", T, p->g.max_tokens);
    for (int t = 0; t < T; t++) {
        if (t >= s->S && t < T - s->W) continue; /* would be evicted anyway */
        put_token(s, t, k + (size_t)t * (size_t)D, v + (size_t)t * (size_t)D, (size_t)T * (size_t)D);
    }
    p->n_tokens = T;
    return KV_OK;
}

static kv_status stream_append(kv_policy *p, int pos, const float *k, const float *v)
{
    stream_policy *s = (stream_policy *)p;
    if (pos != p->n_tokens)
        return kv_fail(KV_E_INTERNAL, "append at position %d, but %d tokens are held", pos,
                       p->n_tokens);
    if (p->n_tokens >= p->g.max_tokens)
        return kv_fail(KV_E_USAGE, "context full (%d tokens)", p->g.max_tokens);
    put_token(s, pos, k, v, (size_t)p->g.head_dim);
    p->n_tokens++;
    return KV_OK;
}

static kv_status stream_attend(kv_policy *p, const float *q, float *out)
{
    stream_policy *s = (stream_policy *)p;
    const kv_policy_geom *g = &p->g;
    const int T = p->n_tokens, n = held(s, T), D = g->head_dim;
    int *idx = malloc(((size_t)g->n_kv_heads * (size_t)n + 1) * sizeof(int));
    float *scratch = malloc(((size_t)2 * (size_t)n + 1) * (size_t)D * sizeof(float));
    if (!idx || !scratch) {
        free(idx);
        free(scratch);
        return kv_fail(KV_E_NOMEM, "attention scratch");
    }
    int sink = T < s->S ? T : s->S;
    for (int h = 0; h < g->n_kv_heads; h++) {
        int *ix = idx + (size_t)h * (size_t)n, m = 0;
        for (int t = 0; t < sink; t++) ix[m++] = t;
        for (int t = T - (n - sink); t < T; t++) ix[m++] = slot_of(s, t);
    }
    kv_attend_gather(g, &s->k, &s->v, idx, n, q, out, scratch, NULL);
    free(scratch);
    free(idx);
    return KV_OK;
}

static void stream_bytes(const kv_policy *p, kv_bytes *b)
{
    const stream_policy *s = (const stream_policy *)p;
    *b = (kv_bytes){0};
    b->resident = 2u * (uint64_t)p->g.n_kv_heads * (uint64_t)held(s, p->n_tokens) *
                  (uint64_t)p->g.head_dim * kv_dtype_size(s->k.dt);
}

static void stream_destroy(kv_policy *p)
{
    stream_policy *s = (stream_policy *)p;
    kv_store_clear(&s->v);
    kv_store_clear(&s->k);
    free(s);
}

static const kv_policy_ops stream_ops = {
    .ingest = stream_ingest,
    .append = stream_append,
    .attend = stream_attend,
    .bytes = stream_bytes,
    .destroy = stream_destroy,
};

kv_status kv_policy_streaming_new(const kv_policy_geom *g, const kv_policy_params *prm,
                                     kv_policy **out)
{
    *out = NULL;
    /* parameters checked by kv_policy_new */
    stream_policy *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(KV_E_NOMEM, "streaming policy");
    s->S = prm->sink;
    s->W = prm->window;
    int rows = s->S + s->W;
    kv_status st = kv_store_init(&s->k, prm->dtype, g->n_kv_heads, rows, g->head_dim);
    if (st == KV_OK) st = kv_store_init(&s->v, prm->dtype, g->n_kv_heads, rows, g->head_dim);
    if (st) {
        kv_store_clear(&s->k);
        free(s);
        return st;
    }
    s->base.ops = &stream_ops;
    *out = &s->base;
    return KV_OK;
}
