/*
 * libFuzzer target for prediction files and the official metrics
 * (lib/eval/kv_score.c, kv_metrics.c): LongBench and RULER prediction
 * lines parse or fail with KV_E_DATA; parsed predictions are scored under
 * every LongBench metric that needs no jieba and both RULER metrics, and
 * every score is a number in [0, 1] (or a KV_E_DATA refusal), never a
 * crash, a hang or a read out of bounds.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eval/kv_metrics.h"
#include "eval/kv_score.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_lb_preds p;
    kv_status st = kv_lb_preds_parse((const char *)data, size, "fuzz", &p);
    if (st && (st != KV_E_DATA || !kv_errdetail()[0])) abort();
    for (int d = 0; !st && d < kv_lb_n_datasets; d++) {
        const kv_lb_dataset *ds = &kv_lb_datasets[d];
        if (kv_lb_metric_needs_jieba(ds->metric)) continue;
        kv_lb_score sc;
        kv_status s2 = kv_lb_score_preds(ds, NULL, &p, d % 2 == 0, true, &sc);
        if (s2 == KV_OK) {
            for (int i = 0; i < sc.n; i++)
                if (!(sc.sample[i] >= 0 && sc.sample[i] <= 1)) abort();
            if (sc.n && !(sc.score >= 0 && sc.score <= 100)) abort();
            kv_lb_score_free(&sc);
        } else if (s2 != KV_E_DATA && s2 != KV_E_UNSUPPORTED) {
            abort();
        }
    }
    if (!st) kv_lb_preds_free(&p);
    kv_ruler_preds r;
    st = kv_ruler_preds_parse((const char *)data, size, "fuzz", &r);
    if (st) {
        if (st != KV_E_DATA || !kv_errdetail()[0]) abort();
        return 0;
    }
    for (int m = 0; m < 2; m++) {
        kv_ruler_score sc;
        kv_status s2 = kv_ruler_score_preds((kv_ruler_metric)m, &r, true, &sc);
        if (s2 == KV_OK) {
            if (sc.nulls < 0 || sc.nulls > sc.n || !(sc.score >= 0 && sc.score <= 100)) abort();
            kv_ruler_score_free(&sc);
        } else if (s2 != KV_E_DATA) {
            abort();
        }
    }
    kv_ruler_preds_free(&r);
    return 0;
}
