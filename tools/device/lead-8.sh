#!/bin/sh
# Lead's last device call of session 7 (2026-12-01): the merged main (A7,
# B7, C7, D7 and the lead's fixes) on the H200, after sh tools/device/unpack.sh DIR:
#   every GPU unit test once, kv-bench decode at 128k after a real prefill
#   (full, offload, quant, the default hybrid with its fetch-free and
#   gather-free steps), niah4k on the GPU (full, the default hybrid, the dsq
#   default), and the prefill against the PyTorch peer at 32k and 128k in
#   the same run.  Everything numerous goes into OUT/lead8.tgz.
# From the repository root:  OUT=DIR sh tools/device/lead-8.sh DIR
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
. tools/device/common.sh
L="$OUT/logs"
mkdir -p "$L"
pack() { tar czf "$OUT/lead8.tgz" -C "$L" . 2>/dev/null; }
gpu_info
for t in test_gpu_engine_kernels:20 test_gpu_engine:40 test_gpu_engine_data:40 test_cuda_kernels:40 test_gpu_graph:25 test_gpu_batch:30 test_gpu_select:25 \
         test_gpu_prefix:25 test_gpu_kv:40 test_cuda_prefill:50; do
    n=${t%%:*}; s=${t#*:}
    [ -x "$D/$n" ] || { log "$n: not in the pack"; continue; }
    timeout "$s" "$D/$n" > "$L/$n.tap" 2>&1
    log "$n rc=$? $(grep -c '^ok' "$L/$n.tap") ok, $(grep -c '^not ok' "$L/$n.tap") not ok"
    grep -A6 '^not ok' "$L/$n.tap" | head -24 >> "$OUT/summary.txt"
    pack
done
timeout 90 "$D/kv-bench" decode --json --context prefill -c 131072 --policies full,offload,quant,hybrid-resident \
    -n 16 --warmup 2 --offload-tokens 2 --nofetch-tokens 8 > "$L/decode.json" 2> "$L/decode.err"
log "kv-bench decode 128k rc=$?"
python3 - "$L/decode.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
for c in d["contexts"]:
    for k, v in c["policies"].items():
        print(c["T"], k, "ms", v.get("ms_per_token"), "graph", (v.get("graph") or {}).get("mode") if isinstance(v.get("graph"), dict) else v.get("graph"),
              "gpu_kv", v.get("gpu_kv_bytes", v.get("gpu_kv")), "no_fetch", v.get("ms_no_fetch"),
              "no_gather", v.get("ms_no_gather"), "pcie_hidden", v.get("pcie_hidden"),
              "side_work_hidden", v.get("side_work_hidden"), "bound", v.get("over_bound"))
for k, v in d.get("targets", {}).items(): print("target", k, v)
PY
pack
ruler_dev final cuda -P full -P sparse:s=8,w=32,frac=0.03,select=resident -P "0=full;*=dsq"
cp "$OUT"/ruler-*.json "$L"/ 2>/dev/null
pack
timeout 45 "$D/kv-bench" prefill --json -c 32768,131072 --reps 1 > "$L/prefill-kv.json" 2> "$L/prefill-kv.err"
log "kv-bench prefill -c 32768,131072 --reps 1 rc=$?"
PYTHONUNBUFFERED=1 timeout 50 python3 tools/device/prefill_peer.py --contexts 32768,131072 --reps 1 \
    > "$L/prefill-peer.json" 2> "$L/prefill-peer.err"
log "prefill_peer.py rc=$?"
python3 - "$L/prefill-kv.json" "$L/prefill-peer.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
for f in sys.argv[1:]:
    try: print(f.split("/")[-1], json.dumps(json.load(open(f)))[:1500])
    except Exception as e: print(f, "no JSON:", e)
PY
pack
log end
