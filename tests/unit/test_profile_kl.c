/*
 * Unit tests of kv-profile's budget choice by the error that decides
 * (lib/eval/kv_profile_kl.c): the KL measured through the model equals
 * kv_compare's KL of the same policy (the way kv-bench fidelity runs it),
 * the budget rule picks sparse when its measured error is the lowest that
 * fits (and not when the attention error decides), and a sparse layer's
 * bytes are what stays resident (GPU), not its host copy.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt.h"
#include "engine/kv_engine.h"
#include "eval/kv_compare.h"
#include "eval/kv_profile.h"
#include "policy/kv_select.h"

#define KT_OK(call)                                                              \
    do {                                                                         \
        kv_status st_ = (call);                                                  \
        KT_REQUIRE(st_ == KV_OK, "%s: %s", #call, kv_errdetail());               \
    } while (0)

#define S260 "tests/data/stories260K/"

/* A table of L layers by hand: full 1000 bytes a layer, every option not
 * set not measured (NaN). */
static void table(kv_profile *a, int L)
{
    memset(a, 0, sizeof *a);
    a->n_layers = L;
    a->n_heads = a->n_kv_heads = 1;
    a->head_dim = 8;
    a->n_docs = -1; /* finished */
    for (int o = 0; o < KV_OPT_COUNT; o++) {
        a->err[o] = calloc((size_t)L, sizeof(double));
        a->layer_err[o] = calloc((size_t)L, sizeof(double));
        a->bytes[o] = calloc((size_t)L, sizeof(double));
        a->kl[o] = calloc((size_t)L, sizeof(double));
        for (int l = 0; l < L; l++)
            a->layer_err[o][l] = a->bytes[o][l] = a->kl[o][l] = o == KV_OPT_FULL ? 0.0 : NAN;
    }
    a->score = calloc((size_t)L, sizeof(double));
    a->layer_score = calloc((size_t)L, sizeof(double));
    for (int l = 0; l < L; l++) a->bytes[KV_OPT_FULL][l] = 1000;
}

static void set(kv_profile *a, int l, kv_profile_opt o, double bytes, double attn, double kl)
{
    a->bytes[o][l] = bytes;
    a->layer_err[o][l] = attn;
    a->kl[o][l] = kl;
}

static void test_budget_picks_sparse_when_its_measured_error_is_lowest(void)
{
    /* three layers; at a quarter of full's bytes every layer can take 4-bit
     * only if one of them goes sparse (3 x 300 > 750; 2 x 300 + 100 fits).
     * The attention error rates sparse worst everywhere; the KL rates it
     * best on layer 1 and worst on the others. */
    kv_profile a;
    table(&a, 3);
    for (int l = 0; l < 3; l++) {
        set(&a, l, KV_OPT_Q4, 300, 0.03, 0.010);
        set(&a, l, KV_OPT_Q2, 180, 0.20, 0.050);
        set(&a, l, KV_OPT_SPARSE, 100, 0.90, l == 1 ? 0.001 : 0.400);
    }
    kv_profile_params p;
    kv_profile_params_default(&p);
    p.kv_budget = 0.25;
    kv_deploy d;
    kv_profile_choice c;
    a.kl_docs = 1; /* the KL was measured: it decides */
    KT_OK(kv_profile_deploy(&a, &p, &d, &c));
    KT_CHECK(c.budget_met && c.opt[0] == KV_OPT_Q4 && c.opt[1] == KV_OPT_SPARSE && c.opt[2] == KV_OPT_Q4,
             "KL: %s, %s, %s", kv_profile_opt_name(c.opt[0]), kv_profile_opt_name(c.opt[1]),
             kv_profile_opt_name(c.opt[2]));
    KT_CHECK(d.per_layer[1].kind == KV_POL_SPARSE && c.bytes == 700, "deployed sparse, %g bytes", c.bytes);
    kv_deploy_clear(&d);
    kv_profile_choice_clear(&c);
    /* the same table decided by the attention error: no sparse layer (the
     * test would pass trivially if sparse were picked for its bytes alone) */
    a.kl_docs = 0;
    KT_OK(kv_profile_deploy(&a, &p, &d, &c));
    for (int l = 0; l < 3; l++)
        KT_CHECK(c.opt[l] != KV_OPT_SPARSE, "attention error: layer %d is %s", l, kv_profile_opt_name(c.opt[l]));
    kv_deploy_clear(&d);
    kv_profile_choice_clear(&c);
    /* sparse's KL raised above the others': not chosen, 2-bit pays instead */
    a.kl_docs = 1;
    set(&a, 1, KV_OPT_SPARSE, 100, 0.90, 0.400);
    KT_OK(kv_profile_deploy(&a, &p, &d, &c));
    for (int l = 0; l < 3; l++)
        KT_CHECK(c.opt[l] != KV_OPT_SPARSE, "KL 0.4: layer %d is %s", l, kv_profile_opt_name(c.opt[l]));
    KT_CHECK(c.bytes <= 750, "within the budget: %g", c.bytes);
    kv_deploy_clear(&d);
    kv_profile_choice_clear(&c);
    kv_profile_clear(&a);
}

static kv_model *load_260k(void)
{
    kv_model *m = NULL;
    if (kv_model_open(S260 "stories260K.bin", &m)) return NULL;
    return m;
}

/* stories260K's greedy text: the first n ids, dumped by the engine (f32, 32 queries). */
static kvc_file *dump_260k(const kv_model *m, int *ids, int n, char *path)
{
    FILE *f = fopen(S260 "reference/greedy_bos_200.ids", "r");
    int got = 0;
    while (f && got < n && fscanf(f, "%d", &ids[got]) == 1) got++;
    if (f) fclose(f);
    if (got < n) return NULL;
    kv_engine *e = NULL;
    strcpy(path, "/tmp/kvtest_profile_kl_XXXXXX");
    int fd = mkstemp(path);
    if (fd >= 0) close(fd);
    kvc_file *out = NULL;
    if (fd < 0 || kv_engine_new(m, NULL, n, &e) || kv_engine_keep(e, 32, true) ||
        kv_engine_prefill(e, ids, n, NULL) || kv_engine_dump_kvc(e, ids, n, KV_DT_F32, path, 0) ||
        kvc_open(path, &out))
        out = NULL;
    kv_engine_free(e);
    return out;
}

static void test_kl_equals_the_fidelity_measure_of_the_same_policy(void)
{
    kv_model *m = load_260k();
    KT_REQUIRE(m, "stories260K: %s", kv_errdetail());
    enum { N = 120, S = 24 };
    int ids[N + 1];
    char path[64];
    kvc_file *f = dump_260k(m, ids, N, path);
    KT_REQUIRE(f, "dump: %s", kv_errdetail());
    kv_profile_params p;
    kv_profile_params_default(&p);
    p.steps = S;
    KT_OK(kv_profile_choices_parse("quant4-r0,quant1-r0,stream32,sparse32", &p.choices));
    kv_profile a;
    memset(&a, 0, sizeof a);
    KT_OK(kv_profile_add(&a, f, &p));
    KT_OK(kv_profile_add_kl(&a, f, m, &p));
    kv_profile_finish(&a);
    KT_CHECK(a.kl_docs == 1 && a.kl_steps == S, "measured %d files, %d steps", a.kl_docs, a.kl_steps);
    KT_CHECK(isnan(a.kl[KV_OPT_Q2][0]) && isnan(a.bytes[KV_OPT_Q2][0]), "quant2 not asked for: not measured");
    /* kv_compare prefills the first N - S densely and scores the steps'
     * predictions: with one more token (any: KL does not look at it) its
     * scored positions are exactly the S steps measured here */
    ids[N] = 0;
    const kv_profile_opt check[] = {KV_OPT_Q1_R0, KV_OPT_STREAM32, KV_OPT_SPARSE32};
    for (size_t i = 0; i < sizeof check / sizeof check[0]; i++) {
        for (int l = 0; l < a.n_layers; l += 2) {
            kv_policy_params per[8];
            for (int j = 0; j < a.n_layers; j++) kv_policy_params_default(&per[j], KV_POL_FULL);
            kv_profile_deploy_params(&p, check[i], &per[l]);
            kv_compare_opts co;
            kv_compare_opts_default(&co);
            co.prefix = N - S;
            kv_compare_result r;
            KT_OK(kv_compare_run(m, ids, N + 1, NULL, per, &co, &r));
            KT_CHECK(r.n_scored == S, "scored %d", r.n_scored);
            KT_CHECK(fabs(r.kl_mean - a.kl[check[i]][l]) <= 1e-5 + 1e-4 * r.kl_mean,
                     "%s on layer %d: KL %g, fidelity %g", kv_profile_opt_name(check[i]), l,
                     a.kl[check[i]][l], r.kl_mean);
            kv_compare_result_clear(&r);
        }
    }
    /* the measure can tell options apart: 1 bit without the window is far
     * from full on every layer, 4 bits without it close */
    for (int l = 0; l < a.n_layers; l++)
        KT_CHECK(a.kl[KV_OPT_Q1_R0][l] > 0.05 && a.kl[KV_OPT_Q4_R0][l] < a.kl[KV_OPT_Q1_R0][l] / 10 &&
                     a.kl[KV_OPT_FULL][l] == 0,
                 "layer %d: KL 1-bit %g, 4-bit %g", l, a.kl[KV_OPT_Q1_R0][l], a.kl[KV_OPT_Q4_R0][l]);
    kv_profile_clear(&a);
    kvc_close(f);
    unlink(path);
    kv_model_close(m);
}

static void test_kl_rejects_a_file_without_room_or_of_another_model(void)
{
    kv_model *m = load_260k();
    KT_REQUIRE(m, "stories260K: %s", kv_errdetail());
    int ids[40];
    char path[64];
    kvc_file *f = dump_260k(m, ids, 40, path);
    KT_REQUIRE(f, "dump: %s", kv_errdetail());
    kv_profile_params p;
    kv_profile_params_default(&p);
    KT_OK(kv_profile_choices_parse("quant4", &p.choices));
    kv_profile a;
    memset(&a, 0, sizeof a);
    KT_CHECK(kv_profile_add_kl(&a, f, m, &p) == KV_E_INTERNAL, "before kv_profile_add");
    KT_OK(kv_profile_add(&a, f, &p));
    p.steps = 40;
    KT_CHECK(kv_profile_add_kl(&a, f, m, &p) == KV_E_USAGE && strstr(kv_errdetail(), "40 tokens"),
             "steps = tokens: %s", kv_errdetail());
    kv_model *other = NULL;
    KT_OK(kv_model_open("tests/data/niah4k/niah4k.bin", &other));
    p.steps = 8;
    KT_CHECK(kv_profile_add_kl(&a, f, other, &p) == KV_E_DATA, "another model: %s", kv_errdetail());
    kv_model_close(other);
    /* a prompt of 32 tokens or fewer is prefilled whole (no rows from the file) */
    KT_OK(kv_profile_add_kl(&a, f, m, &p));
    KT_CHECK(a.kl_docs == 1 && a.kl_steps == 8 && isfinite(a.kl[KV_OPT_Q4][0]) && a.kl[KV_OPT_Q4][0] >= 0,
             "short prompt: %d files, KL %g", a.kl_docs, a.kl[KV_OPT_Q4][0]);
    kv_profile_clear(&a);
    kvc_close(f);
    unlink(path);
    kv_model_close(m);
}

static void test_sparse_bytes_are_the_resident_rows_and_index(void)
{
    /* a sparse layer's GPU bytes: sink + window rows, the K' rows its
     * attention buffer gathers, the channel maxima and the resident index;
     * the prompt's rows live on the host and are not counted */
    kv_model *m = load_260k();
    KT_REQUIRE(m, "stories260K: %s", kv_errdetail());
    enum { N = 200 };
    int ids[N];
    char path[64];
    kvc_file *f = dump_260k(m, ids, N, path);
    KT_REQUIRE(f, "dump: %s", kv_errdetail());
    kv_profile_params p;
    kv_profile_params_default(&p);
    KT_OK(kv_profile_choices_parse("sparse32", &p.choices));
    kv_profile a;
    memset(&a, 0, sizeof a);
    KT_OK(kv_profile_add(&a, f, &p));
    kv_profile_finish(&a);
    const int H = a.n_kv_heads, D = a.head_dim;
    kv_policy_params x;
    kv_profile_deploy_params(&p, KV_OPT_SPARSE32, &x);
    const int C = kv_select_pool_size(x.pool, x.channels, D);
    double want = 2.0 * H * (x.sink + x.window) * D * 2 + (double)H * D * 4 +
                  (double)H * (double)kv_select_rows_bytes(C, N, x.cbits) + 2.0 * H * x.topk * D * 2;
    for (int l = 0; l < a.n_layers; l++) {
        KT_CHECK(a.bytes[KV_OPT_SPARSE32][l] == want, "layer %d: %g bytes, resident %g", l,
                 a.bytes[KV_OPT_SPARSE32][l], want);
        KT_CHECK(a.bytes[KV_OPT_SPARSE32][l] < 0.3 * a.bytes[KV_OPT_FULL][l], "no host copy: %g of %g",
                 a.bytes[KV_OPT_SPARSE32][l], a.bytes[KV_OPT_FULL][l]);
    }
    kv_profile_clear(&a);
    kvc_close(f);
    unlink(path);
    kv_model_close(m);
}

int main(void)
{
    KT_RUN(test_budget_picks_sparse_when_its_measured_error_is_lowest);
    KT_RUN(test_kl_equals_the_fidelity_measure_of_the_same_policy);
    KT_RUN(test_kl_rejects_a_file_without_room_or_of_another_model);
    KT_RUN(test_sparse_bytes_are_the_resident_rows_and_index);
    return kt_done();
}
