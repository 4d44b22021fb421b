/*
 * libFuzzer target for the packed weight types (lib/common/kv_ggml.h,
 * lib/model/kv_quants.c, lib/model/kv_matmul_q.c, the GGUF loader of them).
 * The first byte picks the mode:
 *   < 0xF0: the byte picks a block type and the rest is packed rows of it:
 *           dequantize, quantize the values back, and take the dot product
 *           of the rows with a quantized vector through the reference and
 *           the fast kernel, which must agree (or the target aborts);
 *   else:   the rest is a GGUF model (K-quant seeds), loaded and run.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_ggml.h"
#include "model/kv_matmul_q.h"
#include "model/kv_quants.h"

#include "fuzz_run_model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const uint32_t types[] = {KV_GGML_Q4_0, KV_GGML_Q4_1, KV_GGML_Q5_0, KV_GGML_Q5_1, KV_GGML_Q8_0,
                                 KV_GGML_Q2_K, KV_GGML_Q3_K, KV_GGML_Q4_K, KV_GGML_Q5_K, KV_GGML_Q6_K};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    if (data[0] >= 0xF0) {
        fuzz_run_model(data + 1, size - 1);
        return 0;
    }
    uint32_t t = types[data[0] % 10];
    int bl = kv_quant_block(t);
    size_t bb = kv_quant_row_bytes(t, bl);
    size_t nb = (size - 1) / bb;
    if (nb == 0 || nb > 64) return 0;
    int n = (int)nb * bl;
    const uint8_t *row = data + 1;
    float *y = malloc((size_t)n * sizeof *y), *x = malloc((size_t)n * sizeof *x);
    uint8_t *re = malloc(nb * bb);
    uint32_t vt = kv_quant_vec_type(t);
    uint8_t *xq = malloc(kv_quant_vec_bytes(vt, n));
    if (!y || !x || !re || !xq) goto done;
    kv_quant_dequant_row(t, row, y, n);
    bool finite = true;
    for (int i = 0; i < n; i++) finite &= isfinite(y[i]) && fabsf(y[i]) < 1e30f;
    if (finite) kv_quant_quantize_row(t, y, re, n);
    for (int i = 0; i < n; i++) x[i] = (float)((i * 37) % 19) - 9.0f;
    kv_quant_activations(vt, x, xq, n);
    float r = kv_quant_dot_ref(t, row, xq, n), f = kv_qdot_select(t, true)(row, xq, n);
    double mag = 0;
    for (int i = 0; i < n; i++) mag += fabs((double)y[i] * x[i]);
    if (finite && mag < 1e30 && isfinite(r) && fabs((double)r - f) > 1e-4 * (mag + 1)) {
        fprintf(stderr, "kernel %u disagrees with the reference: %g vs %g (|terms| %g)\n", t, f, r, mag);
        abort();
    }
done:
    free(y);
    free(x);
    free(re);
    free(xq);
    return 0;
}
