#!/bin/sh
# Extract DIR/bins.tar.xz (made by tools/device/pack.sh) into DIR on the
# device: tar with xz where the machine has it, else Python's tarfile.
set -eu
D=${1:?usage: unpack.sh DIR}
[ -f "$D/bins.tar.xz" ] || { echo "unpack: $D/bins.tar.xz is missing" >&2; exit 66; }
if command -v xz > /dev/null 2>&1; then
    tar xJf "$D/bins.tar.xz" -C "$D"
else
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$D/bins.tar.xz" "$D"
fi
chmod +x "$D"/kv-* "$D"/test_* 2>/dev/null || true
