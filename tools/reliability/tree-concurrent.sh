#!/bin/bash
# W concurrent writers (default 8) on one store, R rounds each (default 25):
# put, get (the prefix must come back), and now and then rm or gc.  Every
# command must succeed (the flock serialises them), and the store must
# check ok at the end.  Prints the counts; exit 1 on any failure.
#   tools/reliability/tree-concurrent.sh [W] [R]    (BIN=dir of the tools)
set -u
. "$(dirname "$0")/tree-common.sh"
W=${1:-8}
R=${2:-25}
make_dumps 8
S=$WORK/store
"$BIN/kv-tree" init "$S"
writer() { # id
    fails=0 cmds=0
    for _ in $(seq 1 "$R"); do
        d=$WORK/d$((1 + (RANDOM + $1) % 8)).kvc
        cmds=$((cmds + 2))
        "$BIN/kv-tree" put "$S" "$d" >/dev/null 2>>"$WORK/w$1.err" || fails=$((fails + 1))
        "$BIN/kv-tree" get "$S" --kvc "$d" -o "$WORK/g$1.kvc" --report "$WORK/g$1.json" 2>>"$WORK/w$1.err" ||
            fails=$((fails + 1))
        case $((RANDOM % 10)) in
        0) cmds=$((cmds + 1)); "$BIN/kv-tree" rm "$S" --kvc "$d" >/dev/null 2>>"$WORK/w$1.err" || fails=$((fails + 1)) ;;
        1) cmds=$((cmds + 1)); "$BIN/kv-tree" gc "$S" --max-bytes 200K >/dev/null 2>>"$WORK/w$1.err" || fails=$((fails + 1)) ;;
        esac
    done
    echo "$fails $cmds" >"$WORK/w$1.fails"
}
t0=$(date +%s)
for w in $(seq 1 "$W"); do writer "$w" & done
wait
fails=0 cmds=0
for w in $(seq 1 "$W"); do
    read -r f c <"$WORK/w$w.fails"
    fails=$((fails + f)) cmds=$((cmds + c))
done
ok=yes
check_ok "$S" || ok=no
echo "$W concurrent writers x $R rounds ($cmds kv-tree commands) in $(( $(date +%s) - t0 )) s:" \
     "$fails failed commands, final check ok: $ok"
[ "$fails" -gt 0 ] && head -n 5 "$WORK"/w*.err >&2
rm -rf "$WORK"
[ "$fails" -eq 0 ] && [ "$ok" = yes ]
