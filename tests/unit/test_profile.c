/*
 * Unit tests of kv_profile (scores and errors on constructed caches with
 * known answers, classification) and kv_deploy (strict parsing of the
 * deployment config, application to per-layer policy parameters).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt.h"
#include "policy/kv_deploy.h"
#include "eval/kv_profile.h"
#include "quant/kv_quant.h"

#define KT_OK(call)                                                              \
    do {                                                                         \
        kv_status st_ = (call);                                                  \
        KT_REQUIRE(st_ == KV_OK, "%s: %s", #call, kv_errdetail());               \
    } while (0)

static unsigned long long seed = 0xfeedfacecafebeefULL;

enum { L = 2, NH = 2, H = 1, T = 200, D = 16, NQ = 4 };

/* Layer 0: zero queries (uniform attention).  Layer 1: each query is 60
 * times one key, keys nearly orthogonal unit vectors (one-hot attention). */
static kvc_file *constructed_cache(char *path)
{
    static float k[L][H * T * D], v[L][H * T * D], q[L][NH * NQ * D];
    for (int l = 0; l < L; l++) {
        for (int i = 0; i < H * T * D; i++) v[l][i] = kt_randn(&seed);
        for (int t = 0; t < T; t++) {
            double n2 = 0;
            for (int c = 0; c < D; c++) n2 += pow(k[l][t * D + c] = kt_randn(&seed), 2);
            for (int c = 0; c < D; c++) k[l][t * D + c] /= (float)sqrt(n2);
        }
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < NQ; j++)
                for (int c = 0; c < D; c++)
                    q[l][(h * NQ + j) * D + c] = l == 0 ? 0.0f : 60.0f * k[l][(17 + 5 * j) * D + c];
    }
    kvc_writer *w;
    if (kvc_writer_new(&w)) return NULL;
    char name[32];
    for (int l = 0; l < L; l++) {
        const int64_t kv[3] = {H, T, D}, qs[3] = {NH, NQ, D};
        snprintf(name, sizeof name, "layers.%d.k", l);
        kvc_writer_add(w, name, KV_DT_F32, 3, kv, k[l]);
        snprintf(name, sizeof name, "layers.%d.v", l);
        kvc_writer_add(w, name, KV_DT_F32, 3, kv, v[l]);
        snprintf(name, sizeof name, "layers.%d.q", l);
        kvc_writer_add(w, name, KV_DT_F32, 3, qs, q[l]);
    }
    strcpy(path, "/tmp/kvtest_profile_XXXXXX");
    int fd = mkstemp(path);
    if (fd >= 0) close(fd);
    kvc_file *f = NULL;
    if (fd < 0 || kvc_writer_write(w, path, 0) || kvc_open(path, &f)) f = NULL;
    kvc_writer_free(w);
    return f;
}

static void test_scores_on_uniform_and_one_hot_attention(void)
{
    char path[64];
    kvc_file *f = constructed_cache(path);
    KT_REQUIRE(f, "cache: %s", kv_errdetail());
    kv_profile_params p;
    kv_profile_params_default(&p);
    p.quant.residual = 0;
    p.quant.group = 16;
    p.sparse.topk = 16;
    p.sparse.sink = 2;
    p.sparse.window = 2;
    kv_profile a;
    memset(&a, 0, sizeof a);
    KT_OK(kv_profile_add(&a, f, &p));
    KT_OK(kv_profile_add(&a, f, &p)); /* two "documents": same means */
    kv_profile_finish(&a);
    KT_CHECK(a.n_layers == 2 && a.n_heads == 2 && a.n_q == NQ, "geometry");
    /* uniform: query j sees n = T-NQ+j+1 keys, top ceil(0.05 n) of them */
    double want = 0;
    for (int j = 0; j < NQ; j++) {
        int n = T - NQ + j + 1;
        want += 1.0 - ceil(0.05 * n) / n;
    }
    want /= NQ;
    KT_NEAR(a.layer_score[0], want, 1e-5);
    KT_CHECK(a.layer_score[1] < 0.02, "one-hot score %g", a.layer_score[1]);
    /* one-hot attention: the top-K approximation finds the one key */
    const double *sp = a.layer_err[KV_OPT_SPARSE], *q1 = a.layer_err[KV_OPT_Q1],
                 *q2 = a.layer_err[KV_OPT_Q2], *q4 = a.layer_err[KV_OPT_Q4];
    KT_CHECK(sp[1] < 0.02, "one-hot sparse error %g", sp[1]);
    /* uniform attention over 200 tokens with 20 kept: large error */
    KT_CHECK(sp[0] > 0.3, "uniform sparse error %g", sp[0]);
    KT_CHECK(q4[0] < q2[0] && q2[0] < q1[0], "4-bit %g, 2-bit %g, 1-bit %g not in order", q4[0],
             q2[0], q1[0]);
    KT_CHECK(a.layer_err[KV_OPT_FULL][0] == 0 && a.bytes[KV_OPT_FULL][0] == 2.0 * H * T * D * 2,
             "full: no error, fp16 bytes");
    KT_CHECK(a.bytes[KV_OPT_Q1][0] < a.bytes[KV_OPT_Q2][0] && a.bytes[KV_OPT_Q2][0] < a.bytes[KV_OPT_Q4][0] &&
                 a.bytes[KV_OPT_Q4][0] < a.bytes[KV_OPT_FULL][0],
             "quant bytes grow with the bits");
    /* the tau rule: uniform attention is quantized, one-hot is sparse */
    p.rule = KV_RULE_TAU;
    p.quant.bits = 2;
    kv_deploy d;
    kv_profile_choice c;
    KT_OK(kv_profile_deploy(&a, &p, &d, &c));
    KT_CHECK(d.version == 2 && d.per_layer[0].kind == KV_POL_QUANT && d.per_layer[0].bits == 2 &&
                 d.per_layer[1].kind == KV_POL_SPARSE && c.opt[0] == KV_OPT_Q2,
             "tau classification");
    /* the JSON output parses back as the same deploy config */
    char *buf = NULL;
    size_t len = 0;
    FILE *mf = open_memstream(&buf, &len);
    kv_profile_write_json(&a, &p, &d, &c, mf);
    fclose(mf);
    kv_deploy back;
    KT_OK(kv_deploy_parse(buf, len, 2, &back));
    KT_CHECK(back.per_layer && back.per_layer[1].kind == KV_POL_SPARSE && back.per_layer[1].topk == 16 &&
                 back.per_layer[1].sink == 2 && back.per_layer[0].bits == 2 && !strcmp(back.rule, "tau"),
             "round trip");
    kv_deploy_clear(&back);
    free(buf);
    kv_deploy_clear(&d);
    kv_profile_choice_clear(&c);
    /* the budget rule: a budget of full's bytes keeps every layer full, a
     * small one gives the one-hot layer sparse */
    p.rule = KV_RULE_BUDGET;
    p.kv_budget = 1.0;
    KT_OK(kv_profile_deploy(&a, &p, &d, &c));
    KT_CHECK(c.budget_met && c.opt[0] == KV_OPT_FULL && c.opt[1] == KV_OPT_FULL, "budget 1: full");
    kv_deploy_clear(&d);
    kv_profile_choice_clear(&c);
    /* every budget: the choice fits and no pair of options that fits has
     * less error (brute force over the 6 x 6 choices) */
    for (int bi = 1; bi <= 20; bi++) {
        p.kv_budget = bi / 20.0;
        KT_OK(kv_profile_deploy(&a, &p, &d, &c));
        double best = INFINITY, got = a.layer_err[c.opt[0]][0] + a.layer_err[c.opt[1]][1];
        for (int o0 = 0; o0 < KV_OPT_COUNT; o0++)
            for (int o1 = 0; o1 < KV_OPT_COUNT; o1++) {
                double b = a.bytes[o0][0] + a.bytes[o1][1], e = a.layer_err[o0][0] + a.layer_err[o1][1];
                /* the solver rounds each layer's bytes up to 1/1000 of its full bytes */
                if (isfinite(e) && b <= p.kv_budget * c.full_bytes - 2 * 0.001 * a.bytes[KV_OPT_FULL][0] && e < best)
                    best = e;
            }
        KT_CHECK(!c.budget_met || c.bytes <= p.kv_budget * c.full_bytes + 1e-6, "budget %g: %g bytes of %g",
                 p.kv_budget, c.bytes, c.full_bytes);
        KT_CHECK(!isfinite(best) || got <= best + 1e-12, "budget %g: error %g, %g possible (%s, %s)",
                 p.kv_budget, got, best, kv_profile_opt_name(c.opt[0]), kv_profile_opt_name(c.opt[1]));
        kv_deploy_clear(&d);
        kv_profile_choice_clear(&c);
    }
    kv_profile_clear(&a);
    kvc_close(f);
    unlink(path);
}

/* The cheaper variants a byte budget needs: each costs fewer bytes than the
 * option it varies, and --choices leaves the others unmeasured and unchosen. */
static void test_budget_variants_and_choices(void)
{
    char path[64];
    kvc_file *f = constructed_cache(path);
    KT_REQUIRE(f, "cache: %s", kv_errdetail());
    kv_profile_params p;
    kv_profile_params_default(&p);
    p.quant.group = 32;
    p.quant.residual = 64;
    kv_profile a;
    memset(&a, 0, sizeof a);
    KT_OK(kv_profile_add(&a, f, &p));
    kv_profile_finish(&a);
    const double *b[KV_OPT_COUNT];
    for (int o = 0; o < KV_OPT_COUNT; o++) b[o] = a.bytes[o];
    KT_CHECK(b[KV_OPT_Q2_R0][0] < b[KV_OPT_Q2][0] && b[KV_OPT_Q4_R0][0] < b[KV_OPT_Q4][0] &&
                 b[KV_OPT_Q2_R32G32][0] < b[KV_OPT_Q2][0],
             "residual 0 / 32 costs fewer bytes: %g < %g, %g < %g, %g", b[KV_OPT_Q2_R0][0], b[KV_OPT_Q2][0],
             b[KV_OPT_Q4_R0][0], b[KV_OPT_Q4][0], b[KV_OPT_Q2_R32G32][0]);
    /* 200 tokens, residual 0: group 128 quantizes 128 and keeps 72 in fp16,
     * group 32 (the option's base) quantizes 192 */
    KT_CHECK(b[KV_OPT_Q4_R0G128][0] > b[KV_OPT_Q4_R0][0], "group 128 keeps more tokens in fp16");
    KT_CHECK(b[KV_OPT_DSQ_S10][0] < b[KV_OPT_DSQ][0], "2-bit keys, fewer bytes");
    /* on uniform attention (layer 0) the fp16 window of recent tokens is
     * what 2-bit loses without: more error at residual 0 */
    KT_CHECK(a.layer_err[KV_OPT_Q2_R0][0] >= a.layer_err[KV_OPT_Q2][0],
             "2-bit residual 0 error %g below residual 64's %g", a.layer_err[KV_OPT_Q2_R0][0],
             a.layer_err[KV_OPT_Q2][0]);
    /* deployed as what it was measured as */
    p.kv_budget = 0.2;
    kv_deploy d;
    kv_profile_choice c;
    KT_OK(kv_profile_deploy(&a, &p, &d, &c));
    for (int l = 0; l < L; l++) {
        kv_profile_opt o = c.opt[l];
        const kv_policy_params *x = &d.per_layer[l];
        if (o == KV_OPT_Q2_R0 || o == KV_OPT_Q4_R0 || o == KV_OPT_Q4_R0G128)
            KT_CHECK(x->kind == KV_POL_QUANT && x->residual == 0 &&
                         x->group == (o == KV_OPT_Q4_R0G128 ? 128 : 32) && x->bits == (o == KV_OPT_Q2_R0 ? 2 : 4),
                     "layer %d: %s deployed as bits %d group %d residual %d", l, kv_profile_opt_name(o), x->bits,
                     x->group, x->residual);
        if (o == KV_OPT_DSQ_S10)
            KT_CHECK(x->kind == KV_POL_DSQ && x->dsq_salient == 0.1 && x->dsq_kbits == 2 && x->dsq_vbits == 2,
                     "dsq-s10");
    }
    kv_deploy_clear(&d);
    kv_profile_choice_clear(&c);
    kv_profile_clear(&a);

    /* --choices: the options G2's profile had; the new ones are NaN and never chosen */
    unsigned m = 0;
    KT_OK(kv_profile_choices_parse("quant2,quant4,dsq", &m));
    KT_CHECK(m == (1u << KV_OPT_FULL | 1u << KV_OPT_Q2 | 1u << KV_OPT_Q4 | 1u << KV_OPT_DSQ), "mask %#x", m);
    p.choices = m;
    memset(&a, 0, sizeof a);
    KT_OK(kv_profile_add(&a, f, &p));
    kv_profile_finish(&a);
    KT_CHECK(isnan(a.layer_err[KV_OPT_Q2_R0][0]) && isnan(a.bytes[KV_OPT_Q1][1]) &&
                 isfinite(a.layer_err[KV_OPT_Q4][1]),
             "unasked options unmeasured");
    for (int bi = 1; bi <= 10; bi++) {
        p.kv_budget = bi / 10.0;
        KT_OK(kv_profile_deploy(&a, &p, &d, &c));
        for (int l = 0; l < L; l++)
            KT_CHECK(m & (1u << c.opt[l]), "budget %g: layer %d got %s", p.kv_budget, l, kv_profile_opt_name(c.opt[l]));
        kv_deploy_clear(&d);
        kv_profile_choice_clear(&c);
    }
    kv_profile_clear(&a);
    KT_OK(kv_profile_choices_parse("all", &m));
    KT_CHECK(m == KV_PROFILE_ALL_CHOICES, "all");
    KT_OK(kv_profile_choices_parse("dsq-s10", &m));
    KT_CHECK(m == (1u << KV_OPT_FULL | 1u << KV_OPT_DSQ_S10), "full is always measured");
    KT_CHECK(kv_profile_choices_parse("quant3", &m) == KV_E_USAGE && strstr(kv_errdetail(), "quant3"),
             "unknown name");
    KT_CHECK(kv_profile_choices_parse("quant2,", &m) == KV_E_USAGE, "trailing comma");
    KT_CHECK(kv_profile_choices_parse("", &m) == KV_E_USAGE, "empty");
    KT_CHECK(kv_profile_choices_parse("quant2,,dsq", &m) == KV_E_USAGE, "empty name");
    kvc_close(f);
    unlink(path);
}

static void test_profile_needs_queries(void)
{
    char path[64] = "/tmp/kvtest_noq_XXXXXX";
    int fd = mkstemp(path);
    KT_REQUIRE(fd >= 0, "mkstemp");
    close(fd);
    static float k[2 * 10 * 8];
    kvc_writer *w;
    KT_OK(kvc_writer_new(&w));
    const int64_t s[3] = {2, 10, 8};
    kvc_writer_add(w, "layers.0.k", KV_DT_F32, 3, s, k);
    kvc_writer_add(w, "layers.0.v", KV_DT_F32, 3, s, k);
    kv_status st = kvc_writer_write(w, path, 0);
    kvc_writer_free(w);
    KT_REQUIRE(st == KV_OK, "write: %s", kv_errdetail());
    kvc_file *f;
    KT_OK(kvc_open(path, &f));
    kv_profile_params p;
    kv_profile_params_default(&p);
    kv_profile a;
    memset(&a, 0, sizeof a);
    KT_CHECK(kv_profile_add(&a, f, &p) == KV_E_DATA, "no queries accepted");
    kv_profile_clear(&a);
    kvc_close(f);
    unlink(path);
}

static void test_attention_error_of_identical_cache_is_zero(void)
{
    float q[2 * 3 * 8], k[1 * 10 * 8], v[1 * 10 * 8], k2[80];
    for (int i = 0; i < 48; i++) q[i] = kt_randn(&seed);
    for (int i = 0; i < 80; i++) k[i] = kt_randn(&seed), v[i] = kt_randn(&seed);
    double ph[2];
    KT_CHECK(kv_attn_rel_error(q, 2, 3, k, v, k, v, 1, 10, 8, ph) == 0, "identical");
    memcpy(k2, k, sizeof k2);
    k2[9 * 8] += 3;
    KT_CHECK(kv_attn_rel_error(q, 2, 3, k, v, k2, v, 1, 10, 8, ph) > 0 && ph[0] > 0, "changed key");
}

static const char *good = "{\"deploy\": {\"version\": 1, \"n_layers\": 4, \"quant_layers\": [0, 2],"
                          " \"sparse_layers\": [3], \"bits\": 2, \"group\": 32, \"residual\": 64,"
                          " \"budget\": 0.1, \"channels\": 4, \"sink\": 4, \"window\": 28}}";

static void test_deploy_parse_and_apply(void)
{
    kv_deploy d;
    KT_OK(kv_deploy_parse(good, strlen(good), 4, &d));
    KT_CHECK(d.n_quant == 2 && d.n_sparse == 1 && d.quant.bits == 2 && d.sparse.topk == 0 &&
                 fabs(d.sparse.topk_frac - 0.1) < 1e-12, "fields");
    kv_policy_params pl[4];
    kv_deploy_apply(&d, 4, pl);
    KT_CHECK(pl[0].kind == KV_POL_QUANT && pl[0].bits == 2 && pl[0].group == 32 && pl[0].residual == 64,
             "layer 0");
    KT_CHECK(pl[1].kind == KV_POL_FULL, "layer 1 full");
    KT_CHECK(pl[3].kind == KV_POL_SPARSE && pl[3].channels == 4 && pl[3].topk == 0 &&
                 fabs(pl[3].topk_frac - 0.1) < 1e-12 && pl[3].sink == 4 && pl[3].window == 28,
             "layer 3");
    bool m[4];
    kv_deploy_quant_mask(&d, 4, m);
    KT_CHECK(m[0] && !m[1] && m[2] && !m[3], "mask");
    kv_deploy_clear(&d);
}

static void test_deploy_rejects_bad_configs(void)
{
    const char *bad[] = {
        "{",                                                  /* not JSON */
        "[1, 2]",                                             /* not an object */
        "{\"quant_layers\": [0]}",                            /* missing list */
        "{\"quant_layers\": [0], \"sparse_layers\": \"1\"}",  /* wrong type */
        "{\"quant_layers\": [0, 9], \"sparse_layers\": []}",  /* out of range */
        "{\"quant_layers\": [-1], \"sparse_layers\": []}",
        "{\"quant_layers\": [1.5], \"sparse_layers\": []}",
        "{\"quant_layers\": [1], \"sparse_layers\": [1]}",    /* both */
        "{\"quant_layers\": [1, 1], \"sparse_layers\": []}",  /* twice */
        "{\"quant_layers\": [], \"sparse_layers\": [], \"bits\": 3}",
        "{\"quant_layers\": [], \"sparse_layers\": [], \"bits\": \"1\"}",
        "{\"quant_layers\": [], \"sparse_layers\": [], \"budget\": -2}",
        "{\"quant_layers\": [], \"sparse_layers\": [], \"method\": \"gptq\"}",
        "{\"quant_layers\": [], \"sparse_layers\": [], \"bitz\": 1}", /* typo */
        "{\"quant_layers\": [], \"sparse_layers\": [], \"n_layers\": 7}", /* model has 4 */
        "{\"quant_layers\": [], \"sparse_layers\": [], \"version\": 2}",
        "{\"deploy\": 5}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_deploy d;
        kv_errclear();
        kv_status st = kv_deploy_parse(bad[i], strlen(bad[i]), 4, &d);
        KT_CHECK(st == KV_E_DATA && kv_errdetail()[0], "accepted %s", bad[i]);
        KT_CHECK(d.quant_layers == NULL && d.sparse_layers == NULL, "lists freed for %s", bad[i]);
    }
    kv_policy_params pl[4];
    KT_CHECK(kv_deploy_load("/nonexistent/p.json", 4, pl) == KV_E_NOINPUT, "missing file");
}

/* Version 2: every layer's own spec; layers not listed are full; front-end
 * defaults still apply; the writer's output parses back to the same params. */
static void test_deploy_v2(void)
{
    const char *v2 = "{\"version\": 2, \"n_layers\": 4, \"rule\": \"budget\", \"kv_budget\": 0.25, "
                     "\"layers\": [{\"layer\": 0, \"policy\": \"quant:bits=4,group=32\", \"error\": 0.01}, "
                     "{\"layer\": 2, \"policy\": \"dsq:base=salient,salient=0.5\"}, "
                     "{\"layer\": 3, \"policy\": \"sparse:k=16,select=pages,page=8,dtype=f16\", \"bytes\": 12}]}";
    kv_deploy d;
    KT_OK(kv_deploy_parse(v2, strlen(v2), 4, &d));
    kv_policy_params pl[4];
    kv_deploy_apply(&d, 4, pl);
    KT_CHECK(pl[0].kind == KV_POL_QUANT && pl[0].bits == 4 && pl[0].group == 32, "layer 0");
    KT_CHECK(pl[1].kind == KV_POL_FULL, "layer 1 full");
    KT_CHECK(pl[2].kind == KV_POL_DSQ && pl[2].dsq_base == KV_DSQ_BASE_SALIENT && pl[2].dsq_salient == 0.5,
             "layer 2");
    /* version 2 was written before dsq's 4/2-bit default: no bits named is 2/2 */
    KT_CHECK(pl[2].dsq_kbits == 2 && pl[2].dsq_vbits == 2, "v2 dsq bits %d/%d", pl[2].dsq_kbits, pl[2].dsq_vbits);
    KT_CHECK(pl[3].kind == KV_POL_SPARSE && pl[3].select == KV_SELECT_PAGES && pl[3].page == 8, "layer 3");
    bool m[4];
    kv_deploy_quant_mask(&d, 4, m);
    KT_CHECK(m[0] && !m[1] && m[2] && !m[3], "mask");
    kv_policy_defaults def = {.given = KV_KEY_DTYPE | KV_KEY_SELECT, .dtype = KV_DT_BF16, .select = KV_SELECT_EXACT};
    kv_policy_defaults_apply(&def, pl, 4);
    KT_CHECK(pl[3].dtype == KV_DT_BF16 && pl[3].select == KV_SELECT_EXACT, "front-end defaults apply");
    /* write, parse back */
    char *buf = NULL;
    size_t len = 0;
    FILE *mf = open_memstream(&buf, &len);
    kv_deploy_write_json(&d, mf, 0);
    fclose(mf);
    kv_deploy back;
    KT_OK(kv_deploy_parse(buf, len, 4, &back));
    for (int l = 0; l < 4; l++) {
        kv_policy_params a = d.per_layer[l], b = back.per_layer[l];
        a.given = b.given = 0;
        KT_CHECK(!memcmp(&a, &b, sizeof a), "layer %d round trip", l);
    }
    KT_CHECK(!strcmp(back.rule, "budget") && back.kv_budget == 0.25, "informative members");
    KT_CHECK(back.version == KV_DEPLOY_VERSION && strstr(buf, "\"version\": 3"), "written as version 3");
    kv_deploy_clear(&back);
    free(buf);
    kv_deploy_clear(&d);
    /* what each version means by a dsq layer that names no bits or salient */
    const char *vs[] = {
        "{\"version\": 2, \"n_layers\": 1, \"layers\": [{\"layer\": 0, \"policy\": \"dsq\"}]}",
        "{\"version\": 3, \"n_layers\": 1, \"layers\": [{\"layer\": 0, \"policy\": \"dsq\"}]}",
        "{\"version\": 2, \"n_layers\": 1, \"layers\": [{\"layer\": 0, \"policy\": \"dsq:vbits=4,salient=0.3\"}]}",
        "{\"method\": \"dsq\", \"quant_layers\": [0], \"sparse_layers\": []}",
        "{\"method\": \"dsq\", \"quant_layers\": [0], \"sparse_layers\": [], \"bits\": 4, \"group\": 16}",
    };
    const int want[][3] = {{2, 2, 20}, {4, 2, 10}, {4, 4, 30}, {2, 2, 20}, {4, 4, 20}};
    const int wgroup[] = {32, 32, 32, 32, 16};
    for (size_t i = 0; i < sizeof vs / sizeof vs[0]; i++) {
        kv_deploy dv;
        KT_OK(kv_deploy_parse(vs[i], strlen(vs[i]), 1, &dv));
        kv_policy_params q;
        kv_deploy_apply(&dv, 1, &q);
        KT_CHECK(q.kind == KV_POL_DSQ && q.dsq_kbits == want[i][0] && q.dsq_vbits == want[i][1] &&
                     (int)lround(q.dsq_salient * 100) == want[i][2] && q.dsq_group == wgroup[i],
                 "%s: kbits %d vbits %d salient %g group %d", vs[i], q.dsq_kbits, q.dsq_vbits, q.dsq_salient,
                 q.dsq_group);
        kv_deploy_clear(&dv);
    }
    /* every kind's spec_write round-trips through the parser */
    const char *specs[] = {"full:dtype=bf16", "quant:bits=2,g=32,r=16", "sparse:frac=0.015,s=4,w=8,cbits=8",
                           "streaming:s=2,w=9", "dsq:w=32,salient=0.3,keep=0.5,chan=0.01",
                           "dsq:kbits=1,vbits=4,g=16"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        kv_policy_params a, b;
        char sp[512];
        KT_OK(kv_policy_parse(specs[i], 1, &a));
        KT_OK(kv_policy_spec_write(&a, sp, sizeof sp));
        KT_OK(kv_policy_parse(sp, 1, &b));
        a.given = b.given = 0;
        KT_CHECK(!memcmp(&a, &b, sizeof a), "%s -> %s", specs[i], sp);
    }
    /* fractions in their shortest exact form, not 17 digits */
    {
        kv_policy_params a, b;
        char sp[512];
        KT_OK(kv_policy_parse("dsq:salient=0.1,keep=0.7", 1, &a));
        KT_OK(kv_policy_spec_write(&a, sp, sizeof sp));
        KT_CHECK(strstr(sp, "salient=0.1,") && strstr(sp, "keep=0.7") && !strstr(sp, "0000"), "%s", sp);
        KT_OK(kv_policy_parse("sparse:frac=0.03", 1, &a));
        KT_OK(kv_policy_spec_write(&a, sp, sizeof sp));
        KT_CHECK(strstr(sp, "frac=0.03,"), "%s", sp);
        a.dsq_salient = 1.0 / 3.0, a.kind = KV_POL_DSQ;
        KT_OK(kv_policy_spec_write(&a, sp, sizeof sp));
        KT_OK(kv_policy_parse(sp, 1, &b));
        KT_CHECK(b.dsq_salient == 1.0 / 3.0, "1/3 written as %s reads back %.17g", sp, b.dsq_salient);
    }
    const char *bad[] = {
        "{\"version\": 2, \"layers\": []}", /* no n_layers */
        "{\"version\": 2, \"n_layers\": 4}", /* no layers */
        "{\"version\": 2, \"n_layers\": 5, \"layers\": []}", /* model has 4 */
        "{\"version\": 2, \"n_layers\": 4, \"layers\": [{\"layer\": 4, \"policy\": \"full\"}]}",
        "{\"version\": 2, \"n_layers\": 4, \"layers\": [{\"layer\": 1, \"policy\": \"full\"}, {\"layer\": 1, \"policy\": \"dsq\"}]}",
        "{\"version\": 2, \"n_layers\": 4, \"layers\": [{\"layer\": 1, \"policy\": \"0=full\"}]}",
        "{\"version\": 2, \"n_layers\": 4, \"layers\": [{\"layer\": 1, \"policy\": \"quant:bits=3\"}]}",
        "{\"version\": 2, \"n_layers\": 4, \"layers\": [{\"layer\": 1, \"policy\": 7}]}",
        "{\"version\": 2, \"n_layers\": 4, \"layers\": [{\"layer\": 1}]}",
        "{\"version\": 2, \"n_layers\": 4, \"layers\": [{\"layer\": 1, \"policy\": \"full\", \"extra\": 1}]}",
        "{\"version\": 2, \"n_layers\": 4, \"layers\": [{\"layer\": 1, \"policy\": \"full\", \"error\": \"x\"}]}",
        "{\"version\": 2, \"n_layers\": 4, \"layers\": [], \"quant_layers\": []}",
        "{\"version\": 4, \"n_layers\": 4, \"layers\": []}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_errclear();
        kv_status st = kv_deploy_parse(bad[i], strlen(bad[i]), 4, &d);
        KT_CHECK(st == KV_E_DATA && kv_errdetail()[0], "accepted %s", bad[i]);
        KT_CHECK(d.per_layer == NULL, "per_layer freed for %s", bad[i]);
    }
}

static void test_layer_list(void)
{
    bool s[8];
    KT_OK(kv_layer_list_parse("0,2,5-7", 8, s));
    KT_CHECK(s[0] && !s[1] && s[2] && !s[3] && !s[4] && s[5] && s[6] && s[7], "set");
    KT_CHECK(kv_layer_list_parse("8", 8, s) == KV_E_USAGE, "out of range");
    KT_CHECK(kv_layer_list_parse("3-1", 8, s) == KV_E_USAGE, "reversed");
    KT_CHECK(kv_layer_list_parse("1,,2", 8, s) == KV_E_USAGE, "empty item");
    KT_CHECK(kv_layer_list_parse("x", 8, s) == KV_E_USAGE, "letters");
    KT_OK(kv_layer_list_parse("all", 8, s));
    KT_CHECK(s[0] && s[7], "all");
}

int main(void)
{
    KT_RUN(test_scores_on_uniform_and_one_hot_attention);
    KT_RUN(test_budget_variants_and_choices);
    KT_RUN(test_profile_needs_queries);
    KT_RUN(test_attention_error_of_identical_cache_is_zero);
    KT_RUN(test_deploy_parse_and_apply);
    KT_RUN(test_deploy_rejects_bad_configs);
    KT_RUN(test_layer_list);
    KT_RUN(test_deploy_v2);
    return kt_done();
}
