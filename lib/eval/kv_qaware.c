/*
 * kv_qaware (see kv_qaware.h): sketch, probe, score, pick, load.
 */
#include "eval/kv_qaware.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_stats.h"
#include "policy/kv_prefix.h"

typedef struct {
    int seg, f;     /* segment, frame within it */
    double score;
} pblock;

static int cmp_block(const void *a, const void *b)
{
    const pblock *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return x->seg != y->seg ? x->seg - y->seg : x->f - y->f;
}

/* score[t] (t over the m matched positions) += the attention each query
 * gives position t over the sketched keys, per layer, query head, query. */
static void score_rows(const kv_tree_sketch *sk, const float *q, int L, int H, int Hkv, int nq, int D, double *score)
{
    const int m = sk->matched, g = H / Hkv;
    const float inv = 1.0f / sqrtf((float)D);
    double *part = calloc((size_t)L * m + 1, sizeof *part);
    if (!part) return;
#pragma omp parallel for schedule(dynamic, 1)
    for (int l = 0; l < L; l++) {
        float *lg = malloc((size_t)m * sizeof *lg + 1), *qs = malloc((size_t)D * sizeof *qs + 1);
        for (int hq = 0; lg && qs && hq < H; hq++) {
            const int h = hq / g;
            for (int j = 0; j < nq; j++) {
                const float *qv = q + (((size_t)l * H + hq) * nq + j) * D;
                float mx = -INFINITY;
                for (int si = 0; si < sk->nseg; si++) {
                    const kv_tree_sketch_seg *sg = &sk->seg[si];
                    const size_t lh = (size_t)l * Hkv + h;
                    const uint16_t *ch = sg->ch + lh * sg->r;
                    for (int i = 0; i < sg->r; i++) qs[i] = qv[ch[i]] * sg->scale[lh * sg->r + i] * inv;
                    const int8_t *code = sg->code + lh * (size_t)sg->rows * sg->r;
                    for (int t = 0; t < sg->n; t++) {
                        float a = 0;
                        for (int i = 0; i < sg->r; i++) a += qs[i] * code[(size_t)t * sg->r + i];
                        lg[sg->start + t] = a;
                        if (a > mx) mx = a;
                    }
                }
                double sum = 0;
                for (int t = 0; t < m; t++) sum += (lg[t] = expf(lg[t] - mx));
                for (int t = 0; t < m; t++) part[(size_t)l * m + t] += lg[t] / sum;
            }
        }
        free(lg), free(qs);
    }
    for (int l = 0; l < L; l++)
        for (int t = 0; t < m; t++) score[t] += part[(size_t)l * m + t];
    free(part);
}

kv_status kv_qaware_load(kv_runner *r, kv_tree_store *s, const int *tok, int n, const kv_qaware_opts *o,
                         kv_tree_rows *rows, kv_qaware_report *rep)
{
    memset(rows, 0, sizeof *rows);
    memset(rep, 0, sizeof *rep);
    const kv_model_config *c = &kv_runner_model(r)->cfg;
    const int L = c->n_layers, H = c->n_heads, Hkv = c->n_kv_heads, D = c->head_dim;
    if (!kv_tree_store_tree(s)->has_geom || n < 2) return KV_OK;
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    if (!ids) return kv_fail(KV_E_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) ids[i] = tok[i];
    double t0 = kv_now_ms();
    kv_tree_sketch sk;
    kv_status st = kv_tree_store_sketch(s, ids, n - 1, &sk);
    rep->sketch_ms = kv_now_ms() - t0;
    if (st || !sk.matched) {
        free(ids);
        kv_tree_sketch_free(&sk);
        return st;
    }
    const int m = sk.matched;
    rep->matched = m;
    for (int i = 0; i < KV_TIER_COUNT; i++) rep->sketch_bytes += sk.bytes_read[i];
    /* the probe: the sink row, then the request's last tokens at their positions */
    int P = n - m < o->probe ? n - m : o->probe, nq = P < o->queries ? P : o->queries;
    kv_tree_rows sink;
    kv_get_report gr;
    int32_t zero = 0;
    double t1 = kv_now_ms();
    float *q = malloc((size_t)L * H * P * D * sizeof *q + 1), *ql = malloc((size_t)H * P * D * sizeof *ql + 1);
    double *score = calloc((size_t)m, sizeof *score);
    if (!q || !ql || !score) st = kv_fail(KV_E_NOMEM, "out of memory");
    if (!st) st = kv_tree_store_load(s, ids, n - 1, 1, &zero, 1, false, o->now, &sink, &gr);
    for (int i = 0; !st && i < KV_TIER_COUNT; i++) rep->sketch_bytes += gr.bytes_read[i];
    if (!st) {
        kv_prefix pre = {.T = 1, .matched = n - P, .n_kv_heads = Hkv, .head_dim = D, .positions = sink.positions,
                         .tokens = sink.tokens, .dt = sink.dt, .k = (const void *const *)sink.k,
                         .v = (const void *const *)sink.v};
        if (!(st = kv_runner_keep(r, P, false))) st = kv_runner_prefill_from(r, &pre, tok + n - P, P, NULL);
        for (int l = 0; !st && l < L; l++) {
            int got = kv_runner_queries(r, l, ql);
            if (got < nq) {
                st = kv_fail(KV_E_INTERNAL, "the probe kept %d queries of layer %d, not %d", got, l, nq);
                break;
            }
            for (int h = 0; h < H; h++) /* the last nq of each head */
                memcpy(q + (((size_t)l * H + h) * nq) * D, ql + ((size_t)h * got + (got - nq)) * D, (size_t)nq * D * sizeof *q);
        }
        kv_tree_rows_free(&sink);
    }
    kv_status st2 = kv_runner_reset(r, NULL);
    if (!st2) st2 = kv_runner_keep(r, o->keep_nq, o->keep_kv);
    if (!st) st = st2;
    rep->probe_ms = kv_now_ms() - t1;
    /* score, then whole frames by score */
    double t2 = kv_now_ms();
    if (!st) score_rows(&sk, q, L, H, Hkv, nq, D, score);
    int nb = 0, keep = (int)ceil(o->frac * m);
    if (keep > m) keep = m;
    for (int si = 0; si < sk.nseg; si++) nb += (sk.seg[si].n + sk.seg[si].frame_rows - 1) / sk.seg[si].frame_rows;
    pblock *bl = malloc((size_t)(nb + 1) * sizeof *bl);
    int32_t *pick = malloc((size_t)m * sizeof *pick + 4);
    char *take = calloc((size_t)m + 1, 1);
    if (!st && (!bl || !pick || !take)) st = kv_fail(KV_E_NOMEM, "out of memory");
    int np = 0;
    if (!st) {
        int b = 0;
        for (int si = 0; si < sk.nseg; si++) {
            const kv_tree_sketch_seg *sg = &sk.seg[si];
            for (int f = 0; f * sg->frame_rows < sg->n; f++, b++) {
                double a = 0;
                for (int t = f * sg->frame_rows; t < sg->n && t < (f + 1) * sg->frame_rows; t++) a += score[sg->start + t];
                bool edge = (si == 0 && f == 0) || (si == sk.nseg - 1 && (f + 1) * sg->frame_rows >= sg->n);
                bl[b] = (pblock){si, f, edge ? INFINITY : a};
            }
        }
        qsort(bl, (size_t)nb, sizeof *bl, cmp_block);
        int got = 0;
        for (int i = 0; i < nb && got < keep; i++) {
            const kv_tree_sketch_seg *sg = &sk.seg[bl[i].seg];
            for (int t = bl[i].f * sg->frame_rows; t < sg->n && t < (bl[i].f + 1) * sg->frame_rows; t++)
                take[sg->start + t] = 1, got++;
        }
        for (int t = 0; t < m; t++)
            if (take[t]) pick[np++] = t;
    }
    rep->score_ms = kv_now_ms() - t2;
    double t3 = kv_now_ms();
    if (!st) st = kv_tree_store_load(s, ids, n - 1, 1, pick, np, false, o->now, rows, &gr);
    for (int i = 0; !st && i < KV_TIER_COUNT; i++) rep->row_bytes += gr.bytes_read[i];
    rep->load_ms = kv_now_ms() - t3;
    rep->kept = rows->T;
    free(bl), free(pick), free(take), free(score), free(q), free(ql), free(ids);
    kv_tree_sketch_free(&sk);
    return st;
}
