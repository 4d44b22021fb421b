/*
 * kv_runner: a switch over the two engines (see kv_runner.h).  Nothing here
 * computes; each call forwards to the engine the runner was built with.
 * The whole-run drivers (generation, scoring, the report) are in
 * kv_runner_run.c, written once over these calls.
 */
#include "engine/kv_runner.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_half.h"
#include "engine/kv_engine.h"

struct kv_runner {
    const kv_model *m;     /* borrowed */
    kv_engine *cpu;        /* exactly one of cpu and gpu is set */
    kv_gpu_engine *gpu;
    kv_policy_params *prm; /* (n_layers) what each layer runs with */
    char fallback[256];    /* AUTO on the CPU: the GPU engine's failure */
    int cont_T, cont_matched; /* the last prefill_from's rows and next position (0, 0: none since) */
    int32_t *cont_pos;        /* (cont_T) their positions, or NULL (rows 0 .. cont_T-1) */
};

static void set_params(kv_runner *r, const kv_policy_params *per_layer)
{
    for (int l = 0; l < r->m->cfg.n_layers; l++) {
        if (per_layer) r->prm[l] = per_layer[l];
        else kv_policy_params_default(&r->prm[l], KV_POL_FULL);
    }
}

/* AUTO without a GPU: a layer that only the GPU engine can run makes the
 * request unavailable rather than a usage error of the CPU engine. */
static kv_status cpu_can_run(const kv_runner *r, int ctx)
{
    const kv_model_config *c = &r->m->cfg;
    for (int l = 0; l < c->n_layers; l++) {
        kv_policy_geom g = {l, c->n_heads, c->n_kv_heads, c->head_dim, ctx > 0 ? ctx : c->seq_len};
        if (kv_policy_check(&r->prm[l], &g, KV_DEVICE_CPU) == KV_OK) continue;
        char cpu[512];
        snprintf(cpu, sizeof cpu, "%s", kv_errdetail());
        return kv_fail(KV_E_UNAVAILABLE, "%s, and the GPU engine is unavailable (%s)", cpu, r->fallback);
    }
    return KV_OK;
}

kv_status kv_runner_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                        kv_device dev, const kv_gpu_engine_opts *gpu_opts, kv_runner **out)
{
    *out = NULL;
    if (dev != KV_DEVICE_CPU && dev != KV_DEVICE_CUDA && dev != KV_DEVICE_AUTO)
        return kv_fail(KV_E_USAGE, "unknown device %d", (int)dev);
    kv_runner *r = calloc(1, sizeof *r);
    if (r) r->prm = malloc((size_t)m->cfg.n_layers * sizeof *r->prm + 1);
    if (!r || !r->prm) {
        free(r);
        return kv_fail(KV_E_NOMEM, "runner");
    }
    r->m = m;
    set_params(r, per_layer);
    kv_status st;
    if (dev != KV_DEVICE_CPU) {
        st = kv_gpu_engine_new(m, per_layer, ctx, gpu_opts, &r->gpu);
        if (st && dev == KV_DEVICE_CUDA) goto fail;
        if (st) { /* AUTO: the CPU engine instead, if it can run these layers */
            r->gpu = NULL;
            snprintf(r->fallback, sizeof r->fallback, "%s", kv_errdetail());
            if ((st = cpu_can_run(r, ctx))) goto fail;
        }
    }
    if (!r->gpu && (st = kv_engine_new(m, per_layer, ctx, &r->cpu))) goto fail;
    *out = r;
    return KV_OK;
fail:
    free(r->prm);
    free(r);
    return st;
}

void kv_runner_free(kv_runner *r)
{
    if (!r) return;
    if (r->gpu) kv_gpu_engine_free(r->gpu);
    else kv_engine_free(r->cpu);
    free(r->prm);
    free(r->cont_pos);
    free(r);
}

kv_status kv_runner_reset(kv_runner *r, const kv_policy_params *per_layer)
{
    kv_status st = r->gpu ? kv_gpu_engine_reset(r->gpu, per_layer) : kv_engine_reset(r->cpu, per_layer);
    if (st == KV_OK && per_layer) set_params(r, per_layer);
    return st;
}

kv_status kv_runner_prefill(kv_runner *r, const int *tokens, int n, float *logits_last)
{
    r->cont_T = r->cont_matched = 0;
    free(r->cont_pos);
    r->cont_pos = NULL;
    return r->gpu ? kv_gpu_engine_prefill(r->gpu, tokens, n, logits_last)
                  : kv_engine_prefill(r->cpu, tokens, n, logits_last);
}

kv_status kv_runner_prefill_from(kv_runner *r, const kv_prefix *pre, const int *tokens, int n,
                                 float *logits_last)
{
    kv_status st = r->gpu ? kv_gpu_engine_prefill_from(r->gpu, pre, tokens, n, logits_last)
                          : kv_engine_prefill_from(r->cpu, pre, tokens, n, logits_last);
    /* packed layers now run with the file's encoding */
    for (int l = 0; l < r->m->cfg.n_layers; l++) {
        const kv_policy_params *p = r->cpu ? kv_engine_params(r->cpu, l) : kv_gpu_engine_layer_params(r->gpu, l);
        if (p) r->prm[l] = *p;
    }
    r->cont_T = st ? 0 : pre->T, r->cont_matched = st ? 0 : pre->matched;
    free(r->cont_pos);
    r->cont_pos = NULL;
    if (!st && pre->positions && (r->cont_pos = malloc((size_t)pre->T * sizeof *r->cont_pos)))
        memcpy(r->cont_pos, pre->positions, (size_t)pre->T * sizeof *r->cont_pos);
    return st;
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

const kv_gpu_engine *kv_runner_gpu(const kv_runner *r) { return r->gpu; }

kv_status kv_runner_warm(kv_runner *r, int rows, double *ms, bool *warmed)
{
    if (ms) *ms = 0;
    if (warmed) *warmed = false;
    return r->gpu ? kv_gpu_engine_warm(r->gpu, rows, ms, warmed) : KV_OK;
}

const char *kv_runner_device(const kv_runner *r)
{
    return r->gpu ? kv_gpu_engine_device(r->gpu) : "cpu";
}

const char *kv_runner_fallback(const kv_runner *r) { return r->fallback; }

int kv_runner_n_layers(const kv_runner *r) { return r->m->cfg.n_layers; }

const kv_policy_params *kv_runner_params(const kv_runner *r, int layer) { return &r->prm[layer]; }

void kv_runner_layer_bytes(const kv_runner *r, int layer, kv_bytes *b)
{
    memset(b, 0, sizeof *b);
    if (r->gpu) {
        kv_gpu_engine_layer_bytes(r->gpu, layer, b);
    } else {
        kv_policy *p = kv_engine_policy(r->cpu, layer);
        if (p) p->ops->bytes(p, b);
    }
}

int kv_runner_layer_tokens(const kv_runner *r, int layer)
{
    if (r->gpu) return kv_gpu_engine_pos(r->gpu);
    kv_policy *p = kv_engine_policy(r->cpu, layer);
    return p ? p->n_tokens : 0;
}

kv_status kv_runner_keep(kv_runner *r, int nq, bool prompt_kv)
{
    return r->gpu ? kv_gpu_engine_keep(r->gpu, nq, prompt_kv) : kv_engine_keep(r->cpu, nq, prompt_kv);
}

int kv_runner_queries(const kv_runner *r, int layer, float *out)
{
    if (!r->gpu) return kv_engine_queries(r->cpu, layer, out);
    const int n = kv_gpu_engine_queries(r->gpu, layer, NULL);
    if (!n) return 0;
    const size_t cnt = (size_t)r->m->cfg.n_heads * n * r->m->cfg.head_dim;
    uint16_t *h = malloc(cnt * sizeof *h);
    if (!h) return 0;
    kv_gpu_engine_queries(r->gpu, layer, h);
    kv_halves_to_f32(h, out, cnt);
    free(h);
    return n;
}

/* The GPU engine's capture (fp16, host) through the one writer. */
static kv_status gpu_dump_kvc(const kv_runner *r, const int *tokens, int n, kv_dtype dt,
                              const char *path, int zstd_level)
{
    const kv_model_config *c = &r->m->cfg;
    const int L = c->n_layers, nq = kv_gpu_engine_queries(r->gpu, 0, NULL);
    int T = 0;
    if (!kv_gpu_engine_prompt_kv(r->gpu, 0, 'k', &T))
        return kv_fail(KV_E_INTERNAL, "no prompt K/V kept for the dump (call kv_runner_keep first)");
    /* a continued subset: the capture holds the subset's cont_T rows, then
     * the new rows of positions cont_matched ..; the dump gives every row at
     * its position and zeros at the positions left out (as the CPU engine's
     * dump; kv-run --store --important inserts it: the store already holds
     * that prefix and stores none of it) */
    const int nn = n - r->cont_matched, P = T - nn;
    const bool subset = T != n;
    if (subset && !(r->cont_T && P == r->cont_T && nn > 0))
        return kv_fail(KV_E_UNSUPPORTED, "the GPU engine's capture holds %d rows, not the %d tokens asked", T, n);
    const size_t per = (size_t)c->n_heads * (size_t)nq * (size_t)c->head_dim;
    const size_t lay = (size_t)c->n_kv_heads * n * c->head_dim, rb = (size_t)c->head_dim * 2;
    const void **ptr = malloc((size_t)3 * L * sizeof *ptr);
    uint16_t *q = nq ? malloc((size_t)L * per * 2) : NULL, *full = subset ? calloc(2 * (size_t)L * lay, 2) : NULL;
    if (!ptr || (nq && !q) || (subset && !full)) {
        free(q), free(ptr), free(full);
        return kv_fail(KV_E_NOMEM, "out of memory for the dump");
    }
    for (int l = 0; l < L; l++) {
        ptr[l] = kv_gpu_engine_prompt_kv(r->gpu, l, 'k', &T);
        ptr[L + l] = kv_gpu_engine_prompt_kv(r->gpu, l, 'v', &T);
        for (int w = 0; subset && w < 2; w++) {
            uint16_t *dst = full + (2 * (size_t)l + w) * lay;
            const uint16_t *src = ptr[w * L + l];
            for (int h = 0; h < c->n_kv_heads; h++) {
                for (int i = 0; i < P; i++)
                    memcpy(dst + ((size_t)h * n + (r->cont_pos ? r->cont_pos[i] : i)) * c->head_dim,
                           src + ((size_t)h * T + i) * c->head_dim, rb);
                memcpy(dst + ((size_t)h * n + r->cont_matched) * c->head_dim, src + ((size_t)h * T + P) * c->head_dim,
                       (size_t)nn * rb);
            }
            ptr[w * L + l] = dst;
        }
        ptr[2 * L + l] = q ? q + (size_t)l * per : NULL;
        if (q) kv_gpu_engine_queries(r->gpu, l, q + (size_t)l * per);
    }
    kv_prompt_dump d = {KV_DT_F16, n, nq, ptr, ptr + L, nq ? ptr + 2 * L : NULL};
    kv_status st = kv_prompt_dump_write(r->m, tokens, &d, dt, path, zstd_level);
    free(q), free(ptr), free(full);
    return st;
}

kv_status kv_runner_dump_kvc(const kv_runner *r, const int *tokens, int n, kv_dtype dt,
                             const char *path, int zstd_level)
{
    return r->gpu ? gpu_dump_kvc(r, tokens, n, dt, path, zstd_level)
                  : kv_engine_dump_kvc(r->cpu, tokens, n, dt, path, zstd_level);
}

void kv_runner_prefill_info(kv_runner *r, kv_prefill_info *p)
{
    memset(p, 0, sizeof *p);
    if (r->gpu) {
        p->device = "cuda";
        p->chunked = kv_gpu_engine_prefill_method(r->gpu, &p->chunk, p->why, sizeof p->why);
    } else {
        p->device = "cpu";
        p->chunked = true;
        p->chunk = KV_ENGINE_PREFILL_CHUNK;
        snprintf(p->why, sizeof p->why, "the CPU engine's float32 matrix-matrix products");
    }
}

kv_status kv_runner_prefill_all(kv_runner *r, const int *tokens, int n, float *logits_all)
{
    if (r->gpu)
        return kv_fail(KV_E_UNSUPPORTED, "the GPU engine's prefill gives the last position's logits only "
                                         "(every position's runs on the CPU engine)");
    return kv_engine_prefill_all(r->cpu, tokens, n, logits_all);
}
