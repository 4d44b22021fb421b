/*
 * Placement `sparse` of the GPU engine (kv_gpu_int.h): TailorKV's offload.
 * The prompt's K/V stay in pinned host memory, one row per token with every
 * KV head's K and V (and, for channel selection, the keys channel-major);
 * the GPU keeps the sink rows, the prompt's recent tail and the generated
 * tokens in an attention buffer allocated for the whole context:
 *
 *   ak, av (nkv, cap, hd): [gathered top-K | sink | prompt tail | generated]
 *
 * Each step the layer's query (predicted one layer early by the core, on
 * the selection stream) scores the candidates between the sink and the
 * tail: from C critical key channels read from host memory (channels), from
 * every channel of the host rows (exact), from a resident 1-bit sketch of
 * the keys (sketch), from the resident rows of R critical channels chosen
 * at ingest from the prompt's last queries, fp16 or cbits-bit codes, of
 * which each step scores with C (resident: TailorKV's static channels), or
 * from resident per-page key bounds (pages: Quest), the last three so that
 * only the chosen rows cross PCIe; softmax
 * and the GQA combine, top-K, then the chosen rows are gathered into the
 * buffer on the gather stream while the next layer's selection runs.
 *
 * In a chunked prefill the prompt reaches host memory chunk by chunk
 * (sparse_chunk): as soon as a chunk's rows are in the dense cache, a
 * conversion to the host layouts into a chunk-sized staging buffer and the
 * device-to-host copies run on the copy stream, under the next chunk's (and
 * at the layer's end the next layer's) compute; the main stream waits only
 * for the last conversion before the next layer overwrites the dense cache.
 * What needs the whole prompt (key statistics, sketch, sink, tail, the
 * attention buffer) is built at ingest from the dense cache on the GPU.
 */
#include "gpu/kv_gpu_int.h"
#include "policy/kv_select.h"

#ifdef KV_HAVE_CUDA

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int Tp;                   /* prompt tokens */
    int cs0, cend0;           /* the prompt's candidate range [cs0, cend0) */
    int kmax, tail_base, cap; /* top-K capacity; first tail row; rows of ak/av */
    int ldc;                  /* kcm row pitch: Tp rounded up to 8 */
    uint16_t *rows_h;         /* pinned (Tp, nkv, 2, hd) */
    const void *rows_d;       /* its device alias */
    uint16_t *kcm_h;          /* pinned (nkv, hd, ldc) keys channel-major (channels) */
    const void *kcm_d;        /* its device alias */
    uint16_t *sink;           /* (cs0, nkv, 2, hd) device */
    uint8_t *sketch;          /* (nkv, Tp, hd/8) device (sketch) */
    float *chmax, *kmean, *kmad; /* (nkv, hd) device */
    /* resident: R pool channels (nkv, R) and their rows (eng_rows_build's
     * layout, ldt tokens a row); the prompt's last queries observed */
    int R, ldt;
    int *pool;
    void *rrows;
    uint16_t *rscale, *rzero;
    float *obs;               /* (SPARSE_OBSERVE, n_heads*hd) device */
    int obs_n;
    /* pages: (nkv, np, hd) fp16 bounds */
    int np;
    uint16_t *pmin, *pmax;
    uint16_t *ak, *av;        /* (nkv, cap, hd) the attention buffer */
    int start, natt;          /* rows attended in the current step */
    int streamed;             /* prompt rows already copied to rows_h (and kcm_h) by
                                 sparse_chunk, of streamed_T; 0 when ingest copies them */
    int streamed_T;
    /* opts.sel_cache: the token each row [0, ntag) of ak/av holds per head
     * (tag), the plan of the step's misses (mcap = kmax + cs0 rows), counts
     * (nkv, 4) of eng_sel_cache_plan; cache_reset: the tags are to be set
     * from the rows' current content before the next plan */
    int *tag, *plan, ntag, mcap;
    unsigned long long *cstat;
    bool cache_reset;
    uint64_t extra_last;      /* host bytes of the last step besides the gathered rows */
    /* opts.sel_every >= 2: the ids chosen at position keep_pos (-1: none) for
     * keep_kk rows from candidate keep_cs on, (nkv, kmax + 1) device */
    int *keep;
    int keep_pos, keep_kk, keep_cs;
} sparse_state;

#define SPARSE_OBSERVE 32 /* prompt queries observed: PREFILL_OBSERVE of kv_engine.c */
#define SPARSE_CACHE_MAX 16384 /* rows a selection cache plans per head (eng_sel_cache_plan) */

static int topk_of(const kv_policy_params *p, int T)
{
    if (p->topk > 0) return p->topk;
    return (int)ceil(p->topk_frac * (double)T);
}

/* The candidate range at T tokens, as kv_policy_sparse.c. */
static void cand_range(const kv_policy_params *p, int Tp, int T, int *cs, int *cend)
{
    int a = p->sink < T ? p->sink : T;
    int e = T - p->window;
    if (e > Tp) e = Tp;
    if (e < a) e = a;
    *cs = a;
    *cend = e;
}

static kv_status sparse_configure(kv_gpu_engine *e, gl_layer *y)
{
    (void)e, (void)y; /* kv_policy_check (set_policies) checked the parameters and geometry */
    return KV_OK;
}

/* Everything depends on the prompt: allocated at ingest. */
static kv_status sparse_alloc(kv_gpu_engine *e, gl_layer *y)
{
    TRY(gl_state_new(y, sizeof(sparse_state)));
    sparse_state *sp = y->st;
    if (y->prm.select == KV_SELECT_RESIDENT)
        TRY(gl_dalloc(&sp->obs, (size_t)SPARSE_OBSERVE * (size_t)e->qd * 4, "sparse observed queries"));
    return KV_OK;
}

/* The prompt's last queries, for the resident channels (as the CPU engine
 * gives them to observe()). */
static kv_status sparse_observe(kv_gpu_engine *e, gl_layer *y, const float *q, int pos, int n)
{
    sparse_state *sp = y->st;
    if (!sp->obs) return KV_OK;
    int nobs = n < SPARSE_OBSERVE ? n : SPARSE_OBSERVE, j = pos - (n - nobs);
    if (j >= 0) {
        CK(cudaMemcpyAsync(sp->obs + (size_t)j * e->qd, q, (size_t)e->qd * 4,
                           cudaMemcpyDeviceToDevice, e->s_main));
        sp->obs_n = nobs;
    }
    return KV_OK;
}

/* select=resident at ingest: the pool of R channels per KV head from the
 * observed queries and the key maxima (kv_select_pick_channels on the
 * host, as the CPU policy), then the rows of those channels. */
static kv_status resident_build(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, int ld, int T)
{
    sparse_state *sp = y->st;
    const kv_policy_params *p = &y->prm;
    const int nkv = e->nkv, hd = e->hd, nqh = e->nqh, nobs = sp->obs_n <= T ? sp->obs_n : 0;
    const int R = kv_select_pool_size(p->pool, p->channels, hd);
    cudaStream_t s = e->s_main;
    sp->R = R;
    sp->ldt = (T + KV_SELECT_CGROUP - 1) / KV_SELECT_CGROUP * KV_SELECT_CGROUP;
    float *chm = malloc((size_t)nkv * hd * sizeof(float));
    float *oq = nobs ? malloc((size_t)nobs * e->qd * sizeof(float) * 2) : NULL;
    int *pool = malloc((size_t)nkv * R * sizeof(int));
    kv_status st = KV_OK;
    if (!chm || !pool || (nobs && !oq)) st = kv_fail(KV_E_NOMEM, "resident channel staging");
    if (!st) {
        cudaError_t ce = cudaMemcpyAsync(chm, sp->chmax, (size_t)nkv * hd * 4, cudaMemcpyDeviceToHost, s);
        if (ce == cudaSuccess && nobs)
            ce = cudaMemcpyAsync(oq, sp->obs, (size_t)nobs * e->qd * 4, cudaMemcpyDeviceToHost, s);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
        if (ce != cudaSuccess) st = kv_fail(KV_E_UNAVAILABLE, "CUDA: %s", cudaGetErrorString(ce));
    }
    if (!st) {
        float *q = nobs ? oq + (size_t)nobs * e->qd : NULL; /* (n_heads, nobs, hd) */
        for (int j = 0; j < nobs; j++)
            for (int h = 0; h < nqh; h++)
                memcpy(q + ((size_t)h * nobs + j) * hd, oq + (size_t)j * e->qd + (size_t)h * hd,
                       (size_t)hd * sizeof(float));
        kv_select_pick_channels(q, nobs, chm, nqh, nkv, hd, R, pool);
        st = gl_dalloc(&sp->pool, (size_t)nkv * R * sizeof(int), "resident channels");
        if (!st) st = gl_h2d_sync(e, sp->pool, pool, (size_t)nkv * R * sizeof(int));
    }
    free(chm);
    free(oq);
    free(pool);
    TRY(st);
    const int bits = p->cbits;
    size_t rbytes = bits >= 16 ? (size_t)nkv * R * sp->ldt * 2 : (size_t)nkv * R * sp->ldt * bits / 8;
    TRY(gl_dalloc(&sp->rrows, rbytes, "resident channel rows"));
    if (bits < 16) {
        size_t g = (size_t)nkv * R * (sp->ldt / KV_SELECT_CGROUP) * 2;
        TRY(gl_dalloc(&sp->rscale, g, "resident channel scales"));
        TRY(gl_dalloc(&sp->rzero, g, "resident channel zeros"));
    }
    CK(eng_rows_build(K, nkv, T, ld, hd, sp->pool, R, bits, sp->rrows, sp->rscale, sp->rzero,
                      sp->ldt, s));
    sp->obs_n = 0;
    return KV_OK;
}

/* The pinned host buffers of a T-token prompt: rows (and the channel-major
 * keys, their padding columns zeroed). */
static kv_status sparse_host_alloc(kv_gpu_engine *e, gl_layer *y, int T)
{
    sparse_state *sp = y->st;
    const int nkv = e->nkv, hd = e->hd;
    gl_hfree(&sp->rows_h); /* a failed prefill's, not yet released */
    gl_hfree(&sp->kcm_h);
    sp->rows_d = sp->kcm_d = NULL;
    TRY(gl_halloc(&sp->rows_h, &sp->rows_d, (size_t)T * nkv * 2 * hd * 2, "sparse K/V rows"));
    if (y->prm.select == KV_SELECT_CHANNELS) {
        sp->ldc = gl_pad8(T);
        TRY(gl_halloc(&sp->kcm_h, &sp->kcm_d, (size_t)nkv * hd * sp->ldc * 2, "channel-major keys"));
        for (size_t r = 0; r < (size_t)nkv * hd && sp->ldc > T; r++)
            memset(sp->kcm_h + r * sp->ldc + T, 0, (size_t)(sp->ldc - T) * 2);
    }
    return KV_OK;
}

/*
 * Rows [p0, p0 + n) of a T-token prompt to host memory while the prefill
 * goes on: on the copy stream, after the chunk (an event on the main
 * stream), convert them into the staging buffer (rows, and the keys
 * channel-major), record that the dense cache has been read, and copy the
 * staged bytes to the pinned buffers.  One stream keeps the staging safe:
 * the next chunk's conversion waits for this chunk's copies.  GPU memory:
 * the staging of one chunk, (3 nkv hd n) fp16 values at most.
 */
static kv_status sparse_chunk(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V,
                              int ld, int p0, int n, int T)
{
    sparse_state *sp = y->st;
    const int nkv = e->nkv, hd = e->hd;
    const bool channels = y->prm.select == KV_SELECT_CHANNELS;
    if (p0 == 0) {
        sp->streamed = 0;
        sp->streamed_T = T;
        TRY(sparse_host_alloc(e, y, T));
    }
    if (p0 != sp->streamed || T != sp->streamed_T)
        return kv_fail(KV_E_INTERNAL, "layer %d: prefill chunk at row %d, %d of %d rows copied",
                       y->l, p0, sp->streamed, T);
    const size_t rn = (size_t)n * nkv * 2 * hd, need = rn + (channels ? (size_t)nkv * hd * n : 0);
    if (need > e->pfc.n) { /* grown once per prefill: every chunk but the last has the same n */
        CK(cudaDeviceSynchronize());
        gl_dfree(&e->pfc.stage);
        e->pfc.n = 0;
        TRY(gl_dalloc(&e->pfc.stage, need * 2, "sparse prefill staging"));
        e->pfc.n = need;
    }
    cudaStream_t sc = e->s_copy;
    uint16_t *st_rows = e->pfc.stage, *st_cm = e->pfc.stage + rn;
    CK(cudaEventRecord(e->pfc.ev_chunk, e->s_main));
    CK(cudaStreamWaitEvent(sc, e->pfc.ev_chunk, 0));
    CK(eng_to_row_layout(K + (size_t)p0 * hd, V + (size_t)p0 * hd, nkv, n, ld, hd, KV_DT_F16,
                         st_rows, sc));
    if (channels)
        CK(eng_to_channel_major(K + (size_t)p0 * hd, nkv, n, ld, hd, KV_DT_F16, st_cm, n, sc));
    CK(cudaEventRecord(e->pfc.ev_read, sc));
    CK(cudaMemcpyAsync(sp->rows_h + (size_t)p0 * nkv * 2 * hd, st_rows, rn * 2,
                       cudaMemcpyDeviceToHost, sc));
    if (channels)
        CK(cudaMemcpy2DAsync(sp->kcm_h + p0, (size_t)sp->ldc * 2, st_cm, (size_t)n * 2,
                             (size_t)n * 2, (size_t)nkv * hd, cudaMemcpyDeviceToHost, sc));
    sp->streamed = p0 + n;
    return KV_OK;
}

/* The selection cache of a layer whose attention buffer is laid out
 * (opts.sel_cache): tags for every row up to the end of the prompt's tail,
 * the plan, the counts; reset from the buffer's content at the next step. */
static kv_status cache_alloc(kv_gpu_engine *e, gl_layer *y)
{
    sparse_state *sp = y->st;
    sp->cache_reset = true;
    if (sp->tag) {
        CK(cudaMemset(sp->cstat, 0, (size_t)e->nkv * 4 * 8));
        return KV_OK;
    }
    /* the plan keeps 3 ints per wanted row in shared memory (200 KB): a larger
     * top-K runs without the cache */
    if (sp->kmax + sp->cs0 > SPARSE_CACHE_MAX) return KV_OK;
    sp->ntag = sp->tail_base + (sp->Tp - sp->cend0);
    sp->mcap = sp->kmax + sp->cs0;
    TRY(gl_dalloc(&sp->tag, (size_t)e->nkv * sp->ntag * sizeof(int), "selection cache tags"));
    TRY(gl_dalloc(&sp->plan, (size_t)e->nkv * (1 + 2 * (size_t)sp->mcap) * sizeof(int),
                  "selection cache plan"));
    TRY(gl_dalloc(&sp->cstat, (size_t)e->nkv * 4 * 8, "selection cache counts"));
    CK(cudaMemset(sp->cstat, 0, (size_t)e->nkv * 4 * 8));
    return KV_OK;
}

static void cache_free(sparse_state *sp)
{
    gl_dfree(&sp->tag);
    gl_dfree(&sp->plan);
    gl_dfree(&sp->cstat);
    sp->ntag = sp->mcap = 0;
}

static kv_status sparse_ingest(kv_gpu_engine *e, gl_layer *y, const uint16_t *K,
                               const uint16_t *V, int ld, int T, uint16_t *tmp)
{
    sparse_state *sp = y->st;
    const kv_policy_params *p = &y->prm;
    const int nkv = e->nkv, hd = e->hd;
    const size_t rb = (size_t)hd * 2;
    cudaStream_t s = e->s_main;
    bool sketch = p->select == KV_SELECT_SKETCH;
    bool channels = p->select == KV_SELECT_CHANNELS;
    bool pages = p->select == KV_SELECT_PAGES;
    /* the chunks have been copied out (sparse_chunk): the next layer may
     * overwrite the dense cache once the last one is staged */
    const bool streamed = sp->streamed == T && sp->streamed_T == T && sp->rows_h;
    sp->streamed = sp->streamed_T = 0;
    sp->Tp = T;
    cand_range(p, sp->Tp, T, &sp->cs0, &sp->cend0);
    int kk_ctx = topk_of(p, e->ctx);
    sp->kmax = kk_ctx < T ? kk_ctx : T;
    if (sp->kmax < 0) sp->kmax = 0;
    sp->tail_base = sp->kmax + sp->cs0;
    sp->cap = sp->tail_base + (e->ctx - sp->cend0);
    size_t rowsz = (size_t)T * nkv * 2 * hd * 2;
    if (streamed) {
        CK(cudaStreamWaitEvent(s, e->pfc.ev_read, 0));
    } else {
        TRY(sparse_host_alloc(e, y, T));
        CK(eng_to_row_layout(K, V, nkv, T, ld, hd, KV_DT_F16, tmp, s));
        CK(cudaMemcpyAsync(sp->rows_h, tmp, rowsz, cudaMemcpyDeviceToHost, s));
    }
    if (sp->cs0 > 0) { /* the sink rows in the row layout, from the dense cache */
        size_t sz = (size_t)sp->cs0 * nkv * 2 * hd * 2;
        TRY(gl_dalloc(&sp->sink, sz, "sparse sink rows"));
        CK(eng_to_row_layout(K, V, nkv, sp->cs0, ld, hd, KV_DT_F16, sp->sink, s));
    }
    TRY(gl_dalloc(&sp->chmax, (size_t)nkv * hd * 4, "key channel maxima"));
    TRY(gl_dalloc(&sp->kmean, (size_t)nkv * hd * 4, "key channel means"));
    TRY(gl_dalloc(&sp->kmad, (size_t)nkv * hd * 4, "key channel deviations"));
    CK(eng_key_stats(K, nkv, T, ld, hd, KV_DT_F16, sp->chmax, sp->kmean, sp->kmad, s));
    if (channels && !streamed) {
        size_t cmsz = (size_t)nkv * hd * sp->ldc * 2;
        CK(cudaMemsetAsync(tmp, 0, cmsz, s));
        CK(eng_to_channel_major(K, nkv, T, ld, hd, KV_DT_F16, tmp, sp->ldc, s));
        CK(cudaMemcpyAsync(sp->kcm_h, tmp, cmsz, cudaMemcpyDeviceToHost, s));
    }
    if (sketch) {
        TRY(gl_dalloc(&sp->sketch, (size_t)nkv * T * (hd / 8), "key sketch"));
        CK(eng_sketch_build(K, nkv, T, ld, hd, KV_DT_F16, sp->kmean, sp->sketch, s));
    }
    if (p->select == KV_SELECT_RESIDENT) TRY(resident_build(e, y, K, ld, T));
    if (pages) {
        sp->np = (T + p->page - 1) / p->page;
        size_t pb = (size_t)nkv * sp->np * hd * 2;
        TRY(gl_dalloc(&sp->pmin, pb, "page key minima"));
        TRY(gl_dalloc(&sp->pmax, pb, "page key maxima"));
        CK(eng_page_bounds(K, nkv, T, ld, hd, p->page, sp->pmin, sp->pmax, s));
    }
    size_t asz = (size_t)nkv * sp->cap * hd * 2;
    TRY(gl_dalloc(&sp->ak, asz, "sparse resident K"));
    TRY(gl_dalloc(&sp->av, asz, "sparse resident V"));
    CK(cudaMemsetAsync(sp->ak, 0, asz, s));
    CK(cudaMemsetAsync(sp->av, 0, asz, s));
    int ntail = T - sp->cend0;
    if (ntail > 0) {
        size_t off = (size_t)sp->tail_base * hd;
        CK(cudaMemcpy2DAsync(sp->ak + off, (size_t)sp->cap * rb, K + (size_t)sp->cend0 * hd,
                             (size_t)ld * rb, (size_t)ntail * rb, nkv,
                             cudaMemcpyDeviceToDevice, s));
        CK(cudaMemcpy2DAsync(sp->av + off, (size_t)sp->cap * rb, V + (size_t)sp->cend0 * hd,
                             (size_t)ld * rb, (size_t)ntail * rb, nkv,
                             cudaMemcpyDeviceToDevice, s));
    }
    /* the selection scratch the sparse layers share */
    size_t ncand = (size_t)(sp->cend0 > sp->cs0 ? T - sp->cs0 : 0) + 8;
    if ((size_t)e->nqh * ncand > e->sel.score_n) {
        CK(cudaDeviceSynchronize());
        gl_dfree(&e->sel.score);
        gl_dfree(&e->sel.comb);
        e->sel.score_n = 0;
        TRY(gl_dalloc(&e->sel.score, (size_t)e->nqh * ncand * 4, "selection scores"));
        TRY(gl_dalloc(&e->sel.comb, (size_t)e->nkv * ncand * 4, "selection scores"));
        e->sel.score_n = (size_t)e->nqh * ncand;
    }
    for (int i = 0; i < 3; i++)
        TRY(gl_grow_i32(&e->sel.sel[i], &e->sel.sel_n[i], (size_t)nkv * (sp->kmax + 1),
                        "selection ids"));
    TRY(gl_grow_i32(&e->sel.chans, &e->sel.chans_n, (size_t)nkv * p->channels, "critical channels"));
    if (e->o.topk_wide && !e->sel.tw_ws)
        TRY(gl_dalloc(&e->sel.tw_ws, eng_topk_wide_ws(nkv), "top-K workspace"));
    if (p->select == KV_SELECT_RESIDENT) { /* the chain's workspace, zeroed once */
        size_t need = eng_resident_select_ws(e->nqh, nkv, (int)ncand);
        if (need > e->sel.rs_ws_n) {
            CK(cudaDeviceSynchronize());
            gl_dfree(&e->sel.rs_ws);
            e->sel.rs_ws_n = 0;
            TRY(gl_dalloc(&e->sel.rs_ws, need, "resident selection workspace"));
            CK(cudaMemset(e->sel.rs_ws, 0, need));
            e->sel.rs_ws_n = need;
        }
    }
    cache_free(sp);
    if (e->o.sel_cache) TRY(cache_alloc(e, y));
    gl_dfree(&sp->keep);
    TRY(gl_dalloc(&sp->keep, (size_t)nkv * (sp->kmax + 1) * sizeof(int), "kept selection ids"));
    sp->keep_pos = -1;
    return KV_OK;
}

/* opts changed between steps (the device is idle): the cache's buffers, a
 * fresh start for its tags and counts; the wide top-K's workspace. */
static kv_status sparse_step_opts(kv_gpu_engine *e, gl_layer *y)
{
    sparse_state *sp = y->st;
    if (!sp->ak) return KV_OK; /* nothing ingested yet */
    if (e->o.topk_wide && !e->sel.tw_ws)
        TRY(gl_dalloc(&e->sel.tw_ws, eng_topk_wide_ws(e->nkv), "top-K workspace"));
    if (e->o.sel_cache) return cache_alloc(e, y);
    cache_free(sp);
    return KV_OK;
}

/* Blocks per KV head of a side kernel: opts' value, its default for 0, the
 * widest grid (0 to the launcher) for < 0. */
static int blocks_of(int o, int dflt) { return o == 0 ? dflt : o < 0 ? 0 : o; }

_Static_assert(KV_GPU_SELK_LATE == ENG_SEL_LATE && KV_GPU_SELK_NOPDL == ENG_SEL_NOPDL &&
                   KV_GPU_SELK_COLLECT == ENG_SEL_COLLECT && KV_GPU_SELK_DIRECT == ENG_SEL_DIRECT,
               "opts.sel_kernels bits are eng_resident_select's flags");

/* eng_resident_select's flags of opts.sel_kernels (0: the default). */
static int sel_flags(int k)
{
    return k & KV_GPU_SELK_SET ? k & (ENG_SEL_LATE | ENG_SEL_NOPDL | ENG_SEL_COLLECT | ENG_SEL_DIRECT) : KV_GPU_SELK_DEFAULT;
}

void kv_gpu_engine_set_sel_kernels(kv_gpu_engine *e, int sel_kernels, int sel_every)
{
    e->o.sel_kernels = sel_kernels;
    e->o.sel_every = sel_every;
}
void kv_gpu_engine_set_sel_skip(kv_gpu_engine *e, unsigned sel_skip) { e->o.sel_skip = sel_skip; }

/* Top-K of comb on stream s, one block per KV head or (opts.topk_wide) many. */
static kv_status run_topk(kv_gpu_engine *e, const float *comb, int ncand, int kk, int cs, int *sel,
                          cudaStream_t s)
{
    if (e->o.topk_wide && e->sel.tw_ws)
        CK(eng_topk_wide(comb, e->nkv, ncand, kk, cs, sel, e->sel.tw_ws, s));
    else
        CK(eng_topk(comb, e->nkv, ncand, kk, cs, sel, s));
    return KV_OK;
}

/*
 * Token selection for this step (T tokens after the append), with query q
 * (n_heads, hd) float, on stream s, then the gather of the chosen rows on
 * stream sg (which may be s).  Fills rows [start, start + kk + cs) of the
 * attention buffer and sets start/natt.  The gather runs on its own stream
 * on the selection path so that the next layer's scoring overlaps this
 * layer's PCIe reads.
 */
static kv_status sparse_select(kv_gpu_engine *e, gl_layer *y, const float *q, cudaStream_t s,
                               cudaStream_t sg)
{
    sparse_state *sp = y->st;
    const int l = y->l;
    /* opts.sel_every: ids the layer keeps (reused until sel_every steps have passed) */
    const bool keeping = e->o.sel_every >= 2 && sp->keep;
    int *sel = keeping ? sp->keep : e->sel.sel[l % 3];
    bool g0_done = false; /* profile: first host read recorded */
    const kv_policy_params *p = &y->prm;
    const int T = e->pos + 1, nkv = e->nkv, hd = e->hd;
    const unsigned skip = e->o.sel_skip;
    int cs, cend;
    cand_range(p, sp->Tp, T, &cs, &cend);
    if (cs > sp->cs0) { /* a prompt shorter than the sink: every token is resident */
        cs = sp->cs0;
        cend = sp->cs0;
    }
    int ncand = cend - cs;
    int kk = topk_of(p, T);
    if (kk > ncand) kk = ncand;
    if (kk > sp->kmax) kk = sp->kmax;
    if (kk < 0) kk = 0;
    sp->start = sp->tail_base + (cend - sp->cend0) - cs - kk;
    sp->natt = kk + cs + (T - cend);
    const uint64_t rowb = (uint64_t)2 * hd * 2; /* one head's K and V of a token */
    uint64_t fetched = (uint64_t)kk * nkv * rowb;
    if (e->o.no_fetch) {
        y->fetched_last = 0;
        return KV_OK;
    }
    if (!keeping) {
        sp->keep_pos = -1;
    } else if (sp->keep_pos >= 0 && e->pos - sp->keep_pos < e->o.sel_every && sp->keep_kk == kk &&
               sp->keep_cs == cs) {
        goto gather; /* the kept ids: no scoring, no top-K */
    } else {
        sp->keep_pos = e->pos;
        sp->keep_kk = kk;
        sp->keep_cs = cs;
    }
    if (kk > 0) {
        if (kk < ncand) {
            if (p->select == KV_SELECT_SKETCH) {
                /* per-head scores then the softmax pass: eng_sketch_combine avoids
                 * writing the scores but measured slower (docs/BENCHMARKS.md, GPU decode) */
                if (!(skip & KV_GPU_SKIP_SCORES))
                    CK(eng_score_sketch(q, sp->sketch, sp->Tp, sp->kmad, e->nqh, nkv, hd, cs, cend,
                                        e->sel.score, s));
            } else if (p->select == KV_SELECT_RESIDENT) {
                const int C = p->channels < sp->R ? p->channels : sp->R;
                if (!e->o.sel_classic && !(skip & (KV_GPU_SKIP_SCORES | KV_GPU_SKIP_SOFTMAX | KV_GPU_SKIP_TOPK)) &&
                    e->sel.rs_ws && eng_topk_many_fits(ncand)) {
                    /* the chain of short many-block kernels: scores, softmax,
                     * combine and top-K (kernels/eng_select_fast.cu) */
                    CK(eng_resident_select(q, sp->chmax, sp->pool, sp->R, C, sp->rrows, sp->rscale,
                                           sp->rzero, sp->ldt, p->cbits, e->nqh, nkv, hd, cs, cend,
                                           p->group_reduce == KV_REDUCE_MAX, kk, e->sel.comb,
                                           e->sel.chans, e->sel.qscale, sel, e->sel.rs_ws,
                                           blocks_of(e->o.sel_blocks, KV_GPU_SEL_BLOCKS),
                                           sel_flags(e->o.sel_kernels), s));
                    goto gather;
                }
                if (!(skip & KV_GPU_SKIP_SCORES)) {
                    CK(eng_select_pool(q, sp->chmax, sp->pool, e->nqh, nkv, hd, sp->R, C,
                                       e->sel.chans, e->sel.qscale, s));
                    CK(eng_score_rows(q, sp->pool, e->sel.chans, e->sel.qscale, sp->rrows,
                                      sp->rscale, sp->rzero, sp->ldt, p->cbits, e->nqh, nkv, hd,
                                      sp->R, C, cs, cend, e->sel.score, s));
                }
            } else if (p->select == KV_SELECT_PAGES) {
                const int P = p->page, p0 = cs / P, np = (cend - 1) / P - p0 + 1;
                if (!(skip & KV_GPU_SKIP_SCORES))
                    CK(eng_score_pages(q, sp->pmin, sp->pmax, sp->np, e->nqh, nkv, hd, p0, np,
                                       e->sel.score, s));
                /* pages' probabilities, then each token takes its page's */
                if (!(skip & KV_GPU_SKIP_SOFTMAX)) {
                    CK(eng_softmax_combine(e->sel.score, e->nqh, nkv, np,
                                           p->group_reduce == KV_REDUCE_MAX, e->sel.sm_tmp,
                                           e->sel.comb, s));
                    CK(eng_pages_expand(e->sel.comb, nkv, np, P, p0, cs, ncand, e->sel.score, s));
                }
                if (!(skip & KV_GPU_SKIP_TOPK)) TRY(run_topk(e, e->sel.score, ncand, kk, cs, sel, s));
                goto gather;
            } else if (p->select == KV_SELECT_EXACT) {
                if (e->o.profile) CK(cudaEventRecord(e->ev_g0[l], s)); /* host reads start here */
                g0_done = true;
                CK(eng_score_exact(q, sp->rows_d, KV_DT_F16, e->nqh, nkv, hd, cs, cend,
                                   e->sel.score, s));
                fetched += (uint64_t)ncand * nkv * hd * 2;
            } else {
                int C = p->channels;
                if (e->o.profile) CK(cudaEventRecord(e->ev_g0[l], s)); /* host reads start here */
                g0_done = true;
                CK(eng_select_channels(q, sp->chmax, e->nqh, nkv, hd, C, e->sel.chans,
                                       e->sel.qscale, s));
                CK(eng_score_channels(q, e->sel.chans, e->sel.qscale, sp->kcm_d, KV_DT_F16, sp->ldc,
                                      e->nqh, nkv, hd, C, cs, cend, e->sel.score, s));
                /* host reads are whole 16-byte runs of 8 tokens */
                int n8 = (cend - (cs & ~7) + 7) / 8 * 8;
                fetched += (uint64_t)nkv * C * n8 * 2;
            }
            if (!(skip & KV_GPU_SKIP_SOFTMAX))
                CK(eng_softmax_combine(e->sel.score, e->nqh, nkv, ncand,
                                       p->group_reduce == KV_REDUCE_MAX, e->sel.sm_tmp,
                                       e->sel.comb, s));
        } else {
            CK(eng_fill_f32(e->sel.comb, (size_t)nkv * ncand, 0.0f, s)); /* take every candidate */
        }
        if (!(skip & KV_GPU_SKIP_TOPK)) TRY(run_topk(e, e->sel.comb, ncand, kk, cs, sel, s));
    }
gather:
    if (e->o.profile) CK(cudaEventRecord(e->ev_t1[l], s));
    /* the cache's plan: which chosen rows are held already, where the others go */
    const bool cache = e->o.sel_cache && sp->tag && !(skip & KV_GPU_SKIP_GATHER);
    if (cache) {
        if (sp->cache_reset) { /* the rows from the tail's current start hold their tokens */
            CK(eng_sel_cache_reset(sp->tag, nkv, sp->ntag, sp->tail_base + (cend - sp->cend0), cend, s));
            sp->cache_reset = false;
        }
        CK(eng_sel_cache_plan(sel, kk, cs, nkv, sp->tag, sp->ntag, sp->start, sp->mcap, sp->plan,
                              sp->cstat, s));
    }
    if (sg != s) {
        CK(cudaEventRecord(e->ev_topk[l], s));
        CK(cudaStreamWaitEvent(sg, e->ev_topk[l], 0));
    }
    if (e->o.profile && !g0_done) CK(cudaEventRecord(e->ev_g0[l], sg));
    if (cache) {
        CK(eng_sel_cache_gather(sp->rows_d, nkv, hd, sp->plan, sp->mcap, cs, sp->sink, sp->ak, sp->av,
                                (size_t)sp->cap, sg));
    } else if (!(skip & KV_GPU_SKIP_GATHER)) {
        size_t off = (size_t)sp->start * hd;
        CK(eng_gather_rows_w(sp->rows_d, nkv, hd, KV_DT_F16, sel, kk, sp->sink, cs, sp->ak + off,
                             sp->av + off, (size_t)sp->cap, blocks_of(e->o.gather_blocks, KV_GPU_GATHER_BLOCKS),
                             sg));
        /* the rows of the region no longer hold what the tags say */
        if (sp->tag) sp->cache_reset = true;
    }
    if (e->o.profile) CK(cudaEventRecord(e->ev_g1[l], sg));
    const uint64_t rows_bytes = (uint64_t)kk * nkv * rowb;
    sp->extra_last = fetched - rows_bytes;
    y->fetched_last = fetched;
    /* with the cache, the rows actually read are counted on the device (sparse_bytes) */
    y->fetched_total += cache ? sp->extra_last : fetched;
    return KV_OK;
}

static kv_status sparse_slot(kv_gpu_engine *e, gl_layer *y, int pos, gl_row *r)
{
    sparse_state *sp = y->st;
    size_t row = (size_t)sp->tail_base + (size_t)(pos - sp->cend0);
    r->k = sp->ak + row * e->hd;
    r->v = sp->av + row * e->hd;
    r->hs = (size_t)sp->cap * e->hd;
    return KV_OK;
}

static kv_status sparse_attend(kv_gpu_engine *e, gl_layer *y, int pos, const float *q,
                               const gl_row *r)
{
    (void)pos;
    (void)r;
    sparse_state *sp = y->st;
    cudaStream_t s = e->s_main;
    if (gl_wants_pred(e, y->l)) {
        /* profile: main before and after its wait, the exposed part of the selection */
        if (e->o.profile) CK(cudaEventRecord(e->ev_w0[y->l], s));
        CK(cudaStreamWaitEvent(s, e->ev_sel[y->l], 0));
        if (e->o.profile) CK(cudaEventRecord(e->ev_w1[y->l], s));
    } else {
        /* the selection scratch is shared with the selection stream */
        if (e->sel.side_last >= 0) CK(cudaStreamWaitEvent(s, e->ev_sel[e->sel.side_last], 0));
        TRY(sparse_select(e, y, q, s, s));
    }
    return gl_attend_dense(e, sp->ak + (size_t)sp->start * e->hd, sp->av + (size_t)sp->start * e->hd,
                           (size_t)sp->cap * e->hd, sp->natt, s);
}

/* Host: the rows (and the channel-major keys); resident: the attention
 * buffer (gathered + sink + tail + generated rows, allocated for the whole
 * context), the key statistics, the sink rows and the sketch. */
static void sparse_bytes(const kv_gpu_engine *e, const gl_layer *y, kv_bytes *b)
{
    const sparse_state *sp = y->st;
    const uint64_t nkv = (uint64_t)e->nkv, hd = (uint64_t)e->hd, Tp = (uint64_t)sp->Tp;
    b->host = 2 * nkv * Tp * hd * 2 + (sp->kcm_h ? nkv * hd * (uint64_t)sp->ldc * 2 : 0);
    b->resident = 2 * nkv * (uint64_t)sp->cap * hd * 2 + 3 * nkv * hd * 4 +
                  (sp->sink ? (uint64_t)sp->cs0 * nkv * 2 * hd * 2 : 0) +
                  (sp->sketch ? nkv * Tp * hd / 8 : 0) +
                  (sp->pool ? nkv * (uint64_t)sp->R * 4 : 0) +
                  (sp->rrows ? nkv * (uint64_t)sp->R *
                                   (y->prm.cbits >= 16 ? (uint64_t)sp->ldt * 2
                                                       : (uint64_t)sp->ldt * y->prm.cbits / 8 +
                                                             (uint64_t)sp->ldt / KV_SELECT_CGROUP * 4)
                              : 0) +
                  (sp->pmin ? 2 * nkv * (uint64_t)sp->np * hd * 2 : 0) +
                  (sp->tag ? nkv * ((uint64_t)sp->ntag + 1 + 2 * (uint64_t)sp->mcap) * 4 + nkv * 32
                           : 0);
    if (sp->cstat && e->o.sel_cache) { /* the rows the cache read from host memory */
        unsigned long long c[4 * 64];
        int n = e->nkv < 64 ? e->nkv : 64;
        if (cudaMemcpy(c, sp->cstat, (size_t)n * 32, cudaMemcpyDeviceToHost) != cudaSuccess) {
            (void)cudaGetLastError();
            return;
        }
        uint64_t last = 0, tot = 0;
        for (int h = 0; h < n; h++) {
            last += c[4 * h + 2];
            tot += c[4 * h + 3];
        }
        const uint64_t rowb = 2 * hd * 2;
        b->fetched_last = sp->extra_last + last * rowb;
        b->fetched_total += tot * rowb;
    }
}

static void sparse_timing(const kv_gpu_engine *e, const gl_layer *y, kv_gpu_timing *t)
{
    const sparse_state *sp = y->st;
    if (sp->cstat && e->o.sel_cache) {
        unsigned long long c[4 * 64];
        int n = e->nkv < 64 ? e->nkv : 64;
        if (cudaMemcpy(c, sp->cstat, (size_t)n * 32, cudaMemcpyDeviceToHost) == cudaSuccess) {
            for (int h = 0; h < n; h++) {
                t->cache_hits += c[4 * h];
                t->cache_rows += c[4 * h + 1];
            }
        } else {
            (void)cudaGetLastError();
        }
    }
    if (!gl_wants_pred(e, y->l) || e->o.no_fetch) return;
    t->select_ms += gl_elapsed(e->ev_p0[y->l], e->ev_p1[y->l]);
    t->fetch_ms += gl_elapsed(e->ev_g0[y->l], e->ev_g1[y->l]);
    t->score_ms += gl_elapsed(e->ev_p0[y->l], e->ev_t1[y->l]);
    t->wait_ms += gl_elapsed(e->ev_w0[y->l], e->ev_w1[y->l]);
}

static void sparse_release(gl_layer *y)
{
    sparse_state *sp = y->st;
    gl_hfree(&sp->rows_h);
    gl_hfree(&sp->kcm_h);
    sp->rows_d = sp->kcm_d = NULL;
    cache_free(sp);
    gl_dfree(&sp->keep);
    void *dev[] = {&sp->sink, &sp->sketch, &sp->chmax, &sp->kmean, &sp->kmad, &sp->ak, &sp->av,
                   &sp->pool, &sp->rrows, &sp->rscale, &sp->rzero, &sp->obs, &sp->pmin, &sp->pmax};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) gl_dfree(dev[i]);
}

const gl_placement gl_sparse = {
    .name = "sparse",
    .configure = sparse_configure,
    .alloc = sparse_alloc,
    .ingest = sparse_ingest,
    .chunk = sparse_chunk,
    .observe = sparse_observe,
    .select = sparse_select,
    .slot = sparse_slot,
    .attend = sparse_attend,
    .bytes = sparse_bytes,
    .timing = sparse_timing,
    .step_opts = sparse_step_opts,
    .release = sparse_release,
};

#endif /* KV_HAVE_CUDA */
