/*
 * kv_quant: the KIVI quantizer (asymmetric min/max, 1, 2 or 4 bits) on the
 * CPU, in the planar layout of lib/kv_layout.h, and the .kvc encoding of
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
#ifndef KV_QUANT_H
#define KV_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "kv_half.h"
#include "kv_layout.h"
#include "kv_status.h"

#define KV_QUANT_MAX_DIM 1024

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

/* Allocate the parts of a packed layer (codes zeroed); kv_kivi_free releases. */
kv_status kv_kivi_alloc(kv_kivi_packed *p, kv_kivi_axis axis, const kv_kivi_params *prm,
                        int H, int T, int D);
void kv_kivi_free(kv_kivi_packed *p);

/* Pack x (n_kv_heads, T, head_dim) into a newly allocated *out (heads in
 * parallel with OpenMP). */
kv_status kv_kivi_pack(const float *x, kv_kivi_axis axis, const kv_kivi_params *prm, int H,
                       int T, int D, kv_kivi_packed *out);

/* Dequantize into out (n_kv_heads, T, head_dim). */
void kv_kivi_unpack(const kv_kivi_packed *p, float *out);

// --- packed layers in .kvc files (man/kvc.5) -----------------------------------

/*
 * A layer's K (which = 'k') or V ('v') is stored either plain, as the tensor
 * layers.{i}.k (F16/BF16/F32 [kv_heads, T, head_dim]), or packed, as the
 * tensors layers.{i}.k.<part> with metadata layers.{i}.k.encoding:
 *   "kivi": parts codes, scale, zero, resid (shapes as in kv_layout.h);
 *           metadata layers.{i}.k.bits, .group, .residual;
 *   "dsq":  parts mask, sal, sscale, base (keys only), codes, scale, zero,
 *           resid; metadata layers.{i}.k.window, .salient, .bits, .group.
 * Metadata values are decimal integers.  The geometry (kv_heads, tokens,
 * head_dim) comes from the file's geometry, and every part's dtype and shape
 * must match exactly.
 */
#include "kv_dsq.h"
#include "kvc.h"

typedef enum { KV_ENC_PLAIN = 0, KV_ENC_KIVI, KV_ENC_DSQ } kv_encoding;

const char *kv_encoding_name(kv_encoding e); /* "plain", "kivi", "dsq" */

/* Add a packed layer's parts (copied: p may be freed at once) and its
 * metadata to a writer. */
kv_status kv_kivi_write(kvc_writer *w, int layer, char which, const kv_kivi_packed *p);
kv_status kv_dsq_write(kvc_writer *w, int layer, char which, const kv_dsq_packed *p);

/* Encoding of a layer's K or V (KV_E_DATA if it is missing or unknown). */
kv_status kv_layer_encoding(const kvc_file *f, int layer, char which, kv_encoding *enc);

/* Read a packed layer into *p (own copies of the parts; free with
 * kv_kivi_free / kv_dsq_free).  KV_E_DATA on any inconsistency. */
kv_status kv_kivi_read(const kvc_file *f, int layer, char which, kv_kivi_packed *p);
kv_status kv_dsq_read(const kvc_file *f, int layer, char which, kv_dsq_packed *p);

/* Decode a layer's K or V, whatever its encoding, into
 * out (n_kv_heads, n_tokens, head_dim). */
kv_status kv_layer_decode(const kvc_file *f, int layer, char which, float *out);

/* Bytes the file stores for a layer's K or V (all its tensors). */
uint64_t kv_layer_bytes(const kvc_file *f, int layer, char which);

// --- transcoding a whole file (kv-quant) ----------------------------------------

typedef struct {
    kv_encoding method;    /* KV_ENC_KIVI or KV_ENC_DSQ */
    kv_kivi_params kivi;
    kv_dsq_params dsq;
    const bool *layers;    /* (n_layers) layers to quantize; NULL = all */
    bool decode;           /* instead: write every layer as plain F16 */
} kv_quant_opts;

/* What kv-quant --report prints; arrays are (n_layers). */
typedef struct {
    int n_layers;
    uint64_t kv_bytes_in, kv_bytes_out; /* K and V tensors of all layers */
    uint64_t f16_bytes;                 /* the same cache as plain F16 */
    kv_encoding *enc_k, *enc_v;         /* output encodings */
    double *k_mse, *k_max, *v_mse, *v_max; /* output vs input, decoded */
    double *attn_err;   /* ||o' - o|| / ||o|| over the stored queries; NaN if none */
    double pack_seconds;     /* wall time spent in the quantizers */
    double pack_cpu_seconds; /* CPU time of all threads in the quantizers */
} kv_quant_report;

/*
 * Re-encode every layer of `in` into the writer w (geometry, tokens,
 * queries and other tensors and metadata are carried over): selected layers
 * are decoded and packed with o->method (DSQ importance from the stored
 * queries, else key norms), the others are copied unchanged; with
 * o->decode every layer becomes plain F16.  rep may be NULL.  w borrows
 * tensors from `in`: keep it open until kvc_writer_write.
 */
kv_status kv_quant_file(const kvc_file *in, const kv_quant_opts *o, kvc_writer *w,
                        kv_quant_report *rep);
void kv_quant_report_free(kv_quant_report *r);
/* The report as one JSON object (with a trailing newline). */
void kv_quant_report_json(const kv_quant_report *r, const kv_quant_opts *o, FILE *f);

#endif
