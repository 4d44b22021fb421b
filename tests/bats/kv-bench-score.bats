#!/usr/bin/env bats
# kv-bench score: LongBench and RULER prediction files scored as the
# official eval.py / evaluate.py score them.  tests/data/longbench/pred has
# one prediction file per LongBench dataset (English, Chinese, punctuation,
# empty predictions, several answers); expected-eval*.json are what
# LongBench's eval.py printed for that folder (with rouge 1.0.1, fuzzywuzzy
# and jieba 0.42 installed), without and with --e.
bats_require_minimum_version 1.5.0
load helper

PRED="$DATA/longbench/pred"
RPRED="$DATA/ruler/pred"

need_jieba() {
    [ -r /usr/lib/python3/dist-packages/jieba/dict.txt ] || skip "no jieba data (apt-get install python3-jieba)"
}

@test "kv-bench score --help lists its options on stdout" {
    run --separate-stderr kv-bench score --help
    [ "$status" -eq 0 ]
    [[ "$output" == *"--longbench"* && "$output" == *"--ruler"* && "$output" == *"--per-sample"* ]]
}

@test "kv-bench score needs exactly one of --longbench and --ruler (64)" {
    run --separate-stderr kv-bench score "$PRED"
    assert_fails_with 64 "--longbench and --ruler"
    run --separate-stderr kv-bench score --longbench --ruler "$PRED"
    assert_fails_with 64 "--longbench and --ruler"
    run --separate-stderr kv-bench score --ruler --e "$RPRED"
    assert_fails_with 64 "--e is for --longbench"
    run --separate-stderr kv-bench score --longbench
    assert_fails_with 64 "no prediction files"
}

@test "kv-bench score --longbench gives eval.py's scores for all 21 datasets" {
    need_jieba
    run --separate-stderr kv-bench score --longbench "$PRED"
    [ "$status" -eq 0 ]
    printf '%s' "$output" >"$BATS_TEST_TMPDIR/ours.json"
    run "$PY" -c 'import json,sys
o = json.load(open(sys.argv[1]))["datasets"]; r = json.load(open(sys.argv[2]))
assert len(r) == 21 and o == r, {k: (o.get(k), v) for k, v in r.items() if o.get(k) != v}
print("same")' "$BATS_TEST_TMPDIR/ours.json" "$PRED/expected-eval.json"
    [ "$output" = same ]
}

@test "kv-bench score --longbench --e gives eval.py --e's length bins, null for an empty bin" {
    need_jieba
    run --separate-stderr kv-bench score --longbench --e "$PRED"
    [ "$status" -eq 0 ]
    printf '%s' "$output" >"$BATS_TEST_TMPDIR/ours.json"
    run "$PY" -c 'import json,sys
o = json.load(open(sys.argv[1]))["datasets"]; r = json.load(open(sys.argv[2]))
bad = [(k, b, v, o[k][b]) for k in r for b, v in r[k].items() if not ((v != v and o[k][b] is None) or v == o[k][b])]
assert not bad, bad
print("same")' "$BATS_TEST_TMPDIR/ours.json" "$PRED/expected-eval-e.json"
    [ "$output" = same ]
}

@test "kv-bench score --per-sample lists each sample's score in file order" {
    need_jieba
    run --separate-stderr kv-bench score --longbench --per-sample "$PRED/trec.jsonl" "$PRED/lcc.jsonl"
    [ "$status" -eq 0 ]
    # trec: first line only ("Human"), "Entity type" contains "Entity", a wrong class
    [ "$(json_get 'j["per_sample"]["trec"]')" = "[1.0, 0.5, 0.0]" ]
    [ "$(json_get 'j["per_sample"]["lcc"]')" = "[1.0, 0.89]" ]
    [ "$(json_get 'j["samples"]')" = "{'lcc': 2, 'trec': 3}" ]
    [ "$(json_get 'list(j["datasets"])')" = "['lcc', 'trec']" ]
}

@test "kv-bench score names a bad prediction line and exits 65" {
    d="$BATS_TEST_TMPDIR/p"
    mkdir -p "$d"
    printf '%s\n' '{"pred": "x", "answers": ["x"], "all_classes": null, "length": 1}' '{"pred": 5}' >"$d/hotpotqa.jsonl"
    run --separate-stderr kv-bench score --longbench "$d"
    assert_fails_with 65 "hotpotqa.jsonl:2"
    printf '%s\n' '{"pred": "x", "answers": ["x"], "all_classes": null}' >"$d/hotpotqa.jsonl"
    printf '%s\n' '{"pred": "x", "answers": ["x"]}' >"$d/notadataset.jsonl"
    run --separate-stderr kv-bench score --longbench "$d"
    assert_fails_with 65 "21 datasets"
    rm "$d/notadataset.jsonl"
    printf '%s\n' '{"pred": "x", "answers": ["x"], "all_classes": null}' >"$d/qasper.jsonl"
    run --separate-stderr kv-bench score --longbench --e "$d/qasper.jsonl"
    assert_fails_with 65 "length"
    run --separate-stderr kv-bench score --longbench "$d/none.jsonl"
    assert_fails_with 66 "none.jsonl"
}

@test "kv-bench score refuses a retrieval answer without its paragraph, as eval.py fails on it" {
    d="$BATS_TEST_TMPDIR/p"
    mkdir -p "$d"
    printf '%s\n' '{"pred": "3", "answers": ["three"], "all_classes": null}' >"$d/passage_retrieval_en.jsonl"
    run --separate-stderr kv-bench score --longbench "$d"
    assert_fails_with 65 "Paragraph"
}

@test "kv-bench score --ruler scores each task with its RULER metric and joins chunk files" {
    run --separate-stderr kv-bench score --ruler "$RPRED"
    [ "$status" -eq 0 ]
    # niah: string_match_all over [1, 0, 0]; qa: string_match_part over [1, 0];
    # vt-0 + vt-1 (evaluate.py's aggregate_chunk) over [1, 0.5]; vt.jsonl ignored
    [ "$(json_get 'j["tasks"]')" = "{'niah_single_1': 33.33, 'qa_1': 50.0, 'vt': 75.0}" ]
    [ "$(json_get 'j["nulls"]["niah_single_1"]')" = "1/3" ]
    [ "$(json_get 'j["metrics"]["qa_1"]')" = string_match_part ]
    [[ "$stderr" == *"replaced by their chunk files"* ]]
    run --separate-stderr kv-bench score --ruler --metric all "$RPRED/qa_1.jsonl"
    [ "$(json_get 'j["tasks"]["qa_1"]')" = 25.0 ]
    run --separate-stderr kv-bench score --ruler --metric most "$RPRED"
    assert_fails_with 64 "--metric must be all or part"
}

@test "kv-bench score prints a table on a terminal" {
    command -v script >/dev/null || skip "no script(1) to give a terminal"
    script -qec "$BIN/kv-bench score --ruler $RPRED 2>/dev/null" /dev/null | tr -d '\r' >"$BATS_TEST_TMPDIR/t"
    head -n 1 "$BATS_TEST_TMPDIR/t" | grep -q '^task  *metric  *n  *score  *nulls'
    grep -q '^qa_1  *string_match_part  *2  *50.00' "$BATS_TEST_TMPDIR/t"
}

@test "kv-bench score --longbench without jieba's data exits 66 naming python3-jieba" {
    run --separate-stderr kv-bench score --longbench --jieba "$BATS_TEST_TMPDIR/nojieba" "$PRED/dureader.jsonl"
    assert_fails_with 66 "python3-jieba"
    # the English datasets do not need it
    run --separate-stderr kv-bench score --longbench --jieba "$BATS_TEST_TMPDIR/nojieba" "$PRED/hotpotqa.jsonl"
    [ "$status" -eq 0 ]
}

@test "kv-bench's man page documents the batch subcommands' options and its dispatcher lists them" {
    for sub in longbench score merge report ruler; do
        run "$ROOT/tests/man-covers-help.sh" "$ROOT/man/kv-bench.1" kv-bench "$sub"
        assert_success
    done
    run --separate-stderr kv-bench --help
    for sub in longbench score merge report; do
        [[ "$output" == *"  $sub "* ]] || { echo "kv-bench --help lacks $sub"; return 1; }
        [[ "$output" != *"$sub"*"(not built)"* ]]
    done
}
