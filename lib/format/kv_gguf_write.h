/*
 * kv_gguf_write: a GGUF v3 writer (the format kv_gguf.h reads): metadata
 * in insertion order, tensor infos, then the data section with every
 * tensor aligned to general.alignment (32).  Tensor data is borrowed until
 * kv_gguf_writer_write, which writes the whole file through an atomic
 * output file (a failed write leaves no partial file).
 */
#ifndef KV_GGUF_WRITE_H
#define KV_GGUF_WRITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_status.h"
#include "format/kv_gguf.h"

typedef struct kv_gguf_writer kv_gguf_writer;

kv_status kv_gguf_writer_new(kv_gguf_writer **out);
void kv_gguf_writer_free(kv_gguf_writer *w);

/* Metadata.  A key may be set once (KV_E_USAGE otherwise). */
kv_status kv_gguf_set_str(kv_gguf_writer *w, const char *key, const char *val);
kv_status kv_gguf_set_u32(kv_gguf_writer *w, const char *key, uint32_t val);
kv_status kv_gguf_set_i32(kv_gguf_writer *w, const char *key, int32_t val);
kv_status kv_gguf_set_f32(kv_gguf_writer *w, const char *key, float val);
kv_status kv_gguf_set_bool(kv_gguf_writer *w, const char *key, bool val);
/* Arrays (copied).  lens may be NULL for NUL-terminated strings. */
kv_status kv_gguf_set_arr_str(kv_gguf_writer *w, const char *key, const char *const *s,
                              const size_t *lens, size_t n);
kv_status kv_gguf_set_arr_f32(kv_gguf_writer *w, const char *key, const float *v, size_t n);
kv_status kv_gguf_set_arr_i32(kv_gguf_writer *w, const char *key, const int32_t *v, size_t n);

/* Copy one metadata entry of a parsed file (scalars, strings and arrays of
 * them; nested arrays are KV_E_UNSUPPORTED). */
kv_status kv_gguf_copy_kv(kv_gguf_writer *w, const kv_gguf_kv *kv);

/* A tensor of ggml type with n_dims dimensions ne (ne[0] innermost) whose
 * nbytes of data stay valid until the write.  Sizes are checked against the
 * type's blocks. */
kv_status kv_gguf_add_tensor(kv_gguf_writer *w, const char *name, uint32_t ggml_type, int n_dims,
                             const int64_t *ne, const void *data, size_t nbytes);

/* Write the file to path ("-": stdout). */
kv_status kv_gguf_writer_write(kv_gguf_writer *w, const char *path);

#endif
