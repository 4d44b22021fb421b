/*
 * kv_gpu_bench: the placements, transfer ceilings and timed decode runs
 * for `kv-bench decode` (see kv_gpu_bench.h).  Transfers are timed with CUDA events,
 * after one untimed round, as the median of several rounds.
 */
#include "eval/kv_gpu_bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n ? v[n / 2] : 0;
}

const char *kv_decode_placement_name(kv_decode_placement p)
{
    static const char *const names[KV_DEC_COUNT] = {"full", "quant", "hybrid", "hybrid-sketch",
                                                    "offload", "hybrid-resident", "hybrid-pages"};
    return (unsigned)p < KV_DEC_COUNT ? names[p] : "?";
}

kv_status kv_decode_layers_fill(kv_decode_placement p, const kv_decode_layers *c, int n_layers,
                                kv_policy_params *per_layer)
{
    bool hybrid = kv_decode_is_hybrid(p);
    if (hybrid && c->qlayers > n_layers)
        return kv_fail(KV_E_USAGE, "%d quantized layers: the model has %d", c->qlayers, n_layers);
    for (int l = 0; l < n_layers; l++) {
        kv_policy_params *x = &per_layer[l];
        if (p == KV_DEC_FULL || p == KV_DEC_OFFLOAD) {
            kv_policy_params_default(x, KV_POL_FULL);
            x->offload = p == KV_DEC_OFFLOAD;
        } else if (p == KV_DEC_QUANT || l < c->qlayers) {
            kv_policy_params_default(x, KV_POL_QUANT);
            x->bits = c->qbits;
        } else {
            kv_policy_params_default(x, KV_POL_SPARSE);
            x->topk = c->topk;
            x->topk_frac = 0.0;
            x->channels = c->channels;
            x->sink = c->sink;
            x->window = c->window;
            if (p == KV_DEC_SKETCH) x->select = KV_SELECT_SKETCH;
            if (p == KV_DEC_RESIDENT) x->select = KV_SELECT_RESIDENT;
            if (p == KV_DEC_PAGES) x->select = KV_SELECT_PAGES;
        }
        x->dtype = KV_DT_F16;
    }
    return KV_OK;
}

double kv_gpu_bench_hidden(double ms, double ms_ref, uint64_t bytes, double h2d)
{
    double t_pcie = (double)bytes / h2d * 1e3;
    if (t_pcie <= 0) return 1.0;
    double exposed = ms - ms_ref;
    if (exposed < 0) exposed = 0;
    double h = 1.0 - exposed / t_pcie;
    return h < 0 ? 0 : h;
}

/* A seeded random prompt of T ids below vocab, prefilled, timed on the wall clock. */
static kv_status real_prefill(kv_gpu_engine *e, int T, uint64_t seed, kv_gpu_decode_result *r)
{
    int *tok = malloc((size_t)T * sizeof(int));
    if (!tok) return kv_fail(KV_E_NOMEM, "out of memory for a %d-token prompt", T);
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + 7;
    const int V = kv_gpu_engine_vocab(e);
    for (int t = 0; t < T; t++) {
        z ^= z >> 12, z ^= z << 25, z ^= z >> 27;
        tok[t] = (int)(((z * 2685821657736338717ull) >> 33) % (uint64_t)V);
    }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    kv_status st = kv_gpu_engine_prefill(e, tok, T, NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    free(tok);
    r->prefill_ms = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
    r->prefill_attn_ms = kv_gpu_engine_prefill_attn_ms(e);
    return st;
}

/* The N of chainN / gatherN: 1 to 999 blocks per KV head, or "all" (-1). */
static bool word_blocks(const char *p, size_t n, int *out)
{
    if (n == 3 && !strncmp(p, "all", 3)) {
        *out = -1;
        return true;
    }
    int x = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') return false;
        x = 10 * x + (p[i] - '0');
    }
    *out = x;
    return x >= 1;
}

void kv_decode_variant_apply(const kv_decode_variant *v, kv_gpu_engine_opts *o)
{
    o->sel_serial = v->serial;
    o->topk_wide = v->wide;
    o->sel_cache = v->cache;
    o->sel_classic = v->classic;
    o->sel_ahead = v->ahead;
    o->sel_blocks = v->sel_blocks;
    o->gather_blocks = v->gather_blocks;
    o->sel_kernels = v->sel_kernels;
    o->sel_every = v->sel_every;
}

/* A chain word (late, early, nopdl, collect, direct, hist) into v->sel_kernels. */
static bool word_kernels(const char *p, size_t n, kv_decode_variant *v)
{
    static const struct { const char *w; int set, clear; } K[] = {
        {"late", KV_GPU_SELK_LATE, 0},       {"early", 0, KV_GPU_SELK_LATE},
        {"nopdl", KV_GPU_SELK_NOPDL, 0},     {"collect", KV_GPU_SELK_COLLECT, 0},
        {"direct", KV_GPU_SELK_DIRECT, 0},   {"hist", 0, KV_GPU_SELK_COLLECT | KV_GPU_SELK_DIRECT},
    };
    for (size_t i = 0; i < sizeof K / sizeof K[0]; i++)
        if (strlen(K[i].w) == n && !strncmp(p, K[i].w, n)) {
            if (!v->sel_kernels) v->sel_kernels = KV_GPU_SELK_SET | KV_GPU_SELK_DEFAULT;
            v->sel_kernels = (v->sel_kernels | K[i].set) & ~K[i].clear;
            return true;
        }
    return false;
}

kv_status kv_decode_variant_parse(const char *s, kv_decode_variant *v)
{
    memset(v, 0, sizeof *v);
    if (strlen(s) >= sizeof v->name) return kv_fail(KV_E_USAGE, "variant '%s' too long", s);
    snprintf(v->name, sizeof v->name, "%s", s);
    if (!strcmp(s, "base")) return KV_OK;
    const char *p = s;
    while (*p) {
        const char *q = strchr(p, '+');
        size_t n = q ? (size_t)(q - p) : strlen(p);
        if (n == 6 && !strncmp(p, "serial", 6)) v->serial = true;
        else if (n == 4 && !strncmp(p, "wide", 4)) v->wide = true;
        else if (n == 5 && !strncmp(p, "cache", 5)) v->cache = true;
        else if (n == 7 && !strncmp(p, "classic", 7)) v->classic = true;
        else if (n == 6 && !strncmp(p, "ahead2", 6)) v->ahead = 2;
        else if (n > 5 && n < 9 && !strncmp(p, "chain", 5) && word_blocks(p + 5, n - 5, &v->sel_blocks)) {
        } else if (n > 6 && n < 10 && !strncmp(p, "gather", 6) && word_blocks(p + 6, n - 6, &v->gather_blocks)) {
        } else if (word_kernels(p, n, v)) {
        } else if (n > 5 && n < 9 && !strncmp(p, "every", 5) && word_blocks(p + 5, n - 5, &v->sel_every) &&
                   v->sel_every >= 2) {
        } else return kv_fail(KV_E_USAGE, "variant '%s': '%.*s' is not one of serial, wide, cache, classic, ahead2, "
                              "chainN, gatherN, late, early, nopdl, collect, direct, hist, everyN", s,
                            (int)n, p);
        if (!q) break;
        p = q + 1;
        if (!*p) return kv_fail(KV_E_USAGE, "variant '%s' ends in '+'", s);
    }
    return KV_OK;
}

/* warmup + tokens greedy tokens from the engine's context, timed into r;
 * ids/ms/v scratch of n entries. */
static kv_status timed_run(kv_gpu_engine *e, int warmup, int tokens, int *ids, float *ms, double *v,
                           kv_gpu_decode_result *r)
{
    kv_status st = kv_gpu_engine_generate(e, 1, warmup + tokens, ids, ms);
    if (st) return st;
    for (int i = 0; i < tokens; i++) v[i] = ms[warmup + i];
    qsort(v, (size_t)tokens, sizeof *v, cmp_double);
    r->ms_median = v[tokens / 2];
    r->ms_p90 = v[(tokens * 9) / 10 < tokens ? (tokens * 9) / 10 : tokens - 1];
    r->ms_min = v[0];
    r->tokens = tokens;
    kv_bytes b;
    kv_gpu_engine_bytes(e, &b);
    r->gpu_kv = b.resident;
    r->host_kv = b.host;
    r->pcie_token = b.fetched_last;
    kv_gpu_timing t;
    kv_gpu_engine_timing(e, &t);
    r->select_ms = t.select_ms;
    r->copy_ms = t.copy_ms;
    r->fetch_ms = t.fetch_ms;
    r->score_ms = t.score_ms;
    r->wait_ms = t.wait_ms;
    r->cache_hits = t.cache_hits;
    r->cache_rows = t.cache_rows;
    kv_gpu_engine_graph_info(e, &r->graph);
    return KV_OK;
}

kv_status kv_gpu_bench_decode_variants(kv_gpu_engine *e, const kv_policy_params *per_layer,
                                       const kv_gpu_engine_opts *opts, int T, uint64_t seed,
                                       bool prefill, int warmup, int tokens, int nofetch_tokens,
                                       const kv_decode_variant *v, int nv, kv_gpu_decode_result *r)
{
    if (nv < 1) return kv_fail(KV_E_USAGE, "no variants to time");
    memset(r, 0, (size_t)nv * sizeof *r);
    if (tokens < 1) return kv_fail(KV_E_USAGE, "no tokens to time");
    kv_gpu_engine_opts o = *opts;
    o.time_prefill = o.time_prefill || prefill;
    kv_decode_variant_apply(&v[0], &o);
    kv_status st = kv_gpu_engine_reset_opts(e, per_layer, &o);
    if (!st) st = prefill ? real_prefill(e, T, seed, &r[0]) : kv_gpu_engine_synthesize(e, T, seed);
    if (st) return st;
    int n = warmup + tokens > nofetch_tokens ? warmup + tokens : nofetch_tokens;
    int *ids = malloc((size_t)n * sizeof(int));
    float *ms = malloc((size_t)n * sizeof(float));
    double *dv = malloc((size_t)n * sizeof(double));
    if (!ids || !ms || !dv) {
        free(ids);
        free(ms);
        free(dv);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    bool sparse = false;
    for (int l = 0; per_layer && l < kv_gpu_engine_n_layers(e); l++)
        sparse |= per_layer[l].kind == KV_POL_SPARSE;
    for (int i = 0; i < nv && !st; i++) {
        if (i) {
            r[i].prefill_ms = r[0].prefill_ms;
            r[i].prefill_attn_ms = r[0].prefill_attn_ms;
            st = kv_gpu_engine_set_step_opts(e, v[i].serial, v[i].wide, v[i].cache, o.profile);
            kv_gpu_engine_set_sel_opts(e, v[i].classic, v[i].ahead, v[i].sel_blocks, v[i].gather_blocks);
            kv_gpu_engine_set_sel_kernels(e, v[i].sel_kernels, v[i].sel_every);
        }
        if (!st) st = timed_run(e, warmup, tokens, ids, ms, dv, &r[i]);
        if (!st && sparse && nofetch_tokens > 0) { /* this variant's selection, no gather */
            kv_gpu_engine_set_sel_skip(e, o.sel_skip | KV_GPU_SKIP_GATHER);
            st = kv_gpu_engine_generate(e, ids[warmup + tokens - 1], nofetch_tokens, ids, ms);
            kv_gpu_engine_set_sel_skip(e, o.sel_skip);
            if (!st) {
                for (int j = 0; j < nofetch_tokens; j++) dv[j] = ms[j];
                r[i].ms_nogather = median(dv, nofetch_tokens);
            }
        }
        if (!st && i == 0 && sparse && nofetch_tokens > 0) {
            kv_gpu_engine_set_no_fetch(e, true);
            st = kv_gpu_engine_generate(e, ids[warmup + tokens - 1], nofetch_tokens, ids, ms);
            kv_gpu_engine_set_no_fetch(e, false);
            if (!st) {
                for (int j = 0; j < nofetch_tokens; j++) dv[j] = ms[j];
                r[0].ms_nofetch = median(dv, nofetch_tokens);
            }
        }
        if (i) r[i].ms_nofetch = r[0].ms_nofetch;
    }
    free(ids);
    free(ms);
    free(dv);
    return st;
}

kv_status kv_gpu_bench_decode(kv_gpu_engine *e, const kv_policy_params *per_layer,
                              const kv_gpu_engine_opts *opts, int T, uint64_t seed, bool prefill,
                              int warmup, int tokens, int nofetch_tokens, kv_gpu_decode_result *r)
{
    /* one run, the step as opts says */
    kv_decode_variant v = {.name = "base", .serial = opts->sel_serial, .wide = opts->topk_wide,
                           .cache = opts->sel_cache, .classic = opts->sel_classic,
                           .ahead = opts->sel_ahead, .sel_blocks = opts->sel_blocks,
                           .gather_blocks = opts->gather_blocks, .sel_kernels = opts->sel_kernels,
                           .sel_every = opts->sel_every};
    return kv_gpu_bench_decode_variants(e, per_layer, opts, T, seed, prefill, warmup, tokens, nofetch_tokens,
                                        &v, 1, r);
}

#ifdef KV_HAVE_CUDA

#include <cuda_runtime_api.h>

#include "eng_ops.cuh"
#include "gpu/kv_gpu_cuda.h"

/* A failed CUDA call or launcher: st names the statement (kv_cuda_fail), then cleanup. */
#define BW_CK(call) KV_CUDA_CK_GOTO(call, st, done)

kv_status kv_gpu_bw_measure(int device, kv_gpu_bw *bw)
{
    memset(bw, 0, sizeof *bw);
    kv_status st = KV_OK;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count <= device) {
        (void)cudaGetLastError();
        return kv_fail(KV_E_UNAVAILABLE, "no usable CUDA device %d", device);
    }
    const size_t hbytes = (size_t)256 << 20, dbytes = (size_t)1 << 30;
    const int rows = 65536, rowb = 512, reps = 7;
    void *h = NULL, *hd = NULL, *d0 = NULL, *d1 = NULL;
    int *sel = NULL, *dsel = NULL;
    unsigned *sink = NULL;
    cudaStream_t s = NULL;
    cudaEvent_t a = NULL, b = NULL;
    double t[16];
    float ms;
    bw->row_bytes = rowb;
    BW_CK(cudaSetDevice(device));
    BW_CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    BW_CK(cudaEventCreate(&a));
    BW_CK(cudaEventCreate(&b));
    BW_CK(cudaHostAlloc(&h, hbytes, cudaHostAllocMapped));
    BW_CK(cudaHostGetDevicePointer(&hd, h, 0));
    memset(h, 0x3c, hbytes); /* fp16 1.0-ish pattern: not zeros */
    BW_CK(cudaMalloc(&d0, dbytes));
    BW_CK(cudaMalloc(&d1, dbytes));
    BW_CK(cudaMemsetAsync(d0, 0x5a, dbytes, s));
    BW_CK(cudaMalloc((void **)&sink, 64));
    /* pinned host -> device and back */
    for (int dir = 0; dir < 2; dir++) {
        for (int i = 0; i <= reps; i++) {
            BW_CK(cudaEventRecord(a, s));
            if (dir == 0) BW_CK(cudaMemcpyAsync(d1, h, hbytes, cudaMemcpyHostToDevice, s));
            else BW_CK(cudaMemcpyAsync(h, d1, hbytes, cudaMemcpyDeviceToHost, s));
            BW_CK(cudaEventRecord(b, s));
            BW_CK(cudaEventSynchronize(b));
            BW_CK(cudaEventElapsedTime(&ms, a, b));
            if (i) t[i - 1] = (double)hbytes / (ms * 1e-3);
        }
        if (dir == 0) bw->h2d = median(t, reps);
        else bw->d2h = median(t, reps);
    }
    /* device copy: bytes read plus bytes written */
    for (int i = 0; i <= reps; i++) {
        BW_CK(cudaEventRecord(a, s));
        BW_CK(cudaMemcpyAsync(d1, d0, dbytes, cudaMemcpyDeviceToDevice, s));
        BW_CK(cudaEventRecord(b, s));
        BW_CK(cudaEventSynchronize(b));
        BW_CK(cudaEventElapsedTime(&ms, a, b));
        if (i) t[i - 1] = 2.0 * (double)dbytes / (ms * 1e-3);
    }
    bw->d2d = median(t, reps);
    /* a kernel streaming mapped host memory */
    for (int i = 0; i <= reps; i++) {
        BW_CK(cudaEventRecord(a, s));
        BW_CK(eng_read_probe(hd, hbytes, sink, s));
        BW_CK(cudaEventRecord(b, s));
        BW_CK(cudaEventSynchronize(b));
        BW_CK(cudaEventElapsedTime(&ms, a, b));
        if (i) t[i - 1] = (double)hbytes / (ms * 1e-3);
    }
    bw->zc_read = median(t, reps);
    /* random 512-byte rows (one head's K and V at head_dim 128): one kernel
     * gathering from mapped memory vs one copy-engine transfer per row */
    sel = malloc((size_t)rows * sizeof(int));
    if (!sel) {
        st = kv_fail(KV_E_NOMEM, "out of memory");
        goto done;
    }
    {
        unsigned long long x = 88172645463325252ull;
        int nrows_h = (int)(hbytes / rowb);
        for (int i = 0; i < rows; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            sel[i] = (int)(x % (unsigned long long)nrows_h);
        }
    }
    BW_CK(cudaMalloc((void **)&dsel, (size_t)rows * sizeof(int)));
    /* stream-ordered: a legacy-stream cudaMemcpy does not order with s */
    BW_CK(cudaMemcpyAsync(dsel, sel, (size_t)rows * sizeof(int), cudaMemcpyHostToDevice, s));
    BW_CK(cudaStreamSynchronize(s));
    for (int i = 0; i <= reps; i++) {
        BW_CK(cudaEventRecord(a, s));
        /* rows as (T, 1 head, K|V, 128): the engine's gather, 8 of them per warp-row */
        BW_CK(eng_gather_rows(hd, 1, 128, KV_DT_F16, dsel, rows, NULL, 0, d1,
                              (uint8_t *)d1 + (size_t)rows * 256, (size_t)rows, s));
        BW_CK(cudaEventRecord(b, s));
        BW_CK(cudaEventSynchronize(b));
        BW_CK(cudaEventElapsedTime(&ms, a, b));
        if (i) t[i - 1] = (double)rows * rowb / (ms * 1e-3);
    }
    bw->zc_gather = median(t, reps);
    {
        const int nm = 8192; /* per-row copies are slow: time fewer */
        for (int i = 0; i <= 3; i++) {
            BW_CK(cudaEventRecord(a, s));
            for (int r = 0; r < nm; r++)
                BW_CK(cudaMemcpyAsync((uint8_t *)d1 + (size_t)r * rowb, (uint8_t *)h + (size_t)sel[r] * rowb,
                                      rowb, cudaMemcpyHostToDevice, s));
            BW_CK(cudaEventRecord(b, s));
            BW_CK(cudaEventSynchronize(b));
            BW_CK(cudaEventElapsedTime(&ms, a, b));
            if (i) t[i - 1] = (double)nm * rowb / (ms * 1e-3);
        }
        bw->memcpy_gather = median(t, 3);
    }
done:
    free(sel);
    if (dsel) cudaFree(dsel);
    if (sink) cudaFree(sink);
    if (d0) cudaFree(d0);
    if (d1) cudaFree(d1);
    if (h) cudaFreeHost(h);
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
    if (s) cudaStreamDestroy(s);
    return st;
}


kv_status kv_gpu_bench_select(int device, int n, int k, kv_gpu_select_us *us)
{
    memset(us, 0, sizeof *us);
    us->n = n;
    us->k = k;
    kv_status st = KV_OK;
    const int nqh = 32, nkv = 8, hd = 128, C = 8, dim = 4096, reps = 9;
    const int ldc = (n + 7) & ~7;
    cudaStream_t s = NULL;
    cudaEvent_t a = NULL, b = NULL;
    float *q = NULL, *score = NULL, *comb = NULL, *tmp = NULL, *chmax = NULL, *mad = NULL, *qs = NULL;
    float *x = NULL, *y = NULL;
    int *chans = NULL, *sel = NULL;
    uint8_t *bits = NULL;
    void *W = NULL, *rows_h = NULL, *rows_d = NULL, *kcm_h = NULL, *kcm_d = NULL, *dst = NULL;
    double t[16];
    float ms;
    BW_CK(cudaSetDevice(device));
    BW_CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    BW_CK(cudaEventCreate(&a));
    BW_CK(cudaEventCreate(&b));
    BW_CK(cudaMalloc((void **)&q, (size_t)nqh * hd * 4));
    BW_CK(cudaMalloc((void **)&score, (size_t)nqh * n * 4));
    BW_CK(cudaMalloc((void **)&comb, (size_t)nkv * n * 4));
    BW_CK(cudaMalloc((void **)&tmp, eng_softmax_tmp(nqh) * 4));
    BW_CK(cudaMalloc((void **)&chmax, (size_t)nkv * hd * 4));
    BW_CK(cudaMalloc((void **)&mad, (size_t)nkv * hd * 4));
    BW_CK(cudaMalloc((void **)&qs, (size_t)nqh * 4));
    BW_CK(cudaMalloc((void **)&chans, (size_t)nkv * C * 4));
    BW_CK(cudaMalloc((void **)&sel, (size_t)nkv * k * 4));
    BW_CK(cudaMalloc((void **)&bits, (size_t)nkv * n * hd / 8));
    BW_CK(cudaMalloc((void **)&x, (size_t)dim * 4));
    BW_CK(cudaMalloc((void **)&y, (size_t)nqh * hd * 4));
    BW_CK(cudaMalloc(&W, (size_t)nqh * hd * dim * 2));
    BW_CK(cudaMalloc(&dst, (size_t)2 * nkv * k * hd * 2));
    BW_CK(cudaHostAlloc(&rows_h, (size_t)n * nkv * 2 * hd * 2, cudaHostAllocMapped));
    BW_CK(cudaHostGetDevicePointer(&rows_d, rows_h, 0));
    BW_CK(cudaHostAlloc(&kcm_h, (size_t)nkv * hd * ldc * 2, cudaHostAllocMapped));
    BW_CK(cudaHostGetDevicePointer(&kcm_d, kcm_h, 0));
    memset(rows_h, 0x3c, (size_t)n * nkv * 2 * hd * 2);
    memset(kcm_h, 0x3c, (size_t)nkv * hd * ldc * 2);
    /* non-zero inputs (fills are seeded; values do not matter for time) */
    BW_CK(eng_fill_random(W, KV_DT_F16, (size_t)nqh * hd * dim, 5, NULL, 1, 1, s));
    BW_CK(eng_fill_random(bits, KV_DT_F16, (size_t)nkv * n * hd / 16, 6, NULL, 1, 1, s));
    BW_CK(eng_fill_f32(q, (size_t)nqh * hd, 0.5f, s));
    BW_CK(eng_fill_f32(x, (size_t)dim, 0.25f, s));
    BW_CK(eng_fill_f32(chmax, (size_t)nkv * hd, 1.0f, s));
    BW_CK(eng_fill_f32(mad, (size_t)nkv * hd, 0.7f, s));
    BW_CK(cudaStreamSynchronize(s));
#define TIME_US(field, launch)                                                          \
    do {                                                                                \
        for (int i_ = 0; i_ <= reps; i_++) {                                            \
            BW_CK(cudaEventRecord(a, s));                                               \
            BW_CK(launch);                                                              \
            BW_CK(cudaEventRecord(b, s));                                               \
            BW_CK(cudaEventSynchronize(b));                                             \
            BW_CK(cudaEventElapsedTime(&ms, a, b));                                     \
            if (i_) t[i_ - 1] = ms * 1e3;                                               \
        }                                                                               \
        us->field = median(t, reps);                                                    \
    } while (0)
    TIME_US(pred_gemv, eng_gemv(W, KV_DT_F16, nqh * hd, dim, x, y, 0, s));
    BW_CK(eng_select_channels(q, chmax, nqh, nkv, hd, C, chans, qs, s));
    TIME_US(score_channels, eng_score_channels(q, chans, qs, kcm_d, KV_DT_F16, ldc, nqh, nkv, hd, C, 0, n,
                                               score, s));
    /* last, so that the scores the next kernels see vary as real ones do */
    TIME_US(score_sketch, eng_score_sketch(q, bits, n, mad, nqh, nkv, hd, 0, n, score, s));
    TIME_US(softmax_combine, eng_softmax_combine(score, nqh, nkv, n, 0, tmp, comb, s));
    TIME_US(sketch_combine, eng_sketch_combine(q, bits, n, mad, nqh, nkv, hd, 0, n, 0, tmp, comb, s));
    TIME_US(topk, eng_topk(comb, nkv, n, k, 0, sel, s));
    TIME_US(gather, eng_gather_rows(rows_d, nkv, hd, KV_DT_F16, sel, k, NULL, 0, dst,
                                    (uint8_t *)dst + (size_t)nkv * k * hd * 2, (size_t)k, s));
#undef TIME_US
done:
    if (rows_h) cudaFreeHost(rows_h);
    if (kcm_h) cudaFreeHost(kcm_h);
    void *dev[] = {q, score, comb, tmp, chmax, mad, qs, chans, sel, bits, x, y, W, dst};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) cudaFree(dev[i]);
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
    if (s) cudaStreamDestroy(s);
    return st;
}

#else

kv_status kv_gpu_bench_select(int device, int n, int k, kv_gpu_select_us *us)
{
    (void)device;
    memset(us, 0, sizeof *us);
    us->n = n;
    us->k = k;
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA");
}

kv_status kv_gpu_bw_measure(int device, kv_gpu_bw *bw)
{
    (void)device;
    memset(bw, 0, sizeof *bw);
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA");
}

#endif
