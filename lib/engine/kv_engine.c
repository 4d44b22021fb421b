/*
 * kv_engine: CPU forward pass of a Llama-family model whose per-layer KV
 * caches are kv_policy objects (see kv_engine.h).  Two paths share the same
 * arithmetic:
 *   - prefill runs layer by layer over chunks of prompt tokens: matrix-matrix
 *     projections, exact causal attention over the engine's own float32
 *     prompt K/V, then hands each layer's K/V to its policy (ingest);
 *   - a decode step runs one token through every layer, the attention going
 *     through the layer's policy (append, then attend).
 * Layers whose policy wants a predicted query (TailorKV's sparse layers) get
 * q̂_l = RoPE(Wq_l · rmsnorm(x_{l-1}, attn_norm_l)) computed one layer early.
 */
#include "engine/kv_engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "common/kv_finite.h"
#include "common/kv_half.h"
#include "model/kv_matmul.h"
#include "model/kv_sampler.h"
#include "format/kvc.h"
#include "policy/kv_prefix.h"

#define PREFILL_CHUNK KV_ENGINE_PREFILL_CHUNK /* prompt tokens per projection batch */
#define PREFILL_OBSERVE 32 /* prompt queries given to observe() */

struct kv_engine {
    const kv_model *m;
    int ctx, pos, L;
    int rope_off;           /* position - row of every row past a continued cache (kv_engine_prefill_from) */
    int cont_P;             /* rows of that cache */
    int *cont_pos;          /* (cont_P) their positions when rope_off != 0 */
    kv_policy_params *prm;  /* (L) */
    kv_policy **pol;        /* (L) */
    float *inv_freq;        /* (head_dim/2) RoPE frequency of each pair */
    /* decode scratch */
    float *x, *xb, *xb2;    /* (dim) */
    float *hb, *hb2;        /* (hidden_dim) */
    float *q, *k, *v;       /* (n_heads*hd), (n_kv*hd), (n_kv*hd) */
    float *att;             /* (n_heads*hd) */
    float *qpred;           /* (n_heads*hd) */
    float *rope_cs;         /* (head_dim) cos/sin pairs for the current position */
    /* prompt K/V kept after prefill */
    bool keep_prompt;
    int prompt_T;
    float **pk, **pv;       /* (L) each (n_kv, prompt_T, hd) */
    /* query capture ring */
    int nq;
    long q_seen;            /* queries seen per layer so far */
    long q_prefill;         /* of those, the last prefill's (the prompt's, for the dump) */
    float *qring;           /* (L, nq, n_heads*hd) */
};

// --- small helpers -----------------------------------------------------------

/* cs (hd): cos, sin of each pair's angle at position pos. */
static void rope_table(const float *inv_freq, int hd, int pos, float *cs)
{
    for (int i = 0; i < hd / 2; i++) {
        float a = (float)pos * inv_freq[i];
        cs[2 * i] = cosf(a);
        cs[2 * i + 1] = sinf(a);
    }
}

/* Rotate interleaved pairs of n_heads heads of x (n_heads*hd). */
static void rope_apply(float *x, int n_heads, int hd, const float *cs)
{
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * hd;
        for (int i = 0; i < hd; i += 2) {
            float c = cs[i], s = cs[i + 1], a = v[i], b = v[i + 1];
            v[i] = a * c - b * s;
            v[i + 1] = a * s + b * c;
        }
    }
}

/*
 * NaN or infinity in a layer's queries, keys or values (or in the logits,
 * layer < 0): no policy can rank, quantize or attend over them, and the
 * sampler cannot draw from them, so the engine stops with KV_E_DATA and
 * names the weight they came from (the first non-finite one, in the order
 * the forward pass reads them), or says that finite weights overflowed.
 */
static kv_status nonfinite(const kv_engine *e, int layer, int pos, const char *what)
{
    char at[96];
    if (layer >= 0) snprintf(at, sizeof at, "layer %d: %s", layer, what);
    else snprintf(at, sizeof at, "%s", what);
    return kv_model_nonfinite_fail(e->m, at, pos);
}

static bool finite_all(const float *x, size_t n) { return kv_first_nonfinite(x, n) == SIZE_MAX; }

void kv_engine_set_threads(int n)
{
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
}

// --- construction ------------------------------------------------------------

static void free_policies(kv_engine *e)
{
    if (!e->pol) return;
    for (int l = 0; l < e->L; l++) kv_policy_free(e->pol[l]);
    memset(e->pol, 0, (size_t)e->L * sizeof *e->pol);
}

static void free_prompt(kv_engine *e)
{
    if (!e->pk) return;
    for (int l = 0; l < e->L; l++) {
        free(e->pk[l]);
        free(e->pv[l]);
        e->pk[l] = e->pv[l] = NULL;
    }
    e->prompt_T = 0;
}

static kv_status make_policies(kv_engine *e)
{
    const kv_model_config *c = &e->m->cfg;
    for (int l = 0; l < e->L; l++) {
        kv_policy_geom g = {l, c->n_heads, c->n_kv_heads, c->head_dim, e->ctx};
        kv_status st = kv_policy_new(&g, &e->prm[l], &e->pol[l]);
        if (st) { /* kv_policy_new has named the layer and policy */
            free_policies(e);
            return st;
        }
    }
    return KV_OK;
}

kv_status kv_engine_new(const kv_model *m, const kv_policy_params *per_layer, int ctx,
                        kv_engine **out)
{
    *out = NULL;
    const kv_model_config *c = &m->cfg;
    if (ctx <= 0) ctx = c->seq_len;
    if (ctx > (1 << 24)) return kv_fail(KV_E_USAGE, "context %d too large", ctx);
    kv_engine *e = calloc(1, sizeof *e);
    if (!e) return kv_fail(KV_E_NOMEM, "out of memory");
    e->m = m;
    e->ctx = ctx;
    e->L = c->n_layers;
    int qd = c->n_heads * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    e->prm = calloc((size_t)e->L, sizeof *e->prm);
    e->pol = calloc((size_t)e->L, sizeof *e->pol);
    e->pk = calloc((size_t)e->L, sizeof *e->pk);
    e->pv = calloc((size_t)e->L, sizeof *e->pv);
    e->inv_freq = malloc((size_t)c->head_dim / 2 * sizeof(float));
    e->rope_cs = malloc((size_t)c->head_dim * sizeof(float));
    e->x = malloc((size_t)c->dim * sizeof(float));
    e->xb = malloc((size_t)c->dim * sizeof(float));
    e->xb2 = malloc((size_t)c->dim * sizeof(float));
    e->hb = malloc((size_t)c->hidden_dim * sizeof(float));
    e->hb2 = malloc((size_t)c->hidden_dim * sizeof(float));
    e->q = malloc((size_t)qd * sizeof(float));
    e->qpred = malloc((size_t)qd * sizeof(float));
    e->att = malloc((size_t)qd * sizeof(float));
    e->k = malloc((size_t)kvd * sizeof(float));
    e->v = malloc((size_t)kvd * sizeof(float));
    if (!e->prm || !e->pol || !e->pk || !e->pv || !e->inv_freq || !e->rope_cs || !e->x ||
        !e->xb || !e->xb2 || !e->hb || !e->hb2 || !e->q || !e->qpred || !e->att || !e->k || !e->v) {
        kv_engine_free(e);
        return kv_fail(KV_E_NOMEM, "out of memory for the engine");
    }
    kv_model_rope_freqs(c, e->inv_freq);
    for (int l = 0; l < e->L; l++) {
        if (per_layer) e->prm[l] = per_layer[l];
        else kv_policy_params_default(&e->prm[l], KV_POL_FULL);
    }
    kv_status st = make_policies(e);
    if (st) {
        kv_engine_free(e);
        return st;
    }
    *out = e;
    return KV_OK;
}

void kv_engine_free(kv_engine *e)
{
    if (!e) return;
    free_policies(e);
    free_prompt(e);
    free(e->pk);
    free(e->pv);
    free(e->pol);
    free(e->prm);
    free(e->qring);
    free(e->cont_pos);
    free(e->inv_freq);
    free(e->rope_cs);
    free(e->x);
    free(e->xb);
    free(e->xb2);
    free(e->hb);
    free(e->hb2);
    free(e->q);
    free(e->qpred);
    free(e->att);
    free(e->k);
    free(e->v);
    free(e);
}

kv_status kv_engine_reset(kv_engine *e, const kv_policy_params *per_layer)
{
    free_policies(e);
    free_prompt(e);
    e->pos = 0;
    e->rope_off = 0;
    e->cont_P = 0;
    free(e->cont_pos);
    e->cont_pos = NULL;
    e->q_seen = 0, e->q_prefill = 0;
    if (per_layer) memcpy(e->prm, per_layer, (size_t)e->L * sizeof *e->prm);
    return make_policies(e);
}

kv_status kv_engine_keep(kv_engine *e, int nq, bool prompt_kv)
{
    if (nq < 0 || nq > 1 << 16) return kv_fail(KV_E_USAGE, "query capture count %d out of range", nq);
    const kv_model_config *c = &e->m->cfg;
    free(e->qring);
    e->qring = NULL;
    e->nq = 0;
    if (nq > 0) {
        e->qring = malloc((size_t)e->L * nq * c->n_heads * c->head_dim * sizeof(float));
        if (!e->qring) return kv_fail(KV_E_NOMEM, "out of memory for %d queries per layer", nq);
    }
    e->nq = nq;
    e->q_seen = 0, e->q_prefill = 0;
    e->keep_prompt = prompt_kv;
    return KV_OK;
}

static void capture_q(kv_engine *e, int layer, long index, const float *q)
{
    if (!e->nq) return;
    const kv_model_config *c = &e->m->cfg;
    size_t qd = (size_t)c->n_heads * c->head_dim;
    memcpy(e->qring + ((size_t)layer * e->nq + (size_t)(index % e->nq)) * qd, q, qd * sizeof(float));
}

int kv_engine_queries(const kv_engine *e, int layer, float *out)
{
    if (!e->nq || layer < 0 || layer >= e->L) return 0;
    const kv_model_config *c = &e->m->cfg;
    int hd = c->head_dim, H = c->n_heads;
    long n = e->q_seen < e->nq ? e->q_seen : e->nq;
    for (long i = 0; i < n; i++) {
        long idx = (e->q_seen - n + i) % e->nq;
        const float *q = e->qring + ((size_t)layer * e->nq + (size_t)idx) * H * hd;
        for (int h = 0; h < H; h++)
            memcpy(out + ((size_t)h * n + i) * hd, q + (size_t)h * hd, (size_t)hd * sizeof(float));
    }
    return (int)n;
}

const float *kv_engine_prompt_kv(const kv_engine *e, int layer, char which, int *T)
{
    *T = 0;
    if (layer < 0 || layer >= e->L || !e->pk[layer]) return NULL;
    *T = e->prompt_T;
    return which == 'k' ? e->pk[layer] : which == 'v' ? e->pv[layer] : NULL;
}

// --- prefill -----------------------------------------------------------------

/*
 * Causal attention of chunk queries Q (n, n_heads*hd) at positions t0.. over
 * the prompt's keys and values, into O (n, n_heads*hd).  KT and VT hold
 * each KV head channel-major, (n_kv, hd, T), so both products are long
 * contiguous vector operations: scores are hd axpys over the keys (summed
 * channel by channel, the order of a plain dot product), outputs hd dot
 * products over the probabilities.
 */
static void prefill_attention(const kv_model_config *c, const float *Q, const float *KT,
                              const float *VT, int T, int t0, int n, float *O)
{
    const int H = c->n_heads, hd = c->head_dim, grp = c->n_heads / c->n_kv_heads;
    const int qd = H * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    /* a few thousand multiply-adds are not worth waking the thread team */
#pragma omp parallel if ((long)H * n * (t0 + n) * hd > 65536)
    {
        float *sc = malloc((size_t)(t0 + n) * sizeof(float));
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int h = 0; h < H; h++)
            for (int i = n - 1; i >= 0; i--) { /* longest rows first */
                if (!sc) continue;
                const float *q = Q + (size_t)i * qd + (size_t)h * hd;
                const float *kt = KT + (size_t)(h / grp) * hd * T;
                const float *vt = VT + (size_t)(h / grp) * hd * T;
                float *o = O + (size_t)i * qd + (size_t)h * hd;
                int ns = t0 + i + 1;
                memset(sc, 0, (size_t)ns * sizeof(float));
                for (int d = 0; d < hd; d++) kv_axpy_f32(q[d], kt + (size_t)d * T, sc, ns);
                float mx = -INFINITY;
                for (int s = 0; s < ns; s++) {
                    sc[s] *= scale;
                    if (sc[s] > mx) mx = sc[s];
                }
                double sum = 0.0;
                for (int s = 0; s < ns; s++) {
                    sc[s] = expf(sc[s] - mx);
                    sum += sc[s];
                }
                const float inv = (float)(1.0 / sum);
                for (int d = 0; d < hd; d++) o[d] = kv_dot_f32(sc, vt + (size_t)d * T, ns) * inv;
            }
        free(sc);
    }
}

/* Layers of a continued cache that are packed: rebuild their policies
 * with the file's encoding and load the packed rows into them. */
static kv_status load_packed(kv_engine *e, const kv_prefix *pre, bool *loaded)
{
    const kv_model_config *c = &e->m->cfg;
    for (int l = 0; l < e->L; l++) {
        kv_policy_params prm;
        kv_status st = kv_prefix_layer_packed(pre, l, &loaded[l], &prm);
        if (st) return st;
        if (!loaded[l]) continue;
        prm.dtype = e->prm[l].dtype;
        kv_policy *pol;
        kv_policy_geom g = {l, c->n_heads, c->n_kv_heads, c->head_dim, e->ctx};
        if ((st = kv_policy_new(&g, &prm, &pol))) return st;
        kv_policy_free(e->pol[l]);
        e->pol[l] = pol;
        e->prm[l] = prm;
        if ((st = kv_policy_load(pol, pre, l))) {
            kv_errcontext("layer %d", l);
            return st;
        }
    }
    return KV_OK;
}

/*
 * The dense prefill of tokens (n) after pre's P cached rows (pre NULL: P =
 * 0, a prefill from position 0).  Row r of the result is the cached row r
 * (r < P) or new token r - P, rotated at position r + (matched - P); the
 * new tokens attend causally over every row before them.  Layers whose
 * cache is packed in the file hold it packed (load_packed) and get the new
 * rows appended; every other layer ingests all P + n rows.
 */
static kv_status prefill_impl(kv_engine *e, const int *tokens, int n, float *logits,
                              bool all_logits, const kv_prefix *pre)
{
    const kv_model *m = e->m;
    const kv_model_config *c = &m->cfg;
    if (n < 1) return kv_fail(KV_E_USAGE, "prefill needs at least one token");
    if (e->pos != 0) return kv_fail(KV_E_USAGE, "prefill on an engine at position %d: reset it first", e->pos);
    const int P = pre ? pre->T : 0, N = P + n, off = pre ? pre->matched - P : 0;
    if (N > e->ctx)
        return P ? kv_fail(KV_E_USAGE, "the cache (%d tokens) and the prompt (%d) exceed the context of %d", P, n, e->ctx)
                 : kv_fail(KV_E_USAGE, "prompt of %d tokens exceeds the context of %d", n, e->ctx);
    if (pre && (pre->n_kv_heads != c->n_kv_heads || pre->head_dim != c->head_dim || off < 0))
        return kv_fail(KV_E_DATA, "the cache's rows do not fit this model");
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return kv_fail(KV_E_DATA, "token %d at position %d is outside the vocabulary (%d)",
                           tokens[i], i, c->vocab_size);
    const int D = c->dim, Hd = c->hidden_dim, hd = c->head_dim;
    const int qd = c->n_heads * hd, kvd = c->n_kv_heads * hd, nkv = c->n_kv_heads;
    const int C = n < PREFILL_CHUNK ? n : PREFILL_CHUNK;
    /* Matmuls run on whole 4-token tiles (pad rows are zero and dropped):
     * kv_matmul computes a row differently in a tile and in the tail, so
     * padding makes every prompt row's numbers independent of how the
     * prompt is split into chunks, and a cache dumped after N tokens and
     * continued equals the whole prompt's prefill bit for bit. */
    const int C4 = (C + 3) & ~3;
    free_prompt(e);
    float *X = malloc((size_t)n * D * sizeof(float));       /* (n, dim) residual stream */
    float *XB = calloc((size_t)C4 * D, sizeof(float));      /* (C4, dim) */
    float *Qc = malloc((size_t)C4 * qd * sizeof(float));    /* (C4, qd) */
    float *Kc = malloc((size_t)C4 * kvd * sizeof(float));   /* (C4, kvd) */
    float *Vc = malloc((size_t)C4 * kvd * sizeof(float));   /* (C4, kvd) */
    float *Oc = calloc((size_t)C4 * qd, sizeof(float));     /* (C4, qd) */
    float *H1 = calloc((size_t)C4 * Hd, sizeof(float));     /* (C4, hidden) */
    float *H2 = malloc((size_t)C4 * Hd * sizeof(float));    /* (C4, hidden) */
    float *cs = malloc((size_t)n * hd * sizeof(float));     /* (n, hd) rope cos/sin */
    float *KT = malloc((size_t)nkv * hd * N * sizeof(float)); /* (n_kv, hd, N) */
    float *VT = malloc((size_t)nkv * hd * N * sizeof(float)); /* (n_kv, hd, N) */
    float *PK = P ? malloc((size_t)2 * nkv * P * hd * sizeof(float)) : NULL; /* (2, n_kv, P, hd) cached rows */
    bool *loaded = calloc((size_t)e->L, sizeof *loaded);
    /* Policies that observe the prompt (dsq) get its last PREFILL_OBSERVE
     * queries, an observation window as in SnapKV/H2O: recent queries are
     * what decides which prompt tokens later steps attend to. */
    bool any_observe = false;
    for (int l = 0; l < e->L; l++) any_observe |= e->pol[l]->ops->observe != NULL;
    const int nobs = any_observe ? (n < PREFILL_OBSERVE ? n : PREFILL_OBSERVE) : 0;
    float *obs = nobs ? malloc((size_t)e->L * qd * nobs * sizeof(float)) : NULL; /* (L, n_heads, nobs, hd) */
    kv_status st = KV_OK;
    if (nobs && !obs) {
        st = kv_fail(KV_E_NOMEM, "out of memory for the observed queries");
        goto done;
    }
    if (!X || !XB || !Qc || !Kc || !Vc || !Oc || !H1 || !H2 || !cs || !KT || !VT || (P && !PK) || !loaded) {
        st = kv_fail(KV_E_NOMEM, "out of memory for a %d-token prefill", n);
        goto done;
    }
    for (int l = 0; l < e->L; l++) {
        e->pk[l] = malloc((size_t)nkv * N * hd * sizeof(float));
        e->pv[l] = malloc((size_t)nkv * N * hd * sizeof(float));
        if (!e->pk[l] || !e->pv[l]) {
            st = kv_fail(KV_E_NOMEM, "out of memory for the prompt K/V (%d tokens)", N);
            goto done;
        }
    }
    e->prompt_T = N;
    if (pre && (st = load_packed(e, pre, loaded))) goto done;
    for (int t = 0; t < n; t++) {
        kv_weight_row(&m->tok_embd, tokens[t], X + (size_t)t * D);
        rope_table(e->inv_freq, hd, P + off + t, cs + (size_t)t * hd);
    }
    for (int l = 0; l < e->L; l++) {
        const kv_layer_weights *w = &m->layers[l];
        float *K = e->pk[l], *V = e->pv[l];
        if (P) { /* the cached rows: first in K/V and in the channel-major copies */
            float *pk = PK, *pv = PK + (size_t)nkv * P * hd;
            if ((st = kv_prefix_rows_f32(pre, l, 'k', pk)) || (st = kv_prefix_rows_f32(pre, l, 'v', pv))) {
                kv_errcontext("the cache to continue from");
                goto done;
            }
            for (int h = 0; h < nkv; h++)
                for (int t = 0; t < P; t++) {
                    const float *kr = pk + ((size_t)h * P + t) * hd, *vr = pv + ((size_t)h * P + t) * hd;
                    memcpy(K + ((size_t)h * N + t) * hd, kr, (size_t)hd * sizeof(float));
                    memcpy(V + ((size_t)h * N + t) * hd, vr, (size_t)hd * sizeof(float));
                    for (int d = 0; d < hd; d++) {
                        KT[((size_t)h * hd + d) * N + t] = kr[d];
                        VT[((size_t)h * hd + d) * N + t] = vr[d];
                    }
                }
        }
        for (int t0 = 0; t0 < n; t0 += C) {
            int nc = t0 + C <= n ? C : n - t0, nc4 = (nc + 3) & ~3;
            for (int i = 0; i < nc; i++)
                kv_rmsnorm(XB + (size_t)i * D, X + (size_t)(t0 + i) * D, w->attn_norm, D, c->norm_eps);
            memset(XB + (size_t)nc * D, 0, (size_t)(nc4 - nc) * D * sizeof(float));
            kv_matmul(&w->wq, XB, nc4, Qc);
            kv_matmul(&w->wk, XB, nc4, Kc);
            kv_matmul(&w->wv, XB, nc4, Vc);
            if (!finite_all(Qc, (size_t)nc * qd) || !finite_all(Kc, (size_t)nc * kvd) ||
                !finite_all(Vc, (size_t)nc * kvd)) {
                st = nonfinite(e, l, t0, "queries, keys or values of the prompt chunk");
                goto done;
            }
            for (int i = 0; i < nc; i++) {
                const float *tcs = cs + (size_t)(t0 + i) * hd;
                rope_apply(Qc + (size_t)i * qd, c->n_heads, hd, tcs);
                rope_apply(Kc + (size_t)i * kvd, nkv, hd, tcs);
                const size_t r = (size_t)P + t0 + i; /* the row */
                for (int h = 0; h < nkv; h++) {
                    memcpy(K + ((size_t)h * N + r) * hd, Kc + (size_t)i * kvd + (size_t)h * hd,
                           (size_t)hd * sizeof(float));
                    memcpy(V + ((size_t)h * N + r) * hd, Vc + (size_t)i * kvd + (size_t)h * hd,
                           (size_t)hd * sizeof(float));
                    for (int d = 0; d < hd; d++) {
                        KT[((size_t)h * hd + d) * N + r] = Kc[(size_t)i * kvd + (size_t)h * hd + d];
                        VT[((size_t)h * hd + d) * N + r] = Vc[(size_t)i * kvd + (size_t)h * hd + d];
                    }
                }
                if (e->nq && t0 + i >= n - e->nq) capture_q(e, l, t0 + i, Qc + (size_t)i * qd);
                if (nobs && t0 + i >= n - nobs) {
                    int j = t0 + i - (n - nobs);
                    for (int h = 0; h < c->n_heads; h++)
                        memcpy(obs + (((size_t)l * c->n_heads + h) * nobs + j) * hd,
                               Qc + (size_t)i * qd + (size_t)h * hd, (size_t)hd * sizeof(float));
                }
            }
            prefill_attention(c, Qc, KT, VT, N, P + t0, nc, Oc);
            memset(Oc + (size_t)nc * qd, 0, (size_t)(nc4 - nc) * qd * sizeof(float));
            kv_matmul(&w->wo, Oc, nc4, XB);
            for (size_t j = 0; j < (size_t)nc * D; j++) X[(size_t)t0 * D + j] += XB[j];
            for (int i = 0; i < nc; i++)
                kv_rmsnorm(XB + (size_t)i * D, X + (size_t)(t0 + i) * D, w->ffn_norm, D, c->norm_eps);
            memset(XB + (size_t)nc * D, 0, (size_t)(nc4 - nc) * D * sizeof(float));
            kv_matmul(&w->w_gate, XB, nc4, H1);
            kv_matmul(&w->w_up, XB, nc4, H2);
            kv_swiglu(H1, H2, nc * Hd);
            memset(H1 + (size_t)nc * Hd, 0, (size_t)(nc4 - nc) * Hd * sizeof(float));
            kv_matmul(&w->w_down, H1, nc4, XB);
            for (size_t j = 0; j < (size_t)nc * D; j++) X[(size_t)t0 * D + j] += XB[j];
        }
    }
    e->q_seen = n, e->q_prefill = n;
    for (int l = 0; l < e->L; l++) {
        if (loaded[l]) { /* packed rows held as packed: the new rows follow as appends */
            for (int t = P; t < N && !st; t++) {
                for (int h = 0; h < nkv; h++) {
                    memcpy(Kc + (size_t)h * hd, e->pk[l] + ((size_t)h * N + t) * hd, (size_t)hd * sizeof(float));
                    memcpy(Vc + (size_t)h * hd, e->pv[l] + ((size_t)h * N + t) * hd, (size_t)hd * sizeof(float));
                }
                st = e->pol[l]->ops->append(e->pol[l], t, Kc, Vc);
            }
            if (st) {
                kv_errcontext("layer %d append after the cache", l);
                goto done;
            }
            continue;
        }
        if (nobs && e->pol[l]->ops->observe)
            e->pol[l]->ops->observe(e->pol[l], obs + (size_t)l * qd * nobs, nobs);
        if ((st = e->pol[l]->ops->ingest(e->pol[l], e->pk[l], e->pv[l], N))) {
            kv_errcontext("layer %d ingest", l);
            goto done;
        }
    }
    e->pos = N;
    e->rope_off = off;
    e->cont_P = P;
    free(e->cont_pos);
    e->cont_pos = NULL;
    if (off && !(e->cont_pos = malloc((size_t)P * sizeof *e->cont_pos))) {
        st = kv_fail(KV_E_NOMEM, "out of memory");
        goto done;
    }
    for (int t = 0; off && t < P; t++) {
        int32_t x = t;
        if (pre->positions) memcpy(&x, (const char *)pre->positions + 4 * (size_t)t, 4);
        e->cont_pos[t] = x;
    }
    if (logits) {
        int first = all_logits ? 0 : n - 1;
        for (int t = first; t < n; t += C) {
            int nc = t + C <= n ? C : n - t;
            for (int i = 0; i < nc; i++)
                kv_rmsnorm(XB + (size_t)i * D, X + (size_t)(t + i) * D, m->output_norm, D, c->norm_eps);
            kv_matmul(&m->output, XB, nc, logits + (size_t)(t - first) * c->vocab_size);
            if (!finite_all(logits + (size_t)(t - first) * c->vocab_size, (size_t)nc * c->vocab_size)) {
                st = nonfinite(e, -1, t, "logits of the prompt chunk");
                goto done;
            }
        }
    }
done:
    if (st || !e->keep_prompt) free_prompt(e);
    if (st) {
        e->pos = 0;
        e->rope_off = 0;
        e->q_seen = 0, e->q_prefill = 0;
    }
    free(X);
    free(XB);
    free(Qc);
    free(Kc);
    free(Vc);
    free(Oc);
    free(H1);
    free(H2);
    free(cs);
    free(KT);
    free(VT);
    free(PK);
    free(loaded);
    free(obs);
    return st;
}

kv_status kv_engine_prefill(kv_engine *e, const int *tokens, int n, float *logits_last)
{
    return prefill_impl(e, tokens, n, logits_last, false, NULL);
}

kv_status kv_engine_prefill_from(kv_engine *e, const kv_prefix *pre, const int *tokens, int n,
                                 float *logits_last)
{
    if (n < 1) return kv_fail(KV_E_USAGE, "a continued cache needs at least one new token");
    return prefill_impl(e, tokens, n, logits_last, false, pre);
}

kv_status kv_engine_prefill_all(kv_engine *e, const int *tokens, int n, float *logits_all)
{
    return prefill_impl(e, tokens, n, logits_all, true, NULL);
}

// --- decode ------------------------------------------------------------------

kv_status kv_engine_step(kv_engine *e, int token, float *logits)
{
    if (e->pos == 0) {
        /* A step on an empty engine is a one-token prefill: same numbers,
         * and every policy then starts from ingest(). */
        bool keep = e->keep_prompt;
        e->keep_prompt = false;
        kv_status st = prefill_impl(e, &token, 1, logits, false, NULL);
        e->keep_prompt = keep;
        return st;
    }
    const kv_model *m = e->m;
    const kv_model_config *c = &m->cfg;
    if (token < 0 || token >= c->vocab_size)
        return kv_fail(KV_E_DATA, "token %d is outside the vocabulary (%d)", token, c->vocab_size);
    if (e->pos >= e->ctx) return kv_fail(KV_E_USAGE, "context of %d tokens is full", e->ctx);
    const int D = c->dim, hd = c->head_dim, pos = e->pos;
    kv_weight_row(&m->tok_embd, token, e->x);
    rope_table(e->inv_freq, hd, pos + e->rope_off, e->rope_cs);
    for (int l = 0; l < e->L; l++) {
        const kv_layer_weights *w = &m->layers[l];
        kv_policy *p = e->pol[l];
        /* one layer ahead: the next layer's query from this layer's input */
        if (l + 1 < e->L && e->pol[l + 1]->wants_prediction && e->pol[l + 1]->ops->predict) {
            const kv_layer_weights *wn = &m->layers[l + 1];
            kv_rmsnorm(e->xb2, e->x, wn->attn_norm, D, c->norm_eps);
            kv_matvec(&wn->wq, e->xb2, e->qpred);
            rope_apply(e->qpred, c->n_heads, hd, e->rope_cs);
            e->pol[l + 1]->ops->predict(e->pol[l + 1], e->qpred);
        }
        kv_rmsnorm(e->xb, e->x, w->attn_norm, D, c->norm_eps);
        {
            const kv_weight *ws[3] = {&w->wq, &w->wk, &w->wv};
            float *ys[3] = {e->q, e->k, e->v};
            kv_matvec_multi(3, ws, e->xb, ys);
        }
        rope_apply(e->q, c->n_heads, hd, e->rope_cs);
        rope_apply(e->k, c->n_kv_heads, hd, e->rope_cs);
        {
            const size_t qd = (size_t)c->n_heads * hd, kvd = (size_t)c->n_kv_heads * hd;
            if (!finite_all(e->q, qd) || !finite_all(e->k, kvd) || !finite_all(e->v, kvd))
                return nonfinite(e, l, pos, "queries, keys or values");
        }
        capture_q(e, l, e->q_seen, e->q);
        /* layer 0 has no previous layer: its "prediction" is the query itself */
        if (l == 0 && p->wants_prediction && p->ops->predict) p->ops->predict(p, e->q);
        kv_status st = p->ops->append(p, pos, e->k, e->v);
        if (!st) st = p->ops->attend(p, e->q, e->att);
        if (st) {
            kv_errcontext("layer %d at position %d", l, pos);
            return st;
        }
        kv_matvec(&w->wo, e->att, e->xb2);
        for (int i = 0; i < D; i++) e->x[i] += e->xb2[i];
        kv_rmsnorm(e->xb, e->x, w->ffn_norm, D, c->norm_eps);
        {
            const kv_weight *ws[2] = {&w->w_gate, &w->w_up};
            float *ys[2] = {e->hb, e->hb2};
            kv_matvec_multi(2, ws, e->xb, ys);
        }
        kv_swiglu(e->hb, e->hb2, c->hidden_dim);
        kv_matvec(&w->w_down, e->hb, e->xb);
        for (int i = 0; i < D; i++) e->x[i] += e->xb[i];
    }
    e->q_seen++;
    e->pos++;
    if (logits) {
        kv_rmsnorm(e->xb, e->x, m->output_norm, D, c->norm_eps);
        kv_matvec(&m->output, e->xb, logits);
        if (!finite_all(logits, (size_t)c->vocab_size)) return nonfinite(e, -1, pos, "logits");
    }
    return KV_OK;
}

// --- accessors ---------------------------------------------------------------

int kv_engine_vocab(const kv_engine *e) { return e->m->cfg.vocab_size; }
int kv_engine_pos(const kv_engine *e) { return e->pos; }
int kv_engine_ctx(const kv_engine *e) { return e->ctx; }
int kv_engine_n_layers(const kv_engine *e) { return e->L; }
const kv_model *kv_engine_model(const kv_engine *e) { return e->m; }

const kv_policy_params *kv_engine_params(const kv_engine *e, int layer)
{
    return layer >= 0 && layer < e->L ? &e->prm[layer] : NULL;
}

kv_policy *kv_engine_policy(kv_engine *e, int layer)
{
    return layer >= 0 && layer < e->L ? e->pol[layer] : NULL;
}

void kv_engine_bytes(const kv_engine *e, kv_bytes *total)
{
    memset(total, 0, sizeof *total);
    for (int l = 0; l < e->L; l++) {
        kv_bytes b = {0};
        e->pol[l]->ops->bytes(e->pol[l], &b);
        total->resident += b.resident;
        total->host += b.host;
        total->disk += b.disk;
        total->fetched_last += b.fetched_last;
        total->fetched_total += b.fetched_total;
        total->attends += b.attends;
    }
}

// --- dumps, scoring, descriptions -------------------------------------------------

/* Add n values of type src (f32 or f16) as a tensor of type dt (converted
 * when the types differ). */
static kv_status add_tensor(kvc_writer *w, const char *name, kv_dtype dt, int ndim,
                            const int64_t *shape, kv_dtype src, const void *x, size_t n)
{
    if (dt == src) return kvc_writer_add_copy(w, name, dt, ndim, shape, x);
    const float *xf = src == KV_DT_F32 ? x : NULL;
    const uint16_t *xh = src == KV_DT_F16 ? x : NULL;
    if (!xf && !xh) return kv_fail(KV_E_INTERNAL, "%s: source type %d", name, (int)src);
    size_t esz = dt == KV_DT_F32 ? 4 : 2;
    void *buf = malloc((n ? n : 1) * esz);
    if (!buf) return kv_fail(KV_E_NOMEM, "out of memory converting %s", name);
    for (size_t i = 0; i < n; i++) {
        float f = xf ? xf[i] : kv_half_to_f32(xh[i]);
        if (dt == KV_DT_F32) ((float *)buf)[i] = f;
        else ((uint16_t *)buf)[i] = dt == KV_DT_F16 ? kv_f32_to_half(f) : kv_f32_to_bf16(f);
    }
    kv_status st = kvc_writer_add_copy(w, name, dt, ndim, shape, buf);
    free(buf);
    return st;
}

kv_status kv_prompt_dump_write(const kv_model *m, const int *tokens, const kv_prompt_dump *d,
                               kv_dtype dt, const char *path, int zstd_level)
{
    const kv_model_config *c = &m->cfg;
    const int n = d->T;
    kvc_writer *w;
    kv_status st = kvc_writer_new(&w);
    if (st) return st;
    kv_geom g;
    kv_model_geom(m, &g);
    g.n_tokens = n;
    g.n_q = d->q ? d->nq : 0;
    if ((st = kvc_writer_geom(w, &g))) goto done;
    int64_t tshape[1] = {n};
    if ((st = kvc_writer_add_copy(w, "tokens", KV_DT_I32, 1, tshape, tokens))) goto done;
    char name[64];
    for (int l = 0; l < c->n_layers; l++) {
        int64_t kshape[3] = {c->n_kv_heads, n, c->head_dim};
        size_t kn = (size_t)c->n_kv_heads * (size_t)n * (size_t)c->head_dim;
        snprintf(name, sizeof name, "layers.%d.k", l);
        if ((st = add_tensor(w, name, dt, 3, kshape, d->src, d->k[l], kn))) goto done;
        snprintf(name, sizeof name, "layers.%d.v", l);
        if ((st = add_tensor(w, name, dt, 3, kshape, d->src, d->v[l], kn))) goto done;
        if (g.n_q) {
            int64_t qshape[3] = {c->n_heads, g.n_q, c->head_dim};
            snprintf(name, sizeof name, "layers.%d.q", l);
            if ((st = add_tensor(w, name, dt, 3, qshape, d->src, d->q[l],
                                 (size_t)c->n_heads * g.n_q * c->head_dim)))
                goto done;
        }
    }
    st = kvc_writer_write(w, path, zstd_level);
done:
    kvc_writer_free(w);
    return st;
}

kv_status kv_engine_dump_kvc(const kv_engine *e, const int *tokens, int n, kv_dtype dt,
                             const char *path, int zstd_level)
{
    const kv_model_config *c = &e->m->cfg;
    if (!e->pk[0] || (e->rope_off ? e->prompt_T + e->rope_off != n : e->prompt_T != n))
        return kv_fail(KV_E_INTERNAL, "no prompt K/V kept for the dump (call kv_engine_keep first)");
    /* kvc(5): the queries of the prompt's last positions.  Decode steps
     * after the prefill (kv-run --store inserts after generating) push
     * theirs into the ring too; only the prompt's still there are dumped,
     * none when the steps overwrote them all. */
    const long decoded = e->q_seen - e->q_prefill, left = e->nq - decoded;
    const int nq = e->nq && left > 0 ? (int)(e->q_prefill < left ? e->q_prefill : left) : 0;
    const size_t qn = (size_t)c->n_heads * (size_t)nq * (size_t)c->head_dim;
    float *qbuf = nq ? malloc((size_t)e->L * qn * sizeof(float)) : NULL;
    const void **ptr = malloc((size_t)3 * e->L * sizeof *ptr);
    float *ex = NULL;
    kv_status st = KV_OK;
    if (!ptr || (nq && !qbuf)) {
        st = kv_fail(KV_E_NOMEM, "out of memory for queries");
        goto done;
    }
    /* After a continued subset the rows are not positions 0 .. n-1: the
     * dump has every position, the ones the subset left out as zero rows
     * (a store that already holds them keeps its own). */
    const int nkv = c->n_kv_heads, hd = c->head_dim, R = e->prompt_T;
    ex = e->rope_off ? calloc((size_t)2 * e->L * nkv * n * hd, sizeof(float)) : NULL;
    if (e->rope_off && !ex) {
        st = kv_fail(KV_E_NOMEM, "out of memory for the dump");
        goto done;
    }
    for (int l = 0; l < e->L; l++) {
        ptr[l] = e->pk[l];
        ptr[e->L + l] = e->pv[l];
        if (ex) {
            float *xk = ex + (size_t)2 * l * nkv * n * hd, *xv = xk + (size_t)nkv * n * hd;
            for (int h = 0; h < nkv; h++)
                for (int r = 0; r < R; r++) {
                    int at = r < e->cont_P ? e->cont_pos[r] : r + e->rope_off;
                    memcpy(xk + ((size_t)h * n + at) * hd, e->pk[l] + ((size_t)h * R + r) * hd, (size_t)hd * sizeof(float));
                    memcpy(xv + ((size_t)h * n + at) * hd, e->pv[l] + ((size_t)h * R + r) * hd, (size_t)hd * sizeof(float));
                }
            ptr[l] = xk;
            ptr[e->L + l] = xv;
        }
        ptr[2 * e->L + l] = qbuf ? qbuf + (size_t)l * qn : NULL;
        for (int i = 0; i < nq; i++) { /* the ring's entries q_prefill - nq .. q_prefill - 1 */
            const float *q = e->qring + ((size_t)l * e->nq + (size_t)((e->q_prefill - nq + i) % e->nq)) *
                                            (size_t)c->n_heads * hd;
            for (int h = 0; h < c->n_heads; h++)
                memcpy(qbuf + (size_t)l * qn + ((size_t)h * nq + i) * hd, q + (size_t)h * hd, (size_t)hd * sizeof(float));
        }
    }
    kv_prompt_dump d = {KV_DT_F32, n, nq, ptr, ptr + e->L, nq ? ptr + 2 * e->L : NULL};
    st = kv_prompt_dump_write(e->m, tokens, &d, dt, path, zstd_level);
done:
    free(ex);
    free(ptr);
    free(qbuf);
    return st;
}

int kv_engine_rope_off(const kv_engine *e) { return e->rope_off; }
