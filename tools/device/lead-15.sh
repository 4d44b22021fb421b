#!/bin/sh
# Session 15, issue 11: is the host tier's bimodal prefill at 4k the first
# call of a cuBLAS product at a row count new to the process?  gemm_first
# (tools/device/gemm_first.cu, built beside the binaries as DIR/gemm_first)
# times each of the 8B's four products' first and later calls at the
# reuse modes' row counts (440-500) and full's (3900-3960), with
# CUDA_MODULE_LOADING unset (lazy) and =EAGER; then the widened niah4k on
# SEEDS (default 1 2) for MODES (default full,host) both ways.
# From the repository root:  OUT=DIR sh tools/device/lead-15.sh DIR
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
STEPS=x
. tools/device/common.sh
call_begin
[ -n "${TESTS:-}" ] && unit_tests "$TESTS"
if [ -x "$D/gemm_first" ]; then
    for ml in lazy EAGER; do
        if [ $ml = EAGER ]; then export CUDA_MODULE_LOADING=EAGER; else unset CUDA_MODULE_LOADING; fi
        timeout 60 "$D/gemm_first" 440 500 > "$L/gemm-$ml-440.txt" 2>&1
        log "gemm_first $ml 440-500 rc=$?"
        timeout 60 "$D/gemm_first" 3900 3960 4 > "$L/gemm-$ml-3900.txt" 2>&1
        log "gemm_first $ml 3900-3960 rc=$?"
        grep '^#' "$L/gemm-$ml-440.txt" | grep -v 'rows [0-9]*:' >> "$OUT/summary.txt"
        grep '^# [0-9]* shapes' "$L/gemm-$ml-3900.txt" >> "$OUT/summary.txt"
    done
    unset CUDA_MODULE_LOADING
fi
for ml in ${LOADINGS:-lazy EAGER}; do
    if [ $ml = EAGER ]; then export CUDA_MODULE_LOADING=EAGER; else unset CUDA_MODULE_LOADING; fi
    SEEDS=${SEEDS:-1 2} MODES=${MODES:-full,host} TAG=$ml STEPS=w BUDGET=${WBUDGET:-220} \
        EXTRA="${EXTRA:-}" sh tools/device/lead-9w.sh "$D"
done
unset CUDA_MODULE_LOADING
tar czf "$OUT/lead15.tgz" -C "$L" . 2>/dev/null
log "lead-15 end, $(( $(date +%s) - T0 )) s"
