/*
 * libFuzzer target for the RULER JSONL task reader (lib/eval/kv_niah.c): any
 * byte string must parse or fail with KV_E_DATA and a message naming the
 * line, never crash, leak or read out of bounds; every task that parses has
 * a prompt and at least one expected output.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eval/kv_niah.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* the reader takes text that may hold NULs and no terminator */
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    kv_niah_set set;
    memset(&set, 0, sizeof set);
    kv_status st = kv_niah_parse(text, size, "fuzz", &set);
    if (st) {
        if (st != KV_E_DATA || !kv_errdetail()[0]) abort();
    } else {
        for (int i = 0; i < set.n; i++)
            if (!set.tasks[i].input || set.tasks[i].n_outputs < 1) abort();
        kv_niah_clear(&set);
    }
    free(text);
    return 0;
}
