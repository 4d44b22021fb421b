/*
 * kt_qaware: what the query-aware loading tests (test_qaware on the CPU,
 * test_gpu_qaware on the GPU) both set up: niah4k's first task split into
 * the whole prompt, the haystack before its question and the text before
 * its needle, and that haystack put into a new store whose disk chunks
 * carry a key sketch.  Both helpers are void so that OK and KT_REQUIRE can
 * leave them; the caller requires t->ok afterwards.
 */
#ifndef KT_QAWARE_H
#define KT_QAWARE_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "kt_kv.h"
#include "common/kv_file.h"
#include "engine/kv_runner.h"
#include "format/kvc.h"
#include "model/kv_model.h"
#include "model/kv_tokenizer.h"
#include "tree/kv_tree.h"

typedef struct {
    kv_model *m;
    kv_tokenizer *tok;
    int *ids, n;     /* the whole prompt (BOS first) */
    int *pids, np;   /* the haystack: the prompt up to "\nQuestion:", a prefix of ids */
    int *nids, nn;   /* the text before the needle: nn is the needle's first position */
    const char *ans; /* the expected answer (inside j) */
    char *text;      /* tasks-dev.jsonl */
    cJSON *j;        /* its first task */
    bool ok;
} kt_qaware_task;

static inline void kt_qaware_task_load(kt_qaware_task *t)
{
    memset(t, 0, sizeof *t);
    size_t len = 0;
    OK(kv_file_slurp("tests/data/niah4k/tasks-dev.jsonl", 0, "tasks", &t->text, &len));
    t->j = cJSON_ParseWithLength(t->text, strcspn(t->text, "\n"));
    KT_REQUIRE(t->j, "first task");
    const char *in = cJSON_GetObjectItem(t->j, "input")->valuestring;
    t->ans = cJSON_GetArrayItem(cJSON_GetObjectItem(t->j, "outputs"), 0)->valuestring;
    const char *qs = strstr(in, "\nQuestion:"), *nd = strstr(in, "The special magic number for");
    KT_REQUIRE(qs && nd && nd < qs, "task format");
    OK(kv_model_open("tests/data/niah4k/niah4k.bin", &t->m));
    OK(kv_tokenizer_load_llama2c("tests/data/niah4k/tok259.bin", 259, &t->tok));
    OK(kv_tokenizer_encode(t->tok, in, strlen(in), true, false, &t->ids, &t->n));
    OK(kv_tokenizer_encode(t->tok, in, (size_t)(qs - in), true, false, &t->pids, &t->np));
    OK(kv_tokenizer_encode(t->tok, in, (size_t)(nd - in), true, false, &t->nids, &t->nn));
    KT_REQUIRE(t->np < t->n && !memcmp(t->ids, t->pids, (size_t)t->np * sizeof *t->ids),
               "the haystack's ids begin the prompt's");
    t->ok = true;
}

static inline void kt_qaware_task_free(kt_qaware_task *t)
{
    free(t->ids), free(t->pids), free(t->nids), free(t->text);
    cJSON_Delete(t->j);
    kv_tokenizer_free(t->tok);
    kv_model_close(t->m);
    memset(t, 0, sizeof *t);
}

/* The haystack prefilled by r (a fresh or reset runner; 32 queries and the
 * K/V kept), dumped in f16 to DIR/hay.kvc (open in *f) and put on the disk
 * tier of a new store DIR/s with encodings encs (open in *s; put report in
 * *pr); dir: a mkdtemp template, filled in.  *ok when all of it worked. */
static inline void kt_qaware_store(kv_runner *r, const kt_qaware_task *t, const char *encs, char *dir,
                                   kv_tree_store **s, kvc_file **f, kv_put_report *pr, bool *ok)
{
    char sdir[600], kvp[700];
    *ok = false;
    KT_REQUIRE(mkdtemp(dir), "mkdtemp");
    snprintf(sdir, sizeof sdir, "%s/s", dir);
    snprintf(kvp, sizeof kvp, "%s/hay.kvc", dir);
    kv_tree_enc enc[KV_TIER_COUNT];
    OK(kv_tree_encodings_parse(encs, enc));
    OK(kv_tree_store_create_ex(sdir, enc));
    OK(kv_tree_store_open(sdir, true, s));
    OK(kv_runner_keep(r, 32, true));
    OK(kv_runner_prefill(r, t->pids, t->np, NULL));
    OK(kv_runner_dump_kvc(r, t->pids, t->np, KV_DT_F16, kvp, 0));
    OK(kvc_open(kvp, f));
    OK(kv_tree_store_put(*s, *f, KV_TIER_DISK, 3, 1000, pr));
    *ok = true;
}

#endif
