#!/usr/bin/python3
"""PyTorch side of tests/bench/bench_sd.lua: the same SD 1.5-architecture networks
with the same weights, timed on the CPU.

Usage: /usr/bin/python3 tests/bench/torch_sd.py WEIGHTS WHAT [options]
  WEIGHTS  the single-file checkpoint bench_sd.lua wrote (random f16 weights in the
           original naming); read tensor by tensor through np.memmap, cast to f32
  WHAT     unet | vae | clip
  --batch B --size S   UNet: x [B, 4, S, S] (randn seed 11), t = 500, context
                       [B, 77, 768] (randn seed 12); VAE: z [1, 4, S, S] (seed 13),
                       decoded as ldm's decode_first_stage (z / 0.18215)
  --repeat N           timed runs (the best is reported), default 1
  --threads N          torch.set_num_threads, default 2
  --out PATH           save the output tensor (safetensors, key "out")
Prints one JSON line: {"what", "batch", "size", "sec" (best), "times", "peak_rss"
(bytes, ru_maxrss of this process: weights + the forward), "load_sec"}.

The networks are examples/models/sd_modules.py (the CompVis / LDM / transformers
modules rebuilt from the original code: explicit softmax(q k^T) attention, as the
original runs on a CPU), loaded with strict key matching. Seeds give the same
values as kiln.randn (kiln.randn is torch.randn)."""
import json
import os
import resource
import struct
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "models"))
import sd_modules as sdm  # noqa: E402
from safetensors_io import save  # noqa: E402

_NP = {"F16": np.float16, "F32": np.float32, "BF16": None, "I64": np.int64}


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def load_part(path, prefix):
    """{name without prefix: f32 (or i64) tensor} for the tensors under prefix."""
    header, base = read_header(path)
    out = {}
    for name, info in header.items():
        if not name.startswith(prefix):
            continue
        b, e = info["data_offsets"]
        dt = _NP[info["dtype"]]
        shape = tuple(info["shape"])
        count = (e - b) // np.dtype(dt).itemsize
        arr = np.memmap(path, dtype=dt, mode="r", offset=base + b, shape=(count,))
        t = torch.from_numpy(np.array(arr, dtype=np.int64 if dt == np.int64 else np.float32))
        out[name[len(prefix):]] = t.reshape(shape)
        del arr
    return out


class no_init:
    """Skips the random initialisation while modules are built (the weights are
    replaced right after; initialising 860 M parameters costs seconds)."""
    NAMES = ("kaiming_uniform_", "uniform_", "normal_", "xavier_uniform_")

    def __enter__(self):
        self.saved = {n: getattr(torch.nn.init, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.nn.init, n, f)


def build(what, path):
    if what == "unet":
        with no_init():
            m = sdm.UNetModel(sdm.UNetConfig())
        sd = load_part(path, "model.diffusion_model.")
    elif what == "vae":
        with no_init():
            m = sdm.AutoencoderKL(sdm.VAEConfig(resolution=512))
        sd = load_part(path, "first_stage_model.")
    elif what == "clip":
        with no_init():
            m = sdm.CLIPTextModel(sdm.CLIPTextConfig())
        sd = load_part(path, "cond_stage_model.transformer.")
    else:
        raise SystemExit("WHAT must be unet, vae or clip, got %r" % what)
    m.load_state_dict(sd, strict=True)
    del sd
    return m.eval()


def main(argv):
    if len(argv) < 3:
        raise SystemExit(__doc__)
    path, what = argv[1], argv[2]
    opts = {"batch": 1, "size": 64, "repeat": 1, "threads": 2, "out": None}
    i = 3
    while i < len(argv):
        k = argv[i].lstrip("-")
        if k not in opts:
            raise SystemExit("unknown option %s" % argv[i])
        opts[k] = argv[i + 1] if k == "out" else int(argv[i + 1])
        i += 2
    torch.set_num_threads(opts["threads"])
    t0 = time.perf_counter()
    model = build(what, path)
    load_sec = time.perf_counter() - t0
    B, S = opts["batch"], opts["size"]
    if what == "unet":
        torch.manual_seed(11)
        x = torch.randn(B, 4, S, S)
        torch.manual_seed(12)
        ctx = torch.randn(B, 77, 768)
        t = torch.full((B,), 500.0)
        run = lambda: model(x, t, ctx)  # noqa: E731
    elif what == "vae":
        torch.manual_seed(13)
        z = torch.randn(1, 4, S, S)
        run = lambda: model.decode(z / 0.18215)  # noqa: E731
    else:
        ids = [49406, 320, 1125, 539, 320, 2368, 49407] + [49407] * 70
        ids = torch.tensor([ids] * B)
        run = lambda: model(ids)  # noqa: E731
    times, out = [], None
    with torch.no_grad():
        for _ in range(opts["repeat"]):
            t1 = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - t1)
    if opts["out"]:
        save(opts["out"], {"out": out.contiguous()})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"what": what, "batch": B, "size": S, "sec": min(times), "times": times,
                      "peak_rss": peak, "load_sec": load_sec, "threads": opts["threads"]}))


if __name__ == "__main__":
    main(sys.argv)
