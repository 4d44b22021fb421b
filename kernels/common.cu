/*
 * The failure record behind CUDA_CHECK, the process-wide PDL level and
 * kernel tuning, and device properties shared by the launchers.  The
 * failure message is kept per host thread, like kv_errdetail().
 */
#include "common.cuh"

#include <stdio.h>

static thread_local char last_msg[512];

extern "C" void kv_cuda_record(cudaError_t e, const char *stmt, const char *file, int line)
{
    int dev = -1;
    (void)cudaGetDevice(&dev);
    snprintf(last_msg, sizeof last_msg, "%s failed at %s:%d on device %d: %s", stmt, file, line,
             dev, cudaGetErrorString(e));
}

extern "C" const char *kv_cuda_last_error(void) { return last_msg; }
extern "C" void kv_cuda_clear_error(void) { last_msg[0] = '\0'; }

static int pdl_level;
extern "C" void kv_cuda_set_pdl(int level) { pdl_level = level < 0 ? 0 : level > 2 ? 2 : level; }
extern "C" int kv_cuda_pdl(void) { return pdl_level; }

static kv_cuda_tuning tuning = {0, 4 /* KV_F16_UNROLL */, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};

extern "C" void kv_cuda_tuning_default(kv_cuda_tuning *t)
{
    t->f16_prefetch = 0;
    t->f16_unroll = 4 /* KV_F16_UNROLL */;
    t->f16_waves = 1;
    t->kivi2_var = 0;
    t->f16_legacy = 0;
    t->kivi_kernel = 0;
    t->kivi3_nst = 0;
    t->kivi3_unfused = 0;
    t->kivi3_cps = 0;
    t->kivi3_diag = 0;
    t->kivi3_noprefetch = 0;
    t->kivi3_var = 0;
}

extern "C" void kv_cuda_set_tuning(const kv_cuda_tuning *t)
{
    if (t) tuning = *t;
    else kv_cuda_tuning_default(&tuning);
    if (tuning.f16_waves < 1) tuning.f16_waves = 1;
}

extern "C" const kv_cuda_tuning *kv_cuda_get_tuning(void) { return &tuning; }

int kv_cuda_sm_count(void)
{
    static thread_local int cached_dev = -1, cached_sms = 0;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 1;
    if (dev != cached_dev) {
        int sms = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
            sms < 1)
            sms = 1;
        cached_dev = dev;
        cached_sms = sms;
    }
    return cached_sms;
}
