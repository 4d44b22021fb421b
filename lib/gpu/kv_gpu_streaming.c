/*
 * Placement `streaming` of the GPU engine (kv_gpu_int.h): StreamingLLM's
 * S sink rows and a ring of the W most recent rows on the GPU, exact fp16
 * attention over the tokens the CPU policy keeps (lib/policy/
 * kv_policy_streaming.c).  Order inside the ring does not matter to softmax
 * attention, so the ring is attended as it lies.
 */
#include "gpu/kv_gpu_int.h"

#ifdef KV_HAVE_CUDA

typedef struct {
    uint16_t *k, *v; /* (nkv, S+W, hd): rows [0, S) the sinks, [S, S+W) the ring */
} stream_state;

/* The ring row of token t. */
static int stream_row(const kv_policy_params *p, int t)
{
    return t < p->sink ? t : p->sink + (t - p->sink) % p->window;
}

static kv_status stream_configure(kv_gpu_engine *e, gl_layer *y)
{
    (void)e, (void)y; /* kv_policy_check (set_policies) checked sink and window */
    return KV_OK;
}

static kv_status stream_alloc(kv_gpu_engine *e, gl_layer *y)
{
    TRY(gl_state_new(y, sizeof(stream_state)));
    stream_state *r = y->st;
    size_t rows = (size_t)e->nkv * (size_t)(y->prm.sink + y->prm.window) * e->hd * 2;
    TRY(gl_dalloc(&r->k, rows, "streaming K"));
    TRY(gl_dalloc(&r->v, rows, "streaming V"));
    return KV_OK;
}

/* The tokens the CPU policy keeps: sinks, then the last W in the ring. */
static kv_status stream_ingest(kv_gpu_engine *e, gl_layer *y, const uint16_t *K,
                               const uint16_t *V, int ld, int T, uint16_t *tmp)
{
    (void)tmp;
    stream_state *r = y->st;
    const int S = y->prm.sink, W = y->prm.window, hd = e->hd;
    const size_t rb = (size_t)hd * 2, pitch = (size_t)(S + W) * rb;
    for (int t = 0; t < T; t++) {
        if (t >= S && t < T - W) continue;
        int slot = stream_row(&y->prm, t);
        CK(cudaMemcpy2DAsync(r->k + (size_t)slot * hd, pitch, K + (size_t)t * hd,
                             (size_t)ld * rb, rb, e->nkv, cudaMemcpyDeviceToDevice, e->s_main));
        CK(cudaMemcpy2DAsync(r->v + (size_t)slot * hd, pitch, V + (size_t)t * hd,
                             (size_t)ld * rb, rb, e->nkv, cudaMemcpyDeviceToDevice, e->s_main));
    }
    return KV_OK;
}

static kv_status stream_slot(kv_gpu_engine *e, gl_layer *y, int pos, gl_row *row)
{
    stream_state *r = y->st;
    int slot = stream_row(&y->prm, pos);
    row->k = r->k + (size_t)slot * e->hd;
    row->v = r->v + (size_t)slot * e->hd;
    row->hs = (size_t)(y->prm.sink + y->prm.window) * e->hd;
    return KV_OK;
}

static kv_status stream_attend(kv_gpu_engine *e, gl_layer *y, int pos, const float *q,
                               const gl_row *row)
{
    (void)q;
    (void)row;
    stream_state *r = y->st;
    int S = y->prm.sink, W = y->prm.window, n = pos + 1 < S + W ? pos + 1 : S + W;
    return gl_attend_dense(e, r->k, r->v, (size_t)(S + W) * e->hd, n, e->s_main);
}

static void stream_bytes(const kv_gpu_engine *e, const gl_layer *y, kv_bytes *b)
{
    uint64_t S = (uint64_t)y->prm.sink, W = (uint64_t)y->prm.window, T = (uint64_t)y->T;
    uint64_t held = T < S ? T : S + (T - S < W ? T - S : W);
    b->resident = 2 * (uint64_t)e->nkv * held * (uint64_t)e->hd * 2;
}

static void stream_release(gl_layer *y)
{
    stream_state *r = y->st;
    gl_dfree(&r->k);
    gl_dfree(&r->v);
}

const gl_placement gl_streaming = {
    .name = "streaming",
    .configure = stream_configure,
    .alloc = stream_alloc,
    .ingest = stream_ingest,
    .slot = stream_slot,
    .attend = stream_attend,
    .bytes = stream_bytes,
    .release = stream_release,
};

#endif /* KV_HAVE_CUDA */
