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

/* issue 14 item 3: numbers beyond int were converted with undefined
 * behaviour ("index": 1e300 and "length": -1e40 became -2147483648) */
static void test_numbers_out_of_range_are_refused(void)
{
    const char *bad[] = {
        "{\"index\": 1e300, \"input\": \"a\", \"outputs\": [\"1\"], \"length\": 5}",
        "{\"index\": 1, \"input\": \"a\", \"outputs\": [\"1\"], \"length\": -1e40}",
        "{\"index\": 2.5, \"input\": \"a\", \"outputs\": [\"1\"]}",
        "{\"index\": 2147483648, \"input\": \"a\", \"outputs\": [\"1\"]}",
        "{\"input\": \"a\", \"outputs\": [\"1\"], \"length\": -2}",
        "{\"input\": \"a\", \"outputs\": [\"1\"], \"answer_prefix\": 3}",
    };
    const char *what[] = {"\"index\" 1e+300", "\"length\" -1e+40", "\"index\" 2.5", "\"index\" 2.14748e+09",
                          "\"length\" -2", "\"answer_prefix\""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_niah_set s;
        kv_errclear();
        KT_CHECK(kv_niah_parse(bad[i], strlen(bad[i]), "t.jsonl", &s) == KV_E_DATA, "case %zu accepted", i);
        KT_CHECK(strstr(kv_errdetail(), "t.jsonl:1:") && strstr(kv_errdetail(), what[i]), "case %zu: %s", i,
                 kv_errdetail());
    }
    /* the limits themselves, and RULER's length -1, are fine */
    const char *ok = "{\"index\": -2147483648, \"input\": \"a\", \"outputs\": [\"1\"], \"length\": -1}\n"
                     "{\"index\": 2147483647, \"input\": \"a\", \"outputs\": [\"1\"], \"length\": 2147483647}";
    kv_niah_set s;
    KT_REQUIRE(kv_niah_parse(ok, strlen(ok), "t", &s) == KV_OK, "%s", kv_errdetail());
    KT_CHECK(s.tasks[0].index == -2147483647 - 1 && s.tasks[0].length == -1 && s.tasks[1].length == 2147483647,
             "limits");
    kv_niah_clear(&s);
}

static void test_lenient_parse_and_ids(void)
{
    const char *txt = "{\"index\": 5, \"input\": \"a\", \"outputs\": [\"1\"]}\n"
                      "{\"index\": 1e300, \"input\": \"a\", \"outputs\": [\"1\"]}\n"
                      "not json\n"
                      "{\"index\": 5, \"input\": \"b\", \"outputs\": [\"2\"], \"answer_prefix\": \" Answer:\"}\n";
    kv_niah_set s;
    KT_REQUIRE(kv_niah_parse_lenient(txt, strlen(txt), "t", &s) == KV_OK, "%s", kv_errdetail());
    KT_CHECK(s.n == 2 && s.n_bad == 2 && s.bad[0].line == 2 && s.bad[1].line == 3, "n %d bad %d", s.n, s.n_bad);
    KT_CHECK(strstr(s.bad[0].why, "index") != NULL, "why: %s", s.bad[0].why);
    KT_CHECK(!strcmp(s.tasks[0].id, "5") && !strcmp(s.tasks[1].id, "5#1"), "ids %s %s", s.tasks[0].id, s.tasks[1].id);
    KT_CHECK(s.tasks[1].answer_prefix && !strcmp(s.tasks[1].answer_prefix, " Answer:"), "answer_prefix");
    kv_niah_clear(&s);
    kv_errclear();
    KT_CHECK(kv_niah_parse(txt, strlen(txt), "t", &s) == KV_E_DATA && strstr(kv_errdetail(), "t:2:"),
             "strict parse stops at line 2: %s", kv_errdetail());
}

static void test_ruler_names_and_splits(void)
{
    char n[64];
    kv_niah_task_name("data/niah_single_2/validation.jsonl", n, sizeof n);
    KT_CHECK(!strcmp(n, "niah_single_2"), "%s", n);
    kv_niah_task_name("/x/qa_1.jsonl", n, sizeof n);
    KT_CHECK(!strcmp(n, "qa_1"), "%s", n);
    kv_niah_task_name("tests/data/niah4k/tasks-dev.jsonl", n, sizeof n);
    KT_CHECK(!strcmp(n, "tasks-dev"), "%s", n);
    KT_CHECK(kv_niah_task_gen("niah_multivalue") == 128 && kv_niah_task_gen("vt") == 30 &&
                 kv_niah_task_gen("cwe") == 120 && kv_niah_task_gen("fwe") == 50 && kv_niah_task_gen("qa_2") == 32 &&
                 kv_niah_task_gen("tasks-dev") == 0, "tokens_to_generate");
    /* RULER's niah template: no "\nQuestion:", the question is the last line */
    kv_niah_task t = {0};
    t.input = "Some text.\nMore text.\nWhat are all the special magic numbers for x mentioned in the provided text?";
    KT_CHECK(kv_niah_task_split(&t) == -1, "without answer_prefix: the repo's rule only");
    t.answer_prefix = " The special magic numbers for x mentioned in the provided text are";
    KT_CHECK(kv_niah_task_split(&t) == 21, "last line: %ld", kv_niah_task_split(&t));
    t.input = "ctx\nQuestion: Find all variables.\n";
    KT_CHECK(kv_niah_task_split(&t) == 3, "\\nQuestion: first");
    t.input = "no newline at all";
    KT_CHECK(kv_niah_task_split(&t) == -1, "none");
    char *outs[] = {"London", "Paris"};
    kv_niah_task q = {0, 0, NULL, outs, 2, 1, NULL, ""};
    KT_NEAR(kv_niah_score_metric(&q, "  paris\n", KV_RULER_MATCH_PART), 1.0, 0);
    KT_NEAR(kv_niah_score_metric(&q, "  paris\n", KV_RULER_MATCH_ALL), 0.5, 0);
}

static void test_load_missing_is_noinput(void)
{
    kv_niah_set s;
    KT_CHECK(kv_niah_load("/nonexistent/x.jsonl", &s) == KV_E_NOINPUT, "missing file");
}

static void test_score_string_match_all(void)
{
    char *outs[] = {"1234567", "Alpha"};
    kv_niah_task t = {0, 0, NULL, outs, 2, 1, NULL, ""};
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
    KT_RUN(test_numbers_out_of_range_are_refused);
    KT_RUN(test_lenient_parse_and_ids);
    KT_RUN(test_ruler_names_and_splits);
    KT_RUN(test_load_missing_is_noinput);
    KT_RUN(test_score_string_match_all);
    KT_RUN(test_question_offset);
    return kt_done();
}
