/*
 * kv_json: the few helpers the tools use to write JSON by hand (escaped
 * strings, numbers that stay valid JSON when not finite).  Reading JSON is
 * cJSON's job.
 */
#ifndef KV_JSON_H
#define KV_JSON_H

#include <stdio.h>

/* "s" with JSON escapes. */
void kv_json_string(FILE *f, const char *s);
/* %.6g, or null when v is NaN or infinite. */
void kv_json_number(FILE *f, double v);
/* [a0, a1, ...] of n numbers. */
void kv_json_numbers(FILE *f, const double *a, int n);

#endif
