/*
 * kv_cuda_bench: the measurements behind `kv-bench attn` and `kv-bench
 * pack` (the commands only parse options and print).  GPU timings use CUDA
 * events around many back-to-back launches, rotating among enough copies of
 * the inputs that they cannot stay in L2, and report the median of several
 * repetitions; device-to-device copy bandwidth (bytes read + written) is
 * measured in the same run as the yardstick.  In a build without CUDA the
 * GPU functions return KV_E_UNAVAILABLE; the CPU packing measurement always
 * works.
 */
#ifndef KV_CUDA_BENCH_H
#define KV_CUDA_BENCH_H

#include <stddef.h>

#include "common/kv_status.h"

typedef struct {
    char name[256];   /* device name */
    int sms;          /* multiprocessors */
    size_t l2_bytes;  /* L2 cache size */
    int driver;       /* driver version (e.g. 13000) */
    int runtime;      /* runtime version */
} kv_bench_device;

/* Device description; KV_E_UNAVAILABLE without a usable GPU. */
kv_status kv_cuda_bench_device(kv_bench_device *dev);

/* Device-to-device cudaMemcpy of `bytes`: (bytes read + written) per second. */
kv_status kv_cuda_bench_copy(size_t bytes, int iters, int reps, double *bytes_per_s);

/* Kernel variants kept for measurement (kv_cuda_tuning, kernels/kv_kernels.h,
 * and docs/BENCHMARKS.md, Kernels); all zero: the defaults. */
typedef struct {
    int f16_prefetch; /* 1: the fp16 loop that prefetches the next step's rows */
    int f16_unroll;   /* 0 (= 4) or 8 rows in flight per lane (D 128, 4 heads) */
    int f16_waves;    /* 0 (= 1): waves of resident blocks in the fp16 grid */
    int kivi2_var;    /* packed v2 variant bits; 8, 16, 32 compute wrong results */
    int f16_legacy;   /* 1: the register-streaming fp16 kernel, not the tensor-core one */
    int kivi_kernel;  /* packed kernel: 0 (the default), 2 (v2) or 3 (v3) */
    int kivi3_nst;    /* v3 stages per warp (0: the default) */
    int kivi3_unfused; /* v3 merge: 0 default, 1 separate combine pass, 2 in the kernel */
    int kivi3_cps;    /* v3: blocks per SM cap (0: occupancy) */
    int kivi3_diag;   /* v3: 1 staging only, 2 compute only, 3/4 2 without value/key MMAs */
    int kivi3_noprefetch; /* v3: 1 = no L2 prefetch before the PDL wait */
    int kivi3_var;    /* v3 variant bits: 1 = value-operand sums in fp32 adds */
} kv_bench_variant;

typedef struct {
    int n_heads, n_kv_heads, head_dim, T;
    int group, residual;   /* KIVI geometry of the packed paths */
    int iters, reps;       /* launches per timing, timings (median reported) */
    int check;             /* also compare each path with its CPU reference */
    kv_bench_variant variant; /* set for the run, the defaults restored after */
    int pdl;               /* programmatic dependent launch level (kv_cuda_set_pdl) for the
                              run; -1: 2 on compute capability 9.0 or later (as the GPU
                              engine), else 0; the level used is written back */
} kv_bench_attn_cfg;

typedef struct {
    int ok;            /* measured (0: not supported for this geometry) */
    double seconds;    /* median time of one decode attention */
    double bytes;      /* bytes the path must read (K, V, scales, zeros, residual, q, out) */
    double bytes_per_s;
    double err;        /* normalized error vs the CPU reference, or -1 when not checked */
    int kernel;        /* packed paths: the kernel that ran (2 or 3); 0 for fp16 */
} kv_bench_attn_path;

typedef struct {
    int copies;                  /* input copies rotated to defeat L2 (fp16 path) */
    kv_bench_attn_path f16, kivi1, kivi2;
    int kivi_kernel;             /* the 1/2-bit packed kernel that ran (2 or 3; 0: none) */
    kv_bench_attn_path kivi4;    /* 4 bits (v3 only; ok 0 where it does not serve) */
} kv_bench_attn_result;

kv_status kv_cuda_bench_attn(kv_bench_attn_cfg *c, kv_bench_attn_result *r);

typedef struct {
    int n_kv_heads, head_dim, T, bits, group, residual, iters, reps;
} kv_bench_pack_cfg;

typedef struct {
    double seconds;    /* median time to pack K and V of one layer */
    double in_bytes;   /* fp16 input bytes (K and V) */
    double out_bytes;  /* packed bytes written (codes, scales, zeros, residual) */
} kv_bench_pack_result;

/* GPU: kv_cuda_kivi_pack of K then V. */
kv_status kv_cuda_bench_pack(const kv_bench_pack_cfg *c, kv_bench_pack_result *r);
/* CPU: kv_kivi_pack of K then V (float input made from fp16), with `threads`
 * OpenMP threads (1 = per core). */
kv_status kv_cpu_bench_pack(const kv_bench_pack_cfg *c, int threads, kv_bench_pack_result *r);

/* kv-bench gemv: one decode projection y = W x (batch 1) of a weight type,
 * packed (Q8_0, Q4_K, Q6_K through kernels/eng_gemv_qv.cu's variant) or
 * F16 (the engine's fp16 GEMV; variant ignored).  W holds `distinct`
 * random rows quantized by kv_quant_quantize_row, repeated; copies of W are
 * rotated so that together they exceed L2 four times. */
typedef struct {
    int wtype;         /* ggml type number: KV_GGML_Q8_0, _Q4_K, _Q6_K or _F16 */
    int rows, cols;    /* W (rows, cols) */
    int variant;       /* a packed kv_gemv_variant (common/kv_gemv.h): KV_GEMV_OLD, _ROWS or _DP4A */
    int iters, reps;   /* launches per timing, timings (median reported) */
    int check;         /* compare the output with the CPU reference first */
} kv_bench_gemv_cfg;

typedef struct {
    double seconds;    /* median time of one GEMV */
    double bytes;      /* bytes of W read (packed size), plus x and y */
    double bytes_per_s;
    double err;        /* normalized error vs float64 sums of the dequantized rows, -1 unchecked */
    int copies;        /* copies of W rotated */
} kv_bench_gemv_result;

kv_status kv_cuda_bench_gemv(const kv_bench_gemv_cfg *c, kv_bench_gemv_result *r);

#endif
