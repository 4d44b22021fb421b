/*
 * kv_stats: median, nearest-rank p90 and total of a series (kv_stats.h).
 */
#include "common/kv_stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void kv_stats_of(double *x, int n, kv_stats *s)
{
    memset(s, 0, sizeof *s);
    if (n <= 0) return;
    s->n = n;
    for (int i = 0; i < n; i++) s->sum += x[i];
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    s->median = n % 2 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
    s->p90 = x[(int)ceil(0.9 * n) - 1];
    s->min = x[0];
    s->max = x[n - 1];
}

double kv_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}
