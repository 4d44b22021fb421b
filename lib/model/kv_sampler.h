/*
 * kv_sampler: next-token choice from logits.  Temperature 0 is greedy
 * (argmax); otherwise softmax at the temperature, then nucleus (top-p)
 * sampling when 0 < top_p < 1.  The random stream is llama2.c's xorshift
 * and the sampling order is run.c's, so a given seed reproduces run.c's
 * sampled text on the same model.
 */
#ifndef KV_SAMPLER_H
#define KV_SAMPLER_H

#include <stdint.h>

#include "common/kv_status.h"

typedef struct {
    int vocab;
    float temp, top_p;
    uint64_t rng;
    float *probs;            /* (vocab) scratch */
    struct kv_prob_index *cand; /* (vocab) scratch for top-p */
} kv_sampler;

kv_status kv_sampler_init(kv_sampler *s, int vocab, float temp, float top_p, uint64_t seed);
void kv_sampler_clear(kv_sampler *s);
/* Choose a token; logits (vocab) are modified (scaled, softmaxed). */
int kv_sampler_next(kv_sampler *s, float *logits);

int kv_argmax(const float *x, int n);
/* In-place softmax of x (n). */
void kv_softmax(float *x, int n);
/* -log softmax(logits)[tok], computed stably in double. */
double kv_nll(const float *logits, int n, int tok);
/* The k most probable tokens of softmax(logits) (n), most probable first
 * (ties: lower id first): ids (k) and probabilities p (k), the softmax
 * taken in double.  k is clipped to n; returns it. */
int kv_top_probs(const float *logits, int n, int k, int *ids, double *p);

#endif
