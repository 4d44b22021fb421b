/*
 * kv_profile: per-layer, per-head profiling of a KV cache from its stored
 * query samples, and the choice of a deployment config from it.  For every
 * query head it measures the dense preference score (TailorKV: the mass
 * outside each query's top-alpha keys) and the attention-output error of
 * each policy a layer may get -- quant at 1, 2 and 4 bits (also without
 * the fp16 recent window, and with other group sizes), sparse and dsq (also
 * with fewer salient tokens) -- by running that policy (lib/policy) on the cache: the prompt but its
 * last n_q tokens is ingested (the policy observes the n_q stored
 * queries first, as the engine gives them), the last n_q tokens are
 * appended one by one and each attends its query, against exact attention
 * over the same tokens.  It also measures each policy's resident bytes on
 * the whole cache (fp16 for full-precision parts, as the GPU keeps them;
 * a sparse layer counts the K rows its attention buffer gathers).
 * Several files are averaged.
 *
 * Two rules turn that into a deployment config (lib/policy/kv_deploy.h,
 * version 2: one policy per layer):
 *   budget (default): per layer the option with the least total error
 *     whose resident bytes, summed over layers, fit kv_budget (a fraction
 *     of full's fp16 bytes when <= 1, else bytes) -- a multiple-choice
 *     knapsack, solved exactly by dynamic programming over the bytes in
 *     steps of 1/1000 of a layer's full bytes;
 *   tau (TailorKV): layers whose score exceeds tau are quantized at
 *     quant.bits, the others sparse.
 *
 * Queries: the file stores the last n_q positions' queries per layer
 * ([n_heads, n_q, head_dim]); query j (0-based among them) sits at position
 * T - n_q + j and attends keys 0..T-n_q+j (causal), scaled by 1/sqrt(D).
 */
#ifndef KV_PROFILE_H
#define KV_PROFILE_H

#include <stdbool.h>
#include <stdio.h>

#include "policy/kv_deploy.h"
#include "common/kv_status.h"
#include "format/kvc.h"

/* The options a layer may get, in this order in every per-option table. */
typedef enum {
    KV_OPT_FULL = 0,
    KV_OPT_Q1,     /* quant bits=1 */
    KV_OPT_Q2,     /* quant bits=2 */
    KV_OPT_Q4,     /* quant bits=4 */
    KV_OPT_SPARSE, /* sparse with the sparse parameters */
    KV_OPT_DSQ,    /* dsq with the dsq parameters */
    /* the cheaper variants a KV byte budget needs: without the fp16 window
     * of recent tokens (residual 0), with smaller groups and a short window,
     * with coarser key groups, with fewer salient tokens */
    KV_OPT_Q2_R0,      /* quant bits=2, residual=0 */
    KV_OPT_Q2_R32G32,  /* quant bits=2, group=32, residual=32 */
    KV_OPT_Q4_R0,      /* quant bits=4, residual=0 */
    KV_OPT_Q4_R0G128,  /* quant bits=4, group=128, residual=0 */
    KV_OPT_DSQ_S10,    /* dsq with salient=0.1 */
    KV_OPT_COUNT
} kv_profile_opt;

/* "full", "quant1", "quant2", "quant4", "sparse", "dsq", "quant2-r0",
 * "quant2-r32g32", "quant4-r0", "quant4-r0g128", "dsq-s10" */
const char *kv_profile_opt_name(kv_profile_opt o);

/* Bit o of a choice mask: option o is measured and may be chosen. */
#define KV_PROFILE_ALL_CHOICES ((1u << KV_OPT_COUNT) - 1)

/* A comma-separated list of option names (or "all") -> a mask; full is
 * always in it (it is what the others are measured against).  KV_E_USAGE
 * naming the first unknown name. */
kv_status kv_profile_choices_parse(const char *list, unsigned *mask);

typedef enum { KV_RULE_BUDGET = 0, KV_RULE_TAU } kv_profile_rule;

typedef struct {
    double alpha;       /* top-alpha share of the visible keys (0.05) */
    double tau;         /* tau rule: score > tau is quantization-friendly (0.2) */
    int nq;             /* use the last nq stored queries (32; 0 = all) */
    kv_profile_rule rule;
    double kv_budget;   /* budget rule: resident KV bytes, a fraction of full's fp16
                           (<= 1) or bytes (> 1); 0.25 */
    unsigned choices;   /* options measured and chosen from (KV_PROFILE_ALL_CHOICES) */
    /* the policies measured and deployed (the policy defaults): quant.group
     * and quant.residual (64, 128) size the quant options, quant.bits (1)
     * is the tau rule's width; sparse: budget (topk, or topk_frac when 0),
     * channels, sink, window, select; dsq: window, salient, base */
    kv_policy_params quant, sparse, dsq;
} kv_profile_params;

void kv_profile_params_default(kv_profile_params *p);

typedef struct {
    int n_layers, n_heads, n_kv_heads, head_dim;
    int n_docs;         /* files accumulated */
    int n_q;            /* queries used per layer (of the last file) */
    /* (n_layers, n_heads), sums until kv_profile_finish, then means */
    double *score;
    double *err[KV_OPT_COUNT]; /* attention-output error per option; NaN: not applicable */
    /* (n_layers), means over heads, set by kv_profile_finish */
    double *layer_score;
    double *layer_err[KV_OPT_COUNT];
    /* (n_layers) resident bytes per option and full's fp16 bytes, sums over
     * files until kv_profile_finish, then means */
    double *bytes[KV_OPT_COUNT];
} kv_profile;

/* Add one file's measurements (the first call sizes *acc, which must be
 * zeroed; later files must have the same layers and heads). */
kv_status kv_profile_add(kv_profile *acc, const kvc_file *f, const kv_profile_params *p);
void kv_profile_finish(kv_profile *acc);
void kv_profile_clear(kv_profile *acc);

/* What the rule chose, per layer. */
typedef struct {
    kv_profile_opt *opt; /* (n_layers) */
    double bytes, full_bytes; /* resident bytes chosen / full's, per file (means) */
    double budget_bytes;      /* the budget in bytes (budget rule; 0 for tau) */
    bool budget_met;          /* false: even the cheapest choice exceeds the budget */
} kv_profile_choice;

void kv_profile_choice_clear(kv_profile_choice *c);

/* Choose per layer by p->rule (after kv_profile_finish) and write the
 * version 2 deploy config d; c (may be NULL) gets the choice.  KV_E_USAGE
 * for a bad budget. */
kv_status kv_profile_deploy(const kv_profile *acc, const kv_profile_params *p, kv_deploy *d,
                            kv_profile_choice *c);

/* JSON report: params, per-layer and per-head numbers, the choice,
 * "deploy" (what kv-run --profile reads). */
void kv_profile_write_json(const kv_profile *acc, const kv_profile_params *p,
                           const kv_deploy *d, const kv_profile_choice *c, FILE *f);
/* SVG heatmap of the score, layers down, heads across. */
void kv_profile_write_svg(const kv_profile *acc, const kv_profile_params *p, FILE *f);

#endif
