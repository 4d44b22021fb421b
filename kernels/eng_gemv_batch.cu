/*
 * eng_gemv_batch: the decode projections of B sequences at once (one token
 * each), y_b = W x_b for b < B, W fp16 or bf16 read once per step for the
 * whole batch instead of once per sequence.  The arithmetic of each
 * sequence is eng_gemv.cu's to the bit: a warp owns a row, lane i sums the
 * 16-byte weight vectors i, i + 32, i + 64, ... in that order (dot8 below
 * is the same expression), the warp sum and the RMSNorm's block sum are the
 * same reductions over the same 256 threads.  So a batched greedy decode
 * gives each sequence the tokens it gets alone.  What changes is that every
 * weight vector loaded is multiplied with up to 8 sequences' inputs, each
 * input vector loaded serves 4 rows (a warp owns 4 outputs), and the blocks
 * for the sequence chunks of one row range are adjacent in the grid (chunk
 * index fastest), so a chunk after the first finds the rows in L2.  Past a few tens of sequences the multiply-adds on the CUDA cores
 * dominate; lib/gpu/kv_gpu_batch.c then prefers cuBLAS on the tensor cores.
 */
#include "eng_common.cuh"
#include "eng_batch_ops.h"

#define GB_WARPS 8 /* as eng_gemv.cu's GEMV_WARPS: the norm's block sum must match */
#define GB_NB 8    /* sequences per block */

/* The 8 products of eng_gemv.cu's dot8, the same expression (so the same
 * rounding), on an already unpacked weight vector f and an input a, b whose
 * RMSNorm weight has already been applied (x * nw, as dot8 computes it). */
static __device__ __forceinline__ float gb_dot8(const float (&f)[8], const float4 &a, const float4 &b)
{
    return f[0] * a.x + f[1] * a.y + f[2] * a.z + f[3] * a.w + f[4] * b.x + f[5] * b.y +
           f[6] * b.z + f[7] * b.w;
}

/*
 * A warp owns R consecutive outputs (GLU: R gate/up pairs), so every input
 * vector it loads serves R rows: the loads of x, not the weights, are what
 * bounds a GEMV over several sequences.  Lane i still sums the weight
 * vectors i, i + 32, ... of each row in increasing order, as eng_gemv.cu.
 */
template <typename TT, bool NORM, bool GLU>
__global__ void __launch_bounds__(GB_WARPS * 32)
gemv_batch_kernel(const uint4 *__restrict__ W, int rows_out, int nv, const float *__restrict__ x,
                  int ldx, int nb_all, const float4 *__restrict__ nw, int n_x, float eps,
                  float *__restrict__ y, int ldy, int accumulate)
{
    constexpr int NR = GLU ? 2 : 1;   /* weight rows per output */
    constexpr int R = GLU ? 2 : 4;    /* outputs per warp */
    constexpr int WR = NR * R;        /* weight rows per warp */
    kv_pdl_launch_next();
    const int b0 = blockIdx.x * GB_NB;
    const int nb = nb_all - b0 < GB_NB ? nb_all - b0 : GB_NB;
    const int lane = threadIdx.x & 31;
    const int o0 = (blockIdx.y * GB_WARPS + (threadIdx.x >> 5)) * R;
    const uint4 *w[WR];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int q = 0; q < NR; q++)
            w[r * NR + q] = W + ((size_t)(o0 + r < rows_out ? o0 + r : 0) * NR + q) * nv;
    /* the first weight loads, before waiting for x's producer */
    uint4 p[WR];
    if (o0 < rows_out && lane < nv)
#pragma unroll
        for (int k = 0; k < WR; k++) p[k] = eng_ld_stream(w[k] + lane);
    kv_pdl_wait();
    float rn[GB_NB];
#pragma unroll
    for (int b = 0; b < GB_NB; b++) rn[b] = 1.0f;
    if (NORM) {
        __shared__ float red[32];
#pragma unroll
        for (int b = 0; b < GB_NB; b++) {
            if (b >= nb) break; /* uniform over the block */
            const float *xf = x + (size_t)(b0 + b) * ldx;
            float ss = 0.0f;
            for (int j = threadIdx.x; j < n_x; j += blockDim.x) ss += xf[j] * xf[j];
            ss = eng_block_sum(ss, red);
            rn[b] = 1.0f / sqrtf(ss / (float)n_x + eps);
        }
    }
    if (o0 >= rows_out) return;
    float acc[GB_NB][WR];
#pragma unroll
    for (int b = 0; b < GB_NB; b++)
#pragma unroll
        for (int k = 0; k < WR; k++) acc[b][k] = 0.0f;
    for (int i = lane; i < nv; i += 32) {
        float f[WR][8];
#pragma unroll
        for (int k = 0; k < WR; k++) TT::unpack8(p[k], f[k]);
        if (i + 32 < nv) /* the next weights in flight while these are used */
#pragma unroll
            for (int k = 0; k < WR; k++) p[k] = eng_ld_stream(w[k] + i + 32);
        float4 na = make_float4(1.f, 1.f, 1.f, 1.f), nb4 = na;
        if (NORM) na = nw[2 * i], nb4 = nw[2 * i + 1];
#pragma unroll
        for (int b = 0; b < GB_NB; b++) {
            if (b < nb) {
                const float4 *xb = reinterpret_cast<const float4 *>(x + (size_t)(b0 + b) * ldx);
                float4 a = xb[2 * i], c = xb[2 * i + 1];
                if (NORM) {
                    a.x *= na.x, a.y *= na.y, a.z *= na.z, a.w *= na.w;
                    c.x *= nb4.x, c.y *= nb4.y, c.z *= nb4.z, c.w *= nb4.w;
                }
#pragma unroll
                for (int k = 0; k < WR; k++) acc[b][k] += gb_dot8(f[k], a, c);
            }
        }
    }
#pragma unroll
    for (int b = 0; b < GB_NB; b++) {
        if (b >= nb) break;
#pragma unroll
        for (int k = 0; k < WR; k++) acc[b][k] = eng_warp_sum(acc[b][k]) * rn[b];
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (o0 + r >= rows_out) break;
                float v = acc[b][r * NR];
                if (GLU) v = acc[b][r * NR] / (1.0f + expf(-acc[b][r * NR])) * acc[b][r * NR + NR - 1];
                float *yo = y + (size_t)(b0 + b) * ldy + o0 + r;
                *yo = accumulate ? *yo + v : v;
            }
    }
}

template <bool NORM, bool GLU>
static cudaError_t launch_gb(const void *W, kv_dtype t, int rows, int ld, const float *x, int ldx, int nb,
                             const float *nw, int n_x, float eps, float *y, int ldy, int accumulate,
                             cudaStream_t s)
{
    constexpr int R = GLU ? 2 : 4;
    const int per_block = GB_WARPS * R;
    const dim3 grid((unsigned)((nb + GB_NB - 1) / GB_NB), (unsigned)((rows + per_block - 1) / per_block));
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
    KV_CHECK_ARGS(rows > 0 && rows <= 65535 * GB_WARPS * 2 && ld > 0 && (ld & 7) == 0 && nb > 0 &&
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
