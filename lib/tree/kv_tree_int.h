/*
 * kv_tree_int: what the store's files share (kv_tree.c: the radix tree,
 * kv_tree_index.c: index.json, kv_tree_store.c: chunks, put and get,
 * kv_tree_place.c: placement, eviction and checks) and no caller needs.
 */
#ifndef KV_TREE_INT_H
#define KV_TREE_INT_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tree/kv_tree.h"

#define INDEX_NAME "index.json"
#define MAX_INDEX_BYTES (1u << 30)
#define MAX_TREE_TOKENS (1 << 26) /* tokens over all edges: bounds memory on bad input */
#define MAX_DIM (1 << 20)
#define RM_ZSTD_LEVEL 3 /* splits made by rm keep the node's tier; disk chunks get this level */

/* Frame buffers a store keeps between reads (tree_chunk_rows): one per
 * reading thread, grown to the largest frame read, so that a multi-MB
 * frame is not a fresh allocation (and its page faults) each time.  One
 * call at a time holds them (mu, tried: a concurrent reader of the same
 * store allocates its own); freed with the store. */
typedef struct {
    pthread_mutex_t mu;
    uint8_t **buf;
    size_t *cap;
    int n;
} tree_scratch;

/* The store's reading thread (kv_tree_store_load_start): started on the
 * first layered load and kept, so that its OpenMP team is too (a team
 * made afresh for a new thread cost a share of a millisecond per load on
 * the H200's host); one job at a time, a second load meanwhile gets a
 * thread of its own. */
typedef struct {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    void (*fn)(void *); /* the job posted, NULL when idle */
    void *arg;
    bool busy, stop;
} tree_worker;
/* Run fn(arg) on the store's worker (started when missing): false when it
 * is busy or cannot be started (the caller then runs it otherwise). */
bool tree_worker_post(kv_tree_store *s, void (*fn)(void *), void *arg);
void tree_worker_free(tree_worker *w);

struct kv_tree_store {
    char *dir;
    tree_scratch *scratch;
    tree_worker *worker;  /* NULL until a layered load needs it */
    int lock_fd;
    kv_tree *t;
    char **fresh; /* (n_fresh) chunk paths written since the last save */
    int n_fresh, cap_fresh;
    char **dead;  /* (n_dead) chunk paths to unlink once the index is saved */
    int n_dead, cap_dead;
};

/* One chunk to write: per layer, K and V rows in the store's dtype, laid
 * out [Hkv, src_T, D]. */
typedef struct {
    const void *const *k, *const *v; /* (L) source buffers */
    int src_T;
} chunk_src;

typedef struct {
    uint64_t off, len; /* in the chunk file */
    uint32_t crc;      /* CRC-32C of the frame's bytes */
    int rows;
} tree_frame;

/* An open chunk of either version: its tables in memory, rows read on
 * demand (version 2: only the frames that hold them). */
typedef struct {
    char name[KV_TREE_FILE_MAX];
    int fd;                 /* source: a descriptor (pread) ... */
    const uint8_t *mem;     /* ... or a buffer */
    uint64_t size;          /* of the file */
    uint64_t bytes_read;    /* so far */
    int version;
    int n, start, group_rows, n_frames;
    kv_tree_enc enc;
    int L, Hkv, D;
    kv_dtype dt;
    int q_heads, n_q;       /* query samples (0, 0: none) */
    uint32_t q_crc;
    uint64_t q_off;
    int sk_r;               /* key sketch channels per head (version 3; 0: none) */
    uint32_t sk_crc;
    uint64_t sk_off;
    bool positional;        /* rows stored in position order (version 3), else importance order */
    int32_t *tokens;        /* (n) edge token ids */
    float *imp;             /* (n) importances */
    int32_t *order;         /* (n) stored row j holds edge token order[j] */
    int *rank;              /* (n) inverse of order */
    tree_frame *frames;     /* (n_frames) */
    tree_scratch *scratch;  /* the store's frame buffers, or NULL: each frame allocates */
    kvc_file *v1;           /* version 1: the whole .kvc */
} tree_chunk;

/* Parse the head and tables of c's source (name, fd or mem, size set);
 * g (may be NULL) is the store geometry the chunk must have. */
kv_status tree_chunk_parse(tree_chunk *c, const kv_tree_geom *g);
/* Rows sel[0..k) (edge offsets) into rows [off, off+k) of
 * kdst[l], vdst[l] ([Hkv, dst_T, D] in the store's dtype). */
kv_status tree_chunk_rows(tree_chunk *c, const int *sel, int k, void *const *kdst, void *const *vdst, int dst_T, int off);
/* Rows of a chunk read one layer at a time (kv_tree_store_load_start): the
 * needed frames' headers parsed once (kvc_open_head), then per (layer,
 * frame) one read of that layer's K and V tensors, each checked against
 * its own CRC-32C before its rows are copied out. */
typedef struct {
    tree_chunk *c;
    const int *sel;
    int k, off;            /* rows sel[0..k) go to rows [off, off + k) of the destination */
    int *list, nl;         /* the frames read */
    int *first, *ent;      /* the selection's entries by frame (frame_plan) */
    kvc_file **head;       /* (nl) their headers */
    size_t span;           /* the most bytes of one layer's K and V in a frame */
} tree_layered;
/* *ok false when c cannot be read so (version 1, packed or zstd frames, a
 * tensor without its checksum): the caller reads it whole, tree_chunk_rows. */
kv_status tree_layered_begin(tree_chunk *c, const int *sel, int k, int off, tree_layered *y, bool *ok);
/* Layer l of frame list[li] into kdst[l], vdst[l] ([Hkv, dst_T, D]); buf:
 * room for y->span bytes. */
kv_status tree_layered_frame(const tree_layered *y, int li, int l, uint8_t *buf, void *const *kdst,
                             void *const *vdst, int dst_T);
void tree_layered_free(tree_layered *y);
/* The query samples, F32 [L, q_heads, n_q, D]. */
kv_status tree_chunk_queries(tree_chunk *c, float *q);
/* The key sketch (c->sk_r > 0): channels ch [L, Hkv, r], scales [L, Hkv, r]
 * and int8 codes [L, Hkv, n, r] in edge order (man/kvc.5). */
kv_status tree_chunk_sketch(tree_chunk *c, uint16_t *ch, float *scale, int8_t *code);
void tree_chunk_free(tree_chunk *c);
/* A version-2 chunk image of n tokens (src rows sel[0..n)); q (may be NULL)
 * F32 [L, q_heads, n_q, D]. */
kv_status tree_chunk_encode(const kv_tree_geom *tg, const kv_tree_enc *enc, int R, int sketch_want, int start, int n,
                            const int32_t *tok, const float *imp, const chunk_src *src, const int *sel,
                            const float *q, int q_heads, int n_q, int zstd_level, uint8_t **out, size_t *out_len);

/* Open node i's chunk (either version) and check it against the index. */
kv_status tree_node_open(const kv_tree_store *s, int i, tree_chunk *c);
tree_scratch *tree_scratch_new(void);
void tree_scratch_free(tree_scratch *x);
kv_status tree_chunk_rewrite_range(kv_tree_store *s, int i, tree_chunk *c, int a, int n, int zstd_level,
                                   bool retire_old);
int tree_cmp_str(const void *a, const void *b);
/* A node's file, sizes, tier, use and importance summary, added to the
 * JSON object o (index.json and kv-tree ls write them alike). */
struct cJSON;
void tree_node_json(struct cJSON *o, const kv_tree_node *nd);
/* A 64-bit count added to o as exact decimal text (cJSON would print a
 * double rounded to 15 digits). */
void tree_json_u64(struct cJSON *o, const char *key, uint64_t v);
void tree_json_i64(struct cJSON *o, const char *key, int64_t v);
int tree_find_child(const kv_tree *t, int i, int32_t tok);
void tree_imp_summary(kv_tree_node *nd, const float *imp, int n);
uint64_t tree_kv_bytes_of(const kv_tree *t, int n);
void tree_list_free(char **list, int n);
char *tree_path_join(const char *dir, const char *name);
kv_status tree_retire(kv_tree_store *s, const char *file);
kv_status tree_store_split(kv_tree_store *s, int i, int off, int zstd_level, uint64_t *written, int *head);

#endif
