/*
 * kv_qaware_gpu: step 3 of a query-aware load (lib/eval/kv_qaware.h), the
 * scoring of every matched prefix position by the request's queries over
 * the key sketch, on the GPU (kernels/qaware_score.cu), for a runner whose
 * engine is there.  Same inputs and result as kv_qaware_score_cpu, the
 * reference it is tested against (tests/unit/test_gpu_qaware.c): equal to
 * about 1e-5 relative (the host's softmax uses a polynomial exponential,
 * the device's expf).
 */
#ifndef KV_QAWARE_GPU_H
#define KV_QAWARE_GPU_H

#include "common/kv_status.h"
#include "eval/kv_qaware.h"
#include "tree/kv_tree.h"

typedef struct {
    double upload_ms;   /* device memory, the folded queries, the codes copied in */
    double kernel_ms;   /* the four passes */
    double download_ms; /* the scores back and added in */
} kv_qaware_gpu_times;

/*
 * The scores of kv_qaware_score_cpu (same arguments, score combined with as
 * there: added to for KV_QAWARE_SUM, raised to for KV_QAWARE_MAX) computed on
 * CUDA device `device` (the runner's: kv_gpu_engine_ordinal), with the
 * thread's current device restored after.  Synchronous.  Any CUDA failure
 * is returned with its statement and reason (kv_gpu_cuda.h), score then
 * unchanged; KV_E_UNAVAILABLE in a build without CUDA; KV_E_INTERNAL for
 * segments that do not tile [0, sk->matched).  tm may be NULL.
 */
kv_status kv_qaware_score_gpu(const kv_tree_sketch *sk, const float *q, int L, int H, int Hkv, int nq, int D,
                              kv_qaware_heads how, int device, double *score, kv_qaware_gpu_times *tm);

#endif
