#!/bin/sh
# Install the Debian packages the build and the tests need, when missing.
# As root, install them; otherwise print the exact apt-get line and fail.
#   libclang-rt-dev: libFuzzer and the sanitizer runtimes for clang (only
#   "Recommended" by clang, so absent where recommends are not installed);
#   zstd: the CLI the tests pipe through; python3-numpy: the interop and
#   quantizer checks (/usr/bin/python3); python3-jieba: jieba 0.42's
#   dictionary and HMM tables (read as data by lib/eval/kv_jieba, never
#   imported), which LongBench's Chinese metrics segment with -- without them
#   kv-bench score/longbench cannot score multifieldqa_zh, dureader and
#   vcsum, and their tests skip.
pkgs="build-essential libzstd-dev libcjson-dev bats bats-assert bats-support clang libclang-rt-dev python3 python3-numpy python3-jieba zstd"
if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "deps: not a Debian system; install the equivalents of: $pkgs" >&2
    exit 1
fi
missing=""
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    echo "deps: installing$missing" >&2
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing; } >&2 || {
        echo "deps: apt-get install failed" >&2; exit 1; }
else
    echo "deps: missing packages; run as root:" >&2
    echo "  apt-get install -y$missing" >&2
    exit 1
fi
