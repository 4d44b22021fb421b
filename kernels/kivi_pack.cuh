/*
 * KIVI pack and unpack on the GPU, byte-identical to lib/quant/kv_quant.c (the
 * rounding rule is spelled out in lib/quant/kv_quant.h): float32 min/max, fp16
 * scale and zero rounded to nearest even, code = clamp(rint((x - z) / s))
 * with IEEE division (no fast-math here: __fdiv_rn and __fsub_rn make that
 * explicit), 0 when s is 0 or not finite.
 *
 *   keys:   one block per (head, group of G tokens), a thread per 8
 *           channels of G/16 (D 128) or G/8 (D 64) tokens: 16-byte loads
 *           straight to registers, extremes reduced by shuffles and shared
 *           memory, each thread's codes one 8*bits-bit store (groups that
 *           layout does not divide: a thread per channel, the tile through
 *           shared memory, words assembled across lanes);
 *   values: a thread per 8 channels of 4 tokens, the value group's
 *           extremes reduced over its gv/8 lanes by shuffles;
 *   unpack: one thread per 8 channels of a token (a 16-byte store).
 */
#ifndef KV_KIVI_PACK_CUH
#define KV_KIVI_PACK_CUH

#include "common.cuh"

#define KV_PACK_KEY_THREADS 128
#define KV_PACK_MAX_TILE 8192 /* G * head_dim halves in one key tile (16 KB) */

/* The code of x for divisor sdiv (+inf when the scale is unusable), its
 * reciprocal rcp = 1/sdiv (correctly rounded) and zero z.  (x - z) * rcp is
 * within 2 ulp of the true quotient, so it rounds to the same integer as the
 * correctly rounded division unless it lies within a few ulp of a half
 * integer; only then is the (slow) IEEE division done.  Codes stay identical
 * to the CPU's, at a fraction of the arithmetic. */
__device__ __forceinline__ unsigned kv_kivi_code(float x, float sdiv, float rcp, float z,
                                                 float maxq)
{
    float a = __fsub_rn(x, z);
    float q = __fmul_rn(a, rcp);
    float f = q - floorf(q);
    if (fabsf(f - 0.5f) <= fabsf(q) * 8.0e-7f + 1.0e-30f || !(fabsf(q) < 1.0e30f))
        q = __fdiv_rn(a, sdiv);
    float v = rintf(q);
    v = v > 0.0f ? v : 0.0f; /* NaN -> 0, as on the CPU */
    v = v < maxq ? v : maxq;
    return (unsigned)(int)v;
}

/*
 * kv_kivi_code without the conversion unit, for the 8-channel kernels (the
 * same codes): cvt.rni and F2I run at a quarter of the FP32 rate on sm_90
 * and made packing conversion-bound.  The quotient q = (x - z) * rcp is
 * clamped to [0, maxq] first (fmaxf maps NaN to 0; the CPU's
 * clamp(rint(q)) equals rint(clamp(q)) there), then rounded to nearest even
 * by adding 1.5 * 2^23, whose low mantissa bits are then the code.  The
 * quotient is ambiguous when |q - rint(q)| >= 0.5 - 8e-7 q (frac(q) within
 * 8e-7 q of 1/2; a * rcp is within 2 ulp of a / s): the caller then redoes
 * the row with kv_kivi_code_exact.  Clamped quotients are never ambiguous
 * in a way that matters (both neighbours clamp to the same code).
 */
#define KV_RINT_MAGIC 12582912.0f /* 1.5 * 2^23 */
__device__ __forceinline__ uint32_t kv_kivi_code_fast(float x, float rcp, float z, float maxq,
                                                      bool *amb)
{
    float q = __fmul_rn(__fsub_rn(x, z), rcp);
    q = fminf(fmaxf(q, 0.0f), maxq);
    float t = __fadd_rn(q, KV_RINT_MAGIC);
    float d = fabsf(__fsub_rn(q, __fsub_rn(t, KV_RINT_MAGIC)));
    *amb |= d >= __fmaf_rn(-q, 8.0e-7f, 0.5f);
    return __float_as_uint(t) & 0xFu;
}

/* The exact code (the slow path of kv_kivi_code_fast): IEEE division. */
__device__ __forceinline__ uint32_t kv_kivi_code_exact(float x, float sdiv, float z, float maxq)
{
    float q = fminf(fmaxf(__fdiv_rn(__fsub_rn(x, z), sdiv), 0.0f), maxq);
    return __float_as_uint(__fadd_rn(q, KV_RINT_MAGIC)) & 0xFu;
}

/* fp16 scale/zero of a group and the divisor the code loop uses. */
__device__ __forceinline__ void kv_kivi_group_params(float mn, float mx, float maxq, __half *hs,
                                                     __half *hz, float *sdiv, float *z)
{
    *hs = __float2half_rn(__fdiv_rn(__fsub_rn(mx, mn), maxq));
    *hz = __float2half_rn(mn);
    float s = __half2float(*hs);
    *sdiv = (s > 0.0f && s < INFINITY) ? s : INFINITY;
    *z = __half2float(*hz);
}

#endif
