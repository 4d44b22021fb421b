/*
 * kv-bench score: score prediction files as the official evaluation code
 * does, without a model -- LongBench's eval.py (--longbench, --e for
 * LongBench-E's length bins) or RULER's evaluate.py (--ruler).  The
 * metrics are lib/eval/kv_metrics, the files and numbers lib/eval/kv_score.
 * JSON when piped or with --json, a table on a terminal.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "eval/kv_jieba.h"
#include "eval/kv_metrics.h"
#include "eval/kv_score.h"

int kv_bench_score_main(int argc, char **argv);

enum { O_LONGBENCH = 256, O_RULER, O_E, O_PERSAMPLE, O_METRIC, O_JIEBA, O_JIEBA_DICT, O_JSON };

static const kv_option opts[] = {
    {O_LONGBENCH, 0, "longbench", NULL, "score LongBench predictions (pred.py's <dataset>.jsonl)"},
    {O_RULER, 0, "ruler", NULL, "score RULER predictions (<task>.jsonl with pred and outputs)"},
    {O_E, 0, "e", NULL, "LongBench-E: scores per length bin (0-4k, 4-8k, 8k+)"},
    {O_PERSAMPLE, 0, "per-sample", NULL, "add every sample's score to the JSON"},
    {O_METRIC, 0, "metric", "M", "RULER: all or part for every task (default: by task name)"},
    {O_JIEBA, 0, "jieba", "DIR", "jieba's data (dict.txt, finalseg/) (default " KV_JIEBA_DEFAULT_DIR ")"},
    {O_JIEBA_DICT, 0, "jieba-dict", "FILE", "another jieba dictionary instead of DIR/dict.txt"},
    {O_JSON, 0, "json", NULL, "JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench score", "(--longbench [--e] | --ruler) [OPTIONS] DIR|FILE...",
    "Score benchmark predictions exactly as LongBench's eval.py or RULER's evaluate.py.", opts,
    "A FILE is named by its base name up to the first '.': <dataset>.jsonl for LongBench,\n"
    "<task>.jsonl for RULER; a DIR contributes every *.jsonl in it (RULER chunk files\n"
    "<task>-<k>.jsonl are joined as evaluate.py does).  The JSON's \"datasets\" (LongBench)\n"
    "or \"tasks\" (RULER) object maps each name to its score: x100, rounded to 2 decimals.\n"
    "The Chinese LongBench metrics segment words with jieba's dictionary (python3-jieba)."};

/* Entry i of "per_sample": "name": [the n scores], as Python prints them. */
static void print_samples(FILE *f, int i, const char *name, const double *sample, int n)
{
    fprintf(f, "%s\n  ", i ? "," : "");
    kv_json_pystring(f, name);
    fputs(": [", f);
    for (int k = 0; k < n; k++) {
        fputs(k ? ", " : "", f);
        kv_json_pyfloat(f, sample[k]);
    }
    fputc(']', f);
}

static void print_lb(FILE *f, bool json, bool e, bool per, const kv_score_input *in, int n,
                     const kv_lb_score *sc)
{
    if (json) {
        fprintf(f, "{\"tool\": \"kv-bench score\", \"benchmark\": \"longbench\", \"e\": %s, "
                   "\"datasets\": {", e ? "true" : "false");
        for (int i = 0; i < n; i++) {
            fprintf(f, "%s\n  ", i ? "," : "");
            kv_json_pystring(f, in[i].name);
            fputs(": ", f);
            if (!e) {
                kv_json_pyfloat(f, sc[i].score);
                continue;
            }
            fputc('{', f);
            for (int b = 0; b < KV_LB_NBINS; b++) {
                fprintf(f, "%s\"%s\": ", b ? ", " : "", kv_lb_bin_names[b]);
                kv_json_pyfloat(f, sc[i].bin[b]);
            }
            fputc('}', f);
        }
        fputs("\n}, \"samples\": {", f);
        for (int i = 0; i < n; i++) {
            fprintf(f, "%s", i ? ", " : "");
            kv_json_pystring(f, in[i].name);
            fprintf(f, ": %d", sc[i].n);
        }
        fputc('}', f);
        if (per) {
            fputs(", \"per_sample\": {", f);
            for (int i = 0; i < n; i++) print_samples(f, i, in[i].name, sc[i].sample, sc[i].n);
            fputs("\n}", f);
        }
        fputs("}\n", f);
        return;
    }
    if (e) fprintf(f, "%-22s %-22s %6s %8s %8s %8s\n", "dataset", "metric", "n", "0-4k", "4-8k", "8k+");
    else fprintf(f, "%-22s %-22s %6s %8s\n", "dataset", "metric", "n", "score");
    for (int i = 0; i < n; i++) {
        const kv_lb_dataset *d = kv_lb_dataset_find(in[i].name);
        fprintf(f, "%-22s %-22s %6d", in[i].name, kv_lb_metric_name(d->metric), sc[i].n);
        for (int b = 0; b < (e ? KV_LB_NBINS : 1); b++) {
            double v = e ? sc[i].bin[b] : sc[i].score;
            if (isfinite(v)) fprintf(f, " %8.2f", v);
            else fprintf(f, " %8s", "-");
        }
        fputc('\n', f);
    }
}

static void print_ruler(FILE *f, bool json, bool per, const kv_score_input *in, int n,
                        const kv_ruler_score *sc, const kv_ruler_metric *met)
{
    if (!json) {
        fprintf(f, "%-22s %-18s %6s %8s %10s\n", "task", "metric", "n", "score", "nulls");
        for (int i = 0; i < n; i++)
            fprintf(f, "%-22s %-18s %6d %8.2f %5d/%-5d\n", in[i].name, kv_ruler_metric_name(met[i]),
                    sc[i].n, sc[i].score, sc[i].nulls, sc[i].n);
        return;
    }
    fputs("{\"tool\": \"kv-bench score\", \"benchmark\": \"ruler\", \"tasks\": {", f);
    for (int i = 0; i < n; i++) {
        fprintf(f, "%s\n  ", i ? "," : "");
        kv_json_pystring(f, in[i].name);
        fputs(": ", f);
        kv_json_pyfloat(f, sc[i].score);
    }
    fputs("\n}, \"nulls\": {", f);
    for (int i = 0; i < n; i++) {
        fputs(i ? ", " : "", f);
        kv_json_pystring(f, in[i].name);
        fprintf(f, ": \"%d/%d\"", sc[i].nulls, sc[i].n);
    }
    fputs("}, \"metrics\": {", f);
    for (int i = 0; i < n; i++) {
        fputs(i ? ", " : "", f);
        kv_json_pystring(f, in[i].name);
        fprintf(f, ": \"%s\"", kv_ruler_metric_name(met[i]));
    }
    fputc('}', f);
    if (per) {
        fputs(", \"per_sample\": {", f);
        for (int i = 0; i < n; i++) print_samples(f, i, in[i].name, sc[i].sample, sc[i].n);
        fputs("\n}", f);
    }
    fputs("}\n", f);
}

/* Every file of one input, joined (RULER chunks) or the one file. */
static kv_status load_lb(const kv_score_input *in, kv_lb_preds *p)
{
    return kv_lb_preds_load(in->paths[0], p);
}

static kv_status load_ruler(const kv_score_input *in, kv_ruler_preds *p)
{
    kv_status st = kv_ruler_preds_load(in->paths[0], p);
    for (int k = 1; k < in->n_paths && !st; k++) {
        kv_ruler_preds more;
        if ((st = kv_ruler_preds_load(in->paths[k], &more))) break;
        if (more.n == 0) continue;
        kv_ruler_pred *nv = realloc(p->v, ((size_t)p->n + (size_t)more.n + 1) * sizeof *nv);
        if (!nv) {
            kv_ruler_preds_free(&more);
            st = kv_fail(KV_E_NOMEM, "predictions");
            break;
        }
        p->v = nv;
        memcpy(p->v + p->n, more.v, (size_t)more.n * sizeof *more.v);
        p->n += more.n;
        free(more.v);
    }
    return st;
}

int kv_bench_score_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *a, *jdir = NULL, *jdict = NULL;
    bool lb = false, ruler = false, e = false, per = false, json = false, have_metric = false;
    kv_ruler_metric metric = KV_RULER_MATCH_ALL;
    int oi;
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        switch (c) {
        case O_LONGBENCH: lb = true; break;
        case O_RULER: ruler = true; break;
        case O_E: e = true; break;
        case O_PERSAMPLE: per = true; break;
        case O_METRIC:
            if (kv_ruler_metric_parse(a, &metric)) kv_cli_usage_error("--metric must be all or part");
            have_metric = true;
            break;
        case O_JIEBA: jdir = a; break;
        case O_JIEBA_DICT: jdict = a; break;
        case O_JSON: json = true; break;
        }
    }
    if (lb == ruler) kv_cli_usage_error("give one of --longbench and --ruler");
    if (e && !lb) kv_cli_usage_error("--e is for --longbench");
    if (have_metric && !ruler) kv_cli_usage_error("--metric is for --ruler");
    if (oi >= argc) kv_cli_usage_error("no prediction files or directories");

    int rc = KV_EXIT_OK, n = 0, shadowed = 0;
    kv_score_input *in = NULL;
    kv_jieba *jb = NULL;
    kv_lb_score *lsc = NULL;
    kv_ruler_score *rsc = NULL;
    kv_ruler_metric *met = NULL;
    kv_status st = kv_score_collect((const char *const *)argv + oi, argc - oi, ruler, &in, &n,
                                    &shadowed);
    if (st) {
        rc = kv_report(st, "predictions");
        goto out;
    }
    if (shadowed) kv_warn("%d plain task file(s) replaced by their chunk files, as evaluate.py does", shadowed);
    lsc = calloc((size_t)n, sizeof *lsc);
    rsc = calloc((size_t)n, sizeof *rsc);
    met = calloc((size_t)n, sizeof *met);
    if (!lsc || !rsc || !met) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "scores");
        goto out;
    }
    for (int i = 0; i < n && lb; i++) { /* names first: a typo costs no loading */
        const kv_lb_dataset *d = kv_lb_dataset_find(in[i].name);
        if (!d) {
            rc = kv_report(kv_fail(KV_E_DATA, "not one of LongBench's 21 datasets"), "%s",
                           in[i].paths[0]);
            goto out;
        }
        if (kv_lb_metric_needs_jieba(d->metric) && !jb && (st = kv_jieba_open(jdir, jdict, &jb))) {
            rc = kv_report(st, "jieba");
            goto out;
        }
    }
    for (int i = 0; i < n; i++) {
        kv_progress("scoring %s (%d/%d)", in[i].name, i + 1, n);
        if (lb) {
            kv_lb_preds p;
            if ((st = load_lb(&in[i], &p))) {
                rc = kv_report(st, "%s", in[i].name);
                goto out;
            }
            st = kv_lb_score_preds(kv_lb_dataset_find(in[i].name), jb, &p, e, per, &lsc[i]);
            kv_lb_preds_free(&p);
        } else {
            kv_ruler_preds p;
            bool known = true;
            met[i] = have_metric ? metric : kv_ruler_task_metric(in[i].name, &known);
            if (!known) kv_note(1, "%s: not a published RULER task; scored with %s", in[i].name,
                                kv_ruler_metric_name(met[i]));
            if ((st = load_ruler(&in[i], &p))) {
                rc = kv_report(st, "%s", in[i].name);
                goto out;
            }
            st = kv_ruler_score_preds(met[i], &p, per, &rsc[i]);
            kv_ruler_preds_free(&p);
        }
        if (st) {
            rc = kv_report(st, "%s", in[i].paths[0]);
            goto out;
        }
    }
    kv_progress_done();
    if (lb) print_lb(stdout, kv_want_json(stdout, json), e, per, in, n, lsc);
    else print_ruler(stdout, kv_want_json(stdout, json), per, in, n, rsc, met);
    if (fflush(stdout) || ferror(stdout)) rc = kv_report(kv_fail(KV_E_IO, "write failed"), "stdout");
out:
    for (int i = 0; i < n; i++) {
        if (lsc) kv_lb_score_free(&lsc[i]);
        if (rsc) kv_ruler_score_free(&rsc[i]);
    }
    free(met);
    free(rsc);
    free(lsc);
    kv_jieba_free(jb);
    kv_score_inputs_free(in, n);
    return rc;
}
