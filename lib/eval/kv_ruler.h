/*
 * kv_ruler: `kv-bench ruler` as a resumable, shardable batch -- RULER task
 * files (lib/eval/kv_niah) run under each policy, every finished sample a
 * record in the results log (lib/eval/kv_batch) -- and the summary that a
 * run and `kv-bench merge` both print from the records: per (policy, task,
 * length) the mean accuracy, RULER's score (x100, 2 decimals), the modes
 * the samples ran in, and the bytes and times per task.
 */
#ifndef KV_RULER_H
#define KV_RULER_H

#include <stdbool.h>
#include <stdio.h>

#include <cjson/cJSON.h>

#include "common/kv_status.h"
#include "engine/kv_runner.h"
#include "eval/kv_batch.h"
#include "eval/kv_niah.h"
#include "model/kv_tokenizer.h"

typedef struct {
    const char *path;    /* as given (messages, the header) */
    char task[128];      /* kv_niah_task_name */
    kv_niah_set set;     /* read leniently: bad lines become skips */
    kv_ruler_metric metric;
    int gen;             /* tokens generated per sample */
} kv_ruler_file;

typedef struct {
    kv_niah_mode mode;
    const int *lengths;  /* (n_lengths) only these lengths; none: all */
    int n_lengths;
    int limit;           /* at most this many samples per (file, length), before sharding; 0: all */
    int shard_i, shard_n;
    bool strict;         /* a skipped sample is fatal */
} kv_ruler_opts;

/* Load path leniently and fill f (task name, metric: forced or by name,
 * gen: forced (> 0) or RULER's tokens_to_generate or 7). */
kv_status kv_ruler_file_open(const char *path, const kv_ruler_metric *metric, int gen,
                             kv_ruler_file *f);
void kv_ruler_file_close(kv_ruler_file *f);

/* The header of a run (the caller adds "policies", "shard", ...). */
cJSON *kv_ruler_header(const char *model, const char *tokenizer, const char *device_kind,
                       const char *device_name, const kv_ruler_file *files, int nf,
                       const kv_ruler_opts *o);

/*
 * Run every sample of files that o selects, in this shard, under each
 * policy not yet in done (may be NULL); each record goes to log (may be
 * NULL) and to records.  Bad lines and prompts longer than the context are
 * skipped (kv_batch_skip).
 */
kv_status kv_ruler_batch(kv_runner *e, const kv_tokenizer *tok, const kv_ruler_file *files,
                         int nf, const kv_batch_policy *pols, int np, const kv_ruler_opts *o,
                         kv_batch_log *log, const kv_batch_done *done, cJSON *records,
                         const kv_batch_hooks *hooks);

/* Print the summary of records (sorted here) under headers: JSON or a
 * table; per_task adds each sample. */
kv_status kv_ruler_summary(FILE *f, bool json, const cJSON *headers, cJSON *records,
                           bool per_task);

/* Write DIR/<policy>/<task>.jsonl in RULER's prediction format (index,
 * pred, input, outputs, others, truncation, length) from records; input
 * comes from files when given (NULL: empty). */
kv_status kv_ruler_write_preds(const char *dir, const cJSON *headers, cJSON *records,
                               const kv_ruler_file *files, int nf);

#endif
