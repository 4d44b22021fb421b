#!/bin/sh
# Run on the GPU machine (device `run` tool) from the repository root:
#   sh tools/device/prefill.sh [DIR]
# The chunked-prefill kernels' checks and benchmark (issue 9), with binaries
# built on the development machine and carried in DIR (default
# build-dev-F): DIR/kv-bench, DIR/test_cuda_prefill, DIR/lib (libcjson,
# libzstd) and DIR/prefill_peer.py.  Steps (each under a timeout, STEPS
# selects: t tests, e the engine test (DIR/test_gpu_engine, when carried),
# s sanitizers, b kv-bench prefill, d kv-bench decode --context both,
# p PyTorch peer, a SASS opcode counts): the unit test; compute-sanitizer memcheck and
# racecheck on its short form; kv-bench prefill (every attention variant
# alone, then the prefill at each context); the peer.  Logs in $OUT (at most
# 8 files): summary.txt tests.tap engine.tap sanitizer.log variants.json
# prefill.json decode.json peer.json (the benches' stderr in summary.txt's tail)
set -u
D=${1:-build-dev-F}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-tesbdpa}
CTX=${CTX:-8192,32768,131072}
. tools/device/common.sh
dev_gunzip # binaries may travel gzipped (the carried tree is limited to 64 MiB)
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv;
  nvcc --version | tail -1; ls /usr/local/cuda/lib64/libcublas.so* 2>&1 | head -2; } 2>&1 | tee -a "$OUT/summary.txt"
if has t; then
    log "test_cuda_prefill"
    timeout 300 "$D/test_cuda_prefill" > "$OUT/tests.tap" 2>&1; log "rc=$?"
    grep -v '^ok' "$OUT/tests.tap" | head -40 | tee -a "$OUT/summary.txt"
    log "$(grep -c '^ok' "$OUT/tests.tap") ok, $(grep -c '^not ok' "$OUT/tests.tap") not ok"
fi
if has e && [ -x "$D/test_gpu_engine" ]; then
    # the GPU engine against the CPU engine, now prefilling in chunks
    log "test_gpu_engine (chunked prefill)"
    engine_tests timeout 300 > "$OUT/engine.tap" 2>&1; log "rc=$?"
    grep -v '^ok' "$OUT/engine.tap" | head -30 | tee -a "$OUT/summary.txt"
    log "$(grep -c '^ok' "$OUT/engine.tap") ok, $(grep -c '^not ok' "$OUT/engine.tap") not ok"
fi
if has s; then
    log "memcheck (short)"
    KV_TEST_SHORT=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$D/test_cuda_prefill" > "$OUT/sanitizer.log" 2>&1; log "memcheck rc=$?"
    grep -E '^(ok|not ok)|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 8 | tee -a "$OUT/summary.txt"
    log "racecheck (short, attention)"
    KV_TEST_SHORT=1 KV_TEST_FILTER=attention timeout 240 compute-sanitizer --tool racecheck \
        --error-exitcode 9 "$D/test_cuda_prefill" >> "$OUT/sanitizer.log" 2>&1; log "racecheck rc=$?"
    grep -E '^(ok|not ok)|ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -n 6 | tee -a "$OUT/summary.txt"
fi
if has b; then
    # every attention variant alone at 32k (one layer's prefill alongside), the best one kept
    log "kv-bench prefill --variants at 32768"
    timeout 200 "$D/kv-bench" prefill --json -c 32768 --layers 1 --reps 1 --gemm 0 --variants \
        > "$OUT/variants.json" 2> /tmp/prefill.err; log "rc=$?"
    BEST=$(python3 - "$OUT/variants.json" <<'PY'
import json, sys
try:
    v = json.load(open(sys.argv[1]))["contexts"][0]["variants"]
    names = list(v)
    print(max(range(1, len(names)), key=lambda i: v[names[i]]["tflops"]))
except Exception:
    print(0)
PY
)
    python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['contexts'][0]['variants']; print('variants at 32k, TFLOP/s:', {k: x['tflops'] for k, x in v.items()})" "$OUT/variants.json" 2>&1 | tee -a "$OUT/summary.txt"
    # chunk sizes at 128k on 4 layers, the fastest kept
    BC=4096; BMS=
    for c in ${CHUNKS:-4096 8192 16384}; do
        timeout 100 "$D/kv-bench" prefill --json -c 131072 --layers 4 --reps 1 --gemm 0 --no-alone \
            --variant ${VARIANT:-$BEST} --chunk $c > "$OUT/chunk.json" 2>> /tmp/prefill.err
        ms=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['contexts'][0]['prefill_ms'])" "$OUT/chunk.json" 2>/dev/null)
        echo "chunk $c: 4 layers at 131072 in $ms ms" | tee -a "$OUT/summary.txt"
        if [ -n "$ms" ] && { [ -z "$BMS" ] || python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < float(sys.argv[2]) else 1)" "$ms" "$BMS"; }; then BC=$c; BMS=$ms; fi
    done
    rm -f "$OUT/chunk.json"
    log "kv-bench prefill -c $CTX --variant ${VARIANT:-$BEST} --chunk ${CHUNK:-$BC} ${BENCH_ARGS:-}"
    timeout ${BENCH_TIMEOUT:-400} "$D/kv-bench" prefill --json -c "$CTX" --variant ${VARIANT:-$BEST} --chunk ${CHUNK:-$BC} ${BENCH_ARGS:-} \
        > "$OUT/prefill.json" 2>> /tmp/prefill.err; log "rc=$?"
    tail -n 3 /tmp/prefill.err | tee -a "$OUT/summary.txt"
    python3 - "$OUT/prefill.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
print("gemm", d["gemm_tflops"], "TF/s; cublas", d["cublas"], "; attention variant", d["attn_variant"])
for c in d["contexts"]:
    if "error" in c: print(c["T"], "ERROR", c["error"]); continue
    print("%7d prefill %9.1f ms %8.0f tok/s attn %8.1f ms %6.1f TF/s alone %6.1f TF/s other %6.1f TF/s gpu %.1f GB" % (
        c["T"], c["prefill_ms"], c["tokens_per_s"], c["attn_ms"], c["attn_tflops"], c.get("attn_alone_tflops", 0),
        c["gemm_part_tflops"], c["gpu_bytes"] / 1e9))
PY
fi
if has p; then
    log "prefill_peer.py -c $CTX"
    PYTHONUNBUFFERED=1 timeout ${PEER_TIMEOUT:-300} python3 "$D/prefill_peer.py" --contexts "$CTX" ${PEER_ARGS:-} \
        > "$OUT/peer.json" 2>> /tmp/prefill.err; log "rc=$?"
    python3 - "$OUT/peer.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
print("torch", d["torch"], "gemm", round(d["gemm_tflops"], 1), "TF/s")
for c in d["contexts"]:
    if "error" in c: print(c["T"], "ERROR", c["error"]); continue
    print("%7d prefill %9.1f ms %8.0f tok/s sdpa %6.1f TF/s finite %s peak %.1f GB" % (
        c["T"], c["prefill_ms"], c["tokens_per_s"], c["sdpa_tflops"], c["finite"], c["peak_bytes"] / 1e9))
PY
fi
if has d; then
    # decode after a real (chunked) prefill against a synthesized context, per placement
    log "kv-bench decode --context both ${DECODE_ARGS:--c 32768,131072 -n 32 --offload-tokens 8}"
    timeout ${DECODE_TIMEOUT:-400} "$D/kv-bench" decode --json --context both \
        ${DECODE_ARGS:--c 32768,131072 -n 32 --offload-tokens 8} > "$OUT/decode.json" 2>> /tmp/prefill.err
    log "rc=$?"
    python3 - "$OUT/decode.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
for c in d["contexts"]:
    for p, r in c["policies"].items():
        if "error" in r: print(c["T"], p, "ERROR", r["error"]); continue
        pf = r.get("prefill", {})
        print("%7d %-14s synth %8.3f ms/tok, after prefill %8.3f (%.4fx); prefill %9.1f ms %8.0f tok/s attn %6.1f TF/s" % (
            c["T"], p, r["ms_per_token"], pf.get("ms_per_token", 0), pf.get("over_synthesized", 0),
            pf.get("prefill_ms", 0), pf.get("tokens_per_s", 0), pf.get("attn_tflops", 0)))
for k, v in d.get("targets", {}).items():
    if "prefill" in k: print(k, v)
PY
fi
if has a; then
    cuobjdump --dump-sass "$D/kv-bench" 2>/dev/null | awk '
        /Function :/ { f = ($0 ~ /pf_attn_kernel|pf_wgp?_kernel/) ? $0 : "" }
        f != "" && /HMMA|HGMMA|LDSM|LDL|STL|MUFU|LDGSTS|BAR/ { split($0, a, /[ ;]+/); for (i in a) if (a[i] ~ /^(HMMA|HGMMA|LDSM|LDL|STL|MUFU|LDGSTS|BAR)/) { sub(/\..*/, "", a[i]); n[f, a[i]]++ } }
        END { for (k in n) { split(k, p, SUBSEP); print substr(p[1], 1, 120), p[2], n[k] } }' | sort > /tmp/sass.txt
    log "SASS (attention kernels, static counts): $(wc -l < /tmp/sass.txt) lines"
    grep -E "LDL|STL" /tmp/sass.txt | sed 's/^/  local memory: /' | tee -a "$OUT/summary.txt"
    grep -E "wgp_kernelILi0ELi0ELi128" /tmp/sass.txt | tee -a "$OUT/summary.txt"
fi
