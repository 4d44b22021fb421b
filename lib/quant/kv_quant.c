/*
 * kv_quant: transcode a .kvc file layer by layer into KIVI or DSQ planes
 * (what kv-quant does), with the errors and timings of each layer.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attn/kv_attn.h"
#include "common/kv_finite.h"
#include "common/kv_json.h"
#include "quant/kv_quant.h"

static double clock_seconds(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Wall and CPU (all threads) seconds, so that throughput per core can be
 * told apart from a busy machine's wall time. */
typedef struct {
    double wall, cpu;
} stamp;

static stamp stamp_now(void)
{
    return (stamp){clock_seconds(CLOCK_MONOTONIC), clock_seconds(CLOCK_PROCESS_CPUTIME_ID)};
}

static void stamp_add(kv_quant_report *r, stamp t0)
{
    stamp t1 = stamp_now();
    r->pack_seconds += t1.wall - t0.wall;
    r->pack_cpu_seconds += t1.cpu - t0.cpu;
}

/* Layer of a "layers.{i}.k..." / "layers.{i}.v..." name (i in canonical
 * decimal, as the .kvc reader spells layer numbers), or -1. */
static int kv_name_layer(const char *name)
{
    if (strncmp(name, "layers.", 7)) return -1;
    const char *p = name + 7;
    if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] >= '0' && p[1] <= '9')) return -1;
    long layer = 0;
    while (*p >= '0' && *p <= '9' && layer <= 1000000) layer = layer * 10 + (*p++ - '0');
    if (layer > 1000000 || p[0] != '.' || (p[1] != 'k' && p[1] != 'v')) return -1;
    return p[2] == 0 || p[2] == '.' ? (int)layer : -1;
}

void kv_quant_report_clear(kv_quant_report *r)
{
    if (!r) return;
    free(r->enc_k);
    free(r->enc_v);
    free(r->k_mse);
    free(r->k_max);
    free(r->v_mse);
    free(r->v_max);
    free(r->attn_err);
    memset(r, 0, sizeof *r);
}

static void diff_stats(const float *a, const float *b, size_t n, double *mse, double *mx)
{
    double s = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        s += d * d;
        m = d > m ? d : m;
    }
    *mse = n ? s / (double)n : 0;
    *mx = m;
}

/* Re-encode one layer part x (H, T, D): add it to w, decode the result into y. */
static kv_status encode_part(kvc_writer *w, int l, char which, const float *x, const float *imp,
                             const kv_quant_opts *o, const kv_geom *g, float *y, uint64_t *bytes,
                             kv_encoding *enc, kv_quant_report *rep)
{
    const int H = g->n_kv_heads, T = g->n_tokens, D = g->head_dim;
    const size_t n = (size_t)H * T * D;
    kv_kivi_axis axis = which == 'k' ? KV_KIVI_KEYS : KV_KIVI_VALUES;
    kv_status st;
    stamp t0 = stamp_now();
    if (o->decode) {
        kv_half *h = malloc((n + 1) * sizeof *h);
        if (!h) return kv_fail(KV_E_NOMEM, "layer %d: F16 buffer", l);
        for (size_t i = 0; i < n; i++) {
            h[i] = kv_f32_to_half(x[i]);
            y[i] = kv_half_to_f32(h[i]);
        }
        char name[KVC_NAME_MAX];
        const int64_t shape[3] = {H, T, D};
        snprintf(name, sizeof name, "layers.%d.%c", l, which);
        st = kvc_writer_add_copy(w, name, KV_DT_F16, 3, shape, h);
        free(h);
        snprintf(name, sizeof name, "layers.%d.%c.encoding", l, which);
        if (!st) st = kvc_writer_meta(w, name, "f16");
        *bytes = 2 * n;
        *enc = KV_ENC_PLAIN;
    } else if (o->method == KV_ENC_DSQ) {
        kv_dsq_packed p;
        kv_dsq_params dp = o->dsq;
        if (axis == KV_KIVI_VALUES && o->dsq_vbits > 0) dp.bits = o->dsq_vbits;
        if ((st = kv_dsq_pack(x, imp, axis, &dp, H, T, D, &p))) return st;
        stamp_add(rep, t0);
        kv_dsq_unpack(&p, y);
        st = kv_dsq_write(w, l, which, &p);
        kv_dsq_clear(&p);
        *bytes = kv_dsq_bytes(axis, &dp, H, T, D);
        *enc = KV_ENC_DSQ;
        return st;
    } else {
        kv_kivi_packed p;
        if ((st = kv_kivi_pack(x, axis, &o->kivi, H, T, D, &p))) return st;
        stamp_add(rep, t0);
        kv_kivi_unpack(&p, y);
        st = kv_kivi_write(w, l, which, &p);
        kv_kivi_clear(&p);
        *bytes = kv_kivi_bytes(axis, &o->kivi, H, T, D);
        *enc = KV_ENC_KIVI;
        return st;
    }
    stamp_add(rep, t0);
    return st;
}

static kv_status report_alloc(kv_quant_report *r, int L)
{
    memset(r, 0, sizeof *r);
    r->n_layers = L;
    size_t n = (size_t)L + 1;
    r->enc_k = calloc(n, sizeof *r->enc_k);
    r->enc_v = calloc(n, sizeof *r->enc_v);
    r->k_mse = calloc(n, sizeof(double));
    r->k_max = calloc(n, sizeof(double));
    r->v_mse = calloc(n, sizeof(double));
    r->v_max = calloc(n, sizeof(double));
    r->attn_err = calloc(n, sizeof(double));
    if (!r->enc_k || !r->enc_v || !r->k_mse || !r->k_max || !r->v_mse || !r->v_max || !r->attn_err)
        return kv_fail(KV_E_NOMEM, "report");
    return KV_OK;
}

kv_status kv_quant_file(const kvc_file *in, const kv_quant_opts *o, kvc_writer *w,
                        kv_quant_report *rep)
{
    const kv_geom *g = kvc_geom(in);
    const int L = g->n_layers, H = g->n_kv_heads, T = g->n_tokens, D = g->head_dim;
    const int NH = g->n_heads, nq = g->n_q;
    kv_status st = KV_OK;
    kv_quant_report local;
    if (!rep) rep = &local;
    if ((st = report_alloc(rep, L))) goto out_rep;
    if (!o->decode && !o->per_layer) {
        st = o->method == KV_ENC_DSQ ? kv_dsq_check(&o->dsq, D) : kv_kivi_check(&o->kivi, D);
        if (!st && o->method == KV_ENC_DSQ && o->dsq_vbits > 0) {
            kv_dsq_params ov = o->dsq; /* the values' parameters */
            ov.bits = o->dsq_vbits;
            st = kv_dsq_check(&ov, D);
        }
        if (st) goto out_rep;
    }
    for (int l = 0; o->per_layer && !o->decode && l < L && !st; l++) {
        const kv_quant_layer *y = &o->per_layer[l];
        kv_dsq_params yv = y->dsq; /* the values' parameters */
        if (y->dsq_vbits > 0) yv.bits = y->dsq_vbits;
        st = y->method == KV_ENC_DSQ    ? kv_dsq_check(&y->dsq, D)
             : y->method == KV_ENC_KIVI ? kv_kivi_check(&y->kivi, D)
                                        : KV_OK;
        if (!st && y->method == KV_ENC_DSQ) st = kv_dsq_check(&yv, D);
        if (st) {
            kv_errcontext("layer %d", l);
            goto out_rep;
        }
    }
    bool *sel = calloc((size_t)L + 1, sizeof *sel);
    if (!sel) {
        st = kv_fail(KV_E_NOMEM, "layer table");
        goto out_rep;
    }
    for (int l = 0; l < L; l++)
        sel[l] = o->decode || (o->per_layer ? o->per_layer[l].method != KV_ENC_PLAIN
                                            : !o->layers || o->layers[l]);

    /* metadata and tensors of layers left alone, borrowed from the input */
    for (int i = 0; i < kvc_n_meta(in) && !st; i++) {
        const char *key, *val;
        kvc_meta_at(in, i, &key, &val);
        int l = kv_name_layer(key);
        if (l >= 0 && l < L && sel[l]) continue;
        st = kvc_writer_meta(w, key, val);
    }
    if (!st) st = kvc_writer_geom(w, g);
    for (int i = 0; i < kvc_n_tensors(in) && !st; i++) {
        const kvc_tensor *t = kvc_tensor_at(in, i);
        int l = kv_name_layer(t->name);
        if (l >= 0 && l < L && sel[l]) continue;
        st = kvc_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data);
    }
    const size_t n = (size_t)H * T * D;
    float *k = malloc((n + 1) * sizeof *k), *v = malloc((n + 1) * sizeof *v);
    float *k2 = malloc((n + 1) * sizeof *k2), *v2 = malloc((n + 1) * sizeof *v2);
    float *imp = malloc(((size_t)H * T + 1) * sizeof *imp);
    float *q = nq > 0 && NH > 0 ? malloc((size_t)NH * nq * D * sizeof *q) : NULL;
    if (!st && (!k || !v || !k2 || !v2 || !imp || (nq > 0 && NH > 0 && !q)))
        st = kv_fail(KV_E_NOMEM, "buffers for a layer of %d tokens", T);
    for (int l = 0; l < L && !st; l++) {
        uint64_t bk = kv_layer_bytes(in, l, 'k'), bv = kv_layer_bytes(in, l, 'v');
        rep->kv_bytes_in += bk + bv;
        rep->f16_bytes += 4 * n;
        if (!sel[l]) {
            rep->kv_bytes_out += bk + bv;
            kv_layer_encoding(in, l, 'k', &rep->enc_k[l]);
            kv_layer_encoding(in, l, 'v', &rep->enc_v[l]);
            continue;
        }
        if ((st = kv_layer_decode(in, l, 'k', k)) || (st = kv_layer_decode(in, l, 'v', v))) break;
        kv_quant_opts lo = *o; /* this layer's encoding */
        if (o->per_layer && !o->decode) {
            lo.method = o->per_layer[l].method;
            lo.kivi = o->per_layer[l].kivi;
            lo.dsq = o->per_layer[l].dsq;
            lo.dsq_vbits = o->per_layer[l].dsq_vbits;
        }
        char nk[32], nv[32];
        snprintf(nk, sizeof nk, "layers.%d.k", l);
        snprintf(nv, sizeof nv, "layers.%d.v", l);
        /* a NaN would be packed as some finite code and come back as a number */
        if ((st = kv_check_finite3(nk, k, H, T, D, "quantization")) ||
            (st = kv_check_finite3(nv, v, H, T, D, "quantization")))
            break;
        bool have_q = false;
        const kvc_tensor *qt = q ? kvc_layer(in, l, "q") : NULL;
        if (qt && qt->ndim == 3 && qt->shape[0] == NH && qt->shape[1] == nq && qt->shape[2] == D &&
            NH % H == 0 && nq <= T)
            have_q = kvc_tensor_to_f32(qt, q) == KV_OK;
        const float *ip = NULL;
        if (!o->decode && lo.method == KV_ENC_DSQ && have_q) {
            if ((st = kv_dsq_importance(q, NH, nq, k, H, T, D, imp))) break;
            ip = imp;
        }
        uint64_t ok_bytes = 0, ov_bytes = 0;
        if ((st = encode_part(w, l, 'k', k, ip, &lo, g, k2, &ok_bytes, &rep->enc_k[l], rep)) ||
            (st = encode_part(w, l, 'v', v, ip, &lo, g, v2, &ov_bytes, &rep->enc_v[l], rep))) {
            kv_errcontext("layer %d", l);
            break;
        }
        rep->kv_bytes_out += ok_bytes + ov_bytes;
        diff_stats(k, k2, n, &rep->k_mse[l], &rep->k_max[l]);
        diff_stats(v, v2, n, &rep->v_mse[l], &rep->v_max[l]);
        rep->attn_err[l] = have_q ? kv_attn_rel_error(q, NH, nq, k, v, k2, v2, H, T, D, NULL) : NAN;
    }
    free(q);
    free(imp);
    free(v2);
    free(k2);
    free(v);
    free(k);
    free(sel);
out_rep:
    if (rep == &local || st) kv_quant_report_clear(rep); /* a failed run reports nothing */
    return st;
}

void kv_quant_report_json(const kv_quant_report *r, const kv_quant_opts *o, FILE *f)
{
    fprintf(f, "{\n  \"method\": \"%s\",\n",
            o->decode ? "decode" : o->per_layer ? "per-layer" : kv_encoding_name(o->method));
    if (o->per_layer) {
        /* each layer's parameters are in its entry below */
    } else if (!o->decode && o->method == KV_ENC_KIVI)
        fprintf(f, "  \"bits\": %d,\n  \"group\": %d,\n  \"residual\": %d,\n", o->kivi.bits,
                o->kivi.group, o->kivi.residual);
    else if (!o->decode)
        fprintf(f, "  \"window\": %d,\n  \"salient\": %d,\n  \"bits\": %d,\n  \"group\": %d,\n"
                   "  \"base\": \"%s\",\n",
                o->dsq.window, o->dsq.salient, o->dsq.bits, o->dsq.group, kv_dsq_base_name(o->dsq.base));
    if (!o->per_layer && !o->decode && o->method == KV_ENC_DSQ && o->dsq_vbits > 0 && o->dsq_vbits != o->dsq.bits)
        fprintf(f, "  \"vbits\": %d,\n", o->dsq_vbits);
    fprintf(f, "  \"bytes_before\": %llu,\n  \"bytes_after\": %llu,\n  \"bytes_f16\": %llu,\n",
            (unsigned long long)r->kv_bytes_in, (unsigned long long)r->kv_bytes_out,
            (unsigned long long)r->f16_bytes);
    fputs("  \"ratio\": ", f);
    kv_json_number(f, r->kv_bytes_out ? (double)r->kv_bytes_in / (double)r->kv_bytes_out : NAN);
    fputs(",\n  \"ratio_vs_f16\": ", f);
    kv_json_number(f, r->kv_bytes_out ? (double)r->f16_bytes / (double)r->kv_bytes_out : NAN);
    fputs(",\n  \"pack_seconds\": ", f);
    kv_json_number(f, r->pack_seconds);
    fputs(",\n  \"pack_cpu_seconds\": ", f);
    kv_json_number(f, r->pack_cpu_seconds);
    fputs(",\n  \"layers\": [\n", f);
    for (int l = 0; l < r->n_layers; l++) {
        fprintf(f, "    {\"layer\": %d, \"k_encoding\": \"%s\", \"v_encoding\": \"%s\", \"k_mse\": ",
                l, kv_encoding_name(r->enc_k[l]), kv_encoding_name(r->enc_v[l]));
        kv_json_number(f, r->k_mse[l]);
        fputs(", \"k_max_err\": ", f);
        kv_json_number(f, r->k_max[l]);
        fputs(", \"v_mse\": ", f);
        kv_json_number(f, r->v_mse[l]);
        fputs(", \"v_max_err\": ", f);
        kv_json_number(f, r->v_max[l]);
        fputs(", \"attn_rel_err\": ", f);
        kv_json_number(f, r->attn_err[l]);
        if (o->per_layer && !o->decode) {
            const kv_quant_layer *y = &o->per_layer[l];
            if (y->method == KV_ENC_KIVI)
                fprintf(f, ", \"bits\": %d, \"group\": %d, \"residual\": %d", y->kivi.bits,
                        y->kivi.group, y->kivi.residual);
            else if (y->method == KV_ENC_DSQ)
                fprintf(f, ", \"window\": %d, \"salient\": %d, \"bits\": %d, \"vbits\": %d, "
                           "\"group\": %d, \"base\": \"%s\"",
                        y->dsq.window, y->dsq.salient, y->dsq.bits,
                        y->dsq_vbits > 0 ? y->dsq_vbits : y->dsq.bits, y->dsq.group,
                        kv_dsq_base_name(y->dsq.base));
        }
        fprintf(f, "}%s\n", l + 1 < r->n_layers ? "," : "");
    }
    fputs("  ]\n}\n", f);
}

