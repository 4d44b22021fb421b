/*
 * kv_device: where a model runs, as every front end spells it (--device).
 * It lives at the bottom of the library because the policy checks
 * (lib/policy), the runner (lib/engine) and the evaluation code all take it.
 */
#ifndef KV_DEVICE_H
#define KV_DEVICE_H

#include "common/kv_status.h"

typedef enum {
    KV_DEVICE_CPU = 0, /* lib/engine/kv_engine */
    KV_DEVICE_CUDA,    /* lib/gpu/kv_gpu_engine; failing that is an error */
    KV_DEVICE_AUTO     /* the GPU engine when it can be built, else the CPU engine */
} kv_device;

/*
 * "cpu", "cuda", "auto", "cuda:N" or "N" (a CUDA device ordinal, the form
 * kv-bench decode took first); anything else is KV_E_USAGE and leaves the
 * outputs alone.  *ordinal (may be NULL) is N for the last two forms and 0
 * otherwise.
 */
kv_status kv_device_parse(const char *s, kv_device *out, int *ordinal);
/* The inverse for the kinds: "cpu", "cuda" or "auto". */
const char *kv_device_name(kv_device dev);

#endif
