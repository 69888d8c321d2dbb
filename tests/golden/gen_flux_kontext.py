#!/usr/bin/python3
"""Golden data for Flux.1 Kontext in kiln (tests/lua/test_flux_kontext.lua): reference
latents as extra image tokens, computed with Black Forest Labs' own code run from the
mirror as tests/golden/gen_flux_ae.py does (flux/model.py's Flux, flux/sampling.py's
prepare_kontext, prepare, get_schedule, denoise, unpack; modules/autoencoder.py). Its
code is read and run there, never copied here.

The networks are those of tests/golden/gen_flux_pipeline.py (the tiny [dev] Flux with a
64-wide pooled vector, the tiny autoencoder, the tiny T5 and CLIP-L; prompt "").

- The network: BFL's Flux.forward on the image's tokens followed by the references'
  (img_ids + the references' ids), the prediction's first tokens kept, as BFL's denoise
  does. One reference: its ids are the ones prepare_kontext makes (index 1, rows and
  columns from 0). Two references: ids placed as ComfyUI's default "offset" method
  places them (comfy/ldm/flux/model.py: the second right of the first when it is taller
  than wide against the space taken, else below), written out here.
- The picture: prepare_kontext on a 48 x 32 reference PNG (the module's preferred
  resolutions replaced by that size, so its LANCZOS resize is the identity and the
  reference goes to the encoder as stored), then BFL's denoise with img_cond_seq /
  img_cond_seq_ids, 4 steps, guidance 3.5, a 32 x 32 target, seed 9. Two departures,
  both to compare f32 with f32: prepare_kontext casts the encoded reference and its
  noise to bf16; the reference here is the same encode and packing kept in f32 (checked
  against the bf16 one to bf16's precision), and the noise is get_noise's in f32 (as
  gen_flux_pipeline.py's). The autoencoder takes the posterior mean (sample_z False),
  as ComfyUI's VAEEncode.

Run from the repository root:  /usr/bin/python3 tests/golden/gen_flux_kontext.py

Writes tests/golden/flux/kontext.safetensors: x [2, 16, 6, 4], t [2], context [2, 5, 32],
y [2, 64], guidance [2], ref1 [1, 16, 4, 6], ref2 [2, 16, 2, 4], net_one (with ref1),
net_two (with ref1 then ref2) [2, 16, 6, 4]; reference_image [1, 3, 32, 48] (the PNG's
bytes / 255), image [1, 3, 32, 32] and latent [1, 16, 4, 4] of the Kontext run.
"""

import os
import sys
import tempfile

import numpy as np
import torch
from PIL import Image

torch.set_num_threads(2)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_flux  # noqa: E402
import gen_flux_ae  # noqa: E402
import gen_flux_pipeline as gp  # noqa: E402
import safetensors_io  # noqa: E402


def pack(x):
    B, C, h, w = x.shape
    return x.reshape(B, C, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, (h // 2) * (w // 2), C * 4)


def grid_ids(B, h2, w2, index=0, ho=0, wo=0):
    ids = torch.zeros(h2, w2, 3)
    ids[..., 0] = index
    ids[..., 1] = ids[..., 1] + torch.arange(h2)[:, None] + ho
    ids[..., 2] = ids[..., 2] + torch.arange(w2)[None, :] + wo
    return ids.reshape(1, h2 * w2, 3).repeat(B, 1, 1)


def offset_ids(B, refs):
    """ComfyUI's "offset" placement of several references (latent units, then patches)."""
    H = W = 0
    out = []
    for r in refs:
        h, w = r.shape[-2], r.shape[-1]
        ho = wo = 0
        if h + H > w + W:
            wo = W
        else:
            ho = H
        H, W = max(H, h + ho), max(W, w + wo)
        out.append(grid_ids(B, h // 2, w // 2, 1, ho // 2, wo // 2))
    return torch.cat(out, 1)


def net_with_refs(net, x, t, ctx, y, g, refs, ids):
    B, C, h, w = x.shape
    img = pack(x)
    n = img.shape[1]
    parts = [img] + [pack(r).expand(B, -1, -1) for r in refs]
    img_ids = torch.cat([grid_ids(B, h // 2, w // 2), ids], 1)
    txt_ids = torch.zeros(B, ctx.shape[1], 3)
    with torch.no_grad():
        out = net(img=torch.cat(parts, 1), img_ids=img_ids, txt=ctx, txt_ids=txt_ids, timesteps=t, y=y,
                  guidance=g)
    out = out[:, :n]
    return out.reshape(B, h // 2, w // 2, C, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C, h, w)


def main():
    autoencoder, model_mod, sampling = gen_flux_ae.import_bfl()
    ae, _ = gen_flux_ae.tiny_ae(autoencoder)
    net, _ = gp.tiny_flux(model_mod, True)
    out = {}

    torch.manual_seed(4242)
    x = torch.randn(2, 16, 6, 4)
    t = torch.tensor([0.7, 0.25])
    ctx = torch.randn(2, 5, gen_flux.CONTEXT)
    y = torch.randn(2, gp.VEC)
    g = torch.tensor([3.5, 2.0])
    ref1 = torch.randn(1, 16, 4, 6)
    ref2 = torch.randn(2, 16, 2, 4)
    out.update(x=x, t=t, context=ctx, y=y, guidance=g, ref1=ref1, ref2=ref2)
    out["net_one"] = net_with_refs(net, x, t, ctx, y, g, [ref1], grid_ids(2, 2, 3, 1))
    two = torch.cat([pack(ref1).expand(2, -1, -1), pack(ref2)], 1)
    ids2 = offset_ids(2, [ref1, ref2])
    with torch.no_grad():
        o2 = net(img=torch.cat([pack(x), two], 1), img_ids=torch.cat([grid_ids(2, 3, 2), ids2], 1), txt=ctx,
                 txt_ids=torch.zeros(2, 5, 3), timesteps=t, y=y, guidance=g)[:, :6]
    out["net_two"] = o2.reshape(2, 3, 2, 16, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(2, 16, 6, 4)

    # the picture: BFL's prepare_kontext on a stored PNG, then its denoise
    torch.manual_seed(77)
    pix = torch.randint(0, 256, (32, 48, 3), dtype=torch.uint8)
    out["reference_image"] = pix.permute(2, 0, 1).unsqueeze(0).float() / 255
    sampling.PREFERED_KONTEXT_RESOLUTIONS = [(48, 32)]
    context, pooled = gp.t5_states(512), gp.clip_pooled()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ref.png")
        Image.fromarray(pix.numpy()).save(path)
        inp, height, width = sampling.prepare_kontext(lambda p: context, lambda p: pooled, "", ae, path, 9,
                                                      torch.device("cpu"), target_width=32, target_height=32)
        with torch.no_grad():
            cond = pack(ae.encode(torch.from_numpy(np.array(Image.open(path).convert("RGB"))).float()
                                  .div(127.5).sub(1).permute(2, 0, 1).unsqueeze(0)))
    assert (cond.bfloat16().float() - inp["img_cond_seq"].float()).abs().max() == 0
    with torch.no_grad():
        noise = sampling.get_noise(1, height, width, torch.device("cpu"), torch.float32, 9)
        base = sampling.prepare(lambda p: context, lambda p: pooled, noise, "")
        timesteps = sampling.get_schedule(4, base["img"].shape[1], shift=True)
        xs = sampling.denoise(net, **base, timesteps=timesteps, guidance=3.5, img_cond_seq=cond,
                              img_cond_seq_ids=inp["img_cond_seq_ids"])
        lat = sampling.unpack(xs.float(), height, width)
        out["image"] = (ae.decode(lat).clamp(-1, 1) + 1) / 2
        out["latent"] = lat
    safetensors_io.save(os.path.join(gen_flux.OUT, "kontext.safetensors"), out,
                        {"generator": "tests/golden/gen_flux_kontext.py"})
    for k, v in out.items():
        print(k, tuple(v.shape), "std %.4f" % float(v.std()))


if __name__ == "__main__":
    main()
