#!/usr/bin/env bats
# Conventions shared by every tool: a short option letter means the same
# thing everywhere (the table in docs/DESIGN.md, "Option letters"), and old
# spellings that meant something else warn once and still work.
bats_require_minimum_version 1.5.0
load helper

# "letter long" for every short option each tool and subcommand shows in --help
help_pairs() {
    for t in kv-run kv-info kv-quant kv-profile kv-convert \
             "kv-tree init" "kv-tree put" "kv-tree get" "kv-tree ls" "kv-tree place" \
             "kv-tree rm" "kv-tree gc" "kv-tree check" \
             "kv-bench attn" "kv-bench pack" "kv-bench ruler" "kv-bench fidelity" "kv-bench decode" \
             "kv-bench prefill"; do
        # shellcheck disable=SC2086
        $t --help | sed -nE 's/^ +-([A-Za-z]), --([a-z0-9-]+).*/\1 \2/p' | sed "s|^|$t: |"
    done
}

@test "every short option means what the docs/DESIGN.md letter table says, in every tool" {
    run --separate-stderr bash -c "$(declare -f help_pairs); help_pairs"
    assert_success
    [ "${#lines[@]}" -gt 20 ]
    printf '%s\n' "$output" > "$BATS_TEST_TMPDIR/pairs"
    run "$PY" - "$ROOT/docs/DESIGN.md" "$BATS_TEST_TMPDIR/pairs" <<'PY'
import re, sys
doc = open(sys.argv[1]).read()
sec = doc[doc.index("## Option letters"):]
sec = sec[:sec.index("\n## ", 3)]
table = {}
for m in re.finditer(r"^\| `-(\w)` \| [^|]* \| (.*) \|$", sec, re.M):
    table[m.group(1)] = set(re.findall(r"`--([a-z0-9-]+)`", m.group(2)))
bad = []
for line in open(sys.argv[2]):
    tool, pair = line.rstrip("\n").split(": ")
    letter, long = pair.split(" ")
    if long not in table.get(letter, set()):
        bad.append(f"{tool}: -{letter} is --{long}, the table says {sorted(table.get(letter, []))}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
PY
    assert_success
}

@test "kv-run -p is --prompt, and kv-bench ruler shows no -p (its --policy is -P)" {
    run --separate-stderr bash -c "kv-run --help | grep -E '^ +-p, --prompt'"
    assert_success
    run --separate-stderr bash -c "kv-bench ruler --help | grep -E '^ +-p, '"
    assert_failure
}

@test "--device spells cpu, cuda, auto, cuda:N and N the same in every tool" {
    for t in kv-run "kv-bench ruler" "kv-bench fidelity"; do
        # shellcheck disable=SC2086
        run --separate-stderr $t --device cuda:zero
        assert_fails_with 64 "--device must be cpu, cuda or auto (or cuda:N, N for a CUDA device)"
    done
    for t in "kv-bench decode" "kv-bench prefill"; do
        # shellcheck disable=SC2086
        run --separate-stderr $t --device cuda:zero
        assert_fails_with 64 "--device must be cpu, cuda or auto (or cuda:N, N for a CUDA device)"
        # shellcheck disable=SC2086
        run --separate-stderr $t --device cpu
        assert_fails_with 64 "runs on the GPU: --device cuda[:N]"
    done
}

@test "kv-bench prefill spells -j for --json and --device DEV as every other subcommand" {
    run --separate-stderr bash -c "kv-bench prefill --help | grep -E '^ +-j, --json'"
    assert_success
    run --separate-stderr bash -c "kv-bench prefill --help | grep -E '^ +--device DEV'"
    assert_success
}

@test "an error about a path longer than the message buffer is cut before the reason, not after" {
    local long="$BATS_TEST_TMPDIR/$("$PY" -c "print('/'.join(['d' * 200] * 11))")/x.kvc"
    run --separate-stderr kv-info "$long"
    assert_fails_with 66 "...: cannot open: No such file or directory"
    [ "${#stderr}" -lt 2100 ]
}
