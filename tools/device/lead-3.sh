#!/bin/sh
# Note (session 6): these runs predate the dsq default of 4-bit keys, 2-bit values and
# 10% salient; `dsq` here meant `dsq:salient=0.2,bits=2` (append ",salient=0.2,bits=2" to
# each dsq spec to reproduce the recorded numbers).
# Lead's device call 3 (2026-12-01, after merging helpers E and G): helper
# E's checks (tools/device/e-check.sh: packed GGUF weights on the GPU, qwen2
# biases) and helper G's (tools/device/g-check.sh: resident/pages selection
# kernels, decode after a real prefill per hybrid, niah4k per selection
# mode), then every GPU unit test once.  From the repository root:
#   sh tools/device/lead-3.sh build-dev     (build-dev from tools/device/pack.sh)
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
mkdir -p "$OUT"
sh tools/device/unpack.sh "$D" || exit 66
. tools/device/common.sh
mkdir -p "$OUT/e" "$OUT/g"
OUT="$OUT/e" STEPS=${ESTEPS:-gmks} sh tools/device/e-check.sh "$D"
OUT="$OUT/g" STEPS=${GSTEPS:-emdr} RLIMIT=${RLIMIT:-20} sh tools/device/g-check.sh "$D"
# DSQ variants on the GPU over all 20 niah4k dev tasks per length (issue 17)
N=tests/data/niah4k
timeout 90 "$D/kv-bench" ruler --device cuda -m $N/niah4k.bin --tokenizer $N/tok259.bin \
    --tasks $N/tasks-dev.jsonl --json --no-progress -P full -P dsq -P dsq:base=salient \
    -P '0=full;*=dsq' -P dsq:salient=0.3 -P dsq:window=128 -P dsq:window=32 \
    > "$OUT/dsq.json" 2>> "$OUT/summary.txt"
echo "== dsq variants rc=$?" | tee -a "$OUT/summary.txt"
python3 - "$OUT/dsq.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
by = {}
for r in d.get("results", []):
    by.setdefault(r.get("policy"), []).append("%d:%.2f" % (r["length"], r["accuracy"]))
for p, v in by.items(): print("%-40s %s" % (p, " ".join(v)))
PY
for t in $ENGINE_TESTS test_cuda_kernels test_cuda_prefill; do
    timeout 200 "$D/$t" > "$OUT/$t.tap" 2>&1
    echo "== $t rc=$? $(grep -c '^ok' "$OUT/$t.tap") ok, $(grep -c '^not ok' "$OUT/$t.tap") not ok" | tee -a "$OUT/summary.txt"
    grep '^not ok' "$OUT/$t.tap" | tee -a "$OUT/summary.txt"
done
cat "$OUT/e/summary.txt" "$OUT/g/summary.txt" >> "$OUT/summary.txt"
