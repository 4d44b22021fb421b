/*
 * kv-bench prefill: dense causal prefill speed on the GPU — a prompt of each
 * context length through every layer of a synthetic geometry (bf16 weights,
 * chunked: cuBLAS projections and FFN, the flash-attention chunk kernel of
 * kernels/prefill_attn.cu), tokens/s with the attention kernels' share and
 * their TFLOP/s, the attention kernel alone over the whole prompt in one
 * launch (each tile variant with --variants), and the bf16 GEMM rate of the
 * same run as the ceiling.  A table on a terminal, JSON when piped or with
 * --json.  The measuring is in lib/eval/kv_prefill_bench.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_cli.h"
#include "eval/kv_prefill_bench.h"
#include "gpu/kv_cublas.h"
#include "gpu/kv_gpu.h"
#include "model/kv_model.h"

int kv_bench_prefill_main(int argc, char **argv);

enum { O_CTX = 'c', O_JSON = 'j', O_SEED = 's', O_SYNTH = 256, O_WTYPE, O_CHUNK, O_LAYERS, O_REPS,
       O_VARIANT, O_VARIANTS, O_GEMM, O_NOALONE, O_DEVICE };

static const kv_option opts[] = {
    {O_SYNTH, 0, "synthetic", "NAME", "geometry: llama-3.1-8b (default), llama-2-7b, tiny"},
    {O_WTYPE, 0, "wtype", "T", "weight type: bf16 (default) or f16"},
    {O_CTX, 'c', "contexts", "LIST", "prompt lengths (default 8192,32768,131072)"},
    {O_CHUNK, 0, "chunk", "N", "prompt rows per chunk (default 4096)"},
    {O_LAYERS, 0, "layers", "N", "layers run (default: the model's)"},
    {O_REPS, 0, "reps", "N", "timed repetitions per context, median reported (default 3)"},
    {O_VARIANT, 0, "variant", "N", "attention tile variant (default 0)"},
    {O_VARIANTS, 0, "variants", NULL, "also time every attention tile variant alone"},
    {O_GEMM, 0, "gemm", "N", "GEMM ceiling size N x N x N (default 8192; 0 skips)"},
    {O_NOALONE, 0, "no-alone", NULL, "skip timing the attention kernel alone"},
    {O_SEED, 's', "seed", "N", "seed of the weights and prompt (default 1)"},
    {O_DEVICE, 0, "device", "DEV", "CUDA device: cuda, cuda:N or N (default 0)"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench prefill", "[OPTIONS]",
    "Dense causal prefill tokens/s on the GPU, attention TFLOP/s, and the GEMM ceiling.", opts,
    "Batch 1, random weights and prompt (seeded).  Attention FLOPs are counted as\n"
    "4*T^2*H*D/2 per layer (causal).  Exit 69 means no usable GPU, no cuBLAS, or a\n"
    "build without CUDA."};

#define MAXC 8

typedef struct {
    kv_prefill_bench_result r;
    double alone_ms, alone_tflops;
    double var_ms[32], var_tflops[32];
    char err[256];
    int ok;
} crow;

int kv_bench_prefill_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *synth = "llama-3.1-8b";
    int ctx[MAXC] = {8192, 32768, 131072}, nctx = 3, gemm_n = 8192;
    bool json = false, variants = false, alone = true;
    kv_prefill_bench_opts po;
    kv_prefill_bench_opts_default(&po);
    const char *a;
    int oi;
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        switch (c) {
        case O_SYNTH: synth = a; break;
        case O_WTYPE:
            if (!strcmp(a, "bf16")) po.wbf16 = 1;
            else if (!strcmp(a, "f16")) po.wbf16 = 0;
            else kv_cli_usage_error("--wtype must be bf16 or f16");
            break;
        case O_CTX: {
            nctx = 0;
            char *dup = strdup(a), *save = NULL;
            for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (nctx == MAXC) kv_cli_usage_error("at most %d contexts", MAXC);
                ctx[nctx++] = (int)kv_cli_long("--contexts", t, 1, 1 << 20);
            }
            free(dup);
            if (!nctx) kv_cli_usage_error("--contexts needs at least one length");
            break;
        }
        case O_CHUNK: po.chunk = (int)kv_cli_long("--chunk", a, 16, 1 << 20); break;
        case O_LAYERS: po.layers = (int)kv_cli_long("--layers", a, 1, 1024); break;
        case O_REPS: po.reps = (int)kv_cli_long("--reps", a, 1, 64); break;
        case O_VARIANT: po.variant = (int)kv_cli_long("--variant", a, 0, 31); break;
        case O_VARIANTS: variants = true; break;
        case O_GEMM: gemm_n = (int)kv_cli_long("--gemm", a, 0, 32768); break;
        case O_NOALONE: alone = false; break;
        case O_SEED: po.seed = (uint64_t)kv_cli_long("--seed", a, 0, 1L << 62); break;
        case O_DEVICE:
            if (kv_cli_device(a, &po.device) == KV_DEVICE_CPU)
                kv_cli_usage_error("kv-bench prefill runs on the GPU: --device cuda[:N]");
            break;
        case O_JSON: json = true; break;
        }
    }
    if (oi < argc) kv_cli_usage_error("unexpected argument '%s'", argv[oi]);

    if (po.variant >= kv_prefill_attn_variants() && kv_gpu_built())
        kv_cli_usage_error("--variant must be below %d", kv_prefill_attn_variants());
    char devname[300] = "";
    if (kv_gpu_probe(devname, sizeof devname) <= po.device)
        return kv_report(kv_fail(KV_E_UNAVAILABLE, "no usable GPU (%s)", devname), "prefill");
    kv_model *m = NULL;
    kv_progress("building synthetic %s", synth);
    kv_status st = kv_model_synthetic(synth, po.seed, KV_DT_BF16, &m);
    if (st) return kv_report(st, "synthetic %s", synth);
    kv_model_config cfg = m->cfg;
    kv_model_close(m); /* the geometry is all the benchmark takes */
    double gemm_tflops = 0;
    if (gemm_n > 0) {
        kv_progress("GEMM ceiling %d^3", gemm_n);
        if ((st = kv_prefill_bench_gemm(gemm_n, 10, po.device, &gemm_tflops)))
            return kv_report(st, "GEMM ceiling");
    }
    crow *rows = calloc((size_t)nctx, sizeof *rows);
    if (!rows) return kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "prefill rows");
    int rc = KV_EXIT_OK;
    for (int ci = 0; ci < nctx; ci++) {
        crow *w = &rows[ci];
        po.T = ctx[ci];
        kv_progress("prefill of %d tokens", ctx[ci]);
        st = kv_prefill_bench_run(&cfg, &po, &w->r);
        if (!st && alone)
            st = kv_prefill_bench_attn(&cfg, ctx[ci], po.variant, po.kvbf16, 5, po.device,
                                       &w->alone_ms, &w->alone_tflops);
        for (int v = 0; variants && !st && v < kv_prefill_attn_variants() && v < 32; v++)
            st = kv_prefill_bench_attn(&cfg, ctx[ci], v, po.kvbf16, 3, po.device, &w->var_ms[v],
                                       &w->var_tflops[v]);
        w->ok = !st;
        if (st) {
            snprintf(w->err, sizeof w->err, "%s: %s", kv_strerror(st), kv_errdetail());
            kv_progress_done();
            kv_warn("context %d: %s", ctx[ci], w->err);
            if (st == KV_E_UNAVAILABLE) rc = kv_status_exit(st);
        }
    }
    kv_progress_done();
    if (rc != KV_EXIT_OK) {
        free(rows);
        return rc;
    }
    char date[64];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    const int L = po.layers > 0 ? po.layers : cfg.n_layers;
    if (kv_want_json(stdout, json)) {
        printf("{\n  \"bench\": \"prefill\",\n  \"date\": \"%s\",\n  \"device\": \"%s\",\n", date, devname);
        printf("  \"model\": \"%s\",\n  \"layers\": %d,\n  \"weights\": \"%s\",\n  \"cache\": \"%s\",\n",
               cfg.name, L, po.wbf16 ? "bf16" : "f16", po.kvbf16 ? "bf16" : "f16");
        printf("  \"chunk\": %d,\n  \"attn_variant\": \"%s\",\n  \"cublas\": \"%s\",\n", po.chunk,
               kv_prefill_attn_variant_name(po.variant), kv_cublas_where());
        printf("  \"gemm_n\": %d,\n  \"gemm_tflops\": %.1f,\n  \"contexts\": [\n", gemm_n, gemm_tflops);
        for (int ci = 0; ci < nctx; ci++) {
            const crow *w = &rows[ci];
            printf("    {\"T\": %d", ctx[ci]);
            if (!w->ok) {
                printf(", \"error\": \"%s\"}%s\n", w->err, ci + 1 < nctx ? "," : "");
                continue;
            }
            const kv_prefill_bench_result *r = &w->r;
            printf(", \"prefill_ms\": %.2f, \"prefill_ms_min\": %.2f, \"tokens_per_s\": %.1f, "
                   "\"attn_ms\": %.2f, \"attn_tflops\": %.1f, \"other_ms\": %.2f, "
                   "\"gemm_part_tflops\": %.1f, \"gpu_bytes\": %llu, \"workspace_bytes\": %llu",
                   r->ms, r->ms_min, r->tokens_per_s, r->attn_ms, r->attn_tflops, r->other_ms,
                   r->gemm_tflops, (unsigned long long)r->gpu_bytes, (unsigned long long)r->ws_bytes);
            if (alone)
                printf(", \"attn_alone_ms\": %.3f, \"attn_alone_tflops\": %.1f, "
                       "\"attn_alone_over_gemm\": %.3f", w->alone_ms, w->alone_tflops,
                       gemm_tflops > 0 ? w->alone_tflops / gemm_tflops : 0);
            if (variants) {
                printf(", \"variants\": {");
                for (int v = 0; v < 32 && w->var_ms[v] > 0; v++)
                    printf("%s\"%s\": {\"ms\": %.3f, \"tflops\": %.1f}", v ? ", " : "",
                           kv_prefill_attn_variant_name(v), w->var_ms[v], w->var_tflops[v]);
                printf("}");
            }
            printf("}%s\n", ci + 1 < nctx ? "," : "");
        }
        printf("  ]\n}\n");
    } else {
        printf("%s, %s\n%s, %d layers, %s weights, %s cache, chunks of %d; GEMM ceiling %.0f TFLOP/s\n",
               devname, date, cfg.name, L, po.wbf16 ? "bf16" : "f16", po.kvbf16 ? "bf16" : "f16",
               po.chunk, gemm_tflops);
        printf("%8s %11s %10s %9s %11s %11s %11s\n", "tokens", "prefill ms", "tokens/s", "attn ms",
               "attn TF/s", "alone TF/s", "other TF/s");
        for (int ci = 0; ci < nctx; ci++) {
            const crow *w = &rows[ci];
            if (!w->ok) {
                printf("%8d failed: %s\n", ctx[ci], w->err);
                continue;
            }
            printf("%8d %11.1f %10.0f %9.1f %11.1f %11.1f %11.1f\n", ctx[ci], w->r.ms,
                   w->r.tokens_per_s, w->r.attn_ms, w->r.attn_tflops, w->alone_tflops,
                   w->r.gemm_tflops);
        }
    }
    free(rows);
    return KV_EXIT_OK;
}
