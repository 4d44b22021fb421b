/*
 * kv_file: the one whole-file reader behind every small text or binary input
 * (see kv_file.h).  Large inputs (.kvc files, models) do not come here: they
 * are mmapped or streamed by lib/format/kvc_file.c and lib/model/kv_model.c.
 */
#include "common/kv_file.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

kv_status kv_file_slurp(const char *path, size_t max_bytes, const char *what, char **buf,
                        size_t *len)
{
    *buf = NULL;
    *len = 0;
    const char *w = what ? what : "input";
    bool is_stdin = !strcmp(path, "-");
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) return kv_fail(KV_E_NOINPUT, "cannot open %s %s: %s", w, path, strerror(errno));
    /* fopen succeeds on a directory and fread then fails with EISDIR: say
       what is wrong instead of reporting an I/O error. */
    struct stat sb;
    if (!is_stdin && fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) {
        fclose(f);
        return kv_fail(KV_E_NOINPUT, "%s %s is a directory", w, path);
    }
    size_t cap = 1 << 12, n = 0;
    char *b = malloc(cap);
    kv_status st = b ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory reading %s %s", w, path);
    while (!st) {
        if (n + 1 >= cap) { /* keep one byte for the NUL */
            char *nb = cap < ((size_t)-1) / 2 ? realloc(b, cap * 2) : NULL;
            if (!nb) {
                st = kv_fail(KV_E_NOMEM, "out of memory reading %s %s (%zu bytes so far)", w,
                             path, n);
                break;
            }
            b = nb;
            cap *= 2;
        }
        size_t r = fread(b + n, 1, cap - n - 1, f);
        n += r;
        if (max_bytes && n > max_bytes) {
            st = kv_fail(KV_E_DATA, "%s %s is larger than %zu bytes", w, path, max_bytes);
            break;
        }
        if (r == 0) break;
    }
    if (!st && ferror(f)) st = kv_fail(KV_E_IO, "cannot read %s %s: %s", w, path, strerror(errno));
    if (!is_stdin) fclose(f);
    if (st) {
        free(b);
        return st;
    }
    b[n] = 0;
    *buf = b;
    *len = n;
    return KV_OK;
}

const char *kv_file_kind(mode_t mode)
{
    if (S_ISREG(mode)) return "a regular file";
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISLNK(mode)) return "a symbolic link";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a regular file";
}
