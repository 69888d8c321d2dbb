#!/usr/bin/python3
"""Golden data for tests/test_winograd_bf16.c: 3x3 convolutions of SD UNet shapes
(scaled down) as PyTorch computes them, exactly and in its bf16 mixed precision.

Run from anywhere:  /usr/bin/python3 tests/golden/gen_bf16_conv.py
Writes tests/golden/bf16/conv.safetensors (u64 LE header length, JSON header, raw
little-endian data). Per case <c>: "<c>.x" (F16, the input), "<c>.w" (F16, the weights,
scaled by 1/sqrt(fan_in) as a trained network's are), "<c>.b" (F32 bias), "<c>.y" (F32,
the convolution in float64 from exactly those values: the truth) and "<c>.e" (F32, one
value: PyTorch's bf16 error, max |y_bf16 - y| / max |y|, with y_bf16 the same
convolution under torch.autocast("cpu", bfloat16), oneDNN's direct bf16 convolution
with f32 sums), "<c>.p" (I64: n, c, h, w, k)."""
import json
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(2)
torch.manual_seed(4321)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bf16")

# (name, C, K, size): the many-tiles shapes (64x64 and 32x32 levels) and the few-tiles
# ones (16x16 with many channels), channels scaled down
CASES = [("many", 48, 48, 20), ("few", 64, 64, 12)]


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for k, (dt, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    os.makedirs(OUT, exist_ok=True)
    t = {}
    for name, C, K, S in CASES:
        x = torch.randn(1, C, S, S).half().float()
        w = (torch.randn(K, C, 3, 3) / (9 * C) ** 0.5).half().float()
        b = torch.randn(K) * 0.02
        y = F.conv2d(x.double(), w.double(), b.double(), padding=1)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            yb = F.conv2d(x, w, b, padding=1).float()
        e = ((yb.double() - y).abs().max() / y.abs().max()).item()
        print("%s: C=%d K=%d %dx%d torch bf16 error %.3e" % (name, C, K, S, S, e))
        t[name + ".x"] = ("F16", x.half().numpy())
        t[name + ".w"] = ("F16", w.half().numpy())
        t[name + ".b"] = ("F32", b.numpy())
        t[name + ".y"] = ("F32", y.float().numpy())
        t[name + ".e"] = ("F32", np.array([e], np.float32))
        t[name + ".p"] = ("I64", np.array([1, C, S, S, K], np.int64))
    save(os.path.join(OUT, "conv.safetensors"), t)


if __name__ == "__main__":
    main()
