/*
 * kv_jsonl: the JSON-lines iterator and checked JSON conversions (see
 * kv_jsonl.h).
 */
#include "eval/kv_jsonl.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void kv_jsonl_init(kv_jsonl *it, const char *text, size_t len)
{
    it->text = text;
    it->len = len;
    it->pos = 0;
    it->line = 0;
}

bool kv_jsonl_next(kv_jsonl *it, const char **s, size_t *n, bool *partial)
{
    while (it->pos < it->len) {
        const char *t = it->text;
        const char *nl = memchr(t + it->pos, '\n', it->len - it->pos);
        size_t end = nl ? (size_t)(nl - t) : it->len;
        size_t a = it->pos, b = end;
        it->pos = nl ? end + 1 : it->len;
        it->line++;
        while (a < b && isspace((unsigned char)t[a])) a++;
        while (b > a && isspace((unsigned char)t[b - 1])) b--;
        if (a == b) continue;
        *s = t + a;
        *n = b - a;
        if (partial) *partial = nl == NULL;
        return true;
    }
    return false;
}

bool kv_json_int(const cJSON *v, long long lo, long long hi, long long *out)
{
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    /* compare as doubles first: converting an out-of-range double to an
     * integer is undefined behaviour */
    if (!isfinite(d) || d != floor(d) || d < (double)lo || d > (double)hi) return false;
    long long x = (long long)d;
    if (x < lo || x > hi) return false;
    *out = x;
    return true;
}

char *kv_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

void *kv_grow(void *arr, int n, int *cap, size_t elem, int first)
{
    if (n < *cap) return arr;
    const int nc = *cap ? *cap * 2 : first;
    void *p = realloc(arr, (size_t)nc * elem);
    if (p) *cap = nc;
    return p;
}

void kv_strings_free(char **s, int n)
{
    for (int i = 0; s && i < n; i++) free(s[i]);
    free(s);
}

kv_status kv_json_strings(const cJSON *arr, const char *field, char ***out, int *n)
{
    *out = NULL;
    *n = 0;
    if (!cJSON_IsArray(arr)) return kv_fail(KV_E_DATA, "\"%s\" is not an array", field);
    int k = cJSON_GetArraySize(arr);
    char **v = calloc((size_t)k + 1, sizeof *v);
    if (!v) return kv_fail(KV_E_NOMEM, "%s", field);
    int i = 0;
    for (const cJSON *e = arr->child; e; e = e->next, i++) {
        if (!cJSON_IsString(e)) {
            kv_strings_free(v, i);
            return kv_fail(KV_E_DATA, "%s[%d] is not a string", field, i);
        }
        if (!(v[i] = kv_strdup(e->valuestring))) {
            kv_strings_free(v, i);
            return kv_fail(KV_E_NOMEM, "%s", field);
        }
    }
    *out = v;
    *n = i;
    return KV_OK;
}
