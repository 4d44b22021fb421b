/*
 * The GPU engine against the CPU engine: whole decodes of the real
 * stories260K and niah4k models through the GPU engine (lib/gpu) against
 * lib/engine/kv_engine.c, same tokens fed to both, logits compared per step
 * within fp16 tolerance, and the greedy ids compared wherever the CPU's
 * top-2 margin is clear of fp16 rounding; offload must equal full on the GPU; sparse (channel, exact,
 * sketch, resident, pages) must follow the CPU sparse policy closely, and
 * the sparse step's variants (overlapped, wide top-K, selection cache, two
 * layers ahead) must equal its serial path; quant, streaming and dsq
 * against the CPU engine's same policies; every PDL level the same ids.
 * The engine's kernels alone are test_gpu_engine_kernels.c; dumps, host
 * copies, byte layouts, non-finite and packed weights, biases, wide heads
 * and refused requests are test_gpu_engine_data.c.
 * Without a usable GPU (or in a CPU-only build) the GPU tests are reported
 * as skipped, and the one check that runs is that the engine refuses with
 * KV_E_UNAVAILABLE and a message.
 */
#include "gpu_engine_tests.h"

#ifdef KV_HAVE_CUDA
/* Where the kernel tests (test_gpu_engine_kernels.c), which ran first when
 * the two were one program, leave the random stream (0x51ed270b1f3c9a7d
 * advanced by their draws, replayed on the host): the prompts below are the
 * ones the bounds were measured on. */
static unsigned long long seed = 0xdcaf6f6895587251ULL;
#endif

static void test_engine_refuses_without_gpu(void)
{
    kv_model *m = NULL;
    OK(kv_model_synthetic("tiny", 1, KV_DT_F32, &m));
    kv_gpu_engine *g = NULL;
    kv_errclear();
    kv_status st = kv_gpu_engine_new(m, NULL, 64, NULL, &g);
    KT_CHECK(st == KV_E_UNAVAILABLE, "status %d (%s)", (int)st, kv_errdetail());
    KT_CHECK(g == NULL, "engine returned");
    KT_CHECK(strlen(kv_errdetail()) > 10, "message '%s'", kv_errdetail());
    kv_model_close(m);
}

#ifdef KV_HAVE_CUDA

// --- whole engine against the CPU engine ---------------------------------------------------

static void test_stories260k_full_matches_cpu(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    int prompt[1] = {1};
    kv_engine *cpu = NULL;
    kv_gpu_engine *gpu = NULL;
    OK(kv_engine_new(m, NULL, 256, &cpu));
    kv_status st = kv_gpu_engine_new(m, NULL, 256, NULL, &gpu);
    KT_CHECK(st == KV_OK, "gpu engine: %s", kv_errdetail());
    if (gpu) {
        cmp_result r;
        compare_engines(cpu, gpu, prompt, 1, short_run() ? 40 : 200, m->cfg.vocab_size, &r);
        printf("# stories260K full: %d steps, max logit error %.3g, argmax differences %d\n", r.steps,
               r.max_err, r.argmax_diff);
        KT_CHECK(r.steps == (short_run() ? 41 : 201), "%d steps", r.steps);
        KT_CHECK(r.max_err < 5e-3, "logits normalized error %g", r.max_err);
        KT_CHECK(r.argmax_diff == 0, "%d greedy tokens differ", r.argmax_diff);
        /* greedy generation on the device reproduces the reference ids */
        int ref[256], nref = 0;
        FILE *f = fopen(S260 "reference/greedy_bos_200.ids", "r");
        while (f && nref < 256 && fscanf(f, "%d", &ref[nref]) == 1) nref++;
        if (f) fclose(f);
        OK(kv_gpu_engine_reset(gpu, NULL));
        float *lg = malloc((size_t)m->cfg.vocab_size * 4);
        OK(kv_gpu_engine_prefill(gpu, ref, 1, lg));
        int out[200];
        OK(kv_gpu_engine_generate(gpu, kt_argmax(lg, m->cfg.vocab_size), 199, out, NULL));
        /* ids equal up to the first difference; fp16 rounding may flip a
         * near-tie late in a 200-token run, after which the texts differ */
        int same = ref[1] == kt_argmax(lg, m->cfg.vocab_size);
        for (int i = 0; same == i + 1 && i < 199 && i + 2 < nref; i++) same += out[i] == ref[i + 2];
        printf("# stories260K greedy on the GPU: the first %d of 200 ids equal the reference\n", same);
        KT_CHECK(nref == 201 && same >= 100, "only the first %d greedy ids match", same);
        free(lg);
    }
    kv_gpu_engine_free(gpu);
    kv_engine_free(cpu);
    kv_model_close(m);
}

/*
 * stories260K (head_dim 8: quant through the host-packed form and the fp16
 * expansion) with one policy on every layer against the CPU engine's
 * same policy, past the windows and groups the policy packs or evicts; the
 * GPU's byte accounting must equal the CPU policy's.
 */
static void run_stories_policy(const char *spec, double tol, int max_diff)
{
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    kv_policy_params *pp = calloc((size_t)m->cfg.n_layers, sizeof *pp);
    OK(kv_policy_parse(spec, m->cfg.n_layers, pp));
    for (int l = 0; l < m->cfg.n_layers; l++) pp[l].dtype = KV_DT_F16;
    int prompt[24];
    for (int i = 0; i < 24; i++) prompt[i] = i ? 30 + (int)(kt_rand(&seed) * 400) : 1;
    kv_engine *cpu = NULL;
    kv_gpu_engine *gpu = NULL;
    OK(kv_engine_new(m, pp, 256, &cpu));
    kv_status st = kv_gpu_engine_new(m, pp, 256, NULL, &gpu);
    KT_CHECK(st == KV_OK, "%s: %s", spec, kv_errdetail());
    if (gpu) {
        cmp_result r;
        compare_engines(cpu, gpu, prompt, 24, short_run() ? 60 : 150, m->cfg.vocab_size, &r);
        printf("# stories260K %s: %d steps, max logit error %.3g, argmax differences %d\n", spec,
               r.steps, r.max_err, r.argmax_diff);
        KT_CHECK(r.max_err < tol, "%s: logits normalized error %g", spec, r.max_err);
        KT_CHECK(r.argmax_diff <= max_diff, "%s: %d greedy tokens differ", spec, r.argmax_diff);
        kv_bytes bc, bg;
        kv_engine_bytes(cpu, &bc);
        kv_gpu_engine_bytes(gpu, &bg);
        KT_CHECK(bc.resident == bg.resident && bg.host == 0, "%s: resident bytes cpu %llu gpu %llu",
                 spec, (unsigned long long)bc.resident, (unsigned long long)bg.resident);
    }
    kv_gpu_engine_free(gpu);
    kv_engine_free(cpu);
    free(pp);
    kv_model_close(m);
}

static void test_stories260k_streaming_matches_cpu(void)
{
    run_stories_policy("*=streaming:sink=4,window=32", 5e-3, 0);
}

static void test_stories260k_quant_matches_cpu(void)
{
    /* 2 and 4 bits, groups packed during the prompt and during decode.  The
     * codes are the CPU's given the same fp16 K/V (the host packs them), but
     * the engines' K/V differ by fp16 rounding, and at head_dim 8 a group's
     * min/max moving by one ulp can flip a code worth a third of the range:
     * measured 0.025 / 0.017 on an H200 (niah4k at head_dim 64: 0.006), so
     * the bound is looser than full's and one near-tie flip is allowed. */
    run_stories_policy("*=quant:bits=2,group=16,residual=16", 5e-2, 1);
    run_stories_policy("0=full;*=quant:bits=4,group=32,residual=8", 5e-2, 1);
}

/* KL(p || q) of two logit vectors, in double. */
static double kl_logits(const float *p, const float *q, int n)
{
    double mp = p[kt_argmax(p, n)], mq = q[kt_argmax(q, n)], zp = 0, zq = 0, kl = 0;
    for (int i = 0; i < n; i++) {
        zp += exp((double)p[i] - mp);
        zq += exp((double)q[i] - mq);
    }
    for (int i = 0; i < n; i++) {
        double lp = (double)p[i] - mp - log(zp), lq = (double)q[i] - mq - log(zq);
        kl += exp(lp) * (lp - lq);
    }
    return kl > 0 ? kl : 0;
}

static void test_stories260k_dsq_matches_cpu(void)
{
    /* salient=0: every packed token is a 2-bit code, so the packing does not
     * depend on importance; windows of 16 pack at ingest and during decode,
     * and the GPU must track the CPU as quant does.  Its bound is quant's
     * doubled: DSQ's keys are deltas from a window base, one more fp16
     * rounding that can move a 2-bit code at head_dim 8; once moved, that
     * window's error stays for the rest of the run.  Over random prompts an
     * H200 measured 0.065 with 1 greedy token apart, and 0.144 with 3
     * (2026-12-01); a packing bug gives errors near 1 and most tokens
     * apart (this path packs on the host with the CPU policy's code and
     * expands with eng_dsq_expand; test_cuda_kernels checks the separate
     * device packer, kv_cuda_dsq_pack) */
    run_stories_policy("*=dsq:window=16,salient=0,bits=2", 2e-1, 4);
    /* the default's layout: 4-bit keys, 2-bit values (each plane its own
     * row bytes on the device); not run on a GPU when written (session 6) */
    run_stories_policy("*=dsq:window=16,salient=0", 2e-1, 4);

    /* With salient tokens the choice ranks accumulated attention, and an
     * fp16-level difference can swap two near-tied tokens; that window's
     * noise then differs from the CPU's for the rest of the run.  So compare
     * what the issue asks for, the policy's fidelity against full on each
     * engine: KL and top-1 agreement over the same teacher-forced tokens,
     * next to the CPU engine's own f32-vs-f16 spread. */
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    const int L = m->cfg.n_layers, V = m->cfg.vocab_size, n0 = 24, steps = short_run() ? 60 : 200;
    kv_policy_params *pd = calloc((size_t)L, sizeof *pd), *pf = calloc((size_t)L, sizeof *pf);
    OK(kv_policy_parse("*=dsq:window=16,salient=0.2,bits=2", L, pd));
    OK(kv_policy_parse("*=full:dtype=f16", L, pf));
    int prompt[24];
    kv_engine *cf = NULL, *cd = NULL;
    kv_gpu_engine *gf = NULL, *gd = NULL;
    OK(kv_engine_new(m, pf, 256, &cf));
    OK(kv_engine_new(m, pd, 256, &cd));
    OK(kv_gpu_engine_new(m, NULL, 256, NULL, &gf));
    kv_status st = kv_gpu_engine_new(m, pd, 256, NULL, &gd);
    KT_CHECK(st == KV_OK, "dsq on the GPU: %s", kv_errdetail());
    float *l[4];
    for (int i = 0; i < 4; i++) l[i] = malloc((size_t)V * 4);
    const int runs = short_run() ? 1 : 4;
    double klc = 0, klg = 0;
    int agc = 0, agg = 0;
    for (int run = 0; gd && run < runs; run++) {
        for (int i = 0; i < n0; i++) prompt[i] = i ? 30 + (int)(kt_rand(&seed) * 400) : 1;
        OK(kv_engine_reset(cf, NULL));
        OK(kv_engine_reset(cd, NULL));
        OK(kv_gpu_engine_reset(gf, NULL));
        OK(kv_gpu_engine_reset(gd, NULL));
        OK(kv_engine_prefill(cf, prompt, n0, l[0]));
        OK(kv_engine_prefill(cd, prompt, n0, l[1]));
        OK(kv_gpu_engine_prefill(gf, prompt, n0, l[2]));
        OK(kv_gpu_engine_prefill(gd, prompt, n0, l[3]));
        double kc = 0, kg = 0;
        for (int i = 0; i < steps; i++) {
            int tok = kt_argmax(l[0], V);
            OK(kv_engine_step(cf, tok, l[0]));
            OK(kv_engine_step(cd, tok, l[1]));
            OK(kv_gpu_engine_step(gf, tok, l[2]));
            OK(kv_gpu_engine_step(gd, tok, l[3]));
            kc += kl_logits(l[0], l[1], V);
            kg += kl_logits(l[2], l[3], V);
            agc += kt_argmax(l[0], V) == kt_argmax(l[1], V);
            agg += kt_argmax(l[2], V) == kt_argmax(l[3], V);
        }
        printf("# stories260K dsq w=16 vs full, prompt %d: CPU KL %.4f, GPU KL %.4f\n", run,
               kc / steps, kg / steps);
        klc += kc;
        klg += kg;
    }
    if (gd) {
        const int ns = runs * steps;
        klc /= ns;
        klg /= ns;
        printf("# stories260K dsq w=16 vs full, %d steps: CPU KL %.4f top-1 %.3f, GPU KL %.4f top-1 %.3f\n",
               ns, klc, (double)agc / ns, klg, (double)agg / ns);
        KT_CHECK(fabs(klg - klc) <= 0.25 * klc + 0.02, "KL vs full: GPU %.4f, CPU %.4f", klg, klc);
        KT_CHECK(abs(agg - agc) <= ns / 10, "top-1 vs full: GPU %d, CPU %d of %d", agg, agc, ns);
        kv_bytes bc, bg;
        kv_engine_bytes(cd, &bc);
        kv_gpu_engine_bytes(gd, &bg);
        KT_CHECK(bc.resident == bg.resident, "resident bytes cpu %llu gpu %llu",
                 (unsigned long long)bc.resident, (unsigned long long)bg.resident);
    }
    for (int i = 0; i < 4; i++) free(l[i]);
    kv_gpu_engine_free(gd);
    kv_gpu_engine_free(gf);
    kv_engine_free(cd);
    kv_engine_free(cf);
    free(pf);
    free(pd);
    kv_model_close(m);
}

static void test_offload_equals_full_on_gpu(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    kv_gpu_engine *a = NULL, *b = NULL;
    OK(kv_gpu_engine_new(m, NULL, 128, &o, &a));
    kv_policy_params off[64];
    for (int l = 0; l < m->cfg.n_layers; l++) {
        kv_policy_params_default(&off[l], KV_POL_FULL);
        off[l].offload = true;
    }
    kv_status st = kv_gpu_engine_new(m, off, 128, &o, &b);
    KT_CHECK(st == KV_OK, "%s", kv_errdetail());
    int prompt[5] = {1, 200, 300, 17, 42};
    int oa[40], ob[40];
    if (b) {
        float lg[512];
        OK(kv_gpu_engine_prefill(a, prompt, 5, lg));
        OK(kv_gpu_engine_prefill(b, prompt, 5, lg));
        OK(kv_gpu_engine_generate(a, kt_argmax(lg, 512), 40, oa, NULL));
        OK(kv_gpu_engine_generate(b, kt_argmax(lg, 512), 40, ob, NULL));
        KT_CHECK(!memcmp(oa, ob, sizeof oa), "offload and full generate different ids");
        kv_bytes bb;
        kv_gpu_engine_bytes(b, &bb);
        uint64_t expect = (uint64_t)m->cfg.n_layers * 2 * m->cfg.n_kv_heads * 45 * m->cfg.head_dim * 2;
        KT_CHECK(bb.host == expect && bb.resident == 0, "offload bytes host %llu resident %llu",
                 (unsigned long long)bb.host, (unsigned long long)bb.resident);
        KT_CHECK(bb.fetched_last == (uint64_t)m->cfg.n_layers * 2 * m->cfg.n_kv_heads * 44 * m->cfg.head_dim * 2,
                 "offload fetched %llu", (unsigned long long)bb.fetched_last);
    }
    kv_gpu_engine_free(b);
    kv_gpu_engine_free(a);
    kv_model_close(m);
}

/* Programmatic dependent launch only overlaps launches: every level
 * generates the same ids (engines built one after the other, since the
 * level is the process's); level 3 is refused below. */
static void test_pdl_levels_generate_the_same_ids(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    int prompt[5] = {1, 200, 300, 17, 42}, ids[3][40];
    for (int lvl = 0; lvl < 3; lvl++) {
        kv_gpu_engine_opts o;
        kv_gpu_engine_opts_default(&o);
        o.pdl = lvl;
        kv_gpu_engine *g = NULL;
        OK(kv_gpu_engine_new(m, NULL, 128, &o, &g));
        float lg[512];
        OK(kv_gpu_engine_prefill(g, prompt, 5, lg));
        OK(kv_gpu_engine_generate(g, kt_argmax(lg, 512), 40, ids[lvl], NULL));
        kv_gpu_engine_free(g);
    }
    KT_CHECK(!memcmp(ids[0], ids[1], sizeof ids[0]) && !memcmp(ids[0], ids[2], sizeof ids[0]),
             "PDL levels 0, 1, 2 generate different ids");
    kv_model_close(m);
}

/* niah4k (head_dim 64) with full and sparse layers
 * against the CPU engine's same policies (niah_classic: select=resident with
 * the former kernels, opts.sel_classic). */
static bool niah_classic;
static void run_niah(const char *spec, kv_select_mode sel, double tol, int max_diff)
{
    kv_model *m = NULL;
    OK(kv_model_open(NIAH "niah4k.bin", &m));
    const int n = short_run() ? 160 : 600, V = m->cfg.vocab_size;
    int *prompt = malloc(n * sizeof(int));
    prompt[0] = 1;
    for (int i = 1; i < n; i++) prompt[i] = 3 + 32 + (int)(kt_rand(&seed) * 90); /* printable bytes */
    kv_policy_params *pp = calloc((size_t)m->cfg.n_layers, sizeof *pp);
    OK(kv_policy_parse(spec, m->cfg.n_layers, pp));
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    o.sel_classic = niah_classic;
    kv_engine *cpu = NULL;
    kv_gpu_engine *gpu = NULL;
    /* the CPU reference keeps its sparse prompt copy in fp16, as the GPU does */
    for (int l = 0; l < m->cfg.n_layers; l++) pp[l].dtype = KV_DT_F16;
    OK(kv_engine_new(m, pp, n + 40, &cpu));
    /* the sketch is a GPU selection: the CPU reference selects by its channels */
    if (sel == KV_SELECT_SKETCH) kv_policy_set_select(pp, m->cfg.n_layers, sel);
    kv_status st = kv_gpu_engine_new(m, pp, n + 40, &o, &gpu);
    KT_CHECK(st == KV_OK, "%s", kv_errdetail());
    if (gpu) {
        cmp_result r;
        compare_engines(cpu, gpu, prompt, n, short_run() ? 8 : 30, V, &r);
        printf("# niah4k %s%s%s: %d steps, max logit error %.3g, argmax differences %d\n", spec,
               sel == KV_SELECT_SKETCH ? " (sketch)" : "", niah_classic ? " (classic kernels)" : "", r.steps,
               r.max_err, r.argmax_diff);
        KT_CHECK(r.max_err < tol, "%s: logits normalized error %g", spec, r.max_err);
        KT_CHECK(r.argmax_diff <= max_diff, "%s: %d greedy tokens differ", spec, r.argmax_diff);
    }
    kv_gpu_engine_free(gpu);
    kv_engine_free(cpu);
    free(pp);
    free(prompt);
    kv_model_close(m);
}

static void test_niah4k_full_matches_cpu(void) { run_niah("full", KV_SELECT_CHANNELS, 5e-3, 0); }

static void test_niah4k_sparse_matches_cpu(void)
{
    /* Selection can flip near-ties under fp16 rounding, and the channel
     * approximation makes near-ties common: one token swapped in the top-K
     * moves the logits by a few percent (measured 2.6e-2 and 5.8e-2 on two
     * builds whose CPU attention summed in double and in float), so the
     * channel path gets a looser logit bound; greedy tokens must still agree.
     * The exact-selection path below keeps the tight one. */
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,channels=16", KV_SELECT_CHANNELS, 1e-1, 1);
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,select=exact", KV_SELECT_CHANNELS, 5e-2, 1);
}

/* The resident selections (rows of the pool channels chosen at ingest from
 * the prompt's last queries, fp16 and 4-bit codes; page bounds) against the
 * CPU engine's same policies: as the channel path, a swapped near-tie in
 * the top-K moves the logits by a few percent, so the same loose bound. */
static void test_niah4k_resident_and_pages_match_cpu(void)
{
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,channels=16,select=resident", KV_SELECT_RESIDENT,
             1e-1, 1);
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,channels=8,pool=32,cbits=4,select=resident",
             KV_SELECT_RESIDENT, 1e-1, 1);
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,page=16,select=pages", KV_SELECT_PAGES, 1e-1, 1);
    /* the former kernels on fresh prompts of the same kind, for comparison */
    niah_classic = true;
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,channels=16,select=resident", KV_SELECT_RESIDENT,
             1e-1, 1);
    run_niah("0=full;*=sparse:k=64,sink=8,window=32,channels=8,pool=32,cbits=4,select=resident",
             KV_SELECT_RESIDENT, 1e-1, 1);
    niah_classic = false;
}

/*
 * The sparse step's ways to run (opts.sel_serial, topk_wide, sel_cache)
 * against the serial path, which runs the predicted query's selection and
 * gather on the main stream where they are issued: the overlapped path
 * (side streams ordered by events) and the wide top-K must give the same
 * logits bit for bit (the same kernels on the same inputs: a difference is a
 * race or a wrong id); the selection cache attends the same rows in another
 * order, so within float rounding, with the same greedy tokens, and it must
 * hit (tokens chosen again) and read fewer host bytes.  Also the cache
 * switched on between steps (kv_gpu_engine_set_step_opts: its tags start
 * from the buffer's content).  niah4k, the default resident hybrid.  The
 * former resident kernels (classic) within float rounding, the same greedy
 * tokens; two layers ahead (ahead2) bit for bit against its own serial path.
 */
typedef struct {
    const char *name;
    bool serial, wide, cache, switch_on, classic;
    int ahead;
    int sel_kernels; /* opts.sel_kernels (0: the default) */
} step_variant;

static void run_step_variant(kv_model *m, const kv_policy_params *pp, const int *prompt, int n,
                             int steps, const step_variant *v, float *logits, int *ids,
                             kv_gpu_timing *t, uint64_t *fetched)
{
    const int V = m->cfg.vocab_size;
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    o.sel_serial = v->serial;
    o.topk_wide = v->wide;
    o.sel_cache = v->cache && !v->switch_on;
    o.sel_classic = v->classic;
    o.sel_ahead = v->ahead;
    o.sel_kernels = v->sel_kernels;
    o.profile = true;
    kv_gpu_engine *g = NULL;
    kv_status st = kv_gpu_engine_new(m, pp, n + steps + 8, &o, &g);
    KT_CHECK(st == KV_OK, "%s: %s", v->name, kv_errdetail());
    memset(t, 0, sizeof *t);
    *fetched = 0;
    if (!g) return;
    OK(kv_gpu_engine_prefill(g, prompt, n, logits));
    /* every variant is fed the serial path's tokens (ids, filled by the first) */
    for (int i = 0; i < steps; i++) {
        if (v->switch_on && i == 3) OK(kv_gpu_engine_set_step_opts(g, v->serial, v->wide, true, true));
        int tok = v->serial ? kt_argmax(logits + (size_t)i * V, V) : ids[i];
        if (v->serial) ids[i] = tok;
        OK(kv_gpu_engine_step(g, tok, logits + (size_t)(i + 1) * V));
        kv_bytes b;
        kv_gpu_engine_bytes(g, &b);
        *fetched += b.fetched_last;
    }
    kv_gpu_engine_timing(g, t);
    kv_gpu_engine_free(g);
}

static void test_sparse_step_variants_match_the_serial_path(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(NIAH "niah4k.bin", &m));
    const int n = short_run() ? 200 : 700, steps = short_run() ? 6 : 24, V = m->cfg.vocab_size;
    int *prompt = malloc(n * sizeof(int)), ids[32];
    prompt[0] = 1;
    for (int i = 1; i < n; i++) prompt[i] = 3 + 32 + (int)(kt_rand(&seed) * 90);
    kv_policy_params *pp = calloc((size_t)m->cfg.n_layers, sizeof *pp);
    OK(kv_policy_parse("0=full;*=sparse:frac=0.03,sink=8,window=32,select=resident", m->cfg.n_layers, pp));
    for (int l = 0; l < m->cfg.n_layers; l++) pp[l].dtype = KV_DT_F16;
    const step_variant vs[] = {
        {"serial", true, false, false, false, false, 0, 0},      {"base", false, false, false, false, false, 0, 0},
        {"wide", false, true, false, false, false, 0, 0},        {"serial+wide", true, true, false, false, false, 0, 0},
        {"cache", false, false, true, false, false, 0, 0},       {"wide+cache", false, true, true, false, false, 0, 0},
        {"serial+cache", true, false, true, false, false, 0, 0}, {"cache switched on", false, false, true, true, false, 0, 0},
        {"classic", false, false, false, false, true, 0, 0},
        /* the chain's kernels every way (the default is late+collect): the same ids */
        {"early+hist", false, false, false, false, false, 0, KV_GPU_SELK_SET},
        {"nopdl+collect", false, false, false, false, false, 0, KV_GPU_SELK_SET | KV_GPU_SELK_NOPDL | KV_GPU_SELK_COLLECT},
        {"late+direct", false, false, false, false, false, 0, KV_GPU_SELK_SET | KV_GPU_SELK_LATE | KV_GPU_SELK_DIRECT},
        {"early+direct", false, false, false, false, false, 0, KV_GPU_SELK_SET | KV_GPU_SELK_DIRECT},
        /* last: serial+ahead2 becomes the reference of what follows */
        {"serial+ahead2", true, false, false, false, false, 2, 0},
        {"ahead2", false, false, false, false, false, 2, 0},
    };
    const size_t nl = (size_t)(steps + 1) * V;
    float *ref = malloc(nl * sizeof(float)), *lg = malloc(nl * sizeof(float));
    uint64_t fetched_ref = 0;
    for (size_t i = 0; i < sizeof vs / sizeof vs[0]; i++) {
        kv_gpu_timing t;
        uint64_t fetched = 0;
        const bool is_ref = !i || (vs[i].serial && vs[i].ahead); /* ahead2's own serial path */
        run_step_variant(m, pp, prompt, n, steps, &vs[i], is_ref ? ref : lg, ids, &t, &fetched);
        if (is_ref) {
            fetched_ref = fetched;
            continue;
        }
        double err = 0;
        int diff = 0, loose = 0; /* steps beyond 1e-3 */
        char trace[512] = "";
        size_t tl = 0;
        for (int s = 1; s <= steps; s++) {
            double e = nerr_f(lg + (size_t)s * V, ref + (size_t)s * V, (size_t)V);
            if (e > err) err = e;
            loose += e > 1e-3;
            if (tl < sizeof trace - 16) tl += (size_t)snprintf(trace + tl, sizeof trace - tl, " %.1e", e);
            diff += kt_argmax(lg + (size_t)s * V, V) != kt_argmax(ref + (size_t)s * V, V);
        }
        if (vs[i].cache) printf("#   %s: error per step%s\n", vs[i].name, trace);
        printf("# step %-18s %d steps: max logit error %.3g against serial, argmax differences %d, "
               "host bytes %llu (serial %llu), cache hits %llu of %llu\n", vs[i].name, steps, err, diff,
               (unsigned long long)fetched, (unsigned long long)fetched_ref,
               (unsigned long long)t.cache_hits, (unsigned long long)t.cache_rows);
        if (vs[i].classic) {
            KT_CHECK(err < 1e-2 && diff == 0, "%s: logits error %g, %d greedy tokens differ", vs[i].name, err,
                     diff);
        } else if (!vs[i].cache) {
            KT_CHECK(err == 0, "%s: logits differ from the serial path (%g)", vs[i].name, err);
        } else {
            /* the cache attends the same rows in another order, so its
             * residual stream drifts from serial's by float rounding (1e-5 to
             * 1.3e-4 a step on the H200), and a predicted query that moves by
             * that much can swap a near-tie of the top-K for a few steps: on
             * one prompt (session 7) steps 17-19 reached 2e-3..3.9e-3 and
             * fell back to 1e-5 after, in every cache variant alike.  A row
             * held wrongly would stay wrong, or be wrong on every prompt
             * (five earlier prompts: 1.3e-4 at most): at most 3 of the
             * steps past 1e-3, none past 1e-2. */
            KT_CHECK(err < 1e-2 && loose * 8 <= steps, "%s: logits normalized error %g against the serial path, "
                     "%d of %d steps beyond 1e-3", vs[i].name, err, loose, steps);
            KT_CHECK(diff == 0, "%s: %d greedy tokens differ", vs[i].name, diff);
            KT_CHECK(t.cache_rows > 0 && t.cache_hits > 0, "%s: no cache hits (%llu rows)", vs[i].name,
                     (unsigned long long)t.cache_rows);
            KT_CHECK(fetched < fetched_ref, "%s: %llu host bytes, serial %llu", vs[i].name,
                     (unsigned long long)fetched, (unsigned long long)fetched_ref);
        }
    }
    free(ref);
    free(lg);
    free(pp);
    free(prompt);
    kv_model_close(m);
}

static void test_niah4k_sketch_runs_close_to_full(void)
{
    /* the sketch is a different selector: compare with full, loosely */
    run_niah("0=full;*=sparse:k=256,sink=8,window=64", KV_SELECT_SKETCH, 0.5, 30);
}

static void test_niah4k_quant_matches_cpu(void)
{
    /* head_dim 64: outside the packed-attention kernel, the fp16 expansion */
    run_niah("*=quant:bits=2,group=32,residual=32", KV_SELECT_CHANNELS, 1e-2, 0);
}

static void test_niah4k_streaming_matches_cpu(void)
{
    run_niah("*=streaming:sink=8,window=64", KV_SELECT_CHANNELS, 5e-3, 0);
}

static void test_niah4k_dsq_matches_cpu(void)
{
    run_niah("0=full;*=dsq:salient=0.2,bits=2", KV_SELECT_CHANNELS, 5e-2, 1);
    /* the default: 4-bit keys, 2-bit values at head_dim 64 (not run on a
     * GPU when written, session 6) */
    run_niah("0=full;*=dsq", KV_SELECT_CHANNELS, 5e-2, 1);
}

#endif /* KV_HAVE_CUDA */

int main(void)
{
    if (!gpu_tests_start()) {
        KT_RUN(test_engine_refuses_without_gpu);
        const char *why = "no usable GPU";
        KT_SKIP(test_stories260k_full_matches_cpu, why);
        KT_SKIP(test_stories260k_streaming_matches_cpu, why);
        KT_SKIP(test_stories260k_quant_matches_cpu, why);
        KT_SKIP(test_stories260k_dsq_matches_cpu, why);
        KT_SKIP(test_offload_equals_full_on_gpu, why);
        KT_SKIP(test_pdl_levels_generate_the_same_ids, why);
        KT_SKIP(test_niah4k_full_matches_cpu, why);
        KT_SKIP(test_niah4k_sparse_matches_cpu, why);
        KT_SKIP(test_niah4k_resident_and_pages_match_cpu, why);
        KT_SKIP(test_sparse_step_variants_match_the_serial_path, why);
        KT_SKIP(test_niah4k_sketch_runs_close_to_full, why);
        KT_SKIP(test_niah4k_quant_matches_cpu, why);
        KT_SKIP(test_niah4k_streaming_matches_cpu, why);
        KT_SKIP(test_niah4k_dsq_matches_cpu, why);
        return kt_done();
    }
#ifdef KV_HAVE_CUDA
    const char *filter = getenv("KV_TEST_FILTER");
    RUN_ONE(test_stories260k_full_matches_cpu);
    RUN_ONE(test_stories260k_streaming_matches_cpu);
    RUN_ONE(test_stories260k_quant_matches_cpu);
    RUN_ONE(test_stories260k_dsq_matches_cpu);
    RUN_ONE(test_offload_equals_full_on_gpu);
    RUN_ONE(test_pdl_levels_generate_the_same_ids);
    RUN_ONE(test_niah4k_full_matches_cpu);
    RUN_ONE(test_niah4k_sparse_matches_cpu);
    RUN_ONE(test_niah4k_resident_and_pages_match_cpu);
    RUN_ONE(test_sparse_step_variants_match_the_serial_path);
    RUN_ONE(test_niah4k_sketch_runs_close_to_full);
    RUN_ONE(test_niah4k_quant_matches_cpu);
    RUN_ONE(test_niah4k_streaming_matches_cpu);
    RUN_ONE(test_niah4k_dsq_matches_cpu);
#endif
    return kt_done();
}
