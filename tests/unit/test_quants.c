/*
 * Unit tests of the ggml weight types (lib/model/kv_quants, the block
 * layouts in lib/common/kv_ggml.h, the kernels in kv_matmul): every block
 * type's dequantization agrees with a decoder written here value by value
 * from the layout description; the quantizer's error is that of a 2..8-bit
 * code; activations round-trip; the fast (AVX2) dot products agree with the
 * reference and with a double-precision sum; and matvec, matvec_multi,
 * matmul and weight_row give the reference numbers, biases and row
 * permutations included.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_ggml.h"
#include "common/kv_half.h"
#include "kt.h"
#include "model/kv_matmul.h"
#include "model/kv_matmul_q.h"
#include "model/kv_model.h"
#include "model/kv_quants.h"

static const uint32_t block_types[] = {KV_GGML_Q4_0, KV_GGML_Q4_1, KV_GGML_Q5_0, KV_GGML_Q5_1,
                                       KV_GGML_Q8_0, KV_GGML_Q2_K, KV_GGML_Q3_K, KV_GGML_Q4_K,
                                       KV_GGML_Q5_K, KV_GGML_Q6_K};
#define NBT (int)(sizeof block_types / sizeof *block_types)

static const char *tn(uint32_t t)
{
    static char b[16];
    return kv_ggml_type_name(t, b);
}

static float h2f(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return kv_half_to_f32(h);
}

static int bit(const uint8_t *p, int i) { return (p[i / 8] >> (i % 8)) & 1; }

/* Value i of a block, decoded from the byte layout only (offsets written
 * out here, not taken from the header's structs). */
static float value_at(uint32_t t, const uint8_t *b, int i)
{
    switch (t) {
    case KV_GGML_Q4_0: {
        int q = i < 16 ? b[2 + i] & 15 : b[2 + i - 16] >> 4;
        return h2f(b) * (float)(q - 8);
    }
    case KV_GGML_Q4_1: {
        int q = i < 16 ? b[4 + i] & 15 : b[4 + i - 16] >> 4;
        return h2f(b) * (float)q + h2f(b + 2);
    }
    case KV_GGML_Q5_0: {
        int q = (i < 16 ? b[6 + i] & 15 : b[6 + i - 16] >> 4) | bit(b + 2, i) << 4;
        return h2f(b) * (float)(q - 16);
    }
    case KV_GGML_Q5_1: {
        int q = (i < 16 ? b[8 + i] & 15 : b[8 + i - 16] >> 4) | bit(b + 4, i) << 4;
        return h2f(b) * (float)q + h2f(b + 2);
    }
    case KV_GGML_Q8_0:
        return h2f(b) * (float)(int8_t)b[2 + i];
    case KV_GGML_Q2_K: { /* scales[16] qs[64] d dmin */
        int g = i / 16, half = i / 128, sub = (i % 128) / 32, l = i % 32;
        int q = (b[16 + 32 * half + l] >> (2 * sub)) & 3;
        return h2f(b + 80) * (float)(b[g] & 15) * (float)q - h2f(b + 82) * (float)(b[g] >> 4);
    }
    case KV_GGML_Q3_K: { /* hmask[32] qs[64] scales[12] d */
        int g = i / 16, half = i / 128, sub = (i % 128) / 32, l = i % 32;
        int q = ((b[32 + 32 * half + l] >> (2 * sub)) & 3) - (bit(b + l, 4 * half + sub) ? 0 : 4);
        int lo = g < 8 ? b[96 + g] & 15 : b[96 + g - 8] >> 4;
        int hi = (b[96 + 8 + g % 4] >> (2 * (g / 4))) & 3;
        return h2f(b + 108) * (float)((lo | hi << 4) - 32) * (float)q;
    }
    case KV_GGML_Q4_K:
    case KV_GGML_Q5_K: { /* d dmin scales[12] (qh[32]) qs[128] */
        int g = i / 32, chunk = i / 64, hi = (i % 64) >= 32, l = i % 32;
        const uint8_t *s = b + 4, *qs = b + (t == KV_GGML_Q4_K ? 16 : 48);
        int q = hi ? qs[32 * chunk + l] >> 4 : qs[32 * chunk + l] & 15;
        if (t == KV_GGML_Q5_K) q |= bit(b + 16 + l, 2 * chunk + hi) << 4;
        int sc, mn;
        if (g < 4) sc = s[g] & 63, mn = s[g + 4] & 63;
        else sc = (s[g + 4] & 15) | (s[g - 4] >> 6) << 4, mn = (s[g + 4] >> 4) | (s[g] >> 6) << 4;
        return h2f(b) * (float)sc * (float)q - h2f(b + 2) * (float)mn;
    }
    case KV_GGML_Q6_K: { /* ql[128] qh[64] scales[16] d */
        int half = i / 128, sub = (i % 128) / 32, l = i % 32;
        int lo = b[64 * half + 32 * (sub & 1) + l];
        lo = sub < 2 ? lo & 15 : lo >> 4;
        int q = (lo | ((b[128 + 32 * half + l] >> (2 * sub)) & 3) << 4) - 32;
        return h2f(b + 208) * (float)(int8_t)b[192 + i / 16] * (float)q;
    }
    }
    return NAN;
}

static void fill(float *x, int n, unsigned long long *s)
{
    for (int i = 0; i < n; i++) {
        x[i] = kt_randn(s);
        if (kt_rand(s) < 0.01) x[i] *= 8; /* a few outliers, as real weights have */
    }
}

static void test_dequant_matches_the_layout(void)
{
    unsigned long long s = 11;
    const int n = 512;
    float x[512], y[512];
    for (int ti = 0; ti < NBT; ti++) {
        uint32_t t = block_types[ti];
        size_t rb = kv_quant_row_bytes(t, n);
        uint8_t *row = malloc(rb);
        /* random bytes: every bit pattern, not only those the quantizer writes
         * (fp16 fields forced finite) */
        int bad = 0;
        for (int rep = 0; rep < 20; rep++) {
            for (size_t j = 0; j < rb; j++) row[j] = (uint8_t)(kt_rand(&s) * 256);
            int bl = kv_quant_block(t), bb = (int)(rb / (size_t)(n / bl));
            for (int b = 0; b < n / bl; b++) {
                uint8_t *p = row + (size_t)b * bb;
                int offs[2], no = 0;
                switch (t) {
                case KV_GGML_Q4_1: case KV_GGML_Q5_1: case KV_GGML_Q4_K: case KV_GGML_Q5_K:
                    offs[0] = 0, offs[1] = 2, no = 2; break;
                case KV_GGML_Q2_K: offs[0] = 80, offs[1] = 82, no = 2; break;
                case KV_GGML_Q3_K: offs[0] = 108, no = 1; break;
                case KV_GGML_Q6_K: offs[0] = 208, no = 1; break;
                default: offs[0] = 0, no = 1;
                }
                for (int k = 0; k < no; k++) p[offs[k] + 1] &= 0x3b; /* |d| < 2 */
            }
            kv_quant_dequant_row(t, row, y, n);
            for (int i = 0; i < n; i++) {
                float v = value_at(t, row + (size_t)(i / bl) * bb, i % bl);
                if (!(v == y[i])) bad++;
            }
        }
        KT_CHECK(bad == 0, "%s: %d values differ from the layout decoder", tn(t), bad);
        /* and the quantizer's output decodes the same way */
        fill(x, n, &s);
        KT_REQUIRE(kv_quant_quantize_row(t, x, row, n) == KV_OK, "%s quantize", tn(t));
        kv_quant_dequant_row(t, row, y, n);
        bad = 0;
        for (int i = 0; i < n; i++)
            if (value_at(t, row + (size_t)(i / kv_quant_block(t)) * (rb / (size_t)(n / kv_quant_block(t))),
                         i % kv_quant_block(t)) != y[i])
                bad++;
        KT_CHECK(bad == 0, "%s: quantized row: %d values differ", tn(t), bad);
        free(row);
    }
}

static void test_quantizer_error_fits_the_bits(void)
{
    /* relative RMS error of gaussian rows with 1% of 8-sigma outliers
     * (groups holding an outlier dominate it), bounds ~10% above what this
     * quantizer measured when written */
    const struct { uint32_t t; double max_rel; } lim[] = {
        {KV_GGML_Q4_0, 0.14}, {KV_GGML_Q4_1, 0.095}, {KV_GGML_Q5_0, 0.08}, {KV_GGML_Q5_1, 0.05},
        {KV_GGML_Q8_0, 0.011}, {KV_GGML_Q2_K, 0.33}, {KV_GGML_Q3_K, 0.2}, {KV_GGML_Q4_K, 0.105},
        {KV_GGML_Q5_K, 0.05}, {KV_GGML_Q6_K, 0.028}, {KV_GGML_F16, 1e-3}, {KV_GGML_BF16, 8e-3},
        {KV_GGML_F32, 0},
    };
    unsigned long long s = 5;
    const int n = 4096;
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    uint8_t *row = malloc((size_t)n * 4);
    double prev = 1;
    for (size_t k = 0; k < sizeof lim / sizeof *lim; k++) {
        fill(x, n, &s);
        KT_REQUIRE(kv_quant_quantize_row(lim[k].t, x, row, n) == KV_OK, "%s", tn(lim[k].t));
        kv_quant_dequant_row(lim[k].t, row, y, n);
        double e = 0, m = 0;
        for (int i = 0; i < n; i++) e += (double)(x[i] - y[i]) * (x[i] - y[i]), m += (double)x[i] * x[i];
        double rel = sqrt(e / m);
        KT_CHECK(rel <= lim[k].max_rel, "%s: relative RMS error %.4f > %.4f", tn(lim[k].t), rel, lim[k].max_rel);
        /* more bits of the same family must not be worse */
        if (lim[k].t == KV_GGML_Q5_K || lim[k].t == KV_GGML_Q6_K)
            KT_CHECK(rel < prev, "%s (%.4f) is not better than the type with one bit less (%.4f)", tn(lim[k].t),
                     rel, prev);
        prev = rel;
    }
    /* all-zero and constant rows quantize exactly */
    for (int ti = 0; ti < NBT; ti++) {
        for (int i = 0; i < 256; i++) x[i] = 0;
        kv_quant_quantize_row(block_types[ti], x, row, 256);
        kv_quant_dequant_row(block_types[ti], row, y, 256);
        double worst = 0;
        for (int i = 0; i < 256; i++) worst = fmax(worst, fabs(y[i]));
        KT_CHECK(worst == 0, "%s: zeros decode to %g", tn(block_types[ti]), worst);
    }
    KT_CHECK(kv_quant_quantize_row(KV_GGML_Q4_K, x, row, 100) == KV_E_USAGE, "a short K-quant row is refused");
    KT_CHECK(kv_quant_quantize_row(KV_GGML_IQ2_XS, x, row, 256) == KV_E_UNSUPPORTED &&
                 strstr(kv_errdetail(), "IQ2_XS"),
             "IQ2_XS is refused by name: %s", kv_errdetail());
    free(x);
    free(y);
    free(row);
}

static void test_activations_round_trip(void)
{
    unsigned long long s = 9;
    const int n = 1024;
    float x[1024];
    fill(x, n, &s);
    x[17] = 0; /* zeros and a block of zeros */
    for (int i = 256; i < 512; i++) x[i] = 0;
    uint32_t vts[3] = {KV_GGML_Q8_0, KV_GGML_Q8_1, KV_GGML_Q8_K};
    for (int v = 0; v < 3; v++) {
        uint8_t *q = malloc(kv_quant_vec_bytes(vts[v], n));
        kv_quant_activations(vts[v], x, q, n);
        double worst = 0;
        int badsum = 0;
        for (int i = 0; i < n; i++) {
            float d, val;
            if (vts[v] == KV_GGML_Q8_K) {
                const kv_block_q8_k *b = (const kv_block_q8_k *)q + i / 256;
                d = b->d, val = d * (float)b->qs[i % 256];
                if (i % 16 == 0) {
                    int sum = 0;
                    for (int j = 0; j < 16; j++) sum += b->qs[i % 256 + j];
                    badsum += sum != b->bsums[(i % 256) / 16];
                }
            } else if (vts[v] == KV_GGML_Q8_0) {
                const kv_block_q8_0 *b = (const kv_block_q8_0 *)q + i / 32;
                d = kv_half_to_f32(b->d), val = d * (float)b->qs[i % 32];
            } else {
                const kv_block_q8_1 *b = (const kv_block_q8_1 *)q + i / 32;
                d = kv_half_to_f32(b->d), val = d * (float)b->qs[i % 32];
                if (i % 32 == 0) {
                    int sum = 0;
                    for (int j = 0; j < 32; j++) sum += b->qs[j];
                    badsum += fabsf(kv_half_to_f32(b->s) - d * (float)sum) > 1e-3f * (1 + fabsf(d * (float)sum));
                }
            }
            /* half a step, plus 127 codes times the fp16 rounding of the step */
            worst = fmax(worst, fabs(val - x[i]) - (0.5 + 127.0 / 2048) * fabs(d) * 1.001);
        }
        KT_CHECK(worst <= 1e-6, "%s: an activation is off by more than half a step (%g)", tn(vts[v]), worst);
        KT_CHECK(badsum == 0, "%s: %d group sums are wrong", tn(vts[v]), badsum);
        free(q);
    }
}

static void test_fast_dots_match_the_reference(void)
{
    unsigned long long s = 21;
    const int n = 2048;
    float *w = malloc(n * sizeof *w), *x = malloc(n * sizeof *x), *wd = malloc(n * sizeof *wd);
    for (int ti = 0; ti < NBT; ti++) {
        uint32_t t = block_types[ti], vt = kv_quant_vec_type(t);
        uint8_t *row = malloc(kv_quant_row_bytes(t, n)), *xq = malloc(kv_quant_vec_bytes(vt, n));
        float *xd = malloc(n * sizeof *xd);
        double worst_ref = 0, worst_fast = 0;
        for (int rep = 0; rep < 8; rep++) {
            fill(w, n, &s);
            fill(x, n, &s);
            kv_quant_quantize_row(t, w, row, n);
            kv_quant_dequant_row(t, row, wd, n);
            kv_quant_activations(vt, x, xq, n);
            /* the activations as the kernel sees them */
            for (int i = 0; i < n; i++) {
                if (vt == KV_GGML_Q8_K) {
                    const kv_block_q8_k *b = (const kv_block_q8_k *)xq + i / 256;
                    xd[i] = b->d * (float)b->qs[i % 256];
                } else if (vt == KV_GGML_Q8_0) {
                    const kv_block_q8_0 *b = (const kv_block_q8_0 *)xq + i / 32;
                    xd[i] = kv_half_to_f32(b->d) * (float)b->qs[i % 32];
                } else {
                    const kv_block_q8_1 *b = (const kv_block_q8_1 *)xq + i / 32;
                    xd[i] = kv_half_to_f32(b->d) * (float)b->qs[i % 32];
                }
            }
            double exact = 0, mag = 0;
            for (int i = 0; i < n; i++) exact += (double)wd[i] * xd[i], mag += fabs((double)wd[i] * xd[i]);
            float r = kv_quant_dot_ref(t, row, xq, n);
            /* Q4_1/Q5_1 add m * s with s rounded to fp16: allow that rounding */
            double tol = (t == KV_GGML_Q4_1 || t == KV_GGML_Q5_1) ? 2e-3 : 1e-5;
            worst_ref = fmax(worst_ref, fabs(r - exact) / (mag + 1e-9) / tol);
            kv_qdot_fn fast = kv_qdot_select(t, true), port = kv_qdot_select(t, false);
            KT_REQUIRE(fast && port, "%s has kernels", tn(t));
            worst_fast = fmax(worst_fast, fabs(fast(row, xq, n) - r) / (mag + 1e-9) / 1e-5);
            worst_fast = fmax(worst_fast, fabs(port(row, xq, n) - r) / (mag + 1e-9) / 1e-5);
        }
        KT_CHECK(worst_ref <= 1, "%s: reference dot is %.2f tolerances from the exact sum", tn(t), worst_ref);
        KT_CHECK(worst_fast <= 1, "%s: fast dot is %.2f tolerances from the reference", tn(t), worst_fast);
        free(row);
        free(xq);
        free(xd);
    }
    free(w);
    free(x);
    free(wd);
}

/* Codes of value i of a Q2_K, Q3_K, Q5_K or Q6_K block, from the layout
 * (as value_at): q the code with its fixed offset applied (Q3_K: -4 where
 * the high bit is clear; Q6_K: -32), sc its group's scale, mn its group's
 * min (Q2_K, Q5_K), so the value is d*sc*q - dmin*mn. */
static void codes_at(uint32_t t, const uint8_t *b, int i, int *q, int *sc, int *mn)
{
    int g = i / 16, half = i / 128, sub = (i % 128) / 32, l = i % 32;
    *mn = 0;
    if (t == KV_GGML_Q2_K) {
        *q = (b[16 + 32 * half + l] >> (2 * sub)) & 3;
        *sc = b[g] & 15, *mn = b[g] >> 4;
    } else if (t == KV_GGML_Q3_K) {
        *q = ((b[32 + 32 * half + l] >> (2 * sub)) & 3) - (bit(b + l, 4 * half + sub) ? 0 : 4);
        int lo = g < 8 ? b[96 + g] & 15 : b[96 + g - 8] >> 4;
        *sc = (lo | ((b[96 + 8 + g % 4] >> (2 * (g / 4))) & 3) << 4) - 32;
    } else if (t == KV_GGML_Q5_K) {
        int g32 = i / 32, chunk = i / 64, hi = (i % 64) >= 32;
        const uint8_t *s = b + 4;
        *q = (hi ? b[48 + 32 * chunk + l] >> 4 : b[48 + 32 * chunk + l] & 15) | bit(b + 16 + l, 2 * chunk + hi) << 4;
        if (g32 < 4) *sc = s[g32] & 63, *mn = s[g32 + 4] & 63;
        else *sc = (s[g32 + 4] & 15) | (s[g32 - 4] >> 6) << 4, *mn = (s[g32 + 4] >> 4) | (s[g32] >> 6) << 4;
    } else { /* Q6_K */
        int lo = b[64 * half + 32 * (sub & 1) + l];
        lo = sub < 2 ? lo & 15 : lo >> 4;
        *q = (lo | ((b[128 + 32 * half + l] >> (2 * sub)) & 3) << 4) - 32;
        *sc = (int8_t)b[192 + g];
    }
}

/* The AVX2 K-quant dot as llama.cpp's AVX2 kernels (ggml-cpu's
 * ggml_vec_dot_q{2,3,5,6}_K_q8_K) compute it, written out lane by lane:
 * each of 8 float lanes holds an exact integer sum (lane j: values 4j..4j+3
 * of every 32 consecutive values; Q6_K's -32 taken off as 32 times groups
 * 2j and 2j+1 of scale * activation sum, Q2_K's mins likewise), rounded
 * once per superblock into the lane by an fma, the 8 lanes summed in the
 * order of a 256-bit horizontal add; Q5_K's mins a fused running sum. */
static float k_dot_lanes(uint32_t t, const uint8_t *row, const kv_block_q8_k *y, int n)
{
    const size_t bb = kv_quant_row_bytes(t, 256);
    float acc[8] = {0}, accm = 0;
    for (int b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + bb * b;
        long long L[8] = {0}, M[8] = {0}, msum = 0;
        int q, sc, mn;
        for (int v = 0; v < 256; v++) {
            codes_at(t, blk, v, &q, &sc, &mn);
            L[(v % 32) / 4] += (long long)sc * (t == KV_GGML_Q6_K ? q + 32 : q) * y[b].qs[v];
        }
        for (int j = 0; j < 8; j++)
            for (int g = 2 * j; g < 2 * j + 2; g++) {
                codes_at(t, blk, 16 * g, &q, &sc, &mn);
                if (t == KV_GGML_Q6_K) L[j] -= 32LL * sc * y[b].bsums[g];
                M[j] += (long long)mn * y[b].bsums[g];
            }
        for (int k = 0; k < 8; k++) msum += M[k];
        float d, dmin = 0;
        if (t == KV_GGML_Q2_K) d = h2f(blk + 80), dmin = h2f(blk + 82);
        else if (t == KV_GGML_Q3_K) d = h2f(blk + 108);
        else if (t == KV_GGML_Q5_K) d = h2f(blk), dmin = h2f(blk + 2);
        else d = h2f(blk + 208);
        for (int j = 0; j < 8; j++) {
            if (t == KV_GGML_Q2_K) acc[j] = fmaf(-(y[b].d * dmin), (float)M[j], acc[j]);
            acc[j] = fmaf(y[b].d * d, (float)L[j], acc[j]);
        }
        if (t == KV_GGML_Q5_K) accm = fmaf(y[b].d * dmin, (float)msum, accm);
    }
    return (((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))) - accm;
}

/* Bit for bit, not within a tolerance: the cross-check against llama.cpp
 * (docs/BENCHMARKS.md, helper B8) needs the same numbers, and the -32 and
 * -4 offsets taken off in integers keep bits a float correction after the
 * rounding lost to cancellation. */
static void test_k_quant_dots_sum_lanes_as_llama_cpp(void)
{
    static const uint32_t types[] = {KV_GGML_Q2_K, KV_GGML_Q3_K, KV_GGML_Q5_K, KV_GGML_Q6_K};
    unsigned long long s = 77;
    const int n = 2048;
    float *w = malloc(n * sizeof *w), *x = malloc(n * sizeof *x);
    for (int ti = 0; ti < 4; ti++) {
        const uint32_t t = types[ti];
        uint8_t *row = malloc(kv_quant_row_bytes(t, n)), *xq = malloc(kv_quant_vec_bytes(KV_GGML_Q8_K, n));
        kv_qdot_fn fast = kv_qdot_select(t, true);
        int differ = 0;
        for (int rep = 0; rep < 16; rep++) {
            fill(w, n, &s);
            fill(x, n, &s);
            kv_quant_quantize_row(t, w, row, n);
            kv_quant_activations(KV_GGML_Q8_K, x, xq, n);
            float a = fast(row, xq, n), b = k_dot_lanes(t, row, (const kv_block_q8_k *)xq, n);
            differ += memcmp(&a, &b, sizeof a) != 0;
        }
        KT_CHECK(differ == 0, "%s: AVX2 dot differs from the lane sums in %d of 16 rows", tn(t), differ);
        /* The extremes of every code, scale and min byte against activation
         * codes of +-127: the 16-bit pair sums and 32-bit lanes of the AVX2
         * form must hold them (the lane model sums in 64 bits, so an
         * overflow shows as a difference); the block's fp16 scales are set
         * to 1 so that the sums stay finite. */
        static const uint8_t fills[] = {0xFF, 0x00, 0x80, 0x7F, 0x55};
        const size_t bb = kv_quant_row_bytes(t, 256);
        const int d_at = t == KV_GGML_Q2_K ? 80 : t == KV_GGML_Q3_K ? 108 : t == KV_GGML_Q5_K ? 0 : 208;
        int bad = 0;
        for (int fi = 0; fi < 5; fi++) {
            for (int sign = 0; sign < 2; sign++) {
                memset(row, fills[fi], kv_quant_row_bytes(t, n));
                for (int b = 0; b < n / 256; b++) {
                    uint8_t *blk = row + bb * b;
                    blk[d_at] = 0x00, blk[d_at + 1] = 0x3C; /* fp16 1.0 */
                    if (t == KV_GGML_Q2_K || t == KV_GGML_Q5_K) blk[d_at + 2] = 0x00, blk[d_at + 3] = 0x3C;
                }
                for (int i = 0; i < n; i++) x[i] = sign ? (i & 1 ? -1.0f : 1.0f) : -1.0f;
                kv_quant_activations(KV_GGML_Q8_K, x, xq, n);
                float a = fast(row, xq, n), b = k_dot_lanes(t, row, (const kv_block_q8_k *)xq, n);
                bad += memcmp(&a, &b, sizeof a) != 0;
            }
        }
        KT_CHECK(bad == 0, "%s: AVX2 dot differs from the lane sums on %d of 10 extreme rows", tn(t), bad);
        free(row);
        free(xq);
    }
    free(w);
    free(x);
}

static void test_matrix_entry_points_with_bias_and_permutation(void)
{
    unsigned long long s = 33;
    const int rows = 21, cols = 512, nt = 5;
    float *wf = malloc((size_t)rows * cols * 4), *X = malloc((size_t)nt * cols * 4);
    float bias[21];
    int32_t perm[21];
    for (int r = 0; r < rows; r++) bias[r] = kt_randn(&s), perm[r] = (r * 8) % rows; /* 8 and 21 coprime */
    fill(wf, rows * cols, &s);
    fill(X, nt * cols, &s);
    for (int wt = 0; wt < KV_DT_ALL; wt++) {
        uint32_t g = kv_dtype_ggml((kv_dtype)wt);
        if (g == UINT32_MAX) continue; /* not a weight type (I32, U8, ...) */
        size_t rb = kv_dtype_row_bytes((kv_dtype)wt, cols);
        uint8_t *raw = malloc(rb * rows);
        for (int r = 0; r < rows; r++) kv_quant_quantize_row(g, wf + (size_t)r * cols, raw + rb * r, cols);
        kv_weight w = {.type = (kv_dtype)wt, .rows = rows, .cols = cols, .data = raw, .bias = bias, .perm = perm};
        uint32_t vt = kv_quant_vec_type(g);
        uint8_t *xq = malloc(kv_quant_vec_bytes(vt, cols));
        float *rowf = malloc(cols * 4);
        double worst = 0;
        float y[21], Y[5 * 21], y2[21];
        for (int t = 0; t < nt; t++) {
            const float *x = X + (size_t)t * cols;
            kv_quant_activations(vt, x, xq, cols);
            kv_matvec(&w, x, y);
            for (int r = 0; r < rows; r++) {
                const uint8_t *p = raw + rb * perm[r];
                double ref;
                if (kv_quant_is_block(g)) {
                    ref = kv_quant_dot_ref(g, p, xq, cols);
                } else {
                    /* F16 and BF16 rows meet the input rounded to their type */
                    kv_quant_dequant_row(g, p, rowf, cols);
                    ref = 0;
                    for (int k = 0; k < cols; k++) {
                        float xk = g == KV_GGML_F16 ? kv_round_half(x[k])
                                 : g == KV_GGML_BF16 ? kv_bf16_to_f32(kv_f32_to_bf16(x[k])) : x[k];
                        ref += (double)rowf[k] * xk;
                    }
                }
                worst = fmax(worst, fabs(y[r] - (ref + bias[r])) / (1 + fabs(ref)));
            }
        }
        kv_matmul(&w, X, nt, Y);
        for (int t = 0; t < nt; t++) {
            kv_matvec(&w, X + (size_t)t * cols, y);
            for (int r = 0; r < rows; r++) worst = fmax(worst, fabs(Y[t * rows + r] - y[r]) / (1 + fabs(y[r])));
        }
        const kv_weight *ws[2] = {&w, &w};
        float *ys[2] = {y, y2};
        kv_matvec_multi(2, ws, X, ys);
        float y0[21];
        kv_matvec(&w, X, y0);
        for (int r = 0; r < rows; r++) worst = fmax(worst, fmax(fabs(y[r] - y0[r]), fabs(y2[r] - y0[r])));
        kv_weight_row(&w, 4, rowf);
        float want[512];
        kv_quant_dequant_row(g, raw + rb * perm[4], want, cols);
        for (int k = 0; k < cols; k++) worst = fmax(worst, fabs(rowf[k] - want[k]));
        KT_CHECK(worst < 2e-5, "%s: entry points differ from the reference by %g", kv_dtype_name((kv_dtype)wt),
                 worst);
        free(raw);
        free(xq);
        free(rowf);
    }
    free(wf);
    free(X);
}

static void test_type_names_and_sizes(void)
{
    char b[16];
    KT_CHECK(!strcmp(kv_ggml_type_name(KV_GGML_Q3_K, b), "Q3_K"), "Q3_K");
    KT_CHECK(!strcmp(kv_ggml_type_name(KV_GGML_IQ2_XS, b), "IQ2_XS"), "IQ2_XS");
    KT_CHECK(!strcmp(kv_ggml_type_name(77, b), "type 77"), "unknown: %s", b);
    KT_CHECK(kv_ggml_type_parse("q4_k") == KV_GGML_Q4_K && kv_ggml_type_parse("BF16") == KV_GGML_BF16 &&
                 kv_ggml_type_parse("Q4_2") == -1 && kv_ggml_type_parse("nope") == -1,
             "parse");
    KT_CHECK(kv_quant_row_bytes(KV_GGML_Q4_K, 4096) == 16 * 144 && kv_quant_row_bytes(KV_GGML_Q6_K, 256) == 210 &&
                 kv_quant_row_bytes(KV_GGML_Q5_0, 64) == 44 && kv_quant_row_bytes(KV_GGML_IQ2_XS, 256) == 0,
             "row bytes");
    int weight_types = 0;
    for (int wt = 0; wt < KV_DT_ALL; wt++) {
        uint32_t g = kv_dtype_ggml((kv_dtype)wt);
        if (g == UINT32_MAX) continue;
        weight_types++;
        char gb[16];
        KT_CHECK(kv_dtype_from_ggml(g) == (kv_dtype)wt && !strcmp(kv_dtype_name((kv_dtype)wt), kv_ggml_type_name(g, gb)),
                 "dtype %d maps both ways", wt);
        KT_CHECK(kv_dtype_row_bytes((kv_dtype)wt, 512) == kv_quant_row_bytes(g, 512) &&
                     kv_dtype_block((kv_dtype)wt) == kv_quant_block(g) &&
                     kv_dtype_is_block((kv_dtype)wt) == kv_quant_is_block(g),
                 "%s: the same sizes as ggml's table", kv_dtype_name((kv_dtype)wt));
    }
    KT_CHECK(weight_types == 13, "13 weight types (F32, F16, BF16 and ten block types): %d", weight_types);
    KT_CHECK(kv_dtype_from_ggml(KV_GGML_IQ4_XS) == KV_DT_AUTO && kv_dtype_from_ggml(KV_GGML_Q8_K) == KV_DT_AUTO,
             "unusable types");
}

int main(void)
{
    KT_RUN(test_dequant_matches_the_layout);
    KT_RUN(test_quantizer_error_fits_the_bits);
    KT_RUN(test_activations_round_trip);
    KT_RUN(test_fast_dots_match_the_reference);
    if (strcmp(kv_matmul_isa(), "avx2") == 0) KT_RUN(test_k_quant_dots_sum_lanes_as_llama_cpp);
    else KT_SKIP(test_k_quant_dots_sum_lanes_as_llama_cpp, "no AVX2 kernels on this CPU");
    KT_RUN(test_matrix_entry_points_with_bias_and_permutation);
    KT_RUN(test_type_names_and_sizes);
    return kt_done();
}
