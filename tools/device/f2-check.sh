#!/bin/sh
# Helper F2's device step (issue 9: the GPU dump, the sparse layers' chunk
# copies under the prefill, dsq's near-ties), one device call:
#   STEPS=ekmp sh DIR/f2-check.sh DIR          (from the repository root)
# DIR holds what tools/device/f2-pack.sh put there: gzipped kv-run, kv-bench,
# kv-info and test_gpu_engine built here, lib/ (libcjson) and this script.
# STEPS (each under a timeout):
#   e  test_gpu_engine, every test: the new ones are the GPU dump against the
#      CPU's (niah4k, chunked and token-by-token prefill), the sparse chunk
#      copies against the per-layer copy, and dsq's salient choice on the
#      GPU against the CPU's on the 20 niah4k 1k tasks (prints per task the
#      windows that differ and both engines' answers)
#   m  compute-sanitizer memcheck of the new tests (short form)
#   k  kv-run --device cuda --dump-kv on a niah4k prompt next to the CPU's
#      (exit status, the report's prefill object, tensors by normalized error)
#   p  the prefill of full, hybrid and hybrid-sketch at 32k and 128k with the
#      sparse copies overlapped (default) and as before (--prefill-copy sync)
# Logs in $OUT: summary.txt engine.tap sanitizer.log dump.txt
# decode-overlap.json decode-sync.json
set -u
D=${1:-build-dev-F2}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-ekmp}
. tools/device/common.sh
dev_gunzip
gpu_info
if has e; then
    engine_tests timeout 420 > "$OUT/engine.tap" 2>&1; log "test_gpu_engine* rc=$?"
    log "$(grep -c '^ok' "$OUT/engine.tap") ok, $(grep -c '^not ok' "$OUT/engine.tap") not ok"
    grep -E '^not ok|^# (niah4k (dump|task|dsq)|0=full|  )' "$OUT/engine.tap" | head -60 | tee -a "$OUT/summary.txt"
fi
if has m; then
    engine_tests env KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=gpu_dump,sparse_chunk timeout 240 compute-sanitizer \
        --tool memcheck --error-exitcode 9 > "$OUT/sanitizer.log" 2>&1
    log "memcheck (dump, sparse chunk copies; short) rc=$?"
    grep -E '^not ok|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 4 | tee -a "$OUT/summary.txt"
fi
if has k; then
    # the first 1k task's haystack as the prompt text
    python3 -c "import json; print(json.loads(open('$N/tasks-dev.jsonl').readline())['input'].rsplit(chr(10) + 'Question:', 1)[0])" > "$OUT/p.txt"
    : > "$OUT/dump.txt"
    for dev in cuda cpu; do
        timeout 120 "$D/kv-run" -m $N/niah4k.bin --tokenizer $N/tok259.bin --prompt-file "$OUT/p.txt" -n 8 \
            --nq 32 --device $dev --dump-kv "$OUT/$dev.kvc" --report "$OUT/$dev.json" > /dev/null 2>> "$OUT/dump.txt"
        echo "kv-run --device $dev --dump-kv rc=$? prefill=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('prefill'))" "$OUT/$dev.json" 2>&1)" | tee -a "$OUT/dump.txt"
    done
    "$D/kv-info" --json "$OUT/cuda.kvc" > /dev/null 2>> "$OUT/dump.txt"; echo "kv-info on the GPU dump rc=$?" | tee -a "$OUT/dump.txt"
    python3 - "$OUT/cuda.kvc" "$OUT/cpu.kvc" <<'PY' 2>&1 | tee -a "$OUT/dump.txt"
import sys
sys.path.insert(0, "tests/interop")
try:
    import numpy as np
    from kvc_py import read_kvc
except Exception as e:
    print("no numpy here (%s): values not compared" % e); sys.exit(0)
_, mg, tg = read_kvc(sys.argv[1])
_, mc, tc = read_kvc(sys.argv[2])
print("metadata equal:", mg == mc, "tensor names equal:", sorted(tg) == sorted(tc))
print("tokens equal:", bool((tg["tokens"][4] == tc["tokens"][4]).all()))
worst = {}
for name, t in tc.items():
    if name == "tokens": continue
    a, b = tg[name][4].astype(np.float64), t[4].astype(np.float64)
    e = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    kind = name.rsplit(".", 1)[1]
    worst[kind] = max(worst.get(kind, 0.0), e)
print("worst normalized error per kind:", {k: "%.2e" % v for k, v in worst.items()})
PY
    rm -f "$OUT/cuda.kvc" "$OUT/cpu.kvc" "$OUT/p.txt"
    cat "$OUT/dump.txt" >> "$OUT/summary.txt"
fi
if has p; then
    # overlap first: if a warm machine helps the later run, it helps "sync"
    for mode in overlap sync; do
        log "kv-bench decode --context prefill --prefill-copy $mode"
        timeout 280 "$D/kv-bench" decode --json --context prefill -c "${PCTX:-32768,131072}" \
            --policies "${PPOL:-full,hybrid,hybrid-sketch}" -n 16 --warmup 2 --nofetch-tokens 0 \
            --prefill-copy $mode > "$OUT/decode-$mode.json" 2>> "$OUT/summary.txt"; log "rc=$?"
    done
    python3 - "$OUT/decode-overlap.json" "$OUT/decode-sync.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
runs = {}
for path in sys.argv[1:]:
    try: d = json.load(open(path))
    except Exception as e: print(path, "no JSON:", e); continue
    for c in d["contexts"]:
        for p, r in c["policies"].items():
            pf = r.get("prefill", {})
            runs[(c["T"], p, d.get("prefill_copy"))] = pf.get("prefill_ms")
for (T, p, mode) in sorted(k for k in runs if k[2] == "overlap"):
    o, s = runs[(T, p, "overlap")], runs.get((T, p, "sync"))
    fo, fs = runs.get((T, "full", "overlap")), runs.get((T, "full", "sync"))
    print("%7d %-14s prefill ms: overlap %s, sync %s; over full: overlap %s, sync %s" % (
        T, p, o, s, None if o is None or fo is None else round(o - fo, 1),
        None if s is None or fs is None else round(s - fs, 1)))
PY
fi
log "end"
