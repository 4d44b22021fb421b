/*
 * kv_quants: the CPU reference for ggml weight types (block layouts in
 * common/kv_ggml.h): dequantize a row, quantize a row (this project's own
 * quantizer, written from the published layouts), quantize an activation
 * vector into the integer format the type's dot product takes, and the
 * plain (portable, scalar) dot product of a packed row with such a vector.
 * The fast kernels in kv_matmul.c and a GPU GEMV are tested against these.
 *
 * Types are ggml numbers (KV_GGML_*).  The dot products follow ggml's
 * scheme, so that results agree with llama.cpp's CPU backend: Q4_0, Q5_0
 * and Q8_0 rows meet Q8_0 activations, Q4_1 and Q5_1 rows Q8_1, the
 * K-quants Q8_K; F32 rows meet the float vector itself, F16 and BF16 rows
 * the vector rounded to their type (done in kv_matmul.c).
 */
#ifndef KV_QUANTS_H
#define KV_QUANTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_ggml.h"
#include "common/kv_status.h"

/* Can this code compute with rows of this type?  (F32, F16, BF16, Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.) */
bool kv_quant_supported(uint32_t type);
/* Is it a block type with an integer dot product (all but F32/F16/BF16)? */
bool kv_quant_is_block(uint32_t type);
/* Values per block (1 for F32/F16/BF16) and bytes of a row of n values
 * (n must be a multiple of the block); 0 for an unsupported type. */
int kv_quant_block(uint32_t type);
size_t kv_quant_row_bytes(uint32_t type, int64_t n);

/* dst (n) = the values of a packed row of n values. */
void kv_quant_dequant_row(uint32_t type, const void *src, float *dst, int64_t n);

/* Quantize n floats into a packed row of type (every supported type; F16
 * and BF16 round to nearest even).  n must be a multiple of the block:
 * KV_E_USAGE otherwise, KV_E_UNSUPPORTED for a type this code cannot write. */
kv_status kv_quant_quantize_row(uint32_t type, const float *src, void *dst, int64_t n);

/* The activation format of a block type's dot product (KV_GGML_Q8_0,
 * KV_GGML_Q8_1 or KV_GGML_Q8_K), and bytes of n values in it. */
uint32_t kv_quant_vec_type(uint32_t type);
size_t kv_quant_vec_bytes(uint32_t vec_type, int64_t n);
/* Quantize the activation vector x (n) into dst in vec_type, as ggml's
 * CPU backend does on x86 (round half to even). */
void kv_quant_activations(uint32_t vec_type, const float *x, void *dst, int64_t n);

/* Reference dot product of one packed row (n values) with activations xq
 * already in kv_quant_vec_type(type).  Integer sums per block, scaled and
 * accumulated in float. */
float kv_quant_dot_ref(uint32_t type, const void *row, const void *xq, int64_t n);

#endif
