/*
 * libFuzzer target for the kv-tree index reader (lib/tree/kv_tree_index.c): parse
 * index.json text, and for every index it accepts check that formatting and
 * re-parsing is a fixed point and that matching along every node's own
 * path works.  Any crash, sanitizer report, leak or abort is a bug.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tree/kv_tree.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_tree *t = NULL, *u = NULL;
    if (kv_tree_index_parse((const char *)data, size, &t) != KV_OK) return 0;
    char *a = NULL, *b = NULL;
    if (kv_tree_index_format(t, &a) != KV_OK) abort();
    if (kv_tree_index_parse(a, strlen(a), &u) != KV_OK) abort(); /* we must read what we write */
    if (kv_tree_index_format(u, &b) != KV_OK || strcmp(a, b)) abort();
    /* Every node's full path (its ancestors' edges, then its own) matches. */
    for (int i = 1; i < t->n_nodes; i++) {
        int n = t->nodes[i].start + t->nodes[i].n;
        int32_t *seq = malloc((size_t)n * sizeof *seq + 1);
        int *path = malloc((size_t)n * sizeof *path + 1), np, used;
        if (!seq || !path) abort();
        for (int j = i; j > 0; j = t->nodes[j].parent)
            memcpy(seq + t->nodes[j].start, t->nodes[j].tokens, (size_t)t->nodes[j].n * sizeof *seq);
        if (kv_tree_match(t, seq, n, path, &np, &used) != n) abort();
        free(seq);
        free(path);
    }
    free(a);
    free(b);
    kv_tree_free(t);
    kv_tree_free(u);
    return 0;
}
