/*
 * kv-tree: a prefix-sharing KV-cache store on disk (man/kv-tree.1), after
 * IMPRESS.  Subcommands init, put, get, ls, place, rm, gc, check; each
 * parses its own option table (so `kv-tree put --help` describes put), then
 * calls lib/tree/kv_tree.c and prints.  Reports are JSON (stdout, except for get,
 * whose stdout may carry the .kvc: its report goes to stderr or --report).
 */
#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_cli.h"
#include "common/kv_file.h"
#include "model/kv_tokenizer.h"
#include "tree/kv_tree.h"

/* Options with a short name use it as their id: kv_cli_next returns the
 * short letter when the short form is used. */
enum { O_JSON = 'j', O_TOKENS = 't', O_OUT = 'o' };
enum {
    O_KVC = 256, O_IMPORTANT, O_REPORT, O_TIER, O_ZSTD, O_GPU, O_HOST,
    O_HALF, O_MAX, O_NO_TOUCH
};

#define HALF_LIFE_DEFAULT 3600.0
#define ZSTD_DEFAULT 3

static const kv_option no_opts[] = {{0, 0, NULL, NULL, NULL}};
static const kv_option put_opts[] = {
    {O_TIER, 0, "tier", "TIER", "tier of the new suffix node: gpu, host or disk (default disk)"},
    {O_ZSTD, 0, "zstd", "N", "zstd level of disk-tier chunks (1-19, default 3)"},
    {0, 0, NULL, NULL, NULL},
};
static const kv_option get_opts[] = {
    {O_TOKENS, 't', "tokens", "FILE|-", "token ids to look up (text: integers)"},
    {O_KVC, 0, "kvc", "FILE", "look up the tokens tensor of a .kvc"},
    {O_OUT, 'o', "output", "FILE|-", "write the cached prefix as .kvc here (default stdout)"},
    {O_IMPORTANT, 0, "important", "FRAC", "disk-tier chunks give only their top FRAC tokens"},
    {O_REPORT, 0, "report", "FILE|-", "write the JSON report here instead of stderr"},
    {O_NO_TOUCH, 0, "no-touch", NULL, "do not count the hit (read-only; shared lock)"},
    {0, 0, NULL, NULL, NULL},
};
static const kv_option ls_opts[] = {
    {O_JSON, 'j', "json", NULL, "write JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};
static const kv_option place_opts[] = {
    {O_GPU, 0, "gpu-bytes", "N", "GPU tier budget in K/V bytes (suffix K, M, G: KiB...)"},
    {O_HOST, 0, "host-bytes", "N", "host tier budget in K/V bytes"},
    {O_HALF, 0, "half-life", "SECONDS", "recency half-life of the score (default 3600)"},
    {O_ZSTD, 0, "zstd", "N", "zstd level of chunks moved to disk (1-19, default 3)"},
    {0, 0, NULL, NULL, NULL},
};
static const kv_option rm_opts[] = {
    {O_TOKENS, 't', "tokens", "FILE|-", "the prefix (text: integers) whose continuations go"},
    {O_KVC, 0, "kvc", "FILE", "take the prefix from the tokens tensor of a .kvc"},
    {0, 0, NULL, NULL, NULL},
};
static const kv_option gc_opts[] = {
    {O_MAX, 0, "max-bytes", "N", "evict leaves until chunk files total at most N bytes"},
    {O_HALF, 0, "half-life", "SECONDS", "recency half-life of the score (default 3600)"},
    {0, 0, NULL, NULL, NULL},
};

static const char *env_note = "Time: KV_TREE_NOW=SECONDS replaces the clock (for reproducible tests).";

static const kv_cli_spec specs[] = {
    {"kv-tree init", "STORE", "Create an empty store directory.", no_opts, NULL},
    {"kv-tree put", "[OPTIONS] STORE FILE.kvc|-",
     "Insert a .kvc; shares cached prefixes and stores only the new suffix.  JSON report on stdout.",
     put_opts, NULL},
    {"kv-tree get", "[OPTIONS] STORE (--tokens FILE|- | --kvc FILE) [-o OUT|-]",
     "Write the longest cached prefix of a token sequence as .kvc.", get_opts,
     "The JSON report (matched tokens, bytes read per tier, tokens skipped) goes to\n"
     "stderr unless --report is given.  With --important the output has a positions tensor."},
    {"kv-tree ls", "[OPTIONS] STORE", "List the nodes: a table on a terminal, JSON when piped.", ls_opts,
     NULL},
    {"kv-tree place", "[OPTIONS] STORE --gpu-bytes N --host-bytes N",
     "Assign tiers by score under the budgets; disk chunks are compressed.", place_opts, NULL},
    {"kv-tree rm", "STORE (--tokens FILE|- | --kvc FILE)",
     "Remove every cached token that follows the given prefix.", rm_opts, NULL},
    {"kv-tree gc", "[OPTIONS] STORE --max-bytes N",
     "Evict the least valuable leaves to fit N bytes; delete orphaned chunks.", gc_opts, NULL},
    {"kv-tree check", "STORE", "Verify the index and every chunk (exit 65 on damage).", no_opts, NULL},
};
#define N_SUB ((int)(sizeof specs / sizeof specs[0]))

/* On a usage error: the one line that says how to get the full list. */
static void top_usage_short(void)
{
    fprintf(stderr, "usage: kv-tree SUBCOMMAND [OPTIONS] STORE ...\n"
                    "Try 'kv-tree --help' for more information.\n");
}

static void top_usage(FILE *f)
{
    fprintf(f, "usage: kv-tree SUBCOMMAND [OPTIONS] STORE ...\n"
               "Prefix-sharing KV-cache store with importance-aware tiers (IMPRESS).\n\nSubcommands:\n");
    for (int i = 0; i < N_SUB; i++) fprintf(f, "  %s %s\n      %s\n", specs[i].name, specs[i].synopsis, specs[i].summary);
    fprintf(f, "\nRun 'kv-tree SUBCOMMAND --help' for its options.  %s\n"
               "Exit status: 0 ok, 64 usage, 65 bad data, 66 no input, 69 unavailable,\n"
               "70 internal, 73 cannot create output, 74 I/O error.\n",
            env_note);
}

// --- helpers -------------------------------------------------------------------

static int64_t now_s(void)
{
    const char *e = getenv("KV_TREE_NOW");
    if (e && *e) return (int64_t)kv_cli_long("KV_TREE_NOW", e, 0, 1L << 40);
    return (int64_t)time(NULL);
}

/* A byte count up to KV_TREE_BYTES_MAX (what the index holds exactly).  It
 * starts with a digit: strtoull skips blanks and takes "-1" as 2^64-1. */
static uint64_t parse_bytes(const char *opt, const char *s)
{
    char *end;
    errno = 0;
    if (!isdigit((unsigned char)*s)) kv_cli_usage_error("%s expects a byte count, got '%s'", opt, s);
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) kv_cli_usage_error("%s expects a byte count, got '%s'", opt, s);
    unsigned sh = 0;
    switch (toupper((unsigned char)*end)) {
    case 0: break;
    case 'K': sh = 10; break;
    case 'M': sh = 20; break;
    case 'G': sh = 30; break;
    case 'T': sh = 40; break;
    default: kv_cli_usage_error("%s expects a byte count (suffix K, M, G, T), got '%s'", opt, s);
    }
    if (*end && end[1] && strcmp(end + 1, "iB") && strcmp(end + 1, "B"))
        kv_cli_usage_error("%s expects a byte count (suffix K, M, G, T), got '%s'", opt, s);
    if (v > (KV_TREE_BYTES_MAX >> sh))
        kv_cli_usage_error("%s: '%s' is more than 2^53 bytes (8192T)", opt, s);
    return (uint64_t)v << sh;
}

static int print_json(FILE *fp, cJSON *o)
{
    char *s = cJSON_Print(o);
    int rc = 0;
    if (!s || fprintf(fp, "%s\n", s) < 0) rc = KV_EXIT_IOERR;
    free(s);
    return rc;
}

/* Read token ids from a text file (or stdin) or a .kvc's tokens tensor. */
static int load_tokens(const char *tokens_path, const char *kvc_path, int32_t **tok, int *n)
{
    kv_status st;
    if (kvc_path) {
        kvc_file *f = NULL;
        if ((st = kvc_open(kvc_path, &f))) return kv_report(st, "%s", kvc_path);
        const kvc_tensor *t = kvc_find(f, "tokens");
        if (!t || t->dtype != KV_DT_I32 || t->ndim != 1) {
            kvc_free(f);
            kv_warn("%s: no tokens tensor (I32 [T])", kvc_path);
            return KV_EXIT_DATAERR;
        }
        *n = (int)t->shape[0];
        *tok = malloc((size_t)*n * sizeof **tok + 1);
        if (!*tok) kv_die(KV_EXIT_SOFTWARE, "out of memory");
        memcpy(*tok, t->data, (size_t)*n * sizeof **tok);
        kvc_free(f);
        return 0;
    }
    char *buf;
    size_t len;
    if ((st = kv_file_slurp(tokens_path, 0, "token list", &buf, &len))) return kv_report(st, "--tokens");
    st = kv_tokens_parse(buf, len, tok, n);
    free(buf);
    if (st) return kv_report(st, "%s", strcmp(tokens_path, "-") ? tokens_path : "stdin");
    return 0;
}

static int open_store(const char *dir, bool write, kv_tree_store **s)
{
    kv_errclear();
    kv_status st = kv_tree_store_open(dir, write, s);
    return st ? kv_report(st, "%s", dir) : 0;
}

static int save_store(kv_tree_store *s, const char *dir)
{
    kv_errclear();
    kv_status st = kv_tree_store_save(s);
    return st ? kv_report(st, "%s: cannot save the index", dir) : 0;
}

// --- subcommands ------------------------------------------------------------------

static const char *operand(int argc, char **argv, int *i, const char *what)
{
    if (*i >= argc) kv_cli_usage_error("missing %s", what);
    return argv[(*i)++];
}

static void no_more(int argc, char **argv, int i)
{
    if (i < argc) kv_cli_usage_error("unexpected argument '%s'", argv[i]);
}

static int cmd_init(int argc, char **argv)
{
    const char *arg;
    int oi = 0;
    while (kv_cli_next(argc, argv, &arg, &oi) != -1) {}
    const char *dir = operand(argc, argv, &oi, "STORE");
    no_more(argc, argv, oi);
    kv_status st = kv_tree_store_init(dir);
    if (st) return kv_report(st, "%s", dir);
    kv_note(1, "created store %s", dir);
    return 0;
}

static int cmd_put(int argc, char **argv)
{
    const char *arg;
    int oi = 0, c, zl = ZSTD_DEFAULT;
    kv_tier tier = KV_TIER_DISK;
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1) {
        if (c == O_ZSTD) zl = (int)kv_cli_long("--zstd", arg, 1, 19);
        else if (c == O_TIER) {
            int t = kv_tier_parse(arg);
            if (t < 0) kv_cli_usage_error("--tier expects gpu, host or disk, got '%s'", arg);
            tier = (kv_tier)t;
        }
    }
    const char *dir = operand(argc, argv, &oi, "STORE");
    const char *in = operand(argc, argv, &oi, "input .kvc (use - for stdin)");
    no_more(argc, argv, oi);
    kvc_file *f = NULL;
    kv_tree_store *s = NULL;
    kv_status st;
    int rc;
    if ((st = kvc_open(in, &f))) return kv_report(st, "%s", strcmp(in, "-") ? in : "stdin");
    if ((rc = open_store(dir, true, &s))) goto out;
    kv_put_report r;
    kv_errclear();
    if ((st = kv_tree_store_put(s, f, tier, zl, now_s(), &r))) {
        rc = kv_report(st, "%s", strcmp(in, "-") ? in : "stdin");
        goto out;
    }
    if ((rc = save_store(s, dir))) goto out;
    if (!r.attention) kv_note(0, "%s has no query samples: importance is the key-norm proxy", in);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "tokens", r.tokens);
    cJSON_AddNumberToObject(o, "matched", r.matched);
    cJSON_AddNumberToObject(o, "added_tokens", r.tokens - r.matched);
    cJSON_AddNumberToObject(o, "bytes_added", (double)r.bytes_added);
    cJSON_AddNumberToObject(o, "kv_bytes_added", (double)r.kv_bytes_added);
    cJSON_AddNumberToObject(o, "kv_bytes_shared", (double)r.kv_bytes_shared);
    cJSON_AddNumberToObject(o, "nodes_split", r.nodes_split);
    cJSON_AddNumberToObject(o, "bytes_rewritten", (double)r.bytes_rewritten);
    cJSON_AddStringToObject(o, "tier", kv_tier_name(r.tier));
    cJSON_AddStringToObject(o, "importance", r.attention ? "attention" : "key-norm");
    rc = print_json(stdout, o);
    cJSON_Delete(o);
out:
    kv_tree_store_close(s);
    kvc_free(f);
    return rc;
}

static int cmd_get(int argc, char **argv)
{
    const char *arg, *tokens = NULL, *kvc = NULL, *out = "-", *report = NULL;
    double frac = 1.0;
    bool touch = true;
    int oi = 0, c;
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1) {
        if (c == O_TOKENS) tokens = arg;
        else if (c == O_KVC) kvc = arg;
        else if (c == O_OUT) out = arg;
        else if (c == O_REPORT) report = arg;
        else if (c == O_NO_TOUCH) touch = false;
        else if (c == O_IMPORTANT) {
            frac = kv_cli_double("--important", arg, 0, 1);
            if (frac <= 0) kv_cli_usage_error("--important expects a fraction in (0, 1], got '%s'", arg);
        }
    }
    const char *dir = operand(argc, argv, &oi, "STORE");
    no_more(argc, argv, oi);
    if (!tokens == !kvc) kv_cli_usage_error("give exactly one of --tokens and --kvc");
    if (tokens && !strcmp(tokens, "-") && !strcmp(out, "-") && report && !strcmp(report, "-"))
        kv_cli_usage_error("stdout can carry only one of the output and the report");
    if (!strcmp(out, "-") && report && !strcmp(report, "-"))
        kv_cli_usage_error("--report - needs -o FILE (stdout carries the .kvc)");
    if (!strcmp(out, "-")) kv_refuse_binary_tty(stdout, "a .kvc file");
    int32_t *tok = NULL;
    int n = 0, rc;
    kv_tree_store *s = NULL;
    if ((rc = load_tokens(tokens, kvc, &tok, &n))) return rc;
    if ((rc = open_store(dir, touch, &s))) goto out;
    kv_get_report r;
    kv_errclear();
    kv_status st = kv_tree_store_get(s, tok, n, frac, touch, now_s(), out, &r);
    if (st) {
        rc = kv_report(st, "%s", dir);
        goto out;
    }
    if (touch && (rc = save_store(s, dir))) goto out;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "tokens", r.tokens);
    cJSON_AddNumberToObject(o, "matched", r.matched);
    cJSON_AddNumberToObject(o, "kept", r.kept);
    cJSON_AddNumberToObject(o, "skipped", r.skipped);
    cJSON_AddNumberToObject(o, "nodes", r.nodes);
    cJSON_AddBoolToObject(o, "positions", r.positions);
    cJSON *br = cJSON_AddObjectToObject(o, "bytes_read"), *kb = cJSON_AddObjectToObject(o, "kv_bytes_out");
    for (int t = 0; t < KV_TIER_COUNT; t++) {
        cJSON_AddNumberToObject(br, kv_tier_name((kv_tier)t), (double)r.bytes_read[t]);
        cJSON_AddNumberToObject(kb, kv_tier_name((kv_tier)t), (double)r.kv_bytes_out[t]);
    }
    if (report) {
        kv_outfile of;
        kv_errclear();
        if ((st = kv_outfile_open(&of, report))) rc = kv_report(st, "--report");
        else {
            char *txt = cJSON_Print(o);
            if (txt) fprintf(of.fp, "%s\n", txt);
            free(txt);
            if ((st = kv_outfile_commit(&of))) rc = kv_report(st, "--report");
        }
    } else if (kv_verbosity >= 0)
        print_json(stderr, o);
    cJSON_Delete(o);
out:
    kv_tree_store_close(s);
    free(tok);
    return rc;
}

static cJSON *node_json(const kv_tree *t, int i, int64_t now)
{
    const kv_tree_node *nd = &t->nodes[i];
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "id", i);
    cJSON_AddNumberToObject(o, "parent", nd->parent);
    cJSON_AddNumberToObject(o, "start", nd->start);
    cJSON_AddNumberToObject(o, "tokens", nd->n);
    cJSON_AddNumberToObject(o, "first_token", nd->tokens[0]);
    cJSON_AddNumberToObject(o, "children", nd->n_child);
    cJSON_AddStringToObject(o, "file", nd->file);
    cJSON_AddNumberToObject(o, "bytes", (double)nd->bytes);
    cJSON_AddNumberToObject(o, "kv_bytes", (double)nd->kv_bytes);
    cJSON_AddStringToObject(o, "tier", kv_tier_name(nd->tier));
    cJSON_AddNumberToObject(o, "hits", (double)nd->hits);
    cJSON_AddNumberToObject(o, "last_use", (double)nd->last_use);
    cJSON_AddNumberToObject(o, "score", kv_tree_score(nd, now, HALF_LIFE_DEFAULT));
    cJSON *im = cJSON_AddObjectToObject(o, "importance");
    cJSON_AddNumberToObject(im, "mean", nd->imp_mean);
    cJSON_AddNumberToObject(im, "min", nd->imp_min);
    cJSON_AddNumberToObject(im, "max", nd->imp_max);
    cJSON_AddStringToObject(im, "source", nd->imp_attention ? "attention" : "key-norm");
    return o;
}

static int cmd_ls(int argc, char **argv)
{
    const char *arg;
    int oi = 0, c, rc;
    bool json_flag = false;
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1)
        if (c == O_JSON) json_flag = true;
    const char *dir = operand(argc, argv, &oi, "STORE");
    no_more(argc, argv, oi);
    kv_tree_store *s = NULL;
    if ((rc = open_store(dir, false, &s))) return rc;
    const kv_tree *t = kv_tree_store_tree(s);
    int64_t now = now_s();
    uint64_t bytes = 0, kvb = 0;
    int nodes = 0;
    long toks = 0;
    for (int i = 1; i < t->n_nodes; i++) {
        bytes += t->nodes[i].bytes, kvb += t->nodes[i].kv_bytes, toks += t->nodes[i].n;
        nodes++;
    }
    if (kv_want_json(stdout, json_flag)) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "store", dir);
        cJSON_AddNumberToObject(o, "nodes", nodes);
        cJSON_AddNumberToObject(o, "tokens", (double)toks);
        cJSON_AddNumberToObject(o, "bytes", (double)bytes);
        cJSON_AddNumberToObject(o, "kv_bytes", (double)kvb);
        if (t->has_geom) {
            cJSON *g = cJSON_AddObjectToObject(o, "geometry");
            cJSON_AddNumberToObject(g, "n_layers", t->geom.g.n_layers);
            cJSON_AddNumberToObject(g, "n_heads", t->geom.g.n_heads);
            cJSON_AddNumberToObject(g, "n_kv_heads", t->geom.g.n_kv_heads);
            cJSON_AddNumberToObject(g, "head_dim", t->geom.g.head_dim);
            cJSON_AddStringToObject(g, "dtype", kv_dtype_name(t->geom.dtype));
        } else
            cJSON_AddNullToObject(o, "geometry");
        cJSON *arr = cJSON_AddArrayToObject(o, "list");
        for (int i = 1; i < t->n_nodes; i++) cJSON_AddItemToArray(arr, node_json(t, i, now));
        rc = print_json(stdout, o);
        cJSON_Delete(o);
    } else {
        printf("%s: %d nodes, %ld tokens, %llu bytes in chunks (%llu bytes of K/V)\n", dir, nodes, toks,
               (unsigned long long)bytes, (unsigned long long)kvb);
        printf("%5s %6s %7s %7s %10s %10s %-5s %6s %8s %8s  %s\n", "id", "parent", "start", "tokens", "bytes",
               "kv_bytes", "tier", "hits", "imp_mean", "imp_max", "source");
        for (int i = 1; i < t->n_nodes; i++) {
            const kv_tree_node *nd = &t->nodes[i];
            printf("%5d %6d %7d %7d %10llu %10llu %-5s %6llu %8.3f %8.3f  %s\n", i, nd->parent, nd->start, nd->n,
                   (unsigned long long)nd->bytes, (unsigned long long)nd->kv_bytes, kv_tier_name(nd->tier),
                   (unsigned long long)nd->hits, nd->imp_mean, nd->imp_max,
                   nd->imp_attention ? "attention" : "key-norm");
        }
    }
    kv_tree_store_close(s);
    return rc;
}

static int cmd_place(int argc, char **argv)
{
    const char *arg;
    int oi = 0, c, rc, zl = ZSTD_DEFAULT;
    uint64_t gpu = 0, host = 0;
    bool have_gpu = false, have_host = false;
    double half = HALF_LIFE_DEFAULT;
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1) {
        if (c == O_GPU) gpu = parse_bytes("--gpu-bytes", arg), have_gpu = true;
        else if (c == O_HOST) host = parse_bytes("--host-bytes", arg), have_host = true;
        else if (c == O_HALF) half = kv_cli_double("--half-life", arg, 1e-3, 1e12);
        else if (c == O_ZSTD) zl = (int)kv_cli_long("--zstd", arg, 1, 19);
    }
    const char *dir = operand(argc, argv, &oi, "STORE");
    no_more(argc, argv, oi);
    if (!have_gpu || !have_host) kv_cli_usage_error("place needs --gpu-bytes and --host-bytes");
    kv_tree_store *s = NULL;
    if ((rc = open_store(dir, true, &s))) return rc;
    kv_place_report r;
    kv_errclear();
    kv_status st = kv_tree_store_place(s, gpu, host, half, zl, now_s(), &r);
    if (st) rc = kv_report(st, "%s", dir);
    else if (!(rc = save_store(s, dir))) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "moved", r.moved);
        cJSON_AddNumberToObject(o, "bytes_rewritten", (double)r.bytes_rewritten);
        for (int t = 0; t < KV_TIER_COUNT; t++) {
            cJSON *e = cJSON_AddObjectToObject(o, kv_tier_name((kv_tier)t));
            cJSON_AddNumberToObject(e, "nodes", r.nodes[t]);
            cJSON_AddNumberToObject(e, "kv_bytes", (double)r.kv_bytes[t]);
        }
        char b[2][32]; /* exact: cJSON rounds numbers past 15 digits */
        snprintf(b[0], sizeof b[0], "%llu", (unsigned long long)gpu);
        snprintf(b[1], sizeof b[1], "%llu", (unsigned long long)host);
        cJSON_AddRawToObject(cJSON_GetObjectItem(o, "gpu"), "budget", b[0]);
        cJSON_AddRawToObject(cJSON_GetObjectItem(o, "host"), "budget", b[1]);
        rc = print_json(stdout, o);
        cJSON_Delete(o);
    }
    kv_tree_store_close(s);
    return rc;
}

static int evict_json(const kv_evict_report *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "nodes_removed", r->nodes_removed);
    cJSON_AddNumberToObject(o, "bytes_freed", (double)r->bytes_freed);
    cJSON_AddNumberToObject(o, "orphans_removed", r->orphans_removed);
    cJSON_AddNumberToObject(o, "temp_files_removed", r->temps_removed);
    cJSON_AddNumberToObject(o, "bytes_after", (double)r->bytes_after);
    int rc = print_json(stdout, o);
    cJSON_Delete(o);
    return rc;
}

static int cmd_rm(int argc, char **argv)
{
    const char *arg, *tokens = NULL, *kvc = NULL;
    int oi = 0, c, rc, n = 0;
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1) {
        if (c == O_TOKENS) tokens = arg;
        else if (c == O_KVC) kvc = arg;
    }
    const char *dir = operand(argc, argv, &oi, "STORE");
    no_more(argc, argv, oi);
    if (!tokens == !kvc) kv_cli_usage_error("give exactly one of --tokens and --kvc");
    int32_t *tok = NULL;
    kv_tree_store *s = NULL;
    if ((rc = load_tokens(tokens, kvc, &tok, &n))) return rc;
    if (n == 0) {
        free(tok);
        kv_cli_usage_error("rm needs a non-empty prefix (use gc --max-bytes 0 to empty the store)");
    }
    if ((rc = open_store(dir, true, &s))) goto out;
    kv_evict_report r;
    kv_errclear();
    kv_status st = kv_tree_store_rm(s, tok, n, &r);
    if (st) rc = kv_report(st, "%s", dir);
    else if (!(rc = save_store(s, dir))) rc = evict_json(&r);
out:
    kv_tree_store_close(s);
    free(tok);
    return rc;
}

static int cmd_gc(int argc, char **argv)
{
    const char *arg;
    int oi = 0, c, rc;
    uint64_t max = 0;
    bool have_max = false;
    double half = HALF_LIFE_DEFAULT;
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1) {
        if (c == O_MAX) max = parse_bytes("--max-bytes", arg), have_max = true;
        else if (c == O_HALF) half = kv_cli_double("--half-life", arg, 1e-3, 1e12);
    }
    const char *dir = operand(argc, argv, &oi, "STORE");
    no_more(argc, argv, oi);
    if (!have_max) kv_cli_usage_error("gc needs --max-bytes");
    kv_tree_store *s = NULL;
    if ((rc = open_store(dir, true, &s))) return rc;
    kv_evict_report r;
    kv_errclear();
    kv_status st = kv_tree_store_gc(s, max, half, now_s(), &r); /* saves the index itself */
    rc = st ? kv_report(st, "%s", dir) : evict_json(&r);
    kv_tree_store_close(s);
    return rc;
}

static int cmd_check(int argc, char **argv)
{
    const char *arg;
    int oi = 0, rc;
    while (kv_cli_next(argc, argv, &arg, &oi) != -1) {}
    const char *dir = operand(argc, argv, &oi, "STORE");
    no_more(argc, argv, oi);
    kv_tree_store *s = NULL;
    if ((rc = open_store(dir, false, &s))) return rc;
    kv_check_report r;
    kv_errclear();
    kv_status st = kv_tree_store_check(s, &r);
    if (st) rc = kv_report(st, "%s", dir);
    else {
        for (int i = 0; i < r.n_problems; i++) kv_warn("%s: %s", dir, r.problems[i]);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddBoolToObject(o, "ok", r.n_problems == 0);
        cJSON_AddNumberToObject(o, "nodes", r.nodes);
        cJSON_AddNumberToObject(o, "chunks_ok", r.chunks_ok);
        cJSON_AddNumberToObject(o, "orphans", r.orphans);
        cJSON_AddNumberToObject(o, "temp_files", r.temp_files);
        if (r.temp_files)
            kv_note(0, "%s: %d leftover index temp file%s of an interrupted write (gc removes them)", dir,
                    r.temp_files, r.temp_files == 1 ? "" : "s");
        cJSON *p = cJSON_AddArrayToObject(o, "problems");
        for (int i = 0; i < r.n_problems; i++) cJSON_AddItemToArray(p, cJSON_CreateString(r.problems[i]));
        rc = print_json(stdout, o);
        cJSON_Delete(o);
        if (!rc && r.n_problems) rc = KV_EXIT_DATAERR;
    }
    kv_check_report_free(&r);
    kv_tree_store_close(s);
    return rc;
}

typedef int (*sub_fn)(int argc, char **argv);
static const sub_fn subs[] = {cmd_init, cmd_put, cmd_get, cmd_ls, cmd_place, cmd_rm, cmd_gc, cmd_check};

int main(int argc, char **argv)
{
    static const kv_cli_spec top = {"kv-tree", "SUBCOMMAND [OPTIONS] STORE ...",
                                    "Prefix-sharing KV-cache store.", no_opts, NULL};
    kv_cli_init(&top, argc, argv);
    if (argc < 2) {
        fprintf(stderr, "kv-tree: missing subcommand\n");
        top_usage_short();
        return KV_EXIT_USAGE;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "-h") || !strcmp(sub, "--help")) {
        top_usage(stdout);
        return KV_EXIT_OK;
    }
    if (!strcmp(sub, "-V") || !strcmp(sub, "--version")) {
        static char extra[64];
        snprintf(extra, sizeof extra, "kv-tree index version %d", KV_TREE_INDEX_VERSION);
        kv_cli_version_extra = extra;
        const char *a;
        int oi;
        char *vargv[] = {argv[0], (char *)"--version", NULL};
        kv_cli_next(2, vargv, &a, &oi); /* prints and exits */
        return KV_EXIT_OK;
    }
    for (int i = 0; i < N_SUB; i++) {
        const char *name = specs[i].name + strlen("kv-tree ");
        if (!strcmp(sub, name)) {
            kv_cli_init(&specs[i], argc - 1, argv + 1);
            int rc = subs[i](argc - 1, argv + 1);
            if (!rc && (fflush(stdout) != 0 || ferror(stdout))) {
                kv_warn("write error on stdout");
                rc = KV_EXIT_IOERR;
            }
            return rc;
        }
    }
    kv_warn("unknown subcommand '%s'", sub); /* escaped: argv may hold anything */
    top_usage_short();
    return KV_EXIT_USAGE;
}
