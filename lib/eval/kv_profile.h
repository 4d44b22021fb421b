/*
 * kv_profile: per-layer, per-head profiling of a KV cache from its stored
 * query samples, the decision TailorKV makes offline: layers whose
 * attention is dense (much mass outside each query's top-alpha keys) lose
 * little to quantization, layers whose attention is sparse are served by
 * top-K retrieval.  For every query head it measures the dense preference
 * score and the attention-output errors of 1- and 2-bit KIVI and of top-K
 * retrieval with C critical channels; several files are averaged; the
 * result is classified into a deployment config (lib/policy/kv_deploy.h).
 *
 * Queries: the file stores the last n_q positions' queries per layer
 * ([n_heads, n_q, head_dim]); query j (0-based among them) sits at position
 * T - n_q + j and attends keys 0..T-n_q+j (causal), scaled by 1/sqrt(D).
 */
#ifndef KV_PROFILE_H
#define KV_PROFILE_H

#include <stdio.h>

#include "policy/kv_deploy.h"
#include "common/kv_status.h"
#include "format/kvc.h"

typedef struct {
    double alpha;       /* top-alpha share of the visible keys (0.05) */
    double tau;         /* score > tau: quantization-friendly (0.2) */
    int nq;             /* use the last nq stored queries (32; 0 = all) */
    /* the policies measured and written into the deploy config (the policy
     * defaults): quant.bits (1) is the deployed width, quant.group and
     * quant.residual (64, 128) size the 1- and 2-bit errors; sparse.topk
     * (128, or sparse.topk_frac when 0), sparse.channels (8), sparse.sink
     * and sparse.window (8, 56) size the sparse error */
    kv_policy_params quant, sparse;
} kv_profile_params;

void kv_profile_params_default(kv_profile_params *p);

typedef struct {
    int n_layers, n_heads, n_kv_heads, head_dim;
    int n_docs;         /* files accumulated */
    int n_q;            /* queries used per layer (of the last file) */
    /* (n_layers, n_heads), sums until kv_profile_finish, then means */
    double *score, *err_q1, *err_q2, *err_sparse;
    /* (n_layers), means over heads, set by kv_profile_finish */
    double *layer_score, *layer_q1, *layer_q2, *layer_sparse;
} kv_profile;

/* Add one file's measurements (the first call sizes *acc, which must be
 * zeroed; later files must have the same layers and heads). */
kv_status kv_profile_add(kv_profile *acc, const kvc_file *f, const kv_profile_params *p);
void kv_profile_finish(kv_profile *acc);
void kv_profile_clear(kv_profile *acc);

/* Classify: layer_score > tau -> quant_layers, else sparse_layers. */
kv_status kv_profile_deploy(const kv_profile *acc, const kv_profile_params *p, kv_deploy *d);

/* JSON report: params, per-layer and per-head numbers, classification,
 * "deploy" (what kv-run --profile reads). */
void kv_profile_write_json(const kv_profile *acc, const kv_profile_params *p,
                           const kv_deploy *d, FILE *f);
/* SVG heatmap of the score, layers down, heads across. */
void kv_profile_write_svg(const kv_profile *acc, const kv_profile_params *p, FILE *f);

#endif
