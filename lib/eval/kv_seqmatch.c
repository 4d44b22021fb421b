/*
 * difflib's SequenceMatcher over code points (see kv_seqmatch.h).  b2j is
 * a sorted index: b's positions ordered by (element, position), with the
 * distinct elements and the start of each one's run, found by binary
 * search.  j2len, Python's dict from j to the length of the match ending at
 * (i-1, j), becomes two arrays over j with row stamps, so a row touches
 * only the entries it sets.
 */
#include "eval/kv_seqmatch.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const uint32_t *a, *b;
    size_t na, nb;
    uint32_t *vals;   /* (nv) distinct indexed elements of b, ascending */
    size_t *start;    /* (nv + 1) run of each value in pos[] */
    size_t *pos;      /* positions of b, by (element, position) */
    size_t nv;
    size_t *len0, *len1;   /* (nb + 1) j2len of the previous / current row */
    uint64_t *st0, *st1;   /* (nb + 1) row stamp of each entry */
    uint64_t row;
} matcher;

static int cmp_pos(const void *x, const void *y, void *ctx)
{
    const uint32_t *b = ctx;
    size_t i = *(const size_t *)x, j = *(const size_t *)y;
    if (b[i] != b[j]) return b[i] < b[j] ? -1 : 1;
    return i < j ? -1 : i > j;
}

static kv_status build(matcher *m)
{
    size_t nb = m->nb;
    size_t *all = malloc((nb + 1) * sizeof *all);
    m->vals = malloc((nb + 1) * sizeof *m->vals);
    m->start = malloc((nb + 2) * sizeof *m->start);
    m->pos = malloc((nb + 1) * sizeof *m->pos);
    m->len0 = calloc(nb + 1, sizeof *m->len0);
    m->len1 = calloc(nb + 1, sizeof *m->len1);
    m->st0 = calloc(nb + 1, sizeof *m->st0);
    m->st1 = calloc(nb + 1, sizeof *m->st1);
    if (!all || !m->vals || !m->start || !m->pos || !m->len0 || !m->len1 || !m->st0 || !m->st1) {
        free(all);
        return kv_fail(KV_E_NOMEM, "sequence matcher of %zu elements", nb);
    }
    for (size_t j = 0; j < nb; j++) all[j] = j;
    qsort_r(all, nb, sizeof *all, cmp_pos, (void *)m->b);
    /* autojunk: with 200 or more elements, drop the popular ones */
    size_t ntest = nb >= 200 ? nb / 100 + 1 : (size_t)-1;
    size_t np = 0;
    m->nv = 0;
    for (size_t r = 0; r < nb;) {
        size_t e = r;
        while (e < nb && m->b[all[e]] == m->b[all[r]]) e++;
        if (e - r <= ntest) {
            m->vals[m->nv] = m->b[all[r]];
            m->start[m->nv++] = np;
            for (size_t k = r; k < e; k++) m->pos[np++] = all[k];
        }
        r = e;
    }
    m->start[m->nv] = np;
    free(all);
    m->row = 0;
    return KV_OK;
}

static void release(matcher *m)
{
    free(m->vals);
    free(m->start);
    free(m->pos);
    free(m->len0);
    free(m->len1);
    free(m->st0);
    free(m->st1);
}

/* The run of b-positions holding value v (empty when v is not indexed). */
static void lookup(const matcher *m, uint32_t v, size_t *lo, size_t *hi)
{
    size_t l = 0, h = m->nv;
    while (l < h) {
        size_t mid = (l + h) / 2;
        if (m->vals[mid] < v) l = mid + 1;
        else h = mid;
    }
    if (l < m->nv && m->vals[l] == v) {
        *lo = m->start[l];
        *hi = m->start[l + 1];
    } else {
        *lo = *hi = 0;
    }
}

/* find_longest_match(alo, ahi, blo, bhi) without junk. */
static void longest(matcher *m, size_t alo, size_t ahi, size_t blo, size_t bhi, size_t *bi,
                    size_t *bj, size_t *bk)
{
    size_t besti = alo, bestj = blo, bestsize = 0;
    uint64_t prev_row = 0; /* stamp 0 is never valid: rows start at 1 */
    for (size_t i = alo; i < ahi; i++) {
        uint64_t cur = ++m->row;
        size_t lo, hi;
        lookup(m, m->a[i], &lo, &hi);
        for (size_t p = lo; p < hi; p++) {
            size_t j = m->pos[p];
            if (j < blo) continue;
            if (j >= bhi) break;
            size_t k = (j > 0 && prev_row && m->st0[j - 1] == prev_row ? m->len0[j - 1] : 0) + 1;
            m->len1[j] = k;
            m->st1[j] = cur;
            if (k > bestsize) {
                besti = i + 1 - k;
                bestj = j + 1 - k;
                bestsize = k;
            }
        }
        /* the current row becomes the previous one */
        size_t *tl = m->len0;
        m->len0 = m->len1;
        m->len1 = tl;
        uint64_t *ts = m->st0;
        m->st0 = m->st1;
        m->st1 = ts;
        prev_row = cur;
    }
    while (besti > alo && bestj > blo && m->a[besti - 1] == m->b[bestj - 1]) {
        besti--;
        bestj--;
        bestsize++;
    }
    while (besti + bestsize < ahi && bestj + bestsize < bhi &&
           m->a[besti + bestsize] == m->b[bestj + bestsize])
        bestsize++;
    *bi = besti;
    *bj = bestj;
    *bk = bestsize;
}

kv_status kv_seqmatch_matches(const uint32_t *a, size_t na, const uint32_t *b, size_t nb,
                              size_t *matches)
{
    *matches = 0;
    if (na == 0 || nb == 0) return KV_OK;
    matcher m = {.a = a, .b = b, .na = na, .nb = nb};
    kv_status st = build(&m);
    /* the queue never holds more than one entry per matched block + 1 */
    size_t cap = 64, nq = 0;
    size_t (*q)[4] = st ? NULL : malloc(cap * sizeof *q);
    if (!st && !q) st = kv_fail(KV_E_NOMEM, "sequence matcher queue");
    if (!st) {
        q[nq][0] = 0, q[nq][1] = na, q[nq][2] = 0, q[nq][3] = nb, nq++;
    }
    while (!st && nq) {
        nq--;
        size_t alo = q[nq][0], ahi = q[nq][1], blo = q[nq][2], bhi = q[nq][3];
        size_t i, j, k;
        longest(&m, alo, ahi, blo, bhi, &i, &j, &k);
        if (!k) continue;
        *matches += k;
        if (nq + 2 > cap) {
            size_t nc = cap * 2;
            size_t (*nqp)[4] = realloc(q, nc * sizeof *q);
            if (!nqp) {
                st = kv_fail(KV_E_NOMEM, "sequence matcher queue");
                break;
            }
            q = nqp;
            cap = nc;
        }
        if (alo < i && blo < j) q[nq][0] = alo, q[nq][1] = i, q[nq][2] = blo, q[nq][3] = j, nq++;
        if (i + k < ahi && j + k < bhi)
            q[nq][0] = i + k, q[nq][1] = ahi, q[nq][2] = j + k, q[nq][3] = bhi, nq++;
    }
    free(q);
    release(&m);
    return st;
}

kv_status kv_seqmatch_ratio(const uint32_t *a, size_t na, const uint32_t *b, size_t nb,
                            double *ratio)
{
    size_t mt;
    kv_status st = kv_seqmatch_matches(a, na, b, nb, &mt);
    if (st) return st;
    size_t len = na + nb;
    *ratio = len ? 2.0 * (double)mt / (double)len : 1.0;
    return KV_OK;
}

kv_status kv_fuzz_ratio(const uint32_t *a, size_t na, const uint32_t *b, size_t nb, int *out)
{
    if (na == nb && (na == 0 || !memcmp(a, b, na * sizeof *a))) {
        *out = 100; /* check_for_equivalence comes before the empty check */
        return KV_OK;
    }
    if (na == 0 || nb == 0) {
        *out = 0;
        return KV_OK;
    }
    double r;
    kv_status st = kv_seqmatch_ratio(a, na, b, nb, &r);
    if (st) return st;
    *out = (int)nearbyint(100 * r); /* round-half-even, as Python's round() */
    return KV_OK;
}
