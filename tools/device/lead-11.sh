#!/bin/sh
# Session 11, issue 11: query-aware loading with the session's scoring
# (a token's largest attention from any layer's KV head, carried to the 8
# tokens after it; sketches of half of head_dim) on the H200.  First the
# widened niah4k (Llama-3.1-8B's shape, niah4k's logits) on SEEDS (default
# 1-12: 7 scored requests each) for full, host and disk-query, then
# test_gpu_qaware (the max combination is new in the kernel) plain and
# under memcheck and racecheck, then the synthetic 8B at 32k for the speed.
# From the repository root:  OUT=DIR sh tools/device/lead-11.sh DIR
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
STEPS=x
. tools/device/common.sh
L="$OUT/logs"
mkdir -p "$L"
unpack_once
T0=$(date +%s)
SEEDS=${SEEDS:-1 2 3 4 5 6 7 8 9 10 11 12} MODES=${MODES:-full,host,disk-query} TAG=new STEPS=w \
    BUDGET=${WBUDGET:-330} sh tools/device/lead-9w.sh "$D"
for t in test_gpu_qaware; do
    timeout 90 "$D/$t" > "$L/$t.tap" 2>&1
    log "$t rc=$?"
    tap "$t" "$L/$t.tap" 16
done
sanitize memcheck small test_gpu_qaware qaware 60
sanitize racecheck small test_gpu_qaware qaware 60
[ $(( $(date +%s) - T0 )) -le 440 ] && STEPS=s BUDGET=100 TAG=synth sh tools/device/lead-9w.sh "$D"
tar czf "$OUT/lead11.tgz" -C "$L" . 2>/dev/null
log "lead-11 end, $(( $(date +%s) - T0 )) s"
