#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention on kv-bench attn's shapes, for comparison.

Decode attention (query length 1), fp16, batch 1, one layer, 32 query heads,
8 KV heads, head dim 128, contexts 8k/32k/128k.  GQA two ways: enable_gqa=True
on the 8-head K/V, and K/V repeated to 32 heads beforehand (the repeat is not
timed; the kernel then reads 4x the bytes).  Timed with CUDA events over many
calls, rotating input copies so that they exceed L2 four times, median of 7.
Bytes are counted as kv-bench counts them: the 8-head fp16 K and V.  Prints JSON.
"""
import json
import sys

import torch
import torch.nn.functional as F


def time_calls(fn, copies, iters=200, reps=7):
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for i in range(iters):
            fn(i % copies)
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) / iters * 1e-3)
    out.sort()
    return out[len(out) // 2]


def main():
    heads, kvh, d = 32, 8, 128
    ctxs = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [8192, 32768, 131072]
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "contexts": []}
    for T in ctxs:
        kv_bytes = 2 * kvh * T * d * 2
        copies = max(1, min(64, -(-4 * l2 // kv_bytes)))
        q = torch.randn(1, heads, 1, d, device=dev, dtype=torch.float16)
        ks = [torch.randn(1, kvh, T, d, device=dev, dtype=torch.float16) for _ in range(copies)]
        vs = [torch.randn(1, kvh, T, d, device=dev, dtype=torch.float16) for _ in range(copies)]
        row = {"T": T, "copies": copies, "bytes": kv_bytes}
        try:
            s = time_calls(lambda i: F.scaled_dot_product_attention(q, ks[i], vs[i], enable_gqa=True), copies)
            row["enable_gqa"] = {"us": s * 1e6, "bytes_per_s": kv_bytes / s}
        except Exception as e:  # noqa: BLE001 - report whatever the backend says
            row["enable_gqa"] = {"error": str(e)[:200]}
        rcopies = max(1, min(copies, 4))
        kr = [k.repeat_interleave(heads // kvh, dim=1) for k in ks[:rcopies]]
        vr = [v.repeat_interleave(heads // kvh, dim=1) for v in vs[:rcopies]]
        try:
            s = time_calls(lambda i: F.scaled_dot_product_attention(q, kr[i], vr[i]), rcopies)
            row["repeat_kv"] = {"us": s * 1e6, "bytes_per_s": kv_bytes / s, "copies": rcopies}
        except Exception as e:  # noqa: BLE001
            row["repeat_kv"] = {"error": str(e)[:200]}
        res["contexts"].append(row)
        del ks, vs, kr, vr
        torch.cuda.empty_cache()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
