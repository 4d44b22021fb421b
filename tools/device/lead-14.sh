#!/bin/sh
# Session 14, issue 11: the code after session 13's measured commit on the
# H200.  First TESTS (default: the engine's and the prefix tests, which the
# layer-ahead upload's new order never ran on), then h2d_probe (why the host
# tier's upload is sometimes slow: tools/device/h2d_probe.cu, built beside
# the binaries as DIR/h2d_probe), then the widened niah4k on SEEDS for
# full,host,disk,disk-query (prefill_phases_ms now has upload and
# upload_gbs), then the synthetic 8B at 32k.
# From the repository root:  OUT=DIR sh tools/device/lead-14.sh DIR
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
STEPS=x
. tools/device/common.sh
call_begin
unit_tests "${TESTS:-test_gpu_engine_kernels test_gpu_engine test_gpu_engine_data test_gpu_graph test_gpu_batch test_gpu_prefix test_gpu_qaware}"
if [ -x "$D/h2d_probe" ]; then
    timeout 60 "$D/h2d_probe" "$L" > "$L/h2d_probe.txt" 2>&1
    log "h2d_probe rc=$?"
    cat "$L/h2d_probe.txt" >> "$OUT/summary.txt"
fi
[ -n "${SEEDS-x}" ] && SEEDS=${SEEDS:-1 2 3 4 5 6} MODES=${MODES:-full,host,disk,disk-query} TAG=s14 STEPS=w \
    BUDGET=${WBUDGET:-300} sh tools/device/lead-9w.sh "$D"
[ $(( $(date +%s) - T0 )) -le ${SYNTH_BY:-480} ] && STEPS=s BUDGET=100 TAG=synth sh tools/device/lead-9w.sh "$D"
tar czf "$OUT/lead14.tgz" -C "$L" . 2>/dev/null
log "lead-14 end, $(( $(date +%s) - T0 )) s"
