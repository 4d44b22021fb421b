/*
 * kv_qaware: query-aware loading of a stored prefix, after IMPRESS.  The
 * importance that a put records (attention from the prompt's own last
 * tokens) cannot know the question a later request asks after the shared
 * prefix, so loading only its top tokens drops what that question needs
 * (the needle).  Here the importance is decided at load time, with the new
 * request's queries:
 *   1. the key sketch of the matched prefix is read whole (kv-tree chunks
 *      of version 3: per layer and KV head the store's sketch_channels,
 *      by default half of the channels, int8; about 1/8 of the K/V
 *      bytes);
 *   2. the last tokens of the request (the question) are prefilled once
 *      after the prefix's first row (the attention sink), at their true
 *      positions, and their queries are kept;
 *   3. every prefix token is scored by the attention those queries give
 *      it over the sketched keys (softmax over the whole prefix per layer,
 *      query head and query), summed over each (layer, KV head)'s query
 *      group, then the largest of those (or their sum: kv_qaware_heads);
 *   4. each position's score is carried to the few positions after it
 *      (follow: where the question finds an answer starting, the tokens
 *      generated next read on), then the prefix is loaded in whole frames
 *      (the unit a chunk is read in): the first frame (sink) and the last
 *      (recent tokens) always, then the frames of highest score until frac
 *      of the prefix's tokens.
 * The runner is used for step 2 and left reset, its capture settings
 * (kv_runner_keep) those of the options.
 */
#ifndef KV_QAWARE_H
#define KV_QAWARE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/kv_runner.h"
#include "tree/kv_tree.h"

#define KV_QAWARE_PROBE 64  /* request tokens the probe prefills */
#define KV_QAWARE_QUERIES 4 /* of those, the last ones scored with */
#define KV_QAWARE_FOLLOW 8  /* positions after a scored one that take its score (kv_qaware_pick) */
#define KV_QAWARE_FOLLOW_MAX 4096

/* How a position's scores from the (layer, KV head) pairs combine. */
typedef enum {
    KV_QAWARE_MAX = 0, /* the largest (the default): a position one head retrieves is kept */
    KV_QAWARE_SUM = 1  /* their sum (before session 11): the heads that attend broadly outweigh the
                          few that retrieve (docs/BENCHMARKS.md, issue 11, session 11) */
} kv_qaware_heads;

typedef struct {
    double frac;    /* share of the prefix's tokens to load (0, 1] */
    int probe;      /* request tokens prefilled for their queries (KV_QAWARE_PROBE) */
    int queries;    /* of those, the last ones scored with (KV_QAWARE_QUERIES) */
    int keep_nq;    /* the runner's capture (kv_runner_keep) restored after the probe */
    bool keep_kv;
    int64_t now;
    const kv_tree_alloc *al; /* the rows' block (NULL: malloc) */
    bool sketch_serial; /* read the key sketch before the probe instead of on a second thread
                           beside it (measurement: which is faster depends on the machine) */
    kv_qaware_heads heads; /* step 3's combination (0: KV_QAWARE_MAX) */
    int follow;            /* step 4's positions after a scored one (0: KV_QAWARE_FOLLOW; < 0: none) */
    const kv_tree_alloc *sketch_al; /* the sketch's codes (NULL: malloc; pinned memory makes a GPU
                                       scoring's upload run at full PCIe speed): alloc is called on the
                                       read's thread, free on either (the read is joined before) */
} kv_qaware_opts;

typedef struct {
    int matched, kept;
    double sketch_ms, probe_ms, score_ms, load_ms;
    double probe_sink_ms, probe_prefill_ms, probe_reset_ms; /* of probe_ms: the sink row's load, the
                                                              64-token prefill, the runner's reset */
    double score_upload_ms; /* of score_ms on the GPU: the folded queries copied to the device and
                               the wait for the codes' copy, issued by the sketch's read
                               (sketch_stage_ms) while the probe ran (0 on the CPU) */
    double sketch_stage_ms; /* of sketch_ms, on the GPU: issuing the codes' copy (kv_qaware_gpu_stage) */
    bool score_gpu;         /* the scores were computed on the GPU (kv_qaware_score_gpu) */
    double sketch_spawn_ms; /* of probe_prefill_ms: starting the sketch read's thread */
    double sketch_wait_ms; /* of the total: the wait for the sketch read after the probe (the read
                              runs beside the probe on a second thread; sketch_ms is its own time) */
    double probe_pf[5];    /* the probe prefill's phases on the GPU engine (kv_gpu_prefill_phases), else 0 */
    uint64_t sketch_bytes, row_bytes; /* read from the store (every tier) */
} kv_qaware_report;

/*
 * The rows of the longest cached prefix of tok[0..n-1) (the last token is
 * always prefilled) chosen by the request's own queries; rows->T == 0 on a
 * miss.  r: fresh or reset; it is reset again before returning.  A chunk
 * without a key sketch is KV_E_UNSUPPORTED.
 */
kv_status kv_qaware_load(kv_runner *r, kv_tree_store *s, const int *tok, int n, const kv_qaware_opts *o,
                         kv_tree_rows *rows, kv_qaware_report *rep);
/* The same with the rows read beside the caller (pend non-NULL): the last
 * step is kv_tree_store_load_start with `threads` threads, so rows has its
 * positions and tokens but its K/V arrive layer by layer (kv_tree_rows_wait,
 * kv_prefix.wait); kv_tree_load_finish(*pend, ...) ends it and gives the
 * rows' bytes (rep->row_bytes stays 0; rep->load_ms is the start's time).
 * *pend is NULL on a miss and on failure. */
kv_status kv_qaware_load_start(kv_runner *r, kv_tree_store *s, const int *tok, int n, const kv_qaware_opts *o,
                               int threads, kv_tree_rows *rows, kv_qaware_report *rep, kv_tree_pending **pend);

/*
 * Step 3 on the host, the reference the GPU's kv_qaware_score_gpu is
 * tested against.  For t over sk->matched positions and each layer l and KV
 * head h, a(l, h, t) = the attention the request's queries of h's query
 * heads give position t over the sketched keys, summed over those heads and
 * queries (each query's softmax is over the whole prefix); then
 * KV_QAWARE_SUM: score[t] += the sum of a over (l, h), KV_QAWARE_MAX:
 * score[t] = max(score[t], the largest a).  q: (L, H, nq, D) float, the last nq queries of every layer and
 * query head; a query head h*g..h*g+g-1 (g = H/Hkv) reads KV head h.  The
 * query is folded with each segment's kept channels and scales,
 * qs[i] = q[ch[i]] * scale[i] / sqrt(D), and dotted with the int8 codes in
 * float; the softmax uses an exponential good to about 1e-5 relative.
 * The segments must tile [0, matched) in order.  KV_E_NOMEM without
 * memory (score then unchanged).
 */
kv_status kv_qaware_score_cpu(const kv_tree_sketch *sk, const float *q, int L, int H, int Hkv, int nq, int D,
                              kv_qaware_heads how, double *score);

/*
 * Step 4: the positions to load for scores score (sk->matched), in whole
 * frames until at least ceil(frac * matched) positions are taken.  Each
 * position's score becomes the largest of its own and the follow positions
 * before it (0: its own); then first the first frame of the first segment
 * and the last of the last, then frames by decreasing sum of those scores
 * (ties: the earlier frame).  pick (room for sk->matched): the positions,
 * increasing; *np their count.
 */
kv_status kv_qaware_pick(const kv_tree_sketch *sk, const double *score, double frac, int follow, int32_t *pick,
                         int *np);
/* Step 4's window: out[t] = the largest of score[t - follow .. t] (those
 * at or above 0) for t < m, in O(m); follow < 0 is 0.  KV_E_NOMEM. */
kv_status kv_qaware_follow(const double *score, int m, int follow, double *out);

#endif
