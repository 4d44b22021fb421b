/*
 * eng_gemv_batch: the decode projections of B sequences at once (one token
 * each), y_b = W x_b for b < B, W fp16 or bf16 read once per step for the
 * whole batch instead of once per sequence.  The arithmetic of each
 * sequence is eng_gemv.cu's to the bit: a warp owns a row, lane i sums the
 * 16-byte weight vectors i, i + 32, i + 64, ... in that order (dot8 below
 * is the same expression), the warp sum and the RMSNorm's block sum are the
 * same reductions over the same 256 threads.  So a batched greedy decode
 * gives each sequence the tokens it gets alone.  What changes is that every
 * weight vector loaded is multiplied with up to 8 sequences' inputs, and
 * the blocks for the sequence chunks of one row range are adjacent in the
 * grid (chunk index fastest), so a chunk after the first finds the rows in
 * L2.  Past a few tens of sequences the multiply-adds on the CUDA cores
 * dominate; lib/gpu/kv_gpu_batch.c then prefers cuBLAS on the tensor cores.
 */
#include "eng_common.cuh"
#include "eng_batch_ops.h"

#define GB_WARPS 8 /* as eng_gemv.cu's GEMV_WARPS: the norm's block sum must match */
#define GB_NB 8    /* sequences per block */

template <typename TT, bool NORM>
static __device__ __forceinline__ float gb_dot8(const float (&f)[8], const float4 *__restrict__ x,
                                                const float4 *__restrict__ nw, int i)
{
    float4 a = x[2 * i], b = x[2 * i + 1];
    if (NORM) {
        float4 wa = nw[2 * i], wb = nw[2 * i + 1];
        a.x *= wa.x, a.y *= wa.y, a.z *= wa.z, a.w *= wa.w;
        b.x *= wb.x, b.y *= wb.y, b.z *= wb.z, b.w *= wb.w;
    }
    return f[0] * a.x + f[1] * a.y + f[2] * a.z + f[3] * a.w + f[4] * b.x + f[5] * b.y +
           f[6] * b.z + f[7] * b.w;
}

template <typename TT, bool NORM, bool GLU>
__global__ void __launch_bounds__(GB_WARPS * 32)
gemv_batch_kernel(const uint4 *__restrict__ W, int rows_out, int nv, const float *__restrict__ x,
                  int ldx, int nb_all, const float4 *__restrict__ nw, int n_x, float eps,
                  float *__restrict__ y, int ldy, int accumulate)
{
    constexpr int NR = GLU ? 2 : 1;
    constexpr int U = GLU ? 2 : 4;
    kv_pdl_launch_next();
    const int b0 = blockIdx.x * GB_NB;
    const int nb = nb_all - b0 < GB_NB ? nb_all - b0 : GB_NB;
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.y * GB_WARPS + (threadIdx.x >> 5);
    const bool live = o < rows_out;
    const uint4 *w = W + (size_t)(live ? o : 0) * NR * nv;
    uint4 p[NR][U];
    int i = lane;
    bool full = live && i + 32 * (U - 1) < nv;
    if (full)
#pragma unroll
        for (int q = 0; q < NR; q++)
#pragma unroll
            for (int u = 0; u < U; u++) p[q][u] = eng_ld_stream(w + (size_t)q * nv + i + 32 * u);
    kv_pdl_wait();
    float r[GB_NB];
#pragma unroll
    for (int b = 0; b < GB_NB; b++) r[b] = 1.0f;
    if (NORM) {
        __shared__ float red[32];
#pragma unroll
        for (int b = 0; b < GB_NB; b++) {
            if (b >= nb) break; /* uniform over the block */
            const float *xf = x + (size_t)(b0 + b) * ldx;
            float ss = 0.0f;
            for (int j = threadIdx.x; j < n_x; j += blockDim.x) ss += xf[j] * xf[j];
            ss = eng_block_sum(ss, red);
            r[b] = 1.0f / sqrtf(ss / (float)n_x + eps);
        }
    }
    if (!live) return;
    float acc[GB_NB][NR];
#pragma unroll
    for (int b = 0; b < GB_NB; b++)
#pragma unroll
        for (int q = 0; q < NR; q++) acc[b][q] = 0.0f;
    while (full) {
#pragma unroll
        for (int q = 0; q < NR; q++)
#pragma unroll
            for (int u = 0; u < U; u++) {
                float f[8];
                TT::unpack8(p[q][u], f);
#pragma unroll
                for (int b = 0; b < GB_NB; b++)
                    if (b < nb)
                        acc[b][q] += gb_dot8<TT, NORM>(
                            f, reinterpret_cast<const float4 *>(x + (size_t)(b0 + b) * ldx), nw, i + 32 * u);
            }
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
        for (int q = 0; q < NR; q++) {
            float f[8];
            TT::unpack8(eng_ld_stream(w + (size_t)q * nv + i), f);
#pragma unroll
            for (int b = 0; b < GB_NB; b++)
                if (b < nb)
                    acc[b][q] += gb_dot8<TT, NORM>(
                        f, reinterpret_cast<const float4 *>(x + (size_t)(b0 + b) * ldx), nw, i);
        }
#pragma unroll
    for (int b = 0; b < GB_NB; b++) {
        if (b >= nb) break;
#pragma unroll
        for (int q = 0; q < NR; q++) acc[b][q] = eng_warp_sum(acc[b][q]) * r[b];
        if (lane == 0) {
            float v = acc[b][0];
            if (GLU) v = acc[b][0] / (1.0f + expf(-acc[b][0])) * acc[b][NR - 1];
            float *yo = y + (size_t)(b0 + b) * ldy + o;
            *yo = accumulate ? *yo + v : v;
        }
    }
}

template <bool NORM, bool GLU>
static cudaError_t launch_gb(const void *W, kv_dtype t, int rows, int ld, const float *x, int ldx, int nb,
                             const float *nw, int n_x, float eps, float *y, int ldy, int accumulate,
                             cudaStream_t s)
{
    const dim3 grid((unsigned)((nb + GB_NB - 1) / GB_NB), (unsigned)((rows + GB_WARPS - 1) / GB_WARPS));
    const dim3 block(GB_WARPS * 32);
    if (t == KV_DT_BF16)
        CUDA_CHECK(kv_launch(1, gemv_batch_kernel<eng_bf16, NORM, GLU>, grid, block, 0, s, (const uint4 *)W,
                             rows, ld / 8, x, ldx, nb, (const float4 *)nw, n_x, eps, y, ldy, accumulate));
    else
        CUDA_CHECK(kv_launch(1, gemv_batch_kernel<eng_f16, NORM, GLU>, grid, block, 0, s, (const uint4 *)W,
                             rows, ld / 8, x, ldx, nb, (const float4 *)nw, n_x, eps, y, ldy, accumulate));
    return cudaSuccess;
}

extern "C" cudaError_t eng_gemv_batch(const void *W, kv_dtype t, int rows, int ld, const float *x, int ldx,
                                      int nb, const float *nw, int n_x, float eps, float *y, int ldy,
                                      eng_gb_mode mode, int accumulate, cudaStream_t s)
{
    KV_CHECK_ARGS(rows > 0 && rows <= 65535 * GB_WARPS && ld > 0 && (ld & 7) == 0 && nb > 0 &&
                  ldx >= ld && (ldx & 3) == 0 && ldy >= rows && (mode == ENG_GB_PLAIN || (nw && n_x <= ld)));
    switch (mode) {
    case ENG_GB_NORM: return launch_gb<true, false>(W, t, rows, ld, x, ldx, nb, nw, n_x, eps, y, ldy, 0, s);
    case ENG_GB_GLU: return launch_gb<true, true>(W, t, rows, ld, x, ldx, nb, nw, n_x, eps, y, ldy, 0, s);
    default: return launch_gb<false, false>(W, t, rows, ld, x, ldx, nb, NULL, 0, 0.0f, y, ldy, accumulate, s);
    }
}

template <typename TT>
__global__ void rows_to_16_kernel(const float *__restrict__ x, int ldx, int cols, int n,
                                  typename TT::T *__restrict__ out, int ldo)
{
    const size_t total = (size_t)n * cols;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        const size_t r = k / (size_t)cols, c = k % (size_t)cols;
        out[r * ldo + c] = TT::from(x[r * ldx + c]);
    }
}

extern "C" cudaError_t eng_rows_to_16(const float *x, int ldx, int cols, int n, void *out, kv_dtype t, int ldo,
                                      cudaStream_t s)
{
    KV_CHECK_ARGS(cols > 0 && n > 0 && ldx >= cols && ldo >= cols);
    size_t total = (size_t)n * cols;
    unsigned blocks = (unsigned)((total + 255) / 256);
    if (blocks > 4096) blocks = 4096;
    if (t == KV_DT_BF16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, rows_to_16_kernel<eng_bf16>, dim3(blocks), dim3(256), 0, s, x, ldx, cols, n,
                             (__nv_bfloat16 *)out, ldo));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, rows_to_16_kernel<eng_f16>, dim3(blocks), dim3(256), 0, s, x, ldx, cols, n,
                             (__half *)out, ldo));
    return cudaSuccess;
}
