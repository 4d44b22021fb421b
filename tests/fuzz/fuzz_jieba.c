/*
 * libFuzzer target for the jieba data readers and the segmenter
 * (lib/eval/kv_jieba.c).  The input is up to four parts separated by NUL
 * bytes: dict.txt, prob_start.py, prob_trans.py, prob_emit.py.  Each
 * reader accepts or fails with KV_E_DATA; with data loaded, cutting any
 * text (the input itself included) gives spans that cover it in order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eval/kv_jieba.h"
#include "eval/kv_unicode.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_cut(const kv_jieba *j, const char *s, size_t n)
{
    kv_ustr u;
    if (kv_utf8_decode(s, n, &u)) return;
    kv_span *t;
    size_t nt;
    kv_status st = kv_jieba_cut(j, u.c, u.n, &t, &nt);
    if (st == KV_OK) {
        size_t at = 0;
        for (size_t i = 0; i < nt; i++) {
            if (t[i].start != at || t[i].len == 0) abort();
            at += t[i].len;
        }
        if (at != u.n) abort();
        free(t);
    } else if (st != KV_E_DATA) {
        abort();
    }
    kv_ustr_free(&u);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *part[4] = {"", "", "", ""};
    size_t len[4] = {0};
    const char *s = (const char *)data, *end = s + size;
    for (int k = 0; k < 4 && s <= end; k++) {
        const char *z = memchr(s, 0, (size_t)(end - s));
        part[k] = s;
        len[k] = z ? (size_t)(z - s) : (size_t)(end - s);
        s += len[k] + 1;
    }
    kv_jieba *j;
    if (kv_jieba_new(&j)) return 0;
    kv_status st = kv_jieba_load_dict(j, part[0], len[0], "dict.txt");
    if (st && (st != KV_E_DATA || !kv_errdetail()[0])) abort();
    kv_status sh = kv_jieba_load_hmm(j, part[1], len[1], part[2], len[2], part[3], len[3]);
    if (sh && (sh != KV_E_DATA || !kv_errdetail()[0])) abort();
    if (sh) { /* fall back to tiny valid tables so the dictionary is exercised */
        const char *a = "P={'B': -0.3, 'E': -3.14e+100, 'M': -3.14e+100, 'S': -1.4}";
        const char *b = "P={'B': {'E': -0.5, 'M': -0.9}, 'E': {'B': -0.6, 'S': -0.8}, "
                        "'M': {'E': -0.3, 'M': -1.3}, 'S': {'B': -0.7, 'S': -0.7}}";
        const char *c = "P={'B': {'\\u5c0f': -2}, 'E': {'\\u660e': -2.5}, 'M': {}, 'S': {'\\u6765': -2}}";
        if (kv_jieba_load_hmm(j, a, strlen(a), b, strlen(b), c, strlen(c))) abort();
    }
    if (!st) {
        check_cut(j, part[0], len[0]);
        const char *t = "我爱北京天安门，小明来了 C++ 3.14% ab\r\n好";
        check_cut(j, t, strlen(t));
    }
    kv_jieba_free(j);
    return 0;
}
