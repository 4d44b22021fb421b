/*
 * kv_gpu_int: what the files of the GPU engine share and nothing else sees
 * (CUDA builds only).  The engine is a core (kv_gpu_engine.c: construction,
 * streams, the layer loop, prefill/step/generate/synthesize, accounting)
 * and one file per placement of a layer's K/V, each behind the table
 * gl_placement, which mirrors kv_policy_ops (lib/policy/kv_policy.h):
 *
 *   kv_gpu_full.c       full (fp16 on the GPU) and offload (pinned host memory,
 *                       copied in per step on the copy stream)
 *   kv_gpu_quant.c      quant: KIVI-packed on the GPU with attention from the
 *                       packed data, or (outside that kernel's geometry) packed
 *                       on the host and expanded to fp16 per step
 *   kv_gpu_dsq.c        dsq: windows packed on the host, expanded per step
 *   kv_gpu_sparse.c     sparse: the prompt in pinned host memory, selection and
 *                       gather one layer ahead on the selection streams
 *   kv_gpu_streaming.c  streaming: sink + recent ring on the GPU
 *   kv_gpu_graph.c      (not a placement) the decode step captured into a CUDA
 *                       graph, updated in place per step and launched once
 *   kv_gpu_weights.c    the weights (not a placement): their upload, 16-bit or
 *                       packed, and the projections that read them
 *   kv_gpu_capture.c    the prompt capture for .kvc dumps (not a placement)
 *   kv_gpu_reuse.c      (not a placement) the prefill's kept buffers, layers
 *                       packed in a continued file taken over with the file's
 *                       encoding, the prefill's host-clock phases
 *
 * The core knows no placement: it asks gl_placement_for() for the table of a
 * policy kind, and a placement's state lives in its own file's struct
 * (gl_layer.st).  What several layers of one placement share (scratch that
 * is grown, never per layer) sits in the engine struct, grouped by user.
 */
#ifndef KV_GPU_INT_H
#define KV_GPU_INT_H

#ifdef KV_HAVE_CUDA

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "eng_ops.cuh"
#include "gpu/kv_gpu_cuda.h"
#include "gpu/kv_gpu_engine.h"
#include "gpu/kv_gpu_prefill.h"
#include "kv_kernels.h"

// --- errors and memory ----------------------------------------------------------

/* A failed CUDA call returns its recorded status (kv_gpu_cuda.h). */
#define CK(call) KV_CUDA_CK(call)
/* GL_LCK(call): keep the first CUDA error in the caller's kv_status st and
 * go on (a load that must release what it staged, whatever failed) */
#define GL_LCK(call)                                                                       \
    do {                                                                                   \
        cudaError_t ce_ = (call);                                                          \
        if (ce_ != cudaSuccess && !st) st = kv_cuda_fail(ce_, #call, __FILE__, __LINE__);  \
    } while (0)

#define TRY(expr)                                                                 \
    do {                                                                          \
        kv_status try_st_ = (expr);                                               \
        if (try_st_ != KV_OK) return try_st_;                                     \
    } while (0)

/* Device memory (*pp = NULL for 0 bytes); KV_E_NOMEM names what and how much. */
kv_status gl_dalloc(void *pp, size_t bytes, const char *what);
void gl_dfree(void *pp);
/* A pair of fp16 device buffers (K and V) of *have elements each: when need
 * is more, both are freed and n elements allocated in their place (contents
 * lost); *have is 0 until both are there. */
kv_status gl_grow_kv(void *pk, void *pv, size_t *have, size_t need, size_t n, const char *what_k,
                     const char *what_v);
/* Pinned, mapped host memory: the copy engines read it at full PCIe speed
 * and kernels read it directly through *dev (may be NULL). */
kv_status gl_halloc(void *pp, const void **dev, size_t bytes, const char *what);
void gl_hfree(void *pp);
/* Grow an int device array to n entries (synchronises first). */
kv_status gl_grow_i32(int **p, size_t *cap, size_t n, const char *what);
/* Copy n bytes host to device on the main stream and wait (staging is reused). */
kv_status gl_h2d_sync(kv_gpu_engine *e, void *dst, const void *src, size_t n);

static inline int gl_pad8(int n) { return (n + 7) & ~7; }

// --- layers and placements ------------------------------------------------------------

typedef struct gl_layer gl_layer;

/* Where this step's new K/V row of every KV head goes: head h's row at
 * k + h*hs and v + h*hs (fp16); the RoPE kernel writes it. */
typedef struct {
    uint16_t *k, *v;
    size_t hs; /* elements between KV heads */
} gl_row;

/*
 * One placement of a layer's K/V on the GPU engine.  Calls come in this
 * order: configure (at construction and every reset), alloc, ingest (after
 * a prefill or a synthesized context), then per decode step step_begin,
 * select, slot and attend; bytes, timing at any time; release before the
 * next configure and at the end.  Optional entries may be NULL.
 */
typedef struct gl_placement {
    const char *name;
    /* Check the layer's parameters against this engine and settle the
     * variant (y->pl may be replaced by a sibling: full -> offload, quant ->
     * its host-packed form).  No allocation. */
    kv_status (*configure)(kv_gpu_engine *e, gl_layer *y);
    /* Allocate y->st and what does not depend on the prompt. */
    kv_status (*alloc)(kv_gpu_engine *e, gl_layer *y);
    /* Take the first T tokens of dense fp16 K and V (nkv, ld, hd) on the
     * device; tmp: device scratch of max(2*nkv*T*hd, nkv*hd*pad8(T)) fp16
     * values.  Work is on the main stream; the core synchronises after. */
    kv_status (*ingest)(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V,
                        int ld, int T, uint16_t *tmp);
    /* Optional: before the first layer of a decode step (offload: the copy
     * stream's first copies). */
    kv_status (*step_begin)(kv_gpu_engine *e, gl_layer *y);
    /* Optional: token selection with query q (n_heads, hd) float on stream
     * s and the gather on sg.  A placement with it takes a query predicted
     * one layer ahead (when prm.predict) on the selection streams. */
    kv_status (*select)(kv_gpu_engine *e, gl_layer *y, const float *q, cudaStream_t s,
                        cudaStream_t sg);
    /* Where the new token's K/V row goes at position pos (decode). */
    kv_status (*slot)(kv_gpu_engine *e, gl_layer *y, int pos, gl_row *r);
    /* After the RoPE kernel stored the row at r: attention of this step's
     * query (e->q16 fp16, q float (n_heads, hd)) over every token held, the
     * new one included, into e->att, on the main stream. */
    kv_status (*attend)(kv_gpu_engine *e, gl_layer *y, int pos, const float *q, const gl_row *r);
    /* Optional, chunked prefill only: rows [p0, p0 + n) of this layer's
     * T-token prompt are now in the dense fp16 cache K, V (nkv, ld, hd) on
     * the main stream (ingest follows once the layer is done).  A placement
     * may start moving them out here (sparse: the copy to pinned host memory
     * on the copy stream, overlapping the next chunk's compute); whatever it
     * still reads from K/V must be ordered before the main stream goes on
     * (events), since the next layer overwrites the dense cache. */
    kv_status (*chunk)(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V,
                       int ld, int p0, int n, int T);
    /* Optional: the prefill's query at position pos of an n-token prompt,
     * given before the layer's ingest (dsq takes its importance from the
     * last ones, as kv_policy_ops.observe). */
    kv_status (*observe)(kv_gpu_engine *e, gl_layer *y, const float *q, int pos, int n);
    /* KV bytes resident on the GPU and in host memory (the core fills the
     * fetched counts and attends). */
    void (*bytes)(const kv_gpu_engine *e, const gl_layer *y, kv_bytes *b);
    /* Optional: the side-stream times of the last step (opts.profile). */
    void (*timing)(const kv_gpu_engine *e, const gl_layer *y, kv_gpu_timing *t);
    /* Optional: opts.sel_serial / topk_wide / sel_cache / profile changed
     * between steps (kv_gpu_engine_set_step_opts; the device is idle). */
    kv_status (*step_opts)(kv_gpu_engine *e, gl_layer *y);
    /* Free y->st and everything it holds (the device is idle). */
    void (*release)(gl_layer *y);
    /* Optional (no side effects): why the decode step at position pos
     * cannot be captured into a CUDA graph for this layer (it allocates,
     * frees or waits for the host: a packed group, a host-packed window),
     * or NULL when it can; such a step runs plainly (kv_gpu_graph.c). */
    const char *(*graph_block)(const kv_gpu_engine *e, const gl_layer *y, int pos);
    /* Optional: hold layer y->l of y->load_from's file as it is packed there
     * (its P rows' codes, scales and fp16 rows uploaded, not re-quantized),
     * then append rows [P, T) of the dense fp16 cache K/V (nkv, ld, hd) as
     * new tokens, as decode steps would (kv_gpu_engine_prefill_from; tmp as
     * for ingest).  The layer's policy is the file's encoding
     * (kv_prefix_layer_packed).  Instead of ingest. */
    kv_status (*load)(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V, int ld,
                      int T, uint16_t *tmp);
    /* Optional: forget the layer's tokens but keep its allocations (a reset
     * with the same policies; the device is idle).  Without it a reset
     * releases and allocates the layer again. */
    void (*clear)(kv_gpu_engine *e, gl_layer *y);
} gl_placement;

struct gl_layer {
    const gl_placement *pl;
    kv_policy_params prm;
    int l;                 /* layer index */
    int T;                 /* tokens held */
    uint64_t fetched_last, fetched_total, attends; /* host bytes read per step / in total */
    void *st;              /* the placement's own state (its file's struct) */
    const kv_prefix *load_from; /* during kv_gpu_engine_prefill_from: the file this layer is
                                   loaded packed from (gl_placement.load), else NULL */
};

/* The placement of a policy kind, or NULL when the engine has none. */
const gl_placement *gl_placement_for(kv_policy_kind k);

extern const gl_placement gl_full, gl_offload;      /* kv_gpu_full.c */
extern const gl_placement gl_quant, gl_quant_host;  /* kv_gpu_quant.c */
extern const gl_placement gl_dsq;                   /* kv_gpu_dsq.c */
extern const gl_placement gl_sparse;                /* kv_gpu_sparse.c */
extern const gl_placement gl_streaming;             /* kv_gpu_streaming.c */

/* calloc y->st of n bytes (KV_E_NOMEM otherwise). */
kv_status gl_state_new(gl_layer *y, size_t n);

// --- the engine -----------------------------------------------------------------------

/*
 * One layer's weights.  Each group (q/k/v, o, gate/up, down) is either a
 * 16-bit matrix in the fused layout below or, when every matrix of the
 * group has a type the engine keeps packed (eng_packed_type: Q8_0, Q4_K,
 * Q6_K) and opts.wtype is auto, its packed parts as stored in the file
 * (the 16-bit pointer is then NULL).
 */
typedef struct {
    void *qkv;        /* (n_heads*hd + 2*n_kv*hd, ld_dim) */
    void *o;          /* (dim, ld_qd) */
    void *gu;         /* (2*hidden, ld_dim): gate and up rows interleaved */
    void *down;       /* (dim, ld_hid) */
    kv_gpu_packed pqkv[3]; /* wq, wk, wv when qkv is NULL */
    kv_gpu_packed po;      /* when o is NULL */
    kv_gpu_packed pgu[2];  /* w_gate, w_up when gu is NULL */
    kv_gpu_packed pdown;   /* when down is NULL */
    float *bqkv;      /* (n_heads*hd + 2*n_kv*hd) q/k/v biases (qwen2; absent ones 0), or NULL */
    float *bo;        /* (dim) output projection bias, or NULL */
    float *attn_norm; /* (dim) */
    float *ffn_norm;  /* (dim) */
    bool owner;       /* false when the matrices are an earlier layer's (synthetic models) */
} gw_layer;

/* The captured decode step (kv_gpu_graph.c). */
typedef struct {
    cudaGraphExec_t exec[2]; /* alternate steps: one is updated while the other may run */
    uint64_t sig[2];         /* each one's shape: node count and types (graph_sig) */
    uint64_t no_update_sig;  /* a shape cudaGraphExecUpdate refused once: instantiate it directly */
    int cur;                 /* the one the next capture goes to */
    bool capturing;          /* a capture is under way on s_main (gl_ensure_ws grows safely) */
    cudaEvent_t ev_fork, ev_fan, ev_join[3]; /* ordering of s_side, s_gath, s_copy with s_main */
    uint64_t steps, captured, updated, instantiated, refused;
    int refused_result;      /* cudaGraphExecUpdateResult of the last refused update */
    double host_us;          /* summed over captured steps */
    char plain_why[160];     /* the last step run plainly: why */
    void *retired[16];       /* workspaces replaced during a capture (freed when idle) */
    int n_retired;
} gl_graph;

struct kv_gpu_engine {
    const kv_model *m;
    kv_gpu_engine_opts o;
    char devname[384];
    int L, ctx, pos;
    int rope_off;        /* RoPE position minus row past a continued cache subset (0) */
    int dim, hidden, nqh, nkv, hd, vocab, qd, kvd;
    int ld_dim, ld_qd, ld_hid;
    float eps, scale;
    int cc_major;        /* compute capability of the device */
    int q_f32;           /* fp16 attention takes the float32 query (gl_attend_dense) */
    kv_dtype wt;
    gw_layer *w;         /* (L) */
    void *embd, *outw;   /* (vocab, ld_dim), or NULL when packed: */
    kv_gpu_packed pembd, pout; /* packed embedding and classifier (data NULL: 16-bit) */
    float *out_norm;     /* (dim) */
    float *inv_freq;     /* (hd/2) device */
    uint64_t wbytes, wread;
    cudaStream_t s_main, s_side, s_gath, s_copy;
    /* activations (float32, padded to ld_* with zeros) */
    float *x;            /* (ld_dim) residual stream */
    float *xp[3];        /* (ld_dim) normalized input of the predicted layer l, in xp[l % 3] */
    float *qkv;          /* (n_heads*hd + 2*n_kv*hd) projections, q then k then v */
    float *att;          /* (ld_qd) attention output */
    float *hb;           /* (ld_hid) SwiGLU output */
    float *xn;           /* (ld_dim) normalized input of packed projections */
    float *gu32;         /* (2*hidden) packed gate and up outputs */
    float *logits;       /* (vocab) */
    float *qpred;        /* (n_heads*hd) predicted query (selection stream) */
    uint16_t *q16;       /* (n_heads*hd) fp16 query for kernels/ */
    int *d_tok;          /* (tok_cap) token ids */
    int tok_cap;
    int *h_tok;          /* pinned (1) */
    /* attention workspace (kernels/ partials), grown on demand */
    void *ws;
    size_t ws_bytes;
    /* scratch shared by the layers of one placement, grown, never shrunk */
    struct {
        uint16_t *k, *v; /* (nkv, rc_max, hd) dense residual for kernels/ */
        size_t n;
    } dres;              /* quant (packed) */
    struct {
        uint16_t *k, *v; /* (nkv, ctx, hd) fp16 expansion, per step */
        size_t n;
        float *imp_sc;   /* (nkv, ctx) attention probabilities (dsq) */
    } qx;                /* quant (host-packed), dsq */
    struct {
        float *score;    /* (n_heads, candidates) token scores per query head */
        float *comb;     /* (nkv, candidates) scores combined over each KV group */
        float *sm_tmp;   /* eng_softmax_tmp(n_heads) floats of softmax scratch */
        float *qscale;   /* (n_heads) channel-selection scale per query head */
        int *chans, *sel[3]; /* sel: layer l's in sel[l % 3], so that a gather overlaps the next
                                two layers' selections (opts.sel_ahead 2) */
        size_t score_n, sel_n[3], chans_n;
        int side_last;   /* this step: the last layer selected on the selection stream, or -1 */
        void *tw_ws;     /* eng_topk_wide_ws(nkv) bytes (opts.topk_wide), or NULL */
        void *rs_ws;     /* eng_resident_select_ws bytes (select=resident's chain), zeroed */
        size_t rs_ws_n;
    } sel;               /* sparse (layers take turns on the selection streams) */
    struct {
        uint16_t *stage_k[2], *stage_v[2]; /* (nkv, ctx, hd) double-buffered staging */
        int *list, n;    /* (L) the offloaded layers in order, n used */
        int next;        /* this step: offloaded layers attended so far */
        cudaEvent_t ev_done[2], ev_rope;
        cudaEvent_t *ev_copied; /* (L) */
    } off;               /* offload */
    struct {
        uint16_t *stage; /* (C, nkv, 2, hd) rows, then (nkv, hd, C) channel-major keys of one chunk */
        size_t n;        /* fp16 values allocated; freed at the end of each chunked prefill */
        cudaEvent_t ev_chunk; /* main: a chunk's rows are in the dense cache */
        cudaEvent_t ev_read;  /* copy stream: the last chunk's rows are staged (the dense cache
                                 may be overwritten) */
    } pfc;               /* sparse, during a chunked prefill: the copy of each chunk to host */
    struct {
        int nq;            /* queries to keep per layer (0: none) */
        bool kv;           /* keep the prompt's dense K/V */
        int T;             /* tokens of the captured prompt (0: nothing captured) */
        int q_n;           /* queries captured per layer: min(nq, T) */
        uint16_t **k, **v; /* (L) each (nkv, T, hd) fp16 host, as the layer's placement took it */
        uint16_t *q;       /* (L, q_n, qd) fp16 host: the prompt's last queries, post-RoPE */
    } cap;               /* kv_gpu_engine_keep: the prompt for a .kvc dump */
    cudaEvent_t *ev_x, *ev_sel;           /* (L) predicted layer's input ready, selection done */
    cudaEvent_t *ev_topk;                 /* (L) selection done, gather may start */
    cudaEvent_t *ev_p0, *ev_p1, *ev_g0, *ev_g1; /* (L) profile: side stream start/end, host reads */
    cudaEvent_t *ev_t1;                   /* (L) profile: top-K done (selection stream) */
    cudaEvent_t *ev_w0, *ev_w1;           /* (L) profile: main stream before / after its wait */
    gl_layer *lay;       /* (L) */
    const kv_gpu_engine *wsrc; /* the engine whose weights this one reads (kv_gpu_engine_new_sharing), or NULL */
    bool w_shared;       /* the weights are wsrc's: gl_weights_free leaves them alone */
    struct kv_cublas *cb; /* cuBLAS for the chunked prefill, opened at its first use */
    bool cb_failed;      /* cuBLAS could not be loaded: prefill one token at a time */
    double pf_attn_ms;   /* the last chunked prefill's attention time (opts.time_prefill) */
    gl_graph gr;         /* the captured decode step */
    /* the chunked prefill's buffers, kept between prefills when they are
     * small (KV_GPU_PF_KEEP_BYTES in all, 64 MiB: niah4k's 3.9k-token prefill needs
     * about 46; kv_gpu_reuse.c): a request's
     * cudaMalloc/cudaFree pairs cost more than a short prefill computes */
    struct {
        float *X;          /* (rows, ld_dim) residual stream */
        uint16_t *K, *V;   /* (nkv, rows, hd) each, dense layer cache */
        uint16_t *tmp;     /* ingest scratch, tmp_n fp16 values */
        int *dt;           /* (dt_n) token ids */
        size_t X_n, kv_n, tmp_n, dt_n; /* elements allocated */
        kv_pf_ws ws;       /* the chunk workspace (ws.C rows), or base NULL */
        int ws_packed;     /* the geometry it was sized for had packed weights */
        size_t ws_bytes;   /* its size */
        uint16_t *qpin;    /* pinned host memory the captured queries land in (cap.q points
                              into it): their copies then need no wait per layer */
        size_t qpin_n;     /* fp16 values allocated */
        /* a continued prefill's cached rows uploaded a layer ahead of the
         * compute (gl_pf_overlap_ok): a second dense cache, the layers
         * alternating between the two, and the upload stream's events */
        uint16_t *K2, *V2; /* (nkv, rows, hd) each */
        size_t kv2_n;      /* elements allocated, each */
        cudaStream_t s_up; /* the uploads (created at the first overlapped prefill) */
        cudaEvent_t ev_up[2], ev_free[2]; /* pair b: its rows are in; its last reader is done */
        cudaEvent_t ev_span[2];           /* timed: the first upload's start, the last's end
                                             (kv_gpu_prefill_phases.upload) */
    } pfb;
    kv_gpu_prefill_phases ph; /* the last prefill's host-clock phases */
    size_t pf_keep;      /* pfb's buffers stay allocated while at most this many bytes
                            (KV_GPU_PF_KEEP_BYTES, or 1/64 of the device's memory when more) */
};

// --- the prefill's kept buffers and packed continuation (kv_gpu_reuse.c) -----------

/* Prefill buffers of at most this many bytes in all, or 1/64 of the device's
 * memory when that is more (e->pf_keep), stay allocated between prefills:
 * the 8B's chunk workspace for a 460-row continuation is 85 MiB (528
 * rows allocated), and its cudaMalloc, clear and cudaFree were most of
 * such a request's setup phase; an H200's 1/64 is 2.2 GiB, a 4096-row
 * workspace 656 MiB.  A batch's sequences (wsrc) keep the 64 MiB. */
#define KV_GPU_PF_KEEP_BYTES ((size_t)64 << 20)

/* The chunked prefill's buffers for rows (all rows, cached ones included)
 * of which nn are new, C rows a chunk, geometry g: grown when too small;
 * *ws points at the engine's workspace. */
kv_status gl_pf_buffers(kv_gpu_engine *e, int rows, int nn, int C, const kv_pf_geom *g, size_t tmp_n);
/* After a prefill (the device is idle): free them when they are larger than
 * KV_GPU_PF_KEEP_BYTES (or always, at engine free). */
void gl_pf_buffers_trim(kv_gpu_engine *e, bool all);
/* Rows [0, P) of layer l's dense cache (nkv, ld, hd) from the continued
 * cache pre, on stream s: fp16 rows on this GPU or in host memory copied
 * straight, anything else converted through the pinned staging stage
 * (2, nkv, P, hd), which is reused layer after layer (s is waited for). */
kv_status gl_put_prefix_rows(kv_gpu_engine *e, const kv_prefix *pre, int l, uint16_t *K, uint16_t *V, int ld,
                             uint16_t *stage, cudaStream_t s);
/* Can pre's rows be uploaded a layer ahead of the compute?  fp16 rows that
 * are copied straight (no staging), and every layer a full placement not
 * loading packed planes: its ingest is a copy on the main stream, so a
 * dense cache's last reader is ordered before the next layer's start. */
bool gl_pf_overlap_ok(const kv_gpu_engine *e, const kv_prefix *pre);
/* The second dense cache for rows rows, the upload stream and its events;
 * *ready false when any of them cannot be had (the serial path is then
 * used: it needs none of them), an error only for a failed synchronise. */
kv_status gl_pf_overlap_begin(kv_gpu_engine *e, int rows, bool *ready);
/* At layer l's start on the compute stream s (dense caches K[l & 1],
 * V[l & 1], leading dimension ld): layer 0 issues its own upload; the
 * other pair's last reader (layer l - 1) is marked done; then s waits for
 * layer l's rows. */
kv_status gl_pf_overlap_layer(kv_gpu_engine *e, const kv_prefix *pre, int l, uint16_t *const K[2],
                              uint16_t *const V[2], int ld, cudaStream_t s);
/* At layer l's end, its work issued: layer l + 1's upload into the other
 * pair, once layer l - 1 is done with it.  Issued here rather than at the
 * layer's start so that a host waiting for rows still being read
 * (kv_prefix.wait) waits with layer l already queued on the GPU. */
kv_status gl_pf_overlap_next(kv_gpu_engine *e, const kv_prefix *pre, int l, uint16_t *const K[2],
                             uint16_t *const V[2], int ld);
/* After the prefill's synchronisation: the uploads' span and bytes into
 * e->ph (upload, upload_bytes; 0 without rows_ahead). */
void gl_pf_overlap_span(kv_gpu_engine *e, const kv_prefix *pre);
/* Before a continued prefill: every layer packed in pre's file gets the
 * file's encoding as its policy (placement configured and allocated again)
 * and load_from = pre; the others are left alone.  *any: some layer was. */
kv_status gl_take_packed(kv_gpu_engine *e, const kv_prefix *pre, bool *any);
/* A soft reset: every layer's placement can clear (gl_placement.clear). */
bool gl_can_clear(const kv_gpu_engine *e);
/* Host clock in ms (phases). */
double gl_now_ms(void);

// --- the prompt capture for dumps (kv_gpu_capture.c) -------------------------------

/* Forget the captured prompt (the settings cap.nq, cap.kv stay). */
void gl_cap_clear(kv_gpu_engine *e);
/* Host buffers for the capture of an n-token prompt, when one is asked for. */
kv_status gl_cap_begin(kv_gpu_engine *e, int n);
/* Layer l's dense prompt K/V (nkv, ld, hd), first T tokens, to the host (waits). */
kv_status gl_cap_layer_kv(kv_gpu_engine *e, int l, const uint16_t *K, const uint16_t *V, int ld, int T);
/* Rows [pos, pos + rows) of layer l's rotated fp16 queries q (rows, ldq) on
 * the device, of an n-token prompt: those among the last q_n to the host,
 * asynchronously on stream s (the prefill's final synchronisation waits). */
kv_status gl_cap_queries(kv_gpu_engine *e, int l, int pos, int rows, int n, const uint16_t *q, size_t ldq,
                         cudaStream_t s);

// --- helpers of the core for the placements -----------------------------------------

/* Attention of e->q16 over rows [0, n) of fp16 K/V (nkv, head_stride) into e->att. */
kv_status gl_attend_dense(kv_gpu_engine *e, const uint16_t *K, const uint16_t *V,
                          size_t head_stride, int n, cudaStream_t s);
/* The attention workspace grown to bytes. */
kv_status gl_ensure_ws(kv_gpu_engine *e, size_t bytes);
/* Does layer l take a query predicted one layer ahead? */
bool gl_wants_pred(const kv_gpu_engine *e, int l);
/* The fp16 scratch e->qx a packed layer is expanded into each step
 * (kv_gpu_quant.c; dsq uses it too). */
kv_status gl_ensure_qx(kv_gpu_engine *e);
/* Layer l's query predicted from the residual stream before layer l - 1
 * and its token selection, on the selection streams (a decode step of a
 * layer with gl_wants_pred; the batched step calls it per sequence). */
kv_status gl_predict_ahead(kv_gpu_engine *e, int l);
/* At the start of layer l: issue the predicted layers' selections due now
 * (opts.sel_ahead layers ahead; at layer 0 the nearer ones too). */
kv_status gl_predict_from(kv_gpu_engine *e, int l);
/* Elapsed ms between two recorded events (0 when unavailable). */
float gl_elapsed(cudaEvent_t a, cudaEvent_t b);

// --- the captured decode step (kv_gpu_graph.c) ---------------------------------------

/* One decode token through every layer on the main stream at e->pos
 * (kv_gpu_engine.c's layer loop, no prefill cache). */
kv_status gl_decode_forward(kv_gpu_engine *e, const int *dtok, bool want_logits);
/* Events (engine construction) and their release (engine free). */
kv_status gl_graph_init(kv_gpu_engine *e);
void gl_graph_free(kv_gpu_engine *e);
/* Forget the executable graphs and counts (reset; the device is idle). */
void gl_graph_reset(kv_gpu_engine *e);
/* The device is idle: free the workspaces retired during captures. */
void gl_graph_idle(kv_gpu_engine *e);
/* One decode step from device id *dtok (gl_decode_forward), then, when
 * next is not NULL, the argmax of its logits into the device int *next:
 * captured into a CUDA graph and launched, or plainly where opts.graph is
 * off or a layer's placement blocks it (gl_placement.graph_block). */
kv_status gl_graph_step(kv_gpu_engine *e, const int *dtok, bool want_logits, int *next);
/* cudaMemcpy2DAsync, or inside a capture one 1D copy per row: a captured
 * 2D copy cannot change its shape when the executable graph is updated in
 * place (for device-to-device copies in a step, eng_copy_2d is one node). */
kv_status gl_memcpy_2d(kv_gpu_engine *e, void *dst, size_t dpitch, const void *src, size_t spitch,
                       size_t width, size_t height, enum cudaMemcpyKind kind, cudaStream_t s);
/* During a capture: replace the attention workspace by one of bytes
 * without synchronising (the old one is retired until the device is idle). */
kv_status gl_graph_grow_ws(kv_gpu_engine *e, size_t bytes);

// --- weights (kv_gpu_weights.c) ------------------------------------------------------

kv_status gl_weights_load(kv_gpu_engine *e);
/* e reads src's weights (the same device pointers; nothing uploaded). */
kv_status gl_weights_share(kv_gpu_engine *e, const kv_gpu_engine *src);
void gl_weights_free(kv_gpu_engine *e);
/* Does any matrix live packed on the device? */
bool gl_weights_packed(const kv_gpu_engine *e);

/* The projections of one token on stream s, whatever form the weights take
 * (16-bit fused GEMVs, or packed GEMVs after a separate RMSNorm), biases
 * included:
 *   gl_embed    e->x = embedding row of the device id *dtok
 *   gl_qkv      e->qkv = [Wq; Wk; Wv] rmsnorm(e->x, attn_norm) + b
 *   gl_q_only   q (qd) = Wq xn + bq for an already normalized xn (the
 *               query predicted one layer ahead)
 *   gl_attn_out e->x += Wo e->att + bo
 *   gl_ffn      e->x += Wdown (silu(Wgate xn) * (Wup xn)), xn = rmsnorm(e->x, ffn_norm)
 *   gl_logits   e->logits = Wout rmsnorm(e->x, output_norm) */
kv_status gl_embed(kv_gpu_engine *e, const int *dtok, cudaStream_t s);
kv_status gl_qkv(kv_gpu_engine *e, int l, cudaStream_t s);
kv_status gl_q_only(kv_gpu_engine *e, int l, const float *xn, float *q, cudaStream_t s);
kv_status gl_attn_out(kv_gpu_engine *e, int l, cudaStream_t s);
kv_status gl_ffn(kv_gpu_engine *e, int l, cudaStream_t s);
kv_status gl_logits(kv_gpu_engine *e, cudaStream_t s);
/* A layer's weights as the chunked prefill takes them. */
void gl_prefill_layer(const kv_gpu_engine *e, int l, kv_pf_layer *out);
/* n floats to the device, zero-padded to a multiple of 8 (GEMV inputs are read in 8s). */
kv_status gl_upload_f32(const float *src, int n, float **dst, const char *what);

#endif /* KV_HAVE_CUDA */

#endif
