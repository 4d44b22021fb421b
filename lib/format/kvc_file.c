/*
 * kvc_file: the open .kvc file (man/kvc.5): getting its bytes into one
 * range (mmap of a regular file, stdin read to the end, zstd inflated with
 * a bound), handing them to the parser (kvc_parse.c), and the accessors
 * over the validated tables.
 */
#include "format/kvc_int.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "common/kv_file.h"
#include "common/kv_half.h"
#include "common/kv_tokens.h"

// --- the open file ----------------------------------------------------------

static int bsearch_name(const int *idx, int n, const char *name,
                        const char *(*key)(const kvc_file *, int), const kvc_file *f)
{
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(key(f, idx[mid]), name);
        if (c == 0) return idx[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

static const char *tensor_key(const kvc_file *f, int i) { return f->t[i].name; }
static const char *meta_key(const kvc_file *f, int i) { return f->mkey[i]; }

const kvc_tensor *kvc_find(const kvc_file *f, const char *name)
{
    if (!f || !name) return NULL;
    int i = bsearch_name(f->by_name, f->nt, name, tensor_key, f);
    return i < 0 ? NULL : &f->t[i];
}

const char *kvc_meta(const kvc_file *f, const char *key)
{
    if (!f || !key) return NULL;
    int i = bsearch_name(f->meta_by_key, f->nm, key, meta_key, f);
    return i < 0 ? NULL : f->mval[i];
}

const kvc_tensor *kvc_layer(const kvc_file *f, int layer, const char *part)
{
    char name[KVC_NAME_MAX + 32];
    snprintf(name, sizeof name, "layers.%d.%s", layer, part);
    return kvc_find(f, name);
}

const kv_geom *kvc_geom(const kvc_file *f) { return &f->g; }
int kvc_n_tensors(const kvc_file *f) { return f->nt; }
const kvc_tensor *kvc_tensor_at(const kvc_file *f, int i)
{
    return i >= 0 && i < f->nt ? &f->t[i] : NULL;
}
int kvc_n_meta(const kvc_file *f) { return f->nm; }
void kvc_meta_at(const kvc_file *f, int i, const char **key, const char **value)
{
    bool ok = i >= 0 && i < f->nm;
    if (key) *key = ok ? f->mkey[i] : NULL;
    if (value) *value = ok ? f->mval[i] : NULL;
}
bool kvc_has_checksums(const kvc_file *f) { return f->nt > 0 && f->n_crc == f->nt; }
int kvc_n_checksums(const kvc_file *f) { return f->n_crc; }
uint64_t kvc_file_bytes(const kvc_file *f) { return f->file_bytes; }
bool kvc_was_zstd(const kvc_file *f) { return f->zstd; }

const char *kvc_layer_encoding(const kvc_file *f, int layer, char which)
{
    if (!f || layer < 0 || layer >= f->g.n_layers || (which != 'k' && which != 'v')) return NULL;
    return f->li[layer].enc[which == 'v'];
}

bool kvc_layer_kivi(const kvc_file *f, int layer, char which, kv_kivi_params *p)
{
    const char *e = kvc_layer_encoding(f, layer, which);
    if (!e || strcmp(e, "kivi") != 0) return false;
    if (p) *p = f->li[layer].kivi[which == 'v'];
    return true;
}

uint64_t kvc_layer_bytes(const kvc_file *f, int layer, bool kv_only)
{
    if (!f || layer < 0 || layer >= f->g.n_layers) return 0;
    return kv_only ? f->li[layer].kv_bytes : f->li[layer].bytes;
}

kv_status kvc_tokens(const kvc_file *f, int32_t **ids, int *n)
{
    *ids = NULL;
    *n = 0;
    const kvc_tensor *t = kvc_find(f, "tokens");
    if (!t || t->dtype != KV_DT_I32 || t->ndim != 1) return kv_fail(KV_E_DATA, "no tokens tensor (I32 [T])");
    *ids = malloc((size_t)t->shape[0] * sizeof **ids + 1);
    if (!*ids) return kv_fail(KV_E_NOMEM, "out of memory");
    memcpy(*ids, t->data, (size_t)t->shape[0] * sizeof **ids);
    *n = (int)t->shape[0];
    return KV_OK;
}

kv_status kvc_tokens_read(const char *ids_path, const char *kvc_path, int32_t **ids, int *n)
{
    kv_status st;
    *ids = NULL;
    *n = 0;
    if (kvc_path) {
        kvc_file *f = NULL;
        if (!(st = kvc_open(kvc_path, &f))) st = kvc_tokens(f, ids, n);
        kvc_close(f);
        if (st) kv_errcontext("%s", kvc_path);
        return st;
    }
    char *buf;
    size_t len;
    if (!(st = kv_file_slurp(ids_path, 0, "token list", &buf, &len))) {
        st = kv_tokens_parse(buf, len, ids, n);
        free(buf);
    }
    if (st) kv_errcontext("%s", strcmp(ids_path, "-") ? ids_path : "stdin");
    return st;
}

int64_t kvc_tensor_numel(const kvc_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

kv_status kvc_tensor_to_f32(const kvc_tensor *t, float *out)
{
    int64_t n = kvc_tensor_numel(t);
    const uint8_t *p = t->data;
    switch (t->dtype) {
    case KV_DT_F32:
        if (n) memcpy(out, p, (size_t)n * 4);
        return KV_OK;
    case KV_DT_F16:
        for (int64_t i = 0; i < n; i++) {
            kv_half h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = kv_half_to_f32(h);
        }
        return KV_OK;
    case KV_DT_BF16:
        for (int64_t i = 0; i < n; i++) {
            kv_bf16 b;
            memcpy(&b, p + 2 * i, 2);
            out[i] = kv_bf16_to_f32(b);
        }
        return KV_OK;
    default:
        return kv_fail(KV_E_DATA, "tensor %s is %s, not a floating-point tensor", t->name,
                       kv_dtype_name(t->dtype));
    }
}

void kvc_close(kvc_file *f)
{
    if (!f) return;
    for (int i = 0; i < f->nm; i++) {
        free(f->mkey[i]);
        free(f->mval[i]);
    }
    free(f->li);
    free(f->meta_by_key);
    free(f->mval);
    free(f->mkey);
    free(f->by_name);
    free(f->t);
    if (f->map) munmap(f->map, f->map_len);
    free(f->owned);
    free(f);
}



// --- input: mmap, stdin, zstd ---------------------------------------------

static bool is_zstd(const uint8_t *p, size_t n)
{
    return n >= 4 && p[0] == 0x28 && p[1] == 0xb5 && p[2] == 0x2f && p[3] == 0xfd;
}

static kv_status inflate_zstd(const uint8_t *in, size_t n, uint8_t **out, size_t *out_len)
{
    ZSTD_DCtx *dc = ZSTD_createDCtx();
    if (!dc) return kv_fail(KV_E_NOMEM, "cannot allocate a zstd context");
    size_t cap = 1 << 16;
    unsigned long long want = ZSTD_getFrameContentSize(in, n);
    if (want != ZSTD_CONTENTSIZE_UNKNOWN && want != ZSTD_CONTENTSIZE_ERROR &&
        want < (1ull << 32) && want <= n * 1024ull + (1 << 20))
        cap = (size_t)want + 1; /* trust the frame header only within reason */
    uint8_t *buf = malloc(cap);
    kv_status st = KV_OK;
    ZSTD_inBuffer ib = {in, n, 0};
    size_t len = 0, ret = 0;
    if (!buf) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate %zu bytes for zstd output", cap);
        goto out;
    }
    for (;;) {
        if (len == cap) {
            if ((uint64_t)cap * 2 > KVC_ZSTD_MAX) {
                st = kv_fail(KV_E_DATA, "zstd input inflates past %llu bytes",
                             (unsigned long long)KVC_ZSTD_MAX);
                goto out;
            }
            uint8_t *nb = realloc(buf, cap * 2);
            if (!nb) {
                st = kv_fail(KV_E_NOMEM, "cannot allocate %zu bytes for zstd output", cap * 2);
                goto out;
            }
            buf = nb;
            cap *= 2;
        }
        ZSTD_outBuffer ob = {buf + len, cap - len, 0};
        ret = ZSTD_decompressStream(dc, &ob, &ib);
        len += ob.pos;
        if (ZSTD_isError(ret)) {
            st = kv_fail(KV_E_DATA, "corrupt zstd stream: %s", ZSTD_getErrorName(ret));
            goto out;
        }
        if (ib.pos == ib.size && ob.pos < ob.size) break; /* all input consumed and flushed */
    }
    if (ret != 0) {
        st = kv_fail(KV_E_DATA, "truncated zstd stream");
        goto out;
    }
    *out = buf;
    *out_len = len;
    buf = NULL;
out:
    free(buf);
    ZSTD_freeDCtx(dc);
    return st;
}

static kv_status read_fd(int fd, uint8_t **out, size_t *out_len)
{
    size_t cap = 1 << 16, len = 0;
    uint8_t *buf = malloc(cap);
    if (!buf) return kv_fail(KV_E_NOMEM, "cannot allocate an input buffer");
    for (;;) {
        if (len == cap) {
            uint8_t *nb = cap < SIZE_MAX / 2 ? realloc(buf, cap * 2) : NULL;
            if (!nb) {
                free(buf);
                return kv_fail(KV_E_NOMEM, "input too large for memory (%zu bytes read)", len);
            }
            buf = nb;
            cap *= 2;
        }
        ssize_t r = read(fd, buf + len, cap - len);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            free(buf);
            return kv_fail(KV_E_IO, "read error: %s", strerror(e));
        }
        if (r == 0) break;
        len += (size_t)r;
    }
    *out = buf;
    *out_len = len;
    return KV_OK;
}

/* Takes ownership of f's bytes; on failure frees f. */
static kv_status finish_open(kvc_file *f, kvc_file **out)
{
    if (is_zstd(f->bytes, f->len)) {
        uint8_t *raw = NULL;
        size_t n = 0;
        kv_status st = inflate_zstd(f->bytes, f->len, &raw, &n);
        if (st) {
            kvc_close(f);
            return st;
        }
        if (f->map) munmap(f->map, f->map_len);
        f->map = NULL;
        free(f->owned);
        f->owned = raw;
        f->bytes = raw;
        f->len = n;
        f->zstd = true;
    }
    kv_status st = kvc_parse(f);
    if (st) {
        kvc_close(f);
        return st;
    }
    *out = f;
    return KV_OK;
}

kv_status kvc_open_mem(const void *buf, size_t len, kvc_file **out)
{
    *out = NULL;
    kvc_file *f = calloc(1, sizeof *f);
    if (!f) return kv_fail(KV_E_NOMEM, "cannot allocate a kvc_file");
    f->owned = malloc(len ? len : 1);
    if (!f->owned) {
        free(f);
        return kv_fail(KV_E_NOMEM, "cannot allocate %zu bytes", len);
    }
    if (len) memcpy(f->owned, buf, len);
    f->bytes = f->owned;
    f->len = len;
    f->file_bytes = len;
    return finish_open(f, out);
}

kv_status kvc_open(const char *path, kvc_file **out)
{
    *out = NULL;
    kvc_file *f = calloc(1, sizeof *f);
    if (!f) return kv_fail(KV_E_NOMEM, "cannot allocate a kvc_file");
    bool is_stdin = strcmp(path, "-") == 0;
    int fd = is_stdin ? 0 : open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        free(f);
        return kv_fail(KV_E_NOINPUT, "cannot open: %s", strerror(e));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        if (!is_stdin) close(fd);
        free(f);
        return kv_fail(KV_E_NOINPUT, "cannot stat: %s", strerror(e));
    }
    if (S_ISDIR(sb.st_mode)) {
        if (!is_stdin) close(fd);
        free(f);
        return kv_fail(KV_E_NOINPUT, "is a directory");
    }
    kv_status st = KV_OK;
    if (S_ISREG(sb.st_mode) && sb.st_size > 0) {
        f->map_len = (size_t)sb.st_size;
        f->map = mmap(NULL, f->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (f->map == MAP_FAILED) f->map = NULL; /* fall back to reading */
        else {
            f->bytes = f->map;
            f->len = f->map_len;
        }
    }
    if (!f->map) {
        size_t n = 0;
        st = read_fd(fd, &f->owned, &n);
        f->bytes = f->owned;
        f->len = n;
    }
    if (!is_stdin) close(fd);
    if (st) {
        kvc_close(f);
        return st;
    }
    f->file_bytes = f->len;
    return finish_open(f, out);
}

