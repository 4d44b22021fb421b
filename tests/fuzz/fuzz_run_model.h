/*
 * Shared by the model-loader fuzzers (GGUF, llama2.c): a buffer that loads
 * as a model must also run, so a prefill of two tokens (the first and the
 * last id) and one decode step go through the engine on every such input.
 */
#ifndef FUZZ_RUN_MODEL_H
#define FUZZ_RUN_MODEL_H

#include <stdlib.h>

#include "engine/kv_engine.h"
#include "model/kv_model.h"

static void fuzz_run_model(const uint8_t *data, size_t size)
{
    kv_model *m = NULL;
    if (kv_model_open_mem(data, size, &m) != KV_OK) return;
    kv_engine *e = NULL;
    if (kv_engine_new(m, NULL, 4, &e) == KV_OK) {
        float *lg = malloc((size_t)m->cfg.vocab_size * sizeof *lg);
        int toks[2] = {0, m->cfg.vocab_size - 1};
        if (lg && kv_engine_prefill(e, toks, 2, lg) == KV_OK) kv_engine_step(e, 0, lg);
        free(lg);
        kv_engine_free(e);
    }
    kv_model_close(m);
}

#endif
