/*
 * kv-bench decode's report: every context and placement (and hybrid
 * variant) with its ms/token, KV bytes on each side, PCIe traffic and how
 * much of it the decode hid, the issue targets at the longest context —
 * as JSON (when piped or with --json) or as a table on a terminal.
 */
#include <stdio.h>
#include <string.h>

#include "kv_cli.h"
#include "decode.h"

/* How the steps reached the GPU (kv_gpu_graph_info), as JSON members. */
static void print_graph(const kv_gpu_graph_info *g)
{
    printf(", \"graph\": \"%s\", \"graph_steps\": {\"steps\": %llu, \"captured\": %llu, \"updated\": %llu, "
           "\"instantiated\": %llu, \"update_refused\": %llu, \"host_us\": %.1f}", g->state,
           (unsigned long long)g->steps, (unsigned long long)g->captured, (unsigned long long)g->updated,
           (unsigned long long)g->instantiated, (unsigned long long)g->refused, g->host_us);
}

void kv_bench_decode_json(const decode_args *A, const decode_out *D)
{
    const int nctx = A->nctx, nvar = A->nvar, cmode = A->cmode, pdl = A->pdl;
    const int *ctx = A->ctx;
    const bool *want = A->want;
    const kv_decode_variant *var = A->var;
    const kv_decode_layers bc = A->bc;
    const kv_model *m = D->m;
    const int L = m->cfg.n_layers;
    const char *devname = D->devname, *date = D->date;
    const uint64_t wread = D->wread, wstore = D->wstore;
    const kv_gpu_bw bw = D->bw;
    const kv_gpu_select_us sel_us = D->sel_us;
    prun(*runs)[KV_DEC_COUNT] = D->runs;
    const prun *last = runs[nctx - 1];
    const prun *F = &last[KV_DEC_FULL], *H = &last[KV_DEC_HYBRID], *S = &last[KV_DEC_SKETCH], *O = &last[KV_DEC_OFFLOAD];
    const kv_dtype wt = A->wt;
    const unsigned sel_skip = A->sel_skip;
    const bool pf_sync = A->pf_sync;
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
    printf("  \"graph\": \"%s\",\n", A->gmode == GRAPH_BOTH ? "both" : A->gmode == GRAPH_OFF ? "off" : "on");
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
            /* pcie_hidden against the step with only the gather off; side_work_hidden
             * (the former pcie_hidden) against the step with selection and gather off */
            if (x->ms_nogather > 0)
                printf(", \"ms_no_gather\": %.4f, \"pcie_hidden\": %.4f", x->ms_nogather,
                       kv_gpu_bench_hidden(x->ms_median, x->ms_nogather, x->pcie_token, bw.h2d));
            if (x->ms_nofetch > 0)
                printf(", \"ms_no_fetch\": %.4f, \"side_work_hidden\": %.4f", x->ms_nofetch,
                       kv_gpu_bench_hidden(x->ms_median, x->ms_nofetch, x->pcie_token, bw.h2d));
            if (p == KV_DEC_OFFLOAD && runs[ci][KV_DEC_FULL].ran)
                printf(", \"pcie_hidden\": %.4f",
                       kv_gpu_bench_hidden(x->ms_median, runs[ci][KV_DEC_FULL].r.ms_median, x->pcie_token, bw.h2d));
            if (p == KV_DEC_FULL)
                printf(", \"bound_ms\": %.4f, \"over_bound\": %.4f", (double)(wread + x->gpu_kv) / bw.d2d * 1e3,
                       x->ms_median / ((double)(wread + x->gpu_kv) / bw.d2d * 1e3));
            print_graph(&x->graph);
            if (r->ran_g && vi == 0) {
                printf(", \"no_graph\": {\"ms_per_token\": %.4f, \"ms_p90\": %.4f", r->rg.ms_median,
                       r->rg.ms_p90);
                if (r->rg.select_ms > 0)
                    printf(", \"breakdown_ms\": {\"selection\": %.4f, \"fetch\": %.4f, \"exposed_wait\": %.4f}",
                           r->rg.score_ms, r->rg.fetch_ms, r->rg.wait_ms);
                printf(", \"graph\": \"%s\"}, \"graph_speedup\": %.4f", r->rg.graph.state,
                       r->rg.ms_median / x->ms_median);
            }
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
        for (int w = 0; w < 2; w++) { /* against no gather (pcie_hidden), no selection and gather */
            const double ref = w ? h->r.ms_nofetch : h->r.ms_nogather;
            if (ref <= 0) continue;
            double hid = kv_gpu_bench_hidden(h->r.ms_median, ref, h->r.pcie_token, bw.h2d);
            printf("    \"%s_%s\": {\"value\": %.3f, \"target\": 0.70, \"met\": %s},\n", hn[i],
                   w ? "side_work_hidden" : "pcie_hidden", hid, hid >= 0.70 ? "true" : "false");
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
        for (int w = 0; w < 2; w++) {
            const double ref = w ? x->ms_nofetch : x->ms_nogather;
            if (ref <= 0) continue;
            double hid = kv_gpu_bench_hidden(x->ms_median, ref, x->pcie_token, bw.h2d);
            printf("    \"resident_%s_%s\": {\"value\": %.3f, \"target\": 0.90, \"met\": %s},\n", vn,
                   w ? "side_work_hidden" : "pcie_hidden", hid, hid >= 0.90 ? "true" : "false");
        }
    }
    for (int p = 0; p < KV_DEC_COUNT; p++)
        if (last[p].ran_pf) {
            double q = last[p].rp.ms_median / last[p].r.ms_median;
            printf("    \"%s_decode_after_prefill_over_synthesized\": {\"value\": %.4f, \"target\": 1.02, "
                   "\"met\": %s},\n", kv_decode_placement_name(p), q, q <= 1.02 ? "true" : "false");
        }
    if (F->ran) {
        double bound = (double)(wread + F->r.gpu_kv) / bw.d2d * 1e3, q = F->r.ms_median / bound;
        /* issue 10: 1.10 at 128k, 1.15 at 32k (the earlier 1.25 stays beside it) */
        const double t10 = ctx[nctx - 1] >= 131072 ? 1.10 : 1.15;
        printf("    \"full_over_bound_issue10\": {\"value\": %.3f, \"target\": %.2f, \"met\": %s},\n", q, t10,
               q <= t10 ? "true" : "false");
        printf("    \"full_over_bound\": {\"value\": %.3f, \"target\": 1.25, \"met\": %s}\n",
               F->r.ms_median / bound, F->r.ms_median / bound <= 1.25 ? "true" : "false");
    } else {
        printf("    \"full_over_bound\": null\n");
    }
    printf("  }\n}\n");
}

void kv_bench_decode_table(const decode_args *A, const decode_out *D)
{
    const int nctx = A->nctx, nvar = A->nvar, cmode = A->cmode;
    const int *ctx = A->ctx;
    const bool *want = A->want;
    const kv_decode_variant *var = A->var;
    const kv_model *m = D->m;
    const char *devname = D->devname, *date = D->date;
    const uint64_t wread = D->wread;
    const kv_gpu_bw bw = D->bw;
    const kv_gpu_select_us sel_us = D->sel_us;
    prun(*runs)[KV_DEC_COUNT] = D->runs;
    const prun *last = runs[nctx - 1];
    const prun *F = &last[KV_DEC_FULL];
    const kv_dtype wt = A->wt;
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
    printf("%8s  %-14s %9s %11s %11s %11s %9s %8s %8s\n", "context", "policy", "ms/token", "GPU KV MB",
           "host KV MB", "PCIe MB/tok", "PCIe GB/s", "hidden", "side hid");
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
                double hid = -1, shid = -1;
                if (x->ms_nogather > 0) hid = kv_gpu_bench_hidden(x->ms_median, x->ms_nogather, x->pcie_token, bw.h2d);
                if (x->ms_nofetch > 0) shid = kv_gpu_bench_hidden(x->ms_median, x->ms_nofetch, x->pcie_token, bw.h2d);
                if (p == KV_DEC_OFFLOAD && runs[ci][KV_DEC_FULL].ran)
                    hid = kv_gpu_bench_hidden(x->ms_median, runs[ci][KV_DEC_FULL].r.ms_median, x->pcie_token, bw.h2d);
                printf("%8d  %-14s %9.3f %11.1f %11.1f %11.2f ", ctx[ci], pname, x->ms_median,
                       (double)x->gpu_kv / 1e6, (double)x->host_kv / 1e6, (double)x->pcie_token / 1e6);
                if (side > 0) printf("%9.1f ", (double)x->pcie_token / (side * 1e-3) / 1e9);
                else printf("%9s ", "-");
                if (hid >= 0) printf("%7.0f%% ", 100 * hid);
                else printf("%8s ", "-");
                if (shid >= 0) printf("%7.0f%%\n", 100 * shid);
                else printf("%8s\n", "-");
                const kv_gpu_decode_result *xp = cmode == CTX_PREFILL ? x : r->ran_pf ? &r->rp : NULL;
                if (xp)
                    printf("%8s  %-14s prefill %.1f ms (%.0f tokens/s, attention %.1f ms)%s", "", "",
                           xp->prefill_ms, ctx[ci] / (xp->prefill_ms * 1e-3), xp->prefill_attn_ms,
                           xp == x ? "\n" : "");
                if (xp && xp != x)
                    printf(", then %.3f ms/token (%.3fx the synthesized context)\n", xp->ms_median,
                           xp->ms_median / x->ms_median);
                printf("%8s  %-14s graph: %s", "", "", x->graph.state);
                if (x->graph.captured) printf(" (host %.0f us/step)", x->graph.host_us);
                if (r->ran_g && vi == 0)
                    printf("; kernel by kernel %.3f ms/token (%.3fx)", r->rg.ms_median, r->rg.ms_median / x->ms_median);
                printf("\n");
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
