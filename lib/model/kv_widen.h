/*
 * kv_widen: a small trained model embedded in a large model's shape.
 *
 * The widened model has the large geometry's width, heads, head size,
 * feed-forward width and layer count, so every GEMM, attention kernel,
 * KV byte and PCIe/disk transfer costs what it costs for the large model,
 * while it computes the small model's function (its logits, up to float
 * rounding; the vocabulary and tokenizer stay the small model's).  It
 * serves benchmarks that need both numbers at once: the time of an
 * 8B-class model and the accuracy of a trained one (niah4k's needles).
 *
 * The construction (exact in real arithmetic; s = sqrt(dim_big / dim_small),
 * k = head_dim_big / head_dim_small):
 *   - the residual stream holds the small one's, times s, in its first
 *     dim_small coordinates and zeros elsewhere: the token embedding, wo
 *     and w_down are scaled by s and the norm weights by 1/s, so every
 *     RMSNorm (epsilon included) sees the small model's mean square;
 *   - each small KV head is a large KV head, each of its query heads one
 *     query head of that large group; every rotated pair i of a small head
 *     becomes k pairs of the large head, all turning at pair i's frequency
 *     (RoPE frequency divisors, the GGUF rope_freqs mechanism), queries
 *     copied, keys and values scaled by 1/sqrt(k) (so q.k / sqrt(head_dim)
 *     and the value path are the small model's);
 *   - the first hidden_small feed-forward units are the small ones;
 *   - the small layers are spread over the large stack (layer l at
 *     ceil(l * L_big / L_small)); the other layers are all zero, hence identity
 *     (zero attention and FFN output), and share one weight block, as the
 *     synthetic models do;
 *   - unused query heads, KV heads, feed-forward units and coordinates
 *     are zero.
 * Keys and values of a real head therefore carry k copies of each of the
 * small model's channels (no zero channels); the zero heads and layers
 * attend uniformly.  The classifier is the small model's, on the first
 * dim_small coordinates (not the large vocabulary: its cost is left out).
 */
#ifndef KV_WIDEN_H
#define KV_WIDEN_H

#include "model/kv_model.h"

/*
 * small in the shape of geometry big (kv_model_geometry's names, or a
 * config filled by the caller), weights stored as wt (F32, F16 or BF16).
 * KV_E_USAGE when big is inconsistent (kv_model_config_check) or small
 * does not fit in it: a dimension larger than big's, a query-head group
 * larger than big's, or a head size that does not divide big's;
 * KV_E_UNSUPPORTED for what the construction does not carry over
 * (partial RoPE; feed-forward, embedding or classifier biases).  small
 * may be closed afterwards.
 */
kv_status kv_model_widen(const kv_model *small, const kv_model_config *big, kv_dtype wt, kv_model **out);
/* Same, the geometry by name ("llama-3.1-8b"). */
kv_status kv_model_widen_named(const kv_model *small, const char *geometry, kv_dtype wt, kv_model **out);

#endif
