#!/bin/sh
# Session 15, issue 11, third call: the same machine, seed by seed, three
# builds or options interleaved, to tell a change from the machine: OLD
# (the session-14 pack, DIR1), NEW (this session's, DIR2, warmed) and
# NOWARM (DIR2 with --no-warm), on the widened niah4k for
# full,gpu,host,disk,disk-query (MODES).
# From the repository root:  OUT=DIR sh tools/device/lead-15c.sh DIR1 DIR2
set -u
OUT=${OUT:-/tmp/kv-out}
for sd in ${SEEDS:-1 2 3}; do
    SEEDS=$sd MODES=${MODES:-full,gpu,host,disk,disk-query} TAG=old STEPS=w BUDGET=100 sh tools/device/lead-9w.sh "$1"
    SEEDS=$sd MODES=${MODES:-full,gpu,host,disk,disk-query} TAG=new STEPS=w BUDGET=100 sh tools/device/lead-9w.sh "$2"
    SEEDS=$sd MODES=${MODES:-full,gpu,host,disk,disk-query} TAG=nowarm STEPS=w BUDGET=100 EXTRA=--no-warm sh tools/device/lead-9w.sh "$2"
done
tar czf "$OUT/lead15c.tgz" -C "$OUT/logs" . 2>/dev/null
