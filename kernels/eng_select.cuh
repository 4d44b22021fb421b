/*
 * eng_select.cuh: what the sparse layers' selection kernels share between
 * eng_select.cu (channels, scores, softmax, top-K, gather, selection cache)
 * and eng_select_index.cu (the resident channel index and the page index).
 */
#ifndef ENG_SELECT_CUH
#define ENG_SELECT_CUH

#include "eng_common.cuh"

#define SEL_MAXG 8 /* query heads per KV head the selection kernels take */

/* Larger float -> larger key.  NaN ranks as -inf and -0 as +0, the order of
 * the CPU's selection (kv_policy_sparse.c): without that, a NaN's key
 * depends on its sign bit (the largest or the smallest of all), so which
 * tokens a NaN score displaces would depend on how it was produced. */
static __device__ __forceinline__ uint32_t ord_key(float f)
{
    if (f != f) f = -INFINITY;
    if (f == 0.0f) f = 0.0f;
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Histogram increment with the lanes of a warp that hit the same bin
 * combined first: the scores of one layer crowd into a few bins of the
 * top digits, and plain shared atomics then serialise 32-way. */
static __device__ __forceinline__ void hist_add(unsigned *hist, unsigned bin, bool active)
{
    unsigned act = __ballot_sync(0xffffffffu, active);
    if (!active) return;
    unsigned peers = __match_any_sync(act, bin);
    int leader = __ffs(peers) - 1;
    if ((int)(threadIdx.x & 31) == leader) atomicAdd(&hist[bin], (unsigned)__popc(peers));
}


#endif
