#!/bin/sh
# Note (session 6): these runs predate the dsq default of 4-bit keys, 2-bit values and
# 10% salient; `dsq` here meant `dsq:salient=0.2,bits=2` (append ",salient=0.2,bits=2" to
# each dsq spec to reproduce the recorded numbers).
# Lead's device call 4 (2026-12-01, after merging helpers E4, G4, H1):
# E4's packed GEMV variants (tools/device/e4-check.sh), G4's sparse step
# variants (tools/device/g4-check.sh), H1's stored-cache round trips and
# time to first token (tools/device/h-check.sh), then DSQ variants on the
# niah4k tasks.  From the repository root:
#   sh tools/device/lead-4.sh build-dev     (build-dev from tools/device/pack.sh)
set -u
D=${1:-build-dev}
# at most 8 files come back from the device: everything is written under
# W and leaves as one tarball next to the summary
FINAL=${OUT:-/tmp/kv-out}
OUT=${W:-/tmp/kv-lead4}
mkdir -p "$OUT" "$FINAL"
sh tools/device/unpack.sh "$D" || exit 66
. tools/device/common.sh
for s in ${STAGES:-g4 h e4}; do
    [ -f tools/device/$s-check.sh ] || continue
    mkdir -p "$OUT/$s"
    echo "==== $s-check $(date -u +%H:%M:%S)" >> "$OUT/summary.txt"
    OUT="$OUT/$s" DTIME=${DTIME:-180} sh tools/device/$s-check.sh "$D" > "$OUT/$s/stdout.txt" 2>&1
    cat "$OUT/$s/summary.txt" >> "$OUT/summary.txt" 2>/dev/null
    snap
done
N=tests/data/niah4k
echo "==== dsq variants $(date -u +%H:%M:%S)" >> "$OUT/summary.txt"
timeout ${QTIME:-45} "$D/kv-bench" ruler --device cuda -m $N/niah4k.bin --tokenizer $N/tok259.bin \
    --tasks $N/tasks-dev.jsonl --json --no-progress -P full -P dsq -P dsq:salient=0.3 -P dsq:base=salient \
    > "$OUT/dsq.json" 2>> "$OUT/summary.txt"
echo "rc=$?" >> "$OUT/summary.txt"
python3 - "$OUT/dsq.json" <<'PY' >> "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
by = {}
for r in d.get("results", []):
    by.setdefault(r.get("policy"), []).append("%d:%.2f" % (r["length"], r["accuracy"]))
for p, v in by.items(): print("%-40s %s" % (p, " ".join(v)))
PY
echo "==== end $(date -u +%H:%M:%S)" >> "$OUT/summary.txt"
snap
