#!/bin/sh
# Run on the GPU machine (device `run` tool) from the repository root:
#   sh tools/device/run-kernels.sh [all|tests|bench]
# Builds kvtools there (headers and .so of cJSON/zstd carried in build-devrun/,
# libcjson.so.1 also in .devlib/), falls back to binaries built here and
# carried in build-devrun/bin/, runs the CUDA unit tests plainly and under
# compute-sanitizer (memcheck on all, racecheck on the attention kernels),
# then kv-bench attn/pack and tools/device/sdpa.py.  Logs go to $OUT.
set -u
what=${1:-all}
OUT=${OUT:-/tmp/kv-out}
mkdir -p "$OUT"
R=$PWD
export PATH="$PATH:/usr/local/cuda/bin"
export CPATH="$R/build-devrun/include" LIBRARY_PATH="$R/build-devrun/lib"
export LD_LIBRARY_PATH="$R/build-devrun/lib:$R/.devlib:${LD_LIBRARY_PATH:-}"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

# At most 8 files come back: summary.txt variants.txt tests.tap sanitizer.log
# attn.json pack.json sdpa.json stderr.log (the device build's log goes to
# stderr.log)
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv;
  which nvcc && nvcc --version | tail -1; } 2>&1 | tee -a "$OUT/summary.txt"
E="$OUT/stderr.log"

# Build here in the background (proves the tree builds on the device); the
# runs below use the binaries built on the development machine and carried in
# build-devrun/bin/ unless BUILT=1, which waits for this build and uses it.
make B=build-gpu BINDIR=bin-gpu -j12 -k bin-gpu/kv-bench build-gpu/unit/test_cuda_kernels \
    build-gpu/unit/test_attn > /tmp/kv-build.log 2>&1 &
mk=$!
if [ "${BUILT:-0}" = 1 ]; then
    wait $mk; log "device build rc=$?"; B=build-gpu/unit BIN=bin-gpu
else
    B=build-devrun/bin BIN=build-devrun/bin
fi

if [ "$what" != bench ]; then
    log "unit tests"
    T="$OUT/tests.tap"
    timeout 120 $B/test_attn > "$T" 2>&1; log "test_attn rc=$?"
    timeout 150 $B/test_cuda_kernels >> "$T" 2>&1; log "test_cuda_kernels rc=$?"
    grep -v '^ok' "$T" | head -40
    log "$(grep -c '^ok' "$T") ok, $(grep -c '^not ok' "$T") not ok"
    log "compute-sanitizer memcheck"
    timeout 200 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
        $B/test_cuda_kernels > "$OUT/sanitizer.log" 2>&1; log "memcheck rc=$?"
    tail -n 4 "$OUT/sanitizer.log"
    log "compute-sanitizer racecheck (attention tests)"
    KV_TEST_FILTER=on_real_data timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 \
        $B/test_cuda_kernels >> "$OUT/sanitizer.log" 2>&1; log "racecheck rc=$?"
    tail -n 4 "$OUT/sanitizer.log"
fi
if [ "$what" != tests ]; then
    log "kv-bench attn"
    timeout 150 $BIN/kv-bench attn --check --json > "$OUT/attn.json" 2>> "$E"
    log "attn rc=$?"
    log "variants at 128k (tuning knobs, see docs/bench/kernels.md)"
    for v in "KV_F16_PREFETCH=0" "KV_KIVI_MINB=1"; do
        echo "# $v" >> "$OUT/variants.txt"
        env $v timeout 60 $BIN/kv-bench attn --contexts 131072 --json >> "$OUT/variants.txt" 2>> "$E"
    done
    python3 - "$OUT/variants.txt" <<'PY' | tee -a "$OUT/summary.txt"
import json, re, sys
txt = open(sys.argv[1]).read()
for name, body in re.findall(r"# (\S+)\n(\{.*?\n\})", txt, re.S):
    c = json.loads(body)["contexts"][0]
    print(name, " ".join(f"{k} {c[k]['us']:.1f}us" for k in ("f16", "kivi1", "kivi2") if c[k]))
PY
    log "kv-bench pack"
    timeout 90 $BIN/kv-bench pack --json > "$OUT/pack.json" 2>> "$E"; log "pack rc=$?"
    log "sdpa"
    timeout 100 python3 tools/device/sdpa.py > "$OUT/sdpa.json" 2>> "$E"; log "sdpa rc=$?"
    python3 tools/device/summary.py "$OUT" | tee -a "$OUT/summary.txt"
fi
if [ "${BUILT:-0}" != 1 ]; then
    wait $mk; log "device build (make -k, background) rc=$?"
    cat /tmp/kv-build.log >> "$E"
fi
