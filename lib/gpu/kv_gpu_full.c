/*
 * Placements `full` and `offload` of the GPU engine (kv_gpu_int.h).  full
 * keeps the layer's fp16 K/V on the GPU and attends over all of it.
 * offload (full with offload=on, the baseline the hybrid is measured
 * against) keeps them in pinned host memory: each step, the copy stream
 * brings every offloaded layer's K/V into one of two staging buffers two
 * layers ahead of the layer loop, and the new token's row goes back to host
 * memory after the layer's RoPE.
 */
#include "gpu/kv_gpu_int.h"

#ifdef KV_HAVE_CUDA

typedef struct {
    uint16_t *k, *v; /* (nkv, ctx, hd) device */
} full_state;

typedef struct {
    uint16_t *hk, *hv; /* (nkv, ctx, hd) pinned host */
    int idx;           /* its place among the offloaded layers */
} offload_state;

static kv_status full_configure(kv_gpu_engine *e, gl_layer *y)
{
    (void)e;
    y->pl = y->prm.offload ? &gl_offload : &gl_full;
    return KV_OK;
}

// --- full ----------------------------------------------------------------------------

static kv_status full_alloc(kv_gpu_engine *e, gl_layer *y)
{
    TRY(gl_state_new(y, sizeof(full_state)));
    full_state *f = y->st;
    size_t row = (size_t)e->nkv * e->ctx * e->hd * 2;
    TRY(gl_dalloc(&f->k, row, "full K cache"));
    TRY(gl_dalloc(&f->v, row, "full V cache"));
    return KV_OK;
}

static kv_status full_ingest(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V,
                             int ld, int T, uint16_t *tmp)
{
    (void)tmp;
    full_state *f = y->st;
    const size_t rb = (size_t)e->hd * 2, pitch_ctx = (size_t)e->ctx * rb;
    CK(cudaMemcpy2DAsync(f->k, pitch_ctx, K, (size_t)ld * rb, (size_t)T * rb, e->nkv,
                         cudaMemcpyDeviceToDevice, e->s_main));
    CK(cudaMemcpy2DAsync(f->v, pitch_ctx, V, (size_t)ld * rb, (size_t)T * rb, e->nkv,
                         cudaMemcpyDeviceToDevice, e->s_main));
    return KV_OK;
}

static kv_status full_slot(kv_gpu_engine *e, gl_layer *y, int pos, gl_row *r)
{
    full_state *f = y->st;
    r->k = f->k + (size_t)pos * e->hd;
    r->v = f->v + (size_t)pos * e->hd;
    r->hs = (size_t)e->ctx * e->hd;
    return KV_OK;
}

static kv_status full_attend(kv_gpu_engine *e, gl_layer *y, int pos, const float *q,
                             const gl_row *r)
{
    (void)q;
    (void)r;
    full_state *f = y->st;
    return gl_attend_dense(e, f->k, f->v, (size_t)e->ctx * e->hd, pos + 1, e->s_main);
}

static void full_bytes(const kv_gpu_engine *e, const gl_layer *y, kv_bytes *b)
{
    b->resident = 2 * (uint64_t)e->nkv * (uint64_t)y->T * (uint64_t)e->hd * 2;
}

static void full_release(gl_layer *y)
{
    full_state *f = y->st;
    gl_dfree(&f->k);
    gl_dfree(&f->v);
}

/* Nothing to forget: the cache is overwritten by the next ingest, and
 * attention reads only the rows held. */
static void full_clear(kv_gpu_engine *e, gl_layer *y)
{
    (void)e, (void)y;
}

const gl_placement gl_full = {
    .name = "full",
    .configure = full_configure,
    .alloc = full_alloc,
    .ingest = full_ingest,
    .slot = full_slot,
    .attend = full_attend,
    .bytes = full_bytes,
    .release = full_release,
    .clear = full_clear,
};

// --- offload ---------------------------------------------------------------------------

static kv_status offload_alloc(kv_gpu_engine *e, gl_layer *y)
{
    TRY(gl_state_new(y, sizeof(offload_state)));
    offload_state *o = y->st;
    size_t row = (size_t)e->nkv * e->ctx * e->hd * 2;
    TRY(gl_halloc(&o->hk, NULL, row, "offloaded K"));
    TRY(gl_halloc(&o->hv, NULL, row, "offloaded V"));
    o->idx = e->off.n;
    e->off.list[e->off.n++] = y->l;
    if (!e->off.stage_k[0]) /* staging, shared by the offloaded layers */
        for (int i = 0; i < 2; i++) {
            TRY(gl_dalloc(&e->off.stage_k[i], row, "offload staging"));
            TRY(gl_dalloc(&e->off.stage_v[i], row, "offload staging"));
        }
    return KV_OK;
}

static kv_status offload_ingest(kv_gpu_engine *e, gl_layer *y, const uint16_t *K,
                                const uint16_t *V, int ld, int T, uint16_t *tmp)
{
    (void)tmp;
    offload_state *o = y->st;
    const size_t rb = (size_t)e->hd * 2, pitch_ctx = (size_t)e->ctx * rb;
    CK(cudaMemcpy2DAsync(o->hk, pitch_ctx, K, (size_t)ld * rb, (size_t)T * rb, e->nkv,
                         cudaMemcpyDeviceToHost, e->s_main));
    CK(cudaMemcpy2DAsync(o->hv, pitch_ctx, V, (size_t)ld * rb, (size_t)T * rb, e->nkv,
                         cudaMemcpyDeviceToHost, e->s_main));
    return KV_OK;
}

/* Copy the j-th offloaded layer's T tokens into staging buffer j & 1 on the
 * copy stream once the buffer's last reader is done. */
static kv_status offload_issue(kv_gpu_engine *e, int j)
{
    int l = e->off.list[j], b = j & 1;
    gl_layer *y = &e->lay[l];
    offload_state *o = y->st;
    const size_t rb = (size_t)e->hd * 2, pitch = (size_t)e->ctx * rb;
    const int T = e->pos;
    CK(cudaStreamWaitEvent(e->s_copy, e->off.ev_done[b], 0));
    if (e->o.profile) CK(cudaEventRecord(e->ev_p0[l], e->s_copy));
    if (T > 0) { /* gl_memcpy_2d: row by row inside a graph capture (updatable in place) */
        TRY(gl_memcpy_2d(e, e->off.stage_k[b], pitch, o->hk, pitch, (size_t)T * rb, e->nkv,
                         cudaMemcpyHostToDevice, e->s_copy));
        TRY(gl_memcpy_2d(e, e->off.stage_v[b], pitch, o->hv, pitch, (size_t)T * rb, e->nkv,
                         cudaMemcpyHostToDevice, e->s_copy));
    }
    if (e->o.profile) CK(cudaEventRecord(e->ev_p1[l], e->s_copy));
    CK(cudaEventRecord(e->off.ev_copied[l], e->s_copy));
    y->fetched_last = (uint64_t)2 * e->nkv * T * rb;
    y->fetched_total += y->fetched_last;
    return KV_OK;
}

/* The first two offloaded layers' copies start with the step. */
static kv_status offload_step_begin(kv_gpu_engine *e, gl_layer *y)
{
    offload_state *o = y->st;
    return o->idx < 2 ? offload_issue(e, o->idx) : KV_OK;
}

static kv_status offload_slot(kv_gpu_engine *e, gl_layer *y, int pos, gl_row *r)
{
    int b = e->off.next & 1;
    CK(cudaStreamWaitEvent(e->s_main, e->off.ev_copied[y->l], 0));
    r->k = e->off.stage_k[b] + (size_t)pos * e->hd;
    r->v = e->off.stage_v[b] + (size_t)pos * e->hd;
    r->hs = (size_t)e->ctx * e->hd;
    return KV_OK;
}

static kv_status offload_attend(kv_gpu_engine *e, gl_layer *y, int pos, const float *q,
                                const gl_row *r)
{
    (void)q;
    offload_state *o = y->st;
    cudaStream_t s = e->s_main;
    const int hd = e->hd, b = e->off.next & 1;
    /* the new row goes back to host memory before the next step's copy */
    const size_t rb = (size_t)hd * 2, pitch = (size_t)e->ctx * rb;
    CK(cudaEventRecord(e->off.ev_rope, s));
    CK(cudaStreamWaitEvent(e->s_copy, e->off.ev_rope, 0));
    TRY(gl_memcpy_2d(e, o->hk + (size_t)pos * hd, pitch, r->k, pitch, rb, e->nkv,
                     cudaMemcpyDeviceToHost, e->s_copy));
    TRY(gl_memcpy_2d(e, o->hv + (size_t)pos * hd, pitch, r->v, pitch, rb, e->nkv,
                     cudaMemcpyDeviceToHost, e->s_copy));
    TRY(gl_attend_dense(e, e->off.stage_k[b], e->off.stage_v[b], (size_t)e->ctx * hd, pos + 1, s));
    CK(cudaEventRecord(e->off.ev_done[b], s));
    if (e->off.next + 2 < e->off.n) TRY(offload_issue(e, e->off.next + 2));
    e->off.next++;
    return KV_OK;
}

static void offload_bytes(const kv_gpu_engine *e, const gl_layer *y, kv_bytes *b)
{
    b->host = 2 * (uint64_t)e->nkv * (uint64_t)y->T * (uint64_t)e->hd * 2;
}

static void offload_timing(const kv_gpu_engine *e, const gl_layer *y, kv_gpu_timing *t)
{
    float ms = gl_elapsed(e->ev_p0[y->l], e->ev_p1[y->l]);
    t->copy_ms += ms;
    t->fetch_ms += ms;
}

static void offload_release(gl_layer *y)
{
    offload_state *o = y->st;
    gl_hfree(&o->hk);
    gl_hfree(&o->hv);
}

const gl_placement gl_offload = {
    .name = "offload",
    .configure = full_configure,
    .alloc = offload_alloc,
    .ingest = offload_ingest,
    .step_begin = offload_step_begin,
    .slot = offload_slot,
    .attend = offload_attend,
    .bytes = offload_bytes,
    .timing = offload_timing,
    .release = offload_release,
};

#endif /* KV_HAVE_CUDA */
