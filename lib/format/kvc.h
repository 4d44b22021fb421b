/*
 * kvc: reader and writer of the .kvc KV-cache file (man/kvc.5).  A .kvc file
 * is a safetensors file: 8-byte little-endian header length N, N bytes of
 * JSON header (padded with spaces), then raw little-endian C-order tensor
 * data.  Model geometry, encodings and per-tensor CRC-32C checksums live in
 * the string-to-string "__metadata__" object.  This module is the only code
 * in kvtools that touches .kvc files.
 */
#ifndef KVC_H
#define KVC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/kv_layout.h"
#include "common/kv_status.h"

#define KVC_FORMAT_VERSION 1
#define KVC_MAX_DIMS 4
#define KVC_NAME_MAX 128
#define KVC_DATA_ALIGN 64 /* the data section starts at a multiple of this */

typedef enum {
    KV_DT_F32 = 0,
    KV_DT_F16,
    KV_DT_BF16,
    KV_DT_I32,
    KV_DT_U8,
    KV_DT_I8,
    KV_DT_I64,
    KV_DT_U32,
    KV_DT_COUNT
} kv_dtype;

size_t kv_dtype_size(kv_dtype dt);
const char *kv_dtype_name(kv_dtype dt); /* safetensors spelling: "F32" ... */
kv_status kv_dtype_parse(const char *s, kv_dtype *out);

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

typedef enum { KV_ROPE_INTERLEAVED = 0, KV_ROPE_HALVES = 1 } kv_rope_layout;
typedef enum { KV_ROPE_SCALING_NONE = 0, KV_ROPE_SCALING_LLAMA3 = 1 } kv_rope_scaling;

/* Model and cache geometry, from metadata or derived from tensor shapes. */
typedef struct {
    int n_layers;
    int n_heads;    /* query heads (0 if unknown: no q tensors and no metadata) */
    int n_kv_heads;
    int head_dim;
    int n_tokens;   /* tokens in the cache */
    int n_q;        /* query samples per layer (0 if none) */
    double rope_theta;               /* default 10000 */
    kv_rope_scaling rope_scaling;    /* default none */
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_orig_ctx;
    bool keys_roped;                 /* default true */
    kv_rope_layout rope_layout;      /* default interleaved */
    char model[64];                  /* free-form model name, may be "" */
} kv_geom;

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
void kvc_free(kvc_file *f);

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

/* Convert an F32/F16/BF16 tensor to float (n = element count). */
kv_status kvc_tensor_to_f32(const kvc_tensor *t, float *out);
int64_t kvc_tensor_numel(const kvc_tensor *t);

/* ---- writer ---------------------------------------------------------- */
typedef struct kvc_writer kvc_writer;

kv_status kvc_writer_new(kvc_writer **out);
/* Geometry metadata (format, version, kvc.* keys). */
kv_status kvc_writer_geom(kvc_writer *w, const kv_geom *g);
/* Set (or replace) one metadata key.  "crc32c.*" keys are ignored: the
 * writer computes a checksum for every tensor itself. */
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
void kvc_writer_free(kvc_writer *w);

/* Defaults for a geometry (theta 10000, keys roped, interleaved). */
void kv_geom_defaults(kv_geom *g);

/* Generic atomic file output used by every tool that writes files (JSON
 * reports, SVG): open a temp file beside path (or stdout for "-"), then
 * commit (fsync + rename) or abort (unlink). */
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
/* Unlink every temp file still open through kv_outfile_open (or the
 * writer).  Async-signal-safe: a front end may call it from a SIGINT/SIGTERM
 * handler before re-raising, so an interrupted write leaves nothing behind. */
void kv_outfile_cleanup_all(void);

/* CRC-32C (Castagnoli) of a buffer, continuing from crc (start with 0). */
uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t n);
/* The portable table-driven path kv_crc32c falls back to without SSE4.2
 * (exposed so tests can check both paths). */
uint32_t kv_crc32c_sw(uint32_t crc, const void *buf, size_t n);

#endif
