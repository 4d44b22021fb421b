/*
 * KIVI pack/unpack kernels and their launchers (see kivi_pack.cuh).
 */
#include "kivi_pack.cuh"

/* Keys: grid (ngroups, H). */
__global__ void __launch_bounds__(KV_PACK_KEY_THREADS)
    kivi_pack_keys(const __half *__restrict__ x, int T, int D, int G, int bits, int nq,
                   uint8_t *__restrict__ codes, __half *__restrict__ scale,
                   __half *__restrict__ zero)
{
    __shared__ __align__(16) __half tile[KV_PACK_MAX_TILE];
    __shared__ float sdiv[KV_PACK_KEY_THREADS], zs[KV_PACK_KEY_THREADS];
    const int gi = blockIdx.x, h = blockIdx.y, ng = gridDim.x;
    const float maxq = (float)((1 << bits) - 1);
    const __half *src = x + ((size_t)h * T + (size_t)gi * G) * D;
    const int n16 = G * D / 8;
    for (int i = threadIdx.x; i < n16; i += KV_PACK_KEY_THREADS)
        reinterpret_cast<uint4 *>(tile)[i] = __ldg(reinterpret_cast<const uint4 *>(src) + i);
    __syncthreads();
    const int c = threadIdx.x;
    if (c < D) {
        float mn = __half2float(tile[c]), mx = mn;
        for (int t = 1; t < G; t++) {
            float v = __half2float(tile[t * D + c]);
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
        }
        __half hs, hz;
        kv_kivi_group_params(mn, mx, maxq, &hs, &hz, &sdiv[c], &zs[c]);
        scale[((size_t)h * ng + gi) * D + c] = hs;
        zero[((size_t)h * ng + gi) * D + c] = hz;
    }
    __syncthreads();
    const int wpr = D * bits / 32, cpw = 32 / bits; /* words per row, codes per word */
    uint32_t *out = reinterpret_cast<uint32_t *>(codes + ((size_t)h * nq + (size_t)gi * G) * D * bits / 8);
    for (int w = threadIdx.x; w < G * wpr; w += KV_PACK_KEY_THREADS) {
        const int t = w / wpr, c0 = (w % wpr) * cpw;
        uint32_t word = 0;
        for (int i = 0; i < cpw; i++) {
            int cc = c0 + i;
            word |= kv_kivi_code(__half2float(tile[t * D + cc]), sdiv[cc], zs[cc], maxq) << (i * bits);
        }
        out[w] = word;
    }
}

/* Values: one thread per (head, token, value group); GV channels. */
template <int GV, int BITS>
__global__ void kivi_pack_values(const __half *__restrict__ x, int H, int T, int D, int nq, uint8_t *__restrict__ codes, __half *__restrict__ scale,
                                 __half *__restrict__ zero)
{
    const int ngv = D / GV;
    const size_t n = (size_t)H * nq * ngv;
    const size_t id = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= n) return;
    const int g = (int)(id % ngv);
    const size_t ht = id / ngv; /* h * nq + t */
    const int h = (int)(ht / nq), t = (int)(ht % nq);
    const uint4 *src = reinterpret_cast<const uint4 *>(x + ((size_t)h * T + t) * D + (size_t)g * GV);
    float v[GV];
#pragma unroll
    for (int i = 0; i < GV / 8; i++) {
        uint4 u = __ldg(src + i);
        const __half2 *p = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float2 f = __half22float2(p[j]);
            v[8 * i + 2 * j] = f.x;
            v[8 * i + 2 * j + 1] = f.y;
        }
    }
    float mn = v[0], mx = v[0];
#pragma unroll
    for (int i = 1; i < GV; i++) {
        mn = v[i] < mn ? v[i] : mn;
        mx = v[i] > mx ? v[i] : mx;
    }
    const float maxq = (float)((1 << BITS) - 1);
    __half hs, hz;
    float sd, z;
    kv_kivi_group_params(mn, mx, maxq, &hs, &hz, &sd, &z);
    scale[ht * ngv + g] = hs;
    zero[ht * ngv + g] = hz;
    constexpr int CPW = 32 / BITS, NW = GV * BITS / 32; /* codes per word, words */
    uint32_t *out = reinterpret_cast<uint32_t *>(codes + ht * D * BITS / 8 + (size_t)g * GV * BITS / 8);
#pragma unroll
    for (int w = 0; w < NW; w++) {
        uint32_t word = 0;
#pragma unroll
        for (int i = 0; i < CPW; i++) word |= kv_kivi_code(v[w * CPW + i], sd, z, maxq) << (i * BITS);
        out[w] = word;
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
        prm->residual < 0 || head_dim < 32 || head_dim > 128 || head_dim % 32)
        return 0;
    if (axis == KV_KIVI_KEYS) return prm->group * head_dim <= KV_PACK_MAX_TILE;
    int gv = prm->group < head_dim ? prm->group : head_dim;
    return head_dim % gv == 0 && (gv == 32 || gv == 64 || gv == 128);
}

extern "C" cudaError_t kv_cuda_kivi_pack(kv_kivi_axis axis, const kv_kivi_params *prm, int H,
                                         int T, int D, const uint16_t *x,
                                         const kv_cuda_kivi_out *out, cudaStream_t stream)
{
    if (!kv_cuda_kivi_pack_supported(axis, prm, D) || H < 1 || T < 0 || !x || !out) {
        kv_cuda_record(cudaErrorInvalidValue, "kv_cuda_kivi_pack argument check", __FILE__, __LINE__);
        return cudaErrorInvalidValue;
    }
    const __half *xh = reinterpret_cast<const __half *>(x);
    __half *sc = reinterpret_cast<__half *>(out->scale), *ze = reinterpret_cast<__half *>(out->zero);
    const int G = prm->group, bits = prm->bits;
    const int nq = kv_kivi_nquant(T, G, prm->residual);
    if (nq > 0) {
        if (axis == KV_KIVI_KEYS) {
            kivi_pack_keys<<<dim3(nq / G, H), KV_PACK_KEY_THREADS, 0, stream>>>(
                xh, T, D, G, bits, nq, out->codes, sc, ze);
            CUDA_CHECK_KERNEL("kivi_pack_keys");
        } else {
            int gv = G < D ? G : D;
            size_t n = (size_t)H * nq * (D / gv);
            unsigned blocks = (unsigned)((n + 127) / 128);
#define KV_PACK_V(GVV, BB)                                                                   \
    if (gv == GVV && bits == BB)                                                             \
        kivi_pack_values<GVV, BB><<<blocks, 128, 0, stream>>>(xh, H, T, D, nq, out->codes, sc, ze);
            KV_PACK_V(32, 1) KV_PACK_V(32, 2) KV_PACK_V(32, 4)
            KV_PACK_V(64, 1) KV_PACK_V(64, 2) KV_PACK_V(64, 4)
            KV_PACK_V(128, 1) KV_PACK_V(128, 2) KV_PACK_V(128, 4)
#undef KV_PACK_V
            CUDA_CHECK_KERNEL("kivi_pack_values");
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
    if (!kv_cuda_kivi_pack_supported(axis, prm, D) || H < 1 || T < 1 || !in || !out) {
        kv_cuda_record(cudaErrorInvalidValue, "kv_cuda_kivi_unpack argument check", __FILE__, __LINE__);
        return cudaErrorInvalidValue;
    }
    const int nq = kv_kivi_nquant(T, prm->group, prm->residual);
    size_t n = (size_t)H * T * (D / 8);
    kivi_unpack<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(
        axis, H, T, D, prm->group, prm->bits, nq, in->codes,
        reinterpret_cast<const __half *>(in->scale), reinterpret_cast<const __half *>(in->zero),
        reinterpret_cast<const __half *>(in->resid), reinterpret_cast<__half *>(out));
    CUDA_CHECK_KERNEL("kivi_unpack");
    return cudaSuccess;
}
