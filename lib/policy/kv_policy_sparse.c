/*
 * The `sparse` policy (TailorKV's retrieval side).  The prompt's K/V live in
 * "host" memory; resident (fast) memory keeps the first S sink tokens, the
 * W most recent tokens, every generated token, one max|K| per channel, and
 * the selection index of the mode.  Each attend:
 *   1. take the query predicted for this layer (predict(), from the engine
 *      one layer ahead) or, without one, the actual query;
 *   2. score every non-resident ("candidate") token per query head, by mode:
 *        resident (default): from the C critical channels chosen once at
 *          ingest (kv_select_pick_channels: |q̂|·max|K| over the prompt's
 *          last queries), whose rows of every prompt key stay resident in
 *          fp16 (cbits=16) or as 8- or 4-bit codes: nothing is read from the
 *          host to score;
 *        channels: from C channels chosen per step by sum_h |q_hc| * max_t
 *          |K_tc|, read from the host copy (the "channel" traffic);
 *        exact: from every channel of the host keys;
 *        pages (Quest): per page of P tokens, the upper bound sum_c
 *          max(q_c min_c, q_c max_c) from resident fp16 page bounds;
 *      channel scores get SparQ's temperature sqrt(D * |q_C|_1 / |q|_1);
 *   3. turn each head's scores into softmax probabilities over the
 *      candidates and combine the group's heads (sum by default, or max);
 *   4. take the top K candidates (pages: the best pages' tokens, in page
 *      order, until K), "fetch" their K and V rows, and attend exactly over
 *      resident + fetched tokens, in token order.
 * Selection is per KV head: heads of one layer may fetch different tokens.
 * lib/policy/kv_select.c holds the index and score arithmetic, which the
 * GPU engine reproduces.
 *
 * Byte accounting (eb = bytes per element of prm.dtype, H = KV heads,
 * Tp = prompt tokens):
 *   host      = 2 * H * Tp * D * eb                  (the ingested prompt)
 *   resident  = 2 * H * n_resident * D * eb + H * D * 4   (channel maxima, f32)
 *               + resident: H * kv_select_rows_bytes(C, Tp, cbits)
 *               + pages:    H * ceil(Tp / P) * D * 2 * 2  (fp16 min and max)
 *   fetched   = channels: H * C * n_cand * eb  +  2 * H * K' * D * eb
 *               exact:    H * n_cand * D * eb  +      H * K' * D * eb
 *               resident, pages:                  2 * H * K' * D * eb
 *               (K' = min(K, n_cand); when K' == n_cand nothing is scored
 *               and fetched = 2 * H * n_cand * D * eb)
 * where n_cand = prompt tokens neither sink nor within the W most recent.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "policy/kv_policy_int.h"
#include "policy/kv_select.h"

typedef struct {
    kv_policy base;
    kv_store k, v;   /* (n_kv_heads, max_tokens, head_dim): host prompt + resident */
    float *chmax;    /* (n_kv_heads, head_dim) max_t |K_tc| */
    float *qpred;    /* (n_heads, head_dim) predicted query */
    bool have_pred;
    float *obs_q;    /* (n_heads, obs_n, head_dim) the prompt's last queries, until ingest */
    int obs_n;
    int T_prompt;    /* tokens ingested: the host-resident part */
    kv_bytes acc;    /* fetched counters */
    /* the resident selection index, built at ingest */
    int C;           /* resident: channels of the index */
    int *rch;        /* (n_kv_heads, C) resident channels, ascending */
    float *rval;     /* (n_kv_heads, T_prompt, C) their values as the index holds them */
    float *pbasis, *pmean; /* pca: (n_kv_heads, C, head_dim) directions, (n_kv_heads, head_dim) mean */
    int npages;      /* pages: ceil(T_prompt / page) */
    float *pmin, *pmax; /* (n_kv_heads, npages, head_dim) fp16-rounded page bounds */
    uint64_t index_bytes; /* resident bytes of the index */
} sparse_policy;

/* Candidates: [cs, cend); resident: [0, cs) and [cend, T). */
static void cand_range(const sparse_policy *s, int T, int *cs, int *cend)
{
    const kv_policy_params *prm = &s->base.prm;
    int a = prm->sink < T ? prm->sink : T;
    int e = T - prm->window;
    if (e > s->T_prompt) e = s->T_prompt;
    if (e < a) e = a;
    *cs = a;
    *cend = e;
}

static int topk_of(const sparse_policy *s, int T)
{
    const kv_policy_params *prm = &s->base.prm;
    if (prm->topk > 0) return prm->topk;
    return (int)ceil(prm->topk_frac * (double)T);
}

static void chmax_update(sparse_policy *s, int h, const float *k)
{
    float *m = s->chmax + (size_t)h * (size_t)s->base.g.head_dim;
    for (int c = 0; c < s->base.g.head_dim; c++) {
        float a = fabsf(k[c]);
        if (a > m[c]) m[c] = a;
    }
}

static void free_index(sparse_policy *s)
{
    free(s->rch);
    free(s->rval);
    free(s->pmin);
    free(s->pmax);
    free(s->pbasis);
    free(s->pmean);
    s->rch = NULL;
    s->rval = s->pmin = s->pmax = s->pbasis = s->pmean = NULL;
    s->npages = 0;
    s->index_bytes = 0;
}

/* The resident index of select=resident or pages over the prompt's keys k
 * ([n_kv_heads, T, D], as ingested) and the observed queries. */
static kv_status build_index(sparse_policy *s, const float *k, int T)
{
    const kv_policy_params *prm = &s->base.prm;
    const int H = s->base.g.n_kv_heads, D = s->base.g.head_dim;
    free_index(s);
    if (prm->select == KV_SELECT_RESIDENT) {
        const int C = kv_select_pool_size(prm->pool, prm->channels, D);
        s->C = C;
        s->rch = malloc((size_t)H * (size_t)C * sizeof(int));
        s->rval = malloc(((size_t)H * (size_t)T * (size_t)C + 1) * sizeof(float));
        if (!s->rch || !s->rval) return kv_fail(KV_E_NOMEM, "sparse channel index");
        kv_select_pick_channels(s->obs_n > 0 ? s->obs_q : NULL, s->obs_n, s->chmax, s->base.g.n_heads,
                                H, D, C, s->rch);
        for (int h = 0; h < H; h++)
            for (int j = 0; j < C; j++)
                kv_select_channel_row(k + (size_t)h * T * D + s->rch[(size_t)h * C + j], (size_t)D, T,
                                      prm->cbits, NULL, NULL, NULL,
                                      s->rval + (size_t)h * T * C + j, (size_t)C);
        s->index_bytes = (uint64_t)H * kv_select_rows_bytes(C, T, prm->cbits);
    } else if (prm->select == KV_SELECT_PCA) {
        const int C = prm->channels < D ? prm->channels : D;
        s->C = C;
        s->pbasis = malloc((size_t)H * (size_t)C * (size_t)D * sizeof(float));
        s->pmean = malloc((size_t)H * (size_t)D * sizeof(float));
        s->rval = malloc(((size_t)H * (size_t)T * (size_t)C + 1) * sizeof(float));
        float *proj = malloc(((size_t)T * (size_t)C + 1) * sizeof(float));
        if (!s->pbasis || !s->pmean || !s->rval || !proj) {
            free(proj);
            return kv_fail(KV_E_NOMEM, "sparse principal index");
        }
        for (int h = 0; h < H; h++) {
            const float *kh = k + (size_t)h * T * D;
            float *b = s->pbasis + (size_t)h * C * D, *mu = s->pmean + (size_t)h * D;
            kv_select_pca(kh, (size_t)D, T, D, C, mu, b);
            for (int t = 0; t < T; t++)
                kv_select_project(b, mu, C, D, kh + (size_t)t * D, proj + (size_t)t * C);
            for (int j = 0; j < C; j++)
                kv_select_channel_row(proj + j, (size_t)C, T, prm->cbits, NULL, NULL, NULL,
                                      s->rval + (size_t)h * T * C + j, (size_t)C);
        }
        free(proj);
        s->index_bytes = (uint64_t)H * (kv_select_rows_bytes(C, T, prm->cbits) +
                                        (uint64_t)(C + 1) * (uint64_t)D * 4u);
    } else if (prm->select == KV_SELECT_PAGES) {
        const int P = prm->page, np = (T + P - 1) / P;
        s->npages = np;
        s->pmin = malloc(((size_t)H * (size_t)np * (size_t)D + 1) * sizeof(float));
        s->pmax = malloc(((size_t)H * (size_t)np * (size_t)D + 1) * sizeof(float));
        if (!s->pmin || !s->pmax) return kv_fail(KV_E_NOMEM, "sparse page index");
        for (int h = 0; h < H; h++)
            kv_select_page_bounds(k + (size_t)h * T * D, (size_t)D, T, D, P,
                                  s->pmin + (size_t)h * np * D, s->pmax + (size_t)h * np * D);
        s->index_bytes = (uint64_t)H * (uint64_t)np * (uint64_t)D * 4u;
    }
    return KV_OK;
}

static void sparse_observe(kv_policy *p, const float *q, int n)
{
    sparse_policy *s = (sparse_policy *)p;
    size_t sz = (size_t)p->g.n_heads * (size_t)n * (size_t)p->g.head_dim * sizeof(float);
    free(s->obs_q);
    s->obs_q = n > 0 ? malloc(sz) : NULL;
    s->obs_n = s->obs_q ? n : 0; /* without them the channel maxima alone choose */
    if (s->obs_q) memcpy(s->obs_q, q, sz);
}

static kv_status sparse_ingest(kv_policy *p, const float *k, const float *v, int T)
{
    sparse_policy *s = (sparse_policy *)p;
    const int D = p->g.head_dim;
    if (T < 0 || T > p->g.max_tokens)
        return kv_fail(KV_E_USAGE, "prompt of %d tokens exceeds the context %d", T, p->g.max_tokens);
    memset(s->chmax, 0, (size_t)p->g.n_kv_heads * (size_t)D * sizeof(float));
    for (int h = 0; h < p->g.n_kv_heads; h++)
        for (int t = 0; t < T; t++) {
            size_t o = ((size_t)h * (size_t)T + (size_t)t) * (size_t)D;
            kv_store_put(&s->k, h, t, k + o);
            kv_store_put(&s->v, h, t, v + o);
            chmax_update(s, h, k + o);
        }
    p->n_tokens = s->T_prompt = T;
    s->acc = (kv_bytes){0};
    kv_status st = build_index(s, k, T);
    free(s->obs_q);
    s->obs_q = NULL;
    s->obs_n = 0;
    return st;
}

static kv_status sparse_append(kv_policy *p, int pos, const float *k, const float *v)
{
    sparse_policy *s = (sparse_policy *)p;
    const int D = p->g.head_dim;
    if (pos != p->n_tokens)
        return kv_fail(KV_E_INTERNAL, "append at position %d, but %d tokens are held", pos,
                       p->n_tokens);
    if (p->n_tokens >= p->g.max_tokens)
        return kv_fail(KV_E_USAGE, "context full (%d tokens)", p->g.max_tokens);
    for (int h = 0; h < p->g.n_kv_heads; h++) {
        kv_store_put(&s->k, h, pos, k + (size_t)h * (size_t)D);
        kv_store_put(&s->v, h, pos, v + (size_t)h * (size_t)D);
        chmax_update(s, h, k + (size_t)h * (size_t)D);
    }
    p->n_tokens++;
    return KV_OK;
}

static void sparse_predict(kv_policy *p, const float *q_pred)
{
    sparse_policy *s = (sparse_policy *)p;
    memcpy(s->qpred, q_pred, (size_t)p->g.n_heads * (size_t)p->g.head_dim * sizeof(float));
    s->have_pred = true;
}

typedef struct {
    float score;
    int idx;
} scored;

/* Descending score, NaN ranked as -inf (as kv_dsq_select does); ties to
 * the earlier token.  A total order, so selection is deterministic and the
 * quickselect's scans stop at the pivot: with NaN compared as a number
 * every comparison was "less", and the scan ran off the array. */
static inline float rank_of(float x) { return isnan(x) ? -INFINITY : x; }

static int cmp_scored(const void *a, const void *b)
{
    const scored *x = a, *y = b;
    float u = rank_of(x->score), v = rank_of(y->score);
    if (u != v) return u < v ? 1 : -1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* Top n of m values (indices into c[]), by partial quickselect on scored. */
static void select_top(scored *c, int m, int n)
{
    int lo = 0, hi = m - 1;
    while (lo < hi) {
        scored piv = c[(lo + hi) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (cmp_scored(&c[i], &piv) < 0) i++;
            while (cmp_scored(&c[j], &piv) > 0) j--;
            if (i <= j) {
                scored t = c[i];
                c[i] = c[j];
                c[j] = t;
                i++;
                j--;
            }
        }
        if (n - 1 <= j) hi = j;
        else if (n - 1 >= i) lo = i;
        else break;
    }
}

/* The top kk of n combined scores (cand[i].idx preset), ids ascending into sel. */
static void take_top(scored *cand, int n, int kk, int *sel)
{
    select_top(cand, n, kk);
    for (int i = 0; i < kk; i++) sel[i] = cand[i].idx;
    qsort(sel, (size_t)kk, sizeof(int), cmp_int);
}

/* pages: the candidates [cs, cend) of KV head kh by page upper bounds; the
 * best pages' candidate tokens, best page first, until kk are taken. */
static void choose_pages(sparse_policy *s, int kh, const float *q, int cs, int cend, int kk,
                         int *sel, scored *cand, float *work)
{
    const kv_policy_geom *g = &s->base.g;
    const kv_policy_params *prm = &s->base.prm;
    const int D = g->head_dim, grp = g->n_heads / g->n_kv_heads, P = prm->page;
    const int p0 = cs / P, p1 = (cend - 1) / P, np = p1 - p0 + 1;
    const float *mn = s->pmin + ((size_t)kh * s->npages + (size_t)p0) * D;
    const float *mx = s->pmax + ((size_t)kh * s->npages + (size_t)p0) * D;
    float *sc = work, *comb = work + (size_t)grp * np; /* (grp, np), (np) */
    kv_select_score_pages(q, grp, D, mn, mx, np, sc);
    kv_select_combine(sc, grp, np, prm->group_reduce == KV_REDUCE_MAX, comb);
    for (int i = 0; i < np; i++) {
        cand[i].score = comb[i];
        cand[i].idx = p0 + i;
    }
    qsort(cand, (size_t)np, sizeof *cand, cmp_scored);
    int m = 0;
    for (int i = 0; i < np && m < kk; i++) {
        int a = cand[i].idx * P, e = a + P;
        if (a < cs) a = cs;
        if (e > cend) e = cend;
        for (int t = a; t < e && m < kk; t++) sel[m++] = t;
    }
    qsort(sel, (size_t)kk, sizeof(int), cmp_int);
}

/*
 * Score the candidates [cs, cend) of KV head kh for the group's queries q
 * (grp, D) and write the chosen K' token ids (ascending) to sel.
 * Returns the bytes read from the host to score.
 * work: (grp + 1) * n floats; cand: n.
 */
static uint64_t choose(sparse_policy *s, int kh, const float *q, int cs, int cend, int kk,
                       int *sel, scored *cand, float *work)
{
    const kv_policy_geom *g = &s->base.g;
    const kv_policy_params *prm = &s->base.prm;
    const int D = g->head_dim, grp = g->n_heads / g->n_kv_heads, n = cend - cs;
    const size_t eb = kv_dtype_size(s->k.dt);
    if (prm->select == KV_SELECT_PAGES) {
        choose_pages(s, kh, q, cs, cend, kk, sel, cand, work);
        return 0;
    }
    float *sc = work, *comb = work + (size_t)grp * n; /* (grp, n), (n) */
    uint64_t bytes = 0;
    if (prm->select == KV_SELECT_PCA) {
        const int C = s->C;
        float qp[8 * 1024];
        int gg = grp < 8 ? grp : 8;
        for (int h = 0; h < gg; h++)
            kv_select_project(s->pbasis + (size_t)kh * C * D, NULL, C, D, q + (size_t)h * D, qp + (size_t)h * C);
        kv_select_score_proj(qp, gg, C, D, s->rval + ((size_t)kh * s->T_prompt + (size_t)cs) * C,
                             (size_t)C, n, sc);
        for (int h = gg; h < grp; h++) /* past 8 heads a group: each projected in turn */
            kv_select_project(s->pbasis + (size_t)kh * C * D, NULL, C, D, q + (size_t)h * D, qp),
                kv_select_score_proj(qp, 1, C, D, s->rval + ((size_t)kh * s->T_prompt + (size_t)cs) * C,
                                     (size_t)C, n, sc + (size_t)h * n);
    } else if (prm->select == KV_SELECT_RESIDENT) {
        const int R = s->C, *pool = s->rch + (size_t)kh * R;
        int C = prm->channels < R ? prm->channels : R;
        const float *rows = s->rval + ((size_t)kh * s->T_prompt + (size_t)cs) * R;
        if (C == R) {
            kv_select_score_rows(q, grp, D, pool, NULL, C, rows, (size_t)R, n, sc);
        } else { /* this step's C of the R resident channels */
            int cols[1024], chans[1024];
            kv_select_pool_channels(q, grp, D, s->chmax + (size_t)kh * D, pool, R, C, cols);
            for (int j = 0; j < C; j++) chans[j] = pool[cols[j]];
            kv_select_score_rows(q, grp, D, chans, cols, C, rows, (size_t)R, n, sc);
        }
    } else {
        int chans[1024];
        int C = prm->channels < D ? prm->channels : D;
        if (prm->select == KV_SELECT_EXACT) {
            C = D;
            for (int c = 0; c < D; c++) chans[c] = c;
            bytes = (uint64_t)n * (uint64_t)D * eb;
        } else {
            /* channel scores: (sum over the group of |q_hc|) * max_t |K_tc| */
            scored cs_[1024];
            const float *m = s->chmax + (size_t)kh * (size_t)D;
            for (int c = 0; c < D; c++) {
                float a = 0.0f;
                for (int h = 0; h < grp; h++) a += fabsf(q[(size_t)h * (size_t)D + (size_t)c]);
                cs_[c].score = a * m[c];
                cs_[c].idx = c;
            }
            select_top(cs_, D, C);
            for (int i = 0; i < C; i++) chans[i] = cs_[i].idx;
            qsort(chans, (size_t)C, sizeof(int), cmp_int);
            bytes = (uint64_t)n * (uint64_t)C * eb;
        }
        for (int h = 0; h < grp; h++) {
            const float *qh = q + (size_t)h * (size_t)D;
            double l1_all = 0.0, l1_c = 0.0;
            for (int c = 0; c < D; c++) l1_all += fabsf(qh[c]);
            for (int i = 0; i < C; i++) l1_c += fabsf(qh[chans[i]]);
            double temp = prm->select == KV_SELECT_EXACT || l1_all <= 0.0 ? (double)D : (double)D * l1_c / l1_all;
            float scale = temp > 0.0 ? (float)(1.0 / sqrt(temp)) : 0.0f;
            float *o = sc + (size_t)h * n;
            for (int i = 0; i < n; i++) {
                float d = 0.0f;
                if (s->k.dt == KV_DT_F32) {
                    const float *kt = kv_store_f32(&s->k, kh, cs + i);
                    for (int j = 0; j < C; j++) d += qh[chans[j]] * kt[chans[j]];
                } else {
                    for (int j = 0; j < C; j++) d += qh[chans[j]] * kv_store_at(&s->k, kh, cs + i, chans[j]);
                }
                o[i] = d * scale;
            }
        }
    }
    kv_select_combine(sc, grp, n, prm->group_reduce == KV_REDUCE_MAX, comb);
    for (int i = 0; i < n; i++) {
        cand[i].score = comb[i];
        cand[i].idx = cs + i;
    }
    take_top(cand, n, kk, sel);
    return bytes;
}

static kv_status sparse_attend(kv_policy *p, const float *q, float *out)
{
    sparse_policy *s = (sparse_policy *)p;
    const kv_policy_geom *g = &p->g;
    const int T = p->n_tokens, D = g->head_dim, H = g->n_kv_heads;
    const int grp = g->n_heads / H;
    const size_t eb = kv_dtype_size(s->k.dt);
    int cs, cend;
    cand_range(s, T, &cs, &cend);
    const int ncand = cend - cs;
    int kk = topk_of(s, T);
    if (kk > ncand) kk = ncand;
    if (kk < 0) kk = 0;
    const int n = cs + kk + (T - cend);
    const float *qs = s->have_pred && p->prm.predict ? s->qpred : q;
    s->have_pred = false;

    int *idx = malloc(((size_t)H * (size_t)n + 1) * sizeof(int));
    float *scratch = malloc(((size_t)2 * (size_t)n + 1) * (size_t)D * sizeof(float));
    scored *cand = malloc(((size_t)ncand + 1) * sizeof(scored));
    float *work = malloc(((size_t)(grp + 1) * (size_t)ncand + 1) * sizeof(float));
    if (!idx || !scratch || !cand || !work) {
        free(idx);
        free(scratch);
        free(cand);
        free(work);
        return kv_fail(KV_E_NOMEM, "sparse attention scratch");
    }
    uint64_t fetched = 0;
    for (int kh = 0; kh < H; kh++) {
        int *ix = idx + (size_t)kh * (size_t)n, m = 0;
        for (int t = 0; t < cs; t++) ix[m++] = t;
        if (kk == ncand) {
            for (int t = cs; t < cend; t++) ix[m++] = t;
            fetched += 2u * (uint64_t)ncand * (uint64_t)D * eb;
        } else if (kk > 0) {
            fetched += choose(s, kh, qs + (size_t)kh * (size_t)grp * (size_t)D, cs, cend, kk,
                              ix + m, cand, work);
            m += kk;
            fetched += (uint64_t)(p->prm.select == KV_SELECT_EXACT ? 1 : 2) * (uint64_t)kk * (uint64_t)D * eb;
        }
        for (int t = cend; t < T; t++) ix[m++] = t;
    }
    kv_attend_gather(g, &s->k, &s->v, idx, n, q, out, scratch, NULL);
    s->acc.fetched_last = fetched;
    s->acc.fetched_total += fetched;
    s->acc.attends++;
    free(work);
    free(cand);
    free(scratch);
    free(idx);
    return KV_OK;
}

static void sparse_bytes(const kv_policy *p, kv_bytes *b)
{
    const sparse_policy *s = (const sparse_policy *)p;
    const uint64_t H = (uint64_t)p->g.n_kv_heads, D = (uint64_t)p->g.head_dim;
    const uint64_t eb = kv_dtype_size(s->k.dt);
    int cs, cend;
    cand_range(s, p->n_tokens, &cs, &cend);
    uint64_t nres = (uint64_t)cs + (uint64_t)(p->n_tokens - cend);
    *b = s->acc;
    b->host = 2u * H * (uint64_t)s->T_prompt * D * eb;
    b->resident = 2u * H * nres * D * eb + H * D * 4u + s->index_bytes;
    b->disk = 0;
}

static void sparse_destroy(kv_policy *p)
{
    sparse_policy *s = (sparse_policy *)p;
    free_index(s);
    free(s->obs_q);
    free(s->qpred);
    free(s->chmax);
    kv_store_clear(&s->v);
    kv_store_clear(&s->k);
    free(s);
}

static const kv_policy_ops sparse_ops = {
    .ingest = sparse_ingest,
    .append = sparse_append,
    .attend = sparse_attend,
    .predict = sparse_predict,
    .bytes = sparse_bytes,
    .destroy = sparse_destroy,
    .observe = sparse_observe,
};

kv_status kv_policy_sparse_new(const kv_policy_geom *g, const kv_policy_params *prm,
                                  kv_policy **out)
{
    *out = NULL;
    /* parameters checked by kv_policy_new */
    sparse_policy *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(KV_E_NOMEM, "sparse policy");
    kv_status st = kv_store_init(&s->k, prm->dtype, g->n_kv_heads, g->max_tokens, g->head_dim);
    if (st == KV_OK) st = kv_store_init(&s->v, prm->dtype, g->n_kv_heads, g->max_tokens, g->head_dim);
    s->chmax = calloc((size_t)g->n_kv_heads * (size_t)g->head_dim, sizeof(float));
    s->qpred = calloc((size_t)g->n_heads * (size_t)g->head_dim, sizeof(float));
    if (st == KV_OK && (!s->chmax || !s->qpred)) st = kv_fail(KV_E_NOMEM, "sparse policy");
    s->base.ops = &sparse_ops;
    s->base.wants_prediction = prm->predict;
    if (st) {
        sparse_destroy(&s->base);
        return st;
    }
    *out = &s->base;
    return KV_OK;
}
