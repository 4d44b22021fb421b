# shellcheck shell=bash
# Shared by the kv-tree reliability scripts: BIN (the tools), WORK (scratch),
# and make_dumps N: N .kvc dumps of stories260K whose prompts share
# beginnings (so puts split nodes), in $WORK/d1.kvc .. dN.kvc.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$ROOT/bin}
S260=$ROOT/tests/data/stories260K
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/kv-rel.XXXXXX")}
export OMP_NUM_THREADS=1 NO_COLOR=1
make_dumps() { # N [LONG]: LONG words of text after the shared beginning (default 12..60 in all)
    words="Once upon a time there was a little girl named Lily who loved to play outside in the park with her big red ball and her dog"
    i=1
    while [ "$i" -le "$1" ]; do
        # prompts of 12..60 words, each a prefix of the same text plus a tail;
        # with LONG, the dumps part after 6 words and run on for LONG more
        n=$((12 + (i * 7) % 48))
        p=$(echo "$words $words" | cut -d' ' -f1-$n)
        if [ -n "${2:-}" ]; then
            p="$(echo "$words" | cut -d' ' -f1-6) $i $(yes "$words" | head -n $(($2 / 25 + 1)) | tr '\n' ' ' | cut -d' ' -f$((i * 3))-$(($2 + i * 3)))"
        fi
        "$BIN/kv-run" -m "$S260/stories260K.bin" --tokenizer "$S260/tok512.bin" -p "$p tail $i" -n 0 \
            --dump-kv "$WORK/d$i.kvc" 2>/dev/null || { echo "dump $i failed" >&2; exit 1; }
        i=$((i + 1))
    done
}
check_ok() { # STORE: kv-tree check exits 0 and says ok
    "$BIN/kv-tree" check "$1" >"$WORK/check.json" 2>"$WORK/check.err" &&
        /usr/bin/python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$WORK/check.json"
}
head_tokens() { # N: $WORK/hI.txt = the tokens dI.kvc shares with the others, plus its first own one
    /usr/bin/python3 - "$WORK" "$1" <<'PY'
import json, struct, sys
work, n = sys.argv[1], int(sys.argv[2])
def toks(p):
    b = open(p, 'rb').read()
    (h,) = struct.unpack('<Q', b[:8])
    e = json.loads(b[8:8 + h])['tokens']
    s, t = e['data_offsets']
    d = b[8 + h + s:8 + h + t]
    return list(struct.unpack('<%di' % (len(d) // 4), d))
ts = [toks('%s/d%d.kvc' % (work, i)) for i in range(1, n + 1)]
k = 0
while all(len(t) > k and t[k] == ts[0][k] for t in ts): k += 1
for i, t in enumerate(ts, 1):
    open('%s/h%d.txt' % (work, i), 'w').write(' '.join(map(str, t[:k + 1])) + '\n')
PY
}
