#!/bin/sh
# The lead's device round (session 5): one call serves every helper that
# has asked for one.  A helper fills build-dev-X/ (ignored) with its packed
# binaries (tools/device/pack.sh), its own script run.sh and a file READY
# holding its time cap in seconds; the lead carries those folders and runs,
# from the repository root:
#   sh tools/device/round.sh build-dev-X build-dev-Y ...
# Each helper's script runs as  OUT=$W/X sh build-dev-X/run.sh build-dev-X
# under `timeout CAP`; everything written comes back in $OUT/all.tgz, which
# is refreshed after each helper so that a call cut short keeps the rest.
set -u
FINAL=${OUT:-/tmp/kv-out}
W=${W:-/tmp/kv-round}
mkdir -p "$W" "$FINAL"
export PATH="$PATH:/usr/local/cuda/bin"
snap() {
    find "$W" -name '*.log' -size +4M -delete
    tar czf "$FINAL/all.tgz" -C "$W" . && cp "$W/summary.txt" "$FINAL/"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > "$W/summary.txt" 2>&1
for d in "$@"; do
    d=${d%/}
    x=${d#build-dev-}
    [ -f "$d/READY" ] || { echo "== $x: no READY" >> "$W/summary.txt"; continue; }
    cap=$(head -c 8 "$d/READY" | tr -cd 0-9)
    [ -n "$cap" ] || cap=60
    mkdir -p "$W/$x"
    echo "== $x start $(date -u +%H:%M:%S) cap ${cap}s" >> "$W/summary.txt"
    if [ -f "$d/bins.tar.xz" ]; then sh tools/device/unpack.sh "$d" >> "$W/$x/stdout.txt" 2>&1; fi
    env OUT="$W/$x" LD_LIBRARY_PATH="$PWD/$d/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" \
        timeout -k 5 "$cap" sh "$d/run.sh" "$d" >> "$W/$x/stdout.txt" 2>&1
    echo "== $x rc=$? end $(date -u +%H:%M:%S)" >> "$W/summary.txt"
    snap
done
echo "== end $(date -u +%H:%M:%S)" >> "$W/summary.txt"
snap
