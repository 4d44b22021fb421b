#!/bin/sh
# Session 12, issue 11: query-aware loading with the store's frame buffers
# kept between reads, frames parsed in place (kvc_open_view), three-lane
# CRC-32C, and the key sketch's copy to the GPU issued by its read's thread
# while the probe runs (kv_qaware_gpu_stage).  First test_gpu_qaware and
# test_gpu_prefix, the scoring and staging tests under memcheck and
# racecheck, then the widened niah4k (Llama-3.1-8B's shape, niah4k's
# logits) on SEEDS (default 1-10: 7 scored requests each) for full, host
# and disk-query, then the synthetic 8B at 32k.
# From the repository root:  OUT=DIR sh tools/device/lead-12.sh DIR
# (DIR relative to the root: common.sh puts $PWD/DIR/lib on the library path)
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
STEPS=x
. tools/device/common.sh
L="$OUT/logs"
mkdir -p "$L"
unpack_once
T0=$(date +%s)
gpu_info
for t in ${TESTS:-test_gpu_qaware test_gpu_prefix}; do
    timeout 150 "$D/$t" > "$L/$t.tap" 2>&1
    log "$t rc=$?"
    tap "$t" "$L/$t.tap" 16
done
sanitize memcheck small test_gpu_qaware qaware 60
sanitize memcheck stage test_gpu_qaware stage 90
sanitize racecheck small test_gpu_qaware qaware 60
sanitize racecheck stage test_gpu_qaware stage 120
SEEDS=${SEEDS:-1 2 3 4 5 6 7 8 9 10} MODES=${MODES:-full,host,disk-query} TAG=new STEPS=w \
    BUDGET=${WBUDGET:-320} sh tools/device/lead-9w.sh "$D"
[ $(( $(date +%s) - T0 )) -le 470 ] && STEPS=s BUDGET=100 TAG=synth sh tools/device/lead-9w.sh "$D"
tar czf "$OUT/lead12.tgz" -C "$L" . 2>/dev/null
log "lead-12 end, $(( $(date +%s) - T0 )) s"
