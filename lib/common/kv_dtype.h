/*
 * kv_dtype: the one enum of element types in the library: tensor types of
 * .kvc files (their safetensors names), weight types of models (Q8_0 is a
 * ggml block type), KV storage types of the policies (f32, f16, bf16) and
 * the GPU engine's weight and kernel types.  It compiles as C and CUDA.
 */
#ifndef KV_DTYPE_H
#define KV_DTYPE_H

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
    KV_DT_Q8_0 = KV_DT_COUNT, /* ggml blocks of 32: fp16 scale + 32 int8, 34 bytes (weights only) */
    KV_DT_ALL                 /* every type: the size of a table indexed by kv_dtype */
} kv_dtype;

#define KV_Q8_0_BLOCK 32
#define KV_Q8_0_BYTES 34

/* Bytes of one element; 0 for a block type (Q8_0) and out of range. */
size_t kv_dtype_size(kv_dtype dt);
/* "F32", "F16", "BF16", "I32", ... "Q8_0" (safetensors and ggml spelling). */
const char *kv_dtype_name(kv_dtype dt);
/* The inverse for element types (a .kvc tensor's dtype); KV_E_DATA otherwise. */
kv_status kv_dtype_parse(const char *s, kv_dtype *out);
/* Bytes of one row of cols values (cols a multiple of 32 for Q8_0). */
size_t kv_dtype_row_bytes(kv_dtype dt, int64_t cols);

/* The full-precision float types as options and policy specs spell them:
 * "f32", "f16", "bf16" (anything else is KV_E_USAGE). */
const char *kv_float_dtype_name(kv_dtype dt);
kv_status kv_float_dtype_parse(const char *s, kv_dtype *out);

#ifdef __cplusplus
}
#endif

#endif
