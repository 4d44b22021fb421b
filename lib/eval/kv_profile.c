/*
 * Layer/head profiling (see kv_profile.h): dense preference score, KIVI
 * and top-K retrieval errors on the stored queries, averaging over files,
 * classification, JSON and SVG output.  Everything is computed in float32
 * with float64 sums, one query at a time; the cost is
 * O(layers * heads * n_q * T * D), a few seconds for a 4k-token cache.
 */
#include "eval/kv_profile.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn/kv_attn.h"
#include "common/kv_finite.h"
#include "common/kv_json.h"
#include "quant/kv_quant.h"

void kv_profile_params_default(kv_profile_params *p)
{
    /* Sizes come from the deploy defaults (themselves the policy defaults),
       so the errors measured here are those of the config written out. */
    kv_deploy d;
    kv_deploy_defaults(&d);
    p->alpha = 0.05;
    p->tau = 0.2;
    p->nq = 32;
    p->quant = d.quant;
    p->sparse = d.sparse;
}

/* Selection order everywhere in this file: descending, NaN ranked as -inf
 * (qsort needs a consistent order; with NaN compared as a number it has
 * none, and glibc's qsort may then read outside the array). */
static inline float rank_of(float x) { return isnan(x) ? -INFINITY : x; }

static int cmp_desc(const void *a, const void *b)
{
    float x = rank_of(*(const float *)a), y = rank_of(*(const float *)b);
    return (x < y) - (x > y);
}

/* Mass outside the top ceil(alpha * n) probabilities (p is reordered). */
static double mass_outside_top(float *p, int n, double alpha)
{
    int k = (int)ceil(alpha * n);
    if (k < 1) k = 1;
    if (k >= n) return 0;
    qsort(p, (size_t)n, sizeof *p, cmp_desc);
    double top = 0, all = 0;
    for (int t = 0; t < n; t++) {
        all += p[t];
        if (t < k) top += p[t];
    }
    return all > 0 ? 1.0 - top / all : 0;
}

typedef struct {
    float val;
    int idx;
} scored;

static int cmp_scored(const void *a, const void *b)
{
    const scored *x = a, *y = b;
    float u = rank_of(x->val), v = rank_of(y->val);
    if (u != v) return u > v ? -1 : 1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

/*
 * TailorKV retrieval for one query over n visible tokens: channel scores
 * |q_c| * max_t |K_tc|, top C channels, approximate token scores on them,
 * sink + window + top-K tokens, exact attention over the selection.
 * o (D) gets the output.  scratch: n scored + n floats.
 */
static void sparse_out(const float *qv, const float *k, const float *v, int n, int D,
                       const kv_profile_params *p, scored *sc, float *pr, double *o)
{
    scored ch[KV_QUANT_MAX_DIM];
    int C = p->sparse.channels < D ? p->sparse.channels : D;
    for (int c = 0; c < D; c++) {
        float m = 0;
        for (int t = 0; t < n; t++) {
            float a = fabsf(k[(size_t)t * D + c]);
            m = a > m ? a : m;
        }
        ch[c].val = fabsf(qv[c]) * m;
        ch[c].idx = c;
    }
    qsort(ch, (size_t)D, sizeof *ch, cmp_scored);
    int K = p->sparse.topk > 0 ? p->sparse.topk : (int)ceil(p->sparse.topk_frac * n);
    int m = 0;
    for (int t = 0; t < n; t++) {
        if (t < p->sparse.sink || t >= n - p->sparse.window) continue;
        float s = 0;
        for (int i = 0; i < C; i++) s += qv[ch[i].idx] * k[(size_t)t * D + ch[i].idx];
        sc[m].val = s;
        sc[m].idx = t;
        m++;
    }
    if (K < m) qsort(sc, (size_t)m, sizeof *sc, cmp_scored);
    else K = m;
    /* selection mask in pr: 1 = selected */
    for (int t = 0; t < n; t++) pr[t] = (t < p->sparse.sink || t >= n - p->sparse.window) ? 1.0f : 0.0f;
    for (int i = 0; i < K; i++) pr[sc[i].idx] = 1.0f;
    const float s = 1.0f / sqrtf((float)D);
    float mx = -INFINITY;
    for (int t = 0; t < n; t++)
        if (pr[t] != 0) {
            float l = kv_attn_dot(qv, k + (size_t)t * D, D) * s;
            pr[t] = l; /* the flag becomes the logit */
            mx = l > mx ? l : mx;
        } else {
            pr[t] = -INFINITY;
        }
    double z = 0;
    for (int t = 0; t < n; t++) z += (pr[t] = pr[t] == -INFINITY ? 0.0f : expf(pr[t] - mx));
    for (int t = 0; t < n; t++) pr[t] = (float)(pr[t] / z);
    kv_attn_out(pr, v, n, D, o);
}

// --- one file --------------------------------------------------------------------

static kv_status alloc_acc(kv_profile *a, int L, int NH, int H, int D)
{
    a->n_layers = L;
    a->n_heads = NH;
    a->n_kv_heads = H;
    a->head_dim = D;
    size_t n = (size_t)L * NH;
    a->score = calloc(n, sizeof(double));
    a->err_q1 = calloc(n, sizeof(double));
    a->err_q2 = calloc(n, sizeof(double));
    a->err_sparse = calloc(n, sizeof(double));
    a->layer_score = calloc((size_t)L, sizeof(double));
    a->layer_q1 = calloc((size_t)L, sizeof(double));
    a->layer_q2 = calloc((size_t)L, sizeof(double));
    a->layer_sparse = calloc((size_t)L, sizeof(double));
    if (!a->score || !a->err_q1 || !a->err_q2 || !a->err_sparse || !a->layer_score ||
        !a->layer_q1 || !a->layer_q2 || !a->layer_sparse)
        return kv_fail(KV_E_NOMEM, "profile tables");
    return KV_OK;
}

void kv_profile_clear(kv_profile *a)
{
    free(a->score);
    free(a->err_q1);
    free(a->err_q2);
    free(a->err_sparse);
    free(a->layer_score);
    free(a->layer_q1);
    free(a->layer_q2);
    free(a->layer_sparse);
    memset(a, 0, sizeof *a);
}

/* Queries of one layer, the last nq of the stored ones: out (NH, nq, D). */
static kv_status load_queries(const kvc_file *f, int layer, int NH, int nq_s, int nq, int D,
                              float *out)
{
    const kvc_tensor *t = kvc_layer(f, layer, "q");
    if (!t) return kv_fail(KV_E_DATA, "layer %d has no query samples (layers.%d.q); "
                                      "dump the cache with kv-run --dump-kv", layer, layer);
    if (t->ndim != 3 || t->shape[0] != NH || t->shape[1] != nq_s || t->shape[2] != D)
        return kv_fail(KV_E_DATA, "layers.%d.q: shape is not [%d, %d, %d]", layer, NH, nq_s, D);
    float *all = malloc((size_t)NH * nq_s * D * sizeof *all);
    if (!all) return kv_fail(KV_E_NOMEM, "queries of layer %d", layer);
    kv_status st = kvc_tensor_to_f32(t, all);
    if (!st)
        for (int h = 0; h < NH; h++)
            memcpy(out + (size_t)h * nq * D, all + ((size_t)h * nq_s + (nq_s - nq)) * D,
                   (size_t)nq * D * sizeof *out);
    free(all);
    return st;
}

static kv_status check_params(const kv_profile_params *p, int D)
{
    if (!(p->alpha > 0 && p->alpha <= 1)) return kv_fail(KV_E_USAGE, "alpha must be in (0, 1]");
    if (p->sparse.channels < 1) return kv_fail(KV_E_USAGE, "channels must be >= 1");
    if (p->sparse.topk < 0 || (p->sparse.topk == 0 && !(p->sparse.topk_frac > 0 && p->sparse.topk_frac <= 1)))
        return kv_fail(KV_E_USAGE, "budget must be a token count or a fraction in (0, 1]");
    if (p->quant.group < 1 || p->quant.residual < 0) return kv_fail(KV_E_USAGE, "bad KIVI group or residual");
    (void)D; /* a head dim KIVI cannot pack gives null errors, not a failure */
    return KV_OK;
}

kv_status kv_profile_add(kv_profile *acc, const kvc_file *f, const kv_profile_params *p)
{
    const kv_geom *g = kvc_geom(f);
    const int L = g->n_layers, NH = g->n_heads, H = g->n_kv_heads, D = g->head_dim,
              T = g->n_tokens, nq_s = g->n_q;
    if (nq_s < 1 || NH < 1)
        return kv_fail(KV_E_DATA, "the cache has no query samples (layers.{i}.q); "
                                  "dump it with kv-run --dump-kv --nq N");
    if (NH % H) return kv_fail(KV_E_DATA, "%d query heads is not a multiple of %d KV heads", NH, H);
    if (T < 1) return kv_fail(KV_E_DATA, "the cache holds no tokens");
    if (nq_s > T) return kv_fail(KV_E_DATA, "%d query samples but only %d tokens", nq_s, T);
    if (acc->n_docs < 0) return kv_fail(KV_E_INTERNAL, "kv_profile_add after kv_profile_finish");
    kv_status st = check_params(p, D);
    if (st) return st;
    if (acc->n_docs == 0) {
        if ((st = alloc_acc(acc, L, NH, H, D))) return st;
    } else if (acc->n_layers != L || acc->n_heads != NH || acc->n_kv_heads != H ||
               acc->head_dim != D) {
        return kv_fail(KV_E_DATA, "geometry %d layers x %d heads (%d KV) x %d differs from the "
                                  "first file's %d x %d (%d) x %d", L, NH, H, D, acc->n_layers,
                       acc->n_heads, acc->n_kv_heads, acc->head_dim);
    }
    const int nq = p->nq > 0 && p->nq < nq_s ? p->nq : nq_s;
    const size_t n = (size_t)H * T * D;
    float *q = malloc((size_t)NH * nq * D * sizeof *q);
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    float *k2 = malloc(n * sizeof *k2), *v2 = malloc(n * sizeof *v2);
    float *pr = malloc((size_t)T * sizeof *pr);
    scored *sc = malloc((size_t)T * sizeof *sc);
    double *o = malloc((size_t)2 * D * sizeof *o), *eh = malloc((size_t)NH * sizeof *eh);
    if (!q || !k || !v || !k2 || !v2 || !pr || !sc || !o || !eh) {
        st = kv_fail(KV_E_NOMEM, "profile buffers for %d tokens", T);
        goto out;
    }
    for (int l = 0; l < L && !st; l++) {
        if ((st = load_queries(f, l, NH, nq_s, nq, D, q)) || (st = kv_layer_decode(f, l, 'k', k)) ||
            (st = kv_layer_decode(f, l, 'v', v)))
            break;
        char nm[3][32];
        snprintf(nm[0], sizeof nm[0], "layers.%d.q", l);
        snprintf(nm[1], sizeof nm[1], "layers.%d.k", l);
        snprintf(nm[2], sizeof nm[2], "layers.%d.v", l);
        if ((st = kv_check_finite3(nm[0], q, NH, nq, D, "profiling")) ||
            (st = kv_check_finite3(nm[1], k, H, T, D, "profiling")) ||
            (st = kv_check_finite3(nm[2], v, H, T, D, "profiling")))
            break;
        double *row = acc->score + (size_t)l * NH;
        for (int qh = 0; qh < NH; qh++) {
            const float *kh = k + (size_t)(qh / (NH / H)) * T * D;
            const float *vh = v + (size_t)(qh / (NH / H)) * T * D;
            double ssum = 0, en = 0, ed = 0;
            for (int j = 0; j < nq; j++) {
                const float *qv = q + ((size_t)qh * nq + j) * D;
                int nv = T - nq + j + 1;
                kv_attn_probs(qv, kh, nv, D, pr);
                kv_attn_out(pr, vh, nv, D, o);
                ssum += mass_outside_top(pr, nv, p->alpha);
                sparse_out(qv, kh, vh, nv, D, p, sc, pr, o + D);
                for (int c = 0; c < D; c++) {
                    en += (o[D + c] - o[c]) * (o[D + c] - o[c]);
                    ed += o[c] * o[c];
                }
            }
            row[qh] += ssum / nq;
            acc->err_sparse[(size_t)l * NH + qh] += ed > 0 ? sqrt(en / ed) : 0;
        }
        for (int b = 1; b <= 2; b++) {
            kv_kivi_params kp = {b, p->quant.group, p->quant.residual};
            double *dst = (b == 1 ? acc->err_q1 : acc->err_q2) + (size_t)l * NH;
            if (kv_kivi_check(&kp, D)) { /* e.g. head dim 12 at 1 bit */
                for (int qh = 0; qh < NH; qh++) dst[qh] = NAN;
                kv_errclear();
                continue;
            }
            kv_kivi_packed pk, pv;
            if ((st = kv_kivi_pack(k, KV_KIVI_KEYS, &kp, H, T, D, &pk))) break;
            if ((st = kv_kivi_pack(v, KV_KIVI_VALUES, &kp, H, T, D, &pv))) {
                kv_kivi_clear(&pk);
                break;
            }
            kv_kivi_unpack(&pk, k2);
            kv_kivi_unpack(&pv, v2);
            kv_kivi_clear(&pk);
            kv_kivi_clear(&pv);
            kv_attn_rel_error(q, NH, nq, k, v, k2, v2, H, T, D, eh);
            for (int qh = 0; qh < NH; qh++) dst[qh] += eh[qh];
        }
        if (st) kv_errcontext("layer %d", l);
    }
    if (!st) {
        acc->n_docs++;
        acc->n_q = nq;
    }
out:
    free(q);
    free(k);
    free(v);
    free(k2);
    free(v2);
    free(pr);
    free(sc);
    free(o);
    free(eh);
    return st;
}

void kv_profile_finish(kv_profile *a)
{
    if (a->n_docs < 1) return;
    const int NH = a->n_heads;
    for (int l = 0; l < a->n_layers; l++) {
        double s[4] = {0, 0, 0, 0};
        for (int h = 0; h < NH; h++) {
            size_t i = (size_t)l * NH + h;
            s[0] += a->score[i] /= a->n_docs;
            s[1] += a->err_q1[i] /= a->n_docs;
            s[2] += a->err_q2[i] /= a->n_docs;
            s[3] += a->err_sparse[i] /= a->n_docs;
        }
        a->layer_score[l] = s[0] / NH;
        a->layer_q1[l] = s[1] / NH;
        a->layer_q2[l] = s[2] / NH;
        a->layer_sparse[l] = s[3] / NH;
    }
    a->n_docs = -a->n_docs; /* finished: further adds are an error */
}

kv_status kv_profile_deploy(const kv_profile *a, const kv_profile_params *p, kv_deploy *d)
{
    kv_deploy_defaults(d);
    d->n_layers = a->n_layers;
    d->quant = p->quant;
    d->sparse = p->sparse;
    d->quant_layers = malloc(((size_t)a->n_layers + 1) * sizeof(int));
    d->sparse_layers = malloc(((size_t)a->n_layers + 1) * sizeof(int));
    if (!d->quant_layers || !d->sparse_layers) {
        kv_deploy_clear(d);
        return kv_fail(KV_E_NOMEM, "deploy lists");
    }
    for (int l = 0; l < a->n_layers; l++) {
        if (a->layer_score[l] > p->tau) d->quant_layers[d->n_quant++] = l;
        else d->sparse_layers[d->n_sparse++] = l;
    }
    return KV_OK;
}

// --- output ------------------------------------------------------------------------

static void heads_json(FILE *f, const char *name, const double *row, int n, bool last)
{
    fprintf(f, "\"%s\": ", name);
    kv_json_numbers(f, row, n);
    fputs(last ? "}" : ", ", f);
}

void kv_profile_write_json(const kv_profile *a, const kv_profile_params *p, const kv_deploy *d,
                           FILE *f)
{
    const int NH = a->n_heads;
    fprintf(f, "{\n  \"files\": %d,\n  \"n_layers\": %d,\n  \"n_heads\": %d,\n"
               "  \"n_kv_heads\": %d,\n  \"head_dim\": %d,\n  \"n_q\": %d,\n",
            a->n_docs < 0 ? -a->n_docs : a->n_docs, a->n_layers, NH, a->n_kv_heads, a->head_dim,
            a->n_q);
    fprintf(f, "  \"params\": {\"alpha\": %g, \"tau\": %g, \"nq\": %d, \"group\": %d, "
               "\"residual\": %d, \"budget\": %g, \"channels\": %d, \"sink\": %d, \"window\": %d},\n",
            p->alpha, p->tau, p->nq, p->quant.group, p->quant.residual,
            p->sparse.topk > 0 ? (double)p->sparse.topk : p->sparse.topk_frac, p->sparse.channels, p->sparse.sink, p->sparse.window);
    fputs("  \"layers\": [\n", f);
    for (int l = 0; l < a->n_layers; l++) {
        size_t o = (size_t)l * NH;
        fprintf(f, "    {\"layer\": %d, \"score\": ", l);
        kv_json_number(f, a->layer_score[l]);
        fputs(", \"err_1bit\": ", f);
        kv_json_number(f, a->layer_q1[l]);
        fputs(", \"err_2bit\": ", f);
        kv_json_number(f, a->layer_q2[l]);
        fputs(", \"err_sparse\": ", f);
        kv_json_number(f, a->layer_sparse[l]);
        fprintf(f, ", \"class\": \"%s\",\n     \"heads\": {",
                a->layer_score[l] > p->tau ? "quant" : "sparse");
        heads_json(f, "score", a->score + o, NH, false);
        heads_json(f, "err_1bit", a->err_q1 + o, NH, false);
        heads_json(f, "err_2bit", a->err_q2 + o, NH, false);
        heads_json(f, "err_sparse", a->err_sparse + o, NH, true);
        fprintf(f, "}%s\n", l + 1 < a->n_layers ? "," : "");
    }
    fputs("  ],\n  \"deploy\": ", f);
    kv_deploy_write_json(d, f, 2);
    fputs("\n}\n", f);
}

void kv_profile_write_svg(const kv_profile *a, const kv_profile_params *p, FILE *f)
{
    const int cw = 44, chh = 24, left = 80, top = 56;
    const int NH = a->n_heads, L = a->n_layers;
    int width = left + NH * cw + 170, height = top + (L * chh > 150 ? L * chh : 150) + 40;
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"11\">\n",
            width, height, width, height);
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
               "<text x=\"%d\" y=\"20\" font-size=\"14\">Dense preference score by layer and head "
               "(alpha %g, tau %g)</text>\n",
            8, p->alpha, p->tau);
    for (int h = 0; h < NH; h++)
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">h%d</text>\n",
                left + h * cw + cw / 2, top - 8, h);
    for (int l = 0; l < L; l++) {
        bool quant = a->layer_score[l] > p->tau;
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">layer %d %s</text>\n", left - 6,
                top + l * chh + chh / 2 + 4, l, quant ? "Q" : "S");
        for (int h = 0; h < NH; h++) {
            double s = a->score[(size_t)l * NH + h];
            if (!isfinite(s)) s = 0;
            s = s < 0 ? 0 : s > 1 ? 1 : s;
            /* white (0, sparse) to deep blue (1, dense) */
            int r = (int)(255 - 215 * s), g = (int)(255 - 165 * s), b = (int)(255 - 55 * s);
            fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"rgb(%d,%d,%d)\" "
                       "stroke=\"#888\" stroke-width=\"0.5\"><title>layer %d head %d: %.4f</title></rect>\n",
                    left + h * cw, top + l * chh, cw, chh, r, g, b, l, h, s);
            fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"%s\">%.2f</text>\n",
                    left + h * cw + cw / 2, top + l * chh + chh / 2 + 4, s > 0.6 ? "white" : "black", s);
        }
    }
    int lx = left + NH * cw + 20;
    for (int i = 0; i <= 10; i++) {
        double s = 1.0 - i / 10.0;
        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"16\" height=\"10\" fill=\"rgb(%d,%d,%d)\"/>\n", lx,
                top + i * 10, (int)(255 - 215 * s), (int)(255 - 165 * s), (int)(255 - 55 * s));
    }
    fprintf(f, "<text x=\"%d\" y=\"%d\">1 dense</text>\n<text x=\"%d\" y=\"%d\">0 sparse</text>\n",
            lx + 20, top + 9, lx + 20, top + 109);
    fprintf(f, "<text x=\"%d\" y=\"%d\">Q: quantize, S: sparse</text>\n</svg>\n", lx, top + 130);
}
