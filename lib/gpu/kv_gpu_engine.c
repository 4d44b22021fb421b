/*
 * kv_gpu_engine: the decode engine on a CUDA GPU (see kv_gpu_engine.h), its
 * core.  The layer loop is lib/engine/kv_engine.c's on the main stream,
 * with the RMSNorms and the SwiGLU fused into the GEMVs that consume them
 * and the residual adds into the GEMVs that produce them; what differs per
 * layer is where its K/V live and how attention reaches them, and that is
 * the layer's placement (kv_gpu_int.h: one file per placement behind one
 * table, as the CPU policies are behind kv_policy_ops).  Two more streams
 * carry the work that should hide behind the layer loop: the selection
 * streams (a sparse layer's predicted query, token scores, top-K and the
 * gather of the chosen rows from pinned host memory, one layer ahead) and
 * the copy stream (the offload baseline's per-layer K/V copies, two layers
 * ahead, double-buffered).  Events order the streams; the host never waits
 * inside a step.
 *
 * A prefill runs the same loop one token at a time over a dense fp16 prompt
 * cache (prefill_cache), then hands each layer the prompt's K/V through its
 * placement's ingest; a chunked prefill can replace that loop and keep the
 * hand-off.  A CPU-only build gets kv_gpu_stub.c instead of this file.
 */
#include "gpu/kv_gpu_engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kv_gpu_engine_opts_default(kv_gpu_engine_opts *o)
{
    memset(o, 0, sizeof *o);
    o->device = 0;
    o->wtype = KV_DT_AUTO;
    o->pdl = KV_GPU_PDL_AUTO;
}

#ifdef KV_HAVE_CUDA

#include "common/kv_finite.h"
#include "gpu/kv_gpu_int.h"
#include "gpu/kv_cublas.h"
#include "gpu/kv_gpu_prefill.h"
#include "prefill_ops.h"
#include "model/kv_model.h"

// --- memory ----------------------------------------------------------------------

kv_status gl_dalloc(void *pp, size_t bytes, const char *what)
{
    void **p = (void **)pp;
    *p = NULL;
    if (!bytes) return KV_OK;
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *p = NULL;
        return kv_fail(KV_E_NOMEM, "GPU out of memory: %s needs %.1f MiB (%s)", what,
                       (double)bytes / 1048576.0, cudaGetErrorString(e));
    }
    return KV_OK;
}

void gl_dfree(void *pp)
{
    void **p = (void **)pp;
    if (*p) cudaFree(*p);
    *p = NULL;
}

kv_status gl_grow_kv(void *pk, void *pv, size_t *have, size_t need, size_t n, const char *what_k,
                     const char *what_v)
{
    if (need <= *have) return KV_OK;
    gl_dfree(pk);
    gl_dfree(pv);
    *have = 0;
    TRY(gl_dalloc(pk, n * 2, what_k));
    TRY(gl_dalloc(pv, n * 2, what_v));
    *have = n;
    return KV_OK;
}

kv_status gl_halloc(void *pp, const void **dev, size_t bytes, const char *what)
{
    void **p = (void **)pp;
    *p = NULL;
    if (dev) *dev = NULL;
    if (!bytes) return KV_OK;
    cudaError_t e = cudaHostAlloc(p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *p = NULL;
        return kv_fail(KV_E_NOMEM, "cannot pin %.1f MiB of host memory for %s (%s)",
                       (double)bytes / 1048576.0, what, cudaGetErrorString(e));
    }
    if (dev) {
        void *d = NULL;
        e = cudaHostGetDevicePointer(&d, *p, 0);
        if (e != cudaSuccess) {
            cudaFreeHost(*p);
            *p = NULL;
            return kv_cuda_fail(e, "cudaHostGetDevicePointer(&d, *p, 0)", __FILE__, __LINE__);
        }
        *dev = d;
    }
    return KV_OK;
}

void gl_hfree(void *pp)
{
    void **p = (void **)pp;
    if (*p) cudaFreeHost(*p);
    *p = NULL;
}

kv_status gl_grow_i32(int **p, size_t *cap, size_t n, const char *what)
{
    if (n <= *cap) return KV_OK;
    CK(cudaDeviceSynchronize());
    gl_dfree(p);
    *cap = 0;
    TRY(gl_dalloc(p, n * sizeof(int), what));
    *cap = n;
    return KV_OK;
}

kv_status gl_h2d_sync(kv_gpu_engine *e, void *dst, const void *src, size_t n)
{
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, e->s_main));
    CK(cudaStreamSynchronize(e->s_main));
    return KV_OK;
}

kv_status gl_state_new(gl_layer *y, size_t n)
{
    y->st = calloc(1, n);
    return y->st ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory");
}

// --- helpers for the placements ------------------------------------------------------

bool gl_wants_pred(const kv_gpu_engine *e, int l)
{
    return l >= 1 && e->lay[l].pl->select && e->lay[l].prm.predict;
}

kv_status gl_ensure_ws(kv_gpu_engine *e, size_t bytes)
{
    if (bytes <= e->ws_bytes) return KV_OK;
    /* geometric growth: a long decode from a short context grows the split
     * count step by step, and a capture may retire only a few workspaces */
    if (bytes < 2 * e->ws_bytes) bytes = 2 * e->ws_bytes;
    if (e->gr.capturing) return gl_graph_grow_ws(e, bytes); /* no synchronising in a capture */
    CK(cudaDeviceSynchronize());
    gl_dfree(&e->ws);
    e->ws_bytes = 0;
    TRY(gl_dalloc(&e->ws, bytes, "attention workspace"));
    e->ws_bytes = bytes;
    return KV_OK;
}

/* The one fp16 attention (kernels/attn_f16.cu) serves every geometry the
 * engine accepts (head_dim a power of two 8..256, query groups up to 8),
 * with the fp16 query at head_dim 64 and 128 and groups of 1, 2, 4, 8 (the
 * measured decode path) and the float32 one elsewhere (e->q_f32), as the
 * engine's former second attention kernel took it there. */
kv_status gl_attend_dense(kv_gpu_engine *e, const uint16_t *K, const uint16_t *V,
                          size_t head_stride, int n, cudaStream_t s)
{
    kv_attn_dims d = {e->nqh, e->nkv, e->hd, n, (long long)head_stride, e->scale};
    if (e->q_f32) {
        TRY(gl_ensure_ws(e, kv_cuda_attn_f16_q32_workspace(&d)));
        CK(kv_cuda_attn_f16_q32(&d, e->qkv, K, V, e->att, e->ws, e->ws_bytes, s));
    } else {
        TRY(gl_ensure_ws(e, kv_cuda_attn_f16_workspace(&d)));
        CK(kv_cuda_attn_f16(&d, e->q16, K, V, e->att, e->ws, e->ws_bytes, s));
    }
    return KV_OK;
}

float gl_elapsed(cudaEvent_t a, cudaEvent_t b)
{
    float ms = 0;
    if (cudaEventElapsedTime(&ms, a, b) != cudaSuccess) {
        (void)cudaGetLastError();
        ms = 0;
    }
    return ms;
}

// --- placements: the registry ---------------------------------------------------------

const gl_placement *gl_placement_for(kv_policy_kind k)
{
    static const gl_placement *const by_kind[KV_POL_COUNT] = {
        [KV_POL_FULL] = &gl_full,
        [KV_POL_QUANT] = &gl_quant,
        [KV_POL_SPARSE] = &gl_sparse,
        [KV_POL_STREAMING] = &gl_streaming,
        [KV_POL_DSQ] = &gl_dsq,
    };
    return (unsigned)k < KV_POL_COUNT ? by_kind[k] : NULL;
}

static void layer_release(gl_layer *y)
{
    if (y->st && y->pl && y->pl->release) y->pl->release(y);
    free(y->st);
    y->st = NULL;
    y->T = 0;
    y->fetched_last = y->fetched_total = y->attends = 0;
}

static void release_all(kv_gpu_engine *e)
{
    if (!e->lay) return;
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    gl_graph_reset(e); /* executable graphs hold the layers' pointers */
    for (int l = 0; l < e->L; l++) layer_release(&e->lay[l]);
    gl_cap_clear(e); /* the settings (cap.nq, cap.kv) stay */
    for (int i = 0; i < 2; i++) { /* sized for this configuration's offloaded layers */
        gl_dfree(&e->off.stage_k[i]);
        gl_dfree(&e->off.stage_v[i]);
    }
    e->off.n = 0;
    e->pos = 0;
    e->rope_off = 0;
}

/* Check each layer's params and settle its placement (no allocation yet). */
static kv_status set_policies(kv_gpu_engine *e, const kv_policy_params *per_layer)
{
    for (int l = 0; l < e->L; l++) {
        gl_layer *y = &e->lay[l];
        if (per_layer) y->prm = per_layer[l];
        y->l = l;
        const kv_policy_geom lg = {l, e->nqh, e->nkv, e->hd, e->ctx};
        TRY(kv_policy_check(&y->prm, &lg, KV_DEVICE_CUDA)); /* the one check, as the CPU's */
        y->pl = gl_placement_for(y->prm.kind);
        if (!y->pl)
            return kv_fail(KV_E_UNSUPPORTED, "layer %d: policy %s is not available on the GPU "
                           "engine", l, kv_policy_kind_name(y->prm.kind));
        TRY(y->pl->configure(e, y));
    }
    e->off.n = 0;
    return KV_OK;
}

/* Allocations that do not depend on the prompt (done at reset). */
static kv_status alloc_layers(kv_gpu_engine *e)
{
    for (int l = 0; l < e->L; l++) TRY(e->lay[l].pl->alloc(e, &e->lay[l]));
    /* the memsets of the allocations run on the legacy stream, which does
     * not order with the engine's non-blocking streams */
    CK(cudaDeviceSynchronize());
    return KV_OK;
}

/* Hand layer l the first T tokens of dense fp16 K/V (nkv, ld, hd) on the
 * device.  tmp: device scratch (gl_placement.ingest).  sync: wait for the
 * main stream after it.  Every placement's device work on tmp and K/V is on
 * the main stream (or ordered after it by events), and one that reads back
 * to the host waits itself, so the chunked prefill does not wait here: the
 * host runs ahead, and what it does for the next layer (pinning a sparse
 * layer's host rows) overlaps the GPU's work; that prefill synchronises the
 * device once at its end. */
static kv_status ingest(kv_gpu_engine *e, int l, const uint16_t *K, const uint16_t *V, int ld,
                        int T, uint16_t *tmp, bool sync)
{
    gl_layer *y = &e->lay[l];
    y->T = T;
    y->fetched_last = y->fetched_total = y->attends = 0;
    if (y->load_from) TRY(y->pl->load(e, y, K, V, ld, T, tmp)); /* packed in the file: held as packed */
    else TRY(y->pl->ingest(e, y, K, V, ld, T, tmp));
    if (sync) CK(cudaStreamSynchronize(e->s_main));
    return KV_OK;
}

/* Scratch fp16 values an ingest of T tokens needs. */
static size_t ingest_scratch(const kv_gpu_engine *e, int T)
{
    size_t need = (size_t)2 * e->nkv * T * e->hd;
    size_t cm = (size_t)e->nkv * e->hd * gl_pad8(T);
    return need > cm ? need : cm;
}

// --- the forward pass --------------------------------------------------------------

typedef struct {
    uint16_t **k, **v; /* (L) each (nkv, n, hd) dense prompt cache */
    int n;
} prefill_cache;

/* Layer l + 1's query, predicted from the residual stream before layer l,
 * and its token selection, on the selection streams. */
kv_status gl_predict_ahead(kv_gpu_engine *e, int l)
{
    gl_layer *y = &e->lay[l];
    float *xp = e->xp[l % 3];
    /* opts.sel_serial: the same work on the main stream, where it is issued */
    cudaStream_t ss = e->o.sel_serial ? e->s_main : e->s_side;
    cudaStream_t sg = e->o.sel_serial ? e->s_main : e->s_gath;
    CK(eng_rmsnorm(e->x, e->w[l].attn_norm, e->dim, e->eps, xp, e->s_main));
    CK(cudaEventRecord(e->ev_x[l], e->s_main));
    if (ss != e->s_main) CK(cudaStreamWaitEvent(ss, e->ev_x[l], 0));
    if (e->o.profile) CK(cudaEventRecord(e->ev_p0[l], ss));
    if (!(e->o.sel_skip & KV_GPU_SKIP_QUERY)) TRY(gl_q_only(e, l, xp, e->qpred, ss));
    CK(eng_rope_store(e->qpred, NULL, e->nqh, NULL, NULL, 0, e->hd, e->inv_freq, e->pos + e->rope_off, NULL,
                      NULL, 0, ss));
    TRY(y->pl->select(e, y, e->qpred, ss, sg));
    if (e->o.profile) CK(cudaEventRecord(e->ev_p1[l], sg));
    CK(cudaEventRecord(e->ev_sel[l], sg));
    e->sel.side_last = l;
    return KV_OK;
}

/* At the start of layer l: the predicted layers' selections to issue now,
 * each opts.sel_ahead (1 or 2) layers ahead (at layer 0 also the nearer
 * ones). */
kv_status gl_predict_from(kv_gpu_engine *e, int l)
{
    const int d = e->o.sel_ahead >= 2 ? 2 : 1;
    for (int t = l == 0 ? 1 : l + d; t <= l + d && t < e->L; t++)
        if (gl_wants_pred(e, t)) TRY(gl_predict_ahead(e, t));
    return KV_OK;
}

/*
 * One token through every layer at position e->pos; the input id is read on
 * the device from dtok.  With pf, every layer attends densely over the
 * prompt cache (prefill); otherwise through its placement.
 */
static kv_status forward(kv_gpu_engine *e, const int *dtok, bool want_logits,
                         const prefill_cache *pf)
{
    const int pos = e->pos, hd = e->hd, nkv = e->nkv;
    cudaStream_t s = e->s_main;
    TRY(gl_embed(e, dtok, s));
    e->sel.side_last = -1;
    e->off.next = 0;
    for (int l = 0; !pf && l < e->L; l++)
        if (e->lay[l].pl->step_begin) TRY(e->lay[l].pl->step_begin(e, &e->lay[l]));
    for (int l = 0; l < e->L; l++) {
        gl_layer *y = &e->lay[l];
        /* one (or two) layers ahead: a later layer's query and token selection */
        if (!pf) TRY(gl_predict_from(e, l));
        TRY(gl_qkv(e, l, s));
        float *q = e->qkv, *k = q + e->qd, *v = k + e->kvd;
        gl_row r;
        if (pf) {
            r.k = pf->k[l] + (size_t)pos * hd;
            r.v = pf->v[l] + (size_t)pos * hd;
            r.hs = (size_t)pf->n * hd;
        } else {
            TRY(y->pl->slot(e, y, pos, &r));
        }
        CK(eng_rope_store(q, e->q16, e->nqh, k, v, nkv, hd, e->inv_freq, pos + e->rope_off, r.k, r.v,
                          r.hs, s));
        if (pf) {
            TRY(gl_cap_queries(e, l, pos, 1, pf->n, e->q16, (size_t)e->qd, s));
            if (y->pl->observe) TRY(y->pl->observe(e, y, q, pos, pf->n));
            TRY(gl_attend_dense(e, pf->k[l], pf->v[l], (size_t)pf->n * hd, pos + 1, s));
        } else {
            TRY(y->pl->attend(e, y, pos, q, &r));
            y->T = pos + 1;
            y->attends++;
        }
        TRY(gl_attn_out(e, l, s));
        TRY(gl_ffn(e, l, s));
    }
    if (want_logits) TRY(gl_logits(e, s));
    return KV_OK;
}

kv_status gl_decode_forward(kv_gpu_engine *e, const int *dtok, bool want_logits)
{
    return forward(e, dtok, want_logits, NULL);
}

// --- construction ---------------------------------------------------------------------

/* Programmatic dependent launch (kernels/kv_kernels.h): level 2 on Hopper
 * unless opts ask for less; never below compute capability 9.0. */
static void apply_pdl(const kv_gpu_engine *e, int major)
{
    int level = e->o.pdl == KV_GPU_PDL_AUTO ? 2 : e->o.pdl;
    kv_cuda_set_pdl(major < 9 ? 0 : level);
}

static kv_status engine_init(kv_gpu_engine *e)
{
    const kv_model_config *c = &e->m->cfg;
    int count = 0;
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count <= 0) {
        (void)cudaGetLastError();
        return kv_fail(KV_E_UNAVAILABLE, "no usable CUDA device (%s)",
                       ce != cudaSuccess ? cudaGetErrorString(ce) : "none found");
    }
    if (e->o.device < 0 || e->o.device >= count)
        return kv_fail(KV_E_UNAVAILABLE, "CUDA device %d requested, %d present", e->o.device, count);
    CK(cudaSetDevice(e->o.device));
    struct cudaDeviceProp prop;
    if (e->wsrc) { /* a batch's sequence: the device as its weights engine found it (the property query
                      costs milliseconds, paid once per batch rather than per sequence) */
        memset(&prop, 0, sizeof prop);
        snprintf(prop.name, sizeof prop.name, "%s", "shared");
        prop.major = e->wsrc->cc_major;
        prop.minor = 0;
    } else {
        CK(cudaGetDeviceProperties(&prop, e->o.device));
    }
    int drv = 0;
    cudaDriverGetVersion(&drv);
    if (e->wsrc) snprintf(e->devname, sizeof e->devname, "%s", e->wsrc->devname);
    else snprintf(e->devname, sizeof e->devname, "%.255s (sm_%d%d, %zu MiB, driver CUDA %d.%d)", prop.name,
                  prop.major, prop.minor, prop.totalGlobalMem >> 20, drv / 1000, (drv % 1000) / 10);
    if (prop.major < 7)
        return kv_fail(KV_E_UNAVAILABLE, "%s: compute capability %d.%d is below 7.5", prop.name,
                       prop.major, prop.minor);
    e->cc_major = prop.major;
    /* a batch's sequences (wsrc) keep the small limit: each holds its
     * buffers until the batch ends, and there are many of them */
    e->pf_keep = KV_GPU_PF_KEEP_BYTES;
    if (!e->wsrc && prop.totalGlobalMem / 64 > e->pf_keep) e->pf_keep = prop.totalGlobalMem / 64;
    apply_pdl(e, prop.major);
    if (c->head_dim % 8 || c->head_dim > 256 || (c->head_dim & (c->head_dim - 1)) ||
        c->n_heads % c->n_kv_heads || c->n_heads / c->n_kv_heads > 8 ||
        c->rope_dim != c->head_dim)
        return kv_fail(KV_E_UNSUPPORTED, "GPU engine: head_dim %d, %d/%d heads, rope_dim %d not "
                       "supported (head_dim a power of two 8..256, query group <= 8)",
                       c->head_dim, c->n_heads, c->n_kv_heads, c->rope_dim);
    /* the selection stream runs at a higher priority: its small kernels
     * must get SMs as soon as the main stream's GEMV blocks drain, or the
     * selection falls behind the layer it feeds */
    int prio_lo = 0, prio_hi = 0;
    CK(cudaDeviceGetStreamPriorityRange(&prio_lo, &prio_hi));
    CK(cudaStreamCreateWithPriority(&e->s_main, cudaStreamNonBlocking, prio_lo));
    CK(cudaStreamCreateWithPriority(&e->s_side, cudaStreamNonBlocking, prio_hi));
    CK(cudaStreamCreateWithPriority(&e->s_gath, cudaStreamNonBlocking, prio_hi));
    CK(cudaStreamCreateWithPriority(&e->s_copy, cudaStreamNonBlocking, prio_hi));
    for (int i = 0; i < 2; i++) {
        CK(cudaEventCreateWithFlags(&e->off.ev_done[i], cudaEventDisableTiming));
        CK(cudaEventRecord(e->off.ev_done[i], e->s_main));
    }
    CK(cudaEventCreateWithFlags(&e->off.ev_rope, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&e->pfc.ev_chunk, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&e->pfc.ev_read, cudaEventDisableTiming));
    TRY(gl_graph_init(e));
    for (int l = 0; l < e->L; l++) {
        CK(cudaEventCreateWithFlags(&e->ev_x[l], cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&e->ev_sel[l], cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&e->off.ev_copied[l], cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&e->ev_topk[l], cudaEventDisableTiming));
        CK(cudaEventCreate(&e->ev_p0[l]));
        CK(cudaEventCreate(&e->ev_p1[l]));
        CK(cudaEventCreate(&e->ev_g0[l]));
        CK(cudaEventCreate(&e->ev_g1[l]));
        CK(cudaEventCreate(&e->ev_t1[l]));
        CK(cudaEventCreate(&e->ev_w0[l]));
        CK(cudaEventCreate(&e->ev_w1[l]));
    }
    /* weights */
    kv_dtype src = e->m->layers[0].wq.type;
    e->wt = e->o.wtype == KV_DT_BF16 ? KV_DT_BF16
          : e->o.wtype == KV_DT_F16  ? KV_DT_F16
          : src == KV_DT_BF16            ? KV_DT_BF16 : KV_DT_F16;
    TRY(e->wsrc ? gl_weights_share(e, e->wsrc) : gl_weights_load(e));
    float *f = malloc((size_t)e->hd / 2 * sizeof(float));
    if (!f) return kv_fail(KV_E_NOMEM, "out of memory");
    kv_model_rope_freqs(c, f);
    kv_status st = gl_upload_f32(f, e->hd / 2, &e->inv_freq, "rope frequencies");
    free(f);
    if (st) return st;
    /* activations, zeroed so that the padding of every GEMV input is zero */
    struct { float **p; int n; } acts[] = {
        {&e->x, gl_pad8(e->dim)},    {&e->xp[0], e->ld_dim},       {&e->xp[1], e->ld_dim},
        {&e->xp[2], e->ld_dim},      {&e->qkv, e->qd + 2 * e->kvd}, {&e->att, e->ld_qd},
        {&e->hb, e->ld_hid},          {&e->logits, e->vocab},
        {&e->xn, e->ld_dim},          {&e->gu32, 2 * e->hidden},
        {&e->qpred, e->qd},          {&e->sel.qscale, e->nqh},
        {&e->sel.sm_tmp, (int)eng_softmax_tmp(e->nqh)},
    };
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++) {
        TRY(gl_dalloc(acts[i].p, (size_t)acts[i].n * sizeof(float), "activations"));
        CK(cudaMemset(*acts[i].p, 0, (size_t)acts[i].n * sizeof(float)));
    }
    TRY(gl_dalloc(&e->q16, (size_t)e->qd * 2, "fp16 query"));
    e->tok_cap = 1024;
    TRY(gl_dalloc(&e->d_tok, (size_t)e->tok_cap * sizeof(int), "token ids"));
    CK(cudaMemset(e->d_tok, 0, (size_t)e->tok_cap * sizeof(int)));
    TRY(gl_halloc(&e->h_tok, NULL, sizeof(int) * 2, "token staging"));
    CK(cudaDeviceSynchronize());
    return KV_OK;
}

static kv_status engine_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                            const kv_gpu_engine_opts *opts, const kv_gpu_engine *wsrc,
                            kv_gpu_engine **out)
{
    *out = NULL;
    const kv_model_config *c = &m->cfg;
    if (ctx <= 0) ctx = c->seq_len;
    if (ctx > (1 << 24)) return kv_fail(KV_E_USAGE, "context %d too large", ctx);
    if (opts && (opts->pdl < KV_GPU_PDL_AUTO || opts->pdl > 2))
        return kv_fail(KV_E_USAGE, "PDL level %d: 0, 1 or 2", opts->pdl);
    kv_gpu_engine *e = calloc(1, sizeof *e);
    if (!e) return kv_fail(KV_E_NOMEM, "out of memory");
    if (opts) e->o = *opts;
    else kv_gpu_engine_opts_default(&e->o);
    e->m = m;
    e->wsrc = wsrc;
    e->L = c->n_layers;
    e->ctx = ctx;
    e->dim = c->dim;
    e->hidden = c->hidden_dim;
    e->nqh = c->n_heads;
    e->nkv = c->n_kv_heads;
    e->hd = c->head_dim;
    e->vocab = c->vocab_size;
    e->qd = e->nqh * e->hd;
    e->kvd = e->nkv * e->hd;
    e->ld_dim = gl_pad8(e->dim);
    e->ld_qd = gl_pad8(e->qd);
    e->ld_hid = gl_pad8(e->hidden);
    e->eps = c->norm_eps;
    e->scale = 1.0f / sqrtf((float)e->hd);
    const int g = e->nqh / (e->nkv > 0 ? e->nkv : 1);
    e->q_f32 = !((e->hd == 64 || e->hd == 128) && (g == 1 || g == 2 || g == 4 || g == 8));
    e->w = calloc((size_t)e->L, sizeof *e->w);
    e->lay = calloc((size_t)e->L, sizeof *e->lay);
    e->off.list = calloc((size_t)e->L, sizeof(int));
    cudaEvent_t **evs[] = {&e->ev_x, &e->ev_sel, &e->off.ev_copied, &e->ev_topk,
                           &e->ev_p0, &e->ev_p1, &e->ev_g0, &e->ev_g1,
                           &e->ev_t1, &e->ev_w0, &e->ev_w1};
    bool nomem = !e->w || !e->lay || !e->off.list;
    for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++) {
        *evs[i] = calloc((size_t)e->L, sizeof(cudaEvent_t));
        nomem |= !*evs[i];
    }
    if (nomem) {
        kv_gpu_engine_free(e);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    for (int l = 0; l < e->L; l++) {
        if (per_layer) e->lay[l].prm = per_layer[l];
        else kv_policy_params_default(&e->lay[l].prm, KV_POL_FULL);
    }
    kv_status st = engine_init(e);
    if (!st) st = set_policies(e, NULL);
    if (!st) st = alloc_layers(e);
    if (st) {
        kv_gpu_engine_free(e);
        return st;
    }
    *out = e;
    return KV_OK;
}

kv_status kv_gpu_engine_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                            const kv_gpu_engine_opts *opts, kv_gpu_engine **out)
{
    return engine_new(m, per_layer, ctx, opts, NULL, out);
}

kv_status kv_gpu_engine_new_sharing(const kv_gpu_engine *src, const kv_policy_params *per_layer,
                                    int ctx, const kv_gpu_engine_opts *opts, kv_gpu_engine **out)
{
    *out = NULL;
    if (opts && (opts->device != src->o.device || opts->wtype != src->o.wtype || opts->gemv_q != src->o.gemv_q))
        return kv_fail(KV_E_USAGE, "an engine sharing weights keeps their device, weight type and GEMV variant");
    return engine_new(src->m, per_layer, ctx, opts ? opts : &src->o, src, out);
}

void kv_gpu_engine_free(kv_gpu_engine *e)
{
    if (!e) return;
    if (e->s_main) {
        cudaDeviceSynchronize();
        (void)cudaGetLastError();
    }
    release_all(e);
    gl_pf_buffers_trim(e, true);
    gl_graph_free(e);
    gl_weights_free(e);
    gl_dfree(&e->inv_freq);
    float **acts[] = {&e->x, &e->xp[0], &e->xp[1], &e->xp[2], &e->qkv, &e->att, &e->hb, &e->xn, &e->gu32,
                      &e->logits, &e->qpred, &e->sel.qscale, &e->sel.sm_tmp, &e->sel.score,
                      &e->sel.comb};
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++) gl_dfree(acts[i]);
    gl_dfree(&e->q16);
    gl_dfree(&e->d_tok);
    gl_hfree(&e->h_tok);
    kv_cublas_close(e->cb);
    e->cb = NULL;
    gl_dfree(&e->ws);
    gl_dfree(&e->dres.k);
    gl_dfree(&e->dres.v);
    gl_dfree(&e->qx.k);
    gl_dfree(&e->qx.v);
    gl_dfree(&e->qx.imp_sc);
    gl_dfree(&e->sel.chans);
    for (int i = 0; i < 3; i++) gl_dfree(&e->sel.sel[i]);
    gl_dfree(&e->sel.tw_ws);
    gl_dfree(&e->sel.rs_ws);
    e->sel.rs_ws_n = 0;
    cudaEvent_t *evs[] = {e->ev_x, e->ev_sel, e->off.ev_copied, e->ev_topk,
                          e->ev_p0, e->ev_p1, e->ev_g0, e->ev_g1,
                          e->ev_t1, e->ev_w0, e->ev_w1};
    for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++) {
        for (int l = 0; evs[i] && l < e->L; l++)
            if (evs[i][l]) cudaEventDestroy(evs[i][l]);
        free(evs[i]);
    }
    for (int i = 0; i < 2; i++)
        if (e->off.ev_done[i]) cudaEventDestroy(e->off.ev_done[i]);
    if (e->off.ev_rope) cudaEventDestroy(e->off.ev_rope);
    if (e->pfc.ev_chunk) cudaEventDestroy(e->pfc.ev_chunk);
    if (e->pfc.ev_read) cudaEventDestroy(e->pfc.ev_read);
    gl_dfree(&e->pfc.stage);
    if (e->s_main) cudaStreamDestroy(e->s_main);
    if (e->s_side) cudaStreamDestroy(e->s_side);
    if (e->s_gath) cudaStreamDestroy(e->s_gath);
    if (e->s_copy) cudaStreamDestroy(e->s_copy);
    free(e->off.list);
    free(e->lay);
    free(e->w);
    free(e);
}

/* A reset that keeps the policies and every layer's allocations (each
 * placement's clear): what kv-bench prefix does between a request's modes
 * and after a query-aware probe, where releasing and allocating every
 * layer's cache again cost more than the probe computes. */
static void clear_all(kv_gpu_engine *e)
{
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    gl_graph_reset(e);
    for (int l = 0; l < e->L; l++) {
        gl_layer *y = &e->lay[l];
        y->pl->clear(e, y);
        y->T = 0;
        y->fetched_last = y->fetched_total = y->attends = 0;
        y->load_from = NULL;
    }
    gl_cap_clear(e);
    e->pos = 0;
    e->rope_off = 0;
}

kv_status kv_gpu_engine_reset(kv_gpu_engine *e, const kv_policy_params *per_layer)
{
    if (!per_layer && gl_can_clear(e)) {
        clear_all(e);
        return KV_OK;
    }
    release_all(e);
    TRY(set_policies(e, per_layer));
    return alloc_layers(e);
}

kv_status kv_gpu_engine_reset_opts(kv_gpu_engine *e, const kv_policy_params *per_layer,
                                   const kv_gpu_engine_opts *opts)
{
    if (opts) {
        if (opts->device != e->o.device || opts->wtype != e->o.wtype)
            return kv_fail(KV_E_USAGE, "device and weight type are fixed when the engine is built");
        if (opts->pdl < KV_GPU_PDL_AUTO || opts->pdl > 2)
            return kv_fail(KV_E_USAGE, "PDL level %d: 0, 1 or 2", opts->pdl);
        e->o = *opts;
        apply_pdl(e, e->cc_major);
    }
    return kv_gpu_engine_reset(e, per_layer);
}

// --- prefill, step, generate -------------------------------------------------------------

static kv_status ingest_all(kv_gpu_engine *e, uint16_t **K, uint16_t **V, int ld, int T)
{
    uint16_t *tmp = NULL;
    TRY(gl_dalloc(&tmp, ingest_scratch(e, T) * 2, "ingest scratch"));
    kv_status st = KV_OK;
    for (int l = 0; l < e->L && !st; l++) {
        st = gl_cap_layer_kv(e, l, K[l], V[l], ld, T);
        if (!st) st = ingest(e, l, K[l], V[l], ld, T, tmp, true);
        if (st) kv_errcontext("layer %d ingest", l);
    }
    cudaDeviceSynchronize();
    gl_dfree(&tmp);
    return st;
}

// --- the chunked prefill --------------------------------------------------------------

/* Rows of a prompt whose queries go to the placements that observe them
 * (at least dsq's window, DSQ_OBSERVE = 32). */
#define PF_OBSERVE 64

typedef struct {
    kv_gpu_engine *e;
    uint16_t *K[2], *V[2]; /* the dense layer cache (nkv, T, hd): layer l's is pair l & 1 when the
                              cached rows' upload overlaps (K[1] == K[0] otherwise) */
    uint16_t *tmp;         /* ingest scratch */
    int T;
    const kv_prefix *pre;  /* a continued cache: its rows go first (pf_on_begin), or NULL */
    uint16_t *stage;       /* (2, nkv, P, hd) pinned host staging of one layer's cached rows */
    bool overlap;          /* pre's rows uploaded a layer ahead (gl_pf_overlap_layer) */
} pf_hook_ctx;

static kv_status pf_on_begin(void *ctx, int l, void *stream)
{
    pf_hook_ctx *c = ctx;
    if (c->overlap) return gl_pf_overlap_layer(c->e, c->pre, l, c->K, c->V, c->T, (cudaStream_t)stream);
    return gl_put_prefix_rows(c->e, c->pre, l, c->K[0], c->V[0], c->T, c->stage, c->e->s_main);
}

/* The chunk's last queries, float32, to an observing placement (dsq). */
static kv_status pf_on_chunk(void *ctx, int l, int p0, int n, const void *q, int ldq, void *stream)
{
    pf_hook_ctx *c = ctx;
    kv_gpu_engine *e = c->e;
    gl_layer *y = &e->lay[l];
    /* after a continued cache the rows before the first chunk were never
     * streamed: the placement's ingest then copies them all */
    if (y->pl->chunk && !e->o.prefill_copy_sync && !c->pre)
        TRY(y->pl->chunk(e, y, c->K[l & 1], c->V[l & 1], c->T, p0, n, c->T));
    TRY(gl_cap_queries(e, l, p0, n, c->T, q, (size_t)ldq, (cudaStream_t)stream));
    if (!y->pl->observe) return KV_OK;
    for (int i = 0; i < n; i++) {
        int pos = p0 + i;
        if (pos < c->T - PF_OBSERVE) continue;
        /* e->qkv is free during a prefill; observe copies the row out in stream order */
        CK(pf_rows_to_f32((const uint16_t *)q + (size_t)i * ldq, PF_F16, ldq, e->qd, 1, e->qkv,
                          e->qd, (cudaStream_t)stream));
        TRY(y->pl->observe(e, y, e->qkv, pos, c->T));
    }
    return KV_OK;
}

/* A layer's whole prompt is in the dense cache: its placement takes it. */
static kv_status pf_on_layer(void *ctx, int l, void *stream)
{
    pf_hook_ctx *c = ctx;
    const uint16_t *K = c->K[l & 1], *V = c->V[l & 1];
    kv_status st = gl_cap_layer_kv(c->e, l, K, V, c->T, c->T);
    /* opts.prefill_copy_sync measures the former path: copies on the main
     * stream at the layer's end, the host waiting for each layer */
    if (!st) st = ingest(c->e, l, K, V, c->T, c->T, c->tmp, c->e->o.prefill_copy_sync);
    if (st) kv_errcontext("layer %d ingest", l);
    /* the next layer's cached rows, with this layer's work already queued */
    if (!st && c->overlap) st = gl_pf_overlap_next(c->e, c->pre, l, c->K, c->V, c->T);
    return st;
}

/* Can this engine prefill in chunks?  (cuBLAS is loaded at the first try.) */
static bool pf_chunked_ok(kv_gpu_engine *e)
{
    if (e->o.prefill_chunk < 0 || (e->hd != 64 && e->hd != 128) || e->nqh % e->nkv) return false;
    if (!e->cb && !e->cb_failed && kv_cublas_open(&e->cb) != KV_OK) e->cb_failed = true;
    return e->cb != NULL;
}

bool kv_gpu_engine_prefill_method(kv_gpu_engine *e, int *chunk, char *why, size_t why_len)
{
    const bool ok = pf_chunked_ok(e);
    *chunk = ok ? (e->o.prefill_chunk > 0 ? e->o.prefill_chunk : KV_GPU_PREFILL_CHUNK) : 0;
    char buf[320];
    if (ok)
        snprintf(buf, sizeof buf, "head_dim %d: cuBLAS products (%s) and the flash-attention "
                 "chunk kernel", e->hd, kv_cublas_where());
    else if (e->o.prefill_chunk < 0)
        snprintf(buf, sizeof buf, "one token at a time was asked for (prefill chunk 0)");
    else if (e->hd != 64 && e->hd != 128)
        snprintf(buf, sizeof buf, "head_dim %d: the chunked prefill kernels take 64 or 128", e->hd);
    else if (e->nqh % e->nkv)
        snprintf(buf, sizeof buf, "%d query heads are not a multiple of %d KV heads", e->nqh, e->nkv);
    else
        snprintf(buf, sizeof buf, "cuBLAS is unavailable (%s)", kv_cublas_where());
    if (why_len) snprintf(why, why_len, "%s", buf);
    return ok;
}

/*
 * The prompt dt (device ids, n tokens) through every layer in chunks
 * (kv_gpu_prefill_model), each layer ingested by its placement from one
 * dense fp16 cache shared by the layers, then the last position's logits.
 * Device memory beyond the placements: the residual stream (n, ld_dim)
 * float32, the dense cache 2*(nkv, n, hd) fp16, the ingest scratch and the
 * chunk workspace.
 */
/* The chunked prefill's geometry and chunk rows for nn new tokens after P cached ones. */
static void pf_geom(const kv_gpu_engine *e, const kv_prefix *pre, int nn, kv_pf_geom *g, int *C)
{
    const int C0 = e->o.prefill_chunk > 0 ? e->o.prefill_chunk : KV_GPU_PREFILL_CHUNK;
    const int P = pre ? pre->T : 0;
    *C = C0 < nn ? C0 : nn;
    *g = (kv_pf_geom){e->dim, e->hidden, e->nqh, e->nkv, e->hd, e->ld_dim, e->ld_qd, e->ld_hid,
                      e->eps, e->scale, e->wt == KV_DT_BF16, 0, 0, gl_weights_packed(e),
                      pre ? pre->matched - P : 0};
}

static kv_status prefill_chunked(kv_gpu_engine *e, const int *dt, int n, bool want_logits,
                                 const kv_prefix *pre, uint16_t *stage, bool overlap)
{
    const int P = pre ? pre->T : 0, nn = n; /* n: all rows from here on; nn new ones */
    n = P + nn;
    int C;
    kv_pf_geom g;
    pf_geom(e, pre, nn, &g, &C);
    kv_pf_layer *lw = calloc((size_t)e->L, sizeof *lw);
    void **kc = calloc((size_t)e->L, sizeof *kc), **vc = calloc((size_t)e->L, sizeof *vc);
    /* the engine's kept buffers, grown by gpu_prefill (gl_pf_buffers) */
    float *X = e->pfb.X;
    uint16_t *K = e->pfb.K, *V = e->pfb.V, *tmp = e->pfb.tmp;
    kv_pf_ws ws = e->pfb.ws;
    ws.C = C; /* kept for a longer chunk: this prefill's chunks are C rows (opts may have changed) */
    ws.pad = e->o.prefill_exact ? 0 : KV_GPU_PREFILL_PAD;
    kv_status st = lw && kc && vc ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory");
    pf_hook_ctx hc = {e, {K, overlap ? e->pfb.K2 : K}, {V, overlap ? e->pfb.V2 : V}, tmp, n, pre, stage, overlap};
    e->ph.rows_ahead = overlap;
    for (int l = 0; !st && l < e->L; l++) {
        gl_prefill_layer(e, l, &lw[l]);
        kc[l] = hc.K[l & 1];
        vc[l] = hc.V[l & 1];
    }
    kv_pf_hooks hooks = {pf_on_chunk, pf_on_layer, &hc, pf_on_begin};
    /* measurement: an event pair around every chunk's attention */
    kv_pf_events ev = {NULL, NULL, 0, 0};
    e->pf_attn_ms = 0;
    if (!st && e->o.time_prefill) {
        int cap = e->L * ((nn + C - 1) / C);
        ev.start = calloc((size_t)cap, sizeof(void *));
        ev.stop = calloc((size_t)cap, sizeof(void *));
        if (!ev.start || !ev.stop) st = kv_fail(KV_E_NOMEM, "out of memory");
        for (int i = 0; !st && i < cap; i++) {
            cudaError_t ce = cudaEventCreate((cudaEvent_t *)&ev.start[i]);
            if (ce == cudaSuccess) ce = cudaEventCreate((cudaEvent_t *)&ev.stop[i]);
            if (ce != cudaSuccess) st = kv_cuda_fail(ce, "cudaEventCreate", __FILE__, __LINE__);
            ev.cap = i + 1;
        }
    }
    /* the last chunk's padded rows of X (gl_pf_buffers gave room) are read
     * by the accumulating products: defined, though no row reads them */
    if (!st && ws.pad > 1) {
        cudaError_t ce = cudaMemsetAsync(X + (size_t)nn * e->ld_dim, 0, (size_t)ws.pad * e->ld_dim * 4, e->s_main);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "prefill padding rows", __FILE__, __LINE__);
    }
    if (!st)
        st = kv_gpu_prefill_model_from(e->cb, &g, lw, e->L, e->embd, e->ld_dim, &e->pembd, dt, P, n, &ws, X,
                                       kc, vc, (long long)n * e->hd, e->inv_freq, &hooks, e->s_main,
                                       e->o.time_prefill ? &ev : NULL);
    if (!st && want_logits) {
        cudaError_t ce = cudaMemcpyAsync(e->x, X + (size_t)(nn - 1) * e->ld_dim, (size_t)e->dim * 4,
                                         cudaMemcpyDeviceToDevice, e->s_main);
        st = ce == cudaSuccess ? gl_logits(e, e->s_main) : kv_cuda_fail(ce, "prefill logits", __FILE__, __LINE__);
    }
    cudaDeviceSynchronize();
    if (!st && overlap) gl_pf_overlap_span(e, pre);
    for (int i = 0; i < ev.cap; i++) {
        float ms = 0;
        if (!st && i < ev.n && cudaEventElapsedTime(&ms, (cudaEvent_t)ev.start[i],
                                                   (cudaEvent_t)ev.stop[i]) == cudaSuccess)
            e->pf_attn_ms += ms;
        if (ev.start[i]) cudaEventDestroy((cudaEvent_t)ev.start[i]);
        if (ev.stop[i]) cudaEventDestroy((cudaEvent_t)ev.stop[i]);
    }
    free(ev.start);
    free(ev.stop);
    gl_dfree(&e->pfc.stage); /* the sparse layers' chunk staging (after the synchronise above) */
    e->pfc.n = 0;
    free(vc);
    free(kc);
    free(lw);
    return st;
}

kv_status kv_gpu_engine_warm(kv_gpu_engine *e, int rows, double *ms, bool *ran)
{
    if (ms) *ms = 0;
    if (ran) *ran = false;
    if (rows < 1) return kv_fail(KV_E_USAGE, "warm for %d rows", rows);
    if (rows > e->ctx) rows = e->ctx;
    if (!pf_chunked_ok(e)) return KV_OK;
    const double t0 = gl_now_ms();
    int C;
    kv_pf_geom g;
    pf_geom(e, NULL, rows, &g, &C);
    /* X and the workspace for one chunk; the dense cache and scratch for
     * its rows only (a prefill grows them when it needs more) */
    kv_status bst = gl_pf_buffers(e, C, C, C, &g, ingest_scratch(e, C));
    if (bst) {
        gl_pf_buffers_trim(e, true);
        return bst;
    }
    kv_pf_layer lw;
    gl_prefill_layer(e, 0, &lw);
    kv_pf_ws ws = e->pfb.ws;
    ws.pad = e->o.prefill_exact ? 0 : KV_GPU_PREFILL_PAD;
    /* X's rows are scratch here; cleared so the accumulating products read defined values */
    kv_status st = KV_OK;
    cudaError_t ce = cudaMemsetAsync(e->pfb.X, 0, e->pfb.X_n * 4, e->s_main);
    if (ce != cudaSuccess) st = kv_cuda_fail(ce, "warm scratch", __FILE__, __LINE__);
    /* the rows a chunk can have: every rounded count up to C (a last
     * chunk) and C itself (every chunk but the last; kv_gpu_prefill_warm) */
    if (!st) st = kv_gpu_prefill_warm(e->cb, &g, &lw, &ws, e->pfb.X, C, e->s_main);
    ce = cudaStreamSynchronize(e->s_main);
    if (!st && ce != cudaSuccess) st = kv_cuda_fail(ce, "warm", __FILE__, __LINE__);
    gl_pf_buffers_trim(e, false);
    if (ms) *ms = gl_now_ms() - t0;
    if (ran) *ran = !st;
    return st;
}

static kv_status check_token(const kv_gpu_engine *e, int t, int i)
{
    if (t < 0 || t >= e->vocab)
        return kv_fail(KV_E_DATA, "token %d at position %d is outside the vocabulary (%d)", t, i,
                       e->vocab);
    return KV_OK;
}

/*
 * The prefill of tokens (n) after pre's P rows (pre NULL: from position 0):
 * every layer's dense cache gets the P cached rows first, the new tokens
 * are rotated at row + (matched - P), and each placement then ingests all
 * P + n rows (a layer packed in pre's file takes the file's encoding and
 * loads its packed planes instead: gl_take_packed).
 */
static kv_status gpu_prefill(kv_gpu_engine *e, const int *tokens, int n, float *logits_last,
                             const kv_prefix *pre)
{
    if (n < 1) return kv_fail(KV_E_USAGE, "prefill needs at least one token");
    if (e->pos != 0) return kv_fail(KV_E_USAGE, "prefill on an engine at position %d: reset it first", e->pos);
    const int P = pre ? pre->T : 0, nn = n;
    if (P + n > e->ctx)
        return kv_fail(KV_E_USAGE, "%d cached and %d new tokens exceed the context of %d", P, n, e->ctx);
    if (pre && (pre->n_kv_heads != e->nkv || pre->head_dim != e->hd || pre->matched < P))
        return kv_fail(KV_E_DATA, "the cache's rows do not fit this model");
    for (int i = 0; i < n; i++) TRY(check_token(e, tokens[i], i));
    const double t_start = gl_now_ms();
    memset(&e->ph, 0, sizeof e->ph);
    bool any_packed = false;
    /* layers packed in the file take its encoding and load its planes (gl_placement.load) */
    kv_status st = gl_take_packed(e, pre, &any_packed);
    if (st) {
        for (int l = 0; l < e->L; l++) e->lay[l].load_from = NULL;
        return st;
    }
    const bool chunked = pf_chunked_ok(e);
    bool ahead = false; /* the cached rows uploaded a layer ahead (gl_pf_overlap_ok) */
    n = P + nn; /* rows from here on */
    prefill_cache pf = {NULL, NULL, n};
    int *dt = NULL;
    uint16_t *stage = NULL;
    if (chunked) { /* the kept buffers, grown when too small; dt is one of them */
        int C;
        kv_pf_geom g;
        pf_geom(e, pre, nn, &g, &C);
        st = gl_pf_buffers(e, n, nn, C, &g, ingest_scratch(e, n));
        if (!st && P && gl_pf_overlap_ok(e, pre)) st = gl_pf_overlap_begin(e, n, &ahead);
        dt = e->pfb.dt;
    }
    if (!st) st = gl_cap_begin(e, n);
    if (!st && P && e->cap.q_n > nn) e->cap.q_n = nn; /* only the new rows' queries are computed */
    if (!st && P && !pre->device && !(!pre->f && pre->dt == KV_DT_F16))
        st = gl_halloc(&stage, NULL, (size_t)2 * e->nkv * P * e->hd * 2, "cached rows staging");
    if (!chunked) {
        /* one token at a time: every layer's prompt cache at once */
        pf.k = calloc((size_t)e->L, sizeof(uint16_t *));
        pf.v = calloc((size_t)e->L, sizeof(uint16_t *));
        if (!pf.k || !pf.v) st = kv_fail(KV_E_NOMEM, "out of memory");
        size_t per = (size_t)e->nkv * n * e->hd * 2;
        for (int l = 0; l < e->L && !st; l++) {
            st = gl_dalloc(&pf.k[l], per, "prompt K");
            if (!st) st = gl_dalloc(&pf.v[l], per, "prompt V");
        }
    }
    if (!st && !chunked) st = gl_dalloc(&dt, (size_t)nn * sizeof(int), "prompt tokens");
    if (!st) {
        /* On the main stream, not cudaMemcpy: from pageable memory that may
         * return before the DMA lands, and the legacy stream it runs on does
         * not order with the engine's non-blocking streams, so the embedding
         * kernel could read ids not yet written (seen as illegal-address
         * faults under multi-process load).  A pageable source is staged
         * before cudaMemcpyAsync returns. */
        cudaError_t ce = cudaMemcpyAsync(dt, tokens, (size_t)nn * sizeof(int), cudaMemcpyHostToDevice,
                                         e->s_main);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "prompt upload", __FILE__, __LINE__);
    }
    e->rope_off = pre ? pre->matched - P : 0;
    double t_mark = gl_now_ms();
    e->ph.setup = t_mark - t_start;
    if (chunked) {
        if (!st) st = prefill_chunked(e, dt, nn, logits_last != NULL, pre, stage, ahead);
    } else {
        for (int l = 0; P && l < e->L && !st; l++)
            st = gl_put_prefix_rows(e, pre, l, pf.k[l], pf.v[l], n, stage, e->s_main);
        if (!st && P) {
            cudaError_t ce = cudaStreamSynchronize(e->s_main);
            if (ce != cudaSuccess) st = kv_cuda_fail(ce, "cached rows", __FILE__, __LINE__);
        }
        e->ph.rows = gl_now_ms() - t_mark;
        t_mark = gl_now_ms();
        for (int i = P; i < n && !st; i++) {
            e->pos = i;
            st = forward(e, dt + (i - P), i == n - 1 && logits_last, &pf);
        }
        e->pos = 0;
        if (!st) st = ingest_all(e, pf.k, pf.v, n, n);
    }
    e->ph.compute = gl_now_ms() - t_mark;
    t_mark = gl_now_ms();
    if (!st && logits_last) {
        cudaError_t ce = cudaMemcpyAsync(logits_last, e->logits, (size_t)e->vocab * 4,
                                         cudaMemcpyDeviceToHost, e->s_main);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(e->s_main);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "logits download", __FILE__, __LINE__);
        /* NaN/inf weights or overflow: refused as on the CPU (the logits are
         * the one place the host sees; the selection kernels rank NaN as -inf
         * meanwhile, so nothing before this point misbehaves) */
        else if (kv_first_nonfinite(logits_last, (size_t)e->vocab) != SIZE_MAX)
            st = kv_model_nonfinite_fail(e->m, "logits", n - 1);
    }
    cudaDeviceSynchronize();
    e->ph.logits = gl_now_ms() - t_mark;
    for (int l = 0; pf.k && l < e->L; l++) gl_dfree(&pf.k[l]);
    for (int l = 0; pf.v && l < e->L; l++) gl_dfree(&pf.v[l]);
    free(pf.k);
    free(pf.v);
    if (!chunked) gl_dfree(&dt);
    gl_pf_buffers_trim(e, false); /* kept only when small */
    gl_hfree(&stage);
    for (int l = 0; l < e->L; l++) e->lay[l].load_from = NULL; /* pre is borrowed for this call */
    e->ph.total = gl_now_ms() - t_start;
    if (!st) e->pos = n;
    else {
        gl_cap_clear(e);
        e->rope_off = 0;
    }
    return st;
}

kv_status kv_gpu_engine_prefill(kv_gpu_engine *e, const int *tokens, int n, float *logits_last)
{
    return gpu_prefill(e, tokens, n, logits_last, NULL);
}

kv_status kv_gpu_engine_prefill_from(kv_gpu_engine *e, const kv_prefix *pre, const int *tokens,
                                     int n, float *logits_last)
{
    return gpu_prefill(e, tokens, n, logits_last, pre);
}

kv_status kv_gpu_engine_step(kv_gpu_engine *e, int token, float *logits)
{
    if (e->pos == 0) { /* a one-token prefill, which keeps no prompt K/V (as kv_engine_step) */
        bool kv = e->cap.kv;
        e->cap.kv = false;
        kv_status st = kv_gpu_engine_prefill(e, &token, 1, logits);
        e->cap.kv = kv;
        return st;
    }
    TRY(check_token(e, token, e->pos));
    if (e->pos >= e->ctx) return kv_fail(KV_E_USAGE, "context of %d tokens is full", e->ctx);
    e->h_tok[0] = token;
    CK(cudaMemcpyAsync(e->d_tok, e->h_tok, sizeof(int), cudaMemcpyHostToDevice, e->s_main));
    kv_status st = gl_graph_step(e, e->d_tok, logits != NULL, NULL);
    if (st) return st;
    e->pos++;
    if (logits) {
        CK(cudaMemcpyAsync(logits, e->logits, (size_t)e->vocab * 4, cudaMemcpyDeviceToHost, e->s_main));
    }
    CK(cudaStreamSynchronize(e->s_main));
    gl_graph_idle(e);
    if (logits && kv_first_nonfinite(logits, (size_t)e->vocab) != SIZE_MAX)
        return kv_model_nonfinite_fail(e->m, "logits", e->pos - 1);
    return KV_OK;
}

kv_status kv_gpu_engine_generate(kv_gpu_engine *e, int token, int n, int *out, float *step_ms)
{
    if (n < 1) return KV_OK;
    if (e->pos == 0) return kv_fail(KV_E_USAGE, "generate needs a context: prefill or synthesize first");
    if (e->pos + n > e->ctx) return kv_fail(KV_E_USAGE, "%d more tokens exceed the context of %d", n, e->ctx);
    TRY(check_token(e, token, e->pos));
    if (n + 1 > e->tok_cap) {
        CK(cudaDeviceSynchronize());
        gl_dfree(&e->d_tok);
        e->tok_cap = 0;
        TRY(gl_dalloc(&e->d_tok, (size_t)(n + 1) * sizeof(int), "token ids"));
        e->tok_cap = n + 1;
    }
    cudaEvent_t *ev = calloc((size_t)n + 1, sizeof *ev);
    if (!ev) return kv_fail(KV_E_NOMEM, "out of memory");
    kv_status st = KV_OK;
    for (int i = 0; i <= n && !st; i++) {
        cudaError_t ce = cudaEventCreate(&ev[i]);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "cudaEventCreate(&ev[i])", __FILE__, __LINE__);
    }
    e->h_tok[0] = token;
    if (!st) {
        cudaError_t ce = cudaMemcpyAsync(e->d_tok, e->h_tok, sizeof(int), cudaMemcpyHostToDevice, e->s_main);
        if (ce == cudaSuccess) ce = cudaEventRecord(ev[0], e->s_main);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "generate start", __FILE__, __LINE__);
    }
    for (int i = 0; i < n && !st; i++) {
        st = gl_graph_step(e, e->d_tok + i, true, e->d_tok + i + 1); /* forward, argmax */
        if (st) break;
        cudaError_t ce = cudaEventRecord(ev[i + 1], e->s_main);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "step event", __FILE__, __LINE__);
        e->pos++;
    }
    if (!st) {
        cudaError_t ce = cudaStreamSynchronize(e->s_main);
        if (ce == cudaSuccess) ce = cudaMemcpy(out, e->d_tok + 1, (size_t)n * sizeof(int), cudaMemcpyDeviceToHost);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "generate", __FILE__, __LINE__);
        gl_graph_idle(e);
    }
    for (int i = 0; i < n && !st && step_ms; i++) {
        float ms = 0;
        cudaEventElapsedTime(&ms, ev[i], ev[i + 1]);
        step_ms[i] = ms;
    }
    for (int i = 0; i <= n; i++)
        if (ev[i]) cudaEventDestroy(ev[i]);
    free(ev);
    return st;
}

kv_status kv_gpu_engine_synthesize(kv_gpu_engine *e, int T, uint64_t seed)
{
    if (e->pos != 0) return kv_fail(KV_E_USAGE, "synthesize on an engine at position %d: reset it first", e->pos);
    if (T < 1 || T >= e->ctx) return kv_fail(KV_E_USAGE, "synthetic context of %d tokens does not fit %d", T, e->ctx);
    gl_cap_clear(e); /* a synthesized context has no prompt to dump */
    uint16_t *K = NULL, *V = NULL;
    float *scale = NULL;
    size_t n = (size_t)e->nkv * T * e->hd;
    TRY(gl_dalloc(&K, n * 2, "synthetic K"));
    kv_status st = gl_dalloc(&V, n * 2, "synthetic V");
    if (!st) st = gl_dalloc(&scale, (size_t)e->hd * sizeof(float), "synthetic scales");
    /* real keys have a few channels of much larger magnitude (what makes
     * channel selection work); values are plain */
    float *hs = malloc((size_t)e->hd * sizeof(float));
    if (!st && !hs) st = kv_fail(KV_E_NOMEM, "out of memory");
    if (!st) {
        for (int c = 0; c < e->hd; c++) hs[c] = (c % 16 == 3) ? 6.0f : (c % 7 == 0 ? 2.0f : 1.0f);
        cudaError_t ce = cudaMemcpyAsync(scale, hs, (size_t)e->hd * sizeof(float),
                                         cudaMemcpyHostToDevice, e->s_main);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(e->s_main);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "scale upload", __FILE__, __LINE__);
    }
    uint16_t *tmp = NULL;
    if (!st) st = gl_dalloc(&tmp, ingest_scratch(e, T) * 2, "ingest scratch");
    for (int l = 0; l < e->L && !st; l++) {
        cudaError_t ce = eng_fill_random(K, KV_DT_F16, n, seed * 1315423911u + 2u * l, scale, e->hd, 1, e->s_main);
        if (ce == cudaSuccess) ce = eng_fill_random(V, KV_DT_F16, n, seed * 1315423911u + 2u * l + 1, NULL, 1, 1, e->s_main);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "synthetic fill", __FILE__, __LINE__);
        if (!st) st = ingest(e, l, K, V, T, T, tmp, true);
    }
    cudaDeviceSynchronize();
    free(hs);
    gl_dfree(&tmp);
    gl_dfree(&scale);
    gl_dfree(&V);
    gl_dfree(&K);
    if (!st) e->pos = T;
    return st;
}

// --- accessors and accounting --------------------------------------------------------------

void kv_gpu_engine_set_no_fetch(kv_gpu_engine *e, bool no_fetch) { e->o.no_fetch = no_fetch; }
void kv_gpu_engine_set_sel_opts(kv_gpu_engine *e, bool classic, int ahead, int sel_blocks, int gather_blocks)
{
    e->o.sel_classic = classic;
    e->o.sel_ahead = ahead;
    e->o.sel_blocks = sel_blocks;
    e->o.gather_blocks = gather_blocks;
}

kv_status kv_gpu_engine_set_step_opts(kv_gpu_engine *e, bool sel_serial, bool topk_wide,
                                      bool sel_cache, bool profile)
{
    CK(cudaDeviceSynchronize());
    e->o.sel_serial = sel_serial;
    e->o.topk_wide = topk_wide;
    e->o.sel_cache = sel_cache;
    e->o.profile = profile;
    for (int l = 0; l < e->L; l++) {
        gl_layer *y = &e->lay[l];
        if (y->st && y->pl->step_opts) TRY(y->pl->step_opts(e, y));
    }
    CK(cudaDeviceSynchronize());
    return KV_OK;
}
int kv_gpu_engine_vocab(const kv_gpu_engine *e) { return e->vocab; }
int kv_gpu_engine_pos(const kv_gpu_engine *e) { return e->pos; }
int kv_gpu_engine_ctx(const kv_gpu_engine *e) { return e->ctx; }
int kv_gpu_engine_n_layers(const kv_gpu_engine *e) { return e->L; }
const char *kv_gpu_engine_device(const kv_gpu_engine *e) { return e->devname; }
int kv_gpu_engine_ordinal(const kv_gpu_engine *e) { return e->o.device; }
uint64_t kv_gpu_engine_weight_bytes(const kv_gpu_engine *e) { return e->wbytes; }
uint64_t kv_gpu_engine_weight_read_bytes(const kv_gpu_engine *e) { return e->wread; }

kv_status kv_gpu_engine_layer_bytes(const kv_gpu_engine *e, int layer, kv_bytes *b)
{
    memset(b, 0, sizeof *b);
    if (layer < 0 || layer >= e->L) return kv_fail(KV_E_USAGE, "layer %d out of range", layer);
    const gl_layer *y = &e->lay[layer];
    b->fetched_last = y->fetched_last;
    b->fetched_total = y->fetched_total;
    b->attends = y->attends;
    if (y->st) y->pl->bytes(e, y, b);
    return KV_OK;
}

void kv_gpu_engine_bytes(const kv_gpu_engine *e, kv_bytes *total)
{
    memset(total, 0, sizeof *total);
    for (int l = 0; l < e->L; l++) {
        kv_bytes b;
        kv_gpu_engine_layer_bytes(e, l, &b);
        total->resident += b.resident;
        total->host += b.host;
        total->disk += b.disk;
        total->fetched_last += b.fetched_last;
        total->fetched_total += b.fetched_total;
        total->attends += b.attends;
    }
}

double kv_gpu_engine_prefill_attn_ms(const kv_gpu_engine *e) { return e->pf_attn_ms; }

void kv_gpu_engine_timing(const kv_gpu_engine *e, kv_gpu_timing *t)
{
    memset(t, 0, sizeof *t);
    if (!e->o.profile) return;
    cudaDeviceSynchronize();
    for (int l = 0; l < e->L; l++) {
        const gl_layer *y = &e->lay[l];
        if (y->st && y->pl->timing) y->pl->timing(e, y, t);
    }
}

#endif /* KV_HAVE_CUDA */
