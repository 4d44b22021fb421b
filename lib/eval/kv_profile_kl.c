/*
 * kv_profile_add_kl (see kv_profile.h): each option's error measured as a
 * deployment meets it.  The attention-output error of kv_profile_add rates
 * an option by how far each head's output moves on the stored queries;
 * that ranks a sparse layer worst wherever attention is diffuse (a top-K
 * of 3% then misses half the mass and the small output moves by more than
 * its norm), even where the layer keeps every token that decides the next
 * token (niah4k: sparse at 3% answers every needle full answers, 2-bit
 * layers lose some).  Here the model itself says what moved: the CPU
 * engine continues from the file's rows and decodes its last tokens with
 * one layer under the option, and the error is the KL of the next-token
 * distributions against full.  The budget rule then minimizes the sum of
 * the layers' KL, a first-order estimate of the deployment's (each layer's
 * change measured alone).
 */
#include "eval/kv_profile.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kv_engine.h"
#include "policy/kv_policy.h"
#include "policy/kv_prefix.h"
#include "quant/kv_layer_io.h"

/* Prompt tokens prefilled again densely, so that policies observe the
 * queries a real prefill gives them (the engine observes the last 32). */
#define KL_DENSE 32

/* logp (n) = log_softmax(x) in double (full against full is exactly 0). */
static void log_softmax(const float *x, int n, double *logp)
{
    double mx = -INFINITY, s = 0.0;
    for (int i = 0; i < n; i++)
        if (x[i] > mx) mx = x[i];
    for (int i = 0; i < n; i++) s += exp((double)x[i] - mx);
    double ls = mx + log(s);
    for (int i = 0; i < n; i++) logp[i] = (double)x[i] - ls;
}

typedef struct {
    const int *tokens; /* (T) */
    int T, S;          /* tokens, steps decoded */
    kv_prefix pre;     /* the file's first P rows, from memory */
    int P;
} kl_run;

/* Prefill the prompt under per_layer, decode the S steps; logits (S, V). */
static kv_status run_steps(kv_engine *e, const kl_run *r, const kv_policy_params *per_layer,
                           float *logits, int V)
{
    kv_status st = kv_engine_reset(e, per_layer);
    const int Tp = r->T - r->S;
    if (!st)
        st = r->P > 0 ? kv_engine_prefill_from(e, &r->pre, r->tokens + r->P, Tp - r->P, NULL)
                      : kv_engine_prefill(e, r->tokens, Tp, NULL);
    for (int j = 0; j < r->S && !st; j++)
        st = kv_engine_step(e, r->tokens[Tp + j], logits + (size_t)j * V);
    return st;
}

kv_status kv_profile_add_kl(kv_profile *acc, const kvc_file *f, const kv_model *m,
                            const kv_profile_params *p)
{
    const kv_geom *g = kvc_geom(f);
    const int L = g->n_layers, H = g->n_kv_heads, D = g->head_dim, T = g->n_tokens;
    if (acc->n_docs < 1) return kv_fail(KV_E_INTERNAL, "kv_profile_add_kl before kv_profile_add");
    if (acc->n_layers != L || acc->n_kv_heads != H || acc->head_dim != D)
        return kv_fail(KV_E_INTERNAL, "kv_profile_add_kl on a file kv_profile_add did not see");
    kv_status st = kv_prefix_check_model(m, g);
    if (st) return st;
    const kvc_tensor *tt = kvc_find(f, "tokens");
    if (!tt || tt->dtype != KV_DT_I32 || tt->ndim != 1 || tt->shape[0] != T)
        return kv_fail(KV_E_DATA, "the cache has no tokens [%d] to decode again; dump it with "
                                  "kv-run --dump-kv", T);
    if (p->steps < 1 || p->steps >= T)
        return kv_fail(KV_E_USAGE, "--steps %d: the cache holds %d tokens (steps must be 1..%d)",
                       p->steps, T, T - 1);
    const int V = m->cfg.vocab_size, S = p->steps, Tp = T - S;
    kl_run r = {.T = T, .S = S};
    r.P = Tp > KL_DENSE ? Tp - KL_DENSE : 0;
    int *tok = malloc((size_t)T * sizeof *tok);
    float **kv = calloc((size_t)2 * L, sizeof *kv);
    float *lref = malloc((size_t)S * V * sizeof *lref), *lpol = malloc((size_t)S * V * sizeof *lpol);
    double *a = malloc((size_t)2 * V * sizeof *a);
    kv_policy_params *per = malloc((size_t)L * sizeof *per);
    kv_engine *e = NULL;
    if (!tok || !kv || !lref || !lpol || !a || !per) st = kv_fail(KV_E_NOMEM, "KL profile buffers");
    for (int t = 0; !st && t < T; t++) {
        int32_t x;
        memcpy(&x, (const char *)tt->data + 4 * (size_t)t, 4);
        if (x < 0 || x >= V) st = kv_fail(KV_E_DATA, "token %d at %d is outside the vocabulary (%d)", x, t, V);
        tok[t] = x;
    }
    r.tokens = tok;
    /* every layer's rows once, in memory: the prefix is their first P */
    for (int i = 0; !st && i < 2 * L; i++) {
        if (!(kv[i] = malloc((size_t)H * T * D * sizeof(float)))) st = kv_fail(KV_E_NOMEM, "KL profile rows");
        else st = kv_layer_decode(f, i / 2, i % 2 ? 'v' : 'k', kv[i]);
    }
    const void **kp = malloc(((size_t)L + 1) * sizeof *kp), **vp = malloc(((size_t)L + 1) * sizeof *vp);
    if (!st && (!kp || !vp)) st = kv_fail(KV_E_NOMEM, "KL profile rows");
    for (int l = 0; !st && l < L; l++) {
        kp[l] = kv[2 * l];
        vp[l] = kv[2 * l + 1];
    }
    r.pre = (kv_prefix){.T = r.P, .n_kv_heads = H, .head_dim = D, .matched = r.P, .dt = KV_DT_F32,
                        .k = (const void *const *)kp, .v = (const void *const *)vp, .ld = T};
    for (int l = 0; !st && l < L; l++) kv_policy_params_default(&per[l], KV_POL_FULL);
    if (!st) st = kv_engine_new(m, per, T, &e);
    if (!st && (st = run_steps(e, &r, per, lref, V))) kv_errcontext("full");
    for (int l = 0; !st && l < L; l++) {
        for (int o = KV_OPT_FULL + 1; !st && o < KV_OPT_COUNT; o++) {
            if (!(p->choices & (1u << o)) || isnan(acc->bytes[o][l])) { /* not measured, never chosen */
                acc->kl[o][l] = NAN;
                continue;
            }
            kv_policy_params x;
            kv_profile_deploy_params(p, (kv_profile_opt)o, &x);
            const kv_policy_geom pg = {l, g->n_heads, H, D, T};
            if (kv_policy_check(&x, &pg, KV_DEVICE_CPU)) { /* not an option here */
                kv_errclear();
                acc->kl[o][l] = NAN;
                continue;
            }
            per[l] = x;
            st = run_steps(e, &r, per, lpol, V);
            kv_policy_params_default(&per[l], KV_POL_FULL);
            if (st) {
                kv_errcontext("layer %d, %s", l, kv_profile_opt_name((kv_profile_opt)o));
                break;
            }
            double sum = 0.0;
            for (int j = 0; j < S; j++) {
                log_softmax(lref + (size_t)j * V, V, a);
                log_softmax(lpol + (size_t)j * V, V, a + V);
                double kl = 0.0;
                for (int i = 0; i < V; i++)
                    if (a[i] > -745.0) kl += exp(a[i]) * (a[i] - a[V + i]);
                sum += kl > 0.0 ? kl : 0.0; /* rounding: KL is never negative */
            }
            acc->kl[o][l] += sum / S;
        }
    }
    if (!st) {
        acc->kl_docs++;
        acc->kl_steps = S;
    }
    kv_engine_free(e);
    for (int i = 0; kv && i < 2 * L; i++) free(kv[i]);
    free(kv);
    free(kp);
    free(vp);
    free(tok);
    free(lref);
    free(lpol);
    free(a);
    free(per);
    return st;
}
