/*
 * kv_runner: a switch over the two engines (see kv_runner.h).  Nothing here
 * computes; each call forwards to the engine the runner was built with.
 */
#include "engine/kv_runner.h"

#include <stdlib.h>
#include <string.h>

#include "engine/kv_engine.h"

struct kv_runner {
    const kv_model *m; /* borrowed */
    kv_engine *cpu;    /* exactly one of cpu and gpu is set */
    kv_gpu_engine *gpu;
};

kv_status kv_runner_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                        kv_device dev, const kv_gpu_engine_opts *gpu_opts, kv_runner **out)
{
    *out = NULL;
    if (dev != KV_DEVICE_CPU && dev != KV_DEVICE_CUDA && dev != KV_DEVICE_AUTO)
        return kv_fail(KV_E_USAGE, "unknown device %d", (int)dev);
    kv_runner *r = calloc(1, sizeof *r);
    if (!r) return kv_fail(KV_E_NOMEM, "runner");
    r->m = m;
    kv_status st = KV_E_UNAVAILABLE;
    if (dev != KV_DEVICE_CPU) {
        st = kv_gpu_engine_new(m, per_layer, ctx, gpu_opts, &r->gpu);
        if (st && dev == KV_DEVICE_CUDA) {
            free(r);
            return st;
        }
    }
    if (st) {
        r->gpu = NULL;
        st = kv_engine_new(m, per_layer, ctx, &r->cpu);
        if (st) {
            free(r);
            return st;
        }
    }
    *out = r;
    return KV_OK;
}

void kv_runner_free(kv_runner *r)
{
    if (!r) return;
    if (r->gpu) kv_gpu_engine_free(r->gpu);
    else kv_engine_free(r->cpu);
    free(r);
}

kv_status kv_runner_reset(kv_runner *r, const kv_policy_params *per_layer)
{
    return r->gpu ? kv_gpu_engine_reset(r->gpu, per_layer) : kv_engine_reset(r->cpu, per_layer);
}

kv_status kv_runner_prefill(kv_runner *r, const int *tokens, int n, float *logits_last)
{
    return r->gpu ? kv_gpu_engine_prefill(r->gpu, tokens, n, logits_last)
                  : kv_engine_prefill(r->cpu, tokens, n, logits_last);
}

kv_status kv_runner_step(kv_runner *r, int token, float *logits)
{
    return r->gpu ? kv_gpu_engine_step(r->gpu, token, logits) : kv_engine_step(r->cpu, token, logits);
}

int kv_runner_pos(const kv_runner *r)
{
    return r->gpu ? kv_gpu_engine_pos(r->gpu) : kv_engine_pos(r->cpu);
}

int kv_runner_ctx(const kv_runner *r)
{
    return r->gpu ? kv_gpu_engine_ctx(r->gpu) : kv_engine_ctx(r->cpu);
}

int kv_runner_vocab(const kv_runner *r)
{
    return r->gpu ? kv_gpu_engine_vocab(r->gpu) : kv_engine_vocab(r->cpu);
}

const kv_model *kv_runner_model(const kv_runner *r) { return r->m; }

void kv_runner_bytes(const kv_runner *r, kv_bytes *total)
{
    if (r->gpu) kv_gpu_engine_bytes(r->gpu, total);
    else kv_engine_bytes(r->cpu, total);
}

bool kv_runner_is_gpu(const kv_runner *r) { return r->gpu != NULL; }

const char *kv_runner_device(const kv_runner *r)
{
    return r->gpu ? kv_gpu_engine_device(r->gpu) : "cpu";
}
