#!/usr/bin/env python3
"""Short table from the JSON that run-kernels.sh leaves in $OUT (attn, pack, sdpa)."""
import json
import os
import sys

out = sys.argv[1]


def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001
        print(f"{name}: {e}")
        return None


a, p, s = load("attn.json"), load("pack.json"), load("sdpa.json")
if a:
    copy = a["copy_bytes_per_s"]
    print(f"{a['device']['name']} driver {a['device']['driver']} copy {copy/1e9:.0f} GB/s {a['date']}")
    for c in a["contexts"]:
        for k in ("f16", "kivi1", "kivi2"):
            r = c[k]
            if r:
                print(f"T={c['T']:>6} {k:>5} {r['us']:9.2f} us {r['bytes_per_s']/1e9:7.0f} GB/s "
                      f"{100*r['frac_of_copy']:5.1f}% x{r['speedup_vs_f16']:5.2f} err {r.get('err_vs_cpu', -1):.2e}")
    for k, v in a["targets"].items():
        print(f"target {k}: {v['value']:.3f} (>= {v['target']}) {'met' if v['met'] else 'NOT met'}")
if p:
    for r in p["results"]:
        print(f"pack {r['bits']}-bit: GPU {r.get('gpu_us', 0):.1f} us {100*r.get('gpu_frac_of_copy', 0):.1f}% of copy; "
              f"CPU 1 thread {r['cpu_1thread_input_bytes_per_s']/1e9:.2f} GB/s, all {r['cpu_all_threads_input_bytes_per_s']/1e9:.2f} GB/s")
if s and a:
    for c, sc in zip(a["contexts"], s["contexts"]):
        for k in ("enable_gqa", "repeat_kv"):
            if "us" in sc.get(k, {}):
                print(f"sdpa {k} T={sc['T']}: {sc[k]['us']:.2f} us, ours/sdpa time {c['f16']['us']/sc[k]['us']:.3f}")
