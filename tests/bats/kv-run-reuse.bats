#!/usr/bin/env bats
# kv-run --kv (continue from a .kvc) and --store (reuse a kv-tree store's
# longest cached prefix, then insert the prompt).

load helper

M260="$DATA/stories260K/stories260K.bin"
NIAH="$DATA/niah4k/niah4k.bin"

setup() {
    T="$BATS_TEST_TMPDIR"
    P="Once upon a time there was a little girl named Lily. She liked to play in the park with her dog. One day"
}

# ids FILE.kvc: the tokens tensor as whitespace-separated ids
ids() { "$PY" - "$1" <<'PYEOF'
import json, struct, sys
b = open(sys.argv[1], 'rb').read(); n = struct.unpack('<Q', b[:8])[0]; h = json.loads(b[8:8 + n])
t = h['tokens']; s, e = t['data_offsets']
print(' '.join(str(x) for x in struct.unpack('<%di' % ((e - s) // 4), b[8 + n + s:8 + n + e])))
PYEOF
}

# split the whole prompt's ids into the first N and the rest
split_ids() { # kvc N
    local all; all=$(ids "$1")
    echo "$all" | tr ' ' '\n' | head -n "$2" | tr '\n' ' ' > "$T/first.txt"
    echo "$all" | tr ' ' '\n' | tail -n +"$(($2 + 1))" | tr '\n' ' ' > "$T/rest.txt"
}

gen_ids() { "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["generated_ids"])' "$1"; }

@test "kv-run --kv continues a dumped prefix to exactly the whole prompt's greedy tokens on stories260K" {
    kv-run -m "$M260" -p "$P" -n 0 --dump-kv "$T/all.kvc"
    kv-run -m "$M260" -p "$P" -n 24 --report "$T/whole.json" >/dev/null
    split_ids "$T/all.kvc" 20
    kv-run -m "$M260" --tokens "$T/first.txt" -n 0 --dump-kv "$T/first.kvc"
    run --separate-stderr kv-run -m "$M260" --kv "$T/first.kvc" --tokens "$T/rest.txt" -n 24 --report -
    assert_success
    [ "$(json_get 'j["generated_ids"]')" = "$(gen_ids "$T/whole.json")" ]
    [ "$(json_get 'j["reused_tokens"], j["prefilled_tokens"], j["reuse"]["source"]')" = "(20, $(( $(wc -w < "$T/rest.txt") )), 'kv')" ]
    [ "$(json_get 'j["ttft_ms"] > 0 and j["bytes_read"]["disk"] > 0')" = True ]
}

@test "kv-run --kv continues a niah4k needle prompt to exactly the whole prompt's answer" {
    "$PY" -c 'import json; t=json.loads(open("'"$DATA"'/niah4k/tasks-dev.jsonl").readline()); open("'"$T"'/p.txt","w").write(t["input"])'
    kv-run -m "$NIAH" --prompt-file "$T/p.txt" -n 0 --dump-kv "$T/all.kvc"
    kv-run -m "$NIAH" --prompt-file "$T/p.txt" -n 8 --report "$T/whole.json" >/dev/null
    n=$(ids "$T/all.kvc" | wc -w)
    split_ids "$T/all.kvc" $((n * 9 / 10))
    kv-run -m "$NIAH" --tokens "$T/first.txt" -n 0 --dump-kv "$T/first.kvc" --zstd 3
    run --separate-stderr kv-run -m "$NIAH" --kv "$T/first.kvc" --tokens "$T/rest.txt" -n 8 --report -
    assert_success
    [ "$(json_get 'j["generated_ids"]')" = "$(gen_ids "$T/whole.json")" ]
}

@test "kv-run --kv runs KIVI- and DSQ-packed caches from the packed data with sane fidelity" {
    "$PY" -c 'import json; t=json.loads(open("'"$DATA"'/niah4k/tasks-dev.jsonl").readline()); open("'"$T"'/p.txt","w").write(t["input"])'
    kv-run -m "$NIAH" --prompt-file "$T/p.txt" -n 0 --dump-kv "$T/all.kvc" --kv-dtype f16
    kv-run -m "$NIAH" --prompt-file "$T/p.txt" -n 8 --report "$T/whole.json" >/dev/null
    n=$(ids "$T/all.kvc" | wc -w)
    split_ids "$T/all.kvc" $((n - 40))
    kv-run -m "$NIAH" --tokens "$T/first.txt" -n 0 --dump-kv "$T/first.kvc" --kv-dtype f16
    kv-quant --bits 4 --group 32 --residual 32 "$T/first.kvc" -o "$T/kivi.kvc"
    kv-quant --method dsq -b 4 "$T/first.kvc" -o "$T/dsq.kvc"
    # the dsq policy's default layout: keys at 4 bits, values at 2
    "$PY" -c 'import json; print(json.dumps({"version": 3, "n_layers": 6, "layers": [{"layer": i, "policy": "dsq"} for i in range(6)]}))' > "$T/dsq42.json"
    kv-quant --profile "$T/dsq42.json" "$T/first.kvc" -o "$T/dsq42.kvc"
    for enc in kivi dsq dsq42; do
        run --separate-stderr kv-run -m "$NIAH" --kv "$T/$enc.kvc" --tokens "$T/rest.txt" -n 8 --report -
        assert_success
        want=$([ $enc = kivi ] && echo quant || echo dsq)
        [ "$(json_get 'sorted(set(l["policy"] for l in j["layers"]))')" = "['$want']" ]
        [ $enc != dsq42 ] || [ "$(json_get 'all("kbits=4 vbits=2" in l["params"] for l in j["layers"])')" = True ]
        # at least 6 of the 8 answer tokens agree with the whole f32 prompt's
        same=$(json_get 'sum(a == b for a, b in zip(j["generated_ids"], '"$(gen_ids "$T/whole.json")"'))')
        [ "$same" -ge 6 ] || { echo "$enc: $same of 8 tokens agree"; return 1; }
    done
}

@test "kv-run --device cuda --kv of a packed cache without a usable GPU exits 69, and auto runs the file's encoding on the CPU" {
    if kv-run --version | grep -q '^GPU: NVIDIA'; then
        skip "a GPU is present: test_gpu_kv continues packed caches on it"
    fi
    "$PY" -c 'import json; t=json.loads(open("'"$DATA"'/niah4k/tasks-dev.jsonl").readline()); open("'"$T"'/p.txt","w").write(t["input"])'
    kv-run -m "$NIAH" --prompt-file "$T/p.txt" -n 0 --dump-kv "$T/all.kvc" --kv-dtype f16
    n=$(ids "$T/all.kvc" | wc -w)
    split_ids "$T/all.kvc" $((n - 40))
    kv-run -m "$NIAH" --tokens "$T/first.txt" -n 0 --dump-kv "$T/first.kvc" --kv-dtype f16
    kv-quant --bits 2 --group 32 --residual 64 "$T/first.kvc" -o "$T/kivi.kvc"
    run --separate-stderr kv-run -m "$NIAH" --kv "$T/kivi.kvc" --tokens "$T/rest.txt" -n 4 --device cuda
    assert_fails_with 69 "--device cuda"
    [ -z "$output" ]
    # a policy asking for another layout: the file's encoding is what runs
    run --separate-stderr kv-run -m "$NIAH" --kv "$T/kivi.kvc" --tokens "$T/rest.txt" -n 4 --device auto \
        --policy quant:bits=1 --report -
    assert_success
    [ "$(json_get 'sorted(set((l["policy"], "bits=2" in l["params"]) for l in j["layers"]))')" = "[('quant', True)]" ]
}

@test "kv-run --kv refuses a cache from another model with exit 65 and the reason" {
    kv-run -m "$M260" -p "$P" -n 0 --dump-kv "$T/s.kvc"
    echo "1 40 50" > "$T/t.txt"
    run --separate-stderr kv-run -m "$NIAH" --kv "$T/s.kvc" --tokens "$T/t.txt" -n 2
    assert_fails_with 65 "the cache has 5 layers, the model 6"
    [ "$(printf '%s\n' "$stderr" | wc -l)" -eq 1 ]
}

@test "kv-run --kv without a continuation and --important without --store are usage errors" {
    kv-run -m "$M260" -p "$P" -n 0 --dump-kv "$T/s.kvc"
    run --separate-stderr kv-run -m "$M260" --kv "$T/s.kvc" -n 2
    assert_fails_with 64 "--kv needs the continuation"
    run --separate-stderr kv-run -m "$M260" -p x --important 0.5
    assert_fails_with 64 "--important goes with --store"
    run --separate-stderr kv-run -m "$M260" -p x --store "$T" --kv "$T/s.kvc"
    assert_fails_with 64 "exclusive"
}

@test "kv-run --kv continues a kv-tree get --important subset at the original positions" {
    kv-tree init "$T/st"
    kv-run -m "$M260" -p "$P she found a red ball" -n 0 --dump-kv "$T/a.kvc"
    kv-tree put "$T/st" "$T/a.kvc" >/dev/null
    split_ids "$T/a.kvc" 30
    kv-tree get "$T/st" --tokens "$T/first.txt" --important 0.5 -o "$T/sub.kvc" 2>/dev/null
    run --separate-stderr kv-run -m "$M260" --kv "$T/sub.kvc" --tokens "$T/rest.txt" -n 4 --report -
    assert_success
    [ "$(json_get 'j["reuse"]["matched"], j["reused_tokens"] < 30')" = "(30, True)" ]
}

@test "kv-run --dump-kv after --kv of a subset is refused with exit 64 before the model is loaded" {
    kv-tree init "$T/st"
    kv-run -m "$M260" -p "$P she found a red ball" -n 0 --dump-kv "$T/a.kvc"
    kv-tree put "$T/st" "$T/a.kvc" >/dev/null
    split_ids "$T/a.kvc" 30
    kv-tree get "$T/st" --tokens "$T/first.txt" --important 0.5 -o "$T/sub.kvc" 2>/dev/null
    # a model that does not exist: loading it would be exit 66, so 64 shows the check came first
    run --separate-stderr kv-run -m "$T/no-such-model.bin" --kv "$T/sub.kvc" --tokens "$T/rest.txt" -n 1 --dump-kv "$T/out.kvc"
    assert_fails_with 64 "--dump-kv after --kv needs a cache of a whole prefix with its tokens (this one has a subset of them)"
    [ "${#stderr_lines[@]}" -eq 1 ]
    [ ! -e "$T/out.kvc" ]
    # a whole prefix is accepted: the dump holds the cached tokens and the prompt's
    split_ids "$T/a.kvc" 30
    kv-tree get "$T/st" --tokens "$T/first.txt" -o "$T/whole.kvc" 2>/dev/null
    run --separate-stderr kv-run -m "$M260" --kv "$T/whole.kvc" --tokens "$T/rest.txt" -n 1 --dump-kv "$T/out.kvc"
    assert_success
    [ "$(ids "$T/out.kvc")" = "$(ids "$T/a.kvc")" ]
}

@test "kv-run --store reuses the shared prefix, prefills only the rest and inserts the new suffix" {
    kv-tree init "$T/st"
    run --separate-stderr kv-run -m "$M260" -p "$P she found a ball" -n 6 --store "$T/st" --report -
    assert_success
    [ "$(json_get 'j["reused_tokens"], j["reuse"]["put"]["added_tokens"] == j["prompt_tokens"]')" = "(0, True)" ]
    kv-run -m "$M260" -p "$P she saw a bird" -n 6 --report "$T/whole.json" >/dev/null
    run --separate-stderr kv-run -m "$M260" -p "$P she saw a bird" -n 6 --store "$T/st" --report -
    assert_success
    [ "$(json_get 'j["reused_tokens"] > 20 and j["prefilled_tokens"] == j["prompt_tokens"] - j["reused_tokens"]')" = True ]
    [ "$(json_get 'j["bytes_read"]["disk"] > 0 and j["reuse"]["put"]["matched"] == j["reused_tokens"]')" = True ]
    [ "$(json_get 'j["generated_ids"]')" = "$(gen_ids "$T/whole.json")" ]
    run kv-tree check "$T/st"
    assert_success
    # --no-insert: the store is only read
    before=$(kv-tree ls "$T/st" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["nodes"])')
    run --separate-stderr kv-run -m "$M260" -p "$P she ate a cake" -n 2 --store "$T/st" --no-insert --important 0.5 --report -
    assert_success
    [ "$(json_get 'j["reuse"]["put"]')" = None ]
    [ "$(kv-tree ls "$T/st" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["nodes"])')" = "$before" ]
}

@test "kv-run --store --important --query-aware answers a niah4k needle from a quarter of the haystack" {
    "$PY" "$ROOT/tools/prefix-requests.py" niah --tasks "$DATA/niah4k/tasks-dev.jsonl" --length 700 -n 2 --needles 2 > "$T/r.jsonl"
    "$PY" - "$T/r.jsonl" "$T" <<'PYEOF'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
for i, x in enumerate(r):
    open("%s/p%d.txt" % (sys.argv[2], i), "w").write(x["input"])
    open("%s/a%d.txt" % (sys.argv[2], i), "w").write(x["outputs"][0])
PYEOF
    kv-tree init --encodings disk=raw+zstd+sketch "$T/st"
    kv-run -m "$NIAH" --prompt-file "$T/p0.txt" -n 1 --store "$T/st" >/dev/null 2>&1
    run --separate-stderr kv-run -m "$NIAH" --prompt-file "$T/p1.txt" -n 8 --store "$T/st" --important 0.25 --query-aware --report -
    assert_success
    [ "$(json_get 'j["reuse"]["matched"] > 400 and j["reused_tokens"] < 0.4 * j["reuse"]["matched"]')" = True ]
    [ "$(json_get '"'"$(cat "$T/a1.txt")"'" in j["text"]')" = True ]
    run kv-tree check "$T/st"
    assert_success
    # a store without a key sketch cannot serve it
    kv-tree init "$T/plain"
    kv-run -m "$NIAH" --prompt-file "$T/p0.txt" -n 1 --store "$T/plain" >/dev/null 2>&1
    run --separate-stderr kv-run -m "$NIAH" --prompt-file "$T/p1.txt" -n 2 --store "$T/plain" --important 0.25 --query-aware
    [ "$status" -eq 65 ] || { echo "expected exit 65, got $status: $stderr"; false; }
    [[ "$stderr" == *"no key sketch"* ]]
    run --separate-stderr kv-run -m "$NIAH" -p x --store "$T/plain" --query-aware
    assert_fails_with 64 "--query-aware goes with --store and --important"
}

@test "kv-run --store refuses a store of another model with exit 65" {
    kv-tree init "$T/st"
    kv-run -m "$M260" -p "$P" -n 1 --store "$T/st" >/dev/null
    echo "1 40 50" > "$T/t.txt"
    run --separate-stderr kv-run -m "$NIAH" --tokens "$T/t.txt" -n 1 --store "$T/st"
    assert_fails_with 65 "the model 6"
}

@test "kill -9 during kv-run --store insertion leaves the store consistent and loses nothing committed" {
    kv-tree init "$T/st"
    kv-run -m "$NIAH" -p "$P$P$P$P she found a ball" -n 1 --store "$T/st" >/dev/null
    committed=$(kv-tree ls "$T/st" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
    # how long a whole run takes, so the kills land anywhere in it, the insertion at its end included
    t0=$(date +%s%N)
    kv-run -m "$NIAH" -p "$P$P$P$P she saw bird number 0 in the tall old tree" -n 1 --store "$T/st" >/dev/null
    ms=$(( ($(date +%s%N) - t0) / 1000000 + 1 ))
    committed=$(kv-tree ls "$T/st" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
    for k in $(seq 1 12); do
        kv-run -m "$NIAH" -p "$P$P$P$P she saw bird number $k in the tall old tree" -n 1 --store "$T/st" >/dev/null 2>&1 &
        pid=$!
        # the second half of the run, where the insertion is, gets most kills
        sleep "$("$PY" -c "import random; print($ms * random.uniform(0.4, 1.1) / 1000)")"
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        run kv-tree check "$T/st"
        assert_success
        now=$(kv-tree ls "$T/st" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
        [ "$now" -ge "$committed" ]
        committed=$now
    done
    # the first prompt is still found whole
    run --separate-stderr kv-run -m "$NIAH" -p "$P$P$P$P she found a ball" -n 1 --store "$T/st" --no-insert --report -
    assert_success
    [ "$(json_get 'j["prefilled_tokens"]')" = 1 ]
}

@test "kv-run --store inserts a prompt shorter than its decode, as the README's example does" {
    # the CPU engine's query ring held the decode steps' queries too, so the
    # insert's dump had more queries than tokens and was refused (exit 65)
    local M="$DATA/stories260K/stories260K.bin"
    kv-tree init "$T/st"
    run --separate-stderr kv-run -m "$M" -p "Once upon a time there was a girl" -n 40 --store "$T/st"
    assert_success
    run --separate-stderr kv-run -m "$M" -p "Once upon a time there was a dog" -n 8 --store "$T/st" --report -
    assert_success
    [ "$(json_get 'j["reused_tokens"]')" -ge 7 ]
    run --separate-stderr kv-tree check "$T/st"
    assert_success
    [ "$(json_get 'j["ok"]')" = True ]
}

@test "kv-run --store rejects a KV_TREE_NOW that is not a number with exit 64" {
    kv-tree init "$T/st"
    KV_TREE_NOW=soon run --separate-stderr kv-run -m "$M260" -p "$P" -n 1 --store "$T/st"
    assert_fails_with 64 "KV_TREE_NOW"
}
