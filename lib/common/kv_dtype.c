/*
 * kv_dtype: names and sizes of the element types (kv_dtype.h).
 */
#include "common/kv_dtype.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} dtype_table[KV_DT_ALL] = {
    [KV_DT_F32] = {"F32", 4}, [KV_DT_F16] = {"F16", 2}, [KV_DT_BF16] = {"BF16", 2},
    [KV_DT_I32] = {"I32", 4}, [KV_DT_U8] = {"U8", 1},   [KV_DT_I8] = {"I8", 1},
    [KV_DT_I64] = {"I64", 8}, [KV_DT_U32] = {"U32", 4}, [KV_DT_Q8_0] = {"Q8_0", 0},
};

size_t kv_dtype_size(kv_dtype dt)
{
    return (unsigned)dt < KV_DT_ALL ? dtype_table[dt].size : 0;
}

const char *kv_dtype_name(kv_dtype dt)
{
    return (unsigned)dt < KV_DT_ALL ? dtype_table[dt].name : "?";
}

kv_status kv_dtype_parse(const char *s, kv_dtype *out)
{
    for (int i = 0; i < KV_DT_COUNT; i++) {
        if (strcmp(s, dtype_table[i].name) == 0) {
            *out = (kv_dtype)i;
            return KV_OK;
        }
    }
    return kv_fail(KV_E_DATA, "unknown dtype '%.32s'", s);
}

size_t kv_dtype_row_bytes(kv_dtype dt, int64_t cols)
{
    if (dt == KV_DT_Q8_0) return (size_t)(cols / KV_Q8_0_BLOCK) * KV_Q8_0_BYTES;
    return (size_t)cols * kv_dtype_size(dt);
}

const char *kv_float_dtype_name(kv_dtype d)
{
    return d == KV_DT_F16 ? "f16" : d == KV_DT_BF16 ? "bf16" : "f32";
}

kv_status kv_float_dtype_parse(const char *s, kv_dtype *out)
{
    if (!strcmp(s, "f32")) *out = KV_DT_F32;
    else if (!strcmp(s, "f16")) *out = KV_DT_F16;
    else if (!strcmp(s, "bf16")) *out = KV_DT_BF16;
    else return kv_fail(KV_E_USAGE, "unknown KV dtype '%s' (f32, f16, bf16)", s);
    return KV_OK;
}
