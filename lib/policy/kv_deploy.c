/*
 * Deployment config: strict JSON parsing (cJSON), conversion to per-layer
 * policy parameters, and the writer kv-profile uses.  Strictness matters
 * here because a typo in a hand-edited profile would otherwise silently
 * deploy the wrong policy.
 */
#include "policy/kv_deploy.h"
#include "common/kv_file.h"
#include "common/kv_json.h"
#include "common/kv_layout.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void kv_deploy_defaults(kv_deploy *d)
{
    /* The policy defaults are the one source of these numbers, so that a
       deploy config that names no sizes deploys what --policy would. */
    memset(d, 0, sizeof *d);
    d->version = 1;
    kv_policy_params_default(&d->quant, KV_POL_QUANT);
    kv_policy_params_default(&d->sparse, KV_POL_SPARSE);
}

void kv_deploy_clear(kv_deploy *d)
{
    free(d->quant_layers);
    free(d->sparse_layers);
    free(d->per_layer);
    d->per_layer = NULL;
    d->quant_layers = d->sparse_layers = NULL;
    d->n_quant = d->n_sparse = 0;
}

static kv_status get_int(const cJSON *it, const char *name, int lo, int hi, int *out)
{
    if (!cJSON_IsNumber(it))
        return kv_fail(KV_E_DATA, "deploy config: \"%s\" must be a number", name);
    double v = it->valuedouble;
    if (v != floor(v) || v < lo || v > hi)
        return kv_fail(KV_E_DATA, "deploy config: \"%s\" must be an integer in %d..%d, not %g",
                       name, lo, hi, v);
    *out = (int)v;
    return KV_OK;
}

static kv_status get_list(const cJSON *it, const char *name, int n_layers, int **out, int *n)
{
    if (!cJSON_IsArray(it)) return kv_fail(KV_E_DATA, "deploy config: \"%s\" must be an array", name);
    int cnt = cJSON_GetArraySize(it);
    int *a = malloc(((size_t)cnt + 1) * sizeof *a);
    if (!a) return kv_fail(KV_E_NOMEM, "deploy config");
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, it)
    {
        int hi = n_layers > 0 ? n_layers - 1 : 1 << 20;
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || e->valuedouble < 0 ||
            e->valuedouble > hi) {
            free(a);
            if (cJSON_IsNumber(e))
                return kv_fail(KV_E_DATA, "deploy config: \"%s\": layer %g out of range 0..%d",
                               name, e->valuedouble, hi);
            return kv_fail(KV_E_DATA, "deploy config: \"%s\" must hold layer numbers", name);
        }
        a[i++] = (int)e->valuedouble;
    }
    *out = a;
    *n = cnt;
    return KV_OK;
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* The pre-session-6 dsq defaults for a version 2 layer whose spec did not
 * name them (kv_deploy.h). */
static void dsq_v2_defaults(const char *spec, kv_policy_params *p)
{
    if (p->kind != KV_POL_DSQ) return;
    if (!strstr(spec, "bits=")) p->dsq_kbits = p->dsq_vbits = KV_DSQ_DEFAULT_BITS;
    if (!strstr(spec, "salient=")) p->dsq_salient = KV_DSQ_DEFAULT_SALIENT_FRAC;
}

/* Versions 2 and 3: one spec per layer. */
static kv_status parse_v2(const cJSON *o, int n_layers, int ver, kv_deploy *d)
{
    static const char *const known[] = {"version", "n_layers", "rule", "kv_budget", "layers", NULL};
    static const char *const known_l[] = {"layer", "policy", "error", "bytes", NULL};
    kv_status st;
    const cJSON *it;
    cJSON_ArrayForEach(it, o)
    {
        int k = 0;
        while (known[k] && strcmp(known[k], it->string)) k++;
        if (!known[k]) return kv_fail(KV_E_DATA, "deploy config: unknown member \"%s\"", it->string);
    }
    d->version = ver;
    if (!(it = cJSON_GetObjectItemCaseSensitive(o, "n_layers")))
        return kv_fail(KV_E_DATA, "deploy config: version %d needs \"n_layers\"", ver);
    if ((st = get_int(it, "n_layers", 1, 1 << 20, &d->n_layers))) return st;
    if (n_layers > 0 && d->n_layers != n_layers)
        return kv_fail(KV_E_DATA, "deploy config is for %d layers, the model has %d", d->n_layers,
                       n_layers);
    if ((it = cJSON_GetObjectItemCaseSensitive(o, "rule"))) {
        if (!cJSON_IsString(it) || strlen(it->valuestring) >= sizeof d->rule)
            return kv_fail(KV_E_DATA, "deploy config: \"rule\" must be a short string");
        snprintf(d->rule, sizeof d->rule, "%s", it->valuestring);
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(o, "kv_budget"))) {
        if (!cJSON_IsNumber(it) || !(it->valuedouble >= 0))
            return kv_fail(KV_E_DATA, "deploy config: \"kv_budget\" must be a number >= 0");
        d->kv_budget = it->valuedouble;
    }
    const cJSON *ls = cJSON_GetObjectItemCaseSensitive(o, "layers");
    if (!ls || !cJSON_IsArray(ls))
        return kv_fail(KV_E_DATA, "deploy config: version %d needs a \"layers\" array", ver);
    const int L = d->n_layers;
    d->per_layer = malloc((size_t)L * sizeof *d->per_layer);
    bool *seen = calloc((size_t)L, 1);
    if (!d->per_layer || !seen) {
        free(seen);
        return kv_fail(KV_E_NOMEM, "deploy config");
    }
    for (int l = 0; l < L; l++) kv_policy_params_default(&d->per_layer[l], KV_POL_FULL);
    st = KV_OK;
    const cJSON *e;
    cJSON_ArrayForEach(e, ls)
    {
        if (!cJSON_IsObject(e)) {
            st = kv_fail(KV_E_DATA, "deploy config: \"layers\" must hold objects");
            break;
        }
        cJSON_ArrayForEach(it, e)
        {
            int k = 0;
            while (known_l[k] && strcmp(known_l[k], it->string)) k++;
            if (!known_l[k]) {
                st = kv_fail(KV_E_DATA, "deploy config: unknown member \"%s\" in \"layers\"", it->string);
                break;
            }
            if (k >= 2 && !cJSON_IsNumber(it)) {
                st = kv_fail(KV_E_DATA, "deploy config: \"%s\" must be a number", it->string);
                break;
            }
        }
        if (st) break;
        int l;
        const cJSON *ly = cJSON_GetObjectItemCaseSensitive(e, "layer");
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(e, "policy");
        if (!ly || !sp) {
            st = kv_fail(KV_E_DATA, "deploy config: a \"layers\" entry lacks \"%s\"", ly ? "policy" : "layer");
            break;
        }
        if ((st = get_int(ly, "layer", 0, L - 1, &l))) break;
        if (seen[l]) {
            st = kv_fail(KV_E_DATA, "deploy config: layer %d listed twice", l);
            break;
        }
        seen[l] = true;
        if (!cJSON_IsString(sp)) {
            st = kv_fail(KV_E_DATA, "deploy config: layer %d: \"policy\" must be a string", l);
            break;
        }
        /* one kind for this layer: a per-layer list inside would be ambiguous */
        if (!isalpha((unsigned char)sp->valuestring[0]) ||
            (st = kv_policy_parse(sp->valuestring, 1, &d->per_layer[l]))) {
            if (!st) kv_fail(KV_E_DATA, "not a policy of one kind");
            st = kv_fail(KV_E_DATA, "deploy config: layer %d: policy \"%s\": %s", l, sp->valuestring,
                         kv_errdetail());
            break;
        }
        if (ver == 2) dsq_v2_defaults(sp->valuestring, &d->per_layer[l]);
        d->per_layer[l].given = 0; /* front-end defaults still apply */
    }
    free(seen);
    return st;
}

static kv_status parse_obj(const cJSON *o, int n_layers, kv_deploy *d)
{
    static const char *const known[] = {"version", "n_layers", "method", "quant_layers",
                                        "sparse_layers", "bits", "group", "residual", "budget",
                                        "channels", "sink", "window", "dsq_window",
                                        "dsq_salient", NULL};
    kv_status st;
    const cJSON *it;
    int ver = 1;
    if ((it = cJSON_GetObjectItemCaseSensitive(o, "version")) &&
        (st = get_int(it, "version", 1, 1 << 20, &ver)))
        return st;
    if (ver > KV_DEPLOY_VERSION)
        return kv_fail(KV_E_DATA, "deploy config: version %d not supported (this reads 1 to %d)",
                       ver, KV_DEPLOY_VERSION);
    if (ver >= 2) return parse_v2(o, n_layers, ver, d);
    cJSON_ArrayForEach(it, o)
    {
        int k = 0;
        while (known[k] && strcmp(known[k], it->string)) k++;
        if (!known[k]) return kv_fail(KV_E_DATA, "deploy config: unknown member \"%s\"", it->string);
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(o, "n_layers"))) {
        if ((st = get_int(it, "n_layers", 1, 1 << 20, &d->n_layers))) return st;
        if (n_layers > 0 && d->n_layers != n_layers)
            return kv_fail(KV_E_DATA, "deploy config is for %d layers, the model has %d",
                           d->n_layers, n_layers);
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(o, "method"))) {
        if (!cJSON_IsString(it))
            return kv_fail(KV_E_DATA, "deploy config: \"method\" must be a string");
        if (!strcmp(it->valuestring, "kivi")) d->quant.kind = KV_POL_QUANT;
        else if (!strcmp(it->valuestring, "dsq")) d->quant.kind = KV_POL_DSQ;
        else return kv_fail(KV_E_DATA, "deploy config: method \"%s\" is not kivi or dsq", it->valuestring);
    }
    struct { const char *name; int lo, hi; int *dst; } ints[] = {
        {"bits", 1, 4, &d->quant.bits},         {"group", 1, 65536, &d->quant.group},
        {"residual", 0, 1 << 24, &d->quant.residual}, {"channels", 1, 1 << 16, &d->sparse.channels},
        {"sink", 0, 1 << 24, &d->sparse.sink},   {"window", 0, 1 << 24, &d->sparse.window},
        {"dsq_window", 8, 4096, &d->quant.dsq_window},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if ((it = cJSON_GetObjectItemCaseSensitive(o, ints[i].name)) &&
            (st = get_int(it, ints[i].name, ints[i].lo, ints[i].hi, ints[i].dst)))
            return st;
    if (d->quant.bits == 3) return kv_fail(KV_E_DATA, "deploy config: \"bits\" must be 1, 2 or 4, not 3");
    if (d->quant.dsq_window % 8)
        return kv_fail(KV_E_DATA, "deploy config: \"dsq_window\" must be a multiple of 8");
    if ((it = cJSON_GetObjectItemCaseSensitive(o, "budget"))) {
        if (!cJSON_IsNumber(it) || !(it->valuedouble > 0) || it->valuedouble > (1 << 24))
            return kv_fail(KV_E_DATA, "deploy config: \"budget\" must be a token count or a fraction in (0, 1)");
        if (it->valuedouble < 1) {
            d->sparse.topk = 0;
            d->sparse.topk_frac = it->valuedouble;
        } else if ((st = get_int(it, "budget", 1, 1 << 24, &d->sparse.topk))) {
            return st;
        } else {
            d->sparse.topk_frac = 0.0;
        }
    }
    if (d->quant.kind == KV_POL_DSQ) { /* kv_deploy.h: as version 1 meant them */
        const cJSON *b = cJSON_GetObjectItemCaseSensitive(o, "bits"), *g = cJSON_GetObjectItemCaseSensitive(o, "group");
        d->quant.dsq_kbits = d->quant.dsq_vbits = b ? d->quant.bits : KV_DSQ_DEFAULT_BITS;
        d->quant.dsq_group = g ? d->quant.group : KV_DSQ_DEFAULT_GROUP;
        d->quant.dsq_salient = KV_DSQ_DEFAULT_SALIENT_FRAC;
    }
    if ((it = cJSON_GetObjectItemCaseSensitive(o, "dsq_salient"))) {
        if (!cJSON_IsNumber(it) || !(it->valuedouble >= 0 && it->valuedouble <= 1))
            return kv_fail(KV_E_DATA, "deploy config: \"dsq_salient\" must be a number in [0, 1]");
        d->quant.dsq_salient = it->valuedouble;
    }
    const cJSON *ql = cJSON_GetObjectItemCaseSensitive(o, "quant_layers");
    const cJSON *sl = cJSON_GetObjectItemCaseSensitive(o, "sparse_layers");
    if (!ql || !sl)
        return kv_fail(KV_E_DATA, "deploy config: \"%s\" is missing", ql ? "sparse_layers" : "quant_layers");
    int lim = n_layers > 0 ? n_layers : d->n_layers;
    if ((st = get_list(ql, "quant_layers", lim, &d->quant_layers, &d->n_quant))) return st;
    if ((st = get_list(sl, "sparse_layers", lim, &d->sparse_layers, &d->n_sparse))) return st;
    qsort(d->quant_layers, (size_t)d->n_quant, sizeof(int), cmp_int);
    qsort(d->sparse_layers, (size_t)d->n_sparse, sizeof(int), cmp_int);
    for (int i = 1; i < d->n_quant; i++)
        if (d->quant_layers[i] == d->quant_layers[i - 1])
            return kv_fail(KV_E_DATA, "deploy config: layer %d listed twice in quant_layers", d->quant_layers[i]);
    for (int i = 1; i < d->n_sparse; i++)
        if (d->sparse_layers[i] == d->sparse_layers[i - 1])
            return kv_fail(KV_E_DATA, "deploy config: layer %d listed twice in sparse_layers", d->sparse_layers[i]);
    for (int i = 0, j = 0; i < d->n_quant && j < d->n_sparse;) {
        if (d->quant_layers[i] == d->sparse_layers[j])
            return kv_fail(KV_E_DATA, "deploy config: layer %d is both quantized and sparse", d->quant_layers[i]);
        if (d->quant_layers[i] < d->sparse_layers[j]) i++;
        else j++;
    }
    return KV_OK;
}

kv_status kv_deploy_parse(const char *json, size_t len, int n_layers, kv_deploy *out)
{
    kv_deploy_defaults(out);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root) return kv_fail(KV_E_DATA, "deploy config: not valid JSON");
    kv_status st;
    const cJSON *o = root;
    if (!cJSON_IsObject(root)) {
        st = kv_fail(KV_E_DATA, "deploy config: top level is not a JSON object");
    } else {
        const cJSON *dep = cJSON_GetObjectItemCaseSensitive(root, "deploy");
        if (dep) o = dep;
        if (!cJSON_IsObject(o)) st = kv_fail(KV_E_DATA, "deploy config: \"deploy\" is not an object");
        else st = parse_obj(o, n_layers, out);
    }
    cJSON_Delete(root);
    if (st) kv_deploy_clear(out);
    return st;
}

void kv_deploy_apply(const kv_deploy *d, int n_layers, kv_policy_params *per_layer)
{
    for (int i = 0; i < n_layers; i++) kv_policy_params_default(&per_layer[i], KV_POL_FULL);
    if (d->per_layer) {
        for (int i = 0; i < n_layers && i < d->n_layers; i++) per_layer[i] = d->per_layer[i];
        return;
    }
    for (int i = 0; i < d->n_quant; i++)
        if (d->quant_layers[i] < n_layers) per_layer[d->quant_layers[i]] = d->quant;
    for (int i = 0; i < d->n_sparse; i++)
        if (d->sparse_layers[i] < n_layers) per_layer[d->sparse_layers[i]] = d->sparse;
}

kv_status kv_deploy_read(const char *path, int n_layers, kv_deploy *out)
{
    char *buf = NULL;
    size_t len = 0;
    kv_deploy_defaults(out);
    kv_status st = kv_file_slurp(path, (size_t)64 << 20, "deploy config", &buf, &len);
    if (st) return st;
    st = kv_deploy_parse(buf, len, n_layers, out);
    free(buf);
    if (st) kv_errcontext("%s", path);
    return st;
}

kv_status kv_deploy_load(const char *path, int n_layers, kv_policy_params *per_layer)
{
    kv_deploy d;
    kv_status st = kv_deploy_read(path, n_layers, &d);
    if (st) return st;
    kv_deploy_apply(&d, n_layers, per_layer);
    kv_deploy_clear(&d);
    return KV_OK;
}

kv_status kv_policies_load(const char *spec, const char *profile_path, const kv_policy_defaults *d,
                           int n_layers, kv_policy_params *per_layer)
{
    kv_status st = profile_path ? kv_deploy_load(profile_path, n_layers, per_layer)
                                : kv_policy_parse(spec ? spec : "full", n_layers, per_layer);
    if (st == KV_OK && d) kv_policy_defaults_apply(d, per_layer, n_layers);
    return st;
}

void kv_deploy_quant_mask(const kv_deploy *d, int n_layers, bool *quant)
{
    for (int i = 0; i < n_layers; i++) quant[i] = false;
    if (d->per_layer) {
        for (int i = 0; i < n_layers && i < d->n_layers; i++)
            quant[i] = d->per_layer[i].kind == KV_POL_QUANT || d->per_layer[i].kind == KV_POL_DSQ;
        return;
    }
    for (int i = 0; i < d->n_quant; i++)
        if (d->quant_layers[i] < n_layers) quant[d->quant_layers[i]] = true;
}

static void write_list(FILE *f, const int *a, int n)
{
    fputc('[', f);
    for (int i = 0; i < n; i++) fprintf(f, "%s%d", i ? ", " : "", a[i]);
    fputc(']', f);
}

void kv_deploy_write_json(const kv_deploy *d, FILE *f, int indent)
{
    kv_deploy_write_json_ext(d, NULL, NULL, f, indent);
}

void kv_deploy_write_json_ext(const kv_deploy *d, const double *errors, const double *bytes, FILE *f,
                              int indent)
{
    const char *pad = "                                ";
    int in = indent + 2 < 32 ? indent + 2 : 32;
    if (d->per_layer) {
        fprintf(f, "{\n%.*s\"version\": %d,\n%.*s\"n_layers\": %d,\n", in, pad, KV_DEPLOY_VERSION, in, pad,
                d->n_layers);
        if (d->rule[0]) fprintf(f, "%.*s\"rule\": \"%s\",\n", in, pad, d->rule);
        if (d->kv_budget > 0) fprintf(f, "%.*s\"kv_budget\": %.17g,\n", in, pad, d->kv_budget);
        fprintf(f, "%.*s\"layers\": [", in, pad);
        for (int l = 0; l < d->n_layers; l++) {
            char spec[512];
            if (kv_policy_spec_write(&d->per_layer[l], spec, sizeof spec)) snprintf(spec, sizeof spec, "full");
            fprintf(f, "%s\n%.*s  {\"layer\": %d, \"policy\": \"%s\"", l ? "," : "", in, pad, l, spec);
            if (errors) {
                fputs(", \"error\": ", f);
                kv_json_number(f, errors[l]);
            }
            if (bytes) fprintf(f, ", \"bytes\": %.0f", bytes[l]);
            fputc('}', f);
        }
        fprintf(f, "\n%.*s]\n%.*s}", in, pad, indent < 32 ? indent : 32, pad);
        return;
    }
    fprintf(f, "{\n%.*s\"version\": 1,\n", in, pad);
    if (d->n_layers) fprintf(f, "%.*s\"n_layers\": %d,\n", in, pad, d->n_layers);
    fprintf(f, "%.*s\"method\": \"%s\",\n", in, pad, d->quant.kind == KV_POL_DSQ ? "dsq" : "kivi");
    fprintf(f, "%.*s\"quant_layers\": ", in, pad);
    write_list(f, d->quant_layers, d->n_quant);
    fprintf(f, ",\n%.*s\"sparse_layers\": ", in, pad);
    write_list(f, d->sparse_layers, d->n_sparse);
    const bool dsq = d->quant.kind == KV_POL_DSQ; /* version 1 has one width: the keys' */
    fprintf(f, ",\n%.*s\"bits\": %d,\n%.*s\"group\": %d,\n%.*s\"residual\": %d,\n", in, pad,
            dsq ? d->quant.dsq_kbits : d->quant.bits, in, pad, dsq ? d->quant.dsq_group : d->quant.group, in,
            pad, d->quant.residual);
    if (d->sparse.topk > 0) fprintf(f, "%.*s\"budget\": %d,\n", in, pad, d->sparse.topk);
    else fprintf(f, "%.*s\"budget\": %.17g,\n", in, pad, d->sparse.topk_frac);
    fprintf(f, "%.*s\"channels\": %d,\n%.*s\"sink\": %d,\n%.*s\"window\": %d,\n", in, pad,
            d->sparse.channels, in, pad, d->sparse.sink, in, pad, d->sparse.window);
    fprintf(f, "%.*s\"dsq_window\": %d,\n%.*s\"dsq_salient\": %.17g\n%.*s}", in, pad,
            d->quant.dsq_window, in, pad, d->quant.dsq_salient, indent < 32 ? indent : 32, pad);
}

kv_status kv_layer_list_parse(const char *s, int n_layers, bool *sel)
{
    for (int i = 0; i < n_layers; i++) sel[i] = false;
    if (!strcmp(s, "all") || !strcmp(s, "*")) {
        for (int i = 0; i < n_layers; i++) sel[i] = true;
        return KV_OK;
    }
    const char *p = s;
    for (;;) {
        char *end;
        long a = strtol(p, &end, 10), b;
        if (end == p || *p == '-' || *p == '+' || *p == ' ')
            return kv_fail(KV_E_USAGE, "layer list '%s': expected a layer number at '%s'", s, p);
        b = a;
        p = end;
        if (*p == '-') {
            const char *q = p + 1;
            b = strtol(q, &end, 10);
            if (end == q || *q == '-' || *q == '+' || *q == ' ')
                return kv_fail(KV_E_USAGE, "layer list '%s': bad range end at '%s'", s, q);
            p = end;
        }
        if (a < 0 || b < a || b >= n_layers)
            return kv_fail(KV_E_USAGE, "layer list '%s': range %ld-%ld outside 0..%d", s, a, b,
                           n_layers - 1);
        for (long i = a; i <= b; i++) sel[i] = true;
        if (*p == 0) return KV_OK;
        if (*p != ',') return kv_fail(KV_E_USAGE, "layer list '%s': unexpected '%c'", s, *p);
        p++;
    }
}
