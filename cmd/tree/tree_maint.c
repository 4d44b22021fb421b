/*
 * kv-tree's maintenance subcommands: place (tiers by score under budgets),
 * rm (a prefix's continuations), gc (evict to a byte budget) and check
 * (verify the index and every chunk).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "tree.h"

int tree_cmd_place(int argc, char **argv)
{
    const char *arg, *encs = NULL;
    int oi = 0, c, rc, zl = ZSTD_DEFAULT;
    uint64_t gpu = 0, host = 0;
    bool have_gpu = false, have_host = false;
    double half = KV_TREE_HALF_LIFE;
    kv_tree_enc enc[KV_TIER_COUNT];
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1) {
        if (c == O_ENC) tree_parse_encodings(arg, enc), encs = arg; /* checked now, applied to the store's below */
        else if (c == O_GPU) gpu = tree_bytes("--gpu-bytes", arg), have_gpu = true;
        else if (c == O_HOST) host = tree_bytes("--host-bytes", arg), have_host = true;
        else if (c == O_HALF) half = kv_cli_double("--half-life", arg, 1e-3, 1e12);
        else if (c == O_ZSTD) zl = (int)kv_cli_long("--zstd", arg, 1, 19);
    }
    const char *dir = tree_store_operand(argc, argv, oi);
    if (!have_gpu || !have_host) kv_cli_usage_error("place needs --gpu-bytes and --host-bytes");
    kv_tree_store *s = NULL;
    if ((rc = tree_open_store(dir, true, &s))) return rc;
    kv_place_report r;
    kv_errclear();
    kv_status st = KV_OK;
    if (encs) { /* over the store's own: a TIER=E list leaves the tiers it does not name as they are */
        memcpy(enc, kv_tree_store_tree(s)->enc, sizeof enc);
        if (!(st = kv_tree_encodings_apply(encs, enc))) kv_tree_store_set_encodings(s, enc);
    }
    if (!st) st = kv_tree_store_place(s, gpu, host, half, zl, tree_now(), &r);
    if (st) rc = kv_report(st, "%s", dir);
    else if (!(rc = tree_save_store(s, dir))) rc = tree_put_json(stdout, kv_place_report_json(&r, gpu, host));
    kv_tree_store_close(s);
    return rc;
}

int tree_cmd_rm(int argc, char **argv)
{
    const char *arg, *tokens = NULL, *kvc = NULL;
    int oi = 0, c, rc, n = 0;
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1) {
        if (c == O_TOKENS) tokens = arg;
        else if (c == O_KVC) kvc = arg;
    }
    const char *dir = tree_store_operand(argc, argv, oi);
    if (!tokens == !kvc) kv_cli_usage_error("give exactly one of --tokens and --kvc");
    int32_t *tok = NULL;
    kv_tree_store *s = NULL;
    if ((rc = tree_load_tokens(tokens, kvc, &tok, &n))) return rc;
    if (n == 0) {
        free(tok);
        kv_cli_usage_error("rm needs a non-empty prefix (use gc --max-bytes 0 to empty the store)");
    }
    if ((rc = tree_open_store(dir, true, &s))) goto out;
    kv_evict_report r;
    kv_errclear();
    kv_status st = kv_tree_store_rm(s, tok, n, &r);
    if (st) rc = kv_report(st, "%s", dir);
    else if (!(rc = tree_save_store(s, dir))) rc = tree_put_json(stdout, kv_evict_report_json(&r));
out:
    kv_tree_store_close(s);
    free(tok);
    return rc;
}

int tree_cmd_gc(int argc, char **argv)
{
    const char *arg;
    int oi = 0, c, rc;
    uint64_t max = 0;
    bool have_max = false;
    double half = KV_TREE_HALF_LIFE;
    while ((c = kv_cli_next(argc, argv, &arg, &oi)) != -1) {
        if (c == O_MAX) max = tree_bytes("--max-bytes", arg), have_max = true;
        else if (c == O_HALF) half = kv_cli_double("--half-life", arg, 1e-3, 1e12);
    }
    const char *dir = tree_store_operand(argc, argv, oi);
    if (!have_max) kv_cli_usage_error("gc needs --max-bytes");
    kv_tree_store *s = NULL;
    if ((rc = tree_open_store(dir, true, &s))) return rc;
    kv_evict_report r;
    kv_errclear();
    kv_status st = kv_tree_store_gc(s, max, half, tree_now(), &r); /* saves the index itself */
    rc = st ? kv_report(st, "%s", dir) : tree_put_json(stdout, kv_evict_report_json(&r));
    kv_tree_store_close(s);
    return rc;
}

int tree_cmd_check(int argc, char **argv)
{
    const char *arg;
    int oi = 0, rc;
    while (kv_cli_next(argc, argv, &arg, &oi) != -1) {}
    const char *dir = tree_store_operand(argc, argv, oi);
    kv_tree_store *s = NULL;
    if ((rc = tree_open_store(dir, false, &s))) return rc;
    kv_check_report r;
    kv_errclear();
    kv_status st = kv_tree_store_check(s, &r);
    if (st) rc = kv_report(st, "%s", dir);
    else {
        for (int i = 0; i < r.n_problems; i++) kv_warn("%s: %s", dir, r.problems[i]);
        if (r.temp_files)
            kv_note(0, "%s: %d leftover index temp file%s of an interrupted write (gc removes them)", dir,
                    r.temp_files, r.temp_files == 1 ? "" : "s");
        rc = tree_put_json(stdout, kv_check_report_json(&r));
        if (!rc && r.n_problems) rc = KV_EXIT_DATAERR;
    }
    kv_check_report_clear(&r);
    kv_tree_store_close(s);
    return rc;
}
