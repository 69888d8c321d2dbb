#!/usr/bin/python3
"""Check sd_modules.py against the reference tensor lists in
shared/sd-keys/: builds SD 1.5 (full size, weights left uninitialised) and
the tiny test configurations, and compares names, shapes and state_dict
order exactly; then checks the shipped checkpoint's names against SD 1.5's
patterns (same names modulo block indices and counts).

    /usr/bin/python3 examples/models/check_sd_layout.py [checkpoint]
"""

import os
import sys

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import safetensors_io                                   # noqa: E402
from sd_modules import (AutoencoderKL, CLIPTextConfig, FrozenCLIPEmbedder,  # noqa: E402
                        LatentDiffusion, UNetConfig, UNetModel, VAEConfig,
                        check_sd_names)

KEYS = next(p for p in (os.path.join(HERE, "../../shared/sd-keys"),
                        os.path.join(HERE, "../../../shared/sd-keys"),
                        "/work/shared/sd-keys") if os.path.isdir(p))


def read_list(name):
    out = []
    with open(os.path.join(KEYS, name)) as f:
        for line in f:
            n, s = line.rstrip("\n").split("\t")
            out.append((n, [int(d) for d in s.strip("[]").split(",") if d.strip()]))
    return out


def listing(module, prefix=""):
    return [(prefix + k, list(v.shape)) for k, v in module.state_dict().items()]


def compare(what, ours, ref):
    ok = ours == ref
    print("%-16s %s: %d tensors%s" % (what, "same names, shapes and order" if ok
                                      else "DIFFERENT", len(ours), ""))
    if not ok:
        so, sr = dict(ours), dict(ref)
        print("  only ours:", [k for k in so if k not in sr][:5])
        print("  only ref :", [k for k in sr if k not in so][:5])
        print("  shape differs:", [k for k in so if k in sr and so[k] != sr[k]][:5])
        if set(so) == set(sr):
            print("  (same set, different order)")
    return ok


def no_init():
    """Skip weight initialisation (only names and shapes are needed)."""
    for f in ("kaiming_uniform_", "uniform_", "normal_", "zeros_", "ones_"):
        setattr(nn.init, f, lambda t, *a, **k: t)


def main():
    no_init()
    ok = True
    sd15 = LatentDiffusion(UNetConfig(), VAEConfig(), CLIPTextConfig())
    ok &= compare("sd15", listing(sd15), read_list("sd15.txt"))
    del sd15
    unet = UNetModel(UNetConfig(model_channels=32, channel_mult=(1, 2),
                                num_res_blocks=1, attention_resolutions=(2,),
                                num_heads=2, context_dim=64))
    ok &= compare("tiny-unet", listing(unet, "model.diffusion_model."),
                  read_list("tiny-unet.txt"))
    vae = AutoencoderKL(VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1,
                                  resolution=32))
    ok &= compare("tiny-vae", listing(vae, "first_stage_model."),
                  read_list("tiny-vae.txt"))
    clip = FrozenCLIPEmbedder(CLIPTextConfig(width=64, layers=2, heads=2))
    ok &= compare("tiny-clip-text", listing(clip, "cond_stage_model."),
                  read_list("tiny-clip-text.txt"))
    ckpt = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "kiln-shapes.safetensors")
    if os.path.exists(ckpt):
        sd, _ = safetensors_io.load(ckpt)
        extra, unused = check_sd_names({k: list(v.shape) for k, v in sd.items()},
                                       os.path.join(KEYS, "sd15.txt"))
        print("%s: %d tensors; patterns not in sd15.txt: %d %s; sd15 patterns "
              "this config does not use: %s" % (os.path.basename(ckpt), len(sd),
                                                len(extra), extra, unused))
        ok &= not extra
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
