/*
 * Unit tests of lib/eval/kv_metrics and kv_score: LongBench's per-sample
 * metrics and RULER's, and the numbers as eval.py / evaluate.py print them.
 * Expected values are what LongBench's metrics.py returns (rouge 1.0.1,
 * fuzzywuzzy without python-Levenshtein, jieba 0.42, Python 3.11); the
 * comments derive some of them by hand.  The Chinese cases need jieba's
 * real data (python3-jieba) and skip without it.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt.h"
#include "eval/kv_jsonl.h"
#include "eval/kv_metrics.h"
#include "eval/kv_niah.h"
#include "eval/kv_score.h"

static double m(kv_lb_metric k, const char *p, const char *g)
{
    double s = -1;
    kv_status st = kv_lb_metric_score(k, NULL, p, g, NULL, 0, false, &s);
    return st ? -1 : s;
}

static double cls(const char *p, const char *g, const char *const *c, int n)
{
    double s = -1;
    return kv_lb_metric_score(KV_LB_CLASSIFICATION, NULL, p, g, c, n, true, &s) ? -1 : s;
}

static void test_qa_f1(void)
{
    /* "the cat sat" -> [cat, sat] against [cat]: P 1/2, R 1, F1 2/3 */
    KT_NEAR(m(KV_LB_QA_F1, "The cat sat.", "a cat"), 2.0 / 3, 1e-15);
    KT_NEAR(m(KV_LB_QA_F1, "an apple and the pear", "Apple, pear!"), 0.8, 1e-15);
    KT_NEAR(m(KV_LB_QA_F1, "theatre", "the atre"), 0, 0);        /* \b: "theatre" keeps its "the" */
    KT_NEAR(m(KV_LB_QA_F1, "", "x"), 0, 0);
    KT_NEAR(m(KV_LB_QA_F1, "café, naïve", "Café naïve"), 1, 0);  /* Unicode lower case */
    KT_NEAR(m(KV_LB_QA_F1, "a a a b", "a b b"), 2.0 / 3, 1e-15); /* articles go, [b] vs [b, b] */
    KT_NEAR(m(KV_LB_QA_F1, "Ἀ the_end an-apple", "the end an apple"), 0, 0); /* _ is a word char */
}

static void test_rouge(void)
{
    KT_NEAR(m(KV_LB_ROUGE, "the cat sat on the mat. it was nice", "the cat was on the mat"),
            0.7692307644970415, 0);
    KT_NEAR(m(KV_LB_ROUGE, "...", "the cat"), 0, 0); /* no sentence: rouge raises, 0.0 */
    KT_NEAR(m(KV_LB_ROUGE, "a b c", ""), 0, 0);
    KT_NEAR(m(KV_LB_ROUGE, "  .  x", "x"), 0.6666666622222223, 0); /* a blank sentence is one word "" */
    KT_NEAR(m(KV_LB_ROUGE, "a a b. b a", "a b a"), 0.999999995, 0);
    /* an LCS walk of 991 steps overflows CPython's recursion limit: 0.0 */
    char hyp[8000];
    size_t k = 0;
    for (int i = 0; i < 991; i++) k += (size_t)snprintf(hyp + k, sizeof hyp - k, "%sw%d", i ? " " : "", i);
    KT_NEAR(m(KV_LB_ROUGE, hyp, "w0"), 0, 0);
    hyp[strlen(hyp) - 5] = 0; /* 990 words: the walk fits */
    KT_CHECK(m(KV_LB_ROUGE, hyp, "w0") > 0, "990 steps fit");
}

static void test_classification(void)
{
    const char *c1[] = {"Human", "Human being", "Location"};
    KT_NEAR(cls("Human and Human being", "Human", c1, 3), 0.5, 0);
    KT_NEAR(cls("Human being", "Human being", c1, 3), 1.0, 0); /* "Human" is inside the answer */
    const char *c2[] = {"a", "b", "ab"};
    /* [a, b, ab]: removing "a" shifts "b" under the iterator, which skips it */
    KT_NEAR(cls("ab", "ab", c2, 3), 0.5, 0);
    const char *c3[] = {"x", "y", "x", "xy"};
    KT_NEAR(cls("xy", "xy", c3, 4), 0.5, 0); /* remove() drops the first "x" each time */
    double s;
    KT_CHECK(kv_lb_metric_score(KV_LB_CLASSIFICATION, NULL, "a", "a", NULL, 0, false, &s) == KV_E_DATA,
             "all_classes null is refused");
}

static void test_numbers_and_code(void)
{
    KT_NEAR(m(KV_LB_RETRIEVAL, "Paragraph 3, not Paragraph 4", "Paragraph 3"), 0.5, 0);
    KT_NEAR(m(KV_LB_RETRIEVAL, "it is 12", "Paragraph 12"), 1, 0);
    KT_NEAR(m(KV_LB_RETRIEVAL, "Paragraph １２", "Paragraph 12"), 0, 0); /* fullwidth digits differ */
    KT_NEAR(m(KV_LB_RETRIEVAL_ZH, "答案是段落5", "段落5"), 1, 0);
    KT_CHECK(m(KV_LB_RETRIEVAL, "3", "no paragraph") == -1 && strstr(kv_errdetail(), "Paragraph"),
             "an answer without its paragraph is refused");
    KT_NEAR(m(KV_LB_COUNT, "I count 5, maybe 6 or 5", "5"), 2.0 / 3, 1e-15);
    KT_NEAR(m(KV_LB_COUNT, "none", "5"), 0, 0);
    /* the first line without ` # or //; fuzz.ratio 79 */
    KT_NEAR(m(KV_LB_CODE_SIM, "\n# comment\nreturn a + b\n", "    return a - b"), 0.79, 0);
    KT_NEAR(m(KV_LB_CODE_SIM, "`x`\n// y", "z = 1"), 0, 0);
    KT_NEAR(m(KV_LB_CODE_SIM, "", ""), 1, 0);
}

static void test_sample_score(void)
{
    const kv_lb_dataset *trec = kv_lb_dataset_find("trec"), *hq = kv_lb_dataset_find("hotpotqa");
    KT_REQUIRE(trec && hq && kv_lb_n_datasets == 21 && !kv_lb_dataset_find("hotpot"), "datasets");
    const char *cl[] = {"Human", "Location"};
    const char *ans[] = {"Human"};
    double s;
    /* trec keeps the first line: "Location" on line 2 does not count */
    KT_CHECK(!kv_lb_sample_score(trec, NULL, "\n\nHuman\nLocation", ans, 1, cl, 2, true, &s) && s == 1, "%g", s);
    const char *two[] = {"blue sky", "sky"};
    KT_CHECK(!kv_lb_sample_score(hq, NULL, "the sky", two, 2, NULL, 0, false, &s) && s == 1, "best answer");
    KT_CHECK(!kv_lb_sample_score(hq, NULL, "x", NULL, 0, NULL, 0, false, &s) && s == 0, "no answers: 0");
    KT_CHECK(kv_lb_sample_score(hq, NULL, "\xff", two, 2, NULL, 0, false, &s) == KV_E_DATA, "bad UTF-8");
}

static void test_chinese(void)
{
    kv_jieba *jb = NULL;
    KT_REQUIRE(kv_jieba_open(NULL, NULL, &jb) == KV_OK, "%s", kv_errdetail());
    double s;
    KT_CHECK(!kv_lb_metric_score(KV_LB_QA_F1_ZH, jb, "我爱北京天安门", "北京天安门", NULL, 0, false, &s) &&
                 fabs(s - 2.0 / 3) < 1e-15, "%g", s);
    KT_CHECK(!kv_lb_metric_score(KV_LB_QA_F1_ZH, jb, "北京，北京！", "北京", NULL, 0, false, &s) &&
                 fabs(s - 2.0 / 3) < 1e-15, "punctuation tokens dropped: %g", s);
    KT_CHECK(!kv_lb_metric_score(KV_LB_ROUGE_ZH, jb, "我爱北京。天安门很好", "北京天安门", NULL, 0, false, &s) &&
                 s == 0.4444444409876544, "%.17g", s);
    KT_CHECK(kv_lb_metric_score(KV_LB_QA_F1_ZH, NULL, "a", "b", NULL, 0, false, &s) == KV_E_USAGE,
             "no jieba, no Chinese metric");
    kv_jieba_free(jb);
}

static void test_ruler(void)
{
    const char *refs[] = {"1234567", "Alpha"};
    double s;
    KT_CHECK(!kv_ruler_sample_score(KV_RULER_MATCH_ALL, "1234567 and ALPHA", refs, 2, &s) && s == 1, "all");
    KT_CHECK(!kv_ruler_sample_score(KV_RULER_MATCH_ALL, "1234567", refs, 2, &s) && s == 0.5, "half");
    KT_CHECK(!kv_ruler_sample_score(KV_RULER_MATCH_PART, "1234567", refs, 2, &s) && s == 1, "part");
    KT_CHECK(!kv_ruler_sample_score(KV_RULER_MATCH_PART, "", refs, 2, &s) && s == 0, "empty");
    const char *sig[] = {"ΟΔΥΣΣΕΥΣ"};
    KT_CHECK(!kv_ruler_sample_score(KV_RULER_MATCH_ALL, "οδυσσευς", sig, 1, &s) && s == 1, "Unicode lower");
    char *p = kv_ruler_postprocess("  \x01 a\tb\x1f \n");
    KT_CHECK(p && !strcmp(p, "a\nb"), "postprocess: '%s'", p);
    free(p);
    bool known;
    KT_CHECK(kv_ruler_task_metric("qa_2", &known) == KV_RULER_MATCH_PART && known, "qa_2");
    KT_CHECK(kv_ruler_task_metric("niah_multikey_3", &known) == KV_RULER_MATCH_ALL && known, "niah");
    KT_CHECK(kv_ruler_task_metric("tasks-dev", &known) == KV_RULER_MATCH_ALL && !known, "unknown");
    /* sum / n * 100, then round(.., 2) */
    double v[] = {1, 0, 0.5};
    KT_CHECK(kv_ruler_aggregate(v, 3) == 50.0, "%g", kv_ruler_aggregate(v, 3));
    double t[] = {1, 0, 0};
    KT_CHECK(kv_ruler_aggregate(t, 3) == 33.33, "%.17g", kv_ruler_aggregate(t, 3));
}

static void test_python_numbers(void)
{
    KT_CHECK(kv_py_round2(33.335) == 33.34 && kv_py_round2(0.125) == 0.12 && kv_py_round2(2.675) == 2.67,
             "round(x, 2) on the exact binary value");
    const struct {
        double v;
        const char *s;
    } r[] = {{100.0, "100.0"}, {33.33, "33.33"}, {1e-05, "1e-05"}, {0.0001, "0.0001"}, {1e16, "1e+16"},
             {1e15, "1000000000000000.0"}, {0.1 + 0.2, "0.30000000000000004"}, {-2.5, "-2.5"},
             {1.2345678901234568e+17, "1.2345678901234568e+17"}, {0.0, "0.0"}};
    char b[64];
    for (size_t i = 0; i < sizeof r / sizeof r[0]; i++) {
        kv_py_repr(r[i].v, b, sizeof b);
        KT_CHECK(!strcmp(b, r[i].s), "repr %s, want %s", b, r[i].s);
    }
    /* numpy.mean of 0.1 .. 13.9 (pairwise sum) is exactly 7.0 */
    double a[139];
    for (int i = 0; i < 139; i++) a[i] = 0.1 * (i + 1);
    KT_CHECK(kv_np_mean(a, 139) == 7.0, "%.17g", kv_np_mean(a, 139));
    KT_CHECK(isnan(kv_np_mean(a, 0)), "empty mean is NaN");
    /* scorer: round(100 * total / n, 2); scorer_e: bins at 4000 and 8000 */
    double s[] = {1, 0, 0.5, 0.25};
    long long len[] = {100, 3999, 4000, 8000};
    kv_lb_score sc;
    kv_lb_aggregate(s, len, 4, true, &sc);
    KT_CHECK(sc.score == 43.75 && sc.bin[0] == 50 && sc.bin[1] == 50 && sc.bin[2] == 25, "%g %g %g %g",
             sc.score, sc.bin[0], sc.bin[1], sc.bin[2]);
    kv_lb_aggregate(s, len, 1, true, &sc);
    KT_CHECK(sc.bin[0] == 100 && isnan(sc.bin[1]) && sc.bin_n[1] == 0, "an empty bin is NaN");
}

static void test_pred_files(void)
{
    const char *good = "{\"pred\": \"x\", \"answers\": [\"x\", \"y\"], \"all_classes\": null, \"length\": 5}\n\n"
                       "{\"pred\": \"\", \"answers\": [], \"all_classes\": [\"a\"]}\n";
    kv_lb_preds p;
    KT_REQUIRE(kv_lb_preds_parse(good, strlen(good), "p", &p) == KV_OK, "%s", kv_errdetail());
    KT_CHECK(p.n == 2 && p.v[0].n_answers == 2 && p.v[0].length == 5 && p.v[1].line == 3 &&
                 p.v[1].has_classes && !p.v[0].has_classes && !p.v[1].has_length,
             "fields");
    kv_lb_preds_free(&p);
    const char *bad[] = {"{\"answers\": []}", "{\"pred\": 1, \"answers\": []}", "{\"pred\": \"\"}",
                         "{\"pred\": \"\", \"answers\": [1]}", "{\"pred\": \"\", \"answers\": [], \"length\": 1e300}",
                         "{\"pred\": \"\", \"answers\": []}\n[", "{\"pred\": \"\", \"answers\": [], \"all_classes\": 3}"};
    const char *where[] = {"p:1:", "p:1:", "p:1:", "p:1: answers[0]", "p:1: \"length\"", "p:2:", "p:1:"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_errclear();
        KT_CHECK(kv_lb_preds_parse(bad[i], strlen(bad[i]), "p", &p) == KV_E_DATA && strstr(kv_errdetail(), where[i]),
                 "case %zu: %s", i, kv_errdetail());
    }
    const char *r = "{\"index\": 3, \"pred\": \" 12 \", \"outputs\": [\"12\"], \"others\": {}}\n";
    kv_ruler_preds rp;
    KT_REQUIRE(kv_ruler_preds_parse(r, strlen(r), "r", &rp) == KV_OK, "%s", kv_errdetail());
    kv_ruler_score rs;
    KT_CHECK(!kv_ruler_score_preds(KV_RULER_MATCH_ALL, &rp, true, &rs) && rs.score == 100 && rs.nulls == 0 &&
                 rs.sample[0] == 1, "ruler file score");
    kv_ruler_score_free(&rs);
    kv_ruler_preds_free(&rp);
    const char *rbad = "{\"index\": 1e300, \"pred\": \"\", \"outputs\": [\"1\"]}";
    KT_CHECK(kv_ruler_preds_parse(rbad, strlen(rbad), "r", &rp) == KV_E_DATA, "index 1e300 refused");
}

/* The readers' growth rule and their skipped-line records. */
static void test_grow_and_bad_lines(void)
{
    int *v = NULL, cap = 0, n = 0;
    for (; n < 100; n++) {
        int *nv = kv_grow(v, n, &cap, sizeof *nv, 4);
        KT_REQUIRE(nv, "grow at %d", n);
        v = nv;
        v[n] = n;
    }
    KT_CHECK(cap == 128 && v[99] == 99 && v[0] == 0, "cap %d", cap);
    KT_CHECK(kv_grow(v, 50, &cap, sizeof *v, 4) == v && cap == 128, "room left: no move");
    free(v);
    kv_niah_bad *bad = NULL;
    int nb = 0, bcap = 0;
    for (int i = 0; i < 20; i++) {
        kv_fail(KV_E_DATA, "line %d is bad", i + 1);
        KT_REQUIRE(kv_niah_bad_add(&bad, &nb, &bcap, i + 1, "t.jsonl") == KV_OK, "add %d", i);
    }
    KT_CHECK(nb == 20 && bad[19].line == 20 && !strcmp(bad[19].why, "line 20 is bad") &&
                 !strcmp(bad[0].why, "line 1 is bad"),
             "%d bad lines", nb);
    for (int i = 0; i < nb; i++) free(bad[i].why);
    free(bad);
}

int main(void)
{
    KT_RUN(test_grow_and_bad_lines);
    KT_RUN(test_qa_f1);
    KT_RUN(test_rouge);
    KT_RUN(test_classification);
    KT_RUN(test_numbers_and_code);
    KT_RUN(test_sample_score);
    if (access(KV_JIEBA_DEFAULT_DIR "/dict.txt", R_OK) == 0) KT_RUN(test_chinese);
    else KT_SKIP(test_chinese, "no jieba data (apt-get install python3-jieba)");
    KT_RUN(test_ruler);
    KT_RUN(test_python_numbers);
    KT_RUN(test_pred_files);
    return kt_done();
}
