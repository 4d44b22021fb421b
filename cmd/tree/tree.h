/*
 * The pieces of kv-tree (cmd/kv-tree.c has the option tables and the
 * init, put, get and ls subcommands): the option ids, the helpers every
 * subcommand uses (tree_common.c) and the maintenance subcommands place,
 * rm, gc and check (tree_maint.c).
 */
#ifndef TREE_TREE_H
#define TREE_TREE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "tree/kv_tree.h"

/* Options with a short name use it as their id: kv_cli_next returns the
 * short letter when the short form is used. */
enum { O_JSON = 'j', O_TOKENS = 't', O_OUT = 'o' };
enum { O_KVC = 256, O_IMPORTANT, O_REPORT, O_TIER, O_ZSTD, O_GPU, O_HOST, O_HALF, O_MAX, O_NO_TOUCH, O_ENC, O_SKCH };

#define ZSTD_DEFAULT 3

/* now in seconds: KV_TREE_NOW when set (a fixed clock for tests) */
int64_t tree_now(void);
/* --OPT's byte count (usage error above KV_TREE_BYTES_MAX) */
uint64_t tree_bytes(const char *opt, const char *s);
/* Writes json and a newline to fp and frees it; NULL json: out of memory. */
int tree_put_json(FILE *fp, char *json);
int tree_load_tokens(const char *tokens_path, const char *kvc_path, int32_t **tok, int *n);
const char *tree_store_operand(int argc, char **argv, int oi);
int tree_open_store(const char *dir, bool write, kv_tree_store **s);
int tree_save_store(kv_tree_store *s, const char *dir);
void tree_parse_encodings(const char *arg, kv_tree_enc enc[KV_TIER_COUNT]);

/* the subcommands in tree_maint.c (kv_cli_sub_fn) */
int tree_cmd_place(int argc, char **argv);
int tree_cmd_rm(int argc, char **argv);
int tree_cmd_gc(int argc, char **argv);
int tree_cmd_check(int argc, char **argv);

#endif
