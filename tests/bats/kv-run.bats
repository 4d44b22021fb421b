#!/usr/bin/env bats
# kv-run: front-end conventions, model-file errors, exact greedy and sampled
# text against llama2.c's reference run.c on stories260K, the JSON report,
# the .kvc dump (read back by kv-info), scoring, GGUF and synthetic models.
load helper
bats_require_minimum_version 1.5.0

S260="$DATA/stories260K"
MODEL="$S260/stories260K.bin"

@test "kv-run --help prints usage on stdout and exits 0" {
    run --separate-stderr kv-run --help
    assert_success
    assert_output --partial "usage: kv-run"
    assert_output --partial "--dump-kv"
    [ -z "$stderr" ]
}

@test "kv-run --version names the tool version, the kvc format version and CUDA status" {
    run --separate-stderr kv-run --version
    assert_success
    [[ "${lines[0]}" =~ ^kv-run\ [0-9]+\.[0-9]+\.[0-9]+$ ]]
    [[ "$output" == *"kvc format version "[0-9]* ]]
    [[ "$output" == *"CUDA: "* ]]
}

@test "kv-run rejects an unknown option with exit 64" {
    run --separate-stderr kv-run --no-such-option -m "$MODEL"
    assert_fails_with 64 "unknown option"
}

@test "kv-run without a model is a usage error (64)" {
    run --separate-stderr kv-run -n 3
    assert_fails_with 64 "--model"
}

@test "kv-run rejects a bad --policy with exit 64 or 65" {
    run --separate-stderr kv-run -m "$MODEL" --policy nonsense -n 2
    [ "$status" -eq 64 ] || [ "$status" -eq 65 ]
    [[ "$stderr" == *"policy"* ]]
}

@test "kv-run reports a missing model with exit 66" {
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/nope.bin"
    assert_fails_with 66 "nope.bin"
}

@test "kv-run rejects a truncated llama2.c model with exit 65" {
    head -c 5000 "$MODEL" > "$BATS_TEST_TMPDIR/cut.bin"
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/cut.bin"
    assert_fails_with 65 "truncated"
    [ -z "$output" ]
}

@test "kv-run rejects a GGUF with a bad version with exit 65" {
    { printf 'GGUF\x07\x00\x00\x00'; head -c 100 /dev/zero; } > "$BATS_TEST_TMPDIR/v7.gguf"
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/v7.gguf"
    assert_fails_with 65 "version 7"
}

@test "kv-run rejects a text file as a model with exit 65" {
    echo "hello, I am not a model" > "$BATS_TEST_TMPDIR/text.bin"
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/text.bin"
    assert_fails_with 65 "llama2.c"
}

@test "kv-run reports a directory given as tokenizer, prompt file or token list with exit 66" {
    mkdir "$BATS_TEST_TMPDIR/d"
    run --separate-stderr kv-run -m "$MODEL" --tokenizer "$BATS_TEST_TMPDIR/d" -p hi -n 1
    assert_fails_with 66 "is a directory"
    run --separate-stderr kv-run -m "$MODEL" --prompt-file "$BATS_TEST_TMPDIR/d" -n 1
    assert_fails_with 66 "is a directory"
    run --separate-stderr kv-run -m "$MODEL" --tokens "$BATS_TEST_TMPDIR/d" -n 1
    assert_fails_with 66 "is a directory"
    run --separate-stderr kv-run -m "$MODEL" --profile "$BATS_TEST_TMPDIR/d" -p hi -n 1
    assert_fails_with 66 "is a directory"
    [ -z "$output" ]
}

@test "kv-run --help states the exit status table exactly once" {
    run --separate-stderr kv-run --help
    assert_success
    [ "$(grep -c '^Exit status:' <<<"$output")" -eq 1 ]
    [[ "$output" == *"69 unavailable"* ]]
}

@test "kv-run leaves no dump behind when --report cannot be created (exit 73)" {
    touch "$BATS_TEST_TMPDIR/afile"
    run --separate-stderr kv-run -m "$MODEL" -p hi -n 2 --dump-kv "$BATS_TEST_TMPDIR/d.kvc" \
        --report "$BATS_TEST_TMPDIR/afile/r.json"
    assert_fails_with 73 "afile/r.json"
    [ ! -e "$BATS_TEST_TMPDIR/d.kvc" ]
    [ -z "$(find "$BATS_TEST_TMPDIR" -name '*d.kvc*' -o -name '.r.json*')" ]
}

@test "kv-run refuses --report or --dump-kv with --score-file (exit 64)" {
    echo "Once upon a time" > "$BATS_TEST_TMPDIR/t.txt"
    run --separate-stderr kv-run -m "$MODEL" --score-file "$BATS_TEST_TMPDIR/t.txt" --report "$BATS_TEST_TMPDIR/r.json"
    assert_fails_with 64 "--score-file"
    run --separate-stderr kv-run -m "$MODEL" --score-file "$BATS_TEST_TMPDIR/t.txt" --dump-kv "$BATS_TEST_TMPDIR/d.kvc"
    assert_fails_with 64 "--score-file"
    [ ! -e "$BATS_TEST_TMPDIR/r.json" ] && [ ! -e "$BATS_TEST_TMPDIR/d.kvc" ]
}

@test "kv-run greedy text from BOS equals llama2.c's reference" {
    run --separate-stderr kv-run -m "$MODEL" -n 200
    assert_success
    [ "$output" == "$(cat "$S260/reference/greedy_bos_200.txt")" ]
}

@test "kv-run sampling at seed 42 equals llama2.c's run.c text" {
    run --separate-stderr kv-run -m "$MODEL" -n 200 --temp 1 --top-p 0.95 --seed 42
    assert_success
    [ "$output" == "$(cat "$S260/reference/sample_t1_p095_s42_200.txt")" ]
}

@test "kv-run at a temperature of 1e-38 samples the greedy text instead of reading outside its buffers" {
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 8
    assert_success
    greedy=$output
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 8 --temp 1e-38
    assert_success
    [ "$output" == "$greedy" ]
}

@test "kv-run --report - writes JSON with timings, bytes and one entry per layer" {
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 16 --report -
    assert_success
    [ "$(json_get 'len(j["layers"])')" -eq 5 ]
    [ "$(json_get 'j["layers"][0]["policy"]')" == "full" ]
    [ "$(json_get 'j["prompt_tokens"]')" -eq 5 ]
    [ "$(json_get 'j["generated_tokens"]')" -eq 16 ]
    [ "$(json_get 'j["decode_steps"]')" -eq 15 ]
    [ "$(json_get 'j["ms_per_token_p90"] >= j["ms_per_token_median"] > 0')" == "True" ]
    # full f32: 2 (K,V) x 4 kv heads x 8 dims x 4 bytes x 20 tokens held per layer
    [ "$(json_get 'j["layers"][2]["gpu_bytes"]')" -eq $((2 * 4 * 8 * 4 * 20)) ]
    [ "$(json_get 'j["kv_bytes"]["gpu"]')" -eq $((5 * 2 * 4 * 8 * 4 * 20)) ]
    [ "$(json_get 'j["pcie_bytes_per_token"]')" == "0" ]
}

@test "kv-run --kv-dtype f16 halves the resident bytes in the report" {
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 16 --kv-dtype f16 --report -
    assert_success
    [ "$(json_get 'j["layers"][2]["gpu_bytes"]')" -eq $((2 * 4 * 8 * 2 * 20)) ]
}

@test "kv-run --dump-kv writes a .kvc with K, V and the last queries" {
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time, there was" -n 0 --nq 4 --dump-kv "$BATS_TEST_TMPDIR/p.kvc"
    assert_success
    [ -s "$BATS_TEST_TMPDIR/p.kvc" ]
    run --separate-stderr "$PY" -c '
import json, struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
m = h["__metadata__"]
print(h["layers.0.k"]["shape"], h["layers.4.q"]["shape"], h["tokens"]["shape"], m["kvc.n_heads"], h["layers.0.k"]["dtype"])
' "$BATS_TEST_TMPDIR/p.kvc"
    assert_success
    assert_output "[4, 8, 8] [8, 4, 8] [8] 8 F32"
    command -v kv-info >/dev/null || skip "kv-info not built"
    run --separate-stderr kv-info --json "$BATS_TEST_TMPDIR/p.kvc"
    assert_success
}

@test "kv-run --dump-kv - pipes into kv-info -" {
    command -v kv-info >/dev/null || skip "kv-info not built"
    run --separate-stderr bash -c "kv-run -m '$MODEL' -p 'Once upon a time' -n 0 --kv-dtype f16 --dump-kv - | kv-info --json -"
    assert_success
    [ "$(json_get 'j.get("n_tokens", j.get("geometry", {}).get("n_tokens"))')" == "5" ] || { echo "$output"; false; }
}

@test "kv-run --dump-kv - refuses a terminal and streams to a pipe" {
    run --separate-stderr bash -c "kv-run -m '$MODEL' -n 0 --kv-dtype bf16 --dump-kv - | head -c 8 | wc -c"
    assert_success
    assert_output "8"
    run script -qec "kv-run -m '$MODEL' -n 0 --dump-kv -" /dev/null
    [ "$status" -eq 64 ]
    [[ "$output" == *"refusing to write a .kvc file to a terminal"* ]]
}

@test "kv-run --score-file reports per-token NLL and perplexity as JSON" {
    printf 'Once upon a time, there was a little girl named Lily.' > "$BATS_TEST_TMPDIR/t.txt"
    run --separate-stderr kv-run -m "$MODEL" --score-file "$BATS_TEST_TMPDIR/t.txt"
    assert_success
    n=$(json_get 'j["tokens"]')
    [ "$(json_get 'len(j["nll"])')" -eq $((n - 1)) ]
    [ "$(json_get 'abs(j["perplexity"] - __import__("math").exp(sum(j["nll"]) / len(j["nll"]))) < 1e-6')" == "True" ]
    [ "$(json_get '1 < j["perplexity"] < 50')" == "True" ]
}

@test "kv-run takes token ids from --tokens as JSON" {
    echo '[1, 403, 407, 261, 378]' > "$BATS_TEST_TMPDIR/ids.json"
    run --separate-stderr kv-run -m "$MODEL" --tokens "$BATS_TEST_TMPDIR/ids.json" -n 8 --report -
    assert_success
    [ "$(json_get 'j["prompt_tokens"]')" -eq 5 ]
}

@test "kv-run runs the random-weight GGUF with its SentencePiece vocabulary" {
    run --separate-stderr kv-run -m "$DATA/gguf/llama-2-tiny-random.gguf" -p "Hello world" -n 5 --report -
    assert_success
    [ "$(json_get 'j["model"]["format"]')" == "gguf" ]
    [ "$(json_get 'j["prompt_tokens"]')" -eq 3 ]
}

@test "kv-run --synthetic tiny runs without a file" {
    run --separate-stderr kv-run --synthetic tiny --random-prompt 32 -n 8 --report -
    assert_success
    [ "$(json_get 'j["model"]["layers"]')" -eq 4 ]
    [ "$(json_get 'j["generated_tokens"]')" -ge 1 ]
}

@test "kv-run says text tokenization is unavailable without a tokenizer" {
    run --separate-stderr kv-run --synthetic tiny -p "hello" -n 2
    [ "$status" -ne 0 ]
    [[ "$stderr" == *"--tokens"* ]]
}

@test "kv-run reads the prompt from stdin with --prompt-file -" {
    run --separate-stderr bash -c "printf 'Once upon a time' | kv-run -m '$MODEL' --prompt-file - -n 4 --report /dev/stderr 2>/dev/null"
    assert_success
    [ -n "$output" ]
}

@test "kv-run --profile applies a kv-profile deployment config per layer" {
    cat > "$BATS_TEST_TMPDIR/p.json" <<'JSON'
{"version": 1, "n_layers": 5, "method": "kivi", "quant_layers": [0, 1], "sparse_layers": [3],
 "bits": 2, "group": 8, "residual": 16, "budget": 16, "channels": 4, "sink": 2, "window": 8}
JSON
    run --separate-stderr kv-run -m "$MODEL" --profile "$BATS_TEST_TMPDIR/p.json" -n 30 --report -
    assert_success
    [ "$(json_get '[l["policy"] for l in j["layers"]]')" == "['quant', 'quant', 'full', 'sparse', 'full']" ]
    [ "$(json_get 'j["layers"][0]["params"]')" == "quant bits=2 group=8 residual=16 dtype=f32" ]
}

@test "kv-run rejects a profile with a layer out of range with exit 65" {
    echo '{"quant_layers": [9], "sparse_layers": []}' > "$BATS_TEST_TMPDIR/bad.json"
    run --separate-stderr kv-run -m "$MODEL" --profile "$BATS_TEST_TMPDIR/bad.json" -n 2
    assert_fails_with 65 "9"
}

@test "kv-run rejects a bad token list with exit 65" {
    echo '1 2 x' > "$BATS_TEST_TMPDIR/ids.txt"
    run --separate-stderr kv-run -m "$MODEL" --tokens "$BATS_TEST_TMPDIR/ids.txt"
    assert_fails_with 65 "token list"
}

@test "kv-run rejects an unknown --device with exit 64" {
    run --separate-stderr kv-run -m "$MODEL" -n 4 --device gpu
    assert_fails_with 64 "--device must be cpu, cuda or auto"
}

@test "kv-run --device auto falls back to the CPU and still matches the reference" {
    run --separate-stderr kv-run -m "$MODEL" -n 200 --device auto
    assert_success
    [ "$output" = "$(cat "$S260/reference/greedy_bos_200.txt")" ]
}

@test "kv-run --device cuda without a usable GPU exits 69 with a message" {
    if kv-run --version | grep -q '^GPU: NVIDIA'; then
        skip "a GPU is present: the GPU engine's device tests cover this machine"
    fi
    run --separate-stderr kv-run -m "$MODEL" -n 4 --device cuda
    assert_fails_with 69 "--device cuda"
}

@test "kv-run --device cuda --dump-kv without a usable GPU exits 69 and writes no file" {
    if kv-run --version | grep -q '^GPU: NVIDIA'; then
        skip "a GPU is present: test_gpu_engine_data compares the GPU dump with the CPU's there"
    fi
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 0 --device cuda \
        --dump-kv "$BATS_TEST_TMPDIR/g.kvc"
    assert_fails_with 69 "--device cuda"
    [ ! -e "$BATS_TEST_TMPDIR/g.kvc" ]
}

@test "kv-run --device auto --dump-kv without a usable GPU writes the CPU engine's dump" {
    if kv-run --version | grep -q '^GPU: NVIDIA'; then
        skip "a GPU is present: auto would run the GPU engine"
    fi
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 0 --nq 4 --device auto \
        --dump-kv "$BATS_TEST_TMPDIR/a.kvc"
    assert_success
    kv-run -m "$MODEL" -p "Once upon a time" -n 0 --nq 4 --dump-kv "$BATS_TEST_TMPDIR/c.kvc" 2>/dev/null
    cmp "$BATS_TEST_TMPDIR/a.kvc" "$BATS_TEST_TMPDIR/c.kvc"
}

@test "kv-run --device cuda with --score-file is a usage error (64)" {
    printf 'Once upon a time' > "$BATS_TEST_TMPDIR/t.txt"
    run --separate-stderr kv-run -m "$MODEL" --device cuda --score-file "$BATS_TEST_TMPDIR/t.txt"
    assert_fails_with 64 "--score-file runs on the CPU"
}

@test "kv-run --compare full against full reports zero divergence" {
    run --separate-stderr kv-run -m "$MODEL" --prompt-file "$S260/reference/greedy_bos_200.txt" --compare full
    assert_success
    [ "$(json_get 'j["results"][0]["kl_mean"]')" = "0" ]
    [ "$(json_get 'j["results"][0]["top1_agreement"]')" = "1" ]
    [ "$(json_get 'j["n_scored"] > 50')" = "True" ]
}

@test "kv-run --compare shows that 1-bit quantization damages this model" {
    run --separate-stderr kv-run -m "$MODEL" --prompt-file "$S260/reference/greedy_bos_200.txt" --compare quant:bits=1
    assert_success
    [ "$(json_get 'j["results"][0]["kl_mean"] > 0.1 and j["results"][0]["ppl_diff"] > 0.5')" = "True" ]
    [ "$(json_get 'j["results"][0]["resident_bytes"] < j["reference_resident_bytes"]')" = "True" ]
}

@test "kv-run --compare --device cuda without a usable GPU exits 69; auto is the CPU run" {
    if kv-run --version | grep -q '^GPU: NVIDIA'; then
        skip "a GPU is present: the GPU engine's device tests cover this machine"
    fi
    run --separate-stderr kv-run -m "$MODEL" --prompt "Once upon a time there was" --compare streaming --device cuda
    assert_fails_with 69 "--compare"
    run --separate-stderr kv-run -m "$MODEL" --prompt-file "$S260/reference/greedy_bos_200.txt" --compare quant:bits=2 --device auto
    assert_success
    [ "$(json_get 'j["device"]')" = "cpu" ]
    local kl_auto; kl_auto=$(json_get 'j["results"][0]["kl_mean"]')
    run --separate-stderr kv-run -m "$MODEL" --prompt-file "$S260/reference/greedy_bos_200.txt" --compare quant:bits=2
    assert_success
    [ "$(json_get 'j["results"][0]["kl_mean"]')" = "$kl_auto" ]
}

@test "kv-run --compare rejects an unknown policy with exit 64" {
    run --separate-stderr kv-run -m "$MODEL" --prompt "Once upon a time" --compare nope
    assert_fails_with 64 "unknown policy"
}

@test "kv-run --prefix without --compare is a usage error (64)" {
    run --separate-stderr kv-run -m "$MODEL" --prompt "Once upon a time" --prefix 3
    assert_fails_with 64 "--prefix goes with --compare"
}

@test "kv-run's man page documents every option its --help lists and every exit status" {
    run "$ROOT/tests/man-covers-help.sh" "$ROOT/man/kv-run.1" kv-run
    assert_success
}

@test "kv-run names the layer and policy of a bad policy parameter once (exit 64)" {
    run --separate-stderr kv-run -m "$MODEL" --policy "streaming:window=0,sink=0" -p hi -n 3
    assert_fails_with 64 "layer 0 policy streaming"
    [ "$(grep -o 'layer 0 policy streaming' <<<"$stderr" | wc -l)" -eq 1 ]
    [ -z "$output" ]
}

@test "kv-run reports a full stdout once, with exit 74 and the real cause" {
    run --separate-stderr bash -c 'kv-run -m "$1" -p hi -n 5 > /dev/full' _ "$MODEL"
    assert_fails_with 74 "write error on stdout"
    [ "$(wc -l <<<"$stderr")" -eq 1 ]
    [[ "$stderr" != *"tokenizer"* ]]
    run --separate-stderr bash -c 'kv-run -m "$1" -p hi -n 5 --report - > /dev/full' _ "$MODEL"
    assert_fails_with 74 "write error on stdout"
    [ "$(wc -l <<<"$stderr")" -eq 1 ]
}

@test "kv-run --report - says how the prefill ran: on the CPU, in chunks of 128 rows" {
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 2 --report -
    assert_success
    [ "$(json_get 'j["prefill"]["device"]')" == "cpu" ]
    [ "$(json_get 'j["prefill"]["method"]')" == "chunked" ]
    [ "$(json_get 'j["prefill"]["chunk"]')" == "128" ]
    [ "$(json_get 'len(j["prefill"]["why"]) > 0')" == "True" ]
}

@test "kv-run --report - carries the generated text and token ids" {
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 12 --report -
    assert_success
    [ "$(json_get 'len(j["generated_ids"]) == j["generated_tokens"] == 12')" == "True" ]
    [ "$(json_get 'j["stop"]')" == "steps" ]
    # the text is what kv-run prints on stdout when stdout is free
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 12
    want="$output"
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 12 --report -
    [ "$(json_get 'j["text"]')" == "$want" ]
    # from BOS alone, the greedy ids are llama2.c's reference tokens after BOS
    run --separate-stderr kv-run -m "$MODEL" -n 12 --report -
    ref=$(cut -d' ' -f2-13 "$S260/reference/greedy_bos_200.ids")
    [ "$(json_get '" ".join(map(str, j["generated_ids"]))')" == "$ref" ]
}

@test "kv-run --report without a tokenizer has the ids and a null text" {
    run --separate-stderr kv-run --synthetic tiny --random-prompt 8 -n 4 --report -
    assert_success
    [ "$(json_get 'j["text"] is None and len(j["generated_ids"]) == j["generated_tokens"]')" == "True" ]
}

@test "kv-run --nq without --dump-kv is a usage error (64)" {
    run --separate-stderr kv-run -m "$MODEL" -p hi -n 2 --nq 4
    assert_fails_with 64 "--nq goes with --dump-kv"
    [ -z "$output" ]
}

@test "kv-run --select sketch on the CPU is a usage error (64) naming --device" {
    run --separate-stderr kv-run -m "$MODEL" -p hi -n 2 --policy sparse --select sketch
    assert_fails_with 64 "--device cuda"
    run --separate-stderr kv-run -m "$MODEL" -p hi -n 2 --policy sparse:select=sketch
    assert_fails_with 64 "select=sketch is a GPU engine selection"
    [ -z "$output" ]
}

@test "kv-run --select sketch with --device auto and no usable GPU is unavailable (69)" {
    bash -c 'kv-run --synthetic tiny --random-prompt 4 -n 1 --device cuda' >/dev/null 2>&1 && skip "a usable GPU is present"
    run --separate-stderr kv-run -m "$MODEL" -p hi -n 2 --policy sparse --select sketch --device auto
    assert_fails_with 69 "select=sketch"
    [[ "$stderr" == *"GPU engine is unavailable"* ]]
    [ -z "$output" ]
}

@test "kv-run refuses a prompt or -n that does not fit --ctx (64)" {
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 0 --ctx 3
    assert_fails_with 64 "more than --ctx 3"
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 20 --ctx 10
    assert_fails_with 64 "-n 20 after a 5-token prompt needs a context of 24 tokens"
    [ -z "$output" ]
    # exactly enough: 5 prompt tokens + 19 steps
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 20 --ctx 24 --report -
    assert_success
    [ "$(json_get 'j["generated_tokens"] == 20 and j["ctx"] == 24')" == "True" ]
}

@test "kv-run warns when the prompt and -n grow the context past the model's" {
    run --separate-stderr kv-run -m "$MODEL" --random-prompt 500 -n 20 --report -
    assert_success
    [[ "$stderr" == *"more than the model's trained context of 512"* ]]
    [ "$(json_get 'j["ctx"]')" -eq 520 ]
}

@test "kv-run text without a tokenizer exits 66, beside a model or without one" {
    mkdir "$BATS_TEST_TMPDIR/m" && cp "$MODEL" "$BATS_TEST_TMPDIR/m/"
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/m/stories260K.bin" -p hello -n 2
    assert_fails_with 66 "--tokens"
    run --separate-stderr kv-run --synthetic tiny -p hello -n 2
    assert_fails_with 66 "--tokens"
    # token ids need no tokenizer
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/m/stories260K.bin" --tokens <(echo 1 403 407) -n 2
    assert_success
}

@test "kv-run takes -P for --policy; the old -t for --temp still works with one deprecation note" {
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 8 --policy quant:bits=2 --temp 0
    assert_success
    want="$output"
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 8 -P quant:bits=2 -t 0
    assert_success
    [ "$output" == "$want" ]
    [ "$stderr" == "kv-run: -t is deprecated here: use --temp" ]
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 8 -q -P quant:bits=2 -t 0
    [ -z "$stderr" ]
}

@test "kv-run --device takes cuda:N and a bare ordinal; without a GPU both exit 69" {
    bash -c 'kv-run --synthetic tiny --random-prompt 4 -n 1 --device cuda' >/dev/null 2>&1 && skip "a usable GPU is present"
    run --separate-stderr kv-run -m "$MODEL" -n 2 --device cuda:0
    assert_fails_with 69 "--device cuda"
    run --separate-stderr kv-run -m "$MODEL" -n 2 --device 1
    assert_fails_with 69 "--device cuda"
    run --separate-stderr kv-run -m "$MODEL" -n 2 --device cuda:
    assert_fails_with 64 "--device must be cpu, cuda or auto"
}

@test "kv-run --dump-kv --zstd writes a zstd .kvc; --zstd alone is a usage error (64)" {
    run --separate-stderr kv-run -m "$MODEL" -p "Once upon a time" -n 0 --dump-kv "$BATS_TEST_TMPDIR/z.kvc" --zstd 3
    assert_success
    [ "$(head -c 4 "$BATS_TEST_TMPDIR/z.kvc" | od -An -tx1 | tr -d ' ')" == "28b52ffd" ]
    kv-run -m "$MODEL" -p "Once upon a time" -n 0 --dump-kv "$BATS_TEST_TMPDIR/p.kvc"
    run --separate-stderr kv-info --json "$BATS_TEST_TMPDIR/z.kvc"
    assert_success
    [ "$(json_get 'j["zstd"], j["n_tokens"]')" == "(True, 5)" ]
    [ "$(zstd -dc "$BATS_TEST_TMPDIR/z.kvc" | cmp - "$BATS_TEST_TMPDIR/p.kvc" && echo same)" == "same" ]
    run --separate-stderr kv-run -m "$MODEL" -p hi -n 2 --zstd 3
    assert_fails_with 64 "--zstd goes with --dump-kv"
}
