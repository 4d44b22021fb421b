/*
 * kv_deploy: the deployment config that kv-profile writes (under "deploy" in
 * its JSON output) and that `kv-run --profile P.json` and
 * `kv-quant --profile P.json` read unchanged.  It says which layers are
 * quantized (KIVI or DSQ) and which are sparse (TailorKV), with the knobs of
 * each; layers in neither list stay full.  The file may be the whole
 * kv-profile output (the "deploy" member is used) or just the deploy object:
 *
 *   {"version": 1, "n_layers": 6, "method": "kivi",
 *    "quant_layers": [0, 1], "sparse_layers": [2, 3, 4, 5],
 *    "bits": 1, "group": 64, "residual": 128,
 *    "budget": 128, "channels": 8, "sink": 8, "window": 56,
 *    "dsq_window": 64, "dsq_salient": 0.2}
 *
 * "budget" is a token count (integer >= 1) or a fraction of the context
 * (0 < budget < 1).  Every member is optional except the two lists; unknown
 * members, wrong types, out-of-range values, layers out of range and layers
 * listed twice are rejected (KV_E_DATA with a message).
 *
 * Version 2 (what kv-profile writes) gives every layer its own policy, a
 * one-kind spec of kv-run(1) POLICIES, so that layers may differ in kind,
 * bits or budget:
 *
 *   {"version": 2, "n_layers": 6, "rule": "budget", "kv_budget": 0.25,
 *    "layers": [{"layer": 0, "policy": "quant:bits=4,group=64,residual=128"},
 *               {"layer": 1, "policy": "sparse:sink=4,window=8,frac=0.015"}, ...]}
 *
 * "layers" is required (layers it does not list are full), "n_layers" too;
 * "rule" and "kv_budget" (and per layer "error" and "bytes") are what chose
 * the layers, for people: readers ignore them.  A layer's spec names its
 * keys, but front-end defaults (--kv-dtype, --select) still apply to it, as
 * they do to a version 1 config.
 */
#ifndef KV_DEPLOY_H
#define KV_DEPLOY_H

#include <stdbool.h>
#include <stddef.h>

#include "policy/kv_policy.h"
#include "common/kv_status.h"

/* The newest version this reads and writes.  3: one policy spec per layer.
 * 2: the same, written before dsq's defaults changed (session 6, 2026-12-01):
 * a dsq spec that names no bits reads as 2-bit keys and values, one that
 * names no salient as 0.2, so an old config deploys what it was fitted
 * with.  1: the two lists; its "bits", "group" and "dsq_salient" set a dsq
 * method's layers (2, 32 and 0.2 when absent, as then). */
#define KV_DEPLOY_VERSION 3

/* The config's numbers are the policy parameters themselves: what a quant
 * layer and a sparse layer get, copied whole by kv_deploy_apply. */
typedef struct {
    int version;           /* 1 (the two lists), 2 or 3 (per_layer) */
    int n_layers;          /* as written by kv-profile; 0 if absent */
    int *quant_layers;     /* (n_quant) */
    int n_quant;
    int *sparse_layers;    /* (n_sparse) */
    int n_sparse;
    kv_policy_params quant;  /* kind quant (method "kivi") or dsq: bits, group,
                                residual, dsq_window, dsq_salient */
    kv_policy_params sparse; /* kind sparse: budget (topk, or topk_frac when
                                topk is 0), channels, sink, window */
    /* version 2: (n_layers) every layer's policy, or NULL (version 1) */
    kv_policy_params *per_layer;
    char rule[16];           /* version 2, informative: "budget" or "tau" */
    double kv_budget;        /* version 2, informative: the budget (0: none) */
} kv_deploy;

void kv_deploy_defaults(kv_deploy *d);
void kv_deploy_clear(kv_deploy *d); /* frees the lists and per_layer */

/* Parse a config from JSON text (len bytes, need not be NUL-terminated).
 * n_layers > 0 checks every layer index against it (0: no check). */
kv_status kv_deploy_parse(const char *json, size_t len, int n_layers, kv_deploy *out);

/* Fill per_layer[0..n_layers) with policy params: version 2, each layer's
 * own; version 1, quant layers d->quant, sparse layers d->sparse; the rest
 * full's defaults. */
void kv_deploy_apply(const kv_deploy *d, int n_layers, kv_policy_params *per_layer);

/* Read path ("-" = stdin), parse, apply: what kv-run --profile calls. */
kv_status kv_deploy_load(const char *path, int n_layers, kv_policy_params *per_layer);

/* Every layer's policy the way the tools take it: from the deploy config at
 * profile_path when given (kv_deploy_load), else from spec (NULL: "full"),
 * then the front-end defaults d (NULL: none). */
kv_status kv_policies_load(const char *spec, const char *profile_path, const kv_policy_defaults *d,
                           int n_layers, kv_policy_params *per_layer);

/* Read and parse path; the caller frees with kv_deploy_clear. */
kv_status kv_deploy_read(const char *path, int n_layers, kv_deploy *out);

/* Mark the quantized layers (quant or dsq): quant[i] = true. */
void kv_deploy_quant_mask(const kv_deploy *d, int n_layers, bool *quant /* (n_layers) */);

/* Parse a layer list "0,2,5-7" (or "all") into sel (n_layers) booleans;
 * KV_E_USAGE on syntax errors or layers out of range. */
kv_status kv_layer_list_parse(const char *s, int n_layers, bool *sel);

/* Append the config as a JSON object (no trailing newline) to f, indented by
 * indent spaces: version 2 when per_layer is set (each layer's spec), else
 * version 1 with the lists sorted.  errors and bytes (n_layers, may be NULL)
 * are written beside each layer of a version 2 config. */
#include <stdio.h>
void kv_deploy_write_json(const kv_deploy *d, FILE *f, int indent);
void kv_deploy_write_json_ext(const kv_deploy *d, const double *errors, const double *bytes, FILE *f,
                              int indent);

#endif
