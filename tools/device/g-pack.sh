#!/bin/sh
# Fill DIR with what tools/device/g-check.sh needs on the GPU machine, from
# this tree's CUDA build (make; binaries in bin/ and build/unit/):
#   sh tools/device/g-pack.sh DIR       e.g. /work/main/build-dev-G
# then run there (carry DIR):  STEPS=emdr sh DIR/g-check.sh DIR
# Binaries are stripped and gzipped (the carried tree is limited to 64 MiB);
# the device has no libcjson, so it travels in DIR/lib.
set -eu
D=${1:?usage: g-pack.sh DIR}
B=${B:-build}
BIN=${BINDIR:-bin}
mkdir -p "$D/lib"
for f in "$BIN/kv-bench" "$B"/unit/test_gpu_engine*; do
    [ -x "$f" ] || { echo "g-pack: $f is missing (build with CUDA first: make)" >&2; exit 66; }
    strip -o "$D/$(basename "$f")" "$f"
    gzip -9 -f "$D/$(basename "$f")"
done
# the file itself, not a link: the device tool does not carry links
cp -L /usr/lib/x86_64-linux-gnu/libcjson.so.1 "$D/lib/libcjson.so.1"
cp tools/device/g-check.sh "$D/"
du -sh "$D"
