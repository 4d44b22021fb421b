/*
 * eng_copy: a 2D copy as a kernel, for the GPU engine's decode-step copies.
 * A cudaMemcpy2DAsync captured into a CUDA graph cannot change its shape
 * when the executable graph is updated in place (cudaGraphExecUpdate
 * refuses changes to multidimensional memcpy nodes), while a kernel node
 * takes new arguments and grid sizes, so a copy whose length changes every
 * step (the quant layers' residual rows) is this kernel.  Rows of width
 * bytes, 16 bytes at a time when every address, pitch and the width are
 * 16-byte aligned, byte by byte otherwise.  Its reference is
 * cudaMemcpy2D: tests/unit/test_gpu_graph.c compares the bytes.
 */
#include <stdint.h>

#include "common.cuh"
#include "eng_ops.cuh"

/* T: uint4 (16 bytes) or uint8_t; pitches and width in units of T; row blockIdx.y. */
template <typename T>
__global__ void copy2d_kernel(T *dst, size_t dpitch, const T *src, size_t spitch, size_t w)
{
    const size_t r = blockIdx.y;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < w; i += (size_t)gridDim.x * blockDim.x)
        dst[r * dpitch + i] = src[r * spitch + i];
}

extern "C" cudaError_t eng_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                                   size_t height, cudaStream_t s)
{
    KV_CHECK_ARGS(dst && src && width > 0 && height > 0 && height <= 65535 && width <= dpitch &&
                  width <= spitch);
    const bool v16 = (((uintptr_t)dst | (uintptr_t)src | dpitch | spitch | width) & 15) == 0;
    const size_t u = v16 ? 16 : 1, w = width / u;
    size_t bx = (w + 255) / 256;
    if (bx > 64) bx = 64;
    /* no PDL: the rows copied were written by the kernel just before */
    if (v16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, copy2d_kernel<uint4>, dim3((unsigned)bx, (unsigned)height), dim3(256),
                             0, s, static_cast<uint4 *>(dst), dpitch / u, static_cast<const uint4 *>(src),
                             spitch / u, w));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, copy2d_kernel<uint8_t>, dim3((unsigned)bx, (unsigned)height),
                             dim3(256), 0, s, static_cast<uint8_t *>(dst), dpitch, static_cast<const uint8_t *>(src),
                             spitch, w));
    return cudaSuccess;
}
