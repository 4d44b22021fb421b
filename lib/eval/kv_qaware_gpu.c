/*
 * kv_qaware_gpu (see kv_qaware_gpu.h): the host side of the GPU scoring.
 * The queries are folded with each segment's channels and scales here, as
 * kv_qaware_score_cpu folds them (the same float expression), so the
 * device sees only dense int8 codes and float queries.
 *
 * Choices worth measuring (score_upload_ms of kv_qaware_report is this
 * file's upload_ms, so a device run shows what they cost):
 *   - The codes are most of the bytes (L * Hkv * m * r: 268 MB for an 8B
 *     model at 32k positions) and are copied from the sketch's own
 *     malloc'd (pageable) memory: the driver stages pageable copies through
 *     its pinned buffers, slower than a pinned source at full PCIe speed.
 *     Staging through a pinned buffer here would add a host copy of the
 *     same size; the lever is for kv_tree_store_sketch to read the codes
 *     into pinned memory (kv_gpu_host_alloc) in the first place.
 *   - Only the n matched rows of each node are copied, packed densely: one
 *     copy per segment, a 2D one (pitch rows * r, width n * r, L * Hkv
 *     lines) where the node stores more rows than matched.
 *   - Device memory is allocated per call, in one cudaMalloc (codes,
 *     queries, segment table, scratch, scores) and freed after; a buffer
 *     kept between requests would save the allocation.
 *   - The legacy default stream: the engine's work is finished (the runner
 *     was reset after the probe), and nothing here overlaps anything.
 */
#include "eval/kv_qaware_gpu.h"

#ifdef KV_HAVE_CUDA

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_stats.h"
#include "gpu/kv_gpu_cuda.h"
#include "kv_kernels.h"

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

struct kv_qaware_staged {
    int device, m, L, Hkv, ns;
    cudaStream_t stream;      /* non-blocking: the copy runs beside the engine's work */
    char *codes;              /* device, code_bytes: the segments' codes packed densely */
    size_t code_bytes;
    kv_cuda_qaware_seg *tab;  /* (ns) host, code_off set, qs_off not yet */
    double ms;
};

/* Run the thread on device `device`, *prev the one to put back (-1: none). */
static kv_status use_device(int device, int *prev)
{
    *prev = -1;
    int cur;
    cudaError_t e = cudaGetDevice(&cur);
    if (e != cudaSuccess) return kv_cuda_fail(e, "cudaGetDevice(&cur)", __FILE__, __LINE__);
    if (cur == device) return KV_OK;
    if ((e = cudaSetDevice(device)) != cudaSuccess) return kv_cuda_fail(e, "cudaSetDevice(device)", __FILE__, __LINE__);
    *prev = cur;
    return KV_OK;
}

static kv_status put_device_back(int prev, kv_status st)
{
    if (prev < 0) return st;
    cudaError_t de = cudaSetDevice(prev);
    if (de != cudaSuccess && !st) st = kv_cuda_fail(de, "cudaSetDevice(prev)", __FILE__, __LINE__);
    return st;
}

void kv_qaware_gpu_unstage(kv_qaware_staged *g)
{
    if (!g) return;
    /* nothing here is reported (nothing is left to undo), and the caller's
     * error detail is left as it is: plain CUDA calls, not use_device */
    int cur = -1;
    const bool moved = cudaGetDevice(&cur) == cudaSuccess && cur != g->device && cudaSetDevice(g->device) == cudaSuccess;
    if (g->codes) cudaFreeAsync(g->codes, g->stream);
    if (g->stream) {
        cudaStreamSynchronize(g->stream);
        cudaStreamDestroy(g->stream);
    }
    if (moved) cudaSetDevice(cur);
    free(g->tab);
    free(g);
}

kv_status kv_qaware_gpu_stage(const kv_tree_sketch *sk, int L, int Hkv, int device, kv_qaware_staged **out)
{
    *out = NULL;
    const int m = sk->matched, LH = L * Hkv;
    if (L <= 0 || Hkv <= 0) return kv_fail(KV_E_USAGE, "query-aware scoring: bad geometry (L %d, Hkv %d)", L, Hkv);
    double t0 = kv_now_ms();
    kv_qaware_staged *g = calloc(1, sizeof *g);
    if (!g || !(g->tab = malloc((size_t)(sk->nseg + 1) * sizeof *g->tab))) {
        free(g);
        return kv_fail(KV_E_NOMEM, "out of memory");
    }
    g->device = device, g->m = m, g->L = L, g->Hkv = Hkv;
    /* the device table: non-empty segments, their offsets in one buffer */
    int next = 0;
    for (int si = 0; si < sk->nseg; si++) {
        const kv_tree_sketch_seg *sg = &sk->seg[si];
        if (sg->start != next || sg->n < 0 || sg->n > sg->rows || sg->r <= 0) {
            kv_qaware_gpu_unstage(g);
            return kv_fail(KV_E_INTERNAL, "query-aware scoring: sketch segment %d (start %d, %d of %d rows, "
                           "%d channels) does not continue the tiling at %d", si, sg->start, sg->n, sg->rows,
                           sg->r, next);
        }
        next += sg->n;
        if (!sg->n) continue;
        g->tab[g->ns++] = (kv_cuda_qaware_seg){sg->start, sg->n, sg->r, 0, g->code_bytes, 0};
        g->code_bytes = round_up(g->code_bytes + (size_t)LH * sg->n * sg->r, 16);
    }
    if (next != m) {
        kv_qaware_gpu_unstage(g);
        return kv_fail(KV_E_INTERNAL, "query-aware scoring: the sketch's segments cover %d of %d positions", next, m);
    }
    int prev = -1;
    kv_status st = use_device(device, &prev);
    if (st) {
        kv_qaware_gpu_unstage(g);
        return st;
    }
    /* stream-ordered allocation: a plain cudaMalloc may wait for the
     * device's other work (the probe running beside this copy) */
    KV_CUDA_CK_GOTO(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking), st, out);
    if (g->code_bytes) KV_CUDA_CK_GOTO(cudaMallocAsync((void **)&g->codes, g->code_bytes, g->stream), st, out);
    for (int si = 0, k = 0; si < sk->nseg; si++) {
        const kv_tree_sketch_seg *sg = &sk->seg[si];
        if (!sg->n) continue;
        const size_t w = (size_t)sg->n * sg->r, pitch = (size_t)sg->rows * sg->r;
        if (w == pitch) /* every stored row matched: one plain copy */
            KV_CUDA_CK_GOTO(cudaMemcpyAsync(g->codes + g->tab[k++].code_off, sg->code, w * LH,
                                            cudaMemcpyHostToDevice, g->stream), st, out);
        else
            KV_CUDA_CK_GOTO(cudaMemcpy2DAsync(g->codes + g->tab[k++].code_off, w, sg->code, pitch, w, (size_t)LH,
                                              cudaMemcpyHostToDevice, g->stream), st, out);
    }
out:
    st = put_device_back(prev, st);
    g->ms = kv_now_ms() - t0;
    if (st) {
        char why[512];
        snprintf(why, sizeof why, "%s", kv_errdetail());
        kv_qaware_gpu_unstage(g);
        return kv_fail(st, "%s", why);
    }
    *out = g;
    return KV_OK;
}

kv_status kv_qaware_score_gpu_staged(kv_qaware_staged *g, const kv_tree_sketch *sk, const float *q, int L, int H,
                                     int Hkv, int nq, int D, kv_qaware_heads how, double *score,
                                     kv_qaware_gpu_times *tm)
{
    kv_qaware_gpu_times tz = {0, 0, 0};
    if (!tm) tm = &tz;
    memset(tm, 0, sizeof *tm);
    const int m = sk->matched, gq = Hkv > 0 ? H / Hkv : 0, Q = gq * nq, LH = L * Hkv;
    if (m <= 0) return KV_OK;
    if (L <= 0 || Hkv <= 0 || gq <= 0 || H % Hkv || nq <= 0 || D <= 0)
        return kv_fail(KV_E_USAGE, "query-aware scoring: bad geometry (L %d, H %d, Hkv %d, nq %d, D %d)", L, H,
                       Hkv, nq, D);
    if (g->m != m || g->L != L || g->Hkv != Hkv)
        return kv_fail(KV_E_INTERNAL, "query-aware scoring: the staged codes are of another sketch or geometry");
    size_t qs_floats = 0;
    for (int k = 0; k < g->ns; k++) {
        if (g->tab[k].r > D)
            return kv_fail(KV_E_INTERNAL, "query-aware scoring: a segment of %d channels, head_dim %d", g->tab[k].r,
                           D);
        g->tab[k].qs_off = qs_floats;
        qs_floats = round_up(qs_floats + (size_t)LH * Q * g->tab[k].r, 4);
    }
    const int ns = g->ns;
    const size_t ws_bytes = kv_cuda_qaware_workspace(LH, Q, m);
    const size_t o_tab = round_up(qs_floats * sizeof(float), 256);
    const size_t o_ws = round_up(o_tab + (size_t)ns * sizeof *g->tab, 256), o_sc = round_up(o_ws + ws_bytes, 256);
    const size_t total = o_sc + (size_t)m * sizeof(double);

    kv_status st = KV_OK;
    double t0 = kv_now_ms();
    float *qs = malloc(qs_floats * sizeof *qs + 1);
    double *got = malloc((size_t)m * sizeof *got);
    char *dev = NULL;
    int prev = -1;
    if (!qs || !got) {
        st = kv_fail(KV_E_NOMEM, "out of memory");
        goto out;
    }
    /* the folded queries of kv_qaware_score_cpu: (l, h) in order, query
     * j = (query head within the group) * nq + query */
    const float inv = 1.0f / sqrtf((float)D);
    for (int si = 0, k = 0; si < sk->nseg; si++) {
        const kv_tree_sketch_seg *sg = &sk->seg[si];
        if (!sg->n) continue;
        const int r = sg->r;
        float *dst = qs + g->tab[k++].qs_off;
        for (int lh = 0; lh < LH; lh++) {
            const int l = lh / Hkv, h = lh % Hkv;
            const uint16_t *ch = sg->ch + (size_t)lh * r;
            const float *scl = sg->scale + (size_t)lh * r;
            for (int j = 0; j < Q; j++) {
                const float *qv = q + (((size_t)l * H + h * gq + j / nq) * nq + j % nq) * D;
                float *o = dst + ((size_t)lh * Q + j) * r;
                for (int i = 0; i < r; i++) o[i] = qv[ch[i]] * scl[i] * inv;
            }
        }
    }
    if ((st = use_device(g->device, &prev))) goto out;
    KV_CUDA_CK_GOTO(cudaMallocAsync((void **)&dev, total, g->stream), st, out);
    KV_CUDA_CK_GOTO(cudaMemcpyAsync(dev, qs, qs_floats * sizeof *qs, cudaMemcpyHostToDevice, g->stream), st, out);
    KV_CUDA_CK_GOTO(cudaMemcpyAsync(dev + o_tab, g->tab, (size_t)ns * sizeof *g->tab, cudaMemcpyHostToDevice,
                                    g->stream), st, out);
    KV_CUDA_CK_GOTO(cudaStreamSynchronize(g->stream), st, out); /* the codes' copy too, if still running */
    double t1 = kv_now_ms();
    tm->upload_ms = t1 - t0;
    KV_CUDA_CK_GOTO(kv_cuda_qaware_score(LH, Q, m, ns, (const kv_cuda_qaware_seg *)(dev + o_tab),
                                         (const int8_t *)g->codes, (const float *)dev, dev + o_ws, ws_bytes,
                                         how != KV_QAWARE_SUM, (double *)(dev + o_sc), g->stream), st, out);
    KV_CUDA_CK_GOTO(cudaStreamSynchronize(g->stream), st, out);
    double t2 = kv_now_ms();
    tm->kernel_ms = t2 - t1;
    KV_CUDA_CK_GOTO(cudaMemcpyAsync(got, dev + o_sc, (size_t)m * sizeof *got, cudaMemcpyDeviceToHost, g->stream), st,
                    out);
    KV_CUDA_CK_GOTO(cudaStreamSynchronize(g->stream), st, out);
    for (int t = 0; t < m; t++) {
        if (how == KV_QAWARE_SUM) score[t] += got[t];
        else if (got[t] > score[t]) score[t] = got[t];
    }
    tm->download_ms = kv_now_ms() - t2;
out:
    if (dev) {
        cudaError_t fe = cudaFreeAsync(dev, g->stream);
        if (fe == cudaSuccess) fe = cudaStreamSynchronize(g->stream);
        if (fe != cudaSuccess && !st) st = kv_cuda_fail(fe, "cudaFreeAsync(dev)", __FILE__, __LINE__);
    }
    st = put_device_back(prev, st);
    free(qs), free(got);
    return st;
}

kv_status kv_qaware_score_gpu(const kv_tree_sketch *sk, const float *q, int L, int H, int Hkv, int nq, int D,
                              kv_qaware_heads how, int device, double *score, kv_qaware_gpu_times *tm)
{
    if (tm) memset(tm, 0, sizeof *tm);
    if (sk->matched <= 0) return KV_OK;
    if (L <= 0 || Hkv <= 0 || H <= 0 || H % Hkv || nq <= 0 || D <= 0)
        return kv_fail(KV_E_USAGE, "query-aware scoring: bad geometry (L %d, H %d, Hkv %d, nq %d, D %d)", L, H,
                       Hkv, nq, D);
    kv_qaware_staged *g = NULL;
    kv_status st = kv_qaware_gpu_stage(sk, L, Hkv, device, &g);
    if (!st) {
        st = kv_qaware_score_gpu_staged(g, sk, q, L, H, Hkv, nq, D, how, score, tm);
        if (tm) tm->upload_ms += g->ms; /* the codes' copy was issued here, not beforehand */
        char why[512];
        snprintf(why, sizeof why, "%s", st ? kv_errdetail() : "");
        kv_qaware_gpu_unstage(g);
        if (st) st = kv_fail(st, "%s", why);
    }
    return st;
}

double kv_qaware_gpu_stage_ms(const kv_qaware_staged *g) { return g ? g->ms : 0; }

#else /* no CUDA in the build */

struct kv_qaware_staged {
    int unused;
};

kv_status kv_qaware_gpu_stage(const kv_tree_sketch *sk, int L, int Hkv, int device, kv_qaware_staged **out)
{
    (void)sk, (void)L, (void)Hkv, (void)device;
    *out = NULL;
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA: no GPU scoring");
}

kv_status kv_qaware_score_gpu_staged(kv_qaware_staged *g, const kv_tree_sketch *sk, const float *q, int L, int H,
                                     int Hkv, int nq, int D, kv_qaware_heads how, double *score,
                                     kv_qaware_gpu_times *tm)
{
    (void)g, (void)sk, (void)q, (void)L, (void)H, (void)Hkv, (void)nq, (void)D, (void)how, (void)score;
    if (tm) tm->upload_ms = tm->kernel_ms = tm->download_ms = 0;
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA: no GPU scoring");
}

void kv_qaware_gpu_unstage(kv_qaware_staged *g) { (void)g; }

double kv_qaware_gpu_stage_ms(const kv_qaware_staged *g)
{
    (void)g;
    return 0;
}

kv_status kv_qaware_score_gpu(const kv_tree_sketch *sk, const float *q, int L, int H, int Hkv, int nq, int D,
                              kv_qaware_heads how, int device, double *score, kv_qaware_gpu_times *tm)
{
    (void)sk, (void)q, (void)L, (void)H, (void)Hkv, (void)nq, (void)D, (void)how, (void)device, (void)score;
    if (tm) tm->upload_ms = tm->kernel_ms = tm->download_ms = 0;
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA: no GPU scoring");
}

#endif
