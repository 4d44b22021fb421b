/*
 * kv_prefix_bench: serving requests that share long prefixes in one process
 * (kv-bench prefix), after IMPRESS: a GPU tier and a host tier of prefix
 * chunks in memory, within byte budgets and placed by importance x hits x
 * recency (kv_tree_score, the score kv-tree place uses, with its frontier
 * rule: a chunk is never on a faster tier than its parent), and a kv-tree
 * store on disk below them.  The chunks are the store's nodes: each served
 * prompt is put into the store, and the nodes on its path are held in
 * memory as fp16 rows (host) and, on the GPU engine, device copies (GPU
 * tier).  Every request runs under each asked mode -- full prefill, reuse
 * from the GPU tier, from the host tier, from disk (all tokens, or only
 * the important ones by the put's importance or by the request's own
 * queries, kv_qaware.h) -- and reports its time to first token, the cache
 * bytes it hit per tier and whether its answer is right.
 */
#ifndef KV_PREFIX_BENCH_H
#define KV_PREFIX_BENCH_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/kv_runner.h"
#include "eval/kv_qaware.h"
#include "model/kv_tokenizer.h"
#include "tree/kv_tree.h"

/* One request: a line {"id": ..., "input": TEXT | "tokens": [ids],
 * "outputs": [answers]} (RULER's field names; outputs optional). */
typedef struct {
    char *id;
    char *input;       /* text (encoded after BOS), or NULL */
    int *tok;          /* token ids as given, or NULL */
    int n;
    char **outputs;    /* expected answers (all must appear in the generated text) */
    int n_out;
} kv_preq;

/* Parse a JSONL list; KV_E_DATA names the line and what is wrong. */
kv_status kv_preq_parse(const char *text, size_t len, kv_preq **out, int *n);
void kv_preq_free(kv_preq *r, int n);

typedef enum { KV_PM_FULL = 0, KV_PM_GPU, KV_PM_HOST, KV_PM_DISK, KV_PM_DISK_IMP, KV_PM_DISK_QUERY, KV_PM_COUNT } kv_pmode;
/* full gpu host disk disk-important disk-query (disk-important: the put's
 * importance; disk-query: the request's own queries, kv_qaware) */
const char *kv_pmode_name(kv_pmode m);
/* Comma-separated names (or "all") -> bits of kv_pmode; KV_E_USAGE on an unknown one. */
kv_status kv_pmode_parse(const char *s, unsigned *bits);

typedef struct {
    uint64_t gpu_bytes, host_bytes; /* tier budgets, bytes of fp16 K/V held */
    double important;  /* disk-important, disk-query: the share of disk tokens loaded (0.25) */
    double half_life;  /* of the placement score, seconds (KV_TREE_HALF_LIFE) */
    unsigned modes;    /* bits of kv_pmode */
    int max_new;       /* tokens generated per request (8) */
    const char *store; /* kv-tree store directory (created when missing) */
    const char *tmp_dir; /* files of disk lookups and inserts */
    int64_t now;       /* Unix seconds of the first request; each next one is 1 s later */
    void (*progress)(void *user, int done, int total);
    void *user;
    kv_tier put_tier;  /* tier the store records for inserted nodes: disk (zstd chunks) or host/gpu (plain) */
    int zstd_level;    /* of the store's disk chunks (3; 0: a new store keeps them uncompressed) */
    int insert_max;    /* put only the first N requests' prompts (0: every request) */
    int put_queries;   /* query samples kept per layer for the put's importance (32; 0: key norms) */
    int queries;       /* disk-query: the request's last queries scored with (0: KV_QAWARE_QUERIES) */
    kv_qaware_heads qa_heads; /* disk-query: how the heads' scores combine (kv_qaware_opts.heads) */
    int qa_follow;            /* disk-query: kv_qaware_opts.follow (0: KV_QAWARE_FOLLOW, < 0 none) */
    int sketch_channels; /* set as the store's sketch_channels, for the chunks written from now on (0: unchanged) */
    bool sketch_serial; /* disk-query: the sketch read before the probe (kv_qaware_opts.sketch_serial) */
    bool rows_serial;   /* disk modes: the rows read before the prefill starts, not layer by layer
                           beside it (kv_tree_store_load_start); for comparison */
    bool warmed;        /* reported only: the caller ran kv_gpu_engine_warm before the run, */
    double warm_ms;     /* for this long (ms) */
} kv_pbench_opts;

typedef struct {
    int req;
    kv_pmode mode;
    const char *tier;       /* where the prefix came from: none, gpu, host, disk */
    int tokens, reused, prefilled;
    double ttft_ms;
    double load_ms;         /* of it: finding and loading the prefix (the rest is the prefill) */
    double qa_ms[5];        /* disk-query: of load_ms, the sketch read, the probe, the scoring, the rows;
                               then of the scoring, its upload to the GPU (0 when scored on the CPU) */
    double probe_ms[6];     /* disk-query: of the probe, the sink row's load, its prefill, the reset;
                               then the wait for the sketch read (beside the probe) after it and
                               the start of its thread (of the prefill); then, of the sketch read,
                               the issuing of its codes' copy to the GPU (kv_qaware_gpu_stage) */
    double pf_ms[8];        /* GPU engine: the request's prefill's phases (kv_gpu_prefill_phases:
                               setup, rows, compute, logits, total, capture, upload, and
                               upload_bytes in bytes); all 0 on the CPU */
    double probe_pf_ms[5];  /* disk-query on the GPU: the same for the probe's prefill */
    bool rows_ahead;        /* GPU engine: the cached rows were uploaded a layer ahead of the compute
                               (kv_gpu_prefill_phases.rows_ahead) */
    uint64_t hit_bytes[3];  /* cache bytes taken from the gpu, host and disk tiers */
    bool rows_beside;       /* disk modes: the rows were read layer by layer beside the prefill */
    double rows_ms[2];      /* then the read's own time and the prefill's wait for it (both within ttft_ms) */
    int correct;            /* 1, 0, or -1 without expected outputs */
    char *text;             /* the generated text (or ids) */
} kv_pbench_row;

/* Serve reqs in order on r (tok: the tokenizer for text inputs and the
 * answers, may be NULL).  *rows (n * modes) malloc'd; kv_pbench_rows_free. */
kv_status kv_pbench_run(kv_runner *r, const kv_tokenizer *tok, const kv_preq *reqs, int n,
                        const kv_pbench_opts *o, kv_pbench_row **rows, int *nrows);
void kv_pbench_rows_free(kv_pbench_row *rows, int n);

/* The results as JSON: {"requests": [...rows], "summary": {mode: {n, ttft_ms_median,
 * speedup_vs_full, accuracy, hit_bytes}}}; malloc'd text. */
char *kv_pbench_json(const kv_pbench_row *rows, int n, const kv_pbench_opts *o);

#endif
