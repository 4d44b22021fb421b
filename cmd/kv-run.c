/*
 * kv-run: run a Llama-family model on the CPU or a CUDA GPU (--device) with a
 * KV cache policy per layer: generate text (stdout), dump the prompt's cache
 * (--dump-kv), report timings and KV bytes (--report), score a text
 * (--score-file) or compare two policies on it (--compare); print a prompt's
 * token ids (--tokenize) or every position's next-token probabilities
 * (--probs).  It parses, calls lib/ (kv_prompt, kv_runner on either
 * engine, kv_compare) and prints.
 */
#include <errno.h>
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

enum {
    /* an option with a short name must use it as its id (getopt returns it) */
    O_MODEL = 'm', O_STEPS = 'n', O_PROMPT = 'p', O_TEMP = 't', O_SEED = 's', O_CTX = 'c',
    O_THREADS = 'T', O_TOKENIZER = 256, O_PROMPT_FILE, O_TOKENS, O_TOPP, O_POLICY, O_PROFILE,
    O_KVDTYPE, O_REPORT, O_DUMP, O_NQ, O_SCORE, O_SYNTH, O_WEIGHTS, O_RANDOM_PROMPT, O_DEVICE,
    O_SELECT, O_COMPARE, O_PREFIX, O_ZSTD, O_PREFILL_CHUNK, O_TOKENIZE, O_SPECIAL, O_CHAT, O_PROBS,
    O_PRINT_IDS, O_GEMV
};

static const kv_option opts[] = {
    {O_MODEL, 'm', "model", "FILE", "model: llama2.c .bin or GGUF v3"},
    {O_SYNTH, 0, "synthetic", "NAME", "seeded random model: llama-3.1-8b, llama-3.2-1b, llama-2-7b, tiny, tiny-wide-heads"},
    {O_WEIGHTS, 0, "weights", "TYPE", "synthetic weight type f32|f16|bf16 (default bf16; tiny f32)"},
    {O_TOKENIZER, 0, "tokenizer", "FILE", "llama2.c tokenizer (default: tok*.bin beside the model)"},
    {O_PROMPT, 'p', "prompt", "TEXT", "prompt text (after BOS)"},
    {O_PROMPT_FILE, 0, "prompt-file", "FILE", "prompt text from FILE or - (stdin)"},
    {O_TOKENS, 0, "tokens", "FILE", "prompt as token ids (whitespace or JSON array), FILE or -"},
    {O_RANDOM_PROMPT, 0, "random-prompt", "N", "prompt of N seeded random token ids (benchmarks)"},
    {O_TOKENIZE, 0, "tokenize", NULL, "print the prompt's token ids as a JSON array and exit"},
    {O_SPECIAL, 0, "special", NULL, "recognise special tokens (<|eot_id|>, <s>) written in the prompt"},
    {O_CHAT, 0, "chat", "TEMPLATE", "wrap the prompt as a user turn: llama3, chatml, auto, none or a text with {prompt}"},
    {O_PROBS, 0, "probs", "K", "print each prompt position's top-K next-token probabilities (JSON) and exit"},
    {O_PRINT_IDS, 0, "print-ids", NULL, "write the generated token ids instead of their text"},
    {O_STEPS, 'n', "steps", "N", "tokens to generate (default 128; 0: prefill only)"},
    {O_TEMP, 0, "temp", "T", "temperature; 0 is greedy (default 0)"},
    {O_TEMP, 't', NULL, "T", NULL}, /* deprecated: -t is --tokens elsewhere */
    {O_TOPP, 0, "top-p", "P", "nucleus sampling mass, 0 or 1 disables (default 0.9)"},
    {O_SEED, 's', "seed", "N", "random seed for sampling and --synthetic (default 42)"},
    {O_CTX, 'c', "ctx", "N", "context capacity in tokens (default: the model's)"},
    {O_POLICY, 'P', "policy", "SPEC", "KV policy per layer, e.g. full, quant:bits=2, 0-1=full;*=sparse"},
    {O_PROFILE, 0, "profile", "FILE", "per-layer policies from a kv-profile JSON"},
    {O_KVDTYPE, 0, "kv-dtype", "T", "full-precision KV storage f32|f16|bf16 (default f32)"},
    {O_REPORT, 0, "report", "FILE", "write a JSON report (timings, KV bytes) to FILE or -"},
    {O_DUMP, 0, "dump-kv", "FILE", "write the prompt's KV cache as .kvc to FILE or -"},
    {O_NQ, 0, "nq", "N", "queries per layer kept in --dump-kv (default 32)"},
    {O_ZSTD, 0, "zstd", "N", "compress the --dump-kv file with zstd at level N (1-19)"},
    {O_SCORE, 0, "score-file", "FILE", "score FILE's text by teacher forcing; JSON to stdout"},
    {O_COMPARE, 0, "compare", "SPEC", "run the text under full and under SPEC; report KL, top-1, perplexity"},
    {O_PREFIX, 0, "prefix", "N", "with --compare: tokens prefilled densely (default: half the text)"},
    {O_THREADS, 'T', "threads", "N", "worker threads (default: all cores)"},
    {O_DEVICE, 0, "device", "DEV", "cpu, cuda[:N] or auto (default cpu; auto: the GPU when usable)"},
    {O_SELECT, 0, "select", "HOW", "GPU sparse layers: policy (default) or sketch (1-bit key sketch)"},
    {O_PREFILL_CHUNK, 0, "prefill-chunk", "N", "GPU prefill rows per chunk (default 4096; 0: one token at a time)"},
    {O_GEMV, 0, "gemv-variant", "NAME", "GPU decode GEMV of packed weights: default, old, rows, dp4a (measurement)"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-run", "[OPTIONS] (--model FILE | --synthetic NAME)",
    "Run a Llama-family model on the CPU or GPU with a KV cache policy per layer.", opts,
    "Policies: full, quant, sparse, streaming, dsq (see kv-run(1))."};

typedef struct {
    const char *model, *synth, *weights, *tokenizer, *prompt, *prompt_file, *tokens;
    const char *policy, *profile, *kv_dtype, *report, *dump, *score, *compare;
    kv_policy_defaults def; /* --kv-dtype, --select */
    kv_device dev;
    kv_dtype wt; /* --weights */
    int device_ordinal, prefix, steps, ctx, nq, threads, random_prompt, zstd, prefill_chunk, probs, gemv;
    bool nq_given, tokenize, special, print_ids;
    kv_chat chat; /* --chat */
    double temp, top_p;
    unsigned long seed;
} run_opts;

static bool is_stdout(const char *path) { return path && !strcmp(path, "-"); }

static void parse_opts(int argc, char **argv, run_opts *o)
{
    *o = (run_opts){.steps = 128, .nq = 32, .top_p = 0.9, .seed = 42, .dev = KV_DEVICE_CPU};
    const char *arg;
    int id, optind_;
    while ((id = kv_cli_next(argc, argv, &arg, &optind_)) != -1) {
        switch (id) {
        case O_MODEL: o->model = arg; break;
        case O_SYNTH: o->synth = arg; break;
        case O_WEIGHTS: o->weights = arg; break;
        case O_TOKENIZER: o->tokenizer = arg; break;
        case O_PROMPT: o->prompt = arg; break;
        case O_PROMPT_FILE: o->prompt_file = arg; break;
        case O_TOKENS: o->tokens = arg; break;
        case O_RANDOM_PROMPT: o->random_prompt = (int)kv_cli_long("--random-prompt", arg, 1, 1 << 24); break;
        case O_STEPS: o->steps = (int)kv_cli_long("-n", arg, 0, 1 << 24); break;
        case O_TEMP: o->temp = kv_cli_double("--temp", arg, 0, 100); break;
        case O_TOPP: o->top_p = kv_cli_double("--top-p", arg, 0, 1); break;
        case O_SEED: o->seed = (unsigned long)kv_cli_long("--seed", arg, 0, 0x7fffffffffffffffL); break;
        case O_CTX: o->ctx = (int)kv_cli_long("--ctx", arg, 1, 1 << 24); break;
        case O_POLICY: o->policy = arg; break;
        case O_PROFILE: o->profile = arg; break;
        case O_KVDTYPE:
            if (kv_float_dtype_parse(arg, &o->def.dtype)) kv_cli_usage_error("--kv-dtype must be f32, f16 or bf16");
            o->kv_dtype = arg, o->def.given |= KV_KEY_DTYPE;
            break;
        case O_REPORT: o->report = arg; break;
        case O_DUMP: o->dump = arg; break;
        case O_NQ: o->nq = (int)kv_cli_long("--nq", arg, 1, 1 << 16), o->nq_given = true; break;
        case O_SCORE: o->score = arg; break;
        case O_ZSTD: o->zstd = (int)kv_cli_long("--zstd", arg, 1, 19); break;
        case O_THREADS: o->threads = (int)kv_cli_long("--threads", arg, 1, 4096); break;
        case O_DEVICE: o->dev = kv_cli_device(arg, &o->device_ordinal); break;
        case O_SELECT: /* policy: the spec's own select=; sketch: a default */
            if (strcmp(arg, "policy") && strcmp(arg, "sketch")) kv_cli_usage_error("--select must be policy or sketch");
            if (!strcmp(arg, "sketch")) o->def.given |= KV_KEY_SELECT, o->def.select = KV_SELECT_SKETCH;
            break;
        case O_COMPARE: o->compare = arg; break;
        case O_PREFIX: o->prefix = (int)kv_cli_long("--prefix", arg, 1, 1 << 24); break;
        case O_GEMV: {
            /* the names of kernels/eng_ops.cuh's ENG_GEMVQ_* (default 0, old 1, rows 2, dp4a 3) */
            static const char *const names[] = {"default", "old", "rows", "dp4a"};
            o->gemv = -1;
            for (int i = 0; i < 4; i++)
                if (!strcmp(arg, names[i])) o->gemv = i;
            if (o->gemv < 0) kv_cli_usage_error("--gemv-variant: '%s' is not default, old, rows or dp4a", arg);
            break;
        }
        case O_PREFILL_CHUNK:
            o->prefill_chunk = (int)kv_cli_long("--prefill-chunk", arg, 0, 1 << 20);
            if (o->prefill_chunk == 0) o->prefill_chunk = -1; /* the engine's "one token at a time" */
            break;
        case O_TOKENIZE: o->tokenize = true; break;
        case O_SPECIAL: o->special = true; break;
        case O_CHAT:
            if (kv_chat_parse(arg, &o->chat)) kv_cli_usage_error("--chat must be llama3, chatml, auto, none or a text holding {prompt}");
            break;
        case O_PROBS: o->probs = (int)kv_cli_long("--probs", arg, 1, 1 << 20); break;
        case O_PRINT_IDS: o->print_ids = true; break;
        }
    }
    if (optind_ < argc) kv_cli_usage_error("unexpected argument '%s'", argv[optind_]);
    if (!o->model == !o->synth) kv_cli_usage_error("give exactly one of --model FILE and --synthetic NAME");
    if (!!o->prompt + !!o->prompt_file + !!o->tokens + !!o->random_prompt + !!o->score > 1)
        kv_cli_usage_error("give at most one of --prompt, --prompt-file, --tokens, --random-prompt, --score-file");
    if (o->policy && o->profile) kv_cli_usage_error("--policy and --profile are exclusive");
    o->wt = o->synth && !strcmp(o->synth, "tiny") ? KV_DT_F32 : KV_DT_BF16;
    if (o->weights && kv_float_dtype_parse(o->weights, &o->wt)) kv_cli_usage_error("--weights must be f32, f16 or bf16");
    if (is_stdout(o->report) + is_stdout(o->dump) + !!o->score > 1)
        kv_cli_usage_error("only one of --report -, --dump-kv - and --score-file can use stdout");
    if (o->compare && (o->score || o->dump || o->report || o->random_prompt))
        kv_cli_usage_error("--compare takes a text (--prompt, --prompt-file or --tokens) and no "
                           "--score-file, --dump-kv, --report or --random-prompt");
    if (o->prefix && !o->compare) kv_cli_usage_error("--prefix goes with --compare");
    if (!o->dump && (o->nq_given || o->zstd)) kv_cli_usage_error("%s goes with --dump-kv", o->nq_given ? "--nq" : "--zstd");
    /* Scoring prints its own JSON and runs no decode: a report or a dump
       asked for alongside would silently not be written. */
    if (o->score && (o->report || o->dump))
        kv_cli_usage_error("--score-file writes its JSON to stdout; drop --report and --dump-kv");
    if ((o->def.given & KV_KEY_SELECT) && o->dev == KV_DEVICE_CPU)
        kv_cli_usage_error("--select sketch is a GPU engine selection: add --device cuda (or auto)");
    if (o->dev == KV_DEVICE_CUDA && o->score)
        kv_cli_usage_error("--score-file runs on the CPU: use --device cpu");
    if (o->prompt_file && o->tokens && is_stdout(o->prompt_file) && is_stdout(o->tokens))
        kv_cli_usage_error("stdin can only be read once");
    if ((o->chat.kind || o->special) && (o->tokens || o->random_prompt))
        kv_cli_usage_error("--chat and --special apply to text: not with --tokens or --random-prompt");
    const bool other = o->score || o->compare || o->dump || o->report;
    if (o->tokenize && (other || o->tokens || o->random_prompt || o->synth))
        kv_cli_usage_error("--tokenize takes a model or vocabulary and a text (--prompt or --prompt-file) only");
    if (o->probs && (other || o->tokenize || o->dev != KV_DEVICE_CPU))
        kv_cli_usage_error("--probs runs the prompt on the CPU and prints JSON: no --score-file, --compare, "
                           "--dump-kv, --report, --tokenize or --device");
}

/* The prompt as the options give it. */
static kv_prompt prompt_of(const run_opts *o)
{
    return (kv_prompt){.text = o->prompt, .text_len = o->prompt ? strlen(o->prompt) : 0, .random = o->random_prompt,
                       .path = o->prompt_file ? o->prompt_file : o->score ? o->score : o->tokens,
                       .path_ids = o->tokens != NULL, .seed = o->seed, .chat = o->chat, .special = o->special};
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

/* The model, its tokenizer (optional unless the prompt is text) and the
 * prompt's token ids. */
static int load_inputs(const run_opts *o, kv_model **m, kv_tokenizer **tok, int **prompt, int *n_prompt)
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
    kv_prompt p = prompt_of(o);
    if ((st = kv_prompt_tokens(&p, *tok, c->vocab_size, prompt, n_prompt))) return kv_report(st, "cannot tokenize the prompt");
    if (o->chat.kind == KV_CHAT_AUTO) kv_note(1, "chat template %s", kv_chat_name(p.chat.kind));
    return 0;
}

/* The policies of every layer: --policy or --profile, then the defaults
 * --kv-dtype and --select give for the keys they leave out. */
static int load_policies(const run_opts *o, int L, kv_policy_params **prm)
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
    kv_cli_init(&spec, argc, argv);
    run_opts o;
    parse_opts(argc, argv, &o);
    if (o.tokenize) return run_tokenize(&o);
    if (o.threads) kv_engine_set_threads(o.threads);
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

    /* Open --report before any output is committed, so that an unwritable
       path fails at once (73) rather than after a run and a --dump-kv. */
    if (o.report && (st = kv_outfile_open(&rep, o.report))) {
        rc = kv_report(st, "cannot write %s", o.report);
        goto out;
    }
    rep_open = o.report != NULL;
    if ((rc = load_inputs(&o, &m, &tok, &prompt, &n_prompt))) goto out;
    if ((rc = load_policies(&o, m->cfg.n_layers, &prm))) goto out;
    if (o.compare) {
        rc = run_compare(&o, m, prompt, n_prompt, prm);
        goto out;
    }
    bool grown;
    const int trained = m->cfg.seq_len, n_gen = o.score || o.probs ? 0 : o.steps;
    if ((st = kv_run_ctx(o.ctx, trained, n_prompt, n_gen, &ctx, &grown))) {
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
    if (o.dump && (st = kv_runner_keep(r, o.nq, true))) {
        rc = kv_report(st, "--dump-kv");
        goto out;
    }
    double t0 = kv_now_ms();
    if ((st = kv_runner_prefill(r, prompt, n_prompt, logits))) {
        rc = kv_report(st, "prefill failed");
        goto out;
    }
    double prefill_ms = kv_now_ms() - t0;
    kv_note(1, "prefill: %d tokens in %.1f ms", n_prompt, prefill_ms);
    if (kv_runner_is_gpu(r)) {
        kv_prefill_info pi;
        kv_runner_prefill_info(r, &pi);
        kv_note(1, "GPU prefill %s (%s)", pi.chunked ? "in chunks" : "one token at a time", pi.why);
    }
    if (o.dump && (st = kv_runner_dump_kvc(r, prompt, n_prompt, o.def.dtype, o.dump, o.zstd))) {
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
    if (o.report) { /* the text as printed (none without a tokenizer) */
        if (tok) st = kv_tokens_text(tok, prompt[n_prompt - 1], gen.tokens, gen.n_gen, &text);
        kv_prefill_info pfi;
        kv_runner_prefill_info(r, &pfi);
        kv_run_info info = {n_prompt, prefill_ms, &gen, text, o.kv_dtype, &pfi};
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
    free(prm);
    free(prompt);
    kv_tokenizer_free(tok);
    kv_model_close(m);
    return rc;
}
