#!/usr/bin/env python3
"""Golden data for kiln.taesd and kiln.preview: an independent PyTorch TAESD (the Tiny
AutoEncoder for Stable Diffusion as published: a plain stack of 3x3 convolutions, ReLU
residual blocks, stride-2 convolutions down and nearest 2x upsampling up, a tanh soft
clamp of the latents at the decoder's input) at the real width (64 channels) and with
the real key names of taesd_encoder.safetensors / taesd_decoder.safetensors (the indices
of the two nn.Sequential stacks: 0.weight, 1.conv.0.weight, ...).

Weights are not committed: taesd/decoder.recipe and taesd/encoder.recipe list every tensor
as gen_sd_golden's recipes do (torch.manual_seed(seed); torch.randn(shape) * std + mean),
with He-scaled weights so that the activations neither vanish nor explode through the
stack. Outputs (taesd/io.safetensors):
  dec.z [1, 4, 8, 8]      scaled latents (as samplers produce them)
  dec.img [1, 3, 64, 64]  the decoder's output clamped to [0, 1]
  dec.raw [1, 3, 64, 64]  the decoder's output before the clamp
  enc.img [1, 3, 64, 64]  an image in [0, 1]
  enc.z [1, 4, 8, 8]      the encoder's output (scaled latents)
  l2r.z [2, 4, 6, 10]     latents for the latent->RGB previews, computed with NumPy:
  l2r.sd1, l2r.sdxl       clip((z . F + b + 1) / 2, 0, 1) per pixel, [2, 3, 6, 10]

Run: /usr/bin/python3 tests/golden/gen_taesd.py
"""
import math
import os
import sys

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_sd_golden as G  # noqa: E402

OUT = os.path.join(HERE, "taesd")
torch.set_num_threads(2)
WIDTH = 64


def conv3(cin, cout, bias=True, stride=1):
    return nn.Conv2d(cin, cout, 3, padding=1, bias=bias, stride=stride)


class SoftClamp(nn.Module):
    """Keeps the decoder's input latents within about +-3: 3 tanh(x / 3)."""

    def forward(self, x):
        return 3.0 * torch.tanh(x / 3.0)


class ResBlock(nn.Module):
    """relu(conv3(relu(conv3(relu(conv3(x))))) + skip(x)); skip is the identity at equal
    widths (a bias-free 1x1 convolution otherwise)."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Sequential(conv3(cin, cout), nn.ReLU(), conv3(cout, cout), nn.ReLU(), conv3(cout, cout))
        self.skip = nn.Identity() if cin == cout else nn.Conv2d(cin, cout, 1, bias=False)
        self.fuse = nn.ReLU()

    def forward(self, x):
        return self.fuse(self.conv(x) + self.skip(x))


def encoder(latent=4, w=WIDTH):
    layers = [conv3(3, w), ResBlock(w, w)]
    for _ in range(3):
        layers += [conv3(w, w, bias=False, stride=2), ResBlock(w, w), ResBlock(w, w), ResBlock(w, w)]
    layers += [conv3(w, latent)]
    return nn.Sequential(*layers)


def decoder(latent=4, w=WIDTH):
    layers = [SoftClamp(), conv3(latent, w), nn.ReLU()]
    for _ in range(3):
        layers += [ResBlock(w, w), ResBlock(w, w), ResBlock(w, w), nn.Upsample(scale_factor=2), conv3(w, w, bias=False)]
    layers += [ResBlock(w, w), conv3(w, 3)]
    return nn.Sequential(*layers)


def init_recipe(model, base_seed):
    """Seeds every tensor (state_dict order); returns the recipe lines."""
    recipe, new = [], {}
    for i, (name, t) in enumerate(model.state_dict().items()):
        shape = list(t.shape)
        mean = 0.0
        if len(shape) == 1:
            std, mean = 0.05, 0.0
        else:
            # He scaling; the last convolution of a residual branch smaller, so that the
            # sums of ten blocks stay of order one
            std = math.sqrt(2.0 / float(np.prod(shape[1:])))
            if name.endswith("conv.4.weight"):
                std *= 0.3
        if name == "19.weight":  # the decoder's RGB output: mostly inside [0, 1]
            std *= 0.15
        if name == "19.bias":
            std, mean = 0.05, 0.5
        torch.manual_seed(base_seed + i)
        new[name] = torch.randn(shape) * std + mean
        recipe.append((name, "f32", shape, base_seed + i, std, mean))
    model.load_state_dict(new, strict=True)
    return recipe


# The latent->RGB factors of the previews (ComfyUI's latent_formats.SD15 / SDXL),
# repeated here so the check is against numbers typed separately from kiln.preview.
SD1_F = np.array([[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350],
                  [-0.2829, 0.1762, 0.2721], [-0.2120, -0.2616, -0.7177]])
SD1_B = np.zeros(3)
SDXL_F = np.array([[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068],
                   [0.1076, 0.1111, -0.0362], [-0.3165, -0.2492, -0.2188]])
SDXL_B = np.array([0.1084, -0.0175, -0.0011])


def latent2rgb(z, f, b):
    zz = z.astype(np.float64)
    rgb = np.einsum("bchw,cr->brhw", zz, f) + b[None, :, None, None]
    return np.clip((rgb + 1.0) / 2.0, 0.0, 1.0).astype(np.float32)


def main():
    os.makedirs(OUT, exist_ok=True)
    dec, enc = decoder(), encoder()
    rd = init_recipe(dec, 50000)
    re_ = init_recipe(enc, 51000)
    for fname, recipe in (("decoder.recipe", rd), ("encoder.recipe", re_)):
        path = os.path.join(OUT, fname)
        G.write_recipe(path, recipe, {})
        with open(path) as f:
            lines = f.read().split("\n")
        lines[0] = "# written by tests/golden/gen_taesd.py: name, dtype, shape, seed, std, mean"
        with open(path, "w") as f:
            f.write("\n".join(lines))
    out = {}
    with torch.no_grad():
        z = G.seeded([1, 4, 8, 8], 52000) * 1.5
        raw = dec(z)
        out["dec.z"], out["dec.raw"], out["dec.img"] = z, raw, raw.clamp(0, 1)
        torch.manual_seed(52001)
        img = torch.rand([1, 3, 64, 64])
        out["enc.img"], out["enc.z"] = img, enc(img)
    lz = G.seeded([2, 4, 6, 10], 52002) * 2.0
    out["l2r.z"] = lz
    out["l2r.sd1"] = torch.from_numpy(latent2rgb(lz.numpy(), SD1_F, SD1_B))
    out["l2r.sdxl"] = torch.from_numpy(latent2rgb(lz.numpy(), SDXL_F, SDXL_B))
    for k, v in out.items():
        print("%-8s %-16s mean %8.4f std %8.4f min %8.4f max %8.4f" % (k, list(v.shape), v.mean(), v.std(),
                                                                       v.min(), v.max()))
    G.save(os.path.join(OUT, "io.safetensors"), out, {"generator": "tests/golden/gen_taesd.py"})


if __name__ == "__main__":
    main()
