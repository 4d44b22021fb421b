/*
 * kv_tree_store: the store on disk: token importance (IMPRESS: attention
 * mass from the stored query samples, else key norms), opening, locking and
 * saving, chunk files, put and get.  Every file the store writes is new
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
#include "common/kv_outfile.h"

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
        const kvc_tensor *kt = plain_part(f, l, "k");
        if (!kt) {
            st = kv_fail(KV_E_UNSUPPORTED, "layer %d keys are not a plain F32/F16/BF16 tensor", l);
            goto out;
        }
        char nm[32];
        snprintf(nm, sizeof nm, "layers.%d.k", l);
        /* NaN keys would make the importance (and the index's summary of it,
         * which JSON cannot hold) NaN: the store keeps finite keys only */
        if ((st = kvc_tensor_to_f32(kt, k)) || (st = kv_check_finite3(nm, k, Hkv, T, D, "the store's importance")))
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

kv_status kv_tree_store_create(const char *dir)
{
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
    else if (!(st = kv_tree_new(&t)) && !(st = kv_tree_index_format(t, &text)))
        st = write_text(idx, text);
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

void kv_tree_store_close(kv_tree_store *s)
{
    if (!s) return;
    /* Chunks written by an operation that was never committed are orphans. */
    for (int i = 0; i < s->n_fresh; i++) unlink(s->fresh[i]);
    tree_list_free(s->fresh, s->n_fresh);
    tree_list_free(s->dead, s->n_dead);
    kv_tree_free(s->t);
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

/* One chunk to write: per layer, K and V rows gathered from a source laid
 * out [Hkv, src_T, D]; sel (n) picks the source token of each output row. */
typedef struct {
    const void *const *k, *const *v; /* (L) source buffers */
    int src_T;
} chunk_src;

/* Gather rows sel[0..n) of a [Hkv, src_T, D] tensor into rows
 * [off, off+n) of a [Hkv, dst_T, D] one. */
static void gather(void *dst, int dst_T, int off, const void *src, int Hkv, int src_T, int D, size_t es,
                   const int *sel, int n)
{
    size_t row = (size_t)D * es;
    for (int h = 0; h < Hkv; h++) {
        const char *sh = (const char *)src + (size_t)h * src_T * row;
        char *dh = (char *)dst + ((size_t)h * dst_T + off) * row;
        for (int i = 0; i < n;) { /* copy runs of consecutive rows at once */
            int j = i + 1;
            while (j < n && sel[j] == sel[j - 1] + 1) j++;
            memcpy(dh + (size_t)i * row, sh + (size_t)sel[i] * row, (size_t)(j - i) * row);
            i = j;
        }
    }
}

/* Write a new chunk file for node nd from src rows sel[0..n), with its
 * token ids and importances; fills nd->file, bytes, kv_bytes and the
 * importance summary.  Disk-tier chunks are zstd-compressed. */
static kv_status chunk_write(kv_tree_store *s, kv_tree_node *nd, const chunk_src *src, const int *sel, int n,
                             const int32_t *tok, const float *imp, int zstd_level)
{
    const kv_tree *t = s->t;
    const kv_geom *sg = &t->geom.g;
    int L = sg->n_layers, Hkv = sg->n_kv_heads, D = sg->head_dim;
    size_t es = es_of(t), per = (size_t)Hkv * n * D * es;
    kvc_writer *w = NULL;
    char *buf = malloc(per * 2 * (size_t)L + 1), *path = NULL;
    char file[KV_TREE_FILE_MAX];
    kv_status st = kvc_writer_new(&w);
    if (!st && !buf) st = kv_fail(KV_E_NOMEM, "cannot allocate a chunk of %d tokens", n);
    kv_geom g = *sg;
    g.n_tokens = n, g.n_q = 0;
    int64_t sh1[1] = {n}, sh3[3] = {Hkv, n, D};
    char start[24];
    snprintf(start, sizeof start, "%d", nd->start);
    if (!st) st = kvc_writer_geom(w, &g);
    if (!st) st = kvc_writer_meta(w, "kvtree.start", start);
    if (!st) st = kvc_writer_add(w, "tokens", KV_DT_I32, 1, sh1, tok);
    if (!st) st = kvc_writer_add(w, "importance", KV_DT_F32, 1, sh1, imp);
    for (int l = 0; l < L && !st; l++) {
        char name[64];
        char *kb = buf + per * 2 * (size_t)l, *vb = kb + per;
        gather(kb, n, 0, src->k[l], Hkv, src->src_T, D, es, sel, n);
        gather(vb, n, 0, src->v[l], Hkv, src->src_T, D, es, sel, n);
        snprintf(name, sizeof name, "layers.%d.k", l);
        if ((st = kvc_writer_add(w, name, t->geom.dtype, 3, sh3, kb))) break;
        snprintf(name, sizeof name, "layers.%d.v", l);
        st = kvc_writer_add(w, name, t->geom.dtype, 3, sh3, vb);
    }
    if (!st) {
        s->t->generation++;
        snprintf(file, sizeof file, "chunks/c%llu.kvc", (unsigned long long)s->t->generation);
        if (!(path = tree_path_join(s->dir, file))) st = kv_fail(KV_E_NOMEM, "cannot allocate a path");
    }
    if (!st) st = kvc_writer_write_ex(w, path, nd->tier == KV_TIER_DISK ? zstd_level : 0, KV_OUT_NOFOLLOW);
    if (!st && (st = list_push(&s->fresh, &s->n_fresh, &s->cap_fresh, path))) unlink(path);
    if (!st) {
        struct stat sb;
        if (lstat(path, &sb) != 0) st = kv_fail(KV_E_IO, "cannot stat %s: %s", path, strerror(errno));
        else {
            snprintf(nd->file, sizeof nd->file, "%s", file);
            nd->bytes = (uint64_t)sb.st_size;
            nd->kv_bytes = tree_kv_bytes_of(t, n);
            tree_imp_summary(nd, imp, n);
        }
    }
    kvc_writer_free(w);
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

/* The plain K/V dtype shared by every layer of f, or an error. */
static kv_status input_dtype(const kvc_file *f, kv_dtype *dt)
{
    const kv_geom *g = kvc_geom(f);
    for (int l = 0; l < g->n_layers; l++)
        for (int w = 0; w < 2; w++) {
            const kvc_tensor *x = plain_part(f, l, w ? "v" : "k");
            if (!x)
                return kv_fail(KV_E_UNSUPPORTED, "layer %d %s are not a plain F32/F16/BF16 tensor (kv-tree stores unpacked K/V)",
                               l, w ? "values" : "keys");
            if (l == 0 && w == 0) *dt = x->dtype;
            else if (x->dtype != *dt)
                return kv_fail(KV_E_UNSUPPORTED, "layer %d mixes dtypes (%s and %s)", l, kv_dtype_name(*dt),
                               kv_dtype_name(x->dtype));
        }
    return KV_OK;
}

/* Open node i's chunk and check it against the index and the store:
 * geometry, dtype, token ids, importance, tensor shapes. */
kv_status tree_chunk_open(const kv_tree_store *s, int i, kvc_file **out)
{
    *out = NULL;
    const kv_tree_node *nd = &s->t->nodes[i];
    char *path = tree_path_join(s->dir, nd->file);
    if (!path) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    kvc_file *f = NULL;
    int fd;
    uint64_t size;
    kv_status st = store_file_open(path, nd->file, O_RDONLY, &fd, &size);
    free(path);
    /* the index knows each chunk's size: a file that is not that size is
     * not read at all (it could be any size) */
    if (!st && size != nd->bytes)
        st = kv_fail(KV_E_DATA, "chunk %s is %llu bytes, the index says %llu", nd->file,
                     (unsigned long long)size, (unsigned long long)nd->bytes);
    if (!st) {
        st = kvc_open_fd(fd, &f);
        if (st) kv_errcontext("chunk %s", nd->file);
    }
    if (fd >= 0) close(fd);
    if (st) {
        if (st == KV_E_NOINPUT) st = KV_E_DATA; /* a chunk the index names is missing: damage */
        return st;
    }
    const kv_geom *g = kvc_geom(f);
    const kvc_tensor *tok = kvc_find(f, "tokens"), *imp = kvc_find(f, "importance");
    kv_dtype dt = KV_DT_F32;
    char why[160];
    if ((st = input_dtype(f, &dt))) kv_errcontext("chunk %s", nd->file);
    else if (!same_geom(&s->t->geom, g, dt, why, sizeof why))
        st = kv_fail(KV_E_DATA, "chunk %s has %s", nd->file, why);
    else if (g->n_tokens != nd->n)
        st = kv_fail(KV_E_DATA, "chunk %s holds %d tokens, the index says %d", nd->file, g->n_tokens, nd->n);
    else if (!tok || tok->dtype != KV_DT_I32 || tok->ndim != 1 || tok->shape[0] != nd->n)
        st = kv_fail(KV_E_DATA, "chunk %s: tokens is not I32 [%d]", nd->file, nd->n);
    else if (!imp || imp->dtype != KV_DT_F32 || imp->ndim != 1 || imp->shape[0] != nd->n)
        st = kv_fail(KV_E_DATA, "chunk %s: importance is not F32 [%d]", nd->file, nd->n);
    else
        for (int k = 0; k < nd->n; k++) {
            int32_t v;
            memcpy(&v, (const char *)tok->data + 4 * (size_t)k, 4);
            if (v != nd->tokens[k]) {
                st = kv_fail(KV_E_DATA, "chunk %s: token %d is %d, the index says %d", nd->file, k, v, nd->tokens[k]);
                break;
            }
        }
    /* put writes finite importances only; a NaN one (a chunk rewritten by
     * hand, checksum and all) would give get's ranking no order */
    for (int k = 0; !st && k < nd->n; k++) {
        float x;
        memcpy(&x, (const char *)imp->data + 4 * (size_t)k, 4);
        if (!isfinite(x))
            st = kv_fail(KV_E_DATA, "chunk %s: importance %d is %s", nd->file, k, isnan(x) ? "NaN" : "infinite");
    }
    if (st) {
        kvc_close(f);
        return st;
    }
    *out = f;
    return KV_OK;
}

/* Importances of an open chunk, copied (the mapping may be unaligned). */
float *tree_chunk_imp(const kvc_file *f, int n)
{
    float *imp = malloc((size_t)(n ? n : 1) * sizeof *imp);
    if (imp && n) memcpy(imp, kvc_find(f, "importance")->data, (size_t)n * sizeof *imp);
    return imp;
}

/* Rewrite node i's chunk keeping rows [a, a+n) (the node's tokens must
 * already be updated to match), retiring the old file. */
kv_status tree_chunk_rewrite_range(kv_tree_store *s, int i, const kvc_file *f, int a, int n, int zstd_level,
                                     bool retire_old)
{
    int L = s->t->geom.g.n_layers, T = kvc_geom(f)->n_tokens;
    const void **k = malloc((size_t)L * sizeof *k), **v = malloc((size_t)L * sizeof *v);
    int *sel = malloc((size_t)n * sizeof *sel);
    float *imp = tree_chunk_imp(f, T);
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    kv_status st = KV_OK;
    char old[KV_TREE_FILE_MAX];
    snprintf(old, sizeof old, "%s", s->t->nodes[i].file);
    if (!k || !v || !sel || !imp || !tok) st = kv_fail(KV_E_NOMEM, "cannot allocate a chunk rewrite");
    for (int l = 0; l < L && !st; l++) {
        k[l] = kvc_layer(f, l, "k")->data;
        v[l] = kvc_layer(f, l, "v")->data;
    }
    if (!st) {
        for (int r = 0; r < n; r++) sel[r] = a + r;
        memcpy(tok, (const char *)kvc_find(f, "tokens")->data + 4 * (size_t)a, (size_t)n * 4);
        chunk_src src = {(const void *const *)k, (const void *const *)v, T};
        st = chunk_write(s, &s->t->nodes[i], &src, sel, n, tok, imp + a, zstd_level);
    }
    if (!st && retire_old) st = tree_retire(s, old);
    free(k);
    free(v);
    free(sel);
    free(imp);
    free(tok);
    return st;
}

/* Split node i after off tokens, in the tree and on disk. */
kv_status tree_store_split(kv_tree_store *s, int i, int off, int zstd_level, uint64_t *written, int *head)
{
    kvc_file *f = NULL;
    kv_status st = tree_chunk_open(s, i, &f);
    if (st) return st;
    int n = s->t->nodes[i].n;
    if ((st = kv_tree_split(s->t, i, off, head))) goto out;
    /* The head gets a new chunk of rows [0, off); node i one of [off, n). */
    if ((st = tree_chunk_rewrite_range(s, *head, f, 0, off, zstd_level, false))) goto out;
    if ((st = tree_chunk_rewrite_range(s, i, f, off, n - off, zstd_level, true))) goto out;
    *written += s->t->nodes[*head].bytes + s->t->nodes[i].bytes;
out:
    kvc_close(f);
    return st;
}


// --- put ------------------------------------------------------------------------

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
    kv_status st = input_dtype(f, &dt);
    if (st) return st;
    char why[160];
    if (t->has_geom && !same_geom(&t->geom, g, dt, why, sizeof why))
        return kv_fail(KV_E_DATA, "input geometry does not match the store: it has %s", why);
    if (!t->has_geom) {
        t->geom.g = *g;
        t->geom.g.n_tokens = 0, t->geom.g.n_q = 0;
        t->geom.dtype = dt;
        t->has_geom = true;
    } else if (!t->geom.g.n_heads)
        t->geom.g.n_heads = g->n_heads;
    r->tokens = T;
    r->tier = tier;
    int32_t *tok = malloc((size_t)T * sizeof *tok);
    float *imp = malloc((size_t)T * sizeof *imp);
    int *path = malloc((size_t)T * sizeof *path), *sel = malloc((size_t)T * sizeof *sel);
    const void **k = malloc((size_t)L * sizeof *k), **v = malloc((size_t)L * sizeof *v);
    if (!tok || !imp || !path || !sel || !k || !v) {
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
        for (int l = 0; l < L; l++) {
            k[l] = kvc_layer(f, l, "k")->data;
            v[l] = kvc_layer(f, l, "v")->data;
        }
        for (int i = 0; i < T - m; i++) sel[i] = m + i;
        chunk_src src = {(const void *const *)k, (const void *const *)v, T};
        if ((st = chunk_write(s, nd, &src, sel, T - m, tok + m, imp + m, zstd_level))) goto out;
        r->bytes_added = nd->bytes;
        r->kv_bytes_added = nd->kv_bytes;
    }
out:
    free(tok);
    free(imp);
    free(path);
    free(sel);
    free(k);
    free(v);
    return st;
}

// --- get ------------------------------------------------------------------------

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

kv_status kv_tree_store_get(kv_tree_store *s, const int32_t *tok, int n, double frac, bool touch, int64_t now,
                       const char *out_path, kv_get_report *r)
{
    memset(r, 0, sizeof *r);
    kv_tree *t = s->t;
    r->tokens = n;
    if (!t->has_geom) return kv_fail(KV_E_DATA, "the store is empty (no cache was ever put)");
    const kv_geom *sg = &t->geom.g;
    int L = sg->n_layers, Hkv = sg->n_kv_heads, D = sg->head_dim;
    size_t es = es_of(t);
    int *path = malloc((size_t)(n ? n : 1) * sizeof *path), np = 0, used = 0;
    if (!path) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    int m = kv_tree_match(t, tok, n, path, &np, &used);
    r->matched = m;
    r->nodes = np;
    r->positions = frac < 1;
    kvc_file **cf = calloc((size_t)np + 1, sizeof *cf);
    int **sel = calloc((size_t)np + 1, sizeof *sel), *nsel = calloc((size_t)np + 1, sizeof *nsel);
    int32_t *otok = malloc((size_t)m * 4 + 4), *opos = malloc((size_t)m * 4 + 4);
    float *oimp = malloc((size_t)m * 4 + 4);
    char *kv = NULL;
    kvc_writer *w = NULL;
    kv_status st = KV_OK;
    if (!cf || !sel || !nsel || !otok || !opos || !oimp) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate for %d tokens", m);
        goto out;
    }
    int M = 0;
    for (int p = 0; p < np; p++) {
        const kv_tree_node *nd = &t->nodes[path[p]];
        int u = p == np - 1 ? used : nd->n, keep = u;
        if ((st = tree_chunk_open(s, path[p], &cf[p]))) goto out;
        float *imp = tree_chunk_imp(cf[p], nd->n);
        if (!imp || !(sel[p] = malloc((size_t)u * sizeof **sel + 1))) {
            free(imp);
            st = kv_fail(KV_E_NOMEM, "cannot allocate a selection");
            goto out;
        }
        if (frac < 1 && nd->tier == KV_TIER_DISK) {
            keep = (int)ceil(frac * u);
            if (keep > u) keep = u;
            if ((st = top_tokens(imp, u, keep, sel[p]))) {
                free(imp);
                goto out;
            }
        } else
            for (int i = 0; i < u; i++) sel[p][i] = i;
        for (int i = 0; i < keep; i++) {
            otok[M + i] = nd->tokens[sel[p][i]];
            opos[M + i] = nd->start + sel[p][i];
            oimp[M + i] = imp[sel[p][i]];
        }
        free(imp);
        nsel[p] = keep;
        M += keep;
        r->skipped += u - keep;
        r->bytes_read[nd->tier] += kvc_file_bytes(cf[p]);
        r->kv_bytes_out[nd->tier] += tree_kv_bytes_of(t, keep);
    }
    r->kept = M;
    size_t per = (size_t)Hkv * M * D * es;
    if (!(kv = malloc(per * 2 * (size_t)L + 1))) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate the output K/V (%d tokens)", M);
        goto out;
    }
    for (int l = 0; l < L; l++) {
        char *kb = kv + per * 2 * (size_t)l, *vb = kb + per;
        for (int p = 0, off = 0; p < np; off += nsel[p], p++) {
            const kv_geom *cg = kvc_geom(cf[p]);
            gather(kb, M, off, kvc_layer(cf[p], l, "k")->data, Hkv, cg->n_tokens, D, es, sel[p], nsel[p]);
            gather(vb, M, off, kvc_layer(cf[p], l, "v")->data, Hkv, cg->n_tokens, D, es, sel[p], nsel[p]);
        }
    }
    kv_geom g = *sg;
    g.n_tokens = M, g.n_q = 0;
    int64_t sh1[1] = {M}, sh3[3] = {Hkv, M, D};
    char mbuf[24];
    snprintf(mbuf, sizeof mbuf, "%d", m);
    if ((st = kvc_writer_new(&w)) || (st = kvc_writer_geom(w, &g)) || (st = kvc_writer_meta(w, "kvtree.matched", mbuf)) ||
        (st = kvc_writer_add(w, "tokens", KV_DT_I32, 1, sh1, otok)) ||
        (r->positions && (st = kvc_writer_add(w, "positions", KV_DT_I32, 1, sh1, opos))) ||
        (st = kvc_writer_add(w, "importance", KV_DT_F32, 1, sh1, oimp)))
        goto out;
    for (int l = 0; l < L; l++) {
        char name[64];
        char *kb = kv + per * 2 * (size_t)l, *vb = kb + per;
        snprintf(name, sizeof name, "layers.%d.k", l);
        if ((st = kvc_writer_add(w, name, t->geom.dtype, 3, sh3, kb))) goto out;
        snprintf(name, sizeof name, "layers.%d.v", l);
        if ((st = kvc_writer_add(w, name, t->geom.dtype, 3, sh3, vb))) goto out;
    }
    if ((st = kvc_writer_write(w, out_path, 0))) goto out;
    if (touch)
        for (int p = 0; p < np; p++) {
            t->nodes[path[p]].hits++;
            t->nodes[path[p]].last_use = now;
        }
out:
    kvc_writer_free(w);
    free(kv);
    if (cf)
        for (int p = 0; p < np; p++) kvc_close(cf[p]);
    if (sel)
        for (int p = 0; p < np; p++) free(sel[p]);
    free(cf);
    free(sel);
    free(nsel);
    free(otok);
    free(opos);
    free(oimp);
    free(path);
    return st;
}

