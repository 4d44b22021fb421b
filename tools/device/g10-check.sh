#!/bin/sh
# Helper G10's device round (issue 10, graph-captured decode), under 100 s:
#   OUT=DIR sh tools/device/g10-check.sh build-dev-G10     (from the repository root,
#   after sh tools/device/unpack.sh build-dev-G10; tools/device/pack.sh made the folder)
# Steps, each under a timeout, in this order (STEPS picks some):
#   t  test_gpu_graph: every placement with graphs on equals graphs off (ids, logits),
#      and eng_copy_2d equals cudaMemcpy2D
#   m  compute-sanitizer memcheck of test_gpu_graph (short form, small models)
#   d  kv-bench decode --graph both at 32k and 128k for full and quant: each placement
#      timed captured and kernel by kernel from the same context
#   p  the same with --pdl 0: does PDL still pay inside graphs?
#   r  kv-run --synthetic llama-3.1-8b --device cuda, a 4096-token random prompt, 32
#      steps through kv_gpu_engine_step (logits to the host each step), --graph auto/on/off
#   h  kv-bench decode --graph both for the hybrid (its 128k context pins ~16 GB)
#   e  test_gpu_engine (the engine's own device tests, now with graphs on by default)
# Rounds (the lead's numbering): 1 ran t d(full,quant) d(hybrid) m; 2 the default STEPS; 4 STEPS=tmdre.
# Logs in $OUT: summary.txt graph.tap memcheck.log decode-{full-quant,pdl0,hybrid}.json
# run-{on,off}.json engine.tap
set -u
D=${1:-build-dev-G10}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-tmdprhe}
. tools/device/common.sh
gpu_info
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
if has m; then
    KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=copy,stories,niah timeout ${MTIME:-20} compute-sanitizer \
        --tool memcheck --error-exitcode 9 "$D/test_gpu_graph" > "$OUT/memcheck.log" 2>&1
    log "memcheck (short; copy kernel, stories260K, niah4k) rc=$?"
    grep -E '^not ok|^ok|ERROR SUMMARY' "$OUT/memcheck.log" | tail -n 6 | tee -a "$OUT/summary.txt"
fi
bench() { # name timeout args...
    n=$1; t=$2; shift 2
    log "kv-bench decode $*"
    timeout "$t" "$D/kv-bench" decode --json -c "${DCTX:-32768,131072}" -n ${DN:-32} --warmup 4 \
        --nofetch-tokens 0 "$@" > "$OUT/decode-$n.json" 2>> "$OUT/summary.txt"
    log "rc=$?"
    summarize "$OUT/decode-$n.json"
}
has d && bench full-quant 25 --graph both --policies full,quant
has p && bench pdl0 20 --graph both --pdl 0 --policies full,quant
if has r; then
    for g in auto on off; do
        timeout 25 "$D/kv-run" --synthetic llama-3.1-8b --device cuda --random-prompt 4096 -c 8192 -n 32 \
            --graph $g --report "$OUT/run-$g.json" > /dev/null 2>> "$OUT/summary.txt"
        log "kv-run --graph $g rc=$?"
        python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print('kv-run step() --graph', sys.argv[2], j['ms_per_token_median'], 'ms median,', j['ms_per_token_p90'], 'p90;', j['graph'], j['graph_steps'])" \
            "$OUT/run-$g.json" $g 2>&1 | tee -a "$OUT/summary.txt"
    done
fi
has h && bench hybrid 35 --graph both --policies hybrid
if has e; then
    engine_tests timeout ${ETIME:-30} stdbuf -oL > "$OUT/engine.tap" 2>&1; log "test_gpu_engine* rc=$?"
    log "$(grep -c '^ok' "$OUT/engine.tap") ok, $(grep -c '^not ok' "$OUT/engine.tap") not ok"
    grep -E '^not ok|check failed' "$OUT/engine.tap" | head -20 | tee -a "$OUT/summary.txt"
fi
log "done"
