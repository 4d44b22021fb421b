#!/bin/sh
# Helper K10's device round (issue 10: decode attention and packing at HBM
# speed).  From the repository root, after tools/device/pack.sh DIR and the
# lead's unpack:   OUT=<dir> sh tools/device/k10-check.sh DIR
# Steps, each under a timeout (about 150 s in all), measurements first:
#   attn    kv-bench attn --check --json at 32k and 128k (default kernels),
#           then at both: the register fp16 kernel (--f16-legacy), no PDL
#           (--pdl 0, as SDPA runs), a grid of two waves (--f16-waves 2)
#   sdpa    PyTorch SDPA enable_gqa on the same shapes (tools/device/sdpa.py)
#   pack    kv-bench pack --json (GPU 128k tokens; small CPU part)
#   unit    test_cuda_kernels (every kernel against its CPU reference)
#   mem     compute-sanitizer memcheck, KV_TEST_SHORT, fp16 + pack tests
#   race    compute-sanitizer racecheck, same tests
#   decode  kv-bench decode --json -c 32768,131072 --policies full,quant
#   engine  test_gpu_engine (the engine's fidelity tests, which run every
#           fp16 layer through the attention kernels)
# Results in $OUT: summary.txt and one log/JSON per step.
set -u
D=${1:-build-dev-K10}
OUT=${OUT:-/tmp/k10-out}
STEPS=${STEPS:-attn,sdpa,pack,unit,mem,race,decode,engine}
. tools/device/common.sh
[ -x "$D/kv-bench" ] || sh tools/device/unpack.sh "$D" > "$OUT/unpack.log" 2>&1
has() { case ",$STEPS," in *,$1,*) return 0;; esac; return 1; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv; } \
    2>&1 | tee -a "$OUT/summary.txt"
F="KV_TEST_SHORT=1 KV_TEST_FILTER=attn_f16_matches,kivi_pack_is"
if has attn; then
    timeout 30 "$D/kv-bench" attn --check --json -c 32768,131072 > "$OUT/attn.json" 2> "$OUT/attn.err"
    log "kv-bench attn --check -c 32768,131072 rc=$?"
    for v in legacy:--f16-legacy pdl0:--pdl=0 waves2:--f16-waves=2; do
        n=${v%%:*}; o=$(echo "${v#*:}" | tr = ' ')
        timeout 15 "$D/kv-bench" attn --json -c 32768,131072 --iters 100 --reps 5 $o \
            > "$OUT/attn-$n.json" 2> "$OUT/attn-$n.err"
        log "kv-bench attn $o rc=$?"
    done
fi
if has sdpa; then
    timeout 30 python3 tools/device/sdpa.py 32768,131072 > "$OUT/sdpa.json" 2> "$OUT/sdpa.err"
    log "sdpa.py rc=$?"
fi
if has pack; then
    timeout 15 "$D/kv-bench" pack --json --cpu-context 1024 --reps 5 > "$OUT/pack.json" 2> "$OUT/pack.err"
    log "kv-bench pack rc=$?"
fi
if has unit; then
    timeout 70 "$D/test_cuda_kernels" > "$OUT/unit.tap" 2>&1
    log "test_cuda_kernels rc=$? $(grep -c '^ok' "$OUT/unit.tap") ok, $(grep -c '^not ok' "$OUT/unit.tap") not ok"
    grep -A4 '^not ok' "$OUT/unit.tap" | head -40 | tee -a "$OUT/summary.txt"
fi
for tool in memcheck racecheck; do
    case $tool in memcheck) has mem || continue;; racecheck) has race || continue;; esac
    env KV_TEST_SHORT=1 KV_TEST_FILTER=attn_f16_matches,kivi_pack_is timeout 25 compute-sanitizer \
        --tool $tool --error-exitcode 9 "$D/test_cuda_kernels" > "$OUT/$tool.log" 2>&1
    log "$tool ($F) rc=$?"
    grep -E '^not ok|ERROR SUMMARY|RACECHECK SUMMARY|Hazard' "$OUT/$tool.log" | tail -n 6 | tee -a "$OUT/summary.txt"
done
if has decode; then
    timeout 40 "$D/kv-bench" decode --json -c 32768,131072 --policies full,quant -n 16 --warmup 2 \
        > "$OUT/decode.json" 2> "$OUT/decode.err"
    log "kv-bench decode full,quant rc=$?"
fi
# a short table last
python3 - "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import json, os, sys
o = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(o, n)))
    except Exception as e:
        print(n, "unreadable:", e); return None
a, s, p = load("attn.json"), load("sdpa.json"), load("pack.json")
sd = {r["T"]: r.get("enable_gqa", {}).get("us") for r in (s or {}).get("contexts", [])}
def f16(n):
    x = load(n) or {}
    return {r["T"]: "%.2f" % r["f16"]["us"] for r in x.get("contexts", []) if r.get("f16")}
var = {n: f16("attn-%s.json" % n) for n in ("legacy", "pdl0", "waves2")}
if a:
    print("copy GB/s %.0f" % (a["copy_bytes_per_s"] / 1e9))
    for r in a["contexts"]:
        f = r["f16"]
        row = "T %6d f16 %7.2f us (%.1f%% copy, err %s) sdpa %s %s" % (
            r["T"], f["us"], 100 * f["frac_of_copy"], f.get("err_vs_cpu"), sd.get(r["T"]),
            " ".join("%s %s" % (n, v.get(r["T"])) for n, v in var.items()))
        for k in ("kivi1", "kivi2"):
            x = r.get(k)
            if x: row += " | %s %.2f us %.2fx err %s" % (k, x["us"], x["speedup_vs_f16"], x.get("err_vs_cpu"))
        print(row)
if p:
    for r in p["results"]:
        print("pack %d bits: %.1f us, %.1f%% of copy" % (r["bits"], r.get("gpu_us", -1), 100 * r.get("gpu_frac_of_copy", 0)))
EOF
if has engine; then
    # the GPU engine's fidelity tests run every fp16 layer through these kernels
    engine_tests timeout 75 > "$OUT/engine.tap" 2>&1
    log "test_gpu_engine rc=$? $(grep -c '^ok' "$OUT/engine.tap") ok, $(grep -c '^not ok' "$OUT/engine.tap") not ok"
    grep -A4 '^not ok' "$OUT/engine.tap" | head -30 | tee -a "$OUT/summary.txt"
fi
