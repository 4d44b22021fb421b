#!/bin/sh
# Helper H1's device step (issue 11: decode from a stored cache, prefix
# reuse from GPU / host / disk tiers), one device call of about 200 s:
#   sh DIR/h-check.sh DIR              (from the repository root; STEPS=tkns)
# DIR holds what tools/device/h-pack.sh put there.  STEPS (each under a timeout):
#   t  test_gpu_prefix: GPU --kv round trips on niah4k (the GPU's own dump and
#      the CPU's, chunked and token by token, a positions subset against the
#      CPU engine, device-resident segments against host rows)
#   k  kv-run --device cuda --kv: dump the first 90% of a niah4k needle prompt,
#      continue with the rest; greedy ids against the whole prompt's
#   n  kv-bench prefix on niah4k (4k-token needle prompts, 90% shared, N=8):
#      TTFT and needle accuracy per mode (full, gpu, host, disk, disk-important)
#   s  kv-bench prefix on the synthetic llama-3.1-8b at 32k, 90% shared random
#      prefix (N=3): TTFT per mode against the full GPU prefill
# Logs in $OUT: summary.txt gpu_prefix.tap kv.txt niah.json synth.json
set -u
D=${1:-build-dev-H}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-tkns}
mkdir -p "$OUT"
# unpack the xz-compressed binaries (with xz, or Python's lzma where xz is missing)
for z in "$D"/*.xz; do
    [ -e "$z" ] || continue
    xz -d -f "$z" 2>/dev/null ||
        python3 -c "import lzma, sys; open(sys.argv[1][:-3], 'wb').write(lzma.open(sys.argv[1]).read())" "$z"
    chmod +x "${z%.xz}"
done
. tools/device/common.sh
export TMPDIR=${TMPDIR:-/tmp}
gpu_info
summ() { # the summary table of a kv-bench prefix JSON
    python3 - "$1" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
for m, s in d["summary"].items():
    print("%-15s n=%d reused=%d ttft_ms_median=%.1f speedup=%s accuracy=%s hit_bytes_mean=%s" % (
        m, s["requests"], s["reused"], s["ttft_ms_median"], s["speedup_vs_full"], s["accuracy"],
        {k: round(v / 1e6, 1) for k, v in s["hit_bytes_mean"].items()}))
for r in d["requests"]:
    print("  req %d %-15s tier %-5s reused %6d prefilled %6d ttft %9.1f ms correct %s" % (
        r["request"], r["mode"], r["tier"], r["reused_tokens"], r["prefilled_tokens"], r["ttft_ms"], r["correct"]))
PY
}
if has t; then
    timeout 45 "$D/test_gpu_prefix" > "$OUT/gpu_prefix.tap" 2>&1; log "test_gpu_prefix rc=$?"
    grep -E '^(not )?ok|^#' "$OUT/gpu_prefix.tap" | head -30 | tee -a "$OUT/summary.txt"
fi
if has k; then
    python3 -c "import json; open('$OUT/p.txt','w').write(json.loads(open('$N/tasks-dev.jsonl').readline())['input'])"
    : > "$OUT/kv.txt"
    timeout 60 "$D/kv-run" -m $N/niah4k.bin --prompt-file "$OUT/p.txt" -n 0 --device cuda --dump-kv "$OUT/all.kvc" 2>> "$OUT/kv.txt"
    timeout 60 "$D/kv-run" -m $N/niah4k.bin --prompt-file "$OUT/p.txt" -n 8 --device cuda --report "$OUT/whole.json" > /dev/null 2>> "$OUT/kv.txt"
    python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/kv.txt"
import json, struct, sys
o = sys.argv[1]
b = open(o + "/all.kvc", "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
s, e = h["tokens"]["data_offsets"]; ids = struct.unpack("<%di" % ((e - s) // 4), b[8 + n + s:8 + n + e])
k = len(ids) * 9 // 10
open(o + "/first.txt", "w").write(" ".join(map(str, ids[:k]))); open(o + "/rest.txt", "w").write(" ".join(map(str, ids[k:])))
print("prompt", len(ids), "tokens, split at", k)
PY
    timeout 60 "$D/kv-run" -m $N/niah4k.bin --tokens "$OUT/first.txt" -n 0 --device cuda --dump-kv "$OUT/first.kvc" 2>> "$OUT/kv.txt"
    timeout 60 "$D/kv-run" -m $N/niah4k.bin --kv "$OUT/first.kvc" --tokens "$OUT/rest.txt" -n 8 --device cuda --report "$OUT/cont.json" > /dev/null 2>> "$OUT/kv.txt"
    log "kv-run --device cuda --kv rc=$?"
    python3 -c "
import json; a=json.load(open('$OUT/whole.json')); b=json.load(open('$OUT/cont.json'))
print('whole', a['generated_ids'], 'ttft_ms', round(a['ttft_ms'],2)); print('--kv ', b['generated_ids'], 'ttft_ms', round(b['ttft_ms'],2), 'reused', b['reused_tokens'], 'prefilled', b['prefilled_tokens'])
print('same greedy ids:', a['generated_ids'] == b['generated_ids'])" 2>&1 | tee -a "$OUT/summary.txt"
    rm -f "$OUT"/*.kvc "$OUT"/first.txt "$OUT"/rest.txt "$OUT"/p.txt
fi
if has n; then
    python3 tools/prefix-requests.py niah --tasks $N/tasks-dev.jsonl --length 3900 -n 8 > "$TMPDIR/h-niah.jsonl"
    timeout 45 "$D/kv-bench" prefix --json -m $N/niah4k.bin --device cuda -n 8 --gpu-bytes 2G --host-bytes 4G \
        "$TMPDIR/h-niah.jsonl" > "$OUT/niah.json" 2>> "$OUT/summary.txt"; log "kv-bench prefix niah4k rc=$?"
    summ "$OUT/niah.json"
fi
if has s; then
    python3 tools/prefix-requests.py synthetic --vocab 128256 --length 32768 --shared 0.9 -n 3 > "$TMPDIR/h-synth.jsonl"
    timeout 150 "$D/kv-bench" prefix --json --synthetic llama-3.1-8b --device cuda -n 4 --gpu-bytes 16G \
        --host-bytes 32G --zstd 1 "$TMPDIR/h-synth.jsonl" > "$OUT/synth.json" 2>> "$OUT/summary.txt"
    log "kv-bench prefix llama-3.1-8b 32k rc=$?"
    summ "$OUT/synth.json"
fi
log "end"
