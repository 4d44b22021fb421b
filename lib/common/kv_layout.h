/*
 * Packed KV layouts, declared once for C (lib/) and CUDA (kernels/).  Every
 * packed encoding is planar: separate tensors for codes, scales and zeros,
 * so that each part is one safetensors tensor in a .kvc file (man/kvc.5) and
 * one contiguous device buffer on the GPU.
 *
 * KIVI (asymmetric min/max, b = 1, 2 or 4 bits), for one layer's K or V of
 * shape [kv_heads, T, head_dim]:
 *   - the first nq = kv_kivi_nquant(T, G, R) tokens are quantized; the last
 *     T - nq tokens (the "residual", between R and R+G-1 tokens once T > R)
 *     stay in fp16, as KIVI keeps recent tokens until a full group forms;
 *   - codes:  U8 [kv_heads, nq, head_dim*b/8], token-major: the code of
 *     channel c of token t sits in byte (c*b)/8 of row t at bit (c*b)%8,
 *     least significant bits first;
 *   - keys are quantized per channel over groups of G tokens:
 *       scale, zero: F16 [kv_heads, nq/G, head_dim];
 *   - values are quantized per token over groups of Gv = min(G, head_dim)
 *     channels:  scale, zero: F16 [kv_heads, nq, head_dim/Gv];
 *   - dequantized x = zero + scale * code; scale = (max-min)/(2^b-1),
 *     zero = min, both rounded to fp16 before codes are computed, and
 *     code = clamp(round((x-zero)/scale), 0, 2^b-1) (0 when scale == 0).
 * Token-major codes let one GPU thread (or one CPU loop) read a whole token's
 * codes with one 16-byte load at 1 bit / head_dim 128, and let the key scales
 * be folded into the query once per group.
 */
#ifndef KV_LAYOUT_H
#define KV_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define KV_HD __host__ __device__
#else
#define KV_HD
#endif

#ifndef __cplusplus
#include <assert.h> /* static_assert in C11 */
#endif

/* The shape of one decode-attention call, for the CPU references (lib/attn,
 * lib/quant) and the CUDA kernels (kernels/kv_kernels.h) alike: query head h
 * attends with KV head h / (n_heads / n_kv_heads). */
typedef struct {
    int n_heads;           /* query heads */
    int n_kv_heads;        /* KV heads; n_heads % n_kv_heads == 0 (the kernels: ratio 1, 2, 4 or 8) */
    int head_dim;          /* D (the kernels: 64 or 128) */
    int T;                 /* cached tokens attended to (the new token's K/V included) */
    long long head_stride; /* elements between KV heads in k and v: 0 means T * head_dim (the
                              only layout the CPU references take; the fp16 kernel takes more) */
    float scale;           /* softmax scale, usually 1/sqrt(D) */
} kv_attn_dims;

/* The largest head_dim any packed layout (and the CPU attention) accepts. */
#define KV_QUANT_MAX_DIM 1024

typedef enum { KV_KIVI_KEYS = 0, KV_KIVI_VALUES = 1 } kv_kivi_axis;

typedef struct {
    int bits;     /* 1, 2 or 4 */
    int group;    /* G: tokens per key group, channels per value group */
    int residual; /* R: recent tokens kept in fp16 */
} kv_kivi_params;

#define KV_KIVI_DEFAULT_BITS 1
#define KV_KIVI_DEFAULT_GROUP 64
#define KV_KIVI_DEFAULT_RESIDUAL 128

/* Tokens quantized out of T (a multiple of G). */
static inline KV_HD int kv_kivi_nquant(int T, int group, int residual)
{
    int q = T - residual;
    return q <= 0 ? 0 : q / group * group;
}

/* Bytes of codes per token row. head_dim*bits must be a multiple of 8. */
static inline KV_HD size_t kv_kivi_row_bytes(int head_dim, int bits)
{
    return (size_t)head_dim * (size_t)bits / 8u;
}

/* Channels per value group. */
static inline KV_HD int kv_kivi_vgroup(int group, int head_dim)
{
    return group < head_dim ? group : head_dim;
}

/* Code of channel c in a packed token row. */
static inline KV_HD unsigned kv_code_get(const uint8_t *row, int c, int bits)
{
    unsigned bit = (unsigned)c * (unsigned)bits;
    return (row[bit >> 3] >> (bit & 7u)) & ((1u << bits) - 1u);
}

static inline KV_HD void kv_code_put(uint8_t *row, int c, int bits, unsigned code)
{
    unsigned bit = (unsigned)c * (unsigned)bits;
    unsigned mask = ((1u << bits) - 1u) << (bit & 7u);
    row[bit >> 3] = (uint8_t)((row[bit >> 3] & ~mask) | ((code << (bit & 7u)) & mask));
}

/* One packed row at head_dim 128, the Llama geometry the kernels target. */
typedef struct { uint8_t b[16]; } kv_row128_1bit;
typedef struct { uint8_t b[32]; } kv_row128_2bit;
typedef struct { uint8_t b[64]; } kv_row128_4bit;
static_assert(sizeof(kv_row128_1bit) == 16, "1-bit row of 128 channels is 16 bytes");
static_assert(sizeof(kv_row128_2bit) == 32, "2-bit row of 128 channels is 32 bytes");
static_assert(sizeof(kv_row128_4bit) == 64, "4-bit row of 128 channels is 64 bytes");
static_assert(sizeof(uint16_t) == 2, "fp16 scale/zero are 2 bytes");

/*
 * DSQ (KVO-LLM differential salient-token quantization), for one layer's K
 * or V of shape [kv_heads, T, head_dim], with window W (64), S salient
 * tokens per window (round(0.2 * W) = 13), b bits (2) for the other W - S
 * tokens and Gd = min(group, head_dim) channels per group (group 32):
 *   - the first nw = floor(T / W) windows are packed; the last T - nw*W
 *     tokens stay fp16:  resid F16 [kv_heads, T - nw*W, head_dim];
 *   - mask:   U8 [kv_heads, nw, W/8]; bit t%8 of byte t/8 (LSB first) set
 *     when token t of the window is salient; exactly S bits are set.  The
 *     salient tokens are the S largest importances of the window (ties to
 *     the earlier token); K and V of a layer share the mask;
 *   - sal:    I8 [kv_heads, nw, S, head_dim], salient rows in token order,
 *     symmetric INT8 per channel over the window's salient tokens:
 *     sscale F16 [kv_heads, nw, head_dim] = fp16(max|x| / 127),
 *     code = clamp(rint(x / s), -127, 127) (0 when s == 0), x' = s * code;
 *   - keys only: base F16 [kv_heads, nw, head_dim] = fp16 of the mean, per
 *     channel, of a set of the window's keys chosen by the writer
 *     (kv_dsq_params.base): the salient keys, as KVO-LLM specifies
 *     (KV_DSQ_BASE_SALIENT), or the non-salient keys, the ones stored as
 *     deltas (KV_DSQ_BASE_REST); all W keys when that set is empty.  The
 *     other keys are stored as deltas d = x - base; a reader needs only the
 *     stored base, whichever set it came from;
 *   - codes:  U8 [kv_heads, nw, W - S, head_dim*b/8], the non-salient rows in
 *     token order (key deltas, or values), b-bit asymmetric per token over
 *     groups of Gd channels exactly as KIVI values:
 *     scale, zero F16 [kv_heads, nw, W - S, head_dim/Gd];
 *     x' = base + (zero + scale * code) for keys (float32, parenthesised as
 *     written), zero + scale * code for values.
 * Subtracting the per-channel base removes the channel outliers of keys, so
 * that per-token groups see a small range.
 */
/* Which keys a window's key base is the mean of (see above). */
typedef enum { KV_DSQ_BASE_SALIENT = 0, KV_DSQ_BASE_REST = 1 } kv_dsq_base;

typedef struct {
    int window;   /* W tokens per window, a multiple of 8 */
    int salient;  /* S salient tokens per window, 0..W */
    int bits;     /* b: 1, 2 or 4 for non-salient tokens */
    int group;    /* channels per non-salient group (clipped to head_dim) */
    int base;     /* kv_dsq_base: the keys the base is the mean of (writers only) */
} kv_dsq_params;

#define KV_DSQ_DEFAULT_WINDOW 64
#define KV_DSQ_DEFAULT_SALIENT_FRAC 0.2
#define KV_DSQ_DEFAULT_BITS 2
#define KV_DSQ_DEFAULT_GROUP 32
#define KV_DSQ_DEFAULT_BASE KV_DSQ_BASE_REST /* docs/BENCHMARKS.md, 2026-12-01 */
/* The dsq policy's defaults (kv-run, kv-bench, kv-profile): keys at 4 bits,
 * values at 2, 10% salient.  2-bit per-token key deltas lost needles on
 * niah4k whatever the salient share; 4-bit keys keep `full`'s accuracy at
 * about the bytes of the 2-bit layout with 20% salient (docs/BENCHMARKS.md,
 * "DSQ accuracy on niah4k", 2026-12-01).  The layout above is unchanged: K
 * and V each record their own bits.  KVO-LLM's configuration is
 * dsq:base=salient,salient=0.2,bits=2. */
#define KV_DSQ_POLICY_SALIENT_FRAC 0.1
#define KV_DSQ_POLICY_KBITS 4
#define KV_DSQ_POLICY_VBITS 2

static inline KV_HD int kv_dsq_nwindows(int T, int window) { return T / window; }

/* Is token t (0..W-1) of a window salient? */
static inline KV_HD int kv_dsq_mask_get(const uint8_t *mask, int t)
{
    return (mask[t >> 3] >> (t & 7)) & 1;
}

/* One window of 64 tokens has an 8-byte mask. */
typedef struct { uint8_t b[8]; } kv_dsq_mask64;
static_assert(sizeof(kv_dsq_mask64) == 8, "DSQ mask of a 64-token window is 8 bytes");
static_assert(sizeof(int8_t) == 1, "DSQ salient codes are one byte");

#endif
