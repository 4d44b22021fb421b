/*
 * kv-quant: quantize the K/V of a .kvc cache (KIVI 1/2/4-bit or DSQ) into a
 * packed .kvc, or decode a packed one back to F16, optionally only the
 * layers a kv-profile deploy config marks; --report writes bytes, ratio and
 * per-layer errors as JSON.  The work is lib/quant/kv_quant.c's kv_quant_file.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "common/kv_outfile.h"
#include "policy/kv_deploy.h"
#include "policy/kv_policy_dsqp.h"
#include "quant/kv_quant.h"
#include "format/kvc.h"

enum {
    OPT_METHOD = 256, OPT_BITS, OPT_GROUP, OPT_RESIDUAL, OPT_WINDOW, OPT_SALIENT, OPT_BASE, OPT_PROFILE,
    OPT_LAYERS, OPT_REPORT, OPT_ZSTD, OPT_DECODE = 'd', OPT_OUT = 'o'
};

static const kv_option opts[] = {
    {OPT_METHOD, 0, "method", "M", "kivi (default) or dsq"},
    {OPT_BITS, 'b', "bits", "B", "bits per code: 1, 2 or 4 (kivi default 1, dsq non-salient 2)"},
    {OPT_GROUP, 0, "group", "G", "KIVI group size (64); DSQ channels per group (32)"},
    {OPT_RESIDUAL, 0, "residual", "R", "KIVI recent tokens kept in fp16 (128)"},
    {OPT_WINDOW, 0, "window", "W", "DSQ tokens per window (64)"},
    {OPT_SALIENT, 0, "salient", "F", "DSQ share of salient tokens per window (0.2)"},
    {OPT_BASE, 0, "base", "rest|salient", "DSQ key base: mean of the other keys (rest) or of the salient ones (KVO-LLM)"},
    {OPT_PROFILE, 0, "profile", "P.json", "quantize only the layers a kv-profile deploy config marks"},
    {OPT_LAYERS, 0, "layers", "LIST", "quantize only these layers, e.g. 0,2,4-7"},
    {OPT_DECODE, 'd', "decode", NULL, "decode every layer to a plain F16 .kvc"},
    {OPT_OUT, 'o', "output", "FILE", "write the .kvc to FILE (default stdout)"},
    {OPT_ZSTD, 0, "zstd", "N", "compress the output .kvc with zstd at level N (1-19)"},
    {OPT_REPORT, 0, "report", "FILE|-", "write a JSON report (bytes, ratio, errors)"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-quant", "[OPTIONS] [FILE.kvc|-]",
    "Quantize (KIVI, DSQ) or decode the KV cache in a .kvc file.", opts,
    "Reads stdin when FILE is - or missing and writes the .kvc to stdout (never to a terminal)."};

int main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    const char *arg, *out_path = "-", *report_path = NULL, *profile = NULL, *layers = NULL;
    const char *method = NULL;
    long bits = -1, group = -1, residual = -1, window = -1; /* -1: not given */
    double salient = -1;
    int base = -1;
    bool decode = false;
    int c, optind_, zstd_level = 0;
    while ((c = kv_cli_next(argc, argv, &arg, &optind_)) != -1) {
        switch (c) {
        case OPT_METHOD:
            if (strcmp(arg, "kivi") && strcmp(arg, "dsq"))
                kv_cli_usage_error("--method must be kivi or dsq, not '%s'", arg);
            method = arg;
            break;
        case OPT_ZSTD: zstd_level = (int)kv_cli_long("--zstd", arg, 1, 19); break;
        case OPT_BITS:
            bits = kv_cli_long("--bits", arg, 1, 4);
            if (bits == 3) kv_cli_usage_error("--bits must be 1, 2 or 4");
            break;
        case OPT_GROUP: group = kv_cli_long("--group", arg, 1, 65536); break;
        case OPT_RESIDUAL: residual = kv_cli_long("--residual", arg, 0, 1L << 30); break;
        case OPT_WINDOW: window = kv_cli_long("--window", arg, 8, 4096); break;
        case OPT_SALIENT: salient = kv_cli_double("--salient", arg, 0, 1); break;
        case OPT_BASE:
            if (kv_dsq_base_parse(arg, &base)) kv_cli_usage_error("--base must be rest or salient, not '%s'", arg);
            break;
        case OPT_PROFILE: profile = arg; break;
        case OPT_LAYERS: layers = arg; break;
        case OPT_DECODE: decode = true; break;
        case OPT_OUT: out_path = arg; break;
        case OPT_REPORT: report_path = arg; break;
        }
    }
    if (argc - optind_ > 1) kv_cli_usage_error("expected at most one input file");
    const char *in_path = optind_ < argc ? argv[optind_] : "-";
    if (profile && layers) kv_cli_usage_error("use --profile or --layers, not both");
    if (decode && (profile || layers)) kv_cli_usage_error("--decode applies to every layer");
    if (report_path && !strcmp(report_path, "-") && !strcmp(out_path, "-"))
        kv_cli_usage_error("--report - needs -o FILE: stdout carries the .kvc");
    if (!strcmp(out_path, "-")) kv_refuse_binary_tty(stdout, "a .kvc file");

    int rc = 0;
    kvc_file *in = NULL;
    kvc_writer *w = NULL;
    bool *sel = NULL;
    kv_quant_layer *per = NULL;
    kv_deploy dep;
    kv_deploy_defaults(&dep);
    kv_quant_report rep;
    memset(&rep, 0, sizeof rep);
    kv_quant_opts o;
    memset(&o, 0, sizeof o);
    kv_outfile rep_out;
    bool rep_open = false;
    kv_status st;

    if ((st = kvc_open(in_path, &in))) {
        rc = kv_report(st, "%s", in_path);
        goto done;
    }
    /* kvc(5): a reader that cannot honour positions rejects the file.  DSQ's
     * importance and the report's attention error attend causally by row
     * index, which a subset's rows are not. */
    if (kvc_find(in, "positions")) {
        rc = kv_report(kv_fail(KV_E_DATA, "it has a positions tensor (a token subset, as kv-tree get --important "
                                          "writes); kv-quant packs whole caches only"),
                       "%s", in_path);
        goto done;
    }
    const kv_geom *g = kvc_geom(in);
    sel = calloc((size_t)g->n_layers + 1, sizeof *sel);
    if (!sel) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "layer table");
        goto done;
    }
    o.method = method && !strcmp(method, "dsq") ? KV_ENC_DSQ : KV_ENC_KIVI;
    int dsq_window = KV_DSQ_DEFAULT_WINDOW;
    double dsq_salient = KV_DSQ_DEFAULT_SALIENT_FRAC;
    o.kivi = (kv_kivi_params){KV_KIVI_DEFAULT_BITS, KV_KIVI_DEFAULT_GROUP, KV_KIVI_DEFAULT_RESIDUAL};
    if (profile) {
        if ((st = kv_deploy_read(profile, g->n_layers, &dep))) {
            rc = kv_report(st, "--profile");
            goto done;
        }
        kv_deploy_quant_mask(&dep, g->n_layers, sel);
        o.layers = sel;
        if (dep.per_layer) { /* versions 2 and 3: every layer's own encoding */
            if (method || bits > 0 || group > 0 || residual >= 0 || window > 0 || salient >= 0 || base >= 0)
                kv_cli_usage_error("--profile %s gives each layer's parameters: no --method, --bits, "
                                   "--group, --residual, --window, --salient or --base with it", profile);
            if (!(per = calloc((size_t)g->n_layers + 1, sizeof *per))) {
                rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "layer table");
                goto done;
            }
            for (int l = 0; l < g->n_layers; l++) {
                const kv_policy_params *x = &dep.per_layer[l];
                per[l].method = x->kind == KV_POL_QUANT ? KV_ENC_KIVI : x->kind == KV_POL_DSQ ? KV_ENC_DSQ
                                                                                            : KV_ENC_PLAIN;
                per[l].kivi = (kv_kivi_params){x->bits, x->group, x->residual};
                kv_policy_dsq_params(x, &per[l].dsq, NULL); /* the policy's: keys and values apart */
                per[l].dsq_vbits = x->dsq_vbits;
            }
            o.per_layer = per;
        }
        o.kivi = (kv_kivi_params){dep.quant.bits, dep.quant.group, dep.quant.residual};
        if (!method && dep.quant.kind == KV_POL_DSQ) o.method = KV_ENC_DSQ;
        dsq_window = dep.quant.dsq_window;
        dsq_salient = dep.quant.dsq_salient;
    } else if (layers) {
        if ((st = kv_layer_list_parse(layers, g->n_layers, sel)))
            kv_cli_usage_error("--layers: %s", kv_errdetail());
        o.layers = sel;
    }
    if (o.method == KV_ENC_KIVI) {
        if (bits > 0) o.kivi.bits = (int)bits;
        if (group > 0) o.kivi.group = (int)group;
        if (residual >= 0) o.kivi.residual = (int)residual;
    }
    kv_dsq_params_default(&o.dsq);
    if (window > 0) dsq_window = (int)window;
    if (salient >= 0) dsq_salient = salient;
    o.dsq.window = dsq_window;
    o.dsq.salient = kv_dsq_salient_count(dsq_window, dsq_salient);
    if (base >= 0) o.dsq.base = base;
    if (bits > 0 && o.method == KV_ENC_DSQ) o.dsq.bits = (int)bits;
    if (group > 0 && o.method == KV_ENC_DSQ) o.dsq.group = (int)group;
    o.decode = decode;
    /* An option of the other method would silently do nothing. */
    if (!decode && o.method == KV_ENC_KIVI && (window > 0 || salient >= 0 || base >= 0))
        kv_cli_usage_error("--window, --salient and --base go with --method dsq");
    if (!decode && o.method == KV_ENC_DSQ && residual >= 0)
        kv_cli_usage_error("--residual goes with --method kivi");
    if (!decode && !o.per_layer) {
        st = o.method == KV_ENC_DSQ ? kv_dsq_check(&o.dsq, g->head_dim)
                                    : kv_kivi_check(&o.kivi, g->head_dim);
        if (st) kv_cli_usage_error("%s", kv_errdetail());
    }

    /* Open the report before the .kvc is committed, so that an unwritable
       --report path fails with nothing written rather than after the fact. */
    if (report_path) {
        if ((st = kv_outfile_open(&rep_out, report_path))) {
            rc = kv_report(st, "%s", report_path);
            goto done;
        }
        rep_open = true;
    }
    if ((st = kvc_writer_new(&w)) || (st = kv_quant_file(in, &o, w, &rep))) {
        rc = kv_report(st, "%s", in_path);
        goto done;
    }
    /* A report on stdout cannot be taken back: write it before the .kvc, so
       that when it fails no .kvc is committed either.  A report file is
       committed after the .kvc. */
    if (rep_open) kv_quant_report_json(&rep, &o, rep_out.fp);
    if (rep_open && !rep_out.tmp) {
        rep_open = false;
        if ((st = kv_outfile_commit(&rep_out))) {
            rc = kv_report(st, "%s", report_path);
            goto done;
        }
    }
    if ((st = kvc_writer_write(w, out_path, zstd_level))) {
        rc = kv_report(st, "%s", strcmp(out_path, "-") ? out_path : "stdout");
        goto done;
    }
    kv_note(1, "K/V bytes %llu -> %llu (%.2fx), packing %.3f s",
            (unsigned long long)rep.kv_bytes_in, (unsigned long long)rep.kv_bytes_out,
            rep.kv_bytes_out ? (double)rep.kv_bytes_in / (double)rep.kv_bytes_out : 0.0,
            rep.pack_seconds);
    if (rep_open) {
        rep_open = false;
        if ((st = kv_outfile_commit(&rep_out))) rc = kv_report(st, "%s", report_path);
    }
done:
    if (rep_open) kv_outfile_abort(&rep_out);
    kv_quant_report_clear(&rep);
    kv_deploy_clear(&dep);
    kvc_writer_free(w);
    free(per);
    free(sel);
    kvc_close(in);
    return rc;
}
