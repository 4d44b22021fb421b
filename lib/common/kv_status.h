/*
 * kv_status: the one status type of the kvtools library.  Library code never
 * prints and never exits; it returns a kv_status and may attach a one-line
 * detail (thread-local) that the front end prints.  Each status maps to one
 * sysexits-style exit code shared by every tool.
 */
#ifndef KV_STATUS_H
#define KV_STATUS_H

#include <stdarg.h>
#include <stddef.h>

typedef enum {
    KV_OK = 0,
    KV_E_USAGE,       /* bad option or argument               -> 64 */
    KV_E_DATA,        /* malformed or inconsistent input data -> 65 */
    KV_E_NOINPUT,     /* input file missing or unreadable     -> 66 */
    KV_E_UNAVAILABLE, /* feature/device not available         -> 69 */
    KV_E_INTERNAL,    /* bug or unexpected condition          -> 70 */
    KV_E_NOMEM,       /* allocation failed                    -> 70 */
    KV_E_CANTCREATE,  /* cannot create output                 -> 73 */
    KV_E_IO,          /* read/write error                     -> 74 */
    KV_E_UNSUPPORTED, /* valid but unsupported input          -> 65 */
    KV_STATUS_COUNT
} kv_status;

/* Exit codes (sysexits.h values), one table for every tool. */
enum {
    KV_EXIT_OK = 0,
    KV_EXIT_USAGE = 64,
    KV_EXIT_DATAERR = 65,
    KV_EXIT_NOINPUT = 66,
    KV_EXIT_UNAVAILABLE = 69,
    KV_EXIT_SOFTWARE = 70,
    KV_EXIT_CANTCREAT = 73,
    KV_EXIT_IOERR = 74
};

/* Generic text for a status ("bad data", ...). Never NULL. */
const char *kv_strerror(kv_status st);

/* Exit code a tool should use for a status. */
int kv_status_exit(kv_status st);

/*
 * Record a detail message for the calling thread and return st, so library
 * code can write `return kv_fail(KV_E_DATA, "tensor %s: ...", name);`.
 */
kv_status kv_fail(kv_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The last detail recorded on this thread, or "" if none. */
const char *kv_errdetail(void);

/* Forget the detail (call before an operation whose detail you will print). */
void kv_errclear(void);

/* Prepend context to the current detail: "ctx: old detail". */
void kv_errcontext(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/*
 * Copy src into dst (cap bytes, always NUL-terminated, cut at a whole
 * character) with every control character written as \xNN: C0 controls,
 * DEL, C1 controls (U+0080..U+009F) and bytes that are not valid UTF-8.
 * Printable UTF-8 is kept.  kv_fail and kv_errcontext apply it to every
 * detail, the front end to every message line.  Returns strlen(dst).
 */
size_t kv_escape_controls(char *dst, size_t cap, const char *src);

#endif
