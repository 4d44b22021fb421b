/*
 * Placement `quant` of the GPU engine (kv_gpu_int.h): KIVI 1/2/4-bit keys
 * and values resident on the GPU, in one of two forms chosen at configure:
 *
 *   gl_quant       where kernels/ has the geometry (head_dim 128; 1 or 2
 *                  bits at groups 32/64, 4 bits at group 64, which only the
 *                  v3 kernel attends): the prompt packed on the GPU, the
 *                  packed parts dense over nq tokens (kv_layout.h) and grown
 *                  a group at a time, the fp16 residual in one of two
 *                  (nkv, R+G, hd) stores; attention straight from the
 *                  packed data (kv_cuda_attn_kivi);
 *   gl_quant_host  anywhere else: the same packed bytes, packed on the host
 *                  with lib/quant/kv_quant.c's code as groups fill (so the
 *                  codes are the CPU policy's, bit for bit), kept at the
 *                  layer's capacity in lib/policy/kv_policy_quant.c's layout
 *                  and expanded to an fp16 scratch each step for the fp16
 *                  attention: correct, not fast.
 *
 * Both report the packed bytes plus the fp16 residual, as the CPU policy.
 */
#include "gpu/kv_gpu_int.h"

#ifdef KV_HAVE_CUDA

#include <stdlib.h>
#include <string.h>

#include "common/kv_half.h"
#include "policy/kv_prefix.h"
#include "quant/kv_kivi.h"
#include "quant/kv_layer_io.h"

/* The packed planes of keys (k*) and values (v*): codes, scales, zeros. */
typedef struct {
    uint8_t *kc, *vc;
    uint16_t *ks, *kz, *vs, *vz;
} kivi_planes;

static void planes_free(kivi_planes *p)
{
    void *dev[] = {&p->kc, &p->vc, &p->ks, &p->kz, &p->vs, &p->vz};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) gl_dfree(dev[i]);
}

typedef struct {
    kv_kivi_params kp;
    int nq, nres, rc, cur;    /* tokens packed, in the residual; residual rows; live store */
    kivi_planes p;            /* dense over nq: codes (nkv, nq, hd*bits/8), key scales and
                                 zeros (nkv, nq/G, hd), value ones (nkv, nq, hd/Gv) */
    uint16_t *rk[2], *rv[2];  /* (nkv, rc, hd) */
} quant_state;

typedef struct {
    kv_kivi_params kp;
    int nq, nres, rc;         /* tokens packed, in the ring; ring rows: token t at t % rc */
    int qcap, ngk;            /* token capacity; key scale groups per head (qcap/G + 1) */
    kivi_planes p;            /* at capacity: codes (nkv, qcap, hd*bits/8), key scales and
                                 zeros (nkv, ngk, hd), value ones (nkv, qcap, hd/Gv) */
    uint16_t *rk, *rv;        /* (nkv, rc, hd) fp16 ring */
} qhost_state;

static kv_status quant_configure(kv_gpu_engine *e, gl_layer *y)
{
    const kv_policy_params *p = &y->prm;
    kv_attn_dims d = {e->nqh, e->nkv, e->hd, e->ctx, 0, e->scale};
    kv_kivi_params kp = {p->bits, p->group, p->residual}; /* checked by kv_policy_check */
    /* the packed attention where it applies; elsewhere the same packed
     * bytes, expanded to fp16 each step */
    y->pl = kv_cuda_attn_kivi_supported(&d, &kp) &&
                    kv_cuda_kivi_pack_supported(KV_KIVI_KEYS, &kp, e->hd) &&
                    kv_cuda_kivi_pack_supported(KV_KIVI_VALUES, &kp, e->hd)
                ? &gl_quant
                : &gl_quant_host;
    return KV_OK;
}

/* As kv_policy_quant.c: packed parts plus the fp16 residual. */
static uint64_t quant_resident(const kv_gpu_engine *e, const kv_kivi_params *kp, int nq_, int nres)
{
    const uint64_t nkv = (uint64_t)e->nkv, hd = (uint64_t)e->hd, nq = (uint64_t)nq_;
    uint64_t crow = kv_kivi_row_bytes(e->hd, kp->bits);
    uint64_t gv = (uint64_t)kv_kivi_vgroup(kp->group, e->hd);
    return 2 * nkv * nq * crow + 2 * nkv * (nq / (uint64_t)kp->group) * hd * 2 +
           2 * nkv * nq * (hd / gv) * 2 + 2 * nkv * (uint64_t)nres * hd * 2;
}

// --- packed on the GPU -------------------------------------------------------------------

static kv_status quant_alloc(kv_gpu_engine *e, gl_layer *y)
{
    TRY(gl_state_new(y, sizeof(quant_state)));
    quant_state *q = y->st;
    q->kp = (kv_kivi_params){y->prm.bits, y->prm.group, y->prm.residual};
    q->rc = q->kp.residual + q->kp.group;
    for (int i = 0; i < 2; i++) {
        TRY(gl_dalloc(&q->rk[i], (size_t)e->nkv * q->rc * e->hd * 2, "quant residual K"));
        TRY(gl_dalloc(&q->rv[i], (size_t)e->nkv * q->rc * e->hd * 2, "quant residual V"));
    }
    size_t need = (size_t)e->nkv * q->rc * e->hd;
    return gl_grow_kv(&e->dres.k, &e->dres.v, &e->dres.n, need, need, "dense residual", "dense residual");
}

static kv_status quant_ingest(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V,
                              int ld, int T, uint16_t *tmp)
{
    quant_state *q = y->st;
    const kv_kivi_params *kp = &q->kp;
    const int nkv = e->nkv, hd = e->hd;
    const size_t rb = (size_t)hd * 2;
    cudaStream_t s = e->s_main;
    int nq = kv_kivi_nquant(T, kp->group, kp->residual), nres = T - nq;
    size_t crow = kv_kivi_row_bytes(hd, kp->bits);
    int gv = kv_kivi_vgroup(kp->group, hd);
    uint16_t *Kd = tmp, *Vd = tmp + (size_t)nkv * T * hd; /* dense (nkv, T, hd) */
    CK(cudaMemcpy2DAsync(Kd, (size_t)T * rb, K, (size_t)ld * rb, (size_t)T * rb, nkv,
                         cudaMemcpyDeviceToDevice, s));
    CK(cudaMemcpy2DAsync(Vd, (size_t)T * rb, V, (size_t)ld * rb, (size_t)T * rb, nkv,
                         cudaMemcpyDeviceToDevice, s));
    /* stream-ordered: quant_maybe_pack regrows these with cudaMallocAsync */
    CK(cudaMallocAsync((void **)&q->p.kc, (size_t)nkv * nq * crow + 16, s));
    CK(cudaMallocAsync((void **)&q->p.vc, (size_t)nkv * nq * crow + 16, s));
    CK(cudaMallocAsync((void **)&q->p.ks, (size_t)nkv * (nq / kp->group) * hd * 2 + 16, s));
    CK(cudaMallocAsync((void **)&q->p.kz, (size_t)nkv * (nq / kp->group) * hd * 2 + 16, s));
    CK(cudaMallocAsync((void **)&q->p.vs, (size_t)nkv * nq * (hd / gv) * 2 + 16, s));
    CK(cudaMallocAsync((void **)&q->p.vz, (size_t)nkv * nq * (hd / gv) * 2 + 16, s));
    /* the pack writes the residual dense (nkv, nres, hd) into the stores'
     * spare buffer; it is then placed at pitch rc */
    kv_cuda_kivi_out ko = {q->p.kc, q->p.ks, q->p.kz, q->rk[1]};
    kv_cuda_kivi_out vo = {q->p.vc, q->p.vs, q->p.vz, q->rv[1]};
    CK(kv_cuda_kivi_pack(KV_KIVI_KEYS, kp, nkv, T, hd, Kd, &ko, s));
    CK(kv_cuda_kivi_pack(KV_KIVI_VALUES, kp, nkv, T, hd, Vd, &vo, s));
    if (nres > 0) {
        CK(cudaMemcpy2DAsync(q->rk[0], (size_t)q->rc * rb, q->rk[1], (size_t)nres * rb,
                             (size_t)nres * rb, nkv, cudaMemcpyDeviceToDevice, s));
        CK(cudaMemcpy2DAsync(q->rv[0], (size_t)q->rc * rb, q->rv[1], (size_t)nres * rb,
                             (size_t)nres * rb, nkv, cudaMemcpyDeviceToDevice, s));
    }
    q->nq = nq;
    q->nres = nres;
    q->cur = 0;
    return KV_OK;
}

/* Layer y->l's K and V as the file packs them, checked against the layer's
 * policy (the file's encoding, kv_prefix_layer_packed) and geometry. */
static kv_status kivi_read_pair(const kv_gpu_engine *e, const gl_layer *y, const kv_kivi_params *kp,
                                kv_kivi_packed *K, kv_kivi_packed *V)
{
    const kvc_file *f = y->load_from->f;
    memset(V, 0, sizeof *V);
    TRY(kv_kivi_read(f, y->l, 'k', K));
    kv_status st = kv_kivi_read(f, y->l, 'v', V);
    if (!st && (memcmp(&K->prm, kp, sizeof *kp) || memcmp(&V->prm, kp, sizeof *kp) ||
                K->n_kv_heads != e->nkv || K->head_dim != e->hd || V->T != K->T || K->T != y->load_from->T))
        st = kv_fail(KV_E_DATA, "layer %d: the file's KIVI K/V parameters or shapes differ from each other or "
                     "from the model's", y->l);
    if (st) {
        kv_kivi_clear(K);
        kv_kivi_clear(V);
    }
    return st;
}

/*
 * The file's packed planes as they are, then rows [P, T) of K/V appended
 * as decode steps would append them: the file's fp16 residual and the new
 * rows, dense, are packed in one call (kv_cuda_kivi_pack groups them from
 * the residual's first row, as the appends fill groups; the codes are the
 * CPU's), and the packed planes are the file's followed by the new ones.
 */
static kv_status quant_load(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V, int ld,
                            int T, uint16_t *tmp)
{
    quant_state *q = y->st;
    const kv_kivi_params *kp = &q->kp;
    kv_kivi_packed fk, fv;
    TRY(kivi_read_pair(e, y, kp, &fk, &fv));
    const int nkv = e->nkv, hd = e->hd, G = kp->group, P = fk.T, nq0 = fk.nq, r0 = P - nq0;
    const int rows = r0 + (T - P), nq1 = kv_kivi_nquant(rows, G, kp->residual), nq = nq0 + nq1;
    const size_t rb = (size_t)hd * 2, crow = kv_kivi_row_bytes(hd, kp->bits);
    const size_t nvs = (size_t)hd / (size_t)kv_kivi_vgroup(G, hd), vsb = nvs * 2;
    cudaStream_t s = e->s_main;
    kv_status st = KV_OK;
    uint16_t *Kd = tmp, *Vd = tmp + (size_t)nkv * rows * hd; /* dense (nkv, rows, hd): residual, new rows */
    uint8_t *blk = NULL;                                     /* the new rows' packed parts */
    const size_t c1 = (size_t)nkv * nq1 * crow, s1 = (size_t)nkv * (nq1 / G) * rb, v1 = (size_t)nkv * nq1 * vsb;
    if (r0 > 0) {
        GL_LCK(cudaMemcpy2DAsync(Kd, (size_t)rows * rb, fk.resid, (size_t)r0 * rb, (size_t)r0 * rb, nkv,
                              cudaMemcpyHostToDevice, s));
        GL_LCK(cudaMemcpy2DAsync(Vd, (size_t)rows * rb, fv.resid, (size_t)r0 * rb, (size_t)r0 * rb, nkv,
                              cudaMemcpyHostToDevice, s));
    }
    if (T > P) {
        GL_LCK(cudaMemcpy2DAsync(Kd + (size_t)r0 * hd, (size_t)rows * rb, K + (size_t)P * hd, (size_t)ld * rb,
                              (size_t)(T - P) * rb, nkv, cudaMemcpyDeviceToDevice, s));
        GL_LCK(cudaMemcpy2DAsync(Vd + (size_t)r0 * hd, (size_t)rows * rb, V + (size_t)P * hd, (size_t)ld * rb,
                              (size_t)(T - P) * rb, nkv, cudaMemcpyDeviceToDevice, s));
    }
    /* the planes, stream-ordered as quant_ingest's (quant_maybe_pack regrows them) */
    GL_LCK(cudaMallocAsync((void **)&q->p.kc, (size_t)nkv * nq * crow + 16, s));
    GL_LCK(cudaMallocAsync((void **)&q->p.vc, (size_t)nkv * nq * crow + 16, s));
    GL_LCK(cudaMallocAsync((void **)&q->p.ks, (size_t)nkv * (nq / G) * rb + 16, s));
    GL_LCK(cudaMallocAsync((void **)&q->p.kz, (size_t)nkv * (nq / G) * rb + 16, s));
    GL_LCK(cudaMallocAsync((void **)&q->p.vs, (size_t)nkv * nq * vsb + 16, s));
    GL_LCK(cudaMallocAsync((void **)&q->p.vz, (size_t)nkv * nq * vsb + 16, s));
    GL_LCK(cudaMallocAsync((void **)&blk, 2 * c1 + 2 * s1 + 2 * v1 + 6 * 256, s));
    if (!st) {
        size_t o = 0;
        uint8_t *part[6];
        const size_t sz[6] = {c1, c1, s1, s1, v1, v1};
        for (int i = 0; i < 6; i++) part[i] = blk + o, o += (sz[i] + 255) / 256 * 256;
        /* the pack's residual goes to the spare store, then to the live one at pitch rc */
        kv_cuda_kivi_out ko = {part[0], (uint16_t *)part[2], (uint16_t *)part[3], q->rk[1]};
        kv_cuda_kivi_out vo = {part[1], (uint16_t *)part[4], (uint16_t *)part[5], q->rv[1]};
        GL_LCK(kv_cuda_kivi_pack(KV_KIVI_KEYS, kp, nkv, rows, hd, Kd, &ko, s));
        GL_LCK(kv_cuda_kivi_pack(KV_KIVI_VALUES, kp, nkv, rows, hd, Vd, &vo, s));
        /* each plane: the file's nq0 tokens per head (host), then the new nq1 (device) */
        struct { void *dst; const void *file; const void *add; size_t w0, w1; } pl[6] = {
            {q->p.kc, fk.codes, part[0], (size_t)nq0 * crow, (size_t)nq1 * crow},
            {q->p.vc, fv.codes, part[1], (size_t)nq0 * crow, (size_t)nq1 * crow},
            {q->p.ks, fk.scale, part[2], (size_t)(nq0 / G) * rb, (size_t)(nq1 / G) * rb},
            {q->p.kz, fk.zero, part[3], (size_t)(nq0 / G) * rb, (size_t)(nq1 / G) * rb},
            {q->p.vs, fv.scale, part[4], (size_t)nq0 * vsb, (size_t)nq1 * vsb},
            {q->p.vz, fv.zero, part[5], (size_t)nq0 * vsb, (size_t)nq1 * vsb},
        };
        for (int i = 0; i < 6; i++) {
            const size_t pitch = pl[i].w0 + pl[i].w1;
            if (pl[i].w0)
                GL_LCK(cudaMemcpy2DAsync(pl[i].dst, pitch, pl[i].file, pl[i].w0, pl[i].w0, nkv,
                                      cudaMemcpyHostToDevice, s));
            if (pl[i].w1)
                GL_LCK(cudaMemcpy2DAsync((uint8_t *)pl[i].dst + pl[i].w0, pitch, pl[i].add, pl[i].w1, pl[i].w1, nkv,
                                      cudaMemcpyDeviceToDevice, s));
        }
        const int nres = rows - nq1;
        if (nres > 0) {
            GL_LCK(cudaMemcpy2DAsync(q->rk[0], (size_t)q->rc * rb, q->rk[1], (size_t)nres * rb, (size_t)nres * rb, nkv,
                                  cudaMemcpyDeviceToDevice, s));
            GL_LCK(cudaMemcpy2DAsync(q->rv[0], (size_t)q->rc * rb, q->rv[1], (size_t)nres * rb, (size_t)nres * rb, nkv,
                                  cudaMemcpyDeviceToDevice, s));
        }
        q->nq = nq;
        q->nres = nres;
        q->cur = 0;
    }
    if (blk) GL_LCK(cudaFreeAsync(blk, s));
    /* the host planes are read by copies in flight */
    GL_LCK(cudaStreamSynchronize(s));
    kv_kivi_clear(&fk);
    kv_kivi_clear(&fv);
    return st;
}

static kv_status quant_slot(kv_gpu_engine *e, gl_layer *y, int pos, gl_row *r)
{
    (void)pos;
    quant_state *q = y->st;
    r->k = q->rk[q->cur] + (size_t)q->nres * e->hd;
    r->v = q->rv[q->cur] + (size_t)q->nres * e->hd;
    r->hs = (size_t)q->rc * e->hd;
    return KV_OK;
}

/* After appending a token to the residual, pack the oldest group once the
 * residual holds R + G tokens (KIVI keeps R..R+G-1 in fp16). */
static kv_status quant_maybe_pack(kv_gpu_engine *e, quant_state *y)
{
    const kv_kivi_params *kp = &y->kp;
    if (y->nres < kp->residual + kp->group) return KV_OK;
    cudaStream_t s = e->s_main;
    const int nkv = e->nkv, hd = e->hd, G = kp->group, nq = y->nq;
    const size_t rb = (size_t)hd * 2, crow = kv_kivi_row_bytes(hd, kp->bits);
    const int gv = kv_kivi_vgroup(G, hd), nvs = hd / gv;
    /* the group's rows, dense (nkv, G, hd), in the dense-residual scratch */
    CK(cudaMemcpy2DAsync(e->dres.k, (size_t)G * rb, y->rk[y->cur], (size_t)y->rc * rb,
                         (size_t)G * rb, nkv, cudaMemcpyDeviceToDevice, s));
    CK(cudaMemcpy2DAsync(e->dres.v, (size_t)G * rb, y->rv[y->cur], (size_t)y->rc * rb,
                         (size_t)G * rb, nkv, cudaMemcpyDeviceToDevice, s));
    uint8_t *gkc, *gvc;
    uint16_t *gks, *gkz, *gvs, *gvz;
    size_t codes = (size_t)nkv * G * crow, kss = (size_t)nkv * hd * 2, vss = (size_t)nkv * G * nvs * 2;
    /* one block: new group parts, then the grown packed arrays */
    uint8_t *blk = NULL;
    size_t nbytes = 2 * codes + 2 * kss + 2 * vss + 6 * 256;
    CK(cudaMallocAsync((void **)&blk, nbytes, s));
    size_t o = 0;
#define CARVE(ptr, type, n) do { ptr = (type *)(blk + o); o += ((n) + 255) / 256 * 256; } while (0)
    CARVE(gkc, uint8_t, codes);
    CARVE(gvc, uint8_t, codes);
    CARVE(gks, uint16_t, kss);
    CARVE(gkz, uint16_t, kss);
    CARVE(gvs, uint16_t, vss);
    CARVE(gvz, uint16_t, vss);
#undef CARVE
    kv_kivi_params one = {kp->bits, G, 0};
    kv_cuda_kivi_out ko = {gkc, gks, gkz, e->dres.k}, vo = {gvc, gvs, gvz, e->dres.v};
    CK(kv_cuda_kivi_pack(KV_KIVI_KEYS, &one, nkv, G, hd, e->dres.k, &ko, s));
    CK(kv_cuda_kivi_pack(KV_KIVI_VALUES, &one, nkv, G, hd, e->dres.v, &vo, s));
    /* grow each packed part from nq to nq+G tokens per head */
    struct { void **dst; const void *add; size_t per_tok_old, per_tok_add; int old_rows, add_rows; } parts[6] = {
        {(void **)&y->p.kc, gkc, crow, crow, nq, G},
        {(void **)&y->p.vc, gvc, crow, crow, nq, G},
        {(void **)&y->p.ks, gks, rb, rb, nq / G, 1},
        {(void **)&y->p.kz, gkz, rb, rb, nq / G, 1},
        {(void **)&y->p.vs, gvs, (size_t)nvs * 2, (size_t)nvs * 2, nq, G},
        {(void **)&y->p.vz, gvz, (size_t)nvs * 2, (size_t)nvs * 2, nq, G},
    };
    for (int i = 0; i < 6; i++) {
        size_t w = parts[i].per_tok_old;
        size_t newpitch = (size_t)(parts[i].old_rows + parts[i].add_rows) * w;
        void *nb = NULL;
        CK(cudaMallocAsync(&nb, (size_t)nkv * newpitch + 16, s));
        if (parts[i].old_rows > 0)
            CK(cudaMemcpy2DAsync(nb, newpitch, *parts[i].dst, (size_t)parts[i].old_rows * w,
                                 (size_t)parts[i].old_rows * w, nkv, cudaMemcpyDeviceToDevice, s));
        CK(cudaMemcpy2DAsync((uint8_t *)nb + (size_t)parts[i].old_rows * w, newpitch, parts[i].add,
                             (size_t)parts[i].add_rows * w, (size_t)parts[i].add_rows * w, nkv,
                             cudaMemcpyDeviceToDevice, s));
        CK(cudaFreeAsync(*parts[i].dst, s));
        *parts[i].dst = nb;
    }
    CK(cudaFreeAsync(blk, s));
    /* drop the packed rows from the residual: rows [G, R+G) -> [0, R) of the other store */
    int keep = y->nres - G, nx = 1 - y->cur;
    CK(cudaMemcpy2DAsync(y->rk[nx], (size_t)y->rc * rb, y->rk[y->cur] + (size_t)G * hd,
                         (size_t)y->rc * rb, (size_t)keep * rb, nkv, cudaMemcpyDeviceToDevice, s));
    CK(cudaMemcpy2DAsync(y->rv[nx], (size_t)y->rc * rb, y->rv[y->cur] + (size_t)G * hd,
                         (size_t)y->rc * rb, (size_t)keep * rb, nkv, cudaMemcpyDeviceToDevice, s));
    y->cur = nx;
    y->nres = keep;
    y->nq += G;
    return KV_OK;
}

static kv_status quant_attend(kv_gpu_engine *e, gl_layer *y, int pos, const float *q_,
                              const gl_row *r)
{
    (void)pos;
    (void)q_;
    (void)r;
    quant_state *q = y->st;
    q->nres++;
    TRY(quant_maybe_pack(e, q));
    cudaStream_t s = e->s_main;
    const size_t rb = (size_t)e->hd * 2;
    const int T = q->nq + q->nres;
    if (q->nres > 0) { /* a kernel, not cudaMemcpy2DAsync: a captured step resizes it in place */
        CK(eng_copy_2d(e->dres.k, (size_t)q->nres * rb, q->rk[q->cur], (size_t)q->rc * rb,
                       (size_t)q->nres * rb, (size_t)e->nkv, s));
        CK(eng_copy_2d(e->dres.v, (size_t)q->nres * rb, q->rv[q->cur], (size_t)q->rc * rb,
                       (size_t)q->nres * rb, (size_t)e->nkv, s));
    }
    kv_attn_dims d = {e->nqh, e->nkv, e->hd, T, 0, e->scale};
    kv_cuda_kivi_view kv = {q->p.kc, q->p.ks, q->p.kz, e->dres.k};
    kv_cuda_kivi_view vv = {q->p.vc, q->p.vs, q->p.vz, e->dres.v};
    TRY(gl_ensure_ws(e, kv_cuda_attn_kivi_workspace(&d, &q->kp)));
    CK(kv_cuda_attn_kivi(&d, &q->kp, e->q16, &kv, &vv, e->att, e->ws, e->ws_bytes, s));
    return KV_OK;
}

/* A step that packs a group allocates and frees (stream-ordered) the grown
 * packed arrays, which a graph cannot hold: such a step runs plainly. */
static const char *quant_graph_block(const kv_gpu_engine *e, const gl_layer *y, int pos)
{
    (void)e, (void)pos;
    const quant_state *q = y->st;
    return q->nres + 1 >= q->kp.residual + q->kp.group ? "quant: the step packs a group (allocations)"
                                                        : NULL;
}

static void quant_bytes(const kv_gpu_engine *e, const gl_layer *y, kv_bytes *b)
{
    const quant_state *q = y->st;
    b->resident = quant_resident(e, &q->kp, q->nq, q->nres);
}

static void quant_release(gl_layer *y)
{
    quant_state *q = y->st;
    planes_free(&q->p);
    for (int i = 0; i < 2; i++) {
        gl_dfree(&q->rk[i]);
        gl_dfree(&q->rv[i]);
    }
}

const gl_placement gl_quant = {
    .name = "quant",
    .configure = quant_configure,
    .alloc = quant_alloc,
    .ingest = quant_ingest,
    .load = quant_load,
    .slot = quant_slot,
    .attend = quant_attend,
    .bytes = quant_bytes,
    .release = quant_release,
    .graph_block = quant_graph_block,
};

// --- packed on the host, expanded per step --------------------------------------------------

/* The fp16 scratch a packed layer is expanded into each step (shared with dsq). */
kv_status gl_ensure_qx(kv_gpu_engine *e)
{
    size_t need = (size_t)e->nkv * (size_t)e->ctx * (size_t)e->hd;
    return gl_grow_kv(&e->qx.k, &e->qx.v, &e->qx.n, need, need, "KV expansion scratch", "KV expansion scratch");
}

/* The packed planes at the layer's capacity, the residual ring, and the
 * engine's fp16 expansion scratch. */
static kv_status qhost_alloc(kv_gpu_engine *e, gl_layer *y)
{
    TRY(gl_state_new(y, sizeof(qhost_state)));
    qhost_state *q = y->st;
    const size_t nkv = (size_t)e->nkv, hd = (size_t)e->hd;
    q->kp = (kv_kivi_params){y->prm.bits, y->prm.group, y->prm.residual};
    q->rc = q->kp.residual + q->kp.group;
    q->qcap = e->ctx;
    q->ngk = e->ctx / q->kp.group + 1;
    const size_t crow = kv_kivi_row_bytes(e->hd, q->kp.bits);
    const size_t nvs = hd / (size_t)kv_kivi_vgroup(q->kp.group, e->hd);
    TRY(gl_dalloc(&q->p.kc, nkv * (size_t)q->qcap * crow, "quant key codes"));
    TRY(gl_dalloc(&q->p.vc, nkv * (size_t)q->qcap * crow, "quant value codes"));
    TRY(gl_dalloc(&q->p.ks, nkv * (size_t)q->ngk * hd * 2, "quant key scales"));
    TRY(gl_dalloc(&q->p.kz, nkv * (size_t)q->ngk * hd * 2, "quant key zeros"));
    TRY(gl_dalloc(&q->p.vs, nkv * (size_t)q->qcap * nvs * 2, "quant value scales"));
    TRY(gl_dalloc(&q->p.vz, nkv * (size_t)q->qcap * nvs * 2, "quant value zeros"));
    TRY(gl_dalloc(&q->rk, nkv * (size_t)q->rc * hd * 2, "quant residual K"));
    TRY(gl_dalloc(&q->rv, nkv * (size_t)q->rc * hd * 2, "quant residual V"));
    return gl_ensure_qx(e);
}

static eng_kivi_layer qhost_view(const kv_gpu_engine *e, const qhost_state *q)
{
    eng_kivi_layer v = {e->nkv, e->hd, q->kp.bits, q->kp.group, kv_kivi_vgroup(q->kp.group, e->hd),
                        q->qcap, q->ngk, q->rc, q->nq, q->p.kc, q->p.vc, q->p.ks, q->p.kz,
                        q->p.vs, q->p.vz, q->rk, q->rv};
    return v;
}

/*
 * Pack tokens [nq, nq + G) on the host with lib/quant/kv_quant.c's
 * quantizers and upload the group's parts.  Token t of head h is at xk
 * (keys) or xv (values) + h*head_stride + (t % mod)*hd (fp16, host).
 * Synchronous: this path is for correctness at any head_dim, not speed.
 */
static kv_status qhost_pack(kv_gpu_engine *e, qhost_state *y, const uint16_t *xk,
                            const uint16_t *xv, size_t head_stride, int mod)
{
    const int hd = e->hd, G = y->kp.group, b = y->kp.bits, t0 = y->nq;
    const int gv = kv_kivi_vgroup(G, hd), nvs = hd / gv;
    const size_t crow = kv_kivi_row_bytes(hd, b);
    float *tmp = malloc((size_t)G * hd * sizeof(float));
    uint8_t *kc = malloc((size_t)G * crow), *vc = malloc((size_t)G * crow);
    kv_half *ks = malloc((size_t)hd * 2), *kz = malloc((size_t)hd * 2);
    kv_half *vs = malloc((size_t)G * nvs * 2), *vz = malloc((size_t)G * nvs * 2);
    kv_status st = KV_OK;
    if (!tmp || !kc || !vc || !ks || !kz || !vs || !vz) st = kv_fail(KV_E_NOMEM, "quant pack staging");
    for (int h = 0; h < e->nkv && !st; h++) {
        for (int i = 0; i < G; i++) {
            const uint16_t *r = xk + (size_t)h * head_stride + (size_t)((t0 + i) % mod) * hd;
            for (int c = 0; c < hd; c++) tmp[(size_t)i * hd + c] = kv_half_to_f32(r[c]);
        }
        kv_kivi_pack_key_group(tmp, (size_t)hd, G, hd, b, kc, crow, ks, kz);
        for (int i = 0; i < G; i++) {
            const uint16_t *r = xv + (size_t)h * head_stride + (size_t)((t0 + i) % mod) * hd;
            for (int c = 0; c < hd; c++) tmp[c] = kv_half_to_f32(r[c]);
            kv_kivi_pack_value_row(tmp, hd, gv, b, vc + (size_t)i * crow, vs + (size_t)i * nvs,
                                   vz + (size_t)i * nvs);
        }
        size_t tok = (size_t)h * y->qcap + (size_t)t0, kg = ((size_t)h * y->ngk + (size_t)(t0 / G)) * hd;
        struct { void *dst; const void *src; size_t n; } up[6] = {
            {y->p.kc + tok * crow, kc, (size_t)G * crow}, {y->p.vc + tok * crow, vc, (size_t)G * crow},
            {y->p.ks + kg, ks, (size_t)hd * 2},           {y->p.kz + kg, kz, (size_t)hd * 2},
            {y->p.vs + tok * nvs, vs, (size_t)G * nvs * 2}, {y->p.vz + tok * nvs, vz, (size_t)G * nvs * 2},
        };
        for (int i = 0; i < 6 && !st; i++) st = gl_h2d_sync(e, up[i].dst, up[i].src, up[i].n);
    }
    free(vz);
    free(vs);
    free(kz);
    free(ks);
    free(vc);
    free(kc);
    free(tmp);
    if (!st) y->nq += G;
    return st;
}

/* After a token went into the ring: pack the oldest group once the CPU
 * policy would (kv_kivi_nquant grows), reading the ring back first. */
static kv_status qhost_maybe_pack(kv_gpu_engine *e, qhost_state *y, int T)
{
    y->nres = T - y->nq;
    if (kv_kivi_nquant(T, y->kp.group, y->kp.residual) <= y->nq) return KV_OK;
    size_t n = (size_t)e->nkv * y->rc * e->hd;
    uint16_t *ring = malloc(2 * n * 2);
    if (!ring) return kv_fail(KV_E_NOMEM, "quant ring staging");
    kv_status st = KV_OK;
    cudaError_t ce = cudaMemcpyAsync(ring, y->rk, n * 2, cudaMemcpyDeviceToHost, e->s_main);
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(ring + n, y->rv, n * 2, cudaMemcpyDeviceToHost, e->s_main);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(e->s_main);
    if (ce != cudaSuccess) st = kv_cuda_fail(ce, "quant ring read-back", __FILE__, __LINE__);
    if (!st) st = qhost_pack(e, y, ring, ring + n, (size_t)y->rc * e->hd, y->rc);
    free(ring);
    y->nres = T - y->nq;
    return st;
}

/* The prompt to the host, packed there group by group as the CPU policy's
 * appends would, the rest into the residual ring. */
static kv_status qhost_ingest(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V,
                              int ld, int T, uint16_t *tmp)
{
    (void)tmp;
    qhost_state *q = y->st;
    const int nkv = e->nkv, hd = e->hd;
    const size_t rb = (size_t)hd * 2;
    cudaStream_t s = e->s_main;
    size_t n = (size_t)nkv * T * hd, rn = (size_t)nkv * q->rc * hd;
    uint16_t *hx = malloc((2 * n + 2 * rn) * 2);
    if (!hx) return kv_fail(KV_E_NOMEM, "quant ingest staging");
    uint16_t *hk = hx, *hv = hx + n, *ring = hx + 2 * n;
    memset(ring, 0, 2 * rn * 2);
    cudaError_t ce = cudaMemcpy2DAsync(hk, (size_t)T * rb, K, (size_t)ld * rb, (size_t)T * rb,
                                       nkv, cudaMemcpyDeviceToHost, s);
    if (ce == cudaSuccess)
        ce = cudaMemcpy2DAsync(hv, (size_t)T * rb, V, (size_t)ld * rb, (size_t)T * rb, nkv,
                               cudaMemcpyDeviceToHost, s);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
    kv_status st = ce != cudaSuccess ? kv_cuda_fail(ce, "quant ingest read-back", __FILE__, __LINE__)
                                     : KV_OK;
    q->nq = 0;
    int nq = kv_kivi_nquant(T, q->kp.group, q->kp.residual);
    while (!st && q->nq < nq) st = qhost_pack(e, q, hk, hv, (size_t)T * hd, T);
    for (int h = 0; h < nkv && !st; h++)
        for (int t = nq; t < T; t++) {
            size_t d = ((size_t)h * q->rc + (size_t)(t % q->rc)) * hd, o = ((size_t)h * T + t) * hd;
            memcpy(ring + d, hk + o, rb);
            memcpy(ring + rn + d, hv + o, rb);
        }
    if (!st) {
        ce = cudaMemcpyAsync(q->rk, ring, rn * 2, cudaMemcpyHostToDevice, s);
        if (ce == cudaSuccess) ce = cudaMemcpyAsync(q->rv, ring + rn, rn * 2, cudaMemcpyHostToDevice, s);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "quant ring upload", __FILE__, __LINE__);
    }
    free(hx);
    TRY(st);
    q->nres = T - q->nq;
    return KV_OK;
}

/* The file's planes into the capacity layout, its fp16 residual into the
 * ring, then rows [P, T) appended one by one as qhost_attend's appends
 * would (a group packed on the host whenever kv_kivi_nquant grows). */
static kv_status qhost_load(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V, int ld,
                            int T, uint16_t *tmp)
{
    (void)tmp;
    qhost_state *q = y->st;
    kv_kivi_packed fk, fv;
    TRY(kivi_read_pair(e, y, &q->kp, &fk, &fv));
    const int nkv = e->nkv, hd = e->hd, G = q->kp.group, P = fk.T, nq0 = fk.nq, n = T - P;
    const size_t rb = (size_t)hd * 2, crow = kv_kivi_row_bytes(hd, q->kp.bits);
    const size_t vsb = (size_t)hd / (size_t)kv_kivi_vgroup(G, hd) * 2;
    const size_t rn = (size_t)nkv * q->rc * hd, nn = (size_t)nkv * (size_t)n * hd;
    cudaStream_t s = e->s_main;
    uint16_t *hx = malloc((2 * rn + 2 * nn + 1) * 2);
    kv_status st = hx ? KV_OK : kv_fail(KV_E_NOMEM, "quant load staging");
    uint16_t *ring = hx, *hk = hx + 2 * rn, *hv = hk + nn;
    if (!st) {
        memset(ring, 0, 2 * rn * 2);
        struct { void *dst; const void *src; size_t dpitch, w; } pl[6] = {
            {q->p.kc, fk.codes, (size_t)q->qcap * crow, (size_t)nq0 * crow},
            {q->p.vc, fv.codes, (size_t)q->qcap * crow, (size_t)nq0 * crow},
            {q->p.ks, fk.scale, (size_t)q->ngk * rb, (size_t)(nq0 / G) * rb},
            {q->p.kz, fk.zero, (size_t)q->ngk * rb, (size_t)(nq0 / G) * rb},
            {q->p.vs, fv.scale, (size_t)q->qcap * vsb, (size_t)nq0 * vsb},
            {q->p.vz, fv.zero, (size_t)q->qcap * vsb, (size_t)nq0 * vsb},
        };
        for (int i = 0; i < 6; i++)
            if (pl[i].w) GL_LCK(cudaMemcpy2DAsync(pl[i].dst, pl[i].dpitch, pl[i].src, pl[i].w, pl[i].w, nkv,
                                               cudaMemcpyHostToDevice, s));
        if (n > 0) {
            GL_LCK(cudaMemcpy2DAsync(hk, (size_t)n * rb, K + (size_t)P * hd, (size_t)ld * rb, (size_t)n * rb, nkv,
                                  cudaMemcpyDeviceToHost, s));
            GL_LCK(cudaMemcpy2DAsync(hv, (size_t)n * rb, V + (size_t)P * hd, (size_t)ld * rb, (size_t)n * rb, nkv,
                                  cudaMemcpyDeviceToHost, s));
        }
        GL_LCK(cudaStreamSynchronize(s));
    }
    q->nq = nq0;
    for (int h = 0; h < nkv && !st; h++)
        for (int t = nq0; t < P; t++)
            memcpy(ring + ((size_t)h * q->rc + (size_t)(t % q->rc)) * hd,
                   fk.resid + ((size_t)h * (size_t)(P - nq0) + (size_t)(t - nq0)) * hd, rb),
            memcpy(ring + rn + ((size_t)h * q->rc + (size_t)(t % q->rc)) * hd,
                   fv.resid + ((size_t)h * (size_t)(P - nq0) + (size_t)(t - nq0)) * hd, rb);
    for (int t = P; t < T && !st; t++) { /* the appends */
        for (int h = 0; h < nkv; h++) {
            memcpy(ring + ((size_t)h * q->rc + (size_t)(t % q->rc)) * hd, hk + ((size_t)h * n + (size_t)(t - P)) * hd, rb);
            memcpy(ring + rn + ((size_t)h * q->rc + (size_t)(t % q->rc)) * hd, hv + ((size_t)h * n + (size_t)(t - P)) * hd, rb);
        }
        if (kv_kivi_nquant(t + 1, G, q->kp.residual) > q->nq)
            st = qhost_pack(e, q, ring, ring + rn, (size_t)q->rc * hd, q->rc);
    }
    if (!st) {
        GL_LCK(cudaMemcpyAsync(q->rk, ring, rn * 2, cudaMemcpyHostToDevice, s));
        GL_LCK(cudaMemcpyAsync(q->rv, ring + rn, rn * 2, cudaMemcpyHostToDevice, s));
        GL_LCK(cudaStreamSynchronize(s));
    }
    free(hx);
    kv_kivi_clear(&fk);
    kv_kivi_clear(&fv);
    q->nres = T - q->nq;
    return st;
}

static kv_status qhost_slot(kv_gpu_engine *e, gl_layer *y, int pos, gl_row *r)
{
    qhost_state *q = y->st;
    r->k = q->rk + (size_t)(pos % q->rc) * e->hd;
    r->v = q->rv + (size_t)(pos % q->rc) * e->hd;
    r->hs = (size_t)q->rc * e->hd;
    return KV_OK;
}

static kv_status qhost_attend(kv_gpu_engine *e, gl_layer *y, int pos, const float *q_,
                              const gl_row *r)
{
    (void)q_;
    (void)r;
    qhost_state *q = y->st;
    TRY(qhost_maybe_pack(e, q, pos + 1));
    eng_kivi_layer kv = qhost_view(e, q);
    CK(eng_kivi_expand(&kv, pos + 1, e->qx.k, e->qx.v, (size_t)e->ctx, e->s_main));
    return gl_attend_dense(e, e->qx.k, e->qx.v, (size_t)e->ctx * e->hd, pos + 1, e->s_main);
}

/* A group packed on the host waits for the device: that step runs plainly. */
static const char *qhost_graph_block(const kv_gpu_engine *e, const gl_layer *y, int pos)
{
    (void)e;
    const qhost_state *q = y->st;
    return kv_kivi_nquant(pos + 1, q->kp.group, q->kp.residual) > q->nq
               ? "quant (host-packed): the step packs a group on the host"
               : NULL;
}

/* The same bytes as the packed form (the fp16 expansion is per-step scratch). */
static void qhost_bytes(const kv_gpu_engine *e, const gl_layer *y, kv_bytes *b)
{
    const qhost_state *q = y->st;
    b->resident = quant_resident(e, &q->kp, q->nq, q->nres);
}

static void qhost_release(gl_layer *y)
{
    qhost_state *q = y->st;
    planes_free(&q->p);
    gl_dfree(&q->rk);
    gl_dfree(&q->rv);
}

const gl_placement gl_quant_host = {
    .name = "quant (host-packed)",
    .configure = quant_configure,
    .alloc = qhost_alloc,
    .ingest = qhost_ingest,
    .load = qhost_load,
    .slot = qhost_slot,
    .attend = qhost_attend,
    .bytes = qhost_bytes,
    .release = qhost_release,
    .graph_block = qhost_graph_block,
};

#endif /* KV_HAVE_CUDA */
