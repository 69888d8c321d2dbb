#!/usr/bin/python3
"""Golden LoRA files for the adapter tests: small LoRA / LyCORIS / PEFT files for
the tiny SD 1.x, 2.x and SDXL checkpoints of tests/golden/gen_sd_golden.py, and
the weights those files produce when merged, computed here by an implementation
of each format's published arithmetic written for this purpose (not kiln's).

Run from the repository root:  /usr/bin/python3 tests/golden/gen_lora.py
(Debian's python3-torch and python3-numpy; CPU; a few seconds.)

What it writes, under tests/golden/lora/:
- <name>.safetensors: a LoRA file whose key names are the ones the real tools
  write for that family: kohya sd-scripts (lora_unet_* with diffusers module
  names on SD 1.x / 2.x and original ldm names on SDXL; lora_te_*, lora_te1_*,
  lora_te2_* with transformers' CLIP names; alpha as an f16 scalar), LyCORIS
  (LoCon with lora_mid, LoHa hada_* with and without hada_t1/t2, LoKr lokr_*
  in its full / factored / Tucker forms, full differences diff / diff_b, DoRA
  dora_scale), diffusers PEFT (unet.*, text_encoder.*, text_encoder_2.* with
  lora_A / lora_B), older diffusers (processor.to_q_lora.down, .lora.down) and
  ComfyUI's own saves (diffusion_model.*, text_encoders.clip_l.* / clip_g.*).
  Factors are seeded torch.randn, stored as f16, bf16 or f32 as the tools do.
- <name>.expected.safetensors (and <name>.s<strength>.expected.safetensors): the
  merged checkpoint tensors (only those the file changes; f32; keyed by the
  checkpoint's tensor name) at the strengths the manifest lists. The merge is
  ComfyUI's weight_adapter arithmetic: W + strength * scale * delta with
  scale = alpha / rank (LoRA, LoCon, LoHa: rank = rows of the down / w1_b factor;
  LoKr: rows of w2_b, else of w1_b, else 1; no alpha: 1), and for DoRA
  W + strength * (dora_scale * (W + scale * delta) / ||W + scale * delta||_col - W)
  with the norm over every dimension but the input one (dora_scale [1, in, ...]).
  The base W is rebuilt from tests/golden/sd/<ckpt>.recipe exactly as the Lua
  tests rebuild it (torch.manual_seed(seed); torch.randn(shape) * std + mean).
  The second strength (0.7) stores one or two of the tensors (the manifest's
  case lists them); the two naming-only files (sd1_attnprocs, sd1_unmatched)
  have strength 1.0 alone.
- stack.expected.safetensors: two files applied together (the manifest's
  "stacks"), for the tensors both change.
- sd1_kohya.forward.safetensors: the tiny SD 1.x UNet's output ("unet.out") for
  gen_sd_golden's (x, t, context) and the CLIP text encoder's final-norm output
  ("clip.last") for its two token windows, run by PyTorch with sd1_kohya merged
  at strength 1.0 (both parts).
- manifest.json: for every file its checkpoint, layout, family, key counts, the
  modules (LoRA key -> checkpoint tensor, rows of a fused OpenCLIP in_proj as
  [first (1-based), count]), the number of checkpoint tensors it changes
  ("patched"), the keys that match nothing ("unmatched"), and the cases
  (strengths -> expected file).
Checks before it finishes: every expected file is read back and compared with
a merge done by plain Python loops over the factors read back from the LoRA
file; every plain LoRA / LoCon module is also run unmerged (down, mid, up as the
trainers' linears / convs) against its layer run with the merged weight; the
forward golden's base network must reproduce tests/golden/sd/sd1.safetensors.
The output is the same on every run (seeded).
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch

torch.set_num_threads(2)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_sd_golden as G  # noqa: E402  (reference modules and diffusers names)

OUT = os.path.join(HERE, "lora")
SD = os.path.join(HERE, "sd")
DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
ST_DT = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


# ------------------------------------------------------------- safetensors

def st_bytes(t, dt):
    t = t.detach().to(DT[dt]).contiguous()
    if dt == "bf16":
        return t.view(torch.int16).numpy().astype("<i2").tobytes()
    return t.numpy().astype("<f4" if dt == "f32" else "<f2").tobytes()


def st_write(path, tensors, meta=None):
    """tensors: {name: (torch tensor, dtype name)}; header sorted by name as
    safetensors.torch.save_file writes it."""
    header, blobs, off = {}, [], 0
    for k in sorted(tensors):
        t, dt = tensors[k]
        b = st_bytes(t, dt)
        header[k] = {"dtype": ST_DT[dt], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = dict(meta or {}, format="pt")
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def st_read(path):
    """-> {name: float64 numpy array}, metadata (an independent reader)."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for k, v in header.items():
        a, b = v["data_offsets"]
        raw = data[8 + n + a:8 + n + b]
        if v["dtype"] == "F32":
            x = np.frombuffer(raw, "<f4").astype(np.float64)
        elif v["dtype"] == "F16":
            x = np.frombuffer(raw, "<f2").astype(np.float64)
        elif v["dtype"] == "BF16":
            x = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        else:
            raise ValueError(v["dtype"])
        out[k] = x.reshape(v["shape"])
    return out, meta


# ------------------------------------------------------------- checkpoints

class Ckpt:
    """A tiny checkpoint's recipe: base tensors on demand, and name maps."""

    def __init__(self, name):
        self.name = name
        self.recipe = {}
        with open(os.path.join(SD, name + ".recipe")) as f:
            for line in f:
                if line[0] in "#@":
                    continue
                n, dt, shape, seed, std, mean = line.rstrip("\n").split("\t")
                self.recipe[n] = (dt, json.loads(shape), int(seed), float(std), float(mean))
        self.cache = {}

    def shape(self, n):
        return self.recipe[n][1]

    def base(self, n):
        """f32 torch tensor, as tests/lua/tiny_sd.lua builds it."""
        if n not in self.cache:
            dt, shape, seed, std, mean = self.recipe[n]
            assert dt == "f32" and shape, n
            torch.manual_seed(seed)
            self.cache[n] = torch.randn(shape) * std + mean
        return self.cache[n]


def unet_diffusers_names(model):
    """ldm name -> diffusers name for the UNet, from gen_sd_golden's walk."""
    shim = G.Root()
    shim.model = model.model
    shim.first_stage_model = model.first_stage_model
    shim.cond_stage_model = G.Root()
    shim.cond_stage_model.transformer = torch.nn.Module()
    return {k: v for k, v in G.diffusers_names(shim).items() if k.startswith("model.diffusion_model.")}


CKPT = {}
DIFFUSERS = {}


def setup():
    for name, build in (("sd1", G.sd1_model), ("sd2", G.sd2_model), ("sdxl", G.sdxl_model)):
        CKPT[name] = Ckpt(name)
        m = build()
        names = unet_diffusers_names(m)
        for k in names:
            assert k in CKPT[name].recipe, k
        DIFFUSERS[name] = names


# Where each family keeps its text encoders, and the OpenCLIP layout of HF names.
TE = {
    ("sd1", "te"): ("hf", "cond_stage_model.transformer.text_model.encoder.layers.%d."),
    ("sd2", "te"): ("oc", "cond_stage_model.model.transformer.resblocks.%d."),
    ("sdxl", "te1"): ("hf", "conditioner.embedders.0.transformer.text_model.encoder.layers.%d."),
    ("sdxl", "te2"): ("oc", "conditioner.embedders.1.model.transformer.resblocks.%d."),
}
OC = {"self_attn.q_proj": ("attn.in_proj", 0), "self_attn.k_proj": ("attn.in_proj", 1),
      "self_attn.v_proj": ("attn.in_proj", 2), "self_attn.out_proj": ("attn.out_proj", None),
      "mlp.fc1": ("mlp.c_fc", None), "mlp.fc2": ("mlp.c_proj", None)}
WIDTH = 64   # every tiny text encoder's width


def te_target(fam, enc, layer, sub, bias=False):
    """HF sub-module (e.g. 'self_attn.q_proj') -> (checkpoint tensor, rows0 or None)."""
    kind, prefix = TE[(fam, enc)]
    pre = prefix % layer
    suffix = "bias" if bias else "weight"
    if kind == "hf":
        return pre + sub + "." + suffix, None
    mod, which = OC[sub]
    if which is None:
        return pre + mod + "." + suffix, None
    return pre + mod + "_" + suffix, (which * WIDTH, WIDTH)


def unet_target(sub):
    return "model.diffusion_model." + sub + ".weight"


# --------------------------------------------------------------- key names

def kohya_unet(fam, sub):
    """kohya / LyCORIS UNet module key: diffusers names on SD 1.x / 2.x (sd-scripts
    trains diffusers' UNet there), original names on SDXL (sdxl_original_unet)."""
    t = unet_target(sub)
    if fam == "sdxl":
        return "lora_unet_" + sub.replace(".", "_")
    return "lora_unet_" + DIFFUSERS[fam][t][:-len(".weight")].replace(".", "_")


def kohya_te(enc, layer, sub):
    return "lora_%s_text_model_encoder_layers_%d_%s" % (enc, layer, sub.replace(".", "_"))


def diffusers_unet(fam, sub):
    return "unet." + DIFFUSERS[fam][unet_target(sub)][:-len(".weight")]


def diffusers_te(enc, layer, sub):
    pre = {"te": "text_encoder", "te1": "text_encoder", "te2": "text_encoder_2"}[enc]
    return "%s.text_model.encoder.layers.%d.%s" % (pre, layer, sub)


def comfy_unet(sub):
    return "diffusion_model." + sub


def comfy_te(clip, rest):
    """ComfyUI keeps every CLIP in transformers' layout under clip_l / clip_g / clip_h."""
    return "text_encoders.%s.transformer.text_model.%s" % (clip, rest)


# File key suffixes of each factor, per writer.
SUFFIX = {
    "kohya": {"up": ".lora_up.weight", "down": ".lora_down.weight", "mid": ".lora_mid.weight"},
    "peft": {"up": ".lora_B.weight", "down": ".lora_A.weight"},
    "procs": {"up": "_lora.up.weight", "down": "_lora.down.weight"},
    "dot": {"up": ".lora.up.weight", "down": ".lora.down.weight"},
}
LYCO = {"w1a": ".hada_w1_a", "w1b": ".hada_w1_b", "w2a": ".hada_w2_a", "w2b": ".hada_w2_b",
        "t1": ".hada_t1", "t2": ".hada_t2"}
LOKR = {"w1": ".lokr_w1", "w2": ".lokr_w2", "w1a": ".lokr_w1_a", "w1b": ".lokr_w1_b",
        "w2a": ".lokr_w2_a", "w2b": ".lokr_w2_b", "t2": ".lokr_t2"}


# ------------------------------------------------------------------ modules

class Mod:
    """One module of a LoRA file: its factors (stored dtype), where it lands."""

    def __init__(self, key, part, kind, target, rows=None, style="kohya", alpha=None,
                 bias_target=None, bias_rows=None):
        self.key, self.part, self.kind = key, part, kind
        self.target, self.rows, self.style = target, rows, style
        self.alpha = alpha
        self.bias_target, self.bias_rows = bias_target, bias_rows
        self.f = {}          # canonical factor name -> torch tensor (values as stored)
        self.dora = None     # dora_scale tensor
        self.dtype = "f32"
        self.unmatched = False

    def file_keys(self):
        out = {}
        k = self.key
        if self.kind == "lora":
            for n, t in self.f.items():
                out[k + SUFFIX[self.style][n]] = t
        elif self.kind == "loha":
            for n, t in self.f.items():
                out[k + LYCO[n]] = t
        elif self.kind == "lokr":
            for n, t in self.f.items():
                out[k + LOKR[n]] = t
        elif self.kind == "diff":
            if "diff" in self.f:
                out[k + ".diff"] = self.f["diff"]
        if "diff_b" in self.f:
            out[k + ".diff_b"] = self.f["diff_b"]
        res = {n: (t, self.dtype) for n, t in out.items()}
        if self.alpha is not None:
            res[k + ".alpha"] = (torch.tensor(float(self.alpha)), "f16" if self.style == "kohya" else "f32")
        if self.dora is not None:
            res[k + ".dora_scale"] = (self.dora, self.dtype)
        return res

    def targets(self):
        """[(checkpoint tensor, rows or None, is_bias)] in the order they change."""
        t = []
        if self.unmatched:
            return t
        if self.kind != "diff" or "diff" in self.f:
            t.append((self.target, self.rows, False))
        if "diff_b" in self.f:
            t.append((self.bias_target, self.bias_rows, True))
        return t


def rounded(t, dt):
    return t.to(DT[dt]).to(torch.float32)


def scale_of(m):
    """ComfyUI's alpha / rank for each kind (1 without alpha)."""
    f = m.f
    if m.alpha is None:
        return 1.0
    if m.kind == "lora":
        return m.alpha / f["down"].shape[0]
    if m.kind == "loha":
        return m.alpha / f["w1b"].shape[0]
    if m.kind == "lokr":
        if "w2b" in f:
            return m.alpha / f["w2b"].shape[0]
        if "w1b" in f:
            return m.alpha / f["w1b"].shape[0]
        return 1.0
    return 1.0


def delta_torch(m, shape):
    """The unscaled weight delta (float64, in the target's / slice's shape)."""
    f = {k: v.double() for k, v in m.f.items()}
    if m.kind == "lora":
        up, down = f["up"], f["down"]
        if "mid" in f:
            # LoCon CP: W[o,i,h,w] = sum_a,b up[o,a] mid[a,b,h,w] down[b,i]
            d = torch.einsum("oa,abhw,bi->oihw", up.flatten(1), f["mid"], down.flatten(1))
        else:
            d = up.flatten(1) @ down.flatten(1)
    elif m.kind == "loha":
        if "t1" in f:
            m1 = torch.einsum("ijhw,jr,ip->prhw", f["t1"], f["w1b"], f["w1a"])
            m2 = torch.einsum("ijhw,jr,ip->prhw", f["t2"], f["w2b"], f["w2a"])
        else:
            m1 = f["w1a"] @ f["w1b"]
            m2 = f["w2a"] @ f["w2b"]
        d = m1 * m2
    elif m.kind == "lokr":
        w1 = f["w1"] if "w1" in f else f["w1a"] @ f["w1b"]
        if "w2" in f:
            w2 = f["w2"]
        elif "t2" in f:
            w2 = torch.einsum("ijhw,jr,ip->prhw", f["t2"], f["w2b"], f["w2a"])
        else:
            w2 = f["w2a"] @ f["w2b"]
        while w1.dim() < w2.dim():
            w1 = w1.unsqueeze(-1)
        d = torch.kron(w1.contiguous(), w2.contiguous())
    elif m.kind == "diff":
        d = f["diff"]
    return d.reshape(shape)


def col_norm(w):
    """ComfyUI's DoRA norm: over every dimension but dim 1, kept as [1, in, 1...]."""
    n = w.transpose(0, 1).reshape(w.shape[1], -1).norm(dim=1, keepdim=True)
    return n.reshape(w.shape[1], *[1] * (w.dim() - 1)).transpose(0, 1)


def merge_torch(ckpt, mods_strengths):
    """[(Mod, strength)] in order -> {tensor: float64 merged}."""
    out = {}
    for m, s in mods_strengths:
        for tname, rows, is_bias in m.targets():
            w = out.get(tname)
            if w is None:
                w = ckpt.base(tname).double().clone()
            view = w[rows[0]:rows[0] + rows[1]] if rows else w
            if is_bias:
                view += s * m.f["diff_b"].double().reshape(view.shape)
            else:
                d = delta_torch(m, view.shape)
                sc = scale_of(m)
                if m.dora is not None:
                    assert rows is None
                    calc = view + sc * d
                    calc = calc * (m.dora.double() / col_norm(calc))
                    view += s * (calc - view)
                else:
                    view += s * sc * d
            out[tname] = w
    return out


# ------------------------------------------------------ plain-loop re-check

def mat(t):
    """torch tensor -> nested Python lists of floats, 2-D (rows, flattened rest)."""
    t = t.double()
    return t.reshape(t.shape[0], -1).tolist() if t.dim() > 1 else [[x] for x in t.tolist()]


def loop_delta(m, nrows, ncols):
    """The same delta as delta_torch, by explicit sums, as [nrows][ncols] floats
    (ncols: the target's flattened input size, kernel included)."""
    f = m.f
    if m.kind == "diff":
        flat = f["diff"].double().reshape(-1).tolist()
        return [[flat[o * ncols + c] for c in range(ncols)] for o in range(nrows)]
    if m.kind == "lora":
        up = mat(f["up"])
        r = len(up[0])
        if "mid" in f:
            down = mat(f["down"])                      # [r][in]
            mid = f["mid"].double()                    # [r, r, kh, kw]
            kh, kw = mid.shape[2], mid.shape[3]
            mid = mid.tolist()
            nin = len(down[0])
            eff = [[0.0] * (nin * kh * kw) for _ in range(r)]
            for a in range(r):
                for i in range(nin):
                    for h in range(kh):
                        for w in range(kw):
                            eff[a][(i * kh + h) * kw + w] = sum(mid[a][b][h][w] * down[b][i] for b in range(r))
            down = eff
        else:
            down = mat(f["down"])
        return [[sum(up[o][a] * down[a][c] for a in range(r)) for c in range(ncols)] for o in range(nrows)]
    if m.kind == "loha":
        def rebuild(wa, wb, t):
            if t is None:
                A, B = mat(wa), mat(wb)
                r = len(B)
                return [[sum(A[o][a] * B[a][c] for a in range(r)) for c in range(ncols)] for o in range(nrows)]
            A, B = wa.double().tolist(), wb.double().tolist()      # [r][out], [r][in]
            T = t.double()
            kh, kw = T.shape[2], T.shape[3]
            T = T.tolist()
            r = len(A)
            res = [[0.0] * ncols for _ in range(nrows)]
            for p in range(nrows):
                for q in range(ncols // (kh * kw)):
                    for h in range(kh):
                        for w in range(kw):
                            res[p][(q * kh + h) * kw + w] = sum(
                                T[i][j][h][w] * B[j][q] * A[i][p] for i in range(r) for j in range(r))
            return res
        m1 = rebuild(f["w1a"], f["w1b"], f.get("t1"))
        m2 = rebuild(f["w2a"], f["w2b"], f.get("t2"))
        return [[m1[o][c] * m2[o][c] for c in range(ncols)] for o in range(nrows)]
    if m.kind == "lokr":
        if "w1" in f:
            w1 = mat(f["w1"])
        else:
            A, B = mat(f["w1a"]), mat(f["w1b"])
            w1 = [[sum(A[i][k] * B[k][j] for k in range(len(B))) for j in range(len(B[0]))] for i in range(len(A))]
        if "w2" in f:
            w2 = mat(f["w2"])
        elif "t2" in f:
            A, B = f["w2a"].double().tolist(), f["w2b"].double().tolist()   # [r][c], [r][d]
            T = f["t2"].double()
            kh, kw = T.shape[2], T.shape[3]
            T = T.tolist()
            r, c, d = len(A), len(A[0]), len(B[0])
            w2 = [[0.0] * (d * kh * kw) for _ in range(c)]
            for p in range(c):
                for q in range(d):
                    for h in range(kh):
                        for w in range(kw):
                            w2[p][(q * kh + h) * kw + w] = sum(
                                T[i][j][h][w] * B[j][q] * A[i][p] for i in range(r) for j in range(r))
        else:
            A, B = mat(f["w2a"]), mat(f["w2b"])
            w2 = [[sum(A[i][k] * B[k][j] for k in range(len(B))) for j in range(len(B[0]))] for i in range(len(A))]
        c, dk = len(w2), len(w2[0])
        # Kronecker product, with w1's columns spread over w2's flattened inputs
        return [[w1[o // c][q // dk] * w2[o % c][q % dk] for q in range(ncols)] for o in range(nrows)]
    raise ValueError(m.kind)


def loop_merge(ckpt, mods_strengths):
    out = {}
    for m, s in mods_strengths:
        for tname, rows, is_bias in m.targets():
            base = out.get(tname)
            if base is None:
                base = mat(ckpt.base(tname))
            shape = ckpt.shape(tname)
            r0, nr = rows if rows else (0, shape[0])
            ncols = len(base[0])
            if is_bias:
                db = m.f["diff_b"].double().reshape(-1).tolist()
                for i in range(nr):
                    base[r0 + i][0] += s * db[i]
            else:
                d = loop_delta(m, nr, ncols)
                sc = scale_of(m)
                if m.dora is not None:
                    ds = m.dora.double().reshape(-1).tolist()        # one per input channel
                    nin = shape[1]
                    k = ncols // nin
                    calc = [[base[o][c] + sc * d[o][c] for c in range(ncols)] for o in range(nr)]
                    norms = [math.sqrt(sum(calc[o][i * k + j] ** 2 for o in range(nr) for j in range(k)))
                             for i in range(nin)]
                    for o in range(nr):
                        for c in range(ncols):
                            v = calc[o][c] * ds[c // k] / norms[c // k]
                            base[o][c] += s * (v - base[o][c])
                else:
                    for o in range(nr):
                        for c in range(ncols):
                            base[r0 + o][c] += s * sc * d[o][c]
            out[tname] = base
    return out


# ------------------------------------------------------------- factories

RATIO = 0.35   # delta rms / base rms at strength 1: large enough to see, small enough to be a LoRA


def _randn(shape, g):
    return torch.randn(shape, generator=g)


def finish(ckpt, m, seed, dtype, dora=False):
    """Scales the random factors so the delta is RATIO of the base weight, rounds
    them to the stored dtype, and adds dora_scale when asked."""
    m.dtype = dtype
    tname, rows = m.target, m.rows
    if m.kind != "diff" or "diff" in m.f:
        w = ckpt.base(tname).double()
        if rows:
            w = w[rows[0]:rows[0] + rows[1]]
        names = [n for n in m.f if n != "diff_b"]
        d = delta_torch(m, w.shape) * scale_of(m)
        rms = lambda x: float(x.pow(2).mean().sqrt())
        g = (RATIO * rms(w) / rms(d)) ** (1.0 / len(names))
        for n in names:
            m.f[n] = rounded(m.f[n] * g, dtype)
        if dora:
            gen = torch.Generator().manual_seed(seed + 7)
            m.dora = rounded(col_norm(w).float() * (1 + 0.15 * _randn(col_norm(w).shape, gen)), dtype)
    if "diff_b" in m.f:
        m.f["diff_b"] = rounded(m.f["diff_b"], dtype)
    return m


def lora(ckpt, key, part, target, rank, alpha=None, rows=None, style="kohya", mid=False,
         fshape=None, dtype="f32", seed=0, dora=False):
    """A LoRA / LoCon module. fshape 'conv' / 'linear' forces 4-D / 2-D factors
    whatever the target (the reshape cases)."""
    shape = ckpt.shape(target)
    out = rows[1] if rows else shape[0]
    nin = shape[1]
    k = shape[2:] if len(shape) == 4 else []
    g = torch.Generator().manual_seed(seed)
    m = Mod(key, part, "lora", target, rows, style, alpha)
    conv = (len(shape) == 4 and fshape != "linear") or fshape == "conv"
    if mid:
        m.f["down"] = _randn([rank, nin, 1, 1], g)
        m.f["mid"] = _randn([rank, rank] + list(k), g)
        m.f["up"] = _randn([out, rank, 1, 1], g)
    elif conv:
        m.f["down"] = _randn([rank, nin] + (list(k) or [1, 1]), g)
        m.f["up"] = _randn([out, rank, 1, 1], g)
    else:
        m.f["down"] = _randn([rank, nin * int(np.prod(k or [1]))], g)
        m.f["up"] = _randn([out, rank], g)
    return finish(ckpt, m, seed, dtype, dora)


def loha(ckpt, key, part, target, rank, alpha, rows=None, tucker=False, dtype="f16", seed=0, dora=False):
    shape = ckpt.shape(target)
    out = rows[1] if rows else shape[0]
    nin = shape[1]
    g = torch.Generator().manual_seed(seed)
    m = Mod(key, part, "loha", target, rows, "kohya", alpha)
    if tucker:
        kh, kw = shape[2], shape[3]
        for i in "12":
            m.f["w%sa" % i] = _randn([rank, out], g)
            m.f["w%sb" % i] = _randn([rank, nin], g)
            m.f["t%s" % i] = _randn([rank, rank, kh, kw], g)
    else:
        flat = int(np.prod(shape[1:]))
        for i in "12":
            m.f["w%sa" % i] = _randn([out, rank], g)
            m.f["w%sb" % i] = _randn([rank, flat], g)
    return finish(ckpt, m, seed, dtype, dora)


def lokr(ckpt, key, part, target, w1, w2, alpha=None, rank=None, rows=None, tucker=False,
         dtype="bf16", seed=0):
    """w1 = (a, b) [out = a * c, in = b * d]; w2 = (c, d). rank splits w1 and/or w2:
    rank = {'w1': r} and/or {'w2': r}."""
    shape = ckpt.shape(target)
    k = list(shape[2:])
    kk = int(np.prod(k or [1]))
    (a, b), (c, d) = w1, w2
    assert a * c == (rows[1] if rows else shape[0]) and b * d == shape[1]
    rank = rank or {}
    g = torch.Generator().manual_seed(seed)
    m = Mod(key, part, "lokr", target, rows, "kohya", alpha)
    if "w1" in rank:
        m.f["w1a"] = _randn([a, rank["w1"]], g)
        m.f["w1b"] = _randn([rank["w1"], b], g)
    else:
        m.f["w1"] = _randn([a, b], g)
    if "w2" in rank:
        r = rank["w2"]
        if tucker:
            m.f["w2a"] = _randn([r, c], g)
            m.f["w2b"] = _randn([r, d], g)
            m.f["t2"] = _randn([r, r] + k, g)
        else:
            m.f["w2a"] = _randn([c, r], g)
            m.f["w2b"] = _randn([r, d * kk], g)
    else:
        m.f["w2"] = _randn([c, d] + k, g)
    return finish(ckpt, m, seed, dtype)


def diff(ckpt, key, part, target, rows=None, bias=None, bias_rows=None, weight=True,
         dtype="f32", seed=0):
    g = torch.Generator().manual_seed(seed)
    m = Mod(key, part, "diff", target, rows, "kohya", None, bias, bias_rows)
    if weight:
        shape = ckpt.shape(target)
        if rows:
            shape = [rows[1]] + shape[1:]
        m.f["diff"] = _randn(shape, g)
    if bias:
        n = bias_rows[1] if bias_rows else ckpt.shape(bias)[0]
        base = ckpt.base(bias)
        m.f["diff_b"] = _randn([n], g) * RATIO * float(base.pow(2).mean().sqrt())
    return finish(ckpt, m, seed, dtype)


def with_bias_diff(ckpt, m, bias, bias_rows=None, seed=0):
    """Adds a diff_b (the bias difference LyCORIS / ComfyUI save beside a module)."""
    g = torch.Generator().manual_seed(seed + 99)
    n = bias_rows[1] if bias_rows else ckpt.shape(bias)[0]
    m.bias_target, m.bias_rows = bias, bias_rows
    m.f["diff_b"] = rounded(_randn([n], g) * RATIO * float(ckpt.base(bias).pow(2).mean().sqrt()), m.dtype)
    return m


def unmatched(key, shapes, dtype="f16", seed=0):
    """A kohya module naming a block the tiny checkpoint does not have."""
    g = torch.Generator().manual_seed(seed)
    m = Mod(key, "unet" if key.startswith("lora_unet_") else "clip", "lora", None, alpha=1.0)
    m.f["down"] = rounded(_randn(shapes[0], g) * 0.1, dtype)
    m.f["up"] = rounded(_randn(shapes[1], g) * 0.1, dtype)
    m.dtype = dtype
    m.unmatched = True
    return m


# ------------------------------------------------------------------ the files

KOHYA_META = {"sd1": "sd_v1", "sd2": "sd_v2", "sdxl": "sdxl_base_v1-0"}


def kohya_meta(fam, dim, alpha, module="networks.lora", args=None):
    m = {"ss_network_module": module, "ss_network_dim": str(dim), "ss_network_alpha": str(alpha),
         "ss_base_model_version": KOHYA_META[fam]}
    if args:
        m["ss_network_args"] = json.dumps(args)
    return m


def files():
    """-> list of file specs: name, ckpt, family, layout, mods, meta, second (the
    tensors kept at the second strength; None: all)."""
    F = []
    U = unet_target

    # ---------------------------------------------------------------- SD 1.x
    c = CKPT["sd1"]
    A1 = "input_blocks.3.1.transformer_blocks.0."
    ku = lambda sub: kohya_unet("sd1", sub)
    te = lambda l, sub: te_target("sd1", "te", l, sub)

    def kte(l, sub, **kw):
        t, rows = te(l, sub)
        return lora(c, kohya_te("te", l, sub), "clip", t, rows=rows, **kw)

    mods = [
        lora(c, ku(A1 + "attn1.to_q"), "unet", U(A1 + "attn1.to_q"), 4, 2.0, dtype="f16", seed=101),
        lora(c, ku("input_blocks.3.1.proj_in"), "unet", U("input_blocks.3.1.proj_in"), 4, 1.0, dtype="f16", seed=103),
        kte(0, "self_attn.q_proj", rank=4, alpha=2.0, dtype="f16", seed=105),
        kte(0, "self_attn.out_proj", rank=4, alpha=2.0, dtype="f16", seed=108),
        kte(1, "mlp.fc1", rank=4, alpha=8.0, dtype="f16", seed=109),
    ]
    F.append(dict(name="sd1_kohya", ckpt="sd1", layout="kohya", mods=mods,
                  meta=kohya_meta("sd1", 4, 2.0),
                  second=[te(0, "self_attn.q_proj")[0]], forward=True))

    mods = [
        lora(c, ku("input_blocks.0.0"), "unet", U("input_blocks.0.0"), 2, 1.0, mid=True, seed=201),
        lora(c, ku("out.2"), "unet", U("out.2"), 3, 2.0, seed=202),
        lora(c, ku("input_blocks.3.0.skip_connection"), "unet", U("input_blocks.3.0.skip_connection"), 4, 4.0,
             seed=203),
        lora(c, ku("input_blocks.1.0.emb_layers.1"), "unet", U("input_blocks.1.0.emb_layers.1"), 4, 2.0, seed=204),
    ]
    F.append(dict(name="sd1_locon", ckpt="sd1", layout="lycoris-locon", mods=mods,
                  meta=kohya_meta("sd1", 4, 2.0, "lycoris.kohya", {"algo": "locon", "use_tucker": "True"}),
                  second=[U("input_blocks.0.0")]))

    du = lambda sub: diffusers_unet("sd1", sub)
    mods = [
        lora(c, du(A1 + "attn1.to_k"), "unet", U(A1 + "attn1.to_k"), 4, style="peft", seed=301),
        lora(c, du("middle_block.1.transformer_blocks.0.attn1.to_out.0"), "unet",
             U("middle_block.1.transformer_blocks.0.attn1.to_out.0"), 2, style="peft", seed=302),
        lora(c, du("output_blocks.0.1.proj_out"), "unet", U("output_blocks.0.1.proj_out"), 4, style="peft", seed=303),
        lora(c, du("out.2"), "unet", U("out.2"), 2, style="peft", seed=304),
        lora(c, diffusers_te("te", 1, "self_attn.out_proj"), "clip", te(1, "self_attn.out_proj")[0], 4,
             style="peft", seed=305),
    ]
    F.append(dict(name="sd1_peft", ckpt="sd1", layout="peft", mods=mods, meta={},
                  second=[U("out.2")]))

    def proc(sub):      # diffusers' attention-processor name of an attention linear
        d = du(sub)
        d = d.replace(".to_out.0", ".to_out")
        return d.replace(".to_", ".processor.to_")

    mods = [
        lora(c, proc(A1 + "attn1.to_q"), "unet", U(A1 + "attn1.to_q"), 4, style="procs", seed=401),
        lora(c, proc("output_blocks.1.1.transformer_blocks.0.attn2.to_out.0"), "unet",
             U("output_blocks.1.1.transformer_blocks.0.attn2.to_out.0"), 4, style="procs", seed=402),
        lora(c, du("input_blocks.3.1.proj_in"), "unet", U("input_blocks.3.1.proj_in"), 2, style="dot",
             fshape="linear", seed=403),
    ]
    F.append(dict(name="sd1_diffusers_old", ckpt="sd1", layout="diffusers-old", mods=mods, meta={},
                  second=[U(A1 + "attn1.to_q")]))

    mods = [
        lora(c, proc(A1 + "attn1.to_v")[len("unet."):], "unet", U(A1 + "attn1.to_v"), 4, style="procs", seed=451),
    ]
    F.append(dict(name="sd1_attnprocs", ckpt="sd1", layout="diffusers-old", mods=mods, meta={}, second=[]))

    mods = [
        lora(c, comfy_unet(A1 + "attn1.to_v"), "unet", U(A1 + "attn1.to_v"), 4, dtype="f16", seed=501),
        lora(c, comfy_unet("middle_block.1.proj_in"), "unet", U("middle_block.1.proj_in"), 4, dtype="f16", seed=502),
        lora(c, comfy_unet("out.2"), "unet", U("out.2"), 2, dtype="f16", seed=503),
        diff(c, comfy_unet("input_blocks.3.1.norm"), "unet", U("input_blocks.3.1.norm"), dtype="f16", seed=504),
        diff(c, comfy_unet("input_blocks.3.1.proj_out"), "unet", U("input_blocks.3.1.proj_out"), weight=False,
             bias="model.diffusion_model.input_blocks.3.1.proj_out.bias", dtype="f16", seed=505),
        lora(c, comfy_te("clip_l", "encoder.layers.0.self_attn.k_proj"), "clip", te(0, "self_attn.k_proj")[0], 4,
             dtype="f16", seed=506),
        diff(c, comfy_te("clip_l", "final_layer_norm"), "clip",
             "cond_stage_model.transformer.text_model.final_layer_norm.weight",
             bias="cond_stage_model.transformer.text_model.final_layer_norm.bias", dtype="f16", seed=507),
    ]
    F.append(dict(name="sd1_comfy", ckpt="sd1", layout="comfy", mods=mods, meta={},
                  second=[U("out.2"), "cond_stage_model.transformer.text_model.final_layer_norm.bias"]))

    mods = [
        loha(c, ku(A1 + "attn1.to_out.0"), "unet", U(A1 + "attn1.to_out.0"), 4, 2.0, seed=601),
        loha(c, ku("input_blocks.0.0"), "unet", U("input_blocks.0.0"), 2, 2.0, seed=602),
        loha(c, ku("out.2"), "unet", U("out.2"), 2, 1.0, tucker=True, seed=603),
    ]
    t, rows = te(1, "self_attn.v_proj")
    mods.append(loha(c, kohya_te("te", 1, "self_attn.v_proj"), "clip", t, 4, 4.0, rows=rows, seed=604))
    F.append(dict(name="sd1_loha", ckpt="sd1", layout="lycoris-loha", mods=mods,
                  meta=kohya_meta("sd1", 4, 2.0, "lycoris.kohya", {"algo": "loha", "use_tucker": "True"}),
                  second=[U("out.2")]))

    mods = [
        lokr(c, ku(A1 + "attn1.to_q"), "unet", U(A1 + "attn1.to_q"), (8, 8), (8, 8), 1.0, {"w2": 2}, seed=701),
        lokr(c, ku("input_blocks.3.0.skip_connection"), "unet", U("input_blocks.3.0.skip_connection"), (8, 4), (8, 8),
             1.0, {"w1": 2}, seed=702),
        lokr(c, ku("out.2"), "unet", U("out.2"), (2, 4), (2, 8), 2.0, {"w2": 2}, tucker=True, seed=703),
        lokr(c, ku("input_blocks.1.0.emb_layers.1"), "unet", U("input_blocks.1.0.emb_layers.1"), (4, 8), (8, 16),
             1.0, {"w1": 2, "w2": 2}, seed=704),
    ]
    t, rows = te(0, "self_attn.out_proj")
    mods.append(lokr(c, kohya_te("te", 0, "self_attn.out_proj"), "clip", t, (4, 8), (16, 8), 4.0, seed=705))
    F.append(dict(name="sd1_lokr", ckpt="sd1", layout="lycoris-lokr", mods=mods,
                  meta=kohya_meta("sd1", 2, 1.0, "lycoris.kohya", {"algo": "lokr", "factor": "8"}),
                  second=[U("out.2")]))

    mods = [
        diff(c, ku(A1 + "attn2.to_q"), "unet", U(A1 + "attn2.to_q"), dtype="f16", seed=801),
        diff(c, ku("input_blocks.3.1.proj_out"), "unet", U("input_blocks.3.1.proj_out"),
             bias="model.diffusion_model.input_blocks.3.1.proj_out.bias", dtype="f16", seed=802),
    ]
    t, rows = te(1, "self_attn.q_proj")
    mods.append(diff(c, kohya_te("te", 1, "self_attn.q_proj"), "clip", t,
                     bias=te_target("sd1", "te", 1, "self_attn.q_proj", bias=True)[0], dtype="f16", seed=804))
    F.append(dict(name="sd1_diff", ckpt="sd1", layout="lycoris-full", mods=mods,
                  meta=kohya_meta("sd1", 1, 1.0, "lycoris.kohya", {"algo": "full"}),
                  second=["model.diffusion_model.input_blocks.3.1.proj_out.bias"]))

    mods = [
        lora(c, ku(A1 + "attn1.to_v"), "unet", U(A1 + "attn1.to_v"), 4, 2.0, seed=901, dora=True),
        lora(c, ku("input_blocks.0.0"), "unet", U("input_blocks.0.0"), 2, 1.0, seed=902, dora=True),
        loha(c, ku("output_blocks.0.1.transformer_blocks.0.attn1.to_k"), "unet",
             U("output_blocks.0.1.transformer_blocks.0.attn1.to_k"), 2, 1.0, dtype="f32", seed=903, dora=True),
        kte(1, "self_attn.k_proj", rank=4, alpha=4.0, seed=904, dora=True),
    ]
    F.append(dict(name="sd1_dora", ckpt="sd1", layout="kohya-dora", mods=mods,
                  meta=kohya_meta("sd1", 4, 2.0, "lycoris.kohya", {"algo": "locon", "dora_wd": "True"}),
                  second=[U("input_blocks.0.0"), te(1, "self_attn.k_proj")[0]]))

    mods = [kte(1, "mlp.fc2", rank=2, alpha=1.0, dtype="f16", seed=1001),
            unmatched("lora_unet_down_blocks_2_attentions_0_transformer_blocks_0_attn1_to_q", ([4, 64], [64, 4]),
                      seed=1002),
            unmatched(kohya_te("te", 5, "mlp.fc1"), ([4, 64], [256, 4]), seed=1003)]
    F.append(dict(name="sd1_unmatched", ckpt="sd1", layout="kohya", mods=mods, meta=kohya_meta("sd1", 4, 1.0),
                  second=[]))

    # ---------------------------------------------------------------- SD 2.x
    c = CKPT["sd2"]
    ku = lambda sub: kohya_unet("sd2", sub)
    te = lambda l, sub: te_target("sd2", "te", l, sub)

    def kte2(l, sub, maker=lora, **kw):
        t, rows = te(l, sub)
        return maker(c, kohya_te("te", l, sub), "clip", t, rows=rows, **kw)

    mods = [
        lora(c, ku("input_blocks.3.1.proj_in"), "unet", U("input_blocks.3.1.proj_in"), 4, 2.0, dtype="f16", seed=2001),
        kte2(0, "self_attn.q_proj", rank=4, alpha=2.0, dtype="f16", seed=2004),
        kte2(0, "self_attn.k_proj", rank=2, alpha=2.0, dtype="f16", seed=2005),
        kte2(0, "self_attn.v_proj", rank=4, alpha=1.0, dtype="f16", seed=2006),
        kte2(0, "self_attn.out_proj", rank=4, alpha=2.0, dtype="f16", seed=2007),
    ]
    F.append(dict(name="sd2_kohya", ckpt="sd2", layout="kohya", mods=mods,
                  meta=kohya_meta("sd2", 4, 2.0),
                  second=[te(0, "self_attn.out_proj")[0]]))

    du = lambda sub: diffusers_unet("sd2", sub)
    mods = [
        lora(c, du("middle_block.1.transformer_blocks.0.attn2.to_k"), "unet",
             U("middle_block.1.transformer_blocks.0.attn2.to_k"), 4, style="peft", seed=2101),
        lora(c, du("input_blocks.3.1.proj_out"), "unet", U("input_blocks.3.1.proj_out"), 2, style="peft",
             fshape="conv", seed=2102),
        lora(c, diffusers_te("te", 1, "self_attn.out_proj"), "clip", te(1, "self_attn.out_proj")[0], 4,
             style="peft", seed=2103),
    ]
    F.append(dict(name="sd2_peft", ckpt="sd2", layout="peft", mods=mods, meta={},
                  second=[U("input_blocks.3.1.proj_out")]))

    qb, qbrows = te_target("sd2", "te", 2, "self_attn.q_proj", bias=True)
    mods = [
        kte2(2, "self_attn.v_proj", maker=loha, rank=2, alpha=1.0, seed=2201),
        kte2(2, "self_attn.k_proj", maker=lokr, w1=(4, 4), w2=(16, 16), alpha=2.0, rank={"w2": 2}, dtype="f16",
             seed=2202),
        kte2(2, "self_attn.q_proj", maker=diff, bias=qb, bias_rows=qbrows, dtype="f16", seed=2203),
        diff(c, kohya_te("te", 2, "mlp.fc2"), "clip", te(2, "mlp.fc2")[0], weight=False,
             bias=te_target("sd2", "te", 2, "mlp.fc2", bias=True)[0], dtype="f16", seed=2204),
        loha(c, ku("output_blocks.0.1.proj_in"), "unet", U("output_blocks.0.1.proj_in"), 2, 2.0, seed=2205),
    ]
    F.append(dict(name="sd2_lycoris", ckpt="sd2", layout="lycoris", mods=mods,
                  meta=kohya_meta("sd2", 2, 1.0, "lycoris.kohya", {"algo": "loha"}),
                  second=[te(2, "self_attn.q_proj")[0], qb]))

    # ---------------------------------------------------------------- SDXL
    c = CKPT["sdxl"]
    ku = lambda sub: kohya_unet("sdxl", sub)

    def ktex(enc, l, sub, maker=lora, **kw):
        t, rows = te_target("sdxl", enc, l, sub)
        return maker(c, kohya_te(enc, l, sub), "clip", t, rows=rows, **kw)

    X1 = "input_blocks.3.1.transformer_blocks.1."
    mods = [
        lora(c, ku("middle_block.1.proj_in"), "unet", U("middle_block.1.proj_in"), 4, 4.0, dtype="f16", seed=3002),
        lora(c, ku("output_blocks.0.1.transformer_blocks.0.attn2.to_k"), "unet",
             U("output_blocks.0.1.transformer_blocks.0.attn2.to_k"), 2, 1.0, dtype="f16", seed=3003),
        lora(c, ku("input_blocks.3.0.skip_connection"), "unet", U("input_blocks.3.0.skip_connection"), 4, 2.0,
             dtype="f16", seed=3004),
        ktex("te1", 0, "self_attn.q_proj", rank=4, alpha=2.0, dtype="f16", seed=3006),
        ktex("te2", 0, "self_attn.q_proj", rank=4, alpha=2.0, dtype="f16", seed=3008),
        ktex("te2", 0, "self_attn.k_proj", rank=4, alpha=2.0, dtype="f16", seed=3009),
        ktex("te2", 0, "self_attn.v_proj", rank=4, alpha=2.0, dtype="f16", seed=3010),
    ]
    F.append(dict(name="sdxl_kohya", ckpt="sdxl", layout="kohya", mods=mods,
                  meta=kohya_meta("sdxl", 4, 2.0),
                  second=[U("input_blocks.3.0.skip_connection")]))

    du = lambda sub: diffusers_unet("sdxl", sub)
    mods = [
        lora(c, du(X1 + "attn2.to_out.0"), "unet", U(X1 + "attn2.to_out.0"), 4, style="peft", seed=3101),
        lora(c, du("output_blocks.0.1.proj_in"), "unet", U("output_blocks.0.1.proj_in"), 2, style="peft", seed=3102),
        lora(c, diffusers_te("te1", 1, "self_attn.q_proj"), "clip",
             te_target("sdxl", "te1", 1, "self_attn.q_proj")[0], 4, style="peft", seed=3103),
        lora(c, diffusers_te("te2", 2, "self_attn.out_proj"), "clip",
             te_target("sdxl", "te2", 2, "self_attn.out_proj")[0], 4, style="peft", seed=3104),
    ]
    F.append(dict(name="sdxl_peft", ckpt="sdxl", layout="peft", mods=mods, meta={},
                  second=[te_target("sdxl", "te2", 2, "self_attn.out_proj")[0]]))

    t2k, t2krows = te_target("sdxl", "te2", 1, "self_attn.k_proj")
    mods = [
        lora(c, comfy_unet("input_blocks.3.1.transformer_blocks.0.attn1.to_v"), "unet",
             U("input_blocks.3.1.transformer_blocks.0.attn1.to_v"), 4, dtype="f16", seed=3201),
        lora(c, comfy_te("clip_l", "encoder.layers.1.self_attn.v_proj"), "clip",
             te_target("sdxl", "te1", 1, "self_attn.v_proj")[0], 4, dtype="f16", seed=3203),
        lora(c, comfy_te("clip_g", "encoder.layers.1.self_attn.k_proj"), "clip", t2k, 4, rows=t2krows,
             dtype="f16", seed=3204),
        diff(c, comfy_te("clip_g", "encoder.layers.1.mlp.fc1"), "clip",
             te_target("sdxl", "te2", 1, "mlp.fc1")[0], weight=False,
             bias=te_target("sdxl", "te2", 1, "mlp.fc1", bias=True)[0], dtype="f16", seed=3205),
    ]
    F.append(dict(name="sdxl_comfy", ckpt="sdxl", layout="comfy", mods=mods, meta={},
                  second=[U("input_blocks.3.1.transformer_blocks.0.attn1.to_v"),
                          te_target("sdxl", "te2", 1, "mlp.fc1", bias=True)[0]]))
    return F


# ------------------------------------------------------------------ writing

STRENGTHS = [1.0, 0.7]


def from_file(m, tensors):
    """A copy of m whose factors are the ones read back from the written file."""
    c = Mod(m.key, m.part, m.kind, m.target, m.rows, m.style, None, m.bias_target, m.bias_rows)
    c.unmatched = m.unmatched
    keys = m.file_keys()
    for name, (t, _) in keys.items():
        v = torch.from_numpy(tensors[name])
        suffix = name[len(m.key):]
        if suffix == ".alpha":
            c.alpha = float(v)
        elif suffix == ".dora_scale":
            c.dora = v
        elif suffix == ".diff_b":
            c.f["diff_b"] = v
        else:
            canon = [n for n, tt in m.f.items() if tt is t]
            assert len(canon) == 1, name
            c.f[canon[0]] = v
    assert set(c.f) == set(m.f) and (c.alpha is None) == (m.alpha is None), m.key
    return c


def check_case(ck, mods_read, strengths, expected_path, names):
    """The written expected tensors against a plain-loop merge of the read-back factors."""
    got, _ = st_read(expected_path)
    assert sorted(got) == sorted(names), (expected_path, sorted(got), names)
    loop = loop_merge(ck, [(m, strengths[m.part]) for m in mods_read])
    for n in names:
        ref = np.array(loop[n], dtype=np.float64).reshape(ck.shape(n))
        base = ck.base(n).double().numpy()
        err = float(np.abs(got[n] - ref).max())
        moved = float(np.abs(ref - base).max())
        if err > 2e-6 or moved < 1e-2:
            sys.exit("%s: %s differs from the loop merge by %g (moved %g)" % (expected_path, n, err, moved))
    return len(names)


def check_bypass(ck, mods_read, s):
    """LoRA modules once more, the way the networks run them unmerged (kohya's
    and LyCORIS' forward: org(x) + s * scale * up(mid(down(x)))), against the
    layer run with the merged weight: this pins the conv factor layouts."""
    import torch.nn.functional as Fn
    g = torch.Generator().manual_seed(5)
    for m in mods_read:
        if m.kind != "lora" or m.unmatched or m.dora is not None:
            continue
        merged = merge_torch(ck, [(m, s)])[m.target]
        w = ck.base(m.target).double()
        if m.rows:
            w = w[m.rows[0]:m.rows[0] + m.rows[1]]
            merged = merged[m.rows[0]:m.rows[0] + m.rows[1]]
        f = {k: v.double() for k, v in m.f.items()}
        sc = s * scale_of(m)
        if w.dim() == 4 and w.shape[2] > 1:
            pad = w.shape[2] // 2
            x = torch.randn([1, w.shape[1], 6, 6], generator=g).double()
            h = Fn.conv2d(x, f["down"], padding=0 if "mid" in f else pad)
            if "mid" in f:
                h = Fn.conv2d(h, f["mid"], padding=pad)
            y = Fn.conv2d(x, w, padding=pad) + sc * Fn.conv2d(h, f["up"])
            ref = Fn.conv2d(x, merged, padding=pad)
        else:
            x = torch.randn([3, w.shape[1]], generator=g).double()
            y = x @ w.flatten(1).t() + sc * (x @ f["down"].flatten(1).t()) @ f["up"].flatten(1).t()
            ref = x @ merged.flatten(1).t()
        err = float((y - ref).abs().max())
        if err > 1e-9 * max(1.0, float(ref.abs().max())):
            sys.exit("%s: the merged weight and the unmerged run differ by %g" % (m.key, err))


def module_record(m):
    r = {"key": m.key, "part": m.part, "kind": m.kind, "dora": m.dora is not None,
         "alpha": m.alpha, "scale": scale_of(m) if not m.unmatched else None, "targets": []}
    for tname, rows, is_bias in m.targets():
        r["targets"].append({"tensor": tname, "rows": [rows[0] + 1, rows[1]] if rows else None})
    if m.kind == "lora":
        r["rank"] = int(m.f["down"].shape[0])
        r["mid"] = "mid" in m.f
    if m.kind in ("loha", "lokr"):
        r["factors"] = sorted(m.f)
    return r


def forward_golden(spec, merged):
    """PyTorch's run of the tiny SD 1.x networks with the merged weights."""
    ck = CKPT["sd1"]
    m = G.sd1_model()
    sd = m.state_dict()
    for n in sd:
        dt, shape, _, _, _ = ck.recipe[n]
        if dt == "f32" and shape:
            sd[n] = ck.base(n)
    m.load_state_dict(sd)
    ref, _ = st_read(os.path.join(SD, "sd1.safetensors"))
    g = {}
    with torch.no_grad():
        ids_e, _ = G.ids_batch()
        x, t, ctx = G.unet_inputs(64)
        clip = m.cond_stage_model.transformer.text_model
        base_unet = m.model.diffusion_model(x, t, ctx).double().numpy()
        base_clip = clip.final_layer_norm(clip(ids_e)[-1]).double().numpy()
        # the recipe-built base network reproduces gen_sd_golden's outputs
        assert np.abs(base_unet - ref["unet.out"]).max() < 1e-4, "base UNet differs from sd1.safetensors"
        assert np.abs(base_clip - ref["clip.last"]).max() < 1e-4, "base CLIP differs from sd1.safetensors"
        for n, w in merged.items():
            sd[n] = w.float()
        m.load_state_dict(sd)
        g["unet.out"] = m.model.diffusion_model(x, t, ctx)
        g["clip.last"] = clip.final_layer_norm(clip(ids_e)[-1])
    du = float(np.abs(g["unet.out"].double().numpy() - base_unet).max())
    dc = float(np.abs(g["clip.last"].double().numpy() - base_clip).max())
    assert du > 1e-2 and dc > 1e-2, (du, dc)
    path = os.path.join(OUT, spec["name"] + ".forward.safetensors")
    st_write(path, {k: (v, "f32") for k, v in g.items()},
             {"lora": spec["name"] + ".safetensors", "strength": "1.0",
              "inputs": "gen_sd_golden unet_inputs(64) and ids_batch() (end-padded windows)"})
    return os.path.basename(path), du, dc


def manifest_text(mf):
    """JSON with one line per module, case and note (readable diffs, small file)."""
    j = lambda v: json.dumps(v, separators=(", ", ": "))
    out = ["{", ' "generator": %s,' % j(mf["generator"]), ' "notes": [']
    out.append(",\n".join("  " + j(n) for n in mf["notes"]) + "],")
    out.append(' "files": [')
    recs = []
    for r in mf["files"]:
        head = {k: v for k, v in r.items() if k not in ("modules", "cases")}
        lines = ["  {" + j(head)[1:-1] + ","]
        lines.append('   "modules": [')
        lines.append(",\n".join("    " + j(m) for m in r["modules"]) + "],")
        lines.append('   "cases": [')
        lines.append(",\n".join("    " + j(c) for c in r["cases"]) + "]}")
        recs.append("\n".join(lines))
    out.append(",\n".join(recs) + "],")
    out.append(' "stacks": [')
    out.append(",\n".join("  " + j(st) for st in mf["stacks"]) + "]")
    out.append("}")
    text = "\n".join(out) + "\n"
    assert json.loads(text) == json.loads(json.dumps(mf))
    return text


def expected_name(name, s):
    return "%s.expected.safetensors" % name if s == 1.0 else "%s.s%g.expected.safetensors" % (name, s)


def main():
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        if f.endswith(".safetensors") or f == "manifest.json":
            os.remove(os.path.join(OUT, f))
    setup()
    manifest = {
        "generator": "tests/golden/gen_lora.py",
        "notes": [
            "checkpoints: tests/golden/sd/<checkpoint>.recipe rebuilt as tests/lua/tiny_sd.lua does",
            "expected files hold f32 merged weights of the listed tensors only, keyed by checkpoint name",
            "strengths: unet applies to part 'unet' modules, clip to part 'clip' modules",
            "rows: [first (1-based), count] of dim 1 of a fused OpenCLIP in_proj_weight / in_proj_bias",
            "patched: number of distinct checkpoint tensors the file changes (= tensors of the strength-1 file)",
            "scale: ComfyUI's alpha/rank for the module (1 without alpha; LoKr full w1 and w2: 1)",
            "DoRA: W + s * (dora_scale * (W + scale*delta) / colnorm(W + scale*delta) - W), norm over all "
            "dims but dim 1 (ComfyUI weight_decompose); strength is not folded into the delta",
            "a case's expected file holds exactly the tensors its 'tensors' lists (a subset at strength 0.7)",
        ],
        "files": [],
        "stacks": [],
    }
    specs = files()
    by_name = {}
    total = 0
    for spec in specs:
        ck = CKPT[spec["ckpt"]]
        name = spec["name"]
        by_name[name] = spec
        tensors = {}
        for m in spec["mods"]:
            for k, v in m.file_keys().items():
                assert k not in tensors, k
                tensors[k] = v
        lpath = os.path.join(OUT, name + ".safetensors")
        st_write(lpath, tensors, spec["meta"])
        read, _ = st_read(lpath)
        mods_read = [from_file(m, read) for m in spec["mods"]]
        spec["read"] = mods_read
        patched = []
        for m in spec["mods"]:
            for tname, _, _ in m.targets():
                if tname not in patched:
                    patched.append(tname)
        rec = {
            "name": name, "file": name + ".safetensors", "checkpoint": spec["ckpt"], "family": spec["ckpt"],
            "layout": spec["layout"], "keys": len(tensors),
            "parts": {p: sum(1 for m in spec["mods"] if m.part == p and not m.unmatched) for p in ("unet", "clip")},
            "patched": len(patched),
            "unmatched": sorted(k for m in spec["mods"] if m.unmatched for k in m.file_keys()),
            "modules": [module_record(m) for m in spec["mods"] if not m.unmatched],
            "cases": [],
        }
        for s in STRENGTHS:
            strengths = {"unet": s, "clip": s}
            merged = merge_torch(ck, [(m, strengths[m.part]) for m in spec["mods"]])
            assert sorted(merged) == sorted(patched)
            keep = patched if (s == 1.0 or spec["second"] is None) else spec["second"]
            if not keep:
                continue
            epath = os.path.join(OUT, expected_name(name, s))
            st_write(epath, {n: (merged[n].float(), "f32") for n in keep},
                     {"lora": name + ".safetensors", "unet": str(s), "clip": str(s)})
            check_case(ck, mods_read, strengths, epath, list(keep))
            check_bypass(ck, mods_read, s)
            rec["cases"].append({"unet": s, "clip": s, "expected": os.path.basename(epath),
                                 "tensors": sorted(keep)})
            if s == 1.0 and spec.get("forward"):
                rec["forward"], du, dc = forward_golden(spec, merged)
                print("  %s forward: LoRA moves unet.out by %.3g, clip.last by %.3g" % (name, du, dc))
        manifest["files"].append(rec)
        print("  %-18s %-14s %2d keys %2d patched, checked" % (name, spec["layout"], len(tensors), len(patched)))

    # two files applied together, in this order: the tensors both change
    a, b = by_name["sd1_kohya"], by_name["sd1_lokr"]
    ck = CKPT["sd1"]
    order = [(m, 1.0) for m in a["mods"]] + [(m, 0.7) for m in b["mods"]]
    ta = {t for m in a["mods"] for t, _, _ in m.targets()}
    tb = {t for m in b["mods"] for t, _, _ in m.targets()}
    both = sorted(ta & tb)
    merged = merge_torch(ck, order)
    epath = os.path.join(OUT, "stack.expected.safetensors")
    st_write(epath, {n: (merged[n].float(), "f32") for n in both}, {"loras": "sd1_kohya@1.0, sd1_lokr@0.7"})
    got, _ = st_read(epath)
    loop = loop_merge(ck, [(m, 1.0) for m in a["read"]] + [(m, 0.7) for m in b["read"]])
    for n in both:
        assert np.abs(got[n] - np.array(loop[n]).reshape(ck.shape(n))).max() < 2e-6, n
    manifest["stacks"].append({"checkpoint": "sd1", "expected": "stack.expected.safetensors", "tensors": both,
                               "loras": [{"file": "sd1_kohya.safetensors", "unet": 1.0, "clip": 1.0},
                                         {"file": "sd1_lokr.safetensors", "unet": 0.7, "clip": 0.7}]})
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        f.write(manifest_text(manifest))
    for f in sorted(os.listdir(OUT)):
        n = os.path.getsize(os.path.join(OUT, f))
        total += n
        print("  %-40s %7d bytes" % (f, n))
    print("  total %d bytes" % total)


if __name__ == "__main__":
    main()
