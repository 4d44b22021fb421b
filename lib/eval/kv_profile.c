/*
 * Layer/head profiling (see kv_profile.h): the dense preference score, the
 * error and bytes of each option measured by running its CPU policy on the
 * cache, averaging over files, the budget and tau rules, JSON and SVG
 * output.  Float32 with float64 sums; the cost is O(layers * options * n_q *
 * T * D), seconds for a 4k-token cache.
 */
#include "eval/kv_profile.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn/kv_attn.h"
#include "common/kv_finite.h"
#include "common/kv_json.h"
#include "policy/kv_policy.h"
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
    p->rule = KV_RULE_BUDGET;
    p->kv_budget = 0.25;
    p->choices = KV_PROFILE_ALL_CHOICES;
    p->steps = 32;
    p->quant = d.quant;
    p->sparse = d.sparse;
    kv_policy_params_default(&p->dsq, KV_POL_DSQ);
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

static const char *const opt_names[KV_OPT_COUNT] = {
    "full", "quant1", "quant2", "quant4", "sparse", "dsq",
    "quant2-r0", "quant2-r32g32", "quant4-r0", "quant4-r0g128", "dsq-s10",
    "quant1-r0", "stream32", "stream64", "sparse32"};

const char *kv_profile_opt_name(kv_profile_opt o)
{
    return (unsigned)o < KV_OPT_COUNT ? opt_names[o] : "?";
}

kv_status kv_profile_choices_parse(const char *list, unsigned *mask)
{
    unsigned m = 1u << KV_OPT_FULL;
    const char *s = list;
    if (!*s) return kv_fail(KV_E_USAGE, "empty list of choices");
    while (*s) {
        size_t n = strcspn(s, ",");
        int o = -1;
        if (n == 3 && !strncmp(s, "all", 3)) {
            m = KV_PROFILE_ALL_CHOICES;
            o = 0;
        }
        for (int i = 0; o < 0 && i < KV_OPT_COUNT; i++)
            if (strlen(opt_names[i]) == n && !strncmp(s, opt_names[i], n)) o = i;
        if (o < 0)
            return kv_fail(KV_E_USAGE, "unknown choice '%.*s' (full, quant1, quant2, quant4, sparse, "
                                       "dsq, quant2-r0, quant2-r32g32, quant4-r0, quant4-r0g128, "
                                       "dsq-s10, quant1-r0, stream32, stream64, sparse32 or all)", (int)(n > 64 ? 64 : n), s);
        m |= 1u << o;
        s += n;
        if (*s == ',') {
            s++;
            if (!*s) return kv_fail(KV_E_USAGE, "a list of choices ends with ','");
        }
    }
    *mask = m;
    return KV_OK;
}

/* The policy parameters of option o (full: fp16, as the GPU keeps it). */
static void opt_params(const kv_profile_params *p, kv_profile_opt o, kv_policy_params *x)
{
    switch (o) {
    case KV_OPT_Q1:
    case KV_OPT_Q2:
    case KV_OPT_Q4:
        *x = p->quant;
        x->kind = KV_POL_QUANT;
        x->bits = o == KV_OPT_Q1 ? 1 : o == KV_OPT_Q2 ? 2 : 4;
        break;
    case KV_OPT_Q1_R0:
    case KV_OPT_Q2_R0:
    case KV_OPT_Q2_R32G32:
    case KV_OPT_Q4_R0:
    case KV_OPT_Q4_R0G128:
        *x = p->quant;
        x->kind = KV_POL_QUANT;
        x->bits = o == KV_OPT_Q4_R0 || o == KV_OPT_Q4_R0G128 ? 4 : o == KV_OPT_Q1_R0 ? 1 : 2;
        x->residual = o == KV_OPT_Q2_R32G32 ? 32 : 0;
        if (o == KV_OPT_Q2_R32G32) x->group = 32;
        if (o == KV_OPT_Q4_R0G128) x->group = 128;
        break;
    case KV_OPT_SPARSE: *x = p->sparse; break;
    case KV_OPT_SPARSE32:
        *x = p->sparse;
        x->sink = 4;
        x->window = 12;
        x->topk = 16;
        break;
    case KV_OPT_STREAM32:
    case KV_OPT_STREAM64:
        kv_policy_params_default(x, KV_POL_STREAMING);
        x->sink = 4;
        x->window = o == KV_OPT_STREAM32 ? 28 : 60;
        break;
    case KV_OPT_DSQ: *x = p->dsq; break;
    case KV_OPT_DSQ_S10:
        /* the cheaper layout: 10% salient and 2-bit keys (the dsq default
         * keeps its keys at 4 bits) */
        *x = p->dsq;
        x->dsq_salient = 0.1;
        x->dsq_kbits = 2;
        x->dsq_vbits = 2;
        break;
    default: kv_policy_params_default(x, KV_POL_FULL);
    }
    x->dtype = KV_DT_F16;
    x->given = 0;
}

/* Option o as deployed: its parameters in the storage type asked for, not
 * the fp16 its bytes are counted in. */
void kv_profile_deploy_params(const kv_profile_params *p, kv_profile_opt o, kv_policy_params *x)
{
    opt_params(p, o, x);
    x->dtype = x->kind == KV_POL_SPARSE    ? p->sparse.dtype
               : x->kind == KV_POL_DSQ     ? p->dsq.dtype
               : x->kind == KV_POL_FULL    ? KV_DT_F32
               : x->kind == KV_POL_QUANT   ? p->quant.dtype
                                           : p->sparse.dtype; /* streaming: as sparse rows */
}

// --- one file --------------------------------------------------------------------

static kv_status alloc_acc(kv_profile *a, int L, int NH, int H, int D)
{
    a->n_layers = L;
    a->n_heads = NH;
    a->n_kv_heads = H;
    a->head_dim = D;
    size_t n = (size_t)L * NH;
    bool ok = (a->score = calloc(n, sizeof(double))) && (a->layer_score = calloc((size_t)L, sizeof(double)));
    for (int o = 0; o < KV_OPT_COUNT; o++)
        ok = ok && (a->err[o] = calloc(n, sizeof(double))) &&
             (a->layer_err[o] = calloc((size_t)L, sizeof(double))) &&
             (a->bytes[o] = calloc((size_t)L, sizeof(double))) &&
             (a->kl[o] = calloc((size_t)L, sizeof(double)));
    return ok ? KV_OK : kv_fail(KV_E_NOMEM, "profile tables");
}

void kv_profile_clear(kv_profile *a)
{
    free(a->score);
    free(a->layer_score);
    for (int o = 0; o < KV_OPT_COUNT; o++) {
        free(a->err[o]);
        free(a->layer_err[o]);
        free(a->bytes[o]);
        free(a->kl[o]);
    }
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

static kv_status check_params(const kv_profile_params *p)
{
    if (!(p->alpha > 0 && p->alpha <= 1)) return kv_fail(KV_E_USAGE, "alpha must be in (0, 1]");
    if (p->sparse.channels < 1) return kv_fail(KV_E_USAGE, "channels must be >= 1");
    if (p->sparse.topk < 0 || (p->sparse.topk == 0 && !(p->sparse.topk_frac > 0 && p->sparse.topk_frac <= 1)))
        return kv_fail(KV_E_USAGE, "budget must be a token count or a fraction in (0, 1]");
    if (p->quant.group < 1 || p->quant.residual < 0) return kv_fail(KV_E_USAGE, "bad KIVI group or residual");
    if (!(p->kv_budget > 0)) return kv_fail(KV_E_USAGE, "--kv-budget must be above 0");
    return KV_OK;
}

/* (H, T, D) -> the first n tokens of every head, contiguous: out (H, n, D). */
static void prefix_of(const float *x, int H, int T, int D, int n, float *out)
{
    for (int h = 0; h < H; h++)
        memcpy(out + (size_t)h * n * D, x + (size_t)h * T * D, (size_t)n * D * sizeof *out);
}

/*
 * Run option prm on one layer as the engine would: observe the nq queries,
 * ingest tokens [0, T - nq), then append each of the last nq tokens and
 * attend its query.  eh (NH) += the relative error of each head's output
 * over the nq steps, against exact attention over the same tokens.  Then
 * *resident = the resident bytes of the policy holding the whole cache
 * (plus, for sparse, the K rows its attention buffer gathers).
 * Returns KV_E_USAGE (detail cleared) when the option does not apply to
 * this geometry.  kp, vp: (H*T*D) scratch; row: (2*H*D); o: (2*NH*D).
 */
static kv_status run_option(const kv_policy_params *prm, int layer, const float *q, int NH, int nq,
                            const float *k, const float *v, int H, int T, int D, float *kp,
                            float *vp, float *row, float *o, double *eh, double *resident)
{
    const kv_policy_geom g = {layer, NH, H, D, T};
    kv_status st = kv_policy_check(prm, &g, KV_DEVICE_CPU);
    if (st) {
        kv_errclear();
        return KV_E_USAGE;
    }
    kv_policy *pol = NULL;
    if ((st = kv_policy_new(&g, prm, &pol))) return st;
    const int T0 = T - nq;
    float *qj = o + (size_t)2 * NH * D, *ref = o + (size_t)NH * D;
    double *en = calloc((size_t)2 * NH, sizeof(double)), *ed = en ? en + NH : NULL;
    if (!en) st = kv_fail(KV_E_NOMEM, "profile errors");
    if (!st && pol->ops->observe) pol->ops->observe(pol, q, nq);
    if (!st) {
        prefix_of(k, H, T, D, T0, kp);
        prefix_of(v, H, T, D, T0, vp);
        st = pol->ops->ingest(pol, kp, vp, T0);
    }
    for (int j = 0; j < nq && !st; j++) {
        const int t = T0 + j;
        for (int h = 0; h < H; h++) {
            memcpy(row + (size_t)h * D, k + ((size_t)h * T + t) * D, (size_t)D * sizeof *row);
            memcpy(row + (size_t)(H + h) * D, v + ((size_t)h * T + t) * D, (size_t)D * sizeof *row);
        }
        if ((st = pol->ops->append(pol, t, row, row + (size_t)H * D))) break;
        for (int qh = 0; qh < NH; qh++)
            memcpy(qj + (size_t)qh * D, q + ((size_t)qh * nq + j) * D, (size_t)D * sizeof *qj);
        if ((st = pol->ops->attend(pol, qj, o))) break;
        kv_attend_dense(qj, k, v, t + 1, T, NH, H, D, ref);
        for (int qh = 0; qh < NH; qh++)
            for (int c = 0; c < D; c++) {
                double d = (double)o[(size_t)qh * D + c] - ref[(size_t)qh * D + c];
                en[qh] += d * d;
                ed[qh] += (double)ref[(size_t)qh * D + c] * ref[(size_t)qh * D + c];
            }
    }
    kv_policy_free(pol);
    pol = NULL;
    if (!st)
        for (int qh = 0; qh < NH; qh++) eh[qh] += ed[qh] > 0 ? sqrt(en[qh] / ed[qh]) : 0;
    /* the bytes of the whole cache held */
    if (!st && (st = kv_policy_new(&g, prm, &pol)) == KV_OK) {
        if (pol->ops->observe) pol->ops->observe(pol, q, nq);
        st = pol->ops->ingest(pol, k, v, T);
        kv_bytes b;
        pol->ops->bytes(pol, &b);
        *resident = (double)b.resident;
        if (prm->kind == KV_POL_SPARSE) {
            int kk = prm->topk > 0 ? prm->topk : (int)ceil(prm->topk_frac * T);
            int ncand = T - (prm->sink < T ? prm->sink : T) - prm->window;
            if (kk > ncand) kk = ncand > 0 ? ncand : 0;
            *resident += 2.0 * H * kk * D * 2;
        }
        kv_policy_free(pol);
    }
    free(en);
    return st;
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
    kv_status st = check_params(p);
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
    float *kp = malloc(n * sizeof *kp), *vp = malloc(n * sizeof *vp);
    float *pr = malloc((size_t)T * sizeof *pr);
    float *row = malloc((size_t)2 * H * D * sizeof *row), *o = malloc((size_t)3 * NH * D * sizeof *o);
    double *eh = malloc((size_t)NH * sizeof *eh);
    if (!q || !k || !v || !kp || !vp || !pr || !row || !o || !eh) {
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
        double *row_s = acc->score + (size_t)l * NH;
        for (int qh = 0; qh < NH; qh++) {
            const float *kh = k + (size_t)(qh / (NH / H)) * T * D;
            double ssum = 0;
            for (int j = 0; j < nq; j++) {
                int nv = T - nq + j + 1;
                kv_attn_probs(q + ((size_t)qh * nq + j) * D, kh, nv, D, pr);
                ssum += mass_outside_top(pr, nv, p->alpha);
            }
            row_s[qh] += ssum / nq;
        }
        acc->bytes[KV_OPT_FULL][l] += 2.0 * H * T * D * 2;
        for (int oi = KV_OPT_Q1; oi < KV_OPT_COUNT && !st; oi++) {
            kv_policy_params x;
            opt_params(p, (kv_profile_opt)oi, &x);
            double *dst = acc->err[oi] + (size_t)l * NH, res = 0;
            for (int qh = 0; qh < NH; qh++) eh[qh] = 0;
            st = p->choices & (1u << oi)
                     ? run_option(&x, l, q, NH, nq, k, v, H, T, D, kp, vp, row, o, eh, &res)
                     : KV_E_USAGE; /* not asked for: not measured, never chosen */
            if (st == KV_E_USAGE) { /* e.g. head dim 12 at 1 bit: not an option */
                st = KV_OK;
                for (int qh = 0; qh < NH; qh++) dst[qh] = NAN;
                acc->bytes[oi][l] = NAN;
                continue;
            }
            for (int qh = 0; qh < NH; qh++) dst[qh] += eh[qh];
            acc->bytes[oi][l] += res;
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
    free(kp);
    free(vp);
    free(pr);
    free(row);
    free(o);
    free(eh);
    return st;
}

void kv_profile_finish(kv_profile *a)
{
    if (a->n_docs < 1) return;
    const int NH = a->n_heads;
    for (int l = 0; l < a->n_layers; l++) {
        double s = 0;
        for (int h = 0; h < NH; h++) s += a->score[(size_t)l * NH + h] /= a->n_docs;
        a->layer_score[l] = s / NH;
        for (int o = 0; o < KV_OPT_COUNT; o++) {
            double e = 0;
            for (int h = 0; h < NH; h++) e += a->err[o][(size_t)l * NH + h] /= a->n_docs;
            a->layer_err[o][l] = e / NH;
            a->bytes[o][l] /= a->n_docs;
            if (a->kl_docs > 0) a->kl[o][l] /= a->kl_docs;
        }
    }
    a->n_docs = -a->n_docs; /* finished: further adds are an error */
}

void kv_profile_choice_clear(kv_profile_choice *c)
{
    if (!c) return;
    free(c->opt);
    memset(c, 0, sizeof *c);
}

/* The error the budget rule minimizes: the KL through the model when it
 * was measured, else the attention-output error. */
static const double *decision_err(const kv_profile *a, int o)
{
    return a->kl_docs > 0 ? a->kl[o] : a->layer_err[o];
}

/* Multiple-choice knapsack: per layer one option, least total error with
 * the bytes (in steps of 1/U of each layer's full bytes) within B steps. */
#define STEPS 1000
static kv_status choose_budget(const kv_profile *a, double budget_frac, kv_profile_opt *opt,
                               bool *met)
{
    const int L = a->n_layers;
    const long B = (long)floor(budget_frac * STEPS * L + 1e-9);
    int cost[KV_OPT_COUNT];
    double *dp = malloc((size_t)(B + 1) * sizeof *dp), *nx = malloc((size_t)(B + 1) * sizeof *nx);
    unsigned char *ch = malloc((size_t)L * (size_t)(B + 1));
    if (!dp || !nx || !ch) {
        free(dp);
        free(nx);
        free(ch);
        return kv_fail(KV_E_NOMEM, "budget choice over %ld steps", B);
    }
    for (long b = 0; b <= B; b++) dp[b] = 0;
    for (int l = 0; l < L; l++) {
        for (int o = 0; o < KV_OPT_COUNT; o++) {
            double fr = a->bytes[o][l] / a->bytes[KV_OPT_FULL][l];
            cost[o] = isfinite(decision_err(a, o)[l]) && isfinite(fr) ? (int)ceil(fr * STEPS - 1e-6) : -1;
        }
        for (long b = 0; b <= B; b++) {
            double best = INFINITY;
            int bo = -1;
            for (int o = 0; o < KV_OPT_COUNT; o++) {
                if (cost[o] < 0 || cost[o] > b) continue;
                double e = dp[b - cost[o]] + decision_err(a, o)[l];
                /* less error; on a tie the fewer bytes */
                if (e < best - 1e-12 || (bo >= 0 && fabs(e - best) <= 1e-12 && cost[o] < cost[bo])) {
                    best = e;
                    bo = o;
                }
            }
            nx[b] = best;
            ch[(size_t)l * (B + 1) + b] = (unsigned char)(bo < 0 ? 255 : bo);
        }
        double *t = dp;
        dp = nx;
        nx = t;
    }
    *met = isfinite(dp[B]);
    if (*met) {
        long b = B;
        for (int l = L - 1; l >= 0; l--) {
            int o = ch[(size_t)l * (B + 1) + b];
            opt[l] = (kv_profile_opt)o;
            b -= (int)ceil(a->bytes[o][l] / a->bytes[KV_OPT_FULL][l] * STEPS - 1e-6);
        }
    } else { /* over budget whatever is chosen: the fewest bytes per layer */
        for (int l = 0; l < L; l++) {
            int bo = KV_OPT_FULL;
            for (int o = 0; o < KV_OPT_COUNT; o++)
                if (isfinite(a->bytes[o][l]) && isfinite(decision_err(a, o)[l]) && a->bytes[o][l] < a->bytes[bo][l])
                    bo = o;
            opt[l] = (kv_profile_opt)bo;
        }
    }
    free(dp);
    free(nx);
    free(ch);
    return KV_OK;
}

kv_status kv_profile_deploy(const kv_profile *a, const kv_profile_params *p, kv_deploy *d,
                            kv_profile_choice *c)
{
    kv_deploy_defaults(d);
    kv_profile_choice local = {0};
    if (!c) c = &local;
    memset(c, 0, sizeof *c);
    const int L = a->n_layers;
    d->version = 2;
    d->n_layers = L;
    d->per_layer = malloc(((size_t)L + 1) * sizeof *d->per_layer);
    c->opt = malloc(((size_t)L + 1) * sizeof *c->opt);
    kv_status st = KV_OK;
    if (!d->per_layer || !c->opt) st = kv_fail(KV_E_NOMEM, "deploy config");
    double full = 0;
    for (int l = 0; l < L; l++) full += a->bytes[KV_OPT_FULL][l];
    c->full_bytes = full;
    if (!st && p->rule == KV_RULE_TAU) {
        snprintf(d->rule, sizeof d->rule, "tau");
        int qo = p->quant.bits == 1 ? KV_OPT_Q1 : p->quant.bits == 2 ? KV_OPT_Q2 : KV_OPT_Q4;
        for (int l = 0; l < L; l++) c->opt[l] = a->layer_score[l] > p->tau ? (kv_profile_opt)qo : KV_OPT_SPARSE;
        c->budget_met = true;
    } else if (!st) {
        snprintf(d->rule, sizeof d->rule, "budget");
        double frac = p->kv_budget <= 1 ? p->kv_budget : p->kv_budget / (full > 0 ? full : 1);
        d->kv_budget = p->kv_budget;
        c->budget_bytes = frac * full;
        st = choose_budget(a, frac, c->opt, &c->budget_met);
    }
    if (!st) {
        for (int l = 0; l < L; l++) {
            kv_profile_deploy_params(p, c->opt[l], &d->per_layer[l]);
            c->bytes += a->bytes[c->opt[l]][l];
        }
    }
    if (st) {
        kv_deploy_clear(d);
        kv_profile_choice_clear(c);
    }
    if (c == &local) kv_profile_choice_clear(&local);
    return st;
}

// --- output ------------------------------------------------------------------------

static void heads_json(FILE *f, const char *name, const double *row, int n, bool last)
{
    fprintf(f, "\"%s\": ", name);
    kv_json_numbers(f, row, n);
    fputs(last ? "}" : ", ", f);
}

/* The JSON names of the per-option errors, as kv-profile has always written them. */
static const char *const err_names[KV_OPT_COUNT] = {
    NULL, "err_1bit", "err_2bit", "err_4bit", "err_sparse", "err_dsq", "err_2bit_r0",
    "err_2bit_r32g32", "err_4bit_r0", "err_4bit_r0g128", "err_dsq_s10", "err_1bit_r0",
    "err_stream32", "err_stream64", "err_sparse32"};

void kv_profile_write_json(const kv_profile *a, const kv_profile_params *p, const kv_deploy *d,
                           const kv_profile_choice *c, FILE *f)
{
    const int NH = a->n_heads;
    char sp[512], dq[512];
    kv_policy_params x;
    opt_params(p, KV_OPT_SPARSE, &x);
    if (kv_policy_spec_write(&x, sp, sizeof sp)) sp[0] = 0;
    opt_params(p, KV_OPT_DSQ, &x);
    if (kv_policy_spec_write(&x, dq, sizeof dq)) dq[0] = 0;
    fprintf(f, "{\n  \"files\": %d,\n  \"n_layers\": %d,\n  \"n_heads\": %d,\n"
               "  \"n_kv_heads\": %d,\n  \"head_dim\": %d,\n  \"n_q\": %d,\n",
            a->n_docs < 0 ? -a->n_docs : a->n_docs, a->n_layers, NH, a->n_kv_heads, a->head_dim,
            a->n_q);
    fprintf(f, "  \"params\": {\"rule\": \"%s\", \"kv_budget\": %.17g, \"alpha\": %g, \"tau\": %g, "
               "\"nq\": %d, \"bits\": %d, \"group\": %d, \"residual\": %d, \"budget\": %g, "
               "\"channels\": %d, \"sink\": %d, \"window\": %d,\n             \"sparse\": \"%s\", "
               "\"dsq\": \"%s\"},\n",
            p->rule == KV_RULE_TAU ? "tau" : "budget", p->kv_budget, p->alpha, p->tau, p->nq,
            p->quant.bits, p->quant.group, p->quant.residual,
            p->sparse.topk > 0 ? (double)p->sparse.topk : p->sparse.topk_frac, p->sparse.channels,
            p->sparse.sink, p->sparse.window, sp, dq);
    fprintf(f, "  \"error\": \"%s\",\n", a->kl_docs > 0 ? "kl" : "attn");
    if (a->kl_docs > 0) fprintf(f, "  \"kl_files\": %d,\n  \"kl_steps\": %d,\n", a->kl_docs, a->kl_steps);
    fputs("  \"choices\": [", f);
    for (int oi = 0, n = 0; oi < KV_OPT_COUNT; oi++)
        if (p->choices & (1u << oi)) fprintf(f, "%s\"%s\"", n++ ? ", " : "", opt_names[oi]);
    fputs("],\n", f);
    if (c && c->opt) {
        fprintf(f, "  \"choice\": {\"kv_bytes\": %.0f, \"full_bytes\": %.0f, \"ratio\": ", c->bytes,
                c->full_bytes);
        kv_json_number(f, c->full_bytes > 0 ? c->bytes / c->full_bytes : NAN);
        if (p->rule == KV_RULE_BUDGET)
            fprintf(f, ", \"budget_bytes\": %.0f, \"budget_met\": %s", c->budget_bytes,
                    c->budget_met ? "true" : "false");
        fputs("},\n", f);
    }
    fputs("  \"layers\": [\n", f);
    for (int l = 0; l < a->n_layers; l++) {
        size_t o = (size_t)l * NH;
        fprintf(f, "    {\"layer\": %d, \"score\": ", l);
        kv_json_number(f, a->layer_score[l]);
        for (int oi = KV_OPT_Q1; oi < KV_OPT_COUNT; oi++) {
            fprintf(f, ", \"%s\": ", err_names[oi]);
            kv_json_number(f, a->layer_err[oi][l]);
        }
        fprintf(f, ", \"tau_class\": \"%s\"", a->layer_score[l] > p->tau ? "quant" : "sparse");
        if (c && c->opt) {
            kv_profile_opt ch = c->opt[l];
            fprintf(f, ", \"class\": \"%s\", \"choice\": \"%s\"",
                    kv_policy_kind_name(d && d->per_layer ? d->per_layer[l].kind : KV_POL_FULL),
                    kv_profile_opt_name(ch));
        }
        fputs(",\n     \"bytes\": {", f);
        for (int oi = 0; oi < KV_OPT_COUNT; oi++) {
            fprintf(f, "%s\"%s\": ", oi ? ", " : "", kv_profile_opt_name((kv_profile_opt)oi));
            kv_json_number(f, a->bytes[oi][l]);
        }
        if (a->kl_docs > 0) {
            fputs("},\n     \"kl\": {", f);
            for (int oi = 0; oi < KV_OPT_COUNT; oi++) {
                fprintf(f, "%s\"%s\": ", oi ? ", " : "", kv_profile_opt_name((kv_profile_opt)oi));
                kv_json_number(f, a->kl[oi][l]);
            }
        }
        fputs("},\n     \"heads\": {", f);
        heads_json(f, "score", a->score + o, NH, false);
        for (int oi = KV_OPT_Q1; oi < KV_OPT_COUNT; oi++)
            heads_json(f, err_names[oi], a->err[oi] + o, NH, oi + 1 == KV_OPT_COUNT);
        fprintf(f, "}%s\n", l + 1 < a->n_layers ? "," : "");
    }
    fputs("  ],\n  \"deploy\": ", f);
    if (d) {
        double *e = malloc(((size_t)a->n_layers + 1) * sizeof *e), *by = malloc(((size_t)a->n_layers + 1) * sizeof *by);
        for (int l = 0; e && by && c && c->opt && l < a->n_layers; l++) {
            e[l] = decision_err(a, c->opt[l])[l];
            by[l] = a->bytes[c->opt[l]][l];
        }
        bool ext = e && by && c && c->opt;
        kv_deploy_write_json_ext(d, ext ? e : NULL, ext ? by : NULL, f, 2);
        free(e);
        free(by);
    } else {
        fputs("null", f);
    }
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
