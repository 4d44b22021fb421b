/*
 * kv_tokenizer: text <-> token ids for the vocabularies kv-run can encode:
 * llama2.c's tokenizer.bin (score-driven merges, a dummy-prefix space, byte
 * fallback to <0xHH> pieces), the SentencePiece "llama" vocabulary stored
 * in GGUF metadata (space -> U+2581, a leading U+2581, bigram merges by
 * score, byte fallback), and GGUF "gpt2" byte-level BPE vocabularies
 * (Llama-3, Qwen2: a pre-tokenizer chosen by tokenizer.ggml.pre, then
 * ranked merges over GPT-2's byte alphabet; kv_bpe.c).  SentencePiece and
 * llama2.c share one merge engine: start from UTF-8 characters and
 * repeatedly merge the adjacent pair whose concatenation is the
 * highest-scoring vocabulary piece (leftmost on ties).  Special tokens
 * (<|eot_id|>, <s>) are recognised in text only when asked; user-defined
 * tokens always, as llama.cpp does.  Other GGUF vocabularies (WordPiece,
 * ...) load for decoding only; encoding them is KV_E_UNSUPPORTED and
 * callers take token ids instead (kv_tokens_parse).
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

/* The vocabulary of a GGUF file (a model or a vocabulary-only file). */
kv_status kv_tokenizer_load_gguf(const char *path, kv_tokenizer **out);

/* Can this vocabulary encode text?  If not, why not (for the message). */
bool kv_tokenizer_can_encode(const kv_tokenizer *t, const char **why);
/* Encode len bytes of text: *ids (malloc'd, caller frees), *n tokens.
 * bos/eos: add the model's BOS/EOS ids around the text. */
kv_status kv_tokenizer_encode(const kv_tokenizer *t, const char *text, size_t len, bool bos,
                              bool eos, int **ids, int *n);
typedef struct {
    bool bos, eos;  /* add BOS / EOS around the text */
    bool special;   /* recognise control tokens (<|eot_id|>, <s>) written in the text */
} kv_encode_opts;
kv_status kv_tokenizer_encode_ex(const kv_tokenizer *t, const char *text, size_t len,
                                 const kv_encode_opts *o, int **ids, int *n);
/* What the file says a plain encode adds (GGUF add_bos_token/add_eos_token,
 * llama.cpp's defaults when absent). */
bool kv_tokenizer_add_bos(const kv_tokenizer *t);
bool kv_tokenizer_add_eos(const kv_tokenizer *t);
/* Does token id end a turn or the text (EOS, <|eot_id|>, <|im_end|>...)? */
bool kv_tokenizer_is_eog(const kv_tokenizer *t, int id);

/* Bytes of token tok when it follows prev (strips the leading space after
 * BOS as llama2.c does; <0xHH> pieces become their byte); len set. */
const char *kv_tokenizer_decode(const kv_tokenizer *t, int prev, int tok, size_t *len);

int kv_tokenizer_vocab(const kv_tokenizer *t);
int kv_tokenizer_bos(const kv_tokenizer *t);
int kv_tokenizer_eos(const kv_tokenizer *t);
const char *kv_tokenizer_kind(const kv_tokenizer *t); /* "llama2c", "spm", "gpt2", ... */
const char *kv_tokenizer_pre(const kv_tokenizer *t);  /* tokenizer.ggml.pre, "" if none */
/* tokenizer.chat_template and general.architecture of the file (NULL / ""). */
const char *kv_tokenizer_chat_template(const kv_tokenizer *t);
const char *kv_tokenizer_arch(const kv_tokenizer *t);
/* Piece id as stored (NULL past the vocabulary), its score and GGUF token
 * type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte). */
const char *kv_tokenizer_piece(const kv_tokenizer *t, int id, size_t *len);
float kv_tokenizer_score(const kv_tokenizer *t, int id);
int kv_tokenizer_token_type(const kv_tokenizer *t, int id);
/* Id of a piece given as text ("<|eot_id|>"), or -1. */
int kv_tokenizer_piece_id(const kv_tokenizer *t, const char *piece);


#endif
