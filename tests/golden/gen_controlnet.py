#!/usr/bin/env python3
"""Golden data for kiln.controlnet: a tiny SD 1.x ControlNet written independently from
the published ControlNet (cldm.ControlNet, ControlledUnetModel), over the tiny SD 1.x
UNet of gen_sd_golden.py (its modules and seeds).

Weights are not committed: controlnet/sd1.recipe lists every tensor as gen_sd_golden's
recipes do (torch.manual_seed(seed); torch.randn(shape) * std + mean), with the zero
convolutions random so that they test something. Outputs (controlnet/sd1.safetensors):
cn.<i> the residuals (input blocks, then the middle block) for x, t, context of
gen_sd_golden's unet_inputs and a batch-1 hint [1, 3, 64, 64] in [0, 1]; unet.control
the tiny SD 1.x UNet (sd/sd1.recipe) run with those residuals added.

Run: /usr/bin/python3 tests/golden/gen_controlnet.py
"""
import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_sd_golden as G  # noqa: E402

OUT = os.path.join(HERE, "controlnet")
torch.set_num_threads(2)


def conv_nd(cin, cout, k, **kw):
    return nn.Conv2d(cin, cout, k, **kw)


class ControlNet(nn.Module):
    """cldm.ControlNet for the tiny SD 1.x config (model_channels 32, channel_mult
    (1, 2), one res block, attention at ds 2, 2 heads, context 64)."""

    def __init__(self, in_channels=4, hint_channels=3, model_channels=32, channel_mult=(1, 2),
                 num_res_blocks=1, attention_resolutions=(2,), num_heads=2, context_dim=64):
        super().__init__()
        mc = model_channels
        ted = mc * 4
        self.mc = mc
        self.time_embed = nn.Sequential(nn.Linear(mc, ted), nn.SiLU(), nn.Linear(ted, ted))
        self.input_blocks = nn.ModuleList([G.TimestepEmbedSequential(conv_nd(in_channels, mc, 3, padding=1))])
        self.zero_convs = nn.ModuleList([self.make_zero_conv(mc)])
        self.input_hint_block = G.TimestepEmbedSequential(
            conv_nd(hint_channels, 16, 3, padding=1), nn.SiLU(),
            conv_nd(16, 16, 3, padding=1), nn.SiLU(),
            conv_nd(16, 32, 3, padding=1, stride=2), nn.SiLU(),
            conv_nd(32, 32, 3, padding=1), nn.SiLU(),
            conv_nd(32, 96, 3, padding=1, stride=2), nn.SiLU(),
            conv_nd(96, 96, 3, padding=1), nn.SiLU(),
            conv_nd(96, 256, 3, padding=1, stride=2), nn.SiLU(),
            conv_nd(256, mc, 3, padding=1))
        ch, ds = mc, 1
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                layers = [G.ResBlock(ch, ted, mult * mc)]
                ch = mult * mc
                if ds in attention_resolutions:
                    layers.append(G.SpatialTransformer(ch, num_heads, ch // num_heads, 1, context_dim, False))
                self.input_blocks.append(G.TimestepEmbedSequential(*layers))
                self.zero_convs.append(self.make_zero_conv(ch))
            if level != len(channel_mult) - 1:
                self.input_blocks.append(G.TimestepEmbedSequential(G.Downsample(ch)))
                self.zero_convs.append(self.make_zero_conv(ch))
                ds *= 2
        self.middle_block = G.TimestepEmbedSequential(
            G.ResBlock(ch, ted), G.SpatialTransformer(ch, num_heads, ch // num_heads, 1, context_dim, False),
            G.ResBlock(ch, ted))
        self.middle_block_out = self.make_zero_conv(ch)

    def make_zero_conv(self, ch):
        # zero_module(conv_nd(dims, ch, ch, 1, padding=0)); the recipe makes it random
        return G.TimestepEmbedSequential(conv_nd(ch, ch, 1, padding=0))

    def forward(self, x, hint, timesteps, context):
        emb = self.time_embed(G.timestep_embedding(timesteps, self.mc))
        guided_hint = self.input_hint_block(hint, emb, context)
        outs = []
        h = x
        for module, zero_conv in zip(self.input_blocks, self.zero_convs):
            if guided_hint is not None:
                h = module(h, emb, context)
                h += guided_hint
                guided_hint = None
            else:
                h = module(h, emb, context)
            outs.append(zero_conv(h, emb, context))
        h = self.middle_block(h, emb, context)
        outs.append(self.middle_block_out(h, emb, context))
        return outs


def controlled_unet(u, x, timesteps, context, control):
    """ControlledUnetModel.forward (only_mid_control False) over gen_sd_golden's UNet."""
    control = list(control)
    hs = []
    emb = u.time_embed(G.timestep_embedding(timesteps, u.mc))
    h = x
    for module in u.input_blocks:
        h = module(h, emb, context)
        hs.append(h)
    h = u.middle_block(h, emb, context)
    h += control.pop()
    for module in u.output_blocks:
        h = torch.cat([h, hs.pop() + control.pop()], dim=1)
        h = module(h, emb, context)
    return u.out(h)


def main():
    os.makedirs(OUT, exist_ok=True)
    with torch.no_grad():
        m = G.sd1_model()
        G.init_recipe(m, 10000)                    # the same weights as sd/sd1.recipe
        u = m.model.diffusion_model
        root = G.Root()
        root.control_model = ControlNet()
        recipe = G.init_recipe(root, 40000)
        with open(os.path.join(OUT, "sd1.recipe"), "w") as f:
            f.write("# written by tests/golden/gen_controlnet.py: name, dtype, shape, seed, std, mean\n")
            f.write("# tensor = torch.manual_seed(seed); torch.randn(shape) * std + mean\n")
            for name, dt, shape, seed, std, mean in recipe:
                f.write("%s\t%s\t%s\t%d\t%.9g\t%.9g\n" % (name, dt, G.json.dumps(shape), seed, std, mean))
        x, t, ctx = G.unet_inputs(64)
        hint = (G.seeded([1, 3, 64, 64], 6) * 0.25 + 0.5).clamp(0, 1)
        outs = root.control_model(x, hint.expand(2, -1, -1, -1), t, ctx)
        g = {"hint": hint}
        for i, o in enumerate(outs):
            g["cn.%d" % i] = o
        g["unet.control"] = controlled_unet(u, x, t, ctx, outs)
        G.save(os.path.join(OUT, "sd1.safetensors"), g)
    for f in sorted(os.listdir(OUT)):
        print("  %-22s %7d bytes" % (f, os.path.getsize(os.path.join(OUT, f))))


if __name__ == "__main__":
    main()
