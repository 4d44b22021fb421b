/*
 * kv_policy: one layer's KV cache, behind one interface.  The model loop
 * (lib/engine) asks each layer's policy to take the prompt's K/V after a
 * dense prefill (ingest), to append each new token's K/V, and to attend a
 * query.  A policy owns its layout and reports exactly how many bytes it
 * keeps resident, in host memory, on disk, and fetches per step.
 *
 * Policies: full, quant (KIVI 1/2/4-bit), sparse (TailorKV), streaming
 * (StreamingLLM sink + window), dsq (KVO-LLM DSQ + HCAP).  All vectors are
 * float32 on the CPU; keys and queries arrive with RoPE already applied.
 */
#ifndef KV_POLICY_H
#define KV_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_device.h"
#include "common/kv_dtype.h"
#include "common/kv_status.h"

typedef enum {
    KV_POL_FULL = 0,
    KV_POL_QUANT,
    KV_POL_SPARSE,
    KV_POL_STREAMING,
    KV_POL_DSQ,
    KV_POL_COUNT
} kv_policy_kind;

/* sparse, grouped-query attention: how the query heads sharing one KV head
 * combine their token scores before the top-K (each head's scores are first
 * turned into softmax probabilities over the candidates). */
typedef enum { KV_REDUCE_SUM = 0, KV_REDUCE_MAX } kv_group_reduce;

/* sparse: how the tokens fetched each step are chosen (kv-run(1) POLICIES). */
typedef enum {
    KV_SELECT_CHANNELS = 0, /* TailorKV: C critical channels chosen per step, read from the host */
    KV_SELECT_EXACT,        /* scores from every key channel (host) */
    KV_SELECT_SKETCH,       /* scores from a resident 1-bit key sketch (GPU engine only) */
    KV_SELECT_RESIDENT,     /* C critical channels chosen once at ingest, their rows resident
                               (fp16, or cbits-bit codes): only the chosen rows are fetched */
    KV_SELECT_PAGES,        /* Quest: per page of P tokens a resident per-channel min and max */
    KV_SELECT_PCA,          /* Loki: the keys' C principal coordinates (fp16 or codes) resident */
    KV_SELECT_COUNT
} kv_select_mode;

/* The selection mode a sparse layer gets when its spec names none. */
#define KV_SELECT_DEFAULT KV_SELECT_RESIDENT

/* Keys a front end may set for every layer (kv_policy_defaults), as bits of
 * kv_policy_params.given and kv_policy_defaults.given. */
enum { KV_KEY_DTYPE = 1u << 0, KV_KEY_SELECT = 1u << 1, KV_KEY_OFFLOAD = 1u << 2 };

/*
 * Every tunable of every policy; each policy reads the fields it uses.
 * This one struct carries a layer's choice everywhere: the spec parser and
 * the deploy config fill it, front-end defaults are applied to it, both
 * engines validate it with kv_policy_check, and benchmarks fill it directly.
 */
typedef struct {
    kv_policy_kind kind;
    kv_dtype dtype; /* full precision storage: f32, f16 or bf16 (full, residuals,
                             sparse host copy) */
    /* quant (KIVI) */
    int bits, group, residual;
    /* sparse / streaming */
    int sink, window;     /* S sink tokens, W recent tokens */
    int channels;         /* C critical channels (sparse) */
    int topk;             /* K tokens fetched per step; 0 = use topk_frac */
    double topk_frac;     /* K as a fraction of the context when topk == 0 */
    kv_select_mode select; /* sparse: token selection (KV_SELECT_DEFAULT) */
    int cbits;            /* sparse, select=resident: bits of the resident channel rows:
                             16 (fp16), 8 or 4 (codes per channel over 64-token groups) */
    int page;             /* sparse, select=pages: tokens per page (16) */
    int pool;             /* sparse, select=resident: channels kept resident, R >= C (0:
                             head_dim / 2); each step scores with C of them by |q|·max|K| */
    bool offload;         /* full: K/V in host memory, copied in per step (GPU engine) */
    /* dsq */
    int dsq_window;       /* tokens per DSQ window (64) */
    double dsq_salient;   /* fraction of salient tokens per window (KV_DSQ_POLICY_SALIENT_FRAC, 0.1) */
    int dsq_base;         /* kv_dsq_base: key base from the salient keys (KVO-LLM) or the
                             rest (KV_DSQ_DEFAULT_BASE) */
    int dsq_kbits;        /* bits of the non-salient key rows (1, 2, 4; default 4) */
    int dsq_vbits;        /* bits of the non-salient value rows (1, 2, 4; default 2) */
    int dsq_group;        /* channels per non-salient group (32) */
    double hcap_channel_thresh; /* HCAP: prune channels under this share (0 = off) */
    double hcap_token_keep;     /* HCAP: fraction of tokens kept (1 = off) */
    /* sparse (added by E; defaults from kv_policy_params_default) */
    bool predict;               /* use the engine's predicted query (true) */
    kv_group_reduce group_reduce; /* GQA score combination (sum) */
    unsigned given;             /* KV_KEY_* the spec named: defaults leave them alone */
} kv_policy_params;

void kv_policy_params_default(kv_policy_params *p, kv_policy_kind kind);
const char *kv_policy_kind_name(kv_policy_kind k);
kv_status kv_policy_kind_parse(const char *s, kv_policy_kind *out);
/* "channels", "exact", "sketch", "resident", "pages" ("approx" parses as channels). */
const char *kv_select_mode_name(kv_select_mode m);
kv_status kv_select_mode_parse(const char *s, kv_select_mode *out);

typedef struct {
    int layer;
    int n_heads, n_kv_heads, head_dim;
    int max_tokens; /* context capacity */
} kv_policy_geom;

/* Byte accounting, exact for the layout the policy uses. */
typedef struct {
    uint64_t resident;     /* bytes kept in fast (GPU on the GPU engine) memory */
    uint64_t host;         /* bytes kept in host memory (offloaded) */
    uint64_t disk;         /* bytes on disk (kv-tree) */
    uint64_t fetched_last; /* bytes fetched from host for the last attend */
    uint64_t fetched_total;
    uint64_t attends;      /* attend calls since ingest */
} kv_bytes;

typedef struct kv_policy kv_policy;
struct kvc_file; /* format/kvc.h */

typedef struct {
    /* Take the whole prompt's K and V ([n_kv_heads, T, head_dim] each) after
     * the engine's dense prefill. */
    kv_status (*ingest)(kv_policy *p, const float *k, const float *v, int T);
    /* Append one token at position pos (k, v: [n_kv_heads * head_dim]). */
    kv_status (*append)(kv_policy *p, int pos, const float *k, const float *v);
    /* Attend q [n_heads * head_dim] over every token held; out likewise. */
    kv_status (*attend)(kv_policy *p, const float *q, float *out);
    /* Optional: the query predicted for this layer's next attend (sparse). */
    void (*predict)(kv_policy *p, const float *q_pred);
    void (*bytes)(const kv_policy *p, kv_bytes *b);
    void (*destroy)(kv_policy *p);
    /* Optional (may be NULL; added by E): the prompt's last n queries,
     * (n_heads, n, head_dim) post-RoPE, given just before ingest().  dsq
     * takes its token importance from them; without them it packs the
     * prompt's windows after the first attend, by that attention. */
    void (*observe)(kv_policy *p, const float *q, int n);
    /* Optional (quant, dsq; added by H1): take layer `layer` of a .kvc whose
     * K and V are packed in this policy's encoding and parameters as the
     * first rows, exactly as packed (kv-run --kv: attended from the packed
     * data, not re-quantized); appends continue after them.  Called through
     * kv_policy_load (policy/kv_prefix.h), instead of ingest. */
    kv_status (*load)(kv_policy *p, const struct kvc_file *f, int layer);
} kv_policy_ops;

struct kv_policy {
    const kv_policy_ops *ops;
    kv_policy_geom g;
    kv_policy_params prm;
    int n_tokens; /* tokens held (logical context length) */
    bool wants_prediction; /* engine should call predict() before attend() */
};

/*
 * Check one layer's parameters against its geometry for the engine that
 * will run it: the one validation both engines use (kv_policy_new calls
 * it for the CPU; the GPU engine before it places a layer).  dev:
 *   KV_DEVICE_CPU  also refuses the GPU placements (select=sketch,
 *                  offload=on): KV_E_USAGE, they mean nothing without a GPU;
 *   KV_DEVICE_CUDA also refuses what the GPU engine does not implement (dsq
 *                  with HCAP, sparse with a query group over 8 or a head_dim
 *                  not a multiple of 8): KV_E_UNSUPPORTED;
 *   KV_DEVICE_AUTO checks only what both engines require.
 * A bad value is KV_E_USAGE; the detail starts "layer N policy KIND: ".
 */
kv_status kv_policy_check(const kv_policy_params *p, const kv_policy_geom *g, kv_device dev);

/* Build one layer's CPU policy (kv_policy_check(prm, g, KV_DEVICE_CPU) first). */
kv_status kv_policy_new(const kv_policy_geom *g, const kv_policy_params *prm,
                           kv_policy **out);
void kv_policy_free(kv_policy *p);

/*
 * Parse a policy spec: "KIND[:key=val,...]" for every layer, or a per-layer
 * list "0=quant:bits=1;1-31=sparse:k=128;*=full" ('*' fills the layers no
 * explicit entry names; layers nothing names are full).  Fills n_layers
 * entries.  Keys per kind (kv-run(1) POLICIES has the meanings):
 *   full:      dtype, offload=on|off
 *   quant:     bits (1,2,4), group|g, residual|r
 *   sparse:    sink|s, window|w, channels|c, k|topk, frac, budget (a
 *              count >= 1 or a fraction < 1, as in a deploy config),
 *              select=resident|channels|approx|exact|sketch|pages, cbits (16, 8,
 *              4), page,
 *              predict=on|off, reduce=sum|max, dtype
 *   streaming: sink|s, window|w, dtype
 *   dsq:       window|w, salient, base=rest|salient, bits (1,2,4: kbits and
 *              vbits), kbits, vbits, group|g, chan (HCAP channel share), keep
 *              (HCAP tokens)
 * Strict: an unknown kind or key, or a bad number, is KV_E_USAGE with a
 * message naming it.
 */
kv_status kv_policy_parse(const char *spec, int n_layers, kv_policy_params *per_layer);

/* The spec's syntax, kinds, keys and values, for any number of layers (a
 * front end checks a spec with it before it loads the model that says how
 * many layers there are; kv_policy_parse then checks the ranges). */
kv_status kv_policy_spec_check(const char *spec);

/*
 * Front-end defaults for every layer (--kv-dtype, --select): each field in
 * `given` applies to every layer whose spec did not name that key (a key in
 * the spec wins).  Apply them after kv_policy_parse or kv_deploy_apply.
 *   dtype:   full-precision storage of every layer
 *   select:  token selection of every sparse layer
 *   offload: full layers kept in host memory (GPU engine)
 */
typedef struct {
    unsigned given; /* KV_KEY_* */
    kv_dtype dtype;
    kv_select_mode select;
    bool offload;
} kv_policy_defaults;

void kv_policy_defaults_apply(const kv_policy_defaults *d, kv_policy_params *per_layer,
                              int n_layers);

/* Shorthand: kv_policy_defaults_apply with only `select` given. */
void kv_policy_set_select(kv_policy_params *per_layer, int n_layers, kv_select_mode m);

/* The spec of one layer's parameters, every key of its kind written, so
 * that kv_policy_parse gives them back (the `given` marks aside); what a
 * deploy config stores per layer.  KV_E_USAGE when it does not fit in n. */
kv_status kv_policy_spec_write(const kv_policy_params *p, char *buf, size_t n);

/* One line describing a layer's parameters ("sparse sink=4 window=32 ..."). */
void kv_policy_desc(const kv_policy_params *p, char *buf, size_t n);

#endif
