/*
 * prefill_attn_sm90a: the wgmma kernels of the prefill attention (internal to
 * kernels/: pf_attn in prefill_attn.cu dispatches to them; the tma ones are
 * in prefill_attn_tma_sm90a.cu).  ti: 0 fp16,
 * 1 bf16, 2 fp16 in with bf16 out.
 */
#ifndef PREFILL_ATTN_SM90A_H
#define PREFILL_ATTN_SM90A_H

#include "prefill_ops.h"

/* The wgmma tile pf_attn's variant 0 uses on Hopper when the tma kernels
 * below cannot run (index into these): wg2n128, the fastest of these alone
 * at 128k and tied in the prefill in the device runs of
 * tools/device/NOTES-prefill.md. */
#define PF_WG_DEFAULT 0

int pf_attn_wg_variants(void);
const char *pf_attn_wg_name(int variant);
/* Is the current device one that runs sm_90a code (compute capability 9.0)? */
int pf_attn_wg_available(void);
cudaError_t pf_attn_wg(const pf_attn_args *a, int ti, int variant, cudaStream_t s);

/* The warp-specialized kernels (prefill_attn_tma_sm90a.cu: a producer warpgroup
 * loading K/V tiles through the tensor copy engine, consumer warpgroups on
 * wgmma), numbered after the wgmma tiles above.  cudaErrorNotSupported off
 * Hopper or where the driver has no tensor-map encoder.  PF_TMA_DEFAULT:
 * the one variant 0 uses where they run (-1: the wgmma tile PF_WG_DEFAULT
 * stays the default): tma2n128op, the fastest alone at 32k (614.7 TFLOP/s
 * against wg2n128's 444) and tied with tma2n128s3op at 128k inside the
 * chunked prefill (576.8 and 577.8 against 431.9), device round of
 * 2026-12-01 20:31 in tools/device/NOTES-prefill.md. */
#define PF_TMA_DEFAULT 0
int pf_attn_tma_variants(void);
/* Hopper and a driver that encodes tensor maps: the tma kernels run. */
int pf_attn_tma_available(void);
const char *pf_attn_tma_name(int variant);
cudaError_t pf_attn_tma(const pf_attn_args *a, int ti, int variant, cudaStream_t s);

#endif
