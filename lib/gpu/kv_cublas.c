/*
 * kv_cublas: cuBLAS through dlopen (see kv_cublas.h).  The toolkit's headers
 * give the types and prototypes; nothing is linked.  The library is opened
 * once per process under a pthread_once and never closed (cuBLAS keeps
 * process-wide state, and handles may outlive any one caller).
 */
#include "gpu/kv_cublas.h"

#include <stdio.h>
#include <stdlib.h>

#ifdef KV_HAVE_CUDA

#include <dlfcn.h>
#include <pthread.h>

#include <cublas_api.h>

typedef cublasStatus_t (*create_fn)(cublasHandle_t *);
typedef cublasStatus_t (*destroy_fn)(cublasHandle_t);
typedef cublasStatus_t (*set_stream_fn)(cublasHandle_t, cudaStream_t);
typedef const char *(*status_string_fn)(cublasStatus_t);
typedef cublasStatus_t (*gemm_ex_fn)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int,
                                     int, int, const void *, const void *, cudaDataType, int,
                                     const void *, cudaDataType, int, const void *, void *,
                                     cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);

static struct {
    void *lib;
    create_fn create;
    destroy_fn destroy;
    set_stream_fn set_stream;
    status_string_fn status_string;
    gemm_ex_fn gemm_ex;
    char where[512];
} cb;

static pthread_once_t cb_once = PTHREAD_ONCE_INIT;

static void cb_load(void)
{
    /* the loader's search path first (LD_LIBRARY_PATH, ldconfig), then the
     * toolkit's default install */
    static const char *const names[] = {"libcublas.so.13", "/usr/local/cuda/lib64/libcublas.so.13",
                                        "/usr/local/cuda/targets/x86_64-linux/lib/libcublas.so.13"};
    const char *err = "not found";
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !cb.lib; i++) {
        cb.lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (cb.lib) snprintf(cb.where, sizeof cb.where, "%s", names[i]);
        else if (i == 0) err = dlerror();
    }
    if (!cb.lib) {
        snprintf(cb.where, sizeof cb.where, "cannot load libcublas.so.13 (%s)", err ? err : "?");
        return;
    }
    cb.create = (create_fn)dlsym(cb.lib, "cublasCreate_v2");
    cb.destroy = (destroy_fn)dlsym(cb.lib, "cublasDestroy_v2");
    cb.set_stream = (set_stream_fn)dlsym(cb.lib, "cublasSetStream_v2");
    cb.status_string = (status_string_fn)dlsym(cb.lib, "cublasGetStatusString");
    cb.gemm_ex = (gemm_ex_fn)dlsym(cb.lib, "cublasGemmEx");
    if (!cb.create || !cb.destroy || !cb.set_stream || !cb.gemm_ex) {
        snprintf(cb.where, sizeof cb.where, "%s lacks cublasCreate_v2/cublasGemmEx", names[0]);
        cb.gemm_ex = NULL;
    }
}

struct kv_cublas {
    cublasHandle_t h;
};

const char *kv_cublas_where(void)
{
    pthread_once(&cb_once, cb_load);
    return cb.where;
}

static const char *cb_status(cublasStatus_t s)
{
    return cb.status_string ? cb.status_string(s) : "cuBLAS error";
}

kv_status kv_cublas_open(kv_cublas **out)
{
    *out = NULL;
    pthread_once(&cb_once, cb_load);
    if (!cb.gemm_ex)
        return kv_fail(KV_E_UNAVAILABLE, "cuBLAS is needed for the GPU prefill: %s", cb.where);
    kv_cublas *h = calloc(1, sizeof *h);
    if (!h) return kv_fail(KV_E_NOMEM, "out of memory");
    cublasStatus_t s = cb.create(&h->h);
    if (s != CUBLAS_STATUS_SUCCESS) {
        free(h);
        return kv_fail(s == CUBLAS_STATUS_ALLOC_FAILED ? KV_E_NOMEM : KV_E_UNAVAILABLE,
                       "cublasCreate: %s", cb_status(s));
    }
    *out = h;
    return KV_OK;
}

void kv_cublas_close(kv_cublas *h)
{
    if (!h) return;
    if (h->h) cb.destroy(h->h);
    free(h);
}

static cudaDataType cb_type(kv_gemm_type t)
{
    return t == KV_GEMM_F32 ? CUDA_R_32F : t == KV_GEMM_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

kv_status kv_cublas_gemm(kv_cublas *h, void *stream, int n, int m, int k, const void *W, int ldw,
                         const void *X, int ldx, kv_gemm_type xt, void *Y, int ldy,
                         kv_gemm_type yt, bool accumulate)
{
    if (xt == KV_GEMM_F32 || (yt != KV_GEMM_F32 && yt != xt) || n < 0 || m < 1 || k < 1 ||
        ldw < k || ldx < k || ldy < m)
        return kv_fail(KV_E_USAGE, "GEMM: unsupported types or shape (n %d, m %d, k %d)", n, m, k);
    if (n == 0) return KV_OK;
    cublasStatus_t s = cb.set_stream(h->h, (cudaStream_t)stream);
    /* column-major view: Y^T (m, n) = W (k, m)^T · X^T (k, n) — "TN" */
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cb.gemm_ex(h->h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, W, cb_type(xt), ldw, X,
                       cb_type(xt), ldx, &beta, Y, cb_type(yt), ldy, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return kv_fail(s == CUBLAS_STATUS_ALLOC_FAILED ? KV_E_NOMEM : KV_E_INTERNAL,
                       "cublasGemmEx (%d x %d x %d): %s", n, m, k, cb_status(s));
    return KV_OK;
}

#else /* CPU-only build */

struct kv_cublas {
    int unused;
};

const char *kv_cublas_where(void) { return "CUDA not built in"; }

kv_status kv_cublas_open(kv_cublas **out)
{
    *out = NULL;
    return kv_fail(KV_E_UNAVAILABLE, "cuBLAS: CUDA not built in");
}

void kv_cublas_close(kv_cublas *h) { free(h); }

kv_status kv_cublas_gemm(kv_cublas *h, void *stream, int n, int m, int k, const void *W, int ldw,
                         const void *X, int ldx, kv_gemm_type xt, void *Y, int ldy,
                         kv_gemm_type yt, bool accumulate)
{
    return kv_fail(KV_E_UNAVAILABLE, "cuBLAS: CUDA not built in");
}

#endif
