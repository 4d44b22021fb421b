/*
 * Status texts, the status -> exit code table, and the thread-local detail
 * buffer that lets the library explain an error without printing it.
 */
#include "common/kv_status.h"

#include <stdio.h>
#include <string.h>

static _Thread_local char detail[512];

static const struct {
    const char *text;
    int exit_code;
} status_table[KV_STATUS_COUNT] = {
    [KV_OK] = {"success", KV_EXIT_OK},
    [KV_E_USAGE] = {"usage error", KV_EXIT_USAGE},
    [KV_E_DATA] = {"bad data", KV_EXIT_DATAERR},
    [KV_E_NOINPUT] = {"cannot open input", KV_EXIT_NOINPUT},
    [KV_E_UNAVAILABLE] = {"not available", KV_EXIT_UNAVAILABLE},
    [KV_E_INTERNAL] = {"internal error", KV_EXIT_SOFTWARE},
    [KV_E_NOMEM] = {"out of memory", KV_EXIT_SOFTWARE},
    [KV_E_CANTCREATE] = {"cannot create output", KV_EXIT_CANTCREAT},
    [KV_E_IO] = {"I/O error", KV_EXIT_IOERR},
    [KV_E_UNSUPPORTED] = {"unsupported input", KV_EXIT_DATAERR},
};

const char *kv_strerror(kv_status st)
{
    if ((unsigned)st >= KV_STATUS_COUNT) return "unknown status";
    return status_table[st].text;
}

int kv_status_exit(kv_status st)
{
    if ((unsigned)st >= KV_STATUS_COUNT) return KV_EXIT_SOFTWARE;
    return status_table[st].exit_code;
}

/* Length of the printable UTF-8 sequence at p, or 0 for a control
 * character (C0, DEL, or C1 as U+0080..U+009F) or a byte that does not
 * start a valid sequence (overlong forms and surrogates included). */
static size_t printable_len(const unsigned char *p)
{
    unsigned c = p[0];
    if (c < 0x20 || c == 0x7f) return 0;
    if (c < 0x80) return 1;
#define CONT(i) ((p[i] & 0xc0) == 0x80)
    if (c >= 0xc2 && c <= 0xdf) return CONT(1) && !(c == 0xc2 && p[1] < 0xa0) ? 2 : 0;
    if (c >= 0xe0 && c <= 0xef)
        return CONT(1) && CONT(2) && !(c == 0xe0 && p[1] < 0xa0) && !(c == 0xed && p[1] >= 0xa0) ? 3 : 0;
    if (c >= 0xf0 && c <= 0xf4)
        return CONT(1) && CONT(2) && CONT(3) && !(c == 0xf0 && p[1] < 0x90) && !(c == 0xf4 && p[1] >= 0x90) ? 4
                                                                                                           : 0;
#undef CONT
    return 0;
}

size_t kv_escape_controls(char *dst, size_t cap, const char *src)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)src;
    size_t o = 0;
    if (!cap) return 0;
    while (*p) {
        size_t n = printable_len(p);
        if (n) {
            if (o + n >= cap) break;
            memcpy(dst + o, p, n);
            o += n;
            p += n;
        } else {
            if (o + 4 >= cap) break;
            dst[o++] = '\\';
            dst[o++] = 'x';
            dst[o++] = hex[*p >> 4];
            dst[o++] = hex[*p & 15];
            p++;
        }
    }
    dst[o] = '\0';
    return o;
}

/* Every detail is escaped as it is recorded: messages carry names and
 * values from input files, and an ESC sequence in a metadata key must not
 * reach the terminal (it could re-title it, or worse). */
kv_status kv_fail(kv_status st, const char *fmt, ...)
{
    char raw[sizeof detail];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    kv_escape_controls(detail, sizeof detail, raw);
    return st;
}

const char *kv_errdetail(void) { return detail; }

void kv_errclear(void) { detail[0] = '\0'; }

void kv_errcontext(const char *fmt, ...)
{
    char raw[256], prefix[256], old[sizeof detail];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    kv_escape_controls(prefix, sizeof prefix, raw);
    memcpy(old, detail, sizeof old);
    /* Truncation is acceptable for a one-line message. */
    size_t n = strlen(prefix);
    if (n > sizeof detail - 1) n = sizeof detail - 1;
    memcpy(detail, prefix, n);
    if (old[0] && n + 2 < sizeof detail) {
        detail[n++] = ':';
        detail[n++] = ' ';
        size_t m = strlen(old);
        if (m > sizeof detail - 1 - n) m = sizeof detail - 1 - n;
        memcpy(detail + n, old, m);
        n += m;
    }
    detail[n] = '\0';
}
