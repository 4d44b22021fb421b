/*
 * kv_gguf_write: GGUF v3 writer (see kv_gguf_write.h).  Metadata values are
 * serialized into one growing byte buffer as they are set (key string,
 * u32 type, value), so writing is one pass over that buffer, the tensor
 * infos and the borrowed tensor data.
 */
#include "format/kv_gguf_write.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_ggml.h"
#include "common/kv_outfile.h"
#include "format/kv_gguf.h"

#define ALIGN 32

typedef struct {
    char *name;
    uint32_t type;
    int n_dims;
    int64_t ne[4];
    const void *data;
    size_t nbytes;
    uint64_t offset;
} wtensor;

struct kv_gguf_writer {
    uint8_t *kv;        /* serialized metadata */
    size_t kv_len, kv_cap;
    uint64_t n_kv;
    char **keys;        /* (n_kv) for the duplicate check */
    wtensor *t;
    size_t n_t, cap_t;
    uint64_t data_len;  /* running data size, aligned */
};

kv_status kv_gguf_writer_new(kv_gguf_writer **out)
{
    *out = calloc(1, sizeof **out);
    return *out ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory");
}

void kv_gguf_writer_free(kv_gguf_writer *w)
{
    if (!w) return;
    for (uint64_t i = 0; i < w->n_kv; i++) free(w->keys[i]);
    for (size_t i = 0; i < w->n_t; i++) free(w->t[i].name);
    free(w->keys);
    free(w->t);
    free(w->kv);
    free(w);
}

static kv_status put(kv_gguf_writer *w, const void *p, size_t n)
{
    if (w->kv_len + n > w->kv_cap) {
        size_t nc = w->kv_cap ? w->kv_cap : 4096;
        while (nc < w->kv_len + n) nc *= 2;
        uint8_t *nb = realloc(w->kv, nc);
        if (!nb) return kv_fail(KV_E_NOMEM, "out of memory for GGUF metadata");
        w->kv = nb;
        w->kv_cap = nc;
    }
    memcpy(w->kv + w->kv_len, p, n);
    w->kv_len += n;
    return KV_OK;
}

static kv_status put_u32(kv_gguf_writer *w, uint32_t v) { return put(w, &v, 4); }
static kv_status put_u64(kv_gguf_writer *w, uint64_t v) { return put(w, &v, 8); }

static kv_status put_str(kv_gguf_writer *w, const char *s, size_t n)
{
    kv_status st = put_u64(w, n);
    return st ? st : put(w, s, n);
}

/* Key and type of a new entry. */
static kv_status begin(kv_gguf_writer *w, const char *key, kv_gguf_type t)
{
    if (!key || !*key) return kv_fail(KV_E_USAGE, "GGUF metadata key is empty");
    for (uint64_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->keys[i], key)) return kv_fail(KV_E_USAGE, "GGUF metadata key %s is set twice", key);
    char **nk = realloc(w->keys, (size_t)(w->n_kv + 1) * sizeof *nk);
    if (!nk) return kv_fail(KV_E_NOMEM, "out of memory");
    w->keys = nk;
    if (!(w->keys[w->n_kv] = strdup(key))) return kv_fail(KV_E_NOMEM, "out of memory");
    w->n_kv++;
    kv_status st = put_str(w, key, strlen(key));
    return st ? st : put_u32(w, (uint32_t)t);
}

kv_status kv_gguf_set_str(kv_gguf_writer *w, const char *key, const char *val)
{
    kv_status st = begin(w, key, KV_GGUF_STRING);
    return st ? st : put_str(w, val, strlen(val));
}

kv_status kv_gguf_set_u32(kv_gguf_writer *w, const char *key, uint32_t val)
{
    kv_status st = begin(w, key, KV_GGUF_U32);
    return st ? st : put_u32(w, val);
}

kv_status kv_gguf_set_i32(kv_gguf_writer *w, const char *key, int32_t val)
{
    kv_status st = begin(w, key, KV_GGUF_I32);
    return st ? st : put(w, &val, 4);
}

kv_status kv_gguf_set_f32(kv_gguf_writer *w, const char *key, float val)
{
    kv_status st = begin(w, key, KV_GGUF_F32);
    return st ? st : put(w, &val, 4);
}

kv_status kv_gguf_set_bool(kv_gguf_writer *w, const char *key, bool val)
{
    uint8_t b = val;
    kv_status st = begin(w, key, KV_GGUF_BOOL);
    return st ? st : put(w, &b, 1);
}

static kv_status arr_head(kv_gguf_writer *w, const char *key, kv_gguf_type et, size_t n)
{
    kv_status st = begin(w, key, KV_GGUF_ARRAY);
    if (!st) st = put_u32(w, (uint32_t)et);
    if (!st) st = put_u64(w, n);
    return st;
}

kv_status kv_gguf_set_arr_str(kv_gguf_writer *w, const char *key, const char *const *s,
                              const size_t *lens, size_t n)
{
    kv_status st = arr_head(w, key, KV_GGUF_STRING, n);
    for (size_t i = 0; i < n && !st; i++) st = put_str(w, s[i], lens ? lens[i] : strlen(s[i]));
    return st;
}

kv_status kv_gguf_set_arr_f32(kv_gguf_writer *w, const char *key, const float *v, size_t n)
{
    kv_status st = arr_head(w, key, KV_GGUF_F32, n);
    return st ? st : put(w, v, n * 4);
}

kv_status kv_gguf_set_arr_i32(kv_gguf_writer *w, const char *key, const int32_t *v, size_t n)
{
    kv_status st = arr_head(w, key, KV_GGUF_I32, n);
    return st ? st : put(w, v, n * 4);
}

kv_status kv_gguf_copy_kv(kv_gguf_writer *w, const kv_gguf_kv *kv)
{
    static const size_t esz[KV_GGUF_TYPE_COUNT] = {
        [KV_GGUF_U8] = 1, [KV_GGUF_I8] = 1, [KV_GGUF_U16] = 2, [KV_GGUF_I16] = 2, [KV_GGUF_U32] = 4,
        [KV_GGUF_I32] = 4, [KV_GGUF_F32] = 4, [KV_GGUF_BOOL] = 1, [KV_GGUF_U64] = 8, [KV_GGUF_I64] = 8,
        [KV_GGUF_F64] = 8,
    };
    kv_status st;
    if (kv->type == KV_GGUF_STRING) {
        if ((st = begin(w, kv->key, KV_GGUF_STRING))) return st;
        return put_str(w, kv->str, kv->str_len);
    }
    if (kv->type == KV_GGUF_ARRAY) {
        if (kv->arr_type == KV_GGUF_ARRAY || kv->arr_type >= KV_GGUF_TYPE_COUNT)
            return kv_fail(KV_E_UNSUPPORTED, "GGUF metadata %s: nested arrays are not copied", kv->key);
        if ((st = arr_head(w, kv->key, kv->arr_type, (size_t)kv->arr_n))) return st;
        if (kv->arr_type == KV_GGUF_STRING) {
            for (uint64_t i = 0; i < kv->arr_n; i++) {
                size_t l;
                const char *s = kv_gguf_arr_str(kv, i, &l);
                if ((st = put_str(w, s ? s : "", s ? l : 0))) return st;
            }
            return KV_OK;
        }
        return put(w, kv->arr_data, (size_t)kv->arr_n * esz[kv->arr_type]);
    }
    if (kv->type >= KV_GGUF_TYPE_COUNT) return kv_fail(KV_E_DATA, "GGUF metadata %s: bad type", kv->key);
    if ((st = begin(w, kv->key, kv->type))) return st;
    /* the parser keeps scalars widened: narrow them back */
    uint8_t b[8];
    switch (kv->type) {
    case KV_GGUF_F32: { float f = (float)kv->num.f; memcpy(b, &f, 4); break; }
    case KV_GGUF_F64: memcpy(b, &kv->num.f, 8); break;
    case KV_GGUF_I8: case KV_GGUF_I16: case KV_GGUF_I32: case KV_GGUF_I64: memcpy(b, &kv->num.i, 8); break;
    default: memcpy(b, &kv->num.u, 8);
    }
    return put(w, b, esz[kv->type]);
}

kv_status kv_gguf_add_tensor(kv_gguf_writer *w, const char *name, uint32_t type, int n_dims,
                             const int64_t *ne, const void *data, size_t nbytes)
{
    char tb[16];
    const kv_ggml_type_info *ti = kv_ggml_type_info_of(type);
    if (!ti || !ti->bytes) return kv_fail(KV_E_USAGE, "GGUF tensor %s: cannot write type %s", name, kv_ggml_type_name(type, tb));
    if (n_dims < 1 || n_dims > 4) return kv_fail(KV_E_USAGE, "GGUF tensor %s: %d dimensions", name, n_dims);
    uint64_t n = 1;
    for (int i = 0; i < n_dims; i++) {
        if (ne[i] <= 0) return kv_fail(KV_E_USAGE, "GGUF tensor %s: dimension %lld", name, (long long)ne[i]);
        n *= (uint64_t)ne[i];
    }
    if (ne[0] % ti->block || n / (uint64_t)ti->block * (uint64_t)ti->bytes != nbytes)
        return kv_fail(KV_E_USAGE, "GGUF tensor %s: %zu bytes do not hold %llu %s values", name, nbytes,
                       (unsigned long long)n, ti->name);
    for (size_t i = 0; i < w->n_t; i++)
        if (!strcmp(w->t[i].name, name)) return kv_fail(KV_E_USAGE, "GGUF tensor %s is added twice", name);
    if (w->n_t == w->cap_t) {
        size_t nc = w->cap_t ? 2 * w->cap_t : 64;
        wtensor *nt = realloc(w->t, nc * sizeof *nt);
        if (!nt) return kv_fail(KV_E_NOMEM, "out of memory");
        w->t = nt;
        w->cap_t = nc;
    }
    wtensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name))) return kv_fail(KV_E_NOMEM, "out of memory");
    w->n_t++;
    t->type = type;
    t->n_dims = n_dims;
    for (int i = 0; i < n_dims; i++) t->ne[i] = ne[i];
    t->data = data;
    t->nbytes = nbytes;
    t->offset = w->data_len;
    w->data_len += (nbytes + ALIGN - 1) / ALIGN * ALIGN;
    return KV_OK;
}

static int fput_u32(FILE *f, uint32_t v) { return fwrite(&v, 4, 1, f) == 1 ? 0 : -1; }
static int fput_u64(FILE *f, uint64_t v) { return fwrite(&v, 8, 1, f) == 1 ? 0 : -1; }

kv_status kv_gguf_writer_write(kv_gguf_writer *w, const char *path)
{
    kv_outfile of;
    kv_status st = kv_outfile_open(&of, path);
    if (st) return st;
    FILE *f = of.fp;
    static const uint8_t zeros[ALIGN];
    int bad = fput_u32(f, KV_GGUF_MAGIC) | fput_u32(f, 3) | fput_u64(f, w->n_t) | fput_u64(f, w->n_kv);
    uint64_t pos = 24;
    if (w->kv_len && fwrite(w->kv, 1, w->kv_len, f) != w->kv_len) bad = -1;
    pos += w->kv_len;
    for (size_t i = 0; i < w->n_t && !bad; i++) {
        const wtensor *t = &w->t[i];
        size_t nl = strlen(t->name);
        bad |= fput_u64(f, nl) | (fwrite(t->name, 1, nl, f) == nl ? 0 : -1) | fput_u32(f, (uint32_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++) bad |= fput_u64(f, (uint64_t)t->ne[d]);
        bad |= fput_u32(f, t->type) | fput_u64(f, t->offset);
        pos += 8 + nl + 4 + 8 * (uint64_t)t->n_dims + 4 + 8;
    }
    size_t pad = (size_t)((ALIGN - pos % ALIGN) % ALIGN);
    if (!bad && pad && fwrite(zeros, 1, pad, f) != pad) bad = -1;
    for (size_t i = 0; i < w->n_t && !bad; i++) {
        const wtensor *t = &w->t[i];
        if (t->nbytes && fwrite(t->data, 1, t->nbytes, f) != t->nbytes) bad = -1;
        size_t tp = (ALIGN - t->nbytes % ALIGN) % ALIGN;
        if (!bad && tp && fwrite(zeros, 1, tp, f) != tp) bad = -1;
    }
    if (bad) {
        kv_outfile_abort(&of);
        return kv_fail(KV_E_IO, "write error on %s", path);
    }
    return kv_outfile_commit(&of);
}
