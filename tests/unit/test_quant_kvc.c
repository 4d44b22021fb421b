/*
 * Unit tests of packed layers in .kvc files (lib/quant/kv_quant.c): KIVI and DSQ
 * parts written with kv_kivi_write / kv_dsq_write decode exactly after a
 * file round trip, byte counts match the layout formulas, inconsistent DSQ
 * parts are rejected with KV_E_DATA, and kv_quant_file transcodes a file
 * (selected layers, decode, report).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt.h"
#include "quant/kv_quant.h"

#define KT_OK(call)                                                              \
    do {                                                                         \
        kv_status st_ = (call);                                                  \
        KT_REQUIRE(st_ == KV_OK, "%s: %s", #call, kv_errdetail());               \
    } while (0)

static unsigned long long seed = 0x5151515151515151ULL;
enum { H = 2, T = 150, D = 32 };
static float xk[H * T * D], xv[H * T * D];

static void fill(void)
{
    for (int i = 0; i < H * T * D; i++) {
        xk[i] = kt_randn(&seed) + (i % D == 4 ? 5.0f : 0.0f);
        xv[i] = kt_randn(&seed);
    }
}

static kv_geom geom(int layers)
{
    kv_geom g;
    memset(&g, 0, sizeof g);
    kv_geom_defaults(&g);
    g.n_layers = layers;
    g.n_kv_heads = H;
    g.head_dim = D;
    g.n_tokens = T;
    return g;
}

/* Write w to a temp file and open it (NULL on failure, detail kept). */
static kvc_file *reopen(kvc_writer *w, char *path)
{
    strcpy(path, "/tmp/kvtest_qkvc_XXXXXX");
    int fd = mkstemp(path);
    if (fd < 0) return NULL;
    close(fd);
    kvc_file *f = NULL;
    if (kvc_writer_write(w, path, 0) || kvc_open(path, &f)) f = NULL;
    return f;
}

static void test_kivi_and_dsq_layers_round_trip(void)
{
    fill();
    kv_kivi_params kp = {2, 32, 40};
    kv_dsq_params dp;
    kv_dsq_params_default(&dp);
    kv_kivi_packed k0, v0;
    kv_dsq_packed k1, v1;
    KT_OK(kv_kivi_pack(xk, KV_KIVI_KEYS, &kp, H, T, D, &k0));
    KT_OK(kv_kivi_pack(xv, KV_KIVI_VALUES, &kp, H, T, D, &v0));
    KT_OK(kv_dsq_pack(xk, NULL, KV_KIVI_KEYS, &dp, H, T, D, &k1));
    KT_OK(kv_dsq_pack(xv, NULL, KV_KIVI_VALUES, &dp, H, T, D, &v1));
    kvc_writer *w;
    KT_OK(kvc_writer_new(&w));
    kv_geom g = geom(2);
    KT_OK(kvc_writer_geom(w, &g));
    KT_OK(kv_kivi_write(w, 0, 'k', &k0));
    KT_OK(kv_kivi_write(w, 0, 'v', &v0));
    KT_OK(kv_dsq_write(w, 1, 'k', &k1));
    KT_OK(kv_dsq_write(w, 1, 'v', &v1));
    char path[64];
    kvc_file *f = reopen(w, path);
    kvc_writer_free(w);
    KT_REQUIRE(f, "reopen: %s", kv_errdetail());
    static float got[H * T * D], want[H * T * D];
    kv_encoding e;
    KT_OK(kv_layer_encoding(f, 1, 'v', &e));
    KT_CHECK(e == KV_ENC_DSQ, "encoding %d", e);
    struct { int layer; char which; } parts[] = {{0, 'k'}, {0, 'v'}, {1, 'k'}, {1, 'v'}};
    for (int i = 0; i < 4; i++) {
        KT_OK(kv_layer_decode(f, parts[i].layer, parts[i].which, got));
        size_t bytes;
        if (i == 0) kv_kivi_unpack(&k0, want), bytes = kv_kivi_bytes(KV_KIVI_KEYS, &kp, H, T, D);
        else if (i == 1) kv_kivi_unpack(&v0, want), bytes = kv_kivi_bytes(KV_KIVI_VALUES, &kp, H, T, D);
        else if (i == 2) kv_dsq_unpack(&k1, want), bytes = kv_dsq_bytes(KV_KIVI_KEYS, &dp, H, T, D);
        else kv_dsq_unpack(&v1, want), bytes = kv_dsq_bytes(KV_KIVI_VALUES, &dp, H, T, D);
        KT_CHECK(!memcmp(got, want, sizeof got), "part %d decodes differently", i);
        KT_CHECK(kv_layer_bytes(f, parts[i].layer, parts[i].which) == bytes, "part %d bytes %llu vs %zu",
                 i, (unsigned long long)kv_layer_bytes(f, parts[i].layer, parts[i].which), bytes);
    }
    kvc_close(f);
    unlink(path);
    kv_kivi_clear(&k0);
    kv_kivi_clear(&v0);
    kv_dsq_clear(&k1);
    kv_dsq_clear(&v1);
}

/* A DSQ layer whose part `bad` is replaced by a tampered copy. */
static kv_status open_tampered(const char *bad, const char *meta_key, const char *meta_val)
{
    kv_dsq_params dp;
    kv_dsq_params_default(&dp);
    kv_dsq_packed k1, v1;
    kv_dsq_pack(xk, NULL, KV_KIVI_KEYS, &dp, H, T, D, &k1);
    kv_dsq_pack(xv, NULL, KV_KIVI_VALUES, &dp, H, T, D, &v1);
    kvc_writer *w;
    kvc_writer_new(&w);
    kv_geom g = geom(1);
    kvc_writer_geom(w, &g);
    kv_dsq_packed kb = k1;
    uint8_t mask_bad[H * 2 * 8];
    if (!strcmp(bad, "mask")) {
        memcpy(mask_bad, k1.mask, sizeof mask_bad);
        mask_bad[3] ^= 0x10; /* one salient token too many or too few */
        kb.mask = mask_bad;
    }
    if (!strcmp(bad, "base")) kb.base = NULL; /* keys without their base */
    kv_dsq_write(w, 0, 'k', &kb);
    kv_dsq_write(w, 0, 'v', &v1);
    if (meta_key) kvc_writer_meta(w, meta_key, meta_val);
    char path[64];
    kvc_file *f = reopen(w, path);
    kvc_writer_free(w);
    kv_status st = KV_E_IO;
    if (f) {
        static float out[H * T * D];
        kv_errclear();
        st = kv_layer_decode(f, 0, 'k', out);
        kvc_close(f);
    } else {
        st = KV_E_DATA; /* rejected at open: also fine */
    }
    unlink(path);
    kv_dsq_clear(&k1);
    kv_dsq_clear(&v1);
    return st;
}

static void test_inconsistent_dsq_layers_are_rejected(void)
{
    fill();
    KT_CHECK(open_tampered("none", NULL, NULL) == KV_OK, "untouched: %s", kv_errdetail());
    KT_CHECK(open_tampered("mask", NULL, NULL) == KV_E_DATA, "mask count");
    KT_CHECK(strstr(kv_errdetail(), "salient") != NULL, "message: %s", kv_errdetail());
    KT_CHECK(open_tampered("base", NULL, NULL) == KV_E_DATA, "missing base");
    KT_CHECK(open_tampered("none", "layers.0.k.salient", "12") == KV_E_DATA, "sal shape");
    KT_CHECK(strstr(kv_errdetail(), "shape") != NULL, "message: %s", kv_errdetail());
    KT_CHECK(open_tampered("none", "layers.0.k.window", "6x") == KV_E_DATA, "window not a number");
    KT_CHECK(open_tampered("none", "layers.0.k.bits", "3") == KV_E_DATA, "3 bits");
    KT_CHECK(open_tampered("none", "layers.0.k.group", "12") == KV_E_DATA, "group not dividing D");
}

/* A plain F32 cache of L layers (layer l's K and V are xk and xv, swapped on
 * odd layers), written and reopened from path; NULL on failure. */
static kvc_file *plain_input(int L, char path[64])
{
    fill();
    kvc_writer *w;
    if (kvc_writer_new(&w)) return NULL;
    kv_geom g = geom(L);
    const int64_t s[3] = {H, T, D};
    kv_status st = kvc_writer_geom(w, &g);
    for (int l = 0; l < L && !st; l++) {
        char nk[32], nv[32];
        snprintf(nk, sizeof nk, "layers.%d.k", l);
        snprintf(nv, sizeof nv, "layers.%d.v", l);
        st = kvc_writer_add(w, nk, KV_DT_F32, 3, s, l % 2 ? xv : xk);
        if (!st) st = kvc_writer_add(w, nv, KV_DT_F32, 3, s, l % 2 ? xk : xv);
    }
    kvc_file *f = st ? NULL : reopen(w, path);
    kvc_writer_free(w);
    return f;
}

static void test_transcode_selected_layers_and_decode(void)
{
    kvc_writer *w;
    char p1[64], p2[64];
    kvc_file *f = plain_input(2, p1);
    KT_REQUIRE(f, "input: %s", kv_errdetail());
    bool sel[2] = {false, true};
    kv_quant_opts o;
    memset(&o, 0, sizeof o);
    o.method = KV_ENC_KIVI;
    o.kivi = (kv_kivi_params){1, 32, 0};
    o.layers = sel;
    kv_quant_report r;
    KT_OK(kvc_writer_new(&w));
    KT_OK(kv_quant_file(f, &o, w, &r));
    kvc_file *q = reopen(w, p2);
    kvc_writer_free(w);
    KT_REQUIRE(q, "output: %s", kv_errdetail());
    kv_encoding e0, e1;
    KT_OK(kv_layer_encoding(q, 0, 'k', &e0));
    KT_OK(kv_layer_encoding(q, 1, 'k', &e1));
    KT_CHECK(e0 == KV_ENC_PLAIN && e1 == KV_ENC_KIVI, "encodings %d %d", e0, e1);
    uint64_t plain = 2ull * H * T * D * 4;
    uint64_t packed = kv_kivi_bytes(KV_KIVI_KEYS, &o.kivi, H, T, D) +
                      kv_kivi_bytes(KV_KIVI_VALUES, &o.kivi, H, T, D);
    KT_CHECK(r.kv_bytes_in == 2 * plain && r.kv_bytes_out == plain + packed, "bytes %llu %llu",
             (unsigned long long)r.kv_bytes_in, (unsigned long long)r.kv_bytes_out);
    KT_CHECK(r.k_mse[0] == 0 && r.k_mse[1] > 0 && r.v_max[1] > 0, "errors");
    KT_CHECK(isnan(r.attn_err[1]), "no queries: attention error is NaN");
    kv_quant_report_clear(&r);
    /* decoding gives F16 layers equal to the KIVI decode rounded to fp16 */
    o.decode = true;
    KT_OK(kvc_writer_new(&w));
    KT_OK(kv_quant_file(q, &o, w, &r));
    char p3[64];
    kvc_file *d = reopen(w, p3);
    kvc_writer_free(w);
    KT_REQUIRE(d, "decoded: %s", kv_errdetail());
    const kvc_tensor *t = kvc_layer(d, 1, "k");
    KT_REQUIRE(t && t->dtype == KV_DT_F16, "layers.1.k is F16");
    static float a[H * T * D], b[H * T * D];
    KT_OK(kv_layer_decode(q, 1, 'k', a));
    KT_OK(kv_layer_decode(d, 1, 'k', b));
    int bad = 0;
    for (int i = 0; i < H * T * D; i++) bad += kv_round_half(a[i]) != b[i];
    KT_CHECK(bad == 0, "%d values differ", bad);
    kv_quant_report_clear(&r);
    kvc_close(d);
    kvc_close(q);
    kvc_close(f);
    unlink(p1);
    unlink(p2);
    unlink(p3);
}

/* A whole-file DSQ transcode with its own value bits: bad bits are refused
 * before anything is written, with DSQ's own message; good ones pack the
 * values at them (the bytes say so) and the report names them. */
static void test_whole_file_dsq_value_bits_are_checked_and_used(void)
{
    kvc_writer *w;
    char p1[64];
    kvc_file *f = plain_input(1, p1);
    KT_REQUIRE(f, "input: %s", kv_errdetail());
    kv_quant_opts o;
    memset(&o, 0, sizeof o);
    o.method = KV_ENC_DSQ;
    kv_dsq_params_default(&o.dsq);
    o.dsq.bits = 2;
    o.dsq_vbits = 3;
    kv_quant_report r;
    KT_OK(kvc_writer_new(&w));
    kv_status st = kv_quant_file(f, &o, w, &r);
    KT_CHECK(st == KV_E_USAGE && strstr(kv_errdetail(), "DSQ bits must be 1, 2 or 4, not 3"),
             "value bits 3: status %d, %s", st, kv_errdetail());
    kvc_writer_free(w);
    o.dsq_vbits = 4;
    KT_OK(kvc_writer_new(&w));
    KT_OK(kv_quant_file(f, &o, w, &r));
    kv_dsq_params vp = o.dsq;
    vp.bits = 4;
    uint64_t want = kv_dsq_bytes(KV_KIVI_KEYS, &o.dsq, H, T, D) + kv_dsq_bytes(KV_KIVI_VALUES, &vp, H, T, D);
    KT_CHECK(r.kv_bytes_out == want, "bytes %llu, want %llu (keys 2 bits, values 4)",
             (unsigned long long)r.kv_bytes_out, (unsigned long long)want);
    char rp[64];
    snprintf(rp, sizeof rp, "/tmp/kt_qrep_%d.json", (int)getpid());
    FILE *rf = fopen(rp, "w+");
    KT_REQUIRE(rf, "report file");
    kv_quant_report_json(&r, &o, rf);
    rewind(rf);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, rf);
    buf[n] = 0;
    fclose(rf);
    unlink(rp);
    KT_CHECK(strstr(buf, "\"bits\": 2,") && strstr(buf, "\"vbits\": 4,"), "report names both bits:\n%s", buf);
    kv_quant_report_clear(&r);
    kvc_writer_free(w);
    kvc_close(f);
    unlink(p1);
}

int main(void)
{
    KT_RUN(test_kivi_and_dsq_layers_round_trip);
    KT_RUN(test_inconsistent_dsq_layers_are_rejected);
    KT_RUN(test_transcode_selected_layers_and_decode);
    KT_RUN(test_whole_file_dsq_value_bits_are_checked_and_used);
    return kt_done();
}
