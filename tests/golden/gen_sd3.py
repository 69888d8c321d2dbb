#!/usr/bin/python3
"""Golden data for kiln.mmdit and kiln.families.sd3 (tests/lua/test_sd3.lua): tiny
SD 3.5-style MMDiT networks in Stability AI's tensor names, their weights as a recipe
the Lua test rebuilds (seeded kiln.randn = torch.randn, as gen_flux.py does), the
inputs of one forward and what Stability AI's own reference code computes from them.

The reference is NOT part of this repository: it is the sd3.5 repository
(github.com/Stability-AI/sd3.5, commit fbf8f483f992d8d6ad4eaaeb23b1dc5f523c3b3a),
extracted outside the tree and run as it is:

    git --git-dir=<mirror of Stability-AI/sd3.5> archive fbf8f48 | tar -x -C /tmp/sd3.5-ref
    /usr/bin/python3 tests/golden/gen_sd3.py /tmp/sd3.5-ref

Its modules import einops, transformers, safetensors and tqdm, and call torch 2's
scaled_dot_product_attention; none of these is on this machine (Debian's torch 1.13),
so this script puts stand-ins in their place before importing it: einops.rearrange
for the two patterns mmditx.py uses (the position table to and from its grid),
scaled_dot_product_attention as softmax(q k^T / sqrt(d)) v, and empty modules for
the tokenizer, file and progress-bar imports the network never reaches. Everything
else (sd3_impls.BaseModel reading the configuration from the weights' shapes, the
MMDiTX forward, ModelSamplingDiscreteFlow, CFGDenoiser, SkipLayerCFGDenoiser) is the
reference's own code.

Three networks (heads = depth and hidden = 64 * depth, as the reference's loader
forces; patch 2, a 6x6 position table cropped to the 3x2 patches of a 6x4 latent,
context 32 wide, pooled 24 wide):
- medium: 3 blocks, RMS q/k norms, MMDiT-X self-attention in blocks 0 and 1 (as
  SD 3.5 Medium's first 13);
- large: 2 blocks, RMS q/k norms (SD 3.5 Large);
- sd3: 2 blocks, no q/k norms (SD 3 Medium's layout).

Writes under tests/golden/sd3/:
- <name>.recipe: name, dtype, shape, seed, std, mean per tensor (tensor =
  torch.manual_seed(seed); torch.randn(shape) * std + mean);
- io.safetensors: x [2, 16, 6, 4], sigma [2], t [2] (= sigma * 1000 as the reference's
  timestep), context [2, 5, 32], y [2, 24]; per network <name>.out (MMDiTX.forward),
  <name>.denoised (BaseModel.apply_model: x - out * sigma); medium.skip1 (skip_layers
  [1]); medium.cfg (CFGDenoiser, cond = batch row 1, uncond = row 2, scale 4.5) and
  medium.slg (SkipLayerCFGDenoiser at its first guided step, scale 2.5, layers [1]);
  sigmas_shift3 (the 1000 values of ModelSamplingDiscreteFlow(3.0).sigmas) and
  sched_28 (sd3_infer's get_sigmas for 28 steps, shift 3), sched_4 (4 steps).
"""

import json
import math
import os
import sys
import types

import torch

torch.set_num_threads(2)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "models"))
import safetensors_io  # noqa: E402

OUT = os.path.join(ROOT, "tests", "golden", "sd3")
CONTEXT, ADM, PATCH, POS = 32, 24, 2, 6

CONFIGS = {
    "medium": dict(depth=3, qk_norm=True, x_attn=(0, 1)),
    "large": dict(depth=2, qk_norm=True, x_attn=()),
    "sd3": dict(depth=2, qk_norm=False, x_attn=()),
}


# ------------------------------------------------------------------ stand-ins

def install_stand_ins():
    ein = types.ModuleType("einops")

    def rearrange(t, pattern, **dims):
        if pattern == "1 (h w) c -> 1 h w c":
            return t.reshape(1, dims["h"], dims["w"], t.shape[-1])
        if pattern == "1 h w c -> 1 (h w) c":
            return t.reshape(1, t.shape[1] * t.shape[2], t.shape[3])
        raise NotImplementedError(pattern)

    def repeat(*_a, **_k):
        raise NotImplementedError("einops.repeat (registers) is not used by these networks")

    ein.rearrange, ein.repeat = rearrange, repeat
    sys.modules["einops"] = ein
    tr = types.ModuleType("transformers")
    tr.CLIPTokenizer = tr.T5TokenizerFast = object
    sys.modules["transformers"] = tr
    st = types.ModuleType("safetensors")
    st.safe_open = None
    sys.modules["safetensors"] = st
    tq = types.ModuleType("tqdm")
    tq.tqdm = lambda it, *a, **k: it
    tq.trange = lambda *a, **k: range(*a)
    sys.modules["tqdm"] = tq

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        assert not is_causal
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if attn_mask is not None:
            s = s + attn_mask
        return torch.softmax(s, dim=-1) @ v

    torch.nn.functional.scaled_dot_product_attention = sdpa


class FileLike:
    """What sd3_impls.BaseModel reads its configuration from (safe_open's face)."""

    def __init__(self, w):
        self.w = w

    def get_tensor(self, name):
        return self.w[name]

    def keys(self):
        return list(self.w.keys())


# ------------------------------------------------------------------ tensors

def names_and_shapes(cfg):
    depth = cfg["depth"]
    H = 64 * depth
    M = 4 * H
    D = 64
    r = []

    def lin(p, o, i, bias=True):
        r.append((p + ".weight", [o, i]))
        if bias:
            r.append((p + ".bias", [o]))

    r.append(("x_embedder.proj.weight", [H, 16, PATCH, PATCH]))
    r.append(("x_embedder.proj.bias", [H]))
    r.append(("pos_embed", [1, POS * POS, H]))
    lin("t_embedder.mlp.0", H, 256)
    lin("t_embedder.mlp.2", H, H)
    lin("y_embedder.mlp.0", H, ADM)
    lin("y_embedder.mlp.2", H, H)
    lin("context_embedder", H, CONTEXT)

    def attn(p):
        lin(p + ".qkv", 3 * H, H)
        if cfg["qk_norm"]:
            r.append((p + ".ln_q.weight", [D]))
            r.append((p + ".ln_k.weight", [D]))

    for b in range(depth):
        for s in ("context_block", "x_block"):
            p = "joint_blocks.%d.%s." % (b, s)
            pre_only = s == "context_block" and b == depth - 1
            x2 = s == "x_block" and b in cfg["x_attn"]
            lin(p + "adaLN_modulation.1", (9 if x2 else 2 if pre_only else 6) * H, H)
            attn(p + "attn")
            if not pre_only:
                lin(p + "attn.proj", H, H)
            if x2:
                attn(p + "attn2")
                lin(p + "attn2.proj", H, H)
            if not pre_only:
                lin(p + "mlp.fc1", M, H)
                lin(p + "mlp.fc2", H, M)
    lin("final_layer.linear", PATCH * PATCH * 16, H)
    lin("final_layer.adaLN_modulation.1", 2 * H, H)
    return r


def build_weights(cfg, seed0):
    w, recipe = {}, []
    for i, (name, shape) in enumerate(names_and_shapes(cfg)):
        seed = seed0 + i
        if name.endswith("ln_q.weight") or name.endswith("ln_k.weight"):
            std, mean = 0.2, 1.0
        elif name == "pos_embed":
            std, mean = 0.5, 0.0
        elif len(shape) == 1:
            std, mean = 0.1, 0.0
        else:
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            std, mean = 1.0 / math.sqrt(fan_in), 0.0
        std = float("%.9g" % std)   # the recipe's text, so the Lua rebuild is the same
        torch.manual_seed(seed)
        w[name] = torch.randn(shape) * std + mean
        recipe.append((name, "f32", shape, seed, std, mean))
    return w, recipe


def write_recipe(name, recipe):
    with open(os.path.join(OUT, name + ".recipe"), "w") as f:
        f.write("# written by tests/golden/gen_sd3.py: name, dtype, shape, seed, std, mean\n")
        f.write("# tensor = torch.manual_seed(seed); torch.randn(shape) * std + mean\n")
        for n, dt, shape, seed, std, mean in recipe:
            f.write("%s\t%s\t%s\t%d\t%.9g\t%.9g\n" % (n, dt, json.dumps(shape), seed, std, mean))


# ------------------------------------------------------------------ main

def main():
    ref = sys.argv[1] if len(sys.argv) > 1 else "/tmp/sd3.5-ref"
    if not os.path.exists(os.path.join(ref, "mmditx.py")):
        sys.exit("gen_sd3.py: no mmditx.py in %s: extract Stability-AI/sd3.5 there (see the docstring)" % ref)
    install_stand_ins()
    sys.modules["fire"] = types.ModuleType("fire")
    sys.path.insert(0, ref)
    import sd3_impls  # noqa: E402  (the reference, run as it is)
    import sd3_infer  # noqa: E402
    os.makedirs(OUT, exist_ok=True)

    g = torch.Generator().manual_seed(40)
    x = torch.randn(2, 16, 6, 4, generator=g)
    sigma = torch.tensor([0.9, 0.35])
    context = torch.randn(2, 5, CONTEXT, generator=g)
    y = torch.randn(2, ADM, generator=g)
    io = {"x": x, "sigma": sigma, "context": context, "y": y}

    for k, (name, cfg) in enumerate(CONFIGS.items()):
        w, recipe = build_weights(cfg, 5000 + 1000 * k)
        write_recipe(name, recipe)
        # the reference reads the configuration from the shapes and builds the network
        base = sd3_impls.BaseModel(shift=3.0, file=FileLike(w), prefix="", dtype=torch.float32)
        net = base.diffusion_model
        assert net.num_heads == cfg["depth"] and net.x_block_self_attn_layers == list(cfg["x_attn"])
        net.load_state_dict(w, strict=True)
        net.eval()
        with torch.no_grad():
            t = base.model_sampling.timestep(sigma).float()
            io["t"] = t
            io[name + ".out"] = net(x, t, context=context, y=y)
            io[name + ".denoised"] = base.apply_model(x, sigma, c_crossattn=context, y=y)
            if name == "medium":
                io[name + ".skip1"] = net(x, t, context=context, y=y, skip_layers=[1])
                cond = {"c_crossattn": context[0:1], "y": y[0:1]}
                uncond = {"c_crossattn": context[1:2], "y": y[1:2]}
                x1, s1 = x[0:1], sigma[0:1]
                io[name + ".cfg"] = sd3_impls.CFGDenoiser(base)(x1, s1, cond, uncond, 4.5)
                slg = sd3_impls.SkipLayerCFGDenoiser(base, 10, {"scale": 2.5, "start": 0.01, "end": 0.2,
                                                                "layers": [1]})
                slg(x1, s1, cond, uncond, 4.5)     # step 0: outside the window (> 0.01 * 10)
                io[name + ".slg"] = slg(x1, s1, cond, uncond, 4.5)   # step 1: guided
        print("%s: |out| max %.4f" % (name, io[name + ".out"].abs().max()))

    ms = sd3_impls.ModelSamplingDiscreteFlow(shift=3.0)
    io["sigmas_shift3"] = ms.sigmas.float()
    for steps in (28, 4):
        io["sched_%d" % steps] = sd3_infer.SD3Inferencer.get_sigmas(None, ms, steps).float()
    conditioning(sd3_infer, io)
    safetensors_io.save(os.path.join(OUT, "io.safetensors"), {k: v.contiguous() for k, v in io.items()})


# ------------------------------------------------------------------ conditioning

# Tiny text encoders in the reference's CLIPTextModel (transformers' names): CLIP-L
# style (quick_gelu) and bigG style (gelu), each with a text_projection.
CLIPS = {
    "clip_l": dict(hidden_act="quick_gelu", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                   num_hidden_layers=3),
    "clip_g": dict(hidden_act="gelu", hidden_size=48, intermediate_size=96, num_attention_heads=2,
                   num_hidden_layers=3),
}
# "a photo of a cat" in CLIP's vocabulary (what the reference's SD3Tokenizer gives):
# start, the words, end, then CLIP-L pads with the end token and bigG with 0
WORDS = [320, 1125, 539, 320, 2368]


def conditioning(sd3_infer, io):
    """sd3_infer.SD3Inferencer.get_cond (the reference's assembly of the context and the
    pooled vector) over the reference's ClipL / ClipG models with tiny random weights;
    the T5 stands in as ComfyUI's empty T5 (77 tokens of zeros), which get_cond takes
    like any T5 output."""
    from other_impls import SDClipModel, SDXLClipG   # noqa: E402  (the reference)
    torch.set_grad_enabled(False)     # as sd3_infer.main (@torch.no_grad) builds them
    models = {
        "clip_l": SDClipModel(layer="hidden", layer_idx=-2, device="cpu", dtype=torch.float32,
                              layer_norm_hidden_state=False, return_projected_pooled=False,
                              textmodel_json_config=CLIPS["clip_l"]),
        "clip_g": SDXLClipG(CLIPS["clip_g"], device="cpu", dtype=torch.float32),
    }
    for k, (name, m) in enumerate(models.items()):
        recipe, sd = [], {}
        for i, (n, t) in enumerate(sorted(m.transformer.state_dict().items())):
            seed = 9000 + 500 * k + i
            if n.endswith("layer_norm1.weight") or n.endswith("layer_norm2.weight") or \
                    n.endswith("final_layer_norm.weight"):
                std, mean = 0.2, 1.0
            elif t.dim() == 1:
                std, mean = 0.1, 0.0
            elif "embedding" in n:
                std, mean = 0.5, 0.0
            else:
                std, mean = 1.0 / math.sqrt(t.shape[1]), 0.0
            std = float("%.9g" % std)
            torch.manual_seed(seed)
            sd[n] = torch.randn(list(t.shape)) * std + mean
            recipe.append((n, "f32", list(t.shape), seed, std, mean))
        m.transformer.load_state_dict(sd, strict=True)
        write_recipe(name, recipe)

    def pairs(pad):
        ids = [49406] + WORDS + [49407]
        ids += [pad] * (77 - len(ids))
        return [[(i, 1.0) for i in ids]]

    class EmptyT5:
        def encode_token_weights(self, _tokens):
            return torch.zeros(1, 77, 4096), None

    stub = types.SimpleNamespace(
        print=lambda *a: None,
        tokenizer=types.SimpleNamespace(tokenize_with_weights=lambda text: {
            "l": pairs(49407), "g": pairs(0), "t5xxl": None}),
        clip_l=types.SimpleNamespace(model=models["clip_l"]),
        clip_g=types.SimpleNamespace(model=models["clip_g"]),
        t5xxl=types.SimpleNamespace(model=EmptyT5()),
    )
    with torch.no_grad():
        cond, pooled = sd3_infer.SD3Inferencer.get_cond(stub, "a photo of a cat")
    w = CLIPS["clip_l"]["hidden_size"] + CLIPS["clip_g"]["hidden_size"]
    assert list(cond.shape) == [1, 154, 4096], cond.shape
    # only the CLIP block's first features are not zero: those are kept (the file stays small)
    assert cond[:, :77, w:].abs().max() == 0 and cond[:, 77:].abs().max() == 0
    io["cond.lg"] = cond[:, :77, :w]
    io["cond.pooled"] = pooled
    print("conditioning: cond %s, pooled %s" % (list(cond.shape), list(pooled.shape)))


if __name__ == "__main__":
    main()
