/*
 * kv_policy_check: the one validation of a layer's parameters.  Both
 * engines call it (the CPU through kv_policy_new, the GPU engine before
 * it places a layer), so a bad spec fails with the same message whichever
 * device runs it, and a setting only one engine runs is refused by name.
 */
#include "policy/kv_policy.h"

#include "policy/kv_policy_dsqp.h"
#include "quant/kv_dsq.h"
#include "quant/kv_kivi.h"

/* Fail with "layer N policy KIND: detail" (detail from a lower check or fmt). */
#define BAD(code, ...) \
    return (kv_fail(code, __VA_ARGS__), kv_errcontext("layer %d policy %s", g->layer, kind), code)

kv_status kv_policy_check(const kv_policy_params *p, const kv_policy_geom *g, kv_device dev)
{
    const char *kind = kv_policy_kind_name(p->kind);
    if ((unsigned)p->kind >= KV_POL_COUNT)
        return kv_fail(KV_E_USAGE, "layer %d: unknown policy kind %d", g->layer, (int)p->kind);
    if (g->n_heads <= 0 || g->n_kv_heads <= 0 || g->head_dim <= 0 || g->max_tokens <= 0 ||
        g->n_heads % g->n_kv_heads)
        return kv_fail(KV_E_USAGE, "layer %d: bad attention geometry (%d heads, %d KV heads, dim %d, %d tokens)",
                       g->layer, g->n_heads, g->n_kv_heads, g->head_dim, g->max_tokens);
    if (p->kind != KV_POL_QUANT && p->kind != KV_POL_DSQ && (unsigned)p->dtype > KV_DT_BF16)
        BAD(KV_E_USAGE, "dtype %d is not f32, f16 or bf16", (int)p->dtype);
    const bool cpu = dev == KV_DEVICE_CPU, gpu = dev == KV_DEVICE_CUDA;
    kv_status st;
    switch (p->kind) {
    case KV_POL_FULL:
        if (cpu && p->offload)
            BAD(KV_E_USAGE, "offload=on is a GPU engine placement (the CPU keeps every layer in "
                            "host memory): use --device cuda");
        break;
    case KV_POL_QUANT: {
        kv_kivi_params kp = {p->bits, p->group, p->residual};
        if ((st = kv_kivi_check(&kp, g->head_dim))) {
            kv_errcontext("layer %d policy %s", g->layer, kind);
            return st;
        }
        break;
    }
    case KV_POL_DSQ: {
        kv_dsq_params dp[2];
        kv_policy_dsq_params(p, &dp[0], &dp[1]);
        for (int pass = 0; pass < 2; pass++) {
            if ((st = kv_dsq_check(&dp[pass], g->head_dim))) {
                kv_errcontext("layer %d policy %s", g->layer, kind);
                return st;
            }
        }
        if (!(p->hcap_token_keep > 0.0 && p->hcap_token_keep <= 1.0) ||
            !(p->hcap_channel_thresh >= 0.0 && p->hcap_channel_thresh < 1.0))
            BAD(KV_E_USAGE, "keep must be in (0, 1] and chan in [0, 1)");
        if (gpu && (p->hcap_token_keep < 1.0 || p->hcap_channel_thresh > 0.0))
            BAD(KV_E_UNSUPPORTED, "HCAP (keep < 1 or chan > 0) is not on the GPU engine; use --device cpu");
        break;
    }
    case KV_POL_STREAMING:
        if (p->sink < 0 || p->window < 1)
            BAD(KV_E_USAGE, "needs sink >= 0 and window >= 1 (got %d, %d)", p->sink, p->window);
        break;
    case KV_POL_SPARSE:
        if (p->sink < 0 || p->window < 0 || p->channels < 1 || p->topk < 0 ||
            !(p->topk_frac >= 0.0 && p->topk_frac <= 1.0) || (unsigned)p->select >= KV_SELECT_COUNT || p->page < 1 ||
            (p->cbits != 1 && p->cbits != 2 && p->cbits != 4 && p->cbits != 8 && p->cbits != 16))
            BAD(KV_E_USAGE, "bad parameters (sink %d, window %d, channels %d, k %d, frac %g, page %d, "
                "cbits %d)", p->sink, p->window, p->channels, p->topk, p->topk_frac, p->page, p->cbits);
        if (cpu && p->select == KV_SELECT_SKETCH)
            BAD(KV_E_USAGE, "select=sketch is a GPU engine selection (a resident key sketch): use "
                            "--device cuda, or select=channels on the CPU");
        if (cpu && g->head_dim > 1024) BAD(KV_E_UNSUPPORTED, "head dim %d > 1024", g->head_dim);
        if (gpu && p->select == KV_SELECT_PCA)
            BAD(KV_E_UNSUPPORTED, "select=pca is a CPU engine selection for now: use --device cpu, "
                                  "or select=resident on the GPU");
        if (p->select == KV_SELECT_PCA && g->head_dim > 256)
            BAD(KV_E_UNSUPPORTED, "select=pca needs head dim <= 256 (got %d)", g->head_dim);
        /* the GPU keeps channel-major keys of exactly head_dim channels */
        if (gpu && p->channels > g->head_dim)
            BAD(KV_E_USAGE, "channels %d > head dim %d", p->channels, g->head_dim);
        if (gpu && (g->n_heads / g->n_kv_heads > 8 || (g->head_dim & 7)))
            BAD(KV_E_UNSUPPORTED, "the GPU engine needs a query group of at most 8 and head_dim a "
                                  "multiple of 8");
        break;
    default: break;
    }
    return KV_OK;
}
