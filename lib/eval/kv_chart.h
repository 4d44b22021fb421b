/*
 * kv_chart: SVG line and scatter charts, written by hand (no library), for
 * `kv-bench report` and --svg: several panels stacked in one image, each
 * with axes, ticks, grid lines, axis titles and a legend, a colour-blind
 * safe palette (Okabe-Ito) and a marker shape per series.  And the three
 * panels drawn from benchmark records (lib/eval/kv_batch): accuracy per
 * policy and length, accuracy against KV bytes, and ms per token against
 * length.
 */
#ifndef KV_CHART_H
#define KV_CHART_H

#include <stdbool.h>
#include <stdio.h>

#include <cjson/cJSON.h>

#include "common/kv_status.h"

typedef struct {
    const char *name; /* legend label */
    const double *x, *y; /* (n); NaN y leaves a gap */
    int n;
} kv_series;

typedef enum { KV_AXIS_LINEAR = 0, KV_AXIS_LOG2_BYTES, KV_AXIS_CATEGORY } kv_axis_kind;

typedef struct {
    const char *title, *xlabel, *ylabel;
    kv_axis_kind xkind;   /* category: x are indexes into xcats */
    const char *const *xcats;
    int ncat;
    double ymin, ymax;    /* NaN: from the data (linear, from 0) */
    bool lines;           /* join each series' points */
    const kv_series *s;
    int ns;
} kv_chart;

/* One SVG image of n panels stacked, under title. */
kv_status kv_chart_svg(FILE *f, const char *title, const kv_chart *charts, int n);

/* The report's three panels from records under headers (bench "ruler" or
 * "longbench"), written as one SVG. */
kv_status kv_chart_report(FILE *f, const cJSON *headers, cJSON *records);

#endif
