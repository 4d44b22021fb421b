/*
 * libFuzzer target for LongBench's config tables as kv-bench reads them
 * (dataset2prompt.json, dataset2maxlen.json; lib/eval/kv_longbench.c): any
 * byte string parses or fails with KV_E_DATA; every template that parses
 * formats a sample or fails with KV_E_DATA, never crashes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eval/kv_longbench.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_lb_table t;
    kv_status st = kv_lb_maxlen_parse((const char *)data, size, "m", &t);
    if (st && (st != KV_E_DATA || !kv_errdetail()[0])) abort();
    if (!st) {
        for (int i = 0; i < t.n; i++)
            if (t.num[i] < 1 || t.num[i] > 65536 || kv_lb_table_find(&t, t.name[i]) != i) abort();
        kv_lb_table_free(&t);
    }
    st = kv_lb_prompts_parse((const char *)data, size, "p", &t);
    if (st) {
        if (st != KV_E_DATA || !kv_errdetail()[0]) abort();
        return 0;
    }
    cJSON *obj = cJSON_Parse("{\"context\": \"ctx\", \"input\": \"q\", \"length\": 7, \"_id\": \"x\"}");
    for (int i = 0; obj && i < t.n; i++) {
        char *out;
        long end;
        st = kv_lb_format(t.text[i], obj, &out, &end);
        if (st == KV_OK) {
            if (end > (long)strlen(out)) abort();
            free(out);
        } else if (st != KV_E_DATA) {
            abort();
        }
    }
    cJSON_Delete(obj);
    kv_lb_table_free(&t);
    return 0;
}
