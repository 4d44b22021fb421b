/*
 * kvc_parse: validation of a .kvc's bytes (man/kvc.5), in passes that each
 * trust only what the previous one proved: header length, JSON syntax, each
 * tensor entry, the tiling of the data section, the checksums, and last the
 * KV-cache geometry across layers (plain and packed K/V parts).  Every
 * failure is a KV_E_DATA with a message naming the tensor or key at fault;
 * no pass reads a byte that an earlier pass did not bound.
 */
#include "format/kvc_int.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_crc.h"

// --- parsing: header and tensor table ---------------------------------------

/* A JSON number that is an exact non-negative integer <= max. */
static bool json_uint(const cJSON *j, double max, uint64_t *out)
{
    if (!cJSON_IsNumber(j)) return false;
    double d = j->valuedouble;
    if (!(d >= 0) || d > max || d != floor(d)) return false;
    *out = (uint64_t)d;
    return true;
}

static kv_status parse_tensor(const cJSON *e, kvc_tensor *t)
{
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return kv_fail(KV_E_DATA, "tensor %s: entry is not a JSON object", name);
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(jd)) return kv_fail(KV_E_DATA, "tensor %s: dtype missing or not a string", name);
    if (!cJSON_IsArray(js)) return kv_fail(KV_E_DATA, "tensor %s: shape missing or not an array", name);
    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2)
        return kv_fail(KV_E_DATA, "tensor %s: data_offsets missing or not [begin, end]", name);
    if (kv_dtype_parse(jd->valuestring, &t->dtype)) {
        kv_errcontext("tensor %s", name);
        return KV_E_DATA;
    }
    int nd = cJSON_GetArraySize(js);
    if (nd > KVC_MAX_DIMS)
        return kv_fail(KV_E_DATA, "tensor %s: %d dimensions, at most %d allowed", name, nd, KVC_MAX_DIMS);
    t->ndim = nd;
    uint64_t numel = 1;
    bool empty = false;
    int d = 0;
    for (const cJSON *x = js->child; x; x = x->next, d++) {
        uint64_t v;
        if (cJSON_IsNumber(x) && x->valuedouble < 0)
            return kv_fail(KV_E_DATA, "tensor %s: negative dimension %g", name, x->valuedouble);
        if (!json_uint(x, 9007199254740992.0, &v))
            return kv_fail(KV_E_DATA, "tensor %s: dimension %d is not a non-negative integer", name, d);
        if (v > KVC_DIM_MAX)
            return kv_fail(KV_E_DATA, "tensor %s: dimension %llu too large", name, (unsigned long long)v);
        t->shape[d] = (int64_t)v;
        if (v == 0) empty = true;
        else if (!empty && numel > (UINT64_MAX >> 4) / v)
            return kv_fail(KV_E_DATA, "tensor %s: shape overflows", name);
        else numel *= v;
    }
    if (empty) numel = 0;
    uint64_t b, en;
    if (!json_uint(jo->child, 9007199254740992.0, &b) || !json_uint(jo->child->next, 9007199254740992.0, &en))
        return kv_fail(KV_E_DATA, "tensor %s: data_offsets are not non-negative integers", name);
    if (en < b)
        return kv_fail(KV_E_DATA, "tensor %s: data_offsets [%llu, %llu] out of order", name,
                       (unsigned long long)b, (unsigned long long)en);
    uint64_t want = numel * kv_dtype_size(t->dtype);
    if (en - b != want)
        return kv_fail(KV_E_DATA, "tensor %s: %llu data bytes but its %s shape needs %llu", name,
                       (unsigned long long)(en - b), kv_dtype_name(t->dtype), (unsigned long long)want);
    t->offset = b;
    t->nbytes = want;
    return KV_OK;
}

static int cmp_offset(const void *a, const void *b)
{
    const kvc_tensor *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return 0;
}

/* qsort has no context argument; the file whose indexes are being sorted is
 * passed through this thread-local pointer. */
static _Thread_local const kvc_file *sort_file;
static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp(sort_file->t[*(const int *)a].name, sort_file->t[*(const int *)b].name);
}
static int cmp_meta_key(const void *a, const void *b)
{
    return strcmp(sort_file->mkey[*(const int *)a], sort_file->mkey[*(const int *)b]);
}

static kv_status parse_metadata(kvc_file *f, const cJSON *m)
{
    if (!cJSON_IsObject(m)) return kv_fail(KV_E_DATA, "__metadata__ is not a JSON object");
    int n = cJSON_GetArraySize(m);
    f->mkey = calloc((size_t)n + 1, sizeof *f->mkey);
    f->mval = calloc((size_t)n + 1, sizeof *f->mval);
    if (!f->mkey || !f->mval) return kv_fail(KV_E_NOMEM, "cannot allocate metadata");
    for (const cJSON *x = m->child; x; x = x->next) {
        if (!cJSON_IsString(x))
            return kv_fail(KV_E_DATA, "metadata key '%.64s': value is not a string", x->string);
        f->mkey[f->nm] = strdup(x->string);
        f->mval[f->nm] = strdup(x->valuestring);
        f->nm++;
        if (!f->mkey[f->nm - 1] || !f->mval[f->nm - 1])
            return kv_fail(KV_E_NOMEM, "cannot allocate metadata");
    }
    return KV_OK;
}

static kv_status parse_header(kvc_file *f, uint64_t *data_start)
{
    if (f->len == 0) return kv_fail(KV_E_DATA, "empty file");
    if (f->len < 8)
        return kv_fail(KV_E_DATA, "truncated: %zu bytes, shorter than the 8-byte header length", f->len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | f->bytes[i];
    if (n > KVC_HEADER_MAX)
        return kv_fail(KV_E_DATA, "header length %llu is absurd (limit %u bytes)",
                       (unsigned long long)n, KVC_HEADER_MAX);
    if (n > f->len - 8)
        return kv_fail(KV_E_DATA, "header length %llu past end of file (%zu bytes follow it)",
                       (unsigned long long)n, f->len - 8);
    if (n < 2) return kv_fail(KV_E_DATA, "header length %llu too small for a JSON object",
                              (unsigned long long)n);
    const char *h = (const char *)f->bytes + 8;
    if (memchr(h, 0, n)) return kv_fail(KV_E_DATA, "header contains a NUL byte");
    char *txt = malloc(n + 1);
    if (!txt) return kv_fail(KV_E_NOMEM, "cannot allocate %llu bytes", (unsigned long long)n);
    memcpy(txt, h, n);
    txt[n] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(txt, &end, 0);
    kv_status st = KV_OK;
    if (!root) {
        st = kv_fail(KV_E_DATA, "malformed JSON header near byte %ld",
                     end ? (long)(end - txt) : -1L);
        goto out;
    }
    for (const char *p = end; *p; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            st = kv_fail(KV_E_DATA, "garbage after the JSON header at byte %ld", (long)(p - txt));
            goto out;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = kv_fail(KV_E_DATA, "header is not a JSON object");
        goto out;
    }
    int nchild = cJSON_GetArraySize(root);
    f->t = calloc((size_t)nchild + 1, sizeof *f->t);
    if (!f->t) {
        st = kv_fail(KV_E_NOMEM, "cannot allocate the tensor table");
        goto out;
    }
    bool have_meta = false;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) {
            if (have_meta) {
                st = kv_fail(KV_E_DATA, "duplicate __metadata__");
                goto out;
            }
            have_meta = true;
            if ((st = parse_metadata(f, e))) goto out;
            continue;
        }
        size_t nl = strlen(e->string);
        if (nl == 0) {
            st = kv_fail(KV_E_DATA, "tensor with an empty name");
            goto out;
        }
        if (nl >= KVC_NAME_MAX) {
            st = kv_fail(KV_E_DATA, "tensor name '%.40s...' longer than %d bytes", e->string,
                         KVC_NAME_MAX - 1);
            goto out;
        }
        kvc_tensor *t = &f->t[f->nt];
        memcpy(t->name, e->string, nl + 1);
        if ((st = parse_tensor(e, t))) goto out;
        f->nt++;
    }
    *data_start = 8 + n;
out:
    cJSON_Delete(root);
    free(txt);
    return st;
}

static kv_status check_tiling(kvc_file *f, uint64_t data_start)
{
    uint64_t data_len = f->len - data_start;
    qsort(f->t, (size_t)f->nt, sizeof *f->t, cmp_offset);
    uint64_t pos = 0;
    for (int i = 0; i < f->nt; i++) {
        kvc_tensor *t = &f->t[i];
        if (t->offset > pos)
            return kv_fail(KV_E_DATA, "hole of %llu bytes before tensor %s (data offset %llu)",
                           (unsigned long long)(t->offset - pos), t->name, (unsigned long long)pos);
        if (t->offset < pos)
            return kv_fail(KV_E_DATA, "tensor %s overlaps tensor %s", t->name, f->t[i - 1].name);
        pos = t->offset + t->nbytes;
        if (pos > data_len)
            return kv_fail(KV_E_DATA, "truncated: tensor %s ends at data byte %llu but the data section has %llu",
                           t->name, (unsigned long long)pos, (unsigned long long)data_len);
        t->data = f->head_only ? NULL : f->bytes + data_start + t->offset;
    }
    if (pos < data_len)
        return kv_fail(KV_E_DATA, "%llu bytes after the last tensor", (unsigned long long)(data_len - pos));

    f->by_name = malloc(((size_t)f->nt + 1) * sizeof *f->by_name);
    f->meta_by_key = malloc(((size_t)f->nm + 1) * sizeof *f->meta_by_key);
    if (!f->by_name || !f->meta_by_key) return kv_fail(KV_E_NOMEM, "cannot allocate indexes");
    for (int i = 0; i < f->nt; i++) f->by_name[i] = i;
    for (int i = 0; i < f->nm; i++) f->meta_by_key[i] = i;
    sort_file = f;
    qsort(f->by_name, (size_t)f->nt, sizeof *f->by_name, cmp_tensor_name);
    qsort(f->meta_by_key, (size_t)f->nm, sizeof *f->meta_by_key, cmp_meta_key);
    sort_file = NULL;
    for (int i = 1; i < f->nt; i++)
        if (!strcmp(f->t[f->by_name[i]].name, f->t[f->by_name[i - 1]].name))
            return kv_fail(KV_E_DATA, "duplicate tensor name %s", f->t[f->by_name[i]].name);
    for (int i = 1; i < f->nm; i++)
        if (!strcmp(f->mkey[f->meta_by_key[i]], f->mkey[f->meta_by_key[i - 1]]))
            return kv_fail(KV_E_DATA, "duplicate metadata key '%.64s'", f->mkey[f->meta_by_key[i]]);
    return KV_OK;
}

static kv_status check_crcs(kvc_file *f)
{
    for (int i = 0; i < f->nm; i++) {
        const char *k = f->mkey[i], *v = f->mval[i];
        if (strncmp(k, "crc32c.", 7) != 0) continue;
        kvc_tensor *t = (kvc_tensor *)kvc_find(f, k + 7);
        if (!t) return kv_fail(KV_E_DATA, "checksum for a tensor that does not exist: %.64s", k);
        uint32_t c = 0;
        int n = 0;
        for (; v[n]; n++) {
            char ch = v[n];
            int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
            if (d < 0 || n >= 8) break;
            c = c << 4 | (uint32_t)d;
        }
        if (n != 8 || v[n])
            return kv_fail(KV_E_DATA, "metadata %.64s='%.16s' is not 8 lowercase hex digits", k, v);
        /* kvc_open_view: the caller checked all of the bytes already */
        uint32_t got = f->trusted || f->head_only ? c : kv_crc32c(0, t->data, t->nbytes);
        if (got != c)
            return kv_fail(KV_E_DATA, "checksum mismatch in tensor %s (stored %08x, computed %08x)",
                           t->name, c, got);
        t->crc = c;
        t->has_crc = true;
        f->n_crc++;
    }
    /* A writer that checksums every tensor says so (kvc.checksums = the
     * tensor count): a flipped byte that renames one crc32c key must not
     * quietly turn that tensor into an unchecked one. */
    const char *all = kvc_meta(f, "kvc.checksums");
    if (all) {
        char *end;
        errno = 0;
        long n = strtol(all, &end, 10);
        if (errno || end == all || *end || n != f->nt)
            return kv_fail(KV_E_DATA, "metadata kvc.checksums='%.16s' is not the tensor count %d", all, f->nt);
        for (int i = 0; i < f->nt; i++)
            if (!f->t[i].has_crc)
                return kv_fail(KV_E_DATA, "tensor %s has no checksum, but the writer checksummed all %d "
                                          "tensors (a crc32c key lost or renamed)", f->t[i].name, f->nt);
    }
    return KV_OK;
}


// --- parsing: geometry ------------------------------------------------------

/* Strict decimal integer in [lo, hi]. */
static bool parse_int(const char *s, long lo, long hi, long *out)
{
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi || (s[0] != '-' && (s[0] < '0' || s[0] > '9')))
        return false;
    *out = v;
    return true;
}

/* Integer metadata key: absent -> *out untouched, false; bad -> error. */
static kv_status meta_int(const kvc_file *f, const char *key, long lo, long hi, long *out, bool *present)
{
    const char *v = kvc_meta(f, key);
    *present = v != NULL;
    if (!v) return KV_OK;
    if (!parse_int(v, lo, hi, out))
        return kv_fail(KV_E_DATA, "metadata %s='%.32s' is not an integer in [%ld, %ld]", key, v, lo, hi);
    return KV_OK;
}

static kv_status meta_real(const kvc_file *f, const char *key, double *out, bool required)
{
    const char *v = kvc_meta(f, key);
    if (!v) return required ? kv_fail(KV_E_DATA, "metadata %s is required here", key) : KV_OK;
    char *end;
    double d = strtod(v, &end);
    if (end == v || *end || !isfinite(d))
        return kv_fail(KV_E_DATA, "metadata %s='%.32s' is not a number", key, v);
    *out = d;
    return KV_OK;
}

/* Per-layer shapes as the layers describe them; -1 = unknown. */
typedef struct {
    int kvh, T, hd;
    const char *from; /* name of the tensor they came from */
    char from_buf[KVC_NAME_MAX + 32];
} shape3;

static kv_status need_part(const kvc_file *f, int layer, char which, const char *part, kv_dtype dt,
                           const kvc_tensor **out)
{
    char name[64];
    snprintf(name, sizeof name, "%c.%s", which, part);
    const kvc_tensor *t = kvc_layer(f, layer, name);
    if (!t) return kv_fail(KV_E_DATA, "layer %d: kivi %s lack layers.%d.%s", layer,
                           which == 'k' ? "keys" : "values", layer, name);
    if (t->dtype != dt || t->ndim != 3)
        return kv_fail(KV_E_DATA, "layers.%d.%s must be a 3-dimensional %s tensor", layer, name,
                       kv_dtype_name(dt));
    *out = t;
    return KV_OK;
}

static kv_status expect_shape(const kvc_tensor *t, int64_t a, int64_t b, int64_t c)
{
    if (t->shape[0] != a || t->shape[1] != b || t->shape[2] != c)
        return kv_fail(KV_E_DATA, "%s has shape [%lld,%lld,%lld], kivi parameters imply [%lld,%lld,%lld]",
                       t->name, (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2],
                       (long long)a, (long long)b, (long long)c);
    return KV_OK;
}

static kv_status check_kivi(kvc_file *f, int layer, char which, shape3 *s)
{
    kv_status st;
    char key[64];
    long bits, group, resid;
    bool have;
    const char *w = which == 'k' ? "k" : "v";
    snprintf(key, sizeof key, "layers.%d.%s.bits", layer, w);
    if ((st = meta_int(f, key, 1, 4, &bits, &have))) return st;
    if (!have) return kv_fail(KV_E_DATA, "layers.%d.%s.encoding=kivi needs metadata %s", layer, w, key);
    if (bits == 3) return kv_fail(KV_E_DATA, "metadata %s=3: kivi bits must be 1, 2 or 4", key);
    snprintf(key, sizeof key, "layers.%d.%s.group", layer, w);
    if ((st = meta_int(f, key, 1, 1 << 20, &group, &have))) return st;
    if (!have) return kv_fail(KV_E_DATA, "layers.%d.%s.encoding=kivi needs metadata %s", layer, w, key);
    snprintf(key, sizeof key, "layers.%d.%s.residual", layer, w);
    if ((st = meta_int(f, key, 0, 1 << 30, &resid, &have))) return st;
    if (!have) return kv_fail(KV_E_DATA, "layers.%d.%s.encoding=kivi needs metadata %s", layer, w, key);

    const kvc_tensor *codes, *scale, *zero, *res;
    if ((st = need_part(f, layer, which, "codes", KV_DT_U8, &codes)) ||
        (st = need_part(f, layer, which, "scale", KV_DT_F16, &scale)) ||
        (st = need_part(f, layer, which, "zero", KV_DT_F16, &zero)) ||
        (st = need_part(f, layer, which, "resid", KV_DT_F16, &res)))
        return st;
    int64_t kvh = codes->shape[0], tq = codes->shape[1], hd = res->shape[2];
    int64_t T = tq + res->shape[1];
    if (T > INT32_MAX) return kv_fail(KV_E_DATA, "layer %d: kivi token count overflows", layer);
    if (res->shape[0] != kvh)
        return kv_fail(KV_E_DATA, "%s has %lld heads but %s has %lld", res->name,
                       (long long)res->shape[0], codes->name, (long long)kvh);
    if (hd * bits % 8)
        return kv_fail(KV_E_DATA, "layer %d: kivi head dim %lld times %ld bits is not whole bytes",
                       layer, (long long)hd, bits);
    int nq = kv_kivi_nquant((int)T, (int)group, (int)resid);
    if (tq != nq)
        return kv_fail(KV_E_DATA, "%s holds %lld quantized tokens but kivi with T=%lld, G=%ld, R=%ld quantizes %d",
                       codes->name, (long long)tq, (long long)T, group, resid, nq);
    if ((st = expect_shape(codes, kvh, tq, hd * bits / 8))) return st;
    if (which == 'k') {
        if ((st = expect_shape(scale, kvh, tq / group, hd)) || (st = expect_shape(zero, kvh, tq / group, hd)))
            return st;
    } else {
        int64_t gv = group < hd ? group : hd;
        if (gv == 0 || hd % gv)
            return kv_fail(KV_E_DATA, "layer %d: value group %lld does not divide head dim %lld", layer,
                           (long long)gv, (long long)hd);
        if ((st = expect_shape(scale, kvh, tq, hd / gv)) || (st = expect_shape(zero, kvh, tq, hd / gv)))
            return st;
    }
    layer_info *li = &f->li[layer];
    li->kivi[which == 'v'] = (kv_kivi_params){(int)bits, (int)group, (int)resid};
    s->kvh = (int)kvh;
    s->T = (int)T;
    s->hd = (int)hd;
    snprintf(s->from_buf, sizeof s->from_buf, "%s", codes->name);
    s->from = s->from_buf;
    return KV_OK;
}

static kv_status need_part_n(const kvc_file *f, int layer, char which, const char *part, kv_dtype dt,
                             int ndim, const kvc_tensor **out)
{
    char name[64];
    snprintf(name, sizeof name, "%c.%s", which, part);
    const kvc_tensor *t = kvc_layer(f, layer, name);
    if (!t) return kv_fail(KV_E_DATA, "layer %d: dsq %s lack layers.%d.%s", layer,
                           which == 'k' ? "keys" : "values", layer, name);
    if (t->dtype != dt || t->ndim != ndim)
        return kv_fail(KV_E_DATA, "layers.%d.%s must be a %d-dimensional %s tensor", layer, name, ndim,
                       kv_dtype_name(dt));
    *out = t;
    return KV_OK;
}

static kv_status expect_shape4(const kvc_tensor *t, const int64_t *want, int nd)
{
    for (int d = 0; d < nd; d++) {
        if (t->shape[d] != want[d]) {
            char a[96] = "", b[96] = "";
            for (int e = 0; e < nd; e++) {
                size_t la = strlen(a), lb = strlen(b);
                snprintf(a + la, sizeof a - la, "%s%lld", e ? "," : "", (long long)t->shape[e]);
                snprintf(b + lb, sizeof b - lb, "%s%lld", e ? "," : "", (long long)want[e]);
            }
            return kv_fail(KV_E_DATA, "%s has shape [%s], dsq parameters imply [%s]", t->name, a, b);
        }
    }
    return KV_OK;
}

/* DSQ parts as lib/common/kv_layout.h (and man/kvc.5, DSQ ENCODING) lay them out. */
static kv_status check_dsq(kvc_file *f, int layer, char which, shape3 *s)
{
    kv_status st;
    char key[64];
    long W, S, bits, group;
    bool have;
    const char *w = which == 'k' ? "k" : "v";
    const char *names[4] = {"window", "salient", "bits", "group"};
    long *vals[4] = {&W, &S, &bits, &group};
    const long lo[4] = {8, 0, 1, 1}, hi[4] = {4096, 4096, 4, 65536};
    for (int i = 0; i < 4; i++) {
        snprintf(key, sizeof key, "layers.%d.%s.%s", layer, w, names[i]);
        if ((st = meta_int(f, key, lo[i], hi[i], vals[i], &have))) return st;
        if (!have) return kv_fail(KV_E_DATA, "layers.%d.%s.encoding=dsq needs metadata %s", layer, w, key);
    }
    if (W % 8) return kv_fail(KV_E_DATA, "layers.%d.%s.window=%ld is not a multiple of 8", layer, w, W);
    if (S > W) return kv_fail(KV_E_DATA, "layers.%d.%s.salient=%ld exceeds the window %ld", layer, w, S, W);
    if (bits == 3) return kv_fail(KV_E_DATA, "layers.%d.%s.bits=3: dsq bits must be 1, 2 or 4", layer, w);
    const kvc_tensor *mask, *sal, *sscale, *base = NULL, *codes, *scale, *zero, *res;
    if ((st = need_part_n(f, layer, which, "mask", KV_DT_U8, 3, &mask)) ||
        (st = need_part_n(f, layer, which, "sal", KV_DT_I8, 4, &sal)) ||
        (st = need_part_n(f, layer, which, "sscale", KV_DT_F16, 3, &sscale)) ||
        (which == 'k' && (st = need_part_n(f, layer, which, "base", KV_DT_F16, 3, &base))) ||
        (st = need_part_n(f, layer, which, "codes", KV_DT_U8, 4, &codes)) ||
        (st = need_part_n(f, layer, which, "scale", KV_DT_F16, 4, &scale)) ||
        (st = need_part_n(f, layer, which, "zero", KV_DT_F16, 4, &zero)) ||
        (st = need_part_n(f, layer, which, "resid", KV_DT_F16, 3, &res)))
        return st;
    int64_t H = mask->shape[0], nw = mask->shape[1], D = res->shape[2];
    int64_t T = nw * W + res->shape[1];
    if (T > INT32_MAX) return kv_fail(KV_E_DATA, "layer %d: dsq token count overflows", layer);
    if (res->shape[1] >= W)
        return kv_fail(KV_E_DATA, "%s holds %lld tokens, a whole window of %ld should have been packed",
                       res->name, (long long)res->shape[1], W);
    if (D * bits % 8)
        return kv_fail(KV_E_DATA, "layer %d: dsq head dim %lld times %ld bits is not whole bytes", layer,
                       (long long)D, bits);
    int64_t gd = group < D ? group : D;
    if (gd == 0 || D % gd)
        return kv_fail(KV_E_DATA, "layer %d: dsq group %lld does not divide head dim %lld", layer,
                       (long long)gd, (long long)D);
    const int64_t m[3] = {H, nw, W / 8}, sl[4] = {H, nw, S, D}, hd[3] = {H, nw, D};
    const int64_t cd[4] = {H, nw, W - S, D * bits / 8}, sz[4] = {H, nw, W - S, gd ? D / gd : 0};
    const int64_t rs[3] = {H, res->shape[1], D};
    if ((st = expect_shape4(mask, m, 3)) || (st = expect_shape4(sal, sl, 4)) ||
        (st = expect_shape4(sscale, hd, 3)) || (base && (st = expect_shape4(base, hd, 3))) ||
        (st = expect_shape4(codes, cd, 4)) || (st = expect_shape4(scale, sz, 4)) ||
        (st = expect_shape4(zero, sz, 4)) || (st = expect_shape4(res, rs, 3)))
        return st;
    /* Each window marks exactly S salient tokens, or rows would be misplaced. */
    const uint8_t *mb = mask->data;
    if (!mb) return kv_fail(KV_E_UNSUPPORTED, "layers.%d.%c: a dsq layer's masks cannot be checked from the header alone", layer, which);
    for (int64_t i = 0; i < H * nw; i++) {
        long n = 0;
        for (int64_t b = 0; b < W / 8; b++) n += __builtin_popcount(mb[i * (W / 8) + b]);
        if (n != S)
            return kv_fail(KV_E_DATA, "%s: window %lld marks %ld salient tokens, not %ld", mask->name,
                           (long long)i, n, S);
    }
    s->kvh = (int)H;
    s->T = (int)T;
    s->hd = (int)D;
    snprintf(s->from_buf, sizeof s->from_buf, "%s", mask->name);
    s->from = s->from_buf;
    return KV_OK;
}

/* Layer index of a "layers.{i}.rest" name, or -1; *rest gets the part. */
static long layer_of(const char *name, const char **rest)
{
    if (strncmp(name, "layers.", 7) != 0) return -1;
    const char *p = name + 7;
    if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] >= '0' && p[1] <= '9')) return -1;
    long v = 0;
    while (*p >= '0' && *p <= '9') {
        v = v * 10 + (*p++ - '0');
        if (v > 1000000) return -1;
    }
    if (*p != '.') return -1;
    *rest = p + 1;
    return v;
}

static kv_status check_layer_part(kvc_file *f, int i, char which, shape3 *s)
{
    char key[64], tname[32];
    const char *w = which == 'k' ? "k" : "v";
    snprintf(key, sizeof key, "layers.%d.%s.encoding", i, w);
    snprintf(tname, sizeof tname, "%s", w);
    const char *enc = kvc_meta(f, key);
    const kvc_tensor *t = kvc_layer(f, i, tname);
    char *dst = f->li[i].enc[which == 'v'];
    s->kvh = s->T = s->hd = -1;
    if (t) {
        if (t->dtype != KV_DT_F32 && t->dtype != KV_DT_F16 && t->dtype != KV_DT_BF16)
            return kv_fail(KV_E_DATA, "%s is %s; keys and values must be F32, F16 or BF16", t->name,
                           kv_dtype_name(t->dtype));
        if (t->ndim != 3)
            return kv_fail(KV_E_DATA, "%s has %d dimensions, expected [kv_heads, tokens, head_dim]",
                           t->name, t->ndim);
        const char *dn = t->dtype == KV_DT_F32 ? "f32" : t->dtype == KV_DT_F16 ? "f16" : "bf16";
        if (enc && strcmp(enc, dn) != 0)
            return kv_fail(KV_E_DATA, "metadata %s=%.16s but %s is a plain %s tensor", key, enc, t->name,
                           kv_dtype_name(t->dtype));
        strcpy(dst, dn);
        s->kvh = (int)t->shape[0];
        s->T = (int)t->shape[1];
        s->hd = (int)t->shape[2];
        s->from = t->name;
        return KV_OK;
    }
    if (!enc)
        return kv_fail(KV_E_DATA, "layer %d has no %s (layers.%d.%s)", i, which == 'k' ? "keys" : "values",
                       i, w);
    if (strcmp(enc, "kivi") == 0) {
        strcpy(dst, "kivi");
        return check_kivi(f, i, which, s);
    }
    if (strcmp(enc, "dsq") == 0) {
        strcpy(dst, "dsq");
        return check_dsq(f, i, which, s);
    }
    if (!strcmp(enc, "f32") || !strcmp(enc, "f16") || !strcmp(enc, "bf16"))
        return kv_fail(KV_E_DATA, "metadata %s=%s but there is no tensor layers.%d.%s", key, enc, i, w);
    return kv_fail(KV_E_DATA, "metadata %s='%.16s' is not a known encoding", key, enc);
}

static kv_status merge_dim(const char *what, int *have, const char **have_from, int v, const char *from)
{
    if (v < 0) return KV_OK;
    if (*have < 0) {
        *have = v;
        *have_from = from;
        return KV_OK;
    }
    if (*have != v)
        return kv_fail(KV_E_DATA, "inconsistent geometry: %s has %d %s but %s has %d", from, v, what,
                       *have_from, *have);
    return KV_OK;
}

/* A metadata geometry key must agree with the shapes, or fill an unknown. */
static kv_status meta_dim(const kvc_file *f, const char *key, const char *what, int *have, long lo)
{
    long v;
    bool present;
    kv_status st = meta_int(f, key, lo, INT32_MAX, &v, &present);
    if (st || !present) return st;
    if (*have >= 0 && *have != v)
        return kv_fail(KV_E_DATA, "metadata %s=%ld but the tensors have %d %s", key, v, *have, what);
    *have = (int)v;
    return KV_OK;
}

static kv_status build_geom(kvc_file *f)
{
    kv_geom *g = &f->g;
    kv_geom_defaults(g);
    kv_status st;
    long L = 0;
    for (int i = 0; i < f->nt; i++) {
        const char *rest;
        long l = layer_of(f->t[i].name, &rest);
        if (l >= L) L = l + 1;
    }
    if (L == 0) return kv_fail(KV_E_DATA, "no layers.0.k tensor: not a KV cache");
    if (L > f->nt) /* every layer needs tensors of its own: some are missing */
        return kv_fail(KV_E_DATA, "tensor names reach layer %ld but there are only %d tensors: layers are missing",
                       L - 1, f->nt);
    long ml;
    bool have;
    if ((st = meta_int(f, "kvc.n_layers", 1, 1000000, &ml, &have))) return st;
    if (have && ml != L)
        return kv_fail(KV_E_DATA, "metadata kvc.n_layers=%ld but the tensors describe %ld layers", ml, L);
    g->n_layers = (int)L;
    f->li = calloc((size_t)L, sizeof *f->li);
    if (!f->li) return kv_fail(KV_E_NOMEM, "cannot allocate layer table");

    int kvh = -1, T = -1, hd = -1;
    const char *kvh_from = NULL, *T_from = NULL, *hd_from = NULL;
    shape3 *sh = calloc((size_t)L * 2, sizeof *sh); /* keeps from_buf names alive */
    if (!sh) return kv_fail(KV_E_NOMEM, "cannot allocate layer shapes");
    for (int i = 0; i < L && !st; i++) {
        for (int w = 0; w < 2 && !st; w++) {
            shape3 *s = &sh[2 * i + w];
            if ((st = check_layer_part(f, i, w ? 'v' : 'k', s))) break;
            if (s->kvh == 0 || s->hd == 0) {
                st = kv_fail(KV_E_DATA, "%s has no heads or zero head dim", s->from);
                break;
            }
            if ((st = merge_dim("kv heads", &kvh, &kvh_from, s->kvh, s->from)) ||
                (st = merge_dim("tokens", &T, &T_from, s->T, s->from)) ||
                (st = merge_dim("head dim", &hd, &hd_from, s->hd, s->from)))
                break;
        }
    }
    if (st) {
        free(sh);
        return st;
    }
    /* Layer byte counts (all tensors, and the K/V parts). */
    for (int i = 0; i < f->nt; i++) {
        const char *rest;
        long l = layer_of(f->t[i].name, &rest);
        if (l < 0) continue;
        f->li[l].bytes += f->t[i].nbytes;
        if ((rest[0] == 'k' || rest[0] == 'v') && (rest[1] == 0 || rest[1] == '.'))
            f->li[l].kv_bytes += f->t[i].nbytes;
    }

    if ((st = meta_dim(f, "kvc.n_kv_heads", "kv heads", &kvh, 1)) ||
        (st = meta_dim(f, "kvc.n_tokens", "tokens", &T, 0)) ||
        (st = meta_dim(f, "kvc.head_dim", "head dim", &hd, 1))) {
        free(sh);
        return st;
    }
    free(sh);
    if (kvh < 0 || T < 0 || hd < 0)
        return kv_fail(KV_E_DATA, "geometry unknown: no plain or kivi layer and no kvc.n_kv_heads, "
                                  "kvc.n_tokens, kvc.head_dim metadata");
    g->n_kv_heads = kvh;
    g->n_tokens = T;
    g->head_dim = hd;

    /* Queries: all layers or none, one shape. */
    int H = -1, Q = -1, first_q = -1, first_noq = -1;
    for (int i = 0; i < L; i++) {
        const kvc_tensor *q = kvc_layer(f, i, "q");
        if (!q) {
            if (first_noq < 0) first_noq = i;
            continue;
        }
        if (first_q < 0) first_q = i;
        if (q->dtype != KV_DT_F32 && q->dtype != KV_DT_F16 && q->dtype != KV_DT_BF16)
            return kv_fail(KV_E_DATA, "%s is %s; queries must be F32, F16 or BF16", q->name,
                           kv_dtype_name(q->dtype));
        if (q->ndim != 3)
            return kv_fail(KV_E_DATA, "%s has %d dimensions, expected [heads, n_q, head_dim]", q->name, q->ndim);
        if (q->shape[2] != hd)
            return kv_fail(KV_E_DATA, "%s has head dim %lld but the keys have %d", q->name,
                           (long long)q->shape[2], hd);
        if (H >= 0 && (q->shape[0] != H || q->shape[1] != Q))
            return kv_fail(KV_E_DATA, "inconsistent geometry: %s has shape [%lld,%lld,%d] but layers.%d.q has [%d,%d,%d]",
                           q->name, (long long)q->shape[0], (long long)q->shape[1], hd, first_q, H, Q, hd);
        H = (int)q->shape[0];
        Q = (int)q->shape[1];
    }
    if (first_q >= 0 && first_noq >= 0)
        return kv_fail(KV_E_DATA, "layer %d has no queries (layers.%d.q) but layer %d does", first_noq,
                       first_noq, first_q);
    if (H == 0) return kv_fail(KV_E_DATA, "layers.%d.q has no heads", first_q);
    if (Q > T) return kv_fail(KV_E_DATA, "layers.%d.q holds %d queries but the cache has %d tokens", first_q, Q, T);
    if (Q < 0) Q = 0;
    int Qm = Q >= 0 && first_q >= 0 ? Q : -1;
    if ((st = meta_dim(f, "kvc.n_heads", "query heads", &H, 1)) || (st = meta_dim(f, "kvc.n_q", "queries", &Qm, 0)))
        return st;
    if (first_q < 0 && Qm > 0)
        return kv_fail(KV_E_DATA, "metadata kvc.n_q=%d but there are no layers.{i}.q tensors", Qm);
    if (H > 0 && H % kvh)
        return kv_fail(KV_E_DATA, "%d query heads is not a multiple of %d kv heads", H, kvh);
    g->n_heads = H > 0 ? H : 0;
    g->n_q = Q;

    const kvc_tensor *tok = kvc_find(f, "tokens");
    if (tok) {
        if (tok->dtype != KV_DT_I32 || tok->ndim != 1)
            return kv_fail(KV_E_DATA, "tokens must be a 1-dimensional I32 tensor, not %dd %s", tok->ndim,
                           kv_dtype_name(tok->dtype));
        if (tok->shape[0] != T)
            return kv_fail(KV_E_DATA, "tokens has %lld entries but the cache has %d tokens",
                           (long long)tok->shape[0], T);
    }

    /* A token subset's original positions (man/kvc.5, "Token subsets"):
     * checked here so that no reader can take row t for position t by
     * mistake, nor meet positions that go backwards. */
    const kvc_tensor *pos = kvc_find(f, "positions");
    if (pos && !pos->data) return kv_fail(KV_E_UNSUPPORTED, "positions cannot be checked from the header alone");
    if (pos) {
        if (pos->dtype != KV_DT_I32 || pos->ndim != 1 || pos->shape[0] != T)
            return kv_fail(KV_E_DATA, "positions must be I32 [%d] (one per cached token), not %dd %s", T, pos->ndim,
                           kv_dtype_name(pos->dtype));
        int32_t prev = -1;
        for (int t = 0; t < T; t++) {
            int32_t p;
            memcpy(&p, (const char *)pos->data + 4 * (size_t)t, 4);
            if (p <= prev)
                return kv_fail(KV_E_DATA, "positions[%d] = %d %s: positions must be non-negative and strictly increasing",
                               t, p, p < 0 ? "is negative" : "does not follow the previous one");
            prev = p;
        }
    }

    /* RoPE and the rest. */
    if ((st = meta_real(f, "kvc.rope_theta", &g->rope_theta, false))) return st;
    if (!(g->rope_theta > 0)) return kv_fail(KV_E_DATA, "metadata kvc.rope_theta must be positive");
    const char *v = kvc_meta(f, "kvc.rope_scaling");
    if (v && strcmp(v, "none") && strcmp(v, "llama3"))
        return kv_fail(KV_E_DATA, "metadata kvc.rope_scaling='%.16s' is not none or llama3", v);
    if (v && !strcmp(v, "llama3")) {
        long oc;
        g->rope_scaling = KV_ROPE_SCALING_LLAMA3;
        if ((st = meta_real(f, "kvc.rope_factor", &g->rope_factor, true)) ||
            (st = meta_real(f, "kvc.rope_low_freq_factor", &g->rope_low_freq_factor, true)) ||
            (st = meta_real(f, "kvc.rope_high_freq_factor", &g->rope_high_freq_factor, true)) ||
            (st = meta_int(f, "kvc.rope_orig_ctx", 1, INT32_MAX, &oc, &have)))
            return st;
        if (!have) return kv_fail(KV_E_DATA, "metadata kvc.rope_scaling=llama3 needs kvc.rope_orig_ctx");
        g->rope_orig_ctx = (int)oc;
    }
    v = kvc_meta(f, "kvc.keys_roped");
    if (v && strcmp(v, "true") && strcmp(v, "false"))
        return kv_fail(KV_E_DATA, "metadata kvc.keys_roped='%.16s' is not true or false", v);
    g->keys_roped = !v || !strcmp(v, "true");
    v = kvc_meta(f, "kvc.rope_layout");
    if (v && strcmp(v, "interleaved") && strcmp(v, "halves"))
        return kv_fail(KV_E_DATA, "metadata kvc.rope_layout='%.16s' is not interleaved or halves", v);
    g->rope_layout = v && !strcmp(v, "halves") ? KV_ROPE_HALVES : KV_ROPE_INTERLEAVED;
    v = kvc_meta(f, "kvc.model");
    if (v) snprintf(g->model, sizeof g->model, "%s", v);
    return KV_OK;
}

kv_status kvc_parse(kvc_file *f)
{
    uint64_t data_start = 0;
    kv_status st;
    if ((st = parse_header(f, &data_start)) || (st = check_tiling(f, data_start))) return st;
    f->data_start = data_start;
    const char *ver = kvc_meta(f, "kvc.version");
    if (ver) {
        long v;
        if (!parse_int(ver, 1, INT32_MAX, &v))
            return kv_fail(KV_E_DATA, "metadata kvc.version='%.16s' is not a positive integer", ver);
        if (v > KVC_FORMAT_VERSION)
            return kv_fail(KV_E_UNSUPPORTED, "file is kvc version %ld; this reader reads version %d or older",
                           v, KVC_FORMAT_VERSION);
    }
    if ((st = check_crcs(f))) return st;
    return build_geom(f);
}

