#!/bin/sh
# Session 9's third device call, on main with helpers Q9 (query-aware
# scoring on the GPU) and D9 (GPU-side duplicates) merged and the cached
# rows' upload a layer ahead of the compute: every GPU/CUDA test
# (lead-9.sh's t step), compute-sanitizer memcheck and racecheck of the
# scoring kernel's test and memcheck of test_gpu_prefix (the two-pair
# upload), then lead-9w.sh (widened niah4k TTFT and accuracy, synthetic
# 8B at 32k).  From the repository root:  OUT=DIR sh tools/device/lead-9c.sh DIR
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
. tools/device/common.sh
unpack_once
STEPS=t BUDGET=${TBUDGET:-200} OUT="$OUT" sh tools/device/lead-9.sh "$D"
for tool in memcheck racecheck; do sanitize $tool small test_gpu_qaware qaware; done
sanitize memcheck ahead test_gpu_prefix prefix
tar czf "$OUT/lead9.tgz" -C "$OUT/logs" . 2>/dev/null
STEPS=ws BUDGET=${WBUDGET:-300} sh tools/device/lead-9w.sh "$D"
