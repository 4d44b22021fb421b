/*
 * libFuzzer target for the GGUF reader and the llama loader: parse the
 * metadata, build the vocabulary and tokenize a string when there is one,
 * and when the bytes make a whole model, run a two-token forward pass on a
 * four-token context.  Any crash, sanitizer report or leak is a bug in
 * lib/format/kv_gguf.c, lib/model/kv_model.c, lib/model/kv_tokenizer.c or the engine.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kv_engine.h"
#include "format/kv_gguf.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"

#include "fuzz_run_model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_gguf *g = NULL;
    if (kv_gguf_parse(data, size, &g) == KV_OK) {
        for (uint64_t i = 0; i < g->n_kv; i++) {
            const kv_gguf_kv *kv = &g->kv[i];
            if (kv->type == KV_GGUF_ARRAY && kv->arr_n)
                (void)(kv->arr_type == KV_GGUF_STRING ? (double)(kv_gguf_arr_str(kv, 0, &(size_t){0}) != NULL)
                                                      : kv_gguf_arr_num(kv, kv->arr_n - 1));
        }
        kv_tokenizer *t = NULL;
        if (kv_tokenizer_from_gguf(g, &t) == KV_OK) {
            int *ids = NULL, n = 0;
            const char *s = "Hello world \xe2\x96\x81 caf\xc3\xa9 \x01";
            if (kv_tokenizer_encode(t, s, strlen(s), true, true, &ids, &n) == KV_OK)
                for (int i = 1; i < n; i++) {
                    size_t l;
                    kv_tokenizer_decode(t, ids[i - 1], ids[i], &l);
                }
            free(ids);
            kv_tokenizer_free(t);
        }
        kv_gguf_free(g);
    }
    fuzz_run_model(data, size);
    return 0;
}
