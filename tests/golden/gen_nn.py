#!/usr/bin/python3
"""Golden data for tests/test_cpu_nn.c: attention, group/layer norm, softmax,
activations, interpolation and padding computed by torch 1.13 (CPU).

Run from the repository root:  /usr/bin/python3 tests/golden/gen_nn.py
Writes tests/golden/ops/nn_*.safetensors (written by hand: u64 LE header length,
JSON header, raw little-endian data). Inputs are rounded to f16 and stored as F16
(half the bytes); torch computes on exactly those values widened to f32/f64.
Attention, norms and activations are computed in float64 (the golden is the true
value, so the C tolerances measure our error); resampling runs in float32 because
the point there is torch's exact float index rule.
Scalar parameters are stored as 1-element F32 tensors named "<case>.<param>"."""
import json
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(2)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops")

DT = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}


def save(name, tensors):
    header, blobs, off = {}, [], 0
    for k, a in tensors.items():
        a = np.ascontiguousarray(a)
        b = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[k] = {"dtype": DT[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"generator": "tests/golden/gen_nn.py", "torch": torch.__version__}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    path = os.path.join(OUT, name)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    print(f"{path}: {os.path.getsize(path)} bytes")


def f16(t):
    """round to f16; returns (the f16 array to store, the f64 tensor torch uses)"""
    a = t.to(torch.float16).numpy()
    return a, torch.from_numpy(a.astype(np.float64))


def f32(t):
    return t.to(torch.float32).numpy()


def scalar(v):
    return np.array([v], dtype=np.float32)


g = torch.Generator().manual_seed(1234)


def randn(*shape, s=1.0, m=0.0):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * s + m


# ---- attention: softmax(q k^T * scale) v, [B, L, D] ------------------------------
def attention_cases():
    cases = [  # name, B, Lq, Lk, D, Dv, causal, q/k spread
        ("self", 1, 200, 200, 40, 40, 0, 1.5),    # SD self-attention head, L not a block multiple
        ("cross", 2, 100, 77, 40, 40, 0, 1.5),    # cross-attention to 77 text tokens
        ("d64", 1, 100, 100, 64, 64, 0, 1.0),
        ("d80", 1, 60, 110, 80, 80, 0, 1.0),     # Lq != Lk
        ("d160", 1, 40, 77, 160, 160, 0, 0.8),
        ("causal", 2, 77, 77, 64, 64, 1, 1.0),    # CLIP text encoder
        ("causal_long", 1, 280, 280, 40, 40, 1, 1.5),  # several query tasks and key blocks
        ("dv", 1, 50, 61, 32, 48, 0, 1.0),        # value width != key width
    ]
    out = {}
    for name, B, Lq, Lk, D, Dv, causal, s in cases:
        qa, q = f16(randn(B, Lq, D, s=s))
        ka, k = f16(randn(B, Lk, D, s=s))
        va, v = f16(randn(B, Lk, Dv))
        scale = float(np.float32(D ** -0.5))
        a = torch.bmm(q, k.transpose(1, 2)) * scale
        if causal:  # CLIP's explicit mask: -inf above the diagonal
            mask = torch.full((Lq, Lk), float("-inf"), dtype=torch.float64).triu(1)
            a = a + mask
        o = torch.bmm(a.softmax(-1), v)
        p = "att_" + name
        out.update({p + ".q": qa, p + ".k": ka, p + ".v": va, p + ".out": f32(o),
                    p + ".scale": scalar(scale), p + ".causal": scalar(causal)})
    save("nn_attention.safetensors", out)


# ---- group norm / layer norm / softmax --------------------------------------------
def norm_cases():
    out = {}
    gn = [  # name, N, C, H, W, groups, mean, std
        ("c320", 1, 320, 4, 4, 32, 0.0, 1.0),
        ("c640", 1, 640, 3, 3, 32, 0.5, 2.0),
        ("c1280", 1, 1280, 2, 2, 32, 0.0, 1.0),
        ("c128", 2, 128, 3, 5, 32, 0.0, 1.0),
        ("c256", 1, 256, 4, 4, 32, -1.0, 3.0),
        ("c512", 1, 512, 3, 3, 32, 0.0, 1.0),
        ("offset", 1, 64, 8, 8, 32, 100.0, 0.01),  # mean >> std: needs careful variance
    ]
    for name, N, C, H, W, G, m, s in gn:
        xa, x = f16(randn(N, C, H, W, s=s, m=m))
        if name == "offset":  # f16 would quantize 100 + 0.01 noise away: keep f32 input
            xa = randn(N, C, H, W, s=s, m=m).to(torch.float32).numpy()
            x = torch.from_numpy(xa.astype(np.float64))
        wa, w = f16(randn(C, s=0.5, m=1.0))
        ba, b = f16(randn(C, s=0.5))
        y = F.group_norm(x, G, w, b, eps=1e-6 if C >= 512 else 1e-5)
        p = "gn_" + name
        out.update({p + ".x": xa, p + ".gamma": wa, p + ".beta": ba, p + ".y": f32(y),
                    p + ".y_silu": f32(F.silu(y)), p + ".groups": scalar(G),
                    p + ".eps": scalar(1e-6 if C >= 512 else 1e-5)})
    for name, rows, D in (("d768", 4, 768), ("d320", 6, 320), ("d1024", 2, 1024)):
        xa, x = f16(randn(rows, D, s=2.0, m=0.3))
        wa, w = f16(randn(D, s=0.5, m=1.0))
        ba, b = f16(randn(D, s=0.5))
        p = "ln_" + name
        out.update({p + ".x": xa, p + ".gamma": wa, p + ".beta": ba,
                    p + ".y": f32(F.layer_norm(x, (D,), w, b, eps=1e-5)),
                    p + ".y_plain": f32(F.layer_norm(x, (D,), None, None, eps=1e-5)),
                    p + ".eps": scalar(1e-5)})
    for name, shape, dim, s in (("rows", (3, 77), 1, 3.0), ("mid", (2, 10, 33), 1, 2.0),
                                ("wide", (1, 5, 70), 1, 2.0), ("big", (2, 1000), 1, 30.0),
                                ("first", (7, 20), 0, 1.0)):
        xa, x = f16(randn(*shape, s=s))
        p = "sm_" + name
        out.update({p + ".x": xa, p + ".y": f32(x.softmax(dim)), p + ".dim": scalar(dim)})
    save("nn_norm.safetensors", out)


# ---- activations -------------------------------------------------------------------
def activation_cases():
    special = torch.tensor([-90, -60, -50, -30, -20, -15, -10.5, -9, -6, -5, -4, -3, -1e-3, -1e-7, 0,
                            1e-7, 1e-3, 3, 4, 5, 6, 9, 10.5, 15, 20, 30, 50, 60, 88], dtype=torch.float64)
    x = torch.cat([torch.linspace(-12, 12, 1201, dtype=torch.float64), randn(800, s=3.0), special])
    xa, x = f16(x)
    out = {"act.x": xa,
           "act.silu": f32(F.silu(x)),
           "act.gelu": f32(F.gelu(x)),
           "act.gelu_tanh": f32(F.gelu(x, approximate="tanh")),
           "act.quick_gelu": f32(x * torch.sigmoid(1.702 * x)),
           "act.sigmoid": f32(torch.sigmoid(x))}
    for name, rows, D in (("geglu_a", 4, 40), ("geglu_b", 2, 1280)):
        ga, gx = f16(randn(rows, 2 * D, s=2.0))
        hidden, gate = gx.chunk(2, -1)
        out.update({name + ".x": ga, name + ".y": f32(hidden * F.gelu(gate))})
    save("nn_activation.safetensors", out)


# ---- resampling and padding (float32: exact torch index rules) ----------------------
def resample_cases():
    out = {}
    src = {"s7x9": (2, 7, 9), "s64": (1, 64, 64), "s5x6": (2, 5, 6)}
    xs = {}
    for k, shp in src.items():
        xa, _ = f16(randn(*shp))
        xs[k] = torch.from_numpy(xa.astype(np.float32)).unsqueeze(0)  # [1, NC, H, W]
        out["rs_" + k + ".x"] = xa
    for f in (2, 3):
        y = F.interpolate(xs["s7x9"], scale_factor=f, mode="nearest")
        out["rs_up%d.y" % f] = f32(y[0])
    sizes = (("s7x9", 16, 12), ("s7x9", 3, 4), ("s7x9", 14, 18), ("s7x9", 7, 9),
             ("s64", 96, 80), ("s64", 23, 29))
    for mode, tag in (("bilinear", "bl"), ("nearest-exact", "ne"), ("nearest", "nn")):
        for k, oh, ow in sizes:
            kw = {"align_corners": False} if mode == "bilinear" else {}
            y = F.interpolate(xs[k], size=(oh, ow), mode=mode, **kw)
            out["rs_%s_%s_%dx%d.y" % (tag, k, oh, ow)] = f32(y[0])
    pads = (("constant", (1, 2, 3, 0), 0.5), ("reflect", (2, 3, 1, 4), 0.0),
            ("replicate", (3, 1, 2, 5), 0.0), ("constant", (0, 0, 0, 0), 0.0),
            ("reflect", (5, 5, 4, 4), 0.0), ("constant", (-1, 2, 0, -2), -1.0),
            ("circular", (1, 2, 3, 0), 0.0), ("circular", (2, 0, 0, 1), 0.0),
            ("circular", (6, 6, 5, 5), 0.0))
    modes = {"constant": 0, "reflect": 1, "replicate": 2, "circular": 3}  # ORDER PADMODE (kiln_pad_mode)
    for i, (mode, p, val) in enumerate(pads):
        kw = {"value": val} if mode == "constant" else {}
        y = F.pad(xs["s5x6"], p, mode=mode, **kw)
        out["pad%d.y" % i] = f32(y[0])
        out["pad%d.pads" % i] = np.array(p, dtype=np.float32)
        out["pad%d.value" % i] = scalar(val)
        out["pad%d.mode" % i] = scalar(modes[mode])
    save("nn_resample.safetensors", out)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    attention_cases()
    norm_cases()
    activation_cases()
    resample_cases()
