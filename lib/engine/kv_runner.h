/*
 * kv_runner: one decode driver over the CPU engine (lib/engine/kv_engine.h) and the
 * GPU engine (lib/gpu/kv_gpu_engine.h), so that the evaluation code (kv_niah,
 * kv_compare) runs the same path on either device.  A runner owns exactly
 * one engine, chosen at construction; every call is a switch on that kind
 * and forwards to the engine with the same meaning (positions, context,
 * reset, byte accounting: see the two engine headers).
 *
 * On the GPU the weights are fp16 (bf16 for bf16 models; Q8_0, Q4_K and Q6_K
 * matrices stay packed) and the KV cache is fp16, so `full` there is not the
 * CPU's f32 `full`: compare runners of the same device with each other.
 *
 * Above the two engines it drives whole runs the same way on either device:
 * generation (kv_runner_generate), teacher-forced scoring
 * (kv_runner_score) and the JSON report of a run (kv_runner_report).
 * Both engines capture the prompt for --dump-kv (kv_runner_keep) and
 * write it through one writer (kv_prompt_dump_write): float32 K/V and
 * queries on the CPU, fp16 as the GPU computed them.
 *
 * Typical use:
 *   kv_runner *r; kv_runner_new(m, per_layer, 0, KV_DEVICE_AUTO, NULL, &r);
 *   kv_runner_prefill(r, toks, n, logits);          // logits (vocab)
 *   for (...) kv_runner_step(r, argmax(logits), logits);
 *   kv_runner_free(r);
 */
#ifndef KV_RUNNER_H
#define KV_RUNNER_H

#include <stdbool.h>
#include <stddef.h>

#include "common/kv_device.h"
#include "gpu/kv_gpu_engine.h"
#include "model/kv_model.h"
#include "model/kv_sampler.h"
#include "model/kv_tokenizer.h"
#include "policy/kv_policy.h"
#include "policy/kv_prefix.h"
#include "common/kv_status.h"

typedef struct kv_runner kv_runner;

/*
 * Build a runner for m (borrowed; must outlive the runner).  per_layer
 * (n_layers) or NULL for `full`; ctx: capacity in tokens (0 = the model's
 * seq_len); gpu_opts: the GPU engine's options, NULL for its defaults
 * (ignored on the CPU).  KV_DEVICE_CUDA returns kv_gpu_engine_new's failure
 * as is (KV_E_UNAVAILABLE without a usable GPU, KV_E_UNSUPPORTED for a
 * policy the GPU engine lacks); KV_DEVICE_AUTO then builds the CPU engine
 * instead, without an error (kv_runner_fallback says why), unless a layer
 * asks for what only the GPU engine does (select=sketch, offload=on):
 * that is KV_E_UNAVAILABLE, naming the layer and the GPU's failure.
 */
kv_status kv_runner_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                        kv_device dev, const kv_gpu_engine_opts *gpu_opts, kv_runner **out);
void kv_runner_free(kv_runner *r);

/* Forget every token; per_layer (n_layers) replaces the policies, NULL keeps them. */
kv_status kv_runner_reset(kv_runner *r, const kv_policy_params *per_layer);
/* Dense prefill of tokens (n >= 1) from position 0; logits_last (vocab) or NULL. */
kv_status kv_runner_prefill(kv_runner *r, const int *tokens, int n, float *logits_last);
/* Continue from a stored cache (kv_engine_prefill_from and
 * kv_gpu_engine_prefill_from; the runner must be fresh or reset): pre's
 * rows, then tokens (n >= 1) prefilled after them.  Layers packed in the
 * file run with the file's encoding afterwards (kv_runner_params says so). */
kv_status kv_runner_prefill_from(kv_runner *r, const kv_prefix *pre, const int *tokens, int n,
                                 float *logits_last);
/* Dense prefill that keeps every position's logits (n, vocab): the CPU
 * engine's kv_engine_prefill_all; KV_E_UNSUPPORTED on the GPU engine. */
kv_status kv_runner_prefill_all(kv_runner *r, const int *tokens, int n, float *logits_all);
/* One decode step at position kv_runner_pos(); logits (vocab) or NULL. */
kv_status kv_runner_step(kv_runner *r, int token, float *logits);

int kv_runner_pos(const kv_runner *r);   /* tokens processed so far */
int kv_runner_ctx(const kv_runner *r);   /* capacity */
int kv_runner_vocab(const kv_runner *r);
const kv_model *kv_runner_model(const kv_runner *r);
/* Every layer's kv_bytes summed (resident = GPU bytes on the GPU engine). */
void kv_runner_bytes(const kv_runner *r, kv_bytes *total);

bool kv_runner_is_gpu(const kv_runner *r);
/* "cpu", or the GPU engine's device ("NVIDIA H200 (sm_90, ...)"). */
const char *kv_runner_device(const kv_runner *r);
/* Why KV_DEVICE_AUTO runs on the CPU (the GPU engine's failure), or "". */
const char *kv_runner_fallback(const kv_runner *r);

// --- per layer ---------------------------------------------------------------

int kv_runner_n_layers(const kv_runner *r);
/* The parameters layer runs with (as given to new or the last reset). */
const kv_policy_params *kv_runner_params(const kv_runner *r, int layer);
/* One layer's kv_bytes (resident = GPU bytes on the GPU engine). */
void kv_runner_layer_bytes(const kv_runner *r, int layer, kv_bytes *b);
/* Tokens one layer's cache holds (logical context length). */
int kv_runner_layer_tokens(const kv_runner *r, int layer);

// --- capture -----------------------------------------------------------------

/*
 * Keep the last nq queries of each layer and the dense prompt K/V for
 * kv_runner_dump_kvc (call before the prefill): kv_engine_keep on the CPU,
 * kv_gpu_engine_keep on the GPU (its prefill's fp16 K/V, downloaded layer
 * by layer, and its prefill's queries; decode steps are not captured there).
 */
kv_status kv_runner_keep(kv_runner *r, int nq, bool prompt_kv);
/* The queries kept (kv_runner_keep) of one layer, post-RoPE, oldest first,
 * as float32 (n_heads, nq_out, head_dim) into out (room for the nq asked
 * of kv_runner_keep); returns nq_out (0: none kept, or no memory).  On the
 * GPU only the last prefill's. */
int kv_runner_queries(const kv_runner *r, int layer, float *out);
/* The prompt's cache as .kvc (kv_engine_dump_kvc's layout, through
 * kv_prompt_dump_write on either engine); zstd_level > 0 compresses. */
kv_status kv_runner_dump_kvc(const kv_runner *r, const int *tokens, int n, kv_dtype dt,
                             const char *path, int zstd_level);

/* Before serving prefills of up to rows tokens in a long-lived process:
 * the GPU engine's one-time set-up (kv_gpu_engine_warm), its time in *ms;
 * nothing on the CPU (*ms 0).  *warmed says whether it ran (false on the
 * CPU and for a GPU engine that prefills token by token); either pointer
 * may be NULL. */
kv_status kv_runner_warm(kv_runner *r, int rows, double *ms, bool *warmed);

/* The GPU engine behind the runner, or NULL on the CPU (for what only it
 * reports, such as kv_gpu_engine_graph_info). */
const kv_gpu_engine *kv_runner_gpu(const kv_runner *r);

/* How the runner's prefill runs, for reports: device "cpu" or "cuda";
 * chunked (in chunks of chunk rows, matrix-matrix products) or one token at
 * a time; why: what decided it. */
typedef struct {
    const char *device;
    bool chunked;
    int chunk;
    char why[256];
} kv_prefill_info;
/* May load cuBLAS on the GPU (as the first prefill would). */
void kv_runner_prefill_info(kv_runner *r, kv_prefill_info *p);
/* p as the JSON object the reports carry: {"device", "method": "chunked" or
 * "tokens", "chunk" (rows; 1 token by token), "why"}; NULL without memory. */
struct cJSON *kv_prefill_info_json(const kv_prefill_info *p);

// --- whole runs --------------------------------------------------------------

/*
 * Teacher forcing through the policies: reset, prefill tokens[0], then step
 * through tokens[1..n) (n >= 2).  nll (n-1): -log p(tokens[i] | tokens[<i]).
 */
kv_status kv_runner_score(kv_runner *r, const int *tokens, int n, double *nll);

/*
 * The k most probable next tokens after every prompt position (kv-run
 * --probs, the llama.cpp cross-check): reset, kv_runner_prefill_all, then
 * one JSON array [{"pos": i, "token": id, "top": [[id, p], ...]}, ...] in
 * *json (malloc'd, one line).  CPU engine only (KV_E_UNSUPPORTED on the GPU).
 */
kv_status kv_runner_probs(kv_runner *r, const int *tokens, int n, int k, char **json);

typedef struct {
    int n;           /* tokens to generate (>= 0) */
    int stop[2];     /* ids that end generation unemitted (BOS, EOS); -1: none */
    /* called with each emitted token (i counts from 0); may be NULL */
    void (*on_token)(void *user, int token, int i);
    void *user;
    /* when set, every id it calls end-of-generation (kv_tokenizer_is_eog:
     * EOS, <|eot_id|>, <|im_end|>, ...) stops too, unemitted */
    const kv_tokenizer *eog;
} kv_generate_opts;

typedef enum { KV_GEN_STEPS = 0, KV_GEN_STOP_TOKEN, KV_GEN_CTX_FULL } kv_gen_end;

typedef struct {
    int *tokens;     /* (n_gen) emitted ids, malloc'd */
    int n_gen;
    double *step_ms; /* (n_steps) wall time of each decode step, malloc'd */
    int n_steps;     /* decode steps run: one fewer than n_gen (the first
                        token comes from the prefill's logits), or as many
                        when a stop token ended generation */
    kv_gen_end end;  /* why generation ended */
} kv_generation;

/*
 * Generate after a prefill: sample from logits (vocab; the prefill's last,
 * overwritten), emit, step, until o->n tokens, a stop token, or a full
 * context (end says which).  s: the sampler.  g is filled; free it with
 * kv_generation_clear (also after a failure).
 */
kv_status kv_runner_generate(kv_runner *r, kv_sampler *s, float *logits, const kv_generate_opts *o,
                             kv_generation *g);
void kv_generation_clear(kv_generation *g);
const char *kv_gen_end_name(kv_gen_end e); /* "steps", "stop_token", "ctx_full" */

/*
 * The context a run needs: asked (--ctx; 0 = none) must hold the prompt and
 * the n_gen - 1 decode steps after it (else KV_E_USAGE naming both);
 * without one, the model's trained length, grown to n_prompt + n_gen when
 * that is longer (*grown: past what the model was trained on).
 */
kv_status kv_run_ctx(int asked, int trained, int n_prompt, int n_gen, int *ctx, bool *grown);

/* The JSON of a teacher-forced score (kv-run --score-file): nll (n-1) of
 * n tokens, their mean, the perplexity and the time taken.  *json malloc'd. */
kv_status kv_score_report(const double *nll, int n, double ms, char **json);
/* kv_runner_score timed, then kv_score_report of it. */
kv_status kv_runner_score_json(kv_runner *r, const int *tokens, int n, char **json);

/* A run that continued from a stored cache (kv-run --kv, --store), for its
 * report: tokens taken from the cache and prefilled, the time to the
 * first token (lookup, load and the prefill of the rest) and the cache
 * bytes read from each tier (gpu, host, disk). */
typedef struct {
    const char *source;   /* "kv" (a file) or "store" */
    int reused_tokens;    /* rows taken from the cache */
    int matched;          /* prompt tokens the cache covered (>= reused with --important) */
    int prefilled_tokens; /* tokens prefilled after it */
    double ttft_ms;       /* lookup + load + prefill, to the first token's logits */
    double lookup_ms;     /* finding and reading the cache */
    uint64_t bytes_read[3]; /* gpu, host, disk */
    const char *extra;    /* more JSON members of the "reuse" object (store: the get and
                             put reports), an object's text, or NULL */
} kv_reuse_info;

/* What a run did, for its report. */
typedef struct {
    int n_prompt;
    double prefill_ms;
    const kv_generation *gen; /* NULL: prefill only */
    const char *text;         /* the generated text as written, or NULL (no tokenizer) */
    const char *kv_dtype;     /* the --kv-dtype name, NULL for "f32" */
    const kv_prefill_info *prefill; /* how the prefill ran (kv_runner_prefill_info), or NULL */
    const kv_reuse_info *reuse; /* a continued cache, or NULL: prefilled from position 0 */
} kv_run_info;

/*
 * The JSON report of a run (kv-run --report; kv-run(1) REPORT lists the
 * members): model, device, how the prefill ran, timings (median and p90
 * of the decode steps),
 * KV bytes by tier, the generated token ids and text, and one object per
 * layer.  *json is malloc'd text without a trailing newline.
 */
kv_status kv_runner_report(const kv_runner *r, const kv_run_info *info, char **json);

#endif
