#!/bin/sh
# Helper G10's device round (issue 10, graph-captured decode), about 100 s:
#   OUT=DIR sh tools/device/g10-check.sh build-dev-G10     (from the repository root,
#   after sh tools/device/unpack.sh build-dev-G10; tools/device/pack.sh made the folder)
# Steps, each under a timeout:
#   t  test_gpu_graph: every placement with graphs on equals graphs off (ids, logits)
#   d  kv-bench decode --graph both at 32k and 128k for full, quant, hybrid: each
#      placement timed captured and kernel by kernel from the same context
#   m  compute-sanitizer memcheck of test_gpu_graph (short form, small models)
# Logs in $OUT: summary.txt graph.tap decode-full-quant.json decode-hybrid.json memcheck.log
set -u
D=${1:-build-dev-G10}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-tdm}
mkdir -p "$OUT"
export PATH="$PATH:/usr/local/cuda/bin"
export LD_LIBRARY_PATH="$PWD/$D/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/summary.txt"; }
has() { case "$STEPS" in *$1*) return 0;; esac; return 1; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } 2>&1 | tee -a "$OUT/summary.txt"
if has t; then
    timeout ${TTIME:-20} "$D/test_gpu_graph" > "$OUT/graph.tap" 2>&1; log "test_gpu_graph rc=$?"
    log "$(grep -c '^ok' "$OUT/graph.tap") ok, $(grep -c '^not ok' "$OUT/graph.tap") not ok"
    grep -E '^not ok|^#' "$OUT/graph.tap" | head -40 | tee -a "$OUT/summary.txt"
fi
summarize() {
    python3 - "$1" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
d = json.load(open(sys.argv[1]))
print(d["device"], d["date"])
for c in d["contexts"]:
    for k, v in c["policies"].items():
        if "error" in v:
            print(c["T"], k, "error", v["error"]); continue
        ng = v.get("no_graph", {})
        print("%7d %-8s graph %.4f ms  plain %s ms  speedup %s  bound %s over %s  [%s] steps %s" % (
            c["T"], k, v["ms_per_token"], ng.get("ms_per_token"), v.get("graph_speedup"),
            v.get("bound_ms"), v.get("over_bound"), v.get("graph"), v.get("graph_steps")))
for k, v in d["targets"].items():
    if v and "full_over" in k: print("target", k, v)
PY
}
# d: full and quant, then the hybrid (its 128k context pins ~16 GB of host memory per run)
if has d; then
    for part in "full,quant:${DTIME:-30}" "hybrid:${HTIME:-25}"; do
        pol=${part%%:*}; t=${part#*:}; f=$OUT/decode-$(echo "$pol" | tr , -).json
        log "kv-bench decode --graph both --policies $pol"
        timeout "$t" "$D/kv-bench" decode --json --graph both -c "${DCTX:-32768,131072}" \
            --policies "$pol" -n ${DN:-32} --warmup 4 --nofetch-tokens 0 > "$f" 2>> "$OUT/summary.txt"
        log "rc=$?"
        summarize "$f"
    done
fi
if has m; then
    KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=stories,niah timeout ${MTIME:-20} compute-sanitizer \
        --tool memcheck --error-exitcode 9 "$D/test_gpu_graph" > "$OUT/memcheck.log" 2>&1
    log "memcheck (short; stories260K, niah4k) rc=$?"
    grep -E '^not ok|^ok|ERROR SUMMARY' "$OUT/memcheck.log" | tail -n 6 | tee -a "$OUT/summary.txt"
fi
log "done"
