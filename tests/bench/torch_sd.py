#!/usr/bin/python3
"""PyTorch side of tests/bench/bench_sd.lua: the same SD 1.5-architecture networks
with the same weights, timed on the CPU.

Usage: /usr/bin/python3 tests/bench/torch_sd.py WEIGHTS WHAT [options]
  WEIGHTS  the single-file checkpoint bench_sd.lua wrote (random f16 weights in the
           original naming); copied tensor by tensor (np.memmap) into the f32 model
  WHAT     unet | vae | clip | upscale | taesd
  --batch B --size S   UNet: x [B, 4, S, S] (randn seed 11), t = 500, context
                       [B, 77, 768] (randn seed 12); VAE: z [1, 4, S, S] (seed 13),
                       decoded as ldm's decode_first_stage (z / 0.18215);
                       upscale: an RRDBNet x4 (new key layout, f32 file) on an image
                       [1, 3, S, S] = randn (seed 21) * 0.25 + 0.5;
                       taesd: a TAESD decoder file (tests/golden/gen_taesd.py's
                       independent module) on z [1, 4, S, S] (seed 13), clamped
  --repeat N           timed runs (the best is reported), default 1
  --warmup N           untimed runs before them, default 0
  --threads N          torch.set_num_threads, default 2
  --out PATH           save the output tensor (safetensors, key "out")
Prints one JSON line: {"what", "batch", "size", "sec" (best), "cpu" (process CPU
seconds of that run, all threads), "times", "peak_rss"
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


def load_into(model, path, prefix):
    """Copies the file's tensors under prefix into the model's state, one at a time
    (no second full copy of the weights), with strict name and shape matching."""
    header, base = read_header(path)
    names = {n[len(prefix):]: n for n in header if n.startswith(prefix)}
    state = model.state_dict()
    missing = sorted(set(state) - set(names))
    unexpected = sorted(set(names) - set(state))
    if missing or unexpected:
        raise SystemExit("%s: missing %s, unexpected %s" % (path, missing[:5], unexpected[:5]))
    with torch.no_grad():
        for key, dst in state.items():
            info = header[names[key]]
            if list(info["shape"]) != list(dst.shape):
                raise SystemExit("%s: %s has shape %s, expected %s" % (path, names[key], info["shape"],
                                                                       list(dst.shape)))
            b, e = info["data_offsets"]
            dt = _NP[info["dtype"]]
            count = (e - b) // np.dtype(dt).itemsize
            arr = np.memmap(path, dtype=dt, mode="r", offset=base + b, shape=(count,))
            dst.copy_(torch.from_numpy(np.array(arr)).reshape(dst.shape))
            del arr


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
    with no_init():
        if what == "unet":
            m, prefix = sdm.UNetModel(sdm.UNetConfig()), "model.diffusion_model."
        elif what == "vae":
            m, prefix = sdm.AutoencoderKL(sdm.VAEConfig(resolution=512)), "first_stage_model."
        elif what == "clip":
            m, prefix = sdm.CLIPTextModel(sdm.CLIPTextConfig()), "cond_stage_model.transformer."
        else:
            raise SystemExit("WHAT must be unet, vae or clip, got %r" % what)
    load_into(m, path, prefix)
    return m.eval()


def build_upscaler(path):
    """RRDBNet x4 in the new key layout (tests/golden/gen_upscale.py's independent
    module), sizes read from the file, weights copied tensor by tensor."""
    sys.path.insert(0, os.path.join(HERE, "..", "golden"))
    import gen_upscale as gu
    header, base = read_header(path)
    nb = 1 + max(int(k.split(".")[1]) for k in header if k.startswith("body.") and k.endswith("rdb1.conv1.weight"))
    nf, gc = header["conv_first.weight"]["shape"][0], header["body.0.rdb1.conv1.weight"]["shape"][0]
    with no_init():
        m = gu.RRDBNet(4, nf, gc, nb)
    names = m.names("new")
    with torch.no_grad():
        for pname, p in m.named_parameters():
            info = header[names[pname]]
            b, e = info["data_offsets"]
            dt = _NP[info["dtype"]]
            arr = np.memmap(path, dtype=dt, mode="r", offset=base + b, shape=((e - b) // np.dtype(dt).itemsize,))
            p.copy_(torch.from_numpy(np.array(arr)).reshape(p.shape))
    return m.eval()


def build_taesd(path):
    """A TAESD decoder (tests/golden/gen_taesd.py's independent module, the published
    architecture) with the file's weights (real key names), strict matching."""
    sys.path.insert(0, os.path.join(HERE, "..", "golden"))
    import gen_taesd as gt
    header, _ = read_header(path)
    w, latent = header["1.weight"]["shape"][0], header["1.weight"]["shape"][1]
    with no_init():
        m = gt.decoder(latent, w)
    load_into(m, path, "")
    return m.eval()


def main(argv):
    if len(argv) < 3:
        raise SystemExit(__doc__)
    path, what = argv[1], argv[2]
    opts = {"batch": 1, "size": 64, "repeat": 1, "warmup": 0, "threads": 2, "out": None}
    i = 3
    while i < len(argv):
        k = argv[i].lstrip("-")
        if k not in opts:
            raise SystemExit("unknown option %s" % argv[i])
        opts[k] = argv[i + 1] if k == "out" else int(argv[i + 1])
        i += 2
    torch.set_num_threads(opts["threads"])
    t0 = time.perf_counter()
    model = build_upscaler(path) if what == "upscale" else build_taesd(path) if what == "taesd" else build(what, path)
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
    elif what == "taesd":
        torch.manual_seed(13)
        z = torch.randn(1, 4, S, S)
        run = lambda: model(z).clamp(0, 1)  # noqa: E731
    elif what == "upscale":
        # the image as kiln makes it: randn (seed 21) * 0.25 + 0.5
        torch.manual_seed(21)
        img = torch.randn(1, 3, S, S) * 0.25 + 0.5
        run = lambda: model(img)  # noqa: E731
    else:
        ids = [49406, 320, 1125, 539, 320, 2368, 49407] + [49407] * 70
        ids = torch.tensor([ids] * B)
        run = lambda: model(ids)  # noqa: E731
    times, cpus, out = [], [], None
    with torch.no_grad():
        for _ in range(opts["warmup"]):
            out = run()
        for _ in range(opts["repeat"]):
            t1, c1 = time.perf_counter(), time.process_time()
            out = run()
            times.append(time.perf_counter() - t1)
            cpus.append(time.process_time() - c1)
    if opts["out"]:
        save(opts["out"], {"out": out.contiguous()})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    best = min(range(len(times)), key=lambda j: times[j])
    print(json.dumps({"what": what, "batch": B, "size": S, "sec": times[best], "cpu": cpus[best], "times": times,
                      "peak_rss": peak, "load_sec": load_sec, "threads": opts["threads"]}))


if __name__ == "__main__":
    main(sys.argv)
