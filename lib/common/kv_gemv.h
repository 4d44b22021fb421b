/*
 * kv_gemv: the variants of the GPU engine's packed decode GEMV
 * (kernels/eng_gemv_qv.cu says how they differ), in one table that the
 * kernels (their numbers), kv-run --gemv-variant and kv-bench gemv (the
 * names: parsing, --help and reports) all take.  It sits in lib/common
 * because kernels/ may include nothing above it.  C and CUDA.
 */
#ifndef KV_GEMV_H
#define KV_GEMV_H

/* X(enum suffix, name): the one list.  DEFAULT (0) takes eng_gemvq_best's
 * choice for the type and shape, what the engine uses; the others are the
 * packed kernels a measurement can force. */
#define KV_GEMV_PACKED(X) X(OLD, "old") X(ROWS, "rows") X(DP4A, "dp4a")
#define KV_GEMV_VARIANTS(X) X(DEFAULT, "default") KV_GEMV_PACKED(X)

#define KV_GEMV_ENUM_(e, s) KV_GEMV_##e,
typedef enum { KV_GEMV_VARIANTS(KV_GEMV_ENUM_) KV_GEMV_COUNT } kv_gemv_variant;
#undef KV_GEMV_ENUM_

/* The names space-separated, as string literals for option tables' help:
 * " default old rows dp4a" and " old rows dp4a". */
#define KV_GEMV_HELP_(e, s) " " s
#define KV_GEMV_NAMES_HELP KV_GEMV_VARIANTS(KV_GEMV_HELP_)
#define KV_GEMV_PACKED_HELP KV_GEMV_PACKED(KV_GEMV_HELP_)

#ifndef __cplusplus /* the kernels (nvcc, C++) take only the numbers */
#include <stdbool.h>

#include "common/kv_status.h"

/* "default", "old", "rows", "dp4a"; NULL for another number. */
const char *kv_gemv_variant_name(int v);
/* The name's number into *out; with packed_only, "default" is refused too.
 * Anything else is KV_E_USAGE ("'x' is not old, rows or dp4a") and leaves
 * *out alone. */
kv_status kv_gemv_variant_parse(const char *s, bool packed_only, int *out);
#endif

#endif
