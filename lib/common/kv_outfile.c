/*
 * kv_outfile: atomic output files (kv_outfile.h): a temp file beside the
 * target, fsync, rename, then an fsync of the folder; a registry of temp
 * files in flight lets a signal handler remove them.
 */
#include "common/kv_outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kv_file.h"

/* Temp files in flight, for kv_outfile_cleanup_all from a signal handler. */
#define LIVE_MAX 16
static char *volatile live_tmp[LIVE_MAX];

static void live_add(char *p)
{
    for (int i = 0; i < LIVE_MAX; i++)
        if (!live_tmp[i]) {
            live_tmp[i] = p;
            return;
        }
}

static void live_del(const char *p)
{
    for (int i = 0; i < LIVE_MAX; i++)
        if (live_tmp[i] == p) live_tmp[i] = NULL;
}

void kv_outfile_cleanup_all(void)
{
    for (int i = 0; i < LIVE_MAX; i++) {
        char *p = live_tmp[i];
        if (p) unlink(p);
    }
}

static void outfile_reset(kv_outfile *o)
{
    if (o->tmp) {
        live_del(o->tmp);
        free(o->tmp);
    }
    free(o->path);
    o->fp = NULL;
    o->path = NULL;
    o->tmp = NULL;
}

kv_status kv_outfile_open(kv_outfile *o, const char *path) { return kv_outfile_open_ex(o, path, 0); }

kv_status kv_outfile_open_ex(kv_outfile *o, const char *path, unsigned flags)
{
    memset(o, 0, sizeof *o);
    if (!path || !*path) return kv_fail(KV_E_USAGE, "empty output path");
    o->path = strdup(path);
    if (!o->path) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    if (!strcmp(path, "-")) {
        o->fp = stdout;
        return KV_OK;
    }
    struct stat sb;
    if ((flags & KV_OUT_NOFOLLOW) && lstat(path, &sb) == 0 && !S_ISREG(sb.st_mode)) {
        kv_status st = kv_fail(KV_E_DATA, "refusing to write %s: it is %s, not a regular file", path,
                               kv_file_kind(sb.st_mode));
        outfile_reset(o);
        return st;
    }
    /* Writing through a symlink replaces its target, not the link. */
    if (!(flags & KV_OUT_NOFOLLOW) && lstat(path, &sb) == 0 && S_ISLNK(sb.st_mode)) {
        char *real = realpath(path, NULL);
        if (real) {
            free(o->path);
            o->path = real;
            path = real;
        }
    }
    /* A device or FIFO (/dev/null, a pipe) cannot be replaced by rename:
     * write to it directly. */
    if (!(flags & KV_OUT_NOFOLLOW) && stat(path, &sb) == 0 && !S_ISREG(sb.st_mode)) {
        if (S_ISDIR(sb.st_mode)) {
            outfile_reset(o);
            return kv_fail(KV_E_CANTCREATE, "cannot create %s: is a directory", path);
        }
        o->fp = fopen(path, "wb");
        if (!o->fp) {
            int e = errno;
            outfile_reset(o);
            return kv_fail(KV_E_CANTCREATE, "cannot open %s: %s", path, strerror(e));
        }
        return KV_OK;
    }
    const char *slash = strrchr(path, '/');
    size_t dirlen = slash ? (size_t)(slash - path) + 1 : 0;
    const char *base = slash ? slash + 1 : path;
    size_t n = strlen(path) + 16;
    o->tmp = malloc(n);
    if (!o->tmp) {
        outfile_reset(o);
        return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    }
    snprintf(o->tmp, n, "%.*s.%s.XXXXXX", (int)dirlen, path, base);
    int fd = mkstemp(o->tmp);
    if (fd < 0) {
        int e = errno;
        free(o->tmp);
        o->tmp = NULL;
        outfile_reset(o);
        return kv_fail(KV_E_CANTCREATE, "cannot create %s: %s", path, strerror(e));
    }
    live_add(o->tmp);
    /* mkstemp makes 0600; give the file the mode a plain creat() would. */
    mode_t um = umask(0);
    umask(um);
    (void)fchmod(fd, 0666 & ~um); /* on failure the file merely stays private */
    o->fp = fdopen(fd, "wb");
    if (!o->fp) {
        int e = errno;
        close(fd);
        unlink(o->tmp);
        outfile_reset(o);
        return kv_fail(KV_E_NOMEM, "cannot open a stream: %s", strerror(e));
    }
    return KV_OK;
}

void kv_outfile_abort(kv_outfile *o)
{
    if (!o->path) return;
    if (o->fp && o->fp != stdout) fclose(o->fp);
    else if (o->fp == stdout) fflush(stdout);
    if (o->tmp) unlink(o->tmp);
    outfile_reset(o);
}

kv_status kv_outfile_put(kv_outfile *o, const char *text)
{
    fputs(text, o->fp); /* an error shows in the commit's ferror */
    fputc('\n', o->fp);
    return kv_outfile_commit(o);
}

kv_status kv_outfile_write(const char *path, const char *text)
{
    kv_outfile o;
    kv_status st = kv_outfile_open(&o, path);
    return st ? st : kv_outfile_put(&o, text);
}

kv_status kv_outfile_commit(kv_outfile *o)
{
    if (!o->path) return kv_fail(KV_E_INTERNAL, "commit of an output that is not open");
    if (o->fp == stdout) {
        bool bad = fflush(stdout) != 0 || ferror(stdout);
        int e = errno;
        outfile_reset(o);
        return bad ? kv_fail(KV_E_IO, "write error on stdout: %s", strerror(e)) : KV_OK;
    }
    int e = 0;
    const char *what = NULL;
    if (fflush(o->fp) != 0 || ferror(o->fp)) e = errno, what = "write";
    else if (o->tmp && fsync(fileno(o->fp)) != 0) e = errno, what = "fsync";
    if (fclose(o->fp) != 0 && !what) e = errno, what = "close";
    o->fp = NULL;
    if (!what && o->tmp && rename(o->tmp, o->path) != 0) e = errno, what = "rename";
    if (what) {
        if (o->tmp) unlink(o->tmp);
        kv_status st = kv_fail(KV_E_IO, "cannot write %s (%s): %s", o->path, what, strerror(e));
        outfile_reset(o);
        return st;
    }
    if (o->tmp) { /* make the rename itself durable */
        char *dir = strdup(o->path);
        if (dir) {
            char *slash = strrchr(dir, '/');
            const char *d = slash ? (slash == dir ? "/" : (*slash = '\0', dir)) : ".";
            int dfd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (dfd >= 0) {
                (void)fsync(dfd);
                close(dfd);
            }
            free(dir);
        }
    }
    outfile_reset(o);
    return KV_OK;
}
