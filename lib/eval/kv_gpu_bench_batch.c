/*
 * kv_gpu_bench_batch: batched decode timed (see kv_gpu_bench_batch.h).
 * The batch is built on the caller's weights engine, every sequence gets a
 * synthesized context of its own, a few untimed steps warm the workspaces
 * up, and the timed steps' GPU times (events on the batch's stream, end to
 * end) give ms per step; tokens/s counts every sequence's token.
 */
#include "eval/kv_gpu_bench_batch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_stats.h"

#ifdef KV_HAVE_CUDA

#include <cuda_runtime_api.h>

/* Build B sequences at T tokens; *out NULL on failure. */
static kv_status build(kv_gpu_engine *w, const kv_policy_params *per_layer, int B, int ctx, int T, uint64_t seed,
                       kv_gpu_gemm gemm, kv_gpu_batch **out)
{
    *out = NULL;
    if (B < 1) return kv_fail(KV_E_USAGE, "batch of %d sequences", B);
    const kv_policy_params **per = malloc((size_t)B * sizeof *per);
    if (!per) return kv_fail(KV_E_NOMEM, "out of memory");
    for (int i = 0; i < B; i++) per[i] = per_layer;
    kv_status st = kv_gpu_batch_new(w, B, per, ctx, gemm, out);
    free(per);
    for (int i = 0; i < B && !st; i++) {
        st = kv_gpu_engine_synthesize(kv_gpu_batch_seq(*out, i), T, seed + (uint64_t)i);
        if (st) kv_errcontext("sequence %d of %d", i, B);
    }
    if (st) {
        kv_gpu_batch_free(*out);
        *out = NULL;
    }
    return st;
}

kv_status kv_gpu_bench_batch(kv_gpu_engine *w, const kv_policy_params *per_layer, int T, uint64_t seed, int B,
                             int cap, kv_gpu_gemm gemm, int warmup, int tokens, kv_gpu_batch_result *r)
{
    memset(r, 0, sizeof *r);
    r->asked = B;
    if (tokens < 1 || warmup < 0) return kv_fail(KV_E_USAGE, "no steps to time");
    const int ctx = T + warmup + tokens + 8;
    double t0 = kv_now_ms();
    if (B == 0) {
        const char *why = "";
        kv_status st = kv_gpu_batch_probe(w, per_layer, ctx, T, seed, &r->probe_gpu, &r->probe_host);
        if (!st) st = kv_gpu_batch_max(r->probe_gpu, r->probe_host, 0, cap, &B, &why);
        if (st) return st;
        snprintf(r->bound, sizeof r->bound, "%s", why);
    }
    kv_gpu_batch *bt = NULL;
    kv_status st = build(w, per_layer, B, ctx, T, seed, gemm, &bt);
    for (int tries = 0; st == KV_E_NOMEM && r->asked == 0 && tries < 3 && B > 1; tries++) {
        B = B * 9 / 10 > 0 ? B * 9 / 10 : 1;
        snprintf(r->bound, sizeof r->bound, "nomem");
        kv_errclear();
        st = build(w, per_layer, B, ctx, T, seed, gemm, &bt);
    }
    if (st) return st;
    r->setup_s = (kv_now_ms() - t0) / 1e3;
    r->B = B;
    r->tokens = tokens;
    snprintf(r->gemm, sizeof r->gemm, "%s", kv_gpu_batch_gemm_desc(bt));
    int *first = malloc((size_t)B * sizeof(int)), *ids = malloc((size_t)B * (warmup + tokens) * sizeof(int));
    float *ms = malloc((size_t)tokens * sizeof(float));
    double *dv = malloc((size_t)tokens * sizeof(double));
    if (!first || !ids || !ms || !dv) st = kv_fail(KV_E_NOMEM, "out of memory");
    for (int i = 0; i < B && !st; i++) first[i] = (int)((seed * 2654435761u + (uint64_t)i * 40503u) % 1000u) + 1;
    if (!st && warmup) {
        st = kv_gpu_batch_generate(bt, first, warmup, ids, NULL);
        if (!st) memcpy(first, ids + (size_t)(warmup - 1) * B, (size_t)B * sizeof(int));
    }
    if (!st) st = kv_gpu_batch_generate(bt, first, tokens, ids, ms);
    if (!st) {
        size_t fr = 0, tot = 0;
        if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) r->gpu_used = (uint64_t)(tot - fr), r->gpu_total = tot;
        (void)cudaGetLastError();
        for (int i = 0; i < tokens; i++) dv[i] = ms[i];
        kv_stats s;
        kv_stats_of(dv, tokens, &s);
        r->ms_median = s.median, r->ms_p90 = s.p90, r->ms_min = s.min;
        r->tok_s = s.median > 0 ? B * 1e3 / s.median : 0;
        for (int i = 0; i < B; i++) {
            kv_bytes kb;
            kv_gpu_engine_bytes(kv_gpu_batch_seq(bt, i), &kb);
            r->gpu_kv += kb.resident;
            r->host_kv += kb.host;
        }
    }
    free(first), free(ids), free(ms), free(dv);
    kv_gpu_batch_free(bt);
    return st;
}

#else

kv_status kv_gpu_bench_batch(kv_gpu_engine *w, const kv_policy_params *per_layer, int T, uint64_t seed, int B,
                             int cap, kv_gpu_gemm gemm, int warmup, int tokens, kv_gpu_batch_result *r)
{
    (void)w, (void)per_layer, (void)T, (void)seed, (void)cap, (void)gemm, (void)warmup, (void)tokens;
    memset(r, 0, sizeof *r);
    r->asked = B;
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA");
}

#endif
