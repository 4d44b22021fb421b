/*
 * kv_dtype: names and sizes of the element types (kv_dtype.h).
 */
#include "common/kv_dtype.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} dtype_table[KV_DT_COUNT] = {
    [KV_DT_F32] = {"F32", 4}, [KV_DT_F16] = {"F16", 2}, [KV_DT_BF16] = {"BF16", 2},
    [KV_DT_I32] = {"I32", 4}, [KV_DT_U8] = {"U8", 1},   [KV_DT_I8] = {"I8", 1},
    [KV_DT_I64] = {"I64", 8}, [KV_DT_U32] = {"U32", 4},
};

size_t kv_dtype_size(kv_dtype dt)
{
    return (unsigned)dt < KV_DT_COUNT ? dtype_table[dt].size : 0;
}

const char *kv_dtype_name(kv_dtype dt)
{
    return (unsigned)dt < KV_DT_COUNT ? dtype_table[dt].name : "?";
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
