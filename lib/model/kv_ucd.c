/*
 * kv_ucd: code point classes by binary search over the generated range
 * table, White_Space from its list, and a byte-preserving UTF-8 decoder
 * (see kv_ucd.h).  Well-formed means: a lead byte followed by the right
 * number of continuation bytes, no overlong form, no surrogate, at most
 * U+10FFFF; anything else is taken one raw byte at a time.
 */
#include "model/kv_ucd.h"

#include "model/kv_ucd_table.h"

int kv_ucd_class(uint32_t cp)
{
    if (cp >= 0x110000) return KV_UC_UNASSIGNED;
    size_t lo = 0, hi = sizeof kv_ucd_ranges / sizeof *kv_ucd_ranges;
    while (hi - lo > 1) { /* the last range starting at or before cp */
        size_t mid = (lo + hi) / 2;
        if (kv_ucd_ranges[mid].start <= cp) lo = mid;
        else hi = mid;
    }
    return kv_ucd_ranges[lo].cls;
}

bool kv_ucd_is_space(uint32_t cp)
{
    if (cp > 0x3000) return false;
    for (size_t i = 0; i < sizeof kv_ucd_white_space / sizeof *kv_ucd_white_space; i++)
        if (kv_ucd_white_space[i] == cp) return true;
    return false;
}

const char *kv_ucd_version(void) { return KV_UCD_VERSION; }

size_t kv_ucd_decode(const char *str, size_t n, uint32_t *cps, size_t *ncp)
{
    const uint8_t *s = (const uint8_t *)str;
    size_t i = 0, k = 0, raw = 0;
    while (i < n) {
        uint8_t c = s[i];
        uint32_t cp = 0;
        size_t len = 0;
        if (c < 0x80) cp = c, len = 1;
        else if ((c & 0xE0) == 0xC0) cp = c & 0x1F, len = 2;
        else if ((c & 0xF0) == 0xE0) cp = c & 0x0F, len = 3;
        else if ((c & 0xF8) == 0xF0) cp = c & 0x07, len = 4;
        bool ok = len > 0 && i + len <= n;
        for (size_t j = 1; ok && j < len; j++) {
            if ((s[i + j] & 0xC0) != 0x80) ok = false;
            else cp = cp << 6 | (s[i + j] & 0x3F);
        }
        if (ok && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
                   (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF))
            ok = false;
        if (!ok) {
            cps[k++] = KV_UC_RAW + c;
            raw++;
            i++;
            continue;
        }
        cps[k++] = cp;
        i += len;
    }
    *ncp = k;
    return raw;
}

int kv_ucd_put(uint32_t cp, char *out)
{
    uint8_t *o = (uint8_t *)out;
    if (cp >= KV_UC_RAW) {
        o[0] = (uint8_t)(cp - KV_UC_RAW);
        return 1;
    }
    if (cp < 0x80) {
        o[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (uint8_t)(0xC0 | cp >> 6);
        o[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (uint8_t)(0xE0 | cp >> 12);
        o[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (uint8_t)(0xF0 | cp >> 18);
    o[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}
