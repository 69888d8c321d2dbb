#!/usr/bin/python3
"""PyTorch's side of tests/bench/bench_sd3_blocks.lua: one SD 3.5 joint block at full
width in f32, Stability AI's own JointBlock (mmditx.py of github.com/Stability-AI/sd3.5,
extracted outside the tree as tests/golden/gen_sd3.py says, with gen_sd3.py's stand-ins
for the imports Debian's torch 1.13 lacks) with the weights of block --block of a bf16
safetensors file written by tests/bench/sd3_weights.lua, over --img image and --txt
context tokens.

torch 1.13 has no scaled_dot_product_attention: the stand-in here is softmax(q k^T /
sqrt(d)) v over groups of heads, so one score matrix stays near 256 MiB (all 38 heads of
a 4429-token attention at once would be 3 GB, more than this shared machine spares).

  /usr/bin/python3 tests/bench/torch_sd3_blocks.py FILE --ref DIR [--block 0]
      [--img 4096] [--txt 333] [--repeat 3] [--threads 2]

Prints one line: best and median seconds over --repeat runs.
"""

import argparse
import json
import math
import os
import statistics
import struct
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "golden"))
import gen_sd3  # noqa: E402


def load_bf16(path, prefix):
    """The BF16 tensors below prefix of a safetensors file -> dict of f32 tensors (names
    without the prefix)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        header.pop("__metadata__", None)
        for name, info in header.items():
            if not name.startswith(prefix):
                continue
            if info["dtype"] != "BF16":
                raise SystemExit("%s: %s is %s, not BF16" % (path, name, info["dtype"]))
            b, e = info["data_offsets"]
            f.seek(base + b)
            u = np.frombuffer(f.read(e - b), dtype=np.uint16).astype(np.uint32) << 16
            out[name[len(prefix):]] = torch.from_numpy(u.view(np.float32).reshape(info["shape"]).copy())
    return out


def grouped_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
    assert attn_mask is None and not is_causal
    heads, L, S = q.shape[1], q.shape[2], k.shape[2]
    g = max(1, (256 << 20) // (4 * L * S * q.shape[0]))
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for h in range(0, heads, g):
        s = (q[:, h:h + g] * scale) @ k[:, h:h + g].transpose(-1, -2)
        out[:, h:h + g] = torch.softmax(s, dim=-1) @ v[:, h:h + g]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--ref", default="/tmp/sd3.5-ref")
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--img", type=int, default=4096)
    ap.add_argument("--txt", type=int, default=333)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not os.path.exists(os.path.join(a.ref, "mmditx.py")):
        raise SystemExit("torch_sd3_blocks: %s has no mmditx.py: extract Stability AI's sd3.5 code there "
                         "(see tests/golden/gen_sd3.py)" % a.ref)
    gen_sd3.install_stand_ins()
    torch.nn.functional.scaled_dot_product_attention = grouped_sdpa
    sys.path.insert(0, a.ref)
    import mmditx  # noqa: E402

    w = load_bf16(a.file, "joint_blocks.%d." % a.block)
    H = w["x_block.attn.qkv.weight"].shape[1]
    heads = H // 64
    blk = mmditx.JointBlock(H, heads, mlp_ratio=w["x_block.mlp.fc1.weight"].shape[0] / H, qkv_bias=True,
                            pre_only="context_block.mlp.fc1.weight" not in w,
                            qk_norm="rms" if "x_block.attn.ln_q.weight" in w else None,
                            x_block_self_attn="x_block.attn2.qkv.weight" in w, dtype=torch.float32)
    missing, unexpected = blk.load_state_dict(w, strict=True)
    torch.manual_seed(0)
    x = torch.randn(1, a.img, H)
    ctx = torch.randn(1, a.txt, H)
    c = torch.randn(1, H)
    times = []
    with torch.no_grad():
        for _ in range(a.repeat):
            t0 = time.time()
            blk(ctx, x, c=c)
            times.append(time.time() - t0)
    print("torch f32 joint block %d: best %.3f s, median %.3f s (%d image + %d context tokens, %d runs, %d threads)"
          % (a.block, min(times), statistics.median(times), a.img, a.txt, a.repeat, a.threads), flush=True)


if __name__ == "__main__":
    main()
