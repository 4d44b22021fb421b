/*
 * prefill_attn_tma_sm90a: the warp-specialized Hopper form of the prefill's
 * causal chunk attention (the function of kernels/prefill_attn.cu, CPU
 * reference kv_attn_prefill in lib/attn/kv_attn_prefill.c), after the
 * structure FlashAttention-3 describes.  A block holds NWG consumer
 * warpgroups (64 query rows each, both products on wgmma) and a producer
 * warpgroup (its registers given to the consumers with setmaxnreg) whose
 * first lane alone issues the loads: Q once, then K and V tiles
 * of BN keys through the tensor copy engine (cp.async.bulk.tensor with a
 * 128-byte swizzle, the layout the wgmma descriptors read) into ST stages,
 * each completing on its "full" mbarrier; the consumers free a stage on its
 * "empty" mbarrier once their products have read it.  No block-wide
 * barrier inside the loop: the warpgroups and the loads run decoupled.
 *
 * OV (overlap): a consumer issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}
 * back to back, and computes the softmax of S_j while the second product
 * runs (FlashAttention-3's intra-warpgroup pipelining).  PP (ping-pong,
 * two warpgroups): two named barriers hand the tensor cores from one
 * warpgroup to the other, so that one issues its products while the other
 * is in its softmax.  Without OV: S_j, softmax, P_j V_j in turn.
 *
 * The tensor maps are encoded on the host for every launch (K and V with
 * Tk = p0 + n rows, so that the copy engine fills rows past the chunk with
 * zeros and no probability meets an unwritten cache row); the encoder is
 * the driver's cuTensorMapEncodeTiled, reached through the runtime's
 * cudaGetDriverEntryPointByVersion, so nothing links the driver library.
 * Built for sm_90a alone (the Makefile's *_sm90a.cu rule).
 */
#include <cuda.h> /* CUtensorMap and the encoder's types (no driver call is linked) */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "prefill_ops.h"
#include "prefill_attn_sm90a.h"

namespace {

#include "prefill_wgmma.cuh"

// --- mbarriers, named barriers and the tensor copy engine ---------------------------

static __device__ __forceinline__ void mbar_init(unsigned bar, unsigned count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_fence_init()
{
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
static __device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes)
{
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
                 "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void mbar_arrive(unsigned bar)
{
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
/* Wait for the phase of the given parity to complete. */
static __device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity)
{
    asm volatile("{\n.reg .pred p;\nLAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra LAB_WAIT;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
static __device__ __forceinline__ void nbar_sync(int id, int n)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
static __device__ __forceinline__ void nbar_arrive(int id, int n)
{
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
static __device__ __forceinline__ void tma_2d(unsigned dst, const CUtensorMap *m, int c0, int c1, unsigned bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
static __device__ __forceinline__ void tma_3d(unsigned dst, const CUtensorMap *m, int c0, int c1, int c2,
                                              unsigned bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}

// --- the softmax of one tile (registers of one warp's 16 rows) ---------------------------

/* Mask S (NF fragments of 8 keys for rows wpos0 + g and + 8), update the
 * running maximum and sum, turn S into probabilities; corr[hf] is the
 * factor the accumulators of row half hf take. */
template <int NF>
static __device__ __forceinline__ void tile_softmax(float (&s)[NF * 4], float (&mrow)[2], float (&lrow)[2],
                                                    float (&corr)[2], int kb, int wpos0, int Tk, int g,
                                                    int t4, float scale_log2)
{
    if (kb + NF * 8 - 1 > wpos0 || kb + NF * 8 > Tk) {
#pragma unroll
        for (int f = 0; f < NF; f++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = kb + f * 8 + 2 * t4 + (e & 1);
                int pos = wpos0 + g + ((e >> 1) << 3);
                if (key > pos || key >= Tk) s[f * 4 + e] = -INFINITY;
            }
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float mx = mrow[hf];
#pragma unroll
        for (int f = 0; f < NF; f++) mx = fmaxf(mx, fmaxf(s[f * 4 + 2 * hf], s[f * 4 + 2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, 2));
        /* exp2 with the scale folded in: p = 2^(s*scale*log2e - max*scale*log2e) */
        const float base2 = mx == -INFINITY ? 0.0f : mx * scale_log2;
        corr[hf] = fast_exp2(mrow[hf] * scale_log2 - base2);
        mrow[hf] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int f = 0; f < NF; f++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float p = fast_exp2(fmaf(s[f * 4 + 2 * hf + e], scale_log2, -base2));
                s[f * 4 + 2 * hf + e] = p;
                sum += p;
            }
        lrow[hf] = lrow[hf] * corr[hf] + sum;
    }
}

/* The probabilities as the 16-bit A fragments of P V (16 keys each). */
template <int BF, int BN>
static __device__ __forceinline__ void pack_p(uint32_t (&pa)[BN / 16][4], const float (&s)[BN / 2])
{
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
        pa[kk][0] = wt<BF>::pack(s[(2 * kk) * 4 + 0], s[(2 * kk) * 4 + 1]);
        pa[kk][1] = wt<BF>::pack(s[(2 * kk) * 4 + 2], s[(2 * kk) * 4 + 3]);
        pa[kk][2] = wt<BF>::pack(s[(2 * kk + 1) * 4 + 0], s[(2 * kk + 1) * 4 + 1]);
        pa[kk][3] = wt<BF>::pack(s[(2 * kk + 1) * 4 + 2], s[(2 * kk + 1) * 4 + 3]);
    }
}

// --- the kernel ------------------------------------------------------------------------

template <int BF, int OBF, int D, int NWG, int BN, int ST, int OV, int PP>
__global__ void __launch_bounds__((NWG + 1) * 128, 1)
    pf_tma_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                  const __grid_constant__ CUtensorMap tv, uint16_t *__restrict__ o, long long ldo,
                  int n_heads, int kv_heads, int p0, int n, float scale_log2)
{
#if PF_WGMMA
    static_assert(!PP || NWG == 2, "ping-pong takes two consumer warpgroups");
    constexpr int BM = NWG * 64, NF = BN / 8, OF = D / 8, NR = D / 64;
    constexpr unsigned TB = BN * D * 2, QB = BM * D * 2; /* bytes of a K or V tile, of Q */
    constexpr int NC = NWG * 128;                         /* consumer threads */
    /* registers per consumer thread after the producer gives its own back
     * (24 each): 240 for two consumer warpgroups (FlashAttention-3's split) */
    constexpr int NREG = NWG == 2 ? 240 : 160; /* (one consumer warpgroup: no need) */
    extern __shared__ uint8_t smem_raw[];
    const unsigned base = ((unsigned)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    /* Q (BM rows), K stages, V stages, each NR regions of rows x 128 bytes;
     * then the mbarriers: Q, K full[ST], V full[ST], K empty[ST], V empty[ST] */
    const unsigned sQ = base, sK0 = sQ + QB, sV0 = sK0 + ST * TB, bars = sV0 + ST * TB;
    const unsigned barQ = bars, barKf = bars + 8, barVf = barKf + 8 * ST, barKe = barVf + 8 * ST,
                   barVe = barKe + 8 * ST;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int grp = n_heads / kv_heads;
    const int nqb = (n + BM - 1) / BM;
    int b = blockIdx.x;
    const int hg = b % grp;
    b /= grp;
    const int kvh = b % kv_heads;
    const int qb = nqb - 1 - b / kv_heads; /* the longest rows first */
    const int h = kvh * grp + hg;
    const int q0 = qb * BM;
    const int rows = min(BM, n - q0);
    const int Tk = p0 + n;
    const int ntiles = (p0 + q0 + rows + BN - 1) / BN;

    if (tid == 0) {
        mbar_init(barQ, 1);
#pragma unroll
        for (int i = 0; i < ST; i++) {
            mbar_init(barKf + 8 * i, 1);
            mbar_init(barVf + 8 * i, 1);
            mbar_init(barKe + 8 * i, NWG * 4); /* lane 0 of every consumer warp */
            mbar_init(barVe + 8 * i, NWG * 4);
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (warp >= NWG * 4) { /* the producer warpgroup: its first lane issues every load */
        if (NWG >= 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (warp == NWG * 4 && lane == 0) {
            mbar_expect_tx(barQ, QB);
#pragma unroll
            for (int r = 0; r < NR; r++) tma_2d(sQ + r * BM * 128, &tq, h * D + r * 64, q0, barQ);
            for (int j = 0; j < ntiles; j++) {
                const int st = j % ST;
                const unsigned ph = (unsigned)(j / ST) & 1u;
                if (j >= ST) mbar_wait(barKe + 8 * st, ph ^ 1u);
                mbar_expect_tx(barKf + 8 * st, TB);
#pragma unroll
                for (int r = 0; r < NR; r++)
                    tma_3d(sK0 + st * TB + r * BN * 128, &tk, r * 64, j * BN, kvh, barKf + 8 * st);
                if (j >= ST) mbar_wait(barVe + 8 * st, ph ^ 1u);
                mbar_expect_tx(barVf + 8 * st, TB);
#pragma unroll
                for (int r = 0; r < NR; r++)
                    tma_3d(sV0 + st * TB + r * BN * 128, &tv, r * 64, j * BN, kvh, barVf + 8 * st);
            }
        }
    } else {
    if (NWG >= 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(NREG) : "memory");
    /* a consumer warpgroup: 64 rows, warp wq's 16 of them */
    const int wg = warp >> 2, wq = warp & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const int wpos0 = p0 + q0 + wg * 64 + wq * 16; /* position of this warp's first row */
    const unsigned qbase = sQ + wg * 64 * 128;      /* this warpgroup's rows in each region */
    float acc[OF * 4];
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < OF * 4; i++) acc[i] = 0.0f;

    /* ping-pong: warpgroup w issues its products after bar.sync on 1 + w,
     * and hands over with bar.arrive on the other's; warpgroup 1 lets 0
     * start, warpgroup 0 takes the last hand-over after the loop */
    auto turn_begin = [&]() {
        if (PP) nbar_sync(1 + wg, NC);
    };
    auto turn_end = [&]() {
        if (PP) nbar_arrive(2 - wg, NC);
    };
    auto release = [&](unsigned bar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
    };
    auto qk = [&](float (&s)[NF * 4], int st) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            const unsigned off = (ks & 3) << 5; /* 32 bytes per k-step inside a region */
            uint64_t da = desc(qbase + (ks >> 2) * BM * 128 + off, 16, 1024);
            uint64_t db = desc(sK0 + st * TB + (ks >> 2) * BN * 128 + off, 16, 1024);
            mma_ss<BF, BN>(s, da, db, ks > 0);
        }
    };
    auto pv = [&](const uint32_t (&pa)[BN / 16][4], int st) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) /* keys 16kk..: V's regions are the leading offset */
            mma_rs<BF, D>(acc, pa[kk], desc(sV0 + st * TB + kk * 2048, BN * 128, 1024));
    };

    if (PP && wg == 1) nbar_arrive(1, NC);
    mbar_wait(barQ, 0);
    uint32_t pp[BN / 16][4];
    if (OV) {
        {   /* tile 0: S alone */
            float s[NF * 4], corr[2];
            mbar_wait(barKf, 0);
            turn_begin();
            wg_fence();
            qk(s, 0);
            wg_commit();
            turn_end();
            wg_wait0();
            fence_f(s);
            release(barKe);
            tile_softmax<NF>(s, mrow, lrow, corr, 0, wpos0, Tk, g, t4, scale_log2);
            pack_p<BF, BN>(pp, s);
        }
        for (int j = 1; j < ntiles; j++) {
            const int st = j % ST, sp = (j - 1) % ST;
            float s[NF * 4], corr[2];
            mbar_wait(barKf + 8 * st, (unsigned)(j / ST) & 1u);
            mbar_wait(barVf + 8 * sp, (unsigned)((j - 1) / ST) & 1u);
            turn_begin();
            wg_fence();
            qk(s, st);
            wg_commit();
            pv(pp, sp);
            wg_commit();
            turn_end();
            wg_wait1(); /* S_j done; P_{j-1} V_{j-1} may still run */
            fence_f(s);
            release(barKe + 8 * st);
            tile_softmax<NF>(s, mrow, lrow, corr, j * BN, wpos0, Tk, g, t4, scale_log2);
            wg_wait0(); /* O and P_{j-1}'s registers are free */
            fence_f(acc);
            fence_u(pp);
            release(barVe + 8 * sp);
#pragma unroll
            for (int f = 0; f < OF; f++) {
                acc[f * 4 + 0] *= corr[0];
                acc[f * 4 + 1] *= corr[0];
                acc[f * 4 + 2] *= corr[1];
                acc[f * 4 + 3] *= corr[1];
            }
            pack_p<BF, BN>(pp, s);
        }
        {   /* the last tile's P V */
            const int sp = (ntiles - 1) % ST;
            mbar_wait(barVf + 8 * sp, (unsigned)((ntiles - 1) / ST) & 1u);
            turn_begin();
            wg_fence();
            pv(pp, sp);
            wg_commit();
            turn_end();
            wg_wait0();
            fence_f(acc);
            fence_u(pp);
        }
    } else {
        for (int j = 0; j < ntiles; j++) {
            const int st = j % ST;
            const unsigned ph = (unsigned)(j / ST) & 1u;
            float s[NF * 4], corr[2];
            mbar_wait(barKf + 8 * st, ph);
            turn_begin();
            wg_fence();
            qk(s, st);
            wg_commit();
            turn_end();
            wg_wait0();
            fence_f(s);
            release(barKe + 8 * st);
            tile_softmax<NF>(s, mrow, lrow, corr, j * BN, wpos0, Tk, g, t4, scale_log2);
#pragma unroll
            for (int f = 0; f < OF; f++) {
                acc[f * 4 + 0] *= corr[0];
                acc[f * 4 + 1] *= corr[0];
                acc[f * 4 + 2] *= corr[1];
                acc[f * 4 + 3] *= corr[1];
            }
            pack_p<BF, BN>(pp, s);
            mbar_wait(barVf + 8 * st, ph);
            turn_begin();
            wg_fence();
            pv(pp, st);
            wg_commit();
            turn_end();
            wg_wait0();
            fence_f(acc);
            fence_u(pp);
            release(barVe + 8 * st);
        }
    }
    if (PP && wg == 0) nbar_sync(1, NC); /* warpgroup 1's last hand-over */

#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float l = lrow[hf];
        l += __shfl_xor_sync(KV_FULL_MASK, l, 1);
        l += __shfl_xor_sync(KV_FULL_MASK, l, 2);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int r = wg * 64 + wq * 16 + g + hf * 8;
        if (r < rows) {
            uint32_t *dst = reinterpret_cast<uint32_t *>(o + (size_t)(q0 + r) * ldo + (size_t)h * D + 2 * t4);
#pragma unroll
            for (int f = 0; f < OF; f++)
                dst[f * 4] = wt<OBF>::pack(acc[f * 4 + 2 * hf] * inv, acc[f * 4 + 2 * hf + 1] * inv);
        }
    }
    } /* consumer */
#endif
}

typedef void (*pf_tma_fn)(const CUtensorMap, const CUtensorMap, const CUtensorMap, uint16_t *, long long,
                          int, int, int, int, float);

struct pf_tma_variant {
    const char *name;
    int nwg, bn, st;
    pf_tma_fn f[3][2]; /* [f16, bf16, f16 in bf16 out][head_dim 64, 128] */
};

#define PF_TMA(NAME, NWG, BN, ST, OV, PP)                                                          \
    {NAME,                                                                                         \
     NWG,                                                                                          \
     BN,                                                                                           \
     ST,                                                                                           \
     {{pf_tma_kernel<0, 0, 64, NWG, BN, ST, OV, PP>, pf_tma_kernel<0, 0, 128, NWG, BN, ST, OV, PP>}, \
      {pf_tma_kernel<1, 1, 64, NWG, BN, ST, OV, PP>, pf_tma_kernel<1, 1, 128, NWG, BN, ST, OV, PP>}, \
      {pf_tma_kernel<0, 1, 64, NWG, BN, ST, OV, PP>, pf_tma_kernel<0, 1, 128, NWG, BN, ST, OV, PP>}}}

/* tma<warpgroups>n<keys per tile>[s<stages>][o: overlapped softmax][p: ping-pong] */
static const pf_tma_variant tma_variants[] = {
    PF_TMA("tma2n128op", 2, 128, 2, 1, 1),
    PF_TMA("tma2n128o", 2, 128, 2, 1, 0),
    PF_TMA("tma2n128p", 2, 128, 2, 0, 1),
    PF_TMA("tma2n128", 2, 128, 2, 0, 0),
    PF_TMA("tma1n128o", 1, 128, 2, 1, 0),
    PF_TMA("tma2n128s3op", 2, 128, 3, 1, 1),
};
static const int n_tma = (int)(sizeof tma_variants / sizeof tma_variants[0]);

// --- host: the tensor maps ------------------------------------------------------------

typedef CUresult (*encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                              const cuuint64_t *, const cuuint32_t *, const cuuint32_t *,
                              CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                              CUtensorMapFloatOOBfill);

/* The driver's encoder, once per thread (NULL when the driver has none). */
static encode_fn encoder(void)
{
    static thread_local int tried = 0;
    static thread_local encode_fn fn = nullptr;
    if (!tried) {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
                cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = reinterpret_cast<encode_fn>(p);
        (void)cudaGetLastError();
        tried = 1;
    }
    return fn;
}

/* A map of 16-bit rank-dimensional data: dims[0] contiguous, strides in
 * bytes of dims 1.., a box of 64 values (128 bytes, the swizzle's span)
 * by box1 [by 1]. */
static bool encode(CUtensorMap *m, const void *ptr, int rank, const cuuint64_t *dims,
                   const cuuint64_t *strides, cuuint32_t box1)
{
    encode_fn fn = encoder();
    if (!fn) return false;
    const cuuint32_t box[3] = {64, box1, 1}, es[3] = {1, 1, 1};
    return fn(m, CU_TENSOR_MAP_DATA_TYPE_UINT16, (cuuint32_t)rank, const_cast<void *>(ptr), dims, strides,
              box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

} // namespace

int pf_attn_tma_variants(void) { return n_tma; }
int pf_attn_tma_available(void) { return pf_attn_wg_available() && encoder() != nullptr; }
const char *pf_attn_tma_name(int v) { return v >= 0 && v < n_tma ? tma_variants[v].name : "?"; }

cudaError_t pf_attn_tma(const pf_attn_args *a, int ti, int variant, cudaStream_t s)
{
    if (variant < 0 || variant >= n_tma || !pf_attn_wg_available() || !encoder()) return cudaErrorNotSupported;
    const pf_tma_variant &pv = tma_variants[variant];
    const int D = a->head_dim, BM = pv.nwg * 64;
    pf_tma_fn f = pv.f[ti][D == 128];
    const size_t smem = (size_t)(BM + 2 * pv.st * pv.bn) * D * 2 + 1024 + 8 * (1 + 4 * pv.st);
    static_assert(sizeof tma_variants / sizeof tma_variants[0] <= 8, "raised[] holds 8 variants");
    static thread_local bool raised[8][3][2];
    bool &r = raised[variant][ti][D == 128];
    if (!r) {
        CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        r = true;
    }
    const int Tk = a->p0 + a->n;
    CUtensorMap tq, tk, tv;
    const cuuint64_t qd[2] = {(cuuint64_t)a->n_heads * D, (cuuint64_t)a->n};
    const cuuint64_t qs[1] = {(cuuint64_t)a->ldq * 2};
    const cuuint64_t kd[3] = {(cuuint64_t)D, (cuuint64_t)Tk, (cuuint64_t)a->n_kv_heads};
    const cuuint64_t ks[2] = {(cuuint64_t)D * 2, (cuuint64_t)a->kv_stride * 2};
    if (!encode(&tq, a->q, 2, qd, qs, (cuuint32_t)BM) || !encode(&tk, a->k, 3, kd, ks, (cuuint32_t)pv.bn) ||
        !encode(&tv, a->v, 3, kd, ks, (cuuint32_t)pv.bn)) {
        kv_cuda_record(cudaErrorInvalidValue, "cuTensorMapEncodeTiled of the prefill attention's Q/K/V",
                       __FILE__, __LINE__);
        return cudaErrorInvalidValue;
    }
    const unsigned nqb = (unsigned)((a->n + BM - 1) / BM);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, f, dim3(nqb * (unsigned)a->n_heads), dim3((pv.nwg + 1) * 128), smem, s,
                         tq, tk, tv, (uint16_t *)a->o, a->ldo, a->n_heads, a->n_kv_heads, a->p0, a->n,
                         a->scale * KV_LOG2E));
    return cudaSuccess;
}
