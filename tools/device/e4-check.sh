#!/bin/sh
# Helper E4's device step (issue 13: the packed decode GEMV at memory speed),
# one device call of about 100 s (150 s at most), from the repository root,
# after the lead's single pack is unpacked:
#   sh tools/device/unpack.sh build-dev && sh tools/device/e4-check.sh build-dev
# DIR holds kv-run, kv-bench, kv-convert, test_gpu_engine (CUDA, sm_90) and
# lib/libcjson.so.1 (tools/device/pack.sh).
# STEPS (default bgms, each under its own timeout):
#   b  kv-bench gemv --json: Q8_0, Q4_K, Q6_K and F16 on the Llama-3.2-1B
#      shapes (2048x2048, 512x2048, 8192x2048, 2048x8192, 128256x2048), every
#      variant of kernels/eng_gemv_qv.cu (old, rows, dp4a), each first
#      checked against the CPU reference (normalized error), then timed
#      against the copy bandwidth of the same run
#   g  test_gpu_engine KV_TEST_FILTER=packed: every variant against
#      kv_quants' CPU reference (float64 and kv_quant_dot_ref), the
#      dequantization and embedding rows, the packed models through the whole
#      GPU engine (default variant) against the CPU engine
#   m  compute-sanitizer memcheck: the packed kernel test (short) and
#      kv-bench gemv on ragged shapes (37 and 301 rows: rows past the last
#      warp's four; 800 columns of Q8_0: a partial warp in the int8 rounding)
#   s  decode tokens/s on the GPU: the synthetic Llama-3.2-1B in Q4_K (Q6_K
#      embedding and classifier) with each --gemv-variant, against F16
#      (e-check.sh's step s, one run per variant)
# Logs in $OUT: summary.txt gemv.json engine.tap sanitizer.log speed-*.json
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-bgms}
mkdir -p "$OUT"
chmod +x "$D"/kv-* "$D"/test_* 2>/dev/null
. tools/device/common.sh
W=${TMPDIR:-/tmp}/kv-e4
mkdir -p "$W"
gpu_info
if has b; then
    timeout 60 "$D/kv-bench" gemv --json > "$OUT/gemv.json" 2>> "$OUT/summary.txt"
    log "kv-bench gemv rc=$?"
    python3 - "$OUT/gemv.json" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("no gemv.json:", e); sys.exit(0)
c = j["copy_bytes_per_s"]
print("%s; copy %.0f GB/s (read + write)" % (j["device"]["name"], c / 1e9))
print("%-5s %12s %-5s %9s %8s %8s %8s %8s %10s" % ("type", "shape", "kern", "us", "GB/s", "of copy", "vs old", "vs f16", "err"))
best = {}
for r in j["results"]:
    print("%-5s %12s %-5s %9.2f %8.0f %7.1f%% %7.2fx %7.2fx %10s" % (r["type"], "%dx%d" % (r["rows"], r["cols"]),
          r["variant"], r["us"], r["bytes_per_s"] / 1e9, 100 * r["frac_of_copy"], r.get("speedup_vs_old", 0),
          r.get("speedup_vs_f16", 0), "%.2e" % r["err_vs_cpu"] if "err_vs_cpu" in r else "-"))
    if r["variant"] != "f16":
        k = (r["type"], r["variant"])
        best.setdefault(k, []).append(r["frac_of_copy"])
for (t, v), f in sorted(best.items()):
    print("%-5s %-5s of copy: min %.1f%%, mean %.1f%% over %d shapes (target >= 60%%)" % (
        t, v, 100 * min(f), 100 * sum(f) / len(f), len(f)))
PY
fi
if has g; then
    engine_tests env KV_TEST_FILTER=packed timeout 60 > "$OUT/engine.tap" 2>&1
    log "test_gpu_engine (packed) rc=$?"
    log "$(grep -c '^ok' "$OUT/engine.tap") ok ($(grep -c '# SKIP not selected' "$OUT/engine.tap") not selected), $(grep -c '^not ok' "$OUT/engine.tap") not ok"
    grep -E '^not ok|^# (gemv|niah4k|stories260K|tiny)|^#   ' "$OUT/engine.tap" | head -60 | tee -a "$OUT/summary.txt"
fi
if has m; then
    engine_tests env KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=packed_kernels timeout 30 compute-sanitizer \
        --tool memcheck --error-exitcode 9 > "$OUT/sanitizer.log" 2>&1
    log "memcheck test_gpu_engine (packed kernels; short) rc=$?"
    grep -E '^not ok|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 4 | tee -a "$OUT/summary.txt"
    timeout 30 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/kv-bench" gemv --json --iters 1 --reps 1 \
        --types q8_0,q4_k,q6_k --shapes 37x2048,301x256 > "$W/m1.json" 2>> "$OUT/sanitizer.log"
    log "memcheck kv-bench gemv 37x2048,301x256 rc=$?"
    timeout 20 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/kv-bench" gemv --json --iters 1 --reps 1 \
        --types q8_0 --shapes 5x800 > "$W/m2.json" 2>> "$OUT/sanitizer.log"
    log "memcheck kv-bench gemv q8_0 5x800 rc=$?"
    grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 3 | tee -a "$OUT/summary.txt"
    python3 -c "
import json, sys
for p in sys.argv[1:]:
    try: j = json.load(open(p))
    except Exception as e: print(p, 'no JSON:', e); continue
    print('  under memcheck, worst err_vs_cpu per variant:', {v: '%.2e' % max(r['err_vs_cpu'] for r in j['results'] if r['variant'] == v) for v in sorted({r['variant'] for r in j['results']})})
" "$W/m1.json" "$W/m2.json" | tee -a "$OUT/summary.txt"
fi
if has s; then
    log "kv-convert --synthetic llama-3.2-1b --type Q4_K --embd-type Q6_K"
    timeout 40 "$D/kv-convert" -q --synthetic llama-3.2-1b --vocab tests/data/gguf/llama3-vocab.gguf --type Q4_K \
        --embd-type Q6_K -o "$W/1b-q4k.gguf" 2>> "$OUT/summary.txt"
    log "rc=$? $(ls -l "$W/1b-q4k.gguf" 2>/dev/null | awk '{print $5}') bytes"
    for run in "q4k-old -m $W/1b-q4k.gguf --gemv-variant old" "q4k-rows -m $W/1b-q4k.gguf --gemv-variant rows" \
               "q4k-dp4a -m $W/1b-q4k.gguf --gemv-variant dp4a" "q4k-default -m $W/1b-q4k.gguf" \
               "f16 --synthetic llama-3.2-1b --weights f16"; do
        set -- $run
        name=$1; shift
        timeout 20 "$D/kv-run" "$@" --device cuda --random-prompt 64 -n 256 --temp 0 -c 512 \
            --report "$OUT/speed-$name.json" > /dev/null 2>> "$OUT/summary.txt"
        log "kv-run $* --device cuda rc=$?"
    done
    python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
r = {}
for name in ("q4k-old", "q4k-rows", "q4k-dp4a", "q4k-default", "f16"):
    try: d = json.load(open("%s/speed-%s.json" % (sys.argv[1], name)))
    except Exception as e: print(name, "no report:", e); continue
    r[name] = d
    print("%-12s decode %.1f tok/s, median %.3f ms/token, p90 %.3f ms" % (
        name, d["tokens_per_s"], d["ms_per_token_median"], d["ms_per_token_p90"]))
if "f16" in r:
    for name in r:
        if name != "f16":
            print("%-12s over F16: %.2fx tokens/s (target >= 1.5x)" % (name, r[name]["tokens_per_s"] / r["f16"]["tokens_per_s"]))
ids = {n: d.get("generated_ids") for n, d in r.items() if n != "f16"}
if "q4k-old" in ids:
    for n, g in ids.items():
        a = ids["q4k-old"]
        same = next((i for i, (x, y) in enumerate(zip(g or [], a or [])) if x != y), min(len(g or []), len(a or [])))
        print("%-12s greedy ids equal to old's for %d of %d steps" % (n, same, len(a or [])))
PY
    rm -f "$W/1b-q4k.gguf"
fi
log "end"
