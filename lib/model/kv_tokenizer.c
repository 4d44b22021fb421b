/*
 * kv_tokenizer: llama2.c and SentencePiece-llama tokenizers (see
 * kv_tokenizer.h).  The vocabulary lives in one blob with a hash table from
 * piece to id.  Encoding keeps the symbols in a doubly linked list and the
 * candidate merges in a max-heap ordered by (score, leftmost), validating a
 * popped merge against per-symbol versions, so a 4096-token prompt takes
 * O(n log n) rather than llama2.c's O(n^2) rescans, with the same result.
 */
#include "model/kv_tokenizer.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "format/kv_gguf.h"
#include "common/kv_file.h"

enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER = 4, TT_UNUSED = 5, TT_BYTE = 6 };
typedef enum { TK_LLAMA2C, TK_SPM, TK_OTHER } tok_kind;

struct kv_tokenizer {
    tok_kind kind;
    char kind_name[32];
    int n;              /* vocabulary size */
    char *blob;         /* pieces, each NUL-terminated */
    uint32_t *off;      /* (n) piece offsets into blob */
    uint32_t *len;      /* (n) piece lengths */
    float *score;       /* (n) */
    uint8_t *type;      /* (n) TT_* */
    char *dblob;        /* decoded pieces, NUL-terminated */
    uint32_t *doff, *dlen; /* (n) */
    int32_t *slots;     /* hash table of ids, -1 empty; size nslots (power of two) */
    uint32_t nslots;
    int byte_id[256];   /* id of <0xHH>, or -1 */
    int bos, eos, unk;
    bool add_space_prefix;
};

static uint64_t fnv(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

static int lookup(const kv_tokenizer *t, const char *s, size_t n)
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
        } else if (t->type[id] == TT_CONTROL && t->kind != TK_LLAMA2C) {
            /* control tokens (<s>, </s>) print as nothing */
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
    t->kind = !strcmp(model, "llama") ? TK_SPM : TK_OTHER;
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
    t->add_space_prefix = true;
    const kv_gguf_kv *asp = kv_gguf_find(g, "tokenizer.ggml.add_space_prefix");
    if (asp && asp->type == KV_GGUF_BOOL) t->add_space_prefix = asp->num.u != 0;
    if ((st = finish(t))) {
        kv_tokenizer_free(t);
        return st;
    }
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
    int id = lookup(t, s, n);
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

kv_status kv_tokenizer_encode(const kv_tokenizer *t, const char *text, size_t len, bool bos,
                              bool eos, int **ids, int *n_out)
{
    *ids = NULL;
    *n_out = 0;
    if (t->kind == TK_OTHER)
        return kv_fail(KV_E_UNSUPPORTED,
                       "text tokenization is not supported for the '%s' vocabulary; pass token ids with --tokens",
                       t->kind_name);
    if (len > (1u << 28)) return kv_fail(KV_E_USAGE, "text of %zu bytes is too long", len);
    /* SPM: prefix and escape spaces into a working copy */
    char *work = NULL;
    const char *src = text;
    size_t n = len;
    if (t->kind == TK_SPM) {
        work = malloc(3 * (len + 1) + 1);
        if (!work) return kv_fail(KV_E_NOMEM, "out of memory");
        size_t w = 0;
        if (len > 0 && t->add_space_prefix) {
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
    int *res = malloc((4 * n + 4) * sizeof *res);
    size_t maxpiece = 0;
    for (int i = 0; i < t->n; i++)
        if (t->len[i] > maxpiece) maxpiece = t->len[i];
    char *tmp = malloc(2 * maxpiece + 16);
    heap q = {0};
    kv_status st = KV_OK;
    if (!S || !res || !tmp) {
        st = kv_fail(KV_E_NOMEM, "out of memory");
        goto done;
    }
    int ns = 0;
    if (t->kind == TK_LLAMA2C) {
        int sp = len > 0 ? lookup(t, " ", 1) : -1;
        if (sp >= 0) S[ns++] = (sym){t->blob + t->off[sp], (int)t->len[sp], sp, 0, 0, 0};
        /* codepoints as in llama2.c: a lead byte plus up to 3 continuation bytes */
        size_t i = 0;
        while (i < n) {
            size_t j = i + 1;
            while (j < n && ((uint8_t)src[j] & 0xC0) == 0x80 && j - i < 4) j++;
            int id = lookup(t, src + i, j - i);
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
            S[ns++] = (sym){src + i, (int)l, lookup(t, src + i, l), 0, 0, 0};
            i += l;
        }
    }
    for (int i = 0; i < ns; i++) {
        S[i].prev = i - 1;
        S[i].next = i + 1 < ns ? i + 1 : -1;
    }
    for (int i = 0; i + 1 < ns; i++)
        if (!try_bigram(t, S, i, i + 1, &q, tmp)) {
            st = kv_fail(KV_E_NOMEM, "out of memory");
            goto done;
        }
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
        if (!try_bigram(t, S, L->prev, b.left, &q, tmp) || !try_bigram(t, S, b.left, L->next, &q, tmp)) {
            st = kv_fail(KV_E_NOMEM, "out of memory");
            goto done;
        }
    }
    int nr = 0;
    if (bos) res[nr++] = t->bos;
    for (int i = ns ? 0 : -1; i >= 0; i = S[i].next) {
        if (S[i].n == 0) continue;
        if (S[i].id >= 0) {
            res[nr++] = S[i].id;
        } else {
            for (int k = 0; k < S[i].n; k++) {
                int bid = t->byte_id[(uint8_t)S[i].s[k]];
                res[nr++] = bid >= 0 ? bid : t->unk;
            }
        }
    }
    if (eos) res[nr++] = t->eos;
    *ids = res;
    *n_out = nr;
    res = NULL;
done:
    free(q.h);
    free(tmp);
    free(res);
    free(S);
    free(work);
    return st;
}

const char *kv_tokenizer_decode(const kv_tokenizer *t, int prev, int tok, size_t *len)
{
    if (tok < 0 || tok >= t->n) {
        *len = 0;
        return "";
    }
    const char *d = t->dblob + t->doff[tok];
    size_t n = t->dlen[tok];
    if (prev == t->bos && n > 0 && d[0] == ' ' && t->type[tok] != TT_BYTE) {
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

// --- token id lists ------------------------------------------------------------

