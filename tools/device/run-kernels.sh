#!/bin/sh
# Run on the GPU machine (device `run` tool) from the repository root:
#   sh tools/device/run-kernels.sh [all|final|quick|tests|bench]
# (final: all but kv-bench pack and sdpa.py; quick: final without sanitizers)
# Uses binaries built on the development machine and carried in
# $RUNDIR/bin (default build-devrun; headers and .so of cJSON/zstd in
# $RUNDIR/include and lib, libcjson.so.1 also in .devlib/), or with BUILT=1
# builds kvtools there first.  Runs the CUDA unit tests plainly and (all,
# tests) under compute-sanitizer (memcheck on all, racecheck on the
# real-data tests), then kv-bench attn (+ the tuning variants at 128k,
# VARIANTS: kv-bench attn options, one per variant, "default" for none),
# kv-bench pack and tools/device/sdpa.py (all, bench), and a SASS opcode
# count of the packed attention kernels (all, quick).  Logs go to $OUT.
# At most 8 files come back: summary.txt variants.txt tests.tap sanitizer.log
# attn.json pack.json sdpa.json stderr.log (+ SASS counts in summary.txt).
set -u
what=${1:-all}
OUT=${OUT:-/tmp/kv-out}
RUNDIR=${RUNDIR:-build-devrun}
mkdir -p "$OUT"
R=$PWD
export PATH="$PATH:/usr/local/cuda/bin"
export CPATH="$R/$RUNDIR/include" LIBRARY_PATH="$R/$RUNDIR/lib"
export LD_LIBRARY_PATH="$R/$RUNDIR/lib:$R/.devlib:${LD_LIBRARY_PATH:-}"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
E="$OUT/stderr.log"

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv;
  which nvcc && nvcc --version | tail -1; } 2>&1 | tee -a "$OUT/summary.txt"

if [ "${BUILT:-0}" = 1 ]; then
    make B=build-gpu BINDIR=bin-gpu -j12 -k bin-gpu/kv-bench build-gpu/unit/test_cuda_kernels \
        build-gpu/unit/test_attn > /tmp/kv-build.log 2>&1
    log "device build rc=$?"; cat /tmp/kv-build.log >> "$E"
    B=build-gpu/unit BIN=bin-gpu
else
    B=$RUNDIR/bin BIN=$RUNDIR/bin
fi

if [ "$what" != bench ]; then
    log "unit tests"
    T="$OUT/tests.tap"
    timeout 120 $B/test_attn > "$T" 2>&1; log "test_attn rc=$?"
    timeout 150 $B/test_cuda_kernels >> "$T" 2>&1; log "test_cuda_kernels rc=$?"
    # extra passes with a packed-kernel variant (TEST_ENVS="KV_KIVI2_VAR=7 ...",
    # which test_cuda_kernels turns into kv_cuda_tuning)
    for e in ${TEST_ENVS:-}; do
        echo "# --- $e" >> "$T"
        env $e timeout 150 $B/test_cuda_kernels >> "$T" 2>&1; log "test_cuda_kernels ($e) rc=$?"
    done
    grep -v '^ok' "$T" | grep -v '^#' | head -30
    grep '^# packed\|^# fp16\|^# dsq' "$T" | head -30
    log "$(grep -c '^ok' "$T") ok, $(grep -c '^not ok' "$T") not ok"
fi
if [ "$what" = all ] || [ "$what" = tests ] || [ "$what" = final ]; then
    # SAN_ENVS: memcheck of the whole binary once per setting, racecheck of
    # the real-data tests likewise (KV_NONE=0 stands for no setting)
    for e in ${SAN_ENVS:-KV_NONE=0}; do
        log "compute-sanitizer memcheck ($e)"
        echo "### memcheck $e" >> "$OUT/sanitizer.log"
        env $e timeout ${SAN_TIMEOUT:-200} compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
            $B/test_cuda_kernels >> "$OUT/sanitizer.log" 2>&1; log "memcheck ($e) rc=$?"
        tail -n 3 "$OUT/sanitizer.log"
        log "compute-sanitizer racecheck, real-data tests ($e)"
        echo "### racecheck $e" >> "$OUT/sanitizer.log"
        env $e KV_TEST_FILTER=on_real_data timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool racecheck \
            --error-exitcode 9 $B/test_cuda_kernels >> "$OUT/sanitizer.log" 2>&1
        log "racecheck ($e) rc=$?"
        tail -n 3 "$OUT/sanitizer.log"
    done
fi
if [ "$what" != tests ]; then
    log "kv-bench attn"
    timeout 150 $BIN/kv-bench attn --check --json > "$OUT/attn.json" 2>> "$E"
    log "attn rc=$?"
    log "variants at 128k (tuning knobs, see docs/BENCHMARKS.md (Kernels))"
    for v in ${VARIANTS:-default --kivi2-variant=8 --kivi2-variant=16 --kivi2-variant=32}; do
        echo "# $v" >> "$OUT/variants.txt"
        [ "$v" = default ] && v=
        timeout 60 $BIN/kv-bench attn --contexts 131072 --json $v >> "$OUT/variants.txt" 2>> "$E"
    done
    python3 - "$OUT/variants.txt" <<'PY' | tee -a "$OUT/summary.txt"
import json, re, sys
txt = open(sys.argv[1]).read()
for name, body in re.findall(r"# (\S+)\n(\{.*?\n\})", txt, re.S):
    c = json.loads(body)["contexts"][0]
    print(name, " ".join(f"{k} {c[k]['us']:.1f}us" for k in ("f16", "kivi1", "kivi2") if c[k]))
PY
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    log "kv-bench pack"
    timeout 90 $BIN/kv-bench pack --json > "$OUT/pack.json" 2>> "$E"; log "pack rc=$?"
    log "sdpa"
    timeout 100 python3 tools/device/sdpa.py > "$OUT/sdpa.json" 2>> "$E"; log "sdpa rc=$?"
fi
if [ "$what" != tests ]; then
    python3 tools/device/summary.py "$OUT" | tee -a "$OUT/summary.txt"
fi
if [ "$what" = all ] || [ "$what" = quick ] || [ "$what" = final ]; then
    log "SASS opcodes of the packed attention kernels (whole kernel, static count)"
    cuobjdump --dump-sass $BIN/kv-bench 2>/dev/null | python3 tools/device/sass_count.py attn_kivi \
        | tee -a "$OUT/summary.txt"
fi
