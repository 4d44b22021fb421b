#!/usr/bin/env bats
# kv-profile: options, errors, the JSON report (parsed), aggregation over
# files, the SVG heatmap, and the deploy config accepted by kv-quant.
bats_require_minimum_version 1.5.0
load helper

setup_file() {
    export WORK="$BATS_FILE_TMPDIR"
    "$PY" -c "import sys; sys.path.insert(0, '$ROOT/tests/interop'); import quant_check as q; \
q.random_kvc('$WORK/a.kvc', 11, L=3, NH=4, H=2, T=200, D=32, nq=8); \
q.random_kvc('$WORK/b.kvc', 12, L=3, NH=4, H=2, T=150, D=32, nq=8); \
q.random_kvc('$WORK/other.kvc', 13, L=2, NH=4, H=2, T=150, D=32, nq=8)"
}

@test "kv-profile --help prints usage on stdout and exits 0" {
    run --separate-stderr kv-profile --help
    assert_success
    [[ "$output" == *"--tau"* ]]
    [[ "$output" == *"--svg"* ]]
}

@test "kv-profile --version names the tool version, the kvc format version and CUDA status" {
    run --separate-stderr kv-profile --version
    assert_success
    [[ "${lines[0]}" =~ ^kv-profile\ [0-9]+\.[0-9]+\.[0-9]+$ ]]
    [[ "$output" == *"kvc format version "[0-9]* ]]
    [[ "$output" == *"CUDA: "* ]]
}

@test "kv-profile rejects an unknown option with exit 64" {
    run --separate-stderr kv-profile --bogus "$WORK/a.kvc"
    assert_fails_with 64 "unknown option"
}

@test "kv-profile without a file is a usage error (64)" {
    run --separate-stderr kv-profile
    assert_fails_with 64 "no input"
}

@test "kv-profile reports a missing file with exit 66" {
    run --separate-stderr kv-profile "$WORK/missing.kvc"
    assert_fails_with 66 "missing.kvc"
}

@test "kv-profile rejects a cache without queries with exit 65" {
    "$PY" -c "import sys; sys.path.insert(0, '$ROOT/tests/interop'); import quant_check as q, numpy as np; \
t, m = q.read_kvc('$WORK/a.kvc'); \
q.write_kvc('$WORK/noq.kvc', {k: np.array(v) for k, v in t.items() if not k.endswith('.q')}, {})"
    run --separate-stderr kv-profile "$WORK/noq.kvc"
    assert_fails_with 65 "query"
}

@test "kv-profile rejects files of different geometry with exit 65" {
    run --separate-stderr kv-profile "$WORK/a.kvc" "$WORK/other.kvc"
    assert_fails_with 65 "differs"
}

@test "kv-profile writes JSON with per-layer and per-head numbers and a deploy config" {
    run --separate-stderr kv-profile --json --alpha 0.1 --nq 4 "$WORK/a.kvc"
    assert_success
    [ "$(json_get 'j["n_layers"], j["n_heads"], j["n_q"]')" = "(3, 4, 4)" ]
    [ "$(json_get 'all(len(l["heads"]["score"]) == 4 and 0 <= l["score"] <= 1 for l in j["layers"])')" = True ]
    [ "$(json_get 'all(l[e] >= 0 for l in j["layers"] for e in ("err_1bit", "err_2bit", "err_4bit", "err_sparse", "err_dsq"))')" = True ]
    [ "$(json_get 'all(len(l["heads"]["err_dsq"]) == 4 for l in j["layers"])')" = True ]
    [ "$(json_get 'j["deploy"]["version"], sorted(e["layer"] for e in j["deploy"]["layers"])')" = "(3, [0, 1, 2])" ]
    [ "$(json_get 'all((l["tau_class"] == "quant") == (l["score"] > 0.2) for l in j["layers"])')" = True ]
    # every layer's choice is one of the options, its class the policy kind deployed
    [ "$(json_get 'all(l["choice"] in l["bytes"] and j["deploy"]["layers"][i]["policy"].startswith(l["class"]) for i, l in enumerate(j["layers"]))')" = True ]
}

@test "kv-profile --rule tau moves layers between quant and sparse with --tau" {
    run --separate-stderr kv-profile --rule tau --tau 0 "$WORK/a.kvc"
    assert_success
    [ "$(json_get '[e["policy"].split(":")[0] for e in j["deploy"]["layers"]]')" = "['quant', 'quant', 'quant']" ]
    [ "$(json_get 'j["deploy"]["rule"]')" = tau ]
    run --separate-stderr kv-profile --rule tau --tau 1 "$WORK/a.kvc"
    [ "$(json_get '[e["policy"].split(":")[0] for e in j["deploy"]["layers"]]')" = "['sparse', 'sparse', 'sparse']" ]
}

@test "kv-profile --kv-budget keeps the chosen bytes within the budget, and a budget of full keeps every layer full" {
    for b in 0.35 0.5 0.75; do
        run --separate-stderr kv-profile --json --kv-budget "$b" "$WORK/a.kvc"
        assert_success
        [ "$(json_get "j['choice']['budget_met'] and j['choice']['kv_bytes'] <= $b * j['choice']['full_bytes'] + 1")" = True ]
        [ "$(json_get "sum(l['bytes'][l['choice']] for l in j['layers']) == j['choice']['kv_bytes']")" = True ]
    done
    run --separate-stderr kv-profile --json --kv-budget 1 "$WORK/a.kvc"
    [ "$(json_get '[l["choice"] for l in j["layers"]]')" = "['full', 'full', 'full']" ]
    # a budget in bytes: the same choice as the fraction it is of full's bytes
    full=$(json_get 'int(j["choice"]["full_bytes"])')
    run --separate-stderr kv-profile --json --kv-budget 0.5 "$WORK/a.kvc"
    frac=$(json_get '[l["choice"] for l in j["layers"]]')
    run --separate-stderr kv-profile --json --kv-budget $((full / 2)) "$WORK/a.kvc"
    [ "$(json_get '[l["choice"] for l in j["layers"]]')" = "$frac" ]
}

@test "kv-profile warns when no choice fits the budget and writes the fewest bytes" {
    run --separate-stderr kv-profile --json --kv-budget 0.0001 "$WORK/a.kvc"
    assert_success
    [[ "$stderr" == *"exceed"* ]]
    [ "$(json_get 'j["choice"]["budget_met"]')" = False ]
}

@test "kv-profile --choices measures and chooses only the options it names" {
    run --separate-stderr kv-profile --json --choices quant2,quant4-r0 --kv-budget 0.3 "$WORK/a.kvc"
    assert_success
    [ "$(json_get 'j["choices"]')" = "['full', 'quant2', 'quant4-r0']" ]
    [ "$(json_get 'all(l["choice"] in ("full", "quant2", "quant4-r0") for l in j["layers"])')" = True ]
    [ "$(json_get 'all(l["err_1bit"] is None and l["err_4bit_r0"] >= 0 for l in j["layers"])')" = True ]
    # by default every option is measured, the budget variants too
    run --separate-stderr kv-profile --json "$WORK/a.kvc"
    [ "$(json_get 'len(j["choices"]), all(l[e] >= 0 for l in j["layers"] for e in ("err_2bit_r0", "err_2bit_r32g32", "err_4bit_r0", "err_4bit_r0g128", "err_dsq_s10"))')" = "(11, True)" ]
    [ "$(json_get 'all(l["bytes"]["quant4-r0"] < l["bytes"]["quant4"] for l in j["layers"])')" = True ]
}

@test "kv-profile deploys a residual-0 choice as quant with residual 0" {
    run --separate-stderr kv-profile --json --choices quant4-r0 --kv-budget 0.5 "$WORK/a.kvc"
    assert_success
    [ "$(json_get 'sorted(set(e["policy"] for e in j["deploy"]["layers"]))')" = "['quant:bits=4,group=64,residual=0']" ]
}

@test "kv-profile rejects an unknown or empty --choices name with exit 64" {
    run --separate-stderr kv-profile --choices quant2,quant3 "$WORK/a.kvc"
    assert_fails_with 64 "quant3"
    run --separate-stderr kv-profile --choices quant2, "$WORK/a.kvc"
    assert_fails_with 64 "--choices"
}

@test "kv-profile rejects a bad --rule, --kv-budget or --select with exit 64" {
    run --separate-stderr kv-profile --rule best "$WORK/a.kvc"
    assert_fails_with 64 "--rule"
    run --separate-stderr kv-profile --kv-budget 0 "$WORK/a.kvc"
    assert_fails_with 64 "--kv-budget"
    run --separate-stderr kv-profile --select sketch "$WORK/a.kvc"
    assert_fails_with 64 "--select"
}

@test "kv-profile aggregates several files as the mean per layer and head" {
    run --separate-stderr kv-profile "$WORK/a.kvc"
    a=$(json_get 'j["layers"][1]["heads"]["score"][2]')
    run --separate-stderr kv-profile "$WORK/b.kvc"
    b=$(json_get 'j["layers"][1]["heads"]["score"][2]')
    run --separate-stderr kv-profile "$WORK/a.kvc" "$WORK/b.kvc"
    assert_success
    [ "$(json_get 'j["files"]')" = 2 ]
    [ "$(json_get "abs(j['layers'][1]['heads']['score'][2] - ($a + $b) / 2) < 1e-5")" = True ]
}

@test "kv-profile --svg writes a well-formed heatmap with one cell per layer and head" {
    run --separate-stderr kv-profile --svg "$WORK/h.svg" "$WORK/a.kvc"
    assert_success
    run "$PY" -c "import xml.etree.ElementTree as E; r = E.parse('$WORK/h.svg').getroot(); \
print(len([e for e in r if e.tag.endswith('rect') and e.find('{http://www.w3.org/2000/svg}title') is not None]))"
    assert_output 12
}

@test "kv-profile --svg into a missing directory fails with exit 73 and prints nothing" {
    run --separate-stderr kv-profile --svg "$WORK/no/dir/h.svg" "$WORK/a.kvc"
    [ "$status" -eq 73 ]
    [ -z "$output" ]
}

@test "kv-profile output drives kv-quant --profile" {
    kv-profile --rule tau --tau 0 --bits 2 "$WORK/a.kvc" > "$WORK/p.json"
    run --separate-stderr kv-quant --profile "$WORK/p.json" --report - -o "$WORK/q.kvc" "$WORK/a.kvc"
    assert_success
    [ "$(json_get 'j["method"]')" = per-layer ]
    [ "$(json_get 'all(l["k_encoding"] == "kivi" and l["bits"] == 2 for l in j["layers"])')" = True ]
}

@test "kv-quant --profile packs each layer of a version 3 config with its own encoding" {
    printf '{"version": 3, "n_layers": 3, "layers": [{"layer": 0, "policy": "quant:bits=4,group=32,residual=16"}, {"layer": 2, "policy": "dsq:window=32,base=salient"}, {"layer": 1, "policy": "sparse"}]}' > "$WORK/v2.json"
    run --separate-stderr kv-quant --profile "$WORK/v2.json" --report - -o "$WORK/q2.kvc" "$WORK/a.kvc"
    assert_success
    [ "$(json_get '[l["k_encoding"] for l in j["layers"]]')" = "['kivi', 'plain', 'dsq']" ]
    [ "$(json_get 'j["layers"][0]["bits"], j["layers"][2]["window"], j["layers"][2]["base"]')" = "(4, 32, 'salient')" ]
    # dsq as the policy packs it by default: keys at 4 bits, values at 2
    [ "$(json_get 'j["layers"][2]["bits"], j["layers"][2]["vbits"]')" = "(4, 2)" ]
    run --separate-stderr kv-info --json "$WORK/q2.kvc"
    assert_success
    [ "$(json_get 'j["layers"][2]["k"]["bits"], j["layers"][2]["v"]["bits"]')" = "(4, 2)" ]
    # the same file as version 2 (written before the 4/2 default) packs as it was fitted: 2/2
    sed 's/"version": 3/"version": 2/' "$WORK/v2.json" > "$WORK/v2old.json"
    run --separate-stderr kv-quant --profile "$WORK/v2old.json" --report - -o "$WORK/q2old.kvc" "$WORK/a.kvc"
    assert_success
    [ "$(json_get 'j["layers"][2]["bits"], j["layers"][2]["vbits"]')" = "(2, 2)" ]
    run --separate-stderr kv-quant --profile "$WORK/v2.json" --bits 2 -o "$WORK/q3.kvc" "$WORK/a.kvc"
    assert_fails_with 64 "each layer"
}

@test "kv-profile classifies every layer of a real stories260K cache" {
    [ -x "$BIN/kv-run" ] || skip "kv-run not built"
    kv-run --model "$DATA/stories260K/stories260K.bin" \
        --prompt-file "$DATA/stories260K/reference/greedy_bos_200.txt" -n 1 --dump-kv "$WORK/real.kvc" > /dev/null 2>&1
    run --separate-stderr kv-profile --budget 32 --group 32 --residual 32 "$WORK/real.kvc"
    assert_success
    [ "$(json_get 'sorted(e["layer"] for e in j["deploy"]["layers"])')" = "[0, 1, 2, 3, 4]" ]
    # 2-bit quantization loses less than 1-bit on every layer of the real model
    [ "$(json_get 'all(l["err_2bit"] < l["err_1bit"] for l in j["layers"])')" = True ]
    run --separate-stderr kv-quant --profile /dev/stdin --report - -o "$WORK/rq.kvc" "$WORK/real.kvc" <<< "$output"
    assert_success
}

@test "kv-profile --help states the exit status table exactly once" {
    run --separate-stderr kv-profile --help
    assert_success
    [ "$(grep -c '^Exit status:' <<<"$output")" -eq 1 ]
    [[ "$output" == *"69 unavailable"* ]]
}

@test "kv-profile's man page documents every option its --help lists and every exit status" {
    run "$ROOT/tests/man-covers-help.sh" "$ROOT/man/kv-profile.1" kv-profile
    assert_success
}

@test "kv-profile leaves no SVG behind when stdout cannot be written (exit 74)" {
    run --separate-stderr bash -c 'kv-profile --svg "$2" "$1" > /dev/full' _ "$WORK/a.kvc" "$BATS_TEST_TMPDIR/h.svg"
    assert_fails_with 74 "write error"
    [ -z "$(find "$BATS_TEST_TMPDIR" -name '*h.svg*')" ]
}

@test "kv-profile rejects an --svg path it cannot create with exit 73 and no JSON" {
    touch "$BATS_TEST_TMPDIR/afile"
    run --separate-stderr kv-profile --svg "$BATS_TEST_TMPDIR/afile/h.svg" "$WORK/a.kvc"
    assert_fails_with 73 "afile/h.svg"
    [ -z "$output" ]
}

@test "kv-profile --progress escapes control characters of the file name it shows" {
    p="$WORK/$(printf 'x\033]0;pwned\007y').kvc"
    cp "$WORK/a.kvc" "$p"
    run --separate-stderr kv-profile --progress --json "$p"
    assert_success
    [[ "$stderr" == *'profiling '"$WORK"'/x\x1b]0;pwned\x07y.kvc (1 of 1)'* ]]
    # the only raw ESC bytes are the progress line's own erase-line sequences
    printf '%s' "$stderr" | "$PY" -c 'import sys; b=sys.stdin.buffer.read().replace(b"\x1b[K", b""); sys.exit(0x1b in b or 0x07 in b)'
}

@test "kv-profile --steps without --model is a usage error (64)" {
    run --separate-stderr kv-profile --steps 8 "$WORK/a.kvc"
    assert_fails_with 64 "--steps goes with --model"
}

@test "kv-profile --model with --rule tau is a usage error (64)" {
    run --separate-stderr kv-profile --model "$DATA/stories260K/stories260K.bin" --rule tau "$WORK/a.kvc"
    assert_fails_with 64 "--rule tau"
}

@test "kv-profile --model reports a missing model with exit 66" {
    run --separate-stderr kv-profile --model "$WORK/missing.bin" "$WORK/a.kvc"
    assert_fails_with 66 "missing.bin"
}

@test "kv-profile --model rejects a cache another model made with exit 65" {
    run --separate-stderr kv-profile --model "$DATA/stories260K/stories260K.bin" --choices quant4 "$WORK/a.kvc"
    [ "$status" -eq 65 ]
    [[ "$stderr" == *"a.kvc"* ]]
    [ "$output" = "" ]
}

@test "kv-profile --model rates a real stories260K cache by KL and fits a quarter of full's bytes" {
    [ -x "$BIN/kv-run" ] || skip "kv-run not built"
    kv-run --model "$DATA/stories260K/stories260K.bin" \
        --prompt-file "$DATA/stories260K/reference/greedy_bos_200.txt" -n 0 --dump-kv "$WORK/kl.kvc" > /dev/null 2>&1
    run --separate-stderr kv-profile --model "$DATA/stories260K/stories260K.bin" --steps 202 "$WORK/kl.kvc"
    assert_fails_with 64 "steps must be 1..201"
    run --separate-stderr kv-profile --model "$DATA/stories260K/stories260K.bin" --steps 64 --kv-budget 0.25 \
        --choices quant2-r0,quant4-r0,quant1-r0,stream32,sparse32 "$WORK/kl.kvc"
    assert_success
    [ "$(json_get 'j["error"], j["kl_files"], j["kl_steps"]')" = "('kl', 1, 64)" ]
    [ "$(json_get 'j["choice"]["budget_met"] and j["choice"]["ratio"] <= 0.25')" = True ]
    # full against itself is 0; 1 bit without the window is far from 4 bits on every layer
    [ "$(json_get 'all(l["kl"]["full"] == 0 and l["kl"]["quant1-r0"] > 10 * l["kl"]["quant4-r0"] for l in j["layers"])')" = True ]
    # the deploy config carries the KL each layer was chosen by
    [ "$(json_get 'all(e["error"] == l["kl"][l["choice"]] for e, l in zip(j["deploy"]["layers"], j["layers"]))')" = True ]
    # the 2-bit and 4-bit options do not fit (0.30, 0.42 of full); the KL picks sparse32 (0.25)
    [ "$(json_get '"sparse32" in [l["choice"] for l in j["layers"]]')" = True ]
    # without the model the attention error decides
    run --separate-stderr kv-profile --kv-budget 0.25 --choices quant4-r0,sparse32 "$WORK/kl.kvc"
    assert_success
    [ "$(json_get 'j["error"], "kl" in j["layers"][0]')" = "('attn', False)" ]
}

@test "kv-profile measures the small-cache choices by default only with --model" {
    run --separate-stderr kv-profile --json "$WORK/a.kvc"
    assert_success
    [ "$(json_get 'any(c in j["choices"] for c in ("quant1-r0", "stream32", "stream64", "sparse32"))')" = False ]
    run --separate-stderr kv-profile --json --choices all "$WORK/a.kvc"
    assert_success
    [ "$(json_get 'all(c in j["choices"] for c in ("quant1-r0", "stream32", "stream64", "sparse32"))')" = True ]
}
