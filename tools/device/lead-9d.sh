#!/bin/sh
# Session 9's last device call, after the review fixes: the GPU tests the
# fixes touched (test_gpu_prefix with pinned and device rows uploaded
# ahead, also under memcheck; test_gpu_qaware after kt_qaware.h;
# test_gpu_kv after kt_niah.h), then two seeds of the widened niah4k
# prefix run, whose JSON now says rows_ahead per request.
# From the repository root:  OUT=DIR sh tools/device/lead-9d.sh DIR
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
. tools/device/common.sh
L="$OUT/logs"
unpack_once
gpu_info
mkdir -p "$L"
for t in test_gpu_prefix test_gpu_qaware test_gpu_kv; do
    timeout 60 "$D/$t" > "$L/$t.tap" 2>&1
    log "$t rc=$?"
    tap "$t" "$L/$t.tap" 12
done
sanitize memcheck ahead test_gpu_prefix prefix 90
tar czf "$OUT/lead9d.tgz" -C "$L" . 2>/dev/null
SEEDS="1 2" STEPS=w BUDGET=120 sh tools/device/lead-9w.sh "$D"
python3 - "$L"/wide-s1.json <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
by = {}
for r in d["requests"]:
    by.setdefault(r["mode"], set()).add(r.get("prefill_phases_ms", {}).get("rows_ahead"))
print("rows_ahead by mode:", {m: sorted(map(str, v)) for m, v in by.items()})
PY
