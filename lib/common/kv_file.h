/*
 * kv_file: read a whole small input file (a prompt, a token list, a
 * tokenizer, a deploy config, a store index) into memory.  Every tool used
 * to carry its own loop for this, and each mishandled a different corner
 * (a directory read as an I/O error, a failed realloc taken for end of
 * file); this one place gives every caller the same answers: "-" is stdin,
 * a missing file or a directory is KV_E_NOINPUT, a file over the caller's
 * limit is KV_E_DATA, a read error is KV_E_IO.
 */
#ifndef KV_FILE_H
#define KV_FILE_H

#include <stddef.h>
#include <sys/types.h>

#include "common/kv_status.h"

/*
 * Read all of path ("-": stdin) into a malloc'd buffer with a NUL after the
 * last byte (so text callers can parse it as a string); *len excludes the
 * NUL.  max_bytes 0 means no limit beyond memory.  what names the input in
 * messages ("tokenizer", "prompt"); NULL for none.  On failure *buf is NULL.
 */
kv_status kv_file_slurp(const char *path, size_t max_bytes, const char *what, char **buf,
                        size_t *len);

/* What a file of this st_mode is, for messages: "a regular file", "a
 * symbolic link", "a FIFO", "a character device", ... */
const char *kv_file_kind(mode_t mode);

#endif
