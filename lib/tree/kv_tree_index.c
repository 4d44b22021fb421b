/*
 * kv_tree_index: the store's index.json, read and written (validated field
 * by field: a damaged index is KV_E_DATA naming the field, never a crash;
 * fuzzed by tests/fuzz/fuzz_tree.c).
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

int tree_cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

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
    if (tree_find_child(t, (int)par, tok[0]) >= 0) {
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
    /* Index version 2: the chunk's version and encoding.  A version-1
     * index has neither: its chunks are whole .kvc files, raw, compressed
     * on the disk tier. */
    double cv = 1;
    const cJSON *cvj = cJSON_GetObjectItemCaseSensitive(o, "chunk");
    if (cvj && !get_int(o, "chunk", 1, 1e9, &cv))
        return kv_fail(KV_E_DATA, "index: node %d: chunk must be a chunk version", idx);
    if (cv > KV_TREE_CHUNK_VERSION)
        return kv_fail(KV_E_DATA, "index: node %d: chunk version %.0f; this kv-tree reads version %d or older", idx, cv,
                       KV_TREE_CHUNK_VERSION);
    nd->chunk_version = (int)cv;
    const char *enc = get_str(o, "encoding");
    if (nd->chunk_version == 1) {
        nd->enc = (kv_tree_enc){KV_TREE_ENC_RAW, 0, nd->tier == KV_TIER_DISK, false};
        if (enc && strcmp(enc, nd->tier == KV_TIER_DISK ? "raw+zstd" : "raw"))
            return kv_fail(KV_E_DATA, "index: node %d: a version-1 chunk is raw, compressed only on disk", idx);
    } else if (!enc || kv_tree_enc_parse(enc, &nd->enc)) {
        kv_errclear();
        return kv_fail(KV_E_DATA, "index: node %d: a version-2 chunk needs a known encoding", idx);
    }
    if (nd->chunk_version >= 2 && nd->enc.sketch != (nd->chunk_version == 3))
        return kv_fail(KV_E_DATA, "index: node %d: chunk version 3 is the one with a key sketch (+sketch)", idx);
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
    /* version 2: the tiers' encodings and the rows per frame */
    const cJSON *encs = cJSON_GetObjectItemCaseSensitive(j, "encodings");
    if (encs) {
        if (!cJSON_IsObject(encs)) return kv_fail(KV_E_DATA, "index: encodings must be an object");
        for (int tr = 0; tr < KV_TIER_COUNT; tr++) {
            const char *e = get_str(encs, kv_tier_name((kv_tier)tr));
            if (!e || kv_tree_enc_parse(e, &t->enc[tr])) {
                kv_errclear();
                return kv_fail(KV_E_DATA, "index: encodings.%s must be a known encoding", kv_tier_name((kv_tier)tr));
            }
        }
    }
    if (cJSON_GetObjectItemCaseSensitive(j, "group_rows")) {
        if (!get_int(j, "group_rows", 8, 4096, &v) || (int)v % 8)
            return kv_fail(KV_E_DATA, "index: group_rows must be a multiple of 8 in [8, 4096]");
        t->group_rows = (int)v;
    }
    if (cJSON_GetObjectItemCaseSensitive(j, "sketch_channels")) {
        if (!get_int(j, "sketch_channels", 0, KV_TREE_SKETCH_MAX, &v))
            return kv_fail(KV_E_DATA, "index: sketch_channels must be an integer in [0, %d]", KV_TREE_SKETCH_MAX);
        t->sketch_channels = (int)v;
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
        qsort(names, (size_t)(t->n_nodes - 1), sizeof *names, tree_cmp_str);
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
    tree_json_u64(j, "generation", t->generation);
    if (t->has_geom) cJSON_AddItemToObject(j, "geometry", geom_json(&t->geom));
    else cJSON_AddNullToObject(j, "geometry");
    if (t->has_budgets) {
        cJSON *b = cJSON_AddObjectToObject(j, "budgets");
        tree_json_u64(b, "gpu", t->gpu_budget);
        tree_json_u64(b, "host", t->host_budget);
    } else
        cJSON_AddNullToObject(j, "budgets");
    cJSON *encs = cJSON_AddObjectToObject(j, "encodings");
    for (int tr = 0; tr < KV_TIER_COUNT; tr++) {
        char e[24];
        kv_tree_enc_format(&t->enc[tr], e, sizeof e);
        cJSON_AddStringToObject(encs, kv_tier_name((kv_tier)tr), e);
    }
    cJSON_AddNumberToObject(j, "group_rows", t->group_rows);
    if (t->sketch_channels) cJSON_AddNumberToObject(j, "sketch_channels", t->sketch_channels);
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
        tree_node_json(o, nd);
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

