/*
 * kv_tree_json: the JSON every kv-tree subcommand reports (man/kv-tree.1,
 * REPORTS), built from the library's report structs so that the tool only
 * prints.  Each returns malloc'd text without a trailing newline, or NULL
 * when memory runs out; kv_tree_ls_write writes ls's JSON or table to a
 * stream the caller gives (as kv_compare_print does).
 */
#include "tree/kv_tree_int.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>

/* 64-bit counts as exact decimal text: cJSON prints numbers with 15
 * significant digits when that reads back within an epsilon, so a budget
 * of 2^53 came back as 9007199254740990. */
void tree_json_u64(struct cJSON *o, const char *key, uint64_t v)
{
    char b[32];
    snprintf(b, sizeof b, "%llu", (unsigned long long)v);
    cJSON_AddRawToObject(o, key, b);
}

void tree_json_i64(struct cJSON *o, const char *key, int64_t v)
{
    char b[32];
    snprintf(b, sizeof b, "%lld", (long long)v);
    cJSON_AddRawToObject(o, key, b);
}

static char *finish(cJSON *o)
{
    char *s = o ? cJSON_Print(o) : NULL;
    cJSON_Delete(o);
    return s;
}

char *kv_put_report_json(const kv_put_report *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "tokens", r->tokens);
    cJSON_AddNumberToObject(o, "matched", r->matched);
    cJSON_AddNumberToObject(o, "added_tokens", r->tokens - r->matched);
    cJSON_AddNumberToObject(o, "bytes_added", (double)r->bytes_added);
    cJSON_AddNumberToObject(o, "kv_bytes_added", (double)r->kv_bytes_added);
    cJSON_AddNumberToObject(o, "kv_bytes_shared", (double)r->kv_bytes_shared);
    cJSON_AddNumberToObject(o, "nodes_split", r->nodes_split);
    cJSON_AddNumberToObject(o, "bytes_rewritten", (double)r->bytes_rewritten);
    cJSON_AddStringToObject(o, "tier", kv_tier_name(r->tier));
    cJSON_AddStringToObject(o, "importance", r->attention ? "attention" : "key-norm");
    return finish(o);
}

char *kv_get_report_json(const kv_get_report *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "tokens", r->tokens);
    cJSON_AddNumberToObject(o, "matched", r->matched);
    cJSON_AddNumberToObject(o, "kept", r->kept);
    cJSON_AddNumberToObject(o, "skipped", r->skipped);
    cJSON_AddNumberToObject(o, "nodes", r->nodes);
    cJSON_AddBoolToObject(o, "positions", r->positions);
    cJSON_AddNumberToObject(o, "n_q", r->n_q);
    cJSON *br = cJSON_AddObjectToObject(o, "bytes_read"), *kb = cJSON_AddObjectToObject(o, "kv_bytes_out");
    for (int t = 0; t < KV_TIER_COUNT; t++) {
        cJSON_AddNumberToObject(br, kv_tier_name((kv_tier)t), (double)r->bytes_read[t]);
        cJSON_AddNumberToObject(kb, kv_tier_name((kv_tier)t), (double)r->kv_bytes_out[t]);
    }
    return finish(o);
}

char *kv_place_report_json(const kv_place_report *r, uint64_t gpu_budget, uint64_t host_budget)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "moved", r->moved);
    cJSON_AddNumberToObject(o, "reencoded", r->reencoded);
    cJSON_AddNumberToObject(o, "bytes_rewritten", (double)r->bytes_rewritten);
    for (int t = 0; t < KV_TIER_COUNT; t++) {
        cJSON *e = cJSON_AddObjectToObject(o, kv_tier_name((kv_tier)t));
        cJSON_AddNumberToObject(e, "nodes", r->nodes[t]);
        cJSON_AddNumberToObject(e, "kv_bytes", (double)r->kv_bytes[t]);
    }
    tree_json_u64(cJSON_GetObjectItem(o, "gpu"), "budget", gpu_budget);
    tree_json_u64(cJSON_GetObjectItem(o, "host"), "budget", host_budget);
    return finish(o);
}

char *kv_evict_report_json(const kv_evict_report *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "nodes_removed", r->nodes_removed);
    cJSON_AddNumberToObject(o, "bytes_freed", (double)r->bytes_freed);
    cJSON_AddNumberToObject(o, "orphans_removed", r->orphans_removed);
    cJSON_AddNumberToObject(o, "temp_files_removed", r->temps_removed);
    cJSON_AddNumberToObject(o, "bytes_after", (double)r->bytes_after);
    return finish(o);
}

char *kv_check_report_json(const kv_check_report *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddBoolToObject(o, "ok", r->n_problems == 0);
    cJSON_AddNumberToObject(o, "nodes", r->nodes);
    cJSON_AddNumberToObject(o, "chunks_ok", r->chunks_ok);
    cJSON_AddNumberToObject(o, "orphans", r->orphans);
    cJSON_AddNumberToObject(o, "temp_files", r->temp_files);
    cJSON *p = cJSON_AddArrayToObject(o, "problems");
    for (int i = 0; i < r->n_problems; i++) cJSON_AddItemToArray(p, cJSON_CreateString(r->problems[i]));
    return finish(o);
}

void kv_tree_totals(const kv_tree *t, kv_tree_total *tot)
{
    *tot = (kv_tree_total){0};
    for (int i = 1; i < t->n_nodes; i++) {
        tot->bytes += t->nodes[i].bytes;
        tot->kv_bytes += t->nodes[i].kv_bytes;
        tot->tokens += t->nodes[i].n;
        tot->nodes++;
    }
}

void tree_node_json(struct cJSON *o, const kv_tree_node *nd)
{
    cJSON_AddStringToObject(o, "file", nd->file);
    tree_json_u64(o, "bytes", nd->bytes);
    tree_json_u64(o, "kv_bytes", nd->kv_bytes);
    cJSON_AddStringToObject(o, "tier", kv_tier_name(nd->tier));
    cJSON_AddNumberToObject(o, "chunk", nd->chunk_version);
    char enc[24];
    kv_tree_enc_format(&nd->enc, enc, sizeof enc);
    cJSON_AddStringToObject(o, "encoding", enc);
    tree_json_u64(o, "hits", nd->hits);
    tree_json_i64(o, "last_use", nd->last_use);
    cJSON *im = cJSON_AddObjectToObject(o, "importance");
    cJSON_AddNumberToObject(im, "mean", nd->imp_mean);
    cJSON_AddNumberToObject(im, "min", nd->imp_min);
    cJSON_AddNumberToObject(im, "max", nd->imp_max);
    cJSON_AddStringToObject(im, "source", nd->imp_attention ? "attention" : "key-norm");
}

static cJSON *node_json(const kv_tree *t, int i, int64_t now, double half_life)
{
    const kv_tree_node *nd = &t->nodes[i];
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "id", i);
    cJSON_AddNumberToObject(o, "parent", nd->parent);
    cJSON_AddNumberToObject(o, "start", nd->start);
    cJSON_AddNumberToObject(o, "tokens", nd->n);
    cJSON_AddNumberToObject(o, "first_token", nd->tokens[0]);
    cJSON_AddNumberToObject(o, "children", nd->n_child);
    cJSON_AddNumberToObject(o, "score", kv_tree_score(nd, now, half_life));
    tree_node_json(o, nd);
    return o;
}

char *kv_tree_ls_json(const kv_tree *t, const char *store, int64_t now, double half_life)
{
    kv_tree_total tot;
    kv_tree_totals(t, &tot);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "store", store);
    cJSON_AddNumberToObject(o, "nodes", tot.nodes);
    cJSON_AddNumberToObject(o, "tokens", (double)tot.tokens);
    cJSON_AddNumberToObject(o, "bytes", (double)tot.bytes);
    cJSON_AddNumberToObject(o, "kv_bytes", (double)tot.kv_bytes);
    if (t->has_geom) {
        cJSON *g = cJSON_AddObjectToObject(o, "geometry");
        cJSON_AddNumberToObject(g, "n_layers", t->geom.g.n_layers);
        cJSON_AddNumberToObject(g, "n_heads", t->geom.g.n_heads);
        cJSON_AddNumberToObject(g, "n_kv_heads", t->geom.g.n_kv_heads);
        cJSON_AddNumberToObject(g, "head_dim", t->geom.g.head_dim);
        cJSON_AddStringToObject(g, "dtype", kv_dtype_name(t->geom.dtype));
    } else {
        cJSON_AddNullToObject(o, "geometry");
    }
    cJSON *arr = cJSON_AddArrayToObject(o, "list");
    for (int i = 1; i < t->n_nodes; i++) cJSON_AddItemToArray(arr, node_json(t, i, now, half_life));
    return finish(o);
}

kv_status kv_tree_ls_write(FILE *f, bool json, const kv_tree *t, const char *store, int64_t now, double half_life)
{
    if (json) {
        char *s = kv_tree_ls_json(t, store, now, half_life);
        if (!s) return kv_fail(KV_E_NOMEM, "out of memory writing JSON");
        fprintf(f, "%s\n", s);
        free(s);
        return ferror(f) ? kv_fail(KV_E_IO, "write error") : KV_OK;
    }
    kv_tree_total tot;
    kv_tree_totals(t, &tot);
    fprintf(f, "%s: %d nodes, %ld tokens, %llu bytes in chunks (%llu bytes of K/V)\n", store, tot.nodes, tot.tokens,
            (unsigned long long)tot.bytes, (unsigned long long)tot.kv_bytes);
    fprintf(f, "%5s %6s %7s %7s %10s %10s %-5s %-11s %6s %8s %8s  %s\n", "id", "parent", "start", "tokens", "bytes",
            "kv_bytes", "tier", "encoding", "hits", "imp_mean", "imp_max", "source");
    for (int i = 1; i < t->n_nodes; i++) {
        const kv_tree_node *nd = &t->nodes[i];
        if (!nd->live) continue;
        char enc[24];
        kv_tree_enc_format(&nd->enc, enc, sizeof enc);
        fprintf(f, "%5d %6d %7d %7d %10llu %10llu %-5s %-11s %6llu %8.3f %8.3f  %s\n", i, nd->parent, nd->start, nd->n,
                (unsigned long long)nd->bytes, (unsigned long long)nd->kv_bytes, kv_tier_name(nd->tier), enc,
                (unsigned long long)nd->hits, nd->imp_mean, nd->imp_max, nd->imp_attention ? "attention" : "key-norm");
    }
    return ferror(f) ? kv_fail(KV_E_IO, "write error") : KV_OK;
}
