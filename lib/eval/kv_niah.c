/*
 * kv_niah: RULER JSONL reading, string_match_all scoring, and the greedy
 * needle run through a kv_runner (see kv_niah.h for the two modes).
 */
#include "eval/kv_niah.h"

#include "common/kv_file.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// --- reading ------------------------------------------------------------

static void task_free(kv_niah_task *t)
{
    free(t->input);
    for (int i = 0; i < t->n_outputs; i++) free(t->outputs[i]);
    free(t->outputs);
}

void kv_niah_clear(kv_niah_set *s)
{
    for (int i = 0; i < s->n; i++) task_free(&s->tasks[i]);
    free(s->tasks);
    s->tasks = NULL;
    s->n = 0;
}

static char *dupstr(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* One JSON line into t; the message names the line. */
static kv_status parse_line(const char *line, size_t len, const char *name, int lineno,
                            int ordinal, kv_niah_task *t)
{
    memset(t, 0, sizeof *t);
    t->line = lineno;
    cJSON *j = cJSON_ParseWithLength(line, len);
    if (!j) return kv_fail(KV_E_DATA, "%s:%d: not valid JSON", name, lineno);
    kv_status st = KV_OK;
    const cJSON *in = cJSON_GetObjectItemCaseSensitive(j, "input");
    const cJSON *outs = cJSON_GetObjectItemCaseSensitive(j, "outputs");
    const cJSON *idx = cJSON_GetObjectItemCaseSensitive(j, "index");
    const cJSON *ln = cJSON_GetObjectItemCaseSensitive(j, "length");
    if (!cJSON_IsObject(j)) {
        st = kv_fail(KV_E_DATA, "%s:%d: a task must be a JSON object", name, lineno);
    } else if (!cJSON_IsString(in)) {
        st = kv_fail(KV_E_DATA, "%s:%d: \"input\" missing or not a string", name, lineno);
    } else if (!cJSON_IsArray(outs) || cJSON_GetArraySize(outs) < 1) {
        st = kv_fail(KV_E_DATA, "%s:%d: \"outputs\" missing or not a non-empty array", name, lineno);
    } else if (idx && !cJSON_IsNumber(idx)) {
        st = kv_fail(KV_E_DATA, "%s:%d: \"index\" is not a number", name, lineno);
    } else if (ln && !cJSON_IsNumber(ln)) {
        st = kv_fail(KV_E_DATA, "%s:%d: \"length\" is not a number", name, lineno);
    }
    if (st == KV_OK) {
        int n = cJSON_GetArraySize(outs);
        t->index = idx ? (int)idx->valuedouble : ordinal;
        t->length = ln ? (int)ln->valuedouble : 0;
        t->input = dupstr(in->valuestring);
        t->outputs = calloc((size_t)n, sizeof(char *));
        if (!t->input || !t->outputs) st = kv_fail(KV_E_NOMEM, "%s:%d", name, lineno);
        for (int i = 0; i < n && st == KV_OK; i++) {
            const cJSON *o = cJSON_GetArrayItem(outs, i);
            if (!cJSON_IsString(o)) {
                st = kv_fail(KV_E_DATA, "%s:%d: outputs[%d] is not a string", name, lineno, i);
            } else if (!(t->outputs[i] = dupstr(o->valuestring))) {
                st = kv_fail(KV_E_NOMEM, "%s:%d", name, lineno);
            } else {
                t->n_outputs++;
            }
        }
    }
    cJSON_Delete(j);
    if (st) task_free(t);
    return st;
}

kv_status kv_niah_parse(const char *text, size_t len, const char *name, kv_niah_set *out)
{
    out->tasks = NULL;
    out->n = 0;
    int cap = 0, lineno = 0;
    size_t pos = 0;
    while (pos < len) {
        const char *nl = memchr(text + pos, '\n', len - pos);
        size_t end = nl ? (size_t)(nl - text) : len;
        lineno++;
        size_t a = pos, b = end;
        while (a < b && isspace((unsigned char)text[a])) a++;
        while (b > a && isspace((unsigned char)text[b - 1])) b--;
        pos = end + 1;
        if (a == b) continue;
        if (memchr(text + a, 0, b - a)) {
            kv_niah_clear(out);
            return kv_fail(KV_E_DATA, "%s:%d: NUL byte in a JSON line", name, lineno);
        }
        if (out->n == cap) {
            int nc = cap ? cap * 2 : 64;
            kv_niah_task *nt = realloc(out->tasks, (size_t)nc * sizeof *nt);
            if (!nt) {
                kv_niah_clear(out);
                return kv_fail(KV_E_NOMEM, "%s", name);
            }
            out->tasks = nt;
            cap = nc;
        }
        kv_status st = parse_line(text + a, b - a, name, lineno, out->n, &out->tasks[out->n]);
        if (st) {
            kv_niah_clear(out);
            return st;
        }
        out->n++;
    }
    if (out->n == 0) return kv_fail(KV_E_DATA, "%s: no tasks", name);
    return KV_OK;
}

kv_status kv_niah_load(const char *path, kv_niah_set *out)
{
    char *buf;
    size_t len;
    out->tasks = NULL;
    out->n = 0;
    kv_status st = kv_file_slurp(path, 0, "tasks", &buf, &len);
    if (st) return st;
    st = kv_niah_parse(buf, len, strcmp(path, "-") ? path : "<stdin>", out);
    free(buf);
    return st;
}

// --- scoring --------------------------------------------------------------

/* Case-insensitive (ASCII) substring test, as RULER lower()s both sides. */
static bool contains_ci(const char *hay, const char *needle)
{
    size_t n = strlen(needle);
    if (n == 0) return true;
    for (const char *h = hay; *h; h++) {
        size_t i = 0;
        while (i < n && h[i] && tolower((unsigned char)h[i]) == tolower((unsigned char)needle[i])) i++;
        if (i == n) return true;
    }
    return false;
}

double kv_niah_score(const kv_niah_task *t, const char *pred)
{
    if (t->n_outputs <= 0) return 0.0;
    int hit = 0;
    for (int i = 0; i < t->n_outputs; i++) hit += contains_ci(pred, t->outputs[i]);
    return (double)hit / (double)t->n_outputs;
}

long kv_niah_question_offset(const char *input)
{
    const char *key = "\nQuestion:", *last = NULL;
    for (const char *p = strstr(input, key); p; p = strstr(p + 1, key)) last = p;
    return last ? (long)(last - input) : -1;
}

// --- running ----------------------------------------------------------------

void kv_niah_opts_default(kv_niah_opts *o)
{
    o->mode = KV_NIAH_QUESTION;
    o->gen = 7;
}

void kv_niah_result_clear(kv_niah_result *r)
{
    free(r->pred);
    r->pred = NULL;
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

kv_status kv_niah_run(kv_runner *e, const kv_tokenizer *tok, const kv_policy_params *per_layer,
                      const kv_niah_task *t, const kv_niah_opts *o, kv_niah_result *r)
{
    memset(r, 0, sizeof *r);
    double t0 = now_ms();
    int *ids = NULL, *pre = NULL, n = 0, npre = 0;
    float *logits = NULL;
    size_t plen = 0, pcap = 64;
    char *pred = malloc(pcap);
    kv_status st = pred ? KV_OK : kv_fail(KV_E_NOMEM, "niah");
    if (st == KV_OK) st = kv_tokenizer_encode(tok, t->input, strlen(t->input), true, false, &ids, &n);
    /* Dense part: everything (prefill mode), or the tokens the haystack up
     * to the last "\nQuestion:" encodes to (the common prefix of the two
     * encodings, so a merging tokenizer splits where the texts agree). */
    int split = n;
    long qoff = kv_niah_question_offset(t->input);
    if (st == KV_OK && o->mode == KV_NIAH_QUESTION && qoff > 0) {
        st = kv_tokenizer_encode(tok, t->input, (size_t)qoff, true, false, &pre, &npre);
        if (st == KV_OK) {
            split = 0;
            while (split < npre && split < n && pre[split] == ids[split]) split++;
            if (split < 1) split = 1;
        }
    }
    const int ctx = kv_runner_ctx(e), vocab = kv_runner_vocab(e);
    if (st == KV_OK && n > ctx)
        st = kv_fail(KV_E_USAGE, "task %d: prompt of %d tokens exceeds the context %d", t->index, n, ctx);
    if (st == KV_OK && !(logits = malloc((size_t)vocab * sizeof(float))))
        st = kv_fail(KV_E_NOMEM, "niah logits");
    if (st == KV_OK) st = kv_runner_reset(e, per_layer);
    if (st == KV_OK) st = kv_runner_prefill(e, ids, split, logits);
    for (int i = split; i < n && st == KV_OK; i++) st = kv_runner_step(e, ids[i], logits);
    r->prompt_tokens = n;
    r->dense_tokens = split;
    r->decoded = n - split;
    int prev = n ? ids[n - 1] : 0;
    for (int g = 0; g < o->gen && st == KV_OK; g++) {
        int next = argmax(logits, vocab);
        size_t bl;
        const char *piece = kv_tokenizer_decode(tok, prev, next, &bl);
        if (piece) {
            if (plen + bl + 1 > pcap) {
                while (plen + bl + 1 > pcap) pcap *= 2;
                char *np = realloc(pred, pcap);
                if (!np) {
                    st = kv_fail(KV_E_NOMEM, "niah prediction");
                    break;
                }
                pred = np;
            }
            memcpy(pred + plen, piece, bl);
            plen += bl;
        }
        prev = next;
        /* the last generated token needs no step; nor one past the context */
        if (g + 1 < o->gen && kv_runner_pos(e) < ctx) {
            st = kv_runner_step(e, next, logits);
            r->decoded++;
        } else if (g + 1 < o->gen) {
            break;
        }
    }
    if (pred) pred[plen] = 0;
    if (st == KV_OK) {
        kv_runner_bytes(e, &r->bytes);
        int steps = r->decoded;
        r->fetched_per_step = steps > 0 ? (double)r->bytes.fetched_total / steps : 0.0;
        const kv_model *m = kv_runner_model(e);
        r->full_bytes = 2.0 * m->cfg.n_layers * m->cfg.n_kv_heads * (double)kv_runner_pos(e) *
                        m->cfg.head_dim * 2.0;
        r->score = kv_niah_score(t, pred);
        r->pred = pred;
        pred = NULL;
    }
    r->ms = now_ms() - t0;
    free(pred);
    free(logits);
    free(pre);
    free(ids);
    return st;
}
