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
#   prefill.  Everything numerous goes into OUT/lead9.tgz (packed after
#   every step, so a call cut short still returns what ran).
# From the repository root:  OUT=DIR sh tools/device/lead-9.sh DIR
# (it unpacks DIR's binaries itself when tools/device/unpack.sh has not).
# Needs about 400 s of device time; BUDGET (default 540 s, under the
# device's 600 s a call) skips a step that would not fit.  STEPS picks a
# subset: t tests, s sanitizers, p prefill, d decode; default all.
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-tspd}
BUDGET=${BUDGET:-540}
. tools/device/common.sh
L="$OUT/logs"
mkdir -p "$L"
unpack_once
[ -x "$D/kv-bench" ] || { log "no binaries in $D (see unpack.log)"; exit 66; }
T0=$(date +%s)
# left N WHAT: N more seconds fit in the budget, else WHAT is logged as skipped
left() { [ $(( $(date +%s) - T0 + $1 )) -le "$BUDGET" ] || { log "skipped: $2 (budget)"; return 1; }; }
pack() { tar czf "$OUT/lead9.tgz" -C "$L" . 2>/dev/null; }
gpu_info

if has t; then
    for f in "$D"/test_gpu_* "$D"/test_cuda_*; do
        [ -x "$f" ] || continue
        n=$(basename "$f")
        case $n in test_cuda_kernels) s=110;; test_gpu_engine*) s=45;; *) s=50;; esac
        left "$s" "$n" || continue
        timeout "$s" "$f" > "$L/$n.tap" 2>&1
        log "$n rc=$? $(grep -c '^ok' "$L/$n.tap") ok, $(grep -c '^not ok' "$L/$n.tap") not ok"
        # kt.h prints a failed check's lines before its "not ok"
        grep -B12 '^not ok' "$L/$n.tap" | head -40 >> "$OUT/summary.txt"
        pack
    done
fi

if has s; then
    # KV_TEST_SHORT runs the device's default kernel (the TMA one on the
    # H200) and the mma.sync one
    for tool in memcheck racecheck; do
        left 60 "prefill $tool" || continue
        KV_TEST_SHORT=1 KV_TEST_FILTER=attention_matches timeout 60 \
            compute-sanitizer --tool $tool --error-exitcode 9 "$D/test_cuda_prefill" > "$L/prefill-$tool.log" 2>&1
        log "test_cuda_prefill (short, attention: default + mma.sync kernels) under $tool rc=$?"
        grep -E '^not ok|ERROR SUMMARY|RACECHECK SUMMARY|^# prefill' "$L/prefill-$tool.log" | tail -n 6 |
            tee -a "$OUT/summary.txt"
    done
    if left 60 "test_gpu_kv memcheck"; then
        timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/test_gpu_kv" > "$L/kv-memcheck.log" 2>&1
        log "test_gpu_kv under memcheck rc=$?"
        grep -E '^not ok|ERROR SUMMARY' "$L/kv-memcheck.log" | tail -n 4 | tee -a "$OUT/summary.txt"
    fi
    pack
fi

if has p; then
    # kvtools then the PyTorch peer at each context, 3 repetitions at 32k, 2 at 128k
    for cr in 32768:3:24 131072:2:60; do
        c=${cr%%:*}; r=${cr#*:}; r=${r%%:*}; s=${cr##*:}
        left $((2 * s)) "prefill $c" || continue
        timeout "$s" "$D/kv-bench" prefill --json -c "$c" --reps "$r" > "$L/prefill-kv-$c.json" 2> "$L/prefill-kv-$c.err"
        log "kv-bench prefill -c $c --reps $r rc=$?"
        PYTHONUNBUFFERED=1 timeout "$s" python3 tools/device/prefill_peer.py --contexts "$c" --reps "$r" \
            > "$L/prefill-peer-$c.json" 2> "$L/prefill-peer-$c.err"
        log "prefill_peer.py --contexts $c --reps $r rc=$?"
    done
    python3 - "$L"/prefill-kv-*.json "$L"/prefill-peer-*.json <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
for f in sys.argv[1:]:
    try: print(f.split("/")[-1], json.dumps(json.load(open(f)))[:1500])
    except Exception as e: print(f, "no JSON:", e)
PY
    pack
fi

if has d && left 90 "decode"; then
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
for k, v in d.get("targets", {}).items(): print("target", k, v)
PY
    pack
fi
log "end, $(( $(date +%s) - T0 )) s"
