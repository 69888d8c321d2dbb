#!/usr/bin/python3
"""Golden data for kiln.pipeline.txt2img on SD 3.5 (tests/lua/test_sd3_pipeline.lua): a
tiny txt2img computed with Stability AI's own sampling pieces (sd3_infer.py's
do_sampling: get_noise, get_sigmas, noise_scaling, sample_euler over CFGDenoiser or
SkipLayerCFGDenoiser, SD3LatentFormat; get_cond's assembly of the conditioning; the
VAEDecoder of sd3_impls.py and vae_decode's (x + 1) / 2 clamped), run from the
mirror as tests/golden/gen_sd3.py does (see its docstring; its code is read there,
never copied here).

do_sampling itself moves everything to CUDA in f16; this script calls the same
reference functions in the same order on the CPU in f32 instead.

The networks:
- a tiny Medium-style MMDiT (gen_sd3.py's "medium" layout: 3 blocks, MMDiT-X attention
  in blocks 0 and 1, q/k norms) with a 4096-wide context and an 80-wide pooled vector,
  what the tiny text encoders give: written as sd3/pipeline_dit.recipe;
- gen_sd3.py's tiny CLIP-L and bigG (sd3/clip_l.recipe, sd3/clip_g.recipe), no T5
  (the reference's empty T5: 77 tokens of zeros);
- the decoder of tests/golden/flux/ae.recipe (gen_flux_ae.py's tiny 16-channel
  autoencoder: ch 32, ch_mult 1,1,2,2, one res block) in sd3_impls.VAEDecoder.

The prompt is "a photo of a cat" (CLIP ids 320 1125 539 320 2368, which the Lua test's
word tokenizer gives), the negative "".

Run from the repository root:
    /usr/bin/python3 tests/golden/gen_sd3_pipeline.py /tmp/sd3.5-ref

Writes tests/golden/sd3/pipeline.safetensors: per case <case>_latent (the sampled
latent in the model's space, before SD3LatentFormat.process_out) and <case>_image:
- cfg: 48 wide x 32 high, seed 11, 4 steps, cfg 4.5, get_sigmas (kiln's "normal");
- slg: the same with SkipLayerCFGDenoiser, layers [1], scale 3.0, start 0.01, end
  0.5 (step 1 of 4 only: the same step ComfyUI's sigma window 0.01 .. 0.5 picks).
"""

import json
import os
import sys
import types

import torch

torch.set_num_threads(2)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_sd3  # noqa: E402
import safetensors_io  # noqa: E402  (examples/models, on the path through gen_sd3)

OUT = gen_sd3.OUT
WORDS = gen_sd3.WORDS
CASE = dict(seed=11, width=48, height=32, steps=4, cfg=4.5)
SLG = {"scale": 3.0, "start": 0.01, "end": 0.5, "layers": [1]}


def from_recipe(path, strip=""):
    w = {}
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            name, dt, shape, seed, std, mean = line.rstrip("\n").split("\t")
            if not name.startswith(strip):
                continue
            torch.manual_seed(int(seed))
            w[name[len(strip):]] = torch.randn(json.loads(shape)) * float(std) + float(mean)
    return w


def encoders():
    from other_impls import SDClipModel, SDXLClipG   # noqa: E402  (the reference)
    models = {
        "clip_l": SDClipModel(layer="hidden", layer_idx=-2, device="cpu", dtype=torch.float32,
                              layer_norm_hidden_state=False, return_projected_pooled=False,
                              textmodel_json_config=gen_sd3.CLIPS["clip_l"]),
        "clip_g": SDXLClipG(gen_sd3.CLIPS["clip_g"], device="cpu", dtype=torch.float32),
    }
    for name, m in models.items():
        m.transformer.load_state_dict(from_recipe(os.path.join(OUT, name + ".recipe")), strict=True)
    return models


def get_cond(sd3_infer, models, words):
    def pairs(pad):
        ids = [49406] + words + [49407]
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
    return sd3_infer.SD3Inferencer.get_cond(stub, "")


def main():
    ref = sys.argv[1] if len(sys.argv) > 1 else "/tmp/sd3.5-ref"
    if not os.path.exists(os.path.join(ref, "mmditx.py")):
        sys.exit("gen_sd3_pipeline.py: no mmditx.py in %s: extract Stability-AI/sd3.5 there" % ref)
    gen_sd3.install_stand_ins()
    # the VAE's attention's two patterns besides the network's (einops is not here)
    ein = sys.modules["einops"]
    net_rearrange = ein.rearrange

    def rearrange(t, pattern, **dims):
        if pattern == "b c h w -> b 1 (h w) c":
            b, c, h, w = t.shape
            return t.reshape(b, 1, c, h * w).transpose(2, 3)
        if pattern == "b 1 (h w) c -> b c h w":
            return t.transpose(2, 3).reshape(dims["b"], dims["c"], dims["h"], dims["w"])
        return net_rearrange(t, pattern, **dims)
    ein.rearrange = rearrange
    sys.modules["fire"] = types.ModuleType("fire")
    sys.path.insert(0, ref)
    import sd3_impls  # noqa: E402  (the reference, run as it is)
    import sd3_infer  # noqa: E402
    torch.set_grad_enabled(False)

    models = encoders()
    cond = get_cond(sd3_infer, models, WORDS)
    neg = get_cond(sd3_infer, models, [])
    gen_sd3.CONTEXT, gen_sd3.ADM = 4096, int(cond[1].shape[1])
    cfg = gen_sd3.CONFIGS["medium"]
    w, recipe = gen_sd3.build_weights(cfg, 7000)
    gen_sd3.write_recipe("pipeline_dit", recipe)
    base = sd3_impls.BaseModel(shift=3.0, file=gen_sd3.FileLike(w), prefix="", dtype=torch.float32)
    base.diffusion_model.load_state_dict(w, strict=True)
    base.eval()

    dec = sd3_impls.VAEDecoder(ch=32, ch_mult=(1, 1, 2, 2), num_res_blocks=1, z_channels=16)
    dec.load_state_dict(from_recipe(os.path.join(HERE, "flux", "ae.recipe"), "decoder."), strict=True)
    dec.eval()

    # do_sampling's steps (sd3_infer.py), on the CPU in f32
    inf = types.SimpleNamespace(print=lambda *a: None,
                                sd3=types.SimpleNamespace(model=base))
    out = {}
    for case, slg in (("cfg", {}), ("slg", SLG)):
        shape = (1, 16, CASE["height"] // 8, CASE["width"] // 8)
        latent = sd3_impls.SD3LatentFormat().process_in(torch.zeros(shape))
        noise = sd3_infer.SD3Inferencer.get_noise(inf, CASE["seed"], latent)
        sigmas = sd3_infer.SD3Inferencer.get_sigmas(inf, base.model_sampling, CASE["steps"])
        fix = lambda c: {"c_crossattn": c[0], "y": c[1]}  # noqa: E731
        extra = {"cond": fix(cond), "uncond": fix(neg), "cond_scale": CASE["cfg"]}
        x = base.model_sampling.noise_scaling(sigmas[0], noise, latent, True)
        den = (sd3_impls.SkipLayerCFGDenoiser if slg else sd3_impls.CFGDenoiser)(base, CASE["steps"], slg)
        lat = sd3_impls.sample_euler(den, x, sigmas, extra_args=extra)
        img = torch.clamp((dec(sd3_impls.SD3LatentFormat().process_out(lat)) + 1.0) / 2.0, min=0.0, max=1.0)
        out[case + "_latent"], out[case + "_image"] = lat.float(), img.float()
    safetensors_io.save(os.path.join(OUT, "pipeline.safetensors"), {k: v.contiguous() for k, v in out.items()},
                        {"generator": "tests/golden/gen_sd3_pipeline.py"})
    for k, v in out.items():
        print(k, tuple(v.shape), "std %.4f" % float(v.std()))
    d = (out["cfg_latent"] - out["slg_latent"]).abs().max()
    print("slg changes the latent by %.4f" % float(d))


if __name__ == "__main__":
    main()
