#!/usr/bin/env bats
# kv-bench prefix: requests sharing prefixes served from GPU/host/disk tiers.

load helper

NIAH="$DATA/niah4k/niah4k.bin"

setup() { T="$BATS_TEST_TMPDIR"; }

@test "kv-bench prefix --help lists every option" {
    run --separate-stderr kv-bench prefix --help
    assert_success
    for o in --model --synthetic --widen --store --gpu-bytes --host-bytes --modes --important --put-tier --zstd --insert --put-queries --queries --qa-heads --qa-follow --sketch-serial --rows-serial --no-warm --half-life --steps --ctx --device --output --json; do
        [[ "$output" == *"$o"* ]] || { echo "missing $o"; return 1; }
    done
}

@test "tools/prefix-requests.py writes niah questions that share about 90% of their prompt" {
    run "$PY" "$ROOT/tools/prefix-requests.py" niah --tasks "$DATA/niah4k/tasks-dev.jsonl" --length 1000 -n 4
    assert_success
    printf '%s\n' "$output" > "$T/r.jsonl"
    "$PY" - "$T/r.jsonl" <<'PY'
import json, os, sys
r = [json.loads(l) for l in open(sys.argv[1])]
assert len(r) == 4 and all(len(x["outputs"]) == 1 and x["outputs"][0] in x["input"] for x in r)
shared = len(os.path.commonprefix([x["input"] for x in r]))
assert all(0.8 < shared / len(x["input"]) < 0.97 for x in r), shared
PY
}

@test "kv-bench prefix reuses the shared prefix from every tier and reports TTFT and accuracy" {
    "$PY" "$ROOT/tools/prefix-requests.py" niah --tasks "$DATA/niah4k/tasks-dev.jsonl" --length 400 -n 3 > "$T/r.jsonl"
    run --separate-stderr kv-bench prefix -m "$NIAH" -n 8 --gpu-bytes 2M --host-bytes 8M --store "$T/st" "$T/r.jsonl"
    assert_success
    # the first request has nothing to reuse: only its full prefill runs
    [ "$(json_get 'len(j["requests"]), sorted(j["summary"])')" = "(13, ['disk', 'disk-important', 'disk-query', 'full', 'gpu', 'host'])" ]
    [ "$(json_get '[r["mode"] for r in j["requests"] if r["request"] == 0]')" = "['full']" ]
    # after the first request every reuse mode takes a prefix from the tier it names
    [ "$(json_get 'sorted({(r["mode"], r["tier"]) for r in j["requests"] if r["request"] > 0})')" = \
      "[('disk', 'disk'), ('disk-important', 'disk'), ('disk-query', 'disk'), ('full', 'none'), ('gpu', 'gpu'), ('host', 'host')]" ]
    [ "$(json_get 'all(0 <= r["load_ms"] <= r["ttft_ms"] for r in j["requests"])')" = True ]
    [ "$(json_get 'all(r["reused_tokens"] > 0.6 * r["tokens"] for r in j["requests"] if r["request"] > 0 and r["mode"] in ("gpu", "host", "disk"))')" = True ]
    [ "$(json_get 'all(r["prefilled_tokens"] + (r["tokens"] - r["prefilled_tokens"]) == r["tokens"] and r["ttft_ms"] > 0 for r in j["requests"])')" = True ]
    [ "$(json_get 'all(r["hit_bytes"]["gpu"] > 0 for r in j["requests"] if r["tier"] == "gpu")')" = True ]
    [ "$(json_get 'all(r["hit_bytes"]["disk"] > 0 for r in j["requests"] if r["tier"] == "disk")')" = True ]
    # disk-important and disk-query load a quarter of the disk tokens, in whole frames of 32
    # (the shared node is on disk), and read less than disk does (at ~320 cached tokens
    # disk-query also reads the sink's frame and a key sketch of half the channels: ~0.62)
    [ "$(json_get 'all(r["reused_tokens"] < 0.4 * r["tokens"] for r in j["requests"] if r["mode"] in ("disk-important", "disk-query") and r["request"] > 0)')" = True ]
    [ "$(json_get 'all(a["hit_bytes"]["disk"] < 0.75 * b["hit_bytes"]["disk"] for a in j["requests"] for b in j["requests"] if a["request"] == b["request"] > 0 and a["mode"] == "disk-query" and b["mode"] == "disk")')" = True ]
    # reuse of the exact cached rows answers as the full prefill does
    [ "$(json_get 'all(a["text"] == b["text"] for a in j["requests"] for b in j["requests"] if a["request"] == b["request"] and a["mode"] == "full" and b["mode"] in ("gpu", "host", "disk"))')" = True ]
    run kv-tree check "$T/st"
    assert_success
}

@test "kv-bench prefix reports null TTFT medians, not 0, for modes that served no request" {
    "$PY" "$ROOT/tools/prefix-requests.py" niah --tasks "$DATA/niah4k/tasks-dev.jsonl" --length 300 -n 1 > "$T/r.jsonl"
    run --separate-stderr kv-bench prefix -m "$NIAH" -n 2 --modes full,gpu,disk --store "$T/st" "$T/r.jsonl"
    assert_success
    # one request: the first, with nothing cached; no mode has a request after it
    [ "$(json_get '[r["mode"] for r in j["requests"]]')" = "['full']" ]
    [ "$(json_get 'sorted((k, v["requests"], v["ttft_ms_median"], v["load_ms_median"], v["speedup_vs_full"], v["hit_bytes_mean"]) for k, v in j["summary"].items())')" = \
      "[('disk', 0, None, None, None, None), ('full', 0, None, None, None, None), ('gpu', 0, None, None, None, None)]" ]
}

@test "kv-bench prefix's table on a terminal shows - for the TTFT of a mode that served no request" {
    command -v script >/dev/null || skip "no script(1) to give kv-bench a terminal"
    "$PY" "$ROOT/tools/prefix-requests.py" niah --tasks "$DATA/niah4k/tasks-dev.jsonl" --length 300 -n 1 > "$T/r.jsonl"
    run script -qec "$(command -v kv-bench) prefix -m $NIAH -n 2 --modes full,gpu --store $T/st $T/r.jsonl 2>/dev/null" /dev/null
    assert_success
    [[ "$output" =~ gpu\ +0\ +-\ +- ]] || { echo "$output"; return 1; }
    [[ "$output" =~ full\ +0\ +-\ +- ]] || { echo "$output"; return 1; }
}

@test "kv-bench prefix --insert 1 puts only the first prompt, uncompressed with --zstd 0" {
    "$PY" "$ROOT/tools/prefix-requests.py" niah --tasks "$DATA/niah4k/tasks-dev.jsonl" --length 300 -n 3 > "$T/r.jsonl"
    run --separate-stderr kv-bench prefix -m "$NIAH" -n 2 --insert 1 --zstd 0 --put-queries 0 --modes full,disk,disk-query \
        --store "$T/st" "$T/r.jsonl"
    assert_success
    [ "$(json_get 'sorted((r["request"], r["mode"]) for r in j["requests"])')" = \
      "[(0, 'full'), (1, 'disk'), (1, 'disk-query'), (1, 'full'), (2, 'disk'), (2, 'disk-query'), (2, 'full')]" ]
    run --separate-stderr kv-tree ls --json "$T/st"
    assert_success
    [ "$(json_get '[(n["encoding"], n["chunk"], n["importance"]["source"]) for n in j["list"]]')" = "[('raw+sketch', 3, 'key-norm')]" ]
    run kv-tree check "$T/st"
    assert_success
}

@test "kv-bench prefix --sketch-channels N: the store's index keeps N and its chunks' sketch has N channels a head" {
    "$PY" "$ROOT/tools/prefix-requests.py" niah --tasks "$DATA/niah4k/tasks-dev.jsonl" --length 300 -n 2 > "$T/r.jsonl"
    kv-bench prefix -m "$NIAH" -n 2 --insert 1 --zstd 0 --put-queries 0 --modes full,disk-query --store "$T/d" "$T/r.jsonl" >/dev/null 2>&1
    run --separate-stderr kv-bench prefix -m "$NIAH" -n 2 --insert 1 --zstd 0 --put-queries 0 --modes full,disk-query \
        --sketch-channels 8 --store "$T/s8" "$T/r.jsonl"
    assert_success
    [ "$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["sketch_channels"])' "$T/s8/index.json")" = 8 ]
    [ "$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("sketch_channels"))' "$T/d/index.json")" = None ]
    run kv-tree check "$T/s8"
    assert_success
    # niah4k: 6 layers x 2 KV heads, head_dim 64 (default 32 channels); a channel costs L * Hkv * (6 + tokens) bytes
    b() { kv-tree ls "$1" | "$PY" -c 'import json,sys; n = json.load(sys.stdin)["list"][0]; print(n["tokens"], n["bytes"])'; }
    read -r n32 b32 <<< "$(b "$T/d")"
    read -r n8 b8 <<< "$(b "$T/s8")"
    [ "$n32" = "$n8" ] && [ $((b32 - b8)) -eq $((12 * 24 * (6 + n8))) ] || { echo "$n32 $b32 $n8 $b8"; return 1; }
}

@test "kv-bench prefix reads disk rows layer by layer beside the prefill, with the same answers as --rows-serial" {
    "$PY" "$ROOT/tools/prefix-requests.py" niah --tasks "$DATA/niah4k/tasks-dev.jsonl" --length 400 -n 3 > "$T/r.jsonl"
    for z in 0 3; do
        for how in beside serial; do
            flag=""
            [ "$how" = serial ] && flag=--rows-serial
            run --separate-stderr kv-bench prefix -m "$NIAH" -n 4 --insert 1 --zstd $z --modes full,disk,disk-important,disk-query \
                --store "$T/st-$z-$how" $flag "$T/r.jsonl"
            assert_success
            printf '%s\n' "$output" > "$T/$z-$how.json"
        done
        "$PY" - "$T/$z-beside.json" "$T/$z-serial.json" "$z" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
disk = lambda j: [r for r in j["requests"] if r["tier"] == "disk"]
assert len(disk(a)) == 6 and len(disk(b)) == 6, (len(disk(a)), len(disk(b)))
# the same rows: the same generated text, reuse and bytes
key = lambda r: (r["request"], r["mode"], r["text"], r["reused_tokens"], r["correct"])
assert [key(r) for r in disk(a)] == [key(r) for r in disk(b)]
assert all(r["rows_beside"] and r["rows_beside_ms"]["read"] > 0 and r["rows_beside_ms"]["wait"] >= 0 for r in disk(a))
assert all(r["rows_beside"] is False and "rows_beside_ms" not in r for r in disk(b))
# layered reads take the tensors and each frame's header: never fewer bytes than the frames
# hold, and at most a header read more per frame (uncompressed); zstd frames are read whole
for x, y in zip(disk(a), disk(b)):
    hb, hs = x["hit_bytes"]["disk"], y["hit_bytes"]["disk"]
    assert (hb >= hs and hb <= hs * 1.2) if sys.argv[3] == "0" else hb == hs, (x["mode"], hb, hs)
assert a["options"]["rows_serial"] is False and b["options"]["rows_serial"] is True
assert a["options"]["qa_heads"] == "max" and a["options"]["qa_follow"] == 8 and a["options"]["queries"] == 4
# the CPU engine has nothing to warm: no time is claimed for it
assert a["options"]["warmed"] is False and a["options"]["warm_ms"] == 0, a["options"]
PY
    done
}

@test "kv-bench prefix --no-warm runs the same requests and reports no warm-up" {
    "$PY" "$ROOT/tools/prefix-requests.py" niah --tasks "$DATA/niah4k/tasks-dev.jsonl" --length 300 -n 2 > "$T/r.jsonl"
    run --separate-stderr kv-bench prefix --json -m "$NIAH" -n 4 --modes full,host --no-warm --store "$T/a" "$T/r.jsonl"
    assert_success
    printf '%s\n' "$output" > "$T/nowarm.json"
    run --separate-stderr kv-bench prefix --json -m "$NIAH" -n 4 --modes full,host --store "$T/b" "$T/r.jsonl"
    assert_success
    printf '%s\n' "$output" > "$T/warm.json"
    "$PY" - "$T/nowarm.json" "$T/warm.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
assert a["options"]["warmed"] is False and a["options"]["warm_ms"] == 0, a["options"]
key = lambda j: [(r["request"], r["mode"], r["text"], r["reused_tokens"]) for r in j["requests"]]
assert key(a) == key(b) and len(key(a)) == 3, (key(a), key(b))
PY
}

@test "kv-bench prefix --sketch-serial reads disk-query's sketch before the probe, not on a thread beside it" {
    "$PY" "$ROOT/tools/prefix-requests.py" niah --tasks "$DATA/niah4k/tasks-dev.jsonl" --length 300 -n 2 > "$T/r.jsonl"
    q='[r["query_aware_ms"] for r in j["requests"] if r["mode"] == "disk-query"]'
    run --separate-stderr kv-bench prefix -m "$NIAH" -n 2 --insert 1 --zstd 0 --put-queries 0 --modes full,disk-query "$T/r.jsonl"
    assert_success
    # a thread was started, and the read took time
    [ "$(json_get 'all(x["sketch_spawn"] > 0 and x["sketch"] > 0 for x in '"$q"') and len('"$q"') == 1')" = True ]
    run --separate-stderr kv-bench prefix -m "$NIAH" -n 2 --insert 1 --zstd 0 --put-queries 0 --modes full,disk-query \
        --sketch-serial "$T/r.jsonl"
    assert_success
    # none started and none waited for; the read still took time
    [ "$(json_get 'all(x["sketch_spawn"] == 0 and x["sketch_wait"] == 0 and x["sketch"] > 0 for x in '"$q"') and len('"$q"') == 1')" = True ]
}

@test "kv-bench prefix refuses a bad request line with exit 65 naming it" {
    printf '{"input": "a"}\n{"tokens": "x"}\n' > "$T/bad.jsonl"
    run --separate-stderr kv-bench prefix -m "$NIAH" "$T/bad.jsonl"
    assert_fails_with 65 "line 2"
    run --separate-stderr kv-bench prefix -m "$NIAH" --modes full,warp "$T/bad.jsonl"
    assert_fails_with 64 "unknown mode 'warp'"
}

@test "kv-bench prefix rejects a bad --important, --put-tier, --insert, --zstd, --sketch-channels, --qa-heads, --qa-follow or a missing model with exit 64" {
    printf '{"input": "a"}\n' > "$T/one.jsonl"
    run --separate-stderr kv-bench prefix -m "$NIAH" --important 0 "$T/one.jsonl"
    assert_fails_with 64 "--important must be in (0, 1]"
    run --separate-stderr kv-bench prefix -m "$NIAH" --put-tier tape "$T/one.jsonl"
    assert_fails_with 64 "--put-tier must be gpu, host or disk"
    run --separate-stderr kv-bench prefix -m "$NIAH" --insert 0 "$T/one.jsonl"
    assert_fails_with 64 "--insert"
    run --separate-stderr kv-bench prefix -m "$NIAH" --zstd 20 "$T/one.jsonl"
    assert_fails_with 64 "--zstd"
    run --separate-stderr kv-bench prefix -m "$NIAH" --sketch-channels 0 "$T/one.jsonl"
    assert_fails_with 64 "--sketch-channels"
    run --separate-stderr kv-bench prefix -m "$NIAH" --qa-heads mean "$T/one.jsonl"
    assert_fails_with 64 "--qa-heads must be max or sum"
    run --separate-stderr kv-bench prefix -m "$NIAH" --qa-follow 4097 "$T/one.jsonl"
    assert_fails_with 64 "--qa-follow"
    run --separate-stderr kv-bench prefix -m "$NIAH" --qa-follow -1 "$T/one.jsonl"
    assert_fails_with 64 "--qa-follow"
    run --separate-stderr kv-bench prefix -m "$NIAH" --sketch-channels 4097 "$T/one.jsonl"
    assert_fails_with 64 "--sketch-channels"
    run --separate-stderr kv-bench prefix "$T/one.jsonl"
    assert_fails_with 64 "give exactly one of --model FILE and --synthetic NAME"
    [ -z "$output" ]
}

# bats test_tags=slow
@test "kv-bench prefix --widen runs stories260K in llama-3.2-1b's shape with the small model's output" {
    "$PY" "$ROOT/tools/prefix-requests.py" synthetic --vocab 512 --length 48 --shared 0.9 -n 2 > "$T/w.jsonl"
    S260="$DATA/stories260K/stories260K.bin"
    run --separate-stderr kv-bench prefix --json -m "$S260" --modes full,host -n 2 -o "$T/small.json" "$T/w.jsonl"
    assert_success
    run --separate-stderr kv-bench prefix --json -m "$S260" --widen llama-3.2-1b --modes full,host -n 2 -o "$T/wide.json" "$T/w.jsonl"
    assert_success
    "$PY" - "$T/small.json" "$T/wide.json" <<'PY'
import json, sys
a, b = (json.load(open(f))["requests"] for f in sys.argv[1:])
key = lambda r: (r["request"], r["mode"])
assert sorted(map(key, a)) == sorted(map(key, b)) == [(0, "full"), (1, "full"), (1, "host")], (a, b)
sa, sb = ({key(r): r for r in x} for x in (a, b))
# the same greedy text from every mode, and the host tier reuses the same rows
assert all(sa[k]["text"] == sb[k]["text"] and sa[k]["reused_tokens"] == sb[k]["reused_tokens"] for k in sa), (a, b)
# the K/V bytes are the large shape's: 16 layers x 8 KV heads x 64 x 2 x 2 bytes a row (small: 5 x 4 x 8 x 4)
hs, hb = (sum(x[(1, "host")]["hit_bytes"].values()) for x in (sa, sb))
rows = sa[(1, "host")]["reused_tokens"]
assert hs == rows * 5 * 4 * 8 * 2 * 2 and hb == rows * 16 * 8 * 64 * 2 * 2, (hs, hb, rows)
PY
}

@test "kv-bench prefix --widen refuses a shape the model does not fit, or no --model, with exit 64" {
    printf '{"tokens": [1, 2, 3]}\n' > "$T/one.jsonl"
    run --separate-stderr kv-bench prefix -m "$DATA/stories260K/stories260K.bin" --widen tiny "$T/one.jsonl"
    assert_fails_with 64 "--widen tiny: cannot widen stories260K into tiny: its layer count 5 exceeds 4"
    run --separate-stderr kv-bench prefix -m "$NIAH" --widen llama-3.1-9b "$T/one.jsonl"
    assert_fails_with 64 "unknown model shape 'llama-3.1-9b'"
    run --separate-stderr kv-bench prefix --synthetic tiny --widen llama-3.1-8b "$T/one.jsonl"
    assert_fails_with 64 "--widen needs --model"
    [ -z "$output" ]
}

@test "kv-bench prefix exits 66 naming a request file that does not exist" {
    run --separate-stderr kv-bench prefix -m "$NIAH" "$T/none.jsonl"
    assert_fails_with 66 "none.jsonl"
    [ -z "$output" ]
}

@test "kv-bench prefix --device cuda without a usable GPU exits 69 and removes its temporary store" {
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        skip "a GPU is present: the benchmark would run"
    fi
    printf '{"input": "a"}\n' > "$T/one.jsonl"
    mkdir "$T/tmp"
    TMPDIR="$T/tmp" run --separate-stderr kv-bench prefix -m "$NIAH" --device cuda "$T/one.jsonl"
    assert_fails_with 69 "--device cuda"
    [ -z "$output" ]
    [ -z "$(ls -A "$T/tmp")" ]
}
