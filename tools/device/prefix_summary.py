#!/usr/bin/env python3
"""A kv-bench prefix JSON, for a device call's summary: per mode the
medians, speed-up and accuracy, then per request (after the first) the TTFT,
load, rows reused, answer, prefill phases and the query-aware parts.
Usage: prefix_summary.py FILE.json [--modes-only]"""
import json
import sys


def main():
    try:
        d = json.load(open(sys.argv[1]))
    except Exception as e:  # a cut-short run leaves no JSON: say so, do not fail the call
        print("no JSON:", e)
        return
    rnd = lambda v, n=3: None if v is None else round(v, n)
    for m, s in d["summary"].items():
        print("%-15s n=%d ttft=%s load=%s speedup=%s acc=%s" % (m, s["requests"], rnd(s["ttft_ms_median"]),
              rnd(s["load_ms_median"]), rnd(s["speedup_vs_full"], 2), s["accuracy"]))
    if "--modes-only" in sys.argv:
        return
    r3 = lambda x: {k: round(v, 3) for k, v in x.items()}
    for r in d["requests"]:
        if r["request"] == 0:
            continue
        print("  r%d %-14s ttft %7.3f load %7.3f reused %5d ok %s pf %s" % (r["request"], r["mode"], r["ttft_ms"],
              r["load_ms"], r["reused_tokens"], r["correct"], r3(r.get("prefill_phases_ms", {}))))
        if r.get("rows_beside_ms"):
            print("      rows beside the prefill %s" % r3(r["rows_beside_ms"]))
        if "query_aware_ms" in r:
            print("      qa %s probe-pf %s" % (r3(r["query_aware_ms"]), r3(r.get("probe_prefill_phases_ms", {}))))


main()
