/*
 * fp16 flash-decoding attention (see attn_f16.cuh): grid (kv_heads, nsplit),
 * every block a contiguous token range of one KV head; the split count is
 * chosen so that the grid is about one full wave of resident blocks, each
 * with several 16-byte K and V loads in flight per lane.
 */
#include "attn_f16.cuh"

template <int D, int HPG>
__global__ void __launch_bounds__(KV_F16_THREADS)
    attn_f16_split(const __half *__restrict__ q, const __half *__restrict__ k,
                   const __half *__restrict__ v, float *__restrict__ part, int T,
                   long long head_stride, int tokens_per_split, float qscale)
{
    __shared__ float qs[HPG * D];
    const int kvh = blockIdx.x, split = blockIdx.y, nsplit = gridDim.y;
    for (int i = threadIdx.x; i < HPG * D; i += KV_F16_THREADS)
        qs[i] = __half2float(q[(size_t)kvh * HPG * D + i]) * qscale;
    __syncthreads();
    int t0 = split * tokens_per_split, t1 = min(T, t0 + tokens_per_split);
    kv_f16_block_partial<D, HPG>(qs, k + (size_t)kvh * head_stride, v + (size_t)kvh * head_stride,
                                 t0, t1, part, kvh, split, nsplit);
}

__global__ void attn_combine(const float *__restrict__ part, int D, int nsplit,
                             float *__restrict__ out)
{
    const int qh = blockIdx.x;
    const float *rec = part + (size_t)qh * nsplit * (D + 2);
    float M = -INFINITY;
    for (int s = 0; s < nsplit; s++) M = fmaxf(M, rec[(size_t)s * (D + 2)]);
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float L = 0.0f, O = 0.0f;
        for (int s = 0; s < nsplit; s++) {
            const float *r = rec + (size_t)s * (D + 2);
            float f = kv_exp2_diff(r[0], M);
            L += r[1] * f;
            O += r[2 + c] * f;
        }
        out[(size_t)qh * D + c] = O / L;
    }
}

cudaError_t kv_attn_combine(const float *part, int n_heads, int D, int nsplit, float *out,
                            cudaStream_t stream)
{
    attn_combine<<<n_heads, D, 0, stream>>>(part, D, nsplit, out);
    CUDA_CHECK_KERNEL("attn_combine");
    return cudaSuccess;
}

// --- split choice and dispatch ---------------------------------------------------

static bool f16_dims_ok(const kv_cuda_attn_dims *d)
{
    if (!d || d->n_heads < 1 || d->kv_heads < 1 || d->n_heads % d->kv_heads || d->T < 1)
        return false;
    int hpg = d->n_heads / d->kv_heads;
    if (hpg != 1 && hpg != 2 && hpg != 4 && hpg != 8) return false;
    if (d->head_dim != 64 && d->head_dim != 128) return false;
    return d->head_stride >= (long long)d->T * d->head_dim;
}

/* Tokens per split: about one wave of blocks (4 resident per SM is what the
 * register use of the HPG=4 instance allows), a multiple of a block step. */
static int f16_tokens_per_split(const kv_cuda_attn_dims *d)
{
    int step = kv_f16_block_step(d->head_dim);
    int target_blocks = 4 * kv_cuda_sm_count();
    int nsplit = (target_blocks + d->kv_heads - 1) / d->kv_heads;
    int tps = (d->T + nsplit - 1) / nsplit;
    tps = (tps + step - 1) / step * step;
    return tps < step ? step : tps;
}

static int f16_nsplit(const kv_cuda_attn_dims *d)
{
    int tps = f16_tokens_per_split(d);
    return (d->T + tps - 1) / tps;
}

extern "C" size_t kv_cuda_attn_f16_workspace(const kv_cuda_attn_dims *d)
{
    if (!f16_dims_ok(d)) return 0;
    return (size_t)d->n_heads * f16_nsplit(d) * (d->head_dim + 2) * sizeof(float);
}

template <int D, int HPG>
static cudaError_t launch_f16(const kv_cuda_attn_dims *d, const __half *q, const __half *k,
                              const __half *v, float *part, int tps, int nsplit,
                              cudaStream_t stream)
{
    dim3 grid(d->kv_heads, nsplit);
    attn_f16_split<D, HPG><<<grid, KV_F16_THREADS, 0, stream>>>(
        q, k, v, part, d->T, d->head_stride, tps, d->scale * KV_LOG2E);
    CUDA_CHECK_KERNEL("attn_f16_split");
    return cudaSuccess;
}

extern "C" cudaError_t kv_cuda_attn_f16(const kv_cuda_attn_dims *d, const uint16_t *q,
                                        const uint16_t *k, const uint16_t *v, float *out,
                                        void *ws, size_t ws_bytes, cudaStream_t stream)
{
    if (!f16_dims_ok(d) || !q || !k || !v || !out || !ws ||
        ws_bytes < kv_cuda_attn_f16_workspace(d)) {
        kv_cuda_record(cudaErrorInvalidValue, "kv_cuda_attn_f16 argument check", __FILE__,
                       __LINE__);
        return cudaErrorInvalidValue;
    }
    const __half *qh = reinterpret_cast<const __half *>(q);
    const __half *kh = reinterpret_cast<const __half *>(k);
    const __half *vh = reinterpret_cast<const __half *>(v);
    float *part = static_cast<float *>(ws);
    int tps = f16_tokens_per_split(d), nsplit = f16_nsplit(d);
    int hpg = d->n_heads / d->kv_heads;
    cudaError_t e;
#define KV_F16_CASE(DD, HH)                                                            \
    if (d->head_dim == DD && hpg == HH)                                                \
        e = launch_f16<DD, HH>(d, qh, kh, vh, part, tps, nsplit, stream);              \
    else
    KV_F16_CASE(128, 4) KV_F16_CASE(128, 8) KV_F16_CASE(128, 2) KV_F16_CASE(128, 1)
    KV_F16_CASE(64, 4) KV_F16_CASE(64, 8) KV_F16_CASE(64, 2) KV_F16_CASE(64, 1)
    e = cudaErrorInvalidValue;
#undef KV_F16_CASE
    if (e != cudaSuccess) return e;
    return kv_attn_combine(part, d->n_heads, d->head_dim, nsplit, out, stream);
}
