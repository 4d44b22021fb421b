/*
 * kv_dtype: the one enum of element types in the library: tensor types of
 * .kvc files (their safetensors names), weight types of models (Q8_0 ...
 * Q6_K are ggml block types, laid out in common/kv_ggml.h), KV storage
 * types of the policies (f32, f16, bf16) and the GPU engine's weight and
 * kernel types.  It compiles as C and CUDA.
 */
#ifndef KV_DTYPE_H
#define KV_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    KV_DT_AUTO = -1, /* an option's "let the library choose"; never a tensor's type */
    KV_DT_F32 = 0,
    KV_DT_F16,
    KV_DT_BF16,
    KV_DT_I32,
    KV_DT_U8,
    KV_DT_I8,
    KV_DT_I64,
    KV_DT_U32,
    KV_DT_COUNT,              /* the element types (a .kvc tensor's) end here */
    /* ggml block types (weights only; layouts in common/kv_ggml.h), all
     * past KV_DT_COUNT: a row of n values is n / block blocks */
    KV_DT_Q8_0 = KV_DT_COUNT, /* blocks of 32: fp16 scale + 32 int8, 34 bytes */
    KV_DT_Q4_0,               /* blocks of 32, 18 bytes */
    KV_DT_Q4_1,               /* blocks of 32, 20 bytes */
    KV_DT_Q5_0,               /* blocks of 32, 22 bytes */
    KV_DT_Q5_1,               /* blocks of 32, 24 bytes */
    KV_DT_Q2_K,               /* super-blocks of 256, 84 bytes */
    KV_DT_Q3_K,               /* super-blocks of 256, 110 bytes */
    KV_DT_Q4_K,               /* super-blocks of 256, 144 bytes */
    KV_DT_Q5_K,               /* super-blocks of 256, 176 bytes */
    KV_DT_Q6_K,               /* super-blocks of 256, 210 bytes */
    KV_DT_ALL                 /* every type: the size of a table indexed by kv_dtype */
} kv_dtype;

#define KV_Q8_0_BLOCK 32
#define KV_Q8_0_BYTES 34

/* Bytes of one element; 0 for a block type (Q8_0 ... Q6_K) and out of range. */
size_t kv_dtype_size(kv_dtype dt);
/* "F32", "F16", "BF16", "I32", ... "Q8_0", "Q4_K" (safetensors and ggml spelling). */
const char *kv_dtype_name(kv_dtype dt);
/* The inverse for element types (a .kvc tensor's dtype); KV_E_DATA otherwise. */
kv_status kv_dtype_parse(const char *s, kv_dtype *out);
/* Bytes of one row of cols values (cols a multiple of the block for a
 * block type: 32 for Q4_0 ... Q8_0, 256 for the K-quants). */
size_t kv_dtype_row_bytes(kv_dtype dt, int64_t cols);

/* Is dt a ggml block type (Q8_0 ... Q6_K; its matvec quantizes the input)? */
bool kv_dtype_is_block(kv_dtype dt);
/* Values per block: 1 for an element type, 32 or 256 for a block type. */
int kv_dtype_block(kv_dtype dt);
/* The ggml type number of a weight type (F32, F16, BF16 and the block
 * types), UINT32_MAX for the others; and the inverse, KV_DT_AUTO for a ggml
 * number no weight type has. */
uint32_t kv_dtype_ggml(kv_dtype dt);
kv_dtype kv_dtype_from_ggml(uint32_t ggml_type);

/* The full-precision float types as options and policy specs spell them:
 * "f32", "f16", "bf16" (anything else is KV_E_USAGE). */
const char *kv_float_dtype_name(kv_dtype dt);
kv_status kv_float_dtype_parse(const char *s, kv_dtype *out);

/* out[i] = the IEEE half h[i] as a float, n of them (vectorised where the
 * CPU converts halves itself). */
void kv_halves_to_f32(const uint16_t *h, float *out, size_t n);

#ifdef __cplusplus
}
#endif

#endif
