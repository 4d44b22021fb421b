/*
 * kv-bench decode: end-to-end decode speed of the GPU engine per KV
 * placement — full (fp16 on the GPU), quant (every layer KIVI-packed on the
 * GPU), hybrid (TailorKV: the first layers quantized, the rest sparse with
 * the prompt's K/V in pinned host memory, channel selection), hybrid-sketch
 * (the same with the resident 1-bit key sketch), offload (all K/V in host
 * memory, every layer copied in per step) — on synthetic weights at long
 * contexts, with the machine's transfer ceilings measured in the same run.
 * The context is synthesized on the device (seeded) by default; with
 * --context prefill (or both) a seeded random prompt is prefilled for real
 * (the chunked GPU prefill) and the decode runs from that cache.  A table
 * on a terminal, JSON when piped or with --json.  The measuring is in
 * lib/eval/kv_gpu_bench.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_cli.h"
#include "eval/kv_gpu_bench.h"
#include "gpu/kv_gpu_engine.h"
#include "model/kv_model.h"
#include "policy/kv_policy.h"

int kv_bench_decode_main(int argc, char **argv);

enum { O_CTX = 'c', O_TOKENS = 'n', O_SYNTH = 256, O_WTYPE, O_WARMUP, O_OFFTOK, O_NOFETCH,
       O_POLICIES, O_QBITS, O_QLAYERS, O_TOPK, O_CHANNELS, O_SINK, O_WINDOW, O_SEED, O_DEVICE,
       O_PDL, O_SELSKIP, O_CONTEXT, O_PFCOPY, O_VARIANTS, O_JSON };

static const kv_option opts[] = {
    {O_SYNTH, 0, "synthetic", "NAME", "synthetic weights: llama-3.1-8b (default), llama-2-7b, tiny"},
    {O_WTYPE, 0, "wtype", "T", "weight type: bf16 (default) or f16"},
    {O_CTX, 'c', "contexts", "LIST", "context lengths (default 32768,131072)"},
    {O_TOKENS, 'n', "steps", "N", "decoded tokens timed per policy (default 64)"},
    {O_TOKENS, 0, "tokens", "N", NULL}, /* deprecated: --tokens is a token-id file elsewhere */
    {O_WARMUP, 0, "warmup", "N", "untimed tokens first (default 4)"},
    {O_OFFTOK, 0, "offload-tokens", "N", "timed tokens for offload, which is slow (default 16)"},
    {O_NOFETCH, 0, "nofetch-tokens", "N", "tokens timed with sparse fetching off (default 16)"},
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
                                        "context: base (default: overlapped, one-block top-K, no "
                                        "cache) or words of serial, wide, cache joined by '+', "
                                        "e.g. base,wide,wide+cache,serial"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench decode", "[OPTIONS]",
    "Decode ms/token per KV placement on the GPU, with transfer ceilings.", opts,
    "Batch 1; by default the context is synthesized on the device and in pinned host memory\n"
    "from a seeded generator (--context prefill: prefilled for real); ms/token is the median\n"
    "of per-step GPU times.\n"
    "Exit 69 means no usable GPU or a build without CUDA."};

#define MAXC 8
#define MAXV 8

typedef struct {
    bool ran, ran_pf;
    kv_gpu_decode_result r;  /* after the synthesized context (or the prefill, --context prefill) */
    kv_gpu_decode_result rv[MAXV]; /* hybrids: every --variants entry (rv[0] is r) */
    kv_gpu_decode_result rp; /* after a real prefill (--context both) */
    char err[256];
} prun;

enum { CTX_SYNTH = 1, CTX_PREFILL = 2, CTX_BOTH = 3 };

int kv_bench_decode_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *synth = "llama-3.1-8b";
    kv_dtype wt = KV_DT_BF16;
    int ctx[MAXC] = {32768, 131072}, nctx = 2, tokens = 64, warmup = 4, offtok = 16, nofetch = 16;
    kv_decode_layers bc = {2, 2, 1024, 8, 8, 56};
    int device = 0, pdl = KV_GPU_PDL_AUTO;
    unsigned sel_skip = 0;
    int cmode = CTX_SYNTH;
    bool pf_sync = false;
    unsigned long long seed = 1;
    bool want[KV_DEC_COUNT], json = false;
    kv_decode_variant var[MAXV];
    int nvar = 1;
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
        case O_JSON: json = true; break;
        }
    }
    if (oi < argc) kv_cli_usage_error("unexpected argument '%s'", argv[oi]);

    kv_gpu_bw bw;
    kv_status st = kv_gpu_bw_measure(device, &bw);
    if (st) return kv_report(st, "bandwidth");
    kv_gpu_select_us sel_us;
    if ((st = kv_gpu_bench_select(device, ctx[nctx - 1], bc.topk, &sel_us)))
        return kv_report(st, "selection kernels");
    kv_model *m = NULL;
    kv_progress("building synthetic %s", synth);
    if ((st = kv_model_synthetic(synth, seed, wt, &m))) return kv_report(st, "synthetic %s", synth);
    const int L = m->cfg.n_layers;
    kv_policy_params *pp = calloc((size_t)L, sizeof *pp);
    prun (*runs)[KV_DEC_COUNT] = calloc((size_t)nctx, sizeof *runs);
    char devname[400] = "";
    uint64_t wread = 0, wstore = 0;
    if (!pp || !runs) {
        kv_model_close(m);
        return kv_report(KV_E_NOMEM, "out of memory");
    }
    int rc = KV_EXIT_OK;
    for (int ci = 0; ci < nctx && rc == KV_EXIT_OK; ci++) {
        int T = ctx[ci];
        int extra = warmup + (tokens > offtok ? tokens : offtok) + nofetch + 16;
        kv_gpu_engine_opts o;
        kv_gpu_engine_opts_default(&o);
        o.device = device;
        o.pdl = pdl;
        kv_gpu_engine *e = NULL;
        kv_progress("context %d: loading weights", T);
        if ((st = kv_gpu_engine_new(m, NULL, T + extra, &o, &e))) {
            rc = kv_report(st, "GPU engine");
            break;
        }
        snprintf(devname, sizeof devname, "%s", kv_gpu_engine_device(e));
        wread = kv_gpu_engine_weight_read_bytes(e);
        wstore = kv_gpu_engine_weight_bytes(e);
        for (int p = 0; p < KV_DEC_COUNT; p++) {
            if (!want[p]) continue;
            kv_progress("context %d: %s", T, kv_decode_placement_name(p));
            prun *r = &runs[ci][p];
            kv_gpu_engine_opts_default(&o);
            o.device = device;
            st = kv_decode_layers_fill((kv_decode_placement)p, &bc, L, pp);
            o.profile = kv_decode_is_hybrid(p) || p == KV_DEC_OFFLOAD;
            o.pdl = pdl;
            o.sel_skip = sel_skip;
            o.prefill_copy_sync = pf_sync;
            const int ntok = p == KV_DEC_OFFLOAD ? offtok : tokens;
            const int nnf = kv_decode_is_hybrid(p) ? nofetch : 0;
            if (!st && kv_decode_is_hybrid(p)) {
                st = kv_gpu_bench_decode_variants(e, pp, &o, T, seed + (uint64_t)ci,
                                                  cmode == CTX_PREFILL, warmup, ntok, nnf, var, nvar,
                                                  r->rv);
                r->r = r->rv[0];
            } else if (!st) {
                st = kv_gpu_bench_decode(e, pp, &o, T, seed + (uint64_t)ci, cmode == CTX_PREFILL,
                                         warmup, ntok, nnf, &r->r);
            }
            if (!st && cmode == CTX_BOTH) {
                kv_progress("context %d: %s after a real prefill", T, kv_decode_placement_name(p));
                st = kv_gpu_bench_decode(e, pp, &o, T, seed + (uint64_t)ci, true, warmup, ntok, nnf,
                                         &r->rp);
                r->ran_pf = !st;
            }
            r->ran = true;
            if (st) {
                snprintf(r->err, sizeof r->err, "%s: %s", kv_strerror(st), kv_errdetail());
                kv_progress_done();
                kv_warn("context %d, %s: %s", T, kv_decode_placement_name(p), r->err);
                r->ran = false;
                if (st == KV_E_UNAVAILABLE) rc = kv_status_exit(st);
            }
        }
        kv_gpu_engine_free(e);
    }
    kv_progress_done();
    if (rc != KV_EXIT_OK) {
        free(runs);
        free(pp);
        kv_model_close(m);
        return rc;
    }

    char date[64];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    const prun *last = runs[nctx - 1];
    const prun *F = &last[KV_DEC_FULL], *H = &last[KV_DEC_HYBRID], *S = &last[KV_DEC_SKETCH], *O = &last[KV_DEC_OFFLOAD];
    if (kv_want_json(stdout, json)) {
        printf("{\n  \"bench\": \"decode\",\n  \"date\": \"%s\",\n  \"device\": \"%s\",\n", date, devname);
        printf("  \"model\": \"%s\",\n  \"weights\": \"%s\",\n  \"weight_bytes_read_per_token\": %llu,\n"
               "  \"weight_bytes_stored\": %llu,\n", m->cfg.name, wt == KV_DT_BF16 ? "bf16" : "f16",
               (unsigned long long)wread, (unsigned long long)wstore);
        printf("  \"context_source\": \"%s\",\n",
               cmode == CTX_SYNTH     ? "synthesized on the device (seeded), no prefill"
               : cmode == CTX_PREFILL ? "a seeded random prompt prefilled on the GPU"
                                      : "both: synthesized, then a seeded random prompt prefilled on the GPU");
        printf("  \"hybrid\": {\"quant_layers\": %d, \"bits\": %d, \"topk\": %d, \"channels\": %d, "
               "\"sink\": %d, \"window\": %d},\n", bc.qlayers, bc.qbits, bc.topk, bc.channels, bc.sink,
               bc.window);
        if (pdl == KV_GPU_PDL_AUTO) printf("  \"pdl\": \"auto\",\n");
        else printf("  \"pdl\": %d,\n", pdl);
        printf("  \"sel_skip\": %u,\n", sel_skip);
        printf("  \"prefill_copy\": \"%s\",\n", pf_sync ? "sync" : "overlap");
        printf("  \"variants\": [");
        for (int vi = 0; vi < nvar; vi++) printf("%s\"%s\"", vi ? ", " : "", var[vi].name);
        printf("],\n");
        printf("  \"bandwidth\": {\"h2d\": %.4e, \"d2h\": %.4e, \"d2d_copy\": %.4e, \"zero_copy_read\": %.4e, "
               "\"zero_copy_gather_512B\": %.4e, \"memcpy_gather_512B\": %.4e},\n",
               bw.h2d, bw.d2h, bw.d2d, bw.zc_read, bw.zc_gather, bw.memcpy_gather);
        printf("  \"select_kernels_us\": {\"candidates\": %d, \"topk\": %d, \"pred_gemv\": %.1f, "
               "\"score_sketch\": %.1f, \"score_channels\": %.1f, \"softmax_combine\": %.1f, "
               "\"sketch_combine_fused\": %.1f, \"topk_select\": %.1f, \"gather\": %.1f},\n", sel_us.n, sel_us.k,
               sel_us.pred_gemv, sel_us.score_sketch, sel_us.score_channels, sel_us.softmax_combine,
               sel_us.sketch_combine, sel_us.topk, sel_us.gather);
        printf("  \"contexts\": [\n");
        for (int ci = 0; ci < nctx; ci++) {
            printf("    {\"T\": %d, \"policies\": {\n", ctx[ci]);
            int first = 1;
            for (int p = 0; p < KV_DEC_COUNT; p++) {
                const prun *r = &runs[ci][p];
                if (!want[p]) continue;
                const int nv = kv_decode_is_hybrid(p) && r->ran ? nvar : 1;
                for (int vi = 0; vi < nv; vi++) {
                    char pname[320];
                    if (nv > 1 || (kv_decode_is_hybrid(p) && strcmp(var[0].name, "base")))
                        snprintf(pname, sizeof pname, "%s%s%s", kv_decode_placement_name(p),
                                 strcmp(var[vi].name, "base") ? "/" : "",
                                 strcmp(var[vi].name, "base") ? var[vi].name : "");
                    else
                        snprintf(pname, sizeof pname, "%s", kv_decode_placement_name(p));
                    printf("%s      \"%s\": ", first ? "" : ",\n", pname);
                    first = 0;
                    if (!r->ran) {
                        printf("{\"error\": \"%s\"}", r->err);
                        continue;
                }
                const kv_gpu_decode_result *x = kv_decode_is_hybrid(p) ? &r->rv[vi] : &r->r;
                double side = x->fetch_ms;
                printf("{\"ms_per_token\": %.4f, \"ms_p90\": %.4f, \"tokens\": %d, \"gpu_kv_bytes\": %llu, "
                       "\"host_kv_bytes\": %llu, \"pcie_bytes_per_token\": %llu",
                       x->ms_median, x->ms_p90, x->tokens, (unsigned long long)x->gpu_kv,
                       (unsigned long long)x->host_kv, (unsigned long long)x->pcie_token);
                if (kv_decode_is_hybrid(p))
                    printf(", \"variant\": {\"name\": \"%s\", \"serial\": %s, \"topk_wide\": %s, "
                           "\"sel_cache\": %s}", var[vi].name, var[vi].serial ? "true" : "false",
                           var[vi].wide ? "true" : "false", var[vi].cache ? "true" : "false");
                if (x->select_ms > 0) printf(", \"select_latency_ms\": %.4f", x->select_ms);
                if (kv_decode_is_hybrid(p) && x->select_ms > 0)
                    printf(", \"breakdown_ms\": {\"selection\": %.4f, \"fetch\": %.4f, \"exposed_wait\": %.4f}",
                           x->score_ms, x->fetch_ms, x->wait_ms);
                if (x->cache_rows > 0)
                    printf(", \"cache_hit_rate\": %.4f, \"cache_rows\": %llu", (double)x->cache_hits / (double)x->cache_rows,
                           (unsigned long long)x->cache_rows);
                if (side > 0) printf(", \"fetch_ms\": %.4f, \"pcie_gbs_achieved\": %.3f", side,
                                     (double)x->pcie_token / (side * 1e-3) / 1e9);
                if (x->ms_nofetch > 0)
                    printf(", \"ms_no_fetch\": %.4f, \"pcie_hidden\": %.4f", x->ms_nofetch,
                           kv_gpu_bench_hidden(x->ms_median, x->ms_nofetch, x->pcie_token, bw.h2d));
                if (p == KV_DEC_OFFLOAD && runs[ci][KV_DEC_FULL].ran)
                    printf(", \"pcie_hidden\": %.4f",
                           kv_gpu_bench_hidden(x->ms_median, runs[ci][KV_DEC_FULL].r.ms_median, x->pcie_token, bw.h2d));
                if (p == KV_DEC_FULL)
                    printf(", \"bound_ms\": %.4f", (double)(wread + x->gpu_kv) / bw.d2d * 1e3);
                /* the real prefill: its time, tokens/s and attention rate, and
                 * (both) the decode from its cache against the synthesized one */
                const kv_gpu_decode_result *xp = cmode == CTX_PREFILL ? x : r->ran_pf ? &r->rp : NULL;
                if (xp) {
                    double af = 4.0 * ctx[ci] * (double)ctx[ci] * m->cfg.n_heads * m->cfg.head_dim / 2 * L;
                    printf(", \"prefill\": {\"prefill_ms\": %.2f, \"tokens_per_s\": %.1f, \"attn_ms\": %.2f, "
                           "\"attn_tflops\": %.1f", xp->prefill_ms, ctx[ci] / (xp->prefill_ms * 1e-3),
                           xp->prefill_attn_ms,
                           xp->prefill_attn_ms > 0 ? af / (xp->prefill_attn_ms * 1e-3) / 1e12 : 0.0);
                    if (xp != x)
                        printf(", \"ms_per_token\": %.4f, \"over_synthesized\": %.4f", xp->ms_median,
                               xp->ms_median / x->ms_median);
                    printf("}");
                }
                printf("}");
                }
            }
            printf("\n    }}%s\n", ci + 1 < nctx ? "," : "");
        }
        printf("  ],\n  \"targets_at_T\": %d,\n  \"targets\": {\n", ctx[nctx - 1]);
        const prun *hy[4] = {H, S, &last[KV_DEC_RESIDENT], &last[KV_DEC_PAGES]};
        const char *hn[4] = {"hybrid", "hybrid_sketch", "hybrid_resident", "hybrid_pages"};
        for (int i = 0; i < 4; i++) {
            const prun *h = hy[i];
            if (!h->ran) continue;
            if (O->ran)
                printf("    \"%s_speedup_vs_offload\": {\"value\": %.2f, \"target\": 15, \"met\": %s},\n", hn[i],
                       O->r.ms_median / h->r.ms_median, O->r.ms_median / h->r.ms_median >= 15 ? "true" : "false");
            if (F->ran) {
                double ratio = h->r.ms_median / F->r.ms_median, kv = (double)h->r.gpu_kv / (double)F->r.gpu_kv;
                printf("    \"%s_ms_over_full\": {\"value\": %.3f, \"target\": 2, \"met\": %s},\n", hn[i], ratio,
                       ratio <= 2 ? "true" : "false");
                printf("    \"%s_gpu_kv_over_full\": {\"value\": %.4f, \"target\": 0.10, \"met\": %s},\n", hn[i],
                       kv, kv <= 0.10 ? "true" : "false");
            }
            if (h->r.ms_nofetch > 0) {
                double hid = kv_gpu_bench_hidden(h->r.ms_median, h->r.ms_nofetch, h->r.pcie_token, bw.h2d);
                printf("    \"%s_pcie_hidden\": {\"value\": %.3f, \"target\": 0.70, \"met\": %s},\n", hn[i], hid,
                       hid >= 0.70 ? "true" : "false");
            }
        }
        /* issue 17's targets for the resident hybrid, per variant */
        const prun *R = &last[KV_DEC_RESIDENT];
        for (int vi = 0; R->ran && vi < nvar; vi++) {
            const kv_gpu_decode_result *x = &R->rv[vi];
            const char *vn = var[vi].name;
            if (O->ran)
                printf("    \"resident_%s_speedup_vs_offload\": {\"value\": %.2f, \"target\": 30, \"met\": %s},\n",
                       vn, O->r.ms_median / x->ms_median, O->r.ms_median / x->ms_median >= 30 ? "true" : "false");
            if (F->ran) {
                double ratio = x->ms_median / F->r.ms_median, kv = (double)x->gpu_kv / (double)F->r.gpu_kv;
                printf("    \"resident_%s_ms_over_full\": {\"value\": %.3f, \"target\": 1.0, \"met\": %s},\n",
                       vn, ratio, ratio <= 1.0 ? "true" : "false");
                printf("    \"resident_%s_gpu_kv_over_full\": {\"value\": %.4f, \"target\": 0.06, \"met\": %s},\n",
                       vn, kv, kv <= 0.06 ? "true" : "false");
            }
            if (x->ms_nofetch > 0) {
                double hid = kv_gpu_bench_hidden(x->ms_median, x->ms_nofetch, x->pcie_token, bw.h2d);
                printf("    \"resident_%s_pcie_hidden\": {\"value\": %.3f, \"target\": 0.90, \"met\": %s},\n",
                       vn, hid, hid >= 0.90 ? "true" : "false");
            }
        }
        for (int p = 0; p < KV_DEC_COUNT; p++)
            if (last[p].ran_pf) {
                double q = last[p].rp.ms_median / last[p].r.ms_median;
                printf("    \"%s_decode_after_prefill_over_synthesized\": {\"value\": %.4f, \"target\": 1.02, "
                       "\"met\": %s},\n", kv_decode_placement_name(p), q, q <= 1.02 ? "true" : "false");
            }
        if (F->ran) {
            double bound = (double)(wread + F->r.gpu_kv) / bw.d2d * 1e3;
            printf("    \"full_over_bound\": {\"value\": %.3f, \"target\": 1.25, \"met\": %s}\n",
                   F->r.ms_median / bound, F->r.ms_median / bound <= 1.25 ? "true" : "false");
        } else {
            printf("    \"full_over_bound\": null\n");
        }
        printf("  }\n}\n");
    } else {
        printf("%s, %s\n%s %s weights (%.2f GB read per token); context synthesized on the device\n",
               devname, date, m->cfg.name, wt == KV_DT_BF16 ? "bf16" : "f16", (double)wread / 1e9);
        printf("bandwidth GB/s: h2d %.1f, d2h %.1f, device copy %.0f, zero-copy read %.1f, "
               "gather 512B rows: zero-copy %.1f vs memcpy %.2f\n",
               bw.h2d / 1e9, bw.d2h / 1e9, bw.d2d / 1e9, bw.zc_read / 1e9, bw.zc_gather / 1e9,
               bw.memcpy_gather / 1e9);
        printf("one sparse layer's selection at %d candidates, us each alone: predicted query %.1f, "
               "sketch scores %.1f, channel scores %.1f, softmax %.1f, top-%d %.1f, gather %.1f\n",
               sel_us.n, sel_us.pred_gemv, sel_us.score_sketch, sel_us.score_channels,
               sel_us.softmax_combine, sel_us.k, sel_us.topk, sel_us.gather);
        printf("%8s  %-14s %9s %11s %11s %11s %9s %8s\n", "context", "policy", "ms/token", "GPU KV MB",
               "host KV MB", "PCIe MB/tok", "PCIe GB/s", "hidden");
        for (int ci = 0; ci < nctx; ci++)
            for (int p = 0; p < KV_DEC_COUNT; p++) {
                const prun *r = &runs[ci][p];
                if (!want[p]) continue;
                if (!r->ran) {
                    printf("%8d  %-14s failed: %s\n", ctx[ci], kv_decode_placement_name(p), r->err);
                    continue;
                }
                const int nv = kv_decode_is_hybrid(p) ? nvar : 1;
                for (int vi = 0; vi < nv; vi++) {
                    const kv_gpu_decode_result *x = kv_decode_is_hybrid(p) ? &r->rv[vi] : &r->r;
                    char pname[320];
                    snprintf(pname, sizeof pname, "%s%s%s", kv_decode_placement_name(p),
                             strcmp(var[vi].name, "base") ? "/" : "",
                             strcmp(var[vi].name, "base") ? var[vi].name : "");
                    double side = x->fetch_ms;
                    double hid = -1;
                    if (x->ms_nofetch > 0) hid = kv_gpu_bench_hidden(x->ms_median, x->ms_nofetch, x->pcie_token, bw.h2d);
                    if (p == KV_DEC_OFFLOAD && runs[ci][KV_DEC_FULL].ran)
                        hid = kv_gpu_bench_hidden(x->ms_median, runs[ci][KV_DEC_FULL].r.ms_median, x->pcie_token, bw.h2d);
                    printf("%8d  %-14s %9.3f %11.1f %11.1f %11.2f ", ctx[ci], pname, x->ms_median,
                           (double)x->gpu_kv / 1e6, (double)x->host_kv / 1e6, (double)x->pcie_token / 1e6);
                    if (side > 0) printf("%9.1f ", (double)x->pcie_token / (side * 1e-3) / 1e9);
                    else printf("%9s ", "-");
                    if (hid >= 0) printf("%7.0f%%\n", 100 * hid);
                    else printf("%8s\n", "-");
                    const kv_gpu_decode_result *xp = cmode == CTX_PREFILL ? x : r->ran_pf ? &r->rp : NULL;
                    if (xp)
                        printf("%8s  %-14s prefill %.1f ms (%.0f tokens/s, attention %.1f ms)%s", "", "",
                               xp->prefill_ms, ctx[ci] / (xp->prefill_ms * 1e-3), xp->prefill_attn_ms,
                               xp == x ? "\n" : "");
                    if (xp && xp != x)
                        printf(", then %.3f ms/token (%.3fx the synthesized context)\n", xp->ms_median,
                               xp->ms_median / x->ms_median);
                    if (kv_decode_is_hybrid(p) && x->select_ms > 0)
                        printf("%8s  %-14s selection %.3f ms, fetch %.3f ms, exposed wait %.3f ms%s", "", "",
                               x->score_ms, x->fetch_ms, x->wait_ms, x->cache_rows ? "" : "\n");
                    if (kv_decode_is_hybrid(p) && x->select_ms > 0 && x->cache_rows)
                        printf(", cache hits %.1f%%\n", 100.0 * (double)x->cache_hits / (double)x->cache_rows);
                }
            }
        if (F->ran)
            printf("full bound (weights + KV at copy bandwidth): %.3f ms\n",
                   (double)(wread + F->r.gpu_kv) / bw.d2d * 1e3);
    }
    free(runs);
    free(pp);
    kv_model_close(m);
    return KV_EXIT_OK;
}
