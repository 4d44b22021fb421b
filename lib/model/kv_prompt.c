/*
 * kv_prompt: a model's tokenizer and a prompt's token ids (kv_prompt.h).
 */
#include "model/kv_prompt.h"

#include <dirent.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_file.h"
#include "format/kv_gguf.h"

kv_status kv_tokenizer_find(const char *model_path, int vocab, kv_tokenizer **out)
{
    *out = NULL;
    char *dup = strdup(model_path);
    if (!dup) return kv_fail(KV_E_NOMEM, "out of memory");
    const char *dir = dirname(dup);
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.bin", dir);
    kv_status st = kv_tokenizer_load_llama2c(path, vocab, out);
    if (st != KV_E_NOINPUT) {
        free(dup);
        return st;
    }
    DIR *d = opendir(dir);
    char best[1024] = "";
    for (struct dirent *de; d && (de = readdir(d));) {
        size_t l = strlen(de->d_name);
        if (l > 7 && !strncmp(de->d_name, "tok", 3) && !strcmp(de->d_name + l - 4, ".bin") &&
            l < sizeof best && (!best[0] || strcmp(de->d_name, best) < 0)) {
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            kv_tokenizer *t;
            if (kv_tokenizer_load_llama2c(path, vocab, &t) == KV_OK) {
                kv_tokenizer_free(t);
                snprintf(best, sizeof best, "%s", de->d_name);
            }
        }
    }
    if (d) closedir(d);
    if (!best[0]) {
        free(dup);
        return kv_fail(KV_E_NOINPUT, "no tokenizer for a %d-token vocabulary beside %s (use --tokenizer or --tokens)",
                       vocab, model_path);
    }
    snprintf(path, sizeof path, "%s/%s", dir, best);
    free(dup);
    return kv_tokenizer_load_llama2c(path, vocab, out);
}

kv_status kv_tokenizer_for_model(const kv_model *m, const char *model_path, const char *path,
                                 kv_tokenizer **out)
{
    *out = NULL;
    if (path) return kv_tokenizer_load_llama2c(path, m->cfg.vocab_size, out);
    if (kv_model_gguf(m)) return kv_tokenizer_from_gguf(kv_model_gguf(m), out);
    if (model_path) return kv_tokenizer_find(model_path, m->cfg.vocab_size, out);
    return kv_fail(KV_E_NOINPUT, "the %s model has no tokenizer (use --tokenizer, or --tokens for token ids)",
                   m->cfg.name);
}

kv_status kv_tokenizer_for_file(const char *model_path, const char *path, kv_tokenizer **out)
{
    *out = NULL;
    if (!path && kv_gguf_is_file(model_path)) return kv_tokenizer_load_gguf(model_path, out);
    kv_model *m;
    kv_status st = kv_model_open(model_path, &m);
    if (st) return st;
    st = kv_tokenizer_for_model(m, model_path, path, out);
    kv_model_close(m);
    return st;
}

const char *kv_token_piece(const kv_tokenizer *t, int prev, int tok, size_t *len)
{
    const char *s = kv_tokenizer_decode(t, prev, tok, len);
    if (*len == 1 && !(s[0] >= 32 && s[0] < 127) && s[0] != '\n' && s[0] != '\t' && s[0] != '\r' &&
        !((unsigned char)s[0] & 0x80))
        *len = 0;
    return s;
}

void kv_token_write(kv_token_writer *w, int token)
{
    if (w->tok) {
        size_t l;
        const char *s = kv_token_piece(w->tok, w->prev, token, &l);
        fwrite(s, 1, l, w->out);
    } else {
        fprintf(w->out, "%d ", token);
    }
    w->prev = token;
}

kv_status kv_tokens_text(const kv_tokenizer *t, int prev, const int *ids, int n, char **text)
{
    size_t cap = 64, len = 0;
    char *buf = malloc(cap);
    for (int i = 0; buf && i < n; i++) {
        size_t l;
        const char *s = kv_token_piece(t, i ? ids[i - 1] : prev, ids[i], &l);
        if (len + l + 1 > cap) {
            while (len + l + 1 > cap) cap *= 2;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
        }
        memcpy(buf + len, s, l);
        len += l;
    }
    *text = buf;
    if (!buf) return kv_fail(KV_E_NOMEM, "out of memory for the text");
    buf[len] = 0;
    return KV_OK;
}

/* BOS and n - 1 ids of llama2.c's xorshift stream (kept so that a seed
 * gives the same benchmark prompt as before). */
static kv_status random_ids(int n, int vocab, int bos, uint64_t seed, int *ids)
{
    uint64_t s = seed * 2654435761u + 1;
    for (int i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        ids[i] = i == 0 ? bos : (int)(s % (uint64_t)vocab);
    }
    return KV_OK;
}

static kv_status prompt_text(kv_prompt *p, const kv_tokenizer *tok, int **ids, int *n)
{
    const char *why;
    if (!tok)
        return kv_fail(KV_E_NOINPUT, "no tokenizer for text input (give --tokenizer, or token ids with --tokens)");
    if (!kv_tokenizer_can_encode(tok, &why))
        return kv_fail(KV_E_UNSUPPORTED,
                       "text tokenization is not supported for the '%s' vocabulary; pass token ids with --tokens", why);
    kv_status st = kv_chat_resolve(&p->chat, tok, NULL);
    if (st) return st;
    /* a continuation (kv-run --kv) has no BOS and no chat wrapper: it follows a cached prompt */
    if (p->chat.kind != KV_CHAT_NONE && !p->continuation)
        return kv_chat_encode(tok, &p->chat, NULL, p->text, p->text_len, p->special, ids, n);
    kv_encode_opts eo = {kv_tokenizer_add_bos(tok) && !p->continuation, kv_tokenizer_add_eos(tok) && !p->continuation,
                         p->special};
    return kv_tokenizer_encode_ex(tok, p->text, p->text_len, &eo, ids, n);
}

kv_status kv_prompt_tokens(kv_prompt *p, const kv_tokenizer *tok, int vocab, int **ids, int *n)
{
    *ids = NULL;
    *n = 0;
    const int bos = tok ? kv_tokenizer_bos(tok) : 1;
    kv_status st;
    if (p->path) {
        char *buf;
        size_t len;
        if ((st = kv_file_slurp(p->path, 0, "file", &buf, &len))) return st;
        kv_prompt q = *p;
        q.path = NULL;
        if (p->path_ids) q.ids = buf, q.ids_len = len;
        else q.text = buf, q.text_len = len;
        st = kv_prompt_tokens(&q, tok, vocab, ids, n);
        p->chat = q.chat;
        free(buf);
        return st;
    }
    if (p->ids) {
        st = kv_tokens_parse(p->ids, p->ids_len, ids, n);
    } else if (p->text) {
        st = prompt_text(p, tok, ids, n);
    } else {
        int len = p->random > 0 ? p->random : 1;
        *ids = malloc((size_t)len * sizeof **ids);
        if (!*ids) return kv_fail(KV_E_NOMEM, "out of memory");
        random_ids(len, vocab, bos, p->seed, *ids);
        *n = len;
        st = KV_OK;
    }
    if (st) return st;
    if (*n < 1) st = kv_fail(KV_E_DATA, "the prompt has no tokens");
    for (int i = 0; !st && i < *n; i++)
        if ((*ids)[i] < 0 || (*ids)[i] >= vocab)
            st = kv_fail(KV_E_DATA, "token %d (#%d) outside the vocabulary of %d", (*ids)[i], i, vocab);
    if (st) {
        free(*ids);
        *ids = NULL;
        *n = 0;
    }
    return st;
}

kv_status kv_prompt_json(const char *model_path, const char *tok_path, kv_prompt *p, char **json)
{
    *json = NULL;
    kv_tokenizer *tok = NULL;
    int *ids = NULL, n = 0;
    kv_status st = kv_tokenizer_for_file(model_path, tok_path, &tok);
    if (!st) st = kv_prompt_tokens(p, tok, kv_tokenizer_vocab(tok), &ids, &n);
    if (!st) st = kv_tokens_json(ids, n, json);
    free(ids);
    kv_tokenizer_free(tok);
    return st;
}
