/*
 * eng_attn: fp16 decode attention for the engine's own buffers — the
 * resident + gathered rows of a sparse layer, an offloaded layer's staged
 * copy, and (until kernels/ offers one the engine links) the full cache.
 * Flash-decoding: the tokens are split into chunks, one block per (KV head,
 * chunk) computes the group's scores, a chunk-local softmax and the
 * unnormalised value sum; a second small kernel merges the chunks with the
 * usual max/sum rescaling.  A group of L = hd/8 lanes reads one token's
 * 16-byte slices, so a warp reads 32/L whole rows per load, coalesced; each
 * lane keeps its 8 channels of every query head of the group in registers.
 */
#include "eng_common.cuh"

#define ATT_WARPS 4
#define ATT_UNROLL 4
#define ATT_TARGET_BLOCKS 264 /* two waves of the H200's 132 SMs */

static int att_chunk(int nkv, int n)
{
    long want = ((long)n * nkv + ATT_TARGET_BLOCKS - 1) / ATT_TARGET_BLOCKS;
    want = (want + 31) / 32 * 32;
    if (want < 32) want = 32;
    if (want > 256) want = 256;
    return (int)want;
}

extern "C" size_t eng_attend_scratch(int nq_heads, int hd, int n)
{
    /* the largest split count any n' <= n can need: chunk >= 32 */
    size_t splits = ((size_t)n + 31) / 32;
    return (size_t)nq_heads * splits * (size_t)(hd + 2);
}

template <int HD, int G>
__global__ void __launch_bounds__(ATT_WARPS * 32)
attn_split_kernel(const float *__restrict__ q, const uint4 *__restrict__ K,
                  const uint4 *__restrict__ V, int g, int n, size_t ld, float scale, int chunk,
                  int nsplit, float *__restrict__ part_o, float *__restrict__ part_ml)
{
    constexpr int L = HD / 8;     /* lanes per token row */
    constexpr int TPW = 32 / L;   /* rows per warp per load */
    constexpr int STEP = ATT_WARPS * TPW;
    extern __shared__ float sm[]; /* scores (G, chunk), then value partials */
    __shared__ float red[32];
    const int kh = blockIdx.y, split = blockIdx.x;
    const int t0 = split * chunk, t1 = min(n, t0 + chunk);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane % L, tw = lane / L;
    const uint4 *Kh = K + (size_t)kh * ld * L;
    const uint4 *Vh = V + (size_t)kh * ld * L;

    float qr[G][8];
#pragma unroll
    for (int h = 0; h < G; h++)
#pragma unroll
        for (int j = 0; j < 8; j++)
            qr[h][j] = h < g ? q[(size_t)(kh * g + h) * HD + sub * 8 + j] * scale : 0.0f;

    /* scores */
    for (int tb = t0 + warp * TPW; tb < t1; tb += STEP * ATT_UNROLL) {
        uint4 u[ATT_UNROLL];
#pragma unroll
        for (int r = 0; r < ATT_UNROLL; r++) {
            int t = tb + r * STEP + tw;
            u[r] = t < t1 ? eng_ld_stream(Kh + (size_t)t * L + sub) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int r = 0; r < ATT_UNROLL; r++) {
            int t = tb + r * STEP + tw;
            float f[8];
            eng_f16::unpack8(u[r], f);
#pragma unroll
            for (int h = 0; h < G; h++) {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) d += qr[h][j] * f[j];
#pragma unroll
                for (int o = L / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                if (sub == 0 && t < t1 && h < g) sm[h * chunk + (t - t0)] = d;
            }
        }
    }
    __syncthreads();

    /* chunk-local softmax of each head */
    const int cn = t1 - t0;
    float mloc[G], lloc[G];
#pragma unroll
    for (int h = 0; h < G; h++) {
        float m = -INFINITY;
        if (h < g)
            for (int i = threadIdx.x; i < cn; i += blockDim.x) m = fmaxf(m, sm[h * chunk + i]);
        m = eng_block_max(m, red);
        float l = 0.0f;
        if (h < g)
            for (int i = threadIdx.x; i < cn; i += blockDim.x) {
                float p = __expf(sm[h * chunk + i] - m);
                sm[h * chunk + i] = p;
                l += p;
            }
        l = eng_block_sum(l, red);
        mloc[h] = m;
        lloc[h] = l;
    }
    __syncthreads();

    /* unnormalised value sums */
    float acc[G][8];
#pragma unroll
    for (int h = 0; h < G; h++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[h][j] = 0.0f;
    for (int tb = t0 + warp * TPW; tb < t1; tb += STEP * ATT_UNROLL) {
        uint4 u[ATT_UNROLL];
#pragma unroll
        for (int r = 0; r < ATT_UNROLL; r++) {
            int t = tb + r * STEP + tw;
            u[r] = t < t1 ? eng_ld_stream(Vh + (size_t)t * L + sub) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int r = 0; r < ATT_UNROLL; r++) {
            int t = tb + r * STEP + tw;
            if (t < t1) {
                float f[8];
                eng_f16::unpack8(u[r], f);
#pragma unroll
                for (int h = 0; h < G; h++) {
                    float p = h < g ? sm[h * chunk + (t - t0)] : 0.0f;
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[h][j] += p * f[j];
                }
            }
        }
    }
    /* reduce over the rows a warp's lanes held, then over warps */
#pragma unroll
    for (int h = 0; h < G; h++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int o = L; o < 32; o <<= 1) acc[h][j] += __shfl_xor_sync(0xffffffffu, acc[h][j], o);
    __syncthreads(); /* scores no longer needed: reuse sm */
    float *po = sm;  /* (ATT_WARPS, G, HD) */
    if (tw == 0)
#pragma unroll
        for (int h = 0; h < G; h++)
#pragma unroll
            for (int j = 0; j < 8; j++) po[(warp * G + h) * HD + sub * 8 + j] = acc[h][j];
    __syncthreads();
    for (int i = threadIdx.x; i < g * HD; i += blockDim.x) {
        int h = i / HD, c = i % HD;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) s += po[(w * G + h) * HD + c];
        int qh = kh * g + h;
        part_o[((size_t)qh * nsplit + split) * HD + c] = s;
    }
    if (threadIdx.x < g) {
        int h = threadIdx.x, qh = kh * g + h;
        float mm = 0.0f, ll = 0.0f;
#pragma unroll
        for (int hh = 0; hh < G; hh++)
            if (hh == h) {
                mm = mloc[hh];
                ll = lloc[hh];
            }
        part_ml[((size_t)qh * nsplit + split) * 2] = mm;
        part_ml[((size_t)qh * nsplit + split) * 2 + 1] = ll;
    }
}

__global__ void attn_combine_kernel(const float *part_o, const float *part_ml, int nsplit, int hd,
                                    float *out)
{
    const int qh = blockIdx.x;
    const float *ml = part_ml + (size_t)qh * nsplit * 2;
    float M = -INFINITY;
    for (int s = 0; s < nsplit; s++) M = fmaxf(M, ml[2 * s]);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float o = 0.0f, l = 0.0f;
        for (int s = 0; s < nsplit; s++) {
            float w = __expf(ml[2 * s] - M);
            l += w * ml[2 * s + 1];
            o += w * part_o[((size_t)qh * nsplit + s) * hd + c];
        }
        out[(size_t)qh * hd + c] = l > 0.0f ? o / l : 0.0f;
    }
}

template <int HD, int G>
static cudaError_t launch_split(const float *q, const void *K, const void *V, int g, int nkv,
                                int n, size_t ld, float scale, int chunk, int nsplit,
                                float *po, float *pml, cudaStream_t s)
{
    size_t smem = (size_t)G * chunk * sizeof(float);
    size_t smem2 = (size_t)ATT_WARPS * G * HD * sizeof(float);
    if (smem2 > smem) smem = smem2;
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(attn_split_kernel<HD, G>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    dim3 grid((unsigned)nsplit, (unsigned)nkv);
    attn_split_kernel<HD, G><<<grid, ATT_WARPS * 32, smem, s>>>(
        q, (const uint4 *)K, (const uint4 *)V, g, n, ld, scale, chunk, nsplit, po, pml);
    return cudaGetLastError();
}

template <int HD>
static cudaError_t launch_hd(const float *q, const void *K, const void *V, int g, int nkv, int n,
                             size_t ld, float scale, int chunk, int nsplit, float *po,
                             float *pml, cudaStream_t s)
{
    if (g <= 2) return launch_split<HD, 2>(q, K, V, g, nkv, n, ld, scale, chunk, nsplit, po, pml, s);
    if (g <= 4) return launch_split<HD, 4>(q, K, V, g, nkv, n, ld, scale, chunk, nsplit, po, pml, s);
    return launch_split<HD, 8>(q, K, V, g, nkv, n, ld, scale, chunk, nsplit, po, pml, s);
}

extern "C" cudaError_t eng_attend(const float *q, const void *K, const void *V, kv_dtype t,
                                  int nq_heads, int nkv, int hd, int n, size_t ld, float scale,
                                  float *scratch, float *out, cudaStream_t s)
{
    if (t != KV_DT_F16 || n <= 0 || nkv <= 0 || nq_heads % nkv || nq_heads / nkv > 8)
        return cudaErrorInvalidValue;
    int g = nq_heads / nkv, chunk = att_chunk(nkv, n), nsplit = (n + chunk - 1) / chunk;
    float *po = scratch, *pml = scratch + (size_t)nq_heads * nsplit * hd;
    cudaError_t e;
    switch (hd) {
    case 8: e = launch_hd<8>(q, K, V, g, nkv, n, ld, scale, chunk, nsplit, po, pml, s); break;
    case 16: e = launch_hd<16>(q, K, V, g, nkv, n, ld, scale, chunk, nsplit, po, pml, s); break;
    case 32: e = launch_hd<32>(q, K, V, g, nkv, n, ld, scale, chunk, nsplit, po, pml, s); break;
    case 64: e = launch_hd<64>(q, K, V, g, nkv, n, ld, scale, chunk, nsplit, po, pml, s); break;
    case 128: e = launch_hd<128>(q, K, V, g, nkv, n, ld, scale, chunk, nsplit, po, pml, s); break;
    case 256: e = launch_hd<256>(q, K, V, g, nkv, n, ld, scale, chunk, nsplit, po, pml, s); break;
    default: return cudaErrorInvalidValue;
    }
    if (e != cudaSuccess) return e;
    attn_combine_kernel<<<nq_heads, hd < 32 ? 32 : hd, 0, s>>>(po, pml, nsplit, hd, out);
    ENG_LAUNCHED();
}
