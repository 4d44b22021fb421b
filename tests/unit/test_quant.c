/*
 * Unit tests of the KIVI quantizer (lib/quant/kv_quant.c): packing and unpacking
 * for every bit width and both axes on fresh random data, compared with a
 * plain re-implementation of the formula written here one element at a
 * time; edge cases (T not a multiple of G, T < R, constant channels), the
 * exact byte-size formula, and incremental packing equal to whole packing.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kt.h"
#include "quant/kv_quant.h"

/* KT_REQUIRE evaluates its condition twice: call once, then require. */
#define KT_OK(call)                                                              \
    do {                                                                         \
        kv_status st_ = (call);                                                  \
        KT_REQUIRE(st_ == KV_OK, "%s: %s", #call, kv_errdetail());               \
    } while (0)

static unsigned long long seed = 0x9e3779b97f4a7c15ULL;

static float *rand_tensor(size_t n, float scale)
{
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = scale * kt_randn(&seed);
    return x;
}

/* The formula of kv_quant.h, element by element: quantize then dequantize
 * the values x[idx[0..n)] that form one group. */
static void ref_group(const float *x, const size_t *idx, int n, int bits, float *out)
{
    float mn = x[idx[0]], mx = x[idx[0]];
    for (int i = 1; i < n; i++) {
        if (x[idx[i]] < mn) mn = x[idx[i]];
        if (x[idx[i]] > mx) mx = x[idx[i]];
    }
    float maxq = (float)((1 << bits) - 1);
    float s = kv_round_half((mx - mn) / maxq), z = kv_round_half(mn);
    for (int i = 0; i < n; i++) {
        float code = 0;
        if (s != 0) {
            code = rintf((x[idx[i]] - z) / s);
            if (code < 0) code = 0;
            if (code > maxq) code = maxq;
        }
        out[idx[i]] = z + s * code;
    }
}

static void ref_kivi(const float *x, kv_kivi_axis axis, const kv_kivi_params *p, int H, int T,
                     int D, float *out)
{
    int nq = kv_kivi_nquant(T, p->group, p->residual);
    int gv = kv_kivi_vgroup(p->group, D);
    size_t *idx = malloc((size_t)(p->group > D ? p->group : D) * sizeof *idx);
    for (int h = 0; h < H; h++) {
        size_t base = (size_t)h * T * D;
        if (axis == KV_KIVI_KEYS) {
            for (int g = 0; g < nq / p->group; g++)
                for (int c = 0; c < D; c++) {
                    for (int i = 0; i < p->group; i++)
                        idx[i] = base + (size_t)(g * p->group + i) * D + c;
                    ref_group(x, idx, p->group, p->bits, out);
                }
        } else {
            for (int t = 0; t < nq; t++)
                for (int g = 0; g < D / gv; g++) {
                    for (int i = 0; i < gv; i++) idx[i] = base + (size_t)t * D + g * gv + i;
                    ref_group(x, idx, gv, p->bits, out);
                }
        }
        for (size_t k = base + (size_t)nq * D; k < base + (size_t)T * D; k++)
            out[k] = kv_round_half(x[k]);
    }
    free(idx);
}

static void check_case(kv_kivi_axis axis, int bits, int G, int R, int H, int T, int D)
{
    kv_kivi_params p = {bits, G, R};
    size_t n = (size_t)H * T * D;
    float *x = rand_tensor(n, 1.5f);
    /* one constant channel and one constant token row, so scale == 0 occurs */
    for (int t = 0; t < T; t++) x[(size_t)t * D + 1] = 0.25f;
    if (T > 2)
        for (int c = 0; c < D; c++) x[(size_t)2 * D + c] = -1.0f;
    float *got = malloc(n * sizeof *got), *want = malloc(n * sizeof *want);
    kv_kivi_packed pk;
    kv_status st = kv_kivi_pack(x, axis, &p, H, T, D, &pk);
    KT_REQUIRE(st == KV_OK, "pack: %s", kv_errdetail());
    kv_kivi_unpack(&pk, got);
    ref_kivi(x, axis, &p, H, T, D, want);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i]) bad++;
    KT_CHECK(bad == 0, "axis %d bits %d G %d R %d T %d: %zu of %zu values differ", axis, bits,
             G, R, T, bad, n);
    KT_CHECK(pk.nq == kv_kivi_nquant(T, G, R), "nq %d", pk.nq);
    kv_kivi_clear(&pk);
    free(x);
    free(got);
    free(want);
}

static void test_roundtrip_all_widths_and_axes(void)
{
    int bits[] = {1, 2, 4};
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 3; b++) {
            check_case((kv_kivi_axis)a, bits[b], 32, 64, 2, 300, 64); /* T % G != 0 */
            check_case((kv_kivi_axis)a, bits[b], 64, 128, 3, 256, 128);
            check_case((kv_kivi_axis)a, bits[b], 16, 0, 1, 48, 8);    /* G > D: Gv = D */
        }
}

static void test_short_cache_is_all_residual(void)
{
    kv_kivi_params p = {2, 32, 128};
    float *x = rand_tensor(2 * 100 * 32, 1.0f);
    kv_kivi_packed pk;
    KT_OK(kv_kivi_pack(x, KV_KIVI_KEYS, &p, 2, 100, 32, &pk));
    KT_CHECK(pk.nq == 0, "nq %d", pk.nq);
    float *y = malloc(2 * 100 * 32 * sizeof *y);
    kv_kivi_unpack(&pk, y);
    for (int i = 0; i < 2 * 100 * 32; i++)
        KT_REQUIRE(y[i] == kv_round_half(x[i]), "residual %d: %g vs %g", i, y[i], x[i]);
    kv_kivi_clear(&pk);
    free(x);
    free(y);
}

static void test_constant_group_decodes_exactly(void)
{
    /* scale 0: every code 0 and the value is the fp16 zero */
    kv_kivi_params p = {1, 4, 0};
    float x[4 * 8];
    for (int i = 0; i < 32; i++) x[i] = 0.5f;
    kv_kivi_packed pk;
    KT_OK(kv_kivi_pack(x, KV_KIVI_KEYS, &p, 1, 4, 8, &pk));
    for (int c = 0; c < 8; c++) KT_CHECK(pk.scale[c] == 0, "scale %d = %u", c, pk.scale[c]);
    for (int i = 0; i < 4; i++) KT_CHECK(pk.codes[i] == 0, "codes %d = %u", i, pk.codes[i]);
    float y[32];
    kv_kivi_unpack(&pk, y);
    for (int i = 0; i < 32; i++) KT_CHECK(y[i] == 0.5f, "%d: %g", i, y[i]);
    kv_kivi_clear(&pk);
}

static void test_byte_size_formula(void)
{
    /* Llama-3 layer: 8 heads, D 128, T 1000, G 64, R 128 -> nq 832 */
    kv_kivi_params p = {1, 64, 128};
    int H = 8, T = 1000, D = 128, nq = 832;
    KT_CHECK(kv_kivi_nquant(T, 64, 128) == nq, "nq");
    size_t keys = (size_t)H * nq * 16 + 4 * (size_t)H * (nq / 64) * D + 2 * (size_t)H * (T - nq) * D;
    size_t vals = (size_t)H * nq * 16 + 4 * (size_t)H * nq * (D / 64) + 2 * (size_t)H * (T - nq) * D;
    KT_CHECK(kv_kivi_bytes(KV_KIVI_KEYS, &p, H, T, D) == keys, "keys %zu vs %zu",
             kv_kivi_bytes(KV_KIVI_KEYS, &p, H, T, D), keys);
    KT_CHECK(kv_kivi_bytes(KV_KIVI_VALUES, &p, H, T, D) == vals, "values");
    p.bits = 4;
    KT_CHECK(kv_kivi_codes_bytes(KV_KIVI_KEYS, &p, H, T, D) == (size_t)H * nq * 64, "4-bit codes");
    /* the allocation matches the accounting */
    kv_kivi_packed pk;
    KT_OK(kv_kivi_init(&pk, KV_KIVI_VALUES, &p, H, T, D));
    KT_CHECK(pk.nq == nq, "nq %d", pk.nq);
    kv_kivi_clear(&pk);
}

static void test_incremental_equals_whole(void)
{
    /* A policy packs one key group and G value rows as they fill up. */
    kv_kivi_params p = {2, 16, 32};
    int H = 1, T = 80, D = 32, G = 16;
    float *x = rand_tensor((size_t)T * D, 2.0f);
    kv_kivi_packed k, v;
    KT_OK(kv_kivi_pack(x, KV_KIVI_KEYS, &p, H, T, D, &k));
    KT_OK(kv_kivi_pack(x, KV_KIVI_VALUES, &p, H, T, D, &v));
    KT_CHECK(k.nq == 48, "nq %d", k.nq);
    uint8_t codes[16 * 8];
    kv_half s[32], z[32];
    for (int g = 0; g < k.nq / G; g++) {
        kv_kivi_pack_key_group(x + (size_t)g * G * D, D, G, D, 2, codes, 8, s, z);
        KT_CHECK(!memcmp(codes, k.codes + (size_t)g * G * 8, sizeof codes), "key group %d codes", g);
        KT_CHECK(!memcmp(s, k.scale + g * D, sizeof s) && !memcmp(z, k.zero + g * D, sizeof z),
                 "key group %d scale/zero", g);
    }
    for (int t = 0; t < v.nq; t++) {
        kv_kivi_pack_value_row(x + (size_t)t * D, D, 16, 2, codes, s, z);
        KT_CHECK(!memcmp(codes, v.codes + (size_t)t * 8, 8), "value row %d", t);
        KT_CHECK(!memcmp(s, v.scale + 2 * t, 4) && !memcmp(z, v.zero + 2 * t, 4), "row %d sz", t);
        float row[32], full[32 * 80];
        kv_kivi_dequant_row(codes, s, z, D, 2, 16, row);
        kv_kivi_unpack(&v, full);
        KT_CHECK(!memcmp(row, full + (size_t)t * D, sizeof row), "dequant row %d", t);
    }
    kv_kivi_clear(&k);
    kv_kivi_clear(&v);
    free(x);
}

static void test_bad_params_are_rejected(void)
{
    kv_kivi_params p = {3, 64, 128};
    KT_CHECK(kv_kivi_check(&p, 128) == KV_E_USAGE, "3 bits");
    p.bits = 1;
    KT_CHECK(kv_kivi_check(&p, 12) == KV_E_USAGE, "12 channels at 1 bit");
    p.group = 48;
    KT_CHECK(kv_kivi_check(&p, 64) == KV_E_USAGE, "64 not a multiple of 48");
    p.group = 0;
    KT_CHECK(kv_kivi_check(&p, 64) == KV_E_USAGE, "group 0");
    p.group = 64;
    KT_CHECK(kv_kivi_check(&p, 64) == KV_OK, "good");
}

static void test_nan_input_does_not_crash(void)
{
    kv_kivi_params p = {2, 4, 0};
    float x[4 * 8];
    for (int i = 0; i < 32; i++) x[i] = (float)i;
    x[5] = NAN;
    x[9] = INFINITY;
    kv_kivi_packed pk;
    KT_OK(kv_kivi_pack(x, KV_KIVI_KEYS, &p, 1, 4, 8, &pk));
    for (int i = 0; i < 8; i++) KT_CHECK(pk.codes[i] <= 255, "codes");
    kv_kivi_clear(&pk);
}

int main(void)
{
    KT_RUN(test_roundtrip_all_widths_and_axes);
    KT_RUN(test_short_cache_is_all_residual);
    KT_RUN(test_constant_group_decodes_exactly);
    KT_RUN(test_byte_size_formula);
    KT_RUN(test_incremental_equals_whole);
    KT_RUN(test_bad_params_are_rejected);
    KT_RUN(test_nan_input_does_not_crash);
    return kt_done();
}
