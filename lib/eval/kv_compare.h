/*
 * kv_compare: fidelity of KV cache policies against a reference (`full`).
 * The same token sequence runs through one engine per policy, in lockstep:
 * the first `prefix` tokens are prefilled densely (identical in every
 * engine) and handed to the policies; every later token is teacher-forced
 * through decode steps, so each prediction after the prefix is made by
 * attention through the policy.  Per scored position: KL(ref || policy) of
 * the next-token distributions, whether the top-1 tokens agree, and the
 * log-likelihood each assigns to the actual next token.
 *
 * Scored positions: the predictions of tokens[prefix+1 .. n-1], i.e. the
 * n - prefix - 1 logits produced by decode steps (the prediction made by
 * the dense prefill itself is identical everywhere and is left out).
 */
#ifndef KV_COMPARE_H
#define KV_COMPARE_H

#include <stdbool.h>
#include <stdio.h>

#include "model/kv_model.h"
#include "policy/kv_policy.h"
#include "engine/kv_runner.h"
#include "common/kv_status.h"

typedef struct {
    int prefix;       /* tokens prefilled densely; 0 = half of the sequence (at least 1) */
    kv_device device; /* where the reference and every policy run (default CPU); AUTO
                         picks the reference's device and holds the policies to it */
    int ordinal;      /* the CUDA device on the GPU (0) */
} kv_compare_opts;

typedef struct {
    int n_tokens;      /* sequence length */
    int prefix;        /* tokens prefilled densely */
    int n_scored;      /* positions compared: n_tokens - prefix - 1 */
    double kl_mean;    /* nats, mean over scored positions */
    double kl_max;
    double top1;       /* fraction of positions whose argmax agrees */
    double nll_ref, nll_pol;  /* mean negative log-likelihood of the actual next token */
    double ppl_ref, ppl_pol;  /* exp(nll) */
    double ppl_diff;          /* ppl_pol - ppl_ref */
    kv_bytes bytes_ref, bytes_pol; /* every layer summed, after the last step */
    double *kl;        /* (n_scored) per-position KL, malloc'd */
    unsigned char *agree; /* (n_scored) 1 where top-1 agrees */
    char device[128];  /* where both ran: "cpu" or the GPU engine's device string */
    kv_prefill_info prefill; /* how the dense prefix was prefilled (the reference's engine) */
} kv_compare_result;

void kv_compare_opts_default(kv_compare_opts *o);

/*
 * Compare n_pol policies with a reference on tokens (n >= 3), every one on
 * o->device: on the GPU the reference is the GPU engine's `full` (fp16
 * weights and KV), so the numbers are "policy against full on the same
 * device".  A policy the GPU engine lacks fails (KV_E_UNSUPPORTED), even
 * with AUTO, rather than mixing devices.
 *   ref:  (n_layers) reference parameters, NULL = `full` on every layer
 *         (f32 on the CPU, fp16 on the GPU)
 *   pols: (n_pol) pointers, each to (n_layers) parameters
 *   res:  (n_pol) results, filled; free each with kv_compare_result_clear
 * One runner per policy plus one for the reference, each of context n,
 * advanced in lockstep (memory: n_pol + 1 caches; time: n_pol + 1 runs).
 */
kv_status kv_compare_run_many(const kv_model *m, const int *tokens, int n,
                              const kv_policy_params *ref, const kv_policy_params *const *pols,
                              int n_pol, const kv_compare_opts *o, kv_compare_result *res);

/* One policy (what kv-run --compare POLICY calls). */
kv_status kv_compare_run(const kv_model *m, const int *tokens, int n,
                         const kv_policy_params *ref, const kv_policy_params *pol,
                         const kv_compare_opts *o, kv_compare_result *res);

/* One policy given as a spec, filled in by def (kv_policies_load): what
 * kv-run --compare SPEC calls. */
kv_status kv_compare_run_spec(const kv_model *m, const int *tokens, int n, const kv_policy_params *ref,
                              const char *spec, const kv_policy_defaults *def, const kv_compare_opts *o,
                              kv_compare_result *res);

void kv_compare_result_clear(kv_compare_result *r);

/*
 * Print results (one per policy, names[i] its spec) as JSON or as a table:
 * what kv-bench fidelity and kv-run --compare print, with the device of
 * res[0] ("device" in the JSON, a line of the table).  model and ref_name
 * label the output; n_layers turns the per-layer attend count into steps;
 * per_position adds each result's per-position KL and agreement (JSON).
 * Returns KV_E_IO when f has an error.
 */
kv_status kv_compare_print(FILE *f, bool json, const char *model, const char *ref_name,
                           const char *const *names, const kv_compare_result *res, int n,
                           int n_layers, bool per_position);

/*
 * Open a model and its tokenizer for the evaluation tools: tokenizer is a
 * llama2.c tokenizer.bin path, or NULL for a GGUF model's own vocabulary
 * (a llama2.c checkpoint without one is KV_E_USAGE).
 */
struct kv_tokenizer;
kv_status kv_compare_open_model(const char *model, const char *tokenizer, kv_model **m,
                                struct kv_tokenizer **tok);

#endif
