/*
 * Continuing from a stored cache (kv_engine_prefill_from, lib/policy/kv_prefix):
 * dumping the first N tokens of a prompt and continuing with the rest gives
 * exactly (bit for bit) the logits and greedy tokens of the whole prompt on
 * the CPU with f32 `full`, on stories260K and on niah4k at 1k tokens; a
 * cache from another geometry is refused with KV_E_DATA; a positions
 * subset continues at the original positions.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt_kv.h"
#include "engine/kv_engine.h"
#include "format/kvc.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"
#include "policy/kv_prefix.h"


/* Whole prompt vs the first `split` tokens dumped then continued: logits of
 * the prefill and of `steps` greedy steps must be identical. */
static void roundtrip(const char *model, const int *ids, int n, int split, int steps, const char *tmp)
{
    kv_model *m = NULL;
    OK(kv_model_open(model, &m));
    const int V = m->cfg.vocab_size;
    /* a: the whole prompt's logits after the prefill and after each step */
    float *a = malloc((size_t)(steps + 1) * V * sizeof *a), *b = malloc((size_t)V * sizeof *b);
    int *ta = malloc((size_t)steps * sizeof *ta), *tb = malloc((size_t)steps * sizeof *tb);
    KT_REQUIRE(a && b && ta && tb, "memory");
    kv_engine *e;
    OK(kv_engine_new(m, NULL, n + steps, &e));
    OK(kv_engine_prefill(e, ids, n, a));
    for (int i = 0; i < steps; i++) {
        ta[i] = kt_argmax(a + (size_t)i * V, V);
        OK(kv_engine_step(e, ta[i], a + (size_t)(i + 1) * V));
    }
    OK(kv_engine_reset(e, NULL));
    OK(kv_engine_keep(e, 8, true));
    OK(kv_engine_prefill(e, ids, split, NULL));
    OK(kv_engine_dump_kvc(e, ids, split, KV_DT_F32, tmp, 0));
    kv_engine_free(e);

    kvc_file *f;
    OK(kvc_open(tmp, &f));
    kv_prefix pre;
    OK(kv_prefix_from_kvc(m, f, &pre));
    KT_CHECK(pre.T == split && pre.matched == split && !pre.positions, "prefix T %d matched %d", pre.T, pre.matched);
    OK(kv_engine_new(m, NULL, n + steps, &e));
    OK(kv_engine_prefill_from(e, &pre, ids + split, n - split, b));
    KT_CHECK(kv_engine_pos(e) == n, "pos %d after the continuation, want %d", kv_engine_pos(e), n);
    float d = 0;
    int mism = -1;
    for (int i = 0; i < steps; i++) {
        for (int j = 0; j < V; j++) d = fmaxf(d, fabsf(a[(size_t)i * V + j] - b[j]));
        tb[i] = kt_argmax(b, V);
        if (tb[i] != ta[i] && mism < 0) mism = i;
        OK(kv_engine_step(e, tb[i], b));
    }
    KT_CHECK(d == 0, "continued logits differ from the whole prompt's by %g", d);
    KT_CHECK(mism < 0, "greedy tokens differ from step %d", mism);
    for (int j = 0; j < V; j++) d = fmaxf(d, fabsf(a[(size_t)steps * V + j] - b[j]));
    KT_CHECK(d == 0, "last logits differ by %g", d);
    kv_engine_free(e);
    kvc_close(f);
    unlink(tmp);
    free(a), free(b), free(ta), free(tb);
    kv_model_close(m);
}

static void test_stories260k_dump_then_continue_equals_whole_prompt(void)
{
    int ids[40];
    unsigned long long s = 7;
    ids[0] = 1;
    for (int i = 1; i < 40; i++) ids[i] = 3 + (int)(kt_rand(&s) * 500);
    roundtrip("tests/data/stories260K/stories260K.bin", ids, 40, 17, 12, "/tmp/test_prefix_a.kvc");
    /* a split that is not a chunk multiple, after more than one chunk */
    int *big = malloc(300 * sizeof *big);
    KT_REQUIRE(big, "memory");
    big[0] = 1;
    for (int i = 1; i < 300; i++) big[i] = 3 + (int)(kt_rand(&s) * 500);
    roundtrip("tests/data/stories260K/stories260K.bin", big, 300, 203, 6, "/tmp/test_prefix_b.kvc");
    free(big);
}

static void test_niah4k_1k_task_dump_then_continue_equals_whole_prompt(void)
{
    FILE *fp = fopen("tests/data/niah4k/tasks-dev.jsonl", "r");
    KT_REQUIRE(fp, "tasks-dev.jsonl");
    char *line = NULL;
    size_t cap = 0;
    KT_REQUIRE(getline(&line, &cap, fp) > 0, "first task");
    fclose(fp);
    /* the prompt text between "input": " and the next ", "outputs" */
    char *p = strstr(line, "\"input\": \""), *q = p ? strstr(p, "\", \"outputs\"") : NULL;
    KT_REQUIRE(p && q, "task format");
    p += 10;
    kv_tokenizer *tok;
    OK(kv_tokenizer_load_llama2c("tests/data/niah4k/tok259.bin", 259, &tok));
    int *ids = NULL, n = 0;
    OK(kv_tokenizer_encode(tok, p, (size_t)(q - p), true, false, &ids, &n));
    KT_CHECK(n > 900, "%d tokens", n);
    roundtrip("tests/data/niah4k/niah4k.bin", ids, n, n * 9 / 10, 8, "/tmp/test_prefix_c.kvc");
    free(ids);
    free(line);
    kv_tokenizer_free(tok);
}

static void test_a_cache_of_another_geometry_is_refused(void)
{
    kv_model *m = NULL;
    OK(kv_model_open("tests/data/stories260K/stories260K.bin", &m));
    kv_geom g;
    kv_model_geom(m, &g);
    KT_CHECK(kv_prefix_check_model(m, &g) == KV_OK, "own geometry: %s", kv_errdetail());
    kv_geom x = g;
    x.n_kv_heads *= 2;
    KT_CHECK(kv_prefix_check_model(m, &x) == KV_E_DATA && strstr(kv_errdetail(), "KV heads"), "%s", kv_errdetail());
    x = g;
    x.rope_theta = 500000;
    KT_CHECK(kv_prefix_check_model(m, &x) == KV_E_DATA && strstr(kv_errdetail(), "rope_theta"), "%s", kv_errdetail());
    x = g;
    snprintf(x.model, sizeof x.model, "niah4k");
    KT_CHECK(kv_prefix_check_model(m, &x) == KV_E_DATA && strstr(kv_errdetail(), "niah4k"), "%s", kv_errdetail());
    x = g;
    x.rope_layout = KV_ROPE_HALVES;
    KT_CHECK(kv_prefix_check_model(m, &x) == KV_E_DATA, "halves accepted");
    x = g;
    x.model[0] = 0; /* no name: geometry alone decides */
    KT_CHECK(kv_prefix_check_model(m, &x) == KV_OK, "%s", kv_errdetail());
    kv_model_close(m);
}

/* A memory prefix holding rows 0..P-1 of a whole prompt minus some rows,
 * with their positions: the continuation's RoPE starts at `matched`, so
 * keeping every row but declaring positions 0..P-1 and matched P equals
 * the plain continuation, and dropping rows changes the logits only a
 * little (the cache lost tokens, not positions). */
static void test_positions_subset_continues_at_the_original_positions(void)
{
    kv_model *m = NULL;
    OK(kv_model_open("tests/data/stories260K/stories260K.bin", &m));
    const kv_model_config *c = &m->cfg;
    const int n = 48, P = 40, V = c->vocab_size, L = c->n_layers, nkv = c->n_kv_heads, hd = c->head_dim;
    int ids[48];
    unsigned long long s = 11;
    ids[0] = 1;
    for (int i = 1; i < n; i++) ids[i] = 3 + (int)(kt_rand(&s) * 500);
    kv_engine *e;
    float *a = malloc((size_t)V * 4), *b = malloc((size_t)V * 4);
    OK(kv_engine_new(m, NULL, 64, &e));
    OK(kv_engine_keep(e, 0, true));
    OK(kv_engine_prefill(e, ids, P, NULL));
    /* rows kept: every third row dropped, except the last */
    float **k = calloc((size_t)L, sizeof *k), **v = calloc((size_t)L, sizeof *v);
    int32_t pos[40];
    int T = 0;
    for (int t = 0; t < P; t++)
        if (t % 3 != 1 || t == P - 1) pos[T++] = t;
    for (int l = 0; l < L; l++) {
        int TT;
        const float *pk = kv_engine_prompt_kv(e, l, 'k', &TT), *pv = kv_engine_prompt_kv(e, l, 'v', &TT);
        k[l] = malloc((size_t)nkv * T * hd * 4), v[l] = malloc((size_t)nkv * T * hd * 4);
        for (int h = 0; h < nkv; h++)
            for (int r = 0; r < T; r++) {
                memcpy(k[l] + ((size_t)h * T + r) * hd, pk + ((size_t)h * P + pos[r]) * hd, (size_t)hd * 4);
                memcpy(v[l] + ((size_t)h * T + r) * hd, pv + ((size_t)h * P + pos[r]) * hd, (size_t)hd * 4);
            }
    }
    OK(kv_engine_reset(e, NULL));
    OK(kv_engine_prefill(e, ids, n, a));
    kv_prefix pre = {.T = T, .matched = P, .positions = pos, .n_kv_heads = nkv, .head_dim = hd, .dt = KV_DT_F32,
                     .k = (const void *const *)k, .v = (const void *const *)v};
    OK(kv_engine_reset(e, NULL));
    OK(kv_engine_prefill_from(e, &pre, ids + P, n - P, b));
    KT_CHECK(kv_engine_rope_off(e) == P - T, "rope offset %d, want %d", kv_engine_rope_off(e), P - T);
    KT_CHECK(kv_engine_pos(e) == T + n - P, "rows %d", kv_engine_pos(e));
    double d = 0, na = 0;
    for (int j = 0; j < V; j++) d += (a[j] - b[j]) * (a[j] - b[j]), na += a[j] * a[j];
    KT_CHECK(d > 0 && sqrt(d / na) < 0.5, "subset logits: normalized error %g", sqrt(d / na));
    /* the same rows read as positions 0..T-1 and continued at T would be wrong by more */
    kv_prefix bad = pre;
    bad.positions = NULL, bad.matched = T;
    float *w = malloc((size_t)V * 4);
    OK(kv_engine_reset(e, NULL));
    OK(kv_engine_prefill_from(e, &bad, ids + P, n - P, w));
    double dw = 0;
    for (int j = 0; j < V; j++) dw += (a[j] - w[j]) * (a[j] - w[j]);
    KT_CHECK(dw > d, "positions ignored: error %g, honoured %g", sqrt(dw / na), sqrt(d / na));
    for (int l = 0; l < L; l++) free(k[l]), free(v[l]);
    free(k), free(v), free(a), free(b), free(w);
    kv_engine_free(e);
    kv_model_close(m);
}

int main(void)
{
    KT_RUN(test_stories260k_dump_then_continue_equals_whole_prompt);
    KT_RUN(test_niah4k_1k_task_dump_then_continue_equals_whole_prompt);
    KT_RUN(test_a_cache_of_another_geometry_is_refused);
    KT_RUN(test_positions_subset_continues_at_the_original_positions);
    return kt_done();
}
