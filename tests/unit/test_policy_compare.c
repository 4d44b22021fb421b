/*
 * Unit tests of lib/kv_compare on the seeded synthetic "tiny" model:
 * a policy identical to the reference diverges by exactly zero, lossy
 * policies by more, and the statistics are consistent with each other;
 * the device defaults to the CPU, and AUTO without a GPU is the CPU run.
 */
#include <stdlib.h>
#include <string.h>

#include "kt.h"
#include "eval/kv_compare.h"
#include "engine/kv_engine.h"
#include "gpu/kv_gpu.h"

static kv_model *m;
#define NT 64
static int toks[NT];

static void run(const char *spec, int prefix, kv_compare_result *r, kv_status *st)
{
    kv_policy_params *p = calloc((size_t)m->cfg.n_layers, sizeof *p);
    *st = kv_policy_parse(spec, m->cfg.n_layers, p);
    kv_compare_opts o;
    kv_compare_opts_default(&o);
    o.prefix = prefix;
    if (*st == KV_OK) *st = kv_compare_run(m, toks, NT, NULL, p, &o, r);
    free(p);
}

static void test_identical_is_zero(void)
{
    const char *same[] = {"full", "sparse:k=1000", "streaming:window=1000"};
    for (int i = 0; i < 3; i++) {
        kv_compare_result r;
        kv_status st;
        run(same[i], 0, &r, &st);
        KT_REQUIRE(st == KV_OK, "%s: %s", same[i], kv_errdetail());
        KT_CHECK(r.prefix == NT / 2 && r.n_scored == NT / 2 - 1, "%s: prefix %d scored %d", same[i], r.prefix, r.n_scored);
        KT_CHECK(r.kl_mean == 0 && r.kl_max == 0 && r.top1 == 1 && r.ppl_diff == 0, "%s: kl %g top1 %g dppl %g",
                 same[i], r.kl_mean, r.top1, r.ppl_diff);
        kv_compare_result_clear(&r);
    }
}

static void test_lossy_diverges(void)
{
    kv_compare_result r1, r4;
    kv_status st;
    run("quant:bits=1,residual=0,group=8", 16, &r1, &st);
    KT_REQUIRE(st == KV_OK, "%s", kv_errdetail());
    run("quant:bits=4,residual=0,group=8", 16, &r4, &st);
    KT_REQUIRE(st == KV_OK, "%s", kv_errdetail());
    KT_CHECK(r1.prefix == 16 && r1.n_scored == NT - 17, "scored %d", r1.n_scored);
    KT_CHECK(r1.kl_mean > r4.kl_mean && r4.kl_mean > 0, "kl 1-bit %g 4-bit %g", r1.kl_mean, r4.kl_mean);
    KT_CHECK(r1.kl_max >= r1.kl_mean, "max %g < mean %g", r1.kl_max, r1.kl_mean);
    double s = 0;
    int agree = 0;
    for (int i = 0; i < r1.n_scored; i++) {
        s += r1.kl[i];
        agree += r1.agree[i];
        KT_CHECK(r1.kl[i] >= 0, "negative KL at %d", i);
    }
    KT_NEAR(s / r1.n_scored, r1.kl_mean, 1e-9);
    KT_NEAR((double)agree / r1.n_scored, r1.top1, 1e-12);
    KT_NEAR(r1.ppl_diff, r1.ppl_pol - r1.ppl_ref, 1e-9);
    KT_NEAR(r1.ppl_ref, r4.ppl_ref, 0); /* the reference is the same run */
    KT_CHECK(r1.bytes_pol.resident < r4.bytes_pol.resident && r4.bytes_pol.resident < r4.bytes_ref.resident,
             "bytes");
    kv_compare_result_clear(&r1);
    kv_compare_result_clear(&r4);
}

/* Without a GPU, AUTO runs the same CPU engines: identical numbers. */
static void test_auto_without_gpu_is_the_cpu_run(void)
{
    kv_policy_params *p = calloc((size_t)m->cfg.n_layers, sizeof *p);
    KT_REQUIRE(p, "oom");
    KT_REQUIRE(kv_policy_parse("quant:bits=2,residual=0,group=8", m->cfg.n_layers, p) == KV_OK, "parse");
    kv_compare_opts o;
    kv_compare_opts_default(&o);
    KT_CHECK(o.device == KV_DEVICE_CPU, "default device %d", (int)o.device);
    o.prefix = 16;
    kv_compare_result rc, ra;
    kv_status sc = kv_compare_run(m, toks, NT, NULL, p, &o, &rc);
    o.device = KV_DEVICE_AUTO;
    kv_status sa = kv_compare_run(m, toks, NT, NULL, p, &o, &ra);
    o.device = KV_DEVICE_CUDA;
    kv_compare_result ru;
    kv_status su = kv_compare_run(m, toks, NT, NULL, p, &o, &ru);
    free(p);
    KT_REQUIRE(sc == KV_OK && sa == KV_OK, "cpu %d auto %d: %s", (int)sc, (int)sa, kv_errdetail());
    KT_CHECK(su == KV_E_UNAVAILABLE && ru.kl == NULL, "cuda without a GPU: status %d", (int)su);
    KT_CHECK(!strcmp(rc.device, "cpu") && !strcmp(ra.device, "cpu"), "devices %s %s", rc.device, ra.device);
    KT_CHECK(rc.kl_mean > 0 && rc.kl_mean == ra.kl_mean && rc.kl_max == ra.kl_max && rc.top1 == ra.top1 &&
                 rc.ppl_pol == ra.ppl_pol && rc.ppl_ref == ra.ppl_ref,
             "kl %g vs %g", rc.kl_mean, ra.kl_mean);
    KT_CHECK(!memcmp(rc.kl, ra.kl, (size_t)rc.n_scored * sizeof *rc.kl), "per-position KL differs");
    KT_CHECK(rc.bytes_pol.resident == ra.bytes_pol.resident, "bytes");
    kv_compare_result_clear(&rc);
    kv_compare_result_clear(&ra);
}

static void test_bad_arguments(void)
{
    kv_compare_result r;
    kv_status st;
    run("full", NT - 1, &r, &st);
    KT_CHECK(st == KV_E_USAGE, "prefix leaving nothing accepted");
    kv_policy_params p[8];
    kv_policy_parse("full", m->cfg.n_layers, p);
    KT_CHECK(kv_compare_run(m, toks, 2, NULL, p, NULL, &r) == KV_E_USAGE, "2 tokens accepted");
}

int main(void)
{
    if (kv_model_synthetic("tiny", 7, KV_DT_F32, &m)) {
        printf("# synthetic tiny: %s\n", kv_errdetail());
        return 1;
    }
    kv_engine_set_threads(1); /* tiny matrices: threads only cost */
    unsigned long long s = 99;
    for (int i = 0; i < NT; i++) toks[i] = 1 + (int)(kt_rand(&s) * (m->cfg.vocab_size - 1));
    KT_RUN(test_identical_is_zero);
    KT_RUN(test_lossy_diverges);
    KT_RUN(test_bad_arguments);
    char gpu[256];
    if (kv_gpu_probe(gpu, sizeof gpu) > 0)
        KT_SKIP(test_auto_without_gpu_is_the_cpu_run, "a usable GPU is present");
    else
        KT_RUN(test_auto_without_gpu_is_the_cpu_run);
    kv_model_close(m);
    return kt_done();
}
