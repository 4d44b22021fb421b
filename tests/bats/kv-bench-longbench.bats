#!/usr/bin/env bats
# kv-bench longbench on the bundled models and the LongBench-format fixtures
# of tests/data/longbench (data/ in LongBench's JSONL layout, English and
# Chinese; templates and generation lengths in LongBench's config formats);
# and the batch machinery every batch subcommand shares: --output,
# --resume after kill -9, --shard + kv-bench merge, --pred-dir, --svg.
# Tests tagged slow (whole model runs) are left out of the ASan+UBSan pass
# of tests/run-tests.sh; the plain pass runs them all.
bats_require_minimum_version 1.5.0
load helper

LB="$DATA/longbench"
STORIES="$DATA/stories260K"
NIAH="$DATA/niah4k"

lb() {
    kv-bench longbench --threads 1 --model "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" \
        --prompts "$LB/dataset2prompt.json" --maxlen "$LB/dataset2maxlen.json" "$@"
}

EN="$LB/data/hotpotqa.jsonl $LB/data/trec.jsonl $LB/data/samsum.jsonl $LB/data/passage_count.jsonl $LB/data/lcc.jsonl $LB/data/qasper_e.jsonl"

need_jieba() {
    [ -r /usr/lib/python3/dist-packages/jieba/dict.txt ] || skip "no jieba data (apt-get install python3-jieba)"
}

# the parts of a summary that do not depend on timing
scores_of() { # json-file
    "$PY" -c 'import json,sys
j = json.load(open(sys.argv[1]))
keep = ("policy", "dataset", "n", "score", "length_bins", "truncated", "modes", "resident_bytes", "samples")
print(json.dumps({"scores": j["scores"], "skipped": j["skipped"],
                  "results": [{k: r[k] for k in keep if k in r} for r in j["results"]]}, sort_keys=True))' "$1"
}

@test "kv-bench longbench --help lists its options on stdout" {
    run --separate-stderr kv-bench longbench --help
    [ "$status" -eq 0 ]
    for o in --prompts --maxlen --max-length --chat --output --resume --shard --strict --pred-dir --svg; do
        [[ "$output" == *"$o"* ]] || { echo "missing $o"; return 1; }
    done
}

@test "kv-bench longbench needs --prompts and --maxlen (64) and data files (64)" {
    run --separate-stderr kv-bench longbench --model "$STORIES/stories260K.bin" "$LB/data/hotpotqa.jsonl"
    assert_fails_with 64 "--prompts and --maxlen"
    run --separate-stderr lb
    assert_fails_with 64 "no LongBench data files"
    run --separate-stderr lb --resume "$LB/data/hotpotqa.jsonl"
    assert_fails_with 64 "--resume needs --output"
    run --separate-stderr lb --shard 0/3 "$LB/data/hotpotqa.jsonl"
    assert_fails_with 64 "shards count from 1"
    run --separate-stderr lb --chat '[INST]' "$LB/data/hotpotqa.jsonl"
    assert_fails_with 64 "{prompt}"
}

@test "kv-bench longbench refuses a data file LongBench does not have, and templates it cannot read (65)" {
    cp "$LB/data/hotpotqa.jsonl" "$BATS_TEST_TMPDIR/hotpot.jsonl"
    run --separate-stderr lb "$BATS_TEST_TMPDIR/hotpot.jsonl"
    assert_fails_with 65 "21 datasets"
    printf '{"hotpotqa": "{context!r}"}' >"$BATS_TEST_TMPDIR/p.json"
    run --separate-stderr kv-bench longbench --model "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" \
        --prompts "$BATS_TEST_TMPDIR/p.json" --maxlen "$LB/dataset2maxlen.json" "$LB/data/hotpotqa.jsonl"
    assert_fails_with 65 "\"hotpotqa\""
    printf '{"trec": "{context}"}' >"$BATS_TEST_TMPDIR/p.json"
    run --separate-stderr kv-bench longbench --model "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" \
        --prompts "$BATS_TEST_TMPDIR/p.json" --maxlen "$LB/dataset2maxlen.json" "$LB/data/hotpotqa.jsonl"
    assert_fails_with 65 "no entry for \"hotpotqa\""
    printf '{"hotpotqa": 0}' >"$BATS_TEST_TMPDIR/m.json"
    run --separate-stderr kv-bench longbench --model "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" \
        --prompts "$LB/dataset2prompt.json" --maxlen "$BATS_TEST_TMPDIR/m.json" "$LB/data/hotpotqa.jsonl"
    assert_fails_with 65 "[1, 65536]"
}

@test "kv-bench longbench runs English datasets end to end on stories260K and scores them as eval.py" {
    run --separate-stderr lb -P full -P streaming:sink=4,window=32 --per-sample --pred-dir "$BATS_TEST_TMPDIR/pred" $EN
    [ "$status" -eq 0 ]
    printf '%s' "$output" >"$BATS_TEST_TMPDIR/run.json"
    [ "$(json_get 'len(j["results"])')" -eq 12 ]
    [ "$(json_get 'sorted(j["scores"]["full"])')" = "['hotpotqa', 'lcc', 'passage_count', 'qasper', 'samsum', 'trec']" ]
    [ "$(json_get 'j["skipped"]')" -eq 0 ]
    # LongBench-E file: its score is the three length bins
    [ "$(json_get 'sorted(j["scores"]["full"]["qasper"])')" = "['0-4k', '4-8k', '8k+']" ]
    [ "$(json_get '[r["bin_samples"] for r in j["results"] if r["dataset"] == "qasper"][0]')" = "[1, 1, 1]" ]
    # the third hotpotqa sample is longer than the context: cut in the middle
    [ "$(json_get '[r["truncated"] for r in j["results"] if r["dataset"] == "hotpotqa"]')" = "[1, 1]" ]
    [ "$(json_get 'all(r["modes"]["question"] >= 1 for r in j["results"])')" = True ]
    # streaming keeps sink + window only
    [ "$(json_get 'j["results"][6]["resident_bytes"] < j["results"][0]["resident_bytes"]')" = True ]
    # pred.py's files, and eval.py's numbers from them are the run's
    for f in hotpotqa trec samsum passage_count lcc qasper; do [ -f "$BATS_TEST_TMPDIR/pred/full/$f.jsonl" ]; done
    run "$PY" -c 'import json,sys
l = [json.loads(x) for x in open(sys.argv[1])]
assert [sorted(x) for x in l] == [["all_classes", "answers", "length", "pred"]] * 2, l
assert l[0]["all_classes"][0] == "Abbreviation" and l[0]["answers"] == ["Human"]
print("ok")' "$BATS_TEST_TMPDIR/pred/full/trec.jsonl"
    [ "$output" = ok ]
    for pol in full streaming:sink=4,window=32; do
        run --separate-stderr kv-bench score --longbench "$BATS_TEST_TMPDIR/pred/$pol"
        [ "$status" -eq 0 ]
        printf '%s' "$output" >"$BATS_TEST_TMPDIR/score.json"
        run "$PY" -c 'import json,sys
s = json.load(open(sys.argv[1]))["datasets"]; r = json.load(open(sys.argv[2]))["scores"][sys.argv[3]]
r = {k: v for k, v in r.items() if k != "qasper"}; s.pop("qasper")
assert s == r, (s, r)
print("same")' "$BATS_TEST_TMPDIR/score.json" "$BATS_TEST_TMPDIR/run.json" "$pol"
        [ "$output" = same ]
    done
}

@test "kv-bench longbench scores Chinese datasets with jieba" {
    need_jieba
    run --separate-stderr lb -P full --per-sample "$LB/data/multifieldqa_zh.jsonl"
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["results"][0]["metric"]')" = qa_f1_zh_score ]
    [ "$(json_get 'j["results"][0]["n"]')" -eq 2 ]
    [ "$(json_get 'all(0 <= s["score"] <= 1 for s in j["results"][0]["samples"])')" = True ]
    # the predictions are valid text whatever bytes the model produced
    [ "$(json_get 'all(isinstance(s["prediction"], str) for s in j["results"][0]["samples"])')" = True ]
}

@test "kv-bench longbench runs on niah4k with its byte tokenizer" {
    run --separate-stderr kv-bench longbench --threads 1 --model "$NIAH/niah4k.bin" --tokenizer "$NIAH/tok259.bin" \
        --prompts "$LB/dataset2prompt.json" --maxlen "$LB/dataset2maxlen.json" --max-gen 4 --limit 2 \
        -P full -P sparse:k=16,s=4,w=16 "$LB/data/hotpotqa.jsonl"
    [ "$status" -eq 0 ]
    [ "$(json_get '[r["n"] for r in j["results"]]')" = "[2, 2]" ]
    [ "$(json_get 'j["results"][1]["host_bytes"] > 0')" = True ]
}

@test "kv-bench longbench skips malformed and over-long samples with a warning, --strict makes them fatal" {
    f="$BATS_TEST_TMPDIR/hotpotqa.jsonl"
    head -n 1 "$LB/data/hotpotqa.jsonl" >"$f"
    printf '%s\n' '{"input": "q", "answers": "not a list", "_id": "bad"}' >>"$f"
    "$PY" -c 'import json; print(json.dumps({"input": "q", "context": "word " * 3000, "answers": ["x"], "_id": "long", "length": 3000}))' >>"$f"
    # --max-length 2000 keeps 2000 tokens of a 512-token model: too long for it
    run --separate-stderr lb --max-length 2000 --max-gen 2 "$f"
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["skipped"]')" -eq 2 ]
    [ "$(json_get '[s["line"] for s in j["skipped_samples"]]')" = "[2, 3]" ]
    [ "$(json_get 'j["results"][0]["n"]')" -eq 1 ]
    [[ "$stderr" == *"hotpotqa.jsonl:2: skipped: "*"answers"* ]]
    [[ "$stderr" == *"hotpotqa.jsonl:3: skipped: prompt of "*"exceeds the context 512"* ]]
    run --separate-stderr lb --max-length 2000 --max-gen 2 --strict "$f"
    assert_fails_with 65 "hotpotqa.jsonl:2"
    [ -z "$output" ]
}

# bats test_tags=slow
@test "kv-bench longbench --resume after kill -9 loses nothing and repeats nothing" {
    out="$BATS_TEST_TMPDIR/log.jsonl"
    # niah4k reads bytes: each sample takes long enough to be killed in the middle
    nlb() {
        kv-bench longbench --threads 1 --model "$NIAH/niah4k.bin" --tokenizer "$NIAH/tok259.bin" \
            --prompts "$LB/dataset2prompt.json" --maxlen "$LB/dataset2maxlen.json" --max-gen 3 \
            -P full -P streaming:sink=4,window=32 "$@" "$LB/data/hotpotqa.jsonl" "$LB/data/trec.jsonl"
    }
    run --separate-stderr nlb
    [ "$status" -eq 0 ]
    printf '%s' "$output" >"$BATS_TEST_TMPDIR/ref.json"
    # exec: $! must be kv-bench itself, not a subshell that kill -9 would orphan it from
    (exec kv-bench longbench --threads 1 --model "$NIAH/niah4k.bin" --tokenizer "$NIAH/tok259.bin" \
        --prompts "$LB/dataset2prompt.json" --maxlen "$LB/dataset2maxlen.json" --max-gen 3 \
        -P full -P streaming:sink=4,window=32 -o "$out" "$LB/data/hotpotqa.jsonl" "$LB/data/trec.jsonl" \
        >/dev/null 2>&1) &
    pid=$!
    n=0
    for _ in $(seq 600); do
        n=$(grep -c '"policy"' "$out" 2>/dev/null) || true
        [ "${n:-0}" -ge 2 ] && break
        sleep 0.05
    done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    before=$(grep -c '"policy"' "$out")
    # killed in the middle: some records, not all 12
    [ "$before" -ge 2 ] && [ "$before" -lt 12 ]
    # without --resume the log is not overwritten
    run --separate-stderr nlb -o "$out"
    assert_fails_with 73 "--resume"
    run --separate-stderr nlb -o "$out" --resume
    [ "$status" -eq 0 ]
    printf '%s' "$output" >"$BATS_TEST_TMPDIR/resumed.json"
    # every (sample, policy) exactly once: 6 samples x 2 policies
    run "$PY" -c 'import json,sys
recs = [json.loads(l) for l in open(sys.argv[1]) if "kv_bench_log" not in l]
keys = [(r["task"], r["id"], r["policy"]) for r in recs]
assert len(keys) == len(set(keys)) == 12, (len(keys), len(set(keys)))
print("ok")' "$out"
    [ "$output" = ok ]
    [ "$(scores_of "$BATS_TEST_TMPDIR/resumed.json")" = "$(scores_of "$BATS_TEST_TMPDIR/ref.json")" ]
    # a settings change is refused on resume
    run --separate-stderr nlb -o "$out" --resume --max-gen 2
    assert_fails_with 64 "\"max_gen\" differs"
}

# bats test_tags=slow
@test "kv-bench longbench: three shards merged give the single run's scores byte for byte" {
    run --separate-stderr lb -P full -P quant:bits=2,residual=16 --per-sample --pred-dir "$BATS_TEST_TMPDIR/one" $EN
    [ "$status" -eq 0 ]
    printf '%s' "$output" >"$BATS_TEST_TMPDIR/one.json"
    for i in 1 2 3; do
        run --separate-stderr lb -P full -P quant:bits=2,residual=16 --shard $i/3 -o "$BATS_TEST_TMPDIR/s$i.jsonl" $EN
        [ "$status" -eq 0 ]
    done
    # each sample ran in exactly one shard
    run "$PY" -c 'import json,sys
ids = [(json.loads(l)["task"], json.loads(l)["id"]) for f in sys.argv[1:] for l in open(f)
       if "kv_bench_log" not in l and json.loads(l).get("policy") == "full"]
assert len(ids) == len(set(ids)) == 12, ids
print("ok")' "$BATS_TEST_TMPDIR"/s[123].jsonl
    [ "$output" = ok ]
    run --separate-stderr kv-bench merge --per-task --pred-dir "$BATS_TEST_TMPDIR/merged" \
        "$BATS_TEST_TMPDIR/s2.jsonl" "$BATS_TEST_TMPDIR/s3.jsonl" "$BATS_TEST_TMPDIR/s1.jsonl"
    [ "$status" -eq 0 ]
    printf '%s' "$output" >"$BATS_TEST_TMPDIR/merged.json"
    [ "$(scores_of "$BATS_TEST_TMPDIR/merged.json")" = "$(scores_of "$BATS_TEST_TMPDIR/one.json")" ]
    # the prediction files too
    diff -r "$BATS_TEST_TMPDIR/one" "$BATS_TEST_TMPDIR/merged"
    # a missing shard is an error
    run --separate-stderr kv-bench merge "$BATS_TEST_TMPDIR/s1.jsonl" "$BATS_TEST_TMPDIR/s3.jsonl"
    assert_fails_with 65 "shard 2/3 is missing"
}

@test "kv-bench longbench --svg and kv-bench report draw the three charts" {
    run --separate-stderr lb -P full -P streaming:sink=4,window=32 -o "$BATS_TEST_TMPDIR/log.jsonl" \
        --svg "$BATS_TEST_TMPDIR/run.svg" "$LB/data/qasper_e.jsonl" "$LB/data/hotpotqa.jsonl"
    [ "$status" -eq 0 ]
    run --separate-stderr kv-bench report -o "$BATS_TEST_TMPDIR/report.svg" "$BATS_TEST_TMPDIR/log.jsonl"
    [ "$status" -eq 0 ]
    cmp "$BATS_TEST_TMPDIR/run.svg" "$BATS_TEST_TMPDIR/report.svg"
    run "$PY" -c 'import sys, xml.etree.ElementTree as E
t = E.parse(sys.argv[1]); ns = "{http://www.w3.org/2000/svg}"
text = [x.text for x in t.iter(ns + "text")]
for want in ["Accuracy per policy and length", "Accuracy against KV bytes", "Decode time per token against length",
             "full", "streaming:sink=4,window=32", "0-4k", "4-8k", "8k+", "ms per decoded token"]:
    assert want in text, want
print("ok")' "$BATS_TEST_TMPDIR/report.svg"
    [ "$output" = ok ]
}
