/*
 * kt_niah: niah4k and the prompt of its first task, as the GPU tests that
 * continue a stored cache (test_gpu_kv, test_gpu_prefix) load them.  The
 * prompt is the raw text between `"input": "` and `", "outputs"` of the
 * first line of tasks-dev.jsonl, JSON escapes left as they stand: these
 * tests want one long real prompt, not the task's exact question (that is
 * kv_niah_load's job), and their tolerances were set on these tokens.
 */
#ifndef KT_NIAH_H
#define KT_NIAH_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt_kv.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"

#define KT_NIAH "tests/data/niah4k/"

/* Open niah4k into *model and tokenize its first task's prompt (with BOS)
 * into *ids (malloc'd, n_ids of them).  0, or 1 after printing a TAP
 * "Bail out!" line (main returns it). */
static inline int kt_niah_first_task(kv_model **model, int **ids, int *n_ids)
{
    if (kv_model_open(KT_NIAH "niah4k.bin", model)) return printf("Bail out! niah4k: %s\n", kv_errdetail()), 1;
    FILE *fp = fopen(KT_NIAH "tasks-dev.jsonl", "r");
    char *line = NULL;
    size_t cap = 0;
    const bool got = fp && getline(&line, &cap, fp) > 0;
    if (fp) fclose(fp);
    char *p = got ? strstr(line, "\"input\": \"") : NULL, *q = p ? strstr(p, "\", \"outputs\"") : NULL;
    kv_tokenizer *tok = NULL;
    const bool ok = p && q && !kv_tokenizer_load_llama2c(KT_NIAH "tok259.bin", 259, &tok) &&
                    !kv_tokenizer_encode(tok, p + 10, (size_t)(q - p - 10), true, false, ids, n_ids);
    kv_tokenizer_free(tok);
    free(line);
    if (!ok) return printf("Bail out! %s\n", got ? "the first task" : "tasks-dev.jsonl"), 1;
    return 0;
}

#endif
