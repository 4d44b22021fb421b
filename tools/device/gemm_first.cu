/*
 * gemm_first: the cost of a cuBLAS product's first call at a row count not
 * seen before in the process, against its later calls.  A device
 * diagnostic for the host tier's bimodal prefill (docs/BENCHMARKS.md): the
 * engine's four products per layer (lib/gpu/kv_gpu_prefill.c, the 8B's
 * shapes) called as kv_cublas_gemm calls them (TN, fp16 in, float32 out,
 * float32 accumulation, CUBLAS_GEMM_DEFAULT; each output's pitch is its
 * own width here, where the engine's q/k/v output has the workspace's
 * wider pitch), for every row count in
 * a range, each timed on the host clock around a synchronised call: its
 * first call, then the best of three more.  A first call much slower than
 * the later ones means per-shape set-up (the heuristic, or a kernel loaded
 * on first use under CUDA_MODULE_LOADING=LAZY, the default).
 *
 *   nvcc -O2 -arch=sm_90 -o build-dv/bin/gemm_first tools/device/gemm_first.cu -lcublas
 *   gemm_first [FIRST LAST [STEP]]          (rows; default 440 500 1)
 *   CUDA_MODULE_LOADING=EAGER gemm_first    (every kernel loaded at start)
 */
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "gemm_first: %s: %s\n", #x, cudaGetErrorString(e_));                \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

typedef struct {
    const char *name;
    int m, k;
} product;

static double call(cublasHandle_t h, const product *p, int n, const __half *W, const __half *X, float *Y,
                   float beta)
{
    const float one = 1.0f;
    CK(cudaDeviceSynchronize());
    double t = now_ms();
    cublasStatus_t s = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, p->m, n, p->k, &one, W, CUDA_R_16F, p->k, X,
                                    CUDA_R_16F, p->k, &beta, Y, CUDA_R_32F, p->m, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT);
    CK(cudaDeviceSynchronize());
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "gemm_first: cublasGemmEx %s n %d: status %d\n", p->name, n, (int)s);
        exit(1);
    }
    return now_ms() - t;
}

int main(int argc, char **argv)
{
    int lo = argc > 2 ? atoi(argv[1]) : 440, hi = argc > 2 ? atoi(argv[2]) : 500;
    int step = argc > 3 ? atoi(argv[3]) : 1;
    if (lo < 1 || hi < lo || step < 1 || hi > 8192) {
        fprintf(stderr, "usage: gemm_first [FIRST LAST [STEP]] (rows 1..8192)\n");
        return 64;
    }
    const char *ml = getenv("CUDA_MODULE_LOADING");
    printf("# CUDA_MODULE_LOADING=%s\n", ml ? ml : "(unset: LAZY)");
    /* Llama-3.1-8B: q/k/v (32 + 2*8 heads of 128), o, gate+up, down */
    const product P[4] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gateup", 28672, 4096}, {"down", 4096, 14336}};
    double t0 = now_ms();
    CK(cudaFree(0));
    double t_ctx = now_ms() - t0;
    cublasHandle_t h;
    t0 = now_ms();
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "gemm_first: cublasCreate failed\n");
        return 1;
    }
    double t_create = now_ms() - t0;
    size_t wmax = 0, ymax = 0;
    for (int i = 0; i < 4; i++) {
        size_t w = (size_t)P[i].m * P[i].k;
        if (w > wmax) wmax = w;
        if ((size_t)P[i].m > ymax) ymax = P[i].m;
    }
    __half *W, *X;
    float *Y;
    CK(cudaMalloc(&W, wmax * 2));
    CK(cudaMalloc(&X, (size_t)hi * 14336 * 2));
    CK(cudaMalloc(&Y, (size_t)hi * ymax * 4));
    CK(cudaMemset(W, 0, wmax * 2));
    CK(cudaMemset(X, 0, (size_t)hi * 14336 * 2));
    CK(cudaMemset(Y, 0, (size_t)hi * ymax * 4));
    printf("# context %.1f ms, cublasCreate %.1f ms\n", t_ctx, t_create);
    printf("# rows product first_ms later_ms excess_ms\n");
    double excess_all = 0, first_all = 0, later_all = 0;
    int slow = 0, calls = 0;
    for (int n = lo; n <= hi; n += step) {
        double ex_n = 0;
        for (int i = 0; i < 4; i++) {
            const float beta = (i == 1 || i == 3) ? 1.0f : 0.0f; /* o and down accumulate */
            double f = call(h, &P[i], n, W, X, Y, beta), best = 1e30;
            for (int r = 0; r < 3; r++) {
                double t = call(h, &P[i], n, W, X, Y, beta);
                if (t < best) best = t;
            }
            printf("%d %s %.3f %.3f %.3f\n", n, P[i].name, f, best, f - best);
            ex_n += f - best;
            first_all += f;
            later_all += best;
            calls++;
            if (f - best > 0.2) slow++;
        }
        excess_all += ex_n;
        printf("# rows %d: first calls' excess %.3f ms over the four products\n", n, ex_n);
    }
    printf("# %d shapes: first calls %.1f ms, later %.1f ms, excess %.1f ms; %d first calls >0.2 ms slower\n",
           calls, first_all, later_all, excess_all, slow);
    cublasDestroy(h);
    return 0;
}
