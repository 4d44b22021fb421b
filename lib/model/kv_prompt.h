/*
 * kv_prompt: what a front end needs to turn its inputs into a prompt: the
 * tokenizer that goes with a model (given, the GGUF's own, or the one
 * beside a llama2.c checkpoint) and the prompt's token ids from text
 * (plain, or as a chat turn: model/kv_chat), from a token-id list, or
 * seeded at random for benchmarks.
 */
#ifndef KV_PROMPT_H
#define KV_PROMPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/kv_status.h"
#include "model/kv_chat.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"

/*
 * The tokenizer beside a llama2.c checkpoint: tokenizer.bin in its folder,
 * else the first tok*.bin (by name) that loads for vocab_size tokens.
 * None is KV_E_NOINPUT, with a message naming --tokenizer and --tokens.
 */
kv_status kv_tokenizer_find(const char *model_path, int vocab_size, kv_tokenizer **out);

/*
 * A model's tokenizer: the llama2.c tokenizer.bin at path when given, else
 * the GGUF model's own vocabulary, else kv_tokenizer_find beside model_path.
 * A model with no file (model_path NULL: --synthetic) has none:
 * KV_E_NOINPUT.
 */
kv_status kv_tokenizer_for_model(const kv_model *m, const char *model_path, const char *path,
                                 kv_tokenizer **out);

/*
 * The tokenizer of a model file without its weights where it can be had so
 * (kv-run --tokenize): a GGUF's own vocabulary, read from the file alone (a
 * vocabulary-only GGUF works), unless path names a llama2.c tokenizer;
 * otherwise the model is opened for its vocabulary size, and closed, and
 * kv_tokenizer_for_model decides.
 */
kv_status kv_tokenizer_for_file(const char *model_path, const char *path, kv_tokenizer **out);

/*
 * Token tok after prev as written out: kv_tokenizer_decode's bytes, except
 * that a lone unprintable byte (a raw <0xHH> control code) is dropped
 * (*len 0).  kv_tokens_text joins ids[0..n) so (prev precedes ids[0]) into
 * a malloc'd NUL-terminated string: the text a run printed.
 */
const char *kv_token_piece(const kv_tokenizer *t, int prev, int tok, size_t *len);
kv_status kv_tokens_text(const kv_tokenizer *t, int prev, const int *ids, int n, char **text);

/* Writes generated tokens as they come to a stream the caller gives: each
 * token's piece (kv_token_piece), or its id and a space without a
 * tokenizer.  prev: the token before the first (the prompt's last). */
typedef struct {
    const kv_tokenizer *tok; /* may be NULL */
    int prev;
    FILE *out;
} kv_token_writer;
void kv_token_write(kv_token_writer *w, int token);

/* Where a prompt comes from: at most one of text, ids, path and random is
 * set; none is a prompt of BOS alone. */
typedef struct {
    const char *text;    /* encoded with BOS/EOS as the vocabulary's file says
                            (needs a tokenizer that encodes) */
    size_t text_len;
    const char *ids;     /* token ids as text (kv_tokens_parse): used as they are */
    size_t ids_len;
    const char *path;    /* text, or ids when path_ids, read from a file ("-": stdin) */
    bool path_ids;
    int random;          /* > 0: BOS and random - 1 seeded ids (benchmarks) */
    uint64_t seed;
    kv_chat chat;        /* text only: wrapped as one user turn unless KV_CHAT_NONE;
                            AUTO is replaced by its pick (kv_chat_resolve) */
    bool special;        /* text only: control tokens written in it (<|eot_id|>) count */
    bool continuation;   /* text continues a cached prompt (kv-run --kv): no BOS */
} kv_prompt;

/*
 * The prompt's token ids into *ids (malloc'd), *n of them.  tok may be NULL
 * (BOS is then 1); text without a tokenizer is KV_E_NOINPUT, text a
 * vocabulary cannot encode KV_E_UNSUPPORTED, both with a message naming
 * --tokens.  Ids outside vocab are KV_E_DATA.  A path that cannot be read
 * fails as kv_file_slurp does.
 */
kv_status kv_prompt_tokens(kv_prompt *p, const kv_tokenizer *tok, int vocab, int **ids, int *n);

/* kv-run --tokenize: the ids of p with the tokenizer kv_tokenizer_for_file
 * gives, as one JSON array (kv_tokens_json) in *json (malloc'd). */
kv_status kv_prompt_json(const char *model_path, const char *tok_path, kv_prompt *p, char **json);

#endif
