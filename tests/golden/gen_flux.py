#!/usr/bin/python3
"""Golden data for kiln.flux (tests/lua/test_flux.lua): a tiny Flux.1 network in
Black Forest Labs' tensor names, its weights as a recipe the Lua test rebuilds
(seeded kiln.randn = torch.randn, as tests/golden/gen_sd_golden.py does), the
inputs of one forward and the velocities it gives for [dev] (guidance_in) and
[schnell] (the same weights without guidance_in).

Run from the repository root:  /usr/bin/python3 tests/golden/gen_flux.py
(Debian's python3-torch; CPU; a second.)

The forward below is this generator's own PyTorch implementation of the published
Flux.1 definition (BFL's flux/model.py and modules/layers.py, whose code is not
copied here and which needs einops, absent on this machine): img_in / txt_in,
time_in / vector_in / guidance_in MLP embedders over the sinusoidal embedding of
1000 t (256 wide), a 3-axis rotary embedding over (index, row, column) position
ids, double-stream blocks (adaLN modulation, LayerNorm without affine at 1e-6,
fused qkv, RMS q/k norms, joint attention over text then image tokens, GELU-tanh
MLP, gated residuals), single-stream blocks (fused linear1 -> qkv + MLP, linear2
over both) and the final adaLN layer; latents packed in 2x2 patches.
When written, these outputs were checked against BFL's own Flux class (its
model.py, layers.py and math.py run outside this repository with a stand-in for
the three einops patterns they use and a softmax attention in place of torch
1.13's missing scaled_dot_product_attention): identical to the last bit.

Writes under tests/golden/flux/:
- flux.recipe: name, dtype, shape, seed, std, mean per tensor (tensor =
  torch.manual_seed(seed); torch.randn(shape) * std + mean) and the metadata
  (@kiln.flux.heads, @kiln.flux.axes_dim) the file needs to say its heads and axes.
- io.safetensors: x [2, 16, 6, 4], t [2], context [2, 5, 32], y [2, 24],
  guidance [2] and the outputs dev / schnell [2, 16, 6, 4] (f32).
"""

import json
import math
import os
import sys

import torch

torch.set_num_threads(2)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "models"))
import safetensors_io  # noqa: E402

OUT = os.path.join(ROOT, "tests", "golden", "flux")

HIDDEN, HEADS, AXES = 64, 2, (8, 12, 12)
DEPTH, DEPTH_SINGLE = 2, 2
CONTEXT, VEC, IN_CH = 32, 24, 64
MLP = HIDDEN * 4
THETA = 10000.0


# ------------------------------------------------------------------ tensors

def names_and_shapes():
    H, M = HIDDEN, MLP
    D = H // HEADS
    r = []

    def lin(p, o, i, bias=True):
        r.append((p + ".weight", [o, i]))
        if bias:
            r.append((p + ".bias", [o]))

    lin("img_in", H, IN_CH)
    lin("txt_in", H, CONTEXT)
    for e, i in (("time_in", 256), ("vector_in", VEC), ("guidance_in", 256)):
        lin(e + ".in_layer", H, i)
        lin(e + ".out_layer", H, H)
    for b in range(DEPTH):
        for s in ("img", "txt"):
            p = "double_blocks.%d.%s_" % (b, s)
            lin(p + "mod.lin", 6 * H, H)
            lin(p + "attn.qkv", 3 * H, H)
            r.append((p + "attn.norm.query_norm.scale", [D]))
            r.append((p + "attn.norm.key_norm.scale", [D]))
            lin(p + "attn.proj", H, H)
            lin(p + "mlp.0", M, H)
            lin(p + "mlp.2", H, M)
    for b in range(DEPTH_SINGLE):
        p = "single_blocks.%d." % b
        lin(p + "linear1", 3 * H + M, H)
        lin(p + "linear2", H, H + M)
        r.append((p + "norm.query_norm.scale", [D]))
        r.append((p + "norm.key_norm.scale", [D]))
        lin(p + "modulation.lin", 3 * H, H)
    lin("final_layer.linear", IN_CH, H)
    lin("final_layer.adaLN_modulation.1", 2 * H, H)
    return r


def build_weights():
    w, recipe = {}, []
    for i, (name, shape) in enumerate(names_and_shapes()):
        seed = 3000 + i
        if name.endswith(".scale"):
            std, mean = 0.2, 1.0
        elif len(shape) == 1:
            std, mean = 0.1, 0.0
        else:
            std, mean = 1.0 / math.sqrt(shape[1]), 0.0
        std = float("%.9g" % std)   # the recipe's text, so the Lua rebuild is the same
        torch.manual_seed(seed)
        w[name] = torch.randn(shape) * std + mean
        recipe.append((name, "f32", shape, seed, std, mean))
    return w, recipe


# ------------------------------------------------------------------ the network

def linear(w, p, x):
    return torch.nn.functional.linear(x, w[p + ".weight"], w.get(p + ".bias"))


def sinusoid(t, dim=256):
    t = t * 1000.0
    half = dim // 2
    f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    a = t[:, None].float() * f[None]
    return torch.cat([torch.cos(a), torch.sin(a)], dim=-1)


def mlp_embed(w, p, x):
    return linear(w, p + ".out_layer", torch.nn.functional.silu(linear(w, p + ".in_layer", x)))


def rope_tables(ids):
    """ids [B, L, 3] -> cos, sin [B, 1, L, D/2] (the axes' frequency pairs in order)."""
    angles = []
    for a, d in enumerate(AXES):
        omega = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles.append(ids[..., a:a + 1].float() * omega)   # [B, L, d/2]
    ang = torch.cat(angles, dim=-1)
    return torch.cos(ang)[:, None], torch.sin(ang)[:, None]


def rotate(x, cos, sin):
    """Each consecutive pair (a, b) of the head dimension turned by its angle."""
    a, b = x[..., 0::2], x[..., 1::2]
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    return torch.stack([ra, rb], dim=-1).flatten(-2)


def rms(x, scale):
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6) * scale


def heads_of(qkv):
    B, L, _ = qkv.shape
    q, k, v = qkv.view(B, L, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
    return q, k, v


def attend(q, k, v, cos, sin):
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    o = torch.softmax(s, dim=-1) @ v                       # [B, heads, L, D]
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def ln(x):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-6)


def chunks(w, p, vec, n):
    return linear(w, p, torch.nn.functional.silu(vec))[:, None, :].chunk(n, dim=-1)


def gelu(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def double_block(w, p, img, txt, vec, cos, sin):
    im = chunks(w, p + "img_mod.lin", vec, 6)
    tm = chunks(w, p + "txt_mod.lin", vec, 6)
    qkv = []
    for s, x, m in (("txt", txt, tm), ("img", img, im)):
        h = (1 + m[1]) * ln(x) + m[0]
        q, k, v = heads_of(linear(w, p + s + "_attn.qkv", h))
        q = rms(q, w[p + s + "_attn.norm.query_norm.scale"])
        k = rms(k, w[p + s + "_attn.norm.key_norm.scale"])
        qkv.append((q, k, v))
    q = torch.cat([qkv[0][0], qkv[1][0]], dim=2)
    k = torch.cat([qkv[0][1], qkv[1][1]], dim=2)
    v = torch.cat([qkv[0][2], qkv[1][2]], dim=2)
    a = attend(q, k, v, cos, sin)
    nt = txt.shape[1]
    out = []
    for s, x, m, at in (("img", img, im, a[:, nt:]), ("txt", txt, tm, a[:, :nt])):
        x = x + m[2] * linear(w, p + s + "_attn.proj", at)
        h = (1 + m[4]) * ln(x) + m[3]
        x = x + m[5] * linear(w, p + s + "_mlp.2", gelu(linear(w, p + s + "_mlp.0", h)))
        out.append(x)
    return out[0], out[1]


def single_block(w, p, x, vec, cos, sin):
    shift, scale, gate = chunks(w, p + "modulation.lin", vec, 3)
    h = linear(w, p + "linear1", (1 + scale) * ln(x) + shift)
    qkv, m = h[..., :3 * HIDDEN], h[..., 3 * HIDDEN:]
    q, k, v = heads_of(qkv)
    q = rms(q, w[p + "norm.query_norm.scale"])
    k = rms(k, w[p + "norm.key_norm.scale"])
    a = attend(q, k, v, cos, sin)
    return x + gate * linear(w, p + "linear2", torch.cat([a, gelu(m)], dim=2))


def flux(w, x, t, context, y, guidance):
    B, C, h, wd = x.shape
    h2, w2 = h // 2, wd // 2
    img = x.reshape(B, C, h2, 2, w2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, h2 * w2, C * 4)
    img_ids = torch.zeros(h2, w2, 3)
    img_ids[..., 1] += torch.arange(h2)[:, None]
    img_ids[..., 2] += torch.arange(w2)[None, :]
    img_ids = img_ids.reshape(1, h2 * w2, 3).expand(B, -1, -1)
    txt_ids = torch.zeros(B, context.shape[1], 3)
    cos, sin = rope_tables(torch.cat([txt_ids, img_ids], dim=1))

    img = linear(w, "img_in", img)
    vec = mlp_embed(w, "time_in", sinusoid(t))
    if "guidance_in.in_layer.weight" in w:
        vec = vec + mlp_embed(w, "guidance_in", sinusoid(guidance))
    vec = vec + mlp_embed(w, "vector_in", y)
    txt = linear(w, "txt_in", context)
    for b in range(DEPTH):
        img, txt = double_block(w, "double_blocks.%d." % b, img, txt, vec, cos, sin)
    xs = torch.cat([txt, img], dim=1)
    for b in range(DEPTH_SINGLE):
        xs = single_block(w, "single_blocks.%d." % b, xs, vec, cos, sin)
    img = xs[:, txt.shape[1]:]
    shift, scale = linear(w, "final_layer.adaLN_modulation.1", torch.nn.functional.silu(vec)).chunk(2, dim=1)
    img = (1 + scale[:, None]) * ln(img) + shift[:, None]
    img = linear(w, "final_layer.linear", img)
    return img.reshape(B, h2, w2, C, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C, h, wd)


def main():
    os.makedirs(OUT, exist_ok=True)
    w, recipe = build_weights()
    meta = {"kiln.flux.heads": str(HEADS), "kiln.flux.axes_dim": ",".join(str(a) for a in AXES)}
    with open(os.path.join(OUT, "flux.recipe"), "w") as f:
        f.write("# written by tests/golden/gen_flux.py: name, dtype, shape, seed, std, mean\n")
        f.write("# tensor = torch.manual_seed(seed); torch.randn(shape) * std + mean\n")
        for k, v in sorted(meta.items()):
            f.write("@%s\t%s\n" % (k, v))
        for name, dt, shape, seed, std, mean in recipe:
            f.write("%s\t%s\t%s\t%d\t%.9g\t%.9g\n" % (name, dt, json.dumps(shape), seed, std, mean))

    g = torch.Generator().manual_seed(39)
    x = torch.randn(2, 16, 6, 4, generator=g)
    t = torch.tensor([0.3, 0.85])
    context = torch.randn(2, 5, CONTEXT, generator=g)
    y = torch.randn(2, VEC, generator=g)
    guidance = torch.tensor([3.5, 1.0])
    with torch.no_grad():
        dev = flux(w, x, t, context, y, guidance)
        schnell_w = {k: v for k, v in w.items() if not k.startswith("guidance_in.")}
        schnell = flux(schnell_w, x, t, context, y, None)
    safetensors_io.save(os.path.join(OUT, "io.safetensors"), {
        "x": x, "t": t, "context": context, "y": y, "guidance": guidance, "dev": dev, "schnell": schnell})
    print("dev |out| max %.4f, schnell %.4f, differ by %.4f" % (
        dev.abs().max(), schnell.abs().max(), (dev - schnell).abs().max()))


if __name__ == "__main__":
    main()
