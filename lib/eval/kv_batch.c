/*
 * kv_batch: the results log, resume, shards and the records' order (see
 * kv_batch.h).
 */
#include "eval/kv_batch.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/kv_file.h"
#include "common/kv_json.h"
#include "common/kv_outfile.h"
#include "eval/kv_jsonl.h"

// --- shards ----------------------------------------------------------------------------

kv_status kv_batch_parse_shard(const char *s, int *i, int *n)
{
    char *end;
    errno = 0;
    long a = strtol(s, &end, 10);
    if (errno || end == s || *end != '/')
        return kv_fail(KV_E_USAGE, "--shard wants i/n (1 <= i <= n), got '%s'", s);
    const char *t = end + 1;
    long b = strtol(t, &end, 10);
    if (errno || end == t || *end || b < 1 || b > 100000 || a < 1 || a > b)
        return kv_fail(KV_E_USAGE, "--shard wants i/n with 1 <= i <= n <= 100000 (shards count from 1), got '%s'", s);
    *i = (int)a;
    *n = (int)b;
    return KV_OK;
}

uint64_t kv_batch_hash(const char *task, const char *id)
{
    uint64_t h = 14695981039346656037ULL;
    for (const unsigned char *p = (const unsigned char *)task; *p; p++) h = (h ^ *p) * 1099511628211ULL;
    h = (h ^ 0x1F) * 1099511628211ULL;
    for (const unsigned char *p = (const unsigned char *)id; *p; p++) h = (h ^ *p) * 1099511628211ULL;
    return h;
}

bool kv_batch_in_shard(const char *task, const char *id, int i, int n)
{
    return n <= 1 || kv_batch_hash(task, id) % (uint64_t)n == (uint64_t)(i - 1);
}

double kv_batch_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

// --- the done set ----------------------------------------------------------------------

struct kv_batch_done {
    char **key; /* (cap) NULL or an owned key */
    size_t n, cap;
};

static char *make_key(const char *task, const char *id, const char *policy, long long length)
{
    size_t n = strlen(task) + strlen(id) + (policy ? strlen(policy) : 0) + 48;
    char *k = malloc(n);
    if (k) snprintf(k, n, "%s\x1f%s\x1f%s\x1f%lld", task, id, policy ? policy : "\x01skip", length);
    return k;
}

static uint64_t hash_str(const char *s)
{
    uint64_t h = 14695981039346656037ULL;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) h = (h ^ *p) * 1099511628211ULL;
    return h;
}

kv_status kv_batch_done_new(kv_batch_done **out)
{
    kv_batch_done *d = calloc(1, sizeof *d);
    if (!d) return kv_fail(KV_E_NOMEM, "done set");
    *out = d;
    return KV_OK;
}

void kv_batch_done_free(kv_batch_done *d)
{
    if (!d) return;
    for (size_t i = 0; i < d->cap; i++) free(d->key[i]);
    free(d->key);
    free(d);
}

static bool has_key(const kv_batch_done *d, const char *k)
{
    if (!d->cap) return false;
    for (size_t i = hash_str(k) & (d->cap - 1);; i = (i + 1) & (d->cap - 1)) {
        if (!d->key[i]) return false;
        if (!strcmp(d->key[i], k)) return true;
    }
}

kv_status kv_batch_done_add(kv_batch_done *d, const char *task, const char *id, const char *policy,
                            long long length)
{
    char *k = make_key(task, id, policy, length);
    if (!k) return kv_fail(KV_E_NOMEM, "done set");
    if (has_key(d, k)) {
        free(k);
        return KV_OK;
    }
    if ((d->n + 1) * 2 > d->cap) {
        size_t nc = d->cap ? d->cap * 2 : 1024;
        char **nk = calloc(nc, sizeof *nk);
        if (!nk) {
            free(k);
            return kv_fail(KV_E_NOMEM, "done set");
        }
        for (size_t i = 0; i < d->cap; i++) {
            if (!d->key[i]) continue;
            size_t j = hash_str(d->key[i]) & (nc - 1);
            while (nk[j]) j = (j + 1) & (nc - 1);
            nk[j] = d->key[i];
        }
        free(d->key);
        d->key = nk;
        d->cap = nc;
    }
    size_t j = hash_str(k) & (d->cap - 1);
    while (d->key[j]) j = (j + 1) & (d->cap - 1);
    d->key[j] = k;
    d->n++;
    return KV_OK;
}

bool kv_batch_done_has(const kv_batch_done *d, const char *task, const char *id,
                       const char *policy, long long length)
{
    char *k = make_key(task, id, policy, length), *s = make_key(task, id, NULL, length);
    bool r = (k && has_key(d, k)) || (s && has_key(d, s));
    free(k);
    free(s);
    return r;
}

// --- records -------------------------------------------------------------------------------

double kv_rec_num(const cJSON *r, const char *key, double dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r, key);
    return cJSON_IsNumber(v) ? v->valuedouble : dflt;
}

const char *kv_rec_str(const cJSON *r, const char *key, const char *dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r, key);
    return cJSON_IsString(v) ? v->valuestring : dflt;
}

static bool is_header(const cJSON *j) { return cJSON_GetObjectItemCaseSensitive(j, "kv_bench_log") != NULL; }

/* Parse a log's text: headers and records appended to the arrays; *good_end
 * is the byte offset after the last complete line. */
static kv_status parse_log(const char *path, const char *text, size_t len, cJSON *headers,
                           cJSON *records, size_t *good_end, int *torn)
{
    kv_jsonl it;
    kv_jsonl_init(&it, text, len);
    const char *s;
    size_t n;
    bool partial;
    *good_end = 0;
    while (kv_jsonl_next(&it, &s, &n, &partial)) {
        if (partial) { /* a writer killed mid-line: not a record */
            if (torn) (*torn)++;
            return KV_OK;
        }
        *good_end = it.pos;
        cJSON *j = memchr(s, 0, n) ? NULL : cJSON_ParseWithLength(s, n);
        if (!j || !cJSON_IsObject(j)) {
            cJSON_Delete(j);
            return kv_fail(KV_E_DATA, "%s:%d: not a results record (JSON object)", path, it.line);
        }
        if (is_header(j)) {
            double v = kv_rec_num(j, "kv_bench_log", 0);
            if (v != KV_BATCH_LOG_VERSION) {
                cJSON_Delete(j);
                return kv_fail(KV_E_UNSUPPORTED, "%s:%d: results log version %g (this build reads %d)",
                               path, it.line, v, KV_BATCH_LOG_VERSION);
            }
            cJSON_AddItemToArray(headers, j);
        } else if (!cJSON_GetArraySize(headers)) {
            cJSON_Delete(j);
            return kv_fail(KV_E_DATA, "%s:%d: not a kv-bench results log (no header line before it)",
                           path, it.line);
        } else if (!cJSON_IsString(cJSON_GetObjectItemCaseSensitive(j, "task"))) {
            cJSON_Delete(j);
            return kv_fail(KV_E_DATA, "%s:%d: a record without \"task\"", path, it.line);
        } else {
            cJSON_AddItemToArray(records, j);
        }
    }
    *good_end = len;
    return KV_OK;
}

/* The first key of a whose value differs in b (or "bench"). */
static const char *first_diff(const cJSON *a, const cJSON *b)
{
    const cJSON *ba = cJSON_GetObjectItemCaseSensitive(a, "bench");
    const cJSON *bb = cJSON_GetObjectItemCaseSensitive(b, "bench");
    if (!cJSON_Compare(ba, bb, true)) return "bench";
    const cJSON *ca = cJSON_GetObjectItemCaseSensitive(a, "config");
    const cJSON *cb = cJSON_GetObjectItemCaseSensitive(b, "config");
    if (cJSON_Compare(ca, cb, true)) return NULL;
    for (const cJSON *x = ca ? ca->child : NULL; x; x = x->next)
        if (!cJSON_Compare(x, cJSON_GetObjectItemCaseSensitive(cb, x->string), true)) return x->string;
    for (const cJSON *x = cb ? cb->child : NULL; x; x = x->next)
        if (!cJSON_GetObjectItemCaseSensitive(ca, x->string)) return x->string;
    return "config";
}

struct kv_batch_log {
    int fd;
    char *path;
};

static kv_status write_all(int fd, const char *s, size_t n, const char *path)
{
    while (n) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return kv_fail(KV_E_IO, "cannot write %s: %s", path, strerror(errno));
        s += w;
        n -= (size_t)w;
    }
    return KV_OK;
}

static kv_status append_json(int fd, const cJSON *j, const char *path)
{
    char *s = cJSON_PrintUnformatted(j);
    if (!s) return kv_fail(KV_E_NOMEM, "record");
    size_t n = strlen(s);
    char *line = realloc(s, n + 2);
    if (!line) {
        free(s);
        return kv_fail(KV_E_NOMEM, "record");
    }
    line[n] = '\n';
    kv_status st = write_all(fd, line, n + 1, path);
    free(line);
    if (!st && fsync(fd) && errno != EINVAL)
        st = kv_fail(KV_E_IO, "cannot sync %s: %s", path, strerror(errno));
    return st;
}

kv_status kv_batch_open(const char *path, bool resume, const cJSON *header, kv_batch_log **out,
                        cJSON **records)
{
    *out = NULL;
    *records = NULL;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return kv_fail(KV_E_CANTCREATE, "cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode)) {
        close(fd);
        return kv_fail(KV_E_CANTCREATE, "%s is not a regular file", path);
    }
    kv_status st = KV_OK;
    if (sb.st_size > 0 && !resume) {
        st = kv_fail(KV_E_CANTCREATE, "%s exists: pass --resume to continue it, or remove it", path);
    } else if (sb.st_size > 0) {
        char *buf;
        size_t len;
        cJSON *hs = cJSON_CreateArray(), *rs = cJSON_CreateArray();
        size_t good = 0;
        st = hs && rs ? kv_file_slurp(path, 0, "results log", &buf, &len) : kv_fail(KV_E_NOMEM, "log");
        if (!st) {
            st = parse_log(path, buf, len, hs, rs, &good, NULL);
            free(buf);
        }
        for (const cJSON *h = hs ? hs->child : NULL; h && !st; h = h->next) {
            const char *k = first_diff(h, header);
            if (!k && !cJSON_Compare(cJSON_GetObjectItemCaseSensitive(h, "shard"),
                                     cJSON_GetObjectItemCaseSensitive(header, "shard"), true))
                k = "shard";
            if (k)
                st = kv_fail(KV_E_USAGE, "%s holds results of another run (its \"%s\" differs): "
                             "resume with the same settings or use another --output", path, k);
        }
        if (!st && hs && !hs->child)
            st = kv_fail(KV_E_DATA, "%s: not a kv-bench results log (no header line)", path);
        if (!st && good < len && ftruncate(fd, (off_t)good))
            st = kv_fail(KV_E_IO, "cannot cut the torn last line of %s: %s", path, strerror(errno));
        cJSON_Delete(hs);
        if (st) cJSON_Delete(rs);
        else *records = rs;
    }
    if (!st) st = append_json(fd, header, path);
    if (st) {
        close(fd);
        cJSON_Delete(*records);
        *records = NULL;
        return st;
    }
    kv_batch_log *l = calloc(1, sizeof *l);
    char *p = kv_strdup(path);
    if (!l || !p) {
        free(l);
        free(p);
        close(fd);
        cJSON_Delete(*records);
        *records = NULL;
        return kv_fail(KV_E_NOMEM, "log");
    }
    l->fd = fd;
    l->path = p;
    *out = l;
    return KV_OK;
}

kv_status kv_batch_append(kv_batch_log *l, const cJSON *record)
{
    return l ? append_json(l->fd, record, l->path) : KV_OK;
}

kv_status kv_batch_close(kv_batch_log *l)
{
    if (!l) return KV_OK;
    kv_status st = close(l->fd) ? kv_fail(KV_E_IO, "cannot close %s: %s", l->path, strerror(errno)) : KV_OK;
    free(l->path);
    free(l);
    return st;
}

// --- reading many logs ------------------------------------------------------------------

static bool record_key(const cJSON *r, char *buf, size_t cap)
{
    const char *pol = kv_rec_str(r, "policy", "\x01skip");
    int n = snprintf(buf, cap, "%s\x1f%s\x1f%s\x1f%.17g", kv_rec_str(r, "task", ""),
                     kv_rec_str(r, "id", ""), pol, kv_rec_num(r, "length", -1));
    return n > 0 && (size_t)n < cap;
}

kv_status kv_batch_read(const char *const *paths, int n, cJSON **headers, cJSON **records,
                        int *torn, int *dups)
{
    *headers = cJSON_CreateArray();
    *records = cJSON_CreateArray();
    *torn = *dups = 0;
    cJSON *all = cJSON_CreateArray();
    kv_status st = *headers && *records && all ? KV_OK : kv_fail(KV_E_NOMEM, "logs");
    for (int i = 0; i < n && !st; i++) {
        char *buf;
        size_t len, good;
        if ((st = kv_file_slurp(paths[i], 0, "results log", &buf, &len))) break;
        int before = cJSON_GetArraySize(*headers);
        st = parse_log(paths[i], buf, len, *headers, all, &good, torn);
        free(buf);
        if (!st && cJSON_GetArraySize(*headers) == before)
            st = kv_fail(KV_E_DATA, "%s: not a kv-bench results log (no header line)", paths[i]);
    }
    /* one run's settings; shards complete */
    const cJSON *h0 = st ? NULL : (*headers)->child;
    int shard_n = -1, nh = 0;
    unsigned char *seen = NULL;
    for (const cJSON *h = h0; h && !st; h = h->next, nh++) {
        const char *k = first_diff(h0, h);
        if (k) {
            st = kv_fail(KV_E_DATA, "the logs are of different runs (their \"%s\" differs)", k);
            break;
        }
        const char *sh = kv_rec_str(h, "shard", NULL);
        int si = 0, sn = 0;
        if (sh && kv_batch_parse_shard(sh, &si, &sn)) {
            st = kv_fail(KV_E_DATA, "a log header has a bad shard \"%s\"", sh);
            break;
        }
        if (shard_n == -1) {
            shard_n = sh ? sn : 0;
            if (sn && !(seen = calloc((size_t)sn + 1, 1))) st = kv_fail(KV_E_NOMEM, "shards");
        } else if ((sh ? sn : 0) != shard_n) {
            st = kv_fail(KV_E_DATA, "the logs mix shard counts (%d and %d)", shard_n, sh ? sn : 0);
            break;
        }
        if (sh && seen) seen[si] = 1;
    }
    for (int s = 1; !st && seen && s <= shard_n; s++)
        if (!seen[s]) st = kv_fail(KV_E_DATA, "shard %d/%d is missing", s, shard_n);
    free(seen);
    /* keep each record once */
    kv_batch_done *d = NULL;
    if (!st) st = kv_batch_done_new(&d);
    while (!st && all->child) {
        cJSON *r = cJSON_DetachItemFromArray(all, 0);
        char key[2048];
        if (!record_key(r, key, sizeof key)) {
            cJSON_AddItemToArray(*records, r);
            continue;
        }
        const char *pol = kv_rec_str(r, "policy", NULL);
        long long ln = (long long)kv_rec_num(r, "length", -1);
        if (kv_batch_done_has(d, kv_rec_str(r, "task", ""), kv_rec_str(r, "id", ""), pol ? pol : "\x01skip", ln)) {
            (*dups)++;
            cJSON_Delete(r);
            continue;
        }
        st = kv_batch_done_add(d, kv_rec_str(r, "task", ""), kv_rec_str(r, "id", ""), pol ? pol : "\x01skip", ln);
        cJSON_AddItemToArray(*records, r);
    }
    kv_batch_done_free(d);
    cJSON_Delete(all);
    if (st) {
        cJSON_Delete(*headers);
        cJSON_Delete(*records);
        *headers = *records = NULL;
    }
    return st;
}

cJSON *kv_batch_policies(const cJSON *headers)
{
    cJSON *out = cJSON_CreateArray();
    if (!out) return NULL;
    for (const cJSON *h = headers ? headers->child : NULL; h; h = h->next) {
        const cJSON *ps = cJSON_GetObjectItemCaseSensitive(h, "policies");
        for (const cJSON *p = cJSON_IsArray(ps) ? ps->child : NULL; p; p = p->next) {
            if (!cJSON_IsString(p)) continue;
            bool have = false;
            for (const cJSON *q = out->child; q && !have; q = q->next) have = !strcmp(q->valuestring, p->valuestring);
            if (!have) cJSON_AddItemToArray(out, cJSON_CreateString(p->valuestring));
        }
    }
    return out;
}

const cJSON *kv_batch_config(const cJSON *headers)
{
    return headers && headers->child ? cJSON_GetObjectItemCaseSensitive(headers->child, "config") : NULL;
}

typedef struct {
    cJSON *r;
    int pidx;
    double fi, line;
    int pos;
} sortrec;

static int cmp_sortrec(const void *x, const void *y)
{
    const sortrec *a = x, *b = y;
    if (a->pidx != b->pidx) return a->pidx < b->pidx ? -1 : 1;
    if (a->fi != b->fi) return a->fi < b->fi ? -1 : 1;
    if (a->line != b->line) return a->line < b->line ? -1 : 1;
    return a->pos < b->pos ? -1 : a->pos > b->pos;
}

void kv_batch_sort(cJSON *records, const cJSON *policies)
{
    int n = cJSON_GetArraySize(records);
    if (n < 2) return;
    sortrec *v = malloc((size_t)n * sizeof *v);
    if (!v) return; /* unsorted: the caller's numbers then follow file order */
    int np = cJSON_GetArraySize(policies), i = 0;
    for (cJSON *r = records->child; r; r = r->next, i++) {
        const char *pol = kv_rec_str(r, "policy", NULL);
        int pidx = -1;
        if (pol) {
            pidx = np;
            int k = 0;
            for (const cJSON *p = policies ? policies->child : NULL; p; p = p->next, k++)
                if (cJSON_IsString(p) && !strcmp(p->valuestring, pol)) {
                    pidx = k;
                    break;
                }
        }
        v[i] = (sortrec){r, pidx, kv_rec_num(r, "fi", 0), kv_rec_num(r, "line", 0), i};
    }
    qsort(v, (size_t)n, sizeof *v, cmp_sortrec);
    while (records->child) cJSON_DetachItemViaPointer(records, records->child);
    for (i = 0; i < n; i++) {
        v[i].r->next = v[i].r->prev = NULL;
        cJSON_AddItemToArray(records, v[i].r);
    }
    free(v);
}

// --- progress, skips, records ------------------------------------------------------------

#include <stdarg.h>

void kv_batch_meter_start(kv_batch_meter *m, const kv_batch_hooks *h, int total)
{
    m->t0 = kv_batch_now();
    m->done = 0;
    m->total = total;
    m->hooks = h;
}

void kv_batch_meter_tick(kv_batch_meter *m, const char *policy, const char *task)
{
    if (!m->hooks || !m->hooks->progress) return;
    double dt = kv_batch_now() - m->t0;
    kv_batch_progress p = {m->done, m->total, 0, -1, policy, task};
    if (m->done > 0 && dt > 0) {
        p.rate = m->done / dt;
        p.eta_s = (m->total - m->done) / p.rate;
    }
    m->hooks->progress(m->hooks->ctx, &p);
}

void kv_batch_warn(const kv_batch_hooks *h, const char *fmt, ...)
{
    if (!h || !h->warn) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    h->warn(h->ctx, msg);
}

cJSON *kv_batch_record(const char *bench, const char *task, const char *id, int fi, int line,
                       long long length, const char *policy)
{
    cJSON *r = cJSON_CreateObject();
    if (!r) return NULL;
    cJSON_AddStringToObject(r, "bench", bench);
    cJSON_AddStringToObject(r, "task", task);
    cJSON_AddStringToObject(r, "id", id);
    if (policy) cJSON_AddStringToObject(r, "policy", policy);
    cJSON_AddNumberToObject(r, "fi", fi);
    cJSON_AddNumberToObject(r, "line", line);
    cJSON_AddNumberToObject(r, "length", (double)length);
    if (!cJSON_GetObjectItemCaseSensitive(r, "length")) {
        cJSON_Delete(r);
        return NULL;
    }
    return r;
}

kv_status kv_batch_keep(kv_batch_log *log, cJSON *records, cJSON *r)
{
    kv_status st = kv_batch_append(log, r);
    if (st) {
        cJSON_Delete(r);
        return st;
    }
    cJSON_AddItemToArray(records, r);
    return KV_OK;
}

void kv_batch_record_cost(cJSON *r, const kv_bytes *b, double fetched_per_step, double full_bytes,
                          double ms, double prefill_ms, double decode_ms)
{
    cJSON_AddNumberToObject(r, "resident_bytes", (double)b->resident);
    cJSON_AddNumberToObject(r, "host_bytes", (double)b->host);
    cJSON_AddNumberToObject(r, "fetched_bytes_per_step", fetched_per_step);
    cJSON_AddNumberToObject(r, "full_f16_bytes", full_bytes);
    cJSON_AddNumberToObject(r, "ms", ms);
    cJSON_AddNumberToObject(r, "prefill_ms", prefill_ms);
    cJSON_AddNumberToObject(r, "decode_ms", decode_ms);
}

void kv_batch_cost_add(kv_batch_cost *c, const cJSON *r)
{
    c->resident += kv_rec_num(r, "resident_bytes", 0);
    c->host += kv_rec_num(r, "host_bytes", 0);
    c->fetched += kv_rec_num(r, "fetched_bytes_per_step", 0);
    c->full += kv_rec_num(r, "full_f16_bytes", 0);
    c->ms += kv_rec_num(r, "ms", 0);
    c->decode_ms += kv_rec_num(r, "decode_ms", 0);
    c->decoded += kv_rec_num(r, "decoded", 0);
}

void kv_batch_cost_json(FILE *f, const kv_batch_cost *c, int n, const char *ms_key)
{
    fprintf(f, ", \"resident_bytes\": %.0f, \"host_bytes\": %.0f, \"fetched_bytes_per_step\": %.0f, "
               "\"full_f16_bytes\": %.0f, \"%s\": ",
            c->resident / n, c->host / n, c->fetched / n, c->full / n, ms_key);
    kv_json_number(f, c->ms / n);
    fprintf(f, ", \"ms_per_token\": ");
    kv_json_number(f, c->decoded > 0 ? c->decode_ms / c->decoded : NAN);
}

kv_status kv_batch_skip(const char *bench, const char *task, const char *id, int fi,
                        const char *path, int line, long long length, const char *why,
                        bool strict, kv_batch_log *log, cJSON *records, const kv_batch_hooks *h)
{
    if (strict) return kv_fail(KV_E_DATA, "%s:%d: %s", path, line, why);
    kv_batch_warn(h, "%s:%d: skipped: %s", path, line, why);
    cJSON *r = kv_batch_record(bench, task, id, fi, line, length, NULL);
    if (!r || !cJSON_AddStringToObject(r, "skipped", why)) {
        cJSON_Delete(r);
        return kv_fail(KV_E_NOMEM, "record");
    }
    return kv_batch_keep(log, records, r);
}

void kv_batch_slug(const char *label, char *buf, size_t cap)
{
    size_t k = 0;
    for (const char *p = label; *p && k + 1 < cap; p++) {
        char c = *p;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  strchr("._,=+:-", c);
        buf[k++] = ok ? c : '_';
    }
    if (k == 0 || (k <= 2 && buf[0] == '.')) {
        snprintf(buf, cap, "policy");
        return;
    }
    buf[k] = 0;
}

kv_status kv_batch_mkdirs(const char *path)
{
    char p[4096];
    if (snprintf(p, sizeof p, "%s", path) >= (int)sizeof p)
        return kv_fail(KV_E_CANTCREATE, "path too long: %s", path);
    for (char *s = p + 1;; s++) {
        if (*s == '/' || *s == 0) {
            char c = *s;
            *s = 0;
            if (mkdir(p, 0755) && errno != EEXIST)
                return kv_fail(KV_E_CANTCREATE, "cannot create %s: %s", p, strerror(errno));
            *s = c;
            if (!c) break;
        }
    }
    struct stat sb;
    if (stat(path, &sb) || !S_ISDIR(sb.st_mode))
        return kv_fail(KV_E_CANTCREATE, "%s is not a directory", path);
    return KV_OK;
}

int kv_batch_policy_index(const cJSON *pols, const char *p)
{
    int k = 0;
    for (const cJSON *q = pols->child; q; q = q->next, k++)
        if (!strcmp(q->valuestring, p)) return k;
    return -1;
}

cJSON *kv_batch_all_policies(const cJSON *headers, const cJSON *records)
{
    cJSON *pols = kv_batch_policies(headers);
    for (const cJSON *r = records->child; r && pols; r = r->next) {
        const char *p = kv_rec_str(r, "policy", NULL);
        if (p && kv_batch_policy_index(pols, p) < 0) cJSON_AddItemToArray(pols, cJSON_CreateString(p));
    }
    return pols;
}

const cJSON *kv_batch_file_cfg(const cJSON *cfg, int fi)
{
    return cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(cfg, "files"), fi);
}

static bool rec_of(const cJSON *r, const char *pol, int fi)
{
    const char *rp = kv_rec_str(r, "policy", NULL);
    return rp && !strcmp(rp, pol) && kv_rec_num(r, "fi", -1) == fi;
}

/* DIR/<slug>/<name>.jsonl of one policy and input file. */
static kv_status write_one(const char *path, const char *pol, int fi, const cJSON *records,
                           kv_batch_pred_fn line, void *ctx)
{
    kv_outfile o;
    kv_status st = kv_outfile_open(&o, path);
    if (st) return st;
    for (const cJSON *r = records->child; r; r = r->next)
        if (rec_of(r, pol, fi)) line(o.fp, r, fi, ctx);
    if (ferror(o.fp)) {
        kv_outfile_abort(&o);
        return kv_fail(KV_E_IO, "cannot write %s", path);
    }
    return kv_outfile_commit(&o);
}

kv_status kv_batch_write_preds(const char *dir, const cJSON *pols, const cJSON *cfg, const cJSON *records,
                               const char *name_key, kv_batch_pred_fn line, void *ctx)
{
    const int np = cJSON_GetArraySize(pols);
    const int nf = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(cfg, "files"));
    char (*slugs)[256] = calloc((size_t)np + 1, sizeof *slugs);
    if (!slugs) return kv_fail(KV_E_NOMEM, "predictions");
    kv_status st = KV_OK;
    for (int pi = 0; pi < np && !st; pi++) {
        kv_batch_slug(cJSON_GetArrayItem(pols, pi)->valuestring, slugs[pi], sizeof slugs[pi]);
        for (int q = 0; q < pi; q++)
            if (!strcmp(slugs[q], slugs[pi]))
                st = kv_fail(KV_E_USAGE, "policies '%s' and '%s' need the same folder name '%s'",
                             cJSON_GetArrayItem(pols, q)->valuestring,
                             cJSON_GetArrayItem(pols, pi)->valuestring, slugs[pi]);
    }
    for (int pi = 0; pi < np && !st; pi++) {
        const char *pol = cJSON_GetArrayItem(pols, pi)->valuestring;
        char sub[4096];
        snprintf(sub, sizeof sub, "%s/%s", dir, slugs[pi]);
        if ((st = kv_batch_mkdirs(sub))) break;
        for (int fi = 0; fi < nf && !st; fi++) {
            bool any = false;
            for (const cJSON *r = records->child; r && !any; r = r->next) any = rec_of(r, pol, fi);
            if (!any) continue;
            char path[4352];
            snprintf(path, sizeof path, "%s/%s.jsonl", sub, kv_rec_str(kv_batch_file_cfg(cfg, fi), name_key, name_key));
            st = write_one(path, pol, fi, records, line, ctx);
        }
    }
    free(slugs);
    return st;
}
