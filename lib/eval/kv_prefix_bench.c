/*
 * kv_prefix_bench (see kv_prefix_bench.h): the request list, the in-process
 * tiers of prefix chunks and the serving loop.
 */
#include "eval/kv_prefix_bench.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <cjson/cJSON.h>

#include "common/kv_stats.h"
#include "eval/kv_jsonl.h"
#include "eval/kv_qaware.h"
#include "format/kvc.h"
#include "gpu/kv_gpu.h"
#include "gpu/kv_gpu_engine.h"
#include "model/kv_prompt.h"
#include "model/kv_sampler.h"
#include "policy/kv_prefix.h"
#include "tree/kv_tree.h"

// --- requests -----------------------------------------------------------------------

void kv_preq_free(kv_preq *r, int n)
{
    for (int i = 0; r && i < n; i++) {
        free(r[i].id);
        free(r[i].input);
        free(r[i].tok);
        kv_strings_free(r[i].outputs, r[i].n_out);
    }
    free(r);
}

static kv_status parse_line(const cJSON *j, int line, kv_preq *q)
{
    if (!cJSON_IsObject(j)) return kv_fail(KV_E_DATA, "line %d: not a JSON object", line);
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(j, "id");
    if (!id) id = cJSON_GetObjectItemCaseSensitive(j, "index");
    char buf[32];
    if (cJSON_IsString(id)) q->id = kv_strdup(id->valuestring);
    else if (cJSON_IsNumber(id)) snprintf(buf, sizeof buf, "%.17g", id->valuedouble), q->id = kv_strdup(buf);
    else snprintf(buf, sizeof buf, "%d", line), q->id = kv_strdup(buf);
    if (!q->id) return kv_fail(KV_E_NOMEM, "out of memory");
    const cJSON *in = cJSON_GetObjectItemCaseSensitive(j, "input");
    const cJSON *tk = cJSON_GetObjectItemCaseSensitive(j, "tokens");
    if (!!in == !!tk) return kv_fail(KV_E_DATA, "line %d: give exactly one of \"input\" (text) and \"tokens\" (ids)", line);
    if (in) {
        if (!cJSON_IsString(in)) return kv_fail(KV_E_DATA, "line %d: \"input\" must be a string", line);
        if (!(q->input = kv_strdup(in->valuestring))) return kv_fail(KV_E_NOMEM, "out of memory");
    } else {
        int n = cJSON_IsArray(tk) ? cJSON_GetArraySize(tk) : -1;
        if (n < 1 || n > (1 << 24)) return kv_fail(KV_E_DATA, "line %d: \"tokens\" must be a non-empty array of ids", line);
        if (!(q->tok = malloc((size_t)n * sizeof *q->tok))) return kv_fail(KV_E_NOMEM, "out of memory");
        int i = 0;
        for (const cJSON *x = tk->child; x; x = x->next, i++) {
            long long v;
            if (!kv_json_int(x, 0, (1 << 30), &v)) return kv_fail(KV_E_DATA, "line %d: tokens[%d] is not an id", line, i);
            q->tok[i] = (int)v;
        }
        q->n = n;
    }
    const cJSON *out = cJSON_GetObjectItemCaseSensitive(j, "outputs");
    if (out) return kv_json_strings(out, "outputs", &q->outputs, &q->n_out);
    return KV_OK;
}

kv_status kv_preq_parse(const char *text, size_t len, kv_preq **out, int *n)
{
    *out = NULL;
    *n = 0;
    kv_jsonl it;
    kv_jsonl_init(&it, text, len);
    const char *s;
    size_t sl;
    bool partial;
    kv_preq *r = NULL;
    int cnt = 0, cap = 0;
    kv_status st = KV_OK;
    while (!st && kv_jsonl_next(&it, &s, &sl, &partial)) {
        if (cnt == cap) {
            cap = cap ? 2 * cap : 16;
            kv_preq *nr = realloc(r, (size_t)cap * sizeof *nr);
            if (!nr) {
                st = kv_fail(KV_E_NOMEM, "out of memory");
                break;
            }
            r = nr;
        }
        memset(&r[cnt], 0, sizeof r[cnt]);
        cJSON *j = cJSON_ParseWithLength(s, sl);
        if (!j) st = kv_fail(KV_E_DATA, "line %d: not valid JSON", it.line);
        else st = parse_line(j, it.line, &r[cnt]);
        cJSON_Delete(j);
        cnt++;
    }
    if (!st && !cnt) st = kv_fail(KV_E_DATA, "no requests");
    if (st) {
        kv_preq_free(r, cnt);
        return st;
    }
    *out = r;
    *n = cnt;
    return KV_OK;
}

static const char *mode_names[KV_PM_COUNT] = {"full", "gpu", "host", "disk", "disk-important", "disk-query"};
const char *kv_pmode_name(kv_pmode m) { return m < KV_PM_COUNT ? mode_names[m] : "?"; }

kv_status kv_pmode_parse(const char *s, unsigned *bits)
{
    *bits = 0;
    if (!strcmp(s, "all")) {
        *bits = (1u << KV_PM_COUNT) - 1;
        return KV_OK;
    }
    while (*s) {
        size_t n = strcspn(s, ",");
        int m = -1;
        for (int i = 0; i < KV_PM_COUNT; i++)
            if (strlen(mode_names[i]) == n && !strncmp(s, mode_names[i], n)) m = i;
        if (m < 0) return kv_fail(KV_E_USAGE, "unknown mode '%.*s' (full, gpu, host, disk, disk-important, disk-query, all)", (int)n, s);
        *bits |= 1u << m;
        s += n + (s[n] == ',');
    }
    return *bits ? KV_OK : kv_fail(KV_E_USAGE, "no mode given");
}

// --- the in-process tiers -------------------------------------------------------------

/* One store node's rows held in memory (its chunk file names it: a split
 * writes new chunks, so an entry of a replaced node is dropped). */
typedef struct {
    char file[KV_TREE_FILE_MAX];
    int n;                 /* rows */
    kv_tier tier;          /* KV_TIER_GPU or KV_TIER_HOST while held */
    uint16_t **hk, **hv;   /* (L) (nkv, n, hd) fp16 host */
    void **dk, **dv;       /* (L) device copies on the GPU tier (GPU engine), else NULL */
    uint64_t bytes;        /* K and V bytes of one copy */
} pentry;

typedef struct {
    pentry *e;
    int n, cap;
    int L, nkv, hd;
    bool gpu;              /* the runner is the GPU engine: the GPU tier is device memory */
    void *arena;           /* pinned host memory that disk loads land in (GPU engine), reused */
    size_t arena_cap;
    bool arena_used;
    char *sk_arena;        /* pinned host memory for disk-query's key sketch codes (GPU engine) */
    size_t sk_cap, sk_off; /* its size; the next free byte (0 when no block is live) */
    int sk_live;           /* blocks handed out and not yet freed */
} pcache;

/* The disk loads' allocator on the GPU engine: the pinned arena when it is
 * free and large enough (the copy to the device then runs at full PCIe
 * speed, as from the host tier), else malloc. */
static void *arena_alloc(void *user, size_t n)
{
    pcache *c = user;
    if (!c->arena_used && c->arena && n <= c->arena_cap) {
        c->arena_used = true;
        return c->arena;
    }
    return malloc(n);
}

static void arena_free(void *user, void *p)
{
    pcache *c = user;
    if (p && p == c->arena) c->arena_used = false;
    else free(p);
}

/* The key sketch's allocator on the GPU engine: blocks one after another in
 * the pinned sketch arena while they fit (one per matched node; the
 * scoring's upload then runs at full PCIe speed), else malloc; the arena
 * is reused once every block of it is freed. */
static void *sk_arena_alloc(void *user, size_t n)
{
    pcache *c = user;
    const size_t a = (n + 63) & ~(size_t)63;
    if (c->sk_arena && a <= c->sk_cap - c->sk_off) {
        void *p = c->sk_arena + c->sk_off;
        c->sk_off += a, c->sk_live++;
        return p;
    }
    return malloc(n);
}

static void sk_arena_free(void *user, void *p)
{
    pcache *c = user;
    if (p && c->sk_arena && (char *)p >= c->sk_arena && (char *)p < c->sk_arena + c->sk_cap) {
        if (--c->sk_live == 0) c->sk_off = 0;
    } else
        free(p);
}

/* Room for n tokens' K/V in the arena, and for the key sketch of n tokens
 * at up to head_dim channels (outside the timed loads: pinning gigabytes
 * takes longer than reading them). */
static kv_status arena_reserve(pcache *c, int n)
{
    size_t need = 2ull * c->L * c->nkv * (size_t)n * c->hd * 2 + 1;
    size_t sk_need = (size_t)c->L * c->nkv * (size_t)n * c->hd + 64 * 64;
    if (!c->gpu) return KV_OK;
    if (need > c->arena_cap) {
        kv_gpu_host_free(c->arena);
        c->arena_cap = 0;
        if (!(c->arena = kv_gpu_host_alloc(need))) return kv_fail(KV_E_NOMEM, "out of host memory for the load arena");
        c->arena_cap = need;
    }
    if (sk_need > c->sk_cap && !c->sk_live) {
        kv_gpu_host_free(c->sk_arena);
        c->sk_cap = c->sk_off = 0;
        if (!(c->sk_arena = kv_gpu_host_alloc(sk_need)))
            return kv_fail(KV_E_NOMEM, "out of host memory for the key sketch arena");
        c->sk_cap = sk_need;
    }
    return KV_OK;
}

static void entry_drop_dev(pcache *c, pentry *x)
{
    for (int l = 0; x->dk && l < c->L; l++) kv_gpu_buffer_free(x->dk[l]), kv_gpu_buffer_free(x->dv[l]);
    free(x->dk), free(x->dv);
    x->dk = x->dv = NULL;
}

static void entry_free(pcache *c, pentry *x)
{
    entry_drop_dev(c, x);
    for (int l = 0; x->hk && l < c->L; l++) {
        if (c->gpu) kv_gpu_host_free(x->hk[l]), kv_gpu_host_free(x->hv[l]);
        else free(x->hk[l]), free(x->hv[l]);
    }
    free(x->hk), free(x->hv);
    memset(x, 0, sizeof *x);
}

static int entry_find(const pcache *c, const char *file)
{
    for (int i = 0; i < c->n; i++)
        if (!strcmp(c->e[i].file, file)) return i;
    return -1;
}

/* Hold the nodes on the path of a prompt just put (rows from its dump f). */
static kv_status cache_add_path(pcache *c, const kv_tree *t, const int *tok, int n, const kvc_file *f)
{
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    int *path = malloc((size_t)n * sizeof *path), np, used;
    if (!ids || !path) {
        free(ids), free(path);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    for (int i = 0; i < n; i++) ids[i] = tok[i];
    kv_tree_match(t, ids, n, path, &np, &used);
    kv_status st = KV_OK;
    for (int j = 0; j < np && !st; j++) {
        const kv_tree_node *nd = &t->nodes[path[j]];
        if (entry_find(c, nd->file) >= 0 || nd->start + nd->n > n) continue;
        if (c->n == c->cap) {
            int cap = c->cap ? 2 * c->cap : 16;
            pentry *ne = realloc(c->e, (size_t)cap * sizeof *ne);
            if (!ne) {
                st = kv_fail(KV_E_NOMEM, "out of memory");
                break;
            }
            c->e = ne, c->cap = cap;
        }
        pentry *x = &c->e[c->n];
        memset(x, 0, sizeof *x);
        snprintf(x->file, sizeof x->file, "%s", nd->file);
        x->n = nd->n;
        x->tier = KV_TIER_HOST;
        x->bytes = 2ull * c->L * c->nkv * (uint64_t)nd->n * c->hd * 2;
        x->hk = calloc((size_t)c->L, sizeof *x->hk), x->hv = calloc((size_t)c->L, sizeof *x->hv);
        if (!x->hk || !x->hv) st = kv_fail(KV_E_NOMEM, "out of memory");
        c->n++;
        const int T = kvc_geom(f)->n_tokens;
        for (int l = 0; l < c->L && !st; l++) {
            for (int w = 0; w < 2 && !st; w++) {
                char name[64];
                snprintf(name, sizeof name, "layers.%d.%c", l, w ? 'v' : 'k');
                const kvc_tensor *ten = kvc_find(f, name);
                /* pinned on the GPU engine: the host tier copies at full PCIe speed */
                uint16_t *dst = c->gpu ? kv_gpu_host_alloc((size_t)c->nkv * nd->n * c->hd * 2 + 2)
                                       : malloc((size_t)c->nkv * nd->n * c->hd * 2 + 2);
                if (!dst || !ten || ten->dtype != KV_DT_F16) {
                    if (c->gpu) kv_gpu_host_free(dst);
                    else free(dst);
                    st = dst ? kv_fail(KV_E_INTERNAL, "the insert dump is not f16") : kv_fail(KV_E_NOMEM, "out of memory");
                    break;
                }
                for (int h = 0; h < c->nkv; h++)
                    memcpy(dst + (size_t)h * nd->n * c->hd,
                           (const uint16_t *)ten->data + ((size_t)h * T + nd->start) * c->hd, (size_t)nd->n * c->hd * 2);
                (w ? x->hv : x->hk)[l] = dst;
            }
        }
    }
    free(ids), free(path);
    return st;
}

static int node_of(const kv_tree *t, const char *file)
{
    for (int i = 1; i < t->n_nodes; i++)
        if (t->nodes[i].live && !strcmp(t->nodes[i].file, file)) return i;
    return -1;
}

typedef struct {
    int ent, node;
    double score;
} pscore;

static int cmp_score(const void *a, const void *b)
{
    const pscore *x = a, *y = b;
    return x->score > y->score ? -1 : x->score < y->score ? 1 : x->ent - y->ent;
}

/* Entries of replaced nodes go; the rest are placed greedily by score
 * (kv_tree_score), the GPU tier first, each node only below a parent that
 * is the root or on a tier at least as fast; what does not fit is dropped. */
static kv_status cache_place(pcache *c, const kv_tree *t, const kv_pbench_opts *o, int64_t now)
{
    for (int i = 0; i < c->n;) {
        if (node_of(t, c->e[i].file) < 0) {
            entry_free(c, &c->e[i]);
            c->e[i] = c->e[--c->n];
        } else i++;
    }
    pscore *ps = malloc((size_t)(c->n ? c->n : 1) * sizeof *ps);
    kv_tier *tier_of = malloc((size_t)t->n_nodes * sizeof *tier_of);
    if (!ps || !tier_of) {
        free(ps), free(tier_of);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    for (int i = 0; i < t->n_nodes; i++) tier_of[i] = KV_TIER_DISK;
    for (int i = 0; i < c->n; i++) {
        ps[i].ent = i, ps[i].node = node_of(t, c->e[i].file);
        ps[i].score = kv_tree_score(&t->nodes[ps[i].node], now, o->half_life);
    }
    qsort(ps, (size_t)c->n, sizeof *ps, cmp_score);
    uint64_t used[2] = {0, 0}, budget[2] = {o->gpu_bytes, o->host_bytes};
    for (int tier = 0; tier < 2; tier++)
        for (bool more = true; more;) { /* passes until nothing more fits (parents first) */
            more = false;
            for (int i = 0; i < c->n; i++) {
                int nd = ps[i].node, par = t->nodes[nd].parent;
                if (tier_of[nd] != KV_TIER_DISK) continue;
                bool parent_ok = par <= 0 || (int)tier_of[par] <= tier;
                if (!parent_ok || used[tier] + c->e[ps[i].ent].bytes > budget[tier]) continue;
                tier_of[nd] = (kv_tier)tier;
                used[tier] += c->e[ps[i].ent].bytes;
                more = true;
            }
        }
    kv_status st = KV_OK;
    for (int i = 0; i < c->n && !st; i++) {
        pentry *x = &c->e[ps[i].ent];
        kv_tier nt = tier_of[ps[i].node];
        if (nt == KV_TIER_GPU && c->gpu && !x->dk) { /* onto the device */
            x->dk = calloc((size_t)c->L, sizeof *x->dk), x->dv = calloc((size_t)c->L, sizeof *x->dv);
            if (!x->dk || !x->dv) st = kv_fail(KV_E_NOMEM, "out of memory");
            size_t b = (size_t)c->nkv * x->n * c->hd * 2;
            for (int l = 0; l < c->L && !st; l++)
                if (!(st = kv_gpu_buffer_upload(x->hk[l], b, &x->dk[l]))) st = kv_gpu_buffer_upload(x->hv[l], b, &x->dv[l]);
        } else if (nt != KV_TIER_GPU && x->dk) {
            entry_drop_dev(c, x);
        }
        x->tier = nt;
    }
    /* dropped from memory: the store on disk still has them */
    for (int i = 0; i < c->n;) {
        if (c->e[i].tier == KV_TIER_DISK) {
            entry_free(c, &c->e[i]);
            c->e[i] = c->e[--c->n];
        } else i++;
    }
    free(ps), free(tier_of);
    return st;
}

static void cache_clear(pcache *c)
{
    for (int i = 0; i < c->n; i++) entry_free(c, &c->e[i]);
    free(c->e);
    kv_gpu_host_free(c->arena);
    kv_gpu_host_free(c->sk_arena);
}

// --- serving ---------------------------------------------------------------------------

typedef struct {
    kv_prefix pre;
    kv_prefix_seg *seg;
    kv_tree_rows rows;      /* a disk load */
    kv_tree_pending *pend;  /* its rows still arriving (kv_tree_store_load_start), or NULL */
} psource;

/* The disk load's end (its rows' bytes into hit[2]); KV_OK without one. */
static kv_status source_finish(psource *s, uint64_t *hit, double *ms)
{
    if (!s->pend) return KV_OK;
    kv_get_report gr;
    memset(&gr, 0, sizeof gr);
    kv_status st = kv_tree_load_finish(s->pend, &gr, &ms[0], &ms[1]);
    s->pend = NULL;
    for (int i = 0; hit && i < KV_TIER_COUNT; i++) hit[2] += gr.bytes_read[i];
    return st;
}

static void source_clear(psource *s)
{
    if (s->pend) { /* an error before the prefill ended it: the read must end before its rows go */
        double ms[2];
        (void)source_finish(s, NULL, ms);
        kv_errclear();
    }
    free(s->seg);
    kv_tree_rows_free(&s->rows);
    memset(s, 0, sizeof *s);
}

/* The prefix of tok[0..n-1) for mode m: from the memory tiers (all nodes of
 * the path held; the GPU mode takes the GPU copies where they exist) or
 * from the store.  *tier: what was used; hit: bytes per tier. */
static kv_status source_get(kv_pmode m, kv_runner *r, pcache *c, kv_tree_store *s, const int *tok, int n,
                            const kv_pbench_opts *o, int64_t now, psource *src, const char **tier, uint64_t *hit,
                            double *qa_ms, double *probe_ms, double *probe_pf)
{
    const kv_tree *t = kv_tree_store_tree(s);
    *tier = "none";
    if (!t->has_geom || n < 2) return KV_OK;
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    int *path = malloc((size_t)n * sizeof *path), np = 0, used = 0;
    if (!ids || !path) {
        free(ids), free(path);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    for (int i = 0; i < n; i++) ids[i] = tok[i];
    int matched = kv_tree_match(t, ids, n - 1, path, &np, &used);
    kv_status st = KV_OK;
    bool mem = matched > 0 && (m == KV_PM_GPU || m == KV_PM_HOST);
    if (mem) { /* the leading nodes held in memory; the rest of the match is prefilled */
        int held = 0;
        while (held < np && entry_find(c, t->nodes[path[held]].file) >= 0) held++;
        if (held < np) {
            matched = held ? t->nodes[path[held - 1]].start + t->nodes[path[held - 1]].n : 0;
            used = held ? t->nodes[path[held - 1]].n : 0;
            np = held;
        }
        mem = held > 0;
    }
    if (mem) {
        bool dev = m == KV_PM_GPU && c->gpu;
        for (int j = 0; dev && j < np; j++) dev = c->e[entry_find(c, t->nodes[path[j]].file)].dk != NULL;
        if (!(src->seg = calloc((size_t)np, sizeof *src->seg))) st = kv_fail(KV_E_NOMEM, "out of memory");
        bool all_gpu = true;
        for (int j = 0; !st && j < np; j++) {
            const pentry *x = &c->e[entry_find(c, t->nodes[path[j]].file)];
            int rows = j == np - 1 ? used : x->n;
            src->seg[j] = (kv_prefix_seg){rows, x->n, dev ? (const void *const *)x->dk : (const void *const *)x->hk,
                                          dev ? (const void *const *)x->dv : (const void *const *)x->hv};
            all_gpu &= x->tier == KV_TIER_GPU;
            hit[x->tier == KV_TIER_GPU && m == KV_PM_GPU ? 0 : 1] += x->bytes / (uint64_t)x->n * (uint64_t)rows;
        }
        src->pre = (kv_prefix){.T = matched, .matched = matched, .n_kv_heads = c->nkv, .head_dim = c->hd,
                               .dt = KV_DT_F16, .device = dev, .seg = src->seg, .nseg = np};
        *tier = m == KV_PM_GPU && all_gpu ? "gpu" : "host";
    } else if (matched > 0 && m != KV_PM_FULL) { /* from the store, straight into memory rows */
        kv_get_report gr;
        memset(&gr, 0, sizeof gr);
        kv_tree_rows *x = &src->rows;
        /* the rows read layer by layer beside the prefill, on the cores but one
         * (the one that drives the engine) */
        const int threads = kv_tree_load_threads();
        kv_tree_pending **pend = o->rows_serial ? NULL : &src->pend;
        const kv_tree_alloc al = {arena_alloc, arena_free, c}, skal = {sk_arena_alloc, sk_arena_free, c};
        if (m == KV_PM_DISK_QUERY) {
            kv_qaware_opts qo = {o->important, KV_QAWARE_PROBE, o->queries ? o->queries : KV_QAWARE_QUERIES, 0, false, now,
                                 c->gpu ? &al : NULL, o->sketch_serial, o->qa_heads, o->qa_follow,
                                 c->gpu ? &skal : NULL};
            kv_qaware_report qr;
            st = kv_qaware_load_start(r, s, tok, n, &qo, threads, x, &qr, pend);
            qa_ms[0] = qr.sketch_ms, qa_ms[1] = qr.probe_ms, qa_ms[2] = qr.score_ms, qa_ms[3] = qr.load_ms;
            qa_ms[4] = qr.score_upload_ms;
            probe_ms[0] = qr.probe_sink_ms, probe_ms[1] = qr.probe_prefill_ms, probe_ms[2] = qr.probe_reset_ms;
            probe_ms[3] = qr.sketch_wait_ms, probe_ms[4] = qr.sketch_spawn_ms, probe_ms[5] = qr.sketch_stage_ms;
            memcpy(probe_pf, qr.probe_pf, sizeof qr.probe_pf);
            gr.bytes_read[KV_TIER_DISK] = qr.sketch_bytes + qr.row_bytes;
        } else if (pend)
            st = kv_tree_store_load_start(s, ids, n - 1, m == KV_PM_DISK_IMP ? o->important : 1.0, NULL, 0, false, now,
                                          c->gpu ? &al : NULL, threads, x, pend);
        else
            st = kv_tree_store_load_ex(s, ids, n - 1, m == KV_PM_DISK_IMP ? o->important : 1.0, NULL, 0, false, now,
                                       c->gpu ? &al : NULL, x, &gr);
        if (!st)
            src->pre = (kv_prefix){.T = x->T, .matched = x->matched, .n_kv_heads = x->n_kv_heads,
                                   .head_dim = x->head_dim, .positions = x->T < x->matched ? x->positions : NULL,
                                   .tokens = x->tokens, .dt = x->dt, .k = (const void *const *)x->k,
                                   .v = (const void *const *)x->v, .wait = src->pend ? kv_tree_pending_wait : NULL,
                                   .wait_user = src->pend};
        for (int i = 0; i < 3; i++) hit[2] += gr.bytes_read[i];
        *tier = "disk";
    }
    free(ids), free(path);
    return st;
}

static int greedy(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

kv_status kv_pbench_run(kv_runner *r, const kv_tokenizer *tok, const kv_preq *reqs, int n,
                        const kv_pbench_opts *o, kv_pbench_row **rows, int *nrows)
{
    *rows = NULL;
    *nrows = 0;
    const kv_model *m = kv_runner_model(r);
    const kv_model_config *mc = &m->cfg;
    int nm = 0;
    for (int i = 0; i < KV_PM_COUNT; i++) nm += (o->modes >> i) & 1;
    kv_pbench_row *out = calloc((size_t)n * nm + 1, sizeof *out);
    float *logits = malloc((size_t)mc->vocab_size * sizeof *logits);
    pcache c = {.L = mc->n_layers, .nkv = mc->n_kv_heads, .hd = mc->head_dim, .gpu = kv_runner_is_gpu(r)};
    kv_tree_store *s = NULL;
    kv_status st = out && logits ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory");
    struct stat sb;
    if (!st && stat(o->store, &sb) != 0) {
        kv_tree_enc enc[KV_TIER_COUNT];
        kv_tree_encodings_default(enc);
        enc[KV_TIER_DISK].zstd = o->zstd_level > 0; /* --zstd 0: disk chunks as they are */
        enc[KV_TIER_DISK].sketch = (o->modes >> KV_PM_DISK_QUERY) & 1; /* what disk-query scores with */
        st = kv_tree_store_create_ex(o->store, enc);
    }
    if (!st) st = kv_tree_store_open(o->store, true, &s);
    if (!st && o->sketch_channels) st = kv_tree_store_set_sketch_channels(s, o->sketch_channels);
    if (!st && kv_tree_store_tree(s)->has_geom) st = kv_prefix_check_model(m, &kv_tree_store_tree(s)->geom.g);
    int k = 0;
    for (int i = 0; i < n && !st; i++) {
        const kv_preq *q = &reqs[i];
        int *ids = NULL, len = 0;
        if (q->tok) {
            if (!(ids = malloc((size_t)q->n * sizeof *ids))) st = kv_fail(KV_E_NOMEM, "out of memory");
            else memcpy(ids, q->tok, (size_t)q->n * sizeof *ids), len = q->n;
            for (int j = 0; !st && j < len; j++)
                if (ids[j] >= mc->vocab_size) st = kv_fail(KV_E_DATA, "request %s: token %d outside the vocabulary", q->id, ids[j]);
        } else {
            kv_prompt p = {.text = q->input, .text_len = strlen(q->input)};
            st = kv_prompt_tokens(&p, tok, mc->vocab_size, &ids, &len);
        }
        if (!st && len + o->max_new > kv_runner_ctx(r))
            st = kv_fail(KV_E_USAGE, "request %s: %d tokens and %d new exceed the context of %d", q->id, len, o->max_new, kv_runner_ctx(r));
        const int64_t now = o->now + i;
        const bool insert = !o->insert_max || i < o->insert_max;
        /* reuse modes first, then full, whose capture is put into the store;
         * a reuse mode with nothing cached would only repeat the full
         * prefill, so it is left out for that request */
        static const kv_pmode order[KV_PM_COUNT] = {KV_PM_GPU, KV_PM_HOST, KV_PM_DISK, KV_PM_DISK_IMP, KV_PM_DISK_QUERY,
                                                    KV_PM_FULL};
        for (int mi = 0; mi < KV_PM_COUNT && !st; mi++) {
            kv_pmode mode = order[mi];
            bool is_full = mode == KV_PM_FULL, want = (o->modes >> mode) & 1;
            if (!want && !(is_full && insert)) continue;
            psource src;
            memset(&src, 0, sizeof src);
            uint64_t hit[3] = {0, 0, 0};
            const char *tier = "none";
            if ((st = kv_runner_reset(r, NULL))) break;
            if ((st = kv_runner_keep(r, is_full && insert ? o->put_queries : 0, is_full && insert))) break;
            double t0 = kv_now_ms();
            double qa_ms[5] = {0, 0, 0, 0, 0}, probe_ms[6] = {0, 0, 0, 0, 0, 0}, probe_pf[5] = {0, 0, 0, 0, 0}, pf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            bool rows_ahead = false;
            double rows_ms[2] = {0, 0};
            st = source_get(mode, r, &c, s, ids, len, o, now, &src, &tier, hit, qa_ms, probe_ms, probe_pf);
            double t1 = kv_now_ms();
            int reused = src.pre.T, start = src.pre.matched;
            if (!st && !is_full && !reused) { /* nothing to reuse */
                source_clear(&src);
                continue;
            }
            if (!st) st = reused ? kv_runner_prefill_from(r, &src.pre, ids + start, len - start, logits)
                                 : kv_runner_prefill(r, ids, len, logits);
            const bool beside = src.pend != NULL;
            kv_status fst = source_finish(&src, hit, rows_ms); /* the read's own error first */
            if (fst) st = fst;
            double ttft = kv_now_ms() - t0;
            if (!st && kv_runner_gpu(r)) {
                kv_gpu_prefill_phases ph;
                kv_gpu_engine_prefill_phases(kv_runner_gpu(r), &ph);
                pf[0] = ph.setup, pf[1] = ph.rows, pf[2] = ph.compute, pf[3] = ph.logits, pf[4] = ph.total, pf[5] = ph.capture, pf[6] = ph.upload,
                pf[7] = ph.upload_bytes;
                rows_ahead = ph.rows_ahead;
            }
            source_clear(&src);
            if (st) {
                kv_errcontext("request %s, mode %s", q->id, kv_pmode_name(mode));
                break;
            }
            int *gen = malloc((size_t)(o->max_new + 1) * sizeof *gen), ng = 0;
            if (!gen) st = kv_fail(KV_E_NOMEM, "out of memory");
            for (int g = 0; !st && g < o->max_new; g++) {
                gen[ng++] = greedy(logits, mc->vocab_size);
                if (g + 1 < o->max_new) st = kv_runner_step(r, gen[ng - 1], logits);
            }
            char *text = NULL;
            if (!st && tok) st = kv_tokens_text(tok, ids[len - 1], gen, ng, &text);
            if (!st && !tok && (text = malloc((size_t)ng * 12 + 1))) {
                text[0] = 0;
                for (int g = 0; g < ng; g++) sprintf(text + strlen(text), "%s%d", g ? " " : "", gen[g]);
            }
            free(gen);
            if (st) break;
            if (want) {
                kv_pbench_row *row = &out[k++];
                *row = (kv_pbench_row){i, mode, tier, len, reused, len - start, ttft, t1 - t0,
                                       {qa_ms[0], qa_ms[1], qa_ms[2], qa_ms[3], qa_ms[4]}, {probe_ms[0], probe_ms[1], probe_ms[2], probe_ms[3], probe_ms[4], probe_ms[5]},
                                       {pf[0], pf[1], pf[2], pf[3], pf[4], pf[5], pf[6], pf[7]},
                                       {probe_pf[0], probe_pf[1], probe_pf[2], probe_pf[3], probe_pf[4]},
                                       rows_ahead, {hit[0], hit[1], hit[2]}, beside, {rows_ms[0], rows_ms[1]}, -1, text};
                if (q->n_out) {
                    row->correct = 1;
                    for (int a = 0; a < q->n_out; a++)
                        if (!text || !strstr(text, q->outputs[a])) row->correct = 0;
                }
            } else {
                free(text);
            }
            if (is_full && insert) { /* the prompt into the store, its path into memory */
                char path[4200];
                snprintf(path, sizeof path, "%s/insert.kvc", o->tmp_dir);
                kvc_file *f = NULL;
                kv_put_report pr;
                st = kv_runner_dump_kvc(r, ids, len, KV_DT_F16, path, 0);
                if (!st) st = kvc_open(path, &f);
                unlink(path);
                if (!st) st = kv_tree_store_put(s, f, o->put_tier, o->zstd_level, now, &pr);
                if (!st) st = kv_tree_store_save(s);
                if (!st) st = cache_add_path(&c, kv_tree_store_tree(s), ids, len, f);
                if (!st) st = cache_place(&c, kv_tree_store_tree(s), o, now);
                if (!st) st = arena_reserve(&c, len);
                kvc_close(f);
            }
        }
        free(ids);
        if (o->progress) o->progress(o->user, i + 1, n);
    }
    cache_clear(&c);
    kv_tree_store_close(s);
    free(logits);
    if (st) {
        kv_pbench_rows_free(out, k);
        return st;
    }
    *rows = out;
    *nrows = k;
    return KV_OK;
}

void kv_pbench_rows_free(kv_pbench_row *rows, int n)
{
    for (int i = 0; rows && i < n; i++) free(rows[i].text);
    free(rows);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void add_num_or_null(cJSON *o, const char *name, bool have, double v)
{
    if (have) cJSON_AddNumberToObject(o, name, v);
    else cJSON_AddNullToObject(o, name);
}

char *kv_pbench_json(const kv_pbench_row *rows, int n, const kv_pbench_opts *o)
{
    cJSON *j = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(j, "requests");
    static const char *tn[3] = {"gpu", "host", "disk"};
    for (int i = 0; i < n; i++) {
        const kv_pbench_row *r = &rows[i];
        cJSON *x = cJSON_CreateObject();
        cJSON_AddNumberToObject(x, "request", r->req);
        cJSON_AddStringToObject(x, "mode", kv_pmode_name(r->mode));
        cJSON_AddStringToObject(x, "tier", r->tier);
        cJSON_AddNumberToObject(x, "tokens", r->tokens);
        cJSON_AddNumberToObject(x, "reused_tokens", r->reused);
        cJSON_AddNumberToObject(x, "prefilled_tokens", r->prefilled);
        cJSON_AddNumberToObject(x, "ttft_ms", r->ttft_ms);
        cJSON_AddNumberToObject(x, "load_ms", r->load_ms);
        if (r->mode == KV_PM_DISK_QUERY) {
            cJSON *qa = cJSON_AddObjectToObject(x, "query_aware_ms");
            static const char *qn[5] = {"sketch", "probe", "score", "rows", "score_upload"};
            for (int t = 0; t < 5; t++) cJSON_AddNumberToObject(qa, qn[t], r->qa_ms[t]);
            static const char *pn[6] = {"probe_sink", "probe_prefill", "probe_reset", "sketch_wait", "sketch_spawn",
                                        "sketch_stage"};
            for (int t = 0; t < 6; t++) cJSON_AddNumberToObject(qa, pn[t], r->probe_ms[t]);
        }
        static const char *phn[6] = {"setup", "rows", "compute", "logits", "total", "capture"};
        if (r->pf_ms[4] > 0) { /* the GPU engine's phases of this request's prefill */
            cJSON *ph = cJSON_AddObjectToObject(x, "prefill_phases_ms");
            for (int t = 0; t < 6; t++) cJSON_AddNumberToObject(ph, phn[t], r->pf_ms[t]);
            cJSON_AddBoolToObject(ph, "rows_ahead", r->rows_ahead);
            if (r->rows_ahead) { /* the uploads' span on the GPU clock and their rate */
                cJSON_AddNumberToObject(ph, "upload", r->pf_ms[6]);
                cJSON_AddNumberToObject(ph, "upload_gbs", r->pf_ms[6] > 0 ? r->pf_ms[7] / (r->pf_ms[6] * 1e6) : 0);
            }
        }
        if (r->probe_pf_ms[4] > 0) {
            cJSON *ph = cJSON_AddObjectToObject(x, "probe_prefill_phases_ms");
            for (int t = 0; t < 5; t++) cJSON_AddNumberToObject(ph, phn[t], r->probe_pf_ms[t]);
        }
        if (!strcmp(r->tier, "disk")) {
            cJSON_AddBoolToObject(x, "rows_beside", r->rows_beside);
            if (r->rows_beside) {
                cJSON *rm = cJSON_AddObjectToObject(x, "rows_beside_ms");
                cJSON_AddNumberToObject(rm, "read", r->rows_ms[0]);
                cJSON_AddNumberToObject(rm, "wait", r->rows_ms[1]);
            }
        }
        cJSON *h = cJSON_AddObjectToObject(x, "hit_bytes");
        for (int t = 0; t < 3; t++) cJSON_AddNumberToObject(h, tn[t], (double)r->hit_bytes[t]);
        if (r->correct < 0) cJSON_AddNullToObject(x, "correct");
        else cJSON_AddBoolToObject(x, "correct", r->correct);
        cJSON_AddStringToObject(x, "text", r->text ? r->text : "");
        cJSON_AddItemToArray(arr, x);
    }
    /* per mode over the requests after the first (the first has nothing to reuse) */
    /* what the disk modes ran with (a run's numbers mean little without them) */
    cJSON *op = cJSON_AddObjectToObject(j, "options");
    cJSON_AddNumberToObject(op, "important", o->important);
    cJSON_AddNumberToObject(op, "queries", o->queries ? o->queries : KV_QAWARE_QUERIES);
    cJSON_AddStringToObject(op, "qa_heads", o->qa_heads == KV_QAWARE_SUM ? "sum" : "max");
    cJSON_AddNumberToObject(op, "qa_follow", o->qa_follow < 0 ? 0 : o->qa_follow ? o->qa_follow : KV_QAWARE_FOLLOW);
    cJSON_AddNumberToObject(op, "sketch_channels", o->sketch_channels);
    cJSON_AddBoolToObject(op, "sketch_serial", o->sketch_serial);
    cJSON_AddBoolToObject(op, "rows_serial", o->rows_serial);
    cJSON_AddBoolToObject(op, "warmed", o->warmed);
    cJSON_AddNumberToObject(op, "warm_ms", o->warm_ms);
    cJSON *sum = cJSON_AddObjectToObject(j, "summary");
    double full_med = 0;
    for (int m = 0; m < KV_PM_COUNT; m++) {
        if (!((o->modes >> m) & 1)) continue;
        double *t = malloc(2 * (size_t)(n + 1) * sizeof *t), acc = 0, hb[3] = {0, 0, 0};
        int cnt = 0, nacc = 0, reused = 0;
        for (int i = 0; t && i < n; i++) {
            if (rows[i].mode != (kv_pmode)m || rows[i].req == 0) continue;
            t[n + 1 + cnt] = rows[i].load_ms;
            t[cnt++] = rows[i].ttft_ms;
            reused += rows[i].reused > 0;
            if (rows[i].correct >= 0) acc += rows[i].correct, nacc++;
            for (int k = 0; k < 3; k++) hb[k] += (double)rows[i].hit_bytes[k];
        }
        if (!t) continue;
        qsort(t, (size_t)cnt, sizeof *t, cmp_d);
        double med = cnt ? (cnt % 2 ? t[cnt / 2] : (t[cnt / 2 - 1] + t[cnt / 2]) / 2) : 0;
        qsort(t + n + 1, (size_t)cnt, sizeof *t, cmp_d);
        const double *lt = t + n + 1;
        double lmed = cnt ? (cnt % 2 ? lt[cnt / 2] : (lt[cnt / 2 - 1] + lt[cnt / 2]) / 2) : 0;
        if (m == KV_PM_FULL) full_med = med;
        cJSON *x = cJSON_AddObjectToObject(sum, kv_pmode_name((kv_pmode)m));
        cJSON_AddNumberToObject(x, "requests", cnt);
        cJSON_AddNumberToObject(x, "reused", reused);
        /* a mode that served no request after the first (nothing was
         * cached for it) has no times: null, never a 0 ms median */
        add_num_or_null(x, "ttft_ms_median", cnt > 0, med);
        add_num_or_null(x, "load_ms_median", cnt > 0, lmed);
        add_num_or_null(x, "speedup_vs_full", full_med > 0 && cnt > 0 && med > 0, full_med / med);
        add_num_or_null(x, "accuracy", nacc > 0, nacc ? acc / nacc : 0);
        if (cnt) {
            cJSON *h = cJSON_AddObjectToObject(x, "hit_bytes_mean");
            for (int k = 0; k < 3; k++) cJSON_AddNumberToObject(h, tn[k], hb[k] / cnt);
        } else {
            cJSON_AddNullToObject(x, "hit_bytes_mean");
        }
        free(t);
    }
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    return s;
}
