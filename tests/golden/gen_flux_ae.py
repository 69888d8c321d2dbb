#!/usr/bin/python3
"""Golden data for kiln.vae on Flux's 16-channel autoencoder (tests/lua/test_flux_ae.lua):
a tiny AutoEncoder of Black Forest Labs' own code (flux/modules/autoencoder.py, run
from a mirror of github.com/black-forest-labs/flux extracted under /tmp; its code is
read there, never copied here) with random weights given as a recipe the Lua test
rebuilds (seeded kiln.randn = torch.randn), one encode and one decode.

Run from the repository root:  /usr/bin/python3 tests/golden/gen_flux_ae.py
(Debian's python3-torch 1.13 on the CPU; seconds.) The mirror: KILN_BFL_FLUX names an
extracted checkout's src/ folder, else the fetch tool's mirror
/work/.mirror/black-forest-labs+flux/repo is extracted with git archive.

BFL's code needs einops and torch 2's scaled_dot_product_attention, absent here: a
small rearrange / repeat for the patterns it uses and a softmax attention stand in.

Writes under tests/golden/flux/:
- ae.recipe: name, dtype, shape, seed, std, mean per tensor (BFL's names, which are
  ae.safetensors' names).
- ae_io.safetensors: image [1, 3, 64, 96] in [0, 1], latent = AutoEncoder.encode
  (posterior mean, sample_z False; (z - 0.1159) * 0.3611), z [1, 16, 8, 12] random,
  decoded = (AutoEncoder.decode(z).clamp(-1, 1) + 1) / 2 as BFL's cli saves pictures.
"""

import json
import math
import os
import re
import subprocess
import sys
import types

import torch

torch.set_num_threads(2)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "models"))
import safetensors_io  # noqa: E402

OUT = os.path.join(ROOT, "tests", "golden", "flux")
MIRROR = "/work/.mirror/black-forest-labs+flux/repo"

# the tiny autoencoder: factor 8 (four levels), 32 -> 64 channels (nin_shortcut runs)
AE = dict(resolution=64, in_channels=3, ch=32, out_ch=3, ch_mult=[1, 1, 2, 2], num_res_blocks=1,
          z_channels=16, scale_factor=0.3611, shift_factor=0.1159)


# ------------------------------------------------------------------ BFL's code, runnable here

def _axes(side):
    """'b c (h w) 1' -> [['b'], ['c'], ['h', 'w'], ['1']]"""
    out, group = [], None
    for tok in re.findall(r"\(|\)|[^\s()]+", side):
        if tok == "(":
            group = []
        elif tok == ")":
            out.append(group)
            group = None
        elif group is not None:
            group.append(tok)
        else:
            out.append([tok])
    return out


def rearrange(x, pattern, **sizes):
    """einops.rearrange for the patterns BFL's code uses (no '...')."""
    lhs, rhs = [s.strip() for s in pattern.split("->")]
    L, R = _axes(lhs), _axes(rhs)
    known = dict(sizes)
    elem = []
    for dim, group in zip(x.shape, L):
        names = [g for g in group if g != "1"]
        free = [g for g in names if g not in known]
        prod = 1
        for g in names:
            if g in known:
                prod *= known[g]
        if len(free) == 1:
            known[free[0]] = dim // prod
        elem += names
    x = x.reshape([known[n] for n in elem])
    order = [elem.index(g) for group in R for g in group if g != "1"]
    x = x.permute(order)
    shape = []
    for group in R:
        n = 1
        for g in group:
            n *= 1 if g == "1" else known[g]
        shape.append(n)
    return x.reshape(shape)


def repeat(x, pattern, **sizes):
    """einops.repeat for '1 ... -> bs ...' and 'h w c -> b (h w) c'."""
    lhs, rhs = [s.strip() for s in pattern.split("->")]
    if lhs.startswith("1 ..."):
        return x.expand(sizes[rhs.split()[0]], *x.shape[1:])
    y = rearrange(x, lhs + " -> " + " ".join("(%s)" % " ".join(g) if len(g) > 1 else g[0]
                                             for g in _axes(rhs) if all(a in lhs for a in g)))
    new = [g[0] for g in _axes(rhs) if not all(a in lhs for a in g)]
    return y[None].expand(sizes[new[0]], *y.shape)


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v


def bfl_src():
    """The folder holding BFL's flux package (extracted from the mirror once)."""
    given = os.environ.get("KILN_BFL_FLUX")
    if given:
        return given
    dest = "/tmp/kiln-bfl-flux"
    if not os.path.isdir(os.path.join(dest, "src", "flux")):
        os.makedirs(dest, exist_ok=True)
        tar = subprocess.run(["git", "--git-dir=" + MIRROR, "archive", "HEAD", "src"], check=True,
                             capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=tar, check=True)
    return os.path.join(dest, "src")


def import_bfl():
    """BFL's flux.modules.autoencoder, flux.model and flux.sampling, with stand-ins for
    the modules they import that this machine lacks (einops, transformers' encoders,
    image embedders) and torch 2's attention."""
    torch.nn.functional.scaled_dot_product_attention = sdpa
    ein = types.ModuleType("einops")
    ein.rearrange, ein.repeat = rearrange, repeat
    sys.modules["einops"] = ein
    cond = types.ModuleType("flux.modules.conditioner")
    cond.HFEmbedder = object
    sys.modules["flux.modules.conditioner"] = cond
    emb = types.ModuleType("flux.modules.image_embedders")
    emb.CannyImageEncoder = emb.DepthImageEncoder = emb.ReduxImageEncoder = object
    sys.modules["flux.modules.image_embedders"] = emb
    util = types.ModuleType("flux.util")
    util.PREFERED_KONTEXT_RESOLUTIONS = []
    sys.modules["flux.util"] = util
    sys.path.insert(0, bfl_src())
    import flux.modules.autoencoder as autoencoder
    import flux.model as model
    import flux.sampling as sampling
    return autoencoder, model, sampling


# ------------------------------------------------------------------ recipe

def seeded_weights(module, base_seed, norm_suffixes=("norm.weight", "norm1.weight", "norm2.weight",
                                                       "norm_out.weight")):
    """Every tensor of module's state_dict seeded; the recipe lines (name, dtype, shape,
    seed, std, mean)."""
    recipe, new = [], {}
    for i, (name, t) in enumerate(module.state_dict().items()):
        shape = list(t.shape)
        seed = base_seed + i
        if name.endswith(norm_suffixes):
            std, mean = 0.1, 1.0
        elif len(shape) == 1:
            std, mean = 0.1, 0.0
        else:
            std, mean = 1.0 / math.sqrt(float(torch.tensor(shape[1:]).prod())), 0.0
        std = float("%.9g" % std)
        torch.manual_seed(seed)
        new[name] = torch.randn(shape) * std + mean
        recipe.append((name, "f32", shape, seed, std, mean))
    module.load_state_dict(new, strict=True)
    return recipe


def write_recipe(path, recipe, meta, who):
    with open(path, "w") as f:
        f.write("# written by %s: name, dtype, shape, seed, std, mean\n" % who)
        f.write("# tensor = torch.manual_seed(seed); torch.randn(shape) * std + mean\n")
        for k, v in sorted(meta.items()):
            f.write("@%s\t%s\n" % (k, v))
        for name, dt, shape, seed, std, mean in recipe:
            f.write("%s\t%s\t%s\t%d\t%.9g\t%.9g\n" % (name, dt, json.dumps(shape), seed, std, mean))


def tiny_ae(autoencoder):
    ae = autoencoder.AutoEncoder(autoencoder.AutoEncoderParams(**AE), sample_z=False)
    recipe = seeded_weights(ae, 5000)
    ae.eval()
    return ae, recipe


def main():
    autoencoder, _, _ = import_bfl()
    os.makedirs(OUT, exist_ok=True)
    ae, recipe = tiny_ae(autoencoder)
    write_recipe(os.path.join(OUT, "ae.recipe"), recipe, {}, "tests/golden/gen_flux_ae.py")
    g = torch.Generator().manual_seed(16)
    image = torch.rand(1, 3, 64, 96, generator=g)
    z = torch.randn(1, 16, 8, 12, generator=g)
    with torch.no_grad():
        latent = ae.encode(image * 2 - 1)
        decoded = (ae.decode(z).clamp(-1, 1) + 1) / 2
    safetensors_io.save(os.path.join(OUT, "ae_io.safetensors"),
                        {"image": image, "latent": latent, "z": z, "decoded": decoded},
                        {"generator": "tests/golden/gen_flux_ae.py"})
    print("latent", tuple(latent.shape), "decoded", tuple(decoded.shape), "std", float(decoded.std()))


if __name__ == "__main__":
    main()
