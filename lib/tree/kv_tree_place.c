/*
 * kv_tree_place: what keeps a store within its budgets: tier placement by
 * score, rm of a prefix's continuations, gc of the least valuable leaves
 * and of orphaned chunks, and the consistency check.
 */
#include "tree/kv_tree_int.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

// --- place ------------------------------------------------------------------------

double kv_tree_score(const kv_tree_node *nd, int64_t now, double half_life)
{
    double age = (double)(now - nd->last_use);
    if (age < 0) age = 0;
    return (double)nd->imp_mean * (1.0 + (double)nd->hits) * exp2(-age / (half_life > 0 ? half_life : 1));
}

/* Rewrite node i's whole chunk in its tier's encoding (a version-1 chunk
 * becomes version 2). */
static kv_status chunk_reencode(kv_tree_store *s, int i, int zstd_level)
{
    tree_chunk c;
    kv_status st = tree_node_open(s, i, &c);
    if (st) return st;
    st = tree_chunk_rewrite_range(s, i, &c, 0, s->t->nodes[i].n, zstd_level, true);
    tree_chunk_free(&c);
    return st;
}

/* Does node i's chunk need rewriting for its tier?  Version-1 chunks always
 * do (place is the upgrade path to chunk version 2). */
static bool needs_reencode(const kv_tree *t, const kv_tree_node *nd)
{
    return nd->chunk_version == 1 || !kv_tree_enc_equal(&nd->enc, &t->enc[nd->tier]);
}

kv_status kv_tree_store_place(kv_tree_store *s, uint64_t gpu_bytes, uint64_t host_bytes, double half_life,
                         int zstd_level, int64_t now, kv_place_report *r)
{
    memset(r, 0, sizeof *r);
    if (gpu_bytes > KV_TREE_BYTES_MAX || host_bytes > KV_TREE_BYTES_MAX)
        return kv_fail(KV_E_USAGE, "a tier budget of %llu bytes is beyond the index's 2^53",
                       (unsigned long long)(gpu_bytes > host_bytes ? gpu_bytes : host_bytes));
    kv_tree *t = s->t;
    int n = t->n_nodes;
    int *nt = malloc((size_t)n * sizeof *nt);
    double *score = malloc((size_t)n * sizeof *score);
    kv_status st = KV_OK;
    if (!nt || !score) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate the placement");
        goto out;
    }
    for (int i = 0; i < n; i++) {
        nt[i] = -1;
        score[i] = kv_tree_score(&t->nodes[i], now, half_life);
    }
    /* Greedy by score over the frontier: a node may take a tier only once
     * its parent holds that tier or a faster one, so every cached prefix is
     * as fast as anything that extends it. */
    uint64_t budget[2] = {gpu_bytes, host_bytes};
    for (int tier = KV_TIER_GPU; tier <= KV_TIER_HOST; tier++) {
        uint64_t left = budget[tier];
        for (;;) {
            int best = -1;
            for (int i = 1; i < n; i++) {
                const kv_tree_node *nd = &t->nodes[i];
                if (!nd->live || nt[i] >= 0 || nd->kv_bytes > left) continue;
                if (nd->parent != 0 && (nt[nd->parent] < 0 || nt[nd->parent] > tier)) continue;
                if (best < 0 || score[i] > score[best]) best = i;
            }
            if (best < 0) break;
            nt[best] = tier;
            left -= t->nodes[best].kv_bytes;
        }
    }
    for (int i = 1; i < n && !st; i++) {
        kv_tree_node *nd = &t->nodes[i];
        if (!nd->live) continue;
        kv_tier to = nt[i] < 0 ? KV_TIER_DISK : (kv_tier)nt[i], from = nd->tier;
        nd->tier = to;
        if (to != from) r->moved++;
        if (needs_reencode(t, nd)) {
            if ((st = chunk_reencode(s, i, zstd_level))) break;
            r->bytes_rewritten += nd->bytes;
            r->reencoded++;
        }
        r->nodes[to]++;
        r->kv_bytes[to] += nd->kv_bytes;
    }
    t->gpu_budget = gpu_bytes, t->host_budget = host_bytes, t->has_budgets = true;
out:
    free(nt);
    free(score);
    return st;
}

// --- rm and gc ------------------------------------------------------------------------

/* Retire the chunks of node i's live subtree and remove it. */
static kv_status drop_subtree(kv_tree_store *s, int i, kv_evict_report *r)
{
    kv_tree *t = s->t;
    int *stack = malloc((size_t)t->n_nodes * sizeof *stack), sp = 0;
    if (!stack) return kv_fail(KV_E_NOMEM, "cannot allocate a stack");
    kv_status st = KV_OK;
    stack[sp++] = i;
    while (sp && !st) {
        const kv_tree_node *nd = &t->nodes[stack[--sp]];
        r->nodes_removed++;
        r->bytes_freed += nd->bytes;
        st = tree_retire(s, nd->file);
        for (int c = 0; c < nd->n_child && sp < t->n_nodes; c++) stack[sp++] = nd->child[c];
    }
    free(stack);
    if (!st) kv_tree_remove(t, i);
    return st;
}

static uint64_t live_bytes(const kv_tree *t)
{
    uint64_t b = 0;
    for (int i = 1; i < t->n_nodes; i++)
        if (t->nodes[i].live) b += t->nodes[i].bytes;
    return b;
}

kv_status kv_tree_store_rm(kv_tree_store *s, const int32_t *tok, int n, kv_evict_report *r)
{
    memset(r, 0, sizeof *r);
    kv_tree *t = s->t;
    kv_status st = KV_OK;
    int *path = malloc((size_t)(n ? n : 1) * sizeof *path), np, used;
    if (!path) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    int m = n > 0 ? kv_tree_match(t, tok, n, path, &np, &used) : 0;
    if (n > 0 && m == n) { /* else no cached sequence extends the prefix */
        int last = path[np - 1];
        if (used < t->nodes[last].n) {
            uint64_t w = 0;
            int head;
            if (!(st = tree_store_split(s, last, used, RM_ZSTD_LEVEL, &w, &head))) st = drop_subtree(s, last, r);
        } else {
            while (!st && t->nodes[last].n_child) st = drop_subtree(s, t->nodes[last].child[0], r);
        }
    }
    r->bytes_after = live_bytes(t);
    free(path);
    return st;
}

/* Temp files of index writes that never committed (a writer killed between
 * creating ".index.json.XXXXXX" and renaming it).  Only a lock holder
 * writes the index, so under the lock every such file is a leftover. */
static bool index_temp_name(const char *name)
{
    static const char pre[] = "." INDEX_NAME ".";
    return strncmp(name, pre, sizeof pre - 1) == 0 && strlen(name) == sizeof pre - 1 + 6;
}

/* Count (dry) or delete the leftover index temp files. */
static kv_status remove_index_temps(kv_tree_store *s, int *count, bool dry)
{
    *count = 0;
    DIR *d = opendir(s->dir);
    if (!d) return kv_fail(KV_E_IO, "cannot read %s: %s", s->dir, strerror(errno));
    kv_status st = KV_OK;
    struct dirent *e;
    while ((e = readdir(d)) && !st) {
        if (!index_temp_name(e->d_name)) continue;
        (*count)++;
        if (dry) continue;
        char *p = tree_path_join(s->dir, e->d_name);
        if (!p) st = kv_fail(KV_E_NOMEM, "cannot allocate a path");
        else unlink(p); /* a failure leaves it for the next gc */
        free(p);
    }
    closedir(d);
    return st;
}

/* Delete chunk files (and temp files of interrupted writes) that no live
 * node names.  Only safe under the exclusive lock, after the index is saved. */
static kv_status remove_orphans(kv_tree_store *s, int *count, bool dry)
{
    *count = 0;
    char *cdir = tree_path_join(s->dir, "chunks");
    if (!cdir) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    DIR *d = opendir(cdir);
    if (!d) {
        kv_status st = kv_fail(KV_E_DATA, "cannot read %s: %s", cdir, strerror(errno));
        free(cdir);
        return st;
    }
    char **names = malloc((size_t)s->t->n_nodes * sizeof *names);
    int nn = 0;
    if (names) {
        for (int i = 1; i < s->t->n_nodes; i++)
            if (s->t->nodes[i].live) names[nn++] = s->t->nodes[i].file + 7; /* past "chunks/" */
        qsort(names, (size_t)nn, sizeof *names, tree_cmp_str);
    }
    struct dirent *e;
    while (names && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        const char *key = e->d_name;
        if (bsearch(&key, names, (size_t)nn, sizeof *names, tree_cmp_str)) continue;
        (*count)++;
        if (!dry) {
            char *p = tree_path_join(cdir, e->d_name);
            if (p) unlink(p);
            free(p);
        }
    }
    closedir(d);
    free(cdir);
    kv_status st = names ? KV_OK : kv_fail(KV_E_NOMEM, "cannot allocate a name list");
    free(names);
    return st;
}

kv_status kv_tree_store_gc(kv_tree_store *s, uint64_t max_bytes, double half_life, int64_t now, kv_evict_report *r)
{
    memset(r, 0, sizeof *r);
    kv_tree *t = s->t;
    kv_status st = KV_OK;
    uint64_t total = live_bytes(t);
    while (total > max_bytes && !st) {
        /* The least valuable leaf: lowest score, then least recently used,
         * then largest.  Only leaves go, so every kept node keeps its prefix. */
        int worst = -1;
        double ws = 0;
        for (int i = 1; i < t->n_nodes; i++) {
            const kv_tree_node *nd = &t->nodes[i];
            if (!nd->live || nd->n_child) continue;
            double sc = kv_tree_score(nd, now, half_life);
            const kv_tree_node *w = worst >= 0 ? &t->nodes[worst] : NULL;
            if (!w || sc < ws || (sc == ws && (nd->last_use < w->last_use ||
                                               (nd->last_use == w->last_use && nd->bytes > w->bytes)))) {
                worst = i;
                ws = sc;
            }
        }
        if (worst < 0) break;
        uint64_t b = t->nodes[worst].bytes;
        st = drop_subtree(s, worst, r);
        total -= b;
    }
    r->bytes_after = live_bytes(t);
    if (!st) st = kv_tree_store_save(s);
    if (!st) st = remove_orphans(s, &r->orphans_removed, false);
    if (!st) st = remove_index_temps(s, &r->temps_removed, false);
    return st;
}

// --- check ------------------------------------------------------------------------

static void problem(kv_check_report *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void problem(kv_check_report *r, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    char **p = realloc(r->problems, (size_t)(r->n_problems + 1) * sizeof *p);
    if (!p) return;
    r->problems = p;
    if ((p[r->n_problems] = strdup(buf))) r->n_problems++;
}

kv_status kv_tree_store_check(kv_tree_store *s, kv_check_report *r)
{
    memset(r, 0, sizeof *r);
    const kv_tree *t = s->t;
    for (int i = 1; i < t->n_nodes; i++) {
        const kv_tree_node *nd = &t->nodes[i];
        if (!nd->live) continue;
        r->nodes++;
        tree_chunk c;
        kv_errclear();
        if (tree_node_open(s, i, &c)) {
            problem(r, "%s", kv_errdetail());
            continue;
        }
        bool ok = true;
        /* every frame and the query samples: checksums, and each frame
         * decodes to its rows in the store's geometry */
        void **kb = calloc((size_t)c.L, sizeof *kb), **vb = calloc((size_t)c.L, sizeof *vb);
        int *sel = malloc((size_t)c.n * sizeof *sel + 1);
        float *q = malloc((size_t)c.L * c.q_heads * c.n_q * c.D * sizeof *q + 1);
        size_t per = (size_t)c.Hkv * c.n * c.D * kv_dtype_size(c.dt);
        bool mem = kb && vb && sel && q;
        for (int l = 0; mem && l < c.L; l++) mem = (kb[l] = malloc(per + 1)) && (vb[l] = malloc(per + 1));
        kv_errclear();
        if (!mem) problem(r, "chunk %s: no memory to verify it", nd->file), ok = false;
        else {
            for (int k = 0; k < c.n; k++) sel[k] = k;
            if (tree_chunk_rows(&c, sel, c.n, kb, vb, c.n, 0) || tree_chunk_queries(&c, q))
                problem(r, "%s", kv_errdetail()), ok = false;
            else if (c.sk_r) { /* the key sketch: checksum, channels, scales */
                size_t hr = (size_t)c.L * c.Hkv * c.sk_r;
                uint16_t *ch = malloc(hr * 2);
                float *sc = malloc(hr * 4);
                int8_t *code = malloc(hr * (size_t)c.n);
                if (!ch || !sc || !code) problem(r, "chunk %s: no memory to verify it", nd->file), ok = false;
                else if (tree_chunk_sketch(&c, ch, sc, code)) problem(r, "%s", kv_errdetail()), ok = false;
                free(ch), free(sc), free(code);
            }
        }
        for (int l = 0; kb && vb && l < c.L; l++) free(kb[l]), free(vb[l]);
        free(kb), free(vb), free(sel), free(q);
        if (c.version == 1 && c.enc.zstd != (nd->tier == KV_TIER_DISK))
            problem(r, "chunk %s is %s but its tier is %s", nd->file, c.enc.zstd ? "compressed" : "not compressed",
                    kv_tier_name(nd->tier)), ok = false;
        if (c.version >= 2 && !kv_tree_enc_equal(&nd->enc, &t->enc[nd->tier])) {
            char a[24], b[24];
            kv_tree_enc_format(&nd->enc, a, sizeof a);
            kv_tree_enc_format(&t->enc[nd->tier], b, sizeof b);
            problem(r, "chunk %s is %s but the %s tier's encoding is %s (kv-tree place re-encodes)", nd->file, a,
                    kv_tier_name(nd->tier), b), ok = false;
        }
        if (nd->kv_bytes != tree_kv_bytes_of(t, nd->n))
            problem(r, "node %s: kv_bytes %llu, expected %llu", nd->file, (unsigned long long)nd->kv_bytes,
                    (unsigned long long)tree_kv_bytes_of(t, nd->n)), ok = false;
        kv_tree_node tmp = *nd;
        tree_imp_summary(&tmp, c.imp, nd->n);
        if (fabsf(tmp.imp_mean - nd->imp_mean) > 1e-3f * (1 + fabsf(nd->imp_mean)) || tmp.imp_max != nd->imp_max ||
            tmp.imp_min != nd->imp_min)
            problem(r, "chunk %s: importance summary disagrees with the index", nd->file), ok = false;
        tree_chunk_free(&c);
        r->chunks_ok += ok;
    }
    kv_status st = remove_orphans(s, &r->orphans, true);
    return st ? st : remove_index_temps(s, &r->temp_files, true);
}

void kv_check_report_clear(kv_check_report *r)
{
    tree_list_free(r->problems, r->n_problems);
    r->problems = NULL;
    r->n_problems = 0;
}

