/*
 * kv-tree: a prefix-sharing KV-cache store on disk (man/kv-tree.1), after
 * IMPRESS.  Subcommands init, put, get, ls, place, rm, gc, check; each
 * parses its own option table (so `kv-tree put --help` describes put), then
 * calls lib/tree (which also builds the JSON reports) and prints.  Reports
 * are JSON (stdout, except for get, whose stdout may carry the .kvc: its
 * report goes to stderr or --report).  The helpers every subcommand uses
 * and the subcommands place, rm, gc and check are in cmd/tree/.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "common/kv_outfile.h"
#include "common/kv_file.h"
#include "tree/kv_tree.h"
#include "tree.h"

static const kv_option no_opts[] = {{0, 0, NULL, NULL, NULL}};
static const kv_option init_opts[] = {
    {O_ENC, 0, "encodings", "SPEC", "chunk encoding per tier: lossless (default), packed, or gpu=E,host=E,disk=E"},
    {O_SKCH, 0, "sketch-channels", "N", "key channels per KV head in +sketch chunks (1-4096; default head_dim/2)"},
    {0, 0, NULL, NULL, NULL},
};
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
    {O_ENC, 0, "encodings", "SPEC", "change the tiers' chunk encodings first (as for init); re-encodes"},
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

static const kv_cli_spec specs[] = {
    {"kv-tree init", "[OPTIONS] STORE", "Create an empty store directory.", init_opts,
     "Encodings: raw, kivi1, kivi2, kivi4, dsq1, dsq2, dsq4, each optionally +zstd;\n"
     "packed = gpu=raw,host=kivi2,disk=kivi2+zstd; lossless = gpu=raw,host=raw,disk=raw+zstd."},
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
     "Assign tiers by score under the budgets; chunks are re-encoded for their tier.", place_opts,
     "A chunk is rewritten when its encoding is not its tier's (or it is chunk version 1)."},
    {"kv-tree rm", "STORE (--tokens FILE|- | --kvc FILE)",
     "Remove every cached token that follows the given prefix.", rm_opts, NULL},
    {"kv-tree gc", "[OPTIONS] STORE --max-bytes N",
     "Evict the least valuable leaves to fit N bytes; delete orphaned chunks.", gc_opts, NULL},
    {"kv-tree check", "STORE", "Verify the index and every chunk (exit 65 on damage).", no_opts, NULL},
};

// --- subcommands ------------------------------------------------------------------

static int cmd_init(int argc, char **argv)
{
    const char *arg;
    int oi = 0, c, skch = 0;
    kv_tree_enc enc[KV_TIER_COUNT];
    kv_tree_encodings_default(enc);
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1) {
        if (c == O_ENC) tree_parse_encodings(arg, enc);
        else if (c == O_SKCH) skch = (int)kv_cli_long("--sketch-channels", arg, 1, KV_TREE_SKETCH_MAX);
    }
    const char *dir = tree_store_operand(argc, argv, oi);
    /* the first index names the sketch channels: no store is left behind without them */
    kv_status st = kv_tree_store_create_sk(dir, enc, skch);
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
    const char *dir = kv_cli_operand(argc, argv, &oi, "STORE");
    const char *in = kv_cli_operand(argc, argv, &oi, "input .kvc (use - for stdin)");
    kv_cli_no_more(argc, argv, oi);
    kvc_file *f = NULL;
    kv_tree_store *s = NULL;
    kv_status st;
    int rc;
    if ((st = kvc_open(in, &f))) return kv_report(st, "%s", strcmp(in, "-") ? in : "stdin");
    if ((rc = tree_open_store(dir, true, &s))) goto out;
    kv_put_report r;
    kv_errclear();
    if ((st = kv_tree_store_put(s, f, tier, zl, tree_now(), &r))) {
        rc = kv_report(st, "%s", strcmp(in, "-") ? in : "stdin");
        goto out;
    }
    if ((rc = tree_save_store(s, dir))) goto out;
    if (!r.attention) kv_note(0, "%s has no query samples: importance is the key-norm proxy", in);
    rc = tree_put_json(stdout, kv_put_report_json(&r));
out:
    kv_tree_store_close(s);
    kvc_close(f);
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
    const char *dir = tree_store_operand(argc, argv, oi);
    if (!tokens == !kvc) kv_cli_usage_error("give exactly one of --tokens and --kvc");
    if (!strcmp(out, "-") && report && !strcmp(report, "-"))
        kv_cli_usage_error("--report - needs -o FILE (stdout carries the .kvc)");
    if (!strcmp(out, "-")) kv_refuse_binary_tty(stdout, "a .kvc file");
    int32_t *tok = NULL;
    int n = 0, rc;
    kv_tree_store *s = NULL;
    if ((rc = tree_load_tokens(tokens, kvc, &tok, &n))) return rc;
    if ((rc = tree_open_store(dir, touch, &s))) goto out;
    kv_get_report r;
    kv_errclear();
    kv_status st = kv_tree_store_get(s, tok, n, frac, touch, tree_now(), out, &r);
    if (st) {
        rc = kv_report(st, "%s", dir);
        goto out;
    }
    if (touch && (rc = tree_save_store(s, dir))) goto out;
    char *json = kv_get_report_json(&r);
    if (!json) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "report");
    } else if (report) {
        kv_errclear();
        if ((st = kv_outfile_write(report, json))) rc = kv_report(st, "--report");
    } else if (kv_verbosity >= 0) {
        fprintf(stderr, "%s\n", json);
    }
    free(json);
out:
    kv_tree_store_close(s);
    free(tok);
    return rc;
}

static int cmd_ls(int argc, char **argv)
{
    const char *arg;
    int oi = 0, c, rc;
    bool json_flag = false;
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1)
        if (c == O_JSON) json_flag = true;
    const char *dir = tree_store_operand(argc, argv, oi);
    kv_tree_store *s = NULL;
    if ((rc = tree_open_store(dir, false, &s))) return rc;
    kv_status st = kv_tree_ls_write(stdout, kv_want_json(stdout, json_flag), kv_tree_store_tree(s), dir, tree_now(),
                                    KV_TREE_HALF_LIFE);
    if (st) rc = kv_report(st, "stdout");
    kv_tree_store_close(s);
    return rc;
}

static const kv_cli_sub_fn subs[] = {cmd_init, cmd_put, cmd_get, cmd_ls,
                                     tree_cmd_place, tree_cmd_rm, tree_cmd_gc, tree_cmd_check};

int main(int argc, char **argv)
{
    static const kv_cli_spec top = {"kv-tree", "SUBCOMMAND [OPTIONS] STORE ...",
                                    "Prefix-sharing KV-cache store with importance-aware tiers (IMPRESS).", no_opts,
                                    "Time: KV_TREE_NOW=SECONDS replaces the clock (for reproducible tests)."};
    static char extra[64];
    snprintf(extra, sizeof extra, "kv-tree index version %d, chunk version %d", KV_TREE_INDEX_VERSION,
             KV_TREE_CHUNK_VERSION);
    return kv_cli_subcommands(&top, specs, subs, (int)(sizeof subs / sizeof subs[0]), extra, argc, argv);
}
