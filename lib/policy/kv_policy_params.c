/*
 * kv_policy_params: the policy-independent parameters of a layer's KV cache:
 * defaults per kind, kind and dtype names, the --policy spec parser, the
 * front-end defaults applied over it, and the one-line description.
 */
#include "policy/kv_policy.h"

#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_layout.h"

// --- parameters ---------------------------------------------------------

void kv_policy_params_default(kv_policy_params *p, kv_policy_kind kind)
{
    memset(p, 0, sizeof *p);
    p->kind = kind;
    p->dtype = KV_DT_F32;
    p->bits = KV_KIVI_DEFAULT_BITS;
    p->group = 64;
    p->residual = 128;
    p->sink = 8;
    p->window = 56;
    p->channels = 8;
    p->topk = 128;
    p->topk_frac = 0.0;
    p->select = KV_SELECT_DEFAULT;
    p->cbits = 2; /* docs/BENCHMARKS.md, issue 17: equal to full on niah4k at 1/8 of fp16 rows */
    p->page = 16;
    p->offload = false;
    p->dsq_window = 64;
    p->dsq_salient = KV_DSQ_POLICY_SALIENT_FRAC;
    p->dsq_base = KV_DSQ_DEFAULT_BASE;
    p->dsq_kbits = KV_DSQ_POLICY_KBITS;
    p->dsq_vbits = KV_DSQ_POLICY_VBITS;
    p->dsq_group = KV_DSQ_DEFAULT_GROUP;
    p->hcap_channel_thresh = 0.0;
    p->hcap_token_keep = 1.0;
    p->predict = true;
    p->group_reduce = KV_REDUCE_SUM;
}

static const char *const select_names[KV_SELECT_COUNT] = {
    [KV_SELECT_CHANNELS] = "channels", [KV_SELECT_EXACT] = "exact", [KV_SELECT_SKETCH] = "sketch",
    [KV_SELECT_RESIDENT] = "resident", [KV_SELECT_PAGES] = "pages", [KV_SELECT_PCA] = "pca"};

const char *kv_select_mode_name(kv_select_mode m)
{
    return (unsigned)m < KV_SELECT_COUNT ? select_names[m] : "?";
}

kv_status kv_select_mode_parse(const char *s, kv_select_mode *out)
{
    if (!strcmp(s, "approx")) s = "channels"; /* the first name of the channel mode */
    for (int m = 0; m < KV_SELECT_COUNT; m++)
        if (!strcmp(s, select_names[m])) {
            *out = (kv_select_mode)m;
            return KV_OK;
        }
    return kv_fail(KV_E_USAGE, "policy key select: '%s' (resident, channels, exact, sketch, pages or pca)", s);
}

void kv_policy_defaults_apply(const kv_policy_defaults *d, kv_policy_params *per_layer,
                              int n_layers)
{
    for (int l = 0; l < n_layers; l++) {
        kv_policy_params *p = &per_layer[l];
        unsigned take = d->given & ~p->given;
        /* every layer, as --kv-dtype always did: the kinds without full
           precision storage ignore it */
        if (take & KV_KEY_DTYPE) p->dtype = d->dtype;
        if ((take & KV_KEY_SELECT) && p->kind == KV_POL_SPARSE) p->select = d->select;
        if ((take & KV_KEY_OFFLOAD) && p->kind == KV_POL_FULL) p->offload = d->offload;
    }
}

void kv_policy_set_select(kv_policy_params *per_layer, int n_layers, kv_select_mode m)
{
    kv_policy_defaults d = {.given = KV_KEY_SELECT, .select = m};
    kv_policy_defaults_apply(&d, per_layer, n_layers);
}

static const char *const kind_names[KV_POL_COUNT] = {
    [KV_POL_FULL] = "full",
    [KV_POL_QUANT] = "quant",
    [KV_POL_SPARSE] = "sparse",
    [KV_POL_STREAMING] = "streaming",
    [KV_POL_DSQ] = "dsq",
};

const char *kv_policy_kind_name(kv_policy_kind k)
{
    return (unsigned)k < KV_POL_COUNT ? kind_names[k] : "?";
}

kv_status kv_policy_kind_parse(const char *s, kv_policy_kind *out)
{
    for (int k = 0; k < KV_POL_COUNT; k++)
        if (!strcmp(s, kind_names[k])) {
            *out = (kv_policy_kind)k;
            return KV_OK;
        }
    return kv_fail(KV_E_USAGE, "unknown policy '%s' (full, quant, sparse, streaming, dsq)", s);
}

// --- spec parser --------------------------------------------------------

/* Which kinds accept a key: bit (1 << kind). */
#define K_(x) (1u << (x))
#define K_ALL 0x1fu

static kv_status parse_int(const char *key, const char *val, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long x = strtol(val, &end, 10);
    if (!*val || *end || errno || x < lo || x > hi)
        return kv_fail(KV_E_USAGE, "policy key %s: '%s' is not an integer in %ld..%ld", key,
                       val, lo, hi);
    *out = (int)x;
    return KV_OK;
}

static kv_status parse_real(const char *key, const char *val, double lo, double hi,
                            double *out)
{
    char *end;
    errno = 0;
    double x = strtod(val, &end);
    if (!*val || *end || errno || !(x >= lo && x <= hi))
        return kv_fail(KV_E_USAGE, "policy key %s: '%s' is not a number in %g..%g", key, val,
                       lo, hi);
    *out = x;
    return KV_OK;
}

static kv_status parse_bool(const char *key, const char *val, bool *out)
{
    if (!strcmp(val, "1") || !strcmp(val, "on") || !strcmp(val, "yes") || !strcmp(val, "true"))
        *out = true;
    else if (!strcmp(val, "0") || !strcmp(val, "off") || !strcmp(val, "no") ||
             !strcmp(val, "false"))
        *out = false;
    else
        return kv_fail(KV_E_USAGE, "policy key %s: '%s' is not on/off", key, val);
    return KV_OK;
}

/* budget: a token count (>= 1) or a fraction of the context (< 1), the
 * deploy config's spelling of k and frac. */
static kv_status parse_budget(const char *val, kv_policy_params *p)
{
    double x;
    kv_status st = parse_real("budget", val, 0.0, 1 << 24, &x);
    if (st) return st;
    if (!(x > 0.0) || (x >= 1.0 && x != floor(x)))
        return kv_fail(KV_E_USAGE, "policy key budget: '%s' is not a token count or a fraction in (0, 1)", val);
    if (x < 1.0) {
        p->topk = 0;
        p->topk_frac = x;
    } else {
        p->topk = (int)x;
        p->topk_frac = 0.0;
    }
    return KV_OK;
}

static kv_status set_key(kv_policy_params *p, const char *key, const char *val)
{
    unsigned me = K_(p->kind);
    const unsigned SS = K_(KV_POL_SPARSE) | K_(KV_POL_STREAMING);
#define IS(name, kinds) (!strcmp(key, name) && ((kinds) & me))
    if (IS("dtype", K_(KV_POL_FULL) | SS)) {
        p->given |= KV_KEY_DTYPE;
        return kv_float_dtype_parse(val, &p->dtype);
    }
    if (IS("bits", K_(KV_POL_QUANT))) {
        kv_status st = parse_int(key, val, 1, 4, &p->bits);
        if (st == KV_OK && p->bits == 3)
            return kv_fail(KV_E_USAGE, "policy key bits: 3 is not supported (1, 2 or 4)");
        return st;
    }
    if ((IS("group", K_(KV_POL_QUANT)) || IS("g", K_(KV_POL_QUANT))))
        return parse_int(key, val, 1, 1 << 20, &p->group);
    if ((IS("residual", K_(KV_POL_QUANT)) || IS("r", K_(KV_POL_QUANT))))
        return parse_int(key, val, 0, 1 << 24, &p->residual);
    if (IS("sink", SS) || IS("s", SS)) return parse_int(key, val, 0, 1 << 24, &p->sink);
    if (IS("window", SS) || IS("w", SS)) return parse_int(key, val, 0, 1 << 24, &p->window);
    if (IS("window", K_(KV_POL_DSQ)) || IS("w", K_(KV_POL_DSQ)))
        return parse_int(key, val, 1, 1 << 20, &p->dsq_window);
    if (IS("channels", K_(KV_POL_SPARSE)) || IS("c", K_(KV_POL_SPARSE)))
        return parse_int(key, val, 1, 1 << 20, &p->channels);
    if (IS("k", K_(KV_POL_SPARSE)) || IS("topk", K_(KV_POL_SPARSE))) {
        p->topk_frac = 0.0;
        return parse_int(key, val, 0, 1 << 24, &p->topk);
    }
    if (IS("frac", K_(KV_POL_SPARSE))) {
        p->topk = 0;
        return parse_real(key, val, 0.0, 1.0, &p->topk_frac);
    }
    if (IS("budget", K_(KV_POL_SPARSE))) return parse_budget(val, p);
    if (IS("select", K_(KV_POL_SPARSE))) {
        p->given |= KV_KEY_SELECT;
        return kv_select_mode_parse(val, &p->select);
    }
    if (IS("cbits", K_(KV_POL_SPARSE))) {
        kv_status st = parse_int(key, val, 1, 16, &p->cbits);
        if (st == KV_OK && p->cbits != 1 && p->cbits != 2 && p->cbits != 4 && p->cbits != 8 && p->cbits != 16)
            return kv_fail(KV_E_USAGE, "policy key cbits: %d is not 1, 2, 4, 8 or 16", p->cbits);
        return st;
    }
    if (IS("page", K_(KV_POL_SPARSE))) return parse_int(key, val, 1, 1 << 16, &p->page);
    if (IS("pool", K_(KV_POL_SPARSE))) return parse_int(key, val, 0, 1 << 16, &p->pool);
    if (IS("offload", K_(KV_POL_FULL))) {
        p->given |= KV_KEY_OFFLOAD;
        return parse_bool(key, val, &p->offload);
    }
    if (IS("predict", K_(KV_POL_SPARSE))) return parse_bool(key, val, &p->predict);
    if (IS("reduce", K_(KV_POL_SPARSE))) {
        if (!strcmp(val, "sum")) p->group_reduce = KV_REDUCE_SUM;
        else if (!strcmp(val, "max")) p->group_reduce = KV_REDUCE_MAX;
        else return kv_fail(KV_E_USAGE, "policy key reduce: '%s' (sum or max)", val);
        return KV_OK;
    }
    if (IS("salient", K_(KV_POL_DSQ))) return parse_real(key, val, 0.0, 1.0, &p->dsq_salient);
    if (IS("base", K_(KV_POL_DSQ))) {
        if (!strcmp(val, "salient")) p->dsq_base = KV_DSQ_BASE_SALIENT;
        else if (!strcmp(val, "rest")) p->dsq_base = KV_DSQ_BASE_REST;
        else return kv_fail(KV_E_USAGE, "policy key base: '%s' (rest or salient)", val);
        return KV_OK;
    }
    if (IS("bits", K_(KV_POL_DSQ)) || IS("kbits", K_(KV_POL_DSQ)) || IS("vbits", K_(KV_POL_DSQ))) {
        int b;
        kv_status st = parse_int(key, val, 1, 4, &b);
        if (st == KV_OK && b == 3)
            return kv_fail(KV_E_USAGE, "policy key %s: 3 is not supported (1, 2 or 4)", key);
        if (st) return st;
        if (strcmp(key, "vbits")) p->dsq_kbits = b;
        if (strcmp(key, "kbits")) p->dsq_vbits = b;
        return KV_OK;
    }
    if (IS("group", K_(KV_POL_DSQ)) || IS("g", K_(KV_POL_DSQ)))
        return parse_int(key, val, 1, 65536, &p->dsq_group);
    if (IS("chan", K_(KV_POL_DSQ))) return parse_real(key, val, 0.0, 1.0, &p->hcap_channel_thresh);
    if (IS("keep", K_(KV_POL_DSQ))) return parse_real(key, val, 0.0, 1.0, &p->hcap_token_keep);
#undef IS
    return kv_fail(KV_E_USAGE, "policy %s has no key '%s'", kv_policy_kind_name(p->kind), key);
}

/* One "KIND[:key=val,...]" (len bytes of s) into *p. */
static kv_status parse_one(const char *s, size_t len, kv_policy_params *p)
{
    char buf[512];
    if (len >= sizeof buf) return kv_fail(KV_E_USAGE, "policy spec too long");
    memcpy(buf, s, len);
    buf[len] = 0;
    char *colon = strchr(buf, ':');
    if (colon) *colon = 0;
    kv_policy_kind kind = KV_POL_FULL;
    kv_status st = kv_policy_kind_parse(buf, &kind);
    if (st) return st;
    kv_policy_params_default(p, kind);
    if (!colon) return KV_OK;
    char *rest = colon + 1;
    for (;;) { /* key=val entries split on ',' (an empty entry is an error) */
        char *comma = strchr(rest, ',');
        if (comma) *comma = 0;
        char *eq = strchr(rest, '=');
        if (!eq || eq == rest)
            return kv_fail(KV_E_USAGE, "policy %s: '%s' is not key=value", buf, rest);
        *eq = 0;
        if ((st = set_key(p, rest, eq + 1))) return st;
        if (!comma) break;
        rest = comma + 1;
    }
    return KV_OK;
}

/* "N", "A-B" or "*" -> [lo, hi]; star set when "*". */
static kv_status parse_range(const char *s, size_t len, int n_layers, int *lo, int *hi,
                             bool *star)
{
    *star = false;
    if (len == 1 && s[0] == '*') {
        *star = true;
        *lo = 0;
        *hi = n_layers - 1;
        return KV_OK;
    }
    char buf[64];
    if (len == 0 || len >= sizeof buf) return kv_fail(KV_E_USAGE, "bad layer range in policy");
    memcpy(buf, s, len);
    buf[len] = 0;
    char *end;
    errno = 0;
    long a = strtol(buf, &end, 10), b = a;
    if (end == buf || errno) return kv_fail(KV_E_USAGE, "bad layer range '%s' in policy", buf);
    if (*end == '-') {
        char *e2;
        b = strtol(end + 1, &e2, 10);
        if (e2 == end + 1 || *e2) return kv_fail(KV_E_USAGE, "bad layer range '%s' in policy", buf);
    } else if (*end) {
        return kv_fail(KV_E_USAGE, "bad layer range '%s' in policy", buf);
    }
    if (a < 0 || b < a || b >= n_layers)
        return kv_fail(KV_E_USAGE, "layer range '%s' outside 0..%d", buf, n_layers - 1);
    *lo = (int)a;
    *hi = (int)b;
    return KV_OK;
}

kv_status kv_policy_parse(const char *spec, int n_layers, kv_policy_params *per_layer)
{
    if (!spec || !*spec) return kv_fail(KV_E_USAGE, "empty policy spec");
    if (n_layers <= 0) return kv_fail(KV_E_USAGE, "policy spec: no layers");
    /* A per-layer list starts with a digit or '*'; a kind starts with a letter. */
    if (!isdigit((unsigned char)spec[0]) && spec[0] != '*') {
        kv_policy_params one;
        kv_status st = parse_one(spec, strlen(spec), &one);
        if (st) return st;
        for (int l = 0; l < n_layers; l++) per_layer[l] = one;
        return KV_OK;
    }
    /* Layers no entry names are `full`; '*' fills the layers no explicit
     * range names, wherever it appears; explicit ranges apply in order. */
    bool *named = calloc((size_t)n_layers, 1);
    if (!named) return kv_fail(KV_E_NOMEM, "policy spec");
    kv_policy_params star_p = per_layer[0];
    bool have_star = false;
    for (int l = 0; l < n_layers; l++) kv_policy_params_default(&per_layer[l], KV_POL_FULL);
    kv_status st = KV_OK;
    const char *s = spec;
    while (*s && st == KV_OK) {
        const char *semi = strchr(s, ';');
        size_t len = semi ? (size_t)(semi - s) : strlen(s);
        const char *eq = memchr(s, '=', len);
        if (len == 0) {
            st = kv_fail(KV_E_USAGE, "empty entry in policy spec");
            break;
        }
        if (!eq) {
            st = kv_fail(KV_E_USAGE, "policy entry '%.*s' lacks LAYERS=", (int)len, s);
            break;
        }
        int lo = 0, hi = -1;
        bool star;
        kv_policy_params p;
        st = parse_range(s, (size_t)(eq - s), n_layers, &lo, &hi, &star);
        if (st == KV_OK) st = parse_one(eq + 1, len - (size_t)(eq + 1 - s), &p);
        if (st == KV_OK) {
            if (star) {
                if (have_star) st = kv_fail(KV_E_USAGE, "policy spec has two '*' entries");
                star_p = p;
                have_star = true;
            } else {
                for (int l = lo; l <= hi; l++) {
                    per_layer[l] = p;
                    named[l] = true;
                }
            }
        }
        s = semi ? semi + 1 : s + len;
    }
    if (st == KV_OK && have_star)
        for (int l = 0; l < n_layers; l++)
            if (!named[l]) per_layer[l] = star_p;
    free(named);
    return st;
}

kv_status kv_policy_spec_check(const char *spec)
{
    if (!spec || !*spec) return kv_fail(KV_E_USAGE, "empty policy spec");
    kv_policy_params p;
    if (!isdigit((unsigned char)spec[0]) && spec[0] != '*') return parse_one(spec, strlen(spec), &p);
    bool star_seen = false;
    for (const char *s = spec; *s;) {
        const char *semi = strchr(s, ';');
        size_t len = semi ? (size_t)(semi - s) : strlen(s);
        const char *eq = memchr(s, '=', len);
        if (len == 0) return kv_fail(KV_E_USAGE, "empty entry in policy spec");
        if (!eq) return kv_fail(KV_E_USAGE, "policy entry '%.*s' lacks LAYERS=", (int)len, s);
        int lo, hi;
        bool star;
        kv_status st = parse_range(s, (size_t)(eq - s), INT_MAX, &lo, &hi, &star);
        if (st == KV_OK) st = parse_one(eq + 1, len - (size_t)(eq + 1 - s), &p);
        if (st) return st;
        if (star && star_seen) return kv_fail(KV_E_USAGE, "policy spec has two '*' entries");
        star_seen |= star;
        s = semi ? semi + 1 : s + len;
    }
    return KV_OK;
}

// --- a spec from parameters -----------------------------------------------

/* Append to buf (capacity n, used *at) with printf format. */
static void app(char *buf, size_t n, size_t *at, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void app(char *buf, size_t n, size_t *at, const char *fmt, ...)
{
    if (*at >= n) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + *at, n - *at, fmt, ap);
    va_end(ap);
    if (w > 0) *at += (size_t)w;
}

/* v in the fewest significant digits (up to 17) that read back as v:
 * "0.1", not "0.10000000000000001"; out holds 32 bytes. */
static const char *exact_g(char out[32], double v)
{
    for (int d = 6; d < 17; d++) {
        snprintf(out, 32, "%.*g", d, v);
        if (strtod(out, NULL) == v) return out;
    }
    snprintf(out, 32, "%.17g", v);
    return out;
}

kv_status kv_policy_spec_write(const kv_policy_params *p, char *buf, size_t n)
{
    size_t at = 0;
    char g[32]; /* exact_g's digits */
    const char *dt = kv_float_dtype_name(p->dtype);
    app(buf, n, &at, "%s", kv_policy_kind_name(p->kind));
    switch (p->kind) {
    case KV_POL_FULL:
        app(buf, n, &at, ":dtype=%s%s", dt, p->offload ? ",offload=on" : "");
        break;
    case KV_POL_QUANT:
        app(buf, n, &at, ":bits=%d,group=%d,residual=%d", p->bits, p->group, p->residual);
        break;
    case KV_POL_SPARSE:
        app(buf, n, &at, ":sink=%d,window=%d,channels=%d,", p->sink, p->window, p->channels);
        if (p->topk > 0) app(buf, n, &at, "k=%d", p->topk);
        else app(buf, n, &at, "frac=%s", exact_g(g, p->topk_frac));
        app(buf, n, &at, ",select=%s,cbits=%d,pool=%d,page=%d,predict=%s,reduce=%s,dtype=%s",
            kv_select_mode_name(p->select), p->cbits, p->pool, p->page, p->predict ? "on" : "off",
            p->group_reduce == KV_REDUCE_MAX ? "max" : "sum", dt);
        break;
    case KV_POL_STREAMING:
        app(buf, n, &at, ":sink=%d,window=%d,dtype=%s", p->sink, p->window, dt);
        break;
    case KV_POL_DSQ:
        app(buf, n, &at, ":window=%d,salient=%s,base=%s,kbits=%d,vbits=%d,group=%d",
            p->dsq_window, exact_g(g, p->dsq_salient), p->dsq_base == KV_DSQ_BASE_SALIENT ? "salient" : "rest",
            p->dsq_kbits, p->dsq_vbits, p->dsq_group);
        if (p->hcap_channel_thresh > 0.0) app(buf, n, &at, ",chan=%s", exact_g(g, p->hcap_channel_thresh));
        if (p->hcap_token_keep < 1.0) app(buf, n, &at, ",keep=%s", exact_g(g, p->hcap_token_keep));
        break;
    default: return kv_fail(KV_E_USAGE, "unknown policy kind %d", (int)p->kind);
    }
    if (at >= n) return kv_fail(KV_E_USAGE, "policy spec longer than %zu bytes", n);
    return KV_OK;
}

// --- description --------------------------------------------------------

void kv_policy_desc(const kv_policy_params *p, char *buf, size_t n)
{
    const char *dt = kv_float_dtype_name(p->dtype);
    switch (p->kind) {
    case KV_POL_QUANT:
        snprintf(buf, n, "quant bits=%d group=%d residual=%d dtype=%s", p->bits, p->group, p->residual, dt);
        break;
    case KV_POL_SPARSE: {
        char sel[48];
        if (p->select == KV_SELECT_RESIDENT && p->cbits != 16)
            snprintf(sel, sizeof sel, "resident cbits=%d", p->cbits);
        else if (p->select == KV_SELECT_PAGES)
            snprintf(sel, sizeof sel, "pages page=%d", p->page);
        else
            snprintf(sel, sizeof sel, "%s", kv_select_mode_name(p->select));
        if (p->topk)
            snprintf(buf, n, "sparse sink=%d window=%d channels=%d topk=%d select=%s dtype=%s", p->sink,
                     p->window, p->channels, p->topk, sel, dt);
        else
            snprintf(buf, n, "sparse sink=%d window=%d channels=%d topk_frac=%g select=%s dtype=%s",
                     p->sink, p->window, p->channels, p->topk_frac, sel, dt);
        break;
    }
    case KV_POL_STREAMING:
        snprintf(buf, n, "streaming sink=%d window=%d dtype=%s", p->sink, p->window, dt);
        break;
    case KV_POL_DSQ:
        snprintf(buf, n, "dsq window=%d salient=%g base=%s kbits=%d vbits=%d group=%d "
                 "hcap_channel=%g hcap_token_keep=%g",
                 p->dsq_window, p->dsq_salient, p->dsq_base == KV_DSQ_BASE_SALIENT ? "salient" : "rest",
                 p->dsq_kbits, p->dsq_vbits, p->dsq_group, p->hcap_channel_thresh, p->hcap_token_keep);
        break;
    default:
        snprintf(buf, n, "%s dtype=%s", kv_policy_kind_name(p->kind), dt);
    }
}
