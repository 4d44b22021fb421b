#!/usr/bin/env bats
# kv-quant: options, errors, pipelines, the JSON report, and the independent
# numpy check of the packed layouts (tests/interop/quant_check.py).
bats_require_minimum_version 1.5.0
load helper

setup_file() {
    export WORK="$BATS_FILE_TMPDIR"
    "$PY" -c "import sys; sys.path.insert(0, '$ROOT/tests/interop'); import quant_check as q; \
q.random_kvc('$WORK/r.kvc', 7, L=3, NH=4, H=2, T=300, D=64, nq=8)"
}

@test "kv-quant --help prints usage on stdout and exits 0" {
    run --separate-stderr kv-quant --help
    assert_success
    [[ "$output" == *"--method"* ]]
    [[ "$output" == *"--decode"* ]]
}

@test "kv-quant --version names the tool version, the kvc format version and CUDA status" {
    run --separate-stderr kv-quant --version
    assert_success
    [[ "${lines[0]}" =~ ^kv-quant\ [0-9]+\.[0-9]+\.[0-9]+$ ]]
    [[ "$output" == *"kvc format version "[0-9]* ]]
    [[ "$output" == *"CUDA: "* ]]
}

@test "kv-quant rejects an unknown option with exit 64" {
    run --separate-stderr kv-quant --frobnicate "$WORK/r.kvc"
    assert_fails_with 64 "unknown option"
}

@test "kv-quant rejects 3 bits with exit 64" {
    run --separate-stderr kv-quant --bits 3 -o "$WORK/x.kvc" "$WORK/r.kvc"
    assert_fails_with 64 "bits"
}

@test "kv-quant rejects a layer list out of range with exit 64" {
    run --separate-stderr kv-quant --layers 0,7 -o "$WORK/x.kvc" "$WORK/r.kvc"
    assert_fails_with 64 "outside"
}

@test "kv-quant reports a missing input file with exit 66" {
    run --separate-stderr kv-quant -o "$WORK/x.kvc" "$WORK/nope.kvc"
    assert_fails_with 66 "nope.kvc"
    [ ! -e "$WORK/x.kvc" ]
}

@test "kv-quant rejects a truncated file with exit 65" {
    head -c 1000 "$WORK/r.kvc" > "$WORK/trunc.kvc"
    run --separate-stderr kv-quant -o "$WORK/x.kvc" "$WORK/trunc.kvc"
    assert_fails_with 65 "trunc.kvc"
    [ ! -e "$WORK/x.kvc" ]
}

@test "kv-quant rejects a malformed profile with exit 65" {
    printf '{"quant_layers": [0], "sparse_layers": "x"}' > "$WORK/bad.json"
    run --separate-stderr kv-quant --profile "$WORK/bad.json" -o "$WORK/x.kvc" "$WORK/r.kvc"
    assert_fails_with 65 "sparse_layers"
    printf '{not json' > "$WORK/bad2.json"
    run --separate-stderr kv-quant --profile "$WORK/bad2.json" -o "$WORK/x.kvc" "$WORK/r.kvc"
    assert_fails_with 65 "not valid JSON"
}

@test "kv-quant rejects a profile whose layers exceed the cache with exit 65" {
    printf '{"quant_layers": [0, 5], "sparse_layers": []}' > "$WORK/big.json"
    run --separate-stderr kv-quant --profile "$WORK/big.json" -o "$WORK/x.kvc" "$WORK/r.kvc"
    assert_fails_with 65 "out of range"
}

@test "kv-quant round-trips through a pipeline and decodes to F16 close to the input" {
    cat "$WORK/r.kvc" | kv-quant --bits 4 --group 32 --residual 32 | kv-quant -d - > "$WORK/rt.kvc"
    run "$PY" - "$WORK/r.kvc" "$WORK/rt.kvc" "$ROOT" <<'PYEOF'
import sys
import numpy as np
sys.path.insert(0, sys.argv[3] + '/tests/interop')
import quant_check as q
a, _ = q.read_kvc(sys.argv[1]); b, m = q.read_kvc(sys.argv[2])
for l in range(3):
    for w in 'kv':
        x, y = a['layers.%d.%s' % (l, w)], b['layers.%d.%s' % (l, w)]
        assert y.dtype == np.float16 and y.shape == x.shape, (y.dtype, y.shape)
        rel = np.linalg.norm(y.astype(np.float32) - x) / np.linalg.norm(x)
        assert 0 < rel < 0.15, rel
    assert np.array_equal(a['layers.%d.q' % l], b['layers.%d.q' % l])
assert np.array_equal(a['tokens'], b['tokens'])
print('ok')
PYEOF
    assert_success
    assert_output "ok"
}

@test "kv-quant --report writes JSON with bytes, ratio and per-layer errors" {
    run --separate-stderr kv-quant --bits 1 --residual 32 --report - -o "$WORK/q1.kvc" "$WORK/r.kvc"
    assert_success
    [ "$(json_get 'j["bytes_after"] < j["bytes_before"]')" = True ]
    [ "$(json_get 'round(j["ratio"], 3) == round(j["bytes_before"] / j["bytes_after"], 3)')" = True ]
    [ "$(json_get 'len(j["layers"])')" = 3 ]
    [ "$(json_get 'all(l["k_mse"] > 0 and l["v_max_err"] > 0 and 0 < l["attn_rel_err"] for l in j["layers"])')" = True ]
    # exact accounting: 2 heads x 256 quantized tokens x 8 bytes codes + fp16 scale/zero + residual
    [ "$(json_get 'j["bytes_after"]')" = "$(( 3 * ( (2*256*8 + 4*2*4*64 + 2*2*44*64) + (2*256*8 + 4*2*256*1 + 2*2*44*64) ) ))" ]
}

@test "kv-quant --report - refuses to share stdout with the .kvc" {
    run --separate-stderr kv-quant --report - "$WORK/r.kvc"
    assert_fails_with 64 "report"
}

@test "kv-quant --layers quantizes only the listed layers" {
    run --separate-stderr kv-quant --layers 1 --report - -o "$WORK/l1.kvc" "$WORK/r.kvc"
    assert_success
    [ "$(json_get '[l["k_encoding"] for l in j["layers"]]')" = "['plain', 'kivi', 'plain']" ]
}

@test "kv-quant --method dsq writes DSQ layers with a smaller error on 2 bits than KIVI 1-bit" {
    run --separate-stderr kv-quant --method dsq --report - -o "$WORK/d.kvc" "$WORK/r.kvc"
    assert_success
    [ "$(json_get 'j["method"]')" = dsq ]
    [ "$(json_get 'j["salient"]')" = 13 ]
    [ "$(json_get 'all(l["k_encoding"] == "dsq" for l in j["layers"])')" = True ]
}

@test "kv-quant --profile accepts kv-profile output unchanged" {
    kv-profile --json --rule tau --tau 0.99 "$WORK/r.kvc" > "$WORK/p.json"
    run --separate-stderr kv-quant --profile "$WORK/p.json" --report - -o "$WORK/pq.kvc" "$WORK/r.kvc"
    assert_success
    # tau 0.99: no layer is dense enough, nothing is quantized
    [ "$(json_get 'all(l["k_encoding"] == "plain" for l in j["layers"])')" = True ]
    printf '{"quant_layers": [0, 2], "sparse_layers": [1], "bits": 2}' > "$WORK/p2.json"
    run --separate-stderr kv-quant --profile "$WORK/p2.json" --report - -o "$WORK/pq.kvc" "$WORK/r.kvc"
    assert_success
    [ "$(json_get '[l["k_encoding"] for l in j["layers"]]')" = "['kivi', 'plain', 'kivi']" ]
    [ "$(json_get 'j["bits"]')" = 2 ]
}

@test "kv-quant packed layouts match an independent numpy implementation" {
    run "$PY" "$ROOT/tests/interop/quant_check.py" "$BIN"
    echo "$output"
    assert_success
    [[ "$output" != *"not ok"* ]]
}

@test "kv-quant works in a pipeline on a real cache dumped by kv-run" {
    [ -x "$BIN/kv-run" ] || skip "kv-run not built"
    [ -x "$BIN/kv-info" ] || skip "kv-info not built"
    run --separate-stderr bash -c "kv-run --model '$DATA/stories260K/stories260K.bin' \
        --prompt-file '$DATA/stories260K/reference/greedy_bos_200.txt' -n 1 --dump-kv - 2>/dev/null |
        kv-quant --bits 1 --residual 32 | kv-info --json -"
    assert_success
    [ "$(json_get 'j["n_layers"]')" = 5 ]
    [ "$(json_get 'all(l["k"]["encoding"] == "kivi" and l["v"]["bits"] == 1 for l in j["layers"])')" = True ]
    [ "$(json_get 'j["ratio_vs_f16"] > 1.5')" = True ]
}

@test "kv-quant --help states the exit status table exactly once" {
    run --separate-stderr kv-quant --help
    assert_success
    [ "$(grep -c '^Exit status:' <<<"$output")" -eq 1 ]
    [[ "$output" == *"69 unavailable"* ]]
}

@test "kv-quant leaves no .kvc behind when --report cannot be created (exit 73)" {
    touch "$BATS_TEST_TMPDIR/afile"
    run --separate-stderr kv-quant "$WORK/r.kvc" -o "$BATS_TEST_TMPDIR/q.kvc" --report "$BATS_TEST_TMPDIR/afile/r.json"
    assert_fails_with 73 "afile/r.json"
    [ ! -e "$BATS_TEST_TMPDIR/q.kvc" ]
    [ -z "$(find "$BATS_TEST_TMPDIR" -name '*q.kvc*' -o -name '.r.json*')" ]
}

@test "kv-quant refuses to write a .kvc to a terminal with exit 64" {
    run script -qec "kv-quant '$WORK/r.kvc'" /dev/null
    [ "$status" -eq 64 ]
    [[ "$output" == *"refusing to write a .kvc file to a terminal"* ]]
}

@test "kv-quant's man page documents every option its --help lists and every exit status" {
    run "$ROOT/tests/man-covers-help.sh" "$ROOT/man/kv-quant.1" kv-quant
    assert_success
}

@test "kv-quant commits no .kvc when its --report - cannot be written (exit 74)" {
    run --separate-stderr bash -c 'kv-quant "$1" --report - -o "$2" > /dev/full' _ "$WORK/r.kvc" "$BATS_TEST_TMPDIR/q.kvc"
    assert_fails_with 74 "write error"
    [ -z "$(find "$BATS_TEST_TMPDIR" -name '*q.kvc*')" ]
}

@test "kv-quant rejects an option of the other method with exit 64" {
    run --separate-stderr kv-quant --window 32 -o "$BATS_TEST_TMPDIR/x.kvc" "$WORK/r.kvc"
    assert_fails_with 64 "--method dsq"
    run --separate-stderr kv-quant --method dsq --residual 16 -o "$BATS_TEST_TMPDIR/x.kvc" "$WORK/r.kvc"
    assert_fails_with 64 "--method kivi"
    [ ! -e "$BATS_TEST_TMPDIR/x.kvc" ]
    run --separate-stderr kv-quant --method dsq --window 32 --salient 0.25 -o "$BATS_TEST_TMPDIR/x.kvc" "$WORK/r.kvc"
    assert_success
}

@test "kv-quant --zstd writes a zstd .kvc that kvtools reads back to the same layers" {
    run --separate-stderr kv-quant --bits 2 --zstd 5 -o "$WORK/z.kvc" "$WORK/r.kvc"
    assert_success
    [ "$(head -c 4 "$WORK/z.kvc" | od -An -tx1 | tr -d ' ')" == "28b52ffd" ]
    kv-quant --bits 2 -o "$WORK/p.kvc" "$WORK/r.kvc"
    run --separate-stderr kv-info --json "$WORK/z.kvc"
    assert_success
    [ "$(json_get 'j["zstd"], j["checksums"]')" == "(True, 'verified')" ]
    # decoding either gives the same bytes
    kv-quant --decode -o "$WORK/dz.kvc" "$WORK/z.kvc"
    kv-quant --decode -o "$WORK/dp.kvc" "$WORK/p.kvc"
    cmp "$WORK/dz.kvc" "$WORK/dp.kvc"
    run --separate-stderr kv-quant --zstd 0 -o "$WORK/x.kvc" "$WORK/r.kvc"
    assert_fails_with 64 "--zstd"
}

@test "kv-quant refuses a token subset with positions with exit 65, writing nothing" {
    "$PY" -c "
import sys; sys.path.insert(0, '$ROOT/tests/interop')
import numpy as np, kvc_py as k
z = np.ones((2, 4, 64), dtype=np.float16)
k.write_kvc(sys.argv[1], [('layers.0.k', 'F16', z), ('layers.0.v', 'F16', z),
                          ('positions', 'I32', np.array([0, 2, 5, 7], dtype=np.int32))], checksums=True)" "$WORK/subset.kvc"
    run --separate-stderr kv-quant -o "$WORK/subset-q.kvc" "$WORK/subset.kvc"
    assert_fails_with 65 "positions tensor"
    [ ! -e "$WORK/subset-q.kvc" ]
}

@test "kv-quant --base picks the DSQ key base, reports it, and rejects another name or KIVI with exit 64" {
    for b in rest salient; do
        run --separate-stderr kv-quant --method dsq --base $b --report - -o "$BATS_TEST_TMPDIR/$b.kvc" "$WORK/r.kvc"
        assert_success
        [ "$(json_get 'j["base"]')" = $b ]
        # kv-info shows the base of every DSQ key plane, in JSON and in its table
        run --separate-stderr kv-info --json "$BATS_TEST_TMPDIR/$b.kvc"
        assert_success
        [ "$(json_get '{l["k"]["base_of"] for l in j["layers"]}')" = "{'$b'}" ]
        run script -qec "$BIN/kv-info '$BATS_TEST_TMPDIR/$b.kvc'" /dev/null
        assert_output --partial "base $b"
    done
    # the base changes the packed keys
    run cmp -s "$BATS_TEST_TMPDIR/rest.kvc" "$BATS_TEST_TMPDIR/salient.kvc"
    [ "$status" -eq 1 ]
    run --separate-stderr kv-quant --method dsq --base mean -o "$BATS_TEST_TMPDIR/x.kvc" "$WORK/r.kvc"
    assert_fails_with 64 "--base must be rest or salient, not 'mean'"
    run --separate-stderr kv-quant --base salient -o "$BATS_TEST_TMPDIR/x.kvc" "$WORK/r.kvc"
    assert_fails_with 64 "go with --method dsq"
    [ ! -e "$BATS_TEST_TMPDIR/x.kvc" ]
}
