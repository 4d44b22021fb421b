/*
 * libFuzzer target for byte-level BPE (lib/model/kv_bpe.c, the special-token
 * partition and the pre-tokenizers).  The first byte picks the mode:
 *   even: the rest is a GGUF file: its vocabulary, merges and
 *         tokenizer.ggml.pre are loaded and a few texts encoded and decoded;
 *   odd:  the rest is text for the real Llama-3 vocabulary
 *         (tests/data/gguf/llama3-vocab.gguf, loaded once), encoded with and
 *         without special tokens; the plain encoding must decode back to
 *         exactly the input bytes, or the target aborts.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "format/kv_gguf.h"
#include "model/kv_tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void roundtrip(const kv_tokenizer *t, const char *s, size_t n, bool must_match)
{
    int *ids = NULL, k = 0;
    kv_encode_opts o = {false, false, false};
    if (kv_tokenizer_encode_ex(t, s, n, &o, &ids, &k) == KV_OK) {
        char *back = malloc(n + 1);
        size_t bl = 0;
        bool over = false;
        for (int i = 0; i < k; i++) {
            size_t l;
            const char *d = kv_tokenizer_decode(t, -1, ids[i], &l);
            if (bl + l > n) over = true;
            else memcpy(back + bl, d, l);
            bl += l;
        }
        if (must_match && (over || bl != n || memcmp(back, s, n))) {
            fprintf(stderr, "BPE round trip lost bytes (%zu in, %zu out)\n", n, bl);
            abort();
        }
        free(back);
    }
    free(ids);
    o.special = true;
    o.bos = true;
    if (kv_tokenizer_encode_ex(t, s, n, &o, &ids, &k) == KV_OK) free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    if (data[0] & 1) {
        static kv_tokenizer *l3;
        static int tried;
        if (!tried) {
            tried = 1;
            if (kv_tokenizer_load_gguf("tests/data/gguf/llama3-vocab.gguf", &l3)) l3 = NULL;
        }
        if (l3) roundtrip(l3, (const char *)data + 1, size - 1, true);
        return 0;
    }
    kv_gguf *g = NULL;
    if (kv_gguf_parse(data + 1, size - 1, &g) == KV_OK) {
        kv_tokenizer *t = NULL;
        if (kv_tokenizer_from_gguf(g, &t) == KV_OK) {
            static const char *texts[] = {"Hello, y'all! 1234567 \xe4\xbd\xa0\xe5\xa5\xbd  \n\n\t x", "a\xff\xfe<|eot_id|>",
                                          ""};
            /* byte-exactness is only promised for vocabularies with every byte */
            for (int i = 0; i < 3; i++) roundtrip(t, texts[i], strlen(texts[i]), false);
            kv_tokenizer_free(t);
        }
        kv_gguf_free(g);
    }
    return 0;
}
