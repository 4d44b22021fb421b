/*
 * kv_policy_int: what the policy files (lib/kv_policy_*.c) share and the
 * engine does not need: a full-precision row store in f32/f16/bf16, the
 * gathered attention every subset policy uses, and one constructor per kind.
 * Keeping the arithmetic in one place is what lets a sparse or streaming
 * policy that holds every token reproduce kv_attend_dense bit for bit.
 */
#ifndef KV_POLICY_INT_H
#define KV_POLICY_INT_H

#include <stddef.h>
#include <stdint.h>

#include "attn/kv_attn.h"
#include "policy/kv_policy.h"

// --- full-precision row store -------------------------------------------

typedef struct {
    kv_dtype dt;
    int nkv, cap, dim; /* rows per head (capacity), values per row */
    void *data;        /* (nkv, cap, dim) in dt */
} kv_store;

kv_status kv_store_init(kv_store *s, kv_dtype dt, int nkv, int cap, int dim);
void kv_store_clear(kv_store *s);
/* Row t of head h: write from / read into f32. */
void kv_store_put(kv_store *s, int h, int t, const float *x);
void kv_store_get(const kv_store *s, int h, int t, float *x);
/* One channel of row t of head h, as f32. */
float kv_store_at(const kv_store *s, int h, int t, int c);
/* Pointer to row t of head h when dt is f32 (else NULL). */
const float *kv_store_f32(const kv_store *s, int h, int t);

// --- attention over stored rows ----------------------------------------

/*
 * Attention over a subset of stored rows: idx (nkv, n) lists the rows of
 * each KV head in the order they are summed; the rows are gathered into
 * scratch (2 * n * dim floats) and attended by kv_attend_core one KV head at
 * a time.  probs (n_heads, n) may be NULL.
 */
void kv_attend_gather(const kv_policy_geom *g, const kv_store *K, const kv_store *V,
                      const int *idx, int n, const float *q, float *out, float *scratch,
                      float *probs);

// --- constructors, one per kind (lib/kv_policy_<kind>.c) -----------------

kv_status kv_policy_full_new(const kv_policy_geom *g, const kv_policy_params *prm,
                                kv_policy **out);
kv_status kv_policy_quant_new(const kv_policy_geom *g, const kv_policy_params *prm,
                                 kv_policy **out);
kv_status kv_policy_sparse_new(const kv_policy_geom *g, const kv_policy_params *prm,
                                  kv_policy **out);
kv_status kv_policy_streaming_new(const kv_policy_geom *g, const kv_policy_params *prm,
                                     kv_policy **out);
kv_status kv_policy_dsq_new(const kv_policy_geom *g, const kv_policy_params *prm,
                               kv_policy **out);

#endif
