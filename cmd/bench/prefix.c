/*
 * kv-bench prefix: serve a JSONL list of requests that share long prefixes
 * in one process, with a GPU tier and a host tier of prefix chunks within
 * --gpu-bytes / --host-bytes and a kv-tree store on disk below them; each
 * request runs under every --modes entry (full prefill, reuse from the GPU
 * tier, the host tier, disk, disk with only the important tokens) and
 * reports its time to first token, the bytes it hit per tier and whether
 * its answer is right.  The serving is lib/eval/kv_prefix_bench.c.
 */
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kv_cli.h"
#include "common/kv_file.h"
#include "common/kv_outfile.h"
#include "engine/kv_runner.h"
#include "eval/kv_prefix_bench.h"
#include "eval/kv_qaware.h"
#include "model/kv_model.h"
#include "model/kv_prompt.h"
#include "model/kv_widen.h"
#include "tree/kv_tree.h"

int kv_bench_prefix_main(int argc, char **argv);

enum { O_CTX = 'c', O_JSON = 'j', O_MODEL = 'm', O_STEPS = 'n', O_OUT = 'o', O_SEED = 's', O_SYNTH = 256,
       O_WEIGHTS, O_TOKENIZER, O_STORE, O_GPU, O_HOST, O_MODES, O_IMPORTANT, O_HALF, O_DEVICE, O_PUT_TIER, O_ZSTD,
       O_INSERT, O_PUTQ, O_QUERIES, O_SKSERIAL, O_ROWSERIAL, O_WIDEN, O_SKCH, O_QAHEADS, O_QAFOLLOW, O_NOWARM };

static const kv_option opts[] = {
    {O_MODEL, 'm', "model", "FILE", "model: llama2.c .bin or GGUF v3"},
    {O_SYNTH, 0, "synthetic", "NAME", "seeded random model: llama-3.1-8b, llama-2-7b, tiny"},
    {O_WIDEN, 0, "widen", "SHAPE", "with --model: run it in SHAPE's shape (llama-3.1-8b, ...): that model's costs, its own logits"},
    {O_WEIGHTS, 0, "weights", "TYPE", "synthetic or widened weight type f32|f16|bf16"},
    {O_TOKENIZER, 0, "tokenizer", "FILE", "llama2.c tokenizer (default: beside the model)"},
    {O_STORE, 0, "store", "DIR", "kv-tree store of the disk tier (created if missing; default: a new one in $TMPDIR)"},
    {O_GPU, 0, "gpu-bytes", "N", "GPU tier budget, bytes of fp16 K/V (suffix K, M, G; default 1G)"},
    {O_HOST, 0, "host-bytes", "N", "host tier budget, bytes of fp16 K/V (default 4G)"},
    {O_MODES, 0, "modes", "LIST", "full,gpu,host,disk,disk-important,disk-query or all (default all)"},
    {O_IMPORTANT, 0, "important", "F", "disk-important, disk-query: share of disk tokens loaded (default 0.25)"},
    {O_PUT_TIER, 0, "put-tier", "TIER", "store tier of inserted prompts: disk (zstd chunks, default), host or gpu (plain chunks)"},
    {O_ZSTD, 0, "zstd", "N", "zstd level of the store's disk chunks (1-19, default 3; 0: uncompressed)"},
    {O_INSERT, 0, "insert", "N", "put only the first N requests' prompts into the store (default: every one)"},
    {O_PUTQ, 0, "put-queries", "N", "query samples per layer for the put's importance (default 32; 0: key norms)"},
    {O_QUERIES, 0, "queries", "N", "disk-query: the request's last N queries score the prefix (1-64, default 4)"},
    {O_SKCH, 0, "sketch-channels", "N", "disk-query: key channels per head in new chunks' sketch (1-4096, default head_dim/2)"},
    {O_QAHEADS, 0, "qa-heads", "HOW", "disk-query: a token's score is its max (default) or sum over layers and KV heads"},
    {O_QAFOLLOW, 0, "qa-follow", "N", "disk-query: a token's score also counts for the N after it (0-4096, default 8)"},
    {O_SKSERIAL, 0, "sketch-serial", NULL, "disk-query: read the sketch before the probe, not beside it (measurement)"},
    {O_NOWARM, 0, "no-warm", NULL, "GPU: skip setting up the prefill's products for every chunk length before the first request (measurement)"},
    {O_ROWSERIAL, 0, "rows-serial", NULL, "disk modes: read the rows before the prefill, not layer by layer beside it (measurement)"},
    {O_HALF, 0, "half-life", "S", "recency half-life of the placement score, seconds (default 3600)"},
    {O_STEPS, 'n', "steps", "N", "tokens generated per request (default 8)"},
    {O_CTX, 'c', "ctx", "N", "context capacity (default: the longest request plus -n)"},
    {O_SEED, 's', "seed", "N", "seed of --synthetic weights (default 42)"},
    {O_DEVICE, 0, "device", "DEV", "cpu, cuda[:N] or auto (default cpu)"},
    {O_OUT, 'o', "output", "FILE", "write the JSON here too"},
    {O_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-bench prefix", "[OPTIONS] (--model FILE | --synthetic NAME) REQUESTS.jsonl",
    "Time to first token and accuracy of requests sharing prefixes, from GPU, host and disk tiers.", opts,
    "REQUESTS.jsonl: one {\"input\": TEXT | \"tokens\": [ids], \"outputs\": [answers]} per line\n"
    "(tools/prefix-requests.py writes them).  KV_TREE_NOW fixes the clock."};

static int rm_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb, (void)ftw;
    return type == FTW_DP ? rmdir(path) : unlink(path);
}

static void on_progress(void *user, int done, int total)
{
    (void)user;
    kv_progress("%d/%d requests", done, total);
}

static void print_table(FILE *f, const char *json)
{
    cJSON *j = cJSON_Parse(json), *s = j ? cJSON_GetObjectItem(j, "summary") : NULL;
    fprintf(f, "%-15s %8s %12s %9s %9s\n", "mode", "requests", "ttft_ms", "speedup", "accuracy");
    for (cJSON *m = s ? s->child : NULL; m; m = m->next) {
        cJSON *sp = cJSON_GetObjectItem(m, "speedup_vs_full"), *ac = cJSON_GetObjectItem(m, "accuracy");
        cJSON *tt = cJSON_GetObjectItem(m, "ttft_ms_median"); /* null: the mode served no request */
        fprintf(f, "%-15s %8d ", m->string, cJSON_GetObjectItem(m, "requests")->valueint);
        if (cJSON_IsNumber(tt)) fprintf(f, "%12.2f ", tt->valuedouble);
        else fprintf(f, "%12s ", "-");
        if (cJSON_IsNumber(sp)) fprintf(f, "%8.2fx", sp->valuedouble);
        else fprintf(f, "%9s", "-");
        if (cJSON_IsNumber(ac)) fprintf(f, " %9.3f\n", ac->valuedouble);
        else fprintf(f, " %9s\n", "-");
    }
    cJSON_Delete(j);
}

int kv_bench_prefix_main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *model = NULL, *synth = NULL, *widen = NULL, *weights = NULL, *tokenizer = NULL, *store = NULL, *outp = NULL;
    bool json = false, nowarm = false;
    kv_device dev = KV_DEVICE_CPU;
    int ordinal = 0, ctx = 0;
    unsigned long seed = 42;
    kv_pbench_opts po = {.gpu_bytes = 1ull << 30, .host_bytes = 4ull << 30, .important = 0.25,
                         .half_life = KV_TREE_HALF_LIFE, .modes = (1u << KV_PM_COUNT) - 1, .max_new = 8,
                         .progress = on_progress, .put_tier = KV_TIER_DISK, .zstd_level = 3,
                         .put_queries = 32};
    const char *a;
    int oi;
    for (int c; (c = kv_cli_next(argc, argv, &a, &oi)) != -1;) {
        switch (c) {
        case O_MODEL: model = a; break;
        case O_SYNTH: synth = a; break;
        case O_WIDEN: widen = a; break;
        case O_WEIGHTS: weights = a; break;
        case O_TOKENIZER: tokenizer = a; break;
        case O_STORE: store = a; break;
        case O_GPU: po.gpu_bytes = kv_cli_bytes("--gpu-bytes", a); break;
        case O_HOST: po.host_bytes = kv_cli_bytes("--host-bytes", a); break;
        case O_MODES:
            if (kv_pmode_parse(a, &po.modes)) kv_cli_usage_error("--modes: %s", kv_errdetail());
            break;
        case O_IMPORTANT:
            po.important = kv_cli_double("--important", a, 0, 1);
            if (!(po.important > 0)) kv_cli_usage_error("--important must be in (0, 1]");
            break;
        case O_PUT_TIER: {
            int t = kv_tier_parse(a);
            if (t < 0) kv_cli_usage_error("--put-tier must be gpu, host or disk");
            po.put_tier = (kv_tier)t;
            break;
        }
        case O_ZSTD: po.zstd_level = (int)kv_cli_long("--zstd", a, 0, 19); break;
        case O_INSERT: po.insert_max = (int)kv_cli_long("--insert", a, 1, 1 << 30); break;
        case O_PUTQ: po.put_queries = (int)kv_cli_long("--put-queries", a, 0, 4096); break;
        case O_SKCH: po.sketch_channels = (int)kv_cli_long("--sketch-channels", a, 1, KV_TREE_SKETCH_MAX); break;
        case O_QUERIES: po.queries = (int)kv_cli_long("--queries", a, 1, KV_QAWARE_PROBE); break;
        case O_SKSERIAL: po.sketch_serial = true; break;
        case O_ROWSERIAL: po.rows_serial = true; break;
        case O_NOWARM: nowarm = true; break;
        case O_QAFOLLOW: { /* 0 asks for none: kv_qaware_opts.follow < 0 */
            const int nf = (int)kv_cli_long("--qa-follow", a, 0, KV_QAWARE_FOLLOW_MAX);
            po.qa_follow = nf ? nf : -1;
            break;
        }
        case O_QAHEADS:
            if (!strcmp(a, "max")) po.qa_heads = KV_QAWARE_MAX;
            else if (!strcmp(a, "sum")) po.qa_heads = KV_QAWARE_SUM;
            else kv_cli_usage_error("--qa-heads must be max or sum, not '%s'", a);
            break;
        case O_HALF: po.half_life = kv_cli_double("--half-life", a, 1e-3, 1e12); break;
        case O_STEPS: po.max_new = (int)kv_cli_long("-n", a, 1, 1 << 16); break;
        case O_CTX: ctx = (int)kv_cli_long("--ctx", a, 1, 1 << 24); break;
        case O_SEED: seed = (unsigned long)kv_cli_long("--seed", a, 0, 0x7fffffffL); break;
        case O_DEVICE: dev = kv_cli_device(a, &ordinal); break;
        case O_OUT: outp = a; break;
        case O_JSON: json = true; break;
        }
    }
    const char *reqf = kv_cli_operand(argc, argv, &oi, "REQUESTS.jsonl");
    kv_cli_no_more(argc, argv, oi);
    if (!model == !synth) kv_cli_usage_error("give exactly one of --model FILE and --synthetic NAME");
    if (widen && !model) kv_cli_usage_error("--widen needs --model");
    kv_dtype wt = synth && !strcmp(synth, "tiny") ? KV_DT_F32 : widen ? KV_DT_F16 : KV_DT_BF16;
    if (weights && kv_float_dtype_parse(weights, &wt)) kv_cli_usage_error("--weights must be f32, f16 or bf16");
    po.now = kv_cli_clock("KV_TREE_NOW");

    int rc = 0, nreq = 0, nrows = 0;
    char *text = NULL, *out = NULL, tmp[4096] = "", sdir[4200] = "";
    size_t len = 0;
    kv_preq *reqs = NULL;
    kv_model *m = NULL;
    kv_tokenizer *tok = NULL;
    kv_runner *r = NULL;
    kv_pbench_row *rows = NULL;
    kv_status st = kv_file_slurp(reqf, 0, "requests", &text, &len);
    if (st) {
        rc = kv_report(st, "cannot read %s", reqf);
        goto done;
    }
    if ((st = kv_preq_parse(text, len, &reqs, &nreq))) {
        rc = kv_report(st, "%s", reqf);
        goto done;
    }
    if ((st = synth ? kv_model_synthetic(synth, seed, wt, &m) : kv_model_open(model, &m))) {
        rc = kv_report(st, "cannot load model");
        goto done;
    }
    bool text_in = false;
    int longest = 0;
    for (int i = 0; i < nreq; i++) {
        text_in |= reqs[i].input != NULL;
        int n = reqs[i].input ? (int)strlen(reqs[i].input) + 2 : reqs[i].n; /* an upper bound for byte-level vocabularies */
        if (n > longest) longest = n;
    }
    st = kv_tokenizer_for_model(m, model, tokenizer, &tok);
    if (st && text_in) {
        rc = kv_report(st, "cannot load the tokenizer");
        goto done;
    }
    kv_errclear();
    if (widen) { /* the tokenizer stays the small model's */
        kv_model *w = NULL;
        st = kv_model_widen_named(m, widen, wt, &w);
        kv_model_close(m);
        m = w;
        if (st) {
            rc = kv_report(st, "--widen %s", widen);
            goto done;
        }
    }
    const char *td = getenv("TMPDIR");
    snprintf(tmp, sizeof tmp, "%s/kv-bench-prefix.XXXXXX", td && *td ? td : "/tmp");
    if (!mkdtemp(tmp)) {
        tmp[0] = 0;
        rc = kv_report(kv_fail(KV_E_CANTCREATE, "cannot create a temporary directory: %s", strerror(errno)), "prefix");
        goto done;
    }
    po.tmp_dir = tmp;
    if (!store) snprintf(sdir, sizeof sdir, "%s/store", tmp);
    po.store = store ? store : sdir;
    kv_gpu_engine_opts go;
    kv_gpu_engine_opts_default(&go);
    go.device = ordinal;
    if ((st = kv_runner_new(m, NULL, ctx ? ctx : longest + po.max_new, dev, &go, &r))) {
        rc = kv_report(st, dev == KV_DEVICE_CUDA ? "--device cuda" : "cannot build the engine");
        goto done;
    }
    /* a long-lived server's start: cuBLAS's set-up per row count paid here,
     * not inside the requests' times to first token (kv_gpu_engine_warm) */
    if (!nowarm && (st = kv_runner_warm(r, longest + po.max_new, &po.warm_ms, &po.warmed))) {
        rc = kv_report(st, "GPU warm-up");
        goto done;
    }
    if ((st = kv_pbench_run(r, tok, reqs, nreq, &po, &rows, &nrows))) {
        kv_progress_done();
        rc = kv_report(st, "prefix");
        goto done;
    }
    kv_progress_done();
    if (!(out = kv_pbench_json(rows, nrows, &po))) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "prefix");
        goto done;
    }
    if (outp && (st = kv_outfile_write(outp, out))) {
        rc = kv_report(st, "cannot write %s", outp);
        goto done;
    }
    if (kv_want_json(stdout, json)) printf("%s\n", out);
    else print_table(stdout, out);
done:
    if (!store && sdir[0] && nftw(sdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && errno != ENOENT)
        kv_warn("could not remove %s", sdir); /* our own store */
    if (tmp[0]) rmdir(tmp);
    free(out);
    kv_pbench_rows_free(rows, nrows);
    kv_runner_free(r);
    kv_tokenizer_free(tok);
    kv_model_close(m);
    kv_preq_free(reqs, nreq);
    free(text);
    return rc;
}
