#!/usr/bin/python3
"""Golden data for kiln.image.resize (ComfyUI's comfy.utils.common_upscale).

Run from the repository root:  /usr/bin/python3 tests/golden/gen_resize.py
Writes tests/golden/resize/resize.safetensors, read by tests/lua/test_image.lua.
An independent PyTorch computation of the published behaviour: with crop "center"
the image is cut to the target aspect ratio, x = round((W - W * (new / old)) / 2)
columns (or y rows) off each side, Python's round (halves to even), then
torch.nn.functional.interpolate to (h, w) with the mode ("nearest-exact" for
ControlNet hints, "bilinear" with align_corners False)."""
import json, struct
import numpy as np
import torch

torch.set_num_threads(2)


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def common_upscale(s, width, height, mode, crop):
    if crop == "center":
        ow, oh = s.shape[3], s.shape[2]
        old, new = ow / oh, width / height
        x = y = 0
        if old > new:
            x = round((ow - ow * (new / old)) / 2)
        elif old < new:
            y = round((oh - oh * (old / new)) / 2)
        s = s[:, :, y:oh - y, x:ow - x]
    kw = {"align_corners": False} if mode == "bilinear" else {}
    return torch.nn.functional.interpolate(s, size=(height, width), mode=mode, **kw)


g = torch.Generator().manual_seed(7)
src = {"wide": torch.rand(1, 3, 20, 37, generator=g), "tall": torch.rand(1, 3, 33, 18, generator=g),
       "square": torch.rand(2, 3, 16, 16, generator=g)}
# (source, w, h, mode, crop)
cases = [("wide", 32, 32, "nearest-exact", "center"), ("wide", 48, 24, "nearest-exact", "center"),
         ("tall", 24, 40, "nearest-exact", "center"), ("tall", 16, 16, "bilinear", "center"),
         ("square", 40, 24, "nearest-exact", "center"), ("square", 40, 24, "nearest-exact", "disabled"),
         ("wide", 16, 8, "bilinear", "disabled")]
out = {k: v.numpy() for k, v in src.items()}
for name, w, h, mode, crop in cases:
    key = f"{name}_{w}x{h}_{mode}_{crop}"
    out[key] = common_upscale(src[name], w, h, mode, crop).numpy()
save("tests/golden/resize/resize.safetensors", out)
print("wrote", len(cases), "cases")
