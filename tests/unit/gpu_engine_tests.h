/*
 * What the GPU engine's test programs share: test_gpu_engine_kernels.c (the
 * engine's kernels against float64), test_gpu_engine.c (whole decodes
 * against the CPU engine, policy by policy) and test_gpu_engine_data.c (what
 * the engine writes and copies, the weights it takes, what it refuses) were
 * one program until its size passed the limit on a C file.  Here: the
 * fixtures' folders, the short mode, normalized errors, copies to the
 * device, the engine-against-engine comparison, and the KV_TEST_FILTER
 * selection.  The helpers are static inline so that a program using some
 * of them compiles without unused-function warnings.
 *
 * The three programs share no state but the random stream: each starts
 * its seed where the one program's run left it at the point the program
 * begins (see each seed), so the random data and prompts are the ones the
 * bounds were measured on.
 */
#ifndef GPU_ENGINE_TESTS_H
#define GPU_ENGINE_TESTS_H

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

#ifdef KV_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "eng_ops.cuh"
#include "kv_kernels.h"
#endif

#define S260 "tests/data/stories260K/"
#define NIAH "tests/data/niah4k/"

/* KV_GPU_TEST_SHORT=1 (under compute-sanitizer): smaller prompts and runs. */
static inline int short_run(void) { return getenv("KV_GPU_TEST_SHORT") != NULL; }

/* Whether the GPU tests run here: the GPU named, or the notice that they
 * are skipped (always in a CPU-only build). */
static inline int gpu_tests_start(void)
{
    char name[256];
    if (kv_gpu_probe(name, sizeof name) <= 0) {
        printf("# no usable GPU (%s): GPU tests skipped\n", name);
        return 0;
    }
    printf("# GPU: %s\n", name);
    return 1;
}

#ifdef KV_HAVE_CUDA

/* ||a - b|| / ||b|| */
static inline double nerr(const float *a, const double *b, size_t n)
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

static inline double nerr_f(const float *a, const float *b, size_t n)
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

static inline double nerr_d(const double *a, const double *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Top-1 minus top-2 logit. */
static inline float margin(const float *x, int n)
{
    int b = kt_argmax(x, n);
    float s = -INFINITY;
    for (int i = 0; i < n; i++)
        if (i != b && x[i] > s) s = x[i];
    return x[b] - s;
}

#define CU(call) KT_REQUIRE((call) == cudaSuccess, "%s: %s", #call, cudaGetErrorString(cudaGetLastError()))

static inline void *dput(const void *h, size_t bytes)
{
    void *d = NULL;
    if (cudaMalloc(&d, bytes) != cudaSuccess) return NULL;
    cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    return d;
}

// --- the GPU engine against the CPU engine ------------------------------------------

typedef struct {
    double max_err;   /* largest per-step normalized logit error */
    int argmax_diff;  /* steps whose argmax differs although the CPU margin is > 0.05 */
    int steps;
} cmp_result;

/*
 * Prefill both engines with prompt (n), then feed the CPU's greedy tokens to
 * both for `steps` steps, comparing the logits of every step.
 */
static inline void compare_engines(kv_engine *cpu, kv_gpu_engine *gpu, const int *prompt, int n, int steps,
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


/* t run, or reported skipped when KV_TEST_FILTER=a,b (in filter) leaves it
 * out: only the tests whose names contain a or b run (e.g. under
 * compute-sanitizer) */
#define RUN_ONE(t) KT_RUN_SELECTED(t, filter)

#endif /* KV_HAVE_CUDA */

#endif
