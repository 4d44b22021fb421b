/*
 * kv-info: summarise .kvc files (man/kv-info.1).  For each file: geometry,
 * token count, per-layer encodings and bytes, totals, the compression ratio
 * against the same K/V in F16, and whether checksums were verified.  A
 * table on a terminal, JSON when stdout is piped or with --json (one object
 * for one file, an array for several).  All reading and validation is
 * lib/format's (kvc_parse.c); this file only formats.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "format/kvc.h"

enum { OPT_JSON = 256 };

static const kv_option options[] = {
    {OPT_JSON, 'j', "json", NULL, "write JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-info",
    "[OPTIONS] FILE|- ...",
    "Summarise .kvc KV-cache files: geometry, encodings, bytes, checksums.",
    options,
    "A table on a terminal, JSON when stdout is not a terminal or with --json.\n"
    "Reads zstd-compressed input transparently; '-' reads stdin.",
};

static const char *checksum_state(const kvc_file *f)
{
    if (kvc_has_checksums(f)) return "verified";
    return kvc_n_checksums(f) ? "partial" : "absent";
}

static uint64_t total_bytes(const kvc_file *f)
{
    uint64_t n = 0;
    for (int i = 0; i < kvc_n_tensors(f); i++) n += kvc_tensor_at(f, i)->nbytes;
    return n;
}

static uint64_t kv_bytes(const kvc_file *f)
{
    uint64_t n = 0;
    for (int l = 0; l < kvc_geom(f)->n_layers; l++) n += kvc_layer_bytes(f, l, true);
    return n;
}

static uint64_t f16_bytes(const kv_geom *g)
{
    return 2ull * 2ull * (uint64_t)g->n_layers * (uint64_t)g->n_kv_heads * (uint64_t)g->n_tokens *
           (uint64_t)g->head_dim;
}

/* A DSQ key plane's base (kv_dsq.h): the file's layers.L.k.base_of, or
 * "salient" for files written before it (what readers assume then). */
static const char *dsq_base(const kvc_file *f, int l)
{
    char key[64];
    snprintf(key, sizeof key, "layers.%d.k.base_of", l);
    const char *v = kvc_meta(f, key); /* validated at open */
    return v ? v : "salient";
}

static cJSON *part_json(const kvc_file *f, int l, char which)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "encoding", kvc_layer_encoding(f, l, which));
    kv_kivi_params p;
    if (kvc_layer_kivi(f, l, which, &p)) {
        cJSON_AddNumberToObject(o, "bits", p.bits);
        cJSON_AddNumberToObject(o, "group", p.group);
        cJSON_AddNumberToObject(o, "residual", p.residual);
    } else if (!strcmp(kvc_layer_encoding(f, l, which), "dsq")) {
        static const char *keys[] = {"window", "salient", "bits", "group"};
        for (int i = 0; i < 4; i++) {
            char key[64];
            snprintf(key, sizeof key, "layers.%d.%c.%s", l, which, keys[i]);
            const char *v = kvc_meta(f, key); /* validated at open */
            cJSON_AddNumberToObject(o, keys[i], v ? atoi(v) : 0);
        }
        if (which == 'k') cJSON_AddStringToObject(o, "base_of", dsq_base(f, l));
    }
    return o;
}

/* A token subset's positions (man/kvc.5): count, first, last, and whether
 * they are one run (first .. last without gaps); false when there are none. */
typedef struct {
    int count;
    int32_t first, last;
    bool contiguous;
} pos_summary;

static bool positions_of(const kvc_file *f, pos_summary *p)
{
    int32_t *pos = NULL;
    int n = 0;
    memset(p, 0, sizeof *p);
    if (kvc_positions(f, &pos, &n) || !pos) return false; /* validated at open */
    p->count = n;
    p->first = n ? pos[0] : 0;
    p->last = n ? pos[n - 1] : 0;
    p->contiguous = !n || (int64_t)pos[n - 1] - pos[0] + 1 == n; /* strictly increasing */
    free(pos);
    return true;
}

static cJSON *file_json(const char *path, const kvc_file *f)
{
    const kv_geom *g = kvc_geom(f);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "file", path);
    const char *ver = kvc_meta(f, "kvc.version");
    cJSON_AddNumberToObject(o, "format_version", ver ? atoi(ver) : KVC_FORMAT_VERSION);
    cJSON_AddBoolToObject(o, "zstd", kvc_was_zstd(f));
    cJSON_AddNumberToObject(o, "file_bytes", (double)kvc_file_bytes(f));
    cJSON_AddStringToObject(o, "model", g->model);
    cJSON_AddNumberToObject(o, "n_layers", g->n_layers);
    cJSON_AddNumberToObject(o, "n_heads", g->n_heads);
    cJSON_AddNumberToObject(o, "n_kv_heads", g->n_kv_heads);
    cJSON_AddNumberToObject(o, "head_dim", g->head_dim);
    cJSON_AddNumberToObject(o, "n_tokens", g->n_tokens);
    cJSON_AddNumberToObject(o, "n_q", g->n_q);
    cJSON_AddBoolToObject(o, "has_tokens", kvc_find(f, "tokens") != NULL);
    pos_summary ps;
    if (positions_of(f, &ps)) {
        cJSON *p = cJSON_AddObjectToObject(o, "positions");
        cJSON_AddNumberToObject(p, "count", ps.count);
        cJSON_AddNumberToObject(p, "first", ps.first);
        cJSON_AddNumberToObject(p, "last", ps.last);
        cJSON_AddBoolToObject(p, "contiguous", ps.contiguous);
    } else
        cJSON_AddNullToObject(o, "positions");
    cJSON *r = cJSON_AddObjectToObject(o, "rope");
    cJSON_AddNumberToObject(r, "theta", g->rope_theta);
    cJSON_AddStringToObject(r, "scaling", g->rope_scaling == KV_ROPE_SCALING_LLAMA3 ? "llama3" : "none");
    if (g->rope_scaling == KV_ROPE_SCALING_LLAMA3) {
        cJSON_AddNumberToObject(r, "factor", g->rope_factor);
        cJSON_AddNumberToObject(r, "low_freq_factor", g->rope_low_freq_factor);
        cJSON_AddNumberToObject(r, "high_freq_factor", g->rope_high_freq_factor);
        cJSON_AddNumberToObject(r, "orig_ctx", g->rope_orig_ctx);
    }
    cJSON_AddStringToObject(r, "layout", g->rope_layout == KV_ROPE_HALVES ? "halves" : "interleaved");
    cJSON_AddBoolToObject(r, "keys_roped", g->keys_roped);
    cJSON *layers = cJSON_AddArrayToObject(o, "layers");
    for (int l = 0; l < g->n_layers; l++) {
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "layer", l);
        cJSON_AddItemToObject(e, "k", part_json(f, l, 'k'));
        cJSON_AddItemToObject(e, "v", part_json(f, l, 'v'));
        cJSON_AddNumberToObject(e, "bytes", (double)kvc_layer_bytes(f, l, false));
        cJSON_AddNumberToObject(e, "kv_bytes", (double)kvc_layer_bytes(f, l, true));
        cJSON_AddItemToArray(layers, e);
    }
    uint64_t kvb = kv_bytes(f), f16 = f16_bytes(g);
    cJSON_AddNumberToObject(o, "tensors", kvc_n_tensors(f));
    cJSON_AddNumberToObject(o, "total_bytes", (double)total_bytes(f));
    cJSON_AddNumberToObject(o, "kv_bytes", (double)kvb);
    cJSON_AddNumberToObject(o, "f16_kv_bytes", (double)f16);
    cJSON_AddNumberToObject(o, "ratio_vs_f16", kvb ? (double)f16 / (double)kvb : 0.0);
    cJSON_AddStringToObject(o, "checksums", checksum_state(f));
    cJSON_AddNumberToObject(o, "checksummed_tensors", kvc_n_checksums(f));
    return o;
}

static const char *human_bytes(uint64_t n, char *buf, size_t len)
{
    static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)n;
    int u = 0;
    while (v >= 1024 && u < 4) v /= 1024, u++;
    if (u == 0) snprintf(buf, len, "%llu B", (unsigned long long)n);
    else snprintf(buf, len, "%.1f %s", v, unit[u]);
    return buf;
}

static const char *part_text(const kvc_file *f, int l, char which, char *buf, size_t len)
{
    kv_kivi_params p;
    const char *e = kvc_layer_encoding(f, l, which);
    char key[64];
    if (kvc_layer_kivi(f, l, which, &p)) {
        snprintf(buf, len, "kivi%d g%d r%d", p.bits, p.group, p.residual);
    } else if (!strcmp(e, "dsq")) {
        snprintf(key, sizeof key, "layers.%d.%c.", l, which);
        char k1[80], k2[80], k3[80];
        snprintf(k1, sizeof k1, "%swindow", key);
        snprintf(k2, sizeof k2, "%ssalient", key);
        snprintf(k3, sizeof k3, "%sbits", key);
        snprintf(buf, len, "dsq%s w%s s%s%s%s", kvc_meta(f, k3), kvc_meta(f, k1), kvc_meta(f, k2),
                 which == 'k' ? " base " : "", which == 'k' ? dsq_base(f, l) : "");
    } else
        snprintf(buf, len, "%s", kvc_layer_encoding(f, l, which));
    return buf;
}

/* The table is for a terminal: text from the file (the model name, packed
 * layers' parameters) and the path are printed with control characters
 * escaped, as every message is. */
static void print_table(const char *path, const kvc_file *f)
{
    const kv_geom *g = kvc_geom(f);
    char b1[32], b2[32], b3[32], e[1024];
    kv_escape_controls(e, sizeof e, path);
    printf("%s: %s%s\n", e, human_bytes(kvc_file_bytes(f), b1, sizeof b1),
           kvc_was_zstd(f) ? ", zstd-compressed" : "");
    kv_escape_controls(e, sizeof e, g->model);
    if (g->model[0]) printf("  model      %s\n", e);
    printf("  geometry   %d layers, ", g->n_layers);
    if (g->n_heads) printf("%d heads, ", g->n_heads);
    else printf("query heads unknown, ");
    printf("%d kv heads, head dim %d\n", g->n_kv_heads, g->head_dim);
    printf("  tokens     %d%s", g->n_tokens, kvc_find(f, "tokens") ? "" : " (ids not stored)");
    if (g->n_q) printf(", %d queries per layer", g->n_q);
    pos_summary ps;
    if (positions_of(f, &ps))
        printf("\n  positions  %d (a token subset): first %d, last %d, %s", ps.count, ps.first, ps.last,
               ps.contiguous ? "contiguous" : "with gaps");
    printf("\n  rope       theta %g, %s pairs, keys %s", g->rope_theta,
           g->rope_layout == KV_ROPE_HALVES ? "split-halves" : "interleaved",
           g->keys_roped ? "roped" : "not roped");
    if (g->rope_scaling == KV_ROPE_SCALING_LLAMA3)
        printf(", llama3 scaling x%g (low %g, high %g, ctx %d)", g->rope_factor, g->rope_low_freq_factor,
               g->rope_high_freq_factor, g->rope_orig_ctx);
    printf("\n  %5s  %-16s %-16s %12s\n", "layer", "keys", "values", "bytes");
    for (int l = 0; l < g->n_layers; l++) {
        char k[48], v[48], ek[200], ev[200];
        kv_escape_controls(ek, sizeof ek, part_text(f, l, 'k', k, sizeof k));
        kv_escape_controls(ev, sizeof ev, part_text(f, l, 'v', v, sizeof v));
        printf("  %5d  %-16s %-16s %12s\n", l, ek, ev, human_bytes(kvc_layer_bytes(f, l, false), b1, sizeof b1));
    }
    uint64_t kvb = kv_bytes(f), f16 = f16_bytes(g);
    printf("  total      %s in %d tensors; K/V %s, %.2fx compression vs F16 (%s)\n",
           human_bytes(total_bytes(f), b1, sizeof b1), kvc_n_tensors(f), human_bytes(kvb, b2, sizeof b2),
           kvb ? (double)f16 / (double)kvb : 0.0, human_bytes(f16, b3, sizeof b3));
    const char *cs = checksum_state(f);
    if (!strcmp(cs, "verified")) printf("  checksums  verified (CRC-32C, %d tensors)\n", kvc_n_checksums(f));
    else if (!strcmp(cs, "partial"))
        printf("  checksums  partial: %d of %d tensors verified\n", kvc_n_checksums(f), kvc_n_tensors(f));
    else printf("  checksums  absent (not written by kvtools?)\n");
}

int main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    bool json_flag = false;
    const char *arg;
    int optind_ = 0, c;
    while ((c = kv_cli_next(argc, argv, &arg, &optind_)) != -1) {
        if (c == OPT_JSON) json_flag = true;
    }
    if (optind_ >= argc) kv_cli_usage_error("no input file (use - for stdin)");
    int n_stdin = 0;
    for (int i = optind_; i < argc; i++) n_stdin += !strcmp(argv[i], "-");
    if (n_stdin > 1) kv_cli_usage_error("stdin ('-') can be read only once");

    bool json = kv_want_json(stdout, json_flag);
    int nfiles = argc - optind_, rc = 0;
    cJSON *all = json && nfiles > 1 ? cJSON_CreateArray() : NULL;
    for (int i = optind_; i < argc; i++) {
        const char *path = argv[i];
        kvc_file *f = NULL;
        kv_errclear();
        kv_status st = kvc_open(path, &f);
        if (st) {
            int code = kv_report(st, "%s", strcmp(path, "-") ? path : "stdin");
            if (!rc) rc = code;
            continue;
        }
        if (json) {
            cJSON *o = file_json(path, f);
            if (all) {
                cJSON_AddItemToArray(all, o);
            } else {
                char *s = cJSON_Print(o);
                if (s) printf("%s\n", s);
                free(s);
                cJSON_Delete(o);
            }
        } else {
            if (i > optind_) printf("\n");
            print_table(path, f);
        }
        kvc_close(f);
    }
    if (all) {
        char *s = cJSON_Print(all);
        if (s) printf("%s\n", s);
        free(s);
        cJSON_Delete(all);
    }
    if (fflush(stdout) != 0 || ferror(stdout)) {
        kv_warn("write error on stdout");
        if (!rc) rc = KV_EXIT_IOERR;
    }
    return rc;
}
