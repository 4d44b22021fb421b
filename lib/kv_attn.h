/*
 * kv_attn: CPU reference decode attention (one new query token against a
 * layer's cached keys and values) for every path the CUDA kernels implement:
 * dense fp32 and fp16 grouped-query attention, and attention straight from a
 * KIVI-packed cache (lib/kv_layout.h, packed by lib/kv_quant.c) with the key
 * scales and zeros folded into the query and the value scales into the
 * probabilities.  Plain C; the kernels in kernels/ are tested against these
 * by normalized error, and these against a float64 computation.
 *
 * Shapes: query head h attends with KV head h / (n_heads / kv_heads).
 * Accumulation is float32 throughout (as on the GPU); the output is float32.
 */
#ifndef KV_ATTN_H
#define KV_ATTN_H

#include <stddef.h>

#include "kv_half.h"
#include "kv_quant.h"
#include "kv_status.h"

typedef struct {
    int n_heads;  /* query heads */
    int kv_heads; /* KV heads; n_heads % kv_heads == 0 */
    int head_dim; /* D */
    int T;        /* cached tokens attended to (the new token's K/V included) */
    float scale;  /* softmax scale, usually 1/sqrt(D) */
} kv_attn_dims;

/* Check a geometry (KV_E_USAGE with a message when it is not valid). */
kv_status kv_attn_check(const kv_attn_dims *d);

/*
 * Dense decode attention.
 *   q:   (n_heads, D)
 *   k,v: (kv_heads, T, D)
 *   out: (n_heads, D)
 */
kv_status kv_attn_decode_f32(const kv_attn_dims *d, const float *q, const float *k,
                             const float *v, float *out);
kv_status kv_attn_decode_f16(const kv_attn_dims *d, const kv_half *q, const kv_half *k,
                             const kv_half *v, float *out);

/*
 * Decode attention from a KIVI-packed layer: K and V packed by kv_kivi_pack
 * (keys per channel over G-token groups, values per token over Gv channels,
 * same bits, group and residual, T tokens each, the last T - nq in fp16).
 * For each key group g the folded query is qs_c = q_c * scale_gc and
 * qz = sum_c q_c * zero_gc, so score_t = qz + sum_c qs_c * code_tc; values
 * accumulate sum_t p_t * scale_t,g * code_tc plus sum_t p_t * zero_t,g.
 *   q:   (n_heads, D) fp16
 *   out: (n_heads, D)
 */
kv_status kv_attn_decode_kivi(const kv_attn_dims *d, const kv_half *q, const kv_kivi_packed *K,
                              const kv_kivi_packed *V, float *out);

#endif
