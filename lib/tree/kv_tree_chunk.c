/*
 * kv_tree_chunk: chunk files of version 2 (man/kvc.5, "kv-tree chunks"),
 * written and read in parts.  A chunk holds one node's edge: a fixed head,
 * the token ids, importances and the row order table (rows sorted by
 * importance, most important first), a frame index, the query samples (when
 * the node ends a put prompt that had them), then the rows in that order in
 * frames of group_rows rows.  Each frame is a small .kvc image of its rows
 * for every layer, plain or packed (KIVI, DSQ) as the tier's encoding says,
 * optionally zstd-compressed as a whole: so the top FRAC rows of a chunk are
 * its first frames, and get --important reads only those from disk.
 * Version-1 chunks (a whole .kvc, one zstd frame on the disk tier) are read
 * through the same interface, whole.
 */
#include "tree/kv_tree_int.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "common/kv_crc.h"
#include "common/kv_half.h"
#include "quant/kv_layer_io.h"

#define HEAD_BYTES 72  /* version 2 */
#define HEAD3_BYTES 88 /* version 3: + sketch channels, its CRC, the row order kind, a reserved word */
#define FRAME_ENTRY 24
static const char MAGIC[8] = {'K', 'V', 'T', 'C', 'H', 'U', 'N', 'K'};

// --- encodings ------------------------------------------------------------------

kv_status kv_tree_enc_parse(const char *s, kv_tree_enc *e)
{
    memset(e, 0, sizeof *e);
    if (!s) return kv_fail(KV_E_USAGE, "no encoding");
    size_t n = strlen(s);
    if (n > 7 && !strcmp(s + n - 7, "+sketch")) e->sketch = true, n -= 7;
    if (n > 5 && !strncmp(s + n - 5, "+zstd", 5)) e->zstd = true, n -= 5;
    if (n == 3 && !strncmp(s, "raw", 3)) e->codec = KV_TREE_ENC_RAW;
    else if (n == 5 && !strncmp(s, "kivi", 4) && strchr("124", s[4])) e->codec = KV_TREE_ENC_KIVI, e->bits = s[4] - '0';
    else if (n == 4 && !strncmp(s, "dsq", 3) && strchr("124", s[3])) e->codec = KV_TREE_ENC_DSQ, e->bits = s[3] - '0';
    else
        return kv_fail(KV_E_USAGE, "unknown chunk encoding '%.40s' (raw, kivi1, kivi2, kivi4, dsq1, dsq2, dsq4, "
                                   "each optionally +zstd, then optionally +sketch)", s);
    return KV_OK;
}

void kv_tree_enc_format(const kv_tree_enc *e, char *buf, size_t n)
{
    const char *base = e->codec == KV_TREE_ENC_KIVI ? "kivi" : e->codec == KV_TREE_ENC_DSQ ? "dsq" : "raw";
    const char *z = e->zstd ? "+zstd" : "", *k = e->sketch ? "+sketch" : "";
    if (e->codec == KV_TREE_ENC_RAW) snprintf(buf, n, "raw%s%s", z, k);
    else snprintf(buf, n, "%s%d%s%s", base, e->bits, z, k);
}

bool kv_tree_enc_equal(const kv_tree_enc *a, const kv_tree_enc *b)
{
    return a->codec == b->codec && a->zstd == b->zstd && a->sketch == b->sketch &&
           (a->codec == KV_TREE_ENC_RAW || a->bits == b->bits);
}

void kv_tree_encodings_default(kv_tree_enc enc[KV_TIER_COUNT])
{
    enc[KV_TIER_GPU] = (kv_tree_enc){KV_TREE_ENC_RAW, 0, false, false};
    enc[KV_TIER_HOST] = (kv_tree_enc){KV_TREE_ENC_RAW, 0, false, false};
    enc[KV_TIER_DISK] = (kv_tree_enc){KV_TREE_ENC_RAW, 0, true, false};
}

kv_status kv_tree_encodings_apply(const char *s, kv_tree_enc enc[KV_TIER_COUNT])
{
    kv_tree_enc out[KV_TIER_COUNT]; /* enc changes only when all of s parses */
    if (!strcmp(s, "lossless")) {
        kv_tree_encodings_default(enc);
        return KV_OK;
    }
    if (!strcmp(s, "packed")) { /* LMCache / IMPRESS: hot raw, warm packed, cold packed + zstd */
        kv_tree_encodings_default(enc);
        enc[KV_TIER_HOST] = (kv_tree_enc){KV_TREE_ENC_KIVI, 2, false, false};
        enc[KV_TIER_DISK] = (kv_tree_enc){KV_TREE_ENC_KIVI, 2, true, false};
        return KV_OK;
    }
    memcpy(out, enc, sizeof out);
    char buf[256];
    if (strlen(s) >= sizeof buf) return kv_fail(KV_E_USAGE, "--encodings: too long");
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *p = strtok_r(buf, ",", &save); p; p = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(p, '=');
        if (!eq) return kv_fail(KV_E_USAGE, "--encodings: '%.40s' is not TIER=ENCODING", p);
        *eq = 0;
        int t = kv_tier_parse(p);
        if (t < 0) return kv_fail(KV_E_USAGE, "--encodings: unknown tier '%.20s' (gpu, host, disk)", p);
        kv_status st = kv_tree_enc_parse(eq + 1, &out[t]);
        if (st) return st;
    }
    memcpy(enc, out, sizeof out);
    return KV_OK;
}

kv_status kv_tree_encodings_parse(const char *s, kv_tree_enc enc[KV_TIER_COUNT])
{
    kv_tree_encodings_default(enc);
    return kv_tree_encodings_apply(s, enc);
}

// --- little-endian fields ---------------------------------------------------------

static uint32_t rd32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }
static void wr32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void wr64(uint8_t *p, uint64_t v)
{
    wr32(p, (uint32_t)v);
    wr32(p + 4, (uint32_t)(v >> 32));
}

static kv_status src_read(tree_chunk *c, uint64_t off, void *buf, size_t n)
{
    if (off > c->size || n > c->size - off) return kv_fail(KV_E_DATA, "chunk %s: read past its end", c->name);
    if (c->mem) memcpy(buf, c->mem + off, n);
    else
        for (size_t got = 0; got < n;) {
            ssize_t r = pread(c->fd, (char *)buf + got, n - got, (off_t)(off + got));
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) return kv_fail(KV_E_IO, "cannot read chunk %s: %s", c->name, strerror(errno));
            if (r == 0) return kv_fail(KV_E_DATA, "chunk %s: truncated", c->name);
            got += (size_t)r;
        }
    __atomic_fetch_add(&c->bytes_read, (uint64_t)n, __ATOMIC_RELAXED); /* frames are read in parallel */
    return KV_OK;
}

/* src_read of a large span in slices read in parallel (a page-cache copy
 * of a quarter gigabyte is a few times faster on several cores), and
 * *crc = kv_crc32c(*crc, buf, n) when crc is not NULL: each slice's CRC
 * taken on its thread while the bytes are in its cache, then combined in
 * order (kv_crc32c_combine, ~0.75 us each).  One thread's CRC-32C runs at
 * ~8 GB/s, so a 56 MB key sketch's checksum alone took ~7 ms serially. */
static kv_status src_read_par_crc(tree_chunk *c, uint64_t off, void *buf, size_t n, uint32_t *crc)
{
    /* slices of 256 KiB (a test's sketch spans several), or n / 64 for
     * large spans: at most ~65 serial combinations */
    size_t SL = (size_t)256 << 10;
    if (n / 64 > SL) SL = (n / 64 + 4095) & ~(size_t)4095;
    const long ns = (long)((n + SL - 1) / SL);
    if (c->mem || ns < 2) {
        kv_status st = src_read(c, off, buf, n);
        if (!st && crc) *crc = kv_crc32c(*crc, buf, n);
        return st;
    }
    uint32_t *part = crc ? malloc((size_t)ns * sizeof *part) : NULL;
    if (crc && !part) return kv_fail(KV_E_NOMEM, "out of memory");
    kv_status st = KV_OK;
    char msg[512] = "";
#pragma omp parallel for schedule(dynamic, 1)
    for (long i = 0; i < ns; i++) {
        size_t a = (size_t)i * SL, len = n - a < SL ? n - a : SL;
        kv_status e = src_read(c, off + a, (char *)buf + a, len);
        if (!e && part) part[i] = kv_crc32c(0, (const char *)buf + a, len);
        if (e) {
#pragma omp critical(tree_src_read_par)
            if (!st) snprintf(msg, sizeof msg, "%s", kv_errdetail()), st = e;
        }
    }
    for (long i = 0; !st && part && i < ns; i++) {
        size_t a = (size_t)i * SL, len = n - a < SL ? n - a : SL;
        *crc = kv_crc32c_combine(*crc, part[i], len);
    }
    free(part);
    return st ? kv_fail(st, "%s", msg) : KV_OK;
}


// --- reading ----------------------------------------------------------------------

void tree_chunk_free(tree_chunk *c)
{
    if (!c) return;
    free(c->tokens);
    free(c->imp);
    free(c->order);
    free(c->rank);
    free(c->frames);
    kvc_close(c->v1);
    if (c->fd >= 0) close(c->fd);
    memset(c, 0, sizeof *c);
    c->fd = -1;
}

/* a * b, saturating at UINT64_MAX: sizes from a damaged head must not wrap */
static uint64_t smul(uint64_t a, uint64_t b) { return a && b > UINT64_MAX / a ? UINT64_MAX : a * b; }

static uint64_t raw_row_bytes(const tree_chunk *c)
{
    return smul(smul(smul(2ull * (uint64_t)c->L, (uint64_t)c->Hkv), (uint64_t)c->D), kv_dtype_size(c->dt));
}

kv_status tree_chunk_parse(tree_chunk *c, const kv_tree_geom *g)
{
    uint8_t h[HEAD3_BYTES];
    kv_status st;
    if (c->size < HEAD_BYTES) return kv_fail(KV_E_DATA, "chunk %s: %llu bytes, shorter than its head", c->name, (unsigned long long)c->size);
    if ((st = src_read(c, 0, h, HEAD_BYTES))) return st;
    if (memcmp(h, MAGIC, 8)) return kv_fail(KV_E_DATA, "chunk %s: not a kv-tree chunk (bad magic)", c->name);
    uint32_t ver = rd32(h + 8);
    if (ver != 2 && ver != 3)
        return kv_fail(KV_E_DATA, "chunk %s is chunk version %u; this kv-tree reads versions 1 to %d", c->name, ver,
                       KV_TREE_CHUNK_VERSION);
    c->version = (int)ver;
    const size_t hb = ver == 3 ? HEAD3_BYTES : HEAD_BYTES;
    if (ver == 3) {
        if (c->size < HEAD3_BYTES) return kv_fail(KV_E_DATA, "chunk %s: shorter than its head", c->name);
        if ((st = src_read(c, HEAD_BYTES, h + HEAD_BYTES, HEAD3_BYTES - HEAD_BYTES))) return st;
        c->sk_r = (int)rd32(h + 72), c->sk_crc = rd32(h + 76);
        uint32_t ok = rd32(h + 80), rsv = rd32(h + 84);
        if (ok > 1 || rsv) return kv_fail(KV_E_DATA, "chunk %s: unknown row order %u", c->name, ok);
        c->positional = ok == 1;
        /* query-aware loading reads the sketch and the frames by position */
        if (c->sk_r > 0 && !c->positional)
            return kv_fail(KV_E_DATA, "chunk %s: a key sketch needs rows in position order", c->name);
    }
    uint32_t n = rd32(h + 16), start = rd32(h + 20), R = rd32(h + 24), nf = rd32(h + 28), codec = rd32(h + 32),
             bits = rd32(h + 36), zs = rd32(h + 40), L = rd32(h + 44), Hkv = rd32(h + 48), D = rd32(h + 52),
             dt = rd32(h + 56), qh = rd32(h + 60), nq = rd32(h + 64);
    c->q_crc = rd32(h + 68);
    if (n < 1 || n > MAX_TREE_TOKENS || start > INT32_MAX - n) return kv_fail(KV_E_DATA, "chunk %s: bad token count %u", c->name, n);
    if (R < 8 || R > 4096 || R % 8) return kv_fail(KV_E_DATA, "chunk %s: group_rows %u is not a multiple of 8 in [8, 4096]", c->name, R);
    if (nf != (n + R - 1) / R) return kv_fail(KV_E_DATA, "chunk %s: %u frames for %u rows of %u", c->name, nf, n, R);
    if (codec > KV_TREE_ENC_DSQ || zs > 1 || (codec == KV_TREE_ENC_RAW ? bits != 0 : bits != 1 && bits != 2 && bits != 4))
        return kv_fail(KV_E_DATA, "chunk %s: unknown encoding %u/%u", c->name, codec, bits);
    if (dt != KV_DT_F32 && dt != KV_DT_F16 && dt != KV_DT_BF16) return kv_fail(KV_E_DATA, "chunk %s: bad dtype %u", c->name, dt);
    if (L < 1 || L > MAX_DIM || Hkv < 1 || Hkv > MAX_DIM || D < 1 || D > MAX_DIM || qh > MAX_DIM || nq > MAX_DIM ||
        (qh && (qh % Hkv || !nq)) || (!qh && nq) || c->sk_r < 0 || c->sk_r > (int)D)
        return kv_fail(KV_E_DATA, "chunk %s: bad geometry", c->name);
    if (g && (L != (uint32_t)g->g.n_layers || Hkv != (uint32_t)g->g.n_kv_heads || D != (uint32_t)g->g.head_dim ||
              dt != (uint32_t)g->dtype || (qh && g->g.n_heads && qh != (uint32_t)g->g.n_heads)))
        return kv_fail(KV_E_DATA, "chunk %s: geometry or dtype differs from the store's", c->name);
    c->n = (int)n, c->start = (int)start, c->group_rows = (int)R, c->n_frames = (int)nf;
    c->enc = (kv_tree_enc){(kv_tree_codec)codec, (int)bits, zs != 0, c->sk_r > 0};
    c->L = (int)L, c->Hkv = (int)Hkv, c->D = (int)D, c->dt = (kv_dtype)dt, c->q_heads = (int)qh, c->n_q = (int)nq;
    uint64_t tables = 12ull * n + (uint64_t)FRAME_ENTRY * nf;
    if (tables > c->size - hb) return kv_fail(KV_E_DATA, "chunk %s: truncated tables", c->name);
    uint8_t *tb = malloc((size_t)tables);
    c->tokens = malloc((size_t)n * 4);
    c->imp = malloc((size_t)n * 4);
    c->order = malloc((size_t)n * 4);
    c->rank = malloc((size_t)n * sizeof *c->rank);
    c->frames = calloc(nf, sizeof *c->frames);
    if (!tb || !c->tokens || !c->imp || !c->order || !c->rank || !c->frames) {
        free(tb);
        return kv_fail(KV_E_NOMEM, "cannot allocate chunk tables of %u tokens", n);
    }
    if ((st = src_read(c, hb, tb, (size_t)tables))) goto out;
    uint32_t crc = kv_crc32c(kv_crc32c(0, h + 16, hb - 16), tb, (size_t)tables);
    if (crc != rd32(h + 12)) {
        st = kv_fail(KV_E_DATA, "chunk %s: checksum mismatch in the head (stored %08x, computed %08x)", c->name, rd32(h + 12), crc);
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) c->rank[i] = -1;
    for (uint32_t i = 0; i < n; i++) {
        int32_t tk = (int32_t)rd32(tb + 4 * i), o = (int32_t)rd32(tb + 8ull * n + 4 * i);
        uint32_t fb = rd32(tb + 4ull * n + 4 * i);
        float f;
        memcpy(&f, &fb, 4);
        if (tk < 0) st = kv_fail(KV_E_DATA, "chunk %s: token %u has the negative id %d", c->name, i, tk);
        else if (!isfinite(f))
            st = kv_fail(KV_E_DATA, "chunk %s: importance %u is %s", c->name, i, isnan(f) ? "NaN" : "infinite");
        else if (o < 0 || (uint32_t)o >= n || c->rank[o] >= 0)
            st = kv_fail(KV_E_DATA, "chunk %s: row order is not a permutation (row %u)", c->name, i);
        if (st) goto out;
        c->tokens[i] = tk, c->imp[i] = f, c->order[i] = o, c->rank[o] = (int)i;
    }
    /* the order table must be importance order (ties to the earlier token):
     * get takes the first frames as the most important rows; or, in a
     * version-3 chunk that says so, position order */
    for (uint32_t j = c->positional ? 0 : 1; c->positional && j < n; j++)
        if (c->order[j] != (int)j) {
            st = kv_fail(KV_E_DATA, "chunk %s: row order is not position order at row %u", c->name, j);
            goto out;
        }
    for (uint32_t j = 1; !c->positional && j < n; j++) {
        int a = c->order[j - 1], b = c->order[j];
        if (c->imp[a] < c->imp[b] || (c->imp[a] == c->imp[b] && a > b)) {
            st = kv_fail(KV_E_DATA, "chunk %s: row order is not importance order at row %u", c->name, j);
            goto out;
        }
    }
    uint64_t q_bytes = smul(smul(smul(4ull * L, qh), nq), D);
    c->q_off = hb + tables;
    uint64_t frame_max = smul(smul(raw_row_bytes(c), R), 2) + (1u << 20);
    if (q_bytes > c->size - c->q_off) {
        st = kv_fail(KV_E_DATA, "chunk %s: truncated query samples", c->name);
        goto out;
    }
    c->sk_off = c->q_off + q_bytes;
    uint64_t sk_bytes = smul(smul((uint64_t)L * Hkv, (uint64_t)c->sk_r), 6ull + n);
    if (sk_bytes > c->size - c->sk_off) {
        st = kv_fail(KV_E_DATA, "chunk %s: truncated key sketch", c->name);
        goto out;
    }
    uint64_t pos = c->sk_off + sk_bytes;
    for (uint32_t f = 0; f < nf; f++) {
        const uint8_t *e = tb + 12ull * n + (uint64_t)FRAME_ENTRY * f;
        tree_frame *fr = &c->frames[f];
        fr->off = rd64(e), fr->len = rd64(e + 8), fr->crc = rd32(e + 16), fr->rows = (int)rd32(e + 20);
        uint32_t want = f + 1 < nf ? R : n - (nf - 1) * R;
        if (fr->rows != (int)want || fr->off != pos || fr->len == 0 || fr->len > frame_max || fr->len > c->size - pos) {
            st = kv_fail(KV_E_DATA, "chunk %s: frame %u: bad offset, length or row count", c->name, f);
            goto out;
        }
        pos += fr->len;
    }
    if (pos != c->size) st = kv_fail(KV_E_DATA, "chunk %s: %llu bytes after the last frame", c->name, (unsigned long long)(c->size - pos));
out:
    free(tb);
    return st;
}

/* Frame f's .kvc image opened and checked against the chunk's geometry. */
tree_scratch *tree_scratch_new(void)
{
    tree_scratch *x = calloc(1, sizeof *x);
    if (x && pthread_mutex_init(&x->mu, NULL)) {
        free(x);
        return NULL;
    }
    return x;
}

void tree_scratch_free(tree_scratch *x)
{
    if (!x) return;
    for (int i = 0; i < x->n; i++) free(x->buf[i]);
    free(x->buf), free(x->cap);
    pthread_mutex_destroy(&x->mu);
    free(x);
}

/* A frame's .kvc k against the chunk: geometry, rows, zstd and every
 * layer's encoding as the tier's. */
static kv_status frame_check(const tree_chunk *c, int f, const kvc_file *k)
{
    const tree_frame *fr = &c->frames[f];
    kv_status st = KV_OK;
    const kv_geom *g = kvc_geom(k);
    if (kvc_was_zstd(k) != c->enc.zstd || g->n_layers != c->L || g->n_kv_heads != c->Hkv || g->head_dim != c->D ||
        g->n_tokens != fr->rows)
        st = kv_fail(KV_E_DATA, "chunk %s: frame %d does not hold its rows in the chunk's geometry", c->name, f);
    const char *want = c->enc.codec == KV_TREE_ENC_KIVI ? "kivi" : c->enc.codec == KV_TREE_ENC_DSQ ? "dsq" : NULL;
    char dtn[8];
    snprintf(dtn, sizeof dtn, "%s", kv_dtype_name(c->dt));
    for (char *p = dtn; *p; p++) *p = (char)(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
    for (int l = 0; l < c->L && !st; l++)
        for (int w = 0; w < 2 && !st; w++) {
            const char *e = kvc_layer_encoding(k, l, w ? 'v' : 'k');
            if (!e || strcmp(e, want ? want : dtn))
                st = kv_fail(KV_E_DATA, "chunk %s: frame %d layer %d is %s, the chunk says %s", c->name, f, l,
                             e ? e : "missing", want ? want : dtn);
        }
    return st;
}

/* Frame f opened as a .kvc over buf (at least its length; the caller keeps
 * it until kvc_close): read, checked against the frame's CRC, and parsed in
 * place (kvc_open_view: no copy, and the tensors' own checksums, covered
 * by the frame's, are not taken again). */
static kv_status frame_open(tree_chunk *c, int f, uint8_t *b, bool par, kvc_file **out)
{
    *out = NULL;
    const tree_frame *fr = &c->frames[f];
    uint32_t crc = 0;
    /* par: a frame read alone (a sink row's) in slices on every thread */
    kv_status st = par ? src_read_par_crc(c, fr->off, b, (size_t)fr->len, &crc) : src_read(c, fr->off, b, (size_t)fr->len);
    if (!st && !par) crc = kv_crc32c(0, b, (size_t)fr->len);
    if (!st && crc != fr->crc)
        st = kv_fail(KV_E_DATA, "chunk %s: checksum mismatch in frame %d", c->name, f);
    kvc_file *k = NULL;
    if (!st && (st = kvc_open_view(b, (size_t)fr->len, &k))) kv_errcontext("chunk %s frame %d", c->name, f);
    if (st) return st;
    if ((st = frame_check(c, f, k))) {
        kvc_close(k);
        return st;
    }
    *out = k;
    return KV_OK;
}

static void put_row(void *dst, kv_dtype dt, size_t idx, const float *x, int D)
{
    if (dt == KV_DT_F32) memcpy((float *)dst + idx * D, x, (size_t)D * 4);
    else if (dt == KV_DT_F16)
        for (int i = 0; i < D; i++) ((kv_half *)dst)[idx * D + i] = kv_f32_to_half(x[i]);
    else
        for (int i = 0; i < D; i++) ((kv_bf16 *)dst)[idx * D + i] = kv_f32_to_bf16(x[i]);
}

/* The frames holding rows sel[0..k) of c (version 2 and up): list (nl) the
 * frames in file order; the selection's entries grouped by frame, frame f's
 * in ent[first[f] .. first[f + 1]) (entry order, so increasing). */
static kv_status frame_plan(const tree_chunk *c, const int *sel, int k, int **list_out, int *nl_out, int **first_out,
                            int **ent_out)
{
    const int R = c->group_rows;
    *list_out = *first_out = *ent_out = NULL;
    *nl_out = 0;
    char *need = calloc((size_t)c->n_frames + 1, 1);
    int *list = malloc((size_t)c->n_frames * sizeof *list + 1), nl = 0;
    int *first = calloc((size_t)c->n_frames + 1, sizeof *first), *ent = malloc((size_t)k * sizeof *ent + 1);
    int *pos = malloc((size_t)c->n_frames * sizeof *pos + 1);
    if (!need || !list || !first || !ent || !pos) {
        free(need), free(list), free(first), free(ent), free(pos);
        return kv_fail(KV_E_NOMEM, "cannot allocate a frame list");
    }
    for (int i = 0; i < k; i++) need[c->rank[sel[i]] / R] = 1;
    for (int f = 0; f < c->n_frames; f++)
        if (need[f]) list[nl++] = f;
    for (int i = 0; i < k; i++) first[c->rank[sel[i]] / R + 1]++;
    for (int f = 0; f < c->n_frames; f++) first[f + 1] += first[f];
    memcpy(pos, first, (size_t)c->n_frames * sizeof *pos);
    for (int i = 0; i < k; i++) ent[pos[c->rank[sel[i]] / R]++] = i;
    free(pos), free(need);
    *list_out = list, *nl_out = nl, *first_out = first, *ent_out = ent;
    return KV_OK;
}

/* Frame f's rows of one layer's K or V into dst ([Hkv, dst_T, D], rows
 * from off): raw, the stored bytes of the frame's tensor data (Hkv, rows,
 * D), else decoded floats x (Hkv, rows, D).  Runs of entries whose
 * destination and stored rows both go up by one: one copy per head and
 * run. */
static void copy_runs(const tree_chunk *c, int f, const int *sel, const int *first, const int *ent, const void *raw,
                      const float *x, int rows, char *dst, int dst_T, int off)
{
    const int R = c->group_rows, Hkv = c->Hkv, D = c->D;
    const size_t row = (size_t)D * kv_dtype_size(c->dt);
    for (int e = first[f], e1; e < first[f + 1]; e = e1) {
        const int i = ent[e], r = c->rank[sel[i]] % R;
        for (e1 = e + 1; e1 < first[f + 1] && ent[e1] == i + (e1 - e) && c->rank[sel[ent[e1]]] % R == r + (e1 - e);
             e1++)
            ;
        const int run = e1 - e;
        for (int h = 0; h < Hkv; h++) {
            size_t di = (size_t)h * dst_T + off + i;
            if (raw) /* raw: the stored bytes, exactly */
                memcpy(dst + di * row, (const char *)raw + ((size_t)h * rows + r) * row, row * (size_t)run);
            else
                for (int j = 0; j < run; j++) put_row(dst, c->dt, di + j, x + ((size_t)h * rows + r + j) * D, D);
        }
    }
}

kv_status tree_chunk_rows(tree_chunk *c, const int *sel, int k, void *const *kdst, void *const *vdst, int dst_T, int off)
{
    const int Hkv = c->Hkv, D = c->D, L = c->L;
    const size_t es = kv_dtype_size(c->dt), row = (size_t)D * es;
    for (int i = 0; i < k; i++)
        if (sel[i] < 0 || sel[i] >= c->n) return kv_fail(KV_E_INTERNAL, "row %d outside the chunk", sel[i]);
    if (c->version == 1) {
        for (int l = 0; l < L; l++)
            for (int w = 0; w < 2; w++) {
                const kvc_tensor *t = kvc_layer(c->v1, l, w ? "v" : "k");
                char *dst = (w ? vdst : kdst)[l];
                for (int h = 0; h < Hkv; h++)
                    for (int i = 0; i < k; i++)
                        memcpy(dst + ((size_t)h * dst_T + off + i) * row,
                               (const char *)t->data + ((size_t)h * c->n + sel[i]) * row, row);
            }
        return KV_OK;
    }
    /* frames needed, each decoded once; frames are independent (each
     * writes its own rows), so they are read and decoded in parallel: a
     * multi-GB prefix is CRC-, parse- and copy-bound, not disk-bound */
    const int R = c->group_rows;
    int *list = NULL, nl = 0, *first = NULL, *ent = NULL;
    kv_status st = frame_plan(c, sel, k, &list, &nl, &first, &ent);
    if (st) return st;
    char msg[512] = "";
    /* each thread's frame buffer: the store's (kept between calls) when no
     * other call holds them, else one of its own for this call */
    uint64_t maxlen = 1;
    for (int li = 0; li < nl; li++)
        if (c->frames[list[li]].len > maxlen) maxlen = c->frames[list[li]].len;
    int nth = 1;
#ifdef _OPENMP
    if (nl > 1) nth = omp_get_max_threads();
#endif
    tree_scratch *pool = c->scratch && !pthread_mutex_trylock(&c->scratch->mu) ? c->scratch : NULL;
    if (pool && pool->n < nth) {
        uint8_t **nb = realloc(pool->buf, (size_t)nth * sizeof *nb);
        if (nb) pool->buf = nb;
        size_t *nc = nb ? realloc(pool->cap, (size_t)nth * sizeof *nc) : NULL;
        if (nc) pool->cap = nc;
        if (nb && nc) {
            for (int i = pool->n; i < nth; i++) pool->buf[i] = NULL, pool->cap[i] = 0;
            pool->n = nth;
        }
    }
#pragma omp parallel if (nl > 1) num_threads(nth)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        uint8_t *own = NULL, *b = NULL;
        kv_status bst = KV_OK;
        if (pool && me < pool->n) {
            if (pool->cap[me] < maxlen) {
                free(pool->buf[me]);
                pool->cap[me] = 0;
                if ((pool->buf[me] = malloc((size_t)maxlen))) pool->cap[me] = (size_t)maxlen;
            }
            b = pool->buf[me];
        } else
            b = own = malloc((size_t)maxlen);
        if (!b) bst = kv_fail(KV_E_NOMEM, "cannot allocate a frame of %llu bytes", (unsigned long long)maxlen);
#pragma omp for schedule(dynamic, 1)
        for (int li = 0; li < nl; li++) {
            kv_status fst;
#pragma omp atomic read
            fst = st;
            if (fst) continue;
            fst = bst;
            const int f = list[li];
            kvc_file *fk = NULL;
            float *x = NULL;
            if (!fst) fst = frame_open(c, f, b, nl == 1, &fk);
            const int rows = fst ? 0 : c->frames[f].rows;
            if (!fst && c->enc.codec != KV_TREE_ENC_RAW && !(x = malloc((size_t)Hkv * R * D * sizeof *x + 1)))
                fst = kv_fail(KV_E_NOMEM, "cannot allocate a frame decode");
            for (int l = 0; l < L && !fst; l++)
                for (int w = 0; w < 2 && !fst; w++) {
                    char which = w ? 'v' : 'k';
                    char *dst = (w ? vdst : kdst)[l];
                    const kvc_tensor *t = c->enc.codec == KV_TREE_ENC_RAW ? kvc_layer(fk, l, w ? "v" : "k") : NULL;
                    if (!t && (fst = kv_layer_decode(fk, l, which, x))) {
                        kv_errcontext("chunk %s frame %d", c->name, f);
                        break;
                    }
                    copy_runs(c, f, sel, first, ent, t ? t->data : NULL, x, rows, dst, dst_T, off);
                }
            kvc_close(fk);
            free(x);
            if (fst) {
#pragma omp critical(tree_chunk_rows_err)
                if (!st) { /* the detail is per thread: carried over by hand */
                    snprintf(msg, sizeof msg, "%s", kv_errdetail());
                    st = fst;
                }
            }
        }
        free(own);
    }
    if (pool) pthread_mutex_unlock(&pool->mu);
    free(list), free(first), free(ent);
    return st ? kv_fail(st, "%s", msg) : KV_OK;
}

// --- layered reads -------------------------------------------------------------------

#define LAYERED_HEAD_READ 16384 /* a frame's first read: its header, usually whole */

void tree_layered_free(tree_layered *y)
{
    for (int i = 0; y->head && i < y->nl; i++) kvc_close(y->head[i]);
    free(y->head), free(y->list), free(y->first), free(y->ent);
    memset(y, 0, sizeof *y);
}

/* Frame f's header, parsed (kvc_open_head) and checked against the chunk
 * (frame_check); *fits false when a layer's K or V is not a raw tensor of
 * the chunk's rows with a checksum (then the frame is read whole). */
static kv_status layered_head(tree_chunk *c, int f, kvc_file **out, bool *fits, size_t *span)
{
    *out = NULL;
    *fits = false;
    const tree_frame *fr = &c->frames[f];
    size_t got = fr->len < LAYERED_HEAD_READ ? (size_t)fr->len : LAYERED_HEAD_READ;
    if (got < 8) return kv_fail(KV_E_DATA, "chunk %s: frame %d is shorter than a .kvc header", c->name, f);
    uint8_t *b = malloc(got);
    if (!b) return kv_fail(KV_E_NOMEM, "out of memory");
    kv_status st = src_read(c, fr->off, b, got);
    uint64_t hn = st ? 0 : 8 + rd64(b);
    if (!st && hn - 8 > (100u << 20)) /* kvc's header limit */
        st = kv_fail(KV_E_DATA, "chunk %s: frame %d's header of %llu bytes is over the limit", c->name, f,
                     (unsigned long long)(hn - 8));
    if (!st && hn > got && hn <= fr->len) { /* a longer header: the rest of it */
        uint8_t *nb = realloc(b, (size_t)hn);
        if (!nb) st = kv_fail(KV_E_NOMEM, "out of memory");
        else b = nb, st = src_read(c, fr->off + got, b + got, (size_t)hn - got), got = (size_t)hn;
    }
    kvc_file *k = NULL;
    if (!st && (st = kvc_open_head(b, got, fr->len, &k))) kv_errcontext("chunk %s frame %d", c->name, f);
    /* the whole-frame CRC covered the header's bytes too: the frame is its
     * header then its tensors tiled in offset order, so the header's CRC
     * combined with each tensor's must give it (a frame otherwise, or a
     * tensor without a CRC, is read whole) */
    bool tiled = false;
    if (!st) {
        const uint64_t ds = kvc_data_start(k);
        tiled = ds <= got;
        uint32_t crc = tiled ? kv_crc32c(0, b, (size_t)ds) : 0;
        uint64_t at = 0;
        for (int i = 0; i < kvc_n_tensors(k) && tiled; i++) {
            const kvc_tensor *t = kvc_tensor_at(k, i);
            tiled = t->has_crc && t->offset == at;
            if (tiled) crc = kv_crc32c_combine(crc, t->crc, t->nbytes), at += t->nbytes;
        }
        tiled = tiled && ds + at == fr->len;
        if (tiled && crc != fr->crc)
            st = kv_fail(KV_E_DATA, "chunk %s: checksum mismatch in frame %d (its header)", c->name, f);
    }
    free(b);
    if (!st) st = frame_check(c, f, k);
    if (st) {
        kvc_close(k);
        return st;
    }
    const int rows = fr->rows;
    bool ok = true;
    for (int l = 0; l < c->L && ok; l++) {
        size_t sp = 0;
        for (int w = 0; w < 2 && ok; w++) {
            const kvc_tensor *t = kvc_layer(k, l, w ? "v" : "k");
            ok = t && t->has_crc && t->dtype == c->dt && t->ndim == 3 && t->shape[0] == c->Hkv &&
                 t->shape[1] == rows && t->shape[2] == c->D;
            if (ok) sp += (size_t)t->nbytes;
        }
        if (sp > *span) *span = sp;
    }
    *out = k;
    *fits = ok && tiled;
    return KV_OK;
}

kv_status tree_layered_begin(tree_chunk *c, const int *sel, int k, int off, tree_layered *y, bool *ok)
{
    memset(y, 0, sizeof *y);
    *ok = false;
    if (c->version == 1 || c->enc.codec != KV_TREE_ENC_RAW || c->enc.zstd) return KV_OK;
    for (int i = 0; i < k; i++)
        if (sel[i] < 0 || sel[i] >= c->n) return kv_fail(KV_E_INTERNAL, "row %d outside the chunk", sel[i]);
    y->c = c, y->sel = sel, y->k = k, y->off = off;
    kv_status st = frame_plan(c, sel, k, &y->list, &y->nl, &y->first, &y->ent);
    if (st) return st;
    if (!(y->head = calloc((size_t)y->nl + 1, sizeof *y->head))) {
        tree_layered_free(y);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    bool all = true;
    char msg[512] = "";
    size_t span = 0;
    /* the headers' reads and parses (a few hundred microseconds each in an
     * 8B's shape) in parallel */
#pragma omp parallel for schedule(dynamic, 1) if (y->nl > 1) reduction(&& : all) reduction(max : span)
    for (int li = 0; li < y->nl; li++) {
        bool fits = false;
        size_t sp = 0;
        kv_status e = layered_head(c, y->list[li], &y->head[li], &fits, &sp);
        all = all && fits;
        span = sp > span ? sp : span;
        if (e) {
#pragma omp critical(tree_layered_begin)
            if (!st) snprintf(msg, sizeof msg, "%s", kv_errdetail()), st = e;
        }
    }
    y->span = span;
    if (st || !all) tree_layered_free(y);
    if (st) return kv_fail(st, "%s", msg);
    *ok = all;
    return KV_OK;
}

kv_status tree_layered_frame(const tree_layered *y, int li, int l, uint8_t *buf, void *const *kdst,
                             void *const *vdst, int dst_T)
{
    tree_chunk *c = y->c;
    const int f = y->list[li];
    const tree_frame *fr = &c->frames[f];
    const kvc_tensor *t[2] = {kvc_layer(y->head[li], l, "k"), kvc_layer(y->head[li], l, "v")};
    const uint64_t base = fr->off + kvc_data_start(y->head[li]);
    const size_t kn = (size_t)t[0]->nbytes, vn = (size_t)t[1]->nbytes;
    kv_status st = t[1]->offset == t[0]->offset + kn ? src_read(c, base + t[0]->offset, buf, kn + vn) /* one read */
                                                      : src_read(c, base + t[0]->offset, buf, kn);
    if (!st && t[1]->offset != t[0]->offset + kn) st = src_read(c, base + t[1]->offset, buf + kn, vn);
    if (st) return st;
    for (int w = 0; w < 2; w++)
        if (kv_crc32c(0, buf + (w ? kn : 0), w ? vn : kn) != t[w]->crc)
            return kv_fail(KV_E_DATA, "chunk %s: checksum mismatch in frame %d, layer %d's %c", c->name, f, l,
                           w ? 'V' : 'K');
    copy_runs(c, f, y->sel, y->first, y->ent, buf, NULL, fr->rows, kdst[l], dst_T, y->off);
    copy_runs(c, f, y->sel, y->first, y->ent, buf + kn, NULL, fr->rows, vdst[l], dst_T, y->off);
    return KV_OK;
}

kv_status tree_chunk_queries(tree_chunk *c, float *q)
{
    size_t n = (size_t)c->L * c->q_heads * c->n_q * c->D;
    if (!n) return KV_OK;
    kv_status st = src_read(c, c->q_off, q, n * 4);
    if (!st && kv_crc32c(0, q, n * 4) != c->q_crc) st = kv_fail(KV_E_DATA, "chunk %s: checksum mismatch in the query samples", c->name);
    for (size_t i = 0; i < n && !st; i++)
        if (!isfinite(q[i])) st = kv_fail(KV_E_DATA, "chunk %s: a query sample is not finite", c->name);
    return st;
}

kv_status tree_chunk_sketch(tree_chunk *c, uint16_t *ch, float *scale, int8_t *code)
{
    const size_t hr = (size_t)c->L * c->Hkv * c->sk_r, nc = hr * (size_t)c->n;
    if (!hr) return kv_fail(KV_E_INTERNAL, "chunk %s has no key sketch", c->name);
    uint8_t *b = malloc(hr * 6);
    if (!b) return kv_fail(KV_E_NOMEM, "cannot allocate a key sketch of %zu bytes", hr * 6);
    /* the codes (the bulk) straight into place */
    kv_status st = src_read(c, c->sk_off, b, hr * 6);
    uint32_t crc = st ? 0 : kv_crc32c(0, b, hr * 6);
    if (!st) st = src_read_par_crc(c, c->sk_off + hr * 6, code, nc, &crc);
    if (!st && crc != c->sk_crc)
        st = kv_fail(KV_E_DATA, "chunk %s: checksum mismatch in the key sketch", c->name);
    for (size_t i = 0; i < hr && !st; i++) {
        ch[i] = (uint16_t)(b[2 * i] | b[2 * i + 1] << 8);
        uint32_t fb = rd32(b + 2 * hr + 4 * i);
        memcpy(&scale[i], &fb, 4);
        if (ch[i] >= c->D || (i % c->sk_r && ch[i] <= ch[i - 1]))
            st = kv_fail(KV_E_DATA, "chunk %s: key sketch channel %u is not an increasing channel below %d", c->name, ch[i], c->D);
        else if (!isfinite(scale[i]) || scale[i] < 0)
            st = kv_fail(KV_E_DATA, "chunk %s: key sketch scale %zu is not a finite non-negative number", c->name, i);
    }
    free(b);
    return st;
}

/* Every row of a chunk in memory read layer by layer as well (rows k, v
 * already read whole): equal when both reads succeed. */
static kv_status verify_layered(tree_chunk *c, const int *sel, void *const *k, void *const *v, uint64_t row)
{
    tree_layered y;
    bool ok = false;
    kv_status st = tree_layered_begin(c, sel, c->n, 0, &y, &ok);
    if (st || !ok) return st;
    void **k2 = calloc((size_t)c->L, sizeof *k2), **v2 = calloc((size_t)c->L, sizeof *v2);
    uint8_t *buf = malloc(y.span + 1);
    if (!k2 || !v2 || !buf) st = kv_fail(KV_E_NOMEM, "no memory");
    for (int l = 0; l < c->L && !st; l++)
        if (!(k2[l] = malloc((size_t)row + 1)) || !(v2[l] = malloc((size_t)row + 1))) st = kv_fail(KV_E_NOMEM, "no memory");
    for (int l = 0; l < c->L && !st; l++)
        for (int li = 0; li < y.nl && !st; li++) st = tree_layered_frame(&y, li, l, buf, k2, v2, c->n);
    for (int l = 0; l < c->L && !st; l++)
        if (memcmp(k[l], k2[l], (size_t)row) || memcmp(v[l], v2[l], (size_t)row))
            st = kv_fail(KV_E_INTERNAL, "chunk %s: layer %d read by layer differs from the frames read whole", c->name, l);
    for (int l = 0; k2 && v2 && l < c->L; l++) free(k2[l]), free(v2[l]);
    free(k2), free(v2), free(buf);
    tree_layered_free(&y);
    return st;
}

static kv_status verify_mem(const void *buf, size_t len, bool layered, int *n_rows)
{
    tree_chunk c;
    memset(&c, 0, sizeof c);
    c.fd = -1;
    c.mem = buf;
    c.size = len;
    snprintf(c.name, sizeof c.name, "(memory)");
    *n_rows = 0;
    kv_status st = tree_chunk_parse(&c, NULL);
    uint64_t row = st ? 0 : smul(smul(smul((uint64_t)c.Hkv, (uint64_t)c.n), (uint64_t)c.D), kv_dtype_size(c.dt));
    void **k = NULL, **v = NULL;
    int *sel = NULL;
    float *q = NULL;
    if (!st) {
        k = calloc((size_t)c.L, sizeof *k), v = calloc((size_t)c.L, sizeof *v);
        sel = malloc((size_t)c.n * sizeof *sel);
        /* the query samples are bounded by the file (checked by the parse);
         * the decoded rows are not: refuse heads that claim more than this
         * verifier will allocate */
        q = malloc((size_t)c.L * c.q_heads * c.n_q * c.D * 4 + 4);
        if (!k || !v || !sel || !q || row > (1u << 28) || smul(row, 2ull * c.L) > (1u << 30))
            st = kv_fail(KV_E_NOMEM, "chunk too large to verify in memory");
        for (int l = 0; l < c.L && !st; l++)
            if (!(k[l] = malloc((size_t)row + 1)) || !(v[l] = malloc((size_t)row + 1))) st = kv_fail(KV_E_NOMEM, "no memory");
    }
    if (!st) {
        for (int i = 0; i < c.n; i++) sel[i] = i;
        st = tree_chunk_rows(&c, sel, c.n, k, v, c.n, 0);
    }
    if (!st && layered) st = verify_layered(&c, sel, k, v, row);
    if (!st) st = tree_chunk_queries(&c, q);
    if (!st && c.sk_r) { /* bounded by the file, as the queries */
        size_t hr = (size_t)c.L * c.Hkv * c.sk_r;
        uint16_t *ch = malloc(hr * 2);
        float *sc = malloc(hr * 4);
        int8_t *code = malloc(hr * (size_t)c.n);
        st = ch && sc && code ? tree_chunk_sketch(&c, ch, sc, code) : kv_fail(KV_E_NOMEM, "no memory");
        free(ch), free(sc), free(code);
    }
    if (!st) *n_rows = c.n;
    for (int l = 0; k && v && l < c.L; l++) free(k[l]), free(v[l]);
    free(k);
    free(v);
    free(sel);
    free(q);
    tree_chunk_free(&c);
    return st;
}

kv_status kv_tree_chunk_verify_mem(const void *buf, size_t len, int *n_rows)
{
    return verify_mem(buf, len, false, n_rows);
}

kv_status kv_tree_chunk_verify_layered_mem(const void *buf, size_t len, int *n_rows)
{
    return verify_mem(buf, len, true, n_rows);
}

// --- writing ----------------------------------------------------------------------

static void get_row(const void *src, kv_dtype dt, size_t idx, float *x, int D)
{
    if (dt == KV_DT_F32) memcpy(x, (const float *)src + idx * D, (size_t)D * 4);
    else if (dt == KV_DT_F16)
        for (int i = 0; i < D; i++) x[i] = kv_half_to_f32(((const kv_half *)src)[idx * D + i]);
    else
        for (int i = 0; i < D; i++) x[i] = kv_bf16_to_f32(((const kv_bf16 *)src)[idx * D + i]);
}

typedef struct {
    int32_t j;
    float imp;
} rank_ix;

static int cmp_rank(const void *a, const void *b)
{
    const rank_ix *x = a, *y = b;
    if (x->imp != y->imp) return x->imp > y->imp ? -1 : 1;
    return x->j - y->j; /* ties to the earlier token */
}

/* One frame: rows ord[0..rows) of the chunk (edge offsets), src rows sel[.] */
static kv_status frame_encode(const kv_tree_geom *tg, const kv_tree_enc *enc, int R, const chunk_src *src,
                              const int *sel, const int32_t *ord, int rows, const float *imp, int zstd_level,
                              uint8_t **out, size_t *len)
{
    const kv_geom *sg = &tg->g;
    const int L = sg->n_layers, Hkv = sg->n_kv_heads, D = sg->head_dim;
    const size_t es = kv_dtype_size(tg->dtype), row = (size_t)D * es, per = (size_t)Hkv * rows * row;
    kvc_writer *w = NULL;
    char *raw = malloc(per * 2 * (size_t)L + 1);
    float *x = malloc((size_t)Hkv * rows * D * sizeof *x + 1), *ximp = malloc((size_t)Hkv * rows * sizeof *ximp + 1);
    kv_status st = kvc_writer_new(&w);
    if (!st && (!raw || !x || !ximp)) st = kv_fail(KV_E_NOMEM, "cannot allocate a frame of %d rows", rows);
    kv_geom g = *sg;
    g.n_tokens = rows, g.n_q = 0;
    if (!st) st = kvc_writer_geom(w, &g);
    kv_kivi_params kp = {enc->bits, R, 0};
    kv_dsq_params dp;
    kv_dsq_params_default(&dp);
    dp.window = R, dp.salient = kv_dsq_salient_count(R, KV_DSQ_DEFAULT_SALIENT_FRAC), dp.bits = enc->bits;
    for (int h = 0; h < Hkv; h++)
        for (int r = 0; r < rows; r++) ximp[(size_t)h * rows + r] = imp[ord[r]];
    for (int l = 0; l < L && !st; l++)
        for (int wv = 0; wv < 2 && !st; wv++) {
            const char *s = (const char *)(wv ? src->v[l] : src->k[l]);
            char *dst = raw + per * (2 * (size_t)l + wv);
            for (int h = 0; h < Hkv; h++)
                for (int r = 0; r < rows; r++)
                    memcpy(dst + ((size_t)h * rows + r) * row, s + ((size_t)h * src->src_T + sel[ord[r]]) * row, row);
            char name[64];
            snprintf(name, sizeof name, "layers.%d.%c", l, wv ? 'v' : 'k');
            int64_t sh3[3] = {Hkv, rows, D};
            if (enc->codec == KV_TREE_ENC_RAW) {
                st = kvc_writer_add(w, name, tg->dtype, 3, sh3, dst);
                continue;
            }
            for (size_t i = 0; i < (size_t)Hkv * rows; i++) get_row(dst, tg->dtype, i, x + i * D, D);
            kv_kivi_axis ax = wv ? KV_KIVI_VALUES : KV_KIVI_KEYS;
            if (enc->codec == KV_TREE_ENC_KIVI) {
                kv_kivi_packed p;
                memset(&p, 0, sizeof p);
                if (!(st = kv_kivi_pack(x, ax, &kp, Hkv, rows, D, &p))) st = kv_kivi_write(w, l, wv ? 'v' : 'k', &p);
                kv_kivi_clear(&p);
            } else {
                kv_dsq_packed p;
                memset(&p, 0, sizeof p);
                if (!(st = kv_dsq_pack(x, ximp, ax, &dp, Hkv, rows, D, &p))) st = kv_dsq_write(w, l, wv ? 'v' : 'k', &p);
                kv_dsq_clear(&p);
            }
        }
    if (!st) st = kvc_writer_write_mem(w, enc->zstd ? zstd_level : 0, out, len);
    kvc_writer_free(w);
    free(raw);
    free(x);
    free(ximp);
    return st;
}

/* The key sketch of n rows (src rows sel[0..n), edge order): per layer and
 * KV head the r channels that carry most of q.k (mean |k_c| times the RMS
 * of the query samples' channel c over the head's group; |k_c| alone
 * without samples), each as int8 codes with one scale. */
static kv_status sketch_encode(const kv_tree_geom *tg, const chunk_src *src, const int *sel, int n, const float *q,
                               int q_heads, int n_q, int r, uint8_t **out, size_t *len)
{
    const kv_geom *sg = &tg->g;
    const int L = sg->n_layers, Hkv = sg->n_kv_heads, D = sg->head_dim;
    const size_t hr = (size_t)L * Hkv * r, es = kv_dtype_size(tg->dtype);
    *len = hr * 6 + hr * (size_t)n;
    uint8_t *b = malloc(*len + 1);
    float *x = malloc((size_t)n * D * sizeof *x + 1), *w = malloc((size_t)D * sizeof *w), *mx = malloc((size_t)D * sizeof *mx);
    rank_ix *rk = malloc((size_t)D * sizeof *rk);
    if (!b || !x || !w || !mx || !rk) {
        free(b), free(x), free(w), free(mx), free(rk);
        return kv_fail(KV_E_NOMEM, "cannot allocate a key sketch of %d rows", n);
    }
    for (int l = 0; l < L; l++)
        for (int h = 0; h < Hkv; h++) {
            const size_t lh = (size_t)l * Hkv + h;
            const char *ks = (const char *)src->k[l];
            for (int t = 0; t < n; t++)
                get_row(ks + ((size_t)h * src->src_T + sel[t]) * D * es, tg->dtype, 0, x + (size_t)t * D, D);
            for (int c = 0; c < D; c++) w[c] = 0, mx[c] = 0;
            for (int t = 0; t < n; t++)
                for (int c = 0; c < D; c++) {
                    float a = fabsf(x[(size_t)t * D + c]);
                    w[c] += a;
                    if (a > mx[c]) mx[c] = a;
                }
            if (q && q_heads) {
                const int g = q_heads / Hkv;
                for (int c = 0; c < D; c++) {
                    double qq = 0;
                    for (int hq = h * g; hq < (h + 1) * g; hq++)
                        for (int j = 0; j < n_q; j++) {
                            double v = q[(((size_t)l * q_heads + hq) * n_q + j) * D + c];
                            qq += v * v;
                        }
                    w[c] *= (float)sqrt(qq / ((double)g * n_q));
                }
            }
            for (int c = 0; c < D; c++) rk[c] = (rank_ix){c, w[c]};
            qsort(rk, (size_t)D, sizeof *rk, cmp_rank);
            for (int i = 1; i < r; i++) /* the r chosen, in channel order */
                for (int j = i; j > 0 && rk[j].j < rk[j - 1].j; j--) {
                    rank_ix tmp = rk[j];
                    rk[j] = rk[j - 1], rk[j - 1] = tmp;
                }
            for (int i = 0; i < r; i++) {
                int c = rk[i].j;
                float sc = mx[c] / 127.0f;
                uint32_t fb;
                memcpy(&fb, &sc, 4);
                b[2 * (lh * r + i)] = (uint8_t)c, b[2 * (lh * r + i) + 1] = (uint8_t)(c >> 8);
                wr32(b + 2 * hr + 4 * (lh * r + i), fb);
                int8_t *code = (int8_t *)(b + 6 * hr) + lh * (size_t)n * r;
                for (int t = 0; t < n; t++) {
                    float v = sc > 0 ? x[(size_t)t * D + c] / sc : 0;
                    code[(size_t)t * r + i] = (int8_t)lrintf(v > 127 ? 127 : v < -127 ? -127 : v);
                }
            }
        }
    free(x), free(w), free(mx), free(rk);
    *out = b;
    return KV_OK;
}

int kv_tree_sketch_channels(int head_dim, int want)
{
    if (want > 0) return want < head_dim ? want : head_dim;
    return head_dim / 2 > 0 ? head_dim / 2 : 1;
}

kv_status tree_chunk_encode(const kv_tree_geom *tg, const kv_tree_enc *enc, int R, int sketch_want, int start, int n,
                            const int32_t *tok, const float *imp, const chunk_src *src, const int *sel,
                            const float *q, int q_heads, int n_q, int zstd_level, uint8_t **out, size_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    const kv_geom *sg = &tg->g;
    int nf = (n + R - 1) / R;
    const bool v3 = enc->sketch;
    const size_t hb = v3 ? HEAD3_BYTES : HEAD_BYTES;
    const int sk_r = v3 ? kv_tree_sketch_channels(sg->head_dim, sketch_want) : 0;
    uint8_t *sk = NULL;
    size_t sk_len = 0;
    if (v3) {
        kv_status st0 = sketch_encode(tg, src, sel, n, q, q_heads, n_q, sk_r, &sk, &sk_len);
        if (st0) return st0;
    }
    size_t q_bytes = q ? 4ull * sg->n_layers * q_heads * n_q * sg->head_dim : 0;
    size_t tables = 12ull * n + (size_t)FRAME_ENTRY * nf, head_len = hb + tables + q_bytes + sk_len;
    uint8_t *head = calloc(head_len, 1), **fb = calloc((size_t)nf, sizeof *fb);
    size_t *fl = calloc((size_t)nf, sizeof *fl);
    rank_ix *rk = malloc((size_t)n * sizeof *rk);
    int32_t *ord = malloc((size_t)n * sizeof *ord);
    kv_status st = head && fb && fl && rk && ord ? KV_OK : kv_fail(KV_E_NOMEM, "cannot allocate a chunk of %d tokens", n);
    if (st) goto out;
    for (int i = 0; i < n; i++) rk[i] = (rank_ix){i, imp[i]};
    if (!v3) qsort(rk, (size_t)n, sizeof *rk, cmp_rank); /* version 3: position order */
    for (int i = 0; i < n; i++) ord[i] = rk[i].j;
    for (int f = 0; f < nf && !st; f++) {
        int rows = f + 1 < nf ? R : n - (nf - 1) * R;
        st = frame_encode(tg, enc, R, src, sel, ord + (size_t)f * R, rows, imp, zstd_level, &fb[f], &fl[f]);
    }
    if (st) goto out;
    memcpy(head, MAGIC, 8);
    wr32(head + 8, v3 ? 3u : 2u);
    uint32_t hv[14] = {(uint32_t)n, (uint32_t)start, (uint32_t)R, (uint32_t)nf, (uint32_t)enc->codec,
                       (uint32_t)(enc->codec == KV_TREE_ENC_RAW ? 0 : enc->bits), enc->zstd ? 1u : 0u,
                       (uint32_t)sg->n_layers, (uint32_t)sg->n_kv_heads, (uint32_t)sg->head_dim, (uint32_t)tg->dtype,
                       q ? (uint32_t)q_heads : 0u, q ? (uint32_t)n_q : 0u, 0};
    for (int i = 0; i < 14; i++) wr32(head + 16 + 4 * i, hv[i]);
    if (v3) {
        wr32(head + 72, (uint32_t)sk_r);
        wr32(head + 76, kv_crc32c(0, sk, sk_len));
        wr32(head + 80, 1u); /* rows in position order */
    }
    uint8_t *tb = head + hb;
    for (int i = 0; i < n; i++) {
        uint32_t fbits;
        memcpy(&fbits, &imp[i], 4);
        wr32(tb + 4 * (size_t)i, (uint32_t)tok[i]);
        wr32(tb + 4ull * n + 4 * (size_t)i, fbits);
        wr32(tb + 8ull * n + 4 * (size_t)i, (uint32_t)ord[i]);
    }
    uint64_t pos = head_len;
    for (int f = 0; f < nf; f++) {
        uint8_t *e = tb + 12ull * n + (size_t)FRAME_ENTRY * f;
        wr64(e, pos);
        wr64(e + 8, fl[f]);
        wr32(e + 16, kv_crc32c(0, fb[f], fl[f]));
        wr32(e + 20, (uint32_t)(f + 1 < nf ? R : n - (nf - 1) * R));
        pos += fl[f];
    }
    if (q) {
        memcpy(head + hb + tables, q, q_bytes);
        wr32(head + 68, kv_crc32c(0, q, q_bytes));
    }
    if (sk) memcpy(head + hb + tables + q_bytes, sk, sk_len);
    wr32(head + 12, kv_crc32c(kv_crc32c(0, head + 16, hb - 16), tb, tables));
    uint8_t *all = malloc((size_t)pos);
    if (!all) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate a chunk of %llu bytes", (unsigned long long)pos);
        goto out;
    }
    memcpy(all, head, head_len);
    for (size_t f = 0, p = head_len; f < (size_t)nf; p += fl[f], f++) memcpy(all + p, fb[f], fl[f]);
    *out = all;
    *out_len = (size_t)pos;
out:
    for (int f = 0; fb && f < nf; f++) free(fb[f]);
    free(fb);
    free(fl);
    free(head);
    free(rk);
    free(ord);
    free(sk);
    return st;
}
