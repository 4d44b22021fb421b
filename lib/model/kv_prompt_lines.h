/*
 * kv_prompt_lines: a file of prompts, one per line (kv-run --batch
 * --prompt-file).  '\n' ends a line and a '\r' before it is dropped (CRLF
 * files); a line of nothing but spaces and tabs is skipped; the last line
 * needs no newline.  A NUL byte is KV_E_DATA naming its line, since a
 * prompt is text.  Nothing else is interpreted: each line is a prompt's
 * text exactly as written (kv_prompt.text).
 */
#ifndef KV_PROMPT_LINES_H
#define KV_PROMPT_LINES_H

#include <stddef.h>

#include "common/kv_status.h"

/* The prompts of buf (len bytes) into *lines: *n malloc'd NUL-terminated
 * strings in a malloc'd array (kv_prompt_lines_free); *n may be 0. */
kv_status kv_prompt_lines(const char *buf, size_t len, char ***lines, int *n);
void kv_prompt_lines_free(char **lines, int n);

#endif
