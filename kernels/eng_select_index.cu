/*
 * eng_select_index: the selection indexes of sparse layers that live on the
 * GPU (split from eng_select.cu, which has the rest of the selection): the
 * resident channel index (select=resident: per group of 64 tokens and pool
 * channel, packed codes with an fp16 scale and zero, built once from the
 * prompt's keys and scored per step) and the page index (select=pages: the
 * per-page key minima and maxima, an upper bound of each page's score,
 * expanded back to token scores for the top-K).
 */
#include "eng_select.cuh"

// --- the resident channel index (select=resident) ------------------------------------

#define RB_GROUP 64 /* KV_SELECT_CGROUP */

/* One block per (group of 64 tokens, pool channel, KV head), one thread per
 * token: min and max of the group, fp16 scale and zero, the codes packed. */
__global__ void __launch_bounds__(RB_GROUP) rows_build_kernel(const __half *k, int T, int ld, int hd,
                                                              const int *pool, int R, int bits,
                                                              void *rows, uint16_t *scale,
                                                              uint16_t *zero, int ldt)
{
    __shared__ float smn[2], smx[2];
    __shared__ uint8_t sc[RB_GROUP];
    const int gi = blockIdx.x, j = blockIdx.y, h = blockIdx.z, t0 = gi * RB_GROUP;
    const int t = t0 + threadIdx.x, ch = pool[h * R + j];
    const bool valid = t < T;
    const float x = valid ? __half2float(k[((size_t)h * ld + t) * hd + ch]) : 0.0f;
    const size_t row = (size_t)h * R + j;
    if (bits >= 16) {
        if (t < ldt) ((uint16_t *)rows)[row * ldt + t] = valid ? __half_as_ushort(__float2half_rn(x)) : 0;
        return;
    }
    float mn = valid ? x : INFINITY, mx = valid ? x : -INFINITY;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    }
    if ((threadIdx.x & 31) == 0) {
        smn[threadIdx.x >> 5] = mn;
        smx[threadIdx.x >> 5] = mx;
    }
    __syncthreads();
    mn = fminf(smn[0], smn[1]);
    mx = fmaxf(smx[0], smx[1]);
    const float maxq = (float)((1 << bits) - 1);
    const __half hs = __float2half_rn(__fdiv_rn(__fsub_rn(mx, mn), maxq)), hz = __float2half_rn(mn);
    const float s = __half2float(hs), z = __half2float(hz);
    const float sd = (s > 0.0f && s < INFINITY) ? s : INFINITY;
    if (threadIdx.x == 0) {
        scale[row * (ldt / RB_GROUP) + gi] = __half_as_ushort(hs);
        zero[row * (ldt / RB_GROUP) + gi] = __half_as_ushort(hz);
    }
    float v = rintf(__fdiv_rn(__fsub_rn(x, z), sd));
    v = v > 0.0f ? v : 0.0f;
    v = v < maxq ? v : maxq;
    sc[threadIdx.x] = valid ? (uint8_t)(int)v : 0;
    __syncthreads();
    const int per = 8 / bits, nbytes = RB_GROUP * bits / 8;
    if (threadIdx.x < nbytes) {
        unsigned b = 0;
        for (int i = 0; i < per; i++) b |= (unsigned)sc[threadIdx.x * per + i] << (i * bits);
        ((uint8_t *)rows)[row * ((size_t)ldt * bits / 8) + (size_t)t0 * bits / 8 + threadIdx.x] = (uint8_t)b;
    }
}

extern "C" cudaError_t eng_rows_build(const uint16_t *k, int nkv, int T, int ld, int hd,
                                      const int *pool, int R, int bits, void *rows,
                                      uint16_t *scale, uint16_t *zero, int ldt, cudaStream_t s)
{
    KV_CHECK_ARGS((bits == 1 || bits == 2 || bits == 4 || bits == 8 || bits == 16) && ldt % RB_GROUP == 0 &&
                  ldt >= T && R >= 1 && (bits == 16 || (scale && zero)));
    if (T <= 0) return cudaSuccess;
    dim3 grid((unsigned)(ldt / RB_GROUP), (unsigned)R, (unsigned)nkv);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, rows_build_kernel, grid, dim3(RB_GROUP), 0, s,
                         (const __half *)k, T, ld, hd, pool, R, bits, rows, scale, zero, ldt));
    return cudaSuccess;
}

/* One block per KV head: pool channel scores, the top C by rank (ties to
 * the lower position), then the SparQ scale per query head. */
__global__ void select_pool_kernel(const float *q, const float *chmax, const int *pool, int g,
                                   int hd, int R, int C, int *cols, float *qscale)
{
    extern __shared__ float ps[]; /* (R) pool channel scores */
    __shared__ float red[32];
    __shared__ int scol[1024];
    const int kh = blockIdx.x;
    const float *qg = q + (size_t)kh * g * hd;
    const int *pl = pool + (size_t)kh * R;
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
        float a = 0.0f;
        for (int h = 0; h < g; h++) a += fabsf(qg[(size_t)h * hd + pl[j]]);
        float v = a * chmax[(size_t)kh * hd + pl[j]];
        ps[j] = isnan(v) ? -INFINITY : v;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
        float sj = ps[j];
        int rank = 0;
        for (int i = 0; i < R; i++) rank += ps[i] > sj || (ps[i] == sj && i < j);
        if (rank < C) {
            int pos = 0; /* ascending position among the chosen */
            for (int i = 0; i < j; i++) {
                float si = ps[i];
                int ri = 0;
                for (int m = 0; m < R; m++) ri += ps[m] > si || (ps[m] == si && m < i);
                pos += ri < C;
            }
            cols[kh * C + pos] = j;
            scol[pos] = pl[j];
        }
    }
    __syncthreads();
    for (int h = 0; h < g; h++) {
        const float *qh = qg + (size_t)h * hd;
        float all = 0.0f, part = 0.0f;
        for (int c = threadIdx.x; c < hd; c += blockDim.x) all += fabsf(qh[c]);
        for (int j = threadIdx.x; j < C; j += blockDim.x) part += fabsf(qh[scol[j]]);
        all = eng_block_sum(all, red);
        part = eng_block_sum(part, red);
        if (threadIdx.x == 0) {
            float temp = all <= 0.0f ? (float)hd : (float)hd * part / all;
            qscale[kh * g + h] = temp > 0.0f ? 1.0f / sqrtf(temp) : 0.0f;
        }
    }
}

extern "C" cudaError_t eng_select_pool(const float *q, const float *chmax, const int *pool,
                                       int nq_heads, int nkv, int hd, int R, int C, int *cols,
                                       float *qscale, cudaStream_t s)
{
    KV_CHECK_ARGS(C >= 1 && C <= R && R <= hd && R <= 1024 && nq_heads % nkv == 0);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, select_pool_kernel, dim3(nkv), dim3(128),
                         (size_t)R * sizeof(float), s, q, chmax, pool, nq_heads / nkv, hd, R, C, cols,
                         qscale));
    return cudaSuccess;
}

/* Each thread scores 8 consecutive tokens (from the 8-aligned base below
 * cs): per chosen row one load of their 8 values (16 bytes in fp16, bits
 * bytes in codes), decoded as zero + scale * code. */
template <int BITS>
__global__ void score_rows_kernel(const float *q, const int *pool, const int *cols,
                                  const float *qscale, const uint8_t *rows, const uint16_t *scale,
                                  const uint16_t *zero, int ldt, int g, int hd, int R, int C, int cs,
                                  int cend, float *score)
{
    extern __shared__ float qc[]; /* (g, C) q_c * qscale, then (C) row offsets as ints */
    int *rj = (int *)(qc + (size_t)g * C);
    const int kh = blockIdx.y, n = cend - cs, base = cs & ~7;
    for (int i = threadIdx.x; i < g * C; i += blockDim.x) {
        int h = i / C, j = i % C, qh = kh * g + h;
        qc[i] = q[(size_t)qh * hd + pool[kh * R + cols[kh * C + j]]] * qscale[qh];
    }
    for (int j = threadIdx.x; j < C; j += blockDim.x) rj[j] = kh * R + cols[kh * C + j];
    __syncthreads();
    const int t8 = base + 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (t8 >= cend) return;
    float acc[SEL_MAXG][8];
#pragma unroll
    for (int h = 0; h < SEL_MAXG; h++)
#pragma unroll
        for (int i = 0; i < 8; i++) acc[h][i] = 0.0f;
    for (int j = 0; j < C; j++) {
        const size_t row = (size_t)rj[j];
        float f[8];
        if (BITS == 16) {
            uint4 u = *(const uint4 *)(rows + (row * ldt + t8) * 2);
            eng_f16::unpack8(u, f);
        } else {
            const size_t gi = row * (ldt / RB_GROUP) + t8 / RB_GROUP;
            const float sc = __half2float(__ushort_as_half(scale[gi]));
            const float z = __half2float(__ushort_as_half(zero[gi]));
            const uint8_t *r = rows + row * ((size_t)ldt * BITS / 8) + (size_t)t8 * BITS / 8;
            uint64_t w = 0; /* the 8 codes, 8*BITS bits */
#pragma unroll
            for (int b = 0; b < BITS; b++) w |= (uint64_t)r[b] << (8 * b);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                unsigned code = (unsigned)(w >> (i * BITS)) & ((1u << BITS) - 1u);
                f[i] = __fadd_rn(z, __fmul_rn(sc, (float)code));
            }
        }
#pragma unroll
        for (int h = 0; h < SEL_MAXG; h++)
            if (h < g) {
                float wq = qc[h * C + j];
#pragma unroll
                for (int i = 0; i < 8; i++) acc[h][i] += wq * f[i];
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

extern "C" cudaError_t eng_score_rows(const float *q, const int *pool, const int *cols,
                                      const float *qscale, const void *rows, const uint16_t *scale,
                                      const uint16_t *zero, int ldt, int bits, int nq_heads, int nkv,
                                      int hd, int R, int C, int cs, int cend, float *score,
                                      cudaStream_t s)
{
    KV_CHECK_ARGS(nq_heads / nkv <= SEL_MAXG && ldt % RB_GROUP == 0 && cend <= ldt && C <= R &&
                  (bits == 16 || (scale && zero)));
    if (cend <= cs) return cudaSuccess;
    const int g = nq_heads / nkv, base = cs & ~7, threads8 = (cend - base + 7) / 8;
    dim3 grid((unsigned)((threads8 + 127) / 128), (unsigned)nkv);
    size_t smem = ((size_t)g * C + C) * sizeof(float);
    const uint8_t *r = (const uint8_t *)rows;
#define SR(B)                                                                                       \
    CUDA_CHECK(kv_launch(KV_PDL_NONE, score_rows_kernel<B>, grid, dim3(128), smem, s, q, pool, cols, \
                         qscale, r, scale, zero, ldt, g, hd, R, C, cs, cend, score))
    switch (bits) {
    case 16: SR(16); break;
    case 8: SR(8); break;
    case 4: SR(4); break;
    case 2: SR(2); break;
    case 1: SR(1); break;
    default: KV_CHECK_ARGS(!"bits");
    }
#undef SR
    return cudaSuccess;
}

// --- the page index (select=pages) ---------------------------------------------------

/* One block per (page, KV head), a thread per channel: min and max over
 * the page's tokens, exact in fp16. */
__global__ void page_bounds_kernel(const __half *k, int T, int ld, int hd, int P, int np,
                                   uint16_t *pmin, uint16_t *pmax)
{
    const int p = blockIdx.x, h = blockIdx.y, t0 = p * P, t1 = min(T, t0 + P);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float mn = __half2float(k[((size_t)h * ld + t0) * hd + c]), mx = mn;
        for (int t = t0 + 1; t < t1; t++) {
            float v = __half2float(k[((size_t)h * ld + t) * hd + c]);
            mn = fminf(mn, v);
            mx = fmaxf(mx, v);
        }
        size_t o = ((size_t)h * np + p) * hd + c;
        pmin[o] = __half_as_ushort(__float2half_rn(mn));
        pmax[o] = __half_as_ushort(__float2half_rn(mx));
    }
}

extern "C" cudaError_t eng_page_bounds(const uint16_t *k, int nkv, int T, int ld, int hd, int P,
                                       uint16_t *pmin, uint16_t *pmax, cudaStream_t s)
{
    KV_CHECK_ARGS(P >= 1 && hd >= 1);
    if (T <= 0) return cudaSuccess;
    const int np = (T + P - 1) / P;
    CUDA_CHECK(kv_launch(KV_PDL_NONE, page_bounds_kernel, dim3((unsigned)np, (unsigned)nkv),
                         dim3(hd < 256 ? hd : 256), 0, s, (const __half *)k, T, ld, hd, P, np, pmin,
                         pmax));
    return cudaSuccess;
}

/* A warp per page of one KV head (8 pages a block), lanes over channels,
 * every query head of the group at once. */
__global__ void __launch_bounds__(256) score_pages_kernel(const float *q, const __half *pmin,
                                                          const __half *pmax, int ldp, int g,
                                                          int hd, int p0, int np, float *score)
{
    extern __shared__ float qs[]; /* (g, hd) */
    const int kh = blockIdx.y, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < g * hd; i += blockDim.x) qs[i] = q[(size_t)kh * g * hd + i];
    __syncthreads();
    const int pi = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (pi >= np) return;
    const size_t row = ((size_t)kh * ldp + (size_t)(p0 + pi)) * hd;
    float acc[SEL_MAXG];
#pragma unroll
    for (int h = 0; h < SEL_MAXG; h++) acc[h] = 0.0f;
    for (int c = lane; c < hd; c += 32) {
        const float mn = __half2float(pmin[row + c]), mx = __half2float(pmax[row + c]);
#pragma unroll
        for (int h = 0; h < SEL_MAXG; h++)
            if (h < g) {
                float qc = qs[h * hd + c];
                acc[h] += fmaxf(qc * mn, qc * mx);
            }
    }
    const float sc = rsqrtf((float)hd);
#pragma unroll
    for (int h = 0; h < SEL_MAXG; h++)
        if (h < g) {
            float v = acc[h];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) score[(size_t)(kh * g + h) * np + pi] = v * sc;
        }
}

extern "C" cudaError_t eng_score_pages(const float *q, const uint16_t *pmin, const uint16_t *pmax,
                                       int ldp, int nq_heads, int nkv, int hd, int p0, int np,
                                       float *score, cudaStream_t s)
{
    KV_CHECK_ARGS(nq_heads % nkv == 0 && nq_heads / nkv <= SEL_MAXG && p0 >= 0 && p0 + np <= ldp);
    if (np <= 0) return cudaSuccess;
    const int g = nq_heads / nkv;
    CUDA_CHECK(kv_launch(KV_PDL_NONE, score_pages_kernel, dim3((unsigned)((np + 7) / 8), (unsigned)nkv),
                         dim3(256), (size_t)g * hd * sizeof(float), s, q, (const __half *)pmin,
                         (const __half *)pmax, ldp, g, hd, p0, np, score));
    return cudaSuccess;
}

__global__ void pages_expand_kernel(const float *comb, int np, int P, int p0, int cs, int n,
                                    float *tok)
{
    const int kh = blockIdx.y;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        tok[(size_t)kh * n + i] = comb[(size_t)kh * np + (cs + i) / P - p0];
}

extern "C" cudaError_t eng_pages_expand(const float *comb, int nkv, int np, int P, int p0, int cs,
                                        int n, float *tok, cudaStream_t s)
{
    KV_CHECK_ARGS(P >= 1 && cs / P >= p0 && (n <= 0 || (cs + n - 1) / P - p0 < np));
    if (n <= 0) return cudaSuccess;
    unsigned bx = (unsigned)((n + 255) / 256);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, pages_expand_kernel, dim3(bx < 64 ? bx : 64, (unsigned)nkv),
                         dim3(256), 0, s, comb, np, P, p0, cs, n, tok));
    return cudaSuccess;
}
