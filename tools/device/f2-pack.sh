#!/bin/sh
# Fill DIR with what tools/device/f2-check.sh needs on the GPU machine, from
# this tree's CUDA build (make; binaries in bin/ and build/unit/):
#   sh tools/device/f2-pack.sh DIR       e.g. /work/main/build-dev-F2
# then run there (carry DIR):  STEPS=ekmp sh DIR/f2-check.sh DIR
# Binaries are stripped and gzipped (the carried tree is limited to 64 MiB);
# the device has no libcjson, so it travels in DIR/lib.
set -eu
D=${1:?usage: f2-pack.sh DIR}
B=${B:-build}
BIN=${BINDIR:-bin}
mkdir -p "$D/lib"
for f in "$BIN/kv-run" "$BIN/kv-bench" "$BIN/kv-info" "$B"/unit/test_gpu_engine*; do
    [ -x "$f" ] || { echo "f2-pack: $f is missing (build with CUDA first: make)" >&2; exit 66; }
    strip -o "$D/$(basename "$f")" "$f"
    gzip -f "$D/$(basename "$f")"
done
# the file itself, not a link: the device tool does not carry links
cp -L /usr/lib/x86_64-linux-gnu/libcjson.so.1 "$D/lib/libcjson.so.1"
cp tools/device/f2-check.sh "$D/"
du -sh "$D"
