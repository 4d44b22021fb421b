/*
 * kv_gpu_engine: the forward pass of lib/engine/kv_engine.h on a CUDA GPU, with
 * TailorKV's placement on real hardware.  Same model structure and the same
 * per-layer kv_policy_params as the CPU engine; weights live on the GPU,
 * the Q8_0, Q4_K and Q6_K matrices of a GGUF (what Q8_0 and Q4_K_M files
 * hold) packed as stored, read by a GEMV on the blocks and dequantized per
 * prefill chunk for the tensor-core products, every other matrix converted
 * at load to fp16 (bf16 when the model is bf16); qwen2's q/k/v biases are
 * added after their projections; the KV cache is fp16.  Per layer, by
 * policy:
 *   full    — the K/V cache on the GPU (or, with offload=on, in pinned host
 *             memory, each layer copied in per step on a copy stream while
 *             the previous layer computes: the `offload` baseline);
 *   quant   — KIVI-packed K/V resident on the GPU, attention straight from
 *             the packed data (kernels/kv_kernels.h) at head_dim 128, 1 or
 *             2 bits; any other geometry keeps the same packed bytes
 *             (packed on the host with lib/quant/kv_quant.c's code as groups
 *             fill) and expands them to an fp16 scratch each step for the
 *             fp16 attention: correct, not fast;
 *   streaming — sink + recent-window rows on the GPU (a ring), exact
 *             attention over the tokens the CPU policy keeps;
 *   sparse  — the prompt's K/V in pinned host memory (one row per token with
 *             every KV head's K and V; keys also channel-major), the GPU
 *             keeping sink, recent and generated tokens; the layer's query is
 *             predicted one layer early and its token selection and gather
 *             run on a second stream while the previous layer computes.
 *             select=sketch scores tokens from a resident 1-bit sketch
 *             of the keys instead of fetching critical channels.
 *   dsq     — windows packed on the host by lib/quant/kv_dsq.c (salient tokens by
 *             attention accumulated on the GPU), resident packed, expanded
 *             to an fp16 scratch each step: correct, not fast.  HCAP
 *             (keep < 1, chan > 0) is refused (KV_E_UNSUPPORTED).
 *
 * Without CUDA in the build, or without a usable device, kv_gpu_engine_new
 * fails with KV_E_UNAVAILABLE and a one-line reason; nothing else may be
 * called then.  Every CUDA failure comes back as a status naming the failed
 * statement, file, line and device and the CUDA error text (GPU out of
 * memory is KV_E_NOMEM).  The code: lib/gpu/kv_gpu_engine.c (core) and one
 * file per placement (lib/gpu/kv_gpu_int.h lists them).
 *
 * Typical use mirrors kv_engine.h:
 *   kv_gpu_engine *g; kv_gpu_engine_new(model, per_layer, ctx, NULL, &g);
 *   kv_gpu_engine_prefill(g, toks, n, logits);
 *   for (...) kv_gpu_engine_step(g, argmax(logits), logits);
 *   kv_gpu_engine_free(g);
 */
#ifndef KV_GPU_ENGINE_H
#define KV_GPU_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "model/kv_model.h"
#include "policy/kv_policy.h"
#include "policy/kv_prefix.h"
#include "common/kv_status.h"

typedef struct kv_gpu_engine kv_gpu_engine;

/* opts.pdl: programmatic dependent launch level (kernels/kv_kernels.h). */
#define KV_GPU_PDL_AUTO (-1) /* 2 on compute capability 9.0 and later, else 0 */

/* opts.graph: how a decode step reaches the GPU (lib/gpu/kv_gpu_graph.c). */
enum {
    KV_GPU_GRAPH_AUTO = 0, /* the measured-faster way (docs/BENCHMARKS.md, "Graph-captured
                              decode"): kv_gpu_engine_generate captured, kv_gpu_engine_step
                              (the host waits for each step's logits) kernel by kernel */
    KV_GPU_GRAPH_ON = 1,   /* each step captured into a CUDA graph and replayed */
    KV_GPU_GRAPH_OFF = 2   /* each step's kernels launched one by one (the former path) */
};

/* opts.sel_skip bits (measurement only: the attention then reads stale rows
 * or scores): steps of a sparse layer's selection left out. */
enum {
    KV_GPU_SKIP_SCORES = 1,  /* token scores (sketch) */
    KV_GPU_SKIP_SOFTMAX = 2, /* softmax and the GQA combine */
    KV_GPU_SKIP_TOPK = 4,    /* top-K */
    KV_GPU_SKIP_GATHER = 8,  /* the gather of the chosen rows */
    KV_GPU_SKIP_QUERY = 16   /* the predicted query's GEMV */
};

typedef struct {
    int device;           /* CUDA device ordinal */
    kv_dtype wtype;   /* weights on the GPU: auto = Q8_0/Q4_K/Q6_K kept packed, the rest
                             bf16 for bf16 models, else f16; f16 or bf16 converts every matrix */
    bool no_fetch;        /* measurement only: skip sparse selection and gathering (the
                             attention then reads stale rows) to time the fetch-free step */
    bool profile;         /* time the side streams per layer (kv_gpu_engine_timing) */
    int pdl;              /* KV_GPU_PDL_AUTO, or 0, 1, 2 to lower it, for measurement; for
                             the whole process (kv_cuda_set_pdl), applied at new and reset */
    unsigned sel_skip;    /* KV_GPU_SKIP_* bits, measurement only (0) */
    int prefill_chunk;    /* prompt rows per prefill chunk (tensor cores, lib/gpu/kv_gpu_prefill.c):
                             0 = KV_GPU_PREFILL_CHUNK; < 0 = one token at a time (the former
                             path, also taken for head_dim outside 64/128 or without cuBLAS) */
    bool time_prefill;    /* time the chunked prefill's attention launches with events
                             (kv_gpu_engine_prefill_attn_ms) */
    bool prefill_exact;   /* measurement only: the last chunk's products over its own row
                             count rather than rounded up to KV_GPU_PREFILL_PAD rows */
    bool prefill_copy_sync; /* measurement only: sparse layers copy their prompt to host
                             memory at the end of the layer on the main stream (the former
                             path), instead of chunk by chunk on the copy stream while the
                             next chunk computes */
    /* How a sparse layer's selection runs in a decode step (the same tokens
     * either way, unless noted; kv_gpu_engine_set_step_opts changes them
     * between steps):
     *   sel_serial  the predicted query's selection and gather on the main
     *               stream right where they are issued (no overlap): the
     *               reference the overlapped path must equal;
     *   topk_wide   top-K with its pass over the scores spread over many
     *               blocks per KV head (eng_topk_wide: the same ids);
     *   sel_cache   keep each layer's gathered rows between steps and read
     *               over PCIe only the chosen tokens not already held (the
     *               attention then sums the same rows in another order). */
    bool sel_serial;
    bool topk_wide;
    bool sel_cache;
    int graph;            /* KV_GPU_GRAPH_*: each decode step captured into a CUDA graph
                             (re-captured per step, the executable graph updated in place,
                             then launched once) or launched kernel by kernel; a step a
                             placement cannot capture (a group packed with allocations or on
                             the host) runs plainly, and kv_gpu_engine_graph_info says which */
    /* select=resident's kernels: false (the default) eng_resident_select, the
     * chain of short many-block kernels (kernels/eng_select_fast.cu); true the
     * former chain (eng_select_pool, eng_score_rows, eng_softmax_combine,
     * eng_topk or eng_topk_wide), kept for measurement.  The same ids up to
     * float rounding of the softmax sums.
     * sel_ahead: how many layers ahead a predicted layer's query, selection
     * and gather are issued: 0 or 1 (TailorKV: from the residual stream
     * before the previous layer), 2 (before the layer two back: twice the
     * time to hide the chain behind, a query predicted from further back).
     * kv_gpu_engine_set_sel_opts changes both between steps. */
    bool sel_classic;
    int sel_ahead;
    /* Blocks per KV head of the selection kernels (eng_resident_select) and
     * of the gather of the chosen rows, for every select mode: 0 = the
     * defaults KV_GPU_SEL_BLOCKS, KV_GPU_GATHER_BLOCKS; < 0 = one block per
     * chunk of work (the widest grid).  Narrow kernels leave the SMs to the
     * layer they hide behind (measurement: kv-bench decode --variants
     * chainN, gatherN). */
    int sel_blocks, gather_blocks;
    /* select=resident's chain (eng_resident_select), how its kernels follow
     * each other: 0 = KV_GPU_SELK_DEFAULT (late + collect), else KV_GPU_SELK_SET with some of
     * KV_GPU_SELK_LATE (a kernel lets its successor's blocks onto the SMs
     * only as it ends, not first thing), KV_GPU_SELK_NOPDL (no programmatic
     * dependent launch), KV_GPU_SELK_COLLECT (top-K: the k-th key's bin
     * collected in one pass, two passes over every key fewer),
     * KV_GPU_SELK_DIRECT (the same, the ids written from the list: three
     * fewer).  The same ids every way; for measurement (kv-bench decode
     * --variants late, nopdl, collect, direct, early, hist). */
    int sel_kernels;
    /* Selection reuse (sparse layers, measurement and option): 0 or 1 = a
     * new selection every step; N >= 2 = each layer's chosen ids kept and
     * reused for N - 1 steps after the step that chose them (the scoring and
     * top-K skipped then; the gather still runs, and with sel_cache finds
     * the rows held).  A new selection also when the top-K size changes. */
    int sel_every;
    int gemv_q;           /* packed GEMV variant, a kv_gemv_variant (common/kv_gemv.h): KV_GEMV_DEFAULT
                             (0: per type and shape, eng_gemvq_best) or one forced, for measurement */
} kv_gpu_engine_opts;

#define KV_GPU_SEL_BLOCKS 32

/* opts.sel_kernels bits (the values of kernels/eng_ops.cuh's ENG_SEL_*) */
#define KV_GPU_SELK_LATE 1
#define KV_GPU_SELK_NOPDL 2
#define KV_GPU_SELK_COLLECT 4
#define KV_GPU_SELK_DIRECT 8
#define KV_GPU_SELK_SET 256 /* the bits are explicit (0 would be "none") */
/* the default: late trigger and the collected top-K tail, measured fastest
 * at 128k on the H200 (docs/BENCHMARKS.md, helper A7) */
#define KV_GPU_SELK_DEFAULT (KV_GPU_SELK_LATE | KV_GPU_SELK_COLLECT)
#define KV_GPU_GATHER_BLOCKS 1

/* The default chunk: the fastest of 4096, 8192 and 16384 rows for the 8B
 * geometry at 128k on the H200 (docs/BENCHMARKS.md, GPU prefill). */
#define KV_GPU_PREFILL_CHUNK 4096

/* The chunked prefill's last chunk runs its four products over its rows
 * rounded up to a multiple of this (kv_pf_ws.pad): cuBLAS sets up a kernel
 * at each row count it first meets, a millisecond or more on the 8B's
 * shapes, which a request of a new length paid inside its time to first
 * token; rounded, the row counts are few enough to set up once
 * (kv_gpu_engine_warm).  At most 15 rows more of products (0.4% at 4k
 * rows, 3% at 460). */
#define KV_GPU_PREFILL_PAD 16

void kv_gpu_engine_opts_default(kv_gpu_engine_opts *o);

/*
 * Build an engine for m (borrowed; must outlive the engine).  per_layer
 * (n_layers) or NULL for `full` on every layer; ctx: capacity in tokens (0 =
 * the model's seq_len); opts may be NULL for the defaults.
 */
kv_status kv_gpu_engine_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                            const kv_gpu_engine_opts *opts, kv_gpu_engine **out);
void kv_gpu_engine_free(kv_gpu_engine *e);

/* An engine for the same model that reads src's weights on the GPU instead
 * of uploading its own (a batch of sequences, lib/gpu/kv_gpu_batch.h): src
 * must outlive it; opts (NULL: src's) must keep src's device, wtype and
 * gemv_q.  Its own KV, activations and streams, as kv_gpu_engine_new's. */
kv_status kv_gpu_engine_new_sharing(const kv_gpu_engine *src, const kv_policy_params *per_layer,
                                    int ctx, const kv_gpu_engine_opts *opts, kv_gpu_engine **out);

/* Forget every token; per_layer (n_layers) replaces the policies, NULL keeps them. */
kv_status kv_gpu_engine_reset(kv_gpu_engine *e, const kv_policy_params *per_layer);

/* Same, also replacing the options (device and wtype must not change). */
kv_status kv_gpu_engine_reset_opts(kv_gpu_engine *e, const kv_policy_params *per_layer,
                                   const kv_gpu_engine_opts *opts);

/* Prefill tokens (n >= 1) from position 0: dense causal attention over an
 * fp16 prompt cache, layer by layer in chunks of opts.prefill_chunk rows
 * (cuBLAS products, the flash-attention chunk kernel), each layer's prompt
 * K/V handed to its placement as soon as the layer is done; one token at a
 * time where the chunked path does not apply (opts.prefill_chunk < 0,
 * head_dim outside 64/128, no cuBLAS).  logits_last: (vocab) or NULL. */
kv_status kv_gpu_engine_prefill(kv_gpu_engine *e, const int *tokens, int n, float *logits_last);

/* Continue from a stored cache (kv-run --kv, --store; lib/policy/kv_prefix.h):
 * the engine must be fresh or reset.  Every layer's dense fp16 cache gets
 * pre's P rows first, then tokens (n >= 1) are prefilled after them in
 * chunks (or one at a time, as kv_gpu_engine_prefill would), rotated at
 * positions pre->matched, ...; each layer's placement then ingests all
 * P + n rows.  A layer packed in the file (KIVI or DSQ, kv_prefix_layer_packed)
 * is held packed, as on the CPU: its policy is replaced by the file's
 * encoding (quant with the file's bits, group and residual; dsq with its
 * window, salient count, bits and group; the policy's dtype kept, and kept
 * after kv_gpu_engine_reset(e, NULL) as the CPU engine keeps it: a reset
 * that names the policies again undoes it), the
 * file's codes, scales and fp16 rows are uploaded into that placement as
 * they are (never re-quantized), and the n new rows are appended after them
 * as decode steps would append (KIVI groups packed as they fill; DSQ
 * windows at the first decode step, from its attention, as the CPU policy
 * packs them).  kv_gpu_engine_layer_params says what each layer then runs;
 * a reset keeps those policies unless new ones are given.  A file layer
 * the GPU cannot hold that way (an offloaded layer's policy) is
 * KV_E_UNSUPPORTED with a one-line reason. */
kv_status kv_gpu_engine_prefill_from(kv_gpu_engine *e, const kv_prefix *pre, const int *tokens,
                                     int n, float *logits_last);

/* One decode step at position kv_gpu_engine_pos(); logits (vocab) or NULL. */
kv_status kv_gpu_engine_step(kv_gpu_engine *e, int token, float *logits);

/*
 * Greedy decode of n tokens without a host round trip per token: the first
 * input is `token`, each next input is the device argmax of the last logits.
 * out (n) receives the generated ids; step_ms (n) or NULL, the GPU time of
 * each step (events on the main stream, end to end).
 */
kv_status kv_gpu_engine_generate(kv_gpu_engine *e, int token, int n, int *out, float *step_ms);

/*
 * Benchmarks: put a T-token context in place without a prefill — seeded
 * random fp16 keys (with a few large channels, as real keys have) and values
 * generated on the device, then handed to every layer's placement exactly
 * as a prefill's K/V would be.  The engine must be fresh or reset.
 */
kv_status kv_gpu_engine_synthesize(kv_gpu_engine *e, int T, uint64_t seed);

/* Measurement only: switch the sparse layers' selection and gather off (or
 * back on) without touching the context (see opts.no_fetch). */
void kv_gpu_engine_set_no_fetch(kv_gpu_engine *e, bool no_fetch);

/* Change opts.sel_classic, sel_ahead, sel_blocks and gather_blocks between
 * steps (the device may be busy: they take effect from the next step issued). */
void kv_gpu_engine_set_sel_opts(kv_gpu_engine *e, bool classic, int ahead, int sel_blocks, int gather_blocks);

/* Change opts.sel_kernels and sel_every, or opts.sel_skip (measurement only), between
 * steps (they take effect from the next step issued). */
void kv_gpu_engine_set_sel_kernels(kv_gpu_engine *e, int sel_kernels, int sel_every);
void kv_gpu_engine_set_sel_skip(kv_gpu_engine *e, unsigned sel_skip);

/* Change opts.sel_serial, topk_wide and sel_cache (and profile) between
 * steps, keeping the context (a selection cache starts empty again, its
 * counts at 0).  KV_E_NOMEM when the cache does not fit. */
kv_status kv_gpu_engine_set_step_opts(kv_gpu_engine *e, bool sel_serial, bool topk_wide,
                                      bool sel_cache, bool profile);

int kv_gpu_engine_vocab(const kv_gpu_engine *e);
int kv_gpu_engine_pos(const kv_gpu_engine *e);
int kv_gpu_engine_ctx(const kv_gpu_engine *e);
int kv_gpu_engine_n_layers(const kv_gpu_engine *e);
/* "NVIDIA H200 (sm_90, 143771 MiB, driver 13.0)" */
const char *kv_gpu_engine_device(const kv_gpu_engine *e);
/* Its CUDA device ordinal (opts.device; -1 without CUDA). */
int kv_gpu_engine_ordinal(const kv_gpu_engine *e);

/* Byte accounting of one layer, as kv_policy's: resident = GPU KV bytes,
 * host = pinned host KV bytes, fetched_* = bytes read over PCIe (copies and
 * zero-copy reads) for the last step / in total. */
kv_status kv_gpu_engine_layer_bytes(const kv_gpu_engine *e, int layer, kv_bytes *b);
/* Sum over layers. */
void kv_gpu_engine_bytes(const kv_gpu_engine *e, kv_bytes *total);
/* GPU bytes of the weights as stored (shared layer weights counted once). */
uint64_t kv_gpu_engine_weight_bytes(const kv_gpu_engine *e);
/* GPU bytes the weights read per decode step (every layer counted). */
uint64_t kv_gpu_engine_weight_read_bytes(const kv_gpu_engine *e);

/* Side-stream times of the last step (opts.profile): the copy stream's or
 * the selection stream's busy time, summed over layers, in ms. */
typedef struct {
    double select_ms; /* sparse: predicted query, scoring, top-K and gather, start to end */
    double copy_ms;   /* offload: host-to-device copies of K/V */
    double fetch_ms;  /* time spent reading host memory: the gathers (sparse) or copies */
    double score_ms;  /* sparse: predicted query to top-K done (the selection without its gather) */
    double wait_ms;   /* sparse: the main stream's exposed wait for the selection streams */
    uint64_t cache_hits, cache_rows; /* sel_cache, since the last reset or set_step_opts: chosen
                                        rows already held, and rows chosen (sink included) */
} kv_gpu_timing;
void kv_gpu_engine_timing(const kv_gpu_engine *e, kv_gpu_timing *t);

/* How the decode steps since the last reset reached the GPU (opts.graph). */
typedef struct {
    bool on;               /* opts.graph is on or auto */
    uint64_t steps;        /* decode steps run (step and generate) */
    uint64_t captured;     /* of them, replayed from a captured graph */
    uint64_t updated;      /* captures applied to an existing executable graph in place */
    uint64_t instantiated; /* captures that needed a new executable graph (the first ones,
                              or the step's nodes changed) */
    uint64_t refused;      /* updates cudaGraphExecUpdate refused (same nodes, a change it
                              does not take), each followed by a new executable */
    int refused_result;    /* the last refusal's cudaGraphExecUpdateResult (0: none) */
    double host_us;        /* mean host time of a captured step: capture, update, launch */
    char plain_why[160];   /* why the last step run plainly was ("" when none but the
                              first after a reset, which always runs plainly) */
    char state[256];       /* "off"; "captured" (every step but the first); "fallback:
                              <reason>" (none captured); "captured, N of M steps plain:
                              <reason>"; "on (no step captured yet)"; "off (auto): ..." (auto,
                              only kv_gpu_engine_step steps, which it runs plainly) */
} kv_gpu_graph_info;
void kv_gpu_engine_graph_info(const kv_gpu_engine *e, kv_gpu_graph_info *gi);

/*
 * Capture for a .kvc dump, as kv_engine_keep: call before the prefill to
 * keep the prompt's last nq queries of each layer (post-RoPE, fp16, as the
 * prefill computed them) and, with prompt_kv, each layer's dense prompt
 * K/V, downloaded to host memory as the layer's placement takes it (so the
 * GPU never holds more than one layer's dense K/V).  Only the prefill is
 * captured (decode steps are not).  The settings survive a reset; the
 * captured data does not.
 */
kv_status kv_gpu_engine_keep(kv_gpu_engine *e, int nq, bool prompt_kv);
/* Prompt K or V of a layer after a captured prefill: (n_kv_heads, T,
 * head_dim) fp16 (IEEE half bits) host memory, T the prompt length; NULL
 * when not kept.  which: 'k' or 'v'. */
const uint16_t *kv_gpu_engine_prompt_kv(const kv_gpu_engine *e, int layer, char which, int *T);
/* Copy the captured queries of a layer, oldest first, into out (n_heads,
 * nq_out, head_dim) fp16 (or only count them: out NULL); returns nq_out (0
 * when none were kept). */
int kv_gpu_engine_queries(const kv_gpu_engine *e, int layer, uint16_t *out);

/* How kv_gpu_engine_prefill runs a prompt: in chunks of *chunk rows on the
 * tensor cores (true), or one token at a time (false); why says which
 * condition decided it (opts.prefill_chunk, head_dim, cuBLAS).  May load
 * cuBLAS (as the first prefill would). */
bool kv_gpu_engine_prefill_method(kv_gpu_engine *e, int *chunk, char *why, size_t why_len);

/*
 * For a long-lived process that serves prefills of up to rows new tokens:
 * set up cuBLAS's products for every row count a chunk of them can have
 * (each multiple of KV_GPU_PREFILL_PAD up to the chunk, and the chunk's own
 * rows), once, so that no request pays it inside its time to first token
 * (measured: docs/BENCHMARKS.md, session 15).  Runs the first layer's four
 * products at each (0.7 to 1.1 s for 4096 rows on the 8B's shapes on the
 * H200), leaves the prefill buffers for one chunk allocated when they are
 * within the kept limit, and says its time in *ms and whether it ran in
 * *ran (either may be NULL).  Needs the chunked prefill
 * (kv_gpu_engine_prefill_method); without it nothing is done (*ran false),
 * and no error.  The engine must be idle.
 */
kv_status kv_gpu_engine_warm(kv_gpu_engine *e, int rows, double *ms, bool *ran);

/* The attention kernels' GPU time in the last prefill (ms), when it ran in
 * chunks with opts.time_prefill; 0 otherwise. */
double kv_gpu_engine_prefill_attn_ms(const kv_gpu_engine *e);

/* The policy layer l runs with now (after kv_gpu_engine_prefill_from of a
 * packed cache: the file's encoding), or NULL when l is out of range. */
const kv_policy_params *kv_gpu_engine_layer_params(const kv_gpu_engine *e, int layer);

/* Host-clock phases of the last prefill (kv_gpu_engine_prefill or _from),
 * in ms, each measured up to a synchronisation, for finding fixed costs
 * (kv-bench prefix --json "prefill_phases_ms"):
 *   setup    checks, packed layers replaced, buffers (the persistent ones
 *            grown only when too small), the token upload;
 *   rows     the cached rows into the dense cache (with rows: all layers'
 *            host copies; in the chunked prefill they are issued per layer
 *            and counted in compute);
 *   compute  the layers (chunked or token by token) and every placement's
 *            ingest or load, to the device synchronisation;
 *   logits   the logits' download and the finite check;
 *   total    the whole call;
 *   capture  of compute: the dump capture's downloads (kv_gpu_engine_keep:
 *            the prompt K/V and queries), what a request that is put into
 *            a store pays on top of its prefill.
 * rows_ahead: the cached rows were uploaded a layer ahead of the compute,
 * on a stream of their own into two alternating dense caches (fp16 rows
 * copied straight, every layer full), so their PCIe time hides under the
 * layers' (a host-tier continuation); otherwise each layer's rows are
 * copied at its start on the compute stream.
 * upload: with rows_ahead, the uploads' span on the GPU's clock, from the
 * first layer's copy starting to the last layer's ending (within compute),
 * and upload_bytes their bytes; 0 otherwise.  Each layer's upload waits
 * for its buffer to be freed by the layer two back, so the span follows
 * the compute: upload_bytes / upload is a lower bound on the copy rate,
 * not the rate itself. */
typedef struct {
    double setup, rows, compute, logits, total, capture, upload;
    double upload_bytes;
    bool rows_ahead;
} kv_gpu_prefill_phases;
void kv_gpu_engine_prefill_phases(const kv_gpu_engine *e, kv_gpu_prefill_phases *out);

#endif
