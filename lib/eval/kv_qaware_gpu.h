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

/*
 * The same in two steps, so that the sketch's codes (most of the bytes)
 * are copied while the probe still runs: kv_qaware_gpu_stage allocates
 * device memory and issues the codes' copy on a non-blocking stream of its
 * own (stream-ordered allocation: nothing waits for the device's other
 * work), from any thread, and returns; kv_qaware_score_gpu_staged scores on
 * that stream (its upload_ms includes waiting for the copy still running);
 * kv_qaware_gpu_unstage frees it (NULL is fine).  sk's codes must stay
 * where they are until the score returns (they are read by the copy).
 * kv_qaware_gpu_stage_ms: the stage call's own time.
 */
typedef struct kv_qaware_staged kv_qaware_staged;
kv_status kv_qaware_gpu_stage(const kv_tree_sketch *sk, int L, int Hkv, int device, kv_qaware_staged **out);
kv_status kv_qaware_score_gpu_staged(kv_qaware_staged *g, const kv_tree_sketch *sk, const float *q, int L, int H,
                                     int Hkv, int nq, int D, kv_qaware_heads how, double *score,
                                     kv_qaware_gpu_times *tm);
void kv_qaware_gpu_unstage(kv_qaware_staged *g);
double kv_qaware_gpu_stage_ms(const kv_qaware_staged *g);

#endif
