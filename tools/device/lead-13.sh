#!/bin/sh
# Session 13, issue 11: disk rows read layer by layer beside the prefill
# (kv_tree_store_load_start; the prefill waits per layer in
# gl_put_prefix_rows).  First TESTS (default test_gpu_prefix
# test_gpu_qaware), the new test of rows arriving late under memcheck,
# then the widened niah4k (Llama-3.1-8B's shape, niah4k's logits) on SEEDS
# (default 1-10: 7 scored requests each) for MODES (default
# full,host,disk,disk-query), then, unless AB is 0, the same seeds
# (AB_SEEDS, default 1-4) with --rows-serial and again without, for the
# comparison in one call, then the synthetic 8B at 32k.
# From the repository root:  OUT=DIR sh tools/device/lead-13.sh DIR
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
for t in ${TESTS:-test_gpu_prefix test_gpu_qaware}; do
    timeout 150 "$D/$t" > "$L/$t.tap" 2>&1
    log "$t rc=$?"
    tap "$t" "$L/$t.tap" 16
done
[ "${SAN:-1}" = 1 ] && sanitize memcheck arriving test_gpu_prefix late 90
[ -n "${SEEDS:-x}" ] && SEEDS=${SEEDS:-1 2 3 4 5 6 7 8 9 10} MODES=${MODES:-full,host,disk,disk-query} TAG=new STEPS=w \
    BUDGET=${WBUDGET:-330} sh tools/device/lead-9w.sh "$D"
if [ "${AB:-1}" = 1 ]; then
    SEEDS=${AB_SEEDS:-1 2 3 4} MODES=full,disk,disk-query TAG=serial STEPS=w EXTRA=--rows-serial \
        BUDGET=${ABBUDGET:-120} sh tools/device/lead-9w.sh "$D"
    SEEDS=${AB_SEEDS:-1 2 3 4} MODES=full,disk,disk-query TAG=beside STEPS=w \
        BUDGET=${ABBUDGET:-120} sh tools/device/lead-9w.sh "$D"
fi
[ $(( $(date +%s) - T0 )) -le ${SYNTH_BY:-470} ] && STEPS=s BUDGET=100 TAG=synth sh tools/device/lead-9w.sh "$D"
tar czf "$OUT/lead13.tgz" -C "$L" . 2>/dev/null
log "lead-13 end, $(( $(date +%s) - T0 )) s"
