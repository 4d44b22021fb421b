/*
 * kv_gen: one prompt, generated greedily through a kv_runner (the CPU or
 * the GPU engine) under a set of per-layer policies -- the step every
 * accuracy benchmark (RULER, LongBench) shares.
 *
 * The first `split` prompt tokens are prefilled densely and handed to the
 * policies; the rest of the prompt (the question, say) and every generated
 * token are decoded through them.  Generation is argmax, as HF generate()
 * with do_sample=False: it stops after max_new tokens, at EOS (whose text
 * is dropped, as skip_special_tokens does), at the extra stop token when
 * one is given (its text is kept: LongBench's samsum stops at "\n"), or
 * when the context is full.  Before min_new tokens the stop tokens are
 * suppressed (HF's min_length).  The text is valid UTF-8: ill-formed byte
 * sequences become U+FFFD, as tokenizers' decode() does.
 */
#ifndef KV_GEN_H
#define KV_GEN_H

#include <stdbool.h>

#include "common/kv_status.h"
#include "engine/kv_runner.h"
#include "model/kv_tokenizer.h"
#include "policy/kv_policy.h"

typedef struct {
    const int *ids; /* (n) prompt tokens, BOS first */
    int n;
    int split;      /* 1..n: tokens prefilled densely */
    int max_new;    /* >= 1 */
    int eos;        /* stop token whose text is dropped; -1: none */
    int stop;       /* stop token whose text is kept; -1: none */
    int min_new;    /* stop tokens suppressed before this many new tokens */
} kv_gen_req;

typedef struct {
    char *text;            /* generated text (malloc'd, valid UTF-8) */
    int n_new;             /* tokens generated (a stop token counted) */
    int prompt_tokens, dense_tokens;
    int decoded;           /* tokens decoded through the policies */
    bool ctx_full;         /* stopped because the context was full */
    kv_bytes bytes;        /* every layer, after the last step */
    double fetched_per_step;
    double full_bytes;     /* an f16 cache of the final context */
    double ms, prefill_ms, decode_ms;
} kv_gen_result;

/* Reset e with per_layer (NULL keeps its policies) and generate.  A prompt
 * longer than the context is KV_E_DATA. */
kv_status kv_gen_run(kv_runner *e, const kv_tokenizer *tok, const kv_policy_params *per_layer,
                     const kv_gen_req *q, kv_gen_result *r);
void kv_gen_result_free(kv_gen_result *r);

/* The dense split for a prompt whose first `off` bytes are the context:
 * the tokens of text[0..off) (with BOS) that agree with ids, at least 1 --
 * so a merging tokenizer splits where the two encodings agree. */
kv_status kv_gen_split(const kv_tokenizer *tok, const char *text, size_t off, const int *ids,
                       int n, int *split);

/* Bytes of tokens ids[0..n) decoded as one sequence (BOS/EOS skipped, the
 * first piece's leading space dropped as SentencePiece does). */
kv_status kv_gen_detok(const kv_tokenizer *tok, const int *ids, int n, char **text, size_t *len);

#endif
