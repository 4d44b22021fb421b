/*
 * KIVI pack/unpack kernels and their launchers (see kivi_pack.cuh).
 */
#include "kivi_pack.cuh"

/* OR of v over aligned groups of n lanes (n a power of two), in every lane. */
__device__ __forceinline__ uint32_t kv_or_lanes(uint32_t v, int n)
{
    for (int o = 1; o < n; o <<= 1) v |= __shfl_xor_sync(KV_FULL_MASK, v, o);
    return v;
}

/* Keys: grid (ngroups, H), a thread per channel.  The tile is read from
 * shared memory column-wise (consecutive lanes, consecutive channels); the
 * codes of the 32/bits channels of a word are ORed across lanes. */
__global__ void __launch_bounds__(KV_PACK_KEY_THREADS)
    kivi_pack_keys(const __half *__restrict__ x, int T, int D, int G, int bits, int nq,
                   uint8_t *__restrict__ codes, __half *__restrict__ scale,
                   __half *__restrict__ zero)
{
    __shared__ __align__(16) __half tile[KV_PACK_MAX_TILE];
    const int gi = blockIdx.x, h = blockIdx.y, ng = gridDim.x;
    const float maxq = (float)((1 << bits) - 1);
    const __half *src = x + ((size_t)h * T + (size_t)gi * G) * D;
    const int n16 = G * D / 8;
    for (int i = threadIdx.x; i < n16; i += KV_PACK_KEY_THREADS)
        reinterpret_cast<uint4 *>(tile)[i] = __ldg(reinterpret_cast<const uint4 *>(src) + i);
    __syncthreads();
    const int c = threadIdx.x;
    if (c >= D) return; /* D is a multiple of 32: whole warps leave */
    float mn = __half2float(tile[c]), mx = mn;
    for (int t = 1; t < G; t++) {
        float v = __half2float(tile[t * D + c]);
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
    }
    __half hs, hz;
    float sd, z;
    kv_kivi_group_params(mn, mx, maxq, &hs, &hz, &sd, &z);
    const float rcp = __frcp_rn(sd);
    scale[((size_t)h * ng + gi) * D + c] = hs;
    zero[((size_t)h * ng + gi) * D + c] = hz;
    const int cpw = 32 / bits, wpr = D * bits / 32; /* codes per word, words per row */
    const int sh = (c % cpw) * bits;
    uint32_t *out = reinterpret_cast<uint32_t *>(codes + ((size_t)h * nq + (size_t)gi * G) * D * bits / 8);
    if (bits == 1) { /* a warp's 32 one-bit codes are one ballot */
#pragma unroll 4
        for (int t = 0; t < G; t++) {
            uint32_t w = __ballot_sync(KV_FULL_MASK, kv_kivi_code(__half2float(tile[t * D + c]), sd, rcp, z, maxq));
            if (c % 32 == 0) out[t * wpr + c / 32] = w;
        }
        return;
    }
#pragma unroll 4
    for (int t = 0; t < G; t++) {
        uint32_t w = kv_or_lanes(kv_kivi_code(__half2float(tile[t * D + c]), sd, rcp, z, maxq) << sh, cpw);
        if (c % cpw == 0) out[t * wpr + c / cpw] = w;
    }
}

/* Values: a warp per (head, token); lane l holds channels [l*CPL, l*CPL+CPL).
 * Group extremes and code words are reduced across lanes with shuffles. */
template <int D, int BITS>
__global__ void kivi_pack_values(const __half *__restrict__ x, int H, int T, int nq, int gv,
                                 uint8_t *__restrict__ codes, __half *__restrict__ scale,
                                 __half *__restrict__ zero)
{
    constexpr int CPL = D / 32, LPW = 32 / (CPL * BITS); /* lanes per code word */
    const size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= (size_t)H * nq) return; /* whole warps */
    const int h = (int)(warp / nq), t = (int)(warp % nq);
    const __half *row = x + ((size_t)h * T + t) * D + lane * CPL;
    float v[CPL];
    if constexpr (CPL == 4) {
        uint2 u = __ldg(reinterpret_cast<const uint2 *>(row));
        float2 a = __half22float2(*reinterpret_cast<__half2 *>(&u.x));
        float2 b = __half22float2(*reinterpret_cast<__half2 *>(&u.y));
        v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
    } else {
        uint32_t u = __ldg(reinterpret_cast<const uint32_t *>(row));
        float2 a = __half22float2(*reinterpret_cast<__half2 *>(&u));
        v[0] = a.x, v[1] = a.y;
    }
    float mn = v[0], mx = v[0];
#pragma unroll
    for (int i = 1; i < CPL; i++) {
        mn = v[i] < mn ? v[i] : mn;
        mx = v[i] > mx ? v[i] : mx;
    }
    const int lpg = gv / CPL; /* lanes per value group, a power of two <= 32 */
    for (int o = 1; o < lpg; o <<= 1) {
        float a = __shfl_xor_sync(KV_FULL_MASK, mn, o), b = __shfl_xor_sync(KV_FULL_MASK, mx, o);
        mn = a < mn ? a : mn;
        mx = b > mx ? b : mx;
    }
    const float maxq = (float)((1 << BITS) - 1);
    __half hs, hz;
    float sd, z;
    kv_kivi_group_params(mn, mx, maxq, &hs, &hz, &sd, &z);
    const float rcp = __frcp_rn(sd);
    const int ngv = D / gv;
    const size_t ht = (size_t)h * nq + t;
    if (lane % lpg == 0) {
        scale[ht * ngv + lane / lpg] = hs;
        zero[ht * ngv + lane / lpg] = hz;
    }
    uint32_t w = 0;
#pragma unroll
    for (int i = 0; i < CPL; i++) w |= kv_kivi_code(v[i], sd, rcp, z, maxq) << (i * BITS);
    w = kv_or_lanes(w << ((lane % LPW) * CPL * BITS), LPW);
    if (lane % LPW == 0)
        reinterpret_cast<uint32_t *>(codes + ht * D * BITS / 8)[lane / LPW] = w;
}

/* Unpack: one thread per (head, token, 8 channels); residual tokens copied. */
__global__ void kivi_unpack(kv_kivi_axis axis, int H, int T, int D, int G, int bits, int nq,
                            const uint8_t *__restrict__ codes, const __half *__restrict__ scale,
                            const __half *__restrict__ zero, const __half *__restrict__ resid,
                            __half *__restrict__ out)
{
    const int chunks = D / 8;
    const size_t n = (size_t)H * T * chunks;
    const size_t id = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= n) return;
    const int ch = (int)(id % chunks);
    const size_t ht = id / chunks;
    const int h = (int)(ht / T), t = (int)(ht % T);
    uint4 res;
    if (t >= nq) {
        res = __ldg(reinterpret_cast<const uint4 *>(resid + ((size_t)h * (T - nq) + (t - nq)) * D) + ch);
    } else {
        const uint8_t *row = codes + ((size_t)h * nq + t) * D * bits / 8;
        uint32_t bitsw = 0; /* the 8 codes: 8*bits bits starting at byte ch*bits */
        for (int b = 0; b < bits; b++) bitsw |= (uint32_t)row[ch * bits + b] << (8 * b);
        const int gv = D < G ? D : G, ngv = D / gv;
        __half2 *o = reinterpret_cast<__half2 *>(&res);
        float f[8];
        for (int i = 0; i < 8; i++) {
            const int c = ch * 8 + i;
            size_t si = axis == KV_KIVI_KEYS ? ((size_t)h * (nq / G) + t / G) * D + c
                                             : ((size_t)h * nq + t) * ngv + c / gv;
            float code = (float)((bitsw >> (i * bits)) & ((1u << bits) - 1u));
            f[i] = __fadd_rn(__half2float(zero[si]), __fmul_rn(__half2float(scale[si]), code));
        }
        for (int i = 0; i < 4; i++) o[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    }
    reinterpret_cast<uint4 *>(out + ((size_t)h * T + t) * D)[ch] = res;
}

// --- launchers -------------------------------------------------------------------

extern "C" int kv_cuda_kivi_pack_supported(kv_kivi_axis axis, const kv_kivi_params *prm,
                                           int head_dim)
{
    if (!prm || (prm->bits != 1 && prm->bits != 2 && prm->bits != 4) || prm->group < 1 ||
        prm->residual < 0 || (head_dim != 64 && head_dim != 128))
        return 0;
    if (axis == KV_KIVI_KEYS) return prm->group * head_dim <= KV_PACK_MAX_TILE;
    int gv = prm->group < head_dim ? prm->group : head_dim;
    return head_dim % gv == 0 && (gv == 32 || gv == 64 || gv == 128);
}

extern "C" cudaError_t kv_cuda_kivi_pack(kv_kivi_axis axis, const kv_kivi_params *prm, int H,
                                         int T, int D, const uint16_t *x,
                                         const kv_cuda_kivi_out *out, cudaStream_t stream)
{
    KV_CHECK_ARGS(kv_cuda_kivi_pack_supported(axis, prm, D) && H >= 1 && T >= 0 && x && out);
    const __half *xh = reinterpret_cast<const __half *>(x);
    __half *sc = reinterpret_cast<__half *>(out->scale), *ze = reinterpret_cast<__half *>(out->zero);
    const int G = prm->group, bits = prm->bits;
    const int nq = kv_kivi_nquant(T, G, prm->residual);
    if (nq > 0) {
        if (axis == KV_KIVI_KEYS) {
            CUDA_CHECK(kv_launch(KV_PDL_NONE, kivi_pack_keys, dim3(nq / G, H),
                                 dim3(KV_PACK_KEY_THREADS), 0, stream, xh, T, D, G, bits, nq,
                                 out->codes, sc, ze));
        } else {
            int gv = G < D ? G : D;
            size_t threads = (size_t)H * nq * 32;
            unsigned blocks = (unsigned)((threads + 255) / 256);
#define KV_PACK_V(DD, BB)                                                                    \
    if (D == DD && bits == BB)                                                               \
        CUDA_CHECK(kv_launch(KV_PDL_NONE, kivi_pack_values<DD, BB>, dim3(blocks), dim3(256), \
                             0, stream, xh, H, T, nq, gv, out->codes, sc, ze));
            KV_PACK_V(64, 1) KV_PACK_V(64, 2) KV_PACK_V(64, 4)
            KV_PACK_V(128, 1) KV_PACK_V(128, 2) KV_PACK_V(128, 4)
#undef KV_PACK_V
        }
    }
    if (T > nq) { /* the residual: per head, the last T - nq rows */
        size_t row = (size_t)D * sizeof(uint16_t);
        CUDA_CHECK(cudaMemcpy2DAsync(out->resid, (size_t)(T - nq) * row, x + (size_t)nq * D,
                                     (size_t)T * row, (size_t)(T - nq) * row, (size_t)H,
                                     cudaMemcpyDeviceToDevice, stream));
    }
    return cudaSuccess;
}

extern "C" cudaError_t kv_cuda_kivi_unpack(kv_kivi_axis axis, const kv_kivi_params *prm, int H,
                                           int T, int D, const kv_cuda_kivi_view *in,
                                           uint16_t *out, cudaStream_t stream)
{
    KV_CHECK_ARGS(kv_cuda_kivi_pack_supported(axis, prm, D) && H >= 1 && T >= 1 && in && out);
    const int nq = kv_kivi_nquant(T, prm->group, prm->residual);
    size_t n = (size_t)H * T * (D / 8);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, kivi_unpack, dim3((unsigned)((n + 255) / 256)), dim3(256), 0,
                         stream, axis, H, T, D, prm->group, prm->bits, nq, in->codes,
                         reinterpret_cast<const __half *>(in->scale),
                         reinterpret_cast<const __half *>(in->zero),
                         reinterpret_cast<const __half *>(in->resid),
                         reinterpret_cast<__half *>(out)));
    return cudaSuccess;
}
