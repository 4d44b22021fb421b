/*
 * kv_matmul_q: dot products of packed ggml rows with quantized activations
 * (the fast versions of kv_quant_dot_ref), for kv_matmul.c.  Internal to
 * lib/model.
 */
#ifndef KV_MATMUL_Q_H
#define KV_MATMUL_Q_H

#include <stdbool.h>
#include <stdint.h>

/* dot of one row of n values of a block type with xq (its kv_quant_vec_type) */
typedef float (*kv_qdot_fn)(const void *row, const void *xq, int n);

/* The kernel for a ggml block type: AVX2 when avx2 is true and one exists,
 * else the portable reference.  NULL for a type that is not a block type. */
kv_qdot_fn kv_qdot_select(uint32_t type, bool avx2);

#endif
