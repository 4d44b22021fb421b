#!/bin/sh
# Helper I11's device step (issue 11, prefix reuse revisited), one round of
# at most 150 s, run from the repository root after the round unpacked the
# binaries into DIR:   OUT=dir sh DIR/run.sh DIR   (this file is DIR/run.sh)
# STEPS (default tszkq8, in the order below), each under a timeout that keeps the whole inside the cap:
#   t  test_gpu_prefix (GPU --kv round trips, subsets and their dumps, device segments)
#   n  kv-bench prefix on niah4k, 8 requests of ~3,930 tokens sharing ~88%:
#      every mode (full, gpu, host, disk, disk-important, disk-query), zstd 3 chunks
#   z  the same with uncompressed disk chunks (--zstd 0)
#   k  kv-run --device cuda --store --important 0.25 --query-aware on niah4k: answers, inserts
#   q  full, disk-important and disk-query at 25% on the CPU engine (4 requests)
#   m  test_gpu_prefix under compute-sanitizer memcheck
#   4  niah4k on the GPU as z, disk-query with --queries 4
#   8  the same with --queries 8
#   s  the synthetic llama-3.1-8b at 32k, 90% shared, 3 requests, the first
#      inserted once (--insert 1), uncompressed disk chunks, key-norm put importance
# Results in $OUT: summary.txt, *.json, *.err
set -u
D=${1:-build-dev-I11}
OUT=${OUT:-/tmp/kv-i11}
STEPS=${STEPS:-tszkq8}
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
    if "query_aware_ms" in r: print("      query-aware ms:", {k: round(v, 2) for k, v in r["query_aware_ms"].items()})
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
if has k && [ "$(upto 30)" -gt 0 ]; then
    $PY - "$TMPDIR/i11-niah.jsonl" "$TMPDIR" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
for i in (0, 1):
    open("%s/i11-p%d.txt" % (sys.argv[2], i), "w").write(r[i]["input"])
open("%s/i11-a1.txt" % sys.argv[2], "w").write(r[1]["outputs"][0])
PY
    rm -rf "$TMPDIR/i11-st"
    "$D/kv-tree" init --encodings disk=raw+zstd+sketch "$TMPDIR/i11-st"
    timeout 20 "$D/kv-run" -m $N/niah4k.bin --device cuda --prompt-file "$TMPDIR/i11-p0.txt" -n 1 --store "$TMPDIR/i11-st" > /dev/null 2> "$OUT/kvrun.err"
    timeout 20 "$D/kv-run" -m $N/niah4k.bin --device cuda --prompt-file "$TMPDIR/i11-p1.txt" -n 8 --store "$TMPDIR/i11-st" \
        --important 0.25 --query-aware --report "$OUT/kvrun.json" > /dev/null 2>> "$OUT/kvrun.err"; log "kv-run cuda --query-aware rc=$?"
    "$D/kv-tree" check "$TMPDIR/i11-st" > "$OUT/kvrun-check.json" 2>&1; log "kv-tree check rc=$?"
    $PY - "$OUT/kvrun.json" "$TMPDIR/i11-a1.txt" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("no report:", e); sys.exit(0)
a = open(sys.argv[2]).read()
print("kv-run --query-aware: text %r answer %s in it: %s; reused %d of matched %d, ttft %.2f ms, put %s" % (
    j.get("text"), a, a in (j.get("text") or ""), j["reused_tokens"], j["reuse"]["matched"], j["ttft_ms"],
    None if j["reuse"].get("put") is None else j["reuse"]["put"].get("added_tokens")))
PY
    rm -rf "$TMPDIR/i11-st" "$TMPDIR"/i11-p*.txt "$TMPDIR/i11-a1.txt"
fi
if has q && [ "$MODES" = all ] && [ "$(upto 40)" -gt 0 ]; then
    head -4 "$TMPDIR/i11-niah.jsonl" > "$TMPDIR/i11-niah4.jsonl"
    L=$(upto 40)
    timeout "$L" "$D/kv-bench" prefix --json -m $N/niah4k.bin --device cpu -n 8 --modes full,disk-important,disk-query \
        "$TMPDIR/i11-niah4.jsonl" > "$OUT/niah-cpu.json" 2> "$OUT/niah-cpu.err"; log "niah4k cpu rc=$?"
    summ "$OUT/niah-cpu.json"
fi
if has m && [ "$(upto 40)" -gt 0 ]; then
    timeout "$(upto 40)" compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 "$D/test_gpu_prefix" \
        > "$OUT/memcheck.txt" 2>&1; log "memcheck test_gpu_prefix rc=$?"
    grep -E "ERROR SUMMARY|LEAK SUMMARY|^not ok" "$OUT/memcheck.txt" | head -5 | tee -a "$OUT/summary.txt"
fi
if has 4 && [ "$(upto 20)" -gt 0 ]; then
    timeout "$(upto 20)" "$D/kv-bench" prefix --json -m $N/niah4k.bin --device cuda -n 8 --gpu-bytes 2G --host-bytes 4G \
        --zstd 0 --queries 4 --modes full,disk-query "$TMPDIR/i11-niah.jsonl" > "$OUT/niah-q4.json" 2> "$OUT/niah-q4.err"
    log "niah4k cuda --queries 4 rc=$?"
    summ "$OUT/niah-q4.json"
fi
if has 8 && [ "$(upto 20)" -gt 0 ]; then
    timeout "$(upto 20)" "$D/kv-bench" prefix --json -m $N/niah4k.bin --device cuda -n 8 --gpu-bytes 2G --host-bytes 4G \
        --zstd 0 --queries 8 --modes full,disk-query "$TMPDIR/i11-niah.jsonl" > "$OUT/niah-q8.json" 2> "$OUT/niah-q8.err"
    log "niah4k cuda --queries 8 rc=$?"
    summ "$OUT/niah-q8.json"
fi
rm -f "$TMPDIR"/i11-*.jsonl
log end
