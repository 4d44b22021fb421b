/*
 * libFuzzer target for kv-bench prefix's request list (lib/eval/kv_prefix_bench.c,
 * kv_preq_parse): any byte string must parse or fail with KV_E_DATA and a
 * message naming the line, never crash, leak or read out of bounds; every
 * request that parses has an id and exactly one of a text and token ids.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eval/kv_prefix_bench.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    kv_preq *r = NULL;
    int n = 0;
    kv_status st = kv_preq_parse(text, size, &r, &n);
    if (st) {
        if ((st != KV_E_DATA && st != KV_E_NOMEM) || !kv_errdetail()[0]) abort();
    } else {
        for (int i = 0; i < n; i++)
            if (!r[i].id || !r[i].input == !r[i].tok || (r[i].tok && r[i].n < 1)) abort();
        kv_preq_free(r, n);
    }
    free(text);
    return 0;
}
