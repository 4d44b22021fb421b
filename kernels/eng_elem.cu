/*
 * eng_elem: the engine's small kernels — RMSNorm, SwiGLU, RoPE with the K/V
 * store, argmax, seeded fills for synthetic caches, and the layout changes
 * and key statistics a sparse layer needs when it takes a prompt's cache.
 * Each is one launch over data of a few KB per decode step (or one pass over
 * a layer's cache at ingest); the arithmetic mirrors lib/engine/kv_engine.c so the
 * GPU engine stays within fp16 rounding of the CPU one.
 */
#include "eng_common.cuh"

// --- RMSNorm, SwiGLU --------------------------------------------------------

__global__ void rmsnorm_kernel(const float *x, const float *w, int n, float eps, float *o)
{
    __shared__ float red[32];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    ss = eng_block_sum(ss, red);
    ss = ss / (float)n + eps;
    float r = 1.0f / sqrtf(ss);
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = w[i] * (r * x[i]);
}

extern "C" cudaError_t eng_rmsnorm(const float *x, const float *w, int n, float eps, float *o,
                                   cudaStream_t s)
{
    CUDA_CHECK(kv_launch(KV_PDL_NONE, rmsnorm_kernel, dim3(1), dim3(1024), 0, s, x, w, n, eps, o));
    return cudaSuccess;
}

__global__ void swiglu_kernel(const float *gu, int n, float *h)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float g = gu[i];
        g *= 1.0f / (1.0f + expf(-g));
        h[i] = g * gu[n + i];
    }
}

extern "C" cudaError_t eng_swiglu(const float *gu, int n, float *h, cudaStream_t s)
{
    CUDA_CHECK(kv_launch(KV_PDL_NONE, swiglu_kernel, dim3((n + 255) / 256), dim3(256), 0, s, gu, n,
                         h));
    return cudaSuccess;
}

// --- biases ------------------------------------------------------------------

__global__ void add_bias_kernel(float *y, long long ldy, const float *b, int n, int rows)
{
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        float *row = y + (size_t)r * ldy;
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) row[i] += b[i];
    }
}

extern "C" cudaError_t eng_add_bias_rows(float *y, long long ldy, const float *b, int n, int rows,
                                         cudaStream_t s)
{
    if (n <= 0 || rows <= 0) return cudaSuccess;
    KV_CHECK_ARGS(y && b && (rows == 1 || ldy >= n));
    const unsigned gy = (unsigned)(rows < 65535 ? rows : 65535);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, add_bias_kernel, dim3((unsigned)((n + 255) / 256), gy), dim3(256), 0, s,
                         y, ldy, b, n, rows));
    return cudaSuccess;
}

// --- RoPE and the K/V store --------------------------------------------------

__global__ void rope_store_kernel(float *q, __half *q16, int nqh, float *k, const float *v,
                                  int nkv, int hd, const float *inv_freq, int pos, __half *kdst,
                                  __half *vdst, size_t head_stride)
{
    kv_pdl_launch_next();
    kv_pdl_wait(); /* q, k, v come from the kernel before */
    const int half = hd / 2;
    const int npairs = (nqh + nkv) * half;
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < npairs; p += gridDim.x * blockDim.x) {
        int head = p / half, i = p % half;
        float a = (float)pos * inv_freq[i]; /* float angle, as the CPU engine */
        float c = cosf(a), sn = sinf(a);
        float *vec = head < nqh ? q + (size_t)head * hd : k + (size_t)(head - nqh) * hd;
        float x0 = vec[2 * i], x1 = vec[2 * i + 1];
        float y0 = x0 * c - x1 * sn, y1 = x0 * sn + x1 * c;
        vec[2 * i] = y0;
        vec[2 * i + 1] = y1;
        if (head < nqh) {
            if (q16) {
                q16[(size_t)head * hd + 2 * i] = __float2half_rn(y0);
                q16[(size_t)head * hd + 2 * i + 1] = __float2half_rn(y1);
            }
        } else if (kdst) {
            int h = head - nqh;
            __half *kd = kdst + (size_t)h * head_stride;
            __half *vd = vdst + (size_t)h * head_stride;
            kd[2 * i] = __float2half_rn(y0);
            kd[2 * i + 1] = __float2half_rn(y1);
            vd[2 * i] = __float2half_rn(v[(size_t)h * hd + 2 * i]);
            vd[2 * i + 1] = __float2half_rn(v[(size_t)h * hd + 2 * i + 1]);
        }
    }
}

extern "C" cudaError_t eng_rope_store(float *q, uint16_t *q16, int nq_heads, float *k,
                                      const float *v, int nkv, int hd, const float *inv_freq,
                                      int pos, uint16_t *kdst, uint16_t *vdst, size_t head_stride,
                                      cudaStream_t s)
{
    int npairs = (nq_heads + nkv) * hd / 2;
    unsigned blocks = (unsigned)((npairs + 255) / 256);
    CUDA_CHECK(kv_launch(2, rope_store_kernel, dim3(blocks), dim3(256), 0, s, q, (__half *)q16,
                         nq_heads, k, v, nkv, hd, inv_freq, pos, (__half *)kdst, (__half *)vdst,
                         head_stride));
    return cudaSuccess;
}

// --- argmax --------------------------------------------------------------------

__global__ void argmax_kernel(const float *x, int n, int *out)
{
    __shared__ float bv[32];
    __shared__ int bi[32];
    float best = -INFINITY;
    int idx = n; /* NaN-only input still yields a valid index below */
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (idx == n || x[i] > best) { /* strictly greater: ties keep the lower index */
            best = x[i];
            idx = i;
        }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) {
            best = ov;
            idx = oi;
        }
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) {
        bv[w] = best;
        bi[w] = idx;
    }
    __syncthreads();
    if (w == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? bv[lane] : -INFINITY;
        idx = lane < nw ? bi[lane] : n;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > best || (ov == best && oi < idx)) {
                best = ov;
                idx = oi;
            }
        }
        if (lane == 0) *out = idx < n ? idx : 0;
    }
}

extern "C" cudaError_t eng_argmax(const float *x, int n, int *out, cudaStream_t s)
{
    CUDA_CHECK(kv_launch(KV_PDL_NONE, argmax_kernel, dim3(1), dim3(1024), 0, s, x, n, out));
    return cudaSuccess;
}

// --- seeded fills ----------------------------------------------------------------

static __device__ __forceinline__ uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Sum of four uniforms, centred and scaled to unit variance: cheap and
 * Gaussian enough for synthetic keys and values. */
static __device__ __forceinline__ float rand_normalish(uint64_t seed, size_t i)
{
    uint64_t r = mix64(seed ^ mix64((uint64_t)i));
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) s += (float)((r >> (16 * j)) & 0xffff) * (1.0f / 65536.0f);
    return (s - 2.0f) * 1.7320508f;
}

template <typename TT>
__global__ void fill_random_kernel(typename TT::T *x, size_t n, uint64_t seed, const float *scale,
                                   int nscale, size_t stride)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float sc = scale ? scale[(i / stride) % (size_t)nscale] : 1.0f;
        x[i] = TT::from(rand_normalish(seed, i) * sc);
    }
}

extern "C" cudaError_t eng_fill_random(void *x, kv_dtype t, size_t n, uint64_t seed,
                                       const float *scale, int nscale, size_t stride,
                                       cudaStream_t s)
{
    if (stride == 0) stride = 1;
    if (nscale <= 0) nscale = 1;
    if (t == KV_DT_BF16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, fill_random_kernel<eng_bf16>, dim3(1024), dim3(256), 0, s,
                             (__nv_bfloat16 *)x, n, seed, scale, nscale, stride));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, fill_random_kernel<eng_f16>, dim3(1024), dim3(256), 0, s,
                             (__half *)x, n, seed, scale, nscale, stride));
    return cudaSuccess;
}

__global__ void fill_f32_kernel(float *x, size_t n, float value)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = value;
}

extern "C" cudaError_t eng_fill_f32(float *x, size_t n, float value, cudaStream_t s)
{
    CUDA_CHECK(kv_launch(KV_PDL_NONE, fill_f32_kernel, dim3(256), dim3(256), 0, s, x, n, value));
    return cudaSuccess;
}

// --- layouts for sparse layers ----------------------------------------------------

/* rows (T, nkv, 2, hd) from K, V (nkv, ld, hd); 16-bit elements moved as such. */
__global__ void to_rows_kernel(const uint16_t *k, const uint16_t *v, int nkv, int T, int ld,
                               int hd, uint16_t *rows)
{
    size_t n = (size_t)T * nkv * 2 * hd;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        int c = (int)(i % hd);
        size_t r = i / hd;
        int which = (int)(r % 2);
        int h = (int)((r / 2) % nkv);
        size_t t = r / 2 / nkv;
        const uint16_t *src = which ? v : k;
        rows[i] = src[((size_t)h * ld + t) * hd + c];
    }
}

extern "C" cudaError_t eng_to_row_layout(const void *k, const void *v, int nkv, int T, int ld,
                                         int hd, kv_dtype t, void *rows, cudaStream_t s)
{
    (void)t;
    CUDA_CHECK(kv_launch(KV_PDL_NONE, to_rows_kernel, dim3(2048), dim3(256), 0, s,
                         (const uint16_t *)k, (const uint16_t *)v, nkv, T, ld, hd,
                         (uint16_t *)rows));
    return cudaSuccess;
}

/* kcm (nkv, hd, ldc) from K (nkv, ld, hd): a 32x32 tile transpose per head. */
__global__ void to_cm_kernel(const uint16_t *k, int T, int ld, int hd, uint16_t *kcm, int ldc)
{
    __shared__ uint16_t tile[32][33];
    int h = blockIdx.z;
    int t0 = blockIdx.x * 32, c0 = blockIdx.y * 32;
    const uint16_t *kh = k + (size_t)h * ld * hd;
    uint16_t *oh = kcm + (size_t)h * hd * ldc;
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
        int t = t0 + j, c = c0 + threadIdx.x;
        if (t < T && c < hd) tile[j][threadIdx.x] = kh[(size_t)t * hd + c];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
        int c = c0 + j, t = t0 + threadIdx.x;
        if (t < T && c < hd) oh[(size_t)c * ldc + t] = tile[threadIdx.x][j];
    }
}

extern "C" cudaError_t eng_to_channel_major(const void *k, int nkv, int T, int ld, int hd,
                                            kv_dtype t, void *kcm, int ldc, cudaStream_t s)
{
    (void)t;
    dim3 grid((unsigned)((T + 31) / 32), (unsigned)((hd + 31) / 32), (unsigned)nkv);
    CUDA_CHECK(kv_launch(KV_PDL_NONE, to_cm_kernel, grid, dim3(32, 8), 0, s, (const uint16_t *)k, T,
                         ld, hd, (uint16_t *)kcm, ldc));
    return cudaSuccess;
}

/* One block per (head, channel): max |k|, mean, then mean |k - mean|. */
template <typename TT>
__global__ void key_stats_kernel(const typename TT::T *k, int T, int ld, int hd, float *chmax,
                                 float *mean, float *mad)
{
    __shared__ float red[32];
    int h = blockIdx.y, c = blockIdx.x;
    const typename TT::T *kh = k + (size_t)h * ld * hd + c;
    float mx = 0.0f, sum = 0.0f;
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        float x = TT::load(kh + (size_t)t * hd);
        mx = fmaxf(mx, fabsf(x));
        sum += x;
    }
    mx = eng_block_max(mx, red);
    sum = eng_block_sum(sum, red);
    float m = T > 0 ? sum / (float)T : 0.0f;
    float dev = 0.0f;
    for (int t = threadIdx.x; t < T; t += blockDim.x) dev += fabsf(TT::load(kh + (size_t)t * hd) - m);
    dev = eng_block_sum(dev, red);
    if (threadIdx.x == 0) {
        size_t o = (size_t)h * hd + c;
        if (chmax) chmax[o] = mx;
        if (mean) mean[o] = m;
        if (mad) mad[o] = T > 0 ? dev / (float)T : 0.0f;
    }
}

extern "C" cudaError_t eng_key_stats(const void *k, int nkv, int T, int ld, int hd, kv_dtype t,
                                     float *chmax, float *mean, float *mad, cudaStream_t s)
{
    dim3 grid((unsigned)hd, (unsigned)nkv);
    if (t == KV_DT_BF16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, key_stats_kernel<eng_bf16>, grid, dim3(512), 0, s,
                             (const __nv_bfloat16 *)k, T, ld, hd, chmax, mean, mad));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, key_stats_kernel<eng_f16>, grid, dim3(512), 0, s,
                             (const __half *)k, T, ld, hd, chmax, mean, mad));
    return cudaSuccess;
}

template <typename TT>
__global__ void sketch_build_kernel(const typename TT::T *k, int nkv, int T, int ld, int hd,
                                    const float *mean, uint8_t *bits)
{
    int nb = hd / 8;
    size_t n = (size_t)nkv * T * nb;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        int b = (int)(i % nb);
        size_t r = i / nb;
        int t = (int)(r % T), h = (int)(r / T);
        const typename TT::T *row = k + ((size_t)h * ld + t) * hd + 8 * b;
        const float *m = mean + (size_t)h * hd + 8 * b;
        unsigned byte = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) byte |= (TT::load(row + j) > m[j] ? 1u : 0u) << j;
        bits[i] = (uint8_t)byte;
    }
}

extern "C" cudaError_t eng_sketch_build(const void *k, int nkv, int T, int ld, int hd, kv_dtype t,
                                        const float *mean, uint8_t *bits, cudaStream_t s)
{
    KV_CHECK_ARGS((hd & 7) == 0);
    if (t == KV_DT_BF16)
        CUDA_CHECK(kv_launch(KV_PDL_NONE, sketch_build_kernel<eng_bf16>, dim3(2048), dim3(256), 0,
                             s, (const __nv_bfloat16 *)k, nkv, T, ld, hd, mean, bits));
    else
        CUDA_CHECK(kv_launch(KV_PDL_NONE, sketch_build_kernel<eng_f16>, dim3(2048), dim3(256), 0, s,
                             (const __half *)k, nkv, T, ld, hd, mean, bits));
    return cudaSuccess;
}

__global__ void read_probe_kernel(const uint4 *p, size_t nv, unsigned *sink)
{
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv;
         i += (size_t)gridDim.x * blockDim.x) {
        uint4 u = eng_ld_stream(p + i);
        acc ^= u.x ^ u.y ^ u.z ^ u.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc; /* keeps the loads alive */
}

extern "C" cudaError_t eng_read_probe(const void *src, size_t n, unsigned *sink, cudaStream_t s)
{
    CUDA_CHECK(kv_launch(KV_PDL_NONE, read_probe_kernel, dim3(132 * 8), dim3(512), 0, s,
                         (const uint4 *)src, n / 16, sink));
    return cudaSuccess;
}
