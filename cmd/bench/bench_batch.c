/*
 * bench_batch: shared batch options of kv-bench's subcommands (see
 * bench_batch.h).
 */
#include "bench_batch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_outfile.h"
#include "eval/kv_chart.h"
#include "format/kvc.h"
#include "policy/kv_deploy.h"

void bench_batch_init(bench_batch *b)
{
    memset(b, 0, sizeof *b);
    b->shard_i = b->shard_n = 1;
}

bool bench_batch_option(bench_batch *b, int id, const char *arg)
{
    switch (id) {
    case BB_POLICY:
    case BB_PROFILE:
        if (b->npol == 64) kv_cli_usage_error("at most 64 policies");
        b->pol[b->npol].profile = id == BB_PROFILE;
        b->pol[b->npol++].arg = arg;
        return true;
    case BB_OUTPUT: b->output = arg; return true;
    case BB_RESUME: b->resume = true; return true;
    case BB_STRICT: b->strict = true; return true;
    case BB_PRED_DIR: b->pred_dir = arg; return true;
    case BB_SVG: b->svg = arg; return true;
    case BB_SHARD:
        if (kv_batch_parse_shard(arg, &b->shard_i, &b->shard_n)) kv_cli_usage_error("%s", kv_errdetail());
        return true;
    }
    return false;
}

void bench_batch_check(const bench_batch *b)
{
    if (b->resume && !b->output) kv_cli_usage_error("--resume needs --output FILE");
    if (b->output && !strcmp(b->output, "-")) kv_cli_usage_error("--output needs a file, not stdout");
}

int bench_batch_precheck(const bench_batch *b)
{
    /* the syntax only: the layer ranges wait for the model's layer count */
    for (int i = 0; i < b->npol; i++) {
        kv_status st;
        if (!b->pol[i].profile && (st = kv_policy_spec_check(b->pol[i].arg)))
            return kv_report(st, "--policy %s", b->pol[i].arg);
    }
    return 0;
}

int bench_batch_policies(const bench_batch *b, int n_layers, bool sketch, kv_batch_policy **pols,
                         kv_policy_params **params, int *np)
{
    int n = b->npol ? b->npol : 1;
    kv_batch_policy *p = calloc((size_t)n, sizeof *p);
    kv_policy_params *prm = calloc((size_t)n * (size_t)n_layers, sizeof *prm);
    char **labels = calloc((size_t)n, sizeof *labels);
    if (!p || !prm || !labels) {
        free(p);
        free(prm);
        free(labels);
        return kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "policies");
    }
    for (int i = 0; i < n; i++) {
        kv_policy_params *pl = prm + (size_t)i * (size_t)n_layers;
        const char *arg = b->npol ? b->pol[i].arg : "full";
        bool prof = b->npol && b->pol[i].profile;
        kv_status st = prof ? kv_deploy_load(arg, n_layers, pl) : kv_policy_parse(arg, n_layers, pl);
        if (st) {
            int rc = kv_report(st, prof ? "--profile %s" : "--policy %s", arg);
            for (int k = 0; k < i; k++) free((char *)p[k].label);
            free(p);
            free(prm);
            free(labels);
            return rc;
        }
        if (sketch) kv_policy_set_select(pl, n_layers, KV_SELECT_SKETCH);
        size_t l = strlen(arg) + 16;
        char *label = malloc(l);
        if (label) snprintf(label, l, "%s%s", prof ? "profile:" : "", arg);
        p[i].label = label ? label : arg;
        p[i].per_layer = pl;
        for (int k = 0; k < i; k++)
            if (!strcmp(p[k].label, p[i].label)) kv_die(KV_EXIT_USAGE, "policy '%s' given twice", p[i].label);
    }
    free(labels);
    *pols = p;
    *params = prm;
    *np = n;
    return 0;
}

void bench_batch_policies_free(kv_batch_policy *pols, kv_policy_params *params, int np)
{
    for (int i = 0; pols && i < np; i++) free((char *)pols[i].label);
    free(pols);
    free(params);
}

int bench_batch_engine(const bench_batch *b, const kv_model *m, bool sketch, kv_device dev,
                       const kv_gpu_engine_opts *go, kv_batch_policy **pols, kv_policy_params **params,
                       int *np, kv_runner **e)
{
    int rc = bench_batch_policies(b, m->cfg.n_layers, sketch, pols, params, np);
    if (rc) return rc;
    kv_status st = kv_runner_new(m, NULL, 0, dev, go, e);
    if (st) return dev == KV_DEVICE_CUDA ? kv_report(st, "--device cuda") : kv_report(st, "engine");
    kv_note(1, "running on %s", kv_runner_device(*e));
    return 0;
}

static void fmt_eta(double s, char *buf, size_t cap)
{
    if (s < 0) snprintf(buf, cap, "?");
    else if (s < 60) snprintf(buf, cap, "%.0fs", s);
    else if (s < 3600) snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)s % 60);
    else snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), (int)(s / 60) % 60);
}

static void on_progress(void *ctx, const kv_batch_progress *p)
{
    (void)ctx;
    char eta[32];
    fmt_eta(p->eta_s, eta, sizeof eta);
    int pct = p->total ? (int)(100.0 * p->done / p->total) : 100;
    kv_progress("%d/%d (%d%%) %.2f/s ETA %s  %s  %s", p->done, p->total, pct, p->rate, eta,
                p->task ? p->task : "", p->policy ? p->policy : "");
}

static void on_warn(void *ctx, const char *msg)
{
    (void)ctx;
    kv_warn("%s", msg);
}

void bench_batch_hooks(kv_batch_hooks *h)
{
    h->progress = on_progress;
    h->warn = on_warn;
    h->ctx = NULL;
}

void bench_batch_run_init(bench_batch_run *r)
{
    *r = (bench_batch_run){0};
    bench_batch_hooks(&r->hooks);
}

void bench_batch_run_free(bench_batch_run *r)
{
    kv_batch_close(r->log);
    cJSON_Delete(r->header);
    cJSON_Delete(r->records);
    kv_batch_done_free(r->done);
    bench_batch_policies_free(r->pols, r->prm, r->np);
    kv_runner_free(r->e);
    kv_tokenizer_free(r->tok);
    kv_model_close(r->m);
    *r = (bench_batch_run){0};
}

int bench_batch_open(const bench_batch *b, cJSON *header, const kv_batch_policy *pols, int np,
                     kv_batch_log **log, cJSON **records, kv_batch_done **done)
{
    *log = NULL;
    *done = NULL;
    *records = NULL;
    cJSON *pl = cJSON_CreateArray();
    for (int i = 0; pl && i < np; i++) cJSON_AddItemToArray(pl, cJSON_CreateString(pols[i].label));
    cJSON_AddItemToObject(header, "policies", pl);
    char sh[32];
    snprintf(sh, sizeof sh, "%d/%d", b->shard_i, b->shard_n);
    if (b->shard_n > 1) cJSON_AddStringToObject(header, "shard", sh);
    else cJSON_AddNullToObject(header, "shard");
    kv_status st = kv_batch_done_new(done);
    if (!st && b->output) st = kv_batch_open(b->output, b->resume, header, log, records);
    if (st) return kv_report(st, "%s", b->output ? b->output : "results");
    if (!*records && !(*records = cJSON_CreateArray())) return kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "results");
    int prior = 0;
    for (const cJSON *r = (*records)->child; r && !st; r = r->next, prior++)
        st = kv_batch_done_add(*done, kv_rec_str(r, "task", ""), kv_rec_str(r, "id", ""),
                               kv_rec_str(r, "policy", NULL), (long long)kv_rec_num(r, "length", -1));
    if (st) return kv_report(st, "resume");
    if (prior) kv_note(1, "%s: %d records already there; resuming", b->output, prior);
    return 0;
}

int bench_batch_svg(const char *path, const cJSON *headers, cJSON *records)
{
    kv_outfile o;
    kv_status st = kv_outfile_open(&o, path);
    if (st) return kv_report(st, "--svg %s", path);
    st = kv_chart_report(o.fp, headers, records);
    if (st) kv_outfile_abort(&o);
    else st = kv_outfile_commit(&o);
    return st ? kv_report(st, "--svg %s", path) : 0;
}

int bench_batch_finish(const bench_batch *b, const char *what, kv_status st, kv_batch_log **log,
                       cJSON *header, cJSON *records, bool json, bool per, const bench_batch_out *out)
{
    kv_progress_done();
    if (st) return kv_report(st, "%s", what);
    st = kv_batch_close(*log);
    *log = NULL;
    if (st) return kv_report(st, "%s", b->output);
    cJSON *headers = cJSON_CreateArray();
    if (!headers) return kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "summary");
    cJSON_AddItemReferenceToArray(headers, header);
    int rc = 0;
    if (b->pred_dir && (st = out->preds(b->pred_dir, headers, records, out->ctx)))
        rc = kv_report(st, "--pred-dir %s", b->pred_dir);
    else if (b->svg && (rc = bench_batch_svg(b->svg, headers, records)))
        ;
    else if ((st = out->summary(stdout, kv_want_json(stdout, json), headers, records, per, out->ctx)))
        rc = kv_report(st, "summary");
    else if (fflush(stdout) || ferror(stdout))
        rc = kv_report(kv_fail(KV_E_IO, "write failed"), "stdout");
    cJSON_Delete(headers);
    return rc;
}
