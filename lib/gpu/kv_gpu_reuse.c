/*
 * kv_gpu_reuse: what the GPU engine's core needs to continue from a stored
 * cache cheaply (kv_gpu_engine.h, kv_gpu_engine_prefill_from): the chunked
 * prefill's buffers kept between prefills when they are small (kv-bench
 * prefix serves thousands-of-token requests whose whole prefill is a few
 * milliseconds, and a cudaMalloc/cudaFree pair per buffer per request was a
 * visible share of it), layers packed in the file taken over with the
 * file's encoding (their placement then loads the packed planes instead of
 * ingesting dequantized rows), and the host-clock phases of the last
 * prefill.  CUDA builds only; kv_gpu_stub.c answers without CUDA.
 */
#include "gpu/kv_gpu_int.h"

#ifdef KV_HAVE_CUDA

#include <stdlib.h>
#include <string.h>
#include <time.h>

double gl_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

// --- the chunked prefill's buffers -----------------------------------------------------

/* Grow one device buffer to at least n elements of size es (the device is
 * idle), with 1/8 to spare: requests a few tokens longer than the last
 * would otherwise each pay a synchronise, a cudaFree and a cudaMalloc (half
 * a millisecond on the H200, measured as the setup phase). */
static kv_status grow(void *pp, size_t *have, size_t n, size_t es, const char *what)
{
    if (n <= *have) return KV_OK;
    n += n / 8;
    gl_dfree(pp);
    *have = 0;
    TRY(gl_dalloc(pp, n * es, what));
    *have = n;
    return KV_OK;
}

kv_status gl_pf_buffers(kv_gpu_engine *e, int rows, int nn, int C, const kv_pf_geom *g, size_t tmp_n)
{
    const size_t kvn = (size_t)e->nkv * (size_t)rows * (size_t)e->hd;
    bool regrow = (size_t)nn * e->ld_dim > e->pfb.X_n || kvn > e->pfb.kv_n || tmp_n > e->pfb.tmp_n ||
                  (size_t)nn > e->pfb.dt_n || !e->pfb.ws.base || C > e->pfb.ws.C || g->packed != e->pfb.ws_packed;
    /* a buffer freed here may still be read by work issued before the call */
    if (regrow) CK(cudaDeviceSynchronize());
    TRY(grow(&e->pfb.X, &e->pfb.X_n, (size_t)nn * e->ld_dim, 4, "prefill residual stream"));
    TRY(gl_grow_kv(&e->pfb.K, &e->pfb.V, &e->pfb.kv_n, kvn, kvn + kvn / 8, "prefill K", "prefill V"));
    TRY(grow(&e->pfb.tmp, &e->pfb.tmp_n, tmp_n, 2, "ingest scratch"));
    TRY(grow(&e->pfb.dt, &e->pfb.dt_n, (size_t)nn, sizeof(int), "prompt tokens"));
    if (!e->pfb.ws.base || C > e->pfb.ws.C || g->packed != e->pfb.ws_packed) {
        /* chunk rows with 1/8 to spare as above, up to the engine's chunk */
        const int C0 = e->o.prefill_chunk > 0 ? e->o.prefill_chunk : KV_GPU_PREFILL_CHUNK;
        int Cw = C + C / 8;
        if (Cw > C0 && C <= C0) Cw = C0;
        kv_gpu_prefill_ws_free(&e->pfb.ws);
        e->pfb.ws_bytes = 0;
        TRY(kv_gpu_prefill_ws_alloc(g, Cw, &e->pfb.ws));
        e->pfb.ws_packed = g->packed;
        e->pfb.ws_bytes = kv_gpu_prefill_ws_bytes(g, Cw);
    }
    return KV_OK;
}

void gl_pf_buffers_trim(kv_gpu_engine *e, bool all)
{
    size_t bytes = e->pfb.X_n * 4 + 2 * e->pfb.kv_n * 2 + e->pfb.tmp_n * 2 + e->pfb.dt_n * sizeof(int) +
                   e->pfb.ws_bytes;
    if (!all && bytes <= KV_GPU_PF_KEEP_BYTES) return;
    gl_dfree(&e->pfb.X);
    gl_dfree(&e->pfb.K);
    gl_dfree(&e->pfb.V);
    gl_dfree(&e->pfb.tmp);
    gl_dfree(&e->pfb.dt);
    kv_gpu_prefill_ws_free(&e->pfb.ws);
    e->pfb.X_n = e->pfb.kv_n = e->pfb.tmp_n = e->pfb.dt_n = 0;
    e->pfb.ws_packed = 0;
    e->pfb.ws_bytes = 0;
    if (all) {
        gl_hfree(&e->pfb.qpin);
        e->pfb.qpin_n = 0;
    }
}

// --- layers packed in a continued file -------------------------------------------------

kv_status gl_take_packed(kv_gpu_engine *e, const kv_prefix *pre, bool *any)
{
    *any = false;
    for (int l = 0; l < e->L; l++) e->lay[l].load_from = NULL;
    if (!pre || !pre->f) return KV_OK;
    for (int l = 0; l < e->L; l++) {
        gl_layer *y = &e->lay[l];
        bool packed = false;
        kv_policy_params pp;
        TRY(kv_prefix_layer_packed(pre, l, &packed, &pp));
        if (!packed) continue;
        if (y->pl == &gl_offload)
            return kv_fail(KV_E_UNSUPPORTED, "layer %d is packed in the cache (%s) and offloaded by the policy: "
                           "the GPU engine holds a packed layer on the GPU (drop offload=on for it)",
                           l, kv_policy_kind_name(pp.kind));
        pp.dtype = y->prm.dtype; /* as the CPU engine's load_packed */
        const kv_policy_geom lg = {l, e->nqh, e->nkv, e->hd, e->ctx};
        TRY(kv_policy_check(&pp, &lg, KV_DEVICE_CUDA));
        const gl_placement *pl = gl_placement_for(pp.kind);
        if (!pl) return kv_fail(KV_E_UNSUPPORTED, "layer %d: no GPU placement holds a %s layer", l, kv_policy_kind_name(pp.kind));
        /* the device is idle (a fresh or reset engine): release, then the file's policy */
        if (y->st && y->pl && y->pl->release) y->pl->release(y);
        free(y->st);
        y->st = NULL;
        y->prm = pp;
        y->pl = pl;
        TRY(y->pl->configure(e, y));
        if (!y->pl->load)
            return kv_fail(KV_E_UNSUPPORTED, "layer %d: the GPU placement %s cannot load packed data", l, y->pl->name);
        TRY(y->pl->alloc(e, y));
        y->load_from = pre;
        *any = true;
    }
    if (*any) CK(cudaDeviceSynchronize()); /* the allocations' memsets are on the legacy stream */
    return KV_OK;
}

bool gl_can_clear(const kv_gpu_engine *e)
{
    for (int l = 0; l < e->L; l++)
        if (!e->lay[l].st || !e->lay[l].pl->clear) return false;
    return true;
}

// --- accessors ---------------------------------------------------------------------------

const kv_policy_params *kv_gpu_engine_layer_params(const kv_gpu_engine *e, int layer)
{
    return layer >= 0 && layer < e->L ? &e->lay[layer].prm : NULL;
}

void kv_gpu_engine_prefill_phases(const kv_gpu_engine *e, kv_gpu_prefill_phases *out) { *out = e->ph; }

#endif /* KV_HAVE_CUDA */
