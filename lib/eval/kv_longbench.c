/*
 * kv_longbench: LongBench data, prompt templates, pred.py's truncation, the
 * batch, its summary and its prediction files (see kv_longbench.h).
 */
#include "eval/kv_longbench.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_file.h"
#include "common/kv_outfile.h"
#include "common/kv_json.h"
#include "common/kv_text.h"
#include "eval/kv_gen.h"
#include "eval/kv_jsonl.h"
#include "eval/kv_score.h"
#include "format/kvc.h"

// --- data files ---------------------------------------------------------------------

static void sample_free(kv_lb_sample *s)
{
    cJSON_Delete(s->obj);
    kv_strings_free(s->answers, s->n_answers);
    kv_strings_free(s->classes, s->n_classes);
    memset(s, 0, sizeof *s);
}

void kv_lb_file_free(kv_lb_file *f)
{
    for (int i = 0; i < f->n; i++) sample_free(&f->v[i]);
    for (int i = 0; i < f->n_bad; i++) free(f->bad[i].why);
    free(f->v);
    free(f->bad);
    f->v = NULL;
    f->bad = NULL;
    f->n = f->n_bad = 0;
}

static kv_status sample_parse(const char *s, size_t n, int line, kv_lb_sample *x)
{
    memset(x, 0, sizeof *x);
    x->line = line;
    x->length = -1;
    if (memchr(s, 0, n)) return kv_fail(KV_E_DATA, "NUL byte in a JSON line");
    cJSON *j = cJSON_ParseWithLength(s, n);
    if (!j) return kv_fail(KV_E_DATA, "not valid JSON");
    x->obj = j;
    if (!cJSON_IsObject(j)) return kv_fail(KV_E_DATA, "a sample must be a JSON object");
    const cJSON *an = cJSON_GetObjectItemCaseSensitive(j, "answers");
    const cJSON *cl = cJSON_GetObjectItemCaseSensitive(j, "all_classes");
    const cJSON *ln = cJSON_GetObjectItemCaseSensitive(j, "length");
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(j, "_id");
    if (!an) return kv_fail(KV_E_DATA, "\"answers\" missing");
    kv_status st = kv_json_strings(an, "answers", &x->answers, &x->n_answers);
    if (st) return st;
    if (cl && !cJSON_IsNull(cl)) {
        if ((st = kv_json_strings(cl, "all_classes", &x->classes, &x->n_classes))) return st;
        x->has_classes = true;
    }
    if (ln && !cJSON_IsNull(ln) && !kv_json_int(ln, 0, 1LL << 53, &x->length))
        return kv_fail(KV_E_DATA, "\"length\" is not an integer in [0, 2^53]");
    if (id && !cJSON_IsString(id)) return kv_fail(KV_E_DATA, "\"_id\" is not a string");
    if (id && (strlen(id->valuestring) >= sizeof x->id || !id->valuestring[0]))
        return kv_fail(KV_E_DATA, "\"_id\" is empty or longer than %zu bytes", sizeof x->id - 1);
    if (id) snprintf(x->id, sizeof x->id, "%s", id->valuestring);
    else snprintf(x->id, sizeof x->id, "line:%d", line);
    return KV_OK;
}

static kv_status name_file(const char *path, kv_lb_file *f)
{
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    size_t l = strlen(base);
    if (l > 6 && !strcmp(base + l - 6, ".jsonl")) l -= 6;
    if (l == 0 || l >= sizeof f->stem) return kv_fail(KV_E_USAGE, "%s: no dataset name in the file name", path);
    memcpy(f->stem, base, l);
    f->stem[l] = 0;
    snprintf(f->dataset, sizeof f->dataset, "%s", f->stem);
    size_t dl = strlen(f->dataset);
    if (dl > 2 && !strcmp(f->dataset + dl - 2, "_e")) {
        f->dataset[dl - 2] = 0;
        f->e = true;
    }
    f->ds = kv_lb_dataset_find(f->dataset);
    if (!f->ds)
        return kv_fail(KV_E_DATA, "%s: '%s' is not one of LongBench's 21 datasets (name the file "
                       "<dataset>.jsonl or <dataset>_e.jsonl)", path, f->dataset);
    return KV_OK;
}

kv_status kv_lb_file_parse(const char *text, size_t len, const char *path, kv_lb_file *f)
{
    memset(f, 0, sizeof *f);
    f->path = path;
    kv_status st = name_file(path, f);
    if (st) return st;
    int cap = 0, bcap = 0;
    kv_jsonl it;
    kv_jsonl_init(&it, text, len);
    const char *s;
    size_t n;
    while (!st && kv_jsonl_next(&it, &s, &n, NULL)) {
        kv_lb_sample *nv = kv_grow(f->v, f->n, &cap, sizeof *nv, 64);
        if (!nv) {
            st = kv_fail(KV_E_NOMEM, "%s", path);
            break;
        }
        f->v = nv;
        kv_status ls = sample_parse(s, n, it.line, &f->v[f->n]);
        if (!ls) {
            /* ids must be unique: they key resume and shards */
            for (int k = 0; k < f->n && !ls; k++)
                if (!strcmp(f->v[k].id, f->v[f->n].id))
                    ls = kv_fail(KV_E_DATA, "\"_id\" %s repeats line %d", f->v[k].id, f->v[k].line);
            if (!ls) {
                f->n++;
                continue;
            }
        }
        sample_free(&f->v[f->n]);
        if (ls != KV_E_DATA) {
            st = ls;
            break;
        }
        st = kv_niah_bad_add(&f->bad, &f->n_bad, &bcap, it.line, path);
    }
    if (!st && f->n == 0 && f->n_bad == 0) st = kv_fail(KV_E_DATA, "%s: no samples", path);
    if (st) kv_lb_file_free(f);
    return st;
}

kv_status kv_lb_file_load(const char *path, kv_lb_file *f)
{
    char *buf;
    size_t len;
    memset(f, 0, sizeof *f);
    kv_status st = kv_file_slurp(path, 0, "LongBench data", &buf, &len);
    if (st) return st;
    st = kv_lb_file_parse(buf, len, path, f);
    free(buf);
    return st;
}

// --- templates --------------------------------------------------------------------------

/* Walk a format string: literal runs and fields.  emit gets (text, len,
 * field?) in order; a field's text is its name. */
typedef kv_status (*fmt_cb)(void *ctx, const char *s, size_t n, bool field);

static kv_status fmt_walk(const char *t, fmt_cb cb, void *ctx)
{
    kv_status st = KV_OK;
    const char *p = t, *lit = t;
    while (*p && !st) {
        if ((p[0] == '{' && p[1] == '{') || (p[0] == '}' && p[1] == '}')) {
            st = cb(ctx, lit, (size_t)(p - lit) + 1, false); /* one brace of the pair */
            p += 2;
            lit = p;
            continue;
        }
        if (*p == '}') return kv_fail(KV_E_DATA, "single '}' in the template");
        if (*p != '{') {
            p++;
            continue;
        }
        if ((st = cb(ctx, lit, (size_t)(p - lit), false))) break;
        const char *e = strchr(p + 1, '}');
        if (!e) return kv_fail(KV_E_DATA, "'{' without '}' in the template");
        size_t n = (size_t)(e - p - 1);
        if (n == 0) return kv_fail(KV_E_DATA, "a positional field {} in the template (name it)");
        for (const char *q = p + 1; q < e; q++)
            if (strchr("{!:.[]", *q))
                return kv_fail(KV_E_DATA, "field {%.*s}: conversions, format specs, attributes "
                               "and indexes are not supported", (int)n, p + 1);
        if (p[1] >= '0' && p[1] <= '9')
            return kv_fail(KV_E_DATA, "a positional field {%.*s} in the template (name it)", (int)n, p + 1);
        st = cb(ctx, p + 1, n, true);
        p = e + 1;
        lit = p;
    }
    if (!st) st = cb(ctx, lit, (size_t)(p - lit), false);
    return st;
}

static kv_status check_cb(void *ctx, const char *s, size_t n, bool field)
{
    (void)ctx;
    (void)s;
    (void)n;
    (void)field;
    return KV_OK;
}

kv_status kv_lb_template_check(const char *tmpl) { return fmt_walk(tmpl, check_cb, NULL); }

typedef struct {
    const cJSON *obj;
    kv_text t;
    long ctx_end;
} fmt_out;

static kv_status out_add(fmt_out *o, const char *s, size_t n) { return kv_text_add(&o->t, s, n, "prompt"); }

static kv_status fill_cb(void *ctx, const char *s, size_t n, bool field)
{
    fmt_out *o = ctx;
    if (!field) return out_add(o, s, n);
    char name[128];
    if (n >= sizeof name) return kv_fail(KV_E_DATA, "field name too long");
    memcpy(name, s, n);
    name[n] = 0;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o->obj, name);
    kv_status st;
    char num[64];
    if (!v) return kv_fail(KV_E_DATA, "no field \"%s\", which the template needs", name);
    if (cJSON_IsString(v)) {
        st = out_add(o, v->valuestring, strlen(v->valuestring));
    } else if (cJSON_IsNumber(v)) { /* Python's str(): integers as integers */
        double d = v->valuedouble;
        if (d == floor(d) && fabs(d) < 9007199254740992.0) snprintf(num, sizeof num, "%.0f", d);
        else kv_py_repr(d, num, sizeof num);
        st = out_add(o, num, strlen(num));
    } else if (cJSON_IsBool(v)) {
        st = out_add(o, cJSON_IsTrue(v) ? "True" : "False", cJSON_IsTrue(v) ? 4 : 5);
    } else if (cJSON_IsNull(v)) {
        st = out_add(o, "None", 4);
    } else {
        return kv_fail(KV_E_DATA, "field \"%s\" is an array or object, not text", name);
    }
    if (!st && !strcmp(name, "context")) o->ctx_end = (long)o->t.n;
    return st;
}

kv_status kv_lb_format(const char *tmpl, const cJSON *obj, char **out, long *ctx_end)
{
    fmt_out o = {obj, {0}, -1};
    kv_status st = out_add(&o, "", 0);
    if (!st) st = fmt_walk(tmpl, fill_cb, &o);
    if (st) {
        free(o.t.s);
        *out = NULL;
        return st;
    }
    *out = o.t.s;
    *ctx_end = o.ctx_end;
    return KV_OK;
}

// --- the config tables ----------------------------------------------------------------

void kv_lb_table_free(kv_lb_table *t)
{
    kv_strings_free(t->name, t->n);
    kv_strings_free(t->text, t->text ? t->n : 0);
    free(t->num);
    memset(t, 0, sizeof *t);
}

int kv_lb_table_find(const kv_lb_table *t, const char *name)
{
    for (int i = 0; i < t->n; i++)
        if (!strcmp(t->name[i], name)) return i;
    return -1;
}

static kv_status table_parse(const char *text, size_t len, const char *name, bool prompts,
                             kv_lb_table *out)
{
    memset(out, 0, sizeof *out);
    uint64_t h = 14695981039346656037ULL;
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)text[i]) * 1099511628211ULL;
    out->hash = h;
    if (memchr(text, 0, len)) return kv_fail(KV_E_DATA, "%s: NUL byte", name);
    cJSON *j = cJSON_ParseWithLength(text, len);
    if (!j || !cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return kv_fail(KV_E_DATA, "%s: not a JSON object (want {\"dataset\": %s, ...})", name,
                       prompts ? "\"template\"" : "tokens");
    }
    int n = cJSON_GetArraySize(j);
    out->name = calloc((size_t)n + 1, sizeof *out->name);
    if (prompts) out->text = calloc((size_t)n + 1, sizeof *out->text);
    else out->num = calloc((size_t)n + 1, sizeof *out->num);
    kv_status st = out->name && (out->text || out->num) ? KV_OK : kv_fail(KV_E_NOMEM, "%s", name);
    for (const cJSON *x = j->child; x && !st; x = x->next) {
        long long v = 0;
        if (kv_lb_table_find(out, x->string) >= 0) {
            st = kv_fail(KV_E_DATA, "%s: \"%s\" given twice", name, x->string);
        } else if (prompts && !cJSON_IsString(x)) {
            st = kv_fail(KV_E_DATA, "%s: \"%s\" is not a string", name, x->string);
        } else if (prompts && (st = kv_lb_template_check(x->valuestring))) {
            kv_errcontext("%s: \"%s\"", name, x->string);
        } else if (!prompts && !kv_json_int(x, 1, 65536, &v)) {
            st = kv_fail(KV_E_DATA, "%s: \"%s\" is not an integer in [1, 65536]", name, x->string);
        } else {
            int i = out->n;
            if (!(out->name[i] = kv_strdup(x->string))) st = kv_fail(KV_E_NOMEM, "%s", name);
            else if (prompts && !(out->text[i] = kv_strdup(x->valuestring))) {
                free(out->name[i]);
                st = kv_fail(KV_E_NOMEM, "%s", name);
            } else {
                if (!prompts) out->num[i] = (int)v;
                out->n++;
            }
        }
    }
    cJSON_Delete(j);
    if (!st && out->n == 0) st = kv_fail(KV_E_DATA, "%s: no datasets", name);
    if (st) kv_lb_table_free(out);
    return st;
}

kv_status kv_lb_prompts_parse(const char *text, size_t len, const char *name, kv_lb_table *out)
{
    return table_parse(text, len, name, true, out);
}

kv_status kv_lb_maxlen_parse(const char *text, size_t len, const char *name, kv_lb_table *out)
{
    return table_parse(text, len, name, false, out);
}

kv_status kv_lb_table_load(const char *path, bool prompts, kv_lb_table *out)
{
    char *buf;
    size_t len;
    memset(out, 0, sizeof *out);
    kv_status st = kv_file_slurp(path, 1 << 24, prompts ? "prompt templates" : "generation lengths",
                                 &buf, &len);
    if (st) return st;
    st = table_parse(buf, len, path, prompts, out);
    free(buf);
    return st;
}

// --- prompts ------------------------------------------------------------------------------

kv_status kv_lb_prepare(const kv_tokenizer *tok, const char *tmpl, const kv_lb_sample *s,
                        const kv_lb_dataset *ds, int max_length, const kv_chat *chat,
                        kv_niah_mode mode, kv_lb_prompt *p)
{
    memset(p, 0, sizeof *p);
    char *prompt = NULL, *cut = NULL;
    long ctx_end;
    kv_status st = kv_lb_format(tmpl, s->obj, &prompt, &ctx_end);
    if (st) return st;
    size_t plen = strlen(prompt);
    /* the text after the context, to find the context's end after a cut */
    const char *tail = ctx_end >= 0 ? prompt + ctx_end : NULL;
    size_t tail_len = tail ? plen - (size_t)ctx_end : 0;
    int *ids = NULL, n = 0;
    st = kv_tokenizer_encode(tok, prompt, plen, true, false, &ids, &n);
    if (!st && n > max_length) { /* pred.py: the first and last int(max_length/2) tokens */
        int half = max_length / 2;
        char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        st = kv_gen_detok(tok, ids, half, &a, &la);
        if (!st) st = kv_gen_detok(tok, ids + n - half, half, &b, &lb);
        if (!st && !(cut = malloc(la + lb + 1))) st = kv_fail(KV_E_NOMEM, "prompt");
        if (!st) {
            memcpy(cut, a, la);
            memcpy(cut + la, b, lb);
            cut[la + lb] = 0;
            p->truncated = true;
        }
        free(a);
        free(b);
    }
    const char *text = cut ? cut : prompt;
    size_t tlen = strlen(text);
    long split_at = -1; /* byte offset of the context's end in text */
    if (tail && (!cut || (tlen >= tail_len && !memcmp(text + tlen - tail_len, tail, tail_len))))
        split_at = (long)(tlen - tail_len);
    const bool wrap = chat && chat->kind != KV_CHAT_NONE && ds->chat;
    if (!st && (cut || wrap)) { /* encode the prompt that runs */
        free(ids);
        ids = NULL;
        st = wrap ? kv_chat_encode(tok, chat, NULL, text, tlen, false, &ids, &n)
                  : kv_tokenizer_encode(tok, text, tlen, true, false, &ids, &n);
    }
    p->mode = KV_NIAH_PREFILL;
    p->split = n;
    if (!st && mode == KV_NIAH_QUESTION && split_at > 0) {
        st = wrap ? kv_chat_split(tok, chat, NULL, text, (size_t)split_at, false, ids, n, &p->split)
                  : kv_gen_split(tok, text, (size_t)split_at, ids, n, &p->split);
        p->mode = KV_NIAH_QUESTION;
    }
    free(prompt);
    free(cut);
    if (st) {
        free(ids);
        return st;
    }
    p->ids = ids;
    p->n = n;
    return KV_OK;
}

// --- the batch --------------------------------------------------------------------------------

cJSON *kv_lb_header(const char *model, const char *tokenizer, const char *device_kind,
                    const char *device_name, const kv_lb_file *files, int nf,
                    const kv_lb_table *prompts, const kv_lb_table *maxlen, const kv_lb_opts *o)
{
    cJSON *h = cJSON_CreateObject(), *c = cJSON_CreateObject(), *fs = cJSON_CreateArray();
    if (!h || !c || !fs) {
        cJSON_Delete(h);
        cJSON_Delete(c);
        cJSON_Delete(fs);
        return NULL;
    }
    char hex[40];
    cJSON_AddNumberToObject(h, "kv_bench_log", KV_BATCH_LOG_VERSION);
    cJSON_AddStringToObject(h, "bench", "longbench");
    cJSON_AddStringToObject(c, "model", model);
    if (tokenizer) cJSON_AddStringToObject(c, "tokenizer", tokenizer);
    else cJSON_AddNullToObject(c, "tokenizer");
    cJSON_AddStringToObject(c, "device", device_kind);
    cJSON_AddStringToObject(c, "mode", o->mode == KV_NIAH_QUESTION ? "question" : "prefill");
    cJSON_AddNumberToObject(c, "max_length", o->max_length);
    cJSON_AddNumberToObject(c, "max_gen", o->max_gen);
    if (o->chat.kind == KV_CHAT_TEMPLATE) cJSON_AddStringToObject(c, "chat", o->chat.tmpl);
    else if (o->chat.kind != KV_CHAT_NONE) cJSON_AddStringToObject(c, "chat", kv_chat_name(o->chat.kind));
    else cJSON_AddNullToObject(c, "chat");
    cJSON_AddNumberToObject(c, "limit", o->limit);
    snprintf(hex, sizeof hex, "%016llx", prompts->hash);
    cJSON_AddStringToObject(c, "prompts_hash", hex);
    snprintf(hex, sizeof hex, "%016llx", maxlen->hash);
    cJSON_AddStringToObject(c, "maxlen_hash", hex);
    for (int i = 0; i < nf; i++) {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "path", files[i].path);
        cJSON_AddStringToObject(f, "task", files[i].stem);
        cJSON_AddStringToObject(f, "dataset", files[i].dataset);
        cJSON_AddBoolToObject(f, "e", files[i].e);
        cJSON_AddStringToObject(f, "metric", kv_lb_metric_name(files[i].ds->metric));
        cJSON_AddItemToArray(fs, f);
    }
    cJSON_AddItemToObject(c, "files", fs);
    cJSON_AddItemToObject(h, "config", c);
    cJSON_AddStringToObject(h, "device_name", device_name);
    return h;
}

static kv_status run_sample(kv_runner *e, const kv_tokenizer *tok, const kv_jieba *jb,
                            const kv_lb_file *f, int fi, const kv_lb_sample *s,
                            const kv_lb_prompt *pr, int max_gen, int nl_id,
                            const kv_batch_policy *pol, kv_batch_log *log, cJSON *records)
{
    kv_gen_req q = {pr->ids, pr->n, pr->split, max_gen, kv_tokenizer_eos(tok),
                    f->ds->stop_newline ? nl_id : -1, f->ds->stop_newline ? 1 : 0};
    kv_gen_result g;
    kv_status st = kv_gen_run(e, tok, pol->per_layer, &q, &g);
    if (st) {
        kv_errcontext("%s:%d (%s)", f->path, s->line, pol->label);
        return st;
    }
    double score = 0;
    st = kv_lb_sample_score(f->ds, jb, g.text, (const char *const *)s->answers, s->n_answers,
                            (const char *const *)s->classes, s->n_classes, s->has_classes, &score);
    if (st) {
        kv_errcontext("%s:%d", f->path, s->line);
        kv_gen_result_free(&g);
        return st;
    }
    cJSON *r = kv_batch_record("longbench", f->stem, s->id, fi, s->line, s->length, pol->label);
    cJSON *an = cJSON_CreateStringArray((const char *const *)s->answers, s->n_answers);
    cJSON *cl = s->has_classes ? cJSON_CreateStringArray((const char *const *)s->classes, s->n_classes)
                               : cJSON_CreateNull();
    if (!r || !an || !cl) {
        cJSON_Delete(r);
        cJSON_Delete(an);
        cJSON_Delete(cl);
        kv_gen_result_free(&g);
        return kv_fail(KV_E_NOMEM, "record");
    }
    cJSON_AddNumberToObject(r, "score", score);
    cJSON_AddStringToObject(r, "pred", g.text);
    cJSON_AddItemToObject(r, "answers", an);
    cJSON_AddItemToObject(r, "all_classes", cl);
    cJSON_AddBoolToObject(r, "truncated", pr->truncated);
    cJSON_AddStringToObject(r, "mode", pr->mode == KV_NIAH_QUESTION ? "question" : "prefill");
    cJSON_AddNumberToObject(r, "prompt_tokens", g.prompt_tokens);
    cJSON_AddNumberToObject(r, "dense_tokens", g.dense_tokens);
    cJSON_AddNumberToObject(r, "decoded", g.decoded);
    cJSON_AddNumberToObject(r, "gen_tokens", g.n_new);
    cJSON_AddBoolToObject(r, "ctx_full", g.ctx_full);
    kv_batch_record_cost(r, &g.bytes, g.fetched_per_step, g.full_bytes, g.ms, g.prefill_ms, g.decode_ms);
    kv_gen_result_free(&g);
    return kv_batch_keep(log, records, r);
}

kv_status kv_lb_batch(kv_runner *e, const kv_tokenizer *tok, const kv_jieba *jb,
                      const kv_lb_file *files, int nf, const kv_lb_table *prompts,
                      const kv_lb_table *maxlen, const kv_batch_policy *pols, int np,
                      const kv_lb_opts *o, kv_batch_log *log, const kv_batch_done *done,
                      cJSON *records, const kv_batch_hooks *hooks)
{
    const int ctx = kv_runner_ctx(e);
    /* the "\n" token samsum stops at: encode("\n")[-1] */
    int *nl = NULL, nnl = 0, nl_id = -1;
    kv_status st = kv_tokenizer_encode(tok, "\n", 1, false, false, &nl, &nnl);
    if (st) return st;
    if (nnl > 0) nl_id = nl[nnl - 1];
    free(nl);
    int total = 0;
    for (int fi = 0; fi < nf; fi++)
        for (int i = 0; i < files[fi].n && (!o->limit || i < o->limit); i++) {
            const kv_lb_sample *s = &files[fi].v[i];
            if (!kv_batch_in_shard(files[fi].stem, s->id, o->shard_i, o->shard_n)) continue;
            for (int pi = 0; pi < np; pi++)
                total += !(done && kv_batch_done_has(done, files[fi].stem, s->id, pols[pi].label, s->length));
        }
    kv_batch_meter m;
    kv_batch_meter_start(&m, hooks, total);
    for (int fi = 0; fi < nf && !st; fi++) {
        const kv_lb_file *f = &files[fi];
        int ti = kv_lb_table_find(prompts, f->dataset), gi = kv_lb_table_find(maxlen, f->dataset);
        if (ti < 0 || gi < 0)
            return kv_fail(KV_E_DATA, "%s: no %s for dataset \"%s\"", f->path,
                           ti < 0 ? "prompt template" : "generation length", f->dataset);
        int max_gen = maxlen->num[gi];
        if (o->max_gen > 0 && o->max_gen < max_gen) max_gen = o->max_gen;
        int max_length = o->max_length > 0 ? o->max_length : ctx - max_gen;
        if (max_length < 2) max_length = 2;
        for (int b = 0; b < f->n_bad && !st; b++) {
            char id[32];
            snprintf(id, sizeof id, "line:%d", f->bad[b].line);
            if (!kv_batch_in_shard(f->stem, id, o->shard_i, o->shard_n)) continue;
            if (done && kv_batch_done_has(done, f->stem, id, NULL, -1)) continue;
            st = kv_batch_skip("longbench", f->stem, id, fi, f->path, f->bad[b].line, -1,
                               f->bad[b].why, o->strict, log, records, hooks);
        }
        int no_split = 0, ran = 0;
        for (int i = 0; i < f->n && !st && (!o->limit || i < o->limit); i++) {
            const kv_lb_sample *s = &f->v[i];
            if (!kv_batch_in_shard(f->stem, s->id, o->shard_i, o->shard_n)) continue;
            int todo = 0;
            for (int pi = 0; pi < np; pi++)
                todo += !(done && kv_batch_done_has(done, f->stem, s->id, pols[pi].label, s->length));
            if (!todo) continue;
            kv_lb_prompt pr;
            kv_status ps = kv_lb_prepare(tok, prompts->text[ti], s, f->ds, max_length, &o->chat, o->mode, &pr);
            char why[200] = "";
            if (ps == KV_E_DATA) snprintf(why, sizeof why, "%s", kv_errdetail());
            else if (ps) {
                st = ps;
                break;
            } else if (pr.n > ctx) {
                snprintf(why, sizeof why, "prompt of %d tokens exceeds the context %d", pr.n, ctx);
                free(pr.ids);
            }
            if (why[0]) {
                st = kv_batch_skip("longbench", f->stem, s->id, fi, f->path, s->line, s->length, why,
                                   o->strict, log, records, hooks);
                m.done += todo;
                continue;
            }
            ran++;
            no_split += o->mode == KV_NIAH_QUESTION && pr.mode == KV_NIAH_PREFILL;
            for (int pi = 0; pi < np && !st; pi++) {
                if (done && kv_batch_done_has(done, f->stem, s->id, pols[pi].label, s->length)) continue;
                kv_batch_meter_tick(&m, pols[pi].label, f->stem);
                st = run_sample(e, tok, jb, f, fi, s, &pr, max_gen, nl_id, &pols[pi], log, records);
                m.done++;
                kv_batch_meter_tick(&m, pols[pi].label, f->stem);
            }
            free(pr.ids);
        }
        if (!st && no_split)
            kv_batch_warn(hooks, "%s: %d of %d sample(s) have no end of {context} to split at (the template "
                          "has none, or the truncation cut it): they ran in prefill mode", f->path, no_split, ran);
    }
    return st;
}

// --- the summary ---------------------------------------------------------------------------------

/* The records of (policy, file) in line order (records sorted). */
static int group(cJSON *records, const char *pol, int fi, const cJSON **out, int cap)
{
    int n = 0;
    for (const cJSON *r = records->child; r; r = r->next) {
        const char *p = kv_rec_str(r, "policy", NULL);
        if (p && !strcmp(p, pol) && kv_rec_num(r, "fi", -1) == fi && n < cap) out[n++] = r;
    }
    return n;
}

static kv_status strings_of(const cJSON *arr, char ***out, int *n)
{
    return kv_json_strings(arr, "strings", out, n);
}

/* Per-sample scores as eval.py would give for these records: the stored
 * ones, except that classification uses the last line's all_classes. */
static kv_status scores_of(const cJSON *const *g, int n, const cJSON *fc, double *sc, long long *len)
{
    const kv_lb_dataset *ds = kv_lb_dataset_find(kv_rec_str(fc, "dataset", ""));
    kv_status st = KV_OK;
    char **cls = NULL;
    int ncls = 0;
    bool has = false;
    if (ds && ds->metric == KV_LB_CLASSIFICATION && n > 0) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(g[n - 1], "all_classes");
        if (cJSON_IsArray(c)) {
            st = strings_of(c, &cls, &ncls);
            has = !st;
        }
    }
    for (int k = 0; k < n && !st; k++) {
        sc[k] = kv_rec_num(g[k], "score", 0);
        len[k] = (long long)kv_rec_num(g[k], "length", -1);
        if (!has) continue;
        char **an = NULL;
        int nan = 0;
        if ((st = strings_of(cJSON_GetObjectItemCaseSensitive(g[k], "answers"), &an, &nan))) break;
        st = kv_lb_sample_score(ds, NULL, kv_rec_str(g[k], "pred", ""), (const char *const *)an, nan,
                                (const char *const *)cls, ncls, true, &sc[k]);
        kv_strings_free(an, nan);
    }
    kv_strings_free(cls, ncls);
    return st;
}

static void bins_json(FILE *f, const kv_lb_score *s)
{
    fputc('{', f);
    for (int b = 0; b < KV_LB_NBINS; b++) {
        fprintf(f, "%s\"%s\": ", b ? ", " : "", kv_lb_bin_names[b]);
        kv_json_pyfloat(f, s->bin[b]);
    }
    fputc('}', f);
}

kv_status kv_lb_summary(FILE *f, bool json, const cJSON *headers, cJSON *records,
                        bool per_sample)
{
    cJSON *pols = kv_batch_all_policies(headers, records);
    if (!pols) return kv_fail(KV_E_NOMEM, "summary");
    kv_batch_sort(records, pols);
    const cJSON *cfg = kv_batch_config(headers);
    const cJSON *files = cJSON_GetObjectItemCaseSensitive(cfg, "files");
    const int np = cJSON_GetArraySize(pols), nf = cJSON_GetArraySize(files);
    int nrec = cJSON_GetArraySize(records), nskip = 0;
    for (const cJSON *r = records->child; r; r = r->next) nskip += kv_rec_str(r, "skipped", NULL) != NULL;
    const cJSON **g = malloc(((size_t)nrec + 1) * sizeof *g);
    double *sc = malloc(((size_t)nrec + 1) * sizeof *sc);
    long long *len = malloc(((size_t)nrec + 1) * sizeof *len);
    kv_lb_score *res = calloc((size_t)np * (size_t)nf + 1, sizeof *res);
    int *cnt = calloc((size_t)np * (size_t)nf + 1, sizeof *cnt);
    kv_status st = g && sc && len && res && cnt ? KV_OK : kv_fail(KV_E_NOMEM, "summary");
    for (int pi = 0; pi < np && !st; pi++)
        for (int fi = 0; fi < nf && !st; fi++) {
            int n = group(records, cJSON_GetArrayItem(pols, pi)->valuestring, fi, g, nrec);
            cnt[pi * nf + fi] = n;
            if (!n) continue;
            if ((st = scores_of(g, n, kv_batch_file_cfg(cfg, fi), sc, len))) break;
            kv_lb_aggregate(sc, len, n, cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(kv_batch_file_cfg(cfg, fi), "e")),
                            &res[pi * nf + fi]);
        }
    const char *device = kv_rec_str(headers->child, "device_name", kv_rec_str(cfg, "device", "?"));
    if (!st && json) {
        fprintf(f, "{\"tool\": \"kv-bench longbench\", \"model\": ");
        kv_json_string(f, kv_rec_str(cfg, "model", ""));
        fprintf(f, ", \"device\": ");
        kv_json_string(f, device);
        fprintf(f, ", \"mode\": \"%s\", \"max_length\": %.0f, \"files\": [", kv_rec_str(cfg, "mode", ""),
                kv_rec_num(cfg, "max_length", 0));
        for (int fi = 0; fi < nf; fi++) {
            fprintf(f, "%s{\"path\": ", fi ? ", " : "");
            kv_json_string(f, kv_rec_str(kv_batch_file_cfg(cfg, fi), "path", ""));
            fprintf(f, ", \"dataset\": ");
            kv_json_string(f, kv_rec_str(kv_batch_file_cfg(cfg, fi), "dataset", ""));
            fprintf(f, ", \"e\": %s}", cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(kv_batch_file_cfg(cfg, fi), "e")) ? "true" : "false");
        }
        fprintf(f, "], \"skipped\": %d, \"skipped_samples\": [", nskip);
        int k = 0;
        for (const cJSON *r = records->child; r; r = r->next) {
            const char *why = kv_rec_str(r, "skipped", NULL);
            if (!why) continue;
            fprintf(f, "%s{\"task\": ", k++ ? ", " : "");
            kv_json_string(f, kv_rec_str(r, "task", ""));
            fprintf(f, ", \"id\": ");
            kv_json_string(f, kv_rec_str(r, "id", ""));
            fprintf(f, ", \"line\": %.0f, \"reason\": ", kv_rec_num(r, "line", 0));
            kv_json_string(f, why);
            fputc('}', f);
        }
        fprintf(f, "],\n \"scores\": {");
        for (int pi = 0; pi < np; pi++) {
            fprintf(f, "%s\n  ", pi ? "," : "");
            kv_json_string(f, cJSON_GetArrayItem(pols, pi)->valuestring);
            fprintf(f, ": {");
            int w = 0;
            for (int fi = 0; fi < nf; fi++) {
                const kv_lb_score *s = &res[pi * nf + fi];
                if (!cnt[pi * nf + fi]) continue;
                fprintf(f, "%s", w++ ? ", " : "");
                kv_json_pystring(f, kv_rec_str(kv_batch_file_cfg(cfg, fi), "dataset", ""));
                fputs(": ", f);
                if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(kv_batch_file_cfg(cfg, fi), "e"))) bins_json(f, s);
                else kv_json_pyfloat(f, s->score);
            }
            fputc('}', f);
        }
        fprintf(f, "\n },\n \"results\": [");
    } else if (!st) {
        fprintf(f, "device: %s\n", device);
        fprintf(f, "%-32s %-22s %4s %7s %8s %8s %8s %12s %9s\n", "policy", "dataset", "n", "score",
                "0-4k", "4-8k", "8k+", "resident KiB", "ms/token");
    }
    int row = 0;
    for (int pi = 0; pi < np && !st; pi++)
        for (int fi = 0; fi < nf && !st; fi++) {
            const char *pol = cJSON_GetArrayItem(pols, pi)->valuestring;
            int n = group(records, pol, fi, g, nrec);
            if (!n) continue;
            const kv_lb_score *s = &res[pi * nf + fi];
            const cJSON *fc = kv_batch_file_cfg(cfg, fi);
            bool e = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(fc, "e"));
            kv_batch_cost c = {0};
            int trunc = 0, nq = 0, full_ctx = 0;
            for (int k = 0; k < n; k++) {
                kv_batch_cost_add(&c, g[k]);
                trunc += cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(g[k], "truncated"));
                full_ctx += cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(g[k], "ctx_full"));
                nq += !strcmp(kv_rec_str(g[k], "mode", ""), "question");
            }
            if (!json) {
                fprintf(f, "%-32s %-22s %4d %7.2f", pol, kv_rec_str(fc, "dataset", ""), n, s->score);
                for (int b = 0; b < KV_LB_NBINS; b++)
                    if (e && isfinite(s->bin[b])) fprintf(f, " %8.2f", s->bin[b]);
                    else fprintf(f, " %8s", "-");
                fprintf(f, " %12.1f %9.2f\n", c.resident / n / 1024, c.decoded > 0 ? c.decode_ms / c.decoded : 0.0);
                continue;
            }
            fprintf(f, "%s\n  {\"policy\": ", row++ ? "," : "");
            kv_json_string(f, pol);
            fprintf(f, ", \"dataset\": ");
            kv_json_string(f, kv_rec_str(fc, "dataset", ""));
            fprintf(f, ", \"metric\": \"%s\", \"n\": %d, \"score\": ", kv_rec_str(fc, "metric", ""), n);
            kv_json_pyfloat(f, s->score);
            if (e) {
                fprintf(f, ", \"length_bins\": ");
                bins_json(f, s);
                fprintf(f, ", \"bin_samples\": [%d, %d, %d]", s->bin_n[0], s->bin_n[1], s->bin_n[2]);
            }
            fprintf(f, ", \"truncated\": %d, \"context_full\": %d, \"modes\": {\"question\": %d, \"prefill\": %d}",
                    trunc, full_ctx, nq, n - nq);
            kv_batch_cost_json(f, &c, n, "ms_per_sample");
            if (per_sample) {
                if ((st = scores_of(g, n, fc, sc, len))) break;
                fprintf(f, ", \"samples\": [");
                for (int k = 0; k < n; k++) {
                    fprintf(f, "%s{\"id\": ", k ? ", " : "");
                    kv_json_string(f, kv_rec_str(g[k], "id", ""));
                    fprintf(f, ", \"line\": %.0f, \"length\": %lld, \"score\": ", kv_rec_num(g[k], "line", 0), len[k]);
                    kv_json_pyfloat(f, sc[k]);
                    fprintf(f, ", \"prediction\": ");
                    kv_json_string(f, kv_rec_str(g[k], "pred", ""));
                    fputc('}', f);
                }
                fputc(']', f);
            }
            fputc('}', f);
        }
    if (!st && json) fprintf(f, "\n]}\n");
    free(g);
    free(sc);
    free(len);
    free(res);
    free(cnt);
    cJSON_Delete(pols);
    return st;
}

// --- prediction files ------------------------------------------------------------------------------

static void pystrings(FILE *fp, const cJSON *arr)
{
    int k = 0;
    fputc('[', fp);
    for (const cJSON *x = arr ? arr->child : NULL; x; x = x->next, k++) {
        fputs(k ? ", " : "", fp);
        kv_json_pystring(fp, cJSON_IsString(x) ? x->valuestring : "");
    }
    fputc(']', fp);
}

/* One line of pred.py's output: pred, answers, all_classes, length. */
static void pred_line(FILE *fp, const cJSON *r, int fi, void *ctx)
{
    (void)fi, (void)ctx;
    fputs("{\"pred\": ", fp);
    kv_json_pystring(fp, kv_rec_str(r, "pred", ""));
    fputs(", \"answers\": ", fp);
    pystrings(fp, cJSON_GetObjectItemCaseSensitive(r, "answers"));
    fputs(", \"all_classes\": ", fp);
    const cJSON *cl = cJSON_GetObjectItemCaseSensitive(r, "all_classes");
    if (cJSON_IsArray(cl)) pystrings(fp, cl);
    else fputs("null", fp);
    double ln = kv_rec_num(r, "length", -1);
    if (ln >= 0) fprintf(fp, ", \"length\": %.0f}\n", ln);
    else fputs(", \"length\": null}\n", fp);
}

kv_status kv_lb_write_preds(const char *dir, const cJSON *headers, cJSON *records)
{
    cJSON *pols = kv_batch_all_policies(headers, records);
    if (!pols) return kv_fail(KV_E_NOMEM, "predictions");
    kv_batch_sort(records, pols);
    const cJSON *cfg = kv_batch_config(headers);
    const int nf = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(cfg, "files"));
    kv_status st = KV_OK;
    for (int a = 0; a < nf && !st; a++)
        for (int b = 0; b < a && !st; b++)
            if (!strcmp(kv_rec_str(kv_batch_file_cfg(cfg, a), "dataset", ""), kv_rec_str(kv_batch_file_cfg(cfg, b), "dataset", "")))
                st = kv_fail(KV_E_USAGE, "%s and %s are one dataset: write their predictions apart "
                             "(pred.py keeps LongBench-E in pred_e/)", kv_rec_str(kv_batch_file_cfg(cfg, a), "path", ""),
                             kv_rec_str(kv_batch_file_cfg(cfg, b), "path", ""));
    if (!st) st = kv_batch_write_preds(dir, pols, cfg, records, "dataset", pred_line, NULL);
    cJSON_Delete(pols);
    return st;
}
