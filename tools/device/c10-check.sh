#!/bin/sh
# Helper C7's device round (issue 10: packed attention v3, kernels/attn_kivi3.cu).
# From the repository root, after tools/device/pack.sh DIR and the lead's unpack:
#   OUT=<dir> sh tools/device/c10-check.sh DIR        (CAP seconds in all, default 98)
# Steps, in order of need, each under a timeout and skipped when the cap
# would be passed:
#   unit   test_cuda_kernels, the v3 packed-attention tests (v3 and its
#          variants, 1/2/4 bits; niah4k layer 0 with v2 and v3) against the
#          CPU reference (v2's random-data test is unchanged and slow here)
#   bench  kv-bench attn --check --json -c 32768,131072: v2 (--kivi-kernel 2),
#          the default (the engine's choice), v3 (--kivi-kernel 3); fp16
#          measured in each
#   mem    compute-sanitizer memcheck of the v3 test (KV_TEST_SHORT=1)
#   race   compute-sanitizer racecheck of the v3 test (KV_TEST_SHORT=1)
#   vars   v3 variants at 128k (--iters 100 --reps 5): 3 stages, the
#          in-kernel merge (rounds 2-4 ran the diagnostics, with other
#          STEPS lists of this script: tools/device/runs/c7-round-N)
#   again  v2, the default and v3 at 128k once more (--iters 100 --reps 5)
# Results: OUT/summary.txt, OUT/c10.tgz (every log and JSON).
set -u
D=${1:-build-dev-C}
OUT=${OUT:-/tmp/c10-out}
CAP=${CAP:-98}
STEPS=${STEPS:-unit,bench,mem,race,vars,again}
. tools/device/common.sh
START=$(date +%s)
[ -x "$D/kv-bench" ] || sh tools/device/unpack.sh "$D" > "$OUT/unpack.log" 2>&1
# fits SECONDS: there is time for a step of at most SECONDS
fits() { [ $(( $(date +%s) - START + $1 )) -le "$CAP" ]; }
gpu_info clocks.sm,clocks.mem
if has unit && fits 45; then
    env KV_TEST_QUICK=1 KV_TEST_FILTER=attn_kivi3,attn_kivi_matches_cpu_on_real,launchers timeout 45 \
        "$D/test_cuda_kernels" > "$OUT/unit.tap" 2>&1
    log "test_cuda_kernels (attn_kivi3, real data, launchers) rc=$?"
    tap unit "$OUT/unit.tap" 60
fi
if has bench; then
    for v in k2:--kivi-kernel=2 dflt: k3:--kivi-kernel=3; do
        fits 16 || break
        n=${v%%:*}; o=$(echo "${v#*:}" | tr =: '  ')
        timeout 16 "$D/kv-bench" attn --check --json -c 32768,131072 $o \
            > "$OUT/attn-$n.json" 2> "$OUT/attn-$n.err"
        log "kv-bench attn --check -c 32768,131072 $o rc=$?"
    done
fi
if has mem && fits 25; then
    env KV_TEST_SHORT=1 KV_TEST_QUICK=1 KV_TEST_FILTER=attn_kivi3 timeout 25 compute-sanitizer --tool memcheck \
        --error-exitcode 9 "$D/test_cuda_kernels" > "$OUT/memcheck.log" 2>&1
    log "memcheck (attn_kivi3, short) rc=$?"
    grep -E '^not ok|ERROR SUMMARY' "$OUT/memcheck.log" | tail -n 6 | tee -a "$OUT/summary.txt"
fi
if has race && fits 25; then
    env KV_TEST_SHORT=1 KV_TEST_QUICK=1 KV_TEST_FILTER=attn_kivi3 timeout 25 compute-sanitizer --tool racecheck \
        --error-exitcode 9 "$D/test_cuda_kernels" > "$OUT/racecheck.log" 2>&1
    log "racecheck (attn_kivi3, short) rc=$?"
    grep -E '^not ok|RACECHECK SUMMARY|Hazard' "$OUT/racecheck.log" | tail -n 6 | tee -a "$OUT/summary.txt"
fi
if has vars; then
    for v in nst3:--kivi3-stages=3 fused:--kivi3-fused; do
        fits 9 || break
        n=${v%%:*}; o=$(echo "${v#*:}" | tr =: '  ')
        timeout 9 "$D/kv-bench" attn --json -c 131072 --iters 100 --reps 5 --kivi-kernel 3 $o \
            > "$OUT/attn-$n.json" 2> "$OUT/attn-$n.err"
        log "kv-bench attn -c 131072 --kivi-kernel 3 $o rc=$?"
    done
fi
if has again; then
    for v in k2:--kivi-kernel=2 dflt: k3:--kivi-kernel=3; do
        fits 9 || break
        n=${v%%:*}; o=$(echo "${v#*:}" | tr =: '  ')
        timeout 9 "$D/kv-bench" attn --json -c 131072 --iters 100 --reps 5 $o \
            > "$OUT/attn-again-$n.json" 2> "$OUT/attn-again-$n.err"
        log "kv-bench attn -c 131072 $o (again) rc=$?"
    done
fi
# a short table last
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import glob, json, os, sys
o = sys.argv[1]
for f in sorted(glob.glob(os.path.join(o, "attn-*.json"))):
    try:
        a = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), "unreadable:", e); continue
    for r in a["contexts"]:
        row = ["%-16s T %6d" % (os.path.basename(f)[5:-5], r["T"])]
        for p in ("f16", "kivi1", "kivi2", "kivi4"):
            x = r.get(p)
            if x:
                row.append("%s %7.2f us (%5.2fx%s)" % (p, x["us"], x["speedup_vs_f16"],
                           ", err %.1e" % x["err_vs_cpu"] if "err_vs_cpu" in x else ""))
        row.append("kernel %s" % r.get("kivi_kernel", "?"))
        print("  ".join(row))
PY
log "done in $(( $(date +%s) - START )) s"
# one tarball and the summary come back (the device returns only a few files)
tar czf /tmp/c10.tgz -C "$OUT" . 2>/dev/null && find "$OUT" -type f ! -name summary.txt -delete &&
    mv /tmp/c10.tgz "$OUT/c10.tgz"
