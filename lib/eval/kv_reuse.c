/*
 * kv_reuse: kv-run --store (see kv_reuse.h): lookup with
 * kv_tree_store_get_kvc (in memory), continue with kv_runner_prefill_from,
 * insert with the dump writer and kv_tree_store_put.
 */
#include "eval/kv_reuse.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <cjson/cJSON.h>

#include "common/kv_stats.h"

kv_status kv_reuse_open(kv_reuse *u, const char *store, const kv_model *m, const kv_reuse_opts *o)
{
    memset(u, 0, sizeof *u);
    kv_status st = kv_tree_store_open(store, o->insert, &u->s);
    if (st) return st;
    const kv_tree *t = kv_tree_store_tree(u->s);
    if (t->has_geom && (st = kv_prefix_check_model(m, &t->geom.g))) {
        kv_errcontext("store %s", store);
        kv_tree_store_close(u->s);
        u->s = NULL;
    }
    return st;
}

kv_status kv_reuse_prefill(kv_reuse *u, kv_runner *r, const int *tok, int n, const kv_reuse_opts *o,
                           float *logits, kv_reuse_info *info)
{
    memset(info, 0, sizeof *info);
    info->source = "store";
    if (n < 1) return kv_fail(KV_E_USAGE, "an empty prompt");
    double t0 = kv_now_ms();
    kv_status st = KV_OK;
    int matched = 0;
    const kv_tree *t = kv_tree_store_tree(u->s);
    if (t->has_geom && n > 1) {
        int32_t *ids = malloc((size_t)n * sizeof *ids);
        if (!ids) return kv_fail(KV_E_NOMEM, "out of memory");
        for (int i = 0; i < n; i++) ids[i] = tok[i];
        if (o->query_aware && o->important < 1) { /* the prompt's own queries choose the rows */
            free(ids);
            kv_qaware_opts qo = {o->important, KV_QAWARE_PROBE, KV_QAWARE_QUERIES, o->keep_nq, o->keep_kv, o->now, NULL,
                                 false, KV_QAWARE_MAX, 0, NULL};
            /* the rows read layer by layer beside the prefill, on the cores but this one */
            const int threads = kv_tree_load_threads();
            if ((st = kv_qaware_load_start(r, u->s, tok, n, &qo, threads, &u->rows, &u->qa, &u->pend))) return st;
            matched = u->rows.matched;
            kv_tree_rows *x = &u->rows;
            u->pre = (kv_prefix){.T = x->T, .matched = x->matched, .n_kv_heads = x->n_kv_heads, .head_dim = x->head_dim,
                                 .positions = x->T < x->matched ? x->positions : NULL, .tokens = x->tokens, .dt = x->dt,
                                 .k = (const void *const *)x->k, .v = (const void *const *)x->v,
                                 .wait = u->pend ? kv_tree_pending_wait : NULL, .wait_user = u->pend};
            u->get = (kv_get_report){.tokens = n - 1, .matched = matched, .kept = x->T, .skipped = matched - x->T,
                                     .positions = x->T < matched};
            u->get.bytes_read[KV_TIER_DISK] = u->qa.sketch_bytes + u->qa.row_bytes;
            goto loaded;
        }
        /* in memory: no file to write, sync and read back */
        kvc_file *f = NULL;
        st = kv_tree_store_get_kvc(u->s, ids, n - 1, o->important, o->insert, o->now, &f, &u->get);
        free(ids);
        if (st) return st;
        matched = u->get.matched;
        if (matched > 0) {
            u->f = f;
            if ((st = kv_prefix_from_kvc(kv_runner_model(r), u->f, &u->pre))) return st;
            if (u->pre.matched != matched)
                return kv_fail(KV_E_DATA, "the store's prefix says %d tokens, the lookup matched %d", u->pre.matched, matched);
        } else
            kvc_close(f);
    }
loaded:
    u->lookup_ms = kv_now_ms() - t0;
    if (matched > 0) st = kv_runner_prefill_from(r, &u->pre, tok + matched, n - matched, logits);
    else st = kv_runner_prefill(r, tok, n, logits);
    if (u->pend) { /* the rows' read ends with the prefill; its own error first */
        kv_get_report gr;
        kv_status fst = kv_tree_load_finish(u->pend, &gr, NULL, NULL);
        u->pend = NULL;
        if (fst) st = fst;
        else u->get.bytes_read[KV_TIER_DISK] += gr.bytes_read[KV_TIER_DISK] + gr.bytes_read[KV_TIER_HOST] +
                                               gr.bytes_read[KV_TIER_GPU];
    }
    if (st) return st;
    info->ttft_ms = kv_now_ms() - t0;
    info->lookup_ms = u->lookup_ms;
    info->matched = matched;
    info->reused_tokens = matched ? u->pre.T : 0;
    info->prefilled_tokens = n - matched;
    for (int i = 0; i < 3; i++) info->bytes_read[i] = u->get.bytes_read[i];
    return KV_OK;
}

kv_status kv_reuse_insert(kv_reuse *u, kv_runner *r, const int *tok, int n, const kv_reuse_opts *o)
{
    double t0 = kv_now_ms();
    const kv_tree *t = kv_tree_store_tree(u->s);
    kv_dtype dt = t->has_geom ? t->geom.dtype : KV_DT_F16;
    char path[4200];
    snprintf(path, sizeof path, "%s/insert.kvc", o->tmp_dir);
    kv_status st = kv_runner_dump_kvc(r, tok, n, dt, path, 0);
    kvc_file *f = NULL;
    if (!st) st = kvc_open(path, &f);
    unlink(path);
    if (!st) st = kv_tree_store_put(u->s, f, o->tier, o->zstd_level, o->now, &u->put);
    kvc_close(f);
    if (!st) st = kv_tree_store_save(u->s);
    if (!st) u->inserted = true;
    u->insert_ms = kv_now_ms() - t0;
    return st;
}

char *kv_reuse_json(const kv_reuse *u)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    char *g = kv_get_report_json(&u->get);
    cJSON *gj = g ? cJSON_Parse(g) : NULL;
    free(g);
    if (gj) cJSON_AddItemToObject(o, "get", gj);
    if (u->inserted) {
        char *p = kv_put_report_json(&u->put);
        cJSON *pj = p ? cJSON_Parse(p) : NULL;
        free(p);
        if (pj) cJSON_AddItemToObject(o, "put", pj);
        cJSON_AddNumberToObject(o, "insert_ms", u->insert_ms);
    } else {
        cJSON_AddNullToObject(o, "put");
    }
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

void kv_reuse_close(kv_reuse *u)
{
    if (u->pend) { /* (kv_reuse_prefill ends it; a failure before the prefill may not) */
        (void)kv_tree_load_finish(u->pend, NULL, NULL, NULL);
        u->pend = NULL;
        kv_errclear();
    }
    kv_tree_rows_free(&u->rows);
    kvc_close(u->f);
    u->f = NULL;
    kv_tree_store_close(u->s);
    u->s = NULL;
}
