/*
 * kv_matmul: the CPU weight kernels of the engine.  Activations are float32;
 * weights are F32, F16, BF16 rows or ggml blocks (Q4_0 ... Q6_K, read in
 * place from the mapping).  As llama.cpp's CPU backend does, the input
 * vector meets each weight in that weight's activation format: for block
 * rows it is first quantized once (Q8_0, Q8_1 or Q8_K) and every row is an
 * integer dot product with it (kv_quants.h is the reference); for F16 and
 * BF16 rows it is rounded to F16 or BF16 (kept as floats) before the float
 * dot products; F32 rows take it as it is.  A weight's bias and row permutation apply in every entry
 * point.  Rows are split across OpenMP threads.  The inner dot products have an AVX2+FMA+F16C
 * version chosen at run time (the build targets x86-64-v2, which lacks
 * them) and a portable version with independent accumulators that the
 * compiler vectorises.  The float operations between the products (one
 * attention head, RMSNorm, SwiGLU) are here too.
 */
#ifndef KV_MATMUL_H
#define KV_MATMUL_H

#include <stdbool.h>
#include <stddef.h>

#include "model/kv_model.h"

/* y (rows) = W (rows, cols) · x (cols). */
void kv_matvec(const kv_weight *w, const float *x, float *y);

/* Several matrices with the same input in one parallel region (q/k/v,
 * gate/up): y[i] (w[i].rows) = w[i] · x, for i < n (n <= 4). */
void kv_matvec_multi(int n, const kv_weight *const *w, const float *x, float *const *y);

/* Y (n, rows) = X (n, cols) · Wᵀ : n tokens at once (prefill). */
void kv_matmul(const kv_weight *w, const float *X, int n, float *Y);

/* Row r of W as float32: out (cols). */
void kv_weight_row(const kv_weight *w, int r, float *out);

/* Dot products over float32 (n), used by attention. */
float kv_dot_f32(const float *a, const float *b, int n);
/* y (n) += a * x (n) */
void kv_axpy_f32(float a, const float *x, float *y, int n);

/*
 * One query head attending T keys and values (each (T, D) rows, contiguous):
 * scores q·k_t * scale in float (vectorised dot products), softmax with the
 * maximum subtracted and its normaliser summed in double, output
 * sum_t p_t v_t accumulated in float in token order.  probs (T) receives the probabilities when not NULL; s is scratch
 * of T floats.  About 5x faster than a plain loop at T = 4096, D = 64.
 */
void kv_attend_head_f32(const float *q, const float *k, const float *v, int T, int D, float scale,
                        float *out, float *probs, float *s);

/* o (n) = w (n) * x (n) / sqrt(mean(x^2) + eps), the mean of squares
 * summed in double (o may be x). */
void kv_rmsnorm(float *o, const float *x, const float *w, int n, float eps);

/* hb (n) = silu(hb) * hb2 (n), silu(g) = g / (1 + exp(-g)). */
void kv_swiglu(float *hb, const float *hb2, int n);

/* Which inner kernels were chosen: "avx2" or "portable". */
const char *kv_matmul_isa(void);

/* Use the portable inner kernels even where AVX2 is available (on) or
 * choose again by the CPU (off): for testing and measuring the portable
 * path.  Call while no matmul runs (the choice is process-wide). */
void kv_matmul_set_portable(bool on);

#endif
