/*
 * The tokenizer's private state, shared by kv_tokenizer.c (vocabulary,
 * SentencePiece and llama2.c merging, special-token partitioning) and
 * kv_bpe.c (byte-level BPE: pre-tokenizers and ranked merges).  Internal to
 * lib/model.
 */
#ifndef KV_TOKENIZER_INT_H
#define KV_TOKENIZER_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_status.h"
#include "model/kv_tokenizer.h"

/* GGUF tokenizer.ggml.token_type values */
enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER = 4, TT_UNUSED = 5, TT_BYTE = 6 };
typedef enum { TK_LLAMA2C, TK_SPM, TK_BPE, TK_OTHER } tok_kind;

/* BPE pre-tokenizers (llama.cpp's choice by tokenizer.ggml.pre) */
typedef enum {
    PRE_DEFAULT, /* four passes: punctuation runs, GPT-2, digit runs, digit triples */
    PRE_GPT2,    /* GPT-2's pattern */
    PRE_LLAMA3,  /* Llama-3's pattern: digits in groups of up to 3 */
    PRE_QWEN2,   /* Llama-3's pattern with single digits */
} pre_kind;

typedef struct {
    uint64_t key;   /* left id << 32 | right id; UINT64_MAX empty */
    int32_t rank;
    int32_t id;     /* the merged token */
} merge_slot;

struct kv_tokenizer {
    tok_kind kind;
    char kind_name[32];
    char pre_name[32];  /* tokenizer.ggml.pre as given ("" if absent) */
    int n;              /* vocabulary size */
    char *blob;         /* pieces, each NUL-terminated */
    uint32_t *off;      /* (n) piece offsets into blob */
    uint32_t *len;      /* (n) piece lengths */
    float *score;       /* (n) */
    uint8_t *type;      /* (n) TT_* */
    char *dblob;        /* decoded pieces, NUL-terminated */
    uint32_t *doff, *dlen; /* (n) */
    int32_t *slots;     /* hash table of ids, -1 empty; size nslots (power of two) */
    uint32_t nslots;
    uint32_t max_piece; /* longest piece in bytes */
    int byte_id[256];   /* id of <0xHH>, or -1 */
    int bos, eos, unk;
    bool add_space_prefix;
    bool add_bos, add_eos; /* what a plain encode adds (GGUF add_bos_token/add_eos_token) */
    int32_t *special;   /* (n_special) control/user-defined/unknown ids, longest text first */
    int n_special;
    char *chat_template; /* tokenizer.chat_template, or NULL */
    char arch[32];       /* general.architecture of the file, "" if none */
    /* BPE */
    pre_kind pre;
    bool ignore_merges;  /* a pre-token that is itself a token is not merged */
    int byte_tok[256];   /* token of each byte's GPT-2 code point, or -1 */
    merge_slot *merges;  /* open addressing, nmslots (power of two) */
    uint32_t nmslots;
    int n_merges;
};

/* Id of piece s (n bytes), or -1. */
int kv_tok_lookup(const kv_tokenizer *t, const char *s, size_t n);

/* A growable id list. */
typedef struct {
    int *v;
    size_t n, cap;
} kv_idvec;
bool kv_idvec_push(kv_idvec *v, int id);

/* kv_bpe.c: load the merges and pre-tokenizer of a GGUF "gpt2" vocabulary
 * (after the pieces), and encode one fragment of text (no special tokens). */
struct kv_gguf;
kv_status kv_bpe_load(kv_tokenizer *t, const struct kv_gguf *g);
kv_status kv_bpe_encode(const kv_tokenizer *t, const char *text, size_t len, kv_idvec *out);
/* The bytes a BPE NORMAL piece stands for (GPT-2 code points mapped back);
 * writes at most n bytes into out, returns the length. */
size_t kv_bpe_piece_bytes(const char *piece, size_t n, char *out);

#endif
