/*
 * kv_gpu_bench: transfer ceilings and timed decode runs for `kv-bench
 * decode` (see kv_gpu_bench.h).  Transfers are timed with CUDA events,
 * after one untimed round, as the median of several rounds.
 */
#include "kv_gpu_bench.h"

#include <stdlib.h>
#include <string.h>

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

kv_status kv_gpu_bench_decode(kv_gpu_engine *e, const kv_policy_params *per_layer,
                              const kv_gpu_engine_opts *opts, int T, uint64_t seed, int warmup,
                              int tokens, int nofetch_tokens, kv_gpu_decode_result *r)
{
    memset(r, 0, sizeof *r);
    if (tokens < 1) return kv_fail(KV_E_USAGE, "no tokens to time");
    kv_status st = kv_gpu_engine_reset_opts(e, per_layer, opts);
    if (!st) st = kv_gpu_engine_synthesize(e, T, seed);
    if (st) return st;
    int n = warmup + tokens > nofetch_tokens ? warmup + tokens : nofetch_tokens;
    int *ids = malloc((size_t)n * sizeof(int));
    float *ms = malloc((size_t)n * sizeof(float));
    double *v = malloc((size_t)n * sizeof(double));
    if (!ids || !ms || !v) {
        free(ids);
        free(ms);
        free(v);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    st = kv_gpu_engine_generate(e, 1, warmup + tokens, ids, ms);
    if (!st) {
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
    }
    bool sparse = false;
    for (int l = 0; per_layer && l < kv_gpu_engine_n_layers(e); l++)
        sparse |= per_layer[l].kind == KV_POL_SPARSE;
    if (!st && sparse && nofetch_tokens > 0) {
        kv_gpu_engine_set_no_fetch(e, true);
        st = kv_gpu_engine_generate(e, ids[warmup + tokens - 1], nofetch_tokens, ids, ms);
        kv_gpu_engine_set_no_fetch(e, false);
        if (!st) {
            for (int i = 0; i < nofetch_tokens; i++) v[i] = ms[i];
            r->ms_nofetch = median(v, nofetch_tokens);
        }
    }
    free(ids);
    free(ms);
    free(v);
    return st;
}

#ifdef KV_HAVE_CUDA

#include <cuda_runtime_api.h>

#include "eng_ops.cuh"

#define BW_CK(call)                                                                      \
    do {                                                                                 \
        cudaError_t bw_e_ = (call);                                                      \
        if (bw_e_ != cudaSuccess) {                                                      \
            (void)cudaGetLastError();                                                    \
            st = kv_fail(bw_e_ == cudaErrorMemoryAllocation ? KV_E_NOMEM : KV_E_INTERNAL, \
                         "%s: %s", #call, cudaGetErrorString(bw_e_));                    \
            goto done;                                                                   \
        }                                                                                \
    } while (0)

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
    BW_CK(cudaMemset(d0, 0x5a, dbytes));
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
    BW_CK(cudaMemcpy(dsel, sel, (size_t)rows * sizeof(int), cudaMemcpyHostToDevice));
    for (int i = 0; i <= reps; i++) {
        BW_CK(cudaEventRecord(a, s));
        /* rows as (T, 1 head, K|V, 128): the engine's gather, 8 of them per warp-row */
        BW_CK(eng_gather_rows(hd, 1, 128, ENG_F16, dsel, rows, NULL, 0, d1,
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

#else

kv_status kv_gpu_bw_measure(int device, kv_gpu_bw *bw)
{
    (void)device;
    memset(bw, 0, sizeof *bw);
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA");
}

#endif
