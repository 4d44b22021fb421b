/*
 * The GPU engine against the CPU: each of the engine's kernels
 * (kernels/eng_*.cu, and the fp16 attention at the engine's geometries)
 * against a float64 computation here on fresh random data, by normalized
 * error; then whole decodes of the real stories260K and niah4k models
 * through the GPU engine (lib/gpu) against lib/engine/kv_engine.c, same
 * tokens fed to both, logits compared per step within fp16 tolerance, and the
 * greedy ids compared wherever the CPU's top-2 margin is clear of fp16
 * rounding; offload must equal full on the GPU; sparse (channel, exact,
 * sketch) must follow the CPU sparse policy closely.  The packed weights
 * (Q8_0, Q4_K, Q6_K kept as blocks: kernels/eng_gemv_q.cu, eng_dequant.cu)
 * against lib/model/kv_quants' reference on random rows, then whole models
 * in those types against the CPU engine on their exact float32 conversion;
 * qwen2's q/k/v biases and heads wider than dim / n_heads against the CPU
 * engine, through both prefill paths.
 * Without a usable GPU (or in a CPU-only build) the GPU tests are reported
 * as skipped, and the one check that runs is that the engine refuses with
 * KV_E_UNAVAILABLE and a message.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt_kv.h"
#include "common/kv_ggml.h"
#include "engine/kv_engine.h"
#include "engine/kv_runner.h"
#include "format/kvc.h"
#include "gpu/kv_gpu.h"
#include "gpu/kv_gpu_engine.h"
#include "common/kv_half.h"
#include "model/kv_convert.h"
#include "model/kv_model.h"
#include "model/kv_quants.h"
#include "model/kv_tokenizer.h"
#include "policy/kv_policy.h"
#include "policy/kv_select.h"
#include "quant/kv_dsq.h"
#include "quant/kv_quant.h"
#include "eval/kv_niah.h"
#include "model/kv_tokenizer.h"

#ifdef KV_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "eng_ops.cuh"
#include "kv_kernels.h"
#endif

#define S260 "tests/data/stories260K/"
#define NIAH "tests/data/niah4k/"

#ifdef KV_HAVE_CUDA
static unsigned long long seed = 0x51ed270b1f3c9a7dULL;
#endif

/* KV_GPU_TEST_SHORT=1 (under compute-sanitizer): smaller prompts and runs. */
__attribute__((unused)) static int short_run(void) { return getenv("KV_GPU_TEST_SHORT") != NULL; }


static void test_engine_refuses_without_gpu(void)
{
    kv_model *m = NULL;
    OK(kv_model_synthetic("tiny", 1, KV_DT_F32, &m));
    kv_gpu_engine *g = NULL;
    kv_errclear();
    kv_status st = kv_gpu_engine_new(m, NULL, 64, NULL, &g);
    KT_CHECK(st == KV_E_UNAVAILABLE, "status %d (%s)", (int)st, kv_errdetail());
    KT_CHECK(g == NULL, "engine returned");
    KT_CHECK(strlen(kv_errdetail()) > 10, "message '%s'", kv_errdetail());
    kv_model_close(m);
}

#ifdef KV_HAVE_CUDA

/* ||a - b|| / ||b|| */
static double nerr(const float *a, const double *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        if (isnan(a[i])) return INFINITY;
        num += d * d;
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static double nerr_f(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        if (isnan(a[i])) return INFINITY;
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static double nerr_d(const double *a, const double *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Top-1 minus top-2 logit. */
static float margin(const float *x, int n)
{
    int b = kt_argmax(x, n);
    float s = -INFINITY;
    for (int i = 0; i < n; i++)
        if (i != b && x[i] > s) s = x[i];
    return x[b] - s;
}

#define CU(call) KT_REQUIRE((call) == cudaSuccess, "%s: %s", #call, cudaGetErrorString(cudaGetLastError()))

static void *dput(const void *h, size_t bytes)
{
    void *d = NULL;
    if (cudaMalloc(&d, bytes) != cudaSuccess) return NULL;
    cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    return d;
}

// --- kernels against float64 ------------------------------------------------------

static void check_gemv(int bf16, int rows, int cols)
{
    int ld = (cols + 7) & ~7;
    uint16_t *W = calloc((size_t)rows * ld, 2);
    float *x = calloc((size_t)ld, 4), *y = malloc((size_t)rows * 4);
    double *ref = malloc((size_t)rows * sizeof(double));
    for (int c = 0; c < cols; c++) x[c] = kt_randn(&seed);
    for (int r = 0; r < rows; r++) {
        double s = 0;
        for (int c = 0; c < cols; c++) {
            float w = kt_randn(&seed) * 0.05f;
            uint16_t b = bf16 ? kv_f32_to_bf16(w) : kv_f32_to_half(w);
            W[(size_t)r * ld + c] = b;
            s += (double)(bf16 ? kv_bf16_to_f32(b) : kv_half_to_f32(b)) * x[c];
        }
        ref[r] = s + 1.0; /* accumulate onto y = 1 */
    }
    void *dW = dput(W, (size_t)rows * ld * 2);
    float *dx = dput(x, (size_t)ld * 4), *dy = NULL;
    for (int r = 0; r < rows; r++) y[r] = 1.0f;
    dy = dput(y, (size_t)rows * 4);
    KT_REQUIRE(dW && dx && dy, "alloc");
    CU(eng_gemv(dW, bf16 ? KV_DT_BF16 : KV_DT_F16, rows, ld, dx, dy, 1, 0));
    CU(cudaMemcpy(y, dy, (size_t)rows * 4, cudaMemcpyDeviceToHost));
    double e = nerr(y, ref, (size_t)rows);
    KT_CHECK(e < 1e-5, "gemv %s %dx%d: normalized error %g", bf16 ? "bf16" : "f16", rows, cols, e);
    cudaFree(dW);
    cudaFree(dx);
    cudaFree(dy);
    free(W);
    free(x);
    free(y);
    free(ref);
}

/* y = silu(G·n) * (U·n), n = rmsnorm(x, nw), rows of G and U interleaved. */
static void check_gemv_norm_glu(int bf16, int rows, int cols)
{
    int ld = (cols + 7) & ~7;
    uint16_t *W = calloc((size_t)2 * rows * ld, 2);
    float *x = calloc((size_t)ld, 4), *nw = calloc((size_t)ld, 4), *y = malloc((size_t)rows * 4);
    double *nx = malloc((size_t)cols * sizeof(double)), *ref = malloc((size_t)rows * sizeof(double));
    double ss = 0;
    for (int c = 0; c < cols; c++) {
        x[c] = 3.0f * kt_randn(&seed);
        nw[c] = 1.0f + 0.2f * kt_randn(&seed);
        ss += (double)x[c] * x[c];
    }
    for (int c = 0; c < cols; c++) nx[c] = nw[c] * x[c] / sqrt(ss / cols + 1e-5);
    for (int r = 0; r < 2 * rows; r++)
        for (int c = 0; c < cols; c++) {
            float w = kt_randn(&seed) * 0.05f;
            W[(size_t)r * ld + c] = bf16 ? kv_f32_to_bf16(w) : kv_f32_to_half(w);
        }
    for (int o = 0; o < rows; o++) {
        double g = 0, u = 0;
        for (int c = 0; c < cols; c++) {
            uint16_t a = W[(size_t)(2 * o) * ld + c], b = W[(size_t)(2 * o + 1) * ld + c];
            g += (double)(bf16 ? kv_bf16_to_f32(a) : kv_half_to_f32(a)) * nx[c];
            u += (double)(bf16 ? kv_bf16_to_f32(b) : kv_half_to_f32(b)) * nx[c];
        }
        ref[o] = g / (1.0 + exp(-g)) * u;
    }
    void *dW = dput(W, (size_t)2 * rows * ld * 2);
    float *dx = dput(x, (size_t)ld * 4), *dn = dput(nw, (size_t)ld * 4), *dy = NULL;
    cudaMalloc((void **)&dy, (size_t)rows * 4);
    KT_REQUIRE(dW && dx && dn && dy, "alloc");
    CU(eng_gemv_norm(dW, bf16 ? KV_DT_BF16 : KV_DT_F16, rows, ld, dx, dn, cols, 1e-5f, dy, 1, 0));
    CU(cudaMemcpy(y, dy, (size_t)rows * 4, cudaMemcpyDeviceToHost));
    double e = nerr(y, ref, (size_t)rows);
    KT_CHECK(e < 1e-5, "gemv+norm+swiglu %s %dx%d: normalized error %g", bf16 ? "bf16" : "f16", rows,
             cols, e);
    cudaFree(dW);
    cudaFree(dx);
    cudaFree(dn);
    cudaFree(dy);
    free(W);
    free(x);
    free(nw);
    free(y);
    free(nx);
    free(ref);
}

static void test_gemv_matches_float64(void)
{
    check_gemv_norm_glu(0, 172, 64);
    check_gemv_norm_glu(1, 1433, 4096);
    check_gemv(0, 1000, 4096);
    check_gemv(1, 777, 1000);
    check_gemv(0, 33, 172); /* padded rows */
    check_gemv(1, 4096, 14336);
}

/* The fp16 attention (kernels/attn_f16.cu) over rows [0, n) of K/V with ld
 * rows per head, with the query the engine passes at this geometry: fp16 at
 * head_dim 64/128 and groups 1, 2, 4, 8, float32 elsewhere (or the other one
 * with flip). */
static void check_attend_q(int nqh, int nkv, int hd, int n, int ld, int flip)
{
    const int g = nqh / nkv;
    int q_f32 = !((hd == 64 || hd == 128) && (g == 1 || g == 2 || g == 4 || g == 8));
    if (flip) q_f32 = !q_f32;
    size_t kvn = (size_t)nkv * ld * hd;
    uint16_t *K = malloc(kvn * 2), *V = malloc(kvn * 2), *q16 = malloc((size_t)nqh * hd * 2);
    float *out = malloc((size_t)nqh * hd * 4), *q = malloc((size_t)nqh * hd * 4);
    double *ref = calloc((size_t)nqh * hd, sizeof(double));
    for (size_t i = 0; i < kvn; i++) {
        K[i] = kv_f32_to_half(kt_randn(&seed));
        V[i] = kv_f32_to_half(kt_randn(&seed));
    }
    for (int i = 0; i < nqh * hd; i++) {
        q[i] = kt_randn(&seed);
        q16[i] = kv_f32_to_half(q[i]);
        if (!q_f32) q[i] = kv_half_to_f32(q16[i]);
    }
    double sc = 1.0 / sqrt((double)hd);
    double *p = malloc((size_t)n * sizeof(double));
    for (int h = 0; h < nqh; h++) {
        int kh = h / (nqh / nkv);
        double mx = -INFINITY, sum = 0;
        for (int t = 0; t < n; t++) {
            double d = 0;
            for (int c = 0; c < hd; c++)
                d += (double)q[h * hd + c] * kv_half_to_f32(K[((size_t)kh * ld + t) * hd + c]);
            p[t] = d * sc;
            if (p[t] > mx) mx = p[t];
        }
        for (int t = 0; t < n; t++) sum += (p[t] = exp(p[t] - mx));
        for (int t = 0; t < n; t++)
            for (int c = 0; c < hd; c++)
                ref[h * hd + c] += p[t] / sum * kv_half_to_f32(V[((size_t)kh * ld + t) * hd + c]);
    }
    kv_attn_dims d = {nqh, nkv, hd, n, (long long)ld * hd, (float)sc};
    size_t wsb = q_f32 ? kv_cuda_attn_f16_q32_workspace(&d) : kv_cuda_attn_f16_workspace(&d);
    KT_REQUIRE(wsb > 0, "attention %d/%d heads hd %d: no workspace (unsupported)", nqh, nkv, hd);
    void *dK = dput(K, kvn * 2), *dV = dput(V, kvn * 2);
    void *dq = q_f32 ? dput(q, (size_t)nqh * hd * 4) : dput(q16, (size_t)nqh * hd * 2);
    float *dout = NULL;
    void *ws = NULL;
    cudaMalloc((void **)&dout, (size_t)nqh * hd * 4);
    cudaMalloc(&ws, wsb);
    KT_REQUIRE(dK && dV && dq && dout && ws, "alloc");
    CU(cudaMemset(dout, 0xff, (size_t)nqh * hd * 4)); /* poison: every output must be written */
    if (q_f32) CU(kv_cuda_attn_f16_q32(&d, dq, dK, dV, dout, ws, wsb, 0));
    else CU(kv_cuda_attn_f16(&d, dq, dK, dV, dout, ws, wsb, 0));
    CU(cudaMemcpy(out, dout, (size_t)nqh * hd * 4, cudaMemcpyDeviceToHost));
    double e = nerr(out, ref, (size_t)nqh * hd);
    /* an fp16 query at head_dim 64/128 runs on the tensor-core kernel (attn_f16_tc.cu), whose
     * p is an fp16 operand as in SDPA: about 1e-4; float32 numerics elsewhere */
    double tol = !q_f32 && (hd == 64 || hd == 128) ? 2e-3 : 1e-4;
    KT_CHECK(e < tol, "attend %d/%d heads hd %d n %d, %s query: normalized error %g", nqh, nkv,
             hd, n, q_f32 ? "f32" : "f16", e);
    cudaFree(dK);
    cudaFree(dV);
    cudaFree(dq);
    cudaFree(dout);
    cudaFree(ws);
    free(K);
    free(V);
    free(q16);
    free(q);
    free(out);
    free(ref);
    free(p);
}

static void check_attend(int nqh, int nkv, int hd, int n, int ld)
{
    check_attend_q(nqh, nkv, hd, n, ld, 0);
}

static void test_attend_matches_float64(void)
{
    check_attend(8, 4, 8, 37, 40);
    check_attend(32, 8, 128, 5000, 5003);
    check_attend(4, 2, 64, 1, 1);
    check_attend(8, 1, 16, 700, 700);
    check_attend(16, 2, 256, 300, 301);
    /* more geometries, and each with the other query type; the seed is put
     * back after them so that the later tests' random prompts are the ones
     * their bounds were measured on */
    unsigned long long keep = seed;
    check_attend(6, 2, 32, 333, 340);     /* query group 3: one head per block */
    check_attend(12, 2, 64, 1000, 1000);  /* group 6: two heads per block */
    check_attend_q(8, 4, 8, 37, 40, 1);
    check_attend_q(32, 8, 128, 999, 1003, 1);
    check_attend_q(16, 2, 256, 300, 301, 1);
    check_attend_q(6, 2, 32, 333, 340, 1);
    seed = keep;
}

/* Top-k of random scores with planted ties, against a sort here. */
static void check_topk(int nkv, int n, int k)
{
    float *x = malloc((size_t)nkv * n * 4);
    for (int i = 0; i < nkv * n; i++) x[i] = (float)(int)(kt_rand(&seed) * 400) / 400.0f; /* many ties */
    float *dx = dput(x, (size_t)nkv * n * 4);
    int *dsel = NULL, *sel = malloc((size_t)nkv * k * 4);
    cudaMalloc((void **)&dsel, (size_t)nkv * k * 4);
    KT_REQUIRE(dx && dsel, "alloc");
    CU(eng_topk(dx, nkv, n, k, 10, dsel, 0));
    CU(cudaMemcpy(sel, dsel, (size_t)nkv * k * 4, cudaMemcpyDeviceToHost));
    for (int h = 0; h < nkv; h++) {
        const float *r = x + (size_t)h * n;
        /* reference: the k-th largest value, then the first ones equal to it */
        float *cp = malloc((size_t)n * 4);
        memcpy(cp, r, (size_t)n * 4);
        for (int i = 0; i < k; i++) /* partial selection sort, descending */
            for (int j = i + 1; j < n; j++)
                if (cp[j] > cp[i]) {
                    float t = cp[i];
                    cp[i] = cp[j];
                    cp[j] = t;
                }
        float thr = cp[k - 1];
        int gt = 0;
        for (int i = 0; i < n; i++) gt += r[i] > thr;
        int m = 0, eq = 0, bad = 0;
        for (int i = 0; i < n; i++) {
            bool take = r[i] > thr || (r[i] == thr && eq++ < k - gt);
            if (take) {
                if (m >= k || sel[h * k + m] != 10 + i) bad++;
                m++;
            }
        }
        KT_CHECK(m == k && bad == 0, "n %d k %d head %d: %d taken, %d mismatches", n, k, h, m, bad);
        free(cp);
    }
    cudaFree(dx);
    cudaFree(dsel);
    free(x);
    free(sel);
}

static void test_topk_selects_largest_with_ties_to_lower_index(void)
{
    check_topk(3, 5003, 97);    /* every score fits the shared-memory sort */
    check_topk(2, 40000, 300);  /* sampled threshold */
    check_topk(2, 131072, 1024); /* the benchmark's shape */
    check_topk(1, 20000, 4000); /* sample too coarse: radix fallback inside */
    check_topk(1, 20000, 5000); /* k beyond the sample path: radix kernel */
}

/* The CPU's selection order (kv_policy_sparse.c): NaN as -inf, -0 as +0. */
static float rank_of(float x) { return isnan(x) ? -INFINITY : x == 0.0f ? 0.0f : x; }

/* Top-k over scores full of NaN (both signs), infinities and signed zeros
 * against the CPU's order; channel selection with NaN channel scores picks
 * exactly C channels (a NaN ranked 0 against everything, so more than C were
 * chosen and written past the head's slots); the softmax-combine of a head
 * with one NaN score keeps the other candidates' probabilities. */
static void test_selection_ranks_nan_and_inf_as_the_cpu_does(void)
{
    const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f};
    const int shapes[][3] = {{2, 3000, 50}, {1, 40000, 200}, {1, 20000, 5000}};
    for (int sh = 0; sh < 3; sh++) {
        const int nkv = shapes[sh][0], n = shapes[sh][1], k = shapes[sh][2];
        float *x = malloc((size_t)nkv * n * 4);
        for (int i = 0; i < nkv * n; i++) {
            x[i] = (float)(int)(kt_rand(&seed) * 50) / 50.0f;
            if (kt_rand(&seed) < 0.2) x[i] = specials[(int)(kt_rand(&seed) * 6) % 6];
        }
        float *dx = dput(x, (size_t)nkv * n * 4);
        int *dsel = NULL, *sel = malloc((size_t)nkv * k * 4);
        cudaMalloc((void **)&dsel, (size_t)nkv * k * 4);
        KT_REQUIRE(dx && dsel, "alloc");
        CU(eng_topk(dx, nkv, n, k, 0, dsel, 0));
        CU(cudaMemcpy(sel, dsel, (size_t)nkv * k * 4, cudaMemcpyDeviceToHost));
        for (int h = 0; h < nkv; h++) {
            const float *r = x + (size_t)h * n;
            /* reference: the first k of indices stably sorted by rank_of, descending */
            int *ord = malloc((size_t)n * 4);
            char *want = calloc((size_t)n, 1);
            for (int i = 0; i < n; i++) ord[i] = i;
            for (int i = 0; i < k; i++) { /* partial stable selection */
                int b = i;
                for (int j = i + 1; j < n; j++)
                    if (rank_of(r[ord[j]]) > rank_of(r[ord[b]]) ||
                        (rank_of(r[ord[j]]) == rank_of(r[ord[b]]) && ord[j] < ord[b]))
                        b = j;
                int t = ord[i];
                ord[i] = ord[b];
                ord[b] = t;
                want[ord[i]] = 1;
            }
            int bad = 0, prev = -1;
            for (int i = 0; i < k; i++) {
                int id = sel[h * k + i];
                if (id < 0 || id >= n || !want[id] || id <= prev) bad++;
                else prev = id;
            }
            KT_CHECK(bad == 0, "n %d k %d head %d: %d of %d ids differ from the CPU's order", n, k, h, bad, k);
            free(ord);
            free(want);
        }
        cudaFree(dx);
        cudaFree(dsel);
        free(x);
        free(sel);
    }
    /* channels: q with NaN and inf entries; C chosen, ascending, the CPU's set */
    {
        const int nqh = 4, nkv = 2, hd = 64, C = 8, g = nqh / nkv;
        float q[4 * 64], chmax[2 * 64];
        for (int i = 0; i < nqh * hd; i++) q[i] = kt_randn(&seed);
        for (int i = 0; i < nkv * hd; i++) chmax[i] = fabsf(kt_randn(&seed));
        for (int c = 0; c < hd; c += 5) q[c] = NAN;      /* head 0: NaN channel scores */
        q[2 * hd + 7] = INFINITY;                        /* head 1: one infinite score */
        chmax[hd + 9] = 0.0f;
        q[2 * hd + 9] = INFINITY;                        /* inf * 0: NaN */
        float *dq = dput(q, sizeof q), *dm = dput(chmax, sizeof chmax), *qscale = NULL;
        int *dch = NULL, ch[2 * 8];
        cudaMalloc((void **)&dch, sizeof ch + 64 * 4); /* room to see a write past the slots */
        cudaMalloc((void **)&qscale, nqh * 4);
        KT_REQUIRE(dq && dm && dch && qscale, "alloc");
        int guard[64];
        for (int i = 0; i < 64; i++) guard[i] = -7;
        CU(cudaMemcpy(dch + nkv * C, guard, sizeof guard, cudaMemcpyHostToDevice));
        CU(eng_select_channels(dq, dm, nqh, nkv, hd, C, dch, qscale, 0));
        int after[64];
        CU(cudaMemcpy(ch, dch, sizeof ch, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(after, dch + nkv * C, sizeof after, cudaMemcpyDeviceToHost));
        KT_CHECK(!memcmp(guard, after, sizeof guard), "channel ids written past the %d slots", nkv * C);
        for (int kv = 0; kv < nkv; kv++) {
            float cs[64];
            for (int c = 0; c < hd; c++) {
                float a = 0.0f;
                for (int h = 0; h < g; h++) a += fabsf(q[(kv * g + h) * hd + c]);
                cs[c] = rank_of(a * chmax[kv * hd + c]);
            }
            int m = 0, same = 1;
            for (int c = 0; c < hd; c++) {
                int rank = 0;
                for (int j = 0; j < hd; j++) rank += cs[j] > cs[c] || (cs[j] == cs[c] && j < c);
                if (rank < C) same &= m < C && ch[kv * C + m++] == c;
            }
            KT_CHECK(same && m == C, "kv head %d: channels differ from the CPU's order", kv);
        }
        cudaFree(dq);
        cudaFree(dm);
        cudaFree(dch);
        cudaFree(qscale);
    }
    /* softmax-combine: a NaN score of one head leaves the others' mass intact */
    {
        const int nqh = 2, nkv = 1, n = 300;
        float sc[2 * 300], comb[300];
        for (int i = 0; i < nqh * n; i++) sc[i] = kt_randn(&seed);
        sc[17] = NAN;
        float *dsc = dput(sc, sizeof sc), *dcomb = NULL, *tmp = NULL;
        cudaMalloc((void **)&dcomb, sizeof comb);
        cudaMalloc((void **)&tmp, eng_softmax_tmp(nqh) * 4);
        KT_REQUIRE(dsc && dcomb && tmp, "alloc");
        CU(eng_softmax_combine(dsc, nqh, nkv, n, 0, tmp, dcomb, 0));
        CU(cudaMemcpy(comb, dcomb, sizeof comb, cudaMemcpyDeviceToHost));
        double sum = 0;
        int finite = 0;
        for (int i = 0; i < n; i++)
            if (i != 17) {
                sum += comb[i];
                finite += isfinite(comb[i]) != 0;
            }
        KT_CHECK(finite == n - 1, "%d of %d finite candidates kept a probability", finite, n - 1);
        KT_CHECK(sum > 1.5 && sum < 2.0 + 1e-3, "the two heads' mass without the NaN: %g", sum);
        cudaFree(dsc);
        cudaFree(dcomb);
        cudaFree(tmp);
    }
}

static void test_rmsnorm_swiglu_rope_match_float64(void)
{
    const int n = 4100, nqh = 4, nkv = 2, hd = 64;
    float *x = malloc(n * 4), *w = malloc(n * 4), *o = malloc(n * 4);
    double *ref = malloc(n * sizeof(double));
    double ss = 0;
    for (int i = 0; i < n; i++) {
        x[i] = kt_randn(&seed);
        w[i] = 1.0f + 0.1f * kt_randn(&seed);
        ss += (double)x[i] * x[i];
    }
    for (int i = 0; i < n; i++) ref[i] = w[i] * x[i] / sqrt(ss / n + 1e-5);
    float *dx = dput(x, n * 4), *dw = dput(w, n * 4), *dout = NULL;
    cudaMalloc((void **)&dout, n * 4);
    KT_REQUIRE(dx && dw && dout, "alloc");
    CU(eng_rmsnorm(dx, dw, n, 1e-5f, dout, 0));
    CU(cudaMemcpy(o, dout, n * 4, cudaMemcpyDeviceToHost));
    KT_CHECK(nerr(o, ref, n) < 1e-6, "rmsnorm error %g", nerr(o, ref, n));
    /* swiglu over gate/up halves */
    CU(eng_swiglu(dx, n / 2, dout, 0));
    CU(cudaMemcpy(o, dout, n / 2 * 4, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n / 2; i++) ref[i] = x[i] / (1.0 + exp(-(double)x[i])) * x[n / 2 + i];
    KT_CHECK(nerr(o, ref, n / 2) < 1e-6, "swiglu error %g", nerr(o, ref, n / 2));
    /* rope at a large position, with the fp16 store of k and v */
    float invf[32];
    for (int i = 0; i < hd / 2; i++) invf[i] = 1.0f / powf(500000.0f, (float)(2 * i) / hd);
    float qkv[(4 + 2 + 2) * 64];
    for (int i = 0; i < (nqh + 2 * nkv) * hd; i++) qkv[i] = kt_randn(&seed);
    float *dqkv = dput(qkv, sizeof qkv), *dinv = dput(invf, sizeof invf);
    uint16_t *dkv = NULL, kv16[2 * 2 * 64];
    cudaMalloc((void **)&dkv, sizeof kv16);
    KT_REQUIRE(dqkv && dinv && dkv, "alloc");
    const int pos = 123457;
    CU(eng_rope_store(dqkv, NULL, nqh, dqkv + nqh * hd, dqkv + (nqh + nkv) * hd, nkv, hd, dinv, pos,
                      dkv, dkv + 2 * hd, hd, 0));
    float got[(4 + 2 + 2) * 64];
    CU(cudaMemcpy(got, dqkv, sizeof got, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(kv16, dkv, sizeof kv16, cudaMemcpyDeviceToHost));
    double rr[(4 + 2) * 64];
    for (int h = 0; h < nqh + nkv; h++)
        for (int i = 0; i < hd / 2; i++) {
            double a = (double)(float)((float)pos * invf[i]);
            double x0 = qkv[h * hd + 2 * i], x1 = qkv[h * hd + 2 * i + 1];
            rr[h * hd + 2 * i] = x0 * cos(a) - x1 * sin(a);
            rr[h * hd + 2 * i + 1] = x0 * sin(a) + x1 * cos(a);
        }
    KT_CHECK(nerr(got, rr, (nqh + nkv) * hd) < 1e-5, "rope error %g", nerr(got, rr, (nqh + nkv) * hd));
    int bad = 0;
    for (int h = 0; h < nkv; h++)
        for (int c = 0; c < hd; c++) {
            bad += kv16[h * hd + c] != kv_f32_to_half(got[(nqh + h) * hd + c]);
            bad += kv16[2 * hd + h * hd + c] != kv_f32_to_half(qkv[(nqh + nkv + h) * hd + c]);
        }
    KT_CHECK(bad == 0, "%d fp16 K/V values stored wrongly", bad);
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(dout);
    cudaFree(dqkv);
    cudaFree(dinv);
    cudaFree(dkv);
    free(x);
    free(w);
    free(o);
    free(ref);
}

/* Channel and sketch scoring and the gather, from mapped host memory. */
static void test_selection_kernels_match_float64(void)
{
    const int nqh = 8, nkv = 2, hd = 128, T = 1000, C = 8, cs = 5, cend = 900, n = cend - cs;
    const int g = nqh / nkv, ldc = (T + 7) & ~7;
    float *K = malloc((size_t)nkv * T * hd * 4), *q = malloc((size_t)nqh * hd * 4);
    for (int i = 0; i < nkv * T * hd; i++) K[i] = kt_randn(&seed) * ((i % hd) % 16 == 3 ? 5.0f : 1.0f);
    for (int i = 0; i < nqh * hd; i++) q[i] = kt_randn(&seed);
    uint16_t *kh = malloc((size_t)nkv * T * hd * 2);
    for (int i = 0; i < nkv * T * hd; i++) {
        kh[i] = kv_f32_to_half(K[i]);
        K[i] = kv_half_to_f32(kh[i]);
    }
    uint16_t *dK = dput(kh, (size_t)nkv * T * hd * 2);
    float *dq = dput(q, (size_t)nqh * hd * 4);
    uint16_t *kcm = NULL, *rows = NULL;
    void *dkcm = NULL, *drows = NULL;
    CU(cudaHostAlloc((void **)&kcm, (size_t)nkv * hd * ldc * 2, cudaHostAllocMapped));
    CU(cudaHostAlloc((void **)&rows, (size_t)T * nkv * 2 * hd * 2, cudaHostAllocMapped));
    CU(cudaHostGetDevicePointer(&dkcm, kcm, 0));
    CU(cudaHostGetDevicePointer(&drows, rows, 0));
    float *chmax, *mean, *mad, *qscale, *score;
    int *chans;
    uint8_t *bits;
    cudaMalloc((void **)&chmax, nkv * hd * 4);
    cudaMalloc((void **)&mean, nkv * hd * 4);
    cudaMalloc((void **)&mad, nkv * hd * 4);
    cudaMalloc((void **)&qscale, nqh * 4);
    cudaMalloc((void **)&score, (size_t)nqh * n * 4);
    cudaMalloc((void **)&chans, nkv * C * 4);
    cudaMalloc((void **)&bits, (size_t)nkv * T * hd / 8);
    KT_REQUIRE(dK && dq && score && bits, "alloc");
    CU(eng_to_channel_major(dK, nkv, T, T, hd, KV_DT_F16, dkcm, ldc, 0));
    CU(eng_to_row_layout(dK, dK, nkv, T, T, hd, KV_DT_F16, drows, 0));
    CU(eng_key_stats(dK, nkv, T, T, hd, KV_DT_F16, chmax, mean, mad, 0));
    CU(eng_select_channels(dq, chmax, nqh, nkv, hd, C, chans, qscale, 0));
    CU(eng_score_channels(dq, chans, qscale, dkcm, KV_DT_F16, ldc, nqh, nkv, hd, C, cs, cend, score, 0));
    float *got = malloc((size_t)nqh * n * 4);
    double *ref = malloc((size_t)nqh * n * sizeof(double));
    int hch[2 * 8];
    CU(cudaMemcpy(got, score, (size_t)nqh * n * 4, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hch, chans, sizeof hch, cudaMemcpyDeviceToHost));
    /* reference: the CPU policy's formula (channels by |q| * max|K|) */
    for (int kv = 0; kv < nkv; kv++) {
        double cscore[128];
        for (int c = 0; c < hd; c++) {
            double a = 0, mx = 0;
            for (int h = 0; h < g; h++) a += fabs(q[(kv * g + h) * hd + c]);
            for (int t = 0; t < T; t++) mx = fmax(mx, fabs(K[((size_t)kv * T + t) * hd + c]));
            cscore[c] = a * mx;
        }
        int chosen[8], m = 0;
        for (int c = 0; c < hd; c++) {
            int rank = 0;
            for (int j = 0; j < hd; j++) rank += cscore[j] > cscore[c] || (cscore[j] == cscore[c] && j < c);
            if (rank < C) chosen[m++] = c;
        }
        int same = m == C;
        for (int j = 0; j < C && same; j++) same = chosen[j] == hch[kv * C + j];
        KT_CHECK(same, "kv head %d: critical channels differ", kv);
        for (int h = 0; h < g; h++) {
            const float *qh = q + (kv * g + h) * hd;
            double all = 0, part = 0;
            for (int c = 0; c < hd; c++) all += fabs(qh[c]);
            for (int j = 0; j < C; j++) part += fabs(qh[chosen[j]]);
            double s = 1.0 / sqrt(hd * part / all);
            for (int i = 0; i < n; i++) {
                double d = 0;
                for (int j = 0; j < C; j++) d += qh[chosen[j]] * K[((size_t)kv * T + cs + i) * hd + chosen[j]];
                ref[(size_t)(kv * g + h) * n + i] = d * s;
            }
        }
    }
    KT_CHECK(nerr(got, ref, (size_t)nqh * n) < 1e-5, "channel scores error %g", nerr(got, ref, (size_t)nqh * n));
    /* sketch scores: sum_c q_c * mad_c * sign(k_c - mean_c) / sqrt(hd) */
    float hmean[2 * 128], hmad[2 * 128];
    CU(cudaMemcpy(hmean, mean, sizeof hmean, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hmad, mad, sizeof hmad, cudaMemcpyDeviceToHost));
    CU(eng_sketch_build(dK, nkv, T, T, hd, KV_DT_F16, mean, bits, 0));
    CU(eng_score_sketch(dq, bits, T, mad, nqh, nkv, hd, cs, cend, score, 0));
    CU(cudaMemcpy(got, score, (size_t)nqh * n * 4, cudaMemcpyDeviceToHost));
    for (int h = 0; h < nqh; h++) {
        int kv = h / g;
        for (int i = 0; i < n; i++) {
            double d = 0;
            for (int c = 0; c < hd; c++) {
                double sgn = K[((size_t)kv * T + cs + i) * hd + c] > hmean[kv * hd + c] ? 1 : -1;
                d += q[h * hd + c] * hmad[kv * hd + c] * sgn;
            }
            ref[(size_t)h * n + i] = d / sqrt(hd);
        }
    }
    KT_CHECK(nerr(got, ref, (size_t)nqh * n) < 1e-5, "sketch scores error %g", nerr(got, ref, (size_t)nqh * n));
    /* the fused sketch -> softmax -> group sum equals the two-step path */
    {
        float *tmp = NULL, *comb = NULL, *comb2 = NULL;
        cudaMalloc((void **)&tmp, eng_softmax_tmp(nqh) * 4);
        cudaMalloc((void **)&comb, (size_t)nkv * n * 4);
        cudaMalloc((void **)&comb2, (size_t)nkv * n * 4);
        KT_REQUIRE(tmp && comb && comb2, "alloc");
        for (int rmax = 0; rmax < 2; rmax++) {
            CU(eng_softmax_combine(score, nqh, nkv, n, rmax, tmp, comb, 0));
            CU(eng_sketch_combine(dq, bits, T, mad, nqh, nkv, hd, cs, cend, rmax, tmp, comb2, 0));
            float *c1 = malloc((size_t)nkv * n * 4), *c2 = malloc((size_t)nkv * n * 4);
            CU(cudaMemcpy(c1, comb, (size_t)nkv * n * 4, cudaMemcpyDeviceToHost));
            CU(cudaMemcpy(c2, comb2, (size_t)nkv * n * 4, cudaMemcpyDeviceToHost));
            double e2 = nerr_f(c2, c1, (size_t)nkv * n);
            KT_CHECK(e2 < 1e-5, "fused sketch combine (max %d) differs by %g", rmax, e2);
            free(c1);
            free(c2);
        }
        cudaFree(tmp);
        cudaFree(comb);
        cudaFree(comb2);
    }
    /* gather: rows of chosen tokens plus sink rows from device memory */
    int sel[2 * 3] = {7, 500, 999, 0, 1, 998};
    int *dsel = dput(sel, sizeof sel);
    uint16_t *sink = NULL, *kd = NULL, *vd = NULL;
    cudaMalloc((void **)&sink, (size_t)2 * nkv * 2 * hd * 2);
    cudaMalloc((void **)&kd, (size_t)nkv * 8 * hd * 2);
    cudaMalloc((void **)&vd, (size_t)nkv * 8 * hd * 2);
    CU(cudaMemcpy(sink, rows, (size_t)2 * nkv * 2 * hd * 2, cudaMemcpyHostToDevice));
    CU(eng_gather_rows(drows, nkv, hd, KV_DT_F16, dsel, 3, sink, 2, kd, vd, 8, 0));
    uint16_t *gk = malloc((size_t)nkv * 8 * hd * 2);
    CU(cudaMemcpy(gk, kd, (size_t)nkv * 8 * hd * 2, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int h = 0; h < nkv; h++)
        for (int r = 0; r < 5; r++) {
            int t = r < 3 ? sel[h * 3 + r] : r - 3;
            for (int c = 0; c < hd; c++) bad += gk[((size_t)h * 8 + r) * hd + c] != kh[((size_t)h * T + t) * hd + c];
        }
    KT_CHECK(bad == 0, "%d gathered values differ", bad);
    cudaFreeHost(kcm);
    cudaFreeHost(rows);
    cudaFree(dK);
    cudaFree(dq);
    cudaFree(chmax);
    cudaFree(mean);
    cudaFree(mad);
    cudaFree(qscale);
    cudaFree(score);
    cudaFree(chans);
    cudaFree(bits);
    cudaFree(dsel);
    cudaFree(sink);
    cudaFree(kd);
    cudaFree(vd);
    free(gk);
    free(K);
    free(q);
    free(kh);
    free(got);
    free(ref);
}

/*
 * eng_kivi_expand (the `quant` path outside the packed-attention kernel)
 * against lib/quant/kv_quant.c's kv_kivi_unpack on fresh random data: the fp16
 * expansion must be the CPU's float dequantization rounded once, bit for
 * bit.  T is chosen so that the ring (R+G rows there, T-nq rows here)
 * places token t at row t - nq, which is kv_kivi_packed's residual layout.
 */
static void check_kivi_expand(int hd, int bits)
{
    const int H = 2, T = 100, G = 16, R = 16;
    kv_kivi_params kp = {bits, G, R};
    size_t n = (size_t)H * T * hd;
    float *x[2], *ref[2];
    kv_kivi_packed pk[2];
    for (int a = 0; a < 2; a++) {
        x[a] = malloc(n * sizeof(float));
        ref[a] = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++) x[a][i] = kv_round_half((float)kt_randn(&seed) * (a ? 1.0f : 3.0f));
        OK(kv_kivi_pack(x[a], a ? KV_KIVI_VALUES : KV_KIVI_KEYS, &kp, H, T, hd, &pk[a]));
        kv_kivi_unpack(&pk[a], ref[a]);
    }
    const int nq = pk[0].nq, gv = kv_kivi_vgroup(G, hd);
    KT_CHECK(nq == 80 && nq % (T - nq) == 0, "nq %d", nq);
    size_t cb = (size_t)H * nq * kv_kivi_row_bytes(hd, bits), rs = (size_t)H * (T - nq) * hd * 2;
    eng_kivi_layer y = {H, hd, bits, G, gv, nq, nq / G, T - nq, nq,
                        dput(pk[0].codes, cb), dput(pk[1].codes, cb),
                        dput(pk[0].scale, (size_t)H * (nq / G) * hd * 2),
                        dput(pk[0].zero, (size_t)H * (nq / G) * hd * 2),
                        dput(pk[1].scale, (size_t)H * nq * (hd / gv) * 2),
                        dput(pk[1].zero, (size_t)H * nq * (hd / gv) * 2),
                        dput(pk[0].resid, rs), dput(pk[1].resid, rs)};
    uint16_t *dk = NULL, *dv = NULL;
    cudaMalloc((void **)&dk, n * 2);
    cudaMalloc((void **)&dv, n * 2);
    KT_CHECK(eng_kivi_expand(&y, T, dk, dv, (size_t)T, 0) == cudaSuccess, "launch");
    uint16_t *gk = malloc(n * 2), *gv16 = malloc(n * 2);
    cudaMemcpy(gk, dk, n * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(gv16, dv, n * 2, cudaMemcpyDeviceToHost);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += (gk[i] != kv_f32_to_half(ref[0][i])) + (gv16[i] != kv_f32_to_half(ref[1][i]));
    KT_CHECK(bad == 0, "head_dim %d, %d bits: %zu of %zu values differ from kv_kivi_unpack", hd,
             bits, bad, 2 * n);
    const void *dp[] = {y.kc, y.vc, y.ks, y.kz, y.vs, y.vz, y.rk, y.rv, dk, dv};
    for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++) cudaFree((void *)dp[i]);
    free(gv16);
    free(gk);
    for (int a = 0; a < 2; a++) {
        kv_kivi_clear(&pk[a]);
        free(ref[a]);
        free(x[a]);
    }
}

/*
 * select=resident and select=pages (kernels/eng_select.cu) against their
 * CPU references in lib/policy/kv_select.c on the same fp16 keys: the rows
 * of R pool channels (fp16 and 8/4/2/1-bit codes), this step's C of them
 * and the scores from those rows (kv_select_channel_row,
 * kv_select_pool_channels, kv_select_score_rows); page bounds and page
 * scores (kv_select_page_bounds, kv_select_score_pages), the pages'
 * probabilities spread to their tokens and the top-K; and the many-block
 * top-K (eng_topk_wide) equal to eng_topk's ids.
 */
static void test_resident_and_page_kernels_match_cpu(void)
{
    const int nqh = 8, nkv = 2, hd = 128, T = 1000, R = 24, C = 8, cs = 5, cend = 900, n = cend - cs;
    const int g = nqh / nkv, ldt = (T + 63) / 64 * 64;
    float *K = malloc((size_t)nkv * T * hd * 4), *q = malloc((size_t)nqh * hd * 4);
    uint16_t *kh = malloc((size_t)nkv * T * hd * 2);
    for (int i = 0; i < nkv * T * hd; i++) {
        kh[i] = kv_f32_to_half(kt_randn(&seed) * ((i % hd) % 16 == 3 ? 5.0f : 1.0f));
        K[i] = kv_half_to_f32(kh[i]);
    }
    for (int i = 0; i < nqh * hd; i++) q[i] = kt_randn(&seed);
    int pool[2 * 24];
    for (int h = 0; h < nkv; h++) /* ascending, as kv_select_pick_channels gives them */
        for (int j = 0; j < R; j++) pool[h * R + j] = j * 5 + h;
    uint16_t *dK = dput(kh, (size_t)nkv * T * hd * 2);
    float *dq = dput(q, (size_t)nqh * hd * 4);
    int *dpool = dput(pool, sizeof pool);
    float *chmax, *mean, *mad, *qscale, *score;
    int *cols;
    void *rows;
    uint16_t *scl, *zer;
    cudaMalloc((void **)&chmax, nkv * hd * 4);
    cudaMalloc((void **)&mean, nkv * hd * 4);
    cudaMalloc((void **)&mad, nkv * hd * 4);
    cudaMalloc((void **)&qscale, nqh * 4);
    cudaMalloc((void **)&score, (size_t)nqh * n * 4);
    cudaMalloc((void **)&cols, nkv * C * 4);
    cudaMalloc(&rows, (size_t)nkv * R * ldt * 2);
    cudaMalloc((void **)&scl, (size_t)nkv * R * (ldt / 64) * 2);
    cudaMalloc((void **)&zer, (size_t)nkv * R * (ldt / 64) * 2);
    KT_REQUIRE(dK && dq && dpool && score && rows && zer, "alloc");
    CU(eng_key_stats(dK, nkv, T, T, hd, KV_DT_F16, chmax, mean, mad, 0));
    float hmax[2 * 128];
    CU(cudaMemcpy(hmax, chmax, sizeof hmax, cudaMemcpyDeviceToHost));
    float *got = malloc((size_t)nqh * n * 4), *vals = malloc((size_t)T * R * 4);
    double *ref = malloc((size_t)nqh * n * sizeof(double));
    float *rs = malloc((size_t)g * n * 4);
    const int bits[5] = {16, 8, 4, 2, 1};
    for (int b = 0; b < 5; b++) {
        CU(eng_rows_build(dK, nkv, T, T, hd, dpool, R, bits[b], rows, scl, zer, ldt, 0));
        CU(eng_select_pool(dq, chmax, dpool, nqh, nkv, hd, R, C, cols, qscale, 0));
        CU(eng_score_rows(dq, dpool, cols, qscale, rows, scl, zer, ldt, bits[b], nqh, nkv, hd, R, C,
                          cs, cend, score, 0));
        int hcols[2 * 8];
        CU(cudaMemcpy(got, score, (size_t)nqh * n * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(hcols, cols, sizeof hcols, cudaMemcpyDeviceToHost));
        int colbad = 0;
        for (int h = 0; h < nkv; h++) {
            for (int j = 0; j < R; j++)
                kv_select_channel_row(K + (size_t)h * T * hd + pool[h * R + j], (size_t)hd, T, bits[b],
                                      NULL, NULL, NULL, vals + j, (size_t)R);
            int rc[8], ch[8];
            kv_select_pool_channels(q + (size_t)h * g * hd, g, hd, hmax + h * hd, pool + h * R, R, C, rc);
            for (int j = 0; j < C; j++) {
                colbad += rc[j] != hcols[h * C + j];
                ch[j] = pool[h * R + rc[j]];
            }
            kv_select_score_rows(q + (size_t)h * g * hd, g, hd, ch, rc, C, vals + (size_t)cs * R,
                                 (size_t)R, n, rs);
            for (size_t i = 0; i < (size_t)g * n; i++) ref[(size_t)h * g * n + i] = rs[i];
        }
        double e = nerr(got, ref, (size_t)nqh * n);
        printf("# resident rows at %d bits: score error %.3g\n", bits[b], e);
        KT_CHECK(colbad == 0, "%d bits: %d pool positions differ", bits[b], colbad);
        /* codes: the GPU rounds (x - zero) / scale as the CPU does, so a
         * code may differ only where the quotient sits at a half */
        KT_CHECK(e < (bits[b] >= 8 ? 1e-5 : 1e-3), "%d bits: resident scores error %g", bits[b], e);
    }
    /* pages: bounds, scores, the pages' probabilities spread to tokens, top-K */
    const int P = 16, np_all = (T + P - 1) / P, p0 = cs / P, np = (cend - 1) / P - p0 + 1, kk = 64;
    uint16_t *pmin, *pmax;
    float *comb;
    int *sel;
    cudaMalloc((void **)&pmin, (size_t)nkv * np_all * hd * 2);
    cudaMalloc((void **)&pmax, (size_t)nkv * np_all * hd * 2);
    cudaMalloc((void **)&comb, (size_t)nkv * n * 4);
    cudaMalloc((void **)&sel, (size_t)nkv * kk * 4);
    float *tmp;
    cudaMalloc((void **)&tmp, eng_softmax_tmp(nqh) * 4);
    CU(eng_page_bounds(dK, nkv, T, T, hd, P, pmin, pmax, 0));
    CU(eng_score_pages(dq, pmin, pmax, np_all, nqh, nkv, hd, p0, np, score, 0));
    CU(cudaMemcpy(got, score, (size_t)nqh * np * 4, cudaMemcpyDeviceToHost));
    float *bmin = malloc((size_t)np_all * hd * 4), *bmax = malloc((size_t)np_all * hd * 4);
    uint16_t *gmin = malloc((size_t)nkv * np_all * hd * 2);
    CU(cudaMemcpy(gmin, pmin, (size_t)nkv * np_all * hd * 2, cudaMemcpyDeviceToHost));
    int bbad = 0;
    for (int h = 0; h < nkv; h++) {
        kv_select_page_bounds(K + (size_t)h * T * hd, (size_t)hd, T, hd, P, bmin, bmax);
        for (int i = 0; i < np_all * hd; i++)
            bbad += kv_half_to_f32(gmin[(size_t)h * np_all * hd + i]) != bmin[i];
        kv_select_score_pages(q + (size_t)h * g * hd, g, hd, bmin + (size_t)p0 * hd,
                              bmax + (size_t)p0 * hd, np, rs);
        for (size_t i = 0; i < (size_t)g * np; i++) ref[(size_t)h * g * np + i] = rs[i];
    }
    double ep = nerr(got, ref, (size_t)nqh * np);
    printf("# page scores error %.3g\n", ep);
    KT_CHECK(bbad == 0, "%d page minima differ", bbad);
    KT_CHECK(ep < 1e-5, "page scores error %g", ep);
    CU(eng_softmax_combine(score, nqh, nkv, np, 0, tmp, comb, 0));
    CU(eng_pages_expand(comb, nkv, np, P, p0, cs, n, score, 0));
    CU(eng_topk(score, nkv, n, kk, cs, sel, 0));
    float *hc = malloc((size_t)nkv * np * 4), *tok = malloc((size_t)nkv * n * 4);
    int hsel[2 * 64];
    CU(cudaMemcpy(hc, comb, (size_t)nkv * np * 4, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(tok, score, (size_t)nkv * n * 4, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hsel, sel, sizeof hsel, cudaMemcpyDeviceToHost));
    int xbad = 0, sbad = 0;
    for (int h = 0; h < nkv; h++) {
        for (int i = 0; i < n; i++) xbad += tok[(size_t)h * n + i] != hc[(size_t)h * np + (cs + i) / P - p0];
        /* the CPU's page order on these probabilities: best page first (ties
         * to the lower page), its candidate tokens ascending, until kk */
        char taken[1024] = {0}, pdone[128] = {0};
        int m = 0;
        while (m < kk) {
            int best = -1;
            for (int i = 0; i < np; i++)
                if (!pdone[i] && (best < 0 || hc[h * np + i] > hc[h * np + best])) best = i;
            pdone[best] = 1;
            for (int t = (p0 + best) * P; t < (p0 + best + 1) * P && m < kk; t++)
                if (t >= cs && t < cend) taken[t] = 1, m++;
        }
        for (int j = 0, t = 0; j < kk; j++) {
            while (!taken[t]) t++;
            sbad += hsel[h * kk + j] != t++;
        }
    }
    KT_CHECK(xbad == 0 && sbad == 0, "pages: %d expanded scores, %d selected ids differ", xbad, sbad);
    /* many blocks per head: the same ids as the one-block top-K */
    const int shapes[4][3] = {{8, 131072, 1024}, {2, 40000, 300}, {1, 5003, 97}, {1, 20000, 1500}};
    for (int c = 0; c < 4; c++) {
        const int H = shapes[c][0], N = shapes[c][1], Kk = shapes[c][2];
        float *x = malloc((size_t)H * N * 4);
        for (int i = 0; i < H * N; i++) x[i] = (float)(int)(kt_rand(&seed) * 400) / 400.0f;
        float *dx = dput(x, (size_t)H * N * 4);
        int *s1, *s2, *h1 = malloc((size_t)H * Kk * 4), *h2 = malloc((size_t)H * Kk * 4);
        void *ws;
        cudaMalloc((void **)&s1, (size_t)H * Kk * 4);
        cudaMalloc((void **)&s2, (size_t)H * Kk * 4);
        cudaMalloc(&ws, eng_topk_wide_ws(H));
        CU(eng_topk(dx, H, N, Kk, 3, s1, 0));
        CU(eng_topk_wide(dx, H, N, Kk, 3, s2, ws, 0));
        CU(cudaMemcpy(h1, s1, (size_t)H * Kk * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(h2, s2, (size_t)H * Kk * 4, cudaMemcpyDeviceToHost));
        KT_CHECK(!memcmp(h1, h2, (size_t)H * Kk * 4), "topk_wide n %d k %d: ids differ from eng_topk", N, Kk);
        cudaFree(dx), cudaFree(s1), cudaFree(s2), cudaFree(ws);
        free(x), free(h1), free(h2);
    }
    void *dev[] = {dK, dq, dpool, chmax, mean, mad, qscale, score, cols, rows, scl, zer, pmin, pmax, comb, sel, tmp};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
    free(K), free(q), free(kh), free(got), free(vals), free(ref), free(rs), free(bmin), free(bmax);
    free(gmin), free(hc), free(tok);
}

static void test_kivi_expand_matches_cpu_unpack(void)
{
    check_kivi_expand(8, 2);
    check_kivi_expand(8, 4);
    check_kivi_expand(64, 1);
    check_kivi_expand(64, 2);
}

/* eng_attn_importance: softmax(scale q.k) summed over each KV head's query
 * heads, added to what imp held, against float64. */
static void test_attn_importance_matches_float64(void)
{
    const int nqh = 8, nkv = 2, hd = 64, T = 700, ld = 768, il = 800, grp = nqh / nkv;
    const float scale = 0.125f;
    uint16_t *kh = calloc((size_t)nkv * ld * hd, 2);
    float *q = malloc((size_t)nqh * hd * 4), *imp = malloc((size_t)nkv * il * 4);
    double *ref = malloc((size_t)nkv * il * sizeof(double)), *sc = malloc((size_t)T * sizeof(double));
    for (int h = 0; h < nkv; h++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < hd; c++)
                kh[((size_t)h * ld + t) * hd + c] = kv_f32_to_half(kt_randn(&seed) * (c == 5 ? 4.0f : 1.0f));
    for (int i = 0; i < nqh * hd; i++) q[i] = kt_randn(&seed);
    for (int i = 0; i < nkv * il; i++) ref[i] = imp[i] = kt_rand(&seed);
    for (int h = 0; h < nkv; h++)
        for (int j = 0; j < grp; j++) {
            const float *qj = q + (size_t)(h * grp + j) * hd;
            double mx = -INFINITY, sum = 0;
            for (int t = 0; t < T; t++) {
                double d = 0;
                for (int c = 0; c < hd; c++) d += (double)qj[c] * kv_half_to_f32(kh[((size_t)h * ld + t) * hd + c]);
                sc[t] = d * scale;
                if (sc[t] > mx) mx = sc[t];
            }
            for (int t = 0; t < T; t++) sum += exp(sc[t] - mx);
            for (int t = 0; t < T; t++) ref[(size_t)h * il + t] += exp(sc[t] - mx) / sum;
        }
    uint16_t *dK = dput(kh, (size_t)nkv * ld * hd * 2);
    float *dq = dput(q, (size_t)nqh * hd * 4), *dimp = dput(imp, (size_t)nkv * il * 4), *dsc = NULL;
    cudaMalloc((void **)&dsc, (size_t)nkv * T * 4);
    KT_REQUIRE(dK && dq && dimp && dsc, "alloc");
    CU(eng_attn_importance(dq, dK, nqh, nkv, hd, T, (size_t)ld, scale, dsc, dimp, (size_t)il, 0));
    CU(cudaMemcpy(imp, dimp, (size_t)nkv * il * 4, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int i = 0; i < nkv * il; i++) {
        double d = fabs(imp[i] - ref[i]) / (fabs(ref[i]) + 1e-6);
        if (d > worst) worst = d;
    }
    KT_CHECK(worst < 1e-4, "importance: relative error %g", worst);
    cudaFree(dsc);
    cudaFree(dimp);
    cudaFree(dq);
    cudaFree(dK);
    free(sc);
    free(ref);
    free(imp);
    free(q);
    free(kh);
}

// --- whole engine against the CPU engine ---------------------------------------------------

typedef struct {
    double max_err;   /* largest per-step normalized logit error */
    int argmax_diff;  /* steps whose argmax differs although the CPU margin is > 0.05 */
    int steps;
} cmp_result;

/*
 * Prefill both engines with prompt (n), then feed the CPU's greedy tokens to
 * both for `steps` steps, comparing the logits of every step.
 */
static void compare_engines(kv_engine *cpu, kv_gpu_engine *gpu, const int *prompt, int n, int steps,
                            int vocab, cmp_result *r)
{
    float *lc = malloc((size_t)vocab * 4), *lg = malloc((size_t)vocab * 4);
    memset(r, 0, sizeof *r);
    kv_status sc = kv_engine_prefill(cpu, prompt, n, lc);
    kv_status sg = kv_gpu_engine_prefill(gpu, prompt, n, lg);
    KT_CHECK(sc == KV_OK && sg == KV_OK, "prefill cpu %d gpu %d: %s", (int)sc, (int)sg, kv_errdetail());
    for (int i = 0; i <= steps && sc == KV_OK && sg == KV_OK; i++) {
        double e = nerr_f(lg, lc, (size_t)vocab);
        if (e > r->max_err) r->max_err = e;
        if (kt_argmax(lg, vocab) != kt_argmax(lc, vocab) && margin(lc, vocab) > 0.05f) r->argmax_diff++;
        r->steps++;
        if (i == steps) break;
        int tok = kt_argmax(lc, vocab);
        sc = kv_engine_step(cpu, tok, lc);
        sg = kv_gpu_engine_step(gpu, tok, lg);
        KT_CHECK(sc == KV_OK && sg == KV_OK, "step %d cpu %d gpu %d: %s", i, (int)sc, (int)sg,
                 kv_errdetail());
    }
    free(lc);
    free(lg);
}

static void test_stories260k_full_matches_cpu(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    int prompt[1] = {1};
    kv_engine *cpu = NULL;
    kv_gpu_engine *gpu = NULL;
    OK(kv_engine_new(m, NULL, 256, &cpu));
    kv_status st = kv_gpu_engine_new(m, NULL, 256, NULL, &gpu);
    KT_CHECK(st == KV_OK, "gpu engine: %s", kv_errdetail());
    if (gpu) {
        cmp_result r;
        compare_engines(cpu, gpu, prompt, 1, short_run() ? 40 : 200, m->cfg.vocab_size, &r);
        printf("# stories260K full: %d steps, max logit error %.3g, argmax differences %d\n", r.steps,
               r.max_err, r.argmax_diff);
        KT_CHECK(r.steps == (short_run() ? 41 : 201), "%d steps", r.steps);
        KT_CHECK(r.max_err < 5e-3, "logits normalized error %g", r.max_err);
        KT_CHECK(r.argmax_diff == 0, "%d greedy tokens differ", r.argmax_diff);
        /* greedy generation on the device reproduces the reference ids */
        int ref[256], nref = 0;
        FILE *f = fopen(S260 "reference/greedy_bos_200.ids", "r");
        while (f && nref < 256 && fscanf(f, "%d", &ref[nref]) == 1) nref++;
        if (f) fclose(f);
        OK(kv_gpu_engine_reset(gpu, NULL));
        float *lg = malloc((size_t)m->cfg.vocab_size * 4);
        OK(kv_gpu_engine_prefill(gpu, ref, 1, lg));
        int out[200];
        OK(kv_gpu_engine_generate(gpu, kt_argmax(lg, m->cfg.vocab_size), 199, out, NULL));
        /* ids equal up to the first difference; fp16 rounding may flip a
         * near-tie late in a 200-token run, after which the texts differ */
        int same = ref[1] == kt_argmax(lg, m->cfg.vocab_size);
        for (int i = 0; same == i + 1 && i < 199 && i + 2 < nref; i++) same += out[i] == ref[i + 2];
        printf("# stories260K greedy on the GPU: the first %d of 200 ids equal the reference\n", same);
        KT_CHECK(nref == 201 && same >= 100, "only the first %d greedy ids match", same);
        free(lg);
    }
    kv_gpu_engine_free(gpu);
    kv_engine_free(cpu);
    kv_model_close(m);
}

/*
 * stories260K (head_dim 8: quant through the host-packed form and the fp16
 * expansion) with one policy on every layer against the CPU engine's
 * same policy, past the windows and groups the policy packs or evicts; the
 * GPU's byte accounting must equal the CPU policy's.
 */
static void run_stories_policy(const char *spec, double tol, int max_diff)
{
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    kv_policy_params *pp = calloc((size_t)m->cfg.n_layers, sizeof *pp);
    OK(kv_policy_parse(spec, m->cfg.n_layers, pp));
    for (int l = 0; l < m->cfg.n_layers; l++) pp[l].dtype = KV_DT_F16;
    int prompt[24];
    for (int i = 0; i < 24; i++) prompt[i] = i ? 30 + (int)(kt_rand(&seed) * 400) : 1;
    kv_engine *cpu = NULL;
    kv_gpu_engine *gpu = NULL;
    OK(kv_engine_new(m, pp, 256, &cpu));
    kv_status st = kv_gpu_engine_new(m, pp, 256, NULL, &gpu);
    KT_CHECK(st == KV_OK, "%s: %s", spec, kv_errdetail());
    if (gpu) {
        cmp_result r;
        compare_engines(cpu, gpu, prompt, 24, short_run() ? 60 : 150, m->cfg.vocab_size, &r);
        printf("# stories260K %s: %d steps, max logit error %.3g, argmax differences %d\n", spec,
               r.steps, r.max_err, r.argmax_diff);
        KT_CHECK(r.max_err < tol, "%s: logits normalized error %g", spec, r.max_err);
        KT_CHECK(r.argmax_diff <= max_diff, "%s: %d greedy tokens differ", spec, r.argmax_diff);
        kv_bytes bc, bg;
        kv_engine_bytes(cpu, &bc);
        kv_gpu_engine_bytes(gpu, &bg);
        KT_CHECK(bc.resident == bg.resident && bg.host == 0, "%s: resident bytes cpu %llu gpu %llu",
                 spec, (unsigned long long)bc.resident, (unsigned long long)bg.resident);
    }
    kv_gpu_engine_free(gpu);
    kv_engine_free(cpu);
    free(pp);
    kv_model_close(m);
}

static void test_stories260k_streaming_matches_cpu(void)
{
    run_stories_policy("*=streaming:sink=4,window=32", 5e-3, 0);
}

static void test_stories260k_quant_matches_cpu(void)
{
    /* 2 and 4 bits, groups packed during the prompt and during decode.  The
     * codes are the CPU's given the same fp16 K/V (the host packs them), but
     * the engines' K/V differ by fp16 rounding, and at head_dim 8 a group's
     * min/max moving by one ulp can flip a code worth a third of the range:
     * measured 0.025 / 0.017 on an H200 (niah4k at head_dim 64: 0.006), so
     * the bound is looser than full's and one near-tie flip is allowed. */
    run_stories_policy("*=quant:bits=2,group=16,residual=16", 5e-2, 1);
    run_stories_policy("0=full;*=quant:bits=4,group=32,residual=8", 5e-2, 1);
}

/* KL(p || q) of two logit vectors, in double. */
static double kl_logits(const float *p, const float *q, int n)
{
    double mp = p[kt_argmax(p, n)], mq = q[kt_argmax(q, n)], zp = 0, zq = 0, kl = 0;
    for (int i = 0; i < n; i++) {
        zp += exp((double)p[i] - mp);
        zq += exp((double)q[i] - mq);
    }
    for (int i = 0; i < n; i++) {
        double lp = (double)p[i] - mp - log(zp), lq = (double)q[i] - mq - log(zq);
        kl += exp(lp) * (lp - lq);
    }
    return kl > 0 ? kl : 0;
}

static void test_stories260k_dsq_matches_cpu(void)
{
    /* salient=0: every packed token is a 2-bit code, so the packing does not
     * depend on importance; windows of 16 pack at ingest and during decode,
     * and the GPU must track the CPU as quant does.  Its bound is quant's
     * doubled: DSQ's keys are deltas from a window base, one more fp16
     * rounding that can move a 2-bit code at head_dim 8; once moved, that
     * window's error stays for the rest of the run.  Over random prompts an
     * H200 measured 0.065 with 1 greedy token apart, and 0.144 with 3
     * (2026-12-01); a packing bug gives errors near 1 and most tokens
     * apart (this path packs on the host with the CPU policy's code and
     * expands with eng_dsq_expand; test_cuda_kernels checks the separate
     * device packer, kv_cuda_dsq_pack) */
    run_stories_policy("*=dsq:window=16,salient=0,bits=2", 2e-1, 4);
    /* the default's layout: 4-bit keys, 2-bit values (each plane its own
     * row bytes on the device); not run on a GPU when written (session 6) */
    run_stories_policy("*=dsq:window=16,salient=0", 2e-1, 4);

    /* With salient tokens the choice ranks accumulated attention, and an
     * fp16-level difference can swap two near-tied tokens; that window's
     * noise then differs from the CPU's for the rest of the run.  So compare
     * what the issue asks for, the policy's fidelity against full on each
     * engine: KL and top-1 agreement over the same teacher-forced tokens,
     * next to the CPU engine's own f32-vs-f16 spread. */
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    const int L = m->cfg.n_layers, V = m->cfg.vocab_size, n0 = 24, steps = short_run() ? 60 : 200;
    kv_policy_params *pd = calloc((size_t)L, sizeof *pd), *pf = calloc((size_t)L, sizeof *pf);
    OK(kv_policy_parse("*=dsq:window=16,salient=0.2,bits=2", L, pd));
    OK(kv_policy_parse("*=full:dtype=f16", L, pf));
    int prompt[24];
    kv_engine *cf = NULL, *cd = NULL;
    kv_gpu_engine *gf = NULL, *gd = NULL;
    OK(kv_engine_new(m, pf, 256, &cf));
    OK(kv_engine_new(m, pd, 256, &cd));
    OK(kv_gpu_engine_new(m, NULL, 256, NULL, &gf));
    kv_status st = kv_gpu_engine_new(m, pd, 256, NULL, &gd);
    KT_CHECK(st == KV_OK, "dsq on the GPU: %s", kv_errdetail());
    float *l[4];
    for (int i = 0; i < 4; i++) l[i] = malloc((size_t)V * 4);
    const int runs = short_run() ? 1 : 4;
    double klc = 0, klg = 0;
    int agc = 0, agg = 0;
    for (int run = 0; gd && run < runs; run++) {
        for (int i = 0; i < n0; i++) prompt[i] = i ? 30 + (int)(kt_rand(&seed) * 400) : 1;
        OK(kv_engine_reset(cf, NULL));
        OK(kv_engine_reset(cd, NULL));
        OK(kv_gpu_engine_reset(gf, NULL));
        OK(kv_gpu_engine_reset(gd, NULL));
        OK(kv_engine_prefill(cf, prompt, n0, l[0]));
        OK(kv_engine_prefill(cd, prompt, n0, l[1]));
        OK(kv_gpu_engine_prefill(gf, prompt, n0, l[2]));
        OK(kv_gpu_engine_prefill(gd, prompt, n0, l[3]));
        double kc = 0, kg = 0;
        for (int i = 0; i < steps; i++) {
            int tok = kt_argmax(l[0], V);
            OK(kv_engine_step(cf, tok, l[0]));
            OK(kv_engine_step(cd, tok, l[1]));
            OK(kv_gpu_engine_step(gf, tok, l[2]));
            OK(kv_gpu_engine_step(gd, tok, l[3]));
            kc += kl_logits(l[0], l[1], V);
            kg += kl_logits(l[2], l[3], V);
            agc += kt_argmax(l[0], V) == kt_argmax(l[1], V);
            agg += kt_argmax(l[2], V) == kt_argmax(l[3], V);
        }
        printf("# stories260K dsq w=16 vs full, prompt %d: CPU KL %.4f, GPU KL %.4f\n", run,
               kc / steps, kg / steps);
        klc += kc;
        klg += kg;
    }
    if (gd) {
        const int ns = runs * steps;
        klc /= ns;
        klg /= ns;
        printf("# stories260K dsq w=16 vs full, %d steps: CPU KL %.4f top-1 %.3f, GPU KL %.4f top-1 %.3f\n",
               ns, klc, (double)agc / ns, klg, (double)agg / ns);
        KT_CHECK(fabs(klg - klc) <= 0.25 * klc + 0.02, "KL vs full: GPU %.4f, CPU %.4f", klg, klc);
        KT_CHECK(abs(agg - agc) <= ns / 10, "top-1 vs full: GPU %d, CPU %d of %d", agg, agc, ns);
        kv_bytes bc, bg;
        kv_engine_bytes(cd, &bc);
        kv_gpu_engine_bytes(gd, &bg);
        KT_CHECK(bc.resident == bg.resident, "resident bytes cpu %llu gpu %llu",
                 (unsigned long long)bc.resident, (unsigned long long)bg.resident);
    }
    for (int i = 0; i < 4; i++) free(l[i]);
    kv_gpu_engine_free(gd);
    kv_gpu_engine_free(gf);
    kv_engine_free(cd);
    kv_engine_free(cf);
    free(pf);
    free(pd);
    kv_model_close(m);
}

static void test_offload_equals_full_on_gpu(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    kv_gpu_engine *a = NULL, *b = NULL;
    OK(kv_gpu_engine_new(m, NULL, 128, &o, &a));
    kv_policy_params off[64];
    for (int l = 0; l < m->cfg.n_layers; l++) {
        kv_policy_params_default(&off[l], KV_POL_FULL);
        off[l].offload = true;
    }
    kv_status st = kv_gpu_engine_new(m, off, 128, &o, &b);
    KT_CHECK(st == KV_OK, "%s", kv_errdetail());
    int prompt[5] = {1, 200, 300, 17, 42};
    int oa[40], ob[40];
    if (b) {
        float lg[512];
        OK(kv_gpu_engine_prefill(a, prompt, 5, lg));
        OK(kv_gpu_engine_prefill(b, prompt, 5, lg));
        OK(kv_gpu_engine_generate(a, kt_argmax(lg, 512), 40, oa, NULL));
        OK(kv_gpu_engine_generate(b, kt_argmax(lg, 512), 40, ob, NULL));
        KT_CHECK(!memcmp(oa, ob, sizeof oa), "offload and full generate different ids");
        kv_bytes bb;
        kv_gpu_engine_bytes(b, &bb);
        uint64_t expect = (uint64_t)m->cfg.n_layers * 2 * m->cfg.n_kv_heads * 45 * m->cfg.head_dim * 2;
        KT_CHECK(bb.host == expect && bb.resident == 0, "offload bytes host %llu resident %llu",
                 (unsigned long long)bb.host, (unsigned long long)bb.resident);
        KT_CHECK(bb.fetched_last == (uint64_t)m->cfg.n_layers * 2 * m->cfg.n_kv_heads * 44 * m->cfg.head_dim * 2,
                 "offload fetched %llu", (unsigned long long)bb.fetched_last);
    }
    kv_gpu_engine_free(b);
    kv_gpu_engine_free(a);
    kv_model_close(m);
}

/* Programmatic dependent launch only overlaps launches: every level
 * generates the same ids (engines built one after the other, since the
 * level is the process's); level 3 is refused below. */
static void test_pdl_levels_generate_the_same_ids(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    int prompt[5] = {1, 200, 300, 17, 42}, ids[3][40];
    for (int lvl = 0; lvl < 3; lvl++) {
        kv_gpu_engine_opts o;
        kv_gpu_engine_opts_default(&o);
        o.pdl = lvl;
        kv_gpu_engine *g = NULL;
        OK(kv_gpu_engine_new(m, NULL, 128, &o, &g));
        float lg[512];
        OK(kv_gpu_engine_prefill(g, prompt, 5, lg));
        OK(kv_gpu_engine_generate(g, kt_argmax(lg, 512), 40, ids[lvl], NULL));
        kv_gpu_engine_free(g);
    }
    KT_CHECK(!memcmp(ids[0], ids[1], sizeof ids[0]) && !memcmp(ids[0], ids[2], sizeof ids[0]),
             "PDL levels 0, 1, 2 generate different ids");
    kv_model_close(m);
}

/* niah4k (head_dim 64) with full and sparse layers
 * against the CPU engine's same policies (niah_classic: select=resident with
 * the former kernels, opts.sel_classic). */
static bool niah_classic;
static void run_niah(const char *spec, kv_select_mode sel, double tol, int max_diff)
{
    kv_model *m = NULL;
    OK(kv_model_open(NIAH "niah4k.bin", &m));
    const int n = short_run() ? 160 : 600, V = m->cfg.vocab_size;
    int *prompt = malloc(n * sizeof(int));
    prompt[0] = 1;
    for (int i = 1; i < n; i++) prompt[i] = 3 + 32 + (int)(kt_rand(&seed) * 90); /* printable bytes */
    kv_policy_params *pp = calloc((size_t)m->cfg.n_layers, sizeof *pp);
    OK(kv_policy_parse(spec, m->cfg.n_layers, pp));
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    o.sel_classic = niah_classic;
    kv_engine *cpu = NULL;
    kv_gpu_engine *gpu = NULL;
    /* the CPU reference keeps its sparse prompt copy in fp16, as the GPU does */
    for (int l = 0; l < m->cfg.n_layers; l++) pp[l].dtype = KV_DT_F16;
    OK(kv_engine_new(m, pp, n + 40, &cpu));
    /* the sketch is a GPU selection: the CPU reference selects by its channels */
    if (sel == KV_SELECT_SKETCH) kv_policy_set_select(pp, m->cfg.n_layers, sel);
    kv_status st = kv_gpu_engine_new(m, pp, n + 40, &o, &gpu);
    KT_CHECK(st == KV_OK, "%s", kv_errdetail());
    if (gpu) {
        cmp_result r;
        compare_engines(cpu, gpu, prompt, n, short_run() ? 8 : 30, V, &r);
        printf("# niah4k %s%s%s: %d steps, max logit error %.3g, argmax differences %d\n", spec,
               sel == KV_SELECT_SKETCH ? " (sketch)" : "", niah_classic ? " (classic kernels)" : "", r.steps,
               r.max_err, r.argmax_diff);
        KT_CHECK(r.max_err < tol, "%s: logits normalized error %g", spec, r.max_err);
        KT_CHECK(r.argmax_diff <= max_diff, "%s: %d greedy tokens differ", spec, r.argmax_diff);
    }
    kv_gpu_engine_free(gpu);
    kv_engine_free(cpu);
    free(pp);
    free(prompt);
    kv_model_close(m);
}

static void test_niah4k_full_matches_cpu(void) { run_niah("full", KV_SELECT_CHANNELS, 5e-3, 0); }

static void test_niah4k_sparse_matches_cpu(void)
{
    /* Selection can flip near-ties under fp16 rounding, and the channel
     * approximation makes near-ties common: one token swapped in the top-K
     * moves the logits by a few percent (measured 2.6e-2 and 5.8e-2 on two
     * builds whose CPU attention summed in double and in float), so the
     * channel path gets a looser logit bound; greedy tokens must still agree.
     * The exact-selection path below keeps the tight one. */
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,channels=16", KV_SELECT_CHANNELS, 1e-1, 1);
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,select=exact", KV_SELECT_CHANNELS, 5e-2, 1);
}

/* The resident selections (rows of the pool channels chosen at ingest from
 * the prompt's last queries, fp16 and 4-bit codes; page bounds) against the
 * CPU engine's same policies: as the channel path, a swapped near-tie in
 * the top-K moves the logits by a few percent, so the same loose bound. */
static void test_niah4k_resident_and_pages_match_cpu(void)
{
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,channels=16,select=resident", KV_SELECT_RESIDENT,
             1e-1, 1);
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,channels=8,pool=32,cbits=4,select=resident",
             KV_SELECT_RESIDENT, 1e-1, 1);
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,page=16,select=pages", KV_SELECT_PAGES, 1e-1, 1);
    /* the former kernels on fresh prompts of the same kind, for comparison */
    niah_classic = true;
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,channels=16,select=resident", KV_SELECT_RESIDENT,
             1e-1, 1);
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,channels=8,pool=32,cbits=4,select=resident",
             KV_SELECT_RESIDENT, 1e-1, 1);
    niah_classic = false;
}

/*
 * The sparse step's ways to run (opts.sel_serial, topk_wide, sel_cache)
 * against the serial path, which runs the predicted query's selection and
 * gather on the main stream where they are issued: the overlapped path
 * (side streams ordered by events) and the wide top-K must give the same
 * logits bit for bit (the same kernels on the same inputs: a difference is a
 * race or a wrong id); the selection cache attends the same rows in another
 * order, so within float rounding, with the same greedy tokens, and it must
 * hit (tokens chosen again) and read fewer host bytes.  Also the cache
 * switched on between steps (kv_gpu_engine_set_step_opts: its tags start
 * from the buffer's content).  niah4k, the default resident hybrid.  The
 * former resident kernels (classic) within float rounding, the same greedy
 * tokens; two layers ahead (ahead2) bit for bit against its own serial path.
 */
typedef struct {
    const char *name;
    bool serial, wide, cache, switch_on, classic;
    int ahead;
    int sel_kernels; /* opts.sel_kernels (0: the default) */
} step_variant;

static void run_step_variant(kv_model *m, const kv_policy_params *pp, const int *prompt, int n,
                             int steps, const step_variant *v, float *logits, int *ids,
                             kv_gpu_timing *t, uint64_t *fetched)
{
    const int V = m->cfg.vocab_size;
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    o.sel_serial = v->serial;
    o.topk_wide = v->wide;
    o.sel_cache = v->cache && !v->switch_on;
    o.sel_classic = v->classic;
    o.sel_ahead = v->ahead;
    o.sel_kernels = v->sel_kernels;
    o.profile = true;
    kv_gpu_engine *g = NULL;
    kv_status st = kv_gpu_engine_new(m, pp, n + steps + 8, &o, &g);
    KT_CHECK(st == KV_OK, "%s: %s", v->name, kv_errdetail());
    memset(t, 0, sizeof *t);
    *fetched = 0;
    if (!g) return;
    OK(kv_gpu_engine_prefill(g, prompt, n, logits));
    /* every variant is fed the serial path's tokens (ids, filled by the first) */
    for (int i = 0; i < steps; i++) {
        if (v->switch_on && i == 3) OK(kv_gpu_engine_set_step_opts(g, v->serial, v->wide, true, true));
        int tok = v->serial ? kt_argmax(logits + (size_t)i * V, V) : ids[i];
        if (v->serial) ids[i] = tok;
        OK(kv_gpu_engine_step(g, tok, logits + (size_t)(i + 1) * V));
        kv_bytes b;
        kv_gpu_engine_bytes(g, &b);
        *fetched += b.fetched_last;
    }
    kv_gpu_engine_timing(g, t);
    kv_gpu_engine_free(g);
}

static void test_sparse_step_variants_match_the_serial_path(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(NIAH "niah4k.bin", &m));
    const int n = short_run() ? 200 : 700, steps = short_run() ? 6 : 24, V = m->cfg.vocab_size;
    int *prompt = malloc(n * sizeof(int)), ids[32];
    prompt[0] = 1;
    for (int i = 1; i < n; i++) prompt[i] = 3 + 32 + (int)(kt_rand(&seed) * 90);
    kv_policy_params *pp = calloc((size_t)m->cfg.n_layers, sizeof *pp);
    OK(kv_policy_parse("0=full;*=sparse:frac=0.03,sink=8,window=32,select=resident", m->cfg.n_layers, pp));
    for (int l = 0; l < m->cfg.n_layers; l++) pp[l].dtype = KV_DT_F16;
    const step_variant vs[] = {
        {"serial", true, false, false, false, false, 0, 0},      {"base", false, false, false, false, false, 0, 0},
        {"wide", false, true, false, false, false, 0, 0},        {"serial+wide", true, true, false, false, false, 0, 0},
        {"cache", false, false, true, false, false, 0, 0},       {"wide+cache", false, true, true, false, false, 0, 0},
        {"serial+cache", true, false, true, false, false, 0, 0}, {"cache switched on", false, false, true, true, false, 0, 0},
        {"classic", false, false, false, false, true, 0, 0},
        /* the chain's kernels every way (the default is late+collect): the same ids */
        {"early+hist", false, false, false, false, false, 0, KV_GPU_SELK_SET},
        {"nopdl+collect", false, false, false, false, false, 0, KV_GPU_SELK_SET | KV_GPU_SELK_NOPDL | KV_GPU_SELK_COLLECT},
        {"late+direct", false, false, false, false, false, 0, KV_GPU_SELK_SET | KV_GPU_SELK_LATE | KV_GPU_SELK_DIRECT},
        {"early+direct", false, false, false, false, false, 0, KV_GPU_SELK_SET | KV_GPU_SELK_DIRECT},
        /* last: serial+ahead2 becomes the reference of what follows */
        {"serial+ahead2", true, false, false, false, false, 2, 0},
        {"ahead2", false, false, false, false, false, 2, 0},
    };
    const size_t nl = (size_t)(steps + 1) * V;
    float *ref = malloc(nl * sizeof(float)), *lg = malloc(nl * sizeof(float));
    uint64_t fetched_ref = 0;
    for (size_t i = 0; i < sizeof vs / sizeof vs[0]; i++) {
        kv_gpu_timing t;
        uint64_t fetched = 0;
        const bool is_ref = !i || (vs[i].serial && vs[i].ahead); /* ahead2's own serial path */
        run_step_variant(m, pp, prompt, n, steps, &vs[i], is_ref ? ref : lg, ids, &t, &fetched);
        if (is_ref) {
            fetched_ref = fetched;
            continue;
        }
        double err = 0;
        int diff = 0, loose = 0; /* steps beyond 1e-3 */
        char trace[512] = "";
        size_t tl = 0;
        for (int s = 1; s <= steps; s++) {
            double e = nerr_f(lg + (size_t)s * V, ref + (size_t)s * V, (size_t)V);
            if (e > err) err = e;
            loose += e > 1e-3;
            if (tl < sizeof trace - 16) tl += (size_t)snprintf(trace + tl, sizeof trace - tl, " %.1e", e);
            diff += kt_argmax(lg + (size_t)s * V, V) != kt_argmax(ref + (size_t)s * V, V);
        }
        if (vs[i].cache) printf("#   %s: error per step%s\n", vs[i].name, trace);
        printf("# step %-18s %d steps: max logit error %.3g against serial, argmax differences %d, "
               "host bytes %llu (serial %llu), cache hits %llu of %llu\n", vs[i].name, steps, err, diff,
               (unsigned long long)fetched, (unsigned long long)fetched_ref,
               (unsigned long long)t.cache_hits, (unsigned long long)t.cache_rows);
        if (vs[i].classic) {
            KT_CHECK(err < 1e-2 && diff == 0, "%s: logits error %g, %d greedy tokens differ", vs[i].name, err,
                     diff);
        } else if (!vs[i].cache) {
            KT_CHECK(err == 0, "%s: logits differ from the serial path (%g)", vs[i].name, err);
        } else {
            /* the cache attends the same rows in another order, so its
             * residual stream drifts from serial's by float rounding (1e-5 to
             * 1.3e-4 a step on the H200), and a predicted query that moves by
             * that much can swap a near-tie of the top-K for a few steps: on
             * one prompt (session 7) steps 17-19 reached 2e-3..3.9e-3 and
             * fell back to 1e-5 after, in every cache variant alike.  A row
             * held wrongly would stay wrong, or be wrong on every prompt
             * (five earlier prompts: 1.3e-4 at most): at most 3 of the
             * steps past 1e-3, none past 1e-2. */
            KT_CHECK(err < 1e-2 && loose * 8 <= steps, "%s: logits normalized error %g against the serial path, "
                     "%d of %d steps beyond 1e-3", vs[i].name, err, loose, steps);
            KT_CHECK(diff == 0, "%s: %d greedy tokens differ", vs[i].name, diff);
            KT_CHECK(t.cache_rows > 0 && t.cache_hits > 0, "%s: no cache hits (%llu rows)", vs[i].name,
                     (unsigned long long)t.cache_rows);
            KT_CHECK(fetched < fetched_ref, "%s: %llu host bytes, serial %llu", vs[i].name,
                     (unsigned long long)fetched, (unsigned long long)fetched_ref);
        }
    }
    free(ref);
    free(lg);
    free(pp);
    free(prompt);
    kv_model_close(m);
}

static void test_niah4k_sketch_runs_close_to_full(void)
{
    /* the sketch is a different selector: compare with full, loosely */
    run_niah("0=full;*=sparse:k=256,sink=8,window=64", KV_SELECT_SKETCH, 0.5, 30);
}

/* Synthetic tiny model: the byte accounting of a hybrid engine follows the layout. */
static void test_niah4k_quant_matches_cpu(void)
{
    /* head_dim 64: outside the packed-attention kernel, the fp16 expansion */
    run_niah("*=quant:bits=2,group=32,residual=32", KV_SELECT_CHANNELS, 1e-2, 0);
}

static void test_niah4k_streaming_matches_cpu(void)
{
    run_niah("*=streaming:sink=8,window=64", KV_SELECT_CHANNELS, 5e-3, 0);
}

static void test_niah4k_dsq_matches_cpu(void)
{
    run_niah("0=full;*=dsq:salient=0.2,bits=2", KV_SELECT_CHANNELS, 5e-2, 1);
    /* the default: 4-bit keys, 2-bit values at head_dim 64 (not run on a
     * GPU when written, session 6) */
    run_niah("0=full;*=dsq", KV_SELECT_CHANNELS, 5e-2, 1);
}

/*
 * NaN/inf sweep on the GPU engine: one float of niah4k (legacy llama2.c,
 * f32) set to NaN, +inf or -inf, in a different tensor family of each layer
 * and in the embedding and final norm; every policy the GPU runs (full,
 * offload, quant, sparse by channels, exactly and by sketch, streaming,
 * dsq) must stop with KV_E_DATA naming that layer and tensor (the logits
 * come back non-finite and the host names the weight), or keep finite
 * logits; no CUDA error may follow (a later engine still works).
 */
static void test_nonfinite_weights_on_every_gpu_policy(void)
{
    FILE *f = fopen(NIAH "niah4k.bin", "rb");
    KT_REQUIRE(f, "niah4k");
    fseek(f, 0, SEEK_END);
    size_t len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *orig = malloc(len), *buf = malloc(len);
    KT_REQUIRE(orig && buf && fread(orig, 1, len, f) == len, "read");
    fclose(f);
    int32_t h[7];
    memcpy(h, orig, sizeof h);
    const size_t D = (size_t)h[0], H = (size_t)h[1], L = (size_t)h[2], kvd = D / (size_t)h[3] * (size_t)h[4];
    const size_t V = (size_t)(h[5] < 0 ? -h[5] : h[5]);
    const size_t sizes[11] = {V * D, D, D * D, D * kvd, D * kvd, D * D, D, H * D, D * H, H * D, D};
    const char *names[11] = {"tok_embd", "attn_norm", "wq", "wk", "wv", "wo", "ffn_norm",
                             "w_gate", "w_down", "w_up", "output_norm"};
    size_t base[11], off = 0;
    for (int i = 0; i < 11; i++) {
        base[i] = off;
        off += sizes[i] * (i > 0 && i < 10 ? L : 1);
    }
    static const char *specs[] = {"full", "full:offload=on", "quant:bits=2", "sparse:k=16,sink=4,window=16",
                                  "sparse:k=16,sink=4,window=16,select=exact",
                                  "sparse:k=16,sink=4,window=16,select=sketch", "streaming:sink=4,window=32",
                                  "dsq:window=32,bits=2"};
    const int np = (int)(sizeof specs / sizeof specs[0]);
    const float vals[3] = {NAN, INFINITY, -INFINITY};
    int prompt[200];
    prompt[0] = 1;
    for (int i = 1; i < 200; i++) prompt[i] = 35 + (i * 13) % 90;
    int runs = 0, refused = 0, bad = 0;
    for (int c = 0; c < (int)L + 2; c++) { /* c < L: layer c; then the embedding, the final norm */
        int fam = c < (int)L ? 1 + c % 9 : c == (int)L ? 0 : 10, l = c < (int)L ? c : 0;
        size_t idx = (size_t)(kt_rand(&seed) * (double)sizes[fam]);
        if (fam == 0) idx = (size_t)prompt[1 + c % 5] * D + idx % D; /* a row the prompt uses */
        size_t at = 28 + 4 * (base[fam] + (size_t)l * sizes[fam] + idx);
        float val = vals[c % 3];
        memcpy(buf, orig, len);
        memcpy(buf + at, &val, 4);
        kv_model *m = NULL;
        OK(kv_model_open_mem(buf, len, &m));
        char want[48];
        if (fam > 0 && fam < 10) snprintf(want, sizeof want, "layer %d %s ", l, names[fam]);
        else snprintf(want, sizeof want, "%s", names[fam]);
        for (int p = 0; p < np; p++) {
            kv_policy_params *pp = calloc((size_t)m->cfg.n_layers, sizeof *pp);
            OK(kv_policy_parse(specs[p], m->cfg.n_layers, pp));
            kv_gpu_engine *g = NULL;
            float *lg = malloc((size_t)m->cfg.vocab_size * 4);
            kv_errclear();
            kv_status st = kv_gpu_engine_new(m, pp, 256, NULL, &g);
            if (!st) st = kv_gpu_engine_prefill(g, prompt, 200, lg);
            for (int s = 0; s < 4 && !st; s++) st = kv_gpu_engine_step(g, prompt[1 + s], lg);
            bool fin = true;
            for (int i = 0; !st && i < m->cfg.vocab_size; i++) fin &= isfinite(lg[i]) != 0;
            runs++;
            if (st == KV_E_DATA && strstr(kv_errdetail(), want)) refused++;
            else if (!(st == KV_OK && fin)) {
                bad++;
                printf("#   %s = %g, %s: status %d: %s\n", want, (double)val, specs[p], st, kv_errdetail());
            }
            kv_gpu_engine_free(g);
            free(lg);
            free(pp);
        }
        kv_model_close(m);
    }
    printf("# GPU: %d runs over %d poisoned weights x %d policies: %d refused naming the tensor\n", runs,
           runs / np, np, refused);
    KT_CHECK(bad == 0, "%d runs neither refused with the tensor's name nor kept finite logits", bad);
    KT_CHECK(refused > runs * 9 / 10, "only %d of %d refused", refused, runs);
    /* the device is still sound: a clean model runs */
    kv_model *m = NULL;
    OK(kv_model_open_mem(orig, len, &m));
    kv_gpu_engine *g = NULL;
    float *lg = malloc((size_t)m->cfg.vocab_size * 4);
    OK(kv_gpu_engine_new(m, NULL, 256, NULL, &g));
    OK(kv_gpu_engine_prefill(g, prompt, 200, lg));
    kv_gpu_engine_free(g);
    free(lg);
    kv_model_close(m);
    free(orig);
    free(buf);
}

/* A niah4k-like prompt of n tokens: BOS, then printable bytes. */
static int *niah_prompt(int n)
{
    int *p = malloc((size_t)n * sizeof *p);
    p[0] = 1;
    for (int i = 1; i < n; i++) p[i] = 3 + 32 + (int)(kt_rand(&seed) * 90);
    return p;
}

/* Two .kvc dumps of one prompt, the GPU engine's (g) against the CPU
 * engine's (c): the same metadata, tensors, shapes and tokens; K, V and q
 * within fp16 tolerance by normalized error.  The checksums of K, V and q
 * (crc32c.layers.*) differ with the values; each file's own are verified by
 * kvc_open, and the tokens' must be equal. */
static void compare_dumps(const char *gpath, const char *cpath, const char *what, double tol)
{
    kvc_file *g = NULL, *c = NULL;
    OK(kvc_open(gpath, &g));
    OK(kvc_open(cpath, &c));
    int nm = kvc_n_meta(c), meta_bad = 0;
    for (int i = 0; i < nm; i++) {
        const char *k, *v;
        kvc_meta_at(c, i, &k, &v);
        const char *gv = kvc_meta(g, k);
        if (!strncmp(k, "crc32c.layers.", 14)) {
            meta_bad += !gv; /* present in both: values differ with the data */
            continue;
        }
        meta_bad += !gv || strcmp(gv, v);
    }
    KT_CHECK(kvc_n_meta(g) == nm && meta_bad == 0, "%s: metadata %d vs %d keys, %d differ", what,
             kvc_n_meta(g), nm, meta_bad);
    KT_CHECK(kvc_n_tensors(g) == kvc_n_tensors(c), "%s: %d tensors vs %d", what, kvc_n_tensors(g),
             kvc_n_tensors(c));
    double wkv = 0, wq = 0;
    int nkv = 0, nq = 0, shape_bad = 0, tokens_same = 0;
    for (int i = 0; i < kvc_n_tensors(c); i++) {
        const kvc_tensor *t = kvc_tensor_at(c, i), *u = kvc_find(g, t->name);
        if (!u || u->dtype != t->dtype || u->ndim != t->ndim ||
            memcmp(u->shape, t->shape, (size_t)t->ndim * sizeof t->shape[0])) {
            shape_bad++;
            continue;
        }
        if (!strcmp(t->name, "tokens")) {
            tokens_same = u->nbytes == t->nbytes && !memcmp(u->data, t->data, t->nbytes);
            continue;
        }
        size_t n = (size_t)kvc_tensor_numel(t);
        float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
        KT_REQUIRE(a && b, "alloc");
        OK(kvc_tensor_to_f32(u, a));
        OK(kvc_tensor_to_f32(t, b));
        double e = nerr_f(a, b, n);
        size_t len = strlen(t->name);
        if (t->name[len - 1] == 'q') wq = e > wq ? e : wq, nq++;
        else wkv = e > wkv ? e : wkv, nkv++;
        free(a);
        free(b);
    }
    printf("# %s: %d K/V tensors (worst normalized error %.3g), %d q tensors (worst %.3g), "
           "tokens %s, %d metadata keys equal\n", what, nkv, wkv, nq, wq,
           tokens_same ? "equal" : "DIFFER", nm - meta_bad);
    KT_CHECK(shape_bad == 0, "%s: %d tensors missing or of another type or shape", what, shape_bad);
    KT_CHECK(tokens_same, "%s: the token ids differ", what);
    KT_CHECK(nkv == 2 * kvc_geom(c)->n_layers && nq == kvc_geom(c)->n_layers, "%s: %d K/V, %d q",
             what, nkv, nq);
    KT_CHECK(wkv < tol && wq < tol, "%s: K/V error %g, q error %g (bound %g)", what, wkv, wq, tol);
    kvc_close(g);
    kvc_close(c);
}

/* kv-run --dump-kv on the GPU: the runner's capture of a GPU prefill (in
 * chunks of `chunk` rows, or one token at a time with chunk < 0) written
 * through the one writer, against the CPU engine's dump of the same prompt. */
static void dump_matches_cpu(const char *spec, int n, int nq, int chunk)
{
    kv_model *m = NULL;
    OK(kv_model_open(NIAH "niah4k.bin", &m));
    const int L = m->cfg.n_layers;
    int *prompt = niah_prompt(n);
    kv_policy_params *pp = calloc((size_t)L, sizeof *pp);
    OK(kv_policy_parse(spec, L, pp));
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    o.prefill_chunk = chunk;
    kv_runner *rc = NULL, *rg = NULL;
    OK(kv_runner_new(m, pp, n + 8, KV_DEVICE_CPU, NULL, &rc));
    OK(kv_runner_new(m, pp, n + 8, KV_DEVICE_CUDA, &o, &rg));
    kv_prefill_info pi;
    kv_runner_prefill_info(rg, &pi);
    KT_CHECK(!strcmp(pi.device, "cuda") && pi.chunked == (chunk > 0) && (chunk <= 0 || pi.chunk == chunk),
             "prefill info: %s %d %d (%s)", pi.device, pi.chunked, pi.chunk, pi.why);
    OK(kv_runner_keep(rc, nq, true));
    OK(kv_runner_keep(rg, nq, true));
    OK(kv_runner_prefill(rc, prompt, n, NULL));
    OK(kv_runner_prefill(rg, prompt, n, NULL));
    char gpath[96], cpath[96], what[160];
    snprintf(gpath, sizeof gpath, "/tmp/kv-test-gpudump-%d-g.kvc", (int)getpid());
    snprintf(cpath, sizeof cpath, "/tmp/kv-test-gpudump-%d-c.kvc", (int)getpid());
    OK(kv_runner_dump_kvc(rg, prompt, n, KV_DT_F32, gpath, 0));
    OK(kv_runner_dump_kvc(rc, prompt, n, KV_DT_F32, cpath, 0));
    snprintf(what, sizeof what, "niah4k dump, %s, %d tokens, nq %d, %s", spec, n, nq,
             chunk > 0 ? "GPU prefill in chunks" : "GPU prefill token by token");
    if (chunk > 0) snprintf(what + strlen(what), sizeof what - strlen(what), " of %d", chunk);
    compare_dumps(gpath, cpath, what, 3e-3);
    /* f16 on both: the same writer's conversion, the same bound */
    OK(kv_runner_dump_kvc(rg, prompt, n, KV_DT_F16, gpath, 3));
    OK(kv_runner_dump_kvc(rc, prompt, n, KV_DT_F16, cpath, 3));
    snprintf(what + strlen(what), sizeof what - strlen(what), ", f16 zstd");
    compare_dumps(gpath, cpath, what, 3e-3);
    remove(gpath);
    remove(cpath);
    kv_runner_free(rg);
    kv_runner_free(rc);
    free(pp);
    free(prompt);
    kv_model_close(m);
}

static void test_niah4k_gpu_dump_matches_cpu_dump(void)
{
    /* 700 tokens in chunks of 128: the 100 queries span two chunks; sparse
     * layers stream their rows out chunk by chunk while the dump is taken */
    dump_matches_cpu("0=full;*=sparse:k=64,sink=8,window=32", short_run() ? 300 : 700, 100, 128);
    dump_matches_cpu("full", short_run() ? 60 : 200, 32, -1);
}

/*
 * Why dsq's niah4k accuracy on the GPU is one task off the CPU's at 1k
 * (docs/BENCHMARKS.md, issue 9).  A window's salient tokens are the top S
 * of an importance: the causal attention of the prompt's last 32 queries,
 * summed over heads (kv_dsq_importance, which both engines' dsq ingest
 * calls).  Each engine's inputs to it are what its capture for --dump-kv
 * holds (the prefill's queries and keys: f32 on the CPU, fp16 on the GPU),
 * so the importance is recomputed here from the captures, exactly as each
 * engine's ingest computes it.  Checked: the two importance vectors agree
 * within fp16 tolerance, and every window whose salient set differs is a
 * near-tie in the CPU's ranking (the tokens that swap are within 5% of
 * each other); a different query set, scale or normalization would fail
 * both.  Printed: per task the windows that differ and, unless short, each
 * engine's dsq answer and score.
 */
typedef struct {
    int windows, flipped;
    double worst_err;       /* normalized error of the GPU importance, worst layer */
    double worst_flip;      /* largest relative CPU margin between tokens that swapped */
    double min_margin;      /* smallest relative gap at the salient boundary, any window */
} dsq_cmp;

/* Compare the salient choice of every complete window of one layer's
 * importance (H, T): CPU c against GPU g.  Prints the first flips. */
static void dsq_compare_layer(const float *c, const float *g, int H, int T, int W, int S,
                              const char *tag, int layer, dsq_cmp *r, int *printed)
{
    uint8_t mc[512], mg[512];
    float v[4096];
    for (int h = 0; h < H; h++)
        for (int w = 0; w < T / W; w++) {
            const float *cw = c + (size_t)h * T + (size_t)w * W, *gw = g + (size_t)h * T + (size_t)w * W;
            kv_dsq_select(cw, W, S, mc);
            kv_dsq_select(gw, W, S, mg);
            r->windows++;
            /* the CPU's gap at the boundary: S-th largest against (S+1)-th */
            memcpy(v, cw, (size_t)W * sizeof *v);
            for (int i = 0; i <= S && i < W; i++)
                for (int j = i + 1; j < W; j++)
                    if (v[j] > v[i]) {
                        float t = v[i];
                        v[i] = v[j];
                        v[j] = t;
                    }
            if (S > 0 && S < W && v[S - 1] > 0) {
                double mg_ = (v[S - 1] - v[S]) / v[S - 1];
                if (mg_ < r->min_margin) r->min_margin = mg_;
            }
            if (!memcmp(mc, mg, (size_t)W / 8)) continue;
            r->flipped++;
            int a = -1, b = -1; /* the strongest CPU-only token, the weakest GPU-only one */
            for (int t = 0; t < W; t++) {
                int inc = mc[t >> 3] >> (t & 7) & 1, ing = mg[t >> 3] >> (t & 7) & 1;
                if (inc && !ing && (a < 0 || cw[t] > cw[a])) a = t;
                if (ing && !inc && (b < 0 || cw[t] < cw[b])) b = t;
            }
            double m = a >= 0 && b >= 0 && cw[a] > 0 ? (cw[a] - cw[b]) / cw[a] : 1.0;
            if (m > r->worst_flip) r->worst_flip = m;
            if (a >= 0 && b >= 0 && (*printed)++ < 12)
                printf("#   %s layer %d head %d window %d: CPU keeps token %d (%.6g; GPU %.6g), GPU "
                       "token %d (%.6g; CPU %.6g): CPU margin %.2e, GPU margin %.2e\n", tag, layer, h,
                       w, w * W + a, cw[a], gw[a], w * W + b, gw[b], cw[b], m,
                       gw[b] > 0 ? (gw[b] - gw[a]) / gw[b] : 0.0);
        }
}

static void test_niah4k_dsq_salient_choice_differs_only_at_near_ties(void)
{
    kv_model *m = NULL;
    kv_tokenizer *tok = NULL;
    kv_niah_set set = {0};
    OK(kv_model_open(NIAH "niah4k.bin", &m));
    OK(kv_tokenizer_load_llama2c(NIAH "tok259.bin", m->cfg.vocab_size, &tok));
    OK(kv_niah_load(NIAH "tasks-dev.jsonl", &set));
    const int L = m->cfg.n_layers, H = m->cfg.n_kv_heads, NH = m->cfg.n_heads, hd = m->cfg.head_dim;
    const int NOBS = 32; /* DSQ_OBSERVE of kv_gpu_dsq.c, PREFILL_OBSERVE of kv_engine.c */
    kv_dsq_params dp;
    kv_dsq_params_default(&dp);
    const int W = dp.window, S = kv_dsq_salient_count(W, 0.2);
    kv_policy_params *pd = calloc((size_t)L, sizeof *pd);
    OK(kv_policy_parse("dsq:salient=0.2,bits=2", L, pd));
    kv_engine *ce = NULL;
    kv_gpu_engine *ge = NULL;
    OK(kv_engine_new(m, NULL, 0, &ce));
    OK(kv_gpu_engine_new(m, NULL, 0, NULL, &ge));
    OK(kv_engine_keep(ce, NOBS, true));
    OK(kv_gpu_engine_keep(ge, NOBS, true));
    kv_runner *rc = NULL, *rg = NULL;
    if (!short_run()) {
        OK(kv_runner_new(m, pd, 0, KV_DEVICE_CPU, NULL, &rc));
        OK(kv_runner_new(m, pd, 0, KV_DEVICE_CUDA, NULL, &rg));
    }
    const int ntask = short_run() ? 3 : 20;
    dsq_cmp all = {0, 0, 0, 0, 1e30};
    int printed = 0, done = 0, score_c = 0, score_g = 0;
    for (int ti = 0; ti < set.n && done < ntask; ti++) {
        const kv_niah_task *t = &set.tasks[ti];
        if (t->length != 1024) continue;
        int *ids = NULL, n = 0, split = 0;
        kv_niah_mode used;
        OK(kv_niah_prepare(tok, t, KV_NIAH_QUESTION, &ids, &n, &split, &used));
        OK(kv_engine_reset(ce, NULL));
        OK(kv_gpu_engine_reset(ge, NULL));
        OK(kv_engine_prefill(ce, ids, split, NULL));
        OK(kv_gpu_engine_prefill(ge, ids, split, NULL));
        const size_t kn = (size_t)H * split * hd, qn = (size_t)NH * NOBS * hd;
        float *kg = malloc(kn * 4), *qc = malloc(qn * 4), *qg = malloc(qn * 4);
        float *ic = malloc((size_t)H * split * 4), *ig = malloc((size_t)H * split * 4);
        uint16_t *q16 = malloc(qn * 2);
        KT_REQUIRE(kg && qc && qg && ic && ig && q16, "alloc");
        dsq_cmp r = {0, 0, 0, 0, 1e30};
        char tag[32];
        snprintf(tag, sizeof tag, "task %d", t->index);
        for (int l = 0; l < L; l++) {
            int Tc = 0, Tg = 0;
            const float *kc = kv_engine_prompt_kv(ce, l, 'k', &Tc);
            const uint16_t *k16 = kv_gpu_engine_prompt_kv(ge, l, 'k', &Tg);
            int nc = kv_engine_queries(ce, l, qc), ng = kv_gpu_engine_queries(ge, l, q16);
            KT_REQUIRE(kc && k16 && Tc == split && Tg == split && nc == NOBS && ng == NOBS,
                       "captures: T %d %d, queries %d %d", Tc, Tg, nc, ng);
            for (size_t i = 0; i < kn; i++) kg[i] = kv_half_to_f32(k16[i]);
            for (size_t i = 0; i < qn; i++) qg[i] = kv_half_to_f32(q16[i]);
            OK(kv_dsq_importance(qc, NH, NOBS, kc, H, split, hd, ic));
            OK(kv_dsq_importance(qg, NH, NOBS, kg, H, split, hd, ig));
            double e = nerr_f(ig, ic, (size_t)H * split);
            if (e > r.worst_err) r.worst_err = e;
            dsq_compare_layer(ic, ig, H, split, W, S, tag, l, &r, &printed);
        }
        char answers[256] = "";
        if (rc) {
            kv_niah_opts no;
            kv_niah_opts_default(&no);
            kv_niah_result a, b;
            OK(kv_niah_run_prepared(rc, tok, NULL, t, &no, ids, n, split, used, &a));
            OK(kv_niah_run_prepared(rg, tok, NULL, t, &no, ids, n, split, used, &b));
            snprintf(answers, sizeof answers, "; dsq answers CPU '%s' (%.2f), GPU '%s' (%.2f)%s",
                     a.pred, a.score, b.pred, b.score, a.score != b.score ? "  <- differs" : "");
            score_c += a.score == 1.0;
            score_g += b.score == 1.0;
            kv_niah_result_clear(&a);
            kv_niah_result_clear(&b);
        }
        printf("# niah4k %s, %d tokens ingested: %d of %d windows choose other salient tokens, "
               "importance error %.2e, smallest boundary margin %.2e%s\n", tag, split, r.flipped,
               r.windows, r.worst_err, r.min_margin, answers);
        all.windows += r.windows;
        all.flipped += r.flipped;
        if (r.worst_err > all.worst_err) all.worst_err = r.worst_err;
        if (r.worst_flip > all.worst_flip) all.worst_flip = r.worst_flip;
        if (r.min_margin < all.min_margin) all.min_margin = r.min_margin;
        free(kg), free(qc), free(qg), free(ic), free(ig), free(q16), free(ids);
        done++;
    }
    printf("# niah4k dsq at 1k, %d tasks: %d of %d windows differ; importance error at most %.2e; "
           "the tokens that swap are at most %.2e apart (relative); tasks right CPU %d, GPU %d\n",
           done, all.flipped, all.windows, all.worst_err, all.worst_flip, score_c, score_g);
    KT_CHECK(done == ntask, "%d tasks of length 1024", done);
    KT_CHECK(all.worst_err < 2e-2, "GPU importance differs from the CPU's by %g", all.worst_err);
    KT_CHECK(all.worst_flip < 5e-2, "a salient choice differs where the CPU's margin is %g", all.worst_flip);
    kv_runner_free(rg);
    kv_runner_free(rc);
    kv_gpu_engine_free(ge);
    kv_engine_free(ce);
    free(pd);
    kv_niah_clear(&set);
    kv_tokenizer_free(tok);
    kv_model_close(m);
}

/* Sparse layers copy their prompt to host memory chunk by chunk on the copy
 * stream (sparse_chunk) or, with opts.prefill_copy_sync, at the layer's end:
 * the same bytes, so the same logits bit for bit and the same greedy ids. */
static void test_sparse_chunk_copies_equal_the_layer_copy(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(NIAH "niah4k.bin", &m));
    const int L = m->cfg.n_layers, V = m->cfg.vocab_size, n = short_run() ? 300 : 900, steps = 24;
    int *prompt = niah_prompt(n);
    const char *specs[2] = {"0=full;*=sparse:k=64,sink=8,window=32,channels=16",
                            "0=full;*=sparse:k=64,sink=8,window=32,select=exact"};
    kv_policy_params *pp = calloc((size_t)L, sizeof *pp);
    for (int sidx = 0; sidx < 2; sidx++) {
        OK(kv_policy_parse(specs[sidx], L, pp));
        float *lg[2];
        int ids[2][24];
        kv_bytes b[2];
        for (int k = 0; k < 2; k++) {
            kv_gpu_engine_opts o;
            kv_gpu_engine_opts_default(&o);
            o.prefill_chunk = 128;
            o.prefill_copy_sync = k == 1;
            kv_gpu_engine *g = NULL;
            OK(kv_gpu_engine_new(m, pp, n + steps + 8, &o, &g));
            lg[k] = malloc((size_t)V * sizeof(float));
            OK(kv_gpu_engine_prefill(g, prompt, n, lg[k]));
            OK(kv_gpu_engine_generate(g, kt_argmax(lg[k], V), steps, ids[k], NULL));
            kv_gpu_engine_bytes(g, &b[k]);
            kv_gpu_engine_free(g);
        }
        int same_ids = !memcmp(ids[0], ids[1], sizeof ids[0]);
        int same_logits = !memcmp(lg[0], lg[1], (size_t)V * sizeof(float));
        printf("# %s, %d tokens in chunks of 128: streamed vs per-layer copy: logits %s, %d greedy "
               "ids %s, host bytes %llu vs %llu\n", specs[sidx], n, same_logits ? "equal" : "DIFFER",
               steps, same_ids ? "equal" : "DIFFER", (unsigned long long)b[0].host,
               (unsigned long long)b[1].host);
        KT_CHECK(same_logits && same_ids, "%s: streamed copies change the result", specs[sidx]);
        KT_CHECK(b[0].host == b[1].host && b[0].resident == b[1].resident &&
                     b[0].fetched_total == b[1].fetched_total,
                 "%s: bytes differ", specs[sidx]);
        free(lg[0]);
        free(lg[1]);
    }
    free(pp);
    free(prompt);
    kv_model_close(m);
}

static void test_hybrid_bytes_follow_the_layout(void)
{
    kv_model *m = NULL;
    OK(kv_model_synthetic("tiny", 3, KV_DT_F16, &m));
    kv_policy_params *pp = calloc((size_t)m->cfg.n_layers, sizeof *pp);
    /* select=channels: the host keeps a channel-major copy of the keys and
     * each step reads the critical channels' runs; select=resident (the
     * default since helper G2) keeps its index on the GPU, so the host holds
     * K and V alone and a step fetches the chosen rows only */
    static const char *const specs[2] = {"*=sparse:k=32,sink=4,window=16,channels=4,select=channels",
                                         "*=sparse:k=32,sink=4,window=16,channels=4"};
    for (int sidx = 0; sidx < 2; sidx++) {
        OK(kv_policy_parse(specs[sidx], m->cfg.n_layers, pp));
        kv_gpu_engine *g = NULL;
        kv_status st = kv_gpu_engine_new(m, pp, 1100, NULL, &g);
        KT_CHECK(st == KV_OK, "%s: %s", specs[sidx], kv_errdetail());
        if (g) {
            OK(kv_gpu_engine_synthesize(g, 1000, 7));
            int out[8];
            OK(kv_gpu_engine_generate(g, 5, 8, out, NULL));
            kv_bytes b;
            OK(kv_gpu_engine_layer_bytes(g, 1, &b));
            const uint64_t H = (uint64_t)m->cfg.n_kv_heads, D = (uint64_t)m->cfg.head_dim;
            uint64_t ldc = 1000;
            uint64_t rows = 32 * H * 2 * D * 2;
            if (sidx == 0) {
                KT_CHECK(b.host == 2 * H * 1000 * D * 2 + H * D * ldc * 2, "host %llu", (unsigned long long)b.host);
                /* last step: T = 1008, candidates [4, 992): 8-aligned channel runs + 32 rows */
                uint64_t n8 = (992 - 0 + 7) / 8 * 8;
                uint64_t expect = H * 4 * n8 * 2 + rows;
                KT_CHECK(b.fetched_last == expect, "fetched %llu, expected %llu", (unsigned long long)b.fetched_last,
                         (unsigned long long)expect);
            } else {
                KT_CHECK(b.host == 2 * H * 1000 * D * 2, "resident: host %llu", (unsigned long long)b.host);
                KT_CHECK(b.fetched_last == rows, "resident: fetched %llu, expected %llu",
                         (unsigned long long)b.fetched_last, (unsigned long long)rows);
            }
            for (int i = 0; i < 8; i++) KT_CHECK(out[i] >= 0 && out[i] < m->cfg.vocab_size, "id %d", out[i]);
        }
        kv_gpu_engine_free(g);
    }
    free(pp);
    kv_model_close(m);
}

// --- packed weights, biases, wide heads ------------------------------------------------

/*
 * The packed kernels (kernels/eng_gemv_q.cu, eng_dequant.cu) against the
 * CPU reference of lib/model/kv_quants on fresh random rows of each type:
 * the GEMV against float64 sums of kv_quant_dequant_row's values (tight),
 * and against kv_quant_dot_ref, whose activations are quantized (the CPU
 * path's numbers; looser by that quantization); the dequantization to fp16
 * and bf16 and the embedding rows equal the reference's values exactly.
 * The row counts are odd and Q6_K/Q8_0 rows hold an odd number of blocks,
 * so blocks sit at 2-byte-aligned addresses.
 */
static void check_packed(kv_dtype t, int rows, int cols)
{
    const uint32_t g = kv_dtype_ggml(t);
    const size_t pitch = kv_dtype_row_bytes(t, cols);
    const char *tn = kv_dtype_name(t);
    float *wf = malloc((size_t)rows * cols * 4), *deq = malloc((size_t)rows * cols * 4);
    float *x = malloc((size_t)cols * 4), *y = malloc((size_t)rows * 4);
    uint8_t *W = malloc((size_t)rows * pitch), *xq = malloc(kv_quant_vec_bytes(kv_quant_vec_type(g), cols));
    double *ref = malloc((size_t)rows * sizeof(double)), *refq = malloc((size_t)rows * sizeof(double));
    KT_REQUIRE(wf && deq && x && y && W && xq && ref && refq, "alloc");
    for (size_t i = 0; i < (size_t)rows * cols; i++) wf[i] = 0.05f * kt_randn(&seed);
    for (int c = 0; c < cols; c++) x[c] = kt_randn(&seed);
    for (int r = 0; r < rows; r++) {
        OK(kv_quant_quantize_row(g, wf + (size_t)r * cols, W + (size_t)r * pitch, cols));
        kv_quant_dequant_row(g, W + (size_t)r * pitch, deq + (size_t)r * cols, cols);
    }
    kv_quant_activations(kv_quant_vec_type(g), x, xq, cols);
    for (int r = 0; r < rows; r++) {
        double s = 0;
        for (int c = 0; c < cols; c++) s += (double)deq[(size_t)r * cols + c] * x[c];
        ref[r] = s + 1.0; /* accumulate onto y = 1 */
        refq[r] = (double)kv_quant_dot_ref(g, W + (size_t)r * pitch, xq, cols) + 1.0;
        y[r] = 1.0f;
    }
    void *dW = dput(W, (size_t)rows * pitch);
    float *dx = dput(x, (size_t)cols * 4), *dy = dput(y, (size_t)rows * 4);
    KT_REQUIRE(dW && dx && dy, "alloc");
    CU(eng_gemv_q(dW, t, rows, cols, pitch, dx, dy, 1, 0));
    CU(cudaMemcpy(y, dy, (size_t)rows * 4, cudaMemcpyDeviceToHost));
    double e = nerr(y, ref, (size_t)rows), eq = nerr(y, refq, (size_t)rows);
    printf("# gemv %s %dx%d: normalized error %.3g against float64, %.3g against kv_quant_dot_ref\n", tn, rows,
           cols, e, eq);
    KT_CHECK(e < 1e-5, "gemv %s %dx%d: normalized error %g against float64", tn, rows, cols, e);
    KT_CHECK(eq < 2e-2, "gemv %s %dx%d: normalized error %g against kv_quant_dot_ref", tn, rows, cols, eq);
    /* the variants of eng_gemv_qv (kernels/eng_gemv_qv.cu): "rows" keeps the
     * float arithmetic (as tight as old); "dp4a" rounds x to int8 per 32
     * values, an error of the size of the CPU path's own activation rounding
     * (kv_quant_dot_ref's distance from float64), so it is held to 2e-2 of
     * float64 and to what the CPU path itself reaches times 4 (3.0x measured
     * on Q4_K 37x1024 on 2026-12-01; dp4a is a measurement variant, not the
     * default) */
    const double eq_cpu = nerr_d(refq, ref, (size_t)rows);
    for (int v = KV_GEMV_OLD; v < KV_GEMV_COUNT; v++) {
        float *hv = malloc((size_t)rows * 4);
        KT_REQUIRE(hv, "alloc");
        for (int r = 0; r < rows; r++) hv[r] = 1.0f; /* accumulate onto y = 1 */
        float *yv = dput(hv, (size_t)rows * 4);
        KT_REQUIRE(yv, "alloc");
        CU(eng_gemv_qv(v, dW, t, rows, cols, pitch, dx, yv, 1, 0));
        CU(cudaMemcpy(hv, yv, (size_t)rows * 4, cudaMemcpyDeviceToHost));
        double ev = nerr(hv, ref, (size_t)rows), evq = nerr(hv, refq, (size_t)rows);
        printf("# gemv %s %dx%d variant %s: normalized error %.3g against float64, %.3g against kv_quant_dot_ref "
               "(which is %.3g from float64)\n", tn, rows, cols, kv_gemv_variant_name(v), ev, evq, eq_cpu);
        if (v == KV_GEMV_DP4A)
            KT_CHECK(ev < 2e-2 && ev < 4 * eq_cpu + 1e-6, "gemv %s %dx%d dp4a: normalized error %g against "
                     "float64 (the CPU path's %g)", tn, rows, cols, ev, eq_cpu);
        else
            KT_CHECK(ev < 1e-5, "gemv %s %dx%d %s: normalized error %g against float64", tn, rows, cols,
                     kv_gemv_variant_name(v), ev);
        KT_CHECK(evq < 2e-2, "gemv %s %dx%d %s: normalized error %g against kv_quant_dot_ref", tn, rows, cols,
                 kv_gemv_variant_name(v), evq);
        free(hv);
        cudaFree(yv);
    }
    /* dequantization: fp16 rows two apart with padding, and bf16 */
    const int ld = cols + 8;
    uint16_t *h = malloc((size_t)2 * rows * ld * 2);
    void *dh = NULL;
    KT_REQUIRE(h && cudaMalloc(&dh, (size_t)2 * rows * ld * 2) == cudaSuccess, "alloc");
    for (int bf = 0; bf < 2; bf++) {
        CU(cudaMemset(dh, 0x7f, (size_t)2 * rows * ld * 2));
        CU(eng_dequant_rows(dW, t, rows, cols, pitch, dh, bf ? KV_DT_BF16 : KV_DT_F16, ld, 2, 0));
        CU(cudaMemcpy(h, dh, (size_t)2 * rows * ld * 2, cudaMemcpyDeviceToHost));
        long bad = 0, pad = 0;
        for (int r = 0; r < rows; r++) {
            const uint16_t *o = h + (size_t)2 * r * ld;
            for (int c = 0; c < cols; c++) {
                float v = deq[(size_t)r * cols + c];
                bad += o[c] != (bf ? kv_f32_to_bf16(v) : kv_f32_to_half(v));
            }
            for (int c = cols; c < ld; c++) pad += o[c] != 0;
        }
        KT_CHECK(bad == 0 && pad == 0, "dequant %s to %s: %ld values differ from the reference, %ld padding not 0",
                 tn, bf ? "bf16" : "f16", bad, pad);
    }
    /* embedding rows by token id */
    int tok[3] = {rows - 1, 0, rows / 2};
    int *dt = dput(tok, sizeof tok);
    float *dE = NULL, E[3 * 1024];
    KT_REQUIRE(cols <= 1024 && dt && cudaMalloc((void **)&dE, 3 * (size_t)cols * 4) == cudaSuccess, "alloc");
    CU(eng_embed_rows_q(dW, t, cols, pitch, dt, 3, dE, cols, 0));
    CU(cudaMemcpy(E, dE, 3 * (size_t)cols * 4, cudaMemcpyDeviceToHost));
    long bad = 0;
    for (int i = 0; i < 3; i++)
        for (int c = 0; c < cols; c++) bad += E[(size_t)i * cols + c] != deq[(size_t)tok[i] * cols + c];
    KT_CHECK(bad == 0, "embedding rows %s: %ld values differ from kv_quant_dequant_row's", tn, bad);
    cudaFree(dE);
    cudaFree(dt);
    cudaFree(dh);
    cudaFree(dW);
    cudaFree(dx);
    cudaFree(dy);
    free(h);
    free(wf);
    free(deq);
    free(x);
    free(y);
    free(W);
    free(xq);
    free(ref);
    free(refq);
}

static void test_packed_kernels_match_cpu_reference(void)
{
    check_packed(KV_DT_Q8_0, 37, 800);  /* 25 blocks a row */
    check_packed(KV_DT_Q4_K, 37, 1024);
    check_packed(KV_DT_Q6_K, 37, 768);  /* 3 blocks a row */
    check_packed(KV_DT_Q4_K, 301, 256); /* one block a row */
    check_packed(KV_DT_Q6_K, 5, 256);
    /* bias rows: y (rows, ld) += b, as the CPU's kv_matvec adds it */
    const int n = 300, rows = 7, ld = 304;
    float *yh = malloc((size_t)rows * ld * 4), *b = malloc((size_t)n * 4), *out = malloc((size_t)rows * ld * 4);
    for (int i = 0; i < rows * ld; i++) yh[i] = kt_randn(&seed);
    for (int i = 0; i < n; i++) b[i] = kt_randn(&seed);
    float *dy = dput(yh, (size_t)rows * ld * 4), *db = dput(b, (size_t)n * 4);
    KT_REQUIRE(dy && db, "alloc");
    CU(eng_add_bias_rows(dy, ld, db, n, rows, 0));
    CU(cudaMemcpy(out, dy, (size_t)rows * ld * 4, cudaMemcpyDeviceToHost));
    long bad = 0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < ld; c++) bad += out[r * ld + c] != (c < n ? yh[r * ld + c] + b[c] : yh[r * ld + c]);
    KT_CHECK(bad == 0, "bias rows: %ld values wrong", bad);
    cudaFree(dy);
    cudaFree(db);
    free(yh);
    free(b);
    free(out);
}

static char *temp_gguf(void)
{
    char *p = strdup("/tmp/kv-test-gpu-XXXXXX");
    int fd = p ? mkstemp(p) : -1;
    if (fd >= 0) close(fd);
    return p;
}

/* m written as a GGUF of wtype (a ggml number) and opened again. */
static kv_model *converted(const kv_model *m, const kv_tokenizer *t, uint32_t wtype, const char *arch,
                           uint64_t bias_seed, char **path)
{
    kv_convert_opts o;
    kv_convert_opts_default(&o);
    o.wtype = wtype;
    if (arch) o.arch = arch;
    o.bias_seed = bias_seed;
    *path = temp_gguf();
    kv_model *r = NULL;
    if (!*path || kv_convert_model(m, t, NULL, &o, *path, NULL) || kv_model_open(*path, &r)) return NULL;
    return r;
}

/* Logits of the CPU engine after prompt (n), with or without the model's
 * q/k/v biases: how far the biases move them (the test below must be able
 * to tell). */
static double bias_effect(kv_model *m, const int *prompt, int n)
{
    const int V = m->cfg.vocab_size, L = m->cfg.n_layers;
    float *a = malloc((size_t)V * 4), *b = malloc((size_t)V * 4);
    const float **keep = calloc((size_t)3 * L, sizeof *keep);
    kv_engine *e = NULL;
    double d = 0;
    if (a && b && keep && !kv_engine_new(m, NULL, n + 1, &e) && !kv_engine_prefill(e, prompt, n, a)) {
        for (int l = 0; l < L; l++) {
            kv_layer_weights *lw = &m->layers[l];
            keep[3 * l] = lw->wq.bias, keep[3 * l + 1] = lw->wk.bias, keep[3 * l + 2] = lw->wv.bias;
            lw->wq.bias = lw->wk.bias = lw->wv.bias = NULL;
        }
        if (!kv_engine_reset(e, NULL) && !kv_engine_prefill(e, prompt, n, b)) d = nerr_f(b, a, (size_t)V);
        for (int l = 0; l < L; l++) {
            kv_layer_weights *lw = &m->layers[l];
            lw->wq.bias = keep[3 * l], lw->wk.bias = keep[3 * l + 1], lw->wv.bias = keep[3 * l + 2];
        }
    }
    kv_engine_free(e);
    free(keep);
    free(a);
    free(b);
    return d;
}

/* The GPU engine on m against the CPU engine on ref (m itself, or its exact
 * float32 conversion), same tokens, logits per step; prefill_chunk as
 * opts.prefill_chunk (0 default, < 0 one token at a time). */
static void run_against_cpu(const char *label, const kv_model *m, const kv_model *ref, int n, int steps,
                            int chunk, kv_dtype wtype, double tol)
{
    const int V = m->cfg.vocab_size;
    int *prompt = malloc((size_t)n * sizeof(int));
    prompt[0] = 1;
    for (int i = 1; i < n; i++) prompt[i] = 3 + (int)(kt_rand(&seed) * (V - 3));
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    o.prefill_chunk = chunk;
    o.wtype = wtype;
    kv_engine *cpu = NULL;
    kv_gpu_engine *gpu = NULL;
    OK(kv_engine_new(ref, NULL, n + steps + 1, &cpu));
    kv_status st = kv_gpu_engine_new(m, NULL, n + steps + 1, &o, &gpu);
    KT_CHECK(st == KV_OK, "%s: %s", label, kv_errdetail());
    if (gpu) {
        cmp_result r;
        compare_engines(cpu, gpu, prompt, n, steps, V, &r);
        printf("# %s (prefill chunk %d): %d steps, max logit error %.3g, argmax differences %d, %llu weight bytes\n",
               label, chunk, r.steps, r.max_err, r.argmax_diff, (unsigned long long)kv_gpu_engine_weight_bytes(gpu));
        KT_CHECK(r.steps == steps + 1, "%s: %d steps", label, r.steps);
        KT_CHECK(r.max_err < tol, "%s: logits normalized error %g", label, r.max_err);
        KT_CHECK(r.argmax_diff == 0, "%s: %d greedy tokens differ", label, r.argmax_diff);
    }
    kv_gpu_engine_free(gpu);
    kv_engine_free(cpu);
    free(prompt);
}

/* qwen2's q/k/v biases (stories260K-qwen2-bf16.gguf, bf16 weights, head_dim 8:
 * the token-by-token prefill) and its NEOX row order, on the GPU. */
static void test_qwen2_biases_match_cpu(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K-qwen2-bf16.gguf", &m));
    KT_REQUIRE(m->layers[0].wq.bias && m->layers[0].wq.perm, "the fixture has biases and a NEOX permutation");
    int prompt[24];
    for (int i = 0; i < 24; i++) prompt[i] = i ? 30 + (int)(kt_rand(&seed) * 400) : 1;
    /* 1e-2: the CPU rounds the input of a BF16 product to BF16, as
     * llama.cpp does (lib/model/kv_matmul.c); the GPU GEMV keeps it float
     * (5.6e-3 measured over 121 steps on the H200, 2026-12-01) */
    const double tol = 1e-2, eff = bias_effect(m, prompt, 24);
    printf("# qwen2 biases move the CPU logits by %.3g (normalized)\n", eff);
    KT_CHECK(eff > 2 * tol, "the biases matter more than the tolerance (%g)", eff);
    run_against_cpu("stories260K qwen2 bf16", m, m, 24, short_run() ? 40 : 120, 0, KV_DT_AUTO, tol);
    run_against_cpu("stories260K qwen2 bf16 as f16", m, m, 24, 40, 0, KV_DT_F16, tol);
    kv_model_close(m);
}

/*
 * Heads wider than dim / n_heads (Mistral-Nemo's shape: 4 heads of 64 on a
 * width of 128): the synthetic geometry as it is, and written as a qwen2
 * GGUF in F16 with q/k/v biases, on the GPU (head_dim 64: the chunked
 * prefill, in chunks smaller than the prompt, and the token-by-token one).
 */
static void test_wide_heads_match_cpu(void)
{
    kv_model *syn = NULL, *q = NULL;
    kv_tokenizer *t = NULL;
    OK(kv_model_synthetic("tiny-wide-heads", 5, KV_DT_F32, &syn));
    KT_REQUIRE(syn->cfg.n_heads * syn->cfg.head_dim > syn->cfg.dim, "wide heads");
    run_against_cpu("tiny-wide-heads", syn, syn, 40, 40, 16, KV_DT_AUTO, 5e-3);
    run_against_cpu("tiny-wide-heads", syn, syn, 40, 40, -1, KV_DT_AUTO, 5e-3);
    OK(kv_tokenizer_load_llama2c(S260 "tok512.bin", 512, &t));
    char *path = NULL;
    q = converted(syn, t, KV_GGML_F16, "qwen2", 11, &path);
    KT_REQUIRE(q && q->layers[1].wk.bias && q->layers[1].wk.perm, "qwen2 conversion: %s", kv_errdetail());
    int prompt[40];
    for (int i = 0; i < 40; i++) prompt[i] = i ? 3 + (int)(kt_rand(&seed) * 500) : 1;
    double eff = bias_effect(q, prompt, 40);
    printf("# tiny-wide-heads qwen2: the biases move the CPU logits by %.3g\n", eff);
    KT_CHECK(eff > 1e-2, "the biases matter more than the tolerance (%g)", eff);
    run_against_cpu("tiny-wide-heads qwen2 f16 + biases", q, q, 40, 40, 16, KV_DT_AUTO, 5e-3);
    run_against_cpu("tiny-wide-heads qwen2 f16 + biases", q, q, 40, 40, -1, KV_DT_AUTO, 5e-3);
    kv_model_close(q);
    kv_model_close(syn);
    kv_tokenizer_free(t);
    if (path) unlink(path);
    free(path);
}

/*
 * Packed weights through the whole engine: niah4k in Q4_K (the bundled
 * fixture), Q6_K and Q8_0 (converted here), a Q4_K_M-like mix (Q6_K wv and
 * w_down in Q4_K layers), and stories260K Q8_0 (its w_down is F16: packed and
 * 16-bit groups in one layer), each against the CPU engine on the model's
 * exact float32 conversion (so that only the GPU's own rounding differs:
 * fp16 K/V, the prefill's fp16 GEMMs), through the chunked and the
 * token-by-token prefill.  The packed engine must hold the packed bytes:
 * at most max_ratio of the same model converted to fp16 (Q4_K 0.28, Q6_K
 * 0.41, Q8_0 0.53 of fp16 per value).
 */
static void check_packed_model(const char *label, const kv_model *m, int n, int steps, double max_ratio)
{
    char *path = NULL;
    kv_model *f32 = converted(m, NULL, KV_GGML_F32, NULL, 0, &path);
    KT_REQUIRE(f32, "%s: float32 conversion: %s", label, kv_errdetail());
    run_against_cpu(label, m, f32, n, steps, 0, KV_DT_AUTO, 5e-3);
    run_against_cpu(label, m, f32, n, steps / 2, -1, KV_DT_AUTO, 5e-3);
    kv_gpu_engine *a = NULL, *b = NULL;
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    OK(kv_gpu_engine_new(m, NULL, 64, &o, &a));
    o.wtype = KV_DT_F16;
    OK(kv_gpu_engine_new(m, NULL, 64, &o, &b));
    uint64_t pa = kv_gpu_engine_weight_bytes(a), pb = kv_gpu_engine_weight_bytes(b);
    printf("# %s: %llu weight bytes packed, %llu as fp16\n", label, (unsigned long long)pa, (unsigned long long)pb);
    KT_CHECK(pa < max_ratio * (double)pb, "%s: packed %llu bytes, fp16 %llu (at most %.2f of it expected)", label,
             (unsigned long long)pa, (unsigned long long)pb, max_ratio);
    kv_gpu_engine_free(a);
    kv_gpu_engine_free(b);
    kv_model_close(f32);
    unlink(path);
    free(path);
}

static void test_packed_models_match_cpu(void)
{
    kv_model *q4 = NULL, *bin = NULL, *q6 = NULL, *q8 = NULL, *s8 = NULL;
    kv_tokenizer *t = NULL;
    char *p6 = NULL, *p8 = NULL;
    OK(kv_model_open(NIAH "niah4k-q4_k.gguf", &q4));
    KT_REQUIRE(q4->layers[0].wq.type == KV_DT_Q4_K && q4->tok_embd.type == KV_DT_Q4_K, "niah4k Q4_K");
    check_packed_model("niah4k Q4_K", q4, 200, 30, 0.3);
    OK(kv_model_open(NIAH "niah4k.bin", &bin));
    OK(kv_tokenizer_load_llama2c(NIAH "tok259.bin", bin->cfg.vocab_size, &t));
    q6 = converted(bin, t, KV_GGML_Q6_K, NULL, 0, &p6);
    q8 = converted(bin, t, KV_GGML_Q8_0, NULL, 0, &p8);
    KT_REQUIRE(q6 && q8 && q6->layers[2].w_down.type == KV_DT_Q6_K && q8->layers[2].wq.type == KV_DT_Q8_0,
               "Q6_K and Q8_0 conversions: %s", kv_errdetail());
    check_packed_model("niah4k Q6_K", q6, 200, 30, 0.43);
    check_packed_model("niah4k Q8_0", q8, 200, 30, 0.55);
    /* Q4_K_M's mix: some matrices of a Q4_K layer in Q6_K */
    for (int l = 0; l < q4->cfg.n_layers; l += 2) {
        q4->layers[l].wv = q6->layers[l].wv;
        q4->layers[l].w_down = q6->layers[l].w_down;
    }
    check_packed_model("niah4k Q4_K with Q6_K wv and w_down", q4, 200, 30, 0.41);
    OK(kv_model_open(S260 "stories260K-q8_0.gguf", &s8));
    KT_REQUIRE(s8->layers[0].wq.type == KV_DT_Q8_0 && s8->layers[0].w_down.type == KV_DT_F16, "stories260K Q8_0 (+F16)");
    check_packed_model("stories260K Q8_0 + F16", s8, 24, 60, 0.66);
    kv_model_close(s8);
    kv_model_close(q4);
    kv_model_close(q8);
    kv_model_close(q6);
    kv_model_close(bin);
    kv_tokenizer_free(t);
    if (p6) unlink(p6);
    if (p8) unlink(p8);
    free(p6);
    free(p8);
}

static void test_bad_requests_fail_cleanly(void)
{
    kv_model *m = NULL;
    OK(kv_model_synthetic("tiny", 3, KV_DT_F32, &m));
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    o.device = 99;
    kv_gpu_engine *g = NULL;
    kv_status st = kv_gpu_engine_new(m, NULL, 64, &o, &g);
    KT_CHECK(st == KV_E_UNAVAILABLE && !g, "absent device: status %d", (int)st);
    o.device = 0;
    o.pdl = 3;
    st = kv_gpu_engine_new(m, NULL, 64, &o, &g);
    KT_CHECK(st == KV_E_USAGE && !g, "PDL level 3: status %d", (int)st);
    kv_policy_params *pp = calloc((size_t)m->cfg.n_layers, sizeof *pp);
    OK(kv_policy_parse("*=dsq:keep=0.5", m->cfg.n_layers, pp));
    st = kv_gpu_engine_new(m, pp, 64, NULL, &g);
    KT_CHECK(st == KV_E_UNSUPPORTED && !g, "dsq with HCAP: status %d", (int)st);
    OK(kv_policy_parse("*=dsq", m->cfg.n_layers, pp)); /* the default: kbits 4, vbits 2 */
    st = kv_gpu_engine_new(m, pp, 64, NULL, &g);
    KT_CHECK(st == KV_OK && g, "dsq kbits 4, vbits 2: %s", kv_errdetail());
    kv_gpu_engine_free(g);
    g = NULL;
    OK(kv_policy_parse("*=dsq:window=64,bits=4", m->cfg.n_layers, pp));
    st = kv_gpu_engine_new(m, pp, 64, NULL, &g);
    KT_CHECK(st == KV_OK && g, "dsq: %s", kv_errdetail());
    kv_gpu_engine_free(g);
    g = NULL;
    OK(kv_policy_parse("*=quant:bits=1", m->cfg.n_layers, pp)); /* head_dim 16 */
    st = kv_gpu_engine_new(m, pp, 64, NULL, &g);
    KT_CHECK(st == KV_OK && g, "quant at head_dim 16: %s", kv_errdetail());
    kv_gpu_engine_free(g);
    g = NULL;
    OK(kv_policy_parse("*=streaming:window=4", m->cfg.n_layers, pp));
    pp[1].window = 0;
    st = kv_gpu_engine_new(m, pp, 64, NULL, &g);
    KT_CHECK(st == KV_E_USAGE && !g, "streaming with no window: status %d", (int)st);
    OK(kv_gpu_engine_new(m, NULL, 8, NULL, &g));
    int toks[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    st = kv_gpu_engine_prefill(g, toks, 9, NULL);
    KT_CHECK(st == KV_E_USAGE, "prompt past the context: status %d", (int)st);
    toks[2] = 100000;
    st = kv_gpu_engine_prefill(g, toks, 3, NULL);
    KT_CHECK(st == KV_E_DATA, "bad token: status %d", (int)st);
    kv_gpu_engine_free(g);
    free(pp);
    kv_model_close(m);
}

#endif /* KV_HAVE_CUDA */

#ifdef KV_HAVE_CUDA
/* Does test name contain one of filter's comma-separated parts (no filter: yes)? */
static int selected(const char *name, const char *filter)
{
    if (!filter || !*filter) return 1;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", filter);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
        if (strstr(name, t)) return 1;
    return 0;
}
#endif

int main(void)
{
    char name[256];
    int ndev = kv_gpu_probe(name, sizeof name);
    if (ndev <= 0) {
        printf("# no usable GPU (%s): GPU tests skipped\n", name);
        KT_RUN(test_engine_refuses_without_gpu);
        const char *why = "no usable GPU";
        KT_SKIP(test_gemv_matches_float64, why);
        KT_SKIP(test_attend_matches_float64, why);
        KT_SKIP(test_topk_selects_largest_with_ties_to_lower_index, why);
        KT_SKIP(test_selection_ranks_nan_and_inf_as_the_cpu_does, why);
        KT_SKIP(test_rmsnorm_swiglu_rope_match_float64, why);
        KT_SKIP(test_selection_kernels_match_float64, why);
        KT_SKIP(test_resident_and_page_kernels_match_cpu, why);
        KT_SKIP(test_kivi_expand_matches_cpu_unpack, why);
        KT_SKIP(test_attn_importance_matches_float64, why);
        KT_SKIP(test_stories260k_full_matches_cpu, why);
        KT_SKIP(test_stories260k_streaming_matches_cpu, why);
        KT_SKIP(test_stories260k_quant_matches_cpu, why);
        KT_SKIP(test_stories260k_dsq_matches_cpu, why);
        KT_SKIP(test_offload_equals_full_on_gpu, why);
        KT_SKIP(test_pdl_levels_generate_the_same_ids, why);
        KT_SKIP(test_niah4k_full_matches_cpu, why);
        KT_SKIP(test_niah4k_sparse_matches_cpu, why);
        KT_SKIP(test_niah4k_resident_and_pages_match_cpu, why);
        KT_SKIP(test_sparse_step_variants_match_the_serial_path, why);
        KT_SKIP(test_niah4k_sketch_runs_close_to_full, why);
        KT_SKIP(test_niah4k_quant_matches_cpu, why);
        KT_SKIP(test_niah4k_streaming_matches_cpu, why);
        KT_SKIP(test_niah4k_dsq_matches_cpu, why);
        KT_SKIP(test_niah4k_gpu_dump_matches_cpu_dump, why);
        KT_SKIP(test_sparse_chunk_copies_equal_the_layer_copy, why);
        KT_SKIP(test_niah4k_dsq_salient_choice_differs_only_at_near_ties, why);
        KT_SKIP(test_hybrid_bytes_follow_the_layout, why);
        KT_SKIP(test_nonfinite_weights_on_every_gpu_policy, why);
        KT_SKIP(test_bad_requests_fail_cleanly, why);
        KT_SKIP(test_packed_kernels_match_cpu_reference, why);
        KT_SKIP(test_qwen2_biases_match_cpu, why);
        KT_SKIP(test_wide_heads_match_cpu, why);
        KT_SKIP(test_packed_models_match_cpu, why);
        return kt_done();
    }
#ifdef KV_HAVE_CUDA
    printf("# GPU: %s\n", name);
    /* KV_TEST_FILTER=a,b runs only the tests whose names contain a or b
     * (e.g. under compute-sanitizer) */
    const char *filter = getenv("KV_TEST_FILTER");
#define RUN_ONE(t)                               \
    if (selected(#t, filter)) KT_RUN(t);         \
    else KT_SKIP(t, "not selected by KV_TEST_FILTER")
    RUN_ONE(test_gemv_matches_float64);
    RUN_ONE(test_attend_matches_float64);
    RUN_ONE(test_topk_selects_largest_with_ties_to_lower_index);
    RUN_ONE(test_selection_ranks_nan_and_inf_as_the_cpu_does);
    RUN_ONE(test_rmsnorm_swiglu_rope_match_float64);
    RUN_ONE(test_selection_kernels_match_float64);
    RUN_ONE(test_resident_and_page_kernels_match_cpu);
    RUN_ONE(test_kivi_expand_matches_cpu_unpack);
    RUN_ONE(test_attn_importance_matches_float64);
    RUN_ONE(test_stories260k_full_matches_cpu);
    RUN_ONE(test_stories260k_streaming_matches_cpu);
    RUN_ONE(test_stories260k_quant_matches_cpu);
    RUN_ONE(test_stories260k_dsq_matches_cpu);
    RUN_ONE(test_offload_equals_full_on_gpu);
    RUN_ONE(test_pdl_levels_generate_the_same_ids);
    RUN_ONE(test_niah4k_full_matches_cpu);
    RUN_ONE(test_niah4k_sparse_matches_cpu);
    RUN_ONE(test_niah4k_resident_and_pages_match_cpu);
    RUN_ONE(test_sparse_step_variants_match_the_serial_path);
    RUN_ONE(test_niah4k_sketch_runs_close_to_full);
    RUN_ONE(test_niah4k_quant_matches_cpu);
    RUN_ONE(test_niah4k_streaming_matches_cpu);
    RUN_ONE(test_niah4k_dsq_matches_cpu);
    RUN_ONE(test_niah4k_gpu_dump_matches_cpu_dump);
    RUN_ONE(test_sparse_chunk_copies_equal_the_layer_copy);
    RUN_ONE(test_niah4k_dsq_salient_choice_differs_only_at_near_ties);
    RUN_ONE(test_hybrid_bytes_follow_the_layout);
    RUN_ONE(test_nonfinite_weights_on_every_gpu_policy);
    RUN_ONE(test_bad_requests_fail_cleanly);
    RUN_ONE(test_packed_kernels_match_cpu_reference);
    RUN_ONE(test_qwen2_biases_match_cpu);
    RUN_ONE(test_wide_heads_match_cpu);
    RUN_ONE(test_packed_models_match_cpu);
#endif
    return kt_done();
}
