/*
 * fp16 decode attention, flash-decoding style: the device function that one
 * block runs over a token range of one KV head (all of that head's query
 * heads at once, so K and V are read once), the merge of a block's warps
 * into one partial record, and the combine pass that merges the blocks'
 * partials.  The packed KIVI kernels reuse all three (the block partial for
 * their fp16 residual tokens).
 *
 * Partial record per (query head, split): [max, sum, out[0..D-1]], in the
 * exp2 domain (the query is prescaled by scale*log2(e)), out unnormalized.
 */
#ifndef KV_ATTN_F16_CUH
#define KV_ATTN_F16_CUH

#include "common.cuh"

#define KV_F16_THREADS 128
#define KV_F16_WARPS (KV_F16_THREADS / 32)
#define KV_F16_UNROLL 4 /* token rows each lane has in flight, K and V each */

/* Tokens one block iteration covers: warps * tokens per warp step * unroll. */
__host__ __device__ constexpr int kv_f16_block_step(int D, int U = KV_F16_UNROLL)
{
    return KV_F16_WARPS * (32 / (D / 8)) * U;
}

/* Shared scratch kv_f16_block_partial needs, in floats. */
__host__ __device__ constexpr int kv_f16_smem_floats(int D, int HPG)
{
    return KV_F16_WARPS * HPG * (D + 2);
}

/* Merge online-softmax states (m, l, acc) b into a. */
template <int N>
__device__ __forceinline__ void kv_softmax_merge(float &m, float &l, float (&acc)[N], float mb,
                                                 float lb, const float (&accb)[N])
{
    float mn = fmaxf(m, mb);
    float ca = kv_exp2_diff(m, mn), cb = kv_exp2_diff(mb, mn);
    l = l * ca + lb * cb;
#pragma unroll
    for (int i = 0; i < N; i++) acc[i] = acc[i] * ca + accb[i] * cb;
    m = mn;
}

/*
 * The epilogue every split-K decode kernel here shares (the fp16 blocks and
 * both packed KIVI kernels): merge the NW partial softmax states (m, l, acc)
 * that the warps of a block left in shared memory into one record per query
 * head, in the exp2 domain:
 *   M = max_w m_w,  L = sum_w l_w 2^(m_w - M),  O = sum_w acc_w 2^(m_w - M).
 * State w of head h: (m, l) at ml[(w*HPG + h)*2 + {0, 1}], acc (D) at
 * o + w*o_stride + h*D.  Head h's record [M, L, O (D)] goes to
 * part + ((head0 + h)*nsplit + split)*(D + 2).  All NT threads of the block
 * call it after a __syncthreads.
 */
template <int D, int HPG, int NW, int NT>
__device__ __forceinline__ void kv_softmax_merge_store(const float *ml, const float *o,
                                                       int o_stride, float *__restrict__ part,
                                                       int head0, int split, int nsplit)
{
    for (int idx = threadIdx.x; idx < HPG * D; idx += NT) {
        int h = idx / D, c = idx % D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < NW; w++) M = fmaxf(M, ml[(w * HPG + h) * 2]);
        float L = 0.0f, O = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; w++) {
            float f = kv_exp2_diff(ml[(w * HPG + h) * 2], M);
            L += ml[(w * HPG + h) * 2 + 1] * f;
            O += o[w * o_stride + h * D + c] * f;
        }
        float *rec = part + ((size_t)(head0 + h) * nsplit + split) * (D + 2);
        if (c == 0) {
            rec[0] = M;
            rec[1] = L;
        }
        rec[2 + c] = O;
    }
}

/* Issue the U K and V row loads of one warp step starting at token base. */
template <int D, int U>
__device__ __forceinline__ void kv_f16_load_step(const __half *__restrict__ k,
                                                 const __half *__restrict__ v, int base, int t0,
                                                 int t1, int sub, int cl, uint4 (&kr)[U],
                                                 uint4 (&vr)[U], bool (&ok)[U])
{
    constexpr int TPW = 32 / (D / 8);
#pragma unroll
    for (int u = 0; u < U; u++) {
        int t = base + u * TPW + sub;
        ok[u] = t < t1;
        size_t off = (size_t)(ok[u] ? t : t0) * D + cl * 8;
        kr[u] = __ldg(reinterpret_cast<const uint4 *>(k + off));
        vr[u] = __ldg(reinterpret_cast<const uint4 *>(v + off));
    }
}

/*
 * One block (KV_F16_THREADS threads) attends query heads
 * [kvh*HPG, kvh*HPG + HPG) over tokens [t0, t1) of k/v (already offset to
 * the KV head) and writes HPG partial records at part + (qh*nsplit + split)*(D+2).
 *   qs:   (HPG, D) floats in shared memory, query * scale * log2(e)
 *   smem: kv_f16_smem_floats(D, HPG) floats of shared scratch (the caller's,
 *         so that the packed kernel can lend its staging area)
 * With PF, the next step's loads are issued before this step's arithmetic
 * (twice the registers for rows in flight, no bubble between steps).
 */
template <int D, int HPG, bool PF = true, int UU = KV_F16_UNROLL>
__device__ void kv_f16_block_partial(const float *__restrict__ qs, const __half *__restrict__ k,
                                     const __half *__restrict__ v, int t0, int t1,
                                     float *__restrict__ part, int kvh, int split, int nsplit,
                                     float *smem)
{
    constexpr int LPT = D / 8;   /* lanes per token row: 8 fp16 (16 bytes) each */
    constexpr int TPW = 32 / LPT; /* token rows per warp step */
    constexpr int U = UU;
    float(*sm_o)[HPG][D] = reinterpret_cast<float(*)[HPG][D]>(smem);
    float(*sm_ml)[HPG][2] = reinterpret_cast<float(*)[HPG][2]>(smem + KV_F16_WARPS * HPG * D);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub = lane / LPT, cl = lane % LPT;

    float qf[HPG][8];
#pragma unroll
    for (int h = 0; h < HPG; h++)
#pragma unroll
        for (int i = 0; i < 8; i++) qf[h][i] = qs[h * D + cl * 8 + i];

    float m[HPG], l[HPG], acc[HPG][8];
#pragma unroll
    for (int h = 0; h < HPG; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[h][i] = 0.0f;
    }

    constexpr int STEP = KV_F16_WARPS * TPW * U;
    uint4 kn[U], vn[U];
    bool okn[U];
    int base = t0 + warp * TPW * U;
    if (PF && base < t1) kv_f16_load_step<D, U>(k, v, base, t0, t1, sub, cl, kn, vn, okn);
    for (; base < t1; base += STEP) {
        uint4 kr[U], vr[U]; /* all loads first: 2U 16-byte loads in flight */
        bool ok[U];
        if (PF) {
#pragma unroll
            for (int u = 0; u < U; u++) kr[u] = kn[u], vr[u] = vn[u], ok[u] = okn[u];
            if (base + STEP < t1)
                kv_f16_load_step<D, U>(k, v, base + STEP, t0, t1, sub, cl, kn, vn, okn);
        } else {
            kv_f16_load_step<D, U>(k, v, base, t0, t1, sub, cl, kr, vr, ok);
        }
        float s[U][HPG];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const __half2 *kh = reinterpret_cast<const __half2 *>(&kr[u]);
            float kf[8];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 f = __half22float2(kh[i]);
                kf[2 * i] = f.x;
                kf[2 * i + 1] = f.y;
            }
#pragma unroll
            for (int h = 0; h < HPG; h++) {
                float a = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) a = fmaf(qf[h][i], kf[i], a);
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) a += __shfl_xor_sync(KV_FULL_MASK, a, o);
                s[u][h] = ok[u] ? a : -INFINITY;
            }
        }
        float vf[U][8];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const __half2 *vh = reinterpret_cast<const __half2 *>(&vr[u]);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 f = __half22float2(vh[i]);
                vf[u][2 * i] = f.x;
                vf[u][2 * i + 1] = f.y;
            }
        }
#pragma unroll
        for (int h = 0; h < HPG; h++) {
            float mx = m[h];
#pragma unroll
            for (int u = 0; u < U; u++) mx = fmaxf(mx, s[u][h]);
            float ref = mx == -INFINITY ? 0.0f : mx;
            float corr = kv_exp2_diff(m[h], ref);
            float p[U], ps = 0.0f;
#pragma unroll
            for (int u = 0; u < U; u++) {
                p[u] = kv_exp2_diff(s[u][h], ref);
                ps += p[u];
            }
            l[h] = l[h] * corr + ps;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float a = acc[h][i] * corr;
#pragma unroll
                for (int u = 0; u < U; u++) a = fmaf(p[u], vf[u][i], a);
                acc[h][i] = a;
            }
            m[h] = mx;
        }
    }

    /* Merge the token slots of the warp (lanes with the same channels). */
#pragma unroll
    for (int o = LPT; o < 32; o <<= 1) {
#pragma unroll
        for (int h = 0; h < HPG; h++) {
            float mb = __shfl_xor_sync(KV_FULL_MASK, m[h], o);
            float lb = __shfl_xor_sync(KV_FULL_MASK, l[h], o);
            float accb[8];
#pragma unroll
            for (int i = 0; i < 8; i++) accb[i] = __shfl_xor_sync(KV_FULL_MASK, acc[h][i], o);
            kv_softmax_merge<8>(m[h], l[h], acc[h], mb, lb, accb);
        }
    }
    if (sub == 0) {
#pragma unroll
        for (int h = 0; h < HPG; h++) {
#pragma unroll
            for (int i = 0; i < 8; i++) sm_o[warp][h][cl * 8 + i] = acc[h][i];
            if (cl == 0) {
                sm_ml[warp][h][0] = m[h];
                sm_ml[warp][h][1] = l[h];
            }
        }
    }
    __syncthreads();
    kv_softmax_merge_store<D, HPG, KV_F16_WARPS, KV_F16_THREADS>(&sm_ml[0][0][0], &sm_o[0][0][0],
                                                                HPG * D, part, kvh * HPG, split,
                                                                nsplit);
}

/* The pipelined tensor-core kernel of attn_f16_tc.cu (head dims 64 and 128,
 * up to 16 query heads per KV head, head_stride a multiple of 8): does it
 * serve d, its split plan (tokens per split, splits) and its launch writing
 * partial records to part (n_heads * nsplit * (D + 2) floats). */
bool kv_f16_tc_ok(const kv_attn_dims *d);
cudaError_t kv_f16_tc_plan(const kv_attn_dims *d, bool qf32, int *tps, int *nsplit);
cudaError_t kv_f16_tc_launch(const kv_attn_dims *d, bool qf32, const void *q, const __half *k,
                             const __half *v, float *part, int tps, int nsplit,
                             cudaStream_t stream);

/* Merge nsplit partial records per query head into out (n_heads, D). */
cudaError_t kv_attn_combine(const float *part, int n_heads, int D, int nsplit, float *out,
                            cudaStream_t stream);

#endif
