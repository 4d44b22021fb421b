/*
 * Placement `dsq` of the GPU engine (kv_gpu_int.h): KVO-LLM's DSQ windows,
 * packed on the host by lib/quant/kv_dsq.c (the CPU policy's code: salient
 * tokens by accumulated attention, then K and V) from importance
 * accumulated on the GPU, resident packed at the layer's capacity and
 * expanded to an fp16 scratch each step: correct, not fast.  The tokens of
 * the window being filled wait in an fp16 ring.  HCAP (keep < 1, chan > 0)
 * is refused.
 *
 * The salient choice is a ranking of accumulated attention, so an
 * fp16-level difference can swap two near-tied tokens and then the window's
 * whole quantization noise differs from the CPU's: the device tests compare
 * the packing exactly with salient=0 and the policy's fidelity statistics
 * otherwise (tests/unit/test_gpu_engine.c).
 */
#include "gpu/kv_gpu_int.h"

#ifdef KV_HAVE_CUDA

#include <stdlib.h>
#include <string.h>

#include "common/kv_half.h"
#include "policy/kv_policy_dsqp.h"
#include "policy/kv_prefix.h"
#include "quant/kv_dsq.h"
#include "quant/kv_layer_io.h"

#define DSQ_OBSERVE 32 /* prompt queries a dsq layer observes: PREFILL_OBSERVE of kv_engine.c */

typedef struct {
    kv_dsq_params dp;
    int nwmax, packed;        /* windows allocated / packed per head */
    int rc;                   /* ring rows (one window): token t at t % rc */
    int obs_n;                /* prompt queries observed */
    uint8_t *dmask;           /* (nkv, nwmax, W/8) */
    int8_t *ksal, *vsal;      /* (nkv, nwmax, S, hd) */
    uint16_t *ksscale, *vsscale, *kbase; /* (nkv, nwmax, hd) */
    int vbits;                /* value codes' bits (dp.bits: the keys') */
    uint8_t *kc, *vc;         /* (nkv, nwmax, W-S, hd*kbits/8 or hd*vbits/8) */
    uint16_t *ks, *kz, *vs, *vz; /* (nkv, nwmax, W-S, hd/gd) */
    uint16_t *rk, *rv;        /* (nkv, rc, hd) tokens not yet packed */
    float *imp;               /* (nkv, ctx) accumulated attention per token */
    float *obs;               /* (DSQ_OBSERVE, n_heads*hd) the prompt's last queries */
    uint8_t *vmask;           /* (nkv, nwmax, W/8) the values' masks where a loaded file's differ
                                 from the keys' (dsq_load), else NULL: dmask serves both */
} dsq_state;


static kv_status dsq_configure(kv_gpu_engine *e, gl_layer *y)
{
    (void)e, (void)y; /* kv_policy_check (set_policies) refused HCAP and bad windows */
    return KV_OK;
}

static kv_status dsq_alloc(kv_gpu_engine *e, gl_layer *y)
{
    TRY(gl_state_new(y, sizeof(dsq_state)));
    dsq_state *d = y->st;
    kv_policy_dsq_params(&y->prm, &d->dp, NULL);
    d->vbits = y->prm.dsq_vbits;
    const kv_dsq_params *dp = &d->dp;
    const size_t nkv = (size_t)e->nkv, hd = (size_t)e->hd, W = (size_t)dp->window;
    const size_t S = (size_t)dp->salient, nn = W - S;
    const size_t nvs = hd / (size_t)kv_kivi_vgroup(dp->group, e->hd);
    const size_t kcrow = kv_kivi_row_bytes(e->hd, dp->bits), vcrow = kv_kivi_row_bytes(e->hd, d->vbits);
    d->nwmax = e->ctx / dp->window;
    d->rc = dp->window; /* at most W tokens wait for their window to be packed */
    const size_t hw = nkv * (size_t)d->nwmax;
    TRY(gl_dalloc(&d->dmask, hw * (W / 8), "dsq masks"));
    TRY(gl_dalloc(&d->ksal, hw * S * hd, "dsq salient keys"));
    TRY(gl_dalloc(&d->vsal, hw * S * hd, "dsq salient values"));
    TRY(gl_dalloc(&d->ksscale, hw * hd * 2, "dsq salient key scales"));
    TRY(gl_dalloc(&d->vsscale, hw * hd * 2, "dsq salient value scales"));
    TRY(gl_dalloc(&d->kbase, hw * hd * 2, "dsq key bases"));
    TRY(gl_dalloc(&d->kc, hw * nn * kcrow, "dsq key codes"));
    TRY(gl_dalloc(&d->vc, hw * nn * vcrow, "dsq value codes"));
    TRY(gl_dalloc(&d->ks, hw * nn * nvs * 2, "dsq key scales"));
    TRY(gl_dalloc(&d->kz, hw * nn * nvs * 2, "dsq key zeros"));
    TRY(gl_dalloc(&d->vs, hw * nn * nvs * 2, "dsq value scales"));
    TRY(gl_dalloc(&d->vz, hw * nn * nvs * 2, "dsq value zeros"));
    TRY(gl_dalloc(&d->rk, nkv * (size_t)d->rc * hd * 2, "dsq fp16 K"));
    TRY(gl_dalloc(&d->rv, nkv * (size_t)d->rc * hd * 2, "dsq fp16 V"));
    TRY(gl_dalloc(&d->imp, nkv * (size_t)e->ctx * 4, "dsq importance"));
    CK(cudaMemset(d->imp, 0, nkv * (size_t)e->ctx * 4));
    TRY(gl_dalloc(&d->obs, (size_t)DSQ_OBSERVE * (size_t)e->qd * 4, "dsq observed queries"));
    if (!e->qx.imp_sc)
        TRY(gl_dalloc(&e->qx.imp_sc, nkv * (size_t)e->ctx * 4, "attention probabilities"));
    return gl_ensure_qx(e);
}

static eng_dsq_layer dsq_view(const kv_gpu_engine *e, const dsq_state *y)
{
    eng_dsq_layer v = {e->nkv, e->hd, y->dp.window, y->dp.salient, y->dp.bits, y->vbits,
                       kv_kivi_vgroup(y->dp.group, e->hd), y->nwmax, y->packed, y->rc,
                       y->dmask, y->ksal, y->vsal, y->ksscale, y->vsscale, y->kbase,
                       y->kc, y->vc, y->ks, y->kz, y->vs, y->vz, y->rk, y->rv, y->vmask};
    return v;
}

/*
 * Pack window y->packed of every head on the host and upload its parts.
 * Token t of head h is at xk/xv + h*head_stride + (t % mod)*hd (fp16,
 * host); imp: (nkv, imp_ld) host, the window's importance at imp + h*imp_ld.
 * Synchronous, like the quant fallback.
 */
static kv_status dsq_pack_host(kv_gpu_engine *e, dsq_state *y, const uint16_t *xk,
                               const uint16_t *xv, size_t head_stride, int mod, const float *imp,
                               size_t imp_ld)
{
    const kv_dsq_params *dp = &y->dp;
    const int hd = e->hd, W = dp->window, S = dp->salient, nn = W - S, t0 = y->packed * W;
    const int nvs = hd / kv_kivi_vgroup(dp->group, hd);
    const int mbits = dp->bits > y->vbits ? dp->bits : y->vbits;
    float *xw = malloc((size_t)W * hd * sizeof(float));
    uint8_t *mask = malloc((size_t)W / 8 + 1), *codes = malloc((size_t)nn * kv_kivi_row_bytes(hd, mbits) + 1);
    int8_t *sal = malloc((size_t)S * hd + 1);
    kv_half *sscale = malloc((size_t)hd * 2), *base = malloc((size_t)hd * 2);
    kv_half *scale = malloc((size_t)nn * nvs * 2 + 2), *zero = malloc((size_t)nn * nvs * 2 + 2);
    kv_status st = KV_OK;
    if (!xw || !mask || !codes || !sal || !sscale || !base || !scale || !zero)
        st = kv_fail(KV_E_NOMEM, "dsq pack staging");
    for (int h = 0; h < e->nkv && !st; h++) {
        const size_t hw = (size_t)h * y->nwmax + (size_t)y->packed;
        kv_dsq_select(imp + (size_t)h * imp_ld, W, S, mask);
        st = gl_h2d_sync(e, y->dmask + hw * (size_t)(W / 8), mask, (size_t)W / 8);
        if (!st && y->vmask) st = gl_h2d_sync(e, y->vmask + hw * (size_t)(W / 8), mask, (size_t)W / 8);
        for (int pass = 0; pass < 2 && !st; pass++) {
            const uint16_t *x = pass ? xv : xk;
            for (int i = 0; i < W; i++) {
                const uint16_t *r = x + (size_t)h * head_stride + (size_t)((t0 + i) % mod) * hd;
                for (int c = 0; c < hd; c++) xw[(size_t)i * hd + c] = kv_half_to_f32(r[c]);
            }
            kv_kivi_axis ax = pass ? KV_KIVI_VALUES : KV_KIVI_KEYS;
            kv_dsq_params pp = *dp; /* keys and values at their own bits, as the CPU policy */
            if (pass) pp.bits = y->vbits;
            const size_t crow = kv_kivi_row_bytes(hd, pp.bits);
            kv_dsq_pack_window(xw, (size_t)hd, ax, &pp, hd, mask, sal, sscale, pass ? NULL : base,
                               codes, scale, zero);
            struct { void *dst; const void *src; size_t n; } up[6] = {
                {(pass ? y->vsal : y->ksal) + hw * (size_t)S * hd, sal, (size_t)S * hd},
                {(pass ? y->vsscale : y->ksscale) + hw * hd, sscale, (size_t)hd * 2},
                {(pass ? y->vc : y->kc) + hw * (size_t)nn * crow, codes, (size_t)nn * crow},
                {(pass ? y->vs : y->ks) + hw * (size_t)nn * nvs, scale, (size_t)nn * nvs * 2},
                {(pass ? y->vz : y->kz) + hw * (size_t)nn * nvs, zero, (size_t)nn * nvs * 2},
                {pass ? NULL : y->kbase + hw * hd, base, (size_t)hd * 2},
            };
            for (int i = 0; i < 6 && !st; i++)
                if (up[i].dst && up[i].n) st = gl_h2d_sync(e, up[i].dst, up[i].src, up[i].n);
        }
    }
    free(zero);
    free(scale);
    free(base);
    free(sscale);
    free(sal);
    free(codes);
    free(mask);
    free(xw);
    if (!st) y->packed++;
    return st;
}

/* After an attend at T tokens: pack each window that is now complete, as
 * the CPU policy does at the end of its attend (importance includes this
 * step).  The window's fp16 rows and importance are read back first. */
static kv_status dsq_pack_ready(kv_gpu_engine *e, dsq_state *y, int T)
{
    const int W = y->dp.window;
    while (kv_dsq_nwindows(T, W) > y->packed) {
        size_t n = (size_t)e->nkv * y->rc * e->hd;
        uint16_t *ring = malloc(2 * n * 2);
        float *imp = malloc((size_t)e->nkv * W * sizeof(float));
        kv_status st = KV_OK;
        if (!ring || !imp) st = kv_fail(KV_E_NOMEM, "dsq window staging");
        cudaError_t ce = cudaSuccess;
        if (!st) ce = cudaMemcpyAsync(ring, y->rk, n * 2, cudaMemcpyDeviceToHost, e->s_main);
        if (!st && ce == cudaSuccess)
            ce = cudaMemcpyAsync(ring + n, y->rv, n * 2, cudaMemcpyDeviceToHost, e->s_main);
        if (!st && ce == cudaSuccess)
            ce = cudaMemcpy2DAsync(imp, (size_t)W * 4, y->imp + (size_t)y->packed * W,
                                   (size_t)e->ctx * 4, (size_t)W * 4, e->nkv,
                                   cudaMemcpyDeviceToHost, e->s_main);
        if (!st && ce == cudaSuccess) ce = cudaStreamSynchronize(e->s_main);
        if (!st && ce != cudaSuccess) st = kv_cuda_fail(ce, "dsq window read-back", __FILE__, __LINE__);
        if (!st) st = dsq_pack_host(e, y, ring, ring + n, (size_t)y->rc * e->hd, y->rc, imp, (size_t)W);
        free(imp);
        free(ring);
        TRY(st);
    }
    return KV_OK;
}

/* The prompt's last queries, for its importance (as the CPU engine gives
 * them to observe()). */
static kv_status dsq_observe(kv_gpu_engine *e, gl_layer *y, const float *q, int pos, int n)
{
    dsq_state *d = y->st;
    int nobs = n < DSQ_OBSERVE ? n : DSQ_OBSERVE, j = pos - (n - nobs);
    if (j >= 0) {
        CK(cudaMemcpyAsync(d->obs + (size_t)j * e->qd, q, (size_t)e->qd * 4,
                           cudaMemcpyDeviceToDevice, e->s_main));
        d->obs_n = nobs;
    }
    return KV_OK;
}

/* Importance from the prompt's last queries (observed during the prefill),
 * then every complete window packed on the host; the rest into the fp16
 * ring.  Without observed queries (a synthesized context) the windows are
 * packed now with zero importance: the ring holds one window only. */
static kv_status dsq_ingest(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V,
                            int ld, int T, uint16_t *tmp)
{
    (void)tmp;
    dsq_state *d = y->st;
    const int nkv = e->nkv, hd = e->hd, W = d->dp.window, nobs = d->obs_n <= T ? d->obs_n : 0;
    const size_t rb = (size_t)hd * 2;
    cudaStream_t s = e->s_main;
    size_t n = (size_t)nkv * T * hd, rn = (size_t)nkv * d->rc * hd;
    uint16_t *hx = malloc((2 * n + 2 * rn) * 2);
    float *imp = calloc((size_t)nkv * T + 1, sizeof(float));
    float *kf = nobs ? malloc(n * sizeof(float)) : NULL;
    float *oq = nobs ? malloc((size_t)nobs * e->qd * sizeof(float) * 2) : NULL;
    kv_status st = KV_OK;
    if (!hx || !imp || (nobs && (!kf || !oq))) st = kv_fail(KV_E_NOMEM, "dsq ingest staging");
    uint16_t *hk = hx, *hv = hx + n, *ring = hx + 2 * n;
    cudaError_t ce = cudaSuccess;
    if (!st) {
        memset(ring, 0, 2 * rn * 2);
        ce = cudaMemcpy2DAsync(hk, (size_t)T * rb, K, (size_t)ld * rb, (size_t)T * rb, nkv,
                               cudaMemcpyDeviceToHost, s);
        if (ce == cudaSuccess)
            ce = cudaMemcpy2DAsync(hv, (size_t)T * rb, V, (size_t)ld * rb, (size_t)T * rb, nkv,
                                   cudaMemcpyDeviceToHost, s);
        if (ce == cudaSuccess && nobs)
            ce = cudaMemcpyAsync(oq, d->obs, (size_t)nobs * e->qd * 4, cudaMemcpyDeviceToHost, s);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "dsq ingest read-back", __FILE__, __LINE__);
    }
    if (!st && nobs) {
        /* (nobs, n_heads, hd) -> (n_heads, nobs, hd), as observe() receives them */
        float *q = oq + (size_t)nobs * e->qd;
        for (int j = 0; j < nobs; j++)
            for (int h = 0; h < e->nqh; h++)
                memcpy(q + ((size_t)h * nobs + j) * hd, oq + (size_t)j * e->qd + (size_t)h * hd,
                       (size_t)hd * sizeof(float));
        for (size_t i = 0; i < n; i++) kf[i] = kv_half_to_f32(hk[i]);
        st = kv_dsq_importance(q, e->nqh, nobs, kf, nkv, T, hd, imp);
    }
    if (!st) {
        ce = cudaMemsetAsync(d->imp, 0, (size_t)nkv * e->ctx * 4, s);
        if (ce == cudaSuccess)
            ce = cudaMemcpy2DAsync(d->imp, (size_t)e->ctx * 4, imp, (size_t)T * 4, (size_t)T * 4,
                                   nkv, cudaMemcpyHostToDevice, s);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
        if (ce != cudaSuccess) st = kv_cuda_fail(ce, "dsq importance upload", __FILE__, __LINE__);
    }
    d->packed = 0;
    while (!st && d->packed < kv_dsq_nwindows(T, W))
        st = dsq_pack_host(e, d, hk, hv, (size_t)T * hd, T, imp + (size_t)d->packed * W, (size_t)T);
    for (int h = 0; h < nkv && !st; h++)
        for (int t = d->packed * W; t < T; t++) {
            size_t dd = ((size_t)h * d->rc + (size_t)(t % d->rc)) * hd, o = ((size_t)h * T + t) * hd;
            memcpy(ring + dd, hk + o, rb);
            memcpy(ring + rn + dd, hv + o, rb);
        }
    if (!st) st = gl_h2d_sync(e, d->rk, ring, rn * 2);
    if (!st) st = gl_h2d_sync(e, d->rv, ring + rn, rn * 2);
    free(oq);
    free(kf);
    free(imp);
    free(hx);
    d->obs_n = 0;
    return st;
}

/*
 * The file's packed windows as they are (uploaded into the capacity layout;
 * the values' masks apart when they differ from the keys'), its unpacked
 * tail and rows [P, T) into the fp16 ring, importance 0: as the CPU
 * policy's load and appends, the windows completed by the new rows are
 * packed at the end of the first decode step, from that step's attention.
 * The ring is grown to hold every unpacked row until then.
 */
static kv_status dsq_load(kv_gpu_engine *e, gl_layer *y, const uint16_t *K, const uint16_t *V, int ld,
                          int T, uint16_t *tmp)
{
    (void)tmp;
    dsq_state *d = y->st;
    kv_dsq_packed fk, fv;
    memset(&fv, 0, sizeof fv);
    TRY(kv_dsq_read(y->load_from->f, y->l, 'k', &fk));
    kv_status st = kv_dsq_read(y->load_from->f, y->l, 'v', &fv);
    const int nkv = e->nkv, hd = e->hd;
    if (!st && (fk.prm.window != d->dp.window || fk.prm.salient != d->dp.salient || fk.prm.group != d->dp.group ||
                fk.prm.bits != d->dp.bits || fv.prm.bits != d->vbits || fv.prm.window != fk.prm.window ||
                fv.prm.salient != fk.prm.salient || fv.prm.group != fk.prm.group || fk.n_kv_heads != nkv ||
                fk.head_dim != hd || fv.T != fk.T || fk.T != y->load_from->T || fv.nw != fk.nw))
        st = kv_fail(KV_E_DATA, "layer %d: the file's DSQ K/V parameters or shapes differ from each other or from "
                     "the model's", y->l);
    const int W = d->dp.window, S = d->dp.salient, nw = fk.nw, P = fk.T, n = T - P;
    if (!st && nw > d->nwmax)
        st = kv_fail(KV_E_USAGE, "layer %d: %d packed windows exceed the context's %d", y->l, nw, d->nwmax);
    const size_t rb = (size_t)hd * 2, mb = (size_t)W / 8, nn = (size_t)(W - S);
    const size_t nvs = (size_t)hd / (size_t)kv_kivi_vgroup(d->dp.group, hd);
    const size_t kcrow = kv_kivi_row_bytes(hd, d->dp.bits), vcrow = kv_kivi_row_bytes(hd, d->vbits);
    const size_t hwm = (size_t)d->nwmax, hwf = (size_t)nw; /* windows per head: device pitch, file */
    cudaStream_t s = e->s_main;
    /* every row not yet packed waits in the ring until the first decode step packs it */
    const int wait = T + 1 - nw * W;
    const int rc = wait > W ? (wait + W - 1) / W * W : W;
    if (!st && rc > d->rc) {
        gl_dfree(&d->rk);
        gl_dfree(&d->rv);
        d->rc = 0;
        st = gl_dalloc(&d->rk, (size_t)nkv * rc * rb, "dsq fp16 K");
        if (!st) st = gl_dalloc(&d->rv, (size_t)nkv * rc * rb, "dsq fp16 V");
        if (!st) d->rc = rc;
    }
    const bool vm = !st && nw > 0 && memcmp(fk.mask, fv.mask, (size_t)nkv * hwf * mb) != 0;
    if (!st && vm && !d->vmask) st = gl_dalloc(&d->vmask, (size_t)nkv * hwm * mb, "dsq value masks");
    const size_t rn = (size_t)nkv * d->rc * hd;
    uint16_t *ring = !st ? calloc(2 * rn + 1, 2) : NULL;
    if (!st && !ring) st = kv_fail(KV_E_NOMEM, "dsq load staging");
    if (!st && nw > 0) {
        /* per head: nw windows of the file at the pitch of nwmax */
        struct { void *dst; const void *src; size_t per_w; } pl[12] = {
            {d->dmask, fk.mask, mb},
            {d->vmask, vm ? fv.mask : NULL, mb},
            {d->ksal, fk.sal, (size_t)S * hd},
            {d->vsal, fv.sal, (size_t)S * hd},
            {d->ksscale, fk.sscale, rb},
            {d->vsscale, fv.sscale, rb},
            {d->kbase, fk.base, rb},
            {d->kc, fk.codes, nn * kcrow},
            {d->vc, fv.codes, nn * vcrow},
            {d->ks, fk.scale, nn * nvs * 2},
            {d->kz, fk.zero, nn * nvs * 2},
            {d->vs, fv.scale, nn * nvs * 2},
        };
        for (int i = 0; i < 12; i++)
            if (pl[i].dst && pl[i].src && pl[i].per_w)
                GL_LCK(cudaMemcpy2DAsync(pl[i].dst, hwm * pl[i].per_w, pl[i].src, hwf * pl[i].per_w, hwf * pl[i].per_w,
                                      nkv, cudaMemcpyHostToDevice, s));
        GL_LCK(cudaMemcpy2DAsync(d->vz, hwm * nn * nvs * 2, fv.zero, hwf * nn * nvs * 2, hwf * nn * nvs * 2, nkv,
                              cudaMemcpyHostToDevice, s));
        if (!vm && d->vmask) /* an earlier load's value masks: this file's are the keys' */
            GL_LCK(cudaMemcpy2DAsync(d->vmask, hwm * mb, fk.mask, hwf * mb, hwf * mb, nkv, cudaMemcpyHostToDevice, s));
    }
    /* the unpacked tail (the file's fp16 rows) and the new rows (read back) into the ring */
    const int tail = P - nw * W;
    for (int h = 0; h < nkv && !st; h++)
        for (int t = 0; t < tail; t++) {
            const size_t dr = ((size_t)h * d->rc + (size_t)((nw * W + t) % d->rc)) * hd, sr = ((size_t)h * tail + t) * hd;
            memcpy(ring + dr, fk.resid + sr, rb);
            memcpy(ring + rn + dr, fv.resid + sr, rb);
        }
    if (!st) {
        st = gl_h2d_sync(e, d->rk, ring, rn * 2);
        if (!st) st = gl_h2d_sync(e, d->rv, ring + rn, rn * 2);
    }
    /* rows t in [P, T) at ring row t % rc: one 2D copy per contiguous run */
    for (int t = P; t < T && !st;) {
        const int r0 = t % d->rc, run = T - t < d->rc - r0 ? T - t : d->rc - r0;
        GL_LCK(cudaMemcpy2DAsync(d->rk + (size_t)r0 * hd, (size_t)d->rc * rb, K + (size_t)t * hd, (size_t)ld * rb,
                              (size_t)run * rb, nkv, cudaMemcpyDeviceToDevice, s));
        GL_LCK(cudaMemcpy2DAsync(d->rv + (size_t)r0 * hd, (size_t)d->rc * rb, V + (size_t)t * hd, (size_t)ld * rb,
                              (size_t)run * rb, nkv, cudaMemcpyDeviceToDevice, s));
        t += run;
    }
    GL_LCK(cudaMemsetAsync(d->imp, 0, (size_t)nkv * e->ctx * 4, s));
    GL_LCK(cudaStreamSynchronize(s));
    (void)n;
    free(ring);
    if (!st) {
        d->packed = nw;
        d->dp = fk.prm; /* the base rule too: later windows are packed as the file's (as the CPU policy) */
    }
    d->obs_n = 0; /* a loaded layer observes nothing, as on the CPU */
    kv_dsq_clear(&fk);
    kv_dsq_clear(&fv);
    return st;
}

static kv_status dsq_slot(kv_gpu_engine *e, gl_layer *y, int pos, gl_row *r)
{
    dsq_state *d = y->st;
    r->k = d->rk + (size_t)(pos % d->rc) * e->hd;
    r->v = d->rv + (size_t)(pos % d->rc) * e->hd;
    r->hs = (size_t)d->rc * e->hd;
    return KV_OK;
}

static kv_status dsq_attend(kv_gpu_engine *e, gl_layer *y, int pos, const float *q,
                            const gl_row *r)
{
    (void)r;
    dsq_state *d = y->st;
    cudaStream_t s = e->s_main;
    eng_dsq_layer dv = dsq_view(e, d);
    CK(cudaMemset2DAsync(d->imp + pos, (size_t)e->ctx * 4, 0, 4, e->nkv, s));
    CK(eng_dsq_expand(&dv, pos + 1, e->qx.k, e->qx.v, (size_t)e->ctx, s));
    TRY(gl_attend_dense(e, e->qx.k, e->qx.v, (size_t)e->ctx * e->hd, pos + 1, s));
    CK(eng_attn_importance(q, e->qx.k, e->nqh, e->nkv, e->hd, pos + 1, (size_t)e->ctx, e->scale,
                           e->qx.imp_sc, d->imp, (size_t)e->ctx, s));
    return dsq_pack_ready(e, d, pos + 1);
}

/* A window packed on the host waits for the device: that step runs plainly. */
static const char *dsq_graph_block(const kv_gpu_engine *e, const gl_layer *y, int pos)
{
    (void)e;
    const dsq_state *d = y->st;
    return kv_dsq_nwindows(pos + 1, d->dp.window) > d->packed ? "dsq: the step packs a window on the host"
                                                              : NULL;
}

/* As kv_policy_dsq.c: packed windows (one mask for K and V) + the fp16 rest. */
static void dsq_bytes(const kv_gpu_engine *e, const gl_layer *y, kv_bytes *b)
{
    const dsq_state *d = y->st;
    const uint64_t nkv = (uint64_t)e->nkv, hd = (uint64_t)e->hd, T = (uint64_t)y->T;
    int Tp = d->packed * d->dp.window;
    kv_dsq_sizes ds;
    kv_dsq_params dpv = d->dp;
    dpv.bits = d->vbits;
    kv_dsq_part_sizes(KV_KIVI_KEYS, &d->dp, e->nkv, Tp, e->hd, &ds);
    b->resident = kv_dsq_bytes(KV_KIVI_KEYS, &d->dp, e->nkv, Tp, e->hd) +
                  kv_dsq_bytes(KV_KIVI_VALUES, &dpv, e->nkv, Tp, e->hd) - ds.mask +
                  2 * nkv * (T - (uint64_t)Tp) * hd * 2;
}

static void dsq_release(gl_layer *y)
{
    dsq_state *d = y->st;
    void *dev[] = {&d->dmask, &d->ksal, &d->vsal, &d->ksscale, &d->vsscale, &d->kbase, &d->kc,
                   &d->vc, &d->ks, &d->kz, &d->vs, &d->vz, &d->rk, &d->rv, &d->imp, &d->obs, &d->vmask};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) gl_dfree(dev[i]);
}

const gl_placement gl_dsq = {
    .name = "dsq",
    .configure = dsq_configure,
    .alloc = dsq_alloc,
    .ingest = dsq_ingest,
    .load = dsq_load,
    .slot = dsq_slot,
    .attend = dsq_attend,
    .observe = dsq_observe,
    .bytes = dsq_bytes,
    .release = dsq_release,
    .graph_block = dsq_graph_block,
};

#endif /* KV_HAVE_CUDA */
