#!/bin/sh
# `make demo`: a short tour of kvtools on the bundled real model
# (tests/data/stories260K).  Each step is a section: a header, the command
# as a user would type it, and its output.  To add a step, call `section`
# then `show 'command line'`.  KV_BIN (set by the Makefile) holds the binaries.
set -eu
cd "$(dirname "$0")/.."
BIN=${KV_BIN:-$PWD/bin}
DATA=tests/data
KVC=$DATA/stories260K-prompt.kvc
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvtools-demo.XXXXXX")
trap 'rm -rf "$WORK"' EXIT INT TERM

if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then B=$(printf '\033[1m'); N=$(printf '\033[0m'); else B= N=; fi

section() { # title
    printf '\n%s== %s ==%s\n' "$B" "$*" "$N"
}

show() { # 'shell command line': print it as typed, then run it
    printf '$ %s\n' "$1"
    sh -c "$1"
}
PATH=$BIN:$PATH
export PATH KVC

section "kvtools $(kv-info --version | head -n 1 | cut -d' ' -f2): KV-cache tools for Llama-family models"
echo "binaries in $BIN; man pages in man/ (man -l man/kvc.5 for the file format)"

# The prompt's KV cache: the bundled file, or dumped now by kv-run.
if [ ! -f "$KVC" ] && [ -x "$BIN/kv-run" ]; then
    section "Dump the KV cache of a prompt to stories260K"
    KVC=$WORK/prompt.kvc
    export KVC
    show 'kv-run --model tests/data/stories260K/stories260K.bin --prompt "Once upon a time, there was a little girl named Lily" -n 0 --dump-kv "$KVC"'
fi

if [ -f "$KVC" ]; then
    section "Summarise the cache (.kvc) with kv-info"
    show 'kv-info "$KVC"'

    section "The same cache through zstd and a pipe, as JSON"
    show 'zstd -q -c "$KVC" | kv-info --json - | head -n 14'
else
    section "kv-info"
    echo "no $KVC yet (kv-run --dump-kv makes it); showing kv-info --help instead"
    show 'kv-info --help'
fi

section "Done"
echo "next: make check (all tests), man -l man/kv-info.1"
