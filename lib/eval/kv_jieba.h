/*
 * kv_jieba: Chinese word segmentation exactly as jieba 0.42's
 * jieba.cut(text, cut_all=False, HMM=True), which LongBench's Chinese
 * metrics call (qa_f1_zh_score, rouge_zh_score).  The data are jieba's own
 * files, read as published (Debian's python3-jieba installs them under
 * /usr/lib/python3/dist-packages/jieba):
 *
 *   dict.txt                 one "word freq [tag]" per line
 *   finalseg/prob_start.py   P={'B': -0.26, 'E': -3.14e+100, ...}
 *   finalseg/prob_trans.py   P={'B': {'E': -0.51, 'M': -0.91}, ...}
 *   finalseg/prob_emit.py    P={'B': {'\u4e00': -3.65, ...}, ...}
 *
 * The algorithm (written from jieba's description and behaviour):
 *  1. The text splits into runs of "Han" characters (U+4E00..U+9FD5, ASCII
 *     letters and digits, + # & . _ % -) and the rest; outside a run each
 *     character is a token of its own, "\r\n" being one token.
 *  2. In a run, every dictionary word starting at each position forms a DAG
 *     (the prefix dictionary holds every word and, with frequency 0, every
 *     prefix of one); the route of maximum log-probability
 *     log(freq or 1) - log(total) is taken from the end, the longer word
 *     winning a tie.
 *  3. Consecutive single characters of that route are gathered; a gathered
 *     string of two or more that is not a word of positive frequency goes
 *     to the HMM: Han runs in it are labelled B/M/E/S by Viterbi (ties to
 *     the later state letter, as Python's max over (prob, state) tuples),
 *     other runs split into [a-zA-Z0-9]+(\.\d+)?%? and what lies between.
 * Tokens are returned as spans of the input: they cover it in order.
 */
#ifndef KV_JIEBA_H
#define KV_JIEBA_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_status.h"

/* Where Debian's python3-jieba puts jieba's data. */
#define KV_JIEBA_DEFAULT_DIR "/usr/lib/python3/dist-packages/jieba"

typedef struct kv_jieba kv_jieba;

typedef struct {
    size_t start, len; /* code points */
} kv_span;

kv_status kv_jieba_new(kv_jieba **out);
void kv_jieba_free(kv_jieba *j);

/* Add dict.txt text (len bytes; name for messages "name:LINE: ...") as
 * jieba's gen_pfdict does: later lines replace a word's frequency and every
 * line adds to the total.  Lines jieba refuses (no frequency, a frequency
 * that is not an integer, invalid UTF-8) are KV_E_DATA naming the line; so
 * is a negative frequency, which jieba would take and fail on later. */
kv_status kv_jieba_load_dict(kv_jieba *j, const char *text, size_t len, const char *name);

/* The HMM tables from the text of prob_start.py, prob_trans.py and
 * prob_emit.py (each a Python literal "P={...}"). */
kv_status kv_jieba_load_hmm(kv_jieba *j, const char *start, size_t start_len,
                            const char *trans, size_t trans_len, const char *emit,
                            size_t emit_len);

/* Read DIR/dict.txt (or dict_path when not NULL) and DIR/finalseg/prob_*.py;
 * dir NULL means KV_JIEBA_DEFAULT_DIR.  A missing file is KV_E_NOINPUT with
 * a hint to install python3-jieba or pass --jieba. */
kv_status kv_jieba_open(const char *dir, const char *dict_path, kv_jieba **out);

/* jieba.cut(s, cut_all=False, HMM=True) over n code points: *tok malloc'd
 * (caller frees), *ntok spans.  Needs a dictionary and the HMM tables. */
kv_status kv_jieba_cut(const kv_jieba *j, const uint32_t *s, size_t n, kv_span **tok,
                       size_t *ntok);

/* Entries of the prefix dictionary (words and prefixes) and the total. */
size_t kv_jieba_entries(const kv_jieba *j);
long long kv_jieba_total(const kv_jieba *j);

#endif
