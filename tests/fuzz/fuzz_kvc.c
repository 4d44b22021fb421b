/*
 * libFuzzer target for the .kvc reader: open from memory (which exercises
 * the zstd path too), then touch everything a tool would: every tensor's
 * bytes, float conversion, the metadata, the per-layer views.  Any crash,
 * sanitizer report or leak is a bug in lib/format (kvc_file.c, kvc_parse.c).
 * The same bytes through kvc_open_view (parsed in place, sums not taken):
 * whatever kvc_open_mem accepts it accepts too, with the same tables, and
 * it never reads outside the buffer (ASan) nor frees it.  The header
 * alone through kvc_open_head: never a read past the bytes it is given,
 * and the same tensor table as the whole open.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_crc.h"
#include "format/kvc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* kvc_open_head over a copy of exactly the first hl bytes (so that ASan
 * sees any read past them): never more than it was given, and when the
 * whole open accepted the file, the same tensors at the same places. */
static void head_check(const uint8_t *data, size_t size, size_t hl, const kvc_file *whole)
{
    uint8_t *h = malloc(hl ? hl : 1);
    if (!h) return;
    memcpy(h, data, hl);
    kvc_file *f = NULL;
    kv_status st = kvc_open_head(h, hl, size, &f);
    free(h); /* the header may go once parsed */
    if (!st && whole) {
        if (kvc_n_tensors(f) != kvc_n_tensors(whole)) abort();
        for (int i = 0; i < kvc_n_tensors(f); i++) {
            const kvc_tensor *a = kvc_tensor_at(f, i), *b = kvc_find(whole, a->name);
            if (!b || a->data || a->offset != b->offset || a->nbytes != b->nbytes || a->crc != b->crc) abort();
        }
    }
    kvc_close(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size >= 8) { /* the header alone: as long as it says, shorter, and the whole input */
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--) n = n << 8 | data[i];
        size_t hl = n < size - 8 ? (size_t)n + 8 : size;
        kvc_file *whole = NULL;
        if (kvc_open_mem(data, size, &whole) != KV_OK || kvc_was_zstd(whole)) kvc_close(whole), whole = NULL;
        head_check(data, size, hl, whole);
        head_check(data, size, hl > 9 ? hl - 1 : hl, NULL);
        head_check(data, size, size, whole);
        kvc_close(whole);
    }
    kvc_file *f = NULL, *fv = NULL;
    const kv_status sv = kvc_open_view(data, size, &fv);
    if (kvc_open_mem(data, size, &f) != KV_OK) {
        kvc_close(fv);
        return 0;
    }
    if (sv != KV_OK || kvc_n_tensors(fv) != kvc_n_tensors(f) || kvc_n_meta(fv) != kvc_n_meta(f) ||
        kvc_geom(fv)->n_layers != kvc_geom(f)->n_layers || kvc_geom(fv)->n_tokens != kvc_geom(f)->n_tokens)
        abort(); /* the view accepts all the copy accepts, alike */
    kvc_close(fv);
    volatile uint32_t sink = 0;
    for (int i = 0; i < kvc_n_tensors(f); i++) {
        const kvc_tensor *t = kvc_tensor_at(f, i);
        sink ^= kv_crc32c(0, t->data, t->nbytes);
        if ((t->dtype == KV_DT_F32 || t->dtype == KV_DT_F16 || t->dtype == KV_DT_BF16) &&
            t->nbytes <= (1u << 20)) {
            float *buf = malloc((size_t)kvc_tensor_numel(t) * sizeof *buf + 1);
            /* the bits, not (uint32_t)buf[0]: converting a negative or huge
             * float to an integer is undefined behaviour */
            uint32_t bits = 0;
            if (buf && kvc_tensor_to_f32(t, buf) == KV_OK && kvc_tensor_numel(t) > 0) memcpy(&bits, buf, 4);
            sink ^= bits;
            free(buf);
        }
        if (kvc_find(f, t->name) != t) abort(); /* names are unique and indexed */
    }
    for (int i = 0; i < kvc_n_meta(f); i++) {
        const char *k, *v;
        kvc_meta_at(f, i, &k, &v);
        if (kvc_meta(f, k) != v) abort();
    }
    const kv_geom *g = kvc_geom(f);
    for (int l = 0; l < g->n_layers; l++) {
        kv_kivi_params p;
        if (!kvc_layer_encoding(f, l, 'k') || !kvc_layer_encoding(f, l, 'v')) abort();
        sink ^= (uint32_t)kvc_layer_kivi(f, l, 'k', &p) ^ (uint32_t)kvc_layer_bytes(f, l, false);
        const kvc_tensor *k = kvc_layer(f, l, "k");
        if (k && (k->shape[0] != g->n_kv_heads || k->shape[1] != g->n_tokens || k->shape[2] != g->head_dim))
            abort(); /* the validated geometry matches every plain layer */
    }
    (void)sink;
    kvc_close(f);
    return 0;
}
