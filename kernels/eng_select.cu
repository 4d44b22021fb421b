/*
 * eng_select: the token selection of sparse (TailorKV) layers on the GPU, the
 * same steps as lib/policy/kv_policy_sparse.c: critical channels from the
 * predicted query and the per-channel key maxima; approximate scores of the
 * candidate tokens from those channels (or from a resident 1-bit sketch of
 * every key, or exactly); per-head softmax over the candidates combined
 * over each KV head's group; top-K; and the gather of the chosen rows.
 * Candidate keys and rows live in mapped pinned host memory and are read
 * straight from it ("zero-copy"): the indices are on the device, so a copy
 * engine transfer would first need them on the host, a synchronisation in
 * the middle of every layer.  Host reads use 16-byte loads, and a gathered
 * row (one head's K and V, 2*hd*2 bytes) is one contiguous run.  The
 * indexes kept on the GPU (select=resident, select=pages) are in
 * eng_select_index.cu.
 */
#include "eng_select.cuh"

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
        float v = a * chmax[(size_t)kh * hd + c];
        cs[c] = v != v ? -INFINITY : v; /* NaN compares false both ways: every NaN channel
                                            had rank 0, more than C were chosen and pos ran
                                            past this head's C slots */
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
    KV_CHECK_ARGS(C >= 1 && C <= hd);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, select_channels_kernel, dim3(nkv), dim3(128),
                         (size_t)hd * sizeof(float), s, q, chmax, nq_heads / nkv, hd, C, chans,
                         qscale));
    return cudaSuccess;
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
                                          const void *kcm, kv_dtype t, int ldc, int nq_heads,
                                          int nkv, int hd, int C, int cs, int cend, float *score,
                                          cudaStream_t s)
{
    KV_CHECK_ARGS(t == KV_DT_F16 && (ldc & 7) == 0 && nq_heads / nkv <= SEL_MAXG);
    if (cend <= cs) return cudaSuccess;
    int g = nq_heads / nkv, base = cs & ~7;
    int threads8 = (cend - base + 7) / 8;
    dim3 grid((unsigned)((threads8 + 127) / 128), (unsigned)nkv);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, score_channels_kernel, grid, dim3(128),
                         (size_t)g * C * sizeof(float), s, q, chans, qscale, (const uint4 *)kcm,
                         ldc, g, hd, C, cs, cend, score));
    return cudaSuccess;
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

extern "C" cudaError_t eng_score_exact(const float *q, const void *rows, kv_dtype t, int nq_heads,
                                       int nkv, int hd, int cs, int cend, float *score,
                                       cudaStream_t s)
{
    KV_CHECK_ARGS(t == KV_DT_F16 && (hd & 7) == 0 && nq_heads / nkv <= SEL_MAXG);
    if (cend <= cs) return cudaSuccess;
    dim3 grid((unsigned)((cend - cs + 127) / 128), (unsigned)nkv);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, score_exact_kernel, grid, dim3(128), 0, s, q,
                         (const uint4 *)rows, nq_heads / nkv, nkv, hd, cs, cend, score));
    return cudaSuccess;
}

// --- scores from the resident 1-bit sketch --------------------------------------

/* Per head, a table of the sums of w_c = q_c*mad_c over the set bits of each
 * nibble position: tab (g, hd/4, 16).  score = 2*sum_{bits set} w - sum w. */
#define SK_PARTS_MAX 64 /* blocks per KV head of the sketch kernels */

/*
 * MODE 0 writes every query head's score (nq_heads, n).  MODE 1 and 2 fuse
 * the softmax over candidates and the GQA combination without writing
 * scores: MODE 1 writes each block's (max, sum exp) per head into part,
 * MODE 2 merges those, recomputes the scores (a 16-byte read and 32 table
 * lookups per token and head, cheaper than a float per head and token
 * written and read back twice) and writes comb (nkv, n).
 */
template <int G, int MODE>
__global__ void __launch_bounds__(256, (G <= 4 ? 2 : 1))
score_sketch_kernel(const float *q, const uint8_t *bits, int ldb, const float *mad, int g, int hd,
                    int cs, int cend, float *score, float *part, int reduce_max)
{
    extern __shared__ float tab[]; /* (g, hd/4, 16), then (g) totals, then (2g) max and 1/sum */
    __shared__ float red[32];
    const int kh = blockIdx.y, n = cend - cs, np = hd / 4, nb = hd / 8;
    float *tot = tab + (size_t)g * np * 16, *mz = tot + g;
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
    if (MODE == 2 && threadIdx.x < g) { /* merge the blocks' softmax statistics */
        const float *st = part + (size_t)(kh * g + threadIdx.x) * gridDim.x * 2;
        float M = -INFINITY, Z = 0.0f;
        for (unsigned b = 0; b < gridDim.x; b++) M = fmaxf(M, st[2 * b]);
        for (unsigned b = 0; b < gridDim.x; b++)
            if (st[2 * b] > -INFINITY) Z += st[2 * b + 1] * __expf(st[2 * b] - M);
        mz[2 * threadIdx.x] = M;
        mz[2 * threadIdx.x + 1] = Z > 0.0f ? 1.0f / Z : 0.0f;
    }
    __syncthreads();
    /* the constant term: half the sum of every nibble's all-set entry */
    for (int h = threadIdx.x; h < g; h += blockDim.x) {
        float s = 0.0f;
        for (int p = 0; p < np; p++) s += tab[(h * np + p) * 16 + 15];
        tot[h] = 0.5f * s;
    }
    __syncthreads();
    float om[G], ol[G]; /* MODE 1: this thread's running max and sum */
#pragma unroll
    for (int h = 0; h < G; h++) {
        om[h] = -INFINITY;
        ol[h] = 0.0f;
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const uint8_t *row = bits + ((size_t)kh * ldb + cs + i) * nb;
        float acc[G];
#pragma unroll
        for (int h = 0; h < G; h++) acc[h] = h < g ? -tot[h] : 0.0f;
        if (nb == 16) { /* head_dim 128: one 16-byte load, every index a constant */
            const uint4 u = *(const uint4 *)row;
            const uint32_t wv[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int wi = 0; wi < 4; wi++)
#pragma unroll
                for (int q4 = 0; q4 < 8; q4++) {
                    unsigned nib = (wv[wi] >> (4 * q4)) & 15u;
                    int p = wi * 8 + q4;
#pragma unroll
                    for (int h = 0; h < G; h++)
                        if (h < g) acc[h] += tab[(h * np + p) * 16 + nib];
                }
        } else {
            for (int b = 0; b < nb; b++) {
                unsigned by = row[b];
#pragma unroll
                for (int h = 0; h < G; h++)
                    if (h < g)
                        acc[h] += tab[(h * np + 2 * b) * 16 + (by & 15u)] +
                                  tab[(h * np + 2 * b + 1) * 16 + (by >> 4)];
            }
        }
        if (MODE == 0) {
#pragma unroll
            for (int h = 0; h < G; h++)
                if (h < g) score[(size_t)(kh * g + h) * n + i] = acc[h];
        } else if (MODE == 1) {
#pragma unroll
            for (int h = 0; h < G; h++)
                if (h < g) {
                    if (acc[h] > om[h]) {
                        ol[h] = ol[h] * __expf(om[h] - acc[h]) + 1.0f;
                        om[h] = acc[h];
                    } else {
                        ol[h] += __expf(acc[h] - om[h]);
                    }
                }
        } else {
            float c = 0.0f;
#pragma unroll
            for (int h = 0; h < G; h++)
                if (h < g) {
                    float pr = __expf(acc[h] - mz[2 * h]) * mz[2 * h + 1];
                    c = reduce_max ? fmaxf(c, pr) : c + pr;
                }
            score[(size_t)kh * n + i] = c; /* comb */
        }
    }
    if (MODE == 1) {
#pragma unroll
        for (int h = 0; h < G; h++) {
            if (h >= g) break; /* uniform */
            float M = eng_block_max(om[h], red);
            float l = om[h] > -INFINITY ? ol[h] * __expf(om[h] - M) : 0.0f;
            l = eng_block_sum(l, red);
            if (threadIdx.x == 0) {
                size_t o = ((size_t)(kh * g + h) * gridDim.x + blockIdx.x) * 2;
                part[o] = M;
                part[o + 1] = l;
            }
        }
    }
}

template <int MODE>
static cudaError_t launch_sketch(const float *q, const uint8_t *bits, int ldb, const float *mad,
                                 int nq_heads, int nkv, int hd, int cs, int cend, float *out,
                                 float *part, int reduce_max, cudaStream_t s)
{
    KV_CHECK_ARGS((hd & 7) == 0 && nq_heads / nkv <= SEL_MAXG);
    int g = nq_heads / nkv;
    size_t smem = ((size_t)g * (hd / 4) * 16 + 3 * (size_t)g) * sizeof(float);
    KV_CHECK_ARGS(smem <= 48 * 1024); /* hd 256 with g 8 at most: 33 KB */
    /* at most SK_PARTS_MAX blocks per head: each builds its lookup table once
     * and scores many tokens with it */
    int nb = (cend - cs + 255) / 256;
    dim3 grid((unsigned)(nb < SK_PARTS_MAX ? nb : SK_PARTS_MAX), (unsigned)nkv);
    /* the group size as a template bound keeps the accumulators in registers */
    if (g <= 2)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, score_sketch_kernel<2, MODE>, grid, dim3(256), smem, s, q,
                             bits, ldb, mad, g, hd, cs, cend, out, part, reduce_max));
    else if (g <= 4)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, score_sketch_kernel<4, MODE>, grid, dim3(256), smem, s, q,
                             bits, ldb, mad, g, hd, cs, cend, out, part, reduce_max));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, score_sketch_kernel<8, MODE>, grid, dim3(256), smem, s, q,
                             bits, ldb, mad, g, hd, cs, cend, out, part, reduce_max));
    return cudaSuccess;
}

extern "C" cudaError_t eng_score_sketch(const float *q, const uint8_t *bits, int ldb,
                                        const float *mad, int nq_heads, int nkv, int hd, int cs,
                                        int cend, float *score, cudaStream_t s)
{
    if (cend <= cs) return cudaSuccess;
    return launch_sketch<0>(q, bits, ldb, mad, nq_heads, nkv, hd, cs, cend, score, NULL, 0, s);
}

extern "C" cudaError_t eng_sketch_combine(const float *q, const uint8_t *bits, int ldb,
                                          const float *mad, int nq_heads, int nkv, int hd, int cs,
                                          int cend, int reduce_max, float *tmp, float *comb,
                                          cudaStream_t s)
{
    if (cend <= cs) return cudaSuccess;
    CUDA_CHECK(launch_sketch<1>(q, bits, ldb, mad, nq_heads, nkv, hd, cs, cend, NULL, tmp, 0, s));
    return launch_sketch<2>(q, bits, ldb, mad, nq_heads, nkv, hd, cs, cend, comb, tmp, reduce_max, s);
}

// --- softmax over candidates, combined over the group ------------------------------

/* Partial (max, sum of exp) of each query head's scores over SM_PARTS
 * slices, so that the pass over the candidates uses many blocks. */
#define SM_PARTS 16

__global__ void softmax_stats_kernel(const float *score, int n, float *stats)
{
    __shared__ float red[32];
    const int qh = blockIdx.y, part = blockIdx.x;
    const int len = (n + SM_PARTS - 1) / SM_PARTS, i0 = part * len, i1 = min(n, i0 + len);
    const float *s = score + (size_t)qh * n;
    float m = -INFINITY;
    for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) m = fmaxf(m, s[i]);
    m = eng_block_max(m, red);
    float l = 0.0f; /* a NaN score weighs 0 (fmaxf skipped it above), as on the CPU */
    if (m > -INFINITY)
        for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x)
            if (s[i] == s[i]) l += __expf(s[i] - m);
    l = eng_block_sum(l, red);
    if (threadIdx.x == 0) {
        stats[((size_t)qh * SM_PARTS + part) * 2] = m;
        stats[((size_t)qh * SM_PARTS + part) * 2 + 1] = l;
    }
}

__global__ void combine_kernel(const float *score, int g, int n, int reduce_max,
                               const float *stats, float *comb)
{
    __shared__ float mz[2 * SEL_MAXG]; /* per head of the group: max, 1/sum */
    const int kh = blockIdx.y;
    if (threadIdx.x < g) {
        const float *st = stats + (size_t)(kh * g + threadIdx.x) * SM_PARTS * 2;
        float M = -INFINITY, Z = 0.0f;
        for (int p = 0; p < SM_PARTS; p++) M = fmaxf(M, st[2 * p]);
        for (int p = 0; p < SM_PARTS; p++)
            if (st[2 * p] > -INFINITY) Z += st[2 * p + 1] * __expf(st[2 * p] - M);
        mz[2 * threadIdx.x] = M;
        mz[2 * threadIdx.x + 1] = Z > 0.0f ? 1.0f / Z : 0.0f;
    }
    __syncthreads();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float acc = 0.0f;
    for (int h = 0; h < g; h++) {
        int qh = kh * g + h;
        float p = __expf(score[(size_t)qh * n + i] - mz[2 * h]) * mz[2 * h + 1];
        acc = reduce_max ? fmaxf(acc, p) : acc + p;
    }
    comb[(size_t)kh * n + i] = acc;
}

extern "C" size_t eng_softmax_tmp(int nq_heads)
{
    int parts = SM_PARTS > SK_PARTS_MAX ? SM_PARTS : SK_PARTS_MAX;
    return (size_t)nq_heads * parts * 2;
}

extern "C" cudaError_t eng_softmax_combine(const float *score, int nq_heads, int nkv, int n,
                                           int reduce_max, float *tmp, float *comb,
                                           cudaStream_t s)
{
    if (n <= 0) return cudaSuccess;
    KV_CHECK_ARGS(nq_heads / nkv <= SEL_MAXG);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, softmax_stats_kernel, dim3(SM_PARTS, (unsigned)nq_heads),
                         dim3(512), 0, s, score, n, tmp));
    dim3 grid((unsigned)((n + 255) / 256), (unsigned)nkv);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, combine_kernel, grid, dim3(256), 0, s, score, nq_heads / nkv,
                         n, reduce_max, tmp, comb));
    return cudaSuccess;
}

// --- top-K: radix select then an ordered compaction -------------------------------

#define TOPK_THREADS 1024
#define TOPK_WARPS (TOPK_THREADS / 32)

/* Thread 0 of a radix-select pass: the bin of the need-th largest key at
 * the digit `shift`, given the histogram of the keys that match the prefix
 * so far; narrows prefix and mask and leaves what is still needed. */
static __device__ void radix_pick(const unsigned *hist, int shift, uint32_t prefix, uint32_t mask,
                                  int *need_io, uint32_t *prefix_out, uint32_t *mask_out)
{
    int need = *need_io, b = 255;
    for (; b > 0; b--) {
        if ((int)hist[b] >= need) break;
        need -= (int)hist[b];
    }
    *need_io = need;
    *prefix_out = prefix | ((uint32_t)b << shift);
    *mask_out = mask | (255u << shift);
}

/*
 * One chunk of an ordered output pass, called by every thread of the block
 * with its own element: ids above the threshold (gt) and the first need_eq
 * equal ones (eq), in the order of the threads, go to out at their rank
 * (block-wide prefix counts); out_base / eq_base count what earlier chunks
 * placed.  wt, we: (TOPK_WARPS) and tot: (2) ints of shared scratch.
 */
static __device__ void place_ordered(bool gt, bool eq, int id, int need_eq, int k, int *out,
                                     int *wt, int *we, int *tot, int &out_base, int &eq_base)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    unsigned bgt = __ballot_sync(0xffffffffu, gt), beq = __ballot_sync(0xffffffffu, eq);
    __syncthreads(); /* the scratch's readers of the last chunk are done */
    if (lane == 0) {
        wt[w] = __popc(bgt);
        we[w] = __popc(beq);
    }
    __syncthreads();
    if (w == 0) { /* exclusive prefix over the warps, in place */
        int a = lane < TOPK_WARPS ? wt[lane] : 0, c = lane < TOPK_WARPS ? we[lane] : 0;
        int ia = a, ic = c;
        for (int o = 1; o < 32; o <<= 1) {
            int ta = __shfl_up_sync(0xffffffffu, ia, o), tc = __shfl_up_sync(0xffffffffu, ic, o);
            if (lane >= o) {
                ia += ta;
                ic += tc;
            }
        }
        if (lane < TOPK_WARPS) {
            wt[lane] = ia - a;
            we[lane] = ic - c;
        }
        if (lane == 31) {
            tot[0] = ia;
            tot[1] = ic;
        }
    }
    __syncthreads();
    /* position = greater ids before this one + equal ids taken before it */
    int eq_before = eq_base + we[w] + __popc(beq & ((1u << lane) - 1u));
    int gt_before = out_base + wt[w] + __popc(bgt & ((1u << lane) - 1u));
    int pos = gt_before + min(eq_before, need_eq);
    if ((gt || (eq && eq_before < need_eq)) && pos < k) out[pos] = id;
    out_base += tot[0];
    eq_base += tot[1];
}

/*
 * One block per KV head: the k-th largest key by radix select (8 bits per
 * pass, from the top), then one ordered pass writing the chosen ids: those
 * above the threshold and the first ones equal to it (lowest index first),
 * positions from a block-wide prefix count.  The scores sit in L2; each
 * thread issues TOPK_ILP independent loads before using any, or every
 * pass would wait one L2 latency per 4 KB.
 */
#define TOPK_ILP 16

static __device__ void topk_radix(const float *comb, int n, int k, int base, int *sel)
{
    __shared__ unsigned hist[256];
    __shared__ uint32_t s_prefix, s_mask;
    __shared__ int s_need;
    __shared__ int wtake[TOPK_WARPS], weq[TOPK_WARPS], s_tot[2];
    const int kh = blockIdx.x;
    const float *x = comb + (size_t)kh * n;
    int *out = sel + (size_t)kh * k;
    const int span = TOPK_THREADS * TOPK_ILP;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_mask = 0;
        s_need = k;
    }
    __syncthreads();
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        uint32_t prefix = s_prefix, mask = s_mask;
        for (int i0 = 0; i0 < n; i0 += span) { /* uniform trip count for the warp ops */
            uint32_t key[TOPK_ILP];
#pragma unroll
            for (int j = 0; j < TOPK_ILP; j++) {
                int i = i0 + j * TOPK_THREADS + threadIdx.x;
                key[j] = i < n ? ord_key(x[i]) : 0u;
            }
#pragma unroll
            for (int j = 0; j < TOPK_ILP; j++) {
                int i = i0 + j * TOPK_THREADS + threadIdx.x;
                hist_add(hist, (key[j] >> shift) & 255u, i < n && (key[j] & mask) == prefix);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) radix_pick(hist, shift, prefix, mask, &s_need, &s_prefix, &s_mask);
        __syncthreads();
    }
    const uint32_t thr = s_prefix;
    const int need_eq = s_need;
    int out_base = 0, eq_base = 0; /* greater / equal keys before the chunk (every thread) */
    for (int i0 = 0; i0 < n; i0 += span) {
        uint32_t key[TOPK_ILP];
#pragma unroll
        for (int j = 0; j < TOPK_ILP; j++) {
            int i = i0 + j * TOPK_THREADS + threadIdx.x;
            key[j] = i < n ? ord_key(x[i]) : 0u;
        }
        for (int j = 0; j < TOPK_ILP; j++) { /* chunks of TOPK_THREADS, in index order */
            int i = i0 + j * TOPK_THREADS + threadIdx.x;
            if (i0 + j * TOPK_THREADS >= n) break; /* uniform */
            bool gt = i < n && key[j] > thr, eq = i < n && key[j] == thr;
            if (!__syncthreads_or(gt || eq)) continue; /* most chunks hold none of the k */
            place_ordered(gt, eq, base + i, need_eq, k, out, wtake, weq, s_tot, out_base, eq_base);
        }
    }
}

__global__ void __launch_bounds__(TOPK_THREADS)
topk_radix_kernel(const float *comb, int n, int k, int base, int *sel)
{
    topk_radix(comb, n, k, base, sel);
}

/*
 * Sample select, the fast path when k is small against n, with no sorting:
 *  1. a threshold t just below the expected k-th largest score: the r-th
 *     largest of a strided sample of one score per thread (r for twice
 *     oversampling), by radix select over the sample in shared memory;
 *  2. each warp owns a contiguous segment of the scores: it counts its
 *     scores >= t, a block scan of the 32 counts places the segments, and a
 *     second pass copies every candidate (key, index) into shared memory in
 *     index order (ballot compaction inside the warp);
 *  3. radix select over the candidates gives the exact k-th largest key and
 *     how many equal keys are needed; one ordered pass over the candidates
 *     writes the ids above it and the first (lowest-index) equal ones, which
 *     come out ascending.
 * When the sample misjudges (fewer than k or more than TOPK_CAP candidates)
 * the block falls back to the radix select over all scores, so the result is
 * always the exact top k with ties to the lower index.  (The previous
 * version sorted the sample, the candidates and the ids with bitonic sorts,
 * about 190 block-wide barriers; this one needs about 30.)
 */
#define TOPK_CAP 8192

/*
 * The r-th largest (1-based) of the m keys in shared memory, by 8-bit radix
 * passes; *n_gt: how many keys are larger.  Every thread of the block calls
 * it and gets the result.
 */
static __device__ uint32_t block_kth(const uint32_t *key, int m, int r, unsigned *hist, int *n_gt)
{
    __shared__ uint32_t s_prefix, s_mask;
    __shared__ int s_need;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_mask = 0;
        s_need = r;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        __syncthreads();
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const uint32_t prefix = s_prefix, mask = s_mask;
        for (int i0 = 0; i0 < m; i0 += blockDim.x) { /* uniform trip count for the warp ops */
            int i = i0 + threadIdx.x;
            uint32_t kk = i < m ? key[i] : 0u;
            hist_add(hist, (kk >> shift) & 255u, i < m && (kk & mask) == prefix);
        }
        __syncthreads();
        if (threadIdx.x == 0) radix_pick(hist, shift, prefix, mask, &s_need, &s_prefix, &s_mask);
    }
    __syncthreads();
    *n_gt = r - s_need;
    return s_prefix;
}

/* A warp's TOPK_ILP keys of its segment from i0 (lane-strided; 0 past s1),
 * every load issued before any is used. */
static __device__ __forceinline__ void warp_keys(const float *x, int i0, int s1, int lane,
                                                 uint32_t (&kk)[TOPK_ILP])
{
#pragma unroll
    for (int j = 0; j < TOPK_ILP; j++) {
        int i = i0 + 32 * j + lane;
        kk[j] = i < s1 ? ord_key(x[i]) : 0u;
    }
}

__global__ void __launch_bounds__(TOPK_THREADS)
topk_kernel(const float *comb, int n, int k, int base, int *sel)
{
    extern __shared__ uint32_t tk_key[]; /* (TOPK_CAP) keys, then (TOPK_CAP) ids */
    int *tk_idx = (int *)(tk_key + TOPK_CAP);
    __shared__ unsigned hist[256];
    __shared__ int wcnt[TOPK_WARPS], weq[TOPK_WARPS], s_tot[2];
    const int kh = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const float *x = comb + (size_t)kh * n;
    int *out = sel + (size_t)kh * k;
    int n_gt;
    /* 1. threshold from a sample (or none when every score fits) */
    uint32_t thr = 0u;
    if (n > TOPK_CAP) {
        const size_t stride = (size_t)n / TOPK_THREADS;
        tk_key[threadIdx.x] = ord_key(x[(size_t)threadIdx.x * stride]);
        long r = 2L * k * TOPK_THREADS / n + 8;
        thr = block_kth(tk_key, TOPK_THREADS, (int)(r < TOPK_THREADS ? r : TOPK_THREADS), hist, &n_gt);
    }
    /* 2. candidates >= thr, in index order */
    const int seg = (n + TOPK_WARPS - 1) / TOPK_WARPS, s0 = w * seg, s1 = min(n, s0 + seg);
    int c = 0;
    for (int i0 = s0; i0 < s1; i0 += 32 * TOPK_ILP) {
        uint32_t kk[TOPK_ILP];
        warp_keys(x, i0, s1, lane, kk);
#pragma unroll
        for (int j = 0; j < TOPK_ILP; j++) c += i0 + 32 * j + lane < s1 && kk[j] >= thr;
    }
    c = eng_warp_sum_int(c);
    if (lane == 0) wcnt[w] = c;
    __syncthreads();
    if (w == 0) { /* exclusive prefix over the warps, in place */
        int a = lane < TOPK_WARPS ? wcnt[lane] : 0, ia = a;
        for (int o = 1; o < 32; o <<= 1) {
            int t = __shfl_up_sync(0xffffffffu, ia, o);
            if (lane >= o) ia += t;
        }
        if (lane < TOPK_WARPS) wcnt[lane] = ia - a;
        if (lane == 31) s_tot[0] = ia;
    }
    __syncthreads();
    const int cnt = s_tot[0];
    if (cnt < k || cnt > TOPK_CAP) { /* the sample misjudged: exact radix select */
        topk_radix(comb, n, k, base, sel);
        return;
    }
    int at = wcnt[w];
    for (int i0 = s0; i0 < s1; i0 += 32 * TOPK_ILP) {
        uint32_t kk[TOPK_ILP];
        warp_keys(x, i0, s1, lane, kk);
#pragma unroll
        for (int j = 0; j < TOPK_ILP; j++) {
            int i = i0 + 32 * j + lane;
            bool take = i < s1 && kk[j] >= thr;
            unsigned b = __ballot_sync(0xffffffffu, take);
            if (take) {
                int slot = at + __popc(b & ((1u << lane) - 1u));
                tk_key[slot] = kk[j];
                tk_idx[slot] = i;
            }
            at += __popc(b);
        }
    }
    __syncthreads();
    /* 3. the exact k-th key among the candidates, then the ordered pass */
    const uint32_t kth = block_kth(tk_key, cnt, k, hist, &n_gt);
    const int need_eq = k - n_gt;
    int out_base = 0, eq_base = 0;
    for (int i0 = 0; i0 < cnt; i0 += TOPK_THREADS) { /* uniform */
        int i = i0 + threadIdx.x;
        uint32_t kk = i < cnt ? tk_key[i] : 0u;
        bool gt = i < cnt && kk > kth, eq = i < cnt && kk == kth;
        place_ordered(gt, eq, i < cnt ? base + tk_idx[i] : 0, need_eq, k, out, wcnt, weq, s_tot,
                      out_base, eq_base);
    }
}

extern "C" cudaError_t eng_topk(const float *comb, int nkv, int n, int k, int base, int *sel,
                                cudaStream_t s)
{
    if (k <= 0) return cudaSuccess;
    KV_CHECK_ARGS(k <= n);
    if (k > TOPK_CAP / 2) { /* the sample path is for k small against the candidates it keeps */
        CUDA_CHECK(kv_launch(KV_PDL_NONE, topk_radix_kernel, dim3(nkv), dim3(TOPK_THREADS), 0, s,
                             comb, n, k, base, sel));
        return cudaSuccess;
    }
    size_t smem = (size_t)2 * TOPK_CAP * sizeof(uint32_t);
    static int attr_set = -1; /* per process; the engine uses one device */
    if (attr_set < 0) {
        CUDA_CHECK(cudaFuncSetAttribute(topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        attr_set = 1;
    }
    CUDA_CHECK(kv_launch(KV_PDL_NONE, topk_kernel, dim3(nkv), dim3(TOPK_THREADS), smem, s, comb, n,
                         k, base, sel));
    return cudaSuccess;
}

// --- top-K over many blocks per KV head ---------------------------------------------

/*
 * eng_topk's sample-select with its pass over the scores spread over
 * TW_SEG blocks per KV head, so that it fits beside the main stream's
 * kernels (one 1024-thread block per head waits for a whole free SM):
 *  1. tw_thr: per head, the threshold from a strided sample (block_kth), as
 *     topk_kernel's step 1 (none when every score fits TOPK_CAP);
 *  2. tw_count: each segment's scores >= thr;
 *  3. tw_compact: each segment writes its candidates (key, index) in index
 *     order at the prefix of the earlier segments' counts;
 *  4. tw_final: per head, the exact k-th key among the candidates and the
 *     ordered placement (topk_kernel's step 3), or the radix select over all
 *     scores when the sample misjudged (fewer than k or more than TOPK_CAP).
 * Workspace per head: thr, TW_SEG counts, TOPK_CAP keys and indices.
 */
#define TW_SEG 32
#define TW_THREADS 256

typedef struct {
    uint32_t thr;
    int cnt[TW_SEG];
    uint32_t key[TOPK_CAP];
    int idx[TOPK_CAP];
} tw_head;

extern "C" size_t eng_topk_wide_ws(int nkv) { return (size_t)nkv * sizeof(tw_head); }

__global__ void __launch_bounds__(TOPK_THREADS) tw_thr_kernel(const float *comb, int n, int k,
                                                              tw_head *ws)
{
    __shared__ uint32_t sk[TOPK_THREADS];
    __shared__ unsigned hist[256];
    const int kh = blockIdx.x;
    const float *x = comb + (size_t)kh * n;
    uint32_t thr = 0u;
    if (n > TOPK_CAP) { /* uniform */
        const size_t stride = (size_t)n / TOPK_THREADS;
        sk[threadIdx.x] = ord_key(x[(size_t)threadIdx.x * stride]);
        long r = 2L * k * TOPK_THREADS / n + 8;
        int n_gt;
        thr = block_kth(sk, TOPK_THREADS, (int)(r < TOPK_THREADS ? r : TOPK_THREADS), hist, &n_gt);
    }
    if (threadIdx.x == 0) ws[kh].thr = thr;
}

__global__ void __launch_bounds__(TW_THREADS) tw_count_kernel(const float *comb, int n, tw_head *ws)
{
    __shared__ int red[TW_THREADS / 32];
    const int kh = blockIdx.y, sg = blockIdx.x;
    const int seg = (n + TW_SEG - 1) / TW_SEG, i0 = sg * seg, i1 = min(n, i0 + seg);
    const float *x = comb + (size_t)kh * n;
    const uint32_t thr = ws[kh].thr;
    int c = 0;
    for (int i = i0 + threadIdx.x; i < i1; i += TW_THREADS) c += ord_key(x[i]) >= thr;
    c = eng_warp_sum_int(c);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        int t = 0;
        for (int w = 0; w < TW_THREADS / 32; w++) t += red[w];
        ws[kh].cnt[sg] = t;
    }
}

__global__ void __launch_bounds__(TW_THREADS) tw_compact_kernel(const float *comb, int n, int k,
                                                                tw_head *ws)
{
    __shared__ int wt[TW_THREADS / 32], s_at, s_tot;
    const int kh = blockIdx.y, sg = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int seg = (n + TW_SEG - 1) / TW_SEG, i0 = sg * seg, i1 = min(n, i0 + seg);
    tw_head *hw = ws + kh;
    if (threadIdx.x == 0) {
        int at = 0, tot = 0;
        for (int b = 0; b < TW_SEG; b++) {
            if (b < sg) at += hw->cnt[b];
            tot += hw->cnt[b];
        }
        s_at = at;
        s_tot = tot;
    }
    __syncthreads();
    if (s_tot < k || s_tot > TOPK_CAP) return; /* tw_final takes the radix path */
    const float *x = comb + (size_t)kh * n;
    const uint32_t thr = hw->thr;
    int at = s_at;
    for (int c0 = i0; c0 < i1; c0 += TW_THREADS) { /* uniform trip count */
        int i = c0 + threadIdx.x;
        uint32_t kk = i < i1 ? ord_key(x[i]) : 0u;
        bool take = i < i1 && kk >= thr;
        unsigned b = __ballot_sync(0xffffffffu, take);
        if (lane == 0) wt[w] = __popc(b);
        __syncthreads();
        int before = 0, all = 0;
        for (int v = 0; v < TW_THREADS / 32; v++) {
            before += v < w ? wt[v] : 0;
            all += wt[v];
        }
        if (take) {
            int slot = at + before + __popc(b & ((1u << lane) - 1u));
            hw->key[slot] = kk;
            hw->idx[slot] = i;
        }
        at += all;
        __syncthreads(); /* wt is rewritten by the next chunk */
    }
}

__global__ void __launch_bounds__(TOPK_THREADS) tw_final_kernel(const float *comb, int n, int k,
                                                                int base, int *sel,
                                                                const tw_head *ws)
{
    extern __shared__ uint32_t tk_key[]; /* (TOPK_CAP) keys, then (TOPK_CAP) ids */
    int *tk_idx = (int *)(tk_key + TOPK_CAP);
    __shared__ unsigned hist[256];
    __shared__ int wcnt[TOPK_WARPS], weq[TOPK_WARPS], s_tot[2];
    const int kh = blockIdx.x;
    const tw_head *hw = ws + kh;
    int cnt = 0;
    for (int b = 0; b < TW_SEG; b++) cnt += hw->cnt[b];
    if (cnt < k || cnt > TOPK_CAP) { /* the sample misjudged: exact radix select */
        topk_radix(comb, n, k, base, sel);
        return;
    }
    int *out = sel + (size_t)kh * k;
    for (int i = threadIdx.x; i < cnt; i += TOPK_THREADS) {
        tk_key[i] = hw->key[i];
        tk_idx[i] = hw->idx[i];
    }
    __syncthreads();
    int n_gt;
    const uint32_t kth = block_kth(tk_key, cnt, k, hist, &n_gt);
    const int need_eq = k - n_gt;
    int out_base = 0, eq_base = 0;
    for (int i0 = 0; i0 < cnt; i0 += TOPK_THREADS) { /* uniform */
        int i = i0 + threadIdx.x;
        uint32_t kk = i < cnt ? tk_key[i] : 0u;
        bool gt = i < cnt && kk > kth, eq = i < cnt && kk == kth;
        place_ordered(gt, eq, i < cnt ? base + tk_idx[i] : 0, need_eq, k, out, wcnt, weq, s_tot,
                      out_base, eq_base);
    }
}

extern "C" cudaError_t eng_topk_wide(const float *comb, int nkv, int n, int k, int base, int *sel,
                                     void *ws, cudaStream_t s)
{
    if (k <= 0) return cudaSuccess;
    KV_CHECK_ARGS(k <= n && ws != NULL);
    if (k > TOPK_CAP / 2) return eng_topk(comb, nkv, n, k, base, sel, s);
    tw_head *hw = (tw_head *)ws;
    size_t smem = (size_t)2 * TOPK_CAP * sizeof(uint32_t);
    static int attr_set = -1; /* per process; the engine uses one device */
    if (attr_set < 0) {
        CUDA_CHECK(cudaFuncSetAttribute(tw_final_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        attr_set = 1;
    }
    CUDA_CHECK(kv_launch(KV_PDL_NONE, tw_thr_kernel, dim3(nkv), dim3(TOPK_THREADS), 0, s, comb, n, k,
                         hw));
    CUDA_CHECK(kv_launch(KV_PDL_NONE, tw_count_kernel, dim3(TW_SEG, nkv), dim3(TW_THREADS), 0, s,
                         comb, n, hw));
    CUDA_CHECK(kv_launch(KV_PDL_NONE, tw_compact_kernel, dim3(TW_SEG, nkv), dim3(TW_THREADS), 0, s,
                         comb, n, k, hw));
    CUDA_CHECK(kv_launch(KV_PDL_NONE, tw_final_kernel, dim3(nkv), dim3(TOPK_THREADS), smem, s, comb,
                         n, k, base, sel, (const tw_head *)hw));
    return cudaSuccess;
}

// --- gather of selected rows (zero-copy) -------------------------------------------

/* A warp copies GATHER_ROWS rows of one head: a selected token's K and V,
 * 2*hd fp16 values, one contiguous run of host memory (or of the resident
 * sink rows).  Each lane has one 16-byte load of every row in flight before
 * it stores any, so a warp keeps GATHER_ROWS PCIe reads outstanding rather
 * than one: the gather runs beside the main stream's kernels, which hold
 * most of the SMs, and the few warps it gets must cover PCIe's latency. */
#define GATHER_ROWS 8

__global__ void gather_kernel(const uint4 *rows, int nkv, int hd, const int *sel, int k,
                              const uint4 *sink, int nsink, uint4 *kdst, uint4 *vdst, size_t ld)
{
    const int lane = threadIdx.x & 31, h = blockIdx.y, nr = k + nsink;
    const int step = (int)(gridDim.x * blockDim.x >> 5) * GATHER_ROWS; /* a narrow grid loops */
    for (int r0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * GATHER_ROWS; r0 < nr; r0 += step) {
        const int nv = hd / 8;
        const uint4 *src[GATHER_ROWS];
#pragma unroll
        for (int j = 0; j < GATHER_ROWS; j++) {
            int r = r0 + j;
            src[j] = r >= nr ? NULL
                     : r < k ? rows + ((size_t)sel[(size_t)h * k + r] * nkv + h) * 2 * nv
                             : sink + ((size_t)(r - k) * nkv + h) * 2 * nv;
        }
        for (int v = lane; v < 2 * nv; v += 32) {
            uint4 u[GATHER_ROWS];
#pragma unroll
            for (int j = 0; j < GATHER_ROWS; j++)
                if (src[j]) u[j] = src[j][v];
#pragma unroll
            for (int j = 0; j < GATHER_ROWS; j++) {
                if (!src[j]) continue;
                size_t o = (size_t)h * ld + (size_t)(r0 + j);
                if (v < nv) kdst[o * nv + v] = u[j];
                else vdst[o * nv + (v - nv)] = u[j];
            }
        }
    }
}

extern "C" cudaError_t eng_gather_rows(const void *rows, int nkv, int hd, kv_dtype t,
                                       const int *sel, int k, const void *sink, int nsink,
                                       void *kdst, void *vdst, size_t ld, cudaStream_t s)
{
    return eng_gather_rows_w(rows, nkv, hd, t, sel, k, sink, nsink, kdst, vdst, ld, 0, s);
}

extern "C" cudaError_t eng_gather_rows_w(const void *rows, int nkv, int hd, kv_dtype t,
                                         const int *sel, int k, const void *sink, int nsink,
                                         void *kdst, void *vdst, size_t ld, int blocks, cudaStream_t s)
{
    KV_CHECK_ARGS(t == KV_DT_F16 && (hd & 7) == 0);
    if (k + nsink <= 0) return cudaSuccess;
    const int per_block = 8 * GATHER_ROWS; /* 8 warps */
    int nb = (k + nsink + per_block - 1) / per_block;
    if (blocks > 0 && blocks < nb) nb = blocks;
    dim3 grid((unsigned)nb, (unsigned)nkv);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, gather_kernel, grid, dim3(256), 0, s, (const uint4 *)rows,
                         nkv, hd, sel, k, (const uint4 *)sink, nsink, (uint4 *)kdst, (uint4 *)vdst,
                         ld));
    return cudaSuccess;
}

// --- selection cache: only the chosen rows not already held cross PCIe ---------------

/* Tags of a fresh cache: row r of each head holds token first_tok + (r -
 * first_row) from first_row on (the prompt's tail, in place), nothing
 * before it. */
__global__ void sel_cache_reset_kernel(int *tag, int ntag, int first_row, int first_tok)
{
    const int h = blockIdx.y;
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < ntag; r += gridDim.x * blockDim.x)
        tag[(size_t)h * ntag + r] = r >= first_row ? first_tok + (r - first_row) : -1;
}

extern "C" cudaError_t eng_sel_cache_reset(int *tag, int nkv, int ntag, int first_row, int first_tok,
                                           cudaStream_t s)
{
    if (ntag <= 0) return cudaSuccess;
    unsigned bx = (unsigned)((ntag + 255) / 256);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, sel_cache_reset_kernel, dim3(bx < 64 ? bx : 64, (unsigned)nkv),
                         dim3(256), 0, s, tag, ntag, first_row, first_tok));
    return cudaSuccess;
}

#define SC_THREADS 256

/* Ordered compaction of one chunk of SC_THREADS flags: each taken thread
 * gets its rank among the taken ones so far (*base counts earlier chunks). */
static __device__ int sc_rank(bool take, int *wcnt, int &base)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    unsigned b = __ballot_sync(0xffffffffu, take);
    __syncthreads();
    if (lane == 0) wcnt[w] = __popc(b);
    __syncthreads();
    int before = 0, all = 0;
    for (int v = 0; v < SC_THREADS / 32; v++) {
        before += v < w ? wcnt[v] : 0;
        all += wcnt[v];
    }
    int r = base + before + __popc(b & ((1u << lane) - 1u));
    base += all;
    return r;
}

/*
 * One block per KV head.  Wanted: the ns sink tokens 0..ns-1, then the k
 * chosen ids sel (ascending, all >= ns): m = ns + k tokens, to be held in
 * rows [r0, r0 + m).  A region row whose tag is a wanted token keeps it
 * (the first such row, when two hold the same token); the other rows are
 * free, and the wanted tokens held nowhere (the misses), in order, go to
 * the free rows in order.  plan (nkv, 1 + 2*mcap): the count of misses,
 * then (token, row) pairs; the tags are updated; stat (nkv, 4) adds hits,
 * rows, and host-row misses (tokens >= ns) to [0], [1], [3] and sets [2]
 * to this step's host-row misses.
 */
__global__ void __launch_bounds__(SC_THREADS)
sel_cache_plan_kernel(const int *sel, int k, int ns, int *tag, int ntag, int r0, int mcap,
                      int *plan, unsigned long long *stat)
{
    extern __shared__ int sm[]; /* want (m), held (m), keep (m) */
    __shared__ int wcnt[SC_THREADS / 32];
    const int h = blockIdx.x, m = ns + k;
    int *want = sm, *held = sm + m, *keep = sm + 2 * m;
    int *tg = tag + (size_t)h * ntag, *pl = plan + (size_t)h * (1 + 2 * (size_t)mcap);
    for (int i = threadIdx.x; i < m; i += SC_THREADS) {
        want[i] = i < ns ? i : sel[(size_t)h * k + (i - ns)];
        held[i] = 0;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < m; j += SC_THREADS) {
        const int r = r0 + j, t = r < ntag ? tg[r] : -1;
        int lo = 0, hi = m - 1, at = -1;
        while (t >= 0 && lo <= hi) { /* want is ascending */
            int mid = (lo + hi) >> 1, v = want[mid];
            if (v == t) { at = mid; break; }
            if (v < t) lo = mid + 1;
            else hi = mid - 1;
        }
        keep[j] = at >= 0 && atomicCAS(&held[at], 0, 1) == 0;
    }
    __syncthreads();
    /* the free rows, in order, into keep's slots (rank r -> row index) */
    int base = 0;
    for (int j0 = 0; j0 < m; j0 += SC_THREADS) { /* uniform trip count */
        int j = j0 + threadIdx.x;
        bool fr = j < m && !keep[j];
        int rk = sc_rank(fr, wcnt, base);
        __syncthreads(); /* every keep[] of the chunk read before it is overwritten */
        if (fr) keep[rk] = j; /* rk <= j: slots below j of this chunk are read already */
    }
    __syncthreads();
    const int nfree = base;
    base = 0;
    int host = 0;
    for (int i0 = 0; i0 < m; i0 += SC_THREADS) {
        int i = i0 + threadIdx.x;
        bool miss = i < m && !held[i];
        int rk = sc_rank(miss, wcnt, base);
        if (miss && rk < nfree) {
            const int t = want[i], row = r0 + keep[rk];
            pl[1 + 2 * rk] = t;
            pl[2 + 2 * rk] = row;
            if (row < ntag) tg[row] = t;
            host += t >= ns;
        }
    }
    host = eng_warp_sum_int(host);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) wcnt[threadIdx.x >> 5] = host;
    __syncthreads();
    if (threadIdx.x == 0) {
        int hm = 0;
        for (int v = 0; v < SC_THREADS / 32; v++) hm += wcnt[v];
        const int nmiss = base < nfree ? base : nfree;
        pl[0] = nmiss;
        unsigned long long *st = stat + (size_t)h * 4;
        st[0] += (unsigned long long)(m - nmiss);
        st[1] += (unsigned long long)m;
        st[2] = (unsigned long long)hm;
        st[3] += (unsigned long long)hm;
    }
}

/* A warp copies GATHER_ROWS planned (token, row) pairs of one head, as
 * gather_kernel: host rows for tokens >= ns, the resident sink rows below. */
__global__ void sel_cache_gather_kernel(const uint4 *rows, int nkv, int hd, const int *plan, int mcap,
                                        int ns, const uint4 *sink, uint4 *kdst, uint4 *vdst, size_t ld)
{
    const int h = blockIdx.y, lane = threadIdx.x & 31;
    const int *pl = plan + (size_t)h * (1 + 2 * (size_t)mcap);
    const int nr = pl[0], r0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * GATHER_ROWS;
    if (r0 >= nr) return;
    const int nv = hd / 8;
    const uint4 *src[GATHER_ROWS];
    int dst[GATHER_ROWS];
#pragma unroll
    for (int j = 0; j < GATHER_ROWS; j++) {
        int q = r0 + j;
        if (q >= nr) {
            src[j] = NULL;
            dst[j] = 0;
            continue;
        }
        int t = pl[1 + 2 * q];
        dst[j] = pl[2 + 2 * q];
        src[j] = t >= ns ? rows + ((size_t)t * nkv + h) * 2 * nv : sink + ((size_t)t * nkv + h) * 2 * nv;
    }
    for (int v = lane; v < 2 * nv; v += 32) {
        uint4 u[GATHER_ROWS];
#pragma unroll
        for (int j = 0; j < GATHER_ROWS; j++)
            if (src[j]) u[j] = src[j][v];
#pragma unroll
        for (int j = 0; j < GATHER_ROWS; j++) {
            if (!src[j]) continue;
            size_t o = (size_t)h * ld + (size_t)dst[j];
            if (v < nv) kdst[o * nv + v] = u[j];
            else vdst[o * nv + (v - nv)] = u[j];
        }
    }
}

extern "C" cudaError_t eng_sel_cache_plan(const int *sel, int k, int ns, int nkv, int *tag, int ntag,
                                          int r0, int mcap, int *plan, unsigned long long *stat,
                                          cudaStream_t s)
{
    const int m = ns + k;
    KV_CHECK_ARGS(k >= 0 && ns >= 0 && m <= mcap && r0 >= 0 && plan && tag && stat);
    if (m <= 0) return cudaSuccess;
    const size_t smem = (size_t)3 * m * sizeof(int);
    KV_CHECK_ARGS(smem <= 200 * 1024);
    if (smem > 48 * 1024) {
        static int attr_set = -1; /* per process; the engine uses one device */
        if (attr_set < 0) {
            CUDA_CHECK(cudaFuncSetAttribute(sel_cache_plan_kernel,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
            attr_set = 1;
        }
    }
    CUDA_CHECK(kv_launch(KV_PDL_NONE, sel_cache_plan_kernel, dim3((unsigned)nkv), dim3(SC_THREADS),
                         smem, s, sel, k, ns, tag, ntag, r0, mcap, plan, stat));
    return cudaSuccess;
}

extern "C" cudaError_t eng_sel_cache_gather(const void *rows, int nkv, int hd, const int *plan,
                                            int mcap, int ns, const void *sink, void *kdst,
                                            void *vdst, size_t ld, cudaStream_t s)
{
    KV_CHECK_ARGS((hd & 7) == 0 && plan && mcap >= 0);
    if (mcap <= 0) return cudaSuccess;
    const int per_block = 8 * GATHER_ROWS;
    dim3 grid((unsigned)((mcap + per_block - 1) / per_block), (unsigned)nkv);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, sel_cache_gather_kernel, grid, dim3(256), 0, s,
                         (const uint4 *)rows, nkv, hd, plan, mcap, ns, (const uint4 *)sink,
                         (uint4 *)kdst, (uint4 *)vdst, ld));
    return cudaSuccess;
}
