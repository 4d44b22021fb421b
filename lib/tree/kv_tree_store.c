/*
 * kv_tree_store: the store on disk: token importance (IMPRESS: attention
 * mass from the stored query samples, else key norms), opening, locking and
 * saving, chunk files and put (get is kv_tree_load.c).  Every file the store writes is new
 * (chunks/c<generation>.kvc, never reused) and the index is committed
 * atomically before replaced chunks are unlinked, so a crash at any point
 * leaves the old or the new index, each naming only complete chunks (at
 * worst some orphans, which gc removes).
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

#include "common/kv_file.h"
#include "common/kv_finite.h"
#include "common/kv_half.h"
#include "common/kv_outfile.h"
#include "quant/kv_layer_io.h"

// --- importance ---------------------------------------------------------------

static const kvc_tensor *plain_part(const kvc_file *f, int l, const char *part)
{
    const kvc_tensor *x = kvc_layer(f, l, part);
    if (!x || x->ndim != 3 || (x->dtype != KV_DT_F32 && x->dtype != KV_DT_F16 && x->dtype != KV_DT_BF16)) return NULL;
    return x;
}

kv_status kv_tree_importance(const kvc_file *f, float *imp, bool *attention)
{
    const kv_geom *g = kvc_geom(f);
    int T = g->n_tokens, L = g->n_layers, Hkv = g->n_kv_heads, D = g->head_dim, H = g->n_heads, Q = g->n_q;
    *attention = Q > 0 && H > 0;
    if (T <= 0) return KV_OK;
    double *acc = calloc((size_t)T, sizeof *acc);
    float *k = malloc((size_t)Hkv * (size_t)T * (size_t)D * sizeof *k);
    float *q = *attention ? malloc((size_t)H * (size_t)Q * (size_t)D * sizeof *q) : NULL;
    double *p = malloc((size_t)T * sizeof *p);
    kv_status st = KV_OK;
    if (!acc || !k || !p || (*attention && !q)) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate the importance buffers");
        goto out;
    }
    const double scale = 1.0 / sqrt((double)D);
    for (int l = 0; l < L; l++) {
        char nm[32];
        snprintf(nm, sizeof nm, "layers.%d.k", l);
        /* NaN keys would make the importance (and the index's summary of it,
         * which JSON cannot hold) NaN: the store keeps finite keys only.
         * Packed keys are decoded as kvc(5) says. */
        if ((st = kv_layer_decode(f, l, 'k', k)) || (st = kv_check_finite3(nm, k, Hkv, T, D, "the store's importance")))
            goto out;
        if (!*attention) {
            for (int h = 0; h < Hkv; h++)
                for (int t = 0; t < T; t++) {
                    const float *r = k + ((size_t)h * T + t) * D;
                    double s = 0;
                    for (int c = 0; c < D; c++) s += (double)r[c] * r[c];
                    acc[t] += sqrt(s);
                }
            continue;
        }
        const kvc_tensor *qt = plain_part(f, l, "q");
        if (!qt) {
            st = kv_fail(KV_E_UNSUPPORTED, "layer %d queries are not a plain F32/F16/BF16 tensor", l);
            goto out;
        }
        snprintf(nm, sizeof nm, "layers.%d.q", l);
        if ((st = kvc_tensor_to_f32(qt, q)) || (st = kv_check_finite3(nm, q, H, Q, D, "the store's importance")))
            goto out;
        int group = H / Hkv;
        for (int h = 0; h < H; h++) {
            const float *kh = k + (size_t)(h / group) * T * D;
            for (int j = 0; j < Q; j++) {
                int vis = T - Q + j + 1; /* causal: query at position T-Q+j */
                if (vis > T) vis = T;
                if (vis <= 0) continue;
                const float *qr = q + ((size_t)h * Q + j) * D;
                double mx = -INFINITY, sum = 0;
                for (int t = 0; t < vis; t++) {
                    const float *kr = kh + (size_t)t * D;
                    double s = 0;
                    for (int c = 0; c < D; c++) s += (double)qr[c] * kr[c];
                    p[t] = s * scale;
                    if (p[t] > mx) mx = p[t];
                }
                for (int t = 0; t < vis; t++) sum += (p[t] = exp(p[t] - mx));
                for (int t = 0; t < vis; t++) acc[t] += p[t] / sum;
            }
        }
    }
    double tot = 0;
    for (int t = 0; t < T; t++) tot += acc[t];
    for (int t = 0; t < T; t++) imp[t] = tot > 0 && isfinite(tot) ? (float)(acc[t] * T / tot) : 1.0f;
out:
    free(acc);
    free(k);
    free(q);
    free(p);
    return st;
}

// --- the store: opening, locking, saving ----------------------------------------


char *tree_path_join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static kv_status list_push(char ***list, int *n, int *cap, const char *s)
{
    if (*n == *cap) {
        int c = *cap ? *cap * 2 : 8;
        char **p = realloc(*list, (size_t)c * sizeof *p);
        if (!p) return kv_fail(KV_E_NOMEM, "cannot grow a file list");
        *list = p;
        *cap = c;
    }
    if (!((*list)[*n] = strdup(s))) return kv_fail(KV_E_NOMEM, "cannot copy a path");
    (*n)++;
    return KV_OK;
}

void tree_list_free(char **list, int n)
{
    for (int i = 0; i < n; i++) free(list[i]);
    free(list);
}

/*
 * Open a file of the store.  The store holds only regular files that it
 * wrote itself, so a symbolic link (followed, it made put overwrite files
 * outside the store), a FIFO (a get blocked forever holding the lock) or a
 * device (/dev/zero was read until memory ran out) is damage: refused with
 * KV_E_DATA, never followed and never waited on.  rel names the file in
 * messages; *size gets its length.
 */
static kv_status store_file_open(const char *path, const char *rel, int flags, int *fd_out, uint64_t *size)
{
    *fd_out = -1;
    int fd = open(path, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0666);
    if (fd < 0) {
        int e = errno;
        struct stat lb;
        if (e == ELOOP && lstat(path, &lb) == 0 && S_ISLNK(lb.st_mode))
            return kv_fail(KV_E_DATA, "%s is a symbolic link; a store holds only regular files", rel);
        return kv_fail(e == ENOENT ? KV_E_NOINPUT : KV_E_IO, "cannot open %s: %s", rel, strerror(e));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return kv_fail(KV_E_IO, "cannot stat %s: %s", rel, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return kv_fail(KV_E_DATA, "%s is %s; a store holds only regular files", rel, kv_file_kind(sb.st_mode));
    }
    *fd_out = fd;
    *size = (uint64_t)sb.st_size;
    return KV_OK;
}

/* The index text, read from a checked descriptor, at most MAX_INDEX_BYTES. */
static kv_status read_index(const char *path, char **text, size_t *len)
{
    *text = NULL;
    *len = 0;
    int fd;
    uint64_t size;
    kv_status st = store_file_open(path, INDEX_NAME, O_RDONLY, &fd, &size);
    if (st) return st;
    if (size > MAX_INDEX_BYTES) {
        close(fd);
        return kv_fail(KV_E_DATA, "%s is larger than %u bytes", INDEX_NAME, MAX_INDEX_BYTES);
    }
    char *b = malloc((size_t)size + 1);
    size_t n = 0;
    if (!b) st = kv_fail(KV_E_NOMEM, "cannot allocate %llu bytes for the index", (unsigned long long)size);
    while (!st && n < size) { /* a file growing under us is read only as far as it was */
        ssize_t r = read(fd, b + n, (size_t)size - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) st = kv_fail(KV_E_IO, "cannot read %s: %s", INDEX_NAME, strerror(errno));
        if (r <= 0) break;
        n += (size_t)r;
    }
    close(fd);
    if (st) {
        free(b);
        return st;
    }
    b[n] = 0;
    *text = b;
    *len = n;
    return KV_OK;
}

static kv_status write_text(const char *path, const char *text)
{
    kv_outfile o;
    kv_status st = kv_outfile_open_ex(&o, path, KV_OUT_NOFOLLOW);
    if (st) return st;
    if (fputs(text, o.fp) == EOF || fputc('\n', o.fp) == EOF) {
        kv_outfile_abort(&o);
        return kv_fail(KV_E_IO, "cannot write %s: %s", path, strerror(errno));
    }
    return kv_outfile_commit(&o);
}

kv_status kv_tree_store_create(const char *dir) { return kv_tree_store_create_ex(dir, NULL); }

void kv_tree_store_set_encodings(kv_tree_store *s, const kv_tree_enc enc[KV_TIER_COUNT])
{
    for (int i = 0; i < KV_TIER_COUNT; i++) s->t->enc[i] = enc[i];
}

kv_status kv_tree_store_set_sketch_channels(kv_tree_store *s, int channels)
{
    if (channels < 0 || channels > KV_TREE_SKETCH_MAX)
        return kv_fail(KV_E_USAGE, "sketch channels must be in [0, %d], not %d", KV_TREE_SKETCH_MAX, channels);
    s->t->sketch_channels = channels;
    return KV_OK;
}

kv_status kv_tree_store_create_ex(const char *dir, const kv_tree_enc enc[KV_TIER_COUNT])
{
    return kv_tree_store_create_sk(dir, enc, 0);
}

kv_status kv_tree_store_create_sk(const char *dir, const kv_tree_enc enc[KV_TIER_COUNT], int sketch_channels)
{
    if (sketch_channels < 0 || sketch_channels > KV_TREE_SKETCH_MAX)
        return kv_fail(KV_E_USAGE, "sketch channels must be in [0, %d], not %d", KV_TREE_SKETCH_MAX, sketch_channels);
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return kv_fail(errno == ENOENT ? KV_E_NOINPUT : KV_E_CANTCREATE, "cannot create %s: %s", dir, strerror(errno));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) return kv_fail(KV_E_CANTCREATE, "%s exists and is not a directory", dir);
    char *idx = tree_path_join(dir, INDEX_NAME), *chunks = tree_path_join(dir, "chunks"), *text = NULL;
    kv_tree *t = NULL;
    kv_status st = KV_OK;
    if (!idx || !chunks) st = kv_fail(KV_E_NOMEM, "cannot allocate a path");
    else if (access(idx, F_OK) == 0) st = kv_fail(KV_E_CANTCREATE, "%s is already a kv-tree store", dir);
    else if (mkdir(chunks, 0777) != 0 && errno != EEXIST)
        st = kv_fail(KV_E_CANTCREATE, "cannot create %s: %s", chunks, strerror(errno));
    else if (!(st = kv_tree_new(&t))) {
        for (int i = 0; enc && i < KV_TIER_COUNT; i++) t->enc[i] = enc[i];
        t->sketch_channels = sketch_channels;
        if (!(st = kv_tree_index_format(t, &text))) st = write_text(idx, text);
    }
    free(text);
    kv_tree_free(t);
    free(idx);
    free(chunks);
    return st;
}

kv_status kv_tree_store_open(const char *dir, bool write, kv_tree_store **out)
{
    *out = NULL;
    struct stat sb;
    if (stat(dir, &sb) != 0) return kv_fail(KV_E_NOINPUT, "cannot open store %s: %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return kv_fail(KV_E_NOINPUT, "%s is not a directory", dir);
    kv_tree_store *s = calloc(1, sizeof *s);
    if (!s || !(s->dir = strdup(dir))) {
        free(s);
        return kv_fail(KV_E_NOMEM, "cannot allocate a store");
    }
    s->lock_fd = -1;
    s->scratch = tree_scratch_new(); /* NULL (no memory): frames allocate their own */
    char *idx = tree_path_join(dir, INDEX_NAME), *lock = tree_path_join(dir, "lock"), *text = NULL;
    size_t len = 0;
    kv_status st = KV_OK;
    if (!idx || !lock) st = kv_fail(KV_E_NOMEM, "cannot allocate a path");
    else if (access(idx, F_OK) != 0)
        st = kv_fail(KV_E_NOINPUT, "%s is not a kv-tree store (no %s; run kv-tree init)", dir, INDEX_NAME);
    if (!st) {
        /* The lock file is separate from the index because the index is
         * replaced by rename: a lock on it would guard a stale inode. */
        uint64_t sz;
        st = store_file_open(lock, "lock", O_RDWR | O_CREAT, &s->lock_fd, &sz);
        if (st == KV_E_IO && !write) { /* a read-only store can still be read */
            kv_errclear();
            st = store_file_open(lock, "lock", O_RDONLY, &s->lock_fd, &sz);
        }
        if (st == KV_E_IO || st == KV_E_NOINPUT) st = write ? KV_E_CANTCREATE : KV_E_NOINPUT;
        if (!st && flock(s->lock_fd, write ? LOCK_EX : LOCK_SH) != 0)
            st = kv_fail(KV_E_IO, "cannot lock %s: %s", lock, strerror(errno));
    }
    if (!st) {
        /* chunks/ must be the store's own directory: through a symlink
         * every chunk would be written somewhere else */
        char *cdir = tree_path_join(dir, "chunks");
        struct stat cb;
        if (!cdir) st = kv_fail(KV_E_NOMEM, "cannot allocate a path");
        else if (lstat(cdir, &cb) != 0)
            st = kv_fail(KV_E_DATA, "%s has no chunks directory: %s", dir, strerror(errno));
        else if (!S_ISDIR(cb.st_mode))
            st = kv_fail(KV_E_DATA, "chunks is %s, not the store's directory", kv_file_kind(cb.st_mode));
        free(cdir);
    }
    if (!st) st = read_index(idx, &text, &len);
    if (!st) {
        st = kv_tree_index_parse(text, len, &s->t);
        if (st) kv_errcontext("%s", idx);
    }
    free(text);
    free(idx);
    free(lock);
    if (st) {
        kv_tree_store_close(s);
        return st;
    }
    *out = s;
    return KV_OK;
}

static void *worker_main(void *p)
{
    tree_worker *w = p;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->stop && !w->fn) pthread_cond_wait(&w->cv, &w->mu);
        if (!w->fn) break; /* stopped, and nothing posted: a posted job runs even so, or its finisher hangs */
        void (*fn)(void *) = w->fn;
        void *arg = w->arg;
        pthread_mutex_unlock(&w->mu);
        fn(arg);
        pthread_mutex_lock(&w->mu);
        w->fn = NULL, w->arg = NULL, w->busy = false;
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

bool tree_worker_post(kv_tree_store *s, void (*fn)(void *), void *arg)
{
    if (!s->worker) {
        tree_worker *w = calloc(1, sizeof *w);
        if (!w) return false;
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv, NULL);
        if (pthread_create(&w->th, NULL, worker_main, w)) {
            pthread_mutex_destroy(&w->mu);
            pthread_cond_destroy(&w->cv);
            free(w);
            return false;
        }
        s->worker = w;
    }
    tree_worker *w = s->worker;
    pthread_mutex_lock(&w->mu);
    bool ok = !w->busy;
    if (ok) w->busy = true, w->fn = fn, w->arg = arg, pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return ok;
}

void tree_worker_free(tree_worker *w)
{
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->th, NULL); /* a job still running ends first: the loop checks stop between jobs */
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

void kv_tree_store_close(kv_tree_store *s)
{
    if (!s) return;
    /* Chunks written by an operation that was never committed are orphans. */
    for (int i = 0; i < s->n_fresh; i++) unlink(s->fresh[i]);
    tree_list_free(s->fresh, s->n_fresh);
    tree_list_free(s->dead, s->n_dead);
    tree_worker_free(s->worker); /* (every load was finished before: the contract) */
    kv_tree_free(s->t);
    tree_scratch_free(s->scratch);
    if (s->lock_fd >= 0) close(s->lock_fd); /* releases the flock */
    free(s->dir);
    free(s);
}

const kv_tree *kv_tree_store_tree(const kv_tree_store *s) { return s->t; }

kv_status kv_tree_store_save(kv_tree_store *s)
{
    char *text = NULL, *idx = tree_path_join(s->dir, INDEX_NAME);
    if (!idx) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    kv_status st = kv_tree_index_format(s->t, &text);
    if (!st) st = write_text(idx, text);
    free(text);
    free(idx);
    if (st) return st;
    tree_list_free(s->fresh, s->n_fresh);
    s->fresh = NULL, s->n_fresh = s->cap_fresh = 0;
    for (int i = 0; i < s->n_dead; i++) unlink(s->dead[i]); /* a failure only leaves an orphan */
    tree_list_free(s->dead, s->n_dead);
    s->dead = NULL, s->n_dead = s->cap_dead = 0;
    return KV_OK;
}

kv_status tree_retire(kv_tree_store *s, const char *file)
{
    char *p = tree_path_join(s->dir, file);
    if (!p) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    kv_status st = list_push(&s->dead, &s->n_dead, &s->cap_dead, p);
    free(p);
    return st;
}

// --- chunks -----------------------------------------------------------------------

static size_t es_of(const kv_tree *t) { return kv_dtype_size(t->geom.dtype); }

/* Uncompressed K/V bytes of n tokens. */
uint64_t tree_kv_bytes_of(const kv_tree *t, int n)
{
    const kv_geom *g = &t->geom.g;
    return 2ull * (uint64_t)g->n_layers * (uint64_t)g->n_kv_heads * (uint64_t)n * (uint64_t)g->head_dim * es_of(t);
}

void tree_imp_summary(kv_tree_node *nd, const float *imp, int n)
{
    double s = 0;
    float mn = n ? imp[0] : 0, mx = n ? imp[0] : 0;
    for (int i = 0; i < n; i++) {
        s += imp[i];
        if (imp[i] < mn) mn = imp[i];
        if (imp[i] > mx) mx = imp[i];
    }
    nd->imp_mean = n ? (float)(s / n) : 0, nd->imp_min = mn, nd->imp_max = mx;
}

/* Write a new chunk file (version 2) for node nd from src rows sel[0..n),
 * with its token ids, importances and (q non-NULL) query samples, in the
 * encoding of nd's tier; fills nd->file, bytes, kv_bytes, chunk_version,
 * enc and the importance summary. */
static kv_status chunk_write(kv_tree_store *s, kv_tree_node *nd, const chunk_src *src, const int *sel, int n,
                             const int32_t *tok, const float *imp, const float *q, int q_heads, int n_q,
                             int zstd_level)
{
    kv_tree *t = s->t;
    const kv_tree_enc *enc = &t->enc[nd->tier];
    uint8_t *buf = NULL;
    size_t len = 0;
    char file[KV_TREE_FILE_MAX], *path = NULL;
    kv_status st = tree_chunk_encode(&t->geom, enc, t->group_rows, t->sketch_channels, nd->start, n, tok, imp, src, sel, q, q_heads, n_q,
                                     zstd_level, &buf, &len);
    if (!st) {
        t->generation++;
        snprintf(file, sizeof file, "chunks/c%llu.kvt", (unsigned long long)t->generation);
        if (!(path = tree_path_join(s->dir, file))) st = kv_fail(KV_E_NOMEM, "cannot allocate a path");
    }
    kv_outfile o;
    if (!st && !(st = kv_outfile_open_ex(&o, path, KV_OUT_NOFOLLOW))) {
        if (fwrite(buf, 1, len, o.fp) != len) {
            st = kv_fail(KV_E_IO, "cannot write %s: %s", path, strerror(errno));
            kv_outfile_abort(&o);
        } else
            st = kv_outfile_commit(&o);
    }
    if (!st && (st = list_push(&s->fresh, &s->n_fresh, &s->cap_fresh, path))) unlink(path);
    if (!st) {
        snprintf(nd->file, sizeof nd->file, "%s", file);
        nd->bytes = (uint64_t)len;
        nd->kv_bytes = tree_kv_bytes_of(t, n);
        nd->chunk_version = enc->sketch ? 3 : 2;
        nd->enc = *enc;
        tree_imp_summary(nd, imp, n);
    }
    free(buf);
    free(path);
    return st;
}

static bool same_geom(const kv_tree_geom *a, const kv_geom *g, kv_dtype dt, char *why, size_t len)
{
    const kv_geom *s = &a->g;
#define DIFF(cond, ...) do { if (cond) { snprintf(why, len, __VA_ARGS__); return false; } } while (0)
    DIFF(s->n_layers != g->n_layers, "%d layers, the store has %d", g->n_layers, s->n_layers);
    DIFF(s->n_kv_heads != g->n_kv_heads, "%d KV heads, the store has %d", g->n_kv_heads, s->n_kv_heads);
    DIFF(s->head_dim != g->head_dim, "head dim %d, the store has %d", g->head_dim, s->head_dim);
    DIFF(s->n_heads && g->n_heads && s->n_heads != g->n_heads, "%d query heads, the store has %d", g->n_heads, s->n_heads);
    DIFF(a->dtype != dt, "dtype %s, the store has %s", kv_dtype_name(dt), kv_dtype_name(a->dtype));
    DIFF(s->rope_theta != g->rope_theta, "rope theta %g, the store has %g", g->rope_theta, s->rope_theta);
    DIFF(s->rope_layout != g->rope_layout || s->rope_scaling != g->rope_scaling || s->keys_roped != g->keys_roped,
         "different RoPE settings from the store's");
    DIFF(s->rope_scaling == KV_ROPE_SCALING_LLAMA3 &&
             (s->rope_factor != g->rope_factor || s->rope_low_freq_factor != g->rope_low_freq_factor ||
              s->rope_high_freq_factor != g->rope_high_freq_factor || s->rope_orig_ctx != g->rope_orig_ctx),
         "different llama3 RoPE scaling from the store's");
    DIFF(s->model[0] && g->model[0] && strcmp(s->model, g->model), "model '%s', the store has '%s'", g->model, s->model);
#undef DIFF
    return true;
}

/* The plain K/V dtype shared by every layer of f (*packed false), or
 * *packed true when some layer is KIVI/DSQ-packed (decoded on put). */
static kv_status input_dtype(const kvc_file *f, kv_dtype *dt, bool *packed)
{
    const kv_geom *g = kvc_geom(f);
    *packed = false;
    for (int l = 0; l < g->n_layers; l++)
        for (int w = 0; w < 2; w++) {
            const char *e = kvc_layer_encoding(f, l, w ? 'v' : 'k');
            if (e && (!strcmp(e, "kivi") || !strcmp(e, "dsq"))) {
                *packed = true;
                continue;
            }
            const kvc_tensor *x = plain_part(f, l, w ? "v" : "k");
            if (!x)
                return kv_fail(KV_E_UNSUPPORTED, "layer %d %s are neither a plain F32/F16/BF16 tensor nor KIVI/DSQ parts",
                               l, w ? "values" : "keys");
            if (l == 0 && w == 0) *dt = x->dtype;
            else if (!*packed && x->dtype != *dt)
                return kv_fail(KV_E_UNSUPPORTED, "layer %d mixes dtypes (%s and %s)", l, kv_dtype_name(*dt),
                               kv_dtype_name(x->dtype));
        }
    return KV_OK;
}

/* A version-1 chunk: the whole .kvc, checked as before chunk version 2. */
static kv_status open_v1(const kv_tree_store *s, int i, int fd, tree_chunk *c)
{
    const kv_tree_node *nd = &s->t->nodes[i];
    kvc_file *f = NULL;
    kv_status st = kvc_open_fd(fd, &f);
    if (st) {
        kv_errcontext("chunk %s", nd->file);
        return st == KV_E_NOINPUT ? KV_E_DATA : st;
    }
    const kv_geom *g = kvc_geom(f);
    const kvc_tensor *tok = kvc_find(f, "tokens"), *imp = kvc_find(f, "importance");
    kv_dtype dt = KV_DT_F32;
    bool packed = false;
    char why[160];
    if ((st = input_dtype(f, &dt, &packed))) kv_errcontext("chunk %s", nd->file);
    else if (packed) st = kv_fail(KV_E_DATA, "chunk %s holds packed layers, which version-1 chunks never do", nd->file);
    else if (!same_geom(&s->t->geom, g, dt, why, sizeof why)) st = kv_fail(KV_E_DATA, "chunk %s has %s", nd->file, why);
    else if (g->n_tokens != nd->n)
        st = kv_fail(KV_E_DATA, "chunk %s holds %d tokens, the index says %d", nd->file, g->n_tokens, nd->n);
    else if (!tok || tok->dtype != KV_DT_I32 || tok->ndim != 1 || tok->shape[0] != nd->n)
        st = kv_fail(KV_E_DATA, "chunk %s: tokens is not I32 [%d]", nd->file, nd->n);
    else if (!imp || imp->dtype != KV_DT_F32 || imp->ndim != 1 || imp->shape[0] != nd->n)
        st = kv_fail(KV_E_DATA, "chunk %s: importance is not F32 [%d]", nd->file, nd->n);
    else if (kvc_find(f, "positions")) /* kvc(5): rows would not be positions start.. */
        st = kv_fail(KV_E_DATA, "chunk %s has a positions tensor: its rows are not the edge's positions", nd->file);
    c->v1 = f;
    if (st) return st;
    c->version = 1;
    c->n = nd->n, c->start = nd->start, c->group_rows = nd->n, c->n_frames = 1;
    c->enc = (kv_tree_enc){KV_TREE_ENC_RAW, 0, kvc_was_zstd(f), false};
    c->L = g->n_layers, c->Hkv = g->n_kv_heads, c->D = g->head_dim, c->dt = dt;
    c->tokens = malloc((size_t)nd->n * 4), c->imp = malloc((size_t)nd->n * 4);
    c->order = malloc((size_t)nd->n * 4), c->rank = malloc((size_t)nd->n * sizeof *c->rank);
    if (!c->tokens || !c->imp || !c->order || !c->rank) return kv_fail(KV_E_NOMEM, "cannot allocate chunk tables");
    memcpy(c->tokens, tok->data, (size_t)nd->n * 4);
    memcpy(c->imp, imp->data, (size_t)nd->n * 4);
    for (int k = 0; k < nd->n; k++) c->order[k] = k, c->rank[k] = k;
    for (int k = 0; k < nd->n; k++)
        if (!isfinite(c->imp[k]))
            return kv_fail(KV_E_DATA, "chunk %s: importance %d is %s", nd->file, k, isnan(c->imp[k]) ? "NaN" : "infinite");
    c->bytes_read = kvc_file_bytes(f);
    return KV_OK;
}

/* Open node i's chunk and check it against the index and the store:
 * geometry, dtype, token ids, importance, start.  Version 2 reads only the
 * head and tables here; rows come later, frame by frame. */
kv_status tree_node_open(const kv_tree_store *s, int i, tree_chunk *c)
{
    memset(c, 0, sizeof *c);
    c->fd = -1;
    const kv_tree_node *nd = &s->t->nodes[i];
    snprintf(c->name, sizeof c->name, "%s", nd->file);
    char *path = tree_path_join(s->dir, nd->file);
    if (!path) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    int fd;
    uint64_t size;
    kv_status st = store_file_open(path, nd->file, O_RDONLY, &fd, &size);
    free(path);
    if (st) return st == KV_E_NOINPUT ? KV_E_DATA : st; /* a chunk the index names is missing: damage */
    /* the index knows each chunk's size: a file that is not that size is
     * not read at all (it could be any size) */
    if (size != nd->bytes)
        st = kv_fail(KV_E_DATA, "chunk %s is %llu bytes, the index says %llu", nd->file, (unsigned long long)size,
                     (unsigned long long)nd->bytes);
    else if (nd->chunk_version == 1) {
        st = open_v1(s, i, fd, c);
    } else {
        c->fd = fd; /* the chunk owns it now */
        fd = -1;
        c->size = size;
        c->scratch = s->scratch;
        st = tree_chunk_parse(c, &s->t->geom);
    }
    if (fd >= 0) close(fd);
    if (!st && c->n != nd->n) st = kv_fail(KV_E_DATA, "chunk %s holds %d tokens, the index says %d", nd->file, c->n, nd->n);
    if (!st && c->start != nd->start)
        st = kv_fail(KV_E_DATA, "chunk %s starts at position %d, the index says %d", nd->file, c->start, nd->start);
    for (int k = 0; !st && k < nd->n; k++)
        if (c->tokens[k] != nd->tokens[k])
            st = kv_fail(KV_E_DATA, "chunk %s: token %d is %d, the index says %d", nd->file, k, c->tokens[k], nd->tokens[k]);
    if (!st && c->version >= 2 && (c->version != nd->chunk_version || !kv_tree_enc_equal(&c->enc, &nd->enc)))
        st = kv_fail(KV_E_DATA, "chunk %s is encoded otherwise than the index says", nd->file);
    if (st) tree_chunk_free(c); /* closes its descriptor */
    return st;
}

/* The rows of node i's chunk [a, a+n) in new buffers (one per layer and
 * K/V), the src of a rewrite. */
static kv_status chunk_read_all(tree_chunk *c, int a, int n, void ***k, void ***v)
{
    int L = c->L;
    size_t per = (size_t)c->Hkv * n * c->D * kv_dtype_size(c->dt);
    *k = calloc((size_t)L, sizeof **k), *v = calloc((size_t)L, sizeof **v);
    int *sel = malloc((size_t)n * sizeof *sel + 1);
    kv_status st = *k && *v && sel ? KV_OK : kv_fail(KV_E_NOMEM, "cannot allocate a chunk read");
    for (int l = 0; l < L && !st; l++)
        if (!((*k)[l] = malloc(per + 1)) || !((*v)[l] = malloc(per + 1))) st = kv_fail(KV_E_NOMEM, "cannot allocate a chunk read");
    for (int r = 0; r < n && !st; r++) sel[r] = a + r;
    if (!st) st = tree_chunk_rows(c, sel, n, *k, *v, n, 0);
    free(sel);
    return st;
}

static void free_layers(void **k, void **v, int L)
{
    for (int l = 0; l < L; l++) {
        if (k) free(k[l]);
        if (v) free(v[l]);
    }
    free(k);
    free(v);
}

/* Rewrite node i's chunk keeping rows [a, a+n) of c (the node's tokens must
 * already be updated to match) in the encoding of its tier, retiring the old
 * file.  The query samples stay with the rows that end the edge. */
kv_status tree_chunk_rewrite_range(kv_tree_store *s, int i, tree_chunk *c, int a, int n, int zstd_level,
                                   bool retire_old)
{
    void **k = NULL, **v = NULL;
    int *sel = malloc((size_t)n * sizeof *sel + 1);
    bool keep_q = c->n_q > 0 && a + n == c->n;
    float *q = keep_q ? malloc((size_t)c->L * c->q_heads * c->n_q * c->D * 4) : NULL;
    char old[KV_TREE_FILE_MAX];
    snprintf(old, sizeof old, "%s", s->t->nodes[i].file);
    kv_status st = sel && (!keep_q || q) ? KV_OK : kv_fail(KV_E_NOMEM, "cannot allocate a chunk rewrite");
    if (!st) st = chunk_read_all(c, a, n, &k, &v);
    if (!st && keep_q) st = tree_chunk_queries(c, q);
    if (!st) {
        for (int r = 0; r < n; r++) sel[r] = r;
        chunk_src src = {(const void *const *)k, (const void *const *)v, n};
        st = chunk_write(s, &s->t->nodes[i], &src, sel, n, c->tokens + a, c->imp + a, q, c->q_heads, c->n_q, zstd_level);
    }
    if (!st && retire_old) st = tree_retire(s, old);
    free_layers(k, v, c->L);
    free(sel);
    free(q);
    return st;
}

/* Split node i after off tokens, in the tree and on disk. */
kv_status tree_store_split(kv_tree_store *s, int i, int off, int zstd_level, uint64_t *written, int *head)
{
    tree_chunk c;
    kv_status st = tree_node_open(s, i, &c);
    if (st) return st;
    int n = s->t->nodes[i].n;
    if ((st = kv_tree_split(s->t, i, off, head))) goto out;
    /* The head gets a new chunk of rows [0, off); node i one of [off, n). */
    if ((st = tree_chunk_rewrite_range(s, *head, &c, 0, off, zstd_level, false))) goto out;
    if ((st = tree_chunk_rewrite_range(s, i, &c, off, n - off, zstd_level, true))) goto out;
    *written += s->t->nodes[*head].bytes + s->t->nodes[i].bytes;
out:
    tree_chunk_free(&c);
    return st;
}

// --- put ------------------------------------------------------------------------

/* Layer l's K or V of f in dtype dt: the tensor's own bytes when it is
 * plain in dt, else decoded (kvc(5)) and converted into *own. */
static kv_status input_part(const kvc_file *f, int l, char which, kv_dtype dt, const void **out, void **own)
{
    const kv_geom *g = kvc_geom(f);
    *own = NULL;
    const kvc_tensor *x = plain_part(f, l, which == 'k' ? "k" : "v");
    if (x && x->dtype == dt) {
        *out = x->data;
        return KV_OK;
    }
    size_t n = (size_t)g->n_kv_heads * g->n_tokens * g->head_dim;
    float *tmp = malloc(n * sizeof *tmp + 1);
    void *dst = malloc(n * kv_dtype_size(dt) + 1);
    kv_status st = tmp && dst ? kv_layer_decode(f, l, which, tmp) : kv_fail(KV_E_NOMEM, "cannot decode layer %d", l);
    for (size_t i = 0; i < n && !st; i++) {
        if (dt == KV_DT_F32) ((float *)dst)[i] = tmp[i];
        else if (dt == KV_DT_F16) ((kv_half *)dst)[i] = kv_f32_to_half(tmp[i]);
        else ((kv_bf16 *)dst)[i] = kv_f32_to_bf16(tmp[i]);
    }
    free(tmp);
    if (st) {
        free(dst);
        return st;
    }
    *out = *own = dst;
    return KV_OK;
}

kv_status kv_tree_store_put(kv_tree_store *s, const kvc_file *f, kv_tier tier, int zstd_level, int64_t now,
                       kv_put_report *r)
{
    memset(r, 0, sizeof *r);
    kv_tree *t = s->t;
    const kv_geom *g = kvc_geom(f);
    int T = g->n_tokens, L = g->n_layers;
    const kvc_tensor *tt = kvc_find(f, "tokens");
    if (!tt || tt->dtype != KV_DT_I32 || tt->ndim != 1 || tt->shape[0] != T)
        return kv_fail(KV_E_DATA, "input has no tokens tensor I32 [%d]; kv-tree keys caches by token ids", T);
    if (T <= 0) return kv_fail(KV_E_DATA, "input holds no tokens");
    /* kvc(5): a reader that cannot honour positions must reject the file.
     * A subset (what get --important writes) is not a prefix: storing its
     * rows as positions 0..n-1 would hand later requests wrong K/V. */
    if (kvc_find(f, "positions"))
        return kv_fail(KV_E_DATA, "input has a positions tensor (a token subset, as get --important writes); "
                                  "a subset is not a prefix, and kv-tree stores whole prefixes only");
    kv_dtype dt = KV_DT_F32;
    bool packed = false;
    kv_status st = input_dtype(f, &dt, &packed);
    if (st) return st;
    /* packed layers are decoded into the store's dtype (a new store: F16,
     * what the packed parts' fp16 residuals are) */
    if (packed) dt = t->has_geom ? t->geom.dtype : KV_DT_F16;
    char why[160];
    if (t->has_geom && !same_geom(&t->geom, g, dt, why, sizeof why))
        return kv_fail(KV_E_DATA, "input geometry does not match the store: it has %s", why);
    int H = g->n_heads, Q = g->n_q, D = g->head_dim;
    r->tokens = T;
    r->tier = tier;
    int32_t *tok = malloc((size_t)T * sizeof *tok);
    float *imp = malloc((size_t)T * sizeof *imp);
    float *q = Q > 0 && H > 0 ? malloc((size_t)L * H * Q * D * sizeof *q) : NULL;
    int *path = malloc((size_t)T * sizeof *path), *sel = malloc((size_t)T * sizeof *sel);
    const void **k = calloc((size_t)L, sizeof *k), **v = calloc((size_t)L, sizeof *v);
    void **kown = calloc((size_t)L, sizeof *kown), **vown = calloc((size_t)L, sizeof *vown);
    if (!tok || !imp || !path || !sel || !k || !v || !kown || !vown || (Q > 0 && H > 0 && !q)) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate for %d tokens", T);
        goto out;
    }
    memcpy(tok, tt->data, (size_t)T * sizeof *tok);
    for (int i = 0; i < T; i++)
        if (tok[i] < 0) {
            st = kv_fail(KV_E_DATA, "token %d has the negative id %d", i, tok[i]);
            goto out;
        }
    if ((st = kv_tree_importance(f, imp, &r->attention))) goto out;
    for (int l = 0; l < L && !st; l++)
        if (!(st = input_part(f, l, 'k', dt, &k[l], &kown[l]))) st = input_part(f, l, 'v', dt, &v[l], &vown[l]);
    for (int l = 0; q && l < L && !st; l++) /* checked finite by the importance */
        st = kvc_tensor_to_f32(kvc_layer(f, l, "q"), q + (size_t)l * H * Q * D);
    if (st) goto out;
    if (!t->has_geom) {
        t->geom.g = *g;
        t->geom.g.n_tokens = 0, t->geom.g.n_q = 0;
        t->geom.dtype = dt;
        t->has_geom = true;
    } else if (!t->geom.g.n_heads)
        t->geom.g.n_heads = g->n_heads;
    int np, used;
    int m = kv_tree_match(t, tok, T, path, &np, &used);
    r->matched = m;
    r->kv_bytes_shared = tree_kv_bytes_of(t, m);
    if (m < T && np && used < t->nodes[path[np - 1]].n) {
        int head;
        if ((st = tree_store_split(s, path[np - 1], used, zstd_level, &r->bytes_rewritten, &head))) goto out;
        path[np - 1] = head;
        r->nodes_split = 1;
    }
    for (int i = 0; i < np; i++) {
        t->nodes[path[i]].hits++;
        t->nodes[path[i]].last_use = now;
    }
    if (m < T) {
        int c;
        if ((st = kv_tree_add(t, np ? path[np - 1] : 0, tok + m, T - m, &c))) goto out;
        kv_tree_node *nd = &t->nodes[c];
        nd->tier = tier;
        nd->hits = 1;
        nd->last_use = now;
        nd->imp_attention = r->attention;
        for (int i = 0; i < T - m; i++) sel[i] = m + i;
        chunk_src src = {(const void *const *)k, (const void *const *)v, T};
        /* the new leaf ends where the prompt ends: it keeps the queries */
        if ((st = chunk_write(s, nd, &src, sel, T - m, tok + m, imp + m, q, H, Q, zstd_level))) goto out;
        r->bytes_added = nd->bytes;
        r->kv_bytes_added = nd->kv_bytes;
    }
out:
    for (int l = 0; l < L && kown && vown; l++) free(kown[l]), free(vown[l]);
    free(kown);
    free(vown);
    free(tok);
    free(imp);
    free(q);
    free(path);
    free(sel);
    free(k);
    free(v);
    return st;
}
