/*
 * libFuzzer target for the prompt-per-line reader (lib/model/kv_prompt_lines.c,
 * kv-run --batch --prompt-file): any bytes either fail with KV_E_DATA (a NUL)
 * or give prompts that are non-blank, hold no '\n' and no NUL, and whose
 * total length is at most the input's; anything else aborts.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/kv_prompt_lines.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char **lines = NULL;
    int n = 0;
    kv_status st = kv_prompt_lines((const char *)data, size, &lines, &n);
    if (st) {
        if (st != KV_E_DATA || memchr(data, 0, size) == NULL || lines || n) abort();
        return 0;
    }
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        size_t l = strlen(lines[i]);
        if (!l || memchr(lines[i], '\n', l) || strspn(lines[i], " \t") == l) abort();
        total += l;
    }
    if (total > size) abort();
    kv_prompt_lines_free(lines, n);
    return 0;
}
