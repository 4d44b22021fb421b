/*
 * eng_select: the token selection of sparse (TailorKV) layers on the GPU, the
 * same steps as lib/kv_policy_sparse.c: critical channels from the
 * predicted query and the per-channel key maxima; approximate scores of the
 * candidate tokens from those channels (or from a resident 1-bit sketch of
 * every key, or exactly); per-head softmax over the candidates combined
 * over each KV head's group; top-K; and the gather of the chosen rows.
 * Candidate keys and rows live in mapped pinned host memory and are read
 * straight from it ("zero-copy"): the indices are on the device, so a copy
 * engine transfer would first need them on the host, a synchronisation in
 * the middle of every layer.  Host reads use 16-byte loads, and a gathered
 * row (one head's K and V, 2*hd*2 bytes) is one contiguous run.
 */
#include "eng_common.cuh"

#define SEL_MAXG 8

// --- critical channels --------------------------------------------------------

__global__ void select_channels_kernel(const float *q, const float *chmax, int g, int hd, int C,
                                       int *chans, float *qscale)
{
    extern __shared__ float cs[]; /* (hd) channel scores */
    __shared__ float red[32];
    const int kh = blockIdx.x;
    const float *qg = q + (size_t)kh * g * hd;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float a = 0.0f;
        for (int h = 0; h < g; h++) a += fabsf(qg[(size_t)h * hd + c]);
        cs[c] = a * chmax[(size_t)kh * hd + c];
    }
    __syncthreads();
    /* rank by (score desc, index asc), as the CPU's select_top + sort */
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float sc = cs[c];
        int rank = 0;
        for (int j = 0; j < hd; j++) rank += cs[j] > sc || (cs[j] == sc && j < c);
        if (rank < C) {
            int pos = 0; /* ascending channel order among the chosen */
            for (int j = 0; j < c; j++) {
                float sj = cs[j];
                int rj = 0;
                for (int i = 0; i < hd; i++) rj += cs[i] > sj || (cs[i] == sj && i < j);
                pos += rj < C;
            }
            chans[kh * C + pos] = c;
        }
    }
    __syncthreads();
    /* SparQ temperature per query head */
    for (int h = 0; h < g; h++) {
        const float *qh = qg + (size_t)h * hd;
        float all = 0.0f, part = 0.0f;
        for (int c = threadIdx.x; c < hd; c += blockDim.x) all += fabsf(qh[c]);
        for (int j = threadIdx.x; j < C; j += blockDim.x) part += fabsf(qh[chans[kh * C + j]]);
        all = eng_block_sum(all, red);
        part = eng_block_sum(part, red);
        if (threadIdx.x == 0) {
            float temp = all <= 0.0f ? (float)hd : (float)hd * part / all;
            qscale[kh * g + h] = temp > 0.0f ? 1.0f / sqrtf(temp) : 0.0f;
        }
    }
}

extern "C" cudaError_t eng_select_channels(const float *q, const float *chmax, int nq_heads,
                                           int nkv, int hd, int C, int *chans, float *qscale,
                                           cudaStream_t s)
{
    if (C > hd || C < 1) return cudaErrorInvalidValue;
    select_channels_kernel<<<nkv, 128, (size_t)hd * sizeof(float), s>>>(q, chmax, nq_heads / nkv,
                                                                        hd, C, chans, qscale);
    ENG_LAUNCHED();
}

// --- approximate scores from critical channels (zero-copy) ----------------------

/* Each thread scores 8 consecutive tokens with one 16-byte host read per
 * channel; tokens are counted from the 8-aligned base below cs. */
__global__ void score_channels_kernel(const float *q, const int *chans, const float *qscale,
                                      const uint4 *kcm, int ldc, int g, int hd, int C, int cs,
                                      int cend, float *score)
{
    extern __shared__ float qc[]; /* (g, C) q_c * qscale */
    const int kh = blockIdx.y, n = cend - cs, base = cs & ~7;
    for (int i = threadIdx.x; i < g * C; i += blockDim.x) {
        int h = i / C, j = i % C, qh = kh * g + h;
        qc[i] = q[(size_t)qh * hd + chans[kh * C + j]] * qscale[qh];
    }
    __syncthreads();
    const int t8 = base + 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (t8 >= cend) return;
    float acc[SEL_MAXG][8];
#pragma unroll
    for (int h = 0; h < SEL_MAXG; h++)
#pragma unroll
        for (int i = 0; i < 8; i++) acc[h][i] = 0.0f;
    for (int j = 0; j < C; j++) {
        int c = chans[kh * C + j];
        uint4 u = kcm[(((size_t)kh * hd + c) * ldc + t8) / 8];
        float f[8];
        eng_f16::unpack8(u, f);
#pragma unroll
        for (int h = 0; h < SEL_MAXG; h++)
            if (h < g) {
                float w = qc[h * C + j];
#pragma unroll
                for (int i = 0; i < 8; i++) acc[h][i] += w * f[i];
            }
    }
#pragma unroll
    for (int h = 0; h < SEL_MAXG; h++)
        if (h < g)
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int t = t8 + i;
                if (t >= cs && t < cend) score[(size_t)(kh * g + h) * n + (t - cs)] = acc[h][i];
            }
}

extern "C" cudaError_t eng_score_channels(const float *q, const int *chans, const float *qscale,
                                          const void *kcm, eng_dtype t, int ldc, int nq_heads,
                                          int nkv, int hd, int C, int cs, int cend, float *score,
                                          cudaStream_t s)
{
    if (t != ENG_F16 || (ldc & 7) || nq_heads / nkv > SEL_MAXG) return cudaErrorInvalidValue;
    if (cend <= cs) return cudaSuccess;
    int g = nq_heads / nkv, base = cs & ~7;
    int threads8 = (cend - base + 7) / 8;
    dim3 grid((unsigned)((threads8 + 127) / 128), (unsigned)nkv);
    score_channels_kernel<<<grid, 128, (size_t)g * C * sizeof(float), s>>>(
        q, chans, qscale, (const uint4 *)kcm, ldc, g, hd, C, cs, cend, score);
    ENG_LAUNCHED();
}

// --- exact scores from the host rows (zero-copy) ----------------------------------

__global__ void score_exact_kernel(const float *q, const uint4 *rows, int g, int nkv, int hd,
                                   int cs, int cend, float *score)
{
    const int kh = blockIdx.y, n = cend - cs;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int t = cs + i, nv = hd / 8;
    const uint4 *kr = rows + ((size_t)t * nkv + kh) * 2 * nv;
    float acc[SEL_MAXG];
#pragma unroll
    for (int h = 0; h < SEL_MAXG; h++) acc[h] = 0.0f;
    for (int v = 0; v < nv; v++) {
        float f[8];
        eng_f16::unpack8(kr[v], f);
#pragma unroll
        for (int h = 0; h < SEL_MAXG; h++)
            if (h < g) {
                const float *qh = q + (size_t)(kh * g + h) * hd + 8 * v;
#pragma unroll
                for (int j = 0; j < 8; j++) acc[h] += qh[j] * f[j];
            }
    }
    float sc = rsqrtf((float)hd);
#pragma unroll
    for (int h = 0; h < SEL_MAXG; h++)
        if (h < g) score[(size_t)(kh * g + h) * n + i] = acc[h] * sc;
}

extern "C" cudaError_t eng_score_exact(const float *q, const void *rows, eng_dtype t, int nq_heads,
                                       int nkv, int hd, int cs, int cend, float *score,
                                       cudaStream_t s)
{
    if (t != ENG_F16 || (hd & 7) || nq_heads / nkv > SEL_MAXG) return cudaErrorInvalidValue;
    if (cend <= cs) return cudaSuccess;
    dim3 grid((unsigned)((cend - cs + 127) / 128), (unsigned)nkv);
    score_exact_kernel<<<grid, 128, 0, s>>>(q, (const uint4 *)rows, nq_heads / nkv, nkv, hd, cs,
                                            cend, score);
    ENG_LAUNCHED();
}

// --- scores from the resident 1-bit sketch --------------------------------------

/* Per head, a table of the sums of w_c = q_c*mad_c over the set bits of each
 * nibble position: tab (g, hd/4, 16).  score = 2*sum_{bits set} w - sum w. */
__global__ void score_sketch_kernel(const float *q, const uint8_t *bits, int ldb, const float *mad,
                                    int g, int hd, int cs, int cend, float *score)
{
    extern __shared__ float tab[]; /* (g, hd/4, 16) then (g) totals */
    const int kh = blockIdx.y, n = cend - cs, np = hd / 4, nb = hd / 8;
    float *tot = tab + (size_t)g * np * 16;
    const float sc = rsqrtf((float)hd);
    for (int i = threadIdx.x; i < g * np * 16; i += blockDim.x) {
        int v = i & 15, p = (i >> 4) % np, h = i / (np * 16);
        const float *qh = q + (size_t)(kh * g + h) * hd;
        const float *m = mad + (size_t)kh * hd;
        float s = 0.0f;
        for (int b = 0; b < 4; b++)
            if (v >> b & 1) s += qh[4 * p + b] * m[4 * p + b];
        tab[i] = 2.0f * s * sc;
    }
    for (int h = threadIdx.x; h < g; h += blockDim.x) {
        const float *qh = q + (size_t)(kh * g + h) * hd;
        const float *m = mad + (size_t)kh * hd;
        float s = 0.0f;
        for (int c = 0; c < hd; c++) s += qh[c] * m[c];
        tot[h] = s * sc;
    }
    __syncthreads();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint8_t *row = bits + ((size_t)kh * ldb + cs + i) * nb;
    float acc[SEL_MAXG];
#pragma unroll
    for (int h = 0; h < SEL_MAXG; h++) acc[h] = h < g ? -tot[h] : 0.0f;
    for (int b0 = 0; b0 < nb; b0 += 16) {
        uint8_t by[16];
        if (nb - b0 >= 16) {
            uint4 u = *(const uint4 *)(row + b0);
            memcpy(by, &u, 16);
        } else {
            for (int b = 0; b < 16; b++) by[b] = b0 + b < nb ? row[b0 + b] : 0;
        }
        int lim = nb - b0 < 16 ? nb - b0 : 16;
        for (int b = 0; b < lim; b++) {
            int p0 = 2 * (b0 + b);
            unsigned lo = by[b] & 15u, hi = by[b] >> 4;
#pragma unroll
            for (int h = 0; h < SEL_MAXG; h++)
                if (h < g) acc[h] += tab[(h * np + p0) * 16 + lo] + tab[(h * np + p0 + 1) * 16 + hi];
        }
    }
#pragma unroll
    for (int h = 0; h < SEL_MAXG; h++)
        if (h < g) score[(size_t)(kh * g + h) * n + i] = acc[h];
}

extern "C" cudaError_t eng_score_sketch(const float *q, const uint8_t *bits, int ldb,
                                        const float *mad, int nq_heads, int nkv, int hd, int cs,
                                        int cend, float *score, cudaStream_t s)
{
    if ((hd & 7) || nq_heads / nkv > SEL_MAXG) return cudaErrorInvalidValue;
    if (cend <= cs) return cudaSuccess;
    int g = nq_heads / nkv;
    size_t smem = ((size_t)g * (hd / 4) * 16 + (size_t)g) * sizeof(float);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(score_sketch_kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    dim3 grid((unsigned)((cend - cs + 255) / 256), (unsigned)nkv);
    score_sketch_kernel<<<grid, 256, smem, s>>>(q, bits, ldb, mad, g, hd, cs, cend, score);
    ENG_LAUNCHED();
}

// --- softmax over candidates, combined over the group ------------------------------

__global__ void softmax_stats_kernel(const float *score, int n, float *stats)
{
    __shared__ float red[32];
    const int qh = blockIdx.x;
    const float *s = score + (size_t)qh * n;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, s[i]);
    m = eng_block_max(m, red);
    float l = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) l += __expf(s[i] - m);
    l = eng_block_sum(l, red);
    if (threadIdx.x == 0) {
        stats[2 * qh] = m;
        stats[2 * qh + 1] = l > 0.0f ? 1.0f / l : 0.0f;
    }
}

__global__ void combine_kernel(const float *score, int g, int n, int reduce_max,
                               const float *stats, float *comb)
{
    const int kh = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float acc = 0.0f;
    for (int h = 0; h < g; h++) {
        int qh = kh * g + h;
        float p = __expf(score[(size_t)qh * n + i] - stats[2 * qh]) * stats[2 * qh + 1];
        acc = reduce_max ? fmaxf(acc, p) : acc + p;
    }
    comb[(size_t)kh * n + i] = acc;
}

extern "C" cudaError_t eng_softmax_combine(const float *score, int nq_heads, int nkv, int n,
                                           int reduce_max, float *tmp, float *comb,
                                           cudaStream_t s)
{
    if (n <= 0) return cudaSuccess;
    softmax_stats_kernel<<<nq_heads, 1024, 0, s>>>(score, n, tmp);
    dim3 grid((unsigned)((n + 255) / 256), (unsigned)nkv);
    combine_kernel<<<grid, 256, 0, s>>>(score, nq_heads / nkv, n, reduce_max, tmp, comb);
    ENG_LAUNCHED();
}

// --- top-K: radix select then an ordered compaction -------------------------------

static __device__ __forceinline__ uint32_t ord_key(float f)
{
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* larger float -> larger key */
}

#define TOPK_THREADS 1024

__global__ void __launch_bounds__(TOPK_THREADS)
topk_kernel(const float *comb, int n, int k, int base, int *sel)
{
    __shared__ unsigned hist[256];
    __shared__ uint32_t s_prefix, s_mask;
    __shared__ int s_need;
    __shared__ int wcount[32], weq[32];
    __shared__ int s_out, s_eqseen;
    const int kh = blockIdx.x;
    const float *x = comb + (size_t)kh * n;
    int *out = sel + (size_t)kh * k;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_mask = 0;
        s_need = k;
    }
    __syncthreads();
    /* find the k-th largest key, 8 bits at a time from the top */
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        uint32_t prefix = s_prefix, mask = s_mask;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            uint32_t key = ord_key(x[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int need = s_need, b = 255;
            for (; b > 0; b--) {
                if ((int)hist[b] >= need) break;
                need -= (int)hist[b];
            }
            s_need = need; /* how many with this digit we still need */
            s_prefix = prefix | ((uint32_t)b << shift);
            s_mask = mask | (255u << shift);
        }
        __syncthreads();
    }
    const uint32_t thr = s_prefix;
    const int need_eq = s_need; /* equal-to-threshold elements to take, lowest index first */
    if (threadIdx.x == 0) {
        s_out = 0;
        s_eqseen = 0;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int i0 = 0; i0 < n; i0 += blockDim.x) {
        int i = i0 + threadIdx.x;
        uint32_t key = i < n ? ord_key(x[i]) : 0u;
        bool gt = i < n && key > thr, eq = i < n && key == thr;
        unsigned beq = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) weq[w] = __popc(beq);
        __syncthreads();
        int eq_before = s_eqseen;
        for (int j = 0; j < w; j++) eq_before += weq[j];
        eq_before += __popc(beq & ((1u << lane) - 1u));
        bool take = gt || (eq && eq_before < need_eq);
        unsigned bt = __ballot_sync(0xffffffffu, take);
        if (lane == 0) wcount[w] = __popc(bt);
        __syncthreads();
        int pos = s_out;
        for (int j = 0; j < w; j++) pos += wcount[j];
        pos += __popc(bt & ((1u << lane) - 1u));
        if (take && pos < k) out[pos] = base + i;
        __syncthreads();
        if (threadIdx.x == 0) {
            int a = 0, b = 0;
            for (int j = 0; j < (int)(blockDim.x >> 5); j++) {
                a += wcount[j];
                b += weq[j];
            }
            s_out += a;
            s_eqseen += b;
        }
        __syncthreads();
    }
}

extern "C" cudaError_t eng_topk(const float *comb, int nkv, int n, int k, int base, int *sel,
                                cudaStream_t s)
{
    if (k <= 0) return cudaSuccess;
    if (k > n) return cudaErrorInvalidValue;
    topk_kernel<<<nkv, TOPK_THREADS, 0, s>>>(comb, n, k, base, sel);
    ENG_LAUNCHED();
}

// --- gather of selected rows (zero-copy) -------------------------------------------

/* One warp per (head, row): a selected token's K and V, 2*hd fp16 values,
 * one contiguous run of host memory (or of the resident sink rows). */
__global__ void gather_kernel(const uint4 *rows, int nkv, int hd, const int *sel, int k,
                              const uint4 *sink, int nsink, uint4 *kdst, uint4 *vdst, size_t ld)
{
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.y;
    if (r >= k + nsink) return;
    const int nv = hd / 8;
    const uint4 *src = r < k ? rows + ((size_t)sel[(size_t)h * k + r] * nkv + h) * 2 * nv
                             : sink + ((size_t)(r - k) * nkv + h) * 2 * nv;
    for (int v = lane; v < 2 * nv; v += 32) {
        uint4 u = src[v];
        if (v < nv) kdst[((size_t)h * ld + r) * nv + v] = u;
        else vdst[((size_t)h * ld + r) * nv + (v - nv)] = u;
    }
}

extern "C" cudaError_t eng_gather_rows(const void *rows, int nkv, int hd, eng_dtype t,
                                       const int *sel, int k, const void *sink, int nsink,
                                       void *kdst, void *vdst, size_t ld, cudaStream_t s)
{
    if (t != ENG_F16 || (hd & 7)) return cudaErrorInvalidValue;
    if (k + nsink <= 0) return cudaSuccess;
    dim3 grid((unsigned)((k + nsink + 7) / 8), (unsigned)nkv);
    gather_kernel<<<grid, 256, 0, s>>>((const uint4 *)rows, nkv, hd, sel, k, (const uint4 *)sink,
                                       nsink, (uint4 *)kdst, (uint4 *)vdst, ld);
    ENG_LAUNCHED();
}
