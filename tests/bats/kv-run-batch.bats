#!/usr/bin/env bats
# kv-run --batch (issue 10): B prompts decoded greedily, one JSON line per
# sequence on stdout.  On the CPU (what make check has) the sequences run one
# after another, so each line must equal the same prompt run alone; the
# option checks, the prompt file's rules, the report and the errors; and
# kv-bench decode --batch's options (its runs need a GPU: exit 69 here).
# The GPU's batched-equals-alone check is tests/unit/test_gpu_batch.c.
load helper
bats_require_minimum_version 1.5.0

S260="$DATA/stories260K"
MODEL="$S260/stories260K.bin"

# jsonl_get N 'expr': the expression on line N (from 0) of $output, bound to j
jsonl_get() {
    printf '%s\n' "$output" | "$PY" -c 'import json,sys; L=[l for l in sys.stdin.read().splitlines() if l]; j=json.loads(L[int(sys.argv[1])]); print(eval(sys.argv[2]))' "$1" "$2"
}

setup() {
    TMP="$(mktemp -d)"
    printf 'Once upon a time\n\n  \t\nThe little dog\r\nLily went to\n' > "$TMP/prompts.txt"
}

teardown() { rm -rf "$TMP"; }

@test "kv-run --batch writes one JSON line per prompt of the file, blank lines skipped" {
    run --separate-stderr kv-run -m "$MODEL" --prompt-file "$TMP/prompts.txt" --batch 3 -n 8
    assert_success
    [ "${#lines[@]}" -eq 3 ]
    [ "$(jsonl_get 0 'j["seq"]')" = 0 ]
    [ "$(jsonl_get 2 'j["seq"]')" = 2 ]
    [ "$(jsonl_get 1 'len(j["tokens"])')" = 8 ]
    [ "$(jsonl_get 1 'j["end"]')" = steps ]
    [ "$(jsonl_get 1 'j["prompt_tokens"] > 1')" = True ]
}

@test "kv-run --batch gives each sequence the text it gets alone" {
    run --separate-stderr kv-run -m "$MODEL" --prompt-file "$TMP/prompts.txt" --batch 3 -n 10
    assert_success
    batched="$(jsonl_get 1 'j["text"]')"
    run --separate-stderr kv-run -m "$MODEL" -p "The little dog" -n 10
    assert_success
    [ "$output" = "$batched" ]
}

@test "kv-run --batch with --random-prompt seeds prompt i with seed + i" {
    run --separate-stderr kv-run -m "$MODEL" --random-prompt 6 --seed 7 --batch 2 -n 5
    assert_success
    second="$(jsonl_get 1 'j["tokens"]')"
    run --separate-stderr kv-run -m "$MODEL" --random-prompt 6 --seed 8 --batch 1 -n 5
    assert_success
    [ "$(jsonl_get 0 'j["tokens"]')" = "$second" ]
}

@test "kv-run --batch with --prompt runs B copies and --print-ids leaves the text out" {
    run --separate-stderr kv-run -m "$MODEL" -p "Once" --batch 2 -n 4 --print-ids
    assert_success
    [ "$(jsonl_get 0 'j["tokens"]')" = "$(jsonl_get 1 'j["tokens"]')" ]
    [ "$(jsonl_get 0 '"text" in j')" = False ]
}

@test "kv-run --batch --report writes the batch's report" {
    run --separate-stderr kv-run -m "$MODEL" --prompt-file "$TMP/prompts.txt" --batch 2 -n 6 --report "$TMP/r.json"
    assert_success
    output="$(cat "$TMP/r.json")"
    [ "$(json_get 'j["batch"]')" = 2 ]
    [ "$(json_get 'j["device"]')" = cpu ]
    [ "$(json_get 'j["gemm"]')" = gemv ]
    [ "$(json_get 'j["generated_tokens"]')" = 12 ]
    [ "$(json_get 'j["decode_steps"]')" = 10 ]
    [ "$(json_get 'len(j["sequences"])')" = 2 ]
    [ "$(json_get 'j["sequences"][1]["generated"]')" = 6 ]
    [ "$(json_get 'j["tokens_per_s"] > 0')" = True ]
    [ "$(json_get '"ms_per_step" in j and "kv_bytes" in j')" = True ]
}

@test "kv-run --batch with fewer prompts in the file than B fails with 65" {
    run --separate-stderr kv-run -m "$MODEL" --prompt-file "$TMP/prompts.txt" --batch 4 -n 2
    assert_fails_with 65 "holds 3 prompts, --batch asks for 4"
    [ -z "$output" ]
}

@test "kv-run --batch refuses a prompt file with a NUL byte (65)" {
    printf 'a\0b\n' > "$TMP/nul.txt"
    run --separate-stderr kv-run -m "$MODEL" --prompt-file "$TMP/nul.txt" --batch 1 -n 2
    assert_fails_with 65 "NUL"
}

@test "kv-run --batch without prompts, with sampling or with --score-file is a usage error (64)" {
    run --separate-stderr kv-run -m "$MODEL" --batch 2 -n 2
    assert_fails_with 64 "--batch needs prompts"
    run --separate-stderr kv-run -m "$MODEL" -p x --batch 2 --temp 0.8
    assert_fails_with 64 "greedily"
    run --separate-stderr kv-run -m "$MODEL" --batch 2 --score-file "$TMP/prompts.txt"
    assert_fails_with 64 "--batch decodes prompts"
    run --separate-stderr kv-run -m "$MODEL" -p x --batch 0
    assert_fails_with 64 "--batch"
    run --separate-stderr kv-run -m "$MODEL" -p x --batch 2 --report -
    assert_fails_with 64 "--report needs a file"
}

@test "kv-run --gemm needs --batch and a known word (64)" {
    run --separate-stderr kv-run -m "$MODEL" -p x --gemm cublas
    assert_fails_with 64 "--gemm goes with --batch"
    run --separate-stderr kv-run -m "$MODEL" -p x --batch 2 --gemm tensor
    assert_fails_with 64 "not auto, gemv or cublas"
}

@test "kv-run --batch on --device cuda without a GPU exits 69" {
    if kv-run --version | grep -q '^GPU:' && ! kv-run --version | grep -q '^GPU: none'; then skip "a GPU is present"; fi
    run --separate-stderr kv-run -m "$MODEL" -p x --batch 2 -n 2 --device cuda
    assert_fails_with 69 "--batch on the GPU"
    [ -z "$output" ]
}

@test "kv-run --help lists --batch and --gemm" {
    run --separate-stderr kv-run --help
    assert_success
    assert_output --partial "--batch B"
    assert_output --partial "--gemm HOW"
}

@test "kv-bench decode --batch rejects 0, an unknown --gemm and a bad --batch-cap with 64" {
    run --separate-stderr kv-bench decode --batch 0
    assert_fails_with 64 "--batch"
    run --separate-stderr kv-bench decode --batch 2 --gemm tensor
    assert_fails_with 64 "--gemm"
    run --separate-stderr kv-bench decode --batch max --batch-cap 0
    assert_fails_with 64 "--batch-cap"
    run --separate-stderr kv-bench decode --batch 1,two
    assert_fails_with 64 "--batch"
}

@test "kv-bench decode --help lists --batch, --batch-cap and --gemm" {
    run --separate-stderr kv-bench decode --help
    assert_success
    assert_output --partial "--batch LIST"
    assert_output --partial "--batch-cap N"
    assert_output --partial "--gemm HOW"
}

@test "kv-run --batch and kv-bench decode --batch refuse the single-sequence step options they would ignore (64)" {
    run --separate-stderr kv-run --synthetic tiny --random-prompt 8 -n 2 --batch 2 --graph on
    assert_fails_with 64 "drop --graph"
    run --separate-stderr kv-bench decode --batch 2 --graph off
    assert_fails_with 64 "drop --graph, --context and --prefill-copy"
    run --separate-stderr kv-bench decode --batch 2 --context prefill
    assert_fails_with 64 "drop --graph, --context and --prefill-copy"
}
