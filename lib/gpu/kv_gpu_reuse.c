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

#include "common/kv_status.h"

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
    const size_t xrows = (size_t)nn + KV_GPU_PREFILL_PAD; /* the last chunk's padded rows (kv_pf_ws.pad) */
    bool regrow = xrows * e->ld_dim > e->pfb.X_n || kvn > e->pfb.kv_n || tmp_n > e->pfb.tmp_n ||
                  (size_t)nn > e->pfb.dt_n || !e->pfb.ws.base || C > e->pfb.ws.C || g->packed != e->pfb.ws_packed;
    /* a buffer freed here may still be read by work issued before the call */
    if (regrow) CK(cudaDeviceSynchronize());
    TRY(grow(&e->pfb.X, &e->pfb.X_n, xrows * e->ld_dim, 4, "prefill residual stream"));
    TRY(gl_grow_kv(&e->pfb.K, &e->pfb.V, &e->pfb.kv_n, kvn, kvn + kvn / 8, "prefill K", "prefill V"));
    TRY(grow(&e->pfb.tmp, &e->pfb.tmp_n, tmp_n, 2, "ingest scratch"));
    TRY(grow(&e->pfb.dt, &e->pfb.dt_n, (size_t)nn, sizeof(int), "prompt tokens"));
    if (!e->pfb.ws.base || C > e->pfb.ws.C || g->packed != e->pfb.ws_packed) {
        /* chunk rows with 1/8 to spare as above, up to the engine's chunk,
         * and rounded up to the products' row granule */
        const int C0 = e->o.prefill_chunk > 0 ? e->o.prefill_chunk : KV_GPU_PREFILL_CHUNK;
        int Cw = C + C / 8;
        if (Cw > C0 && C <= C0) Cw = C0;
        Cw = (Cw + KV_GPU_PREFILL_PAD - 1) / KV_GPU_PREFILL_PAD * KV_GPU_PREFILL_PAD;
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
    size_t bytes = e->pfb.X_n * 4 + 2 * (e->pfb.kv_n + e->pfb.kv2_n) * 2 + e->pfb.tmp_n * 2 +
                   e->pfb.dt_n * sizeof(int) + e->pfb.ws_bytes;
    if (!all && bytes <= e->pf_keep) return;
    gl_dfree(&e->pfb.X);
    gl_dfree(&e->pfb.K);
    gl_dfree(&e->pfb.V);
    gl_dfree(&e->pfb.K2);
    gl_dfree(&e->pfb.V2);
    gl_dfree(&e->pfb.tmp);
    gl_dfree(&e->pfb.dt);
    kv_gpu_prefill_ws_free(&e->pfb.ws);
    e->pfb.X_n = e->pfb.kv_n = e->pfb.kv2_n = e->pfb.tmp_n = e->pfb.dt_n = 0;
    e->pfb.ws_packed = 0;
    e->pfb.ws_bytes = 0;
    if (all) {
        gl_hfree(&e->pfb.qpin);
        e->pfb.qpin_n = 0;
        for (int i = 0; i < 2; i++) {
            if (e->pfb.ev_up[i]) cudaEventDestroy(e->pfb.ev_up[i]);
            if (e->pfb.ev_free[i]) cudaEventDestroy(e->pfb.ev_free[i]);
            if (e->pfb.ev_span[i]) cudaEventDestroy(e->pfb.ev_span[i]);
            e->pfb.ev_up[i] = e->pfb.ev_free[i] = e->pfb.ev_span[i] = NULL;
        }
        if (e->pfb.s_up) cudaStreamDestroy(e->pfb.s_up);
        e->pfb.s_up = NULL;
    }
}

// --- a continued prefill's cached rows ---------------------------------------------------

kv_status gl_put_prefix_rows(kv_gpu_engine *e, const kv_prefix *pre, int l, uint16_t *K, uint16_t *V, int ld,
                             uint16_t *stage, cudaStream_t s)
{
    const int P = pre->T, hd = e->hd;
    const size_t rb = (size_t)hd * 2;
    /* rows still being read (kv_tree_store_load_start): this layer's first; the
     * host thread waits here while the GPU runs the layers already issued */
    TRY(kv_prefix_wait(pre, l));
    if (pre->device || (!pre->f && pre->dt == KV_DT_F16)) {
        /* fp16 rows on this GPU, or fp16 rows in host memory (copied straight,
         * at full speed when the caller pinned them): one block of rows, or
         * the segments one after the other */
        const enum cudaMemcpyKind kind = pre->device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
        kv_prefix_seg one = {P, pre->ld, pre->k, pre->v};
        const kv_prefix_seg *sg = pre->nseg ? pre->seg : &one;
        size_t t0 = 0;
        for (int i = 0; i < (pre->nseg ? pre->nseg : 1); i++) {
            const size_t pitch = (size_t)(sg[i].ld ? sg[i].ld : sg[i].T) * rb;
            CK(cudaMemcpy2DAsync(K + t0 * hd, (size_t)ld * rb, sg[i].k[l], pitch, (size_t)sg[i].T * rb,
                                 e->nkv, kind, s));
            CK(cudaMemcpy2DAsync(V + t0 * hd, (size_t)ld * rb, sg[i].v[l], pitch, (size_t)sg[i].T * rb,
                                 e->nkv, kind, s));
            t0 += (size_t)sg[i].T;
        }
        return KV_OK;
    }
    /* the staging is reused layer after layer: the previous copy must be done */
    CK(cudaStreamSynchronize(s));
    TRY(kv_prefix_rows_f16(pre, l, 'k', stage));
    TRY(kv_prefix_rows_f16(pre, l, 'v', stage + (size_t)e->nkv * P * hd));
    CK(cudaMemcpy2DAsync(K, (size_t)ld * rb, stage, (size_t)P * rb, (size_t)P * rb, e->nkv,
                         cudaMemcpyHostToDevice, s));
    CK(cudaMemcpy2DAsync(V, (size_t)ld * rb, stage + (size_t)e->nkv * P * hd, (size_t)P * rb,
                         (size_t)P * rb, e->nkv, cudaMemcpyHostToDevice, s));
    return KV_OK;
}


bool gl_pf_overlap_ok(const kv_gpu_engine *e, const kv_prefix *pre)
{
    if (!pre || pre->T < 1 || !(pre->device || (!pre->f && pre->dt == KV_DT_F16)) || e->o.prefill_copy_sync)
        return false;
    for (int l = 0; l < e->L; l++)
        if (e->lay[l].pl != &gl_full || e->lay[l].load_from) return false;
    return e->L > 1;
}

kv_status gl_pf_overlap_begin(kv_gpu_engine *e, int rows, bool *ready)
{
    *ready = false;
    const size_t kvn = (size_t)e->nkv * (size_t)rows * (size_t)e->hd;
    if (kvn > e->pfb.kv2_n) {
        CK(cudaDeviceSynchronize()); /* the pair may still be read by earlier work */
        if (gl_grow_kv(&e->pfb.K2, &e->pfb.V2, &e->pfb.kv2_n, kvn, kvn + kvn / 8, "prefill K (second)",
                       "prefill V (second)")) { /* no room: the serial path needs none */
            gl_dfree(&e->pfb.K2);
            gl_dfree(&e->pfb.V2);
            e->pfb.kv2_n = 0;
            kv_errclear();
            return KV_OK;
        }
    }
    if (!e->pfb.s_up) { /* all seven handles or none; the last two timed */
        cudaEvent_t ev[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
        cudaStream_t su = NULL;
        bool ok = true;
        for (int i = 0; i < 6 && ok; i++)
            ok = cudaEventCreateWithFlags(&ev[i], i < 4 ? cudaEventDisableTiming : cudaEventDefault) == cudaSuccess;
        ok = ok && cudaStreamCreateWithFlags(&su, cudaStreamNonBlocking) == cudaSuccess;
        if (!ok) {
            for (int i = 0; i < 6; i++)
                if (ev[i]) cudaEventDestroy(ev[i]);
            (void)cudaGetLastError();
            return KV_OK;
        }
        e->pfb.ev_up[0] = ev[0], e->pfb.ev_up[1] = ev[1], e->pfb.ev_free[0] = ev[2], e->pfb.ev_free[1] = ev[3];
        e->pfb.ev_span[0] = ev[4], e->pfb.ev_span[1] = ev[5];
        e->pfb.s_up = su;
    }
    *ready = true;
    return KV_OK;
}

/* Layer l's rows into pair b on the upload stream, once that pair's last
 * reader is done (ev_free[b], recorded by the caller before the uploads of
 * layers 1 and up; at layer 0 it is unrecorded or left complete by an
 * earlier prefill, and the wait passes). */
static kv_status pf_upload(kv_gpu_engine *e, const kv_prefix *pre, int l, uint16_t *K, uint16_t *V, int ld)
{
    const int b = l & 1;
    CK(cudaStreamWaitEvent(e->pfb.s_up, e->pfb.ev_free[b], 0));
    if (l == 0) CK(cudaEventRecord(e->pfb.ev_span[0], e->pfb.s_up));
    TRY(gl_put_prefix_rows(e, pre, l, K, V, ld, NULL, e->pfb.s_up));
    CK(cudaEventRecord(e->pfb.ev_up[b], e->pfb.s_up));
    if (l == e->L - 1) CK(cudaEventRecord(e->pfb.ev_span[1], e->pfb.s_up));
    return KV_OK;
}

kv_status gl_pf_overlap_layer(kv_gpu_engine *e, const kv_prefix *pre, int l, uint16_t *const K[2],
                              uint16_t *const V[2], int ld, cudaStream_t s)
{
    if (l == 0) TRY(pf_upload(e, pre, 0, K[0], V[0], ld));
    /* layer l - 1 read pair (l + 1) & 1 last: its chunks and its ingest (a
     * copy on this stream, gl_pf_overlap_ok) are queued before this point;
     * layer l + 1's upload (gl_pf_overlap_next) waits for this record */
    if (l + 1 < e->L) CK(cudaEventRecord(e->pfb.ev_free[(l + 1) & 1], s));
    CK(cudaStreamWaitEvent(s, e->pfb.ev_up[l & 1], 0));
    return KV_OK;
}

kv_status gl_pf_overlap_next(kv_gpu_engine *e, const kv_prefix *pre, int l, uint16_t *const K[2],
                             uint16_t *const V[2], int ld)
{
    if (l + 1 >= e->L) return KV_OK;
    const int b = (l + 1) & 1;
    return pf_upload(e, pre, l + 1, K[b], V[b], ld);
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

void gl_pf_overlap_span(kv_gpu_engine *e, const kv_prefix *pre)
{
    float ms = 0;
    e->ph.upload = e->ph.upload_bytes = 0;
    if (!e->ph.rows_ahead || !e->pfb.ev_span[0]) return;
    if (cudaEventElapsedTime(&ms, e->pfb.ev_span[0], e->pfb.ev_span[1]) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    e->ph.upload = ms;
    e->ph.upload_bytes = 2.0 * e->L * e->nkv * (double)pre->T * e->hd * 2;
}

#endif /* KV_HAVE_CUDA */
