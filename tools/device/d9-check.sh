#!/bin/sh
# Helper D7's device round (issue 9: the prefill attention against PyTorch
# SDPA).  From the repository root, after the binaries of DIR (kv-bench,
# test_cuda_prefill: tools/device/pack.sh's bins.tar.xz or a smaller one)
# are unpacked:   OUT=<dir> sh tools/device/d9-check.sh DIR
# DIR also holds prefill_peer.py (the PyTorch peer; main's copy may be older).
# Steps (STEPS, comma-separated), each under a timeout, skipped when the
# round's budget (BUDGET seconds, default 95) would run out:
#   test    test_cuda_prefill's attention tests: every variant against the
#           CPU reference (fp16, bf16, fp16 in/bf16 out, head_dim 64/128,
#           chunks past cached keys)
#   full    the whole test_cuda_prefill (layers, niah4k model prefill)
#   a32     every attention variant alone at 32k (kv-bench prefill --variants)
#   sdpa    PyTorch SDPA alone, same shapes (prefill_peer.py --sdpa-only)
#   a128    the variants in A128 alone at 128k (one kv-bench run each)
#   p32     the full prefill at 32k: kvtools (variant PV) then the peer
#   p128    the same at 128k
#   p       both contexts in one process each (PCTX; saves a start-up)
#   mem     compute-sanitizer memcheck, KV_TEST_SHORT, the attention test
#           with the variants in MEMV too
# Results in $OUT: summary.txt, results.tar.gz (every log and JSON).
set -u
D=${1:-build-dev-D}
OUT=${OUT:-/tmp/d9-out}
STEPS=${STEPS:-p32,p128,mem}
BUDGET=${BUDGET:-95}
A128=${A128:-0 16 17 18 19 20 21}
PV=${PV:-best} # best: the fastest variant of a32 (0 when a32 did not run)
MEMV=${MEMV:-}
. tools/device/common.sh
[ -x "$D/kv-bench" ] || sh tools/device/unpack.sh "$D" > "$OUT/unpack.log" 2>&1
has() { case ",$STEPS," in *,$1,*) return 0;; esac; return 1; }
T0=$(date +%s)
# left N: at least N seconds of the budget remain
left() { [ $(( $(date +%s) - T0 + $1 )) -le "$BUDGET" ] || { log "skipped: $2 (budget)"; return 1; }; }
R=$OUT/r
mkdir -p "$R"
PEER=$D/prefill_peer.py
[ -f "$PEER" ] || PEER=tools/device/prefill_peer.py
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv; } \
    2>&1 | tee -a "$OUT/summary.txt"

if has test && left 30 test; then
    KV_TEST_FILTER=attention timeout 40 "$D/test_cuda_prefill" > "$R/test.tap" 2>&1
    rc=$?
    log "test_cuda_prefill (attention) rc=$rc $(grep -c '^ok' "$R/test.tap") ok, $(grep -c '^not ok' "$R/test.tap") not ok"
    if [ $rc -ge 124 ]; then # a kernel hung: time only the earlier kernels
        log "a variant hung: a32 and the tma variants skipped"
        STEPS=$(echo ",$STEPS," | sed 's/,a32,/,/'); A128="0 9"; MEMV=
    fi
    grep -E '^not ok|^# (prefill|GPU|seed)' "$R/test.tap" | head -12 | tee -a "$OUT/summary.txt"
    grep -E '^#   ' "$R/test.tap" | head -12 | tee -a "$OUT/summary.txt"
fi
if has full && left 30 full; then
    timeout 30 "$D/test_cuda_prefill" > "$R/full.tap" 2>&1
    log "test_cuda_prefill (all) rc=$? $(grep -c '^ok' "$R/full.tap") ok, $(grep -c '^not ok' "$R/full.tap") not ok"
    grep -E '^not ok|^# ' "$R/full.tap" | head -16 | tee -a "$OUT/summary.txt"
fi
if has a32 && left 15 a32; then
    timeout 25 "$D/kv-bench" prefill --json -c 32768 --layers 1 --reps 1 --gemm 0 --variants \
        > "$R/a32.json" 2> "$R/a32.err"
    log "kv-bench prefill -c 32768 --layers 1 --variants rc=$?"
fi
if has sdpa && left 20 sdpa; then
    PYTHONUNBUFFERED=1 timeout 30 python3 "$PEER" --sdpa-only --contexts 32768,131072 --reps 3 \
        > "$R/sdpa.json" 2> "$R/sdpa.err"
    log "prefill_peer.py --sdpa-only rc=$?"
fi
if has a128; then
    for v in $A128; do
        left 6 "a128 variant $v" || break
        timeout 12 "$D/kv-bench" prefill --json -c 131072 --layers 1 --reps 1 --gemm 0 --variant "$v" \
            > "$R/a128-$v.json" 2> "$R/a128-$v.err"
        log "kv-bench prefill -c 131072 --layers 1 --variant $v rc=$?"
    done
fi
if [ "$PV" = best ]; then
    PV=$(python3 - "$R/a32.json" <<'PY'
import json, sys
try:
    v = json.load(open(sys.argv[1]))["contexts"][0]["variants"]
    names = list(v)
    print(max(range(1, len(names)), key=lambda i: v[names[i]]["tflops"]))
except Exception:
    print(0)
PY
)
fi
if has p && left 65 p; then
    timeout 40 "$D/kv-bench" prefill --json -c "${PCTX:-32768,131072}" --reps 1 --variant "$PV" \
        > "$R/p-kv.json" 2> "$R/p-kv.err"
    log "kv-bench prefill -c ${PCTX:-32768,131072} --reps 1 --variant $PV rc=$?"
    rest=$(( BUDGET - ($(date +%s) - T0) )); [ $rest -gt 45 ] && rest=45; [ $rest -lt 5 ] && rest=5
    PYTHONUNBUFFERED=1 timeout $rest python3 "$PEER" --contexts "${PCTX:-32768,131072}" --reps 1 \
        > "$R/p-peer.json" 2> "$R/p-peer.err"
    log "prefill_peer.py --contexts ${PCTX:-32768,131072} --reps 1 rc=$?"
fi
for c in 32768:p32 131072:p128; do
    T=${c%%:*}; s=${c#*:}
    has "$s" || continue
    # reps: P32REPS (default 3) at 32k, P128REPS (default 1) at 128k
    if [ "$T" = 32768 ]; then n=${P32REPS:-3}; need=$((12 + 4 * n)); else n=${P128REPS:-1}; need=$((30 + 24 * n)); fi
    left "$need" "$s" || continue
    timeout $((need / 2 + 4)) "$D/kv-bench" prefill --json -c "$T" --reps "$n" --variant "$PV" \
        > "$R/$s-kv.json" 2> "$R/$s-kv.err"
    log "kv-bench prefill -c $T --reps $n --variant $PV rc=$?"
    PYTHONUNBUFFERED=1 timeout $((need / 2 + 6)) python3 "$PEER" --contexts "$T" --reps "$n" \
        > "$R/$s-peer.json" 2> "$R/$s-peer.err"
    log "prefill_peer.py --contexts $T --reps $n rc=$?"
done

if has mem && left 16 mem; then
    KV_TEST_SHORT=1 KV_TEST_FILTER=attention_matches KV_TEST_VARIANTS="$MEMV" timeout 20 \
        compute-sanitizer --tool memcheck --error-exitcode 9 "$D/test_cuda_prefill" > "$R/memcheck.log" 2>&1
    log "memcheck (short, attention, + $MEMV) rc=$?"
    grep -E '^not ok|ERROR SUMMARY|^# prefill' "$R/memcheck.log" | tail -n 6 | tee -a "$OUT/summary.txt"
fi
python3 - "$R" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import glob, json, os, sys
r = sys.argv[1]
def load(p):
    try: return json.load(open(p))
    except Exception: return None
a = load(os.path.join(r, "a32.json"))
if a:
    c = a["contexts"][0]
    print("alone at 32k (fp16), TFLOP/s:")
    for k, v in c.get("variants", {}).items(): print("  %-12s %6.1f" % (k, v["tflops"]))
for p in sorted(glob.glob(os.path.join(r, "a128-*.json"))):
    d = load(p)
    if d and "attn_alone_tflops" in d["contexts"][0]:
        print("alone at 128k (fp16) %-12s %6.1f TFLOP/s" % (d["attn_variant"], d["contexts"][0]["attn_alone_tflops"]))
s = load(os.path.join(r, "sdpa.json"))
if s:
    for c in s["contexts"]:
        print("SDPA alone %6d: f16 %6.1f bf16 %6.1f TFLOP/s" % (c["T"], c["f16"]["tflops"], c["bf16"]["tflops"]))
for t in ("p", "p32", "p128"):
    k, pe = load(os.path.join(r, t + "-kv.json")), load(os.path.join(r, t + "-peer.json"))
    kc = {c["T"]: c for c in k["contexts"]} if k else {}
    pc = {c["T"]: c for c in pe["contexts"]} if pe else {}
    for T in sorted(set(kc) | set(pc)):
        c = kc.get(T, {})
        if "prefill_ms" in c:
            print("kvtools %6d (%s): %.1f ms %.0f tok/s attn %.1f ms %.1f TF/s alone %.1f other %.1f TF/s gemm %.1f gpu %.1f GB" % (
                T, k["attn_variant"], c["prefill_ms"], c["tokens_per_s"], c["attn_ms"], c["attn_tflops"],
                c.get("attn_alone_tflops", 0), c["gemm_part_tflops"], k["gemm_tflops"], c["gpu_bytes"] / 1e9))
        p = pc.get(T, {})
        if "prefill_ms" in p:
            print("torch   %6d: %.1f ms %.0f tok/s sdpa %.1f TF/s gemm %.1f finite %s peak %.1f GB" % (
                T, p["prefill_ms"], p["tokens_per_s"], p["sdpa_tflops"], pe["gemm_tflops"], p["finite"],
                p["peak_bytes"] / 1e9))
            if "tokens_per_s" in c:
                print("ratio %6d: %.3fx" % (T, c["tokens_per_s"] / p["tokens_per_s"]))
PY
tar czf "$OUT/results.tar.gz" -C "$OUT" r && rm -rf "$R"
log "done in $(( $(date +%s) - T0 )) s"
