/*
 * kv_bpe: byte-level BPE as llama.cpp runs GGUF "gpt2" vocabularies
 * (Llama-3, Qwen2, GPT-2 style).  A fragment of text is
 *   1. split into pre-tokens by the pattern tokenizer.ggml.pre selects,
 *      evaluated on code points by hand-written matchers that follow the
 *      regular expressions alternative by alternative (\p{L}, \p{N}, \s from
 *      kv_ucd);
 *   2. each pre-token's bytes mapped to GPT-2's printable code points, one
 *      token per byte to start with;
 *   3. merged pairwise, always the adjacent pair of lowest merge rank
 *      (leftmost on ties), with a heap of candidate pairs validated by
 *      per-symbol versions - unless the vocabulary says ignore_merges and the
 *      whole pre-token is a token.
 * Merges are kept as (left id, right id) -> (rank, merged id); a merge whose
 * parts or result are not tokens can never fire on token symbols and is
 * dropped at load.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "format/kv_gguf.h"
#include "model/kv_tokenizer_int.h"
#include "model/kv_ucd.h"

// --- GPT-2 byte <-> code point -------------------------------------------------

/* Bytes that are printable Latin-1 map to themselves; the other 68 map to
 * U+0100.. in byte order. */
static bool byte_is_printable(int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; }

static uint32_t byte_cp(int b)
{
    if (byte_is_printable(b)) return (uint32_t)b;
    int k = 0;
    for (int i = 0; i < b; i++) k += !byte_is_printable(i);
    return 256u + (uint32_t)k;
}

/* Inverse of byte_cp, or -1. */
static int cp_byte(uint32_t cp)
{
    if (cp < 256) return byte_is_printable((int)cp) ? (int)cp : -1;
    if (cp >= 256 + 68) return -1;
    int k = (int)(cp - 256);
    for (int b = 0; b < 256; b++)
        if (!byte_is_printable(b) && k-- == 0) return b;
    return -1;
}

size_t kv_bpe_piece_bytes(const char *piece, size_t n, char *out)
{
    uint32_t cps[64];
    size_t w = 0, i = 0;
    while (i < n) { /* decode in chunks so pieces of any length work */
        size_t chunk = n - i < 64 ? n - i : 64;
        while (chunk > 0 && chunk < n - i && ((uint8_t)piece[i + chunk] & 0xC0) == 0x80) chunk--;
        if (chunk == 0) chunk = n - i < 64 ? n - i : 64;
        size_t ncp;
        kv_ucd_decode(piece + i, chunk, cps, &ncp);
        for (size_t k = 0; k < ncp && w < n; k++) {
            int b = cp_byte(cps[k]);
            if (b >= 0) out[w++] = (char)b;
            else w += (size_t)kv_ucd_put(cps[k], out + w); /* not a byte char: keep its text */
        }
        i += chunk;
    }
    return w;
}

// --- merges --------------------------------------------------------------------

static uint32_t mhash(uint64_t key, uint32_t mask)
{
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> 32) & mask;
}

static const merge_slot *merge_find(const kv_tokenizer *t, int l, int r)
{
    if (!t->nmslots || l < 0 || r < 0) return NULL;
    uint64_t key = (uint64_t)(uint32_t)l << 32 | (uint32_t)r;
    uint32_t mask = t->nmslots - 1;
    for (uint32_t i = mhash(key, mask);; i = (i + 1) & mask) {
        if (t->merges[i].key == UINT64_MAX) return NULL;
        if (t->merges[i].key == key) return &t->merges[i];
    }
}

kv_status kv_bpe_load(kv_tokenizer *t, const kv_gguf *g)
{
    char pre[32] = "";
    kv_status st = KV_OK;
    kv_gguf_get_str(g, "tokenizer.ggml.pre", pre, sizeof pre, &st);
    if (st) return st;
    snprintf(t->pre_name, sizeof t->pre_name, "%s", pre);
    /* llama.cpp's names for the patterns implemented here */
    static const char *const llama3[] = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                         "midm-2.0", "lfm2", NULL};
    static const char *const gpt2[] = {"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                                       "jina-v2-de", "gpt2", "mpt", "olmo", "jais", "trillion", NULL};
    static const char *const qwen2[] = {"qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", NULL};
    t->pre = (pre_kind)-1;
    if (!pre[0] || !strcmp(pre, "default")) t->pre = PRE_DEFAULT;
    for (int i = 0; llama3[i]; i++)
        if (!strcmp(pre, llama3[i])) t->pre = PRE_LLAMA3, t->ignore_merges = true, t->add_bos = true;
    for (int i = 0; gpt2[i]; i++)
        if (!strcmp(pre, gpt2[i])) t->pre = PRE_GPT2;
    for (int i = 0; qwen2[i]; i++)
        if (!strcmp(pre, qwen2[i])) t->pre = PRE_QWEN2;
    /* an unknown pattern still loads (decoding works); encoding refuses */
    for (int b = 0; b < 256; b++) {
        char u[4];
        int n = kv_ucd_put(byte_cp(b), u);
        t->byte_tok[b] = kv_tok_lookup(t, u, (size_t)n);
    }
    const kv_gguf_kv *m = kv_gguf_find(g, "tokenizer.ggml.merges");
    if (!m) return kv_fail(KV_E_DATA, "GGUF gpt2 vocabulary has no tokenizer.ggml.merges");
    if (m->type != KV_GGUF_ARRAY || m->arr_type != KV_GGUF_STRING)
        return kv_fail(KV_E_DATA, "GGUF tokenizer.ggml.merges is not a string array");
    if (m->arr_n > (1u << 24)) return kv_fail(KV_E_DATA, "GGUF has %llu merges", (unsigned long long)m->arr_n);
    t->nmslots = 1;
    while (t->nmslots < 2 * (uint32_t)m->arr_n + 2) t->nmslots <<= 1;
    t->merges = malloc((size_t)t->nmslots * sizeof *t->merges);
    if (!t->merges) return kv_fail(KV_E_NOMEM, "out of memory for %llu merges", (unsigned long long)m->arr_n);
    for (uint32_t i = 0; i < t->nmslots; i++) t->merges[i].key = UINT64_MAX;
    char *buf = NULL;
    size_t bufcap = 0;
    for (uint64_t i = 0; i < m->arr_n; i++) {
        size_t n;
        const char *s = kv_gguf_arr_str(m, i, &n);
        if (!s) continue;
        /* "left right": split at the first space after the first byte */
        const char *sp = n > 1 ? memchr(s + 1, ' ', n - 1) : NULL;
        if (!sp) continue;
        size_t nl = (size_t)(sp - s), nr = n - nl - 1;
        int l = kv_tok_lookup(t, s, nl), r = kv_tok_lookup(t, sp + 1, nr);
        if (l < 0 || r < 0) continue;
        if (nl + nr > bufcap) {
            size_t nc = (nl + nr) * 2 + 16;
            char *nb = realloc(buf, nc);
            if (!nb) {
                free(buf);
                return kv_fail(KV_E_NOMEM, "out of memory");
            }
            buf = nb, bufcap = nc;
        }
        memcpy(buf, s, nl);
        memcpy(buf + nl, sp + 1, nr);
        int id = kv_tok_lookup(t, buf, nl + nr);
        if (id < 0) continue;
        uint64_t key = (uint64_t)(uint32_t)l << 32 | (uint32_t)r;
        uint32_t mask = t->nmslots - 1, j = mhash(key, mask);
        while (t->merges[j].key != UINT64_MAX && t->merges[j].key != key) j = (j + 1) & mask;
        if (t->merges[j].key == key) continue; /* the first rank of a pair wins */
        t->merges[j] = (merge_slot){key, (int32_t)i, id};
        t->n_merges++;
    }
    free(buf);
    return KV_OK;
}

// --- pre-tokenizers ----------------------------------------------------------------

typedef struct {
    size_t *v; /* segment ends (code point indices), starting after 0 */
    size_t n, cap;
} segs;

static bool seg_push(segs *s, size_t end)
{
    if (s->n && s->v[s->n - 1] == end) return true; /* empty segment */
    if (s->n == s->cap) {
        size_t nc = s->cap ? 2 * s->cap : 64;
        size_t *nv = realloc(s->v, nc * sizeof *nv);
        if (!nv) return false;
        s->v = nv, s->cap = nc;
    }
    s->v[s->n++] = end;
    return true;
}

typedef struct {
    const uint32_t *cp;
    size_t a, b; /* the segment being split: [a, b) */
} span;

static inline uint32_t at(const span *s, size_t i) { return i < s->b ? s->cp[i] : UINT32_MAX; }
static inline bool isL(const span *s, size_t i) { return i < s->b && kv_ucd_class(s->cp[i]) == KV_UC_LETTER; }
static inline bool isN(const span *s, size_t i) { return i < s->b && kv_ucd_class(s->cp[i]) == KV_UC_NUMBER; }
static inline bool isS(const span *s, size_t i) { return i < s->b && kv_ucd_is_space(s->cp[i]); }
/* [^\s\p{L}\p{N}] */
static inline bool isO(const span *s, size_t i) { return i < s->b && !isS(s, i) && !isL(s, i) && !isN(s, i); }
static inline uint32_t lower_ascii(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

/* 's|'t|'re|'ve|'m|'ll|'d at i (case-insensitive for Llama-3's (?i:...)):
 * the match length or 0. */
static size_t contraction(const span *s, size_t i, bool icase)
{
    if (at(s, i) != '\'' || i + 1 >= s->b) return 0;
    uint32_t c1 = at(s, i + 1), c2 = at(s, i + 2);
    if (icase) c1 = lower_ascii(c1), c2 = lower_ascii(c2);
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
    if (i + 2 < s->b && ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')))
        return 3;
    return 0;
}

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static bool split_gpt2(const span *s, segs *out)
{
    size_t pos = s->a;
    while (pos < s->b) {
        size_t c = contraction(s, pos, false);
        if (c) {
            pos += c;
        } else {
            size_t p2 = at(s, pos) == ' ' ? pos + 1 : pos;
            if (isL(s, p2)) {
                for (pos = p2; isL(s, pos); pos++) {}
            } else if (isN(s, p2)) {
                for (pos = p2; isN(s, pos); pos++) {}
            } else if (isO(s, p2)) {
                for (pos = p2; isO(s, pos); pos++) {}
            } else {
                size_t ws = 0;
                while (isS(s, pos + ws)) ws++;
                if (ws > 1 && pos + ws < s->b) pos += ws - 1; /* \s+(?!\S): leave one before \S */
                else if (ws > 0) pos += ws;
                else pos++;
            }
        }
        if (!seg_push(out, pos)) return false;
    }
    return true;
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}
 *   | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * with D = 3 (Llama-3) or 1 (Qwen2). */
static bool split_llama3(const span *s, segs *out, int maxdig)
{
    size_t pos = s->a;
    while (pos < s->b) {
        uint32_t c = at(s, pos);
        size_t k = contraction(s, pos, true);
        if (k) {
            pos += k;
        } else if (c != '\r' && c != '\n' && !isN(s, pos) && (isL(s, pos) || isL(s, pos + 1))) {
            for (pos++; isL(s, pos); pos++) {}
        } else if (isN(s, pos)) {
            size_t ini = pos;
            while (isN(s, pos) && pos - ini < (size_t)maxdig) pos++;
        } else if (isO(s, c == ' ' ? pos + 1 : pos)) {
            for (pos = c == ' ' ? pos + 1 : pos; isO(s, pos); pos++) {}
            while (at(s, pos) == '\r' || at(s, pos) == '\n') pos++;
        } else {
            size_t ws = 0, last_rn = 0;
            while (isS(s, pos + ws)) {
                if (at(s, pos + ws) == '\r' || at(s, pos + ws) == '\n') last_rn = pos + ws + 1;
                ws++;
            }
            if (last_rn) pos = last_rn;                 /* \s*[\r\n]+ */
            else if (ws > 1 && pos + ws < s->b) pos += ws - 1; /* \s+(?!\S) */
            else if (ws > 0) pos += ws;                 /* \s+ */
            else pos++;
        }
        if (!seg_push(out, pos)) return false;
    }
    return true;
}

/* A pass that keeps what a pattern does not match as segments of their own
 * (llama.cpp's regex passes): runs of `in` (run = true) or groups of up to
 * three ASCII digits (run = false, "[0-9][0-9][0-9]"). */
typedef bool (*cp_pred)(uint32_t cp);
static bool pred_punct(uint32_t c) /* [\p{P}\$\+<=>\^~\|] */
{
    return kv_ucd_class(c) == KV_UC_PUNCT || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' ||
           c == '^' || c == '~' || c == '|';
}
static bool pred_num(uint32_t c) { return kv_ucd_class(c) == KV_UC_NUMBER; }
static bool pred_digit(uint32_t c) { return c >= '0' && c <= '9'; }

static bool split_runs(const span *s, segs *out, cp_pred in)
{
    size_t pos = s->a;
    while (pos < s->b) {
        bool m = in(s->cp[pos]);
        while (pos < s->b && in(s->cp[pos]) == m) pos++;
        if (!seg_push(out, pos)) return false;
    }
    return true;
}

static bool split_triples(const span *s, segs *out)
{
    size_t pos = s->a;
    while (pos < s->b) {
        if (pos + 3 <= s->b && pred_digit(s->cp[pos]) && pred_digit(s->cp[pos + 1]) && pred_digit(s->cp[pos + 2])) {
            pos += 3;
        } else {
            /* a gap runs to the next position where a triple starts */
            pos++;
            while (pos < s->b && !(pos + 3 <= s->b && pred_digit(s->cp[pos]) && pred_digit(s->cp[pos + 1]) &&
                                   pred_digit(s->cp[pos + 2])))
                pos++;
        }
        if (!seg_push(out, pos)) return false;
    }
    return true;
}

/* Run every pass of t's pre-tokenizer over cps (n): *ends (malloc'd) gets
 * the end of each pre-token. */
static bool pretokenize(const kv_tokenizer *t, const uint32_t *cps, size_t n, segs *res)
{
    segs cur = {0}, next = {0};
    if (n == 0) {
        *res = cur;
        return true;
    }
    if (!seg_push(&cur, n)) return false;
    int npass = t->pre == PRE_DEFAULT ? 4 : 1;
    for (int p = 0; p < npass; p++) {
        next.n = 0;
        size_t a = 0;
        for (size_t i = 0; i < cur.n; i++) {
            span s = {cps, a, cur.v[i]};
            bool ok;
            switch (t->pre == PRE_DEFAULT ? p : -1) {
            case 0: ok = split_runs(&s, &next, pred_punct); break;
            case 1: ok = split_gpt2(&s, &next); break;
            case 2: ok = split_runs(&s, &next, pred_num); break;
            case 3: ok = split_triples(&s, &next); break;
            default:
                ok = t->pre == PRE_GPT2 ? split_gpt2(&s, &next)
                                        : split_llama3(&s, &next, t->pre == PRE_LLAMA3 ? 3 : 1);
            }
            if (!ok) {
                free(cur.v);
                free(next.v);
                return false;
            }
            a = cur.v[i];
        }
        segs tmp = cur;
        cur = next;
        next = tmp;
    }
    free(next.v);
    *res = cur;
    return true;
}

// --- merging -------------------------------------------------------------------------

typedef struct {
    int id;        /* token, or -1 (a byte whose code point is not a token) */
    int prev, next;
    unsigned ver;
    bool alive;
} bsym;

typedef struct {
    int32_t rank;
    int left, right, id;
    unsigned vl, vr;
} bpair;

static bool pair_before(const bpair *a, const bpair *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

typedef struct {
    bpair *h;
    size_t n, cap;
} pheap;

static bool ph_push(pheap *q, bpair p)
{
    if (q->n == q->cap) {
        size_t nc = q->cap ? 2 * q->cap : 64;
        bpair *nh = realloc(q->h, nc * sizeof *nh);
        if (!nh) return false;
        q->h = nh, q->cap = nc;
    }
    size_t i = q->n++;
    while (i > 0 && pair_before(&p, &q->h[(i - 1) / 2])) {
        q->h[i] = q->h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    q->h[i] = p;
    return true;
}

static bpair ph_pop(pheap *q)
{
    bpair top = q->h[0], last = q->h[--q->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= q->n) break;
        if (c + 1 < q->n && pair_before(&q->h[c + 1], &q->h[c])) c++;
        if (!pair_before(&q->h[c], &last)) break;
        q->h[i] = q->h[c];
        i = c;
    }
    if (q->n) q->h[i] = last;
    return top;
}

static bool try_pair(const kv_tokenizer *t, const bsym *S, int l, int r, pheap *q)
{
    if (l < 0 || r < 0) return true;
    const merge_slot *m = merge_find(t, S[l].id, S[r].id);
    if (!m) return true;
    return ph_push(q, (bpair){m->rank, l, r, m->id, S[l].ver, S[r].ver});
}

kv_status kv_bpe_encode(const kv_tokenizer *t, const char *text, size_t len, kv_idvec *out)
{
    if ((int)t->pre < 0)
        return kv_fail(KV_E_UNSUPPORTED, "BPE pre-tokenizer '%s' is not supported (default, gpt-2, llama-bpe, qwen2 are)",
                       t->pre_name);
    uint32_t *cps = malloc((len ? len : 1) * sizeof *cps);
    size_t ncp = 0;
    segs words = {0};
    bsym *S = NULL;
    char *mapped = NULL, *bytes = NULL;
    pheap q = {0};
    kv_status st = KV_OK;
    if (!cps) return kv_fail(KV_E_NOMEM, "out of memory");
    kv_ucd_decode(text, len, cps, &ncp);
    if (!pretokenize(t, cps, ncp, &words)) {
        st = kv_fail(KV_E_NOMEM, "out of memory");
        goto done;
    }
    size_t longest = 0, a = 0;
    for (size_t w = 0; w < words.n; a = words.v[w++])
        if (words.v[w] - a > longest) longest = words.v[w] - a;
    S = malloc((4 * longest + 1) * sizeof *S);
    bytes = malloc(4 * longest + 1);
    mapped = malloc(8 * longest + 1);
    if (!S || !bytes || !mapped) {
        st = kv_fail(KV_E_NOMEM, "out of memory");
        goto done;
    }
    a = 0;
    for (size_t w = 0; w < words.n; a = words.v[w++]) {
        /* the word's bytes, and their GPT-2 code points as text */
        size_t nb = 0, nm = 0;
        for (size_t i = a; i < words.v[w]; i++) nb += (size_t)kv_ucd_put(cps[i], bytes + nb);
        for (size_t i = 0; i < nb; i++) nm += (size_t)kv_ucd_put(byte_cp((uint8_t)bytes[i]), mapped + nm);
        if (t->ignore_merges) {
            int id = kv_tok_lookup(t, mapped, nm);
            if (id >= 0) {
                if (!kv_idvec_push(out, id)) goto oom;
                continue;
            }
        }
        int ns = (int)nb;
        for (int i = 0; i < ns; i++)
            S[i] = (bsym){t->byte_tok[(uint8_t)bytes[i]], i - 1, i + 1 < ns ? i + 1 : -1, 0, true};
        q.n = 0;
        for (int i = 0; i + 1 < ns; i++)
            if (!try_pair(t, S, i, i + 1, &q)) goto oom;
        while (q.n) {
            bpair p = ph_pop(&q);
            bsym *L = &S[p.left], *R = &S[p.right];
            if (!L->alive || !R->alive || L->ver != p.vl || R->ver != p.vr || L->next != p.right) continue;
            L->id = p.id;
            L->ver++;
            R->alive = false;
            R->ver++;
            L->next = R->next;
            if (R->next >= 0) S[R->next].prev = p.left;
            if (!try_pair(t, S, L->prev, p.left, &q) || !try_pair(t, S, p.left, L->next, &q)) goto oom;
        }
        for (int i = 0; i >= 0 && ns > 0; i = S[i].next)
            if (S[i].id >= 0 && !kv_idvec_push(out, S[i].id)) goto oom;
    }
    goto done;
oom:
    st = kv_fail(KV_E_NOMEM, "out of memory");
done:
    free(cps);
    free(words.v);
    free(S);
    free(bytes);
    free(mapped);
    free(q.h);
    return st;
}
