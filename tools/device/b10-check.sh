#!/bin/sh
# Helper B10's device round (issue 10, batched decode), within 150 s:
#   OUT=DIR sh tools/device/b10-check.sh build-dev-B10     (from the repository root,
#   after sh tools/device/unpack.sh build-dev-B10; tools/device/pack.sh made the folder)
# (round 5 ran it as STEPS=tkfqlh TTIME=40 HTIME=50 HCAP=12, from a copy in the folder)
# STEPS (each under its own timeout):
#   t  test_gpu_batch: the batched GEMV against eng_gemv (bit for bit) and float64,
#      batched greedy decodes (tiny and the synthetic 8B, every placement mixed, each
#      sequence at its own length) equal to each sequence decoded alone; cuBLAS close
#   m  compute-sanitizer memcheck of test_gpu_batch (short form: kernels, tiny model)
#   s  kv-bench decode --batch 1,4,16 at 4k (gemv for 1 and 4, cublas for 16)
#   x  kv-bench decode --batch max at 32k: full, quant (2-bit), hybrid-resident in one run
#   k  kv-run --batch on the GPU (stories260K, --gemm gemv and cublas) against each
#      prompt run alone on the GPU: the texts must be equal with gemv
#   f, q, h  kv-bench decode --batch max at 32k, one run each: full, quant (2-bit),
#      hybrid-resident (variants HVAR, default base; at most HCAP sequences)
#   g  the batched GEMV against cuBLAS at 4k, full: --gemm gemv and cublas at 1..32 sequences
#   l  kv-bench decode --batch max at 128k: full and quant
# Logs in $OUT: summary.txt batch.tap memcheck.log small.json max32k.json kvrun.txt gemm-*.json max-128k.json
#   max-full.json max-quant.json max-hybrid.json (each with its .err, -v notes)
set -u
D=${1:-build-dev-B10}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-tmsx}
. tools/device/common.sh
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; free -g | head -2; } 2>&1 | tee -a "$OUT/summary.txt"
summarize() {
    python3 - "$1" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
d = json.load(open(sys.argv[1]))
print(d["device"], d["date"], "gemm", d["gemm"])
for c in d["contexts"]:
    for p, runs in c["policies"].items():
        for r in runs:
            if "error" in r:
                print(c["T"], p, r["asked"], "ERROR", r["error"]); continue
            print("%6d %-16s asked %-4s B %4d %-6s %9.3f ms/step %9.1f tok/s  gpu KV %6.2f GiB host %6.2f GiB  per-seq %6.3f GiB  used %6.1f GiB  %s  setup %.1fs" % (
                c["T"], p, r["asked"], r["batch"], r["bound"], r["ms_per_step"], r["tokens_per_s"],
                r["gpu_kv_bytes"] / 2**30, r["host_kv_bytes"] / 2**30, r["gpu_bytes_per_seq"] / 2**30,
                r["gpu_used_bytes"] / 2**30, r["gemm"], r["setup_s"]))
    print("best", json.dumps(c["best"]))
PY
}
if has t; then
    timeout ${TTIME:-50} "$D/test_gpu_batch" > "$OUT/batch.tap" 2>&1; log "test_gpu_batch rc=$?"
    log "$(grep -c '^ok' "$OUT/batch.tap") ok, $(grep -c '^not ok' "$OUT/batch.tap") not ok"
    grep -E '^not ok|^#' "$OUT/batch.tap" | head -50 | tee -a "$OUT/summary.txt"
fi
if has m; then
    KV_GPU_TEST_SHORT=1 timeout ${MTIME:-30} compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$D/test_gpu_batch" > "$OUT/memcheck.log" 2>&1
    log "memcheck test_gpu_batch (short) rc=$?"
    grep -E '^not ok|ERROR SUMMARY' "$OUT/memcheck.log" | tail -n 4 | tee -a "$OUT/summary.txt"
fi
if has s; then
    # 1 and 4 sequences on the batched GEMV, 16 on cuBLAS (--gemm auto)
    timeout ${STIME:-25} "$D/kv-bench" decode --batch 1,4,16 --contexts 4096 --policies full,quant,hybrid-resident \
        --steps 8 --warmup 2 --json > "$OUT/small.json" 2> "$OUT/small.err"
    log "kv-bench decode --batch 1,4,16 at 4k rc=$?"
    tail -n 3 "$OUT/small.err" | tee -a "$OUT/summary.txt"
    summarize "$OUT/small.json"
fi
if has x; then
    timeout ${XTIME:-40} "$D/kv-bench" decode --batch max --contexts 32768 --policies full,quant,hybrid-resident \
        --steps 6 --warmup 2 --json > "$OUT/max32k.json" 2> "$OUT/max32k.err"
    log "kv-bench decode --batch max 32k rc=$?"
    tail -n 3 "$OUT/max32k.err" | tee -a "$OUT/summary.txt"
    summarize "$OUT/max32k.json"
fi
if has k; then
    M=tests/data/stories260K/stories260K.bin
    printf 'Once upon a time\nThe little dog\nLily went to the park and\nTom had a big red\n' > "$OUT/prompts.txt"
    : > "$OUT/kvrun.txt"
    for g in gemv cublas; do
        timeout 20 "$D/kv-run" -m $M --prompt-file "$OUT/prompts.txt" --batch 4 -n 24 --device cuda --gemm $g \
            --report "$OUT/kvrun-$g.json" > "$OUT/kvrun-$g.jsonl" 2>> "$OUT/kvrun.txt"
        log "kv-run --batch 4 --gemm $g rc=$?"
    done
    i=0
    while read -r p; do
        timeout 10 "$D/kv-run" -m $M -p "$p" -n 24 --device cuda > "$OUT/alone-$i.txt" 2>> "$OUT/kvrun.txt"
        i=$((i + 1))
    done < "$OUT/prompts.txt"
    python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys, os
o = sys.argv[1]
alone = [open(os.path.join(o, "alone-%d.txt" % i)).read().rstrip("\n") for i in range(4)]
for g in ("gemv", "cublas"):
    try:
        rows = [json.loads(l) for l in open(os.path.join(o, "kvrun-%s.jsonl" % g)) if l.strip()]
    except Exception as e:
        print("kv-run --batch", g, "unreadable:", e); continue
    same = sum(r["text"] == a for r, a in zip(rows, alone))
    print("kv-run --batch 4 --gemm %s on the GPU: %d of 4 texts equal alone" % (g, same))
    rep = json.load(open(os.path.join(o, "kvrun-%s.json" % g)))
    print("  report: how=%s ms_per_step=%.3f tokens_per_s=%.1f" % (rep["how"], rep["ms_per_step"], rep["tokens_per_s"]))
PY
fi
maxrun() { # name policies timeout extra...
    n=$1 p=$2 t=$3
    shift 3
    timeout "$t" "$D/kv-bench" decode -v --batch max --contexts 32768 --policies "$p" --steps 8 --warmup 2 --json "$@" \
        > "$OUT/max-$n.json" 2> "$OUT/max-$n.err"
    log "kv-bench decode --batch max 32k $p rc=$?"
    grep -v '^$' "$OUT/max-$n.err" | tail -n 6 | tee -a "$OUT/summary.txt"
    summarize "$OUT/max-$n.json"
}
if has g; then
    for g in gemv cublas; do
        timeout ${GTIME:-20} "$D/kv-bench" decode --batch 1,2,4,8,16,32 --contexts 4096 --policies full \
            --steps 8 --warmup 2 --gemm $g --json > "$OUT/gemm-$g.json" 2> "$OUT/gemm-$g.err"
        log "kv-bench decode --batch 1..32 at 4k full --gemm $g rc=$?"
        summarize "$OUT/gemm-$g.json"
    done
fi
has f && maxrun full full ${FTIME:-30}
has q && maxrun quant quant ${QTIME:-50}
has h && maxrun hybrid hybrid-resident ${HTIME:-50} --variants ${HVAR:-base} --batch-cap ${HCAP:-12}
if has l; then
    timeout ${LTIME:-45} "$D/kv-bench" decode -v --batch max --contexts 131072 --policies full,quant --steps 6 \
        --warmup 2 --json > "$OUT/max-128k.json" 2> "$OUT/max-128k.err"
    log "kv-bench decode --batch max 128k full,quant rc=$?"
    grep -v '^$' "$OUT/max-128k.err" | tail -n 6 | tee -a "$OUT/summary.txt"
    summarize "$OUT/max-128k.json"
fi
log "done"
