/*
 * kv_chat: the prompt formats instruction-tuned models were trained on,
 * built in (no template engine): Llama-3's header/eot format and ChatML
 * (Qwen2 and many others), as llama.cpp's built-in templates write them.
 * A message becomes token ids directly: the template's own special tokens
 * are placed as ids, the text between them is tokenized as one piece (so
 * merges see the same bytes as when llama.cpp tokenizes the whole
 * formatted string), and special tokens inside the user's text count only
 * when asked.  A template of one's own ("[INST]{prompt}[/INST]", the form
 * LongBench's pred.py writes) is the third kind: the user's text in place
 * of {prompt}, the whole tokenized as one text.  kv-run --chat and
 * kv-bench longbench --chat use this, and nothing else wraps prompts.
 */
#ifndef KV_CHAT_H
#define KV_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "common/kv_status.h"
#include "model/kv_tokenizer.h"

typedef enum {
    KV_CHAT_NONE = 0,
    KV_CHAT_LLAMA3,
    KV_CHAT_CHATML,
    KV_CHAT_AUTO,    /* one of the two, picked for the vocabulary (kv_chat_pick) */
    KV_CHAT_TEMPLATE /* a text holding "{prompt}" */
} kv_chat_kind;

typedef struct {
    kv_chat_kind kind;
    const char *tmpl; /* KV_CHAT_TEMPLATE: the text, "{prompt}" in it (borrowed) */
} kv_chat;

/* "none", "llama3", "chatml", "auto", or a template: any text holding
 * "{prompt}" (its first "{prompt}" takes the user's text); KV_E_USAGE
 * otherwise.  out->tmpl borrows spec. */
kv_status kv_chat_parse(const char *spec, kv_chat *out);
/* "none", "llama3", "chatml", "auto", "template". */
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

/* Resolve KV_CHAT_AUTO in c to the kind kv_chat_pick(t, arch) gives (any
 * other kind is left as it is). */
kv_status kv_chat_resolve(kv_chat *c, const kv_tokenizer *t, const char *arch);

/* Token ids of one user turn (after an optional system turn, system may be
 * NULL) followed by the assistant header, with BOS as the file says; AUTO
 * picks by the vocabulary alone.  A template takes no system text
 * (KV_E_USAGE).  special: recognise control tokens written in the texts. */
kv_status kv_chat_encode(const kv_tokenizer *t, const kv_chat *c, const char *system, const char *user,
                         size_t user_len, bool special, int **ids, int *n);

/* Where a prompt's dense part ends when its first off bytes of user text
 * are the context (LongBench's question mode): the ids of the turn cut
 * after user[0..off), counted while they agree with ids (n, the whole
 * turn from kv_chat_encode), at least 1. */
kv_status kv_chat_split(const kv_tokenizer *t, const kv_chat *c, const char *system, const char *user,
                        size_t off, bool special, const int *ids, int n, int *split);

#endif
