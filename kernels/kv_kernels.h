/*
 * kv_kernels: the C interface (extern "C", usable from C11) to the CUDA
 * kernels in kernels/ (one .cu per operation).  Every pointer is a device pointer; fp16 data is
 * passed as uint16_t (IEEE binary16 bits, kv_half on the host).  Each
 * launcher only enqueues work on the given stream and returns the first
 * CUDA error (kv_cuda_last_error() then says which statement, file, line and
 * device); none prints or synchronises.  Compiled into the library only when
 * KV_HAVE_CUDA is defined; C code must guard its calls the same way.
 *
 * Layouts follow lib/common/kv_layout.h (KIVI) and the CPU references in
 * lib/attn/kv_attn.h and lib/quant/kv_quant.h, which the tests compare against.
 */
#ifndef KV_KERNELS_H
#define KV_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "common/kv_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The statement, file, line and device of the last failure on this thread
 * ("" when none was recorded since the last kv_cuda_clear_error). */
const char *kv_cuda_last_error(void);
void kv_cuda_clear_error(void);
/* Record a failure (what every launcher does through CUDA_CHECK; C code in
 * lib/gpu does it through kv_cuda_fail). */
void kv_cuda_record(cudaError_t e, const char *stmt, const char *file, int line);

/* Programmatic dependent launch (sm_90 and later): level 1 launches the
 * engine's GEMVs with it, level 2 also RoPE, the fp16 and packed attention and their
 * combine.  A kernel launched so may start while the previous kernel in
 * the stream finishes and waits for it in-kernel (griddepcontrol), hiding
 * launch gaps; every such kernel reads nothing an earlier kernel writes
 * before that wait.  Off (0) until set; the GPU engine sets level 2 on
 * Hopper.  For the whole process; only for compute capability 9.0 or
 * later. */
void kv_cuda_set_pdl(int level);
int kv_cuda_pdl(void);

/*
 * Kernel variants kept for measurement (docs/BENCHMARKS.md, Kernels), for the
 * whole process like the PDL level; the defaults are the measured-faster
 * ones.  Set before the first launch (kernel choices and occupancies are
 * cached per instance, not per setting, so changing them later is safe).
 */
typedef struct {
    int f16_prefetch; /* fp16 attention: 1 = the loop that issues the next step's loads
                         before this step's math (D 64/128 only; measured slower) */
    int f16_unroll;   /* fp16 attention: K and V rows in flight per lane, 4 or 8 (8: D 128,
                         4 query heads per KV head only) */
    int f16_waves;    /* fp16 attention: grid sized for this many waves of resident blocks (1) */
    int kivi2_var;    /* packed attention: v2 variant bits (attn_kivi.cu; 0 = the default;
                         8, 16, 32 are timing diagnostics that compute wrong results) */
    int f16_legacy;   /* fp16 attention: 1 = the register-streaming kernel everywhere, not the
                         pipelined tensor-core one (attn_f16_tc.cu); f16_prefetch and
                         f16_unroll 8 imply it */
    int kivi_kernel;  /* packed attention: 0 = the default, 2 = v2 (attn_kivi.cu), 3 = v3
                         (attn_kivi3.cu) where it serves the geometry, else v2 */
    int kivi3_nst;    /* v3: shared-memory stages per warp, 2, 3 or 4 (0 = the default) */
    int kivi3_unfused; /* v3 merge of the splits: 0 = the default (kv_attn_combine), 1 = the
                          combine pass, 2 = the last block of each KV head merges */
    int kivi3_cps;    /* v3: at most this many blocks per SM in the grid plan (0 = occupancy) */
    int kivi3_diag;   /* v3 timing diagnostics (wrong results): 1 = staging only, 2 = compute
                         only (the first stages computed again, no further loads), 3 = 2
                         without the value MMAs, 4 = 2 without the key MMAs */
    int kivi3_noprefetch; /* v3: 1 = no L2 prefetch of the first groups before the PDL wait */
    int kivi3_var;    /* v3 variant bits (attn_kivi3.cu): 1 = value-operand sums in fp32 adds,
                         not MMAs (an instance for 4 query heads per KV head only) */
} kv_cuda_tuning;

void kv_cuda_tuning_default(kv_cuda_tuning *t);
void kv_cuda_set_tuning(const kv_cuda_tuning *t);
const kv_cuda_tuning *kv_cuda_get_tuning(void);

// --- decode attention ---------------------------------------------------------

/* Bytes of scratch the fp16 attention needs for these dimensions. */
size_t kv_cuda_attn_f16_workspace(const kv_attn_dims *d);

/*
 * Flash-decoding fp16 attention, the one fp16 decode attention of kvtools
 * (the GPU engine's every fp16 layer and `kv-bench attn`): blocks split the
 * sequence, each writes a partial (max, sum, output) per query head, and a
 * combine pass merges them.  Head dims 64 and 128 (16-byte aligned K, V,
 * sm_90) run on the tensor cores with the query and the probabilities as
 * fp16 operands (normalized error about 1e-4 to 1e-3 against float32);
 * other head dims, and kv_cuda_attn_f16_q32 always, in float32.  Both kernels use programmatic dependent launch at
 * level 2.
 *   q:   (n_heads, head_dim) fp16
 *   k,v: (kv_heads, head_stride) fp16, token t of head h at h*head_stride + t*head_dim
 *   out: (n_heads, head_dim) float
 *   ws:  kv_cuda_attn_f16_workspace(d) bytes
 */
cudaError_t kv_cuda_attn_f16(const kv_attn_dims *d, const uint16_t *q, const uint16_t *k,
                             const uint16_t *v, float *out, void *ws, size_t ws_bytes,
                             cudaStream_t stream);

/* The same kernel with a float32 query q (n_heads, head_dim), and its
 * workspace (the GPU engine's query where it is not fp16). */
size_t kv_cuda_attn_f16_q32_workspace(const kv_attn_dims *d);
cudaError_t kv_cuda_attn_f16_q32(const kv_attn_dims *d, const float *q, const uint16_t *k,
                                 const uint16_t *v, float *out, void *ws, size_t ws_bytes,
                                 cudaStream_t stream);

/* Device pointers to one packed KIVI layer (shapes as in lib/common/kv_layout.h). */
typedef struct {
    const uint8_t *codes;  /* (kv_heads, nq, head_dim*bits/8) */
    const uint16_t *scale; /* keys (kv_heads, nq/G, head_dim); values (kv_heads, nq, head_dim/Gv) */
    const uint16_t *zero;  /* same shape as scale */
    const uint16_t *resid; /* (kv_heads, T - nq, head_dim) fp16 */
} kv_cuda_kivi_view;

/* Is this packed geometry supported by kv_cuda_attn_kivi (bits 1 or 2,
 * head_dim 128, group 32 or 64, n_heads/kv_heads 1, 2 or 4)?  The kernel
 * also needs an sm_80 or newer GPU (tensor-core mma.m16n8k16, cp.async).
 * Group 64 runs on v3 (attn_kivi3.cu: deeper staging, the splits merged by
 * the last block) when kv_cuda_tuning.kivi_kernel asks for it, else v2. */
int kv_cuda_attn_kivi_supported(const kv_attn_dims *d, const kv_kivi_params *prm);
size_t kv_cuda_attn_kivi_workspace(const kv_attn_dims *d, const kv_kivi_params *prm);
/* Which kernel kv_cuda_attn_kivi runs for this geometry under the current
 * tuning: 2 or 3 (0 when unsupported). */
int kv_cuda_attn_kivi_kernel(const kv_attn_dims *d, const kv_kivi_params *prm);

/*
 * Decode attention straight from KIVI-packed keys and values, with the key
 * scales and zeros folded into the query per group (tensor-core MMA on the
 * codes), the fp16 residual tokens attended densely, then combined.
 *   q: (n_heads, head_dim) fp16; out: (n_heads, head_dim) float
 *   d->head_stride is ignored (packed parts are dense as in kv_layout.h)
 */
cudaError_t kv_cuda_attn_kivi(const kv_attn_dims *d, const kv_kivi_params *prm,
                              const uint16_t *q, const kv_cuda_kivi_view *K,
                              const kv_cuda_kivi_view *V, float *out, void *ws, size_t ws_bytes,
                              cudaStream_t stream);

// --- KIVI pack / unpack -------------------------------------------------------

/* Output parts of a packed layer (device pointers, shapes as above). */
typedef struct {
    uint8_t *codes;
    uint16_t *scale;
    uint16_t *zero;
    uint16_t *resid;
} kv_cuda_kivi_out;

/* Is this geometry supported by the pack/unpack kernels (head_dim 64 or
 * 128, G*head_dim <= 8192 for keys, value groups of 32, 64 or 128)? */
int kv_cuda_kivi_pack_supported(kv_kivi_axis axis, const kv_kivi_params *prm, int head_dim);

/*
 * Pack x (H, T, D) fp16 into KIVI codes, scale, zero and the fp16 residual,
 * byte-identical to kv_kivi_pack in lib/quant/kv_quant.c.
 */
cudaError_t kv_cuda_kivi_pack(kv_kivi_axis axis, const kv_kivi_params *prm, int H, int T, int D,
                              const uint16_t *x, const kv_cuda_kivi_out *out,
                              cudaStream_t stream);

/* Dequantize a packed layer into out (H, T, D) fp16 (residual copied). */
cudaError_t kv_cuda_kivi_unpack(kv_kivi_axis axis, const kv_kivi_params *prm, int H, int T,
                                int D, const kv_cuda_kivi_view *in, uint16_t *out,
                                cudaStream_t stream);

// --- DSQ pack / unpack -------------------------------------------------------

/* Device pointers to one DSQ-packed layer (shapes as in lib/common/kv_layout.h;
 * base is NULL for values). */
typedef struct {
    const uint8_t *mask;    /* (kv_heads, nw, W/8) */
    const int8_t *sal;      /* (kv_heads, nw, S, head_dim) */
    const uint16_t *sscale; /* (kv_heads, nw, head_dim) */
    const uint16_t *base;   /* (kv_heads, nw, head_dim), keys only */
    const uint8_t *codes;   /* (kv_heads, nw, W-S, head_dim*bits/8) */
    const uint16_t *scale;  /* (kv_heads, nw, W-S, head_dim/Gd) */
    const uint16_t *zero;   /* same shape as scale */
    const uint16_t *resid;  /* (kv_heads, T - nw*W, head_dim) fp16 */
} kv_cuda_dsq_view;

typedef struct {
    uint8_t *mask;
    int8_t *sal;
    uint16_t *sscale, *base;
    uint8_t *codes;
    uint16_t *scale, *zero, *resid;
} kv_cuda_dsq_out;

/* Is this geometry supported by the DSQ kernels (head_dim 64 or 128, window
 * a multiple of 8 up to 128, at most 4 channel groups)? */
int kv_cuda_dsq_supported(const kv_dsq_params *p, int head_dim);

/*
 * Pack x (H, T, D) fp16 with importance imp (H, T) float (required; the
 * CPU's key-norm default is not provided) into DSQ parts, byte-identical to
 * kv_dsq_pack in lib/quant/kv_dsq.c given the same importance.
 */
cudaError_t kv_cuda_dsq_pack(kv_kivi_axis axis, const kv_dsq_params *p, int H, int T, int D,
                             const uint16_t *x, const float *imp, const kv_cuda_dsq_out *out,
                             cudaStream_t stream);

/* Dequantize into out (H, T, D) float, equal to kv_dsq_unpack bit for bit. */
cudaError_t kv_cuda_dsq_unpack(kv_kivi_axis axis, const kv_dsq_params *p, int H, int T, int D,
                               const kv_cuda_dsq_view *in, float *out, cudaStream_t stream);

// --- query-aware scoring of a key sketch -------------------------------------

/* One sketched node on the device (lib/eval/kv_qaware.h, kv_tree_sketch_seg):
 * prefix positions [start, start + n), r channels per KV head. */
typedef struct {
    int start, n, r;
    int unused;       /* keeps the offsets 8-byte aligned in C and CUDA alike */
    size_t code_off;  /* bytes into codes: (LH, n, r) int8, 4-byte aligned */
    size_t qs_off;    /* floats into qs: (LH, Q, r) the folded queries */
} kv_cuda_qaware_seg;

/* Bytes of scratch kv_cuda_qaware_score needs. */
size_t kv_cuda_qaware_workspace(int LH, int Q, int m);

/*
 * The scores of kv_qaware_score_cpu (lib/eval/kv_qaware.h) on the device:
 * a(lh, t) = sum over queries j < Q of softmax_t(qs_j . code_t) for the m
 * positions t and (l, h) pairs lh < LH, each softmax over all m (float
 * logits, expf); score[t] = the largest a(., t) (take_max nonzero) or the sum
 * over lh added in double in a fixed order (deterministic either way).
 *   seg:   (nseg) device, tiling [0, m) in order
 *   codes: the segments' codes, seg[s].code_off bytes in: (LH, n, r) int8
 *   qs:    the segments' folded queries, seg[s].qs_off floats in: (LH, Q, r)
 *   score: (m) double, written (not added to)
 */
cudaError_t kv_cuda_qaware_score(int LH, int Q, int m, int nseg, const kv_cuda_qaware_seg *seg,
                                 const int8_t *codes, const float *qs, void *ws, size_t ws_bytes,
                                 int take_max, double *score, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
