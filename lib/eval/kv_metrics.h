/*
 * kv_metrics: the per-sample metrics of LongBench (THUDM/LongBench,
 * LongBench/metrics.py and eval.py) and RULER (NVIDIA/RULER,
 * scripts/eval/synthetic/constants.py), computed as the official Python
 * computes them, down to the floating-point operations and their order:
 *
 *   qa_f1_score          lower-case, drop ASCII punctuation, replace the
 *                        words a/an/the (regex \b(a|an|the)\b, Unicode \b)
 *                        by a space, split on whitespace, token F1 over
 *                        the multiset intersection
 *   qa_f1_zh_score       jieba tokens, each lower-cased with ASCII and
 *                        Chinese punctuation and all whitespace removed,
 *                        empty ones dropped, token F1
 *   rouge_score          the `rouge` package (1.0.1): sentences split on
 *                        '.', words on ' ', ROUGE-L "f" from the union of
 *                        the word sets of each sentence pair's LCS; any
 *                        exception is 0.0 -- an empty hypothesis or
 *                        reference, and an LCS walk deeper than CPython's
 *                        default recursion limit allows (KV_ROUGE_MAX_STEPS)
 *   rouge_zh_score       both sides jieba-cut and joined by spaces first
 *   classification_score the classes found in the prediction, minus those
 *                        inside the answer (Python's remove-while-iterating
 *                        skips included), 1/len when the answer is left
 *   retrieval_score      share of the numbers in the prediction equal to
 *   retrieval_zh_score   the answer's "Paragraph N" / "段落N"
 *   count_score          share of the numbers equal to the answer
 *   code_sim_score       fuzz.ratio(first line without ` # or //, answer)/100
 *
 * Every text is UTF-8; invalid UTF-8 is KV_E_DATA.  Chinese metrics need a
 * loaded kv_jieba.
 */
#ifndef KV_METRICS_H
#define KV_METRICS_H

#include <stdbool.h>

#include "common/kv_status.h"
#include "eval/kv_jieba.h"

/* _recon frames the rouge package can add before CPython's default
 * recursion limit (1000) stops it, when called as `python eval.py` does:
 * eval.py's module, scorer, rouge_score, get_scores, _get_avg_scores, the
 * metric lambda, rouge_l_summary_level, _union_lcs and _recon_lcs take 9
 * frames, rouge_zh_score one more.  A walk of more steps raises
 * RecursionError, which rouge_score turns into 0.0. */
#define KV_ROUGE_MAX_STEPS 990

typedef enum {
    KV_LB_QA_F1 = 0,
    KV_LB_QA_F1_ZH,
    KV_LB_ROUGE,
    KV_LB_ROUGE_ZH,
    KV_LB_CLASSIFICATION,
    KV_LB_RETRIEVAL,
    KV_LB_RETRIEVAL_ZH,
    KV_LB_COUNT,
    KV_LB_CODE_SIM,
    KV_LB_METRIC_COUNT
} kv_lb_metric;

typedef struct {
    const char *name;   /* "hotpotqa" */
    kv_lb_metric metric;
    bool first_line;    /* eval.py keeps the prediction's first line */
    bool chat;          /* pred.py applies a chat template (not for the 6 few-shot/code sets) */
    bool stop_newline;  /* pred.py also stops at "\n" (samsum) */
} kv_lb_dataset;

/* The 21 LongBench datasets, in eval.py's order. */
extern const kv_lb_dataset kv_lb_datasets[];
extern const int kv_lb_n_datasets;
/* By name; NULL when unknown. */
const kv_lb_dataset *kv_lb_dataset_find(const char *name);
const char *kv_lb_metric_name(kv_lb_metric m); /* "qa_f1_score", ... */
bool kv_lb_metric_needs_jieba(kv_lb_metric m);

/*
 * One prediction against one answer: *out in [0, 1].  classes (n_classes)
 * are all_classes (classification only; has_classes false is Python's
 * None, which classification_score cannot iterate: KV_E_DATA).  A
 * retrieval answer without its paragraph number is KV_E_DATA (eval.py
 * fails on it with an IndexError).
 */
kv_status kv_lb_metric_score(kv_lb_metric m, const kv_jieba *jb, const char *pred, const char *gt,
                             const char *const *classes, int n_classes, bool has_classes,
                             double *out);

/* eval.py's per-sample score: the first line for trec/triviaqa/samsum/lsht,
 * then the best over the answers (0 when there are none). */
kv_status kv_lb_sample_score(const kv_lb_dataset *d, const kv_jieba *jb, const char *pred,
                             const char *const *answers, int n_answers,
                             const char *const *classes, int n_classes, bool has_classes,
                             double *out);

// --- RULER -------------------------------------------------------------------

typedef enum { KV_RULER_MATCH_ALL = 0, KV_RULER_MATCH_PART } kv_ruler_metric;

const char *kv_ruler_metric_name(kv_ruler_metric m); /* "string_match_all", ... */
kv_status kv_ruler_metric_parse(const char *s, kv_ruler_metric *out); /* all|part or the full name */
/* The metric of a RULER task name (synthetic.yaml): qa_* string_match_part,
 * niah_*, vt, cwe, fwe (and anything else) string_match_all; *known says
 * whether the name is one of the 13 published tasks. */
kv_ruler_metric kv_ruler_task_metric(const char *task, bool *known);

/* evaluate.py's postprocess_pred: strip, control characters to "\n",
 * strip again.  Returns a malloc'd string or NULL (no memory). */
char *kv_ruler_postprocess(const char *pred);
/* One sample: the share (all) or the best (part) of refs found in pred,
 * both lower-cased as Python does; pred already post-processed. */
kv_status kv_ruler_sample_score(kv_ruler_metric m, const char *pred, const char *const *refs,
                                int n_refs, double *out);

#endif
