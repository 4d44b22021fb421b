/*
 * Unit tests of lib/kv_policy*: the spec parser, the dense reference, and
 * each policy on fresh random data: exactness where a policy holds every
 * token, the error of lossy ones, and byte accounting against the formula
 * the layout implies.
 */
#include <stdlib.h>
#include <string.h>

#include "kt.h"
#include "common/kv_half.h"
#include "attn/kv_attn.h"
#include "policy/kv_policy.h"
#include "policy/kv_select.h"

/* KT_REQUIRE evaluates its condition twice: run a call once, then require. */
#define REQ_OK(call, ...)                                                     \
    do {                                                                      \
        kv_status st_ = (call);                                               \
        KT_REQUIRE(st_ == KV_OK, __VA_ARGS__);                                \
    } while (0)

static unsigned long long seed = 0x5eed1234abcdULL;

static float *randv(size_t n, float sd)
{
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = sd * kt_randn(&seed);
    return x;
}

/* (H, T, D) -> token-major row of token t: (H, D) */
static void token_row(const float *x, int H, int T, int D, int t, float *row)
{
    for (int h = 0; h < H; h++)
        memcpy(row + (size_t)h * D, x + ((size_t)h * T + t) * D, (size_t)D * sizeof(float));
}

typedef struct {
    int nh, nkv, D, T;
    float *k, *v; /* (nkv, T, D) */
} fixture;

static fixture mkfix(int nh, int nkv, int D, int T)
{
    fixture f = {nh, nkv, D, T, randv((size_t)nkv * T * D, 1.0f), randv((size_t)nkv * T * D, 1.0f)};
    return f;
}

static void freefix(fixture *f)
{
    free(f->k);
    free(f->v);
}

/* Needles at token t: each KV head's key there is 3 times the query of its
 * group's first head, so that exact attention finds them. */
static void plant_needles(fixture *f, const float *q, int t)
{
    for (int kh = 0; kh < f->nkv; kh++)
        for (int c = 0; c < f->D; c++)
            f->k[((size_t)kh * f->T + t) * f->D + c] = 3.0f * q[(kh * (f->nh / f->nkv)) * f->D + c];
}

static kv_policy *mkpol(const fixture *f, const char *spec, int cap)
{
    kv_policy_params prm;
    kv_status st = kv_policy_parse(spec, 1, &prm);
    if (st) {
        printf("# parse %s: %s\n", spec, kv_errdetail());
        return NULL;
    }
    kv_policy_geom g = {0, f->nh, f->nkv, f->D, cap};
    kv_policy *p;
    st = kv_policy_new(&g, &prm, &p);
    if (st) {
        printf("# create %s: %s\n", spec, kv_errdetail());
        return NULL;
    }
    return p;
}

/* Ingest the first T0 tokens, then append the rest one by one. */
static kv_status feed(kv_policy *p, const fixture *f, int T0)
{
    float *kp = malloc((size_t)f->nkv * T0 * f->D * sizeof(float) + 4);
    float *vp = malloc((size_t)f->nkv * T0 * f->D * sizeof(float) + 4);
    for (int h = 0; h < f->nkv; h++) {
        memcpy(kp + (size_t)h * T0 * f->D, f->k + (size_t)h * f->T * f->D, (size_t)T0 * f->D * sizeof(float));
        memcpy(vp + (size_t)h * T0 * f->D, f->v + (size_t)h * f->T * f->D, (size_t)T0 * f->D * sizeof(float));
    }
    kv_status st = p->ops->ingest(p, kp, vp, T0);
    free(kp);
    free(vp);
    float *kr = malloc((size_t)f->nkv * f->D * sizeof(float));
    float *vr = malloc((size_t)f->nkv * f->D * sizeof(float));
    for (int t = T0; t < f->T && st == KV_OK; t++) {
        token_row(f->k, f->nkv, f->T, f->D, t, kr);
        token_row(f->v, f->nkv, f->T, f->D, t, vr);
        st = p->ops->append(p, t, kr, vr);
    }
    free(kr);
    free(vr);
    return st;
}

/* spec's policy for f (capacity cap), fed f (feed: T0 rows ingested, the
 * rest appended), then one attend of q into o: the start most tests share.
 * NULL (the failure printed) when a step fails. */
static kv_policy *attended(const fixture *f, const char *spec, int cap, int T0, const float *q, float *o)
{
    kv_policy *p = mkpol(f, spec, cap);
    kv_status st = p ? feed(p, f, T0) : KV_E_USAGE;
    if (p && st) printf("# feed %s: %s\n", spec, kv_errdetail());
    if (p && !st && (st = p->ops->attend(p, q, o))) printf("# attend %s: %s\n", spec, kv_errdetail());
    if (!st) return p;
    kv_policy_free(p);
    return NULL;
}

static double max_abs_diff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > m) m = d;
    }
    return m;
}

static double rel_err(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static double rms_diff(const float *a, const float *b, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) s += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    return sqrt(s / (double)n);
}

// --- parser -------------------------------------------------------------

static void test_parse_single(void)
{
    kv_policy_params p[4];
    REQ_OK(kv_policy_parse("sparse:k=32,c=4,s=2,w=16,select=exact", 4, p), "%s", kv_errdetail());
    for (int l = 0; l < 4; l++) {
        KT_CHECK(p[l].kind == KV_POL_SPARSE, "kind");
        KT_CHECK(p[l].topk == 32 && p[l].channels == 4 && p[l].sink == 2 && p[l].window == 16, "keys");
        KT_CHECK(p[l].select == KV_SELECT_EXACT, "select");
    }
    REQ_OK(kv_policy_parse("quant:bits=2,group=32,residual=64", 1, p), "%s", kv_errdetail());
    KT_CHECK(p[0].bits == 2 && p[0].group == 32 && p[0].residual == 64, "quant keys");
    REQ_OK(kv_policy_parse("full:dtype=bf16", 1, p), "%s", kv_errdetail());
    KT_CHECK(p[0].dtype == KV_DT_BF16, "dtype");
    REQ_OK(kv_policy_parse("sparse:frac=0.05", 1, p), "%s", kv_errdetail());
    KT_CHECK(p[0].topk == 0 && fabs(p[0].topk_frac - 0.05) < 1e-12, "frac");
    kv_policy_params d;
    kv_policy_params_default(&d, KV_POL_QUANT);
    KT_CHECK(d.bits == 1 && d.group == 64 && d.residual == 128, "quant defaults");
    kv_policy_params_default(&d, KV_POL_SPARSE);
    KT_CHECK(d.sink == 8 && d.window == 56 && d.channels == 8 && d.topk == 128, "sparse defaults");
}

static void test_parse_per_layer(void)
{
    kv_policy_params p[32];
    REQ_OK(kv_policy_parse("0=quant:bits=1;1-30=sparse:k=128;*=streaming", 32, p),
               "%s", kv_errdetail());
    KT_CHECK(p[0].kind == KV_POL_QUANT && p[0].bits == 1, "layer 0");
    for (int l = 1; l <= 30; l++) KT_CHECK(p[l].kind == KV_POL_SPARSE && p[l].topk == 128, "layer %d", l);
    KT_CHECK(p[31].kind == KV_POL_STREAMING, "star fills layer 31");
    REQ_OK(kv_policy_parse("*=quant;2=full", 4, p), "%s", kv_errdetail());
    KT_CHECK(p[0].kind == KV_POL_QUANT && p[2].kind == KV_POL_FULL && p[3].kind == KV_POL_QUANT,
             "star first, explicit wins");
    REQ_OK(kv_policy_parse("1=quant", 3, p), "%s", kv_errdetail());
    KT_CHECK(p[0].kind == KV_POL_FULL && p[1].kind == KV_POL_QUANT && p[2].kind == KV_POL_FULL,
             "unnamed layers are full");
}

static void test_parse_rejects(void)
{
    kv_policy_params p[8];
    const char *bad[] = {"", "fulll", "quant:bits=3", "quant:bits=x", "quant:bits=", "quant:k=3",
                         "sparse:k=-1", "sparse:frac=2", "sparse:select=maybe", "full:",
                         "full:dtype=f8", "9=full", "3-1=full", "0=full;;1=full", "0=bogus",
                         "*=full;*=quant", "0-x=full", "streaming:c=4", "quant:bits=1,", "0full",
                         "dsq:bits=3", "dsq:kbits=8", "dsq:vbits=0", "dsq:group=x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_errclear();
        kv_status st = kv_policy_parse(bad[i], 8, p);
        KT_CHECK(st == KV_E_USAGE, "'%s' accepted (st %d)", bad[i], (int)st);
        KT_CHECK(st == KV_OK || kv_errdetail()[0], "'%s': no message", bad[i]);
    }
}

// --- dense reference ----------------------------------------------------

/* --kv-dtype and --select are defaults: they fill the keys a spec leaves
 * out, on the kinds that have them, and never override a key the spec names. */
static void test_defaults_fill_what_the_spec_leaves_out(void)
{
    kv_policy_params p[3];
    REQ_OK(kv_policy_parse("0=full;1=sparse:select=exact,dtype=f16;2=sparse", 3, p), "%s", kv_errdetail());
    kv_policy_defaults d = {.given = KV_KEY_DTYPE | KV_KEY_SELECT, .dtype = KV_DT_BF16,
                            .select = KV_SELECT_SKETCH};
    kv_policy_defaults_apply(&d, p, 3);
    KT_CHECK(p[0].dtype == KV_DT_BF16 && p[0].select == KV_SELECT_DEFAULT, "full layer: dtype only");
    KT_CHECK(p[1].dtype == KV_DT_F16 && p[1].select == KV_SELECT_EXACT, "spec keys win");
    KT_CHECK(p[2].dtype == KV_DT_BF16 && p[2].select == KV_SELECT_SKETCH, "defaults fill");
    kv_policy_defaults none = {0};
    kv_policy_params q = p[2];
    kv_policy_defaults_apply(&none, &q, 1);
    KT_CHECK(!memcmp(&q, &p[2], sizeof q), "no defaults change nothing");
    /* the deploy config's budget spelling is a spec key too */
    REQ_OK(kv_policy_parse("sparse:budget=0.25", 1, p), "%s", kv_errdetail());
    KT_CHECK(p[0].topk == 0 && fabs(p[0].topk_frac - 0.25) < 1e-12, "budget fraction");
    REQ_OK(kv_policy_parse("sparse:budget=64", 1, p), "%s", kv_errdetail());
    KT_CHECK(p[0].topk == 64 && p[0].topk_frac == 0.0, "budget count");
    KT_CHECK(kv_policy_parse("sparse:budget=1.5", 1, p) == KV_E_USAGE, "budget 1.5 accepted");
    KT_CHECK(kv_policy_parse("sparse:budget=0", 1, p) == KV_E_USAGE, "budget 0 accepted");
}

/* One check for both engines: what each refuses, with its status. */
static void test_check_per_device(void)
{
    const kv_policy_geom g = {3, 8, 2, 64, 1024};
    kv_policy_params p;
    kv_policy_params_default(&p, KV_POL_SPARSE);
    p.select = KV_SELECT_SKETCH;
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CPU) == KV_E_USAGE, "sketch on the CPU");
    KT_CHECK(strstr(kv_errdetail(), "layer 3 policy sparse: select=sketch") != NULL, "message: %s", kv_errdetail());
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CUDA) == KV_OK, "%s", kv_errdetail());
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_AUTO) == KV_OK, "%s", kv_errdetail());
    kv_policy_params_default(&p, KV_POL_FULL);
    p.offload = true;
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CPU) == KV_E_USAGE, "offload on the CPU");
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CUDA) == KV_OK, "%s", kv_errdetail());
    kv_policy_params_default(&p, KV_POL_DSQ);
    p.hcap_token_keep = 0.5;
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CPU) == KV_OK, "%s", kv_errdetail());
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CUDA) == KV_E_UNSUPPORTED, "HCAP on the GPU");
    /* keys and values at their own bits on both engines */
    kv_policy_params_default(&p, KV_POL_DSQ);
    p.dsq_kbits = 4, p.dsq_vbits = 2;
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CPU) == KV_OK, "%s", kv_errdetail());
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CUDA) == KV_OK, "kbits 4, vbits 2 on the GPU: %s", kv_errdetail());
    p.dsq_kbits = 3;
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CUDA) == KV_E_USAGE, "kbits 3");
    p.dsq_kbits = 4, p.dsq_vbits = 4;
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CUDA) == KV_OK, "bits=4 on the GPU: %s", kv_errdetail());
    p.dsq_group = 48;
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CPU) == KV_E_USAGE, "dsq group 48 with head dim 64");
    kv_policy_params_default(&p, KV_POL_SPARSE);
    p.channels = 65;
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CPU) == KV_OK, "%s", kv_errdetail()); /* the CPU uses min(C, head_dim) */
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_CUDA) == KV_E_USAGE, "channels > head_dim on the GPU");
    kv_policy_params_default(&p, KV_POL_QUANT);
    p.bits = 3;
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_AUTO) == KV_E_USAGE, "3 bits");
    KT_CHECK(strstr(kv_errdetail(), "layer 3 policy quant: ") != NULL, "message: %s", kv_errdetail());
    kv_policy_params_default(&p, KV_POL_STREAMING);
    p.window = 0;
    KT_CHECK(kv_policy_check(&p, &g, KV_DEVICE_AUTO) == KV_E_USAGE, "window 0");
    const kv_policy_geom bad = {0, 6, 4, 64, 1024};
    kv_policy_params_default(&p, KV_POL_FULL);
    KT_CHECK(kv_policy_check(&p, &bad, KV_DEVICE_AUTO) == KV_E_USAGE, "6 heads over 4 KV heads");
    /* kv_policy_new checks for the CPU */
    kv_policy *pol = NULL;
    kv_policy_params_default(&p, KV_POL_SPARSE);
    p.select = KV_SELECT_SKETCH;
    KT_CHECK(kv_policy_new(&g, &p, &pol) == KV_E_USAGE && !pol, "CPU sketch policy built");
}

static void test_dense_matches_naive(void)
{
    const int nh = 4, nkv = 2, D = 16, T = 37;
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), out[64];
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, out);
    double worst = 0;
    for (int h = 0; h < nh; h++) {
        int kh = h / (nh / nkv);
        double s[64], mx = -1e300, sum = 0;
        for (int t = 0; t < T; t++) {
            s[t] = 0;
            for (int c = 0; c < D; c++) s[t] += (double)q[h * D + c] * f.k[((size_t)kh * T + t) * D + c];
            s[t] /= sqrt((double)D);
            if (s[t] > mx) mx = s[t];
        }
        for (int t = 0; t < T; t++) sum += (s[t] = exp(s[t] - mx));
        for (int c = 0; c < D; c++) {
            double o = 0;
            for (int t = 0; t < T; t++) o += s[t] / sum * f.v[((size_t)kh * T + t) * D + c];
            double d = fabs(o - out[h * D + c]);
            if (d > worst) worst = d;
        }
    }
    KT_CHECK(worst < 1e-5, "dense vs double naive: %g", worst);
    /* large logits must not overflow */
    for (int i = 0; i < nh * D; i++) q[i] *= 1000.0f;
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, out);
    int finite = 1;
    for (int i = 0; i < nh * D; i++) finite &= isfinite(out[i]);
    KT_CHECK(finite, "non-finite output for large logits");
    free(q);
    freefix(&f);
}

/* The vectorised kernel agrees with the plain double-accumulating reference
 * at a long context too (where float accumulation order matters most). */
static void test_dense_matches_reference_long(void)
{
    const int nh = 4, nkv = 2, D = 64, T = 4096;
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), o1[256], o2[256];
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, o1);
    kv_attend_reference(q, f.k, f.v, T, T, nh, nkv, D, o2);
    double num = 0, den = 0;
    for (int i = 0; i < nh * D; i++) {
        num += (o1[i] - o2[i]) * (double)(o1[i] - o2[i]);
        den += (double)o2[i] * o2[i];
    }
    KT_CHECK(den > 0 && sqrt(num / den) < 1e-5, "relative error %g", sqrt(num / (den > 0 ? den : 1)));
    free(q);
    freefix(&f);
}

/* Large inputs run heads in parallel: the same bits as one head at a time. */
static void test_dense_parallel_same_bits(void)
{
    const int nh = 8, nkv = 2, D = 64, T = 1500;
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), o1[512], o2[512];
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, o1);
    for (int h = 0; h < nh; h++)
        kv_attend_dense(q + h * D, f.k + (size_t)(h / 4) * T * D, f.v + (size_t)(h / 4) * T * D, T, T,
                        1, 1, D, o2 + h * D);
    KT_CHECK(memcmp(o1, o2, sizeof o1) == 0, "parallel heads differ: %g", max_abs_diff(o1, o2, 512));
    free(q);
    freefix(&f);
}

// --- full -----------------------------------------------------------------

static void test_full_equals_dense(void)
{
    const int nh = 8, nkv = 2, D = 32, T = 150;
    fixture f = mkfix(nh, nkv, D, T);
    kv_policy *p = mkpol(&f, "full", 200);
    KT_REQUIRE(p, "create");
    REQ_OK(feed(p, &f, 100), "%s", kv_errdetail());
    KT_CHECK(p->n_tokens == T, "n_tokens %d", p->n_tokens);
    float *q = randv((size_t)nh * D, 1.0f), *o1 = malloc(nh * D * 4), *o2 = malloc(nh * D * 4);
    REQ_OK(p->ops->attend(p, q, o1), "attend");
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, o2);
    KT_CHECK(memcmp(o1, o2, (size_t)nh * D * 4) == 0, "full f32 != dense (max diff %g)",
             max_abs_diff(o1, o2, (size_t)nh * D));
    kv_bytes b;
    p->ops->bytes(p, &b);
    KT_CHECK(b.resident == 2ull * nkv * T * D * 4 && b.host == 0 && b.fetched_total == 0,
             "full bytes %llu", (unsigned long long)b.resident);
    kv_policy_free(p);
    /* f16 and bf16: bytes halve, error at the storage precision */
    const char *specs[] = {"full:dtype=f16", "full:dtype=bf16"};
    const double tol[] = {2e-3, 2e-2};
    for (int i = 0; i < 2; i++) {
        p = mkpol(&f, specs[i], T);
        KT_REQUIRE(p, "create");
        REQ_OK(feed(p, &f, 10), "%s", specs[i]);
        REQ_OK(p->ops->attend(p, q, o1), "attend");
        double e = rel_err(o1, o2, (size_t)nh * D);
        KT_CHECK(e < tol[i] && e > 0, "%s rel err %g", specs[i], e);
        p->ops->bytes(p, &b);
        KT_CHECK(b.resident == 2ull * nkv * T * D * 2, "%s bytes", specs[i]);
        kv_policy_free(p);
    }
    /* capacity is enforced and positions must be consecutive */
    p = mkpol(&f, "full", 2);
    KT_REQUIRE(p, "create");
    float row[64] = {0};
    KT_CHECK(p->ops->append(p, 0, row, row) == KV_OK, "append 0");
    KT_CHECK(p->ops->append(p, 5, row, row) != KV_OK, "gap accepted");
    KT_CHECK(p->ops->append(p, 1, row, row) == KV_OK, "append 1");
    KT_CHECK(p->ops->append(p, 2, row, row) == KV_E_USAGE, "overflow accepted");
    kv_policy_free(p);
    free(q);
    free(o1);
    free(o2);
    freefix(&f);
}

// --- streaming ------------------------------------------------------------

/* Dense attention over an explicit token list (same for every KV head). */
static void dense_subset(const fixture *f, const int *toks, int n, const float *q, float *out)
{
    float *k = malloc((size_t)f->nkv * n * f->D * 4 + 4), *v = malloc((size_t)f->nkv * n * f->D * 4 + 4);
    for (int h = 0; h < f->nkv; h++)
        for (int i = 0; i < n; i++) {
            memcpy(k + ((size_t)h * n + i) * f->D, f->k + ((size_t)h * f->T + toks[i]) * f->D, f->D * 4);
            memcpy(v + ((size_t)h * n + i) * f->D, f->v + ((size_t)h * f->T + toks[i]) * f->D, f->D * 4);
        }
    kv_attend_dense(q, k, v, n, n, f->nh, f->nkv, f->D, out);
    free(k);
    free(v);
}

static void test_streaming(void)
{
    const int nh = 4, nkv = 2, D = 16, T = 90;
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), o1[64], o2[64];
    /* window covers everything: exact */
    kv_policy *p = mkpol(&f, "streaming:sink=4,window=86", 128);
    KT_REQUIRE(p, "create");
    REQ_OK(feed(p, &f, 40), "%s", kv_errdetail());
    REQ_OK(p->ops->attend(p, q, o1), "attend");
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, o2);
    KT_CHECK(memcmp(o1, o2, sizeof o1) == 0, "window >= context differs: %g", max_abs_diff(o1, o2, 64));
    kv_policy_free(p);
    /* small window: exactly sink + last W, whether from ingest or appends */
    int toks[64], n = 0;
    for (int t = 0; t < 3; t++) toks[n++] = t;
    for (int t = T - 20; t < T; t++) toks[n++] = t;
    dense_subset(&f, toks, n, q, o2);
    int T0s[] = {T, 50, 1};
    for (int i = 0; i < 3; i++) {
        p = mkpol(&f, "streaming:s=3,w=20", 128);
        KT_REQUIRE(p, "create");
        REQ_OK(feed(p, &f, T0s[i]), "%s", kv_errdetail());
        REQ_OK(p->ops->attend(p, q, o1), "attend");
        KT_CHECK(memcmp(o1, o2, sizeof o1) == 0, "T0=%d: sink+window differs: %g", T0s[i],
                 max_abs_diff(o1, o2, 64));
        kv_bytes b;
        p->ops->bytes(p, &b);
        KT_CHECK(b.resident == 2ull * nkv * 23 * D * 4 && b.host == 0, "bytes %llu",
                 (unsigned long long)b.resident);
        kv_policy_free(p);
    }
    free(q);
    freefix(&f);
}

// --- sparse -------------------------------------------------------------

static void test_sparse_large_k_is_dense(void)
{
    const int nh = 8, nkv = 2, D = 32, T = 300;
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), *o1 = malloc(nh * D * 4), *o2 = malloc(nh * D * 4);
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, o2);
    const char *specs[] = {"sparse:k=300", "sparse:frac=1", "sparse:k=1000,select=exact"};
    for (int i = 0; i < 3; i++) {
        kv_policy *p = mkpol(&f, specs[i], 400);
        KT_REQUIRE(p, "create");
        REQ_OK(feed(p, &f, 250), "%s", kv_errdetail());
        KT_CHECK(p->wants_prediction, "sparse wants a prediction");
        REQ_OK(p->ops->attend(p, q, o1), "attend");
        KT_CHECK(memcmp(o1, o2, (size_t)nh * D * 4) == 0, "%s differs from dense: %g", specs[i],
                 max_abs_diff(o1, o2, (size_t)nh * D));
        kv_policy_free(p);
    }
    free(q);
    free(o1);
    free(o2);
    freefix(&f);
}

/* With one query head per KV head and exact selection, the policy must
 * attend over sink + window + generated + the K best-scoring candidates. */
static void test_sparse_exact_selection(void)
{
    const int nh = 2, nkv = 2, D = 16, T = 200, T0 = 180, S = 4, W = 30, K = 12;
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), o1[32], o2[32];
    kv_policy *p = attended(&f, "sparse:s=4,w=30,k=12,select=exact", 256, T0, q, o1);
    KT_REQUIRE(p, "create");
    /* candidates [S, T-W) = [4, 170); per head pick the K largest q.k */
    int cend = T - W;
    for (int h = 0; h < nh; h++) {
        int toks[256], n = 0;
        char chosen[256] = {0};
        for (int r = 0; r < K; r++) {
            int best = -1;
            float bs = -INFINITY;
            for (int t = S; t < cend; t++) {
                if (chosen[t]) continue;
                float d = 0;
                for (int c = 0; c < D; c++) d += q[h * D + c] * f.k[((size_t)h * T + t) * D + c];
                if (d > bs) bs = d, best = t;
            }
            chosen[best] = 1;
        }
        for (int t = 0; t < T; t++)
            if (t < S || t >= cend || chosen[t]) toks[n++] = t;
        /* dense over this head's tokens: a one-head fixture view */
        fixture one = {1, 1, D, T, f.k + (size_t)h * T * D, f.v + (size_t)h * T * D};
        dense_subset(&one, toks, n, q + h * D, o2 + h * D);
    }
    KT_CHECK(max_abs_diff(o1, o2, 32) < 1e-6, "exact selection differs: %g", max_abs_diff(o1, o2, 32));
    kv_bytes b;
    p->ops->bytes(p, &b);
    uint64_t ncand = (uint64_t)(cend - S);
    KT_CHECK(b.host == 2ull * nkv * T0 * D * 4, "host %llu", (unsigned long long)b.host);
    KT_CHECK(b.resident == 2ull * nkv * (S + (T - cend)) * D * 4 + (uint64_t)nkv * D * 4, "resident %llu",
             (unsigned long long)b.resident);
    KT_CHECK(b.fetched_last == (uint64_t)nkv * (ncand * D * 4 + (uint64_t)K * D * 4), "fetched %llu",
             (unsigned long long)b.fetched_last);
    KT_CHECK(b.attends == 1 && b.fetched_total == b.fetched_last, "totals %llu %llu %llu", (unsigned long long)b.attends, (unsigned long long)b.fetched_total, (unsigned long long)b.fetched_last);
    kv_policy_free(p);
    free(q);
    freefix(&f);
}

/* Approximate selection: bytes follow the channel formula; with a needle
 * (one key aligned with the query) the needle is retrieved and the output
 * is close to dense. */
static void test_sparse_approx(void)
{
    const int nh = 4, nkv = 2, D = 32, T = 512, T0 = 500, C = 8, K = 16;
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), o1[128], o2[128];
    /* plant needles at token 200: keys = 3 * query of the group's first head */
    plant_needles(&f, q, 200);
    kv_policy *p = attended(&f, "sparse:s=8,w=56,c=8,k=16,select=channels", 600, T0, q, o1);
    KT_REQUIRE(p, "create");
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, o2);
    double e = rel_err(o1, o2, 128);
    KT_CHECK(e < 0.5, "approx sparse rel err %g", e);
    kv_bytes b;
    p->ops->bytes(p, &b);
    uint64_t ncand = (uint64_t)(T - 56 - 8);
    KT_CHECK(b.fetched_last == (uint64_t)nkv * (ncand * C * 4 + 2ull * K * D * 4), "fetched %llu",
             (unsigned long long)b.fetched_last);
    /* a prediction is used once, then the actual query again */
    float *qp = randv((size_t)nh * D, 1.0f);
    p->ops->predict(p, qp);
    REQ_OK(p->ops->attend(p, q, o1), "attend");
    p->ops->bytes(p, &b);
    KT_CHECK(b.attends == 2 && b.fetched_total == 2 * b.fetched_last, "totals");
    kv_policy_free(p);
    free(qp);
    free(q);
    freefix(&f);
}

/* select=resident with one query head per KV head: the channels are the
 * top C of sum_j |q_obs,jc| * fp16(max_t |K_tc|), fixed at ingest; each step
 * attends over sink + window + the K candidates with the largest q_C . k_C
 * (fp16 keys on those channels), and fetches only their rows. */
/* The reference of select=resident for one query head per KV head: the
 * pool of R from the observed queries, then this step's C of it. */
static void resident_reference(const fixture *f, const float *obs, int NO, int T0, int R, int C,
                               const float *q, int h, char *chan)
{
    const int D = f->D, T = f->T;
    float cs[64], mx[64];
    char pool[64] = {0};
    for (int c = 0; c < D; c++) {
        float m = 0, a = 0;
        for (int t = 0; t < T0; t++) m = fmaxf(m, fabsf(f->k[((size_t)h * T + t) * D + c]));
        for (int j = 0; j < NO; j++) a += fabsf(obs[((size_t)h * NO + j) * D + c]);
        mx[c] = kv_round_half(m);
        cs[c] = a * mx[c];
    }
    for (int r = 0; r < R; r++) {
        int best = -1;
        for (int c = 0; c < D; c++)
            if (!pool[c] && (best < 0 || cs[c] > cs[best])) best = c;
        pool[best] = 1;
    }
    memset(chan, 0, (size_t)D);
    for (int r = 0; r < C; r++) {
        int best = -1;
        for (int c = 0; c < D; c++)
            if (pool[c] && !chan[c] && (best < 0 || fabsf(q[c]) * mx[c] > fabsf(q[best]) * mx[best])) best = c;
        chan[best] = 1;
    }
}

static void test_sparse_resident_selection(void)
{
    const int nh = 2, nkv = 2, D = 32, T = 400, T0 = 380, S = 4, W = 20, K = 10, C = 6, NO = 3;
    fixture f = mkfix(nh, nkv, D, T);
    /* a few large channels, as real keys have */
    for (int h = 0; h < nkv; h++)
        for (int t = 0; t < T; t++) f.k[((size_t)h * T + t) * D + 5 + h] *= 4.0f;
    float *q = randv((size_t)nh * D, 1.0f), *obs = randv((size_t)nh * NO * D, 1.0f), o1[64], o2[64];
    const int cend = T - W;
    kv_policy *p;
    kv_bytes b;
    float o0[64];
    for (int pass = 0; pass < 2; pass++) { /* pool = C (TailorKV's static channels), then 12 */
    const int R = pass ? 12 : C;
    char sp[96];
    snprintf(sp, sizeof sp, "sparse:s=4,w=20,k=10,c=6,pool=%d,cbits=16", R);
    p = mkpol(&f, sp, 512);
    KT_REQUIRE(p && p->ops->observe, "create");
    p->ops->observe(p, obs, NO);
    REQ_OK(feed(p, &f, T0), "%s", kv_errdetail());
    REQ_OK(p->ops->attend(p, q, o1), "attend");
    for (int h = 0; h < nh; h++) {
        char chan[64];
        resident_reference(&f, obs, NO, T0, R, C, q + h * D, h, chan);
        char chosen[512] = {0};
        for (int r = 0; r < K; r++) {
            int best = -1;
            float bs = -INFINITY;
            for (int t = S; t < cend; t++) {
                if (chosen[t]) continue;
                float d = 0;
                for (int c = 0; c < D; c++)
                    if (chan[c]) d += q[h * D + c] * kv_round_half(f.k[((size_t)h * T + t) * D + c]);
                if (d > bs) bs = d, best = t;
            }
            chosen[best] = 1;
        }
        int toks[512], n = 0;
        for (int t = 0; t < T; t++)
            if (t < S || t >= cend || chosen[t]) toks[n++] = t;
        fixture one = {1, 1, D, T, f.k + (size_t)h * T * D, f.v + (size_t)h * T * D};
        dense_subset(&one, toks, n, q + h * D, o2 + h * D);
    }
    KT_CHECK(max_abs_diff(o1, o2, 64) < 1e-6, "pool %d: resident selection differs: %g", R,
             max_abs_diff(o1, o2, 64));
    if (pass == 0) memcpy(o0, o1, sizeof o0);
    p->ops->bytes(p, &b);
    KT_CHECK(b.resident == 2ull * nkv * (S + (T - cend)) * D * 4 + (uint64_t)nkv * D * 4 +
                               (uint64_t)nkv * R * T0 * 2,
             "resident %llu", (unsigned long long)b.resident);
    KT_CHECK(b.fetched_last == 2ull * nkv * K * D * 4, "fetched %llu (rows only)",
             (unsigned long long)b.fetched_last);
    kv_policy_free(p);
    }
    /* codes of the channel rows: resident bytes by cbits, selection close */
    const int cb[2] = {8, 4};
    for (int i = 0; i < 2; i++) {
        char spec[80];
        snprintf(spec, sizeof spec, "sparse:s=4,w=20,k=10,c=6,pool=6,cbits=%d", cb[i]);
        p = mkpol(&f, spec, 512);
        KT_REQUIRE(p, "create");
        p->ops->observe(p, obs, NO);
        REQ_OK(feed(p, &f, T0), "%s", kv_errdetail());
        float o3[64];
        REQ_OK(p->ops->attend(p, q, o3), "attend");
        p->ops->bytes(p, &b);
        uint64_t rows = (uint64_t)C * (((uint64_t)T0 * cb[i] + 7) / 8 + (uint64_t)(T0 + 63) / 64 * 4);
        KT_CHECK(b.resident == 2ull * nkv * (S + (T - cend)) * D * 4 + (uint64_t)nkv * D * 4 + nkv * rows,
                 "cbits %d resident %llu", cb[i], (unsigned long long)b.resident);
        double e = rel_err(o3, o0, 64);
        printf("# cbits %d: output vs fp16 channel rows %g\n", cb[i], e);
        KT_CHECK(e < 0.5, "cbits %d rel err %g", cb[i], e);
        kv_policy_free(p);
    }
    free(obs);
    free(q);
    freefix(&f);
}

/* The channel index arithmetic: codes decode within half a step of the
 * input, fp16 rows round, ties in the channel choice go to the lower one. */
static void test_select_index(void)
{
    float x[300], y[300];
    uint8_t codes[300];
    kv_half sc[5], zr[5];
    for (int t = 0; t < 300; t++) x[t] = 3.0f * kt_randn(&seed);
    for (int b = 4; b <= 8; b += 4) {
        kv_select_channel_row(x, 1, 300, b, codes, sc, zr, y, 1);
        double worst = 0;
        for (int t = 0; t < 300; t++) {
            float s = kv_half_to_f32(sc[t / 64]), z = kv_half_to_f32(zr[t / 64]);
            KT_CHECK(codes[t] < (1 << b) && y[t] == z + s * (float)codes[t], "code %d at %d", codes[t], t);
            double d = fabs(y[t] - x[t]) / (s > 0 ? s : 1);
            worst = d > worst ? d : worst;
        }
        KT_CHECK(worst <= 0.5 + 1e-2, "%d-bit codes: error %g steps", b, worst);
    }
    kv_select_channel_row(x, 1, 300, 16, NULL, NULL, NULL, y, 1);
    KT_CHECK(y[7] == kv_round_half(x[7]), "fp16 row");
    KT_CHECK(kv_select_rows_bytes(8, 100, 16) == 1600 && kv_select_rows_bytes(8, 100, 4) == 8 * (50 + 8),
             "row bytes");
    /* equal maxima, no queries: the lowest channels; NaN is never chosen */
    float chmax[8] = {1, 2, 2, 2, NAN, 0.5f, 2, 1};
    int ch[3];
    kv_select_pick_channels(NULL, 0, chmax, 1, 1, 8, 3, ch);
    KT_CHECK(ch[0] == 1 && ch[1] == 2 && ch[2] == 3, "ties: %d %d %d", ch[0], ch[1], ch[2]);
    /* pages: each bound holds its page's keys (up to fp16 rounding) */
    float k[40 * 4], mn[3 * 4], mx[3 * 4];
    for (int i = 0; i < 160; i++) k[i] = kt_randn(&seed);
    kv_select_page_bounds(k, 4, 40, 4, 16, mn, mx);
    int ok = 1;
    for (int t = 0; t < 40; t++)
        for (int c = 0; c < 4; c++) {
            float v = k[t * 4 + c];
            ok &= v >= mn[(t / 16) * 4 + c] - 1e-3f && v <= mx[(t / 16) * 4 + c] + 1e-3f;
        }
    KT_CHECK(ok, "page bounds");
}

/* select=pages: with a needle the page holding it is chosen, the tokens
 * fetched are exactly K, bytes follow the page index. */
static void test_sparse_pages(void)
{
    const int nh = 4, nkv = 2, D = 32, T = 512, T0 = 500, K = 16, P = 8;
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), o1[128], o2[128];
    plant_needles(&f, q, 200);
    kv_policy *p = attended(&f, "sparse:s=8,w=56,k=16,select=pages,page=8", 600, T0, q, o1);
    KT_REQUIRE(p, "create");
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, o2);
    double e = rel_err(o1, o2, 128);
    printf("# pages rel err %g\n", e);
    KT_CHECK(e < 0.5, "pages rel err %g", e);
    kv_bytes b;
    p->ops->bytes(p, &b);
    uint64_t np = (T0 + P - 1) / P;
    KT_CHECK(b.fetched_last == 2ull * nkv * K * D * 4, "fetched %llu", (unsigned long long)b.fetched_last);
    KT_CHECK(b.resident == 2ull * nkv * (8 + (T - (T - 56))) * D * 4 + (uint64_t)nkv * D * 4 + nkv * np * D * 4,
             "resident %llu", (unsigned long long)b.resident);
    kv_policy_free(p);
    free(q);
    freefix(&f);
}

/* select=pca (Loki): with every principal direction kept (C = D) the
 * projected score is q . (k - mean) / sqrt(D), the exact score less a
 * constant per head, so the selection and the output equal select=exact's;
 * with C < D it still finds the planted tokens; the basis is orthonormal. */
static void test_sparse_pca(void)
{
    const int nh = 4, nkv = 2, D = 32, T = 512, T0 = 500;
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), o1[128], o2[128], o3[128];
    plant_needles(&f, q, 200);
    const char *spec[3] = {"sparse:s=8,w=56,k=16,select=exact", "sparse:s=8,w=56,k=16,c=32,select=pca,cbits=16",
                           "sparse:s=8,w=56,k=16,c=8,select=pca,cbits=16"};
    float *out[3] = {o1, o2, o3};
    for (int i = 0; i < 3; i++) {
        kv_policy *p = attended(&f, spec[i], 600, T0, q, out[i]);
        KT_REQUIRE(p, "create %s", spec[i]);
        kv_policy_free(p);
    }
    KT_CHECK(max_abs_diff(o1, o2, 128) < 1e-4, "pca with C = D differs from exact: %g", max_abs_diff(o1, o2, 128));
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, o1);
    double e = rel_err(o3, o1, 128);
    printf("# pca C=8 rel err vs dense %g\n", e);
    KT_CHECK(e < 0.5, "pca C=8 rel err %g", e);
    float mean[32], basis[8 * 32];
    kv_select_pca(f.k, (size_t)D, T, D, 8, mean, basis);
    double worst = 0;
    for (int a = 0; a < 8; a++)
        for (int b = 0; b < 8; b++) {
            double d = 0;
            for (int c = 0; c < D; c++) d += (double)basis[a * D + c] * basis[b * D + c];
            worst = fmax(worst, fabs(d - (a == b)));
        }
    KT_CHECK(worst < 1e-4, "basis not orthonormal: %g", worst);
    /* the GPU engine refuses it, the CPU takes it */
    const kv_policy_geom g = {0, nh, nkv, D, 1024};
    kv_policy_params prm;
    kv_policy_params_default(&prm, KV_POL_SPARSE);
    prm.select = KV_SELECT_PCA;
    KT_CHECK(kv_policy_check(&prm, &g, KV_DEVICE_CPU) == KV_OK, "%s", kv_errdetail());
    KT_CHECK(kv_policy_check(&prm, &g, KV_DEVICE_CUDA) == KV_E_UNSUPPORTED, "pca on the GPU accepted");
    prm.select = KV_SELECT_PAGES;
    KT_CHECK(kv_policy_check(&prm, &g, KV_DEVICE_CUDA) == KV_OK, "pages on the GPU: %s", kv_errdetail());
    prm.select = KV_SELECT_RESIDENT;
    KT_CHECK(kv_policy_check(&prm, &g, KV_DEVICE_CUDA) == KV_OK, "resident on the GPU: %s", kv_errdetail());
    free(q);
    freefix(&f);
}

// --- quant ------------------------------------------------------------

/* Formula from lib/common/kv_layout.h, written out independently of lib/kv_quant. */
static uint64_t kivi_formula(int H, int T, int D, int b, int G, int R)
{
    int nq = T - R <= 0 ? 0 : (T - R) / G * G;
    int gv = G < D ? G : D;
    uint64_t codes = (uint64_t)nq * D * b / 8;
    uint64_t keys = codes + 4ull * (nq / G) * D;
    uint64_t vals = codes + 4ull * nq * (D / gv);
    uint64_t res = 2ull * (T - nq) * D * 2;
    return (uint64_t)H * (keys + vals + res);
}

/* NaN and inf in keys or queries: the selection must terminate, stay
 * inside its buffers and be deterministic.  Keys whose every channel is
 * NaN score NaN in both modes and rank last, so with enough finite
 * candidates none is fetched and the output stays finite.  (Before NaN
 * ranked as -inf, the quickselect's scans ran off the candidate array.) */
static void test_sparse_selection_survives_nan_and_inf(void)
{
    const int nh = 4, nkv = 2, D = 16, T = 160, T0 = 150;
    const char *specs[] = {"sparse:s=2,w=8,k=6,c=4", "sparse:s=2,w=8,k=6,select=exact",
                           "sparse:s=2,w=8,k=6,c=4,reduce=max"};
    for (int sp = 0; sp < 3; sp++) {
        fixture f = mkfix(nh, nkv, D, T);
        for (int h = 0; h < nkv; h++)
            for (int t = 10; t < 140; t += 9)
                for (int c = 0; c < D; c++) f.k[((size_t)h * T + t) * D + c] = NAN;
        float *q = randv((size_t)nh * D, 1.0f), o1[64], o2[64];
        kv_policy *p = attended(&f, specs[sp], 256, T0, q, o1);
        KT_REQUIRE(p, "create %s", specs[sp]);
        REQ_OK(p->ops->attend(p, q, o2), "attend");
        int finite = 1;
        for (int i = 0; i < nh * D; i++) finite &= isfinite(o1[i]) != 0;
        KT_CHECK(finite, "%s: a NaN key was fetched while finite candidates were left", specs[sp]);
        KT_CHECK(!memcmp(o1, o2, sizeof o1), "%s: selection is not deterministic", specs[sp]);
        /* a NaN query and infinite keys: any output, but an answer */
        q[3] = NAN;
        f.k[((size_t)1 * T + 50) * D + 2] = INFINITY;
        kv_policy_free(p);
        p = mkpol(&f, specs[sp], 256);
        KT_REQUIRE(p, "create %s", specs[sp]);
        REQ_OK(feed(p, &f, T0), "%s", kv_errdetail());
        REQ_OK(p->ops->attend(p, q, o1), "attend with a NaN query");
        /* every candidate NaN */
        for (size_t i = 0; i < (size_t)nkv * T * D; i++) f.k[i] = NAN;
        kv_policy_free(p);
        p = mkpol(&f, specs[sp], 256);
        KT_REQUIRE(p, "create %s", specs[sp]);
        REQ_OK(feed(p, &f, T0), "%s", kv_errdetail());
        REQ_OK(p->ops->attend(p, q, o1), "attend over NaN keys only");
        kv_policy_free(p);
        free(q);
        freefix(&f);
    }
}

static void test_quant_bytes(void)
{
    const int nh = 4, nkv = 2, D = 32, T = 300;
    fixture f = mkfix(nh, nkv, D, T);
    const char *specs[] = {"quant", "quant:bits=2,group=16,residual=20", "quant:bits=4,g=8,r=0"};
    const int bb[] = {1, 2, 4}, gg[] = {64, 16, 8}, rr[] = {128, 20, 0};
    float row[64] = {0};
    for (int i = 0; i < 3; i++) {
        kv_policy *p = mkpol(&f, specs[i], 400);
        KT_REQUIRE(p, "create %s", specs[i]);
        int bad = 0;
        for (int t = 0; t < T; t++) {
            for (int c = 0; c < nkv * D; c++) row[c] = kt_randn(&seed);
            REQ_OK(p->ops->append(p, t, row, row), "append");
            kv_bytes b;
            p->ops->bytes(p, &b);
            if (b.resident != kivi_formula(nkv, t + 1, D, bb[i], gg[i], rr[i]) || b.host || b.fetched_total) {
                if (!bad++) KT_CHECK(0, "%s at T=%d: %llu vs %llu", specs[i], t + 1,
                                     (unsigned long long)b.resident,
                                     (unsigned long long)kivi_formula(nkv, t + 1, D, bb[i], gg[i], rr[i]));
            }
        }
        kv_policy_free(p);
    }
    freefix(&f);
}

static void test_quant_accuracy(void)
{
    seed = 0x9a17b3c5d2e1ULL; /* fixed data: the bounds below are for it */
    const int nh = 4, nkv = 2, D = 64, T = 400;
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), o1[256], o2[256], o3[256];
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, o2);
    /* error (RMS, in units of the values' RMS of 1) falls with the bit
     * width and stays bounded; random keys make 1-bit scores much sharper */
    const char *specs[] = {"quant:bits=1", "quant:bits=2", "quant:bits=4"};
    const double bound[] = {1.5, 0.15, 0.03};
    double err[3];
    for (int i = 0; i < 3; i++) {
        kv_policy *p = mkpol(&f, specs[i], T);
        KT_REQUIRE(p, "create");
        REQ_OK(feed(p, &f, 333), "%s", kv_errdetail());
        REQ_OK(p->ops->attend(p, q, o1), "attend");
        err[i] = rms_diff(o1, o2, (size_t)nh * D);
        printf("# %s rms err %g\n", specs[i], err[i]);
        KT_CHECK(err[i] < bound[i] && err[i] > 1e-4, "%s rel err %g", specs[i], err[i]);
        /* ingest of everything gives the same result as ingest + appends */
        kv_policy *p2 = mkpol(&f, specs[i], T);
        KT_REQUIRE(p2, "create");
        REQ_OK(feed(p2, &f, T), "%s", kv_errdetail());
        REQ_OK(p2->ops->attend(p2, q, o3), "attend");
        KT_CHECK(memcmp(o1, o3, sizeof o1) == 0, "%s: ingest vs appends differ", specs[i]);
        kv_policy_free(p2);
        kv_policy_free(p);
    }
    KT_CHECK(err[2] < err[1] && err[1] < err[0], "errors not decreasing: %g %g %g", err[0], err[1], err[2]);
    /* fewer tokens than the residual: nothing is quantized, fp16 exactly */
    kv_policy *p = mkpol(&f, "quant:residual=400", T);
    kv_policy *pf = mkpol(&f, "full:dtype=f16", T);
    KT_REQUIRE(p && pf, "create");
    REQ_OK(feed(p, &f, 100), "feed");
    REQ_OK(feed(pf, &f, 100), "feed");
    REQ_OK(p->ops->attend(p, q, o1), "attend");
    REQ_OK(pf->ops->attend(pf, q, o3), "attend");
    KT_CHECK(memcmp(o1, o3, sizeof o1) == 0, "quant below residual != full f16: %g", max_abs_diff(o1, o3, 256));
    kv_policy_free(pf);
    kv_policy_free(p);
    /* geometry the layout cannot pack is refused */
    kv_policy_params prm;
    REQ_OK(kv_policy_parse("quant:group=48", 1, &prm), "parse");
    kv_policy_geom g = {0, 4, 2, 64, 100};
    kv_policy *bad = NULL;
    KT_CHECK(kv_policy_new(&g, &prm, &bad) == KV_E_USAGE && !bad, "group 48 with dim 64 accepted");
    free(q);
    freefix(&f);
}

// --- dsq -------------------------------------------------------------

/* Packed windows + fp16 rest, from lib/common/kv_layout.h (mask counted once),
 * keys at kb bits and values at vb. */
static uint64_t dsq_formula2(int H, int T, int packed_windows, int D, int W, int S, int kb, int vb,
                             int G)
{
    int gd = G < D ? G : D;
    uint64_t nn = (uint64_t)(W - S);
    uint64_t common = (uint64_t)S * D + 2ull * D + 4ull * nn * (D / gd); /* sal, sscale, scale+zero */
    uint64_t win = W / 8 + 2 * common + nn * D * (uint64_t)(kb + vb) / 8 + 2ull * D; /* + codes, key base */
    uint64_t rest = (uint64_t)(T - packed_windows * W) * D * 2 * 2;
    return (uint64_t)H * ((uint64_t)packed_windows * win + rest);
}

static void test_dsq(void)
{
    const int nh = 4, nkv = 2, D = 64, T = 300, W = 64, S = 6, S20 = 13; /* defaults: 10% salient */
    fixture f = mkfix(nh, nkv, D, T);
    float *q = randv((size_t)nh * D, 1.0f), o1[256], o2[256];
    kv_attend_dense(q, f.k, f.v, T, T, nh, nkv, D, o2);
    kv_policy *p = mkpol(&f, "dsq", 400);
    KT_REQUIRE(p, "create");
    REQ_OK(feed(p, &f, 250), "%s", kv_errdetail());
    kv_bytes b;
    p->ops->bytes(p, &b);
    KT_CHECK(b.resident == dsq_formula2(nkv, T, 0, D, W, S, 4, 2, 32), "before attend %llu vs %llu",
             (unsigned long long)b.resident, (unsigned long long)dsq_formula2(nkv, T, 0, D, W, S, 4, 2, 32));
    REQ_OK(p->ops->attend(p, q, o1), "attend");
    KT_CHECK(memcmp(o1, o2, sizeof o1) != 0 && rms_diff(o1, o2, 256) < 1e-3, "first attend is fp16: %g",
             rms_diff(o1, o2, 256));
    p->ops->bytes(p, &b);
    KT_CHECK(b.resident == dsq_formula2(nkv, T, T / W, D, W, S, 4, 2, 32), "after attend %llu vs %llu",
             (unsigned long long)b.resident, (unsigned long long)dsq_formula2(nkv, T, T / W, D, W, S, 4, 2, 32));
    REQ_OK(p->ops->attend(p, q, o1), "attend");
    double e = rms_diff(o1, o2, 256);
    printf("# dsq rms err %g\n", e);
    KT_CHECK(e > 1e-4 && e < 0.1, "dsq rms err %g", e);
    kv_policy_free(p);
    /* observe(): windows packed at ingest from the prompt's queries */
    p = mkpol(&f, "dsq:salient=0.25", 400);
    KT_REQUIRE(p && p->ops->observe, "observe");
    float *qs = randv((size_t)nh * 4 * D, 1.0f);
    p->ops->observe(p, qs, 4);
    REQ_OK(feed(p, &f, 200), "%s", kv_errdetail());
    p->ops->bytes(p, &b);
    KT_CHECK(b.resident == dsq_formula2(nkv, T, 3, D, W, 16, 4, 2, 32), "observe: %llu vs %llu",
             (unsigned long long)b.resident, (unsigned long long)dsq_formula2(nkv, T, 3, D, W, 16, 4, 2, 32));
    kv_policy_free(p);
    free(qs);
    /* HCAP: fewer tokens and channels read, the output stays close */
    p = mkpol(&f, "dsq:keep=0.5,chan=0.005", 400);
    KT_REQUIRE(p, "create");
    KT_CHECK(p->wants_prediction, "HCAP tokens want the predicted query");
    REQ_OK(feed(p, &f, 250), "%s", kv_errdetail());
    REQ_OK(p->ops->attend(p, q, o1), "attend");
    p->ops->predict(p, q);
    REQ_OK(p->ops->attend(p, q, o1), "attend");
    e = rms_diff(o1, o2, 256);
    printf("# dsq+hcap rms err %g\n", e);
    KT_CHECK(e > 1e-4 && e < 0.3, "hcap rms err %g", e);
    kv_policy_free(p);
    /* keys and values at their own bit widths: the bytes follow, and 4-bit
     * key deltas are closer to dense attention than 2-bit ones */
    double err[2];
    for (int i = 0; i < 2; i++) {
        p = mkpol(&f, i ? "dsq:salient=0.2,kbits=4,vbits=2" : "dsq:salient=0.2,bits=2", 400);
        KT_REQUIRE(p, "create");
        REQ_OK(feed(p, &f, 250), "%s", kv_errdetail());
        REQ_OK(p->ops->attend(p, q, o1), "attend");
        p->ops->bytes(p, &b);
        uint64_t want = dsq_formula2(nkv, T, T / W, D, W, S20, i ? 4 : 2, 2, 32);
        KT_CHECK(b.resident == want, "kbits %d: %llu vs %llu", i ? 4 : 2,
                 (unsigned long long)b.resident, (unsigned long long)want);
        REQ_OK(p->ops->attend(p, q, o1), "attend");
        err[i] = rms_diff(o1, o2, 256);
        kv_policy_free(p);
    }
    printf("# dsq rms err kbits 2: %g, kbits 4: %g\n", err[0], err[1]);
    KT_CHECK(err[1] < err[0], "4-bit keys (%g) not closer than 2-bit (%g)", err[1], err[0]);
    free(q);
    freefix(&f);
}

int main(void)
{
    KT_RUN(test_parse_single);
    KT_RUN(test_parse_per_layer);
    KT_RUN(test_parse_rejects);
    KT_RUN(test_defaults_fill_what_the_spec_leaves_out);
    KT_RUN(test_check_per_device);
    KT_RUN(test_dense_matches_naive);
    KT_RUN(test_dense_matches_reference_long);
    KT_RUN(test_dense_parallel_same_bits);
    KT_RUN(test_full_equals_dense);
    KT_RUN(test_streaming);
    KT_RUN(test_sparse_large_k_is_dense);
    KT_RUN(test_sparse_exact_selection);
    KT_RUN(test_sparse_approx);
    KT_RUN(test_sparse_resident_selection);
    KT_RUN(test_select_index);
    KT_RUN(test_sparse_pages);
    KT_RUN(test_sparse_pca);
    KT_RUN(test_sparse_selection_survives_nan_and_inf);
    KT_RUN(test_quant_bytes);
    KT_RUN(test_quant_accuracy);
    KT_RUN(test_dsq);
    return kt_done();
}
