/*
 * kv_model: loading llama2.c and GGUF checkpoints and building synthetic
 * models (see kv_model.h).  A file is mmapped once; the loader checks the
 * header, computes the exact size the header implies (in 64-bit arithmetic
 * with overflow checks) and only then assigns weight views by walking one
 * offset, the way llama2.c's run.c does, but returning an error instead of
 * exiting.
 */
#include "model/kv_model.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "format/kv_gguf.h"
#include "common/kv_finite.h"
#include "common/kv_ggml.h"
#include "common/kv_half.h"
#include "model/kv_matmul.h"

#define LLAMA2C_MAGIC_V1 0x616b3432u /* "ak42" */

// --- geometry checks -----------------------------------------------------------

/* Limits far above any real Llama but low enough that sizes cannot overflow. */
kv_status kv_model_config_check(kv_model_config *c)
{
    if (c->dim <= 0 || c->dim > 65536) return kv_fail(KV_E_DATA, "model dim %d out of range", c->dim);
    if (c->hidden_dim <= 0 || c->hidden_dim > 1 << 20)
        return kv_fail(KV_E_DATA, "model hidden_dim %d out of range", c->hidden_dim);
    if (c->n_layers <= 0 || c->n_layers > 1024)
        return kv_fail(KV_E_DATA, "model n_layers %d out of range", c->n_layers);
    /* head_dim is dim / n_heads unless the file says otherwise (GGUF
     * attention.key_length, as in Mistral-Nemo-style files) */
    if (c->n_heads <= 0 || c->n_heads > 1024 || (c->head_dim == 0 && c->dim % c->n_heads))
        return kv_fail(KV_E_DATA, "model n_heads %d does not divide dim %d", c->n_heads, c->dim);
    if (c->n_kv_heads <= 0 || c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads)
        return kv_fail(KV_E_DATA, "model n_kv_heads %d does not divide n_heads %d", c->n_kv_heads,
                       c->n_heads);
    if (c->head_dim == 0) c->head_dim = c->dim / c->n_heads;
    if (c->head_dim <= 0 || c->head_dim > 4096)
        return kv_fail(KV_E_DATA, "model head_dim %d out of range", c->head_dim);
    if (c->head_dim % 2) return kv_fail(KV_E_DATA, "model head_dim %d is odd", c->head_dim);
    if (c->vocab_size <= 0 || c->vocab_size > 1 << 24)
        return kv_fail(KV_E_DATA, "model vocab_size %d out of range", c->vocab_size);
    if (c->seq_len <= 0 || c->seq_len > 1 << 24)
        return kv_fail(KV_E_DATA, "model seq_len %d out of range", c->seq_len);
    if (!(c->norm_eps > 0 && c->norm_eps < 1))
        return kv_fail(KV_E_DATA, "model RMSNorm epsilon %g out of range", c->norm_eps);
    if (!(c->rope_theta > 1 && c->rope_theta < 1e12))
        return kv_fail(KV_E_DATA, "model rope theta %g out of range", c->rope_theta);
    if (c->rope_dim == 0) c->rope_dim = c->head_dim;
    if (c->rope_dim != c->head_dim)
        return kv_fail(KV_E_UNSUPPORTED, "partial RoPE (%d of %d dims) is not supported",
                       c->rope_dim, c->head_dim);
    if (c->rope_scaling == KV_ROPE_SCALING_LLAMA3 &&
        !(c->rope_factor >= 1 && c->rope_low_freq_factor > 0 &&
          c->rope_high_freq_factor > c->rope_low_freq_factor && c->rope_orig_ctx > 0))
        return kv_fail(KV_E_DATA, "llama3 rope scaling parameters are inconsistent");
    return KV_OK;
}

static void config_defaults(kv_model_config *c)
{
    memset(c, 0, sizeof *c);
    snprintf(c->arch, sizeof c->arch, "llama");
    c->norm_eps = 1e-5f;
    c->rope_theta = 10000.0;
}

static kv_weight wview(kv_dtype t, int rows, int cols, const void *data)
{
    return (kv_weight){.type = t, .rows = rows, .cols = cols, .data = data};
}

// --- llama2.c --------------------------------------------------------------------

static kv_status load_llama2c(kv_model *m, const uint8_t *p, size_t len)
{
    kv_model_config *c = &m->cfg;
    int32_t h[7];
    size_t off;
    bool shared;
    uint32_t magic = 0;
    if (len >= 4) memcpy(&magic, p, 4);
    if (magic == LLAMA2C_MAGIC_V1) {
        int32_t version;
        if (len < 256) return kv_fail(KV_E_DATA, "llama2.c v1 checkpoint truncated in its header");
        memcpy(&version, p + 4, 4);
        if (version != 1)
            return kv_fail(KV_E_UNSUPPORTED,
                           "llama2.c checkpoint version %d not supported (only fp32 version 1)",
                           version);
        memcpy(h, p + 8, sizeof h);
        if (p[36] > 1) return kv_fail(KV_E_DATA, "llama2.c v1 shared-classifier flag is %u", p[36]);
        shared = p[36] == 1;
        if (h[5] <= 0) return kv_fail(KV_E_DATA, "llama2.c v1 vocab_size %d is not positive", h[5]);
        off = 256;
        snprintf(c->format, sizeof c->format, "llama2c-v1");
    } else {
        if (len < 28) return kv_fail(KV_E_DATA, "llama2.c checkpoint truncated in its header (%zu bytes)", len);
        memcpy(h, p, sizeof h);
        shared = h[5] > 0;
        if (h[5] < 0 && h[5] != INT32_MIN) h[5] = -h[5];
        off = 28;
        snprintf(c->format, sizeof c->format, "llama2c");
    }
    c->dim = h[0];
    c->hidden_dim = h[1];
    c->n_layers = h[2];
    c->n_heads = h[3];
    c->n_kv_heads = h[4];
    c->vocab_size = h[5];
    c->seq_len = h[6];
    c->shared_classifier = shared;
    kv_status st = kv_model_config_check(c);
    if (st) {
        /* legacy files have no magic: anything unrecognised ends up here */
        if (off == 28) kv_errcontext("no GGUF or ak42 magic, and as a legacy llama2.c header");
        else kv_errcontext("llama2.c v1 header");
        return st;
    }
    uint64_t D = (uint64_t)c->dim, H = (uint64_t)c->hidden_dim, L = (uint64_t)c->n_layers;
    uint64_t V = (uint64_t)c->vocab_size, hd = (uint64_t)c->head_dim;
    uint64_t qd = (uint64_t)c->n_heads * hd, kvd = (uint64_t)c->n_kv_heads * hd;
    uint64_t per_layer = 2 * D + qd * D + 2 * kvd * D + D * qd + 3 * H * D;
    uint64_t nfl = V * D + L * per_layer + D + (shared ? 0 : V * D);
    bool v1 = off == 256;
    if (!v1) nfl += (uint64_t)c->seq_len * hd; /* legacy freq_cis_real + imag */
    uint64_t want = off + nfl * 4;
    if (want != len)
        return kv_fail(KV_E_DATA,
                       "llama2.c checkpoint is %zu bytes but its header implies %llu "
                       "(dim %d, layers %d, vocab %d%s)",
                       len, (unsigned long long)want, c->dim, c->n_layers, c->vocab_size,
                       len < want ? ": truncated" : "");
    m->layers = calloc((size_t)L, sizeof *m->layers);
    if (!m->layers) return kv_fail(KV_E_NOMEM, "out of memory for %d layers", c->n_layers);
    const float *w = (const float *)(p + off);
#define TAKE(n) (w += (n), w - (n))
    int d = c->dim, hdim = c->hidden_dim, q = (int)qd, kv = (int)kvd, nl = c->n_layers;
    if (v1) {
        for (int l = 0; l < nl; l++) m->layers[l].attn_norm = TAKE(D);
        for (int l = 0; l < nl; l++) m->layers[l].ffn_norm = TAKE(D);
        m->output_norm = TAKE(D);
        m->tok_embd = wview(KV_DT_F32, c->vocab_size, d, TAKE(V * D));
    } else {
        m->tok_embd = wview(KV_DT_F32, c->vocab_size, d, TAKE(V * D));
        for (int l = 0; l < nl; l++) m->layers[l].attn_norm = TAKE(D);
    }
    for (int l = 0; l < nl; l++) m->layers[l].wq = wview(KV_DT_F32, q, d, TAKE(qd * D));
    for (int l = 0; l < nl; l++) m->layers[l].wk = wview(KV_DT_F32, kv, d, TAKE(kvd * D));
    for (int l = 0; l < nl; l++) m->layers[l].wv = wview(KV_DT_F32, kv, d, TAKE(kvd * D));
    for (int l = 0; l < nl; l++) m->layers[l].wo = wview(KV_DT_F32, d, q, TAKE(D * qd));
    if (!v1)
        for (int l = 0; l < nl; l++) m->layers[l].ffn_norm = TAKE(D);
    for (int l = 0; l < nl; l++) m->layers[l].w_gate = wview(KV_DT_F32, hdim, d, TAKE(H * D));
    for (int l = 0; l < nl; l++) m->layers[l].w_down = wview(KV_DT_F32, d, hdim, TAKE(D * H));
    for (int l = 0; l < nl; l++) m->layers[l].w_up = wview(KV_DT_F32, hdim, d, TAKE(H * D));
    if (!v1) {
        m->output_norm = TAKE(D);
        (void)TAKE((uint64_t)c->seq_len * hd); /* freq_cis: unused, RoPE is computed */
    }
    m->output = shared ? m->tok_embd : wview(KV_DT_F32, c->vocab_size, d, TAKE(V * D));
#undef TAKE
    snprintf(c->name, sizeof c->name, "llama2.c");
    return KV_OK;
}

// --- GGUF ------------------------------------------------------------------------

static kv_status gguf_weight(const kv_gguf *g, const char *name, int rows, int cols,
                             kv_weight *out, bool optional)
{
    const kv_gguf_tensor *t = kv_gguf_tensor_find(g, name);
    if (!t) {
        if (optional) {
            out->data = NULL;
            return KV_OK;
        }
        return kv_fail(KV_E_DATA, "GGUF tensor %s is missing", name);
    }
    if (t->n_dims != 2 || t->ne[0] != cols || t->ne[1] != rows)
        return kv_fail(KV_E_DATA, "GGUF tensor %s has shape [%lld, %lld] (ne0, ne1), expected [%d, %d]",
                       name, (long long)t->ne[0], (long long)t->ne[1], cols, rows);
    kv_dtype wt = kv_dtype_from_ggml(t->ggml_type);
    if (wt == KV_DT_AUTO) {
        char tb[16];
        return kv_fail(KV_E_UNSUPPORTED,
                       "GGUF tensor %s: weight type %s is not supported (F32, F16, BF16, Q4_0, Q4_1, "
                       "Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K are)",
                       name, kv_ggml_type_name(t->ggml_type, tb));
    }
    if (wt == KV_DT_F32 && ((uintptr_t)t->data & 3))
        return kv_fail(KV_E_DATA, "GGUF tensor %s: F32 data is not 4-byte aligned", name);
    if ((wt == KV_DT_F16 || wt == KV_DT_BF16) && ((uintptr_t)t->data & 1))
        return kv_fail(KV_E_DATA, "GGUF tensor %s: 16-bit data is not 2-byte aligned", name);
    *out = wview(wt, rows, cols, t->data);
    return KV_OK;
}

/* A 1-D float vector (norms, rope_freqs) converted to f32 into dst. */
static kv_status gguf_vector(const kv_gguf *g, const char *name, int n, float *dst, bool optional,
                             bool *found)
{
    const kv_gguf_tensor *t = kv_gguf_tensor_find(g, name);
    if (found) *found = t != NULL;
    if (!t) return optional ? KV_OK : kv_fail(KV_E_DATA, "GGUF tensor %s is missing", name);
    if (t->n_dims != 1 || t->ne[0] != n)
        return kv_fail(KV_E_DATA, "GGUF tensor %s has %lld elements in %d dims, expected [%d]", name,
                       (long long)t->ne[0], t->n_dims, n);
    const uint8_t *s = t->data;
    for (int i = 0; i < n; i++) {
        if (t->ggml_type == KV_GGML_F32) memcpy(&dst[i], s + 4 * i, 4);
        else if (t->ggml_type == KV_GGML_F16 || t->ggml_type == KV_GGML_BF16) {
            uint16_t b;
            memcpy(&b, s + 2 * i, 2);
            dst[i] = t->ggml_type == KV_GGML_F16 ? kv_half_to_f32(b) : kv_bf16_to_f32(b);
        } else {
            char tb[16];
            return kv_fail(KV_E_UNSUPPORTED, "GGUF tensor %s: a vector must be F32, F16 or BF16, not %s",
                           name, kv_ggml_type_name(t->ggml_type, tb));
        }
    }
    return KV_OK;
}

static kv_status gguf_int(const kv_gguf *g, const char *key, int *v, bool required, int64_t lo,
                          int64_t hi)
{
    int64_t x;
    kv_status st = KV_OK;
    if (!kv_gguf_get_int(g, key, &x, &st)) {
        if (st) return st;
        return required ? kv_fail(KV_E_DATA, "GGUF metadata %s is missing", key) : KV_OK;
    }
    if (x < lo || x > hi) return kv_fail(KV_E_DATA, "GGUF metadata %s = %lld out of range", key, (long long)x);
    *v = (int)x;
    return KV_OK;
}

static kv_status gguf_num(const kv_gguf *g, const char *key, double *v)
{
    kv_status st = KV_OK;
    if (!kv_gguf_get_float(g, key, v, &st)) return st;
    if (!isfinite(*v)) return kv_fail(KV_E_DATA, "GGUF metadata %s is not finite", key);
    return KV_OK;
}

/* The architectures this loader knows; every other one is refused by name. */
static const char *const gguf_archs[] = {"llama", "qwen2"};

/* "<arch>.<rest>" */
static const char *akey(char *buf, size_t n, const char *arch, const char *rest)
{
    snprintf(buf, n, "%s.%s", arch, rest);
    return buf;
}

/* Row order that maps a NEOX-rotated projection (pairs i, i + hd/2 of each
 * head) onto the interleaved order (pairs 2i, 2i + 1): output row
 * h*hd + 2i is stored row h*hd + i, output row h*hd + 2i + 1 is stored row
 * h*hd + i + hd/2.  Rotating the permuted q and k by interleaved pairs is
 * then NEOX RoPE, and q·k is unchanged by the common permutation. */
static void neox_perm(int32_t *perm, int heads, int hd)
{
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < hd / 2; i++) {
            perm[h * hd + 2 * i] = h * hd + i;
            perm[h * hd + 2 * i + 1] = h * hd + i + hd / 2;
        }
}

/* An optional bias "blk.L.<what>.bias" of n floats into dst (permuted when
 * perm is set); *out = dst when present. */
static kv_status gguf_bias(const kv_gguf *g, int l, const char *what, int n, float *dst,
                           const int32_t *perm, float *tmp, const float **out)
{
    char nm[96];
    bool found;
    snprintf(nm, sizeof nm, "blk.%d.%s.bias", l, what);
    kv_status st = gguf_vector(g, nm, n, perm ? tmp : dst, true, &found);
    if (st || !found) return st;
    if (perm)
        for (int i = 0; i < n; i++) dst[i] = tmp[perm[i]];
    *out = dst;
    return KV_OK;
}

static kv_status load_gguf(kv_model *m, const uint8_t *p, size_t len)
{
    kv_status st = kv_gguf_parse(p, len, &m->gguf);
    if (st) return st;
    const kv_gguf *g = m->gguf;
    kv_model_config *c = &m->cfg;
    snprintf(c->format, sizeof c->format, "gguf");
    char arch[32] = "", k[96];
    if (!kv_gguf_get_str(g, "general.architecture", arch, sizeof arch, &st))
        return st ? st : kv_fail(KV_E_DATA, "GGUF general.architecture is missing (a vocabulary-only file?)");
    size_t ai = 0;
    while (ai < sizeof gguf_archs / sizeof *gguf_archs && strcmp(arch, gguf_archs[ai])) ai++;
    if (ai == sizeof gguf_archs / sizeof *gguf_archs)
        return kv_fail(KV_E_UNSUPPORTED, "GGUF architecture '%s' is not supported (llama, qwen2 are)", arch);
    const bool qwen2 = !strcmp(arch, "qwen2");
    snprintf(c->arch, sizeof c->arch, "%s", gguf_archs[ai]);
    kv_gguf_get_str(g, "general.name", c->name, sizeof c->name, NULL);
    if (!c->name[0]) snprintf(c->name, sizeof c->name, "gguf");
    c->n_kv_heads = 0;
    int key_len = 0, val_len = 0;
    if ((st = gguf_int(g, akey(k, sizeof k, arch, "embedding_length"), &c->dim, true, 1, 65536)) ||
        (st = gguf_int(g, akey(k, sizeof k, arch, "block_count"), &c->n_layers, true, 1, 1024)) ||
        (st = gguf_int(g, akey(k, sizeof k, arch, "feed_forward_length"), &c->hidden_dim, true, 1, 1 << 20)) ||
        (st = gguf_int(g, akey(k, sizeof k, arch, "attention.head_count"), &c->n_heads, true, 1, 1024)) ||
        (st = gguf_int(g, akey(k, sizeof k, arch, "attention.head_count_kv"), &c->n_kv_heads, false, 1, 1024)) ||
        (st = gguf_int(g, akey(k, sizeof k, arch, "attention.key_length"), &key_len, false, 1, 4096)) ||
        (st = gguf_int(g, akey(k, sizeof k, arch, "attention.value_length"), &val_len, false, 1, 4096)) ||
        (st = gguf_int(g, akey(k, sizeof k, arch, "context_length"), &c->seq_len, false, 1, 1 << 24)) ||
        (st = gguf_int(g, akey(k, sizeof k, arch, "rope.dimension_count"), &c->rope_dim, false, 1, 65536)))
        return st;
    if (key_len && val_len && key_len != val_len)
        return kv_fail(KV_E_UNSUPPORTED, "GGUF key_length %d != value_length %d is not supported", key_len,
                       val_len);
    c->head_dim = key_len ? key_len : val_len;
    if (!c->n_kv_heads) c->n_kv_heads = c->n_heads;
    if (!c->seq_len) c->seq_len = 2048;
    double eps = c->norm_eps;
    if ((st = gguf_num(g, akey(k, sizeof k, arch, "attention.layer_norm_rms_epsilon"), &eps)) ||
        (st = gguf_num(g, akey(k, sizeof k, arch, "rope.freq_base"), &c->rope_theta)))
        return st;
    c->norm_eps = (float)eps;
    char stype[32] = "";
    kv_gguf_get_str(g, akey(k, sizeof k, arch, "rope.scaling.type"), stype, sizeof stype, &st);
    if (st) return st;
    /* Llama-3.1 files carry their frequency scaling as rope_freqs.weight
     * (read below); "llama3" here is the same rule given by parameters. */
    if (!strcmp(stype, "llama3")) {
        c->rope_scaling = KV_ROPE_SCALING_LLAMA3;
        c->rope_factor = 8;
        c->rope_low_freq_factor = 1;
        c->rope_high_freq_factor = 4;
        c->rope_orig_ctx = 8192;
        if ((st = gguf_num(g, akey(k, sizeof k, arch, "rope.scaling.factor"), &c->rope_factor)) ||
            (st = gguf_num(g, akey(k, sizeof k, arch, "rope.scaling.low_freq_factor"), &c->rope_low_freq_factor)) ||
            (st = gguf_num(g, akey(k, sizeof k, arch, "rope.scaling.high_freq_factor"), &c->rope_high_freq_factor)) ||
            (st = gguf_int(g, akey(k, sizeof k, arch, "rope.scaling.original_context_length"), &c->rope_orig_ctx,
                           false, 1, 1 << 24)))
            return st;
    } else if (stype[0] && strcmp(stype, "none")) {
        return kv_fail(KV_E_UNSUPPORTED, "GGUF rope scaling type '%s' not supported (none, llama3)", stype);
    }
    const kv_gguf_tensor *emb = kv_gguf_tensor_find(g, "token_embd.weight");
    if (!emb) return kv_fail(KV_E_DATA, "GGUF tensor token_embd.weight is missing");
    if (emb->n_dims != 2 || emb->ne[1] < 1 || emb->ne[1] > (1 << 24))
        return kv_fail(KV_E_DATA, "GGUF tensor token_embd.weight has a bad shape");
    c->vocab_size = (int)emb->ne[1];
    if ((st = kv_model_config_check(c))) return st;
    int d = c->dim, L = c->n_layers, hd = c->head_dim;
    int qd = c->n_heads * hd, kvd = c->n_kv_heads * hd, V = c->vocab_size, H = c->hidden_dim;
    /* norm store: output norm, 2 norms per layer, rope_freqs, 4 biases per
     * layer (q, k, v, o), and one scratch vector for permuting biases */
    size_t per_layer = 2 * (size_t)d + (size_t)qd + 2 * (size_t)kvd + (size_t)d;
    size_t nstore = (size_t)d + (size_t)L * per_layer + (size_t)hd / 2 + (size_t)qd + (size_t)d;
    m->layers = calloc((size_t)L, sizeof *m->layers);
    m->norm_store = malloc(nstore * sizeof(float));
    if (qwen2) m->perm_store = malloc((size_t)qd * sizeof *m->perm_store);
    if (!m->layers || !m->norm_store || (qwen2 && !m->perm_store))
        return kv_fail(KV_E_NOMEM, "out of memory for %d layers", L);
    if (qwen2) neox_perm(m->perm_store, c->n_heads, hd);
    const int32_t *perm = m->perm_store;
    if ((st = gguf_weight(g, "token_embd.weight", V, d, &m->tok_embd, false))) return st;
    if ((st = gguf_weight(g, "output.weight", V, d, &m->output, true))) return st;
    c->shared_classifier = m->output.data == NULL;
    if (c->shared_classifier) m->output = m->tok_embd;
    float *ns = m->norm_store;
    if ((st = gguf_vector(g, "output_norm.weight", d, ns, false, NULL))) return st;
    m->output_norm = ns;
    ns += d;
    bool have_rf;
    if ((st = gguf_vector(g, "rope_freqs.weight", hd / 2, ns, true, &have_rf))) return st;
    if (have_rf) {
        c->rope_freq_factors = ns;
        /* the factors already hold the scaling: do not apply it twice */
        c->rope_scaling = KV_ROPE_SCALING_NONE;
        for (int i = 0; i < hd / 2; i++)
            if (!(ns[i] > 0) || !isfinite(ns[i]))
                return kv_fail(KV_E_DATA, "GGUF rope_freqs.weight[%d] = %g is not a positive factor", i, ns[i]);
    }
    ns += hd / 2;
    float *tmp = m->norm_store + nstore - (size_t)(qd > d ? qd : d);
    char nm[96];
    for (int l = 0; l < L; l++) {
        kv_layer_weights *lw = &m->layers[l];
#define W(field, suffix, r, cc)                                                \
    snprintf(nm, sizeof nm, "blk.%d." suffix ".weight", l);                    \
    if ((st = gguf_weight(g, nm, r, cc, &lw->field, false))) return st;
        W(wq, "attn_q", qd, d);
        W(wk, "attn_k", kvd, d);
        W(wv, "attn_v", kvd, d);
        W(wo, "attn_output", d, qd);
        W(w_gate, "ffn_gate", H, d);
        W(w_down, "ffn_down", d, H);
        W(w_up, "ffn_up", H, d);
#undef W
        lw->wq.perm = perm;
        lw->wk.perm = perm; /* the first kvd rows of the same order */
        if ((st = gguf_bias(g, l, "attn_q", qd, ns, perm, tmp, &lw->wq.bias))) return st;
        ns += qd;
        if ((st = gguf_bias(g, l, "attn_k", kvd, ns, perm, tmp, &lw->wk.bias))) return st;
        ns += kvd;
        if ((st = gguf_bias(g, l, "attn_v", kvd, ns, NULL, tmp, &lw->wv.bias))) return st;
        ns += kvd;
        if ((st = gguf_bias(g, l, "attn_output", d, ns, NULL, tmp, &lw->wo.bias))) return st;
        ns += d;
        snprintf(nm, sizeof nm, "blk.%d.attn_norm.weight", l);
        if ((st = gguf_vector(g, nm, d, ns, false, NULL))) return st;
        lw->attn_norm = ns;
        ns += d;
        snprintf(nm, sizeof nm, "blk.%d.ffn_norm.weight", l);
        if ((st = gguf_vector(g, nm, d, ns, false, NULL))) return st;
        lw->ffn_norm = ns;
        ns += d;
    }
    return KV_OK;
}

// --- loading entry points ----------------------------------------------------------

static kv_status load_buffer(kv_model *m, const uint8_t *p, size_t len)
{
    if (len == 0) return kv_fail(KV_E_DATA, "model file is empty");
    if (len >= 4 && !memcmp(p, "GGUF", 4)) return load_gguf(m, p, len);
    return load_llama2c(m, p, len);
}

kv_status kv_model_open_mem(const void *buf, size_t len, kv_model **out)
{
    *out = NULL;
    kv_model *m = calloc(1, sizeof *m);
    if (!m) return kv_fail(KV_E_NOMEM, "out of memory");
    config_defaults(&m->cfg);
    m->owned = malloc(len ? len : 1); /* aligned copy: views assume alignment */
    if (!m->owned) {
        free(m);
        return kv_fail(KV_E_NOMEM, "out of memory for a %zu-byte model", len);
    }
    if (len) memcpy(m->owned, buf, len);
    kv_status st = load_buffer(m, m->owned, len);
    if (st) {
        kv_model_close(m);
        return st;
    }
    *out = m;
    return KV_OK;
}

kv_status kv_model_open(const char *path, kv_model **out)
{
    *out = NULL;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return kv_fail(KV_E_NOINPUT, "cannot open model %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode)) {
        close(fd);
        return kv_fail(KV_E_NOINPUT, "model %s is not a regular file", path);
    }
    kv_model *m = calloc(1, sizeof *m);
    if (!m) {
        close(fd);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    config_defaults(&m->cfg);
    size_t len = (size_t)sb.st_size;
    kv_status st;
    if (len == 0) {
        st = kv_fail(KV_E_DATA, "model file is empty");
    } else {
        void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            st = kv_fail(KV_E_IO, "cannot map model %s: %s", path, strerror(errno));
        } else {
            m->map = map;
            m->map_len = len;
            st = load_buffer(m, map, len);
        }
    }
    close(fd);
    if (st) {
        kv_errcontext("%s", path);
        kv_model_close(m);
        return st;
    }
    if (!strcmp(m->cfg.name, "llama2.c") || !strcmp(m->cfg.name, "gguf")) {
        /* no name inside the file: use its base name ("stories260K") */
        const char *b = strrchr(path, '/');
        b = b ? b + 1 : path;
        size_t n = strcspn(b, ".");
        if (n > 0 && n < sizeof m->cfg.name) snprintf(m->cfg.name, sizeof m->cfg.name, "%.*s", (int)n, b);
    }
    *out = m;
    return KV_OK;
}

// --- synthetic models ----------------------------------------------------------------

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Fill n values uniform in [-a, a] in type t; chunks are seeded by index so
 * the result does not depend on the thread count. */
static void fill_random(void *dst, kv_dtype t, size_t n, float a, uint64_t seed)
{
    const size_t chunk = 1 << 16;
    size_t nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (size_t ci = 0; ci < nchunks; ci++) {
        uint64_t s = seed ^ (ci * 0x2545f4914f6cdd1dull);
        size_t i0 = ci * chunk, i1 = i0 + chunk < n ? i0 + chunk : n;
        for (size_t i = i0; i < i1; i++) {
            uint64_t r = splitmix(&s);
            float f = a * ((float)(r >> 40) * (2.0f / 16777216.0f) - 1.0f);
            if (t == KV_DT_F32) ((float *)dst)[i] = f;
            else if (t == KV_DT_F16) ((uint16_t *)dst)[i] = kv_f32_to_half(f);
            else ((uint16_t *)dst)[i] = kv_f32_to_bf16(f);
        }
    }
}

kv_status kv_model_geometry(const char *name, kv_model_config *out)
{
    kv_model_config c;
    config_defaults(&c);
    if (!strcmp(name, "llama-3.1-8b")) {
        c.dim = 4096, c.hidden_dim = 14336, c.n_layers = 32, c.n_heads = 32, c.n_kv_heads = 8;
        c.vocab_size = 128256, c.seq_len = 131072, c.rope_theta = 500000;
        c.rope_scaling = KV_ROPE_SCALING_LLAMA3;
        c.rope_factor = 8, c.rope_low_freq_factor = 1, c.rope_high_freq_factor = 4;
        c.rope_orig_ctx = 8192;
    } else if (!strcmp(name, "llama-3.2-1b")) {
        c.dim = 2048, c.hidden_dim = 8192, c.n_layers = 16, c.n_heads = 32, c.n_kv_heads = 8;
        c.vocab_size = 128256, c.seq_len = 131072, c.rope_theta = 500000;
        c.rope_scaling = KV_ROPE_SCALING_LLAMA3;
        c.rope_factor = 32, c.rope_low_freq_factor = 1, c.rope_high_freq_factor = 4;
        c.rope_orig_ctx = 8192;
    } else if (!strcmp(name, "llama-2-7b")) {
        c.dim = 4096, c.hidden_dim = 11008, c.n_layers = 32, c.n_heads = 32, c.n_kv_heads = 32;
        c.vocab_size = 32000, c.seq_len = 4096;
    } else if (!strcmp(name, "tiny-wide-heads")) {
        /* Mistral-Nemo's shape in small: heads wider than dim / n_heads */
        c.dim = 128, c.hidden_dim = 256, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 64;
        c.vocab_size = 512, c.seq_len = 1024;
    } else if (!strcmp(name, "tiny")) {
        c.dim = 128, c.hidden_dim = 344, c.n_layers = 4, c.n_heads = 8, c.n_kv_heads = 4;
        c.vocab_size = 512, c.seq_len = 4096;
    } else {
        return kv_fail(KV_E_USAGE,
                       "unknown model shape '%s' (llama-3.1-8b, llama-3.2-1b, llama-2-7b, tiny, tiny-wide-heads)",
                       name);
    }
    c.shared_classifier = false;
    snprintf(c.name, sizeof c.name, "%s", name);
    kv_status st = kv_model_config_check(&c);
    if (st) return st;
    *out = c;
    return KV_OK;
}

kv_status kv_model_synthetic(const char *name, uint64_t seed, kv_dtype wt, kv_model **out)
{
    *out = NULL;
    kv_model_config c;
    kv_status st = kv_model_geometry(name, &c);
    if (st) return st;
    if (wt != KV_DT_F32 && wt != KV_DT_F16 && wt != KV_DT_BF16)
        return kv_fail(KV_E_USAGE, "synthetic weights must be F32, F16 or BF16");
    snprintf(c.name, sizeof c.name, "%s (synthetic)", name);
    snprintf(c.format, sizeof c.format, "synthetic");
    kv_model *m = calloc(1, sizeof *m);
    if (!m) return kv_fail(KV_E_NOMEM, "out of memory");
    m->cfg = c;
    size_t D = (size_t)c.dim, H = (size_t)c.hidden_dim, V = (size_t)c.vocab_size;
    size_t qd = (size_t)c.n_heads * c.head_dim, kvd = (size_t)c.n_kv_heads * c.head_dim;
    size_t es = wt == KV_DT_F32 ? 4 : 2;
    size_t n_layer = qd * D * 2 + kvd * D * 2 + H * D * 3; /* wq wo wk wv gate down up */
    size_t n_emb = V * D;
    size_t bytes = (n_layer + 2 * n_emb) * es;
    m->owned = malloc(bytes);
    m->norm_store = malloc(D * sizeof(float));
    m->layers = calloc((size_t)c.n_layers, sizeof *m->layers);
    if (!m->owned || !m->norm_store || !m->layers) {
        kv_model_close(m);
        return kv_fail(KV_E_NOMEM, "out of memory for synthetic %s (%zu MB)", name, bytes >> 20);
    }
    uint8_t *p = m->owned;
    for (size_t i = 0; i < D; i++) m->norm_store[i] = 1.0f;
    /* uniform[-a, a] with a = sqrt(3 / cols) gives each output unit variance,
     * so activations stay in a realistic range through all layers. */
    kv_weight shared_w[7];
    size_t rows[7] = {qd, kvd, kvd, D, H, D, H}, cols[7] = {D, D, D, qd, D, H, D};
    for (int i = 0; i < 7; i++) {
        fill_random(p, wt, rows[i] * cols[i], sqrtf(3.0f / (float)cols[i]), seed + (uint64_t)i);
        shared_w[i] = wview(wt, (int)rows[i], (int)cols[i], p);
        p += rows[i] * cols[i] * es;
    }
    fill_random(p, wt, 2 * n_emb, 1.0f, seed + 7);
    m->tok_embd = wview(wt, (int)V, (int)D, p);
    p += n_emb * es;
    m->output = wview(wt, (int)V, (int)D, p);
    m->output_norm = m->norm_store;
    for (int l = 0; l < c.n_layers; l++) {
        kv_layer_weights *lw = &m->layers[l];
        lw->attn_norm = lw->ffn_norm = m->norm_store;
        lw->wq = shared_w[0], lw->wk = shared_w[1], lw->wv = shared_w[2], lw->wo = shared_w[3];
        lw->w_gate = shared_w[4], lw->w_down = shared_w[5], lw->w_up = shared_w[6];
    }
    *out = m;
    return KV_OK;
}

void kv_model_close(kv_model *m)
{
    if (!m) return;
    kv_gguf_free(m->gguf);
    if (m->map) munmap(m->map, m->map_len);
    free(m->owned);
    free(m->norm_store);
    free(m->perm_store);
    free(m->layers);
    free(m);
}

const struct kv_gguf *kv_model_gguf(const kv_model *m) { return m ? m->gguf : NULL; }

void kv_model_geom(const kv_model *m, kv_geom *g)
{
    const kv_model_config *c = &m->cfg;
    kv_geom_defaults(g);
    g->n_layers = c->n_layers;
    g->n_heads = c->n_heads;
    g->n_kv_heads = c->n_kv_heads;
    g->head_dim = c->head_dim;
    g->rope_theta = c->rope_theta;
    if (c->rope_scaling == KV_ROPE_SCALING_LLAMA3) {
        g->rope_scaling = KV_ROPE_SCALING_LLAMA3;
        g->rope_factor = c->rope_factor;
        g->rope_low_freq_factor = c->rope_low_freq_factor;
        g->rope_high_freq_factor = c->rope_high_freq_factor;
        g->rope_orig_ctx = c->rope_orig_ctx;
    }
    snprintf(g->model, sizeof g->model, "%s", c->name);
}

uint64_t kv_model_weight_bytes(const kv_model *m)
{
    const kv_model_config *c = &m->cfg;
    uint64_t b = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const kv_layer_weights *lw = &m->layers[l];
        const kv_weight *ws[7] = {&lw->wq, &lw->wk, &lw->wv, &lw->wo, &lw->w_gate, &lw->w_down, &lw->w_up};
        for (int i = 0; i < 7; i++) b += kv_dtype_row_bytes(ws[i]->type, ws[i]->cols) * (uint64_t)ws[i]->rows;
        b += 2 * (uint64_t)c->dim * 4;
    }
    b += kv_dtype_row_bytes(m->tok_embd.type, m->tok_embd.cols) * (uint64_t)m->tok_embd.rows;
    if (!c->shared_classifier)
        b += kv_dtype_row_bytes(m->output.type, m->output.cols) * (uint64_t)m->output.rows;
    return b + (uint64_t)c->dim * 4;
}

/* One definition for the CPU and GPU engines, so that both rotate keys by
   exactly the same float angles and their logits stay comparable. */
void kv_model_rope_freqs(const kv_model_config *c, float *inv_freq)
{
    int hd = c->head_dim;
    for (int i = 0; i < hd / 2; i++) {
        float f = 1.0f / powf((float)c->rope_theta, (float)(2 * i) / (float)hd);
        if (c->rope_scaling == KV_ROPE_SCALING_LLAMA3) {
            double wavelen = 2 * M_PI / f;
            double lo_wl = c->rope_orig_ctx / c->rope_low_freq_factor;
            double hi_wl = c->rope_orig_ctx / c->rope_high_freq_factor;
            if (wavelen > lo_wl) {
                f = (float)(f / c->rope_factor);
            } else if (wavelen >= hi_wl) {
                double smooth = (c->rope_orig_ctx / wavelen - c->rope_low_freq_factor) /
                                (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (float)((1 - smooth) * f / c->rope_factor + smooth * f);
            }
        }
        if (c->rope_freq_factors) f /= c->rope_freq_factors[i];
        inv_freq[i] = f;
    }
}

/* The first non-finite element of w, as "row r, column c", or false. */
static bool weight_nonfinite(const kv_weight *w, float *row, char *at, size_t n)
{
    for (int r = 0; r < w->rows; r++) {
        kv_weight_row(w, r, row);
        size_t c = kv_first_nonfinite(row, (size_t)w->cols);
        if (c != SIZE_MAX) {
            snprintf(at, n, "row %d, column %zu", r, c);
            return true;
        }
    }
    return false;
}

static bool vector_nonfinite(const float *x, int len, char *at, size_t n)
{
    size_t i = x ? kv_first_nonfinite(x, (size_t)len) : SIZE_MAX;
    if (i == SIZE_MAX) return false;
    snprintf(at, n, "element %zu", i);
    return true;
}

bool kv_model_first_nonfinite(const kv_model *m, char *where, size_t n)
{
    const kv_model_config *c = &m->cfg;
    int wide = c->dim > c->hidden_dim ? c->dim : c->hidden_dim;
    if (c->n_heads * c->head_dim > wide) wide = c->n_heads * c->head_dim;
    float *row = malloc((size_t)wide * sizeof *row);
    char at[64];
    bool found = false;
    if (!row) {
        snprintf(where, n, "(out of memory while looking)");
        return true;
    }
    if (weight_nonfinite(&m->tok_embd, row, at, sizeof at)) {
        snprintf(where, n, "token embedding (tok_embd) %s", at);
        found = true;
    } else if (vector_nonfinite(c->rope_freq_factors, c->head_dim / 2, at, sizeof at)) {
        snprintf(where, n, "rope_freqs %s", at);
        found = true;
    }
    for (int l = 0; l < c->n_layers && !found; l++) {
        const kv_layer_weights *lw = &m->layers[l];
        const kv_weight *ws[7] = {&lw->wq, &lw->wk, &lw->wv, &lw->wo, &lw->w_gate, &lw->w_up, &lw->w_down};
        static const char *names[7] = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"};
        const char *what = NULL;
        if (vector_nonfinite(lw->attn_norm, c->dim, at, sizeof at)) what = "attn_norm";
        for (int i = 0; i < 7 && !what; i++) /* in the order a forward pass uses them */
            if (i == 4 && vector_nonfinite(lw->ffn_norm, c->dim, at, sizeof at)) what = "ffn_norm";
            else if (weight_nonfinite(ws[i], row, at, sizeof at)) what = names[i];
        if (what) {
            snprintf(where, n, "layer %d %s %s", l, what, at);
            found = true;
        }
    }
    if (!found && vector_nonfinite(m->output_norm, c->dim, at, sizeof at)) {
        snprintf(where, n, "output_norm %s", at);
        found = true;
    }
    if (!found && m->output.data != m->tok_embd.data && weight_nonfinite(&m->output, row, at, sizeof at)) {
        snprintf(where, n, "classifier (output) %s", at);
        found = true;
    }
    free(row);
    return found;
}

kv_status kv_model_nonfinite_fail(const kv_model *m, const char *what, int pos)
{
    char w[160];
    if (kv_model_first_nonfinite(m, w, sizeof w))
        return kv_fail(KV_E_DATA, "%s at position %d are NaN or infinite: the model's %s is not finite", what,
                       pos, w);
    return kv_fail(KV_E_DATA, "%s at position %d overflowed to NaN or infinity (every weight is finite)", what,
                   pos);
}
