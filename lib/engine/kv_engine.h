/*
 * kv_engine: the CPU forward pass of a Llama-family model, with every
 * layer's KV cache behind a kv_policy.  The prompt is prefilled densely and
 * exactly (causal attention over the engine's own float32 prompt K/V, in
 * chunks of matrix-matrix products), then each layer's policy ingests the
 * prompt's K/V; every later token goes through the policies (append, then
 * attend).  One loaded model can run several policies in turn: reset the
 * engine with new per-layer parameters and prefill again.
 *
 * Typical use:
 *   kv_engine *e; kv_engine_new(model, per_layer, 4096, &e);
 *   kv_engine_prefill(e, toks, n, logits);           // logits (vocab)
 *   for (...) { tok = argmax(logits); kv_engine_step(e, tok, logits); }
 *   kv_engine_reset(e, other_policies);  ... again ...
 *   kv_engine_free(e);
 *
 * Positions: after prefill of n tokens, kv_engine_pos() == n and the next
 * kv_engine_step() runs at position n.  The engine's context capacity (ctx)
 * bounds pos; a step at pos == ctx is KV_E_USAGE.
 */
#ifndef KV_ENGINE_H
#define KV_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/kv_model.h"
#include "policy/kv_policy.h"
#include "policy/kv_prefix.h"
#include "common/kv_status.h"

typedef struct kv_engine kv_engine;

/* Prompt tokens per projection batch of the CPU prefill. */
#define KV_ENGINE_PREFILL_CHUNK 128

/*
 * Build an engine for model m (borrowed: must outlive the engine).
 * per_layer: (n_layers) policy parameters, or NULL for `full` f32 on every
 * layer.  ctx: context capacity in tokens (0 = the model's seq_len).
 */
kv_status kv_engine_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                        kv_engine **out);
void kv_engine_free(kv_engine *e);

/*
 * Forget all tokens and rebuild each layer's policy: per_layer (n_layers)
 * gives new parameters, NULL keeps the current ones.  Position returns to 0.
 */
kv_status kv_engine_reset(kv_engine *e, const kv_policy_params *per_layer);

/*
 * Dense exact prefill of tokens (n >= 1) from position 0 (the engine must be
 * fresh or reset), then ingest() of each layer's prompt K/V into its policy.
 * logits_last: (vocab) logits after the last token, or NULL.
 */
kv_status kv_engine_prefill(kv_engine *e, const int *tokens, int n, float *logits_last);

/*
 * Continue from a stored cache (kv-run --kv, --store): the engine must be
 * fresh or reset.  pre's P rows become the first P cache rows (packed
 * layers are held packed: their policies are replaced by the file's
 * encoding, see kv_prefix_layer_packed, and kv_engine_params says so),
 * then tokens (n >= 1) are prefilled densely after them at positions
 * pre->matched, matched + 1, ... and every later step continues there.
 * kv_engine_pos() counts rows (P + n), not positions.  With f32 `full`
 * and a cache this engine dumped, the logits equal those of a prefill of
 * the whole prompt bit for bit.
 */
kv_status kv_engine_prefill_from(kv_engine *e, const kv_prefix *pre, const int *tokens, int n,
                                 float *logits_last);
/* Positions minus rows of the tokens after a continued subset (0 otherwise). */
int kv_engine_rope_off(const kv_engine *e);

/* Same, returning every position's logits: logits_all (n, vocab), row i is
 * the next-token distribution after tokens[0..i] (for scoring). */
kv_status kv_engine_prefill_all(kv_engine *e, const int *tokens, int n, float *logits_all);

/*
 * One decode step: token at position kv_engine_pos(), through each layer's
 * policy (predict if wanted, append, attend).  logits: (vocab), or NULL.
 * A step on a fresh engine (pos 0) is allowed: no prefill is then needed.
 */
kv_status kv_engine_step(kv_engine *e, int token, float *logits);

/* Geometry and state. */
int kv_engine_vocab(const kv_engine *e);
int kv_engine_pos(const kv_engine *e);      /* tokens processed so far */
int kv_engine_ctx(const kv_engine *e);      /* capacity */
int kv_engine_n_layers(const kv_engine *e);
const kv_model *kv_engine_model(const kv_engine *e);
/* The policy parameters of one layer. */
const kv_policy_params *kv_engine_params(const kv_engine *e, int layer);
/* The policy of one layer (for byte accounting: p->ops->bytes(p, &b)). */
kv_policy *kv_engine_policy(kv_engine *e, int layer);
/* Sum of every layer's kv_bytes. */
void kv_engine_bytes(const kv_engine *e, kv_bytes *total);

/*
 * Capture for --dump-kv and profiling.  Call kv_engine_keep(e, nq, true)
 * before prefill to keep: the last nq queries of each layer (post-RoPE,
 * over prefill and steps), and the dense prompt K/V after prefill (by
 * default the prompt buffers are freed once the policies have them).
 * The settings survive kv_engine_reset; the captured data does not.
 */
kv_status kv_engine_keep(kv_engine *e, int nq, bool prompt_kv);
/* Prompt K or V of a layer after prefill: (n_kv_heads, T, head_dim) float32
 * with T = prompt length; NULL if not kept.  which: 'k' or 'v'. */
const float *kv_engine_prompt_kv(const kv_engine *e, int layer, char which, int *T);
/* Copy the last queries of a layer, oldest first, into out
 * (n_heads, nq_out, head_dim); returns nq_out (<= the nq kept). */
int kv_engine_queries(const kv_engine *e, int layer, float *out);

/*
 * Write the prompt's cache as a .kvc (path "-" = stdout): `tokens` I32 (n),
 * layers.{i}.k / .v (n_kv_heads, T, head_dim) and, when queries were kept,
 * layers.{i}.q (n_heads, nq, head_dim), all in dt, plus the geometry and
 * RoPE metadata.  Needs kv_engine_keep(e, nq, true) before the prefill.
 * zstd_level > 0 writes a zstd-compressed file (kvc(5)).
 */
kv_status kv_engine_dump_kvc(const kv_engine *e, const int *tokens, int n, kv_dtype dt,
                             const char *path, int zstd_level);

/*
 * A prompt's cache as either engine captured it, for the one .kvc writer
 * both use (kv_prompt_dump_write; the GPU engine's is built by kv_runner):
 * per layer the dense prompt K and V (n_kv_heads, T, head_dim) and, when
 * nq > 0, the last nq queries (n_heads, nq, head_dim), all of type src
 * (KV_DT_F32 on the CPU, KV_DT_F16 on the GPU).
 */
typedef struct {
    kv_dtype src;
    int T, nq;
    const void *const *k; /* (n_layers) */
    const void *const *v; /* (n_layers) */
    const void *const *q; /* (n_layers), or NULL when nq == 0 */
} kv_prompt_dump;

/* Write d as the .kvc kv_engine_dump_kvc describes: tokens (T), the
 * geometry and RoPE metadata of m, every tensor converted to dt. */
kv_status kv_prompt_dump_write(const kv_model *m, const int *tokens, const kv_prompt_dump *d,
                               kv_dtype dt, const char *path, int zstd_level);

/* Threads for the matmuls (0 = OpenMP default). Process-wide. */
void kv_engine_set_threads(int n);

#endif
