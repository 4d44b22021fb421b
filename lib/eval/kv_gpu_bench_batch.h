/*
 * kv_gpu_bench_batch: the measuring behind `kv-bench decode --batch`
 * (issue 10): B sequences of one placement at a T-token context, each
 * synthesized on the device with its own seed, decoding together
 * (lib/gpu/kv_gpu_batch.h), timed per step; for --batch max the largest B
 * that fits first (kv_gpu_batch_probe, kv_gpu_batch_max).  Without CUDA
 * every call fails with KV_E_UNAVAILABLE.
 */
#ifndef KV_GPU_BENCH_BATCH_H
#define KV_GPU_BENCH_BATCH_H

#include <stdint.h>

#include "gpu/kv_gpu_batch.h"
#include "common/kv_status.h"

typedef struct {
    int B;                 /* sequences that ran */
    int asked;             /* B asked for; 0 for max */
    char bound[16];        /* max: what decided B ("gpu", "host", "cap", "nomem" after a retry); else "" */
    double ms_median, ms_p90, ms_min; /* per step (every sequence one token) */
    double tok_s;          /* B * 1000 / ms_median */
    uint64_t gpu_kv;       /* KV bytes resident on the GPU, summed over the sequences */
    uint64_t host_kv;      /* KV bytes in pinned host memory, summed */
    uint64_t probe_gpu;    /* max: device bytes one sequence took in the probe (0 otherwise) */
    uint64_t probe_host;   /* max: pinned host bytes of one sequence in the probe */
    uint64_t gpu_used;     /* device memory in use while the batch ran (total - free) */
    uint64_t gpu_total;    /* the device's memory */
    int tokens;            /* timed steps */
    double setup_s;        /* wall time to build and synthesize the batch */
    char gemm[64];         /* kv_gpu_batch_gemm_desc */
} kv_gpu_batch_result;

/*
 * Time B sequences (B = 0: the largest that fits, at most cap) under
 * per_layer (NULL: full) at a T-token context on w's weights: warmup steps,
 * then `tokens` timed steps.  Sequence i is synthesized with seed + i.
 * For max, a batch that still does not fit is retried with 10% fewer
 * sequences (three times at most).
 */
kv_status kv_gpu_bench_batch(kv_gpu_engine *w, const kv_policy_params *per_layer, int T, uint64_t seed, int B,
                             int cap, kv_gpu_gemm gemm, int warmup, int tokens, kv_gpu_batch_result *r);

#endif
