#!/bin/sh
# The first device call after session 8 (which had no device time), on the
# merged main, after sh tools/device/unpack.sh DIR:
#   every GPU and CUDA unit test in the pack once, with room for the whole
#   of test_cuda_kernels (session 7's 40 s cut it at 7 tests) and the parts
#   split out of test_gpu_engine; compute-sanitizer memcheck and racecheck of
#   the prefill attention's default Hopper kernel (the TMA/wgmma one, issue
#   9: memcheck was clean in session 7, racecheck never ran) and of the
#   packed decode kernels; kv-bench prefill against the PyTorch peer with 3
#   repetitions at 32k and 2 at 128k; kv-bench decode at 128k after a real
#   prefill.  Everything numerous goes into OUT/lead9.tgz.
# From the repository root:  OUT=DIR sh tools/device/lead-9.sh DIR
# Needs about 330 s of device time (STEPS picks a subset: t tests, s
# sanitizers, p prefill, d decode; default all).
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-tspd}
. tools/device/common.sh
L="$OUT/logs"
mkdir -p "$L"
pack() { tar czf "$OUT/lead9.tgz" -C "$L" . 2>/dev/null; }
gpu_info

if has t; then
    for f in "$D"/test_gpu_* "$D"/test_cuda_*; do
        [ -x "$f" ] || continue
        n=$(basename "$f")
        case $n in test_cuda_kernels) s=110;; test_gpu_engine*) s=70;; *) s=50;; esac
        timeout "$s" "$f" > "$L/$n.tap" 2>&1
        log "$n rc=$? $(grep -c '^ok' "$L/$n.tap") ok, $(grep -c '^not ok' "$L/$n.tap") not ok"
        grep -A6 '^not ok' "$L/$n.tap" | head -24 >> "$OUT/summary.txt"
        pack
    done
fi

if has s; then
    for tool in memcheck racecheck; do
        KV_TEST_SHORT=1 KV_TEST_FILTER=attention_matches timeout 40 \
            compute-sanitizer --tool $tool --error-exitcode 9 "$D/test_cuda_prefill" > "$L/prefill-$tool.log" 2>&1
        log "test_cuda_prefill (short, attention, default kernel) under $tool rc=$?"
        grep -E '^not ok|ERROR SUMMARY|RACECHECK SUMMARY|^# prefill' "$L/prefill-$tool.log" | tail -n 6 |
            tee -a "$OUT/summary.txt"
    done
    timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/test_gpu_kv" > "$L/kv-memcheck.log" 2>&1
    log "test_gpu_kv under memcheck rc=$?"
    grep -E '^not ok|ERROR SUMMARY' "$L/kv-memcheck.log" | tail -n 4 | tee -a "$OUT/summary.txt"
    pack
fi

if has p; then
    timeout 100 "$D/kv-bench" prefill --json -c 32768,131072 --reps 2 > "$L/prefill-kv.json" 2> "$L/prefill-kv.err"
    log "kv-bench prefill -c 32768,131072 --reps 2 rc=$?"
    PYTHONUNBUFFERED=1 timeout 90 python3 tools/device/prefill_peer.py --contexts 32768,131072 --reps 2 \
        > "$L/prefill-peer.json" 2> "$L/prefill-peer.err"
    log "prefill_peer.py --reps 2 rc=$?"
    python3 - "$L/prefill-kv.json" "$L/prefill-peer.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
for f in sys.argv[1:]:
    try: print(f.split("/")[-1], json.dumps(json.load(open(f)))[:1500])
    except Exception as e: print(f, "no JSON:", e)
PY
    pack
fi

if has d; then
    timeout 90 "$D/kv-bench" decode --json --context prefill -c 131072 --policies full,quant,hybrid-resident \
        -n 16 --warmup 2 --nofetch-tokens 8 > "$L/decode.json" 2> "$L/decode.err"
    log "kv-bench decode 128k rc=$?"
    python3 - "$L/decode.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
for c in d["contexts"]:
    for k, v in c["policies"].items():
        print(c["T"], k, "ms", v.get("ms_per_token"), "gpu_kv", v.get("gpu_kv_bytes", v.get("gpu_kv")),
              "no_gather", v.get("ms_no_gather"), "pcie_hidden", v.get("pcie_hidden"), "bound", v.get("over_bound"))
PY
    pack
fi
log end
