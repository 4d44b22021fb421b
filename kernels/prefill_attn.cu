/*
 * prefill_attn: causal flash attention for a prefill chunk on tensor cores
 * (mma.sync m16n8k16 fed by ldmatrix, tiles streamed in by cp.async), the
 * FlashAttention-2 schedule.  One block owns BM query rows of one query head
 * and walks the key tiles of its KV head from 0 up to its last row's
 * position; each warp owns WM x 16 rows and keeps its output, row maxima and
 * row sums in registers (online softmax in base 2).  Only the last few tiles
 * of a block cross the diagonal, so only they evaluate the mask.
 *
 * Per key tile of BN keys (one K and one V buffer, FlashAttention-2's
 * overlap): wait for K_j; issue V_j; S = Q K_j^T; softmax update; wait for
 * V_j; issue K_{j+1}; O += P V_j.  Shared rows are stored with 16-byte
 * chunks XOR-swizzled by row (chunk c of row r at c ^ (r & 7)), so every
 * ldmatrix phase touches eight distinct bank groups.
 *
 * Blocks are numbered so that the longest query blocks start first (causal
 * work is triangular) and the query heads of one GQA group run side by
 * side, reading the same K/V tiles out of L2.
 *
 * CPU reference: kv_attn_prefill (lib/attn/kv_attn_prefill.c).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "prefill_ops.h"
#include "prefill_attn_sm90a.h"

namespace {

// --- 16-bit types ----------------------------------------------------------------

struct pf_h {
    typedef __half T;
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

struct pf_b {
    typedef __nv_bfloat16 T;
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// --- shared-memory helpers ---------------------------------------------------------

static __device__ __forceinline__ unsigned smem_addr(const void *p)
{
    return (unsigned)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared; zero-filled when !valid (src then unread). */
static __device__ __forceinline__ void cp16(unsigned dst, const void *src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

static __device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
static __device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

static __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], unsigned addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

static __device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], unsigned addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

static __device__ __forceinline__ float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* Byte offset of 16-byte chunk c of row r in a swizzled tile of D columns. */
template <int D>
static __device__ __forceinline__ unsigned swz(int r, int c)
{
    return (unsigned)((r * (D / 8) + (c ^ (r & 7))) * 16);
}

/* Load rows [r0, r0 + R) of a (rows, ld) matrix into a swizzled R x D tile;
 * rows at or past rmax are zero-filled.  NT is a multiple of D/8, so each
 * thread keeps one chunk column and steps NT/(D/8) rows at a time. */
template <int D, int R, int NT>
static __device__ __forceinline__ void load_tile(unsigned tile, const uint16_t *g, long long ld,
                                                 int r0, int rmax, int tid)
{
    constexpr int CH = D / 8, STEP = NT / CH;
    static_assert(NT % CH == 0, "threads must cover whole rows");
    const int c = tid % CH, rt = tid / CH;
    const uint16_t *src = g + (size_t)(r0 + rt) * (size_t)ld + (size_t)c * 8;
#pragma unroll
    for (int i = 0; i < (R + STEP - 1) / STEP; i++) {
        const int r = rt + i * STEP;
        if (R % STEP == 0 || r < R) {
            const bool ok = r0 + r < rmax;
            cp16(tile + swz<D>(r, c), ok ? src : g, ok);
        }
        src += (size_t)STEP * (size_t)ld;
    }
}

// --- the kernel ------------------------------------------------------------------------

template <typename Tr, typename To, int D, int NW, int WM, int BN, int MINB>
__global__ void __launch_bounds__(NW * 32, MINB)
    pf_attn_kernel(const uint16_t *__restrict__ q, const uint16_t *__restrict__ k,
                   const uint16_t *__restrict__ v, uint16_t *__restrict__ o, long long ldq,
                   long long ldo, long long kv_stride, int n_heads, int kv_heads, int p0, int n,
                   float scale_log2)
{
    constexpr int BM = NW * WM * 16;
    constexpr int NT = NW * 32;
    constexpr int NF = BN / 8; /* score fragments (n-tiles of 8 keys) per m-tile */
    constexpr int OF = D / 8;  /* output fragments (n-tiles of 8 channels) per m-tile */
    extern __shared__ uint4 smem[];
    const unsigned sQ = smem_addr(smem);
    const unsigned sK = sQ + BM * D * 2;
    const unsigned sV = sK + BN * D * 2;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    /* block -> (query block, KV head, head in group): longest blocks first,
     * the heads of a group adjacent */
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
    const int kend = p0 + q0 + rows; /* keys [0, kend) reach some row of this block */
    const int ntiles = (kend + BN - 1) / BN;
    const uint16_t *Q = q + (size_t)q0 * ldq + (size_t)h * D;
    const uint16_t *K = k + (size_t)kvh * kv_stride;
    const uint16_t *V = v + (size_t)kvh * kv_stride;

    load_tile<D, BM, NT>(sQ, Q, ldq, 0, rows, tid);
    cp_commit();
    load_tile<D, BN, NT>(sK, K, D, 0, Tk, tid);
    cp_commit();

    const int wrow = warp * WM * 16;       /* first row of this warp in the block */
    const int wpos0 = p0 + q0 + wrow;      /* position of that row */
    const int wposN = wpos0 + WM * 16 - 1; /* position of its last row */

    float acc[WM][OF][4];
    float mrow[WM][2], lrow[WM][2];
#pragma unroll
    for (int mt = 0; mt < WM; mt++) {
#pragma unroll
        for (int f = 0; f < OF; f++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][f][e] = 0.0f;
        mrow[mt][0] = mrow[mt][1] = -INFINITY;
        lrow[mt][0] = lrow[mt][1] = 0.0f;
    }
    /* with one m-tile per warp the query fragments stay in registers */
    uint32_t qf[WM == 1 ? D / 16 : 1][4];

    for (int j = 0; j < ntiles; j++) {
        const int kb = j * BN;
        cp_wait_all();
        __syncthreads(); /* K_j (and Q) landed; every warp is done with V_{j-1} */
        load_tile<D, BN, NT>(sV, V, D, kb, Tk, tid);
        cp_commit();
        if (WM == 1 && j == 0) {
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++)
                ldsm_x4(qf[ks], sQ + swz<D>(wrow + (lane & 15), ks * 2 + (lane >> 4)));
        }
        /* a warp whose rows all precede the tile has nothing to add */
        const bool active = kb <= wposN;
        float s[WM][NF][4];
        if (active) {
#pragma unroll
            for (int mt = 0; mt < WM; mt++)
#pragma unroll
                for (int f = 0; f < NF; f++)
#pragma unroll
                    for (int e = 0; e < 4; e++) s[mt][f][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++) {
                uint32_t af[WM][4];
#pragma unroll
                for (int mt = 0; mt < WM; mt++) {
                    if (WM == 1) {
#pragma unroll
                        for (int e = 0; e < 4; e++) af[mt][e] = qf[WM == 1 ? ks : 0][e];
                    } else {
                        ldsm_x4(af[mt], sQ + swz<D>(wrow + mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
                    }
                }
#pragma unroll
                for (int np = 0; np < BN / 16; np++) {
                    uint32_t bf[4];
                    ldsm_x4(bf, sK + swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                            ks * 2 + ((lane >> 3) & 1)));
#pragma unroll
                    for (int mt = 0; mt < WM; mt++) {
                        Tr::mma(s[mt][2 * np], af[mt], bf[0], bf[1]);
                        Tr::mma(s[mt][2 * np + 1], af[mt], bf[2], bf[3]);
                    }
                }
            }
            /* the mask: keys past a row's position, or past the cache */
            if (kb + BN - 1 > wpos0 || kb + BN > Tk) {
#pragma unroll
                for (int mt = 0; mt < WM; mt++)
#pragma unroll
                    for (int f = 0; f < NF; f++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            int key = kb + f * 8 + 2 * t4 + (e & 1);
                            int pos = wpos0 + mt * 16 + g + ((e >> 1) << 3);
                            if (key > pos || key >= Tk) s[mt][f][e] = -INFINITY;
                        }
            }
            /* online softmax, base 2 */
#pragma unroll
            for (int mt = 0; mt < WM; mt++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float mx = mrow[mt][hf];
#pragma unroll
                    for (int f = 0; f < NF; f++)
                        mx = fmaxf(mx, fmaxf(s[mt][f][2 * hf], s[mt][f][2 * hf + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, 2));
                    const float base = mx == -INFINITY ? 0.0f : mx * scale_log2;
                    const float corr = fast_exp2(mrow[mt][hf] * scale_log2 - base);
                    mrow[mt][hf] = mx;
                    float sum = 0.0f;
#pragma unroll
                    for (int f = 0; f < NF; f++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            float p = fast_exp2(fmaf(s[mt][f][2 * hf + e], scale_log2, -base));
                            s[mt][f][2 * hf + e] = p;
                            sum += p;
                        }
                    lrow[mt][hf] = lrow[mt][hf] * corr + sum;
#pragma unroll
                    for (int f = 0; f < OF; f++) {
                        acc[mt][f][2 * hf] *= corr;
                        acc[mt][f][2 * hf + 1] *= corr;
                    }
                }
        }
        cp_wait_all();
        __syncthreads(); /* V_j landed; every warp is done with K_j */
        if (j + 1 < ntiles) {
            load_tile<D, BN, NT>(sK, K, D, kb + BN, Tk, tid);
            cp_commit();
        }
        if (active) {
#pragma unroll
            for (int ks = 0; ks < BN / 16; ks++) {
                uint32_t pf[WM][4];
#pragma unroll
                for (int mt = 0; mt < WM; mt++) {
                    pf[mt][0] = Tr::pack(s[mt][2 * ks][0], s[mt][2 * ks][1]);
                    pf[mt][1] = Tr::pack(s[mt][2 * ks][2], s[mt][2 * ks][3]);
                    pf[mt][2] = Tr::pack(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
                    pf[mt][3] = Tr::pack(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
                }
#pragma unroll
                for (int dp = 0; dp < D / 16; dp++) {
                    uint32_t bf[4];
                    ldsm_x4_t(bf, sV + swz<D>(ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                              dp * 2 + (lane >> 4)));
#pragma unroll
                    for (int mt = 0; mt < WM; mt++) {
                        Tr::mma(acc[mt][2 * dp], pf[mt], bf[0], bf[1]);
                        Tr::mma(acc[mt][2 * dp + 1], pf[mt], bf[2], bf[3]);
                    }
                }
            }
        }
    }

    /* normalise and store the rows this block owns */
#pragma unroll
    for (int mt = 0; mt < WM; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float l = lrow[mt][hf];
            l += __shfl_xor_sync(KV_FULL_MASK, l, 1);
            l += __shfl_xor_sync(KV_FULL_MASK, l, 2);
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const int r = wrow + mt * 16 + g + hf * 8;
            if (r < rows) {
                uint32_t *dst = reinterpret_cast<uint32_t *>(o + (size_t)(q0 + r) * ldo +
                                                             (size_t)h * D + 2 * t4);
#pragma unroll
                for (int f = 0; f < OF; f++)
                    dst[f * 4] = To::pack(acc[mt][f][2 * hf] * inv, acc[mt][f][2 * hf + 1] * inv);
            }
        }
}

// --- variants and launch -----------------------------------------------------------------

typedef void (*pf_kernel_fn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *,
                             long long, long long, long long, int, int, int, int, float);

struct pf_variant {
    const char *name;
    int nw, wm, bn;
    pf_kernel_fn f[3][2]; /* [f16, bf16, f16 in with bf16 out][head_dim 64, 128] */
};

#define PF_VARIANT(NW, WM, BN, MB)                                                             \
    {"w" #NW "m" #WM "n" #BN "b" #MB,                                                          \
     NW,                                                                                       \
     WM,                                                                                       \
     BN,                                                                                       \
     {{pf_attn_kernel<pf_h, pf_h, 64, NW, WM, BN, MB>, pf_attn_kernel<pf_h, pf_h, 128, NW, WM, BN, MB>}, \
      {pf_attn_kernel<pf_b, pf_b, 64, NW, WM, BN, MB>, pf_attn_kernel<pf_b, pf_b, 128, NW, WM, BN, MB>}, \
      {pf_attn_kernel<pf_h, pf_b, 64, NW, WM, BN, MB>, pf_attn_kernel<pf_h, pf_b, 128, NW, WM, BN, MB>}}}

/* The mma.sync tiles, measured against each other and the wgmma ones. */
static const pf_variant variants[] = {
    PF_VARIANT(4, 2, 64, 1), /* FlashAttention-2's tile for head_dim 128 */
    PF_VARIANT(4, 1, 64, 1), PF_VARIANT(4, 1, 64, 3), PF_VARIANT(8, 1, 64, 1),
    PF_VARIANT(4, 2, 32, 1), PF_VARIANT(8, 1, 128, 1),
};
static const int n_variants = (int)(sizeof variants / sizeof variants[0]);

} // namespace

/* Variant numbers: 0 the default for the device, then the mma.sync tiles,
 * then the wgmma tiles (kernels/prefill_attn_sm90a.cu), then the
 * warp-specialized ones (kernels/prefill_attn_tma_sm90a.cu).  The default:
 * PF_TMA_DEFAULT where the driver encodes tensor maps, else PF_WG_DEFAULT on
 * Hopper, else the first mma.sync tile. */
static int best_variant(void)
{
    if (!pf_attn_wg_available()) return 1;
    if (PF_TMA_DEFAULT >= 0 && pf_attn_tma_available())
        return 1 + n_variants + pf_attn_wg_variants() + PF_TMA_DEFAULT;
    return 1 + n_variants + PF_WG_DEFAULT;
}

extern "C" int pf_attn_variants(void)
{
    return 1 + n_variants + pf_attn_wg_variants() + pf_attn_tma_variants();
}

extern "C" const char *pf_attn_variant_name(int v)
{
    if (v == 0) return "auto";
    if (v >= 1 && v <= n_variants) return variants[v - 1].name;
    if (v <= n_variants + pf_attn_wg_variants()) return pf_attn_wg_name(v - 1 - n_variants);
    return pf_attn_tma_name(v - 1 - n_variants - pf_attn_wg_variants());
}

extern "C" int pf_attn_default_variant(void) { return best_variant(); }

extern "C" int pf_attn_supported(const pf_attn_args *a)
{
    if (a->head_dim != 64 && a->head_dim != 128) return 0;
    if (a->n_kv_heads < 1 || a->n_heads < a->n_kv_heads || a->n_heads % a->n_kv_heads) return 0;
    if ((a->ldq | a->ldo | a->kv_stride) & 7) return 0;
    if (((uintptr_t)a->q | (uintptr_t)a->k | (uintptr_t)a->v | (uintptr_t)a->o) & 15) return 0;
    return a->n >= 0 && a->p0 >= 0;
}

extern "C" cudaError_t pf_attn(const pf_attn_args *a, pf_dtype t, pf_dtype ot, int variant,
                               cudaStream_t s)
{
    KV_CHECK_ARGS(pf_attn_supported(a) && variant >= 0 && variant < pf_attn_variants());
    KV_CHECK_ARGS(t != PF_BF16 || ot == PF_BF16);
    if (a->n == 0) return cudaSuccess;
    if (variant == 0) variant = best_variant();
    const int ti = t == PF_BF16 ? 1 : ot == PF_BF16 ? 2 : 0;
    if (variant > n_variants + pf_attn_wg_variants())
        return pf_attn_tma(a, ti, variant - 1 - n_variants - pf_attn_wg_variants(), s);
    if (variant > n_variants) return pf_attn_wg(a, ti, variant - 1 - n_variants, s);
    const pf_variant &pv = variants[variant - 1];
    pf_kernel_fn f = pv.f[ti][a->head_dim == 128];
    const int BM = pv.nw * pv.wm * 16;
    const size_t smem = (size_t)(BM + 2 * pv.bn) * a->head_dim * 2;
    static thread_local bool raised[16][3][2];
    bool &r = raised[variant][ti][a->head_dim == 128];
    if (!r) {
        CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        r = true;
    }
    const unsigned nqb = (unsigned)((a->n + BM - 1) / BM);
    const float scale_log2 = a->scale * KV_LOG2E;
    CUDA_CHECK(kv_launch(KV_PDL_NONE, f, dim3(nqb * (unsigned)a->n_heads), dim3(pv.nw * 32), smem, s,
                         (const uint16_t *)a->q, (const uint16_t *)a->k, (const uint16_t *)a->v,
                         (uint16_t *)a->o, a->ldq, a->ldo, a->kv_stride, a->n_heads, a->n_kv_heads,
                         a->p0, a->n, scale_log2));
    return cudaSuccess;
}
