# shellcheck shell=bash
# Shared by the kv-tree reliability scripts: BIN (the tools), WORK (scratch),
# and make_dumps N: N .kvc dumps of stories260K whose prompts share
# beginnings (so puts split nodes), in $WORK/d1.kvc .. dN.kvc.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$ROOT/bin}
S260=$ROOT/tests/data/stories260K
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/kv-rel.XXXXXX")}
export OMP_NUM_THREADS=1 NO_COLOR=1
make_dumps() {
    words="Once upon a time there was a little girl named Lily who loved to play outside in the park with her big red ball and her dog"
    i=1
    while [ "$i" -le "$1" ]; do
        # prompts of 12..60 words, each a prefix of the same text plus a tail
        n=$((12 + (i * 7) % 48))
        p=$(echo "$words $words" | cut -d' ' -f1-$n)
        "$BIN/kv-run" -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" -p "$p tail $i" -n 0 \
            --dump-kv "$WORK/d$i.kvc" 2>/dev/null || { echo "dump $i failed" >&2; exit 1; }
        i=$((i + 1))
    done
}
check_ok() { # STORE: kv-tree check exits 0 and says ok
    "$BIN/kv-tree" check "$1" >"$WORK/check.json" 2>"$WORK/check.err" &&
        /usr/bin/python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$WORK/check.json"
}
