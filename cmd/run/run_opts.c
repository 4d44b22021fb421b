/*
 * kv-run's options: the table behind --help, and the parse into run_opts
 * with every check of options that do not go together.
 */
#include <string.h>

#include "kv_cli.h"
#include "common/kv_gemv.h"
#include "run.h"

enum {
    /* an option with a short name must use it as its id (getopt returns it) */
    O_MODEL = 'm', O_STEPS = 'n', O_PROMPT = 'p', O_TEMP = 't', O_SEED = 's', O_CTX = 'c',
    O_THREADS = 'T', O_TOKENIZER = 256, O_PROMPT_FILE, O_TOKENS, O_TOPP, O_POLICY, O_PROFILE,
    O_KVDTYPE, O_REPORT, O_DUMP, O_NQ, O_SCORE, O_SYNTH, O_WEIGHTS, O_RANDOM_PROMPT, O_DEVICE,
    O_SELECT, O_COMPARE, O_PREFIX, O_ZSTD, O_PREFILL_CHUNK, O_TOKENIZE, O_SPECIAL, O_CHAT, O_PROBS,
    O_PRINT_IDS, O_GEMV, O_KV, O_STORE,
    O_IMPORTANT, O_NO_INSERT, O_BATCH, O_GEMM, O_QUERY_AWARE, O_GRAPH
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
    {O_GRAPH, 0, "graph", "WHEN", "GPU decode steps as CUDA graphs: on, off or auto (default: these "
                                 "host-sampled steps kernel by kernel, measured faster)"},
    {O_GEMV, 0, "gemv-variant", "NAME", "GPU decode GEMV of packed weights, for measurement:" KV_GEMV_NAMES_HELP},
    {O_KV, 0, "kv", "FILE", "start from this .kvc cache; the prompt is its continuation"},
    {O_STORE, 0, "store", "DIR", "reuse the prompt's longest cached prefix from a kv-tree store, then insert the prompt"},
    {O_IMPORTANT, 0, "important", "F", "with --store: disk-tier prefix nodes give only their top F of tokens"},
    {O_NO_INSERT, 0, "no-insert", NULL, "with --store: do not insert the prompt's cache afterwards"},
    {O_BATCH, 0, "batch", "B", "decode B prompts greedily (--prompt-file: one per line; --random-prompt: seeds "
                               "seed..seed+B-1; --prompt: B copies), together on the GPU; JSON lines out"},
    {O_GEMM, 0, "gemm", "HOW", "with --batch on the GPU: gemv (default: each sequence as alone, bit for bit), "
                               "cublas (faster) or auto"},
    {O_QUERY_AWARE, 0, "query-aware", NULL, "with --important: the prompt's own queries choose the tokens (a +sketch store)"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-run", "[OPTIONS] (--model FILE | --synthetic NAME)",
    "Run a Llama-family model on the CPU or GPU with a KV cache policy per layer.", opts,
    "Policies: full, quant, sparse, streaming, dsq (see kv-run(1))."};
void run_parse_opts(int argc, char **argv, run_opts *o)
{
    kv_cli_init(&spec, argc, argv);
    *o = (run_opts){.steps = 128, .nq = 32, .top_p = 0.9, .seed = 42, .dev = KV_DEVICE_CPU, .important = 1,
                    .gemm = KV_GPU_GEMM_GEMV};
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
        case O_GEMV:
            kv_errclear();
            if (kv_gemv_variant_parse(arg, false, &o->gemv)) kv_cli_usage_error("--gemv-variant: %s", kv_errdetail());
            break;
        case O_GRAPH:
            if (!strcmp(arg, "on")) o->graph = KV_GPU_GRAPH_ON;
            else if (!strcmp(arg, "off")) o->graph = KV_GPU_GRAPH_OFF;
            else if (!strcmp(arg, "auto")) o->graph = KV_GPU_GRAPH_AUTO;
            else kv_cli_usage_error("--graph must be on, off or auto");
            break;
        case O_KV: o->kv = arg; break;
        case O_STORE: o->store = arg; break;
        case O_IMPORTANT:
            o->important = kv_cli_double("--important", arg, 0, 1);
            if (!(o->important > 0)) kv_cli_usage_error("--important must be in (0, 1]");
            break;
        case O_NO_INSERT: o->no_insert = true; break;
        case O_BATCH: o->batch = (int)kv_cli_long("--batch", arg, 1, 65536); break;
        case O_GEMM:
            if (kv_gpu_gemm_parse(arg, &o->gemm)) kv_cli_usage_error("--gemm: %s", kv_errdetail());
            o->gemm_given = true;
            break;
        case O_QUERY_AWARE: o->query_aware = true; break;
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
    if (o->kv && o->store) kv_cli_usage_error("--kv and --store are exclusive");
    if ((o->kv || o->store) && (o->score || o->compare || o->probs || o->tokenize))
        kv_cli_usage_error("%s goes with generation, not --score-file, --compare, --probs or --tokenize", o->kv ? "--kv" : "--store");
    if (!o->store && (o->important < 1 || o->no_insert))
        kv_cli_usage_error("%s goes with --store", o->no_insert ? "--no-insert" : "--important");
    if (o->query_aware && !(o->important < 1)) kv_cli_usage_error("--query-aware goes with --store and --important F < 1");
    if (o->kv && !o->prompt && !o->prompt_file && !o->tokens && !o->random_prompt)
        kv_cli_usage_error("--kv needs the continuation: --prompt, --prompt-file or --tokens");
    if (o->prompt_file && o->tokens && is_stdout(o->prompt_file) && is_stdout(o->tokens))
        kv_cli_usage_error("stdin can only be read once");
    if ((o->chat.kind || o->special) && (o->tokens || o->random_prompt))
        kv_cli_usage_error("--chat and --special apply to text: not with --tokens or --random-prompt");
    if (o->batch && (o->score || o->compare || o->probs || o->tokenize || o->dump || o->kv || o->store || o->tokens))
        kv_cli_usage_error("--batch decodes prompts: not with --score-file, --compare, --probs, --tokenize, "
                           "--dump-kv, --kv, --store or --tokens");
    if (o->batch && o->temp > 0) kv_cli_usage_error("--batch decodes greedily: drop --temp");
    if (o->batch && is_stdout(o->report)) kv_cli_usage_error("--batch writes its sequences to stdout: --report needs a file");
    if (o->batch && !o->prompt && !o->prompt_file && !o->random_prompt)
        kv_cli_usage_error("--batch needs prompts: --prompt-file (one per line), --random-prompt or --prompt");
    if (o->gemm_given && !o->batch) kv_cli_usage_error("--gemm goes with --batch");
    if (o->batch && o->graph) kv_cli_usage_error("--batch steps run kernel by kernel: drop --graph");
    const bool other = o->score || o->compare || o->dump || o->report;
    if (o->tokenize && (other || o->tokens || o->random_prompt || o->synth))
        kv_cli_usage_error("--tokenize takes a model or vocabulary and a text (--prompt or --prompt-file) only");
    if (o->probs && (other || o->tokenize || o->dev != KV_DEVICE_CPU))
        kv_cli_usage_error("--probs runs the prompt on the CPU and prints JSON: no --score-file, --compare, "
                           "--dump-kv, --report, --tokenize or --device");
}
