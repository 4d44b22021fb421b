/*
 * Real attention inputs for the attention tests: layer 0 of the trained
 * niah4k model (tests/data/niah4k, head_dim 64, 4 query / 2 KV heads) run
 * over the first T bytes of its needle tasks file.  Layer 0 needs no
 * attention to compute its K, V and Q (embedding, RMSNorm, projections,
 * RoPE as llama2.c does them), so the tests get learned K/V statistics --
 * outlier channels included -- without depending on the model engine.
 */
#ifndef ATTN_REALDATA_H
#define ATTN_REALDATA_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NIAH_BIN "tests/data/niah4k/niah4k.bin"
#define NIAH_TEXT "tests/data/niah4k/tasks-dev.jsonl"

typedef struct {
    int n_heads, n_kv_heads, head_dim, T;
    float *q; /* (n_heads, head_dim): the last token's query */
    float *k; /* (kv_heads, T, head_dim) */
    float *v; /* (kv_heads, T, head_dim) */
} niah_layer0;

static void niah_layer0_free(niah_layer0 *r)
{
    free(r->q), free(r->k), free(r->v);
    memset(r, 0, sizeof *r);
}

/* 0 on success, -1 when the asset is missing or malformed. */
static int niah_layer0_load(int T, niah_layer0 *r)
{
    memset(r, 0, sizeof *r);
    FILE *f = fopen(NIAH_BIN, "rb"), *tf = fopen(NIAH_TEXT, "rb");
    int hdr[7];
    unsigned char *text = malloc((size_t)T);
    int ok = f && tf && text && fread(hdr, sizeof(int), 7, f) == 7 &&
             fread(text, 1, (size_t)T - 1, tf) == (size_t)T - 1;
    const int dim = ok ? hdr[0] : 0, nl = ok ? hdr[2] : 0, nh = ok ? hdr[3] : 0,
              nkv = ok ? hdr[4] : 0, vocab = ok ? abs(hdr[5]) : 0;
    ok = ok && dim == 256 && nh == 4 && nkv == 2 && vocab == 259 && nl >= 1;
    const int hs = ok ? dim / nh : 0, kvd = hs * nkv;
    float *emb = NULL, *rms = NULL, *wq = NULL, *wk = NULL, *wv = NULL, *x = NULL, *q = NULL;
    if (ok) {
        emb = malloc((size_t)vocab * dim * sizeof(float));
        rms = malloc((size_t)dim * sizeof(float));
        wq = malloc((size_t)dim * dim * sizeof(float));
        wk = malloc((size_t)kvd * dim * sizeof(float));
        wv = malloc((size_t)kvd * dim * sizeof(float));
        x = malloc((size_t)dim * sizeof(float));
        q = malloc((size_t)dim * sizeof(float));
        r->k = malloc((size_t)T * kvd * sizeof(float));
        r->v = malloc((size_t)T * kvd * sizeof(float));
        r->q = malloc((size_t)dim * sizeof(float));
        long l0 = 7 * sizeof(int);
        ok = emb && rms && wq && wk && wv && x && q && r->k && r->v && r->q &&
             fread(emb, sizeof(float), (size_t)vocab * dim, f) == (size_t)vocab * dim &&
             fread(rms, sizeof(float), (size_t)dim, f) == (size_t)dim && /* layer 0 */
             fseek(f, l0 + (long)sizeof(float) * ((long)vocab * dim + (long)nl * dim), SEEK_SET) == 0 &&
             fread(wq, sizeof(float), (size_t)dim * dim, f) == (size_t)dim * dim &&
             fseek(f, l0 + (long)sizeof(float) * ((long)vocab * dim + (long)nl * dim + (long)nl * dim * dim), SEEK_SET) == 0 &&
             fread(wk, sizeof(float), (size_t)kvd * dim, f) == (size_t)kvd * dim &&
             fseek(f, l0 + (long)sizeof(float) * ((long)vocab * dim + (long)nl * dim + (long)nl * dim * dim + (long)nl * dim * kvd), SEEK_SET) == 0 &&
             fread(wv, sizeof(float), (size_t)kvd * dim, f) == (size_t)kvd * dim;
    }
    float *kt = ok ? malloc((size_t)kvd * sizeof(float)) : NULL, *vt = ok ? malloc((size_t)kvd * sizeof(float)) : NULL;
    ok = ok && kt && vt;
    for (int pos = 0; ok && pos < T; pos++) {
        int tok = pos == 0 ? 1 : text[pos - 1] + 3; /* BOS, then one token per byte */
        memcpy(x, emb + (size_t)tok * dim, (size_t)dim * sizeof(float));
        double ss = 0;
        for (int i = 0; i < dim; i++) ss += (double)x[i] * x[i];
        float inv = (float)(1.0 / sqrt(ss / dim + 1e-5));
        for (int i = 0; i < dim; i++) x[i] = x[i] * inv * rms[i];
        for (int o = 0; o < kvd; o++) {
            float a = 0, b = 0;
            for (int i = 0; i < dim; i++) {
                a += wk[(size_t)o * dim + i] * x[i];
                b += wv[(size_t)o * dim + i] * x[i];
            }
            kt[o] = a, vt[o] = b;
        }
        if (pos == T - 1)
            for (int o = 0; o < dim; o++) {
                float a = 0;
                for (int i = 0; i < dim; i++) a += wq[(size_t)o * dim + i] * x[i];
                q[o] = a;
            }
        for (int i = 0; i < dim; i += 2) { /* RoPE, interleaved pairs */
            float fr = 1.0f / powf(10000.0f, (float)(i % hs) / (float)hs);
            float c = cosf(pos * fr), s = sinf(pos * fr);
            if (i < kvd) {
                float a = kt[i], b = kt[i + 1];
                kt[i] = a * c - b * s, kt[i + 1] = a * s + b * c;
            }
            if (pos == T - 1) {
                float a = q[i], b = q[i + 1];
                q[i] = a * c - b * s, q[i + 1] = a * s + b * c;
            }
        }
        for (int h = 0; h < nkv; h++) {
            memcpy(r->k + ((size_t)h * T + pos) * hs, kt + h * hs, (size_t)hs * sizeof(float));
            memcpy(r->v + ((size_t)h * T + pos) * hs, vt + h * hs, (size_t)hs * sizeof(float));
        }
    }
    if (ok) {
        memcpy(r->q, q, (size_t)dim * sizeof(float));
        r->n_heads = nh, r->n_kv_heads = nkv, r->head_dim = hs, r->T = T;
    }
    free(kt), free(vt), free(emb), free(rms), free(wq), free(wk), free(wv), free(x), free(q), free(text);
    if (f) fclose(f);
    if (tf) fclose(tf);
    if (!ok) niah_layer0_free(r);
    return ok ? 0 : -1;
}

#endif
