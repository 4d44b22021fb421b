/*
 * Chat prompts (lib/model/kv_chat): a Llama-3 turn on the Llama-3
 * vocabulary gives exactly the ids of the formatted string tokenized with
 * special tokens (what llama.cpp does), with the text trimmed; special
 * tokens typed in the user's text count only when asked; ChatML on a
 * vocabulary that has its tokens; auto picks by the file's template, then
 * the vocabulary, then the architecture, and refuses with a reason.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "format/kv_gguf_write.h"
#include "kt_kv.h"
#include "model/kv_chat.h"
#include "model/kv_tokenizer.h"
#include "model/kv_ucd.h"


static int *enc(const kv_tokenizer *t, const char *s, bool bos, bool special, int *n)
{
    int *ids = NULL;
    kv_encode_opts o = {bos, false, special};
    if (kv_tokenizer_encode_ex(t, s, strlen(s), &o, &ids, n)) *n = -1;
    return ids;
}

static bool same(const int *a, int na, const int *b, int nb)
{
    return na == nb && (na == 0 || !memcmp(a, b, (size_t)na * sizeof *a));
}

static void test_llama3_turn_is_the_formatted_string(void)
{
    kv_tokenizer *t;
    OK(kv_tokenizer_load_gguf("tests/data/gguf/llama3-vocab.gguf", &t));
    const char *user = "  What is 2+2? Answer in   one word.\n";
    int *ids, n, *ref, nr;
    OK(kv_chat_encode(t, &(kv_chat){KV_CHAT_LLAMA3, NULL}, NULL, user, strlen(user), false, &ids, &n));
    ref = enc(t,
              "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2? Answer in   one word.<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
              true, true, &nr);
    KT_CHECK(same(ids, n, ref, nr), "llama3 turn: %d ids, formatted string %d", n, nr);
    KT_CHECK(n > 3 && ids[0] == 128000 && ids[1] == 128006 && ids[n - 1] == 271 && ids[n - 2] == 128007,
             "starts with BOS and a header, ends with the assistant header and \\n\\n");
    free(ids);
    free(ref);
    /* with a system turn */
    OK(kv_chat_encode(t, &(kv_chat){KV_CHAT_LLAMA3, NULL}, "Be brief.", "Hi", 2, false, &ids, &n));
    ref = enc(t,
              "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>"
              "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
              true, true, &nr);
    KT_CHECK(same(ids, n, ref, nr), "system + user: %d vs %d", n, nr);
    free(ids);
    free(ref);
    /* a special token typed by the user */
    const char *sneaky = "a<|eot_id|>b";
    int count_plain = 0, count_special = 0;
    OK(kv_chat_encode(t, &(kv_chat){KV_CHAT_LLAMA3, NULL}, NULL, sneaky, strlen(sneaky), false, &ids, &n));
    for (int i = 0; i < n; i++) count_plain += ids[i] == 128009;
    free(ids);
    OK(kv_chat_encode(t, &(kv_chat){KV_CHAT_LLAMA3, NULL}, NULL, sneaky, strlen(sneaky), true, &ids, &n));
    for (int i = 0; i < n; i++) count_special += ids[i] == 128009;
    free(ids);
    KT_CHECK(count_plain == 1 && count_special == 2, "<|eot_id|> in the text: %d plain, %d with special",
             count_plain, count_special);
    kv_chat_kind k;
    OK(kv_chat_pick(t, NULL, &k));
    KT_CHECK(k == KV_CHAT_LLAMA3, "auto picks llama3 for the Llama-3 vocabulary");
    KT_CHECK(kv_chat_encode(t, &(kv_chat){KV_CHAT_CHATML, NULL}, NULL, "x", 1, false, &ids, &n) == KV_E_UNSUPPORTED &&
                 strstr(kv_errdetail(), "<|im_start|>"),
             "chatml needs its tokens: %s", kv_errdetail());
    kv_tokenizer_free(t);
}

/* LongBench's question mode: the dense part of a wrapped prompt ends where
 * the context does, inside the user's text; and a template of one's own is
 * its text with the user's in place of {prompt}, tokenized as one text. */
static void test_split_and_own_template(void)
{
    kv_tokenizer *t;
    OK(kv_tokenizer_load_gguf("tests/data/gguf/llama3-vocab.gguf", &t));
    const char *user = "  The story. Question: who?";
    const kv_chat l3 = {KV_CHAT_LLAMA3, NULL};
    int *ids, n, *ref, nr, split;
    OK(kv_chat_encode(t, &l3, NULL, user, strlen(user), false, &ids, &n));
    OK(kv_chat_split(t, &l3, NULL, user, 12, false, ids, n, &split));
    ref = enc(t, "<|start_header_id|>user<|end_header_id|>\n\nThe story.", true, true, &nr);
    KT_CHECK(split == nr && nr < n && same(ids, nr, ref, nr), "llama3: split %d, the header and context are %d of %d",
             split, nr, n);
    free(ref);
    OK(kv_chat_split(t, &l3, NULL, user, 0, false, ids, n, &split));
    KT_CHECK(split == 5, "an empty context: BOS and the user header (%d)", split);
    free(ids);
    const kv_chat own = {KV_CHAT_TEMPLATE, "[INST]{prompt}[/INST]"};
    OK(kv_chat_encode(t, &own, NULL, "Hello world", 11, false, &ids, &n));
    ref = enc(t, "[INST]Hello world[/INST]", true, false, &nr);
    KT_CHECK(same(ids, n, ref, nr), "own template: %d ids, the formatted text %d", n, nr);
    free(ref);
    OK(kv_chat_split(t, &own, NULL, "Hello world", 5, false, ids, n, &split));
    ref = enc(t, "[INST]Hello", true, false, &nr);
    KT_CHECK(split == nr, "own template: split %d after \"[INST]Hello\" (%d)", split, nr);
    free(ref);
    free(ids);
    KT_CHECK(kv_chat_encode(t, &own, "sys", "x", 1, false, &ids, &n) == KV_E_USAGE, "a template takes no system text");
    kv_tokenizer_free(t);
}

/* A byte-level vocabulary with ChatML's tokens, an architecture and an
 * optional chat template. */
static kv_tokenizer *chatml_vocab(const char *arch, const char *tpl, bool with_tokens, const char *path)
{
    static char store[256][4];
    const char *toks[258];
    for (int b = 0; b < 256; b++) {
        int pr = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae, k = 0;
        for (int i = 0; i < b && !pr; i++) k += !((i >= 0x21 && i <= 0x7e) || (i >= 0xa1 && i <= 0xac) || i >= 0xae);
        int l = kv_ucd_put(pr ? (uint32_t)b : 256u + (uint32_t)k, store[b]);
        store[b][l] = 0;
        toks[b] = store[b];
    }
    toks[256] = with_tokens ? "<|im_start|>" : "<|x|>";
    toks[257] = with_tokens ? "<|im_end|>" : "<|y|>";
    int32_t types[258];
    for (int i = 0; i < 258; i++) types[i] = i < 256 ? 1 : 3;
    const char *merges[] = {"a b"};
    kv_gguf_writer *w;
    if (kv_gguf_writer_new(&w)) return NULL;
    kv_gguf_set_str(w, "general.architecture", arch);
    kv_gguf_set_str(w, "tokenizer.ggml.model", "gpt2");
    kv_gguf_set_str(w, "tokenizer.ggml.pre", "qwen2");
    kv_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, NULL, 258);
    kv_gguf_set_arr_i32(w, "tokenizer.ggml.token_type", types, 258);
    kv_gguf_set_arr_str(w, "tokenizer.ggml.merges", merges, NULL, 1);
    if (tpl) kv_gguf_set_str(w, "tokenizer.chat_template", tpl);
    kv_status st = kv_gguf_writer_write(w, path);
    kv_gguf_writer_free(w);
    kv_tokenizer *t = NULL;
    if (!st) st = kv_tokenizer_load_gguf(path, &t);
    return st ? NULL : t;
}

static void test_chatml_and_auto_selection(void)
{
    char path[] = "/tmp/kv-test-chat-XXXXXX";
    int fd = mkstemp(path);
    KT_REQUIRE(fd >= 0, "temp");
    close(fd);
    kv_tokenizer *t = chatml_vocab("qwen2", NULL, true, path);
    KT_REQUIRE(t, "vocabulary: %s", kv_errdetail());
    kv_chat_kind k;
    OK(kv_chat_pick(t, NULL, &k));
    KT_CHECK(k == KV_CHAT_CHATML, "its <|im_start|> token picks chatml");
    int *ids, n, *ref, nr;
    OK(kv_chat_encode(t, &(kv_chat){KV_CHAT_AUTO, NULL}, NULL, " hi ", 4, false, &ids, &n));
    ref = enc(t, "<|im_start|>user\n hi <|im_end|>\n<|im_start|>assistant\n", false, true, &nr);
    KT_CHECK(same(ids, n, ref, nr), "chatml turn (untrimmed, no BOS for this vocabulary): %d vs %d", n, nr);
    KT_CHECK(!kv_tokenizer_add_bos(t) && n > 0 && ids[0] == 256, "no BOS");
    free(ids);
    free(ref);
    kv_tokenizer_free(t);
    /* the file's template decides first */
    t = chatml_vocab("llama", "{% for m in messages %}<|im_start|>{{ m.role }}...", false, path);
    KT_REQUIRE(t, "vocabulary");
    OK(kv_chat_pick(t, NULL, &k));
    KT_CHECK(k == KV_CHAT_CHATML, "template text picks chatml");
    KT_CHECK(kv_chat_encode(t, &(kv_chat){k, NULL}, NULL, "x", 1, false, &ids, &n) == KV_E_UNSUPPORTED, "but the tokens are missing");
    kv_tokenizer_free(t);
    /* neither template, tokens nor a known architecture */
    t = chatml_vocab("llama", "{{ messages }}", false, path);
    KT_REQUIRE(t, "vocabulary");
    KT_CHECK(kv_chat_pick(t, NULL, &k) == KV_E_UNSUPPORTED && strstr(kv_errdetail(), "--chat"), "no pick: %s",
             kv_errdetail());
    OK(kv_chat_pick(t, "qwen2", &k));
    KT_CHECK(k == KV_CHAT_CHATML, "the architecture decides last");
    kv_tokenizer_free(t);
    unlink(path);
    kv_chat c;
    KT_CHECK(kv_chat_parse("llama3", &c) == KV_OK && c.kind == KV_CHAT_LLAMA3 && kv_chat_parse("jinja", &c) == KV_E_USAGE,
             "names");
    KT_CHECK(kv_chat_parse("<s>[INST]{prompt}[/INST]", &c) == KV_OK && c.kind == KV_CHAT_TEMPLATE &&
                 !strcmp(c.tmpl, "<s>[INST]{prompt}[/INST]"),
             "a text holding {prompt} is a template");
}

int main(void)
{
    KT_RUN(test_llama3_turn_is_the_formatted_string);
    KT_RUN(test_chatml_and_auto_selection);
    KT_RUN(test_split_and_own_template);
    return kt_done();
}
