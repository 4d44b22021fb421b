/*
 * kv_runner_batch: a greedy decode of B prompts (kv-run --batch, issue 10).
 * On the GPU the sequences are prefilled one after another, each on its
 * own engine, and then decode together (lib/gpu/kv_gpu_batch.h: one read
 * of the weights per step for all of them); on the CPU the CPU engine runs
 * them one after another.  Either way each sequence's result is what
 * kv_runner_generate would emit greedily for it: the first token from its
 * prefill's logits, stop tokens ending it unemitted.  On the GPU every
 * sequence steps until the longest is done (one that stopped early keeps
 * stepping; its extra tokens are dropped).
 */
#ifndef KV_RUNNER_BATCH_H
#define KV_RUNNER_BATCH_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/kv_runner.h"
#include "gpu/kv_gpu_batch.h"

typedef struct {
    int B;
    kv_generation *gen;    /* (B) each sequence's emitted ids (step_ms stays empty on the GPU) */
    bool gpu;              /* batched on the GPU (else one after another on the CPU) */
    char device[400];      /* kv_gpu_engine_device, or "cpu" */
    char how[128];         /* "batched on the GPU, products gemv", "one after another on the CPU" */
    char fallback[256];    /* --device auto on the CPU: why not the GPU ("" otherwise) */
    double prefill_ms;     /* wall time of every prefill */
    double decode_ms;      /* wall time of the decode (all sequences) */
    int steps;             /* decode steps run: batched steps on the GPU, summed over sequences on the CPU */
    double step_ms_median; /* GPU: median GPU time of one batched step; CPU: median wall time of one step */
    uint64_t gpu_kv, host_kv; /* KV bytes after the run, summed over the sequences */
} kv_batch_result;

/*
 * Decode o->n tokens greedily for each of B prompts (prompts[i], n_prompt[i]
 * >= 1 ids) under per_layer (NULL: full) with capacity ctx per sequence
 * (room for the longest prompt and o->n).  dev: KV_DEVICE_CUDA batches on
 * the GPU (gpu_opts, gemm), KV_DEVICE_CPU runs one after another,
 * KV_DEVICE_AUTO the GPU when an engine can be built, else the CPU.
 * o->on_token is not called.  res is cleared with kv_batch_result_clear.
 */
kv_status kv_runner_batch(const kv_model *m, const kv_policy_params *per_layer, int ctx, kv_device dev,
                          const kv_gpu_engine_opts *gpu_opts, kv_gpu_gemm gemm, int B, const int *const *prompts,
                          const int *n_prompt, const kv_generate_opts *o, kv_batch_result *res);
void kv_batch_result_clear(kv_batch_result *res);

/* The JSON report of a batch run (kv-run --batch --report): malloc'd text. */
kv_status kv_batch_report(const kv_model *m, const kv_batch_result *res, const int *n_prompt, const char *gemm,
                          char **json);

#endif
