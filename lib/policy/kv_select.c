/*
 * kv_select: the resident selection index of sparse layers and its scores
 * (see kv_select.h).  Plain float arithmetic in a fixed order, so that the
 * GPU kernels can be checked against it by normalized error.
 */
#include "policy/kv_select.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* NaN ranks below every number (a poisoned channel is never critical). */
static inline float rank_val(float x) { return isnan(x) ? -INFINITY : x; }

void kv_select_pick_channels(const float *q, int n, const float *chmax, int n_heads, int H, int D,
                             int C, int *chans)
{
    const int g = n_heads / H;
    float sc[1024];
    unsigned char taken[1024];
    if (D > 1024) D = 1024; /* kv_policy_check refuses larger heads */
    if (C > D) C = D;
    for (int kh = 0; kh < H; kh++) {
        for (int c = 0; c < D; c++) {
            double a = 0.0;
            for (int h = 0; h < g && n > 0; h++)
                for (int j = 0; j < n; j++)
                    a += fabsf(q[(((size_t)kh * g + h) * (size_t)n + j) * (size_t)D + c]);
            float m = kv_round_half(chmax[(size_t)kh * D + c]);
            sc[c] = rank_val(n > 0 ? (float)a * m : m);
            taken[c] = 0;
        }
        /* C passes of "largest not yet taken", ties to the lower channel */
        for (int i = 0; i < C; i++) {
            int best = -1;
            for (int c = 0; c < D; c++)
                if (!taken[c] && (best < 0 || sc[c] > sc[best])) best = c;
            taken[best] = 1;
        }
        int m = 0;
        for (int c = 0; c < D; c++)
            if (taken[c]) chans[(size_t)kh * C + m++] = c;
    }
}

uint64_t kv_select_rows_bytes(int C, int T, int cbits)
{
    if (cbits >= 16) return (uint64_t)C * (uint64_t)T * 2u;
    uint64_t codes = ((uint64_t)T * (uint64_t)cbits + 7u) / 8u;
    uint64_t groups = ((uint64_t)T + KV_SELECT_CGROUP - 1) / KV_SELECT_CGROUP;
    return (uint64_t)C * (codes + groups * 4u);
}

void kv_select_channel_row(const float *x, size_t ldx, int T, int cbits, uint8_t *codes,
                           kv_half *scale, kv_half *zero, float *out, size_t ldo)
{
    if (cbits >= 16) {
        for (int t = 0; t < T; t++) out[(size_t)t * ldo] = kv_round_half(x[(size_t)t * ldx]);
        return;
    }
    const float maxq = (float)((1 << cbits) - 1);
    for (int t0 = 0, gi = 0; t0 < T; t0 += KV_SELECT_CGROUP, gi++) {
        int n = T - t0 < KV_SELECT_CGROUP ? T - t0 : KV_SELECT_CGROUP;
        float mn = x[(size_t)t0 * ldx], mx = mn;
        for (int i = 1; i < n; i++) {
            float v = x[(size_t)(t0 + i) * ldx];
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
        }
        kv_half hs = kv_f32_to_half((mx - mn) / maxq), hz = kv_f32_to_half(mn);
        float s = kv_half_to_f32(hs), z = kv_half_to_f32(hz);
        const float sd = (s > 0.0f && s < INFINITY) ? s : INFINITY;
        if (scale) scale[gi] = hs;
        if (zero) zero[gi] = hz;
        for (int i = 0; i < n; i++) {
            float v = rintf((x[(size_t)(t0 + i) * ldx] - z) / sd);
            v = v > 0.0f ? v : 0.0f; /* NaN compares false: code 0 */
            v = v < maxq ? v : maxq;
            uint8_t code = (uint8_t)(int)v;
            if (codes) codes[t0 + i] = code;
            /* a NaN key stays NaN in the index, so that its score ranks last
             * as at 16 bits (its code is 0) */
            const float xv = x[(size_t)(t0 + i) * ldx];
            out[(size_t)(t0 + i) * ldo] = isnan(xv) ? xv : z + (sd < INFINITY ? s : 0.0f) * (float)code;
        }
    }
}

void kv_select_page_bounds(const float *k, size_t ldk, int T, int D, int P, float *pmin,
                           float *pmax)
{
    const int np = (T + P - 1) / P;
    for (int p = 0; p < np; p++) {
        int t0 = p * P, t1 = t0 + P < T ? t0 + P : T;
        float *mn = pmin + (size_t)p * D, *mx = pmax + (size_t)p * D;
        for (int c = 0; c < D; c++) mn[c] = mx[c] = k[(size_t)t0 * ldk + c];
        for (int t = t0 + 1; t < t1; t++)
            for (int c = 0; c < D; c++) {
                float v = k[(size_t)t * ldk + c];
                mn[c] = v < mn[c] ? v : mn[c];
                mx[c] = v > mx[c] ? v : mx[c];
            }
        for (int c = 0; c < D; c++) { /* to nearest: a bound up to fp16 rounding */
            mn[c] = kv_round_half(mn[c]);
            mx[c] = kv_round_half(mx[c]);
        }
    }
}

void kv_select_pool_channels(const float *q, int g, int D, const float *chmax, const int *pool,
                             int R, int C, int *cols)
{
    float sc[1024];
    unsigned char taken[1024] = {0};
    (void)D;
    for (int j = 0; j < R; j++) {
        float a = 0.0f;
        for (int h = 0; h < g; h++) a += fabsf(q[(size_t)h * D + pool[j]]);
        sc[j] = rank_val(a * kv_round_half(chmax[pool[j]]));
    }
    for (int i = 0; i < C; i++) {
        int best = -1;
        for (int j = 0; j < R; j++)
            if (!taken[j] && (best < 0 || sc[j] > sc[best])) best = j;
        taken[best] = 1;
    }
    for (int j = 0, m = 0; j < R; j++)
        if (taken[j]) cols[m++] = j;
}

void kv_select_score_rows(const float *q, int g, int D, const int *chans, const int *cols, int C,
                          const float *vals, size_t ldv, int n, float *score)
{
    for (int h = 0; h < g; h++) {
        const float *qh = q + (size_t)h * D;
        double l1_all = 0.0, l1_c = 0.0;
        for (int c = 0; c < D; c++) l1_all += fabsf(qh[c]);
        for (int j = 0; j < C; j++) l1_c += fabsf(qh[chans[j]]);
        double temp = l1_all <= 0.0 ? (double)D : (double)D * l1_c / l1_all;
        float s = temp > 0.0 ? (float)(1.0 / sqrt(temp)) : 0.0f;
        float qc[1024];
        for (int j = 0; j < C; j++) qc[j] = qh[chans[j]];
        float *o = score + (size_t)h * n;
        for (int i = 0; i < n; i++) {
            const float *r = vals + (size_t)i * ldv;
            float d = 0.0f;
            if (cols)
                for (int j = 0; j < C; j++) d += qc[j] * r[cols[j]];
            else
                for (int j = 0; j < C; j++) d += qc[j] * r[j];
            o[i] = d * s;
        }
    }
}

void kv_select_score_pages(const float *q, int g, int D, const float *pmin, const float *pmax,
                           int np, float *score)
{
    const float s = 1.0f / sqrtf((float)D);
    for (int h = 0; h < g; h++) {
        const float *qh = q + (size_t)h * D;
        for (int p = 0; p < np; p++) {
            const float *mn = pmin + (size_t)p * D, *mx = pmax + (size_t)p * D;
            float d = 0.0f;
            for (int c = 0; c < D; c++) {
                float a = qh[c] * mn[c], b = qh[c] * mx[c];
                d += a > b ? a : b;
            }
            score[(size_t)h * np + p] = d * s;
        }
    }
}

static inline float combine_w(float x, float mx)
{
    x = rank_val(x);
    return mx == INFINITY ? (float)(x == INFINITY) : mx == -INFINITY ? 0.0f : expf(x - mx);
}

void kv_select_combine(const float *score, int g, int n, int reduce_max, float *comb)
{
    for (int i = 0; i < n; i++) comb[i] = 0.0f;
    for (int h = 0; h < g; h++) {
        const float *sc = score + (size_t)h * n;
        float mx = -INFINITY;
        for (int i = 0; i < n; i++)
            if (rank_val(sc[i]) > mx) mx = rank_val(sc[i]);
        /* a NaN score weighs 0 (through the sum it would blank every
         * probability of the head); +inf scores share the head's mass, and
         * a head without a finite score adds nothing */
        double sum = 0.0;
        for (int i = 0; i < n; i++) sum += combine_w(sc[i], mx);
        float inv = sum > 0.0 ? (float)(1.0 / sum) : 0.0f;
        for (int i = 0; i < n; i++) {
            float pr = combine_w(sc[i], mx) * inv;
            if (reduce_max) comb[i] = pr > comb[i] ? pr : comb[i];
            else comb[i] += pr;
        }
    }
}

void kv_select_pca(const float *k, size_t ldk, int T, int D, int r, float *mean, float *basis)
{
    double *a = calloc((size_t)D * D, sizeof *a), *v = calloc((size_t)D * D, sizeof *v);
    double *mu = calloc((size_t)D, sizeof *mu);
    if (!a || !v || !mu) { /* no memory: the first r channels, a valid if poor basis */
        for (int i = 0; i < r; i++)
            for (int c = 0; c < D; c++) basis[(size_t)i * D + c] = c == i ? 1.0f : 0.0f;
        for (int c = 0; c < D; c++) mean[c] = 0.0f;
        free(a), free(v), free(mu);
        return;
    }
    for (int t = 0; t < T; t++)
        for (int c = 0; c < D; c++) mu[c] += k[(size_t)t * ldk + c];
    for (int c = 0; c < D; c++) mu[c] = T > 0 ? mu[c] / T : 0.0;
    for (int t = 0; t < T; t++) {
        const float *x = k + (size_t)t * ldk;
        for (int i = 0; i < D; i++) {
            double di = x[i] - mu[i];
            if (!isfinite(di)) continue; /* a poisoned key adds nothing */
            for (int j = i; j < D; j++) a[(size_t)i * D + j] += di * (x[j] - mu[j]);
        }
    }
    for (int i = 0; i < D; i++) {
        v[(size_t)i * D + i] = 1.0;
        for (int j = 0; j < i; j++) a[(size_t)i * D + j] = a[(size_t)j * D + i];
    }
    /* cyclic Jacobi: rotate away every off-diagonal entry, sweep after sweep */
    for (int sweep = 0; sweep < 30; sweep++) {
        double off = 0, tot = 0;
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++) {
                double x = a[(size_t)i * D + j] * a[(size_t)i * D + j];
                tot += x;
                if (i != j) off += x;
            }
        if (!(off > 1e-24 * tot)) break;
        for (int p = 0; p < D - 1; p++)
            for (int q = p + 1; q < D; q++) {
                double apq = a[(size_t)p * D + q];
                if (fabs(apq) < 1e-300) continue;
                double app = a[(size_t)p * D + p], aqq = a[(size_t)q * D + q];
                double th = (aqq - app) / (2.0 * apq);
                double t = (th >= 0 ? 1.0 : -1.0) / (fabs(th) + sqrt(th * th + 1.0));
                double c = 1.0 / sqrt(t * t + 1.0), s = t * c;
                for (int m = 0; m < D; m++) { /* columns p and q */
                    double amp = a[(size_t)m * D + p], amq = a[(size_t)m * D + q];
                    a[(size_t)m * D + p] = c * amp - s * amq;
                    a[(size_t)m * D + q] = s * amp + c * amq;
                }
                for (int m = 0; m < D; m++) { /* rows p and q */
                    double apm = a[(size_t)p * D + m], aqm = a[(size_t)q * D + m];
                    a[(size_t)p * D + m] = c * apm - s * aqm;
                    a[(size_t)q * D + m] = s * apm + c * aqm;
                }
                for (int m = 0; m < D; m++) { /* eigenvectors in the columns of v */
                    double vmp = v[(size_t)m * D + p], vmq = v[(size_t)m * D + q];
                    v[(size_t)m * D + p] = c * vmp - s * vmq;
                    v[(size_t)m * D + q] = s * vmp + c * vmq;
                }
            }
    }
    /* the r largest eigenvalues, largest first (ties to the lower index) */
    unsigned char taken[256] = {0};
    for (int i = 0; i < r; i++) {
        int best = -1;
        for (int j = 0; j < D; j++)
            if (!taken[j] && (best < 0 || a[(size_t)j * D + j] > a[(size_t)best * D + best])) best = j;
        taken[best] = 1;
        /* a sign convention, so that equal inputs give equal bases */
        int big = 0;
        for (int m = 1; m < D; m++)
            if (fabs(v[(size_t)m * D + best]) > fabs(v[(size_t)big * D + best])) big = m;
        double sg = v[(size_t)big * D + best] < 0 ? -1.0 : 1.0;
        for (int m = 0; m < D; m++) basis[(size_t)i * D + m] = (float)(sg * v[(size_t)m * D + best]);
    }
    for (int c = 0; c < D; c++) mean[c] = (float)mu[c];
    free(a);
    free(v);
    free(mu);
}

void kv_select_project(const float *basis, const float *mean, int r, int D, const float *x,
                       float *out)
{
    for (int i = 0; i < r; i++) {
        const float *b = basis + (size_t)i * D;
        float d = 0.0f;
        if (mean)
            for (int c = 0; c < D; c++) d += b[c] * (x[c] - mean[c]);
        else
            for (int c = 0; c < D; c++) d += b[c] * x[c];
        out[i] = d;
    }
}

void kv_select_score_proj(const float *qp, int g, int r, int D, const float *vals, size_t ldv,
                          int n, float *score)
{
    const float s = 1.0f / sqrtf((float)D);
    for (int h = 0; h < g; h++) {
        const float *qh = qp + (size_t)h * r;
        float *o = score + (size_t)h * n;
        for (int i = 0; i < n; i++) {
            const float *x = vals + (size_t)i * ldv;
            float d = 0.0f;
            for (int j = 0; j < r; j++) d += qh[j] * x[j];
            o[i] = d * s;
        }
    }
}
