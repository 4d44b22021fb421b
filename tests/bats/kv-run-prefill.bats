#!/usr/bin/env bats
# kv-run --prefill-chunk (the GPU engine's chunked prefill): parsing here;
# the GPU prefill itself is checked on the device (tests/unit/test_cuda_prefill.c,
# tools/device/prefill.sh).
load helper

@test "kv-run rejects a negative --prefill-chunk with exit 64" {
    run --separate-stderr kv-run -m "$DATA/stories260K/stories260K.bin" --prefill-chunk -5 -n 1
    assert_fails_with 64 "prefill-chunk"
}

@test "kv-run rejects a --prefill-chunk that is not a number with exit 64" {
    run --separate-stderr kv-run -m "$DATA/stories260K/stories260K.bin" --prefill-chunk big -n 1
    assert_fails_with 64 "prefill-chunk"
}

@test "kv-run on the CPU takes --prefill-chunk and generates as without it" {
    run --separate-stderr kv-run -m "$DATA/stories260K/stories260K.bin" -p "Once upon a time" -n 12 --prefill-chunk 256
    assert_success
    local with="$output"
    run --separate-stderr kv-run -m "$DATA/stories260K/stories260K.bin" -p "Once upon a time" -n 12
    assert_success
    [ "$output" = "$with" ]
}

@test "kv-run --help lists --prefill-chunk" {
    run --separate-stderr kv-run --help
    assert_success
    [[ "$output" == *"--prefill-chunk"* ]]
}

@test "kv-run --help lists every GPU GEMV variant" {
    run --separate-stderr kv-run --help
    assert_success
    [[ "$output" == *"--gemv-variant NAME"*"for measurement: default old rows dp4a"* ]]
}

@test "kv-run rejects a GPU GEMV variant it does not have with exit 64" {
    run --separate-stderr kv-run -m "$DATA/stories260K/stories260K.bin" --gemv-variant fast -n 1
    assert_fails_with 64 "--gemv-variant: 'fast' is not default, old, rows or dp4a"
    [ -z "$output" ]
}

@test "kv-run takes a GPU GEMV variant on the CPU too (the CPU engine ignores it)" {
    run --separate-stderr kv-run -m "$DATA/stories260K/stories260K.bin" -p "Once upon a time" -n 12 --gemv-variant dp4a
    assert_success
    local with="$output"
    run --separate-stderr kv-run -m "$DATA/stories260K/stories260K.bin" -p "Once upon a time" -n 12
    assert_success
    [ "$output" = "$with" ]
}

@test "kv-run rejects a --graph that is not on, off or auto with exit 64" {
    run --separate-stderr kv-run -m "$DATA/stories260K/stories260K.bin" --graph sometimes -n 1
    assert_fails_with 64 "--graph must be on, off or auto"
    [ -z "$output" ]
}

@test "kv-run takes --graph on the CPU too, generates the same text, and reports graph as null there" {
    run --separate-stderr kv-run -m "$DATA/stories260K/stories260K.bin" -p "Once upon a time" -n 12 --graph off \
        --report "$BATS_TEST_TMPDIR/r.json"
    assert_success
    local with="$output"
    run --separate-stderr kv-run -m "$DATA/stories260K/stories260K.bin" -p "Once upon a time" -n 12
    assert_success
    [ "$output" = "$with" ]
    output=$(cat "$BATS_TEST_TMPDIR/r.json")
    [ "$(json_get 'j["graph"] is None')" = "True" ]
    run --separate-stderr kv-run --help
    [[ "$output" == *"--graph"* ]]
}
