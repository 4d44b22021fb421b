/*
 * kv-bench attn: decode-attention kernels on the GPU (fp16 flash-decoding,
 * 1- and 2-bit packed KIVI) at several context lengths, against the
 * device-to-device copy bandwidth measured in the same run.  The variants
 * measured in docs/BENCHMARKS.md (Kernels) are selected by options.  A table
 * on a terminal, JSON when piped or with --json.  The measuring is in
 * lib/eval/kv_cuda_bench.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_cli.h"
#include "eval/kv_cuda_bench.h"

int kv_bench_attn_main(int argc, char **argv);

enum { O_CTX = 'c', O_HEADS = 256, O_KVH, O_DIM, O_GROUP, O_RESID, O_ITERS, O_REPS, O_CHECK,
       O_CHECKMAX, O_F16LEG, O_F16PF, O_F16UNROLL, O_F16WAVES, O_KIVI2VAR, O_KIVIK, O_K3NST,
       O_K3COMB, O_K3FUSED, O_K3CPS, O_K3DIAG, O_K3NOPF, O_K3ZALU, O_PDL, O_JSON };

static const kv_option opts[] = {
    {O_CTX, 'c', "contexts", "LIST", "context lengths (default 8192,32768,131072)"},
    {O_HEADS, 0, "heads", "N", "query heads (default 32)"},
    {O_KVH, 0, "kv-heads", "N", "KV heads (default 8)"},
    {O_DIM, 0, "head-dim", "N", "head dimension, a power of two 8..256 (default 128)"},
    {O_GROUP, 0, "group", "G", "KIVI group of the packed paths (default 64)"},
    {O_RESID, 0, "residual", "R", "KIVI fp16 residual tokens (default 128)"},
    {O_ITERS, 0, "iters", "N", "launches per timing (default 200)"},
    {O_REPS, 0, "reps", "N", "timings per path; the median is reported (default 7)"},
    {O_CHECK, 0, "check", NULL, "also compare each path with its CPU reference"},
    {O_CHECKMAX, 0, "check-max", "T", "with --check, only contexts up to T (default 32768)"},
    {O_F16LEG, 0, "f16-legacy", NULL, "variant: the register-streaming fp16 kernel, not the tensor-core one"},
    {O_F16PF, 0, "f16-prefetch", NULL, "variant: the fp16 loop that prefetches the next rows"},
    {O_F16UNROLL, 0, "f16-unroll", "N", "variant: fp16 rows in flight per lane, 4 (default) or 8"},
    {O_F16WAVES, 0, "f16-waves", "N", "variant: fp16 grid of N waves of blocks (default 1)"},
    {O_KIVI2VAR, 0, "kivi2-variant", "N", "variant of the packed kernel: 0 (default), 1, 2, 3, 7, 71; "
                                         "8, 16, 32 time stages and compute wrong results"},
    {O_KIVIK, 0, "kivi-kernel", "N", "packed kernel: 2 (v2) or 3 (v3, group 64; default: the engine's)"},
    {O_K3NST, 0, "kivi3-stages", "N", "variant of v3: shared-memory stages per warp, 2, 3 (default) or 4"},
    {O_K3COMB, 0, "kivi3-combine", NULL, "v3 merges the splits in a separate combine pass (the default)"},
    {O_K3FUSED, 0, "kivi3-fused", NULL, "variant of v3: the last block of each KV head merges the splits"},
    {O_K3CPS, 0, "kivi3-blocks", "N", "variant of v3: at most N blocks per SM in the grid (default: occupancy)"},
    {O_K3DIAG, 0, "kivi3-diag", "N", "v3 timing diagnostic, wrong results: 1 staging only, 2 compute only, "
                                     "3 and 4: 2 without the value / key MMAs"},
    {O_K3NOPF, 0, "kivi3-no-prefetch", NULL, "variant of v3: no L2 prefetch before the launch wait"},
    {O_K3ZALU, 0, "kivi3-zsum-alu", NULL, "variant of v3: value-operand sums in fp32 adds, not MMAs"},
    {O_PDL, 0, "pdl", "LEVEL", "programmatic dependent launch: 0 or 2 (default 2 on Hopper, as the engine)"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench attn", "[OPTIONS]",
    "Time the decode-attention kernels against device copy bandwidth.", opts,
    "One layer, batch 1, random fp16 data; inputs are rotated among enough copies to\n"
    "exceed L2 four times.  Bytes: fp16 K+V (fp16 path), codes + scales + zeros +\n"
    "fp16 residual of K and V (packed paths), plus q and the output.\n"
    "Without a usable GPU (or a CUDA build) it exits 69."};

#define MAXC 16

static void path_json(const char *name, const kv_bench_attn_path *p, double copy,
                      const kv_bench_attn_path *f16, int last)
{
    if (!p->ok) {
        printf("      \"%s\": null%s\n", name, last ? "" : ",");
        return;
    }
    printf("      \"%s\": {\"us\": %.3f, \"bytes\": %.0f, \"bytes_per_s\": %.4e, "
           "\"frac_of_copy\": %.4f, \"speedup_vs_f16\": %.3f",
           name, p->seconds * 1e6, p->bytes, p->bytes_per_s, p->bytes_per_s / copy,
           f16->seconds / p->seconds);
    if (p->err >= 0) printf(", \"err_vs_cpu\": %.3e", p->err);
    if (p->kernel) printf(", \"kernel\": %d", p->kernel);
    printf("}%s\n", last ? "" : ",");
}

static void target_json(const char *name, double value, double target, int last)
{
    printf("    \"%s\": {\"value\": %.4f, \"target\": %.4f, \"met\": %s}%s\n", name, value, target,
           value >= target ? "true" : "false", last ? "" : ",");
}

int kv_bench_attn_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    kv_bench_attn_cfg cfg = {32, 8, 128, 0, 64, 128, 200, 7, 0, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, -1};
    int ctx[MAXC] = {8192, 32768, 131072}, nctx = 3, oi, check = 0, check_max = 32768;
    bool json = false;
    const char *a;
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        switch (c) {
        case O_CTX: {
            nctx = 0;
            char *dup = strdup(a), *save = NULL;
            for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (nctx == MAXC) kv_cli_usage_error("at most %d contexts", MAXC);
                ctx[nctx++] = (int)kv_cli_long("--contexts", t, 1, 1 << 24);
            }
            free(dup);
            if (!nctx) kv_cli_usage_error("--contexts: empty list");
            break;
        }
        case O_HEADS: cfg.n_heads = (int)kv_cli_long("--heads", a, 1, 1024); break;
        case O_KVH: cfg.n_kv_heads = (int)kv_cli_long("--kv-heads", a, 1, 1024); break;
        case O_DIM: cfg.head_dim = (int)kv_cli_long("--head-dim", a, 1, 1024); break;
        case O_GROUP: cfg.group = (int)kv_cli_long("--group", a, 1, 65536); break;
        case O_RESID: cfg.residual = (int)kv_cli_long("--residual", a, 0, 1 << 24); break;
        case O_ITERS: cfg.iters = (int)kv_cli_long("--iters", a, 1, 1000000); break;
        case O_REPS: cfg.reps = (int)kv_cli_long("--reps", a, 1, 1000); break;
        case O_CHECK: check = 1; break;
        case O_CHECKMAX: check_max = (int)kv_cli_long("--check-max", a, 1, 1 << 24); break;
        case O_F16LEG: cfg.variant.f16_legacy = 1; break;
        case O_F16PF: cfg.variant.f16_prefetch = 1; break;
        case O_F16UNROLL:
            cfg.variant.f16_unroll = (int)kv_cli_long("--f16-unroll", a, 4, 8);
            if (cfg.variant.f16_unroll != 4 && cfg.variant.f16_unroll != 8)
                kv_cli_usage_error("--f16-unroll must be 4 or 8");
            break;
        case O_F16WAVES: cfg.variant.f16_waves = (int)kv_cli_long("--f16-waves", a, 1, 16); break;
        case O_KIVI2VAR: {
            static const int known[] = {0, 1, 2, 3, 7, 71, 8, 16, 32};
            long v = kv_cli_long("--kivi2-variant", a, 0, 71);
            bool ok = false;
            for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) ok |= v == known[i];
            if (!ok) kv_cli_usage_error("--kivi2-variant %ld: one of 0, 1, 2, 3, 7, 71, 8, 16, 32", v);
            cfg.variant.kivi2_var = (int)v;
            break;
        }
        case O_KIVIK:
            cfg.variant.kivi_kernel = (int)kv_cli_long("--kivi-kernel", a, 2, 3);
            break;
        case O_K3NST:
            cfg.variant.kivi3_nst = (int)kv_cli_long("--kivi3-stages", a, 2, 4);
            break;
        case O_K3COMB: cfg.variant.kivi3_unfused = 1; break;
        case O_K3FUSED: cfg.variant.kivi3_unfused = 2; break;
        case O_K3CPS: cfg.variant.kivi3_cps = (int)kv_cli_long("--kivi3-blocks", a, 1, 64); break;
        case O_K3DIAG: cfg.variant.kivi3_diag = (int)kv_cli_long("--kivi3-diag", a, 1, 4); break;
        case O_K3NOPF: cfg.variant.kivi3_noprefetch = 1; break;
        case O_K3ZALU: cfg.variant.kivi3_var |= 1; break;
        case O_PDL:
            cfg.pdl = (int)kv_cli_long("--pdl", a, 0, 2);
            if (cfg.pdl == 1) kv_cli_usage_error("--pdl must be 0 or 2 (level 1 covers only GEMVs)");
            break;
        case O_JSON: json = true; break;
        }
    }
    if (oi < argc) kv_cli_usage_error("unexpected operand '%s'", argv[oi]);
    if (cfg.n_heads % cfg.n_kv_heads)
        kv_cli_usage_error("%d query heads are not a multiple of %d KV heads", cfg.n_heads, cfg.n_kv_heads);

    kv_bench_device dev;
    kv_status st = kv_cuda_bench_device(&dev);
    if (st) return kv_report(st, "GPU");
    double copy = 0;
    if ((st = kv_cuda_bench_copy((size_t)1 << 30, 20, cfg.reps, &copy))) return kv_report(st, "copy bandwidth");
    kv_bench_attn_result res[MAXC];
    for (int i = 0; i < nctx; i++) {
        cfg.T = ctx[i];
        cfg.check = check && ctx[i] <= check_max;
        kv_progress("context %d", ctx[i]);
        if ((st = kv_cuda_bench_attn(&cfg, &res[i]))) {
            kv_progress_done();
            return kv_report(st, "context %d", ctx[i]);
        }
    }
    kv_progress_done();
    char date[64];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    const kv_bench_attn_result *L = &res[nctx - 1];
    if (kv_want_json(stdout, json)) {
        printf("{\n  \"bench\": \"attn\",\n  \"date\": \"%s\",\n", date);
        printf("  \"device\": {\"name\": \"%s\", \"sms\": %d, \"l2_bytes\": %zu, \"driver\": %d, "
               "\"runtime\": %d},\n", dev.name, dev.sms, dev.l2_bytes, dev.driver, dev.runtime);
        printf("  \"geometry\": {\"heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"group\": %d, "
               "\"residual\": %d, \"batch\": 1, \"layers\": 1},\n", cfg.n_heads, cfg.n_kv_heads,
               cfg.head_dim, cfg.group, cfg.residual);
        printf("  \"variant\": {\"f16_legacy\": %d, \"f16_prefetch\": %d, \"f16_unroll\": %d, "
               "\"f16_waves\": %d, \"kivi2_variant\": %d, \"kivi_kernel\": %d, \"kivi3_stages\": %d, "
               "\"kivi3_merge\": %d, \"kivi3_blocks\": %d, \"kivi3_diag\": %d, \"kivi3_prefetch\": %d, "
               "\"kivi3_var\": %d},\n",
               cfg.variant.f16_legacy, cfg.variant.f16_prefetch,
               cfg.variant.f16_unroll ? cfg.variant.f16_unroll : 4,
               cfg.variant.f16_waves ? cfg.variant.f16_waves : 1, cfg.variant.kivi2_var,
               cfg.variant.kivi_kernel, cfg.variant.kivi3_nst ? cfg.variant.kivi3_nst : 3,
               cfg.variant.kivi3_unfused, cfg.variant.kivi3_cps, cfg.variant.kivi3_diag,
               !cfg.variant.kivi3_noprefetch, cfg.variant.kivi3_var);
        printf("  \"pdl\": %d,\n  \"iters\": %d,\n  \"reps\": %d,\n  \"copy_bytes_per_s\": %.4e,\n"
               "  \"contexts\": [\n", cfg.pdl, cfg.iters, cfg.reps, copy);
        for (int i = 0; i < nctx; i++) {
            printf("    {\n      \"T\": %d,\n      \"copies\": %d,\n      \"kivi_kernel\": %d,\n", ctx[i],
                   res[i].copies, res[i].kivi_kernel);
            path_json("f16", &res[i].f16, copy, &res[i].f16, 0);
            path_json("kivi1", &res[i].kivi1, copy, &res[i].f16, 0);
            path_json("kivi2", &res[i].kivi2, copy, &res[i].f16, 0);
            path_json("kivi4", &res[i].kivi4, copy, &res[i].f16, 1);
            printf("    }%s\n", i + 1 < nctx ? "," : "");
        }
        printf("  ],\n  \"targets_at_T\": %d,\n  \"targets\": {\n", ctx[nctx - 1]);
        target_json("f16_frac_of_copy", L->f16.bytes_per_s / copy, 0.80, 0);
        target_json("kivi1_frac_of_copy", L->kivi1.ok ? L->kivi1.bytes_per_s / copy : 0, 0.60, 0);
        target_json("kivi2_frac_of_copy", L->kivi2.ok ? L->kivi2.bytes_per_s / copy : 0, 0.60, 0);
        target_json("kivi1_speedup", L->kivi1.ok ? L->f16.seconds / L->kivi1.seconds : 0, 8.0, 0);
        target_json("kivi2_speedup", L->kivi2.ok ? L->f16.seconds / L->kivi2.seconds : 0, 5.0, 1);
        printf("  }\n}\n");
    } else {
        printf("%s (%d SMs, L2 %zu MiB), driver %d, runtime %d, %s\n", dev.name, dev.sms,
               dev.l2_bytes >> 20, dev.driver, dev.runtime, date);
        printf("%d/%d heads, head dim %d, KIVI group %d residual %d; PDL %d; copy bandwidth %.0f GB/s\n",
               cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.group, cfg.residual, cfg.pdl, copy / 1e9);
        printf("%8s  %-6s %10s %10s %8s %8s %10s\n", "context", "path", "time us", "GB/s",
               "of copy", "speedup", "err");
        for (int i = 0; i < nctx; i++) {
            const kv_bench_attn_path *p[4] = {&res[i].f16, &res[i].kivi1, &res[i].kivi2, &res[i].kivi4};
            const char *nm[4] = {"fp16", "1-bit", "2-bit", "4-bit"};
            for (int j = 0; j < 4; j++) {
                if (!p[j]->ok) {
                    printf("%8d  %-6s %10s\n", ctx[i], nm[j], "n/a");
                    continue;
                }
                printf("%8d  %-6s %10.2f %10.0f %7.1f%% %7.2fx", ctx[i], nm[j], p[j]->seconds * 1e6,
                       p[j]->bytes_per_s / 1e9, 100 * p[j]->bytes_per_s / copy,
                       res[i].f16.seconds / p[j]->seconds);
                if (p[j]->err >= 0) printf(" %10.2e", p[j]->err);
                printf("\n");
            }
        }
    }
    return KV_EXIT_OK;
}
