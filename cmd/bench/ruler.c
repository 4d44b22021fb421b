/*
 * kv-bench ruler: needle-retrieval accuracy of KV policies on RULER JSONL
 * tasks (lib/kv_niah), per policy and per task length, with the bytes each
 * policy keeps resident, keeps in host memory and fetches per decode step,
 * on the CPU engine or the GPU engine (--device, through lib/kv_runner).
 * A table on a terminal, JSON when piped or with --json.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "eval/kv_compare.h"
#include "engine/kv_engine.h"
#include "common/kv_json.h"
#include "eval/kv_niah.h"
#include "engine/kv_runner.h"
#include "model/kv_tokenizer.h"

int kv_bench_ruler_main(int argc, char **argv);

/* getopt returns the short letter for a short option: ids of options with
 * one are that letter */
enum { O_MODEL = 'm', O_TOK = 't', O_POLICY = 'p', O_LENGTH = 'l', O_TASKS = 256, O_LIMIT,
       O_MODE, O_GEN, O_PERTASK, O_JSON, O_THREADS, O_DEVICE, O_SELECT };

static const kv_option opts[] = {
    {O_MODEL, 'm', "model", "FILE", "model (llama2.c checkpoint or GGUF)"},
    {O_TOK, 0, "tokenizer", "FILE", "llama2.c tokenizer.bin (GGUF models carry their own)"},
    {O_TOK, 't', NULL, "FILE", NULL}, /* deprecated: -t is --tokens elsewhere */
    {O_TASKS, 0, "tasks", "FILE|-", "RULER JSONL tasks (index, input, outputs, length)"},
    {O_POLICY, 'P', "policy", "SPEC", "KV policy spec, repeatable (default: full)"},
    {O_POLICY, 'p', NULL, "SPEC", NULL}, /* deprecated: -p is --prompt elsewhere */
    {O_LENGTH, 'l', "length", "N", "only tasks of this length, repeatable (default: all)"},
    {O_LIMIT, 0, "limit", "N", "at most N tasks per length (default: all)"},
    {O_MODE, 0, "mode", "MODE", "question (haystack dense, question decoded; default) or prefill"},
    {O_GEN, 0, "gen", "N", "tokens generated per task (default 7)"},
    {O_PERTASK, 0, "per-task", NULL, "include every task's prediction in the JSON"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {O_THREADS, 'T', "threads", "N", "matmul threads (default: OpenMP's)"},
    {O_DEVICE, 0, "device", "DEV", "cpu, cuda[:N] or auto (default cpu; auto: the GPU when usable)"},
    {O_SELECT, 0, "select", "HOW", "GPU sparse layers: policy (default) or sketch (1-bit key sketch)"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench ruler", "--model FILE [--tokenizer FILE] --tasks FILE [-P SPEC]...",
    "Needle accuracy and KV bytes of each policy on RULER JSONL tasks.", opts,
    "Modes: 'question' prefills the haystack up to the last \"\\nQuestion:\" densely and\n"
    "decodes the question and answer through the policy; 'prefill' prefills the whole\n"
    "prompt densely (the first answer token then comes from dense attention).\n"
    "On the GPU (--device cuda) every policy runs on the GPU engine (fp16 weights and KV)."};

typedef struct {
    const char *policy;
    int length, n;
    double acc, resident, host, fetched, full, ms;
    int first, count; /* rows of tasks in the per-task arrays */
} row;

int kv_bench_ruler_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *model = NULL, *tokp = NULL, *tasks = NULL, *a;
    const char *pols[64];
    int npol = 0, lens[16], nlen = 0, limit = 0, oi;
    bool json = false, per_task = false;
    kv_policy_defaults def = {0}; /* --select */
    kv_device dev = KV_DEVICE_CPU;
    kv_gpu_engine_opts go;
    kv_gpu_engine_opts_default(&go);
    kv_niah_opts no;
    kv_niah_opts_default(&no);
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        switch (c) {
        case O_MODEL: model = a; break;
        case O_TOK: tokp = a; break;
        case O_TASKS: tasks = a; break;
        case O_POLICY:
            if (npol == 64) kv_cli_usage_error("at most 64 policies");
            pols[npol++] = a;
            break;
        case O_LENGTH:
            if (nlen == 16) kv_cli_usage_error("at most 16 lengths");
            lens[nlen++] = (int)kv_cli_long("--length", a, 1, 1 << 30);
            break;
        case O_LIMIT: limit = (int)kv_cli_long("--limit", a, 1, 1 << 30); break;
        case O_MODE:
            if (!strcmp(a, "question")) no.mode = KV_NIAH_QUESTION;
            else if (!strcmp(a, "prefill")) no.mode = KV_NIAH_PREFILL;
            else kv_cli_usage_error("--mode: '%s' (question or prefill)", a);
            break;
        case O_GEN: no.gen = (int)kv_cli_long("--gen", a, 1, 4096); break;
        case O_PERTASK: per_task = true; break;
        case O_JSON: json = true; break;
        case O_THREADS: kv_engine_set_threads((int)kv_cli_long("--threads", a, 1, 1024)); break;
        case O_DEVICE:
            dev = kv_cli_device(a, &go.device);
            break;
        case O_SELECT:
            if (!strcmp(a, "sketch")) def = (kv_policy_defaults){.given = KV_KEY_SELECT, .select = KV_SELECT_SKETCH};
            else if (strcmp(a, "policy")) kv_cli_usage_error("--select must be policy or sketch");
            break;
        }
    }
    if (oi < argc) kv_cli_usage_error("unexpected operand '%s'", argv[oi]);
    if (!model) kv_cli_usage_error("--model is required");
    if (!tasks) kv_cli_usage_error("--tasks is required");
    if (npol == 0) pols[npol++] = "full";

    int rc = KV_EXIT_OK;
    kv_model *m = NULL;
    kv_tokenizer *tok = NULL;
    kv_runner *e = NULL;
    kv_niah_set set = {0};
    kv_policy_params *prm = NULL;
    row *rows = NULL;
    char **preds = NULL;
    double *scores = NULL;
    int *tidx = NULL, nrows = 0, npred = 0;
    kv_status st = kv_niah_load(tasks, &set);
    if (st) {
        rc = kv_report(st, "%s", tasks);
        goto out;
    }
    /* policy specs are checked before the model loads: a typo costs nothing */
    for (int i = 0; i < npol; i++) {
        kv_policy_params tmp[1];
        if ((st = kv_policy_parse(pols[i], 1, tmp))) {
            rc = kv_report(st, "--policy %s", pols[i]);
            goto out;
        }
    }
    if ((st = kv_compare_open_model(model, tokp, &m, &tok))) {
        rc = kv_report(st, "%s", model);
        goto out;
    }
    const int L = m->cfg.n_layers;
    prm = calloc((size_t)L, sizeof *prm);
    if (!prm) {
        rc = kv_report(KV_E_NOMEM, "engine");
        goto out;
    }
    if ((st = kv_runner_new(m, NULL, 0, dev, &go, &e))) {
        rc = dev == KV_DEVICE_CUDA ? kv_report(st, "--device cuda") : kv_report(st, "engine");
        goto out;
    }
    kv_note(1, "running on %s", kv_runner_device(e));
    /* the lengths to run: given, or every distinct length in file order */
    if (nlen == 0)
        for (int i = 0; i < set.n && nlen < 16; i++) {
            bool seen = false;
            for (int j = 0; j < nlen; j++) seen |= lens[j] == set.tasks[i].length;
            if (!seen) lens[nlen++] = set.tasks[i].length;
        }
    rows = calloc((size_t)npol * (size_t)nlen, sizeof *rows);
    preds = calloc((size_t)npol * (size_t)set.n + 1, sizeof *preds);
    scores = calloc((size_t)npol * (size_t)set.n + 1, sizeof *scores);
    tidx = calloc((size_t)npol * (size_t)set.n + 1, sizeof *tidx);
    if (!rows || !preds || !scores || !tidx) {
        rc = kv_report(KV_E_NOMEM, "results");
        goto out;
    }
    for (int pi = 0; pi < npol; pi++) {
        if ((st = kv_policy_parse(pols[pi], L, prm))) {
            rc = kv_report(st, "--policy %s", pols[pi]);
            goto out;
        }
        kv_policy_defaults_apply(&def, prm, L);
        for (int li = 0; li < nlen; li++) {
            row *r = &rows[nrows++];
            r->policy = pols[pi];
            r->length = lens[li];
            r->first = npred;
            for (int ti = 0; ti < set.n; ti++) {
                const kv_niah_task *t = &set.tasks[ti];
                if (t->length != lens[li] || (limit && r->n >= limit)) continue;
                kv_niah_result res;
                kv_progress("%s: length %d, task %d", pols[pi], lens[li], t->index);
                if ((st = kv_niah_run(e, tok, prm, t, &no, &res))) {
                    kv_progress_done();
                    rc = kv_report(st, "task %d (line %d)", t->index, t->line);
                    goto out;
                }
                kv_note(1, "%s len %d task %d: %.0f \"%s\"", pols[pi], lens[li], t->index,
                        res.score, res.pred);
                r->n++;
                r->acc += res.score;
                r->resident += (double)res.bytes.resident;
                r->host += (double)res.bytes.host;
                r->fetched += res.fetched_per_step;
                r->full += res.full_bytes;
                r->ms += res.ms;
                preds[npred] = res.pred;
                scores[npred] = res.score;
                tidx[npred++] = t->index;
            }
            r->count = npred - r->first;
            if (r->n) {
                r->acc /= r->n;
                r->resident /= r->n;
                r->host /= r->n;
                r->fetched /= r->n;
                r->full /= r->n;
                r->ms /= r->n;
            }
        }
    }
    kv_progress_done();

    if (kv_want_json(stdout, json)) {
        printf("{\"tool\": \"kv-bench ruler\", \"model\": ");
        kv_json_string(stdout, model);
        printf(", \"tasks\": ");
        kv_json_string(stdout, tasks);
        printf(", \"device\": ");
        kv_json_string(stdout, kv_runner_device(e));
        printf(", \"mode\": \"%s\", \"gen\": %d, \"results\": [",
               no.mode == KV_NIAH_QUESTION ? "question" : "prefill", no.gen);
        for (int i = 0; i < nrows; i++) {
            const row *r = &rows[i];
            printf("%s\n  {\"policy\": ", i ? "," : "");
            kv_json_string(stdout, r->policy);
            printf(", \"length\": %d, \"n\": %d, \"accuracy\": ", r->length, r->n);
            kv_json_number(stdout, r->acc);
            printf(", \"resident_bytes\": %.0f, \"host_bytes\": %.0f, \"fetched_bytes_per_step\": %.0f, "
                   "\"full_f16_bytes\": %.0f, \"ms_per_task\": ",
                   r->resident, r->host, r->fetched, r->full);
            kv_json_number(stdout, r->ms);
            if (per_task) {
                printf(", \"tasks\": [");
                for (int k = 0; k < r->count; k++) {
                    printf("%s{\"index\": %d, \"score\": ", k ? ", " : "", tidx[r->first + k]);
                    kv_json_number(stdout, scores[r->first + k]);
                    printf(", \"prediction\": ");
                    kv_json_string(stdout, preds[r->first + k]);
                    printf("}");
                }
                printf("]");
            }
            printf("}");
        }
        printf("\n]}\n");
    } else {
        printf("device: %s\n", kv_runner_device(e));
        printf("%-40s %6s %4s %6s %12s %12s %14s %9s\n", "policy", "length", "n", "acc",
               "resident KiB", "host KiB", "fetched KiB/t", "ms/task");
        for (int i = 0; i < nrows; i++) {
            const row *r = &rows[i];
            printf("%-40s %6d %4d %6.3f %12.1f %12.1f %14.1f %9.0f\n", r->policy, r->length, r->n,
                   r->acc, r->resident / 1024, r->host / 1024, r->fetched / 1024, r->ms);
        }
    }
    if (fflush(stdout) || ferror(stdout)) rc = kv_report(KV_E_IO, "stdout");
out:
    for (int i = 0; preds && i < npred; i++) free(preds[i]);
    free(tidx);
    free(scores);
    free(preds);
    free(rows);
    free(prm);
    kv_runner_free(e);
    kv_tokenizer_free(tok);
    kv_model_close(m);
    kv_niah_clear(&set);
    return rc;
}
