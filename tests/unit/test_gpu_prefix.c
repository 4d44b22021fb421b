/*
 * The GPU engine continuing from a stored cache (kv_gpu_engine_prefill_from):
 * on niah4k, "dump the first 90% of a needle prompt, continue with the rest"
 * gives the whole prompt's logits within fp16 tolerance and its greedy
 * answer, with the GPU's own dump and with the CPU's f32 dump, chunked and
 * one token at a time; a positions subset continues, and is dumped, as the
 * CPU engine does;
 * rows already in GPU memory (kv-bench prefix's GPU tier, in segments) give
 * exactly the host path's logits; rows uploaded a layer ahead of the
 * compute give exactly the serial path's, and so do rows still arriving
 * layer by layer while the prefill runs; packed layers are refused; the last
 * chunk's products padded to 16 rows give the exact products' logits, and
 * the warm-up changes none.  Without a usable GPU every test is a TAP skip.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt_niah.h"
#include "common/kv_half.h"
#include "engine/kv_engine.h"
#include "engine/kv_runner.h"
#include "format/kvc.h"
#include "gpu/kv_gpu.h"
#include "model/kv_model.h"
#include "policy/kv_prefix.h"

static kv_model *model;
static int *ids, n_ids;

static double nerr(const float *a, const float *b, int n)
{
    double d = 0, s = 0;
    for (int i = 0; i < n; i++) d += (double)(a[i] - b[i]) * (a[i] - b[i]), s += (double)a[i] * a[i];
    return sqrt(d / (s > 0 ? s : 1));
}

static kv_status runner(kv_device dev, int chunk, kv_runner **r)
{
    kv_gpu_engine_opts go;
    kv_gpu_engine_opts_default(&go);
    go.prefill_chunk = chunk;
    return kv_runner_new(model, NULL, n_ids + 16, dev, &go, r);
}

/* The whole prompt on the GPU: logits after the prefill and 8 greedy ids. */
static void whole_gpu(int chunk, float *logits, int *gen)
{
    kv_runner *r;
    OK(runner(KV_DEVICE_CUDA, chunk, &r));
    OK(kv_runner_prefill(r, ids, n_ids, logits));
    float *l = malloc(259 * sizeof *l);
    memcpy(l, logits, 259 * sizeof *l);
    for (int i = 0; i < 8; i++) {
        gen[i] = kt_argmax(l, 259);
        OK(kv_runner_step(r, gen[i], l));
    }
    free(l);
    kv_runner_free(r);
}

/* The first `split` tokens dumped by dev's engine into path. */
static void dump_prefix(kv_device dev, int split, kv_dtype dt, const char *path)
{
    kv_runner *r;
    OK(runner(dev, 0, &r));
    OK(kv_runner_keep(r, 8, true));
    OK(kv_runner_prefill(r, ids, split, NULL));
    OK(kv_runner_dump_kvc(r, ids, split, dt, path, 0));
    kv_runner_free(r);
}

/* Continue pre on the GPU; compare with the whole prompt's logits a and ids. */
static void continue_gpu(const kv_prefix *pre, int chunk, const float *a, const int *want, double tol,
                         float *out_logits)
{
    kv_runner *r;
    OK(runner(KV_DEVICE_CUDA, chunk, &r));
    float *b = malloc(259 * sizeof *b);
    OK(kv_runner_prefill_from(r, pre, ids + pre->matched, n_ids - pre->matched, b));
    if (out_logits) memcpy(out_logits, b, 259 * sizeof *b);
    double e = nerr(a, b, 259);
    KT_CHECK(e < tol, "continued logits: normalized error %.3g (chunk %d)", e, chunk);
    int same = 0;
    for (int i = 0; i < 8; i++) {
        int t = kt_argmax(b, 259);
        same += t == want[i];
        OK(kv_runner_step(r, t, b));
    }
    KT_CHECK(same == 8, "%d of 8 greedy ids as the whole prompt's (chunk %d)", same, chunk);
    free(b);
    kv_runner_free(r);
}

static void test_gpu_dump_then_continue_matches_the_whole_prompt(void)
{
    float a[259];
    int gen[8];
    const int split = n_ids * 9 / 10;
    for (int pass = 0; pass < 2; pass++) {
        int chunk = pass ? -1 : 0; /* chunked, then one token at a time */
        whole_gpu(chunk, a, gen);
        dump_prefix(KV_DEVICE_CUDA, split, KV_DT_F16, "/tmp/test_gpu_prefix_g.kvc");
        kvc_file *f;
        OK(kvc_open("/tmp/test_gpu_prefix_g.kvc", &f));
        kv_prefix pre;
        OK(kv_prefix_from_kvc(model, f, &pre));
        continue_gpu(&pre, chunk, a, gen, 1e-2, NULL);
        kvc_close(f);
        unlink("/tmp/test_gpu_prefix_g.kvc");
    }
}

static void test_cpu_f32_dump_continues_on_the_gpu(void)
{
    float a[259];
    int gen[8];
    whole_gpu(0, a, gen);
    dump_prefix(KV_DEVICE_CPU, n_ids * 9 / 10, KV_DT_F32, "/tmp/test_gpu_prefix_c.kvc");
    kvc_file *f;
    OK(kvc_open("/tmp/test_gpu_prefix_c.kvc", &f));
    kv_prefix pre;
    OK(kv_prefix_from_kvc(model, f, &pre));
    continue_gpu(&pre, 0, a, gen, 2e-2, NULL);
    kvc_close(f);
    unlink("/tmp/test_gpu_prefix_c.kvc");
}

/* Rows of a CPU dump kept every third row dropped, as positions; the GPU
 * continuation of that subset against the CPU's, and the GPU tier (device
 * rows in two segments) against the host rows: identical. */
static void test_subset_and_device_rows_continue_as_on_the_cpu(void)
{
    const int P = n_ids * 9 / 10, L = model->cfg.n_layers, nkv = model->cfg.n_kv_heads, hd = model->cfg.head_dim;
    dump_prefix(KV_DEVICE_CPU, P, KV_DT_F16, "/tmp/test_gpu_prefix_s.kvc");
    kvc_file *f;
    OK(kvc_open("/tmp/test_gpu_prefix_s.kvc", &f));
    int32_t *pos = malloc((size_t)P * sizeof *pos);
    int T = 0;
    for (int t = 0; t < P; t++)
        if (t % 3 != 1 || t == P - 1) pos[T++] = t;
    uint16_t **k = calloc((size_t)L, sizeof *k), **v = calloc((size_t)L, sizeof *v);
    for (int l = 0; l < L; l++) {
        const kvc_tensor *tk = kvc_layer(f, l, "k"), *tv = kvc_layer(f, l, "v");
        k[l] = malloc((size_t)nkv * T * hd * 2), v[l] = malloc((size_t)nkv * T * hd * 2);
        for (int h = 0; h < nkv; h++)
            for (int r = 0; r < T; r++) {
                memcpy(k[l] + ((size_t)h * T + r) * hd, (const uint16_t *)tk->data + ((size_t)h * P + pos[r]) * hd, (size_t)hd * 2);
                memcpy(v[l] + ((size_t)h * T + r) * hd, (const uint16_t *)tv->data + ((size_t)h * P + pos[r]) * hd, (size_t)hd * 2);
            }
    }
    kv_prefix pre = {.T = T, .matched = P, .positions = pos, .n_kv_heads = nkv, .head_dim = hd, .dt = KV_DT_F16,
                     .k = (const void *const *)k, .v = (const void *const *)v};
    float c[259], g[259], d[259];
    kv_runner *r;
    OK(runner(KV_DEVICE_CPU, 0, &r));
    OK(kv_runner_keep(r, 8, true));
    OK(kv_runner_prefill_from(r, &pre, ids + P, n_ids - P, c));
    OK(kv_runner_dump_kvc(r, ids, n_ids, KV_DT_F32, "/tmp/test_gpu_prefix_dc.kvc", 0));
    kv_runner_free(r);
    OK(runner(KV_DEVICE_CUDA, 0, &r));
    OK(kv_runner_keep(r, 8, true));
    OK(kv_runner_prefill_from(r, &pre, ids + P, n_ids - P, g));
    /* the GPU dumps a continued subset as the CPU does: rows at their
     * positions, zeros where rows were left out (what kv-run --store
     * --important inserts) */
    OK(kv_runner_dump_kvc(r, ids, n_ids, KV_DT_F32, "/tmp/test_gpu_prefix_dg.kvc", 0));
    kv_runner_free(r);
    KT_CHECK(nerr(c, g, 259) < 2e-2, "GPU subset continuation vs CPU: %.3g", nerr(c, g, 259));
    kvc_file *fc, *fg;
    OK(kvc_open("/tmp/test_gpu_prefix_dc.kvc", &fc));
    OK(kvc_open("/tmp/test_gpu_prefix_dg.kvc", &fg));
    double worst = 0;
    int zeros_differ = 0;
    for (int l = 0; l < L; l++)
        for (int w = 0; w < 2; w++) {
            const kvc_tensor *a = kvc_layer(fc, l, w ? "v" : "k"), *b = kvc_layer(fg, l, w ? "v" : "k");
            KT_REQUIRE(a && b && a->shape[1] == n_ids && b->shape[1] == n_ids, "dumps of %d rows", n_ids);
            const int cnt = nkv * n_ids * hd;
            double e = nerr(a->data, b->data, cnt);
            if (e > worst) worst = e;
            for (int i = 0; i < cnt; i++) zeros_differ += (((const float *)a->data)[i] == 0) != (((const float *)b->data)[i] == 0);
        }
    KT_CHECK(worst < 2e-2 && zeros_differ == 0, "GPU subset dump vs CPU: %.3g, %d zero entries differ", worst, zeros_differ);
    kvc_close(fc), kvc_close(fg);
    unlink("/tmp/test_gpu_prefix_dc.kvc"), unlink("/tmp/test_gpu_prefix_dg.kvc");
    /* the same rows on the device, in two segments */
    const int T1 = T / 3;
    void **dk[2], **dv[2];
    kv_prefix_seg seg[2];
    for (int s = 0; s < 2; s++) {
        int t0 = s ? T1 : 0, tn = s ? T - T1 : T1;
        dk[s] = calloc((size_t)L, sizeof(void *)), dv[s] = calloc((size_t)L, sizeof(void *));
        uint16_t *tmp = malloc((size_t)nkv * tn * hd * 2);
        for (int l = 0; l < L; l++)
            for (int w = 0; w < 2; w++) {
                for (int h = 0; h < nkv; h++)
                    memcpy(tmp + (size_t)h * tn * hd, (w ? v : k)[l] + ((size_t)h * T + t0) * hd, (size_t)tn * hd * 2);
                OK(kv_gpu_buffer_upload(tmp, (size_t)nkv * tn * hd * 2, w ? &dv[s][l] : &dk[s][l]));
            }
        free(tmp);
        seg[s] = (kv_prefix_seg){tn, tn, (const void *const *)dk[s], (const void *const *)dv[s]};
    }
    kv_prefix dpre = pre;
    dpre.device = true, dpre.seg = seg, dpre.nseg = 2, dpre.k = dpre.v = NULL;
    OK(runner(KV_DEVICE_CUDA, 0, &r));
    OK(kv_runner_prefill_from(r, &dpre, ids + P, n_ids - P, d));
    kv_runner_free(r);
    KT_CHECK(nerr(g, d, 259) == 0, "device rows vs host rows: %.3g", nerr(g, d, 259));
    for (int s = 0; s < 2; s++) {
        for (int l = 0; l < L; l++) kv_gpu_buffer_free(dk[s][l]), kv_gpu_buffer_free(dv[s][l]);
        free(dk[s]), free(dv[s]);
    }
    for (int l = 0; l < L; l++) free(k[l]), free(v[l]);
    free(k), free(v), free(pos);
    kvc_close(f);
    unlink("/tmp/test_gpu_prefix_s.kvc");
}

/* fp16 rows of a full-policy continuation are uploaded a layer ahead of
 * the compute (kv_gpu_prefill_phases.rows_ahead): the logits and greedy
 * ids equal, bit for bit, those of the serial path (each layer's rows
 * copied at its start, forced by opts.prefill_copy_sync), for rows in
 * pinned host memory (the host tier: the copies are truly asynchronous)
 * and on the device in two segments (the GPU tier), for the whole 90%
 * prefix and for one of only 3 rows, twice in one engine. */
static void run_ahead_vs_serial(const kv_prefix *pre, const char *what)
{
    float out[2][259];
    int gen[2][8];
    bool ahead[2];
    double up_ms[2], up_bytes[2];
    for (int w = 0; w < 2; w++) { /* w = 0: default; w = 1: the serial copies */
        kv_gpu_engine_opts go;
        kv_gpu_engine_opts_default(&go);
        go.prefill_copy_sync = w == 1;
        kv_runner *r;
        OK(kv_runner_new(model, NULL, n_ids + 16, KV_DEVICE_CUDA, &go, &r));
        for (int rep = 0; rep < 2; rep++) { /* twice: the second reuses the kept pair and events */
            OK(kv_runner_reset(r, NULL));
            OK(kv_runner_prefill_from(r, pre, ids + pre->matched, n_ids - pre->matched, out[w]));
        }
        kv_gpu_prefill_phases ph;
        kv_gpu_engine_prefill_phases(kv_runner_gpu(r), &ph);
        ahead[w] = ph.rows_ahead;
        up_ms[w] = ph.upload, up_bytes[w] = ph.upload_bytes;
        float *l8 = malloc(259 * sizeof *l8);
        memcpy(l8, out[w], 259 * sizeof *l8);
        for (int i = 0; i < 8; i++) {
            gen[w][i] = kt_argmax(l8, 259);
            OK(kv_runner_step(r, gen[w][i], l8));
        }
        free(l8);
        kv_runner_free(r);
    }
    KT_CHECK(ahead[0] && !ahead[1], "%s: rows ahead %d (default), %d (serial)", what, ahead[0], ahead[1]);
    /* the uploads' span is timed only when they run ahead, over all their bytes */
    const double want = 2.0 * model->cfg.n_layers * pre->n_kv_heads * (double)pre->T * pre->head_dim * 2;
    KT_CHECK(up_ms[0] > 0 && up_bytes[0] == want && up_ms[1] == 0 && up_bytes[1] == 0,
             "%s: upload %.3g ms %.0f bytes (want %.0f), serial %.3g ms %.0f bytes", what, up_ms[0], up_bytes[0],
             want, up_ms[1], up_bytes[1]);
    KT_CHECK(memcmp(out[0], out[1], sizeof out[0]) == 0, "%s: logits differ (%.3g)", what, nerr(out[0], out[1], 259));
    KT_CHECK(memcmp(gen[0], gen[1], sizeof gen[0]) == 0, "%s: greedy ids differ", what);
}

static void test_rows_uploaded_ahead_equal_the_serial_path(void)
{
    const int L = model->cfg.n_layers, nkv = model->cfg.n_kv_heads, hd = model->cfg.head_dim;
    const int splits[2] = {n_ids * 9 / 10, 3};
    dump_prefix(KV_DEVICE_CUDA, splits[0], KV_DT_F16, "/tmp/test_gpu_prefix_o.kvc");
    kvc_file *f;
    OK(kvc_open("/tmp/test_gpu_prefix_o.kvc", &f));
    for (int si = 0; si < 2; si++) {
        const int P = splits[si], P1 = P / 2 > 0 ? P / 2 : 1;
        uint16_t **k = calloc((size_t)L, sizeof *k), **v = calloc((size_t)L, sizeof *v);
        void **dk[2] = {calloc((size_t)L, sizeof(void *)), calloc((size_t)L, sizeof(void *))};
        void **dv[2] = {calloc((size_t)L, sizeof(void *)), calloc((size_t)L, sizeof(void *))};
        for (int l = 0; l < L; l++) { /* the first P rows of the dump, (nkv, P, hd), pinned */
            const kvc_tensor *tk = kvc_layer(f, l, "k"), *tv = kvc_layer(f, l, "v");
            k[l] = kv_gpu_host_alloc((size_t)nkv * P * hd * 2), v[l] = kv_gpu_host_alloc((size_t)nkv * P * hd * 2);
            KT_REQUIRE(k[l] && v[l], "pinned rows");
            for (int h = 0; h < nkv; h++) {
                memcpy(k[l] + (size_t)h * P * hd, (const uint16_t *)tk->data + (size_t)h * splits[0] * hd, (size_t)P * hd * 2);
                memcpy(v[l] + (size_t)h * P * hd, (const uint16_t *)tv->data + (size_t)h * splits[0] * hd, (size_t)P * hd * 2);
            }
            for (int sg = 0; sg < 2; sg++) /* the same rows on the device: [0, P1) and [P1, P) */
                for (int w = 0; w < 2; w++) {
                    const int t0 = sg ? P1 : 0, tn = sg ? P - P1 : P1;
                    uint16_t *tmp = malloc((size_t)nkv * (tn ? tn : 1) * hd * 2);
                    for (int h = 0; h < nkv; h++)
                        memcpy(tmp + (size_t)h * tn * hd, (w ? v : k)[l] + ((size_t)h * P + t0) * hd, (size_t)tn * hd * 2);
                    if (tn) OK(kv_gpu_buffer_upload(tmp, (size_t)nkv * tn * hd * 2, w ? &dv[sg][l] : &dk[sg][l]));
                    free(tmp);
                }
        }
        char what[64];
        kv_prefix pre = {.T = P, .matched = P, .n_kv_heads = nkv, .head_dim = hd, .dt = KV_DT_F16,
                         .k = (const void *const *)k, .v = (const void *const *)v};
        snprintf(what, sizeof what, "%d pinned host rows", P);
        run_ahead_vs_serial(&pre, what);
        kv_prefix_seg seg[2] = {{P1, P1, (const void *const *)dk[0], (const void *const *)dv[0]},
                                {P - P1, P - P1, (const void *const *)dk[1], (const void *const *)dv[1]}};
        kv_prefix dpre = pre;
        dpre.device = true, dpre.seg = seg, dpre.nseg = P - P1 ? 2 : 1, dpre.k = dpre.v = NULL;
        snprintf(what, sizeof what, "%d device rows in %d segments", P, dpre.nseg);
        run_ahead_vs_serial(&dpre, what);
        for (int l = 0; l < L; l++) {
            kv_gpu_host_free(k[l]), kv_gpu_host_free(v[l]);
            for (int sg = 0; sg < 2; sg++) kv_gpu_buffer_free(dk[sg][l]), kv_gpu_buffer_free(dv[sg][l]);
        }
        free(k), free(v);
        for (int sg = 0; sg < 2; sg++) free(dk[sg]), free(dv[sg]);
    }
    kvc_close(f);
    unlink("/tmp/test_gpu_prefix_o.kvc");
}

/* Rows that arrive while the prefill runs (kv_prefix.wait, what
 * kv_tree_store_load_start gives): a thread fills pinned rows layer by
 * layer, slowly, from the complete ones. */
typedef struct {
    const uint16_t *const *k, *const *v;
    uint16_t **dk, **dv;
    size_t n;
    int L, ready, fail_at; /* fail_at: the layer whose wait fails (-1: none) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int waits;
} late_rows;

static void *late_fill(void *p)
{
    late_rows *x = p;
    for (int l = 0; l < x->L; l++) {
        usleep(3000);
        memcpy(x->dk[l], x->k[l], x->n * 2);
        memcpy(x->dv[l], x->v[l], x->n * 2);
        pthread_mutex_lock(&x->mu);
        x->ready = l + 1;
        pthread_cond_broadcast(&x->cv);
        pthread_mutex_unlock(&x->mu);
    }
    return NULL;
}

static kv_status late_wait(void *p, int layer)
{
    late_rows *x = p;
    if (layer == x->fail_at) return kv_fail(KV_E_DATA, "layer %d's rows are damaged (planted)", layer);
    pthread_mutex_lock(&x->mu);
    x->waits++;
    while (x->ready <= layer) pthread_cond_wait(&x->cv, &x->mu);
    pthread_mutex_unlock(&x->mu);
    return KV_OK;
}

/* A prefill from rows still arriving gives exactly the logits and greedy
 * ids of the same rows given complete, with the upload a layer ahead and
 * with the serial copies; every layer's rows are waited for; a wait that
 * fails fails the prefill with its reason, and the engine then serves the
 * next prefill. */
static void test_rows_still_arriving_give_the_same_logits(void)
{
    const int L = model->cfg.n_layers, nkv = model->cfg.n_kv_heads, hd = model->cfg.head_dim;
    const int P = n_ids * 9 / 10;
    dump_prefix(KV_DEVICE_CUDA, P, KV_DT_F16, "/tmp/test_gpu_prefix_l.kvc");
    kvc_file *f;
    OK(kvc_open("/tmp/test_gpu_prefix_l.kvc", &f));
    const size_t n = (size_t)nkv * P * hd;
    uint16_t **k = calloc((size_t)L, sizeof *k), **v = calloc((size_t)L, sizeof *v);
    uint16_t **dk = calloc((size_t)L, sizeof *dk), **dv = calloc((size_t)L, sizeof *dv);
    for (int l = 0; l < L; l++) {
        k[l] = kv_gpu_host_alloc(n * 2), v[l] = kv_gpu_host_alloc(n * 2);
        dk[l] = kv_gpu_host_alloc(n * 2), dv[l] = kv_gpu_host_alloc(n * 2);
        KT_REQUIRE(k[l] && v[l] && dk[l] && dv[l], "pinned rows");
        memcpy(k[l], kvc_layer(f, l, "k")->data, n * 2);
        memcpy(v[l], kvc_layer(f, l, "v")->data, n * 2);
        memset(dk[l], 0xff, n * 2), memset(dv[l], 0xff, n * 2); /* NaN halves until filled */
    }
    kv_prefix pre = {.T = P, .matched = P, .n_kv_heads = nkv, .head_dim = hd, .dt = KV_DT_F16,
                     .k = (const void *const *)k, .v = (const void *const *)v};
    for (int w = 0; w < 2; w++) { /* w = 0: uploads a layer ahead; 1: serial copies */
        kv_gpu_engine_opts go;
        kv_gpu_engine_opts_default(&go);
        go.prefill_copy_sync = w == 1;
        kv_runner *r;
        OK(kv_runner_new(model, NULL, n_ids + 16, KV_DEVICE_CUDA, &go, &r));
        float a[259], b[259];
        OK(kv_runner_prefill_from(r, &pre, ids + P, n_ids - P, a));
        late_rows x = {(const uint16_t *const *)k, (const uint16_t *const *)v, dk, dv, n, L, 0, -1,
                       PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
        kv_prefix lp = pre;
        lp.k = (const void *const *)dk, lp.v = (const void *const *)dv, lp.wait = late_wait, lp.wait_user = &x;
        pthread_t th;
        KT_REQUIRE(pthread_create(&th, NULL, late_fill, &x) == 0, "filler");
        OK(kv_runner_reset(r, NULL));
        kv_status st = kv_runner_prefill_from(r, &lp, ids + P, n_ids - P, b);
        pthread_join(th, NULL);
        KT_CHECK(st == KV_OK && memcmp(a, b, sizeof a) == 0, "%s: rows arriving late: %s (%.3g)",
                 w ? "serial" : "ahead", st ? kv_errdetail() : "ok", nerr(a, b, 259));
        KT_CHECK(x.waits >= L, "%s: %d waits for %d layers", w ? "serial" : "ahead", x.waits, L);
        /* a failing wait: the prefill fails with its reason; the engine goes on */
        late_rows y = x; /* its own lock: a copied mutex is undefined */
        pthread_mutex_init(&y.mu, NULL);
        pthread_cond_init(&y.cv, NULL);
        y.fail_at = L / 2, y.ready = L, y.waits = 0;
        lp.wait_user = &y;
        OK(kv_runner_reset(r, NULL));
        kv_errclear();
        st = kv_runner_prefill_from(r, &lp, ids + P, n_ids - P, b);
        KT_CHECK(st == KV_E_DATA && strstr(kv_errdetail(), "planted"), "%s: failed wait: %d %s", w ? "serial" : "ahead",
                 st, kv_errdetail());
        OK(kv_runner_reset(r, NULL));
        OK(kv_runner_prefill_from(r, &pre, ids + P, n_ids - P, b));
        KT_CHECK(memcmp(a, b, sizeof a) == 0, "%s: the prefill after a failed one", w ? "serial" : "ahead");
        pthread_mutex_destroy(&y.mu);
        pthread_cond_destroy(&y.cv);
        kv_runner_free(r);
        for (int l = 0; l < L; l++) memset(dk[l], 0xff, n * 2), memset(dv[l], 0xff, n * 2);
    }
    for (int l = 0; l < L; l++) kv_gpu_host_free(k[l]), kv_gpu_host_free(v[l]), kv_gpu_host_free(dk[l]), kv_gpu_host_free(dv[l]);
    free(k), free(v), free(dk), free(dv);
    kvc_close(f);
    unlink("/tmp/test_gpu_prefix_l.kvc");
}

/* The last chunk's products padded to KV_GPU_PREFILL_PAD rows give the
 * exact products' logits, in chunks of 100 rows (no multiple of 16: the
 * middle chunks stay exact).  The padded engine first prefills in one
 * chunk, so its workspace's rows past 100 hold that prefill's rows: were a
 * middle chunk padded, they would be added into the next chunk's rows.
 * (Continued prefills run padded in every test above.)  The warm-up runs,
 * takes time and leaves the logits as they were; an engine that prefills
 * one token at a time has nothing to warm. */
static void test_padded_products_and_warm_keep_the_logits(void)
{
    const int V = 259;
    float *a = malloc(V * sizeof *a), *b = malloc(V * sizeof *b), *c = malloc(V * sizeof *c);
    kv_gpu_engine *ex, *pd, *tk;
    kv_gpu_engine_opts go;
    kv_gpu_engine_opts_default(&go);
    go.prefill_chunk = 100;
    go.prefill_exact = true;
    OK(kv_gpu_engine_new(model, NULL, n_ids + 16, &go, &ex));
    OK(kv_gpu_engine_prefill(ex, ids, n_ids, a));
    go.prefill_exact = false;
    go.prefill_chunk = 0;
    OK(kv_gpu_engine_new(model, NULL, n_ids + 16, &go, &pd));
    OK(kv_gpu_engine_prefill(pd, ids, n_ids, c));
    go.prefill_chunk = 100;
    OK(kv_gpu_engine_reset_opts(pd, NULL, &go));
    KT_CHECK(n_ids % 100 % KV_GPU_PREFILL_PAD != 0, "the last chunk (%d rows) is padded", n_ids % 100);
    OK(kv_gpu_engine_prefill(pd, ids, n_ids, b));
    double e = nerr(a, b, V);
    KT_CHECK(e < 1e-3 && kt_argmax(a, V) == kt_argmax(b, V), "padded vs exact products: logits error %.3g", e);
    double ms = -1;
    bool ran = false;
    OK(kv_gpu_engine_reset(pd, NULL));
    OK(kv_gpu_engine_warm(pd, n_ids, &ms, &ran));
    KT_CHECK(ran && ms > 0, "warm-up: ran %d, %.3f ms", ran, ms);
    OK(kv_gpu_engine_prefill(pd, ids, n_ids, c));
    double ew = nerr(b, c, V);
    KT_CHECK(ew < 1e-3 && kt_argmax(b, V) == kt_argmax(c, V), "after the warm-up: logits error %.3g", ew);
    printf("# chunks of 100, last %d rows: padded vs exact products %.3g, after a %.1f ms warm-up %.3g\n",
           n_ids % 100, e, ms, ew);
    go.prefill_chunk = -1; /* one token at a time */
    OK(kv_gpu_engine_new(model, NULL, n_ids + 16, &go, &tk));
    ms = -1, ran = true;
    OK(kv_gpu_engine_warm(tk, n_ids, &ms, &ran));
    KT_CHECK(ms == 0 && !ran, "token-by-token engine: warm-up ran %d, %.3f ms", ran, ms);
    kv_gpu_engine_free(tk);
    kv_gpu_engine_free(pd);
    kv_gpu_engine_free(ex);
    free(a), free(b), free(c);
}

int main(void)
{
    char name[256];
    if (kv_gpu_probe(name, sizeof name) <= 0) {
        printf("# no usable GPU (%s): GPU tests skipped\n", name);
        KT_SKIP(test_gpu_dump_then_continue_matches_the_whole_prompt, "no usable GPU");
        KT_SKIP(test_cpu_f32_dump_continues_on_the_gpu, "no usable GPU");
        KT_SKIP(test_subset_and_device_rows_continue_as_on_the_cpu, "no usable GPU");
        KT_SKIP(test_rows_uploaded_ahead_equal_the_serial_path, "no usable GPU");
        KT_SKIP(test_rows_still_arriving_give_the_same_logits, "no usable GPU");
        KT_SKIP(test_padded_products_and_warm_keep_the_logits, "no usable GPU");
        return kt_done();
    }
    printf("# GPU: %s\n", name);
    if (kt_niah_first_task(&model, &ids, &n_ids)) return 1;
    const char *filter = getenv("KV_TEST_FILTER");
    KT_RUN_SELECTED(test_gpu_dump_then_continue_matches_the_whole_prompt, filter);
    KT_RUN_SELECTED(test_cpu_f32_dump_continues_on_the_gpu, filter);
    KT_RUN_SELECTED(test_subset_and_device_rows_continue_as_on_the_cpu, filter);
    KT_RUN_SELECTED(test_rows_uploaded_ahead_equal_the_serial_path, filter);
    KT_RUN_SELECTED(test_rows_still_arriving_give_the_same_logits, filter);
    KT_RUN_SELECTED(test_padded_products_and_warm_keep_the_logits, filter);
    free(ids);
    kv_model_close(model);
    return kt_done();
}
