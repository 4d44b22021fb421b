/*
 * kv-bench pack: KIVI packing throughput of one layer's K and V on the GPU
 * (kernels/kivi_pack.cu, against device copy bandwidth) and on the CPU
 * (lib/quant/kv_quant.c, per core and with all threads).  A table on a terminal,
 * JSON when piped or with --json.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kv_cli.h"
#include "eval/kv_cuda_bench.h"

int kv_bench_pack_main(int argc, char **argv);

enum { O_CTX = 'c', O_BITS = 'b', O_KVH = 256, O_DIM, O_GROUP, O_RESID, O_ITERS, O_REPS,
       O_CPUT, O_NOGPU, O_JSON };

static const kv_option opts[] = {
    {O_CTX, 'c', "context", "T", "tokens of the packed layer on the GPU (default 131072)"},
    {O_BITS, 'b', "bits", "LIST", "bit widths (default 1,2,4)"},
    {O_KVH, 0, "kv-heads", "N", "KV heads (default 8)"},
    {O_DIM, 0, "head-dim", "N", "head dimension (default 128)"},
    {O_GROUP, 0, "group", "G", "KIVI group (default 64)"},
    {O_RESID, 0, "residual", "R", "KIVI fp16 residual tokens (default 128)"},
    {O_ITERS, 0, "iters", "N", "GPU launches per timing (default 50)"},
    {O_REPS, 0, "reps", "N", "timings; the median is reported (default 5)"},
    {O_CPUT, 0, "cpu-context", "T", "tokens of the CPU measurement (default 8192)"},
    {O_NOGPU, 0, "cpu-only", NULL, "skip the GPU measurements"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench pack", "[OPTIONS]", "KIVI packing throughput on the GPU and the CPU.", opts,
    "GPU rate: (fp16 bytes read + packed bytes written) per second, against the device\n"
    "copy bandwidth (bytes read + written) of the same run.  CPU rate: fp16 input bytes\n"
    "per second (kv_kivi_pack takes float32 made from fp16 data).\n"
    "Without a usable GPU it exits 69 (use --cpu-only)."};

int kv_bench_pack_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    kv_bench_pack_cfg cfg = {8, 128, 131072, 1, 64, 128, 50, 5};
    int bits[3] = {1, 2, 4}, nbits = 3, cpu_T = 8192, oi;
    bool json = false, gpu = true;
    const char *a;
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        switch (c) {
        case O_CTX: cfg.T = (int)kv_cli_long("--context", a, 1, 1 << 24); break;
        case O_BITS: {
            nbits = 0;
            char *dup = strdup(a), *save = NULL;
            for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (nbits == 3) kv_cli_usage_error("--bits: at most 3 widths");
                long b = kv_cli_long("--bits", t, 1, 4);
                if (b == 3) kv_cli_usage_error("--bits: 1, 2 or 4");
                bits[nbits++] = (int)b;
            }
            free(dup);
            if (!nbits) kv_cli_usage_error("--bits: empty list");
            break;
        }
        case O_KVH: cfg.n_kv_heads = (int)kv_cli_long("--kv-heads", a, 1, 1024); break;
        case O_DIM: cfg.head_dim = (int)kv_cli_long("--head-dim", a, 1, 1024); break;
        case O_GROUP: cfg.group = (int)kv_cli_long("--group", a, 1, 65536); break;
        case O_RESID: cfg.residual = (int)kv_cli_long("--residual", a, 0, 1 << 24); break;
        case O_ITERS: cfg.iters = (int)kv_cli_long("--iters", a, 1, 100000); break;
        case O_REPS: cfg.reps = (int)kv_cli_long("--reps", a, 1, 1000); break;
        case O_CPUT: cpu_T = (int)kv_cli_long("--cpu-context", a, 1, 1 << 22); break;
        case O_NOGPU: gpu = false; break;
        case O_JSON: json = true; break;
        }
    }
    if (oi < argc) kv_cli_usage_error("unexpected operand '%s'", argv[oi]);

    kv_bench_device dev = {0};
    double copy = 0;
    kv_status st;
    if (gpu) {
        if ((st = kv_cuda_bench_device(&dev))) return kv_report(st, "GPU (try --cpu-only)");
        if ((st = kv_cuda_bench_copy((size_t)1 << 30, 20, cfg.reps, &copy)))
            return kv_report(st, "copy bandwidth");
    }
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    kv_bench_pack_result g[3], c1[3], cn[3];
    for (int i = 0; i < nbits; i++) {
        kv_bench_pack_cfg c = cfg;
        c.bits = bits[i];
        kv_progress("%d bits", bits[i]);
        if (gpu && (st = kv_cuda_bench_pack(&c, &g[i]))) {
            kv_progress_done();
            return kv_report(st, "GPU pack, %d bits", bits[i]);
        }
        c.T = cpu_T;
        c.reps = cfg.reps < 3 ? cfg.reps : 3;
        if ((st = kv_cpu_bench_pack(&c, 1, &c1[i])) || (st = kv_cpu_bench_pack(&c, threads, &cn[i]))) {
            kv_progress_done();
            return kv_report(st, "CPU pack, %d bits", bits[i]);
        }
    }
    kv_progress_done();
    char date[64];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    if (kv_want_json(stdout, json)) {
        printf("{\n  \"bench\": \"pack\",\n  \"date\": \"%s\",\n", date);
        if (gpu)
            printf("  \"device\": {\"name\": \"%s\", \"sms\": %d, \"driver\": %d, \"runtime\": %d},\n"
                   "  \"copy_bytes_per_s\": %.4e,\n",
                   dev.name, dev.sms, dev.driver, dev.runtime, copy);
        printf("  \"geometry\": {\"kv_heads\": %d, \"head_dim\": %d, \"group\": %d, \"residual\": %d, "
               "\"gpu_T\": %d, \"cpu_T\": %d, \"cpu_threads\": %d},\n  \"results\": [\n",
               cfg.n_kv_heads, cfg.head_dim, cfg.group, cfg.residual, cfg.T, cpu_T, threads);
        for (int i = 0; i < nbits; i++) {
            printf("    {\"bits\": %d", bits[i]);
            if (gpu) {
                double rw = (g[i].in_bytes + g[i].out_bytes) / g[i].seconds;
                printf(", \"gpu_us\": %.2f, \"gpu_rw_bytes_per_s\": %.4e, \"gpu_frac_of_copy\": %.4f, "
                       "\"gpu_input_bytes_per_s\": %.4e, \"gpu_target_met\": %s",
                       g[i].seconds * 1e6, rw, rw / copy, g[i].in_bytes / g[i].seconds,
                       rw / copy >= 0.5 ? "true" : "false");
            }
            double one = c1[i].in_bytes / c1[i].seconds;
            printf(", \"cpu_1thread_input_bytes_per_s\": %.4e, \"cpu_all_threads_input_bytes_per_s\": %.4e, "
                   "\"cpu_target_met\": %s}%s\n",
                   one, cn[i].in_bytes / cn[i].seconds, one >= 1e9 ? "true" : "false",
                   i + 1 < nbits ? "," : "");
        }
        printf("  ]\n}\n");
    } else {
        if (gpu)
            printf("%s, driver %d, runtime %d, %s; copy bandwidth %.0f GB/s\n", dev.name, dev.driver,
                   dev.runtime, date, copy / 1e9);
        printf("%d KV heads, head dim %d, group %d, residual %d; GPU %d tokens, CPU %d tokens\n",
               cfg.n_kv_heads, cfg.head_dim, cfg.group, cfg.residual, cfg.T, cpu_T);
        printf("%4s %10s %12s %8s %14s %16s\n", "bits", "GPU us", "GPU r+w GB/s", "of copy",
               "CPU 1 thr GB/s", "CPU all thr GB/s");
        for (int i = 0; i < nbits; i++) {
            if (gpu) {
                double rw = (g[i].in_bytes + g[i].out_bytes) / g[i].seconds;
                printf("%4d %10.1f %12.0f %7.1f%%", bits[i], g[i].seconds * 1e6, rw / 1e9, 100 * rw / copy);
            } else {
                printf("%4d %10s %12s %8s", bits[i], "-", "-", "-");
            }
            printf(" %14.2f %16.2f\n", c1[i].in_bytes / c1[i].seconds / 1e9,
                   cn[i].in_bytes / cn[i].seconds / 1e9);
        }
    }
    return KV_EXIT_OK;
}
