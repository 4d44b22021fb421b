#!/bin/sh
# Fill DIR (default /work/main/build-dev-D) for helper D7's device round:
# kv-bench and test_cuda_prefill from the device build (build-dv, see
# tools/device/pack.sh), stripped, in one xz tarball (tools/device/unpack.sh
# extracts it), libcjson, the PyTorch peer and the check script as run.sh.
set -eu
D=${1:-/work/main/build-dev-D}
B=${B:-build-dv}
BIN=${BINDIR:-build-dv/bin}
rm -rf "$D"
mkdir -p "$D/lib" "$D/stage"
strip -o "$D/stage/kv-bench" "$BIN/kv-bench"
strip -o "$D/stage/test_cuda_prefill" "$B/unit/test_cuda_prefill"
(cd "$D/stage" && tar cf - .) | xz -9 -T1 > "$D/bins.tar.xz"
rm -rf "$D/stage"
cp -L /usr/lib/x86_64-linux-gnu/libcjson.so.1 "$D/lib/libcjson.so.1"
cp tools/device/prefill_peer.py "$D/prefill_peer.py"
cp tools/device/d9-check.sh "$D/run.sh"
du -sh "$D"
