/*
 * kv_unicode: strict UTF-8, and Python's lower(), isspace(), \w and \d
 * over the generated tables (see kv_unicode.h).
 */
#include "eval/kv_unicode.h"

#include <stdlib.h>
#include <string.h>

// --- UTF-8 ------------------------------------------------------------------

/* One code point at s[*i] (advancing *i), or -1 when the bytes there are
 * not strict UTF-8. */
static long utf8_next(const unsigned char *s, size_t n, size_t *i)
{
    unsigned b = s[*i];
    if (b < 0x80) {
        (*i)++;
        return b;
    }
    int len;
    uint32_t c, min;
    if (b >= 0xC2 && b <= 0xDF) len = 2, c = b & 0x1F, min = 0x80;
    else if (b >= 0xE0 && b <= 0xEF) len = 3, c = b & 0x0F, min = 0x800;
    else if (b >= 0xF0 && b <= 0xF4) len = 4, c = b & 0x07, min = 0x10000;
    else return -1;
    if (*i + (size_t)len > n) return -1;
    for (int k = 1; k < len; k++) {
        unsigned x = s[*i + (size_t)k];
        if ((x & 0xC0) != 0x80) return -1;
        c = (c << 6) | (x & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return -1;
    *i += (size_t)len;
    return (long)c;
}

kv_status kv_utf8_decode(const char *s, size_t n, kv_ustr *out)
{
    out->c = malloc((n ? n : 1) * sizeof(uint32_t));
    out->n = 0;
    if (!out->c) return kv_fail(KV_E_NOMEM, "text of %zu bytes", n);
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t at = i;
        long c = utf8_next(u, n, &i);
        if (c < 0) {
            kv_ustr_free(out);
            return kv_fail(KV_E_DATA, "invalid UTF-8 at byte %zu", at);
        }
        out->c[out->n++] = (uint32_t)c;
    }
    return KV_OK;
}

bool kv_utf8_valid(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;)
        if (utf8_next(u, n, &i) < 0) return false;
    return true;
}

/* How many bytes from s[i] form the longest prefix of a well-formed
 * sequence (at least 1): the "maximal subpart" replaced by one U+FFFD. */
static size_t maximal_subpart(const unsigned char *s, size_t n, size_t i)
{
    unsigned b = s[i];
    int need;
    unsigned lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) need = 1;
    else if (b == 0xE0) need = 2, lo = 0xA0;
    else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) need = 2;
    else if (b == 0xED) need = 2, hi = 0x9F;
    else if (b == 0xF0) need = 3, lo = 0x90;
    else if (b >= 0xF1 && b <= 0xF3) need = 3;
    else if (b == 0xF4) need = 3, hi = 0x8F;
    else return 1;
    size_t k = 1;
    for (int q = 0; q < need && i + k < n; q++, k++) {
        unsigned x = s[i + k];
        if (x < (q == 0 ? lo : 0x80) || x > (q == 0 ? hi : 0xBF)) break;
    }
    return k;
}

kv_status kv_utf8_sanitize(const char *s, size_t n, char **out, size_t *len)
{
    char *b = malloc(3 * n + 1);
    if (!b) return kv_fail(KV_E_NOMEM, "text of %zu bytes", n);
    const unsigned char *u = (const unsigned char *)s;
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        size_t at = i;
        if (utf8_next(u, n, &i) >= 0) {
            memcpy(b + k, s + at, i - at);
            k += i - at;
        } else {
            i = at + maximal_subpart(u, n, at);
            k += (size_t)kv_utf8_put(0xFFFD, b + k);
        }
    }
    b[k] = 0;
    *out = b;
    if (len) *len = k;
    return KV_OK;
}

int kv_utf8_put(uint32_t c, char *buf)
{
    unsigned char *b = (unsigned char *)buf;
    if (c < 0x80) {
        b[0] = (unsigned char)c;
        return 1;
    }
    if (c < 0x800) {
        b[0] = (unsigned char)(0xC0 | (c >> 6));
        b[1] = (unsigned char)(0x80 | (c & 0x3F));
        return 2;
    }
    if (c < 0x10000) {
        b[0] = (unsigned char)(0xE0 | (c >> 12));
        b[1] = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
        b[2] = (unsigned char)(0x80 | (c & 0x3F));
        return 3;
    }
    b[0] = (unsigned char)(0xF0 | (c >> 18));
    b[1] = (unsigned char)(0x80 | ((c >> 12) & 0x3F));
    b[2] = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
    b[3] = (unsigned char)(0x80 | (c & 0x3F));
    return 4;
}

kv_status kv_utf8_encode(const uint32_t *c, size_t n, char **out, size_t *len)
{
    char *b = malloc(4 * n + 1);
    if (!b) return kv_fail(KV_E_NOMEM, "text of %zu characters", n);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += (size_t)kv_utf8_put(c[i], b + k);
    b[k] = 0;
    *out = b;
    if (len) *len = k;
    return KV_OK;
}

void kv_ustr_free(kv_ustr *s)
{
    free(s->c);
    s->c = NULL;
    s->n = 0;
}

// --- properties ---------------------------------------------------------------

static bool in_ranges(const kv_uc_range *r, int n, uint32_t c)
{
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (c < r[mid].lo) hi = mid - 1;
        else if (c > r[mid].hi) lo = mid + 1;
        else return true;
    }
    return false;
}

bool kv_uc_isspace(uint32_t c)
{
    if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
    return in_ranges(kv_uc_space, kv_uc_space_n, c);
}

bool kv_uc_isword(uint32_t c)
{
    if (c < 0x80)
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    return in_ranges(kv_uc_word, kv_uc_word_n, c);
}

bool kv_uc_isdecimal(uint32_t c)
{
    if (c < 0x80) return c >= '0' && c <= '9';
    return in_ranges(kv_uc_decimal, kv_uc_decimal_n, c);
}

static uint32_t lower1(uint32_t c)
{
    if (c < 0x80) return c >= 'A' && c <= 'Z' ? c + 32 : c;
    int lo = 0, hi = kv_uc_lower_map_n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (c < kv_uc_lower_map[mid].from) hi = mid - 1;
        else if (c > kv_uc_lower_map[mid].from) lo = mid + 1;
        else return kv_uc_lower_map[mid].to;
    }
    return c;
}

static bool ignorable(uint32_t c) { return in_ranges(kv_uc_ignorable, kv_uc_ignorable_n, c); }
static bool cased(uint32_t c) { return in_ranges(kv_uc_cased, kv_uc_cased_n, c); }

/* Final_Sigma: a cased letter before (past case-ignorables) and none after. */
static bool final_sigma(const uint32_t *s, size_t n, size_t i)
{
    size_t j = i;
    while (j > 0 && ignorable(s[j - 1])) j--;
    if (j == 0 || !cased(s[j - 1])) return false;
    for (j = i + 1; j < n && ignorable(s[j]); j++) {}
    return j == n || !cased(s[j]);
}

size_t kv_uc_lower(const uint32_t *in, size_t n, uint32_t *out)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t c = in[i];
        if (c == 0x130) { /* LATIN CAPITAL LETTER I WITH DOT ABOVE */
            out[k++] = 'i';
            out[k++] = 0x307;
        } else if (c == 0x3A3) {
            out[k++] = final_sigma(in, n, i) ? 0x3C2 : 0x3C3;
        } else {
            out[k++] = lower1(c);
        }
    }
    return k;
}

kv_status kv_ustr_lower(const kv_ustr *in, kv_ustr *out)
{
    out->c = malloc((2 * in->n + 1) * sizeof(uint32_t));
    if (!out->c) return kv_fail(KV_E_NOMEM, "lower case of %zu characters", in->n);
    out->n = kv_uc_lower(in->c, in->n, out->c);
    return KV_OK;
}
