/*
 * The CPU weight kernels' two inner paths (lib/model/kv_matmul.c): the
 * portable one, chosen by kv_matmul_set_portable, against the one the CPU
 * would pick (AVX2+FMA where present), and both against float64, on f32,
 * f16 and bf16 weights.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kt.h"
#include "common/kv_half.h"
#include "model/kv_matmul.h"

static unsigned long long seed = 0x6d61746d756cULL;

/* y = W x with each path, against float64; returns the paths' difference. */
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
        ref[i / (size_t)cols] += (double)wq * x[i % (size_t)cols];
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

int main(void)
{
    KT_RUN(test_portable_path_matches_the_chosen_one);
    return kt_done();
}
