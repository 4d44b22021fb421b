/*
 * kv_runner_run: whole runs over a kv_runner, written once for both
 * engines: teacher-forced scoring, next-token probabilities per position,
 * generation with its stop rules and step timings, and the JSON report of
 * a run (kv-run(1) REPORT).
 */
#include "engine/kv_runner.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "common/kv_stats.h"
#include "model/kv_matmul.h"

kv_status kv_runner_score(kv_runner *r, const int *tokens, int n, double *nll)
{
    if (n < 2) return kv_fail(KV_E_DATA, "scoring needs at least two tokens (the text is empty?)");
    const int V = kv_runner_vocab(r);
    float *lg = malloc((size_t)V * sizeof(float));
    if (!lg) return kv_fail(KV_E_NOMEM, "out of memory");
    kv_status st = kv_runner_reset(r, NULL);
    if (!st) st = kv_runner_prefill(r, tokens, 1, lg);
    for (int i = 1; i < n && !st; i++) {
        if (tokens[i] < 0 || tokens[i] >= V) {
            st = kv_fail(KV_E_DATA, "token %d at position %d is outside the vocabulary", tokens[i], i);
            break;
        }
        nll[i - 1] = kv_nll(lg, V, tokens[i]);
        if (i + 1 < n) st = kv_runner_step(r, tokens[i], lg);
    }
    free(lg);
    return st;
}

kv_status kv_runner_score_json(kv_runner *r, const int *tokens, int n, char **json)
{
    *json = NULL;
    double *nll = malloc((size_t)(n > 1 ? n - 1 : 1) * sizeof *nll), t0 = kv_now_ms();
    kv_status st = nll ? kv_runner_score(r, tokens, n, nll) : kv_fail(KV_E_NOMEM, "out of memory");
    if (!st) st = kv_score_report(nll, n, kv_now_ms() - t0, json);
    free(nll);
    return st;
}

kv_status kv_runner_probs(kv_runner *r, const int *tokens, int n, int k, char **json)
{
    *json = NULL;
    const int V = kv_runner_vocab(r);
    if (n < 1 || k < 1) return kv_fail(KV_E_USAGE, "probabilities of %d positions, top %d", n, k);
    float *lg = malloc((size_t)n * (size_t)V * sizeof *lg);
    int *ids = malloc((size_t)k * sizeof *ids);
    double *p = malloc((size_t)k * sizeof *p);
    cJSON *a = NULL;
    kv_status st = !lg || !ids || !p ? kv_fail(KV_E_NOMEM, "out of memory for %d x %d logits", n, V)
                                     : kv_runner_reset(r, NULL);
    if (!st) st = kv_runner_prefill_all(r, tokens, n, lg);
    if (!st && !(a = cJSON_CreateArray())) st = kv_fail(KV_E_NOMEM, "out of memory");
    for (int i = 0; !st && i < n; i++) {
        int m = kv_top_probs(lg + (size_t)i * V, V, k, ids, p);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "pos", i);
        cJSON_AddNumberToObject(o, "token", tokens[i]);
        cJSON *top = cJSON_AddArrayToObject(o, "top");
        for (int j = 0; j < m; j++) {
            cJSON *pair = cJSON_CreateArray();
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(ids[j]));
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(p[j]));
            cJSON_AddItemToArray(top, pair);
        }
        cJSON_AddItemToArray(a, o);
    }
    if (!st && !(*json = cJSON_PrintUnformatted(a))) st = kv_fail(KV_E_NOMEM, "out of memory writing JSON");
    cJSON_Delete(a);
    free(lg);
    free(ids);
    free(p);
    return st;
}

kv_status kv_run_ctx(int asked, int trained, int n_prompt, int n_gen, int *ctx, bool *grown)
{
    *grown = false;
    int need = n_prompt + n_gen;
    if (asked && n_prompt > asked)
        return kv_fail(KV_E_USAGE, "the prompt has %d tokens, more than --ctx %d", n_prompt, asked);
    /* the last token generated needs no step: n_prompt + n_gen - 1 positions */
    if (asked && n_gen > 0 && need - 1 > asked)
        return kv_fail(KV_E_USAGE, "-n %d after a %d-token prompt needs a context of %d tokens, more than --ctx %d",
                       n_gen, n_prompt, need - 1, asked);
    *ctx = asked ? asked : trained;
    if (!asked && need > trained) {
        *ctx = need;
        *grown = true;
    }
    return KV_OK;
}

kv_status kv_score_report(const double *nll, int n, double ms, char **json)
{
    double sum = 0;
    cJSON *j = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(j, "nll");
    for (int i = 0; i < n - 1; i++) {
        sum += nll[i];
        cJSON_AddItemToArray(arr, cJSON_CreateNumber(nll[i]));
    }
    cJSON_AddNumberToObject(j, "tokens", n);
    cJSON_AddNumberToObject(j, "scored", n - 1);
    cJSON_AddNumberToObject(j, "mean_nll", sum / (n - 1));
    cJSON_AddNumberToObject(j, "perplexity", exp(sum / (n - 1)));
    cJSON_AddNumberToObject(j, "ms", ms);
    *json = cJSON_Print(j);
    cJSON_Delete(j);
    return *json ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory writing JSON");
}

void kv_generation_clear(kv_generation *g)
{
    free(g->tokens);
    free(g->step_ms);
    memset(g, 0, sizeof *g);
}

const char *kv_gen_end_name(kv_gen_end e)
{
    return e == KV_GEN_STOP_TOKEN ? "stop_token" : e == KV_GEN_CTX_FULL ? "ctx_full" : "steps";
}

kv_status kv_runner_generate(kv_runner *r, kv_sampler *s, float *logits, const kv_generate_opts *o,
                             kv_generation *g)
{
    memset(g, 0, sizeof *g);
    const size_t cap = (size_t)(o->n > 0 ? o->n : 1);
    g->tokens = malloc(cap * sizeof *g->tokens);
    g->step_ms = malloc(cap * sizeof *g->step_ms);
    if (!g->tokens || !g->step_ms) return kv_fail(KV_E_NOMEM, "generation buffers");
    g->end = KV_GEN_STEPS;
    while (g->n_gen < o->n) {
        int next = kv_sampler_next(s, logits);
        if (next == o->stop[0] || next == o->stop[1] || (o->eog && kv_tokenizer_is_eog(o->eog, next))) {
            g->end = KV_GEN_STOP_TOKEN;
            break;
        }
        g->tokens[g->n_gen] = next;
        if (o->on_token) o->on_token(o->user, next, g->n_gen);
        if (++g->n_gen == o->n) break; /* the last token needs no step */
        if (kv_runner_pos(r) >= kv_runner_ctx(r)) {
            g->end = KV_GEN_CTX_FULL;
            break;
        }
        double t0 = kv_now_ms();
        kv_status st = kv_runner_step(r, next, logits);
        if (st) return st;
        g->step_ms[g->n_steps++] = kv_now_ms() - t0;
    }
    return KV_OK;
}

// --- the report ----------------------------------------------------------------

static void add_model(cJSON *r, const kv_model *m)
{
    const kv_model_config *c = &m->cfg;
    cJSON *mo = cJSON_AddObjectToObject(r, "model");
    cJSON_AddStringToObject(mo, "name", c->name);
    cJSON_AddStringToObject(mo, "format", c->format);
    cJSON_AddNumberToObject(mo, "layers", c->n_layers);
    cJSON_AddNumberToObject(mo, "heads", c->n_heads);
    cJSON_AddNumberToObject(mo, "kv_heads", c->n_kv_heads);
    cJSON_AddNumberToObject(mo, "head_dim", c->head_dim);
    cJSON_AddNumberToObject(mo, "vocab", c->vocab_size);
    cJSON_AddNumberToObject(mo, "weight_bytes", (double)kv_model_weight_bytes(m));
}

static void add_layers(cJSON *r, const kv_runner *run, int n_steps)
{
    cJSON *la = cJSON_AddArrayToObject(r, "layers");
    for (int l = 0; l < kv_runner_n_layers(run); l++) {
        kv_bytes b;
        kv_runner_layer_bytes(run, l, &b);
        const kv_policy_params *lp = kv_runner_params(run, l);
        char desc[256];
        kv_policy_desc(lp, desc, sizeof desc);
        cJSON *lo = cJSON_CreateObject();
        cJSON_AddNumberToObject(lo, "layer", l);
        cJSON_AddStringToObject(lo, "policy", kv_policy_kind_name(lp->kind));
        cJSON_AddStringToObject(lo, "params", desc);
        cJSON_AddNumberToObject(lo, "tokens", kv_runner_layer_tokens(run, l));
        cJSON_AddNumberToObject(lo, "gpu_bytes", (double)b.resident);
        cJSON_AddNumberToObject(lo, "host_bytes", (double)b.host);
        cJSON_AddNumberToObject(lo, "disk_bytes", (double)b.disk);
        cJSON_AddNumberToObject(lo, "fetched_bytes_last", (double)b.fetched_last);
        cJSON_AddNumberToObject(lo, "fetched_bytes_total", (double)b.fetched_total);
        cJSON_AddNumberToObject(lo, "pcie_bytes_per_token", n_steps ? (double)b.fetched_total / n_steps : 0);
        cJSON_AddItemToArray(la, lo);
    }
}

kv_status kv_runner_report(const kv_runner *run, const kv_run_info *info, char **json)
{
    *json = NULL;
    const kv_generation *gen = info->gen;
    const int n_gen = gen ? gen->n_gen : 0, n_steps = gen ? gen->n_steps : 0;
    double *ms = malloc(((size_t)n_steps + 1) * sizeof *ms);
    cJSON *r = cJSON_CreateObject();
    if (!ms || !r) {
        free(ms);
        cJSON_Delete(r);
        return kv_fail(KV_E_NOMEM, "out of memory writing the report");
    }
    if (n_steps) memcpy(ms, gen->step_ms, (size_t)n_steps * sizeof *ms);
    kv_stats st;
    kv_stats_of(ms, n_steps, &st);
    free(ms);
    add_model(r, kv_runner_model(run));
#ifdef _OPENMP
    cJSON_AddNumberToObject(r, "threads", omp_get_max_threads());
#else
    cJSON_AddNumberToObject(r, "threads", 1);
#endif
    cJSON_AddStringToObject(r, "isa", kv_matmul_isa());
    cJSON_AddStringToObject(r, "device", kv_runner_device(run));
    cJSON_AddNumberToObject(r, "ctx", kv_runner_ctx(run));
    cJSON_AddNumberToObject(r, "prompt_tokens", info->n_prompt);
    cJSON_AddNumberToObject(r, "generated_tokens", n_gen);
    cJSON *ids = cJSON_AddArrayToObject(r, "generated_ids");
    for (int i = 0; i < n_gen; i++) cJSON_AddItemToArray(ids, cJSON_CreateNumber(gen->tokens[i]));
    if (info->text) cJSON_AddStringToObject(r, "text", info->text);
    else cJSON_AddNullToObject(r, "text");
    cJSON_AddStringToObject(r, "stop", gen ? kv_gen_end_name(gen->end) : "steps");
    if (info->prefill) cJSON_AddItemToObject(r, "prefill", kv_prefill_info_json(info->prefill));
    cJSON_AddNumberToObject(r, "prefill_ms", info->prefill_ms);
    cJSON_AddNumberToObject(r, "prefill_tokens_per_s",
                            info->prefill_ms > 0 ? info->n_prompt / (info->prefill_ms / 1e3) : 0);
    if (info->reuse) {
        const kv_reuse_info *u = info->reuse;
        cJSON_AddNumberToObject(r, "reused_tokens", u->reused_tokens);
        cJSON_AddNumberToObject(r, "prefilled_tokens", u->prefilled_tokens);
        cJSON_AddNumberToObject(r, "ttft_ms", u->ttft_ms);
        cJSON *br = cJSON_AddObjectToObject(r, "bytes_read");
        static const char *tn[3] = {"gpu", "host", "disk"};
        for (int i = 0; i < 3; i++) cJSON_AddNumberToObject(br, tn[i], (double)u->bytes_read[i]);
        cJSON *ro = u->extra ? cJSON_Parse(u->extra) : NULL;
        if (!ro || !cJSON_IsObject(ro)) {
            cJSON_Delete(ro);
            ro = cJSON_CreateObject();
        }
        cJSON_AddStringToObject(ro, "source", u->source ? u->source : "kv");
        cJSON_AddNumberToObject(ro, "matched", u->matched);
        cJSON_AddNumberToObject(ro, "lookup_ms", u->lookup_ms);
        cJSON_AddItemToObject(r, "reuse", ro);
    } else {
        cJSON_AddNumberToObject(r, "reused_tokens", 0);
        cJSON_AddNumberToObject(r, "prefilled_tokens", info->n_prompt);
        cJSON_AddNumberToObject(r, "ttft_ms", info->prefill_ms);
    }
    const kv_gpu_engine *g = kv_runner_gpu(run);
    if (g) { /* how the decode steps reached the GPU (CUDA graphs, --graph) */
        kv_gpu_graph_info gi;
        kv_gpu_engine_graph_info(g, &gi);
        cJSON_AddStringToObject(r, "graph", gi.state);
        cJSON *go = cJSON_AddObjectToObject(r, "graph_steps");
        cJSON_AddNumberToObject(go, "steps", (double)gi.steps);
        cJSON_AddNumberToObject(go, "captured", (double)gi.captured);
        cJSON_AddNumberToObject(go, "updated", (double)gi.updated);
        cJSON_AddNumberToObject(go, "instantiated", (double)gi.instantiated);
        cJSON_AddNumberToObject(go, "update_refused", (double)gi.refused);
        cJSON_AddNumberToObject(go, "host_us", gi.host_us);
    } else {
        cJSON_AddNullToObject(r, "graph");
    }
    cJSON_AddNumberToObject(r, "decode_steps", n_steps);
    cJSON_AddNumberToObject(r, "ms_per_token_median", st.median);
    cJSON_AddNumberToObject(r, "ms_per_token_p90", st.p90);
    cJSON_AddNumberToObject(r, "tokens_per_s", st.sum > 0 ? n_steps / (st.sum / 1e3) : 0);
    kv_bytes tot;
    kv_runner_bytes(run, &tot);
    cJSON *kb = cJSON_AddObjectToObject(r, "kv_bytes");
    cJSON_AddNumberToObject(kb, "gpu", (double)tot.resident);
    cJSON_AddNumberToObject(kb, "host", (double)tot.host);
    cJSON_AddNumberToObject(kb, "disk", (double)tot.disk);
    cJSON_AddNumberToObject(r, "pcie_bytes_per_token", n_steps ? (double)tot.fetched_total / n_steps : 0);
    cJSON_AddStringToObject(r, "kv_dtype", info->kv_dtype ? info->kv_dtype : "f32");
    add_layers(r, run, n_steps);
    *json = cJSON_Print(r);
    cJSON_Delete(r);
    return *json ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory writing the report");
}

cJSON *kv_prefill_info_json(const kv_prefill_info *p)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "device", p->device ? p->device : "cpu");
    cJSON_AddStringToObject(o, "method", p->chunked ? "chunked" : "tokens");
    cJSON_AddNumberToObject(o, "chunk", p->chunked ? p->chunk : 1);
    cJSON_AddStringToObject(o, "why", p->why);
    return o;
}
