/*
 * kv_sampler: greedy, temperature and top-p sampling (see kv_sampler.h).
 * The arithmetic follows llama2.c's run.c step for step (float softmax,
 * the (1-p)/(n-1) pre-filter, a descending sort, the cumulative cut) so
 * that the same seed gives the same tokens.  Where run.c's arithmetic
 * breaks down it is replaced, never followed out of bounds: a temperature so
 * small that the scaled logits overflow, NaN logits (counted as impossible
 * tokens), a vocabulary of one, a nucleus cut that keeps no candidate.
 */
#include "model/kv_sampler.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>

struct kv_prob_index {
    float prob;
    int index;
};

kv_status kv_sampler_init(kv_sampler *s, int vocab, float temp, float top_p, uint64_t seed)
{
    s->cand = NULL;
    if (vocab < 1) return kv_fail(KV_E_USAGE, "sampler over an empty vocabulary");
    if (!(temp >= 0.0f && temp <= 1e30f)) return kv_fail(KV_E_USAGE, "temperature %g out of range", temp);
    if (!(top_p >= 0.0f && top_p <= 1.0f)) return kv_fail(KV_E_USAGE, "top-p %g out of range", top_p);
    s->vocab = vocab;
    s->temp = temp;
    s->top_p = top_p;
    s->rng = seed ? seed : 1; /* xorshift must not start at 0 */
    s->probs = NULL;
    s->cand = malloc((size_t)vocab * sizeof *s->cand);
    if (!s->cand) return kv_fail(KV_E_NOMEM, "out of memory for the sampler");
    return KV_OK;
}

void kv_sampler_clear(kv_sampler *s)
{
    free(s->cand);
    s->cand = NULL;
}

static uint32_t rand_u32(uint64_t *st)
{
    *st ^= *st >> 12;
    *st ^= *st << 25;
    *st ^= *st >> 27;
    return (uint32_t)((*st * 0x2545F4914F6CDD1Dull) >> 32);
}

static float rand_f32(uint64_t *st) { return (float)(rand_u32(st) >> 8) / 16777216.0f; }

int kv_argmax(const float *x, int n)
{
    /* NaN never wins over a number: a NaN at 0 is replaced by the first
     * number, and no comparison with NaN is true afterwards */
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b] || (isnan(x[b]) && !isnan(x[i]))) b = i;
    return b;
}

void kv_softmax(float *x, int n)
{
    float mx = x[0];
    for (int i = 1; i < n; i++)
        if (x[i] > mx) mx = x[i];
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    for (int i = 0; i < n; i++) x[i] /= sum;
}

double kv_nll(const float *logits, int n, int tok)
{
    double mx = logits[0];
    for (int i = 1; i < n; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - mx);
    return -(((double)logits[tok] - mx) - log(sum));
}

static int cmp_desc(const void *a, const void *b)
{
    const struct kv_prob_index *x = a, *y = b;
    return x->prob > y->prob ? -1 : x->prob < y->prob ? 1 : 0;
}

/*
 * Probabilities at temperature t in place.  run.c's order (divide, then a
 * softmax that subtracts the maximum) whenever it is exact enough: no NaN
 * and a finite scaled maximum.  Otherwise (a temperature like 1e-38 makes
 * x/t overflow; a +inf logit) subtract the maximum first, so the largest
 * logits get exp(0) = 1 and nothing overflows; NaN logits get 0.
 * Returns false when no logit is a number larger than -inf.
 */
static bool tempered_softmax(float *x, int n, float t)
{
    float mx = -INFINITY;
    bool nan = false;
    for (int i = 0; i < n; i++) {
        if (isnan(x[i])) nan = true;
        else if (x[i] > mx) mx = x[i];
    }
    if (mx == -INFINITY) return false;
    if (!nan && isfinite(mx / t)) {
        for (int i = 0; i < n; i++) x[i] /= t;
        kv_softmax(x, n);
        return true;
    }
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        float d = isnan(x[i]) ? -INFINITY : x[i] == mx ? 0.0f : (x[i] - mx) / t;
        x[i] = expf(d);
        sum += x[i];
    }
    for (int i = 0; i < n; i++) x[i] /= sum; /* sum >= 1: the maximum's exp(0) */
    return true;
}

int kv_sampler_next(kv_sampler *s, float *logits)
{
    int n = s->vocab;
    if (s->temp == 0.0f || n == 1) return kv_argmax(logits, n);
    if (!tempered_softmax(logits, n, s->temp)) return kv_argmax(logits, n);
    float coin = rand_f32(&s->rng);
    if (s->top_p <= 0 || s->top_p >= 1) {
        float cdf = 0.0f;
        for (int i = 0; i < n; i++) {
            cdf += logits[i];
            if (coin < cdf) return i;
        }
        return n - 1; /* run.c's answer when rounding leaves the coin above the sum */
    }
    /* nucleus: drop tokens that cannot be in it before sorting */
    const float cutoff = (1.0f - s->top_p) / (float)(n - 1);
    int n0 = 0;
    for (int i = 0; i < n; i++)
        if (logits[i] >= cutoff) s->cand[n0++] = (struct kv_prob_index){logits[i], i};
    if (n0 == 0) { /* the nucleus always holds the most likely token */
        int b = kv_argmax(logits, n);
        s->cand[n0++] = (struct kv_prob_index){logits[b], b};
    }
    qsort(s->cand, (size_t)n0, sizeof *s->cand, cmp_desc);
    float cum = 0.0f;
    int last = n0 - 1;
    for (int i = 0; i < n0; i++) {
        cum += s->cand[i].prob;
        if (cum > s->top_p) {
            last = i;
            break;
        }
    }
    float r = coin * cum, cdf = 0.0f;
    for (int i = 0; i <= last; i++) {
        cdf += s->cand[i].prob;
        if (r < cdf) return s->cand[i].index;
    }
    return s->cand[last].index;
}

int kv_top_probs(const float *logits, int n, int k, int *ids, double *p)
{
    if (k > n) k = n;
    if (k <= 0) return 0;
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++) mx = fmax(mx, (double)logits[i]);
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - mx);
    int m = 0; /* insertion into a sorted top-k list: k is small */
    for (int i = 0; i < n; i++) {
        if (m == k && !(logits[i] > logits[ids[m - 1]])) continue;
        int j = m < k ? m++ : k - 1;
        while (j > 0 && logits[i] > logits[ids[j - 1]]) {
            ids[j] = ids[j - 1];
            j--;
        }
        ids[j] = i;
    }
    for (int j = 0; j < k; j++) p[j] = exp((double)logits[ids[j]] - mx) / sum;
    return k;
}
