/*
 * kv_geom: the geometry of a model's KV cache, the one description every
 * layer of the library shares: heads, head dimension, layers, tokens, and
 * the RoPE that was applied to the keys.  .kvc files carry it in their
 * metadata (lib/format), a model derives it from its config
 * (kv_model_geom), a kv-tree store records it, the engines size their
 * caches from it.  The RoPE enums are the ones the model config uses too.
 */
#ifndef KV_GEOM_H
#define KV_GEOM_H

#include <stdbool.h>

typedef enum { KV_ROPE_INTERLEAVED = 0, KV_ROPE_HALVES = 1 } kv_rope_layout;
typedef enum { KV_ROPE_SCALING_NONE = 0, KV_ROPE_SCALING_LLAMA3 = 1 } kv_rope_scaling;

/* Model and cache geometry, from metadata or derived from tensor shapes. */
typedef struct {
    int n_layers;
    int n_heads;    /* query heads (0 if unknown: no q tensors and no metadata) */
    int n_kv_heads;
    int head_dim;
    int n_tokens;   /* tokens in the cache */
    int n_q;        /* query samples per layer (0 if none) */
    double rope_theta;               /* default 10000 */
    kv_rope_scaling rope_scaling;    /* default none */
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_orig_ctx;
    bool keys_roped;                 /* default true */
    kv_rope_layout rope_layout;      /* default interleaved */
    char model[64];                  /* free-form model name, may be "" */
} kv_geom;

/* Defaults for a geometry (theta 10000, keys roped, interleaved). */
void kv_geom_defaults(kv_geom *g);

#endif
