/*
 * kv_device: the --device spellings (see kv_device.h).
 */
#include "common/kv_device.h"

#include <stdlib.h>
#include <string.h>

/* A CUDA ordinal: decimal digits only, 0..1023. */
static int parse_ordinal(const char *s)
{
    if (!*s || strspn(s, "0123456789") != strlen(s) || strlen(s) > 4) return -1;
    long v = strtol(s, NULL, 10);
    return v <= 1023 ? (int)v : -1;
}

kv_status kv_device_parse(const char *s, kv_device *out, int *ordinal)
{
    kv_device d;
    int n = 0;
    if (!strcmp(s, "cpu")) d = KV_DEVICE_CPU;
    else if (!strcmp(s, "cuda")) d = KV_DEVICE_CUDA;
    else if (!strcmp(s, "auto")) d = KV_DEVICE_AUTO;
    else if (!strncmp(s, "cuda:", 5) && (n = parse_ordinal(s + 5)) >= 0) d = KV_DEVICE_CUDA;
    else if ((n = parse_ordinal(s)) >= 0) d = KV_DEVICE_CUDA;
    else
        return kv_fail(KV_E_USAGE, "unknown device '%s': must be cpu, cuda or auto (cuda:N or N for a CUDA device)", s);
    *out = d;
    if (ordinal) *ordinal = n;
    return KV_OK;
}

const char *kv_device_name(kv_device dev)
{
    switch (dev) {
    case KV_DEVICE_CPU: return "cpu";
    case KV_DEVICE_CUDA: return "cuda";
    case KV_DEVICE_AUTO: return "auto";
    }
    return "?";
}
