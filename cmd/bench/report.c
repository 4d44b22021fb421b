/*
 * kv-bench report: SVG charts from batch results logs (--output of
 * kv-bench ruler or longbench; shards are merged as kv-bench merge does):
 * accuracy per policy and length, accuracy against the KV bytes each
 * policy keeps, and the decode time per token against length
 * (lib/eval/kv_chart).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "eval/kv_batch.h"
#include "common/kv_outfile.h"
#include "eval/kv_chart.h"
#include "format/kvc.h"

int kv_bench_report_main(int argc, char **argv);

enum { O_OUT = 'o' };

static const kv_option opts[] = {
    {O_OUT, 'o', "output", "FILE.svg", "write the SVG here (default: standard output)"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench report", "[-o FILE.svg] LOG.jsonl...",
    "SVG charts from kv-bench ruler/longbench results logs.", opts,
    "Three panels: accuracy per policy and length (RULER: task length; LongBench: the\n"
    "LongBench-E length bins), accuracy against resident KV bytes, and ms per decoded\n"
    "token against length.  The logs are read as kv-bench merge reads them."};

int kv_bench_report_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *a, *out = "-";
    int oi;
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;)
        if (c == O_OUT) out = a;
    if (oi >= argc) kv_cli_usage_error("no results logs");
    cJSON *headers = NULL, *records = NULL;
    int torn = 0, dups = 0;
    kv_status st = kv_batch_read((const char *const *)argv + oi, argc - oi, &headers, &records,
                                 &torn, &dups);
    if (st) return kv_report(st, "report");
    if (torn) kv_warn("%d torn last line(s) ignored", torn);
    kv_outfile o;
    if ((st = kv_outfile_open(&o, out))) {
        cJSON_Delete(headers);
        cJSON_Delete(records);
        return kv_report(st, "%s", out);
    }
    st = kv_chart_report(o.fp, headers, records);
    if (st) kv_outfile_abort(&o);
    else st = kv_outfile_commit(&o);
    cJSON_Delete(headers);
    cJSON_Delete(records);
    return st ? kv_report(st, "report") : KV_EXIT_OK;
}
