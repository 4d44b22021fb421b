/*
 * kvc_int: what the .kvc reader's files share and no caller needs: the open
 * file's layout and the parser entry (kvc_file.c maps the bytes,
 * kvc_parse.c validates them).
 */
#ifndef KVC_INT_H
#define KVC_INT_H

#include "format/kvc.h"

#define KVC_HEADER_MAX (100u << 20)        /* safetensors' own limit */
#define KVC_ZSTD_MAX ((uint64_t)1 << 36)   /* 64 GiB decompressed */
#define KVC_DIM_MAX INT32_MAX

typedef struct {
    char enc[2][8];           /* [k, v]: "f16", "kivi", ... */
    kv_kivi_params kivi[2];
    uint64_t bytes, kv_bytes; /* all layers.{i}.* tensors; only K/V parts */
} layer_info;

struct kvc_file {
    void *map;       /* mmap of a regular file, or NULL */
    size_t map_len;
    uint8_t *owned;  /* heap bytes (stdin, zstd, kvc_open_mem), or NULL */
    const uint8_t *bytes; /* the uncompressed file */
    size_t len;
    uint64_t file_bytes;
    bool zstd;
    bool trusted;    /* kvc_open_view: the bytes were checksummed as a whole */
    bool head_only;  /* kvc_open_head: bytes holds the header alone, len is the file's length;
                        tensors have no data (NULL) */
    uint64_t data_start; /* where the data section starts (8 + the header's length) */

    kvc_tensor *t;   /* (nt) in data order */
    int nt;
    int *by_name;    /* (nt) indices into t, sorted by name */
    char **mkey, **mval; /* (nm) metadata in header order */
    int nm;
    int *meta_by_key; /* (nm) sorted by key */
    int n_crc;

    kv_geom g;
    layer_info *li;  /* (g.n_layers) */
};

/* Validate f->bytes (f->len) in passes and fill the tables and geometry;
 * KV_E_DATA (or KV_E_UNSUPPORTED) with a message naming what is wrong. */
kv_status kvc_parse(kvc_file *f);

#endif
