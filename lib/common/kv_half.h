/*
 * IEEE half and bfloat16 conversion for host code (C and CUDA host side).
 * Round-to-nearest-even, NaN and infinity preserved, subnormals handled.
 */
#ifndef KV_HALF_H
#define KV_HALF_H

#include <stdint.h>
#include <string.h>

typedef uint16_t kv_half; /* IEEE binary16 bits */
typedef uint16_t kv_bf16; /* bfloat16 bits */

static inline float kv_half_to_f32(kv_half h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline kv_half kv_f32_to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) /* inf or nan */
        return (kv_half)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
    if (absx >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return (kv_half)(sign | 0x7c00u);
    if (absx < 0x38800000u) { /* below smallest normal half: subnormal or zero */
        if (absx < 0x33000000u) return (kv_half)sign; /* < 2^-25 rounds to 0 */
        uint32_t man = (absx & 0x7fffffu) | 0x800000u;
        int shift = 113 - (int)(absx >> 23) + 13; /* 14..24 */
        uint32_t res = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (res & 1))) res++;
        return (kv_half)(sign | res);
    }
    uint32_t res = ((absx >> 13) - (112u << 10));
    uint32_t rem = absx & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (res & 1))) res++;
    return (kv_half)(sign | res);
}

static inline float kv_bf16_to_f32(kv_bf16 b)
{
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline kv_bf16 kv_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (kv_bf16)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (kv_bf16)(x >> 16);
}

/* Round a float through half precision (what storing it as F16 does). */
static inline float kv_round_half(float f) { return kv_half_to_f32(kv_f32_to_half(f)); }

#endif
