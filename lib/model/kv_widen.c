/*
 * kv_widen (see kv_widen.h): the small model's weights written into a
 * zeroed block of the large shape.
 */
#include "model/kv_widen.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_half.h"
#include "model/kv_matmul.h"

enum { W_Q, W_K, W_V, W_O, W_GATE, W_DOWN, W_UP, W_COUNT };

typedef struct {
    const kv_model *s;
    const kv_model_config *b;
    kv_dtype wt;
    size_t es;
    int k;                /* large head_dim / small head_dim */
    float scale;          /* s = sqrt(dim_big / dim_small) */
    size_t rows[W_COUNT], cols[W_COUNT];
    float *row;           /* scratch: one small row (the widest) */
} widen;

static void put(const widen *w, void *base, size_t i, float v)
{
    if (w->wt == KV_DT_F32) ((float *)base)[i] = v;
    else if (w->wt == KV_DT_F16) ((uint16_t *)base)[i] = kv_f32_to_half(v);
    else ((uint16_t *)base)[i] = kv_f32_to_bf16(v);
}

/* Large head element of small head element e (0..hd_small) in copy c. */
static int head_elem(const widen *w, int e, int c) { return 2 * (w->k * (e / 2) + c) + e % 2; }

/* Large query head of small query head h. */
static int q_head(const widen *w, int h)
{
    const int gs = w->s->cfg.n_heads / w->s->cfg.n_kv_heads, gb = w->b->n_heads / w->b->n_kv_heads;
    return (h / gs) * gb + h % gs;
}

/* Rows of a q/k/v projection: small head h's element e -> the large head's
 * copies, times f; columns are the small width. */
static void put_qkv(const widen *w, const kv_weight *src, int heads, bool query, float f, void *dst, float *bias_dst)
{
    const int hs = w->s->cfg.head_dim, hb = w->b->head_dim, Ds = w->s->cfg.dim, Db = w->b->dim;
    for (int h = 0; h < heads; h++) {
        const int H = query ? q_head(w, h) : h;
        for (int e = 0; e < hs; e++) {
            kv_weight_row(src, h * hs + e, w->row);
            for (int c = 0; c < w->k; c++) {
                const size_t r = (size_t)H * hb + head_elem(w, e, c);
                for (int j = 0; j < Ds; j++) put(w, dst, r * Db + j, w->row[j] * f);
                if (src->bias) bias_dst[r] = src->bias[h * hs + e] * f;
            }
        }
    }
}

/* One small layer into the large layer block p (zeroed). */
static void put_layer(const widen *w, const kv_layer_weights *sl, uint8_t *const p[W_COUNT], float *bias)
{
    const kv_model_config *sc = &w->s->cfg, *bc = w->b;
    const int Ds = sc->dim, Fs = sc->hidden_dim, hs = sc->head_dim, hb = bc->head_dim;
    const float rk = 1.0f / sqrtf((float)w->k);
    float *bq = bias, *bk = bq + (size_t)bc->n_heads * hb, *bv = bk + (size_t)bc->n_kv_heads * hb,
          *bo = bv + (size_t)bc->n_kv_heads * hb;
    put_qkv(w, &sl->wq, sc->n_heads, true, 1.0f, p[W_Q], bq);
    put_qkv(w, &sl->wk, sc->n_kv_heads, false, rk, p[W_K], bk);
    put_qkv(w, &sl->wv, sc->n_kv_heads, false, rk, p[W_V], bv);
    const size_t ocols = w->cols[W_O];
    for (int r = 0; r < Ds; r++) { /* wo: the small heads' columns, each copy, times s / sqrt(k) */
        kv_weight_row(&sl->wo, r, w->row);
        for (int h = 0; h < sc->n_heads; h++)
            for (int e = 0; e < hs; e++)
                for (int c = 0; c < w->k; c++)
                    put(w, p[W_O], (size_t)r * ocols + (size_t)q_head(w, h) * hb + head_elem(w, e, c),
                        w->row[h * hs + e] * w->scale * rk);
        if (sl->wo.bias) bo[r] = sl->wo.bias[r] * w->scale;
    }
    const kv_weight *gu[2] = {&sl->w_gate, &sl->w_up};
    uint8_t *gud[2] = {p[W_GATE], p[W_UP]};
    for (int m = 0; m < 2; m++)
        for (int r = 0; r < Fs; r++) {
            kv_weight_row(gu[m], r, w->row);
            for (int j = 0; j < Ds; j++) put(w, gud[m], (size_t)r * bc->dim + j, w->row[j]);
        }
    for (int r = 0; r < Ds; r++) {
        kv_weight_row(&sl->w_down, r, w->row);
        for (int j = 0; j < Fs; j++) put(w, p[W_DOWN], (size_t)r * bc->hidden_dim + j, w->row[j] * w->scale);
    }
}

static kv_status check_fit(const kv_model_config *s, const kv_model_config *b, kv_dtype wt)
{
    if (wt != KV_DT_F32 && wt != KV_DT_F16 && wt != KV_DT_BF16)
        return kv_fail(KV_E_USAGE, "widened weights must be F32, F16 or BF16");
    const char *what = NULL;
    int a = 0, z = 0;
    if (s->dim > b->dim) what = "width", a = s->dim, z = b->dim;
    else if (s->hidden_dim > b->hidden_dim) what = "feed-forward width", a = s->hidden_dim, z = b->hidden_dim;
    else if (s->n_layers > b->n_layers) what = "layer count", a = s->n_layers, z = b->n_layers;
    else if (s->n_kv_heads > b->n_kv_heads) what = "KV head count", a = s->n_kv_heads, z = b->n_kv_heads;
    else if (s->n_heads / s->n_kv_heads > b->n_heads / b->n_kv_heads)
        what = "query heads per KV head", a = s->n_heads / s->n_kv_heads, z = b->n_heads / b->n_kv_heads;
    if (what) return kv_fail(KV_E_USAGE, "cannot widen %s into %s: its %s %d exceeds %d", s->name, b->name, what, a, z);
    if (b->head_dim % s->head_dim)
        return kv_fail(KV_E_USAGE, "cannot widen %s into %s: head size %d does not divide %d", s->name, b->name,
                       s->head_dim, b->head_dim);
    if (s->rope_dim != s->head_dim || b->rope_dim != b->head_dim)
        return kv_fail(KV_E_UNSUPPORTED, "cannot widen a model with partial RoPE");
    return KV_OK;
}

kv_status kv_model_widen(const kv_model *small, const kv_model_config *big, kv_dtype wt, kv_model **out)
{
    *out = NULL;
    const kv_model_config *sc = &small->cfg;
    kv_model_config bc = *big;
    /* a shape the caller filled: its own consistency first (the named ones
     * were checked by kv_model_geometry); its vocabulary, context, epsilon
     * and RoPE base are not used, the small model's are */
    bc.vocab_size = sc->vocab_size, bc.seq_len = sc->seq_len, bc.norm_eps = sc->norm_eps;
    bc.rope_theta = sc->rope_theta, bc.rope_scaling = KV_ROPE_SCALING_NONE, bc.rope_freq_factors = NULL;
    kv_status st = kv_model_config_check(&bc);
    if (st) {
        char why[256];
        snprintf(why, sizeof why, "%s", kv_errdetail());
        return kv_fail(KV_E_USAGE, "cannot widen into %s: %s", bc.name, why);
    }
    big = &bc;
    st = check_fit(sc, big, wt);
    if (st) return st;
    for (int l = 0; l < sc->n_layers; l++) {
        const kv_layer_weights *sl = &small->layers[l];
        if (sl->w_gate.bias || sl->w_up.bias || sl->w_down.bias)
            return kv_fail(KV_E_UNSUPPORTED, "cannot widen feed-forward biases (layer %d)", l);
    }
    if (small->tok_embd.bias || small->output.bias)
        return kv_fail(KV_E_UNSUPPORTED, "cannot widen embedding or classifier biases");
    widen w = {.s = small, .b = big, .wt = wt, .es = wt == KV_DT_F32 ? 4 : 2, .k = big->head_dim / sc->head_dim};
    w.scale = sqrtf((float)big->dim / (float)sc->dim);
    const size_t D = (size_t)big->dim, H = (size_t)big->hidden_dim, V = (size_t)sc->vocab_size;
    const size_t qd = (size_t)big->n_heads * big->head_dim, kvd = (size_t)big->n_kv_heads * big->head_dim;
    const size_t rows[W_COUNT] = {qd, kvd, kvd, D, H, D, H}, cols[W_COUNT] = {D, D, D, qd, D, H, D};
    size_t n_layer = 0;
    for (int i = 0; i < W_COUNT; i++) w.rows[i] = rows[i], w.cols[i] = cols[i], n_layer += rows[i] * cols[i];
    const int Ls = sc->n_layers, Lb = big->n_layers, sets = Ls + (Lb > Ls);
    const size_t bytes = ((size_t)sets * n_layer + 2 * V * D) * w.es;
    /* floats: output norm, per small layer 2 norms + q, k, v, o biases, the
     * identity layers' norms, the rope divisors */
    const size_t per_l = 2 * D + qd + 2 * kvd + D, nfl = D + (size_t)Ls * per_l + D + (size_t)big->head_dim / 2;
    int maxc = sc->dim > sc->hidden_dim ? sc->dim : sc->hidden_dim;
    if (sc->n_heads * sc->head_dim > maxc) maxc = sc->n_heads * sc->head_dim;
    kv_model *m = calloc(1, sizeof *m);
    if (m) {
        m->owned = calloc(bytes, 1); /* zero pages stay unmapped until written */
        m->norm_store = calloc(nfl, sizeof(float));
        m->layers = calloc((size_t)Lb, sizeof *m->layers);
    }
    w.row = malloc((size_t)maxc * sizeof(float));
    if (!m || !m->owned || !m->norm_store || !m->layers || !w.row) {
        kv_model_close(m);
        free(w.row);
        return kv_fail(KV_E_NOMEM, "out of memory for %s widened to %s (%zu MB)", sc->name, big->name, bytes >> 20);
    }
    m->cfg = *big;
    m->cfg.vocab_size = sc->vocab_size, m->cfg.seq_len = sc->seq_len, m->cfg.norm_eps = sc->norm_eps;
    m->cfg.rope_theta = sc->rope_theta, m->cfg.rope_scaling = KV_ROPE_SCALING_NONE;
    m->cfg.shared_classifier = false;
    snprintf(m->cfg.arch, sizeof m->cfg.arch, "%s", sc->arch);
    snprintf(m->cfg.name, sizeof m->cfg.name, "%.24s in %.24s (widened)", sc->name, big->name);
    snprintf(m->cfg.format, sizeof m->cfg.format, "widened");
    /* RoPE: large pair k*i + c turns at small pair i's frequency */
    float *fl = m->norm_store, *sfreq = malloc((size_t)sc->head_dim / 2 * sizeof *sfreq);
    float *rf = fl + nfl - big->head_dim / 2;
    if (!sfreq) {
        kv_model_close(m);
        free(w.row);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    kv_model_rope_freqs(sc, sfreq);
    m->cfg.rope_freq_factors = NULL;
    kv_model_rope_freqs(&m->cfg, rf); /* the large shape's own frequencies, then the divisors */
    for (int p = 0; p < big->head_dim / 2; p++) rf[p] = rf[p] / sfreq[p / w.k];
    m->cfg.rope_freq_factors = rf;
    free(sfreq);
    /* embedding (times s) and classifier, on the first dim_small coordinates */
    uint8_t *p = m->owned;
    uint8_t *emb = p + (size_t)sets * n_layer * w.es, *cls = emb + V * D * w.es;
    for (int v = 0; v < sc->vocab_size; v++) {
        kv_weight_row(&small->tok_embd, v, w.row);
        for (int j = 0; j < sc->dim; j++) put(&w, emb, (size_t)v * D + j, w.row[j] * w.scale);
        kv_weight_row(&small->output, v, w.row);
        for (int j = 0; j < sc->dim; j++) put(&w, cls, (size_t)v * D + j, w.row[j]);
    }
    m->tok_embd = (kv_weight){.type = wt, .rows = (int)V, .cols = (int)D, .data = emb};
    m->output = (kv_weight){.type = wt, .rows = (int)V, .cols = (int)D, .data = cls};
    for (size_t j = 0; j < D; j++) fl[j] = j < (size_t)sc->dim ? small->output_norm[j] / w.scale : 1.0f;
    m->output_norm = fl;
    float *ident = fl + D + (size_t)Ls * per_l; /* the identity layers' norms */
    for (size_t j = 0; j < D; j++) ident[j] = 1.0f;
    /* the layer blocks: set i < Ls is small layer i, set Ls the zero layer */
    kv_weight set_w[W_COUNT];
    for (int i = 0; i < sets; i++) {
        uint8_t *q[W_COUNT];
        for (int j = 0; j < W_COUNT; j++) {
            q[j] = p;
            set_w[j] = (kv_weight){.type = wt, .rows = (int)rows[j], .cols = (int)cols[j], .data = p};
            p += rows[j] * cols[j] * w.es;
        }
        float *nl = fl + D + (size_t)i * per_l, *bias = nl + 2 * D;
        if (i < Ls) {
            const kv_layer_weights *sl = &small->layers[i];
            put_layer(&w, sl, q, bias);
            for (int j = 0; j < sc->dim; j++) nl[j] = sl->attn_norm[j] / w.scale, nl[D + j] = sl->ffn_norm[j] / w.scale;
        }
        for (int l = 0; l < Lb; l++) {
            const int src = (int)((long long)l * Ls / Lb), at = (int)(((long long)src * Lb + Ls - 1) / Ls);
            const bool real = at == l; /* small layer src sits at ceil(src * Lb / Ls) */
            if ((i < Ls) != real || (real && src != i)) continue;
            kv_layer_weights *lw = &m->layers[l];
            lw->wq = set_w[W_Q], lw->wk = set_w[W_K], lw->wv = set_w[W_V], lw->wo = set_w[W_O];
            lw->w_gate = set_w[W_GATE], lw->w_down = set_w[W_DOWN], lw->w_up = set_w[W_UP];
            if (real) {
                const kv_layer_weights *sl = &small->layers[i];
                lw->attn_norm = nl, lw->ffn_norm = nl + D;
                lw->wq.bias = sl->wq.bias ? bias : NULL;
                lw->wk.bias = sl->wk.bias ? bias + qd : NULL;
                lw->wv.bias = sl->wv.bias ? bias + qd + kvd : NULL;
                lw->wo.bias = sl->wo.bias ? bias + qd + 2 * kvd : NULL;
            } else {
                lw->attn_norm = lw->ffn_norm = ident;
            }
        }
    }
    free(w.row);
    *out = m;
    return KV_OK;
}

kv_status kv_model_widen_named(const kv_model *small, const char *geometry, kv_dtype wt, kv_model **out)
{
    *out = NULL;
    kv_model_config c;
    kv_status st = kv_model_geometry(geometry, &c);
    return st ? st : kv_model_widen(small, &c, wt, out);
}
