/*
 * kv_qaware (see kv_qaware.h): sketch, probe, score, pick, load.  The
 * scoring runs on the GPU (lib/eval/kv_qaware_gpu.c) when the runner does,
 * else here on the host (kv_qaware_score_cpu, also the GPU's reference).
 */
#include "eval/kv_qaware.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "common/kv_stats.h"
#include "gpu/kv_gpu_engine.h"
#include "eval/kv_qaware_gpu.h"
#include "policy/kv_prefix.h"

/* A key sketch larger than this is read by several threads (sketch_run). */
#define KV_QAWARE_SKETCH_PAR_BYTES (4.0 * 1024 * 1024)

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

/* lg[t * Q + j] = qs[j] . code[t] for n int8 rows of r channels and Q
 * float queries, qsT (r, Q) the queries transposed.  Vectorised across the
 * queries (no horizontal sums), and built for AVX2 too, chosen at run time
 * (the build targets x86-64-v2). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void dot_rows(const int8_t *code, int n, int r, const float *qsT, int Q, float *lg)
{
    for (int t = 0; t < n; t++) {
        const int8_t *c = code + (size_t)t * r;
        float *acc = lg + (size_t)t * Q;
        for (int j = 0; j < Q; j++) acc[j] = 0;
        for (int i = 0; i < r; i++) {
            const float x = (float)c[i], *qi = qsT + (size_t)i * Q;
#pragma omp simd
            for (int j = 0; j < Q; j++) acc[j] += qi[j] * x;
        }
    }
}

/* e^x for x <= 0, to about 1e-5 relative (2^n by the exponent bits, 2^f
 * by a degree-6 polynomial): softmax weights for a ranking need no more,
 * and unlike expf it vectorises. */
static inline float exp_le0(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float y = x * 1.44269504f, n = floorf(y), f = y - n; /* f in [0, 1) */
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022650e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float sc;
    memcpy(&sc, &e, 4);
    return p * sc;
}

/* out[t] = sum_j softmax_t(lg[. * Q + j])[t]: each query's softmax over the
 * m rows, vectorised across the queries; mx, sum: room for Q. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void softmax_sum(float *lg, int m, int Q, float *mx, float *sum, float *out)
{
    for (int j = 0; j < Q; j++) mx[j] = -INFINITY, sum[j] = 0;
    for (int t = 0; t < m; t++)
        for (int j = 0; j < Q; j++) mx[j] = lg[(size_t)t * Q + j] > mx[j] ? lg[(size_t)t * Q + j] : mx[j];
    for (int t = 0; t < m; t++) {
        float *row = lg + (size_t)t * Q;
#pragma omp simd
        for (int j = 0; j < Q; j++) sum[j] += (row[j] = exp_le0(row[j] - mx[j]));
    }
    for (int j = 0; j < Q; j++) sum[j] = 1.0f / sum[j];
    for (int t = 0; t < m; t++) {
        const float *row = lg + (size_t)t * Q;
        float a = 0;
        for (int j = 0; j < Q; j++) a += row[j] * sum[j];
        out[t] = a;
    }
}

/* score[t] (t over the m matched positions): the attention position t gets
 * over the sketched keys from each (layer, KV head)'s query group (its
 * query heads' queries, each a softmax), the largest of them or their sum.
 * One task per layer and KV head: each sketched row is widened to float
 * once and met by all the group's queries (an int8 x float GEMM, row by
 * row), then each query's softmax over the whole prefix. */
kv_status kv_qaware_score_cpu(const kv_tree_sketch *sk, const float *q, int L, int H, int Hkv, int nq, int D,
                              kv_qaware_heads how, double *score)
{
    const int m = sk->matched, g = H / Hkv, Q = g * nq, tasks = L * Hkv;
    const float inv = 1.0f / sqrtf((float)D);
    float *part = malloc((size_t)tasks * m * sizeof *part + 1);
    if (!part) return kv_fail(KV_E_NOMEM, "out of memory for the scores");
    bool ok = true;
#pragma omp parallel for schedule(dynamic, 1)
    for (int task = 0; task < tasks; task++) {
        const int l = task / Hkv, h = task % Hkv;
        float *lg = malloc((size_t)Q * m * sizeof *lg + 1), *qs = malloc((size_t)Q * D * sizeof *qs + 1),
              *x = malloc(2 * (size_t)Q * sizeof *x + 1), *out = part + (size_t)task * m;
        if (!lg || !qs || !x) {
#pragma omp atomic write
            ok = false;
            free(lg), free(qs), free(x);
            continue;
        }
        for (int si = 0; si < sk->nseg; si++) {
            const kv_tree_sketch_seg *sg = &sk->seg[si];
            const size_t lh = (size_t)l * Hkv + h;
            const int r = sg->r;
            const uint16_t *ch = sg->ch + lh * r;
            const float *scl = sg->scale + lh * r;
            for (int j = 0; j < Q; j++) { /* the folded query: channels kept, times their scale */
                const float *qv = q + (((size_t)l * H + h * g + j / nq) * nq + j % nq) * D;
                for (int i = 0; i < r; i++) qs[(size_t)i * Q + j] = qv[ch[i]] * scl[i] * inv;
            }
            dot_rows(sg->code + lh * (size_t)sg->rows * r, sg->n, r, qs, Q, lg + (size_t)sg->start * Q);
        }
        softmax_sum(lg, m, Q, x, x + Q, out);
        free(lg), free(qs), free(x);
    }
    for (int task = 0; ok && task < tasks; task++) /* in task order: deterministic */
        for (int t = 0; t < m; t++) {
            const double v = part[(size_t)task * m + t];
            if (how == KV_QAWARE_SUM) score[t] += v;
            else if (v > score[t]) score[t] = v;
        }
    free(part);
    return ok ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory for the scores");
}

kv_status kv_qaware_follow(const double *score, int m, int follow, double *out)
{
    if (follow < 0) follow = 0;
    int *dq = malloc((size_t)m * sizeof *dq + 8); /* a sliding-window max: O(m) whatever follow is */
    if (!dq) return kv_fail(KV_E_NOMEM, "out of memory");
    for (int t = 0, h = 0, e = 0; t < m; t++) { /* dq[h..e): positions of decreasing score in [t - follow, t] */
        while (e > h && score[dq[e - 1]] <= score[t]) e--;
        dq[e++] = t;
        if (dq[h] < t - follow) h++;
        out[t] = score[dq[h]];
    }
    free(dq);
    return KV_OK;
}

kv_status kv_qaware_pick(const kv_tree_sketch *sk, const double *score0, double frac, int follow, int32_t *pick,
                         int *np)
{
    const int m = sk->matched;
    if (follow < 0) follow = 0;
    /* each position carries its score to the follow positions after it:
     * the question's queries find where an answer starts, the tokens
     * generated next read on from there */
    double *sw = malloc((size_t)m * sizeof *sw + 8);
    kv_status fst = sw ? kv_qaware_follow(score0, m, follow, sw) : kv_fail(KV_E_NOMEM, "out of memory");
    if (fst) {
        free(sw);
        return fst;
    }
    const double *score = sw;
    int nb = 0, keep = (int)ceil(frac * m);
    if (keep > m) keep = m;
    *np = 0;
    for (int si = 0; si < sk->nseg; si++) nb += (sk->seg[si].n + sk->seg[si].frame_rows - 1) / sk->seg[si].frame_rows;
    pblock *bl = malloc((size_t)(nb + 1) * sizeof *bl);
    char *take = calloc((size_t)m + 1, 1);
    if (!bl || !take) {
        free(bl), free(take), free(sw);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    int b = 0;
    for (int si = 0; si < sk->nseg; si++) {
        const kv_tree_sketch_seg *sg = &sk->seg[si];
        for (int f = 0; f * sg->frame_rows < sg->n; f++, b++) {
            double a = 0;
            for (int t = f * sg->frame_rows; t < sg->n && t < (f + 1) * sg->frame_rows; t++) a += score[sg->start + t];
            bool edge = (si == 0 && f == 0) || (si == sk->nseg - 1 && (f + 1) * sg->frame_rows >= sg->n);
            bl[b] = (pblock){si, f, edge ? INFINITY : a};
        }
    }
    qsort(bl, (size_t)nb, sizeof *bl, cmp_block);
    int got = 0;
    for (int i = 0; i < nb && got < keep; i++) {
        const kv_tree_sketch_seg *sg = &sk->seg[bl[i].seg];
        for (int t = bl[i].f * sg->frame_rows; t < sg->n && t < (bl[i].f + 1) * sg->frame_rows; t++)
            take[sg->start + t] = 1, got++;
    }
    for (int t = 0; t < m; t++)
        if (take[t]) pick[(*np)++] = t;
    free(bl), free(take), free(sw);
    return KV_OK;
}

/* The sketch read on a second thread while the probe runs (the probe is
 * GPU work and CUDA calls, the read is file I/O and copying).  Reads of
 * the store from several threads at once are safe (they change nothing in
 * it; kv_tree_store_load_start's sink read runs beside this one); the
 * probe does not touch the store. */
typedef struct {
    kv_tree_store *s;
    const kv_tree_alloc *al;
    const int32_t *ids;
    int n;
    kv_tree_sketch *sk;
    kv_status st;
    double ms;
    char why[512]; /* the thread's error detail (thread-local there) */
    bool own_thread;
    int threads;    /* of the read's own thread (KV_QAWARE_SKETCH_PAR_BYTES) */
    int device;     /* >= 0: then copy the codes to this GPU (kv_qaware_gpu_stage) */
    int L, Hkv;
    kv_qaware_staged *staged;
    double stage_ms;
} sketch_job;

static void *sketch_run(void *p)
{
    sketch_job *j = p;
    /* an OpenMP team in a new thread is created afresh each request
     * (measured: a niah4k read, 1 MB, then ended ~0.5 ms after the probe),
     * so small sketches are read on this thread alone; an 8B-shaped one
     * (28 MB at 3.5k tokens) took 11 ms so, longer than the probe beside it */
#ifdef _OPENMP /* the fuzz build has no OpenMP runtime */
    if (j->own_thread) omp_set_num_threads(j->threads);
#endif
    double t = kv_now_ms();
    j->st = kv_tree_store_sketch_ex(j->s, j->ids, j->n, j->al, j->sk);
    if (!j->st && j->device >= 0 && j->sk->matched > 0) {
        double ts = kv_now_ms();
        if ((j->st = kv_qaware_gpu_stage(j->sk, j->L, j->Hkv, j->device, &j->staged)))
            kv_errcontext("copying the key sketch to the GPU");
        j->stage_ms = kv_now_ms() - ts;
    }
    if (j->st) snprintf(j->why, sizeof j->why, "%s", kv_errdetail());
    j->ms = kv_now_ms() - t;
    return NULL;
}

kv_status kv_qaware_load(kv_runner *r, kv_tree_store *s, const int *tok, int n, const kv_qaware_opts *o,
                         kv_tree_rows *rows, kv_qaware_report *rep)
{
    return kv_qaware_load_start(r, s, tok, n, o, 0, rows, rep, NULL);
}

kv_status kv_qaware_load_start(kv_runner *r, kv_tree_store *s, const int *tok, int n, const kv_qaware_opts *o,
                               int threads, kv_tree_rows *rows, kv_qaware_report *rep, kv_tree_pending **pend)
{
    if (pend) *pend = NULL;
    memset(rows, 0, sizeof *rows);
    memset(rep, 0, sizeof *rep);
    const kv_model_config *c = &kv_runner_model(r)->cfg;
    const int L = c->n_layers, H = c->n_heads, Hkv = c->n_kv_heads, D = c->head_dim;
    if (!kv_tree_store_tree(s)->has_geom || n < 2) return KV_OK;
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    if (!ids) return kv_fail(KV_E_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) ids[i] = tok[i];
    /* the match (from the index alone) sizes the probe; the sketch is read
     * beside the probe and must agree with it */
    int *path = malloc((size_t)n * sizeof *path), npath = 0, used = 0;
    if (!path) {
        free(ids);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    const int m = kv_tree_match(kv_tree_store_tree(s), ids, n - 1, path, &npath, &used);
    free(path);
    kv_tree_sketch sk;
    memset(&sk, 0, sizeof sk);
    if (!m) {
        free(ids);
        return KV_OK;
    }
    rep->matched = m;
    kv_status st = KV_OK;
    /* the probe: the sink row, then the request's last tokens at their positions */
    int P = n - m < o->probe ? n - m : o->probe, nq = P < o->queries ? P : o->queries;
    kv_tree_rows sink;
    memset(&sink, 0, sizeof sink);
    kv_get_report gr;
    int32_t zero = 0;
    double t1 = kv_now_ms();
    /* q: the nq scored queries of every layer and head; ql: one layer's
     * capture (at most nq positions since kv_runner_keep(r, nq), sized for P) */
    float *q = malloc((size_t)L * H * nq * D * sizeof *q + 1), *ql = malloc((size_t)H * P * D * sizeof *ql + 1);
    double *score = calloc((size_t)m, sizeof *score);
    if (!q || !ql || !score) st = kv_fail(KV_E_NOMEM, "out of memory");
    /* loaded beside the caller (pend): the sink row read layer by layer on the
     * store's worker while the probe runs, the probe waiting for each layer */
    kv_tree_pending *sink_pend = NULL;
    if (!st && pend)
        st = kv_tree_store_load_start(s, ids, n - 1, 1, &zero, 1, false, o->now, NULL, threads, &sink, &sink_pend);
    else if (!st) st = kv_tree_store_load(s, ids, n - 1, 1, &zero, 1, false, o->now, &sink, &gr);
    for (int i = 0; !st && !sink_pend && i < KV_TIER_COUNT; i++) rep->sketch_bytes += gr.bytes_read[i];
    double tp = kv_now_ms();
    rep->probe_sink_ms = tp - t1;
    /* the sketch's bytes, to choose the read's threads: the store's sketch
     * channels (half of head_dim by default) of every key, int8 (chunks
     * written under another setting keep theirs: an estimate) */
    const double sk_bytes = (double)m * L * Hkv * kv_tree_sketch_channels(D, kv_tree_store_tree(s)->sketch_channels);
    int sk_threads = 1;
#ifdef _OPENMP
    if (sk_bytes > KV_QAWARE_SKETCH_PAR_BYTES) sk_threads = omp_get_num_procs() < 8 ? omp_get_num_procs() : 8;
#endif
    /* on the GPU the read's thread also issues the codes' copy to the device */
    const int dev = kv_runner_gpu(r) ? kv_gpu_engine_ordinal(kv_runner_gpu(r)) : -1;
    sketch_job job = {s, o->sketch_al, ids, n - 1, &sk, KV_OK, 0, "", true, sk_threads, dev, L, Hkv, NULL, 0};
    pthread_t th;
    double tsp = kv_now_ms();
    bool threaded = false;
    if (!st && o->sketch_serial) { /* before the probe, on this thread */
        job.own_thread = false;
        sketch_run(&job);
    } else if (!st) {
        threaded = pthread_create(&th, NULL, sketch_run, &job) == 0;
        if (!threaded) job.own_thread = false; /* then run here, after the probe */
    }
    rep->sketch_spawn_ms = threaded ? kv_now_ms() - tsp : 0;
    if (o->sketch_serial) tp = kv_now_ms(); /* the probe's prefill starts after the read */
    if (!st) {
        kv_prefix pre = {.T = 1, .matched = n - P, .n_kv_heads = Hkv, .head_dim = D, .positions = sink.positions,
                         .tokens = sink.tokens, .dt = sink.dt, .k = (const void *const *)sink.k,
                         .v = (const void *const *)sink.v, .wait = sink_pend ? kv_tree_pending_wait : NULL,
                         .wait_user = sink_pend};
        /* only the last nq queries are scored: capturing all P cost a
         * conversion of every probe query, 11 ms of an 8B-shaped probe */
        if (!(st = kv_runner_keep(r, nq, false))) st = kv_runner_prefill_from(r, &pre, tok + n - P, P, NULL);
        if (!st && kv_runner_gpu(r)) {
            kv_gpu_prefill_phases ph;
            kv_gpu_engine_prefill_phases(kv_runner_gpu(r), &ph);
            rep->probe_pf[0] = ph.setup, rep->probe_pf[1] = ph.rows, rep->probe_pf[2] = ph.compute;
            rep->probe_pf[3] = ph.logits, rep->probe_pf[4] = ph.total;
        }
        for (int l = 0; !st && l < L; l++) {
            int got = kv_runner_queries(r, l, ql);
            if (got < nq) {
                st = kv_fail(KV_E_INTERNAL, "the probe kept %d queries of layer %d, not %d", got, l, nq);
                break;
            }
            for (int h = 0; h < H; h++) /* the last nq of each head */
                memcpy(q + (((size_t)l * H + h) * nq) * D, ql + ((size_t)h * got + (got - nq)) * D, (size_t)nq * D * sizeof *q);
        }
    }
    if (sink_pend) { /* the sink's read ends (its own error first), before its rows go */
        kv_get_report sr;
        kv_status sst = kv_tree_load_finish(sink_pend, &sr, NULL, NULL);
        if (!st) st = sst;
        for (int i = 0; !sst && i < KV_TIER_COUNT; i++) rep->sketch_bytes += sr.bytes_read[i];
    }
    kv_tree_rows_free(&sink);
    double tr = kv_now_ms();
    rep->probe_prefill_ms = tr - tp;
    kv_status st2 = kv_runner_reset(r, NULL);
    if (!st2) st2 = kv_runner_keep(r, o->keep_nq, o->keep_kv);
    if (!st) st = st2;
    rep->probe_ms = kv_now_ms() - t1 - (o->sketch_serial ? job.ms : 0); /* the serial read is sketch_ms */
    rep->probe_reset_ms = kv_now_ms() - tr;
    double tj = kv_now_ms();
    if (threaded) pthread_join(th, NULL);
    else if (!st && !o->sketch_serial) sketch_run(&job); /* no thread (own_thread false): after the probe */
    rep->sketch_ms = job.ms;
    rep->sketch_stage_ms = job.stage_ms;
    rep->sketch_wait_ms = o->sketch_serial ? 0 : kv_now_ms() - tj;
    if (!st && job.st) st = kv_fail(job.st, "%s", job.why);
    if (!st && sk.matched != m)
        st = kv_fail(KV_E_INTERNAL, "the sketch covers %d tokens, the index matched %d", sk.matched, m);
    for (int i = 0; !st && i < KV_TIER_COUNT; i++) rep->sketch_bytes += sk.bytes_read[i];
    /* score, then whole frames by score */
    double t2 = kv_now_ms();
    if (!st && kv_runner_gpu(r)) { /* the runner is on the GPU, so a device is there: a failure is an error */
        kv_qaware_gpu_times gt = {0, 0, 0};
        st = job.staged ? kv_qaware_score_gpu_staged(job.staged, &sk, q, L, H, Hkv, nq, D, o->heads, score, &gt)
                        : kv_qaware_score_gpu(&sk, q, L, H, Hkv, nq, D, o->heads,
                                              kv_gpu_engine_ordinal(kv_runner_gpu(r)), score, &gt);
        if (st) kv_errcontext("query-aware scoring on the GPU");
        rep->score_upload_ms = gt.upload_ms, rep->score_gpu = !st;
    } else if (!st)
        st = kv_qaware_score_cpu(&sk, q, L, H, Hkv, nq, D, o->heads, score);
    int32_t *pick = malloc((size_t)m * sizeof *pick + 4);
    int np = 0;
    if (!st && !pick) st = kv_fail(KV_E_NOMEM, "out of memory");
    if (!st) st = kv_qaware_pick(&sk, score, o->frac, o->follow < 0 ? 0 : o->follow ? o->follow : KV_QAWARE_FOLLOW, pick,
                                 &np);
    rep->score_ms = kv_now_ms() - t2;
    double t3 = kv_now_ms();
    if (!st && pend) /* the rows read beside the caller, layer by layer: their bytes come at the finish */
        st = kv_tree_store_load_start(s, ids, n - 1, 1, pick, np, false, o->now, o->al, threads, rows, pend);
    else if (!st) st = kv_tree_store_load_ex(s, ids, n - 1, 1, pick, np, false, o->now, o->al, rows, &gr);
    for (int i = 0; !st && !pend && i < KV_TIER_COUNT; i++) rep->row_bytes += gr.bytes_read[i];
    rep->load_ms = kv_now_ms() - t3;
    rep->kept = rows->T;
    free(pick), free(score), free(q), free(ql), free(ids);
    kv_qaware_gpu_unstage(job.staged); /* before the codes it may still be copying go */
    kv_tree_sketch_free(&sk);
    return st;
}
