/*
 * eng_gemv_qv: variants of the packed decode GEMV (eng_gemv_q.cu is "old"),
 * y = W x with W (rows, cols) Q8_0, Q4_K or Q6_K blocks as stored (the
 * layout of kernels/eng_quant.cuh: PARTS lanes share a block, so a warp
 * reads consecutive bytes of a row), selected by name for kv-bench gemv and
 * by eng_gemvq_default for the engine.
 *
 * Why "old" is slow (device call 3: 0.46 TB/s on Q4_K): each lane reads its
 * 64 activations per block as float32, 1024 bytes of x from L1 per 144
 * bytes of weights, so L1 bandwidth, not HBM, bounds it; and every 4-bit
 * value costs an int-to-float conversion and an FMA.  Both variants here
 * give each warp R rows and load the lane's part of x once for all R:
 *   rows  float32 x in registers, reused across R rows; the Q4_K header
 *         (d, dmin, 12 scale bytes) read as one 16-byte load.  Same
 *         arithmetic as old (error ~1e-7 against float64).
 *   dp4a  x quantized per 32 values to int8 (d = max|x| / 127, plus the
 *         float sum of the 32 values for the Q4_K mins) by each block into
 *         shared memory, then 4 products per __dp4a on the packed nibbles or
 *         bytes.  1 byte of x per weight; the activations are rounded as the
 *         CPU path rounds them (kv_quant_activations: Q8_0 per 32, Q8_K per
 *         256), so the error against float64 is of that size (~1e-3), not 1e-7.
 * CPU reference: kv_quant_dequant_row / kv_quant_dot_ref (lib/model/kv_quants.h);
 * tests/unit/test_gpu_engine_data.c compares every variant with both.
 */
#include "eng_quant.cuh"

#define GQV_WARPS 4 /* warps per block: 16 rows a block keeps small matrices spread over the SMs */
#define GQV_R 4     /* rows per warp */

static __device__ __forceinline__ uint32_t gq_word(const uint4 &u, int w)
{
    return w == 0 ? u.x : w == 1 ? u.y : w == 2 ? u.z : u.w;
}

static __device__ __forceinline__ int gq_iword(const int4 &u, int w)
{
    return w == 0 ? u.x : w == 1 ? u.y : w == 2 ? u.z : u.w;
}

/*
 * Q4_K scales and mins 2p and 2p+1 (kv_ggml_k4_scale_min) from the block's
 * first 16 bytes h (d | dmin, scales 0-3, 4-7, 8-11), shifting by the lane's
 * p instead of indexing (an indexed register array would go to local memory).
 */
static __device__ __forceinline__ void gq_q4k_scales(const uint4 &h, int p, float *d0, float *n0, float *d1,
                                                     float *n1)
{
    const float d = kv_ggml_f16((uint16_t)(h.x & 0xffff)), dmin = kv_ggml_f16((uint16_t)(h.x >> 16));
    const int k = 8 * 2 * (p & 1);
    const uint32_t a = h.y >> k, b = h.z >> k, c = h.w >> k;
    uint32_t s0, m0, s1, m1;
    if (p < 2) {
        s0 = a & 63, m0 = b & 63, s1 = (a >> 8) & 63, m1 = (b >> 8) & 63;
    } else {
        s0 = (c & 15) | ((a >> 6) & 3) << 4, m0 = ((c >> 4) & 15) | ((b >> 6) & 3) << 4;
        s1 = ((c >> 8) & 15) | ((a >> 14) & 3) << 4, m1 = ((c >> 12) & 15) | ((b >> 14) & 3) << 4;
    }
    *d0 = __fmul_rn(d, (float)s0), *n0 = __fmul_rn(dmin, (float)m0);
    *d1 = __fmul_rn(d, (float)s1), *n1 = __fmul_rn(dmin, (float)m1);
}

// --- per-type products of R rows with the lane's part of block b ------------------

struct gq_q8_0 : eq_q8_0 {
    template <int R>
    static __device__ __forceinline__ void dot_f(const uint8_t *const *rp, int b, int p, const float *x, float *acc)
    {
        const float4 a = *reinterpret_cast<const float4 *>(x + 32 * b + 8 * p);
        const float4 c = *reinterpret_cast<const float4 *>(x + 32 * b + 8 * p + 4);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = rp[r] + (size_t)b * BYTES;
            const float d = kv_ggml_f16((uint16_t)eq_u16(blk));
            const uint32_t w0 = eq_u32(blk + 2 + 8 * p), w1 = eq_u32(blk + 6 + 8 * p);
            float s = eq_i8(w0, 0) * a.x + eq_i8(w0, 1) * a.y + eq_i8(w0, 2) * a.z + eq_i8(w0, 3) * a.w;
            s += eq_i8(w1, 0) * c.x + eq_i8(w1, 1) * c.y + eq_i8(w1, 2) * c.z + eq_i8(w1, 3) * c.w;
            acc[r] += d * s;
        }
    }

    template <int R>
    static __device__ __forceinline__ void dot_i(const uint8_t *const *rp, int b, int p, const int8_t *xq,
                                                 const float2 *ds, float *acc)
    {
        const int2 xv = *reinterpret_cast<const int2 *>(xq + 32 * b + 8 * p);
        const float dx = ds[b].x;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = rp[r] + (size_t)b * BYTES;
            const float d = kv_ggml_f16((uint16_t)eq_u16(blk));
            const int w0 = (int)eq_u32(blk + 2 + 8 * p), w1 = (int)eq_u32(blk + 6 + 8 * p);
            acc[r] += d * dx * (float)__dp4a(w1, xv.y, __dp4a(w0, xv.x, 0));
        }
    }
};

struct gq_q4_k : eq_q4_k {
    template <int R>
    static __device__ __forceinline__ void dot_f(const uint8_t *const *rp, int b, int p, const float *x, float *acc)
    {
        const float4 *xl = reinterpret_cast<const float4 *>(x + 256 * b + 64 * p), *xh = xl + 8;
        float4 a[8], c[8];
        float xsl = 0, xsh = 0;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            a[w] = xl[w], c[w] = xh[w];
            xsl += a[w].x + a[w].y + a[w].z + a[w].w;
            xsh += c[w].x + c[w].y + c[w].z + c[w].w;
        }
        uint4 h[R], u0[R], u1[R];
#pragma unroll
        for (int r = 0; r < R; r++) { /* all loads first: 3R 16-byte loads in flight */
            const uint4 *blk = reinterpret_cast<const uint4 *>(rp[r] + (size_t)b * BYTES);
            h[r] = __ldg(blk), u0[r] = __ldg(blk + 1 + 2 * p), u1[r] = __ldg(blk + 2 + 2 * p);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            float d0, n0, d1, n1;
            gq_q4k_scales(h[r], p, &d0, &n0, &d1, &n1);
            float sl = 0, sh = 0;
#pragma unroll
            for (int w = 0; w < 8; w++) {
                const uint32_t v = gq_word(w < 4 ? u0[r] : u1[r], w % 4);
                sl += (float)(v & 15) * a[w].x + (float)((v >> 8) & 15) * a[w].y +
                      (float)((v >> 16) & 15) * a[w].z + (float)((v >> 24) & 15) * a[w].w;
                sh += (float)((v >> 4) & 15) * c[w].x + (float)((v >> 12) & 15) * c[w].y +
                      (float)((v >> 20) & 15) * c[w].z + (float)(v >> 28) * c[w].w;
            }
            acc[r] += d0 * sl - n0 * xsl + d1 * sh - n1 * xsh;
        }
    }

    template <int R>
    static __device__ __forceinline__ void dot_i(const uint8_t *const *rp, int b, int p, const int8_t *xq,
                                                 const float2 *ds, float *acc)
    {
        const int4 *xw = reinterpret_cast<const int4 *>(xq + 256 * b + 64 * p);
        const int4 l0 = xw[0], l1 = xw[1], h0 = xw[2], h1 = xw[3];
        const float2 gl = ds[8 * b + 2 * p], gh = ds[8 * b + 2 * p + 1];
        uint4 h[R], u0[R], u1[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const uint4 *blk = reinterpret_cast<const uint4 *>(rp[r] + (size_t)b * BYTES);
            h[r] = __ldg(blk), u0[r] = __ldg(blk + 1 + 2 * p), u1[r] = __ldg(blk + 2 + 2 * p);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            float d0, n0, d1, n1;
            gq_q4k_scales(h[r], p, &d0, &n0, &d1, &n1);
            int sl = 0, sh = 0;
#pragma unroll
            for (int w = 0; w < 8; w++) {
                const int v = (int)gq_word(w < 4 ? u0[r] : u1[r], w % 4);
                sl = __dp4a(v & 0x0F0F0F0F, gq_iword(w < 4 ? l0 : l1, w % 4), sl);
                sh = __dp4a((v >> 4) & 0x0F0F0F0F, gq_iword(w < 4 ? h0 : h1, w % 4), sh);
            }
            acc[r] += d0 * gl.x * (float)sl - n0 * gl.y + d1 * gh.x * (float)sh - n1 * gh.y;
        }
    }
};

struct gq_q6_k : eq_q6_k {
    template <int R>
    static __device__ __forceinline__ void dot_f(const uint8_t *const *rp, int b, int p, const float *x, float *acc)
    {
        const int h = p >> 2, s = p & 3;
        const float4 *xv = reinterpret_cast<const float4 *>(x + 256 * b + 128 * h + 32 * s);
        float4 a[8];
#pragma unroll
        for (int k = 0; k < 8; k++) a[k] = xv[k];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = rp[r] + (size_t)b * BYTES;
            const float d = kv_ggml_f16((uint16_t)eq_u16(blk + offsetof(kv_block_q6_k, d)));
            const uint32_t scw = eq_u16(blk + offsetof(kv_block_q6_k, scales) + 8 * h + 2 * s);
            const uint8_t *ql = blk + 64 * h + 32 * (s % 2), *qh = blk + offsetof(kv_block_q6_k, qh) + 32 * h;
            float s0 = 0, s1 = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const uint32_t lo = eq_u32(ql + 4 * k), hi = eq_u32(qh + 4 * k);
                const float t = (float)q6(lo, hi, 0, s) * a[k].x + (float)q6(lo, hi, 1, s) * a[k].y +
                                (float)q6(lo, hi, 2, s) * a[k].z + (float)q6(lo, hi, 3, s) * a[k].w;
                if (k < 4) s0 += t;
                else s1 += t;
            }
            acc[r] += d * ((float)(int8_t)(scw & 0xff) * s0 + (float)(int8_t)(scw >> 8) * s1);
        }
    }

    template <int R>
    static __device__ __forceinline__ void dot_i(const uint8_t *const *rp, int b, int p, const int8_t *xq,
                                                 const float2 *ds, float *acc)
    {
        const int h = p >> 2, s = p & 3;
        const int4 *xw = reinterpret_cast<const int4 *>(xq + 256 * b + 32 * p); /* values 128h + 32s .. */
        const int4 x0 = xw[0], x1 = xw[1];
        const float dx = ds[8 * b + p].x;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = rp[r] + (size_t)b * BYTES;
            const float d = kv_ggml_f16((uint16_t)eq_u16(blk + offsetof(kv_block_q6_k, d)));
            const uint32_t scw = eq_u16(blk + offsetof(kv_block_q6_k, scales) + 8 * h + 2 * s);
            const uint8_t *ql = blk + 64 * h + 32 * (s % 2), *qh = blk + offsetof(kv_block_q6_k, qh) + 32 * h;
            int s0 = 0, s1 = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const uint32_t lo = eq_u32(ql + 4 * k), hi = eq_u32(qh + 4 * k);
                const uint32_t nib = (s < 2 ? lo : lo >> 4) & 0x0F0F0F0Fu;
                const uint32_t hb = ((hi >> (2 * s)) & 0x03030303u) << 4;
                const int q = (int)__vsub4(nib | hb, 0x20202020u); /* bytes q - 32 */
                if (k < 4) s0 = __dp4a(q, gq_iword(x0, k), s0);
                else s1 = __dp4a(q, gq_iword(x1, k - 4), s1);
            }
            acc[r] += d * dx * ((float)(int8_t)(scw & 0xff) * (float)s0 + (float)(int8_t)(scw >> 8) * (float)s1);
        }
    }
};

/*
 * x (n, a multiple of 32) into shared memory as int8 per 32 values: q, and
 * (d, sum of the 32 floats) per group.  A lane takes 4 consecutive values,
 * 8 lanes a group; loads are issued 4 deep before the reductions.
 */
static __device__ __forceinline__ void gq_quant_x(const float *__restrict__ x, int n, int8_t *q, float2 *ds)
{
    const int step = 4 * blockDim.x;
    /* the mask of the lane's group: a warp's groups may leave the loop apart */
    const unsigned gm = 0xffu << (threadIdx.x & 24);
#pragma unroll 4
    for (int i = 4 * threadIdx.x; i < n; i += step) {
        const float4 v = *reinterpret_cast<const float4 *>(x + i);
        float a = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
        float s = (v.x + v.y) + (v.z + v.w);
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) { /* the 8 lanes of the group */
            a = fmaxf(a, __shfl_xor_sync(gm, a, o));
            s += __shfl_xor_sync(gm, s, o);
        }
        const float id = a > 0.0f ? 127.0f / a : 0.0f;
        const uint32_t b0 = (uint32_t)(__float2int_rn(v.x * id) & 0xff), b1 = (uint32_t)(__float2int_rn(v.y * id) & 0xff);
        const uint32_t b2 = (uint32_t)(__float2int_rn(v.z * id) & 0xff), b3 = (uint32_t)(__float2int_rn(v.w * id) & 0xff);
        *reinterpret_cast<uint32_t *>(q + i) = b0 | b1 << 8 | b2 << 16 | b3 << 24;
        if ((i & 31) == 0) ds[i / 32] = make_float2(a / 127.0f, s);
    }
}

/* Bytes of shared memory the dp4a variant needs for cols activations. */
static size_t gq_smem(int cols) { return (size_t)cols + (size_t)(cols / 32) * sizeof(float2); }

template <class G, bool INT>
__global__ void __launch_bounds__(GQV_WARPS * 32)
gemv_qv_kernel(const uint8_t *__restrict__ W, size_t pitch, int rows, int nb, const float *__restrict__ x,
               float *__restrict__ y, int accumulate)
{
    extern __shared__ __align__(16) uint8_t gq_sm[];
    kv_pdl_launch_next();
    kv_pdl_wait(); /* x (and y when accumulating) come from the kernel before */
    const int cols = nb * G::QK;
    int8_t *xq = reinterpret_cast<int8_t *>(gq_sm);
    float2 *ds = reinterpret_cast<float2 *>(gq_sm + cols); /* cols is a multiple of 32 */
    if (INT) {
        gq_quant_x(x, cols, xq, ds);
        __syncthreads();
    }
    const int lane = threadIdx.x & 31;
    const int o0 = (blockIdx.x * GQV_WARPS + (threadIdx.x >> 5)) * GQV_R;
    if (o0 >= rows) return;
    const uint8_t *rp[GQV_R]; /* rows past the end repeat the last one, not stored */
#pragma unroll
    for (int r = 0; r < GQV_R; r++) rp[r] = W + (size_t)min(o0 + r, rows - 1) * pitch;
    constexpr int PER = 32 / G::PARTS;
    const int part = lane % G::PARTS;
    float acc[GQV_R];
#pragma unroll
    for (int r = 0; r < GQV_R; r++) acc[r] = 0.0f;
    for (int b = lane / G::PARTS; b < nb; b += PER) {
        if (INT) G::template dot_i<GQV_R>(rp, b, part, xq, ds, acc);
        else G::template dot_f<GQV_R>(rp, b, part, x, acc);
    }
#pragma unroll
    for (int r = 0; r < GQV_R; r++) {
        const float v = eng_warp_sum(acc[r]);
        if (lane == 0 && o0 + r < rows) y[o0 + r] = accumulate ? y[o0 + r] + v : v;
    }
}

template <class G>
static cudaError_t launch_qv(int variant, const void *W, size_t pitch, int rows, int cols, const float *x,
                             float *y, int accumulate, cudaStream_t s)
{
    KV_CHECK_ARGS(cols % G::QK == 0 && pitch >= (size_t)(cols / G::QK) * G::BYTES && (pitch & 1) == 0);
    const dim3 grid((unsigned)((rows + GQV_WARPS * GQV_R - 1) / (GQV_WARPS * GQV_R))), block(GQV_WARPS * 32);
    if (variant == KV_GEMV_DP4A) {
        const size_t sm = gq_smem(cols);
        KV_CHECK_ARGS(sm <= 48 * 1024 && ((uintptr_t)x & 15) == 0);
        CUDA_CHECK(kv_launch(1, gemv_qv_kernel<G, true>, grid, block, sm, s, (const uint8_t *)W, pitch, rows,
                             cols / G::QK, x, y, accumulate));
    } else {
        CUDA_CHECK(kv_launch(1, gemv_qv_kernel<G, false>, grid, block, 0, s, (const uint8_t *)W, pitch, rows,
                             cols / G::QK, x, y, accumulate));
    }
    return cudaSuccess;
}

/* The default picks, per type and shape, the faster of the two float
 * variants as `kv-bench gemv` measured them on the H200 (docs/BENCHMARKS.md,
 * lead's device call 4): rows for Q4_K (1.06-2.63x old on every shape), for
 * Q6_K with at least 4096 rows (1.44-1.87x; old is faster on 2048 rows and
 * fewer), for Q8_0 only with at least 65536 rows (old is faster below).
 * dp4a is faster still on tall matrices (Q4_K 128256x2048: 4.94x old) but
 * adds the activations' int8 rounding, which the engine tests' tolerances
 * against the float32 CPU engine were not set for: a measurement option. */
static inline int eng_gemvq_best(kv_dtype t, int rows, int cols)
{
    (void)cols;
    if (t == KV_DT_Q4_K) return KV_GEMV_ROWS;
    if (t == KV_DT_Q6_K) return rows >= 4096 ? KV_GEMV_ROWS : KV_GEMV_OLD;
    return rows >= 65536 ? KV_GEMV_ROWS : KV_GEMV_OLD;
}

extern "C" cudaError_t eng_gemv_qv(int variant, const void *W, kv_dtype t, int rows, int cols, size_t pitch,
                                   const float *x, float *y, int accumulate, cudaStream_t s)
{
    if (variant == KV_GEMV_DEFAULT) variant = eng_gemvq_best(t, rows, cols);
    /* wider than the dp4a variant's shared memory holds: the float one */
    if (variant == KV_GEMV_DP4A && gq_smem(cols) > 48 * 1024) variant = KV_GEMV_ROWS;
    if (variant == KV_GEMV_OLD) return eng_gemv_q(W, t, rows, cols, pitch, x, y, accumulate, s);
    KV_CHECK_ARGS(rows > 0 && cols > 0 && W && x && y && (variant == KV_GEMV_ROWS || variant == KV_GEMV_DP4A));
    switch (t) {
    case KV_DT_Q8_0: return launch_qv<gq_q8_0>(variant, W, pitch, rows, cols, x, y, accumulate, s);
    case KV_DT_Q4_K:
        KV_CHECK_ARGS(((uintptr_t)W & 15) == 0 && (pitch & 15) == 0);
        return launch_qv<gq_q4_k>(variant, W, pitch, rows, cols, x, y, accumulate, s);
    case KV_DT_Q6_K: return launch_qv<gq_q6_k>(variant, W, pitch, rows, cols, x, y, accumulate, s);
    default: KV_CHECK_ARGS(eng_packed_type(t));
    }
    return cudaErrorInvalidValue;
}
