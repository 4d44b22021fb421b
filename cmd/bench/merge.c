/*
 * kv-bench merge: the summary of a batch run from its results logs -- the
 * shards of one run (--shard 1/N .. N/N, all of them required) or the
 * pieces of a resumed one.  The summary is computed by the same code as
 * the run's own (lib/eval/kv_ruler, kv_longbench) from the records sorted
 * by (policy, file, line), so it is the summary one run over all samples
 * prints, number for number.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "eval/kv_batch.h"
#include "common/kv_outfile.h"
#include "eval/kv_chart.h"
#include "eval/kv_longbench.h"
#include "eval/kv_ruler.h"
#include "format/kvc.h"

int kv_bench_merge_main(int argc, char **argv);

enum { O_JSON = 256, O_PERTASK, O_PRED_DIR, O_SVG };

static const kv_option opts[] = {
    {O_JSON, 0, "json", NULL, "JSON even on a terminal"},
    {O_PERTASK, 0, "per-task", NULL, "include every sample's prediction in the JSON"},
    {O_PRED_DIR, 0, "pred-dir", "DIR", "also write the prediction files DIR/<policy>/<name>.jsonl"},
    {O_SVG, 0, "svg", "FILE", "also draw the charts of kv-bench report into FILE"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench merge", "[OPTIONS] LOG.jsonl...",
    "Combine the results logs of a batch run's shards into its summary.", opts,
    "Every log must come from the same run settings (model, files, mode, ...); shard\n"
    "logs must cover 1/N .. N/N.  A record present twice is counted once."};

int kv_bench_merge_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *a, *pred_dir = NULL, *svg = NULL;
    bool json = false, per = false;
    int oi;
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        switch (c) {
        case O_JSON: json = true; break;
        case O_PERTASK: per = true; break;
        case O_PRED_DIR: pred_dir = a; break;
        case O_SVG: svg = a; break;
        }
    }
    if (oi >= argc) kv_cli_usage_error("no results logs");
    cJSON *headers = NULL, *records = NULL;
    int torn = 0, dups = 0, rc = KV_EXIT_OK;
    kv_status st = kv_batch_read((const char *const *)argv + oi, argc - oi, &headers, &records,
                                 &torn, &dups);
    if (st) return kv_report(st, "merge");
    if (torn) kv_warn("%d torn last line(s) ignored (a run killed while writing)", torn);
    if (dups) kv_warn("%d record(s) found twice; counted once", dups);
    const char *bench = kv_rec_str(headers->child, "bench", "");
    bool want_json = kv_want_json(stdout, json);
    if (!strcmp(bench, "ruler")) {
        if (pred_dir) st = kv_ruler_write_preds(pred_dir, headers, records, NULL, 0);
        if (!st) st = kv_ruler_summary(stdout, want_json, headers, records, per);
    } else if (!strcmp(bench, "longbench")) {
        if (pred_dir) st = kv_lb_write_preds(pred_dir, headers, records);
        if (!st) st = kv_lb_summary(stdout, want_json, headers, records, per);
    } else {
        st = kv_fail(KV_E_DATA, "logs of an unknown benchmark \"%s\"", bench);
    }
    if (!st && svg) {
        kv_outfile o;
        if (!(st = kv_outfile_open(&o, svg))) {
            st = kv_chart_report(o.fp, headers, records);
            if (st) kv_outfile_abort(&o);
            else st = kv_outfile_commit(&o);
        }
    }
    if (st) rc = kv_report(st, "merge");
    else if (fflush(stdout) || ferror(stdout)) rc = kv_report(kv_fail(KV_E_IO, "write failed"), "stdout");
    cJSON_Delete(headers);
    cJSON_Delete(records);
    return rc;
}
