/*
 * kv_score: benchmark scores as the official scripts report them, from
 * prediction files or from per-sample scores already computed.
 *
 * LongBench (eval.py): a prediction file <dataset>.jsonl holds one object
 * per line in pred.py's format, {"pred", "answers", "all_classes",
 * "length"}.  A dataset's score is round(100 * total / n, 2) where total
 * adds the per-sample scores in file order; with LongBench-E (--e) it is
 * one such number per length bin (length < 4000, < 8000, the rest), each
 * round(100 * numpy.mean(bin), 2) -- numpy's pairwise summation, NaN for an
 * empty bin.  As in eval.py, the all_classes of the file's last line serve
 * every line.
 *
 * RULER (evaluate.py): a prediction file <task>.jsonl holds {"index",
 * "pred", "outputs", ...}; predictions are post-processed (strip, control
 * characters to newlines); the task's score is round(sum / n * 100, 2)
 * (summed in order, as CPython before 3.12's sum() does), and "nulls"
 * counts the empty predictions.
 *
 * Python's number formatting is reproduced too: kv_py_round2 is round(x, 2)
 * and kv_py_repr is repr(float), so printed scores read as eval.py's
 * result.json does.
 */
#ifndef KV_SCORE_H
#define KV_SCORE_H

#include <stdbool.h>
#include <stdio.h>

#include "common/kv_status.h"
#include "eval/kv_jieba.h"
#include "eval/kv_metrics.h"

// --- Python's numbers -----------------------------------------------------------

/* round(x, 2) */
double kv_py_round2(double x);
/* repr(x) for a finite x ("50.0", "33.33", "1e-05"); "NaN"/"inf" otherwise. */
void kv_py_repr(double x, char *buf, size_t cap);
/* A JSON number as Python's json module writes a float; null when not finite. */
void kv_json_pyfloat(FILE *f, double x);
/* A JSON string as json.dumps(s, ensure_ascii=False) writes it. */
void kv_json_pystring(FILE *f, const char *s);
/* numpy.mean(a): pairwise summation (8-way unrolled blocks of 128) / n. */
double kv_np_mean(const double *a, size_t n);

// --- LongBench ----------------------------------------------------------------------

/* LongBench-E's length bins. */
enum { KV_LB_BIN_0_4K = 0, KV_LB_BIN_4_8K, KV_LB_BIN_8K, KV_LB_NBINS };
extern const char *const kv_lb_bin_names[KV_LB_NBINS]; /* "0-4k", "4-8k", "8k+" */
int kv_lb_bin_of(long long length);

typedef struct {
    char *pred;
    char **answers; /* (n_answers) */
    int n_answers;
    char **classes; /* (n_classes) all_classes, when has_classes */
    int n_classes;
    bool has_classes;
    long long length;
    bool has_length;
    int line;
} kv_lb_pred;

typedef struct {
    kv_lb_pred *v; /* (n) */
    int n;
} kv_lb_preds;

/* pred.py-format lines; a bad line is KV_E_DATA "name:LINE: ...". */
kv_status kv_lb_preds_parse(const char *text, size_t len, const char *name, kv_lb_preds *out);
kv_status kv_lb_preds_load(const char *path, kv_lb_preds *out);
void kv_lb_preds_free(kv_lb_preds *p);

typedef struct {
    int n;
    double score;               /* eval.py's number (NaN when n == 0) */
    double bin[KV_LB_NBINS];    /* LongBench-E's numbers (NaN for an empty bin) */
    int bin_n[KV_LB_NBINS];
    double *sample;             /* (n) per-sample scores, when asked for */
} kv_lb_score;

/* The dataset's numbers from per-sample scores in file order; lengths may
 * be NULL without e. */
void kv_lb_aggregate(const double *sample, const long long *length, int n, bool e,
                     kv_lb_score *out);

/* Score a whole prediction set; keep_samples fills out->sample. */
kv_status kv_lb_score_preds(const kv_lb_dataset *d, const kv_jieba *jb, const kv_lb_preds *p,
                            bool e, bool keep_samples, kv_lb_score *out);
void kv_lb_score_free(kv_lb_score *s);

// --- RULER ------------------------------------------------------------------------------

typedef struct {
    char *pred;     /* as written (post-processing happens when scoring) */
    char **outputs; /* (n_outputs) */
    int n_outputs;
    long long index;
    int line;
} kv_ruler_pred;

typedef struct {
    kv_ruler_pred *v; /* (n) */
    int n;
} kv_ruler_preds;

kv_status kv_ruler_preds_parse(const char *text, size_t len, const char *name,
                               kv_ruler_preds *out);
kv_status kv_ruler_preds_load(const char *path, kv_ruler_preds *out);
void kv_ruler_preds_free(kv_ruler_preds *p);

/* round(sum(sample) / n * 100, 2); NaN when n == 0. */
double kv_ruler_aggregate(const double *sample, int n);

typedef struct {
    int n, nulls;   /* samples, empty predictions after post-processing */
    double score;
    double *sample; /* (n) when asked for */
} kv_ruler_score;

kv_status kv_ruler_score_preds(kv_ruler_metric m, const kv_ruler_preds *p, bool keep_samples,
                               kv_ruler_score *out);
void kv_ruler_score_free(kv_ruler_score *s);

#endif

// --- prediction files on the command line -------------------------------------------

/* One dataset or task: its name and the files whose lines make it. */
typedef struct {
    char *name;
    char **paths; /* (n_paths) read in this order */
    int n_paths;
} kv_score_input;

/*
 * Resolve operands (files and directories) to named inputs, sorted by name.
 * A file is named by its base name up to the first '.' (eval.py's
 * filename.split('.')[0]); a directory contributes its *.jsonl files.
 * With ruler_chunks, a directory's chunk files "<task>-<k>.jsonl" (RULER's
 * --chunk_amount output) make one input <task>, in file-name order, as
 * evaluate.py's aggregate_chunk joins them; *shadowed counts plain
 * <task>.jsonl files the chunks replace.  The same name twice is KV_E_USAGE.
 */
kv_status kv_score_collect(const char *const *operands, int n, bool ruler_chunks,
                           kv_score_input **out, int *n_out, int *shadowed);
void kv_score_inputs_free(kv_score_input *in, int n);
