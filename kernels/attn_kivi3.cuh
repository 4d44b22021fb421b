/*
 * Packed KIVI decode attention, version 3 (attn_kivi3.cu): the host side
 * that kv_cuda_attn_kivi (attn_kivi.cu) dispatches to for group 64 when
 * kv_cuda_tuning.kivi_kernel selects it.  Same arguments and results as
 * kv_cuda_attn_kivi; the workspace is at most kv_kivi3_workspace bytes.
 */
#ifndef KV_ATTN_KIVI3_CUH
#define KV_ATTN_KIVI3_CUH

#include "kv_kernels.h"

/* Does v3 serve this geometry (bits 1, 2 or 4, group 64, head_dim 128,
 * 1, 2 or 4 query heads per KV head)?  4 bits only v3 serves. */
bool kv_kivi3_ok(const kv_attn_dims *d, const kv_kivi_params *prm);
size_t kv_kivi3_workspace(const kv_attn_dims *d, const kv_kivi_params *prm);
cudaError_t kv_kivi3_launch(const kv_attn_dims *d, const kv_kivi_params *prm, const uint16_t *q,
                            const kv_cuda_kivi_view *K, const kv_cuda_kivi_view *V, float *out,
                            void *ws, size_t ws_bytes, cudaStream_t stream);

#endif
