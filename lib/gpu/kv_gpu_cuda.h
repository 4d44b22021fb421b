/*
 * kv_gpu_cuda: the failure convention of kernels/common.cuh for the C code
 * that calls CUDA (lib/gpu and the GPU benches in lib/eval).  CUDA builds
 * only.  A failed runtime call or launcher is recorded with its statement
 * text, file, line and device (kv_cuda_record) and becomes a kv_status:
 * KV_E_NOMEM for device memory, KV_E_UNAVAILABLE for a missing device or
 * driver, KV_E_INTERNAL otherwise; the detail is "CUDA error: STATEMENT
 * failed at FILE:LINE on device N: REASON", followed by the launcher's own
 * record (the statement inside it that failed) when there is one.
 */
#ifndef KV_GPU_CUDA_H
#define KV_GPU_CUDA_H

#ifdef KV_HAVE_CUDA

#include <cuda_runtime_api.h>

#include "common/kv_status.h"
#include "kv_kernels.h"

kv_status kv_cuda_fail(cudaError_t e, const char *stmt, const char *file, int line);

/* Return the failure of a CUDA call (runtime call or kernels/ launcher). */
#define KV_CUDA_CK(call)                                                              \
    do {                                                                              \
        cudaError_t kv_ck_e_ = (call);                                                \
        if (kv_ck_e_ != cudaSuccess) return kv_cuda_fail(kv_ck_e_, #call, __FILE__, __LINE__); \
    } while (0)

/* The same for code with a cleanup label: st receives the status. */
#define KV_CUDA_CK_GOTO(call, st, label)                                              \
    do {                                                                              \
        cudaError_t kv_ck_e_ = (call);                                                \
        if (kv_ck_e_ != cudaSuccess) {                                                \
            (st) = kv_cuda_fail(kv_ck_e_, #call, __FILE__, __LINE__);                 \
            goto label;                                                               \
        }                                                                             \
    } while (0)

#endif /* KV_HAVE_CUDA */

#endif
