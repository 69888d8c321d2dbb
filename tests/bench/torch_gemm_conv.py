#!/usr/bin/python3
"""PyTorch side of tests/bench/bench_gemm_conv.c: times the same GEMMs and convolutions
at the same shapes (Stable Diffusion 1.5, 512x512 image -> 64x64 latent, batch 1).

Usage: /usr/bin/python3 tests/bench/torch_gemm_conv.py THREADS [CASE ...]
Prints one JSON object per line: {"case": name, "sec": best time of one call}.
Case names are the C bench's: gemm_MxNxK (x[M,K] . W[N,K]^T, F.linear),
gemmnt_MxNxK (A[M,K] . B[N,K]^T, torch.mm), conv_CinxCout_kRxR_HxW (F.conv2d, stride 1,
padding R/2, bias). Timing: one warm-up call, then repeats until 1 s (at least 3, at
most 50); the minimum is kept, the same rule as bench_gemm_conv.c."""
import json
import re
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


def make(case):
    m = re.fullmatch(r"gemm_(\d+)x(\d+)x(\d+)", case)
    if m:
        M, N, K = map(int, m.groups())
        x, w = torch.randn(M, K), torch.randn(N, K)
        return lambda: F.linear(x, w)
    m = re.fullmatch(r"gemmnt_(\d+)x(\d+)x(\d+)", case)
    if m:
        M, N, K = map(int, m.groups())
        a, b = torch.randn(M, K), torch.randn(N, K)
        return lambda: torch.mm(a, b.t())
    m = re.fullmatch(r"conv_(\d+)x(\d+)_k(\d+)_(\d+)x(\d+)", case)
    if m:
        C, K, R, H, W = map(int, m.groups())
        x, w, b = torch.randn(1, C, H, W), torch.randn(K, C, R, R) * (C * R * R) ** -0.5, torch.randn(K)
        return lambda: F.conv2d(x, w, b, padding=R // 2)
    return None


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(int(sys.argv[1]))
    with torch.no_grad():
        for case in sys.argv[2:]:
            fn = make(case)
            if fn is None:
                print(json.dumps({"case": case, "error": "unknown case"}), flush=True)
                continue
            print(json.dumps({"case": case, "sec": best(fn)}), flush=True)


if __name__ == "__main__":
    main()
