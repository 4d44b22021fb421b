/*
 * kv_tokenizer: text <-> token ids for the vocabularies kv-run can encode:
 * llama2.c's tokenizer.bin (score-driven merges, a dummy-prefix space, byte
 * fallback to <0xHH> pieces) and the SentencePiece "llama" vocabulary stored
 * in GGUF metadata (space -> U+2581, a leading U+2581, bigram merges by
 * score, byte fallback).  Both share one merge engine: start from UTF-8
 * characters and repeatedly merge the adjacent pair whose concatenation is
 * the highest-scoring vocabulary piece (leftmost on ties).  Other GGUF
 * vocabularies (BPE, WordPiece, ...) load for decoding only; encoding them
 * is KV_E_UNSUPPORTED and callers take token ids instead (kv_tokens_parse).
 */
#ifndef KV_TOKENIZER_H
#define KV_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>

#include "common/kv_status.h"
#include "common/kv_tokens.h" /* kv_tokens_parse, for the tokenizer's callers */

struct kv_gguf;
typedef struct kv_tokenizer kv_tokenizer;

/* llama2.c tokenizer.bin for a model of vocab_size tokens. */
kv_status kv_tokenizer_load_llama2c(const char *path, int vocab_size, kv_tokenizer **out);
kv_status kv_tokenizer_load_llama2c_mem(const void *buf, size_t len, int vocab_size,
                                        kv_tokenizer **out);
/* The vocabulary in a GGUF file's tokenizer.ggml.* metadata. */
kv_status kv_tokenizer_from_gguf(const struct kv_gguf *g, kv_tokenizer **out);
void kv_tokenizer_free(kv_tokenizer *t);

/* Can this vocabulary encode text?  If not, why not (for the message). */
bool kv_tokenizer_can_encode(const kv_tokenizer *t, const char **why);
/* Encode len bytes of text: *ids (malloc'd, caller frees), *n tokens.
 * bos/eos: add the model's BOS/EOS ids around the text. */
kv_status kv_tokenizer_encode(const kv_tokenizer *t, const char *text, size_t len, bool bos,
                              bool eos, int **ids, int *n);
/* Bytes of token tok when it follows prev (strips the leading space after
 * BOS as llama2.c does; <0xHH> pieces become their byte); len set. */
const char *kv_tokenizer_decode(const kv_tokenizer *t, int prev, int tok, size_t *len);

int kv_tokenizer_vocab(const kv_tokenizer *t);
int kv_tokenizer_bos(const kv_tokenizer *t);
int kv_tokenizer_eos(const kv_tokenizer *t);
const char *kv_tokenizer_kind(const kv_tokenizer *t); /* "llama2c", "spm", "gpt2", ... */


#endif
