/*
 * kv_tree_int: what the store's files share (kv_tree.c: the radix tree,
 * kv_tree_index.c: index.json, kv_tree_store.c: chunks, put and get,
 * kv_tree_place.c: placement, eviction and checks) and no caller needs.
 */
#ifndef KV_TREE_INT_H
#define KV_TREE_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tree/kv_tree.h"

#define INDEX_NAME "index.json"
#define MAX_INDEX_BYTES (1u << 30)
#define MAX_TREE_TOKENS (1 << 26) /* tokens over all edges: bounds memory on bad input */
#define MAX_DIM (1 << 20)
#define RM_ZSTD_LEVEL 3 /* splits made by rm keep the node's tier; disk chunks get this level */

struct kv_tree_store {
    char *dir;
    int lock_fd;
    kv_tree *t;
    char **fresh; /* (n_fresh) chunk paths written since the last save */
    int n_fresh, cap_fresh;
    char **dead;  /* (n_dead) chunk paths to unlink once the index is saved */
    int n_dead, cap_dead;
};

float *tree_chunk_imp(const kvc_file *f, int n);
kv_status tree_chunk_open(const kv_tree_store *s, int i, kvc_file **out);
kv_status tree_chunk_rewrite_range(kv_tree_store *s, int i, const kvc_file *f, int a, int n, int zstd_level,
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
