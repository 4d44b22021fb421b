/*
 * Shared by every kernel file: the launch and error convention (which
 * records the failing statement, file, line and device so that host code
 * can report it through kv_cuda_last_error()), the kernel tuning knobs,
 * small fp16 helpers and the tensor-core MMA wrapper.
 */
#ifndef KV_KERNELS_COMMON_CUH
#define KV_KERNELS_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "kv_kernels.h"

/*
 * The one convention of kernels/ for reporting failures (lib/gpu follows it
 * through kv_cuda_fail, lib/gpu/kv_gpu_cuda.h):
 *   every runtime call     CUDA_CHECK(cudaMemcpy2DAsync(...));
 *   every kernel launch    CUDA_CHECK(kv_launch(KV_PDL_NONE, kernel, grid, block, smem, s,
 *                                           args...));
 *   every argument check   KV_CHECK_ARGS(n > 0 && (ld & 7) == 0);
 * A failure records the statement text, file, line and device
 * (kv_cuda_record, read back with kv_cuda_last_error()) and returns the
 * cudaError_t; no launcher prints or synchronises.  Launching through
 * kv_launch (cudaLaunchKernelEx) rather than <<<>>> returns the launch's own
 * status, so a bad configuration or a missing kernel image is reported at
 * the launch, not at the next synchronisation.
 */
#define CUDA_CHECK(stmt)                                                    \
    do {                                                                    \
        cudaError_t kv_e_ = (stmt);                                         \
        if (kv_e_ != cudaSuccess) {                                         \
            kv_cuda_record(kv_e_, #stmt, __FILE__, __LINE__);               \
            return kv_e_;                                                   \
        }                                                                   \
    } while (0)

/* The record of a failed argument check names the launcher and the condition. */
static inline void kv_cuda_record_args(const char *func, const char *cond, const char *file,
                                       int line)
{
    char what[320];
    snprintf(what, sizeof what, "argument check of %s (%s)", func, cond);
    kv_cuda_record(cudaErrorInvalidValue, what, file, line);
}

#define KV_CHECK_ARGS(cond)                                                  \
    do {                                                                     \
        if (!(cond)) {                                                       \
            kv_cuda_record_args(__func__, #cond, __FILE__, __LINE__);        \
            return cudaErrorInvalidValue;                                    \
        }                                                                    \
    } while (0)

static constexpr float KV_LOG2E = 1.4426950408889634f;
static constexpr unsigned KV_FULL_MASK = 0xffffffffu;

/* Multiprocessor count of the current device (cached per device). */
int kv_cuda_sm_count(void);

/*
 * Programmatic dependent launch, device side.  kv_pdl_launch_next: this
 * block no longer holds the next kernel back (called first thing: the next
 * kernel's blocks then take SM slots as this one's retire).  kv_pdl_wait:
 * wait until the previous kernel has finished and its writes are visible;
 * before it a kernel may only read data no earlier kernel writes.  Both
 * return at once in a kernel launched without the attribute.
 */
static __device__ __forceinline__ void kv_pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

static __device__ __forceinline__ void kv_pdl_launch_next()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Launch kernel f on stream s, with programmatic dependent launch when
 * kv_cuda_pdl() is at least level (KV_PDL_NONE: never, for kernels not
 * written for it); returns the launch status. */
#define KV_PDL_NONE 3
template <typename... P, typename... A>
static cudaError_t kv_launch(int level, void (*f)(P...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t s, A &&...args)
{
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = at;
    cfg.numAttrs = kv_cuda_pdl() >= level ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, f, static_cast<A &&>(args)...);
}

/* D = A(16x16, row) * B(16x8, col) + C, fp16 inputs, fp32 accumulators. */
__device__ __forceinline__ void kv_mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2])
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t kv_pack_half2(float lo, float hi)
{
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}

/* Asynchronous 16-byte global -> shared copy (sm_80+), its group commit and
 * wait: the next group's packed data streams in without holding registers. */
__device__ __forceinline__ void kv_cp_async16(void *smem, const void *gmem)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void kv_cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void kv_cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* exp2 that maps -inf to 0 and never produces NaN from (-inf) - (-inf). */
__device__ __forceinline__ float kv_exp2_diff(float a, float b)
{
    return a == -INFINITY ? 0.0f : exp2f(a - b);
}

#endif
