/*
 * eng_kivi: the GPU engine's geometry-free KIVI dequantizer.  D's packed
 * attention (kernels/attn_kivi.cu) and pack kernels cover head_dim 64/128
 * and a few query groups; every other `quant` layer keeps the same packed
 * bytes resident (codes, scales and zeros in lib/common/kv_layout.h's planar
 * layout at the layer's full capacity, the fp16 residual in a ring of R+G
 * rows as lib/policy/kv_policy_quant.c keeps it) and, each step, expands them here
 * into an fp16 scratch that the fp16 attention then reads.  Correct, not
 * fast: every step rewrites T rows.  The arithmetic is the CPU's
 * (zero + scale * code in float, no FMA contraction), rounded to fp16 once.
 */
#include "eng_common.cuh"
#include "common/kv_layout.h"

/* zero[s] + scale[s] * code of column c of a packed row, as the CPU computes
 * it (in float, no FMA contraction); zero and scale hold fp16 bits. */
__device__ __forceinline__ static float expand_affine(const uint16_t *zero, const uint16_t *scale, size_t s,
                                                      const uint8_t *row, int c, int bits)
{
    float code = (float)kv_code_get(row, c, bits);
    return __fadd_rn(__half2float(__ushort_as_half(zero[s])), __fmul_rn(__half2float(__ushort_as_half(scale[s])), code));
}

/* Both expanders' launch: a thread an element of the (nkv, T, hd) output,
 * grid-strided past 65535 blocks of 256. */
template <typename Y>
static cudaError_t expand_launch(void (*kernel)(Y, int, uint16_t *, uint16_t *, size_t), const Y *y, int T,
                                 uint16_t *k, uint16_t *v, size_t ld, cudaStream_t s)
{
    size_t n = (size_t)y->nkv * (size_t)T * (size_t)y->hd;
    if (n == 0) return cudaSuccess;
    size_t blocks = (n + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    CUDA_CHECK(kv_launch(KV_PDL_NONE, kernel, dim3((unsigned)blocks), dim3(256), 0, s, *y, T, k, v, ld));
    return cudaSuccess;
}

__global__ void kivi_expand_kernel(eng_kivi_layer y, int T, uint16_t *ok, uint16_t *ov,
                                   size_t ld)
{
    const int hd = y.hd;
    const size_t n = (size_t)y.nkv * (size_t)T * (size_t)hd;
    const size_t rb = (size_t)hd * (size_t)y.bits / 8u;
    const int nvs = hd / y.gv;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        int c = (int)(i % (size_t)hd);
        int t = (int)((i / (size_t)hd) % (size_t)T);
        int h = (int)(i / ((size_t)hd * (size_t)T));
        __half kk, vv;
        if (t < y.nq) {
            size_t r = (size_t)h * (size_t)y.cap + (size_t)t;
            size_t ks = ((size_t)h * (size_t)y.ngk + (size_t)(t / y.group)) * (size_t)hd + (size_t)c;
            size_t vs = r * (size_t)nvs + (size_t)(c / y.gv);
            float kf = expand_affine(y.kz, y.ks, ks, y.kc + r * rb, c, y.bits);
            float vf = expand_affine(y.vz, y.vs, vs, y.vc + r * rb, c, y.bits);
            kk = __float2half_rn(kf);
            vv = __float2half_rn(vf);
        } else {
            size_t r = ((size_t)h * (size_t)y.ring + (size_t)(t % y.ring)) * (size_t)hd + (size_t)c;
            kk = __ushort_as_half(y.rk[r]);
            vv = __ushort_as_half(y.rv[r]);
        }
        size_t o = ((size_t)h * ld + (size_t)t) * (size_t)hd + (size_t)c;
        ok[o] = __half_as_ushort(kk);
        ov[o] = __half_as_ushort(vv);
    }
}

extern "C" cudaError_t eng_kivi_expand(const eng_kivi_layer *y, int T, uint16_t *k, uint16_t *v,
                                       size_t ld, cudaStream_t s)
{
    return expand_launch(kivi_expand_kernel, y, T, k, v, ld, s);
}

// --- DSQ ---------------------------------------------------------------------

/* Rank of token i among the salient (set) or the other tokens of its window. */
__device__ static int dsq_rank(const uint8_t *mask, int i, int salient)
{
    int r = 0;
    for (int b = 0; b < (i >> 3); b++) r += __popc((unsigned)mask[b]);
    r += __popc((unsigned)mask[i >> 3] & ((1u << (i & 7)) - 1u));
    return salient ? r : i - r;
}

__global__ void dsq_expand_kernel(eng_dsq_layer y, int T, uint16_t *ok, uint16_t *ov, size_t ld)
{
    const int hd = y.hd, W = y.window, S = y.salient, nn = W - S, nvs = hd / y.gd;
    const size_t n = (size_t)y.nkv * (size_t)T * (size_t)hd;
    const size_t rbk = (size_t)hd * (size_t)y.kbits / 8u, rbv = (size_t)hd * (size_t)y.vbits / 8u;
    const int mb = W / 8;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        int c = (int)(i % (size_t)hd);
        int t = (int)((i / (size_t)hd) % (size_t)T);
        int h = (int)(i / ((size_t)hd * (size_t)T));
        float kf, vf;
        if (t < y.packed * W) {
            int w = t / W, j = t % W;
            size_t hw = (size_t)h * (size_t)y.nwmax + (size_t)w;
            const uint8_t *mask = y.mask + hw * (size_t)mb;
            const uint8_t *vmask = y.vmask ? y.vmask + hw * (size_t)mb : mask;
            if (kv_dsq_mask_get(mask, j)) {
                size_t r = (hw * (size_t)S + (size_t)dsq_rank(mask, j, 1)) * (size_t)hd + (size_t)c;
                kf = __fmul_rn(__half2float(__ushort_as_half(y.ksscale[hw * hd + c])), (float)y.ksal[r]);
            } else {
                size_t r = hw * (size_t)nn + (size_t)dsq_rank(mask, j, 0);
                size_t so = r * (size_t)nvs + (size_t)(c / y.gd);
                kf = expand_affine(y.kzero, y.kscale, so, y.kcodes + r * rbk, c, y.kbits);
                kf = __fadd_rn(__half2float(__ushort_as_half(y.kbase[hw * hd + c])), kf);
            }
            if (kv_dsq_mask_get(vmask, j)) {
                size_t r = (hw * (size_t)S + (size_t)dsq_rank(vmask, j, 1)) * (size_t)hd + (size_t)c;
                vf = __fmul_rn(__half2float(__ushort_as_half(y.vsscale[hw * hd + c])), (float)y.vsal[r]);
            } else {
                size_t r = hw * (size_t)nn + (size_t)dsq_rank(vmask, j, 0);
                size_t so = r * (size_t)nvs + (size_t)(c / y.gd);
                vf = expand_affine(y.vzero, y.vscale, so, y.vcodes + r * rbv, c, y.vbits);
            }
        } else {
            size_t r = ((size_t)h * (size_t)y.ring + (size_t)(t % y.ring)) * (size_t)hd + (size_t)c;
            kf = __half2float(__ushort_as_half(y.rk[r]));
            vf = __half2float(__ushort_as_half(y.rv[r]));
        }
        size_t o = ((size_t)h * ld + (size_t)t) * (size_t)hd + (size_t)c;
        ok[o] = __half_as_ushort(__float2half_rn(kf));
        ov[o] = __half_as_ushort(__float2half_rn(vf));
    }
}

extern "C" cudaError_t eng_dsq_expand(const eng_dsq_layer *y, int T, uint16_t *k, uint16_t *v,
                                      size_t ld, cudaStream_t s)
{
    return expand_launch(dsq_expand_kernel, y, T, k, v, ld, s);
}

/* One block per KV head; its query heads in order, as the CPU policy adds
 * them, so the sums are deterministic. */
__global__ void attn_importance_kernel(const float *q, const uint16_t *K, int grp, int hd, int T,
                                       size_t ld, float scale, float *sc, float *imp,
                                       size_t imp_ld)
{
    __shared__ float red[32];
    const int h = blockIdx.x;
    const __half *k = reinterpret_cast<const __half *>(K) + (size_t)h * ld * (size_t)hd;
    float *s = sc + (size_t)h * (size_t)T;
    float *im = imp + (size_t)h * imp_ld;
    for (int j = 0; j < grp; j++) {
        const float *qj = q + ((size_t)h * grp + (size_t)j) * (size_t)hd;
        float mx = -INFINITY;
        for (int t = threadIdx.x; t < T; t += blockDim.x) {
            float d = 0.0f;
            for (int c = 0; c < hd; c++) d += qj[c] * __half2float(k[(size_t)t * hd + c]);
            d *= scale;
            s[t] = d;
            mx = fmaxf(mx, d);
        }
        mx = eng_block_max(mx, red);
        float sum = 0.0f;
        for (int t = threadIdx.x; t < T; t += blockDim.x) {
            float e = expf(s[t] - mx);
            s[t] = e;
            sum += e;
        }
        sum = eng_block_sum(sum, red);
        for (int t = threadIdx.x; t < T; t += blockDim.x) im[t] += s[t] / sum;
        __syncthreads();
    }
}

extern "C" cudaError_t eng_attn_importance(const float *q, const uint16_t *K, int nq_heads,
                                           int nkv, int hd, int T, size_t ld, float scale,
                                           float *scratch, float *imp, size_t imp_ld,
                                           cudaStream_t s)
{
    CUDA_CHECK(kv_launch(KV_PDL_NONE, attn_importance_kernel, dim3(nkv), dim3(256), 0, s, q, K,
                         nq_heads / nkv, hd, T, ld, scale, scratch, imp, imp_ld));
    return cudaSuccess;
}
