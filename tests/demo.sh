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

section "3. Profile every layer and head (dense preference, quant and sparse errors)"
show 'kv-profile --json $WORK/story.kvc > $WORK/profile.json && kv-profile $WORK/story.kvc | head -n 20'

section "4. Quantize the layers the profile marks, in a pipeline"
show 'kv-quant --profile $WORK/profile.json $WORK/story.kvc | kv-info --json - | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print(\"K/V bytes\", j[\"kv_bytes\"], \"vs f16\", j[\"f16_kv_bytes\"], \"ratio\", round(j[\"ratio_vs_f16\"], 3))"'
show 'kv-quant --bits 2 --group 32 --residual 32 --report - $WORK/story.kvc -o $WORK/story-2bit.kvc | head -n 12'

section "5. Run with the deployment profile (per-layer quant / sparse policies)"
show 'kv-run -m $S/stories260K.bin --profile $WORK/profile.json --prompt "Once upon a time" -n 60'

section "6. Fidelity of each policy against the full cache (KL, top-1, perplexity)"
show 'kv-bench fidelity -m $S/stories260K.bin --tokenizer $S/tok512.bin --text $S/reference/greedy_bos_200.txt -P quant:bits=2 -P quant:bits=4 -P sparse:s=4,w=16,k=32 -P streaming:s=4,w=16 -P dsq --json'

section "7. Needle retrieval at 1k tokens on niah4k: full vs streaming vs TailorKV sparse (3% budget)"
show 'kv-bench ruler -m $N/niah4k.bin --tokenizer $N/tok259.bin --tasks $N/tasks-dev.jsonl -l 1024 --limit 5 -P full -P streaming -P sparse:frac=0.03 --json'

section "8. Share prefixes across requests (kv-tree)"
show 'kv-run -m $S/stories260K.bin --prompt "Once upon a time, there was a little girl named Lily" -n 0 --dump-kv $WORK/a.kvc'
show 'kv-run -m $S/stories260K.bin --prompt "Once upon a time, there was a little boy named Tim" -n 0 --dump-kv $WORK/b.kvc'
show 'kv-tree init $WORK/store && kv-tree put $WORK/store $WORK/a.kvc && kv-tree put $WORK/store $WORK/b.kvc'
show 'kv-tree ls $WORK/store | head -n 30'

section "Done"
echo "next: make check (all tests); docs/BENCHMARKS.md (every measured number); man -l man/kv-run.1"
