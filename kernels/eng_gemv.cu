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

/* 8 products of a 16-byte weight vector with x (optionally scaled by the
 * RMSNorm weight nw: the norm's 1/rms is applied to the sum afterwards). */
template <typename TT, bool NORM>
static __device__ __forceinline__ float dot8(const uint4 &u, const float4 *__restrict__ x,
                                             const float4 *__restrict__ nw, int i)
{
    float f[8];
    TT::unpack8(u, f);
    float4 a = x[2 * i], b = x[2 * i + 1];
    if (NORM) {
        float4 wa = nw[2 * i], wb = nw[2 * i + 1];
        a.x *= wa.x, a.y *= wa.y, a.z *= wa.z, a.w *= wa.w;
        b.x *= wb.x, b.y *= wb.y, b.z *= wb.z, b.w *= wb.w;
    }
    return f[0] * a.x + f[1] * a.y + f[2] * a.z + f[3] * a.w + f[4] * b.x + f[5] * b.y +
           f[6] * b.z + f[7] * b.w;
}

/*
 * With programmatic dependent launch (kv_cuda_set_pdl, common.cuh) a GEMV
 * may start while the kernel before it in the stream is still finishing.
 * Its blocks first issue their first loads of W (weights never depend on
 * the previous kernel), then wait for the previous grid before they read
 * x, so the weight stream of one projection fills the bandwidth the tail of
 * the previous kernel leaves idle.
 */
/*
 * A warp computes NR consecutive rows of W (NR = 2 for the fused SwiGLU:
 * gate and up rows interleaved), U 16-byte loads of each row in flight per
 * lane.  NORM: x is the raw residual stream and the block first computes
 * its 1/rms (n_x values), so the RMSNorm needs no kernel of its own.
 * GLU: y[o] = silu(gate_o) * up_o from rows 2o and 2o+1.
 */
template <typename TT, bool NORM, bool GLU>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(const uint4 *__restrict__ W, int rows_out, int nv, const float4 *__restrict__ x,
            const float4 *__restrict__ nw, int n_x, float eps, float *__restrict__ y,
            int accumulate)
{
    constexpr int NR = GLU ? 2 : 1;
    constexpr int U = GLU ? 4 : 8;
    kv_pdl_launch_next();
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const bool live = o < rows_out;
    const uint4 *w = W + (size_t)(live ? o : 0) * NR * nv;
    /* the first batch of weight loads, before waiting for x's producer */
    uint4 p[NR][U];
    int i = lane;
    bool full = live && i + 32 * (U - 1) < nv;
    if (full)
#pragma unroll
        for (int q = 0; q < NR; q++)
#pragma unroll
            for (int u = 0; u < U; u++) p[q][u] = eng_ld_stream(w + (size_t)q * nv + i + 32 * u);
    kv_pdl_wait();
    float r = 1.0f;
    if (NORM) {
        __shared__ float red[32];
        const float *xf = reinterpret_cast<const float *>(x);
        float ss = 0.0f;
        for (int j = threadIdx.x; j < n_x; j += blockDim.x) ss += xf[j] * xf[j];
        ss = eng_block_sum(ss, red);
        r = 1.0f / sqrtf(ss / (float)n_x + eps);
    }
    if (!live) return;
    float acc[NR];
#pragma unroll
    for (int q = 0; q < NR; q++) acc[q] = 0.0f;
    while (full) {
#pragma unroll
        for (int q = 0; q < NR; q++)
#pragma unroll
            for (int u = 0; u < U; u++) acc[q] += dot8<TT, NORM>(p[q][u], x, nw, i + 32 * u);
        i += 32 * U;
        full = i + 32 * (U - 1) < nv;
        if (full)
#pragma unroll
            for (int q = 0; q < NR; q++)
#pragma unroll
                for (int u = 0; u < U; u++) p[q][u] = eng_ld_stream(w + (size_t)q * nv + i + 32 * u);
    }
    for (; i < nv; i += 32)
#pragma unroll
        for (int q = 0; q < NR; q++)
            acc[q] += dot8<TT, NORM>(eng_ld_stream(w + (size_t)q * nv + i), x, nw, i);
#pragma unroll
    for (int q = 0; q < NR; q++) acc[q] = eng_warp_sum(acc[q]) * r;
    if (lane == 0) {
        float v = acc[0];
        if (GLU) v = acc[0] / (1.0f + expf(-acc[0])) * acc[NR - 1];
        y[o] = accumulate ? y[o] + v : v;
    }
}

template <bool NORM, bool GLU>
static cudaError_t launch_gemv(const void *W, kv_dtype t, int rows_out, int ld, const float *x,
                        const float *nw, int n_x, float eps, float *y, int accumulate,
                        cudaStream_t s)
{
    dim3 grid((unsigned)((rows_out + GEMV_WARPS - 1) / GEMV_WARPS));
    const dim3 block(GEMV_WARPS * 32);
    if (t == KV_DT_BF16)
        CUDA_CHECK(kv_launch(1, gemv_kernel<eng_bf16, NORM, GLU>, grid, block, 0, s,
                             (const uint4 *)W, rows_out, ld / 8, (const float4 *)x,
                             (const float4 *)nw, n_x, eps, y, accumulate));
    else
        CUDA_CHECK(kv_launch(1, gemv_kernel<eng_f16, NORM, GLU>, grid, block, 0, s,
                             (const uint4 *)W, rows_out, ld / 8, (const float4 *)x,
                             (const float4 *)nw, n_x, eps, y, accumulate));
    return cudaSuccess;
}

extern "C" cudaError_t eng_gemv(const void *W, kv_dtype t, int rows, int ld, const float *x,
                                float *y, int accumulate, cudaStream_t s)
{
    KV_CHECK_ARGS(rows > 0 && ld > 0 && (ld & 7) == 0);
    return launch_gemv<false, false>(W, t, rows, ld, x, NULL, 0, 0.0f, y, accumulate, s);
}

extern "C" cudaError_t eng_gemv_norm(const void *W, kv_dtype t, int rows, int ld, const float *x,
                                     const float *nw, int n_x, float eps, float *y, int glu,
                                     cudaStream_t s)
{
    KV_CHECK_ARGS(rows > 0 && ld > 0 && (ld & 7) == 0 && n_x <= ld);
    if (glu) return launch_gemv<true, true>(W, t, rows, ld, x, nw, n_x, eps, y, 0, s);
    return launch_gemv<true, false>(W, t, rows, ld, x, nw, n_x, eps, y, 0, s);
}

template <typename TT>
__global__ void embed_kernel(const typename TT::T *W, int ld, int n, const int *tok, float *out)
{
    const typename TT::T *row = W + (size_t)(*tok) * ld;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = TT::load(row + i);
}

extern "C" cudaError_t eng_embed(const void *W, kv_dtype t, int ld, int n, const int *tok,
                                 float *out, cudaStream_t s)
{
    unsigned blocks = (unsigned)((n + 255) / 256);
    if (t == KV_DT_BF16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, embed_kernel<eng_bf16>, dim3(blocks), dim3(256), 0, s,
                             (const __nv_bfloat16 *)W, ld, n, tok, out));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, embed_kernel<eng_f16>, dim3(blocks), dim3(256), 0, s,
                             (const __half *)W, ld, n, tok, out));
    return cudaSuccess;
}
