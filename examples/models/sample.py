#!/usr/bin/python3
"""Reference text-to-image sampling with a kiln-shapes (or any SD 1.x-layout)
checkpoint in PyTorch: DDIM (eta 0) with classifier-free guidance, eps- or
v-prediction as the file's kiln.prediction says.

    /usr/bin/python3 examples/models/sample.py [--ckpt F] [--steps 25]
        [--cfg 6] [--seed 0] [--outdir /tmp/samples] "prompt" ["prompt" ...]

Writes one PNG per prompt and prints simple colour statistics (the hue of the
border and of the centre) so a run can be checked without looking.
"""

import argparse
import colorsys
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np                            # noqa: E402
import torch                                  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tokenizer as tk                        # noqa: E402
from sd_modules import load_checkpoint        # noqa: E402


@torch.no_grad()
def generate(model, tok, prompts, steps=25, cfg=6.0, seed=0, size=64):
    """-> float images [B, 3, size, size] in [0, 1]."""
    down = 2 ** (len(model.first_stage_model.encoder.down) - 1)
    b = len(prompts)
    ids = torch.tensor([tok(p) for p in prompts] + [tok("")] * b)
    ctx = model.cond_stage_model(ids)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((b, 4, size // down, size // down), generator=g)
    # the file's schedule buffers (zero terminal SNR for a zsnr model) and its
    # prediction type (kiln.prediction: eps or v)
    ac = model.alphas_cumprod.double()
    v_pred = getattr(model, "meta", {}).get("kiln.prediction", "eps") == "v"
    ts = torch.linspace(999, 0, steps).round().long()
    unet = model.model.diffusion_model
    for i, t in enumerate(ts):
        tt = torch.full((2 * b,), int(t), dtype=torch.long)
        e = unet(torch.cat([x, x]), tt, ctx)
        e_c, e_u = e[:b], e[b:]
        out = e_u + cfg * (e_c - e_u)
        a = ac[t]
        a_prev = ac[ts[i + 1]] if i + 1 < steps else torch.tensor(1.0, dtype=torch.float64)
        if v_pred:   # v = sqrt(a) eps - sqrt(1-a) x0
            x0 = a.sqrt() * x - (1 - a).sqrt() * out
            eps = (1 - a).sqrt() * x + a.sqrt() * out
        else:
            eps = out
            x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
        x = (a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps).float()
    img = model.first_stage_model.decode(x / model.scale_factor)
    return ((img + 1) / 2).clamp(0, 1)


def hue_stats(img):
    """(border hue/sat/val, centre hue/sat/val) of one [3, H, W] image."""
    a = img.permute(1, 2, 0).numpy()
    h = a.shape[0]
    border = np.concatenate([a[:3].reshape(-1, 3), a[-3:].reshape(-1, 3),
                             a[:, :3].reshape(-1, 3), a[:, -3:].reshape(-1, 3)])
    centre = a[h // 2 - 6:h // 2 + 6, h // 2 - 6:h // 2 + 6].reshape(-1, 3)
    return [tuple(round(v, 2) for v in colorsys.rgb_to_hsv(*np.median(p, 0)))
            for p in (border, centre)]


def classify(img):
    """Nearest palette colour of each pixel -> (border colour, colour of the
    largest other region inside the centre 40x40, its pixel share)."""
    import data
    names = list(data.COLORS)
    pal = np.array([data.COLORS[n] for n in names], dtype=np.float32) / 255
    a = img.permute(1, 2, 0).numpy()
    lab = ((a[:, :, None, :] - pal) ** 2).sum(-1).argmin(-1)
    border = np.concatenate([lab[:3].ravel(), lab[-3:].ravel(),
                             lab[:, :3].ravel(), lab[:, -3:].ravel()])
    bg = np.bincount(border, minlength=len(names)).argmax()
    inner = lab[12:52, 12:52].ravel()
    inner = inner[inner != bg]
    if inner.size == 0:
        return names[bg], None, 0.0
    counts = np.bincount(inner, minlength=len(names))
    return names[bg], names[counts.argmax()], counts.max() / 1600


def evaluate(model, tok, n=48, seed=0, steps=20, cfg=6.0):
    """Colour accuracy on n random single-shape captions that name the
    background: fraction of pictures whose border / shape colour is right."""
    import data
    rng = np.random.default_rng(seed)
    ok_bg = ok_fg = 0
    for i in range(n):
        bg, fg = rng.choice(data.COLOR_NAMES, 2, replace=False)
        shape = rng.choice(data.SHAPES)
        prompt = "%s %s %s on %s background" % (
            "an" if fg[0] in "aeiou" else "a", fg, shape,
            "an " + bg if bg[0] in "aeiou" else "a " + bg)
        img = generate(model, tok, [prompt], steps, cfg, seed + i)[0]
        got_bg, got_fg, _ = classify(img)
        ok_bg += got_bg == bg
        ok_fg += got_fg == fg
    return ok_bg / n, ok_fg / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("prompts", nargs="*", default=[
        "a red circle on a blue background",
        "a large yellow star on a black background",
        "a green square above a white triangle on a purple background"])
    ap.add_argument("--ckpt", default=os.path.join(HERE, "kiln-shapes.safetensors"))
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--cfg", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=1, help="images per prompt")
    ap.add_argument("--outdir", default="/tmp/samples")
    ap.add_argument("--eval", type=int, default=0,
                    help="also measure colour accuracy on this many prompts")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = load_checkpoint(args.ckpt)
    tok = tk.Tokenizer(os.path.join(HERE, "vocab.json"),
                       os.path.join(HERE, "merges.txt"))
    os.makedirs(args.outdir, exist_ok=True)
    from PIL import Image
    for j, p in enumerate(args.prompts):
        imgs = generate(model, tok, [p] * args.n, args.steps, args.cfg,
                        args.seed + j)
        row = np.concatenate([(im.permute(1, 2, 0).numpy() * 255).round()
                              .astype(np.uint8) for im in imgs], axis=1)
        path = os.path.join(args.outdir, "%d.png" % j)
        Image.fromarray(row).save(path)
        print(path, repr(p), "border/centre hsv:", hue_stats(imgs[0]),
              "classified:", classify(imgs[0]))
    if args.eval:
        bg, fg = evaluate(model, tok, args.eval, cfg=args.cfg)
        print("colour accuracy on %d prompts: background %.2f, shape %.2f"
              % (args.eval, bg, fg))


if __name__ == "__main__":
    main()
