#!/bin/sh
# Session 9, issue 11: time to first token and needle accuracy from one run
# on the H200, with niah4k widened to Llama-3.1-8B's shape (kv_widen.h:
# the 8B's GEMMs, attention and K/V bytes, niah4k's logits).  Per seed
# (SEEDS, default 1 2 3 4): 8 niah4k requests of ~3,930 tokens sharing
# ~88% (request 0 inserts and is not scored: 28 scored per mode), every
# mode, uncompressed disk chunks; --insert 1 (INSERT=all to insert every
# request; MODES, default all; EXTRA: more kv-bench prefix options; TAG
# names this pass's files, so that passes can share one OUT).  Then,
# unless STEPS lacks s, the synthetic 8B at 32k as in
# I11's section, for the same call's reference.
# From the repository root:  OUT=DIR sh tools/device/lead-9w.sh DIR
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
STEPS=${STEPS:-ws}
SEEDS=${SEEDS:-1 2 3 4}
MODES=${MODES:-all}
EXTRA=${EXTRA:-}
TAG=${TAG:-wide}
BUDGET=${BUDGET:-560}
. tools/device/common.sh
L="$OUT/logs"
mkdir -p "$L/tmp"
export TMPDIR="$L/tmp"
unpack_once
[ -x "$D/kv-bench" ] || { log "no binaries in $D (see unpack.log)"; exit 66; }
T0=$(date +%s)
left() { [ $(( $(date +%s) - T0 + $1 )) -le "$BUDGET" ] || { log "skipped: $2 (budget)"; return 1; }; }
pack() { rm -rf "$L/tmp"/*; tar czf "$OUT/lead9w-$TAG.tgz" -C "$L" . 2>/dev/null; }
ins="--insert 1"
[ "${INSERT:-1}" = all ] && ins=""
gpu_info
if has w; then
    for sd in $SEEDS; do
        left 100 "widened seed $sd" || continue
        python3 tools/prefix-requests.py niah --tasks $N/tasks-dev.jsonl --length 3900 -n 8 --seed "$sd" > "$L/r$sd.jsonl"
        timeout 100 "$D/kv-bench" prefix --json -m $N/niah4k.bin --widen llama-3.1-8b --device cuda -n 8 \
            --gpu-bytes 16G --host-bytes 32G --zstd 0 $ins --modes "$MODES" $EXTRA "$L/r$sd.jsonl" \
            > "$L/$TAG-s$sd.json" 2> "$L/$TAG-s$sd.err"
        log "kv-bench prefix --widen llama-3.1-8b $TAG seed $sd rc=$?"
        tail -n 3 "$L/$TAG-s$sd.err" >> "$OUT/summary.txt"
        python3 tools/device/prefix_summary.py "$L/$TAG-s$sd.json" | tee -a "$OUT/summary.txt"
        pack
    done
fi
if has s && left 90 "synthetic 8B 32k"; then
    python3 tools/prefix-requests.py synthetic --vocab 128256 --length 32768 --shared 0.9 -n 3 > "$L/synth.jsonl"
    timeout 90 "$D/kv-bench" prefix --json --synthetic llama-3.1-8b --device cuda -n 2 --gpu-bytes 16G --host-bytes 32G \
        --zstd 0 --insert 1 --put-queries 0 --modes all "$L/synth.jsonl" > "$L/synth.json" 2> "$L/synth.err"
    log "kv-bench prefix synthetic 8B 32k rc=$?"
    python3 tools/device/prefix_summary.py "$L/synth.json" | tee -a "$OUT/summary.txt"
    pack
fi
log "end, $(( $(date +%s) - T0 )) s"
