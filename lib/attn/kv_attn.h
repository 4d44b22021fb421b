/*
 * kv_attn: CPU reference decode attention (one new query token against a
 * layer's cached keys and values) for every path the CUDA kernels implement:
 * dense fp32 and fp16 grouped-query attention, and attention straight from a
 * KIVI-packed cache (lib/common/kv_layout.h, packed by lib/quant/kv_quant.c) with the key
 * scales and zeros folded into the query and the value scales into the
 * probabilities.  Plain C; the kernels in kernels/ are tested against these
 * by normalized error, and these against a float64 computation.
 *
 * Shapes: query head h attends with KV head h / (n_heads / kv_heads).
 * Accumulation is float32 throughout (as on the GPU); the output is float32.
 */
#ifndef KV_ATTN_H
#define KV_ATTN_H

#include <stddef.h>

#include "common/kv_half.h"
#include "common/kv_layout.h"
#include "common/kv_status.h"


/* Check a geometry (KV_E_USAGE with a message when it is not valid). */
kv_status kv_attn_check(const kv_attn_dims *d);

/*
 * Dense decode attention.
 *   q:   (n_heads, D)
 *   k,v: (kv_heads, T, D)
 *   out: (n_heads, D)
 */
kv_status kv_attn_decode_f32(const kv_attn_dims *d, const float *q, const float *k,
                             const float *v, float *out);
kv_status kv_attn_decode_f16(const kv_attn_dims *d, const kv_half *q, const kv_half *k,
                             const kv_half *v, float *out);

// --- exact float32 attention (lib/attn/kv_attend.c) ------------------------

/* Exact dense attention (reference): q [n_heads*D], K/V [n_kv_heads, T, D]
 * with row stride ld (>= T) tokens, out [n_heads*D]. */
void kv_attend_dense(const float *q, const float *k, const float *v, int T, int ld,
                     int n_heads, int n_kv_heads, int head_dim, float *out);

/* The same attention computed plainly (double accumulation, one head at a
 * time): the slow reference kv_attend_dense is tested against. */
void kv_attend_reference(const float *q, const float *k, const float *v, int T, int ld,
                         int n_heads, int n_kv_heads, int head_dim, float *out);


/*
 * kv_attend_dense with, optionally, the attention probabilities written to
 * probs (n_heads, T) (NULL to skip).  Every policy's attention ends here.
 */
void kv_attend_core(const float *q, const float *k, const float *v, int T, int ld,
                    int n_heads, int n_kv_heads, int head_dim, float *out, float *probs);


// --- attention measurements shared with kv-quant -------------------------------

/* p[t] = exp(s[t] - max) in place over T scores; returns the float sum. */
float kv_softmax_unnormalized(float *s, int T);
/* Plain sequential float dot product (the profile's arithmetic). */
float kv_attn_dot(const float *a, const float *b, int n);
/* o (D) = sum_t p_t v_t over n tokens, in double (tokens with p_t = 0 skipped). */
void kv_attn_out(const float *p, const float *v, int n, int D, double *o);

/* Softmax attention probabilities of query qv (D) over keys k (n, D). */
void kv_attn_probs(const float *qv, const float *k, int n, int D, float *p /* (n) */);

/*
 * Relative attention-output error of approximate K/V (k2, v2) against k, v
 * for the stored queries: sqrt(sum ||o' - o||^2 / sum ||o||^2) over the
 * queries of each head.  q (n_heads, nq, D); k, v, k2, v2 (H, T, D);
 * per_head (n_heads) may be NULL.  Returns the error over all heads.
 */
double kv_attn_rel_error(const float *q, int n_heads, int nq, const float *k, const float *v,
                         const float *k2, const float *v2, int H, int T, int D,
                         double *per_head);

// --- a prefill chunk's causal attention (lib/attn/kv_attn_prefill.c) -----------

typedef struct {
    int n_heads, n_kv_heads, head_dim;
    int p0, n;      /* the chunk: queries at positions [p0, p0 + n) */
    long ldq, ldo;  /* floats between rows of q and of o (>= n_heads*head_dim) */
    long kv_stride; /* floats between KV heads of k and v (>= (p0 + n)*head_dim) */
    float scale;    /* usually 1/sqrt(head_dim) */
} kv_attn_prefill_dims;

/*
 * Causal attention of a prefill chunk, the reference of kernels/prefill_attn.cu:
 * query i (position p0 + i) of head h attends to keys [0, p0 + i] of KV head
 * h / (n_heads / n_kv_heads).
 *   q: (n, ldq), head h of row i at q + i*ldq + h*head_dim
 *   k, v: (n_kv_heads, kv_stride), token t of head g at g*kv_stride + t*head_dim
 *   o: (n, ldo), laid out as q
 */
kv_status kv_attn_prefill(const kv_attn_prefill_dims *d, const float *q, const float *k,
                          const float *v, float *o);

#endif
