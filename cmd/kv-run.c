/*
 * kv-run: run a Llama-family model on the CPU or a CUDA GPU (--device) with a
 * KV cache policy per layer: generate text (stdout), dump the prompt's cache
 * (--dump-kv), report timings and KV bytes (--report), score a text
 * (--score-file) or compare two policies on it (--compare); print a prompt's
 * token ids (--tokenize) or every position's next-token probabilities
 * (--probs).  It parses, calls lib/ (kv_prompt, kv_runner on either
 * engine, kv_compare) and prints.  Its option table and parse are in
 * cmd/run/run_opts.c, the --kv/--store prefill start in cmd/run/run_reuse.c.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "common/kv_outfile.h"
#include "common/kv_stats.h"
#include "engine/kv_engine.h"
#include "engine/kv_runner.h"
#include "eval/kv_compare.h"
#include "model/kv_matmul.h"
#include "model/kv_model.h"
#include "model/kv_prompt.h"
#include "policy/kv_deploy.h"
#include "run.h"

/* The prompt as the options give it. */
static kv_prompt prompt_of(const run_opts *o)
{
    return (kv_prompt){.text = o->prompt, .text_len = o->prompt ? strlen(o->prompt) : 0, .random = o->random_prompt,
                       .path = o->prompt_file ? o->prompt_file : o->score ? o->score : o->tokens,
                       .path_ids = o->tokens != NULL, .seed = o->seed, .chat = o->chat, .special = o->special,
                       .continuation = o->kv != NULL};
}

/* --tokenize: the prompt's ids as one JSON array; a GGUF needs only its
 * vocabulary. */
static int run_tokenize(const run_opts *o)
{
    char *json = NULL;
    kv_prompt p = prompt_of(o);
    kv_status st = kv_prompt_json(o->model, o->tokenizer, &p, &json);
    if (!st) st = kv_outfile_write("-", json);
    free(json);
    return st ? kv_report(st, "--tokenize") : 0;
}

/* The model and its tokenizer (optional unless the prompt is text). */
int run_load_model(const run_opts *o, kv_model **m, kv_tokenizer **tok)
{
    kv_status st = o->synth ? kv_model_synthetic(o->synth, o->seed, o->wt, m) : kv_model_open(o->model, m);
    if (st) return kv_report(st, "cannot load model");
    const kv_model_config *c = &(*m)->cfg;
    kv_note(1, "model %s (%s): dim %d, %d layers, %d/%d heads, vocab %d, kernels %s", c->name, c->format,
            c->dim, c->n_layers, c->n_heads, c->n_kv_heads, c->vocab_size, kv_matmul_isa());
    /* a text (or BOS) prompt needs the tokenizer; token ids use one to print if there is one */
    st = kv_tokenizer_for_model(*m, o->model, o->tokenizer, tok);
    if (st && (o->tokenizer || kv_model_gguf(*m) || (o->model && !o->tokens && !o->random_prompt)))
        return kv_report(st, "cannot load the tokenizer");
    kv_errclear();
    if (*tok && kv_tokenizer_vocab(*tok) != c->vocab_size)
        kv_note(0, "tokenizer has %d tokens, model %d", kv_tokenizer_vocab(*tok), c->vocab_size);
    return 0;
}

/* The model, its tokenizer and the prompt's token ids. */
static int load_inputs(const run_opts *o, kv_model **m, kv_tokenizer **tok, int **prompt, int *n_prompt)
{
    int rc = run_load_model(o, m, tok);
    if (rc) return rc;
    const kv_model_config *c = &(*m)->cfg;
    kv_status st;
    kv_prompt p = prompt_of(o);
    if ((st = kv_prompt_tokens(&p, *tok, c->vocab_size, prompt, n_prompt))) return kv_report(st, "cannot tokenize the prompt");
    if (o->chat.kind == KV_CHAT_AUTO) kv_note(1, "chat template %s", kv_chat_name(p.chat.kind));
    return 0;
}

/* The policies of every layer: --policy or --profile, then the defaults
 * --kv-dtype and --select give for the keys they leave out. */
int run_load_policies(const run_opts *o, int L, kv_policy_params **prm)
{
    kv_status st = (*prm = calloc((size_t)L, sizeof **prm)) ? kv_policies_load(o->policy, o->profile, &o->def, L, *prm)
                                                             : kv_fail(KV_E_NOMEM, "out of memory");
    return st ? kv_report(st, o->profile ? "bad --profile %s" : "bad --policy", o->profile) : 0;
}

/* --compare: the same text under the reference (--policy/--profile, by
 * default full) and under SPEC, both on --device's engine. */
static int run_compare(const run_opts *o, const kv_model *m, const int *ids, int n, const kv_policy_params *ref)
{
    kv_compare_opts co;
    kv_compare_opts_default(&co);
    co.prefix = o->prefix, co.device = o->dev, co.ordinal = o->device_ordinal;
    kv_compare_result res = {0};
    kv_status st = kv_compare_run_spec(m, ids, n, ref, o->compare, &o->def, &co, &res);
    int rc = st ? kv_report(st, "--compare %s", o->compare) : 0;
    const char *names[1] = {o->compare}, *rname = o->profile ? o->profile : o->policy ? o->policy : "full";
    if (!st && (st = kv_compare_print(stdout, kv_want_json(stdout, false), m->cfg.name, rname, names, &res, 1,
                                      m->cfg.n_layers, false)))
        rc = kv_report(st, "stdout");
    kv_compare_result_clear(&res);
    return rc;
}

typedef struct {
    kv_token_writer w;
    bool print; /* stdout is free for the text */
    int total;
} printer;

static void on_token(void *user, int t, int i)
{
    printer *p = user;
    if (p->print) kv_token_write(&p->w, t), fflush(stdout);
    kv_progress("%d/%d tokens", i + 1, p->total);
}

int main(int argc, char **argv)
{
    run_opts o;
    run_parse_opts(argc, argv, &o);
    if (o.tokenize) return run_tokenize(&o);
    if (o.threads) kv_engine_set_threads(o.threads);
    if (o.batch) return run_batch(&o);
    if (is_stdout(o.dump)) kv_refuse_binary_tty(stdout, "a .kvc file");
    int rc = 0, *prompt = NULL, n_prompt = 0, ctx = 0;
    kv_model *m = NULL;
    kv_tokenizer *tok = NULL;
    kv_policy_params *prm = NULL;
    kv_runner *r = NULL;
    float *logits = NULL;
    kv_sampler smp = {0};
    kv_generation gen = {0};
    char *text = NULL, *json = NULL;
    kv_outfile rep;
    bool rep_open = false;
    kv_status st;
    reuse_state ru = {0};

    /* Open --report before any output is committed, so that an unwritable
       path fails at once (73) rather than after a run and a --dump-kv. */
    if (o.report && (st = kv_outfile_open(&rep, o.report))) {
        rc = kv_report(st, "cannot write %s", o.report);
        goto out;
    }
    rep_open = o.report != NULL;
    if ((rc = reuse_open_kv(&o, &ru))) goto out;
    if ((rc = load_inputs(&o, &m, &tok, &prompt, &n_prompt))) goto out;
    if ((rc = run_load_policies(&o, m->cfg.n_layers, &prm))) goto out;
    if ((rc = reuse_begin(&o, m, &ru))) goto out;
    if (o.compare) {
        rc = run_compare(&o, m, prompt, n_prompt, prm);
        goto out;
    }
    bool grown;
    const int trained = m->cfg.seq_len, n_gen = o.score || o.probs ? 0 : o.steps;
    if ((st = kv_run_ctx(o.ctx, trained, n_prompt + ru.pre.T, n_gen, &ctx, &grown))) {
        rc = kv_report(st, "cannot run");
        goto out;
    }
    if (grown)
        kv_warn("the prompt (%d tokens) and -n %d need %d tokens, more than the model's trained context "
                "of %d: the context grows to %d (give --ctx to choose)", n_prompt, n_gen, ctx, trained, ctx);
    /* --score-file keeps running on the CPU engine; --dump-kv runs on
       either (the GPU engine captures its prefill's K/V and queries) */
    kv_device dev = o.score ? KV_DEVICE_CPU : o.dev;
    kv_gpu_engine_opts go;
    kv_gpu_engine_opts_default(&go);
    go.device = o.device_ordinal, go.prefill_chunk = o.prefill_chunk, go.gemv_q = o.gemv;
    go.graph = o.graph;
    if ((st = kv_runner_new(m, prm, ctx, dev, &go, &r))) {
        rc = dev == KV_DEVICE_CUDA ? kv_report(st, "--device cuda") : kv_report(st, "cannot build the engine");
        goto out;
    }
    if (kv_runner_fallback(r)[0]) kv_note(1, "--device auto: using the CPU (%s)", kv_runner_fallback(r));
    else if (kv_runner_is_gpu(r)) kv_note(1, "running on %s", kv_runner_device(r));
    if (o.score || o.probs) { /* JSON to stdout, no decode */
        st = o.score ? kv_runner_score_json(r, prompt, n_prompt, &json) : kv_runner_probs(r, prompt, n_prompt, o.probs, &json);
        if (st || (st = kv_outfile_write("-", json))) rc = kv_report(st, o.score ? "scoring failed" : "--probs");
        goto flush;
    }

    /* prefill, dump, decode */
    const int V = m->cfg.vocab_size;
    if (!(logits = malloc((size_t)V * sizeof *logits)) || kv_sampler_init(&smp, V, (float)o.temp, (float)o.top_p, o.seed)) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "decode buffers");
        goto out;
    }
    if ((o.dump || (o.store && !o.no_insert)) && (st = kv_runner_keep(r, o.nq, true))) {
        rc = kv_report(st, "--dump-kv");
        goto out;
    }
    double t0 = kv_now_ms();
    if ((st = reuse_prefill(&o, r, &ru, prompt, n_prompt, logits))) {
        rc = kv_report(st, o.store ? "--store %s" : o.kv ? "--kv %s" : "prefill failed", o.store ? o.store : o.kv);
        goto out;
    }
    double prefill_ms = kv_now_ms() - t0;
    kv_note(1, "prefill: %d tokens in %.1f ms", n_prompt, prefill_ms);
    if (kv_runner_is_gpu(r)) {
        kv_prefill_info pi;
        kv_runner_prefill_info(r, &pi);
        kv_note(1, "GPU prefill %s (%s)", pi.chunked ? "in chunks" : "one token at a time", pi.why);
    }
    if (o.dump && o.kv && !ru.all) { /* reuse_open_kv refused a cache without them: only out of memory is left */
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "--dump-kv");
        goto out;
    }
    if (o.dump && (st = kv_runner_dump_kvc(r, o.kv ? ru.all : prompt, o.kv ? ru.n_all : n_prompt, o.def.dtype, o.dump, o.zstd))) {
        rc = kv_report(st, "cannot write %s", o.dump);
        goto out;
    }
    printer pr = {{o.print_ids ? NULL : tok, prompt[n_prompt - 1], stdout}, !is_stdout(o.report) && !is_stdout(o.dump),
                  o.steps};
    kv_generate_opts gopt = {o.steps, {tok ? kv_tokenizer_bos(tok) : 1, tok ? kv_tokenizer_eos(tok) : 2}, on_token, &pr,
                             tok};
    st = kv_runner_generate(r, &smp, logits, &gopt, &gen);
    kv_progress_done();
    if (st) {
        rc = kv_report(st, "decode failed");
        goto out;
    }
    if (pr.print && gen.n_gen) putchar('\n');
    if (gen.end == KV_GEN_CTX_FULL)
        kv_warn("the context (%d tokens) is full: %d of -n %d tokens generated", ctx, gen.n_gen, o.steps);
    if (o.store && !o.no_insert && (st = kv_reuse_insert(&ru.ru, r, prompt, n_prompt, &ru.ro))) {
        rc = kv_report(st, "--store %s: cannot insert the prompt", o.store);
        goto out;
    }
    if (o.store) ru.info.extra = kv_reuse_json(&ru.ru);
    if (o.report) { /* the text as printed (none without a tokenizer) */
        if (tok) st = kv_tokens_text(tok, prompt[n_prompt - 1], gen.tokens, gen.n_gen, &text);
        kv_prefill_info pfi;
        kv_runner_prefill_info(r, &pfi);
        kv_run_info info = {n_prompt, prefill_ms, &gen, text, o.kv_dtype, &pfi, (o.kv || o.store) ? &ru.info : NULL};
        if (!st) st = kv_runner_report(r, &info, &json);
        if (!st) rep_open = false, st = kv_outfile_put(&rep, json); /* commits or aborts */
        if (st) rc = kv_report(st, "cannot write %s", o.report);
    }
flush:
    /* A bare KV_E_IO would print whatever detail an earlier, handled failure
       left behind (a tokenizer probe); say what failed.  Once a write has
       been reported, do not report stdout a second time. */
    if ((fflush(stdout) || ferror(stdout)) && !rc)
        rc = kv_report(kv_fail(KV_E_IO, "write error on stdout: %s", strerror(errno)), "cannot write to stdout");
out:
    if (rep_open) kv_outfile_abort(&rep);
    free(json);
    free(text);
    kv_generation_clear(&gen);
    kv_sampler_clear(&smp);
    free(logits);
    kv_runner_free(r);
    free((char *)ru.info.extra);
    reuse_end(&ru);
    free(prm);
    free(prompt);
    kv_tokenizer_free(tok);
    kv_model_close(m);
    return rc;
}
