/*
 * prefill_ops: the C launchers of the chunked-prefill kernels
 * (kernels/prefill_attn.cu, kernels/prefill_elem.cu).  A prefill chunk is n
 * prompt tokens at positions [p0, p0 + n); every activation is a matrix of n
 * rows, one per token.  Plain C declarations (extern "C" under C++), included
 * by nvcc and the C compiler, and only in CUDA builds (KV_HAVE_CUDA).  Each
 * launcher enqueues on the given stream and returns the launch status; none
 * synchronises.  16-bit data is passed as void * with a pf_dtype.
 *
 * CPU references: kv_attn_prefill (lib/attn/kv_attn.h) for the attention;
 * lib/engine/kv_engine.c's rmsnorm, rope_apply and swiglu for the rest
 * (tests/unit/test_cuda_prefill.c compares them by normalized error).
 */
#ifndef PREFILL_OPS_H
#define PREFILL_OPS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { PF_F16 = 0, PF_BF16 = 1 } pf_dtype;

// --- causal flash attention over a chunk (prefill_attn.cu) -------------------

/*
 * Queries of n tokens at positions [p0, p0 + n) attend to the cached keys
 * [0, p0 + n) with the causal mask (query at position p sees keys <= p):
 * the keys of earlier chunks are read from the cache, the chunk's own keys
 * must already be stored there.  GQA: query head h reads KV head
 * h / (n_heads / kv_heads); K/V are never repeated.
 *   q: (n, ldq) 16-bit, head h of token i at q + i*ldq + h*head_dim
 *   k, v: (kv_heads, kv_stride) 16-bit, token t of head g at g*kv_stride + t*head_dim
 *   o: (n, ldo) 16-bit, laid out as q
 * q, k and v share the dtype t; o is of dtype ot (t, or bf16 for fp16
 * inputs: the engine's fp16 cache feeding a bf16 model's projection).
 * Pointers and strides keep 16-byte alignment (strides multiples of 8).
 */
typedef struct {
    const void *q;
    const void *k, *v;
    void *o;
    long long ldq, ldo, kv_stride; /* in elements */
    int n_heads, n_kv_heads, head_dim;
    int p0, n;
    float scale; /* usually 1/sqrt(head_dim) */
} pf_attn_args;

/* Is this geometry supported (head_dim 64 or 128, n_heads a multiple of
 * kv_heads, alignment as above)?  Needs sm_80 or newer (mma.m16n8k16). */
int pf_attn_supported(const pf_attn_args *a);

/*
 * Tile configurations (measurement): 0 = the default for the device (on
 * compute capability 9.0 the warp-specialized tma kernel, or the wgmma tile
 * where the driver cannot encode tensor maps; else mma.sync), then the
 * mma.sync tiles, then the wgmma tiles, then the tma ones (both sm_90a;
 * refused with cudaErrorNotSupported elsewhere); pf_attn_variant_name says
 * which.  Every variant computes the
 * same function; pf_attn_default_variant is the one 0 stands for here.
 */
int pf_attn_variants(void);
const char *pf_attn_variant_name(int variant);
int pf_attn_default_variant(void);

cudaError_t pf_attn(const pf_attn_args *a, pf_dtype t, pf_dtype ot, int variant,
                    cudaStream_t s);

// --- row-wise kernels over a chunk (prefill_elem.cu) ----------------------------

/* x (n, ldx) float32 = W row tok[i] (W (vocab, ldw) 16-bit) for the n ids
 * tok (device): the chunk's residual stream. */
cudaError_t pf_embed_rows(const void *W, pf_dtype t, int ldw, int dim, const int *tok, int n,
                          float *x, int ldx, cudaStream_t s);

/* out (n, ldo) 16-bit = w * (x / sqrt(mean(x^2) + eps)) per row of x (n, ldx)
 * (dim values; out's columns [dim, ldo) are left alone). */
cudaError_t pf_rmsnorm_rows(const float *x, int ldx, const float *w, int dim, float eps, int n,
                            void *out, pf_dtype t, int ldo, cudaStream_t s);

/*
 * RoPE over the chunk's projections qkv (n, ldqkv) float32, each row
 * [q (n_heads*hd) | k (kv_heads*hd) | v (kv_heads*hd)]: token i at position
 * p0 + i, interleaved pairs rotated by the float angle (p0+i)*inv_freq[j] as
 * the CPU engine computes it.  Writes q rotated to qout (n, ldq) and k
 * rotated and v as they are into the caches kc, vc (kv_heads, kv_stride, hd)
 * at rows p0 + i.  qout and the caches are of dtype t.
 */
cudaError_t pf_rope_rows(const float *qkv, int ldqkv, int n_heads, int kv_heads, int hd,
                         const float *inv_freq, int p0, int n, void *qout, int ldq, void *kc,
                         void *vc, long long kv_stride, pf_dtype t, cudaStream_t s);
/* Same, rotating row p0 + i at position p0 + i + rope_off (a continued
 * cache subset: rows and positions differ by rope_off past it). */
cudaError_t pf_rope_rows_at(const float *qkv, int ldqkv, int n_heads, int kv_heads, int hd,
                            const float *inv_freq, int p0, int rope_off, int n, void *qout, int ldq,
                            void *kc, void *vc, long long kv_stride, pf_dtype t, cudaStream_t s);

/* h (n, ldh) 16-bit = silu(g) * u per row of gu (n, ldgu) float32 whose
 * columns are gate and up interleaved (g0 u0 g1 u1 ...; hidden pairs). */
cudaError_t pf_swiglu_rows(const float *gu, int ldgu, int hidden, int n, void *h, pf_dtype t,
                           int ldh, cudaStream_t s);

/* out (n, ldo) float32 = the first cols values of each row of x (n, ldx),
 * 16-bit (a chunk's rotated queries for the placements that observe them). */
cudaError_t pf_rows_to_f32(const void *x, pf_dtype t, int ldx, int cols, int n, float *out,
                           int ldo, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
