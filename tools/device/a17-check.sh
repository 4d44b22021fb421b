#!/bin/sh
# Helper A7's device round (issue 17, session 7: the resident hybrid's side
# work cheaper for the layer beside it; pcie_hidden against the step with
# only the gather off), at most 110 s; run from the repository root as
#   OUT=DIR sh tools/device/a17-check.sh BINDIR     (BINDIR: tools/device/pack.sh's, unpacked)
# STEPS (each under a timeout, in the order t d e r m s), default tedrms:
#   t  test_gpu_select: eng_topk_many and eng_resident_select against the CPU
#      references for every flag set (ENG_SEL_LATE, _NOPDL, _COLLECT), then
#      the side work's time alone, beside GEMVs, and what it costs them
#   e  test_gpu_engine filtered to step_variants and resident (the step
#      variants bit for bit against the serial path, late+collect and
#      nopdl+collect, late+direct included; the niah4k resident test against the CPU)
#   d  kv-bench decode --json --context prefill -c DCTX (131072): full and
#      hybrid-resident in the variants DVAR, -n 8 --warmup 2 --nofetch-tokens 8
#      (ms_no_fetch once, ms_no_gather per variant)
#   r  kv-bench ruler --device cuda, niah4k dev tasks (20 per length): full and
#      the default hybrid, then the hybrid with --gpu-step RSTEP, RSTEP2 (and
#      RSTEP3 if set): every2, every2+cache (the ids reused; the words apply
#      over the default late+collect)
#   m  compute-sanitizer memcheck, s racecheck, of test_gpu_select's short form
# Results in $OUT: summary.txt and a17.tgz (every log and JSON), refreshed
# after each step.
set -u
D=${1:?usage: a17-check.sh BINDIR}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-tedrms}
. tools/device/common.sh
S=s=8,w=32,frac=0.03
L="$OUT/logs"
mkdir -p "$L"
pack() { tar czf "$OUT/a17.tgz" -C "$L" . 2>/dev/null; }
gpu_info
if has t; then
    timeout 45 "$D/test_gpu_select" > "$L/select.tap" 2>&1
    log "test_gpu_select rc=$?"
    tap test_gpu_select "$L/select.tap" 60
    pack
fi
if has d; then
    log "kv-bench decode --context prefill"
    timeout ${DTIME:-70} "$D/kv-bench" decode --json --context prefill -c "${DCTX:-131072}" \
        --policies full,hybrid-resident \
        --variants "${DVAR:-base,early+hist,nopdl,ahead2,direct,chain24,chain48,every2,serial}" \
        -n 8 --warmup 2 --nofetch-tokens 8 > "$L/decode.json" 2>> "$L/decode.err"
    log "decode rc=$?"
    python3 - "$L/decode.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
print("bandwidth h2d %.4g" % d["bandwidth"]["h2d"])
for c in d["contexts"]:
    P = c["policies"]
    f = P.get("full", {}).get("ms_per_token"); fkv = P.get("full", {}).get("gpu_kv_bytes")
    for p, r in P.items():
        if "error" in r: print("%7d %-34s error: %s" % (c["T"], p, r["error"])); continue
        ms = r["ms_per_token"]
        print("%7d %-34s %8.3f ms x full %s GPU KV %.4f PCIe MB %.1f no_gather %s pcie_hidden %s no_fetch %s side_work_hidden %s" % (
            c["T"], p, ms, None if not f else round(ms / f, 4), r["gpu_kv_bytes"] / fkv if fkv else float("nan"),
            r["pcie_bytes_per_token"] / 1e6, r.get("ms_no_gather"), r.get("pcie_hidden"), r.get("ms_no_fetch"),
            r.get("side_work_hidden")))
PY
    pack
fi
if has e; then
    engine_tests env KV_TEST_FILTER=step_variants,resident timeout 35 > "$L/engine.tap" 2>&1
    log "test_gpu_engine (step_variants,resident) rc=$?"
    grep -E '^not ok|^# (step|niah4k|resident)' "$L/engine.tap" | head -40 | tee -a "$OUT/summary.txt"
    log "engine: $(grep -c '^ok' "$L/engine.tap") ok (skips included), $(grep -c '^not ok' "$L/engine.tap") not ok"
    pack
fi
ruler() { _r=$1; shift; ruler_dev "$_r" cuda "$@"; } # tools/device/common.sh; writes $OUT/ruler-*.json
if has r; then
    log "kv-bench ruler --device cuda (niah4k dev tasks, 1k/2k/4k)"
    ruler base -P full -P sparse:$S,select=resident
    ruler step --gpu-step "${RSTEP:-every2}" -P sparse:$S,select=resident
    ruler every2 --gpu-step "${RSTEP2:-every2+cache}" -P sparse:$S,select=resident
    [ -n "${RSTEP3:-}" ] && ruler every4 --gpu-step "$RSTEP3" -P sparse:$S,select=resident
    mv "$OUT"/ruler-*.json "$L/" 2>/dev/null
    pack
fi
for tool in memcheck racecheck; do
    case $tool in memcheck) has m || continue;; racecheck) has s || continue;; esac
    KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=topk_many,resident_select timeout ${STIME:-20} compute-sanitizer \
        --tool $tool --error-exitcode 9 "$D/test_gpu_select" 2>&1 | head -c 200000 > "$L/$tool.txt"
    log "$tool (test_gpu_select short) done"
    grep -E '^not ok|ERROR SUMMARY|RACECHECK SUMMARY|^ok' "$L/$tool.txt" | tail -n 6 | tee -a "$OUT/summary.txt"
    pack
done
log "end"
pack
