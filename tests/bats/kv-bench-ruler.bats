#!/usr/bin/env bats
# kv-bench ruler (needle accuracy per KV policy) and kv-bench fidelity
# (KL / top-1 / perplexity against full) on the real test models.
bats_require_minimum_version 1.5.0
load helper

NIAH="$DATA/niah4k"
STORIES="$DATA/stories260K"

ruler() {
    kv-bench ruler --threads 1 --model "$NIAH/niah4k.bin" --tokenizer "$NIAH/tok259.bin" "$@"
}

fidelity() {
    kv-bench fidelity --threads 1 --model "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" "$@"
}

@test "kv-bench ruler --help lists its options on stdout" {
    run --separate-stderr kv-bench ruler --help
    [ "$status" -eq 0 ]
    [[ "$output" == *"--tasks"* ]]
    [[ "$output" == *"--mode"* ]]
}

@test "kv-bench ruler without --tasks is a usage error (64)" {
    run --separate-stderr ruler
    assert_fails_with 64 "--tasks"
}

@test "kv-bench ruler rejects an unknown policy with exit 64 before loading anything" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -p sparce
    assert_fails_with 64 "unknown policy"
}

@test "kv-bench ruler reports a missing task file with exit 66" {
    run --separate-stderr ruler --tasks "$BATS_TEST_TMPDIR/none.jsonl"
    assert_fails_with 66 "none.jsonl"
}

@test "kv-bench ruler names the bad line of a task file and exits 65" {
    f="$BATS_TEST_TMPDIR/bad.jsonl"
    printf '%s\n' '{"index": 0, "input": "x", "outputs": ["1"], "length": 1}' '' '{"index": 1, "input": "y"' >"$f"
    run --separate-stderr ruler --tasks "$f"
    assert_fails_with 65 "bad.jsonl:3"
    printf '%s\n' '{"index": 0, "input": "x", "outputs": "1"}' >"$f"
    run --separate-stderr ruler --tasks "$f"
    assert_fails_with 65 "bad.jsonl:1: \"outputs\""
    printf '%s\n' '[1, 2]' >"$f"
    run --separate-stderr ruler --tasks "$f"
    assert_fails_with 65 "bad.jsonl:1"
}

@test "kv-bench ruler: full and sparse find 1k needles, streaming loses them" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 2 \
        -p full -p sparse -p streaming --per-task
    [ "$status" -eq 0 ]
    [ "$(json_get 'len(j["results"])')" -eq 3 ]
    [ "$(json_get 'j["mode"]')" = question ]
    [ "$(json_get '[r["n"] for r in j["results"]]')" = "[2, 2, 2]" ]
    [ "$(json_get 'j["results"][0]["accuracy"]')" = 1 ]
    [ "$(json_get 'j["results"][1]["accuracy"]')" = 1 ]
    [ "$(json_get 'j["results"][2]["accuracy"]')" = 0 ]
    # the predictions are the needles themselves
    [ "$(json_get 'j["results"][0]["tasks"][0]["prediction"]')" = 9125844 ]
    # bytes: sparse keeps the prompt on the host and fetches per step;
    # streaming keeps sink + window only
    [ "$(json_get 'j["results"][0]["host_bytes"] == 0 and j["results"][0]["fetched_bytes_per_step"] == 0')" = True ]
    [ "$(json_get 'j["results"][1]["host_bytes"] > 0 and j["results"][1]["fetched_bytes_per_step"] > 0')" = True ]
    [ "$(json_get 'j["results"][1]["resident_bytes"] < j["results"][0]["resident_bytes"] / 5')" = True ]
    [ "$(json_get 'j["results"][2]["resident_bytes"] == 6 * 2 * 2 * 64 * 64 * 4')" = True ]
}

@test "kv-bench fidelity: full against full is exactly zero" {
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" -p full --prefix 40
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["prefix"]')" -eq 40 ]
    [ "$(json_get 'j["n_scored"] == j["n_tokens"] - 41')" = True ]
    [ "$(json_get 'j["results"][0]["kl_mean"]')" = 0 ]
    [ "$(json_get 'j["results"][0]["kl_max"]')" = 0 ]
    [ "$(json_get 'j["results"][0]["top1_agreement"]')" = 1 ]
    [ "$(json_get 'j["results"][0]["ppl_diff"]')" = 0 ]
}

@test "kv-bench fidelity shows that 1-bit keys destroy stories260K and 4-bit does not" {
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" \
        -p quant:bits=1,residual=16 -p quant:bits=4,residual=16 -p streaming:sink=4,window=16
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["results"][0]["kl_mean"] > 1')" = True ]
    [ "$(json_get 'j["results"][1]["kl_mean"] < 0.01')" = True ]
    [ "$(json_get 'j["results"][1]["top1_agreement"] > 0.9')" = True ]
    [ "$(json_get 'j["results"][2]["kl_mean"] > 0')" = True ]
    [ "$(json_get 'j["results"][0]["resident_bytes"] < j["reference_resident_bytes"]')" = True ]
}

@test "kv-bench fidelity takes token ids with --tokens" {
    echo "1 403 407 261 378 432 383 286 261 376 298 315 421 395 317 426" >"$BATS_TEST_TMPDIR/ids"
    run --separate-stderr kv-bench fidelity --threads 1 --model "$STORIES/stories260K.bin" \
        --tokens "$BATS_TEST_TMPDIR/ids" -p sparse:k=2,s=1,w=2 --json
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["n_tokens"]')" -eq 16 ]
    [ "$(json_get 'j["results"][0]["host_bytes"] > 0')" = True ]
}

@test "kv-bench fidelity rejects a token id outside the vocabulary with exit 65" {
    echo "1 403 99999 5" >"$BATS_TEST_TMPDIR/ids"
    run --separate-stderr kv-bench fidelity --threads 1 --model "$STORIES/stories260K.bin" \
        --tokens "$BATS_TEST_TMPDIR/ids" -p full
    assert_fails_with 65 "99999"
}

@test "kv-bench fidelity needs --text or --tokens (64) and a tokenizer for text (64)" {
    run --separate-stderr kv-bench fidelity --threads 1 --model "$STORIES/stories260K.bin" -p full
    assert_fails_with 64 "--text"
    run --separate-stderr kv-bench fidelity --threads 1 --model "$STORIES/stories260K.bin" -p full \
        --text "$STORIES/reference/greedy_bos_200.txt"
    assert_fails_with 64 "tokenizer"
}

@test "kv-bench fidelity --per-position lists each position's KL and agreement" {
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" --prefix 100 \
        -p quant:bits=2,residual=8,group=8 --per-position
    [ "$status" -eq 0 ]
    [ "$(json_get 'len(j["results"][0]["kl"]) == j["n_scored"] == len(j["results"][0]["agree"])')" = True ]
    [ "$(json_get 'abs(sum(j["results"][0]["kl"]) / j["n_scored"] - j["results"][0]["kl_mean"]) < 1e-5')" = True ]
    [ "$(json_get 'abs(sum(j["results"][0]["agree"]) / j["n_scored"] - j["results"][0]["top1_agreement"]) < 1e-5')" = True ]
    [ "$(json_get 'j["results"][0]["kl_mean"] > 0')" = True ]
}

# --device: the same runs on the CPU or GPU engine (lib/kv_runner).  CI has
# no GPU: these check the refusal, the fallback and that auto is then the
# CPU run itself.
no_gpu_or_skip() {
    if kv-bench --version | grep -q '^GPU: NVIDIA'; then
        skip "a GPU is present: --device cuda runs there"
    fi
}

@test "kv-bench ruler --device cuda without a usable GPU exits 69 with one line" {
    no_gpu_or_skip
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 1 --device cuda
    assert_fails_with 69 "--device cuda"
    [ "${#stderr_lines[@]}" -eq 1 ]
    [ -z "$output" ]
}

@test "kv-bench fidelity --device cuda without a usable GPU exits 69 with one line" {
    no_gpu_or_skip
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" -P full --device cuda
    assert_fails_with 69 "--device cuda"
    [ "${#stderr_lines[@]}" -eq 1 ]
    [ -z "$output" ]
}

@test "kv-bench ruler and fidelity reject an unknown --device with exit 64" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" --device bogus
    assert_fails_with 64 "--device must be cpu, cuda or auto"
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" -p full --device gpu
    assert_fails_with 64 "--device must be cpu, cuda or auto"
}

@test "kv-bench ruler rejects an unknown --select with exit 64" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" --select fast
    assert_fails_with 64 "--select must be policy or sketch"
}

@test "kv-bench ruler --device auto without a GPU is the CPU run, device \"cpu\"" {
    no_gpu_or_skip
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 1 -p sparse --per-task
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["device"]')" = cpu ]
    cpu="$output"
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 1 -p sparse --per-task \
        --device auto
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["device"]')" = cpu ]
    # every number but the wall time is the same
    strip='[{k: v for k, v in r.items() if k != "ms_per_task"} for r in j["results"]]'
    [ "$(json_get "$strip")" = "$(output="$cpu" json_get "$strip")" ]
    [ "$(json_get 'j["results"][0]["accuracy"]')" = 1 ]
    [ "$(json_get 'j["results"][0]["fetched_bytes_per_step"] > 0')" = True ]
}

@test "kv-bench fidelity --device auto without a GPU is the CPU run, device \"cpu\"" {
    no_gpu_or_skip
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" --max-tokens 64 \
        -p quant:bits=2,residual=8,group=8 --per-position --device cpu
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["device"]')" = cpu ]
    [ "$(json_get 'j["results"][0]["kl_mean"] > 0')" = True ]
    cpu="$output"
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" --max-tokens 64 \
        -p quant:bits=2,residual=8,group=8 --per-position --device auto
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["device"]')" = cpu ]
    [ "$(json_get 'j["n_tokens"]')" -eq 64 ]
    [ "$output" = "$cpu" ]
}

@test "kv-bench ruler and fidelity name the device in their table" {
    command -v script >/dev/null || skip "no script(1) to give a terminal"
    # stdout on a terminal: the table; stderr (progress) dropped
    script -qec "$BIN/kv-bench fidelity --threads 1 --model $STORIES/stories260K.bin \
        --tokenizer $STORIES/tok512.bin --text $STORIES/reference/greedy_bos_200.txt \
        --max-tokens 32 -p full 2>/dev/null" /dev/null | tr -d '\r' >"$BATS_TEST_TMPDIR/t"
    [ "$(head -n 1 "$BATS_TEST_TMPDIR/t")" = "device: cpu" ]
    grep -q 'KL mean' "$BATS_TEST_TMPDIR/t"
    script -qec "$BIN/kv-bench ruler --threads 1 --model $NIAH/niah4k.bin --tokenizer $NIAH/tok259.bin \
        --tasks $NIAH/tasks-dev.jsonl -l 1024 --limit 1 --device cpu 2>/dev/null" /dev/null |
        tr -d '\r' >"$BATS_TEST_TMPDIR/r"
    [ "$(head -n 1 "$BATS_TEST_TMPDIR/r")" = "device: cpu" ]
    grep -q 'resident KiB' "$BATS_TEST_TMPDIR/r"
}

@test "kv-bench ruler and fidelity take -P for --policy; the old -p and -t still work with one deprecation note each" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 1 -P full --json
    assert_success
    [ -z "$stderr" ]
    want=$(json_get 'j["results"][0]["accuracy"]')
    run --separate-stderr kv-bench ruler -T 1 -m "$NIAH/niah4k.bin" -t "$NIAH/tok259.bin" --tasks "$NIAH/tasks-dev.jsonl" \
        -l 1024 --limit 1 -p full -p full --json
    assert_success
    [ "$(json_get 'j["results"][0]["accuracy"]')" == "$want" ]
    [ "$(grep -c -- '-p is deprecated here: use -P or --policy' <<<"$stderr")" -eq 1 ]
    [ "$(grep -c -- '-t is deprecated here: use --tokenizer' <<<"$stderr")" -eq 1 ]
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" -p full --max-tokens 24 -j
    assert_success
    [[ "$stderr" == *"-p is deprecated here: use -P or --policy"* ]]
}

@test "kv-bench ruler and fidelity take a CUDA ordinal in --device" {
    no_gpu_or_skip
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 1 --device cuda:0
    assert_fails_with 69 "--device cuda"
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" -P full --device 0
    assert_fails_with 69 "--device cuda"
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" -P full --device cuda:x
    assert_fails_with 64 "--device must be cpu, cuda or auto"
}
