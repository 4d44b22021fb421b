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
[ -x "$D/kv-bench" ] || sh tools/device/unpack.sh "$D" > "$OUT/unpack.log" 2>&1
STEPS=t BUDGET=${TBUDGET:-200} OUT="$OUT" sh tools/device/lead-9.sh "$D"
for tool in memcheck racecheck; do
    KV_TEST_FILTER=small timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 "$D/test_gpu_qaware" \
        > "$OUT/logs/qaware-$tool.log" 2>&1
    log "test_gpu_qaware (small) under $tool rc=$?"
    grep -E '^not ok|ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/logs/qaware-$tool.log" | tail -n 4 | tee -a "$OUT/summary.txt"
done
KV_TEST_FILTER=ahead timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/test_gpu_prefix" \
    > "$OUT/logs/prefix-memcheck.log" 2>&1
log "test_gpu_prefix (rows ahead) under memcheck rc=$?"
grep -E '^not ok|^ok|ERROR SUMMARY' "$OUT/logs/prefix-memcheck.log" | tail -n 4 | tee -a "$OUT/summary.txt"
tar czf "$OUT/lead9.tgz" -C "$OUT/logs" . 2>/dev/null
STEPS=ws BUDGET=${WBUDGET:-300} sh tools/device/lead-9w.sh "$D"
