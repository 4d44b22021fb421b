#!/bin/sh
# One device call that checks the GPU engine and times it (docs/BENCHMARKS.md,
# "Layered library: GPU split"), from the repository root on the GPU machine:
#   RUNDIR=build-dev-A sh tools/device/gpu-check.sh   (RUNDIR: the carried folder)
# $RUNDIR holds bins.tgz (kv-bench, test_gpu_engine, test_cuda_kernels built
# here with nvcc, stripped of host debug info) and lib/ (libcjson.so.1*).
# Phase 1: the two GPU unit tests and both under compute-sanitizer memcheck,
# side by side (the engine test with KV_GPU_TEST_SHORT=1 under memcheck);
# phase 2: kv-bench decode at 128k alone on the GPU, then full with --pdl 0.
# Files under $OUT (8): summary.txt engine.tap kernels.tap memcheck-engine.log
# memcheck-kernels.log decode.json decode_pdl0.json decode.err.
set -u
D=${RUNDIR:-build-dev-A}
export PATH="$PATH:/usr/local/cuda/bin" LD_LIBRARY_PATH="$PWD/$D/lib"
mkdir -p $D/bin && tar xzf $D/bins.tgz -C $D/bin || exit 3
B=$D/bin S=$OUT/summary.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current --format=csv,noheader; nproc; } > $S 2>&1
t0=$(date +%s)
( for t in test_gpu_engine_kernels test_gpu_engine test_gpu_engine_data; do
    OMP_NUM_THREADS=4 timeout 200 $B/$t; echo "$t rc=$?" >> $S; done > $OUT/engine.tap 2>&1 ) &
( OMP_NUM_THREADS=4 timeout 150 $B/test_cuda_kernels > $OUT/kernels.tap 2>&1; echo "test_cuda_kernels rc=$?" >> $S ) &
( for t in test_gpu_engine_kernels test_gpu_engine test_gpu_engine_data; do
    KV_GPU_TEST_SHORT=1 OMP_NUM_THREADS=4 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
    $B/$t; echo "memcheck $t (short) rc=$?" >> $S; done > $OUT/memcheck-engine.log 2>&1 ) &
( OMP_NUM_THREADS=4 timeout 200 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
    $B/test_cuda_kernels > $OUT/memcheck-kernels.log 2>&1; echo "memcheck test_cuda_kernels rc=$?" >> $S ) &
wait
echo "phase 1: $(( $(date +%s) - t0 )) s" >> $S
t1=$(date +%s)
timeout 170 $B/kv-bench decode --json -c 131072 --policies full,quant,hybrid,hybrid-sketch \
    > $OUT/decode.json 2> $OUT/decode.err
echo "kv-bench decode rc=$? in $(( $(date +%s) - t1 )) s" >> $S
t1=$(date +%s)
timeout 60 $B/kv-bench decode --json -c 131072 --policies full --pdl 0 > $OUT/decode_pdl0.json 2>> $OUT/decode.err
echo "kv-bench decode --pdl 0 rc=$? in $(( $(date +%s) - t1 )) s" >> $S
for f in engine.tap kernels.tap memcheck-engine.log memcheck-kernels.log; do
    echo "$f: $(grep -c '^ok' $OUT/$f) ok, $(grep -c '^not ok' $OUT/$f) not ok; $(grep 'ERROR SUMMARY' $OUT/$f | tr '\n' ' ')" >> $S
    grep '^not ok' $OUT/$f -A3 | head -20 >> $S
done
python3 - $OUT/decode.json $OUT/decode_pdl0.json <<'PY' >> $S 2>&1
import json, sys
for f in sys.argv[1:]:
  d = json.load(open(f))
  print(f.split("/")[-1], "pdl", d.get("pdl"))
  for c in d["contexts"]:
    for p, r in c["policies"].items():
        print(c["T"], p, r.get("error") or "%.3f ms/token p90 %.3f gpu %.1f MB host %.1f MB pcie %.2f MB/tok%s%s" % (
            r["ms_per_token"], r["ms_p90"], r["gpu_kv_bytes"] / 1e6, r["host_kv_bytes"] / 1e6,
            r["pcie_bytes_per_token"] / 1e6, " bound %.3f" % r["bound_ms"] if "bound_ms" in r else "",
            " nofetch %.3f hidden %.3f" % (r["ms_no_fetch"], r["pcie_hidden"]) if "ms_no_fetch" in r else ""))
  print("bandwidth GB/s", {k: round(v / 1e9, 1) for k, v in d["bandwidth"].items()})
PY
cat $S
