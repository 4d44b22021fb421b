/*
 * prefill_attn_sm90a: the Hopper form of kernels/prefill_attn.cu's causal
 * chunk attention — the same tiles, mask and online softmax, with the two
 * products on warpgroup MMAs (wgmma, sm_90a only): S = Q K^T with both
 * operands read by the tensor cores from shared memory, O += P V with P
 * from registers and V from shared memory (N-major).  Each warpgroup (four
 * warps) owns 64 query rows; a block of NWG warpgroups shares each K/V tile.
 * Tiles are stored as the wgmma 128-byte-swizzle canonical layout: per 64
 * columns a region of rows x 128 bytes, 16-byte chunk c of row r at
 * c ^ (r & 7), regions 1024-byte aligned (8-row groups 1024 bytes apart:
 * the descriptors' stride offset; V's regions are its leading offset).
 * Loads are cp.async by every thread, as in the mma.sync kernel, made
 * visible to the tensor cores' proxy with fence.proxy.async before the
 * barrier.
 *
 * Built for sm_90a alone (the Makefile's *_sm90a.cu rule); the launcher
 * refuses any other device, and pf_attn then uses the mma.sync kernel.
 * CPU reference: kv_attn_prefill (lib/attn/kv_attn_prefill.c).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "prefill_ops.h"
#include "prefill_attn_sm90a.h"

namespace {

#include "prefill_wgmma.cuh"

// --- the kernel ------------------------------------------------------------------------

template <int BF, int OBF, int D, int NWG, int BN>
__global__ void __launch_bounds__(NWG * 128, 1)
    pf_wg_kernel(const uint16_t *__restrict__ q, const uint16_t *__restrict__ k,
                 const uint16_t *__restrict__ v, uint16_t *__restrict__ o, long long ldq,
                 long long ldo, long long kv_stride, int n_heads, int kv_heads, int p0, int n,
                 float scale_log2)
{
#if PF_WGMMA
    constexpr int BM = NWG * 64;
    constexpr int NT = NWG * 128;
    constexpr int NF = BN / 8, OF = D / 8;
    extern __shared__ uint8_t smem_raw[];
    const unsigned base = ((unsigned)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const unsigned sQ = base, sK = sQ + BM * D * 2, sV = sK + BN * D * 2;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3; /* warpgroup, warp in it */
    const int g = lane >> 2, t4 = lane & 3;
    const int grp = n_heads / kv_heads;
    const int nqb = (n + BM - 1) / BM;
    int b = blockIdx.x;
    const int hg = b % grp;
    b /= grp;
    const int kvh = b % kv_heads;
    const int qb = nqb - 1 - b / kv_heads;
    const int h = kvh * grp + hg;
    const int q0 = qb * BM;
    const int rows = min(BM, n - q0);
    const int Tk = p0 + n;
    const int ntiles = (p0 + q0 + rows + BN - 1) / BN;
    const uint16_t *Q = q + (size_t)q0 * ldq + (size_t)h * D;
    const uint16_t *K = k + (size_t)kvh * kv_stride;
    const uint16_t *V = v + (size_t)kvh * kv_stride;

    load_tile<D, BM, NT>(sQ, Q, ldq, 0, rows, tid);
    cp_commit();
    load_tile<D, BN, NT>(sK, K, D, 0, Tk, tid);
    cp_commit();

    const int wpos0 = p0 + q0 + wg * 64 + wq * 16; /* position of this warp's first row */
    float acc[OF * 4];
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < OF * 4; i++) acc[i] = 0.0f;
    const unsigned qbase = sQ + wg * 64 * 128; /* this warpgroup's 64 rows in each region */

    for (int j = 0; j < ntiles; j++) {
        const int kb = j * BN;
        cp_wait_all();
        fence_async_smem();
        __syncthreads(); /* K_j (and Q) landed and visible to the tensor cores */
        load_tile<D, BN, NT>(sV, V, D, kb, Tk, tid);
        cp_commit();
        /* every warpgroup runs every tile (a warpgroup wholly before the
         * tile gets zero probabilities): a branch around wgmma makes ptxas
         * serialize them (C7520) */
        float s[NF * 4];
        {
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++) {
                const unsigned off = (ks & 3) << 5; /* 32 bytes per k-step inside a region */
                uint64_t da = desc(qbase + (ks >> 2) * BM * 128 + off, 16, 1024);
                uint64_t db = desc(sK + (ks >> 2) * BN * 128 + off, 16, 1024);
                mma_ss<BF, BN>(s, da, db, ks > 0);
            }
            wg_commit();
            wg_wait0();
            if (kb + BN - 1 > wpos0 || kb + BN > Tk) {
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
                for (int f = 0; f < NF; f++)
                    mx = fmaxf(mx, fmaxf(s[f * 4 + 2 * hf], s[f * 4 + 2 * hf + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, 2));
                const float base2 = mx == -INFINITY ? 0.0f : mx * scale_log2;
                const float corr = fast_exp2(mrow[hf] * scale_log2 - base2);
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
                lrow[hf] = lrow[hf] * corr + sum;
#pragma unroll
                for (int f = 0; f < OF; f++) {
                    acc[f * 4 + 2 * hf] *= corr;
                    acc[f * 4 + 2 * hf + 1] *= corr;
                }
            }
        }
        cp_wait_all();
        fence_async_smem();
        __syncthreads(); /* V_j landed; every warpgroup is done with K_j */
        if (j + 1 < ntiles) {
            load_tile<D, BN, NT>(sK, K, D, kb + BN, Tk, tid);
            cp_commit();
        }
        {
            /* P to 16-bit A fragments first: registers written between
             * wgmmas make ptxas insert a fence before each (C7519) */
            uint32_t pa[BN / 16][4];
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                pa[kk][0] = wt<BF>::pack(s[(2 * kk) * 4 + 0], s[(2 * kk) * 4 + 1]);
                pa[kk][1] = wt<BF>::pack(s[(2 * kk) * 4 + 2], s[(2 * kk) * 4 + 3]);
                pa[kk][2] = wt<BF>::pack(s[(2 * kk + 1) * 4 + 0], s[(2 * kk + 1) * 4 + 1]);
                pa[kk][3] = wt<BF>::pack(s[(2 * kk + 1) * 4 + 2], s[(2 * kk + 1) * 4 + 3]);
            }
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                /* keys 16kk..: two 8-row groups of every region; regions of
                 * 64 channels BN*128 bytes apart (the leading offset) */
                uint64_t dv = desc(sV + kk * 2048, BN * 128, 1024);
                mma_rs<BF, D>(acc, pa[kk], dv);
            }
            wg_commit();
            wg_wait0();
        }
    }

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
#endif
}


/*
 * The same attention with the softmax overlapped with the tensor cores
 * (FlashAttention-3's intra-warpgroup pipelining): in iteration j a
 * warpgroup issues S_j = Q K_j^T and then O += P_{j-1} V_{j-1}, waits for
 * S_j only, and computes the softmax of S_j while the second product runs;
 * O is rescaled once that product is done.  K and V are double-buffered,
 * so the loads of K_{j+1} and V_j have a whole iteration to land.  The
 * operand fences keep the compiler from moving register reads and writes
 * across the wgmma waits (the registers of an in-flight wgmma).
 */

template <int BF, int OBF, int D, int NWG, int BN>
__global__ void __launch_bounds__(NWG * 128, 1)
    pf_wgp_kernel(const uint16_t *__restrict__ q, const uint16_t *__restrict__ k,
                  const uint16_t *__restrict__ v, uint16_t *__restrict__ o, long long ldq,
                  long long ldo, long long kv_stride, int n_heads, int kv_heads, int p0, int n,
                  float scale_log2)
{
#if PF_WGMMA
    constexpr int BM = NWG * 64;
    constexpr int NT = NWG * 128;
    constexpr int NF = BN / 8, OF = D / 8;
    constexpr unsigned TB = BN * D * 2; /* bytes of one K or V tile */
    extern __shared__ uint8_t smem_raw[];
    const unsigned base = ((unsigned)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const unsigned sQ = base, sK0 = sQ + BM * D * 2, sV0 = sK0 + 2 * TB;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const int grp = n_heads / kv_heads;
    const int nqb = (n + BM - 1) / BM;
    int b = blockIdx.x;
    const int hg = b % grp;
    b /= grp;
    const int kvh = b % kv_heads;
    const int qb = nqb - 1 - b / kv_heads;
    const int h = kvh * grp + hg;
    const int q0 = qb * BM;
    const int rows = min(BM, n - q0);
    const int Tk = p0 + n;
    const int ntiles = (p0 + q0 + rows + BN - 1) / BN;
    const uint16_t *Q = q + (size_t)q0 * ldq + (size_t)h * D;
    const uint16_t *K = k + (size_t)kvh * kv_stride;
    const uint16_t *V = v + (size_t)kvh * kv_stride;

    load_tile<D, BM, NT>(sQ, Q, ldq, 0, rows, tid);
    load_tile<D, BN, NT>(sK0, K, D, 0, Tk, tid);
    /* the product of iteration 0 with "tile -1" multiplies zero
     * probabilities by V buffer 1: zero it so that 0 * garbage is no NaN */
    load_tile<D, BN, NT>(sV0 + TB, V, D, 0, 0, tid);
    cp_commit();

    const int wpos0 = p0 + q0 + wg * 64 + wq * 16;
    float acc[OF * 4];
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < OF * 4; i++) acc[i] = 0.0f;
    uint32_t pp[BN / 16][4]; /* P of the previous tile, read by its in-flight product */
#pragma unroll
    for (int i = 0; i < BN / 16; i++) pp[i][0] = pp[i][1] = pp[i][2] = pp[i][3] = 0u;
    const unsigned qbase = sQ + wg * 64 * 128;
    cp_wait_all();
    fence_async_smem();
    __syncthreads();

    for (int j = 0; j < ntiles; j++) {
        const int kb = j * BN;
        const unsigned sK = sK0 + (j & 1) * TB;
        float s[NF * 4];
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            const unsigned off = (ks & 3) << 5;
            uint64_t da = desc(qbase + (ks >> 2) * BM * 128 + off, 16, 1024);
            uint64_t db = desc(sK + (ks >> 2) * BN * 128 + off, 16, 1024);
            mma_ss<BF, BN>(s, da, db, ks > 0);
        }
        wg_commit();
        {   /* no branch around a wgmma (C7520): in iteration 0 this adds 0 */
            const unsigned sV = sV0 + ((j - 1) & 1) * TB;
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++)
                mma_rs<BF, D>(acc, pp[kk], desc(sV + kk * 2048, BN * 128, 1024));
            wg_commit();
        }
        /* V_j and K_{j+1} into the buffers the products of iteration j-1 read */
        load_tile<D, BN, NT>(sV0 + (j & 1) * TB, V, D, kb, Tk, tid);
        if (j + 1 < ntiles) load_tile<D, BN, NT>(sK0 + ((j + 1) & 1) * TB, K, D, kb + BN, Tk, tid);
        cp_commit();
        wg_wait1(); /* S_j done; the second product may still run */
        fence_f(s);
        if (kb + BN - 1 > wpos0 || kb + BN > Tk) {
#pragma unroll
            for (int f = 0; f < NF; f++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int key = kb + f * 8 + 2 * t4 + (e & 1);
                    int pos = wpos0 + g + ((e >> 1) << 3);
                    if (key > pos || key >= Tk) s[f * 4 + e] = -INFINITY;
                }
        }
        float corr[2];
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float mx = mrow[hf];
#pragma unroll
            for (int f = 0; f < NF; f++) mx = fmaxf(mx, fmaxf(s[f * 4 + 2 * hf], s[f * 4 + 2 * hf + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, 2));
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
        uint32_t pn[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            pn[kk][0] = wt<BF>::pack(s[(2 * kk) * 4 + 0], s[(2 * kk) * 4 + 1]);
            pn[kk][1] = wt<BF>::pack(s[(2 * kk) * 4 + 2], s[(2 * kk) * 4 + 3]);
            pn[kk][2] = wt<BF>::pack(s[(2 * kk + 1) * 4 + 0], s[(2 * kk + 1) * 4 + 1]);
            pn[kk][3] = wt<BF>::pack(s[(2 * kk + 1) * 4 + 2], s[(2 * kk + 1) * 4 + 3]);
        }
        wg_wait0(); /* O += P_{j-1} V_{j-1} done: O and P_{j-1}'s registers are free */
        fence_f(acc);
        fence_u(pp);
#pragma unroll
        for (int f = 0; f < OF; f++) {
            acc[f * 4 + 0] *= corr[0];
            acc[f * 4 + 1] *= corr[0];
            acc[f * 4 + 2] *= corr[1];
            acc[f * 4 + 3] *= corr[1];
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
            for (int e = 0; e < 4; e++) pp[kk][e] = pn[kk][e];
        cp_wait_all();
        fence_async_smem();
        __syncthreads(); /* V_j, K_{j+1} landed; every warpgroup is past iteration j's products */
    }
    {
        const unsigned sV = sV0 + ((ntiles - 1) & 1) * TB;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++)
            mma_rs<BF, D>(acc, pp[kk], desc(sV + kk * 2048, BN * 128, 1024));
        wg_commit();
        wg_wait0();
        fence_f(acc);
    }

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
#endif
}

typedef void (*pf_wg_fn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *,
                         long long, long long, long long, int, int, int, int, float);

struct pf_wg_variant {
    const char *name;
    int nwg, bn, pipelined;
    pf_wg_fn f[3][2]; /* [f16, bf16, f16 in bf16 out][head_dim 64, 128] */
};

#define PF_WGK(KER, NAME, PIPE, NWG, BN)                                                        \
    {NAME #NWG "n" #BN,                                                                         \
     NWG,                                                                                       \
     BN,                                                                                        \
     PIPE,                                                                                      \
     {{KER<0, 0, 64, NWG, BN>, KER<0, 0, 128, NWG, BN>},                                        \
      {KER<1, 1, 64, NWG, BN>, KER<1, 1, 128, NWG, BN>},                                        \
      {KER<0, 1, 64, NWG, BN>, KER<0, 1, 128, NWG, BN>}}}
#define PF_WG(NWG, BN) PF_WGK(pf_wg_kernel, "wg", 0, NWG, BN)
#define PF_WGP(NWG, BN) PF_WGK(pf_wgp_kernel, "wgp", 1, NWG, BN)

static const pf_wg_variant wg_variants[] = {
    PF_WG(2, 128), PF_WG(2, 64), PF_WG(1, 128), PF_WG(1, 64), PF_WG(3, 64),
    PF_WGP(2, 128), PF_WGP(1, 128), PF_WGP(2, 64), PF_WGP(3, 64),
};
static const int n_wg = (int)(sizeof wg_variants / sizeof wg_variants[0]);

} // namespace

int pf_attn_wg_variants(void) { return n_wg; }
const char *pf_attn_wg_name(int v) { return v >= 0 && v < n_wg ? wg_variants[v].name : "?"; }

/* Only compute capability 9.0 runs sm_90a code. */
static bool hopper(void)
{
    static thread_local int cached_dev = -1;
    static thread_local bool ok = false;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (dev != cached_dev) {
        int major = 0, minor = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
        ok = major == 9 && minor == 0;
        cached_dev = dev;
    }
    return ok;
}

int pf_attn_wg_available(void) { return hopper(); }

cudaError_t pf_attn_wg(const pf_attn_args *a, int ti, int variant, cudaStream_t s)
{
    if (variant < 0 || variant >= n_wg || !hopper()) return cudaErrorNotSupported;
    const pf_wg_variant &pv = wg_variants[variant];
    pf_wg_fn f = pv.f[ti][a->head_dim == 128];
    const int BM = pv.nwg * 64;
    const size_t smem = (size_t)(BM + (pv.pipelined ? 4 : 2) * pv.bn) * a->head_dim * 2 + 1024;
    static thread_local bool raised[16][3][2];
    bool &r = raised[variant][ti][a->head_dim == 128];
    if (!r) {
        CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        r = true;
    }
    const unsigned nqb = (unsigned)((a->n + BM - 1) / BM);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, f, dim3(nqb * (unsigned)a->n_heads), dim3(pv.nwg * 128), smem,
                         s, (const uint16_t *)a->q, (const uint16_t *)a->k, (const uint16_t *)a->v,
                         (uint16_t *)a->o, a->ldq, a->ldo, a->kv_stride, a->n_heads, a->n_kv_heads,
                         a->p0, a->n, a->scale * KV_LOG2E));
    return cudaSuccess;
}
