/*
 * kv_prompt_lines: one prompt per line (see kv_prompt_lines.h).
 */
#include "model/kv_prompt_lines.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

void kv_prompt_lines_free(char **lines, int n)
{
    for (int i = 0; lines && i < n; i++) free(lines[i]);
    free(lines);
}

kv_status kv_prompt_lines(const char *buf, size_t len, char ***lines, int *n)
{
    *lines = NULL;
    *n = 0;
    char **out = NULL;
    int cnt = 0, cap = 0;
    size_t line_no = 1;
    for (size_t i = 0; i < len;) {
        size_t j = i;
        while (j < len && buf[j] != '\n') {
            if (buf[j] == '\0') {
                kv_prompt_lines_free(out, cnt);
                return kv_fail(KV_E_DATA, "line %zu holds a NUL byte: prompts are text", line_no);
            }
            j++;
        }
        size_t e = j;
        if (e > i && buf[e - 1] == '\r') e--;
        bool blank = true;
        for (size_t k = i; k < e && blank; k++) blank = buf[k] == ' ' || buf[k] == '\t';
        if (!blank) {
            if (cnt == cap) {
                if (cap > (1 << 24)) {
                    kv_prompt_lines_free(out, cnt);
                    return kv_fail(KV_E_DATA, "more than %d prompts", cap);
                }
                int nc = cap ? 2 * cap : 16;
                char **t = realloc(out, (size_t)nc * sizeof *t);
                if (!t) {
                    kv_prompt_lines_free(out, cnt);
                    return kv_fail(KV_E_NOMEM, "out of memory");
                }
                out = t, cap = nc;
            }
            char *s = malloc(e - i + 1);
            if (!s) {
                kv_prompt_lines_free(out, cnt);
                return kv_fail(KV_E_NOMEM, "out of memory");
            }
            memcpy(s, buf + i, e - i);
            s[e - i] = '\0';
            out[cnt++] = s;
        }
        i = j + 1;
        line_no++;
    }
    *lines = out;
    *n = cnt;
    return KV_OK;
}
