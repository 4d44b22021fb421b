/*
 * kv-bench decode's options: the table behind --help and the parse into
 * decode_args (decode.h).
 */
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "decode.h"
#include "gpu/kv_gpu_engine.h"

enum { O_CTX = 'c', O_TOKENS = 'n', O_SYNTH = 256, O_WTYPE, O_WARMUP, O_OFFTOK, O_NOFETCH,
       O_POLICIES, O_QBITS, O_QLAYERS, O_TOPK, O_CHANNELS, O_SINK, O_WINDOW, O_SEED, O_DEVICE,
       O_PDL, O_SELSKIP, O_CONTEXT, O_PFCOPY, O_VARIANTS, O_GRAPH, O_JSON, O_BATCH, O_BCAP, O_GEMM };

static const kv_option opts[] = {
    {O_SYNTH, 0, "synthetic", "NAME", "synthetic weights: llama-3.1-8b (default), llama-2-7b, tiny"},
    {O_WTYPE, 0, "wtype", "T", "weight type: bf16 (default) or f16"},
    {O_CTX, 'c', "contexts", "LIST", "context lengths (default 32768,131072)"},
    {O_TOKENS, 'n', "steps", "N", "decoded tokens timed per policy (default 64)"},
    {O_TOKENS, 0, "tokens", "N", NULL}, /* deprecated: --tokens is a token-id file elsewhere */
    {O_WARMUP, 0, "warmup", "N", "untimed tokens first (default 4)"},
    {O_OFFTOK, 0, "offload-tokens", "N", "timed tokens for offload, which is slow (default 16)"},
    {O_NOFETCH, 0, "nofetch-tokens", "N", "tokens timed with sparse selection and gather off, and per "
                                          "variant with the gather alone off (default 16)"},
    {O_POLICIES, 0, "policies", "LIST", "of full,quant,hybrid,hybrid-sketch,offload,hybrid-resident,hybrid-pages (default all)"},
    {O_QBITS, 0, "quant-bits", "B", "bits of quantized layers, 1 or 2 (default 2)"},
    {O_QLAYERS, 0, "quant-layers", "N", "hybrid: the first N layers quantized (default 2)"},
    {O_TOPK, 0, "topk", "K", "hybrid: tokens fetched per step and KV head (default 1024)"},
    {O_CHANNELS, 0, "channels", "C", "hybrid: critical channels (default 8)"},
    {O_SINK, 0, "sink", "S", "hybrid: sink tokens (default 8)"},
    {O_WINDOW, 0, "window", "W", "hybrid: recent tokens (default 56)"},
    {O_SEED, 's', "seed", "N", "seed of weights and context (default 1)"},
    {O_DEVICE, 0, "device", "DEV", "CUDA device: cuda, cuda:N or N (default 0)"},
    {O_PDL, 0, "pdl", "LEVEL", "programmatic dependent launch: 0, 1 or 2 (default 2 on Hopper)"},
    {O_SELSKIP, 0, "sel-skip", "MASK", "measurement only: leave out selection steps (1 scores, "
                                      "2 softmax, 4 top-K, 8 gather, 16 query GEMV)"},
    {O_CONTEXT, 0, "context", "HOW", "synth (default: synthesized on the device), prefill (a random "
                                     "prompt prefilled for real) or both"},
    {O_PFCOPY, 0, "prefill-copy", "HOW", "sparse layers' prompt to host memory during a real prefill: "
                                         "overlap (default: each chunk on the copy stream) or sync "
                                         "(measurement: each layer at its end, on the main stream)"},
    {O_VARIANTS, 0, "variants", "LIST", "hybrids: ways to run the sparse step, each after the same "
                                        "context: base (default: overlapped, many-block chain, no "
                                        "cache) or words of serial, wide, cache, classic (the "
                                        "former kernels), ahead2 (two layers ahead), chainN, gatherN "
                                        "(blocks per KV head), late, early, nopdl (how the chain's "
                                        "kernels follow each other), collect, direct, hist (its top-K tail), "
                                        "everyN (ids reused N-1 steps) "
                                        "joined by '+', e.g. base,classic,late+collect,serial"},
    {O_BATCH, 0, "batch", "LIST", "batched decode: sequences per step, sizes or max (the most that fit "
                                  "in GPU and host memory), e.g. 1,8,max; its own report"},
    {O_BCAP, 0, "batch-cap", "N", "--batch max takes at most N sequences (default 512)"},
    {O_GEMM, 0, "gemm", "HOW", "batched products: auto (default: gemv for 1 sequence, then cublas), "
                               "gemv or cublas"},
    {O_GRAPH, 0, "graph", "HOW", "decode steps as CUDA graphs: on (default), off (kernel by kernel) "
                                 "or both (each placement timed both ways from the same context)"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench decode", "[OPTIONS]",
    "Decode ms/token per KV placement on the GPU, with transfer ceilings.", opts,
    "Batch 1 unless --batch; by default the context is synthesized on the device and in pinned host memory\n"
    "from a seeded generator (--context prefill: prefilled for real); ms/token is the median\n"
    "of per-step GPU times.\n"
    "Exit 69 means no usable GPU or a build without CUDA."};
void kv_bench_decode_args(int argc, char **argv, decode_args *A)
{
    kv_cli_init(&spec, argc, argv);
    const char *synth = "llama-3.1-8b";
    kv_dtype wt = KV_DT_BF16;
    int ctx[MAXC] = {32768, 131072}, nctx = 2, tokens = 64, warmup = 4, offtok = 16, nofetch = 16;
    kv_decode_layers bc = {2, 2, 1024, 8, 8, 56};
    int device = 0, pdl = KV_GPU_PDL_AUTO;
    unsigned sel_skip = 0;
    int cmode = CTX_SYNTH, gmode = GRAPH_ON;
    bool pf_sync = false;
    unsigned long long seed = 1;
    bool want[KV_DEC_COUNT], json = false;
    kv_decode_variant var[MAXV];
    int nvar = 1, batch[MAXB] = {0}, nbatch = 0, bcap = 512;
    kv_gpu_gemm gemm = KV_GPU_GEMM_AUTO;
    kv_decode_variant_parse("base", &var[0]);
    for (int p = 0; p < KV_DEC_COUNT; p++) want[p] = true;
    const char *a;
    int oi;
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        switch (c) {
        case O_SYNTH: synth = a; break;
        case O_WTYPE:
            if (!strcmp(a, "bf16")) wt = KV_DT_BF16;
            else if (!strcmp(a, "f16")) wt = KV_DT_F16;
            else kv_cli_usage_error("--wtype must be bf16 or f16");
            break;
        case O_CTX: {
            nctx = 0;
            char *dup = strdup(a), *save = NULL;
            if (!dup) kv_die(KV_EXIT_SOFTWARE, "out of memory");
            for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (nctx == MAXC) kv_cli_usage_error("at most %d contexts", MAXC);
                ctx[nctx++] = (int)kv_cli_long("--contexts", t, 16, 1 << 22);
            }
            free(dup);
            if (!nctx) kv_cli_usage_error("--contexts needs at least one length");
            break;
        }
        case O_TOKENS: tokens = (int)kv_cli_long("--steps", a, 1, 4096); break;
        case O_WARMUP: warmup = (int)kv_cli_long("--warmup", a, 0, 1024); break;
        case O_OFFTOK: offtok = (int)kv_cli_long("--offload-tokens", a, 1, 4096); break;
        case O_NOFETCH: nofetch = (int)kv_cli_long("--nofetch-tokens", a, 0, 4096); break;
        case O_POLICIES: {
            memset(want, 0, sizeof want);
            char *dup = strdup(a), *save = NULL;
            if (!dup) kv_die(KV_EXIT_SOFTWARE, "out of memory");
            for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                int p = 0;
                while (p < KV_DEC_COUNT && strcmp(kv_decode_placement_name((kv_decode_placement)p), t)) p++;
                if (p == KV_DEC_COUNT) kv_cli_usage_error("unknown policy '%s'", t);
                want[p] = true;
            }
            free(dup);
            break;
        }
        case O_QBITS: bc.qbits = (int)kv_cli_long("--quant-bits", a, 1, 2); break;
        case O_QLAYERS: bc.qlayers = (int)kv_cli_long("--quant-layers", a, 0, 1024); break;
        case O_TOPK: bc.topk = (int)kv_cli_long("--topk", a, 1, 1 << 22); break;
        case O_CHANNELS: bc.channels = (int)kv_cli_long("--channels", a, 1, 256); break;
        case O_SINK: bc.sink = (int)kv_cli_long("--sink", a, 0, 1 << 20); break;
        case O_WINDOW: bc.window = (int)kv_cli_long("--window", a, 0, 1 << 20); break;
        case O_SEED: seed = (unsigned long long)kv_cli_long("--seed", a, 0, 1L << 62); break;
        case O_DEVICE:
            if (kv_cli_device(a, &device) == KV_DEVICE_CPU) kv_cli_usage_error("kv-bench decode runs on the GPU: --device cuda[:N]");
            break;
        case O_PDL: pdl = (int)kv_cli_long("--pdl", a, 0, 2); break;
        case O_SELSKIP: sel_skip = (unsigned)kv_cli_long("--sel-skip", a, 0, 31); break;
        case O_CONTEXT:
            if (!strcmp(a, "synth")) cmode = CTX_SYNTH;
            else if (!strcmp(a, "prefill")) cmode = CTX_PREFILL;
            else if (!strcmp(a, "both")) cmode = CTX_BOTH;
            else kv_cli_usage_error("--context must be synth, prefill or both");
            break;
        case O_PFCOPY:
            if (!strcmp(a, "overlap")) pf_sync = false;
            else if (!strcmp(a, "sync")) pf_sync = true;
            else kv_cli_usage_error("--prefill-copy must be overlap or sync");
            break;
        case O_VARIANTS: {
            nvar = 0;
            char *dup = strdup(a), *save = NULL;
            if (!dup) kv_die(KV_EXIT_SOFTWARE, "out of memory");
            for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (nvar == MAXV) kv_cli_usage_error("at most %d variants", MAXV);
                if (kv_decode_variant_parse(t, &var[nvar]) != KV_OK)
                    kv_cli_usage_error("--variants: %s", kv_errdetail());
                for (int i = 0; i < nvar; i++)
                    if (!strcmp(var[i].name, t)) kv_cli_usage_error("--variants: '%s' twice", t);
                nvar++;
            }
            free(dup);
            if (!nvar) kv_cli_usage_error("--variants needs at least one variant");
            break;
        }
        case O_BATCH: {
            nbatch = 0;
            char *dup = strdup(a), *save = NULL;
            if (!dup) kv_die(KV_EXIT_SOFTWARE, "out of memory");
            for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (nbatch == MAXB) kv_cli_usage_error("--batch: at most %d sizes", MAXB);
                batch[nbatch++] = !strcmp(t, "max") ? 0 : (int)kv_cli_long("--batch", t, 1, 65536);
            }
            free(dup);
            if (!nbatch) kv_cli_usage_error("--batch needs a size or max");
            break;
        }
        case O_BCAP: bcap = (int)kv_cli_long("--batch-cap", a, 1, 65536); break;
        case O_GEMM:
            if (kv_gpu_gemm_parse(a, &gemm) != KV_OK) kv_cli_usage_error("--gemm: %s", kv_errdetail());
            break;
        case O_GRAPH:
            if (!strcmp(a, "on")) gmode = GRAPH_ON;
            else if (!strcmp(a, "off")) gmode = GRAPH_OFF;
            else if (!strcmp(a, "both")) gmode = GRAPH_BOTH;
            else kv_cli_usage_error("--graph must be on, off or both");
            break;
        case O_JSON: json = true; break;
        }
    }
    if (oi < argc) kv_cli_usage_error("unexpected argument '%s'", argv[oi]);
    if (nbatch && (gmode != GRAPH_ON || cmode != CTX_SYNTH || pf_sync))
        kv_cli_usage_error("--batch steps synthesized contexts kernel by kernel: drop --graph, --context and --prefill-copy");
    *A = (decode_args){.synth = synth, .wt = wt, .nctx = nctx, .tokens = tokens, .warmup = warmup,
                       .offtok = offtok, .nofetch = nofetch, .bc = bc, .device = device, .pdl = pdl,
                       .sel_skip = sel_skip, .cmode = cmode, .gmode = gmode, .pf_sync = pf_sync, .seed = seed,
                       .json = json, .nvar = nvar, .nbatch = nbatch, .batch_cap = bcap, .gemm = gemm};
    memcpy(A->batch, batch, sizeof batch);
    memcpy(A->ctx, ctx, sizeof ctx);
    memcpy(A->want, want, sizeof want);
    memcpy(A->var, var, sizeof var);
}
