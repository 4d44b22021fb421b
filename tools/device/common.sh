# Shared by the device check scripts (tools/device/*-check.sh and the
# lead's call scripts): sourced from the repository root, where the device
# runs them, after the script has set
#   D      the folder of binaries (tools/device/pack.sh's, unpacked)
#   OUT    where the results go (summary.txt there collects the log)
#   STEPS  the letters of the steps to run (for has)
# as  . tools/device/common.sh
# It makes OUT, sets N to the niah4k folder, puts the CUDA tools
# (compute-sanitizer) on PATH and D/lib (libcjson, which the device lacks)
# first on LD_LIBRARY_PATH, and defines the helpers every script repeated
# before: engine_tests, log, has, gpu_info, dev_gunzip, tap, unit_tests,
# ruler_dev, unpack_once, call_begin, sanitize and snap.  A script
# that needs another form of one defines it after.
mkdir -p "$OUT"
N=tests/data/niah4k # the model, tokenizer and tasks most steps run
export PATH="$PATH:/usr/local/cuda/bin"
export LD_LIBRARY_PATH="$PWD/$D/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"

# The GPU engine's test programs (one, test_gpu_engine, until session 8; the
# split is in tests/unit/gpu_engine_tests.h).  engine_tests CMD...: CMD
# (timeout, compute-sanitizer and their options; env VAR=... for variables)
# with each of the programs in D in turn as its last argument, one stdout;
# the status the last nonzero one.  KV_TEST_FILTER names tests of any of them.
ENGINE_TESTS="test_gpu_engine_kernels test_gpu_engine test_gpu_engine_data"
engine_tests() {
    e_rc=0
    for e_t in $ENGINE_TESTS; do "$@" "$D/$e_t" || e_rc=$?; done
    return $e_rc
}
# log MESSAGE: a time-stamped line on stdout and in the summary
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/summary.txt"; }
# has LETTER: the step is in STEPS
has() { case "$STEPS" in *$1*) return 0;; esac; return 1; }
# gpu_info [FIELDS]: the date and the GPU (name, driver, memory, then the
# extra nvidia-smi query fields, comma-separated) into the summary
gpu_info() {
    { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total${1:+,$1} --format=csv; } 2>&1 |
        tee -a "$OUT/summary.txt"
}
# dev_gunzip: the binaries of the older per-helper packs (X-pack.sh), each
# gzipped on its own in D
dev_gunzip() {
    for z in "$D"/*.gz; do [ -e "$z" ] && gunzip -f "$z" && chmod +x "${z%.gz}"; done
    return 0
}
# tap NAME FILE [LINES]: a TAP file's counts and its failures and notes
tap() {
    log "$1: $(grep -c '^ok' "$2") ok, $(grep -c '^not ok' "$2") not ok"
    grep -E '^not ok|^# ' "$2" | head -${3:-25} | tee -a "$OUT/summary.txt"
}
# unit_tests LIST [SECONDS]: each GPU test binary of D in LIST, its TAP into
# $OUT/logs, rc and counts into the summary (SECONDS each, default 150)
unit_tests() {
    mkdir -p "$OUT/logs"
    for _t in $1; do
        timeout "${2:-150}" "$D/$_t" > "$OUT/logs/$_t.tap" 2>&1
        log "$_t rc=$?"
        tap "$_t" "$OUT/logs/$_t.tap" 16
    done
}
# ruler_dev NAME DEVICE OPTIONS...: kv-bench ruler on the niah4k dev tasks
# (RLIMIT per length, default 20) into OUT/ruler-NAME.json, and per policy
# its accuracy by length (with the tasks and the bytes fetched per step)
ruler_dev() {
    _n=$1 _dev=$2
    shift 2
    timeout 25 "$D/kv-bench" ruler --device "$_dev" --limit "${RLIMIT:-20}" -m "$N/niah4k.bin" \
        --tokenizer "$N/tok259.bin" --tasks "$N/tasks-dev.jsonl" --json --no-progress \
        "$@" > "$OUT/ruler-$_n.json" 2>> "$OUT/summary.txt"
    log "ruler $_n rc=$?"
    python3 - "$OUT/ruler-$_n.json" "$_n" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON:", e); sys.exit(0)
by = {}
for r in d.get("results", []):
    by.setdefault(r.get("policy"), []).append("%d:%.2f(n=%s, %dKiB/t)" % (
        r["length"], r["accuracy"], r.get("n", r.get("tasks", "?")), r.get("fetched_bytes_per_step", 0) // 1024))
for p, v in by.items(): print("%-10s %-40s %s" % (sys.argv[2], p, " ".join(v)))
PY
}
# snap: the lead's call scripts, whose device returns only a few files,
# with FINAL set: what OUT holds so far (logs over 2 MB dropped) as
# FINAL/all.tgz beside FINAL/summary.txt, so it comes back even if the
# call runs out of time
snap() {
    find "$OUT" -name '*.log' -size +2M -delete
    tar czf "$FINAL/all.tgz" -C "$OUT" . && cp "$OUT/summary.txt" "$FINAL/"
}
# unpack_once: D's binaries (tools/device/pack.sh's tarball), unpacked
# unless a script or an earlier call already did
unpack_once() {
    [ -x "$D/kv-bench" ] || sh tools/device/unpack.sh "$D" > "$OUT/unpack.log" 2>&1
}
# call_begin: a lead call script's start: L (OUT/logs) made, D unpacked,
# T0 the start in seconds, the GPU into the summary
call_begin() {
    L="$OUT/logs"
    mkdir -p "$L"
    unpack_once
    T0=$(date +%s)
    gpu_info
}
# sanitize TOOL FILTER PROGRAM NAME [SECONDS]: the tests of D/PROGRAM that
# KV_TEST_FILTER=FILTER selects under compute-sanitizer TOOL (memcheck,
# racecheck), into OUT/logs/NAME-TOOL.log; its status and summary lines
# into the summary
sanitize() {
    mkdir -p "$OUT/logs"
    KV_TEST_FILTER=$2 timeout "${5:-60}" compute-sanitizer --tool "$1" --error-exitcode 9 "$D/$3" \
        > "$OUT/logs/$4-$1.log" 2>&1
    log "$3 ($2) under $1 rc=$?"
    grep -E '^not ok|^ok|ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/logs/$4-$1.log" | tail -n 4 | tee -a "$OUT/summary.txt"
}
