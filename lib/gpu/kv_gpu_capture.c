/*
 * kv_gpu_capture: the prompt capture for a .kvc dump (kv_gpu_engine_keep,
 * kv_gpu_engine_prompt_kv, kv_gpu_engine_queries): each layer's dense
 * prompt K/V downloaded as its placement takes it, and the prompt's last
 * queries, post-RoPE, into a pinned buffer the engine keeps (their copies
 * need no wait per layer; the prefill synchronises at its end; before
 * session 7 each layer's queries went through malloc and a wait).  Moved
 * out of the core (kv_gpu_engine.c); CUDA builds only.
 */
#include "gpu/kv_gpu_int.h"

#ifdef KV_HAVE_CUDA

#include <stdlib.h>
#include <string.h>


void gl_cap_clear(kv_gpu_engine *e)
{
    for (int l = 0; l < e->L; l++) {
        if (e->cap.k) free(e->cap.k[l]);
        if (e->cap.v) free(e->cap.v[l]);
    }
    free(e->cap.k);
    free(e->cap.v);
    /* cap.q is in the kept pinned buffer e->pfb.qpin */
    e->cap.k = e->cap.v = NULL;
    e->cap.q = NULL;
    e->cap.T = e->cap.q_n = 0;
}

/* Host buffers for the capture of an n-token prompt, when one is asked for. */
kv_status gl_cap_begin(kv_gpu_engine *e, int n)
{
    gl_cap_clear(e);
    if (!e->cap.nq && !e->cap.kv) return KV_OK;
    const size_t per = (size_t)e->nkv * n * e->hd * 2;
    bool nomem = false;
    if (e->cap.kv) {
        e->cap.k = calloc((size_t)e->L, sizeof *e->cap.k);
        e->cap.v = calloc((size_t)e->L, sizeof *e->cap.v);
        nomem = !e->cap.k || !e->cap.v;
        for (int l = 0; l < e->L && !nomem; l++) {
            e->cap.k[l] = malloc(per);
            e->cap.v[l] = malloc(per);
            nomem = !e->cap.k[l] || !e->cap.v[l];
        }
    }
    e->cap.q_n = e->cap.nq < n ? e->cap.nq : n;
    if (nomem) {
        gl_cap_clear(e);
        return kv_fail(KV_E_NOMEM, "out of host memory for the captured prompt (%d tokens)", n);
    }
    const size_t qn = (size_t)e->L * e->cap.q_n * e->qd;
    if (qn && qn > e->pfb.qpin_n) { /* pinned, kept: the copies run without a wait per layer */
        gl_hfree(&e->pfb.qpin);
        e->pfb.qpin_n = 0;
        kv_status st = gl_halloc(&e->pfb.qpin, NULL, qn * 2, "captured queries");
        if (st) {
            gl_cap_clear(e);
            return st;
        }
        e->pfb.qpin_n = qn;
    }
    e->cap.q = qn ? e->pfb.qpin : NULL;
    e->cap.T = n;
    return KV_OK;
}

/* Layer l's dense prompt K/V (nkv, ld, hd), first T tokens, to the host. */
kv_status gl_cap_layer_kv(kv_gpu_engine *e, int l, const uint16_t *K, const uint16_t *V,
                              int ld, int T)
{
    if (!e->cap.k) return KV_OK;
    const double t0 = gl_now_ms();
    const size_t rb = (size_t)e->hd * 2;
    CK(cudaMemcpy2DAsync(e->cap.k[l], (size_t)T * rb, K, (size_t)ld * rb, (size_t)T * rb, e->nkv,
                         cudaMemcpyDeviceToHost, e->s_main));
    CK(cudaMemcpy2DAsync(e->cap.v[l], (size_t)T * rb, V, (size_t)ld * rb, (size_t)T * rb, e->nkv,
                         cudaMemcpyDeviceToHost, e->s_main));
    CK(cudaStreamSynchronize(e->s_main));
    e->ph.capture += gl_now_ms() - t0;
    return KV_OK;
}

/* Rows [pos, pos + rows) of layer l's rotated fp16 queries q (rows, ldq) on
 * the device, of an n-token prompt: those among the last q_n to the host. */
kv_status gl_cap_queries(kv_gpu_engine *e, int l, int pos, int rows, int n, const uint16_t *q,
                             size_t ldq, cudaStream_t s)
{
    const int first = n - e->cap.q_n; /* the first position kept */
    if (!e->cap.q || pos + rows <= first) return KV_OK;
    const int skip = pos < first ? first - pos : 0, j = pos + skip - first;
    const double t0 = gl_now_ms();
    /* into pinned memory, so asynchronous: the prefill synchronises the device at its end,
     * before anything reads cap.q */
    CK(cudaMemcpy2DAsync(e->cap.q + ((size_t)l * e->cap.q_n + j) * e->qd, (size_t)e->qd * 2,
                         q + (size_t)skip * ldq, ldq * 2, (size_t)e->qd * 2, (size_t)(rows - skip),
                         cudaMemcpyDeviceToHost, s));
    e->ph.capture += gl_now_ms() - t0;
    return KV_OK;
}

kv_status kv_gpu_engine_keep(kv_gpu_engine *e, int nq, bool prompt_kv)
{
    if (nq < 0 || nq > 1 << 16) return kv_fail(KV_E_USAGE, "query capture count %d out of range", nq);
    gl_cap_clear(e);
    e->cap.nq = nq;
    e->cap.kv = prompt_kv;
    return KV_OK;
}

const uint16_t *kv_gpu_engine_prompt_kv(const kv_gpu_engine *e, int layer, char which, int *T)
{
    *T = 0;
    if (layer < 0 || layer >= e->L || !e->cap.k || !e->cap.T) return NULL;
    *T = e->cap.T;
    return which == 'k' ? e->cap.k[layer] : which == 'v' ? e->cap.v[layer] : NULL;
}

int kv_gpu_engine_queries(const kv_gpu_engine *e, int layer, uint16_t *out)
{
    if (layer < 0 || layer >= e->L || !e->cap.q || !e->cap.T) return 0;
    const int n = e->cap.q_n, hd = e->hd;
    if (!out) return n;
    const uint16_t *q = e->cap.q + (size_t)layer * n * e->qd;
    for (int j = 0; j < n; j++)
        for (int h = 0; h < e->nqh; h++)
            memcpy(out + ((size_t)h * n + j) * hd, q + (size_t)j * e->qd + (size_t)h * hd,
                   (size_t)hd * 2);
    return n;
}

#endif /* KV_HAVE_CUDA */
