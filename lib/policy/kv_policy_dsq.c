/*
 * The `dsq` policy (KVO-LLM): tokens are grouped in windows of W (64); in
 * each complete window the S = round(F W) tokens with the most accumulated
 * attention are salient (INT8 per channel), the others kbits (keys, as
 * deltas from the window's base) and vbits (values) per token over groups
 * of 32 channels, packed by lib/kv_dsq (the code kv-quant --method dsq
 * uses); a window still filling stays fp16.  Defaults F 0.1, kbits 4,
 * vbits 2 (KV_DSQ_POLICY_*: 2-bit keys lost niah4k needles); KVO-LLM's own
 * choice is base=salient, salient=0.2, bits=2.
 *
 * Importance: the attention each token has received, summed over the query
 * heads of its KV head, accumulated over every attend since it arrived.  A
 * complete window is packed at the end of the first attend after it
 * completes, so its importance includes that step.  The prompt's windows:
 * when the engine gives the prompt's last queries through observe(), their
 * causal attention is the importance and the windows are packed at ingest;
 * otherwise they are packed after the first decode attend.
 *
 * HCAP (off by default): with chan=X > 0, key channels whose accumulated
 * attention-weighted contribution sum_t p_t |q_c k_tc| is under a share X
 * are dropped from the scores (kv_hcap_channels); with keep=F < 1, each
 * attend reads only the sink + window + top tokens by the predicted query's
 * scores (when predicted) and by accumulated importance, ceil(F T) in all
 * (kv_hcap_tokens).  HCAP changes what attention reads, not the layout:
 * resident bytes are those of the packed layout.
 *
 * Bytes (resident): kv_dsq_bytes(keys) + kv_dsq_bytes(values) over the
 * packed windows, minus one copy of the mask (K and V share it), plus
 * 2 * H * D * 2 per token not yet packed (fp16).
 *
 * Attention reads a float32 view of the cache: packed windows are decoded
 * once with kv_dsq_unpack_window when packed, fp16 tokens rounded.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant/kv_dsq.h"
#include "common/kv_half.h"
#include "policy/kv_policy_dsqp.h"
#include "policy/kv_policy_int.h"
#include "quant/kv_layer_io.h"

typedef struct {
    kv_policy base;
    kv_dsq_params dp;  /* keys' parameters (window, salient and group shared with values) */
    kv_dsq_params dpv; /* values': dp with the values' bits */
    kv_store k, v;   /* (H, max_tokens, D) f32 view: decoded windows, fp16-rounded rest */
    float *imp;      /* (H, max_tokens) accumulated attention */
    float *contrib;  /* (H, D) accumulated channel contribution (HCAP) */
    float *qpred;    /* (n_heads, D) predicted query (HCAP tokens) */
    bool have_pred;
    float *obs_q;    /* (n_heads, obs_n, D) prompt queries from observe(), until ingest */
    int obs_n;
    int packed;      /* windows packed, from the start */
    /* one window's packed parts, reused */
    uint8_t *mask;
    int8_t *sal;
    kv_half *sscale, *kbase, *scale, *zero;
    uint8_t *codes;
    float *win;      /* (W, D) */
} dsq_policy;

static float *imp_row(dsq_policy *d, int h)
{
    return d->imp + (size_t)h * (size_t)d->base.g.max_tokens;
}

/* Token t's rows (head h at k + h*stride), fp16-rounded, importance 0. */
static void put_rows(dsq_policy *d, int t, const float *k, const float *v, size_t stride)
{
    const int D = d->base.g.head_dim;
    float *row = d->win; /* free between packs */
    for (int h = 0; h < d->base.g.n_kv_heads; h++) {
        for (int c = 0; c < D; c++) row[c] = kv_round_half(k[(size_t)h * stride + (size_t)c]);
        kv_store_put(&d->k, h, t, row);
        for (int c = 0; c < D; c++) row[c] = kv_round_half(v[(size_t)h * stride + (size_t)c]);
        kv_store_put(&d->v, h, t, row);
        imp_row(d, h)[t] = 0.0f;
    }
}

/* Pack window w of every head and replace its view by the decoded values. */
static void pack_window(dsq_policy *d, int w)
{
    const int D = d->base.g.head_dim, W = d->dp.window, t0 = w * W;
    float *x = d->win;
    for (int h = 0; h < d->base.g.n_kv_heads; h++) {
        kv_dsq_select(imp_row(d, h) + t0, W, d->dp.salient, d->mask);
        for (int pass = 0; pass < 2; pass++) {
            kv_store *s = pass ? &d->v : &d->k;
            kv_kivi_axis ax = pass ? KV_KIVI_VALUES : KV_KIVI_KEYS;
            kv_half *base = pass ? NULL : d->kbase;
            for (int i = 0; i < W; i++) kv_store_get(s, h, t0 + i, x + (size_t)i * (size_t)D);
            const kv_dsq_params *dp = pass ? &d->dpv : &d->dp;
            kv_dsq_pack_window(x, (size_t)D, ax, dp, D, d->mask, d->sal, d->sscale, base,
                               d->codes, d->scale, d->zero);
            kv_dsq_unpack_window(ax, dp, D, d->mask, d->sal, d->sscale, base, d->codes,
                                 d->scale, d->zero, x);
            for (int i = 0; i < W; i++) kv_store_put(s, h, t0 + i, x + (size_t)i * (size_t)D);
        }
    }
}

static void pack_ready(dsq_policy *d)
{
    int nw = kv_dsq_nwindows(d->base.n_tokens, d->dp.window);
    while (d->packed < nw) pack_window(d, d->packed++);
}

static void dsq_observe(kv_policy *p, const float *q, int n)
{
    dsq_policy *d = (dsq_policy *)p;
    size_t sz = (size_t)p->g.n_heads * (size_t)n * (size_t)p->g.head_dim * sizeof(float);
    free(d->obs_q);
    d->obs_q = n > 0 ? malloc(sz) : NULL;
    d->obs_n = d->obs_q ? n : 0; /* on failure importance comes from the first attend */
    if (d->obs_q) memcpy(d->obs_q, q, sz);
}

static kv_status dsq_ingest(kv_policy *p, const float *k, const float *v, int T)
{
    dsq_policy *d = (dsq_policy *)p;
    const int D = p->g.head_dim, H = p->g.n_kv_heads;
    if (T < 0 || T > p->g.max_tokens)
        return kv_fail(KV_E_USAGE, "prompt of %d tokens exceeds the context %d", T, p->g.max_tokens);
    for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++) {
            size_t o = ((size_t)h * (size_t)T + (size_t)t) * (size_t)D;
            float *row = d->win;
            for (int c = 0; c < D; c++) row[c] = kv_round_half(k[o + (size_t)c]);
            kv_store_put(&d->k, h, t, row);
            for (int c = 0; c < D; c++) row[c] = kv_round_half(v[o + (size_t)c]);
            kv_store_put(&d->v, h, t, row);
        }
    memset(d->imp, 0, (size_t)H * (size_t)p->g.max_tokens * sizeof(float));
    memset(d->contrib, 0, (size_t)H * (size_t)D * sizeof(float));
    p->n_tokens = T;
    d->packed = 0;
    if (d->obs_q && d->obs_n <= T && T > 0) {
        /* importance from the prompt's last queries, over the original keys */
        float *imp = malloc((size_t)H * (size_t)T * sizeof(float));
        if (!imp) return kv_fail(KV_E_NOMEM, "dsq importance");
        kv_status st = kv_dsq_importance(d->obs_q, p->g.n_heads, d->obs_n, k, H, T, D, imp);
        if (st) {
            free(imp);
            return st;
        }
        for (int h = 0; h < H; h++)
            memcpy(imp_row(d, h), imp + (size_t)h * (size_t)T, (size_t)T * sizeof(float));
        free(imp);
        pack_ready(d);
    }
    free(d->obs_q);
    d->obs_q = NULL;
    d->obs_n = 0;
    return KV_OK;
}

static kv_status dsq_append(kv_policy *p, int pos, const float *k, const float *v)
{
    dsq_policy *d = (dsq_policy *)p;
    if (pos != p->n_tokens)
        return kv_fail(KV_E_INTERNAL, "append at position %d, but %d tokens are held", pos,
                       p->n_tokens);
    if (p->n_tokens >= p->g.max_tokens)
        return kv_fail(KV_E_USAGE, "context full (%d tokens)", p->g.max_tokens);
    put_rows(d, pos, k, v, (size_t)p->g.head_dim);
    p->n_tokens++;
    return KV_OK;
}

static void dsq_predict(kv_policy *p, const float *q_pred)
{
    dsq_policy *d = (dsq_policy *)p;
    memcpy(d->qpred, q_pred, (size_t)p->g.n_heads * (size_t)p->g.head_dim * sizeof(float));
    d->have_pred = true;
}

static kv_status dsq_attend(kv_policy *p, const float *q, float *out)
{
    dsq_policy *d = (dsq_policy *)p;
    const kv_policy_geom *g = &p->g;
    const kv_policy_params *prm = &p->prm;
    const int T = p->n_tokens, D = g->head_dim, H = g->n_kv_heads, grp = g->n_heads / H;
    const bool hcap_t = prm->hcap_token_keep < 1.0, hcap_c = prm->hcap_channel_thresh > 0.0;
    int *idx = calloc((size_t)H * (size_t)T + 1, sizeof(int));
    float *scratch = malloc(((size_t)2 * (size_t)T + 1) * (size_t)D * sizeof(float));
    float *probs = malloc(((size_t)g->n_heads * (size_t)T + 1) * sizeof(float));
    float *pred = malloc(((size_t)T + 1) * sizeof(float));
    float *qm = malloc((size_t)g->n_heads * (size_t)D * sizeof(float));
    uint8_t *keep = malloc((size_t)T + (size_t)D + 1);
    if (!idx || !scratch || !probs || !pred || !qm || !keep) {
        free(idx); free(scratch); free(probs); free(pred); free(qm); free(keep);
        return kv_fail(KV_E_NOMEM, "dsq attention scratch");
    }
    memcpy(qm, q, (size_t)g->n_heads * (size_t)D * sizeof(float));
    /* token subsets: idx (H, T) first, then compacted to the common count
     * n (kv_hcap_tokens keeps the same number on every head: ceil(F T),
     * at least sink + window) */
    int n = T;
    for (int h = 0; h < H; h++) {
        int *ix = idx + (size_t)h * (size_t)T;
        if (!hcap_t) {
            for (int t = 0; t < T; t++) ix[t] = t;
            continue;
        }
        const float *pq = d->have_pred ? d->qpred + (size_t)h * (size_t)grp * (size_t)D : NULL;
        if (pq)
            for (int t = 0; t < T; t++) {
                const float *kt = kv_store_f32(&d->k, h, t);
                float s = 0.0f;
                for (int j = 0; j < grp; j++)
                    for (int c = 0; c < D; c++) s += pq[(size_t)j * (size_t)D + (size_t)c] * kt[c];
                pred[t] = s;
            }
        int m = kv_hcap_tokens(imp_row(d, h), pq ? pred : NULL, T, prm->hcap_token_keep,
                               prm->sink, prm->window, keep);
        int c = 0;
        for (int t = 0; t < T; t++)
            if (keep[t]) ix[c++] = t;
        if (m < n) n = m;
    }
    for (int h = 1; h < H && n < T; h++)
        memmove(idx + (size_t)h * (size_t)n, idx + (size_t)h * (size_t)T, (size_t)n * sizeof(int));
    if (hcap_c) {
        for (int h = 0; h < H; h++) {
            kv_hcap_channels(d->contrib + (size_t)h * (size_t)D, D, prm->hcap_channel_thresh, keep);
            for (int j = 0; j < grp; j++)
                for (int c = 0; c < D; c++)
                    if (!keep[c]) qm[((size_t)h * (size_t)grp + (size_t)j) * (size_t)D + (size_t)c] = 0.0f;
        }
    }
    d->have_pred = false;
    kv_attend_gather(g, &d->k, &d->v, idx, n, qm, out, scratch, probs);
    /* accumulate importance (and channel contributions) */
    for (int h = 0; h < H; h++) {
        float *imp = imp_row(d, h);
        const int *ix = idx + (size_t)h * (size_t)n;
        for (int j = 0; j < grp; j++) {
            const float *pr = probs + ((size_t)h * (size_t)grp + (size_t)j) * (size_t)n;
            const float *qh = q + ((size_t)h * (size_t)grp + (size_t)j) * (size_t)D;
            for (int i = 0; i < n; i++) {
                imp[ix[i]] += pr[i];
                if (hcap_c) {
                    const float *kt = kv_store_f32(&d->k, h, ix[i]);
                    float *cb = d->contrib + (size_t)h * (size_t)D;
                    for (int c = 0; c < D; c++) cb[c] += pr[i] * fabsf(qh[c] * kt[c]);
                }
            }
        }
    }
    pack_ready(d);
    free(idx); free(scratch); free(probs); free(pred); free(qm); free(keep);
    return KV_OK;
}

static void dsq_bytes(const kv_policy *p, kv_bytes *b)
{
    const dsq_policy *d = (const dsq_policy *)p;
    const int H = p->g.n_kv_heads, D = p->g.head_dim, Tp = d->packed * d->dp.window;
    kv_dsq_sizes s;
    kv_dsq_part_sizes(KV_KIVI_KEYS, &d->dp, H, Tp, D, &s);
    *b = (kv_bytes){0};
    b->resident = kv_dsq_bytes(KV_KIVI_KEYS, &d->dp, H, Tp, D) +
                  kv_dsq_bytes(KV_KIVI_VALUES, &d->dpv, H, Tp, D) - s.mask +
                  2u * (uint64_t)H * (uint64_t)(p->n_tokens - Tp) * (uint64_t)D * 2u;
}

static void dsq_destroy(kv_policy *p)
{
    dsq_policy *d = (dsq_policy *)p;
    free(d->win);
    free(d->codes);
    free(d->zero);
    free(d->scale);
    free(d->kbase);
    free(d->sscale);
    free(d->sal);
    free(d->mask);
    free(d->obs_q);
    free(d->qpred);
    free(d->contrib);
    free(d->imp);
    kv_store_clear(&d->v);
    kv_store_clear(&d->k);
    free(d);
}

/* The file's packed windows, decoded once into the float32 view exactly as
 * pack_window leaves its own (the values the packed data stands for), and
 * the unpacked tail in fp16; later windows are packed with the file's
 * parameters. */
static kv_status dsq_load(kv_policy *p, const kvc_file *f, int layer)
{
    dsq_policy *d = (dsq_policy *)p;
    kv_dsq_packed K, V;
    kv_status st = kv_dsq_read(f, layer, 'k', &K);
    if (st) return st;
    if ((st = kv_dsq_read(f, layer, 'v', &V))) {
        kv_dsq_clear(&K);
        return st;
    }
    const int H = p->g.n_kv_heads, D = p->g.head_dim, T = K.T;
    float *x = NULL;
    if (K.prm.window != d->dp.window || K.prm.salient != d->dp.salient || K.n_kv_heads != H ||
        K.head_dim != D || V.T != T || K.prm.group != V.prm.group ||
        K.prm.salient != V.prm.salient || K.prm.window != V.prm.window) {
        st = kv_fail(KV_E_INTERNAL, "layer %d: packed parameters differ from the policy's", layer);
        goto out;
    }
    if (T > p->g.max_tokens) {
        st = kv_fail(KV_E_USAGE, "the cache holds %d tokens, more than the context of %d", T, p->g.max_tokens);
        goto out;
    }
    if (K.prm.bits != d->dp.bits || V.prm.bits != d->dpv.bits || K.prm.group != d->dp.group) {
        /* the window buffers are sized by bits and group: regrow them */
        const size_t W = (size_t)K.prm.window, S = (size_t)K.prm.salient;
        const size_t gd = (size_t)kv_kivi_vgroup(K.prm.group, D);
        const int maxbits = K.prm.bits > V.prm.bits ? K.prm.bits : V.prm.bits;
        uint8_t *codes = calloc((W - S) * kv_kivi_row_bytes(D, maxbits) + 1, 1);
        kv_half *scale = calloc((W - S) * ((size_t)D / gd) + 1, sizeof(kv_half));
        kv_half *zero = calloc((W - S) * ((size_t)D / gd) + 1, sizeof(kv_half));
        if (!codes || !scale || !zero) {
            free(codes), free(scale), free(zero);
            st = kv_fail(KV_E_NOMEM, "dsq load");
            goto out;
        }
        free(d->codes), free(d->scale), free(d->zero);
        d->codes = codes, d->scale = scale, d->zero = zero;
    }
    d->dp = K.prm; /* bits and group too: the file's windows and the ones to come agree */
    d->dpv = V.prm;
    if (!(x = malloc(((size_t)H * (size_t)T * (size_t)D + 1) * sizeof(float)))) {
        st = kv_fail(KV_E_NOMEM, "dsq load of %d tokens", T);
        goto out;
    }
    for (int pass = 0; pass < 2; pass++) {
        kv_dsq_unpack(pass ? &V : &K, x);
        kv_store *s = pass ? &d->v : &d->k;
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) kv_store_put(s, h, t, x + ((size_t)h * (size_t)T + (size_t)t) * (size_t)D);
    }
    memset(d->imp, 0, (size_t)H * (size_t)p->g.max_tokens * sizeof(float));
    memset(d->contrib, 0, (size_t)H * (size_t)D * sizeof(float));
    p->n_tokens = T;
    d->packed = K.nw;
out:
    free(x);
    kv_dsq_clear(&K);
    kv_dsq_clear(&V);
    return st;
}

static const kv_policy_ops dsq_ops = {
    .load = dsq_load,
    .ingest = dsq_ingest,
    .append = dsq_append,
    .attend = dsq_attend,
    .predict = dsq_predict,
    .bytes = dsq_bytes,
    .destroy = dsq_destroy,
    .observe = dsq_observe,
};

void kv_policy_dsq_params(const kv_policy_params *p, kv_dsq_params *k, kv_dsq_params *v)
{
    kv_dsq_params_default(k);
    k->window = p->dsq_window;
    k->salient = kv_dsq_salient_count(p->dsq_window, p->dsq_salient);
    k->base = p->dsq_base;
    k->bits = p->dsq_kbits;
    k->group = p->dsq_group;
    if (v) {
        *v = *k;
        v->bits = p->dsq_vbits;
    }
}

kv_status kv_policy_dsq_new(const kv_policy_geom *g, const kv_policy_params *prm,
                               kv_policy **out)
{
    *out = NULL;
    kv_dsq_params dp, dpv; /* checked by kv_policy_new */
    kv_policy_dsq_params(prm, &dp, &dpv);
    kv_status st;
    dsq_policy *d = calloc(1, sizeof *d);
    if (!d) return kv_fail(KV_E_NOMEM, "dsq policy");
    d->base.ops = &dsq_ops;
    d->base.g = *g;
    d->base.wants_prediction = prm->hcap_token_keep < 1.0;
    d->dp = dp;
    d->dpv = dpv;
    const int maxbits = dp.bits > d->dpv.bits ? dp.bits : d->dpv.bits;
    const size_t H = (size_t)g->n_kv_heads, D = (size_t)g->head_dim, W = (size_t)dp.window;
    const size_t S = (size_t)dp.salient, gd = (size_t)kv_kivi_vgroup(dp.group, g->head_dim);
    st = kv_store_init(&d->k, KV_DT_F32, g->n_kv_heads, g->max_tokens, g->head_dim);
    if (st == KV_OK) st = kv_store_init(&d->v, KV_DT_F32, g->n_kv_heads, g->max_tokens, g->head_dim);
    d->imp = calloc(H * (size_t)g->max_tokens, sizeof(float));
    d->contrib = calloc(H * D, sizeof(float));
    d->qpred = calloc((size_t)g->n_heads * D, sizeof(float));
    d->mask = calloc(W / 8 + 1, 1);
    d->sal = calloc(S * D + 1, 1);
    d->sscale = calloc(D, sizeof(kv_half));
    d->kbase = calloc(D, sizeof(kv_half));
    d->codes = calloc((W - S) * kv_kivi_row_bytes(g->head_dim, maxbits) + 1, 1);
    d->scale = calloc((W - S) * (D / gd) + 1, sizeof(kv_half));
    d->zero = calloc((W - S) * (D / gd) + 1, sizeof(kv_half));
    d->win = calloc(W * D, sizeof(float));
    if (st == KV_OK && (!d->imp || !d->contrib || !d->qpred || !d->mask || !d->sal ||
                        !d->sscale || !d->kbase || !d->codes || !d->scale || !d->zero || !d->win))
        st = kv_fail(KV_E_NOMEM, "dsq policy");
    if (st) {
        dsq_destroy(&d->base);
        return st;
    }
    *out = &d->base;
    return KV_OK;
}
