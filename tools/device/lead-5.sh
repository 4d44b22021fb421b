#!/bin/sh
# Lead's device call 5 (2026-12-01), the last of the session: after the
# fixes to call 4 (kv-bench decode's context for --variants, the request
# generator's path, the packed GEMV default per type and shape, G3's merge):
#   G4's decode variants at 32k and 128k and a longer racecheck,
#   H1's kv-bench prefix on niah4k and on the synthetic 8B at 32k,
#   E4's packed engine tests and the 1B decode with the new default,
#   every GPU unit test once.
# From the repository root:  sh tools/device/lead-5.sh build-dev
set -u
D=${1:-build-dev}
FINAL=${OUT:-/tmp/kv-out}
OUT=${W:-/tmp/kv-lead5}
mkdir -p "$OUT" "$FINAL"
sh tools/device/unpack.sh "$D" || exit 66
. tools/device/common.sh
stage() { # name, steps, extra environment
    s=$1; st=$2; shift 2
    mkdir -p "$OUT/$s"
    echo "==== $s-check $st $(date -u +%H:%M:%S)" >> "$OUT/summary.txt"
    env OUT="$OUT/$s" STEPS="$st" "$@" sh tools/device/$s-check.sh "$D" > "$OUT/$s/stdout.txt" 2>&1
    cat "$OUT/$s/summary.txt" >> "$OUT/summary.txt" 2>/dev/null
    snap
}
for t in $ENGINE_TESTS test_cuda_kernels test_cuda_prefill test_gpu_prefix; do
    timeout 150 "$D/$t" > "$OUT/$t.tap" 2>&1
    echo "== $t rc=$? $(grep -c '^ok' "$OUT/$t.tap") ok, $(grep -c '^not ok' "$OUT/$t.tap") not ok" >> "$OUT/summary.txt"
    grep -A3 '^not ok' "$OUT/$t.tap" >> "$OUT/summary.txt"
done
snap
stage g4 rd STIME=90 DTIME=200
stage h ns
stage e4 s
echo "==== end $(date -u +%H:%M:%S)" >> "$OUT/summary.txt"
snap
