/*
 * kv-run's prefill start: --kv FILE (a .kvc whose tokens the prompt
 * continues) or --store DIR (the longest cached prefix of a kv-tree store,
 * its files staged in a temporary directory of ours; the prompt's cache is
 * inserted afterwards unless --no-insert).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kv_cli.h"
#include "common/kv_stats.h"
#include "run.h"

int reuse_open_kv(const run_opts *o, reuse_state *u)
{
    kv_status st;
    if (!o->kv) return 0;
    if ((st = kvc_open(o->kv, &u->f)) || (st = kv_prefix_read(u->f, &u->pre))) return kv_report(st, "--kv %s", o->kv);
    if (u->pre.T < 1) return kv_report(kv_fail(KV_E_DATA, "the cache holds no tokens"), "--kv %s", o->kv);
    /* refused before a model is loaded: the dump would need the ids of
     * every token before the prompt, which a subset or an id-less cache lacks */
    if (o->dump && !kv_prefix_is_whole(&u->pre))
        return kv_report(kv_fail(KV_E_USAGE, "--dump-kv after --kv needs a cache of a whole prefix with its tokens "
                                             "(this one has %s)", u->pre.tokens ? "a subset of them" : "no token ids"),
                         "--kv %s", o->kv);
    return 0;
}

int reuse_begin(const run_opts *o, const kv_model *m, reuse_state *u)
{
    kv_status st = KV_OK;
    if (o->kv) {
        if ((st = kv_prefix_from_kvc(m, u->f, &u->pre))) return kv_report(st, "--kv %s", o->kv);
        return 0;
    }
    if (!o->store) return 0;
    const char *td = getenv("TMPDIR");
    snprintf(u->tmp, sizeof u->tmp, "%s/kv-run.XXXXXX", td && *td ? td : "/tmp");
    if (!mkdtemp(u->tmp)) {
        u->tmp[0] = 0;
        return kv_report(kv_fail(KV_E_CANTCREATE, "cannot create a temporary directory: %s", strerror(errno)), "--store");
    }
    u->ro = (kv_reuse_opts){.important = o->important, .query_aware = o->query_aware,
                            .keep_nq = o->dump || !o->no_insert ? o->nq : 0, .keep_kv = o->dump || !o->no_insert,
                            .insert = !o->no_insert, .tier = KV_TIER_DISK, .zstd_level = 3, .tmp_dir = u->tmp,
                            .now = kv_cli_clock("KV_TREE_NOW")};
    if ((st = kv_reuse_open(&u->ru, o->store, m, &u->ro))) return kv_report(st, "--store %s", o->store);
    u->ru_open = true;
    return 0;
}

kv_status reuse_prefill(const run_opts *o, kv_runner *r, reuse_state *u, const int *ids, int n, float *logits)
{
    if (o->store) return kv_reuse_prefill(&u->ru, r, ids, n, &u->ro, logits, &u->info);
    if (!o->kv) return kv_runner_prefill(r, ids, n, logits);
    double t0 = kv_now_ms();
    kv_status st = kv_runner_prefill_from(r, &u->pre, ids, n, logits);
    u->info = (kv_reuse_info){"kv", u->pre.T, u->pre.matched, n, kv_now_ms() - t0, 0, {0, 0, kvc_file_bytes(u->f)}, NULL};
    if (!st && kv_prefix_is_whole(&u->pre) && (u->all = malloc((size_t)(u->pre.T + n) * sizeof *u->all))) {
        for (int i = 0; i < u->pre.T; i++) memcpy(&u->all[i], (const char *)u->pre.tokens + 4 * (size_t)i, 4);
        memcpy(u->all + u->pre.T, ids, (size_t)n * sizeof *ids);
        u->n_all = u->pre.T + n;
    }
    return st;
}

void reuse_end(reuse_state *u)
{
    if (u->ru_open) kv_reuse_close(&u->ru);
    if (u->tmp[0]) rmdir(u->tmp);
    kvc_close(u->f);
    free(u->all);
}
