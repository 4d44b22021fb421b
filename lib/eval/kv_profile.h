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
 * With the model (kv_profile_add_kl, lib/eval/kv_profile_kl.c) each
 * option's error is instead the KL of the next-token distributions when
 * the file's last tokens are decoded with that layer alone under it: the
 * error a deployment sees (the attention-output error overstates sparse
 * layers wherever attention is diffuse).
 *
 * Two rules turn that into a deployment config (lib/policy/kv_deploy.h,
 * version 2: one policy per layer):
 *   budget (default): per layer the option with the least total error
 *     (the KL when measured, else the attention-output error)
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
#include "model/kv_model.h"

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
    KV_OPT_DSQ_S10,    /* dsq with salient=0.1, bits=2 */
    /* what fits a short cache of small heads (stories260K: head dim 8, where
     * the per-token value scales alone are 1/8 of fp16): 1 bit without the
     * window, StreamingLLM's sink + window, a sparse layer with a short
     * window and a small top-K */
    KV_OPT_Q1_R0,      /* quant bits=1, residual=0 */
    KV_OPT_STREAM32,   /* streaming sink=4, window=28 */
    KV_OPT_STREAM64,   /* streaming sink=4, window=60 */
    KV_OPT_SPARSE32,   /* sparse (the sparse parameters) with sink=4, window=12, k=16 */
    KV_OPT_COUNT
} kv_profile_opt;

/* "full", "quant1", "quant2", "quant4", "sparse", "dsq", "quant2-r0",
 * "quant2-r32g32", "quant4-r0", "quant4-r0g128", "dsq-s10", "quant1-r0",
 * "stream32", "stream64", "sparse32" */
const char *kv_profile_opt_name(kv_profile_opt o);

/* Option o's policy parameters as kv_profile_deploy writes them (in the
 * storage type of p's quant, sparse and dsq parameters; full is f32). */
typedef struct kv_profile_params kv_profile_params;
void kv_profile_deploy_params(const kv_profile_params *p, kv_profile_opt o, kv_policy_params *x);

/* Bit o of a choice mask: option o is measured and may be chosen. */
#define KV_PROFILE_ALL_CHOICES ((1u << KV_OPT_COUNT) - 1)
/* The small-cache choices (quant1-r0, stream32, stream64, sparse32): only
 * the model's KL (--model) judges the tokens they drop, so kv-profile
 * measures them by default only with a model. */
#define KV_PROFILE_SMALL_CHOICES                                                                      \
    ((1u << KV_OPT_Q1_R0) | (1u << KV_OPT_STREAM32) | (1u << KV_OPT_STREAM64) | (1u << KV_OPT_SPARSE32))

/* A comma-separated list of option names (or "all") -> a mask; full is
 * always in it (it is what the others are measured against).  KV_E_USAGE
 * naming the first unknown name. */
kv_status kv_profile_choices_parse(const char *list, unsigned *mask);

typedef enum { KV_RULE_BUDGET = 0, KV_RULE_TAU } kv_profile_rule;

struct kv_profile_params {
    double alpha;       /* top-alpha share of the visible keys (0.05) */
    double tau;         /* tau rule: score > tau is quantization-friendly (0.2) */
    int nq;             /* use the last nq stored queries (32; 0 = all) */
    kv_profile_rule rule;
    double kv_budget;   /* budget rule: resident KV bytes, a fraction of full's fp16
                           (<= 1) or bytes (> 1); 0.25 */
    unsigned choices;   /* options measured and chosen from (KV_PROFILE_ALL_CHOICES) */
    int steps;          /* kv_profile_add_kl: the last `steps` tokens of a file are
                           decoded one by one through the policies (32) */
    /* the policies measured and deployed (the policy defaults): quant.group
     * and quant.residual (64, 128) size the quant options, quant.bits (1)
     * is the tau rule's width; sparse: budget (topk, or topk_frac when 0),
     * channels, sink, window, select; dsq: window, salient, base */
    kv_policy_params quant, sparse, dsq;
};

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
    /* (n_layers) kv_profile_add_kl: mean KL(full || option on this layer
     * alone) of the next-token distributions, nats; sums until finish, then
     * means over the files; NaN: not applicable.  When measured (kl_docs >
     * 0) the budget rule minimizes the sum of these instead of layer_err. */
    double *kl[KV_OPT_COUNT];
    int kl_docs;        /* files whose KL was measured */
    int kl_steps;       /* decode steps scored per file (of the last file) */
} kv_profile;

/* Add one file's measurements (the first call sizes *acc, which must be
 * zeroed; later files must have the same layers and heads). */
kv_status kv_profile_add(kv_profile *acc, const kvc_file *f, const kv_profile_params *p);
void kv_profile_finish(kv_profile *acc);

/*
 * The error that decides, measured the way a deployment runs: with the
 * model m, the file's first T - p->steps tokens are the prompt (its rows
 * are taken from the file, the last 32 prompt tokens are prefilled again
 * densely so that every policy observes the same queries as after a real
 * prefill) and its last p->steps tokens are teacher-forced through decode
 * steps (predicted queries, sparse selection, quantized rows: the CPU
 * engine, lib/engine).  For each layer and each option in p->choices,
 * that layer alone gets the option (as kv_profile_deploy writes it, in
 * the storage type deployed) and every other layer full f32; acc->kl gets
 * the mean KL of the steps' next-token distributions against full f32 on
 * every layer.  Call after kv_profile_add of the same file (which sizes
 * acc and measures the bytes).  The file needs its tokens (kv-run
 * --dump-kv writes them) and must come from m (kv_prefix_check_model).
 * Cost: (1 + layers x options) runs of 32 prefill tokens and steps
 * decode steps.
 */
kv_status kv_profile_add_kl(kv_profile *acc, const kvc_file *f, const kv_model *m,
                            const kv_profile_params *p);
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
