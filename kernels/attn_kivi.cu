/*
 * Packed KIVI decode attention (see attn_kivi.cuh for the method).  Grid
 * (kv_heads, nsplit + nres_split): the first nsplit blocks of a KV head each
 * take a run of key groups (warps interleave groups), the rest attend the
 * fp16 residual tokens with the dense device code of attn_f16.cuh; every
 * block writes one partial record per query head and kv_attn_combine merges.
 * Two kernels: attn_kivi_split (v1, group 32) and attn_kivi2_split (v2,
 * group 64: fewer instructions and half the value MMAs; docs/BENCHMARKS.md,
 * Kernels, has the measurements of both and of v2's variants).  Both end in
 * kv_softmax_merge_store (attn_f16.cuh), the epilogue the fp16 blocks share.
 */
#include "attn_kivi.cuh"
#include "attn_kivi3.cuh"

#ifndef KV_KIVI2_MINB
#define KV_KIVI2_MINB 4 /* resident blocks per SM the v2 instances are compiled for */
#endif

template <int BITS, int G, int HPG>
struct kivi_cfg {
    static constexpr int D = KV_KIVI_D;
    static constexpr int RB = 16 * BITS;              /* code bytes per token row */
    static constexpr int NGV = D / (G < D ? G : D);    /* value groups per token */
    static constexpr int GV = D / NGV;
    static constexpr int NROWS = HPG * NGV;            /* value-MMA rows used */
    static constexpr int MT = G / 16;                  /* 16-token tiles per group */
    static constexpr int KS = D / 16;                  /* 16-channel k-steps */
    static constexpr float FOLD = BITS == 1 ? 0.5f : 1.0f;
    /* staging layout of one group, in 16-byte units */
    static constexpr int O_VC = G * RB / 16;
    static constexpr int O_KS = 2 * O_VC;
    static constexpr int O_KZ = O_KS + D / 8;
    static constexpr int O_VS = O_KZ + D / 8;
    static constexpr int O_VZ = O_VS + G * NGV / 8;
    static constexpr int TOTAL = O_VZ + G * NGV / 8;
    static constexpr int NLD = (TOTAL + 31) / 32;
    static_assert(G % 16 == 0 && HPG * NGV <= 16, "value rows fit one MMA tile");
    static_assert(G * NGV % 8 == 0, "value scales of a group are whole 16-byte units");
};

struct kivi_args {
    const __half *q;
    const uint8_t *kc, *vc;
    const __half *ks, *kz, *vs, *vz, *kres, *vres;
    float *part;
    int nq, ng, nres, gps, nsplit_p, nsplit, res_tps;
    float qscale;
};

/* Start copying group gi's codes, scales and zeros into dst (this warp's
 * staging buffer) with cp.async, 16 bytes per lane per step, coalesced. */
template <class C>
__device__ __forceinline__ void kivi_stage_async(uint4 *dst, const kivi_args &a, int kvh, int gi,
                                                 int lane)
{
    const uint4 *kc = reinterpret_cast<const uint4 *>(a.kc + ((size_t)kvh * a.nq + (size_t)gi * (C::MT * 16)) * C::RB);
    const uint4 *vc = reinterpret_cast<const uint4 *>(a.vc + ((size_t)kvh * a.nq + (size_t)gi * (C::MT * 16)) * C::RB);
    const uint4 *ks = reinterpret_cast<const uint4 *>(a.ks + ((size_t)kvh * a.ng + gi) * C::D);
    const uint4 *kz = reinterpret_cast<const uint4 *>(a.kz + ((size_t)kvh * a.ng + gi) * C::D);
    const uint4 *vs = reinterpret_cast<const uint4 *>(a.vs + ((size_t)kvh * a.nq + (size_t)gi * (C::MT * 16)) * C::NGV);
    const uint4 *vz = reinterpret_cast<const uint4 *>(a.vz + ((size_t)kvh * a.nq + (size_t)gi * (C::MT * 16)) * C::NGV);
#pragma unroll
    for (int j = 0; j < C::NLD; j++) {
        int i = lane + 32 * j;
        if (i < C::TOTAL) {
            const uint4 *src = i < C::O_VC   ? kc + i
                               : i < C::O_KS ? vc + (i - C::O_VC)
                               : i < C::O_KZ ? ks + (i - C::O_KS)
                               : i < C::O_VS ? kz + (i - C::O_KZ)
                               : i < C::O_VZ ? vs + (i - C::O_VS)
                                             : vz + (i - C::O_VZ);
            kv_cp_async16(dst + i, src);
        }
    }
}

template <int BITS, int G, int HPG, int MINB>
__global__ void __launch_bounds__(KV_KIVI_THREADS, MINB)
    attn_kivi_split(kivi_args a)
{
    using C = kivi_cfg<BITS, G, HPG>;
    constexpr int D = C::D;
    __shared__ float qsm[HPG * D];
    __shared__ __align__(16) uint4 stage[2][KV_KIVI_WARPS][C::TOTAL]; /* double buffer */
    static_assert(2 * KV_KIVI_WARPS * C::TOTAL * 4 >= kv_f16_smem_floats(D, HPG),
                  "residual blocks borrow the staging area");
    __shared__ float psm[KV_KIVI_WARPS][HPG * G];
    __shared__ float corr_sm[KV_KIVI_WARPS][HPG];
    __shared__ float ml_sm[KV_KIVI_WARPS][HPG][2];

    const int kvh = blockIdx.x, split = blockIdx.y;
    kv_pdl_launch_next();
    kv_pdl_wait(); /* q (and the newest residual row) come from the kernel before */
    for (int i = threadIdx.x; i < HPG * D; i += KV_KIVI_THREADS)
        qsm[i] = __half2float(a.q[(size_t)kvh * HPG * D + i]) * a.qscale;
    __syncthreads();

    if (split >= a.nsplit_p) { /* fp16 residual tokens */
        kv_kivi_residual_split<D, HPG>(a, qsm, kvh, split, reinterpret_cast<float *>(&stage[0][0][0]));
        return;
    }

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    constexpr int LPH = 32 / HPG, TPL = G / LPH;
    const int hh = lane / LPH, li = lane % LPH;
    const int r0 = g, r1 = g + 8;
    const int h0 = r0 / C::NGV, h1 = r1 / C::NGV, gv0 = r0 % C::NGV, gv1 = r1 % C::NGV;
    const bool ok0 = r0 < C::NROWS, ok1 = r1 < C::NROWS;

    float O[16][4];
#pragma unroll
    for (int n = 0; n < 16; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) O[n][i] = 0.0f;
    float zacc0 = 0.0f, zacc1 = 0.0f, m_run = -INFINITY, l_run = 0.0f;

    float *ps = psm[warp];
    const int gstart = split * a.gps, gend = min(a.ng, gstart + a.gps);
    int gi = gstart + warp, buf = 0;
    if (gi < gend) kivi_stage_async<C>(stage[0][warp], a, kvh, gi, lane);
    kv_cp_async_commit();
    for (; gi < gend; gi += KV_KIVI_WARPS, buf ^= 1) {
        /* the next group streams into the other buffer while this one is used */
        if (gi + KV_KIVI_WARPS < gend)
            kivi_stage_async<C>(stage[buf ^ 1][warp], a, kvh, gi + KV_KIVI_WARPS, lane);
        kv_cp_async_commit();
        kv_cp_async_wait<1>();
        __syncwarp();
        const uint8_t *skc = reinterpret_cast<const uint8_t *>(stage[buf][warp]);
        const uint8_t *svc = skc + G * C::RB;
        const __half *sks = reinterpret_cast<const __half *>(stage[buf][warp] + C::O_KS);
        const __half *skz = reinterpret_cast<const __half *>(stage[buf][warp] + C::O_KZ);
        const __half *svs = reinterpret_cast<const __half *>(stage[buf][warp] + C::O_VS);
        const __half *svz = reinterpret_cast<const __half *>(stage[buf][warp] + C::O_VZ);

        /* The query folded with this group's key scales (B operand), and q . zero. */
        uint32_t bk[C::KS][2];
        float qz = 0.0f;
        if (g < HPG) {
            const float *qh = qsm + g * D;
#pragma unroll
            for (int s = 0; s < C::KS; s++) {
                float f[4];
#pragma unroll
                for (int slot = 0; slot < 4; slot++) {
                    int c = kv_kivi_key_chan<BITS>(t, s, slot);
                    f[slot] = qh[c] * __half2float(sks[c]) * C::FOLD;
                    qz = fmaf(qh[c], __half2float(skz[c]), qz);
                }
                bk[s][0] = kv_pack_half2(f[0], f[1]);
                bk[s][1] = kv_pack_half2(f[2], f[3]);
            }
        } else {
#pragma unroll
            for (int s = 0; s < C::KS; s++) bk[s][0] = bk[s][1] = 0u;
        }
        qz += __shfl_xor_sync(KV_FULL_MASK, qz, 1);
        qz += __shfl_xor_sync(KV_FULL_MASK, qz, 2);
        const float qza = __shfl_sync(KV_FULL_MASK, qz, 8 * t);
        const float qzb = __shfl_sync(KV_FULL_MASK, qz, 8 * t + 4);

        /* Scores, 16 tokens per tile. */
#pragma unroll
        for (int mt = 0; mt < C::MT; mt++) {
            const int ra = mt * 16 + g, rb = ra + 8;
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if constexpr (BITS == 1) {
                uint32_t wa = reinterpret_cast<const uint32_t *>(skc + ra * C::RB)[t];
                uint32_t wb = reinterpret_cast<const uint32_t *>(skc + rb * C::RB)[t];
#pragma unroll
                for (int s = 0; s < C::KS; s++) {
                    uint32_t af[4] = {kv_bits1_pair(wa, 2 * s), kv_bits1_pair(wb, 2 * s),
                                      kv_bits1_pair(wa, 2 * s + 1), kv_bits1_pair(wb, 2 * s + 1)};
                    uint32_t bf[2] = {bk[s][0], bk[s][1]};
                    kv_mma_16816(c, af, bf);
                }
            } else {
                uint2 wa = reinterpret_cast<const uint2 *>(skc + ra * C::RB)[t];
                uint2 wb = reinterpret_cast<const uint2 *>(skc + rb * C::RB)[t];
#pragma unroll
                for (int s = 0; s < C::KS; s++) {
                    uint32_t af[4] = {kv_bits2_pair(wa.x, s), kv_bits2_pair(wb.x, s),
                                      kv_bits2_pair(wa.y, s), kv_bits2_pair(wb.y, s)};
                    uint32_t bf[2] = {bk[s][0], bk[s][1]};
                    kv_mma_16816(c, af, bf);
                }
            }
            if (2 * t < HPG) {
                ps[(2 * t) * G + ra] = c[0] + qza;
                ps[(2 * t) * G + rb] = c[2] + qza;
            }
            if (2 * t + 1 < HPG) {
                ps[(2 * t + 1) * G + ra] = c[1] + qzb;
                ps[(2 * t + 1) * G + rb] = c[3] + qzb;
            }
        }
        __syncwarp();

        /* Online softmax over the group: LPH lanes per head. */
        {
            const float corr = kv_kivi_softmax_step<TPL, LPH, 1>(ps + hh * G + li * TPL, m_run, l_run);
            if (li == 0) corr_sm[warp][hh] = corr;
        }
        __syncwarp();

        const float cr0 = ok0 ? corr_sm[warp][h0] : 1.0f, cr1 = ok1 ? corr_sm[warp][h1] : 1.0f;
        if (__any_sync(KV_FULL_MASK, cr0 != 1.0f || cr1 != 1.0f)) {
#pragma unroll
            for (int n = 0; n < 16; n++) {
                O[n][0] *= cr0;
                O[n][1] *= cr0;
                O[n][2] *= cr1;
                O[n][3] *= cr1;
            }
            zacc0 *= cr0;
            zacc1 *= cr1;
        }

        /* Values, 16 tokens per tile: A = p * value scale, B = codes. */
#pragma unroll
        for (int kt = 0; kt < C::MT; kt++) {
            const int ta = kt * 16 + 2 * t, tb = ta + 1, tc = ta + 8, td = ta + 9;
            uint32_t af[4] = {0u, 0u, 0u, 0u};
            if (ok0) {
                const float *p = ps + h0 * G;
                af[0] = kv_pack_half2(p[ta] * __half2float(svs[ta * C::NGV + gv0]) * C::FOLD,
                                      p[tb] * __half2float(svs[tb * C::NGV + gv0]) * C::FOLD);
                af[2] = kv_pack_half2(p[tc] * __half2float(svs[tc * C::NGV + gv0]) * C::FOLD,
                                      p[td] * __half2float(svs[td * C::NGV + gv0]) * C::FOLD);
                zacc0 += p[ta] * __half2float(svz[ta * C::NGV + gv0]) +
                         p[tb] * __half2float(svz[tb * C::NGV + gv0]) +
                         p[tc] * __half2float(svz[tc * C::NGV + gv0]) +
                         p[td] * __half2float(svz[td * C::NGV + gv0]);
            }
            if (ok1) {
                const float *p = ps + h1 * G;
                af[1] = kv_pack_half2(p[ta] * __half2float(svs[ta * C::NGV + gv1]) * C::FOLD,
                                      p[tb] * __half2float(svs[tb * C::NGV + gv1]) * C::FOLD);
                af[3] = kv_pack_half2(p[tc] * __half2float(svs[tc * C::NGV + gv1]) * C::FOLD,
                                      p[td] * __half2float(svs[td * C::NGV + gv1]) * C::FOLD);
                zacc1 += p[ta] * __half2float(svz[ta * C::NGV + gv1]) +
                         p[tb] * __half2float(svz[tb * C::NGV + gv1]) +
                         p[tc] * __half2float(svz[tc * C::NGV + gv1]) +
                         p[td] * __half2float(svz[td * C::NGV + gv1]);
            }
            if constexpr (BITS == 1) {
                const int wi = g >> 1;
                const unsigned sel = (g & 1) ? 0x7632u : 0x5410u;
                uint32_t y0 = __byte_perm(reinterpret_cast<const uint32_t *>(svc + ta * C::RB)[wi],
                                          reinterpret_cast<const uint32_t *>(svc + tb * C::RB)[wi], sel);
                uint32_t y1 = __byte_perm(reinterpret_cast<const uint32_t *>(svc + tc * C::RB)[wi],
                                          reinterpret_cast<const uint32_t *>(svc + td * C::RB)[wi], sel);
#pragma unroll
                for (int n = 0; n < 16; n++) {
                    uint32_t bf[2] = {kv_bits1_pair(y0, n), kv_bits1_pair(y1, n)};
                    kv_mma_16816(O[n], af, bf);
                }
            } else {
                uint32_t wa = reinterpret_cast<const uint32_t *>(svc + ta * C::RB)[g];
                uint32_t wb = reinterpret_cast<const uint32_t *>(svc + tb * C::RB)[g];
                uint32_t wc = reinterpret_cast<const uint32_t *>(svc + tc * C::RB)[g];
                uint32_t wd = reinterpret_cast<const uint32_t *>(svc + td * C::RB)[g];
                uint32_t y0l = __byte_perm(wa, wb, 0x5410u), y0h = __byte_perm(wa, wb, 0x7632u);
                uint32_t y1l = __byte_perm(wc, wd, 0x5410u), y1h = __byte_perm(wc, wd, 0x7632u);
#pragma unroll
                for (int n = 0; n < 16; n++) {
                    uint32_t bf[2] = {kv_bits2_pair(n < 8 ? y0l : y0h, n & 7),
                                      kv_bits2_pair(n < 8 ? y1l : y1h, n & 7)};
                    kv_mma_16816(O[n], af, bf);
                }
            }
        }
        __syncwarp(); /* all lanes are done with this buffer before it is refilled */
    }
    kv_cp_async_wait<0>();

    /* Per warp: add the value-zero terms and spill the output to shared memory
     * (reusing this warp's staging area: the loop above is done with it). */
    zacc0 += __shfl_xor_sync(KV_FULL_MASK, zacc0, 1);
    zacc0 += __shfl_xor_sync(KV_FULL_MASK, zacc0, 2);
    zacc1 += __shfl_xor_sync(KV_FULL_MASK, zacc1, 1);
    zacc1 += __shfl_xor_sync(KV_FULL_MASK, zacc1, 2);
    static_assert(C::TOTAL * 16 >= HPG * D * 4, "staging area holds one warp's output");
    __syncwarp();
    float *osm = reinterpret_cast<float *>(stage[0][warp]);
#pragma unroll
    for (int n = 0; n < 16; n++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = i < 2 ? r0 : r1;
            const int c = 16 * (2 * t + (i & 1)) + n;
            if (r < C::NROWS && c / C::GV == r % C::NGV)
                osm[(r / C::NGV) * D + c] = O[n][i] + (i < 2 ? zacc0 : zacc1);
        }
    }
    if (li == 0) {
        ml_sm[warp][hh][0] = m_run;
        ml_sm[warp][hh][1] = l_run;
    }
    __syncthreads();
    kv_softmax_merge_store<D, HPG, KV_KIVI_WARPS, KV_KIVI_THREADS>(
        &ml_sm[0][0][0], reinterpret_cast<const float *>(&stage[0][0][0]), C::TOTAL * 4, a.part,
        kvh * HPG, split, a.nsplit);
}

// --- v2: cheaper unpack and fold, values on the channel axis ----------------------------
/*
 * The same staging, online softmax and epilogue merge as above, for the
 * Llama geometry (G 64, two value groups of 64 channels), with three changes
 * that cut the warp instructions per group (v1: about 1,200):
 *   - keys, 1 bit: one shift serves two k-steps' slots: after w << (13 - 2s)
 *     bit 2s+1 sits at bit 14 (half 2.0) and bit 2s at bit 13 (half 2^-7),
 *     so each half2 costs one AND (v1: shift and AND each);  the query
 *     operand carries the inverse factor (0.5 or 128);
 *   - the fold: the query pairs q * scale * log2(e) * factor are made once
 *     per block (half2 registers); per group a key-scale pair is one PRMT
 *     and the folded operand one HMUL2; q . zero is 8 MMAs with the zeros as
 *     A (every row the same) instead of per-lane FMAs;
 *   - values: O^T (channels x heads) += codes^T (channels x tokens) *
 *     P' (tokens x heads).  Each 16-channel tile lies in one value group, so
 *     B = p * value_scale is built once per (16 tokens, group) from fp16
 *     pairs, and rows carry channels, not (head, group) with half of them
 *     padding: 32 MMAs per group instead of 64.  Columns HPG..2HPG-1 of B
 *     carry p * value_zero, which one MMA with A = 1 sums per tile.
 */
template <int BITS>
struct kv2_keys {
    /* channel (within a lane's 32-channel span) of half `hi` of k slot pair j at step s */
    static __host__ __device__ constexpr int chan(int s, int j, int hi)
    {
        return BITS == 1 ? (j == 0 ? 2 * s + 1 : 2 * s) + 16 * hi : (j == 0 ? s : 16 + s) + 8 * hi;
    }
    /* factor folded into the query for slot pair j (inverse of the code's half value) */
    static __host__ __device__ constexpr float fold(int j)
    {
        return BITS == 1 ? (j == 0 ? 0.5f : 128.0f) : 1.0f;
    }
};

/*
 * One-instruction 1-bit unpack (variant 4): for bit position p (8..15) of
 * each half, (w & (0x00010001 << p)) | c_p is a half that is an affine
 * function alpha_p + beta_p * bit: the sign bit (p 15) gives 1 / -1, an
 * exponent bit (10..14) scales a power of two to 1.0 or 4.0, a high mantissa
 * bit (8, 9) adds 1/4 or 1/2 to 1.0.  Lower mantissa bits would put a large
 * constant under a small step, so bits 0..7 are first shifted up by 8.
 * beta is folded into the other operand, alpha is removed with the sum of
 * that operand (one extra MMA per k-step for keys; the value-scale sums the
 * value stage already has for values).
 */
__host__ __device__ constexpr uint32_t kv2_c(int p)
{
    return 0x00010001u * (p == 15 ? 0x3C00u : p == 14 ? 0x0400u : p == 13 ? 0x1C00u
                          : p == 12 ? 0x2C00u : p == 11 ? 0x3400u : p == 10 ? 0x3800u : 0x3C00u);
}
__host__ __device__ constexpr float kv2_alpha(int p)
{
    return p == 15 ? 1.0f : p == 14 ? 6.103515625e-05f : p == 13 ? 0.00390625f : p == 12 ? 0.0625f
           : p == 11 ? 0.25f : p == 10 ? 0.5f : 1.0f;
}
__host__ __device__ constexpr float kv2_beta(int p)
{
    return p == 15 ? -2.0f : p == 14 ? 3.99993896484375f : p == 13 ? 0.99609375f : p == 12 ? 0.9375f
           : p == 11 ? 0.75f : p == 10 ? 0.5f : p == 9 ? 0.5f : 0.25f;
}
__device__ __forceinline__ uint32_t kv2_bit(uint32_t w, int p)
{
    return (w & (0x00010001u << p)) | kv2_c(p);
}

/* Key slot channels and query factors of v2 (ALPHA: variant 4). */
template <int BITS, bool ALPHA>
struct kv2k {
    static __host__ __device__ constexpr int chan(int s, int j, int hi)
    {
        return ALPHA ? (j == 0 ? 8 + s : s) + 16 * hi : kv2_keys<BITS>::chan(s, j, hi);
    }
    static __host__ __device__ constexpr float fold(int s, int j)
    {
        return ALPHA ? 1.0f / kv2_beta(8 + s) : kv2_keys<BITS>::fold(j);
    }
    static __host__ __device__ constexpr float unfold(int s, int j)
    {
        return ALPHA ? kv2_beta(8 + s) : 1.0f / kv2_keys<BITS>::fold(j);
    }
};

/* Variants (VAR bits), for measurement: 1 starts the score MMAs from zero
 * and adds q . zero at the store (the zero MMAs leave the critical path);
 * 2 pads each head's row of scores to G + 8 floats and has softmax lanes
 * read interleaved elements (no bank conflicts);  the diagnostics give wrong
 * results and exist only to time stages: 8 leaves out the value stage,
 * 16 the key unpack and score MMAs, 32 everything but the staging. */
#define KV2_VAR_ZLATE 1
#define KV2_VAR_PAD 2
#define KV2_VAR_ALPHA 4
#define KV2_DIAG_NOV 8
#define KV2_DIAG_NOK 16
#define KV2_DIAG_MEM 32

template <int BITS, int HPG, int MINB, int VAR = 0>
__global__ void __launch_bounds__(KV_KIVI_THREADS, MINB)
    attn_kivi2_split(kivi_args a)
{
    constexpr int G = 64;
    constexpr int PST = (VAR & KV2_VAR_PAD) ? G + 8 : G; /* floats per head row of scores */
    using C = kivi_cfg<BITS, G, HPG>;
    constexpr bool ALPHA = BITS == 1 && (VAR & KV2_VAR_ALPHA) != 0;
    using KK = kv2k<BITS, ALPHA>;
    constexpr int D = C::D;
    static_assert(C::NGV == 2, "v2 is written for two value groups per token");
    __shared__ float qsm[HPG * D];
    __shared__ __align__(16) uint4 stage[2][KV_KIVI_WARPS][C::TOTAL];
    static_assert(2 * KV_KIVI_WARPS * C::TOTAL * 4 >= kv_f16_smem_floats(D, HPG),
                  "residual blocks borrow the staging area");
    __shared__ __align__(16) float psm[KV_KIVI_WARPS][HPG * PST];
    __shared__ float corr_sm[KV_KIVI_WARPS][HPG];
    __shared__ float ml_sm[KV_KIVI_WARPS][HPG][2];

    const int kvh = blockIdx.x, split = blockIdx.y;
    kv_pdl_launch_next();
    kv_pdl_wait(); /* q (and the newest residual row) come from the kernel before */
    for (int i = threadIdx.x; i < HPG * D; i += KV_KIVI_THREADS)
        qsm[i] = __half2float(a.q[(size_t)kvh * HPG * D + i]) * a.qscale;
    __syncthreads();

    if (split >= a.nsplit_p) { /* fp16 residual tokens */
        kv_kivi_residual_split<D, HPG>(a, qsm, kvh, split, reinterpret_cast<float *>(&stage[0][0][0]));
        return;
    }

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    constexpr int LPH = 32 / HPG, TPL = G / LPH;
    const int hh = lane / LPH, li = lane % LPH;

    /* Query pairs (B operand of the key MMAs before the scales), head g. */
    uint32_t qf[C::KS][2];
    kv_kivi_fold_q<KK, C::KS, HPG, D>(qf, qsm, g, t);

    float O[8][4], Z[2][4];
    kv_kivi_clear(O);
    kv_kivi_clear(Z);
    float m_run = -INFINITY, l_run = 0.0f;

    /* B of the value MMAs: column g < HPG is head g times the value scale,
     * HPG <= g < 2 HPG is head g - HPG times the value zero. */
    const int vh = g % HPG;
    const bool vzero = ((g / HPG) & 1) != 0;

    float *ps = psm[warp];
    const int gstart = split * a.gps, gend = min(a.ng, gstart + a.gps);
    int gi = gstart + warp, buf = 0;
    if (gi < gend) kivi_stage_async<C>(stage[0][warp], a, kvh, gi, lane);
    kv_cp_async_commit();
    for (; gi < gend; gi += KV_KIVI_WARPS, buf ^= 1) {
        if (gi + KV_KIVI_WARPS < gend)
            kivi_stage_async<C>(stage[buf ^ 1][warp], a, kvh, gi + KV_KIVI_WARPS, lane);
        kv_cp_async_commit();
        kv_cp_async_wait<1>();
        __syncwarp();
        if constexpr ((VAR & KV2_DIAG_MEM) != 0) {
            __syncwarp();
            continue;
        }
        const uint8_t *skc = reinterpret_cast<const uint8_t *>(stage[buf][warp]);
        const uint8_t *svc = skc + G * C::RB;
        const __half *sks = reinterpret_cast<const __half *>(stage[buf][warp] + C::O_KS);
        const __half *skz = reinterpret_cast<const __half *>(stage[buf][warp] + C::O_KZ);
        const __half *svs = reinterpret_cast<const __half *>(stage[buf][warp] + C::O_VS);
        const __half *svz = reinterpret_cast<const __half *>(stage[buf][warp] + C::O_VZ);

        /* Fold: bk = q pair * key-scale pair; q . zero through 8 MMAs. */
        uint32_t bk[C::KS][2];
        float cz[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        {
            uint32_t w[16];
            kv_kivi_load16(w, sks + 32 * t);
#define KV2_FOLD(S)                                                                           \
    bk[S][0] = kv_kivi_hmul2(qf[S][0], kv_kivi_pair<KK::chan(S, 0, 0), KK::chan(S, 0, 1)>(w));          \
    bk[S][1] = kv_kivi_hmul2(qf[S][1], kv_kivi_pair<KK::chan(S, 1, 0), KK::chan(S, 1, 1)>(w));
            KV2_FOLD(0) KV2_FOLD(1) KV2_FOLD(2) KV2_FOLD(3) KV2_FOLD(4) KV2_FOLD(5) KV2_FOLD(6) KV2_FOLD(7)
#undef KV2_FOLD
            kv_kivi_load16(w, skz + 32 * t);
#define KV2_ZERO(S)                                                                           \
    {                                                                                         \
        uint32_t z0 = kv_kivi_hmul2(kv_kivi_pair<KK::chan(S, 0, 0), KK::chan(S, 0, 1)>(w),           \
                                kv_pack_half2(KK::unfold(S, 0), KK::unfold(S, 0)));           \
        uint32_t z1 = kv_kivi_hmul2(kv_kivi_pair<KK::chan(S, 1, 0), KK::chan(S, 1, 1)>(w),           \
                                kv_pack_half2(KK::unfold(S, 1), KK::unfold(S, 1)));           \
        uint32_t az[4] = {z0, z0, z1, z1};                                                    \
        uint32_t bq[2] = {qf[S][0], qf[S][1]};                                                \
        kv_mma_16816(cz, az, bq);                                                             \
        if constexpr (ALPHA) {                                                                \
            const uint32_t na = kv_pack_half2(-kv2_alpha(8 + S), -kv2_alpha(8 + S));          \
            uint32_t aa[4] = {na, na, na, na};                                                \
            uint32_t bb[2] = {bk[S][0], bk[S][1]};                                            \
            kv_mma_16816(cz, aa, bb);                                                         \
        }                                                                                     \
    }
            KV2_ZERO(0) KV2_ZERO(1) KV2_ZERO(2) KV2_ZERO(3) KV2_ZERO(4) KV2_ZERO(5) KV2_ZERO(6) KV2_ZERO(7)
#undef KV2_ZERO
        }

        /* Scores, 16 tokens per tile, starting from q . zero. */
#pragma unroll
        for (int mt = 0; mt < C::MT; mt++) {
            const int ra = mt * 16 + g, rb = ra + 8;
            float c[4] = {cz[0], cz[1], cz[2], cz[3]};
            if constexpr ((VAR & KV2_VAR_ZLATE) != 0) c[0] = c[1] = c[2] = c[3] = 0.0f;
            if constexpr ((VAR & KV2_DIAG_NOK) != 0) {
            } else if constexpr (ALPHA) {
                const uint32_t wa = reinterpret_cast<const uint32_t *>(skc + ra * C::RB)[t];
                const uint32_t wb = reinterpret_cast<const uint32_t *>(skc + rb * C::RB)[t];
                const uint32_t wa8 = wa << 8, wb8 = wb << 8;
#pragma unroll
                for (int s = 0; s < C::KS; s++) {
                    uint32_t af[4] = {kv2_bit(wa, 8 + s), kv2_bit(wb, 8 + s), kv2_bit(wa8, 8 + s),
                                      kv2_bit(wb8, 8 + s)};
                    uint32_t bf[2] = {bk[s][0], bk[s][1]};
                    kv_mma_16816(c, af, bf);
                }
            } else if constexpr (BITS == 1) {
                uint32_t wa = reinterpret_cast<const uint32_t *>(skc + ra * C::RB)[t];
                uint32_t wb = reinterpret_cast<const uint32_t *>(skc + rb * C::RB)[t];
#define KV2_K1(S)                                                                             \
    {                                                                                         \
        uint32_t ya = kv_kivi_shift<13 - 2 * S>(wa), yb = kv_kivi_shift<13 - 2 * S>(wb);              \
        uint32_t af[4] = {ya & 0x40004000u, yb & 0x40004000u, ya & 0x20002000u, yb & 0x20002000u}; \
        uint32_t bf[2] = {bk[S][0], bk[S][1]};                                                \
        kv_mma_16816(c, af, bf);                                                              \
    }
                KV2_K1(0) KV2_K1(1) KV2_K1(2) KV2_K1(3) KV2_K1(4) KV2_K1(5) KV2_K1(6) KV2_K1(7)
#undef KV2_K1
            } else {
                uint2 wa = reinterpret_cast<const uint2 *>(skc + ra * C::RB)[t];
                uint2 wb = reinterpret_cast<const uint2 *>(skc + rb * C::RB)[t];
#pragma unroll
                for (int s = 0; s < C::KS; s++) {
                    uint32_t af[4] = {kv_bits2_pair(wa.x, s), kv_bits2_pair(wb.x, s),
                                      kv_bits2_pair(wa.y, s), kv_bits2_pair(wb.y, s)};
                    uint32_t bf[2] = {bk[s][0], bk[s][1]};
                    kv_mma_16816(c, af, bf);
                }
            }
            if constexpr ((VAR & KV2_VAR_ZLATE) != 0) {
#pragma unroll
                for (int e = 0; e < 4; e++) c[e] += cz[e];
            }
            kv_kivi_store_scores<HPG, PST>(ps, c, t, ra, rb);
        }
        __syncwarp();

        /* Online softmax over the group: LPH lanes per head (v1's, or
         * interleaved over a padded row). */
        {
            constexpr int JS = (VAR & KV2_VAR_PAD) ? LPH : 1; /* element stride of a lane */
            float *row = ps + hh * PST + ((VAR & KV2_VAR_PAD) ? li : li * TPL);
            const float corr = kv_kivi_softmax_step<TPL, LPH, JS>(row, m_run, l_run);
            if (li == 0) corr_sm[warp][hh] = corr;
        }
        __syncwarp();

        if constexpr ((VAR & KV2_DIAG_NOV) != 0) {
            __syncwarp();
            continue;
        }
        const float cra = corr_sm[warp][(2 * t) % HPG], crb = corr_sm[warp][(2 * t + 1) % HPG];
        if (__any_sync(KV_FULL_MASK, cra != 1.0f || crb != 1.0f)) kv_kivi_rescale(O, Z, cra, crb);

        /* Values, 16 tokens per step: O^T += codes^T * (p * scale). */
        const float *pv = ps + vh * PST;
        const __half *sv = vzero ? svz : svs;
#pragma unroll
        for (int kt = 0; kt < C::MT; kt++) {
            const int ta = kt * 16 + 2 * t, tc = ta + 8;
            uint32_t bv[2][2];
            {
                float2 pab = *reinterpret_cast<const float2 *>(pv + ta);
                float2 pcd = *reinterpret_cast<const float2 *>(pv + tc);
                uint2 sab = *reinterpret_cast<const uint2 *>(sv + 2 * ta);
                uint2 scd = *reinterpret_cast<const uint2 *>(sv + 2 * tc);
                float2 sa = __half22float2(*reinterpret_cast<const __half2 *>(&sab.x));
                float2 sb = __half22float2(*reinterpret_cast<const __half2 *>(&sab.y));
                float2 sc = __half22float2(*reinterpret_cast<const __half2 *>(&scd.x));
                float2 sd = __half22float2(*reinterpret_cast<const __half2 *>(&scd.y));
                bv[0][0] = kv_pack_half2(pab.x * sa.x, pab.y * sb.x);
                bv[1][0] = kv_pack_half2(pab.x * sa.y, pab.y * sb.y);
                bv[0][1] = kv_pack_half2(pcd.x * sc.x, pcd.y * sd.x);
                bv[1][1] = kv_pack_half2(pcd.x * sc.y, pcd.y * sd.y);
            }
            {
                const uint32_t one[4] = {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u};
                kv_mma_16816(Z[0], one, bv[0]);
                kv_mma_16816(Z[1], one, bv[1]);
            }
            if constexpr (BITS == 1) {
                /* lane g: byte g (channels 8g..8g+7, group 0) and byte g+8
                 * (64+8g.., group 1) of tokens ta, ta+1 and tc, tc+1 */
                const int wl = g >> 2;
                const unsigned sel = (unsigned)(g & 3) | ((unsigned)(4 + (g & 3)) << 4);
                const uint32_t *r0 = reinterpret_cast<const uint32_t *>(svc + ta * C::RB);
                const uint32_t *r1 = reinterpret_cast<const uint32_t *>(svc + (ta + 1) * C::RB);
                const uint32_t *r2 = reinterpret_cast<const uint32_t *>(svc + tc * C::RB);
                const uint32_t *r3 = reinterpret_cast<const uint32_t *>(svc + (tc + 1) * C::RB);
                uint32_t u0 = __byte_perm(r0[wl], r0[wl + 2], sel), u1 = __byte_perm(r1[wl], r1[wl + 2], sel);
                uint32_t u2 = __byte_perm(r2[wl], r2[wl + 2], sel), u3 = __byte_perm(r3[wl], r3[wl + 2], sel);
                const uint32_t yab = __byte_perm(u0, u1, 0x5410u), ycd = __byte_perm(u2, u3, 0x5410u);
                if constexpr (ALPHA) {
                    const uint32_t yab8 = yab << 8, ycd8 = ycd << 8;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const uint32_t sa = i < 4 ? yab8 : yab, sc = i < 4 ? ycd8 : ycd;
                        const int p0 = 8 + 2 * (i & 3);
                        uint32_t af[4] = {kv2_bit(sa, p0), kv2_bit(sa, p0 + 1), kv2_bit(sc, p0),
                                          kv2_bit(sc, p0 + 1)};
                        kv_mma_16816(O[i], af, bv[i >> 2]);
                    }
                } else {
#define KV2_V1(I)                                                                             \
    {                                                                                         \
        uint32_t s0 = kv_kivi_shift<13 - 2 * I>(yab), s1 = kv_kivi_shift<13 - 2 * I>(ycd);            \
        uint32_t af[4] = {s0 & 0x40004000u, s0 & 0x20002000u, s1 & 0x40004000u, s1 & 0x20002000u}; \
        kv_mma_16816(O[I], af, bv[(I) >> 2]);                                                 \
    }
                KV2_V1(0) KV2_V1(1) KV2_V1(2) KV2_V1(3) KV2_V1(4) KV2_V1(5) KV2_V1(6) KV2_V1(7)
#undef KV2_V1
                }
            } else {
                /* lane g: halfword g of each value group (bytes 2g, 2g+1 and 16+2g, 17+2g) */
                const int wl = g >> 1;
                const unsigned sel = (g & 1) ? 0x7632u : 0x5410u;
                const uint32_t *r0 = reinterpret_cast<const uint32_t *>(svc + ta * C::RB);
                const uint32_t *r1 = reinterpret_cast<const uint32_t *>(svc + (ta + 1) * C::RB);
                const uint32_t *r2 = reinterpret_cast<const uint32_t *>(svc + tc * C::RB);
                const uint32_t *r3 = reinterpret_cast<const uint32_t *>(svc + (tc + 1) * C::RB);
                uint32_t u0 = __byte_perm(r0[wl], r0[wl + 4], sel), u1 = __byte_perm(r1[wl], r1[wl + 4], sel);
                uint32_t u2 = __byte_perm(r2[wl], r2[wl + 4], sel), u3 = __byte_perm(r3[wl], r3[wl + 4], sel);
                const uint32_t yab[2] = {__byte_perm(u0, u1, 0x5410u), __byte_perm(u0, u1, 0x7632u)};
                const uint32_t ycd[2] = {__byte_perm(u2, u3, 0x5410u), __byte_perm(u2, u3, 0x7632u)};
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const int x = 2 * (i & 3);
                    uint32_t af[4] = {kv_bits2_pair(yab[i >> 2], x), kv_bits2_pair(yab[i >> 2], x + 1),
                                      kv_bits2_pair(ycd[i >> 2], x), kv_bits2_pair(ycd[i >> 2], x + 1)};
                    kv_mma_16816(O[i], af, bv[i >> 2]);
                }
            }
        }
        __syncwarp(); /* all lanes are done with this buffer before it is refilled */
    }
    kv_cp_async_wait<0>();

    /* Per warp: O^T tiles plus the value-zero sums into shared memory (this
     * warp's staging area), then merge the warps as v1. */
    float zv[2][2]; /* [group][column parity]: p . zero of head 2t + parity */
    kv_kivi_zero_cols<HPG>(zv, Z, g, t);
    static_assert(C::TOTAL * 16 >= HPG * D * 4, "staging area holds one warp's output");
    __syncwarp();
    float *osm = reinterpret_cast<float *>(stage[0][warp]);
#pragma unroll
    for (int i = 0; i < 8; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int n = 2 * t + (e & 1), r = e >> 1;
            if constexpr (ALPHA) {
                const int pp = 8 + 2 * (i & 3) + r;
                if (n < HPG)
                    osm[n * D + kv_kivi_vchan<2>(i, r, g)] =
                        (O[i][e] - kv2_alpha(pp) * Z[i >> 2][e & 1]) * (1.0f / kv2_beta(pp)) +
                        zv[i >> 2][e & 1];
            } else {
                const float f = BITS == 1 ? (r == 0 ? 0.5f : 128.0f) : 1.0f;
                if (n < HPG) osm[n * D + kv_kivi_vchan<BITS>(i, r, g)] = O[i][e] * f + zv[i >> 2][e & 1];
            }
        }
    }
    if (li == 0) {
        ml_sm[warp][hh][0] = m_run;
        ml_sm[warp][hh][1] = l_run;
    }
    __syncthreads();
    kv_softmax_merge_store<D, HPG, KV_KIVI_WARPS, KV_KIVI_THREADS>(
        &ml_sm[0][0][0], reinterpret_cast<const float *>(&stage[0][0][0]), C::TOTAL * 4, a.part,
        kvh * HPG, split, a.nsplit);
}

// --- host side ---------------------------------------------------------------------

typedef void (*kivi_kernel)(kivi_args);

/* Instances are compiled for four resident blocks per SM (a 128-register
 * cap, no spills at head_dim 128).  Group 64 is served by v2; a variant of
 * it (kv_cuda_tuning.kivi2_var, VAR bits above) where an instance of it is
 * compiled: 3 for every geometry, the diagnostics for 1 bit and 4 query
 * heads per KV head.  v1 serves group 32 (v2 is written for two value
 * groups of 64 channels); at group 64 it measured slower than v2
 * (docs/BENCHMARKS.md, Kernels: 63.8 against 50.7 us, 1 bit at 128k) and is
 * no longer compiled there. */
static kivi_kernel kivi_pick(int bits, int G, int hpg)
{
    const int var = kv_cuda_get_tuning()->kivi2_var;
    if (G == 64 && var != 0) {
#define KV_KIVI2_PICKV(B, H, V) \
    if (bits == B && hpg == H && var == V) return attn_kivi2_split<B, H, KV_KIVI2_MINB, V>;
        KV_KIVI2_PICKV(1, 4, 3) KV_KIVI2_PICKV(2, 4, 3) KV_KIVI2_PICKV(1, 2, 3)
        KV_KIVI2_PICKV(2, 2, 3) KV_KIVI2_PICKV(1, 1, 3) KV_KIVI2_PICKV(2, 1, 3)
        KV_KIVI2_PICKV(1, 4, 8) KV_KIVI2_PICKV(1, 4, 16) KV_KIVI2_PICKV(1, 4, 32)
        KV_KIVI2_PICKV(1, 4, 1) KV_KIVI2_PICKV(1, 4, 2) KV_KIVI2_PICKV(1, 4, 7)
        KV_KIVI2_PICKV(1, 2, 7) KV_KIVI2_PICKV(1, 1, 7) KV_KIVI2_PICKV(2, 4, 7)
        KV_KIVI2_PICKV(2, 2, 7) KV_KIVI2_PICKV(2, 1, 7)
        if (bits == 1 && hpg == 4 && var == 71) return attn_kivi2_split<1, 4, 3, 7>; /* 3 blocks/SM */
#undef KV_KIVI2_PICKV
    }
    if (G == 64) {
#define KV_KIVI2_PICK(B, H) \
    if (bits == B && hpg == H) return attn_kivi2_split<B, H, KV_KIVI2_MINB>;
        KV_KIVI2_PICK(1, 4) KV_KIVI2_PICK(2, 4) KV_KIVI2_PICK(1, 2) KV_KIVI2_PICK(2, 2)
        KV_KIVI2_PICK(1, 1) KV_KIVI2_PICK(2, 1)
#undef KV_KIVI2_PICK
    }
#define KV_KIVI_PICK(B, H) \
    if (bits == B && G == 32 && hpg == H) return attn_kivi_split<B, 32, H, 4>;
    KV_KIVI_PICK(1, 4) KV_KIVI_PICK(2, 4) KV_KIVI_PICK(1, 2) KV_KIVI_PICK(2, 2)
    KV_KIVI_PICK(1, 1) KV_KIVI_PICK(2, 1)
#undef KV_KIVI_PICK
    return nullptr;
}

/* Resident blocks per SM of a kernel instance, asked once. */
static cudaError_t kivi_occupancy(kivi_kernel k, int *per_sm)
{
    static thread_local kivi_kernel keys[32];
    static thread_local int vals[32];
    for (int i = 0; i < 32 && keys[i]; i++)
        if (keys[i] == k) {
            *per_sm = vals[i];
            return cudaSuccess;
        }
    int n = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, KV_KIVI_THREADS, 0));
    n = n < 1 ? 1 : n;
    for (int i = 0; i < 32; i++)
        if (!keys[i]) {
            keys[i] = k, vals[i] = n;
            break;
        }
    *per_sm = n;
    return cudaSuccess;
}

extern "C" int kv_cuda_attn_kivi_supported(const kv_attn_dims *d, const kv_kivi_params *prm)
{
    if (!d || !prm || d->n_heads < 1 || d->n_kv_heads < 1 || d->n_heads % d->n_kv_heads || d->T < 1 ||
        d->head_dim != KV_KIVI_D || prm->residual < 0)
        return 0;
    return kivi_pick(prm->bits, prm->group, d->n_heads / d->n_kv_heads) != nullptr ||
           (prm->bits == 4 && kv_kivi3_ok(d, prm)); /* 4 bits: v3 only */
}

struct kivi_plan {
    int nq, ng, nres, gps, nsplit_p, nsplit_r, res_tps;
};

static cudaError_t kivi_make_plan(const kv_attn_dims *d, const kv_kivi_params *prm,
                                  kivi_plan *p)
{
    kivi_kernel k = kivi_pick(prm->bits, prm->group, d->n_heads / d->n_kv_heads);
    int per_sm = 0;
    CUDA_CHECK(kivi_occupancy(k, &per_sm));
    p->nq = kv_kivi_nquant(d->T, prm->group, prm->residual);
    p->ng = p->nq / prm->group;
    p->nres = d->T - p->nq;
    p->res_tps = kv_f16_block_step(KV_KIVI_D);
    p->nsplit_r = (p->nres + p->res_tps - 1) / p->res_tps;
    int target = per_sm * kv_cuda_sm_count() - d->n_kv_heads * p->nsplit_r;
    int want = target / d->n_kv_heads;
    if (want < 1) want = 1;
    if (p->ng > 0) {
        int gps = (p->ng + want - 1) / want;
        p->gps = (gps + KV_KIVI_WARPS - 1) / KV_KIVI_WARPS * KV_KIVI_WARPS; /* whole groups per warp */
        p->nsplit_p = (p->ng + p->gps - 1) / p->gps;
    } else {
        p->gps = 1;
        p->nsplit_p = 0;
    }
    return cudaSuccess;
}

/* The kernel kv_cuda_tuning.kivi_kernel 0 means, per bit width: the faster
 * in the same device run (docs/BENCHMARKS.md, Packed attention v3, H200,
 * 128k): 1 bit v2 (46.8 against 48.1 us for v3), 2 bits v3 (60.5 against
 * 63.1 us; 23.5 against 27.8 at 32k); 4 bits have v3 only. */
#ifndef KV_KIVI_DEFAULT_KERNEL1
#define KV_KIVI_DEFAULT_KERNEL1 2
#endif
#ifndef KV_KIVI_DEFAULT_KERNEL2
#define KV_KIVI_DEFAULT_KERNEL2 3
#endif

static bool kivi_use_v3(const kv_attn_dims *d, const kv_kivi_params *prm)
{
    if (prm->bits == 4) return true; /* v2 has no 4-bit kernel (supported() checked v3) */
    int k = kv_cuda_get_tuning()->kivi_kernel;
    if (k == 0) k = prm->bits == 1 ? KV_KIVI_DEFAULT_KERNEL1 : KV_KIVI_DEFAULT_KERNEL2;
    return k == 3 && kv_kivi3_ok(d, prm);
}

extern "C" int kv_cuda_attn_kivi_kernel(const kv_attn_dims *d, const kv_kivi_params *prm)
{
    if (!kv_cuda_attn_kivi_supported(d, prm)) return 0;
    return kivi_use_v3(d, prm) ? 3 : 2;
}

/* Enough for either kernel, so that a workspace sized once serves both. */
extern "C" size_t kv_cuda_attn_kivi_workspace(const kv_attn_dims *d, const kv_kivi_params *prm)
{
    if (!kv_cuda_attn_kivi_supported(d, prm)) return 0;
    if (prm->bits == 4) return kv_kivi3_workspace(d, prm);
    kivi_plan p;
    if (kivi_make_plan(d, prm, &p) != cudaSuccess) return 0;
    size_t v2 = (size_t)d->n_heads * (p.nsplit_p + p.nsplit_r) * (d->head_dim + 2) * sizeof(float);
    size_t v3 = kv_kivi3_ok(d, prm) ? kv_kivi3_workspace(d, prm) : 0;
    return v2 > v3 ? v2 : v3;
}

extern "C" cudaError_t kv_cuda_attn_kivi(const kv_attn_dims *d, const kv_kivi_params *prm,
                                         const uint16_t *q, const kv_cuda_kivi_view *K,
                                         const kv_cuda_kivi_view *V, float *out, void *ws,
                                         size_t ws_bytes, cudaStream_t stream)
{
    KV_CHECK_ARGS(kv_cuda_attn_kivi_supported(d, prm) && q && K && V && out && ws);
    if (kivi_use_v3(d, prm)) return kv_kivi3_launch(d, prm, q, K, V, out, ws, ws_bytes, stream);
    kivi_plan p;
    CUDA_CHECK(kivi_make_plan(d, prm, &p));
    int nsplit = p.nsplit_p + p.nsplit_r;
    KV_CHECK_ARGS(ws_bytes >= (size_t)d->n_heads * nsplit * (d->head_dim + 2) * sizeof(float));
    kivi_args a;
    a.q = reinterpret_cast<const __half *>(q);
    a.kc = K->codes;
    a.vc = V->codes;
    a.ks = reinterpret_cast<const __half *>(K->scale);
    a.kz = reinterpret_cast<const __half *>(K->zero);
    a.vs = reinterpret_cast<const __half *>(V->scale);
    a.vz = reinterpret_cast<const __half *>(V->zero);
    a.kres = reinterpret_cast<const __half *>(K->resid);
    a.vres = reinterpret_cast<const __half *>(V->resid);
    a.part = static_cast<float *>(ws);
    a.nq = p.nq;
    a.ng = p.ng;
    a.nres = p.nres;
    a.gps = p.gps;
    a.nsplit_p = p.nsplit_p;
    a.nsplit = nsplit;
    a.res_tps = p.res_tps;
    a.qscale = d->scale * KV_LOG2E;
    kivi_kernel k = kivi_pick(prm->bits, prm->group, d->n_heads / d->n_kv_heads);
    CUDA_CHECK(kv_launch(2, k, dim3(d->n_kv_heads, nsplit), dim3(KV_KIVI_THREADS), 0, stream, a));
    return kv_attn_combine(a.part, d->n_heads, d->head_dim, nsplit, out, stream);
}
