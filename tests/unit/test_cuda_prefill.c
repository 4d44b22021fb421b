/*
 * The chunked-prefill kernels against their CPU references by normalized
 * error ||gpu - ref|| / ||ref||, on fresh random data every run (seed
 * printed; KT_SEED repeats it): the causal flash attention of a chunk
 * (kernels/prefill_attn.cu, every tile variant, fp16, bf16 and fp16 in/bf16
 * out, head_dim 64 and 128, GQA groups 1 to 8, chunks starting past cached
 * keys) against kv_attn_prefill; the row kernels (RMSNorm, RoPE with Llama-3
 * frequency scaling and the cache store, SwiGLU) against the CPU engine's
 * formulas; cuBLAS products against a plain loop; and one whole layer
 * (kv_gpu_prefill_layer) run in several chunks against a float32 CPU layer,
 * and the whole chunked prefill of niah4k (kv_gpu_prefill_model) against the
 * CPU engine's (last logits, every layer's K/V, the greedy token).
 * Outputs are poisoned before each launch so that an unwritten element
 * fails.  The first two tests (the CPU reference against a float64 one,
 * and the padded products' row count) run everywhere; the rest are TAP
 * skips without a usable GPU.  The layer test runs again with its last
 * chunk's products padded to 16 rows (kv_pf_ws.pad).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kt.h"
#include "attn/kv_attn.h"
#include "common/kv_half.h"
#include "gpu/kv_gpu.h"
#include "gpu/kv_gpu_prefill.h"
#include "model/kv_model.h"
#include "model/kv_matmul.h"
#include "engine/kv_engine.h"

static unsigned long long seed;

static double nerr(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        if (a[i] != a[i]) return INFINITY; /* NaN: an unwritten or broken element */
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void randn(float *x, size_t n, float sd)
{
    for (size_t i = 0; i < n; i++) x[i] = sd * kt_randn(&seed);
}

/* The CPU reference against a float64 computation of the same attention. */
static void test_prefill_reference_matches_float64(void)
{
    const int H = 6, G = 2, D = 16, p0 = 37, n = 29, Tk = p0 + n;
    kv_attn_prefill_dims d = {H, G, D, p0, n, H * D + 3, H * D, (long)(Tk + 5) * D, 0.25f};
    float *q = malloc((size_t)n * d.ldq * 4), *k = malloc((size_t)G * d.kv_stride * 4);
    float *v = malloc((size_t)G * d.kv_stride * 4), *o = malloc((size_t)n * d.ldo * 4);
    float *ref = malloc((size_t)n * d.ldo * 4);
    randn(q, (size_t)n * d.ldq, 1.0f);
    randn(k, (size_t)G * d.kv_stride, 1.0f);
    randn(v, (size_t)G * d.kv_stride, 1.0f);
    KT_REQUIRE(kv_attn_prefill(&d, q, k, v, o) == KV_OK, "%s", kv_errdetail());
    for (int i = 0; i < n; i++)
        for (int h = 0; h < H; h++) {
            const float *qv = q + (size_t)i * d.ldq + (size_t)h * D;
            const float *K = k + (size_t)(h / (H / G)) * d.kv_stride;
            const float *V = v + (size_t)(h / (H / G)) * d.kv_stride;
            int ns = p0 + i + 1;
            double mx = -INFINITY, *s = malloc((size_t)ns * sizeof(double)), sum = 0;
            for (int t = 0; t < ns; t++) {
                double a = 0;
                for (int c = 0; c < D; c++) a += (double)qv[c] * K[(size_t)t * D + c];
                s[t] = a * d.scale;
                mx = s[t] > mx ? s[t] : mx;
            }
            for (int t = 0; t < ns; t++) sum += (s[t] = exp(s[t] - mx));
            for (int c = 0; c < D; c++) {
                double acc = 0;
                for (int t = 0; t < ns; t++) acc += s[t] * V[(size_t)t * D + c];
                ref[(size_t)i * d.ldo + (size_t)h * D + c] = (float)(acc / sum);
            }
            free(s);
        }
    double e = nerr(o, ref, (size_t)n * d.ldo);
    KT_CHECK(e < 1e-5, "float32 reference vs float64: %.3g", e);
    /* a query never sees a later key: changing the last cached key moves
     * only the last row */
    float *o2 = malloc((size_t)n * d.ldo * 4);
    for (int g = 0; g < G; g++) k[(size_t)g * d.kv_stride + (size_t)(Tk - 1) * D] += 3.0f;
    KT_REQUIRE(kv_attn_prefill(&d, q, k, v, o2) == KV_OK, "%s", kv_errdetail());
    KT_CHECK(memcmp(o, o2, (size_t)(n - 1) * d.ldo * 4) == 0, "rows before the last changed");
    KT_CHECK(memcmp(o + (size_t)(n - 1) * d.ldo, o2 + (size_t)(n - 1) * d.ldo, (size_t)d.ldo * 4),
             "the last row did not change");
    d.n_heads = 5;
    KT_CHECK(kv_attn_prefill(&d, q, k, v, o) == KV_E_USAGE, "5 heads over 2 KV heads accepted");
    free(q), free(k), free(v), free(o), free(o2), free(ref);
}

#ifdef KV_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "gpu/kv_cublas.h"
#include "gpu/kv_gpu_prefill.h"
#include "kv_kernels.h"
#include "prefill_ops.h"

/* Normalized-error tolerances: the probabilities and outputs are rounded to
 * the 16-bit type for the tensor cores (relative 2^-11 for fp16, 2^-8 for
 * bf16 per term), accumulation is float32. */
#define TOL_ATT_F16 2e-3
#define TOL_ATT_BF16 1.2e-2

static int cuda_ok(cudaError_t e) { return e == cudaSuccess; }

static void *dalloc(size_t n)
{
    void *p = NULL;
    return cudaMalloc(&p, n ? n : 1) == cudaSuccess ? p : NULL;
}

static uint16_t to16(float x, int bf) { return bf ? kv_f32_to_bf16(x) : kv_f32_to_half(x); }
static float from16(uint16_t x, int bf) { return bf ? kv_bf16_to_f32(x) : kv_half_to_f32(x); }

/* x rounded to the 16-bit type in place; the bits into h. */
static void round16(float *x, uint16_t *h, size_t n, int bf)
{
    for (size_t i = 0; i < n; i++) {
        h[i] = to16(x[i], bf);
        x[i] = from16(h[i], bf);
    }
}

static cudaError_t upload(void *d, const void *h, size_t n)
{
    return cudaMemcpy(d, h, n, cudaMemcpyHostToDevice);
}

/* Is name one of the comma-separated list's entries? */
static int name_listed(const char *list, const char *name)
{
    const size_t n = strlen(name);
    for (const char *p = list; p && *p;) {
        const char *e = strchr(p, ',');
        const size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && !strncmp(p, name, n)) return 1;
        p = e ? e + 1 : NULL;
    }
    return 0;
}

/* One attention case on the GPU against kv_attn_prefill; returns the error
 * (INFINITY when something was left unwritten or failed). */
static double attn_case(int dt, int variant, int H, int G, int D, int p0, int n, char *why,
                        size_t nwhy)
{
    const int bf_in = dt == 1, bf_out = dt >= 1, Tk = p0 + n;
    const long ldq = (long)H * D + 8, ldo = (long)H * D + 16, kvs = (long)(Tk + 24) * D;
    kv_attn_prefill_dims rd = {H, G, D, p0, n, ldq, ldo, kvs, 1.0f / sqrtf((float)D)};
    size_t nq = (size_t)n * ldq, nkv = (size_t)G * kvs, no = (size_t)n * ldo;
    float *q = malloc(nq * 4), *k = malloc(nkv * 4), *v = malloc(nkv * 4), *ref = malloc(no * 4);
    float *got = malloc(no * 4);
    uint16_t *hq = malloc(nq * 2), *hk = malloc(nkv * 2), *hv = malloc(nkv * 2), *ho = malloc(no * 2);
    randn(q, nq, 1.0f);
    randn(k, nkv, 1.0f);
    randn(v, nkv, 1.0f);
    /* a few large key channels and a far-off query (real keys have them;
     * they stress the running maximum) */
    for (size_t i = 0; i < nkv; i += (size_t)D) k[i + 5] *= 6.0f;
    for (size_t i = 0; i < nq; i += (size_t)ldq) q[i + 5] *= 3.0f;
    round16(q, hq, nq, bf_in);
    round16(k, hk, nkv, bf_in);
    round16(v, hv, nkv, bf_in);
    double err = INFINITY;
    void *dq = dalloc(nq * 2), *dk = dalloc(nkv * 2), *dv = dalloc(nkv * 2), *dout = dalloc(no * 2);
    if (kv_attn_prefill(&rd, q, k, v, ref) != KV_OK) {
        snprintf(why, nwhy, "reference: %s", kv_errdetail());
    } else if (!dq || !dk || !dv || !dout || !cuda_ok(upload(dq, hq, nq * 2)) ||
               !cuda_ok(upload(dk, hk, nkv * 2)) || !cuda_ok(upload(dv, hv, nkv * 2)) ||
               !cuda_ok(cudaMemset(dout, 0xFF, no * 2))) { /* NaN in both types */
        snprintf(why, nwhy, "device setup failed");
    } else {
        pf_attn_args a = {dq, dk, dv, dout, ldq, ldo, kvs, H, G, D, p0, n, rd.scale};
        cudaError_t e = pf_attn(&a, bf_in ? PF_BF16 : PF_F16, bf_out ? PF_BF16 : PF_F16, variant, 0);
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
        if (e == cudaErrorNotSupported) { /* a wgmma tile on a GPU other than Hopper */
            (void)cudaGetLastError();
            err = 0;
            snprintf(why, nwhy, "not on this GPU");
        } else if (e != cudaSuccess || !cuda_ok(cudaMemcpy(ho, dout, no * 2, cudaMemcpyDeviceToHost))) {
            snprintf(why, nwhy, "launch: %s (%s)", cudaGetErrorString(e), kv_cuda_last_error());
        } else {
            size_t bad_pad = 0;
            for (int i = 0; i < n; i++)
                for (long c = 0; c < ldo; c++) {
                    size_t j = (size_t)i * ldo + c;
                    if (c < (long)H * D) {
                        got[j] = from16(ho[j], bf_out);
                    } else {
                        got[j] = ref[j] = 0; /* padding: must stay poisoned */
                        bad_pad += ho[j] != 0xFFFF;
                    }
                }
            err = bad_pad ? INFINITY : nerr(got, ref, no);
            snprintf(why, nwhy, "error %.3g%s", err, bad_pad ? ", padding overwritten" : "");
        }
    }
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dout);
    free(q), free(k), free(v), free(ref), free(got), free(hq), free(hk), free(hv), free(ho);
    return err;
}

static void test_prefill_attention_matches_cpu(void)
{
    static const char *const dname[3] = {"f16", "bf16", "f16->bf16"};
    /* (H, G, D, p0, n): one chunk from 0, chunks past cached keys, a single
     * query, rows not a multiple of any tile, GQA 1, 4 and 8 */
    static const int cases[][5] = {
        {4, 1, 128, 0, 300},  {8, 2, 128, 517, 190}, {8, 1, 64, 1000, 1},  {4, 4, 64, 0, 77},
        {16, 2, 128, 96, 64}, {8, 2, 64, 31, 257},   {4, 2, 128, 2048, 33},
    };
    char why[256];
    double worst[3] = {0, 0, 0};
    /* KV_TEST_SHORT (under the sanitizers): the device's default kernel and
     * the mma.sync one (variants 0 and 1), three cases; KV_TEST_VARIANTS
     * (comma-separated names, "auto" for 0) adds others to the short run */
    const int short_run = getenv("KV_TEST_SHORT") != NULL;
    const char *extra = getenv("KV_TEST_VARIANTS");
    const int nvar = pf_attn_variants();
    const size_t ncase = short_run ? 3 : sizeof cases / sizeof cases[0];
    int ran = 0;
    for (int dt = 0; dt < 3; dt++)
        for (int vi = 0; vi < nvar; vi++) {
            if (short_run && vi > 1 && !name_listed(extra, pf_attn_variant_name(vi))) continue;
            ran += dt == 0;
            for (size_t c = 0; c < ncase; c++) {
                const int *p = cases[c];
                double e = attn_case(dt, vi, p[0], p[1], p[2], p[3], p[4], why, sizeof why);
                double tol = dt == 0 ? TOL_ATT_F16 : TOL_ATT_BF16;
                KT_CHECK(e < tol, "%s %s H %d G %d D %d p0 %d n %d: %s", dname[dt],
                         pf_attn_variant_name(vi), p[0], p[1], p[2], p[3], p[4], why);
                if (e > worst[dt]) worst[dt] = e;
            }
        }
    printf("# prefill attention worst normalized error: f16 %.3g, bf16 %.3g, f16->bf16 %.3g "
           "(%d of %d variants)\n", worst[0], worst[1], worst[2], ran, pf_attn_variants());
}

/* A chunk split into pieces gives the same output rows as one launch, and
 * the kernel refuses geometries it does not cover. */
static void test_prefill_attention_chunks_agree_and_bad_arguments_fail(void)
{
    const int H = 8, G = 2, D = 128, T = 640;
    const long ld = (long)H * D, kvs = (long)T * D;
    size_t nq = (size_t)T * ld, nkv = (size_t)G * kvs;
    float *f = malloc((nq > nkv ? nq : nkv) * 4);
    uint16_t *h = malloc(nq * 2), *o1 = malloc(nq * 2), *o2 = malloc(nq * 2);
    void *dq = dalloc(nq * 2), *dk = dalloc(nkv * 2), *dv = dalloc(nkv * 2);
    void *d1 = dalloc(nq * 2), *d2 = dalloc(nq * 2);
    KT_REQUIRE(dq && dk && dv && d1 && d2, "device allocation");
    randn(f, nq, 1.0f), round16(f, h, nq, 0), upload(dq, h, nq * 2);
    randn(f, nkv, 1.0f), round16(f, h, nkv, 0), upload(dk, h, nkv * 2);
    randn(f, nkv, 1.0f), round16(f, h, nkv, 0), upload(dv, h, nkv * 2);
    cudaMemset(d1, 0xFF, nq * 2), cudaMemset(d2, 0xFF, nq * 2);
    pf_attn_args a = {dq, dk, dv, d1, ld, ld, kvs, H, G, D, 0, T, 1.0f / sqrtf((float)D)};
    KT_CHECK(pf_attn(&a, PF_F16, PF_F16, 0, 0) == cudaSuccess, "whole: %s", kv_cuda_last_error());
    static const int cut[] = {0, 1, 129, 130, 400, 640};
    for (int i = 0; i + 1 < 6; i++) {
        pf_attn_args b = a;
        b.q = (const uint16_t *)dq + (size_t)cut[i] * ld;
        b.o = (uint16_t *)d2 + (size_t)cut[i] * ld;
        b.p0 = cut[i];
        b.n = cut[i + 1] - cut[i];
        KT_CHECK(pf_attn(&b, PF_F16, PF_F16, 0, 0) == cudaSuccess, "chunk %d", i);
    }
    KT_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "sync");
    cudaMemcpy(o1, d1, nq * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(o2, d2, nq * 2, cudaMemcpyDeviceToHost);
    /* the same tiles over the same keys: equal up to rounding (the first
     * device run found 7 of 655,360 outputs one unit apart), all written */
    size_t unwritten = 0, diff = 0;
    float *a1 = malloc(nq * 4), *a2 = malloc(nq * 4);
    for (size_t i = 0; i < nq; i++) {
        unwritten += o1[i] == 0xFFFF || o2[i] == 0xFFFF;
        diff += o1[i] != o2[i];
        a1[i] = kv_half_to_f32(o1[i]), a2[i] = kv_half_to_f32(o2[i]);
    }
    double e = nerr(a2, a1, nq);
    KT_CHECK(unwritten == 0 && e < 1e-3, "six chunks vs one launch: error %.3g, %zu unwritten", e, unwritten);
    printf("# six chunks vs one launch: %zu of %zu outputs differ, normalized error %.3g\n", diff, nq, e);
    free(a1), free(a2);
    pf_attn_args bad = a;
    bad.head_dim = 96;
    KT_CHECK(!pf_attn_supported(&bad) && pf_attn(&bad, PF_F16, PF_F16, 0, 0) != cudaSuccess,
             "head_dim 96 accepted");
    bad = a, bad.n_heads = 7;
    KT_CHECK(pf_attn(&bad, PF_F16, PF_F16, 0, 0) != cudaSuccess, "7 heads over 2 accepted");
    bad = a, bad.ldq = ld + 3;
    KT_CHECK(pf_attn(&bad, PF_F16, PF_F16, 0, 0) != cudaSuccess, "unaligned ldq accepted");
    KT_CHECK(pf_attn(&a, PF_BF16, PF_F16, 0, 0) != cudaSuccess, "bf16 in, fp16 out accepted");
    KT_CHECK(pf_attn(&a, PF_F16, PF_F16, pf_attn_variants(), 0) != cudaSuccess, "bad variant accepted");
    (void)cudaGetLastError();
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(d1), cudaFree(d2);
    free(f), free(h), free(o1), free(o2);
}

// --- row kernels --------------------------------------------------------------------

/* The CPU engine's formulas (lib/engine/kv_engine.c). */
static void cpu_rmsnorm(float *o, const float *x, const float *w, int n, float eps)
{
    float ss = 0.0f;
    for (int j = 0; j < n; j++) ss += x[j] * x[j];
    ss /= (float)n;
    ss += eps;
    ss = 1.0f / sqrtf(ss);
    for (int j = 0; j < n; j++) o[j] = w[j] * (ss * x[j]);
}

static void cpu_rope(float *x, int nh, int hd, const float *inv_freq, int pos)
{
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < hd; i += 2) {
            float a = (float)pos * inv_freq[i / 2], c = cosf(a), s = sinf(a);
            float x0 = x[h * hd + i], x1 = x[h * hd + i + 1];
            x[h * hd + i] = x0 * c - x1 * s;
            x[h * hd + i + 1] = x0 * s + x1 * c;
        }
}

static void llama3_freqs(int hd, float *inv)
{
    kv_model_config c;
    memset(&c, 0, sizeof c);
    c.head_dim = hd;
    c.rope_theta = 500000;
    c.rope_scaling = KV_ROPE_SCALING_LLAMA3;
    c.rope_factor = 8, c.rope_low_freq_factor = 1, c.rope_high_freq_factor = 4;
    c.rope_orig_ctx = 8192;
    kv_model_rope_freqs(&c, inv);
}

static void test_prefill_row_kernels_match_cpu(void)
{
    const int n = 37, dim = 200, ld = 208, H = 4, G = 2, hd = 64, hid = 96, p0 = 100000;
    const int qkvw = (H + 2 * G) * hd, ldq = H * hd;
    const long kvs = (long)(p0 + n + 3) * hd;
    float *x = malloc((size_t)n * ld * 4), *w = malloc(dim * 4), *ref = malloc((size_t)n * ld * 4);
    float *qkv = malloc((size_t)n * qkvw * 4), *gu = malloc((size_t)n * 2 * hid * 4);
    float *got = malloc((size_t)n * qkvw * 4), inv[32];
    uint16_t *h16 = malloc((size_t)n * qkvw * 2);
    randn(x, (size_t)n * ld, 3.0f);
    randn(w, dim, 1.0f);
    randn(qkv, (size_t)n * qkvw, 1.0f);
    randn(gu, (size_t)n * 2 * hid, 2.0f);
    llama3_freqs(hd, inv);
    float *dx = dalloc((size_t)n * ld * 4), *dw = dalloc(dim * 4), *dqkv = dalloc((size_t)n * qkvw * 4);
    float *dgu = dalloc((size_t)n * 2 * hid * 4), *dinv = dalloc(sizeof inv);
    void *dout = dalloc((size_t)n * qkvw * 2), *dk = dalloc((size_t)G * kvs * 2);
    void *dv = dalloc((size_t)G * kvs * 2);
    KT_REQUIRE(dx && dw && dqkv && dgu && dinv && dout && dk && dv, "device allocation");
    upload(dx, x, (size_t)n * ld * 4), upload(dw, w, dim * 4), upload(dqkv, qkv, (size_t)n * qkvw * 4);
    upload(dgu, gu, (size_t)n * 2 * hid * 4), upload(dinv, inv, sizeof inv);
    for (int bf = 0; bf < 2; bf++) {
        const pf_dtype t = bf ? PF_BF16 : PF_F16;
        const double tol = bf ? 4e-3 : 5e-4;
        /* RMSNorm */
        cudaMemset(dout, 0xFF, (size_t)n * ld * 2);
        KT_CHECK(pf_rmsnorm_rows(dx, ld, dw, dim, 1e-5f, n, dout, t, ld, 0) == cudaSuccess, "rmsnorm");
        cudaMemcpy(h16, dout, (size_t)n * ld * 2, cudaMemcpyDeviceToHost);
        size_t pad = 0;
        for (int i = 0; i < n; i++) {
            cpu_rmsnorm(ref + (size_t)i * ld, x + (size_t)i * ld, w, dim, 1e-5f);
            for (int c = 0; c < ld; c++) {
                size_t j = (size_t)i * ld + c;
                if (c < dim) got[j] = from16(h16[j], bf);
                else got[j] = ref[j] = 0, pad += h16[j] != 0xFFFF;
            }
        }
        double e = nerr(got, ref, (size_t)n * ld);
        KT_CHECK(e < tol && !pad, "%s rmsnorm: error %.3g, %zu padding written", bf ? "bf16" : "f16", e, pad);
        /* RoPE: q to its buffer, k and v into the caches at rows p0.. */
        cudaMemset(dout, 0xFF, (size_t)n * ldq * 2);
        cudaMemset(dk, 0xFF, (size_t)G * kvs * 2), cudaMemset(dv, 0xFF, (size_t)G * kvs * 2);
        KT_CHECK(pf_rope_rows(dqkv, qkvw, H, G, hd, dinv, p0, n, dout, ldq, dk, dv, kvs, t, 0) ==
                     cudaSuccess, "rope");
        float *r = malloc((size_t)n * qkvw * 4), *g2 = malloc((size_t)n * qkvw * 4);
        memcpy(r, qkv, (size_t)n * qkvw * 4);
        for (int i = 0; i < n; i++) {
            cpu_rope(r + (size_t)i * qkvw, H + G, hd, inv, p0 + i); /* q and k, not v */
        }
        cudaMemcpy(h16, dout, (size_t)n * ldq * 2, cudaMemcpyDeviceToHost);
        for (int i = 0; i < n; i++)
            for (int c = 0; c < ldq; c++) g2[(size_t)i * qkvw + c] = from16(h16[(size_t)i * ldq + c], bf);
        uint16_t *row = malloc((size_t)hd * 2);
        for (int kv = 0; kv < 2; kv++)
            for (int gh = 0; gh < G; gh++)
                for (int i = 0; i < n; i++) {
                    size_t off = ((size_t)gh * kvs + (size_t)(p0 + i) * hd) * 2;
                    cudaMemcpy(row, (char *)(kv ? dv : dk) + off, (size_t)hd * 2, cudaMemcpyDeviceToHost);
                    for (int c = 0; c < hd; c++)
                        g2[(size_t)i * qkvw + (size_t)(H + kv * G + gh) * hd + c] = from16(row[c], bf);
                }
        e = nerr(g2, r, (size_t)n * qkvw);
        KT_CHECK(e < tol, "%s rope at positions %d..: error %.3g", bf ? "bf16" : "f16", p0, e);
        /* rows of the cache before p0 stay untouched */
        cudaMemcpy(row, (char *)dk + (size_t)(p0 - 1) * hd * 2, (size_t)hd * 2, cudaMemcpyDeviceToHost);
        KT_CHECK(row[0] == 0xFFFF && row[hd - 1] == 0xFFFF, "cache row p0-1 written");
        free(row), free(r), free(g2);
        /* SwiGLU over interleaved gate/up */
        cudaMemset(dout, 0xFF, (size_t)n * hid * 2);
        KT_CHECK(pf_swiglu_rows(dgu, 2 * hid, hid, n, dout, t, hid, 0) == cudaSuccess, "swiglu");
        cudaMemcpy(h16, dout, (size_t)n * hid * 2, cudaMemcpyDeviceToHost);
        for (size_t i = 0; i < (size_t)n * hid; i++) {
            float gg = gu[2 * i], u = gu[2 * i + 1];
            gg *= 1.0f / (1.0f + expf(-gg));
            ref[i] = gg * u;
            got[i] = from16(h16[i], bf);
        }
        e = nerr(got, ref, (size_t)n * hid);
        KT_CHECK(e < tol, "%s swiglu: error %.3g", bf ? "bf16" : "f16", e);
    }
    KT_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
    cudaFree(dx), cudaFree(dw), cudaFree(dqkv), cudaFree(dgu), cudaFree(dinv), cudaFree(dout);
    cudaFree(dk), cudaFree(dv);
    free(x), free(w), free(ref), free(qkv), free(gu), free(got), free(h16);
}

// --- cuBLAS and one whole layer ----------------------------------------------------------

static void test_cublas_products_match_cpu(void)
{
    kv_cublas *cb = NULL;
    KT_REQUIRE(kv_cublas_open(&cb) == KV_OK, "%s", kv_errdetail());
    printf("# cuBLAS: %s\n", kv_cublas_where());
    const int n = 45, m = 70, k = 136, ldw = 144, ldx = 152, ldy = 80;
    float *w = malloc((size_t)m * ldw * 4), *x = malloc((size_t)n * ldx * 4);
    float *y0 = malloc((size_t)n * ldy * 4), *ref = malloc((size_t)n * ldy * 4), *got = malloc((size_t)n * ldy * 4);
    uint16_t *hw = malloc((size_t)m * ldw * 2), *hx = malloc((size_t)n * ldx * 2), *hy = malloc((size_t)n * ldy * 2);
    void *dw = dalloc((size_t)m * ldw * 2), *dx = dalloc((size_t)n * ldx * 2), *dy = dalloc((size_t)n * ldy * 4);
    KT_REQUIRE(dw && dx && dy, "device allocation");
    for (int bf = 0; bf < 2; bf++)
        for (int mode = 0; mode < 3; mode++) { /* f32 out, f32 accumulate, 16-bit out */
            randn(w, (size_t)m * ldw, 0.1f), round16(w, hw, (size_t)m * ldw, bf);
            randn(x, (size_t)n * ldx, 1.0f), round16(x, hx, (size_t)n * ldx, bf);
            randn(y0, (size_t)n * ldy, 1.0f);
            upload(dw, hw, (size_t)m * ldw * 2), upload(dx, hx, (size_t)n * ldx * 2);
            upload(dy, y0, (size_t)n * ldy * 4);
            kv_gemm_type xt = bf ? KV_GEMM_BF16 : KV_GEMM_F16;
            kv_gemm_type yt = mode == 2 ? xt : KV_GEMM_F32;
            kv_status st = kv_cublas_gemm(cb, NULL, n, m, k, dw, ldw, dx, ldx, xt, dy, ldy, yt, mode == 1);
            KT_CHECK(st == KV_OK, "gemm: %s", kv_errdetail());
            KT_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "sync");
            for (int i = 0; i < n; i++)
                for (int o = 0; o < ldy; o++) {
                    size_t j = (size_t)i * ldy + o;
                    double a = mode == 1 ? y0[j] : 0;
                    if (o < m)
                        for (int c = 0; c < k; c++) a += (double)x[(size_t)i * ldx + c] * w[(size_t)o * ldw + c];
                    ref[j] = o < m ? (float)a : 0;
                }
            if (mode == 2) {
                cudaMemcpy(hy, dy, (size_t)n * ldy * 2, cudaMemcpyDeviceToHost);
                for (int i = 0; i < n; i++)
                    for (int o = 0; o < ldy; o++)
                        got[(size_t)i * ldy + o] = o < m ? from16(hy[(size_t)i * ldy + o], bf) : 0;
            } else {
                cudaMemcpy(got, dy, (size_t)n * ldy * 4, cudaMemcpyDeviceToHost);
                for (int i = 0; i < n; i++)
                    for (int o = m; o < ldy; o++) got[(size_t)i * ldy + o] = 0;
            }
            double e = nerr(got, ref, (size_t)n * ldy);
            KT_CHECK(e < (mode == 2 ? (bf ? 8e-3 : 1e-3) : 1e-5), "%s mode %d: error %.3g",
                     bf ? "bf16" : "f16", mode, e);
        }
    KT_CHECK(kv_cublas_gemm(cb, NULL, n, m, k, dw, ldw, dx, k - 1, KV_GEMM_F16, dy, ldy, KV_GEMM_F32,
                            false) == KV_E_USAGE, "ldx < k accepted");
    cudaFree(dw), cudaFree(dx), cudaFree(dy);
    free(w), free(x), free(y0), free(ref), free(got), free(hw), free(hx), free(hy);
    kv_cublas_close(cb);
}

/* Layer lw over rows dX (T, g->ld_dim) in chunks of C rows. */
static kv_status layer_chunks(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *lw, const kv_pf_ws *ws,
                              float *dX, int T, int C, void *dk, void *dv, long kvs, const float *dinv)
{
    kv_status st = KV_OK;
    for (int p0 = 0; p0 < T && !st; p0 += C) {
        int nc = T - p0 < C ? T - p0 : C;
        st = kv_gpu_prefill_layer(cb, g, lw, ws, dX + (size_t)p0 * g->ld_dim, p0, nc, dk, dv, kvs, dinv, NULL,
                                  NULL);
    }
    return st;
}

/* One layer of a small model through kv_gpu_prefill_layer in chunks of 48
 * rows, against the same layer in float32 on the CPU over the whole prompt
 * (the CPU engine's order: norm, projections, RoPE, causal attention,
 * residual, norm, SwiGLU, residual), weights rounded to the 16-bit type. */
static void test_prefill_layer_in_chunks_matches_cpu(void)
{
    kv_cublas *cb = NULL;
    KT_REQUIRE(kv_cublas_open(&cb) == KV_OK, "%s", kv_errdetail());
    const int dim = 192, hid = 320, H = 6, G = 2, hd = 64, T = 150, C = 48;
    const int qd = H * hd, kvd = G * hd, ldd = 200, ldq = 384, ldh = 320;
    kv_pf_geom g = {dim, hid, H, G, hd, ldd, ldq, ldh, 1e-5f, 1.0f / sqrtf((float)hd), 0, 0, 0, 0, 0};
    const size_t nqkv = (size_t)(qd + 2 * kvd) * ldd, no = (size_t)dim * ldq;
    const size_t ngu = (size_t)2 * hid * ldd, ndn = (size_t)dim * ldh;
    float *wqkv = calloc(nqkv, 4), *wo = calloc(no, 4), *wgu = calloc(ngu, 4), *wdn = calloc(ndn, 4);
    float *an = malloc(dim * 4), *fn = malloc(dim * 4), inv[32];
    float *X = malloc((size_t)T * ldd * 4), *Xg = malloc((size_t)T * ldd * 4);
    for (int bf = 0; bf < 2; bf++) {
        g.wbf16 = bf;
        for (int kvbf = 0; kvbf <= bf; kvbf++) {
            g.kvbf16 = kvbf;
            uint16_t *h = malloc(nqkv * 2 + no * 2 + ngu * 2 + ndn * 2);
            /* weights of width k live in columns [0, k) of their pitch */
            for (size_t r = 0; r < (size_t)(qd + 2 * kvd); r++) randn(wqkv + r * ldd, dim, 0.08f);
            for (size_t r = 0; r < (size_t)dim; r++) randn(wo + r * ldq, qd, 0.05f);
            for (size_t r = 0; r < (size_t)2 * hid; r++) randn(wgu + r * ldd, dim, 0.08f);
            for (size_t r = 0; r < (size_t)dim; r++) randn(wdn + r * ldh, hid, 0.05f);
            round16(wqkv, h, nqkv, bf);
            round16(wo, h + nqkv, no, bf);
            round16(wgu, h + nqkv + no, ngu, bf);
            round16(wdn, h + nqkv + no + ngu, ndn, bf);
            for (int i = 0; i < dim; i++) an[i] = 1.0f + 0.1f * kt_randn(&seed), fn[i] = 1.0f + 0.1f * kt_randn(&seed);
            llama3_freqs(hd, inv);
            memset(X, 0, (size_t)T * ldd * 4);
            for (int t = 0; t < T; t++) randn(X + (size_t)t * ldd, dim, 1.0f);
            void *dw = dalloc(nqkv * 2 + no * 2 + ngu * 2 + ndn * 2);
            float *dan = dalloc(dim * 4), *dfn = dalloc(dim * 4), *dinv = dalloc(sizeof inv);
            float *dX = dalloc((size_t)T * ldd * 4);
            const long kvs = (long)(T + 10) * hd;
            void *dk = dalloc((size_t)G * kvs * 2), *dv = dalloc((size_t)G * kvs * 2);
            KT_REQUIRE(dw && dan && dfn && dinv && dX && dk && dv, "device allocation");
            upload(dw, h, nqkv * 2 + no * 2 + ngu * 2 + ndn * 2);
            upload(dan, an, dim * 4), upload(dfn, fn, dim * 4), upload(dinv, inv, sizeof inv);
            upload(dX, X, (size_t)T * ldd * 4);
            kv_pf_layer lw = {.qkv = dw, .o = (uint16_t *)dw + nqkv, .gu = (uint16_t *)dw + nqkv + no,
                              .down = (uint16_t *)dw + nqkv + no + ngu, .attn_norm = dan, .ffn_norm = dfn};
            kv_pf_ws ws;
            KT_REQUIRE(kv_gpu_prefill_ws_alloc(&g, C, &ws) == KV_OK, "%s", kv_errdetail());
            kv_status st = layer_chunks(cb, &g, &lw, &ws, dX, T, C, dk, dv, kvs, dinv);
            KT_CHECK(st == KV_OK, "layer: %s", kv_errdetail());
            KT_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "sync: %s", kv_cuda_last_error());
            cudaMemcpy(Xg, dX, (size_t)T * ldd * 4, cudaMemcpyDeviceToHost);
            /* again with the products padded to 16 rows (kv_pf_ws.pad): the
             * last chunk's 6 rows run as 16, into X's room past T */
            float *dXp = dalloc((size_t)(T + 16) * ldd * 4);
            KT_REQUIRE(dXp, "device allocation");
            KT_REQUIRE(cudaMemset(dXp, 0, (size_t)(T + 16) * ldd * 4) == cudaSuccess &&
                           upload(dXp, X, (size_t)T * ldd * 4) == cudaSuccess, "padded X");
            kv_pf_ws wp = ws;
            wp.pad = 16;
            KT_CHECK(kv_gpu_prefill_gemm_rows(&wp, T % C) == 16, "6 rows padded to %d",
                     kv_gpu_prefill_gemm_rows(&wp, T % C));
            st = layer_chunks(cb, &g, &lw, &wp, dXp, T, C, dk, dv, kvs, dinv);
            KT_CHECK(st == KV_OK, "padded layer: %s", kv_errdetail());
            KT_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "sync: %s", kv_cuda_last_error());
            float *Xp = malloc((size_t)T * ldd * 4);
            KT_REQUIRE(Xp && cudaMemcpy(Xp, dXp, (size_t)T * ldd * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
                       "padded X back");
            cudaFree(dXp);
            /* the CPU layer, float32 */
            float *xn = malloc((size_t)T * dim * 4), *qkv = malloc((size_t)T * (qd + 2 * kvd) * 4);
            float *Q = malloc((size_t)T * qd * 4), *K = malloc((size_t)G * T * hd * 4);
            float *V = malloc((size_t)G * T * hd * 4), *att = malloc((size_t)T * qd * 4);
            float *hb = malloc((size_t)T * hid * 4);
            for (int t = 0; t < T; t++) {
                cpu_rmsnorm(xn + (size_t)t * dim, X + (size_t)t * ldd, an, dim, g.eps);
                float *r = qkv + (size_t)t * (qd + 2 * kvd);
                for (int o = 0; o < qd + 2 * kvd; o++) {
                    float a = 0;
                    for (int c = 0; c < dim; c++) a += wqkv[(size_t)o * ldd + c] * xn[(size_t)t * dim + c];
                    r[o] = a;
                }
                cpu_rope(r, H + G, hd, inv, t);
                memcpy(Q + (size_t)t * qd, r, (size_t)qd * 4);
                for (int gh = 0; gh < G; gh++) {
                    memcpy(K + ((size_t)gh * T + t) * hd, r + qd + gh * hd, (size_t)hd * 4);
                    memcpy(V + ((size_t)gh * T + t) * hd, r + qd + kvd + gh * hd, (size_t)hd * 4);
                }
            }
            kv_attn_prefill_dims ad = {H, G, hd, 0, T, qd, qd, (long)T * hd, g.scale};
            kv_attn_prefill(&ad, Q, K, V, att);
            for (int t = 0; t < T; t++) {
                float *x = X + (size_t)t * ldd;
                for (int o = 0; o < dim; o++) {
                    float a = 0;
                    for (int c = 0; c < qd; c++) a += wo[(size_t)o * ldq + c] * att[(size_t)t * qd + c];
                    x[o] += a;
                }
                cpu_rmsnorm(xn + (size_t)t * dim, x, fn, dim, g.eps);
                for (int o = 0; o < hid; o++) {
                    float gg = 0, u = 0;
                    for (int c = 0; c < dim; c++) {
                        gg += wgu[(size_t)(2 * o) * ldd + c] * xn[(size_t)t * dim + c];
                        u += wgu[(size_t)(2 * o + 1) * ldd + c] * xn[(size_t)t * dim + c];
                    }
                    gg *= 1.0f / (1.0f + expf(-gg));
                    hb[(size_t)t * hid + o] = gg * u;
                }
                for (int o = 0; o < dim; o++) {
                    float a = 0;
                    for (int c = 0; c < hid; c++) a += wdn[(size_t)o * ldh + c] * hb[(size_t)t * hid + c];
                    x[o] += a;
                }
            }
            double e = nerr(Xg, X, (size_t)T * ldd);
            double tol = bf ? 1e-2 : 2e-3;
            KT_CHECK(e < tol, "weights %s, cache %s: residual stream error %.3g",
                     bf ? "bf16" : "f16", kvbf ? "bf16" : "f16", e);
            double ep = nerr(Xp, X, (size_t)T * ldd);
            KT_CHECK(ep < tol, "weights %s, cache %s, products padded to 16 rows: residual stream error %.3g",
                     bf ? "bf16" : "f16", kvbf ? "bf16" : "f16", ep);
            printf("# layer in chunks of %d, weights %s cache %s: error %.3g (products padded: %.3g)\n", C,
                   bf ? "bf16" : "f16", kvbf ? "bf16" : "f16", e, ep);
            free(Xp);
            kv_gpu_prefill_ws_free(&ws);
            cudaFree(dw), cudaFree(dan), cudaFree(dfn), cudaFree(dinv), cudaFree(dX);
            cudaFree(dk), cudaFree(dv);
            free(xn), free(qkv), free(Q), free(K), free(V), free(att), free(hb), free(h);
        }
    }
    free(wqkv), free(wo), free(wgu), free(wdn), free(an), free(fn), free(X), free(Xg);
    kv_cublas_close(cb);
}
/* Weight rows as fp16 (the GPU engine's type for float32 models), rows of
 * several matrices one after another (or two interleaved), zero-padded to
 * ld: the layout of lib/gpu/kv_gpu_engine.c's upload_matrix. */
static uint16_t *rows16(const kv_weight *const *parts, int np, int ld, int interleave, size_t *nrows)
{
    size_t rows = 0;
    for (int i = 0; i < np; i++) rows += (size_t)parts[i]->rows;
    uint16_t *h = calloc(rows * (size_t)ld, 2);
    float *f = malloc((size_t)parts[0]->cols * sizeof(float));
    for (size_t r = 0; h && f && r < rows; r++) {
        int part = 0;
        size_t rs = r;
        if (interleave) part = (int)(r % 2), rs = r / 2;
        else
            while (rs >= (size_t)parts[part]->rows) rs -= (size_t)parts[part++]->rows;
        kv_weight_row(parts[part], (int)rs, f);
        for (int c = 0; c < parts[part]->cols; c++) h[r * (size_t)ld + c] = kv_f32_to_half(f[c]);
    }
    free(f);
    *nrows = rows;
    return h;
}

static void *up16(const uint16_t *h, size_t n)
{
    void *d = dalloc(n * 2);
    if (d && upload(d, h, n * 2) != cudaSuccess) cudaFree(d), d = NULL;
    return d;
}

/* The whole chunked prefill (kv_gpu_prefill_model, chunks of 128) on niah4k
 * against the CPU engine's prefill of the same prompt: the last position's
 * logits (output norm and classifier applied on the CPU to the GPU's final
 * residual row) and every layer's K/V, by normalized error; greedy tokens
 * agree.  fp16 weights and cache on the GPU, float32 on the CPU. */
static void test_prefill_model_matches_cpu_engine_on_niah4k(void)
{
    kv_model *m = NULL;
    KT_REQUIRE(kv_model_open("tests/data/niah4k/niah4k.bin", &m) == KV_OK, "%s", kv_errdetail());
    const kv_model_config *c = &m->cfg;
    const int T = 700, C = 128, L = c->n_layers, hd = c->head_dim, nkv = c->n_kv_heads;
    const int qd = c->n_heads * hd, kvd = nkv * hd;
    kv_pf_geom g = {c->dim, c->hidden_dim, c->n_heads, nkv, hd, (c->dim + 7) & ~7, (qd + 7) & ~7,
                    (c->hidden_dim + 7) & ~7, c->norm_eps, 1.0f / sqrtf((float)hd), 0, 0, 0, 0, 0};
    int *tok = malloc(T * sizeof(int));
    for (int t = 0; t < T; t++) tok[t] = 3 + (int)(kt_rand(&seed) * (c->vocab_size - 3));
    /* the CPU engine, full cache, keeping the prompt K/V */
    kv_engine *e = NULL;
    float *logits = malloc((size_t)c->vocab_size * sizeof(float));
    KT_REQUIRE(kv_engine_new(m, NULL, T + 8, &e) == KV_OK, "%s", kv_errdetail());
    KT_REQUIRE(kv_engine_keep(e, 0, true) == KV_OK, "%s", kv_errdetail());
    KT_REQUIRE(kv_engine_prefill(e, tok, T, logits) == KV_OK, "%s", kv_errdetail());
    /* the GPU: weights in the engine's layout */
    kv_pf_layer *lw = calloc((size_t)L, sizeof *lw);
    void **dev = calloc((size_t)L * 6 + 8, sizeof(void *));
    int nd = 0;
    for (int l = 0; l < L; l++) {
        const kv_layer_weights *w = &m->layers[l];
        const kv_weight *qkv[3] = {&w->wq, &w->wk, &w->wv}, *o[1] = {&w->wo};
        const kv_weight *gu[2] = {&w->w_gate, &w->w_up}, *dn[1] = {&w->w_down};
        size_t r;
        uint16_t *h;
        h = rows16(qkv, 3, g.ld_dim, 0, &r), lw[l].qkv = dev[nd++] = up16(h, r * g.ld_dim), free(h);
        h = rows16(o, 1, g.ld_qd, 0, &r), lw[l].o = dev[nd++] = up16(h, r * g.ld_qd), free(h);
        h = rows16(gu, 2, g.ld_dim, 1, &r), lw[l].gu = dev[nd++] = up16(h, r * g.ld_dim), free(h);
        h = rows16(dn, 1, g.ld_hid, 0, &r), lw[l].down = dev[nd++] = up16(h, r * g.ld_hid), free(h);
        float *an = dalloc(c->dim * 4), *fn = dalloc(c->dim * 4);
        upload(an, w->attn_norm, c->dim * 4), upload(fn, w->ffn_norm, c->dim * 4);
        lw[l].attn_norm = dev[nd++] = an, lw[l].ffn_norm = dev[nd++] = fn;
    }
    const kv_weight *em[1] = {&m->tok_embd};
    size_t er;
    uint16_t *eh = rows16(em, 1, g.ld_dim, 0, &er);
    void *demb = dev[nd++] = up16(eh, er * g.ld_dim);
    free(eh);
    float inv[128];
    kv_model_rope_freqs(c, inv);
    float *dinv = dev[nd++] = dalloc(sizeof inv);
    upload(dinv, inv, (size_t)hd / 2 * 4);
    int *dtok = dev[nd++] = dalloc(T * sizeof(int));
    upload(dtok, tok, T * sizeof(int));
    float *dX = dev[nd++] = dalloc((size_t)T * g.ld_dim * 4);
    const long long kvs = (long long)T * hd;
    void **kc = calloc((size_t)L, sizeof(void *)), **vc = calloc((size_t)L, sizeof(void *));
    for (int l = 0; l < L; l++) kc[l] = dalloc((size_t)nkv * kvs * 2), vc[l] = dalloc((size_t)nkv * kvs * 2);
    kv_cublas *cb = NULL;
    KT_REQUIRE(kv_cublas_open(&cb) == KV_OK, "%s", kv_errdetail());
    kv_pf_ws ws;
    KT_REQUIRE(kv_gpu_prefill_ws_alloc(&g, C, &ws) == KV_OK, "%s", kv_errdetail());
    kv_status st = kv_gpu_prefill_model(cb, &g, lw, L, demb, g.ld_dim, NULL, dtok, T, &ws, dX, kc, vc, kvs,
                                        dinv, NULL, NULL, NULL);
    KT_CHECK(st == KV_OK, "prefill: %s", kv_errdetail());
    KT_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "sync: %s", kv_cuda_last_error());
    /* logits of the last position from the GPU's residual row */
    float *xl = malloc((size_t)g.ld_dim * 4), *xn = malloc((size_t)c->dim * 4);
    float *gl = malloc((size_t)c->vocab_size * sizeof(float));
    cudaMemcpy(xl, dX + (size_t)(T - 1) * g.ld_dim, (size_t)g.ld_dim * 4, cudaMemcpyDeviceToHost);
    cpu_rmsnorm(xn, xl, m->output_norm, c->dim, c->norm_eps);
    kv_matmul(&m->output, xn, 1, gl);
    double el = nerr(gl, logits, (size_t)c->vocab_size);
    int a1 = 0, a2 = 0;
    for (int i = 1; i < c->vocab_size; i++) {
        if (logits[i] > logits[a1]) a1 = i;
        if (gl[i] > gl[a2]) a2 = i;
    }
    KT_CHECK(el < 1e-2, "last logits: normalized error %.3g", el);
    KT_CHECK(a1 == a2, "greedy token %d on the CPU, %d on the GPU", a1, a2);
    /* every layer's cache */
    double worst = 0;
    uint16_t *hk = malloc((size_t)nkv * kvs * 2);
    float *fk = malloc((size_t)nkv * kvs * 4);
    for (int l = 0; l < L; l++)
        for (int which = 0; which < 2; which++) {
            int Tc = 0;
            const float *ref = kv_engine_prompt_kv(e, l, which ? 'v' : 'k', &Tc);
            KT_REQUIRE(ref && Tc == T, "CPU prompt K/V of layer %d", l);
            cudaMemcpy(hk, which ? vc[l] : kc[l], (size_t)nkv * kvs * 2, cudaMemcpyDeviceToHost);
            for (size_t i = 0; i < (size_t)nkv * kvs; i++) fk[i] = kv_half_to_f32(hk[i]);
            double ek = nerr(fk, ref, (size_t)nkv * kvs);
            if (ek > worst) worst = ek;
            KT_CHECK(ek < 1e-2, "layer %d %c: normalized error %.3g", l, which ? 'v' : 'k', ek);
        }
    printf("# niah4k, %d tokens in chunks of %d: last logits error %.3g, worst K/V error %.3g, "
           "greedy %d/%d\n", T, C, el, worst, a1, a2);
    (void)qd, (void)kvd;
    kv_gpu_prefill_ws_free(&ws);
    kv_cublas_close(cb);
    for (int l = 0; l < L; l++) cudaFree(kc[l]), cudaFree(vc[l]);
    for (int i = 0; i < nd; i++) cudaFree(dev[i]);
    free(kc), free(vc), free(dev), free(lw), free(xl), free(xn), free(gl), free(hk), free(fk);
    free(logits), free(tok);
    kv_engine_free(e);
    kv_model_close(m);
}
#endif

/* The products' row count under kv_pf_ws.pad: rounded up to the granule
 * while the workspace has the rows, else the chunk's own. */
static void test_gemm_rows_round_within_the_workspace(void)
{
    kv_pf_ws ws;
    memset(&ws, 0, sizeof ws);
    ws.C = ws.cap = 4096;
    KT_CHECK(kv_gpu_prefill_gemm_rows(&ws, 460) == 460, "no pad: %d", kv_gpu_prefill_gemm_rows(&ws, 460));
    ws.pad = 1;
    KT_CHECK(kv_gpu_prefill_gemm_rows(&ws, 461) == 461, "pad 1: %d", kv_gpu_prefill_gemm_rows(&ws, 461));
    ws.pad = 16;
    const int in[6] = {1, 16, 17, 460, 4090, 4096}, want[6] = {16, 16, 32, 464, 4096, 4096};
    for (int i = 0; i < 6; i++)
        KT_CHECK(kv_gpu_prefill_gemm_rows(&ws, in[i]) == want[i], "%d rows: %d, not %d", in[i],
                 kv_gpu_prefill_gemm_rows(&ws, in[i]), want[i]);
    ws.C = ws.cap = 100; /* a chunk option that is no multiple of 16 */
    KT_CHECK(kv_gpu_prefill_gemm_rows(&ws, 97) == 97, "97 of 100 rows: %d", kv_gpu_prefill_gemm_rows(&ws, 97));
    KT_CHECK(kv_gpu_prefill_gemm_rows(&ws, 81) == 96, "81 of 100 rows: %d", kv_gpu_prefill_gemm_rows(&ws, 81));
}

#define GPU_TESTS(X)                                                   \
    X(test_prefill_attention_matches_cpu)                              \
    X(test_prefill_attention_chunks_agree_and_bad_arguments_fail)      \
    X(test_prefill_row_kernels_match_cpu)                              \
    X(test_cublas_products_match_cpu)                                  \
    X(test_prefill_layer_in_chunks_matches_cpu)                        \
    X(test_prefill_model_matches_cpu_engine_on_niah4k)

int main(void)
{
    seed = getenv("KT_SEED") ? strtoull(getenv("KT_SEED"), NULL, 10) : (unsigned long long)time(NULL);
    printf("# seed %llu (set KT_SEED to repeat)\n", seed);
    seed |= 1;
    KT_RUN(test_prefill_reference_matches_float64);
    KT_RUN(test_gemm_rows_round_within_the_workspace);
    char name[256] = "";
    int ngpu = kv_gpu_probe(name, sizeof name);
#ifdef KV_HAVE_CUDA
    if (ngpu > 0) {
        printf("# GPU: %s\n", name);
        const char *filter = getenv("KV_TEST_FILTER");
#define RUN_ONE(t)                                \
    if (!filter || strstr(#t, filter)) KT_RUN(t); \
    else KT_SKIP(t, "not selected by KV_TEST_FILTER");
        GPU_TESTS(RUN_ONE)
        return kt_done();
    }
#endif
    char why[300];
    snprintf(why, sizeof why, "no usable GPU (%s)", name);
    fprintf(stderr, "notice: CUDA prefill tests skipped: %s\n", why);
#define SKIP_ONE(t) KT_SKIP(t, why);
    GPU_TESTS(SKIP_ONE)
    (void)ngpu, (void)kt_cur_failed;
    return kt_done();
}
