/*
 * Unit tests of the .kvc reader and writer (lib/format/kvc_*.c, with
 * lib/common/kv_crc and kv_outfile): CRC-32C, writer/reader round trips of every
 * dtype and of the metadata, geometry derived from shapes alone, zstd, the
 * atomic writer under failure, and the reader against truncation, bit flips
 * and a table of hand-made corrupt headers.
 *
 * `test_kvc --write-sample PATH [--zstd]` writes the deterministic sample
 * file that tests/interop/kvc_py.py checks value by value (the formulas are
 * repeated there; keep them in step).
 */
#include <errno.h>
#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <zstd.h>

#include "kt_kv.h"
#include "common/kv_crc.h"
#include "common/kv_outfile.h"
#include "common/kv_half.h"
#include "format/kvc.h"

/* KT_REQUIRE evaluates its condition twice; calls with side effects go
 * through this, which evaluates once. */
#define REQUIRE_OK(expr)                                                          \
    do {                                                                          \
        kv_status st_ = (expr);                                                   \
        KT_REQUIRE(st_ == KV_OK, "%s: status %d: %s", #expr, st_, kv_errdetail()); \
    } while (0)

static unsigned long long seed = 0x6b7663ull;
static char tmpdir[256];

static void tmp_path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s", tmpdir, name);
}

static int count_dir_entries(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

// --- the deterministic sample (mirrored in tests/interop/kvc_py.py) --------

enum { S_L = 3, S_KVH = 2, S_T = 5, S_D = 4, S_H = 4, S_Q = 2 };

static float sample_val(int layer, int part, long idx)
{
    return (float)((idx * 7 + layer * 13 + part * 5) % 23 - 11) / 8.0f;
}

static void fill_float(void *dst, kv_dtype dt, long n, int layer, int part)
{
    for (long i = 0; i < n; i++) {
        float v = sample_val(layer, part, i);
        if (dt == KV_DT_F32) memcpy((float *)dst + i, &v, 4);
        else if (dt == KV_DT_F16) ((kv_half *)dst)[i] = kv_f32_to_half(v);
        else ((kv_bf16 *)dst)[i] = kv_f32_to_bf16(v);
    }
}

static kv_status add_float(kvc_writer *w, const char *name, kv_dtype dt, int64_t a, int64_t b,
                           int64_t c, int layer, int part)
{
    int64_t shape[3] = {a, b, c};
    long n = (long)(a * b * c);
    void *buf = malloc((size_t)n * 4 + 1);
    fill_float(buf, dt, n, layer, part);
    kv_status st = kvc_writer_add_copy(w, name, dt, 3, shape, buf);
    free(buf);
    return st;
}

/* Layer 0 F32, layer 1 K F16 / V BF16, layer 2 KIVI 2-bit G 2 R 2 (Tq 2). */
static kv_status write_sample(const char *path, int zstd)
{
    kvc_writer *w;
    kv_status st = kvc_writer_new(&w);
    if (st) return st;
    kv_geom g;
    kv_geom_defaults(&g);
    g.n_layers = S_L, g.n_heads = S_H, g.n_kv_heads = S_KVH, g.head_dim = S_D;
    g.n_tokens = S_T, g.n_q = S_Q, g.rope_theta = 500000;
    g.rope_scaling = KV_ROPE_SCALING_LLAMA3, g.rope_factor = 8, g.rope_low_freq_factor = 1;
    g.rope_high_freq_factor = 4, g.rope_orig_ctx = 8192, g.rope_layout = KV_ROPE_HALVES;
    snprintf(g.model, sizeof g.model, "sample");
    if ((st = kvc_writer_geom(w, &g))) goto out;
    int32_t tok[S_T];
    for (int i = 0; i < S_T; i++) tok[i] = 1 + 37 * i;
    int64_t tshape[1] = {S_T};
    if ((st = kvc_writer_add_copy(w, "tokens", KV_DT_I32, 1, tshape, tok))) goto out;
    const kv_dtype kd[2] = {KV_DT_F32, KV_DT_F16}, vd[2] = {KV_DT_F32, KV_DT_BF16};
    const kv_dtype qd[3] = {KV_DT_F32, KV_DT_F16, KV_DT_BF16};
    char name[64];
    for (int l = 0; l < S_L; l++) {
        const char *enc[2] = {l == 0 ? "f32" : "f16", l == 0 ? "f32" : "bf16"};
        if (l < 2) {
            snprintf(name, sizeof name, "layers.%d.k", l);
            if ((st = add_float(w, name, kd[l], S_KVH, S_T, S_D, l, 0))) goto out;
            snprintf(name, sizeof name, "layers.%d.v", l);
            if ((st = add_float(w, name, vd[l], S_KVH, S_T, S_D, l, 1))) goto out;
        } else {
            const int bits = 2, G = 2, R = 2, tq = kv_kivi_nquant(S_T, G, R);
            for (int p = 0; p < 2; p++) {
                const char *kv = p ? "v" : "k";
                enc[p] = "kivi";
                uint8_t codes[S_KVH * S_T * S_D];
                int64_t cs[3] = {S_KVH, tq, (int64_t)kv_kivi_row_bytes(S_D, bits)};
                for (int j = 0; j < S_KVH * tq * (int)cs[2]; j++) codes[j] = (uint8_t)((j * 37 + l * 11 + p * 3) % 256);
                snprintf(name, sizeof name, "layers.%d.%s.codes", l, kv);
                if ((st = kvc_writer_add_copy(w, name, KV_DT_U8, 3, cs, codes))) goto out;
                int64_t s1 = p ? tq : tq / G, s2 = p ? S_D / kv_kivi_vgroup(G, S_D) : S_D;
                kv_half sc[S_KVH * S_T * S_D];
                for (int j = 0; j < S_KVH * s1 * s2; j++) sc[j] = kv_f32_to_half((float)(1 + j % 4) / 4.0f);
                int64_t ss[3] = {S_KVH, s1, s2};
                snprintf(name, sizeof name, "layers.%d.%s.scale", l, kv);
                if ((st = kvc_writer_add_copy(w, name, KV_DT_F16, 3, ss, sc))) goto out;
                snprintf(name, sizeof name, "layers.%d.%s.zero", l, kv);
                if ((st = add_float(w, name, KV_DT_F16, S_KVH, s1, s2, l, 3 + p))) goto out;
                snprintf(name, sizeof name, "layers.%d.%s.resid", l, kv);
                if ((st = add_float(w, name, KV_DT_F16, S_KVH, S_T - tq, S_D, l, p))) goto out;
                char key[64], val[16];
                const char *pk[3] = {"bits", "group", "residual"};
                const int pv[3] = {bits, G, R};
                for (int q = 0; q < 3; q++) {
                    snprintf(key, sizeof key, "layers.%d.%s.%s", l, kv, pk[q]);
                    snprintf(val, sizeof val, "%d", pv[q]);
                    if ((st = kvc_writer_meta(w, key, val))) goto out;
                }
            }
        }
        snprintf(name, sizeof name, "layers.%d.q", l);
        if ((st = add_float(w, name, qd[l], S_H, S_Q, S_D, l, 2))) goto out;
        for (int p = 0; p < 2; p++) {
            snprintf(name, sizeof name, "layers.%d.%s.encoding", l, p ? "v" : "k");
            if ((st = kvc_writer_meta(w, name, enc[p]))) goto out;
        }
    }
    st = kvc_writer_write(w, path, zstd);
out:
    kvc_writer_free(w);
    return st;
}

/* The sample written as name in the test folder, and its bytes (free
 * them); NULL, the reason printed, when either step failed. */
static uint8_t *sample_bytes(const char *name, size_t *len)
{
    char path[300];
    tmp_path(path, sizeof path, name);
    kv_status st = write_sample(path, 0);
    if (st) {
        printf("#   write_sample(%s, 0): status %d: %s\n", path, st, kv_errdetail());
        return NULL;
    }
    return kt_slurp(path, len);
}

// --- CRC ----------------------------------------------------------------

static uint32_t crc_bitwise(const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
    }
    return ~c;
}

static void test_crc32c_known_answer(void)
{
    KT_CHECK(kv_crc32c(0, "123456789", 9) == 0xe3069283u, "got %08x", kv_crc32c(0, "123456789", 9));
    KT_CHECK(kv_crc32c_sw(0, "123456789", 9) == 0xe3069283u, "portable path");
    KT_CHECK(kv_crc32c(0, "", 0) == 0, "empty");
    uint32_t c = kv_crc32c(0, "1234", 4);
    KT_CHECK(kv_crc32c(c, "56789", 5) == 0xe3069283u, "continued crc");
}

/* kv_crc32c_combine: the CRC of a buffer from the CRCs of its two parts,
 * at every split of a random buffer (empty parts too), from a nonzero
 * starting CRC, and with parts longer than a word's worth of bits. */
static void test_crc32c_combine_equals_the_whole(void)
{
    enum { N = 3000 };
    static unsigned char buf[N];
    unsigned long long rs = 99;
    for (int i = 0; i < N; i++) buf[i] = (unsigned char)(kt_rand(&rs) * 256);
    int bad = 0;
    const uint32_t c0[2] = {0, 0x1234abcdu};
    for (int k = 0; k < 2; k++)
        for (int cut = 0; cut <= N; cut += (cut < 40 ? 1 : 97)) {
            const uint32_t whole = kv_crc32c(c0[k], buf, N), a = kv_crc32c(c0[k], buf, (size_t)cut),
                           b = kv_crc32c(0, buf + cut, (size_t)(N - cut));
            bad += kv_crc32c_combine(a, b, (uint64_t)(N - cut)) != whole;
        }
    KT_CHECK(bad == 0, "%d splits combine to another CRC", bad);
    /* three parts in order, as a parallel read combines its slices */
    uint32_t acc = kv_crc32c(0, buf, 1000);
    acc = kv_crc32c_combine(acc, kv_crc32c(0, buf + 1000, 1500), 1500);
    acc = kv_crc32c_combine(acc, kv_crc32c(0, buf + 2500, 500), 500);
    KT_CHECK(acc == kv_crc32c(0, buf, N), "three slices");
    KT_CHECK(kv_crc32c_combine(0x5a5a5a5au, kv_crc32c(0, buf, 0), 0) == 0x5a5a5a5au, "an empty second part");
}

static void test_crc32c_matches_bitwise_reference(void)
{
    uint8_t buf[1100];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)(kt_rand(&seed) * 256);
    for (size_t off = 0; off < 9; off++)
        for (size_t n = 0; n + off <= sizeof buf; n += 37)
            KT_CHECK(kv_crc32c(0, buf + off, n) == crc_bitwise(buf + off, n) &&
                         kv_crc32c_sw(0, buf + off, n) == crc_bitwise(buf + off, n),
                     "off %zu n %zu", off, n);
}

/* Buffers of 64 KiB and more take the three-lane path: against the table
 * path at lengths around the switch and at lengths that leave each tail
 * size (n mod 24), from a nonzero starting CRC and unaligned. */
static void test_crc32c_three_lanes_match_the_table(void)
{
    enum { N = (200 << 10) + 64 };
    uint8_t *buf = malloc(N);
    KT_CHECK(buf != NULL, "malloc");
    if (!buf) return;
    unsigned long long rs = 7;
    for (int i = 0; i < N; i++) buf[i] = (uint8_t)(kt_rand(&rs) * 256);
    const size_t lens[] = {(64 << 10) - 1, 64 << 10, (64 << 10) + 1, (64 << 10) + 7, (64 << 10) + 23, 100003,
                           150000, 200 << 10};
    int bad = 0;
    for (size_t i = 0; i < sizeof lens / sizeof *lens; i++)
        for (size_t off = 0; off < 3; off++)
            for (int k = 0; k < 2; k++) {
                const uint32_t c0 = k ? 0xdeadbeefu : 0;
                bad += kv_crc32c(c0, buf + off, lens[i]) != kv_crc32c_sw(c0, buf + off, lens[i]);
            }
    KT_CHECK(bad == 0, "%d of %zu lengths differ", bad, 6 * (sizeof lens / sizeof *lens));
    /* one flipped bit in each third is seen */
    const uint32_t whole = kv_crc32c(0, buf, 150000);
    int missed = 0;
    for (size_t at = 1000; at < 150000; at += 50000) {
        buf[at] ^= 4;
        missed += kv_crc32c(0, buf, 150000) == whole;
        buf[at] ^= 4;
    }
    KT_CHECK(missed == 0, "%d flipped bits not seen", missed);
    free(buf);
}

// --- round trips --------------------------------------------------------

static void test_roundtrip_every_dtype(void)
{
    kvc_writer *w;
    REQUIRE_OK(kvc_writer_new(&w));
    uint8_t raw[KV_DT_COUNT][96];
    int64_t shape[2] = {3, 4};
    char name[32];
    for (int d = 0; d < KV_DT_COUNT; d++) {
        for (int i = 0; i < 96; i++) raw[d][i] = (uint8_t)(kt_rand(&seed) * 256);
        if (d == KV_DT_F32) /* keep floats finite so memcmp is meaningful for NaN-free data */
            for (int i = 0; i < 12; i++) {
                float v = kt_randn(&seed);
                memcpy(raw[d] + 4 * i, &v, 4);
            }
        snprintf(name, sizeof name, "extra.%s", kv_dtype_name((kv_dtype)d));
        KT_CHECK(kvc_writer_add(w, name, (kv_dtype)d, 2, shape, raw[d]) == KV_OK, "add %s", name);
    }
    KT_CHECK(add_float(w, "layers.0.k", KV_DT_F16, 1, 3, 2, 0, 0) == KV_OK, "k");
    KT_CHECK(add_float(w, "layers.0.v", KV_DT_F16, 1, 3, 2, 0, 1) == KV_OK, "v");
    int64_t s0[1] = {0};
    KT_CHECK(kvc_writer_add(w, "empty", KV_DT_F32, 1, s0, NULL) == KV_OK, "empty tensor");
    KT_CHECK(kvc_writer_add(w, "empty", KV_DT_F32, 1, s0, NULL) != KV_OK, "duplicate refused");
    char path[300];
    tmp_path(path, sizeof path, "dtypes.kvc");
    REQUIRE_OK(kvc_writer_write(w, path, 0));
    kvc_writer_free(w);

    size_t len;
    uint8_t *bytes = kt_slurp(path, &len);
    KT_REQUIRE(bytes != NULL, "slurp");
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | bytes[i];
    KT_CHECK((8 + n) % KVC_DATA_ALIGN == 0, "data section at %llu", (unsigned long long)(8 + n));
    KT_CHECK(bytes[8] == '{', "header starts with {");
    free(bytes);

    kvc_file *f;
    REQUIRE_OK(kvc_open(path, &f));
    KT_CHECK(kvc_n_tensors(f) == KV_DT_COUNT + 3, "%d tensors", kvc_n_tensors(f));
    KT_CHECK(kvc_has_checksums(f), "checksums verified");
    size_t prev = SIZE_MAX;
    for (int i = 0; i < kvc_n_tensors(f); i++) {
        const kvc_tensor *t = kvc_tensor_at(f, i);
        size_t es = kv_dtype_size(t->dtype);
        KT_CHECK(t->offset % es == 0, "%s offset %llu", t->name, (unsigned long long)t->offset);
        KT_CHECK(((uintptr_t)t->data) % es == 0, "%s data pointer aligned", t->name);
        KT_CHECK(es <= prev, "decreasing element size at %s", t->name);
        prev = es;
    }
    for (int d = 0; d < KV_DT_COUNT; d++) {
        snprintf(name, sizeof name, "extra.%s", kv_dtype_name((kv_dtype)d));
        const kvc_tensor *t = kvc_find(f, name);
        KT_REQUIRE(t != NULL, "find %s", name);
        KT_CHECK(t->dtype == (kv_dtype)d && t->ndim == 2 && t->shape[0] == 3 && t->shape[1] == 4, "%s shape", name);
        KT_CHECK(t->nbytes == 12 * kv_dtype_size((kv_dtype)d), "%s nbytes", name);
        KT_CHECK(memcmp(t->data, raw[d], t->nbytes) == 0, "%s bytes", name);
    }
    const kvc_tensor *e = kvc_find(f, "empty");
    KT_CHECK(e && e->nbytes == 0 && e->ndim == 1 && e->shape[0] == 0, "empty tensor");
    kvc_close(f);
}

static void test_roundtrip_metadata_and_geometry(void)
{
    char path[300];
    tmp_path(path, sizeof path, "sample.kvc");
    REQUIRE_OK(write_sample(path, 0));
    kvc_file *f;
    REQUIRE_OK(kvc_open(path, &f));
    const kv_geom *g = kvc_geom(f);
    KT_CHECK(g->n_layers == S_L && g->n_heads == S_H && g->n_kv_heads == S_KVH, "heads");
    KT_CHECK(g->head_dim == S_D && g->n_tokens == S_T && g->n_q == S_Q, "dims");
    KT_CHECK(g->rope_theta == 500000 && g->rope_scaling == KV_ROPE_SCALING_LLAMA3, "rope");
    KT_CHECK(g->rope_factor == 8 && g->rope_low_freq_factor == 1 && g->rope_high_freq_factor == 4, "factors");
    KT_CHECK(g->rope_orig_ctx == 8192 && g->rope_layout == KV_ROPE_HALVES && g->keys_roped, "layout");
    KT_CHECK(!strcmp(g->model, "sample"), "model '%s'", g->model);
    KT_CHECK(!strcmp(kvc_layer_encoding(f, 0, 'k'), "f32") && !strcmp(kvc_layer_encoding(f, 1, 'v'), "bf16"),
             "plain encodings");
    kv_kivi_params p;
    KT_CHECK(kvc_layer_kivi(f, 2, 'v', &p) && p.bits == 2 && p.group == 2 && p.residual == 2, "kivi params");
    KT_CHECK(!kvc_layer_kivi(f, 1, 'k', &p), "layer 1 is not kivi");
    KT_CHECK(kvc_layer_encoding(f, 3, 'k') == NULL, "out of range");
    KT_CHECK(kvc_layer_bytes(f, 0, true) == 2 * S_KVH * S_T * S_D * 4, "layer 0 kv bytes %llu",
             (unsigned long long)kvc_layer_bytes(f, 0, true));
    KT_CHECK(kvc_layer_bytes(f, 0, false) == kvc_layer_bytes(f, 0, true) + S_H * S_Q * S_D * 4, "layer bytes");
    /* Values come back through kvc_tensor_to_f32 for each float dtype. */
    for (int l = 0; l < 2; l++) {
        const char *parts[3] = {"k", "v", "q"};
        for (int p2 = 0; p2 < 3; p2++) {
            const kvc_tensor *t = kvc_layer(f, l, parts[p2]);
            KT_REQUIRE(t != NULL, "layer %d %s", l, parts[p2]);
            float buf[64];
            KT_REQUIRE(kvc_tensor_numel(t) <= 64, "size");
            KT_CHECK(kvc_tensor_to_f32(t, buf) == KV_OK, "to_f32");
            for (long i = 0; i < kvc_tensor_numel(t); i++)
                KT_CHECK(buf[i] == sample_val(l, p2, i), "%s[%ld] %g", t->name, i, buf[i]);
        }
    }
    const kvc_tensor *tok = kvc_find(f, "tokens");
    KT_CHECK(tok && kvc_tensor_to_f32(tok, (float[8]){0}) == KV_E_DATA, "I32 is not float");
    /* Metadata with characters JSON must escape survives a copy. */
    kvc_writer *w;
    REQUIRE_OK(kvc_writer_new(&w));
    KT_CHECK(kvc_writer_copy_meta(w, f) == KV_OK, "copy meta");
    KT_CHECK(kvc_writer_meta(w, "kvc.model", "a \"quoted\"\\ name\n\ttab \xc3\xa9") == KV_OK, "meta");
    KT_CHECK(kvc_writer_meta(w, "crc32c.layers.0.k", "00000000") == KV_OK, "crc key ignored");
    for (int i = 0; i < kvc_n_tensors(f); i++) {
        const kvc_tensor *t = kvc_tensor_at(f, i);
        KT_CHECK(kvc_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data) == KV_OK, "add %s", t->name);
    }
    char path2[300];
    tmp_path(path2, sizeof path2, "copy.kvc");
    KT_CHECK(kvc_writer_write(w, path2, 0) == KV_OK, "write copy: %s", kv_errdetail());
    kvc_writer_free(w);
    kvc_file *f2;
    REQUIRE_OK(kvc_open(path2, &f2));
    KT_CHECK(!strcmp(kvc_meta(f2, "kvc.model"), "a \"quoted\"\\ name\n\ttab \xc3\xa9"), "escaped model");
    KT_CHECK(!strcmp(kvc_meta(f2, "layers.2.k.bits"), "2"), "copied key");
    KT_CHECK(kvc_has_checksums(f2), "fresh checksums");
    kvc_close(f2);
    kvc_close(f);
}

/* Build a raw safetensors image: header text, then data. */
static uint8_t *raw_file(const char *hdr, const void *data, size_t dlen, size_t *len)
{
    size_t n = strlen(hdr);
    uint8_t *b = malloc(8 + n + dlen + 1);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)n >> (8 * i));
    memcpy(b + 8, hdr, n);
    if (dlen) memcpy(b + 8 + n, data, dlen);
    *len = 8 + n + dlen;
    return b;
}

static void test_geometry_derived_without_metadata(void)
{
    /* 2 layers, K/V [2, 3, 4] F16 (48 bytes each), q [4, 1, 4] F32 (64). */
    const char *hdr =
        "{\"layers.0.k\":{\"dtype\":\"F16\",\"shape\":[2,3,4],\"data_offsets\":[0,48]},"
        "\"layers.0.v\":{\"dtype\":\"F16\",\"shape\":[2,3,4],\"data_offsets\":[48,96]},"
        "\"layers.1.v\":{\"dtype\":\"F16\",\"shape\":[2,3,4],\"data_offsets\":[144,192]},"
        "\"layers.1.k\":{\"dtype\":\"F16\",\"shape\":[2,3,4],\"data_offsets\":[96,144]},"
        "\"layers.0.q\":{\"dtype\":\"F32\",\"shape\":[4,1,4],\"data_offsets\":[192,256]},"
        "\"layers.1.q\":{\"dtype\":\"F32\",\"shape\":[4,1,4],\"data_offsets\":[256,320]}}   ";
    uint8_t data[320] = {0};
    size_t len;
    uint8_t *b = raw_file(hdr, data, sizeof data, &len);
    kvc_file *f;
    REQUIRE_OK(kvc_open_mem(b, len, &f));
    const kv_geom *g = kvc_geom(f);
    KT_CHECK(g->n_layers == 2 && g->n_kv_heads == 2 && g->n_tokens == 3 && g->head_dim == 4, "shape geometry");
    KT_CHECK(g->n_heads == 4 && g->n_q == 1, "query geometry");
    KT_CHECK(g->rope_theta == 10000 && g->keys_roped && g->rope_layout == KV_ROPE_INTERLEAVED &&
                 g->rope_scaling == KV_ROPE_SCALING_NONE, "defaults");
    KT_CHECK(!kvc_has_checksums(f) && kvc_n_checksums(f) == 0 && kvc_n_meta(f) == 0, "no checksums");
    KT_CHECK(!strcmp(kvc_layer_encoding(f, 1, 'k'), "f16"), "encoding from dtype");
    KT_CHECK(!strcmp(kvc_tensor_at(f, 2)->name, "layers.1.k"), "tensors in data order");
    KT_CHECK(kvc_file_bytes(f) == len && !kvc_was_zstd(f), "size");
    kvc_close(f);
    free(b);
}

static void test_zstd_roundtrip(void)
{
    char path[300];
    tmp_path(path, sizeof path, "sample.kvc.zst");
    REQUIRE_OK(write_sample(path, 3));
    size_t len;
    uint8_t *b = kt_slurp(path, &len);
    KT_REQUIRE(b && len > 4 && b[0] == 0x28 && b[1] == 0xb5 && b[2] == 0x2f && b[3] == 0xfd, "zstd magic");
    kvc_file *f;
    REQUIRE_OK(kvc_open(path, &f));
    KT_CHECK(kvc_was_zstd(f) && kvc_file_bytes(f) == len, "zstd flag and compressed size");
    KT_CHECK(kvc_has_checksums(f) && kvc_geom(f)->n_layers == S_L, "content");
    kvc_close(f);
    /* A truncated compressed stream is bad data, not a crash. */
    KT_CHECK(kvc_open_mem(b, len - 3, &f) == KV_E_DATA, "truncated zstd: %s", kv_errdetail());
    free(b);
}

/* A raw .kvc of exactly `total` bytes (a multiple of 4): one layer's K and V
 * as F32 [1, m, 1] after a header padded with spaces. */
static uint8_t *exact_file(size_t total, size_t *hlen)
{
    char hdr[256];
    size_t h = (total - 8 - 192) % 8 ? 196 : 192, m = (total - 8 - h) / 8;
    int n = snprintf(hdr, sizeof hdr,
                     "{\"layers.0.k\":{\"dtype\":\"F32\",\"shape\":[1,%zu,1],\"data_offsets\":[0,%zu]},"
                     "\"layers.0.v\":{\"dtype\":\"F32\",\"shape\":[1,%zu,1],\"data_offsets\":[%zu,%zu]}}",
                     m, 4 * m, m, 4 * m, 8 * m);
    if (n < 0 || (size_t)n > h) return NULL;
    memset(hdr + n, ' ', h - (size_t)n);
    hdr[h] = 0;
    float *data = malloc(8 * m);
    for (size_t i = 0; i < 2 * m; i++) data[i] = (float)(i % 1000);
    size_t len;
    uint8_t *b = raw_file(hdr, data, 8 * m, &len);
    free(data);
    *hlen = h;
    if (len != total) {
        free(b);
        return NULL;
    }
    return b;
}

/* zstd streams without a recorded size, as `cat x.kvc | zstd` writes them,
 * of files whose size is the decoder's buffer doubled k times: the frame
 * ends exactly when the buffer is full (they were taken for truncated). */
static void test_zstd_without_content_size_at_buffer_sizes(void)
{
    for (size_t total = 65536 / 2; total <= 65536 * 8; total *= 2)
        for (int d = -1; d <= 1; d++) {
            size_t sz = total + (size_t)(4 * d);
            size_t h;
            uint8_t *raw = exact_file(sz, &h);
            KT_REQUIRE(raw, "raw file of %zu bytes", sz);
            ZSTD_CCtx *z = ZSTD_createCCtx();
            ZSTD_CCtx_setParameter(z, ZSTD_c_contentSizeFlag, 0);
            ZSTD_CCtx_setParameter(z, ZSTD_c_checksumFlag, 1);
            size_t cap = ZSTD_compressBound(sz);
            uint8_t *zb = malloc(cap);
            size_t zn = ZSTD_compress2(z, zb, cap, raw, sz);
            ZSTD_freeCCtx(z);
            KT_REQUIRE(!ZSTD_isError(zn), "compress");
            KT_REQUIRE(ZSTD_getFrameContentSize(zb, zn) == ZSTD_CONTENTSIZE_UNKNOWN, "size recorded");
            kvc_file *f = NULL;
            kv_status st = kvc_open_mem(zb, zn, &f);
            KT_CHECK(st == KV_OK, "%zu bytes: %s", sz, kv_errdetail());
            if (!st) KT_CHECK(kvc_was_zstd(f) && kvc_find(f, "layers.0.v")->nbytes == (sz - 8 - h) / 2, "content");
            kvc_close(f);
            free(zb);
            free(raw);
        }
}

/* A decompression bomb: a valid sample followed, inside the same zstd
 * stream, by 64 MiB of zeros (about 2 KB compressed).  The reader stops
 * one byte past the size the header describes; it used to inflate all of
 * it (up to its 64 GiB cap) before the tiling check refused the file. */
static void test_zstd_bomb_stops_at_the_described_size(void)
{
    size_t len;
    uint8_t *raw = sample_bytes("plain.kvc", &len);
    KT_REQUIRE(raw, "sample");
    ZSTD_CCtx *z = ZSTD_createCCtx();
    size_t cap = 1 << 20, zn = 0;
    uint8_t *zb = malloc(cap), *zeros = calloc(1, 1 << 20);
    ZSTD_inBuffer in = {raw, len, 0};
    ZSTD_outBuffer out = {zb, cap, 0};
    while (in.pos < in.size) ZSTD_compressStream2(z, &out, &in, ZSTD_e_continue);
    for (int i = 0; i < 64; i++) {
        in = (ZSTD_inBuffer){zeros, 1 << 20, 0};
        while (in.pos < in.size) ZSTD_compressStream2(z, &out, &in, ZSTD_e_continue);
    }
    in = (ZSTD_inBuffer){NULL, 0, 0};
    while (ZSTD_compressStream2(z, &out, &in, ZSTD_e_end) != 0) {}
    zn = out.pos;
    ZSTD_freeCCtx(z);
    KT_REQUIRE(zn < 64 * 1024, "bomb is %zu bytes", zn);
    kvc_file *f = NULL;
    kv_status st = kvc_open_mem(zb, zn, &f);
    KT_CHECK(st == KV_E_DATA && strstr(kv_errdetail(), "header describes"), "status %d: %s", st, kv_errdetail());
    kvc_close(f);
    free(zb);
    free(zeros);
    free(raw);
}

/* A pipe that delivers a valid file and then runs on: the reader takes what
 * the header describes plus one byte and stops (it read to end of input). */
static void test_pipe_is_read_only_as_far_as_the_header_says(void)
{
    size_t len;
    uint8_t *raw = sample_bytes("plain.kvc", &len);
    KT_REQUIRE(raw, "sample");
    for (int zstd = 0; zstd < 2; zstd++) {
        int pfd[2];
        KT_REQUIRE(pipe(pfd) == 0, "pipe");
        pid_t pid = fork();
        KT_REQUIRE(pid >= 0, "fork");
        if (pid == 0) { /* writer: the file (or its zstd form), then 256 MiB */
            close(pfd[0]);
            signal(SIGPIPE, SIG_DFL);
            static uint8_t junk[1 << 16];
            if (zstd) {
                size_t zc = ZSTD_compressBound(len);
                uint8_t *zb = malloc(zc);
                size_t zn = ZSTD_compress(zb, zc, raw, len, 1);
                if (write(pfd[1], zb, zn) != (ssize_t)zn) _exit(1);
            } else if (write(pfd[1], raw, len) != (ssize_t)len) {
                _exit(1);
            }
            for (int i = 0; i < 4096; i++)
                if (write(pfd[1], junk, sizeof junk) < 0) _exit(2);
            _exit(0);
        }
        close(pfd[1]);
        kvc_file *f = NULL;
        char dev[32];
        snprintf(dev, sizeof dev, "/dev/fd/%d", pfd[0]);
        kv_status st = kvc_open(dev, &f);
        close(pfd[0]);
        int ws = 0;
        waitpid(pid, &ws, 0);
        KT_CHECK(st == KV_E_DATA, "%s: status %d: %s", zstd ? "zstd" : "plain", st, kv_errdetail());
        /* the writer was cut off by the closed pipe: the reader stopped early */
        KT_CHECK(WIFSIGNALED(ws) || (WIFEXITED(ws) && WEXITSTATUS(ws) == 2), "%s: the reader drained "
                 "the whole pipe (writer status %d)", zstd ? "zstd" : "plain", ws);
        kvc_close(f);
    }
    free(raw);
}

// --- atomic output ---------------------------------------------------------

static void test_atomic_write_leaves_nothing_on_failure(void)
{
    char dir[300], path[340];
    tmp_path(dir, sizeof dir, "atomic");
    int mk = mkdir(dir, 0755);
    KT_REQUIRE(mk == 0, "mkdir %s", dir);
    snprintf(path, sizeof path, "%s/out.kvc", dir);
    FILE *fp = fopen(path, "w");
    KT_REQUIRE(fp != NULL, "pre-existing output");
    fputs("old", fp);
    fclose(fp);

    /* A file-size limit makes the write fail part-way (even for root). */
    kvc_writer *w;
    REQUIRE_OK(kvc_writer_new(&w));
    static uint8_t big[1 << 18];
    int64_t shape[1] = {sizeof big};
    KT_CHECK(kvc_writer_add(w, "layers.0.k.blob", KV_DT_U8, 1, shape, big) == KV_OK, "add");
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = 4096;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    int rl = setrlimit(RLIMIT_FSIZE, &lim);
    KT_REQUIRE(rl == 0, "setrlimit");
    kv_status st = kvc_writer_write(w, path, 0);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    KT_CHECK(st == KV_E_IO, "status %d: %s", st, kv_errdetail());
    KT_CHECK(count_dir_entries(dir) == 1, "%d entries: temp file left behind", count_dir_entries(dir));
    size_t len;
    uint8_t *b = kt_slurp(path, &len);
    KT_CHECK(b && len == 3 && !memcmp(b, "old", 3), "old output untouched");
    free(b);

    /* A directory that does not exist: cannot create, nothing written. */
    char bad[360];
    snprintf(bad, sizeof bad, "%s/no/such/dir/x.kvc", dir);
    KT_CHECK(kvc_writer_write(w, bad, 0) == KV_E_CANTCREATE, "missing dir: %s", kv_errdetail());
    KT_CHECK(count_dir_entries(dir) == 1, "still one entry");
    kvc_writer_free(w);
    unlink(path);
    rmdir(dir);
}

static void test_outfile_commit_and_abort(void)
{
    char dir[300], path[340];
    tmp_path(dir, sizeof dir, "outfile");
    int mk = mkdir(dir, 0755);
    KT_REQUIRE(mk == 0, "mkdir %s", dir);
    snprintf(path, sizeof path, "%s/report.json", dir);
    kv_outfile o;
    REQUIRE_OK(kv_outfile_open(&o, path));
    fputs("{}\n", o.fp);
    KT_CHECK(access(path, F_OK) != 0, "nothing at the final path before commit");
    kv_outfile_abort(&o);
    KT_CHECK(count_dir_entries(dir) == 0, "abort leaves nothing (%d entries)", count_dir_entries(dir));

    mode_t um = umask(022);
    REQUIRE_OK(kv_outfile_open(&o, path));
    fputs("{}\n", o.fp);
    KT_CHECK(kv_outfile_commit(&o) == KV_OK, "commit: %s", kv_errdetail());
    umask(um);
    struct stat sb;
    KT_CHECK(stat(path, &sb) == 0 && sb.st_size == 3 && (sb.st_mode & 0777) == 0644, "committed file, mode %o",
             (unsigned)(sb.st_mode & 0777));
    KT_CHECK(count_dir_entries(dir) == 1, "only the output");
    /* Devices are written in place, never replaced. */
    KT_CHECK(kv_outfile_open(&o, "/dev/null") == KV_OK && kv_outfile_commit(&o) == KV_OK, "/dev/null");
    struct stat dn;
    KT_CHECK(stat("/dev/null", &dn) == 0 && S_ISCHR(dn.st_mode), "/dev/null still a device");
    KT_CHECK(kv_outfile_open(&o, dir) == KV_E_CANTCREATE, "a directory is refused");
    /* Through a symlink: the target gets the new content, the link stays. */
    char link[360];
    snprintf(link, sizeof link, "%s/link.json", dir);
    KT_CHECK(symlink("report.json", link) == 0, "symlink");
    REQUIRE_OK(kv_outfile_open(&o, link));
    fputs("{\"new\": 1}\n", o.fp);
    KT_CHECK(kv_outfile_commit(&o) == KV_OK, "commit through link");
    struct stat ls;
    KT_CHECK(lstat(link, &ls) == 0 && S_ISLNK(ls.st_mode), "link still a link");
    KT_CHECK(stat(path, &sb) == 0 && sb.st_size == 11, "target rewritten (%lld bytes)", (long long)sb.st_size);
    unlink(link);
    unlink(path);
    rmdir(dir);
}

// --- reader robustness -------------------------------------------------------

static void test_open_missing_file_is_noinput(void)
{
    kvc_file *f;
    KT_CHECK(kvc_open("/nonexistent/x.kvc", &f) == KV_E_NOINPUT, "missing");
    KT_CHECK(f == NULL, "no handle");
    KT_CHECK(kvc_open("/", &f) == KV_E_NOINPUT, "directory");
}

static void test_every_truncation_fails_cleanly(void)
{
    size_t len;
    uint8_t *b = sample_bytes("sample.kvc", &len);
    KT_REQUIRE(b != NULL, "slurp");
    int bad = 0;
    for (size_t n = 0; n < len; n++) {
        kvc_file *f = NULL;
        kv_errclear();
        kv_status st = kvc_open_mem(b, n, &f);
        if (st != KV_E_DATA || f != NULL || !kv_errdetail()[0]) {
            if (bad++ < 5) KT_CHECK(0, "truncated to %zu of %zu: status %d '%s'", n, len, st, kv_errdetail());
            kvc_close(f);
        }
    }
    KT_CHECK(bad == 0, "%d truncations not rejected", bad);
    kvc_file *f;
    KT_CHECK(kvc_open_mem(b, len, &f) == KV_OK, "whole file opens");
    kvc_close(f);
    free(b);
}

/* kvc_open_view: the tensors point into the caller's buffer (no copy);
 * a flipped data byte is not recomputed (the caller's whole-buffer sum
 * covers it) but a malformed checksum entry and a truncation are still
 * refused, and kvc_close leaves the buffer alone. */
static void test_open_view_reads_in_place_and_trusts_only_the_sums(void)
{
    size_t len;
    uint8_t *b = sample_bytes("sample.kvc", &len);
    KT_REQUIRE(b != NULL, "slurp");
    kvc_file *f = NULL;
    KT_CHECK(kvc_open_view(b, len, &f) == KV_OK, "view opens: %s", kv_errdetail());
    const kvc_tensor *t = f ? kvc_layer(f, 0, "k") : NULL;
    KT_CHECK(t && (const uint8_t *)t->data >= b && (const uint8_t *)t->data < b + len, "tensor data in the buffer");
    KT_CHECK(f && kvc_has_checksums(f), "checksums still parsed");
    kvc_close(f);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | b[i];
    b[len - 1] ^= 1; /* the last data byte */
    f = NULL;
    KT_CHECK(kvc_open_view(b, len, &f) == KV_OK, "a data flip is the caller's to catch");
    kvc_close(f);
    f = NULL;
    KT_CHECK(kvc_open_mem(b, len, &f) == KV_E_DATA, "kvc_open_mem still recomputes");
    kvc_close(f);
    b[len - 1] ^= 1;
    f = NULL;
    KT_CHECK(kvc_open_view(b, len - 1, &f) == KV_E_DATA && !f, "truncated view refused");
    /* a checksum value made malformed in the header: still refused */
    char *at = memmem(b + 8, (size_t)n, "\"crc32c.", 8);
    KT_REQUIRE(at != NULL, "a crc32c key in the header");
    char *colon = memchr(at, ':', (size_t)(b + 8 + n - (uint8_t *)at));
    KT_REQUIRE(colon && colon[1] == '"', "its value");
    colon[2] = 'Z';
    f = NULL;
    KT_CHECK(kvc_open_view(b, len, &f) == KV_E_DATA && strstr(kv_errdetail(), "hex"), "malformed sum: %s",
             kv_errdetail());
    kvc_close(f);
    free(b);
}

/* kvc_open_head: the header alone gives every tensor's place and stored
 * checksum as a whole open does, with no data; a header cut short, a file
 * length that the tensors do not tile, and a compressed file are refused,
 * and a flip anywhere in the header never crashes it. */
static void test_open_head_reads_the_layout_alone(void)
{
    size_t len;
    uint8_t *b = sample_bytes("sample.kvc", &len);
    KT_REQUIRE(b != NULL, "slurp");
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | b[i];
    kvc_file *full = NULL, *h = NULL;
    KT_REQUIRE(kvc_open_mem(b, len, &full) == KV_OK, "whole open");
    KT_CHECK(kvc_open_head(b, (size_t)(8 + n), len, &h) == KV_OK, "header open: %s", kv_errdetail());
    KT_REQUIRE(h != NULL, "a file");
    KT_CHECK(kvc_n_tensors(h) == kvc_n_tensors(full) && kvc_data_start(h) == 8 + n && kvc_data_start(full) == 8 + n,
             "same tensors, data at 8 + n");
    int same = 0;
    for (int i = 0; i < kvc_n_tensors(full); i++) {
        const kvc_tensor *a = kvc_tensor_at(full, i), *c = kvc_find(h, a->name);
        same += c && !c->data && c->offset == a->offset && c->nbytes == a->nbytes && c->has_crc == a->has_crc &&
                c->crc == a->crc && !memcmp(a->data, b + 8 + n + c->offset, (size_t)c->nbytes);
    }
    KT_CHECK(same == kvc_n_tensors(full), "%d of %d tensors agree", same, kvc_n_tensors(full));
    KT_CHECK(kvc_geom(h)->n_layers == kvc_geom(full)->n_layers && kvc_geom(h)->n_tokens == kvc_geom(full)->n_tokens,
             "same geometry");
    /* the data readers refuse a tensor without bytes, never read through NULL */
    int32_t *ids = NULL;
    int nid = -1;
    KT_CHECK(kvc_tokens(h, &ids, &nid) == KV_E_USAGE && !ids && nid == 0 && strstr(kv_errdetail(), "header alone"),
             "tokens of a header: %s", kv_errdetail());
    const kvc_tensor *k0 = kvc_layer(h, 0, "k");
    float one[1];
    KT_CHECK(k0 && kvc_tensor_to_f32(k0, one) == KV_E_USAGE, "layer 0's K of a header: %s", kv_errdetail());
    kvc_close(h);
    /* more than the header may be given; the data after it is not read */
    h = NULL;
    b[len - 1] ^= 1;
    KT_CHECK(kvc_open_head(b, len, len, &h) == KV_OK, "the whole file as its header");
    b[len - 1] ^= 1;
    kvc_close(h);
    h = NULL;
    KT_CHECK(kvc_open_head(b, (size_t)(8 + n - 1), len, &h) == KV_E_DATA && !h && strstr(kv_errdetail(), "only"),
             "header cut short: %s", kv_errdetail());
    KT_CHECK(kvc_open_head(b, 7, len, &h) == KV_E_DATA && !h, "shorter than the length word");
    KT_CHECK(kvc_open_head(b, (size_t)(8 + n), len - 1, &h) == KV_E_DATA && !h && strstr(kv_errdetail(), "truncated"),
             "a file length the tensors do not tile: %s", kv_errdetail());
    KT_CHECK(kvc_open_head(b, (size_t)(8 + n), len + 64, &h) == KV_E_DATA && !h, "bytes after the last tensor");
    KT_CHECK(kvc_open_head(b, len, len - 1, &h) == KV_E_USAGE && !h, "more header than file");
    for (size_t pos = 0; pos < 8 + n; pos++) { /* flips: refused or read, never a crash */
        b[pos] ^= 0x10;
        h = NULL;
        kv_status st = kvc_open_head(b, (size_t)(8 + n), len, &h);
        KT_CHECK(st == KV_OK || st == KV_E_DATA || st == KV_E_UNSUPPORTED, "header flip at %zu: %d", pos, st);
        kvc_close(h);
        b[pos] ^= 0x10;
    }
    uint8_t *z = NULL;
    size_t zn = 0;
    kvc_writer *w = NULL;
    kv_geom g;
    kv_geom_defaults(&g);
    g.n_layers = 1, g.n_kv_heads = 1, g.head_dim = 4, g.n_tokens = 2;
    float kv[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int64_t sh[3] = {1, 2, 4};
    KT_REQUIRE(kvc_writer_new(&w) == KV_OK && kvc_writer_geom(w, &g) == KV_OK &&
                   kvc_writer_add(w, "layers.0.k", KV_DT_F32, 3, sh, kv) == KV_OK &&
                   kvc_writer_add(w, "layers.0.v", KV_DT_F32, 3, sh, kv) == KV_OK &&
                   kvc_writer_write_mem(w, 3, &z, &zn) == KV_OK, "a compressed file");
    h = NULL;
    KT_CHECK(kvc_open_head(z, zn, zn, &h) == KV_E_UNSUPPORTED && !h, "compressed: %s", kv_errdetail());
    kvc_writer_free(w);
    free(z);
    kvc_close(full);
    free(b);
}

static void test_bit_flips_in_data_are_caught(void)
{
    size_t len;
    uint8_t *b = sample_bytes("sample.kvc", &len);
    KT_REQUIRE(b != NULL, "slurp");
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | b[i];
    int missed = 0;
    for (size_t pos = 8 + n; pos < len; pos++) {
        int bit = (int)(kt_rand(&seed) * 8);
        b[pos] ^= (uint8_t)(1u << bit);
        kvc_file *f = NULL;
        kv_status st = kvc_open_mem(b, len, &f);
        if (st != KV_E_DATA || !strstr(kv_errdetail(), "checksum mismatch")) missed++;
        kvc_close(f);
        b[pos] ^= (uint8_t)(1u << bit);
    }
    KT_CHECK(missed == 0, "%d flips not caught", missed);
    /* Flips in the header must never crash (what they mean varies). */
    for (size_t pos = 0; pos < 8 + n; pos++) {
        b[pos] ^= 0x10;
        kvc_file *f = NULL;
        kv_status st = kvc_open_mem(b, len, &f);
        KT_CHECK(st == KV_OK || st == KV_E_DATA || st == KV_E_UNSUPPORTED, "header flip at %zu: %d", pos, st);
        kvc_close(f);
        b[pos] ^= 0x10;
    }
    free(b);
}

/* One corrupt case: header JSON, data size, expected status and message. */
typedef struct {
    const char *hdr;
    size_t dlen;
    const char *msg;
    kv_status st;
} bad_case;

#define T16(n, a, b) "\"" n "\":{\"dtype\":\"F16\",\"shape\":[1,2,2],\"data_offsets\":[" #a "," #b "]}"
#define KV0 T16("layers.0.k", 0, 8) "," T16("layers.0.v", 8, 16)

static const bad_case bad_cases[] = {
    {"{" KV0 ",}", 16, "malformed JSON", KV_E_DATA},
    {"[1,2,3]", 0, "not a JSON object", KV_E_DATA},
    {"{" KV0 "} x", 16, "garbage after the JSON header", KV_E_DATA},
    {"{\"__metadata__\":{\"a\":1}," KV0 "}", 16, "is not a string", KV_E_DATA},
    {"{\"__metadata__\":[]," KV0 "}", 16, "__metadata__ is not a JSON object", KV_E_DATA},
    {"{" KV0 ",\"x\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[16,24]}}", 24, "unknown dtype 'F64'", KV_E_DATA},
    {"{" KV0 ",\"x\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[16,16]}}", 16, "negative dimension", KV_E_DATA},
    {"{" KV0 ",\"x\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1],\"data_offsets\":[16,17]}}", 17, "5 dimensions", KV_E_DATA},
    {"{" KV0 ",\"x\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[16,17]}}", 17, "not a non-negative integer", KV_E_DATA},
    {"{" KV0 ",\"x\":{\"dtype\":\"U8\",\"shape\":[2147483647,2147483647,2147483647],\"data_offsets\":[16,17]}}", 17,
     "overflows", KV_E_DATA},
    {"{" T16("layers.0.k", 0, 6) "," T16("layers.0.v", 6, 14) "}", 14, "needs 8", KV_E_DATA},
    {"{" T16("layers.0.k", 8, 0) "," T16("layers.0.v", 8, 16) "}", 16, "out of order", KV_E_DATA},
    {"{" T16("layers.0.k", 0, 8) "," T16("layers.0.v", 4, 12) "}", 12, "overlaps", KV_E_DATA},
    {"{" T16("layers.0.k", 0, 8) "," T16("layers.0.v", 10, 18) "}", 18, "hole of 2 bytes", KV_E_DATA},
    {"{" KV0 "}", 20, "4 bytes after the last tensor", KV_E_DATA},
    {"{" KV0 "," T16("layers.0.k", 16, 24) "}", 24, "duplicate tensor name layers.0.k", KV_E_DATA},
    {"{\"__metadata__\":{\"crc32c.layers.0.k\":\"00000001\"}," KV0 "}", 16, "checksum mismatch", KV_E_DATA},
    {"{\"__metadata__\":{\"crc32c.layers.0.k\":\"ABCDEF01\"}," KV0 "}", 16, "8 lowercase hex", KV_E_DATA},
    {"{\"__metadata__\":{\"crc32c.nope\":\"00000000\"}," KV0 "}", 16, "does not exist", KV_E_DATA},
    {"{\"__metadata__\":{\"kvc.version\":\"2\"}," KV0 "}", 16, "kvc version 2", KV_E_UNSUPPORTED},
    {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "not a KV cache", KV_E_DATA},
    {"{" T16("layers.0.k", 0, 8) "}", 8, "layer 0 has no values", KV_E_DATA},
    {"{" KV0 "," T16("layers.2.k", 16, 24) "," T16("layers.2.v", 24, 32) "}", 32, "layer 1 has no keys", KV_E_DATA},
    {"{" KV0 ",\"layers.1.k\":{\"dtype\":\"F16\",\"shape\":[1,3,2],\"data_offsets\":[16,28]}," T16("layers.1.v", 28, 36) "}",
     36, "inconsistent geometry", KV_E_DATA},
    {"{" KV0 ",\"tokens\":{\"dtype\":\"I32\",\"shape\":[3],\"data_offsets\":[16,28]}}", 28,
     "tokens has 3 entries but the cache has 2", KV_E_DATA},
    {"{" KV0 ",\"layers.0.q\":{\"dtype\":\"F16\",\"shape\":[2,1,4],\"data_offsets\":[16,32]}}", 32,
     "head dim 4 but the keys have 2", KV_E_DATA},
    {"{" KV0 ",\"layers.0.q\":{\"dtype\":\"F16\",\"shape\":[3,1,2],\"data_offsets\":[16,28]}," T16("layers.1.k", 28, 36) "," T16("layers.1.v", 36, 44) "}",
     44, "layer 1 has no queries", KV_E_DATA},
    {"{\"__metadata__\":{\"kvc.n_heads\":\"3\",\"kvc.n_kv_heads\":\"2\"},"
     "\"layers.0.k\":{\"dtype\":\"F16\",\"shape\":[2,1,2],\"data_offsets\":[0,8]},"
     "\"layers.0.v\":{\"dtype\":\"F16\",\"shape\":[2,1,2],\"data_offsets\":[8,16]}}", 16,
     "not a multiple of 2 kv heads", KV_E_DATA},
    {"{\"__metadata__\":{\"kvc.head_dim\":\"4\"}," KV0 "}", 16, "metadata kvc.head_dim=4 but the tensors have 2",
     KV_E_DATA},
    {"{\"__metadata__\":{\"kvc.n_layers\":\"2\"}," KV0 "}", 16, "describe 1 layers", KV_E_DATA},
    {"{\"__metadata__\":{\"kvc.rope_layout\":\"diagonal\"}," KV0 "}", 16, "rope_layout", KV_E_DATA},
    {"{\"__metadata__\":{\"layers.0.k.encoding\":\"kivi\"}," KV0 "}", 16, "is a plain F16 tensor", KV_E_DATA},
    /* KIVI keys: T 2 (codes 0 rows + resid 2), bits 4, G 1, R 0 -> Tq should be 2. */
    {"{\"__metadata__\":{\"layers.0.k.encoding\":\"kivi\",\"layers.0.k.bits\":\"4\",\"layers.0.k.group\":\"1\","
     "\"layers.0.k.residual\":\"0\"},"
     "\"layers.0.k.codes\":{\"dtype\":\"U8\",\"shape\":[1,0,1],\"data_offsets\":[0,0]},"
     "\"layers.0.k.scale\":{\"dtype\":\"F16\",\"shape\":[1,0,2],\"data_offsets\":[0,0]},"
     "\"layers.0.k.zero\":{\"dtype\":\"F16\",\"shape\":[1,0,2],\"data_offsets\":[0,0]},"
     "\"layers.0.k.resid\":{\"dtype\":\"F16\",\"shape\":[1,2,2],\"data_offsets\":[0,8]}," T16("layers.0.v", 8, 16) "}",
     16, "quantizes 2", KV_E_DATA},
    {"{\"__metadata__\":{\"layers.0.k.encoding\":\"kivi\",\"layers.0.k.bits\":\"2\",\"layers.0.k.group\":\"1\"},"
     T16("layers.0.v", 0, 8) "}", 8, "needs metadata layers.0.k.residual", KV_E_DATA},
    {"{\"__metadata__\":{\"layers.0.k.encoding\":\"zip\"}," T16("layers.0.v", 0, 8) "}", 8, "not a known encoding",
     KV_E_DATA},
};

static void test_corrupt_headers_get_specific_messages(void)
{
    uint8_t data[64] = {0};
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const bad_case *c = &bad_cases[i];
        size_t len;
        uint8_t *b = raw_file(c->hdr, data, c->dlen, &len);
        kvc_file *f = NULL;
        kv_errclear();
        kv_status st = kvc_open_mem(b, len, &f);
        KT_CHECK(st == c->st && strstr(kv_errdetail(), c->msg), "case %zu: status %d '%s', want '%s'", i, st,
                 kv_errdetail(), c->msg);
        kvc_close(f);
        free(b);
    }
    /* The header length itself. */
    uint8_t b[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}'};
    kvc_file *f;
    KT_CHECK(kvc_open_mem(b, 10, &f) == KV_E_DATA && strstr(kv_errdetail(), "absurd"), "%s", kv_errdetail());
    b[0] = 100, memset(b + 1, 0, 7);
    KT_CHECK(kvc_open_mem(b, 10, &f) == KV_E_DATA && strstr(kv_errdetail(), "past end of file"), "%s",
             kv_errdetail());
    KT_CHECK(kvc_open_mem(b, 0, &f) == KV_E_DATA && strstr(kv_errdetail(), "empty file"), "%s", kv_errdetail());
    b[0] = 2, b[9] = 0;
    KT_CHECK(kvc_open_mem(b, 10, &f) == KV_E_DATA && strstr(kv_errdetail(), "NUL"), "%s", kv_errdetail());
}

static void test_unaligned_foreign_file_reads(void)
{
    /* A safetensors writer that puts F16 first leaves F32 data unaligned. */
    const char *hdr =
        "{\"layers.0.k\":{\"dtype\":\"F16\",\"shape\":[1,1,1],\"data_offsets\":[0,2]},"
        "\"layers.0.v\":{\"dtype\":\"F32\",\"shape\":[1,1,1],\"data_offsets\":[2,6]}}";
    uint8_t data[6];
    kv_half h = kv_f32_to_half(1.5f);
    float v = -2.25f;
    memcpy(data, &h, 2);
    memcpy(data + 2, &v, 4);
    size_t len;
    uint8_t *b = raw_file(hdr, data, 6, &len);
    kvc_file *f;
    REQUIRE_OK(kvc_open_mem(b, len, &f));
    float out;
    KT_CHECK(kvc_tensor_to_f32(kvc_layer(f, 0, "v"), &out) == KV_OK && out == -2.25f, "unaligned F32");
    KT_CHECK(kvc_tensor_to_f32(kvc_layer(f, 0, "k"), &out) == KV_OK && out == 1.5f, "F16");
    kvc_close(f);
    free(b);
}


static void test_writer_streams_to_stdout(void)
{
    char path[300];
    tmp_path(path, sizeof path, "stdout.kvc");
    kvc_writer *w;
    REQUIRE_OK(kvc_writer_new(&w));
    KT_CHECK(add_float(w, "layers.0.k", KV_DT_F16, 1, 3, 2, 0, 0) == KV_OK, "k");
    KT_CHECK(add_float(w, "layers.0.v", KV_DT_F16, 1, 3, 2, 0, 1) == KV_OK, "v");
    /* Point stdout (the TAP stream) at a file for the duration. */
    fflush(stdout);
    int saved = dup(1);
    FILE *fp = fopen(path, "wb");
    KT_REQUIRE(saved >= 0 && fp != NULL, "redirect");
    dup2(fileno(fp), 1);
    kv_status st = kvc_writer_write(w, "-", 0);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    fclose(fp);
    kvc_writer_free(w);
    KT_CHECK(st == KV_OK, "write to stdout: %s", kv_errdetail());
    kvc_file *f;
    REQUIRE_OK(kvc_open(path, &f));
    KT_CHECK(kvc_geom(f)->n_tokens == 3 && kvc_has_checksums(f), "read back");
    kvc_close(f);
}

static void test_cleanup_all_removes_temp_files(void)
{
    char dir[300], path[340];
    tmp_path(dir, sizeof dir, "cleanup");
    int mk = mkdir(dir, 0755);
    KT_REQUIRE(mk == 0, "mkdir");
    snprintf(path, sizeof path, "%s/out.json", dir);
    kv_outfile o;
    REQUIRE_OK(kv_outfile_open(&o, path));
    KT_CHECK(count_dir_entries(dir) == 1, "temp file exists while writing");
    kv_outfile_cleanup_all(); /* what a SIGINT handler does */
    KT_CHECK(count_dir_entries(dir) == 0, "temp file removed");
    kv_outfile_abort(&o);
    rmdir(dir);
}

/* A DSQ key layer (H 1, T 10, D 4, window 8, 2 salient, 2 bits, group 4)
 * beside plain F16 values; mask_byte sets the salient tokens of the window,
 * skip names a part to leave out. */
static kv_status open_dsq(uint8_t mask_byte, const char *skip, kvc_file **out)
{
    kvc_writer *w;
    kv_status st = kvc_writer_new(&w);
    if (st) return st;
    static const uint8_t zeros[256];
    const struct {
        const char *name;
        kv_dtype dt;
        int nd;
        int64_t shape[4];
    } parts[] = {
        {"layers.0.k.mask", KV_DT_U8, 3, {1, 1, 1}},        {"layers.0.k.sal", KV_DT_I8, 4, {1, 1, 2, 4}},
        {"layers.0.k.sscale", KV_DT_F16, 3, {1, 1, 4}},     {"layers.0.k.base", KV_DT_F16, 3, {1, 1, 4}},
        {"layers.0.k.codes", KV_DT_U8, 4, {1, 1, 6, 1}},    {"layers.0.k.scale", KV_DT_F16, 4, {1, 1, 6, 1}},
        {"layers.0.k.zero", KV_DT_F16, 4, {1, 1, 6, 1}},    {"layers.0.k.resid", KV_DT_F16, 3, {1, 2, 4}},
        {"layers.0.v", KV_DT_F16, 3, {1, 10, 4}},
    };
    const char *meta[][2] = {{"layers.0.k.encoding", "dsq"}, {"layers.0.k.window", "8"},
                             {"layers.0.k.salient", "2"}, {"layers.0.k.bits", "2"}, {"layers.0.k.group", "4"}};
    for (size_t i = 0; i < sizeof meta / sizeof meta[0] && !st; i++) st = kvc_writer_meta(w, meta[i][0], meta[i][1]);
    for (size_t i = 0; i < sizeof parts / sizeof parts[0] && !st; i++) {
        if (skip && !strcmp(parts[i].name, skip)) continue;
        const void *d = i == 0 ? (const void *)&mask_byte : zeros;
        st = kvc_writer_add_copy(w, parts[i].name, parts[i].dt, parts[i].nd, parts[i].shape, d);
    }
    char path[300];
    tmp_path(path, sizeof path, "dsq.kvc");
    if (!st) st = kvc_writer_write(w, path, 0);
    kvc_writer_free(w);
    return st ? st : kvc_open(path, out);
}

static void test_dsq_layer_is_validated(void)
{
    kvc_file *f = NULL;
    REQUIRE_OK(open_dsq(0x81, NULL, &f));
    const kv_geom *g = kvc_geom(f);
    KT_CHECK(g->n_tokens == 10 && g->head_dim == 4 && g->n_kv_heads == 1, "geometry from dsq parts");
    KT_CHECK(!strcmp(kvc_layer_encoding(f, 0, 'k'), "dsq") && !strcmp(kvc_layer_encoding(f, 0, 'v'), "f16"),
             "encodings");
    kvc_close(f);
    f = NULL;
    KT_CHECK(open_dsq(0x07, NULL, &f) == KV_E_DATA && strstr(kv_errdetail(), "marks 3 salient tokens, not 2"),
             "%s", kv_errdetail());
    kvc_close(f);
    f = NULL;
    KT_CHECK(open_dsq(0x03, "layers.0.k.base", &f) == KV_E_DATA && strstr(kv_errdetail(), "lack layers.0.k.base"),
             "%s", kv_errdetail());
    kvc_close(f);
}

int main(int argc, char **argv)
{
    if (argc >= 3 && !strcmp(argv[1], "--write-sample")) {
        int z = argc >= 4 && !strcmp(argv[3], "--zstd") ? 3 : 0;
        kv_status st = write_sample(argv[2], z);
        if (st) fprintf(stderr, "test_kvc: %s: %s\n", argv[2], kv_errdetail());
        return st ? kv_status_exit(st) : 0;
    }
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/test_kvc.XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    KT_RUN(test_crc32c_known_answer);
    KT_RUN(test_crc32c_combine_equals_the_whole);
    KT_RUN(test_crc32c_matches_bitwise_reference);
    KT_RUN(test_roundtrip_every_dtype);
    KT_RUN(test_roundtrip_metadata_and_geometry);
    KT_RUN(test_geometry_derived_without_metadata);
    KT_RUN(test_zstd_roundtrip);
    KT_RUN(test_zstd_without_content_size_at_buffer_sizes);
    KT_RUN(test_zstd_bomb_stops_at_the_described_size);
    KT_RUN(test_pipe_is_read_only_as_far_as_the_header_says);
    KT_RUN(test_atomic_write_leaves_nothing_on_failure);
    KT_RUN(test_outfile_commit_and_abort);
    KT_RUN(test_open_missing_file_is_noinput);
    KT_RUN(test_every_truncation_fails_cleanly);
    KT_RUN(test_bit_flips_in_data_are_caught);
    KT_RUN(test_corrupt_headers_get_specific_messages);
    KT_RUN(test_unaligned_foreign_file_reads);
    KT_RUN(test_dsq_layer_is_validated);
    KT_RUN(test_writer_streams_to_stdout);
    KT_RUN(test_cleanup_all_removes_temp_files);
    KT_RUN(test_crc32c_three_lanes_match_the_table);
    KT_RUN(test_open_view_reads_in_place_and_trusts_only_the_sums);
    KT_RUN(test_open_head_reads_the_layout_alone);
    if (kt_rm_rf(tmpdir) != 0) fprintf(stderr, "test_kvc: could not remove %s\n", tmpdir);
    return kt_done();
}
