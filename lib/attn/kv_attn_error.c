/*
 * Attention probabilities and the relative attention-output error of an
 * approximate K/V against the exact one, measured on stored queries: what
 * kv-profile classifies layers by and what kv-quant reports per layer.
 */
#include <math.h>
#include <stdlib.h>

#include "attn/kv_attn.h"

// --- attention ---------------------------------------------------------------

float kv_attn_dot(const float *a, const float *b, int n)
{
    float s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

void kv_attn_probs(const float *qv, const float *k, int n, int D, float *p)
{
    const float sc = 1.0f / sqrtf((float)D);
    float mx = -INFINITY;
    for (int t = 0; t < n; t++) {
        p[t] = kv_attn_dot(qv, k + (size_t)t * D, D) * sc;
        if (p[t] > mx) mx = p[t];
    }
    double z = 0;
    for (int t = 0; t < n; t++) z += (p[t] = expf(p[t] - mx));
    for (int t = 0; t < n; t++) p[t] = (float)(p[t] / z);
}

void kv_attn_out(const float *p, const float *v, int n, int D, double *o)
{
    for (int c = 0; c < D; c++) o[c] = 0;
    for (int t = 0; t < n; t++) {
        if (p[t] == 0) continue;
        const float *vr = v + (size_t)t * D;
        for (int c = 0; c < D; c++) o[c] += (double)p[t] * vr[c];
    }
}

double kv_attn_rel_error(const float *q, int n_heads, int nq, const float *k, const float *v,
                         const float *k2, const float *v2, int H, int T, int D,
                         double *per_head)
{
    float *p = malloc((size_t)T * sizeof *p);
    double *o = malloc((size_t)2 * D * sizeof *o);
    if (!p || !o) {
        free(p);
        free(o);
        return NAN;
    }
    double num = 0, den = 0;
    for (int qh = 0; qh < n_heads; qh++) {
        int h = qh / (n_heads / H);
        size_t off = (size_t)h * T * D;
        double hn = 0, hd = 0;
        for (int j = 0; j < nq; j++) {
            const float *qv = q + ((size_t)qh * nq + j) * D;
            int n = T - nq + j + 1;
            kv_attn_probs(qv, k + off, n, D, p);
            kv_attn_out(p, v + off, n, D, o);
            kv_attn_probs(qv, k2 + off, n, D, p);
            kv_attn_out(p, v2 + off, n, D, o + D);
            for (int c = 0; c < D; c++) {
                hn += (o[D + c] - o[c]) * (o[D + c] - o[c]);
                hd += o[c] * o[c];
            }
        }
        if (per_head) per_head[qh] = hd > 0 ? sqrt(hn / hd) : 0;
        num += hn;
        den += hd;
    }
    free(p);
    free(o);
    return den > 0 ? sqrt(num / den) : 0;
}

