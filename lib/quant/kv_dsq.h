/*
 * kv_dsq: KVO-LLM's differential salient-token quantization (DSQ) and the
 * HCAP pruning decisions, on the CPU.  The layout (parts, shapes, rounding)
 * is declared in lib/common/kv_layout.h; kv-quant --method dsq and kv-run's dsq
 * policy (one window at a time, as windows fill) share this code.
 *
 * Salient tokens are chosen per window from an importance per token (the
 * accumulated attention it received); K and V of one layer must be packed
 * with the same importance so that they share the mask.
 */
#ifndef KV_DSQ_H
#define KV_DSQ_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_half.h"
#include "common/kv_layout.h"
#include "common/kv_status.h"

/* window 64, salient round(0.2*64) = 13, bits 2, group 32, key base from
 * the non-salient keys (KV_DSQ_DEFAULT_BASE; KVO-LLM's salient mean is
 * KV_DSQ_BASE_SALIENT) */
void kv_dsq_params_default(kv_dsq_params *p);
/* "salient" / "rest" for a kv_dsq_base, and back (KV_E_USAGE otherwise). */
const char *kv_dsq_base_name(int base);
kv_status kv_dsq_base_parse(const char *s, int *out);
/* round(frac * window), clamped to 0..window. */
int kv_dsq_salient_count(int window, double frac);
kv_status kv_dsq_check(const kv_dsq_params *p, int head_dim);

/* Mark the S most important of W tokens (ties to the earlier token, NaN
 * counts as least important).  imp: (W); mask: (W/8). */
void kv_dsq_select(const float *imp, int W, int S, uint8_t *mask);

// --- one window (incremental use) --------------------------------------------

/*
 * Pack one window of W rows (row t at x + t*ld) with a given mask.
 *   sal: (S, D) int8; sscale: (D); base: (D), keys only (NULL for values);
 *   codes: (W-S, D*bits/8); scale, zero: (W-S, D/Gd)
 */
void kv_dsq_pack_window(const float *x, size_t ld, kv_kivi_axis axis, const kv_dsq_params *p,
                        int D, const uint8_t *mask, int8_t *sal, kv_half *sscale, kv_half *base,
                        uint8_t *codes, kv_half *scale, kv_half *zero);
/* Dequantize one window into out (W, D). */
void kv_dsq_unpack_window(kv_kivi_axis axis, const kv_dsq_params *p, int D, const uint8_t *mask,
                          const int8_t *sal, const kv_half *sscale, const kv_half *base,
                          const uint8_t *codes, const kv_half *scale, const kv_half *zero,
                          float *out);

// --- a whole layer's K or V --------------------------------------------------

typedef struct {
    kv_kivi_axis axis;
    kv_dsq_params prm;
    int n_kv_heads, T, head_dim;
    int nw;            /* packed windows: T / W */
    uint8_t *mask;     /* (H, nw, W/8) */
    int8_t *sal;       /* (H, nw, S, D) */
    kv_half *sscale;   /* (H, nw, D) */
    kv_half *base;     /* (H, nw, D); NULL for values */
    uint8_t *codes;    /* (H, nw, W-S, D*bits/8) */
    kv_half *scale;    /* (H, nw, W-S, D/Gd) */
    kv_half *zero;     /* (H, nw, W-S, D/Gd) */
    kv_half *resid;    /* (H, T - nw*W, D) */
} kv_dsq_packed;

/* Element counts of the parts (bytes for mask, sal and codes). */
typedef struct {
    size_t mask, sal, sscale, base, codes, scale, resid; /* scale: also zero */
} kv_dsq_sizes;
void kv_dsq_part_sizes(kv_kivi_axis axis, const kv_dsq_params *p, int H, int T, int D,
                       kv_dsq_sizes *s);
/* Exact bytes of the packed form (all parts, fp16 = 2 bytes). */
size_t kv_dsq_bytes(kv_kivi_axis axis, const kv_dsq_params *p, int H, int T, int D);

kv_status kv_dsq_init(kv_dsq_packed *d, kv_kivi_axis axis, const kv_dsq_params *p, int H,
                       int T, int D);
void kv_dsq_clear(kv_dsq_packed *d);

/* Pack x (H, T, D) with importance imp (H, T); imp NULL uses each token's
 * key norm ||x_t|| (pass the same imp for K and V). */
kv_status kv_dsq_pack(const float *x, const float *imp, kv_kivi_axis axis,
                      const kv_dsq_params *p, int H, int T, int D, kv_dsq_packed *out);
void kv_dsq_unpack(const kv_dsq_packed *d, float *out /* (H, T, D) */);

/*
 * Importance of each token: the softmax attention it receives from the
 * stored last n_q queries (causal: query j of n_q sees keys 0..T-n_q+j),
 * summed over queries and over the query heads sharing each KV head.
 *   q: (n_heads, n_q, D), k: (H, T, D), imp: (H, T); scale 1/sqrt(D).
 */
kv_status kv_dsq_importance(const float *q, int n_heads, int n_q, const float *k, int H, int T,
                            int D, float *imp);

// --- HCAP pruning decisions ---------------------------------------------------

/* Keep channel c when its share contrib[c] / sum(contrib) >= thresh; the
 * largest channel is always kept.  contrib: (D); keep: (D) 0/1.  Returns
 * the number kept (thresh <= 0 keeps all). */
int kv_hcap_channels(const float *contrib, int D, double thresh, uint8_t *keep);

/*
 * Tokens to keep out of T: the sink first tokens, the window most recent,
 * then the top by predicted score (pred, may be NULL) up to half of the
 * budget, then the top by historical importance (hist) until
 * ceil(keep_frac * T) tokens are kept (never fewer than sink + window).
 * hist, pred: (T); keep: (T) 0/1.  Returns the number kept.
 */
int kv_hcap_tokens(const float *hist, const float *pred, int T, double keep_frac, int sink,
                   int window, uint8_t *keep);

#endif
