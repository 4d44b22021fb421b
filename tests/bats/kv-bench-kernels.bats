#!/usr/bin/env bats
# kv-bench attn and kv-bench pack (kernel benchmarks): options, errors and
# the CPU-only packing measurement; the GPU measurements themselves run on
# the device (tools/device/run-kernels.sh), not here.
load helper

@test "kv-bench attn --help lists its options and exits 0" {
    run --separate-stderr kv-bench attn --help
    [ "$status" -eq 0 ]
    [[ "$output" == *"--contexts"* ]]
    [[ "$output" == *"--check"* ]]
}

@test "kv-bench attn rejects a context that is not a number with exit 64" {
    run --separate-stderr kv-bench attn --contexts 8192,lots
    assert_fails_with 64 "contexts"
}

@test "kv-bench attn rejects 6 query heads over 4 KV heads with exit 64" {
    run --separate-stderr kv-bench attn --heads 6 --kv-heads 4
    assert_fails_with 64 "multiple"
}

@test "kv-bench attn rejects a packed-kernel variant it does not have with exit 64" {
    run --separate-stderr kv-bench attn --kivi2-variant 5
    assert_fails_with 64 "--kivi2-variant 5"
    [ -z "$output" ]
}

@test "kv-bench attn rejects 6 fp16 rows in flight per lane with exit 64" {
    run --separate-stderr kv-bench attn --f16-unroll 6
    assert_fails_with 64 "--f16-unroll must be 4 or 8"
}

@test "kv-bench attn rejects launch level 1 with exit 64" {
    run --separate-stderr kv-bench attn --pdl 1
    assert_fails_with 64 "--pdl must be 0 or 2"
}

@test "kv-bench attn rejects a grid of no waves with exit 64" {
    run --separate-stderr kv-bench attn --f16-waves 0
    assert_fails_with 64 "--f16-waves"
}

@test "kv-bench attn --help lists the kernel variant options" {
    run --separate-stderr kv-bench attn --help
    assert_success
    for o in --f16-legacy --f16-prefetch --f16-unroll --f16-waves --kivi2-variant --kivi-kernel \
        --kivi3-stages --kivi3-combine --kivi3-fused --kivi3-blocks --kivi3-diag --kivi3-no-prefetch --kivi3-zsum-alu; do
        [[ "$output" == *"$o"* ]] || { echo "help lacks $o"; return 1; }
    done
}

@test "kv-bench attn rejects a packed kernel other than 2 or 3 with exit 64" {
    run --separate-stderr kv-bench attn --kivi-kernel 1
    assert_fails_with 64 "--kivi-kernel"
    [ -z "$output" ]
    run --separate-stderr kv-bench attn --kivi-kernel 4
    assert_fails_with 64 "--kivi-kernel"
}

@test "kv-bench attn rejects 5 stages per warp for the v3 kernel with exit 64" {
    run --separate-stderr kv-bench attn --kivi3-stages 5
    assert_fails_with 64 "--kivi3-stages"
    run --separate-stderr kv-bench attn --kivi3-blocks 0
    assert_fails_with 64 "--kivi3-blocks"
    run --separate-stderr kv-bench attn --kivi3-diag 5
    assert_fails_with 64 "--kivi3-diag"
}

@test "kv-bench attn takes the v3 kernel and its variants and gets past option parsing" {
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        skip "a GPU is present: the benchmark would run"
    fi
    run --separate-stderr kv-bench attn --contexts 1024 --kivi-kernel 3 --kivi3-stages 4 \
        --kivi3-fused --kivi3-blocks 2 --kivi3-diag 4 --kivi3-no-prefetch --kivi3-zsum-alu
    assert_fails_with 69 "GPU"
}

@test "kv-bench attn exits 69 with a message when no GPU is usable" {
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        skip "a GPU is present: the benchmark would run"
    fi
    run --separate-stderr kv-bench attn --contexts 1024
    assert_fails_with 69 "GPU"
}

@test "kv-bench pack rejects 3 bits with exit 64" {
    run --separate-stderr kv-bench pack --cpu-only --bits 1,3
    assert_fails_with 64 "bits"
}

@test "kv-bench pack --cpu-only reports a CPU packing rate per bit width as JSON" {
    run --separate-stderr kv-bench pack --cpu-only --cpu-context 512 --reps 1 --bits 1,2
    [ "$status" -eq 0 ]
    [ "$(json_get 'len(j["results"])')" -eq 2 ]
    [ "$(json_get 'j["results"][1]["bits"]')" -eq 2 ]
    [ "$(json_get 'j["results"][0]["cpu_1thread_input_bytes_per_s"] > 0')" = True ]
    [ "$(json_get '"gpu_us" in j["results"][0]')" = False ]
}

@test "kv-bench's man page documents every subcommand's options and every exit status" {
    for sub in attn pack ruler fidelity decode; do
        run "$ROOT/tests/man-covers-help.sh" "$ROOT/man/kv-bench.1" kv-bench "$sub"
        assert_success
    done
}

@test "kv-bench decode --help states the exit status table exactly once" {
    run --separate-stderr kv-bench decode --help
    assert_success
    [ "$(grep -c '^Exit status:' <<<"$output")" -eq 1 ]
    [[ "$output" == *"--policies"* ]]
}

@test "kv-bench decode rejects launch level 3 with exit 64" {
    run --separate-stderr kv-bench decode --pdl 3
    assert_fails_with 64 "--pdl expects an integer in [0, 2]"
    [ -z "$output" ]
}

@test "kv-bench decode rejects a selection-skip mask beyond the five steps with exit 64" {
    run --separate-stderr kv-bench decode --sel-skip 32
    assert_fails_with 64 "--sel-skip expects an integer in [0, 31]"
}

@test "kv-bench decode with a valid --pdl and --sel-skip gets past option parsing" {
    if nvidia-smi -L >/dev/null 2>&1; then skip "a GPU is present: the benchmark would run"; fi
    run --separate-stderr kv-bench decode --pdl 0 --sel-skip 4 -c 1024 -n 2 --synthetic tiny
    [ "$status" -eq 69 ]
}

@test "kv-bench decode takes the resident and page hybrids by name and refuses an unknown one (64)" {
    run --separate-stderr kv-bench decode --policies hybrid-resident,hybridx
    assert_fails_with 64 "unknown policy 'hybridx'"
    run --separate-stderr kv-bench decode --help
    [ "$status" -eq 0 ]
    [[ "$output" == *"hybrid-resident,hybrid-pages"* ]]
    if nvidia-smi -L >/dev/null 2>&1; then skip "a GPU is present: the benchmark would run"; fi
    run --separate-stderr kv-bench decode --policies hybrid-resident,hybrid-pages -c 1024 -n 2 --synthetic tiny
    [ "$status" -eq 69 ]
}

@test "kv-bench decode takes step variants joined by + and refuses an unknown word or a repeat (64)" {
    run --separate-stderr kv-bench decode --variants base,wide+fast
    assert_fails_with 64 "'fast' is not one of serial, wide, cache"
    [ -z "$output" ]
    run --separate-stderr kv-bench decode --variants wide,wide
    assert_fails_with 64 "'wide' twice"
    run --separate-stderr kv-bench decode --variants cache+
    assert_fails_with 64 "ends in '+'"
    run --separate-stderr kv-bench decode --help
    [ "$status" -eq 0 ]
    [[ "$output" == *"--variants"* ]]
    if nvidia-smi -L >/dev/null 2>&1; then skip "a GPU is present: the benchmark would run"; fi
    run --separate-stderr kv-bench decode --variants base,serial,wide+cache --policies hybrid-resident \
        -c 1024 -n 2 --synthetic tiny
    [ "$status" -eq 69 ]
}

@test "kv-bench decode takes --graph on, off or both and refuses another word with exit 64" {
    run --separate-stderr kv-bench decode --graph sometimes
    assert_fails_with 64 "--graph must be on, off or both"
    [ -z "$output" ]
    run --separate-stderr kv-bench decode --help
    [ "$status" -eq 0 ]
    [[ "$output" == *"--graph"* ]]
    if nvidia-smi -L >/dev/null 2>&1; then skip "a GPU is present: the benchmark would run"; fi
    for g in on off both; do
        run --separate-stderr kv-bench decode --graph "$g" -c 1024 -n 2 --synthetic tiny
        [ "$status" -eq 69 ]
    done
}

@test "kv-bench decode takes the selection variants classic, ahead2, chainN and gatherN and refuses a bad N (64)" {
    run --separate-stderr kv-bench decode --variants chain0
    assert_fails_with 64 "'chain0' is not one of serial, wide, cache, classic, ahead2, chainN, gatherN"
    run --separate-stderr kv-bench decode --variants gather4x
    assert_fails_with 64 "'gather4x' is not one of"
    run --separate-stderr kv-bench decode --variants chain1000
    assert_fails_with 64 "'chain1000' is not one of"
    run --separate-stderr kv-bench decode --help
    [[ "$output" == *"ahead2"* ]]
    if nvidia-smi -L >/dev/null 2>&1; then skip "a GPU is present: the benchmark would run"; fi
    run --separate-stderr kv-bench decode --variants base,classic,ahead2,chain4+gather1,chainall+gatherall \
        --policies hybrid-resident -c 1024 -n 2 --synthetic tiny
    [ "$status" -eq 69 ]
}

@test "kv-bench decode and ruler take the chain words late, early, nopdl, collect, hist and everyN and refuse a misspelt one (64)" {
    run --separate-stderr kv-bench decode --variants late+colect
    assert_fails_with 64 "'colect' is not one of serial, wide, cache, classic, ahead2, chainN, gatherN, late, early, nopdl, collect, direct, hist, everyN"
    [ -z "$output" ]
    run --separate-stderr kv-bench ruler --gpu-step nopdl+lat
    assert_fails_with 64 "'lat' is not one of"
    run --separate-stderr kv-bench decode --variants late,late
    assert_fails_with 64 "'late' twice"
    run --separate-stderr kv-bench decode --variants every1
    assert_fails_with 64 "'every1' is not one of"
    run --separate-stderr kv-bench ruler --gpu-step everyall
    assert_fails_with 64 "'everyall' is not one of"
    run --separate-stderr kv-bench decode --help
    [[ "$output" == *"collect"* && "$output" == *"nopdl"* ]]
    run --separate-stderr kv-bench ruler --help
    [[ "$output" == *"collect"* ]]
    if nvidia-smi -L >/dev/null 2>&1; then skip "a GPU is present: the benchmark would run"; fi
    run --separate-stderr kv-bench decode --variants base,late,nopdl+collect,early+hist,late+collect+chain16,every2+cache,late+direct \
        --policies hybrid-resident -c 1024 -n 2 --synthetic tiny
    [ "$status" -eq 69 ]
}

@test "kv-bench decode without a usable GPU exits 69 with one message" {
    if nvidia-smi -L >/dev/null 2>&1; then skip "a GPU is present"; fi
    run --separate-stderr kv-bench decode -c 1024 -n 2 --synthetic tiny
    [ "$status" -eq 69 ]
    [ -z "$output" ]
    [ "$(wc -l <<<"$stderr")" -eq 1 ]
}

@test "kv-bench rejects an unknown subcommand with one line and a short usage (64)" {
    run --separate-stderr kv-bench nope
    assert_fails_with 64 "unknown subcommand 'nope'"
    [ "$(printf '%s\n' "$stderr" | wc -l)" -le 3 ]
    [ -z "$output" ]
}

@test "kv-bench without a subcommand is a usage error (64)" {
    run --separate-stderr kv-bench
    assert_fails_with 64 "missing subcommand"
}

@test "kv-bench ruler reports a directory given as --tasks with exit 66" {
    run --separate-stderr kv-bench ruler -m "$DATA/niah4k/niah4k.bin" -t "$DATA/niah4k/tok259.bin" --tasks "$BATS_TEST_TMPDIR"
    assert_fails_with 66 "is a directory"
}

@test "kv-bench decode takes --device as every tool spells it and refuses cpu (64)" {
    run --separate-stderr kv-bench decode -c 1024 -n 2 --synthetic tiny --device cpu
    assert_fails_with 64 "runs on the GPU"
    run --separate-stderr kv-bench decode -c 1024 -n 2 --synthetic tiny --device gpu
    assert_fails_with 64 "--device must be cpu, cuda or auto"
}

@test "kv-bench gemv --help lists its options and the variants" {
    run --separate-stderr kv-bench gemv --help
    assert_success
    for o in --types --shapes --variants --iters --reps --no-check; do
        [[ "$output" == *"$o"* ]] || { echo "help lacks $o"; return 1; }
    done
    [[ "$output" == *"packed kernels from old rows dp4a (default all)"* ]]
}

@test "kv-bench gemv rejects a weight type it does not time with exit 64" {
    run --separate-stderr kv-bench gemv --types q4_k,q5_k
    assert_fails_with 64 "unknown type 'q5_k'"
    [ -z "$output" ]
}

@test "kv-bench gemv rejects a variant it does not have with exit 64" {
    run --separate-stderr kv-bench gemv --variants old,fast
    assert_fails_with 64 "--variants: 'fast' is not old, rows or dp4a"
    # default is kv-run's choice per type and shape, not a kernel to time
    run --separate-stderr kv-bench gemv --variants default
    assert_fails_with 64 "--variants: 'default' is not old, rows or dp4a"
}

@test "kv-bench gemv rejects a shape that is not ROWSxCOLS with exit 64" {
    run --separate-stderr kv-bench gemv --shapes 2048x2048,2048
    assert_fails_with 64 "'2048' is not ROWSxCOLS"
}

@test "kv-bench gemv rejects columns that are not a multiple of the Q4_K block with exit 64" {
    run --separate-stderr kv-bench gemv --types q4_k --shapes 64x1000
    assert_fails_with 64 "not a multiple of the q4_k block (256)"
}

@test "kv-bench gemv exits 69 with a message when no GPU is usable" {
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        skip "a GPU is present: the benchmark would run"
    fi
    run --separate-stderr kv-bench gemv --types q4_k --shapes 64x256 --reps 1 --iters 1
    assert_fails_with 69 "GPU"
    [ -z "$output" ]
}

@test "kv-bench's man page documents kv-bench gemv's options" {
    run "$ROOT/tests/man-covers-help.sh" "$ROOT/man/kv-bench.1" kv-bench gemv
    assert_success
}
