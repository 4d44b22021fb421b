/*
 * kv_gpu_bench: the measuring behind `kv-bench decode` — the transfer
 * ceilings of the machine (pinned host<->device copies, device copies,
 * zero-copy reads and row gathers from mapped host memory, and the same
 * gather done with one cudaMemcpyAsync per row), and one timed decode run of
 * a kv_gpu_engine under a given placement.  Without CUDA every call fails
 * with KV_E_UNAVAILABLE.
 */
#ifndef KV_GPU_BENCH_H
#define KV_GPU_BENCH_H

#include <stdbool.h>
#include <stdint.h>

#include "gpu/kv_gpu_engine.h"
#include "common/kv_status.h"

typedef struct {
    double h2d;           /* pinned host -> device, bytes/s (256 MiB copies) */
    double d2h;           /* device -> pinned host, bytes/s */
    double d2d;           /* device copy, bytes read + written per s (1 GiB) */
    double zc_read;       /* a kernel reading mapped pinned memory, bytes/s */
    double zc_gather;     /* zero-copy gather of random 512-byte rows, bytes/s */
    double memcpy_gather; /* the same rows, one cudaMemcpyAsync each, bytes/s */
    int row_bytes;        /* 512 */
} kv_gpu_bw;

kv_status kv_gpu_bw_measure(int device, kv_gpu_bw *bw);

/* Each kernel of one sparse layer's selection timed alone on an idle GPU
 * (median of several launches), microseconds, at n candidates, Llama-3.1-8B
 * attention geometry (32/8 heads, head_dim 128), top-k rows, 8 channels. */
typedef struct {
    double pred_gemv, score_sketch, score_channels, softmax_combine, topk, gather;
    double sketch_combine; /* score_sketch + softmax_combine fused (what the engine runs) */
    int n, k;
} kv_gpu_select_us;

kv_status kv_gpu_bench_select(int device, int n, int k, kv_gpu_select_us *us);

/* The placements `kv-bench decode` compares, every layer one way or the
 * hybrid's two: full (fp16 on the GPU), quant (KIVI on the GPU), hybrid
 * (the first layers quant, the rest sparse with channel selection),
 * hybrid-sketch (the same with the 1-bit key sketch), offload (full with
 * offload=on). */
typedef enum {
    KV_DEC_FULL = 0,
    KV_DEC_QUANT,
    KV_DEC_HYBRID,
    KV_DEC_SKETCH,
    KV_DEC_OFFLOAD,
    KV_DEC_RESIDENT, /* the hybrid with select=resident (pool channel rows on the GPU) */
    KV_DEC_PAGES,    /* the hybrid with select=pages (per-page key bounds on the GPU) */
    KV_DEC_COUNT
} kv_decode_placement;

/* "full", "quant", "hybrid", "hybrid-sketch", "offload", "hybrid-resident", "hybrid-pages". */
const char *kv_decode_placement_name(kv_decode_placement p);

/* Is p one of the hybrids (quant layers, then sparse ones)? */
static inline int kv_decode_is_hybrid(int p)
{
    return p == KV_DEC_HYBRID || p == KV_DEC_SKETCH || p == KV_DEC_RESIDENT || p == KV_DEC_PAGES;
}

typedef struct {
    int qbits;    /* bits of the quantized layers (quant, the hybrid's first layers) */
    int qlayers;  /* hybrid: layers [0, qlayers) quantized */
    int topk, channels, sink, window; /* hybrid: the sparse layers */
} kv_decode_layers;

/* Fill per_layer (n_layers) with placement p's parameters, fp16 storage
 * (KV_E_USAGE when qlayers exceeds the layers of a hybrid). */
kv_status kv_decode_layers_fill(kv_decode_placement p, const kv_decode_layers *c, int n_layers,
                                kv_policy_params *per_layer);

/* Share of the PCIe time (bytes at h2d bytes/s) that does not show in the
 * step time ms against ms_ref, clamped to [0, 1].  kv-bench decode reports
 * it against ms_nogather (pcie_hidden: the gather's cost alone) and against
 * ms_nofetch (side_work_hidden: selection and gather together). */
double kv_gpu_bench_hidden(double ms, double ms_ref, uint64_t bytes, double h2d);

typedef struct {
    double ms_median, ms_p90, ms_min; /* per decoded token */
    double ms_nofetch;    /* median with sparse selection/gather switched off (0 if n/a) */
    double ms_nogather;   /* median with the selection on and only the gather of the chosen
                             rows from host memory off (0 if n/a) */
    uint64_t gpu_kv;      /* KV bytes resident on the GPU after the run */
    uint64_t host_kv;     /* KV bytes in pinned host memory */
    uint64_t pcie_token;  /* bytes read from host memory by the last step */
    double select_ms;     /* last step: selection stream busy time (sparse) */
    double copy_ms;       /* last step: copy stream busy time (offload) */
    double fetch_ms;      /* last step: time in gathers / copies from host memory */
    int tokens;           /* timed tokens */
    double prefill_ms;    /* with a real prefill: its wall time (placements' ingest included) */
    double prefill_attn_ms; /* its attention kernels' GPU time (0 if not chunked) */
    double score_ms;      /* last step: predicted query to top-K done, summed over layers */
    double wait_ms;       /* last step: the main stream's exposed waits for the selection */
    uint64_t cache_hits, cache_rows; /* sel_cache: rows already held / rows chosen, timed steps */
    kv_gpu_graph_info graph; /* how the steps reached the GPU (opts.graph), over the whole run */
} kv_gpu_decode_result;

/* One way to run the sparse layers' step (kv_gpu_engine_opts.sel_serial,
 * topk_wide, sel_cache), for kv_gpu_bench_decode_variants. */
typedef struct {
    char name[32]; /* "base", or the words joined by '+': serial, wide, cache, classic, ahead2 */
    bool serial, wide, cache, classic;
    int ahead;     /* ahead2: 2, else 0 (opts.sel_ahead) */
    int sel_blocks, gather_blocks; /* chainN, gatherN: N (all: -1), else 0 (opts') */
    int sel_kernels; /* late, nopdl, collect, direct (set) and early, hist (clear) over the default:
                        opts.sel_kernels, 0 when none is named */
    int sel_every;   /* everyN: N (opts.sel_every), else 0 */
} kv_decode_variant;

/* Parse "base" or words of serial, wide, cache, classic, ahead2, chainN,
 * gatherN (N 1-999 or all), late, early, nopdl, collect, direct, hist, everyN (N
 * 2-999) joined by '+' (KV_E_USAGE naming the word otherwise). */
kv_status kv_decode_variant_parse(const char *s, kv_decode_variant *v);
/* The step options of variant v into o (the rest of o unchanged). */
void kv_decode_variant_apply(const kv_decode_variant *v, kv_gpu_engine_opts *o);

/*
 * Reset e to per_layer/opts, put a T-token context in place — synthesized
 * on the device (seeded), or with prefill a seeded random prompt prefilled
 * for real (kv_gpu_engine_prefill, its attention timed) — decode warmup
 * then `tokens` greedy tokens timed per step; when nofetch_tokens > 0 and
 * some layer is sparse, decode that many more with fetching off.
 */
kv_status kv_gpu_bench_decode(kv_gpu_engine *e, const kv_policy_params *per_layer,
                              const kv_gpu_engine_opts *opts, int T, uint64_t seed, bool prefill,
                              int warmup, int tokens, int nofetch_tokens, kv_gpu_decode_result *r);

/*
 * The same with one context for nv variants of the step: after the prefill
 * (or synthesis), each variant in turn (kv_gpu_engine_set_step_opts) decodes
 * warmup + tokens timed tokens into r[i]; the fetch-free time is taken once,
 * after the first, and copied to every r[i]; the gather-free time (the
 * variant's selection on, the gather off) after each, nofetch_tokens more.
 */
kv_status kv_gpu_bench_decode_variants(kv_gpu_engine *e, const kv_policy_params *per_layer,
                                       const kv_gpu_engine_opts *opts, int T, uint64_t seed,
                                       bool prefill, int warmup, int tokens, int nofetch_tokens,
                                       const kv_decode_variant *v, int nv, kv_gpu_decode_result *r);

#endif
