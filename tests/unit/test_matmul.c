/*
 * The CPU weight kernels' two inner paths (lib/model/kv_matmul.c): the
 * portable one, chosen by kv_matmul_set_portable, against the one the CPU
 * would pick (AVX2+FMA where present), and both against float64, on f32,
 * f16 and bf16 weights; and that f16 and bf16 products take their input
 * rounded to the weight's type, as llama.cpp's CPU backend does; and the
 * float operations between the products: RMSNorm and the attention
 * softmax sum in double, SwiGLU's silu is one division.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kt.h"
#include "common/kv_dtype.h"
#include "common/kv_half.h"
#include "model/kv_matmul.h"

static unsigned long long seed = 0x6d61746d756cULL;

/* x rounded to the 16-bit type t (F32: unchanged) */
static double round_to(kv_dtype t, float x)
{
    return t == KV_DT_F16 ? kv_round_half(x) : t == KV_DT_BF16 ? kv_bf16_to_f32(kv_f32_to_bf16(x)) : x;
}

/* y = W x with each path, against float64 (of x rounded to the weight's
 * type); returns the paths' difference. */
static double check_matvec(kv_dtype t, int rows, int cols)
{
    size_t n = (size_t)rows * cols;
    void *data = malloc(n * (t == KV_DT_F32 ? 4 : 2));
    float *x = malloc((size_t)cols * 4), *y0 = malloc((size_t)rows * 4), *y1 = malloc((size_t)rows * 4);
    double *ref = calloc((size_t)rows, sizeof(double));
    for (int c = 0; c < cols; c++) x[c] = kt_randn(&seed);
    for (size_t i = 0; i < n; i++) {
        float w = 0.05f * kt_randn(&seed), wq = w;
        if (t == KV_DT_F32) ((float *)data)[i] = w;
        else if (t == KV_DT_F16) wq = kv_half_to_f32(((uint16_t *)data)[i] = kv_f32_to_half(w));
        else wq = kv_bf16_to_f32(((uint16_t *)data)[i] = kv_f32_to_bf16(w));
        ref[i / (size_t)cols] += (double)wq * round_to(t, x[i % (size_t)cols]);
    }
    kv_weight w = {.type = t, .rows = rows, .cols = cols, .data = data};
    kv_matmul_set_portable(false);
    kv_matvec(&w, x, y0);
    kv_matmul_set_portable(true);
    KT_CHECK(!strcmp(kv_matmul_isa(), "portable"), "isa '%s' after set_portable", kv_matmul_isa());
    kv_matvec(&w, x, y1);
    kv_matmul_set_portable(false);
    double d = 0, e0 = 0, e1 = 0, den = 0;
    for (int r = 0; r < rows; r++) {
        d = fmax(d, fabs((double)y0[r] - y1[r]));
        e0 += (y0[r] - ref[r]) * (y0[r] - ref[r]);
        e1 += (y1[r] - ref[r]) * (y1[r] - ref[r]);
        den += ref[r] * ref[r];
    }
    KT_CHECK(sqrt(e0 / den) < 1e-5 && sqrt(e1 / den) < 1e-5,
             "type %d %dx%d: normalized error %g (chosen) %g (portable)", (int)t, rows, cols,
             sqrt(e0 / den), sqrt(e1 / den));
    free(data), free(x), free(y0), free(y1), free(ref);
    return d;
}

static void test_portable_path_matches_the_chosen_one(void)
{
    const char *chosen = kv_matmul_isa();
    double d = check_matvec(KV_DT_F32, 300, 1000);
    d = fmax(d, check_matvec(KV_DT_F16, 257, 777));
    d = fmax(d, check_matvec(KV_DT_BF16, 64, 4096));
    printf("# chosen path %s; largest difference to the portable path %.3g\n", chosen, d);
    KT_CHECK(!strcmp(kv_matmul_isa(), chosen), "isa '%s' after set_portable(false), was '%s'",
             kv_matmul_isa(), chosen);
}

/* Normalized distance of y (n) from ref (n). */
static double nerr(const float *y, const double *ref, int n)
{
    double e = 0, den = 0;
    for (int i = 0; i < n; i++) e += (y[i] - ref[i]) * (y[i] - ref[i]), den += ref[i] * ref[i];
    return sqrt(e / den);
}

/* Decode (kv_matvec, kv_matvec_multi) and prefill (kv_matmul) against
 * float64 sums over the input rounded to each weight's type: 1e-6 where
 * the unrounded input is 1e-4 (f16) or 1e-3 (bf16) away, so a path that
 * keeps float32 inputs fails.  F32 weights take the input as it is. */
static void test_f16_and_bf16_products_round_their_input_to_the_type(void)
{
    enum { ROWS = 37, COLS = 301, NT = 7 };
    const kv_dtype types[3] = {KV_DT_F16, KV_DT_BF16, KV_DT_F32};
    uint16_t *w16[3];
    float *w32 = malloc((size_t)ROWS * COLS * 4), *X = malloc((size_t)NT * COLS * 4);
    float *y = malloc((size_t)NT * ROWS * 4), *ym[3];
    double *ref = malloc((size_t)NT * ROWS * sizeof(double)), *raw = malloc((size_t)ROWS * sizeof(double));
    kv_weight w[3];
    for (int i = 0; i < NT * COLS; i++) X[i] = kt_randn(&seed);
    for (int k = 0; k < 3; k++) {
        w16[k] = malloc((size_t)ROWS * COLS * 2);
        ym[k] = malloc((size_t)ROWS * 4);
        for (int i = 0; i < ROWS * COLS; i++) {
            float v = 0.05f * kt_randn(&seed);
            if (types[k] == KV_DT_F16) w16[k][i] = kv_f32_to_half(v);
            else if (types[k] == KV_DT_BF16) w16[k][i] = kv_f32_to_bf16(v);
            else w32[i] = v;
        }
        w[k] = (kv_weight){.type = types[k], .rows = ROWS, .cols = COLS,
                           .data = types[k] == KV_DT_F32 ? (void *)w32 : (void *)w16[k]};
    }
    for (int portable = 0; portable < 2; portable++) {
        kv_matmul_set_portable(portable);
        const kv_weight *wp[3] = {&w[0], &w[1], &w[2]};
        kv_matvec_multi(3, wp, X, ym);
        for (int k = 0; k < 3; k++) {
            const kv_dtype t = types[k];
            for (int r = 0; r < ROWS; r++) {
                double su = 0;
                for (int c = 0; c < COLS; c++) {
                    size_t i = (size_t)r * COLS + c;
                    double wv = t == KV_DT_F16 ? kv_half_to_f32(w16[k][i])
                              : t == KV_DT_BF16 ? kv_bf16_to_f32(w16[k][i]) : w32[i];
                    for (int j = 0; j < NT; j++) {
                        double a = wv * round_to(t, X[(size_t)j * COLS + c]);
                        ref[(size_t)j * ROWS + r] = (c ? ref[(size_t)j * ROWS + r] : 0) + a;
                    }
                    su += wv * X[c];
                }
                raw[r] = su;
            }
            const double gap = t == KV_DT_F32 ? 0 : t == KV_DT_F16 ? 1e-4 : 1e-3;
            float yu[ROWS];
            for (int r = 0; r < ROWS; r++) yu[r] = (float)raw[r];
            KT_CHECK(nerr(yu, ref, ROWS) >= gap, "type %d: rounding moves the result only %g", (int)t,
                     nerr(yu, ref, ROWS));
            kv_matvec(&w[k], X, y);
            KT_CHECK(nerr(y, ref, ROWS) < 1e-6, "%s kv_matvec type %d: %g from the rounded-input sum",
                     kv_matmul_isa(), (int)t, nerr(y, ref, ROWS));
            KT_CHECK(nerr(ym[k], ref, ROWS) < 1e-6, "%s kv_matvec_multi type %d: %g", kv_matmul_isa(), (int)t,
                     nerr(ym[k], ref, ROWS));
            kv_matmul(&w[k], X, NT, y);
            KT_CHECK(nerr(y, ref, NT * ROWS) < 1e-6, "%s kv_matmul type %d (%d tokens): %g", kv_matmul_isa(),
                     (int)t, NT, nerr(y, ref, NT * ROWS));
        }
    }
    kv_matmul_set_portable(false);
    for (int k = 0; k < 3; k++) free(w16[k]), free(ym[k]);
    free(w32), free(X), free(y), free(ref), free(raw);
}

/* RMSNorm's mean of squares summed in double: with one large element and
 * many ones, a float sum stops growing at 2^24 (every + 1 rounds away) and
 * the scale comes out 1.2e-4 too large; in double it is exact. */
static void test_rmsnorm_sums_its_squares_in_double(void)
{
    enum { N = 4096 };
    float *x = malloc(N * sizeof(float)), *w = malloc(N * sizeof(float)), *o = malloc(N * sizeof(float));
    for (int j = 0; j < N; j++) x[j] = j ? 1.0f : 4096.0f, w[j] = j % 3 ? 0.5f : 2.0f;
    const float eps = 1e-5f;
    double ss = 0;
    for (int j = 0; j < N; j++) ss += (double)x[j] * x[j];
    const double scale = 1 / sqrt(ss / N + eps);
    kv_rmsnorm(o, x, w, N, eps);
    double worst = 0;
    for (int j = 0; j < N; j++) worst = fmax(worst, fabs(o[j] / (w[j] * x[j] * scale) - 1));
    KT_CHECK(worst < 1e-6, "largest relative error %g against the float64 norm", worst);
    kv_rmsnorm(x, x, w, N, eps); /* in place */
    KT_CHECK(!memcmp(x, o, N * sizeof(float)), "in place differs");
    free(x), free(w), free(o);
}

/* Softmax of one head whose probabilities are one large and 4096 small:
 * each small term (2.5e-8) is below half a float step of 1, so a float
 * normaliser stays 1.0 and the probabilities sum to 1.0001; in double they
 * sum to 1. */
static void test_attention_softmax_normaliser_sums_in_double(void)
{
    enum { T = 4097, D = 8 };
    float q[D] = {1}, out[D], *k = calloc((size_t)T * D, sizeof(float)), *v = malloc((size_t)T * D * sizeof(float));
    float *p = malloc(T * sizeof(float)), *s = malloc(T * sizeof(float));
    for (int t = 0; t < T; t++) {
        k[(size_t)t * D] = t ? -17.5f : 0.0f;
        for (int c = 0; c < D; c++) v[(size_t)t * D + c] = 1.0f;
    }
    for (int portable = 0; portable < 2; portable++) {
        kv_matmul_set_portable(portable);
        kv_attend_head_f32(q, k, v, T, D, 1.0f, out, p, s);
        double sum = 0;
        for (int t = 0; t < T; t++) sum += p[t];
        const double p0 = 1 / (1 + (T - 1) * (double)expf(-17.5f));
        KT_CHECK(fabs(sum - 1) < 1e-6, "%s: probabilities sum to 1 + %g", kv_matmul_isa(), sum - 1);
        KT_CHECK(fabs(p[0] - p0) < 1e-6, "%s: p[0] = %.9g, want %.9g", kv_matmul_isa(), p[0], p0);
    }
    kv_matmul_set_portable(false);
    free(k), free(v), free(p), free(s);
}

/* silu(g) as one division g / (1 + exp(-g)), correctly rounded for the
 * float 1 + exp(-g); g * (1 / (1 + exp(-g))) rounds twice and is a float
 * step off for a share of inputs. */
static void test_swiglu_divides_once(void)
{
    enum { N = 100000 };
    float *g = malloc(N * sizeof(float)), *u = malloc(N * sizeof(float)), *want = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++) {
        g[i] = 4.0f * kt_randn(&seed);
        u[i] = i % 2 ? 1.0f : -0.75f;
        want[i] = (float)((double)g[i] / (double)(1.0f + expf(-g[i]))) * u[i];
    }
    kv_swiglu(g, u, N);
    int off = 0;
    for (int i = 0; i < N; i++) off += g[i] != want[i];
    KT_CHECK(off == 0, "%d of %d results differ from the one-division silu", off, N);
    free(g), free(u), free(want);
}

/* kv_halves_to_f32 (F16C where the CPU has it) gives every one of the
 * 65,536 halves as kv_half_to_f32 does: the same bits, NaN as NaN, at
 * every offset of a vector's tail. */
static void test_halves_convert_as_one_by_one(void)
{
    uint16_t *h = malloc(65536 * sizeof *h + 16);
    float *f = malloc(65536 * sizeof *f + 64);
    KT_REQUIRE(h && f, "memory");
    for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    int bad = 0;
    for (int off = 0; off < 9; off++) {
        kv_halves_to_f32(h + off, f, (size_t)(65536 - off));
        for (int i = 0; i < 65536 - off; i++) {
            float w = kv_half_to_f32(h[i + off]);
            uint32_t a, b;
            memcpy(&a, &f[i], 4), memcpy(&b, &w, 4);
            bad += isnan(w) ? !isnan(f[i]) : a != b;
        }
    }
    KT_CHECK(bad == 0, "%d conversions differ", bad);
    free(h), free(f);
}

int main(void)
{
    KT_RUN(test_portable_path_matches_the_chosen_one);
    KT_RUN(test_halves_convert_as_one_by_one);
    KT_RUN(test_f16_and_bf16_products_round_their_input_to_the_type);
    KT_RUN(test_rmsnorm_sums_its_squares_in_double);
    KT_RUN(test_attention_softmax_normaliser_sums_in_double);
    KT_RUN(test_swiglu_divides_once);
    return kt_done();
}
