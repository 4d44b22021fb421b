/*
 * Decode attention from KIVI-packed K/V (1 or 2 bits, head_dim 128) on the
 * tensor cores.  One warp takes one key group of G tokens at a time:
 *
 *   scores  S(16 tokens x 8 cols) = A(codes, 16 x 16 channels) * B(folded query)
 *           per 16-token tile and 16-channel step; column n < HPG is query
 *           head n, B = q * key_scale (one group's scales folded in once), and
 *           the group's q . key_zero is added afterwards;
 *   values  O(16 rows x 8 channels) += A(p * value_scale) * B(codes),
 *           row r = head * NGV + value group; the value zeros enter through
 *           sum_t p_t * zero_t kept per row.
 *
 * The MMA's k index can be any permutation of channels as long as A and B
 * agree, so each lane takes its codes straight out of one 32-bit word of a
 * token row: for 1 bit, (w << (14 - x)) & 0x40004000 turns bits x and x+16
 * into the halves 0.0 / 2.0 (the 1/2 is folded into the other operand); for
 * 2 bits, ((w >> 2x) & 0x00030003) | 0x64006400 is 1024 + code, minus 1024.
 * Codes, scales and zeros of a group are staged through shared memory with
 * 16-byte coalesced loads, the next group's loads in flight meanwhile.
 */
#ifndef KV_ATTN_KIVI_CUH
#define KV_ATTN_KIVI_CUH

#include "attn_f16.cuh"

#define KV_KIVI_THREADS 128
#define KV_KIVI_WARPS (KV_KIVI_THREADS / 32)
#define KV_KIVI_D 128

/* Channel of k slot `slot` (0..3: k = 2t, 2t+1, 2t+8, 2t+9) of k-step s for
 * lanes with t = lane & 3, in the score MMA. */
template <int BITS>
__host__ __device__ constexpr int kv_kivi_key_chan(int t, int s, int slot)
{
    return BITS == 1 ? 32 * t + 2 * s + (slot & 1) * 16 + (slot >> 1)
                     : 32 * t + s + (slot & 1) * 8 + (slot >> 1) * 16;
}

/* Two codes as a half2: 1 bit -> {0, 2} from bits x and x+16 of w. */
__device__ __forceinline__ uint32_t kv_bits1_pair(uint32_t w, int x)
{
    return (x <= 14 ? (w << (14 - x)) : (w >> (x - 14))) & 0x40004000u;
}

/* Two 2-bit codes at bits 2x and 2x+16 of w as a half2 {c0, c1}, exact. */
__device__ __forceinline__ uint32_t kv_bits2_pair(uint32_t w, int x)
{
    uint32_t h = ((w >> (2 * x)) & 0x00030003u) | 0x64006400u;
    __half2 r = __hsub2(*reinterpret_cast<__half2 *>(&h), __halves2half2(__ushort_as_half(0x6400),
                                                                          __ushort_as_half(0x6400)));
    return *reinterpret_cast<uint32_t *>(&r);
}

#endif
