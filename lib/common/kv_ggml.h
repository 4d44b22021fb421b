/*
 * ggml tensor types and the packed block layouts of the quantized ones,
 * declared once for C (lib/) and CUDA (kernels/), from the layouts
 * llama.cpp publishes (ggml-common.h, docs of the GGUF format).  A block
 * holds QK values of one row; a row of n values (n a multiple of QK) is
 * n / QK consecutive blocks.  Every struct is packed by its field order
 * (no padding: each size is asserted below), little-endian, fp16 scales
 * stored as IEEE binary16 bits.
 *
 * The dequantization of one block is written here as KV_HD inline
 * functions, so that the CPU reference (lib/model/kv_quants.c) and a GPU
 * kernel run the same arithmetic:
 *
 *   Q4_0  32 values: x = d * (q - 8),          q 4 bits
 *   Q4_1  32 values: x = d * q + m,            q 4 bits
 *   Q5_0  32 values: x = d * (q - 16),         q 5 bits (4 in qs, 1 in qh)
 *   Q5_1  32 values: x = d * q + m,            q 5 bits
 *   Q8_0  32 values: x = d * q,                q int8
 *   Q2_K 256 values: 16 groups of 16, x = d*sc*q - dmin*m, sc/m 4 bits, q 2 bits
 *   Q3_K 256 values: 16 groups of 16, x = d*(sc-32)*(q-4), sc 6 bits, q 3 bits
 *   Q4_K 256 values:  8 groups of 32, x = d*sc*q - dmin*m, sc/m 6 bits, q 4 bits
 *   Q5_K 256 values:  8 groups of 32, x = d*sc*q - dmin*m, sc/m 6 bits, q 5 bits
 *   Q6_K 256 values: 16 groups of 16, x = d*sc*(q-32), sc int8, q 6 bits
 *
 * In Q4_0/Q4_1/Q5_x block value j < 16 is the low nibble of qs[j] and value
 * j + 16 its high nibble.  The K-quant bit placements are spelled out in
 * each kv_ggml_dequant_* below.  Q8_1 and Q8_K are the activation formats
 * the integer dot products use (ggml's vec_dot_type): a matvec quantizes
 * its input vector once into them.
 */
#ifndef KV_GGML_H
#define KV_GGML_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_half.h"

#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

#ifndef KV_HD
#ifdef __CUDACC__
#define KV_HD __host__ __device__
#else
#define KV_HD
#endif
#endif

#ifndef __cplusplus
#include <assert.h> /* static_assert in C11 */
#endif

/* ggml_type numbers as stored in GGUF tensor infos (gaps are retired types). */
enum {
    KV_GGML_F32 = 0, KV_GGML_F16 = 1, KV_GGML_Q4_0 = 2, KV_GGML_Q4_1 = 3,
    KV_GGML_Q5_0 = 6, KV_GGML_Q5_1 = 7, KV_GGML_Q8_0 = 8, KV_GGML_Q8_1 = 9,
    KV_GGML_Q2_K = 10, KV_GGML_Q3_K = 11, KV_GGML_Q4_K = 12, KV_GGML_Q5_K = 13,
    KV_GGML_Q6_K = 14, KV_GGML_Q8_K = 15, KV_GGML_IQ2_XXS = 16, KV_GGML_IQ2_XS = 17,
    KV_GGML_IQ3_XXS = 18, KV_GGML_IQ1_S = 19, KV_GGML_IQ4_NL = 20, KV_GGML_IQ3_S = 21,
    KV_GGML_IQ2_S = 22, KV_GGML_IQ4_XS = 23, KV_GGML_I8 = 24, KV_GGML_I16 = 25,
    KV_GGML_I32 = 26, KV_GGML_I64 = 27, KV_GGML_F64 = 28, KV_GGML_IQ1_M = 29,
    KV_GGML_BF16 = 30, KV_GGML_TQ1_0 = 34, KV_GGML_TQ2_0 = 35, KV_GGML_MXFP4 = 39,
    KV_GGML_TYPE_LIMIT = 40 /* one past the largest number named here */
};

#define KV_QK 32   /* values per block of the 32-value types */
#define KV_QK_K 256 /* values per K-quant super-block */

typedef struct {
    uint16_t d;         /* fp16 delta */
    uint8_t qs[KV_QK / 2]; /* nibbles */
} kv_block_q4_0;

typedef struct {
    uint16_t d, m;      /* fp16 delta, min */
    uint8_t qs[KV_QK / 2];
} kv_block_q4_1;

typedef struct {
    uint16_t d;
    uint8_t qh[4];      /* bit j: the fifth bit of value j */
    uint8_t qs[KV_QK / 2];
} kv_block_q5_0;

typedef struct {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[KV_QK / 2];
} kv_block_q5_1;

typedef struct {
    uint16_t d;
    int8_t qs[KV_QK];
} kv_block_q8_0;

typedef struct {
    uint16_t d, s;      /* fp16 delta, and d * sum(qs) */
    int8_t qs[KV_QK];
} kv_block_q8_1;

typedef struct {
    uint8_t scales[KV_QK_K / 16]; /* low nibble: scale, high nibble: min, per 16 values */
    uint8_t qs[KV_QK_K / 4];      /* 2-bit quants */
    uint16_t d, dmin;             /* fp16 super-block scales of the scales and of the mins */
} kv_block_q2_k;

typedef struct {
    uint8_t hmask[KV_QK_K / 8];   /* high bit of each 3-bit quant */
    uint8_t qs[KV_QK_K / 4];      /* low 2 bits */
    uint8_t scales[12];           /* 16 scales of 6 bits */
    uint16_t d;
} kv_block_q3_k;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];           /* 8 scales and 8 mins of 6 bits */
    uint8_t qs[KV_QK_K / 2];
} kv_block_q4_k;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[KV_QK_K / 8];      /* fifth bits */
    uint8_t qs[KV_QK_K / 2];      /* low 4 bits */
} kv_block_q5_k;

typedef struct {
    uint8_t ql[KV_QK_K / 2];      /* low 4 bits */
    uint8_t qh[KV_QK_K / 4];      /* high 2 bits */
    int8_t scales[KV_QK_K / 16];  /* per 16 values */
    uint16_t d;
} kv_block_q6_k;

typedef struct {
    float d;                      /* f32 delta */
    int8_t qs[KV_QK_K];
    int16_t bsums[KV_QK_K / 16];  /* sum of qs over each 16 values */
} kv_block_q8_k;

static_assert(sizeof(kv_block_q4_0) == 18, "Q4_0 block is 18 bytes");
static_assert(sizeof(kv_block_q4_1) == 20, "Q4_1 block is 20 bytes");
static_assert(sizeof(kv_block_q5_0) == 22, "Q5_0 block is 22 bytes");
static_assert(sizeof(kv_block_q5_1) == 24, "Q5_1 block is 24 bytes");
static_assert(sizeof(kv_block_q8_0) == 34, "Q8_0 block is 34 bytes");
static_assert(sizeof(kv_block_q8_1) == 36, "Q8_1 block is 36 bytes");
static_assert(sizeof(kv_block_q2_k) == 84, "Q2_K block is 84 bytes");
static_assert(sizeof(kv_block_q3_k) == 110, "Q3_K block is 110 bytes");
static_assert(sizeof(kv_block_q4_k) == 144, "Q4_K block is 144 bytes");
static_assert(sizeof(kv_block_q5_k) == 176, "Q5_K block is 176 bytes");
static_assert(sizeof(kv_block_q6_k) == 210, "Q6_K block is 210 bytes");
static_assert(sizeof(kv_block_q8_k) == 292, "Q8_K block is 292 bytes");

/* fp16 bits to float, the same on the host and on a device. */
static inline KV_HD float kv_ggml_f16(uint16_t h)
{
#ifdef __CUDA_ARCH__
    return __half2float(__ushort_as_half(h));
#else
    return kv_half_to_f32(h); /* one host conversion for the whole project */
#endif
}

/* Scale and min j (0..7) of a Q4_K/Q5_K block: 6 bits each in 12 bytes.
 * j < 4: the low 6 bits of bytes j and j+4; j >= 4: a nibble of byte j+4
 * plus the top 2 bits of bytes j-4 (scale) and j (min). */
static inline KV_HD void kv_ggml_k4_scale_min(int j, const uint8_t *s, int *sc, int *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* The 16 signed scales (-32..31) of a Q3_K block: scale i has its low 4
 * bits in byte i % 8 (low nibble for i < 8, high nibble for i >= 8) and its
 * high 2 bits in byte 8 + i % 4 at bit 2 * (i / 4). */
static inline KV_HD void kv_ggml_q3k_scales(const uint8_t *s, int *out)
{
    for (int i = 0; i < 16; i++) {
        int lo = i < 8 ? s[i] & 0xF : s[i - 8] >> 4;
        int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        out[i] = (lo | (hi << 4)) - 32;
    }
}

static inline KV_HD void kv_ggml_dequant_q4_0(const kv_block_q4_0 *b, float *y)
{
    float d = kv_ggml_f16(b->d);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b->qs[j] & 0xF) - 8);
        y[j + 16] = d * (float)((b->qs[j] >> 4) - 8);
    }
}

static inline KV_HD void kv_ggml_dequant_q4_1(const kv_block_q4_1 *b, float *y)
{
    float d = kv_ggml_f16(b->d), m = kv_ggml_f16(b->m);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(b->qs[j] & 0xF) + m;
        y[j + 16] = d * (float)(b->qs[j] >> 4) + m;
    }
}

static inline KV_HD uint32_t kv_ggml_qh32(const uint8_t *qh)
{
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

static inline KV_HD void kv_ggml_dequant_q5_0(const kv_block_q5_0 *b, float *y)
{
    float d = kv_ggml_f16(b->d);
    uint32_t qh = kv_ggml_qh32(b->qh);
    for (int j = 0; j < 16; j++) {
        int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
        y[j] = d * (float)(((b->qs[j] & 0xF) | h0 << 4) - 16);
        y[j + 16] = d * (float)(((b->qs[j] >> 4) | h1 << 4) - 16);
    }
}

static inline KV_HD void kv_ggml_dequant_q5_1(const kv_block_q5_1 *b, float *y)
{
    float d = kv_ggml_f16(b->d), m = kv_ggml_f16(b->m);
    uint32_t qh = kv_ggml_qh32(b->qh);
    for (int j = 0; j < 16; j++) {
        int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
        y[j] = d * (float)((b->qs[j] & 0xF) | h0 << 4) + m;
        y[j + 16] = d * (float)((b->qs[j] >> 4) | h1 << 4) + m;
    }
}

static inline KV_HD void kv_ggml_dequant_q8_0(const kv_block_q8_0 *b, float *y)
{
    float d = kv_ggml_f16(b->d);
    for (int j = 0; j < KV_QK; j++) y[j] = d * (float)b->qs[j];
}

/* Q2_K: values 128*h + 32*s + l (h < 2, s < 4, l < 32) are bits 2s..2s+1 of
 * qs[32*h + l]; each 16 values k = 0..15 in that order use scales[k]. */
static inline KV_HD void kv_ggml_dequant_q2_k(const kv_block_q2_k *b, float *y)
{
    float d = kv_ggml_f16(b->d), dmin = kv_ggml_f16(b->dmin);
    for (int k = 0; k < 16; k++) {
        float dl = d * (float)(b->scales[k] & 0xF), ml = dmin * (float)(b->scales[k] >> 4);
        int h = k / 8, s = (k / 2) % 4, l0 = (k % 2) * 16;
        for (int l = l0; l < l0 + 16; l++)
            y[16 * k + l - l0] = dl * (float)((b->qs[32 * h + l] >> (2 * s)) & 3) - ml;
    }
}

/* Q3_K: the same 2-bit placement as Q2_K in qs; the third bit of value
 * 128*h + 32*s + l is bit 4h + s of hmask[l]; a clear bit subtracts 4. */
static inline KV_HD void kv_ggml_dequant_q3_k(const kv_block_q3_k *b, float *y)
{
    float d = kv_ggml_f16(b->d);
    int sc[16];
    kv_ggml_q3k_scales(b->scales, sc);
    for (int k = 0; k < 16; k++) {
        float dl = d * (float)sc[k];
        int h = k / 8, s = (k / 2) % 4, l0 = (k % 2) * 16;
        for (int l = l0; l < l0 + 16; l++) {
            int q = (b->qs[32 * h + l] >> (2 * s)) & 3;
            q -= (b->hmask[l] >> (4 * h + s)) & 1 ? 0 : 4;
            y[16 * k + l - l0] = dl * (float)q;
        }
    }
}

/* Q4_K: values 64*p + l (l < 32) are the low nibbles of qs[32*p + l] with
 * scale/min 2p, values 64*p + 32 + l the high nibbles with 2p + 1. */
static inline KV_HD void kv_ggml_dequant_q4_k(const kv_block_q4_k *b, float *y)
{
    float d = kv_ggml_f16(b->d), dmin = kv_ggml_f16(b->dmin);
    for (int p = 0; p < 4; p++) {
        int s0, m0, s1, m1;
        kv_ggml_k4_scale_min(2 * p, b->scales, &s0, &m0);
        kv_ggml_k4_scale_min(2 * p + 1, b->scales, &s1, &m1);
        float d0 = d * (float)s0, n0 = dmin * (float)m0, d1 = d * (float)s1, n1 = dmin * (float)m1;
        for (int l = 0; l < 32; l++) {
            y[64 * p + l] = d0 * (float)(b->qs[32 * p + l] & 0xF) - n0;
            y[64 * p + 32 + l] = d1 * (float)(b->qs[32 * p + l] >> 4) - n1;
        }
    }
}

/* Q5_K: Q4_K's nibbles plus a fifth bit: bit 2p of qh[l] for value
 * 64*p + l, bit 2p + 1 for value 64*p + 32 + l. */
static inline KV_HD void kv_ggml_dequant_q5_k(const kv_block_q5_k *b, float *y)
{
    float d = kv_ggml_f16(b->d), dmin = kv_ggml_f16(b->dmin);
    for (int p = 0; p < 4; p++) {
        int s0, m0, s1, m1;
        kv_ggml_k4_scale_min(2 * p, b->scales, &s0, &m0);
        kv_ggml_k4_scale_min(2 * p + 1, b->scales, &s1, &m1);
        float d0 = d * (float)s0, n0 = dmin * (float)m0, d1 = d * (float)s1, n1 = dmin * (float)m1;
        for (int l = 0; l < 32; l++) {
            int q0 = (b->qs[32 * p + l] & 0xF) | ((b->qh[l] >> (2 * p)) & 1) << 4;
            int q1 = (b->qs[32 * p + l] >> 4) | ((b->qh[l] >> (2 * p + 1)) & 1) << 4;
            y[64 * p + l] = d0 * (float)q0 - n0;
            y[64 * p + 32 + l] = d1 * (float)q1 - n1;
        }
    }
}

/* Q6_K: in each half h (128 values), value 128*h + 32*s + l (s < 4) takes
 * the low nibble (s even) or high nibble (s odd) of ql[64*h + 32*(s%2) + l]
 * and bits 2s..2s+1 of qh[32*h + l]; its scale is scales[8*h + 2*s + l/16]. */
static inline KV_HD void kv_ggml_dequant_q6_k(const kv_block_q6_k *b, float *y)
{
    float d = kv_ggml_f16(b->d);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                uint8_t lo = b->ql[64 * h + 32 * (s % 2) + l];
                int q = ((s < 2 ? lo & 0xF : lo >> 4) | ((b->qh[32 * h + l] >> (2 * s)) & 3) << 4) - 32;
                y[128 * h + 32 * s + l] = d * (float)b->scales[8 * h + 2 * s + l / 16] * (float)q;
            }
}

/* Host-side type table (lib/common/kv_ggml.c). */
typedef struct {
    const char *name;   /* "Q4_K", "IQ2_XS", ...; NULL for an unused number */
    int block;          /* values per block (1 for plain types) */
    int bytes;          /* bytes per block; 0: a type this table cannot size */
} kv_ggml_type_info;

/* Name of a ggml type number ("Q3_K"), "type N" style text for unknown ones
 * written into buf (which must hold 16 bytes); never NULL. */
const char *kv_ggml_type_name(uint32_t type, char *buf);
/* Info of a type, or NULL if the number names no type. */
const kv_ggml_type_info *kv_ggml_type_info_of(uint32_t type);
/* Type number of a name ("q4_k", case-insensitive), or -1. */
int kv_ggml_type_parse(const char *name);

#endif
