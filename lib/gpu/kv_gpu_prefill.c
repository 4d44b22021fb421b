/*
 * kv_gpu_prefill: one layer over one prefill chunk (see kv_gpu_prefill.h):
 * the row kernels of kernels/prefill_elem.cu, the attention of
 * kernels/prefill_attn.cu and four cuBLAS products per layer (a packed
 * matrix group dequantized by kernels/eng_dequant.cu before its product,
 * biases added by eng_add_bias_rows after).
 */
#include "gpu/kv_gpu_prefill.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

double kv_gpu_prefill_attn_flops(int T, int n_heads, int head_dim)
{
    return 4.0 * (double)T * (double)T * n_heads * head_dim / 2.0;
}

int kv_gpu_prefill_gemm_rows(const kv_pf_ws *ws, int n)
{
    if (ws->pad <= 1) return n;
    const int r = (n + ws->pad - 1) / ws->pad * ws->pad;
    return r <= ws->cap ? r : n;
}

static size_t pf_f32_cols(const kv_pf_geom *g)
{
    size_t a = (size_t)(g->n_heads + 2 * g->n_kv_heads) * g->head_dim, b = 2 * (size_t)g->hidden;
    return a > b ? a : b;
}

static size_t al256(size_t n) { return (n + 255) & ~(size_t)255; }

/* 16-bit values of the largest matrix group in the engine's layout. */
static size_t pf_wdq_elems(const kv_pf_geom *g)
{
    const size_t qkv = (size_t)(g->n_heads + 2 * g->n_kv_heads) * g->head_dim * g->ld_dim;
    const size_t o = (size_t)g->dim * g->ld_qd, gu = 2 * (size_t)g->hidden * g->ld_dim;
    const size_t dn = (size_t)g->dim * g->ld_hid;
    size_t m = qkv > o ? qkv : o;
    m = m > gu ? m : gu;
    return m > dn ? m : dn;
}

size_t kv_gpu_prefill_ws_bytes(const kv_pf_geom *g, int C)
{
    const size_t c = (size_t)C, qd = (size_t)g->n_heads * g->head_dim;
    return al256(c * g->ld_dim * 2) + al256(c * pf_f32_cols(g) * 4) + al256(c * qd * 2) +
           al256(c * g->ld_qd * 2) + al256(c * g->ld_hid * 2) + (g->packed ? al256(pf_wdq_elems(g) * 2) : 0);
}

#ifdef KV_HAVE_CUDA

#include <cuda_runtime_api.h>

#include "eng_ops.cuh"
#include "gpu/kv_gpu_cuda.h"
#include "prefill_ops.h"

/* A failed CUDA call or launcher as a kv_status (lib/gpu/kv_gpu_cuda.h's convention). */
static kv_status pf_cuda_at(cudaError_t e, const char *what, int line)
{
    return e == cudaSuccess ? KV_OK : kv_cuda_fail(e, what, __FILE__, line);
}
#define pf_cuda(call, what) pf_cuda_at((call), (what), __LINE__)

kv_status kv_gpu_prefill_ws_alloc(const kv_pf_geom *g, int C, kv_pf_ws *ws)
{
    memset(ws, 0, sizeof *ws);
    if (C < 1) return kv_fail(KV_E_USAGE, "prefill chunk of %d rows", C);
    size_t bytes = kv_gpu_prefill_ws_bytes(g, C);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kv_fail(KV_E_NOMEM, "GPU out of memory: the prefill workspace of %d rows needs "
                       "%.1f MiB", C, (double)bytes / 1048576.0);
    }
    const size_t c = (size_t)C, qd = (size_t)g->n_heads * g->head_dim;
    char *b = p;
    ws->base = p;
    ws->C = C;
    ws->cap = C;
    ws->xn = b;
    b += al256(c * g->ld_dim * 2);
    ws->f32 = (float *)b;
    b += al256(c * pf_f32_cols(g) * 4);
    ws->q = b;
    b += al256(c * qd * 2);
    ws->att = b;
    b += al256(c * g->ld_qd * 2);
    ws->h = b;
    b += al256(c * g->ld_hid * 2);
    ws->wdq = g->packed ? b : NULL;
    /* the 16-bit GEMM inputs are read up to their padded pitch */
    e = cudaMemset(ws->base, 0, bytes);
    if (e != cudaSuccess) {
        kv_gpu_prefill_ws_free(ws);
        return pf_cuda(e, "workspace clear");
    }
    return KV_OK;
}

void kv_gpu_prefill_ws_free(kv_pf_ws *ws)
{
    if (ws->base) cudaFree(ws->base);
    memset(ws, 0, sizeof *ws);
}

/*
 * The weights of one product: the 16-bit matrix when there is one, else the
 * group's packed parts dequantized into ws->wdq in the 16-bit layout (rows
 * of pitch ld, parts one after another, or interleaved when inter), which
 * the product then reads.  Stream order keeps wdq's uses apart.
 */
static kv_status pf_weights(const kv_pf_geom *g, const kv_pf_ws *ws, const void *w16, const kv_gpu_packed *parts,
                            int nparts, bool inter, int ld, cudaStream_t s, const void **out)
{
    *out = w16;
    if (w16) return KV_OK;
    if (!ws->wdq) return kv_fail(KV_E_INTERNAL, "packed weights without a dequantization workspace");
    const kv_dtype dt = g->wbf16 ? KV_DT_BF16 : KV_DT_F16;
    size_t row0 = 0;
    for (int i = 0; i < nparts; i++) {
        const kv_gpu_packed *p = &parts[i];
        void *dst = (uint16_t *)ws->wdq + (inter ? (size_t)i : row0) * ld;
        kv_status st = pf_cuda(eng_dequant_rows(p->data, p->type, p->rows, p->cols, p->pitch, dst, dt, ld,
                                                inter ? nparts : 1, s), "weight dequantization");
        if (st) return st;
        row0 += (size_t)p->rows;
    }
    *out = ws->wdq;
    return KV_OK;
}

kv_status kv_gpu_prefill_layer(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w,
                               const kv_pf_ws *ws, float *X, int p0, int n, void *kc, void *vc,
                               long long kv_stride, const float *inv_freq, void *stream,
                               kv_pf_events *ev)
{
    if (n < 1 || n > ws->C) return kv_fail(KV_E_USAGE, "prefill chunk of %d rows (workspace %d)", n, ws->C);
    cudaStream_t s = (cudaStream_t)stream;
    const pf_dtype wt = g->wbf16 ? PF_BF16 : PF_F16, kt = g->kvbf16 ? PF_BF16 : PF_F16;
    const kv_gemm_type gt = g->wbf16 ? KV_GEMM_BF16 : KV_GEMM_F16;
    const int hd = g->head_dim, qd = g->n_heads * hd, kvd = g->n_kv_heads * hd;
    const int fcols = (int)pf_f32_cols(g);
    const int ng = kv_gpu_prefill_gemm_rows(ws, n); /* the products' rows (ws->pad) */
    const void *W;
    kv_status st;
    st = pf_cuda(pf_rmsnorm_rows(X, g->ld_dim, w->attn_norm, g->dim, g->eps, n, ws->xn, wt,
                                 g->ld_dim, s), "attention RMSNorm");
    if (!st) st = pf_weights(g, ws, w->qkv, w->pqkv, 3, false, g->ld_dim, s, &W);
    if (!st)
        st = kv_cublas_gemm(cb, s, ng, qd + 2 * kvd, g->dim, W, g->ld_dim, ws->xn, g->ld_dim, gt,
                            ws->f32, fcols, KV_GEMM_F32, false);
    if (!st && w->bqkv)
        st = pf_cuda(eng_add_bias_rows(ws->f32, fcols, w->bqkv, qd + 2 * kvd, n, s), "q/k/v biases");
    if (!st)
        st = pf_cuda(pf_rope_rows_at(ws->f32, fcols, g->n_heads, g->n_kv_heads, hd, inv_freq, p0,
                                     g->rope_off, n, ws->q, qd, kc, vc, kv_stride, kt, s), "RoPE");
    if (!st) {
        pf_attn_args a = {ws->q, kc, vc, ws->att, qd, g->ld_qd, kv_stride, g->n_heads,
                          g->n_kv_heads, hd, p0, n, g->scale};
        if (!pf_attn_supported(&a))
            return kv_fail(KV_E_UNSUPPORTED, "prefill attention: head_dim %d with %d/%d heads is "
                           "not supported", hd, g->n_heads, g->n_kv_heads);
        bool timed = ev && ev->n < ev->cap;
        if (timed) st = pf_cuda(cudaEventRecord((cudaEvent_t)ev->start[ev->n], s), "event");
        if (!st) st = pf_cuda(pf_attn(&a, kt, wt, g->attn_variant, s), "prefill attention");
        if (!st && timed) {
            st = pf_cuda(cudaEventRecord((cudaEvent_t)ev->stop[ev->n], s), "event");
            ev->n++;
        }
    }
    if (!st) st = pf_weights(g, ws, w->o, &w->po, 1, false, g->ld_qd, s, &W);
    if (!st)
        st = kv_cublas_gemm(cb, s, ng, g->dim, qd, W, g->ld_qd, ws->att, g->ld_qd, gt, X,
                            g->ld_dim, KV_GEMM_F32, true);
    if (!st && w->bo) st = pf_cuda(eng_add_bias_rows(X, g->ld_dim, w->bo, g->dim, n, s), "output bias");
    if (!st)
        st = pf_cuda(pf_rmsnorm_rows(X, g->ld_dim, w->ffn_norm, g->dim, g->eps, n, ws->xn, wt,
                                     g->ld_dim, s), "FFN RMSNorm");
    if (!st) st = pf_weights(g, ws, w->gu, w->pgu, 2, true, g->ld_dim, s, &W);
    if (!st)
        st = kv_cublas_gemm(cb, s, ng, 2 * g->hidden, g->dim, W, g->ld_dim, ws->xn, g->ld_dim,
                            gt, ws->f32, fcols, KV_GEMM_F32, false);
    if (!st)
        st = pf_cuda(pf_swiglu_rows(ws->f32, fcols, g->hidden, n, ws->h, wt, g->ld_hid, s), "SwiGLU");
    if (!st) st = pf_weights(g, ws, w->down, &w->pdown, 1, false, g->ld_hid, s, &W);
    if (!st)
        st = kv_cublas_gemm(cb, s, ng, g->dim, g->hidden, W, g->ld_hid, ws->h, g->ld_hid, gt,
                            X, g->ld_dim, KV_GEMM_F32, true);
    return st;
}

kv_status kv_gpu_prefill_warm(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w, const kv_pf_ws *ws,
                              float *X, int rows, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const kv_gemm_type gt = g->wbf16 ? KV_GEMM_BF16 : KV_GEMM_F16;
    const int qd = g->n_heads * g->head_dim, kvd = g->n_kv_heads * g->head_dim, fcols = (int)pf_f32_cols(g);
    const int step = ws->pad > 1 ? ws->pad : 1, top = rows < ws->cap ? rows : ws->cap;
    if (top < 1) return KV_OK;
    const void *W[4];
    /* the row counts: each multiple of step below top, rounded as the
     * padded path rounds it, then top itself exact (a middle chunk's, when
     * the chunk is no multiple of the granule) */
    int nr = 0, *rc = malloc(((size_t)top / (size_t)step + 2) * sizeof *rc);
    if (!rc) return kv_fail(KV_E_NOMEM, "out of memory");
    for (int r = step; r < top; r += step) rc[nr++] = kv_gpu_prefill_gemm_rows(ws, r);
    if (kv_gpu_prefill_gemm_rows(ws, top) != top) rc[nr++] = kv_gpu_prefill_gemm_rows(ws, top);
    rc[nr++] = top;
    /* one dequantization per group would overwrite ws->wdq: packed layers
     * take each group in turn, over all row counts */
    for (int grp = 0; grp < 4; grp++) {
        kv_status st = grp == 0   ? pf_weights(g, ws, w->qkv, w->pqkv, 3, false, g->ld_dim, s, &W[0])
                       : grp == 1 ? pf_weights(g, ws, w->o, &w->po, 1, false, g->ld_qd, s, &W[1])
                       : grp == 2 ? pf_weights(g, ws, w->gu, w->pgu, 2, true, g->ld_dim, s, &W[2])
                                  : pf_weights(g, ws, w->down, &w->pdown, 1, false, g->ld_hid, s, &W[3]);
        for (int i = 0; i < nr && !st; i++) {
            const int n = rc[i];
            if (grp == 0)
                st = kv_cublas_gemm(cb, s, n, qd + 2 * kvd, g->dim, W[0], g->ld_dim, ws->xn, g->ld_dim, gt,
                                    ws->f32, fcols, KV_GEMM_F32, false);
            else if (grp == 1)
                st = kv_cublas_gemm(cb, s, n, g->dim, qd, W[1], g->ld_qd, ws->att, g->ld_qd, gt, X, g->ld_dim,
                                    KV_GEMM_F32, true);
            else if (grp == 2)
                st = kv_cublas_gemm(cb, s, n, 2 * g->hidden, g->dim, W[2], g->ld_dim, ws->xn, g->ld_dim, gt,
                                    ws->f32, fcols, KV_GEMM_F32, false);
            else
                st = kv_cublas_gemm(cb, s, n, g->dim, g->hidden, W[3], g->ld_hid, ws->h, g->ld_hid, gt, X,
                                    g->ld_dim, KV_GEMM_F32, true);
        }
        if (st) {
            free(rc);
            return st;
        }
    }
    free(rc);
    return KV_OK;
}

kv_status kv_gpu_prefill_model(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w, int L,
                               const void *embd, int ld_embd, const kv_gpu_packed *embd_packed,
                               const int *dtok, int T,
                               const kv_pf_ws *ws, float *X, void *const *kc, void *const *vc,
                               long long kv_stride, const float *inv_freq,
                               const kv_pf_hooks *hooks, void *stream, kv_pf_events *ev)
{
    return kv_gpu_prefill_model_from(cb, g, w, L, embd, ld_embd, embd_packed, dtok, 0, T, ws, X, kc, vc,
                                     kv_stride, inv_freq, hooks, stream, ev);
}

kv_status kv_gpu_prefill_model_from(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w, int L,
                                    const void *embd, int ld_embd, const kv_gpu_packed *embd_packed,
                                    const int *dtok, int p_start,
                                    int T, const kv_pf_ws *ws, float *X, void *const *kc,
                                    void *const *vc, long long kv_stride, const float *inv_freq,
                                    const kv_pf_hooks *hooks, void *stream, kv_pf_events *ev)
{
    if (T < 1 || L < 1 || p_start < 0 || p_start >= T)
        return kv_fail(KV_E_USAGE, "prefill of rows %d..%d through %d layers", p_start, T, L);
    if (kv_stride < (long long)T * g->head_dim)
        return kv_fail(KV_E_USAGE, "prefill cache of %lld values per head holds fewer than %d tokens",
                       kv_stride, T);
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = embd_packed && embd_packed->data
                       ? pf_cuda(eng_embed_rows_q(embd_packed->data, embd_packed->type, g->dim, embd_packed->pitch,
                                                  dtok, T - p_start, X, g->ld_dim, s), "embedding")
                       : pf_cuda(pf_embed_rows(embd, g->wbf16 ? PF_BF16 : PF_F16, ld_embd, g->dim, dtok,
                                               T - p_start, X, g->ld_dim, s), "embedding");
    const int qd = g->n_heads * g->head_dim;
    kv_pf_ws exact = *ws;
    exact.pad = 0;
    for (int l = 0; l < L && !st; l++) {
        if (p_start && hooks && hooks->begin) st = hooks->begin(hooks->ctx, l, stream);
        for (int p0 = p_start; p0 < T && !st; p0 += ws->C) {
            int n = T - p0 < ws->C ? T - p0 : ws->C;
            /* only the last chunk's products are padded: the rows past a
             * middle chunk are the next chunk's */
            st = kv_gpu_prefill_layer(cb, g, &w[l], p0 + n < T ? &exact : ws,
                                      X + (size_t)(p0 - p_start) * g->ld_dim, p0, n, kc[l], vc[l],
                                      kv_stride, inv_freq, stream, ev);
            if (!st && hooks && hooks->chunk) st = hooks->chunk(hooks->ctx, l, p0, n, ws->q, qd, stream);
        }
        if (!st && hooks && hooks->layer) st = hooks->layer(hooks->ctx, l, stream);
        if (st) kv_errcontext("prefill, layer %d", l);
    }
    return st;
}

#else

kv_status kv_gpu_prefill_model_from(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w, int L,
                                    const void *embd, int ld_embd, const kv_gpu_packed *embd_packed,
                                    const int *dtok, int p_start,
                                    int T, const kv_pf_ws *ws, float *X, void *const *kc,
                                    void *const *vc, long long kv_stride, const float *inv_freq,
                                    const kv_pf_hooks *hooks, void *stream, kv_pf_events *ev)
{
    return kv_fail(KV_E_UNAVAILABLE, "GPU prefill: CUDA not built in");
}

kv_status kv_gpu_prefill_model(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w, int L,
                               const void *embd, int ld_embd, const kv_gpu_packed *embd_packed,
                               const int *dtok, int T,
                               const kv_pf_ws *ws, float *X, void *const *kc, void *const *vc,
                               long long kv_stride, const float *inv_freq,
                               const kv_pf_hooks *hooks, void *stream, kv_pf_events *ev)
{
    return kv_fail(KV_E_UNAVAILABLE, "GPU prefill: CUDA not built in");
}

kv_status kv_gpu_prefill_ws_alloc(const kv_pf_geom *g, int C, kv_pf_ws *ws)
{
    memset(ws, 0, sizeof *ws);
    return kv_fail(KV_E_UNAVAILABLE, "GPU prefill: CUDA not built in");
}

void kv_gpu_prefill_ws_free(kv_pf_ws *ws) { memset(ws, 0, sizeof *ws); }

kv_status kv_gpu_prefill_warm(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w, const kv_pf_ws *ws,
                              float *X, int rows, void *stream)
{
    return kv_fail(KV_E_UNAVAILABLE, "GPU prefill: CUDA not built in");
}

kv_status kv_gpu_prefill_layer(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w,
                               const kv_pf_ws *ws, float *X, int p0, int n, void *kc, void *vc,
                               long long kv_stride, const float *inv_freq, void *stream,
                               kv_pf_events *ev)
{
    return kv_fail(KV_E_UNAVAILABLE, "GPU prefill: CUDA not built in");
}

#endif
