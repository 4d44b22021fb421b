/*
 * prefill_elem: the row-wise kernels of a prefill chunk — embedding rows,
 * RMSNorm to the 16-bit GEMM input, RoPE with the store of K and V into the
 * layer's cache, and SwiGLU — each one pass over the chunk's rows, reading
 * and writing 16-byte or 8-byte vectors.  The arithmetic is
 * lib/engine/kv_engine.c's (float angles, the same norm formula), so a GPU
 * prefill stays within 16-bit rounding of the CPU one.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "prefill_ops.h"

namespace {

template <int BF> struct cv;
template <> struct cv<0> {
    typedef __half T;
    static __device__ __forceinline__ T from(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ float to(T x) { return __half2float(x); }
};
template <> struct cv<1> {
    typedef __nv_bfloat16 T;
    static __device__ __forceinline__ T from(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ float to(T x) { return __bfloat162float(x); }
};

static __device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(KV_FULL_MASK, v, o);
    return v;
}

/* Block-wide sum (blockDim.x a multiple of 32); every thread gets it. */
static __device__ __forceinline__ float block_sum(float v)
{
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    return warp_sum(lane < nw ? red[lane] : 0.0f);
}

// --- embedding ------------------------------------------------------------------------

template <int BF>
__global__ void embed_kernel(const typename cv<BF>::T *W, int ldw, int dim, const int *tok,
                             float *x, int ldx)
{
    const int i = blockIdx.x;
    const typename cv<BF>::T *r = W + (size_t)tok[i] * (size_t)ldw;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) x[(size_t)i * ldx + c] = cv<BF>::to(r[c]);
}

// --- RMSNorm -----------------------------------------------------------------------------

template <int BF>
__global__ void rmsnorm_rows_kernel(const float *x, int ldx, const float *w, int dim, float eps,
                                    typename cv<BF>::T *out, int ldo)
{
    const float *xr = x + (size_t)blockIdx.x * ldx;
    typename cv<BF>::T *orow = out + (size_t)blockIdx.x * ldo;
    float ss = 0.0f;
    if ((dim & 3) == 0 && (ldx & 3) == 0) {
        const float4 *x4 = reinterpret_cast<const float4 *>(xr);
        for (int c = threadIdx.x; c < dim / 4; c += blockDim.x) {
            float4 a = x4[c];
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
        }
    } else {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += xr[c] * xr[c];
    }
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) orow[c] = cv<BF>::from(w[c] * (r * xr[c]));
}

// --- RoPE and the K/V store --------------------------------------------------------------

/* One thread per rotated pair (q and k) or per value pair (v), per row. */
template <int BF>
__global__ void rope_rows_kernel(const float *qkv, int ldqkv, int nqh, int nkv, int hd,
                                 const float *inv_freq, int p0, int rope_off,
                                 typename cv<BF>::T *qout, int ldq, typename cv<BF>::T *kc,
                                 typename cv<BF>::T *vc, long long kv_stride)
{
    typedef typename cv<BF>::T T;
    const int i = blockIdx.y; /* row of the chunk */
    const int half = hd / 2;
    const int nrot = (nqh + nkv) * half, nall = nrot + nkv * half;
    const int pos = p0 + i; /* the cache row; RoPE at pos + rope_off */
    const float *row = qkv + (size_t)i * ldqkv;
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < nall; p += gridDim.x * blockDim.x) {
        const int head = p / half, j = p % half;
        float2 x = *reinterpret_cast<const float2 *>(row + (size_t)head * hd + 2 * j);
        if (p < nrot) {
            float a = (float)(pos + rope_off) * inv_freq[j]; /* float angle, as the CPU engine */
            float c = cosf(a), sn = sinf(a);
            float y0 = x.x * c - x.y * sn, y1 = x.x * sn + x.y * c;
            x.x = y0;
            x.y = y1;
        }
        T *dst;
        if (head < nqh) {
            dst = qout + (size_t)i * ldq + (size_t)head * hd;
        } else if (head < nqh + nkv) {
            dst = kc + (size_t)(head - nqh) * kv_stride + (size_t)pos * hd;
        } else {
            dst = vc + (size_t)(head - nqh - nkv) * kv_stride + (size_t)pos * hd;
        }
        dst[2 * j] = cv<BF>::from(x.x);
        dst[2 * j + 1] = cv<BF>::from(x.y);
    }
}

// --- SwiGLU ----------------------------------------------------------------------------

template <int BF>
__global__ void swiglu_rows_kernel(const float *gu, int ldgu, int hidden, typename cv<BF>::T *h,
                                   int ldh)
{
    const int i = blockIdx.y;
    const float *r = gu + (size_t)i * ldgu;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < hidden; c += gridDim.x * blockDim.x) {
        float2 p = *reinterpret_cast<const float2 *>(r + 2 * (size_t)c);
        float g = p.x;
        g *= 1.0f / (1.0f + expf(-g));
        h[(size_t)i * ldh + c] = cv<BF>::from(g * p.y);
    }
}

template <int BF>
__global__ void rows_to_f32_kernel(const typename cv<BF>::T *x, int ldx, int cols, float *out,
                                   int ldo)
{
    const int i = blockIdx.y;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x)
        out[(size_t)i * ldo + c] = cv<BF>::to(x[(size_t)i * ldx + c]);
}

} // namespace

// --- launchers ------------------------------------------------------------------------------

extern "C" cudaError_t pf_embed_rows(const void *W, pf_dtype t, int ldw, int dim, const int *tok,
                                     int n, float *x, int ldx, cudaStream_t s)
{
    if (n <= 0) return cudaSuccess;
    if (t == PF_BF16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, embed_kernel<1>, dim3(n), dim3(256), 0, s, (const __nv_bfloat16 *)W, ldw, dim, tok, x, ldx));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, embed_kernel<0>, dim3(n), dim3(256), 0, s, (const __half *)W, ldw, dim, tok, x, ldx));
    return cudaSuccess;
}

extern "C" cudaError_t pf_rmsnorm_rows(const float *x, int ldx, const float *w, int dim, float eps,
                                       int n, void *out, pf_dtype t, int ldo, cudaStream_t s)
{
    if (n <= 0) return cudaSuccess;
    if (t == PF_BF16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, rmsnorm_rows_kernel<1>, dim3(n), dim3(256), 0, s, x, ldx, w, dim, eps, (__nv_bfloat16 *)out, ldo));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, rmsnorm_rows_kernel<0>, dim3(n), dim3(256), 0, s, x, ldx, w, dim, eps, (__half *)out, ldo));
    return cudaSuccess;
}

extern "C" cudaError_t pf_rope_rows(const float *qkv, int ldqkv, int n_heads, int kv_heads, int hd,
                                    const float *inv_freq, int p0, int n, void *qout, int ldq,
                                    void *kc, void *vc, long long kv_stride, pf_dtype t,
                                    cudaStream_t s)
{
    return pf_rope_rows_at(qkv, ldqkv, n_heads, kv_heads, hd, inv_freq, p0, 0, n, qout, ldq, kc, vc,
                           kv_stride, t, s);
}

extern "C" cudaError_t pf_rope_rows_at(const float *qkv, int ldqkv, int n_heads, int kv_heads, int hd,
                                       const float *inv_freq, int p0, int rope_off, int n, void *qout,
                                       int ldq, void *kc, void *vc, long long kv_stride, pf_dtype t,
                                       cudaStream_t s)
{
    if (n <= 0) return cudaSuccess;
    KV_CHECK_ARGS(!(hd & 1) && !(ldqkv & 1));
    const int nall = (n_heads + 2 * kv_heads) * hd / 2;
    dim3 grid((unsigned)((nall + 255) / 256), (unsigned)n);
    if (t == PF_BF16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, rope_rows_kernel<1>, dim3(grid), dim3(256), 0, s, qkv, ldqkv, n_heads, kv_heads, hd, inv_freq, p0, rope_off,
                                                 (__nv_bfloat16 *)qout, ldq, (__nv_bfloat16 *)kc,
                                                 (__nv_bfloat16 *)vc, kv_stride));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, rope_rows_kernel<0>, dim3(grid), dim3(256), 0, s, qkv, ldqkv, n_heads, kv_heads, hd, inv_freq, p0, rope_off,
                                                 (__half *)qout, ldq, (__half *)kc, (__half *)vc,
                                                 kv_stride));
    return cudaSuccess;
}

extern "C" cudaError_t pf_swiglu_rows(const float *gu, int ldgu, int hidden, int n, void *h,
                                      pf_dtype t, int ldh, cudaStream_t s)
{
    if (n <= 0) return cudaSuccess;
    KV_CHECK_ARGS(!(ldgu & 1));
    dim3 grid((unsigned)((hidden + 255) / 256), (unsigned)n);
    if (t == PF_BF16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, swiglu_rows_kernel<1>, dim3(grid), dim3(256), 0, s, gu, ldgu, hidden, (__nv_bfloat16 *)h, ldh));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, swiglu_rows_kernel<0>, dim3(grid), dim3(256), 0, s, gu, ldgu, hidden, (__half *)h, ldh));
    return cudaSuccess;
}

extern "C" cudaError_t pf_rows_to_f32(const void *x, pf_dtype t, int ldx, int cols, int n, float *out,
                                      int ldo, cudaStream_t s)
{
    if (n <= 0) return cudaSuccess;
    dim3 grid((unsigned)((cols + 255) / 256), (unsigned)n);
    if (t == PF_BF16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, rows_to_f32_kernel<1>, dim3(grid), dim3(256), 0, s, (const __nv_bfloat16 *)x, ldx, cols, out, ldo));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, rows_to_f32_kernel<0>, dim3(grid), dim3(256), 0, s, (const __half *)x, ldx, cols, out, ldo));
    return cudaSuccess;
}
