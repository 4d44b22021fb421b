/*
 * kv_tree_load: get, the cached prefix of a request read back from the
 * store: into memory rows (kv_tree_store_load, what a server in the same
 * process uses: no file, no second copy), or as a .kvc (kv_tree_store_get,
 * kv_tree_store_get_kvc, written from those rows).  Which rows each node
 * gives is decided from its chunk's tables alone (importance, or the
 * caller's own pick), then only the frames holding them are read, straight
 * into the output rows.
 */
#include "tree/kv_tree_int.h"

#include "common/kv_stats.h"

#include <math.h>
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *imp;
    int i;
} imp_ix;

static int cmp_imp_desc(const void *a, const void *b)
{
    const imp_ix *x = a, *y = b;
    if (x->imp[x->i] != y->imp[y->i]) return x->imp[x->i] > y->imp[y->i] ? -1 : 1;
    return x->i - y->i; /* ties go to the earlier token */
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

/* Pick the top `keep` of n tokens by importance, returned in position order. */
static kv_status top_tokens(const float *imp, int n, int keep, int *sel)
{
    imp_ix *ix = malloc((size_t)(n ? n : 1) * sizeof *ix);
    if (!ix) return kv_fail(KV_E_NOMEM, "cannot allocate a ranking");
    for (int i = 0; i < n; i++) ix[i] = (imp_ix){imp, i};
    qsort(ix, (size_t)n, sizeof *ix, cmp_imp_desc);
    for (int i = 0; i < keep; i++) sel[i] = ix[i].i;
    qsort(sel, (size_t)keep, sizeof *sel, cmp_int);
    free(ix);
    return KV_OK;
}

/* Rows in position order (version 3): the frames of the first u rows
 * with the highest mean importance, whole, until at least keep rows;
 * *got rows in sel, in position order. */
static kv_status top_frames(const tree_chunk *c, int u, int keep, int *sel, int *got)
{
    const int R = c->group_rows, nf = (u + R - 1) / R;
    float *fi = malloc((size_t)nf * sizeof *fi + 1);
    char *take = calloc((size_t)nf + 1, 1);
    if (!fi || !take) {
        free(fi), free(take);
        return kv_fail(KV_E_NOMEM, "cannot allocate a ranking");
    }
    for (int f = 0; f < nf; f++) {
        double a = 0;
        int cnt = 0;
        for (int t = f * R; t < u && t < (f + 1) * R; t++) a += c->imp[t], cnt++;
        fi[f] = (float)(a / cnt);
    }
    imp_ix *ix = malloc((size_t)nf * sizeof *ix + 1);
    if (!ix) {
        free(fi), free(take);
        return kv_fail(KV_E_NOMEM, "cannot allocate a ranking");
    }
    for (int f = 0; f < nf; f++) ix[f] = (imp_ix){fi, f};
    qsort(ix, (size_t)nf, sizeof *ix, cmp_imp_desc);
    int rows = 0;
    for (int i = 0; i < nf && rows < keep; i++) {
        int f = ix[i].i;
        take[f] = 1;
        rows += (f + 1) * R <= u ? R : u - f * R;
    }
    int k = 0;
    for (int f = 0; f < nf; f++)
        for (int t = f * R; take[f] && t < u && t < (f + 1) * R; t++) sel[k++] = t;
    *got = k;
    free(ix), free(fi), free(take);
    return KV_OK;
}

void kv_tree_rows_free(kv_tree_rows *x)
{
    if (!x) return;
    if (x->al.alloc) x->al.free(x->al.user, x->kv);
    else free(x->kv);
    free(x->k);
    free(x->v);
    free(x->tokens);
    free(x->positions);
    free(x->imp);
    free(x->q);
    memset(x, 0, sizeof *x);
}

kv_status kv_tree_store_load(kv_tree_store *s, const int32_t *tok, int n, double frac, const int32_t *pick,
                             int n_pick, bool touch, int64_t now, kv_tree_rows *out, kv_get_report *r)
{
    return kv_tree_store_load_ex(s, tok, n, frac, pick, n_pick, touch, now, NULL, out, r);
}

/* A load between its plan and its end: the chunks open, each node's rows
 * chosen, the output allocated (load_plan); then the rows read, here
 * (load_ex) or layer by layer on a thread of its own (load_start). */
struct kv_tree_pending {
    kv_tree_store *s;
    kv_tree_rows *out;
    kv_get_report r;
    bool touch;
    int64_t now;
    int *path, np, M, L;
    tree_chunk *c;
    int **psel, *nsel;
    /* the layered read's state (load_start) */
    int threads;
    pthread_t th;
    bool threaded;   /* on a thread of its own (th) */
    bool posted;     /* on the store's worker (tree_worker_post): finish waits for done */
    bool done;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ready;       /* layers [0, ready) are in place */
    kv_status st;    /* the read's error: the waits for layer err_layer and later return it (the
                        layers before it are still read and given) */
    int err_layer;
    char why[512];
    double read_ms, wait_ms;
};

static void pending_free(kv_tree_pending *j)
{
    for (int p = 0; p < j->np; p++) {
        if (j->c) {
            j->r.bytes_read[j->s->t->nodes[j->path[p]].tier] += j->c[p].bytes_read;
            tree_chunk_free(&j->c[p]);
        }
        free(j->psel ? j->psel[p] : NULL);
    }
    free(j->c), free(j->psel), free(j->nsel), free(j->path);
    j->c = NULL, j->psel = NULL, j->nsel = NULL, j->path = NULL;
}

/* Pass 1, the rows each node gives (from its tables alone), and the output
 * with everything but the K/V rows.  On failure j is freed (the output too). */
static kv_status load_plan(kv_tree_store *s, const int32_t *tok, int n, double frac, const int32_t *pick,
                           int n_pick, bool touch, int64_t now, const kv_tree_alloc *al, kv_tree_rows *out,
                           kv_tree_pending *j)
{
    memset(j, 0, sizeof *j);
    memset(out, 0, sizeof *out);
    j->s = s, j->out = out, j->touch = touch, j->now = now;
    kv_get_report *r = &j->r;
    if (al && al->alloc) out->al = *al;
    kv_tree *t = s->t;
    r->tokens = n;
    if (!t->has_geom) return kv_fail(KV_E_DATA, "the store is empty (no cache was ever put)");
    const kv_geom *sg = &t->geom.g;
    const int L = sg->n_layers, Hkv = sg->n_kv_heads, D = sg->head_dim;
    const size_t es = kv_dtype_size(t->geom.dtype);
    j->L = L;
    int *path = j->path = malloc((size_t)(n ? n : 1) * sizeof *path), np = 0, used = 0;
    if (!path) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    const int m = kv_tree_match(t, tok, n, path, &np, &used);
    for (int i = 1; pick && i < n_pick; i++)
        if (pick[i] <= pick[i - 1]) {
            pending_free(j);
            return kv_fail(KV_E_USAGE, "the rows picked are not in increasing position order");
        }
    r->matched = m;
    r->nodes = np;
    r->positions = pick ? n_pick < m : frac < 1;
    tree_chunk *c = j->c = calloc((size_t)np + 1, sizeof *c);
    int **psel = j->psel = calloc((size_t)np + 1, sizeof *psel), *nsel = j->nsel = calloc((size_t)np + 1, sizeof *nsel);
    j->np = np;
    kv_status st = c && psel && nsel ? KV_OK : kv_fail(KV_E_NOMEM, "cannot allocate a selection");
    for (int p = 0; c && p < np; p++) c[p].fd = -1;
    int M = 0, pk = 0;
    for (int p = 0; p < np && !st; p++) {
        const kv_tree_node *nd = &t->nodes[path[p]];
        int u = p == np - 1 ? used : nd->n, k = u;
        if (!(psel[p] = malloc((size_t)u * sizeof **psel + 1))) {
            st = kv_fail(KV_E_NOMEM, "cannot allocate a selection");
            break;
        }
        if ((st = tree_node_open(s, path[p], &c[p]))) break;
        if (pick) {
            k = 0;
            while (pk < n_pick && pick[pk] < nd->start) pk++; /* (before the match: none) */
            for (; pk < n_pick && pick[pk] < nd->start + u; pk++) psel[p][k++] = pick[pk] - nd->start;
        } else if (frac < 1 && nd->tier == KV_TIER_DISK && c[p].positional) {
            k = (int)ceil(frac * u);
            if (k > u) k = u;
            st = top_frames(&c[p], u, k, psel[p], &k);
        } else if (frac < 1 && nd->tier == KV_TIER_DISK) {
            k = (int)ceil(frac * u);
            if (k > u) k = u;
            st = top_tokens(c[p].imp, u, k, psel[p]);
        } else
            for (int i = 0; i < u; i++) psel[p][i] = i;
        nsel[p] = k;
        M += k;
        r->skipped += u - k;
        r->kv_bytes_out[nd->tier] += tree_kv_bytes_of(t, k);
    }
    if (!st && pick && pk < n_pick && pick[pk] < m) st = kv_fail(KV_E_INTERNAL, "a picked row is outside the match");
    if (!st && pick && n_pick && pick[n_pick - 1] >= m)
        st = kv_fail(KV_E_USAGE, "row %d was picked from a match of %d tokens", pick[n_pick - 1], m);
    j->M = M;
    const size_t per = (size_t)Hkv * M * D * es;
    out->T = M, out->matched = m, out->dt = t->geom.dtype;
    out->n_layers = L, out->n_kv_heads = Hkv, out->head_dim = D;
    if (!st) {
        out->kv = out->al.alloc ? out->al.alloc(out->al.user, per * 2 * (size_t)L + 1) : malloc(per * 2 * (size_t)L + 1);
        out->k = malloc((size_t)L * sizeof *out->k + 1), out->v = malloc((size_t)L * sizeof *out->v + 1);
        out->tokens = malloc((size_t)M * 4 + 4), out->imp = malloc((size_t)M * 4 + 4);
        out->positions = malloc((size_t)M * 4 + 4);
        if (!out->kv || !out->k || !out->v || !out->tokens || !out->imp || !out->positions)
            st = kv_fail(KV_E_NOMEM, "cannot allocate the output K/V (%d tokens)", M);
        for (int l = 0; l < L && !st; l++)
            out->k[l] = (char *)out->kv + per * 2 * (size_t)l, out->v[l] = (char *)out->kv + per * (2 * (size_t)l + 1);
    }
    for (int p = 0, off = 0; p < np && !st; off += nsel[p], p++) {
        const kv_tree_node *nd = &t->nodes[path[p]];
        for (int i = 0; i < nsel[p]; i++) {
            out->tokens[off + i] = nd->tokens[psel[p][i]];
            out->positions[off + i] = nd->start + psel[p][i];
            out->imp[off + i] = c[p].imp[psel[p][i]];
        }
        if (p == np - 1 && used == nd->n && c[p].n_q > 0 && !r->positions) {
            out->q_heads = c[p].q_heads, out->n_q = c[p].n_q;
            if (!(out->q = malloc((size_t)L * out->q_heads * out->n_q * D * sizeof *out->q)))
                st = kv_fail(KV_E_NOMEM, "cannot allocate queries");
            else st = tree_chunk_queries(&c[p], out->q);
        }
    }
    if (st) {
        pending_free(j);
        kv_tree_rows_free(out);
    }
    return st;
}

/* The end of a load: the report, the nodes' use when asked and all went
 * well, the chunks closed; the output freed on failure. */
static kv_status load_end(kv_tree_pending *j, kv_status st, kv_get_report *r)
{
    kv_tree *t = j->s->t;
    if (!st && j->touch)
        for (int p = 0; p < j->np; p++) {
            t->nodes[j->path[p]].hits++;
            t->nodes[j->path[p]].last_use = j->now;
        }
    pending_free(j);
    j->r.kept = j->M;
    j->r.n_q = j->out->n_q;
    if (r) *r = j->r;
    if (st) kv_tree_rows_free(j->out);
    return st;
}

kv_status kv_tree_store_load_ex(kv_tree_store *s, const int32_t *tok, int n, double frac, const int32_t *pick,
                                int n_pick, bool touch, int64_t now, const kv_tree_alloc *al, kv_tree_rows *out,
                                kv_get_report *r)
{
    kv_tree_pending j;
    kv_status st = load_plan(s, tok, n, frac, pick, n_pick, touch, now, al, out, &j);
    if (st) {
        *r = j.r;
        return st;
    }
    /* pass 2: the rows, read straight into place, frame by frame */
    for (int p = 0, off = 0; p < j.np && !st; off += j.nsel[p], p++)
        st = tree_chunk_rows(&j.c[p], j.psel[p], j.nsel[p], out->k, out->v, j.M, off);
    return load_end(&j, st, r);
}

// --- loads read layer by layer beside the caller ------------------------------------

static void layered_fail(kv_tree_pending *j, kv_status e, int layer)
{
    pthread_mutex_lock(&j->mu);
    if (!j->st || layer < j->err_layer) { /* the earliest layer's error is the one a wait meets first */
        snprintf(j->why, sizeof j->why, "%s", kv_errdetail());
        j->st = e;
        j->err_layer = layer;
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

static void layered_publish(kv_tree_pending *j, int ready)
{
    pthread_mutex_lock(&j->mu);
    if (ready > j->ready) j->ready = ready;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* The read: chunks that cannot be read layer by layer first, whole; then
 * tasks (layer, frame) in layer order on j->threads threads, each layer
 * published once all its frames are in. */
static void layered_read(kv_tree_pending *j)
{
    double t0 = kv_now_ms();
    kv_tree_rows *out = j->out;
    const int L = j->L;
    tree_layered *y = calloc((size_t)j->np + 1, sizeof *y);
    bool *lay = calloc((size_t)j->np + 1, sizeof *lay);
    kv_status st = y && lay ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory");
    int nf = 0;
    size_t span = 1;
    for (int p = 0, off = 0; p < j->np && !st; off += j->nsel[p], p++) {
        if (!j->nsel[p]) continue;
        if ((st = tree_layered_begin(&j->c[p], j->psel[p], j->nsel[p], off, &y[p], &lay[p]))) break;
        if (!lay[p]) st = tree_chunk_rows(&j->c[p], j->psel[p], j->nsel[p], out->k, out->v, j->M, off);
        else nf += y[p].nl, span = y[p].span > span ? y[p].span : span;
    }
    /* task t: layer t / nf, frame t % nf of the layered chunks in order */
    int *fp = malloc((size_t)nf * sizeof *fp + 1), *fli = malloc((size_t)nf * sizeof *fli + 1);
    int *left = malloc((size_t)L * sizeof *left + 1);
    char *done = calloc((size_t)L + 1, 1);
    if (!st && (!fp || !fli || !left || !done)) st = kv_fail(KV_E_NOMEM, "out of memory");
    for (int p = 0, i = 0; !st && p < j->np; p++)
        for (int li = 0; lay[p] && li < y[p].nl; li++) fp[i] = p, fli[i] = li, i++;
    for (int l = 0; !st && l < L; l++) left[l] = nf;
    if (st) layered_fail(j, st, 0);
    else if (!nf) layered_publish(j, L);
    else {
        int ready = 0;
        const long tasks = (long)L * nf;
#pragma omp parallel num_threads(j->threads > 0 ? j->threads : 1)
        {
            uint8_t *buf = malloc(span);
            if (!buf) layered_fail(j, kv_fail(KV_E_NOMEM, "cannot allocate a layer's read of %zu bytes", span), 0);
#pragma omp for schedule(dynamic, 1)
            for (long t = 0; t < tasks; t++) {
                const int l = (int)(t / nf), i = (int)(t % nf);
                pthread_mutex_lock(&j->mu);
                bool skip = j->st && l >= j->err_layer; /* past an error: the layers before it go on */
                pthread_mutex_unlock(&j->mu);
                if (skip || !buf) continue;
                kv_status fst = tree_layered_frame(&y[fp[i]], fli[i], l, buf, out->k, out->v, j->M);
                if (fst) {
                    layered_fail(j, fst, l);
                    continue;
                }
                int now_left;
#pragma omp atomic capture acq_rel
                now_left = --left[l];
                if (now_left == 0) { /* the layer is in: publish the layers in place from the first */
                    pthread_mutex_lock(&j->mu);
                    done[l] = 1;
                    while (ready < L && done[ready]) ready++;
                    if (ready > j->ready) j->ready = ready;
                    pthread_cond_broadcast(&j->cv);
                    pthread_mutex_unlock(&j->mu);
                }
            }
            free(buf);
        }
    }
    pthread_mutex_lock(&j->mu); /* never leave a waiter waiting */
    bool short_of = j->ready < (j->st ? j->err_layer : L);
    pthread_mutex_unlock(&j->mu);
    if (short_of) layered_fail(j, kv_fail(KV_E_INTERNAL, "a layered load ended with layers unread"), 0);
    for (int p = 0; y && p < j->np; p++)
        if (lay[p]) tree_layered_free(&y[p]);
    free(y), free(lay), free(fp), free(fli), free(left), free(done);
    j->read_ms = kv_now_ms() - t0;
}

static void *layered_thread(void *p)
{
    layered_read(p);
    return NULL;
}

static void layered_job(void *p)
{
    kv_tree_pending *j = p;
    layered_read(j);
    pthread_mutex_lock(&j->mu);
    j->done = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

kv_status kv_tree_store_load_start(kv_tree_store *s, const int32_t *tok, int n, double frac, const int32_t *pick,
                                   int n_pick, bool touch, int64_t now, const kv_tree_alloc *al, int threads,
                                   kv_tree_rows *out, kv_tree_pending **pend)
{
    *pend = NULL;
    kv_tree_pending *j = malloc(sizeof *j);
    if (!j) return kv_fail(KV_E_NOMEM, "out of memory");
    kv_status st = load_plan(s, tok, n, frac, pick, n_pick, touch, now, al, out, j);
    if (st) {
        free(j);
        return st;
    }
    j->threads = threads;
    j->err_layer = j->L;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    /* on the store's worker, else a thread of its own; no thread to be had:
     * the read runs here, the waits then pass at once */
    j->posted = tree_worker_post(s, layered_job, j);
    j->threaded = !j->posted && pthread_create(&j->th, NULL, layered_thread, j) == 0;
    if (!j->posted && !j->threaded) layered_read(j);
    *pend = j;
    return KV_OK;
}

kv_status kv_tree_rows_wait(kv_tree_pending *j, int layer)
{
    if (!j) return KV_OK;
    double t0 = kv_now_ms();
    pthread_mutex_lock(&j->mu);
    while (j->ready <= layer && j->ready < j->L && !(j->st && layer >= j->err_layer))
        pthread_cond_wait(&j->cv, &j->mu);
    kv_status st = j->ready > layer || j->ready >= j->L ? KV_OK : j->st;
    char why[512];
    if (st) snprintf(why, sizeof why, "%s", j->why);
    j->wait_ms += kv_now_ms() - t0;
    pthread_mutex_unlock(&j->mu);
    return st ? kv_fail(st, "%s", why) : KV_OK;
}

kv_status kv_tree_pending_wait(void *p, int layer) { return kv_tree_rows_wait(p, layer); }

int kv_tree_load_threads(void)
{
    int n = 1;
#ifdef _OPENMP
    n = omp_get_num_procs() - 1;
#endif
    return n < 1 ? 1 : n > 16 ? 16 : n;
}

kv_status kv_tree_load_finish(kv_tree_pending *j, kv_get_report *r, double *read_ms, double *wait_ms)
{
    if (!j) return KV_OK;
    if (j->threaded) pthread_join(j->th, NULL);
    if (j->posted) {
        pthread_mutex_lock(&j->mu);
        while (!j->done) pthread_cond_wait(&j->cv, &j->mu);
        pthread_mutex_unlock(&j->mu);
    }
    kv_status st = j->st;
    if (st) kv_fail(st, "%s", j->why);
    if (read_ms) *read_ms = j->read_ms;
    if (wait_ms) *wait_ms = j->wait_ms;
    st = load_end(j, st, r);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
    return st;
}

/* The rows as a writer (which borrows x: free x after writing). */
static kv_status rows_writer(const kv_tree_store *s, const kv_tree_rows *x, bool positions, kvc_writer **wout)
{
    *wout = NULL;
    const kv_tree *t = s->t;
    kv_geom g = t->geom.g;
    const int L = g.n_layers, M = x->T;
    g.n_tokens = M, g.n_q = x->q ? x->n_q : 0;
    if (x->q) g.n_heads = x->q_heads;
    int64_t sh1[1] = {M}, sh3[3] = {g.n_kv_heads, M, g.head_dim}, shq[3] = {x->q_heads, x->n_q, g.head_dim};
    char mbuf[24];
    snprintf(mbuf, sizeof mbuf, "%d", x->matched);
    kvc_writer *w = NULL;
    kv_status st;
    if ((st = kvc_writer_new(&w)) || (st = kvc_writer_geom(w, &g)) || (st = kvc_writer_meta(w, "kvtree.matched", mbuf)) ||
        (st = kvc_writer_add(w, "tokens", KV_DT_I32, 1, sh1, x->tokens)) ||
        (positions && (st = kvc_writer_add(w, "positions", KV_DT_I32, 1, sh1, x->positions))) ||
        (st = kvc_writer_add(w, "importance", KV_DT_F32, 1, sh1, x->imp)))
        goto out;
    for (int l = 0; l < L; l++) {
        char name[64];
        snprintf(name, sizeof name, "layers.%d.k", l);
        if ((st = kvc_writer_add(w, name, t->geom.dtype, 3, sh3, x->k[l]))) goto out;
        snprintf(name, sizeof name, "layers.%d.v", l);
        if ((st = kvc_writer_add(w, name, t->geom.dtype, 3, sh3, x->v[l]))) goto out;
        snprintf(name, sizeof name, "layers.%d.q", l);
        if (x->q && (st = kvc_writer_add(w, name, KV_DT_F32, 3, shq, x->q + (size_t)l * x->q_heads * x->n_q * g.head_dim)))
            goto out;
    }
out:
    if (st) kvc_writer_free(w);
    else *wout = w;
    return st;
}

kv_status kv_tree_store_get(kv_tree_store *s, const int32_t *tok, int n, double frac, bool touch, int64_t now,
                            const char *out_path, kv_get_report *r)
{
    kv_tree_rows x;
    kvc_writer *w = NULL;
    kv_status st = kv_tree_store_load(s, tok, n, frac, NULL, 0, touch, now, &x, r);
    if (!st) st = rows_writer(s, &x, r->positions, &w);
    if (!st) st = kvc_writer_write(w, out_path, 0);
    kvc_writer_free(w);
    kv_tree_rows_free(&x);
    return st;
}

kv_status kv_tree_store_get_kvc(kv_tree_store *s, const int32_t *tok, int n, double frac, bool touch, int64_t now,
                                kvc_file **out, kv_get_report *r)
{
    *out = NULL;
    kv_tree_rows x;
    kvc_writer *w = NULL;
    uint8_t *buf = NULL;
    size_t len = 0;
    kv_status st = kv_tree_store_load(s, tok, n, frac, NULL, 0, touch, now, &x, r);
    if (!st) st = rows_writer(s, &x, r->positions, &w);
    if (!st) st = kvc_writer_write_mem(w, 0, &buf, &len);
    kvc_writer_free(w);
    kv_tree_rows_free(&x);
    if (!st) st = kvc_open_mem(buf, len, out);
    free(buf);
    return st;
}

// --- the key sketch (query-aware loads) ---------------------------------------------

void kv_tree_sketch_free(kv_tree_sketch *k)
{
    for (int i = 0; k && k->seg && i < k->nseg; i++) {
        free(k->seg[i].ch), free(k->seg[i].scale);
        if (k->al.alloc && k->seg[i].code) k->al.free(k->al.user, k->seg[i].code);
        else free(k->seg[i].code);
    }
    if (k) free(k->seg);
    if (k) memset(k, 0, sizeof *k);
}

kv_status kv_tree_store_sketch(kv_tree_store *s, const int32_t *tok, int n, kv_tree_sketch *out)
{
    return kv_tree_store_sketch_ex(s, tok, n, NULL, out);
}

kv_status kv_tree_store_sketch_ex(kv_tree_store *s, const int32_t *tok, int n, const kv_tree_alloc *al,
                                  kv_tree_sketch *out)
{
    memset(out, 0, sizeof *out);
    if (al) out->al = *al;
    kv_tree *t = s->t;
    if (!t->has_geom) return kv_fail(KV_E_DATA, "the store is empty (no cache was ever put)");
    int *path = malloc((size_t)(n ? n : 1) * sizeof *path), np = 0, used = 0;
    if (!path) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    out->matched = kv_tree_match(t, tok, n, path, &np, &used);
    out->seg = calloc((size_t)np + 1, sizeof *out->seg);
    kv_status st = out->seg ? KV_OK : kv_fail(KV_E_NOMEM, "cannot allocate a sketch");
    for (int p = 0; p < np && !st; p++) {
        const kv_tree_node *nd = &t->nodes[path[p]];
        tree_chunk c;
        if ((st = tree_node_open(s, path[p], &c))) break;
        if (!c.sk_r) {
            st = kv_fail(KV_E_UNSUPPORTED, "chunk %s has no key sketch (the store's encodings lack +sketch)", nd->file);
            tree_chunk_free(&c);
            break;
        }
        kv_tree_sketch_seg *g = &out->seg[out->nseg++];
        const size_t hr = (size_t)c.L * c.Hkv * c.sk_r;
        g->start = nd->start, g->n = p == np - 1 ? used : nd->n, g->rows = nd->n, g->r = c.sk_r;
        g->frame_rows = c.group_rows;
        g->ch = malloc(hr * sizeof *g->ch), g->scale = malloc(hr * sizeof *g->scale);
        g->code = out->al.alloc ? out->al.alloc(out->al.user, hr * (size_t)nd->n + 1) : malloc(hr * (size_t)nd->n + 1);
        st = g->ch && g->scale && g->code ? tree_chunk_sketch(&c, g->ch, g->scale, g->code)
                                          : kv_fail(KV_E_NOMEM, "cannot allocate a sketch");
        out->bytes_read[nd->tier] += c.bytes_read;
        tree_chunk_free(&c);
    }
    free(path);
    if (st) kv_tree_sketch_free(out);
    return st;
}
