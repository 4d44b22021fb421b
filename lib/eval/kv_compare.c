/*
 * kv_compare: lockstep teacher-forced runs of a reference and policies, and
 * the per-position divergence statistics (see kv_compare.h).  Log-softmax
 * and KL are computed in double so that `full` against `full` is exactly 0.
 */
#include "eval/kv_compare.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_json.h"
#include "engine/kv_runner.h"
#include "model/kv_tokenizer.h"
#include "policy/kv_deploy.h"

void kv_compare_opts_default(kv_compare_opts *o)
{
    o->prefix = 0;
    o->device = KV_DEVICE_CPU;
    o->ordinal = 0;
}

void kv_compare_result_clear(kv_compare_result *r)
{
    free(r->kl);
    free(r->agree);
    r->kl = NULL;
    r->agree = NULL;
}

/* logp (n) = log_softmax(x) in double; returns the argmax. */
static int log_softmax(const float *x, int n, double *logp)
{
    int am = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[am]) am = i;
    double mx = x[am], s = 0.0;
    for (int i = 0; i < n; i++) s += exp((double)x[i] - mx);
    double lse = mx + log(s);
    for (int i = 0; i < n; i++) logp[i] = (double)x[i] - lse;
    return am;
}

kv_status kv_compare_run_many(const kv_model *m, const int *tokens, int n,
                              const kv_policy_params *ref, const kv_policy_params *const *pols,
                              int n_pol, const kv_compare_opts *o, kv_compare_result *res)
{
    const int V = m->cfg.vocab_size, E = n_pol + 1;
    if (n < 3) return kv_fail(KV_E_USAGE, "compare needs at least 3 tokens, got %d", n);
    if (n_pol < 1) return kv_fail(KV_E_USAGE, "compare needs a policy");
    int P = o && o->prefix > 0 ? o->prefix : n / 2;
    if (P < 1) P = 1;
    if (P > n - 2)
        return kv_fail(KV_E_USAGE, "prefix of %d tokens leaves nothing to compare in %d tokens", P, n);
    for (int i = 0; i < n_pol; i++) memset(&res[i], 0, sizeof res[i]);
    kv_runner **eng = calloc((size_t)E, sizeof *eng);
    float *logits = malloc((size_t)E * (size_t)V * sizeof(float));
    double *lref = malloc((size_t)V * sizeof(double)), *lpol = malloc((size_t)V * sizeof(double));
    const int ns = n - P - 1;
    kv_status st = KV_OK;
    if (!eng || !logits || !lref || !lpol) st = kv_fail(KV_E_NOMEM, "compare buffers");
    for (int i = 0; i < n_pol && st == KV_OK; i++) {
        res[i].kl = calloc((size_t)ns, sizeof(double));
        res[i].agree = calloc((size_t)ns, 1);
        if (!res[i].kl || !res[i].agree) st = kv_fail(KV_E_NOMEM, "compare results");
    }
    /* The reference picks the device (AUTO resolves there); the policies
     * follow it, so that every number compares runs of one device. */
    kv_device dev = o ? o->device : KV_DEVICE_CPU;
    kv_gpu_engine_opts go;
    kv_gpu_engine_opts_default(&go);
    go.device = o ? o->ordinal : 0;
    for (int e = 0; e < E && st == KV_OK; e++) {
        st = kv_runner_new(m, e == 0 ? ref : pols[e - 1], n, dev, &go, &eng[e]);
        if (st) kv_errcontext("%s engine", e == 0 ? "reference" : "policy");
        if (st == KV_OK && e == 0) dev = kv_runner_is_gpu(eng[0]) ? KV_DEVICE_CUDA : KV_DEVICE_CPU;
    }
    for (int e = 0; e < E && st == KV_OK; e++) st = kv_runner_prefill(eng[e], tokens, P, NULL);
    double nref = 0.0;
    for (int t = P; t < n - 1 && st == KV_OK; t++) {
        /* step token t; the logits predict token t+1 */
        for (int e = 0; e < E && st == KV_OK; e++)
            st = kv_runner_step(eng[e], tokens[t], logits + (size_t)e * (size_t)V);
        if (st) break;
        const int k = t - P, next = tokens[t + 1];
        int am_ref = log_softmax(logits, V, lref);
        nref -= lref[next];
        for (int i = 0; i < n_pol; i++) {
            int am = log_softmax(logits + (size_t)(i + 1) * (size_t)V, V, lpol);
            double kl = 0.0;
            for (int j = 0; j < V; j++)
                if (lref[j] > -745.0) kl += exp(lref[j]) * (lref[j] - lpol[j]);
            if (kl < 0.0) kl = 0.0; /* rounding: KL is never negative */
            res[i].kl[k] = kl;
            res[i].agree[k] = am == am_ref;
            res[i].kl_mean += kl;
            if (kl > res[i].kl_max) res[i].kl_max = kl;
            res[i].top1 += am == am_ref;
            res[i].nll_pol -= lpol[next];
        }
    }
    if (st == KV_OK)
        for (int i = 0; i < n_pol; i++) {
            kv_compare_result *r = &res[i];
            r->n_tokens = n;
            r->prefix = P;
            r->n_scored = ns;
            r->kl_mean /= ns;
            r->top1 /= ns;
            r->nll_ref = nref / ns;
            r->nll_pol /= ns;
            r->ppl_ref = exp(r->nll_ref);
            r->ppl_pol = exp(r->nll_pol);
            r->ppl_diff = r->ppl_pol - r->ppl_ref;
            kv_runner_bytes(eng[0], &r->bytes_ref);
            kv_runner_bytes(eng[i + 1], &r->bytes_pol);
            snprintf(r->device, sizeof r->device, "%s", kv_runner_device(eng[0]));
            kv_runner_prefill_info(eng[0], &r->prefill);
        }
    if (st)
        for (int i = 0; i < n_pol; i++) kv_compare_result_clear(&res[i]);
    for (int e = E - 1; eng && e >= 0; e--) kv_runner_free(eng[e]);
    free(lpol);
    free(lref);
    free(logits);
    free(eng);
    return st;
}

kv_status kv_compare_run(const kv_model *m, const int *tokens, int n,
                         const kv_policy_params *ref, const kv_policy_params *pol,
                         const kv_compare_opts *o, kv_compare_result *res)
{
    const kv_policy_params *pols[1] = {pol};
    return kv_compare_run_many(m, tokens, n, ref, pols, 1, o, res);
}

kv_status kv_compare_run_spec(const kv_model *m, const int *tokens, int n, const kv_policy_params *ref,
                              const char *spec, const kv_policy_defaults *def, const kv_compare_opts *o,
                              kv_compare_result *res)
{
    const int L = m->cfg.n_layers;
    kv_policy_params *pol = calloc((size_t)L, sizeof *pol);
    kv_status st = pol ? kv_policies_load(spec, NULL, def, L, pol) : kv_fail(KV_E_NOMEM, "out of memory");
    if (!st) st = kv_compare_run(m, tokens, n, ref, pol, o, res);
    free(pol);
    return st;
}

kv_status kv_compare_open_model(const char *model, const char *tokenizer, kv_model **m,
                                kv_tokenizer **tok)
{
    *m = NULL;
    *tok = NULL;
    kv_status st = kv_model_open(model, m);
    if (st) return st;
    if (tokenizer) {
        st = kv_tokenizer_load_llama2c(tokenizer, (*m)->cfg.vocab_size, tok);
    } else if (kv_model_gguf(*m)) {
        st = kv_tokenizer_from_gguf(kv_model_gguf(*m), tok);
    } else {
        st = kv_fail(KV_E_USAGE, "%s is a llama2.c checkpoint: give its tokenizer (--tokenizer)", model);
    }
    if (st) {
        kv_model_close(*m);
        *m = NULL;
    }
    return st;
}

static double per_step(const kv_bytes *b, int n_layers)
{
    double steps = n_layers > 0 && b->attends ? (double)b->attends / n_layers : 0.0;
    return steps > 0 ? (double)b->fetched_total / steps : 0.0;
}

kv_status kv_compare_print(FILE *f, bool json, const char *model, const char *ref_name,
                           const char *const *names, const kv_compare_result *res, int n,
                           int n_layers, bool per_position)
{
    if (n < 1) return KV_OK;
    const kv_compare_result *r0 = &res[0];
    if (json) {
        fprintf(f, "{\"model\": ");
        kv_json_string(f, model);
        fprintf(f, ", \"reference\": ");
        kv_json_string(f, ref_name);
        fprintf(f, ", \"device\": ");
        kv_json_string(f, r0->device);
        fprintf(f, ", \"prefill\": {\"device\": ");
        kv_json_string(f, r0->prefill.device ? r0->prefill.device : "cpu");
        fprintf(f, ", \"method\": \"%s\", \"chunk\": %d, \"why\": ",
                r0->prefill.chunked ? "chunked" : "tokens", r0->prefill.chunked ? r0->prefill.chunk : 1);
        kv_json_string(f, r0->prefill.why);
        fprintf(f, "}, \"n_tokens\": %d, \"prefix\": %d, \"n_scored\": %d, \"ppl_reference\": ",
                r0->n_tokens, r0->prefix, r0->n_scored);
        kv_json_number(f, r0->ppl_ref);
        fprintf(f, ", \"reference_resident_bytes\": %llu, \"results\": [",
                (unsigned long long)r0->bytes_ref.resident);
        for (int i = 0; i < n; i++) {
            const kv_compare_result *r = &res[i];
            fprintf(f, "%s\n  {\"policy\": ", i ? "," : "");
            kv_json_string(f, names[i]);
            fprintf(f, ", \"kl_mean\": ");
            kv_json_number(f, r->kl_mean);
            fprintf(f, ", \"kl_max\": ");
            kv_json_number(f, r->kl_max);
            fprintf(f, ", \"top1_agreement\": ");
            kv_json_number(f, r->top1);
            fprintf(f, ", \"ppl\": ");
            kv_json_number(f, r->ppl_pol);
            fprintf(f, ", \"ppl_diff\": ");
            kv_json_number(f, r->ppl_diff);
            fprintf(f, ", \"resident_bytes\": %llu, \"host_bytes\": %llu, \"fetched_bytes_per_step\": %.0f",
                    (unsigned long long)r->bytes_pol.resident, (unsigned long long)r->bytes_pol.host,
                    per_step(&r->bytes_pol, n_layers));
            if (per_position) {
                fprintf(f, ", \"kl\": ");
                kv_json_numbers(f, r->kl, r->n_scored);
                fprintf(f, ", \"agree\": [");
                for (int k = 0; k < r->n_scored; k++) fprintf(f, "%s%d", k ? ", " : "", r->agree[k]);
                fprintf(f, "]");
            }
            fprintf(f, "}");
        }
        fprintf(f, "\n]}\n");
    } else {
        fprintf(f, "device: %s\n", r0->device);
        const char *pdev = r0->prefill.device ? r0->prefill.device : "cpu";
        if (r0->prefill.chunked)
            fprintf(f, "prefill: %s, chunks of %d rows (%s)\n", pdev, r0->prefill.chunk, r0->prefill.why);
        else
            fprintf(f, "prefill: %s, one token at a time (%s)\n", pdev, r0->prefill.why);
        fprintf(f, "%d tokens, %d prefilled densely, %d positions scored; reference %s: ppl %.4f, %llu bytes\n",
                r0->n_tokens, r0->prefix, r0->n_scored, ref_name, r0->ppl_ref,
                (unsigned long long)r0->bytes_ref.resident);
        fprintf(f, "%-36s %10s %10s %7s %10s %10s %12s %10s %12s\n", "policy", "KL mean", "KL max",
                "top-1", "ppl", "ppl diff", "resident", "host", "fetched/t");
        for (int i = 0; i < n; i++) {
            const kv_compare_result *r = &res[i];
            fprintf(f, "%-36s %10.5f %10.5f %7.3f %10.4f %+10.4f %12llu %10llu %12.0f\n", names[i],
                    r->kl_mean, r->kl_max, r->top1, r->ppl_pol, r->ppl_diff,
                    (unsigned long long)r->bytes_pol.resident, (unsigned long long)r->bytes_pol.host,
                    per_step(&r->bytes_pol, n_layers));
        }
    }
    return fflush(f) || ferror(f) ? kv_fail(KV_E_IO, "write error") : KV_OK;
}
