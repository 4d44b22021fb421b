/*
 * kv_text: a growable NUL-terminated string for text built a piece at a
 * time (generated text, a prompt filled from a template).  Its bytes are
 * whatever was added (NUL bytes too); the caller owns and frees t.s.
 */
#ifndef KV_TEXT_H
#define KV_TEXT_H

#include <stddef.h>

#include "common/kv_status.h"

typedef struct {
    char *s;         /* n bytes and a NUL (malloc'd; NULL before the first add) */
    size_t n, cap;   /* bytes held (NUL not counted), bytes allocated */
} kv_text;

/* Append n bytes of p (the capacity doubles, from 64 bytes).  Out of
 * memory is KV_E_NOMEM with detail `what`, and t is as it was. */
kv_status kv_text_add(kv_text *t, const char *p, size_t n, const char *what);

#endif
