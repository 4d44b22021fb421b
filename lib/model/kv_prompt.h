/*
 * kv_prompt: what a front end needs to turn its inputs into a prompt: the
 * tokenizer that goes with a model (given, the GGUF's own, or the one
 * beside a llama2.c checkpoint) and the prompt's token ids from text,
 * from a token-id list, or seeded at random for benchmarks.
 */
#ifndef KV_PROMPT_H
#define KV_PROMPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/kv_status.h"
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

/* Where a prompt comes from: at most one of the three is set; none is a
 * prompt of BOS alone. */
typedef struct {
    const char *text;    /* encoded after BOS (needs a tokenizer that encodes) */
    size_t text_len;
    const char *ids;     /* token ids as text (kv_tokens_parse): used as they are */
    size_t ids_len;
    int random;          /* > 0: BOS and random - 1 seeded ids (benchmarks) */
    uint64_t seed;
    bool continuation;   /* text continues a cached prompt (kv-run --kv): no BOS */
} kv_prompt;

/*
 * The prompt's token ids into *ids (malloc'd), *n of them.  tok may be NULL
 * (BOS is then 1); text without a tokenizer is KV_E_NOINPUT, text a
 * vocabulary cannot encode KV_E_UNSUPPORTED, both with a message naming
 * --tokens.  Ids outside vocab are KV_E_DATA.
 */
kv_status kv_prompt_tokens(const kv_prompt *p, const kv_tokenizer *tok, int vocab, int **ids, int *n);

#endif
