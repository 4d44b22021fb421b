/*
 * kv_gen: greedy generation of one prompt through a runner (see kv_gen.h).
 */
#include "eval/kv_gen.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/kv_text.h"
#include "eval/kv_unicode.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

void kv_gen_result_free(kv_gen_result *r)
{
    free(r->text);
    r->text = NULL;
}

static kv_status text_add(kv_text *b, const char *s, size_t n)
{
    return kv_text_add(b, s, n, "generated text");
}

kv_status kv_gen_detok(const kv_tokenizer *tok, const int *ids, int n, char **text, size_t *len)
{
    kv_text b = {0};
    kv_status st = text_add(&b, "", 0);
    const int bos = kv_tokenizer_bos(tok), eos = kv_tokenizer_eos(tok);
    int prev = bos;
    for (int i = 0; i < n && !st; i++) {
        if (ids[i] == bos || ids[i] == eos) continue;
        size_t l;
        const char *p = kv_tokenizer_decode(tok, prev, ids[i], &l);
        if (p) st = text_add(&b, p, l);
        prev = ids[i];
    }
    if (st) {
        free(b.s);
        return st;
    }
    *text = b.s;
    if (len) *len = b.n;
    return KV_OK;
}

kv_status kv_gen_split(const kv_tokenizer *tok, const char *text, size_t off, const int *ids,
                       int n, int *split)
{
    int *pre = NULL, npre = 0;
    kv_status st = kv_tokenizer_encode(tok, text, off, true, false, &pre, &npre);
    if (st) return st;
    int s = 0;
    while (s < npre && s < n && pre[s] == ids[s]) s++;
    free(pre);
    *split = s < 1 ? 1 : s;
    return KV_OK;
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

kv_status kv_gen_run(kv_runner *e, const kv_tokenizer *tok, const kv_policy_params *per_layer,
                     const kv_gen_req *q, kv_gen_result *r)
{
    memset(r, 0, sizeof *r);
    const double t0 = now_ms();
    const int ctx = kv_runner_ctx(e), vocab = kv_runner_vocab(e);
    if (q->n < 1 || q->split < 1 || q->split > q->n || q->max_new < 1)
        return kv_fail(KV_E_INTERNAL, "generation request: n %d, split %d, max_new %d", q->n,
                       q->split, q->max_new);
    if (q->n > ctx)
        return kv_fail(KV_E_DATA, "prompt of %d tokens exceeds the context %d", q->n, ctx);
    float *logits = malloc((size_t)vocab * sizeof *logits);
    if (!logits) return kv_fail(KV_E_NOMEM, "logits");
    kv_text text = {0};
    kv_status st = text_add(&text, "", 0);
    if (!st) st = kv_runner_reset(e, per_layer);
    if (!st) st = kv_runner_prefill(e, q->ids, q->split, logits);
    const double t1 = now_ms();
    for (int i = q->split; i < q->n && !st; i++) st = kv_runner_step(e, q->ids[i], logits);
    r->prompt_tokens = q->n;
    r->dense_tokens = q->split;
    r->decoded = q->n - q->split;
    int prev = q->ids[q->n - 1];
    for (int g = 0; g < q->max_new && !st; g++) {
        if (g < q->min_new) { /* HF min_length: stop tokens cannot come yet */
            if (q->eos >= 0 && q->eos < vocab) logits[q->eos] = -INFINITY;
            if (q->stop >= 0 && q->stop < vocab) logits[q->stop] = -INFINITY;
        }
        int next = argmax(logits, vocab);
        r->n_new++;
        if (next == q->eos) break;
        size_t bl;
        const char *piece = kv_tokenizer_decode(tok, prev, next, &bl);
        if (piece) st = text_add(&text, piece, bl);
        prev = next;
        if (st || next == q->stop || g + 1 == q->max_new) break;
        if (kv_runner_pos(e) >= ctx) { /* no room for the next token's K/V */
            r->ctx_full = true;
            break;
        }
        st = kv_runner_step(e, next, logits);
        r->decoded++;
    }
    const double t2 = now_ms();
    if (!st) st = kv_utf8_sanitize(text.s, text.n, &r->text, NULL);
    if (!st) {
        kv_runner_bytes(e, &r->bytes);
        r->fetched_per_step = r->decoded > 0 ? (double)r->bytes.fetched_total / r->decoded : 0.0;
        const kv_model *m = kv_runner_model(e);
        r->full_bytes = 2.0 * m->cfg.n_layers * m->cfg.n_kv_heads * (double)kv_runner_pos(e) *
                        m->cfg.head_dim * 2.0;
    }
    r->prefill_ms = t1 - t0;
    r->decode_ms = t2 - t1;
    r->ms = t2 - t0;
    free(text.s);
    free(logits);
    if (st) kv_gen_result_free(r);
    return st;
}
