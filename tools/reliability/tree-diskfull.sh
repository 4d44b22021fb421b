#!/bin/bash
# A store on a full file system: a tmpfs of SIZE (default 2m) mounted on a
# scratch directory (needs root; says so and exits 77 otherwise).  Puts of
# new dumps until the disk is full: a failing put must exit 73 or 74 with a
# message, leave nothing half-written (no temp file, no index naming a
# missing chunk), and the store must check ok and still serve gets; gc then
# frees the space (evicting everything) and a put works again.  Prints the counts; exit 1 on a failure.
#   tools/reliability/tree-diskfull.sh [SIZE]    (BIN=dir of the tools)
set -u
. "$(dirname "$0")/tree-common.sh"
SIZE=${1:-2m}
make_dumps 30
M=$WORK/mnt
mkdir -p "$M"
if ! mount -t tmpfs -o size="$SIZE" tmpfs "$M" 2>"$WORK/mount.err"; then
    echo "cannot mount a tmpfs: $(cat "$WORK/mount.err")" >&2
    rm -rf "$WORK"
    exit 77
fi
S=$M/store
"$BIN/kv-tree" init "$S"
ok=0 full=0 bad=0 codes=""
for i in $(seq 1 30); do
    "$BIN/kv-tree" put "$S" "$WORK/d$i.kvc" --tier host >/dev/null 2>"$WORK/put.err"
    rc=$?
    if [ "$rc" -eq 0 ]; then
        ok=$((ok + 1))
        continue
    fi
    full=$((full + 1))
    codes="$codes $rc"
    case $rc in 73 | 74) ;; *) bad=$((bad + 1)); echo "put $i: exit $rc: $(cat "$WORK/put.err")" >&2 ;; esac
    [ -s "$WORK/put.err" ] || { bad=$((bad + 1)); echo "put $i failed without a message" >&2; }
    [ -n "${msg:-}" ] || msg=$(head -n 1 "$WORK/put.err")
    check_ok "$S" || { bad=$((bad + 1)); echo "after put $i: $(cat "$WORK/check.err")" >&2; }
    # nothing half-written: no temp files anywhere in the store
    if find "$S" -name '.*.XXXXXX' -o -name '.index.json.*' -o -name '.c*.kvc.*' | grep -q .; then
        bad=$((bad + 1)); echo "after put $i: temp files left" >&2
    fi
    "$BIN/kv-tree" get "$S" --kvc "$WORK/d1.kvc" -o /dev/null 2>/dev/null || { bad=$((bad + 1)); echo "get failed on a full disk" >&2; }
done
used=$(df -k "$M" | awk 'NR == 2 { print $3 }')
# the last bytes taken by a filler: commands that only rewrite the index
# (a get counting its hit, place, rm) now fail at the index write
head -c 10M /dev/zero >"$M/filler" 2>/dev/null
idx=""
"$BIN/kv-tree" get "$S" --kvc "$WORK/d2.kvc" -o /dev/null 2>"$WORK/get.err"; idx="$idx get:$?"
"$BIN/kv-tree" place "$S" --gpu-bytes 1K --host-bytes 0 >/dev/null 2>>"$WORK/get.err"; idx="$idx place:$?"
"$BIN/kv-tree" rm "$S" --kvc "$WORK/d3.kvc" >/dev/null 2>>"$WORK/get.err"; idx="$idx rm:$?"
check_ok "$S" || { bad=$((bad + 1)); echo "after the index writes: $(cat "$WORK/check.err")" >&2; }
if find "$S" -name '.index.json.*' -o -name '.c*.kvc.*' | grep -q .; then
    bad=$((bad + 1)); echo "temp files left by the index writes" >&2
fi
imsg=$(head -n 1 "$WORK/get.err")
rm -f "$M/filler"
"$BIN/kv-tree" gc "$S" --max-bytes 0 >/dev/null || bad=$((bad + 1))
"$BIN/kv-tree" put "$S" "$WORK/d30.kvc" --tier host >/dev/null 2>&1 && after=yes || after=no
check_ok "$S" || bad=$((bad + 1))
umount "$M"
echo "full disk ($SIZE tmpfs): $ok puts fitted, $full failed (exit codes:$codes; first message: ${msg:-none})," \
     "${used} KiB used when full; after each failure the store checked ok and served a get;" \
     "with the last bytes filled, index-only writes exit${idx} (first message: ${imsg:-none}), store checks ok;" \
     "after gc a put succeeds: $after; failures: $bad"
rm -rf "$WORK"
[ "$bad" -eq 0 ] && [ "$after" = yes ]
