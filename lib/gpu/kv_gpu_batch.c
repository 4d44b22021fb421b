/*
 * kv_gpu_batch: B sequences decoding together on one copy of the weights
 * (see kv_gpu_batch.h).  The batch owns the activation rows of every
 * sequence and points each sequence engine's x, qkv, att, hb and logits at
 * its row (the engine's own buffers are kept aside and put back at the
 * end); it runs the products on a stream of its own and each sequence's
 * work on one of four lanes (the first four engines' main streams).
 * A step is then the engine's layer loop (lib/gpu/kv_gpu_engine.c,
 * forward) with the projections batched: what is per sequence (the
 * predicted query and selection of a sparse layer, RoPE and the store of
 * the new row through the placement's slot, the placement's attention) is
 * the engine's own code, called per sequence in order.
 */
#include "gpu/kv_gpu_batch.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *kv_gpu_gemm_name(kv_gpu_gemm g)
{
    return g == KV_GPU_GEMM_GEMV ? "gemv" : g == KV_GPU_GEMM_CUBLAS ? "cublas" : "auto";
}

kv_status kv_gpu_gemm_parse(const char *s, kv_gpu_gemm *g)
{
    if (!strcmp(s, "auto")) *g = KV_GPU_GEMM_AUTO;
    else if (!strcmp(s, "gemv")) *g = KV_GPU_GEMM_GEMV;
    else if (!strcmp(s, "cublas")) *g = KV_GPU_GEMM_CUBLAS;
    else return kv_fail(KV_E_USAGE, "'%s' is not auto, gemv or cublas", s);
    return KV_OK;
}

kv_status kv_gpu_batch_max(uint64_t gpu, uint64_t host, uint64_t margin, int cap, int *B, const char **why);

#ifdef KV_HAVE_CUDA

#include "eng_batch_ops.h"
#include "gpu/kv_cublas.h"
#include "gpu/kv_gpu_int.h"
#include "prefill_ops.h"

/* an engine's activation buffers, kept aside while it is in the batch */
typedef struct {
    float *x, *qkv, *att, *hb, *logits;
    cudaStream_t s_main;
} own_acts;

/* streams the sequences' own work is spread over (each sequence on one,
 * in order), so that one sequence's small kernels overlap another's */
#define LANES 4

struct kv_gpu_batch {
    int B;
    int S;                   /* lanes in use: min(B, LANES) */
    cudaStream_t lane[LANES]; /* the first S engines' main streams; sequence i runs on lane i % S */
    cudaEvent_t ev_x, ev_q;  /* batch stream: a layer's input ready, its projections ready */
    cudaEvent_t ev_a[LANES]; /* lane j: its sequences' attention of the layer done */
    kv_gpu_engine *w;        /* the weights (borrowed) */
    kv_gpu_engine **e;       /* (B) sequence engines, sharing w's weights */
    own_acts *own;           /* (B) */
    cudaStream_t s;          /* the batch's stream: embedding, projections, logits */
    bool cublas;             /* products on the tensor cores */
    kv_cublas *cb;
    int ldqkv;               /* pad8(qd + 2 kvd) */
    float *X;                /* (B, ld_dim) residual streams */
    float *QKV;              /* (B, ldqkv) projections */
    float *ATT;              /* (B, ld_qd) attention outputs */
    float *HB;               /* (B, ld_hid) SwiGLU outputs */
    float *LOG;              /* (B, vocab) logits */
    float *GU;               /* cublas: (B, 2 hidden) gate/up, interleaved */
    void *X16, *A16, *H16;   /* cublas: (B, ld_dim), (B, ld_qd), (B, ld_hid) 16-bit inputs */
    int *d_tok;              /* (tok_cap) ids, (steps + 1, B) */
    size_t tok_cap;
    uint64_t own_bytes;
    char desc[64];
};

int kv_gpu_batch_size(const kv_gpu_batch *b) { return b->B; }
kv_gpu_engine *kv_gpu_batch_seq(kv_gpu_batch *b, int i) { return i >= 0 && i < b->B ? b->e[i] : NULL; }
const char *kv_gpu_batch_gemm_desc(const kv_gpu_batch *b) { return b->desc; }
uint64_t kv_gpu_batch_own_bytes(const kv_gpu_batch *b) { return b->own_bytes; }

static kv_status balloc(kv_gpu_batch *b, void *pp, size_t bytes, const char *what)
{
    TRY(gl_dalloc(pp, bytes, what));
    void **p = (void **)pp;
    if (*p) CK(cudaMemset(*p, 0, bytes)); /* GEMV inputs' padding must be zero */
    b->own_bytes += bytes;
    return KV_OK;
}

void kv_gpu_batch_free(kv_gpu_batch *b)
{
    if (!b) return;
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    for (int i = 0; b->e && i < b->B; i++) {
        kv_gpu_engine *e = b->e[i];
        if (!e) continue;
        if (b->own && b->own[i].x) { /* its own buffers back, then free it */
            e->x = b->own[i].x, e->qkv = b->own[i].qkv, e->att = b->own[i].att;
            e->hb = b->own[i].hb, e->logits = b->own[i].logits, e->s_main = b->own[i].s_main;
        }
        kv_gpu_engine_free(e);
    }
    kv_cublas_close(b->cb);
    if (b->s) cudaStreamDestroy(b->s);
    if (b->ev_x) cudaEventDestroy(b->ev_x);
    if (b->ev_q) cudaEventDestroy(b->ev_q);
    for (int j = 0; j < LANES; j++)
        if (b->ev_a[j]) cudaEventDestroy(b->ev_a[j]);
    void *d[] = {b->X, b->QKV, b->ATT, b->HB, b->LOG, b->GU, b->X16, b->A16, b->H16, b->d_tok};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        if (d[i]) cudaFree(d[i]);
    free(b->own);
    free(b->e);
    free(b);
}

static kv_status batch_init(kv_gpu_batch *b, const kv_policy_params *const *per_seq, int ctx, kv_gpu_gemm gemm)
{
    kv_gpu_engine *w = b->w;
    const int B = b->B;
    b->ldqkv = gl_pad8(w->qd + 2 * w->kvd);
    const size_t nB = (size_t)B;
    TRY(balloc(b, &b->X, nB * w->ld_dim * 4, "batch residual streams"));
    TRY(balloc(b, &b->QKV, nB * b->ldqkv * 4, "batch projections"));
    TRY(balloc(b, &b->ATT, nB * w->ld_qd * 4, "batch attention outputs"));
    TRY(balloc(b, &b->HB, nB * w->ld_hid * 4, "batch SwiGLU outputs"));
    TRY(balloc(b, &b->LOG, nB * w->vocab * 4, "batch logits"));
    b->cublas = gemm == KV_GPU_GEMM_CUBLAS || (gemm == KV_GPU_GEMM_AUTO && B > KV_GPU_BATCH_GEMV_MAX);
    if (b->cublas) {
        kv_status st = kv_cublas_open(&b->cb);
        if (st && gemm == KV_GPU_GEMM_CUBLAS) return st;
        b->cublas = !st;
        kv_errclear();
    }
    if (b->cublas) {
        TRY(balloc(b, &b->GU, nB * 2 * w->hidden * 4, "batch gate/up"));
        TRY(balloc(b, &b->X16, nB * w->ld_dim * 2, "batch 16-bit inputs"));
        TRY(balloc(b, &b->A16, nB * w->ld_qd * 2, "batch 16-bit attention outputs"));
        TRY(balloc(b, &b->H16, nB * w->ld_hid * 2, "batch 16-bit SwiGLU outputs"));
    }
    snprintf(b->desc, sizeof b->desc, "%s%s", b->cublas ? "cublas" : "gemv",
             gl_weights_packed(w) ? " (packed groups per sequence)" : "");
    for (int i = 0; i < B; i++) {
        kv_gpu_engine *e = NULL;
        kv_status st = kv_gpu_engine_new_sharing(w, per_seq ? per_seq[i] : NULL, ctx, &w->o, &e);
        if (st) {
            kv_errcontext("sequence %d of %d", i, B);
            return st;
        }
        b->e[i] = e;
        b->own[i] = (own_acts){e->x, e->qkv, e->att, e->hb, e->logits, e->s_main};
        e->x = b->X + (size_t)i * w->ld_dim;
        e->qkv = b->QKV + (size_t)i * b->ldqkv;
        e->att = b->ATT + (size_t)i * w->ld_qd;
        e->hb = b->HB + (size_t)i * w->ld_hid;
        e->logits = b->LOG + (size_t)i * w->vocab;
        if (i < LANES) b->lane[i] = e->s_main;
        else e->s_main = b->lane[i % LANES];
    }
    b->S = B < LANES ? B : LANES;
    CK(cudaStreamCreateWithFlags(&b->s, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&b->ev_x, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&b->ev_q, cudaEventDisableTiming));
    for (int j = 0; j < b->S; j++) CK(cudaEventCreateWithFlags(&b->ev_a[j], cudaEventDisableTiming));
    CK(cudaDeviceSynchronize());
    return KV_OK;
}

kv_status kv_gpu_batch_new(kv_gpu_engine *w, int B, const kv_policy_params *const *per_seq, int ctx,
                           kv_gpu_gemm gemm, kv_gpu_batch **out)
{
    *out = NULL;
    if (!w) return kv_fail(KV_E_UNAVAILABLE, "no GPU engine to share weights from");
    if (B < 1 || B > (1 << 16)) return kv_fail(KV_E_USAGE, "batch of %d sequences", B);
    kv_gpu_batch *b = calloc(1, sizeof *b);
    if (!b) return kv_fail(KV_E_NOMEM, "out of memory");
    b->B = B;
    b->w = w;
    b->e = calloc((size_t)B, sizeof *b->e);
    b->own = calloc((size_t)B, sizeof *b->own);
    kv_status st = b->e && b->own ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory");
    if (!st) st = batch_init(b, per_seq, ctx, gemm);
    if (st) {
        kv_gpu_batch_free(b);
        return st;
    }
    *out = b;
    return KV_OK;
}

// --- the batched projections -------------------------------------------------------

static pf_dtype pft(const kv_gpu_engine *w) { return w->wt == KV_DT_BF16 ? PF_BF16 : PF_F16; }
static kv_gemm_type gmt(const kv_gpu_engine *w) { return w->wt == KV_DT_BF16 ? KV_GEMM_BF16 : KV_GEMM_F16; }

/* out (B, ldo) = W rmsnorm(X, nw) [+ glu] for a 16-bit W of rows (GLU: 2*rows) */
static kv_status proj_norm(kv_gpu_batch *b, const void *W, int rows, const float *nw, float *out, int ldo,
                           bool glu)
{
    kv_gpu_engine *w = b->w;
    if (!b->cublas) {
        CK(eng_gemv_batch(W, w->wt, rows, w->ld_dim, b->X, w->ld_dim, b->B, nw, w->dim, w->eps, out, ldo,
                          glu ? ENG_GB_GLU : ENG_GB_NORM, 0, b->s));
        return KV_OK;
    }
    CK(pf_rmsnorm_rows(b->X, w->ld_dim, nw, w->dim, w->eps, b->B, b->X16, pft(w), w->ld_dim, b->s));
    if (!glu)
        return kv_cublas_gemm(b->cb, b->s, b->B, rows, w->dim, W, w->ld_dim, b->X16, w->ld_dim, gmt(w), out, ldo,
                              KV_GEMM_F32, false);
    TRY(kv_cublas_gemm(b->cb, b->s, b->B, 2 * rows, w->dim, W, w->ld_dim, b->X16, w->ld_dim, gmt(w), b->GU,
                       2 * w->hidden, KV_GEMM_F32, false));
    CK(pf_swiglu_rows(b->GU, 2 * w->hidden, rows, b->B, b->H16, pft(w), w->ld_hid, b->s));
    return KV_OK;
}

/* X (B, ld_dim) += W in for a 16-bit W (dim, ldw); in (B, ldi) float32, or
 * (cublas) its 16-bit copy in16 (in NULL: already there) */
static kv_status proj_acc(kv_gpu_batch *b, const void *W, int ldw, int k, const float *in, int ldi, void *in16)
{
    kv_gpu_engine *w = b->w;
    if (!b->cublas) {
        CK(eng_gemv_batch(W, w->wt, w->dim, ldw, in, ldi, b->B, NULL, 0, 0.0f, b->X, w->ld_dim, ENG_GB_PLAIN, 1,
                          b->s));
        return KV_OK;
    }
    if (in) CK(eng_rows_to_16(in, ldi, k, b->B, in16, w->wt, ldw, b->s));
    return kv_cublas_gemm(b->cb, b->s, b->B, w->dim, k, W, ldw, in16, ldw, gmt(w), b->X, w->ld_dim, KV_GEMM_F32,
                          true);
}

static kv_status batch_qkv(kv_gpu_batch *b, int l)
{
    const gw_layer *gw = &b->w->w[l];
    kv_gpu_engine *w = b->w;
    if (!gw->qkv) { /* packed: per sequence */
        for (int i = 0; i < b->B; i++) TRY(gl_qkv(b->e[i], l, b->s));
        return KV_OK;
    }
    TRY(proj_norm(b, gw->qkv, w->qd + 2 * w->kvd, gw->attn_norm, b->QKV, b->ldqkv, false));
    if (gw->bqkv) CK(eng_add_bias_rows(b->QKV, b->ldqkv, gw->bqkv, w->qd + 2 * w->kvd, b->B, b->s));
    return KV_OK;
}

static kv_status batch_attn_out(kv_gpu_batch *b, int l)
{
    const gw_layer *gw = &b->w->w[l];
    kv_gpu_engine *w = b->w;
    if (!gw->o) {
        for (int i = 0; i < b->B; i++) TRY(gl_attn_out(b->e[i], l, b->s));
        return KV_OK;
    }
    TRY(proj_acc(b, gw->o, w->ld_qd, w->qd, b->ATT, w->ld_qd, b->A16));
    if (gw->bo) CK(eng_add_bias_rows(b->X, w->ld_dim, gw->bo, w->dim, b->B, b->s));
    return KV_OK;
}

static kv_status batch_ffn(kv_gpu_batch *b, int l)
{
    const gw_layer *gw = &b->w->w[l];
    kv_gpu_engine *w = b->w;
    if (!gw->gu || !gw->down) {
        for (int i = 0; i < b->B; i++) TRY(gl_ffn(b->e[i], l, b->s));
        return KV_OK;
    }
    TRY(proj_norm(b, gw->gu, w->hidden, gw->ffn_norm, b->HB, w->ld_hid, true));
    /* cublas: the SwiGLU kernel already wrote H16 */
    return proj_acc(b, gw->down, w->ld_hid, w->hidden, b->cublas ? NULL : b->HB, w->ld_hid, b->H16);
}

static kv_status batch_logits(kv_gpu_batch *b)
{
    kv_gpu_engine *w = b->w;
    if (!w->outw) {
        for (int i = 0; i < b->B; i++) TRY(gl_logits(b->e[i], b->s));
        return KV_OK;
    }
    return proj_norm(b, w->outw, w->vocab, w->out_norm, b->LOG, w->vocab, false);
}

static kv_status batch_embed(kv_gpu_batch *b, const int *dtok)
{
    kv_gpu_engine *w = b->w;
    if (w->pembd.data)
        CK(eng_embed_rows_q(w->pembd.data, w->pembd.type, w->dim, w->pembd.pitch, dtok, b->B, b->X, w->ld_dim, b->s));
    else
        CK(pf_embed_rows(w->embd, pft(w), w->ld_dim, w->dim, dtok, b->B, b->X, w->ld_dim, b->s));
    return KV_OK;
}

/* One token of every sequence through every layer (kv_gpu_engine.c's
 * forward with the projections batched); ids dtok (B) on the device. */
static kv_status batch_forward(kv_gpu_batch *b, const int *dtok)
{
    const int L = b->w->L;
    TRY(batch_embed(b, dtok));
    for (int i = 0; i < b->B; i++) {
        kv_gpu_engine *e = b->e[i];
        e->sel.side_last = -1;
        e->off.next = 0;
        for (int l = 0; l < L; l++)
            if (e->lay[l].pl->step_begin) TRY(e->lay[l].pl->step_begin(e, &e->lay[l]));
    }
    for (int l = 0; l < L; l++) {
        /* the lanes read the layer's input (X) from here on: the predicted
         * queries beside the batch's projections, then RoPE and attention */
        CK(cudaEventRecord(b->ev_x, b->s));
        for (int j = 0; j < b->S; j++) CK(cudaStreamWaitEvent(b->lane[j], b->ev_x, 0));
        for (int i = 0; i < b->B; i++)
            TRY(gl_predict_from(b->e[i], l));
        TRY(batch_qkv(b, l));
        CK(cudaEventRecord(b->ev_q, b->s));
        for (int j = 0; j < b->S; j++) CK(cudaStreamWaitEvent(b->lane[j], b->ev_q, 0));
        for (int i = 0; i < b->B; i++) {
            kv_gpu_engine *e = b->e[i];
            gl_layer *y = &e->lay[l];
            const int pos = e->pos;
            float *q = e->qkv, *k = q + e->qd, *v = k + e->kvd;
            gl_row r;
            TRY(y->pl->slot(e, y, pos, &r));
            CK(eng_rope_store(q, e->q16, e->nqh, k, v, e->nkv, e->hd, e->inv_freq, pos + e->rope_off, r.k, r.v,
                              r.hs, e->s_main));
            TRY(y->pl->attend(e, y, pos, q, &r));
            y->T = pos + 1;
            y->attends++;
        }
        for (int j = 0; j < b->S; j++) {
            CK(cudaEventRecord(b->ev_a[j], b->lane[j]));
            CK(cudaStreamWaitEvent(b->s, b->ev_a[j], 0));
        }
        TRY(batch_attn_out(b, l));
        TRY(batch_ffn(b, l));
    }
    return batch_logits(b);
}

kv_status kv_gpu_batch_generate(kv_gpu_batch *b, const int *first, int n, int *out, float *step_ms)
{
    if (n < 1) return KV_OK;
    const int B = b->B;
    for (int i = 0; i < B; i++) {
        const kv_gpu_engine *e = b->e[i];
        if (e->pos == 0) return kv_fail(KV_E_USAGE, "sequence %d has no context: prefill or synthesize first", i);
        if (e->pos + n > e->ctx)
            return kv_fail(KV_E_USAGE, "sequence %d: %d more tokens exceed the context of %d", i, n, e->ctx);
        if (first[i] < 0 || first[i] >= e->vocab)
            return kv_fail(KV_E_DATA, "sequence %d: token %d is outside the vocabulary (%d)", i, first[i], e->vocab);
    }
    const size_t need = (size_t)(n + 1) * B;
    if (need > b->tok_cap) {
        CK(cudaDeviceSynchronize());
        if (b->d_tok) cudaFree(b->d_tok);
        b->d_tok = NULL;
        b->tok_cap = 0;
        TRY(gl_dalloc(&b->d_tok, need * sizeof(int), "batch token ids"));
        b->tok_cap = need;
    }
    cudaEvent_t *ev = calloc((size_t)n + 1, sizeof *ev);
    if (!ev) return kv_fail(KV_E_NOMEM, "out of memory");
    kv_status st = KV_OK;
    for (int i = 0; i <= n && !st; i++) {
        cudaError_t ce = cudaEventCreate(&ev[i]);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "cudaEventCreate(&ev[i])", __FILE__, __LINE__);
    }
    if (!st) {
        /* pageable source: staged before the call returns, ordered on the stream */
        cudaError_t ce = cudaMemcpyAsync(b->d_tok, first, (size_t)B * sizeof(int), cudaMemcpyHostToDevice, b->s);
        if (ce == cudaSuccess) ce = cudaEventRecord(ev[0], b->s);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "batch generate start", __FILE__, __LINE__);
    }
    for (int t = 0; t < n && !st; t++) {
        st = batch_forward(b, b->d_tok + (size_t)t * B);
        for (int i = 0; i < B && !st; i++) {
            cudaError_t ce = eng_argmax(b->LOG + (size_t)i * b->w->vocab, b->w->vocab,
                                        b->d_tok + (size_t)(t + 1) * B + i, b->s);
            if (ce != cudaSuccess) st = kv_cuda_fail(ce, "argmax", __FILE__, __LINE__);
        }
        if (!st) {
            cudaError_t ce = cudaEventRecord(ev[t + 1], b->s);
            if (ce != cudaSuccess) st = kv_cuda_fail(ce, "cudaEventRecord", __FILE__, __LINE__);
        }
        for (int i = 0; i < B && !st; i++) b->e[i]->pos++;
    }
    if (!st) {
        cudaError_t ce = cudaStreamSynchronize(b->s);
        if (ce == cudaSuccess)
            ce = cudaMemcpy(out, b->d_tok + B, (size_t)n * B * sizeof(int), cudaMemcpyDeviceToHost);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "batch generate", __FILE__, __LINE__);
    }
    for (int t = 0; t < n && !st && step_ms; t++) step_ms[t] = gl_elapsed(ev[t], ev[t + 1]);
    for (int i = 0; i <= n; i++)
        if (ev[i]) cudaEventDestroy(ev[i]);
    free(ev);
    return st;
}

kv_status kv_gpu_batch_logits(const kv_gpu_batch *b, int i, float *out)
{
    if (i < 0 || i >= b->B) return kv_fail(KV_E_USAGE, "sequence %d of %d", i, b->B);
    CK(cudaStreamSynchronize(b->s));
    CK(cudaMemcpy(out, b->LOG + (size_t)i * b->w->vocab, (size_t)b->w->vocab * 4, cudaMemcpyDeviceToHost));
    return KV_OK;
}

// --- how many fit -----------------------------------------------------------------

kv_status kv_gpu_batch_probe(kv_gpu_engine *w, const kv_policy_params *per_layer, int ctx, int T,
                             uint64_t seed, uint64_t *gpu, uint64_t *host)
{
    *gpu = *host = 0;
    const kv_policy_params *one[1] = {per_layer};
    size_t free0 = 0, free1 = 0, total = 0;
    CK(cudaDeviceSynchronize());
    CK(cudaMemGetInfo(&free0, &total));
    kv_gpu_batch *b = NULL;
    TRY(kv_gpu_batch_new(w, 1, one, ctx, KV_GPU_GEMM_GEMV, &b));
    kv_gpu_engine *e = b->e[0];
    kv_status st = kv_gpu_engine_synthesize(e, T, seed);
    int first = 1, ids[2];
    if (!st) st = kv_gpu_batch_generate(b, &first, 2, ids, NULL); /* workspaces grow at the first steps */
    if (!st) {
        cudaError_t ce = cudaDeviceSynchronize();
        if (ce == cudaSuccess) ce = cudaMemGetInfo(&free1, &total);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "cudaMemGetInfo", __FILE__, __LINE__);
    }
    if (!st) {
        kv_bytes kb;
        kv_gpu_engine_bytes(e, &kb);
        *gpu = free0 > free1 ? (uint64_t)(free0 - free1) : 0;
        if (*gpu < kb.resident) *gpu = kb.resident;
        *host = kb.host;
    }
    kv_gpu_batch_free(b);
    return st;
}

kv_status kv_gpu_batch_max(uint64_t gpu, uint64_t host, uint64_t margin, int cap, int *B, const char **why)
{
    *B = 0;
    *why = "gpu";
    size_t fr = 0, total = 0;
    CK(cudaDeviceSynchronize());
    CK(cudaMemGetInfo(&fr, &total));
    if (!margin) {
        margin = (uint64_t)total / 25;
        if (margin < ((uint64_t)1 << 30)) margin = (uint64_t)1 << 30;
    }
    uint64_t n = gpu && fr > margin ? ((uint64_t)fr - margin) / gpu : (uint64_t)cap;
    if (host) {
        long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        uint64_t avail = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 0, keep = (uint64_t)8 << 30;
        uint64_t nh = avail > keep ? (avail - keep) / host : 0;
        if (nh < n) n = nh, *why = "host";
    }
    if (n > (uint64_t)cap) n = (uint64_t)cap, *why = "cap";
    if (n < 1)
        return kv_fail(KV_E_NOMEM, "not one sequence fits: %.2f GiB of GPU memory free, %.2f GiB needed per sequence",
                       (double)fr / 1073741824.0, (double)gpu / 1073741824.0);
    *B = (int)n;
    return KV_OK;
}

#else /* CPU-only build */

struct kv_gpu_batch {
    int B;
};

static kv_status no_cuda(void) { return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA"); }

kv_status kv_gpu_batch_new(kv_gpu_engine *w, int B, const kv_policy_params *const *per_seq, int ctx,
                           kv_gpu_gemm gemm, kv_gpu_batch **out)
{
    (void)w, (void)B, (void)per_seq, (void)ctx, (void)gemm;
    *out = NULL;
    return no_cuda();
}
void kv_gpu_batch_free(kv_gpu_batch *b) { free(b); }
int kv_gpu_batch_size(const kv_gpu_batch *b) { return b ? b->B : 0; }
kv_gpu_engine *kv_gpu_batch_seq(kv_gpu_batch *b, int i) { (void)b, (void)i; return NULL; }
const char *kv_gpu_batch_gemm_desc(const kv_gpu_batch *b) { (void)b; return "none"; }
uint64_t kv_gpu_batch_own_bytes(const kv_gpu_batch *b) { (void)b; return 0; }
kv_status kv_gpu_batch_logits(const kv_gpu_batch *b, int i, float *out)
{
    (void)b, (void)i, (void)out;
    return no_cuda();
}
kv_status kv_gpu_batch_generate(kv_gpu_batch *b, const int *first, int n, int *out, float *step_ms)
{
    (void)b, (void)first, (void)n, (void)out, (void)step_ms;
    return no_cuda();
}
kv_status kv_gpu_batch_probe(kv_gpu_engine *w, const kv_policy_params *per_layer, int ctx, int T,
                             uint64_t seed, uint64_t *gpu, uint64_t *host)
{
    (void)w, (void)per_layer, (void)ctx, (void)T, (void)seed;
    *gpu = *host = 0;
    return no_cuda();
}
kv_status kv_gpu_batch_max(uint64_t gpu, uint64_t host, uint64_t margin, int cap, int *B, const char **why)
{
    (void)gpu, (void)host, (void)margin, (void)cap;
    *B = 0;
    *why = "none";
    return no_cuda();
}

#endif
