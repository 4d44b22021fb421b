/*
 * kv_chart: hand-written SVG charts and the benchmark report's panels (see
 * kv_chart.h).
 */
#include "eval/kv_chart.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eval/kv_batch.h"
#include "eval/kv_score.h"

enum { PANEL_W = 960, PANEL_H = 400, M_LEFT = 84, M_RIGHT = 300, M_TOP = 56, M_BOTTOM = 64 };

static const char *const palette[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7",
                                      "#E69F00", "#56B4E9", "#000000", "#8C6D31"};
enum { N_COLORS = 8, N_MARKERS = 5 };

static void xml_text(FILE *f, const char *s, size_t max_chars)
{
    size_t k = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if ((*p & 0xC0) != 0x80 && max_chars && k++ == max_chars) {
            fputs("\xe2\x80\xa6", f); /* … */
            return;
        }
        switch (*p) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        default:
            if (*p < 0x20) fputc(' ', f);
            else fputc(*p, f);
        }
    }
}

static double nice_step(double range, int ticks)
{
    if (!(range > 0)) return 1;
    double raw = range / ticks, p = pow(10, floor(log10(raw))), m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10) * p;
}

static void fmt_num(double v, char *b, size_t n)
{
    if (fabs(v) >= 1e4 || (fabs(v) < 1e-3 && v != 0)) snprintf(b, n, "%.3g", v);
    else snprintf(b, n, "%.10g", round(v * 1e6) / 1e6);
}

static void fmt_bytes(double v, char *b, size_t n)
{
    static const char *const u[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int k = 0;
    while (v >= 1024 && k < 5) {
        v /= 1024;
        k++;
    }
    snprintf(b, n, "%g %s", v, u[k]);
}

static void marker(FILE *f, int shape, double x, double y, const char *c)
{
    switch (shape % N_MARKERS) {
    case 0: fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4.5\" fill=\"%s\"/>", x, y, c); break;
    case 1: fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"8\" height=\"8\" fill=\"%s\"/>", x - 4, y - 4, c); break;
    case 2:
        fprintf(f, "<path d=\"M%.1f %.1fL%.1f %.1fL%.1f %.1fZ\" fill=\"%s\"/>", x, y - 5.5, x + 5, y + 4,
                x - 5, y + 4, c);
        break;
    case 3:
        fprintf(f, "<path d=\"M%.1f %.1fL%.1f %.1fL%.1f %.1fL%.1f %.1fZ\" fill=\"%s\"/>", x, y - 6, x + 5,
                y, x, y + 6, x - 5, y, c);
        break;
    default:
        fprintf(f, "<path d=\"M%.1f %.1fL%.1f %.1fM%.1f %.1fL%.1f %.1f\" stroke=\"%s\" stroke-width=\"2.5\"/>",
                x - 4.5, y - 4.5, x + 4.5, y + 4.5, x - 4.5, y + 4.5, x + 4.5, y - 4.5, c);
    }
}

typedef struct {
    double lo, hi; /* data space (log2 for bytes) */
    double p0, p1; /* pixel space */
} axis;

static double ax_map(const axis *a, double v) { return a->p0 + (v - a->lo) / (a->hi - a->lo) * (a->p1 - a->p0); }

static void panel(FILE *f, const kv_chart *c, double oy)
{
    const double x0 = M_LEFT, x1 = PANEL_W - M_RIGHT, y0 = oy + M_TOP, y1 = oy + PANEL_H - M_BOTTOM;
    fprintf(f, "<g>\n<text x=\"%.1f\" y=\"%.1f\" font-size=\"17\" font-weight=\"bold\">", x0, oy + 30);
    xml_text(f, c->title ? c->title : "", 0);
    fputs("</text>\n", f);
    /* y axis */
    double ymax = -INFINITY, ymin = 0;
    for (int i = 0; i < c->ns; i++)
        for (int k = 0; k < c->s[i].n; k++)
            if (isfinite(c->s[i].y[k]) && c->s[i].y[k] > ymax) ymax = c->s[i].y[k];
    if (!isfinite(ymax) || ymax <= 0) ymax = 1;
    if (!isnan(c->ymin)) ymin = c->ymin;
    if (!isnan(c->ymax)) ymax = c->ymax;
    double ystep = nice_step(ymax - ymin, 5);
    if (isnan(c->ymax)) ymax = ceil(ymax / ystep) * ystep;
    /* a few pixels inside the frame, so that points on the extremes show */
    axis ay = {ymin, ymax, y1 - 10, y0 + 10};
    /* x axis */
    axis ax = {0, 1, x0, x1};
    if (c->xkind == KV_AXIS_CATEGORY) {
        ax.lo = -0.5;
        ax.hi = c->ncat - 0.5;
    } else {
        double lo = INFINITY, hi = -INFINITY;
        for (int i = 0; i < c->ns; i++)
            for (int k = 0; k < c->s[i].n; k++) {
                double v = c->s[i].x[k];
                if (c->xkind == KV_AXIS_LOG2_BYTES) v = v > 0 ? log2(v) : NAN;
                if (isfinite(v) && v < lo) lo = v;
                if (isfinite(v) && v > hi) hi = v;
            }
        if (!isfinite(lo)) lo = 0, hi = 1;
        if (c->xkind == KV_AXIS_LOG2_BYTES) {
            lo = floor(lo) - 0.5;
            hi = ceil(hi) + 0.5;
        } else if (hi == lo) {
            hi = lo + 1;
        }
        ax.lo = lo;
        ax.hi = hi;
    }
    /* frame and grid */
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#fafafa\" stroke=\"#888\"/>\n",
            x0, y0, x1 - x0, y1 - y0);
    char lab[64];
    for (double v = ymin; v <= ymax + ystep * 1e-9; v += ystep) {
        double py = ax_map(&ay, v);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>", x0, py, x1, py);
        fmt_num(v, lab, sizeof lab);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" text-anchor=\"end\">%s</text>\n", x0 - 8,
                py + 4, lab);
    }
    if (c->xkind == KV_AXIS_CATEGORY) {
        for (int i = 0; i < c->ncat; i++) {
            double px = ax_map(&ax, i);
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#888\"/>", px, y1, px, y1 + 5);
            fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" text-anchor=\"middle\">", px, y1 + 20);
            xml_text(f, c->xcats[i], 16);
            fputs("</text>\n", f);
        }
    } else if (c->xkind == KV_AXIS_LOG2_BYTES) {
        int lo = (int)ceil(ax.lo), hi = (int)floor(ax.hi), stride = 1;
        while ((hi - lo) / stride > 8) stride++;
        for (int k = lo; k <= hi; k += stride) {
            double px = ax_map(&ax, k);
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>", px, y0, px, y1);
            fmt_bytes(ldexp(1, k), lab, sizeof lab);
            fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" text-anchor=\"middle\">%s</text>\n", px,
                    y1 + 20, lab);
        }
    } else {
        double st = nice_step(ax.hi - ax.lo, 6);
        for (double v = ceil(ax.lo / st) * st; v <= ax.hi + st * 1e-9; v += st) {
            double px = ax_map(&ax, v);
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>", px, y0, px, y1);
            fmt_num(v, lab, sizeof lab);
            fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" text-anchor=\"middle\">%s</text>\n", px,
                    y1 + 20, lab);
        }
    }
    /* axis titles */
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">", (x0 + x1) / 2, y1 + 44);
    xml_text(f, c->xlabel ? c->xlabel : "", 0);
    fprintf(f, "</text>\n<text transform=\"translate(%.1f %.1f) rotate(-90)\" font-size=\"13\" "
               "text-anchor=\"middle\">", x0 - 56, (y0 + y1) / 2);
    xml_text(f, c->ylabel ? c->ylabel : "", 0);
    fputs("</text>\n", f);
    /* series; on a category axis each series is shifted a little, so that
     * series with equal values stay visible side by side */
    for (int i = 0; i < c->ns; i++) {
        const kv_series *s = &c->s[i];
        const char *col = palette[i % N_COLORS];
        double dodge = c->xkind == KV_AXIS_CATEGORY ? (i - (c->ns - 1) / 2.0) * 7.0 : 0.0;
        fprintf(f, "<g><title>");
        xml_text(f, s->name, 0);
        fputs("</title>", f);
        if (c->lines) {
            bool pen = false;
            fputs("<path fill=\"none\" stroke-width=\"2\" stroke=\"", f);
            fprintf(f, "%s\" d=\"", col);
            for (int k = 0; k < s->n; k++) {
                double xv = c->xkind == KV_AXIS_LOG2_BYTES ? (s->x[k] > 0 ? log2(s->x[k]) : NAN) : s->x[k];
                if (!isfinite(xv) || !isfinite(s->y[k])) {
                    pen = false;
                    continue;
                }
                fprintf(f, "%c%.1f %.1f", pen ? 'L' : 'M', ax_map(&ax, xv) + dodge, ax_map(&ay, s->y[k]));
                pen = true;
            }
            fputs("\"/>", f);
        }
        for (int k = 0; k < s->n; k++) {
            double xv = c->xkind == KV_AXIS_LOG2_BYTES ? (s->x[k] > 0 ? log2(s->x[k]) : NAN) : s->x[k];
            if (isfinite(xv) && isfinite(s->y[k]))
                marker(f, i, ax_map(&ax, xv) + dodge, ax_map(&ay, s->y[k]), col);
        }
        fputs("</g>\n", f);
    }
    /* legend */
    double lx = x1 + 24, ly = y0 + 8;
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" font-weight=\"bold\">policy</text>\n", lx, ly + 4);
    for (int i = 0; i < c->ns; i++) {
        double yy = ly + 24 + 22 * i;
        const char *col = palette[i % N_COLORS];
        fprintf(f, "<g><title>");
        xml_text(f, c->s[i].name, 0);
        fputs("</title>", f);
        if (c->lines)
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/>",
                    lx, yy, lx + 24, yy, col);
        marker(f, i, lx + 12, yy, col);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\">", lx + 32, yy + 4);
        xml_text(f, c->s[i].name, 34);
        fputs("</text></g>\n", f);
    }
    fputs("</g>\n", f);
}

kv_status kv_chart_svg(FILE *f, const char *title, const kv_chart *charts, int n)
{
    const int top = 40, h = top + n * PANEL_H + 10;
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
               "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n"
               "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
               "<text x=\"%d\" y=\"28\" font-size=\"20\" font-weight=\"bold\">",
            PANEL_W, h, PANEL_W, h, M_LEFT);
    xml_text(f, title ? title : "", 0);
    fputs("</text>\n", f);
    for (int i = 0; i < n; i++) panel(f, &charts[i], top + (double)i * PANEL_H);
    fputs("</svg>\n", f);
    return ferror(f) ? kv_fail(KV_E_IO, "write error") : KV_OK;
}

// --- the report's panels ---------------------------------------------------------------------

typedef struct {
    double n, score, resident, dms, dec;
} cell;

kv_status kv_chart_report(FILE *f, const cJSON *headers, cJSON *records)
{
    const char *bench = kv_rec_str(headers->child, "bench", "");
    bool lb = !strcmp(bench, "longbench");
    cJSON *pols = kv_batch_policies(headers);
    if (!pols) return kv_fail(KV_E_NOMEM, "report");
    for (const cJSON *r = records->child; r; r = r->next) {
        const char *p = kv_rec_str(r, "policy", NULL);
        bool have = !p;
        for (const cJSON *q = pols->child; q && !have; q = q->next) have = !strcmp(q->valuestring, p);
        if (!have) cJSON_AddItemToArray(pols, cJSON_CreateString(p));
    }
    const int np = cJSON_GetArraySize(pols);
    /* x categories: RULER's lengths, LongBench-E's bins */
    double lens[64];
    int nx = 0;
    if (lb) {
        nx = KV_LB_NBINS;
    } else {
        for (const cJSON *r = records->child; r; r = r->next) {
            if (!kv_rec_str(r, "policy", NULL)) continue;
            double l = kv_rec_num(r, "length", 0);
            bool have = false;
            for (int i = 0; i < nx && !have; i++) have = lens[i] == l;
            if (!have && nx < 64) lens[nx++] = l;
        }
        for (int i = 1; i < nx; i++) /* ascending */
            for (int k = i; k > 0 && lens[k - 1] > lens[k]; k--) {
                double t = lens[k];
                lens[k] = lens[k - 1];
                lens[k - 1] = t;
            }
    }
    if (np == 0 || nx == 0) {
        cJSON_Delete(pols);
        return kv_fail(KV_E_DATA, "no finished samples to chart");
    }
    cell *c = calloc((size_t)np * (size_t)nx, sizeof *c);
    double *buf = calloc((size_t)np * (size_t)nx * 4 + (size_t)nx, sizeof *buf);
    kv_series *s = calloc((size_t)np * 3, sizeof *s);
    char (*cats)[32] = calloc((size_t)nx, sizeof *cats);
    const char **catp = calloc((size_t)nx, sizeof *catp);
    kv_status st = c && buf && s && cats && catp ? KV_OK : kv_fail(KV_E_NOMEM, "report");
    for (const cJSON *r = records->child; r && !st; r = r->next) {
        const char *p = kv_rec_str(r, "policy", NULL);
        if (!p) continue;
        int pi = 0;
        for (const cJSON *q = pols->child; q && strcmp(q->valuestring, p); q = q->next) pi++;
        double l = kv_rec_num(r, "length", 0);
        int xi = 0;
        if (lb) xi = kv_lb_bin_of((long long)l);
        else
            while (xi < nx && lens[xi] != l) xi++;
        cell *e = &c[pi * nx + xi];
        e->n++;
        e->score += kv_rec_num(r, "score", 0);
        e->resident += kv_rec_num(r, "resident_bytes", 0);
        e->dms += kv_rec_num(r, "decode_ms", 0);
        e->dec += kv_rec_num(r, "decoded", 0);
    }
    if (!st) {
        double *xs = buf; /* 0..nx-1 */
        for (int i = 0; i < nx; i++) {
            xs[i] = i;
            if (lb) snprintf(cats[i], sizeof cats[i], "%s", kv_lb_bin_names[i]);
            else snprintf(cats[i], sizeof cats[i], "%.0f", lens[i]);
            catp[i] = cats[i];
        }
        for (int pi = 0; pi < np; pi++) {
            double *acc = buf + nx + (size_t)pi * nx * 4, *byt = acc + nx, *mst = byt + nx;
            for (int i = 0; i < nx; i++) {
                const cell *e = &c[pi * nx + i];
                acc[i] = e->n ? 100.0 * e->score / e->n : NAN;
                byt[i] = e->n ? e->resident / e->n : NAN;
                mst[i] = e->dec > 0 ? e->dms / e->dec : NAN;
            }
            const char *name = cJSON_GetArrayItem(pols, pi)->valuestring;
            s[pi] = (kv_series){name, xs, acc, nx};
            s[np + pi] = (kv_series){name, byt, acc, nx};
            s[2 * np + pi] = (kv_series){name, xs, mst, nx};
        }
        const cJSON *cfg = kv_batch_config(headers);
        const char *model = kv_rec_str(cfg, "model", "");
        const char *slash = strrchr(model, '/');
        char title[512];
        snprintf(title, sizeof title, "kv-bench %s: %s on %s", lb ? "longbench" : "ruler",
                 slash ? slash + 1 : model, kv_rec_str(headers->child, "device_name", "?"));
        const char *xl = lb ? "sample length (LongBench-E bins, words)" : "task length (tokens)";
        kv_chart ch[3] = {
            {"Accuracy per policy and length", xl, lb ? "score (mean, x100)" : "accuracy (%)",
             KV_AXIS_CATEGORY, catp, nx, 0, 100, true, s, np},
            {"Accuracy against KV bytes", "resident KV bytes per sample (log scale; one point per length, joined in order)",
             lb ? "score (mean, x100)" : "accuracy (%)", KV_AXIS_LOG2_BYTES, NULL, 0, 0, 100, true,
             s + np, np},
            {"Decode time per token against length", xl, "ms per decoded token",
             KV_AXIS_CATEGORY, catp, nx, 0, NAN, true, s + 2 * np, np},
        };
        st = kv_chart_svg(f, title, ch, 3);
    }
    free(c);
    free(buf);
    free(s);
    free(cats);
    free(catp);
    cJSON_Delete(pols);
    return st;
}
