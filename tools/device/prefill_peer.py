#!/usr/bin/env python3
"""The PyTorch peer of `kv-bench prefill`: a plain dense causal prefill.

Synthetic Llama-3.1-8B geometry (dim 4096, FFN 14336, 32 query heads, 8 KV
heads, head_dim 128, 32 layers, RoPE theta 500000 with Llama-3 frequency
scaling), bf16, batch 1, random weights (one layer's set read by every layer,
as kv-bench prefill does: the compute and bytes of the real geometry), the
whole prompt through each layer in turn: RMSNorm, the fused QKV projection by
torch.matmul (cuBLAS), RoPE, scaled_dot_product_attention(is_causal=True,
enable_gqa=True), the output projection and residual, RMSNorm, the fused
gate/up projection, SiLU * up, the down projection and residual.  Reads
nothing but torch.  Timed with CUDA events: one warm-up, then the median of
--reps runs.  Also the bf16 GEMM rate (8192^3, random data, mean of 10 after
3 warm-ups) of the same run, as the ceiling.  Prints JSON.

    python3 tools/device/prefill_peer.py [--contexts 8192,32768,131072] [--reps 3]
    python3 tools/device/prefill_peer.py --sdpa-only [--contexts 32768,131072]

--sdpa-only times the attention alone (one layer's shapes, fp16 and bf16,
the median of --reps runs of 3 calls each after a warm-up), as kv-bench
prefill's "alone" figure does for kvtools' kernel, and skips the prefill.
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F


def llama3_inv_freq(hd, theta=500000.0, factor=8.0, lo=1.0, hi=4.0, orig=8192):
    inv = []
    for i in range(hd // 2):
        f = 1.0 / (theta ** (2 * i / hd))
        wl = 2 * math.pi / f
        if wl > orig / lo:
            f = f / factor
        elif wl >= orig / hi:
            s = (orig / wl - lo) / (hi - lo)
            f = (1 - s) * f / factor + s * f
        inv.append(f)
    return torch.tensor(inv, dtype=torch.float32)


def rope(x, cos, sin):
    """Interleaved pairs (x0, x1) rotated, as kvtools does; x (1, H, T, hd)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return y.flatten(-2)


def gemm_ceiling(dev, n=8192):
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        a @ b
    e1.record()
    e1.synchronize()
    s = e0.elapsed_time(e1) / 10 * 1e-3
    return 2 * n ** 3 / s / 1e12


def sdpa_only(dev, args):
    H, G, hd = 32, 8, 128
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "contexts": []}
    for T in [int(t) for t in args.contexts.split(",")]:
        row = {"T": T}
        for name, dt in (("f16", torch.float16), ("bf16", torch.bfloat16)):
            q = torch.randn(1, H, T, hd, device=dev, dtype=dt)
            k = torch.randn(1, G, T, hd, device=dev, dtype=dt)
            v = torch.randn(1, G, T, hd, device=dev, dtype=dt)
            with torch.inference_mode():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                torch.cuda.synchronize()
                ts = []
                for _ in range(max(args.reps, 1)):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(3):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    e1.record()
                    e1.synchronize()
                    ts.append(e0.elapsed_time(e1) / 3)
            ts.sort()
            ms = ts[len(ts) // 2]
            row[name] = {"ms": ms, "ms_all": ts, "tflops": 4.0 * T * T * H * hd / 2 / (ms * 1e-3) / 1e12}
            del q, k, v
            torch.cuda.empty_cache()
        res["contexts"].append(row)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--sdpa-only", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.sdpa_only:
        print(json.dumps(sdpa_only(dev, args), indent=2))
        return
    dt = torch.bfloat16
    D, Hd, H, G, hd, L = 4096, 14336, 32, 8, 128, args.layers
    qd, kvd = H * hd, G * hd
    torch.manual_seed(1)
    wqkv = (torch.randn(qd + 2 * kvd, D, device=dev) / math.sqrt(D)).to(dt)
    wo = (torch.randn(D, qd, device=dev) / math.sqrt(qd)).to(dt)
    wgu = (torch.randn(2 * Hd, D, device=dev) / math.sqrt(D)).to(dt)
    wdn = (torch.randn(D, Hd, device=dev) / math.sqrt(Hd)).to(dt)
    nw = torch.ones(D, device=dev, dtype=dt)
    inv = llama3_inv_freq(hd).to(dev)
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "model": "llama-3.1-8b geometry (synthetic)", "layers": L, "dtype": "bf16",
           "gemm_n": 8192, "gemm_tflops": gemm_ceiling(dev), "contexts": []}

    def prefill(x, cos, sin):
        T = x.shape[0]
        for _ in range(L):
            h = F.rms_norm(x, (D,), nw, 1e-5)
            qkv = torch.matmul(h, wqkv.t())
            q = qkv[:, :qd].view(T, H, hd).transpose(0, 1).unsqueeze(0)
            k = qkv[:, qd:qd + kvd].view(T, G, hd).transpose(0, 1).unsqueeze(0)
            v = qkv[:, qd + kvd:].view(T, G, hd).transpose(0, 1).unsqueeze(0)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + torch.matmul(a.squeeze(0).transpose(0, 1).reshape(T, qd), wo.t())
            h = F.rms_norm(x, (D,), nw, 1e-5)
            gu = torch.matmul(h, wgu.t())
            x = x + torch.matmul(F.silu(gu[:, :Hd]) * gu[:, Hd:], wdn.t())
        return x

    for T in [int(t) for t in args.contexts.split(",")]:
        row = {"T": T}
        try:
            pos = torch.arange(T, device=dev, dtype=torch.float32)
            ang = pos[:, None] * inv[None, :]
            cos, sin = ang.cos().to(dt), ang.sin().to(dt)
            x0 = torch.randn(T, D, device=dev, dtype=dt)
            torch.cuda.reset_peak_memory_stats()
            with torch.inference_mode():
                prefill(x0, cos, sin)
                torch.cuda.synchronize()
                ts = []
                for _ in range(args.reps):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    out = prefill(x0, cos, sin)
                    e1.record()
                    e1.synchronize()
                    ts.append(e0.elapsed_time(e1))
            ts.sort()
            ms = ts[len(ts) // 2]
            row.update({"prefill_ms": ms, "prefill_ms_all": ts, "tokens_per_s": T / (ms * 1e-3),
                        "finite": bool(torch.isfinite(out.float()).all().item()),
                        "peak_bytes": torch.cuda.max_memory_allocated()})
            # the attention alone, one layer's shapes, for its TFLOP/s
            q = torch.randn(1, H, T, hd, device=dev, dtype=dt)
            k = torch.randn(1, G, T, hd, device=dev, dtype=dt)
            v = torch.randn(1, G, T, hd, device=dev, dtype=dt)
            with torch.inference_mode():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(5):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                e1.record()
                e1.synchronize()
            s = e0.elapsed_time(e1) / 5 * 1e-3
            row["sdpa_ms"] = s * 1e3
            row["sdpa_tflops"] = 4.0 * T * T * H * hd / 2 / s / 1e12
            del q, k, v, x0, out
        except Exception as e:  # noqa: BLE001 - report whatever failed (e.g. out of memory)
            row["error"] = str(e)[:300]
        torch.cuda.empty_cache()
        res["contexts"].append(row)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
