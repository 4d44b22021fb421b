/*
 * kv_matmul: weight kernels for the CPU engine (see kv_matmul.h).  The hot
 * loops are dot products of one weight row with one activation vector.  Two
 * sets exist: AVX2+FMA+F16C (picked at run time, since the build targets
 * x86-64-v2) and a portable set written with eight independent accumulators
 * so the compiler can vectorise it without reassociating a single sum.
 * Several tokens (prefill) reuse one decoded weight row.  The engine's
 * float operations between the products (one attention head, RMSNorm,
 * SwiGLU) sit at the end; their sums are in double where ggml's CPU
 * backend sums in double, which keeps them close to llama.cpp's (the
 * products' 8-bit activations turn a last-bit difference into a step).
 */
#include "model/kv_matmul.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_ggml.h"
#include "common/kv_half.h"
#include "model/kv_matmul_q.h"
#include "model/kv_quants.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KV_X86 1
#endif

// --- portable kernels --------------------------------------------------------

#define KV_PAR_MIN (1L << 18) /* multiply-adds below which a matvec stays serial */

static float f16_table[65536]; /* f16 bits -> f32, filled once */

static float dot_f32_port(const float *a, const float *b, int n)
{
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void row_f16_port(const void *row, float *out, int n)
{
    const uint16_t *w = row;
    for (int i = 0; i < n; i++) out[i] = f16_table[w[i]];
}

static void row_bf16_port(const void *row, float *out, int n)
{
    const uint16_t *w = row;
    for (int i = 0; i < n; i++) {
        uint32_t b = (uint32_t)w[i] << 16;
        memcpy(&out[i], &b, 4);
    }
}

static float dot_f16_port(const void *row, const float *x, int n)
{
    const uint16_t *w = row;
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += f16_table[w[i + j]] * x[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += f16_table[w[i]] * x[i];
    return s;
}

static float dot_bf16_port(const void *row, const float *x, int n)
{
    const uint16_t *w = row;
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            uint32_t b = (uint32_t)w[i + j] << 16;
            float f;
            memcpy(&f, &b, 4);
            acc[j] += f * x[i + j];
        }
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) {
        uint32_t b = (uint32_t)w[i] << 16;
        float f;
        memcpy(&f, &b, 4);
        s += f * x[i];
    }
    return s;
}

static float dot_w_f32_port(const void *row, const float *x, int n)
{
    return dot_f32_port(row, x, n);
}

static void axpy_port(float a, const float *x, float *y, int n)
{
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* Activations of an F16 or BF16 product, rounded to that type (nearest
 * even) and kept as floats: llama.cpp's CPU backend converts the input
 * vector to the weight's 16-bit type before its dot product (vec_dot_type
 * F16 and BF16), so the same rounding here gives its numbers. */
static void round_f16_port(const float *x, float *out, int n)
{
    for (int i = 0; i < n; i++) out[i] = kv_round_half(x[i]);
}

static void round_bf16_port(const float *x, float *out, int n)
{
    for (int i = 0; i < n; i++) out[i] = kv_bf16_to_f32(kv_f32_to_bf16(x[i]));
}

// --- AVX2 + FMA + F16C kernels -------------------------------------------------

#ifdef KV_X86
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

KV_AVX2 static inline float hsum256(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

KV_AVX2 static float dot_f32_avx2(const float *a, const float *b, int n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum256(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

KV_AVX2 static float dot_w_f32_avx2(const void *row, const float *x, int n)
{
    return dot_f32_avx2(row, x, n);
}

KV_AVX2 static float dot_f16_avx2(const void *row, const float *x, int n)
{
    const uint16_t *w = row;
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i)));
        __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i + 8)));
        s0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i))),
                             _mm256_loadu_ps(x + i), s0);
    float s = hsum256(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += f16_table[w[i]] * x[i];
    return s;
}

KV_AVX2 static inline __m256 bf16x8(const uint16_t *p)
{
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

KV_AVX2 static float dot_bf16_avx2(const void *row, const float *x, int n)
{
    const uint16_t *w = row;
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(bf16x8(w + i), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(bf16x8(w + i + 8), _mm256_loadu_ps(x + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(bf16x8(w + i), _mm256_loadu_ps(x + i), s0);
    float s = hsum256(_mm256_add_ps(s0, s1));
    for (; i < n; i++) {
        uint32_t b = (uint32_t)w[i] << 16;
        float f;
        memcpy(&f, &b, 4);
        s += f * x[i];
    }
    return s;
}

KV_AVX2 static void row_f16_avx2(const void *row, float *out, int n)
{
    const uint16_t *w = row;
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i))));
    for (; i < n; i++) out[i] = f16_table[w[i]];
}

KV_AVX2 static void round_f16_avx2(const float *x, float *out, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
    for (; i < n; i++) out[i] = kv_round_half(x[i]);
}

KV_AVX2 static void axpy_avx2(float a, const float *x, float *y, int n)
{
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* out[r][j] = dot(w_r, x_j) for 2 rows and 4 tokens: each loaded weight
 * vector feeds 4 FMAs, each token vector 2, with 8 independent chains. */
KV_AVX2 static void tile_2x4_avx2(const float *w0, const float *w1, const float *x, size_t ldx,
                                  int n, float out[2][4])
{
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
    int k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
        __m256 y = _mm256_loadu_ps(x0 + k);
        a00 = _mm256_fmadd_ps(v0, y, a00);
        a10 = _mm256_fmadd_ps(v1, y, a10);
        y = _mm256_loadu_ps(x1 + k);
        a01 = _mm256_fmadd_ps(v0, y, a01);
        a11 = _mm256_fmadd_ps(v1, y, a11);
        y = _mm256_loadu_ps(x2 + k);
        a02 = _mm256_fmadd_ps(v0, y, a02);
        a12 = _mm256_fmadd_ps(v1, y, a12);
        y = _mm256_loadu_ps(x3 + k);
        a03 = _mm256_fmadd_ps(v0, y, a03);
        a13 = _mm256_fmadd_ps(v1, y, a13);
    }
    out[0][0] = hsum256(a00), out[0][1] = hsum256(a01), out[0][2] = hsum256(a02), out[0][3] = hsum256(a03);
    out[1][0] = hsum256(a10), out[1][1] = hsum256(a11), out[1][2] = hsum256(a12), out[1][3] = hsum256(a13);
    for (; k < n; k++)
        for (int j = 0; j < 4; j++) {
            out[0][j] += w0[k] * x[j * ldx + k];
            out[1][j] += w1[k] * x[j * ldx + k];
        }
}
#endif

// --- dispatch ----------------------------------------------------------------

typedef float (*dot_w_fn)(const void *row, const float *x, int n);
typedef void (*row_fn)(const void *row, float *out, int n);
typedef void (*act_fn)(const float *x, float *out, int n);

typedef void (*tile_fn)(const float *w0, const float *w1, const float *x, size_t ldx, int n,
                        float out[2][4]);

static void tile_2x4_port(const float *w0, const float *w1, const float *x, size_t ldx, int n,
                          float out[2][4])
{
    for (int j = 0; j < 4; j++) {
        out[0][j] = dot_f32_port(w0, x + j * ldx, n);
        out[1][j] = dot_f32_port(w1, x + j * ldx, n);
    }
}

static struct {
    tile_fn tile;
    dot_w_fn dot[KV_DT_ALL];     /* float rows (F32, F16, BF16) with a float vector */
    row_fn row[KV_DT_ALL];
    kv_qdot_fn qdot[KV_DT_ALL];  /* block rows with a quantized vector */
    act_fn round[KV_DT_ALL];     /* F16, BF16: the input vector rounded to the type */
    float (*dot_f32)(const float *, const float *, int);
    void (*axpy)(float, const float *, float *, int);
    const char *isa;
} K;

static pthread_once_t k_once = PTHREAD_ONCE_INIT;

static void row_f32(const void *row, float *out, int n) { memcpy(out, row, (size_t)n * 4); }

/* block rows decode through the reference (embedding lookups, GPU upload) */
#define ROWQ(name, wt)                                                                    \
    static void name(const void *row, float *out, int n)                                 \
    {                                                                                     \
        kv_quant_dequant_row(kv_dtype_ggml(wt), row, out, n);                             \
    }
ROWQ(row_q8_0, KV_DT_Q8_0)
ROWQ(row_q4_0, KV_DT_Q4_0)
ROWQ(row_q4_1, KV_DT_Q4_1)
ROWQ(row_q5_0, KV_DT_Q5_0)
ROWQ(row_q5_1, KV_DT_Q5_1)
ROWQ(row_q2_k, KV_DT_Q2_K)
ROWQ(row_q3_k, KV_DT_Q3_K)
ROWQ(row_q4_k, KV_DT_Q4_K)
ROWQ(row_q5_k, KV_DT_Q5_K)
ROWQ(row_q6_k, KV_DT_Q6_K)
#undef ROWQ

static bool force_portable; /* kv_matmul_set_portable */

/* Choose the inner kernels: AVX2+FMA where the CPU has them, unless the
 * portable ones are asked for. */
static void k_choose(void)
{
    K.dot[KV_DT_F32] = dot_w_f32_port;
    K.dot[KV_DT_F16] = dot_f16_port;
    K.dot[KV_DT_BF16] = dot_bf16_port;
    K.row[KV_DT_F32] = row_f32;
    K.row[KV_DT_F16] = row_f16_port;
    K.row[KV_DT_BF16] = row_bf16_port;
    K.round[KV_DT_F16] = round_f16_port;
    K.round[KV_DT_BF16] = round_bf16_port;
    K.row[KV_DT_Q8_0] = row_q8_0;
    K.row[KV_DT_Q4_0] = row_q4_0;
    K.row[KV_DT_Q4_1] = row_q4_1;
    K.row[KV_DT_Q5_0] = row_q5_0;
    K.row[KV_DT_Q5_1] = row_q5_1;
    K.row[KV_DT_Q2_K] = row_q2_k;
    K.row[KV_DT_Q3_K] = row_q3_k;
    K.row[KV_DT_Q4_K] = row_q4_k;
    K.row[KV_DT_Q5_K] = row_q5_k;
    K.row[KV_DT_Q6_K] = row_q6_k;
    for (int t = 0; t < KV_DT_ALL; t++) K.qdot[t] = kv_qdot_select(kv_dtype_ggml((kv_dtype)t), false);
    K.dot_f32 = dot_f32_port;
    K.axpy = axpy_port;
    K.tile = tile_2x4_port;
    K.isa = "portable";
#ifdef KV_X86
    __builtin_cpu_init();
    if (!force_portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        K.dot[KV_DT_F32] = dot_w_f32_avx2;
        K.dot[KV_DT_F16] = dot_f16_avx2;
        K.dot[KV_DT_BF16] = dot_bf16_avx2;
        K.row[KV_DT_F16] = row_f16_avx2;
        K.round[KV_DT_F16] = round_f16_avx2;
        for (int t = 0; t < KV_DT_ALL; t++) K.qdot[t] = kv_qdot_select(kv_dtype_ggml((kv_dtype)t), true);
        K.dot_f32 = dot_f32_avx2;
        K.axpy = axpy_avx2;
        K.tile = tile_2x4_avx2;
        K.isa = "avx2";
    }
#endif
}

static void k_init(void)
{
    for (uint32_t i = 0; i < 65536; i++) f16_table[i] = kv_half_to_f32((kv_half)i);
    k_choose();
}

static inline void k_ready(void) { pthread_once(&k_once, k_init); }

void kv_matmul_set_portable(bool on)
{
    k_ready();
    force_portable = on;
    k_choose();
}

const char *kv_matmul_isa(void)
{
    k_ready();
    return K.isa;
}

float kv_dot_f32(const float *a, const float *b, int n)
{
    k_ready();
    return K.dot_f32(a, b, n);
}

void kv_axpy_f32(float a, const float *x, float *y, int n)
{
    k_ready();
    K.axpy(a, x, y, n);
}

/* Stored row of output row r. */
static inline const uint8_t *wrow(const kv_weight *w, size_t rb, int r)
{
    return (const uint8_t *)w->data + (size_t)(w->perm ? w->perm[r] : r) * rb;
}

void kv_weight_row(const kv_weight *w, int r, float *out)
{
    k_ready();
    K.row[w->type](wrow(w, kv_dtype_row_bytes(w->type, w->cols), r), out, w->cols);
}

/* The copies of an input vector that a set of weights meets, one per
 * activation format (a matvec_multi may mix Q8_0 and Q8_K users): quantized
 * blocks for block types, floats rounded to F16 or BF16 for those types,
 * the vector itself for F32.  Small vectors live on the stack; a failed
 * allocation leaves the outputs NaN rather than silently wrong. */
#define XQ_STACK 32768
typedef struct {
    uint32_t vt[4];
    uint8_t *buf[4];
    int n;
    _Alignas(32) uint8_t stack[XQ_STACK];
    size_t stack_used;
    void *heap[4];
} xq_set;

static const uint8_t *xq_get(xq_set *q, kv_dtype t, const float *x, int cols)
{
    const bool block = kv_dtype_is_block(t);
    if (!block && !K.round[t]) return (const uint8_t *)x;
    const uint32_t vt = block ? kv_quant_vec_type(kv_dtype_ggml(t)) : kv_dtype_ggml(t);
    for (int i = 0; i < q->n; i++)
        if (q->vt[i] == vt) return q->buf[i];
    if (q->n == 4) return NULL;
    size_t nb = block ? kv_quant_vec_bytes(vt, cols) : (size_t)cols * sizeof(float);
    size_t pad = (nb + 31) & ~(size_t)31;
    uint8_t *b;
    if (q->stack_used + pad <= XQ_STACK) {
        b = q->stack + q->stack_used;
        q->stack_used += pad;
        q->heap[q->n] = NULL;
    } else {
        b = q->heap[q->n] = malloc(nb);
        if (!b) return NULL;
    }
    if (block)
        kv_quant_activations(vt, x, b, cols);
    else
        K.round[t](x, (float *)b, cols);
    q->vt[q->n] = vt;
    q->buf[q->n++] = b;
    return b;
}

static void xq_free(xq_set *q)
{
    for (int i = 0; i < q->n; i++) free(q->heap[i]);
}

/* One output of a matvec: the row's dot product with the copy of x its
 * type meets (xq_get), plus the bias. */
static inline float row_out(const kv_weight *w, size_t rb, int r, const uint8_t *xq)
{
    const uint8_t *p = wrow(w, rb, r);
    float v = K.qdot[w->type] ? K.qdot[w->type](p, xq, w->cols) : K.dot[w->type](p, (const float *)xq, w->cols);
    return w->bias ? v + w->bias[r] : v;
}

void kv_matvec(const kv_weight *w, const float *x, float *y)
{
    k_ready();
    const size_t rb = kv_dtype_row_bytes(w->type, w->cols);
    const int rows = w->rows, cols = w->cols;
    xq_set q;
    q.n = 0, q.stack_used = 0;
    const uint8_t *xq = xq_get(&q, w->type, x, cols);
    if (!xq) {
        for (int r = 0; r < rows; r++) y[r] = NAN;
        return;
    }
    /* Below ~256k multiply-adds (a few microseconds of AVX2) waking the
     * thread team costs as much as it saves, and far more when the cores
     * are shared with other work. */
#pragma omp parallel for schedule(static) if ((long)rows * cols > KV_PAR_MIN)
    for (int r = 0; r < rows; r++) y[r] = row_out(w, rb, r, xq);
    xq_free(&q);
}

void kv_matvec_multi(int n, const kv_weight *const *w, const float *x, float *const *y)
{
    k_ready();
    int start[5] = {0};
    long work = 0;
    xq_set q;
    q.n = 0, q.stack_used = 0;
    const uint8_t *xqs[4] = {NULL, NULL, NULL, NULL};
    size_t rbs[4];
    for (int i = 0; i < n; i++) {
        start[i + 1] = start[i] + w[i]->rows;
        work += (long)w[i]->rows * w[i]->cols;
        rbs[i] = kv_dtype_row_bytes(w[i]->type, w[i]->cols);
        if (!(xqs[i] = xq_get(&q, w[i]->type, x, w[i]->cols))) {
            for (int j = 0; j < n; j++)
                for (int r = 0; r < w[j]->rows; r++) y[j][r] = NAN;
            xq_free(&q);
            return;
        }
    }
    const int total = start[n];
#pragma omp parallel for schedule(static) if (work > KV_PAR_MIN)
    for (int r = 0; r < total; r++) {
        int i = 0;
        while (r >= start[i + 1]) i++;
        y[i][r - start[i]] = row_out(w[i], rbs[i], r - start[i], xqs[i]);
    }
    xq_free(&q);
}

#define KV_MM_TOKENS 64 /* tokens per tile: one decoded row serves this many */

/* Prefill with block weights: each token's activations are quantized once
 * per tile, then every row meets every token of the tile while it is in
 * cache, with the same kernels (and so the same numbers) as a decode step. */
static void matmul_block(const kv_weight *w, const float *X, int n, float *Y)
{
    const size_t rb = kv_dtype_row_bytes(w->type, w->cols);
    const int rows = w->rows, cols = w->cols;
    const uint32_t vt = kv_quant_vec_type(kv_dtype_ggml(w->type));
    const size_t vb = kv_quant_vec_bytes(vt, cols);
    const int tile = n < KV_MM_TOKENS ? n : KV_MM_TOKENS;
    uint8_t *xq = malloc(vb * (size_t)tile);
    if (!xq) {
        for (size_t i = 0; i < (size_t)n * rows; i++) Y[i] = NAN;
        return;
    }
    for (int t0 = 0; t0 < n; t0 += KV_MM_TOKENS) {
        int t1 = t0 + KV_MM_TOKENS < n ? t0 + KV_MM_TOKENS : n;
        for (int t = t0; t < t1; t++)
            kv_quant_activations(vt, X + (size_t)t * cols, xq + (size_t)(t - t0) * vb, cols);
#pragma omp parallel for schedule(static) if ((long)rows * cols * (t1 - t0) > 32768)
        for (int r = 0; r < rows; r++) {
            const uint8_t *p = wrow(w, rb, r);
            const float b = w->bias ? w->bias[r] : 0.0f;
            for (int t = t0; t < t1; t++)
                Y[(size_t)t * rows + r] = K.qdot[w->type](p, xq + (size_t)(t - t0) * vb, cols) + b;
        }
    }
    free(xq);
}

void kv_matmul(const kv_weight *w, const float *X0, int n, float *Y)
{
    k_ready();
    if (kv_dtype_is_block(w->type)) {
        matmul_block(w, X0, n, Y);
        return;
    }
    const size_t rb = kv_dtype_row_bytes(w->type, w->cols);
    const int rows = w->rows, cols = w->cols;
    const bool is_f32 = w->type == KV_DT_F32;
    /* F16 and BF16 weights meet their tokens rounded to the type, as in a
     * decode step (xq_get); Xr holds one tile of them. */
    float *Xr = NULL;
    if (K.round[w->type] && !(Xr = malloc((size_t)(n < KV_MM_TOKENS ? n : KV_MM_TOKENS) * cols * sizeof(float)))) {
        for (size_t i = 0; i < (size_t)n * rows; i++) Y[i] = NAN;
        return;
    }
    for (int t0 = 0; t0 < n; t0 += KV_MM_TOKENS) {
        int t1 = t0 + KV_MM_TOKENS < n ? t0 + KV_MM_TOKENS : n;
        int npair = (rows + 1) / 2;
        /* the tile's tokens as the weight meets them: token t at X + (t - t0) * cols */
        const float *X = X0 + (size_t)t0 * cols;
        if (Xr) {
            for (int t = t0; t < t1; t++)
                K.round[w->type](X0 + (size_t)t * cols, Xr + (size_t)(t - t0) * cols, cols);
            X = Xr;
        }
#pragma omp parallel if ((long)rows * cols * (t1 - t0) > 32768)
        {
            /* two decoded rows per pair for non-f32 weights */
            float *buf = is_f32 ? NULL : malloc(2 * (size_t)cols * sizeof(float));
#pragma omp for schedule(static)
            for (int rp = 0; rp < npair; rp++) {
                int r0 = 2 * rp, r1 = r0 + 1 < rows ? r0 + 1 : r0;
                const float *w0, *w1;
                if (is_f32) {
                    w0 = (const float *)wrow(w, rb, r0);
                    w1 = (const float *)wrow(w, rb, r1);
                } else if (buf) {
                    K.row[w->type](wrow(w, rb, r0), buf, cols);
                    K.row[w->type](wrow(w, rb, r1), buf + cols, cols);
                    w0 = buf;
                    w1 = buf + cols;
                } else { /* no scratch: decode per token instead */
                    for (int t = t0; t < t1; t++) {
                        Y[(size_t)t * rows + r0] = K.dot[w->type](wrow(w, rb, r0), X + (size_t)(t - t0) * cols, cols);
                        Y[(size_t)t * rows + r1] = K.dot[w->type](wrow(w, rb, r1), X + (size_t)(t - t0) * cols, cols);
                    }
                    continue;
                }
                int t = t0;
                for (; t + 4 <= t1; t += 4) {
                    float o[2][4];
                    K.tile(w0, w1, X + (size_t)(t - t0) * cols, (size_t)cols, cols, o);
                    for (int j = 0; j < 4; j++) {
                        Y[(size_t)(t + j) * rows + r0] = o[0][j];
                        Y[(size_t)(t + j) * rows + r1] = o[1][j];
                    }
                }
                for (; t < t1; t++) {
                    Y[(size_t)t * rows + r0] = K.dot_f32(w0, X + (size_t)(t - t0) * cols, cols);
                    Y[(size_t)t * rows + r1] = K.dot_f32(w1, X + (size_t)(t - t0) * cols, cols);
                }
            }
            free(buf);
        }
        if (w->bias)
            for (int t = t0; t < t1; t++)
                for (int r = 0; r < rows; r++) Y[(size_t)t * rows + r] += w->bias[r];
    }
    free(Xr);
}

void kv_attend_head_f32(const float *q, const float *k, const float *v, int T, int D, float scale,
                        float *out, float *probs, float *s)
{
    k_ready();
    memset(out, 0, (size_t)D * sizeof(float));
    if (T <= 0) return;
    float mx = -INFINITY;
    for (int t = 0; t < T; t++) {
        s[t] = K.dot_f32(q, k + (size_t)t * D, D) * scale;
        if (s[t] > mx) mx = s[t];
    }
    double sum = 0.0;
    for (int t = 0; t < T; t++) {
        s[t] = expf(s[t] - mx);
        sum += s[t];
    }
    const float inv = (float)(1.0 / sum);
    for (int t = 0; t < T; t++) {
        s[t] *= inv;
        K.axpy(s[t], v + (size_t)t * D, out, D);
    }
    if (probs) memcpy(probs, s, (size_t)T * sizeof(float));
}

/* Sum of squares in double (float products, as ggml's CPU backend), mean
 * rounded to float once, then scale * x * w in float. */
void kv_rmsnorm(float *o, const float *x, const float *w, int n, float eps)
{
    double ss = 0.0;
    for (int j = 0; j < n; j++) ss += (double)(x[j] * x[j]);
    const float mean = (float)(ss / n);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int j = 0; j < n; j++) o[j] = w[j] * (scale * x[j]);
}

/* silu(g) = g / (1 + exp(-g)): one division, not g * (1 / (1 + exp(-g))),
 * whose two roundings put it one float step off in about a quarter of
 * cases; the same formula as ggml's silu. */
void kv_swiglu(float *hb, const float *hb2, int n)
{
    for (int i = 0; i < n; i++) hb[i] = hb[i] / (1.0f + expf(-hb[i])) * hb2[i];
}
