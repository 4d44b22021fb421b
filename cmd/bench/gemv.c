/*
 * kv-bench gemv: the decode projection (batch 1) of packed weights on the
 * GPU, per weight type, shape and kernel variant (kernels/eng_gemv_qv.cu),
 * against the device-to-device copy bandwidth measured in the same run and
 * the engine's F16 GEMV of the same shape.  Each variant's output is first
 * compared with the CPU reference (float64 sums of kv_quant_dequant_row's
 * values) by normalized error.  A table on a terminal, JSON when piped or
 * with --json.  The measuring is in lib/eval/kv_cuda_bench.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "kv_cli.h"
#include "common/kv_gemv.h"
#include "common/kv_ggml.h"
#include "eval/kv_cuda_bench.h"

int kv_bench_gemv_main(int argc, char **argv);

enum { O_TYPES = 't', O_SHAPES = 's', O_VARIANTS = 256, O_ITERS, O_REPS, O_NOCHECK, O_JSON };

static const kv_option opts[] = {
    {O_TYPES, 't', "types", "LIST", "weight types: q8_0, q4_k, q6_k, f16 (default all four)"},
    {O_SHAPES, 's', "shapes", "LIST", "ROWSxCOLS shapes (default Llama-3.2-1B's: 2048x2048, 512x2048, "
                                      "8192x2048, 2048x8192, 128256x2048)"},
    {O_VARIANTS, 0, "variants", "LIST", "packed kernels from" KV_GEMV_PACKED_HELP " (default all)"},
    {O_ITERS, 0, "iters", "N", "launches per timing (default 100)"},
    {O_REPS, 0, "reps", "N", "timings per kernel; the median is reported (default 5)"},
    {O_NOCHECK, 0, "no-check", NULL, "skip the comparison with the CPU reference"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench gemv", "[OPTIONS]",
    "Time the packed decode GEMV (Q8_0, Q4_K, Q6_K) against copy bandwidth and F16.", opts,
    "Batch 1, random rows quantized by this project's quantizer (64 distinct rows\n"
    "repeated), copies of W rotated to exceed L2 four times.  Bytes: W as stored\n"
    "(packed size), plus x and y.  F16 rows are timed once per shape (the engine's\n"
    "fp16 GEMV; variants do not apply).  Without a usable GPU (or a CUDA build) it exits 69."};

#define MAXL 16

static const struct {
    const char *name;
    int ggml;
} types[] = {{"q8_0", KV_GGML_Q8_0}, {"q4_k", KV_GGML_Q4_K}, {"q6_k", KV_GGML_Q6_K}, {"f16", KV_GGML_F16}};

/* Split a comma list into at most MAXL items through fn. */
static int split(const char *opt, const char *a, void (*fn)(const char *opt, const char *item, void *out, int i),
                 void *out)
{
    int n = 0;
    char *dup = strdup(a), *save = NULL;
    if (!dup) kv_cli_usage_error("out of memory");
    for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == MAXL) kv_cli_usage_error("%s: at most %d items", opt, MAXL);
        fn(opt, t, out, n++);
    }
    free(dup);
    if (!n) kv_cli_usage_error("%s: empty list", opt);
    return n;
}

static void one_type(const char *opt, const char *item, void *out, int i)
{
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++)
        if (!strcasecmp(item, types[k].name)) {
            ((int *)out)[i] = (int)k;
            return;
        }
    kv_cli_usage_error("%s: unknown type '%s' (q8_0, q4_k, q6_k, f16)", opt, item);
}

static void one_variant(const char *opt, const char *item, void *out, int i)
{
    kv_errclear();
    if (kv_gemv_variant_parse(item, true, (int *)out + i)) kv_cli_usage_error("%s: %s", opt, kv_errdetail());
}

static void one_shape(const char *opt, const char *item, void *out, int i)
{
    int *rc = (int *)out + 2 * i;
    char *end = NULL;
    long r = strtol(item, &end, 10), c = -1;
    if (end && (*end == 'x' || *end == 'X')) c = strtol(end + 1, &end, 10);
    if (!end || *end || r < 1 || c < 1 || r > (1L << 20) || c > (1L << 20))
        kv_cli_usage_error("%s: '%s' is not ROWSxCOLS (each 1..%ld)", opt, item, 1L << 20);
    rc[0] = (int)r, rc[1] = (int)c;
}

typedef struct {
    int type, rows, cols, variant; /* variant 0 for f16 */
    kv_bench_gemv_result r;
} row_t;

int kv_bench_gemv_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    int tsel[MAXL] = {0, 1, 2, 3}, nt = 4, vsel[MAXL] = {KV_GEMV_OLD, KV_GEMV_ROWS, KV_GEMV_DP4A}, nv = KV_GEMV_COUNT - 1, oi;
    int shapes[2 * MAXL] = {2048, 2048, 512, 2048, 8192, 2048, 2048, 8192, 128256, 2048}, ns = 5;
    int iters = 100, reps = 5, check = 1;
    bool json = false;
    const char *a;
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        switch (c) {
        case O_TYPES: nt = split("--types", a, one_type, tsel); break;
        case O_SHAPES: ns = split("--shapes", a, one_shape, shapes); break;
        case O_VARIANTS: nv = split("--variants", a, one_variant, vsel); break;
        case O_ITERS: iters = (int)kv_cli_long("--iters", a, 1, 1000000); break;
        case O_REPS: reps = (int)kv_cli_long("--reps", a, 1, 1000); break;
        case O_NOCHECK: check = 0; break;
        case O_JSON: json = true; break;
        }
    }
    if (oi < argc) kv_cli_usage_error("unexpected operand '%s'", argv[oi]);
    for (int i = 0; i < ns; i++)
        for (int k = 0; k < nt; k++) {
            const int blk = types[tsel[k]].ggml == KV_GGML_F16 ? 8 : types[tsel[k]].ggml == KV_GGML_Q8_0 ? 32 : 256;
            if (shapes[2 * i + 1] % blk)
                kv_cli_usage_error("--shapes: %d columns are not a multiple of the %s block (%d)", shapes[2 * i + 1],
                                   types[tsel[k]].name, blk);
        }

    kv_bench_device dev;
    kv_status st = kv_cuda_bench_device(&dev);
    if (st) return kv_report(st, "GPU");
    double copy = 0;
    if ((st = kv_cuda_bench_copy((size_t)1 << 30, 20, reps, &copy))) return kv_report(st, "copy bandwidth");
    /* every list may repeat an item, so size by the product, not by the distinct names */
    row_t *res = calloc((size_t)ns * (size_t)nt * (size_t)nv, sizeof *res);
    if (!res) return kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "results");
    int n = 0;
    for (int i = 0; i < ns; i++)
        for (int k = 0; k < nt; k++) {
            const int f16 = types[tsel[k]].ggml == KV_GGML_F16;
            for (int v = 0; v < (f16 ? 1 : nv); v++) {
                row_t *o = &res[n];
                o->type = tsel[k], o->rows = shapes[2 * i], o->cols = shapes[2 * i + 1];
                o->variant = f16 ? 0 : vsel[v];
                kv_bench_gemv_cfg cfg = {types[tsel[k]].ggml, o->rows, o->cols, f16 ? 1 : vsel[v], iters, reps,
                                         check};
                kv_progress("%s %dx%d %s", types[tsel[k]].name, o->rows, o->cols,
                            f16 ? "f16" : kv_gemv_variant_name(vsel[v]));
                if ((st = kv_cuda_bench_gemv(&cfg, &o->r))) {
                    kv_progress_done();
                    int rc = kv_report(st, "%s %dx%d", types[tsel[k]].name, o->rows, o->cols);
                    free(res); /* o points into res */
                    return rc;
                }
                n++;
            }
        }
    kv_progress_done();
    char date[64];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    /* speedups: against the old kernel of the same type and shape, and against F16 of the shape */
    double *vs_old = calloc((size_t)n + 1, sizeof *vs_old), *vs_f16 = calloc((size_t)n + 1, sizeof *vs_f16);
    if (!vs_old || !vs_f16) {
        free(res), free(vs_old), free(vs_f16);
        return kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "results");
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            if (res[j].rows != res[i].rows || res[j].cols != res[i].cols) continue;
            if (res[j].type == res[i].type && res[j].variant == KV_GEMV_OLD) vs_old[i] = res[j].r.seconds / res[i].r.seconds;
            if (res[j].variant == 0) vs_f16[i] = res[j].r.seconds / res[i].r.seconds;
        }
    if (kv_want_json(stdout, json)) {
        printf("{\n  \"bench\": \"gemv\",\n  \"date\": \"%s\",\n", date);
        printf("  \"device\": {\"name\": \"%s\", \"sms\": %d, \"l2_bytes\": %zu, \"driver\": %d, "
               "\"runtime\": %d},\n", dev.name, dev.sms, dev.l2_bytes, dev.driver, dev.runtime);
        printf("  \"iters\": %d,\n  \"reps\": %d,\n  \"copy_bytes_per_s\": %.4e,\n  \"results\": [\n", iters, reps,
               copy);
        for (int i = 0; i < n; i++) {
            const row_t *o = &res[i];
            printf("    {\"type\": \"%s\", \"rows\": %d, \"cols\": %d, \"variant\": \"%s\", \"us\": %.3f, "
                   "\"bytes\": %.0f, \"bytes_per_s\": %.4e, \"frac_of_copy\": %.4f, \"copies\": %d",
                   types[o->type].name, o->rows, o->cols, o->variant ? kv_gemv_variant_name(o->variant) : "f16",
                   o->r.seconds * 1e6, o->r.bytes, o->r.bytes_per_s, o->r.bytes_per_s / copy, o->r.copies);
            if (vs_old[i] > 0) printf(", \"speedup_vs_old\": %.3f", vs_old[i]);
            if (vs_f16[i] > 0) printf(", \"speedup_vs_f16\": %.3f", vs_f16[i]);
            if (o->r.err >= 0) printf(", \"err_vs_cpu\": %.3e", o->r.err);
            printf("}%s\n", i + 1 < n ? "," : "");
        }
        printf("  ]\n}\n");
    } else {
        printf("%s (%d SMs, L2 %zu MiB), driver %d, runtime %d, %s\n", dev.name, dev.sms, dev.l2_bytes >> 20,
               dev.driver, dev.runtime, date);
        printf("copy bandwidth %.0f GB/s (read + write)\n", copy / 1e9);
        printf("%-5s %15s %-5s %9s %8s %8s %8s %8s %10s\n", "type", "shape", "kern", "time us", "GB/s", "of copy",
               "vs old", "vs f16", "err");
        for (int i = 0; i < n; i++) {
            const row_t *o = &res[i];
            char shape[32];
            snprintf(shape, sizeof shape, "%dx%d", o->rows, o->cols);
            printf("%-5s %15s %-5s %9.2f %8.0f %7.1f%%", types[o->type].name, shape,
                   o->variant ? kv_gemv_variant_name(o->variant) : "f16", o->r.seconds * 1e6, o->r.bytes_per_s / 1e9,
                   100 * o->r.bytes_per_s / copy);
            /* "-" where the baseline was not timed (--variants without old, --types without f16) */
            for (int k = 0; k < 2; k++) {
                const double x = k ? vs_f16[i] : vs_old[i];
                if (x > 0) printf(" %7.2fx", x);
                else printf(" %8s", "-");
            }
            if (o->r.err >= 0) printf(" %10.2e", o->r.err);
            printf("\n");
        }
    }
    free(vs_old), free(vs_f16), free(res);
    return KV_EXIT_OK;
}
