/*
 * kv_score: prediction files and the scores LongBench's eval.py and
 * RULER's evaluate.py compute from them (see kv_score.h), with Python's
 * rounding and printing of floats.
 */
#include "eval/kv_score.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_file.h"
#include "eval/kv_jsonl.h"

// --- Python's numbers -------------------------------------------------------------

double kv_py_round2(double x)
{
    if (!isfinite(x)) return x;
    /* round(x, 2) rounds the exact binary value to 2 decimals, ties to
     * even, as glibc's printf does; strtod reads the result back as
     * Python's float() does */
    char buf[400];
    snprintf(buf, sizeof buf, "%.2f", x);
    return strtod(buf, NULL);
}

void kv_py_repr(double x, char *out, size_t cap)
{
    if (isnan(x)) {
        snprintf(out, cap, "NaN");
        return;
    }
    if (isinf(x)) {
        snprintf(out, cap, x > 0 ? "Infinity" : "-Infinity");
        return;
    }
    if (x == 0) {
        snprintf(out, cap, signbit(x) ? "-0.0" : "0.0");
        return;
    }
    /* the shortest %e that reads back as x */
    char e[40];
    for (int p = 1; p <= 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, x);
        if (strtod(e, NULL) == x) break;
    }
    /* e = [-]D[.DDD]e[+-]XX -> sign, digits, decimal exponent */
    const char *s = e;
    bool neg = *s == '-';
    if (neg) s++;
    char dig[24];
    int nd = 0;
    for (; *s && *s != 'e'; s++)
        if (*s != '.') dig[nd++] = *s;
    int ex = atoi(s + 1);
    while (nd > 1 && dig[nd - 1] == '0') nd--;
    dig[nd] = 0;
    int decpt = ex + 1; /* x = 0.DIGITS * 10^decpt */
    char r[64];
    size_t k = 0;
    if (neg) r[k++] = '-';
    if (decpt <= -4 || decpt > 16) {
        r[k++] = dig[0];
        if (nd > 1) {
            r[k++] = '.';
            for (int i = 1; i < nd; i++) r[k++] = dig[i];
        }
        snprintf(r + k, sizeof r - k, "e%c%02d", ex < 0 ? '-' : '+', ex < 0 ? -ex : ex);
    } else if (decpt <= 0) {
        r[k++] = '0';
        r[k++] = '.';
        for (int i = 0; i < -decpt; i++) r[k++] = '0';
        for (int i = 0; i < nd; i++) r[k++] = dig[i];
        r[k] = 0;
    } else if (decpt >= nd) {
        for (int i = 0; i < nd; i++) r[k++] = dig[i];
        for (int i = nd; i < decpt; i++) r[k++] = '0';
        r[k++] = '.';
        r[k++] = '0';
        r[k] = 0;
    } else {
        for (int i = 0; i < nd; i++) {
            if (i == decpt) r[k++] = '.';
            r[k++] = dig[i];
        }
        r[k] = 0;
    }
    snprintf(out, cap, "%s", r);
}

void kv_json_pyfloat(FILE *f, double x)
{
    if (!isfinite(x)) {
        fputs("null", f);
        return;
    }
    char b[64];
    kv_py_repr(x, b, sizeof b);
    fputs(b, f);
}

void kv_json_pystring(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"': fputs("\\\"", f); break;
        case '\\': fputs("\\\\", f); break;
        case '\n': fputs("\\n", f); break;
        case '\r': fputs("\\r", f); break;
        case '\t': fputs("\\t", f); break;
        case '\b': fputs("\\b", f); break;
        case '\f': fputs("\\f", f); break;
        default:
            if (*p < 0x20) fprintf(f, "\\u%04x", *p);
            else fputc(*p, f);
        }
    }
    fputc('"', f);
}

/* numpy's pairwise_sum for doubles (loops_utils.h): plain below 8,
 * eight accumulators up to 128, halves (a multiple of 8) above. */
static double pairwise(const double *a, size_t n)
{
    if (n < 8) {
        double r = 0.;
        for (size_t i = 0; i < n; i++) r += a[i];
        return r;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; j++) r[j] = a[j];
        size_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + (size_t)j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise(a, n2) + pairwise(a + n2, n - n2);
}

double kv_np_mean(const double *a, size_t n) { return n ? pairwise(a, n) / (double)n : NAN; }

// --- LongBench --------------------------------------------------------------------

const char *const kv_lb_bin_names[KV_LB_NBINS] = {"0-4k", "4-8k", "8k+"};

int kv_lb_bin_of(long long length)
{
    return length < 4000 ? KV_LB_BIN_0_4K : length < 8000 ? KV_LB_BIN_4_8K : KV_LB_BIN_8K;
}

static void pred_free(kv_lb_pred *p)
{
    free(p->pred);
    kv_strings_free(p->answers, p->n_answers);
    kv_strings_free(p->classes, p->n_classes);
}

void kv_lb_preds_free(kv_lb_preds *p)
{
    for (int i = 0; i < p->n; i++) pred_free(&p->v[i]);
    free(p->v);
    p->v = NULL;
    p->n = 0;
}

static kv_status lb_pred_line(const cJSON *j, kv_lb_pred *p)
{
    const cJSON *pr = cJSON_GetObjectItemCaseSensitive(j, "pred");
    const cJSON *an = cJSON_GetObjectItemCaseSensitive(j, "answers");
    const cJSON *cl = cJSON_GetObjectItemCaseSensitive(j, "all_classes");
    const cJSON *ln = cJSON_GetObjectItemCaseSensitive(j, "length");
    if (!cJSON_IsObject(j)) return kv_fail(KV_E_DATA, "a prediction must be a JSON object");
    if (!cJSON_IsString(pr)) return kv_fail(KV_E_DATA, "\"pred\" missing or not a string");
    if (!an) return kv_fail(KV_E_DATA, "\"answers\" missing");
    kv_status st = kv_json_strings(an, "answers", &p->answers, &p->n_answers);
    if (st) return st;
    if (cl && !cJSON_IsNull(cl)) {
        if ((st = kv_json_strings(cl, "all_classes", &p->classes, &p->n_classes))) return st;
        p->has_classes = true;
    }
    if (ln && !cJSON_IsNull(ln)) {
        if (!kv_json_int(ln, 0, 1LL << 53, &p->length))
            return kv_fail(KV_E_DATA, "\"length\" is not an integer in [0, 2^53]");
        p->has_length = true;
    }
    if (!(p->pred = kv_strdup(pr->valuestring))) return kv_fail(KV_E_NOMEM, "prediction");
    return KV_OK;
}

kv_status kv_lb_preds_parse(const char *text, size_t len, const char *name, kv_lb_preds *out)
{
    out->v = NULL;
    out->n = 0;
    int cap = 0;
    kv_jsonl it;
    kv_jsonl_init(&it, text, len);
    const char *s;
    size_t n;
    while (kv_jsonl_next(&it, &s, &n, NULL)) {
        kv_lb_pred *nv = kv_grow(out->v, out->n, &cap, sizeof *nv, 64);
        if (!nv) {
            kv_lb_preds_free(out);
            return kv_fail(KV_E_NOMEM, "%s", name);
        }
        out->v = nv;
        kv_lb_pred *p = &out->v[out->n];
        memset(p, 0, sizeof *p);
        p->line = it.line;
        cJSON *j = memchr(s, 0, n) ? NULL : cJSON_ParseWithLength(s, n);
        kv_status st = j ? lb_pred_line(j, p) : kv_fail(KV_E_DATA, "not valid JSON");
        cJSON_Delete(j);
        if (st) {
            pred_free(p);
            kv_errcontext("%s:%d", name, it.line);
            kv_lb_preds_free(out);
            return st;
        }
        out->n++;
    }
    return KV_OK;
}

kv_status kv_lb_preds_load(const char *path, kv_lb_preds *out)
{
    char *buf;
    size_t len;
    out->v = NULL;
    out->n = 0;
    kv_status st = kv_file_slurp(path, 0, "predictions", &buf, &len);
    if (st) return st;
    st = kv_lb_preds_parse(buf, len, strcmp(path, "-") ? path : "<stdin>", out);
    free(buf);
    return st;
}

void kv_lb_aggregate(const double *sample, const long long *length, int n, bool e,
                     kv_lb_score *out)
{
    out->n = n;
    /* scorer: total_score += score; round(100 * total_score / len(predictions), 2) */
    double total = 0.;
    for (int i = 0; i < n; i++) total += sample[i];
    out->score = n ? kv_py_round2(100 * total / n) : NAN;
    for (int b = 0; b < KV_LB_NBINS; b++) {
        out->bin[b] = NAN;
        out->bin_n[b] = 0;
    }
    if (!e || !length) return;
    /* scorer_e: round(100 * np.mean(scores[key]), 2) per bin */
    double *tmp = malloc(((size_t)n + 1) * sizeof *tmp);
    if (!tmp) return;
    for (int b = 0; b < KV_LB_NBINS; b++) {
        int k = 0;
        for (int i = 0; i < n; i++)
            if (kv_lb_bin_of(length[i]) == b) tmp[k++] = sample[i];
        out->bin_n[b] = k;
        out->bin[b] = k ? kv_py_round2(100 * kv_np_mean(tmp, (size_t)k)) : NAN;
    }
    free(tmp);
}

kv_status kv_lb_score_preds(const kv_lb_dataset *d, const kv_jieba *jb, const kv_lb_preds *p,
                            bool e, bool keep_samples, kv_lb_score *out)
{
    memset(out, 0, sizeof *out);
    if (p->n == 0) return kv_fail(KV_E_DATA, "no predictions (eval.py divides by zero)");
    double *s = malloc((size_t)p->n * sizeof *s);
    long long *len = malloc((size_t)p->n * sizeof *len);
    if (!s || !len) {
        free(s);
        free(len);
        return kv_fail(KV_E_NOMEM, "scores");
    }
    /* all_classes = data["all_classes"] of the last line, for every line */
    const kv_lb_pred *last = &p->v[p->n - 1];
    kv_status st = KV_OK;
    for (int i = 0; i < p->n && !st; i++) {
        const kv_lb_pred *x = &p->v[i];
        if (e && !x->has_length) {
            st = kv_fail(KV_E_DATA, "line %d: no \"length\", which LongBench-E bins need", x->line);
            break;
        }
        len[i] = x->length;
        st = kv_lb_sample_score(d, jb, x->pred, (const char *const *)x->answers, x->n_answers,
                                (const char *const *)last->classes, last->n_classes,
                                last->has_classes, &s[i]);
        if (st) kv_errcontext("line %d", x->line);
    }
    if (!st) kv_lb_aggregate(s, len, p->n, e, out);
    free(len);
    if (!st && keep_samples) out->sample = s;
    else free(s);
    return st;
}

void kv_lb_score_free(kv_lb_score *s)
{
    free(s->sample);
    s->sample = NULL;
}

// --- RULER ------------------------------------------------------------------------------

void kv_ruler_preds_free(kv_ruler_preds *p)
{
    for (int i = 0; i < p->n; i++) {
        free(p->v[i].pred);
        kv_strings_free(p->v[i].outputs, p->v[i].n_outputs);
    }
    free(p->v);
    p->v = NULL;
    p->n = 0;
}

kv_status kv_ruler_preds_parse(const char *text, size_t len, const char *name,
                               kv_ruler_preds *out)
{
    out->v = NULL;
    out->n = 0;
    int cap = 0;
    kv_jsonl it;
    kv_jsonl_init(&it, text, len);
    const char *s;
    size_t n;
    kv_status st = KV_OK;
    while (!st && kv_jsonl_next(&it, &s, &n, NULL)) {
        kv_ruler_pred *nv = kv_grow(out->v, out->n, &cap, sizeof *nv, 64);
        if (!nv) {
            st = kv_fail(KV_E_NOMEM, "%s", name);
            break;
        }
        out->v = nv;
        kv_ruler_pred *p = &out->v[out->n];
        memset(p, 0, sizeof *p);
        p->line = it.line;
        cJSON *j = memchr(s, 0, n) ? NULL : cJSON_ParseWithLength(s, n);
        const cJSON *pr = cJSON_GetObjectItemCaseSensitive(j, "pred");
        const cJSON *outs = cJSON_GetObjectItemCaseSensitive(j, "outputs");
        const cJSON *idx = cJSON_GetObjectItemCaseSensitive(j, "index");
        if (!j) st = kv_fail(KV_E_DATA, "not valid JSON");
        else if (!cJSON_IsObject(j)) st = kv_fail(KV_E_DATA, "a prediction must be a JSON object");
        else if (!cJSON_IsString(pr)) st = kv_fail(KV_E_DATA, "\"pred\" missing or not a string");
        else if (idx && !kv_json_int(idx, -(1LL << 53), 1LL << 53, &p->index))
            st = kv_fail(KV_E_DATA, "\"index\" is not an integer");
        else if (!outs) st = kv_fail(KV_E_DATA, "\"outputs\" missing");
        else if (!(st = kv_json_strings(outs, "outputs", &p->outputs, &p->n_outputs))) {
            if (p->n_outputs < 1) st = kv_fail(KV_E_DATA, "\"outputs\" is empty");
            else if (!(p->pred = kv_strdup(pr->valuestring))) st = kv_fail(KV_E_NOMEM, "%s", name);
        }
        cJSON_Delete(j);
        if (st) {
            free(p->pred);
            kv_strings_free(p->outputs, p->n_outputs);
            kv_errcontext("%s:%d", name, it.line);
        } else {
            out->n++;
        }
    }
    if (st) kv_ruler_preds_free(out);
    return st;
}

kv_status kv_ruler_preds_load(const char *path, kv_ruler_preds *out)
{
    char *buf;
    size_t len;
    out->v = NULL;
    out->n = 0;
    kv_status st = kv_file_slurp(path, 0, "predictions", &buf, &len);
    if (st) return st;
    st = kv_ruler_preds_parse(buf, len, strcmp(path, "-") ? path : "<stdin>", out);
    free(buf);
    return st;
}

double kv_ruler_aggregate(const double *sample, int n)
{
    if (n <= 0) return NAN;
    double sum = 0; /* sum([...]) */
    for (int i = 0; i < n; i++) sum += sample[i];
    return kv_py_round2(sum / n * 100);
}

kv_status kv_ruler_score_preds(kv_ruler_metric m, const kv_ruler_preds *p, bool keep_samples,
                               kv_ruler_score *out)
{
    memset(out, 0, sizeof *out);
    if (p->n == 0) return kv_fail(KV_E_DATA, "no predictions");
    double *s = malloc((size_t)p->n * sizeof *s);
    if (!s) return kv_fail(KV_E_NOMEM, "scores");
    kv_status st = KV_OK;
    for (int i = 0; i < p->n && !st; i++) {
        char *pp = kv_ruler_postprocess(p->v[i].pred);
        if (!pp) {
            st = kv_fail(KV_E_NOMEM, "prediction");
            break;
        }
        out->nulls += pp[0] == 0;
        st = kv_ruler_sample_score(m, pp, (const char *const *)p->v[i].outputs,
                                   p->v[i].n_outputs, &s[i]);
        free(pp);
    }
    if (!st) {
        out->n = p->n;
        out->score = kv_ruler_aggregate(s, p->n);
    }
    if (!st && keep_samples) out->sample = s;
    else free(s);
    return st;
}

void kv_ruler_score_free(kv_ruler_score *s)
{
    free(s->sample);
    s->sample = NULL;
}

// --- prediction files on the command line -------------------------------------------

#include <dirent.h>
#include <errno.h>
#include <sys/stat.h>

void kv_score_inputs_free(kv_score_input *in, int n)
{
    for (int i = 0; in && i < n; i++) {
        free(in[i].name);
        kv_strings_free(in[i].paths, in[i].n_paths);
    }
    free(in);
}

typedef struct {
    kv_score_input *v;
    int n, cap;
} inputs;

static kv_score_input *input_get(inputs *in, const char *name, bool create, bool *existed)
{
    for (int i = 0; i < in->n; i++)
        if (!strcmp(in->v[i].name, name)) {
            *existed = true;
            return &in->v[i];
        }
    *existed = false;
    if (!create) return NULL;
    kv_score_input *nv = kv_grow(in->v, in->n, &in->cap, sizeof *nv, 32);
    if (!nv) return NULL;
    in->v = nv;
    kv_score_input *x = &in->v[in->n];
    memset(x, 0, sizeof *x);
    if (!(x->name = kv_strdup(name))) return NULL;
    in->n++;
    return x;
}

static kv_status input_add_path(kv_score_input *x, const char *path)
{
    char **np = realloc(x->paths, ((size_t)x->n_paths + 1) * sizeof *np);
    if (!np) return kv_fail(KV_E_NOMEM, "inputs");
    x->paths = np;
    if (!(x->paths[x->n_paths] = kv_strdup(path))) return kv_fail(KV_E_NOMEM, "inputs");
    x->n_paths++;
    return KV_OK;
}

/* "<task>-<digits>.jsonl" with a non-'_' character before the '-'. */
static bool chunk_name(const char *f, char *task, size_t cap)
{
    size_t n = strlen(f);
    if (n < 6 || strcmp(f + n - 6, ".jsonl")) return false;
    const char *dash = NULL;
    for (const char *p = f; p < f + n - 6; p++) {
        if (*p != '-') continue;
        const char *q = p + 1;
        while (q < f + n - 6 && *q >= '0' && *q <= '9') q++;
        if (q == f + n - 6 && q > p + 1 && p > f && p[-1] != '_') dash = p;
    }
    if (!dash) return false;
    /* '-'.join(file.split('-')[:-1]): everything before the last '-' */
    const char *last = strrchr(f, '-');
    if (last != dash) return false;
    size_t l = (size_t)(last - f);
    if (l + 1 > cap) return false;
    memcpy(task, f, l);
    task[l] = 0;
    return true;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int cmp_input(const void *a, const void *b)
{
    return strcmp(((const kv_score_input *)a)->name, ((const kv_score_input *)b)->name);
}

static kv_status add_file(inputs *in, const char *path, const char *base)
{
    char name[1024];
    size_t l = strcspn(base, ".");
    if (l == 0 || l >= sizeof name) return kv_fail(KV_E_USAGE, "%s: no dataset name in the file name", path);
    memcpy(name, base, l);
    name[l] = 0;
    bool existed;
    kv_score_input *x = input_get(in, name, true, &existed);
    if (!x) return kv_fail(KV_E_NOMEM, "inputs");
    if (existed) return kv_fail(KV_E_USAGE, "two prediction files for '%s' (%s)", name, path);
    return input_add_path(x, path);
}

static kv_status add_dir(inputs *in, const char *dir, bool ruler_chunks, int *shadowed)
{
    DIR *d = opendir(dir);
    if (!d) return kv_fail(KV_E_NOINPUT, "cannot open %s: %s", dir, strerror(errno));
    char **names = NULL;
    int n = 0, cap = 0;
    kv_status st = KV_OK;
    for (struct dirent *e; (e = readdir(d));) {
        size_t l = strlen(e->d_name);
        if (l < 7 || strcmp(e->d_name + l - 6, ".jsonl")) continue;
        char **nn = kv_grow(names, n, &cap, sizeof *nn, 32);
        if (!nn) {
            st = kv_fail(KV_E_NOMEM, "%s", dir);
            break;
        }
        names = nn;
        if (!(names[n] = kv_strdup(e->d_name))) {
            st = kv_fail(KV_E_NOMEM, "%s", dir);
            break;
        }
        n++;
    }
    closedir(d);
    if (!st && n > 1) qsort(names, (size_t)n, sizeof *names, cmp_str);
    char path[4096], task[1024];
    /* chunks first, so that the plain file of a chunked task is skipped */
    inputs chunks = {0};
    for (int i = 0; i < n && !st && ruler_chunks; i++) {
        if (!chunk_name(names[i], task, sizeof task)) continue;
        bool existed;
        kv_score_input *x = input_get(&chunks, task, true, &existed);
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        st = x ? input_add_path(x, path) : kv_fail(KV_E_NOMEM, "inputs");
    }
    for (int i = 0; i < n && !st; i++) {
        if (ruler_chunks && chunk_name(names[i], task, sizeof task)) continue;
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        size_t l = strcspn(names[i], ".");
        snprintf(task, sizeof task, "%.*s", (int)l, names[i]);
        bool existed;
        if (input_get(&chunks, task, false, &existed) || existed) {
            (*shadowed)++;
            continue;
        }
        st = add_file(in, path, names[i]);
    }
    for (int i = 0; i < chunks.n && !st; i++) {
        bool existed;
        kv_score_input *x = input_get(in, chunks.v[i].name, true, &existed);
        if (!x) st = kv_fail(KV_E_NOMEM, "inputs");
        else if (existed) st = kv_fail(KV_E_USAGE, "two prediction sets for '%s'", x->name);
        for (int k = 0; !st && k < chunks.v[i].n_paths; k++) st = input_add_path(x, chunks.v[i].paths[k]);
    }
    kv_score_inputs_free(chunks.v, chunks.n);
    kv_strings_free(names, n);
    return st;
}

kv_status kv_score_collect(const char *const *operands, int n, bool ruler_chunks,
                           kv_score_input **out, int *n_out, int *shadowed)
{
    inputs in = {0};
    *shadowed = 0;
    kv_status st = KV_OK;
    for (int i = 0; i < n && !st; i++) {
        struct stat sb;
        if (stat(operands[i], &sb)) {
            st = kv_fail(KV_E_NOINPUT, "cannot open %s: %s", operands[i], strerror(errno));
        } else if (S_ISDIR(sb.st_mode)) {
            st = add_dir(&in, operands[i], ruler_chunks, shadowed);
        } else {
            const char *slash = strrchr(operands[i], '/');
            st = add_file(&in, operands[i], slash ? slash + 1 : operands[i]);
        }
    }
    if (!st && in.n == 0) st = kv_fail(KV_E_NOINPUT, "no .jsonl prediction files");
    if (st) {
        kv_score_inputs_free(in.v, in.n);
        return st;
    }
    qsort(in.v, (size_t)in.n, sizeof *in.v, cmp_input);
    *out = in.v;
    *n_out = in.n;
    return KV_OK;
}
