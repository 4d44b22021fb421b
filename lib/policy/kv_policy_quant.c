/*
 * The `quant` policy (KIVI): keys quantized per channel over groups of G
 * tokens, values per token over groups of Gv = min(G, D) channels, 1, 2 or
 * 4 bits, fp16 scale and zero, in the planar layout of lib/common/kv_layout.h,
 * with lib/kv_quant's group/row quantizers (the code kv-quant uses).  The
 * most recent tokens stay in fp16 until a full group can be quantized:
 * after T tokens the first nq = kv_kivi_nquant(T, G, R) are packed and the
 * remaining T - nq (R to R+G-1 once T > R) are fp16.
 *
 * Inputs are rounded to fp16 before quantization in both ingest and
 * append, so a prompt ingested at once and the same tokens appended one by
 * one give identical codes (and identical codes to kv-quant on an fp16
 * .kvc).  Attention dequantizes rows on the fly (kv_kivi_dequant_row) and
 * runs the dense reference over them.
 *
 * Bytes (all resident), with H KV heads, b bits, Gv value group:
 *   keys   = H * (nq*D*b/8 + 2*2*(nq/G)*D)
 *   values = H * (nq*D*b/8 + 2*2*nq*(D/Gv))
 *   fp16   = 2 * H * (T - nq) * D * 2
 * which is kv_kivi_bytes(keys) + kv_kivi_bytes(values).
 */
#include <stdlib.h>
#include <string.h>

#include "common/kv_half.h"
#include "policy/kv_policy_int.h"
#include "quant/kv_layer_io.h"
#include "quant/kv_quant.h"

typedef struct {
    kv_policy base;
    kv_kivi_params kp;
    int gv;          /* channels per value group */
    int nq;          /* tokens packed */
    int ring;        /* residual ring rows: R + G */
    size_t rb;       /* code bytes per row */
    uint8_t *kcode;  /* (H, max_tokens, rb) */
    kv_half *ks, *kz; /* (H, max_tokens/G + 1, D) */
    uint8_t *vcode;  /* (H, max_tokens, rb) */
    kv_half *vs, *vz; /* (H, max_tokens, D/Gv) */
    kv_half *rk, *rv; /* (H, ring, D) fp16 residual, token t at row t % ring */
    float *tmp;      /* (G, D) one key group being packed */
} quant_policy;

static size_t kgroups(const quant_policy *q) { return (size_t)q->base.g.max_tokens / (size_t)q->kp.group + 1; }

static kv_half *res_row(const quant_policy *q, kv_half *base, int h, int t)
{
    return base + ((size_t)h * (size_t)q->ring + (size_t)(t % q->ring)) * (size_t)q->base.g.head_dim;
}

/* Pack tokens [nq, nq+G) from the residual ring. */
static void pack_group(quant_policy *q)
{
    const int D = q->base.g.head_dim, G = q->kp.group, b = q->kp.bits, H = q->base.g.n_kv_heads;
    const int cap = q->base.g.max_tokens, t0 = q->nq;
    const size_t ng = kgroups(q), nvg = (size_t)(D / q->gv);
    for (int h = 0; h < H; h++) {
        for (int i = 0; i < G; i++) {
            const kv_half *r = res_row(q, q->rk, h, t0 + i);
            for (int c = 0; c < D; c++) q->tmp[(size_t)i * (size_t)D + (size_t)c] = kv_half_to_f32(r[c]);
        }
        size_t g = (size_t)(t0 / G);
        kv_kivi_pack_key_group(q->tmp, (size_t)D, G, D, b,
                               q->kcode + ((size_t)h * (size_t)cap + (size_t)t0) * q->rb, q->rb,
                               q->ks + ((size_t)h * ng + g) * (size_t)D,
                               q->kz + ((size_t)h * ng + g) * (size_t)D);
        for (int i = 0; i < G; i++) {
            const kv_half *r = res_row(q, q->rv, h, t0 + i);
            float row[KV_QUANT_MAX_DIM];
            for (int c = 0; c < D; c++) row[c] = kv_half_to_f32(r[c]);
            size_t t = (size_t)h * (size_t)cap + (size_t)(t0 + i);
            kv_kivi_pack_value_row(row, D, q->gv, b, q->vcode + t * q->rb, q->vs + t * nvg,
                                   q->vz + t * nvg);
        }
    }
    q->nq += G;
}

/* Store token t (k, v rows of head h at stride) in the residual ring. */
static void put_resid(quant_policy *q, int t, const float *k, const float *v, size_t stride)
{
    const int D = q->base.g.head_dim;
    for (int h = 0; h < q->base.g.n_kv_heads; h++) {
        kv_half *rk = res_row(q, q->rk, h, t), *rv = res_row(q, q->rv, h, t);
        for (int c = 0; c < D; c++) {
            rk[c] = kv_f32_to_half(k[(size_t)h * stride + (size_t)c]);
            rv[c] = kv_f32_to_half(v[(size_t)h * stride + (size_t)c]);
        }
    }
}

static kv_status quant_append(kv_policy *p, int pos, const float *k, const float *v)
{
    quant_policy *q = (quant_policy *)p;
    if (pos != p->n_tokens)
        return kv_fail(KV_E_INTERNAL, "append at position %d, but %d tokens are held", pos,
                       p->n_tokens);
    if (p->n_tokens >= p->g.max_tokens)
        return kv_fail(KV_E_USAGE, "KV cache full (%d tokens)", p->g.max_tokens);
    put_resid(q, pos, k, v, (size_t)p->g.head_dim);
    p->n_tokens++;
    if (kv_kivi_nquant(p->n_tokens, q->kp.group, q->kp.residual) > q->nq) pack_group(q);
    return KV_OK;
}

static kv_status quant_ingest(kv_policy *p, const float *k, const float *v, int T)
{
    quant_policy *q = (quant_policy *)p;
    const int D = p->g.head_dim, H = p->g.n_kv_heads;
    if (T < 0 || T > p->g.max_tokens)
        return kv_fail(KV_E_USAGE, "prompt of %d tokens exceeds the KV capacity %d", T,
                       p->g.max_tokens);
    p->n_tokens = 0;
    q->nq = 0;
    /* token by token through the ring: the same codes as appends */
    float *kr = malloc((size_t)H * (size_t)D * sizeof(float));
    float *vr = malloc((size_t)H * (size_t)D * sizeof(float));
    if (!kr || !vr) {
        free(kr);
        free(vr);
        return kv_fail(KV_E_NOMEM, "quant ingest");
    }
    kv_status st = KV_OK;
    for (int t = 0; t < T && st == KV_OK; t++) {
        for (int h = 0; h < H; h++) {
            memcpy(kr + (size_t)h * D, k + ((size_t)h * T + t) * D, (size_t)D * sizeof(float));
            memcpy(vr + (size_t)h * D, v + ((size_t)h * T + t) * D, (size_t)D * sizeof(float));
        }
        st = quant_append(p, t, kr, vr);
    }
    free(kr);
    free(vr);
    return st;
}

/* Dequantize every held token of head h into k, v (T, D). */
static void dequant_head(const quant_policy *q, int h, float *k, float *v)
{
    const int D = q->base.g.head_dim, G = q->kp.group, b = q->kp.bits, T = q->base.n_tokens;
    const int cap = q->base.g.max_tokens;
    const size_t ng = kgroups(q), nvg = (size_t)(D / q->gv);
    for (int t = 0; t < q->nq; t++) {
        size_t g = (size_t)(t / G), r = (size_t)h * (size_t)cap + (size_t)t;
        kv_kivi_dequant_row(q->kcode + r * q->rb, q->ks + ((size_t)h * ng + g) * (size_t)D,
                            q->kz + ((size_t)h * ng + g) * (size_t)D, D, b, 1, k + (size_t)t * D);
        kv_kivi_dequant_row(q->vcode + r * q->rb, q->vs + r * nvg, q->vz + r * nvg, D, b, q->gv,
                            v + (size_t)t * D);
    }
    for (int t = q->nq; t < T; t++) {
        const kv_half *rk = res_row(q, q->rk, h, t), *rv = res_row(q, q->rv, h, t);
        for (int c = 0; c < D; c++) {
            k[(size_t)t * D + (size_t)c] = kv_half_to_f32(rk[c]);
            v[(size_t)t * D + (size_t)c] = kv_half_to_f32(rv[c]);
        }
    }
}

static kv_status quant_attend(kv_policy *p, const float *qv, float *out)
{
    quant_policy *q = (quant_policy *)p;
    const kv_policy_geom *g = &p->g;
    const int T = p->n_tokens, D = g->head_dim, grp = g->n_heads / g->n_kv_heads;
    float *k = malloc(((size_t)2 * (size_t)T + 1) * (size_t)D * sizeof(float));
    if (!k) return kv_fail(KV_E_NOMEM, "quant attention scratch for %d tokens", T);
    float *v = k + (size_t)T * (size_t)D;
    for (int h = 0; h < g->n_kv_heads; h++) {
        dequant_head(q, h, k, v);
        size_t o = (size_t)h * (size_t)grp * (size_t)D;
        kv_attend_core(qv + o, k, v, T, T, grp, 1, D, out + o, NULL);
    }
    free(k);
    return KV_OK;
}

static void quant_bytes(const kv_policy *p, kv_bytes *b)
{
    const quant_policy *q = (const quant_policy *)p;
    const int H = p->g.n_kv_heads, T = p->n_tokens, D = p->g.head_dim;
    *b = (kv_bytes){0};
    b->resident = kv_kivi_bytes(KV_KIVI_KEYS, &q->kp, H, T, D) +
                  kv_kivi_bytes(KV_KIVI_VALUES, &q->kp, H, T, D);
}

static void quant_destroy(kv_policy *p)
{
    quant_policy *q = (quant_policy *)p;
    free(q->tmp);
    free(q->rv);
    free(q->rk);
    free(q->vz);
    free(q->vs);
    free(q->vcode);
    free(q->kz);
    free(q->ks);
    free(q->kcode);
    free(q);
}

/* The file's planes into this policy's (same parameters: the caller built
 * the policy from them): codes and scales row for row, the fp16 residual
 * into the ring. */
static kv_status quant_load(kv_policy *p, const kvc_file *f, int layer)
{
    quant_policy *q = (quant_policy *)p;
    kv_kivi_packed K, V;
    kv_status st = kv_kivi_read(f, layer, 'k', &K);
    if (st) return st;
    if ((st = kv_kivi_read(f, layer, 'v', &V))) {
        kv_kivi_clear(&K);
        return st;
    }
    const int H = p->g.n_kv_heads, D = p->g.head_dim, T = K.T, G = q->kp.group;
    if (K.prm.bits != q->kp.bits || K.prm.group != G || K.prm.residual != q->kp.residual ||
        memcmp(&K.prm, &V.prm, sizeof K.prm) || K.n_kv_heads != H || K.head_dim != D || V.T != T) {
        /* the caller builds the policy from the file's keys, so what can
         * differ is the file itself: values packed unlike its keys */
        st = kv_fail(KV_E_DATA, "layer %d: packed K/V parameters differ from each other or from the policy's", layer);
        goto out;
    }
    if (T > p->g.max_tokens) {
        st = kv_fail(KV_E_USAGE, "the cache holds %d tokens, more than the context of %d", T, p->g.max_tokens);
        goto out;
    }
    const size_t cap = (size_t)p->g.max_tokens, ng = kgroups(q), nvg = (size_t)(D / q->gv);
    const size_t nq = (size_t)K.nq, fng = nq / (size_t)G;
    for (int h = 0; h < H; h++) {
        memcpy(q->kcode + (size_t)h * cap * q->rb, K.codes + (size_t)h * nq * q->rb, nq * q->rb);
        memcpy(q->vcode + (size_t)h * cap * q->rb, V.codes + (size_t)h * nq * q->rb, nq * q->rb);
        memcpy(q->ks + (size_t)h * ng * D, K.scale + (size_t)h * fng * D, fng * D * sizeof(kv_half));
        memcpy(q->kz + (size_t)h * ng * D, K.zero + (size_t)h * fng * D, fng * D * sizeof(kv_half));
        memcpy(q->vs + (size_t)h * cap * nvg, V.scale + (size_t)h * nq * nvg, nq * nvg * sizeof(kv_half));
        memcpy(q->vz + (size_t)h * cap * nvg, V.zero + (size_t)h * nq * nvg, nq * nvg * sizeof(kv_half));
        for (int t = (int)nq; t < T; t++) {
            size_t r = ((size_t)h * (size_t)(T - (int)nq) + (size_t)(t - (int)nq)) * (size_t)D;
            memcpy(res_row(q, q->rk, h, t), K.resid + r, (size_t)D * sizeof(kv_half));
            memcpy(res_row(q, q->rv, h, t), V.resid + r, (size_t)D * sizeof(kv_half));
        }
    }
    q->nq = (int)nq;
    p->n_tokens = T;
out:
    kv_kivi_clear(&K);
    kv_kivi_clear(&V);
    return st;
}

static const kv_policy_ops quant_ops = {
    .load = quant_load,
    .ingest = quant_ingest,
    .append = quant_append,
    .attend = quant_attend,
    .bytes = quant_bytes,
    .destroy = quant_destroy,
};

kv_status kv_policy_quant_new(const kv_policy_geom *g, const kv_policy_params *prm,
                                 kv_policy **out)
{
    *out = NULL;
    kv_kivi_params kp = {prm->bits, prm->group, prm->residual}; /* checked by kv_policy_new */
    quant_policy *q = calloc(1, sizeof *q);
    if (!q) return kv_fail(KV_E_NOMEM, "quant policy");
    q->base.ops = &quant_ops;
    q->base.g = *g;
    q->kp = kp;
    q->gv = kv_kivi_vgroup(kp.group, g->head_dim);
    q->ring = kp.residual + kp.group;
    q->rb = kv_kivi_row_bytes(g->head_dim, kp.bits);
    const size_t H = (size_t)g->n_kv_heads, cap = (size_t)g->max_tokens, D = (size_t)g->head_dim;
    const size_t ng = kgroups(q);
    q->kcode = calloc(H * cap, q->rb);
    q->vcode = calloc(H * cap, q->rb);
    q->ks = calloc(H * ng * D, sizeof(kv_half));
    q->kz = calloc(H * ng * D, sizeof(kv_half));
    q->vs = calloc(H * cap * (D / (size_t)q->gv), sizeof(kv_half));
    q->vz = calloc(H * cap * (D / (size_t)q->gv), sizeof(kv_half));
    q->rk = calloc(H * (size_t)q->ring * D, sizeof(kv_half));
    q->rv = calloc(H * (size_t)q->ring * D, sizeof(kv_half));
    q->tmp = calloc((size_t)kp.group * D, sizeof(float));
    if (!q->kcode || !q->vcode || !q->ks || !q->kz || !q->vs || !q->vz || !q->rk || !q->rv ||
        !q->tmp) {
        quant_destroy(&q->base);
        return kv_fail(KV_E_NOMEM, "quant policy for %zu tokens", cap);
    }
    *out = &q->base;
    return KV_OK;
}
