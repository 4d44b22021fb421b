#!/bin/sh
# Fill DIR with what tools/device/h-check.sh needs on the GPU machine, from
# this tree's CUDA build (binaries in $BINDIR, unit tests in $B/unit):
#   B=build-cuda BINDIR=bin-cuda sh tools/device/h-pack.sh DIR     e.g. /work/main/build-dev-H
# then, in one device call (carry DIR):  sh DIR/h-check.sh DIR
# Binaries are stripped and xz-compressed (gzip leaves the CUDA fatbins at
# 7.4 MB each; xz -9e makes them 4 MB, keeping DIR under 15 MB); the device has
# no libcjson, so it travels in DIR/lib; the request generator travels too
# (a device run ships /work/main's tree, not this one).
set -eu
D=${1:?usage: h-pack.sh DIR}
B=${B:-build}
BIN=${BINDIR:-bin}
rm -rf "$D"
mkdir -p "$D/lib"
for f in "$BIN/kv-run" "$BIN/kv-bench" "$BIN/kv-tree" "$B/unit/test_gpu_prefix"; do
    [ -x "$f" ] || { echo "h-pack: $f is missing (build with CUDA first: make B=$B BINDIR=$BIN)" >&2; exit 66; }
    strings "$f" | grep -q cudaGetDeviceCount || { echo "h-pack: $f is not a CUDA build" >&2; exit 65; }
    strip -o "$D/$(basename "$f")" "$f"
    xz -9e -T1 -f "$D/$(basename "$f")"
done
# the file itself, not a link: the device tool does not carry links
cp -L /usr/lib/x86_64-linux-gnu/libcjson.so.1 "$D/lib/libcjson.so.1"
cp tools/device/h-check.sh tools/prefix-requests.py "$D/"
du -sh "$D"
kb=$(du -sk "$D" | cut -f1)
[ "$kb" -le 15360 ] || { echo "h-pack: $D is ${kb} KiB, over 15 MB" >&2; exit 73; }
