/*
 * kv_tokenizer: llama2.c, SentencePiece-llama and (with kv_bpe.c) GPT-2
 * style byte-level BPE tokenizers (see kv_tokenizer.h).  The vocabulary
 * lives in one blob with a hash table from piece to id.  Text is first cut
 * at special tokens (user-defined ones always, control ones when asked),
 * longest first, as llama.cpp does; each raw fragment then goes through
 * the vocabulary's own algorithm.  Encoding keeps the symbols in a doubly linked list and the
 * candidate merges in a max-heap ordered by (score, leftmost), validating a
 * popped merge against per-symbol versions, so a 4096-token prompt takes
 * O(n log n) rather than llama2.c's O(n^2) rescans, with the same result.
 */
#include "model/kv_tokenizer.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "format/kv_gguf.h"
#include "common/kv_file.h"
#include "model/kv_tokenizer_int.h"

static uint64_t fnv(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

int kv_tok_lookup(const kv_tokenizer *t, const char *s, size_t n)
{
    uint32_t mask = t->nslots - 1;
    for (uint32_t i = (uint32_t)fnv(s, n) & mask;; i = (i + 1) & mask) {
        int32_t id = t->slots[i];
        if (id < 0) return -1;
        if (t->len[id] == n && !memcmp(t->blob + t->off[id], s, n)) return id;
    }
}

static int parse_byte_piece(const char *p, size_t n)
{
    if (n != 6 || memcmp(p, "<0x", 3) || p[5] != '>' || !isxdigit((unsigned char)p[3]) ||
        !isxdigit((unsigned char)p[4]))
        return -1;
    char h[3] = {p[3], p[4], 0};
    return (int)strtol(h, NULL, 16);
}

/* Build the hash table, byte table and decoded pieces once pieces are in. */
static kv_status finish(kv_tokenizer *t)
{
    t->nslots = 1;
    while (t->nslots < 2u * (uint32_t)t->n) t->nslots <<= 1;
    t->slots = malloc(t->nslots * sizeof *t->slots);
    t->doff = malloc((size_t)t->n * sizeof *t->doff);
    t->dlen = malloc((size_t)t->n * sizeof *t->dlen);
    size_t blob_len = t->n ? t->off[t->n - 1] + t->len[t->n - 1] + 1 : 1;
    t->dblob = malloc(blob_len + (size_t)t->n + 1);
    if (!t->slots || !t->doff || !t->dlen || !t->dblob)
        return kv_fail(KV_E_NOMEM, "out of memory for a %d-token vocabulary", t->n);
    memset(t->slots, 0xff, t->nslots * sizeof *t->slots);
    for (int b = 0; b < 256; b++) t->byte_id[b] = -1;
    uint32_t mask = t->nslots - 1;
    size_t dp = 0;
    for (int id = 0; id < t->n; id++) {
        const char *p = t->blob + t->off[id];
        size_t n = t->len[id];
        /* later duplicates win, as in llama.cpp's text-to-token map */
        uint32_t i = (uint32_t)fnv(p, n) & mask;
        while (t->slots[i] >= 0 && !(t->len[t->slots[i]] == n && !memcmp(t->blob + t->off[t->slots[i]], p, n)))
            i = (i + 1) & mask;
        t->slots[i] = id;
        int bv = parse_byte_piece(p, n);
        if (bv >= 0 && (t->type[id] == TT_BYTE || t->kind == TK_LLAMA2C)) {
            t->type[id] = TT_BYTE;
            if (t->byte_id[bv] < 0) t->byte_id[bv] = id;
        }
        /* decoded text */
        t->doff[id] = (uint32_t)dp;
        char *d = t->dblob + dp;
        size_t dn = 0;
        if (t->type[id] == TT_BYTE) {
            d[dn++] = (char)bv;
        } else if ((t->type[id] == TT_CONTROL || t->type[id] == TT_UNKNOWN) && t->kind != TK_LLAMA2C &&
                   (t->kind == TK_BPE || t->type[id] == TT_CONTROL)) {
            /* control tokens (<s>, </s>, <|eot_id|>) print as nothing */
        } else if (t->kind == TK_BPE && t->type[id] != TT_USER) {
            dn = kv_bpe_piece_bytes(p, n, d);
        } else if (t->kind == TK_SPM) {
            for (size_t k = 0; k < n; k++) {
                if (k + 2 < n && (uint8_t)p[k] == 0xE2 && (uint8_t)p[k + 1] == 0x96 &&
                    (uint8_t)p[k + 2] == 0x81) {
                    d[dn++] = ' ';
                    k += 2;
                } else {
                    d[dn++] = p[k];
                }
            }
        } else {
            memcpy(d, p, n);
            dn = n;
        }
        d[dn] = 0;
        t->dlen[id] = (uint32_t)dn;
        dp += dn + 1;
    }
    /* tokens recognised in text: user-defined always, control and unknown
     * with special parsing; longest first, as llama.cpp partitions */
    t->max_piece = 0;
    for (int id = 0; id < t->n; id++)
        if (t->len[id] > t->max_piece) t->max_piece = t->len[id];
    t->special = malloc((size_t)(t->n ? t->n : 1) * sizeof *t->special);
    if (!t->special) return kv_fail(KV_E_NOMEM, "out of memory for a %d-token vocabulary", t->n);
    t->n_special = 0;
    for (int id = 0; id < t->n; id++)
        if ((t->type[id] == TT_CONTROL || t->type[id] == TT_USER || t->type[id] == TT_UNKNOWN) && t->len[id] > 0)
            t->special[t->n_special++] = id;
    /* insertion sort by decreasing length, stable: a few hundred entries */
    for (int i = 1; i < t->n_special; i++) {
        int32_t v = t->special[i];
        int j = i;
        while (j > 0 && t->len[t->special[j - 1]] < t->len[v]) {
            t->special[j] = t->special[j - 1];
            j--;
        }
        t->special[j] = v;
    }
    return KV_OK;
}

static kv_tokenizer *tok_alloc(int n)
{
    kv_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->n = n;
    t->off = malloc((size_t)(n ? n : 1) * sizeof *t->off);
    t->len = malloc((size_t)(n ? n : 1) * sizeof *t->len);
    t->score = malloc((size_t)(n ? n : 1) * sizeof *t->score);
    t->type = malloc((size_t)(n ? n : 1));
    if (!t->off || !t->len || !t->score || !t->type) {
        kv_tokenizer_free(t);
        return NULL;
    }
    t->bos = 1;
    t->eos = 2;
    t->unk = 0;
    t->add_bos = true;
    t->pre = PRE_DEFAULT;
    return t;
}

void kv_tokenizer_free(kv_tokenizer *t)
{
    if (!t) return;
    free(t->blob);
    free(t->off);
    free(t->len);
    free(t->score);
    free(t->type);
    free(t->dblob);
    free(t->doff);
    free(t->dlen);
    free(t->slots);
    free(t->special);
    free(t->chat_template);
    free(t->merges);
    free(t);
}

// --- loaders -------------------------------------------------------------------

kv_status kv_tokenizer_load_llama2c_mem(const void *buf, size_t blen, int vocab_size,
                                        kv_tokenizer **out)
{
    *out = NULL;
    const uint8_t *p = buf;
    if (vocab_size <= 0 || vocab_size > (1 << 24))
        return kv_fail(KV_E_DATA, "tokenizer: bad vocabulary size %d", vocab_size);
    if (blen < 4) return kv_fail(KV_E_DATA, "tokenizer file truncated in its header");
    /* first pass: sizes */
    size_t pos = 4, total = 0;
    for (int i = 0; i < vocab_size; i++) {
        int32_t l;
        if (blen - pos < 8)
            return kv_fail(KV_E_DATA, "tokenizer file truncated at token %d of %d", i, vocab_size);
        memcpy(&l, p + pos + 4, 4);
        if (l < 0 || (size_t)l > blen - pos - 8)
            return kv_fail(KV_E_DATA, "tokenizer token %d has a bad length %d", i, l);
        pos += 8 + (size_t)l;
        total += (size_t)l + 1;
    }
    if (pos != blen)
        return kv_fail(KV_E_DATA, "tokenizer file has %zu bytes after its %d tokens (wrong model?)",
                       blen - pos, vocab_size);
    kv_tokenizer *t = tok_alloc(vocab_size);
    if (!t || !(t->blob = malloc(total ? total : 1))) {
        kv_tokenizer_free(t);
        return kv_fail(KV_E_NOMEM, "out of memory for the tokenizer");
    }
    t->kind = TK_LLAMA2C;
    snprintf(t->kind_name, sizeof t->kind_name, "llama2c");
    pos = 4;
    size_t bp = 0;
    for (int i = 0; i < vocab_size; i++) {
        int32_t l;
        memcpy(&t->score[i], p + pos, 4);
        memcpy(&l, p + pos + 4, 4);
        memcpy(t->blob + bp, p + pos + 8, (size_t)l);
        t->blob[bp + (size_t)l] = 0;
        t->off[i] = (uint32_t)bp;
        t->len[i] = (uint32_t)l;
        t->type[i] = i < 3 ? TT_CONTROL : TT_NORMAL;
        bp += (size_t)l + 1;
        pos += 8 + (size_t)l;
    }
    t->add_space_prefix = true;
    kv_status st = finish(t);
    if (st) {
        kv_tokenizer_free(t);
        return st;
    }
    *out = t;
    return KV_OK;
}

kv_status kv_tokenizer_load_llama2c(const char *path, int vocab_size, kv_tokenizer **out)
{
    *out = NULL;
    char *buf;
    size_t n;
    /* A llama2.c vocabulary of any real size is a few MB; 1 GiB is absurd. */
    kv_status rst = kv_file_slurp(path, (size_t)1 << 30, "tokenizer", &buf, &n);
    if (rst) return rst;
    kv_status st = kv_tokenizer_load_llama2c_mem(buf, n, vocab_size, out);
    free(buf);
    if (st) kv_errcontext("%s", path);
    return st;
}

kv_status kv_tokenizer_from_gguf(const kv_gguf *g, kv_tokenizer **out)
{
    *out = NULL;
    char model[32] = "";
    kv_status st = KV_OK;
    if (!kv_gguf_get_str(g, "tokenizer.ggml.model", model, sizeof model, &st))
        return st ? st : kv_fail(KV_E_DATA, "GGUF has no tokenizer.ggml.model (no vocabulary)");
    const kv_gguf_kv *toks = kv_gguf_find(g, "tokenizer.ggml.tokens");
    if (!toks || toks->type != KV_GGUF_ARRAY || toks->arr_type != KV_GGUF_STRING)
        return kv_fail(KV_E_DATA, "GGUF tokenizer.ggml.tokens is missing or not a string array");
    if (toks->arr_n == 0 || toks->arr_n > (1u << 24))
        return kv_fail(KV_E_DATA, "GGUF vocabulary of %llu tokens", (unsigned long long)toks->arr_n);
    int n = (int)toks->arr_n;
    const kv_gguf_kv *scores = kv_gguf_find(g, "tokenizer.ggml.scores");
    const kv_gguf_kv *types = kv_gguf_find(g, "tokenizer.ggml.token_type");
    if (scores && (scores->type != KV_GGUF_ARRAY || scores->arr_n != toks->arr_n ||
                   scores->arr_type == KV_GGUF_STRING || scores->arr_type == KV_GGUF_ARRAY))
        return kv_fail(KV_E_DATA, "GGUF tokenizer.ggml.scores does not match the tokens");
    if (types && (types->type != KV_GGUF_ARRAY || types->arr_n != toks->arr_n ||
                  types->arr_type == KV_GGUF_STRING || types->arr_type == KV_GGUF_ARRAY))
        return kv_fail(KV_E_DATA, "GGUF tokenizer.ggml.token_type does not match the tokens");
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        size_t l;
        kv_gguf_arr_str(toks, (uint64_t)i, &l);
        if (l > (1u << 20)) return kv_fail(KV_E_DATA, "GGUF token %d is %zu bytes long", i, l);
        total += l + 1;
    }
    if (total > 0xffffffffu) return kv_fail(KV_E_DATA, "GGUF vocabulary too large");
    kv_tokenizer *t = tok_alloc(n);
    if (!t || !(t->blob = malloc(total))) {
        kv_tokenizer_free(t);
        return kv_fail(KV_E_NOMEM, "out of memory for the tokenizer");
    }
    t->kind = !strcmp(model, "llama") ? TK_SPM : !strcmp(model, "gpt2") ? TK_BPE : TK_OTHER;
    snprintf(t->kind_name, sizeof t->kind_name, "%s", !strcmp(model, "llama") ? "spm" : model);
    size_t bp = 0;
    for (int i = 0; i < n; i++) {
        size_t l;
        const char *s = kv_gguf_arr_str(toks, (uint64_t)i, &l);
        memcpy(t->blob + bp, s, l);
        t->blob[bp + l] = 0;
        t->off[i] = (uint32_t)bp;
        t->len[i] = (uint32_t)l;
        bp += l + 1;
        t->score[i] = scores ? (float)kv_gguf_arr_num(scores, (uint64_t)i) : 0.0f;
        double ty = types ? kv_gguf_arr_num(types, (uint64_t)i) : TT_NORMAL;
        t->type[i] = ty >= 1 && ty <= 6 ? (uint8_t)ty : TT_NORMAL;
    }
    int64_t v;
    if (kv_gguf_get_int(g, "tokenizer.ggml.bos_token_id", &v, NULL) && v >= 0 && v < n) t->bos = (int)v;
    if (kv_gguf_get_int(g, "tokenizer.ggml.eos_token_id", &v, NULL) && v >= 0 && v < n) t->eos = (int)v;
    if (kv_gguf_get_int(g, "tokenizer.ggml.unknown_token_id", &v, NULL) && v >= 0 && v < n) t->unk = (int)v;
    if (t->bos >= n) t->bos = 0;
    if (t->eos >= n) t->eos = 0;
    /* llama.cpp's defaults: SentencePiece prefixes a space and adds BOS;
     * BPE does neither unless its pre-tokenizer says so (kv_bpe_load) */
    t->add_space_prefix = t->kind != TK_BPE;
    t->add_bos = t->kind != TK_BPE;
    t->add_eos = false;
    const kv_gguf_kv *asp = kv_gguf_find(g, "tokenizer.ggml.add_space_prefix");
    if (asp && asp->type == KV_GGUF_BOOL) t->add_space_prefix = asp->num.u != 0;
    kv_gguf_get_str(g, "general.architecture", t->arch, sizeof t->arch, NULL);
    const kv_gguf_kv *ct = kv_gguf_find(g, "tokenizer.chat_template");
    if (ct && ct->type == KV_GGUF_STRING && ct->str_len < (1u << 20)) {
        t->chat_template = malloc(ct->str_len + 1);
        if (t->chat_template) {
            memcpy(t->chat_template, ct->str, ct->str_len);
            t->chat_template[ct->str_len] = 0;
        }
    }
    if ((st = finish(t)) || (t->kind == TK_BPE && (st = kv_bpe_load(t, g)))) {
        kv_tokenizer_free(t);
        return st;
    }
    const kv_gguf_kv *ab = kv_gguf_find(g, "tokenizer.ggml.add_bos_token");
    if (ab && ab->type == KV_GGUF_BOOL) t->add_bos = ab->num.u != 0;
    const kv_gguf_kv *ae = kv_gguf_find(g, "tokenizer.ggml.add_eos_token");
    if (ae && ae->type == KV_GGUF_BOOL) t->add_eos = ae->num.u != 0;
    *out = t;
    return KV_OK;
}

// --- encoding ------------------------------------------------------------------

typedef struct {
    const char *s; /* text of the symbol (into the input or a vocab piece) */
    int n;         /* bytes; 0 once merged away */
    int id;        /* vocabulary id, or -1 (SPM: char not in the vocabulary) */
    int prev, next;
    unsigned ver;
} sym;

typedef struct {
    float score;
    int left, right, id;
    unsigned vl, vr;
} bigram;

static bool bg_before(const bigram *a, const bigram *b) /* a pops before b */
{
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

typedef struct {
    bigram *h;
    size_t n, cap;
} heap;

static bool heap_push(heap *q, bigram b)
{
    if (q->n == q->cap) {
        size_t nc = q->cap ? q->cap * 2 : 64;
        bigram *nh = realloc(q->h, nc * sizeof *nh);
        if (!nh) return false;
        q->h = nh;
        q->cap = nc;
    }
    size_t i = q->n++;
    while (i > 0 && bg_before(&b, &q->h[(i - 1) / 2])) {
        q->h[i] = q->h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    q->h[i] = b;
    return true;
}

static bigram heap_pop(heap *q)
{
    bigram top = q->h[0], last = q->h[--q->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= q->n) break;
        if (c + 1 < q->n && bg_before(&q->h[c + 1], &q->h[c])) c++;
        if (!bg_before(&q->h[c], &last)) break;
        q->h[i] = q->h[c];
        i = c;
    }
    if (q->n) q->h[i] = last;
    return top;
}

static bool try_bigram(const kv_tokenizer *t, sym *S, int l, int r, heap *q, char *tmp)
{
    if (l < 0 || r < 0) return true;
    size_t n = (size_t)S[l].n + (size_t)S[r].n;
    const char *s;
    if (S[l].s + S[l].n == S[r].s) {
        s = S[l].s;
    } else {
        memcpy(tmp, S[l].s, (size_t)S[l].n);
        memcpy(tmp + S[l].n, S[r].s, (size_t)S[r].n);
        s = tmp;
    }
    int id = kv_tok_lookup(t, s, n);
    if (id < 0) return true;
    return heap_push(q, (bigram){t->score[id], l, r, id, S[l].ver, S[r].ver});
}

static int utf8_len(uint8_t c)
{
    if (c < 0x80) return 1;
    if ((c & 0xE0) == 0xC0) return 2;
    if ((c & 0xF0) == 0xE0) return 3;
    if ((c & 0xF8) == 0xF0) return 4;
    return 1;
}

bool kv_tokenizer_can_encode(const kv_tokenizer *t, const char **why)
{
    if (t->kind == TK_OTHER) {
        if (why) *why = t->kind_name;
        return false;
    }
    return true;
}

bool kv_idvec_push(kv_idvec *v, int id)
{
    if (v->n == v->cap) {
        size_t nc = v->cap ? 2 * v->cap : 64;
        int *nv = realloc(v->v, nc * sizeof *nv);
        if (!nv) return false;
        v->v = nv, v->cap = nc;
    }
    v->v[v->n++] = id;
    return true;
}

/* SentencePiece / llama2.c merging of one fragment; prefix: give it the
 * dummy-prefix space (the start of the text, or after a special token). */
static kv_status spm_encode(const kv_tokenizer *t, const char *text, size_t len, bool prefix, kv_idvec *out)
{
    /* SPM: prefix and escape spaces into a working copy */
    char *work = NULL;
    const char *src = text;
    size_t n = len;
    if (t->kind == TK_SPM) {
        work = malloc(3 * (len + 1) + 1);
        if (!work) return kv_fail(KV_E_NOMEM, "out of memory");
        size_t w = 0;
        if (len > 0 && prefix && t->add_space_prefix) {
            memcpy(work, "\xE2\x96\x81", 3);
            w = 3;
        }
        for (size_t i = 0; i < len; i++) {
            if (text[i] == ' ') {
                memcpy(work + w, "\xE2\x96\x81", 3);
                w += 3;
            } else {
                work[w++] = text[i];
            }
        }
        src = work;
        n = w;
    }
    size_t maxsym = n + 2;
    sym *S = malloc(maxsym * sizeof *S);
    char *tmp = malloc(2 * (size_t)t->max_piece + 16);
    heap q = {0};
    kv_status st = KV_OK;
    if (!S || !tmp) {
        st = kv_fail(KV_E_NOMEM, "out of memory");
        goto done;
    }
    int ns = 0;
    if (t->kind == TK_LLAMA2C) {
        int sp = len > 0 && prefix ? kv_tok_lookup(t, " ", 1) : -1;
        if (sp >= 0) S[ns++] = (sym){t->blob + t->off[sp], (int)t->len[sp], sp, 0, 0, 0};
        /* codepoints as in llama2.c: a lead byte plus up to 3 continuation bytes */
        size_t i = 0;
        while (i < n) {
            size_t j = i + 1;
            while (j < n && ((uint8_t)src[j] & 0xC0) == 0x80 && j - i < 4) j++;
            int id = kv_tok_lookup(t, src + i, j - i);
            if (id >= 0) {
                S[ns++] = (sym){t->blob + t->off[id], (int)t->len[id], id, 0, 0, 0};
            } else {
                for (size_t k = i; k < j; k++) {
                    uint8_t b = (uint8_t)src[k];
                    int bid = t->byte_id[b] >= 0 ? t->byte_id[b] : (b + 3 < t->n ? b + 3 : t->unk);
                    if ((size_t)ns >= maxsym) break;
                    S[ns++] = (sym){t->blob + t->off[bid], (int)t->len[bid], bid, 0, 0, 0};
                }
            }
            i = j;
        }
    } else {
        size_t i = 0;
        while (i < n) {
            size_t l = (size_t)utf8_len((uint8_t)src[i]);
            if (l > n - i) l = n - i;
            S[ns++] = (sym){src + i, (int)l, kv_tok_lookup(t, src + i, l), 0, 0, 0};
            i += l;
        }
    }
    for (int i = 0; i < ns; i++) {
        S[i].prev = i - 1;
        S[i].next = i + 1 < ns ? i + 1 : -1;
    }
    for (int i = 0; i + 1 < ns; i++)
        if (!try_bigram(t, S, i, i + 1, &q, tmp)) goto oom;
    while (q.n) {
        bigram b = heap_pop(&q);
        sym *L = &S[b.left], *R = &S[b.right];
        if (L->n == 0 || R->n == 0 || L->ver != b.vl || R->ver != b.vr || L->next != b.right) continue;
        L->s = t->blob + t->off[b.id];
        L->n = (int)t->len[b.id];
        L->id = b.id;
        L->ver++;
        R->n = 0;
        R->ver++;
        L->next = R->next;
        if (R->next >= 0) S[R->next].prev = b.left;
        if (!try_bigram(t, S, L->prev, b.left, &q, tmp) || !try_bigram(t, S, b.left, L->next, &q, tmp)) goto oom;
    }
    for (int i = ns ? 0 : -1; i >= 0; i = S[i].next) {
        if (S[i].n == 0) continue;
        if (S[i].id >= 0) {
            if (!kv_idvec_push(out, S[i].id)) goto oom;
        } else {
            for (int k = 0; k < S[i].n; k++) {
                int bid = t->byte_id[(uint8_t)S[i].s[k]];
                if (!kv_idvec_push(out, bid >= 0 ? bid : t->unk)) goto oom;
            }
        }
    }
    goto done;
oom:
    st = kv_fail(KV_E_NOMEM, "out of memory");
done:
    free(q.h);
    free(tmp);
    free(S);
    free(work);
    return st;
}

/* One fragment of raw text through the vocabulary's own algorithm. */
static kv_status encode_fragment(const kv_tokenizer *t, const char *text, size_t len, bool prefix, kv_idvec *out)
{
    if (len == 0) return KV_OK;
    return t->kind == TK_BPE ? kv_bpe_encode(t, text, len, out) : spm_encode(t, text, len, prefix, out);
}

kv_status kv_tokenizer_encode_ex(const kv_tokenizer *t, const char *text, size_t len, const kv_encode_opts *o,
                                 int **ids, int *n_out)
{
    *ids = NULL;
    *n_out = 0;
    if (t->kind == TK_OTHER)
        return kv_fail(KV_E_UNSUPPORTED,
                       "text tokenization is not supported for the '%s' vocabulary; pass token ids with --tokens",
                       t->kind_name);
    if (len > (1u << 28)) return kv_fail(KV_E_USAGE, "text of %zu bytes is too long", len);
    kv_idvec out = {0};
    kv_status st = KV_OK;
    if (o->bos && !kv_idvec_push(&out, t->bos)) goto oom;
    /* Special tokens split the text first (llama.cpp's partition): for each
     * one, longest first, every occurrence in the remaining raw fragments.
     * Fragments are (start, length, token) with token -1 for raw text. */
    typedef struct { size_t a, n; int tok; } frag;
    size_t nf = 1, capf = 16;
    frag *F = malloc(capf * sizeof *F);
    if (!F) goto oom;
    F[0] = (frag){0, len, -1};
    for (int si = 0; si < t->n_special; si++) {
        int id = t->special[si];
        if (!o->special && t->type[id] != TT_USER) continue;
        const char *pat = t->blob + t->off[id];
        size_t pl = t->len[id];
        for (size_t f = 0; f < nf; f++) {
            if (F[f].tok >= 0 || F[f].n < pl) continue;
            const char *hit = memmem(text + F[f].a, F[f].n, pat, pl);
            if (!hit) continue;
            size_t at = (size_t)(hit - text);
            /* [a, at) raw, the token, [at + pl, a + n) raw (scanned next) */
            if (nf + 2 > capf) {
                capf = 2 * capf + 2;
                frag *nF = realloc(F, capf * sizeof *F);
                if (!nF) {
                    free(F);
                    goto oom;
                }
                F = nF;
            }
            frag rest = {at + pl, F[f].a + F[f].n - at - pl, -1};
            memmove(&F[f + 3], &F[f + 1], (nf - f - 1) * sizeof *F);
            F[f + 1] = (frag){at, pl, id};
            F[f + 2] = rest;
            F[f].n = at - F[f].a;
            nf += 2;
            f++; /* continue with the rest */
        }
    }
    bool prev_special = true; /* SentencePiece prefixes a space after a special token */
    for (size_t f = 0; f < nf && !st; f++) {
        if (F[f].tok >= 0) {
            if (!kv_idvec_push(&out, F[f].tok)) st = kv_fail(KV_E_NOMEM, "out of memory");
            prev_special = true;
        } else if (F[f].n) {
            st = encode_fragment(t, text + F[f].a, F[f].n, prev_special, &out);
            prev_special = false;
        }
    }
    free(F);
    if (st) {
        free(out.v);
        return st;
    }
    if (o->eos && !kv_idvec_push(&out, t->eos)) goto oom;
    if (!out.v && !(out.v = malloc(sizeof *out.v))) goto oom; /* an empty list is still a buffer */
    if (out.n > INT32_MAX) {
        free(out.v);
        return kv_fail(KV_E_USAGE, "text makes more than 2^31 tokens");
    }
    *ids = out.v;
    *n_out = (int)out.n;
    return KV_OK;
oom:
    free(out.v);
    return kv_fail(KV_E_NOMEM, "out of memory");
}

kv_status kv_tokenizer_encode(const kv_tokenizer *t, const char *text, size_t len, bool bos,
                              bool eos, int **ids, int *n_out)
{
    kv_encode_opts o = {bos, eos, false};
    return kv_tokenizer_encode_ex(t, text, len, &o, ids, n_out);
}

const char *kv_tokenizer_decode(const kv_tokenizer *t, int prev, int tok, size_t *len)
{
    if (tok < 0 || tok >= t->n) {
        *len = 0;
        return "";
    }
    const char *d = t->dblob + t->doff[tok];
    size_t n = t->dlen[tok];
    if (prev == t->bos && t->add_space_prefix && n > 0 && d[0] == ' ' && t->type[tok] != TT_BYTE) {
        d++;
        n--;
    }
    *len = n;
    return d;
}

int kv_tokenizer_vocab(const kv_tokenizer *t) { return t->n; }
int kv_tokenizer_bos(const kv_tokenizer *t) { return t->bos; }
int kv_tokenizer_eos(const kv_tokenizer *t) { return t->eos; }
const char *kv_tokenizer_kind(const kv_tokenizer *t) { return t->kind_name; }
bool kv_tokenizer_add_bos(const kv_tokenizer *t) { return t->add_bos; }
bool kv_tokenizer_add_eos(const kv_tokenizer *t) { return t->add_eos; }
const char *kv_tokenizer_pre(const kv_tokenizer *t) { return t->pre_name; }
const char *kv_tokenizer_chat_template(const kv_tokenizer *t) { return t->chat_template; }
const char *kv_tokenizer_arch(const kv_tokenizer *t) { return t->arch; }

const char *kv_tokenizer_piece(const kv_tokenizer *t, int id, size_t *len)
{
    if (id < 0 || id >= t->n) {
        *len = 0;
        return NULL;
    }
    *len = t->len[id];
    return t->blob + t->off[id];
}

float kv_tokenizer_score(const kv_tokenizer *t, int id) { return id >= 0 && id < t->n ? t->score[id] : 0.0f; }
int kv_tokenizer_token_type(const kv_tokenizer *t, int id) { return id >= 0 && id < t->n ? t->type[id] : 0; }

int kv_tokenizer_piece_id(const kv_tokenizer *t, const char *piece)
{
    return kv_tok_lookup(t, piece, strlen(piece));
}

bool kv_tokenizer_is_eog(const kv_tokenizer *t, int id)
{
    if (id < 0 || id >= t->n) return false;
    if (id == t->eos) return true;
    /* end-of-turn tokens by their text, as llama.cpp recognises them */
    static const char *const eog[] = {"<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>",
                                      "<|eom_id|>", "<end_of_turn>", "<|end|>", NULL};
    if (t->type[id] != TT_CONTROL && t->type[id] != TT_USER) return false;
    for (int i = 0; eog[i]; i++)
        if (t->len[id] == strlen(eog[i]) && !memcmp(t->blob + t->off[id], eog[i], t->len[id])) return true;
    return false;
}

kv_status kv_tokenizer_load_gguf(const char *path, kv_tokenizer **out)
{
    *out = NULL;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return kv_fail(KV_E_NOINPUT, "cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode) || sb.st_size == 0) {
        close(fd);
        return kv_fail(sb.st_size == 0 ? KV_E_DATA : KV_E_NOINPUT, "%s is not a non-empty regular file", path);
    }
    size_t n = (size_t)sb.st_size;
    void *map = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return kv_fail(KV_E_IO, "cannot map %s: %s", path, strerror(errno));
    kv_gguf *g = NULL;
    kv_status st = n >= 4 && !memcmp(map, "GGUF", 4) ? kv_gguf_parse(map, n, &g)
                                                     : kv_fail(KV_E_DATA, "not a GGUF file (bad magic)");
    if (!st) st = kv_tokenizer_from_gguf(g, out); /* copies everything it keeps */
    kv_gguf_free(g);
    munmap(map, n);
    if (st) kv_errcontext("%s", path);
    return st;
}

// --- token id lists ------------------------------------------------------------

