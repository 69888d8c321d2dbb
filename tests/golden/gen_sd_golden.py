#!/usr/bin/python3
"""Golden data for tests/lua/sd_test.lua: tiny Stable Diffusion checkpoints
(SD 1.x, SD 2.x and SDXL layouts) and the outputs of a PyTorch reference.

Run from the repository root:  /usr/bin/python3 tests/golden/gen_sd_golden.py
(--add-only: outputs already in the golden files keep their bytes; new ones are added)

The reference modules below are written from the published code (CompVis
ldm/modules/diffusionmodules/openaimodel.py and model.py, ldm attention.py,
transformers' modeling_clip.py, open_clip's TextTransformer, sgm's SDXL
conditioner), with the original attribute names and creation order, so that
state_dict() gives the original single-file names. Only hyper-parameters are
small. The SD 1.x configuration is exactly the one listed in
$KILN_SHARED/sd-keys/tiny-{unet,vae,clip-text}.txt (checked below when that folder
exists); the SD 2.x and SDXL ones reuse the real name patterns of sd21.txt and
sdxl.txt (also checked).

Weights are not committed. Every tensor is torch.manual_seed(seed);
torch.randn(shape) * std + mean, and the recipe (name, shape, seed, std, mean)
is written to tests/golden/sd/<ckpt>.recipe; the Lua test rebuilds the same
checkpoint with kiln.randn (same values as torch for a seed), saves it, and
loads it with kiln.load_checkpoint. Inputs are seeded the same way. The golden
outputs (float32) are in tests/golden/sd/<ckpt>.safetensors."""
import json
import math
import os
import re
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(2)
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "sd")
ROOT = os.path.dirname(os.path.dirname(HERE))
SHARED = os.environ.get("KILN_SHARED", os.path.join(ROOT, "..", "shared"))


# ------------------------------------------------------------------ CLIP (HF)

def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


class CLIPTextEmbeddings(nn.Module):
    def __init__(self, vocab, width, positions):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(positions, width)
        self.register_buffer("position_ids", torch.arange(positions).unsqueeze(0))

    def forward(self, ids):
        return self.token_embedding(ids) + self.position_embedding(self.position_ids[:, :ids.shape[1]])


class CLIPAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.q_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x, mask):
        b, n, w = x.shape
        h = self.heads
        d = w // h
        q = (self.q_proj(x) * d ** -0.5).view(b, n, h, d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, h, d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, h, d).transpose(1, 2)
        a = (q @ k.transpose(-1, -2) + mask).softmax(dim=-1)
        return self.out_proj((a @ v).transpose(1, 2).reshape(b, n, w))


class CLIPMLP(nn.Module):
    def __init__(self, width, mlp, act):
        super().__init__()
        self.act = act
        self.fc1 = nn.Linear(width, mlp)
        self.fc2 = nn.Linear(mlp, width)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, width, heads, mlp, act):
        super().__init__()
        self.self_attn = CLIPAttention(width, heads)
        self.layer_norm1 = nn.LayerNorm(width)
        self.mlp = CLIPMLP(width, mlp, act)
        self.layer_norm2 = nn.LayerNorm(width)

    def forward(self, x, mask):
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, width, heads, mlp, layers, act):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(width, heads, mlp, act) for _ in range(layers))


class CLIPTextTransformer(nn.Module):
    def __init__(self, vocab=49408, width=64, heads=2, layers=2, mlp=256, positions=77, act=quick_gelu):
        super().__init__()
        self.embeddings = CLIPTextEmbeddings(vocab, width, positions)
        self.encoder = CLIPEncoder(width, heads, mlp, layers, act)
        self.final_layer_norm = nn.LayerNorm(width)

    def forward(self, ids):
        """-> list of hidden states: [embeddings, after layer 1, ..., after last]."""
        n = ids.shape[1]
        x = self.embeddings(ids)
        mask = torch.full((n, n), float("-inf")).triu(1)
        hs = [x]
        for layer in self.encoder.layers:
            x = layer(x, mask)
            hs.append(x)
        return hs


class CLIPTextModel(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.text_model = CLIPTextTransformer(**kw)


class FrozenCLIPEmbedder(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.transformer = CLIPTextModel(**kw)


# ------------------------------------------------------------ CLIP (OpenCLIP)

class OCMLP(nn.Module):
    def __init__(self, width, mlp):
        super().__init__()
        self.c_fc = nn.Linear(width, mlp)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(mlp, width)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width, heads, mlp):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads)   # in_proj_weight packs q, k, v
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = OCMLP(width, mlp)

    def forward(self, x, mask):                            # x: [L, B, W] as open_clip
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class OCTransformer(nn.Module):
    def __init__(self, width, layers, heads, mlp):
        super().__init__()
        self.resblocks = nn.ModuleList(ResidualAttentionBlock(width, heads, mlp) for _ in range(layers))


class OpenCLIPText(nn.Module):
    """open_clip.CLIP with the visual tower deleted (as SD 2 / SDXL do)."""

    def __init__(self, vocab=49408, width=64, heads=2, layers=3, mlp=256, positions=77, proj=64):
        super().__init__()
        self.positional_embedding = nn.Parameter(torch.empty(positions, width))
        self.text_projection = nn.Parameter(torch.empty(width, proj))
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))
        self.transformer = OCTransformer(width, layers, heads, mlp)
        self.token_embedding = nn.Embedding(vocab, width)
        self.ln_final = nn.LayerNorm(width)

    def forward(self, ids):
        n = ids.shape[1]
        x = self.token_embedding(ids) + self.positional_embedding[:n]
        mask = torch.full((n, n), float("-inf")).triu(1)
        x = x.permute(1, 0, 2)
        hs = [x.permute(1, 0, 2)]
        for r in self.transformer.resblocks:
            x = r(x, mask)
            hs.append(x.permute(1, 0, 2))
        return hs

    def pooled(self, last, ids):
        x = self.ln_final(last)
        return x[torch.arange(x.shape[0]), ids.argmax(dim=-1)] @ self.text_projection


class FrozenOpenCLIPEmbedder(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.model = OpenCLIPText(**kw)


# ------------------------------------------------------------------ UNet

class GroupNorm32(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


def normalization(ch):
    return GroupNorm32(32, ch)


def Normalize(ch):
    return nn.GroupNorm(32, ch, eps=1e-6, affine=True)


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedSequential(nn.Sequential):
    def forward(self, x, emb, context, output_shape=None):
        for layer in self:
            if isinstance(layer, ResBlock):
                x = layer(x, emb)
            elif isinstance(layer, SpatialTransformer):
                x = layer(x, context)
            elif isinstance(layer, Upsample):
                x = layer(x, output_shape)
            else:
                x = layer(x)
        return x


class ResBlock(nn.Module):
    def __init__(self, ch, emb_ch, out_ch=None):
        super().__init__()
        out_ch = out_ch or ch
        self.in_layers = nn.Sequential(normalization(ch), nn.SiLU(), nn.Conv2d(ch, out_ch, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_ch, out_ch))
        self.out_layers = nn.Sequential(normalization(out_ch), nn.SiLU(), nn.Dropout(0.0),
                                        nn.Conv2d(out_ch, out_ch, 3, padding=1))
        self.skip_connection = nn.Identity() if out_ch == ch else nn.Conv2d(ch, out_ch, 1)

    def forward(self, x, emb):
        h = self.in_layers(x)
        h = h + self.emb_layers(emb)[:, :, None, None]
        return self.skip_connection(x) + self.out_layers(h)


class Downsample(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.op = nn.Conv2d(ch, ch, 3, stride=2, padding=1)

    def forward(self, x):
        return self.op(x)


class Upsample(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x, output_shape=None):
        # ComfyUI's Upsample: to the size of the skip connection it meets next (any
        # latent size), else 2x as the original
        if output_shape is None:
            return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))
        return self.conv(F.interpolate(x, size=tuple(output_shape[2:4]), mode="nearest"))


class CrossAttention(nn.Module):
    def __init__(self, qdim, cdim, heads, dim_head):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_q = nn.Linear(qdim, inner, bias=False)
        self.to_k = nn.Linear(cdim or qdim, inner, bias=False)
        self.to_v = nn.Linear(cdim or qdim, inner, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, qdim), nn.Dropout(0.0))

    def forward(self, x, context=None):
        context = x if context is None else context
        b, n, _ = x.shape
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        q, k, v = (t.reshape(b, t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))
        a = ((q @ k.transpose(-1, -2)) * self.scale).softmax(dim=-1)
        return self.to_out((a @ v).transpose(1, 2).reshape(b, n, -1))


class GEGLU(nn.Module):
    def __init__(self, din, dout):
        super().__init__()
        self.proj = nn.Linear(din, dout * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.net = nn.Sequential(GEGLU(dim, dim * mult), nn.Dropout(0.0), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, heads, dim_head, context_dim):
        super().__init__()
        self.attn1 = CrossAttention(dim, None, heads, dim_head)
        self.ff = FeedForward(dim)
        self.attn2 = CrossAttention(dim, context_dim, heads, dim_head)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)

    def forward(self, x, context):
        x = self.attn1(self.norm1(x)) + x
        x = self.attn2(self.norm2(x), context) + x
        return self.ff(self.norm3(x)) + x


class SpatialTransformer(nn.Module):
    def __init__(self, ch, heads, dim_head, depth, context_dim, use_linear):
        super().__init__()
        inner = heads * dim_head
        self.use_linear = use_linear
        self.norm = Normalize(ch)
        self.proj_in = nn.Linear(ch, inner) if use_linear else nn.Conv2d(ch, inner, 1)
        self.transformer_blocks = nn.ModuleList(
            BasicTransformerBlock(inner, heads, dim_head, context_dim) for _ in range(depth))
        self.proj_out = nn.Linear(inner, ch) if use_linear else nn.Conv2d(inner, ch, 1)

    def forward(self, x, context):
        b, c, h, w = x.shape
        x_in = x
        x = self.norm(x)
        if not self.use_linear:
            x = self.proj_in(x)
        x = x.flatten(2).transpose(1, 2)
        if self.use_linear:
            x = self.proj_in(x)
        for blk in self.transformer_blocks:
            x = blk(x, context)
        if self.use_linear:
            x = self.proj_out(x)
        x = x.transpose(1, 2).reshape(b, -1, h, w)
        if not self.use_linear:
            x = self.proj_out(x)
        return x + x_in


class UNetModel(nn.Module):
    """openaimodel.UNetModel (use_spatial_transformer, legacy False,
    use_scale_shift_norm False, resblock_updown False, conv_resample True);
    transformer_depth per level as sgm; num_classes "sequential" -> label_emb."""

    def __init__(self, in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2),
                 num_res_blocks=1, attention_resolutions=(2,), num_heads=-1, num_head_channels=-1,
                 transformer_depth=1, transformer_depth_middle=None, context_dim=64,
                 use_linear=False, adm_in_channels=None):
        super().__init__()
        mc = model_channels
        ted = mc * 4
        self.mc = mc
        depth = transformer_depth if isinstance(transformer_depth, (list, tuple)) else \
            [transformer_depth] * len(channel_mult)
        depth_mid = depth[-1] if transformer_depth_middle is None else transformer_depth_middle

        def heads_of(ch):
            if num_head_channels == -1:
                return num_heads, ch // num_heads
            return ch // num_head_channels, num_head_channels

        def st(ch, d):
            h, dh = heads_of(ch)
            return SpatialTransformer(ch, h, dh, d, context_dim, use_linear)

        self.time_embed = nn.Sequential(nn.Linear(mc, ted), nn.SiLU(), nn.Linear(ted, ted))
        if adm_in_channels is not None:
            self.label_emb = nn.Sequential(nn.Sequential(nn.Linear(adm_in_channels, ted), nn.SiLU(),
                                                         nn.Linear(ted, ted)))
        self.input_blocks = nn.ModuleList([TimestepEmbedSequential(nn.Conv2d(in_channels, mc, 3, padding=1))])
        chans = [mc]
        ch, ds = mc, 1
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                layers = [ResBlock(ch, ted, mult * mc)]
                ch = mult * mc
                if ds in attention_resolutions:
                    layers.append(st(ch, depth[level]))
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                chans.append(ch)
            if level != len(channel_mult) - 1:
                self.input_blocks.append(TimestepEmbedSequential(Downsample(ch)))
                chans.append(ch)
                ds *= 2
        self.middle_block = TimestepEmbedSequential(ResBlock(ch, ted), st(ch, depth_mid), ResBlock(ch, ted))
        self.output_blocks = nn.ModuleList()
        for level, mult in list(enumerate(channel_mult))[::-1]:
            for i in range(num_res_blocks + 1):
                layers = [ResBlock(ch + chans.pop(), ted, mc * mult)]
                ch = mc * mult
                if ds in attention_resolutions:
                    layers.append(st(ch, depth[level]))
                if level and i == num_res_blocks:
                    layers.append(Upsample(ch))
                    ds //= 2
                self.output_blocks.append(TimestepEmbedSequential(*layers))
        self.out = nn.Sequential(normalization(ch), nn.SiLU(), nn.Conv2d(mc, out_channels, 3, padding=1))

    def forward(self, x, t, context, y=None, comfy_up=False):
        emb = self.time_embed(timestep_embedding(t, self.mc))
        if y is not None:
            emb = emb + self.label_emb(y)
        hs = []
        h = x
        for blk in self.input_blocks:
            h = blk(h, emb, context)
            hs.append(h)
        h = self.middle_block(h, emb, context)
        for blk in self.output_blocks:
            h = torch.cat([h, hs.pop()], dim=1)
            h = blk(h, emb, context, hs[-1].shape if comfy_up and hs else None)
        return self.out(h)


class DiffusionWrapper(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.diffusion_model = UNetModel(**kw)


# ------------------------------------------------------------------ VAE

def swish(x):
    return x * torch.sigmoid(x)


class VResnetBlock(nn.Module):
    def __init__(self, cin, cout=None):
        super().__init__()
        cout = cout or cin
        self.norm1 = Normalize(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = Normalize(cout)
        self.dropout = nn.Dropout(0.0)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)
        self.cin, self.cout = cin, cout

    def forward(self, x):
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(self.dropout(swish(self.norm2(h))))
        if self.cin != self.cout:
            x = self.nin_shortcut(x)
        return x + h


class VAttnBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.norm = Normalize(ch)
        self.q = nn.Conv2d(ch, ch, 1)
        self.k = nn.Conv2d(ch, ch, 1)
        self.v = nn.Conv2d(ch, ch, 1)
        self.proj_out = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, hh, ww = q.shape
        q = q.reshape(b, c, hh * ww).permute(0, 2, 1)
        k = k.reshape(b, c, hh * ww)
        w_ = torch.bmm(q, k) * (int(c) ** (-0.5))
        w_ = F.softmax(w_, dim=2)
        v = v.reshape(b, c, hh * ww)
        h = torch.bmm(v, w_.permute(0, 2, 1)).reshape(b, c, hh, ww)
        return x + self.proj_out(h)


class VDownsample(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class Level(nn.Module):
    pass


class Encoder(nn.Module):
    def __init__(self, ch=32, ch_mult=(1, 2), num_res_blocks=1, in_channels=3, z_channels=4):
        super().__init__()
        self.n = len(ch_mult)
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        in_mult = (1,) + tuple(ch_mult)
        self.down = nn.ModuleList()
        for i in range(self.n):
            lv = Level()
            lv.block = nn.ModuleList()
            lv.attn = nn.ModuleList()
            bin_, bout = ch * in_mult[i], ch * ch_mult[i]
            for _ in range(num_res_blocks):
                lv.block.append(VResnetBlock(bin_, bout))
                bin_ = bout
            if i != self.n - 1:
                lv.downsample = VDownsample(bin_)
            self.down.append(lv)
        self.mid = Level()
        self.mid.block_1 = VResnetBlock(bin_)
        self.mid.attn_1 = VAttnBlock(bin_)
        self.mid.block_2 = VResnetBlock(bin_)
        self.norm_out = Normalize(bin_)
        self.conv_out = nn.Conv2d(bin_, 2 * z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for i, lv in enumerate(self.down):
            for blk in lv.block:
                h = blk(h)
            if i != self.n - 1:
                h = lv.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, ch=32, ch_mult=(1, 2), num_res_blocks=1, out_ch=3, z_channels=4):
        super().__init__()
        self.n = len(ch_mult)
        bin_ = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, bin_, 3, padding=1)
        self.mid = Level()
        self.mid.block_1 = VResnetBlock(bin_)
        self.mid.attn_1 = VAttnBlock(bin_)
        self.mid.block_2 = VResnetBlock(bin_)
        ups = []
        for i in reversed(range(self.n)):
            lv = Level()
            lv.block = nn.ModuleList()
            lv.attn = nn.ModuleList()
            bout = ch * ch_mult[i]
            for _ in range(num_res_blocks + 1):
                lv.block.append(VResnetBlock(bin_, bout))
                bin_ = bout
            if i != 0:
                lv.upsample = Upsample(bin_)
            ups.insert(0, lv)
        self.up = nn.ModuleList(ups)
        self.norm_out = Normalize(bin_)
        self.conv_out = nn.Conv2d(bin_, out_ch, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for i in reversed(range(self.n)):
            lv = self.up[i]
            for blk in lv.block:
                h = blk(h)
            if i != 0:
                h = lv.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class AutoencoderKL(nn.Module):
    def __init__(self, embed_dim=4, **kw):
        super().__init__()
        self.encoder = Encoder(**kw)
        self.decoder = Decoder(**kw)
        self.quant_conv = nn.Conv2d(8, 2 * embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(embed_dim, 4, 1)


# --------------------------------------------------------------- whole models

class Root(nn.Module):
    pass


def sd1_model():
    m = Root()
    m.model = DiffusionWrapper(num_heads=2)                    # tiny-unet.txt
    m.first_stage_model = AutoencoderKL()                      # tiny-vae.txt
    m.cond_stage_model = FrozenCLIPEmbedder()                  # tiny-clip-text.txt
    return m


def sd2_model():
    m = Root()
    # SD 2.x layout: linear proj_in, head size 64 (the family default: 1 head at 64 ch)
    m.model = DiffusionWrapper(num_head_channels=64, use_linear=True)
    m.first_stage_model = AutoencoderKL()
    m.cond_stage_model = FrozenOpenCLIPEmbedder(heads=1, layers=3)   # 64/64 = 1 head (default)
    return m


XL_POOLED = 32


def sdxl_model():
    m = Root()
    # SDXL layout: no attention at level 0, depth 2 elsewhere, linear proj_in,
    # label_emb for pooled (32) + 6 size embeddings (6 * 256); head size 16 via metadata
    m.model = DiffusionWrapper(num_head_channels=16, use_linear=True, transformer_depth=[0, 2],
                               transformer_depth_middle=2, context_dim=128,
                               adm_in_channels=XL_POOLED + 6 * 256)
    m.first_stage_model = AutoencoderKL()
    m.conditioner = Root()
    e0, e1 = Root(), Root()
    e0.transformer = CLIPTextModel()                            # CLIP-L stand-in, 2 heads (metadata)
    e1.model = OpenCLIPText(heads=2, layers=3, proj=XL_POOLED)  # bigG stand-in, 2 heads (metadata)
    m.conditioner.embedders = nn.ModuleList([e0, e1])
    return m


# ------------------------------------------------------------------ weights

NORMS = (nn.LayerNorm, nn.GroupNorm)


def init_recipe(model, base_seed):
    """Seeds every tensor; returns the recipe lines (state_dict order)."""
    norm_params = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, NORMS):
            norm_params.add(mname + ".weight")
    recipe = []
    sd = model.state_dict()
    new = {}
    for i, (name, t) in enumerate(sd.items()):
        seed = base_seed + i
        shape = list(t.shape)
        if name.endswith("position_ids"):
            new[name] = torch.arange(shape[1]).unsqueeze(0)
            recipe.append((name, "i64", shape, 0, 0.0, 0.0))
            continue
        if len(shape) == 0:                                   # logit_scale
            new[name] = torch.tensor(4.6052)
            recipe.append((name, "f32", shape, 0, 0.0, 4.6052))
            continue
        if name in norm_params:
            std, mean = 0.1, 1.0
        elif len(shape) == 1:
            std, mean = 0.1, 0.0
        else:
            std, mean = 1.0 / math.sqrt(float(np.prod(shape[1:]))), 0.0
        torch.manual_seed(seed)
        new[name] = torch.randn(shape) * std + mean
        recipe.append((name, "f32", shape, seed, std, mean))
    model.load_state_dict(new, strict=True)
    return recipe


def write_recipe(path, recipe, meta):
    with open(path, "w") as f:
        f.write("# written by tests/golden/gen_sd_golden.py: name, dtype, shape, seed, std, mean\n")
        f.write("# tensor = torch.manual_seed(seed); torch.randn(shape) * std + mean (i64: arange)\n")
        for k, v in sorted(meta.items()):
            f.write("@%s\t%s\n" % (k, v))
        for name, dt, shape, seed, std, mean in recipe:
            f.write("%s\t%s\t%s\t%d\t%.9g\t%.9g\n" % (name, dt, json.dumps(shape), seed, std, mean))


def seeded(shape, seed):
    torch.manual_seed(seed)
    return torch.randn(shape)


def load_raw(path):
    """name -> (shape, bytes) of a golden file written by save()."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    body = data[8 + n:]
    return {k: (v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def save(path, tensors, meta=None):
    # --add-only: outputs the file already holds keep their bytes (PyTorch's float
    # results differ by an ulp between machines); only new names take new values
    old = load_raw(path) if "--add-only" in sys.argv and os.path.exists(path) else {}
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        a = np.ascontiguousarray(t.detach().float().numpy().astype("<f4"))
        b = a.tobytes()
        if k in old and old[k][0] == list(a.shape):
            b = old[k][1]
        header[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = dict(meta or {}, generator="tests/golden/gen_sd_golden.py", torch=torch.__version__)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


# ------------------------------------------------------------------ checks

def read_list(path):
    out = {}
    with open(path) as f:
        for line in f:
            name, shape = line.rstrip("\n").split("\t")
            out[name] = json.loads(shape)
    return out


_IDX = re.compile(r"(input_blocks|output_blocks|transformer_blocks|layers|resblocks|down|up|block)\.\d+(?=\.)")


def pattern(name):
    return _IDX.sub(lambda m: m.group(1) + ".N", name)


def check_names(model, which):
    sd = {k: list(v.shape) for k, v in model.state_dict().items()}
    if which == "sd1":
        ref = {}
        for part in ("tiny-unet.txt", "tiny-vae.txt", "tiny-clip-text.txt"):
            path = os.path.join(SHARED, "sd-keys", part)
            if not os.path.exists(path):
                print("  (skipping the name check: %s is absent)" % path)
                return
            ref.update(read_list(path))
        if sd != ref:
            missing = sorted(set(ref) - set(sd))[:5]
            extra = sorted(set(sd) - set(ref))[:5]
            bad = sorted(k for k in set(sd) & set(ref) if sd[k] != ref[k])[:5]
            sys.exit("sd1 names differ from tiny-*.txt: missing %s extra %s shapes %s" % (missing, extra, bad))
        print("  sd1: %d names and shapes equal tiny-unet/vae/clip-text.txt" % len(sd))
        return
    path = os.path.join(SHARED, "sd-keys", {"sd2": "sd21.txt", "sdxl": "sdxl.txt"}[which])
    if not os.path.exists(path):
        print("  (skipping the name check: %s is absent)" % path)
        return
    ref = {"%s %d" % (pattern(k), len(v)) for k, v in read_list(path).items()}
    ours = {"%s %d" % (pattern(k), len(v)) for k, v in sd.items()}
    extra = sorted(ours - ref)
    if extra:
        sys.exit("%s: names not in %s: %s" % (which, path, extra[:8]))
    print("  %s: every name pattern and rank occurs in %s" % (which, os.path.basename(path)))


# ------------------------------------------------------- diffusers names

RES_RENAME = {"in_layers.0": "norm1", "in_layers.2": "conv1", "emb_layers.1": "time_emb_proj",
              "out_layers.0": "norm2", "out_layers.3": "conv2", "skip_connection": "conv_shortcut"}


def _rename_params(mod, orig_prefix, new_prefix, table, inner=None):
    for pname, _ in mod.named_parameters():
        new = pname
        if inner:
            for a, b in inner.items():
                if pname.startswith(a + "."):
                    new = b + pname[len(a):]
        table[orig_prefix + pname] = new_prefix + new


def diffusers_names(m):
    """orig name -> diffusers name, by walking the reference modules the way
    diffusers lays out UNet2DConditionModel and AutoencoderKL."""
    t = {}
    u = m.model.diffusion_model
    P = "model.diffusion_model."
    _rename_params(u.time_embed[0], P + "time_embed.0.", "time_embedding.linear_1.", t)
    _rename_params(u.time_embed[2], P + "time_embed.2.", "time_embedding.linear_2.", t)
    _rename_params(u.input_blocks[0][0], P + "input_blocks.0.0.", "conv_in.", t)
    level, res, att = 0, 0, 0
    for i, blk in enumerate(u.input_blocks):
        if i == 0:
            continue
        for k, layer in enumerate(blk):
            op = "%sinput_blocks.%d.%d." % (P, i, k)
            if isinstance(layer, ResBlock):
                _rename_params(layer, op, "down_blocks.%d.resnets.%d." % (level, res), t, RES_RENAME)
                res += 1
            elif isinstance(layer, SpatialTransformer):
                _rename_params(layer, op, "down_blocks.%d.attentions.%d." % (level, att), t)
                att += 1
            elif isinstance(layer, Downsample):
                _rename_params(layer.op, op + "op.", "down_blocks.%d.downsamplers.0.conv." % level, t)
                level, res, att = level + 1, 0, 0
    for k, layer in enumerate(u.middle_block):
        op = "%smiddle_block.%d." % (P, k)
        if isinstance(layer, ResBlock):
            _rename_params(layer, op, "mid_block.resnets.%d." % (k // 2), t, RES_RENAME)
        else:
            _rename_params(layer, op, "mid_block.attentions.0.", t)
    level, res, att = 0, 0, 0
    for i, blk in enumerate(u.output_blocks):
        for k, layer in enumerate(blk):
            op = "%soutput_blocks.%d.%d." % (P, i, k)
            if isinstance(layer, ResBlock):
                _rename_params(layer, op, "up_blocks.%d.resnets.%d." % (level, res), t, RES_RENAME)
                res += 1
            elif isinstance(layer, SpatialTransformer):
                _rename_params(layer, op, "up_blocks.%d.attentions.%d." % (level, att), t)
                att += 1
            elif isinstance(layer, Upsample):
                _rename_params(layer.conv, op + "conv.", "up_blocks.%d.upsamplers.0.conv." % level, t)
        if any(isinstance(layer, Upsample) for layer in blk):
            level, res, att = level + 1, 0, 0
    _rename_params(u.out[0], P + "out.0.", "conv_norm_out.", t)
    _rename_params(u.out[2], P + "out.2.", "conv_out.", t)

    v = m.first_stage_model
    P = "first_stage_model."
    VRES = {"nin_shortcut": "conv_shortcut"}
    VATT = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
    for side in ("encoder", "decoder"):
        coder = getattr(v, side)
        S = P + side + "."
        _rename_params(coder.conv_in, S + "conv_in.", side + ".conv_in.", t)
        _rename_params(coder.conv_out, S + "conv_out.", side + ".conv_out.", t)
        _rename_params(coder.norm_out, S + "norm_out.", side + ".conv_norm_out.", t)
        _rename_params(coder.mid.block_1, S + "mid.block_1.", side + ".mid_block.resnets.0.", t, VRES)
        _rename_params(coder.mid.block_2, S + "mid.block_2.", side + ".mid_block.resnets.1.", t, VRES)
        _rename_params(coder.mid.attn_1, S + "mid.attn_1.", side + ".mid_block.attentions.0.", t, VATT)
        levels = coder.down if side == "encoder" else coder.up
        n = len(levels)
        for i, lv in enumerate(levels):
            d = i if side == "encoder" else n - 1 - i
            kind = "down_blocks" if side == "encoder" else "up_blocks"
            for j, b in enumerate(lv.block):
                _rename_params(b, "%s%s.%d.block.%d." % (S, "down" if side == "encoder" else "up", i, j),
                               "%s.%s.%d.resnets.%d." % (side, kind, d, j), t, VRES)
            if hasattr(lv, "downsample"):
                _rename_params(lv.downsample.conv, "%sdown.%d.downsample.conv." % (S, i),
                               "%s.down_blocks.%d.downsamplers.0.conv." % (side, d), t)
            if hasattr(lv, "upsample"):
                _rename_params(lv.upsample.conv, "%sup.%d.upsample.conv." % (S, i),
                               "%s.up_blocks.%d.upsamplers.0.conv." % (side, d), t)
    for name in ("quant_conv", "post_quant_conv"):
        _rename_params(getattr(v, name), P + name + ".", name + ".", t)
    c = "cond_stage_model.transformer."
    for name, _ in m.cond_stage_model.transformer.named_parameters():
        t[c + name] = "text_encoder:" + name
    return t


# ------------------------------------------------------------------ goldens

def ids_batch():
    """Two 77-token windows: BOS, tokens, EOS, padding (49407 / 0)."""
    a = [49406, 320, 1125, 539, 320, 2368, 49407]
    b = [49406, 1000, 2000, 3000, 40000, 49000, 7, 11, 49407]
    pad_e = lambda s: s + [49407] * (77 - len(s))
    pad_0 = lambda s: s + [0] * (77 - len(s))
    return torch.tensor([pad_e(a), pad_e(b)]), torch.tensor([pad_0(a), pad_0(b)])


WEIGHTS = [1.0] * 77
for _i, _w in ((2, 1.21), (3, 1.21), (5, 1 / 1.1)):
    WEIGHTS[_i] = _w


def emphasis(z, w):
    """A1111 sd_hijack_clip: multiply by the per-token weights, restore the mean."""
    w = torch.tensor(w, dtype=torch.float32)
    original_mean = z.mean()
    z = z * w.reshape(1, -1, 1).expand(z.shape)
    new_mean = z.mean()
    return z * (original_mean / new_mean)


def unet_inputs(ctx_dim):
    x = seeded([2, 4, 8, 8], 1)
    t = torch.tensor([10, 500])
    ctx = seeded([2, 77, ctx_dim], 2)
    return x, t, ctx


def vae_goldens(vae, g, scale):
    z = seeded([1, 4, 8, 8], 3)
    img = (seeded([1, 3, 16, 16], 4) * 0.25 + 0.5).clamp(0, 1)
    dec = vae.decoder(vae.post_quant_conv(z / scale))
    g["vae.decode_raw"] = dec
    g["vae.decode"] = ((dec + 1) / 2).clamp(0, 1)
    mean, _ = vae.quant_conv(vae.encoder(img * 2 - 1)).chunk(2, dim=1)
    g["vae.encode"] = mean * scale


def size_embedding(vals):
    """sgm ConcatTimestepEmbedderND for (h, w) pairs, 256 each."""
    return torch.cat([timestep_embedding(torch.tensor([float(v)]), 256) for v in vals], dim=-1)


def main():
    os.makedirs(OUT, exist_ok=True)
    ids_e, ids_0 = ids_batch()
    with torch.no_grad():
        # ---- SD 1.x
        m = sd1_model()
        recipe = init_recipe(m, 10000)
        check_names(m, "sd1")
        meta = {"kiln.heads.unet": "2", "kiln.heads.clip": "2"}
        write_recipe(os.path.join(OUT, "sd1.recipe"), recipe, meta)
        g = {}
        clip = m.cond_stage_model.transformer.text_model
        hs = clip(ids_e)
        g["clip.last"] = clip.final_layer_norm(hs[-1])
        g["clip.skip2"] = clip.final_layer_norm(hs[-2])
        g["clip.emphasis"] = emphasis(clip.final_layer_norm(hs[-1])[:1], WEIGHTS)
        x, t, ctx = unet_inputs(64)
        g["unet.out"] = m.model.diffusion_model(x, t, ctx)
        # an odd latent size (7x5: the downsampler rounds up to 4x3, Upsample goes
        # back to the skip's 7x5), as ComfyUI runs any multiple of 8 pixels
        g["unet.odd"] = m.model.diffusion_model(seeded([2, 4, 7, 5], 5), t, ctx, comfy_up=True)
        vae_goldens(m.first_stage_model, g, 0.18215)
        save(os.path.join(OUT, "sd1.safetensors"), g)
        names = diffusers_names(m)
        missing = [k for k in m.state_dict() if k not in names and not k.endswith("position_ids")]
        if missing:
            sys.exit("no diffusers name for %s" % missing[:5])
        with open(os.path.join(OUT, "sd1.diffusers"), "w") as f:
            f.write("# original name -> diffusers name (unet/, vae/, text_encoder: in text_encoder/)\n")
            for k, v in names.items():
                f.write("%s\t%s\n" % (k, v))

        # ---- SD 2.x
        m = sd2_model()
        recipe = init_recipe(m, 20000)
        check_names(m, "sd2")
        write_recipe(os.path.join(OUT, "sd2.recipe"), recipe, {})
        g = {}
        oc = m.cond_stage_model.model
        hs = oc(ids_0)
        g["clip.penultimate"] = oc.ln_final(hs[-2])
        x, t, ctx = unet_inputs(64)
        g["unet.out"] = m.model.diffusion_model(x, t, ctx)
        save(os.path.join(OUT, "sd2.safetensors"), g)

        # ---- SDXL
        m = sdxl_model()
        recipe = init_recipe(m, 30000)
        check_names(m, "sdxl")
        meta = {"kiln.heads.clip": "2", "kiln.heads.clip_g": "2", "kiln.head_dim.unet": "16"}
        write_recipe(os.path.join(OUT, "sdxl.recipe"), recipe, meta)
        g = {}
        cl = m.conditioner.embedders[0].transformer.text_model
        cg = m.conditioner.embedders[1].model
        hl = cl(ids_e)[-2]                     # CLIP-L penultimate (hidden_states[11] of 12), no norm
        hgs = cg(ids_0)
        ctx = torch.cat([hl, hgs[-2]], dim=-1)  # bigG penultimate, no norm
        pooled = cg.pooled(hgs[-1], ids_0)
        g["clip.context"] = ctx
        g["clip.pooled"] = pooled
        sizes = [1024, 768, 0, 16, 1024, 768]   # original (h, w), crop (top, left), target (h, w)
        y = torch.cat([pooled, size_embedding(sizes).expand(2, -1)], dim=-1)
        g["unet.y"] = y
        x, t, _ = unet_inputs(128)
        g["unet.out"] = m.model.diffusion_model(x, t, ctx, y)
        save(os.path.join(OUT, "sdxl.safetensors"), g)
    for f in sorted(os.listdir(OUT)):
        print("  %-22s %7d bytes" % (f, os.path.getsize(os.path.join(OUT, f))))


if __name__ == "__main__":
    main()
