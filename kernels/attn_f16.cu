/*
 * fp16 flash-decoding attention (see attn_f16.cuh): grid (kv_heads, nsplit),
 * every block a contiguous token range of one KV head; the split count is
 * chosen so that the grid is about one full wave of resident blocks, each
 * with several 16-byte K and V loads in flight per lane.
 */
#include "attn_f16.cuh"

#include <stdlib.h>

template <int D, int HPG, bool PF, int U = KV_F16_UNROLL>
__global__ void __launch_bounds__(KV_F16_THREADS)
    attn_f16_split(const __half *__restrict__ q, const __half *__restrict__ k,
                   const __half *__restrict__ v, float *__restrict__ part, int T,
                   long long head_stride, int tokens_per_split, float qscale)
{
    __shared__ float qs[HPG * D];
    __shared__ float scratch[kv_f16_smem_floats(D, HPG)];
    kv_pdl_launch_next();
    kv_pdl_wait(); /* q and the newest K/V row come from the kernel before */
    const int kvh = blockIdx.x, split = blockIdx.y, nsplit = gridDim.y;
    for (int i = threadIdx.x; i < HPG * D; i += KV_F16_THREADS)
        qs[i] = __half2float(q[(size_t)kvh * HPG * D + i]) * qscale;
    __syncthreads();
    int t0 = split * tokens_per_split, t1 = min(T, t0 + tokens_per_split);
    kv_f16_block_partial<D, HPG, PF, U>(qs, k + (size_t)kvh * head_stride,
                                     v + (size_t)kvh * head_stride, t0, t1, part, kvh, split, nsplit,
                                     scratch);
}

/* One block per query head: the max and sum over splits in parallel, then
 * warp w accumulates splits w, w+4, ... (lanes over channels, coalesced), and
 * the warps are summed.  Every loop has independent loads, so a few hundred
 * splits cost a few memory latencies rather than one per split. */
#define KV_COMBINE_THREADS 128
__global__ void __launch_bounds__(KV_COMBINE_THREADS)
    attn_combine(const float *__restrict__ part, int D, int nsplit, float *__restrict__ out)
{
    __shared__ float red[KV_COMBINE_THREADS / 32];
    __shared__ float acc_sm[KV_COMBINE_THREADS / 32][128];
    kv_pdl_launch_next();
    kv_pdl_wait();
    const int qh = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t stride = (size_t)D + 2;
    const float *rec = part + (size_t)qh * nsplit * stride;

    float M = -INFINITY;
    for (int s = threadIdx.x; s < nsplit; s += KV_COMBINE_THREADS) M = fmaxf(M, rec[s * stride]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(KV_FULL_MASK, M, o));
    if (lane == 0) red[warp] = M;
    __syncthreads();
    M = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    __syncthreads();

    float L = 0.0f;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* channels lane + 32j, D <= 128 */
#pragma unroll 4
    for (int s = warp; s < nsplit; s += KV_COMBINE_THREADS / 32) {
        const float *r = rec + s * stride;
        float f = kv_exp2_diff(r[0], M);
        L += r[1] * f;
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (lane + 32 * j < D) acc[j] += r[2 + lane + 32 * j] * f;
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
        if (lane + 32 * j < D) acc_sm[warp][lane + 32 * j] = acc[j];
    if (lane == 0) red[warp] = L;
    __syncthreads();
    L = red[0] + red[1] + red[2] + red[3];
    for (int c = threadIdx.x; c < D; c += KV_COMBINE_THREADS)
        out[(size_t)qh * D + c] = (acc_sm[0][c] + acc_sm[1][c] + acc_sm[2][c] + acc_sm[3][c]) / L;
}

cudaError_t kv_attn_combine(const float *part, int n_heads, int D, int nsplit, float *out,
                            cudaStream_t stream)
{
    CUDA_CHECK(kv_launch(2, attn_combine, dim3(n_heads), dim3(KV_COMBINE_THREADS), 0, stream, part, D,
                         nsplit, out));
    return cudaSuccess;
}

// --- split choice and dispatch ---------------------------------------------------

static bool f16_dims_ok(const kv_attn_dims *d)
{
    if (!d || d->n_heads < 1 || d->n_kv_heads < 1 || d->n_heads % d->n_kv_heads || d->T < 1)
        return false;
    int hpg = d->n_heads / d->n_kv_heads;
    if (hpg != 1 && hpg != 2 && hpg != 4 && hpg != 8) return false;
    if (d->head_dim != 64 && d->head_dim != 128) return false;
    return d->head_stride >= (long long)d->T * d->head_dim;
}

typedef void (*f16_kernel)(const __half *, const __half *, const __half *, float *, int,
                           long long, int, float);

/* The single-buffered loop is the default: on the H200 (2026-11-29) it ran
 * 164 us at 128k against 216 us for the prefetching loop, whose extra
 * registers cost a resident block per SM.  KV_F16_PREFETCH=1 in the
 * environment selects the prefetching loop (kept for measurement). */
static bool f16_prefetch(void)
{
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("KV_F16_PREFETCH");
        v = e ? atoi(e) != 0 : 0;
    }
    return v != 0;
}

/* Measurement knobs, read once: KV_F16_UNROLL=8 selects an instance of the
 * Llama geometry (D 128, 4 query heads per KV head) with 8 K and 8 V rows in
 * flight per lane instead of 4; KV_F16_WAVES=n sizes the grid for n waves of
 * resident blocks instead of one. */
static int f16_env(const char *name, int dflt)
{
    const char *e = getenv(name);
    return e ? atoi(e) : dflt;
}

static f16_kernel f16_pick(int D, int hpg, bool pf, int *slot)
{
    static int u8 = -1;
    if (u8 < 0) u8 = f16_env("KV_F16_UNROLL", KV_F16_UNROLL) == 8;
    if (u8 && D == 128 && hpg == 4 && !pf) {
        *slot = 16;
        return attn_f16_split<128, 4, false, 8>;
    }
    int i = 0;
#define KV_F16_PICK(DD, HH)                                                      \
    if (D == DD && hpg == HH) {                                                  \
        *slot = 2 * i + pf;                                                      \
        return pf ? attn_f16_split<DD, HH, true> : attn_f16_split<DD, HH, false>; \
    }                                                                            \
    i++;
    KV_F16_PICK(128, 4) KV_F16_PICK(128, 8) KV_F16_PICK(128, 2) KV_F16_PICK(128, 1)
    KV_F16_PICK(64, 4) KV_F16_PICK(64, 8) KV_F16_PICK(64, 2) KV_F16_PICK(64, 1)
#undef KV_F16_PICK
    return nullptr;
}

/* Tokens per split and split count: about one wave of resident blocks (from
 * the occupancy of the instance, cached), a whole number of block steps. */
static cudaError_t f16_plan(const kv_attn_dims *d, f16_kernel *kern, int *tps_out,
                            int *nsplit_out)
{
    static thread_local int occ[17] = {0};
    int slot = 0;
    f16_kernel k = f16_pick(d->head_dim, d->n_heads / d->n_kv_heads, f16_prefetch(), &slot);
    if (!k) return cudaErrorInvalidValue;
    if (!occ[slot]) {
        int per_sm = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, KV_F16_THREADS, 0));
        occ[slot] = per_sm < 1 ? 1 : per_sm;
    }
    static int waves = -1;
    if (waves < 0) waves = f16_env("KV_F16_WAVES", 1) < 1 ? 1 : f16_env("KV_F16_WAVES", 1);
    int step = kv_f16_block_step(d->head_dim, slot == 16 ? 8 : KV_F16_UNROLL);
    int target_blocks = occ[slot] * kv_cuda_sm_count() * waves;
    int nsplit = (target_blocks + d->n_kv_heads - 1) / d->n_kv_heads;
    int tps = (d->T + nsplit - 1) / nsplit;
    tps = (tps + step - 1) / step * step;
    if (tps < step) tps = step;
    *kern = k;
    *tps_out = tps;
    *nsplit_out = (d->T + tps - 1) / tps;
    return cudaSuccess;
}

extern "C" size_t kv_cuda_attn_f16_workspace(const kv_attn_dims *d)
{
    f16_kernel k;
    int tps, nsplit;
    if (!f16_dims_ok(d) || f16_plan(d, &k, &tps, &nsplit) != cudaSuccess) return 0;
    return (size_t)d->n_heads * nsplit * (d->head_dim + 2) * sizeof(float);
}

extern "C" cudaError_t kv_cuda_attn_f16(const kv_attn_dims *d, const uint16_t *q,
                                        const uint16_t *k, const uint16_t *v, float *out,
                                        void *ws, size_t ws_bytes, cudaStream_t stream)
{
    if (!f16_dims_ok(d) || !q || !k || !v || !out || !ws ||
        ws_bytes < kv_cuda_attn_f16_workspace(d)) {
        kv_cuda_record(cudaErrorInvalidValue, "kv_cuda_attn_f16 argument check", __FILE__,
                       __LINE__);
        return cudaErrorInvalidValue;
    }
    f16_kernel kern;
    int tps, nsplit;
    CUDA_CHECK(f16_plan(d, &kern, &tps, &nsplit));
    float *part = static_cast<float *>(ws);
    CUDA_CHECK(kv_launch(2, kern, dim3(d->n_kv_heads, nsplit), dim3(KV_F16_THREADS), 0, stream,
                         reinterpret_cast<const __half *>(q), reinterpret_cast<const __half *>(k),
                         reinterpret_cast<const __half *>(v), part, d->T, d->head_stride, tps,
                         d->scale * KV_LOG2E));
    return kv_attn_combine(part, d->n_heads, d->head_dim, nsplit, out, stream);
}
