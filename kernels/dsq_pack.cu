/*
 * DSQ pack/unpack kernels and their launchers (see dsq_pack.cuh).
 */
#include "dsq_pack.cuh"

/* Pack window blockIdx.x of head blockIdx.y.  Dynamic shared memory:
 * (W - S) * D floats of non-salient rows (key deltas or values). */
__global__ void dsq_pack_window_kernel(kv_kivi_axis axis, int W, int S, int bits, int gd, int base,
                                       int T, int D, int nw, const __half *__restrict__ x,
                                       const float *__restrict__ imp, kv_cuda_dsq_out o)
{
    __shared__ int sidx[KV_DSQ_MAX_WINDOW], nidx[KV_DSQ_MAX_WINDOW];
    extern __shared__ float rows[]; /* (W - S, D) */
    const int w = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
    const size_t hw = (size_t)h * nw + w;
    const __half *xw = x + ((size_t)h * T + (size_t)w * W) * D;

    if (c == 0) {
        const float *iw = imp + (size_t)h * T + (size_t)w * W;
        bool taken[KV_DSQ_MAX_WINDOW];
        for (int t = 0; t < W; t++) taken[t] = false;
        for (int s = 0; s < S; s++) {
            int best = -1;
            float bv = -INFINITY;
            for (int t = 0; t < W; t++) {
                float v = isnan(iw[t]) ? -INFINITY : iw[t];
                if (!taken[t] && (best < 0 || v > bv)) {
                    best = t;
                    bv = v;
                }
            }
            taken[best] = true;
        }
        int is = 0, in = 0;
        for (int t = 0; t < W; t++) {
            if (taken[t]) sidx[is++] = t;
            else nidx[in++] = t;
        }
        for (int b = 0; b < W / 8; b++) {
            unsigned m = 0;
            for (int i = 0; i < 8; i++) m |= (taken[8 * b + i] ? 1u : 0u) << i;
            o.mask[hw * (W / 8) + b] = (uint8_t)m;
        }
    }
    __syncthreads();

    /* Per channel: INT8 scale over the salient rows, key base. */
    float amax = 0.0f;
    double sum = 0.0;
    for (int i = 0; i < S; i++) {
        float v = __half2float(xw[(size_t)sidx[i] * D + c]);
        float a = fabsf(v);
        amax = a > amax ? a : amax;
        sum += (double)v;
    }
    const __half hs = __float2half_rn(__fdiv_rn(amax, 127.0f));
    o.sscale[hw * D + c] = __half_as_ushort(hs);
    const float s = __half2float(hs);
    const float sdiv = (s > 0.0f && s < INFINITY) ? s : INFINITY;
    float bf = 0.0f;
    if (axis == KV_KIVI_KEYS) {
        /* the mean of the salient keys, or of the others (KV_DSQ_BASE_REST),
         * in token order as lib/quant/kv_dsq.c sums them; of all W when the
         * set is empty */
        const bool rest = base == KV_DSQ_BASE_REST && S < W;
        int nb = rest ? W - S : S;
        if (rest) {
            sum = 0.0;
            for (int i = 0; i < W - S; i++) sum += (double)__half2float(xw[(size_t)nidx[i] * D + c]);
        } else if (S == 0) {
            for (int t = 0; t < W; t++) sum += (double)__half2float(xw[(size_t)t * D + c]);
            nb = W;
        }
        const __half hb = __float2half_rn((float)__ddiv_rn(sum, (double)nb));
        o.base[hw * D + c] = __half_as_ushort(hb);
        bf = __half2float(hb);
    }
    for (int i = 0; i < S; i++) {
        float v = rintf(__fdiv_rn(__half2float(xw[(size_t)sidx[i] * D + c]), sdiv));
        v = v > -127.0f ? v : -127.0f;
        v = v < 127.0f ? v : 127.0f;
        o.sal[(hw * S + i) * D + c] = (int8_t)(int)v;
    }
    const int nn = W - S;
    for (int i = 0; i < nn; i++) {
        float v = __half2float(xw[(size_t)nidx[i] * D + c]);
        rows[i * D + c] = axis == KV_KIVI_KEYS ? __fsub_rn(v, bf) : v;
    }
    __syncthreads();

    /* Non-salient rows: a thread per (row, channel group) for scale and
     * zero, then a thread per (row, code byte). */
    const int ng = D / gd;
    const float maxq = (float)((1 << bits) - 1);
    __shared__ float gsd[KV_DSQ_MAX_WINDOW * 4], gz[KV_DSQ_MAX_WINDOW * 4];
    for (int j = c; j < nn * ng; j += blockDim.x) {
        const float *r = rows + (j / ng) * D + (j % ng) * gd;
        float mn = r[0], mx = r[0];
        for (int k = 1; k < gd; k++) {
            mn = r[k] < mn ? r[k] : mn;
            mx = r[k] > mx ? r[k] : mx;
        }
        __half hsc, hz;
        kv_kivi_group_params(mn, mx, maxq, &hsc, &hz, &gsd[j], &gz[j]);
        o.scale[(hw * nn) * ng + j] = __half_as_ushort(hsc);
        o.zero[(hw * nn) * ng + j] = __half_as_ushort(hz);
    }
    __syncthreads();
    const int rb = D * bits / 8;
    for (int j = c; j < nn * rb; j += blockDim.x) {
        const int i = j / rb, byte = j % rb, per = 8 / bits;
        unsigned v = 0;
        for (int k = 0; k < per; k++) {
            const int ch = byte * per + k, gi = i * ng + ch / gd;
            const float sd = gsd[gi];
            v |= kv_kivi_code(rows[i * D + ch], sd, __frcp_rn(sd), gz[gi], maxq) << (k * bits);
        }
        o.codes[(hw * nn + i) * rb + byte] = (uint8_t)v;
    }
}

/* Unpack window blockIdx.x of head blockIdx.y into out (H, T, D) float. */
__global__ void dsq_unpack_window_kernel(kv_kivi_axis axis, int W, int S, int bits, int gd, int T,
                                         int D, int nw, kv_cuda_dsq_view in, float *__restrict__ out)
{
    const int w = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
    const size_t hw = (size_t)h * nw + w;
    const uint8_t *mask = in.mask + hw * (W / 8);
    const int nn = W - S, ng = D / gd, rb = D * bits / 8;
    const float ss = __half2float(__ushort_as_half(in.sscale[hw * D + c]));
    const float bf = axis == KV_KIVI_KEYS ? __half2float(__ushort_as_half(in.base[hw * D + c])) : 0.0f;
    float *ow = out + ((size_t)h * T + (size_t)w * W) * D;
    int is = 0, i = 0;
    for (int t = 0; t < W; t++) {
        float v;
        if (kv_dsq_mask_get(mask, t)) {
            v = __fmul_rn(ss, (float)in.sal[(hw * S + is++) * D + c]);
        } else {
            const size_t gi = (hw * nn + i) * ng + c / gd;
            const float sc = __half2float(__ushort_as_half(in.scale[gi]));
            const float z = __half2float(__ushort_as_half(in.zero[gi]));
            const unsigned code = kv_code_get(in.codes + (hw * nn + i) * rb, c, bits);
            v = __fadd_rn(z, __fmul_rn(sc, (float)code));
            if (axis == KV_KIVI_KEYS) v = __fadd_rn(bf, v);
            i++;
        }
        ow[(size_t)t * D + c] = v;
    }
}

/* fp16 residual rows: copy (pack) or widen (unpack), one thread per value. */
__global__ void dsq_resid_kernel(int H, int T, int D, int t0, const __half *__restrict__ x,
                                 uint16_t *__restrict__ resid, const uint16_t *__restrict__ rin,
                                 float *__restrict__ out)
{
    const size_t nr = (size_t)(T - t0) * D, n = (size_t)H * nr;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (size_t)gridDim.x * blockDim.x) {
        const size_t h = k / nr, r = k % nr, src = (h * T + t0) * D + r;
        if (x) resid[k] = __half_as_ushort(x[src]);
        else out[src] = __half2float(__ushort_as_half(rin[k]));
    }
}

extern "C" int kv_cuda_dsq_supported(const kv_dsq_params *p, int head_dim)
{
    if (!p || (head_dim != 64 && head_dim != 128) || p->window < 8 || p->window % 8 ||
        p->window > KV_DSQ_MAX_WINDOW || p->salient < 0 || p->salient > p->window ||
        (p->bits != 1 && p->bits != 2 && p->bits != 4) || p->group < 1 ||
        (p->base != KV_DSQ_BASE_SALIENT && p->base != KV_DSQ_BASE_REST))
        return 0;
    int gd = kv_kivi_vgroup(p->group, head_dim);
    return head_dim % gd == 0 && head_dim / gd <= 4 && gd >= 8 / p->bits;
}

static int dsq_args_ok(const kv_dsq_params *p, int H, int T, int D)
{
    return kv_cuda_dsq_supported(p, D) && H >= 1 && T >= 0;
}

extern "C" cudaError_t kv_cuda_dsq_pack(kv_kivi_axis axis, const kv_dsq_params *p, int H, int T,
                                        int D, const uint16_t *x, const float *imp,
                                        const kv_cuda_dsq_out *out, cudaStream_t stream)
{
    KV_CHECK_ARGS(dsq_args_ok(p, H, T, D) && x && imp && out);
    const int nw = kv_dsq_nwindows(T, p->window), gd = kv_kivi_vgroup(p->group, D);
    const __half *xh = reinterpret_cast<const __half *>(x);
    if (nw > 0) {
        size_t smem = (size_t)(p->window - p->salient) * D * sizeof(float);
        CUDA_CHECK(cudaFuncSetAttribute(dsq_pack_window_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CUDA_CHECK(kv_launch(KV_PDL_NONE, dsq_pack_window_kernel, dim3(nw, H), dim3(D), smem,
                             stream, axis, p->window, p->salient, p->bits, gd, p->base, T, D, nw,
                             xh, imp, *out));
    }
    if (T > nw * p->window) {
        CUDA_CHECK(kv_launch(KV_PDL_NONE, dsq_resid_kernel, dim3(256), dim3(256), 0, stream, H, T,
                             D, nw * p->window, xh, out->resid, nullptr, nullptr));
    }
    return cudaSuccess;
}

extern "C" cudaError_t kv_cuda_dsq_unpack(kv_kivi_axis axis, const kv_dsq_params *p, int H, int T,
                                          int D, const kv_cuda_dsq_view *in, float *out,
                                          cudaStream_t stream)
{
    KV_CHECK_ARGS(dsq_args_ok(p, H, T, D) && in && out);
    const int nw = kv_dsq_nwindows(T, p->window), gd = kv_kivi_vgroup(p->group, D);
    if (nw > 0) {
        CUDA_CHECK(kv_launch(KV_PDL_NONE, dsq_unpack_window_kernel, dim3(nw, H), dim3(D), 0, stream,
                             axis, p->window, p->salient, p->bits, gd, T, D, nw, *in, out));
    }
    if (T > nw * p->window) {
        CUDA_CHECK(kv_launch(KV_PDL_NONE, dsq_resid_kernel, dim3(256), dim3(256), 0, stream, H, T,
                             D, nw * p->window, nullptr, nullptr, in->resid, out));
    }
    return cudaSuccess;
}
