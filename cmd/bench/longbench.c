/*
 * kv-bench longbench: LongBench and LongBench-E as published, run under KV
 * policies the way LongBench's pred.py runs a model (lib/eval/kv_longbench)
 * and scored as its eval.py scores (lib/eval/kv_score): per policy and
 * dataset the official score, the KV bytes and the time per token; with
 * --pred-dir the prediction files in pred.py's format, which `kv-bench
 * score --longbench` (or eval.py itself) reads.  A batch (bench_batch.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_batch.h"
#include "kv_cli.h"
#include "engine/kv_engine.h"
#include "engine/kv_runner.h"
#include "eval/kv_compare.h"
#include "eval/kv_longbench.h"

int kv_bench_longbench_main(int argc, char **argv);

enum { O_MODEL = 'm', O_TOK = 't', O_PROMPTS = 256, O_MAXLEN, O_MAXLENGTH, O_MAXGEN, O_CHAT,
       O_MODE, O_LIMIT, O_E, O_JIEBA, O_JIEBA_DICT, O_PERSAMPLE, O_JSON, O_THREADS, O_DEVICE,
       O_SELECT };

static const kv_option opts[] = {
    {O_MODEL, 'm', "model", "FILE", "model (llama2.c checkpoint or GGUF)"},
    {O_TOK, 0, "tokenizer", "FILE", "llama2.c tokenizer.bin (GGUF models carry their own)"},
    {O_TOK, 't', NULL, "FILE", NULL}, /* deprecated: -t is --tokens elsewhere */
    {O_PROMPTS, 0, "prompts", "FILE", "prompt templates (LongBench's dataset2prompt.json format)"},
    {O_MAXLEN, 0, "maxlen", "FILE", "generation lengths (LongBench's dataset2maxlen.json format)"},
    BENCH_BATCH_OPTIONS,
    {O_MAXLENGTH, 0, "max-length", "N", "cut prompts over N tokens in the middle (default: context - max gen)"},
    {O_MAXGEN, 0, "max-gen", "N", "generate at most N tokens per sample whatever maxlen says"},
    {O_CHAT, 0, "chat", "TEMPLATE", "wrap prompts: llama3, chatml, auto or a text like '[INST]{prompt}[/INST]' (not few-shot/code sets)"},
    {O_MODE, 0, "mode", "MODE", "question (context dense, the rest decoded; default) or prefill"},
    {O_LIMIT, 0, "limit", "N", "the first N samples of each file"},
    {O_E, 0, "e", NULL, "score every file as LongBench-E (length bins); *_e.jsonl always are"},
    {O_JIEBA, 0, "jieba", "DIR", "jieba's data for the Chinese metrics (default " KV_JIEBA_DEFAULT_DIR ")"},
    {O_JIEBA_DICT, 0, "jieba-dict", "FILE", "another jieba dictionary instead of DIR/dict.txt"},
    {O_PERSAMPLE, 0, "per-sample", NULL, "include every sample's score and prediction in the JSON"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {O_THREADS, 'T', "threads", "N", "matmul threads (default: OpenMP's)"},
    {O_DEVICE, 0, "device", "DEV", "cpu, cuda[:N] or auto (default cpu; auto: the GPU when usable)"},
    {O_SELECT, 0, "select", "HOW", "GPU sparse layers: policy (default) or sketch (1-bit key sketch)"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench longbench",
    "--model FILE [--tokenizer FILE] --prompts FILE --maxlen FILE [-P SPEC]... DATA.jsonl...",
    "LongBench / LongBench-E predictions and official scores under each KV policy.", opts,
    "DATA files are LongBench's own, named <dataset>.jsonl (<dataset>_e.jsonl for\n"
    "LongBench-E).  As pred.py: prompt = template.format(**sample), cut in the middle to\n"
    "max-length tokens, greedy decoding for the dataset's generation length (samsum stops\n"
    "at a newline).  Scores are eval.py's: x100, rounded to 2 decimals (LongBench-E: per\n"
    "length bin).  Malformed samples and prompts over the context are skipped with a\n"
    "warning (--strict: exit 65)."};

static kv_status lb_preds(const char *dir, const cJSON *headers, cJSON *records, void *ctx)
{
    (void)ctx;
    return kv_lb_write_preds(dir, headers, records);
}

static kv_status lb_summary(FILE *f, bool json, const cJSON *headers, cJSON *records, bool per, void *ctx)
{
    (void)ctx;
    return kv_lb_summary(f, json, headers, records, per);
}

int kv_bench_longbench_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *model = NULL, *tokp = NULL, *prompts_path = NULL, *maxlen_path = NULL;
    const char *jdir = NULL, *jdict = NULL, *a;
    bool json = false, per = false, sketch = false, all_e = false;
    kv_device dev = KV_DEVICE_CPU;
    kv_gpu_engine_opts go;
    kv_gpu_engine_opts_default(&go);
    kv_lb_opts lo = {0, 0, {KV_CHAT_NONE, NULL}, KV_NIAH_QUESTION, 0, 1, 1, false};
    bench_batch bb;
    bench_batch_init(&bb);
    int oi;
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        if (bench_batch_option(&bb, c, a)) continue;
        switch (c) {
        case O_MODEL: model = a; break;
        case O_TOK: tokp = a; break;
        case O_PROMPTS: prompts_path = a; break;
        case O_MAXLEN: maxlen_path = a; break;
        case O_MAXLENGTH: lo.max_length = (int)kv_cli_long("--max-length", a, 2, 1 << 30); break;
        case O_MAXGEN: lo.max_gen = (int)kv_cli_long("--max-gen", a, 1, 65536); break;
        case O_CHAT:
            if (kv_chat_parse(a, &lo.chat))
                kv_cli_usage_error("--chat must be llama3, chatml, auto, none or a template holding \"{prompt}\"");
            break;
        case O_MODE:
            if (!strcmp(a, "question")) lo.mode = KV_NIAH_QUESTION;
            else if (!strcmp(a, "prefill")) lo.mode = KV_NIAH_PREFILL;
            else kv_cli_usage_error("--mode: '%s' (question or prefill)", a);
            break;
        case O_LIMIT: lo.limit = (int)kv_cli_long("--limit", a, 1, 1 << 30); break;
        case O_E: all_e = true; break;
        case O_JIEBA: jdir = a; break;
        case O_JIEBA_DICT: jdict = a; break;
        case O_PERSAMPLE: per = true; break;
        case O_JSON: json = true; break;
        case O_THREADS: kv_engine_set_threads((int)kv_cli_long("--threads", a, 1, 1024)); break;
        case O_DEVICE:
            dev = kv_cli_device(a, &go.device);
            break;
        case O_SELECT:
            if (!strcmp(a, "sketch")) sketch = true;
            else if (strcmp(a, "policy")) kv_cli_usage_error("--select must be policy or sketch");
            break;
        }
    }
    if (!model) kv_cli_usage_error("--model is required");
    if (!prompts_path || !maxlen_path) kv_cli_usage_error("--prompts and --maxlen are required");
    if (oi >= argc) kv_cli_usage_error("no LongBench data files");
    bench_batch_check(&bb);
    lo.shard_i = bb.shard_i;
    lo.shard_n = bb.shard_n;
    lo.strict = bb.strict;

    int rc = KV_EXIT_OK, nf = 0;
    const int nfiles = argc - oi;
    kv_lb_file *files = calloc((size_t)nfiles, sizeof *files);
    kv_lb_table prompts = {0}, maxlen = {0};
    kv_jieba *jb = NULL;
    bench_batch_run br;
    bench_batch_run_init(&br);
    kv_status st;
    if (!files) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "data");
        goto out;
    }
    if ((st = kv_lb_table_load(prompts_path, true, &prompts))) {
        rc = kv_report(st, "--prompts %s", prompts_path);
        goto out;
    }
    if ((st = kv_lb_table_load(maxlen_path, false, &maxlen))) {
        rc = kv_report(st, "--maxlen %s", maxlen_path);
        goto out;
    }
    bool need_jieba = false;
    for (int i = 0; i < nfiles; i++) {
        if ((st = kv_lb_file_load(argv[oi + i], &files[i]))) {
            rc = kv_report(st, "%s", argv[oi + i]);
            goto out;
        }
        nf = i + 1;
        kv_lb_file *f = &files[i];
        f->e |= all_e;
        for (int k = 0; k < i; k++)
            if (!strcmp(files[k].stem, f->stem)) {
                rc = kv_report(kv_fail(KV_E_USAGE, "given twice"), "%s", f->path);
                goto out;
            }
        if (kv_lb_table_find(&prompts, f->dataset) < 0 || kv_lb_table_find(&maxlen, f->dataset) < 0) {
            rc = kv_report(kv_fail(KV_E_DATA, "%s has no entry for \"%s\"",
                                   kv_lb_table_find(&prompts, f->dataset) < 0 ? prompts_path : maxlen_path,
                                   f->dataset), "%s", f->path);
            goto out;
        }
        if (f->n == 0) {
            rc = kv_report(kv_fail(KV_E_DATA, "%s:%d: %s", f->path, f->bad[0].line, f->bad[0].why),
                           "no usable sample");
            goto out;
        }
        need_jieba |= kv_lb_metric_needs_jieba(f->ds->metric);
    }
    if ((rc = bench_batch_precheck(&bb))) goto out;
    if (need_jieba && (st = kv_jieba_open(jdir, jdict, &jb))) {
        rc = kv_report(st, "jieba");
        goto out;
    }
    if ((st = kv_compare_open_model(model, tokp, &br.m, &br.tok))) {
        rc = kv_report(st, "%s", model);
        goto out;
    }
    if ((st = kv_chat_resolve(&lo.chat, br.tok, br.m->cfg.arch))) {
        rc = kv_report(st, "--chat auto");
        goto out;
    }
    if ((rc = bench_batch_engine(&bb, br.m, sketch, dev, &go, &br.pols, &br.prm, &br.np, &br.e))) goto out;
    br.header = kv_lb_header(model, tokp, kv_runner_is_gpu(br.e) ? "cuda" : "cpu",
                             kv_runner_device(br.e), files, nf, &prompts, &maxlen, &lo);
    if (!br.header) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "header");
        goto out;
    }
    if ((rc = bench_batch_open(&bb, br.header, br.pols, br.np, &br.log, &br.records, &br.done))) goto out;
    st = kv_lb_batch(br.e, br.tok, jb, files, nf, &prompts, &maxlen, br.pols, br.np, &lo, br.log, br.done,
                     br.records, &br.hooks);
    rc = bench_batch_finish(&bb, "longbench", st, &br.log, br.header, br.records, json, per,
                            &(bench_batch_out){lb_preds, lb_summary, NULL});
out:
    bench_batch_run_free(&br);
    kv_jieba_free(jb);
    kv_lb_table_free(&prompts);
    kv_lb_table_free(&maxlen);
    for (int i = 0; i < nf; i++) kv_lb_file_free(&files[i]);
    free(files);
    return rc;
}
