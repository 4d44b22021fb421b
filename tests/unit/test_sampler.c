/*
 * The sampler on degenerate logits: a temperature so small that the scaled
 * logits overflow, NaN and infinite logits, a vocabulary of one, a nucleus
 * cut that no token passes.  Each must return a token of the vocabulary
 * (the ASan build also checks that nothing is read outside the candidate
 * buffer), and the ordinary path must still make run.c's choices.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kt_kv.h"
#include "model/kv_sampler.h"


static void fill_logits(float *x, int n, unsigned long long seed)
{
    for (int i = 0; i < n; i++) x[i] = kt_randn(&seed) * 3.0f;
}

/* One draw of the sampler on a copy of logits. */
static int draw(kv_sampler *s, const float *logits, int n)
{
    float *x = malloc((size_t)n * sizeof *x);
    if (!x) return -2;
    memcpy(x, logits, (size_t)n * sizeof *x);
    int t = kv_sampler_next(s, x);
    free(x);
    return t;
}

static void test_tiny_temperature_picks_the_most_likely_token(void)
{
    enum { V = 512 };
    float lg[V];
    fill_logits(lg, V, 7);
    int best = kv_argmax(lg, V);
    const float temps[] = {1e-38f, 1e-30f, 1e-45f};
    const float tops[] = {0.9f, 0.0f, 1.0f};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            kv_sampler s;
            OK(kv_sampler_init(&s, V, temps[a], tops[b], 42));
            int t = best;
            for (int i = 0; i < 20 && t == best; i++) t = draw(&s, lg, V);
            KT_CHECK(t == best, "temp %g top-p %g: token %d, argmax %d", temps[a], tops[b], t, best);
            kv_sampler_clear(&s);
        }
}

static void test_nan_logits_are_never_chosen(void)
{
    enum { V = 64 };
    float lg[V];
    fill_logits(lg, V, 11);
    for (int i = 0; i < V; i += 3) lg[i] = NAN;
    const float tops[] = {0.9f, 0.0f};
    for (int b = 0; b < 2; b++) {
        kv_sampler s;
        OK(kv_sampler_init(&s, V, 1.0f, tops[b], 3));
        for (int i = 0; i < 200; i++) {
            int t = draw(&s, lg, V);
            KT_REQUIRE(t >= 0 && t < V, "token %d outside the vocabulary", t);
            if (isnan(lg[t])) {
                KT_CHECK(!isnan(lg[t]), "top-p %g: chose the NaN logit %d", tops[b], t);
                break;
            }
        }
        kv_sampler_clear(&s);
    }
    /* greedy skips NaN too, wherever it sits */
    float g[4] = {NAN, 1.0f, NAN, 2.0f};
    KT_CHECK(kv_argmax(g, 4) == 3, "argmax %d", kv_argmax(g, 4));
    float g2[3] = {1.0f, NAN, 0.5f};
    KT_CHECK(kv_argmax(g2, 3) == 0, "argmax %d", kv_argmax(g2, 3));
}

static void test_infinite_and_all_nan_logits_stay_in_the_vocabulary(void)
{
    enum { V = 16 };
    float lg[V];
    kv_sampler s;
    OK(kv_sampler_init(&s, V, 0.8f, 0.9f, 5));
    /* +inf: that token is the only one possible */
    fill_logits(lg, V, 13);
    lg[9] = INFINITY;
    int hits = 0;
    for (int i = 0; i < 50; i++) hits += draw(&s, lg, V) == 9;
    KT_CHECK(hits == 50, "+inf logit chosen %d of 50 times", hits);
    /* everything NaN or -inf: some token, never a crash */
    for (int i = 0; i < V; i++) lg[i] = i % 2 ? NAN : -INFINITY;
    int t = draw(&s, lg, V);
    KT_CHECK(t >= 0 && t < V, "token %d", t);
    for (int i = 0; i < V; i++) lg[i] = NAN;
    t = draw(&s, lg, V);
    KT_CHECK(t >= 0 && t < V, "token %d", t);
    kv_sampler_clear(&s);
}

static void test_vocabulary_of_one_gives_token_zero(void)
{
    kv_sampler s;
    OK(kv_sampler_init(&s, 1, 1.0f, 0.9f, 1));
    float x = 0.25f;
    int hits = 0;
    for (int i = 0; i < 5; i++) hits += draw(&s, &x, 1) == 0;
    KT_CHECK(hits == 5, "token 0 %d of 5 times", hits);
    kv_sampler_clear(&s);
    kv_sampler z;
    KT_CHECK(kv_sampler_init(&z, 0, 1.0f, 0.9f, 1) == KV_E_USAGE, "empty vocabulary accepted");
    KT_CHECK(kv_sampler_init(&z, 4, NAN, 0.9f, 1) == KV_E_USAGE, "NaN temperature accepted");
    KT_CHECK(kv_sampler_init(&z, 4, 1.0f, NAN, 1) == KV_E_USAGE, "NaN top-p accepted");
}

static void test_nucleus_below_the_cutoff_keeps_the_top_token(void)
{
    /* uniform logits with top-p < 1/n: every probability 1/n is below the
     * pre-filter's (1-p)/(n-1), so run.c's filter keeps nothing */
    enum { V = 512 };
    float lg[V];
    for (int i = 0; i < V; i++) lg[i] = 1.0f;
    lg[100] = 1.0f + 1e-6f;
    kv_sampler s;
    OK(kv_sampler_init(&s, V, 1.0f, 1e-4f, 9));
    int hits = 0;
    for (int i = 0; i < 10; i++) hits += draw(&s, lg, V) == 100;
    KT_CHECK(hits == 10, "the most likely token chosen %d of 10 times", hits);
    kv_sampler_clear(&s);
}

/* run.c's sample_topp, written out plainly, for the ordinary case. */
static int reference_topp(const float *logits, int n, float temp, float topp, float coin)
{
    float *p = malloc((size_t)n * sizeof *p);
    int *ix = malloc((size_t)n * sizeof *ix);
    float mx = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++) {
        p[i] = logits[i] / temp;
        if (p[i] > mx) mx = p[i];
    }
    for (int i = 0; i < n; i++) sum += (p[i] = expf(p[i] - mx));
    for (int i = 0; i < n; i++) p[i] /= sum;
    const float cut = (1.0f - topp) / (float)(n - 1);
    int m = 0;
    for (int i = 0; i < n; i++)
        if (p[i] >= cut) ix[m++] = i;
    for (int i = 1; i < m; i++) /* insertion sort, descending, stable */
        for (int j = i; j > 0 && p[ix[j]] > p[ix[j - 1]]; j--) {
            int t = ix[j];
            ix[j] = ix[j - 1];
            ix[j - 1] = t;
        }
    float cum = 0;
    int last = m - 1;
    for (int i = 0; i < m; i++) {
        cum += p[ix[i]];
        if (cum > topp) {
            last = i;
            break;
        }
    }
    float r = coin * cum, cdf = 0;
    int out = ix[last];
    for (int i = 0; i <= last; i++) {
        cdf += p[ix[i]];
        if (r < cdf) {
            out = ix[i];
            break;
        }
    }
    free(p);
    free(ix);
    return out;
}

static void test_ordinary_sampling_follows_run_c(void)
{
    enum { V = 256 };
    float lg[V];
    kv_sampler s;
    OK(kv_sampler_init(&s, V, 0.8f, 0.9f, 1234));
    uint64_t rng = 1234;
    int same = 0;
    for (int i = 0; i < 100; i++) {
        fill_logits(lg, V, 100 + (unsigned long long)i);
        /* the sampler's coin: llama2.c's xorshift, one draw per token */
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        float coin = (float)((uint32_t)((rng * 0x2545F4914F6CDD1Dull) >> 32) >> 8) / 16777216.0f;
        int want = reference_topp(lg, V, 0.8f, 0.9f, coin);
        same += draw(&s, lg, V) == want;
    }
    KT_CHECK(same == 100, "%d of 100 draws match run.c", same);
    kv_sampler_clear(&s);
}

int main(void)
{
    KT_RUN(test_tiny_temperature_picks_the_most_likely_token);
    KT_RUN(test_nan_logits_are_never_chosen);
    KT_RUN(test_infinite_and_all_nan_logits_stay_in_the_vocabulary);
    KT_RUN(test_vocabulary_of_one_gives_token_zero);
    KT_RUN(test_nucleus_below_the_cutoff_keeps_the_top_token);
    KT_RUN(test_ordinary_sampling_follows_run_c);
    return kt_done();
}
