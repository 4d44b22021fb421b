/*
 * kv_ruler: the RULER batch, its summary and its prediction files (see
 * kv_ruler.h).
 */
#include "eval/kv_ruler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_json.h"
#include "common/kv_outfile.h"
#include "eval/kv_jsonl.h"
#include "eval/kv_score.h"
#include "format/kvc.h"

kv_status kv_ruler_file_open(const char *path, const kv_ruler_metric *metric, int gen,
                             kv_ruler_file *f)
{
    memset(f, 0, sizeof *f);
    f->path = path;
    kv_status st = kv_niah_load_lenient(path, &f->set);
    if (st) return st;
    kv_niah_task_name(path, f->task, sizeof f->task);
    f->metric = metric ? *metric : kv_ruler_task_metric(f->task, NULL);
    int g = kv_niah_task_gen(f->task);
    f->gen = gen > 0 ? gen : g > 0 ? g : 7;
    return KV_OK;
}

void kv_ruler_file_close(kv_ruler_file *f) { kv_niah_clear(&f->set); }

cJSON *kv_ruler_header(const char *model, const char *tokenizer, const char *device_kind,
                       const char *device_name, const kv_ruler_file *files, int nf,
                       const kv_ruler_opts *o)
{
    cJSON *h = cJSON_CreateObject(), *c = cJSON_CreateObject(), *fs = cJSON_CreateArray();
    cJSON *ls = cJSON_CreateArray();
    if (!h || !c || !fs || !ls) {
        cJSON_Delete(h);
        cJSON_Delete(c);
        cJSON_Delete(fs);
        cJSON_Delete(ls);
        return NULL;
    }
    cJSON_AddNumberToObject(h, "kv_bench_log", KV_BATCH_LOG_VERSION);
    cJSON_AddStringToObject(h, "bench", "ruler");
    cJSON_AddStringToObject(c, "model", model);
    if (tokenizer) cJSON_AddStringToObject(c, "tokenizer", tokenizer);
    else cJSON_AddNullToObject(c, "tokenizer");
    cJSON_AddStringToObject(c, "device", device_kind);
    cJSON_AddStringToObject(c, "mode", o->mode == KV_NIAH_QUESTION ? "question" : "prefill");
    for (int i = 0; i < nf; i++) {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "path", files[i].path);
        cJSON_AddStringToObject(f, "task", files[i].task);
        cJSON_AddStringToObject(f, "metric", kv_ruler_metric_name(files[i].metric));
        cJSON_AddNumberToObject(f, "gen", files[i].gen);
        cJSON_AddItemToArray(fs, f);
    }
    cJSON_AddItemToObject(c, "files", fs);
    for (int i = 0; i < o->n_lengths; i++) cJSON_AddItemToArray(ls, cJSON_CreateNumber(o->lengths[i]));
    cJSON_AddItemToObject(c, "lengths", ls);
    cJSON_AddNumberToObject(c, "limit", o->limit);
    cJSON_AddItemToObject(h, "config", c);
    cJSON_AddStringToObject(h, "device_name", device_name);
    return h;
}

// --- the batch -------------------------------------------------------------------------

/* Whether o selects task ti of f (lengths, then the limit per length). */
static bool selected(const kv_ruler_file *f, int ti, const kv_ruler_opts *o)
{
    const kv_niah_task *t = &f->set.tasks[ti];
    if (o->n_lengths) {
        bool in = false;
        for (int i = 0; i < o->n_lengths; i++) in |= o->lengths[i] == t->length;
        if (!in) return false;
    }
    if (o->limit) {
        int before = 0;
        for (int k = 0; k < ti; k++) before += f->set.tasks[k].length == t->length;
        if (before >= o->limit) return false;
    }
    return true;
}

static kv_status run_one(kv_runner *e, const kv_tokenizer *tok, const kv_ruler_file *f, int fi,
                         const kv_niah_task *t, const kv_batch_policy *p, const kv_niah_opts *no,
                         const int *ids, int n, int split, kv_niah_mode used, kv_batch_log *log,
                         cJSON *records)
{
    kv_niah_result res;
    kv_status st = kv_niah_run_prepared(e, tok, p->per_layer, t, no, ids, n, split, used, &res);
    if (st) {
        kv_errcontext("%s:%d (%s)", f->path, t->line, p->label);
        return st;
    }
    cJSON *r = kv_batch_record("ruler", f->task, t->id, fi, t->line, t->length, p->label);
    cJSON *outs = cJSON_CreateStringArray((const char *const *)t->outputs, t->n_outputs);
    if (!r || !outs) {
        cJSON_Delete(r);
        cJSON_Delete(outs);
        kv_niah_result_clear(&res);
        return kv_fail(KV_E_NOMEM, "record");
    }
    cJSON_AddNumberToObject(r, "index", t->index);
    cJSON_AddNumberToObject(r, "score", res.score);
    cJSON_AddStringToObject(r, "pred", res.pred);
    cJSON_AddItemToObject(r, "outputs", outs);
    cJSON_AddStringToObject(r, "mode", res.mode == KV_NIAH_QUESTION ? "question" : "prefill");
    cJSON_AddNumberToObject(r, "prompt_tokens", res.prompt_tokens);
    cJSON_AddNumberToObject(r, "dense_tokens", res.dense_tokens);
    cJSON_AddNumberToObject(r, "decoded", res.decoded);
    cJSON_AddNumberToObject(r, "gen_tokens", res.gen_tokens);
    kv_batch_record_cost(r, &res.bytes, res.fetched_per_step, res.full_bytes, res.ms, res.prefill_ms,
                         res.decode_ms);
    kv_niah_result_clear(&res);
    return kv_batch_keep(log, records, r);
}

kv_status kv_ruler_batch(kv_runner *e, const kv_tokenizer *tok, const kv_ruler_file *files,
                         int nf, const kv_batch_policy *pols, int np, const kv_ruler_opts *o,
                         kv_batch_log *log, const kv_batch_done *done, cJSON *records,
                         const kv_batch_hooks *hooks)
{
    const int ctx = kv_runner_ctx(e);
    /* the work left in this shard, for the progress line */
    int total = 0;
    for (int fi = 0; fi < nf; fi++)
        for (int ti = 0; ti < files[fi].set.n; ti++) {
            const kv_niah_task *t = &files[fi].set.tasks[ti];
            if (!selected(&files[fi], ti, o) || !kv_batch_in_shard(files[fi].task, t->id, o->shard_i, o->shard_n))
                continue;
            for (int pi = 0; pi < np; pi++)
                total += !(done && kv_batch_done_has(done, files[fi].task, t->id, pols[pi].label, t->length));
        }
    kv_batch_meter m;
    kv_batch_meter_start(&m, hooks, total);
    kv_status st = KV_OK;
    for (int fi = 0; fi < nf && !st; fi++) {
        const kv_ruler_file *f = &files[fi];
        /* malformed lines: one skip each, in the shard of their line number */
        for (int b = 0; b < f->set.n_bad && !st; b++) {
            char id[32];
            snprintf(id, sizeof id, "line:%d", f->set.bad[b].line);
            if (!kv_batch_in_shard(f->task, id, o->shard_i, o->shard_n)) continue;
            if (done && kv_batch_done_has(done, f->task, id, NULL, -1)) continue;
            st = kv_batch_skip("ruler", f->task, id, fi, f->path, f->set.bad[b].line, -1,
                               f->set.bad[b].why, o->strict, log, records, hooks);
        }
        kv_niah_opts no = {o->mode, f->gen, f->metric};
        int no_split = 0, ran = 0;
        for (int ti = 0; ti < f->set.n && !st; ti++) {
            const kv_niah_task *t = &f->set.tasks[ti];
            if (!selected(f, ti, o) || !kv_batch_in_shard(f->task, t->id, o->shard_i, o->shard_n))
                continue;
            bool todo = false;
            for (int pi = 0; pi < np; pi++)
                todo |= !(done && kv_batch_done_has(done, f->task, t->id, pols[pi].label, t->length));
            if (!todo) continue;
            int *ids = NULL, n = 0, split = 0;
            kv_niah_mode used;
            if ((st = kv_niah_prepare(tok, t, o->mode, &ids, &n, &split, &used))) {
                kv_errcontext("%s:%d", f->path, t->line);
                break;
            }
            if (n > ctx) {
                char why[160];
                snprintf(why, sizeof why, "prompt of %d tokens exceeds the context %d", n, ctx);
                st = kv_batch_skip("ruler", f->task, t->id, fi, f->path, t->line, t->length, why,
                                   o->strict, log, records, hooks);
                for (int pi = 0; pi < np; pi++)
                    m.done += !(done && kv_batch_done_has(done, f->task, t->id, pols[pi].label, t->length));
                free(ids);
                continue;
            }
            ran++;
            no_split += o->mode == KV_NIAH_QUESTION && used == KV_NIAH_PREFILL;
            for (int pi = 0; pi < np && !st; pi++) {
                if (done && kv_batch_done_has(done, f->task, t->id, pols[pi].label, t->length)) continue;
                kv_batch_meter_tick(&m, pols[pi].label, f->task);
                st = run_one(e, tok, f, fi, t, &pols[pi], &no, ids, n, split, used, log, records);
                m.done++;
                kv_batch_meter_tick(&m, pols[pi].label, f->task);
            }
            free(ids);
        }
        if (!st && no_split)
            kv_batch_warn(hooks, "%s: %d of %d task(s) have no question to split at (no \"\\nQuestion:\", "
                          "and not RULER's layout with an answer_prefix): they ran in prefill mode",
                          f->path, no_split, ran);
    }
    return st;
}

// --- the summary ---------------------------------------------------------------------------

typedef struct {
    int pidx, fi;
    double length;
    cJSON **rec; /* (n) in line order */
    int n, cap;
} row;

static int cmp_row(const void *x, const void *y)
{
    const row *a = x, *b = y;
    if (a->pidx != b->pidx) return a->pidx < b->pidx ? -1 : 1;
    if (a->fi != b->fi) return a->fi < b->fi ? -1 : 1;
    return a->length < b->length ? -1 : a->length > b->length;
}

/* The rows of records (sorted): one per (policy, file, length). */
static kv_status make_rows(cJSON *records, const cJSON *pols, row **out, int *n_out)
{
    row *rows = NULL;
    int n = 0, cap = 0;
    for (cJSON *r = records->child; r; r = r->next) {
        const char *pol = kv_rec_str(r, "policy", NULL);
        if (!pol) continue;
        int pidx = kv_batch_policy_index(pols, pol), fi = (int)kv_rec_num(r, "fi", 0);
        double len = kv_rec_num(r, "length", 0);
        int k = n - 1;
        while (k >= 0 && !(rows[k].pidx == pidx && rows[k].fi == fi && rows[k].length == len)) k--;
        if (k < 0) {
            row *nr = kv_grow(rows, n, &cap, sizeof *nr, 16);
            if (!nr) goto nomem;
            rows = nr;
            rows[n] = (row){pidx, fi, len, NULL, 0, 0};
            k = n++;
        }
        row *w = &rows[k];
        cJSON **nr = kv_grow(w->rec, w->n, &w->cap, sizeof *nr, 64);
        if (!nr) goto nomem;
        w->rec = nr;
        w->rec[w->n++] = r;
    }
    qsort(rows, (size_t)n, sizeof *rows, cmp_row);
    *out = rows;
    *n_out = n;
    return KV_OK;
nomem:
    for (int i = 0; i < n; i++) free(rows[i].rec);
    free(rows);
    return kv_fail(KV_E_NOMEM, "summary");
}

/* Every policy of the headers, then any other a record names. */
kv_status kv_ruler_summary(FILE *f, bool json, const cJSON *headers, cJSON *records,
                           bool per_task)
{
    cJSON *pols = kv_batch_all_policies(headers, records);
    if (!pols) return kv_fail(KV_E_NOMEM, "summary");
    kv_batch_sort(records, pols);
    row *rows = NULL;
    int nrows = 0;
    kv_status st = make_rows(records, pols, &rows, &nrows);
    if (st) {
        cJSON_Delete(pols);
        return st;
    }
    const cJSON *cfg = kv_batch_config(headers);
    const cJSON *h0 = headers->child;
    int nskip = 0, nsamples = 0;
    for (const cJSON *r = records->child; r; r = r->next) nskip += kv_rec_str(r, "skipped", NULL) != NULL;
    /* samples: distinct (file, line) among records */
    kv_batch_done *seen = NULL;
    if ((st = kv_batch_done_new(&seen))) {
        free(rows);
        cJSON_Delete(pols);
        return st;
    }
    for (const cJSON *r = records->child; r && !st; r = r->next) {
        char fi[32];
        snprintf(fi, sizeof fi, "%.0f", kv_rec_num(r, "fi", 0));
        long long line = (long long)kv_rec_num(r, "line", 0);
        if (kv_batch_done_has(seen, fi, "", "", line)) continue;
        nsamples++;
        st = kv_batch_done_add(seen, fi, "", "", line);
    }
    kv_batch_done_free(seen);
    const char *device = kv_rec_str(h0, "device_name", kv_rec_str(cfg, "device", "?"));
    const char *mode = kv_rec_str(cfg, "mode", "question");
    if (json) {
        fprintf(f, "{\"tool\": \"kv-bench ruler\", \"model\": ");
        kv_json_string(f, kv_rec_str(cfg, "model", ""));
        fprintf(f, ", \"tasks\": ");
        const cJSON *f0 = kv_batch_file_cfg(cfg, 0);
        kv_json_string(f, kv_rec_str(f0, "path", ""));
        fprintf(f, ", \"files\": [");
        int k = 0;
        for (const cJSON *x = f0; x; x = x->next, k++) {
            fprintf(f, "%s{\"path\": ", k ? ", " : "");
            kv_json_string(f, kv_rec_str(x, "path", ""));
            fprintf(f, ", \"task\": ");
            kv_json_string(f, kv_rec_str(x, "task", ""));
            fprintf(f, ", \"metric\": \"%s\", \"gen\": %.0f}", kv_rec_str(x, "metric", ""),
                    kv_rec_num(x, "gen", 0));
        }
        fprintf(f, "], \"device\": ");
        kv_json_string(f, device);
        /* how the prompts were prefilled (a log written before it was recorded has none) */
        const cJSON *pf = cJSON_GetObjectItemCaseSensitive(h0, "prefill");
        char *pfs = cJSON_IsObject(pf) ? cJSON_PrintUnformatted(pf) : NULL;
        if (pfs) fprintf(f, ", \"prefill\": %s", pfs);
        free(pfs);
        fprintf(f, ", \"mode\": \"%s\", \"gen\": %.0f, \"samples\": %d, \"skipped\": %d, "
                   "\"skipped_samples\": [", mode, kv_rec_num(f0, "gen", 0), nsamples, nskip);
        k = 0;
        for (const cJSON *r = records->child; r; r = r->next) {
            const char *why = kv_rec_str(r, "skipped", NULL);
            if (!why) continue;
            fprintf(f, "%s{\"task\": ", k++ ? ", " : "");
            kv_json_string(f, kv_rec_str(r, "task", ""));
            fprintf(f, ", \"line\": %.0f, \"reason\": ", kv_rec_num(r, "line", 0));
            kv_json_string(f, why);
            fputc('}', f);
        }
        fprintf(f, "], \"results\": [");
    } else {
        fprintf(f, "device: %s\n", device);
        const cJSON *pf = cJSON_GetObjectItemCaseSensitive(h0, "prefill");
        if (cJSON_IsObject(pf))
            fprintf(f, "prefill: %s, %s (%s)\n", kv_rec_str(pf, "device", "?"),
                    strcmp(kv_rec_str(pf, "method", ""), "chunked") ? "one token at a time" : "in chunks",
                    kv_rec_str(pf, "why", ""));
        fprintf(f, "%-32s %-16s %6s %4s %6s %7s %12s %12s %14s %9s\n", "policy", "task", "length", "n",
                "acc", "score", "resident KiB", "host KiB", "fetched KiB/t", "ms/task");
    }
    double *sc = NULL;
    for (int i = 0; i < nrows && !st; i++) {
        const row *w = &rows[i];
        free(sc);
        if (!(sc = malloc((size_t)w->n * sizeof *sc))) {
            st = kv_fail(KV_E_NOMEM, "summary");
            break;
        }
        double sum = 0;
        kv_batch_cost c = {0};
        int nq = 0, npf = 0;
        for (int k = 0; k < w->n; k++) {
            const cJSON *r = w->rec[k];
            sc[k] = kv_rec_num(r, "score", 0);
            sum += sc[k];
            kv_batch_cost_add(&c, r);
            if (!strcmp(kv_rec_str(r, "mode", ""), "question")) nq++;
            else npf++;
        }
        const int n = w->n;
        const cJSON *fc = kv_batch_file_cfg(cfg, w->fi);
        const char *pol = cJSON_GetArrayItem(pols, w->pidx)->valuestring;
        const char *task = kv_rec_str(w->rec[0], "task", "");
        double acc = sum / n, score = kv_ruler_aggregate(sc, n);
        if (!json) {
            fprintf(f, "%-32s %-16s %6.0f %4d %6.3f %7.2f %12.1f %12.1f %14.1f %9.0f\n", pol, task,
                    w->length, n, acc, score, c.resident / n / 1024, c.host / n / 1024, c.fetched / n / 1024,
                    c.ms / n);
            continue;
        }
        fprintf(f, "%s\n  {\"policy\": ", i ? "," : "");
        kv_json_string(f, pol);
        fprintf(f, ", \"task\": ");
        kv_json_string(f, task);
        fprintf(f, ", \"metric\": \"%s\", \"length\": %.0f, \"n\": %d, \"accuracy\": ",
                kv_rec_str(fc, "metric", "string_match_all"), w->length, n);
        kv_json_number(f, acc);
        fprintf(f, ", \"score\": ");
        kv_json_pyfloat(f, score);
        fprintf(f, ", \"modes\": {\"question\": %d, \"prefill\": %d}", nq, npf);
        kv_batch_cost_json(f, &c, n, "ms_per_task");
        if (per_task) {
            fprintf(f, ", \"tasks\": [");
            for (int k = 0; k < n; k++) {
                const cJSON *r = w->rec[k];
                fprintf(f, "%s{\"index\": %.0f, \"id\": ", k ? ", " : "", kv_rec_num(r, "index", 0));
                kv_json_string(f, kv_rec_str(r, "id", ""));
                fprintf(f, ", \"line\": %.0f, \"mode\": \"%s\", \"score\": ", kv_rec_num(r, "line", 0),
                        kv_rec_str(r, "mode", ""));
                kv_json_number(f, sc[k]);
                fprintf(f, ", \"prediction\": ");
                kv_json_string(f, kv_rec_str(r, "pred", ""));
                fputc('}', f);
            }
            fputc(']', f);
        }
        fputc('}', f);
    }
    free(sc);
    if (json && !st) fprintf(f, "\n]}\n");
    for (int i = 0; i < nrows; i++) free(rows[i].rec);
    free(rows);
    cJSON_Delete(pols);
    return st;
}

// --- prediction files ------------------------------------------------------------------------

typedef struct {
    const kv_ruler_file *files;
    int nf;
} pred_ctx;

/* One line of RULER's prediction files: index, pred, input, outputs, others, truncation, length. */
static void pred_line(FILE *fp, const cJSON *r, int fi, void *ctx)
{
    const pred_ctx *c = ctx;
    const char *input = "";
    int line = (int)kv_rec_num(r, "line", 0);
    for (int k = 0; c->files && fi < c->nf && k < c->files[fi].set.n; k++)
        if (c->files[fi].set.tasks[k].line == line) input = c->files[fi].set.tasks[k].input;
    fprintf(fp, "{\"index\": %.0f, \"pred\": ", kv_rec_num(r, "index", 0));
    kv_json_pystring(fp, kv_rec_str(r, "pred", ""));
    fputs(", \"input\": ", fp);
    kv_json_pystring(fp, input);
    fputs(", \"outputs\": [", fp);
    int k = 0;
    const cJSON *outs = cJSON_GetObjectItemCaseSensitive(r, "outputs");
    for (const cJSON *x = outs ? outs->child : NULL; x; x = x->next, k++) {
        fputs(k ? ", " : "", fp);
        kv_json_pystring(fp, cJSON_IsString(x) ? x->valuestring : "");
    }
    fprintf(fp, "], \"others\": {}, \"truncation\": -1, \"length\": %.0f}\n", kv_rec_num(r, "length", -1));
}

kv_status kv_ruler_write_preds(const char *dir, const cJSON *headers, cJSON *records,
                               const kv_ruler_file *files, int nf)
{
    cJSON *pols = kv_batch_all_policies(headers, records);
    if (!pols) return kv_fail(KV_E_NOMEM, "predictions");
    kv_batch_sort(records, pols);
    pred_ctx c = {files, nf};
    kv_status st = kv_batch_write_preds(dir, pols, kv_batch_config(headers), records, "task", pred_line, &c);
    cJSON_Delete(pols);
    return st;
}
