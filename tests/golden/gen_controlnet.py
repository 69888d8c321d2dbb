#!/usr/bin/env python3
"""Golden data for kiln.controlnet: a tiny SD 1.x ControlNet written independently from
the published ControlNet (cldm.ControlNet, ControlledUnetModel), over the tiny SD 1.x
UNet of gen_sd_golden.py (its modules and seeds).

Weights are not committed: controlnet/sd1.recipe lists every tensor as gen_sd_golden's
recipes do (torch.manual_seed(seed); torch.randn(shape) * std + mean), with the zero
convolutions random so that they test something. Outputs (controlnet/sd1.safetensors):
cn.<i> the residuals (input blocks, then the middle block) for x, t, context of
gen_sd_golden's unet_inputs and a batch-1 hint [1, 3, 64, 64] in [0, 1]; unet.control
the tiny SD 1.x UNet (sd/sd1.recipe) run with those residuals added. The same for
SDXL (controlnet/sdxl.recipe, controlnet/sdxl.safetensors, with y): sgm's ControlNet
with label_emb over the tiny SDXL UNet of sd/sdxl.recipe.

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
    """cldm.ControlNet (sgm's for SDXL: label_emb, transformer depth per level) for the
    tiny configs: by default SD 1.x's (model_channels 32, channel_mult (1, 2), one res
    block, attention at ds 2, 2 heads, context 64)."""

    def __init__(self, in_channels=4, hint_channels=3, model_channels=32, channel_mult=(1, 2),
                 num_res_blocks=1, attention_resolutions=(2,), num_heads=2, num_head_channels=-1,
                 transformer_depth=1, transformer_depth_middle=None, context_dim=64, use_linear=False,
                 adm_in_channels=None):
        super().__init__()
        mc = model_channels
        ted = mc * 4
        self.mc = mc
        depth = transformer_depth if isinstance(transformer_depth, (list, tuple)) else \
            [transformer_depth] * len(channel_mult)
        depth_mid = depth[-1] if transformer_depth_middle is None else transformer_depth_middle

        def st(ch, d):
            if num_head_channels == -1:
                h, dh = num_heads, ch // num_heads
            else:
                h, dh = ch // num_head_channels, num_head_channels
            return G.SpatialTransformer(ch, h, dh, d, context_dim, use_linear)

        self.time_embed = nn.Sequential(nn.Linear(mc, ted), nn.SiLU(), nn.Linear(ted, ted))
        self.label_emb = None
        if adm_in_channels is not None:
            self.label_emb = nn.Sequential(nn.Sequential(nn.Linear(adm_in_channels, ted), nn.SiLU(),
                                                         nn.Linear(ted, ted)))
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
                if ds in attention_resolutions and depth[level] > 0:
                    layers.append(st(ch, depth[level]))
                self.input_blocks.append(G.TimestepEmbedSequential(*layers))
                self.zero_convs.append(self.make_zero_conv(ch))
            if level != len(channel_mult) - 1:
                self.input_blocks.append(G.TimestepEmbedSequential(G.Downsample(ch)))
                self.zero_convs.append(self.make_zero_conv(ch))
                ds *= 2
        self.middle_block = G.TimestepEmbedSequential(
            G.ResBlock(ch, ted), st(ch, depth_mid), G.ResBlock(ch, ted))
        self.middle_block_out = self.make_zero_conv(ch)

    def make_zero_conv(self, ch):
        # zero_module(conv_nd(dims, ch, ch, 1, padding=0)); the recipe makes it random
        return G.TimestepEmbedSequential(conv_nd(ch, ch, 1, padding=0))

    def forward(self, x, hint, timesteps, context, y=None):
        emb = self.time_embed(G.timestep_embedding(timesteps, self.mc))
        if self.label_emb is not None:
            emb = emb + self.label_emb(y)
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


def controlled_unet(u, x, timesteps, context, control, y=None):
    """ControlledUnetModel.forward (only_mid_control False) over gen_sd_golden's UNet."""
    control = list(control)
    hs = []
    emb = u.time_embed(G.timestep_embedding(timesteps, u.mc))
    if y is not None:
        emb = emb + u.label_emb(y)
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

        # SDXL: the tiny SDXL UNet of sd/sdxl.recipe and an SDXL ControlNet of the same
        # shape (head size 16, no attention at level 0, depth 2, context 128, label_emb)
        m = G.sdxl_model()
        G.init_recipe(m, 30000)                    # the same weights as sd/sdxl.recipe
        u = m.model.diffusion_model
        root = G.Root()
        root.control_model = ControlNet(num_head_channels=16, use_linear=True, transformer_depth=[0, 2],
                                        transformer_depth_middle=2, context_dim=128,
                                        adm_in_channels=G.XL_POOLED + 6 * 256)
        recipe = G.init_recipe(root, 50000)
        with open(os.path.join(OUT, "sdxl.recipe"), "w") as f:
            f.write("# written by tests/golden/gen_controlnet.py: name, dtype, shape, seed, std, mean\n")
            f.write("# tensor = torch.manual_seed(seed); torch.randn(shape) * std + mean\n")
            for name, dt, shape, seed, std, mean in recipe:
                f.write("%s\t%s\t%s\t%d\t%.9g\t%.9g\n" % (name, dt, G.json.dumps(shape), seed, std, mean))
        x, t, ctx = G.unet_inputs(128)
        y = G.seeded([2, G.XL_POOLED + 6 * 256], 7)
        hint = (G.seeded([1, 3, 64, 64], 6) * 0.25 + 0.5).clamp(0, 1)
        outs = root.control_model(x, hint.expand(2, -1, -1, -1), t, ctx, y)
        g = {"hint": hint, "y": y}
        for i, o in enumerate(outs):
            g["cn.%d" % i] = o
        g["unet.control"] = controlled_unet(u, x, t, ctx, outs, y)
        G.save(os.path.join(OUT, "sdxl.safetensors"), g)
    for f in sorted(os.listdir(OUT)):
        print("  %-22s %7d bytes" % (f, os.path.getsize(os.path.join(OUT, f))))


if __name__ == "__main__":
    main()
