/*
 * libFuzzer target for the llama2.c loaders: the checkpoint (legacy and v1
 * "ak42" headers) and the tokenizer.bin format.  The first byte picks the
 * target and, for the tokenizer, the vocabulary size; the rest is the file.
 * A checkpoint that loads runs a two-token forward pass.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kv_engine.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"

#include "fuzz_run_model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint8_t sel = data[0];
    data++, size--;
    if (sel & 1) {
        kv_tokenizer *t = NULL;
        int vocab = 1 + (sel >> 1);
        if (kv_tokenizer_load_llama2c_mem(data, size, vocab, &t) == KV_OK) {
            int *ids = NULL, n = 0;
            const char *s = "Once upon a time \xc3\xa9\x01\n";
            if (kv_tokenizer_encode(t, s, strlen(s), true, false, &ids, &n) == KV_OK)
                for (int i = 1; i < n; i++) {
                    size_t l;
                    kv_tokenizer_decode(t, ids[i - 1], ids[i], &l);
                }
            free(ids);
            kv_tokenizer_free(t);
        }
        return 0;
    }
    fuzz_run_model(data, size);
    return 0;
}
