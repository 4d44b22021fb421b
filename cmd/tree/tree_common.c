/*
 * kv-tree's helpers shared by its subcommands: the clock, byte-count
 * options, JSON reports, the request's tokens and the store's opening and
 * saving, each reporting its own failure.
 */
#include <stdio.h>
#include <stdlib.h>

#include "kv_cli.h"
#include "common/kv_file.h"
#include "tree.h"

int64_t tree_now(void) { return kv_cli_clock("KV_TREE_NOW"); /* a fixed clock for tests */ }

/* A byte count up to KV_TREE_BYTES_MAX, what the index holds exactly (a
 * larger budget was written but never read back). */
uint64_t tree_bytes(const char *opt, const char *s)
{
    uint64_t v = kv_cli_bytes(opt, s);
    if (v > KV_TREE_BYTES_MAX) kv_cli_usage_error("%s: '%s' is more than 2^53 bytes (8192T)", opt, s);
    return v;
}

/* Write a library-built JSON text (NULL: out of memory) and a newline. */
int tree_put_json(FILE *fp, char *json)
{
    int rc = !json ? kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "report") : fprintf(fp, "%s\n", json) < 0 ? KV_EXIT_IOERR : 0;
    free(json);
    return rc;
}

/* The request's token ids: a list file (or stdin) or a .kvc's tokens tensor. */
int tree_load_tokens(const char *tokens_path, const char *kvc_path, int32_t **tok, int *n)
{
    kv_status st = kvc_tokens_read(tokens_path, kvc_path, tok, n);
    return st ? kv_report(st, "cannot read the tokens") : 0;
}

/* The STORE operand, the last one. */
const char *tree_store_operand(int argc, char **argv, int oi)
{
    const char *dir = kv_cli_operand(argc, argv, &oi, "STORE");
    kv_cli_no_more(argc, argv, oi);
    return dir;
}

int tree_open_store(const char *dir, bool write, kv_tree_store **s)
{
    kv_errclear();
    kv_status st = kv_tree_store_open(dir, write, s);
    return st ? kv_report(st, "%s", dir) : 0;
}

int tree_save_store(kv_tree_store *s, const char *dir)
{
    kv_errclear();
    kv_status st = kv_tree_store_save(s);
    return st ? kv_report(st, "%s: cannot save the index", dir) : 0;
}

void tree_parse_encodings(const char *arg, kv_tree_enc enc[KV_TIER_COUNT])
{
    kv_errclear();
    if (kv_tree_encodings_parse(arg, enc)) kv_cli_usage_error("--encodings: %s", kv_errdetail());
}
