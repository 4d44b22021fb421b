#!/bin/sh
# Lead's first device call of session 7 (2026-12-01): the merged main of
# session 6 (never run on a GPU) after sh tools/device/unpack.sh DIR:
#   every GPU unit test once (session 5's unverified fixes: offload events
#   after a graph launch, the BF16/dp4a bounds, the batch refusals; session
#   6's GPU DSQ with separate key/value bits and the GEMV-name table),
#   compute-sanitizer memcheck of the DSQ device tests, niah4k on the GPU
#   for full and the new dsq default, then kv-bench decode at 128k after a
#   real prefill (full, quant, the default hybrid, with the fetch-free step).
# From the repository root:  OUT=DIR sh tools/device/lead-7.sh DIR
set -u
D=${1:-build-dev}
OUT=${OUT:-/tmp/kv-out}
. tools/device/common.sh
gpu_info
for t in test_gpu_engine_kernels:30 test_gpu_engine:60 test_gpu_engine_data:60 test_cuda_kernels:40 test_gpu_graph:25 test_gpu_batch:30 test_gpu_select:15 \
         test_gpu_prefix:15 test_cuda_prefill:40; do
    n=${t%%:*}; s=${t#*:}
    timeout "$s" "$D/$n" > "$OUT/$n.tap" 2>&1
    log "$n rc=$?"
    tap "$n" "$OUT/$n.tap" 30
done
engine_tests env KV_TEST_FILTER=dsq timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 \
    > "$OUT/memcheck-dsq.txt" 2>&1
log "memcheck test_gpu_engine* (dsq tests) rc=$? $(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/memcheck-dsq.txt") clean summaries"
tail -3 "$OUT/memcheck-dsq.txt" >> "$OUT/summary.txt"
ruler_dev dsq cuda -P full -P "0=full;*=dsq"
ruler_dev dsq-old cuda -P "0=full;*=dsq:salient=0.2,bits=2"
timeout 75 "$D/kv-bench" decode --json --context prefill -c 131072 --policies full,quant,hybrid-resident \
    -n 16 --warmup 2 --nofetch-tokens 8 > "$OUT/decode.json" 2> "$OUT/decode.err"
log "kv-bench decode 128k rc=$?"
python3 - "$OUT/decode.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for c in d["contexts"]:
    for k, v in c["policies"].items():
        print(c["T"], k, v.get("ms_per_token"), "graph", v.get("graph"), "gpu_kv", v.get("gpu_kv_over_full"),
              "nofetch", v.get("ms_no_fetch"), "hidden", v.get("pcie_hidden"), "bd", v.get("breakdown_ms"))
PY
log end
