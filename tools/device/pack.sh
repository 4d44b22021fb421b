#!/bin/sh
# Fill DIR with one set of binaries for a device call, from a CUDA build of
# this tree made for the device alone (sm_90 SASS, no PTX, so the carried
# tree stays under the device tool's 64 MiB):
#   make -j2 B=build-dv BINDIR=build-dv/bin NVCC_ARCH="-gencode arch=compute_90,code=sm_90"
#   sh tools/device/pack.sh build-dev              (B=build-dv BINDIR=build-dv/bin by default)
# (and, to carry the diagnostic too, first:
#   nvcc -O2 -arch=sm_90 -o build-dv/bin/h2d_probe tools/device/h2d_probe.cu -lpthread)
# Every tool, every CUDA/GPU unit test, libcjson (the device has none); all
# stripped, in one xz tarball (its 64 MiB window finds the kernels' images
# that every binary links: 2.7 MB where gzip per file gave 23 MB).  On the
# device, sh tools/device/unpack.sh DIR extracts them (tar, or Python's
# tarfile where xz is missing); the check scripts (tools/device/*-check.sh)
# travel with the tree and take DIR as their first argument.
set -eu
D=${1:?usage: pack.sh DIR}
B=${B:-build-dv}
BIN=${BINDIR:-build-dv/bin}
rm -rf "$D"
mkdir -p "$D/lib" "$D/stage"
for f in "$BIN"/kv-* "$B"/unit/test_gpu_* "$B"/unit/test_cuda_* $(ls "$BIN"/h2d_probe "$BIN"/gemm_first 2>/dev/null); do
    [ -x "$f" ] || { echo "pack: $f is missing (build for the device first, see above)" >&2; exit 66; }
    strip -o "$D/stage/$(basename "$f")" "$f"
done
(cd "$D/stage" && tar cf - .) | xz -9 -T1 > "$D/bins.tar.xz"
rm -rf "$D/stage"
# the file itself, not a link: the device tool does not carry links
cp -L /usr/lib/x86_64-linux-gnu/libcjson.so.1 "$D/lib/libcjson.so.1"
du -sh "$D"
