/*
 * The .kvc reader and writer (man/kvc.5).  Reading maps a regular file (or
 * reads stdin, or inflates zstd input) into one byte range, then validates it
 * in passes that each trust only what the previous one proved: header length,
 * JSON syntax, each tensor entry, the tiling of the data section, the
 * checksums, and last the KV-cache geometry across layers.  Every failure is
 * a KV_E_DATA with a message naming the tensor or key at fault; no pass reads
 * a byte that an earlier pass did not bound.  Writing builds the header
 * itself (exact integers, data order), pads it so the data section starts at
 * KVC_DATA_ALIGN, and goes through the atomic kv_outfile.
 */
#include "format/kvc.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "common/kv_file.h"
#include "common/kv_half.h"

#define KVC_HEADER_MAX (100u << 20)        /* safetensors' own limit */
#define KVC_ZSTD_MAX ((uint64_t)1 << 36)   /* 64 GiB decompressed */
#define KVC_DIM_MAX INT32_MAX

// --- dtypes ---------------------------------------------------------------

static const struct {
    const char *name;
    size_t size;
} dtype_table[KV_DT_COUNT] = {
    [KV_DT_F32] = {"F32", 4}, [KV_DT_F16] = {"F16", 2}, [KV_DT_BF16] = {"BF16", 2},
    [KV_DT_I32] = {"I32", 4}, [KV_DT_U8] = {"U8", 1},   [KV_DT_I8] = {"I8", 1},
    [KV_DT_I64] = {"I64", 8}, [KV_DT_U32] = {"U32", 4},
};

size_t kv_dtype_size(kv_dtype dt)
{
    return (unsigned)dt < KV_DT_COUNT ? dtype_table[dt].size : 0;
}

const char *kv_dtype_name(kv_dtype dt)
{
    return (unsigned)dt < KV_DT_COUNT ? dtype_table[dt].name : "?";
}

kv_status kv_dtype_parse(const char *s, kv_dtype *out)
{
    for (int i = 0; i < KV_DT_COUNT; i++) {
        if (strcmp(s, dtype_table[i].name) == 0) {
            *out = (kv_dtype)i;
            return KV_OK;
        }
    }
    return kv_fail(KV_E_DATA, "unknown dtype '%.32s'", s);
}

void kv_geom_defaults(kv_geom *g)
{
    memset(g, 0, sizeof *g);
    g->rope_theta = 10000.0;
    g->rope_scaling = KV_ROPE_SCALING_NONE;
    g->keys_roped = true;
    g->rope_layout = KV_ROPE_INTERLEAVED;
}

// --- CRC-32C ----------------------------------------------------------------

/* Portable path: slicing-by-8 over the reflected Castagnoli polynomial,
 * eight table lookups per 8 bytes (about 1 GB/s). */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

uint32_t kv_crc32c_sw(uint32_t crc, const void *buf, size_t n)
{
    pthread_once(&crc_once, crc_init);
    const uint8_t *p = buf;
    uint32_t c = ~crc;
    while (n && ((uintptr_t)p & 7u)) {
        c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c; /* little-endian: the low 4 bytes meet the running CRC */
        c = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^
            crc_table[5][(w >> 16) & 0xff] ^ crc_table[4][(w >> 24) & 0xff] ^
            crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
            crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
    return ~c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* SSE4.2 has a CRC-32C instruction (8 bytes per ~3 cycles): several times
 * the table's speed, which matters for multi-GB caches.  Chosen at run time,
 * so the binary still runs on CPUs without it. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    uint64_t c = ~crc;
    while (n && ((uintptr_t)p & 7u)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return ~(uint32_t)c;
}

uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t n)
{
    /* __builtin_cpu_supports reads a table filled before main: cheap, no race. */
    return __builtin_cpu_supports("sse4.2") ? crc32c_hw(crc, buf, n) : kv_crc32c_sw(crc, buf, n);
}
#else
uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t n) { return kv_crc32c_sw(crc, buf, n); }
#endif

// --- the open file ----------------------------------------------------------

typedef struct {
    char enc[2][8];           /* [k, v]: "f16", "kivi", ... */
    kv_kivi_params kivi[2];
    uint64_t bytes, kv_bytes; /* all layers.{i}.* tensors; only K/V parts */
} layer_info;

struct kvc_file {
    void *map;       /* mmap of a regular file, or NULL */
    size_t map_len;
    uint8_t *owned;  /* heap bytes (stdin, zstd, kvc_open_mem), or NULL */
    const uint8_t *bytes; /* the uncompressed file */
    size_t len;
    uint64_t file_bytes;
    bool zstd;

    kvc_tensor *t;   /* (nt) in data order */
    int nt;
    int *by_name;    /* (nt) indices into t, sorted by name */
    char **mkey, **mval; /* (nm) metadata in header order */
    int nm;
    int *meta_by_key; /* (nm) sorted by key */
    int n_crc;

    kv_geom g;
    layer_info *li;  /* (g.n_layers) */
};

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

void kvc_free(kvc_file *f)
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
 * set, -1 when the header is unusable (reading stops there and parse() says
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
    if (!(end <= (double)KVC_ZSTD_MAX)) return -1; /* parse() rejects the offsets */
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
            if (described < 0) break; /* an unusable header: parse() says why */
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
 * parse() then reports); never more, however long the input runs. */
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

static kv_status parse(kvc_file *f);

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
            kvc_free(f);
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
    kv_status st = parse(f);
    if (st) {
        kvc_free(f);
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
        kvc_free(f);
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

// --- parsing: header and tensor table ---------------------------------------

/* A JSON number that is an exact non-negative integer <= max. */
static bool json_uint(const cJSON *j, double max, uint64_t *out)
{
    if (!cJSON_IsNumber(j)) return false;
    double d = j->valuedouble;
    if (!(d >= 0) || d > max || d != floor(d)) return false;
    *out = (uint64_t)d;
    return true;
}

static kv_status parse_tensor(const cJSON *e, kvc_tensor *t)
{
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return kv_fail(KV_E_DATA, "tensor %s: entry is not a JSON object", name);
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(jd)) return kv_fail(KV_E_DATA, "tensor %s: dtype missing or not a string", name);
    if (!cJSON_IsArray(js)) return kv_fail(KV_E_DATA, "tensor %s: shape missing or not an array", name);
    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2)
        return kv_fail(KV_E_DATA, "tensor %s: data_offsets missing or not [begin, end]", name);
    if (kv_dtype_parse(jd->valuestring, &t->dtype)) {
        kv_errcontext("tensor %s", name);
        return KV_E_DATA;
    }
    int nd = cJSON_GetArraySize(js);
    if (nd > KVC_MAX_DIMS)
        return kv_fail(KV_E_DATA, "tensor %s: %d dimensions, at most %d allowed", name, nd, KVC_MAX_DIMS);
    t->ndim = nd;
    uint64_t numel = 1;
    bool empty = false;
    int d = 0;
    for (const cJSON *x = js->child; x; x = x->next, d++) {
        uint64_t v;
        if (cJSON_IsNumber(x) && x->valuedouble < 0)
            return kv_fail(KV_E_DATA, "tensor %s: negative dimension %g", name, x->valuedouble);
        if (!json_uint(x, 9007199254740992.0, &v))
            return kv_fail(KV_E_DATA, "tensor %s: dimension %d is not a non-negative integer", name, d);
        if (v > KVC_DIM_MAX)
            return kv_fail(KV_E_DATA, "tensor %s: dimension %llu too large", name, (unsigned long long)v);
        t->shape[d] = (int64_t)v;
        if (v == 0) empty = true;
        else if (!empty && numel > (UINT64_MAX >> 4) / v)
            return kv_fail(KV_E_DATA, "tensor %s: shape overflows", name);
        else numel *= v;
    }
    if (empty) numel = 0;
    uint64_t b, en;
    if (!json_uint(jo->child, 9007199254740992.0, &b) || !json_uint(jo->child->next, 9007199254740992.0, &en))
        return kv_fail(KV_E_DATA, "tensor %s: data_offsets are not non-negative integers", name);
    if (en < b)
        return kv_fail(KV_E_DATA, "tensor %s: data_offsets [%llu, %llu] out of order", name,
                       (unsigned long long)b, (unsigned long long)en);
    uint64_t want = numel * kv_dtype_size(t->dtype);
    if (en - b != want)
        return kv_fail(KV_E_DATA, "tensor %s: %llu data bytes but its %s shape needs %llu", name,
                       (unsigned long long)(en - b), kv_dtype_name(t->dtype), (unsigned long long)want);
    t->offset = b;
    t->nbytes = want;
    return KV_OK;
}

static int cmp_offset(const void *a, const void *b)
{
    const kvc_tensor *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return 0;
}

/* qsort has no context argument; the file whose indexes are being sorted is
 * passed through this thread-local pointer. */
static _Thread_local const kvc_file *sort_file;
static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp(sort_file->t[*(const int *)a].name, sort_file->t[*(const int *)b].name);
}
static int cmp_meta_key(const void *a, const void *b)
{
    return strcmp(sort_file->mkey[*(const int *)a], sort_file->mkey[*(const int *)b]);
}

static kv_status parse_metadata(kvc_file *f, const cJSON *m)
{
    if (!cJSON_IsObject(m)) return kv_fail(KV_E_DATA, "__metadata__ is not a JSON object");
    int n = cJSON_GetArraySize(m);
    f->mkey = calloc((size_t)n + 1, sizeof *f->mkey);
    f->mval = calloc((size_t)n + 1, sizeof *f->mval);
    if (!f->mkey || !f->mval) return kv_fail(KV_E_NOMEM, "cannot allocate metadata");
    for (const cJSON *x = m->child; x; x = x->next) {
        if (!cJSON_IsString(x))
            return kv_fail(KV_E_DATA, "metadata key '%.64s': value is not a string", x->string);
        f->mkey[f->nm] = strdup(x->string);
        f->mval[f->nm] = strdup(x->valuestring);
        f->nm++;
        if (!f->mkey[f->nm - 1] || !f->mval[f->nm - 1])
            return kv_fail(KV_E_NOMEM, "cannot allocate metadata");
    }
    return KV_OK;
}

static kv_status parse_header(kvc_file *f, uint64_t *data_start)
{
    if (f->len == 0) return kv_fail(KV_E_DATA, "empty file");
    if (f->len < 8)
        return kv_fail(KV_E_DATA, "truncated: %zu bytes, shorter than the 8-byte header length", f->len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | f->bytes[i];
    if (n > KVC_HEADER_MAX)
        return kv_fail(KV_E_DATA, "header length %llu is absurd (limit %u bytes)",
                       (unsigned long long)n, KVC_HEADER_MAX);
    if (n > f->len - 8)
        return kv_fail(KV_E_DATA, "header length %llu past end of file (%zu bytes follow it)",
                       (unsigned long long)n, f->len - 8);
    if (n < 2) return kv_fail(KV_E_DATA, "header length %llu too small for a JSON object",
                              (unsigned long long)n);
    const char *h = (const char *)f->bytes + 8;
    if (memchr(h, 0, n)) return kv_fail(KV_E_DATA, "header contains a NUL byte");
    char *txt = malloc(n + 1);
    if (!txt) return kv_fail(KV_E_NOMEM, "cannot allocate %llu bytes", (unsigned long long)n);
    memcpy(txt, h, n);
    txt[n] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(txt, &end, 0);
    kv_status st = KV_OK;
    if (!root) {
        st = kv_fail(KV_E_DATA, "malformed JSON header near byte %ld",
                     end ? (long)(end - txt) : -1L);
        goto out;
    }
    for (const char *p = end; *p; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            st = kv_fail(KV_E_DATA, "garbage after the JSON header at byte %ld", (long)(p - txt));
            goto out;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = kv_fail(KV_E_DATA, "header is not a JSON object");
        goto out;
    }
    int nchild = cJSON_GetArraySize(root);
    f->t = calloc((size_t)nchild + 1, sizeof *f->t);
    if (!f->t) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate the tensor table");
        goto out;
    }
    bool have_meta = false;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) {
            if (have_meta) {
                st = kv_fail(KV_E_DATA, "duplicate __metadata__");
                goto out;
            }
            have_meta = true;
            if ((st = parse_metadata(f, e))) goto out;
            continue;
        }
        size_t nl = strlen(e->string);
        if (nl == 0) {
            st = kv_fail(KV_E_DATA, "tensor with an empty name");
            goto out;
        }
        if (nl >= KVC_NAME_MAX) {
            st = kv_fail(KV_E_DATA, "tensor name '%.40s...' longer than %d bytes", e->string,
                         KVC_NAME_MAX - 1);
            goto out;
        }
        kvc_tensor *t = &f->t[f->nt];
        memcpy(t->name, e->string, nl + 1);
        if ((st = parse_tensor(e, t))) goto out;
        f->nt++;
    }
    *data_start = 8 + n;
out:
    cJSON_Delete(root);
    free(txt);
    return st;
}

static kv_status check_tiling(kvc_file *f, uint64_t data_start)
{
    uint64_t data_len = f->len - data_start;
    qsort(f->t, (size_t)f->nt, sizeof *f->t, cmp_offset);
    uint64_t pos = 0;
    for (int i = 0; i < f->nt; i++) {
        kvc_tensor *t = &f->t[i];
        if (t->offset > pos)
            return kv_fail(KV_E_DATA, "hole of %llu bytes before tensor %s (data offset %llu)",
                           (unsigned long long)(t->offset - pos), t->name, (unsigned long long)pos);
        if (t->offset < pos)
            return kv_fail(KV_E_DATA, "tensor %s overlaps tensor %s", t->name, f->t[i - 1].name);
        pos = t->offset + t->nbytes;
        if (pos > data_len)
            return kv_fail(KV_E_DATA, "truncated: tensor %s ends at data byte %llu but the data section has %llu",
                           t->name, (unsigned long long)pos, (unsigned long long)data_len);
        t->data = f->bytes + data_start + t->offset;
    }
    if (pos < data_len)
        return kv_fail(KV_E_DATA, "%llu bytes after the last tensor", (unsigned long long)(data_len - pos));

    f->by_name = malloc(((size_t)f->nt + 1) * sizeof *f->by_name);
    f->meta_by_key = malloc(((size_t)f->nm + 1) * sizeof *f->meta_by_key);
    if (!f->by_name || !f->meta_by_key) return kv_fail(KV_E_NOMEM, "cannot allocate indexes");
    for (int i = 0; i < f->nt; i++) f->by_name[i] = i;
    for (int i = 0; i < f->nm; i++) f->meta_by_key[i] = i;
    sort_file = f;
    qsort(f->by_name, (size_t)f->nt, sizeof *f->by_name, cmp_tensor_name);
    qsort(f->meta_by_key, (size_t)f->nm, sizeof *f->meta_by_key, cmp_meta_key);
    sort_file = NULL;
    for (int i = 1; i < f->nt; i++)
        if (!strcmp(f->t[f->by_name[i]].name, f->t[f->by_name[i - 1]].name))
            return kv_fail(KV_E_DATA, "duplicate tensor name %s", f->t[f->by_name[i]].name);
    for (int i = 1; i < f->nm; i++)
        if (!strcmp(f->mkey[f->meta_by_key[i]], f->mkey[f->meta_by_key[i - 1]]))
            return kv_fail(KV_E_DATA, "duplicate metadata key '%.64s'", f->mkey[f->meta_by_key[i]]);
    return KV_OK;
}

static kv_status check_crcs(kvc_file *f)
{
    for (int i = 0; i < f->nm; i++) {
        const char *k = f->mkey[i], *v = f->mval[i];
        if (strncmp(k, "crc32c.", 7) != 0) continue;
        kvc_tensor *t = (kvc_tensor *)kvc_find(f, k + 7);
        if (!t) return kv_fail(KV_E_DATA, "checksum for a tensor that does not exist: %.64s", k);
        uint32_t c = 0;
        int n = 0;
        for (; v[n]; n++) {
            char ch = v[n];
            int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
            if (d < 0 || n >= 8) break;
            c = c << 4 | (uint32_t)d;
        }
        if (n != 8 || v[n])
            return kv_fail(KV_E_DATA, "metadata %.64s='%.16s' is not 8 lowercase hex digits", k, v);
        uint32_t got = kv_crc32c(0, t->data, t->nbytes);
        if (got != c)
            return kv_fail(KV_E_DATA, "checksum mismatch in tensor %s (stored %08x, computed %08x)",
                           t->name, c, got);
        t->crc = c;
        t->has_crc = true;
        f->n_crc++;
    }
    /* A writer that checksums every tensor says so (kvc.checksums = the
     * tensor count): a flipped byte that renames one crc32c key must not
     * quietly turn that tensor into an unchecked one. */
    const char *all = kvc_meta(f, "kvc.checksums");
    if (all) {
        char *end;
        errno = 0;
        long n = strtol(all, &end, 10);
        if (errno || end == all || *end || n != f->nt)
            return kv_fail(KV_E_DATA, "metadata kvc.checksums='%.16s' is not the tensor count %d", all, f->nt);
        for (int i = 0; i < f->nt; i++)
            if (!f->t[i].has_crc)
                return kv_fail(KV_E_DATA, "tensor %s has no checksum, but the writer checksummed all %d "
                                          "tensors (a crc32c key lost or renamed)", f->t[i].name, f->nt);
    }
    return KV_OK;
}

// --- parsing: geometry ------------------------------------------------------

/* Strict decimal integer in [lo, hi]. */
static bool parse_int(const char *s, long lo, long hi, long *out)
{
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi || (s[0] != '-' && (s[0] < '0' || s[0] > '9')))
        return false;
    *out = v;
    return true;
}

/* Integer metadata key: absent -> *out untouched, false; bad -> error. */
static kv_status meta_int(const kvc_file *f, const char *key, long lo, long hi, long *out, bool *present)
{
    const char *v = kvc_meta(f, key);
    *present = v != NULL;
    if (!v) return KV_OK;
    if (!parse_int(v, lo, hi, out))
        return kv_fail(KV_E_DATA, "metadata %s='%.32s' is not an integer in [%ld, %ld]", key, v, lo, hi);
    return KV_OK;
}

static kv_status meta_real(const kvc_file *f, const char *key, double *out, bool required)
{
    const char *v = kvc_meta(f, key);
    if (!v) return required ? kv_fail(KV_E_DATA, "metadata %s is required here", key) : KV_OK;
    char *end;
    double d = strtod(v, &end);
    if (end == v || *end || !isfinite(d))
        return kv_fail(KV_E_DATA, "metadata %s='%.32s' is not a number", key, v);
    *out = d;
    return KV_OK;
}

/* Per-layer shapes as the layers describe them; -1 = unknown. */
typedef struct {
    int kvh, T, hd;
    const char *from; /* name of the tensor they came from */
    char from_buf[KVC_NAME_MAX + 32];
} shape3;

static kv_status need_part(const kvc_file *f, int layer, char which, const char *part, kv_dtype dt,
                           const kvc_tensor **out)
{
    char name[64];
    snprintf(name, sizeof name, "%c.%s", which, part);
    const kvc_tensor *t = kvc_layer(f, layer, name);
    if (!t) return kv_fail(KV_E_DATA, "layer %d: kivi %s lack layers.%d.%s", layer,
                           which == 'k' ? "keys" : "values", layer, name);
    if (t->dtype != dt || t->ndim != 3)
        return kv_fail(KV_E_DATA, "layers.%d.%s must be a 3-dimensional %s tensor", layer, name,
                       kv_dtype_name(dt));
    *out = t;
    return KV_OK;
}

static kv_status expect_shape(const kvc_tensor *t, int64_t a, int64_t b, int64_t c)
{
    if (t->shape[0] != a || t->shape[1] != b || t->shape[2] != c)
        return kv_fail(KV_E_DATA, "%s has shape [%lld,%lld,%lld], kivi parameters imply [%lld,%lld,%lld]",
                       t->name, (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2],
                       (long long)a, (long long)b, (long long)c);
    return KV_OK;
}

static kv_status check_kivi(kvc_file *f, int layer, char which, shape3 *s)
{
    kv_status st;
    char key[64];
    long bits, group, resid;
    bool have;
    const char *w = which == 'k' ? "k" : "v";
    snprintf(key, sizeof key, "layers.%d.%s.bits", layer, w);
    if ((st = meta_int(f, key, 1, 4, &bits, &have))) return st;
    if (!have) return kv_fail(KV_E_DATA, "layers.%d.%s.encoding=kivi needs metadata %s", layer, w, key);
    if (bits == 3) return kv_fail(KV_E_DATA, "metadata %s=3: kivi bits must be 1, 2 or 4", key);
    snprintf(key, sizeof key, "layers.%d.%s.group", layer, w);
    if ((st = meta_int(f, key, 1, 1 << 20, &group, &have))) return st;
    if (!have) return kv_fail(KV_E_DATA, "layers.%d.%s.encoding=kivi needs metadata %s", layer, w, key);
    snprintf(key, sizeof key, "layers.%d.%s.residual", layer, w);
    if ((st = meta_int(f, key, 0, 1 << 30, &resid, &have))) return st;
    if (!have) return kv_fail(KV_E_DATA, "layers.%d.%s.encoding=kivi needs metadata %s", layer, w, key);

    const kvc_tensor *codes, *scale, *zero, *res;
    if ((st = need_part(f, layer, which, "codes", KV_DT_U8, &codes)) ||
        (st = need_part(f, layer, which, "scale", KV_DT_F16, &scale)) ||
        (st = need_part(f, layer, which, "zero", KV_DT_F16, &zero)) ||
        (st = need_part(f, layer, which, "resid", KV_DT_F16, &res)))
        return st;
    int64_t kvh = codes->shape[0], tq = codes->shape[1], hd = res->shape[2];
    int64_t T = tq + res->shape[1];
    if (T > INT32_MAX) return kv_fail(KV_E_DATA, "layer %d: kivi token count overflows", layer);
    if (res->shape[0] != kvh)
        return kv_fail(KV_E_DATA, "%s has %lld heads but %s has %lld", res->name,
                       (long long)res->shape[0], codes->name, (long long)kvh);
    if (hd * bits % 8)
        return kv_fail(KV_E_DATA, "layer %d: kivi head dim %lld times %ld bits is not whole bytes",
                       layer, (long long)hd, bits);
    int nq = kv_kivi_nquant((int)T, (int)group, (int)resid);
    if (tq != nq)
        return kv_fail(KV_E_DATA, "%s holds %lld quantized tokens but kivi with T=%lld, G=%ld, R=%ld quantizes %d",
                       codes->name, (long long)tq, (long long)T, group, resid, nq);
    if ((st = expect_shape(codes, kvh, tq, hd * bits / 8))) return st;
    if (which == 'k') {
        if ((st = expect_shape(scale, kvh, tq / group, hd)) || (st = expect_shape(zero, kvh, tq / group, hd)))
            return st;
    } else {
        int64_t gv = group < hd ? group : hd;
        if (gv == 0 || hd % gv)
            return kv_fail(KV_E_DATA, "layer %d: value group %lld does not divide head dim %lld", layer,
                           (long long)gv, (long long)hd);
        if ((st = expect_shape(scale, kvh, tq, hd / gv)) || (st = expect_shape(zero, kvh, tq, hd / gv)))
            return st;
    }
    layer_info *li = &f->li[layer];
    li->kivi[which == 'v'] = (kv_kivi_params){(int)bits, (int)group, (int)resid};
    s->kvh = (int)kvh;
    s->T = (int)T;
    s->hd = (int)hd;
    snprintf(s->from_buf, sizeof s->from_buf, "%s", codes->name);
    s->from = s->from_buf;
    return KV_OK;
}

static kv_status need_part_n(const kvc_file *f, int layer, char which, const char *part, kv_dtype dt,
                             int ndim, const kvc_tensor **out)
{
    char name[64];
    snprintf(name, sizeof name, "%c.%s", which, part);
    const kvc_tensor *t = kvc_layer(f, layer, name);
    if (!t) return kv_fail(KV_E_DATA, "layer %d: dsq %s lack layers.%d.%s", layer,
                           which == 'k' ? "keys" : "values", layer, name);
    if (t->dtype != dt || t->ndim != ndim)
        return kv_fail(KV_E_DATA, "layers.%d.%s must be a %d-dimensional %s tensor", layer, name, ndim,
                       kv_dtype_name(dt));
    *out = t;
    return KV_OK;
}

static kv_status expect_shape4(const kvc_tensor *t, const int64_t *want, int nd)
{
    for (int d = 0; d < nd; d++) {
        if (t->shape[d] != want[d]) {
            char a[96] = "", b[96] = "";
            for (int e = 0; e < nd; e++) {
                size_t la = strlen(a), lb = strlen(b);
                snprintf(a + la, sizeof a - la, "%s%lld", e ? "," : "", (long long)t->shape[e]);
                snprintf(b + lb, sizeof b - lb, "%s%lld", e ? "," : "", (long long)want[e]);
            }
            return kv_fail(KV_E_DATA, "%s has shape [%s], dsq parameters imply [%s]", t->name, a, b);
        }
    }
    return KV_OK;
}

/* DSQ parts as lib/common/kv_layout.h (and man/kvc.5, DSQ ENCODING) lay them out. */
static kv_status check_dsq(kvc_file *f, int layer, char which, shape3 *s)
{
    kv_status st;
    char key[64];
    long W, S, bits, group;
    bool have;
    const char *w = which == 'k' ? "k" : "v";
    const char *names[4] = {"window", "salient", "bits", "group"};
    long *vals[4] = {&W, &S, &bits, &group};
    const long lo[4] = {8, 0, 1, 1}, hi[4] = {4096, 4096, 4, 65536};
    for (int i = 0; i < 4; i++) {
        snprintf(key, sizeof key, "layers.%d.%s.%s", layer, w, names[i]);
        if ((st = meta_int(f, key, lo[i], hi[i], vals[i], &have))) return st;
        if (!have) return kv_fail(KV_E_DATA, "layers.%d.%s.encoding=dsq needs metadata %s", layer, w, key);
    }
    if (W % 8) return kv_fail(KV_E_DATA, "layers.%d.%s.window=%ld is not a multiple of 8", layer, w, W);
    if (S > W) return kv_fail(KV_E_DATA, "layers.%d.%s.salient=%ld exceeds the window %ld", layer, w, S, W);
    if (bits == 3) return kv_fail(KV_E_DATA, "layers.%d.%s.bits=3: dsq bits must be 1, 2 or 4", layer, w);
    const kvc_tensor *mask, *sal, *sscale, *base = NULL, *codes, *scale, *zero, *res;
    if ((st = need_part_n(f, layer, which, "mask", KV_DT_U8, 3, &mask)) ||
        (st = need_part_n(f, layer, which, "sal", KV_DT_I8, 4, &sal)) ||
        (st = need_part_n(f, layer, which, "sscale", KV_DT_F16, 3, &sscale)) ||
        (which == 'k' && (st = need_part_n(f, layer, which, "base", KV_DT_F16, 3, &base))) ||
        (st = need_part_n(f, layer, which, "codes", KV_DT_U8, 4, &codes)) ||
        (st = need_part_n(f, layer, which, "scale", KV_DT_F16, 4, &scale)) ||
        (st = need_part_n(f, layer, which, "zero", KV_DT_F16, 4, &zero)) ||
        (st = need_part_n(f, layer, which, "resid", KV_DT_F16, 3, &res)))
        return st;
    int64_t H = mask->shape[0], nw = mask->shape[1], D = res->shape[2];
    int64_t T = nw * W + res->shape[1];
    if (T > INT32_MAX) return kv_fail(KV_E_DATA, "layer %d: dsq token count overflows", layer);
    if (res->shape[1] >= W)
        return kv_fail(KV_E_DATA, "%s holds %lld tokens, a whole window of %ld should have been packed",
                       res->name, (long long)res->shape[1], W);
    if (D * bits % 8)
        return kv_fail(KV_E_DATA, "layer %d: dsq head dim %lld times %ld bits is not whole bytes", layer,
                       (long long)D, bits);
    int64_t gd = group < D ? group : D;
    if (gd == 0 || D % gd)
        return kv_fail(KV_E_DATA, "layer %d: dsq group %lld does not divide head dim %lld", layer,
                       (long long)gd, (long long)D);
    const int64_t m[3] = {H, nw, W / 8}, sl[4] = {H, nw, S, D}, hd[3] = {H, nw, D};
    const int64_t cd[4] = {H, nw, W - S, D * bits / 8}, sz[4] = {H, nw, W - S, gd ? D / gd : 0};
    const int64_t rs[3] = {H, res->shape[1], D};
    if ((st = expect_shape4(mask, m, 3)) || (st = expect_shape4(sal, sl, 4)) ||
        (st = expect_shape4(sscale, hd, 3)) || (base && (st = expect_shape4(base, hd, 3))) ||
        (st = expect_shape4(codes, cd, 4)) || (st = expect_shape4(scale, sz, 4)) ||
        (st = expect_shape4(zero, sz, 4)) || (st = expect_shape4(res, rs, 3)))
        return st;
    /* Each window marks exactly S salient tokens, or rows would be misplaced. */
    const uint8_t *mb = mask->data;
    for (int64_t i = 0; i < H * nw; i++) {
        long n = 0;
        for (int64_t b = 0; b < W / 8; b++) n += __builtin_popcount(mb[i * (W / 8) + b]);
        if (n != S)
            return kv_fail(KV_E_DATA, "%s: window %lld marks %ld salient tokens, not %ld", mask->name,
                           (long long)i, n, S);
    }
    s->kvh = (int)H;
    s->T = (int)T;
    s->hd = (int)D;
    snprintf(s->from_buf, sizeof s->from_buf, "%s", mask->name);
    s->from = s->from_buf;
    return KV_OK;
}

/* Layer index of a "layers.{i}.rest" name, or -1; *rest gets the part. */
static long layer_of(const char *name, const char **rest)
{
    if (strncmp(name, "layers.", 7) != 0) return -1;
    const char *p = name + 7;
    if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] >= '0' && p[1] <= '9')) return -1;
    long v = 0;
    while (*p >= '0' && *p <= '9') {
        v = v * 10 + (*p++ - '0');
        if (v > 1000000) return -1;
    }
    if (*p != '.') return -1;
    *rest = p + 1;
    return v;
}

static kv_status check_layer_part(kvc_file *f, int i, char which, shape3 *s)
{
    char key[64], tname[32];
    const char *w = which == 'k' ? "k" : "v";
    snprintf(key, sizeof key, "layers.%d.%s.encoding", i, w);
    snprintf(tname, sizeof tname, "%s", w);
    const char *enc = kvc_meta(f, key);
    const kvc_tensor *t = kvc_layer(f, i, tname);
    char *dst = f->li[i].enc[which == 'v'];
    s->kvh = s->T = s->hd = -1;
    if (t) {
        if (t->dtype != KV_DT_F32 && t->dtype != KV_DT_F16 && t->dtype != KV_DT_BF16)
            return kv_fail(KV_E_DATA, "%s is %s; keys and values must be F32, F16 or BF16", t->name,
                           kv_dtype_name(t->dtype));
        if (t->ndim != 3)
            return kv_fail(KV_E_DATA, "%s has %d dimensions, expected [kv_heads, tokens, head_dim]",
                           t->name, t->ndim);
        const char *dn = t->dtype == KV_DT_F32 ? "f32" : t->dtype == KV_DT_F16 ? "f16" : "bf16";
        if (enc && strcmp(enc, dn) != 0)
            return kv_fail(KV_E_DATA, "metadata %s=%.16s but %s is a plain %s tensor", key, enc, t->name,
                           kv_dtype_name(t->dtype));
        strcpy(dst, dn);
        s->kvh = (int)t->shape[0];
        s->T = (int)t->shape[1];
        s->hd = (int)t->shape[2];
        s->from = t->name;
        return KV_OK;
    }
    if (!enc)
        return kv_fail(KV_E_DATA, "layer %d has no %s (layers.%d.%s)", i, which == 'k' ? "keys" : "values",
                       i, w);
    if (strcmp(enc, "kivi") == 0) {
        strcpy(dst, "kivi");
        return check_kivi(f, i, which, s);
    }
    if (strcmp(enc, "dsq") == 0) {
        strcpy(dst, "dsq");
        return check_dsq(f, i, which, s);
    }
    if (!strcmp(enc, "f32") || !strcmp(enc, "f16") || !strcmp(enc, "bf16"))
        return kv_fail(KV_E_DATA, "metadata %s=%s but there is no tensor layers.%d.%s", key, enc, i, w);
    return kv_fail(KV_E_DATA, "metadata %s='%.16s' is not a known encoding", key, enc);
}

static kv_status merge_dim(const char *what, int *have, const char **have_from, int v, const char *from)
{
    if (v < 0) return KV_OK;
    if (*have < 0) {
        *have = v;
        *have_from = from;
        return KV_OK;
    }
    if (*have != v)
        return kv_fail(KV_E_DATA, "inconsistent geometry: %s has %d %s but %s has %d", from, v, what,
                       *have_from, *have);
    return KV_OK;
}

/* A metadata geometry key must agree with the shapes, or fill an unknown. */
static kv_status meta_dim(const kvc_file *f, const char *key, const char *what, int *have, long lo)
{
    long v;
    bool present;
    kv_status st = meta_int(f, key, lo, INT32_MAX, &v, &present);
    if (st || !present) return st;
    if (*have >= 0 && *have != v)
        return kv_fail(KV_E_DATA, "metadata %s=%ld but the tensors have %d %s", key, v, *have, what);
    *have = (int)v;
    return KV_OK;
}

static kv_status build_geom(kvc_file *f)
{
    kv_geom *g = &f->g;
    kv_geom_defaults(g);
    kv_status st;
    long L = 0;
    for (int i = 0; i < f->nt; i++) {
        const char *rest;
        long l = layer_of(f->t[i].name, &rest);
        if (l >= L) L = l + 1;
    }
    if (L == 0) return kv_fail(KV_E_DATA, "no layers.0.k tensor: not a KV cache");
    if (L > f->nt) /* every layer needs tensors of its own: some are missing */
        return kv_fail(KV_E_DATA, "tensor names reach layer %ld but there are only %d tensors: layers are missing",
                       L - 1, f->nt);
    long ml;
    bool have;
    if ((st = meta_int(f, "kvc.n_layers", 1, 1000000, &ml, &have))) return st;
    if (have && ml != L)
        return kv_fail(KV_E_DATA, "metadata kvc.n_layers=%ld but the tensors describe %ld layers", ml, L);
    g->n_layers = (int)L;
    f->li = calloc((size_t)L, sizeof *f->li);
    if (!f->li) return kv_fail(KV_E_NOMEM, "cannot allocate layer table");

    int kvh = -1, T = -1, hd = -1;
    const char *kvh_from = NULL, *T_from = NULL, *hd_from = NULL;
    shape3 *sh = calloc((size_t)L * 2, sizeof *sh); /* keeps from_buf names alive */
    if (!sh) return kv_fail(KV_E_NOMEM, "cannot allocate layer shapes");
    for (int i = 0; i < L && !st; i++) {
        for (int w = 0; w < 2 && !st; w++) {
            shape3 *s = &sh[2 * i + w];
            if ((st = check_layer_part(f, i, w ? 'v' : 'k', s))) break;
            if (s->kvh == 0 || s->hd == 0) {
                st = kv_fail(KV_E_DATA, "%s has no heads or zero head dim", s->from);
                break;
            }
            if ((st = merge_dim("kv heads", &kvh, &kvh_from, s->kvh, s->from)) ||
                (st = merge_dim("tokens", &T, &T_from, s->T, s->from)) ||
                (st = merge_dim("head dim", &hd, &hd_from, s->hd, s->from)))
                break;
        }
    }
    if (st) {
        free(sh);
        return st;
    }
    /* Layer byte counts (all tensors, and the K/V parts). */
    for (int i = 0; i < f->nt; i++) {
        const char *rest;
        long l = layer_of(f->t[i].name, &rest);
        if (l < 0) continue;
        f->li[l].bytes += f->t[i].nbytes;
        if ((rest[0] == 'k' || rest[0] == 'v') && (rest[1] == 0 || rest[1] == '.'))
            f->li[l].kv_bytes += f->t[i].nbytes;
    }

    if ((st = meta_dim(f, "kvc.n_kv_heads", "kv heads", &kvh, 1)) ||
        (st = meta_dim(f, "kvc.n_tokens", "tokens", &T, 0)) ||
        (st = meta_dim(f, "kvc.head_dim", "head dim", &hd, 1))) {
        free(sh);
        return st;
    }
    free(sh);
    if (kvh < 0 || T < 0 || hd < 0)
        return kv_fail(KV_E_DATA, "geometry unknown: no plain or kivi layer and no kvc.n_kv_heads, "
                                  "kvc.n_tokens, kvc.head_dim metadata");
    g->n_kv_heads = kvh;
    g->n_tokens = T;
    g->head_dim = hd;

    /* Queries: all layers or none, one shape. */
    int H = -1, Q = -1, first_q = -1, first_noq = -1;
    for (int i = 0; i < L; i++) {
        const kvc_tensor *q = kvc_layer(f, i, "q");
        if (!q) {
            if (first_noq < 0) first_noq = i;
            continue;
        }
        if (first_q < 0) first_q = i;
        if (q->dtype != KV_DT_F32 && q->dtype != KV_DT_F16 && q->dtype != KV_DT_BF16)
            return kv_fail(KV_E_DATA, "%s is %s; queries must be F32, F16 or BF16", q->name,
                           kv_dtype_name(q->dtype));
        if (q->ndim != 3)
            return kv_fail(KV_E_DATA, "%s has %d dimensions, expected [heads, n_q, head_dim]", q->name, q->ndim);
        if (q->shape[2] != hd)
            return kv_fail(KV_E_DATA, "%s has head dim %lld but the keys have %d", q->name,
                           (long long)q->shape[2], hd);
        if (H >= 0 && (q->shape[0] != H || q->shape[1] != Q))
            return kv_fail(KV_E_DATA, "inconsistent geometry: %s has shape [%lld,%lld,%d] but layers.%d.q has [%d,%d,%d]",
                           q->name, (long long)q->shape[0], (long long)q->shape[1], hd, first_q, H, Q, hd);
        H = (int)q->shape[0];
        Q = (int)q->shape[1];
    }
    if (first_q >= 0 && first_noq >= 0)
        return kv_fail(KV_E_DATA, "layer %d has no queries (layers.%d.q) but layer %d does", first_noq,
                       first_noq, first_q);
    if (H == 0) return kv_fail(KV_E_DATA, "layers.%d.q has no heads", first_q);
    if (Q > T) return kv_fail(KV_E_DATA, "layers.%d.q holds %d queries but the cache has %d tokens", first_q, Q, T);
    if (Q < 0) Q = 0;
    int Qm = Q >= 0 && first_q >= 0 ? Q : -1;
    if ((st = meta_dim(f, "kvc.n_heads", "query heads", &H, 1)) || (st = meta_dim(f, "kvc.n_q", "queries", &Qm, 0)))
        return st;
    if (first_q < 0 && Qm > 0)
        return kv_fail(KV_E_DATA, "metadata kvc.n_q=%d but there are no layers.{i}.q tensors", Qm);
    if (H > 0 && H % kvh)
        return kv_fail(KV_E_DATA, "%d query heads is not a multiple of %d kv heads", H, kvh);
    g->n_heads = H > 0 ? H : 0;
    g->n_q = Q;

    const kvc_tensor *tok = kvc_find(f, "tokens");
    if (tok) {
        if (tok->dtype != KV_DT_I32 || tok->ndim != 1)
            return kv_fail(KV_E_DATA, "tokens must be a 1-dimensional I32 tensor, not %dd %s", tok->ndim,
                           kv_dtype_name(tok->dtype));
        if (tok->shape[0] != T)
            return kv_fail(KV_E_DATA, "tokens has %lld entries but the cache has %d tokens",
                           (long long)tok->shape[0], T);
    }

    /* RoPE and the rest. */
    if ((st = meta_real(f, "kvc.rope_theta", &g->rope_theta, false))) return st;
    if (!(g->rope_theta > 0)) return kv_fail(KV_E_DATA, "metadata kvc.rope_theta must be positive");
    const char *v = kvc_meta(f, "kvc.rope_scaling");
    if (v && strcmp(v, "none") && strcmp(v, "llama3"))
        return kv_fail(KV_E_DATA, "metadata kvc.rope_scaling='%.16s' is not none or llama3", v);
    if (v && !strcmp(v, "llama3")) {
        long oc;
        g->rope_scaling = KV_ROPE_SCALING_LLAMA3;
        if ((st = meta_real(f, "kvc.rope_factor", &g->rope_factor, true)) ||
            (st = meta_real(f, "kvc.rope_low_freq_factor", &g->rope_low_freq_factor, true)) ||
            (st = meta_real(f, "kvc.rope_high_freq_factor", &g->rope_high_freq_factor, true)) ||
            (st = meta_int(f, "kvc.rope_orig_ctx", 1, INT32_MAX, &oc, &have)))
            return st;
        if (!have) return kv_fail(KV_E_DATA, "metadata kvc.rope_scaling=llama3 needs kvc.rope_orig_ctx");
        g->rope_orig_ctx = (int)oc;
    }
    v = kvc_meta(f, "kvc.keys_roped");
    if (v && strcmp(v, "true") && strcmp(v, "false"))
        return kv_fail(KV_E_DATA, "metadata kvc.keys_roped='%.16s' is not true or false", v);
    g->keys_roped = !v || !strcmp(v, "true");
    v = kvc_meta(f, "kvc.rope_layout");
    if (v && strcmp(v, "interleaved") && strcmp(v, "halves"))
        return kv_fail(KV_E_DATA, "metadata kvc.rope_layout='%.16s' is not interleaved or halves", v);
    g->rope_layout = v && !strcmp(v, "halves") ? KV_ROPE_HALVES : KV_ROPE_INTERLEAVED;
    v = kvc_meta(f, "kvc.model");
    if (v) snprintf(g->model, sizeof g->model, "%s", v);
    return KV_OK;
}

static kv_status parse(kvc_file *f)
{
    uint64_t data_start = 0;
    kv_status st;
    if ((st = parse_header(f, &data_start)) || (st = check_tiling(f, data_start))) return st;
    const char *ver = kvc_meta(f, "kvc.version");
    if (ver) {
        long v;
        if (!parse_int(ver, 1, INT32_MAX, &v))
            return kv_fail(KV_E_DATA, "metadata kvc.version='%.16s' is not a positive integer", ver);
        if (v > KVC_FORMAT_VERSION)
            return kv_fail(KV_E_UNSUPPORTED, "file is kvc version %ld; this reader reads version %d or older",
                           v, KVC_FORMAT_VERSION);
    }
    if ((st = check_crcs(f))) return st;
    return build_geom(f);
}

// --- atomic output files ---------------------------------------------------

/* Temp files in flight, for kv_outfile_cleanup_all from a signal handler. */
#define LIVE_MAX 16
static char *volatile live_tmp[LIVE_MAX];

static void live_add(char *p)
{
    for (int i = 0; i < LIVE_MAX; i++)
        if (!live_tmp[i]) {
            live_tmp[i] = p;
            return;
        }
}

static void live_del(const char *p)
{
    for (int i = 0; i < LIVE_MAX; i++)
        if (live_tmp[i] == p) live_tmp[i] = NULL;
}

void kv_outfile_cleanup_all(void)
{
    for (int i = 0; i < LIVE_MAX; i++) {
        char *p = live_tmp[i];
        if (p) unlink(p);
    }
}

static void outfile_reset(kv_outfile *o)
{
    if (o->tmp) {
        live_del(o->tmp);
        free(o->tmp);
    }
    free(o->path);
    o->fp = NULL;
    o->path = NULL;
    o->tmp = NULL;
}

kv_status kv_outfile_open(kv_outfile *o, const char *path) { return kv_outfile_open_ex(o, path, 0); }

kv_status kv_outfile_open_ex(kv_outfile *o, const char *path, unsigned flags)
{
    memset(o, 0, sizeof *o);
    if (!path || !*path) return kv_fail(KV_E_USAGE, "empty output path");
    o->path = strdup(path);
    if (!o->path) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    if (!strcmp(path, "-")) {
        o->fp = stdout;
        return KV_OK;
    }
    struct stat sb;
    if ((flags & KV_OUT_NOFOLLOW) && lstat(path, &sb) == 0 && !S_ISREG(sb.st_mode)) {
        kv_status st = kv_fail(KV_E_DATA, "refusing to write %s: it is %s, not a regular file", path,
                               kv_file_kind(sb.st_mode));
        outfile_reset(o);
        return st;
    }
    /* Writing through a symlink replaces its target, not the link. */
    if (!(flags & KV_OUT_NOFOLLOW) && lstat(path, &sb) == 0 && S_ISLNK(sb.st_mode)) {
        char *real = realpath(path, NULL);
        if (real) {
            free(o->path);
            o->path = real;
            path = real;
        }
    }
    /* A device or FIFO (/dev/null, a pipe) cannot be replaced by rename:
     * write to it directly. */
    if (!(flags & KV_OUT_NOFOLLOW) && stat(path, &sb) == 0 && !S_ISREG(sb.st_mode)) {
        if (S_ISDIR(sb.st_mode)) {
            outfile_reset(o);
            return kv_fail(KV_E_CANTCREATE, "cannot create %s: is a directory", path);
        }
        o->fp = fopen(path, "wb");
        if (!o->fp) {
            int e = errno;
            outfile_reset(o);
            return kv_fail(KV_E_CANTCREATE, "cannot open %s: %s", path, strerror(e));
        }
        return KV_OK;
    }
    const char *slash = strrchr(path, '/');
    size_t dirlen = slash ? (size_t)(slash - path) + 1 : 0;
    const char *base = slash ? slash + 1 : path;
    size_t n = strlen(path) + 16;
    o->tmp = malloc(n);
    if (!o->tmp) {
        outfile_reset(o);
        return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    }
    snprintf(o->tmp, n, "%.*s.%s.XXXXXX", (int)dirlen, path, base);
    int fd = mkstemp(o->tmp);
    if (fd < 0) {
        int e = errno;
        free(o->tmp);
        o->tmp = NULL;
        outfile_reset(o);
        return kv_fail(KV_E_CANTCREATE, "cannot create %s: %s", path, strerror(e));
    }
    live_add(o->tmp);
    /* mkstemp makes 0600; give the file the mode a plain creat() would. */
    mode_t um = umask(0);
    umask(um);
    (void)fchmod(fd, 0666 & ~um); /* on failure the file merely stays private */
    o->fp = fdopen(fd, "wb");
    if (!o->fp) {
        int e = errno;
        close(fd);
        unlink(o->tmp);
        outfile_reset(o);
        return kv_fail(KV_E_NOMEM, "cannot open a stream: %s", strerror(e));
    }
    return KV_OK;
}

void kv_outfile_abort(kv_outfile *o)
{
    if (!o->path) return;
    if (o->fp && o->fp != stdout) fclose(o->fp);
    else if (o->fp == stdout) fflush(stdout);
    if (o->tmp) unlink(o->tmp);
    outfile_reset(o);
}

kv_status kv_outfile_commit(kv_outfile *o)
{
    if (!o->path) return kv_fail(KV_E_INTERNAL, "commit of an output that is not open");
    if (o->fp == stdout) {
        bool bad = fflush(stdout) != 0 || ferror(stdout);
        int e = errno;
        outfile_reset(o);
        return bad ? kv_fail(KV_E_IO, "write error on stdout: %s", strerror(e)) : KV_OK;
    }
    int e = 0;
    const char *what = NULL;
    if (fflush(o->fp) != 0 || ferror(o->fp)) e = errno, what = "write";
    else if (o->tmp && fsync(fileno(o->fp)) != 0) e = errno, what = "fsync";
    if (fclose(o->fp) != 0 && !what) e = errno, what = "close";
    o->fp = NULL;
    if (!what && o->tmp && rename(o->tmp, o->path) != 0) e = errno, what = "rename";
    if (what) {
        if (o->tmp) unlink(o->tmp);
        kv_status st = kv_fail(KV_E_IO, "cannot write %s (%s): %s", o->path, what, strerror(e));
        outfile_reset(o);
        return st;
    }
    if (o->tmp) { /* make the rename itself durable */
        char *dir = strdup(o->path);
        if (dir) {
            char *slash = strrchr(dir, '/');
            const char *d = slash ? (slash == dir ? "/" : (*slash = '\0', dir)) : ".";
            int dfd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (dfd >= 0) {
                (void)fsync(dfd);
                close(dfd);
            }
            free(dir);
        }
    }
    outfile_reset(o);
    return KV_OK;
}

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

kv_status kvc_writer_write_ex(kvc_writer *w, const char *path, int zstd_level, unsigned flags)
{
    kv_status st = KV_OK;
    wtensor **ord = malloc(((size_t)w->nt + 1) * sizeof *ord);
    sbuf h = {0};
    sink k = {0};
    kv_outfile o = {0};
    bool opened = false;
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

    if ((st = kv_outfile_open_ex(&o, path, flags))) goto out;
    opened = true;
    k.fp = o.fp;
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
    if (k.z && (st = sink_zstd(&k, NULL, 0, ZSTD_e_end))) goto out;
    opened = false;
    if ((st = kv_outfile_commit(&o))) goto out;
out:
    if (opened) {
        kv_status keep = st;
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kv_errdetail());
        kv_outfile_abort(&o);
        /* a full disk said only "write error: No space left on device" */
        kv_fail(keep, "%s", msg);
        if (!strcmp(path, "-")) kv_errcontext("stdout");
        else kv_errcontext("cannot write %s", path);
    }
    ZSTD_freeCCtx(k.z);
    free(k.zbuf);
    free(h.p);
    free(ord);
    return st;
}
