bats_require_minimum_version 1.5.0
# Shared helper loaded by every bats file: paths, bats-assert/support, and
# small JSON helpers (JSON is parsed with python3, never grepped).
load '/usr/lib/bats/bats-support/load'
load '/usr/lib/bats/bats-assert/load'

ROOT="$(cd "$BATS_TEST_DIRNAME/../.." && pwd)"
BIN="${KV_BIN:-$ROOT/bin}"
DATA="$ROOT/tests/data"
PATH="$BIN:$PATH"
PY=/usr/bin/python3
export NO_COLOR=1

# json_get 'expr' : evaluates a Python expression on the JSON in $output,
# bound to j; prints the result.
json_get() {
    printf '%s' "$output" | "$PY" -c 'import json,sys; j=json.load(sys.stdin); print(eval(sys.argv[1]))' "$1"
}

# Assert the exit status and that stderr's first line mentions a pattern.
assert_fails_with() { # code pattern
    [ "$status" -eq "$1" ] || { echo "expected exit $1, got $status; stderr: $stderr"; return 1; }
    [[ "$stderr" == *"$2"* ]] || { echo "stderr lacks '$2': $stderr"; return 1; }
}
