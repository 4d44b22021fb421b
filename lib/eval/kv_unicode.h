/*
 * kv_unicode: the few pieces of Unicode that the benchmark scorers need to
 * treat text exactly as Python 3 does, since LongBench's and RULER's
 * official metrics are Python: strict UTF-8 decoding into code points,
 * str.lower() (full mapping, U+0130's two-code-point lower case and the
 * Final_Sigma rule), str.isspace() (what str.split() and re's \s split on),
 * re's \w (alphanumerics and '_', which decides \b) and \d (decimal digits).
 * The property tables (kv_unicode_data.c) are generated from Python's own
 * Unicode database by kv_unicode_gen.py; kv_uc_version names its version.
 *
 * Text is handled as arrays of code points (uint32_t), one per Python
 * character, so that lengths, slices and comparisons match Python's.
 */
#ifndef KV_UNICODE_H
#define KV_UNICODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_status.h"

typedef struct {
    uint32_t lo, hi;
} kv_uc_range;

typedef struct {
    uint32_t from, to;
} kv_uc_pair;

/* Generated tables (sorted, disjoint). */
extern const char kv_uc_version[];
extern const kv_uc_pair kv_uc_lower_map[];
extern const int kv_uc_lower_map_n;
extern const kv_uc_range kv_uc_space[], kv_uc_word[], kv_uc_decimal[], kv_uc_ignorable[],
    kv_uc_cased[];
extern const int kv_uc_space_n, kv_uc_word_n, kv_uc_decimal_n, kv_uc_ignorable_n, kv_uc_cased_n;

/* A string of code points: c (n), malloc'd by whoever built it. */
typedef struct {
    uint32_t *c;
    size_t n;
} kv_ustr;

/*
 * Decode n bytes of UTF-8 as Python's strict utf-8 codec does (no
 * overlong forms, no surrogates, nothing above U+10FFFF).  On success
 * out->c is malloc'd (at least one element even for n == 0).  Invalid
 * input is KV_E_DATA naming the byte offset.
 */
kv_status kv_utf8_decode(const char *s, size_t n, kv_ustr *out);
bool kv_utf8_valid(const char *s, size_t n);
/* Encode n code points; *out malloc'd and NUL-terminated, *len bytes. */
kv_status kv_utf8_encode(const uint32_t *c, size_t n, char **out, size_t *len);
/* s (n bytes) as valid UTF-8, every ill-formed subsequence replaced by
 * U+FFFD as Python's bytes.decode('utf-8', 'replace') does (one U+FFFD per
 * maximal subpart); *out malloc'd and NUL-terminated. */
kv_status kv_utf8_sanitize(const char *s, size_t n, char **out, size_t *len);
/* Bytes of one code point (1..4) written to buf. */
int kv_utf8_put(uint32_t c, char *buf);
void kv_ustr_free(kv_ustr *s);

bool kv_uc_isspace(uint32_t c);   /* str.isspace() */
bool kv_uc_isword(uint32_t c);    /* re \w: isalnum() or '_' */
bool kv_uc_isdecimal(uint32_t c); /* re \d: isdecimal() */

/*
 * Python's str.lower() of in (n code points) into out, which must hold
 * 2 * n code points (U+0130 becomes two); returns the count written.
 * Σ (U+03A3) becomes final ς when the Final_Sigma context holds.
 */
size_t kv_uc_lower(const uint32_t *in, size_t n, uint32_t *out);
/* Lower a kv_ustr in place of a new one; KV_E_NOMEM only. */
kv_status kv_ustr_lower(const kv_ustr *in, kv_ustr *out);

#endif
