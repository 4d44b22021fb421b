/*
 * kv_kivi: the KIVI quantizer (asymmetric min/max, 1, 2 or 4 bits) on the
 * CPU, in the planar layout of lib/common/kv_layout.h, and the .kvc encoding of
 * packed layers.  It is the one implementation that kv-quant, kv-run's
 * `quant` policy (incrementally, one group at a time) and the CUDA kernels'
 * tests (as the reference) share.
 *
 * Rounding, exactly (so that numpy and CUDA re-implementations agree bit for
 * bit): per group, mn and mx are the float32 min and max; scale =
 * fp16((mx - mn) / (2^b - 1)) and zero = fp16(mn), rounded to nearest even;
 * with s = float(scale), z = float(zero), the code of x is
 * clamp(rint((x - z) / s), 0, 2^b - 1) computed in float32, where rint rounds
 * half to even (numpy np.rint, CUDA __float2int_rn); the code is 0 when
 * s == 0 (or is not finite).  Dequantized: x' = z + s * code (float32).
 *
 * Geometry limits: head_dim * bits a multiple of 8, head_dim a multiple of
 * Gv = min(G, head_dim), head_dim <= KV_QUANT_MAX_DIM.
 */
#ifndef KV_KIVI_H
#define KV_KIVI_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_half.h"
#include "common/kv_layout.h"
#include "common/kv_status.h"


/* Check bits/group/residual against a head dim (KV_E_USAGE with a message). */
kv_status kv_kivi_check(const kv_kivi_params *prm, int head_dim);

// --- low level: one key group, one value row (for incremental use) -------

/*
 * Quantize one key group: G token rows of head_dim channels (row i at
 * x + i*ld), per channel over the G tokens.
 *   x:      (G, ld) floats, first head_dim used
 *   codes:  (G, head_dim*bits/8) bytes, row stride code_ld bytes
 *   scale, zero: (head_dim)
 */
void kv_kivi_pack_key_group(const float *x, size_t ld, int G, int head_dim, int bits,
                            uint8_t *codes, size_t code_ld, kv_half *scale, kv_half *zero);

/*
 * Quantize one value token row per groups of gv channels.
 *   x: (head_dim); codes: (head_dim*bits/8); scale, zero: (head_dim/gv)
 */
void kv_kivi_pack_value_row(const float *x, int head_dim, int gv, int bits, uint8_t *codes,
                            kv_half *scale, kv_half *zero);

/*
 * Dequantize one packed token row.  sgroup is the number of consecutive
 * channels sharing one scale/zero entry: 1 for a key row (scale/zero are
 * the group's (head_dim) arrays), gv for a value row ((head_dim/gv) arrays).
 *   row: (head_dim*bits/8); out: (head_dim)
 */
void kv_kivi_dequant_row(const uint8_t *row, const kv_half *scale, const kv_half *zero,
                         int head_dim, int bits, int sgroup, float *out);

// --- a whole layer's K or V ----------------------------------------------

typedef struct {
    kv_kivi_axis axis;   /* keys: per channel over token groups; values: per token */
    kv_kivi_params prm;  /* bits, group G, residual R */
    int n_kv_heads, T, head_dim;
    int nq;              /* quantized tokens: kv_kivi_nquant(T, G, R) */
    uint8_t *codes;      /* (n_kv_heads, nq, head_dim*bits/8) */
    kv_half *scale;      /* keys (n_kv_heads, nq/G, head_dim); values (n_kv_heads, nq, head_dim/Gv) */
    kv_half *zero;       /* same shape as scale */
    kv_half *resid;      /* (n_kv_heads, T - nq, head_dim) fp16 recent tokens */
} kv_kivi_packed;

/* Element counts of each part (for shapes and allocation). */
size_t kv_kivi_codes_bytes(kv_kivi_axis axis, const kv_kivi_params *prm, int H, int T, int D);
size_t kv_kivi_scale_count(kv_kivi_axis axis, const kv_kivi_params *prm, int H, int T, int D);
size_t kv_kivi_resid_count(const kv_kivi_params *prm, int H, int T, int D);

/* Exact bytes of the packed form: codes + 2 bytes * (scale + zero + resid). */
size_t kv_kivi_bytes(kv_kivi_axis axis, const kv_kivi_params *prm, int H, int T, int D);

/* Allocate the parts of a packed layer (codes zeroed); kv_kivi_clear releases. */
kv_status kv_kivi_init(kv_kivi_packed *p, kv_kivi_axis axis, const kv_kivi_params *prm,
                        int H, int T, int D);
void kv_kivi_clear(kv_kivi_packed *p);

/* Pack x (n_kv_heads, T, head_dim) into a newly allocated *out (heads in
 * parallel with OpenMP). */
kv_status kv_kivi_pack(const float *x, kv_kivi_axis axis, const kv_kivi_params *prm, int H,
                       int T, int D, kv_kivi_packed *out);

/* Dequantize into out (n_kv_heads, T, head_dim). */
void kv_kivi_unpack(const kv_kivi_packed *p, float *out);

// --- attention from the packed planes (lib/quant/kv_kivi.c) -----------------

#include "attn/kv_attn.h"

/*
 * Decode attention from a KIVI-packed layer: K and V packed by kv_kivi_pack
 * (keys per channel over G-token groups, values per token over Gv channels,
 * same bits, group and residual, T tokens each, the last T - nq in fp16).
 * For each key group g the folded query is qs_c = q_c * scale_gc and
 * qz = sum_c q_c * zero_gc, so score_t = qz + sum_c qs_c * code_tc; values
 * accumulate sum_t p_t * scale_t,g * code_tc plus sum_t p_t * zero_t,g.
 *   q:   (n_heads, D) fp16
 *   out: (n_heads, D)
 */
kv_status kv_attn_decode_kivi(const kv_attn_dims *d, const kv_half *q, const kv_kivi_packed *K,
                              const kv_kivi_packed *V, float *out);

#endif
