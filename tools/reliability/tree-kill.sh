#!/bin/bash
# kill -9 during kv-tree put, N times (default 150): each put is killed at
# a random moment within the time a put takes, then the store must check
# ok (the index committed atomically, only complete chunks named); every
# 10 kills, gc must remove what the kills left (orphan chunks, index temp
# files) and an unkilled put must succeed.  Prints the counts; exit 1 on
# any inconsistent store.
#   tools/reliability/tree-kill.sh [N]    (BIN=dir of the tools, default bin/)
set -u
. "$(dirname "$0")/tree-common.sh"
N=${1:-150}
make_dumps 8 300 # 300 more words: a put writes ~0.4 MB and compresses it
head_tokens 8
S=$WORK/store
"$BIN/kv-tree" init "$S"
"$BIN/kv-tree" put "$S" "$WORK/d1.kvc" >/dev/null
for i in 2 3 4 5 6 7 8; do "$BIN/kv-tree" put "$S" "$WORK/d$i.kvc" --zstd 19 >/dev/null; done
# how long a put of a removed suffix takes here (ms), to aim the kills inside it
put_ms=0
for i in 2 5 8; do
    "$BIN/kv-tree" rm "$S" --tokens "$WORK/h$i.txt" >/dev/null
    t0=$(date +%s%N)
    "$BIN/kv-tree" put "$S" "$WORK/d$i.kvc" --zstd 19 >/dev/null
    put_ms=$((put_ms + ($(date +%s%N) - t0) / 3000000))
done
put_ms=$((put_ms + 1))
# and of a put that only touches the index (everything already cached)
t0=$(date +%s%N)
for i in 2 5 8; do "$BIN/kv-tree" put "$S" "$WORK/d$i.kvc" >/dev/null; done
touch_ms=$(( ($(date +%s%N) - t0) / 3000000 + 1 ))
killed=0 finished=0 bad=0 orphans=0 temps=0
for k in $(seq 1 "$N"); do
    j=$((1 + RANDOM % 8))
    d=$WORK/d$j.kvc
    # odd kills: remove what follows this dump's first own token, so the put
    # writes a chunk and the index; even ones: a put that rewrites the index only
    ms=$touch_ms
    if [ $((k % 2)) -eq 1 ]; then
        "$BIN/kv-tree" rm "$S" --tokens "$WORK/h$j.txt" >/dev/null 2>&1
        ms=$put_ms
    fi
    "$BIN/kv-tree" put "$S" "$d" --zstd 19 >/dev/null 2>&1 &
    pid=$!
    sleep "$(awk -v r=$RANDOM -v m="$ms" 'BEGIN { printf "%.4f", r / 32768 * m / 1000 }')"
    if kill -9 "$pid" 2>/dev/null; then killed=$((killed + 1)); else finished=$((finished + 1)); fi
    wait "$pid" 2>/dev/null
    if ! check_ok "$S"; then
        bad=$((bad + 1))
        echo "kill $k: store inconsistent: $(cat "$WORK/check.err")" >&2
    fi
    # checks that saw a kill's leftovers: orphan chunks, index temp files
    read -r o t < <(/usr/bin/python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j["orphans"], j.get("temp_files", 0))' "$WORK/check.json" 2>/dev/null || echo 0 0)
    [ "$o" -gt 0 ] && orphans=$((orphans + 1))
    [ "$t" -gt 0 ] && temps=$((temps + 1))
    if [ $((k % 10)) -eq 0 ]; then
        "$BIN/kv-tree" gc "$S" --max-bytes 1G >/dev/null || bad=$((bad + 1))
        "$BIN/kv-tree" put "$S" "$d" >/dev/null || bad=$((bad + 1))
        check_ok "$S" || bad=$((bad + 1))
    fi
done
"$BIN/kv-tree" gc "$S" --max-bytes 1G >"$WORK/gc.json" || bad=$((bad + 1))
check_ok "$S" || bad=$((bad + 1))
left=$(/usr/bin/python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j["orphans"], j.get("temp_files", 0))' "$WORK/check.json")
echo "kill -9 during put: $N puts (a put takes ~${put_ms} ms here, one that only rewrites the index ~${touch_ms} ms)," \
     "$killed killed mid-run, $finished had finished;" \
     "inconsistent stores: $bad; checks that reported orphan chunks: $orphans, index temp files: $temps (not damage: gc removes them);" \
     "after the final gc: $left (orphans, temp files)"
rm -rf "$WORK"
[ "$bad" -eq 0 ]
