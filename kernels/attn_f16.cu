/*
 * fp16 flash-decoding attention (see attn_f16.cuh), the dispatcher and the
 * register-streaming kernel.  Head dims 64 and 128 with K and V 16-byte
 * aligned go to the pipelined tensor-core kernel of attn_f16_tc.cu (the
 * default since issue 10: about the copy bandwidth at 128k on the H200,
 * docs/BENCHMARKS.md); every other geometry, and the measured variants
 * (kv_cuda_tuning: f16_legacy, f16_prefetch, f16_unroll 8), to the kernel
 * here.  Its grid is (query-head groups, nsplit), every block a contiguous
 * token range of one KV head for HPG of its query heads; the split count is
 * chosen so that the grid is about one full wave of resident blocks, each
 * with several 16-byte K and V loads in flight per lane.  HPG is the query
 * group n_heads / kv_heads when that is 1, 2, 4 or 8 (K and V read once);
 * for a group of 3, 5, 6 or 7 it is the largest of those dividing it, and
 * the KV head's rows are read once per HPG heads.  Head dims 8 to 256
 * (powers of two): a token row is D/8 lanes of 16 bytes.  The query is fp16
 * or float32 (TQ): only its load into shared memory differs.  Both kernels
 * write the partial records that attn_combine (below) merges.
 */
#include "attn_f16.cuh"

static __device__ __forceinline__ float kv_q_float(__half x) { return __half2float(x); }
static __device__ __forceinline__ float kv_q_float(float x) { return x; }

template <int D, int HPG, bool PF, int U = KV_F16_UNROLL, typename TQ = __half>
__global__ void __launch_bounds__(KV_F16_THREADS)
    attn_f16_split(const void *__restrict__ qv, const __half *__restrict__ k,
                   const __half *__restrict__ v, float *__restrict__ part, int T,
                   long long head_stride, int tokens_per_split, float qscale, int group)
{
    const TQ *__restrict__ q = static_cast<const TQ *>(qv);
    __shared__ float qs[HPG * D];
    __shared__ float scratch[kv_f16_smem_floats(D, HPG)];
    kv_pdl_launch_next();
    kv_pdl_wait(); /* q and the newest K/V row come from the kernel before */
    /* blockIdx.x: the HPG query heads starting at blockIdx.x*HPG, of KV head kvh */
    const int qg = blockIdx.x, kvh = qg * HPG / group, split = blockIdx.y, nsplit = gridDim.y;
    for (int i = threadIdx.x; i < HPG * D; i += KV_F16_THREADS)
        qs[i] = kv_q_float(q[(size_t)qg * HPG * D + i]) * qscale;
    __syncthreads();
    int t0 = split * tokens_per_split, t1 = min(T, t0 + tokens_per_split);
    kv_f16_block_partial<D, HPG, PF, U>(qs, k + (size_t)kvh * head_stride,
                                     v + (size_t)kvh * head_stride, t0, t1, part, qg, split, nsplit,
                                     scratch);
}

/* One block per query head, one pass: warp w merges splits w, w+4, ... with
 * an online softmax merge (lanes over channels, coalesced; four records'
 * loads in flight), then the four warps' states merge through shared memory.
 * One memory latency per four splits a warp takes, no separate max pass. */
#define KV_COMBINE_THREADS 128
#define KV_COMBINE_WARPS (KV_COMBINE_THREADS / 32)
template <int NJ> /* channels per lane: lane + 32j, j < NJ, so D <= 32 NJ */
__global__ void __launch_bounds__(KV_COMBINE_THREADS)
    attn_combine(const float *__restrict__ part, int D, int nsplit, float *__restrict__ out)
{
    __shared__ float ml[KV_COMBINE_WARPS][2];
    __shared__ float acc_sm[KV_COMBINE_WARPS][32 * NJ];
    kv_pdl_launch_next();
    kv_pdl_wait();
    const int qh = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t stride = (size_t)D + 2;
    const float *rec = part + (size_t)qh * nsplit * stride;

    float M = -INFINITY, L = 0.0f, acc[NJ];
#pragma unroll
    for (int j = 0; j < NJ; j++) acc[j] = 0.0f;
    for (int s0 = warp; s0 < nsplit; s0 += 4 * KV_COMBINE_WARPS) {
        float m4[4], l4[4], a4[4][NJ];
#pragma unroll
        for (int u = 0; u < 4; u++) { /* loads first */
            const int s = s0 + u * KV_COMBINE_WARPS;
            const float *r = rec + (size_t)(s < nsplit ? s : s0) * stride;
            m4[u] = s < nsplit ? r[0] : -INFINITY;
            l4[u] = r[1];
#pragma unroll
            for (int j = 0; j < NJ; j++) a4[u][j] = lane + 32 * j < D ? r[2 + lane + 32 * j] : 0.0f;
        }
        float mn = M;
#pragma unroll
        for (int u = 0; u < 4; u++) mn = fmaxf(mn, m4[u]);
        const float c = kv_exp2_diff(M, mn);
        L *= c;
#pragma unroll
        for (int j = 0; j < NJ; j++) acc[j] *= c;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const float f = kv_exp2_diff(m4[u], mn);
            L += l4[u] * f;
#pragma unroll
            for (int j = 0; j < NJ; j++) acc[j] += a4[u][j] * f;
        }
        M = mn;
    }
#pragma unroll
    for (int j = 0; j < NJ; j++) acc_sm[warp][lane + 32 * j] = acc[j];
    if (lane == 0) ml[warp][0] = M, ml[warp][1] = L;
    __syncthreads();
    float Mt = -INFINITY;
#pragma unroll
    for (int w = 0; w < KV_COMBINE_WARPS; w++) Mt = fmaxf(Mt, ml[w][0]);
    float f[KV_COMBINE_WARPS], Lt = 0.0f;
#pragma unroll
    for (int w = 0; w < KV_COMBINE_WARPS; w++) {
        f[w] = kv_exp2_diff(ml[w][0], Mt);
        Lt += ml[w][1] * f[w];
    }
    for (int c = threadIdx.x; c < D; c += KV_COMBINE_THREADS) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < KV_COMBINE_WARPS; w++) o += acc_sm[w][c] * f[w];
        out[(size_t)qh * D + c] = o / Lt;
    }
}

cudaError_t kv_attn_combine(const float *part, int n_heads, int D, int nsplit, float *out,
                            cudaStream_t stream)
{
    if (D <= 128)
        CUDA_CHECK(kv_launch(2, attn_combine<4>, dim3(n_heads), dim3(KV_COMBINE_THREADS), 0, stream,
                             part, D, nsplit, out));
    else
        CUDA_CHECK(kv_launch(2, attn_combine<8>, dim3(n_heads), dim3(KV_COMBINE_THREADS), 0, stream,
                             part, D, nsplit, out));
    return cudaSuccess;
}

// --- split choice and dispatch ---------------------------------------------------

static bool f16_dims_ok(const kv_attn_dims *d)
{
    if (!d || d->n_heads < 1 || d->n_kv_heads < 1 || d->n_heads % d->n_kv_heads || d->T < 1)
        return false;
    if (d->n_heads / d->n_kv_heads > 8) return false;
    int D = d->head_dim;
    if (D != 8 && D != 16 && D != 32 && D != 64 && D != 128 && D != 256) return false;
    return d->head_stride >= (long long)d->T * d->head_dim;
}

/* Query heads per block: the largest of 8, 4, 2, 1 that divides the group. */
static int f16_hpg(int group)
{
    return group % 8 == 0 ? 8 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
}

typedef void (*f16_kernel)(const void *, const __half *, const __half *, float *, int,
                           long long, int, float, int);

/* The instance for (D, HPG) and the tuning (kv_cuda_tuning: the defaults
 * are the measured-faster loop, docs/BENCHMARKS.md, Kernels): the
 * single-buffered loop (on the H200, 2026-11-29, 164 us at 128k against
 * 216 us for the prefetching loop, whose extra registers cost a resident
 * block per SM) with 4 rows in flight; f16_prefetch selects the
 * prefetching loop (D 64 and 128), f16_unroll = 8 an instance of the Llama
 * geometry (D 128, 4 heads) with 8 K and 8 V rows in flight per lane; a
 * float32 query has the default loop only.  *slot: a small index of the
 * instance, for the occupancy cache. */
static f16_kernel f16_pick(int D, int hpg, bool qf32, int *slot, int *unroll)
{
    const kv_cuda_tuning *tu = kv_cuda_get_tuning();
    const bool pf = tu->f16_prefetch != 0;
    *unroll = KV_F16_UNROLL;
    if (qf32) {
        int i = 33;
#define KV_F16_PICK_Q32(DD, HH)                                                     \
    if (D == DD && hpg == HH) {                                                     \
        *slot = i;                                                                  \
        return attn_f16_split<DD, HH, false, KV_F16_UNROLL, float>;                 \
    }                                                                               \
    i++;
        KV_F16_PICK_Q32(128, 4) KV_F16_PICK_Q32(128, 8) KV_F16_PICK_Q32(128, 2) KV_F16_PICK_Q32(128, 1)
        KV_F16_PICK_Q32(64, 4) KV_F16_PICK_Q32(64, 8) KV_F16_PICK_Q32(64, 2) KV_F16_PICK_Q32(64, 1)
        KV_F16_PICK_Q32(256, 4) KV_F16_PICK_Q32(256, 8) KV_F16_PICK_Q32(256, 2) KV_F16_PICK_Q32(256, 1)
        KV_F16_PICK_Q32(32, 4) KV_F16_PICK_Q32(32, 8) KV_F16_PICK_Q32(32, 2) KV_F16_PICK_Q32(32, 1)
        KV_F16_PICK_Q32(16, 4) KV_F16_PICK_Q32(16, 8) KV_F16_PICK_Q32(16, 2) KV_F16_PICK_Q32(16, 1)
        KV_F16_PICK_Q32(8, 4) KV_F16_PICK_Q32(8, 8) KV_F16_PICK_Q32(8, 2) KV_F16_PICK_Q32(8, 1)
#undef KV_F16_PICK_Q32
        return nullptr;
    }
    if (tu->f16_unroll == 8 && D == 128 && hpg == 4 && !pf) {
        *slot = 0;
        *unroll = 8;
        return attn_f16_split<128, 4, false, 8>;
    }
    int i = 1;
#define KV_F16_PICK_PF(DD, HH)                                                      \
    if (D == DD && hpg == HH) {                                                     \
        *slot = i + pf;                                                             \
        return pf ? attn_f16_split<DD, HH, true> : attn_f16_split<DD, HH, false>;   \
    }                                                                               \
    i += 2;
#define KV_F16_PICK(DD, HH)                                                         \
    if (D == DD && hpg == HH) {                                                     \
        *slot = i;                                                                  \
        return attn_f16_split<DD, HH, false>;                                       \
    }                                                                               \
    i++;
    KV_F16_PICK_PF(128, 4) KV_F16_PICK_PF(128, 8) KV_F16_PICK_PF(128, 2) KV_F16_PICK_PF(128, 1)
    KV_F16_PICK_PF(64, 4) KV_F16_PICK_PF(64, 8) KV_F16_PICK_PF(64, 2) KV_F16_PICK_PF(64, 1)
    KV_F16_PICK(256, 4) KV_F16_PICK(256, 8) KV_F16_PICK(256, 2) KV_F16_PICK(256, 1)
    KV_F16_PICK(32, 4) KV_F16_PICK(32, 8) KV_F16_PICK(32, 2) KV_F16_PICK(32, 1)
    KV_F16_PICK(16, 4) KV_F16_PICK(16, 8) KV_F16_PICK(16, 2) KV_F16_PICK(16, 1)
    KV_F16_PICK(8, 4) KV_F16_PICK(8, 8) KV_F16_PICK(8, 2) KV_F16_PICK(8, 1)
#undef KV_F16_PICK
#undef KV_F16_PICK_PF
    return nullptr;
}
#define KV_F16_SLOTS 57

/* Tokens per split and split count: about f16_waves waves of resident
 * blocks (from the occupancy of the instance, cached), a whole number of
 * block steps. */
static cudaError_t f16_plan(const kv_attn_dims *d, bool qf32, f16_kernel *kern, int *tps_out,
                            int *nsplit_out)
{
    static thread_local int occ[KV_F16_SLOTS] = {0};
    int slot = 0, unroll = KV_F16_UNROLL;
    const int hpg = f16_hpg(d->n_heads / d->n_kv_heads), nqg = d->n_heads / hpg;
    f16_kernel k = f16_pick(d->head_dim, hpg, qf32, &slot, &unroll);
    KV_CHECK_ARGS(k != nullptr);
    if (!occ[slot]) {
        int per_sm = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, KV_F16_THREADS, 0));
        occ[slot] = per_sm < 1 ? 1 : per_sm;
    }
    int step = kv_f16_block_step(d->head_dim, unroll);
    int target_blocks = occ[slot] * kv_cuda_sm_count() * kv_cuda_get_tuning()->f16_waves;
    int nsplit = (target_blocks + nqg - 1) / nqg;
    int tps = (d->T + nsplit - 1) / nsplit;
    tps = (tps + step - 1) / step * step;
    if (tps < step) tps = step;
    *kern = k;
    *tps_out = tps;
    *nsplit_out = (d->T + tps - 1) / tps;
    return cudaSuccess;
}

/* Does the pipelined tensor-core kernel serve d (and the tuning allow it)?
 * Only for an fp16 query: the engine passes a float32 query exactly where
 * it wants float32 numerics (docs/DESIGN.md), and the tensor-core kernel
 * would round it (and p) to fp16. */
static bool f16_use_tc(const kv_attn_dims *d, bool qf32)
{
    const kv_cuda_tuning *tu = kv_cuda_get_tuning();
    return !qf32 && !tu->f16_legacy && !tu->f16_prefetch && tu->f16_unroll != 8 && kv_f16_tc_ok(d);
}

/* Enough for either kernel's plan (the launch falls back to the register
 * kernel when K or V is not 16-byte aligned, which the size cannot know). */
static size_t f16_workspace(const kv_attn_dims *d, bool qf32)
{
    f16_kernel k;
    int tps, nsplit, tc_tps, tc_nsplit;
    if (!f16_dims_ok(d) || f16_plan(d, qf32, &k, &tps, &nsplit) != cudaSuccess) return 0;
    if (f16_use_tc(d, qf32)) {
        if (kv_f16_tc_plan(d, qf32, &tc_tps, &tc_nsplit) != cudaSuccess) return 0;
        if (tc_nsplit > nsplit) nsplit = tc_nsplit;
    }
    return (size_t)d->n_heads * nsplit * (d->head_dim + 2) * sizeof(float);
}

/* After the launcher's argument check (which names the launcher). */
static cudaError_t f16_attend(const kv_attn_dims *d, bool qf32, const void *q,
                              const uint16_t *k, const uint16_t *v, float *out, void *ws,
                              cudaStream_t stream)
{
    f16_kernel kern;
    int tps, nsplit;
    float *part = static_cast<float *>(ws);
    if (f16_use_tc(d, qf32) && ((uintptr_t)k & 15) == 0 && ((uintptr_t)v & 15) == 0) {
        CUDA_CHECK(kv_f16_tc_plan(d, qf32, &tps, &nsplit));
        CUDA_CHECK(kv_f16_tc_launch(d, qf32, q, reinterpret_cast<const __half *>(k),
                                    reinterpret_cast<const __half *>(v), part, tps, nsplit, stream));
        return kv_attn_combine(part, d->n_heads, d->head_dim, nsplit, out, stream);
    }
    CUDA_CHECK(f16_plan(d, qf32, &kern, &tps, &nsplit));
    const int group = d->n_heads / d->n_kv_heads, hpg = f16_hpg(group);
    CUDA_CHECK(kv_launch(2, kern, dim3(d->n_heads / hpg, nsplit), dim3(KV_F16_THREADS), 0, stream,
                         q, reinterpret_cast<const __half *>(k),
                         reinterpret_cast<const __half *>(v), part, d->T, d->head_stride, tps,
                         d->scale * KV_LOG2E, group));
    return kv_attn_combine(part, d->n_heads, d->head_dim, nsplit, out, stream);
}

extern "C" size_t kv_cuda_attn_f16_workspace(const kv_attn_dims *d)
{
    return f16_workspace(d, false);
}

extern "C" size_t kv_cuda_attn_f16_q32_workspace(const kv_attn_dims *d)
{
    return f16_workspace(d, true);
}

extern "C" cudaError_t kv_cuda_attn_f16(const kv_attn_dims *d, const uint16_t *q,
                                        const uint16_t *k, const uint16_t *v, float *out,
                                        void *ws, size_t ws_bytes, cudaStream_t stream)
{
    KV_CHECK_ARGS(f16_dims_ok(d) && q && k && v && out && ws &&
                  ws_bytes >= f16_workspace(d, false));
    return f16_attend(d, false, q, k, v, out, ws, stream);
}

extern "C" cudaError_t kv_cuda_attn_f16_q32(const kv_attn_dims *d, const float *q,
                                            const uint16_t *k, const uint16_t *v, float *out,
                                            void *ws, size_t ws_bytes, cudaStream_t stream)
{
    KV_CHECK_ARGS(f16_dims_ok(d) && q && k && v && out && ws &&
                  ws_bytes >= f16_workspace(d, true));
    return f16_attend(d, true, q, k, v, out, ws, stream);
}
