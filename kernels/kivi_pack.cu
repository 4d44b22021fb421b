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

/*
 * The memory-speed pack (issue 10): a thread owns 8 consecutive channels of
 * a token (one 16-byte load, one 8*BITS-bit store of its own codes), so no
 * code word is assembled across lanes; extremes are reduced across the
 * threads that share channels (keys: the token subsets of a group, by
 * shuffles and then shared memory; values: the 8-channel chunks of a value
 * group, by shuffles).  Codes and parameters are those of kv_kivi_code and
 * kv_kivi_group_params, so the bytes equal the CPU's.
 */
/* The 8 codes of one row chunk (x: 8 floats), packed least significant first. */
template <int BITS>
__device__ __forceinline__ uint32_t kv_kivi_codes8(const float (&x)[8], const float (&sd)[8],
                                                   const float (&rcp)[8], const float (&z)[8])
{
    constexpr float maxq = (float)((1 << BITS) - 1);
    uint32_t w = 0;
    bool amb = false;
#pragma unroll
    for (int i = 0; i < 8; i++) w |= kv_kivi_code_fast(x[i], rcp[i], z[i], maxq, &amb) << (i * BITS);
    if (amb) { /* rare: a quotient within rounding of a half integer */
        w = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) w |= kv_kivi_code_exact(x[i], sd[i], z[i], maxq) << (i * BITS);
    }
    return w;
}

__device__ __forceinline__ void kv_half8(uint4 raw, float (&f)[8])
{
    const __half2 *hp = reinterpret_cast<const __half2 *>(&raw);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 v = __half22float2(hp[i]);
        f[2 * i] = v.x, f[2 * i + 1] = v.y;
    }
}

template <int BITS>
__device__ __forceinline__ void kv_kivi_store_codes8(uint8_t *p, uint32_t w)
{
    if (BITS == 1) *p = (uint8_t)w;
    else if (BITS == 2) *reinterpret_cast<uint16_t *>(p) = (uint16_t)w;
    else *reinterpret_cast<uint32_t *>(p) = w;
}

/* Keys: grid (ngroups, H), 128 threads; thread (c8 = tid % (D/8), ts = tid /
 * (D/8)) holds tokens ts, ts + NS, ... (NS = 128 / (D/8) subsets, G / NS
 * tokens each, at most KV_PACK_TPT).  The extremes meet in shared memory,
 * where thread c (one per channel) makes channel c's scale, zero and
 * reciprocal once for all. */
#define KV_PACK_TPT 8
template <int D, int BITS>
__global__ void __launch_bounds__(KV_PACK_KEY_THREADS)
    kivi_pack_keys8(const __half *__restrict__ x, int T, int G, int nq,
                    uint8_t *__restrict__ codes, __half *__restrict__ scale,
                    __half *__restrict__ zero)
{
    constexpr int CPR = D / 8, NS = KV_PACK_KEY_THREADS / CPR, NW = KV_PACK_KEY_THREADS / 32;
    __shared__ float red[2][NW][D];
    __shared__ __align__(16) float prm[3][D]; /* divisor, reciprocal, zero per channel */
    const int gi = blockIdx.x, h = blockIdx.y, ng = gridDim.x;
    const int tid = threadIdx.x, c8 = tid % CPR, ts = tid / CPR, warp = tid >> 5, lane = tid & 31;
    const int tpt = G / NS;
    const __half *src = x + ((size_t)h * T + (size_t)gi * G) * D + c8 * 8;
    uint4 raw[KV_PACK_TPT];
#pragma unroll
    for (int j = 0; j < KV_PACK_TPT; j++)
        if (j < tpt) raw[j] = __ldg(reinterpret_cast<const uint4 *>(src + (size_t)(ts + j * NS) * D));
    /* Extremes over the thread's tokens in fp16 pairs (exact: the min and max
     * of fp16 values are fp16 values), two channels per instruction. */
    __half2 hmn[4], hmx[4];
#pragma unroll
    for (int i = 0; i < 4; i++) hmn[i] = hmx[i] = reinterpret_cast<const __half2 *>(&raw[0])[i];
#pragma unroll
    for (int j = 1; j < KV_PACK_TPT; j++)
        if (j < tpt)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const __half2 v = reinterpret_cast<const __half2 *>(&raw[j])[i];
                hmn[i] = __hmin2(hmn[i], v);
                hmx[i] = __hmax2(hmx[i], v);
            }
    float mn[8], mx[8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 a = __half22float2(hmn[i]), b = __half22float2(hmx[i]);
        mn[2 * i] = a.x, mn[2 * i + 1] = a.y, mx[2 * i] = b.x, mx[2 * i + 1] = b.y;
    }
    /* lanes lane ^ CPR, ^ 2 CPR, ... of the warp hold the same channels */
#pragma unroll
    for (int o = CPR; o < 32; o <<= 1)
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float a = __shfl_xor_sync(KV_FULL_MASK, mn[i], o), b = __shfl_xor_sync(KV_FULL_MASK, mx[i], o);
            mn[i] = a < mn[i] ? a : mn[i];
            mx[i] = b > mx[i] ? b : mx[i];
        }
    if (lane < CPR)
#pragma unroll
        for (int i = 0; i < 8; i++) red[0][warp][c8 * 8 + i] = mn[i], red[1][warp][c8 * 8 + i] = mx[i];
    __syncthreads();
    if (tid < D) {
        float cmn = red[0][0][tid], cmx = red[1][0][tid];
#pragma unroll
        for (int w = 1; w < NW; w++) {
            float a = red[0][w][tid], b = red[1][w][tid];
            cmn = a < cmn ? a : cmn;
            cmx = b > cmx ? b : cmx;
        }
        __half hs, hz;
        float sd, z;
        kv_kivi_group_params(cmn, cmx, (float)((1 << BITS) - 1), &hs, &hz, &sd, &z);
        const size_t so = ((size_t)h * ng + gi) * D + tid;
        scale[so] = hs;
        zero[so] = hz;
        prm[0][tid] = sd;
        prm[1][tid] = __frcp_rn(sd);
        prm[2][tid] = z;
    }
    __syncthreads();
    float sd[8], rcp[8], z[8];
#pragma unroll
    for (int i = 0; i < 8; i++) sd[i] = prm[0][c8 * 8 + i], rcp[i] = prm[1][c8 * 8 + i], z[i] = prm[2][c8 * 8 + i];
    uint8_t *out = codes + ((size_t)h * nq + (size_t)gi * G) * (D * BITS / 8) + c8 * BITS;
#pragma unroll
    for (int j = 0; j < KV_PACK_TPT; j++)
        if (j < tpt) {
            float f[8];
            kv_half8(raw[j], f);
            kv_kivi_store_codes8<BITS>(out + (size_t)(ts + j * NS) * (D * BITS / 8),
                                       kv_kivi_codes8<BITS>(f, sd, rcp, z));
        }
}

/* Values: grid (ceil(nq / (KV_PACK_VROWS * RPB)), H), 256 threads; a thread
 * per (token, 8 channels) of KV_PACK_VROWS tokens RPB apart (RPB = tokens
 * per block pass), their loads issued together; the LPG = gv / 8 threads
 * of a value group are consecutive lanes. */
#define KV_PACK_VROWS 4
template <int D, int BITS>
__global__ void __launch_bounds__(256)
    kivi_pack_values8(const __half *__restrict__ x, int T, int nq, int gv,
                      uint8_t *__restrict__ codes, __half *__restrict__ scale,
                      __half *__restrict__ zero)
{
    constexpr int CPR = D / 8, RPB = 256 / CPR, maxq = (1 << BITS) - 1;
    const int h = blockIdx.y, c8 = threadIdx.x % CPR;
    const int tb = blockIdx.x * (RPB * KV_PACK_VROWS) + threadIdx.x / CPR;
    const int lpg = gv / 8; /* 4, 8 or 16: whole groups inside a warp (CPR is 8 or 16) */
    const int ngv = D / gv;
    uint4 raw[KV_PACK_VROWS];
#pragma unroll
    for (int j = 0; j < KV_PACK_VROWS; j++) {
        const int t = tb + j * RPB;
        raw[j] = t < nq ? __ldg(reinterpret_cast<const uint4 *>(x + ((size_t)h * T + t) * D + c8 * 8))
                        : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < KV_PACK_VROWS; j++) {
        const int t = tb + j * RPB;
        float f[8];
        kv_half8(raw[j], f);
        float gmn = f[0], gmx = f[0];
#pragma unroll
        for (int i = 1; i < 8; i++) {
            gmn = f[i] < gmn ? f[i] : gmn;
            gmx = f[i] > gmx ? f[i] : gmx;
        }
        for (int o = 1; o < lpg; o <<= 1) {
            float a = __shfl_xor_sync(KV_FULL_MASK, gmn, o), b = __shfl_xor_sync(KV_FULL_MASK, gmx, o);
            gmn = a < gmn ? a : gmn;
            gmx = b > gmx ? b : gmx;
        }
        if (t >= nq) continue; /* whole rows: the shuffles above had every lane */
        __half hs, hz;
        float sdv, zv;
        kv_kivi_group_params(gmn, gmx, (float)maxq, &hs, &hz, &sdv, &zv);
        const float rv = __frcp_rn(sdv);
        const size_t ht = (size_t)h * nq + t;
        if (c8 % lpg == 0) {
            scale[ht * ngv + c8 / lpg] = hs;
            zero[ht * ngv + c8 / lpg] = hz;
        }
        float sd[8], rcp[8], z[8];
#pragma unroll
        for (int i = 0; i < 8; i++) sd[i] = sdv, rcp[i] = rv, z[i] = zv;
        const uint32_t w = kv_kivi_codes8<BITS>(f, sd, rcp, z);
        kv_kivi_store_codes8<BITS>(codes + ht * (D * BITS / 8) + c8 * BITS, w);
    }
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
    /* the 8-channel kernels store scales as 16-byte and codes as up to 4-byte words */
    const bool wide = (((uintptr_t)sc | (uintptr_t)ze) & 15) == 0 && ((uintptr_t)out->codes & 3) == 0;
    if (nq > 0) {
        if (axis == KV_KIVI_KEYS && wide && G % (KV_PACK_KEY_THREADS / (D / 8)) == 0) {
#define KV_PACK_K8(DD, BB)                                                                    \
    if (D == DD && bits == BB)                                                                \
        CUDA_CHECK(kv_launch(KV_PDL_NONE, kivi_pack_keys8<DD, BB>, dim3(nq / G, H),           \
                             dim3(KV_PACK_KEY_THREADS), 0, stream, xh, T, G, nq, out->codes,  \
                             sc, ze));
            KV_PACK_K8(64, 1) KV_PACK_K8(64, 2) KV_PACK_K8(64, 4)
            KV_PACK_K8(128, 1) KV_PACK_K8(128, 2) KV_PACK_K8(128, 4)
#undef KV_PACK_K8
        } else if (axis == KV_KIVI_KEYS) { /* groups the 8-channel layout does not divide */
            CUDA_CHECK(kv_launch(KV_PDL_NONE, kivi_pack_keys, dim3(nq / G, H),
                                 dim3(KV_PACK_KEY_THREADS), 0, stream, xh, T, D, G, bits, nq,
                                 out->codes, sc, ze));
        } else if (!wide) {
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
        } else {
            int gv = G < D ? G : D;
            const int rows = (256 / (D / 8)) * KV_PACK_VROWS;
            dim3 grid((unsigned)((nq + rows - 1) / rows), (unsigned)H);
#define KV_PACK_V(DD, BB)                                                                     \
    if (D == DD && bits == BB)                                                                \
        CUDA_CHECK(kv_launch(KV_PDL_NONE, kivi_pack_values8<DD, BB>, grid, dim3(256), 0, stream, \
                             xh, T, nq, gv, out->codes, sc, ze));
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
