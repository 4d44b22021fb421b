/*
 * The pieces of kv-bench decode (decode.c runs the measurements): its
 * parsed options (decode_args.c) and the report of one run, as JSON or as
 * a table (decode_print.c).  Only the decode*.c files include this.
 */
#ifndef BENCH_DECODE_H
#define BENCH_DECODE_H

#include <stdbool.h>
#include <stdint.h>

#include "eval/kv_gpu_bench.h"
#include "gpu/kv_gpu_batch.h"
#include "model/kv_model.h"

#define MAXC 8
#define MAXV 16
#define MAXB 16

enum { CTX_SYNTH = 1, CTX_PREFILL = 2, CTX_BOTH = 3 };
enum { GRAPH_ON = 1, GRAPH_OFF = 2, GRAPH_BOTH = 3 }; /* --graph */

/* the command line, defaults filled in */
typedef struct {
    const char *synth;
    kv_dtype wt;
    int ctx[MAXC], nctx, tokens, warmup, offtok, nofetch;
    kv_decode_layers bc;
    int device, pdl;
    unsigned sel_skip;
    int cmode; /* CTX_* */
    int gmode; /* GRAPH_* */
    bool pf_sync;
    unsigned long long seed;
    bool want[KV_DEC_COUNT], json;
    kv_decode_variant var[MAXV];
    int nvar;
    int batch[MAXB], nbatch; /* --batch: sizes, 0 = max; none: the batch-1 report */
    int batch_cap;           /* --batch-cap: the most sequences max may take */
    kv_gpu_gemm gemm;        /* --gemm */
} decode_args;


typedef struct {
    bool ran, ran_pf;
    kv_gpu_decode_result r;  /* after the synthesized context (or the prefill, --context prefill) */
    kv_gpu_decode_result rv[MAXV]; /* hybrids: every --variants entry (rv[0] is r) */
    kv_gpu_decode_result rp; /* after a real prefill (--context both) */
    kv_gpu_decode_result rg; /* --graph both: the same context, steps launched kernel by kernel */
    bool ran_g;
    char err[256];
} prun;

/* what one run measured, for the report */
typedef struct {
    const kv_model *m;
    char devname[400];
    char date[64];
    uint64_t wread, wstore;
    kv_gpu_bw bw;
    kv_gpu_select_us sel_us;
    prun (*runs)[KV_DEC_COUNT]; /* (context, placement) */
} decode_out;

/* Parses kv-bench decode's command line into *A (usage errors exit 64). */
void kv_bench_decode_args(int argc, char **argv, decode_args *A);
/* The report on stdout: JSON, or a table for a terminal. */
void kv_bench_decode_json(const decode_args *A, const decode_out *D);
void kv_bench_decode_table(const decode_args *A, const decode_out *D);
/* --batch: the batched runs and their report (decode_batch.c); the exit code. */
int kv_bench_decode_batch(const decode_args *A);

#endif
