/*
 * The pieces of kv-run (cmd/kv-run.c runs the model): its parsed options
 * (run_opts.c, the option table behind --help) and where the prefill starts
 * (run_reuse.c: position 0, a .kvc given by --kv, or a kv-tree store's
 * longest cached prefix given by --store).
 */
#ifndef RUN_RUN_H
#define RUN_RUN_H

#include <stdbool.h>
#include <string.h>

#include "kv_cli.h"
#include "engine/kv_runner.h"
#include "gpu/kv_gpu_batch.h"
#include "eval/kv_reuse.h"
#include "model/kv_model.h"
#include "model/kv_prompt.h"
#include "policy/kv_deploy.h"
#include "policy/kv_prefix.h"

typedef struct {
    const char *model, *synth, *weights, *tokenizer, *prompt, *prompt_file, *tokens;
    const char *policy, *profile, *kv_dtype, *report, *dump, *score, *compare, *kv, *store;
    kv_policy_defaults def; /* --kv-dtype, --select */
    kv_device dev;
    kv_dtype wt; /* --weights */
    int device_ordinal, prefix, steps, ctx, nq, threads, random_prompt, zstd, prefill_chunk, probs, gemv;
    int batch;        /* --batch B (0: one prompt) */
    kv_gpu_gemm gemm; /* --gemm */
    int graph;        /* --graph: KV_GPU_GRAPH_* (0 auto) */
    bool nq_given, tokenize, special, print_ids, no_insert, gemm_given, query_aware;
    kv_chat chat; /* --chat */
    double temp, top_p, important;
    unsigned long seed;
} run_opts;
static inline bool is_stdout(const char *path) { return path && !strcmp(path, "-"); }

/* kv_cli_init, then the command line into *o, checked (usage errors exit 64). */
void run_parse_opts(int argc, char **argv, run_opts *o);

/* Where the prefill starts: position 0, a .kvc (--kv) or a store's longest
 * cached prefix (--store, its files in a temporary directory of ours). */
typedef struct {
    kvc_file *f;
    kv_prefix pre;
    kv_reuse ru;
    bool ru_open;
    kv_reuse_opts ro;
    kv_reuse_info info;
    char tmp[4096];
    int *all, n_all; /* --kv: the cached tokens and the prompt (for --dump-kv) */
} reuse_state;
/* --kv: open the cache and check it without the model, refusing --dump-kv
 * after a cache it cannot extend (reports, returns the exit code). */
int reuse_open_kv(const run_opts *o, reuse_state *u);
/* --kv: check the open cache against m; --store: open the store (reports,
 * returns the exit code). */
int reuse_begin(const run_opts *o, const kv_model *m, reuse_state *u);
/* The prefill, from the cache or the store's prefix when there is one. */
kv_status reuse_prefill(const run_opts *o, kv_runner *r, reuse_state *u, const int *ids, int n, float *logits);
void reuse_end(reuse_state *u);

/* kv-run.c: the model and its tokenizer, and every layer's policies
 * (both report a failure and return the exit code). */
int run_load_model(const run_opts *o, kv_model **m, kv_tokenizer **tok);
int run_load_policies(const run_opts *o, int L, kv_policy_params **prm);
/* --batch (run_batch.c): load, decode the B prompts, print; the exit code. */
int run_batch(const run_opts *o);

#endif
