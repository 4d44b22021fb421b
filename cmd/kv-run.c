/*
 * kv-run: run a Llama-family model on the CPU or a CUDA GPU (--device) with
 * a chosen KV cache policy per layer.  Prefill the prompt, then decode; the generated text goes to
 * stdout.  Optionally dump the prompt's cache as .kvc (--dump-kv), write a
 * JSON report of timings and KV bytes per tier (--report), or score a text
 * by teacher forcing (--score-file).  All the work is in lib/ (kv_model,
 * kv_tokenizer, kv_engine, kv_sampler, kv_policy, kv_deploy).
 */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kv_cli.h"
#include "eval/kv_compare.h"
#include "policy/kv_deploy.h"
#include "engine/kv_engine.h"
#include "common/kv_file.h"
#include "gpu/kv_gpu_engine.h"
#include "format/kv_gguf.h"
#include "model/kv_matmul.h"
#include "model/kv_model.h"
#include "model/kv_sampler.h"
#include "model/kv_chat.h"
#include "model/kv_tokenizer.h"
#include "format/kvc.h"

enum {
    /* an option with a short name must use it as its id (getopt returns it) */
    O_MODEL = 'm', O_STEPS = 'n', O_PROMPT = 'p', O_TEMP = 't', O_SEED = 's', O_CTX = 'c',
    O_THREADS = 'T', O_TOKENIZER = 256, O_PROMPT_FILE, O_TOKENS, O_TOPP, O_POLICY, O_PROFILE,
    O_KVDTYPE, O_REPORT, O_DUMP, O_NQ, O_SCORE, O_SYNTH, O_WEIGHTS, O_RANDOM_PROMPT, O_DEVICE,
    O_SELECT, O_COMPARE, O_PREFIX, O_TOKENIZE, O_SPECIAL, O_CHAT, O_PROBS, O_PRINT_IDS
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
    {O_CHAT, 0, "chat", "TEMPLATE", "wrap the prompt as a user turn: llama3, chatml, auto or none"},
    {O_PROBS, 0, "probs", "K", "print each prompt position's top-K next-token probabilities (JSON) and exit"},
    {O_PRINT_IDS, 0, "print-ids", NULL, "write the generated token ids instead of their text"},
    {O_STEPS, 'n', "steps", "N", "tokens to generate (default 128; 0: prefill only)"},
    {O_TEMP, 't', "temp", "T", "temperature; 0 is greedy (default 0)"},
    {O_TOPP, 0, "top-p", "P", "nucleus sampling mass, 0 or 1 disables (default 0.9)"},
    {O_SEED, 's', "seed", "N", "random seed for sampling and --synthetic (default 42)"},
    {O_CTX, 'c', "ctx", "N", "context capacity in tokens (default: the model's)"},
    {O_POLICY, 0, "policy", "SPEC", "KV policy per layer, e.g. full, quant:bits=2, 0-1=full;*=sparse"},
    {O_PROFILE, 0, "profile", "FILE", "per-layer policies from a kv-profile JSON"},
    {O_KVDTYPE, 0, "kv-dtype", "T", "full-precision KV storage f32|f16|bf16 (default f32)"},
    {O_REPORT, 0, "report", "FILE", "write a JSON report (timings, KV bytes) to FILE or -"},
    {O_DUMP, 0, "dump-kv", "FILE", "write the prompt's KV cache as .kvc to FILE or -"},
    {O_NQ, 0, "nq", "N", "queries per layer kept in --dump-kv (default 32)"},
    {O_SCORE, 0, "score-file", "FILE", "score FILE's text by teacher forcing; JSON to stdout"},
    {O_COMPARE, 0, "compare", "SPEC", "run the text under full and under SPEC; report KL, top-1, perplexity"},
    {O_PREFIX, 0, "prefix", "N", "with --compare: tokens prefilled densely (default: half the text)"},
    {O_THREADS, 'T', "threads", "N", "worker threads (default: all cores)"},
    {O_DEVICE, 0, "device", "DEV", "cpu, cuda or auto (default cpu; auto: the GPU when usable)"},
    {O_SELECT, 0, "select", "HOW", "GPU sparse layers: policy (default) or sketch (1-bit key sketch)"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-run", "[OPTIONS] (--model FILE | --synthetic NAME)",
    "Run a Llama-family model on the CPU or GPU with a KV cache policy per layer.", opts,
    "Policies: full, quant, sparse, streaming, dsq (see kv-run(1))."};

typedef struct {
    const char *model, *synth, *weights, *tokenizer, *prompt, *prompt_file, *tokens;
    const char *policy, *profile, *kv_dtype, *report, *dump, *score, *device, *select, *compare;
    int prefix;
    bool tokenize, special, print_ids;
    int probs;
    const char *chat;
    int steps, ctx, nq, threads, random_prompt;
    double temp, top_p;
    unsigned long seed;
} run_opts;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Default tokenizer: tokenizer.bin, else the first tok*.bin that fits. */
static kv_status find_tokenizer(const char *model_path, int vocab, kv_tokenizer **out)
{
    char *dup = strdup(model_path);
    if (!dup) return kv_fail(KV_E_NOMEM, "out of memory");
    const char *dir = dirname(dup);
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.bin", dir);
    kv_status st = kv_tokenizer_load_llama2c(path, vocab, out);
    if (st != KV_E_NOINPUT) {
        free(dup);
        return st;
    }
    DIR *d = opendir(dir);
    char best[1024] = "";
    for (struct dirent *de; d && (de = readdir(d));) {
        size_t l = strlen(de->d_name);
        if (l > 7 && !strncmp(de->d_name, "tok", 3) && !strcmp(de->d_name + l - 4, ".bin") &&
            l < sizeof best && (!best[0] || strcmp(de->d_name, best) < 0)) {
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            kv_tokenizer *t;
            if (kv_tokenizer_load_llama2c(path, vocab, &t) == KV_OK) {
                kv_tokenizer_free(t);
                snprintf(best, sizeof best, "%s", de->d_name);
            }
        }
    }
    if (d) closedir(d);
    if (!best[0]) {
        free(dup);
        return kv_fail(KV_E_NOINPUT, "no tokenizer for a %d-token vocabulary beside %s (use --tokenizer or --tokens)",
                       vocab, model_path);
    }
    snprintf(path, sizeof path, "%s/%s", dir, best);
    free(dup);
    return kv_tokenizer_load_llama2c(path, vocab, out);
}

/* The prompt's ids: a chat turn (--chat) or the text with BOS/EOS as the
 * vocabulary's file says; --special lets the text name special tokens. */
static kv_status encode_prompt(const kv_tokenizer *tok, const run_opts *o, const char *arch, const char *text,
                               size_t len, int **ids, int *n)
{
    kv_chat_kind k = KV_CHAT_NONE;
    if (o->chat) kv_chat_parse(o->chat, &k); /* checked in parse_opts */
    if (k == KV_CHAT_AUTO) {
        kv_status st = kv_chat_pick(tok, arch, &k);
        if (st) return st;
        kv_note(1, "chat template %s", kv_chat_name(k));
    }
    if (k != KV_CHAT_NONE) return kv_chat_encode(tok, k, NULL, text, len, o->special, ids, n);
    kv_encode_opts eo = {kv_tokenizer_add_bos(tok), kv_tokenizer_add_eos(tok), o->special};
    return kv_tokenizer_encode_ex(tok, text, len, &eo, ids, n);
}

/* --tokenize: ids of the prompt as one JSON array on stdout.  A GGUF needs
 * only its vocabulary (a vocabulary-only file works); a llama2.c model is
 * loaded for its vocabulary size. */
static int tokenize_only(const run_opts *o)
{
    kv_status st;
    kv_model *m = NULL;
    kv_tokenizer *tok = NULL;
    char *text = NULL;
    size_t tlen = 0;
    int *ids = NULL, n = 0, rc = 0;
    if (!o->tokenizer && kv_gguf_is_file(o->model)) {
        st = kv_tokenizer_load_gguf(o->model, &tok);
    } else if (!(st = kv_model_load(o->model, &m))) {
        st = o->tokenizer ? kv_tokenizer_load_llama2c(o->tokenizer, m->cfg.vocab_size, &tok)
                          : find_tokenizer(o->model, m->cfg.vocab_size, &tok);
    }
    if (st) {
        rc = kv_report(st, "cannot load the tokenizer");
        goto out;
    }
    if (o->prompt) {
        text = strdup(o->prompt);
        tlen = strlen(o->prompt);
    } else if (o->prompt_file && (st = kv_file_slurp(o->prompt_file, 0, "file", &text, &tlen))) {
        rc = kv_report(st, "cannot read the prompt");
        goto out;
    }
    if ((st = encode_prompt(tok, o, m ? m->cfg.arch : NULL, text ? text : "", tlen, &ids, &n))) {
        rc = kv_report(st, "cannot tokenize the prompt");
        goto out;
    }
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
    char *js = a ? cJSON_PrintUnformatted(a) : NULL;
    cJSON_Delete(a);
    if (!js) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "--tokenize");
        goto out;
    }
    puts(js);
    free(js);
    if (fflush(stdout) || ferror(stdout))
        rc = kv_report(kv_fail(KV_E_IO, "write error on stdout: %s", strerror(errno)), "cannot write to stdout");
out:
    free(ids);
    free(text);
    kv_tokenizer_free(tok);
    kv_model_free(m);
    return rc;
}

/* --probs: the top-k next-token probabilities after every prompt position,
 * [{"pos": i, "token": id, "top": [[id, p], ...]}, ...] on stdout. */
static int print_probs(kv_engine *e, int vocab, const int *prompt, int n, int k)
{
    float *lg = malloc((size_t)n * (size_t)vocab * sizeof *lg);
    int *ids = malloc((size_t)k * sizeof *ids);
    double *p = malloc((size_t)k * sizeof *p);
    kv_status st = !lg || !ids || !p ? kv_fail(KV_E_NOMEM, "out of memory for %d x %d logits", n, vocab)
                                     : kv_engine_prefill_all(e, prompt, n, lg);
    int rc = 0;
    if (st) {
        rc = kv_report(st, "--probs");
    } else {
        cJSON *a = cJSON_CreateArray();
        for (int i = 0; a && i < n; i++) {
            int m = kv_top_probs(lg + (size_t)i * vocab, vocab, k, ids, p);
            cJSON *o = cJSON_CreateObject(), *top = cJSON_AddArrayToObject(o, "top");
            cJSON_AddNumberToObject(o, "pos", i);
            cJSON_AddNumberToObject(o, "token", prompt[i]);
            for (int j = 0; j < m; j++) {
                cJSON *pair = cJSON_CreateArray();
                cJSON_AddItemToArray(pair, cJSON_CreateNumber(ids[j]));
                cJSON_AddItemToArray(pair, cJSON_CreateNumber(p[j]));
                cJSON_AddItemToArray(top, pair);
            }
            cJSON_AddItemToArray(a, o);
        }
        char *js = a ? cJSON_PrintUnformatted(a) : NULL;
        cJSON_Delete(a);
        if (!js) rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "--probs");
        else puts(js);
        free(js);
    }
    free(lg);
    free(ids);
    free(p);
    return rc;
}

static void put_text(const kv_tokenizer *tok, int prev, int t, FILE *out)
{
    if (!tok) {
        fprintf(out, "%d ", t);
        return;
    }
    size_t l;
    const char *s = kv_tokenizer_decode(tok, prev, t, &l);
    /* a lone unprintable byte (a raw <0xHH> control code) is not written */
    if (l == 1 && !(s[0] >= 32 && s[0] < 127) && s[0] != '\n' && s[0] != '\t' && s[0] != '\r' &&
        !((unsigned char)s[0] & 0x80))
        return;
    fwrite(s, 1, l, out);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The report covers whichever engine ran: the CPU engine e, or the GPU
 * engine g (then e is NULL and per-layer parameters come from prm). */
static cJSON *report_json(const kv_model *m, kv_engine *e, kv_gpu_engine *g,
                          const kv_policy_params *prm, const run_opts *o, int n_prompt, int n_gen,
                          double prefill_ms, double *step_ms, int n_steps)
{
    const kv_model_config *c = &m->cfg;
    cJSON *r = cJSON_CreateObject(), *mo = cJSON_AddObjectToObject(r, "model");
    cJSON_AddStringToObject(mo, "name", c->name);
    cJSON_AddStringToObject(mo, "format", c->format);
    cJSON_AddNumberToObject(mo, "layers", c->n_layers);
    cJSON_AddNumberToObject(mo, "heads", c->n_heads);
    cJSON_AddNumberToObject(mo, "kv_heads", c->n_kv_heads);
    cJSON_AddNumberToObject(mo, "head_dim", c->head_dim);
    cJSON_AddNumberToObject(mo, "vocab", c->vocab_size);
    cJSON_AddNumberToObject(mo, "weight_bytes", (double)kv_model_weight_bytes(m));
#ifdef _OPENMP
    cJSON_AddNumberToObject(r, "threads", omp_get_max_threads());
#else
    cJSON_AddNumberToObject(r, "threads", 1);
#endif
    cJSON_AddStringToObject(r, "isa", kv_matmul_isa());
    cJSON_AddStringToObject(r, "device", g ? kv_gpu_engine_device(g) : "cpu");
    cJSON_AddNumberToObject(r, "ctx", g ? kv_gpu_engine_ctx(g) : kv_engine_ctx(e));
    cJSON_AddNumberToObject(r, "prompt_tokens", n_prompt);
    cJSON_AddNumberToObject(r, "generated_tokens", n_gen);
    cJSON_AddNumberToObject(r, "prefill_ms", prefill_ms);
    cJSON_AddNumberToObject(r, "prefill_tokens_per_s", prefill_ms > 0 ? n_prompt / (prefill_ms / 1e3) : 0);
    double med = 0, p90 = 0, sum = 0;
    if (n_steps > 0) {
        for (int i = 0; i < n_steps; i++) sum += step_ms[i];
        qsort(step_ms, (size_t)n_steps, sizeof *step_ms, cmp_double);
        med = n_steps % 2 ? step_ms[n_steps / 2] : (step_ms[n_steps / 2 - 1] + step_ms[n_steps / 2]) / 2;
        p90 = step_ms[(int)ceil(0.9 * n_steps) - 1];
    }
    cJSON_AddNumberToObject(r, "decode_steps", n_steps);
    cJSON_AddNumberToObject(r, "ms_per_token_median", med);
    cJSON_AddNumberToObject(r, "ms_per_token_p90", p90);
    cJSON_AddNumberToObject(r, "tokens_per_s", sum > 0 ? n_steps / (sum / 1e3) : 0);
    kv_bytes tot;
    if (g) kv_gpu_engine_bytes(g, &tot);
    else kv_engine_bytes(e, &tot);
    cJSON *kb = cJSON_AddObjectToObject(r, "kv_bytes");
    cJSON_AddNumberToObject(kb, "gpu", (double)tot.resident);
    cJSON_AddNumberToObject(kb, "host", (double)tot.host);
    cJSON_AddNumberToObject(kb, "disk", (double)tot.disk);
    cJSON_AddNumberToObject(r, "pcie_bytes_per_token", n_steps ? (double)tot.fetched_total / n_steps : 0);
    cJSON_AddStringToObject(r, "kv_dtype", o->kv_dtype ? o->kv_dtype : "f32");
    cJSON *la = cJSON_AddArrayToObject(r, "layers");
    for (int l = 0; l < c->n_layers; l++) {
        kv_bytes b = {0};
        int n_tokens;
        if (g) {
            kv_gpu_engine_layer_bytes(g, l, &b);
            n_tokens = kv_gpu_engine_pos(g);
        } else {
            kv_policy *p = kv_engine_policy(e, l);
            p->ops->bytes(p, &b);
            n_tokens = p->n_tokens;
        }
        const kv_policy_params *lp = g ? &prm[l] : kv_engine_params(e, l);
        char desc[256];
        kv_engine_policy_desc(lp, desc, sizeof desc);
        cJSON *lo = cJSON_CreateObject();
        cJSON_AddNumberToObject(lo, "layer", l);
        cJSON_AddStringToObject(lo, "policy", kv_policy_kind_name(lp->kind));
        cJSON_AddStringToObject(lo, "params", desc);
        cJSON_AddNumberToObject(lo, "tokens", n_tokens);
        cJSON_AddNumberToObject(lo, "gpu_bytes", (double)b.resident);
        cJSON_AddNumberToObject(lo, "host_bytes", (double)b.host);
        cJSON_AddNumberToObject(lo, "disk_bytes", (double)b.disk);
        cJSON_AddNumberToObject(lo, "fetched_bytes_last", (double)b.fetched_last);
        cJSON_AddNumberToObject(lo, "fetched_bytes_total", (double)b.fetched_total);
        cJSON_AddNumberToObject(lo, "pcie_bytes_per_token", n_steps ? (double)b.fetched_total / n_steps : 0);
        cJSON_AddItemToArray(la, lo);
    }
    return r;
}

/* Print j into an opened outfile and commit it; the outfile is closed
   either way (aborted when printing fails). */
static kv_status write_json(cJSON *j, kv_outfile *of)
{
    char *s = cJSON_Print(j);
    if (!s) {
        kv_outfile_abort(of);
        return kv_fail(KV_E_NOMEM, "out of memory writing JSON");
    }
    fputs(s, of->fp);
    fputc('\n', of->fp);
    free(s);
    return kv_outfile_commit(of);
}

static void parse_opts(int argc, char **argv, run_opts *o)
{
    *o = (run_opts){.steps = 128, .nq = 32, .top_p = 0.9, .seed = 42};
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
        case O_KVDTYPE: o->kv_dtype = arg; break;
        case O_REPORT: o->report = arg; break;
        case O_DUMP: o->dump = arg; break;
        case O_NQ: o->nq = (int)kv_cli_long("--nq", arg, 1, 1 << 16); break;
        case O_SCORE: o->score = arg; break;
        case O_THREADS: o->threads = (int)kv_cli_long("--threads", arg, 1, 4096); break;
        case O_DEVICE: o->device = arg; break;
        case O_SELECT: o->select = arg; break;
        case O_COMPARE: o->compare = arg; break;
        case O_PREFIX: o->prefix = (int)kv_cli_long("--prefix", arg, 1, 1 << 24); break;
        case O_TOKENIZE: o->tokenize = true; break;
        case O_SPECIAL: o->special = true; break;
        case O_CHAT: o->chat = arg; break;
        case O_PROBS: o->probs = (int)kv_cli_long("--probs", arg, 1, 1 << 20); break;
        case O_PRINT_IDS: o->print_ids = true; break;
        }
    }
    if (optind_ < argc) kv_cli_usage_error("unexpected argument '%s'", argv[optind_]);
    if (!o->model == !o->synth) kv_cli_usage_error("give exactly one of --model FILE and --synthetic NAME");
    if (!!o->prompt + !!o->prompt_file + !!o->tokens + !!o->random_prompt + !!o->score > 1)
        kv_cli_usage_error("give at most one of --prompt, --prompt-file, --tokens, --random-prompt, --score-file");
    if (o->policy && o->profile) kv_cli_usage_error("--policy and --profile are exclusive");
    kv_store_dtype dt;
    if (o->kv_dtype && kv_store_dtype_parse(o->kv_dtype, &dt))
        kv_cli_usage_error("--kv-dtype must be f32, f16 or bf16");
    if (o->weights && strcmp(o->weights, "f32") && strcmp(o->weights, "f16") && strcmp(o->weights, "bf16"))
        kv_cli_usage_error("--weights must be f32, f16 or bf16");
    int on_stdout = (o->report && !strcmp(o->report, "-")) + (o->dump && !strcmp(o->dump, "-")) + !!o->score;
    if (on_stdout > 1) kv_cli_usage_error("only one of --report -, --dump-kv - and --score-file can use stdout");
    if (o->compare && (o->score || o->dump || o->report || o->random_prompt))
        kv_cli_usage_error("--compare takes a text (--prompt, --prompt-file or --tokens) and no "
                           "--score-file, --dump-kv, --report or --random-prompt");
    if (o->prefix && !o->compare) kv_cli_usage_error("--prefix goes with --compare");
    kv_chat_kind ck;
    if (o->chat && kv_chat_parse(o->chat, &ck)) kv_cli_usage_error("--chat must be llama3, chatml, auto or none");
    if ((o->chat || o->special) && (o->tokens || o->random_prompt))
        kv_cli_usage_error("--chat and --special apply to text: not with --tokens or --random-prompt");
    if (o->tokenize && (o->tokens || o->random_prompt || o->score || o->compare || o->dump || o->report || o->synth))
        kv_cli_usage_error("--tokenize takes a model or vocabulary and a text (--prompt or --prompt-file) only");
    if (o->probs && (o->score || o->compare || o->dump || o->report || o->tokenize ||
                     (o->device && strcmp(o->device, "cpu"))))
        kv_cli_usage_error("--probs runs the prompt on the CPU and prints JSON: no --score-file, --compare, "
                           "--dump-kv, --report, --tokenize or --device");
    /* Scoring prints its own JSON and runs no decode: a report or a dump
       asked for alongside would silently not be written. */
    if (o->score && (o->report || o->dump))
        kv_cli_usage_error("--score-file writes its JSON to stdout; drop --report and --dump-kv");
    if (o->device && strcmp(o->device, "cpu") && strcmp(o->device, "cuda") && strcmp(o->device, "auto"))
        kv_cli_usage_error("--device must be cpu, cuda or auto");
    if (o->select && strcmp(o->select, "policy") && strcmp(o->select, "sketch"))
        kv_cli_usage_error("--select must be policy or sketch");
    if (o->device && !strcmp(o->device, "cuda") && (o->score || o->dump))
        kv_cli_usage_error("--score-file and --dump-kv run on the CPU: use --device cpu");
    if (o->prompt_file && o->tokens && !strcmp(o->prompt_file, "-") && !strcmp(o->tokens, "-"))
        kv_cli_usage_error("stdin can only be read once");
}

int main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    run_opts o;
    parse_opts(argc, argv, &o);
    if (o.tokenize) return tokenize_only(&o);
    if (o.threads) kv_engine_set_threads(o.threads);
    if (o.dump && !strcmp(o.dump, "-")) kv_refuse_binary_tty(stdout, "a .kvc file");
    int rc = 0;
    kv_status st;
    kv_model *m = NULL;
    kv_tokenizer *tok = NULL;
    kv_policy_params *prm = NULL;
    kv_engine *e = NULL;
    kv_gpu_engine *g = NULL;
    int *prompt = NULL, n_prompt = 0, *gen = NULL;
    double *step_ms = NULL, *nll = NULL;
    char *text = NULL;
    float *logits = NULL;
    kv_sampler smp = {0};
    cJSON *rep = NULL;
    bool text_to_stdout = !o.score && !(o.report && !strcmp(o.report, "-")) && !(o.dump && !strcmp(o.dump, "-"));
    kv_outfile rep_out;
    bool rep_open = false;

    /* Open --report before any output is committed, so that an unwritable
       path fails at once (73) rather than after a run and a --dump-kv. */
    if (o.report) {
        if ((st = kv_outfile_open(&rep_out, o.report))) {
            rc = kv_report(st, "cannot write %s", o.report);
            goto out;
        }
        rep_open = true;
    }

    /* model */
    if (o.synth) {
        kv_wtype wt = !strcmp(o.synth, "tiny") ? KV_W_F32 : KV_W_BF16;
        if (o.weights) {
            if (!strcmp(o.weights, "f32")) wt = KV_W_F32;
            else if (!strcmp(o.weights, "f16")) wt = KV_W_F16;
            else wt = KV_W_BF16; /* checked in parse_opts */
        }
        st = kv_model_synthetic(o.synth, o.seed, wt, &m);
    } else {
        st = kv_model_load(o.model, &m);
    }
    if (st) {
        rc = kv_report(st, "cannot load model");
        goto out;
    }
    const kv_model_config *c = &m->cfg;
    kv_note(1, "model %s (%s): dim %d, %d layers, %d/%d heads, vocab %d, kernels %s", c->name, c->format,
            c->dim, c->n_layers, c->n_heads, c->n_kv_heads, c->vocab_size, kv_matmul_isa());

    /* tokenizer: explicit, from the GGUF, or beside a llama2.c model */
    if (o.tokenizer) st = kv_tokenizer_load_llama2c(o.tokenizer, c->vocab_size, &tok);
    else if (kv_model_gguf(m)) st = kv_tokenizer_from_gguf(kv_model_gguf(m), &tok);
    else if (o.model && !o.tokens && !o.random_prompt) st = find_tokenizer(o.model, c->vocab_size, &tok);
    else if (o.model) find_tokenizer(o.model, c->vocab_size, &tok); /* only for printing */
    if (st) {
        rc = kv_report(st, "cannot load the tokenizer");
        goto out;
    }
    if (tok && kv_tokenizer_vocab(tok) != c->vocab_size)
        kv_note(0, "tokenizer has %d tokens, model %d", kv_tokenizer_vocab(tok), c->vocab_size);

    /* prompt tokens */
    const char *tsrc = o.prompt_file ? o.prompt_file : o.score ? o.score : o.tokens;
    size_t tlen = 0;
    if (o.prompt) {
        text = strdup(o.prompt);
        tlen = strlen(o.prompt);
    } else if (tsrc && (st = kv_file_slurp(tsrc, 0, "file", &text, &tlen))) {
        rc = kv_report(st, "cannot read the prompt");
        goto out;
    }
    if (o.tokens) {
        st = kv_tokens_parse(text, tlen, &prompt, &n_prompt);
    } else if (o.random_prompt) {
        prompt = malloc((size_t)o.random_prompt * sizeof *prompt);
        uint64_t s = o.seed * 2654435761u + 1;
        for (int i = 0; i < o.random_prompt && prompt; i++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            prompt[i] = i == 0 ? (tok ? kv_tokenizer_bos(tok) : 1) : (int)(s % (uint64_t)c->vocab_size);
        }
        n_prompt = prompt ? o.random_prompt : 0;
        st = prompt ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory");
    } else if (text) {
        const char *why;
        if (!tok) st = kv_fail(KV_E_UNAVAILABLE, "no tokenizer for text input; pass token ids with --tokens");
        else if (!kv_tokenizer_can_encode(tok, &why))
            st = kv_fail(KV_E_UNSUPPORTED,
                         "text tokenization is not supported for the '%s' vocabulary; pass token ids with --tokens", why);
        else st = encode_prompt(tok, &o, c->arch, text, tlen, &prompt, &n_prompt);
    } else {
        prompt = malloc(sizeof *prompt);
        if (prompt) prompt[0] = tok ? kv_tokenizer_bos(tok) : 1;
        n_prompt = 1;
        st = prompt ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory");
    }
    if (st) {
        rc = kv_report(st, "cannot tokenize the prompt");
        goto out;
    }

    /* policies */
    prm = calloc((size_t)c->n_layers, sizeof *prm);
    if (!prm) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "policies");
        goto out;
    }
    if (o.profile) st = kv_deploy_load(o.profile, c->n_layers, prm);
    else st = kv_policy_parse(o.policy ? o.policy : "full", c->n_layers, prm);
    if (st) {
        rc = kv_report(st, o.profile ? "bad --profile %s" : "bad --policy", o.profile);
        goto out;
    }
    kv_store_dtype dump_dt = KV_STORE_F32;
    if (o.kv_dtype) {
        kv_store_dtype_parse(o.kv_dtype, &dump_dt); /* checked in parse_opts */
        for (int l = 0; l < c->n_layers; l++) prm[l].dtype = dump_dt;
    }
    if (o.select && !strcmp(o.select, "sketch")) kv_policy_set_select(prm, c->n_layers, KV_SELECT_SKETCH);
    int ctx = o.ctx ? o.ctx : c->seq_len;
    if (!o.ctx && !o.score && n_prompt + o.steps > ctx) ctx = n_prompt + o.steps; /* beyond training length */
    /* --compare: the same text under the reference (--policy/--profile, by
     * default full) and under SPEC, both on --device's engine (lib/kv_compare). */
    if (o.compare) {
        kv_policy_params *pol = calloc((size_t)c->n_layers, sizeof *pol);
        kv_compare_opts co;
        kv_compare_opts_default(&co);
        co.prefix = o.prefix;
        if (o.device) kv_device_parse(o.device, &co.device); /* checked in parse_opts */
        kv_compare_result res = {0};
        if (!pol) st = kv_fail(KV_E_NOMEM, "out of memory");
        else if (!(st = kv_policy_parse(o.compare, c->n_layers, pol)))
            st = kv_compare_run(m, prompt, n_prompt, prm, pol, &co, &res);
        if (st) {
            rc = kv_report(st, "--compare %s", o.compare);
        } else {
            const char *names[1] = {o.compare};
            const char *ref = o.profile ? o.profile : o.policy ? o.policy : "full";
            if ((st = kv_compare_print(stdout, kv_want_json(stdout, false), c->name, ref, names, &res, 1,
                                       c->n_layers, false)))
                rc = kv_report(st, "stdout");
        }
        kv_compare_result_free(&res);
        free(pol);
        goto out;
    }

    /* The GPU engine when asked for (auto falls back to the CPU), else the CPU
     * engine; only one is built, so a long context is allocated only once. */
    if (o.device && strcmp(o.device, "cpu") && !o.score && !o.dump) {
        kv_gpu_engine_opts go;
        kv_gpu_engine_opts_default(&go);
        st = kv_gpu_engine_new(m, prm, ctx, &go, &g);
        if (st && !strcmp(o.device, "cuda")) {
            rc = kv_report(st, "--device cuda");
            goto out;
        }
        if (st) kv_note(1, "--device auto: using the CPU (%s)", kv_errdetail());
        else kv_note(1, "running on %s", kv_gpu_engine_device(g));
    }
    if (!g && (st = kv_engine_new(m, prm, ctx, &e))) {
        rc = kv_report(st, "cannot build the engine");
        goto out;
    }

    if (o.probs) {
        rc = print_probs(e, c->vocab_size, prompt, n_prompt, o.probs);
        goto report;
    }

    /* scoring mode */
    if (o.score) {
        nll = malloc((size_t)(n_prompt > 1 ? n_prompt - 1 : 1) * sizeof *nll);
        double t0 = now_ms();
        if (!nll) st = kv_fail(KV_E_NOMEM, "out of memory");
        else st = kv_engine_score(e, prompt, n_prompt, nll);
        if (st) {
            rc = kv_report(st, "scoring failed");
            goto out;
        }
        double sum = 0;
        cJSON *j = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(j, "nll");
        for (int i = 0; i < n_prompt - 1; i++) {
            sum += nll[i];
            cJSON_AddItemToArray(arr, cJSON_CreateNumber(nll[i]));
        }
        cJSON_AddNumberToObject(j, "tokens", n_prompt);
        cJSON_AddNumberToObject(j, "scored", n_prompt - 1);
        cJSON_AddNumberToObject(j, "mean_nll", sum / (n_prompt - 1));
        cJSON_AddNumberToObject(j, "perplexity", exp(sum / (n_prompt - 1)));
        cJSON_AddNumberToObject(j, "ms", now_ms() - t0);
        kv_outfile so;
        st = kv_outfile_open(&so, "-");
        if (!st) st = write_json(j, &so);
        cJSON_Delete(j);
        if (st) rc = kv_report(st, "cannot write the scores");
        goto report;
    }

    /* prefill, dump, decode */
    logits = malloc((size_t)c->vocab_size * sizeof *logits);
    step_ms = malloc((size_t)(o.steps ? o.steps : 1) * sizeof *step_ms);
    gen = malloc((size_t)(o.steps ? o.steps : 1) * sizeof *gen);
    if (!logits || !step_ms || !gen || kv_sampler_init(&smp, c->vocab_size, (float)o.temp, (float)o.top_p, o.seed)) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "decode buffers");
        goto out;
    }
    if (o.dump && (st = kv_engine_keep(e, o.nq, true))) {
        rc = kv_report(st, "--dump-kv");
        goto out;
    }
    double t0 = now_ms();
    st = g ? kv_gpu_engine_prefill(g, prompt, n_prompt, logits)
           : kv_engine_prefill(e, prompt, n_prompt, logits);
    if (st) {
        rc = kv_report(st, "prefill failed");
        goto out;
    }
    double prefill_ms = now_ms() - t0;
    kv_note(1, "prefill: %d tokens in %.1f ms", n_prompt, prefill_ms);
    if (o.dump && (st = kv_engine_dump_kvc(e, prompt, n_prompt, dump_dt, o.dump))) {
        rc = kv_report(st, "cannot write %s", o.dump);
        goto out;
    }
    int n_gen = 0, n_steps = 0, prev = prompt[n_prompt - 1];
    int bos = tok ? kv_tokenizer_bos(tok) : 1, eos = tok ? kv_tokenizer_eos(tok) : 2;
    while (n_gen < o.steps) {
        int next = kv_sampler_next(&smp, logits);
        if (next == bos || next == eos || (tok && kv_tokenizer_is_eog(tok, next))) break;
        gen[n_gen++] = next;
        if (text_to_stdout) {
            put_text(o.print_ids ? NULL : tok, prev, next, stdout);
            fflush(stdout);
        }
        prev = next;
        if (n_gen == o.steps) break;
        if (g ? kv_gpu_engine_pos(g) >= kv_gpu_engine_ctx(g) : kv_engine_pos(e) >= kv_engine_ctx(e))
            break;
        double ts = now_ms();
        st = g ? kv_gpu_engine_step(g, next, logits) : kv_engine_step(e, next, logits);
        if (st) {
            rc = kv_report(st, "decode failed");
            goto out;
        }
        step_ms[n_steps++] = now_ms() - ts;
        kv_progress("%d/%d tokens", n_gen, o.steps);
    }
    kv_progress_done();
    if (text_to_stdout && n_gen) putchar('\n');
    if (o.report) {
        rep = report_json(m, e, g, prm, &o, n_prompt, n_gen, prefill_ms, step_ms, n_steps);
        rep_open = false;
        if ((st = write_json(rep, &rep_out))) rc = kv_report(st, "cannot write %s", o.report);
    }
report:
    /* A bare KV_E_IO would print whatever detail an earlier, handled failure
       left behind (a tokenizer probe); say what failed.  Once a write has
       been reported, do not report stdout a second time. */
    if ((fflush(stdout) || ferror(stdout)) && !rc)
        rc = kv_report(kv_fail(KV_E_IO, "write error on stdout: %s", strerror(errno)), "cannot write to stdout");
out:
    if (rep_open) kv_outfile_abort(&rep_out);
    cJSON_Delete(rep);
    kv_sampler_clear(&smp);
    free(gen);
    free(step_ms);
    free(logits);
    free(nll);
    kv_gpu_engine_free(g);
    kv_engine_free(e);
    free(prm);
    free(prompt);
    free(text);
    kv_tokenizer_free(tok);
    kv_model_free(m);
    return rc;
}
