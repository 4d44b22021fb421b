/*
 * eng_batch_ops: the C launchers of kernels/eng_gemv_batch.cu, the
 * projections of a batched decode step (lib/gpu/kv_gpu_batch.c): B
 * independent sequences, one token each, against one copy of the weights.
 * Plain C declarations (extern "C" under C++), included by nvcc and the C
 * compiler, only in CUDA builds (KV_HAVE_CUDA); conventions as eng_ops.cuh.
 *
 * CPU reference: a float64 product in tests/unit/test_gpu_batch.c; the
 * batched GEMV must also equal eng_gemv / eng_gemv_norm bit for bit on
 * every row (the same per-lane sums in the same order), which is what
 * makes a batched greedy decode equal each sequence decoded alone.
 */
#ifndef ENG_BATCH_OPS_H
#define ENG_BATCH_OPS_H

#include <stddef.h>
#include <stdint.h>
#include "common/kv_dtype.h"

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What eng_gemv_batch computes per sequence (the three forms of eng_gemv.cu). */
typedef enum {
    ENG_GB_PLAIN = 0, /* y = W x (+ y with accumulate), as eng_gemv */
    ENG_GB_NORM = 1,  /* y = W rmsnorm(x, nw), as eng_gemv_norm */
    ENG_GB_GLU = 2    /* y = silu(gate) * up of W rmsnorm(x, nw), as eng_gemv_norm with glu */
} eng_gb_mode;

/*
 * For each of nb sequences b: y_b = W x_b in the given mode, with x_b at
 * x + b*ldx (ld values, zero padding; the raw residual stream of n_x
 * values for the norm modes) and y_b at y + b*ldy.  W (rows, ld) 16-bit,
 * ld a multiple of 8 (for GLU 2*rows rows, gate and up interleaved); ldx a
 * multiple of 4.  Each weight row is read once per 8 sequences from memory
 * (the blocks of one row range run side by side, so the other reads hit
 * L2).
 */
cudaError_t eng_gemv_batch(const void *W, kv_dtype t, int rows, int ld, const float *x, int ldx,
                           int nb, const float *nw, int n_x, float eps, float *y, int ldy,
                           eng_gb_mode mode, int accumulate, cudaStream_t s);

/* out (n, ldo) 16-bit of type t (F16 or BF16) = the first cols values of
 * each row of x (n, ldx) float32, rounded to nearest: a batch's attention
 * outputs as the input of a tensor-core product. */
cudaError_t eng_rows_to_16(const float *x, int ldx, int cols, int n, void *out, kv_dtype t, int ldo,
                           cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
