/*
 * kv_convert: GGUF writing of models and vocabularies (see kv_convert.h).
 * Matrices are decoded row by row to float32 (kv_weight_row, so any input
 * type converts to any output type) and quantized with kv_quants, rows in
 * parallel.  A matrix whose row length is not a multiple of the chosen
 * type's block falls back the way llama.cpp's quantizer does (K-quants to
 * Q5_0/Q5_1/Q8_0, then to F16) and the report says so.
 */
#include "model/kv_convert.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_file.h"
#include "common/kv_ggml.h"
#include "format/kv_gguf.h"
#include "format/kv_gguf_write.h"
#include "model/kv_matmul.h"
#include "model/kv_quants.h"

void kv_convert_opts_default(kv_convert_opts *o)
{
    memset(o, 0, sizeof *o);
    o->wtype = KV_GGML_F16;
    o->embd_type = -1;
    o->arch = "llama";
    o->rope_factor = 8;
    o->rope_low = 1;
    o->rope_high = 4;
    o->rope_orig_ctx = 8192;
}

typedef struct {
    kv_gguf_writer *w;
    void **bufs; /* tensor data to free after the write */
    size_t nbufs, capbufs;
    kv_convert_report *rep;
} conv;

static void *keep(conv *c, size_t n)
{
    if (c->nbufs == c->capbufs) {
        size_t nc = c->capbufs ? 2 * c->capbufs : 64;
        void **nb = realloc(c->bufs, nc * sizeof *nb);
        if (!nb) return NULL;
        c->bufs = nb, c->capbufs = nc;
    }
    void *p = malloc(n ? n : 1);
    if (p) c->bufs[c->nbufs++] = p;
    return p;
}

/* The type a row of cols values can take when t cannot (llama.cpp's rule). */
static uint32_t fallback_type(uint32_t t, int cols)
{
    if (cols % kv_quant_block(t) == 0) return t;
    switch (t) {
    case KV_GGML_Q2_K: case KV_GGML_Q3_K: case KV_GGML_Q4_K: t = KV_GGML_Q5_0; break;
    case KV_GGML_Q5_K: t = KV_GGML_Q5_1; break;
    case KV_GGML_Q6_K: t = KV_GGML_Q8_0; break;
    default: break;
    }
    return cols % kv_quant_block(t) == 0 ? t : KV_GGML_F16;
}

/* Matrix w as tensor name in type t; order (rows) gives the model row of
 * each file row, or NULL. */
static kv_status put_matrix(conv *c, const char *name, const kv_weight *w, uint32_t t, const int32_t *order)
{
    uint32_t tt = fallback_type(t, w->cols);
    if (tt != t) {
        char tb[16];
        if (!c->rep->n_fallback)
            snprintf(c->rep->fallback, sizeof c->rep->fallback, "%s (rows of %d): %s", name, w->cols,
                     kv_ggml_type_name(tt, tb));
        c->rep->n_fallback++;
    }
    size_t rb = kv_quant_row_bytes(tt, w->cols), nb = rb * (size_t)w->rows;
    uint8_t *buf = keep(c, nb);
    if (!buf) return kv_fail(KV_E_NOMEM, "out of memory for %s (%zu bytes)", name, nb);
    int bad = 0;
#pragma omp parallel reduction(| : bad)
    {
        float *row = malloc((size_t)w->cols * sizeof *row);
        if (!row) bad = 1;
#pragma omp for schedule(dynamic, 16)
        for (int r = 0; r < w->rows; r++) {
            if (!row) continue;
            kv_weight_row(w, order ? order[r] : r, row);
            if (kv_quant_quantize_row(tt, row, buf + rb * (size_t)r, w->cols)) bad = 1;
        }
        free(row);
    }
    if (bad) return kv_fail(KV_E_NOMEM, "cannot convert %s", name);
    int64_t ne[2] = {w->cols, w->rows};
    c->rep->n_tensors++;
    c->rep->bytes += nb;
    return kv_gguf_add_tensor(c->w, name, tt, 2, ne, buf, nb);
}

static kv_status put_vector(conv *c, const char *name, const float *v, int n, const int32_t *order)
{
    float *buf = keep(c, (size_t)n * sizeof *buf);
    if (!buf) return kv_fail(KV_E_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) buf[i] = v[order ? order[i] : i];
    int64_t ne[1] = {n};
    c->rep->n_tensors++;
    c->rep->bytes += (uint64_t)n * 4;
    return kv_gguf_add_tensor(c->w, name, KV_GGML_F32, 1, ne, buf, (size_t)n * 4);
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The SentencePiece vocabulary of a llama2.c tokenizer: spaces become
 * U+2581, <0xHH> pieces bytes, ids 1 and 2 control, 0 unknown. */
static kv_status put_llama2c_vocab(conv *c, const kv_tokenizer *t)
{
    int n = kv_tokenizer_vocab(t);
    char **pieces = calloc((size_t)n, sizeof *pieces);
    size_t *lens = calloc((size_t)n, sizeof *lens);
    float *scores = malloc((size_t)n * sizeof *scores);
    int32_t *types = malloc((size_t)n * sizeof *types);
    kv_status st = KV_OK;
    if (!pieces || !lens || !scores || !types) {
        st = kv_fail(KV_E_NOMEM, "out of memory");
        goto done;
    }
    for (int i = 0; i < n && !st; i++) {
        size_t l;
        const char *p = kv_tokenizer_piece(t, i, &l);
        char *q = malloc(3 * l + 1);
        if (!q) {
            st = kv_fail(KV_E_NOMEM, "out of memory");
            break;
        }
        size_t k = 0;
        for (size_t j = 0; j < l; j++) {
            if (p[j] == ' ') memcpy(q + k, "\xE2\x96\x81", 3), k += 3;
            else q[k++] = p[j];
        }
        pieces[i] = q;
        lens[i] = k;
        scores[i] = kv_tokenizer_score(t, i);
        int ty = kv_tokenizer_token_type(t, i);
        types[i] = i == 0 && ty == 3 ? 2 : ty; /* <unk> is the unknown token */
    }
    if (!st) st = kv_gguf_set_str(c->w, "tokenizer.ggml.model", "llama");
    if (!st) st = kv_gguf_set_arr_str(c->w, "tokenizer.ggml.tokens", (const char *const *)pieces, lens, (size_t)n);
    if (!st) st = kv_gguf_set_arr_f32(c->w, "tokenizer.ggml.scores", scores, (size_t)n);
    if (!st) st = kv_gguf_set_arr_i32(c->w, "tokenizer.ggml.token_type", types, (size_t)n);
    if (!st) st = kv_gguf_set_u32(c->w, "tokenizer.ggml.bos_token_id", (uint32_t)kv_tokenizer_bos(t));
    if (!st) st = kv_gguf_set_u32(c->w, "tokenizer.ggml.eos_token_id", (uint32_t)kv_tokenizer_eos(t));
    if (!st) st = kv_gguf_set_u32(c->w, "tokenizer.ggml.unknown_token_id", 0);
    if (!st) st = kv_gguf_set_bool(c->w, "tokenizer.ggml.add_bos_token", true);
    if (!st) st = kv_gguf_set_bool(c->w, "tokenizer.ggml.add_eos_token", false);
done:
    for (int i = 0; pieces && i < n; i++) free(pieces[i]);
    free(pieces);
    free(lens);
    free(scores);
    free(types);
    return st;
}

kv_status kv_convert_model(const kv_model *m, const kv_tokenizer *vocab, const kv_gguf *vocab_gguf,
                           const kv_convert_opts *o, const char *path, kv_convert_report *rep)
{
    const kv_model_config *cf = &m->cfg;
    kv_convert_report dummy;
    if (!rep) rep = &dummy;
    memset(rep, 0, sizeof *rep);
    const bool qwen2 = !strcmp(o->arch, "qwen2");
    if (!qwen2 && strcmp(o->arch, "llama"))
        return kv_fail(KV_E_USAGE, "cannot write architecture '%s' (llama, qwen2)", o->arch);
    if (!kv_quant_supported(o->wtype) || (o->embd_type >= 0 && !kv_quant_supported((uint32_t)o->embd_type))) {
        char tb[16];
        return kv_fail(KV_E_USAGE, "cannot write %s weights",
                       kv_ggml_type_name(kv_quant_supported(o->wtype) ? (uint32_t)o->embd_type : o->wtype, tb));
    }
    const kv_gguf *vsrc = vocab_gguf ? vocab_gguf : kv_model_gguf(m);
    bool llama2c_vocab = vocab && !strcmp(kv_tokenizer_kind(vocab), "llama2c");
    if (!llama2c_vocab && !vsrc)
        return kv_fail(KV_E_USAGE, "no vocabulary to write: give the model's llama2.c tokenizer");
    if (llama2c_vocab && kv_tokenizer_vocab(vocab) != cf->vocab_size)
        return kv_fail(KV_E_DATA, "the tokenizer has %d tokens, the model %d", kv_tokenizer_vocab(vocab),
                       cf->vocab_size);
    if (!llama2c_vocab) {
        const kv_gguf_kv *tk = kv_gguf_find(vsrc, "tokenizer.ggml.tokens");
        if (!tk || tk->type != KV_GGUF_ARRAY)
            return kv_fail(KV_E_DATA, "the vocabulary file has no tokenizer.ggml.tokens");
        if (tk->arr_n != (uint64_t)cf->vocab_size)
            return kv_fail(KV_E_DATA, "the vocabulary has %llu tokens, the model %d", (unsigned long long)tk->arr_n,
                           cf->vocab_size);
    }
    conv c = {0};
    c.rep = rep;
    kv_status st = kv_gguf_writer_new(&c.w);
    if (st) return st;
    const char *arch = qwen2 ? "qwen2" : "llama";
    char k[96];
#define AK(rest) (snprintf(k, sizeof k, "%s." rest, arch), k)
    const int d = cf->dim, hd = cf->head_dim, L = cf->n_layers;
    const int qd = cf->n_heads * hd, kvd = cf->n_kv_heads * hd;
    double theta = o->rope_theta > 0 ? o->rope_theta : cf->rope_theta;
    if (!st) st = kv_gguf_set_str(c.w, "general.architecture", arch);
    if (!st) st = kv_gguf_set_str(c.w, "general.name", o->name ? o->name : cf->name);
    if (!st) st = kv_gguf_set_u32(c.w, AK("context_length"), (uint32_t)cf->seq_len);
    if (!st) st = kv_gguf_set_u32(c.w, AK("embedding_length"), (uint32_t)d);
    if (!st) st = kv_gguf_set_u32(c.w, AK("block_count"), (uint32_t)L);
    if (!st) st = kv_gguf_set_u32(c.w, AK("feed_forward_length"), (uint32_t)cf->hidden_dim);
    if (!st) st = kv_gguf_set_u32(c.w, AK("attention.head_count"), (uint32_t)cf->n_heads);
    if (!st) st = kv_gguf_set_u32(c.w, AK("attention.head_count_kv"), (uint32_t)cf->n_kv_heads);
    if (!st && hd * cf->n_heads != d) st = kv_gguf_set_u32(c.w, AK("attention.key_length"), (uint32_t)hd);
    if (!st && hd * cf->n_heads != d) st = kv_gguf_set_u32(c.w, AK("attention.value_length"), (uint32_t)hd);
    if (!st) st = kv_gguf_set_f32(c.w, AK("attention.layer_norm_rms_epsilon"), cf->norm_eps);
    if (!st) st = kv_gguf_set_f32(c.w, AK("rope.freq_base"), (float)theta);
    if (!st) st = kv_gguf_set_u32(c.w, AK("rope.dimension_count"), (uint32_t)hd);
    if (!st) st = kv_gguf_set_u32(c.w, AK("vocab_size"), (uint32_t)cf->vocab_size);
#undef AK
    if (!st && o->chat_template) st = kv_gguf_set_str(c.w, "tokenizer.chat_template", o->chat_template);
    if (!st && llama2c_vocab) st = put_llama2c_vocab(&c, vocab);
    for (uint64_t i = 0; !st && !llama2c_vocab && i < vsrc->n_kv; i++) {
        const kv_gguf_kv *kv = &vsrc->kv[i];
        if (strncmp(kv->key, "tokenizer.", 10)) continue;
        if (o->chat_template && !strcmp(kv->key, "tokenizer.chat_template")) continue;
        st = kv_gguf_copy_kv(c.w, kv);
    }
    /* qwen2 files hold q and k in NEOX order: file row f is model row inv[f] */
    int32_t *inv = NULL;
    if (!st && qwen2) {
        inv = keep(&c, (size_t)qd * sizeof *inv);
        if (!inv) st = kv_fail(KV_E_NOMEM, "out of memory");
        for (int h = 0; !st && h < cf->n_heads; h++)
            for (int i = 0; i < hd / 2; i++) {
                inv[h * hd + i] = h * hd + 2 * i;
                inv[h * hd + hd / 2 + i] = h * hd + 2 * i + 1;
            }
    }
    const uint32_t et = o->embd_type >= 0 ? (uint32_t)o->embd_type : o->wtype;
    if (!st) st = put_matrix(&c, "token_embd.weight", &m->tok_embd, et, NULL);
    if (!st) st = put_vector(&c, "output_norm.weight", m->output_norm, d, NULL);
    if (!st && !cf->shared_classifier) st = put_matrix(&c, "output.weight", &m->output, et, NULL);
    if (!st && o->rope_llama3) {
        /* Llama-3.1's rule as its converter writes it: divisors of each
         * pair's frequency (1 for short wavelengths, factor for long ones,
         * a smooth blend between) */
        float *ff = keep(&c, (size_t)(hd / 2) * sizeof *ff);
        if (!ff) st = kv_fail(KV_E_NOMEM, "out of memory");
        double lo_wl = o->rope_orig_ctx / o->rope_low, hi_wl = o->rope_orig_ctx / o->rope_high;
        for (int i = 0; !st && i < hd / 2; i++) {
            double freq = 1.0 / pow(theta, (2.0 * i) / hd), wl = 2 * M_PI / freq;
            if (wl < hi_wl) ff[i] = 1;
            else if (wl > lo_wl) ff[i] = (float)o->rope_factor;
            else {
                double sm = (o->rope_orig_ctx / wl - o->rope_low) / (o->rope_high - o->rope_low);
                ff[i] = (float)(1 / ((1 - sm) / o->rope_factor + sm));
            }
        }
        int64_t ne[1] = {hd / 2};
        if (!st) st = kv_gguf_add_tensor(c.w, "rope_freqs.weight", KV_GGML_F32, 1, ne, ff, (size_t)(hd / 2) * 4);
        rep->n_tensors++;
    }
    uint64_t seed = o->bias_seed;
    float *rb = o->bias_seed ? keep(&c, (size_t)(qd + 2 * kvd) * sizeof *rb) : NULL;
    if (o->bias_seed && !rb) st = kv_fail(KV_E_NOMEM, "out of memory");
    char nm[96];
    for (int l = 0; !st && l < L; l++) {
        const kv_layer_weights *lw = &m->layers[l];
#define N(suffix) (snprintf(nm, sizeof nm, "blk.%d." suffix, l), nm)
        st = put_vector(&c, N("attn_norm.weight"), lw->attn_norm, d, NULL);
        if (!st) st = put_matrix(&c, N("attn_q.weight"), &lw->wq, o->wtype, inv);
        if (!st) st = put_matrix(&c, N("attn_k.weight"), &lw->wk, o->wtype, inv);
        if (!st) st = put_matrix(&c, N("attn_v.weight"), &lw->wv, o->wtype, NULL);
        if (!st) st = put_matrix(&c, N("attn_output.weight"), &lw->wo, o->wtype, NULL);
        /* biases: the model's, plus seeded noise when asked */
        const kv_weight *bw[3] = {&lw->wq, &lw->wk, &lw->wv};
        const char *bn[3] = {"attn_q.bias", "attn_k.bias", "attn_v.bias"};
        for (int b = 0; !st && b < 3; b++) {
            int n = bw[b]->rows;
            if (!bw[b]->bias && !o->bias_seed) continue;
            float *v = rb + (b == 0 ? 0 : b == 1 ? qd : qd + kvd);
            for (int i = 0; i < n; i++) {
                float noise = o->bias_seed ? 0.2f * ((float)(splitmix(&seed) >> 40) / 16777216.0f - 0.5f) : 0;
                v[i] = (bw[b]->bias ? bw[b]->bias[i] : 0) + noise;
            }
            snprintf(nm, sizeof nm, "blk.%d.%s", l, bn[b]);
            st = put_vector(&c, nm, v, n, b < 2 ? inv : NULL);
        }
        if (!st && lw->wo.bias) st = put_vector(&c, N("attn_output.bias"), lw->wo.bias, d, NULL);
        if (!st) st = put_vector(&c, N("ffn_norm.weight"), lw->ffn_norm, d, NULL);
        if (!st) st = put_matrix(&c, N("ffn_gate.weight"), &lw->w_gate, o->wtype, NULL);
        if (!st) st = put_matrix(&c, N("ffn_down.weight"), &lw->w_down, o->wtype, NULL);
        if (!st) st = put_matrix(&c, N("ffn_up.weight"), &lw->w_up, o->wtype, NULL);
#undef N
    }
    if (!st) st = kv_gguf_writer_write(c.w, path);
    kv_gguf_writer_free(c.w);
    for (size_t i = 0; i < c.nbufs; i++) free(c.bufs[i]);
    free(c.bufs);
    return st;
}

// --- vocabularies ------------------------------------------------------------------

kv_status kv_convert_hf_vocab(const char *json_path, const kv_vocab_opts *o, const char *path, int *n_tokens)
{
    char *text;
    size_t len;
    kv_status st = kv_file_slurp(json_path, (size_t)1 << 30, "tokenizer.json", &text, &len);
    if (st) return st;
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    if (!j) return kv_fail(KV_E_DATA, "%s is not valid JSON", json_path);
    char **tok = NULL;
    int32_t *types = NULL;
    char **merges = NULL;
    int n = 0, nm = 0;
    kv_gguf_writer *w = NULL;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(j, "model");
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(model, "type");
    const cJSON *voc = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *mer = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(j, "added_tokens");
    if (!cJSON_IsString(mt) || strcmp(mt->valuestring, "BPE") || !cJSON_IsObject(voc) || !cJSON_IsArray(mer)) {
        st = kv_fail(KV_E_DATA, "%s: not a BPE tokenizer.json (model.type BPE, model.vocab, model.merges)",
                     json_path);
        goto done;
    }
    /* ids: the largest of vocab and added tokens */
    const cJSON *e;
    int maxid = -1;
    cJSON_ArrayForEach(e, voc)
    {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble >= (1 << 24) || e->valuedouble != (int)e->valuedouble) {
            st = kv_fail(KV_E_DATA, "%s: vocab entry '%s' has a bad id", json_path, e->string);
            goto done;
        }
        if (e->valueint > maxid) maxid = e->valueint;
    }
    cJSON_ArrayForEach(e, added)
    {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= (1 << 24) || !cJSON_IsString(ct)) {
            st = kv_fail(KV_E_DATA, "%s: an added token has no valid id and content", json_path);
            goto done;
        }
        if (id->valueint > maxid) maxid = id->valueint;
    }
    n = maxid + 1;
    if (n <= 0) {
        st = kv_fail(KV_E_DATA, "%s: empty vocabulary", json_path);
        goto done;
    }
    tok = calloc((size_t)n, sizeof *tok);
    types = malloc((size_t)n * sizeof *types);
    if (!tok || !types) goto oom;
    for (int i = 0; i < n; i++) types[i] = 5; /* unused until named */
    cJSON_ArrayForEach(e, voc)
    {
        if (tok[e->valueint]) continue;
        if (!(tok[e->valueint] = strdup(e->string))) goto oom;
        types[e->valueint] = 1;
    }
    cJSON_ArrayForEach(e, added)
    {
        int id = cJSON_GetObjectItemCaseSensitive(e, "id")->valueint;
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(e, "special");
        free(tok[id]);
        if (!(tok[id] = strdup(cJSON_GetObjectItemCaseSensitive(e, "content")->valuestring))) goto oom;
        types[id] = cJSON_IsTrue(sp) ? 3 : 4;
    }
    for (int i = 0; i < n; i++)
        if (!tok[i]) { /* gaps, as llama.cpp's converter fills them */
            char pad[32];
            snprintf(pad, sizeof pad, "[PAD%d]", i);
            if (!(tok[i] = strdup(pad))) goto oom;
        }
    nm = cJSON_GetArraySize(mer);
    merges = calloc((size_t)(nm ? nm : 1), sizeof *merges);
    if (!merges) goto oom;
    int mi = 0;
    cJSON_ArrayForEach(e, mer)
    {
        if (cJSON_IsString(e)) {
            merges[mi] = strdup(e->valuestring);
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(cJSON_GetArrayItem(e, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(e, 1))) {
            const char *a = cJSON_GetArrayItem(e, 0)->valuestring, *b = cJSON_GetArrayItem(e, 1)->valuestring;
            merges[mi] = malloc(strlen(a) + strlen(b) + 2);
            if (merges[mi]) sprintf(merges[mi], "%s %s", a, b);
        } else {
            st = kv_fail(KV_E_DATA, "%s: merge %d is neither \"a b\" nor [\"a\", \"b\"]", json_path, mi);
            goto done;
        }
        if (!merges[mi++]) goto oom;
    }
    int bos = -1, eos = -1;
    for (int i = 0; i < n; i++) {
        if (o->bos && bos < 0 && !strcmp(tok[i], o->bos)) bos = i;
        if (o->eos && eos < 0 && !strcmp(tok[i], o->eos)) eos = i;
    }
    if ((o->bos && bos < 0) || (o->eos && eos < 0)) {
        st = kv_fail(KV_E_USAGE, "token '%s' is not in the vocabulary", o->bos && bos < 0 ? o->bos : o->eos);
        goto done;
    }
    if ((st = kv_gguf_writer_new(&w))) goto done;
    /* Llama-3-8B's geometry, so that llama.cpp's loader finds every key it
     * reads even for a vocabulary-only file */
    if (!st) st = kv_gguf_set_str(w, "general.architecture", "llama");
    if (!st) st = kv_gguf_set_str(w, "general.name", "vocabulary");
    if (!st) st = kv_gguf_set_u32(w, "llama.context_length", 8192);
    if (!st) st = kv_gguf_set_u32(w, "llama.embedding_length", 4096);
    if (!st) st = kv_gguf_set_u32(w, "llama.block_count", 32);
    if (!st) st = kv_gguf_set_u32(w, "llama.feed_forward_length", 14336);
    if (!st) st = kv_gguf_set_u32(w, "llama.attention.head_count", 32);
    if (!st) st = kv_gguf_set_u32(w, "llama.attention.head_count_kv", 8);
    if (!st) st = kv_gguf_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    if (!st) st = kv_gguf_set_f32(w, "llama.rope.freq_base", 500000.0f);
    if (!st) st = kv_gguf_set_u32(w, "llama.rope.dimension_count", 128);
    if (!st) st = kv_gguf_set_u32(w, "llama.vocab_size", (uint32_t)n);
    if (!st) st = kv_gguf_set_str(w, "tokenizer.ggml.model", "gpt2");
    if (!st) st = kv_gguf_set_str(w, "tokenizer.ggml.pre", o->pre ? o->pre : "default");
    if (!st) st = kv_gguf_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)tok, NULL, (size_t)n);
    if (!st) st = kv_gguf_set_arr_i32(w, "tokenizer.ggml.token_type", types, (size_t)n);
    if (!st) st = kv_gguf_set_arr_str(w, "tokenizer.ggml.merges", (const char *const *)merges, NULL, (size_t)nm);
    if (!st && bos >= 0) st = kv_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)bos);
    if (!st && eos >= 0) st = kv_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)eos);
    if (!st && o->chat_template) st = kv_gguf_set_str(w, "tokenizer.chat_template", o->chat_template);
    if (!st) st = kv_gguf_writer_write(w, path);
    if (!st && n_tokens) *n_tokens = n;
    goto done;
oom:
    st = kv_fail(KV_E_NOMEM, "out of memory");
done:
    kv_gguf_writer_free(w);
    for (int i = 0; tok && i < n; i++) free(tok[i]);
    for (int i = 0; merges && i < nm; i++) free(merges[i]);
    free(tok);
    free(types);
    free(merges);
    cJSON_Delete(j);
    return st;
}
