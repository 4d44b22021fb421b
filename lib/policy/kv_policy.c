/*
 * kv_policy: the registry that builds one layer's policy from its
 * parameters, checked once here (kv_policy_check), dispatching to
 * lib/policy/kv_policy_<kind>.c.
 */
#include "policy/kv_policy.h"

#include <stdlib.h>

#include "policy/kv_policy_int.h"

// --- construction -------------------------------------------------------

kv_status kv_policy_new(const kv_policy_geom *g, const kv_policy_params *prm,
                           kv_policy **out)
{
    *out = NULL;
    kv_status st = kv_policy_check(prm, g, KV_DEVICE_CPU);
    if (st) return st;
    switch (prm->kind) {
    case KV_POL_FULL: st = kv_policy_full_new(g, prm, out); break;
    case KV_POL_QUANT: st = kv_policy_quant_new(g, prm, out); break;
    case KV_POL_SPARSE: st = kv_policy_sparse_new(g, prm, out); break;
    case KV_POL_STREAMING: st = kv_policy_streaming_new(g, prm, out); break;
    case KV_POL_DSQ: st = kv_policy_dsq_new(g, prm, out); break;
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

