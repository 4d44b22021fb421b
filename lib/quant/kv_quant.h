/*
 * kv_quant: transcoding a whole .kvc file into KIVI or DSQ planes (kv-quant).
 */
#ifndef KV_QUANT_H
#define KV_QUANT_H

#include <stdbool.h>
#include <stdio.h>

#include "quant/kv_layer_io.h"

// --- transcoding a whole file (kv-quant) ----------------------------------------

/* One layer's encoding when layers differ (a version 2 deploy config):
 * method KV_ENC_PLAIN leaves the layer as it is. */
typedef struct {
    kv_encoding method;
    kv_kivi_params kivi;
    kv_dsq_params dsq;  /* dsq.bits: the keys' bits */
    int dsq_vbits;      /* the values' bits; 0 = dsq.bits */
} kv_quant_layer;

typedef struct {
    kv_encoding method;    /* KV_ENC_KIVI or KV_ENC_DSQ */
    kv_kivi_params kivi;
    kv_dsq_params dsq;     /* dsq.bits: the keys' bits */
    int dsq_vbits;         /* the values' bits; 0 = dsq.bits */
    const bool *layers;    /* (n_layers) layers to quantize; NULL = all */
    bool decode;           /* instead: write every layer as plain F16 */
    const kv_quant_layer *per_layer; /* (n_layers) or NULL: each layer's own encoding,
                                        instead of method/kivi/dsq/layers */
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
 * o->decode every layer becomes plain F16.  rep may be NULL; on failure it
 * is left cleared (nothing to free).  w borrows
 * tensors from `in`: keep it open until kvc_writer_write.
 */
kv_status kv_quant_file(const kvc_file *in, const kv_quant_opts *o, kvc_writer *w,
                        kv_quant_report *rep);
void kv_quant_report_clear(kv_quant_report *r);
/* The report as one JSON object (with a trailing newline). */
void kv_quant_report_json(const kv_quant_report *r, const kv_quant_opts *o, FILE *f);

#endif
