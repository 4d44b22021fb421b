#!/bin/sh
# Helper S17's device round (issue 17: select=resident's chain hidden behind
# the layer), about 150 s; run from the repository root as
#   OUT=DIR sh tools/device/s17-check.sh BINDIR      (BINDIR: tools/device/pack.sh's, unpacked)
# STEPS (each under a timeout, in this order), default tnmsd:
#   t  test_gpu_select (eng_topk_many and eng_resident_select against the CPU
#      references at several widths, the side kernels' time alone and beside
#      GEMVs and what they cost the GEMVs) and test_gpu_engine filtered to the
#      selection and resident tests and the step variants (classic, ahead2)
#   n  kv-bench ruler --device cuda, niah4k dev tasks (RLIMIT=20 per length):
#      full and the default hybrid (sparse frac=0.03, select=resident) in the
#      default step, then with --gpu-step RSTEP (chainall+gather1)
#   m  compute-sanitizer memcheck of test_gpu_select's short form and of the
#      engine's step variants (short), s racecheck of test_gpu_select's short form
#   d  kv-bench decode --json --context prefill at DCTX (131072): full, offload,
#      hybrid-resident in the variants DVAR
# Results in $OUT: summary.txt and the logs / JSON of each step.
set -u
D=${1:?usage: s17-check.sh BINDIR}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-tnmsd}
. tools/device/common.sh
S=s=8,w=32,frac=0.03
gpu_info
if has t; then
    timeout 40 "$D/test_gpu_select" > "$OUT/select.tap" 2>&1
    log "test_gpu_select rc=$? $(grep -c '^ok' "$OUT/select.tap") ok, $(grep -c '^not ok' "$OUT/select.tap") not ok"
    grep -E '^not ok|^#' "$OUT/select.tap" | head -30 | tee -a "$OUT/summary.txt"
    engine_tests env KV_TEST_FILTER=topk_selects,selection_ranks,selection_kernels,resident_and_page,niah4k_resident,step_variants,niah4k_sparse \
        timeout 40 > "$OUT/engine.tap" 2>&1
    log "test_gpu_engine (filtered) rc=$? $(grep -c '^ok' "$OUT/engine.tap") ok (skips included), $(grep -c '^not ok' "$OUT/engine.tap") not ok"
    grep -E '^not ok|^# (step|niah4k|resident)' "$OUT/engine.tap" | head -30 | tee -a "$OUT/summary.txt"
fi
ruler() { _r=$1; shift; ruler_dev "$_r" cuda "$@"; } # name, extra options... (tools/device/common.sh)
if has n; then
    log "kv-bench ruler --device cuda (niah4k dev tasks, 1k/2k/4k)"
    ruler base -P full -P sparse:$S,select=resident
    ruler step --gpu-step "${RSTEP:-chainall+gather1}" -P sparse:$S,select=resident
fi
for tool in memcheck racecheck; do
    case $tool in memcheck) has m || continue;; racecheck) has s || continue;; esac
    KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=topk_many,resident_select timeout ${STIME:-30} compute-sanitizer \
        --tool $tool --error-exitcode 9 "$D/test_gpu_select" 2>&1 | head -c 200000 > "$OUT/$tool.txt"
    log "$tool (test_gpu_select short) done"
    grep -E '^not ok|ERROR SUMMARY|RACECHECK SUMMARY|^ok' "$OUT/$tool.txt" | tail -n 6 | tee -a "$OUT/summary.txt"
done
if has m; then
    engine_tests env KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=step_variants timeout 30 compute-sanitizer --tool memcheck \
        --error-exitcode 9 2>&1 | head -c 200000 > "$OUT/memcheck-engine.txt"
    log "memcheck (test_gpu_engine step variants, short) done"
    grep -E '^not ok|ERROR SUMMARY|^# step' "$OUT/memcheck-engine.txt" | tail -n 14 | tee -a "$OUT/summary.txt"
fi
if has d; then
    log "kv-bench decode --context prefill"
    timeout ${DTIME:-75} "$D/kv-bench" decode --json --context prefill -c "${DCTX:-131072}" \
        --policies full,offload,hybrid-resident --variants "${DVAR:-base,chainall+gather1,chain32+gather1,chain8+gather1,chain16+gather2,classic,classic+gatherall,serial}" \
        -n 8 --warmup 2 --offload-tokens 2 --nofetch-tokens 8 > "$OUT/decode.json" 2>> "$OUT/summary.txt"
    log "rc=$?"
    python3 - "$OUT/decode.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
print("bandwidth", d.get("bandwidth"))
for c in d["contexts"]:
    P = c["policies"]
    f = P.get("full", {}).get("ms_per_token"); o = P.get("offload", {}).get("ms_per_token")
    fkv = P.get("full", {}).get("gpu_kv_bytes")
    for p, r in P.items():
        if "error" in r: print("%7d %-28s error: %s" % (c["T"], p, r["error"])); continue
        ms = r["ms_per_token"]; b = r.get("breakdown_ms", {})
        print("%7d %-28s %8.3f ms  x full %s  offload/x %s  GPU KV %.4f  PCIe MB %.1f  hidden %s  nofetch %s "
              "sel %s fetch %s wait %s lat %s" % (
            c["T"], p, ms, None if not f else round(ms / f, 3), None if not o else round(o / ms, 1),
            r["gpu_kv_bytes"] / fkv if fkv else float("nan"), r["pcie_bytes_per_token"] / 1e6,
            r.get("pcie_hidden"), r.get("ms_no_fetch"), b.get("selection"), b.get("fetch"),
            b.get("exposed_wait"), r.get("select_latency_ms")))
for k, v in d.get("targets", {}).items():
    if k.startswith("resident_") and v: print("target %-40s %s (target %s) met %s" % (k, v["value"], v["target"], v["met"]))
PY
fi
log "end"
