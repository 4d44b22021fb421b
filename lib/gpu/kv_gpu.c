/*
 * Build and device probe, and the CUDA failure convention for C code
 * (kv_gpu_cuda.h).  The CUDA runtime is linked statically in CUDA builds, so
 * cudaGetDeviceCount fails cleanly (no crash, no missing library) on a
 * machine without a driver.
 */
#include "gpu/kv_gpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KV_HAVE_CUDA
#include "gpu/kv_gpu_cuda.h"

kv_status kv_cuda_fail(cudaError_t e, const char *stmt, const char *file, int line)
{
    char inner[512];
    snprintf(inner, sizeof inner, "%s", kv_cuda_last_error()); /* a launcher's own record */
    (void)cudaGetLastError();
    kv_cuda_record(e, stmt, file, line);
    char rec[512];
    snprintf(rec, sizeof rec, "%s", kv_cuda_last_error());
    kv_cuda_clear_error();
    const char *sep = inner[0] && strcmp(inner, rec) ? "; inside: " : "";
    if (!*sep) inner[0] = '\0';
    if (e == cudaErrorMemoryAllocation)
        return kv_fail(KV_E_NOMEM, "GPU out of memory: %s%s%s", rec, sep, inner);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorInvalidDevice)
        return kv_fail(KV_E_UNAVAILABLE, "CUDA unavailable: %s%s%s", rec, sep, inner);
    return kv_fail(KV_E_INTERNAL, "CUDA error: %s%s%s", rec, sep, inner);
}

bool kv_gpu_built(void) { return true; }

int kv_gpu_probe(char *name, size_t n)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count <= 0) {
        if (name && n) snprintf(name, n, "%s", cudaGetErrorString(e));
        (void)cudaGetLastError();
        return 0;
    }
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) == cudaSuccess) {
        if (name && n) snprintf(name, n, "%s (sm_%d%d, %zu MiB)", p.name, p.major, p.minor,
                                p.totalGlobalMem >> 20);
    }
    return count;
}

kv_status kv_gpu_buffer_upload(const void *host, size_t n, void **dev)
{
    *dev = NULL;
    if (!n) return KV_OK;
    cudaError_t e = cudaMalloc(dev, n);
    if (e == cudaSuccess) e = cudaMemcpy(*dev, host, n, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        if (*dev) cudaFree(*dev);
        *dev = NULL;
        return kv_cuda_fail(e, "cache tier upload", __FILE__, __LINE__);
    }
    return KV_OK;
}

void kv_gpu_buffer_free(void *dev)
{
    if (dev) cudaFree(dev);
}

/* A one-byte header says how the block was allocated. */
void *kv_gpu_host_alloc(size_t n)
{
    unsigned char *p = NULL;
    if (cudaHostAlloc((void **)&p, n + 64, cudaHostAllocPortable) == cudaSuccess) {
        p[0] = 1;
        return p + 64;
    }
    (void)cudaGetLastError();
    if (!(p = malloc(n + 64))) return NULL;
    p[0] = 0;
    return p + 64;
}

void kv_gpu_host_free(void *q)
{
    if (!q) return;
    unsigned char *p = (unsigned char *)q - 64;
    if (p[0]) cudaFreeHost(p);
    else free(p);
}
#else
bool kv_gpu_built(void) { return false; }

kv_status kv_gpu_buffer_upload(const void *host, size_t n, void **dev)
{
    (void)host, (void)n;
    *dev = NULL;
    return kv_fail(KV_E_UNAVAILABLE, "GPU buffers: CUDA not built in");
}

void kv_gpu_buffer_free(void *dev) { (void)dev; }

void *kv_gpu_host_alloc(size_t n) { return malloc(n ? n : 1); }
void kv_gpu_host_free(void *p) { free(p); }

int kv_gpu_probe(char *name, size_t n)
{
    if (name && n) snprintf(name, n, "CUDA not built in");
    return 0;
}
#endif
