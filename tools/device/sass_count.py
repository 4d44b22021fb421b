#!/usr/bin/env python3
"""Static SASS opcode counts per kernel (stdin: cuobjdump --dump-sass), for
kernels whose mangled name contains argv[1]: the instruction-count predictor
of docs/BENCHMARKS.md (Kernels).  Prints total, HMMA, LDS, PRMT, LOP3, SHF, SHFL,
MUFU, and the twelve most frequent opcodes."""
import collections
import re
import sys

pat = sys.argv[1] if len(sys.argv) > 1 else ""
name, counts = None, {}
for line in sys.stdin:
    m = re.match(r"\s+Function : (\S+)", line)
    if m:
        name = m.group(1) if pat in m.group(1) else None
        if name:
            counts[name] = collections.Counter()
        continue
    if name:
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
        if m:
            counts[name][m.group(1)] += 1
for n, c in counts.items():
    tot = sum(c.values())
    key = " ".join(f"{k} {c[k]}" for k in ("HMMA", "LDS", "LDSM", "PRMT", "LOP3", "SHF", "SHFL", "MUFU", "FFMA", "FMUL", "F2FP", "HMUL2", "STS", "LDGSTS", "BAR"))
    print(f"{n}: total {tot}; {key}")
    print("   top:", ", ".join(f"{k} {v}" for k, v in c.most_common(12)))
