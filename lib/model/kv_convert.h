/*
 * kv_convert: write GGUF files - a loaded model (llama2.c checkpoint, GGUF,
 * synthetic) with its vocabulary, its matrices converted to one weight type
 * through kv_quants' quantizer; or a vocabulary-only file built from a
 * Hugging Face tokenizer.json.  The metadata follows what llama.cpp reads
 * for the llama and qwen2 architectures, so llama.cpp loading these files
 * and agreeing with kv-run checks both sides of the format.
 */
#ifndef KV_CONVERT_H
#define KV_CONVERT_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kv_status.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"

typedef struct {
    uint32_t wtype;       /* ggml type of the 2-D matrices (KV_GGML_F16 by default) */
    int32_t embd_type;    /* ggml type of token_embd/output; -1: wtype */
    const char *arch;     /* "llama" (default) or "qwen2" (q/k rows written in NEOX order) */
    const char *name;     /* general.name; NULL: the model's */
    uint64_t bias_seed;   /* nonzero: add seeded random q/k/v biases (test fixtures) */
    double rope_theta;    /* > 0: write this RoPE base instead of the model's */
    bool rope_llama3;     /* write rope_freqs.weight by Llama-3.1's frequency rule */
    double rope_factor, rope_low, rope_high; /* its parameters (8, 1, 4) */
    int rope_orig_ctx;                       /* (8192) */
    const char *chat_template; /* tokenizer.chat_template text, or NULL */
} kv_convert_opts;

void kv_convert_opts_default(kv_convert_opts *o);

typedef struct {
    int n_tensors;
    int n_fallback;        /* matrices written in another type (row length) */
    char fallback[256];    /* the first of them, "blk.0.ffn_down.weight: F16" */
    uint64_t bytes;        /* tensor data bytes */
} kv_convert_report;

/* Write m as a GGUF at path.  vocab: the tokenizer to embed (a llama2.c
 * tokenizer becomes a SentencePiece "llama" vocabulary), or NULL to copy
 * the tokenizer.* metadata of vocab_gguf, or of the model's own GGUF. */
kv_status kv_convert_model(const kv_model *m, const kv_tokenizer *vocab, const struct kv_gguf *vocab_gguf,
                           const kv_convert_opts *o, const char *path, kv_convert_report *rep);

typedef struct {
    const char *pre;           /* tokenizer.ggml.pre ("llama-bpe") */
    const char *bos, *eos;     /* their texts, or NULL */
    const char *chat_template; /* or NULL */
} kv_vocab_opts;

/* A vocabulary-only GGUF (general.architecture llama, Llama-3-8B's
 * geometry in the llama.* keys, no tensors) from a tokenizer.json with a
 * BPE model: model.vocab, model.merges ("a b" or ["a", "b"]), added_tokens
 * (special ones become control tokens, the others user-defined). */
kv_status kv_convert_hf_vocab(const char *json_path, const kv_vocab_opts *o, const char *path,
                              int *n_tokens);

#endif
