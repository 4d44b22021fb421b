/*
 * kv_gpu_batch: batched decode on the GPU (issue 10).  B independent
 * sequences step together: each is a kv_gpu_engine of its own (its own
 * per-layer placements, KV, length and position, prefilled or synthesized
 * alone), all reading one copy of the weights (kv_gpu_engine_new_sharing),
 * and a decode step runs every projection once for the whole batch: the
 * residual streams of the B sequences are rows of one matrix (X (B,
 * ld_dim), QKV, attention outputs, SwiGLU outputs, logits likewise), each
 * engine's activation pointers aimed at its row, so per layer there is
 * one batched QKV product, then per sequence its own RoPE/store and its
 * placement's attention, then one batched output projection and one
 * feed-forward; logits and argmax for all B.  Weights are read once per
 * step instead of B times (the GEMV becomes a skinny GEMM).
 *
 * Two ways to run the products (kv_gpu_gemm):
 *   gemv    kernels/eng_gemv_batch.cu: each sequence's arithmetic is the
 *           single-sequence GEMV's to the bit, so a batched greedy decode
 *           gives every sequence exactly the tokens it gets alone;
 *           on the H200 it is as fast as the single GEMV for one sequence
 *           but slower than cuBLAS from two on (docs/BENCHMARKS.md, batched
 *           decode: 19.3 against 8.7 ms a step for 8 sequences at 4k).
 *   cublas  tensor cores (lib/gpu/kv_cublas.c, loaded lazily): the
 *           normalized inputs rounded to the weights' 16-bit type first, as
 *           the chunked prefill does; float32 accumulation.  Numerically
 *           close to the GEMV, not identical, so greedy tokens may part
 *           where two logits nearly tie.
 *   auto    gemv up to KV_GPU_BATCH_GEMV_MAX sequences (one), cublas past it
 *           (gemv when cuBLAS cannot be loaded).
 * A matrix group kept packed (Q8_0/Q4_K/Q6_K GGUF weights) is not batched:
 * it runs the engine's packed GEMV once per sequence (correct, reads those
 * weights B times).
 *
 * The products run on the batch's own stream; each sequence's own work
 * (predicted query, RoPE/store, attention) on one of 4 lanes (the first
 * four engines' main streams; sequence i on lane i % 4), joined by events
 * twice per layer; a sparse layer's selection stays on each engine's own
 * selection streams.  Without CUDA every call fails with KV_E_UNAVAILABLE.
 */
#ifndef KV_GPU_BATCH_H
#define KV_GPU_BATCH_H

#include <stdint.h>

#include "gpu/kv_gpu_engine.h"
#include "common/kv_status.h"

typedef struct kv_gpu_batch kv_gpu_batch;

typedef enum { KV_GPU_GEMM_AUTO = 0, KV_GPU_GEMM_GEMV, KV_GPU_GEMM_CUBLAS } kv_gpu_gemm;

/* auto: the batched GEMV up to this many sequences, cuBLAS past it (the
 * H200's measurements: cuBLAS is faster from two sequences on) */
#define KV_GPU_BATCH_GEMV_MAX 1

/* "auto", "gemv", "cublas"; kv_gpu_gemm_parse: KV_E_USAGE for another word. */
const char *kv_gpu_gemm_name(kv_gpu_gemm g);
kv_status kv_gpu_gemm_parse(const char *s, kv_gpu_gemm *g);

/*
 * B (>= 1) sequences reading w's weights (borrowed: it must outlive the
 * batch, and is not stepped by it).  per_seq: NULL (full everywhere) or B
 * pointers, each NULL or the sequence's n_layers policies.  ctx: every
 * sequence's capacity (0: the model's).  Each sequence engine takes w's
 * options.  KV_E_NOMEM names what did not fit.
 */
kv_status kv_gpu_batch_new(kv_gpu_engine *w, int B, const kv_policy_params *const *per_seq, int ctx,
                           kv_gpu_gemm gemm, kv_gpu_batch **out);
void kv_gpu_batch_free(kv_gpu_batch *b);

int kv_gpu_batch_size(const kv_gpu_batch *b);
/* Sequence i's engine: prefill, synthesize, reset, bytes, even a decode of
 * its own (kv_gpu_engine_generate: it then runs alone, same arithmetic
 * as the gemv batch) - but not while the batch steps. */
kv_gpu_engine *kv_gpu_batch_seq(kv_gpu_batch *b, int i);
/* How the products run: "gemv", "cublas", with " (packed groups per
 * sequence)" when some matrix group is packed. */
const char *kv_gpu_batch_gemm_desc(const kv_gpu_batch *b);

/*
 * Greedy decode of n steps of every sequence together: step 0's inputs are
 * first (B), each next input is the device argmax of the sequence's last
 * logits.  out (n, B): out[i*B + b] = sequence b's id generated at step i;
 * step_ms (n) or NULL: GPU time of each step (events, end to end).  Every
 * sequence must have a context (prefill or synthesize) and room for n more.
 */
kv_status kv_gpu_batch_generate(kv_gpu_batch *b, const int *first, int n, int *out, float *step_ms);

/* Sequence i's logits (vocab) of the last step to host memory. */
kv_status kv_gpu_batch_logits(const kv_gpu_batch *b, int i, float *out);

/* GPU bytes the batch itself holds (the shared activation rows). */
uint64_t kv_gpu_batch_own_bytes(const kv_gpu_batch *b);

/*
 * What one sequence costs under per_layer at a T-token context (for
 * --batch max): a sequence engine sharing w's weights is built,
 * synthesized to T tokens (seed) and stepped twice, and gpu is the drop in
 * free device memory that caused (KV, workspaces, activations, the batch's
 * rows for one sequence), host its pinned host KV bytes; then it is freed.
 */
kv_status kv_gpu_batch_probe(kv_gpu_engine *w, const kv_policy_params *per_layer, int ctx, int T,
                             uint64_t seed, uint64_t *gpu, uint64_t *host);

/*
 * The largest batch that fits now: free device memory less margin (bytes;
 * 0 takes max(1 GiB, 4% of the device)) over gpu bytes per sequence, and,
 * when host > 0, available host memory less 8 GiB over host bytes; at most
 * cap (>= 1).  *why says which bound decided ("gpu", "host", "cap").
 */
kv_status kv_gpu_batch_max(uint64_t gpu, uint64_t host, uint64_t margin, int cap, int *B,
                           const char **why);

#endif
