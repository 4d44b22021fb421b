/*
 * Each CUDA kernel against its CPU reference: KIVI pack byte for byte
 * against lib/quant/kv_quant.c, unpack exactly, and the fp16 and packed decode
 * attention by normalized error ||gpu - ref|| / ||ref|| against
 * lib/attn/kv_attn.c, on fresh random data (seed printed; KT_SEED repeats it) and
 * on real layer-0 K/V of niah4k.  The fp16 attention is tested at every
 * geometry the GPU engine uses it for, and in its measurement variants.  Outputs are poisoned with NaN before each
 * launch so an unwritten element fails.  Without a usable GPU (or in a
 * CPU-only build) every test is reported as a TAP skip with a notice.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kt.h"
#include "attn/kv_attn.h"
#include "quant/kv_kivi.h"
#include "gpu/kv_gpu.h"

static unsigned long long seed;

#ifdef KV_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "attn_realdata.h"

#include "quant/kv_dsq.h"
#include "kv_kernels.h"

/* Tolerances on normalized error: the register fp16 attention accumulates
 * in fp32 like the reference; the tensor-core fp16 kernel (head dims 64 and
 * 128, up to 16 query heads per KV head: attn_f16_tc.cu) and the packed
 * kernel round the (prescaled) query and the probabilities p (times the
 * value scale) to fp16 operands (relative 2^-11 per term, fp32 sums). */
#define TOL_F16 1e-4
#define TOL_F16_TC 2e-3
#define TOL_KIVI 4e-3

static double nerr(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / den);
}

static void *dalloc(size_t n)
{
    void *p = NULL;
    if (cudaMalloc(&p, n ? n : 1) != cudaSuccess) return NULL;
    return p;
}

static void *dup_to_device(const void *h, size_t n)
{
    void *p = dalloc(n);
    if (p && n && cudaMemcpy(p, h, n, cudaMemcpyHostToDevice) != cudaSuccess) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

static int from_device(void *h, const void *d, size_t n)
{
    return cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost) == cudaSuccess &&
                   cudaDeviceSynchronize() == cudaSuccess
               ? 0
               : -1;
}

/* Random fp16 data (kv_heads, T, D) with an outlier channel, as half and float. */
static void rand_half(size_t n, int D, kv_half *h, float *f)
{
    for (size_t i = 0; i < n; i++) {
        float x = kt_randn(&seed) + ((i % (size_t)D) == 3 ? 8.0f : 0.0f);
        h[i] = kv_f32_to_half(x);
        f[i] = kv_half_to_f32(h[i]);
    }
}

// --- pack / unpack -----------------------------------------------------------------

/* Pack on both sides and compare every part byte for byte; 0 when equal. */
static int pack_case(kv_kivi_axis axis, int bits, int G, int R, int H, int T, int D,
                     const kv_half *xh, const float *xf, char *why, size_t nwhy)
{
    kv_kivi_params prm = {bits, G, R};
    kv_kivi_packed cpu;
    if (kv_kivi_pack(xf, axis, &prm, H, T, D, &cpu) != KV_OK) {
        snprintf(why, nwhy, "CPU pack refused: %s", kv_errdetail());
        return -1;
    }
    size_t nc = kv_kivi_codes_bytes(axis, &prm, H, T, D);
    size_t ns = kv_kivi_scale_count(axis, &prm, H, T, D);
    size_t nr = kv_kivi_resid_count(&prm, H, T, D);
    uint16_t *dx = dup_to_device(xh, (size_t)H * T * D * 2);
    kv_cuda_kivi_out o = {dalloc(nc), dalloc(ns * 2), dalloc(ns * 2), dalloc(nr * 2)};
    uint8_t *gc = malloc(nc + 1);
    kv_half *gs = malloc(ns * 2 + 2), *gz = malloc(ns * 2 + 2), *gr = malloc(nr * 2 + 2);
    int rc = -1;
    if (!dx || !o.codes || !o.scale || !o.zero || !o.resid || !gc || !gs || !gz || !gr) {
        snprintf(why, nwhy, "allocation failed");
    } else if (cudaMemset(o.codes, 0xA5, nc) != cudaSuccess ||
               kv_cuda_kivi_pack(axis, &prm, H, T, D, dx, &o, 0) != cudaSuccess) {
        snprintf(why, nwhy, "GPU pack: %s", kv_cuda_last_error());
    } else if (from_device(gc, o.codes, nc) || from_device(gs, o.scale, ns * 2) ||
               from_device(gz, o.zero, ns * 2) || from_device(gr, o.resid, nr * 2)) {
        snprintf(why, nwhy, "copy back: %s", cudaGetErrorString(cudaGetLastError()));
    } else {
        size_t bad = 0;
        for (size_t i = 0; i < nc; i++) bad += gc[i] != cpu.codes[i];
        size_t bads = 0;
        for (size_t i = 0; i < ns; i++) bads += (gs[i] != cpu.scale[i]) + (gz[i] != cpu.zero[i]);
        int resid_same = nr == 0 || memcmp(gr, cpu.resid, nr * 2) == 0;
        if (bad || bads || !resid_same)
            snprintf(why, nwhy, "%zu of %zu code bytes, %zu scale/zero values differ, residual %s",
                     bad, nc, bads, resid_same ? "same" : "differs");
        else
            rc = 0;
    }
    cudaFree(dx), cudaFree(o.codes), cudaFree(o.scale), cudaFree(o.zero), cudaFree(o.resid);
    free(gc), free(gs), free(gz), free(gr);
    kv_kivi_clear(&cpu);
    return rc;
}

static void test_kivi_pack_is_byte_identical_to_cpu(void)
{
    /* small groups: the 8-channel key kernel at 1 and 2 tokens per thread, and the
     * per-channel kernel it leaves the groups to that its thread layout does not divide
     * (4 at D 128, 4 and 8 at D 64) */
    const int H = 3, T = 1000, dims[] = {64, 128}, bits[] = {1, 2, 4}, groups[] = {4, 8, 16, 32, 64, 128};
    size_t n = (size_t)H * T * 128;
    kv_half *xh = malloc(n * 2);
    float *xf = malloc(n * 4);
    char why[256];
    for (int di = 0; di < 2; di++) {
        rand_half((size_t)H * T * dims[di], dims[di], xh, xf);
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 3; b++)
                for (int g = 0; g < 6; g++) {
                    kv_kivi_axis axis = a ? KV_KIVI_VALUES : KV_KIVI_KEYS;
                    kv_kivi_params prm = {bits[b], groups[g], 100};
                    if (!kv_cuda_kivi_pack_supported(axis, &prm, dims[di])) continue;
                    int rc = pack_case(axis, bits[b], groups[g], 100, H, T, dims[di], xh, xf, why,
                                       sizeof why);
                    KT_CHECK(rc == 0, "%s D %d bits %d G %d: %s", a ? "values" : "keys",
                             dims[di], bits[b], groups[g], why);
                }
    }
    /* a constant channel (scale 0) and T < R (everything residual) */
    rand_half((size_t)H * T * 128, 128, xh, xf);
    for (size_t i = 0; i < (size_t)H * T * 128; i += 128) xh[i + 7] = kv_f32_to_half(1.5f), xf[i + 7] = 1.5f;
    KT_CHECK(pack_case(KV_KIVI_KEYS, 2, 64, 128, H, T, 128, xh, xf, why, sizeof why) == 0,
             "constant channel: %s", why);
    KT_CHECK(pack_case(KV_KIVI_VALUES, 1, 64, 2000, H, T, 128, xh, xf, why, sizeof why) == 0,
             "all residual: %s", why);
    free(xh), free(xf);
}

static void test_kivi_pack_is_byte_identical_on_real_data(void)
{
    niah_layer0 r;
    KT_REQUIRE(niah_layer0_load(1024, &r) == 0, "cannot load layer 0 of " NIAH_BIN);
    size_t n = (size_t)r.n_kv_heads * r.T * r.head_dim;
    kv_half *kh = malloc(n * 2), *vh = malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        kh[i] = kv_f32_to_half(r.k[i]), r.k[i] = kv_half_to_f32(kh[i]);
        vh[i] = kv_f32_to_half(r.v[i]), r.v[i] = kv_half_to_f32(vh[i]);
    }
    char why[256];
    for (int bits = 1; bits <= 4; bits *= 2) {
        KT_CHECK(pack_case(KV_KIVI_KEYS, bits, 64, 128, r.n_kv_heads, r.T, r.head_dim, kh, r.k, why,
                           sizeof why) == 0, "keys %d bits: %s", bits, why);
        KT_CHECK(pack_case(KV_KIVI_VALUES, bits, 64, 128, r.n_kv_heads, r.T, r.head_dim, vh, r.v,
                           why, sizeof why) == 0, "values %d bits: %s", bits, why);
    }
    free(kh), free(vh);
    niah_layer0_free(&r);
}

static void test_kivi_unpack_equals_cpu_dequantization(void)
{
    const int H = 2, T = 777, D = 128;
    size_t n = (size_t)H * T * D;
    kv_half *xh = malloc(n * 2), *gout = malloc(n * 2);
    float *xf = malloc(n * 4), *cpu = malloc(n * 4);
    rand_half(n, D, xh, xf);
    for (int a = 0; a < 2; a++)
        for (int bits = 1; bits <= 4; bits *= 2) {
            kv_kivi_axis axis = a ? KV_KIVI_VALUES : KV_KIVI_KEYS;
            kv_kivi_params prm = {bits, 64, 128};
            kv_kivi_packed p;
            KT_REQUIRE(kv_kivi_pack(xf, axis, &prm, H, T, D, &p) == KV_OK, "CPU pack");
            kv_kivi_unpack(&p, cpu);
            size_t nc = kv_kivi_codes_bytes(axis, &prm, H, T, D);
            size_t ns = kv_kivi_scale_count(axis, &prm, H, T, D);
            size_t nr = kv_kivi_resid_count(&prm, H, T, D);
            kv_cuda_kivi_view v = {dup_to_device(p.codes, nc), dup_to_device(p.scale, ns * 2),
                                   dup_to_device(p.zero, ns * 2), dup_to_device(p.resid, nr * 2)};
            uint16_t *dout = dalloc(n * 2);
            int ok = v.codes && v.scale && v.zero && v.resid && dout &&
                     cudaMemset(dout, 0xFF, n * 2) == cudaSuccess &&
                     kv_cuda_kivi_unpack(axis, &prm, H, T, D, &v, dout, 0) == cudaSuccess &&
                     from_device(gout, dout, n * 2) == 0;
            KT_CHECK(ok, "GPU unpack: %s", kv_cuda_last_error());
            size_t bad = 0;
            for (size_t i = 0; ok && i < n; i++) bad += gout[i] != kv_f32_to_half(cpu[i]);
            KT_CHECK(ok && bad == 0, "%s %d bits: %zu of %zu values differ", a ? "values" : "keys",
                     bits, bad, n);
            cudaFree((void *)v.codes), cudaFree((void *)v.scale), cudaFree((void *)v.zero);
            cudaFree((void *)v.resid), cudaFree(dout);
            kv_kivi_clear(&p);
        }
    free(xh), free(gout), free(xf), free(cpu);
}

// --- fp16 attention -------------------------------------------------------------------

/* GPU fp16 attention vs kv_attn_decode_f16 (fp16 query q), or with a float32
 * query qf (q unused) vs kv_attn_decode_f32 over the same fp16 K/V; stride
 * >= T*D tokens per head on the GPU. */
static double f16_case(int nh, int nkv, int D, int T, long long stride, const kv_half *q,
                       const float *qf, const kv_half *k, const kv_half *v, char *why, size_t nwhy)
{
    kv_attn_dims cd = {nh, nkv, D, T, 0, 1.0f / sqrtf((float)D)};
    kv_attn_dims gd = {nh, nkv, D, T, stride, cd.scale};
    size_t nq = (size_t)nh * D, n = (size_t)nkv * T * D;
    float *ref = malloc(nq * 4), *got = malloc(nq * 4);
    float *kf = qf ? malloc(n * 4) : NULL, *vf = qf ? malloc(n * 4) : NULL;
    for (size_t i = 0; qf && i < n; i++) kf[i] = kv_half_to_f32(k[i]), vf[i] = kv_half_to_f32(v[i]);
    kv_half *ks = calloc((size_t)nkv * stride, 2), *vs = calloc((size_t)nkv * stride, 2);
    for (int h = 0; h < nkv; h++) {
        memcpy(ks + h * stride, k + (size_t)h * T * D, (size_t)T * D * 2);
        memcpy(vs + h * stride, v + (size_t)h * T * D, (size_t)T * D * 2);
    }
    size_t wsb = qf ? kv_cuda_attn_f16_q32_workspace(&gd) : kv_cuda_attn_f16_workspace(&gd);
    void *dq = qf ? (void *)dup_to_device(qf, nq * 4) : (void *)dup_to_device(q, nq * 2);
    uint16_t *dk = dup_to_device(ks, (size_t)nkv * stride * 2),
             *dv = dup_to_device(vs, (size_t)nkv * stride * 2);
    float *dout = dalloc(nq * 4);
    void *ws = dalloc(wsb);
    double e = NAN;
    kv_status rs = qf ? kv_attn_decode_f32(&cd, qf, kf, vf, ref) : kv_attn_decode_f16(&cd, q, k, v, ref);
    if (rs != KV_OK) {
        snprintf(why, nwhy, "CPU reference: %s", kv_errdetail());
    } else if (!wsb || !dq || !dk || !dv || !dout || !ws) {
        snprintf(why, nwhy, "allocation or workspace size failed");
    } else if (cudaMemset(dout, 0xFF, nq * 4) != cudaSuccess ||
               (qf ? kv_cuda_attn_f16_q32(&gd, dq, dk, dv, dout, ws, wsb, 0)
                   : kv_cuda_attn_f16(&gd, dq, dk, dv, dout, ws, wsb, 0)) != cudaSuccess ||
               from_device(got, dout, nq * 4)) {
        snprintf(why, nwhy, "GPU: %s / %s", kv_cuda_last_error(), cudaGetErrorString(cudaGetLastError()));
    } else {
        e = nerr(got, ref, nq);
        snprintf(why, nwhy, "normalized error %.3g", e);
    }
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dout), cudaFree(ws);
    free(ref), free(got), free(ks), free(vs), free(kf), free(vf);
    return e;
}

/* The GPU engine's every geometry goes through this kernel: head dims 8 to
 * 256, query groups 1 to 8 (3, 5, 6, 7 by blocks of fewer heads).  The
 * tensor-core kernel's tiles are 64 tokens (D 128) or 128 (D 64) and its
 * splits whole tiles: T = 1, under one tile, one tile plus one, many splits
 * with a short last one. */
static const struct { int nh, nkv, D, T, pad; } f16_cases[] = {
    {32, 8, 128, 4133, 0}, {32, 8, 128, 1, 0}, {32, 8, 128, 37, 100}, {16, 2, 128, 3000, 0},
    {8, 8, 128, 999, 0},   {4, 2, 64, 2049, 0}, {8, 8, 64, 77, 5},     {16, 4, 64, 1500, 0},
    {8, 4, 8, 37, 3},      {8, 1, 16, 700, 0},  {6, 2, 32, 333, 7},    {12, 2, 64, 1000, 0},
    {16, 2, 256, 300, 1},  {10, 2, 128, 513, 0}, {14, 2, 16, 90, 0},   {16, 4, 128, 65, 0},
    {8, 1, 64, 129, 8},    {4, 4, 64, 1, 0},     {64, 8, 128, 300, 0}, {32, 8, 128, 20000, 0},
    {16, 8, 64, 12345, 0}, {8, 2, 128, 64, 0},
};

static int f16_short; /* KV_TEST_SHORT: no fp16 case over 5000 tokens (sanitizer runs) */

/* The tolerance of the kernel that serves this geometry (attn_f16.cu's rule:
 * the tensor-core kernel takes fp16 queries only). */
static double f16_tol(int nh, int nkv, int D, int legacy, int q_f32)
{
    int group = nh / nkv;
    return !legacy && !q_f32 && (D == 64 || D == 128) && group <= 16 ? TOL_F16_TC : TOL_F16;
}

static void check_f16_cases(const char *variant, size_t ncases, int q_f32, int legacy)
{
    char why[256];
    double worst = 0;
    for (size_t i = 0; i < ncases; i++) {
        const int nh = f16_cases[i].nh, nkv = f16_cases[i].nkv, D = f16_cases[i].D, T = f16_cases[i].T;
        if (f16_short && T > 5000) continue;
        size_t nkvs = (size_t)nkv * T * D;
        kv_half *q = malloc((size_t)nh * D * 2), *k = malloc(nkvs * 2), *v = malloc(nkvs * 2);
        float *tmp = malloc((nkvs > (size_t)nh * D ? nkvs : (size_t)nh * D) * 4);
        float *qf = q_f32 ? malloc((size_t)nh * D * 4) : NULL;
        rand_half((size_t)nh * D, D, q, tmp);
        for (size_t j = 0; qf && j < (size_t)nh * D; j++) qf[j] = tmp[j] + 1e-3f * (float)(j % 7);
        rand_half(nkvs, D, k, tmp);
        rand_half(nkvs, D, v, tmp);
        double e = f16_case(nh, nkv, D, T, (long long)(T + f16_cases[i].pad) * D, q, qf, k, v, why,
                            sizeof why);
        free(qf);
        KT_CHECK(e <= f16_tol(nh, nkv, D, legacy, q_f32), "%s%s: %d/%d heads D %d T %d: %s", variant,
                 q_f32 ? ", f32 query" : "", nh, nkv, D, T, why);
        if (!(e <= worst)) worst = e;
        free(q), free(k), free(v), free(tmp);
    }
    printf("# fp16 attention, %s%s: largest normalized error %.3g over %zu cases\n", variant,
           q_f32 ? ", f32 query" : "", worst, ncases);
}

static void test_attn_f16_matches_cpu_on_random_data(void)
{
    check_f16_cases("default", sizeof f16_cases / sizeof f16_cases[0], 0, 0);
    check_f16_cases("default", sizeof f16_cases / sizeof f16_cases[0], 1, 0);
}

/* The measurement variants (kv_cuda_tuning) compute the same attention. */
static void test_attn_f16_variants_match_cpu(void)
{
    kv_cuda_tuning keep = *kv_cuda_get_tuning(), t;
    static const char *name[] = {"prefetch", "unroll 8", "2 waves", "register kernel"};
    for (int v = 0; v < 4; v++) {
        kv_cuda_tuning_default(&t);
        if (v == 0) t.f16_prefetch = 1;
        if (v == 1) t.f16_unroll = 8;
        if (v == 2) t.f16_waves = 2;
        if (v == 3) t.f16_legacy = 1;
        kv_cuda_set_tuning(&t);
        size_t n = v == 3 ? sizeof f16_cases / sizeof f16_cases[0] : 8;
        check_f16_cases(name[v], n, 0, v != 2);
        if (v == 3) check_f16_cases(name[v], n, 1, 1);
    }
    kv_cuda_set_tuning(&keep);
}

static void test_attn_f16_matches_cpu_on_real_data(void)
{
    niah_layer0 r;
    KT_REQUIRE(niah_layer0_load(2048, &r) == 0, "cannot load layer 0 of " NIAH_BIN);
    size_t nq = (size_t)r.n_heads * r.head_dim, nkv = (size_t)r.n_kv_heads * r.T * r.head_dim;
    kv_half *q = malloc(nq * 2), *k = malloc(nkv * 2), *v = malloc(nkv * 2);
    for (size_t i = 0; i < nq; i++) q[i] = kv_f32_to_half(r.q[i]);
    for (size_t i = 0; i < nkv; i++) k[i] = kv_f32_to_half(r.k[i]), v[i] = kv_f32_to_half(r.v[i]);
    char why[256];
    double e = f16_case(r.n_heads, r.n_kv_heads, r.head_dim, r.T, (long long)r.T * r.head_dim, q,
                        NULL, k, v, why, sizeof why);
    KT_CHECK(e <= f16_tol(r.n_heads, r.n_kv_heads, r.head_dim, 0, 0), "niah4k layer 0, T %d: %s", r.T, why);
    printf("# fp16 attention on niah4k layer 0: %s\n", why);
    free(q), free(k), free(v);
    niah_layer0_free(&r);
}

// --- packed KIVI attention --------------------------------------------------------------

static double kivi_case(int nh, int nkv, int T, int bits, int G, int R, const kv_half *q,
                        const kv_half *k, const kv_half *v, char *why, size_t nwhy)
{
    const int D = 128;
    kv_attn_dims cd = {nh, nkv, D, T, 0, 1.0f / sqrtf((float)D)};
    kv_attn_dims gd = {nh, nkv, D, T, (long long)T * D, cd.scale};
    kv_kivi_params prm = {bits, G, R};
    size_t nq = (size_t)nh * D, n = (size_t)nkv * T * D;
    float *kf = malloc(n * 4), *vf = malloc(n * 4), *ref = malloc(nq * 4), *got = malloc(nq * 4);
    for (size_t i = 0; i < n; i++) kf[i] = kv_half_to_f32(k[i]), vf[i] = kv_half_to_f32(v[i]);
    kv_kivi_packed K, V;
    double e = NAN;
    if (!kv_cuda_attn_kivi_supported(&gd, &prm)) {
        snprintf(why, nwhy, "geometry not supported");
        free(kf), free(vf), free(ref), free(got);
        return e;
    }
    if (kv_kivi_pack(kf, KV_KIVI_KEYS, &prm, nkv, T, D, &K) != KV_OK ||
        kv_kivi_pack(vf, KV_KIVI_VALUES, &prm, nkv, T, D, &V) != KV_OK ||
        kv_attn_decode_kivi(&cd, q, &K, &V, ref) != KV_OK) {
        snprintf(why, nwhy, "CPU side: %s", kv_errdetail());
        free(kf), free(vf), free(ref), free(got);
        return e;
    }
    size_t nc = kv_kivi_codes_bytes(KV_KIVI_KEYS, &prm, nkv, T, D);
    size_t nks = kv_kivi_scale_count(KV_KIVI_KEYS, &prm, nkv, T, D);
    size_t nvs = kv_kivi_scale_count(KV_KIVI_VALUES, &prm, nkv, T, D);
    size_t nr = kv_kivi_resid_count(&prm, nkv, T, D);
    kv_cuda_kivi_view dK = {dup_to_device(K.codes, nc), dup_to_device(K.scale, nks * 2),
                            dup_to_device(K.zero, nks * 2), dup_to_device(K.resid, nr * 2)};
    kv_cuda_kivi_view dV = {dup_to_device(V.codes, nc), dup_to_device(V.scale, nvs * 2),
                            dup_to_device(V.zero, nvs * 2), dup_to_device(V.resid, nr * 2)};
    size_t wsb = kv_cuda_attn_kivi_workspace(&gd, &prm);
    uint16_t *dq = dup_to_device(q, nq * 2);
    float *dout = dalloc(nq * 4);
    void *ws = dalloc(wsb);
    if (!dK.codes || !dK.scale || !dK.zero || !dK.resid || !dV.codes || !dV.scale || !dV.zero ||
        !dV.resid || !dq || !dout || !ws || !wsb) {
        snprintf(why, nwhy, "allocation or workspace size failed");
    } else if (cudaMemset(dout, 0xFF, nq * 4) != cudaSuccess ||
               kv_cuda_attn_kivi(&gd, &prm, dq, &dK, &dV, dout, ws, wsb, 0) != cudaSuccess ||
               from_device(got, dout, nq * 4)) {
        snprintf(why, nwhy, "GPU: %s / %s", kv_cuda_last_error(), cudaGetErrorString(cudaGetLastError()));
    } else {
        e = nerr(got, ref, nq);
        snprintf(why, nwhy, "normalized error %.3g", e);
    }
    cudaFree((void *)dK.codes), cudaFree((void *)dK.scale), cudaFree((void *)dK.zero), cudaFree((void *)dK.resid);
    cudaFree((void *)dV.codes), cudaFree((void *)dV.scale), cudaFree((void *)dV.zero), cudaFree((void *)dV.resid);
    cudaFree(dq), cudaFree(dout), cudaFree(ws);
    kv_kivi_clear(&K), kv_kivi_clear(&V);
    free(kf), free(vf), free(ref), free(got);
    return e;
}

/* The packed cases (odd T, group 32, 16/8 and 8/8 heads, no residual, a
 * long cache), each against kv_attn_decode_kivi; label names the kernel.
 * kivi_quick (the v3 variants): group 64 only and no case over 5000 tokens,
 * as under KV_TEST_SHORT. */
static int kivi_quick;
static void check_kivi_random_cases(const char *label)
{
    static const struct { int nh, nkv, T, bits, G, R; } cases[] = {
        {32, 8, 5000, 1, 64, 128}, {32, 8, 5000, 2, 64, 128}, {32, 8, 3001, 1, 32, 128},
        {32, 8, 3001, 2, 32, 128}, {32, 8, 100, 1, 64, 128},  {32, 8, 4096, 2, 64, 0},
        {16, 8, 2500, 1, 64, 128}, {8, 8, 2500, 2, 64, 128},  {32, 8, 20000, 1, 64, 128},
        {32, 8, 3001, 2, 64, 128}, {8, 8, 777, 1, 64, 128},   {16, 8, 20000, 2, 64, 128},
        {32, 8, 5000, 4, 64, 128}, {16, 8, 3001, 4, 64, 128}, {8, 8, 777, 4, 64, 0},
    };
    char why[256];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int nh = cases[i].nh, nkv = cases[i].nkv, T = cases[i].T;
        if ((kivi_quick && cases[i].G != 64) || ((kivi_quick || f16_short) && T > 5000)) continue;
        size_t n = (size_t)nkv * T * 128;
        kv_half *q = malloc((size_t)nh * 128 * 2), *k = malloc(n * 2), *v = malloc(n * 2);
        float *tmp = malloc(n * 4 + 4 * 128 * nh);
        rand_half((size_t)nh * 128, 128, q, tmp);
        rand_half(n, 128, k, tmp);
        rand_half(n, 128, v, tmp);
        double e = kivi_case(nh, nkv, T, cases[i].bits, cases[i].G, cases[i].R, q, k, v, why, sizeof why);
        KT_CHECK(e <= TOL_KIVI, "%s: %d/%d heads T %d bits %d G %d R %d: %s", label, nh, nkv, T,
                 cases[i].bits, cases[i].G, cases[i].R, why);
        printf("# packed attention (%s) %d/%d heads T %d %d-bit G %d R %d: %s\n", label, nh, nkv, T,
               cases[i].bits, cases[i].G, cases[i].R, why);
        free(q), free(k), free(v), free(tmp);
    }
}

/* Run fn with the packed kernel settings of t in force, the old ones restored. */
static void with_kivi_tuning(const kv_cuda_tuning *t, void (*fn)(const char *), const char *label)
{
    kv_cuda_tuning keep = *kv_cuda_get_tuning();
    kv_cuda_set_tuning(t);
    fn(label);
    kv_cuda_set_tuning(&keep);
}

static void test_attn_kivi_matches_cpu_on_random_data(void)
{
    kv_cuda_tuning t = *kv_cuda_get_tuning();
    t.kivi_kernel = 2;
    with_kivi_tuning(&t, check_kivi_random_cases, "v2");
}

/* v3 (attn_kivi3.cu) in its variants: the default on every case, then on
 * the short ones 2 and 4 stages, the in-kernel merge, a one-block-
 * per-SM plan, no L2 prefetch and the fp32-add sums (4 query heads per KV
 * head; other geometries fall back to the default); the default again, so that a second pass
 * over the ticket sets finds them reset.  KV_TEST_QUICK=1 (the device
 * rounds' time cap) leaves out 4 stages, one block/SM and no prefetch. */
static void test_attn_kivi3_matches_cpu_on_random_data(void)
{
    static const struct { int nst, unfused, cps, nopf, var, slow; const char *label; } vars[] = {
        {0, 0, 0, 0, 0, 0, "v3"},          {2, 0, 0, 0, 0, 0, "v3 2 stages"},
        {4, 0, 0, 0, 0, 1, "v3 4 stages"}, {0, 2, 0, 0, 0, 0, "v3 merged in the kernel"},
        {0, 0, 1, 0, 0, 1, "v3 1 block/SM"}, {0, 0, 0, 1, 0, 1, "v3 no prefetch"},
        {0, 0, 0, 0, 1, 0, "v3 sums in fp32 adds"}, {0, 0, 0, 0, 0, 0, "v3 again"},
    };
    const int quick = getenv("KV_TEST_QUICK") != NULL;
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        if (quick && vars[i].slow) continue;
        kv_cuda_tuning t = *kv_cuda_get_tuning();
        t.kivi_kernel = 3;
        t.kivi3_nst = vars[i].nst;
        t.kivi3_unfused = vars[i].unfused;
        t.kivi3_cps = vars[i].cps;
        t.kivi3_noprefetch = vars[i].nopf;
        t.kivi3_var = vars[i].var;
        kivi_quick = i > 0;
        with_kivi_tuning(&t, check_kivi_random_cases, vars[i].label);
    }
    kivi_quick = 0;
}

/* niah4k has head_dim 64; the packed kernel wants 128, so the two KV heads
 * of each token are laid side by side (one KV head of 128 channels) and
 * query heads h and h+2 likewise: real value statistics, a real mixture of
 * the two heads' attention. */
static void test_attn_kivi_matches_cpu_on_real_data(void)
{
    niah_layer0 r;
    KT_REQUIRE(niah_layer0_load(2048, &r) == 0, "cannot load layer 0 of " NIAH_BIN);
    const int T = r.T, hs = r.head_dim;
    kv_half *q = malloc(2 * 128 * 2), *k = malloc((size_t)T * 128 * 2), *v = malloc((size_t)T * 128 * 2);
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 128; c++) q[h * 128 + c] = kv_f32_to_half(r.q[(h + 2 * (c / hs)) * hs + c % hs]);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < 128; c++) {
            size_t src = ((size_t)(c / hs) * T + t) * hs + c % hs;
            k[(size_t)t * 128 + c] = kv_f32_to_half(r.k[src]);
            v[(size_t)t * 128 + c] = kv_f32_to_half(r.v[src]);
        }
    char why[256];
    kv_cuda_tuning keep = *kv_cuda_get_tuning(), t = keep;
    for (int ver = 2; ver <= 3; ver++) {
        t.kivi_kernel = ver;
        kv_cuda_set_tuning(&t);
        for (int bits = 1; bits <= 4; bits *= 2) {
            double e = kivi_case(2, 1, T, bits, 64, 128, q, k, v, why, sizeof why);
            KT_CHECK(e <= TOL_KIVI, "niah4k layer 0, v%d, %d bits: %s", ver, bits, why);
            printf("# packed attention (v%d) on niah4k layer 0, %d-bit: %s\n", ver, bits, why);
        }
    }
    kv_cuda_set_tuning(&keep);
    free(q), free(k), free(v);
    niah_layer0_free(&r);
}

// --- DSQ pack / unpack --------------------------------------------------------------

/* Pack with kv_dsq_pack and kv_cuda_dsq_pack (same importance), compare
 * every part byte for byte, then unpack both sides and compare the floats
 * bit for bit; 0 when all equal. */
static int dsq_case(kv_kivi_axis axis, const kv_dsq_params *p, int H, int T, int D,
                    const kv_half *xh, const float *xf, const float *imp, char *why, size_t nwhy)
{
    kv_dsq_packed cpu;
    if (kv_dsq_pack(xf, imp, axis, p, H, T, D, &cpu) != KV_OK) {
        snprintf(why, nwhy, "CPU pack refused: %s", kv_errdetail());
        return -1;
    }
    kv_dsq_sizes z;
    kv_dsq_part_sizes(axis, p, H, T, D, &z);
    const size_t n = (size_t)H * T * D;
    uint16_t *dx = dup_to_device(xh, n * 2);
    float *dimp = dup_to_device(imp, (size_t)H * T * 4), *dout = dalloc(n * 4);
    kv_cuda_dsq_out o = {dalloc(z.mask), dalloc(z.sal), dalloc(z.sscale * 2),
                         axis == KV_KIVI_KEYS ? dalloc(z.base * 2) : NULL, dalloc(z.codes),
                         dalloc(z.scale * 2), dalloc(z.scale * 2), dalloc(z.resid * 2)};
    const size_t hostn = z.mask + z.sal + z.codes + 2 * (z.sscale + z.base + 2 * z.scale + z.resid);
    uint8_t *h = malloc(hostn + 16);
    float *gout = malloc(n * 4 + 4), *cout = malloc(n * 4 + 4);
    int rc = -1;
    if (!dx || !dimp || !dout || !o.mask || !o.sal || !o.sscale || (axis == KV_KIVI_KEYS && !o.base) ||
        !o.codes || !o.scale || !o.zero || !o.resid || !h || !gout || !cout) {
        snprintf(why, nwhy, "allocation failed");
        goto done;
    }
    struct { void *dev; const void *cpu; size_t bytes; const char *name; } parts[] = {
        {o.mask, cpu.mask, z.mask, "mask"},       {o.sal, cpu.sal, z.sal, "salient codes"},
        {o.sscale, cpu.sscale, z.sscale * 2, "salient scales"},
        {o.base, cpu.base, z.base * 2, "base"},   {o.codes, cpu.codes, z.codes, "codes"},
        {o.scale, cpu.scale, z.scale * 2, "scales"}, {o.zero, cpu.zero, z.scale * 2, "zeros"},
        {o.resid, cpu.resid, z.resid * 2, "residual"},
    };
    /* poison every output, so that an element the kernels skip shows up */
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        if (parts[i].bytes && cudaMemset(parts[i].dev, 0xA5, parts[i].bytes) != cudaSuccess) {
            snprintf(why, nwhy, "cudaMemset of %s failed", parts[i].name);
            goto done;
        }
    if (cudaMemset(dout, 0xFF, n * 4) != cudaSuccess) {
        snprintf(why, nwhy, "cudaMemset of the unpack output failed");
        goto done;
    }
    if (kv_cuda_dsq_pack(axis, p, H, T, D, dx, dimp, &o, 0) != cudaSuccess) {
        snprintf(why, nwhy, "GPU pack: %s", kv_cuda_last_error());
        goto done;
    }
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        if (!parts[i].bytes) continue;
        if (from_device(h, parts[i].dev, parts[i].bytes)) {
            snprintf(why, nwhy, "copy back: %s", cudaGetErrorString(cudaGetLastError()));
            goto done;
        }
        size_t bad = 0;
        for (size_t k = 0; k < parts[i].bytes; k++) bad += h[k] != ((const uint8_t *)parts[i].cpu)[k];
        if (bad) {
            snprintf(why, nwhy, "%s: %zu of %zu bytes differ", parts[i].name, bad, parts[i].bytes);
            goto done;
        }
    }
    kv_cuda_dsq_view v = {o.mask, o.sal, o.sscale, o.base, o.codes, o.scale, o.zero, o.resid};
    kv_dsq_unpack(&cpu, cout);
    if (kv_cuda_dsq_unpack(axis, p, H, T, D, &v, dout, 0) != cudaSuccess) {
        snprintf(why, nwhy, "GPU unpack: %s", kv_cuda_last_error());
    } else if (from_device(gout, dout, n * 4)) {
        snprintf(why, nwhy, "copy back: %s", cudaGetErrorString(cudaGetLastError()));
    } else if (memcmp(gout, cout, n * 4) != 0) {
        size_t bad = 0;
        for (size_t k = 0; k < n; k++) bad += memcmp(&gout[k], &cout[k], 4) != 0;
        snprintf(why, nwhy, "unpack: %zu of %zu values differ", bad, n);
    } else {
        rc = 0;
    }
done:
    cudaFree(dx), cudaFree(dimp), cudaFree(dout), cudaFree(o.mask), cudaFree(o.sal);
    cudaFree(o.sscale), cudaFree(o.base), cudaFree(o.codes), cudaFree(o.scale), cudaFree(o.zero);
    cudaFree(o.resid);
    free(h), free(gout), free(cout);
    kv_dsq_clear(&cpu);
    return rc;
}

/* Importance with many ties and a NaN, so that the tie rule is exercised. */
static void rand_importance(float *imp, size_t n)
{
    for (size_t i = 0; i < n; i++) imp[i] = (float)(int)(kt_rand(&seed) * 40.0);
    if (n > 5) imp[5] = NAN;
}

static void test_dsq_pack_and_unpack_are_identical_to_cpu(void)
{
    const int H = 3, T = 64 * 9 + 37;
    static const struct { int D, W, S, bits, group; } cases[] = {
        {128, 64, 13, 2, 32}, {128, 64, 13, 1, 64}, {128, 64, 13, 4, 128}, {64, 64, 13, 2, 32},
        {128, 32, 0, 2, 32},  {128, 64, 64, 2, 32}, {128, 128, 26, 2, 32}, {64, 16, 3, 4, 16},
    };
    size_t n = (size_t)H * T * 128;
    kv_half *xh = malloc(n * 2);
    float *xf = malloc(n * 4), *imp = malloc((size_t)H * T * 4);
    char why[256];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kv_dsq_params p = {cases[i].W, cases[i].S, cases[i].bits, cases[i].group, KV_DSQ_BASE_SALIENT};
        const int D = cases[i].D;
        KT_REQUIRE(kv_cuda_dsq_supported(&p, D), "case %zu is supported", i);
        for (int a = 0; a < 2; a++) {
            kv_kivi_axis axis = a ? KV_KIVI_VALUES : KV_KIVI_KEYS;
            rand_half((size_t)H * T * D, D, xh, xf);
            rand_importance(imp, (size_t)H * T);
            int rc = dsq_case(axis, &p, H, T, D, xh, xf, imp, why, sizeof why);
            KT_CHECK(rc == 0, "%s D %d W %d S %d %d-bit G %d: %s", a ? "values" : "keys", D,
                     cases[i].W, cases[i].S, cases[i].bits, cases[i].group, why);
        }
    }
    free(xh), free(xf), free(imp);
}

/* niah4k layer 0 K and V with the importance its stored query gives. */
static void test_dsq_pack_and_unpack_are_identical_on_real_data(void)
{
    niah_layer0 r;
    KT_REQUIRE(niah_layer0_load(2048, &r) == 0, "cannot load layer 0 of " NIAH_BIN);
    const int H = r.n_kv_heads, T = r.T, D = r.head_dim;
    const size_t n = (size_t)H * T * D;
    kv_half *kh = malloc(n * 2), *vh = malloc(n * 2);
    float *kf = malloc(n * 4), *vf = malloc(n * 4), *imp = malloc((size_t)H * T * 4);
    for (size_t i = 0; i < n; i++) {
        kh[i] = kv_f32_to_half(r.k[i]), kf[i] = kv_half_to_f32(kh[i]);
        vh[i] = kv_f32_to_half(r.v[i]), vf[i] = kv_half_to_f32(vh[i]);
    }
    KT_REQUIRE(kv_dsq_importance(r.q, r.n_heads, 1, kf, H, T, D, imp) == KV_OK, "importance");
    kv_dsq_params p;
    kv_dsq_params_default(&p);
    char why[256];
    KT_CHECK(dsq_case(KV_KIVI_KEYS, &p, H, T, D, kh, kf, imp, why, sizeof why) == 0, "keys: %s", why);
    KT_CHECK(dsq_case(KV_KIVI_VALUES, &p, H, T, D, vh, vf, imp, why, sizeof why) == 0, "values: %s",
             why);
    free(kh), free(vh), free(kf), free(vf), free(imp);
    niah_layer0_free(&r);
}

static void test_launchers_reject_bad_arguments(void)
{
    kv_attn_dims d = {32, 8, 96, 100, 9600, 0.1f};
    KT_CHECK(kv_cuda_attn_f16_workspace(&d) == 0, "head dim 96 has a workspace");
    float *dout = dalloc(32 * 96 * 4);
    cudaError_t e = kv_cuda_attn_f16(&d, (const uint16_t *)dout, (const uint16_t *)dout,
                                     (const uint16_t *)dout, dout, dout, 1 << 20, 0);
    KT_CHECK(e == cudaErrorInvalidValue, "head dim 96 accepted (%d)", (int)e);
    KT_CHECK(strstr(kv_cuda_last_error(), "kv_cuda_attn_f16") != NULL, "message '%s'",
             kv_cuda_last_error());
    kv_kivi_params prm = {4, 32, 128};
    d.head_dim = 128;
    KT_CHECK(!kv_cuda_attn_kivi_supported(&d, &prm), "4-bit packed attention at group 32 claimed");
    prm.bits = 3;
    prm.group = 64;
    KT_CHECK(!kv_cuda_attn_kivi_supported(&d, &prm), "3-bit packed attention claimed");
    prm.bits = 4;
    KT_CHECK(kv_cuda_attn_kivi_supported(&d, &prm), "4-bit packed attention at group 64 not claimed");
    KT_CHECK(kv_cuda_attn_kivi_kernel(&d, &prm) == 3, "4-bit packed attention not on v3");
    kv_dsq_params dp = {256, 51, 2, 32, KV_DSQ_BASE_SALIENT};
    KT_CHECK(!kv_cuda_dsq_supported(&dp, 128), "DSQ window 256 claimed");
    dp.window = 64, dp.salient = 13;
    kv_cuda_dsq_out o = {0};
    e = kv_cuda_dsq_pack(KV_KIVI_KEYS, &dp, 1, 64, 128, (const uint16_t *)dout, NULL, &o, 0);
    KT_CHECK(e == cudaErrorInvalidValue, "DSQ pack without importance accepted (%d)", (int)e);
    cudaFree(dout);
}
#endif /* KV_HAVE_CUDA */

#define ALL_TESTS(X)                                                                  \
    X(test_kivi_pack_is_byte_identical_to_cpu)                                        \
    X(test_kivi_pack_is_byte_identical_on_real_data)                                  \
    X(test_kivi_unpack_equals_cpu_dequantization)                                     \
    X(test_attn_f16_matches_cpu_on_random_data)                                       \
    X(test_attn_f16_matches_cpu_on_real_data)                                         \
    X(test_attn_f16_variants_match_cpu)                                               \
    X(test_attn_kivi_matches_cpu_on_random_data)                                      \
    X(test_attn_kivi3_matches_cpu_on_random_data)                                     \
    X(test_attn_kivi_matches_cpu_on_real_data)                                        \
    X(test_dsq_pack_and_unpack_are_identical_to_cpu)                                  \
    X(test_dsq_pack_and_unpack_are_identical_on_real_data)                            \
    X(test_launchers_reject_bad_arguments)

#ifdef KV_HAVE_CUDA
/* Does name contain one of the comma-separated substrings of filter? */
static int filter_match(const char *filter, const char *name)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", filter);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
        if (strstr(name, t)) return 1;
    return 0;
}
#endif

int main(void)
{
    seed = getenv("KT_SEED") ? strtoull(getenv("KT_SEED"), NULL, 10) : (unsigned long long)time(NULL);
    printf("# seed %llu (set KT_SEED to repeat)\n", seed);
    seed |= 1;
    char name[256] = "";
    int ngpu = kv_gpu_probe(name, sizeof name);
#ifdef KV_HAVE_CUDA
    if (ngpu > 0) {
        printf("# GPU: %s\n", name);
        /* KV_KIVI2_VAR=n runs the packed-attention tests on a v2 variant
         * (kv_cuda_tuning; tools/device/run-kernels.sh TEST_ENVS) */
        kv_cuda_tuning tu;
        kv_cuda_tuning_default(&tu);
        if (getenv("KV_KIVI2_VAR")) tu.kivi2_var = atoi(getenv("KV_KIVI2_VAR"));
        kv_cuda_set_tuning(&tu);
        /* KV_TEST_FILTER=substring[,substring...] runs only matching tests (e.g. under
         * racecheck); KV_TEST_SHORT=1 leaves out the fp16 cases over 5000 tokens */
        const char *filter = getenv("KV_TEST_FILTER");
        f16_short = getenv("KV_TEST_SHORT") != NULL;
#define RUN_ONE(t)                                        \
    if (!filter || filter_match(filter, #t)) KT_RUN(t);   \
    else KT_SKIP(t, "not selected by KV_TEST_FILTER");
        ALL_TESTS(RUN_ONE)
        return kt_done();
    }
#endif
    char why[300];
    snprintf(why, sizeof why, "no usable GPU (%s)", name);
    fprintf(stderr, "notice: CUDA kernel tests skipped: %s\n", why);
#define SKIP_ONE(t) KT_SKIP(t, why);
    ALL_TESTS(SKIP_ONE)
    (void)ngpu, (void)kt_cur_failed;
    return kt_done();
}
