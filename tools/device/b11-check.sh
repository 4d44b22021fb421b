#!/bin/sh
# Helper B7's device step (issue 11, session 7: GPU --kv of KIVI/DSQ-packed
# caches; TTFT and needle accuracy of prefix reuse on the GPU), one round of
# at most CAP seconds, run from the repository root after the round unpacked
# the binaries into DIR:   OUT=dir sh DIR/run.sh DIR   (this file is DIR/run.sh)
# STEPS (default tnsipmc), in this order, each under a timeout inside the cap
# (a step that no longer fits is skipped and says so):
#   t  test_gpu_kv (packed caches continued on the GPU vs the CPU and the whole prompt)
#   n  kv-bench prefix on niah4k, 8 requests of ~3,930 tokens sharing ~88%, every
#      request inserted (the brief's command), seeds $SEEDS, uncompressed chunks
#   s  the same with --sketch-serial (disk-query reads the sketch before its probe)
#   i  the same with --insert 1 (requests after the first have no dump capture:
#      full is a plain prefill); n, s and i interleaved per seed
#   p  test_gpu_prefix (the plain --kv round trips)
#   m  test_gpu_kv's DSQ and head_dim-128 KIVI tests under compute-sanitizer memcheck (leaks too)
#   c  kv-run --device cuda --kv of a KIVI-packed niah4k cache (report layers)
# Results: $OUT/summary.txt and $OUT/b11.tgz (every log and JSON).
set -u
D=${1:-build-dev-B}
OUT=${OUT:-/tmp/kv-b11}
STEPS=${STEPS:-tnsipmc}
SEEDS=${SEEDS:-1 2 3 4}
CAP=${CAP:-76}
mkdir -p "$OUT"
W="$OUT/w"
mkdir -p "$W/tmp"
T0=$(date +%s)
export TMPDIR="$W/tmp"
N=tests/data/niah4k
PY=python3
S="$OUT/summary.txt"
log() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" | tee -a "$S"; }
has() { case "$STEPS" in *$1*) return 0;; esac; return 1; }
left() { echo $(( CAP - ($(date +%s) - T0) )); }
upto() { # seconds for the next step: what is left, at most $1; 0 when under $2 (default 6) is left
    l=$(left); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt "${2:-6}" ] && l=0; echo "$l"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } 2>&1 | tee -a "$S"
tap() { grep -E '^(not )?ok|^# ' "$1" | head -24 | tee -a "$S"; }
summ() { $PY tools/device/prefix_summary.py "$1" | tee -a "$S"; } # a kv-bench prefix JSON
if has t; then
    s=$(upto 30)
    if [ "$s" -gt 0 ]; then timeout "$s" "$D/test_gpu_kv" > "$W/gpu_kv.tap" 2>&1; log "test_gpu_kv rc=$? (timeout $s)"; tap "$W/gpu_kv.tap"
    else log "test_gpu_kv skipped: no time left"; fi
fi
bench() { # tag seed extra-args...
    tag=$1 seed=$2; shift 2
    $PY tools/prefix-requests.py niah --tasks $N/tasks-dev.jsonl --length 3900 -n 8 --seed "$seed" > "$W/tmp/r$seed.jsonl"
    s=$(upto 12)
    if [ "$s" -gt 0 ]; then
        timeout "$s" "$D/kv-bench" prefix --json -m $N/niah4k.bin --device cuda -n 8 --gpu-bytes 2G --host-bytes 4G --zstd 0 \
            "$@" "$W/tmp/r$seed.jsonl" > "$W/$tag-s$seed.json" 2> "$W/$tag-s$seed.err"
        log "kv-bench prefix $tag seed $seed rc=$? (timeout $s)"; summ "$W/$tag-s$seed.json"
    else log "kv-bench prefix $tag seed $seed skipped: no time left"; fi
}
# per seed: the brief's command, the same with the sketch read before the
# probe (--sketch-serial), and --insert 1; interleaved so that a slower
# stretch of the machine hits all three
for sd in $SEEDS; do
    has n && bench niah "$sd"
    has s && bench niah-serial "$sd" --sketch-serial
    has i && bench niah-ins1 "$sd" --insert 1
done
if has p; then
    s=$(upto 15)
    if [ "$s" -gt 0 ]; then timeout "$s" "$D/test_gpu_prefix" > "$W/gpu_prefix.tap" 2>&1; log "test_gpu_prefix rc=$?"; tap "$W/gpu_prefix.tap"
    else log "test_gpu_prefix skipped: no time left"; fi
fi
if has m; then
    s=$(upto 30 15)
    if [ "$s" -gt 0 ]; then
        TEST_GPU_KV_ONLY=dsq timeout "$s" compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
            "$D/test_gpu_kv" > "$W/memcheck.log" 2>&1
        log "memcheck test_gpu_kv (dsq) rc=$? (timeout $s)"; grep -E "ERROR SUMMARY|LEAK SUMMARY|^(not )?ok" "$W/memcheck.log" | head -8 | tee -a "$S"
    else log "memcheck skipped: no time left"; fi
    s=$(upto 30 15)
    if [ "$s" -gt 0 ]; then # the quant placement packed on the GPU (head_dim 128)
        TEST_GPU_KV_ONLY=128 timeout "$s" compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
            "$D/test_gpu_kv" > "$W/memcheck128.log" 2>&1
        log "memcheck test_gpu_kv (head_dim 128) rc=$? (timeout $s)"; grep -E "ERROR SUMMARY|LEAK SUMMARY|^(not )?ok" "$W/memcheck128.log" | head -8 | tee -a "$S"
    else log "memcheck (head_dim 128) skipped: no time left"; fi
fi
if has c; then
    s=$(upto 10)
    if [ "$s" -gt 0 ]; then
        (
            set -e
            $PY -c 'import json; t=json.loads(open("'$N'/tasks-dev.jsonl").readline()); open("'$W/tmp'/p.txt","w").write(t["input"])'
            "$D/kv-run" -m $N/niah4k.bin --device cpu --prompt-file "$W/tmp/p.txt" -n 0 --dump-kv "$W/tmp/all.kvc" --kv-dtype f16
            $PY - "$W/tmp/all.kvc" "$W/tmp" <<'PY'
import json, struct, sys
b = open(sys.argv[1], 'rb').read(); n = struct.unpack('<Q', b[:8])[0]; h = json.loads(b[8:8 + n])
s, e = h['tokens']['data_offsets']; ids = struct.unpack('<%di' % ((e - s) // 4), b[8 + n + s:8 + n + e])
k = len(ids) - 40
open(sys.argv[2] + '/first.txt', 'w').write(' '.join(map(str, ids[:k])))
open(sys.argv[2] + '/rest.txt', 'w').write(' '.join(map(str, ids[k:])))
PY
            "$D/kv-run" -m $N/niah4k.bin --device cpu --tokens "$W/tmp/first.txt" -n 0 --dump-kv "$W/tmp/first.kvc" --kv-dtype f16
            "$D/kv-quant" --bits 2 --group 32 --residual 64 "$W/tmp/first.kvc" -o "$W/tmp/kivi.kvc"
            for dev in cuda cpu; do
                "$D/kv-run" -m $N/niah4k.bin --device $dev --kv "$W/tmp/kivi.kvc" --tokens "$W/tmp/rest.txt" -n 8 \
                    --policy quant:bits=1 --report "$W/kvrun-$dev.json" > "$W/kvrun-$dev.txt" 2> "$W/kvrun-$dev.err" ||
                    echo "kv-run --device $dev rc=$?"
            done
        ) > "$W/kvrun.log" 2>&1
        log "kv-run --kv packed rc=$?"
        $PY - "$W" <<'PY' | tee -a "$S"
import json, sys
for dev in ("cuda", "cpu"):
    try: j = json.load(open(sys.argv[1] + "/kvrun-%s.json" % dev))
    except Exception as e: print(dev, "no report:", e); continue
    print(dev, "ids", j.get("generated_ids"), "layers", sorted(set((l["policy"], l["params"]) for l in j["layers"])), "ttft", j.get("ttft_ms"))
PY
    else log "kv-run skipped: no time left"; fi
fi
log "done"
tar czf "$OUT/b11.tgz" -C "$W" --exclude tmp . 2>/dev/null
rm -rf "$W"
