/*
 * kv_policy: the registry that builds one layer's policy from its
 * parameters, dispatching to lib/policy/kv_policy_<kind>.c.
 */
#include "policy/kv_policy.h"

#include <stdlib.h>

#include "policy/kv_policy_int.h"

// --- construction -------------------------------------------------------

kv_status kv_policy_create(const kv_policy_geom *g, const kv_policy_params *prm,
                           kv_policy **out)
{
    *out = NULL;
    if (g->n_heads <= 0 || g->n_kv_heads <= 0 || g->head_dim <= 0 || g->max_tokens <= 0 ||
        g->n_heads % g->n_kv_heads)
        return kv_fail(KV_E_USAGE, "layer %d: bad attention geometry (%d heads, %d KV heads, dim %d, %d tokens)",
                       g->layer, g->n_heads, g->n_kv_heads, g->head_dim, g->max_tokens);
    kv_status st;
    switch (prm->kind) {
    case KV_POL_FULL: st = kv_policy_full_create(g, prm, out); break;
    case KV_POL_QUANT: st = kv_policy_quant_create(g, prm, out); break;
    case KV_POL_SPARSE: st = kv_policy_sparse_create(g, prm, out); break;
    case KV_POL_STREAMING: st = kv_policy_streaming_create(g, prm, out); break;
    case KV_POL_DSQ: st = kv_policy_dsq_create(g, prm, out); break;
    default: return kv_fail(KV_E_USAGE, "unknown policy kind %d", (int)prm->kind);
    }
    if (st) {
        kv_errcontext("layer %d policy %s", g->layer, kv_policy_kind_name(prm->kind));
        return st;
    }
    (*out)->g = *g;
    (*out)->prm = *prm;
    return KV_OK;
}

void kv_policy_free(kv_policy *p)
{
    if (p) p->ops->destroy(p);
}

