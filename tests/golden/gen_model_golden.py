#!/usr/bin/python3
"""Golden outputs of the shipped demo model, for kiln's network tests.

    /usr/bin/python3 tests/golden/gen_model_golden.py      (from the repo root)

Loads examples/models/kiln-shapes.safetensors (f16 weights, converted to f32)
into the PyTorch reference modules of examples/models/sd_modules.py, runs
everything in f32 on the CPU (torch.set_num_threads(2)) and writes
tests/golden/model/*.safetensors. Metadata of each file repeats the inputs
that are not tensors (prompts, checkpoint name, scale factor).

tokenizer.safetensors
  ids            int64 [3, 77]  CLIP token ids of PROMPTS (below), as
                 tokenizer.Tokenizer gives them: <|startoftext|>, tokens,
                 <|endoftext|>, padded with <|endoftext|>. Prompt 2 has words
                 outside the caption vocabulary, upper case, a digit and
                 punctuation, so it exercises the byte-level fallback.
  uncond_ids     int64 [1, 77]  ids of the empty prompt "" (CFG's negative).
  (metadata prompt.0 .. prompt.2 hold the strings.)

clip.safetensors
  ids            int64 [3, 77]  same as tokenizer ids
  out            f32 [3, 77, 64] last hidden state after final_layer_norm
                 (SD 1.x conditioning) for each prompt
  uncond_out     f32 [1, 77, 64] the same for ""

unet.safetensors
  x              f32 [2, 4, 16, 16]  torch.manual_seed(1234); torch.randn
  t              int64 [2]           timesteps [10, 500]
  context        f32 [2, 77, 64]     clip out of prompts 0 and 1
  out            f32 [2, 4, 16, 16]  UNet output (the model's prediction: v for the
                                     shipped model, kiln.prediction)

vae.safetensors
  image          f32 [1, 3, 64, 64]  a data.py picture in [0, 1] (uint8/255)
  encode_out     f32 [1, 4, 16, 16]  posterior mode (mean) of encode(2*image-1)
                                     times scale_factor, as vae:encode returns
  decode_in      f32 [1, 4, 16, 16]  = encode_out (scaled latent)
  decode_out     f32 [1, 3, 64, 64]  clamp((decode(decode_in / scale_factor)
                                     + 1) / 2, 0, 1), as vae:decode returns
  (metadata scale_factor, caption of the picture)

The values are f32 computed with f32 weights that were f16 in the file, so
an f32 implementation should match to about 1e-4 relative (the softmaxes and
norms reorder sums); f16 compute needs looser tolerances.
"""

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np                            # noqa: E402
import torch                                  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "examples", "models")
sys.path.insert(0, MODELS)

import data                                   # noqa: E402
import safetensors_io                         # noqa: E402
import tokenizer as tk                        # noqa: E402
from sd_modules import load_checkpoint        # noqa: E402

CKPT = os.path.join(MODELS, "kiln-shapes.safetensors")
OUT = os.path.join(ROOT, "tests", "golden", "model")
PROMPTS = [
    "a red circle on a blue background",
    "a small yellow star above a green square on a black background",
    "A Magenta hexagon, 3 stars & <b>two</b>  moons!",
]


def main():
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    model = load_checkpoint(CKPT)
    sf = model.scale_factor
    tok = tk.Tokenizer(os.path.join(MODELS, "vocab.json"),
                       os.path.join(MODELS, "merges.txt"))
    meta = {"checkpoint": "examples/models/kiln-shapes.safetensors",
            "generator": "tests/golden/gen_model_golden.py"}
    pmeta = dict(meta, **{"prompt.%d" % i: p for i, p in enumerate(PROMPTS)})

    ids = torch.tensor([tok(p) for p in PROMPTS], dtype=torch.int64)
    uncond = torch.tensor([tok("")], dtype=torch.int64)
    safetensors_io.save(os.path.join(OUT, "tokenizer.safetensors"),
                        {"ids": ids, "uncond_ids": uncond}, pmeta)

    with torch.no_grad():
        clip_out = model.cond_stage_model(ids)
        clip_unc = model.cond_stage_model(uncond)
    safetensors_io.save(os.path.join(OUT, "clip.safetensors"),
                        {"ids": ids, "out": clip_out, "uncond_out": clip_unc},
                        pmeta)

    torch.manual_seed(1234)
    x = torch.randn(2, 4, 16, 16)
    t = torch.tensor([10, 500], dtype=torch.int64)
    ctx = clip_out[:2].clone()
    with torch.no_grad():
        eps = model.model.diffusion_model(x, t, ctx)
    safetensors_io.save(os.path.join(OUT, "unet.safetensors"),
                        {"x": x, "t": t, "context": ctx, "out": eps},
                        dict(pmeta, context="clip out of prompt.0 and prompt.1"))

    img_u8, caption, _ = data.sample(np.random.default_rng(7))
    image = torch.from_numpy(img_u8.astype(np.float32) / 255.0).permute(2, 0, 1)[None]
    vae = model.first_stage_model
    with torch.no_grad():
        mean, _ = vae.encode_moments(image * 2 - 1)
        enc = mean * sf
        dec = ((vae.decode(enc / sf) + 1) / 2).clamp(0, 1)
    safetensors_io.save(os.path.join(OUT, "vae.safetensors"),
                        {"image": image.contiguous(), "encode_out": enc,
                         "decode_in": enc.clone(), "decode_out": dec},
                        dict(meta, scale_factor="%.6f" % sf, caption=caption))

    total = 0
    for f in sorted(os.listdir(OUT)):
        n = os.path.getsize(os.path.join(OUT, f))
        total += n
        print("%-24s %7d bytes" % (f, n))
    print("total %d bytes; ids[2] = %s" % (total, ids[2][:24].tolist()))
    print("vae round trip L1 (0..1): %.4f" % (dec - image).abs().mean())


if __name__ == "__main__":
    main()
