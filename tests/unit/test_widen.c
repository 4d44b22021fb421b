/*
 * kv_widen: a trained model embedded in a larger shape computes the same
 * logits (stories260K and niah4k, F32 weights, through the CPU engine's
 * prefill and its decode steps), its identity layers share one zero block,
 * and shapes it does not fit are refused with the reason.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt_kv.h"
#include "engine/kv_engine.h"
#include "model/kv_model.h"
#include "model/kv_widen.h"

static kv_model *open_model(const char *path)
{
    kv_model *m = NULL;
    kv_status st = kv_model_open(path, &m);
    KT_CHECK(st == KV_OK, "load %s: %s", path, kv_errdetail());
    return m;
}

static kv_model_config shape(int dim, int hidden, int layers, int heads, int kv, int hd)
{
    kv_model_config c;
    memset(&c, 0, sizeof c);
    c.dim = dim, c.hidden_dim = hidden, c.n_layers = layers, c.n_heads = heads, c.n_kv_heads = kv;
    c.head_dim = hd, c.rope_dim = hd;
    snprintf(c.name, sizeof c.name, "shape%d", dim);
    return c;
}

/* Largest |logit difference| of the two models over the prefill of n
 * tokens (every position) and `steps` greedy decode steps after it; *ids
 * set false when a greedy id differs. */
static double max_logit_diff(const kv_model *a, const kv_model *b, const int *tok, int n, int steps, bool *ids)
{
    const int V = a->cfg.vocab_size;
    kv_engine *ea = NULL, *eb = NULL;
    float *la = malloc((size_t)n * V * sizeof *la), *lb = malloc((size_t)n * V * sizeof *lb);
    double worst = -1;
    *ids = true;
    if (!la || !lb || kv_engine_new(a, NULL, n + steps + 1, &ea) || kv_engine_new(b, NULL, n + steps + 1, &eb))
        goto out;
    if (kv_engine_prefill_all(ea, tok, n, la) || kv_engine_prefill_all(eb, tok, n, lb)) goto out;
    worst = 0;
    for (size_t i = 0; i < (size_t)n * V; i++) worst = fmax(worst, fabs((double)la[i] - lb[i]));
    float *xa = la + (size_t)(n - 1) * V, *xb = lb + (size_t)(n - 1) * V;
    for (int s = 0; s < steps; s++) {
        int ta = kt_argmax(xa, V), tb = kt_argmax(xb, V);
        if (ta != tb) *ids = false;
        if (kv_engine_step(ea, ta, xa) || kv_engine_step(eb, ta, xb)) {
            worst = -1;
            break;
        }
        for (int i = 0; i < V; i++) worst = fmax(worst, fabs((double)xa[i] - xb[i]));
    }
out:
    kv_engine_free(ea);
    kv_engine_free(eb);
    free(la), free(lb);
    return worst;
}

static int *some_tokens(int n, int vocab, uint64_t seed)
{
    int *t = malloc((size_t)n * sizeof *t);
    if (!t) return NULL;
    t[0] = 1;
    for (int i = 1; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = 3 + (int)((seed >> 33) % (uint64_t)(vocab - 3));
    }
    return t;
}

static void check_same_function(const char *path, kv_model_config big, int n, double tol)
{
    kv_model *s = open_model(path), *w = NULL;
    KT_REQUIRE(s, "no model");
    kv_status st = kv_model_widen(s, &big, KV_DT_F32, &w);
    KT_REQUIRE(st == KV_OK, "widen: %s", kv_errdetail());
    KT_CHECK(w->cfg.dim == big.dim && w->cfg.n_layers == big.n_layers && w->cfg.head_dim == big.head_dim &&
                 w->cfg.n_kv_heads == big.n_kv_heads && w->cfg.hidden_dim == big.hidden_dim,
             "shape %d/%d/%d/%d", w->cfg.dim, w->cfg.n_layers, w->cfg.head_dim, w->cfg.n_kv_heads);
    KT_CHECK(w->cfg.vocab_size == s->cfg.vocab_size, "vocab %d", w->cfg.vocab_size);
    int *tok = some_tokens(n, s->cfg.vocab_size, 7);
    bool ids;
    double d = max_logit_diff(s, w, tok, n, 8, &ids);
    printf("# %s in %d wide, %d layers, heads of %d: max |dlogit| %g over %d positions\n", path, big.dim,
           big.n_layers, big.head_dim, d, n + 8);
    KT_CHECK(d >= 0 && d < tol, "%s widened to %d wide: max |dlogit| %g (tolerance %g)", path, big.dim, d, tol);
    KT_CHECK(ids, "%s widened: a greedy id differs", path);
    free(tok);
    kv_model_close(w);
    kv_model_close(s);
}

static void test_stories260k_widened_keeps_its_logits(void)
{
    /* width x2 (s = sqrt 2, not exact in float), head 8 -> 16, 5 -> 8 layers,
     * groups of 2 -> 4, more feed-forward units */
    check_same_function("tests/data/stories260K/stories260K.bin", shape(128, 256, 8, 16, 4, 16), 21, 2e-4);
    /* width x4 (s = 2), head 8 -> 32 (4 copies per pair) */
    check_same_function("tests/data/stories260K/stories260K.bin", shape(256, 200, 5, 16, 8, 32), 60, 2e-4);
}

static void test_niah4k_widened_keeps_its_logits(void)
{
    /* niah4k (256 wide, 6 layers, 4/2 heads of 64) in a shape of 8B's
     * proportions: 1024 wide, 16 layers, 32/8 heads of 128 */
    check_same_function("tests/data/niah4k/niah4k.bin", shape(1024, 1024, 16, 32, 8, 128), 400, 5e-4);
}

static void test_identity_layers_share_one_zero_block(void)
{
    kv_model *s = open_model("tests/data/stories260K/stories260K.bin"), *w = NULL;
    KT_REQUIRE(s, "no model");
    kv_model_config big = shape(128, 256, 12, 16, 4, 16);
    KT_REQUIRE(kv_model_widen(s, &big, KV_DT_BF16, &w) == KV_OK, "widen: %s", kv_errdetail());
    int real = 0, zero = 0;
    const void *zdata = NULL, *zdown = NULL;
    for (int l = 0; l < 12; l++) {
        const kv_weight *q = &w->layers[l].wq;
        bool nz = false;
        for (int i = 0; i < q->rows * q->cols && !nz; i++) nz = ((const uint16_t *)q->data)[i] != 0;
        if (nz) {
            real++;
        } else {
            zero++;
            if (!zdata) zdata = q->data, zdown = w->layers[l].w_down.data;
            KT_CHECK(q->data == zdata && w->layers[l].w_down.data == zdown,
                     "layer %d: identity layers do not share the zero block", l);
        }
    }
    KT_CHECK(real == 5 && zero == 7, "%d real and %d identity layers (want 5 and 7)", real, zero);
    KT_CHECK(w->layers[0].wq.data != zdata && w->layers[11].wq.data == zdata, "small layer 0 is the first");
    KT_CHECK(strstr(w->cfg.name, "(widened)") && !strcmp(w->cfg.format, "widened"), "name %s", w->cfg.name);
    kv_model_close(w);
    kv_model_close(s);
}

static void test_shapes_that_do_not_fit_are_refused(void)
{
    kv_model *s = open_model("tests/data/niah4k/niah4k.bin"), *w = NULL;
    KT_REQUIRE(s, "no model");
    struct {
        kv_model_config c;
        const char *why;
    } bad[] = {
        {shape(128, 1024, 8, 8, 2, 64), "width 256 exceeds 128"},
        {shape(512, 512, 8, 8, 2, 64), "feed-forward width 768 exceeds 512"},
        {shape(512, 1024, 4, 8, 2, 64), "layer count 6 exceeds 4"},
        {shape(512, 1024, 8, 8, 1, 64), "KV head count 2 exceeds 1"},
        {shape(512, 1024, 8, 2, 2, 64), "query heads per KV head 2 exceeds 1"},
        {shape(960, 1024, 8, 8, 2, 96), "head size 64 does not divide 96"},
        {shape(512, 1024, 8, 8, 0, 64), "n_kv_heads 0 does not divide n_heads 8"},
        {shape(512, 1024, 8, 6, 4, 64), "n_kv_heads 4 does not divide n_heads 6"},
        {shape(0, 1024, 8, 8, 2, 64), "model dim 0 out of range"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_status st = kv_model_widen(s, &bad[i].c, KV_DT_F32, &w);
        KT_CHECK(st == KV_E_USAGE && !w && strstr(kv_errdetail(), bad[i].why), "case %zu: %d '%s'", i, st,
                 kv_errdetail());
    }
    KT_CHECK(kv_model_widen_named(s, "llama-3.1-9b", KV_DT_F32, &w) == KV_E_USAGE && !w, "unknown geometry");
    /* what the construction does not carry over: a feed-forward bias */
    float bias[768] = {0};
    s->layers[2].w_up.bias = bias;
    kv_status st = kv_model_widen_named(s, "llama-3.1-8b", KV_DT_F16, &w);
    KT_CHECK(st == KV_E_UNSUPPORTED && !w && strstr(kv_errdetail(), "cannot widen feed-forward biases (layer 2)"),
             "feed-forward bias: %d '%s'", st, kv_errdetail());
    s->layers[2].w_up.bias = NULL;
    KT_CHECK(kv_model_widen(s, &bad[0].c, KV_DT_Q8_0, &w) == KV_E_USAGE && !w, "weight type");
    kv_model_close(s);
}

int main(void)
{
    KT_RUN(test_stories260k_widened_keeps_its_logits);
    KT_RUN(test_niah4k_widened_keeps_its_logits);
    KT_RUN(test_identity_layers_share_one_zero_block);
    KT_RUN(test_shapes_that_do_not_fit_are_refused);
    return kt_done();
}
