#!/bin/sh
# Run every fuzzer of a build for SECONDS each (default 180), niced, from a
# scratch copy of its corpus; print one line per fuzzer with its executions
# and whether it stopped on a finding.  Exit 1 if any did.
#   tools/reliability/fuzz-all.sh [SECONDS] [BUILD_DIR]
set -u
cd "$(dirname "$0")/../.." || exit 1
secs=${1:-180}
B=${2:-build}
out=$(mktemp -d "${TMPDIR:-/tmp}/kv-fuzz.XXXXXX")
bad=0
for fz in "$B"/fuzz/fuzz_*; do
    [ -x "$fz" ] || continue
    name=$(basename "$fz")
    mkdir -p "$out/$name"
    nice -n 19 "$fz" -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$out/$name-" "$out/$name" "tests/fuzz/corpus/${name#fuzz_}" >"$out/$name.log" 2>&1
    rc=$?
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out/$name.log")
    reports=$(grep -Ec 'runtime error:|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)' "$out/$name.log")
    echo "$name: $runs executions in ${secs} s, exit $rc, $reports reports"
    [ "$rc" -ne 0 ] || [ "$reports" -ne 0 ] && bad=1
done
echo "logs in $out"
exit $bad
