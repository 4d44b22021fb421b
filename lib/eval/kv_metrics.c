/*
 * kv_metrics: LongBench's and RULER's per-sample metrics over code points
 * (see kv_metrics.h for what each computes).  Comments name the Python
 * expression each step reproduces.
 */
#include "eval/kv_metrics.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eval/kv_seqmatch.h"
#include "eval/kv_unicode.h"

const kv_lb_dataset kv_lb_datasets[] = {
    {"narrativeqa", KV_LB_QA_F1, false, true, false},
    {"qasper", KV_LB_QA_F1, false, true, false},
    {"multifieldqa_en", KV_LB_QA_F1, false, true, false},
    {"multifieldqa_zh", KV_LB_QA_F1_ZH, false, true, false},
    {"hotpotqa", KV_LB_QA_F1, false, true, false},
    {"2wikimqa", KV_LB_QA_F1, false, true, false},
    {"musique", KV_LB_QA_F1, false, true, false},
    {"dureader", KV_LB_ROUGE_ZH, false, true, false},
    {"gov_report", KV_LB_ROUGE, false, true, false},
    {"qmsum", KV_LB_ROUGE, false, true, false},
    {"multi_news", KV_LB_ROUGE, false, true, false},
    {"vcsum", KV_LB_ROUGE_ZH, false, true, false},
    {"trec", KV_LB_CLASSIFICATION, true, false, false},
    {"triviaqa", KV_LB_QA_F1, true, false, false},
    {"samsum", KV_LB_ROUGE, true, false, true},
    {"lsht", KV_LB_CLASSIFICATION, true, false, false},
    {"passage_retrieval_en", KV_LB_RETRIEVAL, false, true, false},
    {"passage_count", KV_LB_COUNT, false, true, false},
    {"passage_retrieval_zh", KV_LB_RETRIEVAL_ZH, false, true, false},
    {"lcc", KV_LB_CODE_SIM, false, false, false},
    {"repobench-p", KV_LB_CODE_SIM, false, false, false},
};
const int kv_lb_n_datasets = (int)(sizeof kv_lb_datasets / sizeof kv_lb_datasets[0]);

const kv_lb_dataset *kv_lb_dataset_find(const char *name)
{
    for (int i = 0; i < kv_lb_n_datasets; i++)
        if (!strcmp(kv_lb_datasets[i].name, name)) return &kv_lb_datasets[i];
    return NULL;
}

const char *kv_lb_metric_name(kv_lb_metric m)
{
    static const char *const n[KV_LB_METRIC_COUNT] = {
        "qa_f1_score", "qa_f1_zh_score", "rouge_score", "rouge_zh_score",
        "classification_score", "retrieval_score", "retrieval_zh_score", "count_score",
        "code_sim_score"};
    return m >= 0 && m < KV_LB_METRIC_COUNT ? n[m] : "?";
}

bool kv_lb_metric_needs_jieba(kv_lb_metric m) { return m == KV_LB_QA_F1_ZH || m == KV_LB_ROUGE_ZH; }

// --- helpers ------------------------------------------------------------------------

typedef struct {
    const uint32_t *p;
    size_t n;
} tok;

typedef struct {
    tok *v;
    size_t n, cap;
} toks;

static kv_status toks_add(toks *t, const uint32_t *p, size_t n)
{
    if (t->n == t->cap) {
        size_t nc = t->cap ? t->cap * 2 : 32;
        tok *nv = realloc(t->v, nc * sizeof *nv);
        if (!nv) return kv_fail(KV_E_NOMEM, "tokens");
        t->v = nv;
        t->cap = nc;
    }
    t->v[t->n++] = (tok){p, n};
    return KV_OK;
}

static kv_status decode(const char *s, const char *what, kv_ustr *u)
{
    kv_status st = kv_utf8_decode(s, strlen(s), u);
    if (st == KV_E_DATA) kv_errcontext("%s", what);
    return st;
}

/* str.split(): runs of non-whitespace, as spans of s. */
static kv_status split_ws(const uint32_t *s, size_t n, toks *out)
{
    kv_status st = KV_OK;
    for (size_t i = 0; i < n && !st;) {
        while (i < n && kv_uc_isspace(s[i])) i++;
        size_t a = i;
        while (i < n && !kv_uc_isspace(s[i])) i++;
        if (i > a) st = toks_add(out, s + a, i - a);
    }
    return st;
}

static int cmp_cps(const uint32_t *a, size_t na, const uint32_t *b, size_t nb)
{
    size_t n = na < nb ? na : nb;
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
    return na < nb ? -1 : na > nb;
}

typedef struct {
    tok t;
    int side;
} sided;

static int cmp_sided(const void *x, const void *y)
{
    const sided *a = x, *b = y;
    return cmp_cps(a->t.p, a->t.n, b->t.p, b->t.n);
}

/* f1_score(prediction, ground_truth) over token lists. */
static kv_status f1_tokens(const toks *pred, const toks *gt, double *out)
{
    size_t n = pred->n + gt->n;
    sided *all = malloc((n ? n : 1) * sizeof *all);
    if (!all) return kv_fail(KV_E_NOMEM, "f1");
    for (size_t i = 0; i < pred->n; i++) all[i] = (sided){pred->v[i], 0};
    for (size_t i = 0; i < gt->n; i++) all[pred->n + i] = (sided){gt->v[i], 1};
    qsort(all, n, sizeof *all, cmp_sided);
    /* sum((Counter(prediction) & Counter(ground_truth)).values()) */
    size_t same = 0;
    for (size_t i = 0; i < n;) {
        size_t e = i, c0 = 0, c1 = 0;
        while (e < n && !cmp_sided(&all[i], &all[e])) {
            if (all[e].side) c1++;
            else c0++;
            e++;
        }
        same += c0 < c1 ? c0 : c1;
        i = e;
    }
    free(all);
    if (same == 0) {
        *out = 0;
        return KV_OK;
    }
    double precision = 1.0 * (double)same / (double)pred->n;
    double recall = 1.0 * (double)same / (double)gt->n;
    *out = (2 * precision * recall) / (precision + recall);
    return KV_OK;
}

static bool is_ascii_punct(uint32_t c)
{
    return c < 0x80 && c > 0x20 && c != 0x7F && !(c >= '0' && c <= '9') &&
           !(c >= 'a' && c <= 'z') && !(c >= 'A' && c <= 'Z');
}

/* normalize_zh_answer's cn_punctuation (with '.', which it also lists). */
static bool is_cn_punct(uint32_t c)
{
    static const uint32_t p[] = {
        0xFF01, 0xFF1F, 0xFF61, 0x3002, 0xFF02, 0xFF03, 0xFF04, 0xFF05, 0xFF06, 0xFF07, 0xFF08,
        0xFF09, 0xFF0A, 0xFF0B, 0xFF0C, 0xFF0D, 0xFF0F, 0xFF1A, 0xFF1B, 0xFF1C, 0xFF1D, 0xFF1E,
        0xFF20, 0xFF3B, 0xFF3C, 0xFF3D, 0xFF3E, 0xFF3F, 0xFF40, 0xFF5B, 0xFF5C, 0xFF5D, 0xFF5E,
        0xFF5F, 0xFF60, 0xFF62, 0xFF63, 0xFF64, 0x3001, 0x3003, 0x300B, 0x300C, 0x300D, 0x300E,
        0x300F, 0x3010, 0x3011, 0x3014, 0x3015, 0x3016, 0x3017, 0x3018, 0x3019, 0x301A, 0x301B,
        0x301C, 0x301D, 0x301E, 0x301F, 0x3030, 0x303E, 0x303F, 0x2013, 0x2014, 0x2018, 0x2019,
        0x201B, 0x201C, 0x201D, 0x201E, 0x201F, 0x2026, 0x2027, 0xFE4F, 0x002E};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        if (p[i] == c) return true;
    return false;
}

static bool word_at(const uint32_t *t, size_t n, size_t i) { return i < n && kv_uc_isword(t[i]); }

static bool lit_at(const uint32_t *t, size_t n, size_t i, const char *w)
{
    for (size_t k = 0; w[k]; k++)
        if (i + k >= n || t[i + k] != (unsigned char)w[k]) return false;
    return true;
}

/* normalize_answer(s) split into tokens; *buf holds them (caller frees). */
static kv_status normalize_en(const char *s, const char *what, uint32_t **buf, toks *out)
{
    kv_ustr u, lo;
    *buf = NULL;
    kv_status st = decode(s, what, &u);
    if (st) return st;
    st = kv_ustr_lower(&u, &lo);
    kv_ustr_free(&u);
    if (st) return st;
    /* remove_punc(lower(s)) */
    size_t n = 0;
    for (size_t i = 0; i < lo.n; i++)
        if (!is_ascii_punct(lo.c[i])) lo.c[n++] = lo.c[i];
    /* re.sub(r"\b(a|an|the)\b", " ", text) */
    uint32_t *r = malloc((n + 1) * sizeof *r);
    if (!r) {
        kv_ustr_free(&lo);
        return kv_fail(KV_E_NOMEM, "normalize");
    }
    size_t k = 0;
    const uint32_t *t = lo.c;
    for (size_t i = 0; i < n;) {
        size_t len = 0;
        if (!(i > 0 && kv_uc_isword(t[i - 1]))) {
            if (lit_at(t, n, i, "a") && !word_at(t, n, i + 1)) len = 1;
            else if (lit_at(t, n, i, "an") && !word_at(t, n, i + 2)) len = 2;
            else if (lit_at(t, n, i, "the") && !word_at(t, n, i + 3)) len = 3;
        }
        if (len) {
            r[k++] = ' ';
            i += len;
        } else {
            r[k++] = t[i++];
        }
    }
    kv_ustr_free(&lo);
    /* white_space_fix, then .split() */
    st = split_ws(r, k, out);
    if (st) {
        free(r);
        return st;
    }
    *buf = r;
    return KV_OK;
}

/* The jieba tokens of s as spans of *u (caller frees both). */
static kv_status cut(const kv_jieba *jb, const char *s, const char *what, kv_ustr *u,
                     kv_span **sp, size_t *nsp)
{
    *sp = NULL;
    if (!jb) return kv_fail(KV_E_USAGE, "the Chinese metrics need jieba's dictionary");
    kv_status st = decode(s, what, u);
    if (st) return st;
    st = kv_jieba_cut(jb, u->c, u->n, sp, nsp);
    if (st) kv_ustr_free(u);
    return st;
}

/* [normalize_zh_answer(t) for t in jieba.cut(s)], empty ones dropped. */
static kv_status normalize_zh(const kv_jieba *jb, const char *s, const char *what,
                              uint32_t **buf, toks *out)
{
    kv_ustr u;
    kv_span *sp;
    size_t nsp;
    *buf = NULL;
    kv_status st = cut(jb, s, what, &u, &sp, &nsp);
    if (st) return st;
    uint32_t *b = malloc((2 * u.n + 1) * sizeof *b);
    if (!b) st = kv_fail(KV_E_NOMEM, "normalize");
    size_t k = 0;
    for (size_t i = 0; i < nsp && !st; i++) {
        size_t a = k;
        size_t m = kv_uc_lower(u.c + sp[i].start, sp[i].len, b + k);
        for (size_t q = a; q < a + m; q++) {
            uint32_t c = b[q];
            if (!is_ascii_punct(c) && !is_cn_punct(c) && !kv_uc_isspace(c)) b[k++] = c;
        }
        if (k > a) st = toks_add(out, b + a, k - a);
    }
    /* the spans point into b, which does not move after this */
    free(sp);
    kv_ustr_free(&u);
    if (st) {
        free(b);
        return st;
    }
    *buf = b;
    return KV_OK;
}

// --- ROUGE-L (the rouge package) ----------------------------------------------------

typedef struct {
    const uint32_t *p;
    size_t n;
} word;

/* Interning of words to small ids, so the LCS compares integers. */
typedef struct {
    word *w;      /* (n) distinct words */
    size_t n, cap;
    int64_t *slot;
    size_t nslot;
} interner;

static uint64_t hash_word(const uint32_t *p, size_t n)
{
    uint64_t h = 1469598103934665603ULL ^ n;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ULL;
    }
    return h ^ (h >> 31);
}

static kv_status intern(interner *in, const uint32_t *p, size_t n, int *id)
{
    if ((in->n + 1) * 2 > in->nslot) {
        size_t ns = in->nslot ? in->nslot * 2 : 256;
        int64_t *sl = malloc(ns * sizeof *sl);
        if (!sl) return kv_fail(KV_E_NOMEM, "rouge");
        for (size_t i = 0; i < ns; i++) sl[i] = -1;
        for (size_t e = 0; e < in->n; e++) {
            size_t i = hash_word(in->w[e].p, in->w[e].n) & (ns - 1);
            while (sl[i] >= 0) i = (i + 1) & (ns - 1);
            sl[i] = (int64_t)e;
        }
        free(in->slot);
        in->slot = sl;
        in->nslot = ns;
    }
    size_t mask = in->nslot - 1;
    size_t i = hash_word(p, n) & mask;
    for (; in->slot[i] >= 0; i = (i + 1) & mask) {
        const word *w = &in->w[in->slot[i]];
        if (w->n == n && !memcmp(w->p, p, n * sizeof *p)) {
            *id = (int)in->slot[i];
            return KV_OK;
        }
    }
    if (in->n == in->cap) {
        size_t nc = in->cap ? in->cap * 2 : 128;
        word *nw = realloc(in->w, nc * sizeof *nw);
        if (!nw) return kv_fail(KV_E_NOMEM, "rouge");
        in->w = nw;
        in->cap = nc;
    }
    in->w[in->n] = (word){p, n};
    in->slot[i] = (int64_t)in->n;
    *id = (int)in->n++;
    return KV_OK;
}

/* A text as the rouge package sees it: sentences (pieces between '.', the
 * empty ones dropped, whitespace collapsed), each a list of word ids. */
typedef struct {
    int *ids;      /* all words, sentence after sentence */
    size_t *start; /* (n_sent + 1) */
    size_t n_sent;
} rtext;

static void rtext_free(rtext *t)
{
    free(t->ids);
    free(t->start);
}

static kv_status rouge_text(const uint32_t *s, size_t n, interner *in, rtext *t)
{
    memset(t, 0, sizeof *t);
    t->ids = malloc((n + 1) * sizeof *t->ids);
    t->start = malloc((n + 2) * sizeof *t->start);
    if (!t->ids || !t->start) return kv_fail(KV_E_NOMEM, "rouge");
    size_t nw = 0;
    kv_status st = KV_OK;
    for (size_t i = 0; i <= n && !st;) {
        size_t e = i;
        while (e < n && s[e] != '.') e++;
        if (e > i) { /* [" ".join(_.split()) for _ in text.split(".") if len(_) > 0] */
            t->start[t->n_sent++] = nw;
            toks w = {0};
            st = split_ws(s + i, e - i, &w);
            /* "".split(" ") is [""]: a sentence of blanks is one empty word */
            if (!st && w.n == 0) st = intern(in, s + i, 0, &t->ids[nw++]);
            for (size_t k = 0; k < w.n && !st; k++) st = intern(in, w.v[k].p, w.v[k].n, &t->ids[nw++]);
            free(w.v);
        }
        i = e + 1;
    }
    t->start[t->n_sent] = nw;
    return st;
}

/* |set(words)| over every sentence of t, marking them in mark (n_words). */
static size_t distinct(const rtext *t, unsigned char *mark, size_t nmark)
{
    memset(mark, 0, nmark);
    size_t d = 0;
    for (size_t k = 0; k < t->start[t->n_sent]; k++)
        if (!mark[t->ids[k]]) {
            mark[t->ids[k]] = 1;
            d++;
        }
    return d;
}

#define ROUGE_MAX_CELLS ((size_t)1 << 26)

/* The words of _recon_lcs(x, y) added to uni; *deep when the walk needs
 * more _recon frames than max_steps allows (RecursionError). */
static kv_status recon(const int *x, size_t nx, const int *y, size_t ny, size_t max_steps,
                       unsigned char *uni, bool *deep)
{
    *deep = false;
    /* the walk takes at least min(nx, ny) steps */
    if ((nx < ny ? nx : ny) > max_steps) {
        *deep = true;
        return KV_OK;
    }
    size_t w = ny + 1;
    if ((nx + 1) > ROUGE_MAX_CELLS / w)
        return kv_fail(KV_E_UNSUPPORTED,
                       "ROUGE-L: sentences of %zu and %zu words need a %zu-entry table "
                       "(the rouge package would exhaust memory)", nx, ny, (nx + 1) * w);
    uint16_t *tb = calloc((nx + 1) * w, sizeof *tb); /* LCS <= max_steps < 65536 */
    if (!tb) return kv_fail(KV_E_NOMEM, "ROUGE-L table");
    for (size_t i = 1; i <= nx; i++)
        for (size_t j = 1; j <= ny; j++) {
            uint16_t up = tb[(i - 1) * w + j], left = tb[i * w + j - 1];
            tb[i * w + j] = x[i - 1] == y[j - 1] ? (uint16_t)(tb[(i - 1) * w + j - 1] + 1)
                                                 : (up > left ? up : left);
        }
    size_t i = nx, j = ny, steps = 0;
    while (i > 0 && j > 0) {
        if (++steps > max_steps) {
            *deep = true;
            break;
        }
        if (x[i - 1] == y[j - 1]) {
            uni[x[i - 1]] = 1;
            i--;
            j--;
        } else if (tb[(i - 1) * w + j] > tb[i * w + j - 1]) {
            i--;
        } else {
            j--;
        }
    }
    free(tb);
    return KV_OK;
}

/* rouge_score(prediction, ground_truth) on code points; depth: extra
 * frames of the caller (rouge_zh_score adds one). */
static kv_status rouge_cps(const uint32_t *h, size_t nh, const uint32_t *r, size_t nr,
                           size_t depth, double *out)
{
    *out = 0.0;
    interner in = {0};
    rtext hyp = {0}, ref = {0};
    kv_status st = rouge_text(h, nh, &in, &hyp);
    if (!st) st = rouge_text(r, nr, &in, &ref);
    if (st || hyp.n_sent == 0 || ref.n_sent == 0) /* "Hypothesis is empty." etc. */
        goto done;
    unsigned char *mark = malloc(in.n + 1), *uni = calloc(in.n + 1, 1);
    if (!mark || !uni) {
        free(mark);
        free(uni);
        st = kv_fail(KV_E_NOMEM, "rouge");
        goto done;
    }
    size_t m = distinct(&ref, mark, in.n + 1); /* len(Ngrams(ref words)) */
    size_t n = distinct(&hyp, mark, in.n + 1);
    bool deep = false;
    for (size_t a = 0; a < ref.n_sent && !st && !deep; a++)
        for (size_t b = 0; b < hyp.n_sent && !st && !deep; b++)
            st = recon(ref.ids + ref.start[a], ref.start[a + 1] - ref.start[a],
                       hyp.ids + hyp.start[b], hyp.start[b + 1] - hyp.start[b],
                       KV_ROUGE_MAX_STEPS - depth, uni, &deep);
    if (!st && !deep) {
        size_t llcs = 0;
        for (size_t k = 0; k < in.n; k++) llcs += uni[k];
        double r_lcs = (double)llcs / (double)m, p_lcs = (double)llcs / (double)n;
        *out = 2.0 * ((p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8));
    }
    free(mark);
    free(uni);
done:
    rtext_free(&hyp);
    rtext_free(&ref);
    free(in.w);
    free(in.slot);
    return st;
}

static kv_status rouge_en(const char *pred, const char *gt, double *out)
{
    kv_ustr a, b;
    kv_status st = decode(pred, "prediction", &a);
    if (st) return st;
    if ((st = decode(gt, "answer", &b))) {
        kv_ustr_free(&a);
        return st;
    }
    st = rouge_cps(a.c, a.n, b.c, b.n, 0, out);
    kv_ustr_free(&a);
    kv_ustr_free(&b);
    return st;
}

/* " ".join(jieba.cut(s)) */
static kv_status cut_join(const kv_jieba *jb, const char *s, const char *what, kv_ustr *out)
{
    kv_ustr u;
    kv_span *sp;
    size_t nsp;
    kv_status st = cut(jb, s, what, &u, &sp, &nsp);
    if (st) return st;
    out->c = malloc((2 * u.n + 1) * sizeof *out->c);
    out->n = 0;
    if (!out->c) st = kv_fail(KV_E_NOMEM, "rouge_zh");
    for (size_t i = 0; i < nsp && !st; i++) {
        if (i) out->c[out->n++] = ' ';
        memcpy(out->c + out->n, u.c + sp[i].start, sp[i].len * sizeof *u.c);
        out->n += sp[i].len;
    }
    free(sp);
    kv_ustr_free(&u);
    return st;
}

static kv_status rouge_zh(const kv_jieba *jb, const char *pred, const char *gt, double *out)
{
    kv_ustr a = {0}, b = {0};
    kv_status st = cut_join(jb, pred, "prediction", &a);
    if (!st) st = cut_join(jb, gt, "answer", &b);
    if (!st) st = rouge_cps(a.c, a.n, b.c, b.n, 1, out);
    kv_ustr_free(&a);
    kv_ustr_free(&b);
    return st;
}

// --- the number metrics ----------------------------------------------------------------

/* re.findall(r"\d+", s) */
static kv_status numbers(const kv_ustr *u, toks *out)
{
    kv_status st = KV_OK;
    for (size_t i = 0; i < u->n && !st;) {
        if (!kv_uc_isdecimal(u->c[i])) {
            i++;
            continue;
        }
        size_t a = i;
        while (i < u->n && kv_uc_isdecimal(u->c[i])) i++;
        st = toks_add(out, u->c + a, i - a);
    }
    return st;
}

/* right_num / len(numbers) for the numbers of pred equal to want. */
static kv_status number_share(const char *pred, const uint32_t *want, size_t nwant, double *out)
{
    kv_ustr u;
    kv_status st = decode(pred, "prediction", &u);
    if (st) return st;
    toks num = {0};
    st = numbers(&u, &num);
    size_t right = 0;
    for (size_t i = 0; i < num.n && !st; i++) right += !cmp_cps(num.v[i].p, num.v[i].n, want, nwant);
    if (!st) *out = num.n == 0 ? 0.0 : (double)right / (double)num.n;
    free(num.v);
    kv_ustr_free(&u);
    return st;
}

/* re.findall(key + r"(\d+)", gt)[0] */
static kv_status retrieval(const char *pred, const char *gt, const char *key, double *out)
{
    kv_ustr g, k;
    kv_status st = decode(gt, "answer", &g);
    if (st) return st;
    if ((st = kv_utf8_decode(key, strlen(key), &k))) {
        kv_ustr_free(&g);
        return st;
    }
    size_t at = 0, len = 0;
    bool found = false;
    for (size_t i = 0; i + k.n < g.n && !found; i++) {
        if (memcmp(g.c + i, k.c, k.n * sizeof *k.c)) continue;
        size_t e = i + k.n;
        while (e < g.n && kv_uc_isdecimal(g.c[e])) e++;
        if (e > i + k.n) {
            found = true;
            at = i + k.n;
            len = e - at;
        }
    }
    if (!found)
        st = kv_fail(KV_E_DATA, "answer \"%.60s\" names no \"%sN\" (eval.py fails on it)", gt, key);
    else
        st = number_share(pred, g.c + at, len, out);
    kv_ustr_free(&k);
    kv_ustr_free(&g);
    return st;
}

static kv_status count_metric(const char *pred, const char *gt, double *out)
{
    kv_ustr g;
    kv_status st = decode(gt, "answer", &g);
    if (st) return st;
    st = number_share(pred, g.c, g.n, out);
    kv_ustr_free(&g);
    return st;
}

// --- classification and code ---------------------------------------------------------

static kv_status classification(const char *pred, const char *gt, const char *const *classes,
                                int n_classes, bool has_classes, double *out)
{
    if (!has_classes)
        return kv_fail(KV_E_DATA, "all_classes is null: classification_score cannot score it");
    const char **em = malloc(((size_t)n_classes + 1) * sizeof *em);
    if (!em) return kv_fail(KV_E_NOMEM, "classification");
    int n = 0;
    for (int i = 0; i < n_classes; i++)
        if (strstr(pred, classes[i])) em[n++] = classes[i];
    /* for match_term in em_match_list: ... em_match_list.remove(match_term):
     * a removal shifts the list under the running index, so the element
     * after a removed one is never looked at; remove() drops the first
     * equal element, which may be an earlier one */
    for (int idx = 0; idx < n; idx++) {
        const char *term = em[idx];
        if (strstr(gt, term) && strcmp(term, gt)) {
            int f = 0;
            while (strcmp(em[f], term)) f++;
            memmove(em + f, em + f + 1, (size_t)(n - f - 1) * sizeof *em);
            n--;
        }
    }
    bool in = false;
    for (int i = 0; i < n && !in; i++) in = !strcmp(em[i], gt);
    *out = in ? 1.0 / n : 0.0;
    free(em);
    return KV_OK;
}

static kv_status code_sim(const char *pred, const char *gt, double *out)
{
    /* all_lines = prediction.lstrip('\n').split('\n'); the first line
     * without ` # or // (else "") */
    while (*pred == '\n') pred++;
    const char *line = "";
    size_t len = 0;
    for (const char *p = pred;;) {
        const char *nl = strchr(p, '\n');
        size_t l = nl ? (size_t)(nl - p) : strlen(p);
        bool bad = memchr(p, '`', l) || memchr(p, '#', l);
        for (size_t i = 0; i + 1 < l && !bad; i++) bad = p[i] == '/' && p[i + 1] == '/';
        if (!bad) {
            line = p;
            len = l;
            break;
        }
        if (!nl) break;
        p = nl + 1;
    }
    kv_ustr a, b;
    kv_status st = kv_utf8_decode(line, len, &a);
    if (st) {
        kv_errcontext("prediction");
        return st;
    }
    if ((st = decode(gt, "answer", &b))) {
        kv_ustr_free(&a);
        return st;
    }
    int r = 0;
    st = kv_fuzz_ratio(a.c, a.n, b.c, b.n, &r);
    if (!st) *out = r / 100.0;
    kv_ustr_free(&a);
    kv_ustr_free(&b);
    return st;
}

// --- dispatch ---------------------------------------------------------------------------

kv_status kv_lb_metric_score(kv_lb_metric m, const kv_jieba *jb, const char *pred, const char *gt,
                             const char *const *classes, int n_classes, bool has_classes,
                             double *out)
{
    *out = 0.0;
    kv_status st = KV_OK;
    uint32_t *b1 = NULL, *b2 = NULL;
    toks t1 = {0}, t2 = {0};
    switch (m) {
    case KV_LB_QA_F1:
    case KV_LB_QA_F1_ZH:
        st = m == KV_LB_QA_F1 ? normalize_en(pred, "prediction", &b1, &t1)
                              : normalize_zh(jb, pred, "prediction", &b1, &t1);
        if (!st)
            st = m == KV_LB_QA_F1 ? normalize_en(gt, "answer", &b2, &t2)
                                  : normalize_zh(jb, gt, "answer", &b2, &t2);
        if (!st) st = f1_tokens(&t1, &t2, out);
        break;
    case KV_LB_ROUGE: st = rouge_en(pred, gt, out); break;
    case KV_LB_ROUGE_ZH: st = rouge_zh(jb, pred, gt, out); break;
    case KV_LB_CLASSIFICATION:
        st = classification(pred, gt, classes, n_classes, has_classes, out);
        break;
    case KV_LB_RETRIEVAL: st = retrieval(pred, gt, "Paragraph ", out); break;
    case KV_LB_RETRIEVAL_ZH: st = retrieval(pred, gt, "段落", out); break;
    case KV_LB_COUNT: st = count_metric(pred, gt, out); break;
    case KV_LB_CODE_SIM: st = code_sim(pred, gt, out); break;
    default: st = kv_fail(KV_E_INTERNAL, "unknown metric %d", (int)m);
    }
    free(t1.v);
    free(t2.v);
    free(b1);
    free(b2);
    return st;
}

kv_status kv_lb_sample_score(const kv_lb_dataset *d, const kv_jieba *jb, const char *pred,
                             const char *const *answers, int n_answers,
                             const char *const *classes, int n_classes, bool has_classes,
                             double *out)
{
    *out = 0.0;
    char *first = NULL;
    if (d->first_line) { /* prediction.lstrip('\n').split('\n')[0] */
        while (*pred == '\n') pred++;
        size_t l = strcspn(pred, "\n");
        if (!(first = malloc(l + 1))) return kv_fail(KV_E_NOMEM, "prediction");
        memcpy(first, pred, l);
        first[l] = 0;
        pred = first;
    }
    double score = 0.0;
    kv_status st = KV_OK;
    for (int i = 0; i < n_answers && !st; i++) {
        double s;
        st = kv_lb_metric_score(d->metric, jb, pred, answers[i], classes, n_classes, has_classes,
                                &s);
        if (!st && s > score) score = s; /* max(score, s) keeps the first on ties */
    }
    free(first);
    if (!st) *out = score;
    return st;
}

// --- RULER --------------------------------------------------------------------------------

const char *kv_ruler_metric_name(kv_ruler_metric m)
{
    return m == KV_RULER_MATCH_PART ? "string_match_part" : "string_match_all";
}

kv_status kv_ruler_metric_parse(const char *s, kv_ruler_metric *out)
{
    if (!strcmp(s, "all") || !strcmp(s, "string_match_all")) *out = KV_RULER_MATCH_ALL;
    else if (!strcmp(s, "part") || !strcmp(s, "string_match_part")) *out = KV_RULER_MATCH_PART;
    else return kv_fail(KV_E_USAGE, "unknown RULER metric '%s' (all or part)", s);
    return KV_OK;
}

kv_ruler_metric kv_ruler_task_metric(const char *task, bool *known)
{
    static const char *const pub[] = {
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1",
        "qa_2"};
    bool k = false;
    for (size_t i = 0; i < sizeof pub / sizeof pub[0]; i++) k |= !strcmp(task, pub[i]);
    if (known) *known = k;
    return !strncmp(task, "qa", 2) ? KV_RULER_MATCH_PART : KV_RULER_MATCH_ALL;
}

char *kv_ruler_postprocess(const char *pred)
{
    kv_ustr u;
    if (kv_utf8_decode(pred, strlen(pred), &u)) {
        /* not UTF-8: strip ASCII only, map control bytes */
        size_t n = strlen(pred);
        char *r = malloc(n + 1);
        if (!r) return NULL;
        memcpy(r, pred, n + 1);
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)r[i] < 0x20) r[i] = '\n';
        size_t a = 0, b = n;
        while (a < b && (r[a] == ' ' || r[a] == '\n')) a++;
        while (b > a && (r[b - 1] == ' ' || r[b - 1] == '\n')) b--;
        memmove(r, r + a, b - a);
        r[b - a] = 0;
        return r;
    }
    /* predict_str.strip(); re.sub(r'[\x00-\x1f]', '\n', ...).strip() */
    size_t a = 0, b = u.n;
    while (a < b && kv_uc_isspace(u.c[a])) a++;
    while (b > a && kv_uc_isspace(u.c[b - 1])) b--;
    for (size_t i = a; i < b; i++)
        if (u.c[i] < 0x20) u.c[i] = '\n';
    while (a < b && kv_uc_isspace(u.c[a])) a++;
    while (b > a && kv_uc_isspace(u.c[b - 1])) b--;
    char *r = NULL;
    kv_utf8_encode(u.c + a, b - a, &r, NULL);
    kv_ustr_free(&u);
    return r;
}

/* s.lower() as UTF-8; bytes that are not UTF-8 are lowered as ASCII. */
static char *lower_utf8(const char *s, size_t *len)
{
    kv_ustr u, lo;
    if (kv_utf8_decode(s, strlen(s), &u)) {
        size_t n = strlen(s);
        char *r = malloc(n + 1);
        if (!r) return NULL;
        for (size_t i = 0; i <= n; i++) r[i] = (s[i] >= 'A' && s[i] <= 'Z') ? s[i] + 32 : s[i];
        *len = n;
        return r;
    }
    char *r = NULL;
    if (!kv_ustr_lower(&u, &lo)) {
        kv_utf8_encode(lo.c, lo.n, &r, len);
        kv_ustr_free(&lo);
    }
    kv_ustr_free(&u);
    return r;
}

kv_status kv_ruler_sample_score(kv_ruler_metric m, const char *pred, const char *const *refs,
                                int n_refs, double *out)
{
    *out = 0.0;
    if (n_refs <= 0) return kv_fail(KV_E_DATA, "no expected outputs");
    size_t pl;
    char *p = lower_utf8(pred, &pl);
    if (!p) return kv_fail(KV_E_NOMEM, "score");
    double sum = 0.0, best = 0.0;
    kv_status st = KV_OK;
    for (int i = 0; i < n_refs; i++) {
        size_t rl;
        char *r = lower_utf8(refs[i], &rl);
        if (!r) {
            st = kv_fail(KV_E_NOMEM, "score");
            break;
        }
        double hit = memmem(p, pl, r, rl) ? 1.0 : 0.0; /* r.lower() in pred.lower() */
        free(r);
        sum += hit;
        if (i == 0 || hit > best) best = hit;
    }
    free(p);
    if (!st) *out = m == KV_RULER_MATCH_PART ? best : sum / n_refs;
    return st;
}
