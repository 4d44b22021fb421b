/*
 * kv_matmul_q: integer dot products of packed ggml rows with quantized
 * activations (see kv_matmul_q.h).  Every kernel computes exactly the
 * integer block sums of kv_quant_dot_ref and only accumulates them in a
 * different float order.  The AVX2 versions share one pattern: turn a
 * group of 32 packed codes into 32 unsigned bytes, multiply them with the
 * 32 int8 activations into 16-bit pair sums (maddubs: no overflow, the
 * codes are below 64 and the activations within ±127), weight the pairs by
 * the group scales in a 16-bit multiply-add, and keep the block total in
 * 32-bit lanes.  The constant part of a code is applied through the
 * activation sums (Q8_K bsums, Q8_1 s) instead of per value: the -8 and
 * -16 of Q4_0/Q5_0 and the mins of the K-quants once per group; Q3_K's -4
 * per pair of products in 16 bits and Q6_K's -32 per 32-bit lane, both in
 * integers before the lane's one rounding, as llama.cpp's AVX2 kernels do
 * (a float correction after the rounding cancelled against the sums).
 */
#include "model/kv_matmul_q.h"

#include <math.h>
#include <string.h>

#include "common/kv_ggml.h"
#include "model/kv_quants.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KV_X86 1
#endif

// --- portable: the reference --------------------------------------------------

#define REF(name, type) \
    static float name(const void *row, const void *xq, int n) { return kv_quant_dot_ref(type, row, xq, n); }
REF(ref_q4_0, KV_GGML_Q4_0)
REF(ref_q4_1, KV_GGML_Q4_1)
REF(ref_q5_0, KV_GGML_Q5_0)
REF(ref_q5_1, KV_GGML_Q5_1)
REF(ref_q8_0, KV_GGML_Q8_0)
REF(ref_q2_k, KV_GGML_Q2_K)
REF(ref_q3_k, KV_GGML_Q3_K)
REF(ref_q4_k, KV_GGML_Q4_K)
REF(ref_q5_k, KV_GGML_Q5_K)
REF(ref_q6_k, KV_GGML_Q6_K)
#undef REF

static inline float f16at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return kv_ggml_f16(h);
}

// --- AVX2 ------------------------------------------------------------------------

/* The 8 scales and 8 mins of a Q4_K/Q5_K block as bytes, by whole words
 * (the bit placement of kv_ggml_k4_scale_min, four at a time). */
static inline void k4_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn)
{
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    uint32_t a = u0 & 0x3f3f3f3fu, b = (u2 & 0x0f0f0f0fu) | ((u0 >> 6) & 0x03030303u) << 4;
    uint32_t c = u1 & 0x3f3f3f3fu, d = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 6) & 0x03030303u) << 4;
    memcpy(sc, &a, 4);
    memcpy(sc + 4, &b, 4);
    memcpy(mn, &c, 4);
    memcpy(mn + 4, &d, 4);
}


#ifdef KV_X86
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

KV_AVX2 static inline float hsum_ps(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* 32 unsigned codes · 32 int8 activations -> 8 int32 partial sums */
KV_AVX2 static inline __m256i dot_u8_i8(__m256i u, __m256i y)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1));
}

/* 32 signed codes · 32 int8 activations (|code| <= 127) */
KV_AVX2 static inline __m256i dot_i8_i8(__m256i q, __m256i y)
{
    return dot_u8_i8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));
}

/* The 32 nibbles of 16 bytes: value j < 16 is the low nibble of byte j,
 * value 16 + j its high nibble (the layout of the 32-value types). */
KV_AVX2 static inline __m256i nibbles32(const uint8_t *qs)
{
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i m = _mm_set1_epi8(0xF);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

/* 0x10 in byte j where bit j of the 32-bit word is set */
KV_AVX2 static inline __m256i bits32_to_0x10(uint32_t h)
{
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

KV_AVX2 static float avx2_q8_0(const void *row, const void *xq, int n)
{
    const uint8_t *w = row;
    const kv_block_q8_0 *y = xq;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / 32; b++, w += sizeof(kv_block_q8_0)) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
        __m256i s = dot_i8_i8(q, _mm256_loadu_si256((const __m256i *)y[b].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16at(w) * kv_ggml_f16(y[b].d)), _mm256_cvtepi32_ps(s), acc);
    }
    return hsum_ps(acc);
}

KV_AVX2 static float avx2_q4_0(const void *row, const void *xq, int n)
{
    const uint8_t *w = row;
    const kv_block_q8_0 *y = xq;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / 32; b++, w += sizeof(kv_block_q4_0)) {
        __m256i q = _mm256_sub_epi8(nibbles32(w + 2), _mm256_set1_epi8(8));
        __m256i s = dot_i8_i8(q, _mm256_loadu_si256((const __m256i *)y[b].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16at(w) * kv_ggml_f16(y[b].d)), _mm256_cvtepi32_ps(s), acc);
    }
    return hsum_ps(acc);
}

KV_AVX2 static float avx2_q4_1(const void *row, const void *xq, int n)
{
    const uint8_t *w = row;
    const kv_block_q8_1 *y = xq;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0;
    for (int b = 0; b < n / 32; b++, w += sizeof(kv_block_q4_1)) {
        __m256i s = dot_u8_i8(nibbles32(w + 4), _mm256_loadu_si256((const __m256i *)y[b].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16at(w) * kv_ggml_f16(y[b].d)), _mm256_cvtepi32_ps(s), acc);
        mins += f16at(w + 2) * kv_ggml_f16(y[b].s);
    }
    return hsum_ps(acc) + mins;
}

KV_AVX2 static float avx2_q5_0(const void *row, const void *xq, int n)
{
    const uint8_t *w = row;
    const kv_block_q8_0 *y = xq;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / 32; b++, w += sizeof(kv_block_q5_0)) {
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        __m256i q = _mm256_or_si256(nibbles32(w + 6), bits32_to_0x10(qh));
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        __m256i s = dot_i8_i8(q, _mm256_loadu_si256((const __m256i *)y[b].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16at(w) * kv_ggml_f16(y[b].d)), _mm256_cvtepi32_ps(s), acc);
    }
    return hsum_ps(acc);
}

KV_AVX2 static float avx2_q5_1(const void *row, const void *xq, int n)
{
    const uint8_t *w = row;
    const kv_block_q8_1 *y = xq;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0;
    for (int b = 0; b < n / 32; b++, w += sizeof(kv_block_q5_1)) {
        uint32_t qh;
        memcpy(&qh, w + 4, 4);
        __m256i q = _mm256_or_si256(nibbles32(w + 8), bits32_to_0x10(qh));
        __m256i s = dot_u8_i8(q, _mm256_loadu_si256((const __m256i *)y[b].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16at(w) * kv_ggml_f16(y[b].d)), _mm256_cvtepi32_ps(s), acc);
        mins += f16at(w + 2) * kv_ggml_f16(y[b].s);
    }
    return hsum_ps(acc) + mins;
}

/* 16-bit scale vector: a in the first 8 lanes (values 0..15 of a 32-value
 * chunk), b in the last 8 (values 16..31). */
KV_AVX2 static inline __m256i scales2(int a, int b)
{
    return _mm256_set_m128i(_mm_set1_epi16((short)b), _mm_set1_epi16((short)a));
}

KV_AVX2 static inline __m256i ld(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* sum over the 8 groups of 32 of m[k] * (bsums[2k] + bsums[2k+1]) */
KV_AVX2 static inline int mins_dot(const int16_t *bsums, const uint8_t *mn)
{
    __m128i lo = _mm_loadu_si128((const __m128i *)bsums), hi = _mm_loadu_si128((const __m128i *)(bsums + 8));
    __m128i pairs = _mm_hadd_epi16(lo, hi); /* 8 sums of 32 values: |sum| <= 32 * 127 */
    __m128i m = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn));
    __m128i p = _mm_madd_epi16(pairs, m);
    p = _mm_add_epi32(p, _mm_unpackhi_epi64(p, p));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 1));
    return _mm_cvtsi128_si32(p);
}

/* Q4_K and Q5_K share their scales, mins and nibbles; Q5_K adds a fifth
 * bit per value from qh (q5, a constant where it is inlined). */
KV_AVX2 static inline float avx2_k45(const void *row, const void *xq, int n, bool q5)
{
    const uint8_t *w = row;
    const kv_block_q8_k *y = xq;
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const size_t bytes = q5 ? sizeof(kv_block_q5_k) : sizeof(kv_block_q4_k);
    __m256 acc = _mm256_setzero_ps();
    float accm = 0;
    for (int b = 0; b < n / 256; b++, w += bytes) {
        const uint8_t *qh = w + 16, *qs = w + (q5 ? 48 : 16);
        uint8_t s[8], m[8];
        k4_scales(w + 4, s, m);
        const int msum = mins_dot(y[b].bsums, m);
        const __m256i h = q5 ? ld(qh) : _mm256_setzero_si256();
        __m256i isum = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            __m256i q = ld(qs + 32 * p);
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (q5) {
                __m256i hl = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * p), one), 4);
                __m256i hh = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * p + 1), one), 4);
                lo = _mm256_or_si256(lo, hl);
                hi = _mm256_or_si256(hi, hh);
            }
            __m256i plo = _mm256_maddubs_epi16(lo, ld((const uint8_t *)y[b].qs + 64 * p));
            __m256i phi = _mm256_maddubs_epi16(hi, ld((const uint8_t *)y[b].qs + 64 * p + 32));
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(plo, _mm256_set1_epi16((short)s[2 * p])));
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(phi, _mm256_set1_epi16((short)s[2 * p + 1])));
        }
        const float dy = y[b].d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dy * f16at(w)), _mm256_cvtepi32_ps(isum), acc);
        /* Q5_K: one rounding, as llama.cpp's contracted sum.  Q4_K left as
           it was: llama.cpp repacks Q4_K rows in multiples of 8 and its
           plain kernel (other row counts) sums the mins in 4 fma lanes,
           neither of which this form matches yet. */
        if (q5)
            accm = fmaf(dy * f16at(w + 2), (float)msum, accm);
        else
            accm += dy * f16at(w + 2) * (float)msum;
    }
    return hsum_ps(acc) - accm;
}

KV_AVX2 static float avx2_q4_k(const void *row, const void *xq, int n) { return avx2_k45(row, xq, n, false); }
KV_AVX2 static float avx2_q5_k(const void *row, const void *xq, int n) { return avx2_k45(row, xq, n, true); }

KV_AVX2 static float avx2_q6_k(const void *row, const void *xq, int n)
{
    const uint8_t *w = row;
    const kv_block_q8_k *y = xq;
    const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / 256; b++, w += sizeof(kv_block_q6_k)) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        /* The -32 of every code, through the group sums, taken off in
         * integers lane by lane before the lane's one rounding: corr's lane
         * j holds 32 x scale x bsum of groups 2j and 2j+1 (|corr| <= 2^24),
         * isum's lane j the scaled products of other values (|isum| <=
         * ~3.3e7), so the difference is exact in int32 and each lane is an
         * exact integer, as in llama.cpp's kernel.  As a float term after
         * the rounding it cancelled against sums up to ~2^25 (codes 0..63). */
        const __m256i corr = _mm256_slli_epi32(
            _mm256_madd_epi16(ld((const uint8_t *)y[b].bsums), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc))), 5);
        __m256i isum = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i l0 = ld(ql + 64 * h), l1 = ld(ql + 64 * h + 32), hb = ld(qh + 32 * h);
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
            for (int s = 0; s < 4; s++) {
                __m256i p = _mm256_maddubs_epi16(q[s], ld((const uint8_t *)y[b].qs + 128 * h + 32 * s));
                int k = 8 * h + 2 * s;
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scales2(sc[k], sc[k + 1])));
            }
        }
        const float dy = y[b].d * f16at(w + 208);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dy), _mm256_cvtepi32_ps(_mm256_sub_epi32(isum, corr)), acc);
    }
    return hsum_ps(acc);
}

KV_AVX2 static float avx2_q3_k(const void *row, const void *xq, int n)
{
    const uint8_t *w = row;
    const kv_block_q8_k *y = xq;
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / 256; b++, w += sizeof(kv_block_q3_k)) {
        const uint8_t *hm = w, *qs = w + 32;
        /* the 16 6-bit scales by whole words (kv_ggml_q3k_scales' placement) */
        uint32_t u0, u1, t, q4[4];
        memcpy(&u0, w + 96, 4);
        memcpy(&u1, w + 100, 4);
        memcpy(&t, w + 104, 4);
        q4[0] = (u0 & 0x0f0f0f0fu) | (t & 0x03030303u) << 4;
        q4[1] = (u1 & 0x0f0f0f0fu) | ((t >> 2) & 0x03030303u) << 4;
        q4[2] = ((u0 >> 4) & 0x0f0f0f0fu) | ((t >> 4) & 0x03030303u) << 4;
        q4[3] = ((u1 >> 4) & 0x0f0f0f0fu) | ((t >> 6) & 0x03030303u) << 4;
        int8_t sc[16];
        __m128i sv = _mm_sub_epi8(_mm_loadu_si128((const __m128i *)q4), _mm_set1_epi8(32));
        _mm_storeu_si128((__m128i *)sc, sv);
        /* codes are stored +4 (clear high bit = -4): the 4 comes off each
         * pair of products in 16 bits (4 * y, |.| <= 1016), so every lane
         * holds the exact sum of its values before its one rounding */
        const __m256i four = _mm256_set1_epi8(4);
        const __m256i hb = ld(hm);
        __m256i isum = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q2 = ld(qs + 32 * h);
            for (int s = 0; s < 4; s++) {
                __m256i lo = _mm256_and_si256(_mm256_srli_epi16(q2, 2 * s), m2);
                __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4 * h + s), one), 2);
                const __m256i yv = ld((const uint8_t *)y[b].qs + 128 * h + 32 * s);
                __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(_mm256_or_si256(lo, hi), yv),
                                             _mm256_maddubs_epi16(four, yv));
                int k = 8 * h + 2 * s;
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scales2(sc[k], sc[k + 1])));
            }
        }
        const float dy = y[b].d * f16at(w + 108);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dy), _mm256_cvtepi32_ps(isum), acc);
    }
    return hsum_ps(acc);
}

KV_AVX2 static float avx2_q2_k(const void *row, const void *xq, int n)
{
    const uint8_t *w = row;
    const kv_block_q8_k *y = xq;
    const __m256i m2 = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / 256; b++, w += sizeof(kv_block_q2_k)) {
        const uint8_t *sc = w, *qs = w + 16;
        /* the mins term lane by lane (lane j: groups 2j, 2j+1), into the
         * same accumulator: 8 exact integer sums, one rounding each */
        const float dy = y[b].d;
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_srli_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)sc),
                                                                                  _mm_set1_epi8((char)0xF0)), 4));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(-(dy * f16at(w + 82))),
                              _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, ld((const uint8_t *)y[b].bsums))), acc);
        __m256i isum = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q2 = ld(qs + 32 * h);
            for (int s = 0; s < 4; s++) {
                __m256i q = _mm256_and_si256(_mm256_srli_epi16(q2, 2 * s), m2);
                __m256i p = _mm256_maddubs_epi16(q, ld((const uint8_t *)y[b].qs + 128 * h + 32 * s));
                int k = 8 * h + 2 * s;
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scales2(sc[k] & 0xF, sc[k + 1] & 0xF)));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dy * f16at(w + 80)), _mm256_cvtepi32_ps(isum), acc);
    }
    return hsum_ps(acc);
}
#endif

kv_qdot_fn kv_qdot_select(uint32_t type, bool avx2)
{
#ifdef KV_X86
    if (avx2) {
        switch (type) {
        case KV_GGML_Q4_0: return avx2_q4_0;
        case KV_GGML_Q4_1: return avx2_q4_1;
        case KV_GGML_Q5_0: return avx2_q5_0;
        case KV_GGML_Q5_1: return avx2_q5_1;
        case KV_GGML_Q8_0: return avx2_q8_0;
        case KV_GGML_Q2_K: return avx2_q2_k;
        case KV_GGML_Q3_K: return avx2_q3_k;
        case KV_GGML_Q4_K: return avx2_q4_k;
        case KV_GGML_Q5_K: return avx2_q5_k;
        case KV_GGML_Q6_K: return avx2_q6_k;
        default: return NULL;
        }
    }
#else
    (void)avx2;
#endif
    switch (type) {
    case KV_GGML_Q4_0: return ref_q4_0;
    case KV_GGML_Q4_1: return ref_q4_1;
    case KV_GGML_Q5_0: return ref_q5_0;
    case KV_GGML_Q5_1: return ref_q5_1;
    case KV_GGML_Q8_0: return ref_q8_0;
    case KV_GGML_Q2_K: return ref_q2_k;
    case KV_GGML_Q3_K: return ref_q3_k;
    case KV_GGML_Q4_K: return ref_q4_k;
    case KV_GGML_Q5_K: return ref_q5_k;
    case KV_GGML_Q6_K: return ref_q6_k;
    default: return NULL;
    }
}
