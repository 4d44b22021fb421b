/*
 * kv_dtype: names and sizes of the element types (kv_dtype.h).  The block
 * types take their names and block sizes from ggml's table (kv_ggml.c), so
 * the two spellings cannot drift apart.
 */
#include "common/kv_dtype.h"

#include <string.h>

#include "common/kv_ggml.h"
#include "common/kv_half.h"

/* With F16C where the CPU has it (8 at a time; the scalar conversion of an
 * 8B-shaped probe's kept queries, half a million values, took ~0.5 ms of a
 * query-aware load), else one by one: the same values, NaN as NaN. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
/* AVX with the OS saving YMM state, and F16C (by CPUID: clang's
 * __builtin_cpu_supports knows no "f16c") */
static bool have_f16c(void)
{
    static int known = -1;
    int k = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (k >= 0) return k;
    unsigned a, b, c, d;
    bool ok = __get_cpuid(1, &a, &b, &c, &d) && (c >> 27 & 1) && (c >> 28 & 1) && (c >> 29 & 1);
    if (ok) {
        unsigned lo, hi;
        __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        ok = (lo & 6) == 6;
    }
    __atomic_store_n(&known, ok, __ATOMIC_RELAXED);
    return ok;
}
__attribute__((target("avx,f16c"))) static void halves_f16c(const uint16_t *h, float *out, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) out[i] = kv_half_to_f32(h[i]);
}
#endif

void kv_halves_to_f32(const uint16_t *h, float *out, size_t n)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (have_f16c()) {
        halves_f16c(h, out, n);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++) out[i] = kv_half_to_f32(h[i]);
}

#define NO_GGML UINT32_MAX

static const struct {
    const char *name;
    size_t size;   /* bytes of one element; 0 for a block type */
    uint32_t ggml; /* ggml type number of a weight type, else NO_GGML */
} dtype_table[KV_DT_ALL] = {
    [KV_DT_F32] = {"F32", 4, KV_GGML_F32},    [KV_DT_F16] = {"F16", 2, KV_GGML_F16},
    [KV_DT_BF16] = {"BF16", 2, KV_GGML_BF16}, [KV_DT_I32] = {"I32", 4, NO_GGML},
    [KV_DT_U8] = {"U8", 1, NO_GGML},          [KV_DT_I8] = {"I8", 1, NO_GGML},
    [KV_DT_I64] = {"I64", 8, NO_GGML},        [KV_DT_U32] = {"U32", 4, NO_GGML},
    [KV_DT_Q8_0] = {"Q8_0", 0, KV_GGML_Q8_0}, [KV_DT_Q4_0] = {"Q4_0", 0, KV_GGML_Q4_0},
    [KV_DT_Q4_1] = {"Q4_1", 0, KV_GGML_Q4_1}, [KV_DT_Q5_0] = {"Q5_0", 0, KV_GGML_Q5_0},
    [KV_DT_Q5_1] = {"Q5_1", 0, KV_GGML_Q5_1}, [KV_DT_Q2_K] = {"Q2_K", 0, KV_GGML_Q2_K},
    [KV_DT_Q3_K] = {"Q3_K", 0, KV_GGML_Q3_K}, [KV_DT_Q4_K] = {"Q4_K", 0, KV_GGML_Q4_K},
    [KV_DT_Q5_K] = {"Q5_K", 0, KV_GGML_Q5_K}, [KV_DT_Q6_K] = {"Q6_K", 0, KV_GGML_Q6_K},
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
    if (!kv_dtype_is_block(dt)) return (size_t)cols * kv_dtype_size(dt);
    const kv_ggml_type_info *i = kv_ggml_type_info_of(dtype_table[dt].ggml);
    return (size_t)(cols / i->block) * (size_t)i->bytes;
}

bool kv_dtype_is_block(kv_dtype dt)
{
    return dt >= KV_DT_Q8_0 && dt < KV_DT_ALL;
}

int kv_dtype_block(kv_dtype dt)
{
    return kv_dtype_is_block(dt) ? kv_ggml_type_info_of(dtype_table[dt].ggml)->block : 1;
}

uint32_t kv_dtype_ggml(kv_dtype dt)
{
    return (unsigned)dt < KV_DT_ALL ? dtype_table[dt].ggml : NO_GGML;
}

kv_dtype kv_dtype_from_ggml(uint32_t ggml_type)
{
    for (int t = 0; t < KV_DT_ALL; t++)
        if (dtype_table[t].ggml == ggml_type) return (kv_dtype)t;
    return KV_DT_AUTO;
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
