/*
 * libFuzzer target for the LongBench data reader (lib/eval/kv_longbench.c):
 * any byte string must parse (bad lines set aside with a reason) or fail
 * with KV_E_DATA, never crash, leak or read out of bounds; every sample
 * that parses has an id and its answers, and formats through a template
 * or fails with KV_E_DATA.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eval/kv_longbench.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_lb_file f;
    kv_status st = kv_lb_file_parse((const char *)data, size, "fuzz/trec_e.jsonl", &f);
    if (st) {
        if (st != KV_E_DATA || !kv_errdetail()[0]) abort();
        return 0;
    }
    if (!f.e || strcmp(f.dataset, "trec")) abort();
    for (int i = 0; i < f.n_bad; i++)
        if (f.bad[i].line < 1 || !f.bad[i].why[0]) abort();
    for (int i = 0; i < f.n; i++) {
        const kv_lb_sample *s = &f.v[i];
        if (!s->id[0] || (s->n_answers && !s->answers) || (s->has_classes && s->n_classes && !s->classes))
            abort();
        char *out;
        long end;
        st = kv_lb_format("Q {input}\n{context}\n{{x}} {length}", s->obj, &out, &end);
        if (st == KV_OK) {
            if (end > (long)strlen(out)) abort();
            free(out);
        } else if (st != KV_E_DATA) {
            abort();
        }
    }
    kv_lb_file_free(&f);
    return 0;
}
