/*
 * kv_cublas: matrix-matrix products on the tensor cores through cuBLAS,
 * loaded lazily.  libcublas.so.13 is opened with dlopen on the first
 * kv_cublas_open() and its few entry points resolved with dlsym, so a CUDA
 * build neither links cuBLAS nor needs it to start: without the library (or
 * in a CPU-only build) kv_cublas_open fails with KV_E_UNAVAILABLE and says
 * what was looked for.  docs/DESIGN.md says why cuBLAS and why lazily.
 *
 * One product shape serves every projection of a prefill chunk: the weights
 * W are stored as the engine stores them, (m, ldw) row-major, one output
 * feature per row; the chunk's activations X are (n, ldx) row-major, one token
 * per row; Y (n, ldy) = X W^T (+ Y when accumulating, the residual add).
 * Inputs are fp16 or bf16 (both of one type), Y is float32 or of the input
 * type; accumulation is float32.
 */
#ifndef KV_CUBLAS_H
#define KV_CUBLAS_H

#include <stdbool.h>

#include "common/kv_status.h"

typedef struct kv_cublas kv_cublas;

typedef enum { KV_GEMM_F16 = 0, KV_GEMM_BF16 = 1, KV_GEMM_F32 = 2 } kv_gemm_type;

/* Load cuBLAS (once per process) and create a handle on the current device. */
kv_status kv_cublas_open(kv_cublas **out);
void kv_cublas_close(kv_cublas *h);

/* Where cuBLAS was found ("libcublas.so.13", a path), or why not. */
const char *kv_cublas_where(void);

/*
 * Y (n, ldy) = X (n, ldx) · W (m, ldw)^T over k input features, or
 * Y += X W^T with accumulate.  Enqueued on stream (a cudaStream_t, passed as
 * void * so this header needs no CUDA headers).  Y's type yt is KV_GEMM_F32
 * or xt; W and X share xt.
 */
kv_status kv_cublas_gemm(kv_cublas *h, void *stream, int n, int m, int k, const void *W, int ldw,
                         const void *X, int ldx, kv_gemm_type xt, void *Y, int ldy,
                         kv_gemm_type yt, bool accumulate);

#endif
