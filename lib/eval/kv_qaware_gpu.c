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

kv_status kv_qaware_score_gpu(const kv_tree_sketch *sk, const float *q, int L, int H, int Hkv, int nq, int D,
                              kv_qaware_heads how, int device, double *score, kv_qaware_gpu_times *tm)
{
    kv_qaware_gpu_times tz = {0, 0, 0};
    if (!tm) tm = &tz;
    memset(tm, 0, sizeof *tm);
    const int m = sk->matched, g = Hkv > 0 ? H / Hkv : 0, Q = g * nq, LH = L * Hkv;
    if (m <= 0) return KV_OK;
    if (L <= 0 || Hkv <= 0 || g <= 0 || H % Hkv || nq <= 0 || D <= 0)
        return kv_fail(KV_E_USAGE, "query-aware scoring: bad geometry (L %d, H %d, Hkv %d, nq %d, D %d)", L, H,
                       Hkv, nq, D);
    /* the device table: non-empty segments, their offsets in one buffer */
    kv_cuda_qaware_seg *tab = malloc((size_t)(sk->nseg + 1) * sizeof *tab);
    if (!tab) return kv_fail(KV_E_NOMEM, "out of memory");
    int ns = 0, next = 0;
    size_t code_bytes = 0, qs_floats = 0;
    for (int si = 0; si < sk->nseg; si++) {
        const kv_tree_sketch_seg *sg = &sk->seg[si];
        if (sg->start != next || sg->n < 0 || sg->n > sg->rows || sg->r <= 0 || sg->r > D) {
            free(tab);
            return kv_fail(KV_E_INTERNAL, "query-aware scoring: sketch segment %d (start %d, %d of %d rows, "
                           "%d channels) does not continue the tiling at %d", si, sg->start, sg->n, sg->rows,
                           sg->r, next);
        }
        next += sg->n;
        if (!sg->n) continue;
        tab[ns++] = (kv_cuda_qaware_seg){sg->start, sg->n, sg->r, 0, code_bytes, qs_floats};
        code_bytes = round_up(code_bytes + (size_t)LH * sg->n * sg->r, 16);
        qs_floats = round_up(qs_floats + (size_t)LH * Q * sg->r, 4);
    }
    if (next != m) {
        free(tab);
        return kv_fail(KV_E_INTERNAL, "query-aware scoring: the sketch's segments cover %d of %d positions", next, m);
    }
    const size_t ws_bytes = kv_cuda_qaware_workspace(LH, Q, m);
    const size_t o_qs = round_up(code_bytes, 256), o_tab = round_up(o_qs + qs_floats * sizeof(float), 256);
    const size_t o_ws = round_up(o_tab + (size_t)ns * sizeof *tab, 256), o_sc = round_up(o_ws + ws_bytes, 256);
    const size_t total = o_sc + (size_t)m * sizeof(double);

    kv_status st = KV_OK;
    double t0 = kv_now_ms();
    float *qs = malloc(qs_floats * sizeof *qs + 1);
    double *got = malloc((size_t)m * sizeof *got);
    char *dev = NULL;
    int prev = -1;
    bool restore = false;
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
        float *dst = qs + tab[k++].qs_off;
        for (int lh = 0; lh < LH; lh++) {
            const int l = lh / Hkv, h = lh % Hkv;
            const uint16_t *ch = sg->ch + (size_t)lh * r;
            const float *scl = sg->scale + (size_t)lh * r;
            for (int j = 0; j < Q; j++) {
                const float *qv = q + (((size_t)l * H + h * g + j / nq) * nq + j % nq) * D;
                float *o = dst + ((size_t)lh * Q + j) * r;
                for (int i = 0; i < r; i++) o[i] = qv[ch[i]] * scl[i] * inv;
            }
        }
    }
    KV_CUDA_CK_GOTO(cudaGetDevice(&prev), st, out);
    restore = prev != device;
    if (restore) KV_CUDA_CK_GOTO(cudaSetDevice(device), st, out);
    KV_CUDA_CK_GOTO(cudaMalloc((void **)&dev, total), st, out);
    for (int si = 0, k = 0; si < sk->nseg; si++) {
        const kv_tree_sketch_seg *sg = &sk->seg[si];
        if (!sg->n) continue;
        const size_t w = (size_t)sg->n * sg->r, pitch = (size_t)sg->rows * sg->r;
        if (w == pitch) /* every stored row matched: one plain copy */
            KV_CUDA_CK_GOTO(cudaMemcpyAsync(dev + tab[k++].code_off, sg->code, w * LH, cudaMemcpyHostToDevice, 0),
                            st, out);
        else
            KV_CUDA_CK_GOTO(cudaMemcpy2DAsync(dev + tab[k++].code_off, w, sg->code, pitch, w, (size_t)LH,
                                              cudaMemcpyHostToDevice, 0), st, out);
    }
    KV_CUDA_CK_GOTO(cudaMemcpyAsync(dev + o_qs, qs, qs_floats * sizeof *qs, cudaMemcpyHostToDevice, 0), st, out);
    KV_CUDA_CK_GOTO(cudaMemcpyAsync(dev + o_tab, tab, (size_t)ns * sizeof *tab, cudaMemcpyHostToDevice, 0), st, out);
    KV_CUDA_CK_GOTO(cudaStreamSynchronize(0), st, out);
    double t1 = kv_now_ms();
    tm->upload_ms = t1 - t0;
    KV_CUDA_CK_GOTO(kv_cuda_qaware_score(LH, Q, m, ns, (const kv_cuda_qaware_seg *)(dev + o_tab),
                                         (const int8_t *)dev, (const float *)(dev + o_qs), dev + o_ws, ws_bytes,
                                         how != KV_QAWARE_SUM, (double *)(dev + o_sc), 0), st, out);
    KV_CUDA_CK_GOTO(cudaStreamSynchronize(0), st, out);
    double t2 = kv_now_ms();
    tm->kernel_ms = t2 - t1;
    KV_CUDA_CK_GOTO(cudaMemcpy(got, dev + o_sc, (size_t)m * sizeof *got, cudaMemcpyDeviceToHost), st, out);
    for (int t = 0; t < m; t++) {
        if (how == KV_QAWARE_SUM) score[t] += got[t];
        else if (got[t] > score[t]) score[t] = got[t];
    }
    tm->download_ms = kv_now_ms() - t2;
out:
    if (dev) {
        cudaError_t fe = cudaFree(dev);
        if (fe != cudaSuccess && !st) st = kv_cuda_fail(fe, "cudaFree(dev)", __FILE__, __LINE__);
    }
    if (restore) {
        cudaError_t de = cudaSetDevice(prev);
        if (de != cudaSuccess && !st) st = kv_cuda_fail(de, "cudaSetDevice(prev)", __FILE__, __LINE__);
    }
    free(qs), free(got), free(tab);
    return st;
}

#else /* no CUDA in the build */

kv_status kv_qaware_score_gpu(const kv_tree_sketch *sk, const float *q, int L, int H, int Hkv, int nq, int D,
                              kv_qaware_heads how, int device, double *score, kv_qaware_gpu_times *tm)
{
    (void)sk, (void)q, (void)L, (void)H, (void)Hkv, (void)nq, (void)D, (void)how, (void)device, (void)score;
    if (tm) tm->upload_ms = tm->kernel_ms = tm->download_ms = 0;
    return kv_fail(KV_E_UNAVAILABLE, "this kvtools was built without CUDA: no GPU scoring");
}

#endif
