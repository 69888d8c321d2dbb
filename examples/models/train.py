#!/usr/bin/python3
"""Train kiln-shapes, the tiny SD 1.x-architecture demo model that ships with
kiln, on procedural shape pictures (data.py), on the CPU.

    /usr/bin/python3 examples/models/train.py --out examples/models/kiln-shapes.safetensors
    /usr/bin/python3 examples/models/train.py --quick --out /tmp/quick.safetensors

Settings (a full run takes about 35 minutes on 2 busy CPU cores):
  seed 0 (torch and numpy), torch.set_num_threads(2), deterministic
  images     64x64 RGB in [-1, 1], generated on the fly (data.py)
  tokenizer  CLIP byte-level BPE, 621 tokens (vocab.json/merges.txt, built
             here from data.WORDS), context 77, padded with <|endoftext|>
  VAE        AutoencoderKL ch 32, ch_mult [1,2,2], num_res_blocks 1, no
             attention outside the mid blocks, z_channels 4, embed_dim 4,
             double_z -> latent 4x16x16 (factor 4).
             850 steps: 750 on random 32x32 crops (batch 16), then 100 on
             full 64x64 images (batch 8); AdamW lr 1e-3 (50 warm-up steps,
             cosine to 5%); loss L1 + MSE + 1e-4 * mean KL, posterior
             sampled as in SD; quant_conv's logvar bias starts at -4.
  scale      scale_factor = 1 / std(posterior means of 2048 images)
  CLIP text  width 64, 3 layers, 2 heads, MLP 256, QuickGELU, causal mask,
             77 positions, trained jointly with the UNet from scratch
  UNet       model_channels 32, channel_mult [1,2,3], num_res_blocks 1,
             attention_resolutions [2,4] (8x8, 4x4 and the middle block),
             4 heads, transformer_depth 1, context_dim 64
  diffusion  v-prediction on SD's scaled-linear schedule (1000 steps, betas =
             linspace(sqrt(0.00085), sqrt(0.012))^2) rescaled to zero terminal
             SNR (Lin et al. 2024, Algorithm 1; see MODEL.md for why), MSE on v;
             t: half of each batch uniform in [0, 1000), half uniform in
             [600, 1000) (see train_unet); 10% empty captions for
             classifier-free guidance; 3200 steps, batch 32, AdamW lr 6e-4
             for the UNet and 1e-3 for the text encoder (100 warm-up steps,
             cosine to 5%), weight decay 0.01, grad-clip 1.0, EMA 0.998 (the
             EMA weights are saved); posteriors of 8192 pre-encoded images,
             reused for ~12 epochs (z sampled anew each time). Text encoder
             embeddings start from transformers' CLIP init (N(0, 0.02)).
             Safety cap: the UNet loop stops after 55 minutes in all (logged,
             and recorded in kiln.train.unet_steps)
  --vae-from F  skips the VAE stage and takes first_stage_model.* from F.
  --finetune F  loads every weight and the scale factor from F and trains
             the UNet and text encoder 500 more steps with the file's own
             objective (FINETUNE: lr 2e-4 / 3e-4, 20 warm-up steps; offset
             noise 0.15, which helped the old eps model little).
  The shipped model was made in two runs (CPU time was short):
    1. train.py                              (VAE 850 steps + a UNet, discarded)
    2. train.py --vae-from <1>               (UNet + text, 3200 steps, 27 min)
  Each run keeps the VAE bit-for-bit, and a run is deterministic (seed 0).
  output     one .safetensors, SD 1.x names, f16 weights (schedule buffers
             f32, position_ids int64), hyper-parameters in __metadata__
"""

import argparse
import math
import os
import sys
import time

# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine
# spinning threads fight the other processes and steps get several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np                            # noqa: E402
import torch                                  # noqa: E402
import torch.nn.functional as F               # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import data                                   # noqa: E402
import safetensors_io                         # noqa: E402
import tokenizer as tk                        # noqa: E402
from sd_modules import (AutoencoderKL, CLIPTextConfig, LatentDiffusion,  # noqa: E402
                        UNetConfig, VAEConfig, check_sd_names)

SEED = 0
VAE_CFG = dict(ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, attn_resolutions=(),
               z_channels=4, embed_dim=4, resolution=64)
UNET_CFG = dict(model_channels=32, channel_mult=(1, 2, 3), num_res_blocks=1,
                attention_resolutions=(2, 4), num_heads=4, transformer_depth=1,
                context_dim=64)
CLIP_CFG = dict(width=64, layers=3, heads=2, context_length=77)

FULL = dict(vae_steps=850, vae_crop_steps=750, vae_batch=16, vae_lr=1e-3,
            vae_logvar_init=-4.0, kl_weight=1e-4,
            unet_images=8192, unet_steps=3200, unet_batch=32,
            unet_lr=6e-4, clip_lr=1e-3, warmup=100, ema=0.998, uncond_p=0.1,
            high_t_p=0.5, high_t_from=600, offset_noise=0.0, max_minutes=55,
            prediction="v", zsnr=True)
# --finetune: continue from a checkpoint with offset noise, so that the text,
# not the low-frequency residue of the image left in x_t at t ~ 999, decides
# the background colour (SD's schedule never reaches zero SNR; sampling
# starts from pure noise, whose random mean then picked the background).
FINETUNE = dict(FULL, unet_steps=500, unet_lr=2e-4, clip_lr=3e-4, warmup=20,
                offset_noise=0.15)
QUICK = dict(FULL, vae_steps=20, vae_crop_steps=10, unet_images=256,
             unet_steps=30)


T_START = time.time()


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def cosine_lr(step, total, peak, warmup=0, floor=0.05):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def train_vae(vae, s, rng):
    # start with a small posterior variance: with logvar 0 the sampling noise
    # (std 1) swamps the young latents and the first hundreds of steps learn
    # little; the KL term still pulls logvar up where the decoder allows it
    with torch.no_grad():
        vae.quant_conv.bias[vae.quant_conv.bias.shape[0] // 2:].fill_(
            s["vae_logvar_init"])
    opt = torch.optim.AdamW(vae.parameters(), lr=s["vae_lr"], weight_decay=0.0,
                            foreach=True)
    t0 = time.time()
    for step in range(s["vae_steps"]):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, s["vae_steps"], s["vae_lr"], 50)
        if step < s["vae_crop_steps"]:
            # cheap steps: random 32x32 crops (the VAE is convolutional)
            x, _ = data.batch(rng, s["vae_batch"])
            oy, ox = rng.integers(0, 33, size=2)
            x = torch.from_numpy(x[:, :, oy:oy + 32, ox:ox + 32].copy())
        else:
            # full 64x64 images, so the mid attention sees 16x16 latents
            x, _ = data.batch(rng, s["vae_batch"] // 2)
            x = torch.from_numpy(x)
        mean, logvar = vae.encode_moments(x)
        z = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)
        rec = vae.decode(z)
        l1 = (rec - x).abs().mean()
        l2 = (rec - x).pow(2).mean()
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        loss = l1 + l2 + s["kl_weight"] * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == s["vae_steps"] - 1:
            log("vae %4d  l1 %.4f  mse %.5f  kl %.2f  (%.0fs)"
                % (step, l1.item(), l2.item(), kl.item(), time.time() - t0))


@torch.no_grad()
def encode_dataset(vae, n, rng, bs=128):
    means, stds, caps = [], [], []
    for i in range(0, n, bs):
        x, c = data.batch(rng, min(bs, n - i))
        m, lv = vae.encode_moments(torch.from_numpy(x))
        means.append(m)
        stds.append(torch.exp(0.5 * lv))
        caps += c
    return torch.cat(means), torch.cat(stds), caps


def train_unet(sd, tok, lat_mean, lat_std, caps, s, gen):
    unet = sd.model.diffusion_model
    clip = sd.cond_stage_model
    params = list(unet.parameters()) + list(clip.parameters())
    opt = torch.optim.AdamW(
        [{"params": list(unet.parameters()), "peak": s["unet_lr"]},
         {"params": list(clip.parameters()), "peak": s["clip_lr"]}],
        lr=s["unet_lr"], weight_decay=0.01, foreach=True)
    ema = [p.detach().clone() for p in params]
    ac = sd.alphas_cumprod
    ids_all = torch.tensor([tok(c) for c in caps])
    ids_empty = torch.tensor(tok(""))
    n = lat_mean.shape[0]
    t0 = time.time()
    run_loss = None
    perm, pos = torch.randperm(n, generator=gen), 0
    deadline = T_START + 60 * s["max_minutes"]     # safety cap on busy machines
    done = 0
    for step in range(s["unet_steps"]):
        if time.time() > deadline:
            log("unet: time cap of %d minutes reached at step %d, stopping"
                % (s["max_minutes"], step))
            break
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, s["unet_steps"], g["peak"], s["warmup"])
        if pos + s["unet_batch"] > n:
            perm, pos = torch.randperm(n, generator=gen), 0
        idx = perm[pos:pos + s["unet_batch"]]
        pos += s["unet_batch"]
        b = idx.numel()
        z0 = lat_mean[idx] + lat_std[idx] * torch.randn(lat_mean[idx].shape, generator=gen)
        z0 = z0 * sd.scale_factor
        ids = ids_all[idx].clone()
        drop = torch.rand(b, generator=gen) < s["uncond_p"]
        ids[drop] = ids_empty
        # half the batch uniform in t, half in the noisiest steps, where the
        # picture's colours and layout (the text's job) are decided; with
        # eps-prediction and uniform t those steps give the text little
        # gradient, and the model learns to ignore it
        t = torch.randint(0, 1000, (b,), generator=gen)
        hi = torch.rand(b, generator=gen) < s["high_t_p"]
        t[hi] = torch.randint(s["high_t_from"], 1000, (int(hi.sum()),), generator=gen)
        eps = torch.randn(z0.shape, generator=gen)
        if s["offset_noise"]:
            eps = eps + s["offset_noise"] * torch.randn(
                (b, eps.shape[1], 1, 1), generator=gen)
        a = ac[t].view(b, 1, 1, 1)
        zt = a.sqrt() * z0 + (1 - a).sqrt() * eps
        pred = unet(zt, t, clip(ids))
        if s["prediction"] == "v":            # v = sqrt(a) eps - sqrt(1-a) x0
            target = a.sqrt() * eps - (1 - a).sqrt() * z0
        else:
            target = eps
        loss = F.mse_loss(pred, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        d = min(s["ema"], (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_mul_(ema, d)
            torch._foreach_add_(ema, [p.detach() for p in params], alpha=1 - d)
        done = step + 1
        run_loss = loss.item() if run_loss is None else 0.98 * run_loss + 0.02 * loss.item()
        if step % 50 == 0 or step == s["unet_steps"] - 1:
            log("unet %4d  loss %.4f  avg %.4f  lr %.2e  (%.0fs)"
                % (step, loss.item(), run_loss, opt.param_groups[0]["lr"],
                   time.time() - t0))
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    return run_loss, done


def metadata(sd, s, extra):
    m = {
        "kiln.model": "kiln-shapes",
        "kiln.family": "sd1",
        "kiln.scale_factor": "%.6f" % sd.scale_factor,
        "kiln.prediction": s["prediction"],
        "kiln.image_size": "64",
        "kiln.vae.downsample": "4",
        "kiln.context_length": "77",
        "kiln.heads.unet": str(UNET_CFG["num_heads"]),
        "kiln.heads.clip": str(CLIP_CFG["heads"]),
        "kiln.clip.activation": "quick_gelu",
        "kiln.clip.output": "last_hidden_state+final_layer_norm",
        "kiln.tokenizer": "vocab.json and merges.txt beside this file",
        "kiln.schedule": "scaled_linear 0.00085 0.012 1000"
                         + (" zsnr" if s["zsnr"] else ""),
        "kiln.zsnr": "true" if s["zsnr"] else "false",
        # the guidance scale the pipelines default to for this model: measured with
        # tests/lua/demo_model_test.lua's classifier (v-prediction with zero terminal
        # SNR over-saturates at SD's usual 7: shape colour right 88% at 3, 65% at 9)
        "kiln.cfg": "3",
        "kiln.license": "same as kiln (our own work, trained only on procedural data)",
    }
    m.update(extra)
    return m


def save_checkpoint(sd, path, meta):
    out = {}
    for name, t in sd.state_dict().items():
        if t.dtype == torch.int64:
            out[name] = t                     # position_ids
        elif not name.startswith(("model.", "first_stage_model.",
                                  "cond_stage_model.")):
            out[name] = t.float()             # schedule buffers stay f32
        else:
            out[name] = t.half()
    safetensors_io.save(path, out, meta)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "kiln-shapes.safetensors"))
    ap.add_argument("--quick", action="store_true", help="1-minute smoke run")
    ap.add_argument("--tokenizer-dir", default=HERE)
    ap.add_argument("--finetune", metavar="F",
                    help="load all weights and scale_factor from F, skip the "
                    "VAE, train the UNet and text encoder with FINETUNE")
    ap.add_argument("--vae-from", help="take the VAE from this checkpoint "
                    "instead of training it (the data stream then differs)")
    ap.add_argument("--offset-noise", type=float, default=None,
                    help="offset noise for the whole UNet run (default: the "
                    "settings' value); see FINETUNE for why")
    ap.add_argument("--unet-steps", type=int, default=None)
    ap.add_argument("--max-minutes", type=float, default=None)
    args = ap.parse_args()
    s = QUICK if args.quick else FULL
    if args.finetune:
        s = (dict(FINETUNE, unet_steps=30, unet_images=256) if args.quick
             else FINETUNE)
        args.vae_from = args.finetune
    if args.finetune:                         # the model's own objective
        _, fmeta = safetensors_io.load(args.finetune)
        s = dict(s, prediction=fmeta.get("kiln.prediction", "eps"),
                 zsnr=fmeta.get("kiln.zsnr", "false") == "true")
    for key in ("offset_noise", "unet_steps", "max_minutes"):
        if getattr(args, key) is not None:
            s = dict(s, **{key: getattr(args, key)})
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    gen = torch.Generator().manual_seed(SEED)
    t_start = time.time()

    vocab = os.path.join(args.tokenizer_dir, "vocab.json")
    merges = os.path.join(args.tokenizer_dir, "merges.txt")
    nvocab = tk.build_vocab(data.WORDS, vocab, merges)
    tok = tk.Tokenizer(vocab, merges)
    log("tokenizer: %d tokens -> %s" % (nvocab, vocab))

    sd = LatentDiffusion(UNetConfig(**UNET_CFG), VAEConfig(**VAE_CFG),
                         CLIPTextConfig(vocab_size=nvocab, **CLIP_CFG),
                         zsnr=s["zsnr"])
    # transformers' CLIP init for the embeddings (std 0.02, not nn.Embedding's
    # N(0, 1), which the optimizer can hardly move in a short run)
    emb = sd.cond_stage_model.transformer.text_model.embeddings
    with torch.no_grad():
        emb.token_embedding.weight.normal_(0.0, 0.02)
        emb.position_embedding.weight.normal_(0.0, 0.02)
    counts = {k: sum(p.numel() for p in m.parameters()) for k, m in
              (("unet", sd.model), ("vae", sd.first_stage_model),
               ("clip", sd.cond_stage_model))}
    log("params", counts, "total", sum(counts.values()))

    vae = sd.first_stage_model
    if args.vae_from:
        ref, _ = safetensors_io.load(args.vae_from)
        vae.load_state_dict({k[len("first_stage_model."):]: v.float()
                             for k, v in ref.items()
                             if k.startswith("first_stage_model.")})
        log("VAE taken from %s (not trained)" % args.vae_from)
    else:
        train_vae(vae, s, rng)
    t_vae = time.time() - t_start
    if args.finetune:
        ref, ref_meta = safetensors_io.load(args.finetune)
        for name, mod in (("model.", sd.model),
                          ("cond_stage_model.", sd.cond_stage_model)):
            mod.load_state_dict({k[len(name):]: v.to(torch.float32)
                                 if v.is_floating_point() else v
                                 for k, v in ref.items() if k.startswith(name)})
        log("fine-tuning UNet and text encoder from %s" % args.finetune)
    vae.eval()
    for p in vae.parameters():
        p.requires_grad_(False)

    log("encoding %d images" % s["unet_images"])
    lat_mean, lat_std, caps = encode_dataset(vae, s["unet_images"], rng)
    n_sf = min(2048, lat_mean.shape[0])
    sd.scale_factor = float(1.0 / lat_mean[:n_sf].std())
    if args.finetune:                         # keep the model's own scale
        sd.scale_factor = float(ref_meta["kiln.scale_factor"])
    log("latent mean %.3f std %.3f, posterior std mean %.4f -> scale_factor %.5f"
        % (lat_mean.mean(), lat_mean.std(), lat_std.mean(), sd.scale_factor))

    final_loss, unet_steps = train_unet(sd, tok, lat_mean, lat_std, caps, s, gen)
    total = time.time() - t_start
    log("done: vae %.0fs, total %.0fs" % (t_vae, total))

    # VAE reconstruction error on fresh images, for the model card
    with torch.no_grad():
        x, _ = data.batch(np.random.default_rng(12345), 64)
        x = torch.from_numpy(x)
        rec = vae.decode(vae.encode_moments(x)[0]).clamp(-1, 1)
        rec_l1 = ((rec - x).abs().mean() / 2).item()      # in [0,1] units
    log("vae reconstruction L1 on 64 fresh images: %.4f (0..1 scale)" % rec_l1)

    meta = metadata(sd, s, {
        "kiln.train.seconds": "%.0f" % total,
        "kiln.train.vae_steps": str(s["vae_steps"]) + (
            " (VAE from %s)" % os.path.basename(args.vae_from)
            if args.vae_from else ""),
        "kiln.train.unet_steps": str(unet_steps) + (
            " (fine-tune of %s, offset noise %g)" % (
                os.path.basename(args.finetune), s["offset_noise"])
            if args.finetune else ""),
        "kiln.train.final_loss": "%.4f" % final_loss,
        "kiln.train.vae_rec_l1": "%.4f" % rec_l1,
    })
    out = save_checkpoint(sd, args.out, meta)
    shapes = {k: list(v.shape) for k, v in out.items()}
    extra, missing = check_sd_names(
        shapes, "/work/shared/sd-keys/sd15.txt"
        if os.path.exists("/work/shared/sd-keys/sd15.txt")
        else os.path.join(HERE, "../../../shared/sd-keys/sd15.txt"))
    log("names not in sd15.txt patterns: %d %s" % (len(extra), extra[:5]))
    log("sd15 patterns not used by this small config: %d" % len(missing))
    log("wrote %s (%d tensors, %.2f MB)" % (args.out, len(out),
                                           os.path.getsize(args.out) / 1e6))


if __name__ == "__main__":
    main()
