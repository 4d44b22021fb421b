/*
 * kv-bench ruler: needle and RULER accuracy of KV policies on RULER JSONL
 * task files (lib/eval/kv_niah, kv_ruler), per policy, task and length,
 * with the bytes each policy keeps resident, keeps in host memory and
 * fetches per decode step, on the CPU engine or the GPU engine (--device,
 * through lib/engine/kv_runner).  A batch (bench_batch.h): --output,
 * --resume, --shard, --strict, --pred-dir.  A table on a terminal, JSON
 * when piped or with --json.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_batch.h"
#include "kv_cli.h"
#include "engine/kv_engine.h"
#include "engine/kv_runner.h"
#include "eval/kv_compare.h"
#include "eval/kv_gpu_bench.h"
#include "eval/kv_ruler.h"
#include "model/kv_tokenizer.h"

int kv_bench_ruler_main(int argc, char **argv);

/* getopt returns the short letter for a short option: ids of options with
 * one are that letter */
enum { O_MODEL = 'm', O_TOK = 't', O_LENGTH = 'l', O_TASKS = 256, O_LIMIT, O_MODE, O_GEN,
       O_METRIC, O_PERTASK, O_JSON, O_THREADS, O_DEVICE, O_SELECT, O_GPUSTEP };

static const kv_option opts[] = {
    {O_MODEL, 'm', "model", "FILE", "model (llama2.c checkpoint or GGUF)"},
    {O_TOK, 0, "tokenizer", "FILE", "llama2.c tokenizer.bin (GGUF models carry their own)"},
    {O_TOK, 't', NULL, "FILE", NULL}, /* deprecated: -t is --tokens elsewhere */
    {O_TASKS, 0, "tasks", "FILE|-", "RULER JSONL tasks, repeatable (one file per task)"},
    BENCH_BATCH_OPTIONS,
    {O_LENGTH, 'l', "length", "N", "only tasks of this length, repeatable (default: all)"},
    {O_LIMIT, 0, "limit", "N", "at most N tasks per length and file (default: all)"},
    {O_MODE, 0, "mode", "MODE", "question (haystack dense, question decoded; default) or prefill"},
    {O_GEN, 0, "gen", "N", "tokens generated per task (default: RULER's per task, else 7)"},
    {O_METRIC, 0, "metric", "M", "all or part for every file (default: by task name)"},
    {O_PERTASK, 0, "per-task", NULL, "include every task's prediction in the JSON"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {O_THREADS, 'T', "threads", "N", "matmul threads (default: OpenMP's)"},
    {O_DEVICE, 0, "device", "DEV", "cpu, cuda[:N] or auto (default cpu; auto: the GPU when usable)"},
    {O_SELECT, 0, "select", "HOW", "GPU sparse layers: policy (default) or sketch (1-bit key sketch)"},
    {O_GPUSTEP, 0, "gpu-step", "HOW", "GPU sparse layers' step: base (default) or words of serial, "
                                     "wide, cache, classic, ahead2, chainN, gatherN, late, early, nopdl, collect, direct, hist, everyN "
                                     "joined by '+' (as kv-bench decode --variants)"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench ruler", "--model FILE [--tokenizer FILE] --tasks FILE... [-P SPEC]...",
    "Needle/RULER accuracy and KV bytes of each policy on RULER JSONL tasks.", opts,
    "The prompt is input + answer_prefix, as RULER sends it.  Modes: 'question' prefills\n"
    "the haystack densely and decodes the question and answer through the policy (the\n"
    "question starts at the last \"\\nQuestion:\", or in RULER's own files at the input's\n"
    "last line; a task without one runs in prefill mode, counted in \"modes\");\n"
    "'prefill' prefills the whole prompt densely.  Each file is a task named by its base\n"
    "name (data/<task>/validation.jsonl by its folder) and scored with RULER's metric:\n"
    "string_match_part for qa_*, string_match_all for the rest.  Malformed lines and\n"
    "prompts longer than the context are skipped with a warning (--strict: exit 65).\n"
    "On the GPU (--device cuda) every policy runs on the GPU engine (fp16 weights and KV)."};

typedef struct {
    const kv_ruler_file *files;
    int nf;
} ruler_files;

static kv_status ruler_preds(const char *dir, const cJSON *headers, cJSON *records, void *ctx)
{
    const ruler_files *rf = ctx;
    return kv_ruler_write_preds(dir, headers, records, rf->files, rf->nf);
}

static kv_status ruler_summary(FILE *f, bool json, const cJSON *headers, cJSON *records, bool per, void *ctx)
{
    (void)ctx;
    return kv_ruler_summary(f, json, headers, records, per);
}

int kv_bench_ruler_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *model = NULL, *tokp = NULL, *tasks[64], *a;
    int ntasks = 0, lens[16], nlen = 0, limit = 0, gen = 0, oi;
    bool json = false, per_task = false, sketch = false, have_metric = false;
    kv_ruler_metric metric = KV_RULER_MATCH_ALL;
    kv_niah_mode mode = KV_NIAH_QUESTION;
    kv_device dev = KV_DEVICE_CPU;
    kv_gpu_engine_opts go;
    kv_gpu_engine_opts_default(&go);
    bench_batch bb;
    bench_batch_init(&bb);
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        if (bench_batch_option(&bb, c, a)) continue;
        switch (c) {
        case O_MODEL: model = a; break;
        case O_TOK: tokp = a; break;
        case O_TASKS:
            if (ntasks == 64) kv_cli_usage_error("at most 64 task files");
            tasks[ntasks++] = a;
            break;
        case O_LENGTH:
            if (nlen == 16) kv_cli_usage_error("at most 16 lengths");
            lens[nlen++] = (int)kv_cli_long("--length", a, 1, 1 << 30);
            break;
        case O_LIMIT: limit = (int)kv_cli_long("--limit", a, 1, 1 << 30); break;
        case O_MODE:
            if (!strcmp(a, "question")) mode = KV_NIAH_QUESTION;
            else if (!strcmp(a, "prefill")) mode = KV_NIAH_PREFILL;
            else kv_cli_usage_error("--mode: '%s' (question or prefill)", a);
            break;
        case O_GEN: gen = (int)kv_cli_long("--gen", a, 1, 4096); break;
        case O_METRIC:
            if (kv_ruler_metric_parse(a, &metric)) kv_cli_usage_error("--metric must be all or part");
            have_metric = true;
            break;
        case O_PERTASK: per_task = true; break;
        case O_JSON: json = true; break;
        case O_THREADS: kv_engine_set_threads((int)kv_cli_long("--threads", a, 1, 1024)); break;
        case O_DEVICE:
            dev = kv_cli_device(a, &go.device);
            break;
        case O_GPUSTEP: {
            kv_decode_variant v;
            if (kv_decode_variant_parse(a, &v) != KV_OK) kv_cli_usage_error("--gpu-step: %s", kv_errdetail());
            kv_decode_variant_apply(&v, &go);
            break;
        }
        case O_SELECT:
            if (!strcmp(a, "sketch")) sketch = true;
            else if (strcmp(a, "policy")) kv_cli_usage_error("--select must be policy or sketch");
            break;
        }
    }
    if (oi < argc) kv_cli_usage_error("unexpected operand '%s'", argv[oi]);
    if (!model) kv_cli_usage_error("--model is required");
    if (!ntasks) kv_cli_usage_error("--tasks is required");
    bench_batch_check(&bb);

    int rc = KV_EXIT_OK, nf = 0;
    kv_ruler_file *files = calloc((size_t)ntasks, sizeof *files);
    bench_batch_run br;
    bench_batch_run_init(&br);
    kv_status st;
    if (!files) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "tasks");
        goto out;
    }
    for (; nf < ntasks; nf++)
        if ((st = kv_ruler_file_open(tasks[nf], have_metric ? &metric : NULL, gen, &files[nf]))) {
            rc = kv_report(st, "%s", tasks[nf]);
            goto out;
        }
    /* nothing to run at all is an error, named by the first bad line */
    int valid = 0;
    for (int i = 0; i < nf; i++) valid += files[i].set.n;
    for (int i = 0; i < nf && !valid; i++)
        if (files[i].set.n_bad) {
            rc = kv_report(kv_fail(KV_E_DATA, "%s:%d: %s", tasks[i], files[i].set.bad[0].line,
                                   files[i].set.bad[0].why), "no usable task");
            goto out;
        }
    /* policy specs are checked before the model loads: a typo costs nothing */
    if ((rc = bench_batch_precheck(&bb))) goto out;
    if ((st = kv_compare_open_model(model, tokp, &br.m, &br.tok))) {
        rc = kv_report(st, "%s", model);
        goto out;
    }
    if ((rc = bench_batch_engine(&bb, br.m, sketch, dev, &go, &br.pols, &br.prm, &br.np, &br.e))) goto out;
    kv_ruler_opts ro = {mode, lens, nlen, limit, bb.shard_i, bb.shard_n, bb.strict};
    br.header = kv_ruler_header(model, tokp, kv_runner_is_gpu(br.e) ? "cuda" : "cpu",
                                kv_runner_device(br.e), files, nf, &ro);
    kv_prefill_info pfi; /* how the prompts are prefilled (not part of the config a resume checks) */
    kv_runner_prefill_info(br.e, &pfi);
    if (br.header) cJSON_AddItemToObject(br.header, "prefill", kv_prefill_info_json(&pfi));
    if (!br.header) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "header");
        goto out;
    }
    if ((rc = bench_batch_open(&bb, br.header, br.pols, br.np, &br.log, &br.records, &br.done))) goto out;
    st = kv_ruler_batch(br.e, br.tok, files, nf, br.pols, br.np, &ro, br.log, br.done, br.records, &br.hooks);
    rc = bench_batch_finish(&bb, "ruler", st, &br.log, br.header, br.records, json, per_task,
                            &(bench_batch_out){ruler_preds, ruler_summary, &(ruler_files){files, nf}});
out:
    bench_batch_run_free(&br);
    for (int i = 0; i < nf; i++) kv_ruler_file_close(&files[i]);
    free(files);
    return rc;
}
