/*
 * The GPU engine in a CPU-only build (KV_HAVE_CUDA undefined): every entry
 * point of kv_gpu_engine.h reports the engine unavailable (KV_E_UNAVAILABLE
 * with a one-line reason) or returns zeros, so that CPU-only, sanitizer and
 * fuzz builds link the same API.  kv_gpu_engine_opts_default is in
 * kv_gpu_engine.c, which compiles in both builds.
 */
#include "gpu/kv_gpu_engine.h"

#ifndef KV_HAVE_CUDA

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kv_gpu_engine {
    int unused;
};

kv_status kv_gpu_engine_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                            const kv_gpu_engine_opts *opts, kv_gpu_engine **out)
{
    (void)m; (void)per_layer; (void)ctx; (void)opts;
    *out = NULL;
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA: the GPU engine is "
                   "unavailable (use --device cpu)");
}

kv_status kv_gpu_engine_new_sharing(const kv_gpu_engine *src, const kv_policy_params *per_layer,
                                    int ctx, const kv_gpu_engine_opts *opts, kv_gpu_engine **out)
{
    (void)src; (void)per_layer; (void)ctx; (void)opts;
    *out = NULL;
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA");
}

void kv_gpu_engine_free(kv_gpu_engine *e) { free(e); }

static kv_status no_cuda(void)
{
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA");
}

kv_status kv_gpu_engine_reset(kv_gpu_engine *e, const kv_policy_params *per_layer)
{
    (void)e; (void)per_layer;
    return no_cuda();
}

kv_status kv_gpu_engine_reset_opts(kv_gpu_engine *e, const kv_policy_params *per_layer,
                                   const kv_gpu_engine_opts *opts)
{
    (void)e; (void)per_layer; (void)opts;
    return no_cuda();
}

kv_status kv_gpu_engine_prefill(kv_gpu_engine *e, const int *tokens, int n, float *logits_last)
{
    (void)e; (void)tokens; (void)n; (void)logits_last;
    return no_cuda();
}

kv_status kv_gpu_engine_prefill_from(kv_gpu_engine *e, const kv_prefix *pre, const int *tokens,
                                     int n, float *logits_last)
{
    (void)e; (void)pre; (void)tokens; (void)n; (void)logits_last;
    return no_cuda();
}

kv_status kv_gpu_engine_step(kv_gpu_engine *e, int token, float *logits)
{
    (void)e; (void)token; (void)logits;
    return no_cuda();
}

kv_status kv_gpu_engine_generate(kv_gpu_engine *e, int token, int n, int *out, float *step_ms)
{
    (void)e; (void)token; (void)n; (void)out; (void)step_ms;
    return no_cuda();
}

kv_status kv_gpu_engine_synthesize(kv_gpu_engine *e, int T, uint64_t seed)
{
    (void)e; (void)T; (void)seed;
    return no_cuda();
}

void kv_gpu_engine_set_no_fetch(kv_gpu_engine *e, bool no_fetch) { (void)e; (void)no_fetch; }
void kv_gpu_engine_set_sel_opts(kv_gpu_engine *e, bool classic, int ahead, int sel_blocks, int gather_blocks)
{
    (void)e, (void)classic, (void)ahead, (void)sel_blocks, (void)gather_blocks;
}
void kv_gpu_engine_set_sel_kernels(kv_gpu_engine *e, int sel_kernels, int sel_every)
{
    (void)e, (void)sel_kernels, (void)sel_every;
}
void kv_gpu_engine_set_sel_skip(kv_gpu_engine *e, unsigned sel_skip) { (void)e, (void)sel_skip; }
kv_status kv_gpu_engine_set_step_opts(kv_gpu_engine *e, bool sel_serial, bool topk_wide,
                                      bool sel_cache, bool profile)
{
    (void)e, (void)sel_serial, (void)topk_wide, (void)sel_cache, (void)profile;
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA");
}
int kv_gpu_engine_vocab(const kv_gpu_engine *e) { (void)e; return 0; }
int kv_gpu_engine_pos(const kv_gpu_engine *e) { (void)e; return 0; }
int kv_gpu_engine_ctx(const kv_gpu_engine *e) { (void)e; return 0; }
int kv_gpu_engine_n_layers(const kv_gpu_engine *e) { (void)e; return 0; }
const char *kv_gpu_engine_device(const kv_gpu_engine *e) { (void)e; return "none (CUDA not built in)"; }
int kv_gpu_engine_ordinal(const kv_gpu_engine *e) { (void)e; return -1; }
uint64_t kv_gpu_engine_weight_bytes(const kv_gpu_engine *e) { (void)e; return 0; }
uint64_t kv_gpu_engine_weight_read_bytes(const kv_gpu_engine *e) { (void)e; return 0; }

kv_status kv_gpu_engine_layer_bytes(const kv_gpu_engine *e, int layer, kv_bytes *b)
{
    (void)e; (void)layer;
    memset(b, 0, sizeof *b);
    return no_cuda();
}

void kv_gpu_engine_bytes(const kv_gpu_engine *e, kv_bytes *total)
{
    (void)e;
    memset(total, 0, sizeof *total);
}

double kv_gpu_engine_prefill_attn_ms(const kv_gpu_engine *e) { return 0; }

kv_status kv_gpu_engine_warm(kv_gpu_engine *e, int rows, double *ms, bool *ran)
{
    (void)e, (void)rows;
    if (ms) *ms = 0;
    if (ran) *ran = false;
    return kv_fail(KV_E_UNAVAILABLE, "GPU engine: CUDA not built in");
}

const kv_policy_params *kv_gpu_engine_layer_params(const kv_gpu_engine *e, int layer)
{
    (void)e, (void)layer;
    return NULL;
}

void kv_gpu_engine_prefill_phases(const kv_gpu_engine *e, kv_gpu_prefill_phases *out)
{
    (void)e;
    memset(out, 0, sizeof *out);
}

kv_status kv_gpu_engine_keep(kv_gpu_engine *e, int nq, bool prompt_kv)
{
    (void)e; (void)nq; (void)prompt_kv;
    return no_cuda();
}

const uint16_t *kv_gpu_engine_prompt_kv(const kv_gpu_engine *e, int layer, char which, int *T)
{
    (void)e; (void)layer; (void)which;
    *T = 0;
    return NULL;
}

int kv_gpu_engine_queries(const kv_gpu_engine *e, int layer, uint16_t *out)
{
    (void)e; (void)layer; (void)out;
    return 0;
}

bool kv_gpu_engine_prefill_method(kv_gpu_engine *e, int *chunk, char *why, size_t why_len)
{
    (void)e;
    *chunk = 0;
    if (why_len) snprintf(why, why_len, "CUDA not built in");
    return false;
}

void kv_gpu_engine_timing(const kv_gpu_engine *e, kv_gpu_timing *t)
{
    (void)e;
    memset(t, 0, sizeof *t);
}

void kv_gpu_engine_graph_info(const kv_gpu_engine *e, kv_gpu_graph_info *gi)
{
    (void)e;
    memset(gi, 0, sizeof *gi);
    snprintf(gi->state, sizeof gi->state, "off");
}

#endif /* !KV_HAVE_CUDA */
