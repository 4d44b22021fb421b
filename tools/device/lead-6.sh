#!/bin/sh
# Lead's last device call of session 5 (2026-12-01): the merged main (K10,
# G10, B10, S17, P17, I11, Q13) on the H200, after sh tools/device/unpack.sh DIR:
#   every GPU unit test once (the merge points: the engine's forward() with
#   the graph step, the batch driver and the selection ahead; the CPU's new
#   F16/BF16 activation rounding against the GPU engine), then kv-bench
#   decode at 128k after a real prefill: full, quant, the default hybrid.
# From the repository root:  OUT=DIR sh tools/device/lead-6.sh DIR
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
. tools/device/common.sh
log() { echo "== $(date -u +%H:%M:%S) $*" >> "$OUT/summary.txt"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } >> "$OUT/summary.txt" 2>&1
for t in test_gpu_engine_kernels:25 test_gpu_engine:50 test_gpu_engine_data:50 test_cuda_kernels:40 test_gpu_graph:25 test_gpu_batch:30 test_gpu_select:15 \
         test_gpu_prefix:15 test_cuda_prefill:40; do
    n=${t%%:*}; s=${t#*:}
    timeout "$s" "$D/$n" > "$OUT/$n.tap" 2>&1
    log "$n rc=$? $(grep -c '^ok' "$OUT/$n.tap") ok, $(grep -c '^not ok' "$OUT/$n.tap") not ok"
    grep -A4 '^not ok' "$OUT/$n.tap" | head -20 >> "$OUT/summary.txt"
done
timeout 60 "$D/kv-bench" decode --json --context prefill -c 131072 --policies full,quant,hybrid-resident \
    -n 16 --warmup 2 --nofetch-tokens 0 > "$OUT/decode.json" 2> "$OUT/decode.err"
log "kv-bench decode 128k rc=$?"
python3 - "$OUT/decode.json" >> "$OUT/summary.txt" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for c in d["contexts"]:
    for k, v in c["policies"].items():
        print(c["T"], k, v.get("ms_per_token"), "graph", v.get("graph"), "gpu_kv", v.get("gpu_kv_over_full"))
PY
log end
