/*
 * kv_reuse: a prompt continued from its longest cached prefix in a kv-tree
 * store (kv-run --store), and the prompt's cache put back.  The store is
 * held open, and so locked, from the lookup to the insert: the prefix a
 * run continued from cannot change or be evicted in between, so the
 * insert stores exactly the new suffix.  The looked-up prefix stays in
 * memory; the dump to insert goes to a directory the caller chooses and is
 * removed.
 */
#ifndef KV_REUSE_H
#define KV_REUSE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/kv_runner.h"
#include "eval/kv_qaware.h"
#include "format/kvc.h"
#include "policy/kv_prefix.h"
#include "tree/kv_tree.h"

typedef struct {
    double important;    /* (0, 1]: disk-tier nodes contribute their top F tokens; 1: all */
    bool query_aware;    /* with important < 1: the prompt's own queries choose them (kv_qaware) */
    int keep_nq;         /* with query_aware: the runner's capture (kv_runner_keep), restored after the probe */
    bool keep_kv;
    bool insert;         /* put the prompt's cache after the run (needs kv_runner_keep before) */
    kv_tier tier;        /* of the inserted suffix (disk) */
    int zstd_level;      /* of disk chunks written (3) */
    const char *tmp_dir; /* an existing directory for the lookup's and the dump's files */
    int64_t now;         /* Unix seconds for hits and last-use times */
} kv_reuse_opts;

typedef struct {
    kv_tree_store *s;
    kvc_file *f;          /* the cached prefix, or NULL on a miss */
    kv_tree_rows rows;    /* ... or its rows chosen by the prompt's queries (query_aware) */
    kv_qaware_report qa;
    kv_tree_pending *pend; /* the query-aware rows still arriving, read beside the prefill (ended by it) */
    kv_prefix pre;
    kv_get_report get;
    kv_put_report put;
    bool inserted;
    double lookup_ms, insert_ms;
} kv_reuse;

/* Open the store (write lock when o->insert, else shared, and then the
 * lookup counts no hit) and check that its geometry fits m (KV_E_DATA). */
kv_status kv_reuse_open(kv_reuse *u, const char *store, const kv_model *m, const kv_reuse_opts *o);

/*
 * Look up tok[0 .. n-1) (the last token is always prefilled: its logits
 * are the first token's), load the cached prefix and prefill the rest on r
 * (fresh or reset).  info gets reused/prefilled tokens, bytes read per
 * tier, the lookup time and the time to the first token.
 */
kv_status kv_reuse_prefill(kv_reuse *u, kv_runner *r, const int *tok, int n, const kv_reuse_opts *o,
                           float *logits, kv_reuse_info *info);

/* Put the prompt's cache (kv_runner_dump_kvc of tok[0..n)) into the store
 * and commit the index; a prompt the store already holds whole adds nothing. */
kv_status kv_reuse_insert(kv_reuse *u, kv_runner *r, const int *tok, int n, const kv_reuse_opts *o);

/* The "reuse" object's extra members (get and put reports) as JSON text
 * (malloc'd, NULL without memory). */
char *kv_reuse_json(const kv_reuse *u);

void kv_reuse_close(kv_reuse *u);

#endif
