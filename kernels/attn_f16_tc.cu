/*
 * fp16 decode attention at memory speed (issue 10): the pipelined
 * tensor-core kernel that kv_cuda_attn_f16 uses for head dims 64 and 128 and
 * up to 16 query heads per KV head (attn_f16.cu keeps the register-streaming
 * kernel for every other geometry and as a measured variant).
 *
 * Grid (KV head, split): one CTA of 4 warps reads a contiguous token range of
 * one KV head once for all of that head's query heads (the rows of a 16-row
 * MMA tile), so each K/V byte crosses the memory bus once.  K and V tiles of
 * 16 KB each stream into a ring of KV_TC_STAGES shared-memory stages with
 * cp.async (no registers hold bytes in flight: two stages, 64 KB, are in the
 * air while the third is computed, and two CTAs share an SM), rows swizzled
 * (16-byte chunk c of row r at c ^ (r & 7)) so that ldmatrix reads them
 * without bank conflicts.  Each warp takes 16 tokens at a time:
 *   S (16 heads x 16 tokens) = Q (16 x D) . K^T      mma.m16n8k16, B = K rows
 *   online softmax on S in registers (exp2 domain, q prescaled)
 *   O (16 x D) += P (fp16) . V                       B = V rows, ldmatrix.trans
 * The C fragments of S are the A fragments of P as they stand (no shuffles).
 * The warps' states merge through shared memory into the partial records of
 * attn_f16.cuh ([max, sum, out]), which kv_attn_combine merges over splits.
 * q and p are fp16 MMA operands (fp32 accumulation), as in FlashAttention:
 * normalized error about 1e-4..1e-3 against the fp32 reference, where the
 * register kernel (fp32 throughout) stays under 1e-5; so it serves fp16
 * queries only, and a float32 query (the engine's choice where it wants
 * float32 numerics) keeps the register kernel.
 */
#include "attn_f16.cuh"

#define KV_TC_THREADS 128
#define KV_TC_WARPS 4
#define KV_TC_STAGES 3
#define KV_TC_TILE_BYTES 16384 /* one K (or V) tile of one stage */

template <int D> struct kv_tc_geom {
    static constexpr int TT = KV_TC_TILE_BYTES / (D * 2); /* tokens per tile: 64 (D 128), 128 (D 64) */
    static constexpr int WT = TT / KV_TC_WARPS;           /* tokens per warp per tile */
    static constexpr int CPR = D / 8;                     /* 16-byte chunks per row */
    static constexpr int CHUNKS = TT * CPR;               /* chunks per tile */
    static constexpr int CPT = CHUNKS / KV_TC_THREADS;    /* chunks per thread per tile */
    static constexpr int SMEM = KV_TC_STAGES * 2 * KV_TC_TILE_BYTES;
};

static __device__ __forceinline__ float tc_ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

static __device__ __forceinline__ void tc_cp16(uint32_t dst, const void *src, bool ok)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(ok ? 16 : 0)
                 : "memory");
}

static __device__ __forceinline__ void tc_ldm4(uint32_t addr, uint32_t (&r)[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ void tc_ldm4t(uint32_t addr, uint32_t (&r)[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ float tc_qf(__half x) { return __half2float(x); }

/* Byte offset of 16-byte chunk c of row r in a swizzled tile. */
template <int D>
static __device__ __forceinline__ uint32_t tc_off(int r, int c)
{
    return (uint32_t)(r * (D * 2) + ((c ^ (r & 7)) << 4));
}

template <int D, typename TQ>
__global__ void __launch_bounds__(KV_TC_THREADS, 2)
    attn_f16_tc(const void *__restrict__ qv, const __half *__restrict__ k,
                const __half *__restrict__ v, float *__restrict__ part, int T,
                long long head_stride, int tps, float qscale, int group)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    __trap(); /* the host launches it on sm_90 and later only (kv_f16_tc_ok) */
#else
    using G = kv_tc_geom<D>;
    const TQ *__restrict__ q = static_cast<const TQ *>(qv);
    extern __shared__ __align__(128) unsigned char tc_smem[];
    kv_pdl_launch_next();
    const int kvh = blockIdx.x, split = blockIdx.y, nsplit = gridDim.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;
    const int t0 = split * tps, t1 = min(T, t0 + tps);
    const int ntiles = (t1 - t0 + G::TT - 1) / G::TT;
    const __half *kb = k + (size_t)kvh * head_stride, *vb = v + (size_t)kvh * head_stride;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(tc_smem);

    /* While the kernel before finishes: the first tiles into L2 (a prefetch
     * returns nothing to this SM, and L2 is where every write lands, so a
     * row the kernel before is still writing is read fresh after the wait). */
    if (tid < 2) {
        const int nrow = min(t1 - t0, (KV_TC_STAGES - 1) * G::TT);
        const __half *src = (tid == 0 ? kb : vb) + (size_t)t0 * D;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src),
                     "r"((unsigned)(nrow * D * 2))
                     : "memory");
    }
    kv_pdl_wait(); /* q and the newest K/V row come from the kernel before */

    /* The loader: thread tid copies chunk column tid % CPR of rows tid / CPR + i * (128 / CPR). */
    const int lcol = tid % G::CPR, lrow = tid / G::CPR;
    constexpr int RSTEP = KV_TC_THREADS / G::CPR;
    auto load_tile = [&](int it) {
        if (it < ntiles) {
            const int tt = t0 + it * G::TT;
            const uint32_t ks = sbase + (uint32_t)((it % KV_TC_STAGES) * 2 * KV_TC_TILE_BYTES);
            const uint32_t vs = ks + KV_TC_TILE_BYTES;
#pragma unroll
            for (int i = 0; i < G::CPT; i++) {
                const int r = lrow + i * RSTEP;
                const bool ok = tt + r < t1;
                const size_t go = (size_t)(ok ? tt + r : t0) * D + lcol * 8;
                const uint32_t so = tc_off<D>(r, lcol);
                tc_cp16(ks + so, kb + go, ok);
                tc_cp16(vs + so, vb + go, ok);
            }
        }
        kv_cp_async_commit(); /* an empty group past the end keeps the counting uniform */
    };
#pragma unroll
    for (int s = 0; s < KV_TC_STAGES - 1; s++) load_tile(s);

    /* Q as A fragments: row = head (g, g + 8), k = channel. */
    uint32_t qa[D / 16][4];
    {
        const TQ *qb = q + (size_t)kvh * group * D;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int h = g + (j & 1) * 8, c = kk * 16 + (j >> 1) * 8 + tig * 2;
                float x0 = 0.0f, x1 = 0.0f;
                if (h < group) {
                    x0 = tc_qf(qb[(size_t)h * D + c]) * qscale;
                    x1 = tc_qf(qb[(size_t)h * D + c + 1]) * qscale;
                }
                qa[kk][j] = kv_pack_half2(x0, x1);
            }
        }
    }

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

    /* ldmatrix lane roles: matrix mi = lane / 8, row r = lane % 8 within it. */
    const int mi = lane >> 3, mr = lane & 7;

    for (int it = 0; it < ntiles; it++) {
        kv_cp_async_wait<KV_TC_STAGES - 2>();
        __syncthreads(); /* tile it is in; every warp is done with tile it - 1 */
        load_tile(it + KV_TC_STAGES - 1);
        const uint32_t ks = sbase + (uint32_t)((it % KV_TC_STAGES) * 2 * KV_TC_TILE_BYTES);
        const uint32_t vs = ks + KV_TC_TILE_BYTES;
        const int tile_t = t0 + it * G::TT;
#pragma unroll
        for (int ch = 0; ch < G::WT / 16; ch++) {
            const int r0 = warp * G::WT + ch * 16; /* first row of these 16 tokens */
            if (tile_t + r0 >= t1) break;          /* warp-uniform */
            float s[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint32_t b[4];
                tc_ldm4(ks + tc_off<D>(r0 + (mi >> 1) * 8 + mr, kk * 2 + (mi & 1)), b);
                const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                kv_mma_16816(s[0], qa[kk], b0);
                kv_mma_16816(s[1], qa[kk], b1);
            }
            /* Tokens past the range: -inf (their rows were zero-filled). */
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (tile_t + r0 + n * 8 + tig * 2 + (j & 1) >= t1) s[n][j] = -INFINITY;
            /* Online softmax per row: row g holds s[n][0..1], row g + 8 s[n][2..3]. */
            float corr[2];
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                float mx = fmaxf(fmaxf(s[0][2 * rr], s[0][2 * rr + 1]), fmaxf(s[1][2 * rr], s[1][2 * rr + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(KV_FULL_MASK, mx, 2));
                const float mn = fmaxf(m[rr], mx), ref = mn == -INFINITY ? 0.0f : mn;
                corr[rr] = tc_ex2(m[rr] - ref);
                float ps = 0.0f;
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    s[n][2 * rr] = tc_ex2(s[n][2 * rr] - ref);
                    s[n][2 * rr + 1] = tc_ex2(s[n][2 * rr + 1] - ref);
                    ps += s[n][2 * rr] + s[n][2 * rr + 1];
                }
                l[rr] = l[rr] * corr[rr] + ps;
                m[rr] = mn;
            }
            const uint32_t pa[4] = {kv_pack_half2(s[0][0], s[0][1]), kv_pack_half2(s[0][2], s[0][3]),
                                    kv_pack_half2(s[1][0], s[1][1]), kv_pack_half2(s[1][2], s[1][3])};
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                o[j][0] *= corr[0], o[j][1] *= corr[0];
                o[j][2] *= corr[1], o[j][3] *= corr[1];
            }
#pragma unroll
            for (int n2 = 0; n2 < D / 16; n2++) {
                uint32_t b[4];
                tc_ldm4t(vs + tc_off<D>(r0 + (mi & 1) * 8 + mr, n2 * 2 + (mi >> 1)), b);
                const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                kv_mma_16816(o[2 * n2], pa, b0);
                kv_mma_16816(o[2 * n2 + 1], pa, b1);
            }
        }
    }
    kv_cp_async_wait<0>();
    __syncthreads(); /* the ring is free: it becomes the merge scratch */

    /* Row sums over the quad; then each warp's state to shared memory. */
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        l[rr] += __shfl_xor_sync(KV_FULL_MASK, l[rr], 1);
        l[rr] += __shfl_xor_sync(KV_FULL_MASK, l[rr], 2);
    }
    float *sm_o = reinterpret_cast<float *>(tc_smem);   /* (warps, 16, D) */
    float *sm_ml = sm_o + KV_TC_WARPS * 16 * D;          /* (warps, 16, 2) */
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        const int c = j * 8 + tig * 2;
        sm_o[(warp * 16 + g) * D + c] = o[j][0];
        sm_o[(warp * 16 + g) * D + c + 1] = o[j][1];
        sm_o[(warp * 16 + g + 8) * D + c] = o[j][2];
        sm_o[(warp * 16 + g + 8) * D + c + 1] = o[j][3];
    }
    if (tig == 0) {
        sm_ml[(warp * 16 + g) * 2] = m[0];
        sm_ml[(warp * 16 + g) * 2 + 1] = l[0];
        sm_ml[(warp * 16 + g + 8) * 2] = m[1];
        sm_ml[(warp * 16 + g + 8) * 2 + 1] = l[1];
    }
    __syncthreads();
    for (int idx = tid; idx < group * D; idx += KV_TC_THREADS) {
        const int h = idx / D, c = idx % D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < KV_TC_WARPS; w++) M = fmaxf(M, sm_ml[(w * 16 + h) * 2]);
        float L = 0.0f, O = 0.0f;
#pragma unroll
        for (int w = 0; w < KV_TC_WARPS; w++) {
            const float f = kv_exp2_diff(sm_ml[(w * 16 + h) * 2], M);
            L += sm_ml[(w * 16 + h) * 2 + 1] * f;
            O += sm_o[(w * 16 + h) * D + c] * f;
        }
        float *rec = part + ((size_t)(kvh * group + h) * nsplit + split) * (D + 2);
        if (c == 0) rec[0] = M, rec[1] = L;
        rec[2 + c] = O;
    }
#endif
}

// --- plan and launch ---------------------------------------------------------------

typedef void (*tc_kernel)(const void *, const __half *, const __half *, float *, int, long long,
                          int, float, int);

/* fp16 queries only (attn_f16.cu keeps float32 queries on the register
 * kernel); the query type stays a template parameter of the kernel. */
static tc_kernel tc_pick(int D, bool qf32, int *slot)
{
    *slot = D == 128 ? 0 : 1;
    if (qf32) return nullptr;
    if (D == 128) return attn_f16_tc<128, __half>;
    if (D == 64) return attn_f16_tc<64, __half>;
    return nullptr;
}

/* Compute capability major of the current device (cached per device): the
 * kernel uses sm_90's bulk L2 prefetch, and the build's PTX for older GPUs
 * would not hold it. */
static int tc_cc_major(void)
{
    static thread_local int cached_dev = -1, cached_major = 0;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (dev != cached_dev) {
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
            return 0;
        cached_dev = dev, cached_major = major;
    }
    return cached_major;
}

bool kv_f16_tc_ok(const kv_attn_dims *d)
{
    const int group = d->n_heads / d->n_kv_heads;
    return tc_cc_major() >= 9 && (d->head_dim == 64 || d->head_dim == 128) && group >= 1 && group <= 16 &&
           d->head_stride % 8 == 0 && d->head_stride >= (long long)d->T * d->head_dim;
}

/* Tokens per split (a whole number of tiles) and splits: about f16_waves
 * waves of resident CTAs (2 per SM with 96 KB of ring each). */
cudaError_t kv_f16_tc_plan(const kv_attn_dims *d, bool qf32, int *tps_out, int *nsplit_out)
{
    static thread_local int occ[2] = {0, 0};
    int slot;
    tc_kernel kern = tc_pick(d->head_dim, qf32, &slot);
    KV_CHECK_ARGS(kern != nullptr);
    const int smem = d->head_dim == 128 ? kv_tc_geom<128>::SMEM : kv_tc_geom<64>::SMEM;
    if (!occ[slot]) {
        CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void *>(kern),
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int per_sm = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, KV_TC_THREADS, smem));
        occ[slot] = per_sm < 1 ? 1 : per_sm;
    }
    const int tt = KV_TC_TILE_BYTES / (d->head_dim * 2);
    const int target = occ[slot] * kv_cuda_sm_count() * kv_cuda_get_tuning()->f16_waves;
    int nsplit = (target + d->n_kv_heads - 1) / d->n_kv_heads;
    int tps = (d->T + nsplit - 1) / nsplit;
    tps = (tps + tt - 1) / tt * tt;
    *tps_out = tps;
    *nsplit_out = (d->T + tps - 1) / tps;
    return cudaSuccess;
}

cudaError_t kv_f16_tc_launch(const kv_attn_dims *d, bool qf32, const void *q, const __half *k,
                             const __half *v, float *part, int tps, int nsplit,
                             cudaStream_t stream)
{
    int slot;
    tc_kernel kern = tc_pick(d->head_dim, qf32, &slot);
    KV_CHECK_ARGS(kern != nullptr);
    const int smem = d->head_dim == 128 ? kv_tc_geom<128>::SMEM : kv_tc_geom<64>::SMEM;
    CUDA_CHECK(kv_launch(2, kern, dim3(d->n_kv_heads, nsplit), dim3(KV_TC_THREADS), (size_t)smem,
                         stream, q, k, v, part, d->T, d->head_stride, tps, d->scale * KV_LOG2E,
                         d->n_heads / d->n_kv_heads));
    return cudaSuccess;
}
