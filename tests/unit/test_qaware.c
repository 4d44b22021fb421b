/*
 * Query-aware loading of a stored prefix (lib/eval/kv_qaware, kv-tree
 * chunks of version 3 with a key sketch): a niah4k needle haystack is put
 * into a store without its question; a request that asks the question
 * loads 25% of the haystack chosen by its own queries, and those rows hold
 * the needle and give the answer the whole prompt gives (CPU, f32).  The
 * sketch itself is checked against the keys it stands for, and the store
 * stays consistent (kv_tree_store_check).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "kt_kv.h"
#include "common/kv_file.h"
#include "common/kv_half.h"
#include "engine/kv_runner.h"
#include "eval/kv_qaware.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"
#include "policy/kv_prefix.h"
#include "tree/kv_tree.h"


/* Greedy text of n tokens after a prefill that left its logits in lg. */
static void greedy_text(kv_runner *r, const kv_tokenizer *tok, float *lg, int V, int n, char *out, size_t cap)
{
    size_t o = 0;
    out[0] = 0;
    for (int i = 0, prev = 0; i < n; i++) {
        int t = kt_argmax(lg, V);
        size_t pl = 0;
        const char *p = kv_tokenizer_decode(tok, prev, t, &pl);
        if (p && o + pl + 1 < cap) memcpy(out + o, p, pl), o += pl, out[o] = 0;
        prev = t;
        if (i + 1 < n && kv_runner_step(r, t, lg)) break;
    }
}

static void test_query_aware_quarter_keeps_the_needle(void)
{
    char *text = NULL;
    size_t len = 0;
    OK(kv_file_slurp("tests/data/niah4k/tasks-dev.jsonl", 0, "tasks", &text, &len));
    cJSON *j = cJSON_ParseWithLength(text, strcspn(text, "\n"));
    KT_REQUIRE(j, "first task");
    const char *in = cJSON_GetObjectItem(j, "input")->valuestring;
    const char *ans = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "outputs"), 0)->valuestring;
    const char *qs = strstr(in, "\nQuestion:"), *nd = strstr(in, "The special magic number for");
    KT_REQUIRE(qs && nd && nd < qs, "task format");
    kv_model *m = NULL;
    OK(kv_model_open("tests/data/niah4k/niah4k.bin", &m));
    kv_tokenizer *tok;
    OK(kv_tokenizer_load_llama2c("tests/data/niah4k/tok259.bin", 259, &tok));
    int *ids = NULL, n = 0, *pids = NULL, np = 0, *nids = NULL, nn = 0;
    OK(kv_tokenizer_encode(tok, in, strlen(in), true, false, &ids, &n));
    OK(kv_tokenizer_encode(tok, in, (size_t)(qs - in), true, false, &pids, &np));
    OK(kv_tokenizer_encode(tok, in, (size_t)(nd - in), true, false, &nids, &nn));
    KT_REQUIRE(np < n && !memcmp(ids, pids, (size_t)np * sizeof *ids), "the haystack's ids begin the prompt's");
    const int V = m->cfg.vocab_size, needle = nn, needle_end = nn + 40;
    float *lg = malloc((size_t)V * sizeof *lg);
    kv_runner *r;
    OK(kv_runner_new(m, NULL, n + 8, KV_DEVICE_CPU, NULL, &r));
    char full[128], qa[128], imp[128];
    OK(kv_runner_prefill(r, ids, n, lg));
    greedy_text(r, tok, lg, V, 8, full, sizeof full);
    KT_CHECK(strstr(full, ans), "the whole prompt answers '%s' (got '%s')", ans, full);

    /* the haystack into a store whose disk chunks carry a key sketch */
    char dir[] = "/tmp/test_qaware_XXXXXX", sdir[600], kvp[700];
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(sdir, sizeof sdir, "%s/s", dir);
    snprintf(kvp, sizeof kvp, "%s/hay.kvc", dir);
    kv_tree_enc enc[KV_TIER_COUNT];
    OK(kv_tree_encodings_parse("disk=raw+zstd+sketch", enc));
    KT_CHECK(enc[KV_TIER_DISK].sketch && enc[KV_TIER_DISK].zstd, "+sketch parsed");
    OK(kv_tree_store_create_ex(sdir, enc));
    kv_tree_store *s;
    OK(kv_tree_store_open(sdir, true, &s));
    OK(kv_runner_reset(r, NULL));
    OK(kv_runner_keep(r, 32, true));
    OK(kv_runner_prefill(r, pids, np, NULL));
    OK(kv_runner_dump_kvc(r, pids, np, KV_DT_F16, kvp, 0));
    kvc_file *f;
    OK(kvc_open(kvp, &f));
    kv_put_report pr;
    OK(kv_tree_store_put(s, f, KV_TIER_DISK, 3, 1000, &pr));
    OK(kv_tree_store_save(s));
    KT_CHECK(kv_tree_store_tree(s)->nodes[1].chunk_version == 3, "a sketch chunk is version 3");

    /* the sketch stands for the keys: |code * scale - k| <= scale / 2 */
    int32_t *ids32 = malloc((size_t)n * sizeof *ids32);
    for (int i = 0; i < n; i++) ids32[i] = ids[i];
    kv_tree_sketch sk;
    OK(kv_tree_store_sketch(s, ids32, n - 1, &sk));
    KT_CHECK(sk.matched == np && sk.nseg == 1 && sk.seg[0].r == m->cfg.head_dim / 4, "sketch of %d rows, %d segments",
             sk.matched, sk.nseg);
    double worst = 0;
    const int Hkv = m->cfg.n_kv_heads, D = m->cfg.head_dim, r4 = sk.seg[0].r;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const kvc_tensor *kt = kvc_layer(f, l, "k");
        for (int h = 0; h < Hkv; h++)
            for (int t = 0; t < np; t += 7)
                for (int i = 0; i < r4; i++) {
                    size_t lh = (size_t)l * Hkv + h;
                    int c = sk.seg[0].ch[lh * r4 + i];
                    float sc = sk.seg[0].scale[lh * r4 + i];
                    float k = kv_half_to_f32(((const uint16_t *)kt->data)[((size_t)h * np + t) * D + c]);
                    double e = fabs(sk.seg[0].code[(lh * np + t) * r4 + i] * sc - k) - sc * 0.5001;
                    if (e > worst) worst = e;
                }
    }
    KT_CHECK(worst <= 0, "a sketch code is off by %g beyond half a step", worst);
    kv_tree_sketch_free(&sk);

    /* the question's own queries choose a quarter of the haystack */
    kv_qaware_opts qo = {0.25, KV_QAWARE_PROBE, KV_QAWARE_QUERIES, 0, false, 1001, NULL, false};
    kv_qaware_report qr;
    kv_tree_rows rows;
    OK(kv_runner_reset(r, NULL));
    OK(kv_qaware_load(r, s, ids, n, &qo, &rows, &qr));
    KT_CHECK(rows.T >= (int)ceil(0.25 * np) && rows.T <= (int)ceil(0.25 * np) + 32 && rows.matched == np,
             "kept %d of %d", rows.T, np);
    int hit = 0;
    for (int i = 0; i < rows.T; i++) hit += rows.positions[i] >= needle && rows.positions[i] < needle_end;
    KT_CHECK(hit == 40, "the needle's 40 tokens at %d: %d loaded", needle, hit);
    KT_CHECK(qr.row_bytes < pr.bytes_added / 2 && qr.sketch_bytes > 0, "read %llu + %llu sketch bytes of %llu",
             (unsigned long long)qr.row_bytes, (unsigned long long)qr.sketch_bytes, (unsigned long long)pr.bytes_added);
    kv_prefix pre = {.T = rows.T, .matched = rows.matched, .n_kv_heads = Hkv, .head_dim = D, .positions = rows.positions,
                     .tokens = rows.tokens, .dt = rows.dt, .k = (const void *const *)rows.k, .v = (const void *const *)rows.v};
    OK(kv_runner_prefill_from(r, &pre, ids + np, n - np, lg));
    greedy_text(r, tok, lg, V, 8, qa, sizeof qa);
    KT_CHECK(strstr(qa, ans), "query-aware 25%% answers '%s' (got '%s')", ans, qa);
    /* the sketch read before the probe instead of beside it: the same rows */
    kv_tree_rows rows2;
    kv_qaware_report qr2;
    qo.sketch_serial = true;
    OK(kv_runner_reset(r, NULL));
    OK(kv_qaware_load(r, s, ids, n, &qo, &rows2, &qr2));
    KT_CHECK(rows2.T == rows.T && !memcmp(rows2.positions, rows.positions, (size_t)rows.T * sizeof *rows.positions) &&
                 qr.sketch_spawn_ms > 0 && qr2.sketch_spawn_ms == 0 && qr2.sketch_wait_ms == 0,
             "serial read: %d rows (threaded %d), spawn %.3f / %.3f ms", rows2.T, rows.T, qr.sketch_spawn_ms,
             qr2.sketch_spawn_ms);
    kv_tree_rows_free(&rows2);
    kv_tree_rows_free(&rows);

    /* the put's importance at 25%, for the record (the needle is usually lost) */
    kv_get_report gr;
    OK(kv_tree_store_load(s, ids32, n - 1, 0.25, NULL, 0, false, 1002, &rows, &gr));
    hit = 0;
    for (int i = 0; i < rows.T; i++) hit += rows.positions[i] >= needle && rows.positions[i] < needle_end;
    pre = (kv_prefix){.T = rows.T, .matched = rows.matched, .n_kv_heads = Hkv, .head_dim = D, .positions = rows.positions,
                      .tokens = rows.tokens, .dt = rows.dt, .k = (const void *const *)rows.k, .v = (const void *const *)rows.v};
    OK(kv_runner_reset(r, NULL));
    OK(kv_runner_prefill_from(r, &pre, ids + np, n - np, lg));
    greedy_text(r, tok, lg, V, 8, imp, sizeof imp);
    printf("# full '%s'; query-aware 25%%: '%s' (%d rows, %llu+%llu bytes, probe %.1f ms, score %.1f ms); "
           "put importance 25%%: '%s' (%d rows, %d needle tokens)\n",
           full, qa, qr.kept, (unsigned long long)qr.sketch_bytes, (unsigned long long)qr.row_bytes, qr.probe_ms,
           qr.score_ms, imp, rows.T, hit);
    kv_tree_rows_free(&rows);

    kv_check_report cr;
    KT_CHECK(kv_tree_store_check(s, &cr) == KV_OK && cr.n_problems == 0, "check: %s", cr.n_problems ? cr.problems[0] : "");
    kv_check_report_clear(&cr);
    kv_tree_store_close(s);
    kvc_close(f);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
    kv_runner_free(r);
    free(ids32), free(lg), free(ids), free(pids), free(nids), free(text);
    cJSON_Delete(j);
    kv_tokenizer_free(tok);
    kv_model_close(m);
}

int main(void)
{
    KT_RUN(test_query_aware_quarter_keeps_the_needle);
    return kt_done();
}
