#!/usr/bin/env bats
# kv-run with every KV policy (lib/kv_policy*): each runs on the real
# stories260K model and on --synthetic tiny, the report's bytes equal what
# the policy's layout implies, and policies that hold every token reproduce
# the full cache's greedy text exactly.
bats_require_minimum_version 1.5.0
load helper

STORIES="$DATA/stories260K"

# run kv-run on stories260K with a 300-token seeded random prompt; the
# report goes to $REP and is loaded into $output for json_get
stories_report() { # policy [extra args]
    local pol=$1; shift
    REP="$BATS_TEST_TMPDIR/rep.json"
    run --separate-stderr kv-run -T 1 -m "$STORIES/stories260K.bin" --random-prompt 300 -n 20 \
        --policy "$pol" --report "$REP" "$@"
    [ "$status" -eq 0 ] || { echo "kv-run --policy $pol: $status $stderr"; return 1; }
    output=$(cat "$REP")
}

@test "kv-run runs every policy on stories260K" {
    for pol in full quant quant:bits=2 quant:bits=4 sparse sparse:select=exact streaming dsq \
        dsq:keep=0.5,chan=0.01 "0=full;1-3=sparse:k=16;*=quant:bits=2"; do
        run --separate-stderr kv-run -T 1 -m "$STORIES/stories260K.bin" -p "Once upon a time" -n 30 \
            --policy "$pol" --report "$BATS_TEST_TMPDIR/r.json"
        [ "$status" -eq 0 ] || { echo "$pol: exit $status: $stderr"; return 1; }
        [ -n "$output" ]
        output=$(cat "$BATS_TEST_TMPDIR/r.json")
        [ "$(json_get 'j["generated_tokens"]')" -eq 30 ]
    done
    [ "$(json_get '[l["policy"] for l in j["layers"]]')" = "['full', 'sparse', 'sparse', 'sparse', 'quant']" ]
}

@test "kv-run runs every policy on --synthetic tiny" {
    for pol in full quant quant:bits=2 sparse streaming dsq; do
        run --separate-stderr kv-run -T 1 --synthetic tiny --random-prompt 150 -n 8 --policy "$pol" \
            --report "$BATS_TEST_TMPDIR/r.json"
        [ "$status" -eq 0 ] || { echo "$pol: exit $status: $stderr"; return 1; }
        output=$(cat "$BATS_TEST_TMPDIR/r.json")
        [ "$(json_get 'j["layers"][0]["policy"]')" = "${pol%%:*}" ]
        [ "$(json_get 'j["kv_bytes"]["gpu"] > 0')" = True ]
    done
}

@test "kv-run full: resident bytes are 2 x kv_heads x tokens x head_dim x dtype size" {
    stories_report full
    [ "$(json_get 'all(l["gpu_bytes"] == 2*4*l["tokens"]*8*4 for l in j["layers"])')" = True ]
    [ "$(json_get 'j["layers"][0]["tokens"]')" -eq 319 ]
    stories_report full --kv-dtype f16
    [ "$(json_get 'all(l["gpu_bytes"] == 2*4*l["tokens"]*8*2 for l in j["layers"])')" = True ]
}

@test "kv-run quant: bytes follow the KIVI layout (codes, fp16 scales and zeros, fp16 residual)" {
    for spec in "quant 1 64 128" "quant:bits=2,group=32,residual=64 2 32 64" "quant:bits=4,group=8,residual=0 4 8 0"; do
        set -- $spec
        stories_report "$1"
        b=$2 G=$3 R=$4
        expr="all(l['gpu_bytes'] == (lambda T, H, D, nq: H*(2*nq*D*$b//8 + 4*(nq//$G)*D + 4*nq*(D//min($G,D)) + 4*(T-nq)*D))(l['tokens'], 4, 8, max(0, (l['tokens']-$R))//$G*$G) and l['host_bytes'] == 0 for l in j['layers'])"
        [ "$(json_get "$expr")" = True ] || { echo "$1: $output"; return 1; }
    done
}

@test "kv-run sparse: prompt on the host, sink + window + generated resident, fetches per step" {
    stories_report sparse:sink=8,window=56,channels=4,k=32,select=channels
    # prompt 300 tokens in host memory; resident: 8 sink + the most recent
    # 56 + all generated (19 steps); channel maxima 4 heads x 8 x 4 bytes
    [ "$(json_get 'all(l["host_bytes"] == 2*4*300*8*4 for l in j["layers"])')" = True ]
    [ "$(json_get 'all(l["gpu_bytes"] == 2*4*(8+56)*8*4 + 4*8*4 for l in j["layers"])')" = True ]
    # per step: 4 channels of every candidate key + K/V rows of 32 tokens,
    # for each of 4 KV heads; candidates = 319 - 8 - 56 = 255 at the last step
    [ "$(json_get 'all(l["fetched_bytes_last"] == 4*(4*255*4 + 2*32*8*4) for l in j["layers"])')" = True ]
    [ "$(json_get 'j["pcie_bytes_per_token"] > 0')" = True ]
}

@test "kv-run streaming keeps sink + window tokens only" {
    stories_report streaming:sink=4,window=60
    [ "$(json_get 'all(l["gpu_bytes"] == 2*4*64*8*4 and l["host_bytes"] == 0 for l in j["layers"])')" = True ]
}

@test "kv-run dsq: bytes follow the DSQ layout for the packed windows" {
    stories_report dsq:salient=0.2,bits=2
    # 319 tokens: 4 windows of 64 packed (13 salient INT8 + 51 2-bit, mask
    # shared by K and V, key base), 63 tokens fp16; head_dim 8, group 8
    win="(8 + 2*(13*8 + 2*8 + 51*8*2//8 + 4*51*1) + 2*8)"
    [ "$(json_get "all(l['gpu_bytes'] == 4*(4*$win + 63*8*2*2) for l in j['layers'])")" = True ]
}

@test "kv-run dsq by default packs keys at 4 bits and values at 2 with 10% salient tokens" {
    stories_report dsq
    # 6 salient INT8 + 58 non-salient rows: keys 4 bits, values 2 bits
    win="(8 + 2*(6*8 + 2*8 + 4*58*1) + 58*8*4//8 + 58*8*2//8 + 2*8)"
    [ "$(json_get "all(l['gpu_bytes'] == 4*(4*$win + 63*8*2*2) for l in j['layers'])")" = True ]
    [ "$(json_get "all('kbits=4 vbits=2' in l['params'] for l in j['layers'])")" = True ]
}

@test "kv-run dsq:kbits and vbits set the keys' and the values' bits" {
    stories_report dsq:salient=0.2,kbits=1,vbits=4
    win="(8 + 2*(13*8 + 2*8 + 4*51*1) + 51*8*1//8 + 51*8*4//8 + 2*8)"
    [ "$(json_get "all(l['gpu_bytes'] == 4*(4*$win + 63*8*2*2) for l in j['layers'])")" = True ]
    run --separate-stderr kv-run -m "$STORIES/stories260K.bin" -p "Once" -n 1 --policy dsq:kbits=3
    assert_fails_with 64 "kbits: 3 is not supported"
}

@test "policies that hold every token reproduce full's greedy text exactly" {
    args=(-m "$STORIES/stories260K.bin" -p "Once upon a time" -n 120)
    run --separate-stderr kv-run -T 1 "${args[@]}" --policy full
    [ "$status" -eq 0 ]
    full_text=$output
    for pol in sparse:k=1000 sparse:k=1000,select=exact streaming:window=1000 \
        "sparse:frac=1,sink=0,window=0"; do
        run --separate-stderr kv-run -T 1 "${args[@]}" --policy "$pol"
        [ "$status" -eq 0 ]
        [ "$output" = "$full_text" ] || { echo "$pol differs"; return 1; }
    done
}

@test "1-bit quantization changes stories260K's greedy text, a window of 8 tokens too" {
    args=(-m "$STORIES/stories260K.bin" -p "Once upon a time" -n 200)
    run --separate-stderr kv-run -T 1 "${args[@]}" --policy full
    full_text=$output
    run --separate-stderr kv-run -T 1 "${args[@]}" --policy quant:residual=0,group=16
    [ "$status" -eq 0 ]
    [ "$output" != "$full_text" ]
    run --separate-stderr kv-run -T 1 "${args[@]}" --policy streaming:sink=0,window=8
    [ "$status" -eq 0 ]
    [ "$output" != "$full_text" ]
}

@test "kv-run rejects bad policy specs with exit 64 and says why" {
    m=(-m "$STORIES/stories260K.bin" -p hi -n 2)
    run --separate-stderr kv-run -T 1 "${m[@]}" --policy sparce
    assert_fails_with 64 "unknown policy 'sparce'"
    run --separate-stderr kv-run -T 1 "${m[@]}" --policy quant:bits=3
    assert_fails_with 64 "bits"
    run --separate-stderr kv-run -T 1 "${m[@]}" --policy quant:k=3
    assert_fails_with 64 "no key 'k'"
    run --separate-stderr kv-run -T 1 "${m[@]}" --policy "7=full"
    assert_fails_with 64 "outside 0..4"
    run --separate-stderr kv-run -T 1 "${m[@]}" --policy sparse:k=x
    assert_fails_with 64 "not an integer"
}
