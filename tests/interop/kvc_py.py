#!/usr/bin/python3
"""An independent reader and writer of .kvc files in Python and numpy.

Written from man/kvc.5 alone (it shares no code with lib/format and does not
import safetensors), so the bats interop tests can check both directions:
files written by kvtools read here with identical arrays, and files written
here read by kv-info.

    kvc_py.py check-sample FILE     verify test_kvc --write-sample output value by value
    kvc_py.py write-minimal FILE    K/V only, no metadata, safetensors-style 8-byte padding
    kvc_py.py write-full FILE       full metadata, queries, tokens and CRC-32C checksums
    kvc_py.py corrupt CASE IN OUT   write a corrupt variant of IN (cases: see CORRUPT)
    kvc_py.py summary FILE          print geometry and checksum status as JSON
    kvc_py.py poison IN OUT TENSOR INDEX VALUE
                                    set element INDEX of a plain F32/F16/BF16 tensor to VALUE
                                    (nan, inf, -inf or a number), its checksum kept valid

Exit status: 0 ok, 1 check failed, 64 usage.
"""
import json
import struct
import subprocess
import sys

import numpy as np

ALIGN = 64
DTYPES = {  # safetensors name -> (numpy dtype, element size)
    "F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2), "I32": ("<i4", 4),
    "U8": ("u1", 1), "I8": ("i1", 1), "I64": ("<i8", 8), "U32": ("<u4", 4),
}


# --- CRC-32C (Castagnoli, reflected 0x82f63b78) ------------------------------

def _crc_table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        t.append(c)
    return t


CRC_TABLE = _crc_table()


def crc32c(data):
    c = 0xFFFFFFFF
    t = CRC_TABLE
    for b in bytes(data):
        c = (c >> 8) ^ t[(c ^ b) & 0xFF]
    return c ^ 0xFFFFFFFF


# --- reading -------------------------------------------------------------------

class KvcError(Exception):
    pass


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def read_kvc(path):
    """Return (header_len, metadata dict, {name: (dtype, shape, begin, end, array)})."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:4] == b"\x28\xb5\x2f\xfd":
        raw = subprocess.run(["zstd", "-dc"], input=raw, capture_output=True, check=True).stdout
    if len(raw) < 8:
        raise KvcError("shorter than the header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise KvcError("header length past end of file")
    text = raw[8:8 + n].decode("utf-8")
    hdr, end = json.JSONDecoder().raw_decode(text)
    if text[end:].strip(" \t\r\n"):
        raise KvcError("header padding is not whitespace")
    if not isinstance(hdr, dict):
        raise KvcError("header is not an object")
    meta = hdr.pop("__metadata__", {})
    if not all(isinstance(v, str) for v in meta.values()):
        raise KvcError("metadata values must be strings")
    data = raw[8 + n:]
    tensors = {}
    for name, e in hdr.items():
        dt = e["dtype"]
        if dt not in DTYPES:
            raise KvcError(f"unknown dtype {dt}")
        npdt, size = DTYPES[dt]
        shape = [int(d) for d in e["shape"]]
        begin, end = (int(x) for x in e["data_offsets"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * size:
            raise KvcError(f"{name}: byte size does not match shape")
        arr = np.frombuffer(data[begin:end], dtype=npdt).reshape(shape)
        if dt == "BF16":
            arr = bf16_to_f32(arr)
        tensors[name] = (dt, shape, begin, end, arr)
    pos = 0
    for name, (_, _, begin, end, _) in sorted(tensors.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != pos:
            raise KvcError(f"{name}: hole or overlap at {begin}")
        pos = end
    if pos != len(data):
        raise KvcError("data section length does not match the tensors")
    for key, val in meta.items():
        if key.startswith("crc32c."):
            name = key[len("crc32c."):]
            _, _, begin, end, _ = tensors[name]
            if f"{crc32c(data[begin:end]):08x}" != val:
                raise KvcError(f"checksum mismatch in {name}")
    if "kvc.checksums" in meta:  # the writer checksummed every tensor
        if meta["kvc.checksums"] != str(len(tensors)):
            raise KvcError("kvc.checksums is not the tensor count")
        missing = [t for t in tensors if "crc32c." + t not in meta]
        if missing:
            raise KvcError(f"tensor {missing[0]} has no checksum")
    return n, meta, tensors


def kivi_nquant(T, G, R):
    q = T - R
    return 0 if q <= 0 else q // G * G


def kivi_unpack(codes, bits, head_dim):
    """codes U8 [..., head_dim*bits/8] -> integer codes [..., head_dim], LSB first."""
    c = np.arange(head_dim)
    bit = c * bits
    byte = codes[..., bit // 8].astype(np.uint32)
    return (byte >> (bit % 8)) & ((1 << bits) - 1)


def kivi_decode(t, layer, which, meta):
    """Dequantize a kivi layer part per man/kvc.5 -> float32 [kv_heads, T, head_dim]."""
    p = f"layers.{layer}.{which}"
    bits, G = int(meta[p + ".bits"]), int(meta[p + ".group"])
    codes = t[p + ".codes"][4]
    scale = t[p + ".scale"][4].astype(np.float32)
    zero = t[p + ".zero"][4].astype(np.float32)
    resid = t[p + ".resid"][4].astype(np.float32)
    D = resid.shape[2]
    q = kivi_unpack(codes, bits, D).astype(np.float32)
    if which == "k":
        s = np.repeat(scale, G, axis=1)[:, :q.shape[1]]
        z = np.repeat(zero, G, axis=1)[:, :q.shape[1]]
    else:
        gv = min(G, D)
        s = np.repeat(scale, gv, axis=2)
        z = np.repeat(zero, gv, axis=2)
    return np.concatenate([z + s * q, resid], axis=1)


# --- the sample written by tests/unit/test_kvc.c --write-sample -----------------

S_L, S_KVH, S_T, S_D, S_H, S_Q = 3, 2, 5, 4, 4, 2


def sample_val(layer, part, n):
    i = np.arange(n, dtype=np.int64)
    return (((i * 7 + layer * 13 + part * 5) % 23) - 11).astype(np.float32) / 8.0


def check(cond, what):
    if not cond:
        raise KvcError("check failed: " + what)


def check_sample(path):
    n, meta, t = read_kvc(path)
    check((8 + n) % ALIGN == 0, "data section starts at a multiple of 64")
    order = sorted(t.items(), key=lambda kv: kv[1][2])
    sizes = [DTYPES[v[0]][1] for _, v in order]
    check(sizes == sorted(sizes, reverse=True), "tensors in decreasing element size")
    for name, (dt, _, begin, _, _) in t.items():
        check(begin % DTYPES[dt][1] == 0, f"{name} offset aligned to its element size")
        check(meta.get("crc32c." + name, "") != "", f"{name} has a checksum")
    check(meta.get("kvc.checksums") == str(len(t)), "kvc.checksums is the tensor count")
    want = {"format": "kvc", "kvc.version": "1", "kvc.n_layers": "3", "kvc.n_heads": "4",
            "kvc.n_kv_heads": "2", "kvc.head_dim": "4", "kvc.n_tokens": "5", "kvc.n_q": "2",
            "kvc.rope_theta": "500000", "kvc.rope_scaling": "llama3", "kvc.rope_factor": "8",
            "kvc.rope_low_freq_factor": "1", "kvc.rope_high_freq_factor": "4",
            "kvc.rope_orig_ctx": "8192", "kvc.keys_roped": "true", "kvc.rope_layout": "halves",
            "kvc.model": "sample", "layers.0.k.encoding": "f32", "layers.1.v.encoding": "bf16",
            "layers.2.k.encoding": "kivi", "layers.2.v.bits": "2", "layers.2.v.group": "2",
            "layers.2.v.residual": "2"}
    for k, v in want.items():
        check(meta.get(k) == v, f"metadata {k}={meta.get(k)!r}, want {v!r}")
    check(t["tokens"][0] == "I32" and list(t["tokens"][4]) == [1 + 37 * i for i in range(S_T)], "tokens")
    kv_shape = [S_KVH, S_T, S_D]
    dts = {(0, "k"): "F32", (0, "v"): "F32", (0, "q"): "F32", (1, "k"): "F16", (1, "v"): "BF16",
           (1, "q"): "F16", (2, "q"): "BF16"}
    for (layer, part), dt in dts.items():
        name = f"layers.{layer}.{part}"
        pid = "kvq".index(part)
        shape = [S_H, S_Q, S_D] if part == "q" else kv_shape
        check(t[name][0] == dt and t[name][1] == shape, f"{name} dtype/shape")
        got = t[name][4].astype(np.float32).reshape(-1)
        check(np.array_equal(got, sample_val(layer, pid, got.size)), f"{name} values")
    # Layer 2: KIVI 2-bit, G 2, R 2 -> Tq 2; shapes exactly as the spec says.
    tq = kivi_nquant(S_T, 2, 2)
    for p, which in enumerate("kv"):
        pre = f"layers.2.{which}"
        s1, s2 = (tq // 2, S_D) if which == "k" else (tq, S_D // min(2, S_D))
        check(t[pre + ".codes"][:2] == ("U8", [S_KVH, tq, S_D * 2 // 8]), pre + ".codes shape")
        check(t[pre + ".scale"][:2] == ("F16", [S_KVH, s1, s2]), pre + ".scale shape")
        check(t[pre + ".zero"][:2] == ("F16", [S_KVH, s1, s2]), pre + ".zero shape")
        check(t[pre + ".resid"][:2] == ("F16", [S_KVH, S_T - tq, S_D]), pre + ".resid shape")
        codes = t[pre + ".codes"][4].reshape(-1)
        j = np.arange(codes.size)
        check(np.array_equal(codes, (j * 37 + 2 * 11 + p * 3) % 256), pre + ".codes values")
        sc = t[pre + ".scale"][4].astype(np.float32).reshape(-1)
        check(np.array_equal(sc, (1 + np.arange(sc.size) % 4) / 4.0), pre + ".scale values")
        z = t[pre + ".zero"][4].astype(np.float32).reshape(-1)
        check(np.array_equal(z, sample_val(2, 3 + p, z.size)), pre + ".zero values")
        r = t[pre + ".resid"][4].astype(np.float32).reshape(-1)
        check(np.array_equal(r, sample_val(2, p, r.size)), pre + ".resid values")
        dec = kivi_decode(t, 2, which, meta)
        check(dec.shape == (S_KVH, S_T, S_D), pre + " decodes to [kv_heads, T, head_dim]")
    print(f"ok: {len(t)} tensors, {len(meta)} metadata keys")


# --- writing -------------------------------------------------------------------

def write_kvc(path, tensors, metadata=None, checksums=False, align=ALIGN, sort=True):
    """tensors: list of (name, dtype name, numpy array in the file's dtype)."""
    items = list(tensors)
    if sort:
        items.sort(key=lambda x: -DTYPES[x[1]][1])
    meta = dict(metadata or {})
    blobs, hdr, pos = [], {}, 0
    for name, dt, arr in items:
        b = np.ascontiguousarray(arr).astype(DTYPES[dt][0] if dt != "BF16" else "<u2").tobytes()
        hdr[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [pos, pos + len(b)]}
        if checksums:
            meta["crc32c." + name] = f"{crc32c(b):08x}"
        blobs.append(b)
        pos += len(b)
    full = {"__metadata__": meta} if meta else {}
    full.update(hdr)
    text = json.dumps(full, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % align)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def f32_to_bf16(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_minimal(path):
    """What a user's three-line export gives: K/V only, no metadata, 8-byte padding,
    JSON keys not in data order."""
    rng = np.random.default_rng(7)
    ts = []
    for layer in (1, 0):
        for part in "vk":
            ts.append((f"layers.{layer}.{part}", "F16", rng.standard_normal((1, 3, 2)).astype(np.float16)))
    write_kvc(path, ts, align=8, sort=False)


def write_full(path):
    rng = np.random.default_rng(11)
    L, H, KVH, T, D, Q = 2, 4, 2, 6, 8, 3
    ts = [("tokens", "I32", np.arange(T, dtype=np.int32) * 5 + 1)]
    for layer in range(L):
        ts.append((f"layers.{layer}.k", "BF16", f32_to_bf16(rng.standard_normal((KVH, T, D)))))
        ts.append((f"layers.{layer}.v", "F16", rng.standard_normal((KVH, T, D)).astype(np.float16)))
        ts.append((f"layers.{layer}.q", "F32", rng.standard_normal((H, Q, D)).astype(np.float32)))
    meta = {"format": "kvc", "kvc.version": "1", "kvc.n_layers": str(L), "kvc.n_heads": str(H),
            "kvc.n_kv_heads": str(KVH), "kvc.head_dim": str(D), "kvc.n_tokens": str(T),
            "kvc.n_q": str(Q), "kvc.rope_theta": "10000", "kvc.rope_layout": "halves",
            "kvc.keys_roped": "true", "kvc.model": "python-writer"}
    write_kvc(path, ts, meta, checksums=True)


# --- corrupt variants (for the kv-info bats tests) -------------------------------

def _split(raw):
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(hdr, data):
    text = json.dumps(hdr, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % ALIGN)
    return struct.pack("<Q", len(text)) + text + data


def _first(hdr, prefix="layers.0.k"):
    return hdr[prefix]


def corrupt(case, raw):
    hdr, data = _split(raw)
    meta = hdr.setdefault("__metadata__", {})
    if case == "truncated":
        return raw[:len(raw) - 5]
    if case == "header-past-eof":
        return struct.pack("<Q", len(raw)) + raw[8:]
    if case == "header-absurd":
        return struct.pack("<Q", 1 << 40) + raw[8:]
    if case == "bad-json":
        (n,) = struct.unpack("<Q", raw[:8])
        return raw[:8] + b"{{" + raw[10:8 + n] + raw[8 + n:]
    if case == "not-object":
        return _raw_header(b"[1,2,3]", data)
    if case == "meta-not-string":
        meta["kvc.n_layers"] = 3
    elif case == "unknown-dtype":
        _first(hdr)["dtype"] = "F64"
    elif case == "negative-dim":
        _first(hdr)["shape"][0] = -2
    elif case == "size-mismatch":
        _first(hdr)["shape"][1] += 1
    elif case == "offsets-reversed":
        o = _first(hdr)["data_offsets"]
        o[0], o[1] = o[1], o[0]
    elif case == "overlap":
        items = sorted((v["data_offsets"][0], k) for k, v in hdr.items() if k != "__metadata__")
        second = hdr[items[1][1]]
        second["data_offsets"] = [x - 2 for x in second["data_offsets"]]
    elif case == "hole":
        data = data + b"\0\0\0\0"
        items = sorted((v["data_offsets"][0], k) for k, v in hdr.items() if k != "__metadata__")
        for _, k in items[1:]:
            hdr[k]["data_offsets"] = [x + 4 for x in hdr[k]["data_offsets"]]
    elif case == "checksum":
        begin = _first(hdr)["data_offsets"][0]
        data = bytearray(data)
        data[begin] ^= 1
        data = bytes(data)
    elif case == "geometry":
        meta["kvc.n_kv_heads"] = str(int(meta.get("kvc.n_kv_heads", "1")) + 1)
    elif case == "missing-layer":
        hdr.pop("layers.0.v")
        for k in [k for k in meta if k.startswith("crc32c.") or k.startswith("layers.0.v.")]:
            meta.pop(k)
        meta.pop("kvc.checksums", None)
        data = _repack(hdr, data)
    elif case == "version":
        meta["kvc.version"] = "2"
    elif case == "crc-key-renamed":  # one flipped byte in a crc32c key's prefix
        k = "crc32c.layers.0.k"
        meta["crc32d.layers.0.k"] = meta.pop(k)
    elif case == "escape-key":      # a key that would re-title a terminal, with a bad value
        meta["\x1b]0;pwned\x07\x9b31m"] = 5
    elif case == "escape-model":    # valid, but the model name holds escape sequences
        meta["kvc.model"] = "\x1b]0;pwned\x07\x1b[31mred"
    else:
        raise SystemExit(64)
    return _join(hdr, data)


def _raw_header(text, data):
    text += b" " * ((-(8 + len(text))) % ALIGN)
    return struct.pack("<Q", len(text)) + text + data


def _repack(hdr, data):
    """After removing a tensor, move the others down so the data has no hole."""
    items = sorted((v["data_offsets"][0], k) for k, v in hdr.items() if k != "__metadata__")
    out, pos = b"", 0
    for _, k in items:
        b, e = hdr[k]["data_offsets"]
        out += data[b:e]
        hdr[k]["data_offsets"] = [pos, pos + e - b]
        pos += e - b
    return out


CORRUPT = ["truncated", "header-past-eof", "header-absurd", "bad-json", "not-object",
           "meta-not-string", "unknown-dtype", "negative-dim", "size-mismatch", "offsets-reversed",
           "overlap", "hole", "checksum", "geometry", "missing-layer", "version", "escape-key",
           "escape-model", "crc-key-renamed"]


def poison(src, dst, tensor, index, value):
    """A valid file whose one element is non-finite: bytes patched, CRC redone."""
    raw = open(src, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8:8 + n])
    e = hdr[tensor]
    size = DTYPES[e["dtype"]][1]
    v = np.array([float(value)], dtype=np.float32)
    if e["dtype"] == "F32":
        b = v.tobytes()
    elif e["dtype"] == "F16":
        b = v.astype(np.float16).tobytes()
    elif e["dtype"] == "BF16":
        b = (v.view(np.uint32) >> 16).astype("<u2").tobytes()
    else:
        raise KvcError(f"{tensor} is {e['dtype']}, not a float tensor")
    data = bytearray(raw[8 + n:])
    begin, end = e["data_offsets"]
    at = begin + int(index) * size
    if at + size > end:
        raise KvcError(f"{tensor} has no element {index}")
    data[at:at + size] = b
    meta = hdr.get("__metadata__", {})
    if "crc32c." + tensor in meta:
        meta["crc32c." + tensor] = f"{crc32c(bytes(data[begin:end])):08x}"
    text = json.dumps(hdr, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % ALIGN)
    open(dst, "wb").write(struct.pack("<Q", len(text)) + text + bytes(data))


def summary(path):
    n, meta, t = read_kvc(path)
    k0 = t["layers.0.k"][1] if "layers.0.k" in t else [int(meta[f"kvc.{k}"]) for k in ("n_kv_heads", "n_tokens", "head_dim")]
    layers = len({k.split(".")[1] for k in t if k.startswith("layers.")})
    print(json.dumps({"n_layers": layers, "n_kv_heads": k0[0], "n_tokens": k0[1], "head_dim": k0[2],
                      "checksums": sum(k.startswith("crc32c.") for k in meta), "tensors": len(t)}))


def main(argv):
    if len(argv) == 3 and argv[1] == "check-sample":
        check_sample(argv[2])
    elif len(argv) == 3 and argv[1] == "write-minimal":
        write_minimal(argv[2])
    elif len(argv) == 3 and argv[1] == "write-full":
        write_full(argv[2])
    elif len(argv) == 3 and argv[1] == "summary":
        summary(argv[2])
    elif len(argv) == 7 and argv[1] == "poison":
        poison(*argv[2:])
    elif len(argv) == 5 and argv[1] == "corrupt" and argv[2] in CORRUPT:
        with open(argv[3], "rb") as f:
            raw = f.read()
        with open(argv[4], "wb") as f:
            f.write(corrupt(argv[2], raw))
    else:
        sys.stderr.write(__doc__)
        return 64
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except KvcError as e:
        sys.stderr.write(f"kvc_py: {e}\n")
        sys.exit(1)
