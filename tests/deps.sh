#!/bin/sh
# Install the Debian packages the build and the tests need, when missing.
# As root, install them; otherwise print the exact apt-get line and fail.
pkgs="build-essential libzstd-dev libcjson-dev bats bats-assert bats-support clang python3-numpy zstd"
missing=""
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    echo "deps: installing$missing" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 && apt-get install -y -qq $missing >&2 || {
        echo "deps: apt-get install failed" >&2; exit 1; }
else
    echo "deps: missing packages; run as root:" >&2
    echo "  apt-get install -y$missing" >&2
    exit 1
fi
