/*
 * kv_tree: the prefix-sharing KV store (man/kv-tree.1) in four files: this
 * one holds the tier names and the in-memory radix tree over token ids
 * (unit-tested against a brute-force oracle); kv_tree_index.c reads and
 * writes index.json; kv_tree_store.c holds the store on disk (importance,
 * chunk files, put, get); kv_tree_place.c keeps it within its budgets
 * (place, rm, gc) and checks it.
 */#include "tree/kv_tree_int.h"

#include <stdlib.h>
#include <string.h>

static const char *tier_names[KV_TIER_COUNT] = {"gpu", "host", "disk"};

const char *kv_tier_name(kv_tier t) { return (unsigned)t < KV_TIER_COUNT ? tier_names[t] : "?"; }

int kv_tier_parse(const char *s)
{
    for (int i = 0; i < KV_TIER_COUNT; i++)
        if (s && !strcmp(s, tier_names[i])) return i;
    return -1;
}

// --- the radix tree ----------------------------------------------------------

static kv_status node_new(kv_tree *t, int *out)
{
    if (t->n_nodes == t->cap_nodes) {
        int cap = t->cap_nodes ? t->cap_nodes * 2 : 16;
        kv_tree_node *p = realloc(t->nodes, (size_t)cap * sizeof *p);
        if (!p) return kv_fail(KV_E_NOMEM, "cannot grow the tree to %d nodes", cap);
        t->nodes = p;
        t->cap_nodes = cap;
    }
    kv_tree_node *nd = &t->nodes[t->n_nodes];
    memset(nd, 0, sizeof *nd);
    nd->parent = -1;
    nd->live = true;
    nd->tier = KV_TIER_DISK;
    nd->enc = t->enc[KV_TIER_DISK];
    nd->chunk_version = nd->enc.sketch ? 3 : 2;
    *out = t->n_nodes++;
    return KV_OK;
}

static kv_status child_push(kv_tree_node *nd, int c)
{
    if (nd->n_child == nd->cap_child) {
        int cap = nd->cap_child ? nd->cap_child * 2 : 4;
        int *p = realloc(nd->child, (size_t)cap * sizeof *p);
        if (!p) return kv_fail(KV_E_NOMEM, "cannot grow a child list");
        nd->child = p;
        nd->cap_child = cap;
    }
    nd->child[nd->n_child++] = c;
    return KV_OK;
}

static void child_drop(kv_tree_node *nd, int c)
{
    for (int i = 0; i < nd->n_child; i++)
        if (nd->child[i] == c) {
            memmove(&nd->child[i], &nd->child[i + 1], (size_t)(nd->n_child - i - 1) * sizeof *nd->child);
            nd->n_child--;
            return;
        }
}

int tree_find_child(const kv_tree *t, int i, int32_t tok)
{
    const kv_tree_node *nd = &t->nodes[i];
    for (int c = 0; c < nd->n_child; c++)
        if (t->nodes[nd->child[c]].tokens[0] == tok) return nd->child[c];
    return -1;
}

kv_status kv_tree_new(kv_tree **out)
{
    *out = NULL;
    kv_tree *t = calloc(1, sizeof *t);
    if (!t) return kv_fail(KV_E_NOMEM, "cannot allocate a tree");
    kv_tree_encodings_default(t->enc);
    t->group_rows = KV_TREE_GROUP_ROWS;
    int root;
    kv_status st = node_new(t, &root);
    if (st) {
        free(t);
        return st;
    }
    kv_geom_defaults(&t->geom.g);
    t->geom.dtype = KV_DT_F32;
    *out = t;
    return KV_OK;
}

void kv_tree_free(kv_tree *t)
{
    if (!t) return;
    for (int i = 0; i < t->n_nodes; i++) {
        free(t->nodes[i].tokens);
        free(t->nodes[i].child);
    }
    free(t->nodes);
    free(t);
}

int kv_tree_match(const kv_tree *t, const int32_t *tok, int n, int *path, int *n_path, int *last_used)
{
    int cur = 0, m = 0, np = 0, used = 0;
    while (m < n) {
        int c = tree_find_child(t, cur, tok[m]);
        if (c < 0) break;
        const kv_tree_node *ch = &t->nodes[c];
        int k = 0;
        while (k < ch->n && m + k < n && ch->tokens[k] == tok[m + k]) k++;
        path[np++] = c;
        used = k;
        m += k;
        if (k < ch->n) break;
        cur = c;
    }
    *n_path = np;
    *last_used = used;
    return m;
}

kv_status kv_tree_split(kv_tree *t, int i, int off, int *head)
{
    if (i <= 0 || i >= t->n_nodes || off <= 0 || off >= t->nodes[i].n)
        return kv_fail(KV_E_INTERNAL, "bad split of node %d at %d", i, off);
    int32_t *htok = malloc((size_t)off * sizeof *htok);
    if (!htok) return kv_fail(KV_E_NOMEM, "cannot allocate a split");
    int h;
    kv_status st = node_new(t, &h);
    if (st) {
        free(htok);
        return st;
    }
    kv_tree_node *nd = &t->nodes[i], *hd = &t->nodes[h]; /* after node_new: it may move the array */
    if ((st = child_push(hd, i))) {
        free(htok);
        t->n_nodes--;
        return st;
    }
    memcpy(htok, nd->tokens, (size_t)off * sizeof *htok);
    memmove(nd->tokens, nd->tokens + off, (size_t)(nd->n - off) * sizeof *nd->tokens);
    hd->tokens = htok;
    hd->n = off;
    hd->start = nd->start;
    hd->parent = nd->parent;
    hd->tier = nd->tier;
    hd->hits = nd->hits;
    hd->last_use = nd->last_use;
    hd->imp_mean = nd->imp_mean, hd->imp_min = nd->imp_min, hd->imp_max = nd->imp_max;
    hd->imp_attention = nd->imp_attention;
    nd->n -= off;
    nd->start += off;
    kv_tree_node *p = &t->nodes[nd->parent];
    for (int c = 0; c < p->n_child; c++)
        if (p->child[c] == i) p->child[c] = h;
    nd->parent = h;
    *head = h;
    return KV_OK;
}

kv_status kv_tree_add(kv_tree *t, int parent, const int32_t *tok, int n, int *out)
{
    if (parent < 0 || parent >= t->n_nodes || n <= 0 || tree_find_child(t, parent, tok[0]) >= 0)
        return kv_fail(KV_E_INTERNAL, "bad add under node %d", parent);
    int32_t *cp = malloc((size_t)n * sizeof *cp);
    if (!cp) return kv_fail(KV_E_NOMEM, "cannot allocate %d tokens", n);
    int c;
    kv_status st = node_new(t, &c);
    if (st) {
        free(cp);
        return st;
    }
    if ((st = child_push(&t->nodes[parent], c))) {
        t->n_nodes--; /* drop the half-made node: it was the last one */
        free(cp);
        return st;
    }
    memcpy(cp, tok, (size_t)n * sizeof *cp);
    kv_tree_node *nd = &t->nodes[c];
    nd->tokens = cp;
    nd->n = n;
    nd->parent = parent;
    nd->start = t->nodes[parent].start + t->nodes[parent].n;
    *out = c;
    return KV_OK;
}

kv_status kv_tree_insert(kv_tree *t, const int32_t *tok, int n, kv_tree_insert_result *r)
{
    r->matched = 0, r->split_node = r->split_head = r->new_node = r->end_node = -1;
    if (n <= 0) return KV_OK;
    int *path = malloc((size_t)n * sizeof *path), np, used;
    if (!path) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    int m = kv_tree_match(t, tok, n, path, &np, &used);
    int end = np ? path[np - 1] : 0;
    free(path);
    kv_status st = KV_OK;
    r->matched = m;
    if (np && used < t->nodes[end].n) {
        if (m == n) { /* ends inside an edge: nothing to add, nothing to split */
            r->end_node = end;
            return KV_OK;
        }
        if ((st = kv_tree_split(t, end, used, &r->split_head))) return st;
        r->split_node = end;
        end = r->split_head;
    }
    if (m < n) {
        if ((st = kv_tree_add(t, end, tok + m, n - m, &r->new_node))) return st;
        end = r->new_node;
    }
    r->end_node = end;
    return KV_OK;
}

void kv_tree_remove(kv_tree *t, int i)
{
    if (i <= 0 || i >= t->n_nodes || !t->nodes[i].live) return;
    child_drop(&t->nodes[t->nodes[i].parent], i);
    /* Depth-first over the detached subtree with an explicit stack: the
     * child lists themselves hold the pending nodes. */
    int *stack = malloc((size_t)t->n_nodes * sizeof *stack), sp = 0;
    if (!stack) { /* cannot walk: at least the subtree root is gone */
        t->nodes[i].live = false;
        return;
    }
    stack[sp++] = i;
    while (sp) {
        kv_tree_node *nd = &t->nodes[stack[--sp]];
        nd->live = false;
        for (int c = 0; c < nd->n_child && sp < t->n_nodes; c++) stack[sp++] = nd->child[c];
    }
    free(stack);
}

