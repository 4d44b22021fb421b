/*
 * kv_prefill_bench: the measuring behind `kv-bench prefill` — a dense causal
 * prefill of a model geometry on the GPU (kv_gpu_prefill_layer, layer by
 * layer, in chunks), timed end to end with the attention kernels' share
 * timed separately, the attention kernel alone over a whole prompt in one
 * launch, and the bf16 cuBLAS GEMM rate as the ceiling.  Weights are seeded
 * random numbers generated on the device (one layer's set, read by every
 * layer: the compute and bytes of the real geometry), the caches one per
 * layer.  Without CUDA every call fails with KV_E_UNAVAILABLE.
 */
#ifndef KV_PREFILL_BENCH_H
#define KV_PREFILL_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_status.h"
#include "model/kv_model.h"

typedef struct {
    int T;          /* prompt tokens */
    int chunk;      /* rows per chunk (0: 4096) */
    int variant;    /* attention tile variant (0 = default) */
    int wbf16;      /* weights bf16 (else fp16); the cache is fp16 as in the engine */
    int kvbf16;     /* cache and queries bf16 instead */
    int layers;     /* layers run (0: the model's) */
    int reps;       /* timed repetitions, the median reported (0: 3) */
    uint64_t seed;
    int device;
} kv_prefill_bench_opts;

typedef struct {
    double ms;             /* the whole prefill (every layer), median */
    double ms_min;
    double tokens_per_s;
    double attn_ms;        /* the attention kernels' share of that run */
    double attn_tflops;    /* causal attention FLOPs (4*T^2*H*D/2 per layer) / attn_ms */
    double other_ms;       /* ms - attn_ms: projections, FFN, norms, RoPE */
    double gemm_tflops;    /* projection and FFN FLOPs (2*T*params) / other_ms */
    uint64_t gpu_bytes;    /* device memory the run allocated (weights, caches, workspace) */
    uint64_t ws_bytes;     /* of which the chunk workspace */
} kv_prefill_bench_result;

/* The attention kernel's tile variants (pf_attn_variants): count and names
 * (0 and "none" in a build without CUDA). */
int kv_prefill_attn_variants(void);
const char *kv_prefill_attn_variant_name(int v);

void kv_prefill_bench_opts_default(kv_prefill_bench_opts *o);

kv_status kv_prefill_bench_run(const kv_model_config *c, const kv_prefill_bench_opts *o,
                               kv_prefill_bench_result *r);

/* The attention kernel alone: one causal launch over T tokens (p0 0, n T) of
 * c's attention geometry, fp16 (bf16 with bf16 set); median ms of reps. */
kv_status kv_prefill_bench_attn(const kv_model_config *c, int T, int variant, int bf16, int reps,
                                int device, double *ms, double *tflops);

/* cuBLAS bf16 GEMM n x n x n (random inputs, f32 accumulation, bf16 out):
 * median TFLOP/s of reps. */
kv_status kv_prefill_bench_gemm(int n, int reps, int device, double *tflops);

#endif
