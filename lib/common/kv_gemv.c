/*
 * kv_gemv: the packed GEMV variants' names (see kv_gemv.h).
 */
#include "common/kv_gemv.h"

#include <stdio.h>
#include <string.h>

#define KV_GEMV_NAME_(e, s) s,
static const char *const names[KV_GEMV_COUNT] = {KV_GEMV_VARIANTS(KV_GEMV_NAME_)};

const char *kv_gemv_variant_name(int v) { return v >= 0 && v < KV_GEMV_COUNT ? names[v] : NULL; }

kv_status kv_gemv_variant_parse(const char *s, bool packed_only, int *out)
{
    const int first = packed_only ? KV_GEMV_OLD : KV_GEMV_DEFAULT;
    for (int v = first; s && v < KV_GEMV_COUNT; v++)
        if (!strcmp(s, names[v])) {
            *out = v;
            return KV_OK;
        }
    char list[128] = "";
    for (int v = first; v < KV_GEMV_COUNT; v++) /* "a, b, c or d" */
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s",
                 v == first ? "" : v + 1 < KV_GEMV_COUNT ? ", " : " or ", names[v]);
    return kv_fail(KV_E_USAGE, "'%.40s' is not %s", s ? s : "(null)", list);
}
