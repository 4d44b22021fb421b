/*
 * kv_finite: the one test for non-finite values (NaN, +-inf) that every
 * consumer of K/V, weights and logits applies before it computes with them.
 * A policy cannot rank, quantize or attend over NaN, so the library refuses
 * such input with KV_E_DATA and names the tensor and element, rather than
 * producing NaN output (or, before the selection order was fixed, looping).
 */
#ifndef KV_FINITE_H
#define KV_FINITE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_status.h"

/* Index of the first NaN or infinite value of x (n), or SIZE_MAX if none. */
static inline size_t kv_first_nonfinite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return i;
    return SIZE_MAX;
}

/* KV_OK, or KV_E_DATA naming the first NaN or infinite element of the
 * (A, B, C) float tensor `name` (a .kvc's "layers.3.k": heads, tokens,
 * channels) and what cannot work with it. */
static inline kv_status kv_check_finite3(const char *name, const float *x, int64_t A, int64_t B, int64_t C,
                                         const char *who)
{
    size_t i = kv_first_nonfinite(x, (size_t)(A * B * C));
    if (i == SIZE_MAX) return KV_OK;
    return kv_fail(KV_E_DATA, "%s[%lld, %lld, %lld] is %s: %s needs finite values", name,
                   (long long)(i / (size_t)(B * C)), (long long)(i / (size_t)C % (size_t)B),
                   (long long)(i % (size_t)C), isnan(x[i]) ? "NaN" : "infinite", who);
}

#endif
