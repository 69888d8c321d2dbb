#!/usr/bin/python3
"""Golden data for tests/lua/test_weighting.lua: the conditioning of the tiny SD 1.x
text encoder (gen_sd_golden.py's modules and seeds) for weighted prompts, weighted as
ComfyUI does (each weighted token: (z - z_empty) * w + z_empty, z_empty the encoding
of the empty prompt: start, end, then padding) and as A1111 does (multiply, restore
the mean), written out here independently of kiln's prompt code.

Run from the repository root:  /usr/bin/python3 tests/golden/gen_weighting.py

Token windows are written by hand: word ids are the built-in CLIP vocabulary's (a 320,
photo 1125, of 539, cat 2368), which the Lua test's whitespace tokenizer gives, and
the per-token weights are those the prompts in the comments parse to.

Output: tests/golden/weighting/golden.safetensors (float32), keys below."""
import json
import os
import struct
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_sd_golden as G  # noqa: E402
from gen_embeddings import hf_hidden  # noqa: E402

OUT = os.path.join(HERE, "weighting")
BOS, EOS = 49406, 49407
A, PHOTO, OF, CAT = 320, 1125, 539, 2368


def save(path, tensors):
    """safetensors writer (float32)."""
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        b = np.ascontiguousarray(t.detach().float().numpy().astype("<f4")).tobytes()
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"generator": "tests/golden/gen_weighting.py", "torch": torch.__version__}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def windows(pairs, pad=EOS):
    """[(id, weight), ...] -> list of (ids [77], weights [77]): start, up to 75
    tokens, end, padding (the end token for SD 1.x and SDXL's CLIP-L, 0 for the
    OpenCLIP encoders of SD 2.x and SDXL), as both UIs chunk a prompt without commas."""
    out = []
    for k in range(0, max(len(pairs), 1), 75):
        part = pairs[k:k + 75]
        ids = [BOS] + [p[0] for p in part] + [EOS]
        ws = [1.0] + [p[1] for p in part] + [1.0]
        ids += [pad] * (77 - len(ids))
        ws += [1.0] * (77 - len(ws))
        out.append((ids, ws))
    return out


def comfy(z, z_empty, w):
    """ComfyUI's encode_token_weights for one window."""
    z = z.clone()
    for j, wj in enumerate(w):
        if wj != 1.0:
            z[0, j] = (z[0, j] - z_empty[0, j]) * wj + z_empty[0, j]
    return z


def main():
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    g = {}
    with torch.no_grad():
        m = G.sd1_model()
        G.init_recipe(m, 10000)
        tm = m.cond_stage_model.transformer.text_model

        def enc(ids):
            return tm.final_layer_norm(hf_hidden(tm, torch.tensor([ids]), {})[-1])

        empty = enc([BOS, EOS] + [EOS] * 75)

        def run(pairs, how):
            zs = []
            for ids, ws in windows(pairs):
                z = enc(ids)
                zs.append(comfy(z, empty, ws) if how == "comfy" else G.emphasis(z, ws))
            return torch.cat(zs, dim=1)

        # "a (photo:1.3) of (cat)": photo 1.3, cat 1.1 in both parses
        p = [(A, 1.0), (PHOTO, 1.3), (OF, 1.0), (CAT, 1.1)]
        g["sd1.comfy"] = run(p, "comfy")
        g["sd1.a1111"] = run(p, "a1111")
        # "(a photo:0.5) of (cat:1.4)": down and up
        g["sd1.comfy_down"] = run([(A, 0.5), (PHOTO, 0.5), (OF, 1.0), (CAT, 1.4)], "comfy")
        # "((a photo:0.5) of) cat" in ComfyUI's parse: the inner weight replaces the
        # outer 1.1 (A1111 would give 0.5 * 1.1), "of" keeps the 1.1
        g["sd1.comfy_nested"] = run([(A, 0.5), (PHOTO, 0.5), (OF, 1.1), (CAT, 1.0)], "comfy")
        # "(a:1.2) " .. "photo " * 80: two windows, one empty prompt for both
        g["sd1.comfy_long"] = run([(A, 1.2)] + [(PHOTO, 1.0)] * 80, "comfy")
        g["sd1.empty"] = empty

        # SD 2.x: OpenCLIP, penultimate layer + ln_final (gen_sd_golden's sd2), windows
        # and the empty prompt padded with 0 (ComfyUI's SD2 tokenizer)
        m = G.sd2_model()
        G.init_recipe(m, 20000)
        oc = m.cond_stage_model.model

        def enc2(ids):
            return oc.ln_final(oc(torch.tensor([ids]))[-2])

        empty2 = enc2([BOS, EOS] + [0] * 75)

        def run2(pairs):
            return torch.cat([comfy(enc2(ids), empty2, ws) for ids, ws in windows(pairs, 0)], dim=1)

        g["sd2.comfy"] = run2(p)
        g["sd2.comfy_long"] = run2([(A, 1.2)] + [(PHOTO, 1.0)] * 80)

        # SDXL: each encoder weighted against its own empty prompt (CLIP-L penultimate,
        # padded with the end token; bigG penultimate, padded with 0; no final norm),
        # then concatenated; pooled from bigG's first window, unweighted (ComfyUI's
        # first_pooled)
        m = G.sdxl_model()
        G.init_recipe(m, 30000)
        cl = m.conditioner.embedders[0].transformer.text_model
        cg = m.conditioner.embedders[1].model

        def run_xl(pairs):
            el = cl(torch.tensor([[BOS, EOS] + [EOS] * 75]))[-2]
            eg = cg(torch.tensor([[BOS, EOS] + [0] * 75]))[-2]
            zl = [comfy(cl(torch.tensor([ids]))[-2], el, ws) for ids, ws in windows(pairs, EOS)]
            zg = [comfy(cg(torch.tensor([ids]))[-2], eg, ws) for ids, ws in windows(pairs, 0)]
            ids0 = torch.tensor([windows(pairs, 0)[0][0]])
            pooled = cg.pooled(cg(ids0)[-1], ids0)
            return torch.cat([torch.cat(zl, dim=1), torch.cat(zg, dim=1)], dim=-1), pooled

        g["sdxl.comfy"], g["sdxl.pooled"] = run_xl(p)
        g["sdxl.comfy_long"], _ = run_xl([(A, 1.2)] + [(PHOTO, 1.0)] * 80)

    save(os.path.join(OUT, "golden.safetensors"), g)
    for f in sorted(os.listdir(OUT)):
        print("  %-24s %7d bytes" % (f, os.path.getsize(os.path.join(OUT, f))))


if __name__ == "__main__":
    main()
