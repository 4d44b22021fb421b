/*
 * kv_chat: the prompt formats instruction-tuned models were trained on,
 * built in (no template engine): Llama-3's header/eot format and ChatML
 * (Qwen2 and many others), as llama.cpp's built-in templates write them.
 * A message becomes token ids directly: the template's own special tokens
 * are placed as ids, the text between them is tokenized as one piece (so
 * merges see the same bytes as when llama.cpp tokenizes the whole
 * formatted string), and special tokens inside the user's text count only
 * when asked.  kv-run --chat and kv-bench use this.
 */
#ifndef KV_CHAT_H
#define KV_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "common/kv_status.h"
#include "model/kv_tokenizer.h"

typedef enum { KV_CHAT_NONE = 0, KV_CHAT_LLAMA3, KV_CHAT_CHATML, KV_CHAT_AUTO } kv_chat_kind;

/* "none", "llama3", "chatml" or "auto"; KV_E_USAGE otherwise. */
kv_status kv_chat_parse(const char *name, kv_chat_kind *out);
const char *kv_chat_name(kv_chat_kind k);

/* The template for a vocabulary: its file's tokenizer.chat_template if it
 * is recognisably one of the two, else the vocabulary's own header tokens,
 * else the architecture (qwen2: ChatML).  arch may be NULL (the
 * tokenizer's file's general.architecture is used).  KV_E_UNSUPPORTED
 * with a message when none fits. */
kv_status kv_chat_pick(const kv_tokenizer *t, const char *arch, kv_chat_kind *out);
/* The same choice from its inputs: the template text (or NULL), the
 * architecture (or NULL) and which header tokens the vocabulary has. */
kv_status kv_chat_pick_from(const char *tpl, const char *arch, bool has_llama3_tokens, bool has_chatml_tokens,
                            kv_chat_kind *out);

/* Token ids of one user turn (after an optional system turn, system may be
 * NULL) followed by the assistant header, with BOS as the file says.
 * special: recognise control tokens written in the texts. */
kv_status kv_chat_encode(const kv_tokenizer *t, kv_chat_kind k, const char *system, const char *user,
                         size_t user_len, bool special, int **ids, int *n);

#endif
