/*
 * eng_dequant: packed ggml rows (Q8_0, Q4_K, Q6_K as stored; eng_quant.cuh)
 * expanded on the device: to fp16/bf16 matrices in the engine's 16-bit
 * layout (rows padded to a pitch, optionally every other row: the prefill
 * dequantizes a layer's packed matrices chunk by chunk and runs cuBLAS on
 * them), and to float32 embedding rows picked by token id (decode and the
 * prefill's first step).  The values are kv_quant_dequant_row's floats
 * exactly (eng_quant.cuh rounds each operation as the reference does), then
 * rounded once to the 16-bit type.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "eng_quant.cuh"

namespace {

template <typename T> struct to16;
template <> struct to16<__half> {
    static __device__ __forceinline__ __half from(float v) { return __float2half_rn(v); }
};
template <> struct to16<__nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};
template <> struct to16<float> {
    static __device__ __forceinline__ float from(float v) { return v; }
};

template <typename T> struct row_out {
    T *o;
    __device__ __forceinline__ void operator()(int i, float v) { o[i] = to16<T>::from(v); }
};

/*
 * One block of threads per output row r: source row tok ? tok[r] : r of W
 * (pitch bytes apart), written to dst + r * step * ldd as cols values, then
 * zeros up to ldd when pad.
 */
template <class Q, typename T>
__global__ void dequant_rows_kernel(const uint8_t *__restrict__ W, size_t pitch, int nb, const int *tok,
                                    T *dst, long long ldd, int step, int pad)
{
    const int r = blockIdx.x;
    const int src = tok ? tok[r] : r;
    const uint8_t *row = W + (size_t)src * pitch;
    T *out = dst + (size_t)r * step * ldd;
    for (int t = threadIdx.x; t < nb * Q::PARTS; t += blockDim.x) {
        const int b = t / Q::PARTS;
        row_out<T> o = {out + (size_t)b * Q::QK};
        Q::values(row + (size_t)b * Q::BYTES, t % Q::PARTS, o);
    }
    if (pad)
        for (long long c = (long long)nb * Q::QK + threadIdx.x; c < ldd; c += blockDim.x) out[c] = to16<T>::from(0.0f);
}

template <class Q, typename T>
cudaError_t launch(const void *W, size_t pitch, int rows, int cols, const int *tok, T *dst, long long ldd,
                   int step, int pad, cudaStream_t s)
{
    KV_CHECK_ARGS(cols % Q::QK == 0 && pitch >= (size_t)(cols / Q::QK) * Q::BYTES && (pitch & 1) == 0 &&
                  ldd >= cols && step >= 1);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, dequant_rows_kernel<Q, T>, dim3((unsigned)rows), dim3(128), 0, s,
                         (const uint8_t *)W, pitch, cols / Q::QK, tok, dst, ldd, step, pad));
    return cudaSuccess;
}

template <typename T>
cudaError_t by_type(const void *W, kv_dtype t, size_t pitch, int rows, int cols, const int *tok, T *dst,
                    long long ldd, int step, int pad, cudaStream_t s)
{
    switch (t) {
    case KV_DT_Q8_0: return launch<eq_q8_0, T>(W, pitch, rows, cols, tok, dst, ldd, step, pad, s);
    case KV_DT_Q4_K:
        KV_CHECK_ARGS(((uintptr_t)W & 15) == 0 && (pitch & 15) == 0);
        return launch<eq_q4_k, T>(W, pitch, rows, cols, tok, dst, ldd, step, pad, s);
    case KV_DT_Q6_K: return launch<eq_q6_k, T>(W, pitch, rows, cols, tok, dst, ldd, step, pad, s);
    default: KV_CHECK_ARGS(eng_packed_type(t));
    }
    return cudaErrorInvalidValue;
}

} // namespace

extern "C" cudaError_t eng_dequant_rows(const void *W, kv_dtype t, int rows, int cols, size_t pitch, void *dst,
                                        kv_dtype dt, int ldd, int step, cudaStream_t s)
{
    KV_CHECK_ARGS(rows > 0 && cols > 0 && W && dst && (dt == KV_DT_F16 || dt == KV_DT_BF16));
    if (dt == KV_DT_BF16)
        return by_type(W, t, pitch, rows, cols, NULL, (__nv_bfloat16 *)dst, ldd, step, 1, s);
    return by_type(W, t, pitch, rows, cols, NULL, (__half *)dst, ldd, step, 1, s);
}

extern "C" cudaError_t eng_embed_rows_q(const void *W, kv_dtype t, int cols, size_t pitch, const int *tok, int n,
                                        float *x, int ldx, cudaStream_t s)
{
    if (n <= 0) return cudaSuccess;
    KV_CHECK_ARGS(cols > 0 && W && tok && x && ldx >= cols);
    return by_type(W, t, pitch, n, cols, tok, x, ldx, 1, 0, s);
}
