/*
 * kv_jsonl: what every JSON-lines reader of the benchmarks shares -- the
 * line iterator (blank lines skipped, line numbers kept for messages),
 * checked conversions of JSON numbers to integers (a number that is not
 * an integer, or lies outside the range, is refused instead of converted
 * with undefined behaviour), and arrays of strings.  cJSON parses.
 */
#ifndef KV_JSONL_H
#define KV_JSONL_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

#include "common/kv_status.h"

typedef struct {
    const char *text;
    size_t len, pos;
    int line; /* 1-based number of the line last returned */
} kv_jsonl;

void kv_jsonl_init(kv_jsonl *it, const char *text, size_t len);
/* The next line that is not blank, trimmed of surrounding whitespace;
 * false at the end.  *partial: the line is the last one and has no
 * newline (a writer may have been killed in the middle of it). */
bool kv_jsonl_next(kv_jsonl *it, const char **s, size_t *n, bool *partial);

/* v is a finite, integer-valued number in [lo, hi]: *out set, true. */
bool kv_json_int(const cJSON *v, long long lo, long long hi, long long *out);

/* A JSON array of strings (NULL entries never): *out malloc'd, each string
 * malloc'd; KV_E_DATA naming field when an item is not a string. */
kv_status kv_json_strings(const cJSON *arr, const char *field, char ***out, int *n);
void kv_strings_free(char **s, int n);

/* strdup that returns NULL on allocation failure (C11 has no strdup). */
char *kv_strdup(const char *s);

/* Room for element n of the array arr of capacity *cap (elements of elem
 * bytes): when n has reached *cap, the capacity doubles (to first from 0).
 * Returns the array, maybe moved, or NULL when out of memory (then arr and
 * *cap are as they were): the one growth rule of the readers' record lists. */
void *kv_grow(void *arr, int n, int *cap, size_t elem, int first);

#endif
