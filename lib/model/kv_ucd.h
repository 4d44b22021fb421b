/*
 * kv_ucd: what the BPE pre-tokenizers need of Unicode: the general
 * category class of a code point (from a table generated from the Unicode
 * Character Database, lib/model/kv_ucd_table.h), White_Space, and a
 * UTF-8 decoder that keeps every input byte: a byte that does not start a
 * well-formed sequence becomes the pseudo code point KV_UC_RAW + byte (class
 * KV_UC_UNASSIGNED), which kv_ucd_put turns back into that byte, so text
 * round-trips through tokenization byte for byte.
 */
#ifndef KV_UCD_H
#define KV_UCD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum {
    KV_UC_UNASSIGNED = 0, /* Cn, and raw bytes */
    KV_UC_LETTER = 1,     /* L* */
    KV_UC_MARK = 2,       /* M* */
    KV_UC_NUMBER = 3,     /* N* */
    KV_UC_PUNCT = 4,      /* P* */
    KV_UC_SYMBOL = 5,     /* S* */
    KV_UC_SEPARATOR = 6,  /* Z* */
    KV_UC_OTHER = 7,      /* Cc, Cf, Cs, Co */
};

#define KV_UC_RAW 0x110000u /* + byte: an undecodable input byte */

int kv_ucd_class(uint32_t cp);
bool kv_ucd_is_space(uint32_t cp);
const char *kv_ucd_version(void);

/* Decode n bytes into cps (room for n code points); *ncp set.  Returns the
 * number of raw (undecodable) bytes met. */
size_t kv_ucd_decode(const char *s, size_t n, uint32_t *cps, size_t *ncp);
/* Encode one code point (or raw byte) into out (4 bytes); returns its length. */
int kv_ucd_put(uint32_t cp, char *out);

#endif
