#!/bin/sh
# `make demo`: the toolkit's main job on the bundled real models, in the
# order a deployment would go: generate, dump a prompt's KV cache, profile
# its layers, quantize what the profile marks, run with the profile, measure
# each policy's fidelity, retrieve needles from a long context with full,
# streaming and TailorKV-sparse caches, and share prefixes in kv-tree.
# Each step prints a header, the command as a user would type it, and its
# output.  KV_BIN (set by the Makefile) holds the binaries.
set -eu
cd "$(dirname "$0")/.."
BIN=${KV_BIN:-$PWD/bin}
S=tests/data/stories260K
N=tests/data/niah4k
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvtools-demo.XXXXXX")
trap 'rm -rf "$WORK"' EXIT INT TERM
export S N WORK

if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then B=$(printf '\033[1m'); R=$(printf '\033[0m'); else B= R=; fi

section() { # title
    printf '\n%s== %s ==%s\n' "$B" "$*" "$R"
}

show() { # 'shell command line': print it as typed, then run it
    printf '$ %s\n' "$1"
    sh -c "$1"
}
PATH=$BIN:$PATH
export PATH

section "kvtools $(kv-info --version | head -n 1 | cut -d' ' -f2): KV-cache tools for Llama-family models"
echo "binaries in $BIN; man pages in man/ (man -l man/kvc.5 for the file format)"
kv-run --version | sed -n '3,4p'

section "1. Generate with the real stories260K model (full cache), with a report"
show 'kv-run -m $S/stories260K.bin --prompt "Once upon a time" -n 60 --report $WORK/report.json'
/usr/bin/python3 - "$WORK/report.json" <<'EOF' 2>/dev/null || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"   {r['generated_tokens']} tokens, {r['ms_per_token_median']:.3f} ms/token median, "
      f"KV resident {r['kv_bytes']['gpu']} bytes")
EOF

section "2. Dump the KV cache of a prompt (.kvc: safetensors + geometry + checksums)"
show 'kv-run -m $S/stories260K.bin --prompt-file $S/reference/greedy_bos_200.txt -n 0 --kv-dtype f16 --dump-kv $WORK/story.kvc'
show 'kv-info $WORK/story.kvc | head -n 20'

section "3. Profile every layer and head (dense preference, error and bytes of each option)"
echo "   (stories260K's head dim is 8: every packed layout carries its scales at a high rate, so"
echo "    0.42 of full's fp16 bytes is the least that keeps KL <= 0.01; the 0.25 default fits"
echo "    head dims of 64 and more, docs/BENCHMARKS.md)"
show 'kv-profile --kv-budget 0.45 --json $WORK/story.kvc > $WORK/profile.json'
/usr/bin/python3 - "$WORK/profile.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
# the options this profile measured (one left out reports null errors)
errs = [e for e in j["layers"][0] if e.startswith("err_") and any(l[e] is not None for l in j["layers"])]
print("   layer  score  " + " ".join(f"{e[4:]:>10}" for e in errs) + "  chosen")
for l in j["layers"]:
    print(f"   {l['layer']:5d}  {l['score']:.3f}  " + " ".join(f"{l[e]:10.4f}" if l[e] is not None else f"{'-':>10}" for e in errs) +
          f"  {l['choice']} ({l['bytes'][l['choice']] / l['bytes']['full']:.2f} of full)")
c = j["choice"]
print(f"   chosen: {c['kv_bytes']} of {c['full_bytes']} fp16 bytes ({c['ratio']:.3f}), budget met: {c['budget_met']}")
EOF

section "4. Quantize the layers the profile marks, in a pipeline"
show 'kv-quant --profile $WORK/profile.json $WORK/story.kvc | kv-info --json - | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print(\"K/V bytes\", j[\"kv_bytes\"], \"vs f16\", j[\"f16_kv_bytes\"], \"ratio\", round(j[\"ratio_vs_f16\"], 3))"'
show 'kv-quant --bits 2 --group 32 --residual 32 --report - $WORK/story.kvc -o $WORK/story-2bit.kvc | head -n 12'

section "5. Continue the 202-token story with the deployment profile and with each policy"
echo "   (the prompt is longer than quant's 128-token fp16 window, so every policy packs,"
echo "    drops or offloads part of it: resident KV bytes and the continuation change)"
show 'kv-run -m $S/stories260K.bin --profile $WORK/profile.json --prompt-file $S/reference/greedy_bos_200.txt -n 40 --report $WORK/run-profile.json | tail -n 3'
show 'for p in full quant:bits=2 quant:bits=2,residual=0 quant:bits=4,residual=0 dsq sparse:s=4,w=16,k=32 streaming:s=4,w=16; do kv-run -m $S/stories260K.bin -P $p --prompt-file $S/reference/greedy_bos_200.txt -n 40 --report "$WORK/run-$p.json" > /dev/null; done'
/usr/bin/python3 - "$WORK" <<'EOF'
import json, os, sys
work = sys.argv[1]
runs = ["full", "quant:bits=2", "quant:bits=2,residual=0", "quant:bits=4,residual=0", "dsq",
        "sparse:s=4,w=16,k=32", "streaming:s=4,w=16", "profile"]
rep = {p: json.load(open(os.path.join(work, f"run-{p}.json"))) for p in runs}
full = rep["full"]
fb = full["kv_bytes"]["gpu"]
print(f"   {'policy':<24} {'resident KV':>11} {'of full':>7}   continuation ('=': the same tokens as full; ...: from where it departs)")
for p in runs:
    r = rep[p]
    b = r["kv_bytes"]["gpu"]
    same = "=" if r["generated_ids"] == full["generated_ids"] else " "
    text = r["text"].replace("\n", " ")
    ref = full["text"].replace("\n", " ")
    cp = next((i for i, (a, b) in enumerate(zip(text, ref)) if a != b), min(len(text), len(ref)))
    # from a little before the first character that differs from full's
    text = text[:52] if cp < 24 or same == "=" else "..." + text[cp - 20:cp + 29]
    host = f"  (+{r['kv_bytes']['host']} B host)" if r["kv_bytes"]["host"] else ""
    print(f"   {p:<24} {b:>11} {b / fb:>7.2f} {same} {text}{host}")
EOF
echo "   (bytes: the CPU engine's f32 cache; the sparse policy keeps its full copy in host memory)"

section "6. Fidelity of each policy against the full cache (KL, top-1, perplexity)"
show 'kv-bench fidelity -m $S/stories260K.bin --tokenizer $S/tok512.bin --text $S/reference/greedy_bos_200.txt -P quant:bits=2 -P quant:bits=4 -P sparse:s=4,w=16,k=32 -P streaming:s=4,w=16 -P dsq --json'

section "7. Needle retrieval at 1k tokens on niah4k: full vs streaming vs TailorKV sparse (3% budget)"
show 'kv-bench ruler -m $N/niah4k.bin --tokenizer $N/tok259.bin --tasks $N/tasks-dev.jsonl -l 1024 --limit 3 -P full -P streaming -P sparse:frac=0.03 --json'

section "8. Share prefixes across requests (kv-tree)"
show 'kv-run -m $S/stories260K.bin --prompt "Once upon a time, there was a little girl named Lily" -n 0 --dump-kv $WORK/a.kvc'
show 'kv-run -m $S/stories260K.bin --prompt "Once upon a time, there was a little boy named Tim" -n 0 --dump-kv $WORK/b.kvc'
show 'kv-tree init $WORK/store && kv-tree put $WORK/store $WORK/a.kvc && kv-tree put $WORK/store $WORK/b.kvc'
show 'kv-tree ls $WORK/store | head -n 30'

section "Done"
echo "next: make check (all tests); docs/BENCHMARKS.md (every measured number); man -l man/kv-run.1"
