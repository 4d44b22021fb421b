/*
 * kv_jieba: jieba's prefix dictionary, its HMM tables and jieba.cut with
 * HMM=True (see kv_jieba.h).  Words are code-point strings in one pool,
 * found through an open-addressing hash table; the HMM's emission tables
 * are sorted (character, log-probability) arrays per state.
 */
#include "eval/kv_jieba.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_file.h"
#include "eval/kv_unicode.h"

#define MIN_FLOAT (-3.14e100) /* jieba's log-probability of the impossible */
#define MAX_FREQ 1000000000000000LL

enum { ST_B, ST_M, ST_E, ST_S, N_STATES };
static const char state_name[N_STATES] = {'B', 'M', 'E', 'S'};

typedef struct {
    uint32_t ch;
    double lp;
} emit_entry;

typedef struct {
    size_t off;    /* into pool */
    uint32_t len;  /* code points */
    long long freq;
} entry;

struct kv_jieba {
    uint32_t *pool; /* (pool_n) the code points of every key */
    size_t pool_n, pool_cap;
    entry *ent;     /* (n_ent) */
    size_t n_ent, ent_cap;
    int64_t *slot;  /* (n_slot) entry index or -1; n_slot a power of two */
    size_t n_slot;
    long long total;
    bool have_hmm;
    double start[N_STATES];
    double trans[N_STATES][N_STATES]; /* MIN_FLOAT where the table has none */
    emit_entry *emit[N_STATES];        /* (n_emit[s]) sorted by ch */
    size_t n_emit[N_STATES];
};

// --- the prefix dictionary -------------------------------------------------------

static uint64_t hash_cps(const uint32_t *s, size_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ULL;
    }
    return h ^ (h >> 29);
}

static const entry *find(const kv_jieba *j, const uint32_t *s, size_t n)
{
    if (!j->n_slot) return NULL;
    size_t mask = j->n_slot - 1;
    for (size_t i = hash_cps(s, n) & mask;; i = (i + 1) & mask) {
        int64_t e = j->slot[i];
        if (e < 0) return NULL;
        const entry *x = &j->ent[e];
        if (x->len == n && !memcmp(j->pool + x->off, s, n * sizeof *s)) return x;
    }
}

static kv_status grow_slots(kv_jieba *j)
{
    size_t ns = j->n_slot ? j->n_slot * 2 : 1024;
    int64_t *sl = malloc(ns * sizeof *sl);
    if (!sl) return kv_fail(KV_E_NOMEM, "jieba dictionary of %zu entries", j->n_ent);
    for (size_t i = 0; i < ns; i++) sl[i] = -1;
    for (size_t e = 0; e < j->n_ent; e++) {
        size_t i = hash_cps(j->pool + j->ent[e].off, j->ent[e].len) & (ns - 1);
        while (sl[i] >= 0) i = (i + 1) & (ns - 1);
        sl[i] = (int64_t)e;
    }
    free(j->slot);
    j->slot = sl;
    j->n_slot = ns;
    return KV_OK;
}

/* Insert s with freq (replace: overwrite an existing entry's freq; else an
 * existing entry is left alone). */
static kv_status put(kv_jieba *j, const uint32_t *s, size_t n, long long freq, bool replace)
{
    entry *x = (entry *)find(j, s, n);
    if (x) {
        if (replace) x->freq = freq;
        return KV_OK;
    }
    if ((j->n_ent + 1) * 2 > j->n_slot) {
        kv_status st = grow_slots(j);
        if (st) return st;
    }
    if (j->n_ent == j->ent_cap) {
        size_t nc = j->ent_cap ? j->ent_cap * 2 : 4096;
        entry *ne = realloc(j->ent, nc * sizeof *ne);
        if (!ne) return kv_fail(KV_E_NOMEM, "jieba dictionary");
        j->ent = ne;
        j->ent_cap = nc;
    }
    if (j->pool_n + n > j->pool_cap) {
        size_t nc = j->pool_cap ? j->pool_cap * 2 : 65536;
        while (nc < j->pool_n + n) nc *= 2;
        uint32_t *np = realloc(j->pool, nc * sizeof *np);
        if (!np) return kv_fail(KV_E_NOMEM, "jieba dictionary");
        j->pool = np;
        j->pool_cap = nc;
    }
    memcpy(j->pool + j->pool_n, s, n * sizeof *s);
    j->ent[j->n_ent] = (entry){j->pool_n, (uint32_t)n, freq};
    j->pool_n += n;
    size_t mask = j->n_slot - 1;
    size_t i = hash_cps(s, n) & mask;
    while (j->slot[i] >= 0) i = (i + 1) & mask;
    j->slot[i] = (int64_t)j->n_ent++;
    return KV_OK;
}

kv_status kv_jieba_new(kv_jieba **out)
{
    kv_jieba *j = calloc(1, sizeof *j);
    if (!j) return kv_fail(KV_E_NOMEM, "jieba");
    *out = j;
    return KV_OK;
}

void kv_jieba_free(kv_jieba *j)
{
    if (!j) return;
    free(j->pool);
    free(j->ent);
    free(j->slot);
    for (int s = 0; s < N_STATES; s++) free(j->emit[s]);
    free(j);
}

size_t kv_jieba_entries(const kv_jieba *j) { return j->n_ent; }
long long kv_jieba_total(const kv_jieba *j) { return j->total; }

static bool ascii_ws(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

/* Python's int() of the frequency field: optional whitespace and sign, ASCII
 * digits with single underscores between them. */
static bool parse_freq(const uint32_t *s, size_t n, long long *out)
{
    size_t a = 0, b = n;
    while (a < b && kv_uc_isspace(s[a])) a++;
    while (b > a && kv_uc_isspace(s[b - 1])) b--;
    bool neg = false;
    if (a < b && (s[a] == '+' || s[a] == '-')) neg = s[a++] == '-';
    if (a == b) return false;
    long long v = 0;
    bool prev_digit = false;
    for (size_t i = a; i < b; i++) {
        if (s[i] == '_' && prev_digit && i + 1 < b) {
            prev_digit = false;
            continue;
        }
        if (s[i] < '0' || s[i] > '9') return false;
        if (v > MAX_FREQ) return false;
        v = v * 10 + (s[i] - '0');
        prev_digit = true;
    }
    if (!prev_digit) return false;
    *out = neg ? -v : v;
    return true;
}

kv_status kv_jieba_load_dict(kv_jieba *j, const char *text, size_t len, const char *name)
{
    size_t pos = 0;
    int lineno = 0;
    kv_ustr u = {0};
    kv_status st = KV_OK;
    while (pos < len && !st) {
        const char *nl = memchr(text + pos, '\n', len - pos);
        size_t end = nl ? (size_t)(nl - text) : len;
        size_t a = pos, b = end;
        pos = nl ? end + 1 : len;
        lineno++;
        /* bytes.strip(), then decode */
        while (a < b && ascii_ws((unsigned char)text[a])) a++;
        while (b > a && ascii_ws((unsigned char)text[b - 1])) b--;
        kv_ustr_free(&u);
        if (kv_utf8_decode(text + a, b - a, &u)) {
            st = kv_fail(KV_E_DATA, "%s:%d: invalid dictionary entry (not UTF-8)", name, lineno);
            break;
        }
        /* word, freq = line.split(' ')[:2] */
        size_t s1 = 0;
        while (s1 < u.n && u.c[s1] != ' ') s1++;
        size_t s2 = s1 < u.n ? s1 + 1 : u.n;
        while (s2 < u.n && u.c[s2] != ' ') s2++;
        long long freq = 0;
        if (s1 >= u.n || !parse_freq(u.c + s1 + 1, s2 - s1 - 1, &freq)) {
            st = kv_fail(KV_E_DATA, "%s:%d: invalid dictionary entry (want \"word freq [tag]\")",
                         name, lineno);
            break;
        }
        if (freq < 0) {
            st = kv_fail(KV_E_DATA, "%s:%d: negative frequency %lld", name, lineno, freq);
            break;
        }
        if (j->total > MAX_FREQ) {
            st = kv_fail(KV_E_DATA, "%s:%d: frequencies add up past %lld", name, lineno, MAX_FREQ);
            break;
        }
        /* the word replaces its frequency; every prefix exists (freq 0 if new) */
        if ((st = put(j, u.c, s1, freq, true))) break;
        j->total += freq;
        for (size_t k = 1; k < s1 && !st; k++) st = put(j, u.c, k, 0, false);
    }
    kv_ustr_free(&u);
    return st;
}

// --- the HMM tables: a Python literal reader -------------------------------------

typedef struct {
    const char *s;
    size_t n, i;
    const char *name;
} lit;

static void skip_ws(lit *p)
{
    for (;;) {
        while (p->i < p->n && isspace((unsigned char)p->s[p->i])) p->i++;
        if (p->i < p->n && p->s[p->i] == '#') { /* a comment runs to the line's end */
            while (p->i < p->n && p->s[p->i] != '\n') p->i++;
            continue;
        }
        return;
    }
}

static kv_status lit_err(const lit *p, const char *what)
{
    int line = 1;
    for (size_t k = 0; k < p->i && k < p->n; k++) line += p->s[k] == '\n';
    return kv_fail(KV_E_DATA, "%s:%d: %s", p->name, line, what);
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A quoted string holding exactly one code point (the keys of these tables
 * are state letters and characters). */
static kv_status lit_char(lit *p, uint32_t *out)
{
    skip_ws(p);
    if (p->i >= p->n || (p->s[p->i] != '\'' && p->s[p->i] != '"'))
        return lit_err(p, "expected a quoted string");
    char q = p->s[p->i++];
    uint32_t c = 0;
    int count = 0;
    while (p->i < p->n && p->s[p->i] != q) {
        char ch = p->s[p->i];
        if (ch == '\n') return lit_err(p, "unterminated string");
        if (ch == '\\') {
            if (p->i + 1 >= p->n) return lit_err(p, "unterminated string");
            char e = p->s[p->i + 1];
            int digits = e == 'u' ? 4 : e == 'U' ? 8 : e == 'x' ? 2 : 0;
            if (digits) {
                if (p->i + 2 + (size_t)digits > p->n) return lit_err(p, "bad escape");
                uint32_t v = 0;
                for (int k = 0; k < digits; k++) {
                    int h = hexval(p->s[p->i + 2 + (size_t)k]);
                    if (h < 0) return lit_err(p, "bad escape");
                    v = v * 16 + (uint32_t)h;
                }
                if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return lit_err(p, "bad escape");
                c = v;
                p->i += 2 + (size_t)digits;
            } else if (e == '\\' || e == '\'' || e == '"') {
                c = (uint32_t)e;
                p->i += 2;
            } else if (e == 'n' || e == 't' || e == 'r') {
                c = e == 'n' ? '\n' : e == 't' ? '\t' : '\r';
                p->i += 2;
            } else {
                return lit_err(p, "unsupported escape in a string");
            }
        } else {
            size_t at = p->i, k = p->i;
            unsigned char b0 = (unsigned char)ch;
            size_t l = b0 < 0x80 ? 1 : b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
            if (at + l > p->n || !kv_utf8_valid(p->s + at, l)) return lit_err(p, "invalid UTF-8");
            kv_ustr u;
            if (kv_utf8_decode(p->s + k, l, &u)) return lit_err(p, "invalid UTF-8");
            c = u.c[0];
            kv_ustr_free(&u);
            p->i += l;
        }
        count++;
    }
    if (p->i >= p->n) return lit_err(p, "unterminated string");
    p->i++;
    if (count != 1) return lit_err(p, "expected a one-character key");
    *out = c;
    return KV_OK;
}

static kv_status lit_number(lit *p, double *out)
{
    skip_ws(p);
    char buf[64];
    size_t k = 0;
    while (p->i < p->n && k + 1 < sizeof buf &&
           (isdigit((unsigned char)p->s[p->i]) || strchr("+-.eE", p->s[p->i])))
        buf[k++] = p->s[p->i++];
    buf[k] = 0;
    char *end;
    errno = 0;
    double v = k ? strtod(buf, &end) : 0;
    if (!k || *end || errno == ERANGE || !isfinite(v)) return lit_err(p, "expected a number");
    *out = v;
    return KV_OK;
}

static kv_status lit_expect(lit *p, char c, const char *what)
{
    skip_ws(p);
    if (p->i >= p->n || p->s[p->i] != c) return lit_err(p, what);
    p->i++;
    return KV_OK;
}

/* After an item: ',' then maybe '}', or '}'; *done when the dict closed. */
static kv_status lit_next(lit *p, bool *done)
{
    skip_ws(p);
    if (p->i < p->n && p->s[p->i] == ',') {
        p->i++;
        skip_ws(p);
    }
    *done = p->i < p->n && p->s[p->i] == '}';
    if (*done) p->i++;
    else if (p->i >= p->n) return lit_err(p, "unterminated dict");
    return KV_OK;
}

/* Skip to just after "P" "=" at the start of a line. */
static kv_status lit_assign(lit *p)
{
    for (size_t i = 0; i + 1 < p->n; i++) {
        if ((i == 0 || p->s[i - 1] == '\n') && p->s[i] == 'P') {
            size_t k = i + 1;
            while (k < p->n && (p->s[k] == ' ' || p->s[k] == '\t')) k++;
            if (k < p->n && p->s[k] == '=') {
                p->i = k + 1;
                return KV_OK;
            }
        }
    }
    return lit_err(p, "no \"P = {...}\" assignment");
}

static int state_of(uint32_t c)
{
    for (int s = 0; s < N_STATES; s++)
        if (c == (uint32_t)state_name[s]) return s;
    return -1;
}

static int cmp_emit(const void *x, const void *y)
{
    uint32_t a = ((const emit_entry *)x)->ch, b = ((const emit_entry *)y)->ch;
    return a < b ? -1 : a > b;
}

/* {'B': <inner>, ...}: inner is a number (start), a dict of states (trans)
 * or a dict of characters (emit). */
static kv_status parse_table(kv_jieba *j, lit *p, int kind)
{
    kv_status st = lit_assign(p);
    if (!st) st = lit_expect(p, '{', "expected '{'");
    bool seen[N_STATES] = {0}, done = false;
    skip_ws(p);
    if (!st && p->i < p->n && p->s[p->i] == '}') return lit_err(p, "empty table");
    while (!st && !done) {
        uint32_t key;
        if ((st = lit_char(p, &key))) break;
        int s = state_of(key);
        if (s < 0) return lit_err(p, "unknown state (want B, M, E or S)");
        if (seen[s]) return lit_err(p, "state listed twice");
        seen[s] = true;
        if ((st = lit_expect(p, ':', "expected ':'"))) break;
        if (kind == 0) {
            st = lit_number(p, &j->start[s]);
        } else {
            if ((st = lit_expect(p, '{', "expected '{'"))) break;
            skip_ws(p);
            bool idone = p->i < p->n && p->s[p->i] == '}';
            if (idone) p->i++;
            size_t cap = 0;
            while (!st && !idone) {
                uint32_t k2;
                double v;
                if ((st = lit_char(p, &k2))) break;
                if ((st = lit_expect(p, ':', "expected ':'"))) break;
                if ((st = lit_number(p, &v))) break;
                if (kind == 1) {
                    int t = state_of(k2);
                    if (t < 0) return lit_err(p, "unknown state (want B, M, E or S)");
                    j->trans[s][t] = v;
                } else {
                    if (j->n_emit[s] == cap) {
                        size_t nc = cap ? cap * 2 : 1024;
                        emit_entry *ne = realloc(j->emit[s], nc * sizeof *ne);
                        if (!ne) return kv_fail(KV_E_NOMEM, "jieba emission table");
                        j->emit[s] = ne;
                        cap = nc;
                    }
                    j->emit[s][j->n_emit[s]++] = (emit_entry){k2, v};
                }
                st = lit_next(p, &idone);
            }
            if (kind == 2 && !st && j->n_emit[s] > 1) {
                qsort(j->emit[s], j->n_emit[s], sizeof *j->emit[s], cmp_emit);
                for (size_t k = 1; k < j->n_emit[s]; k++)
                    if (j->emit[s][k].ch == j->emit[s][k - 1].ch)
                        return kv_fail(KV_E_DATA, "%s: character U+%04X listed twice for state %c",
                                       p->name, (unsigned)j->emit[s][k].ch, state_name[s]);
            }
        }
        if (!st) st = lit_next(p, &done);
    }
    if (st) return st;
    skip_ws(p);
    if (p->i < p->n) return lit_err(p, "unexpected text after the table");
    for (int s = 0; s < N_STATES; s++)
        if (!seen[s])
            return kv_fail(KV_E_DATA, "%s: state %c missing", p->name, state_name[s]);
    return KV_OK;
}

kv_status kv_jieba_load_hmm(kv_jieba *j, const char *start, size_t start_len,
                            const char *trans, size_t trans_len, const char *emit,
                            size_t emit_len)
{
    for (int s = 0; s < N_STATES; s++) {
        free(j->emit[s]);
        j->emit[s] = NULL;
        j->n_emit[s] = 0;
        for (int t = 0; t < N_STATES; t++) j->trans[s][t] = MIN_FLOAT;
    }
    j->have_hmm = false;
    lit a = {start, start_len, 0, "prob_start.py"};
    lit b = {trans, trans_len, 0, "prob_trans.py"};
    lit c = {emit, emit_len, 0, "prob_emit.py"};
    kv_status st = parse_table(j, &a, 0);
    if (!st) st = parse_table(j, &b, 1);
    if (!st) st = parse_table(j, &c, 2);
    j->have_hmm = st == KV_OK;
    return st;
}

kv_status kv_jieba_open(const char *dir, const char *dict_path, kv_jieba **out)
{
    *out = NULL;
    if (!dir) dir = KV_JIEBA_DEFAULT_DIR;
    static const char *const names[4] = {"dict.txt", "finalseg/prob_start.py",
                                         "finalseg/prob_trans.py", "finalseg/prob_emit.py"};
    char *buf[4] = {0};
    size_t len[4] = {0};
    char path[4][4096];
    kv_status st = KV_OK;
    for (int i = 0; i < 4 && !st; i++) {
        if (i == 0 && dict_path) snprintf(path[i], sizeof path[i], "%s", dict_path);
        else snprintf(path[i], sizeof path[i], "%s/%s", dir, names[i]);
        st = kv_file_slurp(path[i], 0, "jieba data", &buf[i], &len[i]);
        if (st == KV_E_NOINPUT)
            kv_errcontext("jieba's data are needed for the Chinese metrics (install python3-jieba "
                          "or pass --jieba DIR)");
    }
    kv_jieba *j = NULL;
    if (!st) st = kv_jieba_new(&j);
    if (!st) st = kv_jieba_load_dict(j, buf[0], len[0], path[0]);
    if (!st) {
        st = kv_jieba_load_hmm(j, buf[1], len[1], buf[2], len[2], buf[3], len[3]);
        if (st) kv_errcontext("%s/finalseg", dir);
    }
    for (int i = 0; i < 4; i++) free(buf[i]);
    if (st) {
        kv_jieba_free(j);
        return st;
    }
    *out = j;
    return KV_OK;
}

// --- cutting ------------------------------------------------------------------------

typedef struct {
    kv_span *v;
    size_t n, cap;
} spans;

static kv_status emit_tok(spans *t, size_t start, size_t len)
{
    if (len == 0) return KV_OK;
    if (t->n == t->cap) {
        size_t nc = t->cap ? t->cap * 2 : 64;
        kv_span *nv = realloc(t->v, nc * sizeof *nv);
        if (!nv) return kv_fail(KV_E_NOMEM, "jieba tokens");
        t->v = nv;
        t->cap = nc;
    }
    t->v[t->n++] = (kv_span){start, len};
    return KV_OK;
}

static bool is_hanzi(uint32_t c) { return c >= 0x4E00 && c <= 0x9FD5; }
static bool is_alnum_ascii(uint32_t c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}
/* re_han_default: [\u4E00-\u9FD5a-zA-Z0-9+#&\._%\-] */
static bool is_han_default(uint32_t c)
{
    return is_hanzi(c) || is_alnum_ascii(c) || c == '+' || c == '#' || c == '&' || c == '.' ||
           c == '_' || c == '%' || c == '-';
}

static double emit_lp(const kv_jieba *j, int s, uint32_t c)
{
    size_t lo = 0, hi = j->n_emit[s];
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (j->emit[s][mid].ch < c) lo = mid + 1;
        else hi = mid;
    }
    return lo < j->n_emit[s] && j->emit[s][lo].ch == c ? j->emit[s][lo].lp : MIN_FLOAT;
}

/* finalseg.__cut: Viterbi over a run of hanzi s[0..n), offset base. */
static kv_status hmm_cut_han(const kv_jieba *j, const uint32_t *s, size_t n, size_t base, spans *t)
{
    /* PrevStatus: the states each state may follow, in jieba's order */
    static const int prev[N_STATES][2] = {
        [ST_B] = {ST_E, ST_S}, [ST_M] = {ST_M, ST_B}, [ST_S] = {ST_S, ST_E}, [ST_E] = {ST_B, ST_M}};
    static const int order[N_STATES] = {ST_B, ST_M, ST_E, ST_S}; /* 'BMES' */
    double *v = malloc(n * N_STATES * sizeof *v);
    unsigned char *bp = malloc(n * N_STATES);
    if (!v || !bp) {
        free(v);
        free(bp);
        return kv_fail(KV_E_NOMEM, "jieba HMM over %zu characters", n);
    }
    for (int k = 0; k < N_STATES; k++) {
        int y = order[k];
        v[y] = j->start[y] + emit_lp(j, y, s[0]);
        bp[y] = (unsigned char)y;
    }
    for (size_t i = 1; i < n; i++) {
        for (int k = 0; k < N_STATES; k++) {
            int y = order[k];
            double em = emit_lp(j, y, s[i]);
            int best = -1;
            double bestp = 0;
            for (int q = 0; q < 2; q++) {
                int y0 = prev[y][q];
                double pr = v[(i - 1) * N_STATES + y0] + j->trans[y0][y] + em;
                /* max over (prob, state) tuples: ties go to the later letter */
                if (best < 0 || pr > bestp || (pr == bestp && state_name[y0] > state_name[best])) {
                    best = y0;
                    bestp = pr;
                }
            }
            v[i * N_STATES + y] = bestp;
            bp[i * N_STATES + y] = (unsigned char)best;
        }
    }
    double pe = v[(n - 1) * N_STATES + ST_E], ps = v[(n - 1) * N_STATES + ST_S];
    int state = ps >= pe ? ST_S : ST_E; /* ('S' > 'E') */
    unsigned char *path = malloc(n);
    kv_status st = path ? KV_OK : kv_fail(KV_E_NOMEM, "jieba HMM path");
    if (!st) {
        for (size_t i = n; i-- > 0;) {
            path[i] = (unsigned char)state;
            if (i) state = bp[i * N_STATES + state];
        }
        size_t begin = 0, nexti = 0;
        for (size_t i = 0; i < n && !st; i++) {
            if (path[i] == ST_B) {
                begin = i;
            } else if (path[i] == ST_E) {
                st = emit_tok(t, base + begin, i + 1 - begin);
                nexti = i + 1;
            } else if (path[i] == ST_S) {
                st = emit_tok(t, base + i, 1);
                nexti = i + 1;
            }
        }
        if (!st && nexti < n) st = emit_tok(t, base + nexti, n - nexti);
    }
    free(path);
    free(v);
    free(bp);
    return st;
}

/* finalseg.cut(buf): hanzi runs to the HMM; the rest split by
 * ([a-zA-Z0-9]+(?:\.\d+)?%?) into matches and the (non-empty) text between. */
static kv_status hmm_cut(const kv_jieba *j, const uint32_t *s, size_t n, size_t base, spans *t)
{
    kv_status st = KV_OK;
    for (size_t i = 0; i < n && !st;) {
        size_t e = i;
        if (is_hanzi(s[i])) {
            while (e < n && is_hanzi(s[e])) e++;
            st = hmm_cut_han(j, s + i, e - i, base + i, t);
            i = e;
            continue;
        }
        while (e < n && !is_hanzi(s[e])) e++;
        size_t k = i, gap = i; /* gap: start of the text before the next match */
        while (k < e && !st) {
            if (!is_alnum_ascii(s[k])) {
                k++;
                continue;
            }
            size_t m = k;
            while (m < e && is_alnum_ascii(s[m])) m++;
            if (m + 1 < e && s[m] == '.' && s[m + 1] >= '0' && s[m + 1] <= '9') {
                m += 2;
                while (m < e && s[m] >= '0' && s[m] <= '9') m++;
            }
            if (m < e && s[m] == '%') m++;
            st = emit_tok(t, base + gap, k - gap);
            if (!st) st = emit_tok(t, base + k, m - k);
            k = gap = m;
        }
        if (!st) st = emit_tok(t, base + gap, e - gap);
        i = e;
    }
    return st;
}

static double freq_of(const kv_jieba *j, const uint32_t *s, size_t n)
{
    const entry *x = find(j, s, n);
    return x && x->freq ? (double)x->freq : 1.0; /* FREQ.get(w) or 1 */
}

/* The gathered single characters buf = s[b0..b1) of __cut_DAG. */
static kv_status flush_buf(const kv_jieba *j, const uint32_t *s, size_t b0, size_t b1,
                           size_t base, spans *t)
{
    size_t n = b1 - b0;
    if (n == 0) return KV_OK;
    if (n == 1) return emit_tok(t, base + b0, 1);
    const entry *x = find(j, s + b0, n);
    if (!x || x->freq == 0) return hmm_cut(j, s + b0, n, base + b0, t);
    kv_status st = KV_OK;
    for (size_t k = b0; k < b1 && !st; k++) st = emit_tok(t, base + k, 1);
    return st;
}

/* __cut_DAG over one run s[0..n) of re_han_default characters. */
static kv_status dag_cut(const kv_jieba *j, const uint32_t *s, size_t n, size_t base, spans *t)
{
    double *rp = malloc((n + 1) * sizeof *rp);  /* route[x][0] */
    size_t *rx = malloc((n + 1) * sizeof *rx);  /* route[x][1] */
    size_t *dag = malloc((n + 1) * sizeof *dag);
    if (!rp || !rx || !dag) {
        free(rp);
        free(rx);
        free(dag);
        return kv_fail(KV_E_NOMEM, "jieba route over %zu characters", n);
    }
    const double logtotal = log((double)j->total);
    rp[n] = 0;
    rx[n] = 0;
    for (size_t idx = n; idx-- > 0;) {
        /* DAG[idx]: every end i of a word s[idx..i] of positive frequency,
         * scanning while s[idx..i] is in the prefix dictionary; [idx] if none */
        size_t nd = 0;
        for (size_t i = idx; i < n; i++) {
            const entry *x = find(j, s + idx, i - idx + 1);
            if (!x) break;
            if (x->freq) dag[nd++] = i;
        }
        if (!nd) dag[nd++] = idx;
        double best = 0;
        size_t bx = 0;
        for (size_t q = 0; q < nd; q++) {
            size_t x = dag[q];
            double p = log(freq_of(j, s + idx, x - idx + 1)) - logtotal + rp[x + 1];
            if (q == 0 || p > best || (p == best && x > bx)) {
                best = p;
                bx = x;
            }
        }
        rp[idx] = best;
        rx[idx] = bx;
    }
    kv_status st = KV_OK;
    size_t x = 0, b0 = 0, b1 = 0; /* buf = s[b0..b1) */
    while (x < n && !st) {
        size_t y = rx[x] + 1;
        if (y - x == 1) {
            if (b1 == b0) b0 = b1 = x;
            b1 = y;
        } else {
            st = flush_buf(j, s, b0, b1, base, t);
            b0 = b1 = y;
            if (!st) st = emit_tok(t, base + x, y - x);
        }
        x = y;
    }
    if (!st) st = flush_buf(j, s, b0, b1, base, t);
    free(rp);
    free(rx);
    free(dag);
    return st;
}

kv_status kv_jieba_cut(const kv_jieba *j, const uint32_t *s, size_t n, kv_span **tok,
                       size_t *ntok)
{
    *tok = NULL;
    *ntok = 0;
    if (!j->have_hmm) return kv_fail(KV_E_USAGE, "jieba: the HMM tables are not loaded");
    if (j->total <= 0)
        return kv_fail(KV_E_DATA, "jieba: the dictionary has no word of positive frequency");
    spans t = {0};
    kv_status st = KV_OK;
    for (size_t i = 0; i < n && !st;) {
        size_t e = i;
        if (is_han_default(s[i])) {
            while (e < n && is_han_default(s[e])) e++;
            st = dag_cut(j, s + i, e - i, i, &t);
        } else {
            /* re_skip (\r\n|\s) separators and every other character alone */
            e = i + (s[i] == '\r' && i + 1 < n && s[i + 1] == '\n' ? 2 : 1);
            st = emit_tok(&t, i, e - i);
        }
        i = e;
    }
    if (st) {
        free(t.v);
        return st;
    }
    *tok = t.v;
    *ntok = t.n;
    return KV_OK;
}
