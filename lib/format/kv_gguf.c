/*
 * kv_gguf: strict GGUF v3 reader (see kv_gguf.h).  A cursor walks the
 * buffer; every read checks the bytes left first.  Counts are bounded by
 * what the remaining bytes could possibly hold before anything is
 * allocated, so a header claiming 2^60 tensors fails fast instead of
 * trying to allocate them.
 */
#include "format/kv_gguf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_half.h"

typedef struct {
    const uint8_t *p;
    size_t len, pos;
} cursor;

static const size_t scalar_size[KV_GGUF_TYPE_COUNT] = {
    [KV_GGUF_U8] = 1, [KV_GGUF_I8] = 1, [KV_GGUF_U16] = 2, [KV_GGUF_I16] = 2,
    [KV_GGUF_U32] = 4, [KV_GGUF_I32] = 4, [KV_GGUF_F32] = 4, [KV_GGUF_BOOL] = 1,
    [KV_GGUF_U64] = 8, [KV_GGUF_I64] = 8, [KV_GGUF_F64] = 8,
};

const char *kv_gguf_type_name(kv_gguf_type t)
{
    static const char *n[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32",
                              "bool", "string", "array", "u64", "i64", "f64"};
    return (unsigned)t < KV_GGUF_TYPE_COUNT ? n[t] : "?";
}

static kv_status need(const cursor *c, uint64_t n, const char *what)
{
    if (n > c->len - c->pos)
        return kv_fail(KV_E_DATA, "GGUF truncated: %s needs %llu bytes at offset %zu, %zu left",
                       what, (unsigned long long)n, c->pos, c->len - c->pos);
    return KV_OK;
}

static kv_status rd_u32(cursor *c, uint32_t *v, const char *what)
{
    kv_status st = need(c, 4, what);
    if (st) return st;
    memcpy(v, c->p + c->pos, 4);
    c->pos += 4;
    return KV_OK;
}

static kv_status rd_u64(cursor *c, uint64_t *v, const char *what)
{
    kv_status st = need(c, 8, what);
    if (st) return st;
    memcpy(v, c->p + c->pos, 8);
    c->pos += 8;
    return KV_OK;
}

static kv_status rd_str(cursor *c, const char **s, size_t *n, const char *what)
{
    uint64_t len;
    kv_status st = rd_u64(c, &len, what);
    if (st) return st;
    if ((st = need(c, len, what))) return st;
    *s = (const char *)c->p + c->pos;
    *n = (size_t)len;
    c->pos += len;
    return KV_OK;
}

static char *dup_n(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

// --- name tables ------------------------------------------------------------
/* Keys and tensor names are checked for duplicates and looked up through
 * hash tables: the pairwise checks took 15 s for 100k keys (a 2 MB file)
 * and more than 120 s for 200k. */

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* A table for n names: (*mask + 1) slots, a power of two >= 2n. */
static kv_status table_new(uint64_t n, uint64_t **slot, uint64_t *mask)
{
    uint64_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    *slot = calloc((size_t)cap, sizeof **slot);
    *mask = cap - 1;
    return *slot ? KV_OK : kv_fail(KV_E_NOMEM, "GGUF: out of memory");
}

/* Index of the entry named s, or -1.  name_at(g, i): the name of entry i. */
static int64_t table_find(const kv_gguf *g, const uint64_t *slot, uint64_t mask,
                          const char *(*name_at)(const kv_gguf *, uint64_t), const char *s)
{
    if (!slot) return -1;
    for (uint64_t i = name_hash(s) & mask;; i = (i + 1) & mask) {
        if (!slot[i]) return -1;
        if (!strcmp(name_at(g, slot[i] - 1), s)) return (int64_t)(slot[i] - 1);
    }
}

/* Add entry idx; false if its name is already there. */
static bool table_add(const kv_gguf *g, uint64_t *slot, uint64_t mask,
                      const char *(*name_at)(const kv_gguf *, uint64_t), uint64_t idx)
{
    const char *s = name_at(g, idx);
    uint64_t i = name_hash(s) & mask;
    for (; slot[i]; i = (i + 1) & mask)
        if (!strcmp(name_at(g, slot[i] - 1), s)) return false;
    slot[i] = idx + 1;
    return true;
}

static const char *kv_name(const kv_gguf *g, uint64_t i) { return g->kv[i].key; }
static const char *tensor_name(const kv_gguf *g, uint64_t i) { return g->tensors[i].name; }

static double scalar_at(kv_gguf_type t, const uint8_t *p)
{
    switch (t) {
    case KV_GGUF_U8: return *p;
    case KV_GGUF_I8: return (int8_t)*p;
    case KV_GGUF_BOOL: return *p != 0;
    case KV_GGUF_U16: { uint16_t v; memcpy(&v, p, 2); return v; }
    case KV_GGUF_I16: { int16_t v; memcpy(&v, p, 2); return v; }
    case KV_GGUF_U32: { uint32_t v; memcpy(&v, p, 4); return v; }
    case KV_GGUF_I32: { int32_t v; memcpy(&v, p, 4); return v; }
    case KV_GGUF_F32: { float v; memcpy(&v, p, 4); return v; }
    case KV_GGUF_U64: { uint64_t v; memcpy(&v, p, 8); return (double)v; }
    case KV_GGUF_I64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case KV_GGUF_F64: { double v; memcpy(&v, p, 8); return v; }
    default: return 0;
    }
}

/* Skip over (and validate) one array's elements; depth bounds nesting. */
static kv_status skip_array(cursor *c, int depth, kv_gguf_type *et, uint64_t *n,
                            const uint8_t **first, uint64_t **str_off)
{
    uint32_t t;
    kv_status st;
    if (depth > 8) return kv_fail(KV_E_DATA, "GGUF arrays nested too deeply");
    if ((st = rd_u32(c, &t, "array type"))) return st;
    if (t >= KV_GGUF_TYPE_COUNT)
        return kv_fail(KV_E_DATA, "GGUF array of unknown value type %u", t);
    if ((st = rd_u64(c, n, "array length"))) return st;
    *et = (kv_gguf_type)t;
    *first = c->p + c->pos;
    if (t == KV_GGUF_STRING) {
        /* each element is at least its 8-byte length */
        if (*n > (c->len - c->pos) / 8)
            return kv_fail(KV_E_DATA, "GGUF string array length %llu exceeds the file",
                           (unsigned long long)*n);
        uint64_t *off = NULL;
        if (str_off) {
            off = malloc((*n ? *n : 1) * sizeof *off);
            if (!off) return kv_fail(KV_E_NOMEM, "GGUF: out of memory for %llu strings",
                                     (unsigned long long)*n);
        }
        for (uint64_t i = 0; i < *n; i++) {
            const char *s;
            size_t sl;
            if (off) off[i] = c->pos;
            if ((st = rd_str(c, &s, &sl, "array string"))) {
                free(off);
                return st;
            }
        }
        if (str_off) *str_off = off;
        return KV_OK;
    }
    if (t == KV_GGUF_ARRAY) {
        if (*n > (c->len - c->pos) / 12)
            return kv_fail(KV_E_DATA, "GGUF nested array length %llu exceeds the file",
                           (unsigned long long)*n);
        for (uint64_t i = 0; i < *n; i++) {
            kv_gguf_type et2;
            uint64_t n2;
            const uint8_t *f2;
            if ((st = skip_array(c, depth + 1, &et2, &n2, &f2, NULL))) return st;
        }
        return KV_OK;
    }
    uint64_t es = scalar_size[t];
    if (*n > (c->len - c->pos) / es)
        return kv_fail(KV_E_DATA, "GGUF %s array of %llu elements exceeds the file",
                       kv_gguf_type_name((kv_gguf_type)t), (unsigned long long)*n);
    c->pos += *n * es;
    return KV_OK;
}

static kv_status ggml_nbytes(uint32_t type, const int64_t *ne, int nd, uint64_t *out,
                             const char *name)
{
    uint64_t n = 1;
    for (int i = 0; i < nd; i++) {
        if (ne[i] <= 0 || (uint64_t)ne[i] > (1ull << 40))
            return kv_fail(KV_E_DATA, "GGUF tensor %s: bad dimension %lld", name, (long long)ne[i]);
        if (n > (1ull << 50) / (uint64_t)ne[i])
            return kv_fail(KV_E_DATA, "GGUF tensor %s: too many elements", name);
        n *= (uint64_t)ne[i];
    }
    char tb[16];
    const kv_ggml_type_info *ti = kv_ggml_type_info_of(type);
    if (!ti || !ti->bytes)
        return kv_fail(KV_E_UNSUPPORTED, "GGUF tensor %s: ggml type %s is not supported", name,
                       kv_ggml_type_name(type, tb));
    if (ne[0] % ti->block)
        return kv_fail(KV_E_DATA, "GGUF tensor %s: %s row length %lld is not a multiple of %d", name,
                       ti->name, (long long)ne[0], ti->block);
    *out = n / (uint64_t)ti->block * (uint64_t)ti->bytes;
    return KV_OK;
}

kv_status kv_gguf_parse(const void *buf, size_t len, kv_gguf **out)
{
    *out = NULL;
    cursor c = {buf, len, 0};
    uint32_t magic, version;
    kv_status st;
    if (len < 4) return kv_fail(KV_E_DATA, "GGUF truncated: %zu bytes", len);
    if ((st = rd_u32(&c, &magic, "magic"))) return st;
    if (magic != KV_GGUF_MAGIC) return kv_fail(KV_E_DATA, "not a GGUF file (bad magic)");
    if ((st = rd_u32(&c, &version, "version"))) return st;
    if (version != 3)
        return kv_fail(KV_E_UNSUPPORTED, "GGUF version %u not supported (only 3)", version);
    kv_gguf *g = calloc(1, sizeof *g);
    if (!g) return kv_fail(KV_E_NOMEM, "GGUF: out of memory");
    g->version = version;
    g->alignment = 32;
    /* counts stay in locals until the arrays exist: kv_gguf_free walks them */
    uint64_t n_kv, n_t;
    if ((st = rd_u64(&c, &n_t, "tensor count"))) goto fail;
    if ((st = rd_u64(&c, &n_kv, "metadata count"))) goto fail;
    /* a key-value pair takes >= 8+4+1 bytes, a tensor info >= 8+4+8+4+8 */
    if (n_kv > (len - c.pos) / 13 || n_t > (len - c.pos) / 32) {
        st = kv_fail(KV_E_DATA, "GGUF counts (%llu metadata, %llu tensors) exceed the file size",
                     (unsigned long long)n_kv, (unsigned long long)n_t);
        goto fail;
    }
    g->kv = calloc(n_kv ? n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(n_t ? n_t : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors) {
        st = kv_fail(KV_E_NOMEM, "GGUF: out of memory");
        goto fail;
    }
    if ((st = table_new(n_kv, &g->kv_slot, &g->kv_mask)) || (st = table_new(n_t, &g->t_slot, &g->t_mask)))
        goto fail;
    g->n_kv = 0;
    g->n_tensors = 0;
    for (uint64_t i = 0; i < n_kv; i++) {
        kv_gguf_kv *kv = &g->kv[i];
        const char *k;
        size_t kl;
        uint32_t t;
        if ((st = rd_str(&c, &k, &kl, "metadata key"))) goto fail;
        if (!(kv->key = dup_n(k, kl))) { st = kv_fail(KV_E_NOMEM, "GGUF: out of memory"); goto fail; }
        g->n_kv = i + 1;
        if (kl == 0 || strlen(kv->key) != kl) {
            st = kv_fail(KV_E_DATA, "GGUF metadata key %llu is empty or holds a NUL byte",
                         (unsigned long long)i);
            goto fail;
        }
        if ((st = rd_u32(&c, &t, "metadata type"))) goto fail;
        if (t >= KV_GGUF_TYPE_COUNT) {
            st = kv_fail(KV_E_DATA, "GGUF metadata %s: unknown value type %u", kv->key, t);
            goto fail;
        }
        kv->type = (kv_gguf_type)t;
        if (t == KV_GGUF_STRING) {
            if ((st = rd_str(&c, &kv->str, &kv->str_len, kv->key))) goto fail;
        } else if (t == KV_GGUF_ARRAY) {
            if ((st = skip_array(&c, 0, &kv->arr_type, &kv->arr_n, &kv->arr_data, &kv->arr_str_off)))
                goto fail;
        } else {
            if ((st = need(&c, scalar_size[t], kv->key))) goto fail;
            const uint8_t *p = c.p + c.pos;
            if (t == KV_GGUF_U64) memcpy(&kv->num.u, p, 8);
            else if (t == KV_GGUF_I64) memcpy(&kv->num.i, p, 8);
            else if (t == KV_GGUF_F32 || t == KV_GGUF_F64) kv->num.f = scalar_at(kv->type, p);
            else if (t == KV_GGUF_I8 || t == KV_GGUF_I16 || t == KV_GGUF_I32)
                kv->num.i = (int64_t)scalar_at(kv->type, p);
            else kv->num.u = (uint64_t)scalar_at(kv->type, p);
            c.pos += scalar_size[t];
        }
        if (!table_add(g, g->kv_slot, g->kv_mask, kv_name, i)) {
            st = kv_fail(KV_E_DATA, "GGUF metadata key %s appears twice", kv->key);
            goto fail;
        }
    }
    const kv_gguf_kv *al = kv_gguf_find(g, "general.alignment");
    if (al) {
        if (al->type != KV_GGUF_U32 || al->num.u == 0 || (al->num.u & (al->num.u - 1)) ||
            al->num.u > 65536) {
            st = kv_fail(KV_E_DATA, "GGUF general.alignment must be a power-of-two u32");
            goto fail;
        }
        g->alignment = al->num.u;
    }
    for (uint64_t i = 0; i < n_t; i++) {
        kv_gguf_tensor *t = &g->tensors[i];
        const char *nm;
        size_t nl;
        uint32_t nd;
        if ((st = rd_str(&c, &nm, &nl, "tensor name"))) goto fail;
        if (!(t->name = dup_n(nm, nl))) { st = kv_fail(KV_E_NOMEM, "GGUF: out of memory"); goto fail; }
        g->n_tensors = i + 1;
        if (nl == 0 || strlen(t->name) != nl) {
            st = kv_fail(KV_E_DATA, "GGUF tensor %llu has an empty or bad name", (unsigned long long)i);
            goto fail;
        }
        if ((st = rd_u32(&c, &nd, t->name))) goto fail;
        if (nd < 1 || nd > 4) {
            st = kv_fail(KV_E_DATA, "GGUF tensor %s: %u dimensions (1..4 allowed)", t->name, nd);
            goto fail;
        }
        t->n_dims = (int)nd;
        for (uint32_t d = 0; d < 4; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < nd; d++) {
            uint64_t v;
            if ((st = rd_u64(&c, &v, t->name))) goto fail;
            t->ne[d] = v > INT64_MAX ? -1 : (int64_t)v;
        }
        if ((st = rd_u32(&c, &t->ggml_type, t->name))) goto fail;
        if ((st = rd_u64(&c, &t->offset, t->name))) goto fail;
        if ((st = ggml_nbytes(t->ggml_type, t->ne, t->n_dims, &t->nbytes, t->name))) goto fail;
        if (t->offset % g->alignment) {
            st = kv_fail(KV_E_DATA, "GGUF tensor %s: offset %llu not aligned to %llu", t->name,
                         (unsigned long long)t->offset, (unsigned long long)g->alignment);
            goto fail;
        }
        if (!table_add(g, g->t_slot, g->t_mask, tensor_name, i)) {
            st = kv_fail(KV_E_DATA, "GGUF tensor %s appears twice", t->name);
            goto fail;
        }
    }
    uint64_t data = (c.pos + g->alignment - 1) / g->alignment * g->alignment;
    g->data_offset = data;
    for (uint64_t i = 0; i < n_t; i++) {
        kv_gguf_tensor *t = &g->tensors[i];
        if (data > len || t->offset > len - data || t->nbytes > len - data - t->offset) {
            st = kv_fail(KV_E_DATA,
                         "GGUF tensor %s: data [%llu, +%llu) lies outside the file (%zu bytes)",
                         t->name, (unsigned long long)(data + t->offset),
                         (unsigned long long)t->nbytes, len);
            goto fail;
        }
        t->data = (const uint8_t *)buf + data + t->offset;
    }
    *out = g;
    return KV_OK;
fail:
    kv_gguf_free(g);
    return st;
}

void kv_gguf_free(kv_gguf *g)
{
    if (!g) return;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        free(g->kv[i].key);
        free(g->kv[i].arr_str_off);
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) free(g->tensors[i].name);
    free(g->kv);
    free(g->tensors);
    free(g->kv_slot);
    free(g->t_slot);
    free(g);
}

const kv_gguf_kv *kv_gguf_find(const kv_gguf *g, const char *key)
{
    int64_t i = table_find(g, g->kv_slot, g->kv_mask, kv_name, key);
    return i >= 0 && (uint64_t)i < g->n_kv ? &g->kv[i] : NULL;
}

const kv_gguf_tensor *kv_gguf_tensor_find(const kv_gguf *g, const char *name)
{
    int64_t i = table_find(g, g->t_slot, g->t_mask, tensor_name, name);
    return i >= 0 && (uint64_t)i < g->n_tensors ? &g->tensors[i] : NULL;
}

static bool is_int_type(kv_gguf_type t)
{
    return t == KV_GGUF_U8 || t == KV_GGUF_I8 || t == KV_GGUF_U16 || t == KV_GGUF_I16 ||
           t == KV_GGUF_U32 || t == KV_GGUF_I32 || t == KV_GGUF_U64 || t == KV_GGUF_I64 ||
           t == KV_GGUF_BOOL;
}

static bool is_signed(kv_gguf_type t)
{
    return t == KV_GGUF_I8 || t == KV_GGUF_I16 || t == KV_GGUF_I32 || t == KV_GGUF_I64;
}

bool kv_gguf_get_int(const kv_gguf *g, const char *key, int64_t *v, kv_status *st)
{
    const kv_gguf_kv *kv = kv_gguf_find(g, key);
    if (!kv) return false;
    if (!is_int_type(kv->type) || (!is_signed(kv->type) && kv->num.u > (uint64_t)INT64_MAX)) {
        kv_status s = kv_fail(KV_E_DATA, "GGUF %s: expected an integer, found %s", key,
                              kv_gguf_type_name(kv->type));
        if (st) *st = s;
        return false;
    }
    *v = is_signed(kv->type) ? kv->num.i : (int64_t)kv->num.u;
    return true;
}

bool kv_gguf_get_float(const kv_gguf *g, const char *key, double *v, kv_status *st)
{
    const kv_gguf_kv *kv = kv_gguf_find(g, key);
    if (!kv) return false;
    if (kv->type == KV_GGUF_F32 || kv->type == KV_GGUF_F64) *v = kv->num.f;
    else if (is_int_type(kv->type)) *v = is_signed(kv->type) ? (double)kv->num.i : (double)kv->num.u;
    else {
        kv_status s = kv_fail(KV_E_DATA, "GGUF %s: expected a number, found %s", key,
                              kv_gguf_type_name(kv->type));
        if (st) *st = s;
        return false;
    }
    return true;
}

bool kv_gguf_get_str(const kv_gguf *g, const char *key, char *out, size_t n, kv_status *st)
{
    const kv_gguf_kv *kv = kv_gguf_find(g, key);
    if (!kv) return false;
    if (kv->type != KV_GGUF_STRING) {
        kv_status s = kv_fail(KV_E_DATA, "GGUF %s: expected a string, found %s", key,
                              kv_gguf_type_name(kv->type));
        if (st) *st = s;
        return false;
    }
    if (n == 0) return true;
    size_t l = kv->str_len < n - 1 ? kv->str_len : n - 1;
    memcpy(out, kv->str, l);
    out[l] = 0;
    return true;
}

const char *kv_gguf_arr_str(const kv_gguf_kv *kv, uint64_t i, size_t *len)
{
    if (kv->type != KV_GGUF_ARRAY || kv->arr_type != KV_GGUF_STRING || i >= kv->arr_n ||
        !kv->arr_str_off)
        return NULL;
    /* offsets are from the buffer start; arr_data - (its offset) recovers it */
    const uint8_t *base = kv->arr_data - kv->arr_str_off[0];
    uint64_t l;
    memcpy(&l, base + kv->arr_str_off[i], 8);
    *len = (size_t)l;
    return (const char *)base + kv->arr_str_off[i] + 8;
}

double kv_gguf_arr_num(const kv_gguf_kv *kv, uint64_t i)
{
    if (kv->type != KV_GGUF_ARRAY || i >= kv->arr_n || kv->arr_type >= KV_GGUF_TYPE_COUNT ||
        kv->arr_type == KV_GGUF_STRING || kv->arr_type == KV_GGUF_ARRAY)
        return NAN;
    return scalar_at(kv->arr_type, kv->arr_data + i * scalar_size[kv->arr_type]);
}

bool kv_gguf_is_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    char m[4];
    bool yes = fread(m, 1, 4, f) == 4 && !memcmp(m, "GGUF", 4);
    fclose(f);
    return yes;
}
