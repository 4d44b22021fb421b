#!/usr/bin/env bats
# kv-convert: GGUF files from the bundled real models in every weight type
# kv-run computes with (each loads back as that type and runs), the qwen2
# layout with biases, Llama-3.1 rope_freqs, vocabulary-only files from a
# tokenizer.json, and its usage and data errors.
load helper
bats_require_minimum_version 1.5.0

S260="$DATA/stories260K"
NIAH="$DATA/niah4k"

@test "kv-convert --help prints usage on stdout and exits 0" {
    run --separate-stderr kv-convert --help
    assert_success
    assert_output --partial "usage: kv-convert"
    assert_output --partial "--hf-tokenizer"
    [ -z "$stderr" ]
}

@test "kv-convert's man page documents every option its --help lists and every exit status" {
    run "$ROOT/tests/man-covers-help.sh" "$ROOT/man/kv-convert.1" kv-convert
    assert_success
}

@test "kv-convert without -o is a usage error (64)" {
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin"
    assert_fails_with 64 "-o FILE"
}

@test "kv-convert names an unknown or unwritable weight type (64)" {
    run --separate-stderr kv-convert -m "$NIAH/niah4k.bin" --tokenizer "$NIAH/tok259.bin" --type IQ2_XS -o "$BATS_TEST_TMPDIR/x.gguf"
    assert_fails_with 64 "IQ2_XS"
    [ ! -e "$BATS_TEST_TMPDIR/x.gguf" ]
}

@test "kv-convert refuses a llama2.c model without its tokenizer (64) and leaves no file" {
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" -o "$BATS_TEST_TMPDIR/x.gguf"
    assert_fails_with 64 "tokenizer"
    [ ! -e "$BATS_TEST_TMPDIR/x.gguf" ]
}

@test "kv-convert reports a tokenizer of the wrong size as bad data (65)" {
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --tokenizer "$NIAH/tok259.bin" -o "$BATS_TEST_TMPDIR/x.gguf"
    [ "$status" -eq 65 ]
}

@test "kv-convert writes every weight type and kv-run reads each back as that type" {
    for t in F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K; do
        run --separate-stderr kv-convert -q -m "$NIAH/niah4k.bin" --tokenizer "$NIAH/tok259.bin" --type $t -o "$BATS_TEST_TMPDIR/n-$t.gguf"
        assert_success
        run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/n-$t.gguf" -p "The special magic number" -n 4 --report -
        assert_success
        [ "$(json_get 'j["generated_tokens"]')" -ge 1 ]
    done
    # packed types keep the file's size: weight bytes shrink with the bits
    f32=$(stat -c %s "$BATS_TEST_TMPDIR/n-F32.gguf"); q4k=$(stat -c %s "$BATS_TEST_TMPDIR/n-Q4_K.gguf")
    [ $((q4k * 6)) -lt "$f32" ]
}

@test "kv-convert's F32 GGUF of stories260K reproduces llama2.c's reference greedy text" {
    run --separate-stderr kv-convert -q -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" --type F32 -o "$BATS_TEST_TMPDIR/s.gguf"
    assert_success
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/s.gguf" -n 200
    assert_success
    [ "$output" == "$(cat "$S260/reference/greedy_bos_200.txt")" ]
}

@test "kv-convert notes the matrices whose rows a K-quant cannot hold" {
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" --type Q4_K -o "$BATS_TEST_TMPDIR/s.gguf"
    assert_success
    [[ "$stderr" == *"(rows of 64): Q5_0"* ]]
    [[ "$stderr" == *"matrices have rows their type cannot hold"* ]]
}

@test "kv-convert --arch qwen2 writes a qwen2 file that kv-run runs" {
    run --separate-stderr kv-convert -q -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" --type F32 --arch qwen2 -o "$BATS_TEST_TMPDIR/q.gguf"
    assert_success
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/q.gguf" -n 200
    assert_success
    [ "$output" == "$(cat "$S260/reference/greedy_bos_200.txt")" ]
}

@test "kv-convert --rope-freqs rejects malformed parameters (64)" {
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" --rope-freqs llama3:8,4,1,512 -o "$BATS_TEST_TMPDIR/r.gguf"
    assert_fails_with 64 "LOW < HIGH"
}

@test "kv-convert requantizes a GGUF and copies its vocabulary" {
    run --separate-stderr kv-convert -q -m "$NIAH/niah4k-q4_k.gguf" --type Q8_0 -o "$BATS_TEST_TMPDIR/r.gguf"
    assert_success
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/r.gguf" --tokenize -p "abc"
    assert_success
    [ "$(json_get 'j')" == "[1, 35, 100, 101, 102]" ]
}

@test "kv-convert --hf-tokenizer builds a vocabulary-only GGUF that kv-run tokenizes" {
    cat > "$BATS_TEST_TMPDIR/tokenizer.json" <<'JSON'
{"added_tokens": [{"id": 5, "content": "<|end|>", "special": true}],
 "model": {"type": "BPE", "vocab": {"h": 0, "i": 1, "hi": 2, "\u0120": 3, "\u0120hi": 4},
           "merges": ["h i", "\u0120 hi"]}}
JSON
    run --separate-stderr kv-convert --hf-tokenizer "$BATS_TEST_TMPDIR/tokenizer.json" --pre gpt-2 --eos '<|end|>' -o "$BATS_TEST_TMPDIR/v.gguf"
    assert_success
    [[ "$stderr" == *"vocabulary of 6 tokens"* ]]
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/v.gguf" --tokenize --special -p "hi hi<|end|>"
    assert_success
    [ "$(json_get 'j')" == "[2, 4, 5]" ]
}

@test "kv-convert --hf-tokenizer rejects a file that is not JSON (65)" {
    echo "not json" > "$BATS_TEST_TMPDIR/t.json"
    run --separate-stderr kv-convert --hf-tokenizer "$BATS_TEST_TMPDIR/t.json" -o "$BATS_TEST_TMPDIR/v.gguf"
    assert_fails_with 65 "JSON"
}

@test "kv-convert --hf-tokenizer with weight options is a usage error (64)" {
    run --separate-stderr kv-convert --hf-tokenizer x.json --type Q4_K -o "$BATS_TEST_TMPDIR/v.gguf"
    assert_fails_with 64 "vocabulary only"
}

@test "kv-convert writes a synthetic model with another file's vocabulary and its --name, taking the other weight options" {
    run --separate-stderr kv-convert -q -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" --type F32 -o "$BATS_TEST_TMPDIR/s.gguf"
    assert_success
    printf '{%% for m in messages %%}{{ m.content }}{%% endfor %%}' > "$BATS_TEST_TMPDIR/tmpl"
    run --separate-stderr kv-convert -q --synthetic tiny --seed 7 --vocab "$BATS_TEST_TMPDIR/s.gguf" --name conv-test \
        --rope-theta 500000 --qkv-bias 3 --type Q4_0 --embd-type Q8_0 --chat-template "$BATS_TEST_TMPDIR/tmpl" \
        -o "$BATS_TEST_TMPDIR/syn.gguf"
    assert_success
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/syn.gguf" -p "Once" -n 4 --report -
    assert_success
    [ "$(json_get 'j["model"]["name"]')" = conv-test ]
    [ "$(json_get 'j["model"]["vocab"]')" = 512 ]
    [ "$(json_get 'j["generated_tokens"]')" = 4 ]
    # the vocabulary is stories260K's: the same ids for the same text
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/syn.gguf" --tokenize -p "Once upon"
    local syn="$output"
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/s.gguf" --tokenize -p "Once upon"
    [ "$output" = "$syn" ]
}

@test "kv-convert's usage errors name the conflict (64) and write nothing" {
    local o="$BATS_TEST_TMPDIR/x.gguf"
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" --vocab "$S260/tok512.bin" -o "$o"
    assert_fails_with 64 "--tokenizer and --vocab are exclusive"
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" --arch mistral -o "$o"
    assert_fails_with 64 "--arch must be llama or qwen2"
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" --pre gpt-2 -o "$o"
    assert_fails_with 64 "go with --hf-tokenizer"
    run --separate-stderr kv-convert --synthetic tiny --hf-tokenizer x.json -o "$o"
    assert_fails_with 64 "exactly one of --model, --synthetic and --hf-tokenizer"
    # options the chosen input would ignore
    run --separate-stderr kv-convert --hf-tokenizer x.json --name v -o "$o"
    assert_fails_with 64 "vocabulary only"
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" --seed 3 -o "$o"
    assert_fails_with 64 "--seed goes with --synthetic or --qkv-bias"
    [ ! -e "$o" ]
}

@test "kv-convert exits 65 for a --vocab that is not GGUF, 66 for missing inputs, 73 for an unwritable output" {
    local o="$BATS_TEST_TMPDIR/x.gguf"
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --vocab "$S260/tok512.bin" -o "$o"
    assert_fails_with 65 "not a GGUF file"
    run --separate-stderr kv-convert -m "$BATS_TEST_TMPDIR/none.bin" --tokenizer "$S260/tok512.bin" -o "$o"
    assert_fails_with 66 "none.bin"
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" --chat-template "$BATS_TEST_TMPDIR/none.tmpl" -o "$o"
    assert_fails_with 66 "none.tmpl"
    run --separate-stderr kv-convert --hf-tokenizer "$BATS_TEST_TMPDIR/none.json" -o "$o"
    assert_fails_with 66 "none.json"
    [ ! -e "$o" ]
    run --separate-stderr kv-convert -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" -o "$BATS_TEST_TMPDIR/no/dir/x.gguf"
    assert_fails_with 73 "cannot create"
}
