/*
 * eng_ops: the C launchers of the GPU engine's own kernels (kernels/eng_*.cu),
 * callable from lib/gpu (the engine's core and placements).  Plain C
 * declarations (extern "C" under C++), so this header is included by both
 * nvcc and the C compiler, and only in CUDA builds (KV_HAVE_CUDA).  Every
 * launcher enqueues on the given stream and returns the status of its
 * launch, having recorded any failure (kv_cuda_last_error names the
 * statement, file, line and device); none synchronises.  The engine's fp16
 * attention is kv_cuda_attn_f16 (kv_kernels.h).
 *
 * Conventions: activations are float32 on the device; weights and KV are
 * fp16 or bf16 (kv_dtype); "ld" is a row pitch in elements; shapes are in
 * the comments as (outer, ..., inner).
 */
#ifndef ENG_OPS_CUH
#define ENG_OPS_CUH

#include <stddef.h>
#include <stdint.h>
#include "common/kv_dtype.h" /* kv_dtype: KV_DT_F16, KV_DT_BF16 */
#include "common/kv_gemv.h"  /* KV_GEMV_*: the packed GEMV variants */

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

// --- dense layers (eng_gemv.cu) -------------------------------------------

/* y (rows) = W (rows, ld) · x (ld), or y += W x when accumulate.  ld is a
 * multiple of 8 (rows are padded with zeros at load) and x has ld entries
 * whose padding is zero.  W is 16-byte aligned. */
cudaError_t eng_gemv(const void *W, kv_dtype t, int rows, int ld, const float *x, float *y,
                     int accumulate, cudaStream_t s);

/*
 * y = W · rmsnorm(x, nw): x (ld) the raw residual stream (n_x values, zero
 * padding), nw (ld) the norm weight (zero padding).  With glu, W holds
 * 2*rows rows, gate and up interleaved (row 2o gate_o, row 2o+1 up_o), and
 * y (rows) = silu(gate) * up: the SwiGLU of the feed-forward, fused.
 */
cudaError_t eng_gemv_norm(const void *W, kv_dtype t, int rows, int ld, const float *x,
                          const float *nw, int n_x, float eps, float *y, int glu, cudaStream_t s);

/* out (n) = float(W row r) for an embedding lookup; r read from device *tok. */
cudaError_t eng_embed(const void *W, kv_dtype t, int ld, int n, const int *tok, float *out,
                      cudaStream_t s);

// --- packed weights (eng_gemv_q.cu, eng_dequant.cu) ----------------------

/*
 * The ggml block types the engine keeps packed on the device, as they are
 * stored (lib/common/kv_ggml.h): Q8_0, Q4_K and Q6_K, what Q8_0 and Q4_K_M
 * files hold.  A packed matrix is rows of pitch bytes, each cols values in
 * cols / block blocks (pitch even; 16-byte aligned rows for Q4_K).
 */
static inline int eng_packed_type(kv_dtype t)
{
    return t == KV_DT_Q8_0 || t == KV_DT_Q4_K || t == KV_DT_Q6_K;
}

/* y (rows) = W (rows, cols) x (cols), or y += W x when accumulate; x float32,
 * 16-byte aligned.  CPU reference: kv_quant_dequant_row / kv_quant_dot_ref. */
cudaError_t eng_gemv_q(const void *W, kv_dtype t, int rows, int cols, size_t pitch, const float *x,
                       float *y, int accumulate, cudaStream_t s);

/*
 * Variants of the packed GEMV (kernels/eng_gemv_qv.cu says how they differ):
 * KV_GEMV_* of common/kv_gemv.h, the one table of their numbers and names.
 * KV_GEMV_DEFAULT takes eng_gemvq_best's choice for the type and shape
 * (eng_gemv_qv.cu, from the H200 measurements in docs/BENCHMARKS.md): what
 * the engine uses.
 */

/* eng_gemv_q by variant: "old" is eng_gemv_q itself; "dp4a" rounds x to int8
 * per 32 values (as the CPU path rounds its activations) and falls back to
 * "rows" for cols above 38000 (its shared memory). */
cudaError_t eng_gemv_qv(int variant, const void *W, kv_dtype t, int rows, int cols, size_t pitch, const float *x,
                        float *y, int accumulate, cudaStream_t s);

/* dst (16-bit dt: F16 or BF16) row r * step (ldd apart) = the values of packed
 * row r (cols), then zeros up to ldd: the engine's 16-bit layout (step 2
 * interleaves two matrices' rows).  Values as kv_quant_dequant_row's, rounded
 * once. */
cudaError_t eng_dequant_rows(const void *W, kv_dtype t, int rows, int cols, size_t pitch, void *dst,
                             kv_dtype dt, int ldd, int step, cudaStream_t s);

/* x (n, ldx) float32, first cols values = packed row tok[i] (device ids):
 * embedding rows. */
cudaError_t eng_embed_rows_q(const void *W, kv_dtype t, int cols, size_t pitch, const int *tok, int n,
                             float *x, int ldx, cudaStream_t s);

// --- small fused kernels (eng_elem.cu) ------------------------------------

/* y (rows, ldy) += b (n) on each row: the projections' biases (qwen2's q, k,
 * v) after a GEMV (rows 1) or a prefill chunk's GEMM. */
cudaError_t eng_add_bias_rows(float *y, long long ldy, const float *b, int n, int rows, cudaStream_t s);

/* o (n) = w (n) * (x / sqrt(mean(x^2) + eps)), as the CPU engine computes it. */
cudaError_t eng_rmsnorm(const float *x, const float *w, int n, float eps, float *o,
                        cudaStream_t s);

/* h (n) = silu(gu[0..n)) * gu[n..2n) */
cudaError_t eng_swiglu(const float *gu, int n, float *h, cudaStream_t s);

/*
 * RoPE on interleaved pairs at position pos with per-pair inverse
 * frequencies inv_freq (hd/2): rotates q (nq_heads, hd) in place (and writes
 * an fp16 copy to q16 unless NULL) and k (nkv, hd) in place (k may be NULL
 * when nkv is 0).  When kdst is not NULL, also writes k and v (nkv, hd) as
 * fp16 rows: head h to kdst + h*head_stride (same for vdst).
 */
cudaError_t eng_rope_store(float *q, uint16_t *q16, int nq_heads, float *k, const float *v,
                           int nkv, int hd, const float *inv_freq, int pos, uint16_t *kdst,
                           uint16_t *vdst, size_t head_stride, cudaStream_t s);

/* *out = index of the largest of x (n) (the lowest index on ties). */
cudaError_t eng_argmax(const float *x, int n, int *out, cudaStream_t s);

/* x (n) = seeded pseudo-random values: per element, a Gaussian-like number
 * times scale[(i / stride) % nscale] (scale may be NULL: 1). */
cudaError_t eng_fill_random(void *x, kv_dtype t, size_t n, uint64_t seed, const float *scale,
                            int nscale, size_t stride, cudaStream_t s);

/* Fill float x (n) with value. */
cudaError_t eng_fill_f32(float *x, size_t n, float value, cudaStream_t s);

/* cudaMemcpy2DAsync's device-to-device copy (height rows of width bytes) as
 * a kernel, which a CUDA graph updated in place may resize (eng_copy.cu). */
cudaError_t eng_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                        size_t height, cudaStream_t s);

/*
 * Convert a dense layer's K and V (nkv, ld, hd) (first T tokens) to the
 * host layouts of a sparse layer:
 *   rows: (T, nkv, 2, hd) — one token's K and V of every head contiguous;
 *   kcm:  (nkv, hd, ldc)  — keys channel-major (may be NULL).
 */
cudaError_t eng_to_row_layout(const void *k, const void *v, int nkv, int T, int ld, int hd,
                              kv_dtype t, void *rows, cudaStream_t s);
cudaError_t eng_to_channel_major(const void *k, int nkv, int T, int ld, int hd, kv_dtype t,
                                 void *kcm, int ldc, cudaStream_t s);

/*
 * Per channel statistics of keys k (nkv, ld, hd), tokens [0, T):
 * chmax (nkv, hd) = max |k|; mean (nkv, hd); mad (nkv, hd) = mean |k - mean|.
 */
cudaError_t eng_key_stats(const void *k, int nkv, int T, int ld, int hd, kv_dtype t,
                          float *chmax, float *mean, float *mad, cudaStream_t s);

/* 1-bit key sketch: bits (nkv, T, hd/8), bit c%8 of byte c/8 set when
 * k[t][c] > mean[c] (hd a multiple of 8). */
cudaError_t eng_sketch_build(const void *k, int nkv, int T, int ld, int hd, kv_dtype t,
                             const float *mean, uint8_t *bits, cudaStream_t s);

// --- sparse selection (eng_select.cu) -------------------------------------

/*
 * Channel step of TailorKV for each KV head: channel score
 * sum_{h in group} |q_hc| * chmax_c, top C channels (ascending ids) into
 * chans (nkv, C), and per query head the SparQ scale
 * 1/sqrt(hd * |q_C|_1 / |q|_1) into qscale (nq_heads).
 */
cudaError_t eng_select_channels(const float *q, const float *chmax, int nq_heads, int nkv,
                                int hd, int C, int *chans, float *qscale, cudaStream_t s);

/*
 * Approximate scores of candidates [cs, cend) of every query head from the C
 * critical key channels, read straight from host memory (zero-copy, mapped
 * pinned) in the channel-major copy kcm (nkv, hd, ldc):
 * score (nq_heads, n) with n = cend - cs.
 */
cudaError_t eng_score_channels(const float *q, const int *chans, const float *qscale,
                               const void *kcm, kv_dtype t, int ldc, int nq_heads, int nkv,
                               int hd, int C, int cs, int cend, float *score, cudaStream_t s);

/* Exact scores (select=exact) of candidates from the host row layout
 * rows (T, nkv, 2, hd) (zero-copy): score (nq_heads, n) = q·k / sqrt(hd). */
cudaError_t eng_score_exact(const float *q, const void *rows, kv_dtype t, int nq_heads,
                            int nkv, int hd, int cs, int cend, float *score, cudaStream_t s);

/*
 * Scores from the resident 1-bit sketch bits (nkv, ldb, hd/8) with per
 * channel mean and mad (nkv, hd): score = sum_c q_c*mad_c*(+1|-1) / sqrt(hd)
 * (the common term q·mean drops out of the softmax).
 */
cudaError_t eng_score_sketch(const float *q, const uint8_t *bits, int ldb, const float *mad,
                             int nq_heads, int nkv, int hd, int cs, int cend, float *score,
                             cudaStream_t s);

/*
 * eng_score_sketch followed by eng_softmax_combine, fused: comb (nkv, n)
 * without writing the per-head scores (two passes over the sketch bits).
 * tmp: eng_softmax_tmp(nq_heads) floats.
 */
cudaError_t eng_sketch_combine(const float *q, const uint8_t *bits, int ldb, const float *mad,
                               int nq_heads, int nkv, int hd, int cs, int cend, int reduce_max,
                               float *tmp, float *comb, cudaStream_t s);

/*
 * Turn each query head's scores (nq_heads, n) into softmax probabilities
 * over the n candidates and combine the heads of each KV head's group (sum,
 * or max when reduce_max): comb (nkv, n).  tmp: eng_softmax_tmp(nq_heads)
 * floats.
 */
size_t eng_softmax_tmp(int nq_heads);
cudaError_t eng_softmax_combine(const float *score, int nq_heads, int nkv, int n, int reduce_max,
                                float *tmp, float *comb, cudaStream_t s);

/* Top k of each row of comb (nkv, n) (ties to the lower index), token ids
 * base + i in ascending order into sel (nkv, k).  k <= n. */
cudaError_t eng_topk(const float *comb, int nkv, int n, int k, int base, int *sel,
                     cudaStream_t s);

/*
 * Gather selected rows from the host row layout rows (T, nkv, 2, hd)
 * (zero-copy, mapped pinned memory): for each head h and i < k, token
 * sel[h*k+i]'s K and V go to row i of head h of kdst/vdst (nkv, ld, hd);
 * then the nsink resident rows sink (nsink, nkv, 2, hd) (device memory) go
 * to rows k .. k+nsink-1.
 */
cudaError_t eng_gather_rows(const void *rows, int nkv, int hd, kv_dtype t, const int *sel, int k,
                            const void *sink, int nsink, void *kdst, void *vdst, size_t ld,
                            cudaStream_t s);
/* The same with at most `blocks` blocks of 8 warps per head (0: one block
 * per 64 rows), each warp looping over its rows with 8 in flight: a narrow
 * gather leaves the SMs to the main stream while it waits on PCIe. */
cudaError_t eng_gather_rows_w(const void *rows, int nkv, int hd, kv_dtype t, const int *sel, int k,
                              const void *sink, int nsink, void *kdst, void *vdst, size_t ld, int blocks,
                              cudaStream_t s);

// --- the resident channel index (select=resident; eng_select.cu) ----------

/*
 * The resident rows of R pool channels of a sparse layer, built from keys
 * k (nkv, ld, hd) fp16, tokens [0, T), as lib/policy/kv_select.c's
 * kv_select_channel_row: row j of head h is channel pool[h*R + j].
 *   bits 16: rows (nkv, R, ldt) fp16 values;
 *   bits 1, 2, 4, 8: rows (nkv, R, ldt*bits/8) bytes, token t's code at bit
 *     t*bits of its row (least significant first), with scale and zero
 *     (nkv, R, ldt/64) fp16 per group of 64 tokens (scale = fp16((max -
 *     min) / (2^bits - 1)), zero = fp16(min), code = clamp(rint((x - zero) /
 *     scale))).  scale and zero are unused (may be NULL) at 16 bits.
 * ldt: T rounded up to 64; tokens past T are zero codes.
 */
cudaError_t eng_rows_build(const uint16_t *k, int nkv, int T, int ld, int hd, const int *pool, int R,
                           int bits, void *rows, uint16_t *scale, uint16_t *zero, int ldt,
                           cudaStream_t s);

/*
 * The C of R pool channels each KV head scores with this step: by (sum over
 * its query heads of |q_hc|) * chmax_c over the pool, the top C (ties to the
 * lower position), positions ascending into cols (nkv, C); and per query
 * head SparQ's scale 1/sqrt(hd * |q_C|_1 / |q|_1) into qscale (nq_heads).
 * As kv_select_pool_channels and kv_select_score_rows.
 */
cudaError_t eng_select_pool(const float *q, const float *chmax, const int *pool, int nq_heads,
                            int nkv, int hd, int R, int C, int *cols, float *qscale,
                            cudaStream_t s);

/*
 * Scores of candidates [cs, cend) of every query head from the resident
 * rows (eng_rows_build's layout) of the C positions cols (nkv, C) of the
 * pool: score (nq_heads, n) = qscale * sum_j q[pool[cols[j]]] * value.
 * As kv_select_score_rows.
 */
cudaError_t eng_score_rows(const float *q, const int *pool, const int *cols, const float *qscale,
                           const void *rows, const uint16_t *scale, const uint16_t *zero, int ldt,
                           int bits, int nq_heads, int nkv, int hd, int R, int C, int cs, int cend,
                           float *score, cudaStream_t s);

/*
 * Top k of each row of comb (nkv, n), exactly as eng_topk (ties to the
 * lower index, ids base + i ascending into sel (nkv, k)), with the pass over
 * the scores spread over many blocks per KV head: a threshold from a
 * sample, the candidates above it counted and compacted in index order by
 * segments, then the exact selection among them (the one-block radix
 * select over all scores when the sample misjudged).  ws: device scratch
 * of eng_topk_wide_ws(nkv) bytes.
 */
size_t eng_topk_wide_ws(int nkv);
cudaError_t eng_topk_wide(const float *comb, int nkv, int n, int k, int base, int *sel, void *ws,
                          cudaStream_t s);

// --- select=resident's chain over many blocks (eng_select_fast.cu) --------

/*
 * eng_topk's ids (the top k of each row of comb (nkv, n), ties to the lower
 * index, base + i ascending into sel (nkv, k)) by a radix select of 12, 12
 * and 8 bits whose passes, the counts and the ordered write each spread
 * over chunks of 4096 keys, `blocks` blocks per KV head looping over them
 * (0: one block per chunk).  ws: eng_topk_many_ws(nkv) bytes, zeroed once
 * before the first call (each call leaves it so).  n at most 2^20
 * (eng_topk_many_fits).
 */
int eng_topk_many_fits(int n);
size_t eng_topk_many_ws(int nkv);
cudaError_t eng_topk_many(const float *comb, int nkv, int n, int k, int base, int *sel, void *ws,
                          int blocks, int flags, cudaStream_t s);

/* flags of eng_topk_many and eng_resident_select (0: the first way, which
 * helper S17 measured; the ids are the same every way):
 *   ENG_SEL_LATE     a kernel of the chain lets its successor's blocks in
 *                    only as it ends (not first thing), so that the blocks
 *                    of the chain's later kernels do not sit on the SMs,
 *                    waiting, beside the main stream's layer;
 *   ENG_SEL_NOPDL    the chain launched without programmatic dependent
 *                    launch at all;
 *   ENG_SEL_COLLECT  after digit 1, one pass collects the keys of the k-th
 *                    key's bin (up to 16384 a head) and one block per head
 *                    finds digits 2 and 3 and the counts among them: two
 *                    passes over every key fewer than the histograms of
 *                    digits 2 and 3 and the counts. */
#define ENG_SEL_LATE 1
#define ENG_SEL_NOPDL 2
#define ENG_SEL_COLLECT 4
/*   ENG_SEL_DIRECT   as collect, the list also holding the keys above the
 *                    bin, and the one block per head writes the ids too
 *                    (for n <= 131072 when the list held them): the chain's
 *                    last pass over every key goes as well. */
#define ENG_SEL_DIRECT 8

/*
 * select=resident's whole selection of candidates [cs, cend): eng_select_pool
 * (cols (nkv, C), qscale (nq_heads) written), eng_score_rows, the softmax and
 * GQA combine of eng_softmax_combine (comb (nkv, n) written) and the top k
 * into sel (nkv, k), ids ascending, without writing the per-head scores (two
 * passes over the resident codes).  0 < k <= n = cend - cs; ws:
 * eng_resident_select_ws(nq_heads, nkv, n) bytes or more, zeroed once;
 * blocks: per KV head, each kernel's (0: one per chunk of 2048 candidates
 * or 4096 keys).
 */
size_t eng_resident_select_ws(int nq_heads, int nkv, int n);
cudaError_t eng_resident_select(const float *q, const float *chmax, const int *pool, int R, int C,
                                const void *rows, const uint16_t *scale, const uint16_t *zero, int ldt,
                                int bits, int nq_heads, int nkv, int hd, int cs, int cend,
                                int reduce_max, int k, float *comb, int *cols, float *qscale, int *sel,
                                void *ws, int blocks, int flags, cudaStream_t s);

// --- the selection cache (opts.sel_cache; eng_select.cu) ------------------

/*
 * A sparse layer's gathered rows kept between decode steps, so that only
 * the chosen tokens not already held cross PCIe.  tag (nkv, ntag): the
 * token each row of the attention buffer holds (-1: none).
 *   eng_sel_cache_reset: row r holds first_tok + (r - first_row) from
 *     first_row on (the prompt's tail, in place), nothing before it.
 *   eng_sel_cache_plan: the wanted tokens, the ns sink tokens 0..ns-1 then
 *     the k ids of sel (nkv, k) ascending (>= ns), are to be held in rows
 *     [r0, r0 + ns + k): a row whose tag is wanted keeps it (the first, when
 *     two hold one token), the wanted tokens held nowhere go in order to the
 *     other rows in order; plan (nkv, 1 + 2*mcap): their count, then (token,
 *     row) pairs; tags updated; stat (nkv, 4) unsigned 64-bit: [0] += rows
 *     kept, [1] += rows wanted, [2] = this step's misses read from host
 *     rows (tokens >= ns), [3] += the same.  ns + k <= mcap.
 *   eng_sel_cache_gather: the planned pairs' K and V from the host rows
 *     (T, nkv, 2, hd) (tokens >= ns) or the resident sink rows (ns, nkv, 2,
 *     hd) into rows of kdst/vdst (nkv, ld, hd).
 * The rows attended are then the same set as eng_gather_rows' in another
 * order.
 */
cudaError_t eng_sel_cache_reset(int *tag, int nkv, int ntag, int first_row, int first_tok,
                                cudaStream_t s);
cudaError_t eng_sel_cache_plan(const int *sel, int k, int ns, int nkv, int *tag, int ntag, int r0,
                               int mcap, int *plan, unsigned long long *stat, cudaStream_t s);
cudaError_t eng_sel_cache_gather(const void *rows, int nkv, int hd, const int *plan, int mcap,
                                 int ns, const void *sink, void *kdst, void *vdst, size_t ld,
                                 cudaStream_t s);

// --- the resident page index (select=pages; eng_select.cu) ---------------

/*
 * Quest's page bounds of keys k (nkv, ld, hd) fp16, tokens [0, T), pages
 * of P tokens: pmin, pmax (nkv, np, hd) fp16, np = ceil(T / P), as
 * kv_select_page_bounds (the last page may be short).
 */
cudaError_t eng_page_bounds(const uint16_t *k, int nkv, int T, int ld, int hd, int P,
                            uint16_t *pmin, uint16_t *pmax, cudaStream_t s);

/*
 * Upper-bound scores of pages [p0, p0 + np) of every query head:
 * score (nq_heads, np) = sum_c max(q_c min_c, q_c max_c) / sqrt(hd), as
 * kv_select_score_pages.  pmin, pmax: eng_page_bounds' (nkv, ldp, hd).
 */
cudaError_t eng_score_pages(const float *q, const uint16_t *pmin, const uint16_t *pmax, int ldp,
                            int nq_heads, int nkv, int hd, int p0, int np, float *score,
                            cudaStream_t s);

/* Each candidate token t in [cs, cs + n) takes its page's combined score:
 * tok (nkv, n) = comb[kh][t / P - p0] of comb (nkv, np), so that eng_topk
 * on tok takes the best pages first, ties to the lower token, as the CPU's
 * page order. */
cudaError_t eng_pages_expand(const float *comb, int nkv, int np, int P, int p0, int cs, int n,
                             float *tok, cudaStream_t s);

/* Device-to-device and zero-copy read bandwidth probes (bench): read n bytes
 * of src (device or mapped host) with 16-byte loads, write a checksum. */
cudaError_t eng_read_probe(const void *src, size_t n, unsigned *sink, cudaStream_t s);

// --- KIVI expansion (eng_kivi.cu) ----------------------------------------

/* One `quant` layer kept in lib/policy/kv_policy_quant.c's layout on the device. */
typedef struct {
    int nkv, hd, bits, group, gv; /* gv: channels per value group */
    int cap;                      /* token capacity of the code and value-scale planes */
    int ngk;                      /* key scale groups per head: cap / group + 1 */
    int ring;                     /* residual ring rows: R + G; token t at row t % ring */
    int nq;                       /* tokens packed */
    const uint8_t *kc, *vc;       /* (nkv, cap, hd*bits/8) */
    const uint16_t *ks, *kz;      /* (nkv, ngk, hd) */
    const uint16_t *vs, *vz;      /* (nkv, cap, hd/gv) */
    const uint16_t *rk, *rv;      /* (nkv, ring, hd) fp16 residual */
} eng_kivi_layer;

/* Dequantize tokens [0, T) of y into fp16 k, v (nkv, ld, hd): packed tokens
 * as zero + scale * code, the rest copied from the ring (any head_dim). */
cudaError_t eng_kivi_expand(const eng_kivi_layer *y, int T, uint16_t *k, uint16_t *v, size_t ld,
                            cudaStream_t s);

/* One `dsq` layer on the device: packed windows in lib/common/kv_layout.h's DSQ
 * layout at capacity nwmax windows per head (K and V share the mask unless
 * vmask is set), the
 * tokens not yet packed in an fp16 ring. */
typedef struct {
    int nkv, hd, window, salient, kbits, vbits, gd; /* bits of the non-salient key and value
                                                       codes; gd: channels per group */
    int nwmax, packed;                      /* windows allocated / packed per head */
    int ring;                               /* fp16 ring rows; token t at row t % ring */
    const uint8_t *mask;                    /* (nkv, nwmax, W/8) */
    const int8_t *ksal, *vsal;              /* (nkv, nwmax, S, hd) */
    const uint16_t *ksscale, *vsscale;      /* (nkv, nwmax, hd) */
    const uint16_t *kbase;                  /* (nkv, nwmax, hd) */
    const uint8_t *kcodes, *vcodes;         /* (nkv, nwmax, W-S, hd*kbits/8 or hd*vbits/8) */
    const uint16_t *kscale, *kzero;         /* (nkv, nwmax, W-S, hd/gd) */
    const uint16_t *vscale, *vzero;         /* (nkv, nwmax, W-S, hd/gd) */
    const uint16_t *rk, *rv;                /* (nkv, ring, hd) */
    const uint8_t *vmask;                   /* (nkv, nwmax, W/8) the values' own salient masks (a file
                                               packed them apart, kv-run --kv), or NULL: mask */
} eng_dsq_layer;

/* Dequantize tokens [0, T) of y into fp16 k, v (nkv, ld, hd), as
 * kv_dsq_unpack_window computes them (float, no FMA), rounded once. */
cudaError_t eng_dsq_expand(const eng_dsq_layer *y, int T, uint16_t *k, uint16_t *v, size_t ld,
                           cudaStream_t s);

/*
 * The attention each of T tokens receives, summed over the query heads of
 * its KV head, added to imp (nkv, imp_ld): q (nq_heads, hd) float, K (nkv,
 * ld, hd) fp16, softmax of scale * q.k.  scratch: nkv * T floats.
 */
cudaError_t eng_attn_importance(const float *q, const uint16_t *K, int nq_heads, int nkv, int hd,
                                int T, size_t ld, float scale, float *scratch, float *imp,
                                size_t imp_ld, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
