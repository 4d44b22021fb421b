/*
 * kv_longbench: LongBench (THUDM/LongBench, v1) and LongBench-E as
 * published, run the way LongBench's pred.py runs them, under KV policies.
 *
 * Data: one JSONL file per dataset, <dataset>.jsonl or <dataset>_e.jsonl
 * (LongBench-E), each line {"input", "context", "answers", "length",
 * "dataset", "language", "all_classes", "_id"}.  Prompt templates and
 * generation lengths come from files in LongBench's own formats,
 * dataset2prompt.json ({"name": "template with {context} and {input}"})
 * and dataset2maxlen.json ({"name": tokens}).
 *
 * A sample's prompt is template.format(**sample) (Python's str.format:
 * {field}, {{ and }}); when it encodes to more than max_length tokens it is
 * cut in the middle as pred.py does -- the first and the last
 * int(max_length/2) tokens, each half decoded on its own, then joined and
 * encoded again.  A chat format (model/kv_chat: Llama-3's, ChatML, or a
 * template of one's own, "...{prompt}...") wraps it, except for
 * trec, triviaqa, samsum, lsht, lcc and repobench-p.  Generation is greedy
 * for dataset2maxlen tokens, stopping at EOS (samsum also at "\n", and not
 * before its first token).  In question mode (the default) the prompt up to
 * the end of {context} is prefilled densely and the rest -- the question
 * and the instruction after the context -- is decoded through the
 * policies; prefill mode prefills everything.
 */
#ifndef KV_LONGBENCH_H
#define KV_LONGBENCH_H

#include <stdbool.h>
#include <stdio.h>

#include <cjson/cJSON.h>

#include "common/kv_status.h"
#include "engine/kv_runner.h"
#include "eval/kv_batch.h"
#include "eval/kv_jieba.h"
#include "eval/kv_metrics.h"
#include "eval/kv_niah.h"
#include "model/kv_chat.h"
#include "model/kv_tokenizer.h"

typedef struct {
    cJSON *obj;         /* the line (the template reads its fields) */
    char id[128];       /* "_id", or "line:N" without one */
    char **answers;     /* (n_answers) */
    int n_answers;
    char **classes;     /* (n_classes) when has_classes */
    int n_classes;
    bool has_classes;
    long long length;   /* -1 without one */
    int line;
} kv_lb_sample;

typedef struct {
    const char *path;
    char stem[128];     /* base name without .jsonl ("qasper_e") */
    char dataset[128];  /* without _e ("qasper") */
    bool e;             /* a LongBench-E file */
    const kv_lb_dataset *ds;
    kv_lb_sample *v;    /* (n) */
    int n;
    kv_niah_bad *bad;   /* (n_bad) lines that could not be read */
    int n_bad;
} kv_lb_file;

/* Read a data file leniently (bad lines to f->bad); the dataset is named
 * by the file (a name LongBench does not have is KV_E_DATA). */
kv_status kv_lb_file_parse(const char *text, size_t len, const char *path, kv_lb_file *f);
kv_status kv_lb_file_load(const char *path, kv_lb_file *f);
void kv_lb_file_free(kv_lb_file *f);

/* dataset2prompt.json and dataset2maxlen.json. */
typedef struct {
    char **name;   /* (n) */
    char **text;   /* (n) templates (prompts) */
    int *num;      /* (n) lengths (maxlen) */
    int n;
    unsigned long long hash; /* FNV-1a of the file, for the run's header */
} kv_lb_table;

/* Every value a string template that str.format can fill from named
 * fields (prompts), or an integer in [1, 65536] (maxlen); KV_E_DATA names
 * the key. */
kv_status kv_lb_prompts_parse(const char *text, size_t len, const char *name, kv_lb_table *out);
kv_status kv_lb_maxlen_parse(const char *text, size_t len, const char *name, kv_lb_table *out);
kv_status kv_lb_table_load(const char *path, bool prompts, kv_lb_table *out);
void kv_lb_table_free(kv_lb_table *t);
int kv_lb_table_find(const kv_lb_table *t, const char *name); /* index or -1 */

/* Check that tmpl is a format string of named fields only. */
kv_status kv_lb_template_check(const char *tmpl);
/* tmpl.format(**obj): *out malloc'd; *ctx_end the byte offset just after
 * the last {context} (-1 without one).  A field obj lacks, or one that is
 * an array or object, is KV_E_DATA. */
kv_status kv_lb_format(const char *tmpl, const cJSON *obj, char **out, long *ctx_end);

typedef struct {
    int max_length;      /* pred.py's max_length; 0: the context minus the dataset's max_gen */
    int max_gen;         /* > 0: cap every dataset's generation length */
    kv_chat chat;        /* the chat format (KV_CHAT_NONE: none; AUTO resolved before the batch) */
    kv_niah_mode mode;
    int limit;           /* the first N samples of each file (before sharding); 0: all */
    int shard_i, shard_n;
    bool strict;
} kv_lb_opts;

/* A prompt ready to run. */
typedef struct {
    int *ids;            /* (n) BOS first */
    int n;
    int split;           /* dense tokens */
    bool truncated;      /* cut in the middle */
    kv_niah_mode mode;   /* prefill when the context's end could not be found */
} kv_lb_prompt;

kv_status kv_lb_prepare(const kv_tokenizer *tok, const char *tmpl, const kv_lb_sample *s,
                        const kv_lb_dataset *ds, int max_length, const kv_chat *chat,
                        kv_niah_mode mode, kv_lb_prompt *p);

cJSON *kv_lb_header(const char *model, const char *tokenizer, const char *device_kind,
                    const char *device_name, const kv_lb_file *files, int nf,
                    const kv_lb_table *prompts, const kv_lb_table *maxlen, const kv_lb_opts *o);

/* Run every selected sample of this shard under each policy not in done;
 * records to log and records.  jb: jieba for the Chinese metrics (NULL if
 * no file needs it). */
kv_status kv_lb_batch(kv_runner *e, const kv_tokenizer *tok, const kv_jieba *jb,
                      const kv_lb_file *files, int nf, const kv_lb_table *prompts,
                      const kv_lb_table *maxlen, const kv_batch_policy *pols, int np,
                      const kv_lb_opts *o, kv_batch_log *log, const kv_batch_done *done,
                      cJSON *records, const kv_batch_hooks *hooks);

/* The summary: per (policy, dataset) eval.py's score (LongBench-E files:
 * its length bins), bytes and times; JSON or a table. */
kv_status kv_lb_summary(FILE *f, bool json, const cJSON *headers, cJSON *records,
                        bool per_sample);
/* DIR/<policy>/<dataset>.jsonl in pred.py's format (pred, answers,
 * all_classes, length), samples in file order. */
kv_status kv_lb_write_preds(const char *dir, const cJSON *headers, cJSON *records);

#endif
