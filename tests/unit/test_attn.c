/*
 * CPU reference attention (lib/attn/kv_attn.c) against a plain float64
 * computation written here: dense fp32 and fp16 GQA, and the packed KIVI
 * path (whose float64 reference attends the dequantized K/V from
 * kv_kivi_unpack), on fresh random data and on real layer-0 K/V of niah4k.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attn_realdata.h"
#include "kt.h"
#include "attn/kv_attn.h"
#include "quant/kv_kivi.h"

static unsigned long long seed;

/* out = softmax(q k^T * scale) v in float64; k, v (kv_heads, T, D) floats. */
static void attn_f64(const kv_attn_dims *d, const float *q, const float *k, const float *v,
                     double *out)
{
    const int D = d->head_dim, T = d->T, rep = d->n_heads / d->n_kv_heads;
    double *s = malloc((size_t)T * sizeof(double));
    for (int h = 0; h < d->n_heads; h++) {
        const float *kh = k + (size_t)(h / rep) * T * D, *vh = v + (size_t)(h / rep) * T * D;
        double m = -INFINITY, l = 0;
        for (int t = 0; t < T; t++) {
            double a = 0;
            for (int c = 0; c < D; c++) a += (double)q[h * D + c] * kh[(size_t)t * D + c];
            s[t] = a * d->scale;
            m = s[t] > m ? s[t] : m;
        }
        for (int t = 0; t < T; t++) l += (s[t] = exp(s[t] - m));
        for (int c = 0; c < D; c++) {
            double o = 0;
            for (int t = 0; t < T; t++) o += s[t] * vh[(size_t)t * D + c];
            out[h * D + c] = o / l;
        }
    }
    free(s);
}

/* ||a - ref|| / ||ref||; NaN anywhere gives NaN (which fails every check). */
static double nerr(const float *a, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += (a[i] - ref[i]) * (a[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return sqrt(num / den);
}

static float *randn(size_t n, float sd)
{
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = sd * kt_randn(&seed);
    return x;
}

/* Round through fp16 in place, returning the fp16 copy. */
static kv_half *to_half(float *x, size_t n)
{
    kv_half *h = malloc(n * sizeof(kv_half));
    for (size_t i = 0; i < n; i++) x[i] = kv_half_to_f32(h[i] = kv_f32_to_half(x[i]));
    return h;
}

static void test_dense_f32_matches_float64(void)
{
    kv_attn_dims d = {8, 2, 64, 333, 0, 0.125f};
    size_t nq = 8 * 64, nkv = 2 * 333 * 64;
    float *q = randn(nq, 1), *k = randn(nkv, 1), *v = randn(nkv, 1), *o = malloc(nq * sizeof(float));
    double *ref = malloc(nq * sizeof(double));
    KT_REQUIRE(kv_attn_decode_f32(&d, q, k, v, o) == KV_OK, "decode");
    attn_f64(&d, q, k, v, ref);
    double e = nerr(o, ref, nq);
    KT_CHECK(e < 1e-5, "normalized error %g", e);
    free(q), free(k), free(v), free(o), free(ref);
}

static void test_dense_f16_matches_float64(void)
{
    kv_attn_dims d = {32, 8, 128, 257, 0, 1.0f / sqrtf(128.0f)};
    size_t nq = 32 * 128, nkv = 8 * 257 * 128;
    float *q = randn(nq, 1), *k = randn(nkv, 1), *v = randn(nkv, 1), *o = malloc(nq * sizeof(float));
    kv_half *qh = to_half(q, nq), *kh = to_half(k, nkv), *vh = to_half(v, nkv);
    double *ref = malloc(nq * sizeof(double));
    KT_REQUIRE(kv_attn_decode_f16(&d, qh, kh, vh, o) == KV_OK, "decode");
    attn_f64(&d, q, k, v, ref);
    double e = nerr(o, ref, nq);
    KT_CHECK(e < 1e-5, "normalized error %g", e);
    free(q), free(k), free(v), free(o), free(ref), free(qh), free(kh), free(vh);
}

/* Packed attention equals float64 attention over the dequantized cache. */
static double kivi_case(const kv_attn_dims *d, const float *q, const float *k, const float *v,
                        int bits, int G, int R)
{
    const size_t nq = (size_t)d->n_heads * d->head_dim, nkv = (size_t)d->n_kv_heads * d->T * d->head_dim;
    kv_kivi_params prm = {bits, G, R};
    kv_kivi_packed K, V;
    float *qr = malloc(nq * sizeof(float)), *kd = malloc(nkv * sizeof(float)),
          *vd = malloc(nkv * sizeof(float)), *o = malloc(nq * sizeof(float));
    memcpy(qr, q, nq * sizeof(float));
    kv_half *qh = to_half(qr, nq);
    /* The packed cache comes from fp16 K/V, as on the GPU. */
    float *kr = malloc(nkv * sizeof(float)), *vr = malloc(nkv * sizeof(float));
    memcpy(kr, k, nkv * sizeof(float)), memcpy(vr, v, nkv * sizeof(float));
    free(to_half(kr, nkv)), free(to_half(vr, nkv));
    double *ref = malloc(nq * sizeof(double)), e = NAN;
    if (kv_kivi_pack(kr, KV_KIVI_KEYS, &prm, d->n_kv_heads, d->T, d->head_dim, &K) == KV_OK) {
        if (kv_kivi_pack(vr, KV_KIVI_VALUES, &prm, d->n_kv_heads, d->T, d->head_dim, &V) == KV_OK) {
            kv_kivi_unpack(&K, kd);
            kv_kivi_unpack(&V, vd);
            if (kv_attn_decode_kivi(d, qh, &K, &V, o) == KV_OK) {
                attn_f64(d, qr, kd, vd, ref);
                e = nerr(o, ref, nq);
            }
            kv_kivi_clear(&V);
        }
        kv_kivi_clear(&K);
    }
    free(qr), free(kd), free(vd), free(o), free(qh), free(kr), free(vr), free(ref);
    return e;
}

static void test_kivi_matches_float64_on_random_data(void)
{
    kv_attn_dims d = {32, 8, 128, 700, 0, 1.0f / sqrtf(128.0f)};
    size_t nq = 32 * 128, nkv = 8 * 700 * 128;
    float *q = randn(nq, 1), *k = randn(nkv, 1), *v = randn(nkv, 1);
    for (size_t i = 0; i < nkv; i += 128) k[i + 5] += 6.0f; /* an outlier key channel */
    const int bits[] = {1, 2, 4}, groups[] = {32, 64, 128};
    for (int b = 0; b < 3; b++)
        for (int g = 0; g < 3; g++) {
            double e = kivi_case(&d, q, k, v, bits[b], groups[g], 128);
            KT_CHECK(e < 2e-5, "bits %d group %d: normalized error %g", bits[b], groups[g], e);
        }
    double e = kivi_case(&d, q, k, v, 2, 64, 1000); /* everything residual */
    KT_CHECK(e < 2e-5, "all-residual: normalized error %g", e);
    e = kivi_case(&d, q, k, v, 1, 140, 0); /* no residual: 700 = 5 groups of 140 */
    KT_CHECK(e < 2e-5, "no residual: normalized error %g", e);
    free(q), free(k), free(v);
}

static void test_kivi_matches_float64_on_real_data(void)
{
    niah_layer0 r;
    KT_REQUIRE(niah_layer0_load(1536, &r) == 0, "cannot load layer 0 of " NIAH_BIN);
    kv_attn_dims d = {r.n_heads, r.n_kv_heads, r.head_dim, r.T, 0, 1.0f / sqrtf((float)r.head_dim)};
    for (int bits = 1; bits <= 4; bits *= 2) {
        double e = kivi_case(&d, r.q, r.k, r.v, bits, 64, 128);
        KT_CHECK(e < 2e-5, "bits %d: normalized error %g", bits, e);
    }
    size_t nq = (size_t)r.n_heads * r.head_dim;
    float *o = malloc(nq * sizeof(float));
    double *ref = malloc(nq * sizeof(double));
    KT_CHECK(kv_attn_decode_f32(&d, r.q, r.k, r.v, o) == KV_OK, "dense");
    attn_f64(&d, r.q, r.k, r.v, ref);
    double e = nerr(o, ref, nq);
    KT_CHECK(e < 1e-5, "dense fp32 on real data: normalized error %g", e);
    free(o), free(ref);
    niah_layer0_free(&r);
}

static void test_bad_geometry_is_a_usage_error(void)
{
    kv_attn_dims d = {6, 4, 64, 10, 0, 0.125f};
    KT_CHECK(kv_attn_check(&d) == KV_E_USAGE, "6 heads over 4 KV heads accepted");
    d = (kv_attn_dims){8, 2, 64, 0, 0, 0.125f};
    KT_CHECK(kv_attn_check(&d) == KV_E_USAGE, "T = 0 accepted");
    d = (kv_attn_dims){8, 2, 64, 10, 0, NAN};
    KT_CHECK(kv_attn_check(&d) == KV_E_USAGE, "NaN scale accepted");
    d = (kv_attn_dims){8, 2, 64, 10, 0, 0.125f};
    KT_CHECK(kv_attn_check(&d) == KV_OK, "valid geometry refused");
}

int main(void)
{
    seed = getenv("KT_SEED") ? strtoull(getenv("KT_SEED"), NULL, 10) : (unsigned long long)time(NULL);
    printf("# seed %llu (set KT_SEED to repeat)\n", seed);
    seed |= 1;
    KT_RUN(test_dense_f32_matches_float64);
    KT_RUN(test_dense_f16_matches_float64);
    KT_RUN(test_kivi_matches_float64_on_random_data);
    KT_RUN(test_kivi_matches_float64_on_real_data);
    KT_RUN(test_bad_geometry_is_a_usage_error);
    return kt_done();
}
