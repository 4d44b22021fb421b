/*
 * kv_model: a Llama-family model's geometry and weights, loaded from a
 * llama2.c checkpoint (legacy 7-int header or v1 "ak42"), a GGUF v3 file of
 * architecture llama (Llama 1/2/3, Mistral-style files) or qwen2, or built
 * in memory from a seeded random generator (--synthetic).  Files are
 * mmapped and the weight views point into the mapping, packed types
 * included (Q4_0 ... Q6_K: resident memory stays about the file's size);
 * nothing is converted except the small norm and bias vectors, which are
 * always float32.  qwen2's q/k projections are stored in the NEOX rotary
 * order; their views carry a row permutation into the interleaved order
 * the engines rotate, so the attention scores are those of NEOX RoPE.  Every header field, offset and tensor shape is checked:
 * a bad file is KV_E_DATA / KV_E_UNSUPPORTED with a one-line detail.
 */
#ifndef KV_MODEL_H
#define KV_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_dtype.h"
#include "common/kv_geom.h"
#include "common/kv_status.h"

/* A row-major weight matrix: y = W x (+ bias) with W (rows, cols).  Its
 * type is F32, F16, BF16 or a ggml block type (KV_DT_Q8_0 ... KV_DT_Q6_K,
 * common/kv_dtype.h).  perm, when set, reorders the stored rows: output
 * row r is stored row perm[r] (used to turn NEOX-ordered q/k projections
 * into the interleaved RoPE order the engines use, without copying the
 * mapping). */
typedef struct {
    kv_dtype type; /* F32, F16, BF16 or a block type */
    int rows, cols;
    const void *data;     /* (rows, cols) in `type`; borrowed from the mapping */
    const float *bias;    /* (rows) added to W x, or NULL (qwen2's q/k/v) */
    const int32_t *perm;  /* (rows) stored row of each output row, or NULL */
} kv_weight;

typedef struct {
    int dim;          /* model width */
    int hidden_dim;   /* feed-forward width */
    int n_layers;
    int n_heads;      /* query heads */
    int n_kv_heads;   /* key/value heads (GQA: n_heads % n_kv_heads == 0) */
    int head_dim;     /* dim / n_heads */
    int vocab_size;
    int seq_len;      /* trained context length */
    float norm_eps;   /* RMSNorm epsilon */
    double rope_theta;
    int rope_dim;     /* rotated dims per head (== head_dim here) */
    kv_rope_scaling rope_scaling;
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_orig_ctx;
    const float *rope_freq_factors; /* (head_dim/2) divisors of each pair's
                                       frequency (GGUF rope_freqs), or NULL */
    bool shared_classifier; /* output == token embedding */
    char arch[16];    /* GGUF general.architecture ("llama", "qwen2"); "llama" otherwise */
    char name[64];    /* "stories260K", "llama-3.1-8b (synthetic)", ... */
    char format[16];  /* "llama2c", "gguf", "synthetic" */
} kv_model_config;

typedef struct {
    const float *attn_norm; /* (dim) */
    const float *ffn_norm;  /* (dim) */
    kv_weight wq;           /* (n_heads*head_dim, dim) */
    kv_weight wk;           /* (n_kv_heads*head_dim, dim) */
    kv_weight wv;           /* (n_kv_heads*head_dim, dim) */
    kv_weight wo;           /* (dim, n_heads*head_dim) */
    kv_weight w_gate;       /* (hidden_dim, dim)  llama2.c w1 */
    kv_weight w_down;       /* (dim, hidden_dim)  llama2.c w2 */
    kv_weight w_up;         /* (hidden_dim, dim)  llama2.c w3 */
} kv_layer_weights;

typedef struct kv_tokenizer kv_tokenizer;

typedef struct kv_model {
    kv_model_config cfg;
    kv_weight tok_embd;         /* (vocab_size, dim) */
    kv_weight output;           /* (vocab_size, dim); == tok_embd when shared */
    const float *output_norm;   /* (dim) */
    kv_layer_weights *layers;   /* (n_layers) */
    /* private: storage */
    void *map;                  /* mmapped file or NULL */
    size_t map_len;
    void *owned;                /* heap block holding owned data (buffer copy, synthetic) */
    float *norm_store;          /* f32 copies of norm vectors (and biases) */
    int32_t *perm_store;        /* (n_heads*head_dim) NEOX -> interleaved row order (qwen2) */
    struct kv_gguf *gguf;       /* parsed GGUF metadata (NULL for llama2.c) */
} kv_model;

/* Load a model file: llama2.c (legacy or v1) or GGUF v3, detected by magic.
 * A missing file is KV_E_NOINPUT. */
kv_status kv_model_open(const char *path, kv_model **out);
/* Same from a memory buffer (copied; for fuzzing and tests). */
kv_status kv_model_open_mem(const void *buf, size_t len, kv_model **out);
/* Seeded random weights for "llama-3.1-8b", "llama-3.2-1b", "llama-2-7b", "tiny" or
 * "tiny-wide-heads" (4 heads of 64 on a width of 128, as Mistral-Nemo's heads are wider
 * than dim / n_heads), big
 * matrices stored as wt.  To keep memory and start-up time sane, every layer
 * shares one random set of layer weights (compute and bytes read per layer
 * are those of the real geometry); the embedding and classifier are
 * distinct.  The 8B geometry in BF16 takes about 2.5 GB. */
kv_status kv_model_synthetic(const char *name, uint64_t seed, kv_dtype wt, kv_model **out);
/* The geometry kv_model_synthetic builds for name (dims, heads, layers,
 * vocabulary, RoPE), name "llama-3.1-8b" etc.; KV_E_USAGE for another name. */
kv_status kv_model_geometry(const char *name, kv_model_config *out);
/* Check a configuration's dimensions, heads, vocabulary, epsilon and RoPE
 * (KV_E_DATA or KV_E_UNSUPPORTED with the detail); fills head_dim and
 * rope_dim when they are 0. */
kv_status kv_model_config_check(kv_model_config *c);
void kv_model_close(kv_model *m);

/* The GGUF metadata of a GGUF model (for the vocabulary), else NULL. */
const struct kv_gguf *kv_model_gguf(const kv_model *m);

/* Where the first NaN or infinite weight of m is, in the order a forward
 * pass reads them ("layer 0 attn_norm element 0", "layer 3 w_up row 7,
 * column 2"), written to where (n); false if every weight is finite.  It
 * reads every weight: for the message of an engine that found non-finite
 * activations, not for every run. */
bool kv_model_first_nonfinite(const kv_model *m, char *where, size_t n);
/* KV_E_DATA for activations `what` (e.g. "layer 2: keys") that came out
 * NaN or infinite at position pos, naming the weight they came from or
 * saying that finite weights overflowed; both engines use it. */
kv_status kv_model_nonfinite_fail(const kv_model *m, const char *what, int pos);
/* The cache geometry of the model (no tokens yet; keys roped, interleaved). */
void kv_model_geom(const kv_model *m, kv_geom *g);

/* Total bytes of weights (for reports and the bandwidth bound). */
uint64_t kv_model_weight_bytes(const kv_model *m);

/* inv_freq (head_dim / 2): the RoPE frequency of each rotated pair, with
   Llama-3 frequency scaling or the GGUF rope_freqs divisors applied. */
void kv_model_rope_freqs(const kv_model_config *c, float *inv_freq);

#endif
