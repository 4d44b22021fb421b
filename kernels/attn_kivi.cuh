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

// --- what the three packed kernels share (v1 and v2 in attn_kivi.cu, v3 in attn_kivi3.cu)
/* All of these are forced inline into kernels whose loops are unrolled, so
 * that array arguments stay in registers as they did when each kernel wrote
 * them out. */

/* w shifted left by K (right by -K). */
template <int K>
__device__ __forceinline__ uint32_t kv_kivi_shift(uint32_t w)
{
    return K >= 0 ? (w << (K & 31)) : (w >> ((-K) & 31));
}

__device__ __forceinline__ uint32_t kv_kivi_hmul2(uint32_t a, uint32_t b)
{
    __half2 r = __hmul2(*reinterpret_cast<__half2 *>(&a), *reinterpret_cast<__half2 *>(&b));
    return *reinterpret_cast<uint32_t *>(&r);
}

/* {h[c0], h[c1]} from 16 words holding 32 consecutive halves. */
template <int C0, int C1>
__device__ __forceinline__ uint32_t kv_kivi_pair(const uint32_t (&w)[16])
{
    return __byte_perm(w[C0 >> 1], w[C1 >> 1], ((C0 & 1) ? 0x32u : 0x10u) | ((C1 & 1) ? 0x7600u : 0x5400u));
}

/* 32 halves from p (16-byte aligned) as 16 words. */
__device__ __forceinline__ void kv_kivi_load16(uint32_t (&w)[16], const __half *p)
{
    const uint4 *s = reinterpret_cast<const uint4 *>(p);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint4 u = s[i];
        w[4 * i] = u.x, w[4 * i + 1] = u.y, w[4 * i + 2] = u.z, w[4 * i + 3] = u.w;
    }
}

/* Channel of value tile i, row half r (0: row g, 1: row g+8), for lane
 * group g, in v2's and v3's value MMAs (channels on the row axis). */
template <int BITS>
__host__ __device__ constexpr int kv_kivi_vchan(int i, int r, int g)
{
    return BITS == 1 ? 64 * (i >> 2) + 8 * g + 2 * (i & 3) + 1 - r : 64 * (i >> 2) + 8 * g + 2 * (i & 3) + r;
}

/* A split past the packed ones (split >= a.nsplit_p): its a.res_tps fp16
 * residual tokens through the fp16 kernels' block partial, in scratch
 * (kv_f16_smem_floats(D, HPG) floats).  A: kivi_args or kivi3_args. */
template <int D, int HPG, class A>
__device__ __forceinline__ void kv_kivi_residual_split(const A &a, const float *qsm, int kvh, int split,
                                                       float *scratch)
{
    const int t0 = (split - a.nsplit_p) * a.res_tps, t1 = min(a.nres, t0 + a.res_tps);
    const size_t off = (size_t)kvh * a.nres * D;
    kv_f16_block_partial<D, HPG, false>(qsm, a.kres + off, a.vres + off, t0, t1, a.part, kvh, split, a.nsplit,
                                        scratch);
}

/* Query pairs of head g (the B operand of the key MMAs before the scales):
 * lane t's channels KK::chan of each of the KS k-steps, times KK::fold;
 * zero for a lane group past the HPG heads. */
template <class KK, int KS, int HPG, int D>
__device__ __forceinline__ void kv_kivi_fold_q(uint32_t (&qf)[KS][2], const float *qsm, int g, int t)
{
#pragma unroll
    for (int s = 0; s < KS; s++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            float lo = 0.0f, hi = 0.0f;
            if (g < HPG) {
                lo = qsm[g * D + 32 * t + KK::chan(s, j, 0)] * KK::fold(s, j);
                hi = qsm[g * D + 32 * t + KK::chan(s, j, 1)] * KK::fold(s, j);
            }
            qf[s][j] = kv_pack_half2(lo, hi);
        }
}

template <int N, int M>
__device__ __forceinline__ void kv_kivi_clear(float (&x)[N][M])
{
#pragma unroll
    for (int i = 0; i < N; i++)
#pragma unroll
        for (int e = 0; e < M; e++) x[i][e] = 0.0f;
}

/* A score tile c (tokens ra and rb = ra + 8, heads 2t and 2t + 1 of the
 * MMA's C layout) into the warp's scores ps, PST floats a head. */
template <int HPG, int PST>
__device__ __forceinline__ void kv_kivi_store_scores(float *ps, const float (&c)[4], int t, int ra, int rb)
{
    if (2 * t < HPG) {
        ps[(2 * t) * PST + ra] = c[0];
        ps[(2 * t) * PST + rb] = c[2];
    }
    if (2 * t + 1 < HPG) {
        ps[(2 * t + 1) * PST + ra] = c[1];
        ps[(2 * t + 1) * PST + rb] = c[3];
    }
}

/* One group of the online softmax (base 2), LPH lanes a head: this lane's
 * TPL scores at row[0], row[JS], ... become exp2(score - m), m_run and l_run
 * move on; returns the factor the sums so far take. */
template <int TPL, int LPH, int JS>
__device__ __forceinline__ float kv_kivi_softmax_step(float *row, float &m_run, float &l_run)
{
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < TPL; j++) mx = fmaxf(mx, row[j * JS]);
#pragma unroll
    for (int o = LPH / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, o));
    const float mnew = fmaxf(m_run, mx);
    const float corr = kv_exp2_diff(m_run, mnew);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < TPL; j++) {
        const float p = exp2f(row[j * JS] - mnew);
        row[j * JS] = p;
        sum += p;
    }
#pragma unroll
    for (int o = LPH / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(KV_FULL_MASK, sum, o);
    l_run = l_run * corr + sum;
    m_run = mnew;
    return corr;
}

/* v2's and v3's O^T tiles and value-zero sums times the correction of
 * column 2t (cra) and 2t + 1 (crb). */
__device__ __forceinline__ void kv_kivi_rescale(float (&O)[8][4], float (&Z)[2][4], float cra, float crb)
{
#pragma unroll
    for (int i = 0; i < 8; i++) {
        O[i][0] *= cra, O[i][2] *= cra;
        O[i][1] *= crb, O[i][3] *= crb;
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        Z[i][0] *= cra, Z[i][2] *= cra;
        Z[i][1] *= crb, Z[i][3] *= crb;
    }
}

/* v2's and v3's p . zero of head 2t + e per value group, from the zero
 * columns HPG.. of the value-zero MMAs' C layout. */
template <int HPG>
__device__ __forceinline__ void kv_kivi_zero_cols(float (&zv)[2][2], const float (&Z)[2][4], int g, int t)
{
#pragma unroll
    for (int gv = 0; gv < 2; gv++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int col = (HPG + ((2 * t + e) % HPG)) % 8;
            const int src = g * 4 + (col >> 1);
            const float z0 = __shfl_sync(KV_FULL_MASK, Z[gv][0], src);
            const float z1 = __shfl_sync(KV_FULL_MASK, Z[gv][1], src);
            zv[gv][e] = (col & 1) ? z1 : z0;
        }
}

#endif
