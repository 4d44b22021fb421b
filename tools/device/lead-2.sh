#!/bin/sh
# Lead's device call 2 (2026-12-01, after merging helpers D and F2): every
# GPU unit test, F2's checks (tools/device/f2-check.sh: the GPU dump, the
# sparse prefill chunk copies, dsq's near-ties), compute-sanitizer memcheck
# of D's NaN/inf sweep and the selection NaN test.  From the repository root:
#   sh tools/device/lead-2.sh build-dev     (build-dev from tools/device/pack.sh)
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
mkdir -p "$OUT"
sh tools/device/unpack.sh "$D" || exit 66
. tools/device/common.sh
for t in test_cuda_kernels test_cuda_prefill; do
    timeout 120 "$D/$t" > "$OUT/$t.tap" 2>&1
    log "$t rc=$? $(grep -c '^ok' "$OUT/$t.tap") ok, $(grep -c '^not ok' "$OUT/$t.tap") not ok"
    grep '^not ok' "$OUT/$t.tap" | tee -a "$OUT/summary.txt"
done
OUT="$OUT" STEPS=${STEPS:-ekmp} sh tools/device/f2-check.sh "$D"
engine_tests env KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=nonfinite,selection_ranks,near_ties timeout 200 compute-sanitizer \
    --tool memcheck --error-exitcode 9 > "$OUT/memcheck-nan.log" 2>&1
log "memcheck (NaN sweep, selection NaN ranks, dsq near-ties; short) rc=$?"
grep -E '^not ok|^ok|ERROR SUMMARY' "$OUT/memcheck-nan.log" | tail -n 8 | tee -a "$OUT/summary.txt"
log "end"
