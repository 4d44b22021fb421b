/*
 * kv_gguf: a strict reader of GGUF v3 files (the llama.cpp model container):
 * header, every metadata value type including (nested) arrays, tensor
 * infos, general.alignment and the aligned data section.  It parses a
 * buffer the caller keeps alive (usually an mmap) and checks every length,
 * count, offset and size against the buffer, so a corrupt file is a
 * KV_E_DATA with a one-line detail, never an out-of-bounds read.
 */
#ifndef KV_GGUF_H
#define KV_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_ggml.h"
#include "common/kv_status.h"

#define KV_GGUF_MAGIC 0x46554747u /* "GGUF" little-endian */

typedef enum {
    KV_GGUF_U8 = 0, KV_GGUF_I8, KV_GGUF_U16, KV_GGUF_I16, KV_GGUF_U32, KV_GGUF_I32,
    KV_GGUF_F32, KV_GGUF_BOOL, KV_GGUF_STRING, KV_GGUF_ARRAY, KV_GGUF_U64, KV_GGUF_I64,
    KV_GGUF_F64, KV_GGUF_TYPE_COUNT
} kv_gguf_type;

/* Tensor types are ggml's (common/kv_ggml.h); the reader sizes every type
 * that table sizes and refuses the others by name. */

typedef struct {
    char *key;
    kv_gguf_type type;
    /* scalars */
    union { uint64_t u; int64_t i; double f; } num;
    const char *str; size_t str_len;   /* STRING (not NUL-terminated) */
    /* ARRAY */
    kv_gguf_type arr_type;
    uint64_t arr_n;
    const uint8_t *arr_data;           /* first element in the buffer */
    uint64_t *arr_str_off;             /* (arr_n) offsets of string elements */
} kv_gguf_kv;

typedef struct {
    char *name;
    int n_dims;
    int64_t ne[4];      /* ne[0] is the innermost (row length) */
    uint32_t ggml_type;
    uint64_t offset;    /* from the start of the data section */
    uint64_t nbytes;
    const void *data;   /* into the buffer */
} kv_gguf_tensor;

typedef struct kv_gguf {
    uint32_t version;
    uint64_t n_kv;
    kv_gguf_kv *kv;          /* (n_kv) */
    uint64_t n_tensors;
    kv_gguf_tensor *tensors; /* (n_tensors) */
    uint64_t alignment;
    uint64_t data_offset;    /* start of the data section in the buffer */
    /* private: open-addressing hash tables of entry index + 1 (0 empty), so
     * duplicate checks and lookups are linear, not quadratic, in the counts */
    uint64_t *kv_slot, *t_slot; /* (kv_mask + 1), (t_mask + 1) */
    uint64_t kv_mask, t_mask;
} kv_gguf;

/* Does the file at path start with the GGUF magic?  (false if unreadable) */
bool kv_gguf_is_file(const char *path);

/* Parse buf (len bytes, borrowed). */
kv_status kv_gguf_parse(const void *buf, size_t len, kv_gguf **out);
void kv_gguf_free(kv_gguf *g);

const kv_gguf_kv *kv_gguf_find(const kv_gguf *g, const char *key);
const kv_gguf_tensor *kv_gguf_tensor_find(const kv_gguf *g, const char *name);
const char *kv_gguf_type_name(kv_gguf_type t);

/* Typed getters: false if absent; KV_E_DATA via *st if present but of a
 * type that cannot be read as asked (st may be NULL). */
bool kv_gguf_get_int(const kv_gguf *g, const char *key, int64_t *v, kv_status *st);
bool kv_gguf_get_float(const kv_gguf *g, const char *key, double *v, kv_status *st);
/* String value copied into out (NUL-terminated, truncated to n-1). */
bool kv_gguf_get_str(const kv_gguf *g, const char *key, char *out, size_t n, kv_status *st);

/* Array elements (i < arr_n). */
const char *kv_gguf_arr_str(const kv_gguf_kv *kv, uint64_t i, size_t *len);
double kv_gguf_arr_num(const kv_gguf_kv *kv, uint64_t i);

#endif
