#!/usr/bin/python3
"""PyTorch's side of tests/bench/bench_flux_blocks.lua: one Flux.1 double-stream block
and one single-stream block at full width (hidden 3072, 24 heads, axes 16/56/56), in
f32, on the weights of a bf16 safetensors file written by tests/bench/flux_weights.lua
(--double 1 --single 1 --format bf16), over --img image and --txt text tokens.

The blocks are tests/golden/gen_flux.py's own PyTorch implementation of BFL's published
definition, with its width constants set to the full-size model's.

  /usr/bin/python3 tests/bench/torch_flux_blocks.py FILE [--img 1024] [--txt 512]
      [--repeat 3] [--threads 2]

Prints one line per block: best and median seconds over --repeat runs.
"""

import argparse
import json
import os
import statistics
import struct
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "golden"))
import gen_flux  # noqa: E402


def load_bf16(path):
    """A safetensors file of BF16 tensors -> dict of f32 tensors."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        if info["dtype"] != "BF16":
            raise SystemExit("%s: %s is %s, not BF16" % (path, name, info["dtype"]))
        b, e = info["data_offsets"]
        u = np.frombuffer(data[b:e], dtype=np.uint16).astype(np.uint32) << 16
        out[name] = torch.from_numpy(u.view(np.float32).reshape(info["shape"]).copy())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--img", type=int, default=1024)
    ap.add_argument("--txt", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    w = load_bf16(a.file)
    H = w["img_in.weight"].shape[0]
    gen_flux.HIDDEN, gen_flux.HEADS, gen_flux.AXES = H, H // 128, (16, 56, 56)
    side = int(round(a.img ** 0.5))
    torch.manual_seed(0)
    img = torch.randn(1, a.img, H)
    txt = torch.randn(1, a.txt, H)
    vec = torch.randn(1, H)
    ids = torch.zeros(1, a.txt + a.img, 3)
    r = torch.arange(a.img)
    ids[0, a.txt:, 1] = (r // side).float()
    ids[0, a.txt:, 2] = (r % side).float()
    cos, sin = gen_flux.rope_tables(ids)

    def run(name, fn):
        times = []
        with torch.no_grad():
            for _ in range(a.repeat):
                t0 = time.time()
                fn()
                times.append(time.time() - t0)
        print("torch f32 %s: best %.3f s, median %.3f s (%d runs, %d threads)"
              % (name, min(times), statistics.median(times), a.repeat, a.threads), flush=True)

    run("double block", lambda: gen_flux.double_block(w, "double_blocks.0.", img, txt, vec, cos, sin))
    xs = torch.cat([txt, img], dim=1)
    run("single block", lambda: gen_flux.single_block(w, "single_blocks.0.", xs, vec, cos, sin))


if __name__ == "__main__":
    main()
