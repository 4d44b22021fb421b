/*
 * Unit tests of lib/tree: the radix tree against a brute-force
 * longest-common-prefix oracle on thousands of random insert/match cases,
 * node splitting, token importance on a hand-computed case (attention and
 * the key-norm proxy), and the index round trip with its rejections.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <math.h>
#include <pthread.h>

#include "common/kv_half.h"
#include "kt_kv.h"
#include "tree/kv_tree.h"

static unsigned long long seed;

static int rnd(int n) { return (int)(kt_rand(&seed) * n); }

/* Tree invariants: starts chain, edges non-empty, siblings differ in their
 * first token, parent/child links agree. */
static int tree_ok(const kv_tree *t)
{
    for (int i = 1; i < t->n_nodes; i++) {
        const kv_tree_node *nd = &t->nodes[i];
        if (!nd->live) continue;
        const kv_tree_node *p = &t->nodes[nd->parent];
        if (nd->n <= 0 || nd->start != p->start + p->n) return 0;
        int found = 0;
        for (int c = 0; c < p->n_child; c++) found += p->child[c] == i;
        if (found != 1) return 0;
        for (int a = 0; a < nd->n_child; a++)
            for (int b = a + 1; b < nd->n_child; b++)
                if (t->nodes[nd->child[a]].tokens[0] == t->nodes[nd->child[b]].tokens[0]) return 0;
    }
    return 1;
}

static int lcp(const int32_t *a, int na, const int32_t *b, int nb)
{
    int k = 0;
    while (k < na && k < nb && a[k] == b[k]) k++;
    return k;
}

#define MAXSEQ 24
#define MAXINS 12

/* A random sequence, often built on one already inserted so that prefixes
 * are shared and splits happen at every depth. */
static int rand_seq(int32_t *s, int32_t (*prev)[MAXSEQ], const int *plen, int np, int alpha)
{
    int n = rnd(MAXSEQ + 1), k = 0;
    if (np && rnd(3)) {
        int j = rnd(np);
        k = rnd(plen[j] + 1);
        if (k > n) n = k;
        memcpy(s, prev[j], (size_t)k * sizeof *s);
    }
    for (; k < n; k++) s[k] = rnd(alpha);
    return n;
}

static void test_radix_matches_brute_force(void)
{
    int32_t seqs[MAXINS][MAXSEQ], q[MAXSEQ];
    int lens[MAXINS], path[MAXSEQ], cases = 0, bad = 0;
    for (int c = 0; c < 3000; c++) {
        kv_tree *t;
        KT_REQUIRE(kv_tree_new(&t) == KV_OK, "new");
        int alpha = 2 + rnd(4), ni = 1 + rnd(MAXINS), done = 0;
        for (int i = 0; i < ni; i++) {
            int n = rand_seq(seqs[done], seqs, lens, done, alpha);
            int want = 0;
            for (int j = 0; j < done; j++) {
                int l = lcp(seqs[done], n, seqs[j], lens[j]);
                if (l > want) want = l;
            }
            kv_tree_insert_result r;
            if (kv_tree_insert(t, seqs[done], n, &r) != KV_OK || r.matched != want) bad++;
            lens[done++] = n;
            if (!tree_ok(t)) bad++;
            /* Every inserted sequence is now spelled in full. */
            for (int j = 0; j < done; j++) {
                int np, used;
                if (kv_tree_match(t, seqs[j], lens[j], path, &np, &used) != lens[j]) bad++;
            }
            /* Random queries match exactly the longest common prefix. */
            for (int k = 0; k < 4; k++) {
                int nq = rand_seq(q, seqs, lens, done, alpha), np, used, best = 0;
                for (int j = 0; j < done; j++) {
                    int l = lcp(q, nq, seqs[j], lens[j]);
                    if (l > best) best = l;
                }
                int m = kv_tree_match(t, q, nq, path, &np, &used);
                int sum = 0;
                for (int p = 0; p < np; p++) sum += p == np - 1 ? used : t->nodes[path[p]].n;
                if (m != best || sum != m) bad++;
                cases++;
            }
        }
        kv_tree_free(t);
        if (bad) {
            KT_CHECK(0, "case %d (seed %llu): %d mismatches", c, seed, bad);
            return;
        }
    }
    KT_CHECK(cases > 10000, "only %d queries", cases);
}

static void test_split_moves_children_under_a_new_head(void)
{
    kv_tree *t;
    KT_REQUIRE(kv_tree_new(&t) == KV_OK, "new");
    int32_t a[] = {5, 6, 7, 8}, b[] = {5, 6, 9};
    kv_tree_insert_result r;
    KT_REQUIRE(kv_tree_insert(t, a, 4, &r) == KV_OK, "insert a");
    KT_CHECK(r.matched == 0 && r.new_node == 1 && r.split_node == -1, "first insert");
    KT_REQUIRE(kv_tree_insert(t, b, 3, &r) == KV_OK, "insert b");
    KT_CHECK(r.matched == 2 && r.split_node == 1 && r.split_head >= 0 && r.new_node >= 0, "split at 2");
    int head = r.split_head;
    const kv_tree_node *h = &t->nodes[r.split_head], *tail = &t->nodes[1], *nw = &t->nodes[r.new_node];
    KT_CHECK(h->n == 2 && h->start == 0 && h->parent == 0 && h->n_child == 2, "head");
    KT_CHECK(tail->n == 2 && tail->start == 2 && tail->parent == r.split_head && tail->tokens[0] == 7, "tail");
    KT_CHECK(nw->n == 1 && nw->start == 2 && nw->tokens[0] == 9, "new");
    /* A prefix that ends mid-edge neither splits nor adds. */
    int32_t c[] = {5, 6, 7};
    int before = t->n_nodes;
    KT_REQUIRE(kv_tree_insert(t, c, 3, &r) == KV_OK, "insert c");
    KT_CHECK(r.matched == 3 && r.split_node == -1 && r.new_node == -1 && t->n_nodes == before, "no-op");
    kv_tree_remove(t, head);
    int path[4], np, used;
    KT_CHECK(kv_tree_match(t, a, 4, path, &np, &used) == 0, "removed subtree no longer matches");
    KT_CHECK(tree_ok(t), "invariants");
    kv_tree_free(t);
}

/* Write a one-layer .kvc (Hkv 1, D 2) and open it. */
static kvc_file *tiny_kvc(const float *k, int T, const float *q, int Q)
{
    char path[] = "/tmp/test_tree_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return NULL;
    close(fd);
    kvc_writer *w;
    kvc_file *f = NULL;
    if (kvc_writer_new(&w)) return NULL;
    int64_t sk[3] = {1, T, 2}, sq[3] = {1, Q, 2};
    kv_geom g;
    kv_geom_defaults(&g);
    g.n_layers = 1, g.n_heads = 1, g.n_kv_heads = 1, g.head_dim = 2, g.n_tokens = T, g.n_q = Q;
    kvc_writer_geom(w, &g);
    kvc_writer_add(w, "layers.0.k", KV_DT_F32, 3, sk, k);
    kvc_writer_add(w, "layers.0.v", KV_DT_F32, 3, sk, k);
    if (Q) kvc_writer_add(w, "layers.0.q", KV_DT_F32, 3, sq, q);
    if (kvc_writer_write(w, path, 0) == KV_OK) kvc_open(path, &f);
    kvc_writer_free(w);
    unlink(path);
    return f;
}

static void test_importance_is_attention_mass(void)
{
    /* Keys (0,0), (1,0), (0,0); one query (2,0) at the last position sees all
     * three: scores 0, 2/sqrt2, 0; importance = T * softmax. */
    float k[] = {0, 0, 1, 0, 0, 0}, q1[] = {2, 0};
    kvc_file *f = tiny_kvc(k, 3, q1, 1);
    KT_REQUIRE(f, "write/open: %s", kv_errdetail());
    float imp[3];
    bool att = false;
    KT_REQUIRE(kv_tree_importance(f, imp, &att) == KV_OK, "%s", kv_errdetail());
    double e = exp(2 / sqrt(2.0)), z = 2 + e;
    KT_CHECK(att, "attention source");
    KT_NEAR(imp[0], 3 / z, 1e-5);
    KT_NEAR(imp[1], 3 * e / z, 1e-5);
    KT_NEAR(imp[2], 3 / z, 1e-5);
    kvc_close(f);

    /* Two queries are causal: the first (position 1) sees keys 0 and 1 only. */
    float q2[] = {2, 0, 0, 0};
    f = tiny_kvc(k, 3, q2, 2);
    KT_REQUIRE(f, "open 2");
    KT_REQUIRE(kv_tree_importance(f, imp, &att) == KV_OK, "%s", kv_errdetail());
    /* masses: query 1: [1, e]/(1+e); query 2 (score 0 everywhere): 1/3 each. */
    double m0 = 1 / (1 + e) + 1.0 / 3, m1 = e / (1 + e) + 1.0 / 3, m2 = 1.0 / 3, tot = m0 + m1 + m2;
    KT_NEAR(imp[0], 3 * m0 / tot, 1e-5);
    KT_NEAR(imp[1], 3 * m1 / tot, 1e-5);
    KT_NEAR(imp[2], 3 * m2 / tot, 1e-5);
    kvc_close(f);

    /* Without queries: key L2 norms scaled to mean 1. */
    float k2[] = {3, 4, 0, 1, 0, 0};
    f = tiny_kvc(k2, 3, NULL, 0);
    KT_REQUIRE(f, "open 3");
    KT_REQUIRE(kv_tree_importance(f, imp, &att) == KV_OK, "%s", kv_errdetail());
    KT_CHECK(!att, "key-norm source");
    KT_NEAR(imp[0], 2.5, 1e-5);
    KT_NEAR(imp[1], 0.5, 1e-5);
    KT_NEAR(imp[2], 0.0, 1e-6);
    kvc_close(f);
}

static kv_tree *random_tree(int n_ins)
{
    kv_tree *t;
    if (kv_tree_new(&t)) return NULL;
    t->has_geom = true;
    t->geom.g.n_layers = 2, t->geom.g.n_heads = 4, t->geom.g.n_kv_heads = 2, t->geom.g.head_dim = 8;
    t->geom.dtype = KV_DT_F16;
    snprintf(t->geom.g.model, sizeof t->geom.g.model, "m");
    int32_t seqs[MAXINS][MAXSEQ];
    int lens[MAXINS];
    kv_tree_insert_result r;
    for (int i = 0; i < n_ins && i < MAXINS; i++) {
        lens[i] = rand_seq(seqs[i], seqs, lens, i, 4);
        kv_tree_insert(t, seqs[i], lens[i], &r);
    }
    for (int i = 1; i < t->n_nodes; i++) {
        kv_tree_node *nd = &t->nodes[i];
        snprintf(nd->file, sizeof nd->file, "chunks/c%d.kvc", i);
        nd->bytes = (uint64_t)rnd(100000), nd->kv_bytes = (uint64_t)rnd(100000);
        nd->tier = (kv_tier)rnd(3), nd->hits = (uint64_t)rnd(50), nd->last_use = 1700000000 + rnd(1000);
        nd->imp_mean = 0.5f, nd->imp_min = 0.25f, nd->imp_max = 2.0f, nd->imp_attention = rnd(2);
    }
    t->generation = (uint64_t)t->n_nodes;
    return t;
}

static void test_index_round_trip(void)
{
    for (int c = 0; c < 200; c++) {
        kv_tree *t = random_tree(1 + rnd(MAXINS)), *u = NULL;
        KT_REQUIRE(t, "tree");
        char *a = NULL, *b = NULL;
        KT_REQUIRE(kv_tree_index_format(t, &a) == KV_OK, "format");
        kv_status st = kv_tree_index_parse(a, strlen(a), &u);
        KT_REQUIRE(st == KV_OK, "parse: %s\n%s", kv_errdetail(), a);
        KT_REQUIRE(kv_tree_index_format(u, &b) == KV_OK, "format 2");
        KT_CHECK(!strcmp(a, b), "round trip differs:\n%s\n%s", a, b);
        /* Same matches before and after. */
        int32_t q[MAXSEQ];
        int path[MAXSEQ], np, used;
        for (int k = 0; k < 20; k++) {
            int n = rnd(MAXSEQ);
            for (int i = 0; i < n; i++) q[i] = rnd(4);
            KT_CHECK(kv_tree_match(t, q, n, path, &np, &used) == kv_tree_match(u, q, n, path, &np, &used), "match");
        }
        free(a);
        free(b);
        kv_tree_free(t);
        kv_tree_free(u);
    }
}

static void expect_reject(const char *json, const char *what)
{
    kv_tree *t = NULL;
    kv_errclear();
    kv_status st = kv_tree_index_parse(json, strlen(json), &t);
    KT_CHECK(st == KV_E_DATA && strstr(kv_errdetail(), what), "want '%s', got %d '%s'", what, st, kv_errdetail());
    kv_tree_free(t);
}

#define HDR "{\"format\":\"kv-tree\",\"version\":1,\"generation\":3,\"geometry\":{\"n_layers\":1,\"n_heads\":0," \
            "\"n_kv_heads\":1,\"head_dim\":2,\"dtype\":\"F32\",\"rope_theta\":10000,\"rope_scaling\":\"none\"," \
            "\"rope_layout\":\"interleaved\",\"keys_roped\":true,\"model\":\"\"},\"budgets\":null,\"nodes\":["
#define NODE(id, par, start, toks, file)                                                                  \
    "{\"id\":" #id ",\"parent\":" #par ",\"start\":" #start ",\"tokens\":" toks ",\"file\":\"" file "\"," \
    "\"bytes\":1,\"kv_bytes\":1,\"tier\":\"disk\",\"hits\":0,\"last_use\":0,"                             \
    "\"importance\":{\"mean\":1,\"min\":1,\"max\":1,\"source\":\"attention\"}}"

static void test_index_rejects_damage(void)
{
    kv_tree *t = NULL;
    const char *good = HDR NODE(1, 0, 0, "[1,2]", "chunks/c1.kvc") "," NODE(2, 1, 2, "[3]", "chunks/c2.kvc") "]}";
    KT_CHECK(kv_tree_index_parse(good, strlen(good), &t) == KV_OK, "good index: %s", kv_errdetail());
    KT_CHECK(t && t->n_nodes == 3 && t->nodes[2].start == 2, "shape");
    kv_tree_free(t);
    expect_reject("{", "malformed JSON");
    expect_reject("[]", "not a JSON object");
    expect_reject("{\"format\":\"kv-tree\",\"version\":3,\"generation\":0,\"nodes\":[]}", "version 3");
    expect_reject(HDR NODE(1, 1, 0, "[1]", "chunks/c1.kvc") "]}", "parent must be an earlier node");
    expect_reject(HDR NODE(1, 0, 0, "[1]", "chunks/c1.kvc") "," NODE(2, 0, 0, "[1,5]", "chunks/c2.kvc") "]}",
                  "same token as a sibling");
    expect_reject(HDR NODE(1, 0, 0, "[1]", "chunks/../../etc/passwd") "]}", "bad chunk file name");
    expect_reject(HDR NODE(1, 0, 0, "[1]", "chunks/c1.kvc") "," NODE(2, 0, 0, "[2]", "chunks/c1.kvc") "]}",
                  "two nodes name the chunk");
    expect_reject(HDR NODE(1, 0, 1, "[1]", "chunks/c1.kvc") "]}", "start must be 0");
    expect_reject(HDR NODE(1, 0, 0, "[-1]", "chunks/c1.kvc") "]}", "not an id");
    expect_reject(HDR NODE(1, 0, 0, "[]", "chunks/c1.kvc") "]}", "non-empty array");
}

/* Index version 2's fields: tier encodings, group_rows, each node's chunk
 * version and encoding; a version-1 node (no "chunk") is a whole .kvc. */
#define NODE2(extra)                                                                                          \
    "{\"id\":1,\"parent\":0,\"start\":0,\"tokens\":[1],\"file\":\"chunks/c1.kvt\",\"bytes\":1,\"kv_bytes\":1," \
    "\"tier\":\"host\",\"hits\":0,\"last_use\":0,\"importance\":{\"mean\":1,\"min\":1,\"max\":1,"             \
    "\"source\":\"attention\"}" extra "}"
static void test_index_version_2_fields(void)
{
    kv_tree *t = NULL;
    const char *v1 = HDR NODE(1, 0, 0, "[1,2]", "chunks/c1.kvc") "]}";
    KT_REQUIRE(kv_tree_index_parse(v1, strlen(v1), &t) == KV_OK, "v1: %s", kv_errdetail());
    KT_CHECK(t->nodes[1].chunk_version == 1 && t->nodes[1].enc.codec == KV_TREE_ENC_RAW && t->nodes[1].enc.zstd,
             "a version-1 disk node is raw+zstd");
    KT_CHECK(t->group_rows == KV_TREE_GROUP_ROWS && !t->enc[KV_TIER_HOST].zstd && t->enc[KV_TIER_DISK].zstd,
             "version-1 stores take the lossless encodings");
    kv_tree_free(t);
    const char *v2 = HDR NODE2(",\"chunk\":2,\"encoding\":\"kivi2\"") "],\"encodings\":{\"gpu\":\"raw\",\"host\":"
                     "\"kivi2\",\"disk\":\"dsq4+zstd\"},\"group_rows\":64,\"sketch_channels\":48}";
    KT_REQUIRE(kv_tree_index_parse(v2, strlen(v2), &t) == KV_OK, "v2: %s", kv_errdetail());
    KT_CHECK(t->nodes[1].chunk_version == 2 && t->nodes[1].enc.codec == KV_TREE_ENC_KIVI && t->nodes[1].enc.bits == 2,
             "node encoding");
    KT_CHECK(t->enc[KV_TIER_DISK].codec == KV_TREE_ENC_DSQ && t->enc[KV_TIER_DISK].bits == 4 &&
             t->enc[KV_TIER_DISK].zstd && t->group_rows == 64 && t->sketch_channels == 48, "store encodings");
    kv_tree_free(t);
    expect_reject(HDR NODE2(",\"chunk\":3,\"encoding\":\"raw\"") "]}", "chunk version 3");
    expect_reject(HDR NODE2(",\"chunk\":2,\"encoding\":\"kivi3\"") "]}", "known encoding");
    expect_reject(HDR NODE2(",\"chunk\":2") "]}", "known encoding");
    expect_reject(HDR NODE2(",\"encoding\":\"kivi2\"") "]}", "version-1 chunk is raw");
    expect_reject(HDR NODE2("") "],\"group_rows\":12}", "group_rows");
    expect_reject(HDR NODE2("") "],\"sketch_channels\":-1}", "sketch_channels");
    expect_reject(HDR NODE2("") "],\"sketch_channels\":4097}", "sketch_channels");
    expect_reject(HDR NODE2("") "],\"sketch_channels\":1.5}", "sketch_channels");
    expect_reject(HDR NODE2("") "],\"encodings\":{\"gpu\":\"raw\"}}", "encodings.host");
    kv_tree_enc e[KV_TIER_COUNT];
    kv_errclear();
    KT_CHECK(kv_tree_encodings_parse("packed", e) == KV_OK && e[KV_TIER_GPU].codec == KV_TREE_ENC_RAW &&
                 e[KV_TIER_HOST].codec == KV_TREE_ENC_KIVI && !e[KV_TIER_HOST].zstd && e[KV_TIER_DISK].zstd,
             "packed preset");
    KT_CHECK(kv_tree_encodings_parse("disk=zip", e) == KV_E_USAGE, "unknown encoding is a usage error");
    KT_CHECK(kv_tree_encodings_parse("cpu=raw", e) == KV_E_USAGE, "unknown tier is a usage error");
    /* apply: a list changes only the tiers it names, a bad list changes nothing */
    KT_REQUIRE(kv_tree_encodings_parse("packed", e) == KV_OK, "packed preset");
    KT_CHECK(kv_tree_encodings_apply("host=dsq4", e) == KV_OK && e[KV_TIER_HOST].codec == KV_TREE_ENC_DSQ &&
                 e[KV_TIER_HOST].bits == 4 && e[KV_TIER_DISK].codec == KV_TREE_ENC_KIVI && e[KV_TIER_DISK].zstd &&
                 e[KV_TIER_GPU].codec == KV_TREE_ENC_RAW,
             "apply host=dsq4 keeps the packed disk tier");
    KT_CHECK(kv_tree_encodings_apply("gpu=kivi1,disk=zip", e) == KV_E_USAGE && e[KV_TIER_GPU].codec == KV_TREE_ENC_RAW,
             "a failed apply leaves every tier as it was");
    KT_CHECK(kv_tree_encodings_apply("lossless", e) == KV_OK && e[KV_TIER_HOST].codec == KV_TREE_ENC_RAW &&
                 e[KV_TIER_DISK].codec == KV_TREE_ENC_RAW,
             "a preset sets every tier");
}

// --- the store on disk, end to end -------------------------------------------

/* K/V of a token depend only on its prefix, as in a real model: a hash of
 * tokens[0..t] picks each F16 element (positive, below 1). */
#define SL 2
#define SH 2
#define SD 4
static uint16_t kv_elem(const int32_t *tok, int t, int l, int w, int h, int c)
{
    unsigned long long x = 1469598103934665603ull;
    for (int i = 0; i <= t; i++) x = (x ^ (unsigned)tok[i]) * 1099511628211ull;
    x = (x ^ (unsigned)(((l * 2 + w) * SH + h) * SD + c)) * 1099511628211ull;
    return (uint16_t)((x >> 20) & 0x37ff);
}

static kvc_file *seq_kvc(const char *dir, const int32_t *tok, int T)
{
    char path[512];
    snprintf(path, sizeof path, "%s/in.kvc", dir);
    kvc_writer *w;
    if (kvc_writer_new(&w)) return NULL;
    kv_geom g;
    kv_geom_defaults(&g);
    g.n_layers = SL, g.n_kv_heads = SH, g.head_dim = SD, g.n_tokens = T;
    kvc_writer_geom(w, &g);
    int64_t s1[1] = {T}, s3[3] = {SH, T, SD};
    kvc_writer_add_copy(w, "tokens", KV_DT_I32, 1, s1, tok);
    uint16_t *buf = malloc((size_t)SH * T * SD * 2 + 2);
    for (int l = 0; l < SL; l++)
        for (int wv = 0; wv < 2; wv++) {
            for (int h = 0; h < SH; h++)
                for (int t = 0; t < T; t++)
                    for (int c = 0; c < SD; c++) buf[((size_t)h * T + t) * SD + c] = kv_elem(tok, t, l, wv, h, c);
            char name[32];
            snprintf(name, sizeof name, "layers.%d.%c", l, wv ? 'v' : 'k');
            kvc_writer_add_copy(w, name, KV_DT_F16, 3, s3, buf);
        }
    free(buf);
    kvc_file *f = NULL;
    if (kvc_writer_write(w, path, 0) == KV_OK) kvc_open(path, &f);
    kvc_writer_free(w);
    return f;
}

/* Does the .kvc at path hold exactly the rows `positions` (or 0..n-1) of
 * sequence tok?  Returns the token count, or -1. */
static int check_out(const char *path, const int32_t *tok)
{
    kvc_file *f = NULL;
    if (kvc_open(path, &f)) return -1;
    const kvc_tensor *tt = kvc_find(f, "tokens"), *pt = kvc_find(f, "positions");
    int n = (int)tt->shape[0], ok = 1;
    for (int r = 0; r < n && ok; r++) {
        int32_t pos = r, id;
        if (pt) memcpy(&pos, (const char *)pt->data + 4 * r, 4);
        memcpy(&id, (const char *)tt->data + 4 * r, 4);
        ok &= id == tok[pos];
        for (int l = 0; l < SL; l++)
            for (int wv = 0; wv < 2; wv++) {
                const kvc_tensor *x = kvc_layer(f, l, wv ? "v" : "k");
                for (int h = 0; h < SH; h++)
                    for (int c = 0; c < SD; c++) {
                        uint16_t e;
                        memcpy(&e, (const char *)x->data + (((size_t)h * n + r) * SD + c) * 2, 2);
                        ok &= e == kv_elem(tok, pos, l, wv, h, c);
                    }
            }
    }
    kvc_close(f);
    return ok ? n : -1;
}

/* kv_tree_store_create_sk: the first index holds the sketch channels; a
 * value out of range is refused before the directory is made. */
static void test_create_names_sketch_channels(void)
{
    char dir[] = "/tmp/test_tree_sk_XXXXXX", st_dir[600];
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(st_dir, sizeof st_dir, "%s/s", dir);
    KT_CHECK(kv_tree_store_create_sk(st_dir, NULL, KV_TREE_SKETCH_MAX + 1) == KV_E_USAGE, "4097 channels refused");
    KT_CHECK(kv_tree_store_create_sk(st_dir, NULL, -1) == KV_E_USAGE, "-1 channels refused");
    KT_CHECK(access(st_dir, F_OK) != 0, "a refused create leaves no directory");
    KT_REQUIRE(kv_tree_store_create_sk(st_dir, NULL, 24) == KV_OK, "init: %s", kv_errdetail());
    kv_tree_store *s = NULL;
    KT_REQUIRE(kv_tree_store_open(st_dir, false, &s) == KV_OK, "open: %s", kv_errdetail());
    KT_CHECK(kv_tree_store_tree(s)->sketch_channels == 24, "the first index keeps 24 channels (read %d)",
             kv_tree_store_tree(s)->sketch_channels);
    kv_tree_store_close(s);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    KT_CHECK(system(cmd) == 0, "cleanup");
}

static void test_store_get_is_exact_after_random_puts(void)
{
    char dir[] = "/tmp/test_tree_store_XXXXXX", st_dir[600], out[600];
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(st_dir, sizeof st_dir, "%s/s", dir);
    snprintf(out, sizeof out, "%s/out.kvc", dir);
    KT_REQUIRE(kv_tree_store_create(st_dir) == KV_OK, "init: %s", kv_errdetail());
    int32_t seqs[30][MAXSEQ];
    int lens[30], n = 0, bad = 0;
    for (int i = 0; i < 30; i++) {
        int L = rand_seq(seqs[i], seqs, lens, i, 3);
        if (L == 0) seqs[i][L++] = 1;
        lens[i] = L;
        kv_tree_store *s;
        KT_REQUIRE(kv_tree_store_open(st_dir, true, &s) == KV_OK, "open: %s", kv_errdetail());
        kvc_file *f = seq_kvc(dir, seqs[i], L);
        KT_REQUIRE(f, "input %d", i);
        kv_put_report r;
        kv_status st = kv_tree_store_put(s, f, (kv_tier)rnd(3), 1, 1000 + i, &r);
        KT_CHECK(st == KV_OK, "put %d: %s", i, kv_errdetail());
        if (!st) KT_CHECK(kv_tree_store_save(s) == KV_OK, "save: %s", kv_errdetail());
        kvc_close(f);
        kv_tree_store_close(s);
        n++;
    }
    kv_tree_store *s;
    KT_REQUIRE(kv_tree_store_open(st_dir, true, &s) == KV_OK, "open: %s", kv_errdetail());
    kv_check_report cr;
    KT_CHECK(kv_tree_store_check(s, &cr) == KV_OK && cr.n_problems == 0 && cr.orphans == 0, "check: %s",
             cr.n_problems ? cr.problems[0] : kv_errdetail());
    kv_check_report_clear(&cr);
    for (int i = 0; i < n; i++) {
        kv_get_report r;
        if (kv_tree_store_get(s, seqs[i], lens[i], 1.0, true, 5000, out, &r) || r.matched != lens[i] ||
            check_out(out, seqs[i]) != lens[i])
            bad++;
    }
    KT_CHECK(!bad, "%d of %d gets differ from the puts", bad, n);
    /* Everything on disk: --important keeps ceil(frac * u) rows per node,
     * still exact at their positions. */
    kv_place_report pr;
    KT_CHECK(kv_tree_store_place(s, 0, 0, 3600, 1, 5000, &pr) == KV_OK, "place: %s", kv_errdetail());
    for (int i = 0; i < n; i++) {
        kv_get_report r;
        int got;
        if (kv_tree_store_get(s, seqs[i], lens[i], 0.5, false, 5000, out, &r) || (got = check_out(out, seqs[i])) < 0 ||
            got != r.kept || r.kept + r.skipped != lens[i] || 2 * r.kept < lens[i])
            bad++;
    }
    KT_CHECK(!bad, "%d --important gets are wrong", bad);
    KT_CHECK(kv_tree_store_save(s) == KV_OK, "save");
    kv_evict_report er;
    KT_CHECK(kv_tree_store_gc(s, 3000, 3600, 5000, &er) == KV_OK && er.bytes_after <= 3000, "gc");
    KT_CHECK(kv_tree_store_check(s, &cr) == KV_OK && cr.n_problems == 0 && cr.orphans == 0, "check after gc");
    kv_check_report_clear(&cr);
    kv_tree_store_close(s);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
}

// --- chunk version 2: frames in importance order --------------------------------

/* A longer cache in a bigger geometry than seq_kvc's: LL layers, 2 KV
 * heads, head dim 32, F16 values in [0, 1), distinct key norms (so the
 * key-norm importance ranks every token). */
#define LL 4
#define LH 2
#define LD 32
static kvc_file *long_kvc(const char *dir, int T, int32_t base, float *vals)
{
    char path[512];
    snprintf(path, sizeof path, "%s/long.kvc", dir);
    kvc_writer *w;
    if (kvc_writer_new(&w)) return NULL;
    kv_geom g;
    kv_geom_defaults(&g);
    g.n_layers = LL, g.n_kv_heads = LH, g.head_dim = LD, g.n_tokens = T;
    kvc_writer_geom(w, &g);
    int32_t *tok = malloc((size_t)T * 4);
    for (int t = 0; t < T; t++) tok[t] = base + t;
    int64_t s1[1] = {T}, s3[3] = {LH, T, LD};
    kvc_writer_add_copy(w, "tokens", KV_DT_I32, 1, s1, tok);
    kv_half *buf = malloc((size_t)LH * T * LD * 2);
    for (int l = 0; l < LL; l++)
        for (int wv = 0; wv < 2; wv++) {
            for (size_t i = 0; i < (size_t)LH * T * LD; i++) {
                float x = (float)kt_rand(&seed);
                buf[i] = kv_f32_to_half(x);
                if (vals) vals[(((size_t)l * 2 + wv) * LH * T * LD) + i] = kv_half_to_f32(buf[i]);
            }
            char name[32];
            snprintf(name, sizeof name, "layers.%d.%c", l, wv ? 'v' : 'k');
            kvc_writer_add_copy(w, name, KV_DT_F16, 3, s3, buf);
        }
    free(buf);
    free(tok);
    kvc_file *f = NULL;
    if (kvc_writer_write(w, path, 0) == KV_OK) kvc_open(path, &f);
    kvc_writer_free(w);
    return f;
}

/* Largest |out - in| over the rows of a get (in: vals of long_kvc). */
static double max_err(const kvc_file *out, const float *vals, int T)
{
    const kvc_tensor *pt = kvc_find(out, "positions");
    int M = kvc_geom(out)->n_tokens;
    double e = 0;
    float *x = malloc((size_t)LH * M * LD * sizeof *x);
    for (int l = 0; l < LL; l++)
        for (int wv = 0; wv < 2; wv++) {
            kvc_tensor_to_f32(kvc_layer(out, l, wv ? "v" : "k"), x);
            for (int h = 0; h < LH; h++)
                for (int r = 0; r < M; r++) {
                    int32_t pos = r;
                    if (pt) memcpy(&pos, (const char *)pt->data + 4 * r, 4);
                    for (int c = 0; c < LD; c++) {
                        double d = fabs(x[((size_t)h * M + r) * LD + c] -
                                        vals[(((size_t)l * 2 + wv) * LH * T * LD) + ((size_t)h * T + pos) * LD + c]);
                        if (d > e) e = d;
                    }
                }
        }
    free(x);
    return e;
}

static void test_important_reads_scale_with_frac(void)
{
    char dir[] = "/tmp/test_tree_frac_XXXXXX", st_dir[600];
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(st_dir, sizeof st_dir, "%s/s", dir);
    const int T = 320;
    float *vals = malloc((size_t)LL * 2 * LH * T * LD * sizeof *vals);
    kvc_file *f = long_kvc(dir, T, 10, vals);
    KT_REQUIRE(f && vals, "input");
    static const char *encs[] = {"lossless", "packed", "gpu=raw,host=raw,disk=dsq4+zstd", "gpu=raw,host=raw,disk=kivi4",
                                 "gpu=raw,host=raw,disk=raw+zstd+sketch"};
    static const double tol[] = {0, 0.2, 0.1, 0.1, 0}; /* 2-bit: half a step of range/3; 4-bit: range/15 */
    for (int e = 0; e < 5; e++) {
        KT_REQUIRE(kt_rm_rf(st_dir) == 0, "clean");
        kv_tree_enc enc[KV_TIER_COUNT];
        KT_REQUIRE(kv_tree_encodings_parse(encs[e], enc) == KV_OK, "encodings");
        KT_REQUIRE(kv_tree_store_create_ex(st_dir, enc) == KV_OK, "init: %s", kv_errdetail());
        kv_tree_store *s;
        KT_REQUIRE(kv_tree_store_open(st_dir, true, &s) == KV_OK, "open");
        kv_put_report pr;
        KT_REQUIRE(kv_tree_store_put(s, f, KV_TIER_DISK, 3, 1000, &pr) == KV_OK, "put: %s", kv_errdetail());
        int32_t tok[320];
        for (int t = 0; t < T; t++) tok[t] = 10 + t;
        uint64_t read[3];
        static const double fr[3] = {1, 0.5, 0.25};
        for (int k = 0; k < 3; k++) {
            kv_get_report r;
            kvc_file *out = NULL;
            KT_REQUIRE(kv_tree_store_get_kvc(s, tok, T, fr[k], false, 1000, &out, &r) == KV_OK, "get: %s",
                       kv_errdetail());
            read[k] = r.bytes_read[KV_TIER_DISK];
            double err = max_err(out, vals, T);
            /* version 3 (+sketch) keeps whole frames of 32 positions */
            int want = (int)ceil(fr[k] * T), kept_ok = e == 4 ? r.kept >= want && r.kept < want + 32 && r.kept % 32 == 0
                                                              : r.kept == want;
            KT_CHECK(kept_ok && kvc_geom(out)->n_tokens == r.kept, "%s F=%g: kept %d", encs[e], fr[k], r.kept);
            if (tol[e] == 0) KT_CHECK(err == 0, "%s F=%g: error %g", encs[e], fr[k], err);
            else KT_CHECK(err > 0 && err <= tol[e], "%s F=%g: error %g not in (0, %g]", encs[e], fr[k], err, tol[e]);
            kvc_close(out);
        }
        printf("# %s: disk bytes read at F = 1, 0.5, 0.25: %llu %llu %llu (%.2f, %.2f)\n", encs[e],
               (unsigned long long)read[0], (unsigned long long)read[1], (unsigned long long)read[2],
               (double)read[1] / (double)read[0], (double)read[2] / (double)read[0]);
        /* all but the key sketch (half of head_dim's channels in int8: about
         * 1/8 of the f16 K/V), which only a query-aware load reads */
        KT_CHECK(e == 4 ? read[0] < pr.bytes_added && read[0] > 0.85 * pr.bytes_added : read[0] == pr.bytes_added,
                 "%s: F=1 reads the whole chunk (%llu of %llu)", encs[e], (unsigned long long)read[0],
                 (unsigned long long)pr.bytes_added);
        KT_CHECK(read[2] <= 0.35 * read[0] && read[1] <= 0.6 * read[0] && read[2] < read[1], "%s: bytes read %llu %llu %llu",
                 encs[e], (unsigned long long)read[0], (unsigned long long)read[1], (unsigned long long)read[2]);
        kv_check_report cr;
        KT_CHECK(kv_tree_store_check(s, &cr) == KV_OK && cr.n_problems == 0, "check %s: %s", encs[e],
                 cr.n_problems ? cr.problems[0] : "");
        kv_check_report_clear(&cr);
        KT_CHECK(kv_tree_store_save(s) == KV_OK, "save");
        kv_tree_store_close(s);
    }
    kvc_close(f);
    free(vals);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
}

/* A chunk file's n bytes, read whole for a damage test; NULL when it
 * cannot be. */
static uint8_t *read_chunk(const char *path, size_t n)
{
    FILE *fp = fopen(path, "rb");
    uint8_t *b = fp ? malloc(n) : NULL;
    const bool ok = b && fread(b, 1, n, fp) == n;
    if (fp) fclose(fp);
    if (ok) return b;
    free(b);
    return NULL;
}

typedef struct {
    size_t at;        /* the byte flipped */
    const char *what; /* what the refusal must say */
} chunk_damage;

/* Each damage in turn (bit 6 of its byte flipped, then put back): the
 * chunk in b (n bytes) must be refused with KV_E_DATA saying what. */
static void expect_chunk_damage(uint8_t *b, size_t n, const chunk_damage *dmg, size_t nd)
{
    int rows;
    for (size_t i = 0; i < nd; i++) {
        b[dmg[i].at] ^= 0x40;
        kv_errclear();
        kv_status st = kv_tree_chunk_verify_mem(b, n, &rows);
        KT_CHECK(st == KV_E_DATA && strstr(kv_errdetail(), dmg[i].what), "byte %zu: want '%s', got %d '%s'", dmg[i].at,
                 dmg[i].what, st, kv_errdetail());
        b[dmg[i].at] ^= 0x40;
    }
}

/* A chunk file is refused on any damage: head, tables, frame bytes. */
static void test_chunk_rejects_damage(void)
{
    char dir[] = "/tmp/test_tree_chunk_XXXXXX", st_dir[600], path[700];
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(st_dir, sizeof st_dir, "%s/s", dir);
    kvc_file *f = long_kvc(dir, 100, 1, NULL);
    KT_REQUIRE(f && kv_tree_store_create(st_dir) == KV_OK, "init");
    kv_tree_store *s;
    KT_REQUIRE(kv_tree_store_open(st_dir, true, &s) == KV_OK, "open");
    kv_put_report pr;
    KT_REQUIRE(kv_tree_store_put(s, f, KV_TIER_HOST, 3, 1000, &pr) == KV_OK && kv_tree_store_save(s) == KV_OK, "put");
    snprintf(path, sizeof path, "%s/%s", st_dir, kv_tree_store_tree(s)->nodes[1].file);
    kv_tree_store_close(s);
    kvc_close(f);
    uint8_t *b = read_chunk(path, pr.bytes_added);
    KT_REQUIRE(b, "read the chunk");
    int rows;
    KT_CHECK(kv_tree_chunk_verify_mem(b, pr.bytes_added, &rows) == KV_OK && rows == 100, "good chunk: %s", kv_errdetail());
    static const chunk_damage dmg[] = {
        {0, "bad magic"}, {8, "chunk version"}, {20, "checksum mismatch in the head"}, {72 + 5, "checksum mismatch"},
    };
    expect_chunk_damage(b, pr.bytes_added, dmg, sizeof dmg / sizeof dmg[0]);
    b[pr.bytes_added - 10] ^= 1; /* inside the last frame */
    kv_errclear();
    KT_CHECK(kv_tree_chunk_verify_mem(b, pr.bytes_added, &rows) == KV_E_DATA && strstr(kv_errdetail(), "frame"),
             "frame damage: %s", kv_errdetail());
    b[pr.bytes_added - 10] ^= 1;
    KT_CHECK(kv_tree_chunk_verify_mem(b, pr.bytes_added - 1, &rows) == KV_E_DATA, "truncated");
    free(b);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
}

/* Chunk version 3 (+sketch): rows in position order, the key sketch
 * after the tables, both covered by checksums; damage is refused. */
static void test_chunk_version_3_holds_a_key_sketch(void)
{
    char dir[] = "/tmp/test_tree_v3_XXXXXX", st_dir[600], path[700];
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(st_dir, sizeof st_dir, "%s/s", dir);
    const int T = 100;
    kvc_file *f = long_kvc(dir, T, 1, NULL);
    kv_tree_enc enc[KV_TIER_COUNT];
    KT_REQUIRE(kv_tree_encodings_parse("disk=raw+sketch", enc) == KV_OK && enc[KV_TIER_DISK].sketch &&
                   !enc[KV_TIER_DISK].zstd, "encodings");
    char name[24];
    kv_tree_enc_format(&enc[KV_TIER_DISK], name, sizeof name);
    KT_CHECK(!strcmp(name, "raw+sketch"), "formatted as %s", name);
    KT_CHECK(kv_tree_encodings_parse("disk=raw+sketch+zstd", enc) == KV_E_USAGE, "+sketch goes last");
    kv_errclear();
    KT_REQUIRE(kv_tree_encodings_parse("disk=raw+sketch", enc) == KV_OK, "encodings");
    KT_REQUIRE(f && kv_tree_store_create_ex(st_dir, enc) == KV_OK, "init");
    kv_tree_store *s;
    KT_REQUIRE(kv_tree_store_open(st_dir, true, &s) == KV_OK, "open");
    kv_put_report pr;
    KT_REQUIRE(kv_tree_store_put(s, f, KV_TIER_DISK, 3, 1000, &pr) == KV_OK && kv_tree_store_save(s) == KV_OK, "put");
    KT_CHECK(kv_tree_store_tree(s)->nodes[1].chunk_version == 3, "version %d", kv_tree_store_tree(s)->nodes[1].chunk_version);
    int32_t tok[100];
    for (int t = 0; t < T; t++) tok[t] = 1 + t;
    kv_tree_sketch sk;
    KT_REQUIRE(kv_tree_store_sketch(s, tok, 60, &sk) == KV_OK, "sketch: %s", kv_errdetail());
    KT_CHECK(sk.matched == 60 && sk.nseg == 1 && sk.seg[0].n == 60 && sk.seg[0].rows == T && sk.seg[0].r == LD / 2 &&
                 sk.seg[0].frame_rows == 32 && sk.bytes_read[KV_TIER_DISK] > (uint64_t)LL * LH * (LD / 2) * T,
             "sketch of %d rows, r %d, %llu bytes", sk.matched, sk.seg[0].r, (unsigned long long)sk.bytes_read[KV_TIER_DISK]);
    kv_tree_sketch_free(&sk);
    /* a caller's pick: exactly those rows */
    int32_t pick[3] = {0, 33, 59};
    kv_tree_rows x;
    kv_get_report gr;
    KT_REQUIRE(kv_tree_store_load(s, tok, 60, 1, pick, 3, false, 1000, &x, &gr) == KV_OK, "load: %s", kv_errdetail());
    KT_CHECK(x.T == 3 && x.matched == 60 && x.positions[1] == 33 && x.tokens[2] == 60 && gr.positions, "picked %d rows", x.T);
    KT_CHECK(gr.bytes_read[KV_TIER_DISK] < pr.bytes_added * 3 / 4, "two frames of four read: %llu of %llu",
             (unsigned long long)gr.bytes_read[KV_TIER_DISK], (unsigned long long)pr.bytes_added);
    kv_tree_rows_free(&x);
    int32_t bad[2] = {5, 2};
    KT_CHECK(kv_tree_store_load(s, tok, 60, 1, bad, 2, false, 1000, &x, &gr) == KV_E_USAGE, "a pick out of order");
    int32_t far[1] = {70};
    KT_CHECK(kv_tree_store_load(s, tok, 60, 1, far, 1, false, 1000, &x, &gr) == KV_E_USAGE, "a pick past the match");
    kv_errclear();
    snprintf(path, sizeof path, "%s/%s", st_dir, kv_tree_store_tree(s)->nodes[1].file);
    kv_tree_store_close(s);
    kvc_close(f);
    uint8_t *b = read_chunk(path, pr.bytes_added);
    KT_REQUIRE(b, "read the chunk");
    int rows;
    KT_CHECK(b[8] == 3 && kv_tree_chunk_verify_mem(b, pr.bytes_added, &rows) == KV_OK && rows == T, "good chunk: %s",
             kv_errdetail());
    const size_t sk_at = 88 + 12 * (size_t)T + 24 * 4; /* no query samples */
    static const chunk_damage dmg[] = {
        {76, "checksum mismatch in the head"}, {80, "unknown row order"}, {sk_at + 1, "key sketch"}, {sk_at + LL * LH * (LD / 2) * 6 + 7, "key sketch"},
    };
    expect_chunk_damage(b, pr.bytes_added, dmg, sizeof dmg / sizeof dmg[0]);
    /* damage on disk: check names it */
    b[sk_at + 3] ^= 1;
    FILE *fp = fopen(path, "wb");
    KT_REQUIRE(fp && fwrite(b, 1, pr.bytes_added, fp) == pr.bytes_added && fclose(fp) == 0, "rewrite");
    KT_REQUIRE(kv_tree_store_open(st_dir, false, &s) == KV_OK, "reopen");
    kv_check_report cr;
    KT_CHECK(kv_tree_store_check(s, &cr) == KV_OK && cr.n_problems == 1 && strstr(cr.problems[0], "key sketch"), "check: %s",
             cr.n_problems ? cr.problems[0] : "no problem found");
    kv_check_report_clear(&cr);
    kv_tree_store_close(s);
    free(b);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
}

/* Rows loaded are exactly long_kvc's values at their positions (0 if so,
 * else the count of differing values). */
static long rows_differ(const kv_tree_rows *x, const float *vals, int T)
{
    long bad = 0;
    for (int l = 0; l < LL; l++)
        for (int wv = 0; wv < 2; wv++)
            for (int h = 0; h < LH; h++)
                for (int r = 0; r < x->T; r++)
                    for (int c = 0; c < LD; c++) {
                        const kv_half got = ((const kv_half *)(wv ? x->v : x->k)[l])[((size_t)h * x->T + r) * LD + c];
                        bad += kv_half_to_f32(got) !=
                               vals[(((size_t)l * 2 + wv) * LH * T * LD) + ((size_t)h * T + x->positions[r]) * LD + c];
                    }
    return bad;
}

typedef struct {
    kv_tree_store *s;
    const int32_t *tok;
    const float *vals;
    int T, rounds;
    long bad;
} load_job;

static void *load_rounds(void *p)
{
    load_job *j = p;
    for (int i = 0; i < j->rounds; i++) {
        kv_tree_rows x;
        kv_get_report gr;
        if (kv_tree_store_load(j->s, j->tok, j->T, 1, NULL, 0, false, 1000, &x, &gr) || x.T != j->T) {
            j->bad++;
            continue;
        }
        j->bad += rows_differ(&x, j->vals, j->T) != 0;
        kv_tree_rows_free(&x);
    }
    return NULL;
}

/* The store's frame buffers (kept between loads, one per reading thread):
 * a load of the short last frame, then of every frame (the buffers grow),
 * then of a pick across frames, each exact; two threads loading from one
 * store at once (one holds the buffers, the other allocates its own) get
 * exact rows every time; a frame damaged on disk after the buffers were
 * filled is still refused. */
static void test_frame_buffers_are_reused_and_shared_safely(void)
{
    char dir[] = "/tmp/test_tree_bufs_XXXXXX", st_dir[600], path[700];
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(st_dir, sizeof st_dir, "%s/s", dir);
    const int T = 200; /* frames of 32 positions: the last holds 8 */
    float *vals = malloc((size_t)LL * 2 * LH * T * LD * sizeof *vals);
    kvc_file *f = long_kvc(dir, T, 1, vals);
    kv_tree_enc enc[KV_TIER_COUNT];
    KT_REQUIRE(f && vals && kv_tree_encodings_parse("disk=raw+sketch", enc) == KV_OK &&
                   kv_tree_store_create_ex(st_dir, enc) == KV_OK, "init");
    kv_tree_store *s;
    KT_REQUIRE(kv_tree_store_open(st_dir, true, &s) == KV_OK, "open");
    kv_put_report pr;
    KT_REQUIRE(kv_tree_store_put(s, f, KV_TIER_DISK, 3, 1000, &pr) == KV_OK && kv_tree_store_save(s) == KV_OK, "put");
    int32_t tok[200];
    for (int t = 0; t < T; t++) tok[t] = 1 + t;
    kv_tree_rows x;
    kv_get_report gr;
    int32_t last[2] = {195, 199};
    KT_REQUIRE(kv_tree_store_load(s, tok, T, 1, last, 2, false, 1000, &x, &gr) == KV_OK, "load: %s", kv_errdetail());
    KT_CHECK(x.T == 2 && rows_differ(&x, vals, T) == 0, "the last frame's rows");
    kv_tree_rows_free(&x);
    for (int k = 0; k < 2; k++) {
        KT_REQUIRE(kv_tree_store_load(s, tok, T, 1, NULL, 0, false, 1000, &x, &gr) == KV_OK, "load: %s", kv_errdetail());
        KT_CHECK(x.T == T && rows_differ(&x, vals, T) == 0, "every row, load %d", k);
        kv_tree_rows_free(&x);
    }
    int32_t pick[6] = {0, 1, 31, 32, 100, 163};
    KT_REQUIRE(kv_tree_store_load(s, tok, T, 1, pick, 6, false, 1000, &x, &gr) == KV_OK, "load: %s", kv_errdetail());
    KT_CHECK(x.T == 6 && x.positions[3] == 32 && rows_differ(&x, vals, T) == 0, "a pick across frames");
    kv_tree_rows_free(&x);
    load_job jb[2] = {{s, tok, vals, T, 25, 0}, {s, tok, vals, T, 25, 0}};
    pthread_t th;
    KT_REQUIRE(pthread_create(&th, NULL, load_rounds, &jb[1]) == 0, "thread");
    load_rounds(&jb[0]);
    pthread_join(th, NULL);
    KT_CHECK(jb[0].bad == 0 && jb[1].bad == 0, "concurrent loads: %ld and %ld of 25 wrong", jb[0].bad, jb[1].bad);
    snprintf(path, sizeof path, "%s/%s", st_dir, kv_tree_store_tree(s)->nodes[1].file);
    uint8_t *b = read_chunk(path, pr.bytes_added);
    KT_REQUIRE(b, "read the chunk");
    b[pr.bytes_added - 20] ^= 2; /* inside the last frame */
    FILE *fp = fopen(path, "wb");
    KT_REQUIRE(fp && fwrite(b, 1, pr.bytes_added, fp) == pr.bytes_added && fclose(fp) == 0, "rewrite");
    kv_errclear();
    KT_CHECK(kv_tree_store_load(s, tok, T, 1, last, 2, false, 1000, &x, &gr) == KV_E_DATA &&
                 strstr(kv_errdetail(), "checksum mismatch in frame"), "damage refused: %s", kv_errdetail());
    KT_REQUIRE(kv_tree_store_load(s, tok, T, 1, pick, 3, false, 1000, &x, &gr) == KV_OK, "other frames: %s",
               kv_errdetail());
    KT_CHECK(rows_differ(&x, vals, T) == 0, "other frames still exact");
    kv_tree_rows_free(&x);
    free(b);
    kv_tree_store_close(s);
    kvc_close(f);
    free(vals);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
}

/* Layer l of a layered load against the same load read frame by frame:
 * bytes of K and V; -1 when they differ. */
static int layer_same(const kv_tree_rows *a, const kv_tree_rows *b, int l)
{
    const size_t n = (size_t)LH * a->T * LD * 2;
    return a->T == b->T && !memcmp(a->k[l], b->k[l], n) && !memcmp(a->v[l], b->v[l], n);
}

/* One load both ways: each layer checked as soon as its wait returns
 * (before the read has ended), then the tables and the report. */
static int layered_matches(kv_tree_store *s, const int32_t *tok, int n, double frac, const int32_t *pick, int np,
                           int threads, const char *what)
{
    kv_tree_rows a, b;
    kv_get_report ra;
    kv_tree_pending *p = NULL;
    if (kv_tree_store_load_ex(s, tok, n, frac, pick, np, false, 1000, NULL, &a, &ra) != KV_OK) {
        KT_CHECK(0, "%s: load: %s", what, kv_errdetail());
        return 1;
    }
    if (kv_tree_store_load_start(s, tok, n, frac, pick, np, false, 1000, NULL, threads, &b, &p) != KV_OK) {
        KT_CHECK(0, "%s: start: %s", what, kv_errdetail());
        kv_tree_rows_free(&a);
        return 1;
    }
    int bad = b.T != a.T || b.matched != a.matched;
    for (int l = LL - 1; l >= 0 && !bad; l -= 2) /* out of order: a later layer's wait covers the earlier ones */
        bad |= kv_tree_rows_wait(p, l) != KV_OK || !layer_same(&a, &b, l) || (l && !layer_same(&a, &b, l - 1));
    kv_get_report rf;
    double rms = -1, wms = -1;
    bad |= kv_tree_load_finish(p, &rf, &rms, &wms) != KV_OK;
    bad |= memcmp(a.positions, b.positions, (size_t)a.T * 4) || memcmp(a.tokens, b.tokens, (size_t)a.T * 4) ||
           memcmp(a.imp, b.imp, (size_t)a.T * 4);
    bad |= rf.kept != ra.kept || rf.matched != ra.matched || rf.positions != ra.positions || rf.nodes != ra.nodes ||
           !(rms >= 0 && wms >= 0) || rf.bytes_read[KV_TIER_DISK] == 0;
    KT_CHECK(!bad, "%s (%d threads): the layered load differs", what, threads);
    kv_tree_rows_free(&a);
    kv_tree_rows_free(&b);
    return bad;
}

/* kv_tree_store_load_start: the same rows, tables and report as a load read
 * frame by frame, over two nodes (a split path), whole, picked across
 * frames and nodes, and by importance; a zstd store (read whole, then
 * given out) likewise; a flipped byte in the last frame's last layer is
 * found there (the layers before it are given, that one and the finish
 * fail, the rows freed); NULL pendings pass. */
static void test_layered_load_equals_the_frame_load(void)
{
    char dir[] = "/tmp/test_tree_layered_XXXXXX", st_dir[600], zdir[600], path[700];
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(st_dir, sizeof st_dir, "%s/s", dir);
    snprintf(zdir, sizeof zdir, "%s/z", dir);
    const int T = 200, T2 = 150;
    kvc_file *f = long_kvc(dir, T, 1, NULL);
    KT_REQUIRE(f, "first cache");
    kv_tree_enc enc[KV_TIER_COUNT], zenc[KV_TIER_COUNT];
    KT_REQUIRE(kv_tree_encodings_parse("disk=raw+sketch", enc) == KV_OK && kv_tree_store_create_ex(st_dir, enc) == KV_OK &&
                   kv_tree_encodings_parse("disk=raw+zstd+sketch", zenc) == KV_OK &&
                   kv_tree_store_create_ex(zdir, zenc) == KV_OK, "init");
    kv_tree_store *s, *z;
    KT_REQUIRE(kv_tree_store_open(st_dir, true, &s) == KV_OK && kv_tree_store_open(zdir, true, &z) == KV_OK, "open");
    kv_put_report pr;
    KT_REQUIRE(kv_tree_store_put(s, f, KV_TIER_DISK, 3, 1000, &pr) == KV_OK && kv_tree_store_put(z, f, KV_TIER_DISK, 3, 1000, &pr) == KV_OK,
               "put: %s", kv_errdetail());
    kvc_close(f);
    /* a second prompt sharing the first 100 tokens: the path splits */
    f = long_kvc(dir, T2, 1, NULL);
    KT_REQUIRE(f, "second cache");
    int32_t tok2[150];
    for (int t = 0; t < T2; t++) tok2[t] = t < 100 ? 1 + t : 5000 + t;
    kvc_close(f);
    {
        char p2[600];
        snprintf(p2, sizeof p2, "%s/long.kvc", dir);
        kvc_file *g = NULL;
        KT_REQUIRE(kvc_open(p2, &g) == KV_OK, "reopen");
        /* the same rows under the diverging ids */
        kvc_writer *w = NULL;
        KT_REQUIRE(kvc_writer_new(&w) == KV_OK && kvc_writer_geom(w, kvc_geom(g)) == KV_OK, "writer");
        int64_t s1[1] = {T2};
        kvc_writer_add_copy(w, "tokens", KV_DT_I32, 1, s1, tok2);
        for (int l = 0; l < LL; l++)
            for (int wv = 0; wv < 2; wv++) {
                const kvc_tensor *t = kvc_layer(g, l, wv ? "v" : "k");
                kvc_writer_add_copy(w, t->name, t->dtype, t->ndim, t->shape, t->data);
            }
        snprintf(p2, sizeof p2, "%s/second.kvc", dir);
        KT_REQUIRE(kvc_writer_write(w, p2, 0) == KV_OK && kvc_open(p2, &f) == KV_OK, "second written");
        kvc_writer_free(w);
        kvc_close(g);
    }
    KT_REQUIRE(kv_tree_store_put(s, f, KV_TIER_DISK, 3, 1001, &pr) == KV_OK && kv_tree_store_save(s) == KV_OK &&
                   kv_tree_store_put(z, f, KV_TIER_DISK, 3, 1001, &pr) == KV_OK && kv_tree_store_save(z) == KV_OK,
               "second put: %s", kv_errdetail());
    kvc_close(f);
    int32_t tok[200];
    for (int t = 0; t < T; t++) tok[t] = 1 + t;
    int32_t pick[9] = {0, 1, 31, 32, 99, 100, 101, 140, 149};
    int bad = 0;
    for (int th = 1; th <= 3; th++) {
        bad += layered_matches(s, tok, T, 1, NULL, 0, th, "the first prompt, whole");
        bad += layered_matches(s, tok2, T2, 1, NULL, 0, th, "the second prompt (two nodes), whole");
        bad += layered_matches(s, tok2, T2, 1, pick, 9, th, "a pick across frames and nodes");
        bad += layered_matches(s, tok2, T2, 0.25, NULL, 0, th, "a quarter by importance");
        bad += layered_matches(z, tok2, T2, 1, pick, 9, th, "zstd frames");
    }
    KT_CHECK(bad == 0, "%d loads differ", bad);
    { /* two loads pending at once: the second is read on a thread of its own, both alike */
        kv_tree_rows a, b, ref;
        kv_tree_pending *pa = NULL, *pb = NULL;
        kv_get_report gr;
        KT_REQUIRE(kv_tree_store_load_ex(s, tok2, T2, 1, NULL, 0, false, 1000, NULL, &ref, &gr) == KV_OK, "reference");
        KT_REQUIRE(kv_tree_store_load_start(s, tok2, T2, 1, NULL, 0, false, 1000, NULL, 2, &a, &pa) == KV_OK &&
                       kv_tree_store_load_start(s, tok2, T2, 1, NULL, 0, false, 1000, NULL, 2, &b, &pb) == KV_OK,
                   "two starts: %s", kv_errdetail());
        int same = kv_tree_rows_wait(pb, LL - 1) == KV_OK && kv_tree_rows_wait(pa, LL - 1) == KV_OK;
        for (int l = 0; l < LL; l++) same &= layer_same(&ref, &a, l) && layer_same(&ref, &b, l);
        same &= kv_tree_load_finish(pb, &gr, NULL, NULL) == KV_OK && kv_tree_load_finish(pa, &gr, NULL, NULL) == KV_OK;
        KT_CHECK(same, "two loads at once");
        kv_tree_rows_free(&a), kv_tree_rows_free(&b), kv_tree_rows_free(&ref);
    }
    KT_CHECK(kv_tree_rows_wait(NULL, 3) == KV_OK && kv_tree_load_finish(NULL, NULL, NULL, NULL) == KV_OK, "NULL pending");
    /* damage in the first prompt's tail chunk, its last frame's last layer */
    const kv_tree *t = kv_tree_store_tree(s);
    int tail = -1;
    for (int i = 1; i < t->n_nodes; i++)
        if (t->nodes[i].live && t->nodes[i].start == 100 && t->nodes[i].tokens[0] == 101) tail = i;
    KT_REQUIRE(tail > 0, "the first prompt's tail node");
    snprintf(path, sizeof path, "%s/%s", st_dir, t->nodes[tail].file);
    struct stat sb;
    KT_REQUIRE(stat(path, &sb) == 0, "stat");
    uint8_t *b = read_chunk(path, (size_t)sb.st_size);
    KT_REQUIRE(b, "read the chunk");
    { /* a damaged frame header that still parses (a digit of rope_theta's 10000): the layered read refuses it */
        uint8_t *hit = memmem(b, (size_t)sb.st_size, "\"10000\"", 7); /* the first frame's header */
        if (hit) hit++;
        KT_REQUIRE(hit, "a 10000 in the chunk");
        hit[1] ^= '0' ^ '1'; /* 10000 -> 11000 */
        FILE *hp = fopen(path, "wb");
        KT_REQUIRE(hp && fwrite(b, 1, (size_t)sb.st_size, hp) == (size_t)sb.st_size && fclose(hp) == 0, "rewrite");
        kv_tree_rows hx;
        kv_tree_pending *hpend = NULL;
        KT_REQUIRE(kv_tree_store_load_start(s, tok, T, 1, NULL, 0, false, 1000, NULL, 2, &hx, &hpend) == KV_OK,
                   "start: %s", kv_errdetail());
        kv_status hw = kv_tree_rows_wait(hpend, 0);
        KT_CHECK(hw == KV_E_DATA && strstr(kv_errdetail(), "checksum mismatch") != NULL,
                 "a damaged frame header is refused: %d %s", hw, kv_errdetail());
        kv_get_report hr;
        KT_CHECK(kv_tree_load_finish(hpend, &hr, NULL, NULL) == KV_E_DATA, "finish fails on a damaged header");
        hit[1] ^= '0' ^ '1'; /* restored */
        hp = fopen(path, "wb");
        KT_REQUIRE(hp && fwrite(b, 1, (size_t)sb.st_size, hp) == (size_t)sb.st_size && fclose(hp) == 0, "restore");
    }
    b[sb.st_size - 20] ^= 2;
    FILE *fp = fopen(path, "wb");
    KT_REQUIRE(fp && fwrite(b, 1, (size_t)sb.st_size, fp) == (size_t)sb.st_size && fclose(fp) == 0, "rewrite");
    free(b);
    kv_tree_rows x;
    kv_tree_pending *p = NULL;
    KT_REQUIRE(kv_tree_store_load_start(s, tok, T, 1, NULL, 0, false, 1000, NULL, 2, &x, &p) == KV_OK, "start: %s",
               kv_errdetail());
    kv_status w0 = kv_tree_rows_wait(p, LL - 2);
    kv_errclear();
    kv_status w1 = kv_tree_rows_wait(p, LL - 1);
    int found = w1 == KV_E_DATA && strstr(kv_errdetail(), "checksum mismatch in frame") &&
                strstr(kv_errdetail(), "layer 3's V") != NULL;
    KT_CHECK(w0 == KV_OK && found, "the damaged layer's wait fails, not the ones before: %d %d %s", w0, w1,
             kv_errdetail());
    kv_get_report rf;
    KT_CHECK(kv_tree_load_finish(p, &rf, NULL, NULL) == KV_E_DATA && x.kv == NULL && x.T == 0, "finish fails, rows freed");
    KT_CHECK(layered_matches(s, tok2, T2, 1, NULL, 0, 2, "the undamaged path") == 0, "other chunks still load");
    kv_tree_store_close(s);
    kv_tree_store_close(z);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
}

/* put refuses a token subset (positions) and changes nothing. */
static void test_put_refuses_positions(void)
{
    char dir[] = "/tmp/test_tree_pos_XXXXXX", st_dir[600], path[700];
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(st_dir, sizeof st_dir, "%s/s", dir);
    snprintf(path, sizeof path, "%s/sub.kvc", dir);
    kvc_file *f = long_kvc(dir, 40, 1, NULL);
    KT_REQUIRE(f && kv_tree_store_create(st_dir) == KV_OK, "init");
    kv_tree_store *s;
    KT_REQUIRE(kv_tree_store_open(st_dir, true, &s) == KV_OK, "open");
    kv_put_report pr;
    KT_REQUIRE(kv_tree_store_put(s, f, KV_TIER_DISK, 3, 1000, &pr) == KV_OK, "put");
    int32_t tok[40];
    for (int t = 0; t < 40; t++) tok[t] = 1 + t;
    kv_get_report r;
    KT_REQUIRE(kv_tree_store_get(s, tok, 40, 0.5, false, 1000, path, &r) == KV_OK && r.positions, "get --important");
    kvc_file *sub = NULL;
    KT_REQUIRE(kvc_open(path, &sub) == KV_OK, "open subset");
    int32_t *pos;
    int np;
    KT_CHECK(kvc_positions(sub, &pos, &np) == KV_OK && pos && np == 20, "kvc_positions");
    free(pos);
    kv_tree_store_close(s);
    KT_REQUIRE(kv_tree_store_open(st_dir, true, &s) == KV_OK, "reopen");
    int before = kv_tree_store_tree(s)->n_nodes;
    kv_errclear();
    kv_status st = kv_tree_store_put(s, sub, KV_TIER_DISK, 3, 1000, &pr);
    KT_CHECK(st == KV_E_DATA && strstr(kv_errdetail(), "positions"), "put of a subset: %d %s", st, kv_errdetail());
    KT_CHECK(kv_tree_store_tree(s)->n_nodes == before, "nothing added");
    kv_tree_store_close(s);
    kvc_close(sub);
    kvc_close(f);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
}

/* The version-1 store in tests/data/tree-v1 is read, and place upgrades it. */
static void test_reads_version_1_stores(void)
{
    char dir[] = "/tmp/test_tree_v1_XXXXXX", cmd[700], st_dir[600];
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(st_dir, sizeof st_dir, "%s/store", dir);
    snprintf(cmd, sizeof cmd, "cp -r tests/data/tree-v1/store '%s'", dir);
    KT_REQUIRE(system(cmd) == 0, "tests/data/tree-v1 not found (the tests run from the repository root)");
    kvc_file *a = NULL;
    KT_REQUIRE(kvc_open("tests/data/tree-v1/a.kvc", &a) == KV_OK, "a.kvc");
    int32_t *tok;
    int n;
    KT_REQUIRE(kvc_tokens(a, &tok, &n) == KV_OK, "tokens");
    kv_tree_store *s;
    KT_REQUIRE(kv_tree_store_open(st_dir, true, &s) == KV_OK, "open v1: %s", kv_errdetail());
    KT_CHECK(kv_tree_store_tree(s)->nodes[1].chunk_version == 1, "version-1 chunks");
    for (int pass = 0; pass < 2; pass++) {
        kv_check_report cr;
        KT_CHECK(kv_tree_store_check(s, &cr) == KV_OK && cr.n_problems == 0 && cr.chunks_ok == 3, "check pass %d: %s",
                 pass, cr.n_problems ? cr.problems[0] : "");
        kv_check_report_clear(&cr);
        kv_get_report r;
        kvc_file *out = NULL;
        KT_CHECK(kv_tree_store_get_kvc(s, tok, n, 1, false, 1, &out, &r) == KV_OK && r.matched == n, "get pass %d", pass);
        int ok = out != NULL;
        for (int l = 0; ok && l < kvc_geom(a)->n_layers; l++)
            ok = !memcmp(kvc_layer(out, l, "k")->data, kvc_layer(a, l, "k")->data, kvc_layer(a, l, "k")->nbytes) &&
                 !memcmp(kvc_layer(out, l, "v")->data, kvc_layer(a, l, "v")->data, kvc_layer(a, l, "v")->nbytes);
        KT_CHECK(ok, "pass %d: get returns the original K/V exactly", pass);
        kvc_close(out);
        if (pass == 0) {
            kv_place_report pr;
            KT_CHECK(kv_tree_store_place(s, 0, 1 << 20, 3600, 3, 1, &pr) == KV_OK && pr.reencoded == 3,
                     "place upgrades every chunk: %s", kv_errdetail());
            KT_CHECK(kv_tree_store_save(s) == KV_OK, "save");
        }
    }
    KT_CHECK(kv_tree_store_tree(s)->nodes[1].chunk_version == 2, "upgraded");
    kv_tree_store_close(s);
    free(tok);
    kvc_close(a);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
}

int main(void)
{
    seed = (unsigned long long)time(NULL) * 2654435761ull | 1;
    printf("# seed %llu\n", seed);
    KT_RUN(test_radix_matches_brute_force);
    KT_RUN(test_split_moves_children_under_a_new_head);
    KT_RUN(test_importance_is_attention_mass);
    KT_RUN(test_index_round_trip);
    KT_RUN(test_index_rejects_damage);
    KT_RUN(test_index_version_2_fields);
    KT_RUN(test_create_names_sketch_channels);
    KT_RUN(test_store_get_is_exact_after_random_puts);
    KT_RUN(test_important_reads_scale_with_frac);
    KT_RUN(test_chunk_rejects_damage);
    KT_RUN(test_chunk_version_3_holds_a_key_sketch);
    KT_RUN(test_put_refuses_positions);
    KT_RUN(test_frame_buffers_are_reused_and_shared_safely);
    KT_RUN(test_layered_load_equals_the_frame_load);
    KT_RUN(test_reads_version_1_stores);
    return kt_done();
}
