/*
 * kv_niah: needle-in-a-haystack and RULER tasks.  Reads RULER JSONL task
 * files -- this repository's own format (index, input ending in "Answer: ",
 * outputs, length) and the files RULER's prepare.py writes for its 13
 * tasks (input without the answer prefix, answer_prefix, outputs,
 * length, length_w_model_temp, token_position_answer, ...) -- runs each
 * prompt through a kv_runner under a set of per-layer policies, generates
 * greedily and scores as RULER does (string_match_all, or
 * string_match_part for the qa tasks; lib/eval/kv_metrics).
 *
 * The prompt is input + answer_prefix, as RULER's call_api.py sends it.
 *
 * How the policy sees the needle (kv_niah_mode):
 *   KV_NIAH_QUESTION (default): the haystack is prefilled densely and handed
 *     to the policies (ingest); the question tail and the answer are decoded
 *     token by token through the policies -- the cached-context setup, where
 *     every query that can find the needle goes through the policy.  The
 *     question starts at the last "\nQuestion:" or, in RULER's published
 *     files (those with an answer_prefix), at the input's last line, which
 *     holds the question in all 13 templates.  A task with neither runs in
 *     prefill mode, and says so (kv_niah_result.mode).
 *   KV_NIAH_PREFILL: the whole prompt is prefilled densely; only the answer
 *     tokens after the first are decoded through the policies.
 */
#ifndef KV_NIAH_H
#define KV_NIAH_H

#include <stdbool.h>
#include <stddef.h>

#include "common/kv_status.h"
#include "engine/kv_runner.h"
#include "eval/kv_metrics.h"
#include "model/kv_tokenizer.h"
#include "policy/kv_policy.h"

typedef struct {
    int index;      /* "index", or the line's position among tasks */
    int length;     /* "length" (tokens the generator aimed at), or 0 */
    char *input;    /* the prompt without the answer prefix */
    char **outputs; /* (n_outputs) expected strings */
    int n_outputs;
    int line;       /* line number in the file (1-based) */
    char *answer_prefix; /* RULER's answer_prefix, or NULL */
    char id[40];    /* the index as text, "#k" appended to the k-th repeat */
} kv_niah_task;

/* A line that could not be read: its number and why. */
typedef struct {
    int line;
    char *why;
} kv_niah_bad;

/* Record a skipped line with the current error detail as its why: bad
 * (n_bad, capacity *cap) grows as needed; KV_E_NOMEM naming name. */
kv_status kv_niah_bad_add(kv_niah_bad **bad, int *n_bad, int *cap, int line, const char *name);

typedef struct {
    kv_niah_task *tasks; /* (n) */
    int n;
    kv_niah_bad *bad;    /* (n_bad) lines skipped by kv_niah_parse_lenient */
    int n_bad;
} kv_niah_set;

/* Parse RULER JSONL text (name is used in messages: "name:LINE: ...").  Blank
 * lines are skipped; any other bad line is KV_E_DATA with its number, as is
 * a file without tasks.  Numbers must be integers: "index" in int's range,
 * "length" in [-1, INT_MAX] (a number beyond them is refused, never
 * converted). */
kv_status kv_niah_parse(const char *text, size_t len, const char *name, kv_niah_set *out);
/* The same, but bad lines go to out->bad instead of failing; a file with
 * neither tasks nor bad lines is KV_E_DATA. */
kv_status kv_niah_parse_lenient(const char *text, size_t len, const char *name,
                                kv_niah_set *out);
/* kv_file_slurp + kv_niah_parse; a missing file is KV_E_NOINPUT. */
kv_status kv_niah_load(const char *path, kv_niah_set *out);
kv_status kv_niah_load_lenient(const char *path, kv_niah_set *out);
void kv_niah_clear(kv_niah_set *s);

/* The task name of a file: its base name without ".jsonl"; RULER's
 * data/<task>/validation.jsonl (or test.jsonl) is named by the folder. */
void kv_niah_task_name(const char *path, char *buf, size_t cap);
/* RULER's tokens_to_generate for a published task name, or 0. */
int kv_niah_task_gen(const char *task);

/* RULER string_match_all for one task: in [0, 1] (pred post-processed as
 * evaluate.py does). */
double kv_niah_score(const kv_niah_task *t, const char *pred);
double kv_niah_score_metric(const kv_niah_task *t, const char *pred, kv_ruler_metric m);

/* Byte offset where the question tail starts (the last "\nQuestion:"),
 * or -1 when there is none. */
long kv_niah_question_offset(const char *input);
/* The split a task gets: kv_niah_question_offset, else for RULER's
 * published format the input's last newline; -1 when there is none. */
long kv_niah_task_split(const kv_niah_task *t);

typedef enum { KV_NIAH_QUESTION = 0, KV_NIAH_PREFILL } kv_niah_mode;

typedef struct {
    kv_niah_mode mode;
    int gen;    /* tokens to generate (>= 1; RULER needles: 7 digits) */
    kv_ruler_metric metric;
} kv_niah_opts;

typedef struct {
    char *pred;          /* generated text (malloc'd, valid UTF-8) */
    double score;        /* the task's RULER metric */
    kv_niah_mode mode;   /* the mode the task ran in */
    int prompt_tokens;   /* BOS + prompt */
    int dense_tokens;    /* prefilled densely and ingested */
    int decoded;         /* tokens decoded through the policies */
    int gen_tokens;      /* tokens generated */
    kv_bytes bytes;      /* every layer summed, after the last step */
    double fetched_per_step; /* fetched bytes per decode step, all layers */
    double full_bytes;   /* bytes a full f16 cache of the final context takes */
    double ms;           /* wall time of this task */
    double prefill_ms, decode_ms;
} kv_niah_result;

void kv_niah_opts_default(kv_niah_opts *o);

/* The prompt's tokens (BOS + input + answer_prefix) and the dense split the
 * task gets under mode; *mode_used is KV_NIAH_PREFILL when the question
 * split it needs is absent. */
kv_status kv_niah_prepare(const kv_tokenizer *tok, const kv_niah_task *t, kv_niah_mode mode,
                          int **ids, int *n, int *split, kv_niah_mode *mode_used);

/*
 * Run one task on e (the CPU or the GPU engine): reset e with per_layer
 * (NULL keeps the runner's), prefill and decode per o->mode, generate
 * o->gen tokens greedily (fewer at EOS or if the context fills up), score.
 * A prompt longer than the context is KV_E_DATA.  r->pred is malloc'd: free
 * it with kv_niah_result_clear.  On the GPU r->bytes.resident counts GPU
 * bytes; r->full_bytes is the same fp16 figure on either device.
 */
kv_status kv_niah_run(kv_runner *e, const kv_tokenizer *tok, const kv_policy_params *per_layer,
                      const kv_niah_task *t, const kv_niah_opts *o, kv_niah_result *r);
/* The same on a prompt kv_niah_prepare made. */
kv_status kv_niah_run_prepared(kv_runner *e, const kv_tokenizer *tok,
                               const kv_policy_params *per_layer, const kv_niah_task *t,
                               const kv_niah_opts *o, const int *ids, int n, int split,
                               kv_niah_mode mode_used, kv_niah_result *r);
void kv_niah_result_clear(kv_niah_result *r);

#endif
