#!/usr/bin/python3
"""Golden data for kiln.pipeline.txt2img on Flux (tests/lua/test_flux_pipeline.lua): a
tiny txt2img computed with Black Forest Labs' own sampling loop and autoencoder
(flux/sampling.py: get_noise, prepare, get_schedule, denoise, unpack; flux/model.py's
Flux; modules/autoencoder.py), run from the mirror as tests/golden/gen_flux_ae.py does
(its code is read there, never copied here).

The networks: a tiny Flux of tests/golden/gen_flux.py's recipe with a 64-wide pooled
vector (BFL's Flux class loaded with those weights), the tiny autoencoder of
gen_flux_ae.py, the tiny T5 of tests/golden/t5/bare.safetensors (gen_t5.py's reference
encoder) and the tiny CLIP-L of tests/golden/sd/sd1.recipe (gen_sd_golden.py's
CLIPTextModel; BFL's HFEmbedder takes its pooler_output: the final norm at the end
token). The tiny T5's vocabulary (100 ids) cannot hold a real prompt's tokens, so the
prompt is "" (T5 ids 1, then 0 up to the padded length; CLIP's start, end, then end
tokens up to 77), which both tokenizers give exactly.

Run from the repository root:  /usr/bin/python3 tests/golden/gen_flux_pipeline.py

Writes under tests/golden/flux/:
- pipeline_dit.recipe: the tiny Flux (vector_in 64 wide).
- pipeline.safetensors: per case the picture (BFL's cli: (decode(x).clamp(-1, 1) + 1) / 2)
  and the final latents: schnell_image / schnell_latent (32 x 32, seed 7, 4 steps, T5 at
  256 tokens, unshifted schedule) and dev_image / dev_latent (48 wide x 32 high, seed 8,
  4 steps, guidance 3.5, T5 at 512 tokens, schedule shifted by the 6 image tokens).
"""

import os
import sys

import torch

torch.set_num_threads(2)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_flux  # noqa: E402
import gen_flux_ae  # noqa: E402
import gen_t5  # noqa: E402
import gen_sd_golden  # noqa: E402
import safetensors_io  # noqa: E402  (examples/models, on the path through gen_flux)

OUT = gen_flux.OUT
VEC = 64


def tiny_flux(model_mod, guidance):
    gen_flux.VEC = VEC
    w, recipe = gen_flux.build_weights()
    p = model_mod.FluxParams(in_channels=gen_flux.IN_CH, out_channels=gen_flux.IN_CH, vec_in_dim=VEC,
                             context_in_dim=gen_flux.CONTEXT, hidden_size=gen_flux.HIDDEN, mlp_ratio=4.0,
                             num_heads=gen_flux.HEADS, depth=gen_flux.DEPTH,
                             depth_single_blocks=gen_flux.DEPTH_SINGLE, axes_dim=list(gen_flux.AXES),
                             theta=int(gen_flux.THETA), qkv_bias=True, guidance_embed=guidance)
    net = model_mod.Flux(p)
    sd = {k: v for k, v in w.items() if guidance or not k.startswith("guidance_in.")}
    net.load_state_dict(sd, strict=True)
    net.eval()
    return net, recipe


def t5_states(length):
    W, _ = safetensors_io.load(os.path.join(HERE, "t5", "bare.safetensors"))
    W = {k: v.double() for k, v in W.items()}
    ids = torch.tensor([[1] + [0] * (length - 1)])
    return gen_t5.encode(W, ids).float()


def clip_pooled():
    m = gen_sd_golden.CLIPTextModel()
    pre = "cond_stage_model.transformer."
    sd = {}
    with open(os.path.join(HERE, "sd", "sd1.recipe")) as f:
        for line in f:
            if line.startswith(pre):
                name, dt, shape, seed, std, mean = line.rstrip("\n").split("\t")
                shape = [int(s) for s in shape.strip("[]").split(",")]
                if dt == "i64":
                    sd[name[len(pre):]] = torch.arange(shape[1]).unsqueeze(0)
                else:
                    sd[name[len(pre):]] = gen_sd_golden.seeded(shape, int(seed)) * float(std) + float(mean)
    m.load_state_dict(sd, strict=True)
    ids = torch.tensor([[49406] + [49407] * 76])
    with torch.no_grad():
        hs = m.text_model(ids)
        last = m.text_model.final_layer_norm(hs[-1])
    return last[:, int(ids[0].argmax())]


def run(sampling, net, ae, seed, height, width, steps, guidance, t5_length, shift):
    context, pooled = t5_states(t5_length), clip_pooled()
    with torch.no_grad():
        noise = sampling.get_noise(1, height, width, torch.device("cpu"), torch.float32, seed)
        inp = sampling.prepare(lambda prompts: context, lambda prompts: pooled, noise, "")
        timesteps = sampling.get_schedule(steps, inp["img"].shape[1], shift=shift)
        x = sampling.denoise(net, **inp, timesteps=timesteps, guidance=guidance)
        lat = sampling.unpack(x.float(), height, width)
        img = (ae.decode(lat).clamp(-1, 1) + 1) / 2
    return img, lat


def main():
    autoencoder, model_mod, sampling = gen_flux_ae.import_bfl()
    ae, _ = gen_flux_ae.tiny_ae(autoencoder)
    dev, recipe = tiny_flux(model_mod, True)
    schnell, _ = tiny_flux(model_mod, False)
    meta = {"kiln.flux.heads": str(gen_flux.HEADS), "kiln.flux.axes_dim": ",".join(str(a) for a in gen_flux.AXES)}
    gen_flux_ae.write_recipe(os.path.join(OUT, "pipeline_dit.recipe"), recipe, meta,
                             "tests/golden/gen_flux_pipeline.py")
    out = {}
    out["schnell_image"], out["schnell_latent"] = run(sampling, schnell, ae, 7, 32, 32, 4, 3.5, 256, False)
    out["dev_image"], out["dev_latent"] = run(sampling, dev, ae, 8, 32, 48, 4, 3.5, 512, True)
    safetensors_io.save(os.path.join(OUT, "pipeline.safetensors"), out,
                        {"generator": "tests/golden/gen_flux_pipeline.py"})
    for k, v in out.items():
        print(k, tuple(v.shape), "std %.4f" % float(v.std()))


if __name__ == "__main__":
    main()
