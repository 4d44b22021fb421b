/*
 * kv_select: the resident selection index of a sparse (TailorKV) layer and
 * the arithmetic that scores candidates from it, shared by the CPU policy
 * (lib/policy/kv_policy_sparse.c) and, as the CPU reference of its
 * kernels, by the GPU engine (lib/gpu/kv_gpu_sparse.c, kernels/eng_select.cu).
 * Everything here is what the GPU must reproduce, so the values an index
 * holds are exactly those the GPU keeps: fp16-rounded channel rows, or
 * codes with fp16 scale and zero, and fp16 page bounds.
 *
 * select=resident: the C critical key channels of each KV head are chosen
 * once, at ingest, from |q̂|·max|K| (q̂: the prompt's last queries the
 * engine observed), and those C channels of every prompt key stay resident
 * (C/D of the keys), so a step reads no channel from the host and fetches
 * only the chosen rows.  select=pages (Quest): per page of P prompt tokens
 * a per-channel min and max stay resident; a page's score is the upper
 * bound sum_c max(q_c min_c, q_c max_c).
 */
#ifndef KV_SELECT_H
#define KV_SELECT_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_half.h"

/* Tokens per scale/zero group of the cbits < 16 channel codes. */
#define KV_SELECT_CGROUP 64

/* The resident pool of select=resident: pool channels (0: half of D), never
 * fewer than the C scored per step, never more than D. */
static inline int kv_select_pool_size(int pool, int channels, int D)
{
    int r = pool > 0 ? pool : D / 2, c = channels < D ? channels : D;
    r = r > c ? r : c;
    return r < D ? r : D;
}

/*
 * Critical channels of each KV head: channel score
 *   (sum over the group's query heads and the n observed queries of |q_c|)
 *   * fp16(max_t |K_tc|)
 * (the maxima rounded to fp16, as the GPU holds its keys), the top C by
 * score (ties to the lower channel), written ascending to chans (H, C).
 * q (n_heads, n, D) post-RoPE; with n == 0 (q may be NULL) the maxima alone
 * decide.  C <= D.
 */
void kv_select_pick_channels(const float *q, int n, const float *chmax, int n_heads, int H, int D,
                             int C, int *chans);

/* Bytes of one KV head's resident channel rows of T tokens at cbits. */
uint64_t kv_select_rows_bytes(int C, int T, int cbits);

/*
 * One channel's values over T tokens, x (T) (stride ldx between tokens),
 * as the index keeps them: cbits 16 rounds each to fp16; cbits 8 or 4
 * quantizes each group of KV_SELECT_CGROUP tokens asymmetrically, scale =
 * fp16((max - min) / (2^b - 1)), zero = fp16(min), code = clamp(rint((x -
 * zero) / scale), 0, 2^b - 1) (0 when scale is 0 or not finite), as KIVI
 * does.  codes (T) one code per byte (may be NULL), scale/zero
 * (ceil(T / KV_SELECT_CGROUP)) (may be NULL for cbits 16); out (T) gets the
 * decoded values zero + scale * code (float, that order), stride ldo.
 */
void kv_select_channel_row(const float *x, size_t ldx, int T, int cbits, uint8_t *codes,
                           kv_half *scale, kv_half *zero, float *out, size_t ldo);

/*
 * Quest page bounds of one KV head's keys k (T, D) (row stride ldk): for
 * page p (tokens [p P, min((p+1) P, T))) and channel c, pmin/pmax (np, D)
 * = fp16 of the page's min and max of k_tc.  np = ceil(T / P).
 */
void kv_select_page_bounds(const float *k, size_t ldk, int T, int D, int P, float *pmin,
                           float *pmax);

/*
 * Scores of n candidates for g query heads q (g, D) of one KV head from
 * resident channel rows vals (n, ldv): channel chans[j] is column cols[j]
 * of a row (cols NULL: column j), j < C:
 * score[h][i] = sum_j q_h[chans[j]] * vals[i][cols[j]] * s_h, with SparQ's
 * temperature s_h = 1 / sqrt(D * |q_h,C|_1 / |q_h|_1) (1/sqrt(D) when q_h
 * is zero).  score (g, n).
 */
void kv_select_score_rows(const float *q, int g, int D, const int *chans, const int *cols, int C,
                          const float *vals, size_t ldv, int n, float *score);

/*
 * The C of R resident channels pool (R, ascending) a step scores with: by
 * (sum over the g query heads of |q_hc|) * fp16(chmax_c), the top C (ties to the
 * lower channel), as positions into pool, ascending: cols (C).  C <= R.
 */
void kv_select_pool_channels(const float *q, int g, int D, const float *chmax, const int *pool,
                             int R, int C, int *cols);

/* Page scores: score[h][p] = sum_c max(q_hc pmin_pc, q_hc pmax_pc) / sqrt(D)
 * for np pages of bounds pmin/pmax (np, D); score (g, np). */
void kv_select_score_pages(const float *q, int g, int D, const float *pmin, const float *pmax,
                           int np, float *score);

/*
 * The r principal directions of one KV head's keys k (T, D) (row stride
 * ldk), as Loki uses them: mean (D) of the keys and basis (r, D), the
 * unit eigenvectors of their covariance with the r largest eigenvalues
 * (cyclic Jacobi in double, a deterministic order), largest first.  A
 * key's coordinates are basis . (k - mean); a query's basis . q, so that
 * their dot product approximates q . k up to the term q . mean, the same
 * for every token.  r <= D <= 256.
 */
void kv_select_pca(const float *k, size_t ldk, int T, int D, int r, float *mean, float *basis);

/* out (r) = basis (r, D) . (x - mean), mean may be NULL (queries). */
void kv_select_project(const float *basis, const float *mean, int r, int D, const float *x,
                       float *out);

/* Scores from projected keys: score[h][i] = sum_j qp_h[j] * vals[i][j] /
 * sqrt(D), qp (g, r) the heads' projected queries, vals (n, ldv). */
void kv_select_score_proj(const float *qp, int g, int r, int D, const float *vals, size_t ldv,
                          int n, float *score);

/* Each of g heads' scores (g, n) to softmax probabilities over the n
 * candidates, combined over the heads by sum (or max): comb (n). */
void kv_select_combine(const float *score, int g, int n, int reduce_max, float *comb);

#endif
