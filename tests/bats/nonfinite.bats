#!/usr/bin/env bats
# NaN and infinity in what the tools are handed: a checkpoint with one
# non-finite weight, a KV cache with one non-finite element.  No policy can
# rank, quantize or attend over them, so every tool stops with exit 65 and
# names the layer and tensor (issue 14), instead of crashing (the sparse
# policy's selection looped on NaN), printing <unk> or writing NaN.
load helper
bats_require_minimum_version 1.5.0

setup_file() {
    M="$DATA/stories260K/stories260K.bin"
    kv-run --model "$M" --prompt "Once upon a time there was a little girl" -n 0 \
        --dump-kv "$BATS_FILE_TMPDIR/a.kvc" 2>/dev/null
}

setup() {
    M="$DATA/stories260K/stories260K.bin"
    TOK="$DATA/stories260K/tok512.bin"
    KVPY="$ROOT/tests/interop/kvc_py.py"
    A="$BATS_FILE_TMPDIR/a.kvc"
}

# poison_model OFFSET FLOAT: a copy of stories260K with one float replaced
poison_model() {
    cp "$M" "$BATS_TEST_TMPDIR/m.bin"
    "$PY" -c 'import struct,sys; f=open(sys.argv[1],"r+b"); f.seek(int(sys.argv[2])); f.write(struct.pack("<f", float(sys.argv[3])))' \
        "$BATS_TEST_TMPDIR/m.bin" "$1" "$2"
}

# stories260K (legacy llama2.c): 28-byte header, tok_embd 512x64, then per
# family all 5 layers: attn_norm 64, wq 64x64, wk 32x64, wv 32x64, wo 64x64,
# ffn_norm 64, w_gate 172x64, w_down 64x172, w_up 172x64.
ATTN_NORM0=131100                       # 28 + 4*512*64
W_DOWN3=$((28 + 4 * (512*64 + 5*64 + 5*4096 + 2*5*2048 + 5*4096 + 5*64 + 5*11008 + 3*11008 + 100)))

@test "kv-run refuses a NaN weight under the sparse policy with exit 65 naming the tensor" {
    poison_model $ATTN_NORM0 nan
    for pol in sparse:k=2,sink=1,window=1 sparse:k=2,sink=1,window=1,select=exact full quant:bits=2 dsq streaming; do
        run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/m.bin" --tokenizer "$TOK" -p "Once upon a time" -n 4 --policy "$pol"
        assert_fails_with 65 "layer 0 attn_norm element 0 is not finite"
        [ -z "$output" ]
    done
}

@test "kv-run refuses a NaN weight when sampling and when scoring" {
    poison_model $ATTN_NORM0 nan
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/m.bin" --tokenizer "$TOK" -p "Once upon a time" -n 4 --temp 1
    assert_fails_with 65 "NaN or infinite"
    echo "Once upon a time there was" >"$BATS_TEST_TMPDIR/t.txt"
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/m.bin" --tokenizer "$TOK" --score-file "$BATS_TEST_TMPDIR/t.txt"
    assert_fails_with 65 "layer 0 attn_norm"
}

@test "kv-run names an infinite weight deep in the model (layer 3 w_down)" {
    poison_model $W_DOWN3 inf
    run --separate-stderr kv-run -m "$BATS_TEST_TMPDIR/m.bin" --tokenizer "$TOK" -p "Once upon a time" -n 4
    assert_fails_with 65 "layer 3 w_down row 0, column 100 is not finite"
}

@test "kv-profile refuses a cache with a NaN key with exit 65 naming the element" {
    "$PY" "$KVPY" poison "$A" "$BATS_TEST_TMPDIR/p.kvc" layers.1.k 9 nan
    run --separate-stderr kv-profile "$BATS_TEST_TMPDIR/p.kvc"
    assert_fails_with 65 "layers.1.k[0, 1, 1] is NaN: profiling needs finite values"
}

@test "kv-quant refuses a cache with an infinite value with exit 65 and writes nothing" {
    "$PY" "$KVPY" poison "$A" "$BATS_TEST_TMPDIR/p.kvc" layers.0.v 3 inf
    run --separate-stderr kv-quant "$BATS_TEST_TMPDIR/p.kvc" -o "$BATS_TEST_TMPDIR/q.kvc"
    assert_fails_with 65 "layers.0.v[0, 0, 3] is infinite: quantization needs finite values"
    [ ! -e "$BATS_TEST_TMPDIR/q.kvc" ]
}

@test "kv-tree put refuses a cache with a NaN key and leaves the store consistent" {
    S="$BATS_TEST_TMPDIR/store"
    kv-tree init "$S"
    "$PY" "$KVPY" poison "$A" "$BATS_TEST_TMPDIR/p.kvc" layers.2.k 0 nan
    run --separate-stderr kv-tree put "$S" "$BATS_TEST_TMPDIR/p.kvc"
    assert_fails_with 65 "layers.2.k[0, 0, 0] is NaN"
    run --separate-stderr kv-tree check "$S"
    assert_success
    [ "$(json_get 'j["ok"], j["nodes"]')" = "(True, 0)" ]
    run --separate-stderr kv-tree put "$S" "$A"
    assert_success
}

@test "kv-tree refuses a chunk whose importance was made NaN, checksum and size intact, with exit 65" {
    S="$BATS_TEST_TMPDIR/store"
    kv-tree init "$S"
    kv-tree put "$S" "$A" >/dev/null
    f=$(kv-tree ls "$S" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["list"][0]["file"])')
    # a chunk of version 2 (kvc(5), KV-TREE CHUNKS): importance[3] in its
    # table made NaN, the head's CRC-32C recomputed, the size unchanged
    "$PY" - "$S/$f" "$BATS_TEST_TMPDIR/p.kvc" <<'EOF'
import struct, sys
b = bytearray(open(sys.argv[1], 'rb').read())
n, nf = struct.unpack_from('<I', b, 16)[0], struct.unpack_from('<I', b, 28)[0]
struct.pack_into('<f', b, 72 + 4 * n + 4 * 3, float('nan'))
def crc32c(data, crc=0xFFFFFFFF):
    for x in data:
        crc ^= x
        for _ in range(8): crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc
tables = bytes(b[16:72 + 12 * n + 24 * nf])
struct.pack_into('<I', b, 12, crc32c(tables) ^ 0xFFFFFFFF)
open(sys.argv[2], 'wb').write(b)
EOF
    [ "$(stat -c %s "$BATS_TEST_TMPDIR/p.kvc")" = "$(stat -c %s "$S/$f")" ]
    cp "$BATS_TEST_TMPDIR/p.kvc" "$S/$f"
    run --separate-stderr kv-tree get "$S" --kvc "$A" --important 0.5 -o "$BATS_TEST_TMPDIR/g.kvc"
    assert_fails_with 65 "importance 3 is NaN"
    [ ! -e "$BATS_TEST_TMPDIR/g.kvc" ]
    run --separate-stderr kv-tree check "$S"
    assert_fails_with 65 "importance 3 is NaN"
}
