/*
 * Query-aware scoring of a key sketch (kv_cuda_qaware_score, kv_kernels.h):
 * the device form of kv_qaware_score_cpu (lib/eval/kv_qaware.c), which the
 * tests compare it with (tests/unit/test_gpu_qaware.c).  Four passes, so
 * that no logit is kept (at 32k positions, 8 KV heads, 32 layers and 16
 * queries per KV head they would be 0.5 GB) and no atomics make the sum
 * depend on timing:
 *   1. stats:   a thread per position and (layer, KV head), a block per 256
 *               positions: each query's logit, then the block's max and
 *               sum of exp(logit - max), per query;
 *   2. combine: a thread per (layer, KV head, query) merges the blocks'
 *               (max, sum) into the softmax's max and 1/sum;
 *   3. probs:   the logits again (the codes are read twice: cheap beside
 *               keeping them), each query's probability summed over the
 *               queries into part[(l, h)][t] (float, as the CPU's part);
 *   4. sum:     a thread per position adds part over (l, h) in double, in
 *               the CPU's order, or takes their largest (take_max).
 * Logits are float dot products in channel order as on the host; the
 * exponential is expf (the host's is a polynomial good to 1e-5 relative).
 */
#include "common.cuh"

#define QA_TPB 256 /* positions per block */

static size_t qa_align(size_t n) { return (n + 255) & ~(size_t)255; }

extern "C" size_t kv_cuda_qaware_workspace(int LH, int Q, int m)
{
    const size_t nblk = ((size_t)m + QA_TPB - 1) / QA_TPB;
    return qa_align((size_t)LH * Q * nblk * sizeof(float2)) + qa_align((size_t)LH * Q * sizeof(float2)) +
           qa_align((size_t)LH * m * sizeof(float));
}

/* The segment holding position t: the last one starting at or before it
 * (segments tile [0, m) in order; the host drops empty ones). */
static __device__ __forceinline__ int qa_find(const kv_cuda_qaware_seg *seg, int nseg, int t)
{
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (seg[mid].start <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Where position t's code row and (layer, KV head) lh's folded queries are. */
struct qa_row {
    const int8_t *code; /* (r) */
    const float *qs;    /* (Q, r) */
    int r;
};

static __device__ __forceinline__ qa_row qa_locate(const kv_cuda_qaware_seg *seg, int nseg, const int8_t *codes,
                                                   const float *qs, int Q, int lh, int t)
{
    const kv_cuda_qaware_seg g = seg[qa_find(seg, nseg, t)];
    qa_row w;
    w.r = g.r;
    w.code = codes + g.code_off + ((size_t)lh * g.n + (size_t)(t - g.start)) * g.r;
    w.qs = qs + g.qs_off + (size_t)lh * Q * g.r;
    return w;
}

/* qs_j . code, summed in channel order like the host's dot_rows.  r a
 * multiple of 4: 4-byte code and 16-byte query loads (the host aligns the
 * offsets for it). */
static __device__ __forceinline__ float qa_logit(const qa_row &w, int j)
{
    const float *q = w.qs + (size_t)j * w.r;
    float a = 0.0f;
    if ((w.r & 3) == 0) {
        const char4 *c4 = reinterpret_cast<const char4 *>(w.code);
        const float4 *q4 = reinterpret_cast<const float4 *>(q);
        for (int i = 0; i < (w.r >> 2); i++) {
            const char4 c = c4[i];
            const float4 x = __ldg(q4 + i);
            a += x.x * (float)c.x;
            a += x.y * (float)c.y;
            a += x.z * (float)c.z;
            a += x.w * (float)c.w;
        }
    } else {
        for (int i = 0; i < w.r; i++) a += __ldg(q + i) * (float)w.code[i];
    }
    return a;
}

/* The block's max (MAX) or sum of v, returned to every thread.  red:
 * QA_TPB/32 floats, free on entry (the first barrier sees to it). */
template <bool MAX>
static __device__ __forceinline__ float qa_block_reduce(float v, float *red)
{
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        const float u = __shfl_xor_sync(KV_FULL_MASK, v, o);
        v = MAX ? fmaxf(v, u) : v + u;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
#pragma unroll
    for (int i = 1; i < QA_TPB / 32; i++) v = MAX ? fmaxf(v, red[i]) : v + red[i];
    return v;
}

/* grid (nblk, LH): stats[(lh * Q + j) * nblk + b] = (max, sum of exp(x - max)) over block b. */
__global__ void __launch_bounds__(QA_TPB) qa_stats_kernel(int Q, int m, int nseg, const kv_cuda_qaware_seg *seg,
                                                          const int8_t *codes, const float *qs, float2 *stats)
{
    __shared__ float red[QA_TPB / 32];
    const int t = blockIdx.x * QA_TPB + threadIdx.x, lh = blockIdx.y, nblk = gridDim.x;
    const bool valid = t < m;
    qa_row w = {nullptr, nullptr, 0};
    if (valid) w = qa_locate(seg, nseg, codes, qs, Q, lh, t);
    for (int j = 0; j < Q; j++) {
        const float x = valid ? qa_logit(w, j) : -INFINITY;
        const float mx = qa_block_reduce<true>(x, red);
        const float s = qa_block_reduce<false>(valid ? expf(x - mx) : 0.0f, red);
        if (threadIdx.x == 0) stats[((size_t)lh * Q + j) * nblk + blockIdx.x] = make_float2(mx, s);
    }
}

/* A thread per (lh, j) < n: mi = (the softmax's max, 1 / its sum). */
__global__ void qa_combine_kernel(int n, int nblk, const float2 *stats, float2 *mi)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float2 *st = stats + (size_t)i * nblk;
    float mx = -INFINITY, s = 0.0f;
    for (int b = 0; b < nblk; b++) mx = fmaxf(mx, st[b].x);
    for (int b = 0; b < nblk; b++) s += st[b].y * expf(st[b].x - mx);
    mi[i] = make_float2(mx, 1.0f / s);
}

/* grid (nblk, LH): part[lh * m + t] = sum_j softmax_j(t). */
__global__ void __launch_bounds__(QA_TPB) qa_probs_kernel(int Q, int m, int nseg, const kv_cuda_qaware_seg *seg,
                                                          const int8_t *codes, const float *qs, const float2 *mi,
                                                          float *part)
{
    const int t = blockIdx.x * QA_TPB + threadIdx.x, lh = blockIdx.y;
    if (t >= m) return;
    const qa_row w = qa_locate(seg, nseg, codes, qs, Q, lh, t);
    const float2 *mq = mi + (size_t)lh * Q;
    float p = 0.0f;
    for (int j = 0; j < Q; j++) {
        const float2 s = mq[j];
        p += expf(qa_logit(w, j) - s.x) * s.y;
    }
    part[(size_t)lh * m + t] = p;
}

/* A thread per position: score[t] = sum over lh of part (double, lh in
 * order), or with take_max their largest (parts are >= 0). */
__global__ void qa_sum_kernel(int LH, int m, int take_max, const float *part, double *score)
{
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= m) return;
    double a = 0.0;
    for (int lh = 0; lh < LH; lh++) {
        const double v = (double)part[(size_t)lh * m + t];
        a = take_max ? fmax(a, v) : a + v;
    }
    score[t] = a;
}

extern "C" cudaError_t kv_cuda_qaware_score(int LH, int Q, int m, int nseg, const kv_cuda_qaware_seg *seg,
                                            const int8_t *codes, const float *qs, void *ws, size_t ws_bytes,
                                            int take_max, double *score, cudaStream_t stream)
{
    KV_CHECK_ARGS(LH > 0 && LH <= 65535 && Q > 0 && m > 0 && nseg > 0 && seg && codes && qs && ws && score);
    KV_CHECK_ARGS(ws_bytes >= kv_cuda_qaware_workspace(LH, Q, m));
    const int nblk = (m + QA_TPB - 1) / QA_TPB;
    char *p = static_cast<char *>(ws);
    float2 *stats = reinterpret_cast<float2 *>(p);
    p += qa_align((size_t)LH * Q * nblk * sizeof(float2));
    float2 *mi = reinterpret_cast<float2 *>(p);
    p += qa_align((size_t)LH * Q * sizeof(float2));
    float *part = reinterpret_cast<float *>(p);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, qa_stats_kernel, dim3(nblk, LH), dim3(QA_TPB), 0, stream, Q, m, nseg, seg,
                         codes, qs, stats));
    const int nq = LH * Q;
    CUDA_CHECK(kv_launch(KV_PDL_NONE, qa_combine_kernel, dim3((nq + 127) / 128), dim3(128), 0, stream, nq, nblk,
                         (const float2 *)stats, mi));
    CUDA_CHECK(kv_launch(KV_PDL_NONE, qa_probs_kernel, dim3(nblk, LH), dim3(QA_TPB), 0, stream, Q, m, nseg, seg,
                         codes, qs, (const float2 *)mi, part));
    CUDA_CHECK(kv_launch(KV_PDL_NONE, qa_sum_kernel, dim3((m + 255) / 256), dim3(256), 0, stream, LH, m, take_max,
                         (const float *)part, score));
    return cudaSuccess;
}
