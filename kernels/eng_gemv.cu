/*
 * eng_gemv: batch-1 decode projections, y = W x with W in fp16 or bf16 and
 * x, y in float32.  One decode token reads every weight once and does two
 * flops per weight, far below the chip's ~200 flop/byte balance point: the
 * step is bound by memory bandwidth, so what matters is streaming W with
 * 16-byte loads, several in flight per thread, coalesced across the warp.
 * A warp owns one row; x (at most a few tens of KB) stays in L1/L2 and is
 * shared by the block's warps.  cuBLAS would give the same bandwidth for
 * this shape but is a large shared library that must then be present at run
 * time (the build links only the static CUDA runtime), so we do not use it.
 */
#include "eng_common.cuh"

#define GEMV_WARPS 8

template <typename TT>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(const uint4 *__restrict__ W, int rows, int nv, const float4 *__restrict__ x,
            float *__restrict__ y, int accumulate)
{
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const uint4 *w = W + (size_t)row * nv;
    float acc = 0.0f;
    int i = lane;
    /* four independent 16-byte loads in flight per lane */
    for (; i + 96 < nv; i += 128) {
        uint4 p0 = eng_ld_stream(w + i), p1 = eng_ld_stream(w + i + 32);
        uint4 p2 = eng_ld_stream(w + i + 64), p3 = eng_ld_stream(w + i + 96);
        const uint4 ps[4] = {p0, p1, p2, p3};
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float f[8];
            TT::unpack8(ps[u], f);
            float4 a = x[2 * (i + 32 * u)], b = x[2 * (i + 32 * u) + 1];
            acc += f[0] * a.x + f[1] * a.y + f[2] * a.z + f[3] * a.w + f[4] * b.x + f[5] * b.y +
                   f[6] * b.z + f[7] * b.w;
        }
    }
    for (; i < nv; i += 32) {
        float f[8];
        TT::unpack8(eng_ld_stream(w + i), f);
        float4 a = x[2 * i], b = x[2 * i + 1];
        acc += f[0] * a.x + f[1] * a.y + f[2] * a.z + f[3] * a.w + f[4] * b.x + f[5] * b.y +
               f[6] * b.z + f[7] * b.w;
    }
    acc = eng_warp_sum(acc);
    if (lane == 0) y[row] = accumulate ? y[row] + acc : acc;
}

extern "C" cudaError_t eng_gemv(const void *W, eng_dtype t, int rows, int ld, const float *x,
                                float *y, int accumulate, cudaStream_t s)
{
    if (rows <= 0 || ld <= 0 || (ld & 7)) return cudaErrorInvalidValue;
    dim3 grid((unsigned)((rows + GEMV_WARPS - 1) / GEMV_WARPS));
    if (t == ENG_BF16)
        gemv_kernel<eng_bf16><<<grid, GEMV_WARPS * 32, 0, s>>>(
            (const uint4 *)W, rows, ld / 8, (const float4 *)x, y, accumulate);
    else
        gemv_kernel<eng_f16><<<grid, GEMV_WARPS * 32, 0, s>>>(
            (const uint4 *)W, rows, ld / 8, (const float4 *)x, y, accumulate);
    ENG_LAUNCHED();
}

template <typename TT>
__global__ void embed_kernel(const typename TT::T *W, int ld, int n, const int *tok, float *out)
{
    const typename TT::T *row = W + (size_t)(*tok) * ld;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = TT::load(row + i);
}

extern "C" cudaError_t eng_embed(const void *W, eng_dtype t, int ld, int n, const int *tok,
                                 float *out, cudaStream_t s)
{
    unsigned blocks = (unsigned)((n + 255) / 256);
    if (t == ENG_BF16)
        embed_kernel<eng_bf16><<<blocks, 256, 0, s>>>((const __nv_bfloat16 *)W, ld, n, tok, out);
    else
        embed_kernel<eng_f16><<<blocks, 256, 0, s>>>((const __half *)W, ld, n, tok, out);
    ENG_LAUNCHED();
}
