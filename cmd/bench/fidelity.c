/*
 * kv-bench fidelity: how far each KV policy's next-token distributions
 * drift from `full` on a text (lib/kv_compare): KL divergence, top-1
 * agreement, perplexity of both, and the bytes each policy keeps.  The
 * first --prefix tokens are prefilled densely; the rest are teacher-forced
 * through the policies.  --device runs the reference and every policy on
 * the CPU engine or all on the GPU engine (lib/kv_runner).  A table on a
 * terminal, JSON when piped or --json.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "common/kv_file.h"
#include "eval/kv_compare.h"
#include "engine/kv_engine.h"
#include "engine/kv_runner.h"
#include "model/kv_tokenizer.h"
#include "policy/kv_deploy.h"

int kv_bench_fidelity_main(int argc, char **argv);

/* getopt returns the short letter for a short option: ids of options with
 * one are that letter */
enum { O_MODEL = 'm', O_TOK = 't', O_POLICY = 'p', O_TEXT = 256, O_TOKENS, O_PREFIX,
       O_MAXTOK, O_REF, O_PERPOS, O_JSON, O_THREADS, O_DEVICE, O_PROFILE };

static const kv_option opts[] = {
    {O_MODEL, 'm', "model", "FILE", "model (llama2.c checkpoint or GGUF)"},
    {O_TOK, 0, "tokenizer", "FILE", "llama2.c tokenizer.bin (GGUF models carry their own)"},
    {O_TOK, 't', NULL, "FILE", NULL}, /* deprecated: -t is --tokens elsewhere */
    {O_TEXT, 0, "text", "FILE|-", "text to score (encoded after BOS)"},
    {O_TOKENS, 0, "tokens", "FILE|-", "token ids instead of text (whitespace or JSON array)"},
    {O_POLICY, 'P', "policy", "SPEC", "policy spec to compare with the reference, repeatable"},
    {O_POLICY, 'p', NULL, "SPEC", NULL}, /* deprecated: -p is --prompt elsewhere */
    {O_PROFILE, 0, "profile", "FILE", "per-layer policies from a kv-profile JSON, repeatable"},
    {O_REF, 0, "reference", "SPEC", "reference policy (default: full; f32 on the CPU, fp16 on the GPU)"},
    {O_PREFIX, 0, "prefix", "N", "tokens prefilled densely (default: half of the sequence)"},
    {O_MAXTOK, 0, "max-tokens", "N", "use the first N tokens (default: the model's context)"},
    {O_PERPOS, 0, "per-position", NULL, "add each position's KL and top-1 agreement to the JSON"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {O_THREADS, 'T', "threads", "N", "matmul threads (default: OpenMP's)"},
    {O_DEVICE, 0, "device", "DEV", "cpu, cuda[:N] or auto (default cpu; auto: the GPU when usable)"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench fidelity",
    "--model FILE [--tokenizer FILE] (--text FILE | --tokens FILE) (-P SPEC | --profile FILE)...",
    "KL divergence, top-1 agreement and perplexity of KV policies against full.", opts,
    "KL(reference || policy) in nats per position, over the positions predicted by\n"
    "decode steps after the prefix.  On the GPU (--device cuda) the reference and\n"
    "every policy run on the GPU engine (fp16 weights and KV)."};

int kv_bench_fidelity_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *model = NULL, *tokp = NULL, *text = NULL, *tokfile = NULL, *refspec = NULL, *a;
    const char *pols[64];
    bool prof[64];
    char *labels[64] = {0};
    int npol = 0, maxtok = 0, oi;
    bool json = false, per_pos = false;
    kv_compare_opts co;
    kv_compare_opts_default(&co);
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        switch (c) {
        case O_MODEL: model = a; break;
        case O_TOK: tokp = a; break;
        case O_TEXT: text = a; break;
        case O_TOKENS: tokfile = a; break;
        case O_POLICY:
        case O_PROFILE:
            if (npol == 64) kv_cli_usage_error("at most 64 policies");
            prof[npol] = c == O_PROFILE;
            pols[npol++] = a;
            break;
        case O_REF: refspec = a; break;
        case O_PREFIX: co.prefix = (int)kv_cli_long("--prefix", a, 1, 1 << 30); break;
        case O_MAXTOK: maxtok = (int)kv_cli_long("--max-tokens", a, 3, 1 << 30); break;
        case O_PERPOS: per_pos = true; break;
        case O_JSON: json = true; break;
        case O_THREADS: kv_engine_set_threads((int)kv_cli_long("--threads", a, 1, 1024)); break;
        case O_DEVICE:
            co.device = kv_cli_device(a, &co.ordinal);
            break;
        }
    }
    if (oi < argc) kv_cli_usage_error("unexpected operand '%s'", argv[oi]);
    if (!model) kv_cli_usage_error("--model is required");
    if (!text == !tokfile) kv_cli_usage_error("give one of --text and --tokens");
    if (npol == 0) kv_cli_usage_error("give at least one --policy or --profile");

    int rc = KV_EXIT_OK;
    kv_model *m = NULL;
    kv_tokenizer *tok = NULL;
    char *buf = NULL;
    size_t len = 0;
    int *ids = NULL, n = 0;
    kv_policy_params *ref = NULL, *all = NULL;
    const kv_policy_params **pp = NULL;
    kv_compare_result *res = NULL;
    kv_status st;
    for (int i = 0; i <= npol; i++) { /* check specs before any loading (ranges: later) */
        const char *s = i < npol ? pols[i] : refspec;
        if (s && !(i < npol && prof[i]) && (st = kv_policy_spec_check(s))) {
            rc = kv_report(st, "policy %s", s);
            goto out;
        }
    }
    const char *in = text ? text : tokfile;
    if ((st = kv_file_slurp(in, 0, "text", &buf, &len))) {
        rc = kv_report(st, "%s", in);
        goto out;
    }
    if (text) {
        st = kv_compare_open_model(model, tokp, &m, &tok);
        if (st == KV_OK) st = kv_tokenizer_encode(tok, buf, len, true, false, &ids, &n);
    } else {
        st = kv_model_open(model, &m);
        if (st == KV_OK) st = kv_tokens_parse(buf, len, &ids, &n);
        for (int i = 0; st == KV_OK && i < n; i++)
            if (ids[i] < 0 || ids[i] >= m->cfg.vocab_size)
                st = kv_fail(KV_E_DATA, "token %d (#%d) outside the vocabulary of %d", ids[i], i,
                             m->cfg.vocab_size);
    }
    if (st) {
        rc = kv_report(st, "%s", st == KV_E_DATA || st == KV_E_UNSUPPORTED ? in : model);
        goto out;
    }
    if (maxtok == 0) maxtok = m->cfg.seq_len;
    if (n > maxtok) n = maxtok;
    const int L = m->cfg.n_layers;
    ref = calloc((size_t)L, sizeof *ref);
    all = calloc((size_t)L * (size_t)npol, sizeof *all);
    pp = calloc((size_t)npol, sizeof *pp);
    res = calloc((size_t)npol, sizeof *res);
    if (!ref || !all || !pp || !res) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "fidelity");
        goto out;
    }
    if (refspec && (st = kv_policy_parse(refspec, L, ref))) {
        rc = kv_report(st, "--reference %s", refspec);
        goto out;
    }
    for (int i = 0; i < npol; i++) {
        pp[i] = all + (size_t)i * (size_t)L;
        st = prof[i] ? kv_deploy_load(pols[i], L, all + (size_t)i * (size_t)L)
                     : kv_policy_parse(pols[i], L, all + (size_t)i * (size_t)L);
        if (st) {
            rc = kv_report(st, prof[i] ? "--profile %s" : "--policy %s", pols[i]);
            goto out;
        }
        if (prof[i]) { /* reported as "profile:FILE", as kv-bench ruler does */
            size_t l = strlen(pols[i]) + 9;
            if ((labels[i] = malloc(l))) {
                snprintf(labels[i], l, "profile:%s", pols[i]);
                pols[i] = labels[i];
            }
        }
    }
    if ((st = kv_compare_run_many(m, ids, n, refspec ? ref : NULL, pp, npol, &co, res))) {
        /* no usable GPU reads as kv-run's --device cuda error */
        bool no_gpu = co.device == KV_DEVICE_CUDA && st == KV_E_UNAVAILABLE;
        rc = kv_report(st, "%s", no_gpu ? "--device cuda" : "compare");
        goto out;
    }
    kv_note(1, "ran on %s", res[0].device);
    if ((st = kv_compare_print(stdout, kv_want_json(stdout, json), model,
                               refspec ? refspec : "full", pols, res, npol, L, per_pos)))
        rc = kv_report(st, "stdout");
out:
    for (int i = 0; i < npol; i++) free(labels[i]);
    for (int i = 0; res && i < npol; i++) kv_compare_result_clear(&res[i]);
    free(res);
    free(pp);
    free(all);
    free(ref);
    free(ids);
    free(buf);
    kv_tokenizer_free(tok);
    kv_model_close(m);
    return rc;
}
