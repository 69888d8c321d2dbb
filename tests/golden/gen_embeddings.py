#!/usr/bin/python3
"""Golden data for tests/lua/test_embedding.lua: small textual-inversion embedding
files for the tiny checkpoints of gen_sd_golden.py, and the conditioning PyTorch's
text encoders give when the embedding's vectors replace the token embeddings at the
placeholder positions of a prompt.

Run from the repository root:  /usr/bin/python3 tests/golden/gen_embeddings.py

The tiny SD 1.x and SDXL models are rebuilt with gen_sd_golden.py's modules and seeds
(the same weights the Lua test rebuilds from the recipes). The token windows are
written out by hand here (start, ids, placeholders, end, padding as A1111 pads), so
the generator does not share kiln's prompt code: word ids are those of the Lua test's
whitespace tokenizer (a 320, photo 1125, of 539, cat 2368). The emphasis is A1111's
(multiply by the token weights, restore the mean), per encoder.

Files in tests/golden/embeddings/:
  tiny_neg.safetensors     emb_params [3, 64]             (A1111 / ComfyUI layout)
  tiny_a1111.safetensors   string_to_param.* [2, 64] and string_to_token.* (A1111 .pt
                           dictionary flattened into safetensors)
  tiny_xl.safetensors      clip_l [2, 64], clip_g [2, 64]  (SDXL layout)
  golden.safetensors       the expected conditioning (float32), keys below."""
import json
import os
import struct
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_sd_golden as G  # noqa: E402

OUT = os.path.join(HERE, "embeddings")
BOS, EOS = 49406, 49407
A, PHOTO, OF, CAT = 320, 1125, 539, 2368


def save(path, tensors, meta=None):
    """safetensors writer (float32, and int64 for string_to_token)."""
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        if t.dtype == torch.int64:
            a, dt = np.ascontiguousarray(t.numpy().astype("<i8")), "I64"
        else:
            a, dt = np.ascontiguousarray(t.detach().float().numpy().astype("<f4")), "F32"
        b = a.tobytes()
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = dict(meta or {}, generator="tests/golden/gen_embeddings.py")
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def vectors(n, width, seed):
    """Vectors on the scale of the tiny token embeddings (std 1/sqrt(width))."""
    torch.manual_seed(seed)
    return torch.randn([n, width]) / width ** 0.5


def window(items, pad):
    """items: ids, or ("emb", tensor [n, W]) -> (ids [77], {position: vector}).
    Placeholders are id 0; the token after the text is the end token, then pad."""
    ids, subst = [BOS], {}
    for it in items:
        if isinstance(it, tuple):
            for k in range(it[1].shape[0]):
                subst[len(ids)] = it[1][k]
                ids.append(0)
        else:
            ids.append(it)
    ids.append(EOS)
    while len(ids) < 77:
        ids.append(pad)
    assert len(ids) == 77
    return torch.tensor([ids]), subst


def weights_of(items, weight_of):
    """Per-position multipliers: weight_of(index of the item) for its positions."""
    w = [1.0]
    for i, it in enumerate(items):
        n = it[1].shape[0] if isinstance(it, tuple) else 1
        w += [weight_of(i)] * n
    return w + [1.0] * (77 - len(w))


def hf_hidden(tm, ids, subst):
    """transformers' CLIPTextTransformer with inputs_embeds: hidden states list."""
    x = tm.embeddings.token_embedding(ids).clone()
    for p, v in subst.items():
        x[0, p] = v
    n = ids.shape[1]
    x = x + tm.embeddings.position_embedding(torch.arange(n).unsqueeze(0))
    mask = torch.full((n, n), float("-inf")).triu(1)
    hs = [x]
    for layer in tm.encoder.layers:
        x = layer(x, mask)
        hs.append(x)
    return hs


def oc_hidden(oc, ids, subst):
    """open_clip's TextTransformer on substituted token embeddings."""
    x = oc.token_embedding(ids).clone()
    for p, v in subst.items():
        x[0, p] = v
    n = ids.shape[1]
    x = x + oc.positional_embedding[:n]
    mask = torch.full((n, n), float("-inf")).triu(1)
    x = x.permute(1, 0, 2)
    hs = [x.permute(1, 0, 2)]
    for r in oc.transformer.resblocks:
        x = r(x, mask)
        hs.append(x.permute(1, 0, 2))
    return hs


def main():
    os.makedirs(OUT, exist_ok=True)
    neg = vectors(3, 64, 40001)
    a1111 = vectors(2, 64, 40002)
    xl_l, xl_g = vectors(2, 64, 40003), vectors(2, 64, 40004)
    save(os.path.join(OUT, "tiny_neg.safetensors"), {"emb_params": neg})
    save(os.path.join(OUT, "tiny_a1111.safetensors"),
         {"string_to_param.*": a1111, "string_to_token.*": torch.tensor([265], dtype=torch.int64)})
    save(os.path.join(OUT, "tiny_xl.safetensors"), {"clip_l": xl_l, "clip_g": xl_g})

    g = {}
    with torch.no_grad():
        # ---- SD 1.x: last layer, final norm; padding with the end token
        m = G.sd1_model()
        G.init_recipe(m, 10000)
        tm = m.cond_stage_model.transformer.text_model

        def sd1(items, weight_of=None):
            ids, subst = window(items, EOS)
            z = tm.final_layer_norm(hf_hidden(tm, ids, subst)[-1])
            return G.emphasis(z, weights_of(items, weight_of)) if weight_of else z

        # "a photo of embedding:tiny_neg cat"
        items = [A, PHOTO, OF, ("emb", neg), CAT]
        g["sd1.plain"] = sd1(items)
        # "a photo of (embedding:tiny_neg:1.2) cat"
        g["sd1.emphasis"] = sd1(items, lambda i: 1.2 if i == 3 else 1.0)
        # "a (photo:1.1) embedding:tiny_a1111.safetensors"
        items2 = [A, PHOTO, ("emb", a1111)]
        g["sd1.a1111"] = sd1(items2, lambda i: 1.1 if i == 1 else 1.0)
        # "a " * 73 .. "embedding:tiny_neg": 73 + 3 > 75, so the embedding starts the
        # second chunk (A1111's tokenize_line) and the first is padded
        c1 = sd1([A] * 73)
        c2 = sd1([("emb", neg)])
        g["sd1.boundary"] = torch.cat([c1, c2], dim=1)
        # "a " * 72 .. "embedding:tiny_neg": exactly 75, one chunk
        g["sd1.fits"] = sd1([A] * 72 + [("emb", neg)])

        # ---- SDXL: CLIP-L penultimate (end-token padding), bigG penultimate (padding 0),
        # no final norm; pooled from bigG's last layer at the end token
        m = G.sdxl_model()
        G.init_recipe(m, 30000)
        cl = m.conditioner.embedders[0].transformer.text_model
        cg = m.conditioner.embedders[1].model

        def sdxl(weight_of=None):
            il = [A, PHOTO, OF, ("emb", xl_l), CAT]
            ig = [A, PHOTO, OF, ("emb", xl_g), CAT]
            ids_l, sub_l = window(il, EOS)
            ids_g, sub_g = window(ig, 0)
            zl = hf_hidden(cl, ids_l, sub_l)[-2]
            hg = oc_hidden(cg, ids_g, sub_g)
            zg = hg[-2]
            if weight_of:
                zl = G.emphasis(zl, weights_of(il, weight_of))
                zg = G.emphasis(zg, weights_of(ig, weight_of))
            return torch.cat([zl, zg], dim=-1), cg.pooled(hg[-1], ids_g)

        # "a photo of embedding:tiny_xl cat"
        g["sdxl.context"], g["sdxl.pooled"] = sdxl()
        # "a photo of (embedding:tiny_xl:1.2) cat"
        g["sdxl.emphasis"], _ = sdxl(lambda i: 1.2 if i == 3 else 1.0)

    save(os.path.join(OUT, "golden.safetensors"), g, {"torch": torch.__version__})
    for f in sorted(os.listdir(OUT)):
        print("  %-24s %7d bytes" % (f, os.path.getsize(os.path.join(OUT, f))))


if __name__ == "__main__":
    main()
