#!/bin/sh
# Helper G4's device step (issue 17, "Overlap for real"): the sparse step's
# variants on the GPU engine, one device call of about 200 s (timeouts
# 30 + 20 + 20 + 100 + 2 x 25 s; the lead runs `sh tools/device/unpack.sh DIR`
# first):
#   STEPS=emrdn sh tools/device/g4-check.sh DIR     (from the repository root)
# DIR holds the lead's pack (tools/device/pack.sh): kv-run, kv-bench,
# test_gpu_engine, lib/libcjson.so.1.
# STEPS (each under a timeout):
#   e  test_gpu_engine: the step variants against the serial path
#      (overlapped and wide top-K bit-equal, selection cache within rounding,
#      with hits and fewer host bytes, cache switched on mid-run), and the
#      resident/page kernels and niah4k resident tests beside them
#   m  compute-sanitizer memcheck of the variants test (short form)
#   r  compute-sanitizer racecheck of the same (shared-memory hazards of the
#      new plan kernel; stream order is checked by the bit-equality in e)
#   d  kv-bench decode --context prefill -c 32768,131072: full, offload,
#      hybrid-resident and hybrid-pages, each hybrid after one prefill in
#      the variants base, wide, cache, wide+cache, serial: ms/token, GPU KV,
#      PCIe bytes, pcie_hidden, breakdown (selection, fetch, exposed wait),
#      cache hit rate
#   n  kv-bench ruler --device cuda on the niah4k dev tasks (RLIMIT=20 per
#      length): full and the default hybrid (sparse frac=0.03, resident)
#      with --gpu-step base, then the hybrid with --gpu-step wide+cache
#   c  (not in the default STEPS) the same niah4k tasks on the CPU, for the
#      GPU-vs-CPU comparison (16 threads)
# Logs in $OUT: summary.txt engine.tap memcheck.log racecheck.log decode.json
# ruler-base.json ruler-cache.json (ruler-cpu.json)
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-emrdn}
. tools/device/common.sh
S=s=8,w=32,frac=0.03
gpu_info
if has e; then
    engine_tests env KV_TEST_FILTER=step_variants,resident_and_page,niah4k_resident timeout 30 \
        > "$OUT/engine.tap" 2>&1; log "test_gpu_engine* (filtered) rc=$?"
    log "$(grep -c '^ok' "$OUT/engine.tap") ok (skips included), $(grep -c '^not ok' "$OUT/engine.tap") not ok"
    grep -E '^not ok|^# (step|resident|page|niah4k)|^#   ' "$OUT/engine.tap" | head -40 | tee -a "$OUT/summary.txt"
fi
for tool in memcheck racecheck; do
    case $tool in memcheck) has m || continue;; racecheck) has r || continue;; esac
    engine_tests env KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=step_variants timeout ${STIME:-20} compute-sanitizer \
        --tool $tool --error-exitcode 9 > "$OUT/$tool.log" 2>&1
    log "$tool (step variants, short) rc=$?"
    grep -E '^not ok|ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -n 4 | tee -a "$OUT/summary.txt"
done
if has d; then
    log "kv-bench decode --context prefill, variants"
    timeout ${DTIME:-100} "$D/kv-bench" decode --json --context prefill -c "${DCTX:-32768,131072}" \
        --policies "${DPOL:-full,offload,hybrid-resident,hybrid-pages}" \
        --variants "${DVAR:-base,wide,cache,wide+cache,serial}" \
        -n 8 --warmup 2 --offload-tokens 3 --nofetch-tokens 8 > "$OUT/decode.json" 2>> "$OUT/summary.txt"
    log "rc=$?"
    python3 - "$OUT/decode.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
for c in d["contexts"]:
    P = c["policies"]
    f = P.get("full", {}).get("ms_per_token"); o = P.get("offload", {}).get("ms_per_token")
    fkv = P.get("full", {}).get("gpu_kv_bytes")
    for p, r in P.items():
        if "error" in r: print("%7d %-28s error: %s" % (c["T"], p, r["error"])); continue
        ms = r["ms_per_token"]; b = r.get("breakdown_ms", {})
        print("%7d %-28s %8.3f ms  x full %s  offload/x %s  GPU KV %.4f  PCIe MB %.1f  hidden %s  "
              "sel %s fetch %s wait %s  hits %s" % (
            c["T"], p, ms, None if not f else round(ms / f, 3), None if not o else round(o / ms, 1),
            r["gpu_kv_bytes"] / fkv if fkv else float("nan"), r["pcie_bytes_per_token"] / 1e6,
            r.get("pcie_hidden"), b.get("selection"), b.get("fetch"), b.get("exposed_wait"),
            r.get("cache_hit_rate")))
for k, v in d.get("targets", {}).items():
    if k.startswith("resident_") and v: print("target %-40s %s (target %s) met %s" % (k, v["value"], v["target"], v["met"]))
PY
fi
ruler() { ruler_dev "$@"; } # name, device, extra options... (tools/device/common.sh)
if has n; then
    log "kv-bench ruler --device cuda (niah4k dev tasks, 1k/2k/4k)"
    ruler base cuda -P full -P sparse:$S,select=resident -P sparse:$S,select=pages
    ruler cache cuda --gpu-step wide+cache -P sparse:$S,select=resident
fi
if has c; then
    log "kv-bench ruler on the CPU (same tasks)"
    ruler cpu cpu --threads 16 -P full -P sparse:$S,select=resident
fi
log "end"
