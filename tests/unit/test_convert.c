/*
 * GGUF writing and conversion (lib/format/kv_gguf_write, lib/model/
 * kv_convert): every metadata type round-trips through the reader; the
 * real models converted to each weight type load with that type and
 * compute the logits of the float32 original within the type's error (F32
 * exactly); the qwen2 layout (NEOX q/k rows) computes what the llama
 * layout does; Llama-3.1's rope_freqs give the frequencies of its
 * parameterised rule; the bundled fixtures (niah4k Q4_K, stories260K Q8_0,
 * a qwen2 file with q/k/v biases) load as what they claim; unknown
 * architectures and weight types are refused by name; a tokenizer.json
 * becomes a vocabulary-only GGUF.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kv_file.h"
#include "common/kv_ggml.h"
#include "engine/kv_engine.h"
#include "format/kv_gguf.h"
#include "format/kv_gguf_write.h"
#include "kt_kv.h"
#include "model/kv_convert.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"


static char *tmpname(void)
{
    char *p = strdup("/tmp/kv-test-convert-XXXXXX");
    int fd = mkstemp(p);
    if (fd >= 0) close(fd);
    return p;
}

/* The whole file (NULL when it cannot be read): lib's reader, not a copy. */
/* Logits after each of a few tokens (n positions x vocab). */
static float *logits(const kv_model *m, const int *toks, int n)
{
    kv_engine *e;
    float *out = malloc((size_t)n * (size_t)m->cfg.vocab_size * sizeof *out);
    if (!out || kv_engine_new(m, NULL, 64, &e)) {
        free(out);
        return NULL;
    }
    if (kv_engine_prefill_all(e, toks, n, out)) {
        free(out);
        out = NULL;
    }
    kv_engine_free(e);
    return out;
}

/* Mean KL(softmax(ref) || softmax(x)) over n positions of v logits. */
static double mean_kl(const float *x, const float *ref, int n, int v)
{
    double kl = 0;
    for (int p = 0; p < n; p++) {
        const float *a = ref + (size_t)p * v, *b = x + (size_t)p * v;
        double ma = -INFINITY, mb = -INFINITY, za = 0, zb = 0;
        for (int i = 0; i < v; i++) ma = fmax(ma, a[i]), mb = fmax(mb, b[i]);
        for (int i = 0; i < v; i++) za += exp(a[i] - ma), zb += exp(b[i] - mb);
        for (int i = 0; i < v; i++) {
            double pa = exp(a[i] - ma) / za, lpa = a[i] - ma - log(za), lpb = b[i] - mb - log(zb);
            kl += pa * (lpa - lpb);
        }
    }
    return kl / n;
}

static double max_diff(const float *a, const float *b, size_t n, double *mag)
{
    double d = 0;
    *mag = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        *mag = fmax(*mag, fabs((double)b[i]));
    }
    return d;
}

static void test_writer_round_trips_every_value_type(void)
{
    kv_gguf_writer *w;
    OK(kv_gguf_writer_new(&w));
    const char *strs[3] = {"a", "", "\xe2\x96\x81x"};
    float fv[3] = {1.5f, -2, 1e-7f};
    int32_t iv[2] = {-7, 123456};
    OK(kv_gguf_set_str(w, "s", "hello"));
    OK(kv_gguf_set_u32(w, "u", 4000000000u));
    OK(kv_gguf_set_i32(w, "i", -5));
    OK(kv_gguf_set_f32(w, "f", 0.25f));
    OK(kv_gguf_set_bool(w, "b", true));
    OK(kv_gguf_set_arr_str(w, "as", strs, NULL, 3));
    OK(kv_gguf_set_arr_f32(w, "af", fv, 3));
    OK(kv_gguf_set_arr_i32(w, "ai", iv, 2));
    KT_CHECK(kv_gguf_set_u32(w, "u", 1) == KV_E_USAGE, "a key twice is refused");
    float t1[5] = {1, 2, 3, 4, 5};
    int64_t ne1[1] = {5}, ne2[2] = {256, 2};
    uint8_t q4k[2 * 144];
    for (size_t i = 0; i < sizeof q4k; i++) q4k[i] = (uint8_t)(i * 7);
    OK(kv_gguf_add_tensor(w, "t1", KV_GGML_F32, 1, ne1, t1, sizeof t1));
    OK(kv_gguf_add_tensor(w, "t2", KV_GGML_Q4_K, 2, ne2, q4k, sizeof q4k));
    KT_CHECK(kv_gguf_add_tensor(w, "t3", KV_GGML_Q4_K, 2, ne2, q4k, 100) == KV_E_USAGE, "wrong size refused");
    char *path = tmpname();
    OK(kv_gguf_writer_write(w, path));
    kv_gguf_writer_free(w);
    size_t len;
    char *buf = kt_slurp(path, &len);
    KT_REQUIRE(buf, "read back");
    kv_gguf *g;
    OK(kv_gguf_parse(buf, len, &g));
    char s[16];
    int64_t v;
    double f;
    KT_CHECK(kv_gguf_get_str(g, "s", s, sizeof s, NULL) && !strcmp(s, "hello"), "string");
    KT_CHECK(kv_gguf_get_int(g, "u", &v, NULL) && v == 4000000000ll, "u32");
    KT_CHECK(kv_gguf_get_int(g, "i", &v, NULL) && v == -5, "i32");
    KT_CHECK(kv_gguf_get_float(g, "f", &f, NULL) && f == 0.25, "f32");
    KT_CHECK(kv_gguf_get_int(g, "b", &v, NULL) && v == 1, "bool");
    const kv_gguf_kv *as = kv_gguf_find(g, "as");
    size_t l;
    KT_CHECK(as && as->arr_n == 3 && !memcmp(kv_gguf_arr_str(as, 2, &l), "\xe2\x96\x81x", 4) && l == 4 &&
                 kv_gguf_arr_str(as, 1, &l) && l == 0,
             "string array");
    const kv_gguf_kv *af = kv_gguf_find(g, "af"), *ai = kv_gguf_find(g, "ai");
    KT_CHECK(af && kv_gguf_arr_num(af, 2) == (double)1e-7f && ai && kv_gguf_arr_num(ai, 0) == -7, "number arrays");
    const kv_gguf_tensor *a = kv_gguf_tensor_find(g, "t1"), *b = kv_gguf_tensor_find(g, "t2");
    KT_CHECK(a && !memcmp(a->data, t1, sizeof t1) && ((uintptr_t)a->data - (uintptr_t)buf) % 32 == 0, "F32 tensor");
    KT_CHECK(b && b->ggml_type == KV_GGML_Q4_K && b->nbytes == sizeof q4k && !memcmp(b->data, q4k, sizeof q4k) &&
                 ((uintptr_t)b->data - (uintptr_t)buf) % 32 == 0,
             "Q4_K tensor");
    /* copying every entry gives the same metadata */
    OK(kv_gguf_writer_new(&w));
    for (uint64_t i = 0; i < g->n_kv; i++) OK(kv_gguf_copy_kv(w, &g->kv[i]));
    OK(kv_gguf_writer_write(w, path));
    kv_gguf_writer_free(w);
    size_t len2;
    char *buf2 = kt_slurp(path, &len2);
    KT_REQUIRE(buf2, "read back");
    kv_gguf *g2;
    OK(kv_gguf_parse(buf2, len2, &g2));
    KT_CHECK(g2->n_kv == g->n_kv && kv_gguf_get_int(g2, "u", &v, NULL) && v == 4000000000ll &&
                 kv_gguf_get_float(g2, "f", &f, NULL) && f == 0.25 && kv_gguf_find(g2, "as")->arr_n == 3,
             "copied metadata");
    kv_gguf_free(g2);
    free(buf2);
    kv_gguf_free(g);
    free(buf);
    unlink(path);
    free(path);
}

static kv_status convert(const char *model, const char *tok, uint32_t type, const char *arch, bool rope31,
                         const char *path)
{
    kv_model *m;
    kv_tokenizer *t;
    kv_status st = kv_model_open(model, &m);
    if (st) return st;
    if ((st = kv_tokenizer_load_llama2c(tok, m->cfg.vocab_size, &t))) {
        kv_model_close(m);
        return st;
    }
    kv_convert_opts o;
    kv_convert_opts_default(&o);
    o.wtype = type;
    o.arch = arch;
    o.rope_llama3 = rope31;
    o.rope_orig_ctx = 512;
    st = kv_convert_model(m, t, NULL, &o, path, NULL);
    kv_tokenizer_free(t);
    kv_model_close(m);
    return st;
}

static void test_every_type_computes_the_source_logits(void)
{
    /* niah4k: every row length is a multiple of 256, so every type applies */
    /* bounds on the mean KL from the float32 model, ~3x what was measured */
    static const struct { uint32_t t; double tol; } types[] = {
        {KV_GGML_F32, 1e-12}, {KV_GGML_F16, 1e-7}, {KV_GGML_BF16, 2e-6}, {KV_GGML_Q8_0, 1e-4},
        {KV_GGML_Q6_K, 2e-4}, {KV_GGML_Q5_K, 5e-4}, {KV_GGML_Q5_1, 5e-4}, {KV_GGML_Q5_0, 5e-4},
        {KV_GGML_Q4_K, 2e-3}, {KV_GGML_Q4_1, 2e-3}, {KV_GGML_Q4_0, 2e-3}, {KV_GGML_Q3_K, 8e-3},
        {KV_GGML_Q2_K, 2.5e-2},
    };
    kv_model *src;
    OK(kv_model_open("tests/data/niah4k/niah4k.bin", &src));
    int toks[6] = {1, 87, 107, 104, 35, 118};
    float *ref = logits(src, toks, 6);
    KT_REQUIRE(ref, "reference logits");
    char *path = tmpname();
    for (size_t k = 0; k < sizeof types / sizeof *types; k++) {
        char tb[16];
        const char *tn = kv_ggml_type_name(types[k].t, tb);
        OK(convert("tests/data/niah4k/niah4k.bin", "tests/data/niah4k/tok259.bin", types[k].t, "llama", false, path));
        kv_model *m;
        OK(kv_model_open(path, &m));
        KT_CHECK(kv_dtype_ggml(m->layers[0].wq.type) == types[k].t && kv_dtype_ggml(m->layers[5].w_down.type) == types[k].t,
                 "%s: matrices load as %s", tn, kv_dtype_name(m->layers[0].wq.type));
        float *lg = logits(m, toks, 6);
        double kl = lg ? mean_kl(lg, ref, 6, 259) : INFINITY;
        KT_CHECK(kl <= types[k].tol, "%s: mean KL from the float32 model %g > %g", tn, kl, types[k].tol);
        free(lg);
        kv_model_close(m);
    }
    /* stories260K: F32 from llama2.c is the same model exactly */
    OK(convert("tests/data/stories260K/stories260K.bin", "tests/data/stories260K/tok512.bin", KV_GGML_F32, "llama",
               false, path));
    kv_model *a, *b;
    OK(kv_model_open("tests/data/stories260K/stories260K.bin", &a));
    OK(kv_model_open(path, &b));
    float *la = logits(a, toks, 6), *lb = logits(b, toks, 6);
    double mag = 0;
    KT_CHECK(la && lb && max_diff(la, lb, 6 * 512, &mag) == 0, "F32 GGUF of stories260K computes identical logits");
    free(la);
    free(lb);
    kv_model_close(b);
    /* rows of 172 values cannot be Q4_K: they fall back to F16 */
    OK(convert("tests/data/stories260K/stories260K.bin", "tests/data/stories260K/tok512.bin", KV_GGML_Q4_K, "llama",
               false, path));
    OK(kv_model_open(path, &b));
    KT_CHECK(b->layers[0].w_down.type == KV_DT_F16 && b->layers[0].wq.type == KV_DT_Q5_0, "fallbacks: %s, %s",
             kv_dtype_name(b->layers[0].w_down.type), kv_dtype_name(b->layers[0].wq.type));
    kv_model_close(b);
    kv_model_close(a);
    free(ref);
    kv_model_close(src);
    unlink(path);
    free(path);
}

static void test_qwen2_layout_and_llama31_rope(void)
{
    char *p1 = tmpname(), *p2 = tmpname();
    OK(convert("tests/data/stories260K/stories260K.bin", "tests/data/stories260K/tok512.bin", KV_GGML_F32, "llama",
               false, p1));
    OK(convert("tests/data/stories260K/stories260K.bin", "tests/data/stories260K/tok512.bin", KV_GGML_F32, "qwen2",
               false, p2));
    kv_model *a, *b;
    OK(kv_model_open(p1, &a));
    OK(kv_model_open(p2, &b));
    KT_CHECK(!strcmp(b->cfg.arch, "qwen2") && b->layers[0].wq.perm && !a->layers[0].wq.perm, "qwen2 rows permuted");
    int toks[5] = {1, 403, 407, 261, 378};
    float *la = logits(a, toks, 5), *lb = logits(b, toks, 5);
    double mag, d = la && lb ? max_diff(la, lb, 5 * 512, &mag) : INFINITY;
    KT_CHECK(d < 1e-4, "qwen2 layout differs from llama layout by %g", d);
    free(la);
    free(lb);
    kv_model_close(b);
    /* rope_freqs written by Llama-3.1's rule = the rule from its parameters */
    OK(convert("tests/data/stories260K/stories260K.bin", "tests/data/stories260K/tok512.bin", KV_GGML_F32, "llama",
               true, p2));
    OK(kv_model_open(p2, &b));
    KT_REQUIRE(b->cfg.rope_freq_factors && b->cfg.rope_scaling == KV_ROPE_SCALING_NONE, "rope_freqs loaded");
    kv_model_config c = a->cfg;
    c.rope_scaling = KV_ROPE_SCALING_LLAMA3;
    c.rope_factor = 8, c.rope_low_freq_factor = 1, c.rope_high_freq_factor = 4, c.rope_orig_ctx = 512;
    float f1[64], f2[64], f0[64];
    kv_model_rope_freqs(&b->cfg, f1);
    kv_model_rope_freqs(&c, f2);
    kv_model_rope_freqs(&a->cfg, f0);
    double worst = 0;
    int changed = 0;
    for (int i = 0; i < a->cfg.head_dim / 2; i++) {
        worst = fmax(worst, fabs(f1[i] - f2[i]) / f2[i]);
        changed += f1[i] != f0[i];
    }
    KT_CHECK(worst < 1e-6 && changed >= 2, "rope_freqs vs parameters: %g relative, %d pairs scaled", worst, changed);
    kv_model_close(b);
    kv_model_close(a);
    unlink(p1);
    unlink(p2);
    free(p1);
    free(p2);
}

static void test_heads_wider_than_dim_over_heads(void)
{
    /* attention.key_length: 4 heads of 64 on a width of 128 (Mistral-Nemo's shape) */
    kv_model *syn, *m;
    kv_tokenizer *t;
    OK(kv_model_synthetic("tiny-wide-heads", 3, KV_DT_F32, &syn));
    OK(kv_tokenizer_load_llama2c("tests/data/stories260K/tok512.bin", 512, &t));
    kv_convert_opts o;
    kv_convert_opts_default(&o);
    o.wtype = KV_GGML_F32;
    char *path = tmpname();
    OK(kv_convert_model(syn, t, NULL, &o, path, NULL));
    OK(kv_model_open(path, &m));
    KT_CHECK(m->cfg.head_dim == 64 && m->cfg.dim == 128 && m->layers[0].wq.rows == 256, "head_dim %d dim %d",
             m->cfg.head_dim, m->cfg.dim);
    int toks[4] = {1, 403, 407, 261};
    float *a = logits(syn, toks, 4), *b = logits(m, toks, 4);
    double mag = 0;
    KT_CHECK(a && b && max_diff(a, b, 4 * 512, &mag) == 0, "the GGUF computes the synthetic model's logits");
    free(a);
    free(b);
    kv_model_close(m);
    kv_model_close(syn);
    kv_tokenizer_free(t);
    unlink(path);
    free(path);
}

static void test_bundled_fixtures_are_what_they_claim(void)
{
    kv_model *m;
    OK(kv_model_open("tests/data/niah4k/niah4k-q4_k.gguf", &m));
    KT_CHECK(m->layers[0].wq.type == KV_DT_Q4_K && m->tok_embd.type == KV_DT_Q4_K && m->cfg.n_layers == 6, "niah4k Q4_K");
    /* resident weights are the packed file: ~4.5 bits a weight */
    KT_CHECK(kv_model_weight_bytes(m) < 2800000, "Q4_K weights %llu bytes", (unsigned long long)kv_model_weight_bytes(m));
    kv_model_close(m);
    OK(kv_model_open("tests/data/stories260K/stories260K-q8_0.gguf", &m));
    KT_CHECK(m->layers[0].wq.type == KV_DT_Q8_0 && m->layers[0].w_down.type == KV_DT_F16, "stories260K Q8_0 (+F16)");
    kv_model_close(m);
    OK(kv_model_open("tests/data/stories260K/stories260K-qwen2-bf16.gguf", &m));
    KT_CHECK(!strcmp(m->cfg.arch, "qwen2") && m->layers[0].wq.bias && m->layers[4].wv.bias && !m->layers[0].wo.bias &&
                 m->layers[0].wq.type == KV_DT_BF16,
             "qwen2 with q/k/v biases");
    kv_model_close(m);
}

static void test_refusals_name_the_architecture_and_type(void)
{
    char *path = tmpname();
    kv_gguf_writer *w;
    OK(kv_gguf_writer_new(&w));
    OK(kv_gguf_set_str(w, "general.architecture", "mamba"));
    OK(kv_gguf_writer_write(w, path));
    kv_gguf_writer_free(w);
    kv_model *m = NULL;
    KT_CHECK(kv_model_open(path, &m) == KV_E_UNSUPPORTED && strstr(kv_errdetail(), "'mamba'"), "arch: %s",
             kv_errdetail());
    /* a llama file whose query matrix is IQ2_XS */
    OK(convert("tests/data/niah4k/niah4k.bin", "tests/data/niah4k/tok259.bin", KV_GGML_Q8_0, "llama", false, path));
    size_t len;
    char *buf = kt_slurp(path, &len);
    KT_REQUIRE(buf, "read");
    kv_gguf *g;
    OK(kv_gguf_parse(buf, len, &g));
    OK(kv_gguf_writer_new(&w));
    for (uint64_t i = 0; i < g->n_kv; i++) OK(kv_gguf_copy_kv(w, &g->kv[i]));
    uint8_t *iq = calloc(256 * 74, 1); /* IQ2_XS: 74 bytes per 256 values */
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const kv_gguf_tensor *t = &g->tensors[i];
        if (!strcmp(t->name, "blk.0.attn_q.weight"))
            OK(kv_gguf_add_tensor(w, t->name, KV_GGML_IQ2_XS, 2, t->ne, iq, (size_t)(t->ne[0] / 256 * 74 * t->ne[1])));
        else
            OK(kv_gguf_add_tensor(w, t->name, t->ggml_type, t->n_dims, t->ne, t->data, t->nbytes));
    }
    OK(kv_gguf_writer_write(w, path));
    kv_gguf_writer_free(w);
    KT_CHECK(kv_model_open(path, &m) == KV_E_UNSUPPORTED && strstr(kv_errdetail(), "IQ2_XS") &&
                 strstr(kv_errdetail(), "blk.0.attn_q.weight"),
             "type: %s", kv_errdetail());
    free(iq);
    kv_gguf_free(g);
    free(buf);
    unlink(path);
    free(path);
}

static void test_tokenizer_json_becomes_a_vocabulary(void)
{
    char *js = tmpname(), *out = tmpname();
    FILE *f = fopen(js, "w");
    KT_REQUIRE(f, "temp json");
    fputs("{\"added_tokens\": [{\"id\": 5, \"content\": \"<|end|>\", \"special\": true},"
          " {\"id\": 6, \"content\": \"<tool>\", \"special\": false}],"
          " \"model\": {\"type\": \"BPE\", \"vocab\": {\"h\": 0, \"i\": 1, \"hi\": 2, \"\\u0120\": 3, \"\\u0120hi\": 4},"
          " \"merges\": [\"h i\", [\"\\u0120\", \"hi\"]]}}",
          f);
    fclose(f);
    kv_vocab_opts o = {"gpt-2", NULL, "<|end|>", NULL};
    int n = 0;
    OK(kv_convert_hf_vocab(js, &o, out, &n));
    KT_CHECK(n == 7, "%d tokens", n);
    kv_tokenizer *t;
    OK(kv_tokenizer_load_gguf(out, &t));
    int *ids, k;
    kv_encode_opts eo = {false, false, false};
    OK(kv_tokenizer_encode_ex(t, "hi hi<tool>", 11, &eo, &ids, &k));
    KT_CHECK(k == 3 && ids[0] == 2 && ids[1] == 4 && ids[2] == 6, "ids: %d (%d %d %d)", k, k > 0 ? ids[0] : -1,
             k > 1 ? ids[1] : -1, k > 2 ? ids[2] : -1);
    free(ids);
    KT_CHECK(kv_tokenizer_eos(t) == 5 && kv_tokenizer_token_type(t, 5) == 3 && kv_tokenizer_token_type(t, 6) == 4,
             "special and user-defined tokens");
    kv_tokenizer_free(t);
    f = fopen(js, "w");
    fputs("{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}", f);
    fclose(f);
    KT_CHECK(kv_convert_hf_vocab(js, &o, out, &n) == KV_E_DATA && strstr(kv_errdetail(), "BPE"), "not BPE: %s",
             kv_errdetail());
    unlink(js);
    unlink(out);
    free(js);
    free(out);
}

int main(void)
{
    KT_RUN(test_writer_round_trips_every_value_type);
    KT_RUN(test_every_type_computes_the_source_logits);
    KT_RUN(test_qwen2_layout_and_llama31_rope);
    KT_RUN(test_heads_wider_than_dim_over_heads);
    KT_RUN(test_bundled_fixtures_are_what_they_claim);
    KT_RUN(test_refusals_name_the_architecture_and_type);
    KT_RUN(test_tokenizer_json_becomes_a_vocabulary);
    return kt_done();
}
