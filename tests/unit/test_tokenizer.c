/*
 * Tokenizers: every SentencePiece test vector that ships with llama.cpp's
 * ggml-vocab-llama-spm.gguf is reproduced; the llama2.c tokenizer of
 * stories260K round-trips the reference prompt's ids; byte fallback, the
 * niah4k byte vocabulary, token-id lists and bad tokenizer files.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt.h"
#include "format/kv_gguf.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"

#define OK(expr)                                                               \
    do {                                                                       \
        kv_status st_ = (expr);                                                \
        KT_REQUIRE(st_ == KV_OK, "%s: %s", #expr, kv_errdetail());             \
    } while (0)

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    if (b) b[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return b;
}

static void test_spm_reproduces_every_llama_cpp_vector(void)
{
    kv_model *m = NULL;
    /* the vocab-only file has no tensors: parse its metadata directly */
    size_t len;
    char *buf = slurp("tests/data/gguf/ggml-vocab-llama-spm.gguf", &len);
    KT_REQUIRE(buf, "vocab file");
    kv_gguf *g;
    OK(kv_gguf_parse(buf, len, &g));
    kv_tokenizer *t;
    OK(kv_tokenizer_from_gguf(g, &t));
    KT_CHECK(kv_tokenizer_vocab(t) == 32000, "vocab %d", kv_tokenizer_vocab(t));
    size_t il, ol;
    char *inp = slurp("tests/data/gguf/ggml-vocab-llama-spm.gguf.inp", &il);
    char *outp = slurp("tests/data/gguf/ggml-vocab-llama-spm.gguf.out", &ol);
    KT_REQUIRE(inp && outp, "vector files");
    const char *sep = "\n__ggml_vocab_test__\n";
    char *p = inp, *o = outp;
    int cases = 0, bad = 0;
    for (;;) {
        char *end = strstr(p, sep);
        if (!end) break;
        char *oe = strchr(o, '\n');
        KT_REQUIRE(oe, "output line for case %d", cases);
        *oe = 0;
        int *ids, n;
        OK(kv_tokenizer_encode(t, p, (size_t)(end - p), false, false, &ids, &n));
        /* expected ids */
        int exp[4096], ne = 0;
        char *q = o;
        while (*q && ne < 4096) {
            char *e2;
            long v = strtol(q, &e2, 10);
            if (e2 == q) break;
            exp[ne++] = (int)v;
            q = e2;
        }
        bool same = n == ne && (n == 0 || !memcmp(ids, exp, (size_t)n * sizeof(int)));
        if (!same) {
            bad++;
            printf("# case %d: got %d ids, want %d:", cases, n, ne);
            for (int i = 0; i < n && i < 12; i++) printf(" %d", ids[i]);
            printf("\n");
        }
        free(ids);
        cases++;
        p = end + strlen(sep);
        o = oe + 1;
    }
    KT_CHECK(cases == 46, "%d cases", cases);
    KT_CHECK(bad == 0, "%d of %d vectors differ", bad, cases);
    free(inp);
    free(outp);
    kv_tokenizer_free(t);
    kv_gguf_free(g);
    free(buf);
    kv_model_close(m);
}

static void test_spm_decodes_with_spaces_and_bytes(void)
{
    kv_model *m;
    OK(kv_model_open("tests/data/gguf/llama-2-tiny-random.gguf", &m));
    kv_tokenizer *t;
    OK(kv_tokenizer_from_gguf(kv_model_gguf(m), &t));
    const char *text = "Hello world, Cửa Việt";
    int *ids, n;
    OK(kv_tokenizer_encode(t, text, strlen(text), true, false, &ids, &n));
    KT_CHECK(ids[0] == 1, "BOS first");
    char out[256];
    size_t ol = 0;
    for (int i = 1; i < n; i++) {
        size_t l;
        const char *s = kv_tokenizer_decode(t, ids[i - 1], ids[i], &l);
        memcpy(out + ol, s, l);
        ol += l;
    }
    out[ol] = 0;
    KT_CHECK(!strcmp(out, text), "decoded '%s'", out);
    free(ids);
    kv_tokenizer_free(t);
    kv_model_close(m);
}

static void test_llama2c_round_trips_the_reference_prompt(void)
{
    kv_tokenizer *t;
    OK(kv_tokenizer_load_llama2c("tests/data/stories260K/tok512.bin", 512, &t));
    int ref[32], nr = 0;
    FILE *f = fopen("tests/data/stories260K/reference/prompt_lily_ids.txt", "r");
    KT_REQUIRE(f, "ids");
    while (nr < 32 && fscanf(f, "%d", &ref[nr]) == 1) nr++;
    fclose(f);
    char text[512];
    size_t tl = 0;
    for (int i = 1; i < nr; i++) {
        size_t l;
        const char *s = kv_tokenizer_decode(t, ref[i - 1], ref[i], &l);
        memcpy(text + tl, s, l);
        tl += l;
    }
    text[tl] = 0;
    KT_CHECK(!strncmp(text, "Once upon a time", 16), "text '%s'", text);
    int *ids, n;
    OK(kv_tokenizer_encode(t, text, tl, true, false, &ids, &n));
    KT_CHECK(n == nr && !memcmp(ids, ref, (size_t)n * sizeof(int)), "re-encoded %d ids vs %d", n, nr);
    free(ids);
    /* a byte outside every piece falls back to <0xHH> = byte + 3 */
    OK(kv_tokenizer_encode(t, "\x01", 1, false, false, &ids, &n));
    KT_CHECK(n == 2 && ids[1] == 0x01 + 3, "byte fallback: n %d id %d", n, n > 1 ? ids[1] : -1);
    size_t l;
    const char *s = kv_tokenizer_decode(t, 5, ids[1], &l);
    KT_CHECK(l == 1 && s[0] == 1, "byte decodes to itself");
    free(ids);
    kv_tokenizer_free(t);
}

static void test_niah_byte_vocabulary(void)
{
    kv_tokenizer *t;
    OK(kv_tokenizer_load_llama2c("tests/data/niah4k/tok259.bin", 259, &t));
    const char *text = "Answer: 12\n";
    int *ids, n;
    OK(kv_tokenizer_encode(t, text, strlen(text), true, false, &ids, &n));
    KT_REQUIRE(n == (int)strlen(text) + 2, "n %d", n);
    KT_CHECK(ids[0] == 1 && ids[1] == ' ' + 3, "BOS then the dummy space");
    for (size_t i = 0; i < strlen(text); i++)
        KT_CHECK(ids[i + 2] == (unsigned char)text[i] + 3, "byte %zu -> %d", i, ids[i + 2]);
    free(ids);
    kv_tokenizer_free(t);
}

static void test_token_lists_parse(void)
{
    int *ids, n;
    OK(kv_tokens_parse(" 1 2\n3\t40 ", 10, &ids, &n));
    KT_CHECK(n == 4 && ids[3] == 40, "n %d", n);
    free(ids);
    OK(kv_tokens_parse("[1, 5, 7]", 9, &ids, &n));
    KT_CHECK(n == 3 && ids[2] == 7, "json n %d", n);
    free(ids);
    KT_CHECK(kv_tokens_parse("1 x 3", 5, &ids, &n) == KV_E_DATA, "junk");
    KT_CHECK(kv_tokens_parse("[1, -2]", 7, &ids, &n) == KV_E_DATA, "negative");
    KT_CHECK(kv_tokens_parse("[1, 2.5]", 8, &ids, &n) == KV_E_DATA, "fraction");
    KT_CHECK(kv_tokens_parse("  ", 2, &ids, &n) == KV_E_DATA, "empty");
    KT_CHECK(kv_tokens_parse("[1,", 3, &ids, &n) == KV_E_DATA, "bad json");
}

static void test_bad_tokenizer_files_are_data_errors(void)
{
    size_t len;
    char *buf = slurp("tests/data/stories260K/tok512.bin", &len);
    KT_REQUIRE(buf, "tok512");
    kv_tokenizer *t;
    OK(kv_tokenizer_load_llama2c_mem(buf, len, 512, &t));
    kv_tokenizer_free(t);
    size_t cuts[] = {0, 3, 4, 10, len / 2, len - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++)
        KT_CHECK(kv_tokenizer_load_llama2c_mem(buf, cuts[i], 512, &t) == KV_E_DATA, "cut at %zu", cuts[i]);
    KT_CHECK(kv_tokenizer_load_llama2c_mem(buf, len, 511, &t) == KV_E_DATA, "wrong vocab size");
    int32_t bad = -5;
    memcpy(buf + 8, &bad, 4);
    KT_CHECK(kv_tokenizer_load_llama2c_mem(buf, len, 512, &t) == KV_E_DATA, "negative length");
    KT_CHECK(kv_tokenizer_load_llama2c("tests/data/nonexistent.bin", 512, &t) == KV_E_NOINPUT, "missing");
    free(buf);
}

int main(void)
{
    KT_RUN(test_spm_reproduces_every_llama_cpp_vector);
    KT_RUN(test_spm_decodes_with_spaces_and_bytes);
    KT_RUN(test_llama2c_round_trips_the_reference_prompt);
    KT_RUN(test_niah_byte_vocabulary);
    KT_RUN(test_token_lists_parse);
    KT_RUN(test_bad_tokenizer_files_are_data_errors);
    return kt_done();
}
