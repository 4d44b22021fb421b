/*
 * kv-bench decode --batch: batched decode throughput per context, placement
 * and batch size (issue 10).  One weights engine per context; for each
 * placement and each --batch entry, B sequences (or, for max, as many as
 * fit in GPU and host memory) each get a synthesized context of their own
 * and decode together (lib/eval/kv_gpu_bench_batch.c).  Reported per run:
 * B, ms per step, tokens/s = B / step time, KV bytes on the GPU and in
 * host memory, and for max the bytes one sequence took and what bounded B;
 * per context the best tokens/s of each placement and its ratio to full's.
 * JSON when piped or with --json, a table on a terminal.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_cli.h"
#include "common/kv_json.h"
#include "eval/kv_gpu_bench_batch.h"
#include "gpu/kv_gpu_engine.h"
#include "model/kv_model.h"
#include "policy/kv_policy.h"
#include "decode.h"

typedef struct {
    bool ran;
    kv_gpu_batch_result r;
    char err[256];
} brun;

/* run (context, placement, variant, batch entry) */
#define RUN(ci, p, vi, bi) runs[(((size_t)(ci) * KV_DEC_COUNT + (size_t)(p)) * MAXV + (size_t)(vi)) * MAXB + (size_t)(bi)]

/* variants a placement runs: the hybrids every --variants entry, the rest one */
static int nvar_of(const decode_args *A, int p) { return kv_decode_is_hybrid(p) ? A->nvar : 1; }

/* "hybrid-resident" or, for a hybrid variant other than base, "hybrid-resident/cache" */
static void run_name(const decode_args *A, int p, int vi, char *out, size_t n)
{
    const bool base = !strcmp(A->var[vi].name, "base") || !kv_decode_is_hybrid(p);
    snprintf(out, n, "%s%s%s", kv_decode_placement_name(p), base ? "" : "/", base ? "" : A->var[vi].name);
}

/* the best run of placement p at context ci over its variants and sizes; *vbest its variant */
static const brun *best_of(const brun *runs, const decode_args *A, int ci, int p, int *vbest)
{
    const brun *b = NULL;
    for (int vi = 0; vi < nvar_of(A, p); vi++)
        for (int bi = 0; bi < A->nbatch; bi++) {
            const brun *x = &RUN(ci, p, vi, bi);
            if (x->ran && (!b || x->r.tok_s > b->r.tok_s)) b = x, *vbest = vi;
        }
    return b;
}

static void print_json(const decode_args *A, const kv_model *m, const char *dev, const char *date, uint64_t wread,
                       const brun *runs)
{
    printf("{\n  \"bench\": \"decode-batch\",\n  \"date\": \"%s\",\n  \"device\": ", date);
    kv_json_string(stdout, dev);
    printf(",\n  \"model\": ");
    kv_json_string(stdout, m->cfg.name);
    printf(",\n  \"weights\": \"%s\",\n  \"weight_bytes_read_per_step\": %llu,\n", A->wt == KV_DT_BF16 ? "bf16" : "f16",
           (unsigned long long)wread);
    printf("  \"gemm\": \"%s\",\n  \"warmup\": %d,\n  \"steps\": %d,\n  \"batch_cap\": %d,\n",
           kv_gpu_gemm_name(A->gemm), A->warmup, A->tokens, A->batch_cap);
    printf("  \"hybrid\": {\"quant_layers\": %d, \"bits\": %d, \"topk\": %d, \"channels\": %d, \"sink\": %d, "
           "\"window\": %d},\n", A->bc.qlayers, A->bc.qbits, A->bc.topk, A->bc.channels, A->bc.sink, A->bc.window);
    printf("  \"contexts\": [\n");
    for (int ci = 0; ci < A->nctx; ci++) {
        printf("    {\"T\": %d, \"policies\": {", A->ctx[ci]);
        int firstp = 1;
        for (int p = 0; p < KV_DEC_COUNT; p++)
        for (int vi = 0; A->want[p] && vi < nvar_of(A, p); vi++) {
            char name[96];
            run_name(A, p, vi, name, sizeof name);
            printf("%s\n      \"%s\": [", firstp ? "" : ",", name);
            firstp = 0;
            for (int bi = 0; bi < A->nbatch; bi++) {
                const brun *x = &RUN(ci, p, vi, bi);
                printf("%s\n        {\"asked\": ", bi ? "," : "");
                if (A->batch[bi]) printf("%d", A->batch[bi]);
                else printf("\"max\"");
                if (!x->ran) {
                    printf(", \"error\": ");
                    kv_json_string(stdout, x->err);
                    printf("}");
                    continue;
                }
                const kv_gpu_batch_result *r = &x->r;
                printf(", \"batch\": %d, \"bound\": \"%s\", \"ms_per_step\": %.4f, \"ms_p90\": %.4f, \"ms_min\": %.4f, "
                       "\"tokens_per_s\": %.2f, \"gpu_kv_bytes\": %llu, \"host_kv_bytes\": %llu, "
                       "\"gpu_bytes_per_seq\": %llu, \"host_bytes_per_seq\": %llu, \"gpu_used_bytes\": %llu, "
                       "\"gpu_total_bytes\": %llu, \"gemm\": \"%s\", \"steps\": %d, \"setup_s\": %.2f}",
                       r->B, r->bound, r->ms_median, r->ms_p90, r->ms_min, r->tok_s, (unsigned long long)r->gpu_kv,
                       (unsigned long long)r->host_kv, (unsigned long long)r->probe_gpu,
                       (unsigned long long)r->probe_host, (unsigned long long)r->gpu_used,
                       (unsigned long long)r->gpu_total, r->gemm, r->tokens, r->setup_s);
            }
            printf("\n      ]");
        }
        printf("\n    }, \"best\": {");
        int fv = 0, bv = 0;
        const brun *full = A->want[KV_DEC_FULL] ? best_of(runs, A, ci, KV_DEC_FULL, &fv) : NULL;
        int firstb = 1;
        for (int p = 0; p < KV_DEC_COUNT; p++) {
            const brun *b = A->want[p] ? best_of(runs, A, ci, p, &bv) : NULL;
            if (!b) continue;
            printf("%s\"%s\": {\"batch\": %d, \"variant\": \"%s\", \"tokens_per_s\": %.2f", firstb ? "" : ", ",
                   kv_decode_placement_name(p), b->r.B, nvar_of(A, p) > 1 || kv_decode_is_hybrid(p) ? A->var[bv].name : "base",
                   b->r.tok_s);
            if (full && full->r.tok_s > 0) printf(", \"vs_full\": %.3f", b->r.tok_s / full->r.tok_s);
            printf("}");
            firstb = 0;
        }
        printf("}}%s\n", ci + 1 < A->nctx ? "," : "");
    }
    printf("  ]\n}\n");
}

static void print_table(const decode_args *A, const kv_model *m, const char *dev, const char *date, const brun *runs)
{
    printf("kv-bench decode --batch: %s, %s weights, %s, %s\n", m->cfg.name, A->wt == KV_DT_BF16 ? "bf16" : "f16", dev,
           date);
    printf("%8s  %-22s %6s %7s %10s %11s %10s %10s  %s\n", "context", "policy", "batch", "bound", "ms/step",
           "tokens/s", "GPU KV GiB", "host GiB", "products");
    for (int ci = 0; ci < A->nctx; ci++)
        for (int p = 0; p < KV_DEC_COUNT; p++)
            for (int vi = 0; A->want[p] && vi < nvar_of(A, p); vi++)
            for (int bi = 0; bi < A->nbatch; bi++) {
                const brun *x = &RUN(ci, p, vi, bi);
                char name[96];
                run_name(A, p, vi, name, sizeof name);
                if (!x->ran) {
                    printf("%8d  %-22s %6s  %s\n", A->ctx[ci], name, "-", x->err);
                    continue;
                }
                const kv_gpu_batch_result *r = &x->r;
                printf("%8d  %-22s %6d %7s %10.3f %11.1f %10.2f %10.2f  %s\n", A->ctx[ci], name,
                       r->B, r->bound[0] ? r->bound : "-", r->ms_median, r->tok_s, r->gpu_kv / 1073741824.0,
                       r->host_kv / 1073741824.0, r->gemm);
            }
    for (int ci = 0; ci < A->nctx; ci++) {
        int fv = 0, bv = 0;
        const brun *full = A->want[KV_DEC_FULL] ? best_of(runs, A, ci, KV_DEC_FULL, &fv) : NULL;
        for (int p = 0; p < KV_DEC_COUNT && full && full->r.tok_s > 0; p++) {
            const brun *b = A->want[p] && p != KV_DEC_FULL ? best_of(runs, A, ci, p, &bv) : NULL;
            if (b)
                printf("context %d: best %s %.1f tokens/s (batch %d) = %.2fx full's best %.1f (batch %d)\n",
                       A->ctx[ci], kv_decode_placement_name(p), b->r.tok_s, b->r.B, b->r.tok_s / full->r.tok_s,
                       full->r.tok_s, full->r.B);
        }
    }
}

int kv_bench_decode_batch(const decode_args *A)
{
    kv_model *m = NULL;
    kv_progress("building synthetic %s", A->synth);
    kv_status st = kv_model_synthetic(A->synth, A->seed, A->wt, &m);
    if (st) return kv_report(st, "synthetic %s", A->synth);
    const int L = m->cfg.n_layers;
    kv_policy_params *pp = calloc((size_t)L, sizeof *pp);
    brun *runs = calloc((size_t)A->nctx * KV_DEC_COUNT * MAXV * MAXB, sizeof *runs);
    if (!pp || !runs) {
        free(pp), free(runs);
        kv_model_close(m);
        return kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "out of memory");
    }
    char dev[400] = "";
    uint64_t wread = 0;
    int rc = KV_EXIT_OK;
    for (int ci = 0; ci < A->nctx && rc == KV_EXIT_OK; ci++) {
        const int T = A->ctx[ci];
        kv_gpu_engine_opts o;
        kv_gpu_engine_opts_default(&o);
        o.device = A->device;
        o.pdl = A->pdl;
        o.sel_skip = A->sel_skip;
        kv_gpu_engine *w = NULL;
        kv_progress("context %d: loading weights", T);
        /* the weights engine never decodes: a token of room is enough */
        if ((st = kv_gpu_engine_new(m, NULL, 16, &o, &w))) {
            rc = kv_report(st, "GPU engine");
            break;
        }
        snprintf(dev, sizeof dev, "%s", kv_gpu_engine_device(w));
        wread = kv_gpu_engine_weight_read_bytes(w);
        for (int p = 0; p < KV_DEC_COUNT && rc == KV_EXIT_OK; p++) {
            if (!A->want[p]) continue;
            const int nv = kv_decode_is_hybrid(p) ? A->nvar : 1;
            for (int vi = 0; vi < nv; vi++)
            for (int bi = 0; bi < A->nbatch; bi++) {
                brun *x = &RUN(ci, p, vi, bi);
                /* a hybrid's step variant: the sequences take the weights engine's options */
                kv_gpu_engine_opts ov = o;
                kv_decode_variant_apply(&A->var[vi], &ov);
                if ((st = kv_gpu_engine_reset_opts(w, NULL, &ov))) {
                    rc = kv_report(st, "GPU engine");
                    break;
                }
                kv_progress("context %d: %s, batch %s%.0d", T, kv_decode_placement_name(p), A->batch[bi] ? "" : "max",
                            A->batch[bi]);
                st = kv_decode_layers_fill((kv_decode_placement)p, &A->bc, L, pp);
                if (!st)
                    st = kv_gpu_bench_batch(w, pp, T, A->seed + (uint64_t)ci * 1000003u, A->batch[bi], A->batch_cap,
                                            A->gemm, A->warmup, p == KV_DEC_OFFLOAD ? A->offtok : A->tokens, &x->r);
                x->ran = !st;
                if (!st)
                    kv_note(1, "context %d, %s%s%s: batch %d (%s), %.3f ms/step, %.1f tokens/s, setup %.1f s", T,
                            kv_decode_placement_name(p), nv > 1 ? "/" : "", nv > 1 ? A->var[vi].name : "", x->r.B,
                            x->r.bound[0] ? x->r.bound : "asked", x->r.ms_median, x->r.tok_s, x->r.setup_s);
                if (st) {
                    snprintf(x->err, sizeof x->err, "%s: %s", kv_strerror(st), kv_errdetail());
                    kv_progress_done();
                    kv_warn("context %d, %s, batch %d: %s", T, kv_decode_placement_name(p), A->batch[bi], x->err);
                    if (st == KV_E_UNAVAILABLE) rc = kv_status_exit(st);
                }
            }
        }
        kv_gpu_engine_free(w);
    }
    kv_progress_done();
    if (rc == KV_EXIT_OK) {
        char date[64];
        time_t now = time(NULL);
        strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
        if (kv_want_json(stdout, A->json)) print_json(A, m, dev, date, wread, runs);
        else print_table(A, m, dev, date, runs);
    }
    free(runs);
    free(pp);
    kv_model_close(m);
    return rc;
}
