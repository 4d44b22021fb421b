/*
 * kv_gpu: what the build and the machine offer.  In a CPU-only build
 * (KV_HAVE_CUDA undefined) every probe reports "no GPU"; in a CUDA build the
 * runtime is linked statically, so a binary still starts on a machine with
 * no driver and the probe simply finds no device.
 */
#ifndef KV_GPU_H
#define KV_GPU_H

#include <stdbool.h>
#include <stddef.h>

#include "common/kv_status.h"

/* Was CUDA compiled in? */
bool kv_gpu_built(void);
/* Number of usable devices (0 if none, no driver, or not built); writes the
 * first device's name (or the reason none is usable) into name. */
int kv_gpu_probe(char *name, size_t n);

/* Device memory for a cache tier held on the GPU (kv-bench prefix): n bytes
 * of host data copied into a new device buffer (*dev; NULL for n 0), and
 * its release.  KV_E_UNAVAILABLE without CUDA, KV_E_NOMEM when full. */
kv_status kv_gpu_buffer_upload(const void *host, size_t n, void **dev);
void kv_gpu_buffer_free(void *dev);
/* Pinned host memory (copies to the GPU at full PCIe speed), for a host
 * tier; plain malloc without CUDA or a device.  Free with kv_gpu_host_free. */
void *kv_gpu_host_alloc(size_t n);
void kv_gpu_host_free(void *p);

#endif
