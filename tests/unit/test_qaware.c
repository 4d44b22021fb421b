/*
 * Query-aware loading of a stored prefix (lib/eval/kv_qaware, kv-tree
 * chunks of version 3 with a key sketch): a niah4k needle haystack is put
 * into a store without its question; a request that asks the question
 * loads 25% of the haystack chosen by its own queries, and those rows hold
 * the needle and give the answer the whole prompt gives (CPU, f32).  The
 * sketch itself is checked against the keys it stands for, and the store
 * stays consistent (kv_tree_store_check).  The scoring step on its own
 * (kv_qaware_score_cpu, the GPU's reference) is checked against a direct
 * double-precision computation on a small hand-made sketch, and the frame
 * pick (kv_qaware_pick) on scores whose answer is known.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fcntl.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kt_kv.h"
#include "kt_qaware.h"
#include "common/kv_file.h"
#include "common/kv_half.h"
#include "engine/kv_runner.h"
#include "eval/kv_qaware.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"
#include "policy/kv_prefix.h"
#include "tree/kv_tree.h"


/* A counting allocator (kv_tree_alloc) over malloc. */
typedef struct {
    int allocs, frees;
} kt_count_alloc;

static void *kt_count_alloc_fn(void *user, size_t n)
{
    ((kt_count_alloc *)user)->allocs++;
    return malloc(n);
}

static void kt_count_free_fn(void *user, void *p)
{
    ((kt_count_alloc *)user)->frees++;
    free(p);
}

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

/* The store's sketch_channels: the haystack's dump put into stores asking
 * for a quarter of the channels (not the default half) and for more than head_dim, the setting kept in
 * the index, values out of range refused. */
static void sketch_channels_follow_the_store(kvc_file *f, const char *dir, const int32_t *ids, int n, int D)
{
    const int want[2] = {D / 4, 4096}, got[2] = {D / 4, D};
    for (int c = 0; c < 2; c++) {
        char sdir[700];
        snprintf(sdir, sizeof sdir, "%s/ch%d", dir, c);
        kv_tree_enc enc[KV_TIER_COUNT];
        OK(kv_tree_encodings_parse("disk=raw+sketch", enc));
        OK(kv_tree_store_create_ex(sdir, enc));
        kv_tree_store *s;
        OK(kv_tree_store_open(sdir, true, &s));
        KT_CHECK(kv_tree_store_set_sketch_channels(s, -1) == KV_E_USAGE, "-1 channels refused");
        KT_CHECK(kv_tree_store_set_sketch_channels(s, 4097) == KV_E_USAGE, "4097 channels refused");
        KT_CHECK(kv_tree_store_tree(s)->sketch_channels == 0, "a refused value changes nothing");
        OK(kv_tree_store_set_sketch_channels(s, want[c]));
        kv_put_report pr;
        OK(kv_tree_store_put(s, f, KV_TIER_DISK, 0, 1000, &pr));
        OK(kv_tree_store_save(s));
        kv_tree_store_close(s);
        OK(kv_tree_store_open(sdir, false, &s));
        KT_CHECK(kv_tree_store_tree(s)->sketch_channels == want[c], "the index keeps %d channels (read %d)", want[c],
                 kv_tree_store_tree(s)->sketch_channels);
        kv_tree_sketch sk;
        OK(kv_tree_store_sketch(s, ids, n - 1, &sk));
        KT_CHECK(sk.nseg == 1 && sk.seg[0].r == got[c], "asked %d channels of %d: the sketch has %d", want[c], D,
                 sk.nseg ? sk.seg[0].r : -1);
        kv_tree_sketch_free(&sk);
        kv_tree_store_close(s);
    }
}

static void test_query_aware_quarter_keeps_the_needle(void)
{
    kt_qaware_task task;
    kt_qaware_task_load(&task);
    KT_REQUIRE(task.ok, "niah4k's first task");
    kv_model *m = task.m;
    kv_tokenizer *tok = task.tok;
    const int *ids = task.ids, n = task.n, np = task.np, nn = task.nn;
    const char *ans = task.ans;
    const int V = m->cfg.vocab_size, needle = nn, needle_end = nn + 40;
    float *lg = malloc((size_t)V * sizeof *lg);
    kv_runner *r;
    OK(kv_runner_new(m, NULL, n + 8, KV_DEVICE_CPU, NULL, &r));
    char full[128], qa[128], imp[128];
    OK(kv_runner_prefill(r, ids, n, lg));
    greedy_text(r, tok, lg, V, 8, full, sizeof full);
    KT_CHECK(strstr(full, ans), "the whole prompt answers '%s' (got '%s')", ans, full);

    /* the haystack into a store whose disk chunks carry a key sketch */
    char dir[] = "/tmp/test_qaware_XXXXXX";
    kv_tree_enc enc[KV_TIER_COUNT];
    OK(kv_tree_encodings_parse("disk=raw+zstd+sketch", enc));
    KT_CHECK(enc[KV_TIER_DISK].sketch && enc[KV_TIER_DISK].zstd, "+sketch parsed");
    kv_tree_store *s;
    kvc_file *f;
    kv_put_report pr;
    bool stored;
    OK(kv_runner_reset(r, NULL));
    kt_qaware_store(r, &task, "disk=raw+zstd+sketch", dir, &s, &f, &pr, &stored);
    KT_REQUIRE(stored, "the haystack stored");
    OK(kv_tree_store_save(s));
    KT_CHECK(kv_tree_store_tree(s)->nodes[1].chunk_version == 3, "a sketch chunk is version 3");

    /* the sketch stands for the keys: |code * scale - k| <= scale / 2 */
    int32_t *ids32 = malloc((size_t)n * sizeof *ids32);
    for (int i = 0; i < n; i++) ids32[i] = ids[i];
    kv_tree_sketch sk;
    OK(kv_tree_store_sketch(s, ids32, n - 1, &sk));
    KT_CHECK(sk.matched == np && sk.nseg == 1 && sk.seg[0].r == m->cfg.head_dim / 2, "sketch of %d rows, %d segments",
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
    /* the codes are read in slices of 256 KiB, each checksummed on its own
     * thread and combined: this sketch spans several, and a read through a
     * caller's allocator gives the same bytes from its blocks, freed there */
    const size_t code_bytes = (size_t)m->cfg.n_layers * Hkv * r4 * np;
    KT_CHECK(code_bytes > (256u << 10), "the sketch's %zu code bytes span two slices or more", code_bytes);
    kt_count_alloc ca = {0, 0};
    const kv_tree_alloc al = {kt_count_alloc_fn, kt_count_free_fn, &ca};
    kv_tree_sketch sk2;
    OK(kv_tree_store_sketch_ex(s, ids32, n - 1, &al, &sk2));
    KT_CHECK(sk2.nseg == 1 && ca.allocs == 1 && !memcmp(sk2.seg[0].code, sk.seg[0].code, code_bytes),
             "the allocator's sketch: %d segments, %d blocks, the same codes", sk2.nseg, ca.allocs);
    kv_tree_sketch_free(&sk2);
    KT_CHECK(ca.frees == 1, "its block freed through it (%d)", ca.frees);
    kv_tree_sketch_free(&sk);
    /* a byte of the last slice of codes (they end where frame 0 starts:
     * kvc(5), the frame table after the 88-byte head and 12 bytes a row)
     * flipped: the combined checksum finds it; flipped back, all reads */
    {
        const kv_tree_node *nd = &kv_tree_store_tree(s)->nodes[1];
        char cp[1400];
        snprintf(cp, sizeof cp, "%s/s/%s", dir, nd->file);
        int fd = open(cp, O_RDWR);
        uint64_t f0 = 0;
        unsigned char byte = 0;
        KT_REQUIRE(fd >= 0 && pread(fd, &f0, 8, 88 + 12 * (off_t)nd->n) == 8 && f0 > 100 &&
                       pread(fd, &byte, 1, (off_t)f0 - 100) == 1, "chunk %s", cp);
        byte ^= 0x40;
        KT_REQUIRE(pwrite(fd, &byte, 1, (off_t)f0 - 100) == 1, "damage");
        kv_tree_sketch bad_sk;
        kv_status dst = kv_tree_store_sketch(s, ids32, n - 1, &bad_sk);
        KT_CHECK(dst == KV_E_DATA && strstr(kv_errdetail(), "checksum mismatch in the key sketch"),
                 "a damaged last slice: status %d, %s", dst, kv_errdetail());
        kv_errclear();
        byte ^= 0x40;
        KT_REQUIRE(pwrite(fd, &byte, 1, (off_t)f0 - 100) == 1, "repair");
        close(fd);
        OK(kv_tree_store_sketch(s, ids32, n - 1, &bad_sk));
        kv_tree_sketch_free(&bad_sk);
    }

    /* the question's own queries choose a quarter of the haystack */
    kv_qaware_opts qo = {0.25, KV_QAWARE_PROBE, KV_QAWARE_QUERIES, 0, false, 1001, NULL, false, KV_QAWARE_MAX, 0, NULL};
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
    sketch_channels_follow_the_store(f, dir, ids32, np + 1, D);
    kvc_close(f);
    KT_CHECK(kt_rm_rf(dir) == 0, "cleanup");
    kv_runner_free(r);
    free(ids32), free(lg);
    kt_qaware_task_free(&task);
}

/* A sketch of two segments over m = 5 positions for L 2, Hkv 2, D 8: the
 * first of r 3 channels, 3 rows matched of 4 stored (the stride), the
 * second of r 2 channels, 2 of 2; frames of 2 rows. */
enum { SL = 2, SH = 4, SKV = 2, SNQ = 2, SD = 8, SM = 5 };

static void small_sketch(kv_tree_sketch *sk, kv_tree_sketch_seg *seg, uint16_t ch[2][SL * SKV * 3],
                         float sc[2][SL * SKV * 3], int8_t code[2][SL * SKV * 4 * 3])
{
    static const int start[2] = {0, 3}, n[2] = {3, 2}, rows[2] = {4, 2}, r[2] = {3, 2};
    unsigned long long rs = 7;
    for (int s = 0; s < 2; s++) {
        for (int lh = 0; lh < SL * SKV; lh++) {
            int c = (int)(kt_rand(&rs) * 3); /* increasing channels in [0, 8) */
            for (int i = 0; i < r[s]; i++, c += 1 + (int)(kt_rand(&rs) * 2)) {
                ch[s][lh * r[s] + i] = (uint16_t)c;
                sc[s][lh * r[s] + i] = 0.01f + 0.04f * (float)kt_rand(&rs);
            }
            for (int t = 0; t < rows[s]; t++)
                for (int i = 0; i < r[s]; i++)
                    code[s][(lh * rows[s] + t) * r[s] + i] = (int8_t)(-127 + (int)(kt_rand(&rs) * 255));
        }
        seg[s] = (kv_tree_sketch_seg){start[s], n[s], rows[s], r[s], 2, ch[s], sc[s], code[s]};
    }
    memset(sk, 0, sizeof *sk);
    sk->matched = SM, sk->nseg = 2, sk->seg = seg;
}

static void test_score_cpu_matches_a_direct_double_computation(void)
{
    kv_tree_sketch sk;
    kv_tree_sketch_seg seg[2];
    uint16_t ch[2][SL * SKV * 3];
    float sc[2][SL * SKV * 3];
    int8_t code[2][SL * SKV * 4 * 3];
    small_sketch(&sk, seg, ch, sc, code);
    float q[SL * SH * SNQ * SD]; /* (L, H, nq, D) */
    unsigned long long rs = 11;
    for (int i = 0; i < SL * SH * SNQ * SD; i++) q[i] = 3 * kt_randn(&rs);
    /* the definition: per layer, query head and query, a softmax over the
     * five positions of q[ch] * scale * code / sqrt(D), summed per (layer,
     * KV head) into pair[lh]; KV_QAWARE_SUM adds them, KV_QAWARE_MAX takes the
     * largest */
    double want[SM] = {0}, pair[SL * SKV][SM] = {{0}};
    for (int l = 0; l < SL; l++)
        for (int hq = 0; hq < SH; hq++)
            for (int k = 0; k < SNQ; k++) {
                const int lh = l * SKV + hq / (SH / SKV);
                const float *qv = q + ((l * SH + hq) * SNQ + k) * SD;
                double x[SM], mx = -INFINITY, sum = 0;
                for (int s = 0; s < 2; s++)
                    for (int t = 0; t < seg[s].n; t++) {
                        double a = 0;
                        for (int i = 0; i < seg[s].r; i++)
                            a += (double)qv[seg[s].ch[lh * seg[s].r + i]] * seg[s].scale[lh * seg[s].r + i] *
                                 seg[s].code[(lh * seg[s].rows + t) * seg[s].r + i];
                        x[seg[s].start + t] = a / sqrt((double)SD);
                        if (x[seg[s].start + t] > mx) mx = x[seg[s].start + t];
                    }
                for (int t = 0; t < SM; t++) sum += exp(x[t] - mx);
                for (int t = 0; t < SM; t++) want[t] += exp(x[t] - mx) / sum, pair[lh][t] += exp(x[t] - mx) / sum;
            }
    double got[SM] = {1, 1, 1, 1, 1}, total = 0; /* added to */
    OK(kv_qaware_score_cpu(&sk, q, SL, SH, SKV, SNQ, SD, KV_QAWARE_SUM, got));
    for (int t = 0; t < SM; t++) {
        KT_CHECK(fabs(got[t] - 1 - want[t]) <= 1e-5 * want[t] + 1e-7, "position %d: %.9g, want %.9g", t, got[t] - 1,
                 want[t]);
        total += got[t] - 1;
    }
    /* every softmax sums to one: L * H * nq of them */
    KT_NEAR(total, SL * SH * SNQ, 1e-4);
    double spread = 0;
    for (int t = 1; t < SM; t++) spread += fabs(want[t] - want[0]);
    KT_CHECK(spread > 0.1, "the case is not degenerate (spread %g)", spread);
    /* the largest pair's; a score already above it stays (position 2) */
    double mxs[SM] = {0, 0, 50, 0, 0};
    OK(kv_qaware_score_cpu(&sk, q, SL, SH, SKV, SNQ, SD, KV_QAWARE_MAX, mxs));
    for (int t = 0; t < SM; t++) {
        double w = 0;
        for (int lh = 0; lh < SL * SKV; lh++) w = pair[lh][t] > w ? pair[lh][t] : w;
        if (t == 2) w = 50;
        KT_CHECK(fabs(mxs[t] - w) <= 1e-5 * w + 1e-7, "max, position %d: %.9g, want %.9g", t, mxs[t], w);
    }
}

static void test_pick_takes_the_edge_frames_then_the_best(void)
{
    /* frames of 2: segment 0 is [0 1][2 3][4 5], segment 1 [6 7][8 9][10] */
    kv_tree_sketch_seg seg[2] = {{0, 6, 6, 1, 2, NULL, NULL, NULL}, {6, 5, 8, 1, 2, NULL, NULL, NULL}};
    kv_tree_sketch sk = {.matched = 11, .nseg = 2, .seg = seg};
    const double score[11] = {0, 0, 0.5, 0.5, 5, 5, 2, 0.5, 0.2, 0.1, 0};
    int32_t pick[11];
    int np = -1;
    OK(kv_qaware_pick(&sk, score, 0.6, 0, pick, &np)); /* 7 of 11: the edges (3), [4 5], [6 7] */
    const int32_t want[7] = {0, 1, 4, 5, 6, 7, 10};
    KT_CHECK(np == 7 && !memcmp(pick, want, sizeof want), "%d picked: %d %d %d %d %d %d %d", np, pick[0], pick[1],
             pick[2], pick[3], pick[4], pick[5], pick[6]);
    OK(kv_qaware_pick(&sk, score, 0.01, 0, pick, &np)); /* a whole frame, the first, below the share */
    KT_CHECK(np == 2 && pick[0] == 0 && pick[1] == 1, "%d picked", np);
    OK(kv_qaware_pick(&sk, score, 1, 0, pick, &np));
    KT_CHECK(np == 11 && pick[10] == 10, "%d picked", np);
    /* 9 of 11: on their own scores [6 7] (2.5) then [2 3] (1) beat [8 9] (0.3) ... */
    const int32_t own[9] = {0, 1, 2, 3, 4, 5, 6, 7, 10}, fol[9] = {0, 1, 4, 5, 6, 7, 8, 9, 10};
    OK(kv_qaware_pick(&sk, score, 0.8, 0, pick, &np));
    KT_CHECK(np == 9 && !memcmp(pick, own, sizeof own), "follow 0: %d picked, third frame at %d", np, pick[2]);
    /* ... but when each position takes the largest score of itself and the
     * 2 before it, [6 7] (5, 5: across the segments' seam) and [8 9] (2,
     * 0.5) follow the peak at [4 5], and [2 3] (0.5, 0.5) is left */
    OK(kv_qaware_pick(&sk, score, 0.8, 2, pick, &np));
    KT_CHECK(np == 9 && !memcmp(pick, fol, sizeof fol), "follow 2: %d picked, third frame at %d", np, pick[2]);
    /* the window against its definition on random scores: picking with
     * follow f equals picking the scores max(score[t - f .. t]) with none */
    enum { RM = 500 };
    kv_tree_sketch_seg rseg[2] = {{0, 300, 320, 1, 32, NULL, NULL, NULL}, {300, 200, 200, 1, 16, NULL, NULL, NULL}};
    kv_tree_sketch rsk = {.matched = RM, .nseg = 2, .seg = rseg};
    static double rs_score[RM], rs_win[RM];
    static int32_t pa[RM], pb[RM];
    unsigned long long rs = 5;
    int bad = 0;
    for (int trial = 0; trial < 40; trial++) {
        const int f = trial % 5 == 0 ? 0 : (int)(kt_rand(&rs) * 70);
        for (int t = 0; t < RM; t++) rs_score[t] = kt_rand(&rs) < 0.05 ? 10 * kt_rand(&rs) : kt_rand(&rs);
        for (int t = 0; t < RM; t++) {
            rs_win[t] = rs_score[t];
            for (int k = 1; k <= f && k <= t; k++) rs_win[t] = rs_score[t - k] > rs_win[t] ? rs_score[t - k] : rs_win[t];
        }
        static double got_win[RM];
        OK(kv_qaware_follow(rs_score, RM, f, got_win));
        bad += memcmp(got_win, rs_win, sizeof rs_win) != 0;
        int na = 0, nb = 0;
        OK(kv_qaware_pick(&rsk, rs_score, 0.3, f, pa, &na));
        OK(kv_qaware_pick(&rsk, rs_win, 0.3, 0, pb, &nb));
        bad += na != nb || memcmp(pa, pb, (size_t)na * sizeof *pa);
    }
    KT_CHECK(bad == 0, "%d of 40 random windows differ from their definition or pick otherwise", bad);
    /* edges: a window past m, and m of 1 and 0 */
    static double edge[RM];
    OK(kv_qaware_follow(rs_score, RM, 1 << 30, edge));
    double run = 0;
    for (int t = 0; t < RM; t++) {
        run = rs_score[t] > run ? rs_score[t] : run;
        bad += edge[t] != run;
    }
    OK(kv_qaware_follow(rs_score, 1, 5, edge));
    OK(kv_qaware_follow(rs_score, 0, 5, edge));
    KT_CHECK(bad == 0 && edge[0] == rs_score[0], "a window past m is the running max (%d off)", bad);
    OK(kv_qaware_pick(&sk, score, 0.8, -3, pick, &np)); /* below 0: none */
    KT_CHECK(np == 9 && !memcmp(pick, own, sizeof own), "follow -3: as 0");
}

int main(void)
{
    KT_RUN(test_score_cpu_matches_a_direct_double_computation);
    KT_RUN(test_pick_takes_the_edge_frames_then_the_best);
    KT_RUN(test_query_aware_quarter_keeps_the_needle);
    return kt_done();
}
