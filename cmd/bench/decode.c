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
#include "decode.h"

int kv_bench_decode_main(int argc, char **argv);

int kv_bench_decode_main(int argc, char **argv)
{
    decode_args A;
    kv_bench_decode_args(argc, argv, &A);
    if (A.nbatch) return kv_bench_decode_batch(&A);
    const char *synth = A.synth;
    const kv_dtype wt = A.wt;
    const int *ctx = A.ctx, nctx = A.nctx, tokens = A.tokens, warmup = A.warmup, offtok = A.offtok,
              nofetch = A.nofetch;
    const kv_decode_layers bc = A.bc;
    const int device = A.device, pdl = A.pdl, cmode = A.cmode, nvar = A.nvar;
    const unsigned sel_skip = A.sel_skip;
    const bool pf_sync = A.pf_sync, *want = A.want;
    const unsigned long long seed = A.seed;
    const kv_decode_variant *var = A.var;

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
        return kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "decode results");
    }
    int rc = KV_EXIT_OK;
    for (int ci = 0; ci < nctx && rc == KV_EXIT_OK; ci++) {
        int T = ctx[ci];
        /* each variant decodes warmup + tokens (and nofetch without its gather)
         * more from the same context, the first nofetch more without fetching */
        int extra = nvar * (warmup + (tokens > offtok ? tokens : offtok) + nofetch) + nofetch + 16;
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
            /* timing events are not recorded inside a graph: the side streams'
             * times come with plain steps only */
            o.profile = (kv_decode_is_hybrid(p) || p == KV_DEC_OFFLOAD) && A.gmode == GRAPH_OFF;
            o.graph = A.gmode == GRAPH_OFF ? KV_GPU_GRAPH_OFF : KV_GPU_GRAPH_ON;
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
            if (!st && A.gmode == GRAPH_BOTH) { /* the same context again, kernel by kernel */
                kv_progress("context %d: %s without graphs", T, kv_decode_placement_name(p));
                kv_gpu_engine_opts og = o;
                og.graph = KV_GPU_GRAPH_OFF;
                og.profile = kv_decode_is_hybrid(p) || p == KV_DEC_OFFLOAD;
                st = kv_gpu_bench_decode(e, pp, &og, T, seed + (uint64_t)ci, cmode == CTX_PREFILL,
                                         warmup, ntok, 0, &r->rg);
                r->ran_g = !st;
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

    decode_out D = {.m = m, .wread = wread, .wstore = wstore, .bw = bw, .sel_us = sel_us, .runs = runs};
    snprintf(D.devname, sizeof D.devname, "%s", devname);
    time_t now = time(NULL);
    strftime(D.date, sizeof D.date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    if (kv_want_json(stdout, A.json)) kv_bench_decode_json(&A, &D);
    else kv_bench_decode_table(&A, &D);
    free(runs);
    free(pp);
    kv_model_close(m);
    return KV_EXIT_OK;
}
