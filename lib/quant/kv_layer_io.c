/*
 * Packed layers in a .kvc file: the planes of KIVI- and DSQ-encoded K/V as
 * safetensors tensors with their per-layer metadata (man/kvc.5), read back,
 * decoded to float32, and counted.
 */
#include <stdlib.h>
#include <string.h>

#include "quant/kv_layer_io.h"

const char *kv_encoding_name(kv_encoding e)
{
    return e == KV_ENC_KIVI ? "kivi" : e == KV_ENC_DSQ ? "dsq" : "plain";
}

static kv_status add_part(kvc_writer *w, int layer, char which, const char *part, kv_dtype dt,
                          int ndim, const int64_t *shape, const void *data)
{
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c.%s", layer, which, part);
    return kvc_writer_add_copy(w, name, dt, ndim, shape, data);
}

static kv_status add_meta_int(kvc_writer *w, int layer, char which, const char *key, int v)
{
    char name[KVC_NAME_MAX], val[32];
    snprintf(name, sizeof name, "layers.%d.%c.%s", layer, which, key);
    snprintf(val, sizeof val, "%d", v);
    return kvc_writer_meta(w, name, val);
}

/* Which keys a DSQ key base is the mean of: informative, readers do not need it. */
static kv_status add_base_of(kvc_writer *w, int layer, char which, int base)
{
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c.base_of", layer, which);
    return kvc_writer_meta(w, name, kv_dsq_base_name(base));
}

static kv_status add_encoding(kvc_writer *w, int layer, char which, kv_encoding e)
{
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c.encoding", layer, which);
    return kvc_writer_meta(w, name, kv_encoding_name(e));
}

kv_status kv_kivi_write(kvc_writer *w, int layer, char which, const kv_kivi_packed *p)
{
    const int64_t H = p->n_kv_heads, D = p->head_dim, nq = p->nq, G = p->prm.group;
    const int64_t sc1 = p->axis == KV_KIVI_KEYS ? nq / G : nq;
    const int64_t sc2 = p->axis == KV_KIVI_KEYS ? D : D / kv_kivi_vgroup((int)G, (int)D);
    const int64_t codes[3] = {H, nq, (int64_t)kv_kivi_row_bytes((int)D, p->prm.bits)};
    const int64_t sz[3] = {H, sc1, sc2};
    const int64_t rs[3] = {H, p->T - nq, D};
    kv_status st;
    if ((st = add_encoding(w, layer, which, KV_ENC_KIVI)) ||
        (st = add_meta_int(w, layer, which, "bits", p->prm.bits)) ||
        (st = add_meta_int(w, layer, which, "group", p->prm.group)) ||
        (st = add_meta_int(w, layer, which, "residual", p->prm.residual)) ||
        (st = add_part(w, layer, which, "codes", KV_DT_U8, 3, codes, p->codes)) ||
        (st = add_part(w, layer, which, "scale", KV_DT_F16, 3, sz, p->scale)) ||
        (st = add_part(w, layer, which, "zero", KV_DT_F16, 3, sz, p->zero)) ||
        (st = add_part(w, layer, which, "resid", KV_DT_F16, 3, rs, p->resid)))
        return st;
    return KV_OK;
}

kv_status kv_dsq_write(kvc_writer *w, int layer, char which, const kv_dsq_packed *p)
{
    const int64_t H = p->n_kv_heads, D = p->head_dim, nw = p->nw, W = p->prm.window;
    const int64_t S = p->prm.salient;
    const int64_t gd = kv_kivi_vgroup(p->prm.group, (int)D);
    const int64_t mask[3] = {H, nw, W / 8}, sal[4] = {H, nw, S, D}, hd[3] = {H, nw, D};
    const int64_t codes[4] = {H, nw, W - S, (int64_t)kv_kivi_row_bytes((int)D, p->prm.bits)};
    const int64_t sz[4] = {H, nw, W - S, D / gd}, rs[3] = {H, p->T - nw * W, D};
    kv_status st;
    if ((st = add_encoding(w, layer, which, KV_ENC_DSQ)) ||
        (st = add_meta_int(w, layer, which, "window", p->prm.window)) ||
        (st = add_meta_int(w, layer, which, "salient", p->prm.salient)) ||
        (st = add_meta_int(w, layer, which, "bits", p->prm.bits)) ||
        (st = add_meta_int(w, layer, which, "group", p->prm.group)) ||
        (p->base && (st = add_base_of(w, layer, which, p->prm.base))) ||
        (st = add_part(w, layer, which, "mask", KV_DT_U8, 3, mask, p->mask)) ||
        (st = add_part(w, layer, which, "sal", KV_DT_I8, 4, sal, p->sal)) ||
        (st = add_part(w, layer, which, "sscale", KV_DT_F16, 3, hd, p->sscale)) ||
        (p->base && (st = add_part(w, layer, which, "base", KV_DT_F16, 3, hd, p->base))) ||
        (st = add_part(w, layer, which, "codes", KV_DT_U8, 4, codes, p->codes)) ||
        (st = add_part(w, layer, which, "scale", KV_DT_F16, 4, sz, p->scale)) ||
        (st = add_part(w, layer, which, "zero", KV_DT_F16, 4, sz, p->zero)) ||
        (st = add_part(w, layer, which, "resid", KV_DT_F16, 3, rs, p->resid)))
        return st;
    return KV_OK;
}

static const char *layer_meta(const kvc_file *f, int layer, char which, const char *key)
{
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c.%s", layer, which, key);
    return kvc_meta(f, name);
}

static kv_status meta_int(const kvc_file *f, int layer, char which, const char *key, int lo,
                          int hi, int *out)
{
    const char *s = layer_meta(f, layer, which, key);
    if (!s) return kv_fail(KV_E_DATA, "layers.%d.%c: metadata %s missing", layer, which, key);
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > hi)
        return kv_fail(KV_E_DATA, "layers.%d.%c.%s: \"%s\" is not an integer in %d..%d", layer,
                       which, key, s, lo, hi);
    *out = (int)v;
    return KV_OK;
}

kv_status kv_layer_encoding(const kvc_file *f, int layer, char which, kv_encoding *enc)
{
    const char *e = layer_meta(f, layer, which, "encoding");
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c", layer, which);
    if (!e || !strcmp(e, "plain") || !strcmp(e, "f16") || !strcmp(e, "bf16") || !strcmp(e, "f32")) {
        if (!kvc_find(f, name)) return kv_fail(KV_E_DATA, "tensor %s missing", name);
        *enc = KV_ENC_PLAIN;
    } else if (!strcmp(e, "kivi")) {
        *enc = KV_ENC_KIVI;
    } else if (!strcmp(e, "dsq")) {
        *enc = KV_ENC_DSQ;
    } else {
        return kv_fail(KV_E_DATA, "%s: unknown encoding \"%s\"", name, e);
    }
    return KV_OK;
}

/* Copy part `part` after checking its dtype and shape. */
static kv_status get_part(const kvc_file *f, int layer, char which, const char *part,
                          kv_dtype dt, int ndim, const int64_t *shape, void *dst)
{
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c.%s", layer, which, part);
    const kvc_tensor *t = kvc_find(f, name);
    if (!t) return kv_fail(KV_E_DATA, "tensor %s missing", name);
    if (t->dtype != dt)
        return kv_fail(KV_E_DATA, "tensor %s: dtype %s, expected %s", name, kv_dtype_name(t->dtype),
                       kv_dtype_name(dt));
    bool same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (!same) {
        char want[96] = "", *w = want;
        for (int i = 0; i < ndim; i++)
            w += snprintf(w, sizeof want - (size_t)(w - want), "%s%lld", i ? ", " : "[",
                          (long long)shape[i]);
        return kv_fail(KV_E_DATA, "tensor %s: shape does not match its encoding (expected %s])",
                       name, want);
    }
    uint64_t n = kv_dtype_size(dt);
    for (int i = 0; i < ndim; i++) n *= (uint64_t)shape[i];
    if (t->nbytes != n) return kv_fail(KV_E_DATA, "tensor %s: %llu bytes, expected %llu", name,
                                       (unsigned long long)t->nbytes, (unsigned long long)n);
    if (n) memcpy(dst, t->data, n);
    return KV_OK;
}

static kv_status file_geom(const kvc_file *f, int *H, int *T, int *D)
{
    const kv_geom *g = kvc_geom(f);
    *H = g->n_kv_heads;
    *T = g->n_tokens;
    *D = g->head_dim;
    if (*H < 1 || *T < 0 || *D < 1 || *D > KV_QUANT_MAX_DIM)
        return kv_fail(KV_E_DATA, "geometry %d KV heads x %d tokens x head dim %d unsupported", *H,
                       *T, *D);
    return KV_OK;
}

kv_status kv_kivi_read(const kvc_file *f, int layer, char which, kv_kivi_packed *p)
{
    memset(p, 0, sizeof *p);
    int H, T, D;
    kv_kivi_params prm;
    kv_status st;
    if ((st = file_geom(f, &H, &T, &D)) ||
        (st = meta_int(f, layer, which, "bits", 1, 4, &prm.bits)) ||
        (st = meta_int(f, layer, which, "group", 1, 65536, &prm.group)) ||
        (st = meta_int(f, layer, which, "residual", 0, 1 << 30, &prm.residual)))
        return st;
    kv_kivi_axis axis = which == 'k' ? KV_KIVI_KEYS : KV_KIVI_VALUES;
    if ((st = kv_kivi_check(&prm, D))) {
        kv_errcontext("layers.%d.%c", layer, which);
        return kv_fail(KV_E_DATA, "%s", kv_errdetail());
    }
    if ((st = kv_kivi_init(p, axis, &prm, H, T, D))) return st;
    const int64_t nq = p->nq, G = prm.group;
    const int64_t codes[3] = {H, nq, (int64_t)kv_kivi_row_bytes(D, prm.bits)};
    const int64_t sz[3] = {H, axis == KV_KIVI_KEYS ? nq / G : nq,
                           axis == KV_KIVI_KEYS ? D : D / kv_kivi_vgroup((int)G, D)};
    const int64_t rs[3] = {H, T - nq, D};
    if ((st = get_part(f, layer, which, "codes", KV_DT_U8, 3, codes, p->codes)) ||
        (st = get_part(f, layer, which, "scale", KV_DT_F16, 3, sz, p->scale)) ||
        (st = get_part(f, layer, which, "zero", KV_DT_F16, 3, sz, p->zero)) ||
        (st = get_part(f, layer, which, "resid", KV_DT_F16, 3, rs, p->resid))) {
        kv_kivi_clear(p);
        return st;
    }
    return KV_OK;
}

kv_status kv_dsq_read(const kvc_file *f, int layer, char which, kv_dsq_packed *p)
{
    memset(p, 0, sizeof *p);
    int H, T, D;
    kv_dsq_params prm;
    kv_status st;
    if ((st = file_geom(f, &H, &T, &D)) ||
        (st = meta_int(f, layer, which, "window", 8, 4096, &prm.window)) ||
        (st = meta_int(f, layer, which, "salient", 0, 4096, &prm.salient)) ||
        (st = meta_int(f, layer, which, "bits", 1, 4, &prm.bits)) ||
        (st = meta_int(f, layer, which, "group", 1, 65536, &prm.group)))
        return st;
    kv_kivi_axis axis = which == 'k' ? KV_KIVI_KEYS : KV_KIVI_VALUES;
    /* optional (files before it have the salient mean); unknown names are refused */
    const char *bo = layer_meta(f, layer, which, "base_of");
    prm.base = KV_DSQ_BASE_SALIENT;
    if (bo && kv_dsq_base_parse(bo, &prm.base))
        return kv_fail(KV_E_DATA, "layers.%d.%c.base_of: \"%s\" is not salient or rest", layer,
                       which, bo);
    if ((st = kv_dsq_check(&prm, D))) {
        kv_errcontext("layers.%d.%c", layer, which);
        return kv_fail(KV_E_DATA, "%s", kv_errdetail());
    }
    if ((st = kv_dsq_init(p, axis, &prm, H, T, D))) return st;
    const int64_t nw = p->nw, W = prm.window, S = prm.salient;
    const int64_t gd = kv_kivi_vgroup(prm.group, D);
    const int64_t mask[3] = {H, nw, W / 8}, sal[4] = {H, nw, S, D}, hd[3] = {H, nw, D};
    const int64_t codes[4] = {H, nw, W - S, (int64_t)kv_kivi_row_bytes(D, prm.bits)};
    const int64_t sz[4] = {H, nw, W - S, D / gd}, rs[3] = {H, T - nw * W, D};
    if ((st = get_part(f, layer, which, "mask", KV_DT_U8, 3, mask, p->mask)) ||
        (st = get_part(f, layer, which, "sal", KV_DT_I8, 4, sal, p->sal)) ||
        (st = get_part(f, layer, which, "sscale", KV_DT_F16, 3, hd, p->sscale)) ||
        (p->base && (st = get_part(f, layer, which, "base", KV_DT_F16, 3, hd, p->base))) ||
        (st = get_part(f, layer, which, "codes", KV_DT_U8, 4, codes, p->codes)) ||
        (st = get_part(f, layer, which, "scale", KV_DT_F16, 4, sz, p->scale)) ||
        (st = get_part(f, layer, which, "zero", KV_DT_F16, 4, sz, p->zero)) ||
        (st = get_part(f, layer, which, "resid", KV_DT_F16, 3, rs, p->resid))) {
        kv_dsq_clear(p);
        return st;
    }
    /* a mask with the wrong number of salient tokens would misplace rows */
    for (int64_t i = 0; i < H * nw; i++) {
        int n = 0;
        for (int t = 0; t < W; t++) n += kv_dsq_mask_get(p->mask + i * (W / 8), t);
        if (n != S) {
            kv_dsq_clear(p);
            return kv_fail(KV_E_DATA, "layers.%d.%c.mask: window %lld marks %d salient tokens, not %lld",
                           layer, which, (long long)i, n, (long long)S);
        }
    }
    return KV_OK;
}

kv_status kv_layer_decode(const kvc_file *f, int layer, char which, float *out)
{
    kv_encoding enc;
    kv_status st = kv_layer_encoding(f, layer, which, &enc);
    if (st) return st;
    if (enc == KV_ENC_KIVI) {
        kv_kivi_packed p;
        if ((st = kv_kivi_read(f, layer, which, &p))) return st;
        kv_kivi_unpack(&p, out);
        kv_kivi_clear(&p);
        return KV_OK;
    }
    if (enc == KV_ENC_DSQ) {
        kv_dsq_packed p;
        if ((st = kv_dsq_read(f, layer, which, &p))) return st;
        kv_dsq_unpack(&p, out);
        kv_dsq_clear(&p);
        return KV_OK;
    }
    int H, T, D;
    if ((st = file_geom(f, &H, &T, &D))) return st;
    char name[KVC_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%c", layer, which);
    const kvc_tensor *t = kvc_find(f, name);
    if (t->ndim != 3 || t->shape[0] != H || t->shape[1] != T || t->shape[2] != D)
        return kv_fail(KV_E_DATA, "tensor %s: shape is not [%d, %d, %d]", name, H, T, D);
    if (t->dtype != KV_DT_F32 && t->dtype != KV_DT_F16 && t->dtype != KV_DT_BF16)
        return kv_fail(KV_E_DATA, "tensor %s: dtype %s is not F32, F16 or BF16", name,
                       kv_dtype_name(t->dtype));
    return kvc_tensor_to_f32(t, out);
}

uint64_t kv_layer_bytes(const kvc_file *f, int layer, char which)
{
    char pre[KVC_NAME_MAX];
    int n = snprintf(pre, sizeof pre, "layers.%d.%c", layer, which);
    uint64_t b = 0;
    for (int i = 0; i < kvc_n_tensors(f); i++) {
        const kvc_tensor *t = kvc_tensor_at(f, i);
        if (!strncmp(t->name, pre, (size_t)n) && (t->name[n] == 0 || t->name[n] == '.'))
            b += t->nbytes;
    }
    return b;
}

// --- transcoding a whole file ----------------------------------------------------

