#!/bin/sh
# round 5 of helper B10: tools/device/b10-check.sh with STEPS=tkfqlh
STEPS=${STEPS:-tkfqlh} TTIME=40 HTIME=50 HCAP=12 exec sh "$1/b10.sh" "$@"
