/*
 * kv_text: the growable string of kv_text.h.
 */
#include "common/kv_text.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

kv_status kv_text_add(kv_text *t, const char *p, size_t n, const char *what)
{
    if (n > SIZE_MAX / 2 - t->n - 1) return kv_fail(KV_E_NOMEM, "%s", what); /* doubling would wrap */
    if (t->n + n + 1 > t->cap) {
        size_t nc = t->cap ? t->cap : 64;
        while (t->n + n + 1 > nc) nc *= 2;
        char *ns = realloc(t->s, nc);
        if (!ns) return kv_fail(KV_E_NOMEM, "%s", what);
        t->s = ns;
        t->cap = nc;
    }
    memcpy(t->s + t->n, p, n);
    t->n += n;
    t->s[t->n] = 0;
    return KV_OK;
}
