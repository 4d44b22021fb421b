/*
 * kv_seqmatch: the ratio of Python's difflib.SequenceMatcher(None, a, b),
 * which is what fuzzywuzzy's fuzz.ratio computes when python-Levenshtein is
 * not installed (LongBench's requirements install plain fuzzywuzzy), and so
 * what LongBench's code_sim_score reports for lcc and repobench-p.
 *
 * The same algorithm, not an approximation of it: b's elements are indexed
 * by position; with b of 200 or more elements the autojunk heuristic drops
 * every element occurring more than len(b)/100 + 1 times from the index
 * ("popular" elements can then only join a match by the extension step);
 * the longest matching block (earliest in a, then in b, on ties) is found,
 * extended over equal neighbours, and the two sides are searched again;
 * ratio = 2 * matched / (len(a) + len(b)), 1.0 when both are empty.
 */
#ifndef KV_SEQMATCH_H
#define KV_SEQMATCH_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_status.h"

/* Total size of the matching blocks of a (na) and b (nb). */
kv_status kv_seqmatch_matches(const uint32_t *a, size_t na, const uint32_t *b, size_t nb,
                              size_t *matches);
/* SequenceMatcher(None, a, b).ratio(), computed as Python does. */
kv_status kv_seqmatch_ratio(const uint32_t *a, size_t na, const uint32_t *b, size_t nb,
                            double *ratio);
/* fuzzywuzzy fuzz.ratio(a, b): 100 if equal, 0 if either is empty, else
 * int(round(100 * ratio)) with Python's round-half-even. */
kv_status kv_fuzz_ratio(const uint32_t *a, size_t na, const uint32_t *b, size_t nb, int *out);

#endif
