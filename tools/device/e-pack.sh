#!/bin/sh
# Fill DIR with what tools/device/e-check.sh needs on the GPU machine:
#   sh tools/device/e-pack.sh DIR        e.g. /work/main/build-dev-E
# then run there (carry DIR, from the repository root):
#   STEPS=gmks sh DIR/e-check.sh DIR
# The CUDA binaries come from a build for sm_90 only with size-compressed
# fatbins (27 MB of kernels -> under 2 MB), in its own tree:
#   make B=build-dev BINDIR=bin-dev NVCC_ARCH='-gencode arch=compute_90,code=sm_90' \
#       NVCCFLAGS='-O3 -std=c++17 -Xcompiler -fPIC -lineinfo --compress-mode=size' \
#       bin-dev/kv-run build-dev/unit/test_gpu_engine
# and kv-convert (CPU work only) from any build.  Binaries are stripped and
# gzipped; the device has no libcjson, so it travels in DIR/lib; the GGUF
# fixtures main may not have yet travel in DIR/data.  DIR must stay under
# 15 MB (the carried tree is limited to 64 MiB for everyone).
set -eu
D=${1:?usage: e-pack.sh DIR}
B=${B:-build-dev}
BIN=${BINDIR:-bin-dev}
CONV=${CONV:-bin-cpu/kv-convert}
rm -rf "$D"
mkdir -p "$D/lib" "$D/data"
for f in "$BIN/kv-run" "$B"/unit/test_gpu_engine* "$CONV"; do
    [ -x "$f" ] || { echo "e-pack: $f is missing (see the build line at the top of this script)" >&2; exit 66; }
    strip -o "$D/$(basename "$f")" "$f"
    gzip -9 -f "$D/$(basename "$f")"
done
for f in tests/data/niah4k/niah4k-q4_k.gguf tests/data/stories260K/stories260K-q8_0.gguf \
         tests/data/stories260K/stories260K-qwen2-bf16.gguf tests/data/gguf/llama3-vocab.gguf; do
    gzip -9 -c "$f" > "$D/data/$(basename "$f").gz"
done
# the file itself, not a link: the device tool does not carry links
cp -L /usr/lib/x86_64-linux-gnu/libcjson.so.1 "$D/lib/libcjson.so.1"
cp tools/device/e-check.sh "$D/"
kb=$(du -sk "$D" | cut -f1)
echo "e-pack: $D holds $kb KB"
[ "$kb" -le 15360 ] || { echo "e-pack: $D is over 15 MB" >&2; exit 70; }
