/*
 * kv_dtype: the element types of tensors (the safetensors names of .kvc
 * files), in one enum for the whole library.
 */
#ifndef KV_DTYPE_H
#define KV_DTYPE_H

#include <stddef.h>

#include "common/kv_status.h"

typedef enum {
    KV_DT_F32 = 0,
    KV_DT_F16,
    KV_DT_BF16,
    KV_DT_I32,
    KV_DT_U8,
    KV_DT_I8,
    KV_DT_I64,
    KV_DT_U32,
    KV_DT_COUNT
} kv_dtype;

size_t kv_dtype_size(kv_dtype dt);
const char *kv_dtype_name(kv_dtype dt); /* safetensors spelling: "F32" ... */
kv_status kv_dtype_parse(const char *s, kv_dtype *out);

#endif
