/*
 * kv_tokens: token-id lists as the tools take them (kv_tokens.h).
 */
#include "common/kv_tokens.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

kv_status kv_tokens_parse(const char *text, size_t len, int **ids, int *n_out)
{
    *ids = NULL;
    *n_out = 0;
    size_t i = 0;
    while (i < len && isspace((unsigned char)text[i])) i++;
    int *res = NULL;
    int n = 0;
    if (i < len && text[i] == '[') {
        cJSON *j = cJSON_ParseWithLength(text, len);
        if (!j || !cJSON_IsArray(j)) {
            cJSON_Delete(j);
            return kv_fail(KV_E_DATA, "token list is not a valid JSON array of integers");
        }
        int cnt = cJSON_GetArraySize(j);
        res = malloc((size_t)(cnt ? cnt : 1) * sizeof *res);
        if (!res) {
            cJSON_Delete(j);
            return kv_fail(KV_E_NOMEM, "out of memory");
        }
        const cJSON *e;
        cJSON_ArrayForEach(e, j)
        {
            double v = cJSON_IsNumber(e) ? e->valuedouble : -1;
            if (!cJSON_IsNumber(e) || v < 0 || v > 2147483647.0 || v != (double)(int)v) {
                free(res);
                cJSON_Delete(j);
                return kv_fail(KV_E_DATA, "token list element %d is not a non-negative integer", n);
            }
            res[n++] = (int)v;
        }
        cJSON_Delete(j);
    } else {
        size_t cap = 64;
        res = malloc(cap * sizeof *res);
        while (res && i < len) {
            char num[16];
            size_t k = 0;
            while (i < len && !isspace((unsigned char)text[i]) && k < sizeof num - 1) num[k++] = text[i++];
            num[k] = 0;
            char *end;
            errno = 0;
            long v = strtol(num, &end, 10);
            if (k == 0 || *end || errno || v < 0 || v > 2147483647L ||
                (i < len && !isspace((unsigned char)text[i]))) {
                free(res);
                return kv_fail(KV_E_DATA, "token list: '%s' is not a non-negative integer", num);
            }
            if ((size_t)n == cap) {
                int *nr = realloc(res, 2 * cap * sizeof *res);
                if (!nr) {
                    free(res);
                    res = NULL;
                    break;
                }
                res = nr;
                cap *= 2;
            }
            res[n++] = (int)v;
            while (i < len && isspace((unsigned char)text[i])) i++;
        }
        if (!res) return kv_fail(KV_E_NOMEM, "out of memory");
    }
    if (n == 0) {
        free(res);
        return kv_fail(KV_E_DATA, "token list is empty");
    }
    *ids = res;
    *n_out = n;
    return KV_OK;
}

kv_status kv_tokens_json(const int *ids, int n, char **json)
{
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
    *json = a ? cJSON_PrintUnformatted(a) : NULL;
    cJSON_Delete(a);
    return *json ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory for %d token ids", n);
}
