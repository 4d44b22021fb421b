/*
 * kvc_file: the open .kvc file (man/kvc.5): getting its bytes into one
 * range (mmap of a regular file, a pipe or stdin read as far as the header
 * describes, zstd inflated no further than that), handing them to the
 * parser (kvc_parse.c), and the accessors over the validated tables.
 */
#include "format/kvc_int.h"

#include <cjson/cJSON.h>
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

/* A tensor opened by its header alone (kvc_open_head) has no bytes to read. */
static kv_status no_data(const kvc_tensor *t)
{
    return kv_fail(KV_E_USAGE, "tensor %s has no data here: the file was opened by its header alone", t->name);
}

kv_status kvc_tokens(const kvc_file *f, int32_t **ids, int *n)
{
    *ids = NULL;
    *n = 0;
    const kvc_tensor *t = kvc_find(f, "tokens");
    if (!t || t->dtype != KV_DT_I32 || t->ndim != 1) return kv_fail(KV_E_DATA, "no tokens tensor (I32 [T])");
    if (!t->data && t->nbytes) return no_data(t);
    *ids = malloc((size_t)t->shape[0] * sizeof **ids + 1);
    if (!*ids) return kv_fail(KV_E_NOMEM, "out of memory");
    memcpy(*ids, t->data, (size_t)t->shape[0] * sizeof **ids);
    *n = (int)t->shape[0];
    return KV_OK;
}

kv_status kvc_positions(const kvc_file *f, int32_t **pos, int *n)
{
    *pos = NULL;
    *n = 0;
    const kvc_tensor *t = kvc_find(f, "positions");
    if (!t) return KV_OK;
    if (t->dtype != KV_DT_I32 || t->ndim != 1) return kv_fail(KV_E_DATA, "positions is not I32 [T]");
    if (!t->data && t->nbytes) return no_data(t);
    *pos = malloc((size_t)t->shape[0] * sizeof **pos + 1);
    if (!*pos) return kv_fail(KV_E_NOMEM, "out of memory");
    memcpy(*pos, t->data, (size_t)t->shape[0] * sizeof **pos);
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
    if (!p && n) return no_data(t);
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

/* The header length of b (len >= 8). */
static uint64_t header_len(const uint8_t *b)
{
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | b[i];
    return n;
}

/*
 * The size a .kvc's own header gives it: 8 + header + the end of the last
 * tensor's data (the tiling rule makes that the whole file).  b holds the
 * first len bytes.  Returns 0 while they are too few to tell, 1 with *size
 * set, -1 when the header is unusable (reading stops there and kvc_parse() says
 * what is wrong with it).  A reader of an unbounded input (a pipe, a zstd
 * stream) stops at this size instead of at memory exhaustion.
 */
static int described_size(const uint8_t *b, size_t len, uint64_t *size)
{
    if (len < 8) return 0;
    uint64_t n = header_len(b);
    if (n < 2 || n > KVC_HEADER_MAX) return -1;
    if (len < 8 + n) return 0;
    cJSON *root = cJSON_ParseWithLength((const char *)b + 8, (size_t)n);
    if (!root) return -1;
    double end = 0;
    for (const cJSON *e = root->child; e; e = e->next) {
        const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
        const cJSON *x = cJSON_IsArray(jo) ? cJSON_GetArrayItem(jo, 1) : NULL;
        if (cJSON_IsNumber(x) && x->valuedouble > end) end = x->valuedouble;
    }
    cJSON_Delete(root);
    if (!(end <= (double)KVC_ZSTD_MAX)) return -1; /* kvc_parse() rejects the offsets */
    *size = 8 + n + (uint64_t)end;
    return 1;
}

/*
 * Inflate zstd input: the n bytes at in, then (fd >= 0) the rest of fd.
 * The output stops at what the .kvc header inside describes (one byte
 * more is an error, not a reason to keep inflating: a 145 KB stream of
 * zeros inflated to 4 GiB before the tiling check refused it), and the
 * input at what any zstd encoding of that could take.  *in_total: the
 * compressed bytes read.
 */
static kv_status inflate_zstd(const uint8_t *in, size_t n, int fd, uint64_t *in_total,
                              uint8_t **out, size_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    *in_total = n;
    ZSTD_DCtx *dc = ZSTD_createDCtx();
    if (!dc) return kv_fail(KV_E_NOMEM, "cannot allocate a zstd context");
    size_t cap = 1 << 16;
    unsigned long long want = ZSTD_getFrameContentSize(in, n);
    if (want != ZSTD_CONTENTSIZE_UNKNOWN && want != ZSTD_CONTENTSIZE_ERROR &&
        want < (1ull << 32) && want <= n * 1024ull + (1 << 20))
        cap = (size_t)want + 1; /* trust the frame header only within reason */
    const size_t stage_cap = fd >= 0 ? ZSTD_DStreamInSize() : 0;
    uint8_t *buf = malloc(cap), *stage = fd >= 0 ? malloc(stage_cap) : NULL;
    kv_status st = KV_OK;
    ZSTD_inBuffer ib = {in, n, 0};
    size_t len = 0, ret = 0;
    bool eof = fd < 0;
    /* before the header is out, its own maximum bounds the output */
    uint64_t limit = 8 + (uint64_t)KVC_HEADER_MAX;
    int described = 0; /* described_size's answer once it is not 0 */
    if (!buf || (fd >= 0 && !stage)) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate %zu bytes for zstd output", cap);
        goto out;
    }
    /* Done when a frame has ended (ret 0) with all input consumed; that
     * can coincide with a full output buffer (a 65536 * 2^k byte file of
     * unknown size), so it is not "output left over".  Truncated when the
     * input is gone, the frame is not, and there was room to write more. */
    bool frame_done = false, stuck = false;
    for (;;) {
        if (ib.pos == ib.size && !eof) {
            ssize_t r = read(fd, stage, stage_cap);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) {
                st = kv_fail(KV_E_IO, "read error: %s", strerror(errno));
                goto out;
            }
            if (r == 0) eof = true;
            ib = (ZSTD_inBuffer){stage, (size_t)r, 0};
            *in_total += (uint64_t)r;
            if (*in_total > ZSTD_compressBound((size_t)limit) + (1u << 20)) {
                st = kv_fail(KV_E_DATA, "zstd input is longer than any encoding of the %llu bytes its "
                                        "header describes", (unsigned long long)limit);
                goto out;
            }
            continue;
        }
        if (ib.pos == ib.size && (frame_done || stuck)) break;
        if (len == cap) {
            uint64_t ncap = (uint64_t)cap * 2 < limit + 1 ? (uint64_t)cap * 2 : limit + 1;
            if (ncap <= cap) { /* full at limit + 1: one byte past the header's size */
                st = described > 0 ? kv_fail(KV_E_DATA, "zstd data inflates past the %llu bytes its "
                                                    "header describes", (unsigned long long)limit)
                               : kv_fail(KV_E_DATA, "zstd data: no .kvc header in the first %llu bytes",
                                         (unsigned long long)limit);
                goto out;
            }
            uint8_t *nb = realloc(buf, (size_t)ncap);
            if (!nb) {
                st = kv_fail(KV_E_NOMEM, "cannot allocate %llu bytes for zstd output",
                             (unsigned long long)ncap);
                goto out;
            }
            buf = nb;
            cap = (size_t)ncap;
        }
        ZSTD_outBuffer ob = {buf + len, cap - len, 0};
        ret = ZSTD_decompressStream(dc, &ob, &ib);
        len += ob.pos;
        if (ZSTD_isError(ret)) {
            st = kv_fail(KV_E_DATA, "corrupt zstd stream: %s", ZSTD_getErrorName(ret));
            goto out;
        }
        frame_done = ret == 0;
        stuck = ob.pos < ob.size;
        uint64_t size;
        if (!described && (described = described_size(buf, len, &size))) {
            if (described < 0) break; /* an unusable header: kvc_parse() says why */
            limit = size < KVC_ZSTD_MAX ? size : KVC_ZSTD_MAX;
        }
        if (len > limit) {
            st = kv_fail(KV_E_DATA, "zstd data inflates past the %llu bytes its header describes",
                         (unsigned long long)limit);
            goto out;
        }
    }
    if (ret != 0 && described >= 0) {
        st = kv_fail(KV_E_DATA, "truncated zstd stream");
        goto out;
    }
    *out = buf;
    *out_len = len;
    buf = NULL;
out:
    free(buf);
    free(stage);
    ZSTD_freeDCtx(dc);
    return st;
}

/* Read a plain .kvc from fd after its first hn bytes (in head): exactly
 * what its header describes, plus one byte to show trailing data (which
 * kvc_parse() then reports); never more, however long the input runs. */
static kv_status read_described(int fd, const uint8_t *head, size_t hn, uint8_t **out, size_t *out_len)
{
    size_t cap = 1 << 16, len = hn;
    uint8_t *buf = malloc(cap);
    if (!buf) return kv_fail(KV_E_NOMEM, "cannot allocate an input buffer");
    memcpy(buf, head, hn);
    uint64_t size = 0;
    int described = 0;
    for (;;) {
        if (!described && (described = described_size(buf, len, &size)) < 0) break;
        /* what to have: the length, then the header, then the file + 1 */
        uint64_t target = described ? size + 1 : len < 8 ? 8 : 8 + header_len(buf);
        if (target > KVC_ZSTD_MAX + 1) target = KVC_ZSTD_MAX + 1;
        if (len >= target) break;
        if (len == cap) {
            uint64_t ncap = (uint64_t)cap * 2 < target ? (uint64_t)cap * 2 : target;
            uint8_t *nb = ncap <= SIZE_MAX ? realloc(buf, (size_t)ncap) : NULL;
            if (!nb) {
                free(buf);
                return kv_fail(KV_E_NOMEM, "input too large for memory (%zu bytes read)", len);
            }
            buf = nb;
            cap = (size_t)ncap;
        }
        size_t room = cap - len;
        if (room > target - len) room = (size_t)(target - len);
        ssize_t r = read(fd, buf + len, room);
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

/* Takes ownership of f's bytes; on failure frees f.  Input still compressed
 * (a mapped file, a buffer) is inflated here. */
static kv_status finish_open(kvc_file *f, kvc_file **out)
{
    if (!f->zstd && is_zstd(f->bytes, f->len)) {
        uint8_t *raw = NULL;
        size_t n = 0;
        uint64_t used;
        kv_status st = inflate_zstd(f->bytes, f->len, -1, &used, &raw, &n);
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

kv_status kvc_open_view(const void *buf, size_t len, kvc_file **out)
{
    *out = NULL;
    kvc_file *f = calloc(1, sizeof *f);
    if (!f) return kv_fail(KV_E_NOMEM, "cannot allocate a kvc_file");
    f->bytes = buf;
    f->len = len;
    f->file_bytes = len;
    f->trusted = true;
    return finish_open(f, out);
}

kv_status kvc_open_head(const void *head, size_t head_len, uint64_t file_len, kvc_file **out)
{
    *out = NULL;
    const uint8_t *b = head;
    if (head_len < 8 || file_len < 8)
        return kv_fail(KV_E_DATA, "truncated: shorter than the 8-byte header length");
    if (head_len > file_len) return kv_fail(KV_E_USAGE, "%zu header bytes given of a %llu-byte file", head_len,
                                            (unsigned long long)file_len);
    if (is_zstd(b, head_len)) return kv_fail(KV_E_UNSUPPORTED, "a compressed .kvc has no header to read alone");
    uint64_t n = header_len(b);
    if (n > KVC_HEADER_MAX)
        return kv_fail(KV_E_DATA, "header length %llu is absurd (limit %u bytes)", (unsigned long long)n, KVC_HEADER_MAX);
    if (n > head_len - 8)
        return kv_fail(KV_E_DATA, "header length %llu: only %zu bytes of it were given", (unsigned long long)n,
                       head_len - 8);
    kvc_file *f = calloc(1, sizeof *f);
    if (!f) return kv_fail(KV_E_NOMEM, "cannot allocate a kvc_file");
    f->bytes = b;
    f->len = (size_t)file_len;
    f->file_bytes = file_len;
    f->head_only = true;
    kv_status st = kvc_parse(f);
    if (st) {
        kvc_close(f);
        return st;
    }
    f->bytes = NULL; /* the caller's header may go: nothing refers to it now */
    *out = f;
    return KV_OK;
}

uint64_t kvc_data_start(const kvc_file *f) { return f->data_start; }

kv_status kvc_open_fd(int fd, kvc_file **out)
{
    *out = NULL;
    kvc_file *f = calloc(1, sizeof *f);
    if (!f) return kv_fail(KV_E_NOMEM, "cannot allocate a kvc_file");
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        free(f);
        return kv_fail(KV_E_NOINPUT, "cannot stat: %s", strerror(e));
    }
    if (S_ISDIR(sb.st_mode)) {
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
            f->file_bytes = f->len;
        }
    }
    if (!f->map) { /* a pipe, a device, stdin: read what the header describes */
        uint8_t head[8];
        size_t hn = 0;
        while (hn < sizeof head) {
            ssize_t r = read(fd, head + hn, sizeof head - hn);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) {
                st = kv_fail(KV_E_IO, "read error: %s", strerror(errno));
                break;
            }
            if (r == 0) break;
            hn += (size_t)r;
        }
        size_t n = 0;
        if (!st && is_zstd(head, hn)) {
            st = inflate_zstd(head, hn, fd, &f->file_bytes, &f->owned, &n);
            f->zstd = true;
        } else if (!st) {
            st = read_described(fd, head, hn, &f->owned, &n);
            f->file_bytes = n;
        }
        f->bytes = f->owned;
        f->len = n;
    }
    if (st) {
        kvc_close(f);
        return st;
    }
    return finish_open(f, out);
}

kv_status kvc_open(const char *path, kvc_file **out)
{
    *out = NULL;
    bool is_stdin = strcmp(path, "-") == 0;
    int fd = is_stdin ? 0 : open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kv_fail(KV_E_NOINPUT, "cannot open: %s", strerror(errno));
    kv_status st = kvc_open_fd(fd, out);
    if (!is_stdin) close(fd);
    return st;
}
