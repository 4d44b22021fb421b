/*
 * eng_gemv_q: batch-1 decode projections straight from packed ggml blocks,
 * y = W x with W (rows, cols) in Q8_0, Q4_K or Q6_K as stored in the GGUF
 * (kernels/eng_quant.cuh reads them) and x, y float32.  The decode step is
 * bound by the bytes of weights it reads, and a packed row is 3.6x (Q4_K)
 * to 1.9x (Q8_0) smaller than its fp16 conversion, so the blocks are read
 * as they are and expanded in registers.  A warp owns a row; PARTS lanes
 * share a block (eng_quant.cuh), so consecutive lanes read consecutive bytes
 * of the row and consecutive activations.  Activations stay float32 (the CPU
 * path quantizes them to Q8_0/Q8_K first, as llama.cpp's CPU backend does;
 * tests/unit/test_gpu_engine_data.c measures both against float64).
 * CPU reference: kv_quant_dequant_row and kv_quant_dot_ref (lib/model/kv_quants.h).
 */
#include "eng_quant.cuh"

#define GEMVQ_WARPS 8

template <class Q>
__global__ void __launch_bounds__(GEMVQ_WARPS * 32)
gemv_q_kernel(const uint8_t *__restrict__ W, size_t pitch, int rows, int nb, const float *__restrict__ x,
              float *__restrict__ y, int accumulate)
{
    kv_pdl_launch_next();
    kv_pdl_wait(); /* x (and y when accumulating) come from the kernel before */
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * GEMVQ_WARPS + (threadIdx.x >> 5);
    if (o >= rows) return;
    constexpr int PER = 32 / Q::PARTS; /* blocks a warp covers per iteration */
    const uint8_t *row = W + (size_t)o * pitch;
    const int part = lane % Q::PARTS;
    float acc = 0.0f;
    int b = lane / Q::PARTS;
    /* two blocks in flight per lane */
    for (; b + PER < nb; b += 2 * PER)
        acc += Q::dot(row + (size_t)b * Q::BYTES, part, x + (size_t)b * Q::QK) +
               Q::dot(row + (size_t)(b + PER) * Q::BYTES, part, x + (size_t)(b + PER) * Q::QK);
    if (b < nb) acc += Q::dot(row + (size_t)b * Q::BYTES, part, x + (size_t)b * Q::QK);
    acc = eng_warp_sum(acc);
    if (lane == 0) y[o] = accumulate ? y[o] + acc : acc;
}

template <class Q>
static cudaError_t launch(const void *W, size_t pitch, int rows, int cols, const float *x, float *y,
                          int accumulate, cudaStream_t s)
{
    KV_CHECK_ARGS(cols % Q::QK == 0 && pitch >= (size_t)(cols / Q::QK) * Q::BYTES && (pitch & 1) == 0);
    dim3 grid((unsigned)((rows + GEMVQ_WARPS - 1) / GEMVQ_WARPS));
    CUDA_CHECK(kv_launch(1, gemv_q_kernel<Q>, grid, dim3(GEMVQ_WARPS * 32), 0, s, (const uint8_t *)W, pitch,
                         rows, cols / Q::QK, x, y, accumulate));
    return cudaSuccess;
}

extern "C" cudaError_t eng_gemv_q(const void *W, kv_dtype t, int rows, int cols, size_t pitch,
                                  const float *x, float *y, int accumulate, cudaStream_t s)
{
    KV_CHECK_ARGS(rows > 0 && cols > 0 && W && x && y);
    switch (t) {
    case KV_DT_Q8_0: return launch<eq_q8_0>(W, pitch, rows, cols, x, y, accumulate, s);
    case KV_DT_Q4_K:
        KV_CHECK_ARGS(((uintptr_t)W & 15) == 0 && (pitch & 15) == 0);
        return launch<eq_q4_k>(W, pitch, rows, cols, x, y, accumulate, s);
    case KV_DT_Q6_K: return launch<eq_q6_k>(W, pitch, rows, cols, x, y, accumulate, s);
    default: KV_CHECK_ARGS(eng_packed_type(t));
    }
    return cudaErrorInvalidValue;
}
