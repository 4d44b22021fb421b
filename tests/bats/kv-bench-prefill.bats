#!/usr/bin/env bats
# kv-bench prefill (the GPU prefill benchmark): options, usage errors and the
# refusal without a GPU; the measurement itself runs on the device
# (tools/device/prefill.sh), not here.
load helper

@test "kv-bench prefill --help lists its options and states the exit status table once" {
    run --separate-stderr kv-bench prefill --help
    assert_success
    [[ "$output" == *"--chunk"* ]]
    [[ "$output" == *"--variants"* ]]
    [ "$(grep -c '^Exit status:' <<<"$output")" -eq 1 ]
}

@test "kv-bench prefill's options are all in the man page" {
    run "$ROOT/tests/man-covers-help.sh" "$ROOT/man/kv-bench.1" kv-bench prefill
    assert_success
}

@test "kv-bench prefill rejects a chunk of 3 rows with exit 64" {
    run --separate-stderr kv-bench prefill --chunk 3
    assert_fails_with 64 "chunk"
}

@test "kv-bench prefill rejects an f32 weight type with exit 64" {
    run --separate-stderr kv-bench prefill --wtype f32
    assert_fails_with 64 "wtype"
}

@test "kv-bench prefill rejects a context list with a word in it with exit 64" {
    run --separate-stderr kv-bench prefill -c 8192,long
    assert_fails_with 64 "contexts"
}

@test "kv-bench prefill rejects attention variant 99 with exit 64" {
    run --separate-stderr kv-bench prefill --variant 99
    assert_fails_with 64 "variant"
}

@test "kv-bench prefill without a usable GPU exits 69 with one message and no output" {
    if nvidia-smi -L >/dev/null 2>&1; then skip "a GPU is present"; fi
    run --separate-stderr kv-bench prefill -c 1024 --synthetic tiny
    [ "$status" -eq 69 ]
    [ -z "$output" ]
    [ "$(wc -l <<<"$stderr")" -eq 1 ]
    [[ "$stderr" == *"GPU"* ]]
}

@test "kv-bench lists prefill among its subcommands" {
    run --separate-stderr kv-bench --help
    assert_success
    [[ "$output" == *"prefill"* ]]
}

@test "kv-bench decode rejects an unknown --context with exit 64" {
    run --separate-stderr kv-bench decode --context sometimes
    assert_fails_with 64 "context"
}

@test "kv-bench decode --help offers a real prefill as the context" {
    run --separate-stderr kv-bench decode --help
    assert_success
    [[ "$output" == *"--context"* ]]
    [[ "$output" == *"prefill"* ]]
}

@test "kv-bench decode rejects an unknown --prefill-copy with exit 64 and documents it" {
    run --separate-stderr kv-bench decode --prefill-copy later
    assert_fails_with 64 "--prefill-copy must be overlap or sync"
    run "$ROOT/tests/man-covers-help.sh" "$ROOT/man/kv-bench.1" kv-bench decode
    assert_success
}
