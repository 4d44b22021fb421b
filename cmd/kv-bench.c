/*
 * kv-bench: batch benchmarks.  A thin dispatcher: each subcommand lives in
 * cmd/bench/<name>.c (linked into kv-bench only) and parses its own options.
 * Subcommands are weak symbols so a build that lacks one (e.g. no CUDA)
 * reports it unavailable instead of failing to link.
 */
#include <stdio.h>
#include <string.h>

#include "kv_cli.h"

typedef int (*bench_fn)(int argc, char **argv);

int kv_bench_attn_main(int argc, char **argv) __attribute__((weak));
int kv_bench_pack_main(int argc, char **argv) __attribute__((weak));
int kv_bench_ruler_main(int argc, char **argv) __attribute__((weak));
int kv_bench_fidelity_main(int argc, char **argv) __attribute__((weak));
int kv_bench_decode_main(int argc, char **argv) __attribute__((weak));
int kv_bench_longbench_main(int argc, char **argv) __attribute__((weak));
int kv_bench_score_main(int argc, char **argv) __attribute__((weak));
int kv_bench_merge_main(int argc, char **argv) __attribute__((weak));
int kv_bench_report_main(int argc, char **argv) __attribute__((weak));
int kv_bench_prefill_main(int argc, char **argv) __attribute__((weak));
int kv_bench_gemv_main(int argc, char **argv) __attribute__((weak));

static const struct {
    const char *name;
    const char *summary;
} names[] = {
    {"attn", "decode-attention kernels (fp16, 1/2-bit packed) vs copy bandwidth"},
    {"pack", "KIVI/DSQ packing throughput on the CPU and GPU"},
    {"gemv", "packed decode GEMV (Q8_0, Q4_K, Q6_K) variants vs copy bandwidth and F16"},
    {"ruler", "needle/RULER JSONL accuracy per KV policy"},
    {"fidelity", "KL divergence and top-1 agreement of each policy vs full"},
    {"decode", "end-to-end decode ms/token per policy (GPU runtime)"},
    {"longbench", "LongBench / LongBench-E JSONL: predictions and official scores per policy"},
    {"score", "score LongBench or RULER prediction files as the official scripts do"},
    {"merge", "combine result files of shards into the summary one run gives"},
    {"report", "SVG charts from result files (accuracy, KV bytes, ms/token)"},
    {"prefill", "dense causal prefill tokens/s and attention TFLOP/s on the GPU"},
};

static bench_fn lookup(const char *name)
{
    if (!strcmp(name, "attn")) return kv_bench_attn_main;
    if (!strcmp(name, "pack")) return kv_bench_pack_main;
    if (!strcmp(name, "gemv")) return kv_bench_gemv_main;
    if (!strcmp(name, "ruler")) return kv_bench_ruler_main;
    if (!strcmp(name, "fidelity")) return kv_bench_fidelity_main;
    if (!strcmp(name, "decode")) return kv_bench_decode_main;
    if (!strcmp(name, "longbench")) return kv_bench_longbench_main;
    if (!strcmp(name, "score")) return kv_bench_score_main;
    if (!strcmp(name, "merge")) return kv_bench_merge_main;
    if (!strcmp(name, "report")) return kv_bench_report_main;
    if (!strcmp(name, "prefill")) return kv_bench_prefill_main;
    return NULL;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kv-bench SUBCOMMAND [OPTIONS]\n"
               "Batch benchmarks for kvtools; results as JSON on stdout (a table on a terminal).\n\n"
               "Subcommands:\n");
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        bool have = lookup(names[i].name) != NULL;
        fprintf(f, "  %-10s %s%s\n", names[i].name, names[i].summary, have ? "" : " (not built)");
    }
    fprintf(f, "\nRun 'kv-bench SUBCOMMAND --help' for its options.\n"
               "Exit status: 0 ok, 64 usage, 65 bad data, 66 no input, 69 unavailable,\n"
               "70 internal, 73 cannot create output, 74 I/O error.\n");
}

int main(int argc, char **argv)
{
    static const kv_option no_opts[] = {{0, 0, NULL, NULL, NULL}};
    static const kv_cli_spec spec = {"kv-bench", "SUBCOMMAND [OPTIONS]",
                                     "Batch benchmarks for kvtools.", no_opts, NULL};
    kv_cli_init(&spec, argc, argv);
    if (argc < 2) {
        fprintf(stderr, "kv-bench: missing subcommand\n"
                        "usage: kv-bench SUBCOMMAND [OPTIONS]\nTry 'kv-bench --help' for more information.\n");
        return KV_EXIT_USAGE;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "-h") || !strcmp(sub, "--help")) {
        usage(stdout);
        return KV_EXIT_OK;
    }
    if (!strcmp(sub, "-V") || !strcmp(sub, "--version")) {
        const char *a;
        int oi;
        char *vargv[] = {argv[0], (char *)"--version", NULL};
        kv_cli_next(2, vargv, &a, &oi); /* prints and exits */
        return KV_EXIT_OK;
    }
    bench_fn fn = lookup(sub);
    if (!fn) {
        bool known = false;
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            known |= !strcmp(names[i].name, sub);
        if (known) {
            fprintf(stderr, "kv-bench: subcommand '%s' is not built into this binary\n", sub);
            return KV_EXIT_UNAVAILABLE;
        }
        kv_warn("unknown subcommand '%s'", sub); /* escaped: argv may hold anything */
        fprintf(stderr, "usage: kv-bench SUBCOMMAND [OPTIONS]\nTry 'kv-bench --help' for more information.\n");
        return KV_EXIT_USAGE;
    }
    return fn(argc - 1, argv + 1);
}
