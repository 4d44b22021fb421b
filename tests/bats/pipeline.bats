#!/usr/bin/env bats
# The README's pipeline on stories260K, as `make demo` runs it: a prompt
# longer than quant's fp16 window, so the profile's deployment and each
# policy change the resident bytes, and a lossy one the text.
bats_require_minimum_version 1.5.0
load helper

setup_file() {
    export WORK="$BATS_FILE_TMPDIR"
    export M="$DATA/stories260K/stories260K.bin" P="$DATA/stories260K/reference/greedy_bos_200.txt"
    kv-run --model "$M" --prompt-file "$P" -n 0 --dump-kv - > "$WORK/story.kvc"
    kv-profile --kv-budget 0.45 "$WORK/story.kvc" > "$WORK/profile.json"
    kv-run --model "$M" -P full --prompt-file "$P" -n 40 --report "$WORK/full.json" > /dev/null
}

@test "the README's prompt is longer than quant's 128-token fp16 window" {
    run --separate-stderr kv-info --json "$WORK/story.kvc"
    assert_success
    [ "$(json_get 'j["n_tokens"] > 128')" = True ]
}

@test "the README's profile fits its 0.45 budget and packs every layer" {
    output=$(cat "$WORK/profile.json")
    [ "$(json_get 'j["choice"]["budget_met"] and j["choice"]["ratio"] <= 0.45')" = True ]
    [ "$(json_get 'all(l["choice"] != "full" for l in j["layers"])')" = True ]
}

@test "kv-quant --profile on the README's cache writes fewer K/V bytes than fp16" {
    run --separate-stderr sh -c 'kv-quant --profile "$WORK/profile.json" "$WORK/story.kvc" | kv-info --json -'
    assert_success
    [ "$(json_get 'j["kv_bytes"] < 0.5 * j["f16_kv_bytes"]')" = True ]
}

@test "kv-run with the README's profile holds fewer resident bytes than full" {
    run --separate-stderr kv-run --model "$M" --profile "$WORK/profile.json" --prompt-file "$P" -n 40 --report -
    assert_success
    full=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["kv_bytes"]["gpu"])' "$WORK/full.json")
    [ "$(json_get "j['kv_bytes']['gpu'] < 0.3 * $full and j['generated_tokens'] == 40")" = True ]
}

@test "a 2-bit cache without the fp16 window changes the README's continuation" {
    run --separate-stderr kv-run --model "$M" -P quant:bits=2,residual=0 --prompt-file "$P" -n 40 --report -
    assert_success
    ids=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["generated_ids"])' "$WORK/full.json")
    [ "$(json_get "j['generated_ids'] != $ids")" = True ]
}
