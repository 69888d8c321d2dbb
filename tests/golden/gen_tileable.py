#!/usr/bin/python3
"""Golden data for tests/lua/test_tileable.lua: convolutions with circular padding
(seamless pictures), computed by torch 1.13 (CPU).

Run from the repository root:  /usr/bin/python3 tests/golden/gen_tileable.py
Writes tests/golden/tileable/conv.safetensors (F32): an input x [2, 3, 7, 10], a
3x3 weight w [4, 3, 3, 3] and bias b, and per tiling mode m in x, y, xy:
  m.s1    Conv2d(padding=1) with padding_mode="circular" on the wrapped axes
  m.s2    the same with stride 2 (the UNet's downsampler)
  m.up    nearest 2x, then m.s1's convolution (the decoders' Upsample)
  m.enc   F.pad(x, (0, 1, 0, 1)) circular on the wrapped axes, zeros on the others,
          then a stride-2 convolution without padding (the VAE encoder's downsampler)
Both axes wrapped ("xy") is Conv2d's own padding_mode="circular"; one axis is
F.pad(mode="circular") on that axis and the convolution's zero padding on the other."""
import json
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(2)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tileable")


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        b = np.ascontiguousarray(t.detach().float().numpy().astype("<f4")).tobytes()
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"generator": "tests/golden/gen_tileable.py", "torch": torch.__version__}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    print("%s: %d bytes" % (path, os.path.getsize(path)))


def conv_circular(x, w, b, mode, stride=1):
    """3x3 convolution, padding 1: circular on the axes of mode, zeros elsewhere."""
    if mode == "xy":
        m = torch.nn.Conv2d(w.shape[1], w.shape[0], 3, stride=stride, padding=1, padding_mode="circular")
        with torch.no_grad():
            m.weight.copy_(w)
            m.bias.copy_(b)
        return m(x)
    if mode == "x":
        return F.conv2d(F.pad(x, (1, 1, 0, 0), mode="circular"), w, b, stride=stride, padding=(1, 0))
    return F.conv2d(F.pad(x, (0, 0, 1, 1), mode="circular"), w, b, stride=stride, padding=(0, 1))


def enc_pad(x, mode):
    """The encoder downsampler's right/bottom pad of 1: circular on wrapped axes."""
    if mode == "xy":
        return F.pad(x, (0, 1, 0, 1), mode="circular")
    if mode == "x":
        return F.pad(F.pad(x, (0, 1, 0, 0), mode="circular"), (0, 0, 0, 1))
    return F.pad(F.pad(x, (0, 0, 0, 1), mode="circular"), (0, 1, 0, 0))


def main():
    os.makedirs(OUT, exist_ok=True)
    g = torch.Generator().manual_seed(20)
    x = torch.randn(2, 3, 7, 10, generator=g)
    w = torch.randn(4, 3, 3, 3, generator=g) * 0.3
    b = torch.randn(4, generator=g) * 0.1
    out = {"x": x, "w": w, "b": b}
    with torch.no_grad():
        for m in ("x", "y", "xy"):
            out[m + ".s1"] = conv_circular(x, w, b, m)
            out[m + ".s2"] = conv_circular(x, w, b, m, stride=2)
            out[m + ".up"] = conv_circular(F.interpolate(x, scale_factor=2, mode="nearest"), w, b, m)
            out[m + ".enc"] = F.conv2d(enc_pad(x, m), w, b, stride=2)
    save(os.path.join(OUT, "conv.safetensors"), out)


if __name__ == "__main__":
    main()
