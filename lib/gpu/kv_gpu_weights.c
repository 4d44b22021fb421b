/*
 * The GPU engine's weights and the projections that read them.  A matrix
 * group (q/k/v, o, gate/up, down, the embedding, the classifier) whose
 * matrices all have a type the engine keeps packed (Q8_0, Q4_K, Q6_K:
 * eng_packed_type) is uploaded as stored in the file, its rows in the
 * kv_weight's order (qwen2's NEOX permutation applied), and read by the
 * packed GEMV (kernels/eng_gemv_qv.cu, variant opts.gemv_q) after a separate RMSNorm; any other
 * group is converted on the host to the engine's weight type (fp16, or bf16
 * for bf16 models) in chunks and uploaded as padded row-major matrices, q/k/v
 * as one matrix and gate/up interleaved for the fused RMSNorm/SwiGLU GEMVs.
 * opts.wtype f16/bf16 converts every group.  q/k/v and o biases (qwen2) are
 * float32 vectors added after their projection.  A synthetic model's shared
 * layer weights are kept once.  Part of the engine (kv_gpu_int.h).
 */
#include "gpu/kv_gpu_int.h"

#ifdef KV_HAVE_CUDA

#include <stdlib.h>
#include <string.h>

#include "common/kv_dtype.h"
#include "common/kv_half.h"
#include "model/kv_matmul.h"

/*
 * Upload the rows of nparts matrices (same cols) as one (sum rows, ld)
 * matrix of the engine's weight type, zero-padded to ld: one after another,
 * or with interleave (two parts of equal rows) as a0, b0, a1, b1, ... (the
 * gate/up layout of the fused SwiGLU GEMV).  Rows are converted on the host
 * in chunks through one staging buffer.
 */
static kv_status upload_matrix(kv_gpu_engine *e, const kv_weight *const *parts, int nparts, int ld,
                               bool interleave, void **dst, const char *what)
{
    size_t rows = 0;
    int cols = parts[0]->cols;
    for (int i = 0; i < nparts; i++) {
        if (parts[i]->cols != cols || !parts[i]->data)
            return kv_fail(KV_E_DATA, "%s: parts of different widths", what);
        if (interleave && parts[i]->rows != parts[0]->rows)
            return kv_fail(KV_E_DATA, "%s: interleaved parts of different heights", what);
        rows += (size_t)parts[i]->rows;
    }
    TRY(gl_dalloc(dst, rows * (size_t)ld * 2, what));
    e->wbytes += rows * (size_t)ld * 2;
    const size_t chunk = 4096; /* rows per staging round */
    uint16_t *stage = malloc(chunk * (size_t)ld * 2);
    if (!stage) return kv_fail(KV_E_NOMEM, "out of memory staging %s", what);
    kv_status st = KV_OK;
    for (size_t r0 = 0; r0 < rows && !st; r0 += chunk) {
        int nr = rows - r0 < chunk ? (int)(rows - r0) : (int)chunk;
        int bad = 0;
#pragma omp parallel for schedule(static)
        for (int r = 0; r < nr; r++) {
            size_t ro = r0 + (size_t)r; /* output row -> (part, row) */
            int part = 0;
            size_t rs = ro;
            if (interleave) {
                part = (int)(ro % (size_t)nparts);
                rs = ro / (size_t)nparts;
            } else {
                while (rs >= (size_t)parts[part]->rows) rs -= (size_t)parts[part++]->rows;
            }
            const kv_weight *w = parts[part];
            bool same = (w->type == KV_DT_F16 && e->wt == KV_DT_F16) ||
                        (w->type == KV_DT_BF16 && e->wt == KV_DT_BF16);
            uint16_t *o = stage + (size_t)r * ld;
            if (same) { /* the stored row of output row rs (qwen2's q/k are permuted) */
                size_t sr = w->perm ? (size_t)w->perm[rs] : rs;
                memcpy(o, (const uint8_t *)w->data + sr * (size_t)cols * 2, (size_t)cols * 2);
            } else {
                float *f = malloc((size_t)cols * sizeof(float));
                if (!f) {
#pragma omp atomic write
                    bad = 1;
                    continue;
                }
                kv_weight_row(w, (int)rs, f);
                for (int c = 0; c < cols; c++)
                    o[c] = e->wt == KV_DT_BF16 ? kv_f32_to_bf16(f[c]) : kv_f32_to_half(f[c]);
                free(f);
            }
            for (int c = cols; c < ld; c++) o[c] = 0;
        }
        if (bad) {
            st = kv_fail(KV_E_NOMEM, "out of memory converting %s", what);
            break;
        }
        cudaError_t ce = cudaMemcpy((uint8_t *)*dst + r0 * (size_t)ld * 2, stage, (size_t)nr * ld * 2,
                                    cudaMemcpyHostToDevice);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "weight upload", __FILE__, __LINE__);
    }
    free(stage);
    return st;
}

/* Can this group stay packed on the device? */
static bool keep_packed(const kv_gpu_engine *e, const kv_weight *const *parts, int nparts)
{
    if (e->o.wtype != KV_DT_AUTO) return false;
    for (int i = 0; i < nparts; i++)
        if (!eng_packed_type(parts[i]->type)) return false;
    return true;
}

/* Upload a packed matrix as stored, rows in output order (perm applied). */
static kv_status upload_packed(kv_gpu_engine *e, const kv_weight *w, kv_gpu_packed *p, const char *what)
{
    memset(p, 0, sizeof *p);
    const size_t pitch = kv_dtype_row_bytes(w->type, w->cols), bytes = (size_t)w->rows * pitch;
    if (!w->data || w->cols % kv_dtype_block(w->type))
        return kv_fail(KV_E_DATA, "%s: a %s matrix of %d columns", what, kv_dtype_name(w->type), w->cols);
    TRY(gl_dalloc(&p->data, bytes, what));
    p->type = w->type, p->rows = w->rows, p->cols = w->cols, p->pitch = pitch;
    e->wbytes += bytes;
    if (!w->perm) {
        CK(cudaMemcpy(p->data, w->data, bytes, cudaMemcpyHostToDevice));
        return KV_OK;
    }
    const int chunk = 1024; /* rows per staging round */
    uint8_t *stage = malloc((size_t)chunk * pitch);
    if (!stage) return kv_fail(KV_E_NOMEM, "out of memory staging %s", what);
    kv_status st = KV_OK;
    for (int r0 = 0; r0 < w->rows && !st; r0 += chunk) {
        int nr = w->rows - r0 < chunk ? w->rows - r0 : chunk;
        for (int r = 0; r < nr; r++)
            memcpy(stage + (size_t)r * pitch, (const uint8_t *)w->data + (size_t)w->perm[r0 + r] * pitch, pitch);
        cudaError_t ce = cudaMemcpy((uint8_t *)p->data + (size_t)r0 * pitch, stage, (size_t)nr * pitch,
                                    cudaMemcpyHostToDevice);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "weight upload", __FILE__, __LINE__);
    }
    free(stage);
    return st;
}

/* Bytes a decode step reads of a group: the packed rows, or the 16-bit matrix. */
static uint64_t group_bytes(const void *w16, const kv_gpu_packed *p, int np, uint64_t rows16, int ld)
{
    if (w16) return rows16 * (uint64_t)ld * 2u;
    uint64_t b = 0;
    for (int i = 0; i < np; i++) b += (uint64_t)p[i].rows * p[i].pitch;
    return b;
}

/* The layer's biases: q/k/v as one vector (absent parts 0), o; any other
 * bias is one this engine does not add. */
static kv_status upload_biases(kv_gpu_engine *e, const kv_layer_weights *lw, gw_layer *w, int l)
{
    if (lw->w_gate.bias || lw->w_up.bias || lw->w_down.bias)
        return kv_fail(KV_E_UNSUPPORTED, "GPU engine: layer %d has feed-forward biases, which it does not add", l);
    if (lw->wq.bias || lw->wk.bias || lw->wv.bias) {
        const int n = e->qd + 2 * e->kvd;
        float *b = calloc((size_t)n, sizeof *b);
        if (!b) return kv_fail(KV_E_NOMEM, "out of memory");
        if (lw->wq.bias) memcpy(b, lw->wq.bias, (size_t)e->qd * sizeof *b);
        if (lw->wk.bias) memcpy(b + e->qd, lw->wk.bias, (size_t)e->kvd * sizeof *b);
        if (lw->wv.bias) memcpy(b + e->qd + e->kvd, lw->wv.bias, (size_t)e->kvd * sizeof *b);
        kv_status st = gl_upload_f32(b, n, &w->bqkv, "q/k/v biases");
        free(b);
        TRY(st);
    }
    if (lw->wo.bias) TRY(gl_upload_f32(lw->wo.bias, e->dim, &w->bo, "output projection bias"));
    return KV_OK;
}

kv_status gl_upload_f32(const float *src, int n, float **dst, const char *what)
{
    TRY(gl_dalloc(dst, (size_t)gl_pad8(n) * sizeof(float), what));
    CK(cudaMemset(*dst, 0, (size_t)gl_pad8(n) * sizeof(float)));
    CK(cudaMemcpy(*dst, src, (size_t)n * sizeof(float), cudaMemcpyHostToDevice));
    return KV_OK;
}

static bool same_layer_weights(const kv_layer_weights *a, const kv_layer_weights *b)
{
    return a->wq.data == b->wq.data && a->wk.data == b->wk.data && a->wv.data == b->wv.data &&
           a->wo.data == b->wo.data && a->w_gate.data == b->w_gate.data &&
           a->w_up.data == b->w_up.data && a->w_down.data == b->w_down.data;
}

kv_status gl_weights_load(kv_gpu_engine *e)
{
    const kv_model *m = e->m;
    uint64_t read = 0; /* bytes one decode step reads */
    if (m->tok_embd.bias || m->output.bias)
        return kv_fail(KV_E_UNSUPPORTED, "GPU engine: embedding or classifier biases are not supported");
    for (int l = 0; l < e->L; l++) {
        const kv_layer_weights *lw = &m->layers[l];
        gw_layer *w = &e->w[l];
        int share = -1;
        /* synthetic models share one set of layer weights: keep one copy on
         * the GPU (each layer still reads all of it per step) */
        for (int j = 0; j < l && share < 0; j++)
            if (same_layer_weights(lw, &m->layers[j])) share = j;
        if (share >= 0) {
            const gw_layer *s = &e->w[share];
            *w = *s;
            w->bqkv = w->bo = NULL;
            w->attn_norm = w->ffn_norm = NULL;
            w->owner = false;
        } else {
            const kv_weight *qkv[3] = {&lw->wq, &lw->wk, &lw->wv};
            const kv_weight *o[1] = {&lw->wo};
            const kv_weight *gu[2] = {&lw->w_gate, &lw->w_up};
            const kv_weight *dn[1] = {&lw->w_down};
            w->owner = true;
            if (keep_packed(e, qkv, 3))
                for (int i = 0; i < 3; i++) TRY(upload_packed(e, qkv[i], &w->pqkv[i], "layer wq/wk/wv"));
            else
                TRY(upload_matrix(e, qkv, 3, e->ld_dim, false, &w->qkv, "layer wq/wk/wv"));
            if (keep_packed(e, o, 1)) TRY(upload_packed(e, o[0], &w->po, "layer wo"));
            else TRY(upload_matrix(e, o, 1, e->ld_qd, false, &w->o, "layer wo"));
            if (keep_packed(e, gu, 2))
                for (int i = 0; i < 2; i++) TRY(upload_packed(e, gu[i], &w->pgu[i], "layer w_gate/w_up"));
            else
                TRY(upload_matrix(e, gu, 2, e->ld_dim, true, &w->gu, "layer w_gate/w_up"));
            if (keep_packed(e, dn, 1)) TRY(upload_packed(e, dn[0], &w->pdown, "layer w_down"));
            else TRY(upload_matrix(e, dn, 1, e->ld_hid, false, &w->down, "layer w_down"));
        }
        TRY(upload_biases(e, lw, w, l));
        TRY(gl_upload_f32(lw->attn_norm, e->dim, &w->attn_norm, "attn_norm"));
        TRY(gl_upload_f32(lw->ffn_norm, e->dim, &w->ffn_norm, "ffn_norm"));
        read += group_bytes(w->qkv, w->pqkv, 3, (uint64_t)e->qd + 2u * e->kvd, e->ld_dim) +
                group_bytes(w->o, &w->po, 1, (uint64_t)e->dim, e->ld_qd) +
                group_bytes(w->gu, w->pgu, 2, 2u * (uint64_t)e->hidden, e->ld_dim) +
                group_bytes(w->down, &w->pdown, 1, (uint64_t)e->dim, e->ld_hid);
    }
    const kv_weight *em[1] = {&m->tok_embd};
    if (keep_packed(e, em, 1)) TRY(upload_packed(e, em[0], &e->pembd, "token embedding"));
    else TRY(upload_matrix(e, em, 1, e->ld_dim, false, &e->embd, "token embedding"));
    if (m->cfg.shared_classifier || m->output.data == m->tok_embd.data) {
        e->outw = e->embd;
        e->pout = e->pembd;
    } else {
        const kv_weight *ou[1] = {&m->output};
        if (keep_packed(e, ou, 1)) TRY(upload_packed(e, ou[0], &e->pout, "classifier"));
        else TRY(upload_matrix(e, ou, 1, e->ld_dim, false, &e->outw, "classifier"));
    }
    TRY(gl_upload_f32(m->output_norm, e->dim, &e->out_norm, "output_norm"));
    /* bytes one decode step reads: every layer's matrices and the classifier */
    e->wread = read + group_bytes(e->outw, &e->pout, 1, (uint64_t)e->vocab, e->ld_dim);
    return KV_OK;
}

kv_status gl_weights_share(kv_gpu_engine *e, const kv_gpu_engine *src)
{
    if (src->L != e->L || src->wt != e->wt) return kv_fail(KV_E_USAGE, "weights of another model shared");
    for (int l = 0; l < e->L; l++) {
        e->w[l] = src->w[l];
        e->w[l].owner = false;
    }
    e->embd = src->embd, e->outw = src->outw;
    e->pembd = src->pembd, e->pout = src->pout;
    e->out_norm = src->out_norm;
    e->wbytes = 0; /* stored once, by src */
    e->wread = src->wread;
    e->w_shared = true;
    return KV_OK;
}

bool gl_weights_packed(const kv_gpu_engine *e)
{
    if (e->pembd.data || e->pout.data) return true;
    for (int l = 0; l < e->L; l++) {
        const gw_layer *w = &e->w[l];
        if (!w->qkv || !w->o || !w->gu || !w->down) return true;
    }
    return false;
}

// --- the projections ---------------------------------------------------------------

static kv_status gemv_q(const kv_gpu_engine *e, const kv_gpu_packed *p, const float *x, float *y, int accumulate,
                        cudaStream_t s)
{
    CK(eng_gemv_qv(e->o.gemv_q, p->data, p->type, p->rows, p->cols, p->pitch, x, y, accumulate, s));
    return KV_OK;
}

kv_status gl_embed(kv_gpu_engine *e, const int *dtok, cudaStream_t s)
{
    if (e->pembd.data) CK(eng_embed_rows_q(e->pembd.data, e->pembd.type, e->dim, e->pembd.pitch, dtok, 1, e->x, e->ld_dim, s));
    else CK(eng_embed(e->embd, e->wt, e->ld_dim, e->dim, dtok, e->x, s));
    return KV_OK;
}

kv_status gl_qkv(kv_gpu_engine *e, int l, cudaStream_t s)
{
    const gw_layer *w = &e->w[l];
    if (w->qkv) {
        CK(eng_gemv_norm(w->qkv, e->wt, e->qd + 2 * e->kvd, e->ld_dim, e->x, w->attn_norm, e->dim, e->eps,
                         e->qkv, 0, s));
    } else {
        CK(eng_rmsnorm(e->x, w->attn_norm, e->dim, e->eps, e->xn, s));
        TRY(gemv_q(e, &w->pqkv[0], e->xn, e->qkv, 0, s));
        TRY(gemv_q(e, &w->pqkv[1], e->xn, e->qkv + e->qd, 0, s));
        TRY(gemv_q(e, &w->pqkv[2], e->xn, e->qkv + e->qd + e->kvd, 0, s));
    }
    if (w->bqkv) CK(eng_add_bias_rows(e->qkv, 0, w->bqkv, e->qd + 2 * e->kvd, 1, s));
    return KV_OK;
}

kv_status gl_q_only(kv_gpu_engine *e, int l, const float *xn, float *q, cudaStream_t s)
{
    const gw_layer *w = &e->w[l];
    if (w->qkv) CK(eng_gemv(w->qkv, e->wt, e->qd, e->ld_dim, xn, q, 0, s));
    else TRY(gemv_q(e, &w->pqkv[0], xn, q, 0, s));
    if (w->bqkv) CK(eng_add_bias_rows(q, 0, w->bqkv, e->qd, 1, s));
    return KV_OK;
}

kv_status gl_attn_out(kv_gpu_engine *e, int l, cudaStream_t s)
{
    const gw_layer *w = &e->w[l];
    if (w->o) CK(eng_gemv(w->o, e->wt, e->dim, e->ld_qd, e->att, e->x, 1, s));
    else TRY(gemv_q(e, &w->po, e->att, e->x, 1, s));
    if (w->bo) CK(eng_add_bias_rows(e->x, 0, w->bo, e->dim, 1, s));
    return KV_OK;
}

kv_status gl_ffn(kv_gpu_engine *e, int l, cudaStream_t s)
{
    const gw_layer *w = &e->w[l];
    if (w->gu) {
        CK(eng_gemv_norm(w->gu, e->wt, e->hidden, e->ld_dim, e->x, w->ffn_norm, e->dim, e->eps, e->hb, 1, s));
    } else {
        CK(eng_rmsnorm(e->x, w->ffn_norm, e->dim, e->eps, e->xn, s));
        TRY(gemv_q(e, &w->pgu[0], e->xn, e->gu32, 0, s));
        TRY(gemv_q(e, &w->pgu[1], e->xn, e->gu32 + e->hidden, 0, s));
        CK(eng_swiglu(e->gu32, e->hidden, e->hb, s));
    }
    if (w->down) CK(eng_gemv(w->down, e->wt, e->dim, e->ld_hid, e->hb, e->x, 1, s));
    else TRY(gemv_q(e, &w->pdown, e->hb, e->x, 1, s));
    return KV_OK;
}

kv_status gl_logits(kv_gpu_engine *e, cudaStream_t s)
{
    if (e->outw) {
        CK(eng_gemv_norm(e->outw, e->wt, e->vocab, e->ld_dim, e->x, e->out_norm, e->dim, e->eps, e->logits, 0, s));
    } else {
        CK(eng_rmsnorm(e->x, e->out_norm, e->dim, e->eps, e->xn, s));
        TRY(gemv_q(e, &e->pout, e->xn, e->logits, 0, s));
    }
    return KV_OK;
}

void gl_prefill_layer(const kv_gpu_engine *e, int l, kv_pf_layer *out)
{
    const gw_layer *w = &e->w[l];
    *out = (kv_pf_layer){w->qkv, w->o, w->gu, w->down, w->attn_norm, w->ffn_norm, w->bqkv, w->bo,
                         {w->pqkv[0], w->pqkv[1], w->pqkv[2]}, w->po, {w->pgu[0], w->pgu[1]}, w->pdown};
}

void gl_weights_free(kv_gpu_engine *e)
{
    if (e->w_shared) { /* src's: forget them */
        if (e->w) memset(e->w, 0, (size_t)e->L * sizeof *e->w);
        e->embd = e->outw = NULL;
        memset(&e->pembd, 0, sizeof e->pembd);
        memset(&e->pout, 0, sizeof e->pout);
        e->out_norm = NULL;
        return;
    }
    if (e->w)
        for (int l = 0; l < e->L; l++) {
            gw_layer *w = &e->w[l];
            if (w->owner) {
                gl_dfree(&w->qkv);
                gl_dfree(&w->o);
                gl_dfree(&w->gu);
                gl_dfree(&w->down);
                for (int i = 0; i < 3; i++) gl_dfree(&w->pqkv[i].data);
                gl_dfree(&w->po.data);
                for (int i = 0; i < 2; i++) gl_dfree(&w->pgu[i].data);
                gl_dfree(&w->pdown.data);
            }
            gl_dfree(&w->bqkv);
            gl_dfree(&w->bo);
            gl_dfree(&w->attn_norm);
            gl_dfree(&w->ffn_norm);
        }
    if (e->outw != e->embd) gl_dfree(&e->outw);
    if (e->pout.data != e->pembd.data) gl_dfree(&e->pout.data);
    gl_dfree(&e->embd);
    gl_dfree(&e->pembd.data);
    gl_dfree(&e->out_norm);
}

#endif /* KV_HAVE_CUDA */
