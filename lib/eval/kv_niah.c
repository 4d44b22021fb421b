/*
 * kv_niah: RULER JSONL reading, RULER's scoring, and the greedy needle run
 * through a kv_runner (see kv_niah.h for the two modes).
 */
#include "eval/kv_niah.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_file.h"
#include "eval/kv_gen.h"
#include "eval/kv_jsonl.h"

// --- reading ------------------------------------------------------------

static void task_free(kv_niah_task *t)
{
    free(t->input);
    free(t->answer_prefix);
    kv_strings_free(t->outputs, t->n_outputs);
    t->input = t->answer_prefix = NULL;
    t->outputs = NULL;
    t->n_outputs = 0;
}

void kv_niah_clear(kv_niah_set *s)
{
    for (int i = 0; i < s->n; i++) task_free(&s->tasks[i]);
    for (int i = 0; i < s->n_bad; i++) free(s->bad[i].why);
    free(s->tasks);
    free(s->bad);
    memset(s, 0, sizeof *s);
}

/* One JSON line into t; the message (without file and line) says why not. */
static kv_status parse_line(const char *line, size_t len, int ordinal, kv_niah_task *t)
{
    cJSON *j = cJSON_ParseWithLength(line, len);
    if (!j) return kv_fail(KV_E_DATA, "not valid JSON");
    kv_status st = KV_OK;
    const cJSON *in = cJSON_GetObjectItemCaseSensitive(j, "input");
    const cJSON *outs = cJSON_GetObjectItemCaseSensitive(j, "outputs");
    const cJSON *idx = cJSON_GetObjectItemCaseSensitive(j, "index");
    const cJSON *ln = cJSON_GetObjectItemCaseSensitive(j, "length");
    const cJSON *ap = cJSON_GetObjectItemCaseSensitive(j, "answer_prefix");
    long long iv = ordinal, lv = 0;
    if (!cJSON_IsObject(j)) {
        st = kv_fail(KV_E_DATA, "a task must be a JSON object");
    } else if (!cJSON_IsString(in)) {
        st = kv_fail(KV_E_DATA, "\"input\" missing or not a string");
    } else if (!cJSON_IsArray(outs) || cJSON_GetArraySize(outs) < 1) {
        st = kv_fail(KV_E_DATA, "\"outputs\" missing or not a non-empty array");
    } else if (idx && !cJSON_IsNumber(idx)) {
        st = kv_fail(KV_E_DATA, "\"index\" is not a number");
    } else if (idx && !kv_json_int(idx, INT_MIN, INT_MAX, &iv)) {
        st = kv_fail(KV_E_DATA, "\"index\" %g is not an integer in [%d, %d]", idx->valuedouble,
                     INT_MIN, INT_MAX);
    } else if (ln && !cJSON_IsNumber(ln)) {
        st = kv_fail(KV_E_DATA, "\"length\" is not a number");
    } else if (ln && !kv_json_int(ln, -1, INT_MAX, &lv)) {
        st = kv_fail(KV_E_DATA, "\"length\" %g is not an integer in [-1, %d]", ln->valuedouble,
                     INT_MAX);
    } else if (ap && !cJSON_IsString(ap)) {
        st = kv_fail(KV_E_DATA, "\"answer_prefix\" is not a string");
    }
    if (st == KV_OK) {
        t->index = (int)iv;
        t->length = (int)lv;
        st = kv_json_strings(outs, "outputs", &t->outputs, &t->n_outputs);
        if (!st && !(t->input = kv_strdup(in->valuestring))) st = kv_fail(KV_E_NOMEM, "task");
        if (!st && ap && !(t->answer_prefix = kv_strdup(ap->valuestring)))
            st = kv_fail(KV_E_NOMEM, "task");
    }
    cJSON_Delete(j);
    if (st) task_free(t);
    return st;
}

/* Give each task an id: its index, "#k" added to the k-th repeat (RULER's
 * niah files store a character position as "index", which can repeat). */
static void assign_ids(kv_niah_set *s)
{
    for (int i = 0; i < s->n; i++) {
        int rep = 0;
        for (int k = 0; k < i; k++) rep += s->tasks[k].index == s->tasks[i].index;
        if (rep) snprintf(s->tasks[i].id, sizeof s->tasks[i].id, "%d#%d", s->tasks[i].index, rep);
        else snprintf(s->tasks[i].id, sizeof s->tasks[i].id, "%d", s->tasks[i].index);
    }
}

kv_status kv_niah_bad_add(kv_niah_bad **bad, int *n_bad, int *cap, int line, const char *name)
{
    kv_niah_bad *nb = kv_grow(*bad, *n_bad, cap, sizeof *nb, 16);
    char *why = nb ? kv_strdup(kv_errdetail()) : NULL;
    if (nb) *bad = nb;
    if (!why) return kv_fail(KV_E_NOMEM, "%s", name);
    nb[(*n_bad)++] = (kv_niah_bad){line, why};
    return KV_OK;
}

static kv_status parse_all(const char *text, size_t len, const char *name, bool lenient,
                           kv_niah_set *out)
{
    memset(out, 0, sizeof *out);
    int cap = 0, bcap = 0;
    kv_jsonl it;
    kv_jsonl_init(&it, text, len);
    const char *s;
    size_t n;
    kv_status st = KV_OK;
    while (!st && kv_jsonl_next(&it, &s, &n, NULL)) {
        kv_niah_task *nt = kv_grow(out->tasks, out->n, &cap, sizeof *nt, 64);
        if (!nt) {
            st = kv_fail(KV_E_NOMEM, "%s", name);
            break;
        }
        out->tasks = nt;
        kv_niah_task *t = &out->tasks[out->n];
        memset(t, 0, sizeof *t);
        t->line = it.line;
        kv_status ls = memchr(s, 0, n) ? kv_fail(KV_E_DATA, "NUL byte in a JSON line")
                                       : parse_line(s, n, out->n, t);
        if (!ls) {
            out->n++;
            continue;
        }
        if (ls != KV_E_DATA || !lenient) {
            kv_errcontext("%s:%d", name, it.line);
            st = ls;
            break;
        }
        st = kv_niah_bad_add(&out->bad, &out->n_bad, &bcap, it.line, name);
    }
    if (!st && out->n == 0 && out->n_bad == 0) st = kv_fail(KV_E_DATA, "%s: no tasks", name);
    if (st) {
        kv_niah_clear(out);
        return st;
    }
    assign_ids(out);
    return KV_OK;
}

kv_status kv_niah_parse(const char *text, size_t len, const char *name, kv_niah_set *out)
{
    return parse_all(text, len, name, false, out);
}

kv_status kv_niah_parse_lenient(const char *text, size_t len, const char *name,
                                kv_niah_set *out)
{
    return parse_all(text, len, name, true, out);
}

static kv_status load(const char *path, bool lenient, kv_niah_set *out)
{
    char *buf;
    size_t len;
    memset(out, 0, sizeof *out);
    kv_status st = kv_file_slurp(path, 0, "tasks", &buf, &len);
    if (st) return st;
    st = parse_all(buf, len, strcmp(path, "-") ? path : "<stdin>", lenient, out);
    free(buf);
    return st;
}

kv_status kv_niah_load(const char *path, kv_niah_set *out) { return load(path, false, out); }
kv_status kv_niah_load_lenient(const char *path, kv_niah_set *out) { return load(path, true, out); }

void kv_niah_task_name(const char *path, char *buf, size_t cap)
{
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    size_t l = strlen(base);
    if (l > 6 && !strcmp(base + l - 6, ".jsonl")) l -= 6;
    if (slash && slash > path && ((l == 10 && !strncmp(base, "validation", 10)) ||
                                  (l == 4 && !strncmp(base, "test", 4)))) {
        const char *d = slash;
        while (d > path && d[-1] != '/') d--;
        snprintf(buf, cap, "%.*s", (int)(slash - d), d);
        return;
    }
    if (!strcmp(path, "-")) {
        snprintf(buf, cap, "stdin");
        return;
    }
    snprintf(buf, cap, "%.*s", (int)l, base);
}

int kv_niah_task_gen(const char *task)
{
    bool known;
    kv_ruler_task_metric(task, &known);
    if (!known) return 0;
    /* RULER's scripts/data/synthetic/constants.py tokens_to_generate */
    if (!strncmp(task, "niah", 4)) return 128;
    if (!strcmp(task, "vt")) return 30;
    if (!strcmp(task, "cwe")) return 120;
    if (!strcmp(task, "fwe")) return 50;
    return 32; /* qa_1, qa_2 */
}

// --- scoring --------------------------------------------------------------

double kv_niah_score_metric(const kv_niah_task *t, const char *pred, kv_ruler_metric m)
{
    if (t->n_outputs <= 0) return 0.0;
    char *pp = kv_ruler_postprocess(pred);
    double s = 0.0;
    if (pp && kv_ruler_sample_score(m, pp, (const char *const *)t->outputs, t->n_outputs, &s))
        s = 0.0;
    free(pp);
    return s;
}

double kv_niah_score(const kv_niah_task *t, const char *pred)
{
    return kv_niah_score_metric(t, pred, KV_RULER_MATCH_ALL);
}

long kv_niah_question_offset(const char *input)
{
    const char *key = "\nQuestion:", *last = NULL;
    for (const char *p = strstr(input, key); p; p = strstr(p + 1, key)) last = p;
    return last ? (long)(last - input) : -1;
}

long kv_niah_task_split(const kv_niah_task *t)
{
    long q = kv_niah_question_offset(t->input);
    if (q > 0 || !t->answer_prefix) return q;
    const char *nl = strrchr(t->input, '\n');
    return nl && nl > t->input ? (long)(nl - t->input) : -1;
}

// --- running ----------------------------------------------------------------

void kv_niah_opts_default(kv_niah_opts *o)
{
    o->mode = KV_NIAH_QUESTION;
    o->gen = 7;
    o->metric = KV_RULER_MATCH_ALL;
}

void kv_niah_result_clear(kv_niah_result *r)
{
    free(r->pred);
    r->pred = NULL;
}

kv_status kv_niah_prepare(const kv_tokenizer *tok, const kv_niah_task *t, kv_niah_mode mode,
                          int **ids, int *n, int *split, kv_niah_mode *mode_used)
{
    *ids = NULL;
    const char *ap = t->answer_prefix ? t->answer_prefix : "";
    size_t li = strlen(t->input), la = strlen(ap);
    char *prompt = malloc(li + la + 1);
    if (!prompt) return kv_fail(KV_E_NOMEM, "prompt");
    memcpy(prompt, t->input, li);
    memcpy(prompt + li, ap, la + 1);
    kv_status st = kv_tokenizer_encode(tok, prompt, li + la, true, false, ids, n);
    *split = st ? 0 : *n;
    *mode_used = KV_NIAH_PREFILL;
    long off = mode == KV_NIAH_QUESTION ? kv_niah_task_split(t) : -1;
    if (!st && off > 0) {
        st = kv_gen_split(tok, prompt, (size_t)off, *ids, *n, split);
        *mode_used = KV_NIAH_QUESTION;
    }
    free(prompt);
    if (st) {
        free(*ids);
        *ids = NULL;
    }
    return st;
}

kv_status kv_niah_run_prepared(kv_runner *e, const kv_tokenizer *tok,
                               const kv_policy_params *per_layer, const kv_niah_task *t,
                               const kv_niah_opts *o, const int *ids, int n, int split,
                               kv_niah_mode mode_used, kv_niah_result *r)
{
    memset(r, 0, sizeof *r);
    kv_gen_req q = {ids, n, split, o->gen, kv_tokenizer_eos(tok), -1, 0};
    kv_gen_result g;
    kv_status st = kv_gen_run(e, tok, per_layer, &q, &g);
    if (st) return st;
    r->pred = g.text;
    r->score = kv_niah_score_metric(t, g.text, o->metric);
    r->mode = mode_used;
    r->prompt_tokens = g.prompt_tokens;
    r->dense_tokens = g.dense_tokens;
    r->decoded = g.decoded;
    r->gen_tokens = g.n_new;
    r->bytes = g.bytes;
    r->fetched_per_step = g.fetched_per_step;
    r->full_bytes = g.full_bytes;
    r->ms = g.ms;
    r->prefill_ms = g.prefill_ms;
    r->decode_ms = g.decode_ms;
    return KV_OK;
}

kv_status kv_niah_run(kv_runner *e, const kv_tokenizer *tok, const kv_policy_params *per_layer,
                      const kv_niah_task *t, const kv_niah_opts *o, kv_niah_result *r)
{
    memset(r, 0, sizeof *r);
    int *ids, n, split;
    kv_niah_mode used;
    kv_status st = kv_niah_prepare(tok, t, o->mode, &ids, &n, &split, &used);
    if (st) return st;
    st = kv_niah_run_prepared(e, tok, per_layer, t, o, ids, n, split, used, r);
    free(ids);
    return st;
}
