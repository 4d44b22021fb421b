/*
 * Measurements for kv-bench attn/pack (see kv_cuda_bench.h).  The GPU part
 * compiles only with KV_HAVE_CUDA; without it every GPU entry point returns
 * KV_E_UNAVAILABLE, so CPU-only, sanitizer and fuzz builds link the same API.
 */
#include "eval/kv_cuda_bench.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "attn/kv_attn.h"
#include "common/kv_half.h"
#include "quant/kv_quant.h"

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *x, int n)
{
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* n fp16 values: a block of 2^20 random normals (sum of uniforms, never
 * exactly zero in bulk) repeated; content does not change the timings but
 * must not be zeros. */
static void fill_random_half(kv_half *h, size_t n, unsigned long long s)
{
    const size_t blk = (size_t)1 << 20;
    for (size_t i = 0; i < n && i < blk; i++) {
        float a = 0;
        for (int j = 0; j < 4; j++) {
            s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
            a += (float)((s * 2685821657736338717ULL) >> 40) * (1.0f / 16777216.0f);
        }
        h[i] = kv_f32_to_half((a - 2.0f) * 1.7f);
    }
    for (size_t i = blk; i < n; i++) h[i] = h[i % blk];
}

// --- CPU packing ---------------------------------------------------------------------

kv_status kv_cpu_bench_pack(const kv_bench_pack_cfg *c, int threads, kv_bench_pack_result *r)
{
    kv_kivi_params prm = {c->bits, c->group, c->residual};
    kv_status st = kv_kivi_check(&prm, c->head_dim);
    if (st) return st;
    size_t n = (size_t)c->n_kv_heads * c->T * c->head_dim;
    kv_half *h = malloc(n * sizeof(kv_half));
    float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    double *t = calloc((size_t)c->reps + 1, sizeof(double));
    if (!h || !k || !v || !t) {
        free(h), free(k), free(v), free(t);
        return kv_fail(KV_E_NOMEM, "CPU pack benchmark buffers (%zu values)", n);
    }
    fill_random_half(h, n, 42);
    for (size_t i = 0; i < n; i++) k[i] = kv_half_to_f32(h[i]);
    fill_random_half(h, n, 4242);
    for (size_t i = 0; i < n; i++) v[i] = kv_half_to_f32(h[i]);
#ifdef _OPENMP
    int old = omp_get_max_threads();
    if (threads > 0) omp_set_num_threads(threads);
#else
    (void)threads;
#endif
    r->in_bytes = 2.0 * (double)n * sizeof(kv_half);
    r->out_bytes = 2.0 * (double)kv_kivi_bytes(KV_KIVI_KEYS, &prm, c->n_kv_heads, c->T, c->head_dim);
    for (int rep = -1; rep < c->reps && !st; rep++) { /* rep -1 warms up */
        kv_kivi_packed K, V;
        double t0 = now_s();
        st = kv_kivi_pack(k, KV_KIVI_KEYS, &prm, c->n_kv_heads, c->T, c->head_dim, &K);
        if (st) break;
        st = kv_kivi_pack(v, KV_KIVI_VALUES, &prm, c->n_kv_heads, c->T, c->head_dim, &V);
        double t1 = now_s();
        kv_kivi_clear(&K);
        if (st) break;
        kv_kivi_clear(&V);
        if (rep >= 0) t[rep] = t1 - t0;
    }
#ifdef _OPENMP
    omp_set_num_threads(old);
#endif
    if (!st) r->seconds = median(t, c->reps);
    free(h), free(k), free(v), free(t);
    return st;
}

#ifdef KV_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/kv_dtype.h"
#include "eng_ops.cuh"
#include "gpu/kv_gpu_cuda.h"
#include "model/kv_quants.h"

/* A failed CUDA call or launcher: st names the statement (kv_cuda_fail), then cleanup. */
#define CK(x) KV_CUDA_CK_GOTO(x, st, done)

kv_status kv_cuda_bench_device(kv_bench_device *dev)
{
    int n = 0;
    memset(dev, 0, sizeof *dev);
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        (void)cudaGetLastError();
        return kv_fail(KV_E_UNAVAILABLE, "no usable CUDA device");
    }
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess)
        return kv_fail(KV_E_UNAVAILABLE, "cannot read the properties of CUDA device 0");
    snprintf(dev->name, sizeof dev->name, "%s", p.name);
    dev->sms = p.multiProcessorCount;
    dev->l2_bytes = (size_t)p.l2CacheSize;
    cudaDriverGetVersion(&dev->driver);
    cudaRuntimeGetVersion(&dev->runtime);
    return KV_OK;
}

typedef cudaError_t (*launch_fn)(void *ctx, int i);

/* Median seconds per launch over reps timings of iters launches each. */
static kv_status time_launches(launch_fn fn, void *ctx, int iters, int reps, double *sec)
{
    kv_status st = KV_OK;
    cudaEvent_t e0 = NULL, e1 = NULL;
    double *t = calloc((size_t)reps, sizeof(double));
    if (!t) return kv_fail(KV_E_NOMEM, "timing buffer");
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; i++) CK(fn(ctx, i));
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < reps; r++) {
        CK(cudaEventRecord(e0, 0));
        for (int i = 0; i < iters; i++) CK(fn(ctx, i));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t[r] = 1e-3 * ms / iters;
    }
    *sec = median(t, reps);
done:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    free(t);
    return st;
}

typedef struct {
    void *dst, *src;
    size_t bytes;
} copy_ctx;

static cudaError_t copy_launch(void *ctx, int i)
{
    copy_ctx *c = ctx;
    (void)i;
    return cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, 0);
}

kv_status kv_cuda_bench_copy(size_t bytes, int iters, int reps, double *bytes_per_s)
{
    kv_status st = KV_OK;
    copy_ctx c = {NULL, NULL, bytes};
    CK(cudaMalloc(&c.dst, bytes));
    CK(cudaMalloc(&c.src, bytes));
    CK(cudaMemset(c.src, 0x3c, bytes));
    double s = 0;
    st = time_launches(copy_launch, &c, iters, reps, &s);
    if (!st) *bytes_per_s = 2.0 * (double)bytes / s;
done:
    cudaFree(c.dst);
    cudaFree(c.src);
    return st;
}

// --- attention ---------------------------------------------------------------------

#define MAX_COPIES 64

typedef struct {
    kv_attn_dims d;
    kv_kivi_params prm;
    const uint16_t *q;
    uint16_t *k[MAX_COPIES], *v[MAX_COPIES];
    kv_cuda_kivi_view K[MAX_COPIES], V[MAX_COPIES];
    int copies;
    float *out;
    void *ws;
    size_t wsb;
} attn_ctx;

static cudaError_t f16_launch(void *ctx, int i)
{
    attn_ctx *a = ctx;
    int c = i % a->copies;
    return kv_cuda_attn_f16(&a->d, a->q, a->k[c], a->v[c], a->out, a->ws, a->wsb, 0);
}

static cudaError_t kivi_launch(void *ctx, int i)
{
    attn_ctx *a = ctx;
    int c = i % a->copies;
    return kv_cuda_attn_kivi(&a->d, &a->prm, a->q, &a->K[c], &a->V[c], a->out, a->ws, a->wsb, 0);
}

static int copies_for(size_t bytes, size_t l2)
{
    size_t want = 4 * (l2 ? l2 : ((size_t)64 << 20));
    size_t n = (want + bytes - 1) / bytes;
    return n < 1 ? 1 : n > MAX_COPIES ? MAX_COPIES : (int)n;
}

static double nerr(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / den);
}

/* One packed path: pack `copies` copies from the fp16 copies, time, check. */
static kv_status bench_kivi(const kv_bench_attn_cfg *c, attn_ctx *f16, size_t l2, int bits,
                            const kv_half *hq, const kv_half *hk, const kv_half *hv,
                            kv_bench_attn_path *out)
{
    kv_status st = KV_OK;
    attn_ctx a = *f16;
    a.prm = (kv_kivi_params){bits, c->group, c->residual};
    a.copies = 0;
    a.ws = NULL;
    memset(out, 0, sizeof *out);
    out->err = -1;
    const int H = c->n_kv_heads, T = c->T, D = c->head_dim;
    float *got = NULL, *ref = NULL, *kf = NULL, *vf = NULL;
    kv_kivi_packed K = {0}, V = {0};
    if (!kv_cuda_attn_kivi_supported(&a.d, &a.prm) ||
        !kv_cuda_kivi_pack_supported(KV_KIVI_KEYS, &a.prm, D) ||
        !kv_cuda_kivi_pack_supported(KV_KIVI_VALUES, &a.prm, D))
        return KV_OK; /* ok = 0: not supported here */
    size_t nc = kv_kivi_codes_bytes(KV_KIVI_KEYS, &a.prm, H, T, D);
    size_t nks = kv_kivi_scale_count(KV_KIVI_KEYS, &a.prm, H, T, D);
    size_t nvs = kv_kivi_scale_count(KV_KIVI_VALUES, &a.prm, H, T, D);
    size_t nr = kv_kivi_resid_count(&a.prm, H, T, D);
    size_t per_copy = kv_kivi_bytes(KV_KIVI_KEYS, &a.prm, H, T, D) +
                      kv_kivi_bytes(KV_KIVI_VALUES, &a.prm, H, T, D);
    int want = copies_for(per_copy, l2);
    for (; a.copies < want; a.copies++) {
        int i = a.copies;
        kv_cuda_kivi_out ko = {0}, vo = {0};
        CK(cudaMalloc((void **)&ko.codes, nc + 1));
        a.K[i].codes = ko.codes;
        CK(cudaMalloc((void **)&ko.scale, 2 * nks + 2));
        a.K[i].scale = ko.scale;
        CK(cudaMalloc((void **)&ko.zero, 2 * nks + 2));
        a.K[i].zero = ko.zero;
        CK(cudaMalloc((void **)&ko.resid, 2 * nr + 2));
        a.K[i].resid = ko.resid;
        CK(cudaMalloc((void **)&vo.codes, nc + 1));
        a.V[i].codes = vo.codes;
        CK(cudaMalloc((void **)&vo.scale, 2 * nvs + 2));
        a.V[i].scale = vo.scale;
        CK(cudaMalloc((void **)&vo.zero, 2 * nvs + 2));
        a.V[i].zero = vo.zero;
        CK(cudaMalloc((void **)&vo.resid, 2 * nr + 2));
        a.V[i].resid = vo.resid;
        int src = i % f16->copies;
        CK(kv_cuda_kivi_pack(KV_KIVI_KEYS, &a.prm, H, T, D, f16->k[src], &ko, 0));
        CK(kv_cuda_kivi_pack(KV_KIVI_VALUES, &a.prm, H, T, D, f16->v[src], &vo, 0));
    }
    a.wsb = kv_cuda_attn_kivi_workspace(&a.d, &a.prm);
    CK(cudaMalloc(&a.ws, a.wsb));
    st = time_launches(kivi_launch, &a, c->iters, c->reps, &out->seconds);
    if (st) goto done;
    out->ok = 1;
    out->kernel = kv_cuda_attn_kivi_kernel(&a.d, &a.prm);
    out->bytes = (double)per_copy + 2.0 * 2 * c->n_heads * D + 4.0 * c->n_heads * D;
    out->bytes_per_s = out->bytes / out->seconds;
    if (c->check) {
        size_t nq = (size_t)c->n_heads * D, n = (size_t)H * T * D;
        got = malloc(nq * 4), ref = malloc(nq * 4), kf = malloc(n * 4), vf = malloc(n * 4);
        if (!got || !ref || !kf || !vf) {
            st = kv_fail(KV_E_NOMEM, "check buffers");
            goto done;
        }
        for (size_t i = 0; i < n; i++) kf[i] = kv_half_to_f32(hk[i]), vf[i] = kv_half_to_f32(hv[i]);
        kv_attn_dims cd = {c->n_heads, H, D, T, 0, a.d.scale};
        if ((st = kv_kivi_pack(kf, KV_KIVI_KEYS, &a.prm, H, T, D, &K)) ||
            (st = kv_kivi_pack(vf, KV_KIVI_VALUES, &a.prm, H, T, D, &V)) ||
            (st = kv_attn_decode_kivi(&cd, hq, &K, &V, ref)))
            goto done;
        CK(cudaMemset(a.out, 0xff, nq * 4));
        CK(kivi_launch(&a, 0));
        CK(cudaMemcpy(got, a.out, nq * 4, cudaMemcpyDeviceToHost));
        out->err = nerr(got, ref, nq);
    }
done:
    for (int i = 0; i < a.copies + (a.copies < want && st ? 1 : 0) && i < MAX_COPIES; i++) {
        cudaFree((void *)a.K[i].codes), cudaFree((void *)a.K[i].scale);
        cudaFree((void *)a.K[i].zero), cudaFree((void *)a.K[i].resid);
        cudaFree((void *)a.V[i].codes), cudaFree((void *)a.V[i].scale);
        cudaFree((void *)a.V[i].zero), cudaFree((void *)a.V[i].resid);
    }
    cudaFree(a.ws);
    if (K.codes) kv_kivi_clear(&K);
    if (V.codes) kv_kivi_clear(&V);
    free(got), free(ref), free(kf), free(vf);
    return st;
}

static kv_status bench_attn(const kv_bench_attn_cfg *c, kv_bench_attn_result *r);

kv_status kv_cuda_bench_attn(kv_bench_attn_cfg *c, kv_bench_attn_result *r)
{
    int major = 0, keep_pdl = kv_cuda_pdl();
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        return kv_fail(KV_E_UNAVAILABLE, "no usable CUDA device");
    }
    if (c->pdl < 0) c->pdl = major >= 9 ? 2 : 0;
    if (major < 9) c->pdl = 0; /* griddepcontrol needs sm_90 */
    kv_cuda_set_pdl(c->pdl);
    kv_cuda_tuning keep = *kv_cuda_get_tuning(), t;
    kv_cuda_tuning_default(&t);
    t.f16_prefetch = c->variant.f16_prefetch;
    if (c->variant.f16_unroll) t.f16_unroll = c->variant.f16_unroll;
    if (c->variant.f16_waves) t.f16_waves = c->variant.f16_waves;
    t.kivi2_var = c->variant.kivi2_var;
    t.f16_legacy = c->variant.f16_legacy;
    t.kivi_kernel = c->variant.kivi_kernel;
    t.kivi3_nst = c->variant.kivi3_nst;
    t.kivi3_unfused = c->variant.kivi3_unfused;
    t.kivi3_cps = c->variant.kivi3_cps;
    t.kivi3_diag = c->variant.kivi3_diag;
    t.kivi3_noprefetch = c->variant.kivi3_noprefetch;
    t.kivi3_var = c->variant.kivi3_var;
    kv_cuda_set_tuning(&t);
    kv_status st = bench_attn(c, r);
    kv_cuda_set_tuning(&keep);
    kv_cuda_set_pdl(keep_pdl);
    return st;
}

static kv_status bench_attn(const kv_bench_attn_cfg *c, kv_bench_attn_result *r)
{
    kv_status st = KV_OK;
    kv_bench_device dev;
    if ((st = kv_cuda_bench_device(&dev))) return st;
    memset(r, 0, sizeof *r);
    r->f16.err = r->kivi1.err = r->kivi2.err = r->kivi4.err = -1;
    attn_ctx a;
    memset(&a, 0, sizeof a);
    a.d = (kv_attn_dims){c->n_heads, c->n_kv_heads, c->head_dim, c->T,
                              (long long)c->T * c->head_dim, 1.0f / sqrtf((float)c->head_dim)};
    const size_t n = (size_t)c->n_kv_heads * c->T * c->head_dim, nq = (size_t)c->n_heads * c->head_dim;
    kv_half *hq = malloc(nq * 2), *hk = malloc(n * 2), *hv = malloc(n * 2);
    float *got = NULL, *ref = NULL;
    if (!hq || !hk || !hv) {
        st = kv_fail(KV_E_NOMEM, "host buffers for %zu values", n);
        goto done;
    }
    a.wsb = kv_cuda_attn_f16_workspace(&a.d);
    if (!a.wsb) {
        st = kv_fail(KV_E_UNSUPPORTED, "fp16 attention does not support %d/%d heads of dim %d "
                     "(head dim 8..256, a power of two; at most 8 query heads per KV head)",
                     c->n_heads, c->n_kv_heads, c->head_dim);
        goto done;
    }
    fill_random_half(hq, nq, 7);
    fill_random_half(hk, n, 11);
    fill_random_half(hv, n, 13);
    CK(cudaMalloc((void **)&a.q, nq * 2));
    CK(cudaMemcpy((void *)a.q, hq, nq * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&a.out, nq * 4));
    CK(cudaMalloc(&a.ws, a.wsb));
    int want = copies_for(4 * n, dev.l2_bytes);
    for (; a.copies < want; a.copies++) {
        CK(cudaMalloc((void **)&a.k[a.copies], n * 2));
        CK(cudaMalloc((void **)&a.v[a.copies], n * 2));
        CK(cudaMemcpy(a.k[a.copies], hk, n * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(a.v[a.copies], hv, n * 2, cudaMemcpyHostToDevice));
    }
    r->copies = a.copies;
    if ((st = time_launches(f16_launch, &a, c->iters, c->reps, &r->f16.seconds))) goto done;
    r->f16.ok = 1;
    r->f16.bytes = 4.0 * (double)n + 2.0 * (double)nq + 4.0 * (double)nq;
    r->f16.bytes_per_s = r->f16.bytes / r->f16.seconds;
    if (c->check) {
        got = malloc(nq * 4), ref = malloc(nq * 4);
        kv_attn_dims cd = {c->n_heads, c->n_kv_heads, c->head_dim, c->T, 0, a.d.scale};
        if (!got || !ref) {
            st = kv_fail(KV_E_NOMEM, "check buffers");
            goto done;
        }
        if ((st = kv_attn_decode_f16(&cd, hq, hk, hv, ref))) goto done;
        CK(cudaMemset(a.out, 0xff, nq * 4));
        CK(f16_launch(&a, 0));
        CK(cudaMemcpy(got, a.out, nq * 4, cudaMemcpyDeviceToHost));
        r->f16.err = nerr(got, ref, nq);
    }
    {
        kv_kivi_params kp = {1, c->group, c->residual};
        r->kivi_kernel = kv_cuda_attn_kivi_kernel(&a.d, &kp);
    }
    if ((st = bench_kivi(c, &a, dev.l2_bytes, 1, hq, hk, hv, &r->kivi1))) goto done;
    if ((st = bench_kivi(c, &a, dev.l2_bytes, 2, hq, hk, hv, &r->kivi2))) goto done;
    if ((st = bench_kivi(c, &a, dev.l2_bytes, 4, hq, hk, hv, &r->kivi4))) goto done;
done:
    for (int i = 0; i < MAX_COPIES; i++) cudaFree(a.k[i]), cudaFree(a.v[i]);
    cudaFree((void *)a.q), cudaFree(a.out), cudaFree(a.ws);
    free(hq), free(hk), free(hv), free(got), free(ref);
    return st;
}

// --- GPU packing --------------------------------------------------------------------

typedef struct {
    kv_kivi_params prm;
    int H, T, D, copies;
    uint16_t *k[MAX_COPIES], *v[MAX_COPIES];
    kv_cuda_kivi_out ko, vo;
} pack_ctx;

static cudaError_t pack_launch(void *ctx, int i)
{
    pack_ctx *p = ctx;
    int c = i % p->copies;
    cudaError_t e = kv_cuda_kivi_pack(KV_KIVI_KEYS, &p->prm, p->H, p->T, p->D, p->k[c], &p->ko, 0);
    if (e == cudaSuccess)
        e = kv_cuda_kivi_pack(KV_KIVI_VALUES, &p->prm, p->H, p->T, p->D, p->v[c], &p->vo, 0);
    return e;
}

kv_status kv_cuda_bench_pack(const kv_bench_pack_cfg *c, kv_bench_pack_result *r)
{
    kv_status st = KV_OK;
    kv_bench_device dev;
    if ((st = kv_cuda_bench_device(&dev))) return st;
    pack_ctx p;
    memset(&p, 0, sizeof p);
    p.prm = (kv_kivi_params){c->bits, c->group, c->residual};
    p.H = c->n_kv_heads, p.T = c->T, p.D = c->head_dim;
    if (!kv_cuda_kivi_pack_supported(KV_KIVI_KEYS, &p.prm, p.D) ||
        !kv_cuda_kivi_pack_supported(KV_KIVI_VALUES, &p.prm, p.D))
        return kv_fail(KV_E_UNSUPPORTED, "GPU packing does not support %d bits, group %d, dim %d",
                       c->bits, c->group, c->head_dim);
    const size_t n = (size_t)p.H * p.T * p.D;
    kv_half *h = malloc(n * 2);
    if (!h) return kv_fail(KV_E_NOMEM, "host buffer of %zu values", n);
    fill_random_half(h, n, 99);
    size_t nc = kv_kivi_codes_bytes(KV_KIVI_KEYS, &p.prm, p.H, p.T, p.D);
    size_t nks = kv_kivi_scale_count(KV_KIVI_KEYS, &p.prm, p.H, p.T, p.D);
    size_t nvs = kv_kivi_scale_count(KV_KIVI_VALUES, &p.prm, p.H, p.T, p.D);
    size_t nr = kv_kivi_resid_count(&p.prm, p.H, p.T, p.D);
    CK(cudaMalloc((void **)&p.ko.codes, nc + 1));
    CK(cudaMalloc((void **)&p.ko.scale, 2 * nks + 2));
    CK(cudaMalloc((void **)&p.ko.zero, 2 * nks + 2));
    CK(cudaMalloc((void **)&p.ko.resid, 2 * nr + 2));
    CK(cudaMalloc((void **)&p.vo.codes, nc + 1));
    CK(cudaMalloc((void **)&p.vo.scale, 2 * nvs + 2));
    CK(cudaMalloc((void **)&p.vo.zero, 2 * nvs + 2));
    CK(cudaMalloc((void **)&p.vo.resid, 2 * nr + 2));
    int want = copies_for(4 * n, dev.l2_bytes);
    for (; p.copies < want; p.copies++) {
        CK(cudaMalloc((void **)&p.k[p.copies], n * 2));
        CK(cudaMalloc((void **)&p.v[p.copies], n * 2));
        CK(cudaMemcpy(p.k[p.copies], h, n * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(p.v[p.copies], h, n * 2, cudaMemcpyHostToDevice));
    }
    if ((st = time_launches(pack_launch, &p, c->iters, c->reps, &r->seconds))) goto done;
    r->in_bytes = 4.0 * (double)n;
    r->out_bytes = (double)(kv_kivi_bytes(KV_KIVI_KEYS, &p.prm, p.H, p.T, p.D) +
                            kv_kivi_bytes(KV_KIVI_VALUES, &p.prm, p.H, p.T, p.D));
done:
    for (int i = 0; i < MAX_COPIES; i++) cudaFree(p.k[i]), cudaFree(p.v[i]);
    cudaFree(p.ko.codes), cudaFree(p.ko.scale), cudaFree(p.ko.zero), cudaFree(p.ko.resid);
    cudaFree(p.vo.codes), cudaFree(p.vo.scale), cudaFree(p.vo.zero), cudaFree(p.vo.resid);
    free(h);
    return st;
}

// --- packed GEMV --------------------------------------------------------------------

#define GEMV_DISTINCT 64 /* distinct random rows of a benchmark matrix */

typedef struct {
    const uint8_t *w[MAX_COPIES];
    int copies, variant, rows, cols;
    kv_dtype t;
    size_t pitch;
    const float *x;
    float *y;
} gemv_ctx;

static cudaError_t gemv_launch(void *ctx, int i)
{
    gemv_ctx *g = ctx;
    const uint8_t *w = g->w[i % g->copies];
    if (g->t == KV_DT_F16) return eng_gemv(w, KV_DT_F16, g->rows, g->cols, g->x, g->y, 0, 0);
    return eng_gemv_qv(g->variant, w, g->t, g->rows, g->cols, g->pitch, g->x, g->y, 0, 0);
}

kv_status kv_cuda_bench_gemv(const kv_bench_gemv_cfg *c, kv_bench_gemv_result *r)
{
    kv_status st = KV_OK;
    const uint32_t g = (uint32_t)c->wtype;
    const kv_dtype t = kv_dtype_from_ggml(g);
    if (!(t == KV_DT_F16 || eng_packed_type(t)))
        return kv_fail(KV_E_USAGE, "GEMV benchmark: type %s is neither packed on the GPU nor F16", kv_dtype_name(t));
    const int blk = kv_quant_block(g);
    if (c->rows < 1 || c->cols < 1 || c->cols % blk || (t == KV_DT_F16 && c->cols % 8))
        return kv_fail(KV_E_USAGE, "GEMV benchmark: %d columns are not a multiple of the %s block (%d)", c->cols,
                       kv_dtype_name(t), t == KV_DT_F16 ? 8 : blk);
    const size_t pitch = kv_quant_row_bytes(g, c->cols), wbytes = (size_t)c->rows * pitch;
    const int nd = c->rows < GEMV_DISTINCT ? c->rows : GEMV_DISTINCT;
    gemv_ctx ctx = {{NULL}, 0, c->variant, c->rows, c->cols, t, pitch, NULL, NULL};
    float *wf = malloc((size_t)nd * c->cols * sizeof(float)), *deq = malloc((size_t)nd * c->cols * sizeof(float));
    float *x = malloc((size_t)c->cols * sizeof(float)), *y = malloc((size_t)c->rows * sizeof(float));
    uint8_t *rowsb = malloc((size_t)nd * pitch), *stage = NULL;
    double *ref = malloc((size_t)nd * sizeof(double));
    float *dx = NULL, *dy = NULL;
    if (!wf || !deq || !x || !y || !rowsb || !ref) {
        st = kv_fail(KV_E_NOMEM, "GEMV benchmark buffers");
        goto done;
    }
    unsigned long long seed = 0x9e3779b97f4a7c15ULL ^ (unsigned long long)c->rows * 31u ^ (unsigned long long)c->cols;
    for (size_t i = 0; i < (size_t)nd * c->cols + (size_t)c->cols; i++) {
        float a = 0;
        for (int j = 0; j < 4; j++) {
            seed ^= seed >> 12, seed ^= seed << 25, seed ^= seed >> 27;
            a += (float)((seed * 2685821657736338717ULL) >> 40) * (1.0f / 16777216.0f);
        }
        a = (a - 2.0f) * 1.7f; /* about unit variance */
        if (i < (size_t)nd * c->cols) wf[i] = 0.05f * a;
        else x[i - (size_t)nd * c->cols] = a;
    }
    for (int i = 0; i < nd; i++) {
        if ((st = kv_quant_quantize_row(g, wf + (size_t)i * c->cols, rowsb + (size_t)i * pitch, c->cols))) goto done;
        kv_quant_dequant_row(g, rowsb + (size_t)i * pitch, deq + (size_t)i * c->cols, c->cols);
        double sum = 0;
        for (int k = 0; k < c->cols; k++) sum += (double)deq[(size_t)i * c->cols + k] * x[k];
        ref[i] = sum;
    }
    /* enough copies of W that together they exceed L2 four times */
    int dev = 0;
    struct cudaDeviceProp prop;
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    size_t need = 4 * (size_t)prop.l2CacheSize;
    ctx.copies = (int)((need + wbytes - 1) / wbytes);
    if (ctx.copies < 1) ctx.copies = 1;
    if (ctx.copies > MAX_COPIES) ctx.copies = MAX_COPIES;
    /* the matrix: the distinct rows repeated, staged in chunks */
    const size_t chunk_rows = 4096;
    stage = malloc(chunk_rows * pitch);
    if (!stage) {
        st = kv_fail(KV_E_NOMEM, "GEMV benchmark staging");
        goto done;
    }
    for (int k = 0; k < ctx.copies; k++) {
        void *d = NULL;
        CK(cudaMalloc(&d, wbytes));
        ctx.w[k] = d;
        if (k) {
            CK(cudaMemcpy(d, ctx.w[0], wbytes, cudaMemcpyDeviceToDevice));
            continue;
        }
        for (size_t r0 = 0; r0 < (size_t)c->rows; r0 += chunk_rows) {
            size_t nr = (size_t)c->rows - r0 < chunk_rows ? (size_t)c->rows - r0 : chunk_rows;
            for (size_t i = 0; i < nr; i++)
                memcpy(stage + i * pitch, rowsb + ((r0 + i) % (size_t)nd) * pitch, pitch);
            CK(cudaMemcpy((uint8_t *)d + r0 * pitch, stage, nr * pitch, cudaMemcpyHostToDevice));
        }
    }
    CK(cudaMalloc((void **)&dx, (size_t)c->cols * sizeof(float)));
    CK(cudaMalloc((void **)&dy, (size_t)c->rows * sizeof(float)));
    CK(cudaMemcpy(dx, x, (size_t)c->cols * sizeof(float), cudaMemcpyHostToDevice));
    ctx.x = dx, ctx.y = dy;
    r->err = -1;
    r->copies = ctx.copies;
    if (c->check) {
        CK(cudaMemset(dy, 0xff, (size_t)c->rows * sizeof(float))); /* NaN: rows left unwritten show */
        CK(gemv_launch(&ctx, 0));
        CK(cudaMemcpy(y, dy, (size_t)c->rows * sizeof(float), cudaMemcpyDeviceToHost));
        double num = 0, den = 0;
        for (int i = 0; i < c->rows; i++) {
            double e = (double)y[i] - ref[i % nd];
            num += isfinite(y[i]) ? e * e : INFINITY;
            den += ref[i % nd] * ref[i % nd];
        }
        r->err = den > 0 ? sqrt(num / den) : sqrt(num);
    }
    if ((st = time_launches(gemv_launch, &ctx, c->iters, c->reps, &r->seconds))) goto done;
    r->bytes = (double)wbytes + 4.0 * c->cols + 4.0 * c->rows;
    r->bytes_per_s = r->bytes / r->seconds;
done:
    for (int k = 0; k < ctx.copies; k++) cudaFree((void *)ctx.w[k]);
    cudaFree(dx);
    cudaFree(dy);
    free(wf), free(deq), free(x), free(y), free(rowsb), free(ref), free(stage);
    return st;
}

#else /* no CUDA in this build */

kv_status kv_cuda_bench_device(kv_bench_device *dev)
{
    memset(dev, 0, sizeof *dev);
    return kv_fail(KV_E_UNAVAILABLE, "this build has no CUDA support");
}

kv_status kv_cuda_bench_copy(size_t bytes, int iters, int reps, double *bytes_per_s)
{
    (void)bytes, (void)iters, (void)reps, (void)bytes_per_s;
    return kv_fail(KV_E_UNAVAILABLE, "this build has no CUDA support");
}

kv_status kv_cuda_bench_attn(kv_bench_attn_cfg *c, kv_bench_attn_result *r)
{
    (void)c, (void)r;
    return kv_fail(KV_E_UNAVAILABLE, "this build has no CUDA support");
}

kv_status kv_cuda_bench_pack(const kv_bench_pack_cfg *c, kv_bench_pack_result *r)
{
    (void)c, (void)r;
    return kv_fail(KV_E_UNAVAILABLE, "this build has no CUDA support");
}

kv_status kv_cuda_bench_gemv(const kv_bench_gemv_cfg *c, kv_bench_gemv_result *r)
{
    (void)c, (void)r;
    return kv_fail(KV_E_UNAVAILABLE, "this build has no CUDA support");
}
#endif
