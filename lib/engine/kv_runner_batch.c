/*
 * kv_runner_batch: B prompts decoded greedily (see kv_runner_batch.h): on
 * the GPU a kv_gpu_batch over one weights engine, each sequence prefilled
 * alone and then stepped together; on the CPU a kv_runner reset between
 * sequences.  The stop rule is kv_runner_generate's, applied to each
 * sequence's ids after the batch ran.
 */
#include "engine/kv_runner_batch.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_stats.h"
#include "model/kv_sampler.h"
#include "model/kv_tokenizer.h"

#define TRY(expr)                                                                 \
    do {                                                                          \
        kv_status try_st_ = (expr);                                               \
        if (try_st_ != KV_OK) return try_st_;                                     \
    } while (0)

void kv_batch_result_clear(kv_batch_result *res)
{
    for (int i = 0; res->gen && i < res->B; i++) kv_generation_clear(&res->gen[i]);
    free(res->gen);
    memset(res, 0, sizeof *res);
}

static bool is_stop(const kv_generate_opts *o, int t)
{
    return t == o->stop[0] || t == o->stop[1] || (o->eog && kv_tokenizer_is_eog(o->eog, t));
}

/* The sequence's emitted ids from its candidates c (n: the first from the
 * prefill, then one per step), as kv_runner_generate emits them. */
static kv_status emit(const kv_generate_opts *o, const int *c, int n, size_t stride, kv_generation *g)
{
    g->tokens = malloc((size_t)(n > 0 ? n : 1) * sizeof *g->tokens);
    if (!g->tokens) return kv_fail(KV_E_NOMEM, "out of memory");
    g->end = KV_GEN_STEPS;
    for (int k = 0; k < n; k++) {
        const int t = c[(size_t)k * stride];
        if (is_stop(o, t)) {
            g->end = KV_GEN_STOP_TOKEN;
            g->n_steps = g->n_gen;
            return KV_OK;
        }
        g->tokens[g->n_gen++] = t;
    }
    g->n_steps = g->n_gen > 0 ? g->n_gen - 1 : 0;
    return KV_OK;
}

static kv_status run_gpu(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                         const kv_gpu_engine_opts *go, kv_gpu_gemm gemm, int B, const int *const *prompts,
                         const int *n_prompt, const kv_generate_opts *o, kv_batch_result *res, kv_gpu_engine **wp)
{
    const int V = m->cfg.vocab_size, n = o->n;
    /* the weights' engine never decodes: a few tokens of room */
    TRY(kv_gpu_engine_new(m, NULL, 16, go, wp));
    kv_gpu_engine *w = *wp;
    snprintf(res->device, sizeof res->device, "%s", kv_gpu_engine_device(w));
    const kv_policy_params **per = malloc((size_t)B * sizeof *per);
    float *logits = malloc((size_t)V * sizeof *logits);
    int *cand = malloc((size_t)B * (n > 0 ? n : 1) * sizeof(int));
    float *ms = malloc((size_t)(n > 0 ? n : 1) * sizeof *ms);
    kv_gpu_batch *bt = NULL;
    kv_status st = per && logits && cand && ms ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory");
    for (int i = 0; i < B && !st; i++) per[i] = per_layer;
    if (!st) st = kv_gpu_batch_new(w, B, per, ctx, gemm, &bt);
    if (!st) snprintf(res->how, sizeof res->how, "batched on the GPU, products %s", kv_gpu_batch_gemm_desc(bt));
    double t0 = kv_now_ms();
    for (int i = 0; i < B && !st; i++) {
        st = kv_gpu_engine_prefill(kv_gpu_batch_seq(bt, i), prompts[i], n_prompt[i], logits);
        if (st) kv_errcontext("sequence %d", i);
        else cand[i] = kv_argmax(logits, V); /* step 0's candidates: row 0 of cand (n, B) */
    }
    res->prefill_ms = kv_now_ms() - t0;
    t0 = kv_now_ms();
    if (!st && n > 1) {
        /* cand row k + 1 = the ids generated at step k */
        st = kv_gpu_batch_generate(bt, cand, n - 1, cand + B, ms);
        res->steps = n - 1;
        if (!st) {
            double *d = malloc((size_t)(n - 1) * sizeof *d);
            if (!d) st = kv_fail(KV_E_NOMEM, "out of memory");
            for (int k = 0; d && k < n - 1; k++) d[k] = ms[k];
            kv_stats s;
            if (d) kv_stats_of(d, n - 1, &s), res->step_ms_median = s.median;
            free(d);
        }
    }
    res->decode_ms = kv_now_ms() - t0;
    for (int i = 0; i < B && !st; i++) st = emit(o, cand + i, n, (size_t)B, &res->gen[i]);
    for (int i = 0; i < B && !st; i++) {
        kv_bytes kb;
        kv_gpu_engine_bytes(kv_gpu_batch_seq(bt, i), &kb);
        res->gpu_kv += kb.resident;
        res->host_kv += kb.host;
    }
    res->gpu = true;
    kv_gpu_batch_free(bt);
    free(per), free(logits), free(cand), free(ms);
    return st;
}

static kv_status run_cpu(const kv_model *m, const kv_policy_params *per_layer, int ctx, int B,
                         const int *const *prompts, const int *n_prompt, const kv_generate_opts *o,
                         kv_batch_result *res)
{
    const int V = m->cfg.vocab_size;
    kv_runner *r = NULL;
    TRY(kv_runner_new(m, per_layer, ctx, KV_DEVICE_CPU, NULL, &r));
    snprintf(res->device, sizeof res->device, "cpu");
    snprintf(res->how, sizeof res->how, "one after another on the CPU");
    float *logits = malloc((size_t)V * sizeof *logits);
    kv_sampler smp = {0};
    kv_status st = logits ? kv_sampler_init(&smp, V, 0.0f, 1.0f, 1) : kv_fail(KV_E_NOMEM, "out of memory");
    kv_generate_opts go = *o;
    go.on_token = NULL;
    double *all = malloc((size_t)B * (o->n > 0 ? o->n : 1) * sizeof *all);
    int nall = 0;
    if (!st && !all) st = kv_fail(KV_E_NOMEM, "out of memory");
    for (int i = 0; i < B && !st; i++) {
        double t0 = kv_now_ms();
        if (i) st = kv_runner_reset(r, NULL);
        if (!st) st = kv_runner_prefill(r, prompts[i], n_prompt[i], logits);
        res->prefill_ms += kv_now_ms() - t0;
        t0 = kv_now_ms();
        if (!st) st = kv_runner_generate(r, &smp, logits, &go, &res->gen[i]);
        res->decode_ms += kv_now_ms() - t0;
        if (st) {
            kv_errcontext("sequence %d", i);
            break;
        }
        for (int k = 0; k < res->gen[i].n_steps; k++) all[nall++] = res->gen[i].step_ms[k];
        res->steps += res->gen[i].n_steps;
        kv_bytes kb;
        kv_runner_bytes(r, &kb);
        res->gpu_kv += kb.resident;
        res->host_kv += kb.host;
    }
    kv_stats s;
    kv_stats_of(all, all ? nall : 0, &s);
    res->step_ms_median = s.median;
    free(all);
    kv_sampler_clear(&smp);
    free(logits);
    kv_runner_free(r);
    return st;
}

kv_status kv_runner_batch(const kv_model *m, const kv_policy_params *per_layer, int ctx, kv_device dev,
                          const kv_gpu_engine_opts *gpu_opts, kv_gpu_gemm gemm, int B, const int *const *prompts,
                          const int *n_prompt, const kv_generate_opts *o, kv_batch_result *res)
{
    memset(res, 0, sizeof *res);
    if (B < 1) return kv_fail(KV_E_USAGE, "a batch of %d prompts", B);
    for (int i = 0; i < B; i++)
        if (n_prompt[i] < 1) return kv_fail(KV_E_USAGE, "prompt %d is empty", i);
    res->gen = calloc((size_t)B, sizeof *res->gen);
    if (!res->gen) return kv_fail(KV_E_NOMEM, "out of memory");
    res->B = B;
    kv_status st = KV_E_UNAVAILABLE;
    if (dev != KV_DEVICE_CPU) {
        kv_gpu_engine *w = NULL;
        st = run_gpu(m, per_layer, ctx, gpu_opts, gemm, B, prompts, n_prompt, o, res, &w);
        const bool no_engine = !w;
        kv_gpu_engine_free(w);
        if (st && dev == KV_DEVICE_AUTO && no_engine) { /* no GPU engine at all: the CPU */
            snprintf(res->fallback, sizeof res->fallback, "%s", kv_errdetail());
            kv_errclear();
            for (int i = 0; i < B; i++) kv_generation_clear(&res->gen[i]);
            st = KV_E_UNAVAILABLE;
        } else {
            return st;
        }
    }
    return run_cpu(m, per_layer, ctx, B, prompts, n_prompt, o, res);
}

kv_status kv_batch_report(const kv_model *m, const kv_batch_result *res, const int *n_prompt, const char *gemm,
                          char **json)
{
    *json = NULL;
    cJSON *r = cJSON_CreateObject();
    if (!r) return kv_fail(KV_E_NOMEM, "out of memory");
    cJSON_AddStringToObject(r, "model", m->cfg.name);
    cJSON_AddNumberToObject(r, "batch", res->B);
    cJSON_AddStringToObject(r, "device", res->device);
    cJSON_AddStringToObject(r, "how", res->how);
    cJSON_AddStringToObject(r, "gemm", gemm);
    if (res->fallback[0]) cJSON_AddStringToObject(r, "fallback", res->fallback);
    long gen = 0;
    for (int i = 0; i < res->B; i++) gen += res->gen[i].n_gen;
    cJSON_AddNumberToObject(r, "prefill_ms", res->prefill_ms);
    cJSON_AddNumberToObject(r, "decode_ms", res->decode_ms);
    cJSON_AddNumberToObject(r, "decode_steps", res->steps);
    cJSON_AddNumberToObject(r, "ms_per_step", res->step_ms_median);
    cJSON_AddNumberToObject(r, "generated_tokens", (double)gen);
    /* decoded ids (the first of each sequence comes from its prefill) per second of decode */
    double dec = res->gpu ? (double)res->steps * res->B : (double)res->steps;
    cJSON_AddNumberToObject(r, "tokens_per_s", res->decode_ms > 0 ? dec * 1e3 / res->decode_ms : 0);
    /* resident: on the GPU for a GPU run, in the CPU engine's memory otherwise */
    cJSON_AddNumberToObject(r, "kv_bytes", (double)res->gpu_kv);
    cJSON_AddNumberToObject(r, "host_kv_bytes", (double)res->host_kv);
    cJSON *a = cJSON_AddArrayToObject(r, "sequences");
    for (int i = 0; a && i < res->B; i++) {
        cJSON *s = cJSON_CreateObject();
        cJSON_AddNumberToObject(s, "seq", i);
        cJSON_AddNumberToObject(s, "prompt_tokens", n_prompt[i]);
        cJSON_AddNumberToObject(s, "generated", res->gen[i].n_gen);
        cJSON_AddStringToObject(s, "end", kv_gen_end_name(res->gen[i].end));
        cJSON_AddItemToArray(a, s);
    }
    *json = cJSON_Print(r);
    cJSON_Delete(r);
    return *json ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory writing JSON");
}
