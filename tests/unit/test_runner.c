/*
 * Unit tests of lib/kv_runner on the CPU: a runner is the engine it wraps,
 * so its logits, positions and bytes must equal a kv_engine's bit for bit
 * under every policy (stories260K, prefill then greedy steps, then a reset
 * to another policy).  Also: device names, and KV_DEVICE_CUDA without a
 * usable GPU being KV_E_UNAVAILABLE while AUTO falls back to the CPU.
 * The GPU side of the runner is the GPU engine, tested in test_gpu_engine*.c.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "kt_kv.h"
#include "common/kv_gemv.h"
#include "engine/kv_engine.h"
#include "gpu/kv_gpu.h"
#include "engine/kv_runner.h"

#define S260 "tests/data/stories260K/"
#define NPROMPT 12
#define NSTEP 6

static kv_model *m;
static int prompt[NPROMPT];
static bool have_gpu;


static void test_device_parse(void)
{
    const char *good[] = {"cpu", "cuda", "auto"};
    const kv_device want[] = {KV_DEVICE_CPU, KV_DEVICE_CUDA, KV_DEVICE_AUTO};
    for (int i = 0; i < 3; i++) {
        kv_device d = (kv_device)-1;
        KT_CHECK(kv_device_parse(good[i], &d, NULL) == KV_OK && d == want[i], "%s -> %d", good[i], (int)d);
        KT_CHECK(!strcmp(kv_device_name(want[i]), good[i]), "name of %d: %s", (int)want[i],
                 kv_device_name(want[i]));
    }
    const char *bad[] = {"", "gpu", "CPU", "cuda0", "auto "};
    for (int i = 0; i < 5; i++) {
        kv_device d = KV_DEVICE_CPU;
        KT_CHECK(kv_device_parse(bad[i], &d, NULL) == KV_E_USAGE, "'%s' accepted", bad[i]);
        KT_CHECK(strstr(kv_errdetail(), "cpu, cuda or auto") && !strchr(kv_errdetail(), '\n'),
                 "message: %s", kv_errdetail());
        KT_CHECK(d == KV_DEVICE_CPU, "'%s' wrote the output", bad[i]);
    }
}

/* The packed GEMV variants: every name parses back to its number, the
 * packed-only form refuses "default", and a bad name lists the choices. */
static void test_gemv_variant_names(void)
{
    for (int v = 0; v < KV_GEMV_COUNT; v++) {
        int got = -1;
        KT_CHECK(kv_gemv_variant_parse(kv_gemv_variant_name(v), false, &got) == KV_OK && got == v, "%d -> %s -> %d",
                 v, kv_gemv_variant_name(v), got);
    }
    KT_CHECK(!strcmp(kv_gemv_variant_name(KV_GEMV_DP4A), "dp4a") && !kv_gemv_variant_name(KV_GEMV_COUNT) &&
                 !kv_gemv_variant_name(-1),
             "names and their bounds");
    int v = 7;
    kv_errclear();
    KT_CHECK(kv_gemv_variant_parse("fast", false, &v) == KV_E_USAGE && v == 7 &&
                 !strcmp(kv_errdetail(), "'fast' is not default, old, rows or dp4a"),
             "bad name: %s", kv_errdetail());
    kv_errclear();
    KT_CHECK(kv_gemv_variant_parse("default", true, &v) == KV_E_USAGE && v == 7 &&
                 !strcmp(kv_errdetail(), "'default' is not old, rows or dp4a"),
             "packed only: %s", kv_errdetail());
    KT_CHECK(!strcmp(KV_GEMV_NAMES_HELP, " default old rows dp4a"), "help list: '%s'", KV_GEMV_NAMES_HELP);
}

/* Prefill the prompt, then NSTEP greedy steps, on both; every logit and
 * the bytes equal exactly. */
static void lockstep(kv_engine *e, kv_runner *r, const char *what)
{
    const int V = m->cfg.vocab_size;
    float *le = malloc((size_t)V * sizeof(float)), *lr = malloc((size_t)V * sizeof(float));
    KT_REQUIRE(le && lr, "oom");
    kv_status se = kv_engine_prefill(e, prompt, NPROMPT, le);
    kv_status sr = kv_runner_prefill(r, prompt, NPROMPT, lr);
    KT_CHECK(se == KV_OK && sr == KV_OK, "%s prefill: %d %d", what, (int)se, (int)sr);
    KT_CHECK(!memcmp(le, lr, (size_t)V * sizeof(float)), "%s: prefill logits differ", what);
    for (int s = 0; s < NSTEP && se == KV_OK && sr == KV_OK; s++) {
        int tok = kt_argmax(le, V);
        se = kv_engine_step(e, tok, le);
        sr = kv_runner_step(r, tok, lr);
        KT_CHECK(se == KV_OK && sr == KV_OK, "%s step %d: %d %d", what, s, (int)se, (int)sr);
        KT_CHECK(!memcmp(le, lr, (size_t)V * sizeof(float)), "%s: step %d logits differ", what, s);
        KT_CHECK(kv_engine_pos(e) == kv_runner_pos(r), "%s: pos %d vs %d", what, kv_engine_pos(e),
                 kv_runner_pos(r));
    }
    KT_CHECK(kv_runner_pos(r) == NPROMPT + NSTEP, "%s: pos %d", what, kv_runner_pos(r));
    kv_bytes be, br;
    memset(&be, 0xa5, sizeof be); /* padding too: both sides must write every field */
    memset(&br, 0x5a, sizeof br);
    kv_engine_bytes(e, &be);
    kv_runner_bytes(r, &br);
    KT_CHECK(be.resident == br.resident && be.host == br.host && be.fetched_total == br.fetched_total &&
                 be.fetched_last == br.fetched_last && be.attends == br.attends && be.disk == br.disk,
             "%s: bytes differ (resident %llu vs %llu)", what, (unsigned long long)be.resident,
             (unsigned long long)br.resident);
    KT_CHECK(br.resident > 0, "%s: no resident bytes counted", what);
    free(lr);
    free(le);
}

static void test_cpu_runner_is_the_engine(void)
{
    const char *specs[] = {"full", "quant:bits=2,residual=4,group=8", "sparse:k=2,s=1,w=2",
                           "streaming:sink=2,window=4"};
    const int L = m->cfg.n_layers, n = (int)(sizeof specs / sizeof *specs);
    kv_policy_params *p = calloc((size_t)L * (size_t)n, sizeof *p);
    KT_REQUIRE(p, "oom");
    for (int i = 0; i < n; i++) OK(kv_policy_parse(specs[i], L, p + (size_t)i * (size_t)L));
    for (int i = 0; i < n; i++) {
        kv_engine *e = NULL;
        kv_runner *r = NULL;
        const kv_policy_params *pi = p + (size_t)i * (size_t)L;
        kv_status se = kv_engine_new(m, pi, 64, &e);
        kv_status sr = kv_runner_new(m, pi, 64, KV_DEVICE_CPU, NULL, &r);
        KT_CHECK(se == KV_OK && sr == KV_OK, "%s: new %d %d: %s", specs[i], (int)se, (int)sr, kv_errdetail());
        if (se == KV_OK && sr == KV_OK) {
            KT_CHECK(!kv_runner_is_gpu(r) && !strcmp(kv_runner_device(r), "cpu"), "device %s",
                     kv_runner_device(r));
            KT_CHECK(kv_runner_model(r) == m, "model");
            KT_CHECK(kv_runner_ctx(r) == 64 && kv_runner_vocab(r) == kv_engine_vocab(e) &&
                         kv_runner_pos(r) == 0,
                     "ctx %d vocab %d pos %d", kv_runner_ctx(r), kv_runner_vocab(r), kv_runner_pos(r));
            lockstep(e, r, specs[i]);
            /* reset to the next policy (and NULL: keep) on both */
            const kv_policy_params *pn = p + (size_t)((i + 1) % n) * (size_t)L;
            se = kv_engine_reset(e, pn);
            sr = kv_runner_reset(r, pn);
            KT_CHECK(se == KV_OK && sr == KV_OK && kv_runner_pos(r) == 0, "%s: reset", specs[i]);
            lockstep(e, r, specs[(i + 1) % n]);
            se = kv_engine_reset(e, NULL);
            sr = kv_runner_reset(r, NULL);
            KT_CHECK(se == KV_OK && sr == KV_OK, "%s: reset NULL", specs[i]);
            lockstep(e, r, specs[(i + 1) % n]);
        }
        kv_runner_free(r);
        kv_engine_free(e);
    }
    free(p);
}

static void test_ctx_zero_is_the_models(void)
{
    kv_runner *r = NULL;
    OK(kv_runner_new(m, NULL, 0, KV_DEVICE_CPU, NULL, &r));
    KT_CHECK(kv_runner_ctx(r) == m->cfg.seq_len, "ctx %d, seq_len %d", kv_runner_ctx(r), m->cfg.seq_len);
    /* a step past the context is refused, as the engine refuses it */
    kv_runner_free(r);
    OK(kv_runner_new(m, NULL, 2, KV_DEVICE_CPU, NULL, &r));
    KT_CHECK(kv_runner_step(r, 1, NULL) == KV_OK && kv_runner_step(r, 2, NULL) == KV_OK, "steps");
    KT_CHECK(kv_runner_step(r, 3, NULL) == KV_E_USAGE, "step past the context accepted");
    kv_runner_free(r);
    kv_runner_free(NULL);
}

static void test_cuda_without_gpu_is_unavailable(void)
{
    kv_runner *r = (kv_runner *)&r; /* must be cleared on failure */
    kv_status st = kv_runner_new(m, NULL, 64, KV_DEVICE_CUDA, NULL, &r);
    KT_CHECK(st == KV_E_UNAVAILABLE, "status %d: %s", (int)st, kv_errdetail());
    KT_CHECK(r == NULL, "runner left set");
    KT_CHECK(kv_errdetail()[0] && !strchr(kv_errdetail(), '\n'), "reason: '%s'", kv_errdetail());
    /* AUTO falls back to the CPU engine, which then is the CPU runner */
    OK(kv_runner_new(m, NULL, 64, KV_DEVICE_AUTO, NULL, &r));
    KT_CHECK(!kv_runner_is_gpu(r) && !strcmp(kv_runner_device(r), "cpu"), "auto: %s", kv_runner_device(r));
    kv_engine *e = NULL;
    if (kv_engine_new(m, NULL, 64, &e) == KV_OK) lockstep(e, r, "auto");
    kv_engine_free(e);
    kv_runner_free(r);
}

static void test_bad_device_is_usage(void)
{
    kv_runner *r = NULL;
    KT_CHECK(kv_runner_new(m, NULL, 64, (kv_device)7, NULL, &r) == KV_E_USAGE && !r, "device 7 accepted");
}

/* Greedy generation through the runner is prefill + argmax + steps by
 * hand; teacher-forced scoring sees the same logits; the report carries
 * what was generated. */
static void test_generate_score_report(void)
{
    kv_runner *r;
    OK(kv_runner_new(m, NULL, 64, KV_DEVICE_CPU, NULL, &r));
    const int V = m->cfg.vocab_size;
    float *lg = malloc((size_t)V * sizeof *lg);
    int want[NSTEP];
    OK(kv_runner_prefill(r, prompt, NPROMPT, lg));
    for (int i = 0; i < NSTEP; i++) {
        want[i] = kt_argmax(lg, V);
        if (i + 1 < NSTEP) OK(kv_runner_step(r, want[i], lg));
    }
    OK(kv_runner_reset(r, NULL));
    OK(kv_runner_prefill(r, prompt, NPROMPT, lg));
    kv_sampler smp;
    OK(kv_sampler_init(&smp, V, 0.0f, 0.9f, 1));
    kv_generate_opts go = {NSTEP, {-1, -1}, NULL, NULL, NULL};
    kv_generation g;
    OK(kv_runner_generate(r, &smp, lg, &go, &g));
    KT_CHECK(g.n_gen == NSTEP && g.n_steps == NSTEP - 1 && g.end == KV_GEN_STEPS, "gen %d steps %d end %d",
             g.n_gen, g.n_steps, (int)g.end);
    KT_CHECK(!memcmp(g.tokens, want, sizeof want), "generated ids differ from prefill + argmax + steps");
    kv_run_info info = {NPROMPT, 1.0, &g, "text", NULL, NULL, NULL};
    char *json = NULL;
    OK(kv_runner_report(r, &info, &json));
    cJSON *j = cJSON_Parse(json);
    const cJSON *ids = cJSON_GetObjectItem(j, "generated_ids");
    KT_CHECK(cJSON_GetArraySize(ids) == NSTEP && cJSON_GetArrayItem(ids, 1)->valueint == want[1], "ids");
    KT_CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "text")), "text") &&
                 !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "stop")), "steps"), "text, stop");
    KT_CHECK(cJSON_GetObjectItem(j, "decode_steps")->valueint == NSTEP - 1, "steps");
    cJSON_Delete(j);
    free(json);
    kv_generation_clear(&g);
    /* a stop token ends generation before it is emitted */
    OK(kv_runner_reset(r, NULL));
    OK(kv_runner_prefill(r, prompt, NPROMPT, lg));
    go.stop[0] = want[2];
    OK(kv_runner_generate(r, &smp, lg, &go, &g));
    KT_CHECK(g.n_gen == 2 && g.end == KV_GEN_STOP_TOKEN, "stop: gen %d end %d", g.n_gen, (int)g.end);
    kv_generation_clear(&g);
    /* scoring: nll of token i is -log softmax of the logits before it */
    int seq[NPROMPT + 1];
    memcpy(seq, prompt, sizeof prompt);
    seq[NPROMPT] = want[0];
    double nll[NPROMPT];
    OK(kv_runner_score(r, seq, NPROMPT + 1, nll));
    OK(kv_runner_reset(r, NULL));
    OK(kv_runner_prefill(r, prompt, NPROMPT, lg));
    KT_CHECK(fabs(nll[NPROMPT - 1] - kv_nll(lg, V, want[0])) < 1e-5, "nll %g vs %g", nll[NPROMPT - 1],
             kv_nll(lg, V, want[0]));
    KT_CHECK(kv_runner_score(r, seq, 1, nll) == KV_E_DATA, "one token scored");
    kv_sampler_clear(&smp);
    free(lg);
    kv_runner_free(r);
}

/* --ctx must hold the prompt and n - 1 steps; without it the context grows. */
static void test_run_ctx(void)
{
    int ctx;
    bool grown;
    OK(kv_run_ctx(0, 512, 10, 20, &ctx, &grown));
    KT_CHECK(ctx == 512 && !grown, "model's: %d", ctx);
    OK(kv_run_ctx(0, 512, 500, 20, &ctx, &grown));
    KT_CHECK(ctx == 520 && grown, "grown: %d", ctx);
    OK(kv_run_ctx(29, 512, 10, 20, &ctx, &grown));
    KT_CHECK(ctx == 29 && !grown, "exact fit: %d", ctx);
    KT_CHECK(kv_run_ctx(28, 512, 10, 20, &ctx, &grown) == KV_E_USAGE, "-n past --ctx accepted");
    KT_CHECK(kv_run_ctx(9, 512, 10, 0, &ctx, &grown) == KV_E_USAGE, "prompt past --ctx accepted");
    OK(kv_run_ctx(10, 512, 10, 0, &ctx, &grown));
}

/* Dumps need the CPU engine's prompt K/V; the per-layer view follows the
 * policies given. */
static void test_layers_and_keep(void)
{
    kv_policy_params pp[8];
    KT_REQUIRE(m->cfg.n_layers <= 8, "layers");
    OK(kv_policy_parse("0=quant:bits=2;*=full", m->cfg.n_layers, pp));
    kv_runner *r;
    OK(kv_runner_new(m, pp, 64, KV_DEVICE_CPU, NULL, &r));
    KT_CHECK(kv_runner_n_layers(r) == m->cfg.n_layers && kv_runner_params(r, 0)->kind == KV_POL_QUANT &&
                 kv_runner_params(r, 1)->kind == KV_POL_FULL, "params");
    OK(kv_runner_keep(r, 4, true));
    OK(kv_runner_prefill(r, prompt, NPROMPT, NULL));
    kv_bytes b;
    kv_runner_layer_bytes(r, 1, &b);
    KT_CHECK(kv_runner_layer_tokens(r, 1) == NPROMPT &&
                 b.resident == 2ull * m->cfg.n_kv_heads * NPROMPT * m->cfg.head_dim * 4, "layer 1 bytes %llu",
             (unsigned long long)b.resident);
    KT_CHECK(!strcmp(kv_runner_fallback(r), ""), "no fallback on the CPU");
    kv_runner_free(r);
}

int main(void)
{
    char name[256];
    have_gpu = kv_gpu_probe(name, sizeof name) > 0;
    if (kv_model_open(S260 "stories260K.bin", &m)) {
        printf("# stories260K: %s\n", kv_errdetail());
        return 1;
    }
    kv_engine_set_threads(1); /* tiny matrices; and one order of sums in both */
    unsigned long long s = 17;
    prompt[0] = 1;
    for (int i = 1; i < NPROMPT; i++) prompt[i] = 2 + (int)(kt_rand(&s) * (m->cfg.vocab_size - 2));
    KT_RUN(test_device_parse);
    KT_RUN(test_gemv_variant_names);
    KT_RUN(test_cpu_runner_is_the_engine);
    KT_RUN(test_ctx_zero_is_the_models);
    KT_RUN(test_bad_device_is_usage);
    KT_RUN(test_generate_score_report);
    KT_RUN(test_run_ctx);
    KT_RUN(test_layers_and_keep);
    if (have_gpu) KT_SKIP(test_cuda_without_gpu_is_unavailable, "a usable GPU is present");
    else KT_RUN(test_cuda_without_gpu_is_unavailable);
    kv_model_close(m);
    return kt_done();
}
