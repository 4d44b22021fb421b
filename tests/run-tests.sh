#!/bin/sh
# Run every test suite and count results: unit tests (plain build, then the
# ASan+UBSan build), bats tests (TAP), and each fuzzer for a bounded time.
# The last line is "N passed, N failed" (skips counted separately).
set -u
cd "$(dirname "$0")/.." || exit 1
passed=0 failed=0 skipped=0
B=${KV_BUILD:-build}
log=$B/test-logs
mkdir -p "$log"

count_tap() { # file -> updates counters
    p=$(grep -E '^ok ' "$1" | grep -vc '# [Ss][Kk][Ii][Pp]')
    s=$(grep -Ec '^ok .*# [Ss][Kk][Ii][Pp]' "$1")
    f=$(grep -c '^not ok ' "$1")
    passed=$((passed + p)); skipped=$((skipped + s)); failed=$((failed + f))
}

run_suite() { # name command...
    name=$1; shift
    out="$log/$name.tap"
    "$@" >"$out" 2>"$log/$name.err"
    rc=$?
    count_tap "$out"
    if [ $rc -ne 0 ] && ! grep -q '^not ok ' "$out"; then
        echo "FAIL $name: exited $rc with no failing test line" >&2
        tail -n 20 "$log/$name.err" >&2
        failed=$((failed + 1))
    fi
    grep '^not ok ' "$out" | sed "s/^/$name: /" >&2
    [ $rc -ne 0 ] && tail -n 20 "$log/$name.err" >&2
    echo "suite $name: rc=$rc" >&2
}

run_suite layers /usr/bin/python3 tests/layers/check-layers.py
for t in $B/unit/test_*; do
    [ -x "$t" ] && run_suite "unit-$(basename "$t")" "$t"
done
for t in $B/asan/unit/test_*; do
    [ -x "$t" ] && run_suite "asan-$(basename "$t")" env ASAN_OPTIONS=detect_leaks=1 "$t"
done
if ls tests/bats/*.bats >/dev/null 2>&1; then
    run_suite bats bats --tap tests/bats
fi
for fz in $B/fuzz/fuzz_*; do
    [ -x "$fz" ] || continue
    name=$(basename "$fz")
    corpus=tests/fuzz/corpus/${name#fuzz_}
    work=$B/fuzz-work/$name
    mkdir -p "$work"
    if "$fz" -max_total_time="${FUZZ_SECONDS:-30}" -rss_limit_mb=2048 -print_final_stats=0 \
        "$work" "$corpus" >"$log/$name.log" 2>&1; then
        passed=$((passed + 1)); echo "fuzz $name: ok" >&2
    else
        failed=$((failed + 1)); echo "FAIL fuzz $name (see $log/$name.log)" >&2
        tail -n 30 "$log/$name.log" >&2
    fi
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
