/*
 * kv_runner: one decode driver over the CPU engine (lib/engine/kv_engine.h) and the
 * GPU engine (lib/gpu/kv_gpu_engine.h), so that the evaluation code (kv_niah,
 * kv_compare) runs the same path on either device.  A runner owns exactly
 * one engine, chosen at construction; every call is a switch on that kind
 * and forwards to the engine with the same meaning (positions, context,
 * reset, byte accounting: see the two engine headers).
 *
 * On the GPU the weights are fp16 (bf16 for bf16 models) and the KV cache is
 * fp16, so `full` there is not the CPU's f32 `full`: compare runners of the
 * same device with each other.
 *
 * Typical use:
 *   kv_runner *r; kv_runner_new(m, per_layer, 0, KV_DEVICE_AUTO, NULL, &r);
 *   kv_runner_prefill(r, toks, n, logits);          // logits (vocab)
 *   for (...) kv_runner_step(r, argmax(logits), logits);
 *   kv_runner_free(r);
 */
#ifndef KV_RUNNER_H
#define KV_RUNNER_H

#include <stdbool.h>

#include "common/kv_device.h"
#include "gpu/kv_gpu_engine.h"
#include "model/kv_model.h"
#include "policy/kv_policy.h"
#include "common/kv_status.h"

typedef struct kv_runner kv_runner;

/*
 * Build a runner for m (borrowed; must outlive the runner).  per_layer
 * (n_layers) or NULL for `full`; ctx: capacity in tokens (0 = the model's
 * seq_len); gpu_opts: the GPU engine's options, NULL for its defaults
 * (ignored on the CPU).  KV_DEVICE_CUDA returns kv_gpu_engine_new's failure
 * as is (KV_E_UNAVAILABLE without a usable GPU, KV_E_UNSUPPORTED for a
 * policy the GPU engine lacks); KV_DEVICE_AUTO then builds the CPU engine
 * instead, without an error.
 */
kv_status kv_runner_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                        kv_device dev, const kv_gpu_engine_opts *gpu_opts, kv_runner **out);
void kv_runner_free(kv_runner *r);

/* Forget every token; per_layer (n_layers) replaces the policies, NULL keeps them. */
kv_status kv_runner_reset(kv_runner *r, const kv_policy_params *per_layer);
/* Dense prefill of tokens (n >= 1) from position 0; logits_last (vocab) or NULL. */
kv_status kv_runner_prefill(kv_runner *r, const int *tokens, int n, float *logits_last);
/* One decode step at position kv_runner_pos(); logits (vocab) or NULL. */
kv_status kv_runner_step(kv_runner *r, int token, float *logits);

int kv_runner_pos(const kv_runner *r);   /* tokens processed so far */
int kv_runner_ctx(const kv_runner *r);   /* capacity */
int kv_runner_vocab(const kv_runner *r);
const kv_model *kv_runner_model(const kv_runner *r);
/* Every layer's kv_bytes summed (resident = GPU bytes on the GPU engine). */
void kv_runner_bytes(const kv_runner *r, kv_bytes *total);

bool kv_runner_is_gpu(const kv_runner *r);
/* "cpu", or the GPU engine's device ("NVIDIA H200 (sm_90, ...)"). */
const char *kv_runner_device(const kv_runner *r);

#endif
