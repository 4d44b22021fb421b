/*
 * kv_tokens: a list of token ids in text, as every tool takes it (--tokens,
 * kv-tree's prefixes): whitespace-separated integers or a JSON array.  It
 * sits in common because the tools read token lists whatever layer they
 * work in (lib/tree takes them without a tokenizer).
 */
#ifndef KV_TOKENS_H
#define KV_TOKENS_H

#include <stddef.h>

#include "common/kv_status.h"

/* Token ids from text: whitespace-separated integers or a JSON array of
 * non-negative integers.  *ids malloc'd; a bad list is KV_E_DATA. */
kv_status kv_tokens_parse(const char *text, size_t len, int **ids, int *n);
/* The inverse: ids (n) as one JSON array on one line ("[1,2,3]"), which
 * kv_tokens_parse reads back.  *json malloc'd. */
kv_status kv_tokens_json(const int *ids, int n, char **json);

#endif
