/*
 * The GPU engine's weights: each layer's matrices converted on the host to
 * the engine's weight type (fp16, or bf16 for bf16 models) in chunks and
 * uploaded as padded row-major matrices, q/k/v as one matrix and gate/up
 * interleaved for the fused SwiGLU GEMV; a synthetic model's shared layer
 * weights are kept once.  Part of the engine (kv_gpu_int.h).
 */
#include "gpu/kv_gpu_int.h"

#ifdef KV_HAVE_CUDA

#include <stdlib.h>
#include <string.h>

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
            if (same) {
                memcpy(o, (const uint8_t *)w->data + rs * (size_t)cols * 2, (size_t)cols * 2);
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
            w->qkv = s->qkv;
            w->o = s->o;
            w->gu = s->gu;
            w->down = s->down;
            w->owner = false;
        } else {
            const kv_weight *qkv[3] = {&lw->wq, &lw->wk, &lw->wv};
            const kv_weight *o[1] = {&lw->wo};
            const kv_weight *gu[2] = {&lw->w_gate, &lw->w_up};
            const kv_weight *dn[1] = {&lw->w_down};
            w->owner = true;
            TRY(upload_matrix(e, qkv, 3, e->ld_dim, false, &w->qkv, "layer wq/wk/wv"));
            TRY(upload_matrix(e, o, 1, e->ld_qd, false, &w->o, "layer wo"));
            TRY(upload_matrix(e, gu, 2, e->ld_dim, true, &w->gu, "layer w_gate/w_up"));
            TRY(upload_matrix(e, dn, 1, e->ld_hid, false, &w->down, "layer w_down"));
        }
        TRY(gl_upload_f32(lw->attn_norm, e->dim, &w->attn_norm, "attn_norm"));
        TRY(gl_upload_f32(lw->ffn_norm, e->dim, &w->ffn_norm, "ffn_norm"));
    }
    const kv_weight *em[1] = {&m->tok_embd};
    TRY(upload_matrix(e, em, 1, e->ld_dim, false, &e->embd, "token embedding"));
    if (m->cfg.shared_classifier || m->output.data == m->tok_embd.data) {
        e->outw = e->embd;
    } else {
        const kv_weight *ou[1] = {&m->output};
        TRY(upload_matrix(e, ou, 1, e->ld_dim, false, &e->outw, "classifier"));
    }
    TRY(gl_upload_f32(m->output_norm, e->dim, &e->out_norm, "output_norm"));
    /* bytes one decode step reads: every layer's matrices and the classifier */
    uint64_t per_layer = ((uint64_t)(e->qd + 2 * e->kvd) * e->ld_dim + (uint64_t)e->dim * e->ld_qd +
                          (uint64_t)2 * e->hidden * e->ld_dim + (uint64_t)e->dim * e->ld_hid) * 2u;
    e->wread = per_layer * (uint64_t)e->L + (uint64_t)e->vocab * e->ld_dim * 2u;
    return KV_OK;
}

void gl_weights_free(kv_gpu_engine *e)
{
    if (e->w)
        for (int l = 0; l < e->L; l++) {
            gw_layer *w = &e->w[l];
            if (w->owner) {
                gl_dfree(&w->qkv);
                gl_dfree(&w->o);
                gl_dfree(&w->gu);
                gl_dfree(&w->down);
            }
            gl_dfree(&w->attn_norm);
            gl_dfree(&w->ffn_norm);
        }
    if (e->outw != e->embd) gl_dfree(&e->outw);
    gl_dfree(&e->embd);
    gl_dfree(&e->out_norm);
}

#endif /* KV_HAVE_CUDA */
