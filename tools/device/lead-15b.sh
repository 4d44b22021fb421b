#!/bin/sh
# Session 15, issue 11, second call: the padded last chunk's products
# (KV_GPU_PREFILL_PAD) and kv-bench prefix's warm-up (kv_gpu_engine_warm).
# First TESTS (the prefill's and the engine's), then compute-sanitizer
# memcheck and initcheck on the padded tests (SANITIZE=0 skips), then the
# widened niah4k on SEEDS for MODES (default full,host,disk,disk-query),
# warmed (EXTRA=--no-warm for the former path), then the synthetic 8B at
# 32k when the call's time allows (SYNTH_BY seconds in).
# From the repository root:  OUT=DIR sh tools/device/lead-15b.sh DIR
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
STEPS=x
. tools/device/common.sh
call_begin
unit_tests "${TESTS:-test_cuda_prefill test_gpu_prefix test_gpu_engine test_gpu_engine_data test_gpu_qaware test_gpu_batch}"
if [ "${SANITIZE:-1}" = 1 ]; then
    for tool in memcheck initcheck; do
        KV_TEST_FILTER=layer_in_chunks timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 \
            "$D/test_cuda_prefill" > "$L/san-$tool-prefill.txt" 2>&1
        log "compute-sanitizer $tool test_cuda_prefill (layer in chunks) rc=$?"
        KV_TEST_FILTER=padded timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 \
            "$D/test_gpu_prefix" > "$L/san-$tool-prefix.txt" 2>&1
        log "compute-sanitizer $tool test_gpu_prefix (padded) rc=$?"
        grep -E "ERROR SUMMARY|^not ok|^ok" "$L/san-$tool-prefill.txt" "$L/san-$tool-prefix.txt" | head -12 >> "$OUT/summary.txt"
    done
fi
[ -n "${SEEDS-x}" ] && SEEDS=${SEEDS:-1 2 3 4 5 6} MODES=${MODES:-full,host,disk,disk-query} TAG=${TAG:-s15} STEPS=w \
    BUDGET=${WBUDGET:-300} EXTRA="${EXTRA:-}" sh tools/device/lead-9w.sh "$D"
[ $(( $(date +%s) - T0 )) -le ${SYNTH_BY:-480} ] && STEPS=s BUDGET=100 TAG=synth sh tools/device/lead-9w.sh "$D"
tar czf "$OUT/lead15b.tgz" -C "$L" . 2>/dev/null
log "lead-15b end, $(( $(date +%s) - T0 )) s"
