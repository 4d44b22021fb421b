/*
 * kv_gpu_prefill: one transformer layer over one prefill chunk on the GPU —
 * the matrix-matrix half of a chunked prefill, shared by the GPU engine and
 * the prefill benchmark.  For rows X (n, ld_dim) float32 of the residual
 * stream at positions [p0, p0 + n):
 *   xn  = rmsnorm(X, attn_norm)                     (pf_rmsnorm_rows, 16-bit)
 *   qkv = xn Wqkv^T (+ q/k/v biases)                (cuBLAS, float32)
 *   q, k, v = RoPE(qkv); k, v -> the layer's cache  (pf_rope_rows)
 *   att = causal attention of q over cache [0, p0+n) (pf_attn, tensor cores)
 *   X  += att Wo^T (+ its bias)                     (cuBLAS, beta = 1)
 *   xn  = rmsnorm(X, ffn_norm)
 *   gu  = xn Wgu^T  (gate and up rows interleaved)  (cuBLAS, float32)
 *   h   = silu(gate) * up                           (pf_swiglu_rows, 16-bit)
 *   X  += h Wdown^T                                 (cuBLAS, beta = 1)
 * The weights are laid out as lib/gpu/kv_gpu_engine.c keeps them: 16-bit
 * matrices, or packed ggml blocks (kv_gpu_packed), which each chunk
 * dequantizes to the 16-bit layout in the workspace just before its GEMM
 * (kernels/eng_dequant.cu), one matrix group at a time.  Every call only
 * enqueues work on the stream.  CUDA builds only (KV_HAVE_CUDA).
 *
 * Workspace for chunks of up to C rows (kv_gpu_prefill_ws_bytes):
 *   C * (2*ld_dim + 2*qd + 2*ld_qd + 2*ld_hid + 4*max(qd + 2*kvd, 2*hidden))
 * bytes (qd = n_heads*hd, kvd = kv_heads*hd): bounded by the chunk, never by
 * the prompt; with packed weights (g->packed) also one 16-bit copy of the
 * largest matrix group, 2*max((qd + 2*kvd)*ld_dim, dim*ld_qd,
 * 2*hidden*ld_dim, dim*ld_hid) bytes.
 */
#ifndef KV_GPU_PREFILL_H
#define KV_GPU_PREFILL_H

#include <stddef.h>

#include "common/kv_dtype.h"
#include "common/kv_status.h"
#include "gpu/kv_cublas.h"

/* A matrix kept on the device in ggml blocks as stored in the GGUF (Q8_0,
 * Q4_K, Q6_K: kernels/eng_ops.cuh, eng_packed_type); data NULL when the
 * matrix is 16-bit instead. */
typedef struct {
    void *data;              /* (rows, pitch bytes) */
    kv_dtype type;
    int rows, cols;
    size_t pitch;            /* bytes per row: kv_dtype_row_bytes(type, cols) */
} kv_gpu_packed;

/* One layer's device weights (borrowed).  A group (q/k/v, o, gate/up,
 * down) is either its 16-bit matrix or, when that pointer is NULL, its
 * packed parts. */
typedef struct {
    const void *qkv;         /* (qd + 2*kvd, ld_dim): wq, wk, wv rows */
    const void *o;           /* (dim, ld_qd) */
    const void *gu;          /* (2*hidden, ld_dim): gate and up rows interleaved */
    const void *down;        /* (dim, ld_hid) */
    const float *attn_norm;  /* (dim) */
    const float *ffn_norm;   /* (dim) */
    const float *bqkv;       /* (qd + 2*kvd) q/k/v biases, or NULL */
    const float *bo;         /* (dim) output projection bias, or NULL */
    kv_gpu_packed pqkv[3];   /* wq, wk, wv when qkv is NULL */
    kv_gpu_packed po;        /* when o is NULL */
    kv_gpu_packed pgu[2];    /* w_gate, w_up when gu is NULL */
    kv_gpu_packed pdown;     /* when down is NULL */
} kv_pf_layer;

typedef struct {
    int dim, hidden, n_heads, n_kv_heads, head_dim;
    int ld_dim, ld_qd, ld_hid; /* padded row pitches of the weights (multiples of 8) */
    float eps, scale;
    int wbf16;                 /* weights (and GEMM inputs) bf16, else fp16 */
    int kvbf16;                /* cache and queries bf16, else fp16 (the engine: fp16) */
    int attn_variant;          /* pf_attn tile variant, 0 = default */
    int packed;                /* some layer has packed matrices: the workspace holds ws->wdq */
    int rope_off;              /* RoPE position minus cache row (a continued subset; 0) */
} kv_pf_geom;

typedef struct {
    int C;          /* rows per chunk at most */
    int cap;        /* rows allocated (kv_gpu_prefill_ws_alloc's C; C may be set lower) */
    /* Products' row granule (0 or 1: none).  With pad > 1 the four
     * products of a chunk of n rows run over n rounded up to a multiple of
     * pad (at most cap): cuBLAS picks, and on its first call sets up, a
     * kernel per row count, a millisecond or more each (measured:
     * tools/device/gemm_first.cu), so rounding bounds the row counts a
     * process meets and kv_gpu_prefill_warm can set each up once.  The
     * rows past n of the workspace and of X are then scratch: the caller
     * gives X room for them (kv_gpu_prefill_model_from pads only its last
     * chunk, so X needs T - p_start + pad - 1 rows). */
    int pad;
    void *xn;       /* (C, ld_dim) 16-bit weight type */
    float *f32;     /* (C, max(qd + 2*kvd, 2*hidden)): qkv, then gate/up */
    void *q;        /* (C, qd) cache type */
    void *att;      /* (C, ld_qd) weight type */
    void *h;        /* (C, ld_hid) weight type */
    void *wdq;      /* packed weights: one matrix group dequantized (g->packed), else NULL */
    void *base;     /* the one allocation */
} kv_pf_ws;

size_t kv_gpu_prefill_ws_bytes(const kv_pf_geom *g, int C);
kv_status kv_gpu_prefill_ws_alloc(const kv_pf_geom *g, int C, kv_pf_ws *ws);
void kv_gpu_prefill_ws_free(kv_pf_ws *ws);

/* Measurement: event pairs (cudaEvent_t) recorded around each attention
 * launch, n used of cap (recording stops when full). */
typedef struct {
    void **start, **stop; /* (cap) */
    int cap, n;
} kv_pf_events;

/*
 * Run layer w over rows X (n, ld_dim) float32 at positions [p0, p0 + n),
 * n <= ws->C.  kc, vc: the layer's dense cache (kv_heads, kv_stride) of the
 * cache type, rows [0, p0) already filled; rows [p0, p0 + n) are written.
 * inv_freq (hd/2) device.  stream: a cudaStream_t.  ev: NULL, or events to
 * time the attention with.
 */
kv_status kv_gpu_prefill_layer(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w,
                               const kv_pf_ws *ws, float *X, int p0, int n, void *kc, void *vc,
                               long long kv_stride, const float *inv_freq, void *stream,
                               kv_pf_events *ev);

/*
 * Where a placement takes its prompt from (the GPU engine's hooks): chunk
 * runs after layer l's rows [p0, p0 + n) are in its cache, with the chunk's
 * rotated queries q (n, ldq) of the cache type (DSQ's last queries, the
 * profile's); layer runs after layer l's whole prompt is in its cache (so a
 * placement can pack it or copy it out before the cache is reused).  Either
 * may be NULL.  Both are enqueued work on stream; they must not keep q.
 */
typedef struct {
    kv_status (*chunk)(void *ctx, int layer, int p0, int n, const void *q, int ldq, void *stream);
    kv_status (*layer)(void *ctx, int layer, void *stream);
    void *ctx;
    /* Optional (kv_gpu_prefill_model_from): before layer l's chunks, fill
     * rows [0, p_start) of its cache (a continued cache's rows). */
    kv_status (*begin)(void *ctx, int layer, void *stream);
} kv_pf_hooks;

/*
 * The dense causal prefill of T tokens dtok (device ids) through L layers,
 * layer by layer in chunks of ws->C rows, as lib/engine/kv_engine.c orders
 * it: X (T, ld_dim) float32 = embedding rows of embd (vocab, ld_embd) of the
 * weight type (or of embd_packed when it is given with data), then each
 * layer over each chunk (kv_gpu_prefill_layer).  kc[l],
 * vc[l]: layer l's dense cache (kv_heads, kv_stride) rows [0, T) — distinct
 * per layer, or one scratch shared by all when hooks->layer moves each
 * layer's K/V into its placement.  On return X holds the final residual
 * stream (the caller applies the output norm and the classifier to the
 * rows it wants).
 *
 * Peak device memory of a prefill through this path: the weights, the
 * placements' KV, X (T * ld_dim * 4 bytes), the dense caches passed here
 * (2 * kv_heads * T * hd * 2 bytes each: a full layer's own cache, or one
 * shared scratch), and the chunk workspace (kv_gpu_prefill_ws_bytes(C)):
 * linear in T, never T^2.
 */
kv_status kv_gpu_prefill_model(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w, int L,
                               const void *embd, int ld_embd, const kv_gpu_packed *embd_packed,
                               const int *dtok, int T,
                               const kv_pf_ws *ws, float *X, void *const *kc, void *const *vc,
                               long long kv_stride, const float *inv_freq,
                               const kv_pf_hooks *hooks, void *stream, kv_pf_events *ev);

/* Same after p_start rows that hooks->begin puts in each layer's cache
 * first: dtok and X hold the T - p_start new rows only, at cache rows
 * [p_start, T) (RoPE at row + g->rope_off). */
kv_status kv_gpu_prefill_model_from(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w, int L,
                                    const void *embd, int ld_embd, const kv_gpu_packed *embd_packed,
                                    const int *dtok, int p_start,
                                    int T, const kv_pf_ws *ws, float *X, void *const *kc,
                                    void *const *vc, long long kv_stride, const float *inv_freq,
                                    const kv_pf_hooks *hooks, void *stream, kv_pf_events *ev);

/* A chunk of n rows' product row count under ws->pad (n when not padded). */
int kv_gpu_prefill_gemm_rows(const kv_pf_ws *ws, int n);

/*
 * Set up cuBLAS's product for every row count a chunked prefill can meet
 * with chunks of top = min(rows, ws->cap) rows: each multiple of ws->pad
 * below top as kv_gpu_prefill_gemm_rows rounds it (a last chunk), and top
 * itself, exact (the chunks before the last), by running layer w's four
 * products once at each (weights dequantized first when packed) on X
 * float32 scratch of kv_gpu_prefill_gemm_rows(ws, top) rows of ld_dim: the
 * first call at a row count is the slow one.  Writes only the workspace
 * and X.
 */
kv_status kv_gpu_prefill_warm(kv_cublas *cb, const kv_pf_geom *g, const kv_pf_layer *w, const kv_pf_ws *ws,
                              float *X, int rows, void *stream);

/* FLOPs of the causal attention of a T-token prompt (all chunks): 4*T^2*H*D/2. */
double kv_gpu_prefill_attn_flops(int T, int n_heads, int head_dim);

#endif
