#!/bin/sh
# Helper E's device step (issue 13: GGUF weights kept packed on the GPU, the
# decode GEMV on Q8_0/Q4_K/Q6_K blocks, the prefill dequantizing per chunk,
# qwen2's q/k/v biases), one device call of about 150 s:
#   STEPS=gmks sh DIR/e-check.sh DIR          (from the repository root)
# DIR holds what tools/device/e-pack.sh put there: gzipped kv-run and
# test_gpu_engine (CUDA, sm_90, fatbins compressed), kv-convert (CPU build),
# the GGUF fixtures of tests/data that main does not have yet (data/), lib/
# (libcjson) and this script.
# STEPS (each under its own timeout):
#   g  test_gpu_engine, the new tests only (KV_TEST_FILTER): every packed
#      kernel (GEMV, dequantization to fp16/bf16, embedding rows) against
#      lib/model/kv_quants' CPU reference by normalized error; niah4k Q4_K,
#      Q6_K, Q8_0, a Q4_K_M-like mix and stories260K Q8_0 (+F16) through the
#      whole GPU engine against the CPU engine (logits, greedy ids, packed
#      bytes); qwen2's biases; heads wider than dim / n_heads
#   m  compute-sanitizer memcheck of the kernel test and the qwen2 test
#      (short form)
#   k  greedy ids of kv-run --device cuda against --device cpu on the GGUF
#      fixtures (niah4k Q4_K, stories260K Q8_0, stories260K qwen2 bf16) and
#      on niah4k converted here to Q6_K and Q8_0
#   s  decode tokens/s on the GPU: a synthetic Llama-3.2-1B converted here to
#      Q4_K (Q6_K embedding and classifier, as in a Q4_K_M file) against the
#      same synthetic model in F16 (kv-run --synthetic --weights f16)
# Logs in $OUT: summary.txt engine.tap sanitizer.log greedy.txt speed-*.json
set -u
D=${1:-build-dev-E}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-gmks}
mkdir -p "$OUT"
for z in "$D"/*.gz "$D"/data/*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
chmod +x "$D/kv-run" "$D/kv-convert" "$D"/test_gpu_engine* 2>/dev/null
# the fixtures where the tests look for them (the device's copy of main)
cp -n "$D"/data/niah4k-*.gguf tests/data/niah4k/ 2>/dev/null
cp -n "$D"/data/stories260K-*.gguf tests/data/stories260K/ 2>/dev/null
mkdir -p tests/data/gguf && cp -n "$D"/data/llama3-vocab.gguf tests/data/gguf/ 2>/dev/null
. tools/device/common.sh
S=tests/data/stories260K
W=${TMPDIR:-/tmp}/kv-e
mkdir -p "$W"
gpu_info
if has g; then
    engine_tests env KV_TEST_FILTER=packed,qwen2_biases,wide_heads timeout 100 > "$OUT/engine.tap" 2>&1
    log "test_gpu_engine (packed, qwen2 biases, wide heads) rc=$?"
    log "$(grep -c '^ok' "$OUT/engine.tap") ok ($(grep -c '# SKIP not selected' "$OUT/engine.tap") not selected), $(grep -c '^not ok' "$OUT/engine.tap") not ok"
    grep -E '^not ok|^# (gemv|niah4k|stories260K|tiny|qwen2)|^#   ' "$OUT/engine.tap" | head -60 | tee -a "$OUT/summary.txt"
fi
if has m; then
    engine_tests env KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=packed_kernels,qwen2_biases timeout 60 compute-sanitizer \
        --tool memcheck --error-exitcode 9 > "$OUT/sanitizer.log" 2>&1
    log "memcheck (packed kernels, qwen2 biases; short) rc=$?"
    grep -E '^not ok|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 4 | tee -a "$OUT/summary.txt"
fi
if has k; then
    : > "$OUT/greedy.txt"
    python3 -c "import json; print(json.loads(open('$N/tasks-dev.jsonl').readline())['input'].rsplit(chr(10) + 'Question:', 1)[0][-1500:])" > "$W/p.txt"
    echo "Once upon a time" > "$W/s.txt"
    for t in Q6_K Q8_0; do
        timeout 20 "$D/kv-convert" -q -m $N/niah4k.bin --tokenizer $N/tok259.bin --type $t -o "$W/niah4k-$t.gguf" 2>> "$OUT/greedy.txt"
    done
    for f in $N/niah4k-q4_k.gguf "$W/niah4k-Q6_K.gguf" "$W/niah4k-Q8_0.gguf" $S/stories260K-q8_0.gguf $S/stories260K-qwen2-bf16.gguf; do
        case "$f" in *niah4k*) pf=$W/p.txt n=24;; *) pf=$W/s.txt n=64;; esac
        for dev in cuda cpu; do
            timeout 30 "$D/kv-run" -m "$f" --prompt-file "$pf" -n $n --temp 0 --device $dev \
                --report "$W/$dev.json" > /dev/null 2>> "$OUT/greedy.txt"
            echo "$(basename "$f") --device $dev rc=$?" >> "$OUT/greedy.txt"
        done
        python3 - "$f" "$W/cuda.json" "$W/cpu.json" <<'PY' 2>&1 | tee -a "$OUT/greedy.txt"
import json, os, sys
try:
    g, c = (json.load(open(p)) for p in sys.argv[2:4])
except Exception as e:
    print(os.path.basename(sys.argv[1]), "no report:", e); sys.exit(0)
a, b = g["generated_ids"], c["generated_ids"]
same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
print("%-28s greedy GPU vs CPU: %d/%d ids identical%s; decode tok/s GPU %.0f, CPU %.0f" % (
    os.path.basename(sys.argv[1]), same, len(b), "" if same == len(b) else " (first difference at step %d)" % same,
    g.get("tokens_per_s", 0), c.get("tokens_per_s", 0)))
PY
        rm -f "$W/cuda.json" "$W/cpu.json"
    done
    grep -v '^$' "$OUT/greedy.txt" | grep -E 'greedy|rc=[1-9]|error|refus' >> "$OUT/summary.txt"
fi
if has s; then
    log "kv-convert --synthetic llama-3.2-1b --type Q4_K --embd-type Q6_K"
    timeout 90 "$D/kv-convert" -q --synthetic llama-3.2-1b --vocab tests/data/gguf/llama3-vocab.gguf --type Q4_K \
        --embd-type Q6_K -o "$W/1b-q4k.gguf" 2>> "$OUT/summary.txt"
    log "rc=$? $(ls -l "$W/1b-q4k.gguf" 2>/dev/null | awk '{print $5}') bytes"
    for run in "q4k -m $W/1b-q4k.gguf" "f16 --synthetic llama-3.2-1b --weights f16"; do
        set -- $run
        name=$1; shift
        timeout 40 "$D/kv-run" "$@" --device cuda --random-prompt 64 -n 256 --temp 0 -c 512 \
            --report "$OUT/speed-$name.json" > /dev/null 2>> "$OUT/summary.txt"
        log "kv-run $* --device cuda rc=$?"
    done
    python3 - "$OUT/speed-q4k.json" "$OUT/speed-f16.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
r = {}
for name, path in zip(("Q4_K (Q6_K embd/out)", "F16"), sys.argv[1:]):
    try: d = json.load(open(path))
    except Exception as e: print(name, "no report:", e); continue
    r[name] = d
    print("%-22s decode %.1f tok/s, median %.3f ms/token, p90 %.3f ms, prefill %.1f ms, %s" % (
        name, d["tokens_per_s"], d["ms_per_token_median"], d["ms_per_token_p90"], d["prefill_ms"],
        json.dumps(d.get("prefill", {}).get("method"))))
if len(r) == 2:
    a, b = r["Q4_K (Q6_K embd/out)"], r["F16"]
    print("packed over F16: %.2fx tokens/s (median ms/token %.2fx)" % (
        a["tokens_per_s"] / b["tokens_per_s"], b["ms_per_token_median"] / a["ms_per_token_median"]))
PY
    rm -f "$W/1b-q4k.gguf"
fi
log "end"
