#!/usr/bin/env bats
# Interop both ways with an independent implementation of man/kvc.5 in
# Python+numpy (tests/interop/kvc_py.py, no shared code, no safetensors):
# files kvtools writes are read there value by value, files written there
# are read by kv-info.
load helper
bats_require_minimum_version 1.5.0

setup() {
    SAMPLE_BIN="$ROOT/${KV_BUILD:-build}/unit/test_kvc"
    [ -x "$SAMPLE_BIN" ] || { echo "missing $SAMPLE_BIN: build the unit tests (make unit-bins)"; return 1; }
    KVPY="$ROOT/tests/interop/kvc_py.py"
}

@test "a .kvc written by kvtools is read by the Python reader with identical arrays" {
    "$SAMPLE_BIN" --write-sample "$BATS_TEST_TMPDIR/s.kvc"
    run "$PY" "$KVPY" check-sample "$BATS_TEST_TMPDIR/s.kvc"
    assert_success
    assert_output "ok: 16 tensors, 46 metadata keys"
}

@test "a zstd-compressed .kvc written by kvtools is read by the Python reader" {
    "$SAMPLE_BIN" --write-sample "$BATS_TEST_TMPDIR/s.kvc" --zstd
    run "$PY" "$KVPY" check-sample "$BATS_TEST_TMPDIR/s.kvc"
    assert_success
}

@test "the Python reader notices a changed value in a kvtools file" {
    "$SAMPLE_BIN" --write-sample "$BATS_TEST_TMPDIR/s.kvc"
    "$PY" "$KVPY" corrupt checksum "$BATS_TEST_TMPDIR/s.kvc" "$BATS_TEST_TMPDIR/bad.kvc"
    run "$PY" "$KVPY" check-sample "$BATS_TEST_TMPDIR/bad.kvc"
    assert_failure 1
    assert_output --partial "checksum mismatch"
}

@test "a minimal Python-written .kvc without metadata gets its geometry from the shapes" {
    "$PY" "$KVPY" write-minimal "$BATS_TEST_TMPDIR/min.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/min.kvc"
    assert_success
    [ "$(json_get 'j["n_layers"], j["n_kv_heads"], j["n_tokens"], j["head_dim"]')" = "(2, 1, 3, 2)" ]
    [ "$(json_get 'j["rope"]["theta"], j["rope"]["layout"], j["rope"]["keys_roped"], j["checksums"]')" = "(10000, 'interleaved', True, 'absent')" ]
    [ "$(json_get '[l["k"]["encoding"] for l in j["layers"]]')" = "['f16', 'f16']" ]
}

@test "a full Python-written .kvc has its checksums verified by kv-info" {
    "$PY" "$KVPY" write-full "$BATS_TEST_TMPDIR/full.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/full.kvc"
    assert_success
    [ "$(json_get 'j["checksums"], j["checksummed_tensors"], j["tensors"]')" = "('verified', 7, 7)" ]
    [ "$(json_get 'j["n_layers"], j["n_heads"], j["n_kv_heads"], j["head_dim"], j["n_tokens"], j["n_q"]')" = "(2, 4, 2, 8, 6, 3)" ]
    [ "$(json_get 'j["model"], j["rope"]["layout"], [l["k"]["encoding"] for l in j["layers"]]')" = "('python-writer', 'halves', ['bf16', 'bf16'])" ]
}

@test "kv-info rejects a Python-written .kvc whose data no longer matches its checksum" {
    "$PY" "$KVPY" write-full "$BATS_TEST_TMPDIR/full.kvc"
    "$PY" "$KVPY" corrupt checksum "$BATS_TEST_TMPDIR/full.kvc" "$BATS_TEST_TMPDIR/bad.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/bad.kvc"
    assert_fails_with 65 "checksum mismatch"
}

@test "the Python reader and kv-info agree on a file kvtools wrote" {
    "$SAMPLE_BIN" --write-sample "$BATS_TEST_TMPDIR/s.kvc"
    run --separate-stderr kv-info "$BATS_TEST_TMPDIR/s.kvc"
    assert_success
    info="$output"
    run "$PY" "$KVPY" summary "$BATS_TEST_TMPDIR/s.kvc"
    assert_success
    [ "$(json_get 'j["n_layers"], j["tensors"], j["checksums"]')" = "$(output="$info" json_get 'j["n_layers"], j["tensors"], j["checksummed_tensors"]')" ]
}
