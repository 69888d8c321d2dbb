#!/usr/bin/python3
"""PyTorch side of tests/bench/bench_nn.c: times the same ops at the same shapes.

Usage: /usr/bin/python3 tests/bench/torch_nn.py THREADS [CASE ...]
Prints one JSON object per line: {"case": name, "sec": best time of one call}.
Attention is what diffusers runs on a torch 1.13 CPU (AttnProcessor):
baddbmm(q, k^T) * scale -> softmax -> bmm(p, v), which holds a B x Lq x Lk matrix.
Timing: one warm-up call, then repeats until 1 s (at least 3); the minimum is kept,
the same rule as bench_nn.c."""
import json
import sys
import time

import torch
import torch.nn.functional as F


def best(fn):
    fn()
    times, t_end = [], time.perf_counter() + 1.0
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 50):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def attention(B, Lq, Lk, D):
    q, k, v = torch.randn(B, Lq, D), torch.randn(B, Lk, D), torch.randn(B, Lk, D)
    scale = D ** -0.5

    def run():
        s = torch.baddbmm(torch.empty(B, Lq, Lk), q, k.transpose(1, 2), beta=0, alpha=scale)
        return torch.bmm(s.softmax(-1), v)
    return run


def group_norm(N, C, HW, silu):
    x, w, b = torch.randn(N, C, HW), torch.randn(C), torch.randn(C)
    return (lambda: F.silu(F.group_norm(x, 32, w, b, 1e-6))) if silu else (lambda: F.group_norm(x, 32, w, b, 1e-6))


def layer_norm(rows, D):
    x, w, b = torch.randn(rows, D), torch.randn(D), torch.randn(D)
    return lambda: F.layer_norm(x, (D,), w, b, 1e-5)


def pointwise(fn, n):
    x = torch.randn(n)
    return lambda: fn(x)


CASES = {
    "attn_4096_d40": lambda: attention(16, 4096, 4096, 40),
    "attn_1024_d80": lambda: attention(16, 1024, 1024, 80),
    "xattn_4096x77_d40": lambda: attention(16, 4096, 77, 40),
    "gn_silu_2x320x64x64": lambda: group_norm(2, 320, 64 * 64, True),
    "gn_1x128x512x512": lambda: group_norm(1, 128, 512 * 512, False),
    "ln_4096x320": lambda: layer_norm(4096, 320),
    "gelu_10M": lambda: pointwise(F.gelu, 10_000_000),
    "silu_10M": lambda: pointwise(F.silu, 10_000_000),
}

if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    for name in sys.argv[2:] or list(CASES):
        if name in CASES:
            print(json.dumps({"case": name, "sec": best(CASES[name]())}), flush=True)
