/*
 * Unit tests of DSQ and HCAP (lib/quant/kv_dsq.c): salient selection, a round
 * trip compared with the layout's formulas re-implemented here, the error
 * being smaller on salient tokens, exact byte sizes, importance from
 * queries, and the HCAP channel and token decisions.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kt.h"
#include "quant/kv_dsq.h"
#include "quant/kv_quant.h"

/* KT_REQUIRE evaluates its condition twice: call once, then require. */
#define KT_OK(call)                                                              \
    do {                                                                         \
        kv_status st_ = (call);                                                  \
        KT_REQUIRE(st_ == KV_OK, "%s: %s", #call, kv_errdetail());               \
    } while (0)

static unsigned long long seed = 0x1234567887654321ULL;

static void test_select_marks_the_top_tokens(void)
{
    float imp[64];
    uint8_t mask[8];
    for (int t = 0; t < 64; t++) imp[t] = (float)((t * 37) % 64); /* a permutation */
    kv_dsq_select(imp, 64, 13, mask);
    int n = 0;
    for (int t = 0; t < 64; t++) {
        int want = imp[t] >= 51;
        KT_CHECK(kv_dsq_mask_get(mask, t) == want, "token %d imp %g", t, imp[t]);
        n += kv_dsq_mask_get(mask, t);
    }
    KT_CHECK(n == 13, "%d salient", n);
    /* ties go to the earlier token; NaN is least important */
    for (int t = 0; t < 64; t++) imp[t] = 1;
    imp[0] = NAN;
    kv_dsq_select(imp, 64, 3, mask);
    KT_CHECK(!kv_dsq_mask_get(mask, 0) && kv_dsq_mask_get(mask, 1) && kv_dsq_mask_get(mask, 3) &&
                 !kv_dsq_mask_get(mask, 4), "ties: mask %02x", mask[0]);
    KT_CHECK(kv_dsq_salient_count(64, 0.2) == 13 && kv_dsq_salient_count(64, 0) == 0 &&
                 kv_dsq_salient_count(64, 1.5) == 64, "salient counts");
}

/* Decode of one window from the formulas of kv_layout.h. */
static void ref_window(kv_kivi_axis axis, const kv_dsq_packed *d, int h, int w, float *out)
{
    const int W = d->prm.window, S = d->prm.salient, D = d->head_dim, b = d->prm.bits;
    const int gd = d->prm.group < D ? d->prm.group : D;
    size_t hw = (size_t)h * d->nw + w;
    const uint8_t *mask = d->mask + hw * (W / 8);
    int is = 0, in = 0;
    for (int t = 0; t < W; t++) {
        if ((mask[t / 8] >> (t % 8)) & 1) {
            for (int c = 0; c < D; c++)
                out[t * D + c] = kv_half_to_f32(d->sscale[hw * D + c]) * d->sal[(hw * S + is) * D + c];
            is++;
        } else {
            size_t row = hw * (W - S) + in;
            for (int c = 0; c < D; c++) {
                unsigned code = (d->codes[row * (D * b / 8) + c * b / 8] >> (c * b % 8)) & ((1u << b) - 1);
                float v = kv_half_to_f32(d->zero[row * (D / gd) + c / gd]) +
                          kv_half_to_f32(d->scale[row * (D / gd) + c / gd]) * (float)code;
                if (axis == KV_KIVI_KEYS) v = kv_half_to_f32(d->base[hw * D + c]) + v;
                out[t * D + c] = v;
            }
            in++;
        }
    }
}

static void test_roundtrip_matches_layout_formulas(void)
{
    int H = 2, T = 64 * 3 + 17, D = 64;
    size_t n = (size_t)H * T * D;
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y), *imp = malloc((size_t)H * T * 4);
    for (size_t i = 0; i < n; i++) x[i] = kt_randn(&seed) + (i % D == 5 ? 8.0f : 0.0f);
    for (int i = 0; i < H * T; i++) imp[i] = (float)kt_rand(&seed);
    for (int a = 0; a < 2; a++) {
        kv_dsq_params p;
        kv_dsq_params_default(&p);
        kv_dsq_packed d;
        KT_OK(kv_dsq_pack(x, imp, (kv_kivi_axis)a, &p, H, T, D, &d));
        KT_CHECK(d.nw == 3, "nw %d", d.nw);
        kv_dsq_unpack(&d, y);
        float ref[64 * 64];
        int bad = 0;
        double es = 0, en = 0;
        int cs = 0, cn = 0;
        for (int h = 0; h < H; h++)
            for (int w = 0; w < d.nw; w++) {
                ref_window((kv_kivi_axis)a, &d, h, w, ref);
                const uint8_t *mask = d.mask + ((size_t)h * d.nw + w) * 8;
                int nset = 0;
                for (int t = 0; t < 64; t++) {
                    nset += kv_dsq_mask_get(mask, t);
                    for (int c = 0; c < D; c++) {
                        size_t i = ((size_t)h * T + w * 64 + t) * D + c;
                        bad += y[i] != ref[t * D + c];
                        double e = fabs(y[i] - x[i]);
                        if (kv_dsq_mask_get(mask, t)) { es += e; cs++; }
                        else { en += e; cn++; }
                    }
                }
                KT_CHECK(nset == 13, "window %d,%d has %d salient", h, w, nset);
            }
        KT_CHECK(bad == 0, "axis %d: %d values differ from the formula", a, bad);
        KT_CHECK(es / cs < en / cn / 4, "salient error %g not well below non-salient %g", es / cs, en / cn);
        KT_CHECK(en / cn < 0.7, "non-salient mean error %g", en / cn);
        for (int h = 0; h < H; h++)
            for (int t = 192; t < T; t++)
                for (int c = 0; c < D; c++) {
                    size_t i = ((size_t)h * T + t) * D + c;
                    KT_REQUIRE(y[i] == kv_round_half(x[i]), "residual token %d", t);
                }
        kv_dsq_clear(&d);
    }
    free(x);
    free(y);
    free(imp);
}

static void test_salient_choice_follows_importance(void)
{
    /* the importance, not the data, decides */
    int T = 64, D = 16;
    float x[64 * 16], imp[64];
    for (int i = 0; i < T * D; i++) x[i] = kt_randn(&seed);
    for (int t = 0; t < T; t++) imp[t] = t == 7 || t == 40 ? 10.0f : 0.0f;
    kv_dsq_params p = {64, 2, 2, 16, KV_DSQ_BASE_SALIENT};
    kv_dsq_packed d;
    KT_OK(kv_dsq_pack(x, imp, KV_KIVI_VALUES, &p, 1, T, D, &d));
    for (int t = 0; t < T; t++)
        KT_CHECK(kv_dsq_mask_get(d.mask, t) == (t == 7 || t == 40), "token %d", t);
    float y[64 * 16];
    kv_dsq_unpack(&d, y);
    for (int c = 0; c < D; c++) KT_CHECK(fabsf(y[7 * D + c] - x[7 * D + c]) < 0.03f, "int8 row");
    kv_dsq_clear(&d);
}

static void test_byte_sizes_are_exact(void)
{
    kv_dsq_params p;
    kv_dsq_params_default(&p); /* W 64, S 13, b 2, group 32 */
    int H = 8, T = 1000, D = 128, nw = 15;
    size_t common = (size_t)H * nw * (8 + 13 * 128 + 2 * 128 + 51 * 32 + 4 * 51 * 4) +
                    2 * (size_t)H * (T - nw * 64) * D;
    KT_CHECK(kv_dsq_bytes(KV_KIVI_VALUES, &p, H, T, D) == common, "values %zu vs %zu",
             kv_dsq_bytes(KV_KIVI_VALUES, &p, H, T, D), common);
    KT_CHECK(kv_dsq_bytes(KV_KIVI_KEYS, &p, H, T, D) == common + (size_t)H * nw * 2 * 128, "keys");
    p.window = 12;
    KT_CHECK(kv_dsq_check(&p, 128) == KV_E_USAGE, "window 12 rejected");
}

static void test_importance_from_uniform_queries(void)
{
    /* zero queries attend uniformly: token t gets sum_j 1/(T-nq+j+1) */
    int T = 10, nq = 3, D = 4;
    float q[2 * 3 * 4] = {0}, k[10 * 4], imp[10];
    for (int i = 0; i < 40; i++) k[i] = kt_randn(&seed);
    KT_OK(kv_dsq_importance(q, 2, nq, k, 1, T, D, imp));
    for (int t = 0; t < T; t++) {
        double want = 0;
        for (int j = 0; j < nq; j++)
            if (t <= T - nq + j) want += 2.0 / (T - nq + j + 1);
        KT_NEAR(imp[t], want, 1e-5);
    }
    KT_CHECK(kv_dsq_importance(q, 3, nq, k, 2, T, D, imp) == KV_E_DATA, "3 heads over 2");
}

static void test_hcap_channels(void)
{
    float c[8] = {10, 0.1f, 5, 0.2f, 0, 3, 0.05f, 1};
    uint8_t keep[8];
    int n = kv_hcap_channels(c, 8, 0.05, keep); /* sum 19.35: keep >= 0.9675 */
    KT_CHECK(n == 4, "kept %d", n);
    KT_CHECK(keep[0] && keep[2] && keep[5] && keep[7] && !keep[1] && !keep[4], "which");
    KT_CHECK(kv_hcap_channels(c, 8, 0, keep) == 8, "threshold 0 keeps all");
    KT_CHECK(kv_hcap_channels(c, 8, 0.9, keep) == 1 && keep[0], "the largest stays");
}

static void test_hcap_tokens(void)
{
    float hist[20], pred[20];
    uint8_t keep[20];
    for (int t = 0; t < 20; t++) {
        hist[t] = t == 9 ? 5.0f : t == 11 ? 4.0f : 0.0f;
        pred[t] = t == 5 ? 1.0f : 0.0f;
    }
    int n = kv_hcap_tokens(hist, pred, 20, 0.3, 2, 2, keep); /* budget 6 */
    KT_CHECK(n == 6, "kept %d", n);
    KT_CHECK(keep[0] && keep[1] && keep[18] && keep[19] && keep[5] && keep[9] && !keep[11],
             "set");
    KT_CHECK(kv_hcap_tokens(hist, NULL, 20, 1.0, 0, 0, keep) == 20, "keep all");
    KT_CHECK(kv_hcap_tokens(hist, NULL, 20, 0.0, 1, 1, keep) == 2, "sink+window only");
}

int main(void)
{
    KT_RUN(test_select_marks_the_top_tokens);
    KT_RUN(test_roundtrip_matches_layout_formulas);
    KT_RUN(test_salient_choice_follows_importance);
    KT_RUN(test_byte_sizes_are_exact);
    KT_RUN(test_importance_from_uniform_queries);
    KT_RUN(test_hcap_channels);
    KT_RUN(test_hcap_tokens);
    return kt_done();
}
