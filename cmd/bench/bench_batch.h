/*
 * bench_batch: the options and front-end pieces every batch subcommand of
 * kv-bench shares (ruler, longbench): the policy list (-p SPEC and
 * --profile FILE, in command-line order), --output/--resume/--shard/
 * --strict/--pred-dir, and the hooks that turn the library's progress and
 * skip reports into a progress line (on a terminal) and warnings.
 */
#ifndef BENCH_BATCH_H
#define BENCH_BATCH_H

#include <stdbool.h>

#include "kv_cli.h"
#include "engine/kv_runner.h"
#include "eval/kv_batch.h"
#include "policy/kv_policy.h"

enum {
    BB_POLICY = 'p',
    BB_PROFILE = 0x1000,
    BB_OUTPUT,
    BB_RESUME,
    BB_SHARD,
    BB_STRICT,
    BB_PRED_DIR,
    BB_SVG,
};

#define BENCH_BATCH_OPTIONS                                                                     \
    {BB_POLICY, 'P', "policy", "SPEC", "KV policy spec (per-layer lists too), repeatable (default: full)"}, \
    {BB_POLICY, 'p', NULL, "SPEC", NULL}, /* deprecated: -p is --prompt elsewhere */             \
    {BB_PROFILE, 0, "profile", "FILE", "per-layer policies from a kv-profile JSON, repeatable"},    \
    {BB_OUTPUT, 'o', "output", "FILE.jsonl", "append every finished sample to FILE (fsynced)"},    \
    {BB_RESUME, 0, "resume", NULL, "continue --output FILE, skipping samples already in it"},      \
    {BB_SHARD, 0, "shard", "I/N", "run shard I of N (1-based; split by sample id)"},               \
    {BB_STRICT, 0, "strict", NULL, "a malformed or over-long sample is fatal (exit 65)"},          \
    {BB_PRED_DIR, 0, "pred-dir", "DIR", "write prediction files DIR/<policy>/<name>.jsonl"},    \
    {BB_SVG, 0, "svg", "FILE", "also draw the charts of kv-bench report into FILE"}

typedef struct {
    struct {
        bool profile;
        const char *arg;
    } pol[64];
    int npol;
    const char *output, *pred_dir, *svg;
    bool resume, strict;
    int shard_i, shard_n;
} bench_batch;

void bench_batch_init(bench_batch *b);
/* Take option id (one of BB_*): true when it was one. */
bool bench_batch_option(bench_batch *b, int id, const char *arg);
/* After parsing: usage errors (--resume without --output, ...). */
void bench_batch_check(const bench_batch *b);
/* Check every spec parses (before anything loads); 0 or an exit code. */
int bench_batch_precheck(const bench_batch *b);
/* The policies for n_layers: *pols and their parameters (free both);
 * sketch applies --select sketch. 0 or an exit code (message printed). */
int bench_batch_policies(const bench_batch *b, int n_layers, bool sketch, kv_batch_policy **pols,
                         kv_policy_params **params, int *np);
void bench_batch_policies_free(kv_batch_policy *pols, kv_policy_params *params, int np);
/* bench_batch_policies for m, then the engine that runs them on dev (go:
 * the GPU's options), its device noted at -v.  0 or an exit code (message
 * printed); the caller frees what was made either way. */
int bench_batch_engine(const bench_batch *b, const kv_model *m, bool sketch, kv_device dev,
                       const kv_gpu_engine_opts *go, kv_batch_policy **pols, kv_policy_params **params,
                       int *np, kv_runner **e);
/* --svg: the report's charts of records; 0 or an exit code. */
int bench_batch_svg(const char *path, const cJSON *headers, cJSON *records);
/* Hooks printing progress (kv_progress) and skip warnings (kv_warn). */
void bench_batch_hooks(kv_batch_hooks *h);
/* What a batch run holds from its model to its summary, released
 * together at the end whatever happened. */
typedef struct {
    kv_model *m;
    kv_tokenizer *tok;
    kv_runner *e;
    kv_batch_policy *pols;  /* (np) */
    kv_policy_params *prm;  /* bench_batch_policies' parameters */
    int np;
    cJSON *header, *records;
    kv_batch_log *log;
    kv_batch_done *done;
    kv_batch_hooks hooks; /* bench_batch_hooks */
} bench_batch_run;
void bench_batch_run_init(bench_batch_run *r);
void bench_batch_run_free(bench_batch_run *r);
/* The header's "policies" and "shard"; then open --output (resume: the
 * records already there go to *records and their keys to *done).  0 or an
 * exit code. */
int bench_batch_open(const bench_batch *b, cJSON *header, const kv_batch_policy *pols, int np,
                     kv_batch_log **log, cJSON **records, kv_batch_done **done);

/* What a benchmark writes once its samples are done: prediction files
 * (--pred-dir) and the summary on stdout. */
typedef struct {
    kv_status (*preds)(const char *dir, const cJSON *headers, cJSON *records, void *ctx);
    kv_status (*summary)(FILE *f, bool json, const cJSON *headers, cJSON *records, bool per, void *ctx);
    void *ctx;
} bench_batch_out;
/* The end of a batch run: st is the run's status (reported as `what`);
 * then close *log, write --pred-dir, --svg and the summary of header's
 * run.  0 or an exit code (message printed). */
int bench_batch_finish(const bench_batch *b, const char *what, kv_status st, kv_batch_log **log,
                       cJSON *header, cJSON *records, bool json, bool per, const bench_batch_out *out);

#endif
