/*
 * Unit tests of lib/kv_niah's RULER JSONL reader, string_match_all scorer
 * and question split (the engine-driven run is tested by
 * tests/bats/kv-bench-ruler.bats on the real niah4k model).
 */
#include <string.h>

#include "kt.h"
#include "eval/kv_niah.h"

static void test_parse_good(void)
{
    const char *txt =
        "{\"index\": 7, \"input\": \"hay \\\"q\\\"\\nQuestion: x?\\nAnswer: \", \"outputs\": [\"123\", \"ab\"], \"length\": 1024}\n"
        "\n   \n"
        "{\"input\": \"second\", \"outputs\": [\"z\"]}";
    kv_niah_set s;
    kv_status st = kv_niah_parse(txt, strlen(txt), "t.jsonl", &s);
    KT_REQUIRE(st == KV_OK, "%s", kv_errdetail());
    KT_CHECK(s.n == 2, "n %d", s.n);
    KT_CHECK(s.tasks[0].index == 7 && s.tasks[0].length == 1024 && s.tasks[0].line == 1, "task 0 fields");
    KT_CHECK(!strcmp(s.tasks[0].input, "hay \"q\"\nQuestion: x?\nAnswer: "), "input %s", s.tasks[0].input);
    KT_CHECK(s.tasks[0].n_outputs == 2 && !strcmp(s.tasks[0].outputs[1], "ab"), "outputs");
    KT_CHECK(s.tasks[1].index == 1 && s.tasks[1].length == 0 && s.tasks[1].line == 4, "defaults, line %d",
             s.tasks[1].line);
    kv_niah_clear(&s);
}

static void test_parse_bad_names_line(void)
{
    const char *bad[] = {
        "{\"input\": \"a\", \"outputs\": [\"1\"]}\n{\"input\": \"b\"",        /* truncated */
        "{\"input\": \"a\", \"outputs\": [\"1\"]}\n\n{\"outputs\": [\"1\"]}", /* no input */
        "{\"input\": \"a\", \"outputs\": []}",                                /* empty outputs */
        "{\"input\": \"a\", \"outputs\": [1]}",                               /* not strings */
        "{\"input\": 5, \"outputs\": [\"1\"]}",
        "{\"input\": \"a\", \"outputs\": [\"1\"], \"index\": \"x\"}",
        "[\"input\"]",
        "",
        "\n\n",
    };
    const char *where[] = {"t:2:", "t:3:", "t:1:", "t:1: outputs[0]", "t:1:", "t:1: \"index\"", "t:1:",
                           "no tasks", "no tasks"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_niah_set s;
        kv_errclear();
        kv_status st = kv_niah_parse(bad[i], strlen(bad[i]), "t", &s);
        KT_CHECK(st == KV_E_DATA, "case %zu accepted", i);
        KT_CHECK(strstr(kv_errdetail(), where[i]) != NULL, "case %zu: '%s' lacks '%s'", i, kv_errdetail(),
                 where[i]);
        KT_CHECK(s.n == 0 && s.tasks == NULL, "case %zu leaves tasks", i);
    }
}

static void test_load_missing_is_noinput(void)
{
    kv_niah_set s;
    KT_CHECK(kv_niah_load("/nonexistent/x.jsonl", &s) == KV_E_NOINPUT, "missing file");
}

static void test_score_string_match_all(void)
{
    char *outs[] = {"1234567", "Alpha"};
    kv_niah_task t = {0, 0, NULL, outs, 2, 1};
    KT_NEAR(kv_niah_score(&t, "1234567 and alpha"), 1.0, 0);
    KT_NEAR(kv_niah_score(&t, "123456"), 0.0, 0);
    KT_NEAR(kv_niah_score(&t, "x1234567x"), 0.5, 0);
    KT_NEAR(kv_niah_score(&t, ""), 0.0, 0);
    t.n_outputs = 1;
    KT_NEAR(kv_niah_score(&t, "ALPHA 1234567"), 1.0, 0);
}

static void test_question_offset(void)
{
    const char *in = "a\nQuestion: no\nmore\nQuestion: What?\nAnswer: ";
    KT_CHECK(kv_niah_question_offset(in) == 19, "offset %ld", kv_niah_question_offset(in));
    KT_CHECK(kv_niah_question_offset("no question here") == -1, "none");
}

int main(void)
{
    KT_RUN(test_parse_good);
    KT_RUN(test_parse_bad_names_line);
    KT_RUN(test_load_missing_is_noinput);
    KT_RUN(test_score_string_match_all);
    KT_RUN(test_question_offset);
    return kt_done();
}
