/*
 * kv-profile: profile the layers and heads of one or more .kvc caches (with
 * query samples), measure what each policy a layer may get costs in error
 * and bytes, and choose per layer under a KV byte budget (or by TailorKV's
 * tau rule); prints JSON (or a table on a terminal) that ends with the
 * deployment config kv-run --profile, kv-quant --profile and kv-bench
 * read.  The measurements live in lib/eval/kv_profile.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>

#include "kv_cli.h"
#include "common/kv_outfile.h"
#include "policy/kv_deploy.h"
#include "eval/kv_profile.h"
#include "format/kvc.h"

enum {
    OPT_TAU = 256, OPT_ALPHA, OPT_NQ, OPT_BUDGET, OPT_CHANNELS, OPT_BITS, OPT_GROUP,
    OPT_RESIDUAL, OPT_SINK, OPT_WINDOW, OPT_SVG, OPT_JSON, OPT_KV_BUDGET, OPT_RULE, OPT_SELECT,
    OPT_CHOICES, OPT_MODEL, OPT_STEPS
};

static const kv_option opts[] = {
    {OPT_KV_BUDGET, 0, "kv-budget", "B", "resident KV bytes: a fraction of full's fp16 (<= 1) or bytes (0.25)"},
    {OPT_RULE, 0, "rule", "budget|tau", "choose by the errors under --kv-budget, or TailorKV's tau rule (budget)"},
    {OPT_CHOICES, 0, "choices", "LIST", "options measured and chosen from: names, comma-separated (all; without "
                                        "--model all but quant1-r0, stream32, stream64, sparse32)"},
    {OPT_MODEL, 'm', "model", "FILE", "the files' model: rate each option by the KL of decoding through it"},
    {OPT_STEPS, 0, "steps", "N", "with --model: decode each file's last N tokens (32)"},
    {OPT_TAU, 0, "tau", "T", "tau rule: score above T is quantization-friendly (0.2)"},
    {OPT_ALPHA, 0, "alpha", "A", "top share of keys for the score (0.05)"},
    {OPT_NQ, 0, "nq", "N", "use the last N stored queries (32; 0 = all)"},
    {OPT_BUDGET, 0, "budget", "K", "top-K tokens for sparse layers: a count, or a fraction < 1 (128)"},
    {OPT_CHANNELS, 0, "channels", "C", "critical channels for sparse selection (8)"},
    {OPT_SELECT, 0, "select", "MODE", "sparse selection: resident, channels, exact or pages (resident)"},
    {OPT_BITS, 'b', "bits", "B", "tau rule: bits of the quantized layers, 1, 2 or 4 (1)"},
    {OPT_GROUP, 0, "group", "G", "KIVI group size (64)"},
    {OPT_RESIDUAL, 0, "residual", "R", "KIVI recent tokens kept in fp16 (128)"},
    {OPT_SINK, 0, "sink", "S", "sink tokens always kept by sparse layers (8)"},
    {OPT_WINDOW, 0, "window", "W", "recent tokens always kept by sparse layers (56)"},
    {OPT_SVG, 0, "svg", "FILE", "write a heatmap of the scores (SVG)"},
    {OPT_JSON, 'j', "json", NULL, "JSON even on a terminal"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-profile", "[OPTIONS] FILE.kvc...",
    "Profile KV cache layers and choose each one's policy under a KV byte budget.", opts,
    "Each layer gets full, quant (1, 2, 4 bits; residual 0 and other groups too), sparse or\n"
    "dsq: the least total attention error whose resident bytes fit --kv-budget (--rule\n"
    "budget), or TailorKV's rule (--rule tau).  --choices names the options: full, quant1,\n"
    "quant2, quant4, sparse, dsq, quant2-r0, quant2-r32g32, quant4-r0, quant4-r0g128, dsq-s10,\n"
    "quant1-r0, stream32, stream64, sparse32.  With --model the error is the KL of the next-token\n"
    "distributions when the files' last --steps tokens are decoded with one layer under the\n"
    "option.  Several files are averaged per layer and head.  Output: JSON on stdout (a table\n"
    "on a terminal) whose \"deploy\" member kv-run, kv-quant and kv-bench take with --profile."};

static void print_table(const kv_profile *a, const kv_profile_params *p, const kv_deploy *d,
                        const kv_profile_choice *c)
{
    printf("%d file(s), %d layers, %d heads (%d KV), head dim %d, %d queries\n\n",
           a->n_docs < 0 ? -a->n_docs : a->n_docs, a->n_layers, a->n_heads, a->n_kv_heads,
           a->head_dim, a->n_q);
    /* one row per option measured, one column per layer: error (bytes / full) */
    printf("%-14s", "layer");
    for (int l = 0; l < a->n_layers; l++) printf("  %14d", l);
    printf("\n%-14s", "score (tau)");
    for (int l = 0; l < a->n_layers; l++)
        printf("  %7.3f %-6s", a->layer_score[l], a->layer_score[l] > p->tau ? "quant" : "sparse");
    printf("\n%-14s", "choice");
    for (int l = 0; l < a->n_layers; l++) printf("  %14s", kv_profile_opt_name(c->opt[l]));
    printf("\n");
    /* the error that decided: KL with --model, else the attention error */
    printf("%s\n", a->kl_docs > 0 ? "(KL, nats; bytes / full)" : "(attention error; bytes / full)");
    for (int o = KV_OPT_Q1; o < KV_OPT_COUNT; o++) {
        if (!(p->choices & (1u << o))) continue;
        printf("%-14s", kv_profile_opt_name((kv_profile_opt)o));
        for (int l = 0; l < a->n_layers; l++)
            printf("  %6.4f (%5.3f)", a->kl_docs > 0 ? a->kl[o][l] : a->layer_err[o][l],
                   a->bytes[o][l] / a->bytes[KV_OPT_FULL][l]);
        printf("\n");
    }
    printf("\nrule %s: %.0f of %.0f bytes (%.3f)", d->rule, c->bytes, c->full_bytes,
           c->full_bytes > 0 ? c->bytes / c->full_bytes : 0.0);
    if (p->rule == KV_RULE_BUDGET) printf(", budget %.0f%s", c->budget_bytes, c->budget_met ? "" : " (not met)");
    printf("\n");
    for (int l = 0; l < a->n_layers; l++) {
        char sp[512];
        if (kv_policy_spec_write(&d->per_layer[l], sp, sizeof sp)) sp[0] = 0;
        printf("  layer %d: %s\n", l, sp);
    }
}

int main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    kv_profile_params p;
    kv_profile_params_default(&p);
    const char *arg, *svg = NULL, *model = NULL;
    bool steps_given = false, choices_given = false;
    bool json = false;
    int c, optind_;
    while ((c = kv_cli_next(argc, argv, &arg, &optind_)) != -1) {
        switch (c) {
        case OPT_TAU: p.tau = kv_cli_double("--tau", arg, 0, 1); break;
        case OPT_KV_BUDGET: p.kv_budget = kv_cli_double("--kv-budget", arg, 1e-9, 1e18); break;
        case OPT_RULE:
            if (!strcmp(arg, "budget")) p.rule = KV_RULE_BUDGET;
            else if (!strcmp(arg, "tau")) p.rule = KV_RULE_TAU;
            else kv_cli_usage_error("--rule must be budget or tau, not '%s'", arg);
            break;
        case OPT_SELECT:
            if (kv_select_mode_parse(arg, &p.sparse.select) || p.sparse.select == KV_SELECT_SKETCH)
                kv_cli_usage_error("--select must be resident, channels, exact or pages, not '%s'", arg);
            break;
        case OPT_ALPHA: p.alpha = kv_cli_double("--alpha", arg, 1e-6, 1); break;
        case OPT_NQ: p.nq = (int)kv_cli_long("--nq", arg, 0, 1 << 20); break;
        case OPT_BUDGET: {
            double b = kv_cli_double("--budget", arg, 1e-9, 1 << 24);
            if (b < 1) {
                p.sparse.topk = 0;
                p.sparse.topk_frac = b;
            } else {
                p.sparse.topk = (int)kv_cli_long("--budget", arg, 1, 1 << 24);
            }
            break;
        }
        case OPT_CHANNELS: p.sparse.channels = (int)kv_cli_long("--channels", arg, 1, 65536); break;
        case OPT_BITS:
            p.quant.bits = (int)kv_cli_long("--bits", arg, 1, 4);
            if (p.quant.bits == 3) kv_cli_usage_error("--bits must be 1, 2 or 4");
            break;
        case OPT_GROUP: p.quant.group = (int)kv_cli_long("--group", arg, 1, 65536); break;
        case OPT_RESIDUAL: p.quant.residual = (int)kv_cli_long("--residual", arg, 0, 1L << 30); break;
        case OPT_SINK: p.sparse.sink = (int)kv_cli_long("--sink", arg, 0, 1L << 24); break;
        case OPT_WINDOW: p.sparse.window = (int)kv_cli_long("--window", arg, 0, 1L << 24); break;
        case OPT_CHOICES: {
            kv_status cs = kv_profile_choices_parse(arg, &p.choices);
            if (cs) kv_cli_usage_error("--choices: %s", kv_errdetail());
            choices_given = true;
            break;
        }
        case OPT_MODEL: model = arg; break;
        case OPT_STEPS:
            p.steps = (int)kv_cli_long("--steps", arg, 1, 1 << 24);
            steps_given = true;
            break;
        case OPT_SVG: svg = arg; break;
        case OPT_JSON: json = true; break;
        }
    }
    if (optind_ >= argc) kv_cli_usage_error("no input file");
    if (steps_given && !model) kv_cli_usage_error("--steps goes with --model");
    if (!choices_given && !model) p.choices &= ~KV_PROFILE_SMALL_CHOICES;
    if (model && p.rule == KV_RULE_TAU) kv_cli_usage_error("--model rates the options for --rule budget; --rule tau uses none");
    int rc = 0;
    kv_profile acc;
    memset(&acc, 0, sizeof acc);
    kv_deploy dep;
    kv_deploy_defaults(&dep);
    kv_profile_choice ch = {0};
    kv_status st;
    kv_model *m = NULL;
    /* The SVG is opened first, so that a bad path fails before the work,
       and committed last, so that a failed stdout leaves no SVG behind. */
    kv_outfile svg_out;
    bool svg_open = false;
    if (model && (st = kv_model_open(model, &m))) {
        rc = kv_report(st, "%s", model);
        goto done;
    }
    if (svg) {
        if ((st = kv_outfile_open(&svg_out, svg))) {
            rc = kv_report(st, "%s", svg);
            goto done;
        }
        svg_open = true;
    }
    for (int i = optind_; i < argc; i++) {
        kvc_file *f = NULL;
        kv_progress("profiling %s (%d of %d)", argv[i], i - optind_ + 1, argc - optind_);
        if ((st = kvc_open(argv[i], &f)) || (st = kv_profile_add(&acc, f, &p)) ||
            (m && (st = kv_profile_add_kl(&acc, f, m, &p)))) {
            rc = kv_report(st, "%s", argv[i]);
            kvc_close(f);
            goto done;
        }
        kvc_close(f);
    }
    kv_progress_done();
    kv_profile_finish(&acc);
    if ((st = kv_profile_deploy(&acc, &p, &dep, &ch))) {
        rc = kv_report(st, "deploy config");
        goto done;
    }
    if (p.rule == KV_RULE_BUDGET && !ch.budget_met)
        kv_warn("--kv-budget %g: even the fewest bytes per layer (%.0f) exceed it (%.0f); "
                "writing the fewest", p.kv_budget, ch.bytes, ch.budget_bytes);
    if (svg_open) kv_profile_write_svg(&acc, &p, svg_out.fp);
    if (kv_want_json(stdout, json)) kv_profile_write_json(&acc, &p, &dep, &ch, stdout);
    else print_table(&acc, &p, &dep, &ch);
    if (fflush(stdout) || ferror(stdout)) {
        rc = kv_report(kv_fail(KV_E_IO, "write error: %s", strerror(errno)), "stdout");
        goto done;
    }
    if (svg_open) {
        svg_open = false;
        if ((st = kv_outfile_commit(&svg_out))) rc = kv_report(st, "%s", svg);
    }
done:
    if (svg_open) kv_outfile_abort(&svg_out);
    kv_profile_choice_clear(&ch);
    kv_deploy_clear(&dep);
    kv_profile_clear(&acc);
    kv_model_close(m);
    return rc;
}
