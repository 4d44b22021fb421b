#!/bin/sh
# Helper G's device step (issue 17: select=resident and select=pages on the
# GPU engine), one device call of about 200 s (timeouts 45 + 45 + 100 + 60 s):
#   STEPS=emdr sh DIR/g-check.sh DIR          (from the repository root)
# DIR holds what tools/device/g-pack.sh put there: gzipped kv-bench and
# test_gpu_engine built here, lib/ (libcjson) and this script.
# STEPS (each under a timeout):
#   e  test_gpu_engine, the new tests and their neighbours: the resident and
#      page kernels against lib/policy/kv_select.c (rows at 16/8/4/2/1 bits,
#      pool choice, row scores; page bounds, page scores, expand + top-K;
#      eng_topk_wide against eng_topk), niah4k GPU vs CPU for
#      select=resident (fp16, 4-bit codes) and select=pages, and the existing
#      niah4k sparse and hybrid-bytes tests
#   m  compute-sanitizer memcheck of the two new tests (short form)
#   d  kv-bench decode --context prefill at 32k and 128k (synthetic
#      llama-3.1-8b): full, offload, hybrid (channels), hybrid-resident,
#      hybrid-pages, hybrid-sketch: ms/token, GPU KV bytes, pcie_hidden,
#      ratios to full and offload
#   r  kv-bench ruler --device cuda on niah4k 1k/2k/4k (RLIMIT=10 tasks per
#      length, as the CPU table in docs/BENCHMARKS.md): full and sparse at
#      frac=0.03 with select=channels, resident (fp16, 4-bit), pages, sketch
# Logs in $OUT: summary.txt engine.tap sanitizer.log decode.json ruler.json
set -u
D=${1:-build-dev-G}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-emdr}
. tools/device/common.sh
dev_gunzip
gpu_info
if has e; then
    engine_tests env KV_TEST_FILTER=resident_and_page,niah4k_resident,niah4k_sparse,hybrid_bytes timeout 45 \
        > "$OUT/engine.tap" 2>&1; log "test_gpu_engine* (filtered) rc=$?"
    log "$(grep -c '^ok' "$OUT/engine.tap") ok (skips included), $(grep -c '^not ok' "$OUT/engine.tap") not ok"
    grep -E '^not ok|^# (resident|page|niah4k)|^#   ' "$OUT/engine.tap" | head -40 | tee -a "$OUT/summary.txt"
fi
if has m; then
    engine_tests env KV_GPU_TEST_SHORT=1 KV_TEST_FILTER=resident_and_page,niah4k_resident timeout 45 compute-sanitizer \
        --tool memcheck --error-exitcode 9 > "$OUT/sanitizer.log" 2>&1
    log "memcheck (resident and page kernels, niah4k resident/pages; short) rc=$?"
    grep -E '^not ok|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 4 | tee -a "$OUT/summary.txt"
fi
if has d; then
    log "kv-bench decode --context prefill"
    timeout ${DTIME:-240} "$D/kv-bench" decode --json --context prefill -c "${DCTX:-32768,131072}" \
        --policies "${DPOL:-full,offload,hybrid,hybrid-resident,hybrid-pages,hybrid-sketch}" \
        -n 8 --warmup 2 --offload-tokens 3 --nofetch-tokens 8 > "$OUT/decode.json" 2>> "$OUT/summary.txt"
    log "rc=$?"
    python3 - "$OUT/decode.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
for c in d["contexts"]:
    P = c["policies"]
    f = P.get("full", {}).get("ms_per_token"); o = P.get("offload", {}).get("ms_per_token")
    fkv = P.get("full", {}).get("gpu_kv_bytes")
    for p, r in P.items():
        if "error" in r: print("%7d %-16s error: %s" % (c["T"], p, r["error"])); continue
        ms = r["ms_per_token"]
        print("%7d %-16s %8.3f ms/token  x full %s  offload/x %s  GPU KV %.4f of full  pcie_hidden %s  fetch_ms %s" % (
            c["T"], p, ms, None if not f else round(ms / f, 3), None if not o else round(o / ms, 1),
            r["gpu_kv_bytes"] / fkv if fkv else float("nan"), r.get("pcie_hidden"), r.get("fetch_ms")))
PY
fi
if has r; then
    S=s=8,w=32,frac=0.03
    log "kv-bench ruler --device cuda (niah4k dev tasks, 1k/2k/4k)"
    timeout 60 "$D/kv-bench" ruler --device cuda --limit "${RLIMIT:-10}" -m $N/niah4k.bin --tokenizer $N/tok259.bin --tasks $N/tasks-dev.jsonl \
        --json --no-progress -P full -P sparse:$S,select=channels -P sparse:$S,select=resident \
        -P sparse:$S,select=resident,pool=8 -P sparse:$S,select=resident,pool=32,cbits=4 \
        -P sparse:$S,select=pages -P sparse:$S,select=sketch > "$OUT/ruler.json" 2>> "$OUT/summary.txt"
    log "rc=$?"
    python3 - "$OUT/ruler.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
by = {}
for r in d.get("results", []):
    by.setdefault(r.get("policy"), []).append("%d:%.2f(%dKiB/t, resident %dKiB)" % (
        r["length"], r["accuracy"], r.get("fetched_bytes_per_step", 0) // 1024, r.get("resident_bytes", 0) // 1024))
for p, v in by.items(): print("%-52s %s" % (p, " ".join(v)))
PY
fi
log "end"
