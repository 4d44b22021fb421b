/*
 * Query-aware scoring on the GPU (kv_qaware_score_gpu, kernels/qaware_score.cu)
 * against its CPU reference (kv_qaware_score_cpu) on fresh random sketches:
 * a small geometry (channels a multiple of 4 and not), Llama-3.1-8B's
 * (32 layers, 32 query and 8 KV heads, head dim 128, 32 sketched
 * channels, 4 queries, 4000 positions in 3 segments, one with more rows
 * stored than matched) and 8B's at 32k positions, timed.  Scores agree to
 * rel 1e-4 + abs 1e-6 (the host's exponential is a polynomial good to
 * 1e-5, the device's expf), every softmax sums to one, and the frames
 * picked at 25% are the same: on sketches whose frames differ in salience
 * (distinct frame scores) always; on plain noise, where neighbouring frame
 * sums can lie closer than the tolerance, whenever the gap at the cut is
 * wider than 1e-3 relative (else the cut is reported, not failed).
 * Then a whole query-aware load of a niah4k haystack with the runner on
 * the GPU scores there and keeps 25% (how much of the needle is printed).  Without a usable GPU every
 * test is a TAP skip.  KV_TEST_FILTER=a,b runs the tests whose names hold
 * a or b.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "kt_kv.h"
#include "kt_qaware.h"
#include "common/kv_file.h"
#include "common/kv_stats.h"
#include "engine/kv_runner.h"
#include "eval/kv_qaware.h"
#include "format/kvc.h"
#include "gpu/kv_gpu.h"
#include "gpu/kv_gpu_engine.h"
#include "eval/kv_qaware_gpu.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"
#include "tree/kv_tree.h"

typedef struct {
    int L, H, Hkv, D, r, nq, frame_rows;
    int nseg, n[4], extra[4]; /* matched rows per segment; rows stored beyond them */
    int salient;              /* frames of distinct salience (else plain noise) */
} geom;

/* A random sketch and queries for g (free with kv_tree_sketch_free, free).
 * Salient: the queries lean one way on every channel and each frame's codes
 * lean along it by a factor of its own (a permutation of evenly spaced
 * values), so frame scores are far apart. */
static float *make_case(const geom *g, unsigned long long seed, kv_tree_sketch *sk)
{
    unsigned long long rs = seed;
    const int LH = g->L * g->Hkv;
    memset(sk, 0, sizeof *sk);
    sk->nseg = g->nseg;
    sk->seg = calloc((size_t)g->nseg, sizeof *sk->seg);
    int start = 0, nframes = 0;
    for (int s = 0; s < g->nseg; s++) nframes += (g->n[s] + g->frame_rows - 1) / g->frame_rows;
    double *lean = malloc((size_t)nframes * sizeof *lean);
    for (int f = 0; f < nframes; f++) lean[f] = -1 + 2.0 * f / (nframes > 1 ? nframes - 1 : 1);
    for (int f = nframes - 1; f > 0; f--) { /* shuffled */
        int k = (int)(kt_rand(&rs) * (f + 1));
        double x = lean[f];
        lean[f] = lean[k], lean[k] = x;
    }
    int *pool = malloc((size_t)g->D * sizeof *pool);
    for (int s = 0, f0 = 0; s < g->nseg; s++) {
        kv_tree_sketch_seg *sg = &sk->seg[s];
        const int rows = g->n[s] + g->extra[s], r = g->r;
        *sg = (kv_tree_sketch_seg){start, g->n[s], rows, r, g->frame_rows, malloc((size_t)LH * r * sizeof(uint16_t)),
                                   malloc((size_t)LH * r * sizeof(float)), malloc((size_t)LH * rows * r)};
        for (int lh = 0; lh < LH; lh++) {
            /* r distinct channels, increasing */
            for (int d = 0; d < g->D; d++) pool[d] = d;
            for (int i = 0; i < r; i++) {
                int k = i + (int)(kt_rand(&rs) * (g->D - i));
                int x = pool[i];
                pool[i] = pool[k], pool[k] = x;
            }
            for (int i = 1; i < r; i++)
                for (int k = i; k > 0 && pool[k - 1] > pool[k]; k--) {
                    int x = pool[k];
                    pool[k] = pool[k - 1], pool[k - 1] = x;
                }
            for (int i = 0; i < r; i++) {
                sg->ch[(size_t)lh * r + i] = (uint16_t)pool[i];
                sg->scale[(size_t)lh * r + i] = (float)(0.01 + 0.02 * kt_rand(&rs));
            }
            for (int t = 0; t < rows; t++)
                for (int i = 0; i < r; i++) {
                    double c = g->salient ? 60 * lean[f0 + (t < g->n[s] ? t : 0) / g->frame_rows] + 30 * kt_randn(&rs)
                                          : 73 * kt_randn(&rs);
                    c = c > 127 ? 127 : c < -127 ? -127 : c;
                    sg->code[((size_t)lh * rows + t) * r + i] = (int8_t)lrint(c);
                }
        }
        f0 += (g->n[s] + g->frame_rows - 1) / g->frame_rows;
        start += g->n[s];
    }
    sk->matched = start;
    const size_t nqf = (size_t)g->L * g->H * g->nq * g->D;
    float *q = malloc(nqf * sizeof *q);
    for (size_t i = 0; i < nqf; i++) q[i] = g->salient ? 1 + 0.3f * kt_randn(&rs) : kt_randn(&rs);
    free(pool), free(lean);
    return q;
}

/* The relative gap at the cut of kv_qaware_pick(frac) between the score
 * sums of the last frame taken and the first left (edge frames aside); 1
 * when the cut falls on no such pair. */
typedef struct {
    double sum;
    int len;
} frame;

static int cmp_frame(const void *a, const void *b)
{
    double x = ((const frame *)a)->sum, y = ((const frame *)b)->sum;
    return x > y ? -1 : x < y;
}

static double cut_gap(const kv_tree_sketch *sk, const double *score, double frac)
{
    int nb = 0, edge_rows = 0, k = 0;
    for (int s = 0; s < sk->nseg; s++) nb += (sk->seg[s].n + sk->seg[s].frame_rows - 1) / sk->seg[s].frame_rows;
    frame *fr = malloc((size_t)(nb + 1) * sizeof *fr);
    for (int s = 0; s < sk->nseg; s++) {
        const kv_tree_sketch_seg *sg = &sk->seg[s];
        for (int f = 0; f * sg->frame_rows < sg->n; f++) {
            const int a = f * sg->frame_rows, b = a + sg->frame_rows < sg->n ? a + sg->frame_rows : sg->n;
            if ((s == 0 && f == 0) || (s == sk->nseg - 1 && b == sg->n)) {
                edge_rows += b - a;
                continue;
            }
            double x = 0;
            for (int t = a; t < b; t++) x += score[sg->start + t];
            fr[k++] = (frame){x, b - a};
        }
    }
    qsort(fr, (size_t)k, sizeof *fr, cmp_frame);
    const int keep = (int)ceil(frac * sk->matched);
    int got = edge_rows, i = 0;
    while (i < k && got < keep) got += fr[i++].len;
    const double gap = i > 0 && i < k ? (fr[i - 1].sum - fr[i].sum) / fabs(fr[i - 1].sum) : 1;
    free(fr);
    return gap;
}

/* GPU against CPU on case g, the heads' scores combined by how: scores,
 * softmax totals (the sum), picks; the times printed for the record. */
static void compare_how(const geom *g, unsigned long long seed, const char *what0, kv_qaware_heads how)
{
    char what[200];
    snprintf(what, sizeof what, "%s, %s", what0, how == KV_QAWARE_SUM ? "sum" : "max");
    kv_tree_sketch sk;
    float *q = make_case(g, seed, &sk);
    const int m = sk.matched, Q = g->H / g->Hkv * g->nq;
    double *a = calloc((size_t)m, sizeof *a), *b = calloc((size_t)m, sizeof *b);
    double tc = kv_now_ms();
    OK(kv_qaware_score_cpu(&sk, q, g->L, g->H, g->Hkv, g->nq, g->D, how, a));
    tc = kv_now_ms() - tc;
    kv_qaware_gpu_times tm;
    double tg = kv_now_ms();
    kv_status st = kv_qaware_score_gpu(&sk, q, g->L, g->H, g->Hkv, g->nq, g->D, how, 0, b, &tm);
    tg = kv_now_ms() - tg;
    KT_CHECK(st == KV_OK, "kv_qaware_score_gpu: %s", kv_errdetail());
    if (st == KV_OK) {
        int bad = 0, worst_t = 0;
        double worst = 0, ta = 0, tb = 0, d2 = 0, s2 = 0;
        for (int t = 0; t < m; t++) {
            double e = fabs(a[t] - b[t]), tol = 1e-4 * fabs(a[t]) + 1e-6;
            bad += !(e <= tol);
            if (e / tol > worst) worst = e / tol, worst_t = t;
            ta += a[t], tb += b[t], d2 += e * e, s2 += a[t] * a[t];
        }
        KT_CHECK(bad == 0, "%s: %d of %d scores off; worst at %d: cpu %.9g gpu %.9g", what, bad, m, worst_t,
                 a[worst_t], b[worst_t]);
        const double softmaxes = (double)g->L * g->Hkv * Q;
        if (how == KV_QAWARE_SUM)
            KT_CHECK(fabs(ta - softmaxes) < 1e-3 * softmaxes && fabs(tb - softmaxes) < 1e-3 * softmaxes,
                     "%s: totals cpu %.6f gpu %.6f, want %.0f", what, ta, tb, softmaxes);
        else /* each position's largest pair is at most the pair's g * nq queries' mass */
            KT_CHECK(ta > 0 && ta < softmaxes && fabs(ta - tb) < 1e-3 * ta, "%s: totals cpu %.6f gpu %.6f", what, ta, tb);
        int32_t *pa = malloc((size_t)m * sizeof *pa), *pb = malloc((size_t)m * sizeof *pb);
        int na = 0, nb = 0;
        OK(kv_qaware_pick(&sk, a, 0.25, 0, pa, &na)); /* follow 0: cut_gap's frame sums */
        OK(kv_qaware_pick(&sk, b, 0.25, 0, pb, &nb));
        const bool same = na == nb && !memcmp(pa, pb, (size_t)na * sizeof *pa);
        const double gap = cut_gap(&sk, a, 0.25);
        if (g->salient && how == KV_QAWARE_SUM) /* the data's own promise (checked on the CPU when the test was written) */
            KT_CHECK(gap > 1e-3, "%s: salient frames, yet a gap of %.3g at the cut", what, gap);
        if (gap > 1e-3)
            KT_CHECK(same, "%s: picks differ (%d and %d positions; the gap at the cut %.3g)", what, na, nb, gap);
        else if (!same)
            printf("# %s: picks differ at a near tie (gap %.3g at the cut): allowed\n", what, gap);
        printf("# %s: m %d, normalized error %.3g, worst %.3g of the tolerance, gap at the cut %.3g, picks %s; "
               "cpu %.2f ms, gpu %.2f ms (upload %.2f, kernels %.2f, download %.2f)\n",
               what, m, sqrt(d2 / (s2 > 0 ? s2 : 1)), worst, gap, same ? "equal" : "differ", tc, tg, tm.upload_ms,
               tm.kernel_ms, tm.download_ms);
        free(pa), free(pb);
    }
    kv_tree_sketch_free(&sk);
    free(q), free(a), free(b);
}

static void compare(const geom *g, unsigned long long seed, const char *what)
{
    compare_how(g, seed, what, KV_QAWARE_SUM);
    compare_how(g, seed, what, KV_QAWARE_MAX);
}

static void test_gpu_scores_match_the_cpu_small(void)
{
    geom g = {2, 4, 2, 16, 4, 2, 8, 3, {100, 37, 163, 0}, {0, 11, 0, 0}, 0};
    compare(&g, 1, "small, noise");
    g.salient = 1;
    compare(&g, 2, "small, salient");
    g.r = 3, g.salient = 0; /* channels not a multiple of 4: the kernel's scalar path */
    compare(&g, 3, "small, r 3");
    g.nseg = 1, g.n[0] = 1, g.extra[0] = 2; /* one position */
    compare(&g, 4, "one position");
}

static void test_gpu_scores_match_the_cpu_8b(void)
{
    geom g = {32, 32, 8, 128, 32, 4, 64, 3, {1500, 1700, 800, 0}, {0, 0, 224, 0}, 1};
    compare(&g, 5, "8B, salient");
    g.salient = 0;
    compare(&g, 6, "8B, noise");
}

static void test_gpu_scores_match_the_cpu_8b_32k_timed(void)
{
    geom g = {32, 32, 8, 128, 32, 4, 256, 2, {16384, 16384, 0, 0}, {0, 0, 0, 0}, 1};
    compare(&g, 7, "8B, 32k");
    compare(&g, 8, "8B, 32k again (warm)");
}

static void test_gpu_rejects_a_sketch_that_does_not_tile(void)
{
    geom g = {2, 4, 2, 16, 4, 2, 8, 2, {10, 10, 0, 0}, {0, 0, 0, 0}, 0};
    kv_tree_sketch sk;
    float *q = make_case(&g, 9, &sk);
    double b[20] = {0};
    sk.seg[1].start = 11; /* a hole at 10 */
    kv_status st = kv_qaware_score_gpu(&sk, q, g.L, g.H, g.Hkv, g.nq, g.D, KV_QAWARE_SUM, 0, b, NULL);
    KT_CHECK(st == KV_E_INTERNAL && strstr(kv_errdetail(), "tiling"), "status %d: %s", st, kv_errdetail());
    sk.seg[1].start = 10;
    KT_CHECK(b[0] == 0, "scores untouched on failure");
    kv_tree_sketch_free(&sk);
    free(q);
}

typedef struct {
    const kv_tree_sketch *sk;
    const geom *g;
    kv_qaware_staged *staged;
    kv_status st;
} stage_job;

static void *stage_on_thread(void *p)
{
    stage_job *j = p;
    j->st = kv_qaware_gpu_stage(j->sk, j->g->L, j->g->Hkv, 0, &j->staged);
    return NULL;
}

/* The codes' copy issued on another thread (as a query-aware load's
 * sketch read does while the probe runs), the scoring on this one: the
 * scores equal the one-call GPU scoring's exactly (same kernels, same
 * inputs); a staged sketch scored with another sketch's size, or another
 * geometry, is refused with the scores untouched. */
static void test_gpu_stage_on_another_thread_scores_the_same(void)
{
    geom g = {32, 32, 8, 128, 32, 4, 64, 3, {1500, 1700, 800, 0}, {0, 0, 224, 0}, 1};
    kv_tree_sketch sk;
    float *q = make_case(&g, 10, &sk);
    const int m = sk.matched;
    double *a = calloc((size_t)m, sizeof *a), *b = calloc((size_t)m, sizeof *b);
    OK(kv_qaware_score_gpu(&sk, q, g.L, g.H, g.Hkv, g.nq, g.D, KV_QAWARE_MAX, 0, a, NULL));
    stage_job j = {&sk, &g, NULL, KV_OK};
    pthread_t th;
    KT_REQUIRE(pthread_create(&th, NULL, stage_on_thread, &j) == 0, "thread");
    pthread_join(th, NULL);
    KT_CHECK(j.st == KV_OK && j.staged, "stage: %s", kv_errdetail());
    if (j.st == KV_OK) {
        kv_qaware_gpu_times tm;
        OK(kv_qaware_score_gpu_staged(j.staged, &sk, q, g.L, g.H, g.Hkv, g.nq, g.D, KV_QAWARE_MAX, b, &tm));
        KT_CHECK(!memcmp(a, b, (size_t)m * sizeof *a), "staged scores differ from the one-call scores");
        printf("# staged on a thread: stage %.2f ms, then upload+wait %.2f, kernels %.2f, download %.2f\n",
               kv_qaware_gpu_stage_ms(j.staged), tm.upload_ms, tm.kernel_ms, tm.download_ms);
        double c[4] = {0, 0, 0, 0};
        const int keep = sk.matched;
        sk.matched = 4;
        kv_errclear();
        KT_CHECK(kv_qaware_score_gpu_staged(j.staged, &sk, q, g.L, g.H, g.Hkv, g.nq, g.D, KV_QAWARE_MAX, c, NULL) ==
                         KV_E_INTERNAL && c[0] == 0, "another sketch's size: %s", kv_errdetail());
        sk.matched = keep;
        KT_CHECK(kv_qaware_score_gpu_staged(j.staged, &sk, q, g.L - 1, g.H, g.Hkv, g.nq, g.D, KV_QAWARE_MAX, b,
                                            NULL) == KV_E_INTERNAL, "another geometry");
    }
    kv_qaware_gpu_unstage(j.staged);
    kv_qaware_gpu_unstage(NULL);
    kv_tree_sketch_free(&sk);
    free(q), free(a), free(b);
}

/* The niah4k haystack put into a store with a key sketch by a CPU runner,
 * then loaded query-aware by a runner on the GPU: the scoring ran there
 * and the 25% kept holds the needle. */
static void test_gpu_runner_scores_a_query_aware_load_on_the_gpu(void)
{
    kt_qaware_task t;
    kt_qaware_task_load(&t);
    KT_REQUIRE(t.ok, "niah4k's first task");
    kv_model *m = t.m;
    const int *ids = t.ids, n = t.n, np = t.np, nn = t.nn;
    char dir[] = "/tmp/test_gpu_qaware_XXXXXX";
    kv_tree_store *s;
    kvc_file *f;
    kv_put_report pr;
    bool stored;
    kv_runner *rc, *rg;
    OK(kv_runner_new(m, NULL, n + 8, KV_DEVICE_CPU, NULL, &rc));
    kt_qaware_store(rc, &t, "disk=raw+sketch", dir, &s, &f, &pr, &stored);
    KT_REQUIRE(stored, "the haystack stored");
    kv_gpu_engine_opts go;
    kv_gpu_engine_opts_default(&go);
    OK(kv_runner_new(m, NULL, n + 8, KV_DEVICE_CUDA, &go, &rg));
    KT_REQUIRE(kv_runner_gpu(rg), "the runner is on the GPU");
    kv_qaware_opts qo = {0.25, KV_QAWARE_PROBE, KV_QAWARE_QUERIES, 0, false, 1001, NULL, false, KV_QAWARE_MAX, 0, NULL};
    kv_qaware_report qr;
    kv_tree_rows rows;
    OK(kv_qaware_load(rg, s, ids, n, &qo, &rows, &qr));
    int hit = 0;
    for (int i = 0; i < rows.T; i++) hit += rows.positions[i] >= nn && rows.positions[i] < nn + 40;
    KT_CHECK(qr.score_gpu && qr.score_upload_ms > 0 && qr.score_upload_ms <= qr.score_ms,
             "scored on the GPU (%d), upload %.3f of %.3f ms", qr.score_gpu, qr.score_upload_ms, qr.score_ms);
    KT_CHECK(rows.T >= (int)ceil(0.25 * np) && rows.T <= (int)ceil(0.25 * np) + 32, "kept %d of %d", rows.T, np);
    /* the needle is not asserted: the GPU engine's fp16 probe gives other
     * queries than the CPU's f32 one (test_qaware asserts it on the CPU) */
    printf("# GPU runner: kept %d of %d, needle %d of 40, score %.2f ms (upload %.2f)\n", rows.T, np, hit, qr.score_ms,
           qr.score_upload_ms);
    kv_tree_rows_free(&rows);
    kv_runner_free(rg);
    kv_runner_free(rc);
    kv_tree_store_close(s);
    kvc_close(f);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
    kt_qaware_task_free(&t);
}

int main(void)
{
    char name[256];
    if (kv_gpu_probe(name, sizeof name) <= 0) {
        printf("# no usable GPU (%s): GPU tests skipped\n", name);
        KT_SKIP(test_gpu_scores_match_the_cpu_small, "no usable GPU");
        KT_SKIP(test_gpu_scores_match_the_cpu_8b, "no usable GPU");
        KT_SKIP(test_gpu_scores_match_the_cpu_8b_32k_timed, "no usable GPU");
        KT_SKIP(test_gpu_rejects_a_sketch_that_does_not_tile, "no usable GPU");
        KT_SKIP(test_gpu_stage_on_another_thread_scores_the_same, "no usable GPU");
        KT_SKIP(test_gpu_runner_scores_a_query_aware_load_on_the_gpu, "no usable GPU");
        return kt_done();
    }
    printf("# GPU: %s\n", name);
    const char *filter = getenv("KV_TEST_FILTER");
    KT_RUN_SELECTED(test_gpu_scores_match_the_cpu_small, filter);
    KT_RUN_SELECTED(test_gpu_scores_match_the_cpu_8b, filter);
    KT_RUN_SELECTED(test_gpu_scores_match_the_cpu_8b_32k_timed, filter);
    KT_RUN_SELECTED(test_gpu_rejects_a_sketch_that_does_not_tile, filter);
    KT_RUN_SELECTED(test_gpu_stage_on_another_thread_scores_the_same, filter);
    KT_RUN_SELECTED(test_gpu_runner_scores_a_query_aware_load_on_the_gpu, filter);
    return kt_done();
}
