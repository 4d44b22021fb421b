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

kv_status kv_fail(kv_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return st;
}

const char *kv_errdetail(void) { return detail; }

void kv_errclear(void) { detail[0] = '\0'; }

void kv_errcontext(const char *fmt, ...)
{
    char prefix[256], old[sizeof detail];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
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
