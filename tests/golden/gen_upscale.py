#!/usr/bin/env python3
"""Golden data for kiln.upscaler: tiny upscale models written independently from the
published architectures, with random weights, and their outputs on one small image.

- RRDBNet (ESRGAN, Real-ESRGAN, BSRGAN), in the new key layout (conv_first, body.N.rdb1.conv1,
  conv_body, conv_up1.., conv_hr, conv_last) and the original ESRGAN one (model.0,
  model.1.sub.N.RDB1.conv1.0, model.1.sub.NB, upsampling convs model.3 / model.6 ...,
  then the HR conv and the last conv). The x1 / x2 Real-ESRGAN variants fold the input
  with pixel-unshuffle (factor 4 / 2) before conv_first, then upsample 4x as the x4 model.
- SRVGGNetCompact (Real-ESRGAN compact): conv, PReLU, (conv, PReLU) * n, conv to
  out * s^2 channels, pixel shuffle, plus the input upsampled (nearest).

Files under tests/golden/upscale/: <name>.safetensors (the weights, f32) for each model,
and io.safetensors: `input` [1, 3, 12, 12] in [0, 1] and `out.<name>` (the raw network
output, unclamped).

Run: /usr/bin/python3 tests/golden/gen_upscale.py
"""
import json
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "upscale")
torch.set_num_threads(2)


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        b = np.ascontiguousarray(t.detach().float().numpy().astype("<f4")).tobytes()
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"generator": "tests/golden/gen_upscale.py", "torch": torch.__version__}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def lrelu(x):
    return F.leaky_relu(x, 0.2)


class DenseBlock(nn.Module):
    """Residual dense block: five 3x3 convs, each reading the input and every earlier
    output; the result scaled by 0.2 and added to the input."""

    def __init__(self, nf, gc):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(nf + i * gc, gc if i < 4 else nf, 3, 1, 1) for i in range(5)])

    def forward(self, x):
        feats = [x]
        for i, c in enumerate(self.convs):
            y = c(torch.cat(feats, 1))
            if i < 4:
                feats.append(lrelu(y))
        return y * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf, gc):
        super().__init__()
        self.rdbs = nn.ModuleList([DenseBlock(nf, gc) for _ in range(3)])

    def forward(self, x):
        h = x
        for r in self.rdbs:
            h = r(h)
        return h * 0.2 + x


class RRDBNet(nn.Module):
    """scale 1, 2, 4, 8: unshuffle = 4, 2, 1, 1; upsampling steps = 2, 2, 2, 3 (plain=True:
    the original ESRGAN's x1 models, no unshuffle and no upsampling step)."""

    def __init__(self, scale, nf, gc, nb, cin=3, cout=3, plain=False):
        super().__init__()
        self.unshuffle = 1 if plain else {1: 4, 2: 2}.get(scale, 1)
        self.ups = 0 if plain else 3 if scale == 8 else 2
        self.conv_first = nn.Conv2d(cin * self.unshuffle ** 2, nf, 3, 1, 1)
        self.body = nn.ModuleList([RRDB(nf, gc) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_ups = nn.ModuleList([nn.Conv2d(nf, nf, 3, 1, 1) for _ in range(self.ups)])
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, cout, 3, 1, 1)

    def forward(self, x):
        if self.unshuffle > 1:
            x = F.pixel_unshuffle(x, self.unshuffle)
        f = self.conv_first(x)
        h = f
        for b in self.body:
            h = b(h)
        f = f + self.conv_body(h)
        for c in self.conv_ups:
            f = lrelu(c(F.interpolate(f, scale_factor=2, mode="nearest")))
        return self.conv_last(lrelu(self.conv_hr(f)))

    def names(self, layout):
        """module parameter name -> the file's name in layout "new" or "old"."""
        m = {}
        for pname, _ in self.named_parameters():
            parts = pname.split(".")
            kind = parts[-1]
            if parts[0] == "body":
                n, r, c = int(parts[1]), int(parts[3]), int(parts[5])
                if layout == "new":
                    m[pname] = "body.%d.rdb%d.conv%d.%s" % (n, r + 1, c + 1, kind)
                else:
                    m[pname] = "model.1.sub.%d.RDB%d.conv%d.0.%s" % (n, r + 1, c + 1, kind)
                continue
            if layout == "new":
                if parts[0] == "conv_ups":
                    m[pname] = "conv_up%d.%s" % (int(parts[1]) + 1, kind)
                else:
                    m[pname] = "%s.%s" % (parts[0], kind)
                continue
            # the original Sequential: 0 first conv, 1 the shortcut block (its last
            # module the body conv), then (upsample, conv, lrelu) per step, HR conv,
            # lrelu, last conv
            nb = len(self.body)
            if parts[0] == "conv_first":
                idx = "model.0"
            elif parts[0] == "conv_body":
                idx = "model.1.sub.%d" % nb
            elif parts[0] == "conv_ups":
                idx = "model.%d" % (3 + 3 * int(parts[1]))
            elif parts[0] == "conv_hr":
                idx = "model.%d" % (3 * self.ups + 2)
            else:
                idx = "model.%d" % (3 * self.ups + 4)
            m[pname] = "%s.%s" % (idx, kind)
        return m


class Compact(nn.Module):
    """SRVGGNetCompact: conv + PReLU, nconv x (conv + PReLU), conv to cout * s^2,
    pixel shuffle, plus the nearest-upsampled input."""

    def __init__(self, scale, nf, nconv, cin=3, cout=3):
        super().__init__()
        self.scale = scale
        body = [nn.Conv2d(cin, nf, 3, 1, 1), nn.PReLU(nf)]
        for _ in range(nconv):
            body += [nn.Conv2d(nf, nf, 3, 1, 1), nn.PReLU(nf)]
        body.append(nn.Conv2d(nf, cout * scale * scale, 3, 1, 1))
        self.body = nn.Sequential(*body)

    def forward(self, x):
        y = F.pixel_shuffle(self.body(x), self.scale)
        return y + F.interpolate(x, scale_factor=self.scale, mode="nearest")

    def names(self, layout):
        return {n: n for n, _ in self.named_parameters()}


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 4:
                fan_in = p.shape[1] * p.shape[2] * p.shape[3]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
            elif "body" in name and p.dim() == 1 and isinstance(model, Compact) and p.shape[0] > 0 \
                    and name.split(".")[1].isdigit() and int(name.split(".")[1]) % 2 == 1:
                p.copy_(0.25 + 0.1 * torch.randn(p.shape, generator=g))  # PReLU slopes
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


MODELS = [
    # name, constructor, layout
    ("rrdb_x4_new", lambda: RRDBNet(4, 8, 4, 2), "new"),
    ("rrdb_x2_new", lambda: RRDBNet(2, 8, 4, 2), "new"),
    ("rrdb_x1_new", lambda: RRDBNet(1, 8, 4, 1), "new"),
    ("rrdb_x8_new", lambda: RRDBNet(8, 8, 4, 1), "new"),
    ("rrdb_x4_old", lambda: RRDBNet(4, 8, 4, 2), "old"),
    ("rrdb_x2_old", lambda: RRDBNet(2, 6, 5, 1), "old"),
    ("compact_x4", lambda: Compact(4, 8, 3), "new"),
    ("compact_x2", lambda: Compact(2, 6, 2), "new"),
    ("rrdb_x1_old", lambda: RRDBNet(1, 8, 4, 1, plain=True), "old"),
]
# (seeds follow the list's order: a new model goes at the end, keeping the others' bytes)


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(20)
    x = torch.rand(1, 3, 12, 12)
    io = {"input": x}
    for i, (name, make, layout) in enumerate(MODELS):
        m = make().eval()
        randomize(m, 100 + i)
        names = m.names(layout)
        save(os.path.join(OUT, name + ".safetensors"), {names[n]: p for n, p in m.named_parameters()})
        with torch.no_grad():
            io["out." + name] = m(x)
        print(name, tuple(io["out." + name].shape))
    save(os.path.join(OUT, "io.safetensors"), io)


if __name__ == "__main__":
    main()
