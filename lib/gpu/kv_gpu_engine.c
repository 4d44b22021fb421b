/*
 * kv_gpu_engine: the decode engine on a CUDA GPU (see kv_gpu_engine.h).  The
 * layer loop is lib/engine/kv_engine.c's on the main stream, with the RMSNorms and
 * the SwiGLU fused into the GEMVs that consume them and the residual adds
 * into the GEMVs that produce them; what differs per layer is where its K/V
 * live and how attention reaches them.  Two more streams carry the work that should hide behind the
 * layer loop: the selection stream (a sparse layer's predicted query, token
 * scores, top-K and the gather of the chosen rows from pinned host memory,
 * one layer ahead) and the copy stream (the offload baseline's per-layer
 * K/V copies, two layers ahead, double-buffered).  Events order the streams;
 * the host never waits inside a step.
 *
 * Everything that touches CUDA is behind KV_HAVE_CUDA; a CPU-only build gets
 * the stubs at the end, which report the GPU engine unavailable.
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
    o->wtype = KV_GPU_W_AUTO;
}

#ifdef KV_HAVE_CUDA

#include <cuda_runtime_api.h>

#include "eng_ops.cuh"
#include "common/kv_finite.h"
#include "common/kv_half.h"
#include "kv_kernels.h"
#include "quant/kv_dsq.h"
#include "model/kv_matmul.h"
#include "quant/kv_quant.h"

// --- errors -------------------------------------------------------------------

static kv_status cuda_fail(cudaError_t e, const char *what, int line)
{
    (void)cudaGetLastError();
    if (e == cudaErrorMemoryAllocation)
        return kv_fail(KV_E_NOMEM, "GPU out of memory (%s, kv_gpu_engine.c:%d)", what, line);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorInvalidDevice)
        return kv_fail(KV_E_UNAVAILABLE, "CUDA: %s (%s)", cudaGetErrorString(e), what);
    const char *d = kv_cuda_last_error();
    return kv_fail(KV_E_INTERNAL, "CUDA error: %s in %s (kv_gpu_engine.c:%d)%s%s",
                   cudaGetErrorString(e), what, line, d && *d ? "; " : "", d ? d : "");
}

#define CK(call)                                                                  \
    do {                                                                          \
        cudaError_t ck_e_ = (call);                                               \
        if (ck_e_ != cudaSuccess) return cuda_fail(ck_e_, #call, __LINE__);       \
    } while (0)

#define TRY(expr)                                                                 \
    do {                                                                          \
        kv_status try_st_ = (expr);                                               \
        if (try_st_ != KV_OK) return try_st_;                                     \
    } while (0)

static kv_status dalloc(void *pp, size_t bytes, const char *what)
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

static void dfree(void *pp)
{
    void **p = (void **)pp;
    if (*p) cudaFree(*p);
    *p = NULL;
}

/* Pinned, mapped host memory: the copy engines read it at full PCIe speed
 * and kernels read it directly through *dev. */
static kv_status halloc(void *pp, const void **dev, size_t bytes, const char *what)
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
            return cuda_fail(e, "cudaHostGetDevicePointer", __LINE__);
        }
        *dev = d;
    }
    return KV_OK;
}

static void hfree(void *pp)
{
    void **p = (void **)pp;
    if (*p) cudaFreeHost(*p);
    *p = NULL;
}

// --- state ----------------------------------------------------------------------

/* L_QDQ: a `quant` layer outside the packed-attention kernel's geometry
 * (expanded to fp16 per step); L_STREAM: `streaming` (sink + recent ring);
 * L_DSQ: `dsq` (packed windows expanded to fp16 per step). */
enum { L_FULL = 0, L_OFFLOAD, L_QUANT, L_SPARSE, L_QDQ, L_STREAM, L_DSQ };

typedef struct {
    void *qkv;        /* (n_heads*hd + 2*n_kv*hd, ld_dim) */
    void *o;          /* (dim, ld_qd) */
    void *gu;         /* (2*hidden, ld_dim): gate and up rows interleaved */
    void *down;       /* (dim, ld_hid) */
    float *attn_norm; /* (dim) */
    float *ffn_norm;  /* (dim) */
    bool owner;       /* false when the matrices are an earlier layer's (synthetic models) */
} gw_layer;

typedef struct {
    kv_policy_params prm;
    int kind;
    int T; /* tokens held */
    /* full: (nkv, ctx, hd) on the GPU; offload: the same in pinned host memory */
    uint16_t *k, *v;          /* (nkv, ctx, hd) device (full); (nkv, S+W, hd) (streaming) */
    uint16_t *hk, *hv;        /* (nkv, ctx, hd) pinned host (offload) */
    /* quant: packed part dense over nq tokens (kv_layout.h), residual rows in
     * one of two (nkv, rc, hd) stores */
    kv_kivi_params kp;
    int nq, nres, rc, cur;
    uint8_t *kc, *vc;         /* (nkv, nq, hd*bits/8) */
    uint16_t *ks, *kz;        /* (nkv, nq/G, hd) */
    uint16_t *vs, *vz;        /* (nkv, nq, hd/Gv) */
    uint16_t *rk[2], *rv[2];  /* (nkv, rc, hd) */
    /* quant outside the kernels' geometry (L_QDQ): kc..vz at capacity qcap
     * in lib/policy/kv_policy_quant.c's layout (eng_kivi_layer), key scales
     * (nkv, ngk, hd), the residual ring in rk[0], rv[0] (nkv, rc, hd) */
    int qcap, ngk;
    /* dsq (L_DSQ): windows packed on the host, resident at capacity nwmax
     * (eng_dsq_layer; codes in kc/vc, scales and zeros in ks/kz/vs/vz at
     * (nkv, nwmax, W-S, hd/gd)); tokens not yet packed in rk[0], rv[0] (nkv, rc, hd) */
    kv_dsq_params dp;
    int nwmax, packed, obs_n;
    uint8_t *dmask;           /* (nkv, nwmax, W/8) */
    int8_t *ksal, *vsal;      /* (nkv, nwmax, S, hd) */
    uint16_t *ksscale, *vsscale, *kbase; /* (nkv, nwmax, hd) */
    float *imp;               /* (nkv, ctx) accumulated attention per token */
    float *obs;               /* (DSQ_OBSERVE, n_heads*hd) the prompt's last queries */
    /* sparse */
    int Tp, cs0, cend0, kmax, tail_base, cap, ldc;
    uint16_t *rows_h;         /* pinned (Tp, nkv, 2, hd) */
    const void *rows_d;       /* its device alias */
    uint16_t *kcm_h;          /* pinned (nkv, hd, ldc) keys channel-major */
    const void *kcm_d;        /* its device alias */
    uint16_t *sink;           /* (cs0, nkv, 2, hd) device */
    uint8_t *sketch;          /* (nkv, Tp, hd/8) device */
    float *chmax, *kmean, *kmad; /* (nkv, hd) device */
    uint16_t *ak, *av;        /* (nkv, cap, hd): [gathered | sink | prompt tail | generated] */
    int start, natt;          /* rows attended in the current step */
    /* accounting */
    uint64_t fetched_last, fetched_total, attends;
} gl_layer;

struct kv_gpu_engine {
    const kv_model *m;
    kv_gpu_engine_opts o;
    char devname[384];
    int L, ctx, pos;
    int dim, hidden, nqh, nkv, hd, vocab, qd, kvd;
    int ld_dim, ld_qd, ld_hid;
    float eps, scale;
    bool own_attn;       /* KV_GPU_OWN_ATTN: eng_attend for every layer */
    unsigned sel_skip;   /* KV_GPU_SEL_SKIP (measurement only): selection steps left out,
                            1 scores, 2 softmax/combine, 4 top-K, 8 gather, 16 query GEMV */
    eng_dtype wt;
    gw_layer *w;         /* (L) */
    void *embd, *outw;   /* (vocab, ld_dim) */
    float *out_norm;     /* (dim) */
    float *inv_freq;     /* (hd/2) device */
    uint64_t wbytes, wread;
    cudaStream_t s_main, s_side, s_gath, s_copy;
    /* activations (float32, padded to ld_* with zeros) */
    float *x;            /* (ld_dim) residual stream */
    float *xp[2];        /* (ld_dim) normalized input of the predicted layer, by parity */
    float *qkv;          /* (n_heads*hd + 2*n_kv*hd) projections, q then k then v */
    float *att;          /* (ld_qd) attention output */
    float *hb;           /* (ld_hid) SwiGLU output */
    float *logits;       /* (vocab) */
    float *qpred;        /* (n_heads*hd) predicted query (selection stream) */
    uint16_t *q16;       /* (n_heads*hd) fp16 query for kernels/ */
    int *d_tok;          /* (tok_cap) token ids */
    int tok_cap;
    int *h_tok;          /* pinned (1) */
    /* attention scratch */
    void *ws;
    size_t ws_bytes;
    float *att_part;     /* eng_attend partials */
    size_t att_part_n;
    uint16_t *dres_k, *dres_v; /* (nkv, rc_max, hd) dense residual for kernels/ */
    size_t dres_n;
    uint16_t *qx_k, *qx_v; /* (nkv, ctx, hd) fp16 expansion of an L_QDQ/L_DSQ layer, per step */
    size_t qx_n;
    float *imp_sc;         /* (nkv, ctx) attention-probability scratch (L_DSQ) */
    /* selection scratch (selection stream; layers take turns) */
    float *score;        /* (n_heads, candidates) token scores per query head */
    float *comb;         /* (nkv, candidates) scores combined over each KV group */
    float *sm_tmp;       /* eng_softmax_tmp(n_heads) floats of softmax scratch */
    float *qscale;       /* (n_heads) channel-selection scale per query head */
    int *chans, *sel[2]; /* sel: by layer parity, so a gather overlaps the next selection */
    size_t score_n, sel_n[2], chans_n;
    /* offload staging: two (nkv, ctx, hd) buffers each for K and V */
    uint16_t *stage_k[2], *stage_v[2];
    int *off_list, n_off; /* (L) indices of the offloaded layers, n_off used */
    cudaEvent_t ev_done[2], ev_rope;
    cudaEvent_t *ev_x, *ev_sel, *ev_copied; /* (L) */
    cudaEvent_t *ev_topk;                   /* (L) selection done, gather may start */
    cudaEvent_t *ev_p0, *ev_p1, *ev_g0, *ev_g1; /* (L) profile: selection start/end, gather */
    gl_layer *lay;       /* (L) */
};

static int pad8(int n) { return (n + 7) & ~7; }

static int wants_pred(const kv_gpu_engine *e, int l)
{
    return l >= 1 && e->lay[l].kind == L_SPARSE && e->lay[l].prm.predict;
}

static int topk_of(const kv_policy_params *p, int T)
{
    if (p->topk > 0) return p->topk;
    return (int)ceil(p->topk_frac * (double)T);
}

/* The sparse layer's candidate range at T tokens, as kv_policy_sparse.c. */
static void cand_range(const gl_layer *y, int T, int *cs, int *cend)
{
    int a = y->prm.sink < T ? y->prm.sink : T;
    int e = T - y->prm.window;
    if (e > y->Tp) e = y->Tp;
    if (e < a) e = a;
    *cs = a;
    *cend = e;
}

/* fp16 attention from kernels/ where it has the geometry; the engine's own
 * eng_attend otherwise (or everywhere with KV_GPU_OWN_ATTN set, to compare). */
static bool use_kernels_f16(const kv_gpu_engine *e)
{
    if (e->own_attn) return false;
    int g = e->nqh / e->nkv;
    return (e->hd == 64 || e->hd == 128) && (g == 1 || g == 2 || g == 4 || g == 8);
}

static kv_status ensure_ws(kv_gpu_engine *e, size_t bytes)
{
    if (bytes <= e->ws_bytes) return KV_OK;
    CK(cudaDeviceSynchronize());
    dfree(&e->ws);
    e->ws_bytes = 0;
    TRY(dalloc(&e->ws, bytes, "attention workspace"));
    e->ws_bytes = bytes;
    return KV_OK;
}

// --- weights --------------------------------------------------------------------

/*
 * Upload the rows of nparts matrices (same cols) as one (sum rows, ld)
 * matrix of the engine's weight type, zero-padded to ld: one after another,
 * or with interleave (two parts of equal rows) as a0, b0, a1, b1, ... (the
 * gate/up layout of the fused SwiGLU GEMV).  Rows are converted on the host
 * in chunks through one staging buffer.
 */
static kv_status upload_matrix(kv_gpu_engine *e, const kv_weight *const *parts, int nparts, int ld,
                               bool interleave, void **dst, const char *what)
{
    size_t rows = 0;
    int cols = parts[0]->cols;
    for (int i = 0; i < nparts; i++) {
        if (parts[i]->cols != cols || !parts[i]->data)
            return kv_fail(KV_E_DATA, "%s: parts of different widths", what);
        if (interleave && parts[i]->rows != parts[0]->rows)
            return kv_fail(KV_E_DATA, "%s: interleaved parts of different heights", what);
        rows += (size_t)parts[i]->rows;
    }
    TRY(dalloc(dst, rows * (size_t)ld * 2, what));
    e->wbytes += rows * (size_t)ld * 2;
    const size_t chunk = 4096; /* rows per staging round */
    uint16_t *stage = malloc(chunk * (size_t)ld * 2);
    if (!stage) return kv_fail(KV_E_NOMEM, "out of memory staging %s", what);
    kv_status st = KV_OK;
    for (size_t r0 = 0; r0 < rows && !st; r0 += chunk) {
        int nr = rows - r0 < chunk ? (int)(rows - r0) : (int)chunk;
        int bad = 0;
#pragma omp parallel for schedule(static)
        for (int r = 0; r < nr; r++) {
            size_t ro = r0 + (size_t)r; /* output row -> (part, row) */
            int part = 0;
            size_t rs = ro;
            if (interleave) {
                part = (int)(ro % (size_t)nparts);
                rs = ro / (size_t)nparts;
            } else {
                while (rs >= (size_t)parts[part]->rows) rs -= (size_t)parts[part++]->rows;
            }
            const kv_weight *w = parts[part];
            bool same = (w->type == KV_W_F16 && e->wt == ENG_F16) ||
                        (w->type == KV_W_BF16 && e->wt == ENG_BF16);
            uint16_t *o = stage + (size_t)r * ld;
            if (same) {
                memcpy(o, (const uint8_t *)w->data + rs * (size_t)cols * 2, (size_t)cols * 2);
            } else {
                float *f = malloc((size_t)cols * sizeof(float));
                if (!f) {
#pragma omp atomic write
                    bad = 1;
                    continue;
                }
                kv_weight_row(w, (int)rs, f);
                for (int c = 0; c < cols; c++)
                    o[c] = e->wt == ENG_BF16 ? kv_f32_to_bf16(f[c]) : kv_f32_to_half(f[c]);
                free(f);
            }
            for (int c = cols; c < ld; c++) o[c] = 0;
        }
        if (bad) {
            st = kv_fail(KV_E_NOMEM, "out of memory converting %s", what);
            break;
        }
        cudaError_t ce = cudaMemcpy((uint8_t *)*dst + r0 * (size_t)ld * 2, stage, (size_t)nr * ld * 2,
                                    cudaMemcpyHostToDevice);
        if (ce != cudaSuccess) st = cuda_fail(ce, "weight upload", __LINE__);
    }
    free(stage);
    return st;
}

/* n floats, zero-padded to a multiple of 8 (GEMV inputs are read in 8s). */
static kv_status upload_f32(const float *src, int n, float **dst, const char *what)
{
    TRY(dalloc(dst, (size_t)pad8(n) * sizeof(float), what));
    CK(cudaMemset(*dst, 0, (size_t)pad8(n) * sizeof(float)));
    CK(cudaMemcpy(*dst, src, (size_t)n * sizeof(float), cudaMemcpyHostToDevice));
    return KV_OK;
}

static bool same_layer_weights(const kv_layer_weights *a, const kv_layer_weights *b)
{
    return a->wq.data == b->wq.data && a->wk.data == b->wk.data && a->wv.data == b->wv.data &&
           a->wo.data == b->wo.data && a->w_gate.data == b->w_gate.data &&
           a->w_up.data == b->w_up.data && a->w_down.data == b->w_down.data;
}

static kv_status load_weights(kv_gpu_engine *e)
{
    const kv_model *m = e->m;
    for (int l = 0; l < e->L; l++) {
        const kv_layer_weights *lw = &m->layers[l];
        gw_layer *w = &e->w[l];
        int share = -1;
        /* synthetic models share one set of layer weights: keep one copy on
         * the GPU (each layer still reads all of it per step) */
        for (int j = 0; j < l && share < 0; j++)
            if (same_layer_weights(lw, &m->layers[j])) share = j;
        if (share >= 0) {
            const gw_layer *s = &e->w[share];
            w->qkv = s->qkv;
            w->o = s->o;
            w->gu = s->gu;
            w->down = s->down;
            w->owner = false;
        } else {
            const kv_weight *qkv[3] = {&lw->wq, &lw->wk, &lw->wv};
            const kv_weight *o[1] = {&lw->wo};
            const kv_weight *gu[2] = {&lw->w_gate, &lw->w_up};
            const kv_weight *dn[1] = {&lw->w_down};
            w->owner = true;
            TRY(upload_matrix(e, qkv, 3, e->ld_dim, false, &w->qkv, "layer wq/wk/wv"));
            TRY(upload_matrix(e, o, 1, e->ld_qd, false, &w->o, "layer wo"));
            TRY(upload_matrix(e, gu, 2, e->ld_dim, true, &w->gu, "layer w_gate/w_up"));
            TRY(upload_matrix(e, dn, 1, e->ld_hid, false, &w->down, "layer w_down"));
        }
        TRY(upload_f32(lw->attn_norm, e->dim, &w->attn_norm, "attn_norm"));
        TRY(upload_f32(lw->ffn_norm, e->dim, &w->ffn_norm, "ffn_norm"));
    }
    const kv_weight *em[1] = {&m->tok_embd};
    TRY(upload_matrix(e, em, 1, e->ld_dim, false, &e->embd, "token embedding"));
    if (m->cfg.shared_classifier || m->output.data == m->tok_embd.data) {
        e->outw = e->embd;
    } else {
        const kv_weight *ou[1] = {&m->output};
        TRY(upload_matrix(e, ou, 1, e->ld_dim, false, &e->outw, "classifier"));
    }
    TRY(upload_f32(m->output_norm, e->dim, &e->out_norm, "output_norm"));
    /* bytes one decode step reads: every layer's matrices and the classifier */
    uint64_t per_layer = ((uint64_t)(e->qd + 2 * e->kvd) * e->ld_dim + (uint64_t)e->dim * e->ld_qd +
                          (uint64_t)2 * e->hidden * e->ld_dim + (uint64_t)e->dim * e->ld_hid) * 2u;
    e->wread = per_layer * (uint64_t)e->L + (uint64_t)e->vocab * e->ld_dim * 2u;
    return KV_OK;
}

// --- layer placements -------------------------------------------------------------

static void layer_release(gl_layer *y)
{
    dfree(&y->k);
    dfree(&y->v);
    hfree(&y->hk);
    hfree(&y->hv);
    dfree(&y->kc);
    dfree(&y->vc);
    dfree(&y->ks);
    dfree(&y->kz);
    dfree(&y->vs);
    dfree(&y->vz);
    for (int i = 0; i < 2; i++) {
        dfree(&y->rk[i]);
        dfree(&y->rv[i]);
    }
    hfree(&y->rows_h);
    hfree(&y->kcm_h);
    y->rows_d = y->kcm_d = NULL;
    dfree(&y->sink);
    dfree(&y->sketch);
    dfree(&y->chmax);
    dfree(&y->kmean);
    dfree(&y->kmad);
    dfree(&y->ak);
    dfree(&y->av);
    dfree(&y->dmask);
    dfree(&y->ksal);
    dfree(&y->vsal);
    dfree(&y->ksscale);
    dfree(&y->vsscale);
    dfree(&y->kbase);
    dfree(&y->imp);
    dfree(&y->obs);
    kv_policy_params prm = y->prm;
    int kind = y->kind;
    memset(y, 0, sizeof *y);
    y->prm = prm;
    y->kind = kind;
}

static void release_all(kv_gpu_engine *e)
{
    if (!e->lay) return;
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    for (int l = 0; l < e->L; l++) layer_release(&e->lay[l]);
    for (int i = 0; i < 2; i++) {
        dfree(&e->stage_k[i]);
        dfree(&e->stage_v[i]);
    }
    e->n_off = 0;
    e->pos = 0;
}

/* Check and set each layer's kind from its params (no allocation yet). */
static kv_status set_policies(kv_gpu_engine *e, const kv_policy_params *per_layer)
{
    for (int l = 0; l < e->L; l++) {
        gl_layer *y = &e->lay[l];
        if (per_layer) y->prm = per_layer[l];
        const kv_policy_params *p = &y->prm;
        switch (p->kind) {
        case KV_POL_FULL:
            y->kind = p->offload ? L_OFFLOAD : L_FULL;
            break;
        case KV_POL_QUANT: {
            kv_cuda_attn_dims d = {e->nqh, e->nkv, e->hd, e->ctx, 0, e->scale};
            kv_kivi_params kp = {p->bits, p->group, p->residual};
            kv_status qst = kv_kivi_check(&kp, e->hd);
            if (qst) {
                kv_errcontext("layer %d", l);
                return qst;
            }
            /* D's packed attention where it applies; elsewhere the same
             * packed bytes, expanded to fp16 each step (L_QDQ) */
            y->kind = kv_cuda_attn_kivi_supported(&d, &kp) &&
                              kv_cuda_kivi_pack_supported(KV_KIVI_KEYS, &kp, e->hd) &&
                              kv_cuda_kivi_pack_supported(KV_KIVI_VALUES, &kp, e->hd)
                          ? L_QUANT
                          : L_QDQ;
            break;
        }
        case KV_POL_DSQ: {
            /* Windows are packed on the host by lib/quant/kv_dsq.c from importance
             * accumulated on the GPU.  The salient choice is a ranking of
             * accumulated attention, so an fp16-level difference can swap
             * two near-tied tokens and then the window's whole quantization
             * noise differs from the CPU's: the device tests compare the
             * packing exactly with salient=0 and the policy's fidelity
             * statistics otherwise (tests/unit/test_gpu_engine.c). */
            y->kind = L_DSQ;
            kv_dsq_params_default(&y->dp);
            y->dp.window = p->dsq_window;
            y->dp.salient = kv_dsq_salient_count(p->dsq_window, p->dsq_salient);
            kv_status dst = kv_dsq_check(&y->dp, e->hd);
            if (dst) {
                kv_errcontext("layer %d", l);
                return dst;
            }
            if (p->hcap_token_keep < 1.0 || p->hcap_channel_thresh > 0.0)
                return kv_fail(KV_E_UNSUPPORTED, "layer %d: dsq with HCAP (keep < 1 or chan > 0) "
                               "is not on the GPU engine; use --device cpu", l);
            break;
        }
        case KV_POL_STREAMING:
            y->kind = L_STREAM;
            if (p->sink < 0 || p->window < 1)
                return kv_fail(KV_E_USAGE, "layer %d: streaming needs sink >= 0 and window >= 1 "
                               "(got %d, %d)", l, p->sink, p->window);
            break;
        case KV_POL_SPARSE:
            y->kind = L_SPARSE;
            if (p->sink < 0 || p->window < 0 || p->channels < 1 || p->channels > e->hd ||
                p->topk < 0 || !(p->topk_frac >= 0.0 && p->topk_frac <= 1.0))
                return kv_fail(KV_E_USAGE, "layer %d: bad sparse parameters", l);
            if (e->nqh / e->nkv > 8 || (e->hd & 7))
                return kv_fail(KV_E_UNSUPPORTED, "layer %d: sparse on the GPU needs a query "
                               "group of at most 8 and head_dim a multiple of 8", l);
            break;
        default:
            return kv_fail(KV_E_UNSUPPORTED, "layer %d: policy %s is not available on the GPU "
                           "engine", l, kv_policy_kind_name(p->kind));
        }
    }
    e->n_off = 0;
    for (int l = 0; l < e->L; l++)
        if (e->lay[l].kind == L_OFFLOAD) e->off_list[e->n_off++] = l;
    return KV_OK;
}

// --- quant outside the kernels' geometry (L_QDQ) ------------------------------------

/* The fp16 scratch a packed layer is expanded into each step (shared). */
static kv_status ensure_qx(kv_gpu_engine *e)
{
    size_t need = (size_t)e->nkv * (size_t)e->ctx * (size_t)e->hd;
    if (need <= e->qx_n) return KV_OK;
    dfree(&e->qx_k);
    dfree(&e->qx_v);
    e->qx_n = 0;
    TRY(dalloc(&e->qx_k, need * 2, "KV expansion scratch"));
    TRY(dalloc(&e->qx_v, need * 2, "KV expansion scratch"));
    e->qx_n = need;
    return KV_OK;
}

/* The packed planes at the layer's capacity (as lib/policy/kv_policy_quant.c holds
 * them), the residual ring, and the engine's fp16 expansion scratch. */
static kv_status qdq_alloc(kv_gpu_engine *e, gl_layer *y)
{
    const size_t nkv = (size_t)e->nkv, hd = (size_t)e->hd;
    y->kp = (kv_kivi_params){y->prm.bits, y->prm.group, y->prm.residual};
    y->rc = y->kp.residual + y->kp.group;
    y->qcap = e->ctx;
    y->ngk = e->ctx / y->kp.group + 1;
    const size_t crow = kv_kivi_row_bytes(e->hd, y->kp.bits);
    const size_t nvs = hd / (size_t)kv_kivi_vgroup(y->kp.group, e->hd);
    TRY(dalloc(&y->kc, nkv * (size_t)y->qcap * crow, "quant key codes"));
    TRY(dalloc(&y->vc, nkv * (size_t)y->qcap * crow, "quant value codes"));
    TRY(dalloc(&y->ks, nkv * (size_t)y->ngk * hd * 2, "quant key scales"));
    TRY(dalloc(&y->kz, nkv * (size_t)y->ngk * hd * 2, "quant key zeros"));
    TRY(dalloc(&y->vs, nkv * (size_t)y->qcap * nvs * 2, "quant value scales"));
    TRY(dalloc(&y->vz, nkv * (size_t)y->qcap * nvs * 2, "quant value zeros"));
    TRY(dalloc(&y->rk[0], nkv * (size_t)y->rc * hd * 2, "quant residual K"));
    TRY(dalloc(&y->rv[0], nkv * (size_t)y->rc * hd * 2, "quant residual V"));
    return ensure_qx(e);
}

static eng_kivi_layer qdq_view(const kv_gpu_engine *e, const gl_layer *y)
{
    eng_kivi_layer v = {e->nkv, e->hd, y->kp.bits, y->kp.group, kv_kivi_vgroup(y->kp.group, e->hd),
                        y->qcap, y->ngk, y->rc, y->nq, y->kc, y->vc, y->ks, y->kz, y->vs, y->vz,
                        y->rk[0], y->rv[0]};
    return v;
}

/*
 * Pack tokens [nq, nq + G) on the host with lib/quant/kv_quant.c's quantizers (so
 * the codes are the CPU policy's, bit for bit) and upload the group's parts.
 * Token t of head h is at xk (keys) or xv (values) + h*head_stride +
 * (t % mod)*hd (fp16, host).
 * Synchronous: this path is for correctness at any head_dim, not speed.
 */
static kv_status qdq_pack_kv(kv_gpu_engine *e, gl_layer *y, const uint16_t *xk,
                              const uint16_t *xv, size_t head_stride, int mod)
{
    const int hd = e->hd, G = y->kp.group, b = y->kp.bits, t0 = y->nq;
    const int gv = kv_kivi_vgroup(G, hd), nvs = hd / gv;
    const size_t crow = kv_kivi_row_bytes(hd, b);
    float *tmp = malloc((size_t)G * hd * sizeof(float));
    uint8_t *kc = malloc((size_t)G * crow), *vc = malloc((size_t)G * crow);
    kv_half *ks = malloc((size_t)hd * 2), *kz = malloc((size_t)hd * 2);
    kv_half *vs = malloc((size_t)G * nvs * 2), *vz = malloc((size_t)G * nvs * 2);
    kv_status st = KV_OK;
    if (!tmp || !kc || !vc || !ks || !kz || !vs || !vz) st = kv_fail(KV_E_NOMEM, "quant pack staging");
    for (int h = 0; h < e->nkv && !st; h++) {
        for (int i = 0; i < G; i++) {
            const uint16_t *r = xk + (size_t)h * head_stride + (size_t)((t0 + i) % mod) * hd;
            for (int c = 0; c < hd; c++) tmp[(size_t)i * hd + c] = kv_half_to_f32(r[c]);
        }
        kv_kivi_pack_key_group(tmp, (size_t)hd, G, hd, b, kc, crow, ks, kz);
        for (int i = 0; i < G; i++) {
            const uint16_t *r = xv + (size_t)h * head_stride + (size_t)((t0 + i) % mod) * hd;
            for (int c = 0; c < hd; c++) tmp[c] = kv_half_to_f32(r[c]);
            kv_kivi_pack_value_row(tmp, hd, gv, b, vc + (size_t)i * crow, vs + (size_t)i * nvs,
                                   vz + (size_t)i * nvs);
        }
        size_t tok = (size_t)h * y->qcap + (size_t)t0, kg = ((size_t)h * y->ngk + (size_t)(t0 / G)) * hd;
        struct { void *dst; const void *src; size_t n; } up[6] = {
            {y->kc + tok * crow, kc, (size_t)G * crow}, {y->vc + tok * crow, vc, (size_t)G * crow},
            {y->ks + kg, ks, (size_t)hd * 2},           {y->kz + kg, kz, (size_t)hd * 2},
            {y->vs + tok * nvs, vs, (size_t)G * nvs * 2}, {y->vz + tok * nvs, vz, (size_t)G * nvs * 2},
        };
        for (int i = 0; i < 6 && !st; i++) {
            cudaError_t ce = cudaMemcpyAsync(up[i].dst, up[i].src, up[i].n, cudaMemcpyHostToDevice,
                                             e->s_main);
            if (ce == cudaSuccess) ce = cudaStreamSynchronize(e->s_main); /* staging is reused */
            if (ce != cudaSuccess) st = cuda_fail(ce, "quant group upload", __LINE__);
        }
    }
    free(vz);
    free(vs);
    free(kz);
    free(ks);
    free(vc);
    free(kc);
    free(tmp);
    if (!st) y->nq += G;
    return st;
}

/* After a token went into the ring: pack the oldest group once the CPU
 * policy would (kv_kivi_nquant grows), reading the ring back first. */
static kv_status qdq_maybe_pack(kv_gpu_engine *e, gl_layer *y, int T)
{
    y->nres = T - y->nq;
    if (kv_kivi_nquant(T, y->kp.group, y->kp.residual) <= y->nq) return KV_OK;
    size_t n = (size_t)e->nkv * y->rc * e->hd;
    uint16_t *ring = malloc(2 * n * 2);
    if (!ring) return kv_fail(KV_E_NOMEM, "quant ring staging");
    kv_status st = KV_OK;
    cudaError_t ce = cudaMemcpyAsync(ring, y->rk[0], n * 2, cudaMemcpyDeviceToHost, e->s_main);
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(ring + n, y->rv[0], n * 2, cudaMemcpyDeviceToHost, e->s_main);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(e->s_main);
    if (ce != cudaSuccess) st = cuda_fail(ce, "quant ring read-back", __LINE__);
    if (!st) st = qdq_pack_kv(e, y, ring, ring + n, (size_t)y->rc * e->hd, y->rc);
    free(ring);
    y->nres = T - y->nq;
    return st;
}

// --- dsq (L_DSQ) ---------------------------------------------------------------------

#define DSQ_OBSERVE 32 /* prompt queries a dsq layer observes: PREFILL_OBSERVE of kv_engine.c */

/* Copy n bytes host to device on the main stream and wait (staging is reused). */
static kv_status h2d_sync(kv_gpu_engine *e, void *dst, const void *src, size_t n, int line)
{
    cudaError_t ce = cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, e->s_main);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(e->s_main);
    return ce == cudaSuccess ? KV_OK : cuda_fail(ce, "upload", line);
}

static kv_status dsq_alloc(kv_gpu_engine *e, gl_layer *y)
{
    const kv_dsq_params *dp = &y->dp;
    const size_t nkv = (size_t)e->nkv, hd = (size_t)e->hd, W = (size_t)dp->window;
    const size_t S = (size_t)dp->salient, nn = W - S;
    const size_t nvs = hd / (size_t)kv_kivi_vgroup(dp->group, e->hd);
    const size_t crow = kv_kivi_row_bytes(e->hd, dp->bits);
    y->nwmax = e->ctx / dp->window;
    y->rc = dp->window; /* at most W tokens wait for their window to be packed */
    const size_t hw = nkv * (size_t)y->nwmax;
    TRY(dalloc(&y->dmask, hw * (W / 8), "dsq masks"));
    TRY(dalloc(&y->ksal, hw * S * hd, "dsq salient keys"));
    TRY(dalloc(&y->vsal, hw * S * hd, "dsq salient values"));
    TRY(dalloc(&y->ksscale, hw * hd * 2, "dsq salient key scales"));
    TRY(dalloc(&y->vsscale, hw * hd * 2, "dsq salient value scales"));
    TRY(dalloc(&y->kbase, hw * hd * 2, "dsq key bases"));
    TRY(dalloc(&y->kc, hw * nn * crow, "dsq key codes"));
    TRY(dalloc(&y->vc, hw * nn * crow, "dsq value codes"));
    TRY(dalloc(&y->ks, hw * nn * nvs * 2, "dsq key scales"));
    TRY(dalloc(&y->kz, hw * nn * nvs * 2, "dsq key zeros"));
    TRY(dalloc(&y->vs, hw * nn * nvs * 2, "dsq value scales"));
    TRY(dalloc(&y->vz, hw * nn * nvs * 2, "dsq value zeros"));
    TRY(dalloc(&y->rk[0], nkv * (size_t)y->rc * hd * 2, "dsq fp16 K"));
    TRY(dalloc(&y->rv[0], nkv * (size_t)y->rc * hd * 2, "dsq fp16 V"));
    TRY(dalloc(&y->imp, nkv * (size_t)e->ctx * 4, "dsq importance"));
    CK(cudaMemset(y->imp, 0, nkv * (size_t)e->ctx * 4));
    TRY(dalloc(&y->obs, (size_t)DSQ_OBSERVE * (size_t)e->qd * 4, "dsq observed queries"));
    if (!e->imp_sc) TRY(dalloc(&e->imp_sc, nkv * (size_t)e->ctx * 4, "attention probabilities"));
    return ensure_qx(e);
}

static eng_dsq_layer dsq_view(const kv_gpu_engine *e, const gl_layer *y)
{
    eng_dsq_layer v = {e->nkv, e->hd, y->dp.window, y->dp.salient, y->dp.bits,
                       kv_kivi_vgroup(y->dp.group, e->hd), y->nwmax, y->packed, y->rc,
                       y->dmask, y->ksal, y->vsal, y->ksscale, y->vsscale, y->kbase,
                       y->kc, y->vc, y->ks, y->kz, y->vs, y->vz, y->rk[0], y->rv[0]};
    return v;
}

/*
 * Pack window y->packed of every head on the host with lib/quant/kv_dsq.c (the
 * CPU policy's code: salient tokens by importance, then K and V) and
 * upload its parts.  Token t of head h is at xk/xv + h*head_stride +
 * (t % mod)*hd (fp16, host); imp: (nkv, imp_ld) host, the window's
 * importance at imp + h*imp_ld.  Synchronous, like the quant fallback.
 */
static kv_status dsq_pack_host(kv_gpu_engine *e, gl_layer *y, const uint16_t *xk,
                               const uint16_t *xv, size_t head_stride, int mod, const float *imp,
                               size_t imp_ld)
{
    const kv_dsq_params *dp = &y->dp;
    const int hd = e->hd, W = dp->window, S = dp->salient, nn = W - S, t0 = y->packed * W;
    const int nvs = hd / kv_kivi_vgroup(dp->group, hd);
    const size_t crow = kv_kivi_row_bytes(hd, dp->bits);
    float *xw = malloc((size_t)W * hd * sizeof(float));
    uint8_t *mask = malloc((size_t)W / 8 + 1), *codes = malloc((size_t)nn * crow + 1);
    int8_t *sal = malloc((size_t)S * hd + 1);
    kv_half *sscale = malloc((size_t)hd * 2), *base = malloc((size_t)hd * 2);
    kv_half *scale = malloc((size_t)nn * nvs * 2 + 2), *zero = malloc((size_t)nn * nvs * 2 + 2);
    kv_status st = KV_OK;
    if (!xw || !mask || !codes || !sal || !sscale || !base || !scale || !zero)
        st = kv_fail(KV_E_NOMEM, "dsq pack staging");
    for (int h = 0; h < e->nkv && !st; h++) {
        const size_t hw = (size_t)h * y->nwmax + (size_t)y->packed;
        kv_dsq_select(imp + (size_t)h * imp_ld, W, S, mask);
        st = h2d_sync(e, y->dmask + hw * (size_t)(W / 8), mask, (size_t)W / 8, __LINE__);
        for (int pass = 0; pass < 2 && !st; pass++) {
            const uint16_t *x = pass ? xv : xk;
            for (int i = 0; i < W; i++) {
                const uint16_t *r = x + (size_t)h * head_stride + (size_t)((t0 + i) % mod) * hd;
                for (int c = 0; c < hd; c++) xw[(size_t)i * hd + c] = kv_half_to_f32(r[c]);
            }
            kv_kivi_axis ax = pass ? KV_KIVI_VALUES : KV_KIVI_KEYS;
            kv_dsq_pack_window(xw, (size_t)hd, ax, dp, hd, mask, sal, sscale, pass ? NULL : base,
                               codes, scale, zero);
            struct { void *dst; const void *src; size_t n; } up[6] = {
                {(pass ? y->vsal : y->ksal) + hw * (size_t)S * hd, sal, (size_t)S * hd},
                {(pass ? y->vsscale : y->ksscale) + hw * hd, sscale, (size_t)hd * 2},
                {(pass ? y->vc : y->kc) + hw * (size_t)nn * crow, codes, (size_t)nn * crow},
                {(pass ? y->vs : y->ks) + hw * (size_t)nn * nvs, scale, (size_t)nn * nvs * 2},
                {(pass ? y->vz : y->kz) + hw * (size_t)nn * nvs, zero, (size_t)nn * nvs * 2},
                {pass ? NULL : y->kbase + hw * hd, base, (size_t)hd * 2},
            };
            for (int i = 0; i < 6 && !st; i++)
                if (up[i].dst && up[i].n) st = h2d_sync(e, up[i].dst, up[i].src, up[i].n, __LINE__);
        }
    }
    free(zero);
    free(scale);
    free(base);
    free(sscale);
    free(sal);
    free(codes);
    free(mask);
    free(xw);
    if (!st) y->packed++;
    return st;
}

/* After an attend at T tokens: pack each window that is now complete, as
 * the CPU policy does at the end of its attend (importance includes this
 * step).  The window's fp16 rows and importance are read back first. */
static kv_status dsq_pack_ready(kv_gpu_engine *e, gl_layer *y, int T)
{
    const int W = y->dp.window;
    while (kv_dsq_nwindows(T, W) > y->packed) {
        size_t n = (size_t)e->nkv * y->rc * e->hd;
        uint16_t *ring = malloc(2 * n * 2);
        float *imp = malloc((size_t)e->nkv * W * sizeof(float));
        kv_status st = KV_OK;
        if (!ring || !imp) st = kv_fail(KV_E_NOMEM, "dsq window staging");
        cudaError_t ce = cudaSuccess;
        if (!st) ce = cudaMemcpyAsync(ring, y->rk[0], n * 2, cudaMemcpyDeviceToHost, e->s_main);
        if (!st && ce == cudaSuccess)
            ce = cudaMemcpyAsync(ring + n, y->rv[0], n * 2, cudaMemcpyDeviceToHost, e->s_main);
        if (!st && ce == cudaSuccess)
            ce = cudaMemcpy2DAsync(imp, (size_t)W * 4, y->imp + (size_t)y->packed * W,
                                   (size_t)e->ctx * 4, (size_t)W * 4, e->nkv,
                                   cudaMemcpyDeviceToHost, e->s_main);
        if (!st && ce == cudaSuccess) ce = cudaStreamSynchronize(e->s_main);
        if (!st && ce != cudaSuccess) st = cuda_fail(ce, "dsq window read-back", __LINE__);
        if (!st) st = dsq_pack_host(e, y, ring, ring + n, (size_t)y->rc * e->hd, y->rc, imp, (size_t)W);
        free(imp);
        free(ring);
        TRY(st);
    }
    return KV_OK;
}

/* Allocations that do not depend on the prompt (done at reset). */
static kv_status alloc_layers(kv_gpu_engine *e)
{
    size_t row = (size_t)e->nkv * e->ctx * e->hd * 2;
    for (int l = 0; l < e->L; l++) {
        gl_layer *y = &e->lay[l];
        if (y->kind == L_FULL) {
            TRY(dalloc(&y->k, row, "full K cache"));
            TRY(dalloc(&y->v, row, "full V cache"));
        } else if (y->kind == L_OFFLOAD) {
            TRY(halloc(&y->hk, NULL, row, "offloaded K"));
            TRY(halloc(&y->hv, NULL, row, "offloaded V"));
        } else if (y->kind == L_STREAM) {
            size_t rows = (size_t)e->nkv * (size_t)(y->prm.sink + y->prm.window) * e->hd * 2;
            TRY(dalloc(&y->k, rows, "streaming K"));
            TRY(dalloc(&y->v, rows, "streaming V"));
        } else if (y->kind == L_QDQ) {
            TRY(qdq_alloc(e, y));
        } else if (y->kind == L_DSQ) {
            TRY(dsq_alloc(e, y));
        } else if (y->kind == L_QUANT) {
            y->kp = (kv_kivi_params){y->prm.bits, y->prm.group, y->prm.residual};
            y->rc = y->kp.residual + y->kp.group;
            for (int i = 0; i < 2; i++) {
                TRY(dalloc(&y->rk[i], (size_t)e->nkv * y->rc * e->hd * 2, "quant residual K"));
                TRY(dalloc(&y->rv[i], (size_t)e->nkv * y->rc * e->hd * 2, "quant residual V"));
            }
            size_t need = (size_t)e->nkv * y->rc * e->hd;
            if (need > e->dres_n) {
                dfree(&e->dres_k);
                dfree(&e->dres_v);
                TRY(dalloc(&e->dres_k, need * 2, "dense residual"));
                TRY(dalloc(&e->dres_v, need * 2, "dense residual"));
                e->dres_n = need;
            }
        }
    }
    if (e->n_off)
        for (int i = 0; i < 2; i++) {
            TRY(dalloc(&e->stage_k[i], row, "offload staging"));
            TRY(dalloc(&e->stage_v[i], row, "offload staging"));
        }
    /* the memsets above run on the legacy stream, which does not order with
     * the engine's non-blocking streams */
    CK(cudaDeviceSynchronize());
    return KV_OK;
}

static kv_status grow_i32(int **p, size_t *cap, size_t n, const char *what)
{
    if (n <= *cap) return KV_OK;
    CK(cudaDeviceSynchronize());
    dfree(p);
    *cap = 0;
    TRY(dalloc(p, n * sizeof(int), what));
    *cap = n;
    return KV_OK;
}

/*
 * Hand a layer the first T tokens of dense fp16 K/V (nkv, ld, hd) on the
 * device (a prefill's or a synthesized cache).  tmp: device scratch of at
 * least 2*nkv*T*hd fp16 values.
 */
static kv_status ingest(kv_gpu_engine *e, int l, const uint16_t *K, const uint16_t *V, int ld,
                        int T, uint16_t *tmp)
{
    gl_layer *y = &e->lay[l];
    const int nkv = e->nkv, hd = e->hd;
    const size_t rb = (size_t)hd * 2, pitch_ctx = (size_t)e->ctx * rb;
    cudaStream_t s = e->s_main;
    y->T = T;
    y->fetched_last = y->fetched_total = y->attends = 0;
    switch (y->kind) {
    case L_FULL:
        CK(cudaMemcpy2DAsync(y->k, pitch_ctx, K, (size_t)ld * rb, (size_t)T * rb, nkv,
                             cudaMemcpyDeviceToDevice, s));
        CK(cudaMemcpy2DAsync(y->v, pitch_ctx, V, (size_t)ld * rb, (size_t)T * rb, nkv,
                             cudaMemcpyDeviceToDevice, s));
        break;
    case L_OFFLOAD:
        CK(cudaMemcpy2DAsync(y->hk, pitch_ctx, K, (size_t)ld * rb, (size_t)T * rb, nkv,
                             cudaMemcpyDeviceToHost, s));
        CK(cudaMemcpy2DAsync(y->hv, pitch_ctx, V, (size_t)ld * rb, (size_t)T * rb, nkv,
                             cudaMemcpyDeviceToHost, s));
        break;
    case L_QUANT: {
        const kv_kivi_params *kp = &y->kp;
        int nq = kv_kivi_nquant(T, kp->group, kp->residual), nres = T - nq;
        size_t crow = kv_kivi_row_bytes(hd, kp->bits);
        int gv = kv_kivi_vgroup(kp->group, hd);
        uint16_t *Kd = tmp, *Vd = tmp + (size_t)nkv * T * hd; /* dense (nkv, T, hd) */
        CK(cudaMemcpy2DAsync(Kd, (size_t)T * rb, K, (size_t)ld * rb, (size_t)T * rb, nkv,
                             cudaMemcpyDeviceToDevice, s));
        CK(cudaMemcpy2DAsync(Vd, (size_t)T * rb, V, (size_t)ld * rb, (size_t)T * rb, nkv,
                             cudaMemcpyDeviceToDevice, s));
        /* stream-ordered: quant_maybe_pack regrows these with cudaMallocAsync */
        CK(cudaMallocAsync((void **)&y->kc, (size_t)nkv * nq * crow + 16, s));
        CK(cudaMallocAsync((void **)&y->vc, (size_t)nkv * nq * crow + 16, s));
        CK(cudaMallocAsync((void **)&y->ks, (size_t)nkv * (nq / kp->group) * hd * 2 + 16, s));
        CK(cudaMallocAsync((void **)&y->kz, (size_t)nkv * (nq / kp->group) * hd * 2 + 16, s));
        CK(cudaMallocAsync((void **)&y->vs, (size_t)nkv * nq * (hd / gv) * 2 + 16, s));
        CK(cudaMallocAsync((void **)&y->vz, (size_t)nkv * nq * (hd / gv) * 2 + 16, s));
        /* the pack writes the residual dense (nkv, nres, hd) into the stores'
         * spare buffer; it is then placed at pitch rc */
        kv_cuda_kivi_out ko = {y->kc, y->ks, y->kz, y->rk[1]};
        kv_cuda_kivi_out vo = {y->vc, y->vs, y->vz, y->rv[1]};
        CK(kv_cuda_kivi_pack(KV_KIVI_KEYS, kp, nkv, T, hd, Kd, &ko, s));
        CK(kv_cuda_kivi_pack(KV_KIVI_VALUES, kp, nkv, T, hd, Vd, &vo, s));
        if (nres > 0) {
            CK(cudaMemcpy2DAsync(y->rk[0], (size_t)y->rc * rb, y->rk[1], (size_t)nres * rb,
                                 (size_t)nres * rb, nkv, cudaMemcpyDeviceToDevice, s));
            CK(cudaMemcpy2DAsync(y->rv[0], (size_t)y->rc * rb, y->rv[1], (size_t)nres * rb,
                                 (size_t)nres * rb, nkv, cudaMemcpyDeviceToDevice, s));
        }
        y->nq = nq;
        y->nres = nres;
        y->cur = 0;
        break;
    }
    case L_STREAM: {
        /* the tokens the CPU policy keeps: sinks, then the last W in the ring */
        const int S = y->prm.sink, W = y->prm.window;
        const size_t pitch = (size_t)(S + W) * rb;
        for (int t = 0; t < T; t++) {
            if (t >= S && t < T - W) continue;
            int slot = t < S ? t : S + (t - S) % W;
            CK(cudaMemcpy2DAsync(y->k + (size_t)slot * hd, pitch, K + (size_t)t * hd,
                                 (size_t)ld * rb, rb, nkv, cudaMemcpyDeviceToDevice, s));
            CK(cudaMemcpy2DAsync(y->v + (size_t)slot * hd, pitch, V + (size_t)t * hd,
                                 (size_t)ld * rb, rb, nkv, cudaMemcpyDeviceToDevice, s));
        }
        break;
    }
    case L_QDQ: {
        /* the prompt to the host, packed there group by group as the CPU
         * policy's appends would, the rest into the residual ring */
        size_t n = (size_t)nkv * T * hd, rn = (size_t)nkv * y->rc * hd;
        uint16_t *hx = malloc((2 * n + 2 * rn) * 2);
        if (!hx) return kv_fail(KV_E_NOMEM, "quant ingest staging");
        uint16_t *hk = hx, *hv = hx + n, *ring = hx + 2 * n;
        memset(ring, 0, 2 * rn * 2);
        cudaError_t ce = cudaMemcpy2DAsync(hk, (size_t)T * rb, K, (size_t)ld * rb, (size_t)T * rb,
                                           nkv, cudaMemcpyDeviceToHost, s);
        if (ce == cudaSuccess)
            ce = cudaMemcpy2DAsync(hv, (size_t)T * rb, V, (size_t)ld * rb, (size_t)T * rb, nkv,
                                   cudaMemcpyDeviceToHost, s);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
        kv_status st = ce != cudaSuccess ? cuda_fail(ce, "quant ingest read-back", __LINE__) : KV_OK;
        y->nq = 0;
        int nq = kv_kivi_nquant(T, y->kp.group, y->kp.residual);
        while (!st && y->nq < nq) st = qdq_pack_kv(e, y, hk, hv, (size_t)T * hd, T);
        for (int h = 0; h < nkv && !st; h++)
            for (int t = nq; t < T; t++) {
                size_t d = ((size_t)h * y->rc + (size_t)(t % y->rc)) * hd, o = ((size_t)h * T + t) * hd;
                memcpy(ring + d, hk + o, rb);
                memcpy(ring + rn + d, hv + o, rb);
            }
        if (!st) {
            ce = cudaMemcpyAsync(y->rk[0], ring, rn * 2, cudaMemcpyHostToDevice, s);
            if (ce == cudaSuccess) ce = cudaMemcpyAsync(y->rv[0], ring + rn, rn * 2, cudaMemcpyHostToDevice, s);
            if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
            if (ce != cudaSuccess) st = cuda_fail(ce, "quant ring upload", __LINE__);
        }
        free(hx);
        TRY(st);
        y->nres = T - y->nq;
        break;
    }
    case L_DSQ: {
        /* importance from the prompt's last queries (observed during the
         * prefill, as the CPU engine gives them to observe()), then every
         * complete window packed on the host; the rest into the fp16 ring */
        const int W = y->dp.window, nobs = y->obs_n <= T ? y->obs_n : 0;
        size_t n = (size_t)nkv * T * hd, rn = (size_t)nkv * y->rc * hd;
        uint16_t *hx = malloc((2 * n + 2 * rn) * 2);
        float *imp = calloc((size_t)nkv * T + 1, sizeof(float));
        float *kf = nobs ? malloc(n * sizeof(float)) : NULL;
        float *oq = nobs ? malloc((size_t)nobs * e->qd * sizeof(float) * 2) : NULL;
        kv_status st = KV_OK;
        if (!hx || !imp || (nobs && (!kf || !oq))) st = kv_fail(KV_E_NOMEM, "dsq ingest staging");
        uint16_t *hk = hx, *hv = hx + n, *ring = hx + 2 * n;
        cudaError_t ce = cudaSuccess;
        if (!st) {
            memset(ring, 0, 2 * rn * 2);
            ce = cudaMemcpy2DAsync(hk, (size_t)T * rb, K, (size_t)ld * rb, (size_t)T * rb, nkv,
                                   cudaMemcpyDeviceToHost, s);
            if (ce == cudaSuccess)
                ce = cudaMemcpy2DAsync(hv, (size_t)T * rb, V, (size_t)ld * rb, (size_t)T * rb, nkv,
                                       cudaMemcpyDeviceToHost, s);
            if (ce == cudaSuccess && nobs)
                ce = cudaMemcpyAsync(oq, y->obs, (size_t)nobs * e->qd * 4, cudaMemcpyDeviceToHost, s);
            if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
            if (ce != cudaSuccess) st = cuda_fail(ce, "dsq ingest read-back", __LINE__);
        }
        if (!st && nobs) {
            /* (nobs, n_heads, hd) -> (n_heads, nobs, hd), as observe() receives them */
            float *q = oq + (size_t)nobs * e->qd;
            for (int j = 0; j < nobs; j++)
                for (int h = 0; h < e->nqh; h++)
                    memcpy(q + ((size_t)h * nobs + j) * hd, oq + (size_t)j * e->qd + (size_t)h * hd,
                           (size_t)hd * sizeof(float));
            for (size_t i = 0; i < n; i++) kf[i] = kv_half_to_f32(hk[i]);
            st = kv_dsq_importance(q, e->nqh, nobs, kf, nkv, T, hd, imp);
        }
        if (!st) {
            ce = cudaMemsetAsync(y->imp, 0, (size_t)nkv * e->ctx * 4, s);
            if (ce == cudaSuccess)
                ce = cudaMemcpy2DAsync(y->imp, (size_t)e->ctx * 4, imp, (size_t)T * 4, (size_t)T * 4,
                                       nkv, cudaMemcpyHostToDevice, s);
            if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
            if (ce != cudaSuccess) st = cuda_fail(ce, "dsq importance upload", __LINE__);
        }
        /* without observed queries (a synthesized context) the windows are
         * packed now with zero importance: the ring holds one window only */
        y->packed = 0;
        while (!st && y->packed < kv_dsq_nwindows(T, W))
            st = dsq_pack_host(e, y, hk, hv, (size_t)T * hd, T, imp + (size_t)y->packed * W, (size_t)T);
        for (int h = 0; h < nkv && !st; h++)
            for (int t = y->packed * W; t < T; t++) {
                size_t d = ((size_t)h * y->rc + (size_t)(t % y->rc)) * hd, o = ((size_t)h * T + t) * hd;
                memcpy(ring + d, hk + o, rb);
                memcpy(ring + rn + d, hv + o, rb);
            }
        if (!st) st = h2d_sync(e, y->rk[0], ring, rn * 2, __LINE__);
        if (!st) st = h2d_sync(e, y->rv[0], ring + rn, rn * 2, __LINE__);
        free(oq);
        free(kf);
        free(imp);
        free(hx);
        y->obs_n = 0;
        TRY(st);
        break;
    }
    case L_SPARSE: {
        const kv_policy_params *p = &y->prm;
        bool sketch = p->select == KV_SELECT_SKETCH;
        bool channels = p->select == KV_SELECT_CHANNELS;
        y->Tp = T;
        cand_range(y, T, &y->cs0, &y->cend0);
        int kk_ctx = topk_of(p, e->ctx);
        y->kmax = kk_ctx < T ? kk_ctx : T;
        if (y->kmax < 0) y->kmax = 0;
        y->tail_base = y->kmax + y->cs0;
        y->cap = y->tail_base + (e->ctx - y->cend0);
        size_t rowsz = (size_t)T * nkv * 2 * hd * 2;
        TRY(halloc(&y->rows_h, &y->rows_d, rowsz, "sparse K/V rows"));
        CK(eng_to_row_layout(K, V, nkv, T, ld, hd, ENG_F16, tmp, s));
        CK(cudaMemcpyAsync(y->rows_h, tmp, rowsz, cudaMemcpyDeviceToHost, s));
        if (y->cs0 > 0) {
            size_t sz = (size_t)y->cs0 * nkv * 2 * hd * 2;
            TRY(dalloc(&y->sink, sz, "sparse sink rows"));
            CK(cudaMemcpyAsync(y->sink, tmp, sz, cudaMemcpyDeviceToDevice, s));
        }
        TRY(dalloc(&y->chmax, (size_t)nkv * hd * 4, "key channel maxima"));
        TRY(dalloc(&y->kmean, (size_t)nkv * hd * 4, "key channel means"));
        TRY(dalloc(&y->kmad, (size_t)nkv * hd * 4, "key channel deviations"));
        CK(eng_key_stats(K, nkv, T, ld, hd, ENG_F16, y->chmax, y->kmean, y->kmad, s));
        if (channels) {
            y->ldc = pad8(T);
            size_t cmsz = (size_t)nkv * hd * y->ldc * 2;
            TRY(halloc(&y->kcm_h, &y->kcm_d, cmsz, "channel-major keys"));
            CK(cudaMemsetAsync(tmp, 0, cmsz, s));
            CK(eng_to_channel_major(K, nkv, T, ld, hd, ENG_F16, tmp, y->ldc, s));
            CK(cudaMemcpyAsync(y->kcm_h, tmp, cmsz, cudaMemcpyDeviceToHost, s));
        }
        if (sketch) {
            TRY(dalloc(&y->sketch, (size_t)nkv * T * (hd / 8), "key sketch"));
            CK(eng_sketch_build(K, nkv, T, ld, hd, ENG_F16, y->kmean, y->sketch, s));
        }
        size_t asz = (size_t)nkv * y->cap * hd * 2;
        TRY(dalloc(&y->ak, asz, "sparse resident K"));
        TRY(dalloc(&y->av, asz, "sparse resident V"));
        CK(cudaMemsetAsync(y->ak, 0, asz, s));
        CK(cudaMemsetAsync(y->av, 0, asz, s));
        int ntail = T - y->cend0;
        if (ntail > 0) {
            size_t off = (size_t)y->tail_base * hd;
            CK(cudaMemcpy2DAsync(y->ak + off, (size_t)y->cap * rb, K + (size_t)y->cend0 * hd,
                                 (size_t)ld * rb, (size_t)ntail * rb, nkv,
                                 cudaMemcpyDeviceToDevice, s));
            CK(cudaMemcpy2DAsync(y->av + off, (size_t)y->cap * rb, V + (size_t)y->cend0 * hd,
                                 (size_t)ld * rb, (size_t)ntail * rb, nkv,
                                 cudaMemcpyDeviceToDevice, s));
        }
        /* shared selection scratch */
        size_t ncand = (size_t)(y->cend0 > y->cs0 ? T - y->cs0 : 0) + 8;
        if ((size_t)e->nqh * ncand > e->score_n) {
            CK(cudaDeviceSynchronize());
            dfree(&e->score);
            dfree(&e->comb);
            e->score_n = 0;
            TRY(dalloc(&e->score, (size_t)e->nqh * ncand * 4, "selection scores"));
            TRY(dalloc(&e->comb, (size_t)e->nkv * ncand * 4, "selection scores"));
            e->score_n = (size_t)e->nqh * ncand;
        }
        for (int i = 0; i < 2; i++)
            TRY(grow_i32(&e->sel[i], &e->sel_n[i], (size_t)nkv * (y->kmax + 1), "selection ids"));
        TRY(grow_i32(&e->chans, &e->chans_n, (size_t)nkv * p->channels, "critical channels"));
        break;
    }
    }
    CK(cudaStreamSynchronize(s)); /* tmp is reused by the next layer */
    return KV_OK;
}

// --- per-step pieces ---------------------------------------------------------------

/* Attention over rows [0, n) of fp16 K/V (nkv, head_stride) into e->att. */
static kv_status attend_dense(kv_gpu_engine *e, const uint16_t *K, const uint16_t *V,
                              size_t head_stride, int n, cudaStream_t s)
{
    if (use_kernels_f16(e)) {
        kv_cuda_attn_dims d = {e->nqh, e->nkv, e->hd, n, (long long)head_stride, e->scale};
        TRY(ensure_ws(e, kv_cuda_attn_f16_workspace(&d)));
        CK(kv_cuda_attn_f16(&d, e->q16, K, V, e->att, e->ws, e->ws_bytes, s));
        return KV_OK;
    }
    size_t need = eng_attend_scratch(e->nqh, e->hd, n);
    if (need > e->att_part_n) {
        CK(cudaDeviceSynchronize());
        dfree(&e->att_part);
        e->att_part_n = 0;
        TRY(dalloc(&e->att_part, need * sizeof(float), "attention partials"));
        e->att_part_n = need;
    }
    CK(eng_attend(e->qkv, K, V, ENG_F16, e->nqh, e->nkv, e->hd, n, head_stride / (size_t)e->hd,
                  e->scale, e->att_part, e->att, s));
    return KV_OK;
}

/*
 * Token selection of sparse layer l for this step (T tokens after the
 * append), with query q (n_heads, hd) float, on stream s, then the gather of
 * the chosen rows on stream sg (which may be s).  Fills rows
 * [start, start + kk + cs) of the layer's attention buffer and sets
 * start/natt.  The gather runs on its own stream on the selection path so
 * that the next layer's scoring overlaps this layer's PCIe reads.
 */
static kv_status sparse_select(kv_gpu_engine *e, int l, const float *q, cudaStream_t s,
                               cudaStream_t sg)
{
    int *sel = e->sel[l & 1];
    bool g0_done = false; /* profile: first host read recorded */
    gl_layer *y = &e->lay[l];
    const kv_policy_params *p = &y->prm;
    const int T = e->pos + 1, nkv = e->nkv, hd = e->hd;
    int cs, cend;
    cand_range(y, T, &cs, &cend);
    if (cs > y->cs0) { /* a prompt shorter than the sink: every token is resident */
        cs = y->cs0;
        cend = y->cs0;
    }
    int ncand = cend - cs;
    int kk = topk_of(p, T);
    if (kk > ncand) kk = ncand;
    if (kk > y->kmax) kk = y->kmax;
    if (kk < 0) kk = 0;
    y->start = y->tail_base + (cend - y->cend0) - cs - kk;
    y->natt = kk + cs + (T - cend);
    const uint64_t rowb = (uint64_t)2 * hd * 2; /* one head's K and V of a token */
    uint64_t fetched = (uint64_t)kk * nkv * rowb;
    if (e->o.no_fetch) {
        y->fetched_last = 0;
        return KV_OK;
    }
    if (kk > 0) {
        if (kk < ncand) {
            if (p->select == KV_SELECT_SKETCH) {
                /* per-head scores then the softmax pass: eng_sketch_combine avoids
                 * writing the scores but measured slower (docs/BENCHMARKS.md, GPU decode) */
                if (!(e->sel_skip & 1))
                    CK(eng_score_sketch(q, y->sketch, y->Tp, y->kmad, e->nqh, nkv, hd, cs, cend,
                                        e->score, s));
            } else if (p->select == KV_SELECT_EXACT) {
                if (e->o.profile) CK(cudaEventRecord(e->ev_g0[l], s)); /* host reads start here */
                g0_done = true;
                CK(eng_score_exact(q, y->rows_d, ENG_F16, e->nqh, nkv, hd, cs, cend, e->score, s));
                fetched += (uint64_t)ncand * nkv * hd * 2;
            } else {
                int C = p->channels;
                if (e->o.profile) CK(cudaEventRecord(e->ev_g0[l], s)); /* host reads start here */
                g0_done = true;
                CK(eng_select_channels(q, y->chmax, e->nqh, nkv, hd, C, e->chans, e->qscale, s));
                CK(eng_score_channels(q, e->chans, e->qscale, y->kcm_d, ENG_F16, y->ldc, e->nqh,
                                      nkv, hd, C, cs, cend, e->score, s));
                /* host reads are whole 16-byte runs of 8 tokens */
                int n8 = (cend - (cs & ~7) + 7) / 8 * 8;
                fetched += (uint64_t)nkv * C * n8 * 2;
            }
            if (!(e->sel_skip & 2))
                CK(eng_softmax_combine(e->score, e->nqh, nkv, ncand,
                                       p->group_reduce == KV_REDUCE_MAX, e->sm_tmp, e->comb, s));
        } else {
            CK(eng_fill_f32(e->comb, (size_t)nkv * ncand, 0.0f, s)); /* take every candidate */
        }
        if (!(e->sel_skip & 4)) CK(eng_topk(e->comb, nkv, ncand, kk, cs, sel, s));
    }
    if (sg != s) {
        CK(cudaEventRecord(e->ev_topk[l], s));
        CK(cudaStreamWaitEvent(sg, e->ev_topk[l], 0));
    }
    size_t off = (size_t)y->start * hd;
    if (e->o.profile && !g0_done) CK(cudaEventRecord(e->ev_g0[l], sg));
    if (!(e->sel_skip & 8))
        CK(eng_gather_rows(y->rows_d, nkv, hd, ENG_F16, sel, kk, y->sink, cs, y->ak + off,
                           y->av + off, (size_t)y->cap, sg));
    if (e->o.profile) CK(cudaEventRecord(e->ev_g1[l], sg));
    y->fetched_last = fetched;
    y->fetched_total += fetched;
    return KV_OK;
}

/* Offload: copy layer l's T tokens into staging buffer b on the copy stream
 * once the buffer's last reader is done. */
static kv_status offload_issue(kv_gpu_engine *e, int j)
{
    int l = e->off_list[j], b = j & 1;
    gl_layer *y = &e->lay[l];
    const size_t rb = (size_t)e->hd * 2, pitch = (size_t)e->ctx * rb;
    const int T = e->pos;
    CK(cudaStreamWaitEvent(e->s_copy, e->ev_done[b], 0));
    if (e->o.profile) CK(cudaEventRecord(e->ev_p0[l], e->s_copy));
    if (T > 0) {
        CK(cudaMemcpy2DAsync(e->stage_k[b], pitch, y->hk, pitch, (size_t)T * rb, e->nkv,
                             cudaMemcpyHostToDevice, e->s_copy));
        CK(cudaMemcpy2DAsync(e->stage_v[b], pitch, y->hv, pitch, (size_t)T * rb, e->nkv,
                             cudaMemcpyHostToDevice, e->s_copy));
    }
    if (e->o.profile) CK(cudaEventRecord(e->ev_p1[l], e->s_copy));
    CK(cudaEventRecord(e->ev_copied[l], e->s_copy));
    y->fetched_last = (uint64_t)2 * e->nkv * T * rb;
    y->fetched_total += y->fetched_last;
    return KV_OK;
}

/* Quant: after appending a token to the residual, pack the oldest group once
 * the residual holds R + G tokens (KIVI keeps R..R+G-1 in fp16). */
static kv_status quant_maybe_pack(kv_gpu_engine *e, gl_layer *y)
{
    const kv_kivi_params *kp = &y->kp;
    if (y->nres < kp->residual + kp->group) return KV_OK;
    cudaStream_t s = e->s_main;
    const int nkv = e->nkv, hd = e->hd, G = kp->group, nq = y->nq;
    const size_t rb = (size_t)hd * 2, crow = kv_kivi_row_bytes(hd, kp->bits);
    const int gv = kv_kivi_vgroup(G, hd), nvs = hd / gv;
    /* the group's rows, dense (nkv, G, hd), in the dense-residual scratch */
    CK(cudaMemcpy2DAsync(e->dres_k, (size_t)G * rb, y->rk[y->cur], (size_t)y->rc * rb,
                         (size_t)G * rb, nkv, cudaMemcpyDeviceToDevice, s));
    CK(cudaMemcpy2DAsync(e->dres_v, (size_t)G * rb, y->rv[y->cur], (size_t)y->rc * rb,
                         (size_t)G * rb, nkv, cudaMemcpyDeviceToDevice, s));
    uint8_t *gkc, *gvc;
    uint16_t *gks, *gkz, *gvs, *gvz;
    size_t codes = (size_t)nkv * G * crow, kss = (size_t)nkv * hd * 2, vss = (size_t)nkv * G * nvs * 2;
    /* one block: new group parts, then the grown packed arrays */
    uint8_t *blk = NULL;
    size_t nbytes = 2 * codes + 2 * kss + 2 * vss + 6 * 256;
    CK(cudaMallocAsync((void **)&blk, nbytes, s));
    size_t o = 0;
#define CARVE(ptr, type, n) do { ptr = (type *)(blk + o); o += ((n) + 255) / 256 * 256; } while (0)
    CARVE(gkc, uint8_t, codes);
    CARVE(gvc, uint8_t, codes);
    CARVE(gks, uint16_t, kss);
    CARVE(gkz, uint16_t, kss);
    CARVE(gvs, uint16_t, vss);
    CARVE(gvz, uint16_t, vss);
#undef CARVE
    kv_kivi_params one = {kp->bits, G, 0};
    kv_cuda_kivi_out ko = {gkc, gks, gkz, e->dres_k}, vo = {gvc, gvs, gvz, e->dres_v};
    CK(kv_cuda_kivi_pack(KV_KIVI_KEYS, &one, nkv, G, hd, e->dres_k, &ko, s));
    CK(kv_cuda_kivi_pack(KV_KIVI_VALUES, &one, nkv, G, hd, e->dres_v, &vo, s));
    /* grow each packed part from nq to nq+G tokens per head */
    struct { void **dst; const void *add; size_t per_tok_old, per_tok_add; int old_rows, add_rows; } parts[6] = {
        {(void **)&y->kc, gkc, crow, crow, nq, G},
        {(void **)&y->vc, gvc, crow, crow, nq, G},
        {(void **)&y->ks, gks, rb, rb, nq / G, 1},
        {(void **)&y->kz, gkz, rb, rb, nq / G, 1},
        {(void **)&y->vs, gvs, (size_t)nvs * 2, (size_t)nvs * 2, nq, G},
        {(void **)&y->vz, gvz, (size_t)nvs * 2, (size_t)nvs * 2, nq, G},
    };
    for (int i = 0; i < 6; i++) {
        size_t w = parts[i].per_tok_old;
        size_t newpitch = (size_t)(parts[i].old_rows + parts[i].add_rows) * w;
        void *nb = NULL;
        CK(cudaMallocAsync(&nb, (size_t)nkv * newpitch + 16, s));
        if (parts[i].old_rows > 0)
            CK(cudaMemcpy2DAsync(nb, newpitch, *parts[i].dst, (size_t)parts[i].old_rows * w,
                                 (size_t)parts[i].old_rows * w, nkv, cudaMemcpyDeviceToDevice, s));
        CK(cudaMemcpy2DAsync((uint8_t *)nb + (size_t)parts[i].old_rows * w, newpitch, parts[i].add,
                             (size_t)parts[i].add_rows * w, (size_t)parts[i].add_rows * w, nkv,
                             cudaMemcpyDeviceToDevice, s));
        CK(cudaFreeAsync(*parts[i].dst, s));
        *parts[i].dst = nb;
    }
    CK(cudaFreeAsync(blk, s));
    /* drop the packed rows from the residual: rows [G, R+G) -> [0, R) of the other store */
    int keep = y->nres - G, nx = 1 - y->cur;
    CK(cudaMemcpy2DAsync(y->rk[nx], (size_t)y->rc * rb, y->rk[y->cur] + (size_t)G * hd,
                         (size_t)y->rc * rb, (size_t)keep * rb, nkv, cudaMemcpyDeviceToDevice, s));
    CK(cudaMemcpy2DAsync(y->rv[nx], (size_t)y->rc * rb, y->rv[y->cur] + (size_t)G * hd,
                         (size_t)y->rc * rb, (size_t)keep * rb, nkv, cudaMemcpyDeviceToDevice, s));
    y->cur = nx;
    y->nres = keep;
    y->nq += G;
    return KV_OK;
}

static kv_status quant_attend(kv_gpu_engine *e, gl_layer *y)
{
    cudaStream_t s = e->s_main;
    const size_t rb = (size_t)e->hd * 2;
    const int T = y->nq + y->nres;
    if (y->nres > 0) {
        CK(cudaMemcpy2DAsync(e->dres_k, (size_t)y->nres * rb, y->rk[y->cur], (size_t)y->rc * rb,
                             (size_t)y->nres * rb, e->nkv, cudaMemcpyDeviceToDevice, s));
        CK(cudaMemcpy2DAsync(e->dres_v, (size_t)y->nres * rb, y->rv[y->cur], (size_t)y->rc * rb,
                             (size_t)y->nres * rb, e->nkv, cudaMemcpyDeviceToDevice, s));
    }
    kv_cuda_attn_dims d = {e->nqh, e->nkv, e->hd, T, 0, e->scale};
    kv_cuda_kivi_view kv = {y->kc, y->ks, y->kz, e->dres_k};
    kv_cuda_kivi_view vv = {y->vc, y->vs, y->vz, e->dres_v};
    TRY(ensure_ws(e, kv_cuda_attn_kivi_workspace(&d, &y->kp)));
    CK(kv_cuda_attn_kivi(&d, &y->kp, e->q16, &kv, &vv, e->att, e->ws, e->ws_bytes, s));
    return KV_OK;
}

// --- the forward pass --------------------------------------------------------------

typedef struct {
    uint16_t **k, **v; /* (L) each (nkv, n, hd) dense prompt cache */
    int n;
} prefill_cache;

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
    CK(eng_embed(e->embd, e->wt, e->ld_dim, e->dim, dtok, e->x, s));
    int off_j = 0, side_last = -1;
    if (!pf)
        for (int j = 0; j < 2 && j < e->n_off; j++) TRY(offload_issue(e, j));
    for (int l = 0; l < e->L; l++) {
        const gw_layer *w = &e->w[l];
        gl_layer *y = &e->lay[l];
        /* one layer ahead: the next sparse layer's query and token selection */
        if (!pf && l + 1 < e->L && wants_pred(e, l + 1)) {
            float *xp = e->xp[(l + 1) & 1];
            CK(eng_rmsnorm(e->x, e->w[l + 1].attn_norm, e->dim, e->eps, xp, s));
            CK(cudaEventRecord(e->ev_x[l + 1], s));
            CK(cudaStreamWaitEvent(e->s_side, e->ev_x[l + 1], 0));
            if (e->o.profile) CK(cudaEventRecord(e->ev_p0[l + 1], e->s_side));
            if (!(e->sel_skip & 16))
                CK(eng_gemv(e->w[l + 1].qkv, e->wt, e->qd, e->ld_dim, xp, e->qpred, 0, e->s_side));
            CK(eng_rope_store(e->qpred, NULL, e->nqh, NULL, NULL, 0, hd, e->inv_freq, pos, NULL,
                              NULL, 0, e->s_side));
            TRY(sparse_select(e, l + 1, e->qpred, e->s_side, e->s_gath));
            if (e->o.profile) CK(cudaEventRecord(e->ev_p1[l + 1], e->s_gath));
            CK(cudaEventRecord(e->ev_sel[l + 1], e->s_gath));
            side_last = l + 1;
        }
        CK(eng_gemv_norm(w->qkv, e->wt, e->qd + 2 * e->kvd, e->ld_dim, e->x, w->attn_norm, e->dim,
                         e->eps, e->qkv, 0, s));
        float *q = e->qkv, *k = q + e->qd, *v = k + e->kvd;
        uint16_t *kd = NULL, *vd = NULL;
        size_t hs = 0;
        int b = 0;
        if (pf) {
            kd = pf->k[l] + (size_t)pos * hd;
            vd = pf->v[l] + (size_t)pos * hd;
            hs = (size_t)pf->n * hd;
        } else {
            switch (y->kind) {
            case L_FULL:
                kd = y->k + (size_t)pos * hd;
                vd = y->v + (size_t)pos * hd;
                hs = (size_t)e->ctx * hd;
                break;
            case L_OFFLOAD:
                b = off_j & 1;
                CK(cudaStreamWaitEvent(s, e->ev_copied[l], 0));
                kd = e->stage_k[b] + (size_t)pos * hd;
                vd = e->stage_v[b] + (size_t)pos * hd;
                hs = (size_t)e->ctx * hd;
                break;
            case L_STREAM: {
                const int S = y->prm.sink, W = y->prm.window;
                int slot = pos < S ? pos : S + (pos - S) % W;
                kd = y->k + (size_t)slot * hd;
                vd = y->v + (size_t)slot * hd;
                hs = (size_t)(S + W) * hd;
                break;
            }
            case L_QDQ:
            case L_DSQ:
                kd = y->rk[0] + (size_t)(pos % y->rc) * hd;
                vd = y->rv[0] + (size_t)(pos % y->rc) * hd;
                hs = (size_t)y->rc * hd;
                break;
            case L_QUANT:
                kd = y->rk[y->cur] + (size_t)y->nres * hd;
                vd = y->rv[y->cur] + (size_t)y->nres * hd;
                hs = (size_t)y->rc * hd;
                break;
            case L_SPARSE: {
                size_t row = (size_t)y->tail_base + (size_t)(pos - y->cend0);
                kd = y->ak + row * hd;
                vd = y->av + row * hd;
                hs = (size_t)y->cap * hd;
                break;
            }
            }
        }
        CK(eng_rope_store(q, e->q16, e->nqh, k, v, nkv, hd, e->inv_freq, pos, kd, vd, hs, s));
        if (pf && y->kind == L_DSQ) { /* the prompt's last queries, for its importance */
            int nobs = pf->n < DSQ_OBSERVE ? pf->n : DSQ_OBSERVE, j = pos - (pf->n - nobs);
            if (j >= 0) {
                CK(cudaMemcpyAsync(y->obs + (size_t)j * e->qd, q, (size_t)e->qd * 4,
                                   cudaMemcpyDeviceToDevice, s));
                y->obs_n = nobs;
            }
        }
        if (pf) {
            TRY(attend_dense(e, pf->k[l], pf->v[l], (size_t)pf->n * hd, pos + 1, s));
        } else {
            switch (y->kind) {
            case L_FULL:
                TRY(attend_dense(e, y->k, y->v, (size_t)e->ctx * hd, pos + 1, s));
                break;
            case L_OFFLOAD: {
                /* the new row goes back to host memory before the next step's copy */
                const size_t rb = (size_t)hd * 2, pitch = (size_t)e->ctx * rb;
                CK(cudaEventRecord(e->ev_rope, s));
                CK(cudaStreamWaitEvent(e->s_copy, e->ev_rope, 0));
                CK(cudaMemcpy2DAsync(y->hk + (size_t)pos * hd, pitch, kd, pitch, rb, nkv,
                                     cudaMemcpyDeviceToHost, e->s_copy));
                CK(cudaMemcpy2DAsync(y->hv + (size_t)pos * hd, pitch, vd, pitch, rb, nkv,
                                     cudaMemcpyDeviceToHost, e->s_copy));
                TRY(attend_dense(e, e->stage_k[b], e->stage_v[b], (size_t)e->ctx * hd, pos + 1, s));
                CK(cudaEventRecord(e->ev_done[b], s));
                if (off_j + 2 < e->n_off) TRY(offload_issue(e, off_j + 2));
                off_j++;
                break;
            }
            case L_QUANT:
                y->nres++;
                TRY(quant_maybe_pack(e, y));
                TRY(quant_attend(e, y));
                break;
            case L_STREAM: {
                /* order inside the ring does not matter to softmax attention */
                int S = y->prm.sink, W = y->prm.window, n = pos + 1 < S + W ? pos + 1 : S + W;
                TRY(attend_dense(e, y->k, y->v, (size_t)(S + W) * hd, n, s));
                break;
            }
            case L_DSQ: {
                eng_dsq_layer dv = dsq_view(e, y);
                CK(cudaMemset2DAsync(y->imp + pos, (size_t)e->ctx * 4, 0, 4, nkv, s));
                CK(eng_dsq_expand(&dv, pos + 1, e->qx_k, e->qx_v, (size_t)e->ctx, s));
                TRY(attend_dense(e, e->qx_k, e->qx_v, (size_t)e->ctx * hd, pos + 1, s));
                CK(eng_attn_importance(q, e->qx_k, e->nqh, nkv, hd, pos + 1, (size_t)e->ctx,
                                       e->scale, e->imp_sc, y->imp, (size_t)e->ctx, s));
                TRY(dsq_pack_ready(e, y, pos + 1));
                break;
            }
            case L_QDQ: {
                TRY(qdq_maybe_pack(e, y, pos + 1));
                eng_kivi_layer kv = qdq_view(e, y);
                CK(eng_kivi_expand(&kv, pos + 1, e->qx_k, e->qx_v, (size_t)e->ctx, s));
                TRY(attend_dense(e, e->qx_k, e->qx_v, (size_t)e->ctx * hd, pos + 1, s));
                break;
            }
            case L_SPARSE:
                if (wants_pred(e, l)) {
                    CK(cudaStreamWaitEvent(s, e->ev_sel[l], 0));
                } else {
                    /* the selection scratch is shared with the selection stream */
                    if (side_last >= 0) CK(cudaStreamWaitEvent(s, e->ev_sel[side_last], 0));
                    TRY(sparse_select(e, l, q, s, s));
                }
                TRY(attend_dense(e, y->ak + (size_t)y->start * hd, y->av + (size_t)y->start * hd,
                                 (size_t)y->cap * hd, y->natt, s));
                break;
            }
            y->T = pos + 1;
            y->attends++;
        }
        CK(eng_gemv(w->o, e->wt, e->dim, e->ld_qd, e->att, e->x, 1, s));
        CK(eng_gemv_norm(w->gu, e->wt, e->hidden, e->ld_dim, e->x, w->ffn_norm, e->dim, e->eps,
                         e->hb, 1, s));
        CK(eng_gemv(w->down, e->wt, e->dim, e->ld_hid, e->hb, e->x, 1, s));
    }
    if (want_logits) {
        CK(eng_gemv_norm(e->outw, e->wt, e->vocab, e->ld_dim, e->x, e->out_norm, e->dim, e->eps,
                         e->logits, 0, s));
    }
    return KV_OK;
}

// --- construction ---------------------------------------------------------------------

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
    CK(cudaGetDeviceProperties(&prop, e->o.device));
    int drv = 0;
    cudaDriverGetVersion(&drv);
    snprintf(e->devname, sizeof e->devname, "%.255s (sm_%d%d, %zu MiB, driver CUDA %d.%d)", prop.name,
             prop.major, prop.minor, prop.totalGlobalMem >> 20, drv / 1000, (drv % 1000) / 10);
    if (prop.major < 7)
        return kv_fail(KV_E_UNAVAILABLE, "%s: compute capability %d.%d is below 7.5", prop.name,
                       prop.major, prop.minor);
    /* Hopper: programmatic dependent launch of the decode kernels (level 2,
     * kernels/kv_kernels.h); KV_GPU_PDL=0 or 1 lowers it, for measurement */
    kv_cuda_set_pdl(prop.major < 9 ? 0 : getenv("KV_GPU_PDL") ? atoi(getenv("KV_GPU_PDL")) : 2);
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
        CK(cudaEventCreateWithFlags(&e->ev_done[i], cudaEventDisableTiming));
        CK(cudaEventRecord(e->ev_done[i], e->s_main));
    }
    CK(cudaEventCreateWithFlags(&e->ev_rope, cudaEventDisableTiming));
    for (int l = 0; l < e->L; l++) {
        CK(cudaEventCreateWithFlags(&e->ev_x[l], cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&e->ev_sel[l], cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&e->ev_copied[l], cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&e->ev_topk[l], cudaEventDisableTiming));
        CK(cudaEventCreate(&e->ev_p0[l]));
        CK(cudaEventCreate(&e->ev_p1[l]));
        CK(cudaEventCreate(&e->ev_g0[l]));
        CK(cudaEventCreate(&e->ev_g1[l]));
    }
    /* weights */
    kv_wtype src = e->m->layers[0].wq.type;
    e->wt = e->o.wtype == KV_GPU_W_BF16 ? ENG_BF16
          : e->o.wtype == KV_GPU_W_F16  ? ENG_F16
          : src == KV_W_BF16            ? ENG_BF16 : ENG_F16;
    TRY(load_weights(e));
    float *f = malloc((size_t)e->hd / 2 * sizeof(float));
    if (!f) return kv_fail(KV_E_NOMEM, "out of memory");
    kv_model_rope_freqs(c, f);
    kv_status st = upload_f32(f, e->hd / 2, &e->inv_freq, "rope frequencies");
    free(f);
    if (st) return st;
    /* activations, zeroed so that the padding of every GEMV input is zero */
    struct { float **p; int n; } acts[] = {
        {&e->x, pad8(e->dim)},       {&e->xp[0], e->ld_dim},
        {&e->xp[1], e->ld_dim},      {&e->qkv, e->qd + 2 * e->kvd}, {&e->att, e->ld_qd},
        {&e->hb, e->ld_hid},          {&e->logits, e->vocab},
        {&e->qpred, e->qd},          {&e->qscale, e->nqh},
        {&e->sm_tmp, (int)eng_softmax_tmp(e->nqh)},
    };
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++) {
        TRY(dalloc(acts[i].p, (size_t)acts[i].n * sizeof(float), "activations"));
        CK(cudaMemset(*acts[i].p, 0, (size_t)acts[i].n * sizeof(float)));
    }
    TRY(dalloc(&e->q16, (size_t)e->qd * 2, "fp16 query"));
    e->tok_cap = 1024;
    TRY(dalloc(&e->d_tok, (size_t)e->tok_cap * sizeof(int), "token ids"));
    CK(cudaMemset(e->d_tok, 0, (size_t)e->tok_cap * sizeof(int)));
    TRY(halloc(&e->h_tok, NULL, sizeof(int) * 2, "token staging"));
    CK(cudaDeviceSynchronize());
    return KV_OK;
}

kv_status kv_gpu_engine_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                            const kv_gpu_engine_opts *opts, kv_gpu_engine **out)
{
    *out = NULL;
    const kv_model_config *c = &m->cfg;
    if (ctx <= 0) ctx = c->seq_len;
    if (ctx > (1 << 24)) return kv_fail(KV_E_USAGE, "context %d too large", ctx);
    kv_gpu_engine *e = calloc(1, sizeof *e);
    if (!e) return kv_fail(KV_E_NOMEM, "out of memory");
    if (opts) e->o = *opts;
    else kv_gpu_engine_opts_default(&e->o);
    e->m = m;
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
    e->ld_dim = pad8(e->dim);
    e->ld_qd = pad8(e->qd);
    e->ld_hid = pad8(e->hidden);
    e->eps = c->norm_eps;
    e->scale = 1.0f / sqrtf((float)e->hd);
    e->own_attn = getenv("KV_GPU_OWN_ATTN") != NULL;
    e->sel_skip = getenv("KV_GPU_SEL_SKIP") ? (unsigned)strtoul(getenv("KV_GPU_SEL_SKIP"), NULL, 0) : 0;
    e->w = calloc((size_t)e->L, sizeof *e->w);
    e->lay = calloc((size_t)e->L, sizeof *e->lay);
    e->off_list = calloc((size_t)e->L, sizeof(int));
    e->ev_x = calloc((size_t)e->L, sizeof(cudaEvent_t));
    e->ev_sel = calloc((size_t)e->L, sizeof(cudaEvent_t));
    e->ev_copied = calloc((size_t)e->L, sizeof(cudaEvent_t));
    e->ev_topk = calloc((size_t)e->L, sizeof(cudaEvent_t));
    e->ev_p0 = calloc((size_t)e->L, sizeof(cudaEvent_t));
    e->ev_p1 = calloc((size_t)e->L, sizeof(cudaEvent_t));
    e->ev_g0 = calloc((size_t)e->L, sizeof(cudaEvent_t));
    e->ev_g1 = calloc((size_t)e->L, sizeof(cudaEvent_t));
    if (!e->w || !e->lay || !e->off_list || !e->ev_x || !e->ev_sel || !e->ev_copied || !e->ev_p0 ||
        !e->ev_p1 || !e->ev_topk || !e->ev_g0 || !e->ev_g1) {
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

void kv_gpu_engine_free(kv_gpu_engine *e)
{
    if (!e) return;
    if (e->s_main) {
        cudaDeviceSynchronize();
        (void)cudaGetLastError();
    }
    release_all(e);
    if (e->w)
        for (int l = 0; l < e->L; l++) {
            gw_layer *w = &e->w[l];
            if (w->owner) {
                dfree(&w->qkv);
                dfree(&w->o);
                dfree(&w->gu);
                dfree(&w->down);
            }
            dfree(&w->attn_norm);
            dfree(&w->ffn_norm);
        }
    if (e->outw != e->embd) dfree(&e->outw);
    dfree(&e->embd);
    dfree(&e->out_norm);
    dfree(&e->inv_freq);
    float **acts[] = {&e->x, &e->xp[0], &e->xp[1], &e->qkv, &e->att, &e->hb,
                      &e->logits, &e->qpred, &e->qscale, &e->sm_tmp, &e->score, &e->comb,
                      &e->att_part};
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++) dfree(acts[i]);
    dfree(&e->q16);
    dfree(&e->d_tok);
    hfree(&e->h_tok);
    dfree(&e->ws);
    dfree(&e->dres_k);
    dfree(&e->dres_v);
    dfree(&e->qx_k);
    dfree(&e->qx_v);
    dfree(&e->imp_sc);
    dfree(&e->chans);
    dfree(&e->sel[0]);
    dfree(&e->sel[1]);
    for (int l = 0; e->ev_x && l < e->L; l++) {
        if (e->ev_x[l]) cudaEventDestroy(e->ev_x[l]);
        if (e->ev_sel[l]) cudaEventDestroy(e->ev_sel[l]);
        if (e->ev_copied[l]) cudaEventDestroy(e->ev_copied[l]);
        if (e->ev_topk[l]) cudaEventDestroy(e->ev_topk[l]);
        if (e->ev_p0[l]) cudaEventDestroy(e->ev_p0[l]);
        if (e->ev_p1[l]) cudaEventDestroy(e->ev_p1[l]);
        if (e->ev_g0[l]) cudaEventDestroy(e->ev_g0[l]);
        if (e->ev_g1[l]) cudaEventDestroy(e->ev_g1[l]);
    }
    for (int i = 0; i < 2; i++)
        if (e->ev_done[i]) cudaEventDestroy(e->ev_done[i]);
    if (e->ev_rope) cudaEventDestroy(e->ev_rope);
    if (e->s_main) cudaStreamDestroy(e->s_main);
    if (e->s_side) cudaStreamDestroy(e->s_side);
    if (e->s_gath) cudaStreamDestroy(e->s_gath);
    if (e->s_copy) cudaStreamDestroy(e->s_copy);
    free(e->ev_x);
    free(e->ev_sel);
    free(e->ev_copied);
    free(e->ev_topk);
    free(e->ev_p0);
    free(e->ev_p1);
    free(e->ev_g0);
    free(e->ev_g1);
    free(e->off_list);
    free(e->lay);
    free(e->w);
    free(e);
}

kv_status kv_gpu_engine_reset(kv_gpu_engine *e, const kv_policy_params *per_layer)
{
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
        e->o = *opts;
    }
    return kv_gpu_engine_reset(e, per_layer);
}

// --- prefill, step, generate -------------------------------------------------------------

static kv_status ingest_all(kv_gpu_engine *e, uint16_t **K, uint16_t **V, int ld, int T)
{
    uint16_t *tmp = NULL;
    size_t need = (size_t)2 * e->nkv * T * e->hd;
    size_t cm = (size_t)e->nkv * e->hd * pad8(T);
    if (cm > need) need = cm;
    TRY(dalloc(&tmp, need * 2, "ingest scratch"));
    kv_status st = KV_OK;
    for (int l = 0; l < e->L && !st; l++) {
        st = ingest(e, l, K[l], V[l], ld, T, tmp);
        if (st) kv_errcontext("layer %d ingest", l);
    }
    cudaDeviceSynchronize();
    dfree(&tmp);
    return st;
}

static kv_status check_token(const kv_gpu_engine *e, int t, int i)
{
    if (t < 0 || t >= e->vocab)
        return kv_fail(KV_E_DATA, "token %d at position %d is outside the vocabulary (%d)", t, i,
                       e->vocab);
    return KV_OK;
}

kv_status kv_gpu_engine_prefill(kv_gpu_engine *e, const int *tokens, int n, float *logits_last)
{
    if (n < 1) return kv_fail(KV_E_USAGE, "prefill needs at least one token");
    if (e->pos != 0) return kv_fail(KV_E_USAGE, "prefill on an engine at position %d: reset it first", e->pos);
    if (n > e->ctx) return kv_fail(KV_E_USAGE, "prompt of %d tokens exceeds the context of %d", n, e->ctx);
    for (int i = 0; i < n; i++) TRY(check_token(e, tokens[i], i));
    prefill_cache pf = {calloc((size_t)e->L, sizeof(uint16_t *)), calloc((size_t)e->L, sizeof(uint16_t *)), n};
    int *dt = NULL;
    kv_status st = KV_OK;
    if (!pf.k || !pf.v) st = kv_fail(KV_E_NOMEM, "out of memory");
    size_t per = (size_t)e->nkv * n * e->hd * 2;
    for (int l = 0; l < e->L && !st; l++) {
        st = dalloc(&pf.k[l], per, "prompt K");
        if (!st) st = dalloc(&pf.v[l], per, "prompt V");
    }
    if (!st) st = dalloc(&dt, (size_t)n * sizeof(int), "prompt tokens");
    if (!st) {
        /* On the main stream, not cudaMemcpy: from pageable memory that may
         * return before the DMA lands, and the legacy stream it runs on does
         * not order with the engine's non-blocking streams, so the embedding
         * kernel could read ids not yet written (seen as illegal-address
         * faults under multi-process load).  A pageable source is staged
         * before cudaMemcpyAsync returns. */
        cudaError_t ce = cudaMemcpyAsync(dt, tokens, (size_t)n * sizeof(int), cudaMemcpyHostToDevice,
                                         e->s_main);
        if (ce != cudaSuccess) st = cuda_fail(ce, "prompt upload", __LINE__);
    }
    for (int i = 0; i < n && !st; i++) {
        e->pos = i;
        st = forward(e, dt + i, i == n - 1 && logits_last, &pf);
    }
    e->pos = 0;
    if (!st) st = ingest_all(e, pf.k, pf.v, n, n);
    if (!st && logits_last) {
        cudaError_t ce = cudaMemcpyAsync(logits_last, e->logits, (size_t)e->vocab * 4,
                                         cudaMemcpyDeviceToHost, e->s_main);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(e->s_main);
        if (ce != cudaSuccess) st = cuda_fail(ce, "logits download", __LINE__);
        /* NaN/inf weights or overflow: refused as on the CPU (the logits are
         * the one place the host sees; the selection kernels rank NaN as -inf
         * meanwhile, so nothing before this point misbehaves) */
        else if (kv_first_nonfinite(logits_last, (size_t)e->vocab) != SIZE_MAX)
            st = kv_model_nonfinite_fail(e->m, "logits", n - 1);
    }
    cudaDeviceSynchronize();
    for (int l = 0; pf.k && l < e->L; l++) dfree(&pf.k[l]);
    for (int l = 0; pf.v && l < e->L; l++) dfree(&pf.v[l]);
    free(pf.k);
    free(pf.v);
    dfree(&dt);
    if (!st) e->pos = n;
    return st;
}

kv_status kv_gpu_engine_step(kv_gpu_engine *e, int token, float *logits)
{
    if (e->pos == 0) return kv_gpu_engine_prefill(e, &token, 1, logits);
    TRY(check_token(e, token, e->pos));
    if (e->pos >= e->ctx) return kv_fail(KV_E_USAGE, "context of %d tokens is full", e->ctx);
    e->h_tok[0] = token;
    CK(cudaMemcpyAsync(e->d_tok, e->h_tok, sizeof(int), cudaMemcpyHostToDevice, e->s_main));
    kv_status st = forward(e, e->d_tok, logits != NULL, NULL);
    if (st) return st;
    e->pos++;
    if (logits) {
        CK(cudaMemcpyAsync(logits, e->logits, (size_t)e->vocab * 4, cudaMemcpyDeviceToHost, e->s_main));
    }
    CK(cudaStreamSynchronize(e->s_main));
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
        dfree(&e->d_tok);
        e->tok_cap = 0;
        TRY(dalloc(&e->d_tok, (size_t)(n + 1) * sizeof(int), "token ids"));
        e->tok_cap = n + 1;
    }
    cudaEvent_t *ev = calloc((size_t)n + 1, sizeof *ev);
    if (!ev) return kv_fail(KV_E_NOMEM, "out of memory");
    kv_status st = KV_OK;
    for (int i = 0; i <= n && !st; i++) {
        cudaError_t ce = cudaEventCreate(&ev[i]);
        if (ce != cudaSuccess) st = cuda_fail(ce, "cudaEventCreate", __LINE__);
    }
    e->h_tok[0] = token;
    if (!st) {
        cudaError_t ce = cudaMemcpyAsync(e->d_tok, e->h_tok, sizeof(int), cudaMemcpyHostToDevice, e->s_main);
        if (ce == cudaSuccess) ce = cudaEventRecord(ev[0], e->s_main);
        if (ce != cudaSuccess) st = cuda_fail(ce, "generate start", __LINE__);
    }
    for (int i = 0; i < n && !st; i++) {
        st = forward(e, e->d_tok + i, true, NULL);
        if (st) break;
        cudaError_t ce = eng_argmax(e->logits, e->vocab, e->d_tok + i + 1, e->s_main);
        if (ce == cudaSuccess) ce = cudaEventRecord(ev[i + 1], e->s_main);
        if (ce != cudaSuccess) st = cuda_fail(ce, "argmax", __LINE__);
        e->pos++;
    }
    if (!st) {
        cudaError_t ce = cudaStreamSynchronize(e->s_main);
        if (ce == cudaSuccess) ce = cudaMemcpy(out, e->d_tok + 1, (size_t)n * sizeof(int), cudaMemcpyDeviceToHost);
        if (ce != cudaSuccess) st = cuda_fail(ce, "generate", __LINE__);
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
    uint16_t *K = NULL, *V = NULL;
    float *scale = NULL;
    size_t n = (size_t)e->nkv * T * e->hd;
    TRY(dalloc(&K, n * 2, "synthetic K"));
    kv_status st = dalloc(&V, n * 2, "synthetic V");
    if (!st) st = dalloc(&scale, (size_t)e->hd * sizeof(float), "synthetic scales");
    /* real keys have a few channels of much larger magnitude (what makes
     * channel selection work); values are plain */
    float *hs = malloc((size_t)e->hd * sizeof(float));
    if (!st && !hs) st = kv_fail(KV_E_NOMEM, "out of memory");
    if (!st) {
        for (int c = 0; c < e->hd; c++) hs[c] = (c % 16 == 3) ? 6.0f : (c % 7 == 0 ? 2.0f : 1.0f);
        cudaError_t ce = cudaMemcpyAsync(scale, hs, (size_t)e->hd * sizeof(float),
                                         cudaMemcpyHostToDevice, e->s_main);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(e->s_main);
        if (ce != cudaSuccess) st = cuda_fail(ce, "scale upload", __LINE__);
    }
    uint16_t *tmp = NULL;
    if (!st) {
        size_t need = 2 * n, cm = (size_t)e->nkv * e->hd * pad8(T);
        st = dalloc(&tmp, (need > cm ? need : cm) * 2, "ingest scratch");
    }
    for (int l = 0; l < e->L && !st; l++) {
        cudaError_t ce = eng_fill_random(K, ENG_F16, n, seed * 1315423911u + 2u * l, scale, e->hd, 1, e->s_main);
        if (ce == cudaSuccess) ce = eng_fill_random(V, ENG_F16, n, seed * 1315423911u + 2u * l + 1, NULL, 1, 1, e->s_main);
        if (ce != cudaSuccess) st = cuda_fail(ce, "synthetic fill", __LINE__);
        if (!st) st = ingest(e, l, K, V, T, T, tmp);
    }
    cudaDeviceSynchronize();
    free(hs);
    dfree(&tmp);
    dfree(&scale);
    dfree(&V);
    dfree(&K);
    if (!st) e->pos = T;
    return st;
}

// --- accessors and accounting --------------------------------------------------------------

void kv_gpu_engine_set_no_fetch(kv_gpu_engine *e, bool no_fetch) { e->o.no_fetch = no_fetch; }
int kv_gpu_engine_vocab(const kv_gpu_engine *e) { return e->vocab; }
int kv_gpu_engine_pos(const kv_gpu_engine *e) { return e->pos; }
int kv_gpu_engine_ctx(const kv_gpu_engine *e) { return e->ctx; }
int kv_gpu_engine_n_layers(const kv_gpu_engine *e) { return e->L; }
const char *kv_gpu_engine_device(const kv_gpu_engine *e) { return e->devname; }
uint64_t kv_gpu_engine_weight_bytes(const kv_gpu_engine *e) { return e->wbytes; }
uint64_t kv_gpu_engine_weight_read_bytes(const kv_gpu_engine *e) { return e->wread; }

kv_status kv_gpu_engine_layer_bytes(const kv_gpu_engine *e, int layer, kv_bytes *b)
{
    memset(b, 0, sizeof *b);
    if (layer < 0 || layer >= e->L) return kv_fail(KV_E_USAGE, "layer %d out of range", layer);
    const gl_layer *y = &e->lay[layer];
    const uint64_t nkv = (uint64_t)e->nkv, hd = (uint64_t)e->hd, T = (uint64_t)y->T;
    b->fetched_last = y->fetched_last;
    b->fetched_total = y->fetched_total;
    b->attends = y->attends;
    switch (y->kind) {
    case L_FULL:
        b->resident = 2 * nkv * T * hd * 2;
        break;
    case L_OFFLOAD:
        b->host = 2 * nkv * T * hd * 2;
        break;
    case L_STREAM: {
        uint64_t S = (uint64_t)y->prm.sink, W = (uint64_t)y->prm.window;
        uint64_t held = T < S ? T : S + (T - S < W ? T - S : W);
        b->resident = 2 * nkv * held * hd * 2;
        break;
    }
    case L_DSQ: { /* as kv_policy_dsq.c: packed windows (one mask for K and V) + fp16 rest */
        int Tp = y->packed * y->dp.window;
        kv_dsq_sizes ds;
        kv_dsq_part_sizes(KV_KIVI_KEYS, &y->dp, e->nkv, Tp, e->hd, &ds);
        b->resident = kv_dsq_bytes(KV_KIVI_KEYS, &y->dp, e->nkv, Tp, e->hd) +
                      kv_dsq_bytes(KV_KIVI_VALUES, &y->dp, e->nkv, Tp, e->hd) - ds.mask +
                      2 * nkv * (T - (uint64_t)Tp) * hd * 2;
        break;
    }
    case L_QDQ: /* the same bytes as L_QUANT (the fp16 expansion is per-step scratch) */
    case L_QUANT: {
        uint64_t crow = kv_kivi_row_bytes(e->hd, y->kp.bits), nq = (uint64_t)y->nq;
        uint64_t gv = (uint64_t)kv_kivi_vgroup(y->kp.group, e->hd);
        b->resident = 2 * nkv * nq * crow + 2 * nkv * (nq / (uint64_t)y->kp.group) * hd * 2 +
                      2 * nkv * nq * (hd / gv) * 2 + 2 * nkv * (uint64_t)y->nres * hd * 2;
        break;
    }
    case L_SPARSE: {
        uint64_t Tp = (uint64_t)y->Tp;
        b->host = 2 * nkv * Tp * hd * 2 + (y->kcm_h ? nkv * hd * (uint64_t)y->ldc * 2 : 0);
        /* resident: the attention buffer (gathered + sink + tail + generated
         * rows, allocated for the whole context), key statistics, sketch */
        b->resident = 2 * nkv * (uint64_t)y->cap * hd * 2 + 3 * nkv * hd * 4 +
                      (y->sink ? (uint64_t)y->cs0 * nkv * 2 * hd * 2 : 0) +
                      (y->sketch ? nkv * Tp * hd / 8 : 0);
        break;
    }
    }
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

static float elapsed(cudaEvent_t a, cudaEvent_t b)
{
    float ms = 0;
    if (cudaEventElapsedTime(&ms, a, b) != cudaSuccess) {
        (void)cudaGetLastError();
        ms = 0;
    }
    return ms;
}

void kv_gpu_engine_timing(const kv_gpu_engine *e, kv_gpu_timing *t)
{
    memset(t, 0, sizeof *t);
    if (!e->o.profile) return;
    cudaDeviceSynchronize();
    for (int l = 0; l < e->L; l++) {
        const gl_layer *y = &e->lay[l];
        if (y->kind == L_SPARSE && wants_pred(e, l) && !e->o.no_fetch) {
            t->select_ms += elapsed(e->ev_p0[l], e->ev_p1[l]);
            t->fetch_ms += elapsed(e->ev_g0[l], e->ev_g1[l]);
        }
        if (y->kind == L_OFFLOAD) {
            float ms = elapsed(e->ev_p0[l], e->ev_p1[l]);
            t->copy_ms += ms;
            t->fetch_ms += ms;
        }
    }
}

#else /* !KV_HAVE_CUDA */

// --- CPU-only build: the GPU engine is unavailable ------------------------------------------

struct kv_gpu_engine {
    int unused;
};

kv_status kv_gpu_engine_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                            const kv_gpu_engine_opts *opts, kv_gpu_engine **out)
{
    (void)m; (void)per_layer; (void)ctx; (void)opts;
    *out = NULL;
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA: the GPU engine is "
                   "unavailable (use --device cpu)");
}

void kv_gpu_engine_free(kv_gpu_engine *e) { free(e); }

static kv_status no_cuda(void)
{
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA");
}

kv_status kv_gpu_engine_reset(kv_gpu_engine *e, const kv_policy_params *per_layer)
{
    (void)e; (void)per_layer;
    return no_cuda();
}

kv_status kv_gpu_engine_reset_opts(kv_gpu_engine *e, const kv_policy_params *per_layer,
                                   const kv_gpu_engine_opts *opts)
{
    (void)e; (void)per_layer; (void)opts;
    return no_cuda();
}

kv_status kv_gpu_engine_prefill(kv_gpu_engine *e, const int *tokens, int n, float *logits_last)
{
    (void)e; (void)tokens; (void)n; (void)logits_last;
    return no_cuda();
}

kv_status kv_gpu_engine_step(kv_gpu_engine *e, int token, float *logits)
{
    (void)e; (void)token; (void)logits;
    return no_cuda();
}

kv_status kv_gpu_engine_generate(kv_gpu_engine *e, int token, int n, int *out, float *step_ms)
{
    (void)e; (void)token; (void)n; (void)out; (void)step_ms;
    return no_cuda();
}

kv_status kv_gpu_engine_synthesize(kv_gpu_engine *e, int T, uint64_t seed)
{
    (void)e; (void)T; (void)seed;
    return no_cuda();
}

void kv_gpu_engine_set_no_fetch(kv_gpu_engine *e, bool no_fetch) { (void)e; (void)no_fetch; }
int kv_gpu_engine_vocab(const kv_gpu_engine *e) { (void)e; return 0; }
int kv_gpu_engine_pos(const kv_gpu_engine *e) { (void)e; return 0; }
int kv_gpu_engine_ctx(const kv_gpu_engine *e) { (void)e; return 0; }
int kv_gpu_engine_n_layers(const kv_gpu_engine *e) { (void)e; return 0; }
const char *kv_gpu_engine_device(const kv_gpu_engine *e) { (void)e; return "none (CUDA not built in)"; }
uint64_t kv_gpu_engine_weight_bytes(const kv_gpu_engine *e) { (void)e; return 0; }
uint64_t kv_gpu_engine_weight_read_bytes(const kv_gpu_engine *e) { (void)e; return 0; }

kv_status kv_gpu_engine_layer_bytes(const kv_gpu_engine *e, int layer, kv_bytes *b)
{
    (void)e; (void)layer;
    memset(b, 0, sizeof *b);
    return no_cuda();
}

void kv_gpu_engine_bytes(const kv_gpu_engine *e, kv_bytes *total)
{
    (void)e;
    memset(total, 0, sizeof *total);
}

void kv_gpu_engine_timing(const kv_gpu_engine *e, kv_gpu_timing *t)
{
    (void)e;
    memset(t, 0, sizeof *t);
}

#endif
