/*
 * kv_niah: needle-in-a-haystack evaluation in RULER's format.  Reads RULER
 * JSONL task files (one object per line: index, input, outputs, length),
 * runs each prompt through a kv_runner (the CPU or the GPU engine) under a
 * set of per-layer policies, generates greedily and scores like RULER's string_match_all: the fraction
 * of expected outputs that appear, case-insensitively, in the prediction.
 *
 * How the policy sees the needle (kv_niah_mode):
 *   KV_NIAH_QUESTION (default): the haystack, up to the last "\nQuestion:",
 *     is prefilled densely and handed to the policies (ingest); the question
 *     tail and the answer are decoded token by token through the policies.
 *     This is the cached-context setup: a long document is in the cache,
 *     a question arrives later, and every query that can find the needle
 *     goes through the policy.
 *   KV_NIAH_PREFILL: the whole prompt is prefilled densely; only the answer
 *     tokens after the first are decoded through the policies.  The first
 *     answer digit then comes from dense attention, which hides most of a
 *     policy's effect.
 */
#ifndef KV_NIAH_H
#define KV_NIAH_H

#include <stdbool.h>
#include <stddef.h>

#include "policy/kv_policy.h"
#include "engine/kv_runner.h"
#include "common/kv_status.h"
#include "model/kv_tokenizer.h"

typedef struct {
    int index;      /* "index", or the line's position among tasks */
    int length;     /* "length" (tokens the generator aimed at), or 0 */
    char *input;    /* the prompt */
    char **outputs; /* (n_outputs) expected strings */
    int n_outputs;
    int line;       /* line number in the file (1-based) */
} kv_niah_task;

typedef struct {
    kv_niah_task *tasks; /* (n) */
    int n;
} kv_niah_set;

/* Parse RULER JSONL text (name is used in messages: "name:LINE: ..."). Blank
 * lines are skipped; any other bad line is KV_E_DATA with its number. */
kv_status kv_niah_parse(const char *text, size_t len, const char *name, kv_niah_set *out);
/* kv_file_slurp + kv_niah_parse; a missing file is KV_E_NOINPUT. */
kv_status kv_niah_load(const char *path, kv_niah_set *out);
void kv_niah_clear(kv_niah_set *s);

/* RULER string_match_all for one task: in [0, 1]. */
double kv_niah_score(const kv_niah_task *t, const char *pred);

/* Byte offset where the question tail starts (the last "\nQuestion:"),
 * or -1 when there is none. */
long kv_niah_question_offset(const char *input);

typedef enum { KV_NIAH_QUESTION = 0, KV_NIAH_PREFILL } kv_niah_mode;

typedef struct {
    kv_niah_mode mode;
    int gen;    /* tokens to generate (>= 1; RULER needles: 7 digits) */
} kv_niah_opts;

typedef struct {
    char *pred;          /* generated text (malloc'd) */
    double score;        /* string_match_all */
    int prompt_tokens;   /* BOS + prompt */
    int dense_tokens;    /* prefilled densely and ingested */
    int decoded;         /* tokens decoded through the policies */
    kv_bytes bytes;      /* every layer summed, after the last step */
    double fetched_per_step; /* fetched bytes per decode step, all layers */
    double full_bytes;   /* bytes a full f16 cache of the final context takes */
    double ms;           /* wall time of this task */
} kv_niah_result;

void kv_niah_opts_default(kv_niah_opts *o);

/*
 * Run one task on e (the CPU or the GPU engine): reset e with per_layer
 * (NULL keeps the runner's), encode BOS + input with tok, prefill and
 * decode per o->mode, generate o->gen tokens greedily (fewer if the context
 * fills up), score.  r->pred is malloc'd: free it with kv_niah_result_clear.
 * On the GPU r->bytes.resident counts GPU bytes; r->full_bytes is the same
 * fp16 figure on either device.
 */
kv_status kv_niah_run(kv_runner *e, const kv_tokenizer *tok, const kv_policy_params *per_layer,
                      const kv_niah_task *t, const kv_niah_opts *o, kv_niah_result *r);
void kv_niah_result_clear(kv_niah_result *r);

#endif
