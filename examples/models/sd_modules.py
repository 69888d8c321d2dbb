"""Reference PyTorch implementation of the Stable Diffusion 1.x architecture.

This file is kiln's reference for what an SD 1.x single-file checkpoint
means: the module tree is built so that `state_dict()` gives exactly the
names of an original checkpoint (the shared key list sd-keys/sd15.txt, under $KILN_SHARED):

    betas, alphas_cumprod, ...                 noise-schedule buffers
    model.diffusion_model.*                    CompVis UNetModel (openaimodel.py)
    first_stage_model.*                        AutoencoderKL (ldm/.../model.py)
    cond_stage_model.transformer.text_model.*  CLIP text encoder, HF naming

Everything is written from the original code's semantics (CompVis
stable-diffusion, openai/CLIP, transformers' modeling_clip.py); only the
hyper-parameters are free, so the same code builds full SD 1.5 or the tiny
`kiln-shapes` demo model. Numerical details a re-implementation must copy:

  * UNet GroupNorm: 32 groups, eps 1e-5, computed in f32 (GroupNorm32).
  * SpatialTransformer GroupNorm and every VAE GroupNorm: 32 groups, eps 1e-6.
  * LayerNorm (transformer blocks, CLIP): eps 1e-5.
  * Timestep embedding: [cos(t*f), sin(t*f)] (cos first), f_i =
    exp(-ln(10000) * i / half), i = 0..half-1.
  * GEGLU: proj -> (x, gate) = chunk(2, last dim), x * gelu(gate) (exact erf GELU).
  * CLIP: pre-LN blocks, causal mask, QuickGELU x*sigmoid(1.702x), q scaled by
    head_dim^-0.5, output = final_layer_norm(last hidden state).
  * VAE Downsample: pad (left 0, right 1, top 0, bottom 1) with zeros, then a
    3x3 stride-2 conv without padding. Upsample: nearest x2, then 3x3 conv.
  * VAE attention: single head over h*w positions, scale c^-0.5.
"""

import json
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------- CLIP text

class CLIPTextConfig:
    def __init__(self, vocab_size=49408, width=768, layers=12, heads=12,
                 mlp_ratio=4, context_length=77):
        self.vocab_size = vocab_size
        self.width = width
        self.layers = layers
        self.heads = heads
        self.mlp_width = width * mlp_ratio
        self.context_length = context_length


class CLIPTextEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.width)
        self.position_embedding = nn.Embedding(cfg.context_length, cfg.width)
        # SD 1.x files carry this int64 [1, 77] buffer (0..76); it is saved
        # for compatibility, loaders should not need it.
        self.register_buffer("position_ids",
                             torch.arange(cfg.context_length).unsqueeze(0))

    def forward(self, ids):
        pos = self.position_ids[:, :ids.shape[1]]
        return self.token_embedding(ids) + self.position_embedding(pos)


class CLIPAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        w = cfg.width
        self.heads = cfg.heads
        self.head_dim = w // cfg.heads
        # creation order k, v, q, out as in transformers' CLIPAttention
        self.k_proj = nn.Linear(w, w)
        self.v_proj = nn.Linear(w, w)
        self.q_proj = nn.Linear(w, w)
        self.out_proj = nn.Linear(w, w)

    def forward(self, x, mask):
        b, n, w = x.shape
        h, d = self.heads, self.head_dim
        q = (self.q_proj(x) * d ** -0.5).view(b, n, h, d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, h, d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, h, d).transpose(1, 2)
        att = q @ k.transpose(-1, -2) + mask      # [b, h, n, n]
        att = att.softmax(dim=-1)
        o = (att @ v).transpose(1, 2).reshape(b, n, w)
        return self.out_proj(o)


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


class CLIPMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg.width, cfg.mlp_width)
        self.fc2 = nn.Linear(cfg.mlp_width, cfg.width)

    def forward(self, x):
        return self.fc2(quick_gelu(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.width, eps=1e-5)
        self.mlp = CLIPMLP(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.width, eps=1e-5)

    def forward(self, x, mask):
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg)
                                    for _ in range(cfg.layers))

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


class CLIPTextTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = CLIPTextEmbeddings(cfg)
        self.encoder = CLIPEncoder(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.width, eps=1e-5)

    def forward(self, ids):
        """ids: int64 [B, L] -> last hidden state after final LN [B, L, W]."""
        n = ids.shape[1]
        x = self.embeddings(ids)
        mask = torch.full((n, n), float("-inf")).triu(1)   # causal
        x = self.encoder(x, mask)
        return self.final_layer_norm(x)


class CLIPTextModel(nn.Module):
    """transformers.CLIPTextModel: holds `text_model`."""

    def __init__(self, cfg):
        super().__init__()
        self.text_model = CLIPTextTransformer(cfg)

    def forward(self, ids):
        return self.text_model(ids)


class FrozenCLIPEmbedder(nn.Module):
    """ldm.modules.encoders.modules.FrozenCLIPEmbedder: holds `transformer`
    (the tokenizer lives outside, see tokenizer.py)."""

    def __init__(self, cfg):
        super().__init__()
        self.transformer = CLIPTextModel(cfg)

    def forward(self, ids):
        return self.transformer(ids)


# ---------------------------------------------------------------- UNet

class GroupNorm32(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


def normalization(channels):
    """UNet ResBlock / output norm: 32 groups, eps 1e-5."""
    return GroupNorm32(32, channels)


def Normalize(channels):
    """SpatialTransformer and VAE norm: 32 groups, eps 1e-6."""
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6,
                        affine=True)


def zero_module(m):
    for p in m.parameters():
        p.detach().zero_()
    return m


def timestep_embedding(timesteps, dim, max_period=10000):
    """CompVis util.timestep_embedding: [cos, sin] halves (cos first)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) *
                      torch.arange(0, half, dtype=torch.float32) / half)
    args = timesteps[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepEmbedSequential(nn.Sequential):
    """Passes the time embedding to ResBlocks and the context to
    SpatialTransformers."""

    def forward(self, x, emb, context=None):
        for layer in self:
            if isinstance(layer, ResBlock):
                x = layer(x, emb)
            elif isinstance(layer, SpatialTransformer):
                x = layer(x, context)
            else:
                x = layer(x)
        return x


class ResBlock(nn.Module):
    def __init__(self, channels, emb_channels, out_channels=None):
        super().__init__()
        out_channels = out_channels or channels
        self.in_layers = nn.Sequential(           # .0 norm, .2 conv
            normalization(channels), nn.SiLU(),
            nn.Conv2d(channels, out_channels, 3, padding=1))
        self.emb_layers = nn.Sequential(          # .1 linear
            nn.SiLU(), nn.Linear(emb_channels, out_channels))
        self.out_layers = nn.Sequential(          # .0 norm, .3 conv
            normalization(out_channels), nn.SiLU(), nn.Dropout(0.0),
            zero_module(nn.Conv2d(out_channels, out_channels, 3, padding=1)))
        if out_channels == channels:
            self.skip_connection = nn.Identity()
        else:
            self.skip_connection = nn.Conv2d(channels, out_channels, 1)

    def forward(self, x, emb):
        h = self.in_layers(x)
        h = h + self.emb_layers(emb)[:, :, None, None]
        h = self.out_layers(h)
        return self.skip_connection(x) + h


class Downsample(nn.Module):
    """UNet downsample: 3x3 conv, stride 2, padding 1 (named `op`)."""

    def __init__(self, channels):
        super().__init__()
        self.op = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x):
        return self.op(x)


class Upsample(nn.Module):
    """UNet and VAE upsample: nearest x2 then 3x3 conv (named `conv`)."""

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64):
        super().__init__()
        inner = heads * dim_head
        context_dim = context_dim or query_dim
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, query_dim),
                                    nn.Dropout(0.0))

    def forward(self, x, context=None):
        context = x if context is None else context
        b, n, _ = x.shape
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        q, k, v = (t.view(b, t.shape[1], h, -1).transpose(1, 2)
                   for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) * self.scale
        o = att.softmax(dim=-1) @ v                        # [b, h, n, d]
        return self.to_out(o.transpose(1, 2).reshape(b, n, -1))


class GEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        inner = dim * mult
        self.net = nn.Sequential(GEGLU(dim, inner), nn.Dropout(0.0),
                                 nn.Linear(inner, dim))

    def forward(self, x):
        return self.net(x)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, heads, dim_head, context_dim):
        super().__init__()
        # creation order attn1, ff, attn2, norm1..3 as in CompVis
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
    """SD 1.x version: 1x1 conv proj_in / proj_out."""

    def __init__(self, channels, heads, dim_head, depth, context_dim):
        super().__init__()
        inner = heads * dim_head
        self.norm = Normalize(channels)
        self.proj_in = nn.Conv2d(channels, inner, 1)
        self.transformer_blocks = nn.ModuleList(
            BasicTransformerBlock(inner, heads, dim_head, context_dim)
            for _ in range(depth))
        self.proj_out = zero_module(nn.Conv2d(inner, channels, 1))

    def forward(self, x, context):
        b, c, hh, ww = x.shape
        x_in = x
        x = self.proj_in(self.norm(x))
        x = x.flatten(2).transpose(1, 2)                   # b (h w) c
        for block in self.transformer_blocks:
            x = block(x, context)
        x = x.transpose(1, 2).reshape(b, -1, hh, ww)
        return self.proj_out(x) + x_in


class UNetConfig:
    def __init__(self, in_channels=4, out_channels=4, model_channels=320,
                 channel_mult=(1, 2, 4, 4), num_res_blocks=2,
                 attention_resolutions=(4, 2, 1), num_heads=8,
                 transformer_depth=1, context_dim=768):
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.model_channels = model_channels
        self.channel_mult = tuple(channel_mult)
        self.num_res_blocks = num_res_blocks
        self.attention_resolutions = tuple(attention_resolutions)
        self.num_heads = num_heads
        self.transformer_depth = transformer_depth
        self.context_dim = context_dim


class UNetModel(nn.Module):
    """CompVis openaimodel.UNetModel as configured by SD 1.x
    (use_spatial_transformer, legacy False, no label_emb,
    use_scale_shift_norm False, conv_resample True)."""

    def __init__(self, cfg):
        super().__init__()
        mc = cfg.model_channels
        ted = mc * 4
        self.model_channels = mc

        def transformer(ch):
            return SpatialTransformer(ch, cfg.num_heads, ch // cfg.num_heads,
                                      cfg.transformer_depth, cfg.context_dim)

        self.time_embed = nn.Sequential(nn.Linear(mc, ted), nn.SiLU(),
                                        nn.Linear(ted, ted))
        self.input_blocks = nn.ModuleList([TimestepEmbedSequential(
            nn.Conv2d(cfg.in_channels, mc, 3, padding=1))])
        chans = [mc]
        ch, ds = mc, 1
        for level, mult in enumerate(cfg.channel_mult):
            for _ in range(cfg.num_res_blocks):
                layers = [ResBlock(ch, ted, mult * mc)]
                ch = mult * mc
                if ds in cfg.attention_resolutions:
                    layers.append(transformer(ch))
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                chans.append(ch)
            if level != len(cfg.channel_mult) - 1:
                self.input_blocks.append(
                    TimestepEmbedSequential(Downsample(ch)))
                chans.append(ch)
                ds *= 2
        self.middle_block = TimestepEmbedSequential(
            ResBlock(ch, ted), transformer(ch), ResBlock(ch, ted))
        self.output_blocks = nn.ModuleList()
        for level, mult in list(enumerate(cfg.channel_mult))[::-1]:
            for i in range(cfg.num_res_blocks + 1):
                layers = [ResBlock(ch + chans.pop(), ted, mc * mult)]
                ch = mc * mult
                if ds in cfg.attention_resolutions:
                    layers.append(transformer(ch))
                if level and i == cfg.num_res_blocks:
                    layers.append(Upsample(ch))
                    ds //= 2
                self.output_blocks.append(TimestepEmbedSequential(*layers))
        self.out = nn.Sequential(normalization(ch), nn.SiLU(),
                                 zero_module(nn.Conv2d(mc, cfg.out_channels,
                                                       3, padding=1)))

    def forward(self, x, timesteps, context):
        emb = self.time_embed(timestep_embedding(timesteps,
                                                 self.model_channels))
        hs = []
        h = x
        for block in self.input_blocks:
            h = block(h, emb, context)
            hs.append(h)
        h = self.middle_block(h, emb, context)
        for block in self.output_blocks:
            h = block(torch.cat([h, hs.pop()], dim=1), emb, context)
        return self.out(h)


class DiffusionWrapper(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.diffusion_model = UNetModel(cfg)

    def forward(self, x, t, context):
        return self.diffusion_model(x, t, context)


# ---------------------------------------------------------------- VAE

def swish(x):
    return x * torch.sigmoid(x)


class VAEResnetBlock(nn.Module):
    def __init__(self, in_channels, out_channels=None):
        super().__init__()
        out_channels = out_channels or in_channels
        self.norm1 = Normalize(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = Normalize(out_channels)
        self.dropout = nn.Dropout(0.0)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1)
        else:
            self.nin_shortcut = None

    def forward(self, x):
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(self.dropout(swish(self.norm2(h))))
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return x + h


class VAEAttnBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.norm = Normalize(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        h = self.norm(x)
        b, c, hh, ww = h.shape
        q = self.q(h).flatten(2).transpose(1, 2)           # b, hw, c
        k = self.k(h).flatten(2)                           # b, c, hw
        v = self.v(h).flatten(2)                           # b, c, hw
        w = ((q @ k) * c ** -0.5).softmax(dim=2)           # b, hw(q), hw(k)
        o = (v @ w.transpose(1, 2)).reshape(b, c, hh, ww)
        return x + self.proj_out(o)


class VAEDownsample(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class VAEConfig:
    def __init__(self, ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2,
                 attn_resolutions=(), in_channels=3, out_ch=3, z_channels=4,
                 embed_dim=4, resolution=256):
        self.ch = ch
        self.ch_mult = tuple(ch_mult)
        self.num_res_blocks = num_res_blocks
        self.attn_resolutions = tuple(attn_resolutions)
        self.in_channels = in_channels
        self.out_ch = out_ch
        self.z_channels = z_channels
        self.embed_dim = embed_dim
        self.resolution = resolution


class _Level(nn.Module):
    """A plain container so that names read down.N.block.M etc."""


class Encoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        ch, mult = cfg.ch, cfg.ch_mult
        self.num_resolutions = len(mult)
        self.conv_in = nn.Conv2d(cfg.in_channels, ch, 3, padding=1)
        res = cfg.resolution
        in_mult = (1,) + mult
        self.down = nn.ModuleList()
        for i in range(self.num_resolutions):
            level = _Level()
            level.block = nn.ModuleList()
            level.attn = nn.ModuleList()
            block_in, block_out = ch * in_mult[i], ch * mult[i]
            for _ in range(cfg.num_res_blocks):
                level.block.append(VAEResnetBlock(block_in, block_out))
                block_in = block_out
                if res in cfg.attn_resolutions:
                    level.attn.append(VAEAttnBlock(block_in))
            if i != self.num_resolutions - 1:
                level.downsample = VAEDownsample(block_in)
                res //= 2
            self.down.append(level)
        self.mid = _Level()
        self.mid.block_1 = VAEResnetBlock(block_in)
        self.mid.attn_1 = VAEAttnBlock(block_in)
        self.mid.block_2 = VAEResnetBlock(block_in)
        self.norm_out = Normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, 2 * cfg.z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for i, level in enumerate(self.down):
            for j, block in enumerate(level.block):
                h = block(h)
                if len(level.attn):
                    h = level.attn[j](h)
            if i != self.num_resolutions - 1:
                h = level.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        ch, mult = cfg.ch, cfg.ch_mult
        self.num_resolutions = len(mult)
        block_in = ch * mult[-1]
        res = cfg.resolution // 2 ** (self.num_resolutions - 1)
        self.conv_in = nn.Conv2d(cfg.z_channels, block_in, 3, padding=1)
        self.mid = _Level()
        self.mid.block_1 = VAEResnetBlock(block_in)
        self.mid.attn_1 = VAEAttnBlock(block_in)
        self.mid.block_2 = VAEResnetBlock(block_in)
        # levels are built from the lowest resolution up and inserted at the
        # front, so up.0 is the full-resolution level (as in LDM)
        ups = []
        for i in reversed(range(self.num_resolutions)):
            level = _Level()
            level.block = nn.ModuleList()
            level.attn = nn.ModuleList()
            block_out = ch * mult[i]
            for _ in range(cfg.num_res_blocks + 1):
                level.block.append(VAEResnetBlock(block_in, block_out))
                block_in = block_out
                if res in cfg.attn_resolutions:
                    level.attn.append(VAEAttnBlock(block_in))
            if i != 0:
                level.upsample = Upsample(block_in)
                res *= 2
            ups.insert(0, level)
        self.up = nn.ModuleList(ups)
        self.norm_out = Normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, cfg.out_ch, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for i in reversed(range(self.num_resolutions)):
            level = self.up[i]
            for j, block in enumerate(level.block):
                h = block(h)
                if len(level.attn):
                    h = level.attn[j](h)
            if i != 0:
                h = level.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class AutoencoderKL(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quant_conv = nn.Conv2d(2 * cfg.z_channels, 2 * cfg.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)

    def encode_moments(self, x):
        """x in [-1, 1] -> (mean, logvar) of the diagonal Gaussian."""
        mean, logvar = self.quant_conv(self.encoder(x)).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def decode(self, z):
        """unscaled latent -> image in about [-1, 1]."""
        return self.decoder(self.post_quant_conv(z))


# ---------------------------------------------------------------- whole model

def rescale_zero_terminal_snr(ac):
    """Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are
    Flawed", Algorithm 1: shift and scale sqrt(alphas_cumprod) so that the
    first value is kept and the last is exactly 0 (x_T is pure noise)."""
    s = ac.sqrt()
    s0, sT = s[0].clone(), s[-1].clone()
    s = (s - sT) * (s0 / (s0 - sT))
    return s ** 2


# what the saved buffers and samplers use for alphas_cumprod[T] when it is 0
# (ComfyUI's value: sigma_max ~ 4519 instead of infinity)
ZSNR_LAST = 4.8973451890853435e-08


def make_schedule(n=1000, start=0.00085, end=0.012, zsnr=False):
    """ldm ddpm.register_schedule, 'linear' (really scaled-linear) betas;
    zsnr rescales them to zero terminal SNR (alphas_cumprod[T] stored as
    ZSNR_LAST so that no buffer is infinite)."""
    betas = torch.linspace(start ** 0.5, end ** 0.5, n,
                           dtype=torch.float64) ** 2
    alphas = 1.0 - betas
    ac = torch.cumprod(alphas, dim=0)
    if zsnr:
        ac = rescale_zero_terminal_snr(ac)
        ac[-1] = ZSNR_LAST
        alphas = ac / torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
        betas = 1.0 - alphas
    ac_prev = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
    post_var = betas * (1.0 - ac_prev) / (1.0 - ac)
    return {
        "betas": betas,
        "alphas_cumprod": ac,
        "alphas_cumprod_prev": ac_prev,
        "sqrt_alphas_cumprod": ac.sqrt(),
        "sqrt_one_minus_alphas_cumprod": (1.0 - ac).sqrt(),
        "log_one_minus_alphas_cumprod": (1.0 - ac).log(),
        "sqrt_recip_alphas_cumprod": (1.0 / ac).sqrt(),
        "sqrt_recipm1_alphas_cumprod": (1.0 / ac - 1).sqrt(),
        "posterior_variance": post_var,
        "posterior_log_variance_clipped":
            torch.log(torch.clamp(post_var, min=1e-20)),
        "posterior_mean_coef1": betas * ac_prev.sqrt() / (1.0 - ac),
        "posterior_mean_coef2": (1.0 - ac_prev) * alphas.sqrt() / (1.0 - ac),
    }


class LatentDiffusion(nn.Module):
    """Top level of an SD 1.x checkpoint: schedule buffers, then model.*,
    first_stage_model.*, cond_stage_model.* (state_dict order as sd15.txt)."""

    def __init__(self, unet_cfg, vae_cfg, clip_cfg, scale_factor=0.18215,
                 zsnr=False):
        super().__init__()
        for name, buf in make_schedule(zsnr=zsnr).items():
            self.register_buffer(name, buf.float())
        self.model = DiffusionWrapper(unet_cfg)
        self.first_stage_model = AutoencoderKL(vae_cfg)
        self.cond_stage_model = FrozenCLIPEmbedder(clip_cfg)
        self.scale_factor = scale_factor   # plain attribute, not in the file


# ---------------------------------------------------------------- name check

_BLOCK_INDEX = re.compile(
    r"(input_blocks|output_blocks|transformer_blocks|layers|down|up|block|attn)"
    r"\.\d+(?=\.)")


def name_pattern(name):
    """Replace repeated-block indices by N: input_blocks.7.1.proj_in.weight
    -> input_blocks.N.1.proj_in.weight (the index inside a block is kept)."""
    return _BLOCK_INDEX.sub(lambda m: m.group(1) + ".N", name)


def check_sd_names(shapes, ref_path):
    """Compare {name: shape} with a reference list (sd15.txt format).
    Returns (ours_not_in_ref, ref_not_in_ours) as sorted lists of
    'pattern rank' strings; the first must be empty."""
    ref = set()
    with open(ref_path) as f:
        for line in f:
            name, shape = line.rstrip("\n").split("\t")
            ref.add("%s %d" % (name_pattern(name), len(json.loads(shape))))
    ours = {"%s %d" % (name_pattern(n), len(s)) for n, s in shapes.items()}
    return sorted(ours - ref), sorted(ref - ours)



# ---------------------------------------------------------------- configs from a file

def configs_from_state_dict(sd, meta=None):
    """Read every hyper-parameter that the tensor names and shapes reveal, as
    kiln's loader does; heads come from __metadata__ (kiln.heads.unet,
    kiln.heads.clip) or SD 1.x's values (8 and 12)."""
    meta = meta or {}
    u = "model.diffusion_model."
    v = "first_stage_model."
    c = "cond_stage_model.transformer.text_model."

    def count(prefix):
        idx = set()
        for k in sd:
            if k.startswith(prefix):
                idx.add(int(k[len(prefix):].split(".")[0]))
        return len(idx)

    mc = sd[u + "input_blocks.0.0.weight"].shape[0]
    n_in = count(u + "input_blocks.")
    levels = 1 + sum(1 for k in sd if k.startswith(u + "input_blocks.")
                     and k.endswith(".op.weight"))
    nrb = (n_in - 1 - (levels - 1)) // levels
    mult, attn, depth, ctx = [], [], 1, None
    for lvl in range(levels):
        i = 1 + lvl * (nrb + 1)
        mult.append(sd[u + "input_blocks.%d.0.out_layers.3.weight" % i].shape[0] // mc)
        if u + "input_blocks.%d.1.proj_in.weight" % i in sd:
            attn.append(2 ** lvl)
    for k in sd:
        if k.startswith(u) and k.endswith("attn2.to_k.weight"):
            ctx = sd[k].shape[1]
    depth = count(u + "middle_block.1.transformer_blocks.")
    unet = UNetConfig(in_channels=sd[u + "input_blocks.0.0.weight"].shape[1],
                      out_channels=sd[u + "out.2.weight"].shape[0],
                      model_channels=mc, channel_mult=mult,
                      num_res_blocks=nrb, attention_resolutions=attn,
                      num_heads=int(meta.get("kiln.heads.unet", 8)),
                      transformer_depth=depth, context_dim=ctx)
    ch = sd[v + "encoder.conv_in.weight"].shape[0]
    vlev = count(v + "encoder.down.")
    vae = VAEConfig(
        ch=ch,
        ch_mult=[sd[v + "encoder.down.%d.block.0.conv1.weight" % i].shape[0] // ch
                 for i in range(vlev)],
        num_res_blocks=count(v + "encoder.down.0.block."),
        in_channels=sd[v + "encoder.conv_in.weight"].shape[1],
        out_ch=sd[v + "decoder.conv_out.weight"].shape[0],
        z_channels=sd[v + "decoder.conv_in.weight"].shape[1],
        embed_dim=sd[v + "post_quant_conv.weight"].shape[1],
        resolution=int(meta.get("kiln.image_size", 256)))
    tok = sd[c + "embeddings.token_embedding.weight"]
    clip = CLIPTextConfig(
        vocab_size=tok.shape[0], width=tok.shape[1],
        layers=count(c + "encoder.layers."),
        heads=int(meta.get("kiln.heads.clip", 12)),
        mlp_ratio=sd[c + "encoder.layers.0.mlp.fc1.weight"].shape[0] // tok.shape[1],
        context_length=sd[c + "embeddings.position_embedding.weight"].shape[0])
    return unet, vae, clip


def load_checkpoint(path):
    """-> LatentDiffusion in f32 with the file's weights, scale_factor set."""
    from safetensors_io import load
    sd, meta = load(path)
    unet, vae, clip = configs_from_state_dict(sd, meta)
    model = LatentDiffusion(unet, vae, clip,
                            float(meta.get("kiln.scale_factor", 0.18215)))
    state = model.state_dict()
    missing = [k for k in state if k not in sd]
    if missing:
        raise KeyError("%s: missing tensors %s" % (path, missing[:5]))
    model.load_state_dict({k: sd[k].to(state[k].dtype) for k in state})
    model.meta = meta
    return model.eval()
