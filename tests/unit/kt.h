/*
 * kt: the tiny unit-test harness used by every tests/unit/test_*.c.  Output
 * is TAP ("ok 3 - name" / "not ok 3 - name"), which tests/run-tests.sh
 * counts.  A failed check prints where and why and marks the current test
 * failed; the test continues so one run shows every broken check.
 *
 *   static void test_roundtrip(void) { KT_CHECK(x == 1, "x=%d", x); }
 *   int main(void) { KT_RUN(test_roundtrip); return kt_done(); }
 */
#ifndef KT_H
#define KT_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int kt_count, kt_fail_count;
/* unused where a file's every test is compiled out (CUDA=0) */
static int kt_cur_failed __attribute__((unused));

#define KT_CHECK(cond, ...)                                                   \
    do {                                                                      \
        if (!(cond)) {                                                        \
            kt_cur_failed = 1;                                                \
            fprintf(stdout, "#   %s:%d: check failed: %s: ", __FILE__,        \
                    __LINE__, #cond);                                         \
            fprintf(stdout, __VA_ARGS__);                                     \
            fputc('\n', stdout);                                              \
        }                                                                     \
    } while (0)

/* Stop the current test (e.g. after a failed open). */
#define KT_REQUIRE(cond, ...)                                                 \
    do {                                                                      \
        if (!(cond)) { /* evaluated once: cond may have effects */            \
            kt_cur_failed = 1;                                                \
            fprintf(stdout, "#   %s:%d: required check failed: %s: ",         \
                    __FILE__, __LINE__, #cond);                               \
            fprintf(stdout, __VA_ARGS__);                                     \
            fputc('\n', stdout);                                              \
            return;                                                           \
        }                                                                     \
    } while (0)

#define KT_NEAR(a, b, tol)                                                    \
    KT_CHECK(fabs((double)(a) - (double)(b)) <= (tol), "%g vs %g (tol %g)",   \
             (double)(a), (double)(b), (double)(tol))

#define KT_RUN(fn)                                                            \
    do {                                                                      \
        kt_cur_failed = 0;                                                    \
        fn();                                                                 \
        kt_count++;                                                           \
        if (kt_cur_failed) kt_fail_count++;                                   \
        printf("%sok %d - %s\n", kt_cur_failed ? "not " : "", kt_count, #fn); \
        fflush(stdout);                                                       \
    } while (0)

/* A test that cannot run here (no GPU): reported as a TAP skip. */
#define KT_SKIP(fn, why)                                                      \
    do {                                                                      \
        kt_count++;                                                           \
        printf("ok %d - %s # SKIP %s\n", kt_count, #fn, why);                 \
    } while (0)

/* Does test name contain one of filter's comma-separated parts (no filter:
 * yes)?  The GPU tests take KV_TEST_FILTER=a,b so that compute-sanitizer
 * can run a few of them. */
static inline int kt_selected(const char *name, const char *filter)
{
    if (!filter || !*filter) return 1;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", filter);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
        if (strstr(name, t)) return 1;
    return 0;
}

/* fn run, or reported skipped when filter (see kt_selected) leaves it out */
#define KT_RUN_SELECTED(fn, filter)          \
    do {                                     \
        if (kt_selected(#fn, filter))        \
            KT_RUN(fn);                      \
        else                                 \
            KT_SKIP(fn, "not selected by KV_TEST_FILTER"); \
    } while (0)

static inline int kt_done(void)
{
    printf("1..%d\n", kt_count);
    return kt_fail_count ? 1 : 0;
}

/* Deterministic random numbers for tests (xorshift64*). */
static inline double kt_rand(unsigned long long *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return (double)((*s * 2685821657736338717ULL) >> 11) * (1.0 / 9007199254740992.0);
}

static inline float kt_randn(unsigned long long *s)
{
    double u1 = kt_rand(s), u2 = kt_rand(s);
    if (u1 < 1e-300) u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

#endif
