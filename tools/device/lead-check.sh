#!/bin/sh
# One device call of the lead (issue 9 phase 2 validation and measurements):
#   sh tools/device/lead-check.sh DIR
# DIR holds gzipped binaries built here (kv-bench, test_gpu_engine,
# test_cuda_prefill, test_cuda_kernels), lib/ (libcjson) and prefill_peer.py.
# STEPS: e engine tests, s sanitizers, d decode after a real prefill,
# r niah4k on the GPU, b prefill bench + peer.  Each step has a timeout;
# logs in $OUT: summary.txt engine.tap prefill.tap sanitizer.log decode.json
# ruler.txt ruler.jsonl prefill.json peer.json
set -u
D=${1:-build-dev-lead}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-esdrb}
. tools/device/common.sh
dev_gunzip
gpu_info clocks.sm,clocks.mem
if has e; then
    for t in test_cuda_prefill test_gpu_engine test_cuda_kernels; do
        [ -x "$D/$t" ] || continue
        timeout ${ETIME:-200} "$D/$t" > "$OUT/$t.tap" 2>&1; log "$t rc=$?"; tap $t "$OUT/$t.tap"
    done
fi
if has s; then
    engine_tests env KV_GPU_TEST_SHORT=1 KV_TEST_SHORT=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
        > "$OUT/sanitizer.log" 2>&1; log "memcheck test_gpu_engine* (short) rc=$?"
    grep -E 'ERROR SUMMARY|^not ok' "$OUT/sanitizer.log" | tail -n 5 | tee -a "$OUT/summary.txt"
    KV_TEST_SHORT=1 KV_TEST_FILTER=attention timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
        "$D/test_cuda_prefill" >> "$OUT/sanitizer.log" 2>&1; log "racecheck prefill attention (short) rc=$?"
    grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 2 | tee -a "$OUT/summary.txt"
fi
if has d; then
    log "kv-bench decode --context both -c ${DCTX:-32768,131072}"
    timeout ${DTIME:-200} "$D/kv-bench" decode --json --context both -c ${DCTX:-32768,131072} \
        --policies ${DPOL:-full,quant,hybrid-sketch,hybrid} > "$OUT/decode.json" 2>> "$OUT/summary.txt"; log "rc=$?"
    python3 - "$OUT/decode.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
for c in d["contexts"]:
    for p, r in c["policies"].items():
        if "error" in r: print(c["T"], p, "ERROR", r["error"]); continue
        pf = r.get("prefill", {})
        print("%7d %-14s synth %8.3f ms  after-prefill %s ms  ratio %s  prefill %s ms (%s tok/s, attn %s TFLOP/s)  gpu %.1f MB" % (
            c["T"], p, r["ms_per_token"], pf.get("ms_per_token"), pf.get("over_synthesized"),
            pf.get("prefill_ms"), pf.get("tokens_per_s"), pf.get("attn_tflops"), r["gpu_kv_bytes"] / 1e6))
PY
fi
if has r; then
    N=tests/data/niah4k
    : > "$OUT/ruler.txt"
    for p in full sparse sparse:s=8,w=32,frac=0.03 quant quant:bits=2 dsq streaming; do
        timeout 60 "$D/kv-bench" ruler --device cuda -m $N/niah4k.bin --tokenizer $N/tok259.bin \
            --tasks $N/tasks-dev.jsonl -P "$p" --json > "$OUT/r.json" 2>/dev/null
        echo "rc=$? $p $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(' '.join('%d:%.2f(%dKiB/t)' % (r['length'], r['accuracy'], r['fetched_bytes_per_step'] // 1024) for r in d['results']))" "$OUT/r.json" 2>&1 | head -c 400)" | tee -a "$OUT/ruler.txt"
        cat "$OUT/r.json" >> "$OUT/ruler.jsonl"; echo >> "$OUT/ruler.jsonl"
    done
    rm -f "$OUT/r.json"
    log "ruler done"; cat "$OUT/ruler.txt" >> "$OUT/summary.txt"
fi
if has b; then
    log "kv-bench prefill -c 8192,32768,131072"
    timeout 200 "$D/kv-bench" prefill --json -c 8192,32768,131072 --reps 2 > "$OUT/prefill.json" 2>> "$OUT/summary.txt"; log "rc=$?"
    python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
print('gemm', d.get('gemm_tflops'))
for c in d['contexts']: print(c['T'], 'prefill ms', c.get('prefill_ms'), 'tok/s', c.get('tokens_per_s'), 'attn TFLOP/s', c.get('attn_tflops'))
" "$OUT/prefill.json" 2>&1 | tee -a "$OUT/summary.txt"
    log "peer"
    PYTHONUNBUFFERED=1 timeout 200 python3 "$D/prefill_peer.py" --reps 2 > "$OUT/peer.json" 2>> "$OUT/summary.txt"; log "peer rc=$?"
    tail -c 1500 "$OUT/peer.json" | tee -a "$OUT/summary.txt"
fi
log "end"
