/*
 * Build and device probe.  The CUDA runtime is linked statically in CUDA
 * builds, so cudaGetDeviceCount fails cleanly (no crash, no missing library)
 * on a machine without a driver.
 */
#include "gpu/kv_gpu.h"

#include <stdio.h>

#ifdef KV_HAVE_CUDA
#include <cuda_runtime_api.h>

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
#else
bool kv_gpu_built(void) { return false; }

int kv_gpu_probe(char *name, size_t n)
{
    if (name && n) snprintf(name, n, "CUDA not built in");
    return 0;
}
#endif
