/*
 * Packed KIVI decode attention, version 3 (issue 10): v2's tensor-core
 * arithmetic (attn_kivi.cu: values on the channel axis, the query folded
 * with the key scales once per group) with the structure changed where the
 * measurements of v2 put its time (docs/BENCHMARKS.md, issue 10 K10 and
 * "Packed attention v3"):
 *   - staging: each warp owns a ring of NST shared-memory stages (one key
 *     group of 64 tokens each: codes, scales, zeros) filled with 16-byte
 *     cp.async, so NST - 1 groups stream in while one is computed (v2: one);
 *   - the splits merge in the kernel: every block writes its partial record,
 *     the last block of each KV head to arrive (an atomic ticket) merges
 *     that head's records into the output, so there is no combine launch;
 *   - 2-bit codes without a subtraction: a code at mantissa bits 8-9 (or
 *     6-7) OR 1.0 is the half 1 + code/4 (1 + code/16), so one shift and
 *     two LOP3s give two operand registers (v2: shift, LOP3 and HSUB2 each);
 *     the constant 1 is removed by MMAs with A = -1 (keys, once per group)
 *     and by the value-scale sums v2 already makes (values); the factors
 *     4 and 16 go into the query (keys) or the output rows (values);
 *   - the value operand p * scale is made in half2 (HMUL2), not in fp32.
 * Grid (kv_heads, nsplit + residual splits) of 4-warp blocks; the residual
 * blocks are v2's (kv_f16_block_partial).  Group 64, head dim 128, 1, 2 or
 * 4 query heads per KV head, bits 1 or 2.
 */
#include "attn_kivi.cuh"
#include "attn_kivi3.cuh"

#include <atomic>

#define KV3_THREADS 128
#define KV3_WARPS 4
#define KV3_G 64
#define KV3_SLOTS 16 /* ticket sets: launches in flight on different streams take different ones */
#define KV3_MAXKV 64 /* KV heads a ticket set covers (more: the separate combine pass) */

/* The default merge of the splits (kivi3_unfused 1 and 2 choose): 0, the
 * combine pass (kv_attn_combine) after the kernel; 1, the last block of
 * each KV head.  The combine pass measured faster (docs/BENCHMARKS.md,
 * Packed attention v3: 48.1 against 49.9 us at 1 bit, 128k). */
#ifndef KV3_MERGE_IN_KERNEL
#define KV3_MERGE_IN_KERNEL 0
#endif

/* Tickets of the in-kernel merge; each launch's last block per head resets its own to 0. */
__device__ unsigned kv3_tickets[KV3_SLOTS * KV3_MAXKV];

template <int BITS> struct kv3_cfg {
    static constexpr int D = KV_KIVI_D;
    static constexpr int RB = 16 * BITS; /* code bytes per token row */
    static constexpr int NGV = 2;        /* value groups per token (64 channels each) */
    static constexpr int MT = KV3_G / 16;
    static constexpr int KS = D / 16;
    /* one stage (one group), in 16-byte units: K codes, V codes, K scale, K zero, V scale, V zero */
    static constexpr int O_VC = KV3_G * RB / 16;
    static constexpr int O_KS = 2 * O_VC;
    static constexpr int O_KZ = O_KS + D / 8;
    static constexpr int O_VS = O_KZ + D / 8;
    static constexpr int O_VZ = O_VS + KV3_G * NGV / 8;
    static constexpr int TOTAL = O_VZ + KV3_G * NGV / 8;
    static constexpr int NLD = (TOTAL + 31) / 32;
};

struct kivi3_args {
    const __half *q;
    const uint8_t *kc, *vc;
    const __half *ks, *kz, *vs, *vz, *kres, *vres;
    float *part, *out;
    unsigned *tickets; /* (n_kv_heads), or NULL: kv_attn_combine merges */
    int nq, ng, nres, gps, nsplit_p, nsplit, res_tps;
    int prefetch; /* bulk-prefetch each warp's first groups into L2 before the PDL wait */
    float qscale;
};

/* Dynamic shared memory of one block, in bytes (ring, query, scores, softmax state). */
template <int BITS, int HPG, int NST>
__host__ __device__ constexpr int kv3_smem_bytes()
{
    return NST * KV3_WARPS * kv3_cfg<BITS>::TOTAL * 16 + HPG * KV_KIVI_D * 4 +
           KV3_WARPS * HPG * KV3_G * 4 + KV3_WARPS * HPG * 4 + KV3_WARPS * HPG * 8 + HPG * 4 + 16;
}

template <class C>
__device__ __forceinline__ void kv3_stage(uint4 *dst, const kivi3_args &a, int kvh, int gi, int lane)
{
    const size_t row = (size_t)kvh * a.nq + (size_t)gi * KV3_G;
    const uint4 *kc = reinterpret_cast<const uint4 *>(a.kc + row * C::RB);
    const uint4 *vc = reinterpret_cast<const uint4 *>(a.vc + row * C::RB);
    const uint4 *ks = reinterpret_cast<const uint4 *>(a.ks + ((size_t)kvh * a.ng + gi) * C::D);
    const uint4 *kz = reinterpret_cast<const uint4 *>(a.kz + ((size_t)kvh * a.ng + gi) * C::D);
    const uint4 *vs = reinterpret_cast<const uint4 *>(a.vs + row * C::NGV);
    const uint4 *vz = reinterpret_cast<const uint4 *>(a.vz + row * C::NGV);
#pragma unroll
    for (int j = 0; j < C::NLD; j++) {
        const int i = lane + 32 * j;
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

/* While the kernel before finishes: the groups each warp stages first into
 * L2 (as attn_f16_tc.cu does; a prefetch returns nothing to the SM and every
 * write lands in L2, so a group the kernel before still writes is read fresh
 * after the wait).  Lane l of warp w: part l % 6 of its group l / 6. */
template <class C, int NST>
__device__ __forceinline__ void kv3_prefetch(const kivi3_args &a, int kvh, int split)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int k = lane / 6, part = lane % 6;
    const int gi = split * a.gps + warp + k * KV3_WARPS;
    if (k >= NST - 1 || gi >= min(a.ng, split * a.gps + a.gps)) return;
    const size_t row = (size_t)kvh * a.nq + (size_t)gi * KV3_G;
    const void *src;
    unsigned bytes;
    switch (part) {
    case 0: src = a.kc + row * C::RB, bytes = KV3_G * C::RB; break;
    case 1: src = a.vc + row * C::RB, bytes = KV3_G * C::RB; break;
    case 2: src = a.ks + ((size_t)kvh * a.ng + gi) * C::D, bytes = C::D * 2; break;
    case 3: src = a.kz + ((size_t)kvh * a.ng + gi) * C::D, bytes = C::D * 2; break;
    case 4: src = a.vs + row * C::NGV, bytes = KV3_G * C::NGV * 2; break;
    default: src = a.vz + row * C::NGV, bytes = KV3_G * C::NGV * 2; break;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
#else
    (void)src, (void)bytes;
#endif
}

/*
 * Key operand layout.  Lane (g, t) of a score MMA holds, for k-step s, the
 * half pairs j = 0 (k slots 2t, 2t+1) and j = 1 (2t+8, 2t+9); chan() is the
 * channel (within the lane's 32-channel span) of half `hi` of pair j, and
 * fold() the factor the query carries so that A * B = code * q:
 *   1 bit (v2's): after w << (13 - 2s) bit 2s+1 is at bit 14 (2.0) and bit
 *     2s at bit 13 (2^-7): fold 1/2 and 128;
 *   2 bits: word j (channels 16j..16j+15, codes c at bits 2c, 2c+16) shifted
 *     so that code s sits at bits 8-9 (odd s) or 6-7 (even s, the same shift
 *     as s + 1), OR 1.0: the half is 1 + code/4 or 1 + code/16: fold 4, 16.
 */
template <int BITS> struct kv3_keys {
    static __host__ __device__ constexpr int chan(int s, int j, int hi)
    {
        return BITS == 1   ? (j == 0 ? 2 * s + 1 : 2 * s) + 16 * hi
               : BITS == 2 ? (j == 0 ? s : 16 + s) + 8 * hi
                           : 8 * ((2 * s + j) >> 2) + 4 * hi + ((2 * s + j) & 3);
    }
    static __host__ __device__ constexpr float fold(int s, int j)
    {
        return BITS == 1 ? (j == 0 ? 0.5f : 128.0f) : BITS == 2 ? ((s & 1) ? 4.0f : 16.0f) : 16.0f;
    }
};

#define KV3_ONE2 0x3C003C00u  /* half2 {1, 1} */
/* The MMAs of the key and of the value stage; DIAG 4 leaves the first out,
 * DIAG 3 the second (compute-only timing diagnostics). */
#define KV3_KMMA(d, a, b) \
    if constexpr (DIAG != 4) kv_mma_16816(d, a, b)
#define KV3_VMMA(d, a, b) \
    if constexpr (DIAG != 3) kv_mma_16816(d, a, b)
#define KV3_MONE2 0xBC00BC00u /* half2 {-1, -1} */

/* The last block of KV head kvh to finish merges the nsplit records of its
 * HPG query heads into out (the one-pass merge of kv_attn_combine, with the
 * weights 2^(m - M) made once per record in shared memory). */
template <int HPG>
__device__ void kv3_merge(const kivi3_args &a, int kvh, float *smf)
{
    constexpr int D = KV_KIVI_D;
    const int ns = a.nsplit, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float *w = smf;                 /* (HPG, ns, 2): m then weight, l */
    float *linv = smf + 2 * HPG * ns; /* (HPG) */
    const float *rec0 = a.part + (size_t)kvh * HPG * ns * (D + 2);
    for (int i = tid; i < HPG * ns; i += KV3_THREADS) {
        w[2 * i] = __ldcg(rec0 + (size_t)i * (D + 2));
        w[2 * i + 1] = __ldcg(rec0 + (size_t)i * (D + 2) + 1);
    }
    __syncthreads();
    for (int h = warp; h < HPG; h += KV3_WARPS) {
        float M = -INFINITY;
        for (int s = lane; s < ns; s += 32) M = fmaxf(M, w[2 * (h * ns + s)]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(KV_FULL_MASK, M, o));
        float L = 0.0f;
        for (int s = lane; s < ns; s += 32) {
            const float f = kv_exp2_diff(w[2 * (h * ns + s)], M);
            w[2 * (h * ns + s)] = f;
            L += f * w[2 * (h * ns + s) + 1];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(KV_FULL_MASK, L, o);
        if (lane == 0) linv[h] = 1.0f / L;
    }
    __syncthreads();
    /* One thread per (head, 4 channels): 16-byte loads, eight records in flight. */
    for (int idx = tid; idx < HPG * D / 4; idx += KV3_THREADS) {
        const int h = idx / (D / 4), c = 4 * (idx % (D / 4));
        const float *r = rec0 + (size_t)h * ns * (D + 2) + 2 + c;
        const float *wh = w + 2 * h * ns;
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int s0 = 0; s0 < ns; s0 += 8) {
            float4 x[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int s = min(s0 + u, ns - 1);
                /* records are D + 2 floats: 8-byte aligned, so two 8-byte loads */
                const float2 lo = __ldcg(reinterpret_cast<const float2 *>(r + (size_t)s * (D + 2)));
                const float2 hi = __ldcg(reinterpret_cast<const float2 *>(r + (size_t)s * (D + 2) + 2));
                x[u] = make_float4(lo.x, lo.y, hi.x, hi.y);
            }
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const float f = s0 + u < ns ? wh[2 * (s0 + u)] : 0.0f;
                o.x = fmaf(f, x[u].x, o.x), o.y = fmaf(f, x[u].y, o.y);
                o.z = fmaf(f, x[u].z, o.z), o.w = fmaf(f, x[u].w, o.w);
            }
        }
        const float li = linv[h];
        float *dst = a.out + ((size_t)kvh * HPG + h) * D + c;
        dst[0] = o.x * li, dst[1] = o.y * li, dst[2] = o.z * li, dst[3] = o.w * li;
    }
}

/* VAR bit 1 (ZALU): the column sums of the value operand (p * scale and
 * p * zero over the tokens) in fp32 adds, not in 8 MMAs with A = 1 per group. */
#define KV3_VAR_ZALU 1

template <int BITS, int HPG, int NST, int DIAG, int VAR = 0>
__global__ void __launch_bounds__(KV3_THREADS, 4) attn_kivi3(kivi3_args a)
{
    constexpr bool ZALU = (VAR & KV3_VAR_ZALU) != 0;
    using C = kv3_cfg<BITS>;
    using KK = kv3_keys<BITS>;
    constexpr int D = C::D, G = KV3_G;
    extern __shared__ __align__(16) unsigned char kv3_smem[];
    uint4 *ring = reinterpret_cast<uint4 *>(kv3_smem);                     /* (NST, warps, TOTAL) */
    float *qsm = reinterpret_cast<float *>(ring + NST * KV3_WARPS * C::TOTAL); /* (HPG, D) */
    float *psm = qsm + HPG * D;                                            /* (warps, HPG, G) */
    float *corr_sm = psm + KV3_WARPS * HPG * G;                            /* (warps, HPG) */
    float *ml_sm = corr_sm + KV3_WARPS * HPG;                              /* (warps, HPG, 2) */
    int *last_sm = reinterpret_cast<int *>(ml_sm + KV3_WARPS * HPG * 2 + HPG);
    static_assert(NST * KV3_WARPS * C::TOTAL * 4 >= kv_f16_smem_floats(D, HPG),
                  "residual blocks borrow the ring");
    static_assert(NST * C::TOTAL * 16 >= HPG * D * 4, "a warp's ring holds its output");

    const int kvh = blockIdx.x, split = blockIdx.y;
    kv_pdl_launch_next();
    if (a.prefetch && split < a.nsplit_p) kv3_prefetch<C, NST>(a, kvh, split);
    kv_pdl_wait(); /* q (and the newest residual row) come from the kernel before */
    for (int i = threadIdx.x; i < HPG * D; i += KV3_THREADS)
        qsm[i] = __half2float(a.q[(size_t)kvh * HPG * D + i]) * a.qscale;
    __syncthreads();

    if (split >= a.nsplit_p) { /* fp16 residual tokens */
        kv_kivi_residual_split<D, HPG>(a, qsm, kvh, split, reinterpret_cast<float *>(ring));
    } else {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int g = lane >> 2, t = lane & 3;
        constexpr int LPH = 32 / HPG, TPL = G / LPH;
        const int hh = lane / LPH, li = lane % LPH;
        uint4 *wring = ring + warp * NST * C::TOTAL; /* this warp's stages */

        uint32_t qf[C::KS][2]; /* query pairs of head g, times the fold */
        kv_kivi_fold_q<KK, C::KS, HPG, D>(qf, qsm, g, t);

        float O[8][4], Z[2][4];
        kv_kivi_clear(O);
        kv_kivi_clear(Z);
        float m_run = -INFINITY, l_run = 0.0f;
        float zs[2] = {0.0f, 0.0f}; /* ZALU: this lane's part of column g's sums, per value group */
        /* B of the value MMAs: column g < HPG is head g times the value
         * scale, HPG <= g < 2 HPG head g - HPG times the value zero. */
        const int vh = g % HPG;
        const bool vzero = ((g / HPG) & 1) != 0;
        float *ps = psm + warp * HPG * G;

        const int gstart = split * a.gps + warp, gend = min(a.ng, split * a.gps + a.gps);
        const int nk = gstart < gend ? (gend - gstart + KV3_WARPS - 1) / KV3_WARPS : 0;
#pragma unroll
        for (int k = 0; k < NST - 1; k++) {
            if (k < nk) kv3_stage<C>(wring + k * C::TOTAL, a, kvh, gstart + k * KV3_WARPS, lane);
            kv_cp_async_commit();
        }
        for (int k = 0; k < nk; k++) {
            kv_cp_async_wait<NST - 2>();
            __syncwarp(); /* group k is in for every lane; group k - 1's stage is free */
            if (k + NST - 1 < nk && DIAG < 2) /* DIAG >= 2: compute on the first stages again */
                kv3_stage<C>(wring + ((k + NST - 1) % NST) * C::TOTAL, a, kvh,
                             gstart + (k + NST - 1) * KV3_WARPS, lane);
            kv_cp_async_commit();
            if constexpr (DIAG == 1) continue; /* staging only */
            const uint4 *st = wring + (k % NST) * C::TOTAL;
            const uint8_t *skc = reinterpret_cast<const uint8_t *>(st);
            const uint8_t *svc = skc + G * C::RB;
            const __half *sks = reinterpret_cast<const __half *>(st + C::O_KS);
            const __half *skz = reinterpret_cast<const __half *>(st + C::O_KZ);
            const __half *svs = reinterpret_cast<const __half *>(st + C::O_VS);
            const __half *svz = reinterpret_cast<const __half *>(st + C::O_VZ);

            /* Fold: bk = q pair * key-scale pair; q . zero (and for 2 bits
             * minus the sum of bk, the 1 in every code half) through MMAs. */
            uint32_t bk[C::KS][2];
            float cz[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            {
                uint32_t w[16];
                kv_kivi_load16(w, sks + 32 * t);
#define KV3_FOLD(S)                                                                          \
    bk[S][0] = kv_kivi_hmul2(qf[S][0], kv_kivi_pair<KK::chan(S, 0, 0), KK::chan(S, 0, 1)>(w));         \
    bk[S][1] = kv_kivi_hmul2(qf[S][1], kv_kivi_pair<KK::chan(S, 1, 0), KK::chan(S, 1, 1)>(w));
                KV3_FOLD(0) KV3_FOLD(1) KV3_FOLD(2) KV3_FOLD(3) KV3_FOLD(4) KV3_FOLD(5) KV3_FOLD(6) KV3_FOLD(7)
#undef KV3_FOLD
                kv_kivi_load16(w, skz + 32 * t);
#define KV3_ZERO(S)                                                                          \
    {                                                                                        \
        const uint32_t z0 = kv_kivi_hmul2(kv_kivi_pair<KK::chan(S, 0, 0), KK::chan(S, 0, 1)>(w),    \
                                      kv_pack_half2(1.0f / KK::fold(S, 0), 1.0f / KK::fold(S, 0))); \
        const uint32_t z1 = kv_kivi_hmul2(kv_kivi_pair<KK::chan(S, 1, 0), KK::chan(S, 1, 1)>(w),    \
                                      kv_pack_half2(1.0f / KK::fold(S, 1), 1.0f / KK::fold(S, 1))); \
        const uint32_t az[4] = {z0, z0, z1, z1};                                             \
        const uint32_t bq[2] = {qf[S][0], qf[S][1]};                                         \
        KV3_KMMA(cz, az, bq);                                                                \
        if constexpr (BITS != 1) {                                                           \
            const uint32_t am[4] = {KV3_MONE2, KV3_MONE2, KV3_MONE2, KV3_MONE2};             \
            const uint32_t bb[2] = {bk[S][0], bk[S][1]};                                     \
            KV3_KMMA(cz, am, bb);                                                            \
        }                                                                                    \
    }
                KV3_ZERO(0) KV3_ZERO(1) KV3_ZERO(2) KV3_ZERO(3) KV3_ZERO(4) KV3_ZERO(5) KV3_ZERO(6) KV3_ZERO(7)
#undef KV3_ZERO
            }

            /* Scores, 16 tokens per tile, starting from q . zero. */
#pragma unroll
            for (int mt = 0; mt < C::MT; mt++) {
                const int ra = mt * 16 + g, rb = ra + 8;
                float c[4] = {cz[0], cz[1], cz[2], cz[3]};
                if constexpr (BITS == 1) {
                    const uint32_t wa = reinterpret_cast<const uint32_t *>(skc + ra * C::RB)[t];
                    const uint32_t wb = reinterpret_cast<const uint32_t *>(skc + rb * C::RB)[t];
#define KV3_K1(S)                                                                            \
    {                                                                                        \
        const uint32_t ya = kv_kivi_shift<13 - 2 * S>(wa), yb = kv_kivi_shift<13 - 2 * S>(wb);       \
        const uint32_t af[4] = {ya & 0x40004000u, yb & 0x40004000u, ya & 0x20002000u, yb & 0x20002000u}; \
        const uint32_t bf[2] = {bk[S][0], bk[S][1]};                                         \
        KV3_KMMA(c, af, bf);                                                                 \
    }
                    KV3_K1(0) KV3_K1(1) KV3_K1(2) KV3_K1(3) KV3_K1(4) KV3_K1(5) KV3_K1(6) KV3_K1(7)
#undef KV3_K1
                } else if constexpr (BITS == 4) {
                    /* pair P = 2s + j: word P / 4 of the lane's 16 bytes, code P % 4 of
                     * each half moved to bits 6-9: 1 + code/16 */
                    const uint4 qa = reinterpret_cast<const uint4 *>(skc + ra * C::RB)[t];
                    const uint4 qb = reinterpret_cast<const uint4 *>(skc + rb * C::RB)[t];
                    const uint32_t wa4[4] = {qa.x, qa.y, qa.z, qa.w}, wb4[4] = {qb.x, qb.y, qb.z, qb.w};
#define KV3_K4(S)                                                                            \
    {                                                                                        \
        const uint32_t ya0 = kv_kivi_shift<6 - 4 * ((2 * S) & 3)>(wa4[(2 * S) >> 2]);            \
        const uint32_t yb0 = kv_kivi_shift<6 - 4 * ((2 * S) & 3)>(wb4[(2 * S) >> 2]);            \
        const uint32_t ya1 = kv_kivi_shift<6 - 4 * ((2 * S + 1) & 3)>(wa4[(2 * S + 1) >> 2]);    \
        const uint32_t yb1 = kv_kivi_shift<6 - 4 * ((2 * S + 1) & 3)>(wb4[(2 * S + 1) >> 2]);    \
        const uint32_t af[4] = {(ya0 & 0x03C003C0u) | KV3_ONE2, (yb0 & 0x03C003C0u) | KV3_ONE2, \
                                (ya1 & 0x03C003C0u) | KV3_ONE2, (yb1 & 0x03C003C0u) | KV3_ONE2}; \
        const uint32_t bf[2] = {bk[S][0], bk[S][1]};                                         \
        KV3_KMMA(c, af, bf);                                                                 \
    }
                    KV3_K4(0) KV3_K4(1) KV3_K4(2) KV3_K4(3) KV3_K4(4) KV3_K4(5) KV3_K4(6) KV3_K4(7)
#undef KV3_K4
                } else {
                    const uint2 wa = reinterpret_cast<const uint2 *>(skc + ra * C::RB)[t];
                    const uint2 wb = reinterpret_cast<const uint2 *>(skc + rb * C::RB)[t];
                    /* k-steps S - 1 and S (S odd) from one shift of each word */
#define KV3_K2(S)                                                                            \
    {                                                                                        \
        const uint32_t xa = kv_kivi_shift<8 - 2 * S>(wa.x), xb = kv_kivi_shift<8 - 2 * S>(wb.x);     \
        const uint32_t ya = kv_kivi_shift<8 - 2 * S>(wa.y), yb = kv_kivi_shift<8 - 2 * S>(wb.y);     \
        const uint32_t ae[4] = {(xa & 0x00C000C0u) | KV3_ONE2, (xb & 0x00C000C0u) | KV3_ONE2, \
                                (ya & 0x00C000C0u) | KV3_ONE2, (yb & 0x00C000C0u) | KV3_ONE2}; \
        const uint32_t ao[4] = {(xa & 0x03000300u) | KV3_ONE2, (xb & 0x03000300u) | KV3_ONE2, \
                                (ya & 0x03000300u) | KV3_ONE2, (yb & 0x03000300u) | KV3_ONE2}; \
        const uint32_t be[2] = {bk[S - 1][0], bk[S - 1][1]}, bo[2] = {bk[S][0], bk[S][1]};  \
        KV3_KMMA(c, ae, be);                                                                 \
        KV3_KMMA(c, ao, bo);                                                                 \
    }
                    KV3_K2(1) KV3_K2(3) KV3_K2(5) KV3_K2(7)
#undef KV3_K2
                }
                kv_kivi_store_scores<HPG, G>(ps, c, t, ra, rb);
            }
            __syncwarp();

            /* Online softmax over the group: LPH lanes per head. */
            {
                const float corr = kv_kivi_softmax_step<TPL, LPH, 1>(ps + hh * G + li * TPL, m_run, l_run);
                if (li == 0) corr_sm[warp * HPG + hh] = corr;
            }
            __syncwarp();

            const float cra = corr_sm[warp * HPG + (2 * t) % HPG], crb = corr_sm[warp * HPG + (2 * t + 1) % HPG];
            if (__any_sync(KV_FULL_MASK, cra != 1.0f || crb != 1.0f)) {
                kv_kivi_rescale(O, Z, cra, crb);
                if constexpr (ZALU) {
                    const float crv = corr_sm[warp * HPG + vh];
                    zs[0] *= crv, zs[1] *= crv;
                }
            }

            /* Values, 16 tokens per step: O^T += codes^T * (p * scale). */
            const float *pv = ps + vh * G;
            const __half *sv = vzero ? svz : svs;
#pragma unroll
            for (int kt = 0; kt < C::MT; kt++) {
                const int ta = kt * 16 + 2 * t, tc = ta + 8;
                uint32_t bv[2][2];
                {
                    const float2 pab = *reinterpret_cast<const float2 *>(pv + ta);
                    const float2 pcd = *reinterpret_cast<const float2 *>(pv + tc);
                    const uint2 sab = *reinterpret_cast<const uint2 *>(sv + 2 * ta);
                    const uint2 scd = *reinterpret_cast<const uint2 *>(sv + 2 * tc);
                    const uint32_t p2ab = kv_pack_half2(pab.x, pab.y), p2cd = kv_pack_half2(pcd.x, pcd.y);
                    bv[0][0] = kv_kivi_hmul2(p2ab, __byte_perm(sab.x, sab.y, 0x5410u));
                    bv[1][0] = kv_kivi_hmul2(p2ab, __byte_perm(sab.x, sab.y, 0x7632u));
                    bv[0][1] = kv_kivi_hmul2(p2cd, __byte_perm(scd.x, scd.y, 0x5410u));
                    bv[1][1] = kv_kivi_hmul2(p2cd, __byte_perm(scd.x, scd.y, 0x7632u));
                }
                if constexpr (ZALU) {
#pragma unroll
                    for (int gv = 0; gv < 2; gv++) {
                        const float2 x = __half22float2(*reinterpret_cast<const __half2 *>(&bv[gv][0]));
                        const float2 y = __half22float2(*reinterpret_cast<const __half2 *>(&bv[gv][1]));
                        zs[gv] += (x.x + x.y) + (y.x + y.y);
                    }
                } else {
                    const uint32_t one[4] = {KV3_ONE2, KV3_ONE2, KV3_ONE2, KV3_ONE2};
                    KV3_VMMA(Z[0], one, bv[0]);
                    KV3_VMMA(Z[1], one, bv[1]);
                }
                const uint32_t *r0 = reinterpret_cast<const uint32_t *>(svc + ta * C::RB);
                const uint32_t *r1 = reinterpret_cast<const uint32_t *>(svc + (ta + 1) * C::RB);
                const uint32_t *r2 = reinterpret_cast<const uint32_t *>(svc + tc * C::RB);
                const uint32_t *r3 = reinterpret_cast<const uint32_t *>(svc + (tc + 1) * C::RB);
                if constexpr (BITS == 1) {
                    /* lane g: byte g (channels 8g.., group 0) and byte g+8 (64+8g.., group 1) */
                    const int wl = g >> 2;
                    const unsigned sel = (unsigned)(g & 3) | ((unsigned)(4 + (g & 3)) << 4);
                    const uint32_t u0 = __byte_perm(r0[wl], r0[wl + 2], sel), u1 = __byte_perm(r1[wl], r1[wl + 2], sel);
                    const uint32_t u2 = __byte_perm(r2[wl], r2[wl + 2], sel), u3 = __byte_perm(r3[wl], r3[wl + 2], sel);
                    const uint32_t yab = __byte_perm(u0, u1, 0x5410u), ycd = __byte_perm(u2, u3, 0x5410u);
#define KV3_V1(I)                                                                            \
    {                                                                                        \
        const uint32_t s0 = kv_kivi_shift<13 - 2 * I>(yab), s1 = kv_kivi_shift<13 - 2 * I>(ycd);     \
        const uint32_t af[4] = {s0 & 0x40004000u, s0 & 0x20002000u, s1 & 0x40004000u, s1 & 0x20002000u}; \
        KV3_VMMA(O[I], af, bv[(I) >> 2]);                                                    \
    }
                    KV3_V1(0) KV3_V1(1) KV3_V1(2) KV3_V1(3) KV3_V1(4) KV3_V1(5) KV3_V1(6) KV3_V1(7)
#undef KV3_V1
                } else if constexpr (BITS == 4) {
                    /* lane g: word g of each value group (channels 8g..8g+7); tile i
                     * takes channels 2(i & 3) (row g) and 2(i & 3) + 1 (row g + 8) */
#define KV3_V4(I)                                                                            \
    {                                                                                        \
        constexpr int GV = (I) >> 2, C0 = 2 * ((I) & 3), C1 = C0 + 1;                        \
        const uint32_t w0 = r0[8 * GV + g], w1 = r1[8 * GV + g], w2 = r2[8 * GV + g], w3 = r3[8 * GV + g]; \
        const uint32_t yab = __byte_perm(w0, w1, C0 < 4 ? 0x5410u : 0x7632u);               \
        const uint32_t ycd = __byte_perm(w2, w3, C0 < 4 ? 0x5410u : 0x7632u);               \
        const uint32_t a0 = kv_kivi_shift<6 - 4 * (C0 & 3)>(yab), a1 = kv_kivi_shift<6 - 4 * (C1 & 3)>(yab); \
        const uint32_t c0 = kv_kivi_shift<6 - 4 * (C0 & 3)>(ycd), c1 = kv_kivi_shift<6 - 4 * (C1 & 3)>(ycd); \
        const uint32_t af[4] = {(a0 & 0x03C003C0u) | KV3_ONE2, (a1 & 0x03C003C0u) | KV3_ONE2, \
                                (c0 & 0x03C003C0u) | KV3_ONE2, (c1 & 0x03C003C0u) | KV3_ONE2}; \
        KV3_VMMA(O[I], af, bv[GV]);                                                          \
    }
                    KV3_V4(0) KV3_V4(1) KV3_V4(2) KV3_V4(3) KV3_V4(4) KV3_V4(5) KV3_V4(6) KV3_V4(7)
#undef KV3_V4
                } else {
                    /* lane g: halfword g of each value group; codes x (row g) and
                     * x + 1 (row g + 8) from one shift: 1 + code/16 and 1 + code/4 */
                    const int wl = g >> 1;
                    const unsigned sel = (g & 1) ? 0x7632u : 0x5410u;
                    const uint32_t u0 = __byte_perm(r0[wl], r0[wl + 4], sel), u1 = __byte_perm(r1[wl], r1[wl + 4], sel);
                    const uint32_t u2 = __byte_perm(r2[wl], r2[wl + 4], sel), u3 = __byte_perm(r3[wl], r3[wl + 4], sel);
                    const uint32_t yab[2] = {__byte_perm(u0, u1, 0x5410u), __byte_perm(u0, u1, 0x7632u)};
                    const uint32_t ycd[2] = {__byte_perm(u2, u3, 0x5410u), __byte_perm(u2, u3, 0x7632u)};
#define KV3_V2(I)                                                                            \
    {                                                                                        \
        const uint32_t s0 = kv_kivi_shift<6 - 4 * ((I) & 3)>(yab[(I) >> 2]);                      \
        const uint32_t s1 = kv_kivi_shift<6 - 4 * ((I) & 3)>(ycd[(I) >> 2]);                      \
        const uint32_t af[4] = {(s0 & 0x00C000C0u) | KV3_ONE2, (s0 & 0x03000300u) | KV3_ONE2, \
                                (s1 & 0x00C000C0u) | KV3_ONE2, (s1 & 0x03000300u) | KV3_ONE2}; \
        KV3_VMMA(O[I], af, bv[(I) >> 2]);                                                    \
    }
                    KV3_V2(0) KV3_V2(1) KV3_V2(2) KV3_V2(3) KV3_V2(4) KV3_V2(5) KV3_V2(6) KV3_V2(7)
#undef KV3_V2
                }
            }
            __syncwarp(); /* every lane is done with this stage before it is refilled */
        }
        kv_cp_async_wait<0>();

        /* O^T tiles plus the value-zero sums into this warp's ring, then the
         * block's warps merge into one record per head. */
        float zv[2][2]; /* [group][column parity]: p . zero of head 2t + parity */
        if constexpr (ZALU) {
            /* column g's sums: the four lanes t of g add up; then Z's C
             * layout (column 2t + e) and the zero columns from lanes 4 col */
#pragma unroll
            for (int gv = 0; gv < 2; gv++) {
                zs[gv] += __shfl_xor_sync(KV_FULL_MASK, zs[gv], 1);
                zs[gv] += __shfl_xor_sync(KV_FULL_MASK, zs[gv], 2);
            }
#pragma unroll
            for (int gv = 0; gv < 2; gv++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = (HPG + ((2 * t + e) % HPG)) % 8;
                    zv[gv][e] = __shfl_sync(KV_FULL_MASK, zs[gv], 4 * col);
                    Z[gv][e] = __shfl_sync(KV_FULL_MASK, zs[gv], 4 * ((2 * t + e) % 8));
                }
        } else {
            kv_kivi_zero_cols<HPG>(zv, Z, g, t);
        }
        __syncwarp();
        float *osm = reinterpret_cast<float *>(wring);
#pragma unroll
        for (int i = 0; i < 8; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int n = 2 * t + (e & 1), r = e >> 1;
                if (n < HPG) {
                    float o;
                    if constexpr (BITS == 1)
                        o = O[i][e] * (r == 0 ? 0.5f : 128.0f);
                    else /* remove the sum of p * scale that the 1 in each code half added */
                        o = (O[i][e] - Z[i >> 2][e & 1]) * (BITS == 4 || r == 0 ? 16.0f : 4.0f);
                    osm[n * D + kv_kivi_vchan<BITS>(i, r, g)] = o + zv[i >> 2][e & 1];
                }
            }
        }
        if (li == 0) {
            ml_sm[(warp * HPG + hh) * 2] = m_run;
            ml_sm[(warp * HPG + hh) * 2 + 1] = l_run;
        }
        __syncthreads();
        kv_softmax_merge_store<D, HPG, KV3_WARPS, KV3_THREADS>(ml_sm, reinterpret_cast<const float *>(ring),
                                                               NST * C::TOTAL * 4, a.part, kvh * HPG, split,
                                                               a.nsplit);
    }
    if (!a.tickets) return;

    /* The last block of this KV head merges (threadFenceReduction's pattern:
     * records visible device-wide before the ticket is taken). */
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *last_sm = atomicAdd(a.tickets + kvh, 1u) + 1u == (unsigned)a.nsplit;
    __syncthreads();
    if (!*last_sm) return;
    __threadfence();
    kv3_merge<HPG>(a, kvh, reinterpret_cast<float *>(ring));
    if (threadIdx.x == 0) a.tickets[kvh] = 0u; /* every block of the head has taken its ticket */
}

// --- host side ---------------------------------------------------------------------

typedef void (*kivi3_kernel)(kivi3_args);

/* Stages per warp: 3 by default, as measured as the default in rounds 3
 * and 4; 2 measured 0.4-0.6 us faster at 128k (1 and 2 bits) as a variant
 * there, but the build that would make it the default did not get a device
 * round (docs/BENCHMARKS.md, Packed attention v3). */
static int kv3_nst(void)
{
    const int n = kv_cuda_get_tuning()->kivi3_nst;
    return n == 2 || n == 4 ? n : 3;
}

/* Instances: 1 and 2 bits with NST 2 and 3 for every geometry, NST 4 and
 * the diagnostics for 4 query heads per KV head (the Llama geometry); 4
 * bits with NST 2 (9 KB stages: two blocks fit an SM). */
static kivi3_kernel kv3_pick(int bits, int hpg, int nst, int diag, int *smem, int var = 0)
{
#define KV3_PICK(B, H, N, X)                                                \
    if (bits == B && hpg == H && nst == N && diag == X && var == 0) {       \
        *smem = kv3_smem_bytes<B, H, N>();                                  \
        return attn_kivi3<B, H, N, X>;                                      \
    }
#define KV3_PICKV(B, H, N, V)                                               \
    if (bits == B && hpg == H && nst == N && diag == 0 && var == V) {       \
        *smem = kv3_smem_bytes<B, H, N>();                                  \
        return attn_kivi3<B, H, N, 0, V>;                                   \
    }
    KV3_PICK(1, 4, 3, 0) KV3_PICK(2, 4, 3, 0) KV3_PICK(1, 2, 3, 0) KV3_PICK(2, 2, 3, 0)
    KV3_PICK(1, 1, 3, 0) KV3_PICK(2, 1, 3, 0)
    KV3_PICK(1, 4, 2, 0) KV3_PICK(2, 4, 2, 0) KV3_PICK(1, 2, 2, 0) KV3_PICK(2, 2, 2, 0)
    KV3_PICK(1, 1, 2, 0) KV3_PICK(2, 1, 2, 0) KV3_PICK(1, 4, 4, 0) KV3_PICK(2, 4, 4, 0)
    KV3_PICK(1, 4, 3, 1) KV3_PICK(2, 4, 3, 1) KV3_PICK(1, 4, 3, 2) KV3_PICK(2, 4, 3, 2)
    KV3_PICK(1, 4, 3, 3) KV3_PICK(1, 4, 3, 4)
    KV3_PICKV(1, 4, 3, 1) KV3_PICKV(2, 4, 3, 1) KV3_PICKV(4, 4, 2, 1)
    KV3_PICK(4, 4, 2, 0) KV3_PICK(4, 2, 2, 0) KV3_PICK(4, 1, 2, 0)
#undef KV3_PICK
#undef KV3_PICKV
    return nullptr;
}

static int kv3_default_nst(int bits) { return bits == 4 ? 2 : kv3_nst(); }

static kivi3_kernel kv3_pick_tuned(int bits, int hpg, int *smem)
{
    const kv_cuda_tuning *t = kv_cuda_get_tuning();
    const int nst = bits == 4 ? 2 : (t->kivi3_diag || t->kivi3_var) && !t->kivi3_nst ? 3 : kv3_nst();
    kivi3_kernel k = kv3_pick(bits, hpg, nst, t->kivi3_diag, smem, t->kivi3_var);
    return k ? k : kv3_pick(bits, hpg, kv3_default_nst(bits), 0, smem); /* variants: 4 heads per KV head */
}

bool kv_kivi3_ok(const kv_attn_dims *d, const kv_kivi_params *prm)
{
    int smem = 0;
    return d && prm && d->head_dim == KV_KIVI_D && prm->group == KV3_G && d->n_kv_heads >= 1 &&
           d->n_heads % d->n_kv_heads == 0 && prm->residual >= 0 && d->T >= 1 &&
           kv3_pick(prm->bits, d->n_heads / d->n_kv_heads, kv3_default_nst(prm->bits), 0, &smem) != nullptr;
}

/* Resident blocks per SM of an instance at its shared memory, asked once
 * (the dynamic limit raised first). */
static cudaError_t kv3_occupancy(kivi3_kernel k, int smem, int *per_sm)
{
    static thread_local kivi3_kernel keys[32];
    static thread_local int vals[32], devs[32];
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    for (int i = 0; i < 32 && keys[i]; i++)
        if (keys[i] == k && devs[i] == dev) {
            *per_sm = vals[i];
            return cudaSuccess;
        }
    CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void *>(k),
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int n = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, KV3_THREADS, smem));
    n = n < 1 ? 1 : n;
    for (int i = 0; i < 32; i++)
        if (!keys[i]) {
            keys[i] = k, vals[i] = n, devs[i] = dev;
            break;
        }
    *per_sm = n;
    return cudaSuccess;
}

struct kivi3_plan {
    kivi3_kernel k;
    int smem, nq, ng, nres, gps, nsplit_p, nsplit_r, res_tps;
    bool fuse;
};

static cudaError_t kv3_make_plan(const kv_attn_dims *d, const kv_kivi_params *prm, kivi3_plan *p)
{
    const int hpg = d->n_heads / d->n_kv_heads;
    p->k = kv3_pick_tuned(prm->bits, hpg, &p->smem);
    KV_CHECK_ARGS(p->k != nullptr);
    int per_sm = 0;
    CUDA_CHECK(kv3_occupancy(p->k, p->smem, &per_sm));
    const int cps = kv_cuda_get_tuning()->kivi3_cps;
    if (cps > 0 && cps < per_sm) per_sm = cps;
    p->nq = kv_kivi_nquant(d->T, prm->group, prm->residual);
    p->ng = p->nq / prm->group;
    p->nres = d->T - p->nq;
    p->res_tps = kv_f16_block_step(KV_KIVI_D);
    p->nsplit_r = (p->nres + p->res_tps - 1) / p->res_tps;
    int want = (per_sm * kv_cuda_sm_count() - d->n_kv_heads * p->nsplit_r) / d->n_kv_heads;
    if (want < 1) want = 1;
    if (p->ng > 0) {
        const int gps = (p->ng + want - 1) / want;
        p->gps = (gps + KV3_WARPS - 1) / KV3_WARPS * KV3_WARPS; /* whole groups per warp */
        p->nsplit_p = (p->ng + p->gps - 1) / p->gps;
    } else {
        p->gps = KV3_WARPS;
        p->nsplit_p = 0;
    }
    /* The in-kernel merge keeps (weight, l) of every record of a head, and
     * 1/L per head, in the ring (the block's shared memory before qsm). */
    const int nsplit = p->nsplit_p + p->nsplit_r;
    const int ring_floats = (p->smem - 16 - hpg * 4 - KV3_WARPS * hpg * (KV3_G * 4 + 12) - hpg * KV_KIVI_D * 4) / 4;
    const int mode = kv_cuda_get_tuning()->kivi3_unfused; /* 0 default, 1 combine pass, 2 in kernel */
    p->fuse = (mode == 2 || (mode == 0 && KV3_MERGE_IN_KERNEL)) && d->n_kv_heads <= KV3_MAXKV &&
              2 * hpg * nsplit + hpg <= ring_floats;
    return cudaSuccess;
}

size_t kv_kivi3_workspace(const kv_attn_dims *d, const kv_kivi_params *prm)
{
    kivi3_plan p;
    if (!kv_kivi3_ok(d, prm) || kv3_make_plan(d, prm, &p) != cudaSuccess) return 0;
    return (size_t)d->n_heads * (p.nsplit_p + p.nsplit_r) * (d->head_dim + 2) * sizeof(float);
}

/* Device address of this device's ticket sets (asked once per device). */
static cudaError_t kv3_tickets_ptr(unsigned **out)
{
    static thread_local int cached_dev = -1;
    static thread_local unsigned *cached = nullptr;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    if (dev != cached_dev) {
        void *p = nullptr;
        CUDA_CHECK(cudaGetSymbolAddress(&p, kv3_tickets));
        cached = static_cast<unsigned *>(p);
        cached_dev = dev;
    }
    *out = cached;
    return cudaSuccess;
}

cudaError_t kv_kivi3_launch(const kv_attn_dims *d, const kv_kivi_params *prm, const uint16_t *q,
                            const kv_cuda_kivi_view *K, const kv_cuda_kivi_view *V, float *out,
                            void *ws, size_t ws_bytes, cudaStream_t stream)
{
    KV_CHECK_ARGS(kv_kivi3_ok(d, prm) && q && K && V && out && ws);
    kivi3_plan p;
    CUDA_CHECK(kv3_make_plan(d, prm, &p));
    const int nsplit = p.nsplit_p + p.nsplit_r;
    KV_CHECK_ARGS(ws_bytes >= (size_t)d->n_heads * nsplit * (d->head_dim + 2) * sizeof(float));
    kivi3_args a;
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
    a.out = out;
    a.tickets = nullptr;
    if (p.fuse) {
        static std::atomic<unsigned> next_slot{0};
        unsigned *base = nullptr;
        CUDA_CHECK(kv3_tickets_ptr(&base));
        a.tickets = base + (next_slot.fetch_add(1u, std::memory_order_relaxed) % KV3_SLOTS) * KV3_MAXKV;
    }
    a.nq = p.nq;
    a.ng = p.ng;
    a.nres = p.nres;
    a.gps = p.gps;
    a.nsplit_p = p.nsplit_p;
    a.nsplit = nsplit;
    a.res_tps = p.res_tps;
    a.prefetch = !kv_cuda_get_tuning()->kivi3_noprefetch;
    a.qscale = d->scale * KV_LOG2E;
    CUDA_CHECK(kv_launch(2, p.k, dim3(d->n_kv_heads, nsplit), dim3(KV3_THREADS), (size_t)p.smem, stream, a));
    if (p.fuse) return cudaSuccess;
    return kv_attn_combine(a.part, d->n_heads, d->head_dim, nsplit, out, stream);
}
