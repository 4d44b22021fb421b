/*
 * kv_chat: Llama-3 and ChatML prompts as token ids (see kv_chat.h).
 *
 *   llama3: <|start_header_id|>ROLE<|end_header_id|>\n\nTEXT<|eot_id|> per
 *           message (TEXT trimmed of surrounding whitespace), then
 *           <|start_header_id|>assistant<|end_header_id|>\n\n
 *   chatml: <|im_start|>ROLE\nTEXT<|im_end|>\n per message, then
 *           <|im_start|>assistant\n
 *   template: the text before {prompt}, TEXT, the text after it (no
 *           token of the template's is placed by id: it is all raw text)
 *
 * A prompt is built as a list of pieces, each either a special token or
 * raw text; adjacent raw pieces are joined and tokenized together.
 */
#include "model/kv_chat.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

static const char *const chat_names[] = {"none", "llama3", "chatml", "auto", "template"};

kv_status kv_chat_parse(const char *spec, kv_chat *out)
{
    *out = (kv_chat){KV_CHAT_NONE, NULL};
    for (int i = 0; i < 4; i++)
        if (!strcmp(spec, chat_names[i])) {
            out->kind = (kv_chat_kind)i;
            return KV_OK;
        }
    if (strstr(spec, "{prompt}")) {
        *out = (kv_chat){KV_CHAT_TEMPLATE, spec};
        return KV_OK;
    }
    return kv_fail(KV_E_USAGE, "unknown chat template '%.64s' (llama3, chatml, auto, none, or a text holding {prompt})",
                   spec);
}

const char *kv_chat_name(kv_chat_kind k)
{
    return (unsigned)k < 5 ? chat_names[k] : "?";
}

kv_status kv_chat_pick_from(const char *tpl, const char *arch, bool has_llama3_tokens, bool has_chatml_tokens,
                            kv_chat_kind *out)
{
    if (tpl && strstr(tpl, "<|start_header_id|>")) *out = KV_CHAT_LLAMA3;
    else if (tpl && strstr(tpl, "<|im_start|>")) *out = KV_CHAT_CHATML;
    else if (has_llama3_tokens) *out = KV_CHAT_LLAMA3;
    else if (has_chatml_tokens || (arch && !strcmp(arch, "qwen2"))) *out = KV_CHAT_CHATML;
    else
        return kv_fail(KV_E_UNSUPPORTED,
                       "no known chat format for this model (its template is %s, its vocabulary has no header "
                       "tokens): give --chat llama3 or --chat chatml",
                       tpl ? "not Llama-3 or ChatML" : "absent");
    return KV_OK;
}

kv_status kv_chat_pick(const kv_tokenizer *t, const char *arch, kv_chat_kind *out)
{
    if (!arch || !*arch) arch = kv_tokenizer_arch(t);
    return kv_chat_pick_from(kv_tokenizer_chat_template(t), arch, kv_tokenizer_piece_id(t, "<|start_header_id|>") >= 0,
                             kv_tokenizer_piece_id(t, "<|im_start|>") >= 0, out);
}

kv_status kv_chat_resolve(kv_chat *c, const kv_tokenizer *t, const char *arch)
{
    return c->kind == KV_CHAT_AUTO ? kv_chat_pick(t, arch, &c->kind) : KV_OK;
}

typedef struct {
    const char *s;
    size_t n;
    int tok; /* -1: raw text */
} piece;

typedef struct {
    piece *p;
    size_t n, cap;
} pieces;

static bool add(pieces *v, const char *s, size_t n, int tok)
{
    if (v->n == v->cap) {
        size_t nc = v->cap ? 2 * v->cap : 16;
        piece *np = realloc(v->p, nc * sizeof *np);
        if (!np) return false;
        v->p = np, v->cap = nc;
    }
    v->p[v->n++] = (piece){s, n, tok};
    return true;
}

static bool add_text(pieces *v, const char *s) { return add(v, s, strlen(s), -1); }

static void trim(const char **s, size_t *n)
{
    while (*n && isspace((unsigned char)**s)) (*s)++, (*n)--;
    while (*n && isspace((unsigned char)(*s)[*n - 1])) (*n)--;
}

/* The turn's pieces; open: stop after the user's text, of which only the
 * first `cut` bytes are taken (kv_chat_split). */
static kv_status build(const kv_tokenizer *t, const kv_chat *c, const char *system, const char *user,
                       size_t user_len, bool special, bool open, size_t cut, int **ids, int *n_out)
{
    *ids = NULL;
    *n_out = 0;
    kv_chat_kind k = c->kind;
    if (k == KV_CHAT_AUTO) {
        kv_status st = kv_chat_pick(t, NULL, &k);
        if (st) return st;
    }
    if (k == KV_CHAT_TEMPLATE && (!c->tmpl || !strstr(c->tmpl, "{prompt}")))
        return kv_fail(KV_E_USAGE, "a chat template needs {prompt} in its text");
    if (k == KV_CHAT_TEMPLATE && system)
        return kv_fail(KV_E_USAGE, "a chat template of one's own takes no system text");
    if (k != KV_CHAT_LLAMA3 && k != KV_CHAT_CHATML && k != KV_CHAT_TEMPLATE)
        return kv_fail(KV_E_USAGE, "no chat template to apply");
    const char *need[3] = {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
    const char *needc[2] = {"<|im_start|>", "<|im_end|>"};
    int tk[3];
    int nneed = k == KV_CHAT_LLAMA3 ? 3 : k == KV_CHAT_CHATML ? 2 : 0;
    for (int i = 0; i < nneed; i++) {
        const char *name = k == KV_CHAT_LLAMA3 ? need[i] : needc[i];
        if ((tk[i] = kv_tokenizer_piece_id(t, name)) < 0)
            return kv_fail(KV_E_UNSUPPORTED, "the %s chat format needs the token %s, which this vocabulary lacks",
                           kv_chat_name(k), name);
    }
    pieces v = {0};
    bool ok = true;
    const char *roles[2] = {"system", "user"};
    const char *texts[2] = {system, user};
    size_t lens[2] = {system ? strlen(system) : 0, user_len};
    if (k == KV_CHAT_TEMPLATE) {
        const char *at = strstr(c->tmpl, "{prompt}");
        ok = add(&v, c->tmpl, (size_t)(at - c->tmpl), -1) && add(&v, user, open ? cut : user_len, -1) &&
             (open || add_text(&v, at + 8));
    }
    for (int m = system ? 0 : 1; k != KV_CHAT_TEMPLATE && m < 2 && ok; m++) {
        const char *s = texts[m];
        size_t n = lens[m];
        const bool last = open && m == 1;
        if (k == KV_CHAT_LLAMA3) {
            trim(&s, &n);
            if (last) { /* the cut, in the trimmed text */
                size_t lead = (size_t)(s - user);
                n = cut <= lead ? 0 : cut - lead < n ? cut - lead : n;
            }
            ok = add(&v, NULL, 0, tk[0]) && add_text(&v, roles[m]) && add(&v, NULL, 0, tk[1]) &&
                 add_text(&v, "\n\n") && add(&v, s, n, -1) && (last || add(&v, NULL, 0, tk[2]));
        } else {
            if (last) n = cut < n ? cut : n;
            ok = add(&v, NULL, 0, tk[0]) && add_text(&v, roles[m]) && add_text(&v, "\n") && add(&v, s, n, -1) &&
                 (last || (add(&v, NULL, 0, tk[1]) && add_text(&v, "\n")));
        }
    }
    if (ok && !open && k == KV_CHAT_LLAMA3)
        ok = add(&v, NULL, 0, tk[0]) && add_text(&v, "assistant") && add(&v, NULL, 0, tk[1]) && add_text(&v, "\n\n");
    else if (ok && !open && k == KV_CHAT_CHATML)
        ok = add(&v, NULL, 0, tk[0]) && add_text(&v, "assistant") && add_text(&v, "\n");
    kv_status st = ok ? KV_OK : kv_fail(KV_E_NOMEM, "out of memory");
    /* tokenize: join raw runs, place template tokens as ids */
    int *out = NULL;
    size_t nout = 0, cap = 0;
    char *buf = NULL;
    size_t blen = 0, bcap = 0;
    bool bos = kv_tokenizer_add_bos(t);
    for (size_t i = 0; i <= v.n && !st; i++) {
        if (i < v.n && v.p[i].tok < 0) { /* collect raw text */
            if (blen + v.p[i].n + 1 > bcap) {
                bcap = 2 * (blen + v.p[i].n) + 64;
                char *nb = realloc(buf, bcap);
                if (!nb) {
                    st = kv_fail(KV_E_NOMEM, "out of memory");
                    break;
                }
                buf = nb;
            }
            if (v.p[i].n) memcpy(buf + blen, v.p[i].s, v.p[i].n);
            blen += v.p[i].n;
            continue;
        }
        int *part = NULL, np = 0;
        if (blen || bos) {
            kv_encode_opts eo = {bos, false, special};
            st = kv_tokenizer_encode_ex(t, buf ? buf : "", blen, &eo, &part, &np);
            bos = false;
            blen = 0;
        }
        if (st) break;
        size_t want = nout + (size_t)np + 1;
        if (want > cap) {
            cap = 2 * want + 16;
            int *no = realloc(out, cap * sizeof *no);
            if (!no) {
                free(part);
                st = kv_fail(KV_E_NOMEM, "out of memory");
                break;
            }
            out = no;
        }
        if (np) memcpy(out + nout, part, (size_t)np * sizeof *out);
        nout += (size_t)np;
        free(part);
        if (i < v.n) out[nout++] = v.p[i].tok;
    }
    free(buf);
    free(v.p);
    if (st) {
        free(out);
        return st;
    }
    *ids = out;
    *n_out = (int)nout;
    return KV_OK;
}

kv_status kv_chat_encode(const kv_tokenizer *t, const kv_chat *c, const char *system, const char *user,
                         size_t user_len, bool special, int **ids, int *n)
{
    return build(t, c, system, user, user_len, special, false, 0, ids, n);
}

kv_status kv_chat_split(const kv_tokenizer *t, const kv_chat *c, const char *system, const char *user,
                        size_t off, bool special, const int *ids, int n, int *split)
{
    int *pre = NULL, npre = 0;
    kv_status st = build(t, c, system, user, off, special, true, off, &pre, &npre);
    if (st) return st;
    int s = 0;
    while (s < npre && s < n && pre[s] == ids[s]) s++;
    free(pre);
    *split = s < 1 ? 1 : s;
    return KV_OK;
}
