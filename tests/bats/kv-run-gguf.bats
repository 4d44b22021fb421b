#!/usr/bin/env bats
# kv-run on the GGUF files people download: the Llama-3 vocabulary
# (tokenize, special tokens, chat templates), K-quant weights (the bundled
# niah4k Q4_K answers its needle), Q8_0 and the qwen2 architecture with
# q/k/v biases, and refusals that name what they refuse.
load helper
bats_require_minimum_version 1.5.0

L3="$DATA/gguf/llama3-vocab.gguf"
NIAH="$DATA/niah4k"
S260="$DATA/stories260K"

@test "kv-run --tokenize prints Llama-3 ids as JSON from a vocabulary-only GGUF" {
    run --separate-stderr kv-run -m "$L3" --tokenize -p "Hello world"
    assert_success
    [ "$(json_get 'j')" == "[128000, 9906, 1917]" ]
}

@test "kv-run --tokenize reads the text from stdin and splits digits in threes" {
    run --separate-stderr bash -c "printf '3333333' | kv-run -m '$L3' --tokenize --prompt-file -"
    assert_success
    [ "$(json_get 'j')" == "[128000, 8765, 8765, 18]" ]
}

@test "kv-run recognises special tokens in the text only with --special" {
    run --separate-stderr kv-run -m "$L3" --tokenize -p "<|eot_id|>"
    assert_success
    [ "$(json_get 'len(j) > 2 and 128009 not in j')" == "True" ]
    run --separate-stderr kv-run -m "$L3" --tokenize --special -p "<|eot_id|>"
    assert_success
    [ "$(json_get 'j')" == "[128000, 128009]" ]
}

@test "kv-run --chat llama3 wraps the prompt in Llama-3 headers" {
    run --separate-stderr kv-run -m "$L3" --tokenize --chat llama3 -p "Hi"
    assert_success
    [ "$(json_get 'j')" == "[128000, 128006, 882, 128007, 271, 13347, 128009, 128006, 78191, 128007, 271]" ]
}

@test "kv-run --chat auto picks llama3 for the Llama-3 vocabulary" {
    run --separate-stderr kv-run -m "$L3" --tokenize --chat auto -p "Hi"
    assert_success
    [ "$(json_get 'j[:2]')" == "[128000, 128006]" ]
}

@test "kv-run --chat auto refuses a vocabulary with no chat format (65)" {
    run --separate-stderr kv-run -m "$DATA/gguf/ggml-vocab-llama-spm.gguf" --tokenize --chat auto -p "Hi"
    assert_fails_with 65 "--chat llama3"
}

@test "kv-run rejects an unknown --chat template (64)" {
    run --separate-stderr kv-run -m "$L3" --tokenize --chat jinja -p "Hi"
    assert_fails_with 64 "--chat"
}

@test "kv-run --tokenize with --tokens is a usage error (64)" {
    run --separate-stderr kv-run -m "$L3" --tokenize --tokens /dev/null
    assert_fails_with 64 "--tokenize"
}

@test "kv-run cannot run a vocabulary-only GGUF as a model (65)" {
    run --separate-stderr kv-run -m "$L3" -p "Hi" -n 2
    assert_fails_with 65 "token_embd.weight"
}

@test "kv-run answers a needle task with the bundled Q4_K niah4k GGUF" {
    "$PY" -c 'import json,sys; t=json.loads(open(sys.argv[1]).readline()); open(sys.argv[2],"w").write(t["input"]); print(t["outputs"][0])' \
        "$NIAH/tasks-dev.jsonl" "$BATS_TEST_TMPDIR/p.txt" > "$BATS_TEST_TMPDIR/want"
    run --separate-stderr kv-run -m "$NIAH/niah4k-q4_k.gguf" --prompt-file "$BATS_TEST_TMPDIR/p.txt" -n 8
    assert_success
    [[ "$output" == *"$(cat "$BATS_TEST_TMPDIR/want")"* ]]
}

# Peak resident memory (kB) of a kv-run command, sampled from /proc.
peak_rss() {
    "$@" >/dev/null 2>&1 &
    local pid=$! peak=0 r
    while kill -0 $pid 2>/dev/null; do
        r=$(awk '/VmHWM/{print $2}' /proc/$pid/status 2>/dev/null)
        [ -n "$r" ] && [ "$r" -gt "$peak" ] && peak=$r
        sleep 0.005
    done
    echo $peak
}

@test "kv-run keeps Q4_K weights packed: resident memory grows by the file, not by float32 weights" {
    f32=$(peak_rss kv-run -m "$NIAH/niah4k.bin" --random-prompt 1 -n 48 --ctx 64)
    q4k=$(peak_rss kv-run -m "$NIAH/niah4k-q4_k.gguf" --random-prompt 1 -n 48 --ctx 64)
    echo "f32 $f32 kB, q4_k $q4k kB"
    [ "$f32" -gt 0 ] && [ "$q4k" -gt 0 ]
    # the float32 file is 19.3 MB and the Q4_K one 2.7 MB: 16.6 MB apart
    [ $((f32 - q4k)) -gt 14000 ]
}

@test "kv-run's Q8_0 stories260K GGUF follows llama2.c's greedy reference for 100 tokens" {
    run --separate-stderr kv-run -m "$S260/stories260K-q8_0.gguf" -n 100 --print-ids
    assert_success
    want=$(tr ' ' '\n' < "$S260/reference/greedy_bos_200.ids" | sed -n '2,101p' | tr '\n' ' ')
    [ "$(echo $output | cut -d' ' -f1-100) " == "$want" ]
}

@test "kv-run runs the qwen2 GGUF with q/k/v biases" {
    run --separate-stderr kv-run -m "$S260/stories260K-qwen2-bf16.gguf" -p "Once upon a time" -n 20 --report -
    assert_success
    [ "$(json_get 'j["generated_tokens"]')" -ge 1 ]
}

@test "kv-run --print-ids writes the generated ids" {
    run --separate-stderr kv-run -m "$S260/stories260K.bin" -n 5 --print-ids
    assert_success
    [ "$output" == "403 407 261 378 432 " ] || [ "$output" == "403 407 261 378 432" ]
}

@test "kv-run --probs prints every prompt position's top-k as JSON" {
    run --separate-stderr kv-run -m "$S260/stories260K.bin" --tokens <(echo '[1, 403, 407]') --probs 3
    assert_success
    [ "$(json_get 'len(j)')" -eq 3 ]
    [ "$(json_get 'j[0]["top"][0][0]')" -eq 403 ]
    [ "$(json_get 'all(abs(sum(p for _, p in e["top"])) <= 1 for e in j)')" == "True" ]
}

@test "kv-run --probs with --device cuda is a usage error (64)" {
    run --separate-stderr kv-run -m "$S260/stories260K.bin" --probs 3 --device cuda
    assert_fails_with 64 "--probs"
}

@test "kv-run refuses an unknown architecture by name (65)" {
    "$PY" -c 'import sys; b=open(sys.argv[1],"rb").read(); i=b.index(b"general.architecture"); j=b.index(b"llama", i); open(sys.argv[2],"wb").write(b[:j]+b"mamba"+b[j+5:])' \
        "$S260/stories260K-q8_0.gguf" "$BATS_TEST_TMPDIR/m.gguf"
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/m.gguf" -n 2
    assert_fails_with 65 "architecture 'mamba' is not supported"
}
