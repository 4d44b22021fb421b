#!/usr/bin/env bats
# kv-bench ruler (needle accuracy per KV policy) and kv-bench fidelity
# (KL / top-1 / perplexity against full) on the real test models.
# Tests tagged slow (whole model runs) are left out of the ASan+UBSan pass
# of tests/run-tests.sh; the plain pass runs them all.
bats_require_minimum_version 1.5.0
load helper

NIAH="$DATA/niah4k"
STORIES="$DATA/stories260K"

ruler() {
    kv-bench ruler --threads 1 --model "$NIAH/niah4k.bin" --tokenizer "$NIAH/tok259.bin" "$@"
}

fidelity() {
    kv-bench fidelity --threads 1 --model "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" "$@"
}

@test "kv-bench ruler --help lists its options on stdout" {
    run --separate-stderr kv-bench ruler --help
    [ "$status" -eq 0 ]
    [[ "$output" == *"--tasks"* ]]
    [[ "$output" == *"--mode"* ]]
}

@test "kv-bench ruler without --tasks is a usage error (64)" {
    run --separate-stderr ruler
    assert_fails_with 64 "--tasks"
}

@test "kv-bench ruler rejects an unknown policy with exit 64 before loading anything" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -P sparce
    assert_fails_with 64 "unknown policy"
}

@test "kv-bench ruler reports a missing task file with exit 66" {
    run --separate-stderr ruler --tasks "$BATS_TEST_TMPDIR/none.jsonl"
    assert_fails_with 66 "none.jsonl"
}

@test "kv-bench ruler --strict names the bad line of a task file and exits 65" {
    f="$BATS_TEST_TMPDIR/bad.jsonl"
    printf '%s\n' '{"index": 0, "input": "x", "outputs": ["1"], "length": 1}' '' '{"index": 1, "input": "y"' >"$f"
    run --separate-stderr ruler --tasks "$f" --strict
    assert_fails_with 65 "bad.jsonl:3"
    [ -z "$output" ]
    printf '%s\n' '{"index": 0, "input": "x", "outputs": "1"}' >"$f"
    run --separate-stderr ruler --tasks "$f"
    assert_fails_with 65 "bad.jsonl:1: \"outputs\""
    printf '%s\n' '[1, 2]' >"$f"
    run --separate-stderr ruler --tasks "$f"
    assert_fails_with 65 "bad.jsonl:1"
}

# bats test_tags=slow
@test "kv-bench ruler: full and sparse find 1k needles, streaming loses them" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 2 \
        -P full -P sparse -P streaming --per-task
    [ "$status" -eq 0 ]
    [ "$(json_get 'len(j["results"])')" -eq 3 ]
    [ "$(json_get 'j["mode"]')" = question ]
    [ "$(json_get '[r["n"] for r in j["results"]]')" = "[2, 2, 2]" ]
    [ "$(json_get 'j["results"][0]["accuracy"]')" = 1 ]
    [ "$(json_get 'j["results"][1]["accuracy"]')" = 1 ]
    [ "$(json_get 'j["results"][2]["accuracy"]')" = 0 ]
    # the predictions are the needles themselves
    [ "$(json_get 'j["results"][0]["tasks"][0]["prediction"]')" = 9125844 ]
    # bytes: sparse keeps the prompt on the host and fetches per step;
    # streaming keeps sink + window only
    [ "$(json_get 'j["results"][0]["host_bytes"] == 0 and j["results"][0]["fetched_bytes_per_step"] == 0')" = True ]
    [ "$(json_get 'j["results"][1]["host_bytes"] > 0 and j["results"][1]["fetched_bytes_per_step"] > 0')" = True ]
    [ "$(json_get 'j["results"][1]["resident_bytes"] < j["results"][0]["resident_bytes"] / 5')" = True ]
    [ "$(json_get 'j["results"][2]["resident_bytes"] == 6 * 2 * 2 * 64 * 64 * 4')" = True ]
}

@test "kv-bench fidelity: full against full is exactly zero" {
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" -P full --prefix 40
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["prefix"]')" -eq 40 ]
    [ "$(json_get 'j["n_scored"] == j["n_tokens"] - 41')" = True ]
    [ "$(json_get 'j["results"][0]["kl_mean"]')" = 0 ]
    [ "$(json_get 'j["results"][0]["kl_max"]')" = 0 ]
    [ "$(json_get 'j["results"][0]["top1_agreement"]')" = 1 ]
    [ "$(json_get 'j["results"][0]["ppl_diff"]')" = 0 ]
}

@test "kv-bench fidelity shows that 1-bit keys destroy stories260K and 4-bit does not" {
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" \
        -P quant:bits=1,residual=16 -P quant:bits=4,residual=16 -P streaming:sink=4,window=16
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["results"][0]["kl_mean"] > 1')" = True ]
    [ "$(json_get 'j["results"][1]["kl_mean"] < 0.01')" = True ]
    [ "$(json_get 'j["results"][1]["top1_agreement"] > 0.9')" = True ]
    [ "$(json_get 'j["results"][2]["kl_mean"] > 0')" = True ]
    [ "$(json_get 'j["results"][0]["resident_bytes"] < j["reference_resident_bytes"]')" = True ]
}

@test "kv-bench fidelity takes token ids with --tokens" {
    echo "1 403 407 261 378 432 383 286 261 376 298 315 421 395 317 426" >"$BATS_TEST_TMPDIR/ids"
    run --separate-stderr kv-bench fidelity --threads 1 --model "$STORIES/stories260K.bin" \
        --tokens "$BATS_TEST_TMPDIR/ids" -P sparse:k=2,s=1,w=2 --json
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["n_tokens"]')" -eq 16 ]
    [ "$(json_get 'j["results"][0]["host_bytes"] > 0')" = True ]
}

@test "kv-bench fidelity rejects a token id outside the vocabulary with exit 65" {
    echo "1 403 99999 5" >"$BATS_TEST_TMPDIR/ids"
    run --separate-stderr kv-bench fidelity --threads 1 --model "$STORIES/stories260K.bin" \
        --tokens "$BATS_TEST_TMPDIR/ids" -P full
    assert_fails_with 65 "99999"
}

@test "kv-bench fidelity needs --text or --tokens (64) and a tokenizer for text (64)" {
    run --separate-stderr kv-bench fidelity --threads 1 --model "$STORIES/stories260K.bin" -P full
    assert_fails_with 64 "--text"
    run --separate-stderr kv-bench fidelity --threads 1 --model "$STORIES/stories260K.bin" -P full \
        --text "$STORIES/reference/greedy_bos_200.txt"
    assert_fails_with 64 "tokenizer"
}

@test "kv-bench fidelity --per-position lists each position's KL and agreement" {
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" --prefix 100 \
        -P quant:bits=2,residual=8,group=8 --per-position
    [ "$status" -eq 0 ]
    [ "$(json_get 'len(j["results"][0]["kl"]) == j["n_scored"] == len(j["results"][0]["agree"])')" = True ]
    [ "$(json_get 'abs(sum(j["results"][0]["kl"]) / j["n_scored"] - j["results"][0]["kl_mean"]) < 1e-5')" = True ]
    [ "$(json_get 'abs(sum(j["results"][0]["agree"]) / j["n_scored"] - j["results"][0]["top1_agreement"]) < 1e-5')" = True ]
    [ "$(json_get 'j["results"][0]["kl_mean"] > 0')" = True ]
}

# --device: the same runs on the CPU or GPU engine (lib/kv_runner).  CI has
# no GPU: these check the refusal, the fallback and that auto is then the
# CPU run itself.
no_gpu_or_skip() {
    if kv-bench --version | grep -q '^GPU: NVIDIA'; then
        skip "a GPU is present: --device cuda runs there"
    fi
}

@test "kv-bench ruler --device cuda without a usable GPU exits 69 with one line" {
    no_gpu_or_skip
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 1 --device cuda
    assert_fails_with 69 "--device cuda"
    [ "${#stderr_lines[@]}" -eq 1 ]
    [ -z "$output" ]
}

@test "kv-bench fidelity --device cuda without a usable GPU exits 69 with one line" {
    no_gpu_or_skip
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" -P full --device cuda
    assert_fails_with 69 "--device cuda"
    [ "${#stderr_lines[@]}" -eq 1 ]
    [ -z "$output" ]
}

@test "kv-bench ruler and fidelity reject an unknown --device with exit 64" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" --device bogus
    assert_fails_with 64 "--device must be cpu, cuda or auto"
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" -P full --device gpu
    assert_fails_with 64 "--device must be cpu, cuda or auto"
}

@test "kv-bench ruler rejects an unknown --select with exit 64" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" --select fast
    assert_fails_with 64 "--select must be policy or sketch"
}

# bats test_tags=slow
@test "kv-bench ruler --device auto without a GPU is the CPU run, device \"cpu\"" {
    no_gpu_or_skip
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 1 -P sparse --per-task
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["device"]')" = cpu ]
    cpu="$output"
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 1 -P sparse --per-task \
        --device auto
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["device"]')" = cpu ]
    # every number but the wall time is the same
    strip='[{k: v for k, v in r.items() if not k.startswith("ms_per")} for r in j["results"]]'
    [ "$(json_get "$strip")" = "$(output="$cpu" json_get "$strip")" ]
    [ "$(json_get 'j["results"][0]["accuracy"]')" = 1 ]
    [ "$(json_get 'j["results"][0]["fetched_bytes_per_step"] > 0')" = True ]
}

@test "kv-bench fidelity --device auto without a GPU is the CPU run, device \"cpu\"" {
    no_gpu_or_skip
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" --max-tokens 64 \
        -P quant:bits=2,residual=8,group=8 --per-position --device cpu
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["device"]')" = cpu ]
    [ "$(json_get 'j["results"][0]["kl_mean"] > 0')" = True ]
    cpu="$output"
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" --max-tokens 64 \
        -P quant:bits=2,residual=8,group=8 --per-position --device auto
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["device"]')" = cpu ]
    [ "$(json_get 'j["n_tokens"]')" -eq 64 ]
    [ "$output" = "$cpu" ]
}

@test "kv-bench ruler and fidelity say in their JSON how the prompts were prefilled" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 1 -P full --device cpu
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["prefill"]["device"]')" = cpu ]
    [ "$(json_get 'j["prefill"]["method"]')" = chunked ]
    [ "$(json_get 'j["prefill"]["chunk"]')" = 128 ]
    [ "$(json_get 'len(j["prefill"]["why"]) > 0')" = True ]
    run --separate-stderr fidelity --text "$STORIES/reference/greedy_bos_200.txt" --max-tokens 32 -P full
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["prefill"]["device"]')" = cpu ]
    [ "$(json_get 'j["prefill"]["method"]')" = chunked ]
    [ "$(json_get 'j["prefill"]["chunk"]')" = 128 ]
}

# bats test_tags=slow
@test "kv-bench ruler and fidelity name the device in their table" {
    command -v script >/dev/null || skip "no script(1) to give a terminal"
    # stdout on a terminal: the table; stderr (progress) dropped
    script -qec "$BIN/kv-bench fidelity --threads 1 --model $STORIES/stories260K.bin \
        --tokenizer $STORIES/tok512.bin --text $STORIES/reference/greedy_bos_200.txt \
        --max-tokens 32 -P full 2>/dev/null" /dev/null | tr -d '\r' >"$BATS_TEST_TMPDIR/t"
    [ "$(head -n 1 "$BATS_TEST_TMPDIR/t")" = "device: cpu" ]
    [ "$(sed -n 2p "$BATS_TEST_TMPDIR/t")" = "prefill: cpu, chunks of 128 rows (the CPU engine's float32 matrix-matrix products)" ]
    grep -q 'KL mean' "$BATS_TEST_TMPDIR/t"
    script -qec "$BIN/kv-bench ruler --threads 1 --model $NIAH/niah4k.bin --tokenizer $NIAH/tok259.bin \
        --tasks $NIAH/tasks-dev.jsonl -l 1024 --limit 1 --device cpu 2>/dev/null" /dev/null |
        tr -d '\r' >"$BATS_TEST_TMPDIR/r"
    [ "$(head -n 1 "$BATS_TEST_TMPDIR/r")" = "device: cpu" ]
    grep -q '^prefill: cpu, in chunks' "$BATS_TEST_TMPDIR/r"
    grep -q 'resident KiB' "$BATS_TEST_TMPDIR/r"
}

# --- RULER as published, and robust batches ------------------------------------------------

RULERDATA="$DATA/ruler/data"
sruler() {
    kv-bench ruler --threads 1 --model "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" "$@"
}

@test "kv-bench ruler refuses out-of-range numbers instead of converting them (issue 14, item 3)" {
    f="$BATS_TEST_TMPDIR/t.jsonl"
    printf '%s\n' '{"index": 0, "input": "Lily had a ball.\nQuestion: What?", "outputs": ["ball"], "length": 8}' \
        '{"index":1e300,"input":"x","outputs":["1"],"length":-1e40}' >"$f"
    run --separate-stderr sruler --tasks "$f" --gen 2 --strict
    assert_fails_with 65 "t.jsonl:2: \"index\" 1e+300 is not an integer"
    # without --strict the line is skipped, said once and counted
    run --separate-stderr sruler --tasks "$f" --gen 2
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["skipped"]')" -eq 1 ]
    [ "$(json_get 'j["skipped_samples"][0]["line"]')" -eq 2 ]
    [ "$(json_get '[(r["length"], r["n"]) for r in j["results"]]')" = "[(8, 1)]" ]
    [[ "$stderr" == *"t.jsonl:2: skipped: \"index\" 1e+300 is not an integer in ["* ]]
}

@test "kv-bench ruler accepts the files of all 13 RULER tasks and scores each with its metric" {
    args=()
    for t in "$RULERDATA"/*/validation.jsonl; do args+=(--tasks "$t"); done
    [ "${#args[@]}" -eq 26 ]
    run --separate-stderr sruler "${args[@]}"
    [ "$status" -eq 0 ]
    [ "$(json_get 'len(j["files"])')" -eq 13 ]
    # tasks are named by their folder; RULER's tokens_to_generate per task
    [ "$(json_get '{f["task"]: f["gen"] for f in j["files"]}')" = "{'cwe': 120, 'fwe': 50, 'niah_multikey_1': 128, 'niah_multikey_2': 128, 'niah_multikey_3': 128, 'niah_multiquery': 128, 'niah_multivalue': 128, 'niah_single_1': 128, 'niah_single_2': 128, 'niah_single_3': 128, 'qa_1': 32, 'qa_2': 32, 'vt': 30}" ]
    [ "$(json_get 'sorted({r["task"] for r in j["results"] if r["metric"] == "string_match_part"})')" = "['qa_1', 'qa_2']" ]
    # every task found its question (the input's last line) and decoded it through the policy
    [ "$(json_get 'all(r["modes"] == {"question": r["n"], "prefill": 0} for r in j["results"])')" = True ]
    [ "$(json_get 'sum(r["n"] for r in j["results"])')" -eq 19 ]
}

# bats test_tags=slow
@test "kv-bench ruler sends input + answer_prefix, as RULER does" {
    # two repository tasks rewritten in RULER's layout: "Answer: " moved into answer_prefix
    "$PY" -c 'import json,sys
for l in list(open(sys.argv[1]))[:2]:
    t = json.loads(l); i = t["input"].rindex("Answer: ")
    t["answer_prefix"] = t["input"][i:]; t["input"] = t["input"][:i]
    print(json.dumps(t))' "$NIAH/tasks-dev.jsonl" >"$BATS_TEST_TMPDIR/split.jsonl"
    run --separate-stderr ruler --tasks "$BATS_TEST_TMPDIR/split.jsonl" -l 1024 --per-task
    [ "$status" -eq 0 ]
    split="$output"
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 2 --per-task
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["results"][0]["accuracy"]')" = 1 ]
    preds='[t["prediction"] for t in j["results"][0]["tasks"]]'
    [ "$(json_get "$preds")" = "$(output="$split" json_get "$preds")" ]
}

@test "kv-bench ruler warns when a task has no question to split at and says it ran in prefill mode" {
    f="$BATS_TEST_TMPDIR/niah_single_1.jsonl"
    printf '%s\n' '{"index": 0, "input": "Lily had a red ball. What color was the ball?", "answer_prefix": " It was", "outputs": ["red"], "length": 20}' \
        '{"index": 1, "input": "Lily had a red ball.\nWhat color was the ball?", "answer_prefix": " It was", "outputs": ["red"], "length": 20}' >"$f"
    run --separate-stderr sruler --tasks "$f" --gen 4
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["mode"]')" = question ]
    [ "$(json_get 'j["results"][0]["modes"]')" = "{'question': 1, 'prefill': 1}" ]
    [[ "$stderr" == *"niah_single_1.jsonl: 1 of 2 task(s) have no question to split at"*"prefill mode"* ]]
}

@test "kv-bench ruler skips a task longer than the context and counts it" {
    f="$BATS_TEST_TMPDIR/t.jsonl"
    "$PY" -c 'import json
print(json.dumps({"index": 0, "input": "Lily had a ball.\nQuestion: What?", "outputs": ["ball"], "length": 8}))
print(json.dumps({"index": 1, "input": "word " * 900 + "\nQuestion: What?", "outputs": ["ball"], "length": 8}))' >"$f"
    run --separate-stderr sruler --tasks "$f" --gen 2
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["skipped"]')" -eq 1 ]
    [ "$(json_get 'j["results"][0]["n"]')" -eq 1 ]
    [[ "$stderr" == *"t.jsonl:2: skipped: prompt of "*"tokens exceeds the context 512"* ]]
    run --separate-stderr sruler --tasks "$f" --gen 2 --strict
    assert_fails_with 65 "t.jsonl:2: prompt of"
}

@test "kv-bench ruler --resume runs only the policies a log lacks" {
    out="$BATS_TEST_TMPDIR/log.jsonl"
    args=(--tasks "$RULERDATA/qa_1/validation.jsonl" --tasks "$RULERDATA/vt/validation.jsonl" --gen 3)
    # --resume on a log that is not there yet starts it (one command line for
    # the first start and every requeue)
    run --separate-stderr sruler "${args[@]}" -P full -o "$out" --resume
    [ "$status" -eq 0 ]
    [ "$(grep -c '"policy"' "$out")" -eq 2 ]
    run --separate-stderr sruler "${args[@]}" -P full -P streaming:sink=4,window=8 -o "$out" --resume
    [ "$status" -eq 0 ]
    [ "$(grep -c '"policy"' "$out")" -eq 4 ]
    [ "$(grep -c '"policy":"full"' "$out")" -eq 2 ]
    [ "$(json_get '[r["policy"] for r in j["results"]]')" = "['full', 'full', 'streaming:sink=4,window=8', 'streaming:sink=4,window=8']" ]
    # nothing left: a third run adds no record
    run --separate-stderr sruler "${args[@]}" -P full -P streaming:sink=4,window=8 -o "$out" --resume
    [ "$status" -eq 0 ]
    [ "$(grep -c '"policy"' "$out")" -eq 4 ]
}

# bats test_tags=slow
@test "kv-bench ruler: three shards merged equal one run in every score" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 3 -P full -P streaming --per-task
    [ "$status" -eq 0 ]
    one="$output"
    for i in 1 2 3; do
        run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" -l 1024 --limit 3 -P full -P streaming \
            --shard $i/3 -o "$BATS_TEST_TMPDIR/s$i.jsonl"
        [ "$status" -eq 0 ]
    done
    run --separate-stderr kv-bench merge --per-task "$BATS_TEST_TMPDIR"/s[123].jsonl
    [ "$status" -eq 0 ]
    keep='[{k: v for k, v in r.items() if not k.startswith("ms_per")} for r in j["results"]]'
    [ "$(json_get "$keep")" = "$(output="$one" json_get "$keep")" ]
    [ "$(json_get 'j["samples"]')" -eq 3 ]
}

@test "kv-bench merge refuses logs of different runs and non-logs" {
    printf '%s\n' '{"not": "a log"}' >"$BATS_TEST_TMPDIR/x.jsonl"
    run --separate-stderr kv-bench merge "$BATS_TEST_TMPDIR/x.jsonl"
    assert_fails_with 65 "no header"
    run --separate-stderr sruler --tasks "$RULERDATA/qa_1/validation.jsonl" --gen 2 -o "$BATS_TEST_TMPDIR/a.jsonl"
    run --separate-stderr sruler --tasks "$RULERDATA/qa_1/validation.jsonl" --gen 3 -o "$BATS_TEST_TMPDIR/b.jsonl"
    run --separate-stderr kv-bench merge "$BATS_TEST_TMPDIR/a.jsonl" "$BATS_TEST_TMPDIR/b.jsonl"
    assert_fails_with 65 "different runs"
    run --separate-stderr kv-bench merge
    assert_fails_with 64 "no results logs"
    run --separate-stderr kv-bench merge "$BATS_TEST_TMPDIR/none.jsonl"
    assert_fails_with 66 "none.jsonl"
}

@test "kv-bench ruler --pred-dir writes RULER's prediction files, which kv-bench score reads" {
    run --separate-stderr sruler --tasks "$RULERDATA/qa_1/validation.jsonl" --tasks "$RULERDATA/niah_single_1/validation.jsonl" \
        --gen 4 -P full --pred-dir "$BATS_TEST_TMPDIR/pred"
    [ "$status" -eq 0 ]
    run_json="$output"
    [ -f "$BATS_TEST_TMPDIR/pred/full/qa_1.jsonl" ]
    [ -f "$BATS_TEST_TMPDIR/pred/full/niah_single_1.jsonl" ]
    run "$PY" -c 'import json,sys
l = [json.loads(x) for x in open(sys.argv[1])]
assert len(l) == 2 and all(k in l[0] for k in ("index", "pred", "input", "outputs", "others", "length")), l
assert l[0]["input"].startswith("Some special magic")
print("ok")' "$BATS_TEST_TMPDIR/pred/full/niah_single_1.jsonl"
    [ "$output" = ok ]
    run --separate-stderr kv-bench score --ruler "$BATS_TEST_TMPDIR/pred/full"
    [ "$status" -eq 0 ]
    [ "$(json_get 'j["tasks"]["qa_1"]')" = "$(output="$run_json" json_get '[r["score"] for r in j["results"] if r["task"] == "qa_1"][0]')" ]
}

@test "kv-bench report draws a RULER log, and refuses bad input" {
    run --separate-stderr sruler --tasks "$RULERDATA/qa_1/validation.jsonl" --tasks "$RULERDATA/vt/validation.jsonl" \
        --gen 2 -P full -P streaming:sink=4,window=8 -o "$BATS_TEST_TMPDIR/log.jsonl"
    [ "$status" -eq 0 ]
    run --separate-stderr kv-bench report "$BATS_TEST_TMPDIR/log.jsonl"
    [ "$status" -eq 0 ]
    printf '%s' "$output" >"$BATS_TEST_TMPDIR/r.svg"
    run "$PY" -c 'import sys, xml.etree.ElementTree as E
t = E.parse(sys.argv[1]); ns = "{http://www.w3.org/2000/svg}"
text = [x.text for x in t.iter(ns + "text")]
assert "task length (tokens)" in text and "streaming:sink=4,window=8" in text and "90" in text, text
assert len(list(t.iter(ns + "path"))) >= 6
print("ok")' "$BATS_TEST_TMPDIR/r.svg"
    [ "$output" = ok ]
    run --separate-stderr kv-bench report
    assert_fails_with 64 "no results logs"
    run --separate-stderr kv-bench report "$BATS_TEST_TMPDIR/none.jsonl"
    assert_fails_with 66 "none.jsonl"
    run --separate-stderr kv-bench report -o "$BATS_TEST_TMPDIR/nodir/x.svg" "$BATS_TEST_TMPDIR/log.jsonl"
    assert_fails_with 73 "nodir"
}

@test "kv-bench ruler shows done/total, rate and ETA on a terminal" {
    command -v script >/dev/null || skip "no script(1) to give a terminal"
    script -qec "$BIN/kv-bench ruler --threads 1 --model $STORIES/stories260K.bin --tokenizer $STORIES/tok512.bin \
        --tasks $RULERDATA/qa_1/validation.jsonl --tasks $RULERDATA/vt/validation.jsonl --gen 2 >/dev/null" \
        /dev/null | tr '\r' '\n' >"$BATS_TEST_TMPDIR/p"
    grep -Eq '[0-9]+/2 \([0-9]+%\) [0-9.]+/s ETA ' "$BATS_TEST_TMPDIR/p"
}

@test "kv-bench ruler takes --gpu-step as decode's variants and refuses an unknown word (64)" {
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" --gpu-step cache+slow -P full
    assert_fails_with 64 "'slow' is not one of serial, wide, cache"
    [ -z "$output" ]
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" --gpu-step ahead3 -P full
    assert_fails_with 64 "'ahead3' is not one of"
    run --separate-stderr kv-bench ruler --help
    [[ "$output" == *"--gpu-step"* ]]
    [[ "$output" == *"ahead2"* ]]
    # on the CPU the option changes nothing: the same JSON as without it
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" --limit 1 -l 1024 --json --gpu-step wide+cache -P full
    [ "$status" -eq 0 ]
    a=$(json_get '[(r["policy"], r["length"], r["accuracy"]) for r in j["results"]]')
    run --separate-stderr ruler --tasks "$NIAH/tasks-dev.jsonl" --limit 1 -l 1024 --json -P full
    [ "$status" -eq 0 ]
    b=$(json_get '[(r["policy"], r["length"], r["accuracy"]) for r in j["results"]]')
    [ "$a" = "$b" ]
    [ "$(json_get 'len(j["results"])')" -ge 1 ]
}
