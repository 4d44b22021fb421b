#!/usr/bin/env bats
# kv-info: the front-end conventions, the summary (JSON and table), stdin and
# zstd input, and one test per corrupt-file case (each exit 65 with its
# message).  Corrupt files are made from a valid sample by tests/interop/kvc_py.py.
load helper
bats_require_minimum_version 1.5.0

setup() {
    SAMPLE_BIN="$ROOT/${KV_BUILD:-build}/unit/test_kvc"
    [ -x "$SAMPLE_BIN" ] || { echo "missing $SAMPLE_BIN: build the unit tests (make unit-bins)"; return 1; }
    KVPY="$ROOT/tests/interop/kvc_py.py"
    S="$BATS_TEST_TMPDIR/sample.kvc"
    "$SAMPLE_BIN" --write-sample "$S"
}

# corrupt_case CASE MESSAGE: kv-info must exit 65 and say MESSAGE.
corrupt_case() {
    "$PY" "$KVPY" corrupt "$1" "$S" "$BATS_TEST_TMPDIR/bad.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/bad.kvc"
    assert_fails_with 65 "$2"
    [ -z "$output" ]
}

@test "kv-info --help prints usage on stdout and exits 0" {
    run --separate-stderr kv-info --help
    assert_success
    assert_output --partial "usage: kv-info"
    assert_output --partial "--json"
    [ -z "$stderr" ]
}

@test "kv-info --version names the kvc format version" {
    run kv-info --version
    assert_success
    assert_output --partial "kvc format version 1"
}

@test "kv-info rejects an unknown option with exit 64" {
    run --separate-stderr kv-info --no-such-option "$S"
    assert_fails_with 64 "unknown option"
    [ -z "$output" ]
}

@test "kv-info without a file is a usage error (exit 64)" {
    run --separate-stderr kv-info
    assert_fails_with 64 "no input file"
}

@test "kv-info reports a missing file with exit 66" {
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/nope.kvc"
    assert_fails_with 66 "nope.kvc: cannot open"
}

@test "kv-info reports a directory with exit 66" {
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR"
    assert_fails_with 66 "is a directory"
}

@test "kv-info writes JSON with the geometry when stdout is a pipe" {
    run --separate-stderr kv-info "$S"
    assert_success
    [ "$(json_get 'j["n_layers"], j["n_heads"], j["n_kv_heads"], j["head_dim"], j["n_tokens"], j["n_q"]')" = "(3, 4, 2, 4, 5, 2)" ]
    [ "$(json_get 'j["model"], j["has_tokens"], j["zstd"], j["format_version"]')" = "('sample', True, False, 1)" ]
    [ "$(json_get 'j["rope"]["theta"], j["rope"]["scaling"], j["rope"]["layout"], j["rope"]["factor"]')" = "(500000, 'llama3', 'halves', 8)" ]
    [ "$(json_get 'j["checksums"], j["checksummed_tensors"], j["tensors"]')" = "('verified', 16, 16)" ]
}

@test "kv-info reports per-layer encodings, bytes and the ratio against F16" {
    run --separate-stderr kv-info --json "$S"
    assert_success
    [ "$(json_get '[(l["k"]["encoding"], l["v"]["encoding"]) for l in j["layers"]]')" = "[('f32', 'f32'), ('f16', 'bf16'), ('kivi', 'kivi')]" ]
    [ "$(json_get '(j["layers"][2]["k"]["bits"], j["layers"][2]["k"]["group"], j["layers"][2]["k"]["residual"])')" = "(2, 2, 2)" ]
    # F32 layer 0: K and V are 2*5*4 floats each; its queries add 4*2*4 floats.
    [ "$(json_get 'j["layers"][0]["kv_bytes"], j["layers"][0]["bytes"]')" = "(320, 448)" ]
    [ "$(json_get 'j["f16_kv_bytes"] == 3*2*2*5*4*2, sum(l["kv_bytes"] for l in j["layers"]) == j["kv_bytes"]')" = "(True, True)" ]
    [ "$(json_get 'abs(j["ratio_vs_f16"] - j["f16_kv_bytes"] / j["kv_bytes"]) < 1e-9')" = "True" ]
}

@test "kv-info prints a table on a terminal" {
    command -v script >/dev/null || skip "script(1) not installed"
    run script -qec "kv-info '$S'" /dev/null
    assert_success
    assert_output --partial "geometry   3 layers, 4 heads, 2 kv heads, head dim 4"
    assert_output --partial "kivi2 g2 r2"
    assert_output --partial "checksums  verified"
}

# no_raw_control TEXT: TEXT holds no ESC, BEL or C1 CSI byte
no_raw_control() {
    printf '%s' "$1" | "$PY" -c 'import sys; b=sys.stdin.buffer.read(); sys.exit(any(c in b for c in (0x1b, 0x07, 0x9b)))'
}

@test "kv-info escapes control characters from the file in its messages and its table" {
    "$PY" "$KVPY" corrupt escape-key "$S" "$BATS_TEST_TMPDIR/bad.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/bad.kvc"
    assert_fails_with 65 'metadata key '"'"'\x1b]0;pwned\x07\xc2\x9b31m'"'"
    no_raw_control "$stderr"
    "$PY" "$KVPY" corrupt escape-model "$S" "$BATS_TEST_TMPDIR/m.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/m.kvc"
    assert_success
    [ "$(json_get 'j["model"]')" = "$(printf '\033]0;pwned\007\033[31mred')" ] # JSON keeps the value
    if command -v script >/dev/null; then
        run script -qec "kv-info '$BATS_TEST_TMPDIR/m.kvc'" /dev/null
        assert_success
        assert_output --partial 'model      \x1b]0;pwned\x07\x1b[31mred'
        no_raw_control "$output"
    fi
    run --separate-stderr kv-info "$(printf -- '--\033]0;x\007')"
    assert_fails_with 64 "unknown option '--\x1b]0;x\x07'"
    no_raw_control "$stderr"
    run --separate-stderr kv-tree "$(printf 'sub\033[2J')"
    assert_fails_with 64 "unknown subcommand 'sub\x1b[2J'"
    no_raw_control "$stderr"
}

@test "kv-info reads a .kvc from stdin" {
    run --separate-stderr kv-info - <"$S"
    assert_success
    [ "$(json_get 'j["file"], j["n_layers"], j["checksums"]')" = "('-', 3, 'verified')" ]
    run --separate-stderr bash -c "cat '$S' | kv-info -"
    assert_success
    [ "$(json_get 'j["n_tokens"]')" = "5" ]
}

@test "kv-info reads zstd-compressed input from a pipe" {
    run --separate-stderr bash -c "zstd -q -c '$S' | kv-info -"
    assert_success
    [ "$(json_get 'j["zstd"], j["n_layers"], j["checksums"]')" = "(True, 3, 'verified')" ]
}

@test "kv-info reads a file the library wrote zstd-compressed" {
    "$SAMPLE_BIN" --write-sample "$BATS_TEST_TMPDIR/z.kvc" --zstd
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/z.kvc"
    assert_success
    [ "$(json_get 'j["zstd"], j["file_bytes"] < j["total_bytes"] + 2000')" = "(True, True)" ]
}

@test "kv-info says checksums are absent for a file without metadata" {
    "$PY" "$KVPY" write-minimal "$BATS_TEST_TMPDIR/min.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/min.kvc"
    assert_success
    [ "$(json_get 'j["checksums"], j["n_heads"], j["n_q"]')" = "('absent', 0, 0)" ]
}

@test "kv-info summarises several files as a JSON array" {
    cp "$S" "$BATS_TEST_TMPDIR/two.kvc"
    run --separate-stderr kv-info "$S" "$BATS_TEST_TMPDIR/two.kvc"
    assert_success
    [ "$(json_get 'len(j), j[1]["file"].endswith("two.kvc")')" = "(2, True)" ]
}

@test "kv-info still summarises good files when one is bad, and exits 65" {
    printf 'not a kvc' >"$BATS_TEST_TMPDIR/junk.kvc"
    run --separate-stderr kv-info "$S" "$BATS_TEST_TMPDIR/junk.kvc"
    assert_fails_with 65 "junk.kvc"
    [ "$(json_get 'len(j), j[0]["n_layers"]')" = "(1, 3)" ]
}

@test "kv-info rejects an empty file with exit 65" {
    : >"$BATS_TEST_TMPDIR/empty.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/empty.kvc"
    assert_fails_with 65 "empty file"
}

@test "kv-info rejects a file cut short by one byte with exit 65" {
    head -c "$(($(stat -c %s "$S") - 1))" "$S" >"$BATS_TEST_TMPDIR/bad.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/bad.kvc"
    assert_fails_with 65 "truncated"
}

@test "kv-info rejects a file cut inside its header with exit 65" {
    head -c 100 "$S" >"$BATS_TEST_TMPDIR/bad.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/bad.kvc"
    assert_fails_with 65 "past end of file"
}

@test "kv-info rejects a file shorter than the length field with exit 65" {
    head -c 5 "$S" >"$BATS_TEST_TMPDIR/bad.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/bad.kvc"
    assert_fails_with 65 "shorter than the 8-byte header length"
}

@test "kv-info rejects a truncated data section with exit 65" { corrupt_case truncated "truncated: tensor"; }
@test "kv-info rejects a header length past the end of the file with exit 65" { corrupt_case header-past-eof "past end of file"; }
@test "kv-info rejects an absurd header length with exit 65" { corrupt_case header-absurd "is absurd"; }
@test "kv-info rejects malformed JSON with exit 65" { corrupt_case bad-json "malformed JSON header"; }
@test "kv-info rejects a header that is not a JSON object with exit 65" { corrupt_case not-object "not a JSON object"; }
@test "kv-info rejects a metadata value that is not a string with exit 65" { corrupt_case meta-not-string "value is not a string"; }
@test "kv-info rejects an unknown dtype with exit 65" { corrupt_case unknown-dtype "unknown dtype 'F64'"; }
@test "kv-info rejects a negative dimension with exit 65" { corrupt_case negative-dim "negative dimension"; }
@test "kv-info rejects a shape that does not match the byte size with exit 65" { corrupt_case size-mismatch "shape needs"; }
@test "kv-info rejects data offsets out of order with exit 65" { corrupt_case offsets-reversed "out of order"; }
@test "kv-info rejects overlapping tensors with exit 65" { corrupt_case overlap "overlaps"; }
@test "kv-info rejects a hole between tensors with exit 65" { corrupt_case hole "hole of 4 bytes"; }
@test "kv-info rejects a checksum mismatch with exit 65" { corrupt_case checksum "checksum mismatch in tensor layers.0.k"; }
@test "kv-info rejects metadata that disagrees with the shapes with exit 65" { corrupt_case geometry "kvc.n_kv_heads=3 but the tensors have 2"; }
@test "kv-info rejects a layer without values with exit 65" { corrupt_case missing-layer "layer 0 has no values"; }
@test "kv-info rejects a newer format version with exit 65" { corrupt_case version "kvc version 2"; }
@test "kv-info rejects a kvtools file whose crc32c key was renamed with exit 65" { corrupt_case crc-key-renamed "tensor layers.0.k has no checksum, but the writer checksummed all"; }

@test "kv-info reports partial checksums in a file whose writer did not claim them all" {
    "$PY" "$KVPY" corrupt crc-key-renamed "$S" "$BATS_TEST_TMPDIR/p.kvc"
    "$PY" - "$BATS_TEST_TMPDIR/p.kvc" <<'EOF'
import json, struct, sys
raw = open(sys.argv[1], 'rb').read()
(n,) = struct.unpack('<Q', raw[:8])
h = json.loads(raw[8:8 + n]); h['__metadata__'].pop('kvc.checksums')
t = json.dumps(h, separators=(',', ':')).encode(); t += b' ' * ((-(8 + len(t))) % 64)
open(sys.argv[1], 'wb').write(struct.pack('<Q', len(t)) + t + raw[8 + n:])
EOF
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/p.kvc"
    assert_success
    [ "$(json_get 'j["checksums"]')" = partial ]
}

@test "kv-info's man page documents every option its --help lists and every exit status" {
    run "$ROOT/tests/man-covers-help.sh" "$ROOT/man/kv-info.1" kv-info
    assert_success
}

# pos_file PATH POSITIONS...: a one-layer F16 file with a positions tensor
pos_file() {
    local out=$1; shift
    "$PY" -c "
import sys; sys.path.insert(0, '$ROOT/tests/interop')
import numpy as np, kvc_py as k
p = np.array([int(x) for x in sys.argv[2:]], dtype=np.int32); T = len(p)
z = np.zeros((1, T, 2), dtype=np.float16)
k.write_kvc(sys.argv[1], [('layers.0.k', 'F16', z), ('layers.0.v', 'F16', z), ('tokens', 'I32', p + 5),
                          ('positions', 'I32', p)], checksums=True)" "$out" "$@"
}

@test "kv-info shows a token subset's positions: count, first, last and whether contiguous" {
    pos_file "$BATS_TEST_TMPDIR/p.kvc" 3 4 9 12
    run --separate-stderr kv-info --json "$BATS_TEST_TMPDIR/p.kvc"
    assert_success
    [ "$(json_get 'j["positions"]')" = "{'count': 4, 'first': 3, 'last': 12, 'contiguous': False}" ]
    pos_file "$BATS_TEST_TMPDIR/c.kvc" 7 8 9
    run --separate-stderr kv-info --json "$BATS_TEST_TMPDIR/c.kvc"
    [ "$(json_get 'j["positions"]["contiguous"], j["positions"]["count"]')" = "(True, 3)" ]
    run --separate-stderr kv-info --json "$S"
    [ "$(json_get 'j["positions"]')" = None ]
    run script -qc "kv-info $BATS_TEST_TMPDIR/p.kvc" /dev/null
    assert_output --partial "positions  4 (a token subset): first 3, last 12, with gaps"
}

@test "kv-info rejects positions that go backwards or are negative with exit 65" {
    pos_file "$BATS_TEST_TMPDIR/b.kvc" 3 9 4
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/b.kvc"
    assert_fails_with 65 "strictly increasing"
    pos_file "$BATS_TEST_TMPDIR/n.kvc" -1 2
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/n.kvc"
    assert_fails_with 65 "is negative"
}
