/*
 * kv_prefix: a stored cache to continue from (see kv_prefix.h): the match
 * against the model, the rows' positions, the rows as float32, and the
 * packed layers handed to the policy that holds them packed.
 */
#include "policy/kv_prefix.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_finite.h"
#include "common/kv_half.h"
#include "quant/kv_layer_io.h"

static bool near(double a, double b) { return fabs(a - b) <= 1e-6 * fmax(fabs(a), fabs(b)); }

kv_status kv_prefix_check_model(const kv_model *m, const kv_geom *g)
{
    kv_geom mg;
    kv_model_geom(m, &mg);
#define DIFF(what, a, b) \
    if ((a) != (b)) return kv_fail(KV_E_DATA, "the cache has %d %s, the model %d", (int)(a), what, (int)(b))
    DIFF("layers", g->n_layers, mg.n_layers);
    DIFF("KV heads", g->n_kv_heads, mg.n_kv_heads);
    DIFF("as head_dim", g->head_dim, mg.head_dim);
    if (g->n_heads) DIFF("query heads", g->n_heads, mg.n_heads);
#undef DIFF
    if (!g->keys_roped)
        return kv_fail(KV_E_DATA, "the cache stores keys before RoPE (kvc.keys_roped false); the engines continue only from roped keys");
    if (g->rope_layout != KV_ROPE_INTERLEAVED)
        return kv_fail(KV_E_DATA, "the cache rotates split halves (kvc.rope_layout halves); this model's engine rotates interleaved pairs");
    if (!near(g->rope_theta, mg.rope_theta))
        return kv_fail(KV_E_DATA, "the cache has rope_theta %g, the model %g", g->rope_theta, mg.rope_theta);
    if (g->rope_scaling != mg.rope_scaling)
        return kv_fail(KV_E_DATA, "the cache has RoPE scaling %s, the model %s",
                       g->rope_scaling ? "llama3" : "none", mg.rope_scaling ? "llama3" : "none");
    if (g->rope_scaling == KV_ROPE_SCALING_LLAMA3 &&
        (!near(g->rope_factor, mg.rope_factor) || !near(g->rope_low_freq_factor, mg.rope_low_freq_factor) ||
         !near(g->rope_high_freq_factor, mg.rope_high_freq_factor) || g->rope_orig_ctx != mg.rope_orig_ctx))
        return kv_fail(KV_E_DATA, "the cache's llama3 RoPE scaling parameters differ from the model's");
    if (g->model[0] && mg.model[0] && strcmp(g->model, mg.model))
        return kv_fail(KV_E_DATA, "the cache is from model '%s', this is '%s'", g->model, mg.model);
    return KV_OK;
}

kv_status kv_prefix_from_kvc(const kv_model *m, const kvc_file *f, kv_prefix *p)
{
    memset(p, 0, sizeof *p);
    kv_status st = kv_prefix_check_model(m, kvc_geom(f));
    return st ? st : kv_prefix_read(f, p);
}

kv_status kv_prefix_read(const kvc_file *f, kv_prefix *p)
{
    memset(p, 0, sizeof *p);
    const kv_geom *g = kvc_geom(f);
    p->f = f;
    p->T = g->n_tokens;
    p->n_kv_heads = g->n_kv_heads;
    p->head_dim = g->head_dim;
    const kvc_tensor *tt = kvc_find(f, "tokens");
    if (tt && tt->dtype == KV_DT_I32 && tt->ndim == 1 && tt->shape[0] == p->T) p->tokens = tt->data;
    const kvc_tensor *pt = kvc_find(f, "positions");
    int last = p->T - 1;
    if (pt) {
        if (pt->dtype != KV_DT_I32 || pt->ndim != 1 || pt->shape[0] != p->T)
            return kv_fail(KV_E_DATA, "positions must be I32 [%d]", p->T);
        const unsigned char *b = pt->data;
        int prev = -1;
        for (int t = 0; t < p->T; t++) {
            int32_t x;
            memcpy(&x, b + 4 * (size_t)t, 4);
            if (x <= prev) return kv_fail(KV_E_DATA, "positions[%d] = %d: positions must increase strictly from 0 up", t, x);
            prev = x;
        }
        last = prev;
        p->positions = pt->data;
    }
    p->matched = last + 1;
    const char *mt = kvc_meta(f, "kvtree.matched");
    if (mt) {
        char *end;
        long v = strtol(mt, &end, 10);
        if (*end || end == mt || v < last + 1 || v > (1L << 24))
            return kv_fail(KV_E_DATA, "kvtree.matched '%s' is not a length of at least %d", mt, last + 1);
        p->matched = (int)v;
    }
    return KV_OK;
}

bool kv_prefix_is_whole(const kv_prefix *p) { return p->tokens && p->matched == p->T; }

kv_status kv_prefix_rows_f32(const kv_prefix *p, int layer, char which, float *out)
{
    kv_status wst = kv_prefix_wait(p, layer);
    if (wst) return wst;
    const size_t n = (size_t)p->n_kv_heads * (size_t)p->T * (size_t)p->head_dim;
    char name[64];
    snprintf(name, sizeof name, "layers.%d.%c", layer, which);
    if (p->f) {
        kv_status st = kv_layer_decode(p->f, layer, which, out);
        if (st) return st;
    } else {
        if (p->device) return kv_fail(KV_E_INTERNAL, "a prefix in GPU memory cannot be read on the host");
        const size_t es = p->dt == KV_DT_F32 ? 4 : 2, D = (size_t)p->head_dim;
        if (p->dt != KV_DT_F32 && p->dt != KV_DT_F16 && p->dt != KV_DT_BF16)
            return kv_fail(KV_E_INTERNAL, "prefix rows of type %s", kv_dtype_name(p->dt));
        kv_prefix_seg one = {p->T, p->ld, p->k, p->v};
        const kv_prefix_seg *sg = p->nseg ? p->seg : &one;
        const int ns = p->nseg ? p->nseg : 1;
        for (int h = 0; h < p->n_kv_heads; h++) {
            size_t t0 = 0;
            for (int i = 0; i < ns && t0 < (size_t)p->T; i++) {
                const size_t ld = (size_t)(sg[i].ld ? sg[i].ld : sg[i].T), rows = (size_t)sg[i].T;
                const char *hs = (const char *)(which == 'k' ? sg[i].k[layer] : sg[i].v[layer]) + (size_t)h * ld * D * es;
                float *o = out + ((size_t)h * (size_t)p->T + t0) * D;
                const size_t m = rows * D;
                if (p->dt == KV_DT_F32) memcpy(o, hs, m * 4);
                else if (p->dt == KV_DT_F16)
                    for (size_t j = 0; j < m; j++) o[j] = kv_half_to_f32(((const uint16_t *)hs)[j]);
                else
                    for (size_t j = 0; j < m; j++) o[j] = kv_bf16_to_f32(((const uint16_t *)hs)[j]);
                t0 += rows;
            }
        }
        (void)n;
    }
    return kv_check_finite3(name, out, p->n_kv_heads, p->T, p->head_dim, "the continued cache");
}

kv_status kv_prefix_wait(const kv_prefix *p, int layer)
{
    if (!p->wait) return KV_OK;
    kv_status st = p->wait(p->wait_user, layer);
    if (st) kv_errcontext("the cached rows of layer %d", layer);
    return st;
}

kv_status kv_prefix_rows_f16(const kv_prefix *p, int layer, char which, uint16_t *out)
{
    kv_status wst = kv_prefix_wait(p, layer);
    if (wst) return wst;
    const size_t n = (size_t)p->n_kv_heads * (size_t)p->T * (size_t)p->head_dim;
    /* plain F16 tensors of a file (the common case, kv-tree's chunks): straight copies */
    if (p->f) {
        char name[64];
        snprintf(name, sizeof name, "layers.%d.%c", layer, which);
        const kvc_tensor *t = kvc_find(p->f, name);
        if (t && t->dtype == KV_DT_F16 && (uint64_t)t->nbytes == n * 2) {
            memcpy(out, t->data, n * 2);
            for (size_t i = 0; i < n; i++) /* non-finite halves: exponent all ones */
                if ((out[i] & 0x7c00) == 0x7c00)
                    return kv_fail(KV_E_DATA, "%s holds a NaN or infinite value: the continued cache needs finite values", name);
            return KV_OK;
        }
    } else if (!p->device && p->dt == KV_DT_F16 && !p->nseg) {
        const char *src = which == 'k' ? p->k[layer] : p->v[layer];
        const size_t ld = (size_t)(p->ld ? p->ld : p->T), row = (size_t)p->T * (size_t)p->head_dim;
        for (int h = 0; h < p->n_kv_heads; h++)
            memcpy(out + (size_t)h * row, src + (size_t)h * ld * (size_t)p->head_dim * 2, row * 2);
        return KV_OK;
    }
    float *f = malloc((n ? n : 1) * sizeof *f);
    if (!f) return kv_fail(KV_E_NOMEM, "out of memory for %zu cached values", n);
    kv_status st = kv_prefix_rows_f32(p, layer, which, f);
    for (size_t i = 0; !st && i < n; i++) out[i] = kv_f32_to_half(f[i]);
    free(f);
    return st;
}

kv_status kv_prefix_layer_packed(const kv_prefix *p, int layer, bool *packed, kv_policy_params *prm)
{
    *packed = false;
    if (!p->f) return KV_OK;
    kv_encoding ek, ev;
    kv_status st = kv_layer_encoding(p->f, layer, 'k', &ek);
    if (!st) st = kv_layer_encoding(p->f, layer, 'v', &ev);
    if (st) return st;
    if (ek == KV_ENC_PLAIN && ev == KV_ENC_PLAIN) return KV_OK;
    if (ek != ev)
        return kv_fail(KV_E_UNSUPPORTED, "layer %d stores K as %s and V as %s: a packed layer is continued only with K and V packed alike",
                       layer, kv_encoding_name(ek), kv_encoding_name(ev));
    if (ek == KV_ENC_KIVI) {
        kv_kivi_params a, b;
        if (!kvc_layer_kivi(p->f, layer, 'k', &a) || !kvc_layer_kivi(p->f, layer, 'v', &b))
            return kv_fail(KV_E_DATA, "layer %d: unreadable KIVI parameters", layer);
        if (a.bits != b.bits || a.group != b.group || a.residual != b.residual)
            return kv_fail(KV_E_UNSUPPORTED, "layer %d packs K and V with different KIVI parameters", layer);
        kv_policy_params_default(prm, KV_POL_QUANT);
        prm->bits = a.bits, prm->group = a.group, prm->residual = a.residual;
    } else {
        kv_dsq_packed k, v;
        if ((st = kv_dsq_read(p->f, layer, 'k', &k))) return st;
        if ((st = kv_dsq_read(p->f, layer, 'v', &v))) {
            kv_dsq_clear(&k);
            return st;
        }
        /* the layout parameters (base says how a writer chose the keys' base);
         * keys and values may have their own bits (dsq:kbits, vbits) */
        bool same = k.prm.window == v.prm.window && k.prm.salient == v.prm.salient &&
                    k.prm.group == v.prm.group;
        kv_dsq_params dp = k.prm;
        const int vbits = v.prm.bits;
        kv_dsq_clear(&k);
        kv_dsq_clear(&v);
        if (!same) return kv_fail(KV_E_UNSUPPORTED, "layer %d packs K and V with different DSQ parameters", layer);
        kv_policy_params_default(prm, KV_POL_DSQ);
        prm->dsq_window = dp.window;
        prm->dsq_salient = (double)dp.salient / (double)dp.window;
        prm->dsq_kbits = dp.bits;
        prm->dsq_vbits = vbits;
        prm->dsq_group = dp.group;
    }
    *packed = true;
    return KV_OK;
}

kv_status kv_policy_load(kv_policy *pol, const kv_prefix *p, int layer)
{
    if (!pol->ops->load)
        return kv_fail(KV_E_INTERNAL, "layer %d policy %s cannot load packed data", layer,
                       kv_policy_kind_name(pol->prm.kind));
    if (p->T > pol->g.max_tokens)
        return kv_fail(KV_E_USAGE, "the cache holds %d tokens, more than the context of %d", p->T, pol->g.max_tokens);
    return pol->ops->load(pol, p->f, layer);
}
