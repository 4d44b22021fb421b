/*
 * kv_tree: a prefix-sharing KV-cache store (man/kv-tree.1), after IMPRESS.
 * A store is a directory: index.json holds a radix tree over token ids whose
 * every node owns one chunk file (a .kvc under chunks/) with exactly its edge
 * label's K/V for every layer plus a per-token importance.  Requests that
 * share a prefix share the nodes of that prefix, so a put stores only the
 * new suffix.  Each node also carries a tier (gpu, host, disk): a placement
 * decision a server would follow, made by kv_tree_store_place under byte budgets;
 * disk chunks are zstd-compressed and, when a caller asks, contribute only
 * their most important tokens to a get.
 *
 * The first half of this header is the in-memory radix tree (no files, unit
 * tested against a brute-force oracle); the second is the store on disk.
 * Like all of lib/, nothing here prints or exits.
 */
#ifndef KV_TREE_H
#define KV_TREE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/kv_status.h"
#include "format/kvc.h"

#define KV_TREE_INDEX_VERSION 2 /* 2: encodings, group_rows, per-node chunk and encoding */
#define KV_TREE_CHUNK_VERSION 3 /* newest chunk files read: 1 = a whole .kvc; 2 = frames (man/kvc.5);
                                   3 = frames + a key sketch (encodings with +sketch; others stay 2) */
#define KV_TREE_GROUP_ROWS 32   /* rows per frame of new chunks */
#define KV_TREE_SKETCH_MAX 4096 /* sketch_channels of an index, at most */
#define KV_TREE_FILE_MAX 48 /* "chunks/c<generation>.kvt" */
/* The largest byte count (budget, size) the index holds: JSON numbers are
 * doubles, exact up to 2^53.  Writers refuse more, the reader accepts up to
 * it, so every store that is written can be read back. */
#define KV_TREE_BYTES_MAX (UINT64_C(1) << 53)

typedef enum { KV_TIER_GPU = 0, KV_TIER_HOST = 1, KV_TIER_DISK = 2, KV_TIER_COUNT } kv_tier;

const char *kv_tier_name(kv_tier t);
/* "gpu", "host", "disk" -> tier; -1 if unknown. */
int kv_tier_parse(const char *s);

/* How a chunk stores its rows (man/kvc.5, "kv-tree chunks"): plain in the
 * store's dtype, or packed by KIVI or DSQ at 1, 2 or 4 bits (groups of
 * group_rows tokens), each frame optionally zstd-compressed.  Spelled "raw",
 * "kivi2", "dsq4+zstd", ... */
typedef enum { KV_TREE_ENC_RAW = 0, KV_TREE_ENC_KIVI = 1, KV_TREE_ENC_DSQ = 2 } kv_tree_codec;
typedef struct {
    kv_tree_codec codec;
    int bits;  /* 0 for raw */
    bool zstd;
    bool sketch; /* chunk version 3: rows in position order and a key sketch for query-aware loads */
} kv_tree_enc;

kv_status kv_tree_enc_parse(const char *s, kv_tree_enc *e); /* KV_E_USAGE when unknown */
void kv_tree_enc_format(const kv_tree_enc *e, char *buf, size_t n);
bool kv_tree_enc_equal(const kv_tree_enc *a, const kv_tree_enc *b);
/* The encoding of each tier: "lossless" (the default: gpu raw, host raw,
 * disk raw+zstd), "packed" (gpu raw, host kivi2, disk kivi2+zstd, as
 * LMCache and IMPRESS tier them) or a list "gpu=raw,host=dsq2,disk=...". */
kv_status kv_tree_encodings_parse(const char *s, kv_tree_enc enc[KV_TIER_COUNT]);
/* Same, over the encodings enc already holds: a preset sets every tier, a
 * list changes only the tiers it names (place --encodings host=E keeps the
 * store's gpu and disk encodings); on an error enc is left as it was. */
kv_status kv_tree_encodings_apply(const char *s, kv_tree_enc enc[KV_TIER_COUNT]);
void kv_tree_encodings_default(kv_tree_enc enc[KV_TIER_COUNT]);

typedef struct {
    int parent;          /* index into kv_tree.nodes; -1 for the root only */
    int start;           /* position of the first edge token in the sequence */
    int n;               /* edge length (0 for the root only) */
    int32_t *tokens;     /* (n) the edge label */
    int *child;          /* (n_child) indices of children, distinct first tokens */
    int n_child, cap_child;
    char file[KV_TREE_FILE_MAX]; /* chunk path relative to the store */
    uint64_t bytes;      /* size of the chunk file */
    uint64_t kv_bytes;   /* uncompressed K/V bytes of the chunk */
    kv_tier tier;
    uint64_t hits;       /* requests whose matched path included this node */
    int64_t last_use;    /* unix seconds of the last such request */
    float imp_mean, imp_min, imp_max; /* importance summary of the edge tokens */
    bool imp_attention;  /* importance from attention (true) or key norms */
    int chunk_version;   /* 1: a whole .kvc (stores of index version 1); 2: frames */
    kv_tree_enc enc;     /* how the chunk stores its rows (version 1: raw, +zstd on disk) */
    bool live;           /* false once removed (slot kept until save) */
} kv_tree_node;

/* Store geometry: what every put must match. */
typedef struct {
    kv_geom g;          /* n_tokens and n_q are 0 here */
    kv_dtype dtype;     /* of every K/V tensor */
} kv_tree_geom;

typedef struct {
    kv_tree_node *nodes; /* (n_nodes) nodes[0] is the root */
    int n_nodes, cap_nodes;
    bool has_geom;       /* false until the first put */
    kv_tree_geom geom;
    uint64_t generation; /* last chunk file number handed out */
    uint64_t gpu_budget, host_budget; /* from the last place (0 = none) */
    bool has_budgets;
    kv_tree_enc enc[KV_TIER_COUNT]; /* the encoding of each tier's chunks */
    int group_rows;      /* rows per frame of new chunks */
    int sketch_channels; /* key sketch channels per head of new chunks (0: head_dim / 2) */
} kv_tree;

kv_status kv_tree_new(kv_tree **out);
void kv_tree_free(kv_tree *t);

/*
 * Longest prefix of tok[0..n) spelled by the tree.  Returns the number of
 * matched tokens; path[0..*n_path) gets the indices of the nodes entered
 * (root excluded), the last possibly only partly: *last_used tokens of its
 * edge matched (0 when n_path is 0).  path needs room for n entries.
 */
int kv_tree_match(const kv_tree *t, const int32_t *tok, int n, int *path, int *n_path, int *last_used);

/* Split node i after `off` edge tokens (0 < off < n): a new head node takes
 * the first off tokens and becomes i's parent; i keeps the rest and its
 * children.  Chunk fields of the head are left empty for the caller. */
kv_status kv_tree_split(kv_tree *t, int i, int off, int *head);
/* Add a child of parent with edge tok[0..n) (its first token must be new
 * among the parent's children). */
kv_status kv_tree_add(kv_tree *t, int parent, const int32_t *tok, int n, int *out);

typedef struct {
    int matched;      /* tokens already in the tree */
    int split_node;   /* node split at the divergence point, or -1 */
    int split_head;   /* its new head node, or -1 */
    int new_node;     /* node holding the new suffix, or -1 if none */
    int end_node;     /* node where the sequence ends (-1 if n == 0) */
} kv_tree_insert_result;

/* Insert tok[0..n) structurally: match, split where it diverges mid-edge,
 * add one node for the remaining suffix. */
kv_status kv_tree_insert(kv_tree *t, const int32_t *tok, int n, kv_tree_insert_result *r);

/* Mark node i and its subtree removed (they stay in the array, not live). */
void kv_tree_remove(kv_tree *t, int i);

/* Index (de)serialisation.  Parse validates everything it reads: versions,
 * types, ranges, tree shape (one root, no cycles, start positions, distinct
 * first tokens), safe chunk file names; anything wrong is KV_E_DATA. */
kv_status kv_tree_index_parse(const char *text, size_t len, kv_tree **out);
/* Serialised text (malloc'd, NUL-terminated); live nodes only, renumbered. */
kv_status kv_tree_index_format(const kv_tree *t, char **out);

/*
 * Token importance of a .kvc (n = its token count, imp has room for n).
 * With query samples (layers.i.q): the attention mass each key receives
 * from the stored queries (causal: query j of Q sees keys [0, T-Q+j]),
 * averaged over layers, heads and queries; without: the key L2 norm
 * averaged over layers and KV heads.  Either way scaled so the mean over
 * the n tokens is 1.  *attention says which was used.
 */
kv_status kv_tree_importance(const kvc_file *f, float *imp, bool *attention);

// --- the store on disk -----------------------------------------------------

typedef struct kv_tree_store kv_tree_store;

/* Create a store directory (its parent must exist); KV_E_CANTCREATE if it
 * already holds an index. */
kv_status kv_tree_store_create(const char *dir);
/* Same, with the tiers' encodings (NULL: lossless). */
kv_status kv_tree_store_create_ex(const char *dir, const kv_tree_enc enc[KV_TIER_COUNT]);
/* Same, with the store's sketch_channels in its first index (0: half of
 * head_dim; outside [0, KV_TREE_SKETCH_MAX] KV_E_USAGE before anything
 * is created). */
kv_status kv_tree_store_create_sk(const char *dir, const kv_tree_enc enc[KV_TIER_COUNT], int sketch_channels);
/* Change the tiers' encodings; the next kv_tree_store_place re-encodes
 * every chunk whose encoding then differs from its tier's. */
void kv_tree_store_set_encodings(kv_tree_store *s, const kv_tree_enc enc[KV_TIER_COUNT]);
/* Key sketch channels per head of the chunks written from now on (0: a
 * half of head_dim; at most KV_TREE_SKETCH_MAX, else KV_E_USAGE); kept in
 * the index by the next write. */
kv_status kv_tree_store_set_sketch_channels(kv_tree_store *s, int channels);
/* Open a store; write = take the lock exclusively (else shared). */
kv_status kv_tree_store_open(const char *dir, bool write, kv_tree_store **out);
void kv_tree_store_close(kv_tree_store *s);
const kv_tree *kv_tree_store_tree(const kv_tree_store *s);
/* Commit the index after changes (atomic), then delete replaced chunks. */
kv_status kv_tree_store_save(kv_tree_store *s);

typedef struct {
    int tokens, matched;
    int nodes_split;
    uint64_t bytes_added;     /* chunk file bytes of the new suffix node */
    uint64_t kv_bytes_added;  /* its uncompressed K/V bytes */
    uint64_t kv_bytes_shared; /* K/V bytes of the matched prefix, not stored again */
    uint64_t bytes_rewritten; /* file bytes written to split existing chunks */
    bool attention;           /* importance source */
    kv_tier tier;             /* of the new node */
} kv_put_report;

/* Insert a .kvc with a tokens tensor: plain K/V (in the store's dtype), or
 * KIVI/DSQ-packed layers, which are decoded (kvc(5)) into the store's dtype
 * (F16 for a new store); a file with positions is refused (KV_E_DATA).
 * The new suffix node keeps the input's query samples. */
kv_status kv_tree_store_put(kv_tree_store *s, const kvc_file *f, kv_tier tier, int zstd_level, int64_t now,
                       kv_put_report *r);

typedef struct {
    int tokens, matched;      /* request length; cached prefix length */
    int kept, skipped;        /* tokens written; tokens left out by --important */
    int nodes;
    uint64_t bytes_read[KV_TIER_COUNT];    /* chunk file bytes read per tier: with --important,
                                              only the head and the frames holding kept rows */
    uint64_t kv_bytes_out[KV_TIER_COUNT];  /* K/V bytes taken from each tier */
    bool positions;           /* output carries a positions tensor */
    int n_q;                  /* query samples written per layer (0: none) */
} kv_get_report;

/* Write the longest cached prefix of tok[0..n) to out_path as a .kvc.
 * frac in (0, 1): disk-tier chunks contribute only their top
 * ceil(frac * n) tokens by importance (frac >= 1: everything).  touch:
 * count the hit and update last-use times (the caller then saves). */
kv_status kv_tree_store_get(kv_tree_store *s, const int32_t *tok, int n, double frac, bool touch, int64_t now,
                       const char *out_path, kv_get_report *r);
/* Same, in memory: *out is the .kvc that kv_tree_store_get would write
 * (plain K/V in the store's dtype, tokens, importance, kvtree.matched,
 * positions when frac < 1, queries when the match ends where a put that had
 * them ended and there are no positions); kvc_close it. */
kv_status kv_tree_store_get_kvc(kv_tree_store *s, const int32_t *tok, int n, double frac, bool touch, int64_t now,
                                kvc_file **out, kv_get_report *r);

/* Where the rows of a load go: an allocator for their one block (pinned
 * host memory that the GPU copies at full speed, a reused arena); NULL:
 * malloc. */
typedef struct {
    void *(*alloc)(void *user, size_t n);
    void (*free)(void *user, void *p);
    void *user;
} kv_tree_alloc;

/* A cached prefix read back into memory (kv_tree_store_load). */
typedef struct {
    int T, matched;            /* rows; prompt tokens the match covered (rows <= matched) */
    int n_layers, n_kv_heads, head_dim;
    kv_dtype dt;               /* the store's */
    void **k, **v;             /* (n_layers) each (n_kv_heads, T, head_dim) of dt, inside kv */
    void *kv;
    kv_tree_alloc al;          /* what kv came from (alloc NULL: malloc) */
    int32_t *tokens, *positions; /* (T) ids and positions, increasing */
    float *imp;                /* (T) importances */
    float *q;                  /* query samples F32 (n_layers, q_heads, n_q, head_dim), or NULL */
    int q_heads, n_q;
} kv_tree_rows;

/*
 * The longest cached prefix of tok[0..n) as rows in memory: what get
 * writes, without the file.  Rows from every node of the match, or with
 * frac in (0, 1) only the top ceil(frac * n) of each disk-tier node by
 * importance, or (pick non-NULL) exactly the positions pick[0..n_pick),
 * increasing and inside the match (a caller's own importance: query-aware
 * loading).  Only the frames holding the rows are read (bytes_read).
 */
kv_status kv_tree_store_load(kv_tree_store *s, const int32_t *tok, int n, double frac, const int32_t *pick,
                             int n_pick, bool touch, int64_t now, kv_tree_rows *out, kv_get_report *r);
/* The same, the K/V block from al (NULL: malloc). */
kv_status kv_tree_store_load_ex(kv_tree_store *s, const int32_t *tok, int n, double frac, const int32_t *pick,
                                int n_pick, bool touch, int64_t now, const kv_tree_alloc *al, kv_tree_rows *out,
                                kv_get_report *r);
void kv_tree_rows_free(kv_tree_rows *x);

/*
 * kv_tree_store_load_ex with its K/V rows read beside the caller: when it
 * returns, out holds everything but the rows (T, positions, tokens,
 * importances, the allocated K/V block) and a thread of its own reads the
 * rows layer by layer, layer 0 first, with `threads` OpenMP threads.  Raw
 * uncompressed frames are read per layer: each frame's header once
 * (kvc_open_head), then one read per (layer, frame) of that layer's K and
 * V tensors, each checked against its own CRC-32C before its rows are
 * copied out (the frame's whole-frame CRC is kv-tree check's).  Chunks of
 * other encodings are read whole first, before layer 0 is given.
 * kv_tree_rows_wait(p, l) returns once layers 0..l are in place (or the
 * read's error); kv_tree_load_finish joins the read, fills r as load_ex
 * does, touches the nodes when asked and all went well, and frees p; on an
 * error out is freed.  Until then the store may be read (other loads, a
 * key sketch: reads change nothing in it) but not changed, nor closed (the
 * read owns the chunks it opened).  read_ms: the read's own time; wait_ms: the
 * callers' time in kv_tree_rows_wait (either may be NULL).
 */
typedef struct kv_tree_pending kv_tree_pending;
kv_status kv_tree_store_load_start(kv_tree_store *s, const int32_t *tok, int n, double frac, const int32_t *pick,
                                   int n_pick, bool touch, int64_t now, const kv_tree_alloc *al, int threads,
                                   kv_tree_rows *out, kv_tree_pending **p);
kv_status kv_tree_rows_wait(kv_tree_pending *p, int layer);
kv_status kv_tree_load_finish(kv_tree_pending *p, kv_get_report *r, double *read_ms, double *wait_ms);
/* kv_tree_rows_wait for a kv_prefix's wait hook (user: the pending load). */
kv_status kv_tree_pending_wait(void *p, int layer);
/* The threads a load beside a prefill reads with: the cores but the one
 * that drives the engine, 1 to 16. */
int kv_tree_load_threads(void);

/* The key sketch of a cached prefix, node by node (kv_tree_store_sketch):
 * what a query-aware load scores the prefix with before it reads rows. */
typedef struct {
    int start, n;        /* prefix positions [start, start + n) (n: the rows matched) */
    int rows, r;         /* the node's rows (code's stride); channels per head */
    int frame_rows;      /* rows per frame: the unit a load reads (frames are in position order) */
    uint16_t *ch;        /* (n_layers, n_kv_heads, r) channels kept, increasing */
    float *scale;        /* (n_layers, n_kv_heads, r) */
    int8_t *code;        /* (n_layers, n_kv_heads, rows, r): key[ch] ~= code * scale */
} kv_tree_sketch_seg;
typedef struct {
    int matched, nseg;
    kv_tree_sketch_seg *seg; /* (nseg) */
    uint64_t bytes_read[KV_TIER_COUNT];
    kv_tree_alloc al;        /* what the segments' code came from (alloc NULL: malloc) */
} kv_tree_sketch;

/* The sketches of the nodes matching tok[0..n): every chunk of the match
 * must have one (version 3, a tier encoding with +sketch), else
 * KV_E_UNSUPPORTED. */
kv_status kv_tree_store_sketch(kv_tree_store *s, const int32_t *tok, int n, kv_tree_sketch *out);
/* The same, each segment's code (the bulk, what a GPU scoring uploads) from
 * al (NULL: malloc): pinned host memory copies at full PCIe speed.  al's
 * alloc is called on the thread that reads, its free (never with NULL) by
 * kv_tree_sketch_free on whichever thread calls that. */
kv_status kv_tree_store_sketch_ex(kv_tree_store *s, const int32_t *tok, int n, const kv_tree_alloc *al,
                                  kv_tree_sketch *out);
/* Channels a new chunk's sketch keeps of each key of head_dim channels:
 * want (the tree's sketch_channels) when it is in [1, head_dim], more
 * than head_dim gives head_dim, 0 half of head_dim (a quarter before
 * session 11: chunks keep the count they were written with). */
int kv_tree_sketch_channels(int head_dim, int want);
void kv_tree_sketch_free(kv_tree_sketch *k);

typedef struct {
    int nodes[KV_TIER_COUNT];
    uint64_t kv_bytes[KV_TIER_COUNT];
    int moved;                /* nodes whose tier changed */
    int reencoded;            /* chunks rewritten in their tier's encoding */
    uint64_t bytes_rewritten;
} kv_place_report;

/* Score of a node at time now (man/kv-tree.1, PLACEMENT). */
double kv_tree_score(const kv_tree_node *nd, int64_t now, double half_life);
/* Assign tiers under the budgets (bytes of uncompressed K/V, at most
 * KV_TREE_BYTES_MAX each, else KV_E_USAGE) and rewrite the chunks whose
 * compression changes. */
kv_status kv_tree_store_place(kv_tree_store *s, uint64_t gpu_bytes, uint64_t host_bytes, double half_life,
                         int zstd_level, int64_t now, kv_place_report *r);

typedef struct {
    int nodes_removed;
    uint64_t bytes_freed;
    int orphans_removed;      /* chunk files the index did not name */
    int temps_removed;        /* leftover index temp files (.index.json.XXXXXX) */
    uint64_t bytes_after;
} kv_evict_report;

/* Remove every cached token that follows the prefix tok[0..n) (n >= 1). */
kv_status kv_tree_store_rm(kv_tree_store *s, const int32_t *tok, int n, kv_evict_report *r);
/* Evict lowest-score leaves until chunk files total <= max_bytes, commit
 * the index (gc saves by itself: orphans may only be deleted after the
 * commit), then delete orphaned chunk files and leftover index temp files. */
kv_status kv_tree_store_gc(kv_tree_store *s, uint64_t max_bytes, double half_life, int64_t now,
                      kv_evict_report *r);

typedef struct {
    int nodes, chunks_ok;
    int n_problems;
    char **problems;          /* (n_problems) one line each */
    int orphans;              /* chunk files not in the index (not damage) */
    int temp_files;           /* leftover index temp files of interrupted writes (not damage; gc removes them) */
} kv_check_report;

/* Parse a version-2 chunk file image (head, tables, frame index), decode
 * every frame and the query samples: what kv-tree check does to each chunk,
 * without a store (the fuzzer's entry).  *n_rows gets the token count. */
kv_status kv_tree_chunk_verify_mem(const void *buf, size_t len, int *n_rows);
/* The same, and the rows read again layer by layer as a load beside a
 * prefill reads them (raw uncompressed frames: each frame's header, then
 * each layer's K and V with their own checksums), which must give the
 * same bytes (KV_E_INTERNAL if not): for the fuzzer and tests. */
kv_status kv_tree_chunk_verify_layered_mem(const void *buf, size_t len, int *n_rows);

/* Verify every chunk against the index.  Returns KV_OK even when problems
 * are found (they are in the report); other statuses mean it could not run. */
kv_status kv_tree_store_check(kv_tree_store *s, kv_check_report *r);
void kv_check_report_clear(kv_check_report *r);

// --- reports as JSON (man/kv-tree.1 REPORTS; malloc'd, no newline; NULL: no memory)

#define KV_TREE_HALF_LIFE 3600.0 /* seconds: the default recency half-life */

char *kv_put_report_json(const kv_put_report *r);
char *kv_get_report_json(const kv_get_report *r);
char *kv_place_report_json(const kv_place_report *r, uint64_t gpu_budget, uint64_t host_budget);
char *kv_evict_report_json(const kv_evict_report *r);
char *kv_check_report_json(const kv_check_report *r);

typedef struct {
    int nodes;          /* not counting the root */
    long tokens;        /* over every edge */
    uint64_t bytes;     /* chunk file bytes */
    uint64_t kv_bytes;  /* their uncompressed K/V bytes */
} kv_tree_total;
void kv_tree_totals(const kv_tree *t, kv_tree_total *tot);
/* kv-tree ls --json: the totals, the geometry and one object per node
 * (scored at now with half_life). */
char *kv_tree_ls_json(const kv_tree *t, const char *store, int64_t now, double half_life);
/* kv-tree ls: that JSON (json) or a table with one row per node, to f;
 * KV_E_IO when f has an error. */
kv_status kv_tree_ls_write(FILE *f, bool json, const kv_tree *t, const char *store, int64_t now, double half_life);

#endif
