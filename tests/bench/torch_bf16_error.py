#!/usr/bin/python3
"""PyTorch's side of tests/bench/bf16_error.lua: the SD 1.5 UNet (torch_sd.py's module,
the same random weights and inputs) evaluated once in f32 and once under PyTorch's
mixed precision (torch.autocast("cpu", bfloat16): convolutions, linear layers and
matrix products in bf16 through oneDNN with f32 sums), the error as max |bf16 - f32| /
max |f32|. With --kiln PATH (bf16_error.lua's --out file) it also compares kiln's f32
output with PyTorch's f32 one (the two f32 networks must agree) and kiln's bf16 output
with PyTorch's f32 one.

Usage: /usr/bin/python3 tests/bench/torch_bf16_error.py WEIGHTS [--size 64] [--kiln PATH]
Prints one JSON line."""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_sd  # noqa: E402


def f32_norms():
    """Norms in f32 under autocast (as mixed-precision pipelines run them): the input
    widened, the norm computed with autocast off; the result stays f32."""
    for cls in (torch.nn.GroupNorm, torch.nn.LayerNorm):
        fwd = cls.forward

        def forward(self, x, fwd=fwd):
            with torch.autocast("cpu", enabled=False):
                return fwd(self, x.float())
        cls.forward = forward


def main(argv):
    if len(argv) < 2:
        raise SystemExit(__doc__)
    path, size, kiln_out = argv[1], 64, None
    i = 2
    while i < len(argv):
        if argv[i] == "--size":
            size = int(argv[i + 1])
        elif argv[i] == "--kiln":
            kiln_out = argv[i + 1]
        else:
            raise SystemExit("unknown option %s" % argv[i])
        i += 2
    torch.set_num_threads(2)
    model = torch_sd.build("unet", path)
    torch.manual_seed(11)
    x = torch.randn(1, 4, size, size)
    torch.manual_seed(12)
    ctx = torch.randn(1, 77, 768)
    t = torch.full((1,), 500.0)
    with torch.no_grad():
        f32 = model(x, t, ctx).float()
        f32_norms()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model(x, t, ctx).float()
    scale = f32.abs().max().item()
    r = {"size": size, "torch_bf16_err": (bf16 - f32).abs().max().item() / scale, "f32_max": scale}
    if kiln_out:
        from safetensors_io import load
        k, _ = load(kiln_out)
        kf, kb = k["f32"].reshape(f32.shape), k["bf16"].reshape(f32.shape)
        r["kiln_f32_vs_torch_f32"] = (kf - f32).abs().max().item() / scale
        r["kiln_bf16_vs_torch_f32"] = (kb - f32).abs().max().item() / scale
        r["kiln_bf16_vs_kiln_f32"] = (kb - kf).abs().max().item() / kf.abs().max().item()
    print(json.dumps(r))


if __name__ == "__main__":
    main(sys.argv)
