/*
 * kv_tree: the prefix-sharing KV store (man/kv-tree.1).  Chapters: the
 * in-memory radix tree over token ids; the index.json reader and writer
 * (validated field by field, fuzzed by tests/fuzz/fuzz_tree.c); token
 * importance (IMPRESS: attention mass from the stored query samples, else
 * key norms); then the store on disk: chunk files, put, get, place, rm, gc,
 * check.  Every file the store writes is new (chunks/c<generation>.kvc,
 * never reused) and the index is committed atomically before replaced
 * chunks are unlinked, so a crash at any point leaves the old or the new
 * index, each naming only complete chunks (at worst some orphans, which gc
 * removes).
 */
#include "tree/kv_tree.h"

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

#define INDEX_NAME "index.json"
#define MAX_INDEX_BYTES (1u << 30)
#define MAX_TREE_TOKENS (1 << 26) /* tokens over all edges: bounds memory on bad input */
#define MAX_DIM (1 << 20)

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

static int find_child(const kv_tree *t, int i, int32_t tok)
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
        int c = find_child(t, cur, tok[m]);
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
    if (parent < 0 || parent >= t->n_nodes || n <= 0 || find_child(t, parent, tok[0]) >= 0)
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

// --- index.json -------------------------------------------------------------

static bool get_int(const cJSON *o, const char *key, double lo, double hi, double *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d) || d < lo || d > hi) return false;
    *out = d;
    return true;
}

static bool get_real(const cJSON *o, const char *key, double *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) return false;
    *out = v->valuedouble;
    return true;
}

static const char *get_str(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

#define U53 ((double)KV_TREE_BYTES_MAX)

/* A chunk name must stay inside STORE/chunks/: "chunks/" + [A-Za-z0-9._-]+
 * not starting with '.' (temp files start with '.'). */
static bool safe_file(const char *s)
{
    if (!s || strncmp(s, "chunks/", 7) != 0) return false;
    size_t n = strlen(s);
    if (n <= 7 || n >= KV_TREE_FILE_MAX || s[7] == '.') return false;
    for (size_t i = 7; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}

static kv_status parse_geom(const cJSON *o, kv_tree_geom *tg)
{
    kv_geom *g = &tg->g;
    kv_geom_defaults(g);
    double L, H, Hkv, D;
    if (!cJSON_IsObject(o)) return kv_fail(KV_E_DATA, "index: geometry is not an object");
    if (!get_int(o, "n_layers", 1, MAX_DIM, &L) || !get_int(o, "n_heads", 0, MAX_DIM, &H) ||
        !get_int(o, "n_kv_heads", 1, MAX_DIM, &Hkv) || !get_int(o, "head_dim", 1, MAX_DIM, &D))
        return kv_fail(KV_E_DATA, "index: geometry needs integer n_layers, n_heads, n_kv_heads, head_dim");
    g->n_layers = (int)L, g->n_heads = (int)H, g->n_kv_heads = (int)Hkv, g->head_dim = (int)D;
    if (g->n_heads % g->n_kv_heads)
        return kv_fail(KV_E_DATA, "index: n_heads %d is not a multiple of n_kv_heads %d", g->n_heads, g->n_kv_heads);
    const char *dt = get_str(o, "dtype");
    if (!dt || kv_dtype_parse(dt, &tg->dtype) ||
        (tg->dtype != KV_DT_F32 && tg->dtype != KV_DT_F16 && tg->dtype != KV_DT_BF16))
        return kv_fail(KV_E_DATA, "index: geometry dtype must be F32, F16 or BF16");
    if (!get_real(o, "rope_theta", &g->rope_theta) || g->rope_theta <= 0)
        return kv_fail(KV_E_DATA, "index: bad rope_theta");
    const char *sc = get_str(o, "rope_scaling"), *lay = get_str(o, "rope_layout"), *model = get_str(o, "model");
    const cJSON *kr = cJSON_GetObjectItemCaseSensitive(o, "keys_roped");
    if (!sc || !lay || !model || !cJSON_IsBool(kr))
        return kv_fail(KV_E_DATA, "index: geometry needs rope_scaling, rope_layout, keys_roped, model");
    g->keys_roped = cJSON_IsTrue(kr);
    if (!strcmp(lay, "interleaved")) g->rope_layout = KV_ROPE_INTERLEAVED;
    else if (!strcmp(lay, "halves")) g->rope_layout = KV_ROPE_HALVES;
    else return kv_fail(KV_E_DATA, "index: unknown rope_layout '%.20s'", lay);
    if (!strcmp(sc, "none")) g->rope_scaling = KV_ROPE_SCALING_NONE;
    else if (!strcmp(sc, "llama3")) {
        double ctx;
        g->rope_scaling = KV_ROPE_SCALING_LLAMA3;
        if (!get_real(o, "rope_factor", &g->rope_factor) || !get_real(o, "rope_low_freq_factor", &g->rope_low_freq_factor) ||
            !get_real(o, "rope_high_freq_factor", &g->rope_high_freq_factor) ||
            !get_int(o, "rope_orig_ctx", 1, INT_MAX, &ctx))
            return kv_fail(KV_E_DATA, "index: llama3 rope scaling needs its four parameters");
        g->rope_orig_ctx = (int)ctx;
    } else
        return kv_fail(KV_E_DATA, "index: unknown rope_scaling '%.20s'", sc);
    snprintf(g->model, sizeof g->model, "%s", model);
    return KV_OK;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static kv_status parse_node(kv_tree *t, const cJSON *o, int idx, long *total)
{
    double v;
    if (!cJSON_IsObject(o)) return kv_fail(KV_E_DATA, "index: node %d is not an object", idx);
    if (!get_int(o, "id", idx, idx, &v)) return kv_fail(KV_E_DATA, "index: node %d: id must be %d", idx, idx);
    double par;
    if (!get_int(o, "parent", 0, idx - 1, &par))
        return kv_fail(KV_E_DATA, "index: node %d: parent must be an earlier node (0 = root)", idx);
    if (!t->nodes[(int)par].live) return kv_fail(KV_E_INTERNAL, "index: dead parent");
    const cJSON *toks = cJSON_GetObjectItemCaseSensitive(o, "tokens");
    int n = cJSON_IsArray(toks) ? cJSON_GetArraySize(toks) : 0;
    if (n <= 0) return kv_fail(KV_E_DATA, "index: node %d: tokens must be a non-empty array", idx);
    if ((*total += n) > MAX_TREE_TOKENS) return kv_fail(KV_E_DATA, "index: more than %d tokens in all", MAX_TREE_TOKENS);
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    if (!tok) return kv_fail(KV_E_NOMEM, "cannot allocate %d tokens", n);
    int k = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, toks)
    {
        double d = cJSON_IsNumber(e) ? e->valuedouble : -1;
        if (!isfinite(d) || d != floor(d) || d < 0 || d > INT32_MAX) {
            free(tok);
            return kv_fail(KV_E_DATA, "index: node %d: token %d is not an id in [0, 2^31)", idx, k);
        }
        tok[k++] = (int32_t)d;
    }
    if (find_child(t, (int)par, tok[0]) >= 0) {
        free(tok);
        return kv_fail(KV_E_DATA, "index: node %d starts with the same token as a sibling", idx);
    }
    int c;
    kv_status st = kv_tree_add(t, (int)par, tok, n, &c);
    free(tok);
    if (st) return st;
    kv_tree_node *nd = &t->nodes[c];
    if (!get_int(o, "start", nd->start, nd->start, &v))
        return kv_fail(KV_E_DATA, "index: node %d: start must be %d (its parent's end)", idx, nd->start);
    if ((long)nd->start + nd->n > INT_MAX) return kv_fail(KV_E_DATA, "index: node %d: sequence too long", idx);
    const char *file = get_str(o, "file");
    if (!safe_file(file)) return kv_fail(KV_E_DATA, "index: node %d: bad chunk file name", idx);
    snprintf(nd->file, sizeof nd->file, "%s", file);
    double b, kb, hits, lu;
    if (!get_int(o, "bytes", 0, U53, &b) || !get_int(o, "kv_bytes", 0, U53, &kb) || !get_int(o, "hits", 0, U53, &hits) ||
        !get_int(o, "last_use", -U53, U53, &lu))
        return kv_fail(KV_E_DATA, "index: node %d: bytes, kv_bytes, hits, last_use must be integers", idx);
    nd->bytes = (uint64_t)b, nd->kv_bytes = (uint64_t)kb, nd->hits = (uint64_t)hits, nd->last_use = (int64_t)lu;
    int tier = kv_tier_parse(get_str(o, "tier"));
    if (tier < 0) return kv_fail(KV_E_DATA, "index: node %d: tier must be gpu, host or disk", idx);
    nd->tier = (kv_tier)tier;
    const cJSON *imp = cJSON_GetObjectItemCaseSensitive(o, "importance");
    double mean, mn, mx;
    const char *src = cJSON_IsObject(imp) ? get_str(imp, "source") : NULL;
    if (!src || !get_real(imp, "mean", &mean) || !get_real(imp, "min", &mn) || !get_real(imp, "max", &mx) ||
        fabs(mean) > 1e30 || fabs(mn) > 1e30 || fabs(mx) > 1e30)
        return kv_fail(KV_E_DATA, "index: node %d: importance needs mean, min, max and source", idx);
    if (strcmp(src, "attention") && strcmp(src, "key-norm"))
        return kv_fail(KV_E_DATA, "index: node %d: importance source must be attention or key-norm", idx);
    nd->imp_mean = (float)mean, nd->imp_min = (float)mn, nd->imp_max = (float)mx;
    nd->imp_attention = !strcmp(src, "attention");
    return KV_OK;
}

static kv_status parse_json(const cJSON *j, kv_tree *t)
{
    kv_status st;
    double v;
    if (!cJSON_IsObject(j)) return kv_fail(KV_E_DATA, "index: not a JSON object");
    const char *fmt = get_str(j, "format");
    if (!fmt || strcmp(fmt, "kv-tree")) return kv_fail(KV_E_DATA, "index: format is not \"kv-tree\"");
    if (!get_int(j, "version", 1, U53, &v)) return kv_fail(KV_E_DATA, "index: version must be a positive integer");
    if (v > KV_TREE_INDEX_VERSION)
        return kv_fail(KV_E_DATA, "index is version %.0f; this kv-tree reads version %d or older", v,
                       KV_TREE_INDEX_VERSION);
    if (!get_int(j, "generation", 0, U53, &v)) return kv_fail(KV_E_DATA, "index: generation must be an integer");
    t->generation = (uint64_t)v;
    const cJSON *g = cJSON_GetObjectItemCaseSensitive(j, "geometry");
    if (g && !cJSON_IsNull(g)) {
        if ((st = parse_geom(g, &t->geom))) return st;
        t->has_geom = true;
    }
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(j, "budgets");
    if (b && !cJSON_IsNull(b)) {
        double gb, hb;
        if (!get_int(b, "gpu", 0, U53, &gb) || !get_int(b, "host", 0, U53, &hb))
            return kv_fail(KV_E_DATA, "index: budgets need integer gpu and host");
        t->gpu_budget = (uint64_t)gb, t->host_budget = (uint64_t)hb, t->has_budgets = true;
    }
    const cJSON *nodes = cJSON_GetObjectItemCaseSensitive(j, "nodes");
    if (!cJSON_IsArray(nodes)) return kv_fail(KV_E_DATA, "index: nodes must be an array");
    if (cJSON_GetArraySize(nodes) && !t->has_geom) return kv_fail(KV_E_DATA, "index: nodes without a geometry");
    int idx = 0;
    long total = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, nodes)
    {
        if ((st = parse_node(t, e, ++idx, &total))) return st;
    }
    /* Two nodes naming one chunk would lose data when either is evicted. */
    if (t->n_nodes > 2) {
        char **names = malloc((size_t)(t->n_nodes - 1) * sizeof *names);
        if (!names) return kv_fail(KV_E_NOMEM, "cannot allocate a name list");
        for (int i = 1; i < t->n_nodes; i++) names[i - 1] = t->nodes[i].file;
        qsort(names, (size_t)(t->n_nodes - 1), sizeof *names, cmp_str);
        for (int i = 1; i < t->n_nodes - 1; i++)
            if (!strcmp(names[i - 1], names[i])) {
                st = kv_fail(KV_E_DATA, "index: two nodes name the chunk %s", names[i]);
                break;
            }
        free(names);
    }
    return st;
}

kv_status kv_tree_index_parse(const char *text, size_t len, kv_tree **out)
{
    *out = NULL;
    cJSON *j = cJSON_ParseWithLength(text, len);
    if (!j) return kv_fail(KV_E_DATA, "index: malformed JSON");
    kv_tree *t;
    kv_status st = kv_tree_new(&t);
    if (!st) st = parse_json(j, t);
    cJSON_Delete(j);
    if (st) {
        kv_tree_free(t);
        return st;
    }
    *out = t;
    return KV_OK;
}

/* 64-bit counts as exact decimal text: cJSON prints numbers with 15
 * significant digits when that reads back within an epsilon, so a budget
 * of 2^53 came back as 9007199254740990. */
static void add_u64(cJSON *o, const char *key, uint64_t v)
{
    char b[32];
    snprintf(b, sizeof b, "%llu", (unsigned long long)v);
    cJSON_AddRawToObject(o, key, b);
}

static void add_i64(cJSON *o, const char *key, int64_t v)
{
    char b[32];
    snprintf(b, sizeof b, "%lld", (long long)v);
    cJSON_AddRawToObject(o, key, b);
}

static cJSON *geom_json(const kv_tree_geom *tg)
{
    const kv_geom *g = &tg->g;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "n_layers", g->n_layers);
    cJSON_AddNumberToObject(o, "n_heads", g->n_heads);
    cJSON_AddNumberToObject(o, "n_kv_heads", g->n_kv_heads);
    cJSON_AddNumberToObject(o, "head_dim", g->head_dim);
    cJSON_AddStringToObject(o, "dtype", kv_dtype_name(tg->dtype));
    cJSON_AddNumberToObject(o, "rope_theta", g->rope_theta);
    cJSON_AddStringToObject(o, "rope_scaling", g->rope_scaling == KV_ROPE_SCALING_LLAMA3 ? "llama3" : "none");
    if (g->rope_scaling == KV_ROPE_SCALING_LLAMA3) {
        cJSON_AddNumberToObject(o, "rope_factor", g->rope_factor);
        cJSON_AddNumberToObject(o, "rope_low_freq_factor", g->rope_low_freq_factor);
        cJSON_AddNumberToObject(o, "rope_high_freq_factor", g->rope_high_freq_factor);
        cJSON_AddNumberToObject(o, "rope_orig_ctx", g->rope_orig_ctx);
    }
    cJSON_AddStringToObject(o, "rope_layout", g->rope_layout == KV_ROPE_HALVES ? "halves" : "interleaved");
    cJSON_AddBoolToObject(o, "keys_roped", g->keys_roped);
    cJSON_AddStringToObject(o, "model", g->model);
    return o;
}

kv_status kv_tree_index_format(const kv_tree *t, char **out)
{
    *out = NULL;
    /* Renumber live nodes in depth-first preorder so every parent precedes
     * its children (the reader relies on it to rule out cycles). */
    int *order = malloc((size_t)t->n_nodes * sizeof *order), *newid = malloc((size_t)t->n_nodes * sizeof *newid);
    int *stack = malloc((size_t)t->n_nodes * sizeof *stack);
    cJSON *j = cJSON_CreateObject();
    kv_status st = KV_OK;
    if (!order || !newid || !stack || !j) {
        st = kv_fail(KV_E_NOMEM, "cannot format the index");
        goto out;
    }
    int no = 0, sp = 0;
    stack[sp++] = 0;
    while (sp) {
        int i = stack[--sp];
        newid[i] = no;
        order[no++] = i;
        const kv_tree_node *nd = &t->nodes[i];
        for (int c = nd->n_child - 1; c >= 0 && sp < t->n_nodes; c--)
            if (t->nodes[nd->child[c]].live) stack[sp++] = nd->child[c];
    }
    cJSON_AddStringToObject(j, "format", "kv-tree");
    cJSON_AddNumberToObject(j, "version", KV_TREE_INDEX_VERSION);
    add_u64(j, "generation", t->generation);
    if (t->has_geom) cJSON_AddItemToObject(j, "geometry", geom_json(&t->geom));
    else cJSON_AddNullToObject(j, "geometry");
    if (t->has_budgets) {
        cJSON *b = cJSON_AddObjectToObject(j, "budgets");
        add_u64(b, "gpu", t->gpu_budget);
        add_u64(b, "host", t->host_budget);
    } else
        cJSON_AddNullToObject(j, "budgets");
    cJSON *arr = cJSON_AddArrayToObject(j, "nodes");
    for (int k = 1; k < no; k++) {
        const kv_tree_node *nd = &t->nodes[order[k]];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddItemToArray(arr, o);
        cJSON_AddNumberToObject(o, "id", k);
        cJSON_AddNumberToObject(o, "parent", newid[nd->parent]);
        cJSON_AddNumberToObject(o, "start", nd->start);
        cJSON *tk = cJSON_AddArrayToObject(o, "tokens");
        for (int i = 0; i < nd->n; i++) cJSON_AddItemToArray(tk, cJSON_CreateNumber(nd->tokens[i]));
        cJSON_AddStringToObject(o, "file", nd->file);
        add_u64(o, "bytes", nd->bytes);
        add_u64(o, "kv_bytes", nd->kv_bytes);
        cJSON_AddStringToObject(o, "tier", kv_tier_name(nd->tier));
        add_u64(o, "hits", nd->hits);
        add_i64(o, "last_use", nd->last_use);
        cJSON *im = cJSON_AddObjectToObject(o, "importance");
        cJSON_AddNumberToObject(im, "mean", nd->imp_mean);
        cJSON_AddNumberToObject(im, "min", nd->imp_min);
        cJSON_AddNumberToObject(im, "max", nd->imp_max);
        cJSON_AddStringToObject(im, "source", nd->imp_attention ? "attention" : "key-norm");
    }
    *out = cJSON_PrintUnformatted(j);
    if (!*out) st = kv_fail(KV_E_NOMEM, "cannot print the index");
out:
    cJSON_Delete(j);
    free(order);
    free(newid);
    free(stack);
    return st;
}

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

struct kv_tree_store {
    char *dir;
    int lock_fd;
    kv_tree *t;
    char **fresh; /* (n_fresh) chunk paths written since the last save */
    int n_fresh, cap_fresh;
    char **dead;  /* (n_dead) chunk paths to unlink once the index is saved */
    int n_dead, cap_dead;
};

static char *path_join(const char *dir, const char *name)
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

static void list_free(char **list, int n)
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

kv_status kv_tree_store_init(const char *dir)
{
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return kv_fail(errno == ENOENT ? KV_E_NOINPUT : KV_E_CANTCREATE, "cannot create %s: %s", dir, strerror(errno));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) return kv_fail(KV_E_CANTCREATE, "%s exists and is not a directory", dir);
    char *idx = path_join(dir, INDEX_NAME), *chunks = path_join(dir, "chunks"), *text = NULL;
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
    char *idx = path_join(dir, INDEX_NAME), *lock = path_join(dir, "lock"), *text = NULL;
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
        char *cdir = path_join(dir, "chunks");
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
    list_free(s->fresh, s->n_fresh);
    list_free(s->dead, s->n_dead);
    kv_tree_free(s->t);
    if (s->lock_fd >= 0) close(s->lock_fd); /* releases the flock */
    free(s->dir);
    free(s);
}

const kv_tree *kv_tree_store_tree(const kv_tree_store *s) { return s->t; }

kv_status kv_tree_store_save(kv_tree_store *s)
{
    char *text = NULL, *idx = path_join(s->dir, INDEX_NAME);
    if (!idx) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    kv_status st = kv_tree_index_format(s->t, &text);
    if (!st) st = write_text(idx, text);
    free(text);
    free(idx);
    if (st) return st;
    list_free(s->fresh, s->n_fresh);
    s->fresh = NULL, s->n_fresh = s->cap_fresh = 0;
    for (int i = 0; i < s->n_dead; i++) unlink(s->dead[i]); /* a failure only leaves an orphan */
    list_free(s->dead, s->n_dead);
    s->dead = NULL, s->n_dead = s->cap_dead = 0;
    return KV_OK;
}

static kv_status retire(kv_tree_store *s, const char *file)
{
    char *p = path_join(s->dir, file);
    if (!p) return kv_fail(KV_E_NOMEM, "cannot allocate a path");
    kv_status st = list_push(&s->dead, &s->n_dead, &s->cap_dead, p);
    free(p);
    return st;
}

// --- chunks -----------------------------------------------------------------------

static size_t es_of(const kv_tree *t) { return kv_dtype_size(t->geom.dtype); }

/* Uncompressed K/V bytes of n tokens. */
static uint64_t kv_bytes_of(const kv_tree *t, int n)
{
    const kv_geom *g = &t->geom.g;
    return 2ull * (uint64_t)g->n_layers * (uint64_t)g->n_kv_heads * (uint64_t)n * (uint64_t)g->head_dim * es_of(t);
}

static void imp_summary(kv_tree_node *nd, const float *imp, int n)
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
        if (!(path = path_join(s->dir, file))) st = kv_fail(KV_E_NOMEM, "cannot allocate a path");
    }
    if (!st) st = kvc_writer_write_ex(w, path, nd->tier == KV_TIER_DISK ? zstd_level : 0, KV_OUT_NOFOLLOW);
    if (!st && (st = list_push(&s->fresh, &s->n_fresh, &s->cap_fresh, path))) unlink(path);
    if (!st) {
        struct stat sb;
        if (lstat(path, &sb) != 0) st = kv_fail(KV_E_IO, "cannot stat %s: %s", path, strerror(errno));
        else {
            snprintf(nd->file, sizeof nd->file, "%s", file);
            nd->bytes = (uint64_t)sb.st_size;
            nd->kv_bytes = kv_bytes_of(t, n);
            imp_summary(nd, imp, n);
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
static kv_status chunk_open(const kv_tree_store *s, int i, kvc_file **out)
{
    *out = NULL;
    const kv_tree_node *nd = &s->t->nodes[i];
    char *path = path_join(s->dir, nd->file);
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
    if (st) {
        kvc_free(f);
        return st;
    }
    *out = f;
    return KV_OK;
}

/* Importances of an open chunk, copied (the mapping may be unaligned). */
static float *chunk_imp(const kvc_file *f, int n)
{
    float *imp = malloc((size_t)(n ? n : 1) * sizeof *imp);
    if (imp && n) memcpy(imp, kvc_find(f, "importance")->data, (size_t)n * sizeof *imp);
    return imp;
}

/* Rewrite node i's chunk keeping rows [a, a+n) (the node's tokens must
 * already be updated to match), retiring the old file. */
static kv_status chunk_rewrite_range(kv_tree_store *s, int i, const kvc_file *f, int a, int n, int zstd_level,
                                     bool retire_old)
{
    int L = s->t->geom.g.n_layers, T = kvc_geom(f)->n_tokens;
    const void **k = malloc((size_t)L * sizeof *k), **v = malloc((size_t)L * sizeof *v);
    int *sel = malloc((size_t)n * sizeof *sel);
    float *imp = chunk_imp(f, T);
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
    if (!st && retire_old) st = retire(s, old);
    free(k);
    free(v);
    free(sel);
    free(imp);
    free(tok);
    return st;
}

/* Split node i after off tokens, in the tree and on disk. */
static kv_status store_split(kv_tree_store *s, int i, int off, int zstd_level, uint64_t *written, int *head)
{
    kvc_file *f = NULL;
    kv_status st = chunk_open(s, i, &f);
    if (st) return st;
    int n = s->t->nodes[i].n;
    if ((st = kv_tree_split(s->t, i, off, head))) goto out;
    /* The head gets a new chunk of rows [0, off); node i one of [off, n). */
    if ((st = chunk_rewrite_range(s, *head, f, 0, off, zstd_level, false))) goto out;
    if ((st = chunk_rewrite_range(s, i, f, off, n - off, zstd_level, true))) goto out;
    *written += s->t->nodes[*head].bytes + s->t->nodes[i].bytes;
out:
    kvc_free(f);
    return st;
}

#define RM_ZSTD_LEVEL 3 /* splits made by rm keep the node's tier; disk chunks get this level */

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
    r->kv_bytes_shared = kv_bytes_of(t, m);
    if (m < T && np && used < t->nodes[path[np - 1]].n) {
        int head;
        if ((st = store_split(s, path[np - 1], used, zstd_level, &r->bytes_rewritten, &head))) goto out;
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
        if ((st = chunk_open(s, path[p], &cf[p]))) goto out;
        float *imp = chunk_imp(cf[p], nd->n);
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
        r->kv_bytes_out[nd->tier] += kv_bytes_of(t, keep);
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
        for (int p = 0; p < np; p++) kvc_free(cf[p]);
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

// --- place ------------------------------------------------------------------------

double kv_tree_score(const kv_tree_node *nd, int64_t now, double half_life)
{
    double age = (double)(now - nd->last_use);
    if (age < 0) age = 0;
    return (double)nd->imp_mean * (1.0 + (double)nd->hits) * exp2(-age / (half_life > 0 ? half_life : 1));
}

/* Rewrite node i's whole chunk (after its tier changed compression). */
static kv_status chunk_recompress(kv_tree_store *s, int i, int zstd_level)
{
    kvc_file *f = NULL;
    kv_status st = chunk_open(s, i, &f);
    if (st) return st;
    st = chunk_rewrite_range(s, i, f, 0, s->t->nodes[i].n, zstd_level, true);
    kvc_free(f);
    return st;
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
        if ((to == KV_TIER_DISK) != (from == KV_TIER_DISK)) {
            if ((st = chunk_recompress(s, i, zstd_level))) break;
            r->bytes_rewritten += nd->bytes;
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
        st = retire(s, nd->file);
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
            if (!(st = store_split(s, last, used, RM_ZSTD_LEVEL, &w, &head))) st = drop_subtree(s, last, r);
        } else {
            while (!st && t->nodes[last].n_child) st = drop_subtree(s, t->nodes[last].child[0], r);
        }
    }
    r->bytes_after = live_bytes(t);
    free(path);
    return st;
}

/* Delete chunk files (and temp files of interrupted writes) that no live
 * node names.  Only safe under the exclusive lock, after the index is saved. */
/* Temp files of index writes that never committed (a writer killed between
 * creating ".index.json.XXXXXX" and renaming it).  Only a lock holder
 * writes the index, so under the lock every such file is a leftover. */
static bool index_temp_name(const char *name)
{
    static const char pre[] = "." INDEX_NAME ".";
    return strncmp(name, pre, sizeof pre - 1) == 0 && strlen(name) == sizeof pre - 1 + 6;
}

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
        char *p = path_join(s->dir, e->d_name);
        if (!p) st = kv_fail(KV_E_NOMEM, "cannot allocate a path");
        else unlink(p); /* a failure leaves it for the next gc */
        free(p);
    }
    closedir(d);
    return st;
}

static kv_status remove_orphans(kv_tree_store *s, int *count, bool dry)
{
    *count = 0;
    char *cdir = path_join(s->dir, "chunks");
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
        qsort(names, (size_t)nn, sizeof *names, cmp_str);
    }
    struct dirent *e;
    while (names && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        const char *key = e->d_name;
        if (bsearch(&key, names, (size_t)nn, sizeof *names, cmp_str)) continue;
        (*count)++;
        if (!dry) {
            char *p = path_join(cdir, e->d_name);
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
        kvc_file *f = NULL;
        kv_errclear();
        if (chunk_open(s, i, &f)) {
            problem(r, "%s", kv_errdetail());
            continue;
        }
        bool ok = true;
        if (kvc_file_bytes(f) != nd->bytes)
            problem(r, "chunk %s is %llu bytes, the index says %llu", nd->file, (unsigned long long)kvc_file_bytes(f),
                    (unsigned long long)nd->bytes), ok = false;
        if (kvc_was_zstd(f) != (nd->tier == KV_TIER_DISK))
            problem(r, "chunk %s is %s but its tier is %s", nd->file, kvc_was_zstd(f) ? "compressed" : "not compressed",
                    kv_tier_name(nd->tier)), ok = false;
        if (nd->kv_bytes != kv_bytes_of(t, nd->n))
            problem(r, "node %s: kv_bytes %llu, expected %llu", nd->file, (unsigned long long)nd->kv_bytes,
                    (unsigned long long)kv_bytes_of(t, nd->n)), ok = false;
        float *imp = chunk_imp(f, nd->n);
        if (imp) {
            kv_tree_node tmp = *nd;
            imp_summary(&tmp, imp, nd->n);
            if (fabsf(tmp.imp_mean - nd->imp_mean) > 1e-3f * (1 + fabsf(nd->imp_mean)) || tmp.imp_max != nd->imp_max ||
                tmp.imp_min != nd->imp_min)
                problem(r, "chunk %s: importance summary disagrees with the index", nd->file), ok = false;
            free(imp);
        }
        kvc_free(f);
        r->chunks_ok += ok;
    }
    kv_status st = remove_orphans(s, &r->orphans, true);
    return st ? st : remove_index_temps(s, &r->temp_files, true);
}

void kv_check_report_free(kv_check_report *r)
{
    list_free(r->problems, r->n_problems);
    r->problems = NULL;
    r->n_problems = 0;
}
