#!/usr/bin/python3
"""Independent check of kv-quant's packed layouts (lib/kv_layout.h, man/kvc.5).

A plain numpy re-implementation of the KIVI and DSQ formulas, written from
the layout text, not from the C code: it writes random .kvc caches (and,
when kv-run is built, a real cache dumped from tests/data/stories260K),
runs kv-quant on them, then
  * re-encodes the original K/V with numpy and requires the packed parts
    (codes, scales, zeros, residual; DSQ mask-driven parts) to be identical,
  * decodes the packed parts with numpy and requires kv-quant --decode to
    give the same values (after its fp16 rounding).
Prints TAP; exit status 0 when every check passes.

usage: quant_check.py BINDIR [WORKDIR]
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

BIN = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "../../bin")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
DT = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I8": np.int8, "I32": np.int32,
      "BF16": np.uint16}

# ---- .kvc (safetensors) reader and writer ---------------------------------


def read_kvc(path):
    with open(path, "rb") as f:
        buf = f.read()
    n = struct.unpack("<Q", buf[:8])[0]
    hdr = json.loads(buf[8:8 + n])
    meta = hdr.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, t in hdr.items():
        a, b = t["data_offsets"]
        arr = np.frombuffer(buf[base + a:base + b], dtype=DT[t["dtype"]]).reshape(t["shape"])
        if t["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr
    return out, meta


def write_kvc(path, tensors, meta):
    hdr, off, blobs = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        dt = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
              np.dtype(np.int32): "I32"}[arr.dtype]
        hdr[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
        blobs.append(arr.tobytes())
        off += arr.nbytes
    if meta:
        hdr["__metadata__"] = meta
    h = json.dumps(hdr).encode()
    h += b" " * ((-(8 + len(h))) % 64)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


# ---- the formulas ----------------------------------------------------------


def asym_quant(x, axis, bits):
    """KIVI group quantization of x along axis: returns codes, scale, zero (fp16)."""
    maxq = np.float32(2 ** bits - 1)
    mn = x.min(axis=axis, keepdims=True)
    mx = x.max(axis=axis, keepdims=True)
    scale = ((mx - mn) / maxq).astype(np.float16)
    zero = mn.astype(np.float16)
    s = scale.astype(np.float32)
    z = zero.astype(np.float32)
    ok = (s > 0) & np.isfinite(s)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.rint((x - z) / np.where(ok, s, np.float32(1)))
    c = np.where(ok, np.clip(c, 0, maxq), 0).astype(np.uint8)
    return c, scale, zero


def pack_bits(codes, bits):
    """codes (..., D) -> bytes (..., D*bits/8), LSB first."""
    per = 8 // bits
    c = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // per, per)).astype(np.uint16)
    shifts = (np.arange(per) * bits).astype(np.uint16)
    return (c << shifts).sum(axis=-1).astype(np.uint8)


def unpack_bits(packed, bits, D):
    per = 8 // bits
    shifts = (np.arange(per) * bits).astype(np.uint8)
    c = (packed[..., None] >> shifts) & np.uint8(2 ** bits - 1)
    return c.reshape(packed.shape[:-1] + (D,))


def kivi_encode(x, which, bits, G, R):
    H, T, D = x.shape
    nq = max(T - R, 0) // G * G
    xq = x[:, :nq]
    if which == "k":
        g = xq.reshape(H, nq // G, G, D)
        c, s, z = asym_quant(g, 2, bits)
        codes = c.reshape(H, nq, D)
        s, z = s.reshape(H, nq // G, D), z.reshape(H, nq // G, D)
    else:
        gv = min(G, D)
        g = xq.reshape(H, nq, D // gv, gv)
        c, s, z = asym_quant(g, 3, bits)
        codes = c.reshape(H, nq, D)
        s, z = s.reshape(H, nq, D // gv), z.reshape(H, nq, D // gv)
    return {"codes": pack_bits(codes, bits), "scale": s, "zero": z,
            "resid": x[:, nq:].astype(np.float16)}


def kivi_decode(p, which, bits, G, T, D):
    codes = unpack_bits(p["codes"], bits, D).astype(np.float32)
    H, nq = codes.shape[:2]
    s = p["scale"].astype(np.float32)
    z = p["zero"].astype(np.float32)
    if which == "k":
        s, z = np.repeat(s, G, axis=1), np.repeat(z, G, axis=1)
    else:
        gv = min(G, D)
        s, z = np.repeat(s, gv, axis=2), np.repeat(z, gv, axis=2)
    q = z + s * codes
    return np.concatenate([q, p["resid"].astype(np.float32)], axis=1)


def dsq_encode(x, which, mask, W, S, bits, group, base_of="salient"):
    """DSQ of x (H,T,D) given the file's salient mask bytes (H,nw,W/8); the
    key base is the mean of the salient keys or (base_of "rest") of the
    others, of all W keys when that set is empty."""
    H, T, D = x.shape
    nw = T // W
    gd = min(group, D)
    sel = unpack_bits(mask, 1, W).astype(bool)  # (H, nw, W)
    xw = x[:, :nw * W].reshape(H, nw, W, D)
    sal = xw[sel].reshape(H, nw, S, D)
    non = xw[~sel].reshape(H, nw, W - S, D)
    amax = np.abs(sal).max(axis=2) if S else np.zeros((H, nw, D), np.float32)
    sscale = (amax / np.float32(127)).astype(np.float16)
    ss = sscale.astype(np.float32)[:, :, None, :]
    ok = (ss > 0) & np.isfinite(ss)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.rint(sal / np.where(ok, ss, np.float32(1)))
    sc = np.where(ok, np.clip(sc, -127, 127), 0).astype(np.int8)
    out = {"mask": mask, "sal": sc, "sscale": sscale}
    if which == "k":
        if base_of == "rest" and S < W:
            src, nb = non, W - S
        else:
            src, nb = (sal, S) if S else (xw, W)
        base = (src.astype(np.float64).sum(axis=2) / nb).astype(np.float32).astype(np.float16)
        out["base"] = base
        non = non - base.astype(np.float32)[:, :, None, :]
    g = non.reshape(H, nw, W - S, D // gd, gd)
    c, s, z = asym_quant(g, 4, bits)
    out["codes"] = pack_bits(c.reshape(H, nw, W - S, D), bits)
    out["scale"] = s.reshape(H, nw, W - S, D // gd)
    out["zero"] = z.reshape(H, nw, W - S, D // gd)
    out["resid"] = x[:, nw * W:].astype(np.float16)
    return out


def dsq_decode(p, which, W, S, bits, group, T, D):
    H, nw = p["mask"].shape[:2]
    gd = min(group, D)
    sel = unpack_bits(p["mask"], 1, W).astype(bool)
    out = np.zeros((H, nw, W, D), np.float32)
    out[sel] = (p["sscale"].astype(np.float32)[:, :, None, :] * p["sal"].astype(np.float32)).reshape(-1, D)
    c = unpack_bits(p["codes"], bits, D).astype(np.float32)
    s = np.repeat(p["scale"].astype(np.float32), gd, axis=3)
    z = np.repeat(p["zero"].astype(np.float32), gd, axis=3)
    v = z + s * c
    if which == "k":
        v = p["base"].astype(np.float32)[:, :, None, :] + v
    out[~sel] = v.reshape(-1, D)
    return np.concatenate([out.reshape(H, nw * W, D), p["resid"].astype(np.float32)], axis=1)


def importance(q, k):
    """Attention each key receives from the stored queries (causal), summed
    over queries and the query heads of its KV head: (H, T)."""
    NH, nq, D = q.shape
    H, T, _ = k.shape
    imp = np.zeros((H, T))
    for qh in range(NH):
        h = qh // (NH // H)
        for j in range(nq):
            n = T - nq + j + 1
            s = (k[h, :n].astype(np.float64) @ q[qh, j].astype(np.float64)) / np.sqrt(D)
            p = np.exp(s - s.max())
            imp[h, :n] += p / p.sum()
    return imp


def select_mask(imp, W, S):
    """Top-S of each window (ties to the earlier token) as mask bytes."""
    H, T = imp.shape
    nw = T // W
    sel = np.zeros((H, nw, W), np.uint8)
    for h in range(H):
        for w in range(nw):
            order = sorted(range(W), key=lambda t: (-imp[h, w * W + t], t))
            sel[h, w, order[:S]] = 1
    return pack_bits(sel, 1)


# ---- the checks ------------------------------------------------------------

n_test = 0
n_fail = 0


def check(ok, name, detail=""):
    global n_test, n_fail
    n_test += 1
    if not ok:
        n_fail += 1
    print(("ok" if ok else "not ok") + " %d - %s%s" % (n_test, name, "" if ok else " # " + detail))
    sys.stdout.flush()


def run(args, **kw):
    return subprocess.run([os.path.join(BIN, args[0])] + args[1:], capture_output=True, **kw)


def parts(tensors, prefix):
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.view(np.uint8) if a.dtype == np.float16 else a, b.view(np.uint8) if b.dtype == np.float16 else b)


def check_file(src, tag, work):
    orig, meta = read_kvc(src)
    L = int(meta.get("kvc.n_layers", 0)) or len([k for k in orig if k.endswith(".k")])
    for method, args in [("kivi", ["--bits", "1"]), ("kivi", ["--bits", "2", "--group", "32", "--residual", "16"]),
                         ("kivi", ["--bits", "4", "--group", "16", "--residual", "0"]),
                         ("dsq", ["--method", "dsq"]), ("dsq", ["--method", "dsq", "--base", "salient"]),
                         ("dsq", ["--method", "dsq", "--bits", "1", "--group", "16"])]:
        label = "%s %s %s" % (tag, method, " ".join(args))
        packed = os.path.join(work, "p.kvc")
        dec = os.path.join(work, "d.kvc")
        r = run(["kv-quant"] + args + ["-o", packed, src])
        if r.returncode:
            check(False, label + ": kv-quant runs", r.stderr.decode())
            continue
        r = run(["kv-quant", "-d", "-o", dec, packed])
        if r.returncode:
            check(False, label + ": kv-quant -d runs", r.stderr.decode())
            continue
        pt, pm = read_kvc(packed)
        dt, _ = read_kvc(dec)
        enc_ok, dec_ok, msgs = True, True, []
        for l in range(L):
            for which in "kv":
                pre = "layers.%d.%s" % (l, which)
                x = orig[pre].astype(np.float32)
                H, T, D = x.shape
                p = parts(pt, pre + ".")
                m = lambda k: int(pm[pre + "." + k])
                if pm.get(pre + ".encoding") != method:
                    enc_ok = False
                    msgs.append("%s encoding %s" % (pre, pm.get(pre + ".encoding")))
                    continue
                if method == "kivi":
                    want = kivi_encode(x, which, m("bits"), m("group"), m("residual"))
                    mine = kivi_decode(p, which, m("bits"), m("group"), T, D)
                else:
                    W, S = m("window"), m("salient")
                    want = dsq_encode(x, which, p["mask"], W, S, m("bits"), m("group"),
                                      pm.get(pre + ".base_of", "salient"))
                    mine = dsq_decode(p, which, W, S, m("bits"), m("group"), T, D)
                for k, v in want.items():
                    if not same(p[k], v):
                        enc_ok = False
                        diff = (p[k].astype(np.float64) != v.astype(np.float64)).sum() if p[k].shape == v.shape else "shape"
                        msgs.append("%s.%s differs (%s of %d)" % (pre, k, diff, v.size))
                got = dt[pre]
                if got.dtype != np.float16 or not np.array_equal(got, mine.astype(np.float16)):
                    dec_ok = False
                    msgs.append("%s decode differs" % pre)
        check(enc_ok, label + ": packed parts equal the numpy encoding", "; ".join(msgs[:4]))
        if method == "dsq" and "layers.0.q" in orig:
            agree = total = 0
            for l in range(L):
                pre = "layers.%d.k" % l
                W, S = int(pm[pre + ".window"]), int(pm[pre + ".salient"])
                want = unpack_bits(select_mask(importance(orig["layers.%d.q" % l].astype(np.float32),
                                                          orig[pre].astype(np.float32)), W, S), 1, W)
                for which in "kv":
                    got = unpack_bits(pt["layers.%d.%s.mask" % (l, which)], 1, W)
                    agree += int((got == want).sum())
                    total += got.size
            check(agree >= 0.99 * total, label + ": salient tokens are the most attended ones",
                  "%d of %d mask bits agree" % (agree, total))
        check(dec_ok, label + ": kv-quant --decode equals the numpy decoding", "; ".join(msgs[:4]))


def random_kvc(path, seed, L=2, NH=4, H=2, T=300, D=64, nq=8, dtype=np.float32):
    rng = np.random.default_rng(seed)
    t = {"tokens": rng.integers(0, 512, T).astype(np.int32)}
    for l in range(L):
        k = rng.standard_normal((H, T, D)).astype(np.float32)
        k[:, :, 3] += 6.0  # an outlier channel, as real keys have
        k[:, :, 5] = 0.5   # a constant channel: scale 0
        t["layers.%d.k" % l] = k.astype(dtype)
        t["layers.%d.v" % l] = rng.standard_normal((H, T, D)).astype(dtype)
        t["layers.%d.q" % l] = rng.standard_normal((NH, nq, D)).astype(dtype)
    write_kvc(path, t, {})


def main():
    with tempfile.TemporaryDirectory() as work:
        for i, dt in enumerate([np.float32, np.float16]):
            src = os.path.join(work, "r%d.kvc" % i)
            random_kvc(src, 1234 + i, dtype=dt)
            check_file(src, "random-%s" % np.dtype(dt).name, work)
        kvrun = os.path.join(BIN, "kv-run")
        model = os.path.join(ROOT, "tests/data/stories260K/stories260K.bin")
        tok = os.path.join(ROOT, "tests/data/stories260K/tok512.bin")
        if os.access(kvrun, os.X_OK):
            real = os.path.join(work, "real.kvc")
            text = os.path.join(ROOT, "tests/data/stories260K/reference/greedy_bos_200.txt")
            r = subprocess.run([kvrun, "--model", model, "--tokenizer", tok, "--prompt-file", text,
                                "-n", "1", "--dump-kv", real], capture_output=True)
            if r.returncode == 0:
                check_file(real, "stories260K", work)
            else:
                check(False, "kv-run --dump-kv on stories260K", r.stderr.decode()[:300])
        else:
            print("ok %d - real stories260K cache # SKIP kv-run not built" % (n_test + 1))
    print("1..%d" % (n_test + (0 if os.access(os.path.join(BIN, "kv-run"), os.X_OK) else 1)))
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
