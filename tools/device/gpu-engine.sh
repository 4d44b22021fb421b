#!/bin/sh
# Run on the GPU machine (device `run` tool) from the repository root:
#   sh tools/device/gpu-engine.sh [all|tests|sanitize|bench|quick]
# (quick: tests and bench, no sanitizer)
# The GPU engine's checks and benchmark (issue 5).  Uses binaries built on the
# development machine and carried in $RUNDIR/bin/ (default build-Fdev; with the
# cJSON and zstd headers and libraries in $RUNDIR/), while building the same
# targets on the device in the background to prove the tree builds there
# (NOBUILD=1: no device build); if a carried binary cannot start, waits for
# that build and uses it.  Then: the GPU unit tests (test_gpu_engine, and
# test_cuda_kernels when carried), the same under compute-sanitizer memcheck
# (short sizes), and `kv-bench decode` ($DECODE_ARGS).
# Logs go to $OUT (at most 8 files come back): summary.txt build.log
# tests.tap sanitizer.log decode.json decode.err
set -u
what=${1:-all}
OUT=${OUT:-/tmp/kv-out}
mkdir -p "$OUT"
R=$PWD
export PATH="$PATH:/usr/local/cuda/bin"
RUNDIR=${RUNDIR:-build-Fdev}
export CPATH="$R/$RUNDIR/include" LIBRARY_PATH="$R/$RUNDIR/lib"
export LD_LIBRARY_PATH="$R/$RUNDIR/lib:$R/.devlib:${LD_LIBRARY_PATH:-}"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv;
  which nvcc && nvcc --version | tail -1; nproc; free -g | head -2; } 2>&1 | tee -a "$OUT/summary.txt"

if [ "${NOBUILD:-0}" = 1 ]; then # NOBUILD=1: carried binaries only
    true & mk=$!
else
    make B=build-gpu BINDIR=bin-gpu -j12 bin-gpu/kv-bench build-gpu/unit/test_gpu_engine build-gpu/unit/test_gpu_engine_kernels \
        build-gpu/unit/test_gpu_engine_data > "$OUT/build.log" 2>&1 &
    mk=$!
fi
built=0
B=$RUNDIR/bin
if ! $B/kv-bench --version >/dev/null 2>&1; then
    log "carried binaries do not start here: waiting for the device build"
    wait $mk; log "device build rc=$?"; built=1
    B=build-gpu/unit; cp bin-gpu/kv-bench build-gpu/unit/ 2>/dev/null
fi

if [ "$what" != bench ]; then
    for t in test_gpu_engine_kernels test_gpu_engine test_gpu_engine_data; do
        log "unit test: $t"
        timeout 240 $B/$t >> "$OUT/tests.tap" 2>&1; log "$t rc=$?"
    done
    if [ -x $B/test_cuda_kernels ]; then
        log "unit test: test_cuda_kernels"
        timeout 150 $B/test_cuda_kernels >> "$OUT/tests.tap" 2>&1; log "test_cuda_kernels rc=$?"
    fi
    grep -v '^ok' "$OUT/tests.tap" | head -40
    log "$(grep -c '^ok' "$OUT/tests.tap") ok, $(grep -c '^not ok' "$OUT/tests.tap") not ok"
fi
if [ "$what" = all ] || [ "$what" = sanitize ]; then
    log "compute-sanitizer memcheck (short sizes)"
    for t in test_gpu_engine_kernels test_gpu_engine test_gpu_engine_data; do
        KV_GPU_TEST_SHORT=1 timeout ${SAN_TIMEOUT:-300} compute-sanitizer --tool memcheck --error-exitcode 9 \
            $B/$t >> "$OUT/sanitizer.log" 2>&1; log "memcheck $t rc=$?"
    done
    if [ -x $B/test_cuda_kernels ]; then
        timeout ${SAN_TIMEOUT:-300} compute-sanitizer --tool memcheck --error-exitcode 9 \
            $B/test_cuda_kernels >> "$OUT/sanitizer.log" 2>&1; log "memcheck (kernels) rc=$?"
    fi
    grep -E '^(ok|not ok)|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 40
fi
if [ $built = 0 ]; then # never time the benchmark beside a 12-job build
    wait $mk; log "device build (background) rc=$?"; tail -n 3 "$OUT/build.log"; built=1
fi
if [ "$what" != tests ] && [ "$what" != sanitize ]; then
    log "kv-bench decode"
    timeout ${DECODE_TIMEOUT:-420} $B/kv-bench decode --json ${DECODE_ARGS:-} > "$OUT/decode.json" 2> "$OUT/decode.err"
    log "decode rc=$?"
    tail -n 5 "$OUT/decode.err"
    python3 - "$OUT/decode.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no JSON:", e); sys.exit(0)
bw = d["bandwidth"]
print("bandwidth GB/s:", {k: round(v / 1e9, 2) for k, v in bw.items()})
print("selection kernels us:", d.get("select_kernels_us"))
for c in d["contexts"]:
    for p, r in c["policies"].items():
        if "error" in r:
            print(c["T"], p, "ERROR", r["error"]); continue
        print("%7d %-14s %8.3f ms  gpu %9.1f MB host %9.1f MB pcie %8.2f MB/tok %s" % (
            c["T"], p, r["ms_per_token"], r["gpu_kv_bytes"] / 1e6, r["host_kv_bytes"] / 1e6,
            r["pcie_bytes_per_token"] / 1e6,
            " ".join("%s=%s" % (k, r[k]) for k in ("ms_no_fetch", "pcie_hidden", "pcie_gbs_achieved", "bound_ms") if k in r)))
for k, v in d["targets"].items():
    print(k, v)
PY
fi
