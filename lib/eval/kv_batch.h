/*
 * kv_batch: what makes a long benchmark run survive being killed, split
 * across machines and put back together.
 *
 * The results log (--output FILE.jsonl) is JSON lines.  The first line of
 * each run is a header, {"kv_bench_log": 1, "bench": ..., "config": {...},
 * "policies": [...], "shard": "i/n" | null, ...}; every other line is one
 * record: a finished sample under one policy, or a sample skipped for
 * every policy ("skipped": "why").  Each record is appended with one
 * write() and fsync()ed before the next sample starts, so kill -9 loses at
 * most the sample in flight; a torn last line is cut off when the log is
 * resumed.  --resume reads the log, checks that its config is this run's,
 * and skips every (task, id, policy, length) already there.
 *
 * --shard i/n (1 <= i <= n) keeps the samples whose FNV-1a hash of
 * "task" 0x1F "id" is i-1 modulo n: a split that depends on nothing but
 * the sample, so every machine computes the same one.  kv_batch_read loads
 * any number of logs (shards of one run, or resumed pieces) for `kv-bench
 * merge` and `kv-bench report`; summaries are computed from records sorted
 * by (policy order, file, line), so a merge of shards gives the numbers a
 * single run gives, bit for bit.
 */
#ifndef KV_BATCH_H
#define KV_BATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cjson/cJSON.h>

#include "common/kv_status.h"
#include "policy/kv_policy.h"

#define KV_BATCH_LOG_VERSION 1

/* One policy configuration of a batch: its label in records (the spec, or
 * "profile:PATH") and its per-layer parameters (n_layers). */
typedef struct {
    const char *label;
    const kv_policy_params *per_layer;
} kv_batch_policy;

/* "i/n" -> 1 <= i <= n <= 100000; KV_E_USAGE otherwise. */
kv_status kv_batch_parse_shard(const char *s, int *i, int *n);
uint64_t kv_batch_hash(const char *task, const char *id);
bool kv_batch_in_shard(const char *task, const char *id, int i, int n);

// --- the set of finished work ----------------------------------------------------------

typedef struct kv_batch_done kv_batch_done;
kv_status kv_batch_done_new(kv_batch_done **out);
void kv_batch_done_free(kv_batch_done *d);
/* policy NULL: the sample was skipped (done for every policy). */
kv_status kv_batch_done_add(kv_batch_done *d, const char *task, const char *id, const char *policy,
                            long long length);
bool kv_batch_done_has(const kv_batch_done *d, const char *task, const char *id,
                       const char *policy, long long length);

// --- the log -----------------------------------------------------------------------------

typedef struct kv_batch_log kv_batch_log;

/*
 * Open path for appending a run whose header is `header` (an object with
 * at least "bench" and "config"; borrowed).  Without resume an existing
 * non-empty file is KV_E_CANTCREATE ("pass --resume").  With resume the
 * file's records are returned in *records (a cJSON array the caller
 * deletes; NULL when the file is new), a torn last line is truncated away,
 * and a header whose "bench" or "config" differs from this one is
 * KV_E_USAGE naming the first differing key.  The header is then appended.
 */
kv_status kv_batch_open(const char *path, bool resume, const cJSON *header, kv_batch_log **out,
                        cJSON **records);
/* Append one record (an object, printed unformatted) and fsync. */
kv_status kv_batch_append(kv_batch_log *l, const cJSON *record);
kv_status kv_batch_close(kv_batch_log *l); /* NULL is fine */

/*
 * Read logs for merge/report: every header (in *headers) and every record
 * (in *records), in file order.  A torn last line is ignored (*torn counts
 * them); a record seen twice (the same log given twice) is kept once (*dups).  Headers of different "bench" or "config" are KV_E_DATA; so is a
 * set of shard headers that is not exactly 1/n .. n/n.
 */
kv_status kv_batch_read(const char *const *paths, int n, cJSON **headers, cJSON **records,
                        int *torn, int *dups);

/* The policies of the headers, in order of first appearance (a cJSON
 * array of strings, owned by the caller). */
cJSON *kv_batch_policies(const cJSON *headers);
/* The config of the first header (borrowed from headers). */
const cJSON *kv_batch_config(const cJSON *headers);

/* Sort records in place by (policy's index in policies, "fi", "line");
 * skip records (policy null) come first. */
void kv_batch_sort(cJSON *records, const cJSON *policies);

/* Small accessors for records (missing or mistyped fields read as given). */
double kv_rec_num(const cJSON *r, const char *key, double dflt);
const char *kv_rec_str(const cJSON *r, const char *key, const char *dflt);

// --- progress --------------------------------------------------------------------------------

typedef struct {
    int done, total;    /* samples x policies finished in this run / to do */
    double rate;        /* per second */
    double eta_s;       /* seconds left at that rate (-1 unknown) */
    const char *policy, *task;
} kv_batch_progress;

/* Callbacks through which the batch loops report (lib/ never prints). */
typedef struct {
    void (*progress)(void *ctx, const kv_batch_progress *p);
    void (*warn)(void *ctx, const char *msg); /* a skipped sample: "file:LINE: why" */
    void *ctx;
} kv_batch_hooks;

double kv_batch_now(void); /* monotonic seconds */

/* done/total, rate and ETA through hooks->progress (at most a few per
 * second is the front end's business). */
typedef struct {
    double t0;
    int done, total;
    const kv_batch_hooks *hooks;
} kv_batch_meter;
void kv_batch_meter_start(kv_batch_meter *m, const kv_batch_hooks *h, int total);
void kv_batch_meter_tick(kv_batch_meter *m, const char *policy, const char *task);
/* A one-line message through hooks->warn. */
void kv_batch_warn(const kv_batch_hooks *h, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A record's common fields; policy NULL for a skip record. */
cJSON *kv_batch_record(const char *bench, const char *task, const char *id, int fi, int line,
                       long long length, const char *policy);
/*
 * A sample that cannot run (malformed, longer than the context): with
 * strict, KV_E_DATA "path:LINE: why"; else warn "path:LINE: skipped: why",
 * and append a skip record to log and records.
 */
kv_status kv_batch_skip(const char *bench, const char *task, const char *id, int fi,
                        const char *path, int line, long long length, const char *why,
                        bool strict, kv_batch_log *log, cJSON *records, const kv_batch_hooks *h);
/* Add r to log (when open) and to records (taking r). */
kv_status kv_batch_keep(kv_batch_log *log, cJSON *records, cJSON *r);

/* The cost fields every benchmark's record ends with: "resident_bytes" and
 * "host_bytes" of b, "fetched_bytes_per_step", "full_f16_bytes", "ms",
 * "prefill_ms", "decode_ms" (in that order). */
void kv_batch_record_cost(cJSON *r, const kv_bytes *b, double fetched_per_step, double full_bytes,
                          double ms, double prefill_ms, double decode_ms);

/* Those fields summed over the records of one summary row. */
typedef struct {
    double resident, host, fetched, full, ms, decode_ms, decoded;
} kv_batch_cost;
/* Add record r's cost fields (and its "decoded") to c. */
void kv_batch_cost_add(kv_batch_cost *c, const cJSON *r);
/* The row's means over n records as JSON members on f: ", \"resident_bytes\": ...
 * \"full_f16_bytes\": ..., \"<ms_key>\": ms/n, \"ms_per_token\": decode_ms/decoded"
 * (null when nothing was decoded). */
void kv_batch_cost_json(FILE *f, const kv_batch_cost *c, int n, const char *ms_key);

/* A file-name-safe form of a policy label: [A-Za-z0-9._,=+:-] kept, the
 * rest '_' ("0=quant:bits=1;*=full" -> "0=quant:bits=1_=full"). */
void kv_batch_slug(const char *label, char *buf, size_t cap);
/* mkdir -p (mode 0755); KV_E_CANTCREATE on failure. */
kv_status kv_batch_mkdirs(const char *path);

/* Index of policy label p in the array pols, or -1. */
int kv_batch_policy_index(const cJSON *pols, const char *p);
/* The headers' policies, then any other policy a record names (NULL: out
 * of memory); the caller deletes it. */
cJSON *kv_batch_all_policies(const cJSON *headers, const cJSON *records);
/* Input file fi of a run's configuration (kv_batch_config). */
const cJSON *kv_batch_file_cfg(const cJSON *cfg, int fi);

/* One prediction line for record r (of input file fi) on fp. */
typedef void (*kv_batch_pred_fn)(FILE *fp, const cJSON *r, int fi, void *ctx);
/* The prediction files of a run, as the benchmark's own scorer reads them:
 * DIR/<policy slug>/<name>.jsonl for each policy and input file with
 * records, <name> the file configuration's name_key, each line written by
 * line() in record order; every file complete or absent (kv_outfile).
 * Two policies with one slug are a usage error. */
kv_status kv_batch_write_preds(const char *dir, const cJSON *pols, const cJSON *cfg, const cJSON *records,
                               const char *name_key, kv_batch_pred_fn line, void *ctx);

#endif
