#!/bin/sh
# Run every test suite and count results: unit tests (plain build, then the
# ASan+UBSan build), bats tests (TAP) against the tools, then again against
# the ASan+UBSan tools ($B/asan/bin), and each fuzzer for a bounded time.
# Any sanitizer report fails its suite: the sanitized programs stop on the
# first one (-fno-sanitize-recover=all) and log it under $B/test-logs/san.
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
# Sanitizer reports go to files (a tool's own exit status may be what a
# test expects, so a report must not hide behind it); any file is a failure.
san=$log/san
rm -rf "$san" && mkdir -p "$san"
SAN_ENV="ASAN_OPTIONS=detect_leaks=1:log_path=$san/asan UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$san/ubsan"
san_reports() { # suite name: fail it if sanitizers logged anything
    if ls "$san"/* >/dev/null 2>&1; then
        echo "FAIL $1: sanitizer reports:" >&2
        head -n 40 "$san"/* >&2
        failed=$((failed + 1))
        mkdir -p "$log/san-$1" && mv "$san"/* "$log/san-$1/"
    fi
}
for t in $B/asan/unit/test_*; do
    [ -x "$t" ] || continue
    # shellcheck disable=SC2086
    run_suite "asan-$(basename "$t")" env $SAN_ENV "$t"
    san_reports "asan-$(basename "$t")"
done
if ls tests/bats/*.bats >/dev/null 2>&1; then
    run_suite bats bats --tap tests/bats
fi
# The tools themselves under ASan+UBSan: every bats file, but not the tests
# tagged slow (`# bats test_tags=slow`: end-to-end benchmark runs of a model,
# tens of seconds each under ASan, whose readers are fuzzed below and
# exercised by the untagged tests of the same files; they run against the
# plain tools above).  About 3 minutes on two cores.
if [ -x "$B/asan/bin/kv-run" ] && ls tests/bats/*.bats >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    run_suite bats-asan env $SAN_ENV KV_BIN="$(pwd)/$B/asan/bin" bats --tap --filter-tags '!slow' tests/bats
    san_reports bats-asan
fi
# The canaries: a planted float-to-int overflow and a heap overflow must kill
# both the fuzzer build and the ASan+UBSan build (else a finding could pass).
printf 'U\312\362\111\161' >"$log/canary-ub.in" # 'U' + 1e30f
printf 'Aaaa' >"$log/canary-asan.in"
for c in "$B/fuzz/canary_ub" "$B/asan/canary_ub"; do
    [ -x "$c" ] || continue
    for in in ub asan; do
        cname=canary-$(basename "$(dirname "$c")")-$in
        env ASAN_OPTIONS=detect_leaks=0 "$c" "$log/canary-$in.in" >"$log/$cname.log" 2>&1
        rc=$?
        if [ $rc -ne 0 ] && grep -Eq 'runtime error:|ERROR: AddressSanitizer' "$log/$cname.log"; then
            passed=$((passed + 1)); echo "$cname: dies of its report (exit $rc)" >&2
        else
            failed=$((failed + 1)); echo "FAIL $cname: a planted report did not stop it (exit $rc)" >&2
        fi
    done
done
for fz in $B/fuzz/fuzz_*; do
    [ -x "$fz" ] || continue
    name=$(basename "$fz")
    corpus=tests/fuzz/corpus/${name#fuzz_}
    work=$B/fuzz-work/$name
    mkdir -p "$work"
    # a finding fails the run (the fuzzers abort on any sanitizer report);
    # the log is searched too, in case a report ever stops being fatal
    if "$fz" -max_total_time="${FUZZ_SECONDS:-30}" -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$log/$name-" "$work" "$corpus" >"$log/$name.log" 2>&1 &&
        ! grep -Eq 'runtime error:|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)' "$log/$name.log"; then
        passed=$((passed + 1))
        echo "fuzz $name: ok ($(sed -n 's/^stat::number_of_executed_units: *//p' "$log/$name.log") runs)" >&2
    else
        failed=$((failed + 1)); echo "FAIL fuzz $name (see $log/$name.log)" >&2
        tail -n 30 "$log/$name.log" >&2
    fi
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
