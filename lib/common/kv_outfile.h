/*
 * kv_outfile: the atomic output file every tool writes through (.kvc files,
 * JSON reports, SVG): open a temp file beside path (or stdout for "-"),
 * then commit (fsync + rename) or abort (unlink), so that a failed or
 * interrupted write never leaves a half-written file behind.
 */
#ifndef KV_OUTFILE_H
#define KV_OUTFILE_H

#include <stdio.h>

#include "common/kv_status.h"

typedef struct {
    FILE *fp;
    char *path;
    char *tmp; /* NULL for stdout */
} kv_outfile;

kv_status kv_outfile_open(kv_outfile *o, const char *path);
/* KV_OUT_NOFOLLOW: a file inside a directory the caller owns (a kv-tree
 * store).  kv_outfile_open writes through a symlink to its target and
 * straight into a FIFO or device; with this flag an existing path that is
 * not a regular file is refused (KV_E_DATA) and never followed. */
#define KV_OUT_NOFOLLOW 1u
kv_status kv_outfile_open_ex(kv_outfile *o, const char *path, unsigned flags);
kv_status kv_outfile_commit(kv_outfile *o);
void kv_outfile_abort(kv_outfile *o);
/* Write text and a newline, then commit (the outfile is closed either way). */
kv_status kv_outfile_put(kv_outfile *o, const char *text);
/* open + put: write text and a newline to path ("-": stdout) atomically. */
kv_status kv_outfile_write(const char *path, const char *text);
/* Unlink every temp file still open through kv_outfile_open.
 * Async-signal-safe: a front end may call it from a SIGINT/SIGTERM handler
 * before re-raising, so an interrupted write leaves nothing behind. */
void kv_outfile_cleanup_all(void);

#endif
