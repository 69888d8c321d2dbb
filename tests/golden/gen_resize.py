#!/usr/bin/python3
"""Golden data for kiln.image.resize (ComfyUI's comfy.utils.common_upscale).

Run from the repository root:  /usr/bin/python3 tests/golden/gen_resize.py
Writes tests/golden/resize/resize.safetensors, read by tests/lua/test_image.lua, and
tests/golden/resize/methods.safetensors (the methods beyond interpolate's nearest and
bilinear, below), read by tests/lua/test_comfy.lua.
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


# ComfyUI's other methods, written here from their published definitions: "area" and
# "bicubic" are interpolate's modes (bicubic with align_corners False); "lanczos" hands
# each picture to Pillow as 8 bits (np.clip(255 x, 0, 255).astype(uint8), i.e. truncated)
# and resizes with Image.LANCZOS; "bislerp" slerps each pixel's channel vector between
# the two neighbours a bilinear resize of the index ramp picks, width first, then height.
def lanczos(s, width, height):
    from PIL import Image
    outs = []
    for img in s:
        a = np.clip(255. * img.movedim(0, -1).numpy(), 0, 255).astype(np.uint8)
        r = Image.fromarray(a).resize((width, height), resample=Image.LANCZOS)
        outs.append(torch.from_numpy(np.array(r).astype(np.float32) / 255.0).movedim(-1, 0))
    return torch.stack(outs)


def slerp(b1, b2, r):
    n1, n2 = torch.norm(b1, dim=-1, keepdim=True), torch.norm(b2, dim=-1, keepdim=True)
    u1, u2 = b1 / n1, b2 / n2
    u1[n1.expand_as(u1) == 0] = 0
    u2[n2.expand_as(u2) == 0] = 0
    dot = (u1 * u2).sum(1)
    om = torch.acos(dot)
    so = torch.sin(om)
    res = (torch.sin((1 - r.squeeze(1)) * om) / so).unsqueeze(1) * u1 + (torch.sin(r.squeeze(1) * om) / so).unsqueeze(1) * u2
    res *= (n1 * (1 - r) + n2 * r).expand_as(res)
    res[dot > 1 - 1e-5] = b1[dot > 1 - 1e-5]
    res[dot < 1e-5 - 1] = (b1 * (1 - r) + b2 * r)[dot < 1e-5 - 1]
    return res


def taps(n_old, n_new):
    ramp = torch.arange(n_old, dtype=torch.float32).reshape(1, 1, 1, -1)
    c1 = torch.nn.functional.interpolate(ramp, size=(1, n_new), mode="bilinear")
    ratio = c1 - c1.floor()
    ramp2 = ramp + 1
    ramp2[:, :, :, -1] -= 1
    c2 = torch.nn.functional.interpolate(ramp2, size=(1, n_new), mode="bilinear")
    return ratio.reshape(-1), c1.to(torch.int64).reshape(-1), c2.to(torch.int64).reshape(-1)


def bislerp(s, width, height):
    n, c, h, w = s.shape
    r, i1, i2 = taps(w, width)
    a = s[:, :, :, i1].movedim(1, -1).reshape(-1, c)
    b = s[:, :, :, i2].movedim(1, -1).reshape(-1, c)
    rr = r.reshape(1, 1, -1).expand(n, h, -1).reshape(-1, 1)
    x = slerp(a, b, rr).reshape(n, h, width, c).movedim(-1, 1)
    r, i1, i2 = taps(h, height)
    a = x[:, :, i1, :].movedim(1, -1).reshape(-1, c)
    b = x[:, :, i2, :].movedim(1, -1).reshape(-1, c)
    rr = r.reshape(1, -1, 1).expand(n, -1, width).reshape(-1, 1)
    return slerp(a, b, rr).reshape(n, height, width, c).movedim(-1, 1)


def upscale2(s, width, height, mode, crop):
    if crop == "center":
        ow, oh = s.shape[3], s.shape[2]
        old, new = ow / oh, width / height
        x = y = 0
        if old > new:
            x = round((ow - ow * (new / old)) / 2)
        elif old < new:
            y = round((oh - oh * (old / new)) / 2)
        s = s[:, :, y:oh - y, x:ow - x]
    if mode == "lanczos":
        return lanczos(s, width, height)
    if mode == "bislerp":
        return bislerp(s, width, height)
    return torch.nn.functional.interpolate(s, size=(height, width), mode=mode)


save("tests/golden/resize/resize.safetensors", out)
src["latent"] = torch.randn(1, 4, 9, 12, generator=g)
out = {k: v.numpy() for k, v in src.items()}
cases2 = [("wide", 50, 31, "area", "disabled"), ("wide", 13, 9, "area", "disabled"), ("tall", 24, 24, "area", "center"),
          ("wide", 61, 45, "bicubic", "disabled"), ("tall", 11, 17, "bicubic", "disabled"),
          ("square", 40, 24, "bicubic", "center"),
          ("wide", 60, 33, "lanczos", "disabled"), ("wide", 15, 8, "lanczos", "disabled"),
          ("tall", 18, 50, "lanczos", "disabled"), ("square", 24, 24, "lanczos", "center"),
          ("latent", 18, 14, "bislerp", "disabled"), ("latent", 7, 5, "bislerp", "disabled"),
          ("latent", 12, 20, "bislerp", "disabled")]
for name, w, h, mode, crop in cases2:
    key = f"{name}_{w}x{h}_{mode}_{crop}"
    out[key] = upscale2(src[name], w, h, mode, crop).numpy()
save("tests/golden/resize/methods.safetensors", out)
print("wrote", len(cases) + len(cases2), "cases")
