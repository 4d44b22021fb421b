#!/bin/sh
# Helper I11's device step (issue 11, prefix reuse revisited), one round of
# at most 150 s, run from the repository root after the round unpacked the
# binaries into DIR:   OUT=dir sh DIR/run.sh DIR   (this file is DIR/run.sh)
# STEPS (default tnszq, in that order), each under a timeout that keeps the whole inside the cap:
#   t  test_gpu_prefix (GPU --kv round trips, subsets, device segments)
#   n  kv-bench prefix on niah4k, 8 requests of ~3,930 tokens sharing ~88%:
#      every mode (full, gpu, host, disk, disk-important, disk-query), zstd 3 chunks
#   z  the same with uncompressed disk chunks (--zstd 0)
#   q  disk-query at 10% and 25% and put-time importance at 25% on the CPU engine
#      (4 requests) for the CPU accuracy
#   s  the synthetic llama-3.1-8b at 32k, 90% shared, 3 requests, the first
#      inserted once (--insert 1), uncompressed disk chunks, key-norm put importance
# Results in $OUT: summary.txt, *.json, *.err
set -u
D=${1:-build-dev-I11}
OUT=${OUT:-/tmp/kv-i11}
STEPS=${STEPS:-tnszq}
CAP=${CAP:-145}
mkdir -p "$OUT"
T0=$(date +%s)
export TMPDIR=${TMPDIR:-/tmp}
N=tests/data/niah4k
PY=python3
GEN="$D/prefix-requests.py"
[ -f "$GEN" ] || GEN=tools/prefix-requests.py
log() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" | tee -a "$OUT/summary.txt"; }
has() { case "$STEPS" in *$1*) return 0;; esac; return 1; }
left() { echo $(( CAP - ($(date +%s) - T0) )); }
upto() { # seconds for the next step: what is left, at most $1; 0 when too little is left
    l=$(left); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 8 ] && l=0; echo "$l"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } 2>&1 | tee -a "$OUT/summary.txt"
summ() { # the summary of a kv-bench prefix JSON
    $PY - "$1" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
for m, s in d["summary"].items():
    print("%-15s n=%d ttft_ms_median=%.2f load_ms_median=%.2f speedup=%s accuracy=%s hit_MB=%s" % (
        m, s["requests"], s["ttft_ms_median"], s.get("load_ms_median", -1), s["speedup_vs_full"] and round(s["speedup_vs_full"], 2),
        s["accuracy"], {k: round(v / 1e6, 2) for k, v in s["hit_bytes_mean"].items()}))
for r in d["requests"]:
    print("  req %d %-15s tier %-5s reused %6d prefilled %6d ttft %9.2f load %9.2f ms correct %s" % (
        r["request"], r["mode"], r["tier"], r["reused_tokens"], r["prefilled_tokens"], r["ttft_ms"], r.get("load_ms", -1), r["correct"]))
PY
}
MODES=full,gpu,host,disk,disk-important
"$D/kv-bench" prefix --help 2>&1 | grep -q disk-query && MODES=all
if has t; then
    timeout 40 "$D/test_gpu_prefix" > "$OUT/gpu_prefix.tap" 2>&1; log "test_gpu_prefix rc=$?"
    grep -E '^(not )?ok|^# (skip|fail)' "$OUT/gpu_prefix.tap" | head -20 | tee -a "$OUT/summary.txt"
fi
$PY "$GEN" niah --tasks $N/tasks-dev.jsonl --length 3900 -n 8 > "$TMPDIR/i11-niah.jsonl"
if has n; then
    timeout 30 "$D/kv-bench" prefix --json -m $N/niah4k.bin --device cuda -n 8 --gpu-bytes 2G --host-bytes 4G \
        --modes $MODES "$TMPDIR/i11-niah.jsonl" > "$OUT/niah.json" 2> "$OUT/niah.err"; log "niah4k cuda zstd3 rc=$?"
    summ "$OUT/niah.json"
fi
if has s && [ "$(upto 110)" -gt 0 ]; then
    $PY "$GEN" synthetic --vocab 128256 --length 32768 --shared 0.9 -n 3 > "$TMPDIR/i11-synth.jsonl"
    L=$(upto 110)
    log "8B 32k, timeout ${L}s"
    timeout "$L" "$D/kv-bench" prefix --json --synthetic llama-3.1-8b --device cuda -n 2 --gpu-bytes 16G \
        --host-bytes 32G --zstd 0 --insert 1 --put-queries 0 --modes $MODES "$TMPDIR/i11-synth.jsonl" \
        > "$OUT/synth.json" 2> "$OUT/synth.err"; log "8B 32k rc=$?"
    tail -c 600 "$OUT/synth.err" | tr '\r' '\n' | tail -3 >> "$OUT/summary.txt"
    summ "$OUT/synth.json"
fi
if has z && [ "$(upto 30)" -gt 0 ]; then
    L=$(upto 30)
    timeout "$L" "$D/kv-bench" prefix --json -m $N/niah4k.bin --device cuda -n 8 --gpu-bytes 2G --host-bytes 4G \
        --zstd 0 --modes $MODES "$TMPDIR/i11-niah.jsonl" > "$OUT/niah-raw.json" 2> "$OUT/niah-raw.err"; log "niah4k cuda zstd0 rc=$?"
    summ "$OUT/niah-raw.json"
fi
if has q && [ "$MODES" = all ] && [ "$(upto 40)" -gt 0 ]; then
    head -4 "$TMPDIR/i11-niah.jsonl" > "$TMPDIR/i11-niah4.jsonl"
    L=$(upto 40)
    timeout "$L" "$D/kv-bench" prefix --json -m $N/niah4k.bin --device cpu -n 8 --modes full,disk-important,disk-query \
        "$TMPDIR/i11-niah4.jsonl" > "$OUT/niah-cpu.json" 2> "$OUT/niah-cpu.err"; log "niah4k cpu rc=$?"
    summ "$OUT/niah-cpu.json"
fi
rm -f "$TMPDIR"/i11-*.jsonl
log end
