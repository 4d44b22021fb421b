/*
 * kvc_write: the .kvc writer (man/kvc.5).  It builds the header itself
 * (exact integers, data order, a CRC-32C per tensor), pads it so the data
 * section starts at KVC_DATA_ALIGN, optionally compresses with zstd, and
 * goes through the atomic kv_outfile.
 */
#include "format/kvc_int.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zstd.h>

#include "common/kv_crc.h"
#include "common/kv_outfile.h"

// --- writer -----------------------------------------------------------------

typedef struct {
    char name[KVC_NAME_MAX];
    kv_dtype dtype;
    int ndim;
    int64_t shape[KVC_MAX_DIMS];
    const void *data;
    void *own;
    uint64_t nbytes, offset;
    uint32_t crc;
} wtensor;

struct kvc_writer {
    wtensor *t; /* (nt) in insertion order */
    int nt, tcap;
    char **mkey, **mval; /* (nm) */
    int nm, mcap;
};

kv_status kvc_writer_new(kvc_writer **out)
{
    *out = calloc(1, sizeof **out);
    return *out ? KV_OK : kv_fail(KV_E_NOMEM, "cannot allocate a writer");
}

void kvc_writer_free(kvc_writer *w)
{
    if (!w) return;
    for (int i = 0; i < w->nt; i++) free(w->t[i].own);
    for (int i = 0; i < w->nm; i++) {
        free(w->mkey[i]);
        free(w->mval[i]);
    }
    free(w->mval);
    free(w->mkey);
    free(w->t);
    free(w);
}

kv_status kvc_writer_meta(kvc_writer *w, const char *key, const char *value)
{
    if (!key || !*key || !value) return kv_fail(KV_E_INTERNAL, "metadata key or value missing");
    if (!strncmp(key, "crc32c.", 7) || !strcmp(key, "kvc.checksums")) return KV_OK; /* written by write */
    for (int i = 0; i < w->nm; i++) {
        if (!strcmp(w->mkey[i], key)) {
            char *v = strdup(value);
            if (!v) return kv_fail(KV_E_NOMEM, "cannot allocate metadata");
            free(w->mval[i]);
            w->mval[i] = v;
            return KV_OK;
        }
    }
    if (w->nm == w->mcap) {
        int nc = w->mcap ? w->mcap * 2 : 32;
        char **k = realloc(w->mkey, (size_t)nc * sizeof *k);
        if (!k) return kv_fail(KV_E_NOMEM, "cannot allocate metadata");
        w->mkey = k;
        char **v = realloc(w->mval, (size_t)nc * sizeof *v);
        if (!v) return kv_fail(KV_E_NOMEM, "cannot allocate metadata");
        w->mval = v;
        w->mcap = nc;
    }
    w->mkey[w->nm] = strdup(key);
    w->mval[w->nm] = strdup(value);
    if (!w->mkey[w->nm] || !w->mval[w->nm]) {
        free(w->mkey[w->nm]);
        free(w->mval[w->nm]);
        return kv_fail(KV_E_NOMEM, "cannot allocate metadata");
    }
    w->nm++;
    return KV_OK;
}

kv_status kvc_writer_copy_meta(kvc_writer *w, const kvc_file *f)
{
    for (int i = 0; i < f->nm; i++) {
        kv_status st = kvc_writer_meta(w, f->mkey[i], f->mval[i]);
        if (st) return st;
    }
    return KV_OK;
}

/* Shortest decimal that reads back as the same double. */
static void fmt_real(char *buf, size_t n, double v)
{
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) return;
    }
}

kv_status kvc_writer_geom(kvc_writer *w, const kv_geom *g)
{
    char b[64];
    kv_status st = KV_OK;
#define PUT(k, ...) \
    do { snprintf(b, sizeof b, __VA_ARGS__); if ((st = kvc_writer_meta(w, k, b))) return st; } while (0)
    PUT("format", "kvc");
    PUT("kvc.version", "%d", KVC_FORMAT_VERSION);
    PUT("kvc.n_layers", "%d", g->n_layers);
    if (g->n_heads > 0) PUT("kvc.n_heads", "%d", g->n_heads);
    PUT("kvc.n_kv_heads", "%d", g->n_kv_heads);
    PUT("kvc.head_dim", "%d", g->head_dim);
    PUT("kvc.n_tokens", "%d", g->n_tokens);
    PUT("kvc.n_q", "%d", g->n_q);
    fmt_real(b, sizeof b, g->rope_theta);
    if ((st = kvc_writer_meta(w, "kvc.rope_theta", b))) return st;
    PUT("kvc.rope_scaling", "%s", g->rope_scaling == KV_ROPE_SCALING_LLAMA3 ? "llama3" : "none");
    if (g->rope_scaling == KV_ROPE_SCALING_LLAMA3) {
        fmt_real(b, sizeof b, g->rope_factor);
        if ((st = kvc_writer_meta(w, "kvc.rope_factor", b))) return st;
        fmt_real(b, sizeof b, g->rope_low_freq_factor);
        if ((st = kvc_writer_meta(w, "kvc.rope_low_freq_factor", b))) return st;
        fmt_real(b, sizeof b, g->rope_high_freq_factor);
        if ((st = kvc_writer_meta(w, "kvc.rope_high_freq_factor", b))) return st;
        PUT("kvc.rope_orig_ctx", "%d", g->rope_orig_ctx);
    }
    PUT("kvc.keys_roped", "%s", g->keys_roped ? "true" : "false");
    PUT("kvc.rope_layout", "%s", g->rope_layout == KV_ROPE_HALVES ? "halves" : "interleaved");
    if ((st = kvc_writer_meta(w, "kvc.model", g->model))) return st;
#undef PUT
    return KV_OK;
}

static kv_status writer_add(kvc_writer *w, const char *name, kv_dtype dt, int ndim,
                            const int64_t *shape, const void *data, bool copy)
{
    if (!name || !*name || strlen(name) >= KVC_NAME_MAX || !strcmp(name, "__metadata__"))
        return kv_fail(KV_E_INTERNAL, "bad tensor name '%.40s'", name ? name : "(null)");
    if ((unsigned)dt >= KV_DT_COUNT || ndim < 0 || ndim > KVC_MAX_DIMS)
        return kv_fail(KV_E_INTERNAL, "tensor %s: bad dtype or rank", name);
    for (int i = 0; i < w->nt; i++)
        if (!strcmp(w->t[i].name, name)) return kv_fail(KV_E_INTERNAL, "duplicate tensor %s", name);
    uint64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || shape[d] > KVC_DIM_MAX)
            return kv_fail(KV_E_INTERNAL, "tensor %s: bad dimension %lld", name, (long long)shape[d]);
        if (shape[d] && numel > (UINT64_MAX >> 4) / (uint64_t)shape[d])
            return kv_fail(KV_E_INTERNAL, "tensor %s: shape overflows", name);
        numel *= (uint64_t)shape[d];
    }
    uint64_t nb = numel * kv_dtype_size(dt);
    if (nb && !data) return kv_fail(KV_E_INTERNAL, "tensor %s: no data", name);
    if (w->nt == w->tcap) {
        int nc = w->tcap ? w->tcap * 2 : 32;
        wtensor *t = realloc(w->t, (size_t)nc * sizeof *t);
        if (!t) return kv_fail(KV_E_NOMEM, "cannot allocate the tensor table");
        w->t = t;
        w->tcap = nc;
    }
    wtensor *t = &w->t[w->nt];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dtype = dt;
    t->ndim = ndim;
    for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
    t->nbytes = nb;
    t->data = data;
    if (copy && nb) {
        if (nb > SIZE_MAX || !(t->own = malloc((size_t)nb)))
            return kv_fail(KV_E_NOMEM, "cannot copy tensor %s (%llu bytes)", name, (unsigned long long)nb);
        memcpy(t->own, data, (size_t)nb);
        t->data = t->own;
    }
    w->nt++;
    return KV_OK;
}

kv_status kvc_writer_add(kvc_writer *w, const char *name, kv_dtype dt, int ndim,
                         const int64_t *shape, const void *data)
{
    return writer_add(w, name, dt, ndim, shape, data, false);
}

kv_status kvc_writer_add_copy(kvc_writer *w, const char *name, kv_dtype dt, int ndim,
                              const int64_t *shape, const void *data)
{
    return writer_add(w, name, dt, ndim, shape, data, true);
}

/* Growing text buffer for the header. */
typedef struct {
    char *p;
    size_t n, cap;
    bool oom;
} sbuf;

static void sb_put(sbuf *s, const char *x, size_t n)
{
    if (s->oom) return;
    if (s->n + n + 1 > s->cap) {
        size_t nc = s->cap ? s->cap : 4096;
        while (s->n + n + 1 > nc) nc *= 2;
        char *np = realloc(s->p, nc);
        if (!np) {
            s->oom = true;
            return;
        }
        s->p = np;
        s->cap = nc;
    }
    memcpy(s->p + s->n, x, n);
    s->n += n;
    s->p[s->n] = '\0';
}

static void sb_fmt(sbuf *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_fmt(sbuf *s, const char *fmt, ...)
{
    char b[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b, sizeof b, fmt, ap);
    va_end(ap);
    if (n > 0) sb_put(s, b, (size_t)n < sizeof b ? (size_t)n : sizeof b - 1);
}

/* A JSON string literal: escapes quotes, backslashes and control bytes;
 * other bytes (UTF-8) pass through. */
static void sb_str(sbuf *s, const char *x)
{
    sb_put(s, "\"", 1);
    for (; *x; x++) {
        unsigned char c = (unsigned char)*x;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            sb_put(s, e, 2);
        } else if (c < 0x20) {
            sb_fmt(s, "\\u%04x", c);
        } else {
            sb_put(s, (const char *)&c, 1);
        }
    }
    sb_put(s, "\"", 1);
}

/* Output sink: plain FILE or zstd stream into it. */
typedef struct {
    FILE *fp;
    ZSTD_CCtx *z;
    uint8_t *zbuf;
    size_t zcap;
} sink;

static kv_status sink_zstd(sink *k, const void *p, size_t n, ZSTD_EndDirective end)
{
    ZSTD_inBuffer in = {p, n, 0};
    for (;;) {
        ZSTD_outBuffer out = {k->zbuf, k->zcap, 0};
        size_t r = ZSTD_compressStream2(k->z, &out, &in, end);
        if (ZSTD_isError(r)) return kv_fail(KV_E_INTERNAL, "zstd: %s", ZSTD_getErrorName(r));
        if (out.pos && fwrite(k->zbuf, 1, out.pos, k->fp) != out.pos)
            return kv_fail(KV_E_IO, "write error: %s", strerror(errno));
        if (end == ZSTD_e_end ? r == 0 : in.pos == in.size) return KV_OK;
    }
}

static kv_status sink_write(sink *k, const void *p, size_t n)
{
    if (!n) return KV_OK;
    if (k->z) return sink_zstd(k, p, n, ZSTD_e_continue);
    if (fwrite(p, 1, n, k->fp) != n) return kv_fail(KV_E_IO, "write error: %s", strerror(errno));
    return KV_OK;
}

static int cmp_wsize(const void *a, const void *b)
{
    const wtensor *const *x = a, *const *y = b;
    size_t sx = kv_dtype_size((*x)->dtype), sy = kv_dtype_size((*y)->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return *x < *y ? -1 : *x > *y; /* stable: insertion order */
}

kv_status kvc_writer_write(kvc_writer *w, const char *path, int zstd_level)
{
    return kvc_writer_write_ex(w, path, zstd_level, 0);
}

/* The file's bytes (8-byte length, header, tensors; zstd-compressed at
 * zstd_level > 0) to fp. */
static kv_status emit(kvc_writer *w, FILE *fp, int zstd_level)
{
    kv_status st = KV_OK;
    wtensor **ord = malloc(((size_t)w->nt + 1) * sizeof *ord);
    sbuf h = {0};
    sink k = {0};
    if (!ord) return kv_fail(KV_E_NOMEM, "cannot allocate the tensor order");
    for (int i = 0; i < w->nt; i++) ord[i] = &w->t[i];
    qsort(ord, (size_t)w->nt, sizeof *ord, cmp_wsize);
    uint64_t pos = 0;
    for (int i = 0; i < w->nt; i++) {
        ord[i]->offset = pos;
        pos += ord[i]->nbytes;
        ord[i]->crc = kv_crc32c(0, ord[i]->data, (size_t)ord[i]->nbytes);
    }

    sb_put(&h, "{\"__metadata__\":{", 17);
    for (int i = 0; i < w->nm; i++) {
        if (i) sb_put(&h, ",", 1);
        sb_str(&h, w->mkey[i]);
        sb_put(&h, ":", 1);
        sb_str(&h, w->mval[i]);
    }
    for (int i = 0; i < w->nt; i++) {
        char key[KVC_NAME_MAX + 8];
        snprintf(key, sizeof key, "crc32c.%s", ord[i]->name);
        if (w->nm || i) sb_put(&h, ",", 1);
        sb_str(&h, key);
        sb_fmt(&h, ":\"%08x\"", ord[i]->crc);
    }
    sb_fmt(&h, "%s\"kvc.checksums\":\"%d\"", w->nm || w->nt ? "," : "", w->nt);
    sb_put(&h, "}", 1);
    for (int i = 0; i < w->nt; i++) {
        wtensor *t = ord[i];
        sb_put(&h, ",", 1);
        sb_str(&h, t->name);
        sb_fmt(&h, ":{\"dtype\":\"%s\",\"shape\":[", kv_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++) sb_fmt(&h, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        sb_fmt(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)t->offset,
               (unsigned long long)(t->offset + t->nbytes));
    }
    sb_put(&h, "}", 1);
    while ((8 + h.n) % KVC_DATA_ALIGN) sb_put(&h, " ", 1);
    if (h.oom) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate the header");
        goto out;
    }
    if (h.n > KVC_HEADER_MAX) {
        st = kv_fail(KV_E_INTERNAL, "header of %zu bytes exceeds the %u-byte limit", h.n, KVC_HEADER_MAX);
        goto out;
    }
    k.fp = fp;
    if (zstd_level > 0) {
        k.z = ZSTD_createCCtx();
        k.zcap = ZSTD_CStreamOutSize();
        k.zbuf = malloc(k.zcap);
        if (!k.z || !k.zbuf) {
            st = kv_fail(KV_E_NOMEM, "cannot allocate a zstd context");
            goto out;
        }
        int lv = zstd_level > ZSTD_maxCLevel() ? ZSTD_maxCLevel() : zstd_level;
        ZSTD_CCtx_setParameter(k.z, ZSTD_c_compressionLevel, lv);
        ZSTD_CCtx_setPledgedSrcSize(k.z, 8 + h.n + pos);
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)h.n >> (8 * i));
    if ((st = sink_write(&k, len8, 8)) || (st = sink_write(&k, h.p, h.n))) goto out;
    for (int i = 0; i < w->nt; i++) {
        const uint8_t *p = ord[i]->data;
        uint64_t left = ord[i]->nbytes;
        while (left && !st) { /* chunks keep zstd and stdio calls bounded */
            size_t c = left > (1u << 24) ? (1u << 24) : (size_t)left;
            st = sink_write(&k, p, c);
            p += c;
            left -= c;
        }
        if (st) goto out;
    }
    if (k.z) st = sink_zstd(&k, NULL, 0, ZSTD_e_end);
out:
    ZSTD_freeCCtx(k.z);
    free(k.zbuf);
    free(h.p);
    free(ord);
    return st;
}

kv_status kvc_writer_write_ex(kvc_writer *w, const char *path, int zstd_level, unsigned flags)
{
    kv_outfile o = {0};
    kv_status st = kv_outfile_open_ex(&o, path, flags);
    if (st) return st;
    if (!(st = emit(w, o.fp, zstd_level))) return kv_outfile_commit(&o);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kv_errdetail());
    kv_outfile_abort(&o);
    /* a full disk said only "write error: No space left on device" */
    kv_fail(st, "%s", msg);
    if (!strcmp(path, "-")) kv_errcontext("stdout");
    else kv_errcontext("cannot write %s", path);
    return st;
}

kv_status kvc_writer_write_mem(kvc_writer *w, int zstd_level, uint8_t **buf, size_t *len)
{
    *buf = NULL;
    *len = 0;
    char *p = NULL;
    size_t n = 0;
    FILE *fp = open_memstream(&p, &n);
    if (!fp) return kv_fail(KV_E_NOMEM, "cannot open a memory stream");
    kv_status st = emit(w, fp, zstd_level);
    if (fclose(fp) != 0 && !st) st = kv_fail(KV_E_NOMEM, "cannot finish a memory stream");
    if (st) {
        free(p);
        return st;
    }
    *buf = (uint8_t *)p;
    *len = n;
    return KV_OK;
}
