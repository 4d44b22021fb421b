/*
 * kt_kv: what the unit tests of the library share on top of kt.h (which
 * knows nothing of kvtools): OK, a required check of a kv_status that prints
 * the library's detail; kt_argmax, the greedy token of a logits row; and
 * kt_slurp, a whole file read through the library's own reader; kt_rm_rf,
 * the cleanup of a test's temporary directory.
 */
#ifndef KT_KV_H
#define KT_KV_H

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#include "kt.h"
#include "common/kv_file.h"
#include "common/kv_status.h"

/* Stop the test unless expr (evaluated once) is KV_OK. */
#define OK(expr)                                                               \
    do {                                                                       \
        kv_status st_ = (expr);                                                \
        KT_REQUIRE(st_ == KV_OK, "%s: %s", #expr, kv_errdetail());             \
    } while (0)

/* The index of the largest of x[0..n) (the first of equals). */
static inline int kt_argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* All of path, NUL-terminated (*len without the NUL); NULL if unreadable.
 * void *: the tests read text and bytes alike. */
static inline void *kt_slurp(const char *path, size_t *len)
{
    char *b = NULL;
    return kv_file_slurp(path, 0, NULL, &b, len) ? NULL : b;
}

/* rm -rf dir (a mkdtemp name: no quote in it); 0 when it went. */
static inline int kt_rm_rf(const char *dir)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd);
}

#endif
