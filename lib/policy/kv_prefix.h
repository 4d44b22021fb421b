/*
 * kv_prefix: a stored prompt cache that a run continues from (kv-run --kv,
 * --store; kv-bench prefix).  It is the rows of a .kvc (plain, KIVI- or
 * DSQ-packed layers, maybe a subset of the prompt's tokens with a
 * positions tensor) or rows already in memory (the in-process tiers of
 * kv-bench prefix), together with what the engines need to continue after
 * them: the position of the next token and the check that the cache was
 * made by this model (kvc(5), "Continuing from a cache").
 *
 * Rows and positions: row t of the prefix is the token at position
 * positions[t] (t itself without positions), keys roped there.  Every row
 * precedes `matched`, the position of the first new token, so an engine
 * holds the T rows as its first T cache rows and rotates the new tokens
 * at row + (matched - T): attention is over rows, RoPE over positions.
 */
#ifndef KV_PREFIX_H
#define KV_PREFIX_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kv_dtype.h"
#include "common/kv_status.h"
#include "format/kvc.h"
#include "model/kv_model.h"
#include "policy/kv_policy.h"

/* Consecutive rows of a prefix held apart (one kv-tree node's chunk in
 * kv-bench prefix's in-process tiers): per layer (n_kv_heads, T, head_dim). */
typedef struct {
    int T;                           /* rows taken */
    int ld;                          /* rows per head in k[l], v[l] (>= T; 0 means T) */
    const void *const *k, *const *v; /* (n_layers) */
} kv_prefix_seg;

typedef struct {
    int T;                     /* rows (cached tokens) */
    int n_kv_heads, head_dim;  /* of every layer's rows */
    int matched;               /* position of the next token (>= the last row's position + 1) */
    const int32_t *positions;  /* (T) the rows' positions, or NULL: row t is position t */
    const int32_t *tokens;     /* (T) their ids, or NULL */
    /* the rows: from a file ... */
    const kvc_file *f;         /* or NULL */
    /* ... or from memory (f NULL): per layer (n_kv_heads, T, head_dim) of dt */
    kv_dtype dt;               /* F32, F16 or BF16 (F16 when device) */
    const void *const *k, *const *v; /* (n_layers) */
    int ld;                    /* rows per head in k[l], v[l] (>= T; 0 means T) */
    bool device;               /* k, v are fp16 in the GPU engine's device memory (kv-bench's GPU tier) */
    const kv_prefix_seg *seg;  /* or the rows in nseg segments (k, v unused), their T summing to T */
    int nseg;
    /* rows still arriving (kv_tree_store_load_start): wait(wait_user, l) returns once layer l's
       rows (and every earlier layer's) are in k, v, or with the load's error; NULL: all are there.
       Every reader of a layer's rows calls kv_prefix_wait first. */
    kv_status (*wait)(void *wait_user, int layer);
    void *wait_user;
} kv_prefix;

/* Layer l's rows of p are in place (p->wait), or the error of their load. */
kv_status kv_prefix_wait(const kv_prefix *p, int layer);

/*
 * The prefix a .kvc holds, for model m: checks that the file was written
 * for m (kv_prefix_check_model) and reads matched (metadata kvtree.matched,
 * else the last position + 1, else T) and the positions (strictly
 * increasing, below matched).  p borrows from f.  A mismatch or a bad
 * positions tensor is KV_E_DATA with a one-line reason.
 */
kv_status kv_prefix_from_kvc(const kv_model *m, const kvc_file *f, kv_prefix *p);
/* The same without a model (no kv_prefix_check_model): what a front end can
 * check before it loads one. */
kv_status kv_prefix_read(const kvc_file *f, kv_prefix *p);
/* The prefix is the whole of the tokens before matched, with their ids:
 * a cache that --dump-kv can extend into the prompt's full cache. */
bool kv_prefix_is_whole(const kv_prefix *p);

/*
 * Does a cache of geometry g fit model m?  Layers, KV heads, head
 * dimension, query heads (when g knows them), RoPE base, scaling and its
 * parameters, keys stored after RoPE with interleaved pairs (how both
 * engines rotate), and the model name when g has one.  KV_E_DATA names the
 * first difference ("the cache has 4 KV heads, the model 8").
 */
kv_status kv_prefix_check_model(const kv_model *m, const kv_geom *g);

/* Layer l's K (which 'k') or V ('v') rows as float32 (n_kv_heads, T, head_dim),
 * decoded from whatever the file stores (packed layers are dequantized:
 * the values the packed data stands for); non-finite values are KV_E_DATA. */
kv_status kv_prefix_rows_f32(const kv_prefix *p, int layer, char which, float *out);

/* The same rows as fp16 (IEEE half bits), for the GPU engine. */
kv_status kv_prefix_rows_f16(const kv_prefix *p, int layer, char which, uint16_t *out);

/*
 * Is layer l packed in the file (KIVI or DSQ)?  Then *prm is the policy
 * that holds such a layer as it is (quant with the file's bits, group and
 * residual, or dsq with its window and salient count), and the layer is
 * loaded into that policy (kv_policy_load) instead of re-quantized.  K and
 * V packed differently (or one plain) is KV_E_UNSUPPORTED.
 */
kv_status kv_prefix_layer_packed(const kv_prefix *p, int layer, bool *packed, kv_policy_params *prm);

/* Load layer l's packed K and V from p's file into policy pol (built with
 * the parameters kv_prefix_layer_packed gave): the policy then holds the
 * T rows exactly as packed, and appends continue after them. */
kv_status kv_policy_load(kv_policy *pol, const kv_prefix *p, int layer);

#endif
