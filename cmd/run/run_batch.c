/*
 * kv-run --batch B: B prompts decoded greedily (lib/engine/kv_runner_batch.c:
 * together on the GPU, one after another on the CPU).  The prompts: the
 * lines of --prompt-file (one per line, blank lines skipped, the first B
 * used), B seeded random prompts (--random-prompt N: seeds seed .. seed+B-1),
 * or B copies of --prompt.  stdout gets one JSON object per sequence and
 * line, in order: {"seq", "prompt_tokens", "tokens", "text" (with a
 * tokenizer, unless --print-ids), "end"}; --report FILE the batch's report.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cli.h"
#include "common/kv_file.h"
#include "common/kv_outfile.h"
#include "engine/kv_runner_batch.h"
#include "model/kv_prompt.h"
#include "model/kv_prompt_lines.h"
#include "run.h"

/* The B prompts' ids (ids[i], n[i]); reports and returns the exit code. */
static int batch_prompts(const run_opts *o, const kv_tokenizer *tok, int vocab, int **ids, int *n)
{
    char *buf = NULL, **lines = NULL;
    size_t len = 0;
    int nl = 0;
    kv_status st = KV_OK;
    if (o->prompt_file) {
        st = kv_file_slurp(o->prompt_file, 0, "prompt file", &buf, &len);
        if (!st) st = kv_prompt_lines(buf, len, &lines, &nl);
        if (st) {
            free(buf);
            return kv_report(st, "--prompt-file %s", o->prompt_file);
        }
        if (nl < o->batch) {
            free(buf);
            kv_prompt_lines_free(lines, nl);
            return kv_report(kv_fail(KV_E_DATA, "%s holds %d prompt%s, --batch asks for %d", o->prompt_file, nl,
                                     nl == 1 ? "" : "s", o->batch), "--prompt-file");
        }
        if (nl > o->batch) kv_note(1, "%s holds %d prompts: the first %d run", o->prompt_file, nl, o->batch);
    }
    for (int i = 0; i < o->batch && !st; i++) {
        kv_prompt p = {.chat = o->chat, .special = o->special, .seed = o->seed + (uint64_t)i};
        if (lines) p.text = lines[i], p.text_len = strlen(lines[i]);
        else if (o->random_prompt) p.random = o->random_prompt;
        else p.text = o->prompt, p.text_len = strlen(o->prompt);
        st = kv_prompt_tokens(&p, tok, vocab, &ids[i], &n[i]);
        if (st) kv_errcontext("prompt %d", i + 1);
    }
    free(buf);
    kv_prompt_lines_free(lines, nl);
    return st ? kv_report(st, "cannot tokenize the prompts") : 0;
}

/* One sequence as a JSON line on stdout. */
static kv_status print_seq(const run_opts *o, const kv_tokenizer *tok, int i, const int *prompt, int np,
                           const kv_generation *g)
{
    cJSON *j = cJSON_CreateObject();
    if (!j) return kv_fail(KV_E_NOMEM, "out of memory");
    cJSON_AddNumberToObject(j, "seq", i);
    cJSON_AddNumberToObject(j, "prompt_tokens", np);
    cJSON *a = cJSON_AddArrayToObject(j, "tokens");
    for (int k = 0; a && k < g->n_gen; k++) cJSON_AddItemToArray(a, cJSON_CreateNumber(g->tokens[k]));
    kv_status st = KV_OK;
    if (tok && !o->print_ids) {
        char *text = NULL;
        st = kv_tokens_text(tok, prompt[np - 1], g->tokens, g->n_gen, &text);
        if (!st) cJSON_AddStringToObject(j, "text", text);
        free(text);
    }
    cJSON_AddStringToObject(j, "end", kv_gen_end_name(g->end));
    char *line = st ? NULL : cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!st && !line) st = kv_fail(KV_E_NOMEM, "out of memory writing JSON");
    if (!st && printf("%s\n", line) < 0) st = kv_fail(KV_E_IO, "write error on stdout: %s", strerror(errno));
    free(line);
    return st;
}

int run_batch(const run_opts *o)
{
    const int B = o->batch;
    int rc = 0, **ids = calloc((size_t)B, sizeof *ids), *n = calloc((size_t)B, sizeof *n);
    kv_model *m = NULL;
    kv_tokenizer *tok = NULL;
    kv_policy_params *prm = NULL;
    kv_batch_result res = {0};
    kv_outfile rep;
    bool rep_open = false;
    char *json = NULL;
    kv_status st;
    if (!ids || !n) {
        rc = kv_report(kv_fail(KV_E_NOMEM, "out of memory"), "out of memory");
        goto out;
    }
    if (o->report && (st = kv_outfile_open(&rep, o->report))) {
        rc = kv_report(st, "cannot write %s", o->report);
        goto out;
    }
    rep_open = o->report != NULL;
    if ((rc = run_load_model(o, &m, &tok)) || (rc = run_load_policies(o, m->cfg.n_layers, &prm)) ||
        (rc = batch_prompts(o, tok, m->cfg.vocab_size, ids, n)))
        goto out;
    int longest = 0, ctx = 0;
    for (int i = 0; i < B; i++) longest = n[i] > longest ? n[i] : longest;
    bool grown;
    if ((st = kv_run_ctx(o->ctx, m->cfg.seq_len, longest, o->steps, &ctx, &grown))) {
        rc = kv_report(st, "cannot run");
        goto out;
    }
    if (grown) kv_warn("the longest prompt (%d tokens) and -n %d need more than the model's trained context: %d", longest,
                       o->steps, ctx);
    kv_gpu_engine_opts go;
    kv_gpu_engine_opts_default(&go);
    go.device = o->device_ordinal, go.prefill_chunk = o->prefill_chunk, go.gemv_q = o->gemv;
    kv_generate_opts gopt = {o->steps, {tok ? kv_tokenizer_bos(tok) : 1, tok ? kv_tokenizer_eos(tok) : 2}, NULL, NULL,
                             tok};
    kv_progress("%d sequences", B);
    st = kv_runner_batch(m, prm, ctx, o->dev, &go, o->gemm, B, (const int *const *)ids, n, &gopt, &res);
    kv_progress_done();
    if (st) {
        rc = kv_report(st, o->dev == KV_DEVICE_CUDA ? "--batch on the GPU" : "--batch");
        goto out;
    }
    if (res.fallback[0]) kv_note(1, "--device auto: using the CPU (%s)", res.fallback);
    kv_note(1, "%d sequences %s: prefill %.1f ms, decode %.1f ms", B, res.how, res.prefill_ms, res.decode_ms);
    for (int i = 0; i < B && !st; i++) st = print_seq(o, tok, i, ids[i], n[i], &res.gen[i]);
    if (!st && (fflush(stdout) || ferror(stdout))) st = kv_fail(KV_E_IO, "write error on stdout: %s", strerror(errno));
    if (st) {
        rc = kv_report(st, "cannot write to stdout");
        goto out;
    }
    if (o->report) {
        st = kv_batch_report(m, &res, n, kv_gpu_gemm_name(o->gemm), &json);
        if (!st) rep_open = false, st = kv_outfile_put(&rep, json);
        if (st) rc = kv_report(st, "cannot write %s", o->report);
    }
out:
    if (rep_open) kv_outfile_abort(&rep);
    free(json);
    kv_batch_result_clear(&res);
    for (int i = 0; ids && i < B; i++) free(ids[i]);
    free(ids);
    free(n);
    free(prm);
    kv_tokenizer_free(tok);
    kv_model_close(m);
    return rc;
}
