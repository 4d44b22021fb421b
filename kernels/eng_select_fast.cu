/*
 * eng_select_fast: select=resident's selection chain in short kernels that
 * each spread over many blocks per KV head, so that the chain fits beside
 * the main stream's layer (issue 17: the chain of eng_select_pool,
 * eng_score_rows, eng_softmax_combine and eng_topk took 0.37 ms a layer
 * next to the layer's 0.18 ms, its top-K one 1024-thread block per head):
 *
 *   rf_pool    one block per KV head: this step's C of the R pool channels
 *              and the SparQ scales (eng_select_pool's rule, its ranking in
 *              O(R) per channel where eng_select_pool's is O(R^2));
 *   rf_stats   the scores of its chunks of 2048 candidates from the
 *              resident rows (eng_score_rows' arithmetic, so the same
 *              floats), each query head's running max and sum of exp;
 *   rf_comb    the same scores again (a few bytes per token: cheaper than
 *              writing and re-reading a float per token and query head),
 *              softmax with the merged statistics, the GQA combine (sum or
 *              max), comb written once, and the histogram of the top 12
 *              bits of comb's order keys;
 *   tm_hist    digits 2 (12 bits) and 3 (8 bits) of the k-th largest key,
 *              each over the keys that match the digits so far;
 *   tm_count   per block, keys above and equal to the k-th;
 *   tm_write   per block, from the earlier blocks' counts, the chosen ids
 *              in ascending order: every key above the k-th and the first
 *              ones equal to it (lowest index), exactly eng_topk's ids.
 *
 * With ENG_SEL_COLLECT (kernels/eng_ops.cuh) tm_collect and tm_finish take
 * the place of the two tm_hist passes and tm_count: one pass counts per
 * chunk the keys above digit 1's bin and appends the keys of that bin (a
 * few hundred to a few thousand: the bin is 1/8 of an octave wide) to a
 * list per head; one block per head finds digits 2 and 3 and the counts per
 * chunk among them (among every key of the bin when the list overflowed).
 * Four kernels then run over all the candidates instead of six.
 * ENG_SEL_DIRECT also lists the keys above that bin, and tm_finish writes
 * the ids itself (a bitmap of the chosen ids, read in order) when the list
 * held them all and n <= 131072; tm_write's blocks then return at once.
 * ENG_SEL_LATE and ENG_SEL_NOPDL change only how the kernels follow each
 * other: the early trigger below lets every later kernel's blocks onto the
 * SMs, waiting, as soon as its predecessor's have started.
 *
 * Each histogram pass ends in its last block (a counter per head): it
 * picks the digit, leaves the prefix and what is still needed in the
 * workspace, and zeroes the histogram and counter for the next step.  Every
 * kernel waits for its predecessor (kv_pdl_wait) before it reads anything
 * written in the chain, and is launched with programmatic dependent launch
 * at level 2, so its blocks are resident when the predecessor finishes.
 * eng_topk_many is the top-K part alone (one more histogram pass for digit
 * 1).  The work is cut in chunks (2048 candidates of the score passes, 4096
 * keys of the top-K passes) and each kernel runs `blocks` blocks per KV head
 * that loop over the chunks: few blocks leave the SMs to the main stream's
 * layer (the decode measured the side kernels' width, not their latency,
 * as what slowed the layer down: docs/BENCHMARKS.md, issue 17, helper S17).  CPU references: kv_select_pool_channels, kv_select_score_rows and
 * kv_select_combine (lib/policy/kv_select.c), the CPU policy's top-K.
 */
#include "eng_select.cuh"

#define RF_THREADS 256
#define RF_TOK (RF_THREADS * 8) /* candidates per block of the score passes */
#define TM_THREADS 256
#define TM_PER 16 /* keys per thread of the top-K passes, contiguous */
#define TM_SEG (TM_THREADS * TM_PER)
#define TM_MAXB 256 /* blocks per KV head of the top-K passes */
#define TM_BIN1 4096
#define TM_BIN3 256
#define TM_CAP 16384 /* ENG_SEL_COLLECT: candidates listed per KV head */

typedef struct {
    unsigned hist1[TM_BIN1], hist2[TM_BIN1], hist3[TM_BIN3];
    unsigned done[4]; /* blocks finished, per histogram pass */
    uint32_t pre;     /* the key bits resolved so far (all 32 after digit 3) */
    int need;         /* keys still to take at that prefix */
    int cgt[TM_MAXB], ceq[TM_MAXB]; /* per chunk: keys above / equal to the k-th */
    unsigned ncand;   /* ENG_SEL_COLLECT: candidates of digit 1's bin appended (may pass TM_CAP) */
    int skipw;        /* ENG_SEL_DIRECT: tm_finish wrote the ids (tm_write has nothing to do) */
    /* ENG_SEL_COLLECT: the candidates' keys and ids, the first TM_CAP of them
     * (more send tm_finish over every key of the head instead: right, slower);
     * in each head's own workspace, so that a workspace sized for more heads
     * serves fewer */
    uint32_t ckey[TM_CAP];
    int cidx[TM_CAP];
} tm_head;

static __device__ __forceinline__ uint32_t *tm_ckey(tm_head *ws, int nkv, int kh) { return ws[kh].ckey; }
static __device__ __forceinline__ int *tm_cidx(tm_head *ws, int nkv, int kh) { return ws[kh].cidx; }

extern "C" int eng_topk_many_fits(int n) { return n >= 1 && n <= TM_MAXB * TM_SEG; }

extern "C" size_t eng_topk_many_ws(int nkv) { return (size_t)nkv * sizeof(tm_head); }

/* chunks of the score passes for candidates [cs, cend) */
static __host__ __device__ int rf_chunks(int cs, int cend) { return ((cend - (cs & ~7) + 7) / 8 + RF_THREADS - 1) / RF_THREADS; }
static __host__ __device__ int tm_chunks(int n) { return (n + TM_SEG - 1) / TM_SEG; }
static unsigned grid_of(int chunks, int blocks) { return (unsigned)(blocks > 0 && blocks < chunks ? blocks : chunks); }

extern "C" size_t eng_resident_select_ws(int nq_heads, int nkv, int n)
{
    /* the head workspaces, then (nq_heads, blocks, 2) softmax statistics for
     * candidates [cs, cs + n) with cs up to 7 past a multiple of 8 */
    return eng_topk_many_ws(nkv) + (size_t)nq_heads * (size_t)(rf_chunks(7, 7 + n) + 1) * 2 * sizeof(float);
}

// --- block helpers (TM_THREADS = RF_THREADS = 256 threads) -----------------------------

/* Exclusive prefix sum over the block; *total gets the sum.  sw: 9 ints of
 * shared scratch. */
static __device__ int blk_exscan(int v, int *sw, int *total)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int t = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += t;
    }
    __syncthreads(); /* sw's readers of an earlier call are done */
    if (lane == 31) sw[w] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        int a = 0;
        for (int i = 0; i < nw; i++) {
            int t = sw[i];
            sw[i] = a;
            a += t;
        }
        sw[8] = a;
    }
    __syncthreads();
    *total = sw[8];
    return sw[w] + x - v;
}

/*
 * The last block of a histogram pass (all threads): bin b of h (nb bins,
 * global, written by every block's atomics) with the keys above it fewer
 * than need and the keys from it up at least need; *need_io becomes what is
 * still needed within b.  Zeroes h for the next pass.  sw: 9 ints.
 */
template <bool SHARED = false>
static __device__ int tm_pick(unsigned *h, int nb, int *need_io, int *sw, int *sbin)
{
    const int per = nb / TM_THREADS, b0 = threadIdx.x * per; /* 16 or 1 bins a thread */
    unsigned c[16];
    int mine = 0;
    for (int i = 0; i < per; i++) {
        c[i] = SHARED ? h[b0 + i] : __ldcg(&h[b0 + i]);
        h[b0 + i] = 0u;
        mine += (int)c[i];
    }
    /* keys in bins above this thread's: a suffix sum, by a prefix sum in
     * reversed thread order */
    int tot, above;
    {
        const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
        /* reverse: thread t takes the count of thread 255 - t through shared memory */
        __shared__ int rv[TM_THREADS];
        rv[threadIdx.x] = mine;
        __syncthreads();
        int r = rv[TM_THREADS - 1 - threadIdx.x];
        int ex = blk_exscan(r, sw, &tot);
        __syncthreads();
        rv[TM_THREADS - 1 - threadIdx.x] = ex; /* keys of the threads above t */
        __syncthreads();
        above = rv[threadIdx.x];
        (void)lane, (void)w;
    }
    const int need = *need_io;
    if (threadIdx.x == 0) *sbin = -1;
    __syncthreads();
    if (above < need && above + mine >= need) {
        int a = above;
        for (int i = per - 1; i >= 0; i--) {
            if (a + (int)c[i] >= need) {
                sbin[0] = b0 + i;
                sbin[1] = need - a;
                break;
            }
            a += (int)c[i];
        }
    }
    __syncthreads();
    int b = sbin[0];
    if (b < 0) { /* fewer keys than needed: not reached for k <= n */
        b = 0;
        sbin[1] = need;
    }
    *need_io = sbin[1];
    __syncthreads();
    return b;
}

/* After a block's global atomics: true in the last block of the pass
 * (counter i of head hw), which then resets the counter. */
static __device__ bool tm_last(tm_head *hw, int i, bool *s_last)
{
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned d = atomicAdd(&hw->done[i], 1u);
        *s_last = d == gridDim.x - 1;
        if (*s_last) hw->done[i] = 0u;
    }
    __syncthreads();
    if (*s_last) __threadfence();
    return *s_last;
}

/* A block's shared histogram added to the global one (non-zero bins). */
static __device__ void tm_flush(const unsigned *sh, unsigned *g, int nb)
{
    __syncthreads();
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
        if (sh[b]) atomicAdd(&g[b], sh[b]);
}

/* This thread's TM_PER contiguous keys of chunk c (0: none). */
static __device__ __forceinline__ void tm_keys(const float *x, int n, int c, uint32_t (&k)[TM_PER], int *i0)
{
    const int a = c * TM_SEG + threadIdx.x * TM_PER;
    *i0 = a;
#pragma unroll
    for (int j = 0; j < TM_PER; j++) k[j] = a + j < n ? ord_key(x[a + j]) : 0u;
}

// --- top-K passes -----------------------------------------------------------------------

/*
 * Digit d of the k-th largest key of each head (d 1: bits 31-20 of every
 * key; 2: bits 19-8 of the keys whose bits 31-20 are the prefix; 3: bits 7-0
 * of those matching bits 31-8).  k: the keys to take (digit 1 only; later
 * digits read what is still needed from the workspace).
 */
__global__ void __launch_bounds__(TM_THREADS) tm_hist_kernel(const float *comb, int n, int k, int d,
                                                             tm_head *ws, int early)
{
    __shared__ unsigned sh[TM_BIN1];
    __shared__ int sw[9], sbin[2];
    __shared__ bool s_last;
    if (early) kv_pdl_launch_next();
    const int nb = d == 3 ? TM_BIN3 : TM_BIN1;
    for (int b = threadIdx.x; b < nb; b += TM_THREADS) sh[b] = 0u;
    kv_pdl_wait();
    const int kh = blockIdx.y;
    tm_head *hw = ws + kh;
    const uint32_t pre = d == 1 ? 0u : hw->pre;
    __syncthreads();
    for (int c = blockIdx.x; c < tm_chunks(n); c += gridDim.x) {
        uint32_t key[TM_PER];
        int i0;
        tm_keys(comb + (size_t)kh * n, n, c, key, &i0);
#pragma unroll
        for (int j = 0; j < TM_PER; j++) {
            const uint32_t x = key[j];
            bool m;
            unsigned bin;
            if (d == 1) {
                m = x != 0u;
                bin = x >> 20;
            } else if (d == 2) {
                m = x != 0u && (x >> 20) == (pre >> 20);
                bin = (x >> 8) & 4095u;
            } else {
                m = x != 0u && (x >> 8) == (pre >> 8);
                bin = x & 255u;
            }
            hist_add(sh, bin, m);
        }
    }
    unsigned *gh = d == 1 ? hw->hist1 : d == 2 ? hw->hist2 : hw->hist3;
    tm_flush(sh, gh, nb);
    if (!tm_last(hw, d, &s_last)) return;
    int need = d == 1 ? k : hw->need;
    const int b = tm_pick(gh, nb, &need, sw, sbin);
    if (threadIdx.x == 0) {
        hw->pre = d == 1 ? (uint32_t)b << 20 : d == 2 ? pre | ((uint32_t)b << 8) : pre | (uint32_t)b;
        hw->need = need;
    }
}

/* Per chunk: keys above and equal to the k-th (hw->pre after digit 3). */
__global__ void __launch_bounds__(TM_THREADS) tm_count_kernel(const float *comb, int n, tm_head *ws, int early)
{
    __shared__ int sw[9];
    if (early) kv_pdl_launch_next();
    kv_pdl_wait();
    const int kh = blockIdx.y;
    tm_head *hw = ws + kh;
    const uint32_t thr = hw->pre;
    for (int c = blockIdx.x; c < tm_chunks(n); c += gridDim.x) {
        uint32_t key[TM_PER];
        int i0, gt = 0, eq = 0;
        tm_keys(comb + (size_t)kh * n, n, c, key, &i0);
#pragma unroll
        for (int j = 0; j < TM_PER; j++) {
            gt += key[j] > thr;
            eq += key[j] == thr;
        }
        int t; /* both counts of a chunk (<= 4096) in one sum */
        (void)blk_exscan(gt << 16 | eq, sw, &t);
        if (threadIdx.x == 0) {
            hw->cgt[c] = t >> 16;
            hw->ceq[c] = t & 0xffff;
        }
    }
}

/* The chosen ids, ascending: keys above the k-th, then the first equal ones. */
__global__ void __launch_bounds__(TM_THREADS) tm_write_kernel(const float *comb, int n, int k, int base,
                                                              int *sel, const tm_head *ws, int direct, int early)
{
    __shared__ int sw[9];
    if (early) kv_pdl_launch_next();
    kv_pdl_wait();
    const int kh = blockIdx.y;
    const tm_head *hw = ws + kh;
    if (direct && hw->skipw) return; /* tm_finish wrote them */
    const uint32_t thr = hw->pre;
    const int need_eq = hw->need, nc = tm_chunks(n);
    __shared__ int pg[TM_MAXB], pe[TM_MAXB]; /* keys above / equal in the chunks before each */
    {
        int tg, te;
        const int a = threadIdx.x < nc ? hw->cgt[threadIdx.x] : 0, b = threadIdx.x < nc ? hw->ceq[threadIdx.x] : 0;
        const int xg = blk_exscan(a, sw, &tg), xe = blk_exscan(b, sw, &te);
        pg[threadIdx.x] = xg;
        pe[threadIdx.x] = xe;
    }
    __syncthreads();
    int *out = sel + (size_t)kh * k;
    for (int c = blockIdx.x; c < nc; c += gridDim.x) {
        const int G0 = pg[c], E0 = pe[c];
        uint32_t key[TM_PER];
        int i0, gt = 0, eq = 0;
        tm_keys(comb + (size_t)kh * n, n, c, key, &i0);
#pragma unroll
        for (int j = 0; j < TM_PER; j++) {
            gt += key[j] > thr;
            eq += key[j] == thr;
        }
        int teq, ttk;
        const int er0 = E0 + blk_exscan(eq, sw, &teq); /* rank among the equal keys of this thread's first */
        int take_eq = need_eq - er0;
        take_eq = take_eq < 0 ? 0 : take_eq > eq ? eq : take_eq;
        int pos = G0 + (E0 < need_eq ? E0 : need_eq) + blk_exscan(gt + take_eq, sw, &ttk);
        int er = er0;
#pragma unroll
        for (int j = 0; j < TM_PER; j++) {
            const bool g = key[j] > thr, e = key[j] == thr;
            if (g || (e && er < need_eq)) {
                if (pos < k) out[pos] = base + i0 + j;
                pos++;
            }
            er += e;
        }
    }
}

/*
 * ENG_SEL_COLLECT, after digit 1 (hw->pre's bits 31-20 name the bin b of the
 * k-th key): per chunk, the keys above b (all chosen) counted into cgt, and
 * the keys of bin b appended to the head's candidate list (TM_CAP of them
 * kept; ncand counts them all).  One pass over the keys where digits 2 and
 * 3 and the counts took three.
 */
__global__ void __launch_bounds__(TM_THREADS) tm_collect_kernel(const float *comb, int n, tm_head *ws, int nkv,
                                                                int direct, int early)
{
    __shared__ int sw[9], sbase;
    if (early) kv_pdl_launch_next();
    kv_pdl_wait();
    const int kh = blockIdx.y;
    tm_head *hw = ws + kh;
    const uint32_t b = hw->pre >> 20;
    uint32_t *ck = tm_ckey(ws, nkv, kh);
    int *ci = tm_cidx(ws, nkv, kh);
    for (int c = blockIdx.x; c < tm_chunks(n); c += gridDim.x) {
        uint32_t key[TM_PER];
        int i0, gt = 0, nb = 0;
        tm_keys(comb + (size_t)kh * n, n, c, key, &i0);
#pragma unroll
        for (int j = 0; j < TM_PER; j++) {
            gt += key[j] != 0u && (key[j] >> 20) > b;
            nb += key[j] != 0u && (direct ? (key[j] >> 20) >= b : (key[j] >> 20) == b);
        }
        int tg, tb;
        (void)blk_exscan(gt, sw, &tg);
        const int off = blk_exscan(nb, sw, &tb);
        if (threadIdx.x == 0) {
            hw->cgt[c] = tg;
            sbase = tb ? (int)atomicAdd(&hw->ncand, (unsigned)tb) : 0;
        }
        __syncthreads();
        int at = sbase + off;
#pragma unroll
        for (int j = 0; j < TM_PER; j++)
            if (key[j] != 0u && (direct ? (key[j] >> 20) >= b : (key[j] >> 20) == b)) {
                if (at < TM_CAP) {
                    ck[at] = key[j];
                    ci[at] = i0 + j;
                }
                at++;
            }
        __syncthreads(); /* sbase is read before the next chunk's write */
    }
}

/*
 * ENG_SEL_DIRECT's end in one block (all threads): from the list of every
 * key in digit 1's bin and above (m of them, ids below n <= 32 * TM_BIN1),
 * with the k-th key thr and need_eq of the keys equal to it to take, the
 * ids as tm_write_kernel writes them: a bitmap of the keys above thr, the
 * lowest-index need_eq of the equal ones added, then every set bit in
 * ascending order into out (k).  S, E: TM_BIN1 words of shared memory.
 */
static __device__ void tm_direct(const uint32_t *ck, const int *ci, int m, int n, uint32_t thr, int need_eq,
                                 unsigned *S, unsigned *E, int *sw, int *out, int k, int base)
{
    const int nw = (n + 31) / 32, per = (nw + TM_THREADS - 1) / TM_THREADS, w0 = threadIdx.x * per;
    for (int w = threadIdx.x; w < nw; w += TM_THREADS) S[w] = E[w] = 0u;
    __syncthreads();
    for (int i = threadIdx.x; i < m; i += TM_THREADS) {
        const uint32_t key = ck[i];
        const int id = ci[i];
        if (key > thr) atomicOr(&S[id >> 5], 1u << (id & 31));
        else if (key == thr) atomicOr(&E[id >> 5], 1u << (id & 31));
    }
    __syncthreads();
    int c = 0, tot;
    for (int w = w0; w < w0 + per && w < nw; w++) c += __popc(E[w]);
    int r = blk_exscan(c, sw, &tot); /* equal keys at lower ids than this thread's words */
    for (int w = w0; w < w0 + per && w < nw; w++) {
        unsigned v = E[w], keep = 0u;
        while (v && r < need_eq) { /* the lowest bits first */
            const unsigned b = v & (0u - v);
            keep |= b;
            v ^= b;
            r++;
        }
        S[w] |= keep;
    }
    c = 0;
    for (int w = w0; w < w0 + per && w < nw; w++) c += __popc(S[w]);
    int pos = blk_exscan(c, sw, &tot);
    for (int w = w0; w < w0 + per && w < nw; w++)
        for (unsigned v = S[w]; v; v &= v - 1u) {
            if (pos < k) out[pos] = base + w * 32 + __ffs(v) - 1;
            pos++;
        }
}

/*
 * ENG_SEL_COLLECT, one block per KV head: digits 2 and 3 of the k-th key
 * over the candidates (or, past TM_CAP, over every key of bin b), then per
 * chunk the candidates above and equal to it added to the counts, which
 * leaves hw as tm_count_kernel would for tm_write_kernel; ncand reset.
 */
__global__ void __launch_bounds__(TM_THREADS) tm_finish_kernel(const float *comb, int n, int k, int base, int *sel,
                                                               tm_head *ws, int nkv, int direct, int early)
{
    __shared__ unsigned sh[TM_BIN1], eqm[TM_BIN1];
    __shared__ int sgt[TM_MAXB], seq[TM_MAXB], sw[9], sbin[2];
    if (early) kv_pdl_launch_next();
    kv_pdl_wait();
    const int kh = blockIdx.x;
    tm_head *hw = ws + kh;
    const uint32_t *ck = tm_ckey(ws, nkv, kh);
    const int *ci = tm_cidx(ws, nkv, kh);
    const float *x = comb + (size_t)kh * n;
    const int m = (int)hw->ncand, nc = tm_chunks(n);
    const bool list = m <= TM_CAP;
    const int cnt = list ? m : n;
    const uint32_t b1 = hw->pre >> 20;
    int need = hw->need;
    uint32_t pre = hw->pre;
    for (int d = 2; d <= 3; d++) {
        const int nb = d == 3 ? TM_BIN3 : TM_BIN1;
        for (int i = threadIdx.x; i < nb; i += TM_THREADS) sh[i] = 0u;
        __syncthreads();
        for (int i0 = 0; i0 < cnt; i0 += TM_THREADS) { /* whole warps in the loop: hist_add's ballot */
            const int i = i0 + threadIdx.x;
            const uint32_t key = i < cnt ? (list ? ck[i] : ord_key(x[i])) : 0u;
            bool on = i < cnt && key != 0u && (key >> 20) == b1;
            if (d == 3) on = on && (key >> 8) == (pre >> 8);
            hist_add(sh, d == 2 ? (key >> 8) & 4095u : key & 255u, on);
        }
        __syncthreads();
        const int bsel = tm_pick<true>(sh, nb, &need, sw, sbin);
        pre = d == 2 ? pre | ((uint32_t)bsel << 8) : pre | (uint32_t)bsel;
    }
    if (direct && list && n <= TM_BIN1 * 32) { /* the ids from the list itself */
        tm_direct(ck, ci, m, n, pre, need, sh, eqm, sw, sel + (size_t)kh * k, k, base);
        if (threadIdx.x == 0) {
            hw->skipw = 1;
            hw->ncand = 0u;
        }
        return;
    }
    for (int c = threadIdx.x; c < TM_MAXB; c += TM_THREADS) sgt[c] = seq[c] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < cnt; i += TM_THREADS) {
        const uint32_t key = list ? ck[i] : ord_key(x[i]);
        const int id = list ? ci[i] : i;
        if ((key >> 20) != b1 || key == 0u) continue;
        if (key > pre) atomicAdd(&sgt[id / TM_SEG], 1);
        else if (key == pre) atomicAdd(&seq[id / TM_SEG], 1);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < nc; c += TM_THREADS) {
        hw->cgt[c] += sgt[c];
        hw->ceq[c] = seq[c];
    }
    if (threadIdx.x == 0) {
        hw->pre = pre;
        hw->need = need;
        hw->ncand = 0u;
        hw->skipw = 0;
    }
}

/* Digits 2 and 3 (or, ENG_SEL_COLLECT, the candidates' pass), the counts
 * and the ids (digit 1 done). */
static cudaError_t tm_tail(const float *comb, int nkv, int n, int k, int base, int *sel, tm_head *hw,
                           int blocks, int flags, cudaStream_t s)
{
    const dim3 grid(grid_of(tm_chunks(n), blocks), (unsigned)nkv);
    const int lv = flags & ENG_SEL_NOPDL ? KV_PDL_NONE : 2, early = !(flags & ENG_SEL_LATE);
    const int direct = (flags & ENG_SEL_DIRECT) != 0;
    if (flags & (ENG_SEL_COLLECT | ENG_SEL_DIRECT)) {
        CUDA_CHECK(kv_launch(lv, tm_collect_kernel, grid, dim3(TM_THREADS), 0, s, comb, n, hw, nkv, direct, early));
        CUDA_CHECK(kv_launch(lv, tm_finish_kernel, dim3((unsigned)nkv), dim3(TM_THREADS), 0, s, comb, n, k, base, sel,
                             hw, nkv, direct, early));
    } else {
        CUDA_CHECK(kv_launch(lv, tm_hist_kernel, grid, dim3(TM_THREADS), 0, s, comb, n, k, 2, hw, early));
        CUDA_CHECK(kv_launch(lv, tm_hist_kernel, grid, dim3(TM_THREADS), 0, s, comb, n, k, 3, hw, early));
        CUDA_CHECK(kv_launch(lv, tm_count_kernel, grid, dim3(TM_THREADS), 0, s, comb, n, hw, early));
    }
    CUDA_CHECK(kv_launch(lv, tm_write_kernel, grid, dim3(TM_THREADS), 0, s, comb, n, k, base, sel,
                         (const tm_head *)hw, direct, early));
    return cudaSuccess;
}

extern "C" cudaError_t eng_topk_many(const float *comb, int nkv, int n, int k, int base, int *sel,
                                     void *ws, int blocks, int flags, cudaStream_t s)
{
    if (k <= 0) return cudaSuccess;
    KV_CHECK_ARGS(k <= n && ws != NULL && eng_topk_many_fits(n));
    tm_head *hw = (tm_head *)ws;
    const dim3 grid(grid_of(tm_chunks(n), blocks), (unsigned)nkv);
    const int lv = flags & ENG_SEL_NOPDL ? KV_PDL_NONE : 2, early = !(flags & ENG_SEL_LATE);
    CUDA_CHECK(kv_launch(lv, tm_hist_kernel, grid, dim3(TM_THREADS), 0, s, comb, n, k, 1, hw, early));
    return tm_tail(comb, nkv, n, k, base, sel, hw, blocks, flags, s);
}

// --- the resident scores, softmax and combine ------------------------------------------

/* The raw bytes of resident row `row` for tokens t8 .. t8 + 7 (16 bytes of
 * fp16, or BITS bytes of codes with their group's scale and zero). */
template <int BITS>
static __device__ __forceinline__ void rf_load(const uint8_t *rows, const uint16_t *scale,
                                               const uint16_t *zero, size_t row, int ldt, int t8, uint4 &raw,
                                               float &sc, float &z)
{
    if (BITS == 16) {
        raw = *(const uint4 *)(rows + (row * ldt + t8) * 2);
        return;
    }
    const size_t gi = row * (ldt / 64) + t8 / 64;
    sc = __half2float(__ushort_as_half(scale[gi]));
    z = __half2float(__ushort_as_half(zero[gi]));
    const uint8_t *r = rows + row * ((size_t)ldt * BITS / 8) + (size_t)t8 * BITS / 8;
    uint64_t w; /* the 8 codes: t8 * BITS / 8 is a multiple of BITS bytes */
    if (BITS == 1) w = *r;
    else if (BITS == 2) w = *(const uint16_t *)r;
    else if (BITS == 4) w = *(const uint32_t *)r;
    else w = *(const uint64_t *)r;
    raw.x = (uint32_t)w;
    raw.y = (uint32_t)(w >> 32);
}

/* Those bytes as 8 values, as eng_score_rows decodes them. */
template <int BITS>
static __device__ __forceinline__ void rf_decode(const uint4 &raw, float sc, float z, float (&f)[8])
{
    if (BITS == 16) {
        eng_f16::unpack8(raw, f);
        return;
    }
    const uint64_t w = (uint64_t)raw.x | (uint64_t)raw.y << 32;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        unsigned code = (unsigned)(w >> (i * BITS)) & ((1u << BITS) - 1u);
        f[i] = __fadd_rn(z, __fmul_rn(sc, (float)code));
    }
}

#define RF_JB 8 /* rows whose loads are in flight together */

/* The block's scores: acc[h][i] for token t8 + i, query head h of the group
 * (eng_score_rows' sums, in its order). */
template <int BITS, int G>
static __device__ __forceinline__ void rf_scores(const uint8_t *rows, const uint16_t *scale,
                                                 const uint16_t *zero, int ldt, int g, int C,
                                                 const float *qc, const int *rj, int t8, int cend,
                                                 float (&acc)[G][8])
{
#pragma unroll
    for (int h = 0; h < G; h++)
#pragma unroll
        for (int i = 0; i < 8; i++) acc[h][i] = 0.0f;
    if (t8 >= cend) return;
    for (int j0 = 0; j0 < C; j0 += RF_JB) {
        uint4 raw[RF_JB];
        float sc[RF_JB], z[RF_JB];
#pragma unroll
        for (int jj = 0; jj < RF_JB; jj++)
            if (j0 + jj < C) rf_load<BITS>(rows, scale, zero, (size_t)rj[j0 + jj], ldt, t8, raw[jj], sc[jj], z[jj]);
#pragma unroll
        for (int jj = 0; jj < RF_JB; jj++) {
            if (j0 + jj >= C) break;
            float f[8];
            rf_decode<BITS>(raw[jj], sc[jj], z[jj], f);
#pragma unroll
            for (int h = 0; h < G; h++)
                if (h < g) {
                    float wq = qc[h * C + j0 + jj];
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[h][i] += wq * f[i];
                }
        }
    }
}

/* kv_select_combine's weight of score x under the head's maximum mx. */
static __device__ __forceinline__ float rf_w(float x, float mx)
{
    if (x != x) x = -INFINITY;
    return mx == INFINITY ? (float)(x == INFINITY) : mx == -INFINITY ? 0.0f : expf(x - mx);
}

/*
 * This step's C of the R pool channels of KV head kh and the SparQ scales,
 * as eng_select_pool: rj (C) the resident row of each chosen channel
 * (ascending position), qc (g, C) q * scale; with cols/qscale non-NULL also
 * written out.  ps, rk: (R) shared scratch; sq: (g) shared.
 */
static __device__ void rf_pool(const float *q, const float *chmax, const int *pool, int R, int C,
                               int g, int hd, int kh, float *qc, int *rj, float *ps, int *rk,
                               float *sq, int *cols, float *qscale)
{
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
        const float sj = ps[j];
        int rank = 0;
        for (int i = 0; i < R; i++) rank += ps[i] > sj || (ps[i] == sj && i < j);
        rk[j] = rank;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < R; j += blockDim.x)
        if (rk[j] < C) {
            int pos = 0;
            for (int i = 0; i < j; i++) pos += rk[i] < C;
            rj[pos] = kh * R + j;
            if (cols) cols[kh * C + pos] = j;
        }
    __syncthreads();
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int h = w; h < g; h += nw) { /* a warp per query head */
        const float *qh = qg + (size_t)h * hd;
        float all = 0.0f, part = 0.0f;
        for (int c = lane; c < hd; c += 32) all += fabsf(qh[c]);
        for (int j = lane; j < C; j += 32) part += fabsf(qh[pl[rj[j] - kh * R]]);
        all = eng_warp_sum(all);
        part = eng_warp_sum(part);
        if (lane == 0) {
            float temp = all <= 0.0f ? (float)hd : (float)hd * part / all;
            sq[h] = temp > 0.0f ? 1.0f / sqrtf(temp) : 0.0f;
            if (qscale) qscale[kh * g + h] = sq[h];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < g * C; i += blockDim.x) {
        int h = i / C, j = i % C;
        qc[i] = qg[(size_t)h * hd + pl[rj[j] - kh * R]] * sq[h];
    }
    __syncthreads();
}

/* A running (max, sum of weights) pair of kv_select_combine's softmax and
 * one more score x (weights as rf_w). */
static __device__ __forceinline__ void rf_add(float &m, float &l, float x)
{
    if (x != x || x == -INFINITY) return; /* weight 0 whatever the max */
    if (x > m) {
        l = l * expf(m - x) + 1.0f; /* m -inf: l is 0; x +inf: the finite ones weigh 0 */
        m = x;
    } else {
        l += m == INFINITY ? (float)(x == INFINITY) : expf(x - m);
    }
}

/* Two pairs merged. */
static __device__ __forceinline__ void rf_merge(float &m, float &l, float m2, float l2)
{
    const float M = fmaxf(m, m2);
    if (M == -INFINITY) return;
    const float a = m == -INFINITY ? 0.0f : M == INFINITY ? (m == INFINITY ? l : 0.0f) : l * expf(m - M);
    const float b = m2 == -INFINITY ? 0.0f : M == INFINITY ? (m2 == INFINITY ? l2 : 0.0f) : l2 * expf(m2 - M);
    m = M;
    l = a + b;
}

/* One block per KV head: this step's columns and scales (rf_pool), once,
 * so that the score passes' blocks start from them rather than each
 * repeating the ranking (measured: the repeated prologue held the SMs). */
__global__ void __launch_bounds__(RF_THREADS)
rf_pool_kernel(const float *q, const float *chmax, const int *pool, int R, int C, int g, int hd, int *cols,
               float *qscale, int early)
{
    extern __shared__ float sm[]; /* qc (g*C), rj (C), ps (R), rk (R) */
    __shared__ float sq[SEL_MAXG];
    float *qc = sm;
    int *rj = (int *)(qc + g * C), *rk = rj + C + R;
    float *ps = (float *)(rj + C);
    if (early) kv_pdl_launch_next();
    kv_pdl_wait();
    rf_pool(q, chmax, pool, R, C, g, hd, blockIdx.x, qc, rj, ps, rk, sq, cols, qscale);
}

/* qc (g, C) and rj (C) of KV head kh from rf_pool_kernel's columns and scales. */
static __device__ __forceinline__ void rf_qc(const float *q, const int *pool, int R, int C, const int *cols,
                                             const float *qscale, int g, int hd, int kh, float *qc, int *rj)
{
    for (int i = threadIdx.x; i < g * C; i += blockDim.x) {
        int h = i / C, j = i % C, qh = kh * g + h;
        qc[i] = q[(size_t)qh * hd + pool[kh * R + cols[kh * C + j]]] * qscale[qh];
    }
    for (int j = threadIdx.x; j < C; j += blockDim.x) rj[j] = kh * R + cols[kh * C + j];
    __syncthreads();
}

/* Per block and query head: the max and sum of weights of its chunks' scores. */
template <int BITS, int G>
__global__ void __launch_bounds__(RF_THREADS)
rf_stats_kernel(const float *q, const int *pool, int R, int C, const int *cols, const float *qscale,
                const uint8_t *rows, const uint16_t *scale, const uint16_t *zero, int ldt, int g, int hd, int cs,
                int cend, float *part, int early)
{
    extern __shared__ float sm[]; /* qc (g*C), rj (C) */
    __shared__ float rm[RF_THREADS / 32][G], rl[RF_THREADS / 32][G];
    float *qc = sm;
    int *rj = (int *)(qc + g * C);
    if (early) kv_pdl_launch_next();
    kv_pdl_wait();
    const int kh = blockIdx.y, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    rf_qc(q, pool, R, C, cols, qscale, g, hd, kh, qc, rj);
    float m[G], l[G];
#pragma unroll
    for (int h = 0; h < G; h++) m[h] = -INFINITY, l[h] = 0.0f;
    const int nch = rf_chunks(cs, cend);
    for (int c = blockIdx.x; c < nch; c += gridDim.x) {
        const int t8 = (cs & ~7) + 8 * (c * RF_THREADS + threadIdx.x);
        float acc[G][8];
        rf_scores<BITS, G>(rows, scale, zero, ldt, g, C, qc, rj, t8, cend, acc);
#pragma unroll
        for (int h = 0; h < G; h++)
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (t8 + i >= cs && t8 + i < cend) rf_add(m[h], l[h], acc[h][i]);
    }
#pragma unroll
    for (int h = 0; h < G; h++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_xor_sync(0xffffffffu, m[h], o), l2 = __shfl_xor_sync(0xffffffffu, l[h], o);
            rf_merge(m[h], l[h], m2, l2);
        }
        if (lane == 0) rm[w][h] = m[h], rl[w][h] = l[h];
    }
    __syncthreads();
    if (threadIdx.x < g) {
        float M = -INFINITY, L = 0.0f;
        for (int v = 0; v < RF_THREADS / 32; v++) rf_merge(M, L, rm[v][threadIdx.x], rl[v][threadIdx.x]);
        float *o = part + ((size_t)(kh * g + threadIdx.x) * gridDim.x + blockIdx.x) * 2;
        o[0] = M;
        o[1] = L;
    }
}

/* Softmax with the merged statistics, the combine, comb, digit 1's histogram. */
template <int BITS, int G>
__global__ void __launch_bounds__(RF_THREADS)
rf_comb_kernel(const float *q, const int *pool, int R, int C, const int *cols, const float *qscale,
               const uint8_t *rows, const uint16_t *scale, const uint16_t *zero, int ldt, int g, int hd,
               int cs, int cend, int reduce_max, const float *part, int k, float *comb, tm_head *ws, int early)
{
    extern __shared__ float sm[]; /* qc (g*C), rj (C) */
    __shared__ unsigned sh[TM_BIN1];
    __shared__ float mz[2 * SEL_MAXG];
    __shared__ int sw[9], sbin[2];
    __shared__ bool s_last;
    float *qc = sm;
    int *rj = (int *)(qc + g * C);
    if (early) kv_pdl_launch_next();
    for (int b = threadIdx.x; b < TM_BIN1; b += RF_THREADS) sh[b] = 0u;
    kv_pdl_wait();
    const int kh = blockIdx.y, lane = threadIdx.x & 31, w = threadIdx.x >> 5, n = cend - cs;
    rf_qc(q, pool, R, C, cols, qscale, g, hd, kh, qc, rj);
    if (w < g) { /* warp h merges head h's block statistics */
        const float *st = part + (size_t)(kh * g + w) * gridDim.x * 2;
        float M = -INFINITY, Z = 0.0f;
        for (unsigned b = lane; b < gridDim.x; b += 32) rf_merge(M, Z, st[2 * b], st[2 * b + 1]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_xor_sync(0xffffffffu, M, o), l2 = __shfl_xor_sync(0xffffffffu, Z, o);
            rf_merge(M, Z, m2, l2);
        }
        if (lane == 0) {
            mz[2 * w] = M;
            mz[2 * w + 1] = Z > 0.0f ? 1.0f / Z : 0.0f;
        }
    }
    __syncthreads();
    float *cr = comb + (size_t)kh * n;
    const int nch = rf_chunks(cs, cend);
    for (int ch = blockIdx.x; ch < nch; ch += gridDim.x) {
        const int t8 = (cs & ~7) + 8 * (ch * RF_THREADS + threadIdx.x);
        float acc[G][8];
        rf_scores<BITS, G>(rows, scale, zero, ldt, g, C, qc, rj, t8, cend, acc);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int t = t8 + i;
            const bool ok = t >= cs && t < cend;
            float c = 0.0f;
#pragma unroll
            for (int h = 0; h < G; h++)
                if (h < g) {
                    float pr = rf_w(acc[h][i], mz[2 * h]) * mz[2 * h + 1];
                    c = reduce_max ? (pr > c ? pr : c) : c + pr;
                }
            if (ok) cr[t - cs] = c;
            hist_add(sh, ord_key(c) >> 20, ok);
        }
    }
    tm_head *hw = ws + kh;
    tm_flush(sh, hw->hist1, TM_BIN1);
    if (!tm_last(hw, 0, &s_last)) return;
    int need = k;
    const int b = tm_pick(hw->hist1, TM_BIN1, &need, sw, sbin);
    if (threadIdx.x == 0) {
        hw->pre = (uint32_t)b << 20;
        hw->need = need;
    }
}

template <int BITS, int G>
static cudaError_t rf_launch(const float *q, const float *chmax, const int *pool, int R, int C,
                             const uint8_t *rows, const uint16_t *scale, const uint16_t *zero, int ldt,
                             int g, int hd, int cs, int cend, int reduce_max, int k, float *comb,
                             int *cols, float *qscale, int *sel, tm_head *hw, float *part, int nkv,
                             int blocks, int flags, cudaStream_t s)
{
    const dim3 grid(grid_of(rf_chunks(cs, cend), blocks), (unsigned)nkv);
    const size_t sm1 = ((size_t)g * C + C + 2 * (size_t)R) * 4, sm2 = ((size_t)g * C + C) * 4;
    const int lv = flags & ENG_SEL_NOPDL ? KV_PDL_NONE : 2, early = !(flags & ENG_SEL_LATE);
    CUDA_CHECK(kv_launch(lv, rf_pool_kernel, dim3((unsigned)nkv), dim3(RF_THREADS), sm1, s, q, chmax, pool, R, C, g,
                         hd, cols, qscale, early));
    CUDA_CHECK(kv_launch(lv, rf_stats_kernel<BITS, G>, grid, dim3(RF_THREADS), sm2, s, q, pool, R, C,
                         (const int *)cols, (const float *)qscale, rows, scale, zero, ldt, g, hd, cs, cend, part,
                         early));
    CUDA_CHECK(kv_launch(lv, rf_comb_kernel<BITS, G>, grid, dim3(RF_THREADS), sm2, s, q, pool, R, C,
                         (const int *)cols, (const float *)qscale, rows, scale, zero, ldt, g, hd, cs, cend,
                         reduce_max, (const float *)part, k, comb, hw, early));
    return tm_tail(comb, nkv, cend - cs, k, cs, sel, hw, blocks, flags, s);
}

extern "C" cudaError_t eng_resident_select(const float *q, const float *chmax, const int *pool, int R,
                                           int C, const void *rows, const uint16_t *scale,
                                           const uint16_t *zero, int ldt, int bits, int nq_heads,
                                           int nkv, int hd, int cs, int cend, int reduce_max, int k,
                                           float *comb, int *cols, float *qscale, int *sel, void *ws,
                                           int blocks, int flags, cudaStream_t s)
{
    const int n = cend - cs;
    if (k <= 0 || n <= 0) return cudaSuccess;
    KV_CHECK_ARGS(nq_heads % nkv == 0 && nq_heads / nkv <= SEL_MAXG && ldt % 64 == 0 && cend <= ldt &&
                  C >= 1 && C <= R && R <= hd && k <= n && ws && eng_topk_many_fits(n) &&
                  (bits == 16 || (scale && zero)));
    const int g = nq_heads / nkv;
    tm_head *hw = (tm_head *)ws;
    float *part = (float *)((uint8_t *)ws + eng_topk_many_ws(nkv));
    const uint8_t *r = (const uint8_t *)rows;
#define RF(B)                                                                                             \
    return g <= 4 ? rf_launch<B, 4>(q, chmax, pool, R, C, r, scale, zero, ldt, g, hd, cs, cend, reduce_max, \
                                    k, comb, cols, qscale, sel, hw, part, nkv, blocks, flags, s)           \
                  : rf_launch<B, 8>(q, chmax, pool, R, C, r, scale, zero, ldt, g, hd, cs, cend, reduce_max, \
                                    k, comb, cols, qscale, sel, hw, part, nkv, blocks, flags, s)
    switch (bits) {
    case 16: RF(16);
    case 8: RF(8);
    case 4: RF(4);
    case 2: RF(2);
    case 1: RF(1);
    default: KV_CHECK_ARGS(!"bits");
    }
#undef RF
    return cudaSuccess;
}
