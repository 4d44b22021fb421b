/*
 * KIVI pack and unpack on the GPU, byte-identical to lib/quant/kv_quant.c (the
 * rounding rule is spelled out in lib/quant/kv_quant.h): float32 min/max, fp16
 * scale and zero rounded to nearest even, code = clamp(rint((x - z) / s))
 * with IEEE division (no fast-math here: __fdiv_rn and __fsub_rn make that
 * explicit), 0 when s is 0 or not finite.
 *
 *   keys:   one block per (head, group of G tokens); the fp16 tile goes
 *           through shared memory with 16-byte loads, a thread per channel
 *           finds min/max, then threads pack whole 32-bit code words;
 *   values: one thread per (token, value group) of Gv channels;
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

/* kv_kivi_code in fewer instructions, for the 8-channel kernels: the same
 * codes.  The ambiguity test |q - rint(q)| >= 0.5 - 8e-7 |q| is the one
 * above (frac(q) within 8e-7 |q| of 1/2); the test for huge or non-finite
 * q is not needed because the quotient is clamped to [0, maxq] either way
 * (a * rcp and the IEEE a / s agree on NaN, on infinities and on which side
 * of the clamp any quotient beyond 2^23 falls); cvt.rni maps NaN to 0 and
 * saturates, as the CPU's `v > 0 ? v : 0` then `min(v, maxq)` do. */
__device__ __forceinline__ unsigned kv_kivi_code_fast(float x, float sdiv, float rcp, float z,
                                                      int maxq)
{
    float a = __fsub_rn(x, z);
    float q = __fmul_rn(a, rcp);
    float d = fabsf(__fsub_rn(q, rintf(q)));
    if (d >= __fmaf_rn(-fabsf(q), 8.0e-7f, 0.5f)) q = __fdiv_rn(a, sdiv);
    int v = __float2int_rn(q);
    v = v > 0 ? v : 0;
    v = v < maxq ? v : maxq;
    return (unsigned)v;
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
