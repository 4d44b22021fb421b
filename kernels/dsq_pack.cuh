/*
 * DSQ (lib/common/kv_layout.h) pack and unpack on the GPU, byte-identical to
 * kv_dsq_pack / kv_dsq_unpack in lib/quant/kv_dsq.c: one block per (window, KV
 * head), a thread per channel.  Thread 0 picks the salient tokens with the
 * CPU's rule (S passes of "largest not yet taken", ties to the earlier
 * token, NaN least important); per-channel INT8 scales, the key base (a
 * float64 sum in token order, as on the CPU) and the non-salient rows'
 * per-token groups (KIVI value rounding, kivi_pack.cuh) follow.  IEEE
 * operations are spelled out (__fdiv_rn, __fadd_rn, __fmul_rn) so that no
 * contraction changes a rounding.  DSQ is packed once per window as the
 * cache grows, so this kernel is written for exactness, not for bandwidth.
 */
#ifndef KV_DSQ_PACK_CUH
#define KV_DSQ_PACK_CUH

#include "kivi_pack.cuh"

#define KV_DSQ_MAX_WINDOW 128 /* tokens per window the kernels hold in shared memory */

#endif
