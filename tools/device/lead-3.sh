#!/bin/sh
# Lead's device call 3 (2026-12-01, after merging helpers E and G): helper
# E's checks (tools/device/e-check.sh: packed GGUF weights on the GPU, qwen2
# biases) and helper G's (tools/device/g-check.sh: resident/pages selection
# kernels, decode after a real prefill per hybrid, niah4k per selection
# mode), then every GPU unit test once.  From the repository root:
#   sh tools/device/lead-3.sh build-dev     (build-dev from tools/device/pack.sh)
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
mkdir -p "$OUT"
sh tools/device/unpack.sh "$D" || exit 66
export PATH="$PATH:/usr/local/cuda/bin"
export LD_LIBRARY_PATH="$PWD/$D/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
mkdir -p "$OUT/e" "$OUT/g"
OUT="$OUT/e" STEPS=${ESTEPS:-gmks} sh tools/device/e-check.sh "$D"
OUT="$OUT/g" STEPS=${GSTEPS:-emdr} RLIMIT=${RLIMIT:-20} sh tools/device/g-check.sh "$D"
for t in test_gpu_engine test_cuda_kernels test_cuda_prefill; do
    timeout 200 "$D/$t" > "$OUT/$t.tap" 2>&1
    echo "== $t rc=$? $(grep -c '^ok' "$OUT/$t.tap") ok, $(grep -c '^not ok' "$OUT/$t.tap") not ok" | tee -a "$OUT/summary.txt"
    grep '^not ok' "$OUT/$t.tap" | tee -a "$OUT/summary.txt"
done
cat "$OUT/e/summary.txt" "$OUT/g/summary.txt" >> "$OUT/summary.txt"
