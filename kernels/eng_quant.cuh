/*
 * eng_quant: device access to the ggml blocks the GPU engine keeps packed
 * (Q8_0, Q4_K and Q6_K, the types of Q8_0 and Q4_K_M files), read as they
 * are stored: the block structs and bit placements of lib/common/kv_ggml.h,
 * whose kv_ggml_dequant_* are the CPU reference (lib/model/kv_quants.c).
 * Shared by the packed GEMV (eng_gemv_q.cu) and the row dequantization
 * (eng_dequant.cu).
 *
 * A block is split into PARTS parts of VALS consecutive-in-meaning values,
 * one part per lane, so that PARTS lanes share a block and a warp covers
 * 32 / PARTS blocks per iteration:
 *   Q8_0  (32 values, 34 bytes)   4 parts:  values 8p .. 8p+7
 *   Q4_K (256 values, 144 bytes)  4 parts:  values 64p .. 64p+63 (the low
 *         nibbles of qs[32p..32p+32) with scale/min 2p, the high ones with 2p+1)
 *   Q6_K (256 values, 210 bytes)  8 parts:  part 4h+s holds values
 *         128h + 32s + l, l < 32 (scales 8h+2s for l < 16, 8h+2s+1 after)
 * Alignment: a packed row starts at a multiple of its pitch (n_blocks *
 * BYTES) from a cudaMalloc'd base.  Q4_K blocks (144 bytes) stay 16-byte
 * aligned and are read with 16-byte loads; Q8_0 (34) and Q6_K (210) blocks
 * are only 2-byte aligned and are read 16 bits at a time.  x (the float32
 * activations) is 16-byte aligned.
 *
 * values() computes every value with the reference's arithmetic, each
 * product and difference rounded on its own (__fmul_rn, __fsub_rn: no FMA
 * contraction), so a dequantized row equals kv_quant_dequant_row's floats
 * exactly.  dot() sums the part's products in float with factored scales
 * (d*sc*sum(q*x) - dmin*m*sum(x)): the same value within float rounding.
 */
#ifndef ENG_QUANT_CUH
#define ENG_QUANT_CUH

#include <stdint.h>

#include "common/kv_ggml.h"
#include "eng_common.cuh"

/* 16 bits at a 2-byte aligned address, through the read-only path. */
static __device__ __forceinline__ uint32_t eq_u16(const uint8_t *p)
{
    return __ldg(reinterpret_cast<const unsigned short *>(p));
}

/* 4 bytes at a 2-byte aligned address. */
static __device__ __forceinline__ uint32_t eq_u32(const uint8_t *p)
{
    return eq_u16(p) | eq_u16(p + 2) << 16;
}

static __device__ __forceinline__ float eq_i8(uint32_t w, int k)
{
    return (float)(int8_t)(uint8_t)(w >> (8 * k));
}

// --- Q8_0 --------------------------------------------------------------------------

struct eq_q8_0 {
    static constexpr int QK = KV_QK, BYTES = (int)sizeof(kv_block_q8_0), PARTS = 4, VALS = 8;

    static __device__ __forceinline__ float dot(const uint8_t *b, int p, const float *x)
    {
        const float d = kv_ggml_f16((uint16_t)eq_u16(b));
        const uint8_t *q = b + 2 + 8 * p;
        const uint32_t w0 = eq_u32(q), w1 = eq_u32(q + 4);
        const float4 a = *reinterpret_cast<const float4 *>(x + 8 * p);
        const float4 c = *reinterpret_cast<const float4 *>(x + 8 * p + 4);
        float s = eq_i8(w0, 0) * a.x + eq_i8(w0, 1) * a.y + eq_i8(w0, 2) * a.z + eq_i8(w0, 3) * a.w;
        s += eq_i8(w1, 0) * c.x + eq_i8(w1, 1) * c.y + eq_i8(w1, 2) * c.z + eq_i8(w1, 3) * c.w;
        return d * s;
    }

    /* out(i, v) for the part's values, i the value's index in the block */
    template <class Out>
    static __device__ __forceinline__ void values(const uint8_t *b, int p, Out &out)
    {
        const float d = kv_ggml_f16((uint16_t)eq_u16(b));
        const uint8_t *q = b + 2 + 8 * p;
        const uint32_t w[2] = {eq_u32(q), eq_u32(q + 4)};
#pragma unroll
        for (int j = 0; j < 8; j++) out(8 * p + j, __fmul_rn(d, eq_i8(w[j / 4], j % 4)));
    }
};

// --- Q4_K --------------------------------------------------------------------------

struct eq_q4_k {
    static constexpr int QK = KV_QK_K, BYTES = (int)sizeof(kv_block_q4_k), PARTS = 4, VALS = 64;

    /* d*scale and dmin*min of groups 2p and 2p+1 */
    static __device__ __forceinline__ void scales(const kv_block_q4_k *blk, int p, float *d0, float *n0,
                                                  float *d1, float *n1)
    {
        const float d = kv_ggml_f16(__ldg(&blk->d)), dmin = kv_ggml_f16(__ldg(&blk->dmin));
        int s0, m0, s1, m1;
        /* the 12 scale bytes read where they are (a register copy indexed by
         * the lane's p would go to local memory) */
        kv_ggml_k4_scale_min(2 * p, blk->scales, &s0, &m0);
        kv_ggml_k4_scale_min(2 * p + 1, blk->scales, &s1, &m1);
        *d0 = __fmul_rn(d, (float)s0);
        *n0 = __fmul_rn(dmin, (float)m0);
        *d1 = __fmul_rn(d, (float)s1);
        *n1 = __fmul_rn(dmin, (float)m1);
    }

    static __device__ __forceinline__ float dot(const uint8_t *b, int p, const float *x)
    {
        const kv_block_q4_k *blk = reinterpret_cast<const kv_block_q4_k *>(b);
        float d0, n0, d1, n1;
        scales(blk, p, &d0, &n0, &d1, &n1);
        const uint4 *qv = reinterpret_cast<const uint4 *>(blk->qs + 32 * p); /* 16-byte aligned */
        const uint4 u[2] = {__ldg(qv), __ldg(qv + 1)};
        const float4 *xl = reinterpret_cast<const float4 *>(x + 64 * p), *xh = xl + 8;
        float sl = 0, sh = 0, xsl = 0, xsh = 0;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            const uint32_t v = w % 4 == 0 ? u[w / 4].x : w % 4 == 1 ? u[w / 4].y : w % 4 == 2 ? u[w / 4].z : u[w / 4].w;
            const float4 a = xl[w], c = xh[w];
            sl += (float)(v & 15) * a.x + (float)((v >> 8) & 15) * a.y + (float)((v >> 16) & 15) * a.z +
                  (float)((v >> 24) & 15) * a.w;
            sh += (float)((v >> 4) & 15) * c.x + (float)((v >> 12) & 15) * c.y + (float)((v >> 20) & 15) * c.z +
                  (float)(v >> 28) * c.w;
            xsl += a.x + a.y + a.z + a.w;
            xsh += c.x + c.y + c.z + c.w;
        }
        return d0 * sl - n0 * xsl + d1 * sh - n1 * xsh;
    }

    template <class Out>
    static __device__ __forceinline__ void values(const uint8_t *b, int p, Out &out)
    {
        const kv_block_q4_k *blk = reinterpret_cast<const kv_block_q4_k *>(b);
        float d0, n0, d1, n1;
        scales(blk, p, &d0, &n0, &d1, &n1);
        const uint4 *qv = reinterpret_cast<const uint4 *>(blk->qs + 32 * p);
        const uint4 u[2] = {__ldg(qv), __ldg(qv + 1)};
#pragma unroll
        for (int w = 0; w < 8; w++) {
            const uint32_t v = w % 4 == 0 ? u[w / 4].x : w % 4 == 1 ? u[w / 4].y : w % 4 == 2 ? u[w / 4].z : u[w / 4].w;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int l = 4 * w + k;
                const uint32_t q = (v >> (8 * k)) & 0xff;
                out(64 * p + l, __fsub_rn(__fmul_rn(d0, (float)(q & 15)), n0));
                out(64 * p + 32 + l, __fsub_rn(__fmul_rn(d1, (float)(q >> 4)), n1));
            }
        }
    }
};

// --- Q6_K --------------------------------------------------------------------------

struct eq_q6_k {
    static constexpr int QK = KV_QK_K, BYTES = (int)sizeof(kv_block_q6_k), PARTS = 8, VALS = 32;

    /* q - 32 of the part's values 4k .. 4k+3 (l = 4k + j), from ql/qh words */
    static __device__ __forceinline__ int q6(uint32_t lo, uint32_t hi, int j, int s)
    {
        const uint32_t lb = (lo >> (8 * j)) & 0xff, hb = (hi >> (8 * j)) & 0xff;
        const uint32_t nib = s < 2 ? lb & 15 : lb >> 4;
        return (int)(nib | ((hb >> (2 * s)) & 3) << 4) - 32;
    }

    static __device__ __forceinline__ float dot(const uint8_t *b, int p, const float *x)
    {
        const int h = p >> 2, s = p & 3;
        const kv_block_q6_k *blk = reinterpret_cast<const kv_block_q6_k *>(b);
        const float d = kv_ggml_f16((uint16_t)eq_u16(b + offsetof(kv_block_q6_k, d)));
        const uint32_t scw = eq_u16(b + offsetof(kv_block_q6_k, scales) + 8 * h + 2 * s);
        const float sc0 = (float)(int8_t)(scw & 0xff), sc1 = (float)(int8_t)(scw >> 8);
        const uint8_t *ql = blk->ql + 64 * h + 32 * (s % 2), *qh = blk->qh + 32 * h;
        const float4 *xv = reinterpret_cast<const float4 *>(x + 128 * h + 32 * s);
        float s0 = 0, s1 = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t lo = eq_u32(ql + 4 * k), hi = eq_u32(qh + 4 * k);
            const float4 a = xv[k];
            const float t = (float)q6(lo, hi, 0, s) * a.x + (float)q6(lo, hi, 1, s) * a.y +
                            (float)q6(lo, hi, 2, s) * a.z + (float)q6(lo, hi, 3, s) * a.w;
            if (k < 4) s0 += t;
            else s1 += t;
        }
        return d * (sc0 * s0 + sc1 * s1);
    }

    template <class Out>
    static __device__ __forceinline__ void values(const uint8_t *b, int p, Out &out)
    {
        const int h = p >> 2, s = p & 3;
        const kv_block_q6_k *blk = reinterpret_cast<const kv_block_q6_k *>(b);
        const float d = kv_ggml_f16((uint16_t)eq_u16(b + offsetof(kv_block_q6_k, d)));
        const uint32_t scw = eq_u16(b + offsetof(kv_block_q6_k, scales) + 8 * h + 2 * s);
        const float ds0 = __fmul_rn(d, (float)(int8_t)(scw & 0xff)), ds1 = __fmul_rn(d, (float)(int8_t)(scw >> 8));
        const uint8_t *ql = blk->ql + 64 * h + 32 * (s % 2), *qh = blk->qh + 32 * h;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t lo = eq_u32(ql + 4 * k), hi = eq_u32(qh + 4 * k);
#pragma unroll
            for (int j = 0; j < 4; j++)
                out(128 * h + 32 * s + 4 * k + j, __fmul_rn(k < 4 ? ds0 : ds1, (float)q6(lo, hi, j, s)));
        }
    }
};

#endif
