/*
 * libFuzzer target for the deployment-config parser (lib/policy/kv_deploy.c):
 * any byte string must parse or fail with KV_E_DATA and a message, never
 * crash, leak or read out of bounds; a config that parses must apply to
 * the layers it names and survive a write/parse round trip unchanged.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/kv_deploy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const int n_layers = 32;
    kv_deploy d;
    kv_status st = kv_deploy_parse((const char *)data, size, n_layers, &d);
    if (st) {
        if (st != KV_E_DATA || !kv_errdetail()[0]) abort();
        return 0;
    }
    kv_policy_params pl[32];
    kv_deploy_apply(&d, n_layers, pl);
    for (int i = 0; i < d.n_quant; i++)
        if (pl[d.quant_layers[i]].kind != d.quant.kind) abort();
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) abort();
    kv_deploy_write_json(&d, f, 0);
    fclose(f);
    kv_deploy back;
    if (kv_deploy_parse(buf, len, n_layers, &back)) abort();
    /* the writer writes the newest per-layer version (2 comes back as 3, its
     * dsq defaults made explicit) or version 1, whose one "bits" is a dsq
     * method's keys' */
    const bool dsq = !d.per_layer && d.quant.kind == KV_POL_DSQ;
    if (back.n_quant != d.n_quant || back.n_sparse != d.n_sparse ||
        (dsq ? back.quant.dsq_kbits != d.quant.dsq_kbits : back.quant.bits != d.quant.bits) ||
        back.sparse.topk != d.sparse.topk || back.quant.dsq_window != d.quant.dsq_window ||
        back.version != (d.per_layer ? KV_DEPLOY_VERSION : 1) || !back.per_layer != !d.per_layer)
        abort();
    /* versions 2 and 3: every layer's parameters come back (what a spec sets) */
    for (int i = 0; d.per_layer && i < n_layers; i++) {
        kv_policy_params a = d.per_layer[i], b = back.per_layer[i];
        if (memcmp(&a, &b, sizeof a)) abort();
        if (pl[i].kind != a.kind) abort();
    }
    for (int i = 0; i < d.n_quant; i++)
        if (back.quant_layers[i] != d.quant_layers[i]) abort();
    kv_deploy_clear(&back);
    free(buf);
    kv_deploy_clear(&d);
    return 0;
}
