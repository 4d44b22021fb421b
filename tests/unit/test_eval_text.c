/*
 * Unit tests of the text primitives behind the official scorers:
 * lib/eval/kv_unicode (Python's lower/isspace/\w/\d, strict UTF-8 and
 * replacement decoding), kv_seqmatch (difflib's SequenceMatcher with its
 * autojunk heuristic; expected values from Python 3.11's difflib) and
 * kv_jieba on the fixture dictionary and HMM tables of tests/data/jieba
 * (expected cuts from jieba 0.42 run with the same files).
 */
#include <stdlib.h>
#include <string.h>

#include "kt.h"
#include "eval/kv_jieba.h"
#include "eval/kv_seqmatch.h"
#include "eval/kv_unicode.h"

static kv_ustr u(const char *s)
{
    kv_ustr x = {0};
    kv_utf8_decode(s, strlen(s), &x);
    return x;
}

static char *lower(const char *s)
{
    kv_ustr a = u(s), b;
    char *out = NULL;
    if (!kv_ustr_lower(&a, &b)) {
        kv_utf8_encode(b.c, b.n, &out, NULL);
        kv_ustr_free(&b);
    }
    kv_ustr_free(&a);
    return out;
}

static void test_lower_is_pythons(void)
{
    /* expected: Python 3.11 str.lower() */
    const char *cases[][2] = {
        {"Hello WORLD", "hello world"},
        {"ΣΟΦΟΣ", "σοφος"},           /* final sigma at the end of a word */
        {"ΟΔΥΣΣΕΥΣ ΣΑ", "οδυσσευς σα"}, /* inside a word, and a word start */
        {"Σ", "σ"},                   /* alone: not final */
        {"AΣ.", "aς."},               /* before a non-cased character */
        {"İstanbul", "i̇stanbul"},     /* U+0130: two code points */
        {"ÀÉÎ ＡＢＣ", "àéî ａｂｃ"},
        {"中文 Ǆ", "中文 ǆ"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *l = lower(cases[i][0]);
        KT_CHECK(l && !strcmp(l, cases[i][1]), "lower(%s) = %s, want %s", cases[i][0], l, cases[i][1]);
        free(l);
    }
}

static void test_properties(void)
{
    KT_CHECK(kv_uc_isspace(' ') && kv_uc_isspace(0x1C) && kv_uc_isspace(0x85) && kv_uc_isspace(0x3000) &&
                 kv_uc_isspace(0xA0) && !kv_uc_isspace(0x200B) && !kv_uc_isspace('a'),
             "isspace");
    KT_CHECK(kv_uc_isword('_') && kv_uc_isword(0x4E2D) && kv_uc_isword(0xE9) && kv_uc_isword(0x0663) &&
                 !kv_uc_isword('-') && !kv_uc_isword(0x3002),
             "\\w");
    KT_CHECK(kv_uc_isdecimal('7') && kv_uc_isdecimal(0xFF11) && kv_uc_isdecimal(0x0663) &&
                 !kv_uc_isdecimal(0x00B2) && !kv_uc_isdecimal(0x2460),
             "\\d is isdecimal: superscripts and circled digits are not");
    KT_CHECK(strlen(kv_uc_version) > 0, "version");
}

static void test_utf8(void)
{
    kv_ustr x;
    KT_CHECK(kv_utf8_decode("a\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80", 10, &x) == KV_OK && x.n == 4 &&
                 x.c[1] == 0xE9 && x.c[3] == 0x1F600,
             "decode");
    kv_ustr_free(&x);
    const char *bad[] = {"\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe4\xb8", "\x80"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        KT_CHECK(kv_utf8_decode(bad[i], strlen(bad[i]), &x) == KV_E_DATA, "bad %zu accepted", i);
    /* bytes.decode('utf-8', 'replace') */
    char *s;
    KT_REQUIRE(kv_utf8_sanitize("a\xe4\xb8" "b\xff\xc3\xa9", 7, &s, NULL) == KV_OK, "sanitize");
    KT_CHECK(!strcmp(s, "a\xef\xbf\xbd" "b\xef\xbf\xbd\xc3\xa9"), "got %s", s);
    free(s);
    KT_REQUIRE(kv_utf8_sanitize("\xed\xa0\x80", 3, &s, NULL) == KV_OK, "sanitize");
    KT_CHECK(!strcmp(s, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"), "a surrogate is three replacements");
    free(s);
}

static int fuzz(const char *a, const char *b)
{
    kv_ustr x = u(a), y = u(b);
    int r = -1;
    kv_fuzz_ratio(x.c, x.n, y.c, y.n, &r);
    kv_ustr_free(&x);
    kv_ustr_free(&y);
    return r;
}

static size_t matches(const char *a, const char *b)
{
    kv_ustr x = u(a), y = u(b);
    size_t m = 0;
    kv_seqmatch_matches(x.c, x.n, y.c, y.n, &m);
    kv_ustr_free(&x);
    kv_ustr_free(&y);
    return m;
}

static void test_seqmatch_is_difflibs(void)
{
    KT_CHECK(matches("abcd", "bcde") == 3, "abcd/bcde");
    KT_CHECK(matches("return a + b", "    return a - b") == 11, "code line");
    KT_CHECK(fuzz("return a + b", "    return a - b") == 79, "ratio 0.7857 -> 79");
    KT_CHECK(fuzz("kitten", "sitting") == 62, "0.615 -> 62");
    KT_CHECK(fuzz("", "") == 100 && fuzz("", "abc") == 0 && fuzz("same", "same") == 100, "edges");
    /* autojunk: b of 251 elements, 'x' 250 times (> 251/100 + 1): only 'y' matches */
    char a[300], b[300];
    memset(a, 'x', 250);
    a[250] = 'y';
    a[251] = 0;
    b[0] = 'y';
    memset(b + 1, 'x', 250);
    b[251] = 0;
    KT_CHECK(matches(a, b) == 1, "autojunk: %zu", matches(a, b));
    /* both letters popular: no match at all */
    for (int i = 0; i < 300; i++) a[i] = "ab"[i % 2], b[i] = "ba"[i % 2];
    a[300 - 1] = b[300 - 1] = 0;
    KT_CHECK(matches(a, b) == 0, "all popular: %zu", matches(a, b));
    /* under 200 elements nothing is junk */
    a[150] = b[150] = 0;
    KT_CHECK(matches(a, b) == 149, "no autojunk below 200: %zu", matches(a, b));
}

static kv_jieba *fixture(void)
{
    kv_jieba *j = NULL;
    if (kv_jieba_open("tests/data/jieba", NULL, &j)) return NULL;
    return j;
}

static char *cut(const kv_jieba *j, const char *s)
{
    kv_ustr x = u(s);
    kv_span *t = NULL;
    size_t n = 0;
    char *out = calloc(4 * x.n + 2 * 64 + 2, 1);
    if (!out || kv_jieba_cut(j, x.c, x.n, &t, &n)) {
        free(out);
        kv_ustr_free(&x);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        char *w;
        kv_utf8_encode(x.c + t[i].start, t[i].len, &w, NULL);
        if (i) strcat(out, "|");
        strcat(out, w);
        free(w);
    }
    free(t);
    kv_ustr_free(&x);
    return out;
}

static void test_jieba_cuts_as_jieba(void)
{
    kv_jieba *j = fixture();
    KT_REQUIRE(j, "fixture: %s", kv_errdetail());
    KT_CHECK(kv_jieba_total(j) == 2947, "total %lld", kv_jieba_total(j));
    /* expected: jieba 0.42 with tests/data/jieba's dictionary and HMM tables */
    const char *cases[][2] = {
        {"我爱北京天安门", "我|爱|北京|天安门"},
        {"北京大学生活", "北京大学|生活"},
        {"小明来北京上学", "小明|来|北京|上学"},
        {"今天天气很好!", "今天|天气|很|好|!"},
        {"C++ 和 3.14%\r\n好", "C++| |和| |3.14|%|\r\n|好"},
        {"大学生在北京大学", "大学生|在|北京大学"},
        {"小小明明来来", "小|小明|明|来|来"},
        {"ab12.5%cd", "ab12.5%|cd"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *c = cut(j, cases[i][0]);
        KT_CHECK(c && !strcmp(c, cases[i][1]), "cut(%s) = %s, want %s", cases[i][0], c, cases[i][1]);
        free(c);
    }
    char *c = cut(j, "");
    KT_CHECK(c && !c[0], "empty text, no tokens");
    free(c);
    kv_jieba_free(j);
}

static void test_jieba_refuses_bad_data(void)
{
    kv_jieba *j;
    KT_REQUIRE(kv_jieba_new(&j) == KV_OK, "new");
    const char *dicts[] = {"a 1\nb\n", "a 1\n\n", "a x\n", "a -3\n", "a 1\n\xff 2\n", "a 1 n\nb 2\tz\n"};
    const char *where[] = {"d:2:", "d:2:", "d:1:", "d:1: negative", "d:2:", "d:2:"};
    for (size_t i = 0; i < sizeof dicts / sizeof dicts[0]; i++) {
        kv_jieba *k;
        kv_jieba_new(&k);
        kv_errclear();
        kv_status st = kv_jieba_load_dict(k, dicts[i], strlen(dicts[i]), "d");
        KT_CHECK(st == KV_E_DATA && strstr(kv_errdetail(), where[i]), "dict %zu: %d %s", i, st, kv_errdetail());
        kv_jieba_free(k);
    }
    /* "1_000" and surrounding blanks are Python ints */
    KT_CHECK(kv_jieba_load_dict(j, "ab 1_000 n\n", 11, "d") == KV_OK && kv_jieba_total(j) == 1000, "1_000");
    const char *st_ok = "P={'B': -0.2, 'E': -3.14e+100, 'M': -3.14e+100, 'S': -1.4}";
    const char *tr_ok = "P={'B': {'E': -0.5}, 'E': {'B': -0.6}, 'M': {}, 'S': {'S': -0.7}}";
    const char *em_ok = "P={'B': {'\\u4e00': -3.6}, 'E': {}, 'M': {}, 'S': {'\\u4e00': -1}}";
    KT_CHECK(kv_jieba_load_hmm(j, st_ok, strlen(st_ok), tr_ok, strlen(tr_ok), em_ok, strlen(em_ok)) == KV_OK,
             "hmm: %s", kv_errdetail());
    const char *bad_start[] = {"P={'B': -0.2, 'E': 1, 'M': 1}", "P={'B': x}", "P={'X': 1}", "Q={}",
                               "P={'B': 1, 'B': 2, 'M': 1, 'S': 1, 'E': 1}", "P={'B': -0.2, 'E': 1, 'M': 1, 'S': 1"};
    for (size_t i = 0; i < sizeof bad_start / sizeof bad_start[0]; i++)
        KT_CHECK(kv_jieba_load_hmm(j, bad_start[i], strlen(bad_start[i]), tr_ok, strlen(tr_ok), em_ok,
                                   strlen(em_ok)) == KV_E_DATA,
                 "start %zu accepted", i);
    const char *bad_emit = "P={'B': {'ab': -3.6}, 'E': {}, 'M': {}, 'S': {}}";
    KT_CHECK(kv_jieba_load_hmm(j, st_ok, strlen(st_ok), tr_ok, strlen(tr_ok), bad_emit, strlen(bad_emit)) ==
                 KV_E_DATA, "a two-character emission key");
    kv_jieba_free(j);
    kv_jieba *none = NULL;
    KT_CHECK(kv_jieba_open("/nonexistent", NULL, &none) == KV_E_NOINPUT && strstr(kv_errdetail(), "python3-jieba"),
             "missing data names the package: %s", kv_errdetail());
}

int main(void)
{
    KT_RUN(test_lower_is_pythons);
    KT_RUN(test_properties);
    KT_RUN(test_utf8);
    KT_RUN(test_seqmatch_is_difflibs);
    KT_RUN(test_jieba_cuts_as_jieba);
    KT_RUN(test_jieba_refuses_bad_data);
    return kt_done();
}
