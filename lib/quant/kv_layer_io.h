/*
 * kv_layer_io: KIVI- and DSQ-packed layers as .kvc tensors (man/kvc.5).
 */
#ifndef KV_LAYER_IO_H
#define KV_LAYER_IO_H

#include <stdint.h>

#include "format/kvc.h"
#include "quant/kv_dsq.h"
#include "quant/kv_kivi.h"

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

typedef enum { KV_ENC_PLAIN = 0, KV_ENC_KIVI, KV_ENC_DSQ } kv_encoding;

const char *kv_encoding_name(kv_encoding e); /* "plain", "kivi", "dsq" */

/* Add a packed layer's parts (copied: p may be freed at once) and its
 * metadata to a writer. */
kv_status kv_kivi_write(kvc_writer *w, int layer, char which, const kv_kivi_packed *p);
kv_status kv_dsq_write(kvc_writer *w, int layer, char which, const kv_dsq_packed *p);

/* Encoding of a layer's K or V (KV_E_DATA if it is missing or unknown). */
kv_status kv_layer_encoding(const kvc_file *f, int layer, char which, kv_encoding *enc);

/* Read a packed layer into *p (own copies of the parts; free with
 * kv_kivi_clear / kv_dsq_clear).  KV_E_DATA on any inconsistency. */
kv_status kv_kivi_read(const kvc_file *f, int layer, char which, kv_kivi_packed *p);
kv_status kv_dsq_read(const kvc_file *f, int layer, char which, kv_dsq_packed *p);

/* Decode a layer's K or V, whatever its encoding, into
 * out (n_kv_heads, n_tokens, head_dim). */
kv_status kv_layer_decode(const kvc_file *f, int layer, char which, float *out);

/* Bytes the file stores for a layer's K or V (all its tensors). */
uint64_t kv_layer_bytes(const kvc_file *f, int layer, char which);

#endif
