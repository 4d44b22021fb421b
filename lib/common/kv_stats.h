/*
 * kv_stats: the clock and the summary statistics every report prints for
 * a series of timings (median, 90th percentile, total), in one place so
 * that kv-run's report and the benchmarks agree on what "p90" means.
 */
#ifndef KV_STATS_H
#define KV_STATS_H

typedef struct {
    int n;
    double sum;    /* 0 when n == 0, as are the others */
    double median; /* the mean of the two middle values when n is even */
    double p90;    /* nearest rank: the ceil(0.9 n)-th smallest */
    double min, max;
} kv_stats;

/* Summarise x (n >= 0 values); x is sorted in place. */
void kv_stats_of(double *x, int n, kv_stats *s);

/* Milliseconds on the monotonic clock (for timing a span). */
double kv_now_ms(void);

#endif
