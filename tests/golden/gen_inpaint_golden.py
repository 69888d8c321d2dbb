#!/usr/bin/env python3
"""Goldens of a tiny 9-channel inpainting SD 1.x checkpoint and of ComfyUI's
VAEEncodeForInpaint + the inpainting UNet's concat, for tests/lua/test_inpaint.lua.
Run with /usr/bin/python3 from the repository root (the models of gen_sd_golden.py):
writes tests/golden/inpaint/sd1_inpaint.recipe and sd1_inpaint.safetensors."""
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_sd_golden as G  # noqa: E402  (sets torch's thread count)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

OUT = os.path.join(HERE, "inpaint")


def vae_encode_for_inpaint(pixels, mask, grow=6):
    """ComfyUI's VAEEncodeForInpaint on [1, 3, H, W] pixels (channels first here):
    the grey-filled pixels and the grown noise mask at pixel size."""
    h, w = pixels.shape[2], pixels.shape[3]
    kernel = torch.ones((1, 1, grow, grow))
    padding = math.ceil((grow - 1) / 2)
    grown = torch.clamp(F.conv2d(mask.round(), kernel, padding=padding), 0, 1)[:, :, :h, :w].round()
    m = 1.0 - mask.round()
    grey = (pixels - 0.5) * m + 0.5
    return grey, grown


def main():
    os.makedirs(OUT, exist_ok=True)
    with torch.no_grad():
        m = G.Root()
        m.model = G.DiffusionWrapper(num_heads=2, in_channels=9)
        m.first_stage_model = G.AutoencoderKL()
        m.cond_stage_model = G.FrozenCLIPEmbedder()
        recipe = G.init_recipe(m, 40000)
        G.write_recipe(os.path.join(OUT, "sd1_inpaint.recipe"), recipe,
                       {"kiln.heads.unet": "2", "kiln.heads.clip": "2"})
        g = {}
        x = G.seeded([2, 9, 8, 8], 11)
        t = torch.tensor([10, 500])
        ctx = G.seeded([2, 77, 64], 2)
        g["unet.out"] = m.model.diffusion_model(x, t, ctx)
        pixels = (G.seeded([1, 3, 16, 16], 12) * 0.25 + 0.5).clamp(0, 1)
        mask = torch.zeros((1, 1, 16, 16))
        mask[:, :, 4:9, 6:12] = 0.8
        mask[:, :, 9:10, 6:12] = 0.3              # rounds to 0
        grey, grown = vae_encode_for_inpaint(pixels, mask)
        g["grey"] = grey
        g["grown"] = grown
        vae = m.first_stage_model
        mean, _ = vae.quant_conv(vae.encoder(grey * 2 - 1)).chunk(2, dim=1)
        g["latent"] = mean * 0.18215
        # the concat mask: prepare_mask's bilinear to latent size, then rounded
        g["concat_mask"] = F.interpolate(grown, size=(8, 8), mode="bilinear").round()
        g["pixels"] = pixels
        g["mask"] = mask
        G.save(os.path.join(OUT, "sd1_inpaint.safetensors"), g)
    for f in sorted(os.listdir(OUT)):
        print("  %-24s %7d bytes" % (f, os.path.getsize(os.path.join(OUT, f))))


if __name__ == "__main__":
    main()
