/*
 * kvc: reader and writer of the .kvc KV-cache file (man/kvc.5).  A .kvc file
 * is a safetensors file: 8-byte little-endian header length N, N bytes of
 * JSON header (padded with spaces), then raw little-endian C-order tensor
 * data.  Model geometry, encodings and per-tensor CRC-32C checksums live in
 * the string-to-string "__metadata__" object.  This module is the only code
 * in kvtools that touches .kvc files: kvc_file.c opens and maps them,
 * kvc_parse.c validates them, kvc_write.c writes them (through the atomic
 * lib/common/kv_outfile, with lib/common/kv_crc checksums).
 */
#ifndef KVC_H
#define KVC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/kv_dtype.h"
#include "common/kv_geom.h"
#include "common/kv_layout.h"
#include "common/kv_status.h"

#define KVC_FORMAT_VERSION 1
#define KVC_MAX_DIMS 4
#define KVC_NAME_MAX 128
#define KVC_DATA_ALIGN 64 /* the data section starts at a multiple of this */

typedef struct {
    char name[KVC_NAME_MAX];
    kv_dtype dtype;
    int ndim;
    int64_t shape[KVC_MAX_DIMS];
    uint64_t offset; /* from the start of the data section */
    uint64_t nbytes;
    const void *data; /* points into the mapping or buffer; may be unaligned
                         only for files not written by kvtools */
    uint32_t crc;     /* stored CRC-32C, valid if has_crc */
    bool has_crc;
} kvc_tensor;


typedef struct kvc_file kvc_file;

/* Open a .kvc from a path, or "-" for stdin.  Regular files are mmapped;
 * stdin and zstd-compressed input (detected by magic) are read into memory,
 * never more than the file's own header describes (a pipe that runs on, a
 * decompression bomb: KV_E_DATA once past it).
 * Validates the header, every tensor, the geometry and (when present) every
 * checksum; any problem is KV_E_DATA with a specific kv_errdetail(). */
kv_status kvc_open(const char *path, kvc_file **out);
/* Same, from an open descriptor (not closed; a caller that must check what
 * it opens, such as the kv-tree store, opens it itself). */
kv_status kvc_open_fd(int fd, kvc_file **out);
/* Same, from a buffer (copied; used by the fuzzer and tests). */
kv_status kvc_open_mem(const void *buf, size_t len, kvc_file **out);
/* Same, over the caller's buffer, not copied: buf must outlive the
 * kvc_file (kvc_close leaves it alone).  For a caller that has just checked
 * a checksum over all len bytes (a kv-tree chunk frame): the tensors'
 * crc32c entries are still parsed and must be well formed and complete,
 * but not recomputed.  Every other check of kvc_open runs. */
kv_status kvc_open_view(const void *buf, size_t len, kvc_file **out);
/* The header alone: head holds the first head_len bytes of a file of
 * file_len bytes, the whole JSON header among them.  Every check of
 * kvc_open that needs no tensor data runs (the tiling against file_len,
 * the geometry, the crc32c entries' form); the tensors' data is NULL and
 * their checksums are not taken (has_crc and crc say what the reader of
 * each tensor's bytes must check).  Positions and dsq layers, whose checks
 * read data, are KV_E_UNSUPPORTED; so is a compressed file.  For a reader
 * that reads tensors one at a time (kv-tree's layered loads).  head is not
 * kept.  kvc_tokens, kvc_positions and kvc_tensor_to_f32 refuse its
 * tensors with KV_E_USAGE (they have no bytes here). */
kv_status kvc_open_head(const void *head, size_t head_len, uint64_t file_len, kvc_file **out);
/* Where the data section starts in the file (tensor offsets count from there). */
uint64_t kvc_data_start(const kvc_file *f);
void kvc_close(kvc_file *f);

const kv_geom *kvc_geom(const kvc_file *f);
int kvc_n_tensors(const kvc_file *f);
const kvc_tensor *kvc_tensor_at(const kvc_file *f, int i);
const kvc_tensor *kvc_find(const kvc_file *f, const char *name);
/* "layers.{layer}.{part}", e.g. part "k", "v", "q", "k.codes". */
const kvc_tensor *kvc_layer(const kvc_file *f, int layer, const char *part);
/* Metadata value for key, or NULL. */
const char *kvc_meta(const kvc_file *f, const char *key);
int kvc_n_meta(const kvc_file *f);
void kvc_meta_at(const kvc_file *f, int i, const char **key, const char **value);
/* Were checksums present (and all verified)? */
bool kvc_has_checksums(const kvc_file *f);
/* Size of the input as read (compressed size if zstd), and whether it was. */
uint64_t kvc_file_bytes(const kvc_file *f);
bool kvc_was_zstd(const kvc_file *f);

/* How layer `layer` stores its keys (which = 'k') or values ('v'):
 * "f32", "f16", "bf16" (plain tensor), "kivi" or "dsq" (packed parts);
 * NULL if the layer or `which` is out of range. */
const char *kvc_layer_encoding(const kvc_file *f, int layer, char which);
/* KIVI parameters of a kivi-encoded layer part (validated at open);
 * false if that part is not kivi. */
bool kvc_layer_kivi(const kvc_file *f, int layer, char which, kv_kivi_params *p);
/* Bytes of all tensors named "layers.{layer}.*", or with kv_only of its
 * K and V tensors only (plain or packed parts, not the queries). */
uint64_t kvc_layer_bytes(const kvc_file *f, int layer, bool kv_only);
/* Tensors whose stored checksum was verified (kvc_has_checksums: all). */
int kvc_n_checksums(const kvc_file *f);

/* The token ids of a cache: its "tokens" tensor (I32 [T]) copied into
 * *ids (malloc'd); KV_E_DATA when there is none. */
kv_status kvc_tokens(const kvc_file *f, int32_t **ids, int *n);
/* The positions tensor of a token subset (man/kvc.5, "Token subsets"),
 * copied into *pos (malloc'd, *n = T entries); *pos = NULL and *n = 0 when
 * the file has none (row t is then position t).  kvc_open has validated it:
 * I32 [T], non-negative, strictly increasing. */
kv_status kvc_positions(const kvc_file *f, int32_t **pos, int *n);
/* A request's token ids from exactly one of: a token list file (ids_path,
 * "-" for stdin: kv_tokens_parse) or the tokens tensor of the .kvc at
 * kvc_path.  The detail names the file (or "stdin"). */
kv_status kvc_tokens_read(const char *ids_path, const char *kvc_path, int32_t **ids, int *n);

/* Convert an F32/F16/BF16 tensor to float (n = element count). */
kv_status kvc_tensor_to_f32(const kvc_tensor *t, float *out);
int64_t kvc_tensor_numel(const kvc_tensor *t);

/* ---- writer ---------------------------------------------------------- */
typedef struct kvc_writer kvc_writer;

kv_status kvc_writer_new(kvc_writer **out);
/* Geometry metadata (format, version, kvc.* keys). */
kv_status kvc_writer_geom(kvc_writer *w, const kv_geom *g);
/* Set (or replace) one metadata key.  "crc32c.*" and "kvc.checksums" are
 * ignored: the writer computes a checksum for every tensor itself and says
 * so (man/kvc.5). */
kv_status kvc_writer_meta(kvc_writer *w, const char *key, const char *value);
/* Copy every metadata key of an open file (except checksums). */
kv_status kvc_writer_copy_meta(kvc_writer *w, const kvc_file *f);
/* Add a tensor; data is borrowed and must stay valid until kvc_writer_write. */
kv_status kvc_writer_add(kvc_writer *w, const char *name, kv_dtype dt, int ndim,
                         const int64_t *shape, const void *data);
/* Same, but the writer keeps its own copy. */
kv_status kvc_writer_add_copy(kvc_writer *w, const char *name, kv_dtype dt, int ndim,
                              const int64_t *shape, const void *data);
/* Write to path ("-" = stdout).  Files are written atomically: a temp file in
 * the same directory, fsync, rename; on failure nothing is left behind.
 * If zstd_level > 0 the output is zstd-compressed. */
kv_status kvc_writer_write(kvc_writer *w, const char *path, int zstd_level);
/* Same, with kv_outfile_open_ex flags (KV_OUT_NOFOLLOW). */
kv_status kvc_writer_write_ex(kvc_writer *w, const char *path, int zstd_level, unsigned flags);
/* Same, into memory: *buf (malloc'd, *len bytes) holds the whole file. */
kv_status kvc_writer_write_mem(kvc_writer *w, int zstd_level, uint8_t **buf, size_t *len);
void kvc_writer_free(kvc_writer *w);


#endif
