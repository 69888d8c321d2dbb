#!/usr/bin/python3
"""Golden data for tests/test_cpu_gemm_conv.c: gemm, batched gemm, linear and conv2d
computed by torch 1.13 (CPU).

Run from anywhere:  /usr/bin/python3 tests/golden/gen_gemm_conv.py
Writes tests/golden/ops/gemm_cases.safetensors and tests/golden/ops/conv_cases.safetensors
(written by hand: u64 LE header length, JSON header, raw little-endian data).

Inputs are rounded to f16 and stored as F16 (half the bytes); weights are stored in the
dtype the kernel is given (F16 for the f32 and f16 cases - the test widens the f32 ones -
and BF16 for the bf16 ones). Expected outputs are computed in float64 from exactly those
values and stored as F32, so the C tolerances measure our error alone.

Per case <c>: tensors "<c>.x", "<c>.w", "<c>.b" (optional), "<c>.y" and "<c>.p", an I64
parameter vector:
  gemm   p = [M, N, K, trans_a, trans_b, batch, stride_a, stride_b]  + "<c>.ab" = [alpha, beta],
         "<c>.c0" (the initial C when beta != 0); x = A, w = B
  linear p = [M, N, K, has_bias]
  conv   p = [n, c, h, w, k, r, s, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups]
The shapes are SD's (UNet 320/640/1280, VAE 128-512 channels) scaled down in channels
and space, plus the odd cases: sizes that are not multiples of 8, 1x1 images, batch 2,
depthwise and grouped, stride 2 on odd sizes, dilation 2, padding 0/1/2."""
import json
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(2)
torch.manual_seed(1234)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops")


def save(name, tensors):
    header, blobs, off = {}, [], 0
    for k, (dt, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"generator": "tests/golden/gen_gemm_conv.py", "torch": torch.__version__}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    path = os.path.join(OUT, name)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    print(f"{path}: {os.path.getsize(path)} bytes")


def rnd(*shape, scale=1.0):
    return torch.randn(*shape) * scale


def as_f16(t):
    """rounded to f16: (the F16 entry to store, the float64 tensor torch computes with)"""
    a = t.to(torch.float16)
    return ("F16", a.numpy().astype("<f2")), a.to(torch.float64)


def as_bf16(t):
    a = t.to(torch.bfloat16)
    raw = a.view(torch.int16).numpy().astype("<i2")
    return ("BF16", raw), a.to(torch.float64)


def f32(t):
    return ("F32", t.to(torch.float32).numpy().astype("<f4"))


def i64(v):
    return ("I64", np.array(v, dtype="<i8"))


# ---------------------------------------------------------------- gemm / linear

def gemm_cases(T):
    # name, M, N, K, trans_a, trans_b, alpha, beta, batch, broadcast_b
    cases = [
        ("g_nn", 37, 45, 29, 0, 0, 1.0, 0.0, 1, 0),
        ("g_tt", 37, 45, 29, 1, 1, 0.5, 2.0, 1, 0),
        ("g_nt", 64, 96, 128, 0, 1, 1.0, 1.0, 1, 0),
        ("g_tn", 13, 70, 33, 1, 0, -1.5, 0.25, 1, 0),
        ("g_1x1", 1, 1, 1, 0, 0, 1.0, 0.0, 1, 0),
        ("g_k1", 25, 40, 1, 0, 0, 1.0, 0.0, 1, 0),
        ("g_batch", 17, 19, 23, 0, 1, 1.0, 0.0, 3, 0),
        ("g_batch_bcast", 12, 33, 40, 0, 0, 2.0, 0.0, 4, 1),
    ]
    for name, M, N, K, ta, tb, alpha, beta, batch, bcast in cases:
        a_shape = (batch, K, M) if ta else (batch, M, K)
        b_shape = (1 if bcast else batch, N, K) if tb else (1 if bcast else batch, K, N)
        xa, a = as_f16(rnd(*a_shape))
        xb, b = as_f16(rnd(*b_shape))
        A = a.transpose(1, 2) if ta else a
        B = b.transpose(1, 2) if tb else b
        y = alpha * torch.matmul(A, B)
        ent = {"x": xa, "w": xb}
        if beta != 0.0:
            c0s, c0 = as_f16(rnd(batch, M, N))
            y = y + beta * c0
            ent["c0"] = c0s
        stride_a = M * K
        stride_b = 0 if bcast else N * K
        for k, v in ent.items():
            T[f"{name}.{k}"] = v
        T[f"{name}.y"] = f32(y)
        T[f"{name}.p"] = i64([M, N, K, ta, tb, batch, stride_a, stride_b])
        T[f"{name}.ab"] = f32(torch.tensor([alpha, beta]))
    return [c[0] for c in cases]


def linear_cases(T):
    # name, M, N, K, weight dtype, bias
    cases = [
        ("l_f16_clip", 77, 768, 64, "f16", True),     # CLIP-like odd M, many outputs
        ("l_f32", 33, 50, 70, "f32", True),
        ("l_f32_nobias", 64, 64, 64, "f32", False),
        ("l_bf16", 20, 40, 96, "bf16", False),
        ("l_bf16_bias", 9, 130, 45, "bf16", True),
        ("l_1x1", 1, 1, 1, "f16", True),
    ]
    for name, M, N, K, dt, has_b in cases:
        xs, x = as_f16(rnd(M, K))
        ws, w = (as_bf16 if dt == "bf16" else as_f16)(rnd(N, K, scale=K ** -0.5))
        y = x @ w.t()
        T[f"{name}.x"] = xs
        T[f"{name}.w"] = ws
        if has_b:
            bs, b = as_f16(rnd(N))
            y = y + b
            T[f"{name}.b"] = bs
        T[f"{name}.y"] = f32(y)
        T[f"{name}.p"] = i64([M, N, K, 1 if has_b else 0])
        T[f"{name}.dt"] = i64([{"f32": 0, "f16": 1, "bf16": 2}[dt]])
    return [c[0] for c in cases]


# ---------------------------------------------------------------- conv2d

def conv_cases(T):
    # name, (n, c, h, w), (k, r, s), stride, pad, dil, groups, weight dtype, bias
    cases = [
        # SD UNet 3x3 (320/640/1280 ch at 64/32/16/8) scaled: enough tiles for Winograd
        ("c_unet3x3", (1, 32, 24, 24), (32, 3, 3), (1, 1), (1, 1), (1, 1), 1, "f32", True),
        ("c_unet3x3_f16", (1, 24, 16, 16), (24, 3, 3), (1, 1), (1, 1), (1, 1), 1, "f16", True),
        ("c_unet3x3_small", (1, 48, 8, 8), (48, 3, 3), (1, 1), (1, 1), (1, 1), 1, "bf16", True),
        # 1x1 (UNet proj_in/out, skip convs), stride 1 pad 0: a plain GEMM
        ("c_unet1x1", (1, 64, 10, 10), (48, 1, 1), (1, 1), (0, 0), (1, 1), 1, "f32", True),
        ("c_unet1x1_bf16", (2, 24, 7, 9), (40, 1, 1), (1, 1), (0, 0), (1, 1), 1, "bf16", False),
        # UNet / VAE encoder downsample: 3x3 stride 2 pad 1, even and odd sizes
        ("c_down_even", (1, 16, 16, 16), (16, 3, 3), (2, 2), (1, 1), (1, 1), 1, "f16", True),
        ("c_down_odd", (1, 8, 9, 11), (8, 3, 3), (2, 2), (1, 1), (1, 1), 1, "f32", True),
        # VAE decoder 3x3 (512/256/128 ch) scaled, pad 0 Winograd on a wide image
        ("c_vae3x3", (1, 32, 12, 44), (32, 3, 3), (1, 1), (1, 1), (1, 1), 1, "f16", True),
        ("c_vae3x3_pad0", (1, 16, 18, 18), (16, 3, 3), (1, 1), (0, 0), (1, 1), 1, "f32", False),
        # VAE conv_in 4 -> 512 and conv_out 128 -> 3 (thin channel counts)
        ("c_vae_in", (1, 4, 12, 12), (40, 3, 3), (1, 1), (1, 1), (1, 1), 1, "f32", True),
        ("c_vae_out", (1, 40, 12, 12), (3, 3, 3), (1, 1), (1, 1), (1, 1), 1, "f16", True),
        # odd sizes, not multiples of 8
        ("c_odd", (1, 13, 11, 9), (7, 3, 3), (1, 1), (1, 1), (1, 1), 1, "f32", True),
        ("c_odd_wino", (1, 33, 15, 13), (35, 3, 3), (1, 1), (1, 1), (1, 1), 1, "f32", True),
        # 1x1 spatial
        ("c_1x1_image", (1, 5, 1, 1), (7, 3, 3), (1, 1), (1, 1), (1, 1), 1, "f32", True),
        ("c_1x1_image_k1", (2, 6, 1, 1), (4, 1, 1), (1, 1), (0, 0), (1, 1), 1, "f16", False),
        # batch 2
        ("c_batch2", (2, 16, 9, 9), (24, 3, 3), (1, 1), (1, 1), (1, 1), 1, "f32", True),
        ("c_batch2_wino", (2, 24, 13, 11), (24, 3, 3), (1, 1), (1, 1), (1, 1), 1, "f16", True),
        # depthwise and grouped
        ("c_depthwise", (1, 16, 10, 10), (16, 3, 3), (1, 1), (1, 1), (1, 1), 16, "f32", True),
        ("c_depthwise_s2", (2, 6, 9, 8), (12, 3, 3), (2, 2), (1, 1), (1, 1), 6, "bf16", False),
        ("c_groups2", (1, 8, 7, 7), (12, 3, 3), (1, 1), (1, 1), (1, 1), 2, "f32", True),
        # dilation 2, padding 0 / 2, a 5x5 and a non-square kernel
        ("c_dil2", (1, 6, 12, 12), (6, 3, 3), (1, 1), (2, 2), (2, 2), 1, "f32", True),
        ("c_pad0", (1, 5, 8, 8), (4, 3, 3), (1, 1), (0, 0), (1, 1), 1, "f16", True),
        ("c_5x5_pad2", (1, 4, 9, 10), (6, 5, 5), (1, 1), (2, 2), (1, 1), 1, "f32", False),
        ("c_rect", (1, 3, 17, 19), (5, 5, 3), (2, 1), (2, 0), (1, 3), 1, "f32", True),
    ]
    for name, (n, c, h, w), (k, r, s), st, pd, dl, g, dt, has_b in cases:
        xs, x = as_f16(rnd(n, c, h, w))
        ws, wt = (as_bf16 if dt == "bf16" else as_f16)(rnd(k, c // g, r, s, scale=(c // g * r * s) ** -0.5))
        bias = None
        T[f"{name}.x"] = xs
        T[f"{name}.w"] = ws
        if has_b:
            bs, bias = as_f16(rnd(k))
            T[f"{name}.b"] = bs
        y = F.conv2d(x, wt, bias, stride=st, padding=pd, dilation=dl, groups=g)
        T[f"{name}.y"] = f32(y)
        T[f"{name}.p"] = i64([n, c, h, w, k, r, s, st[0], st[1], pd[0], pd[1], dl[0], dl[1], g])
        T[f"{name}.dt"] = i64([{"f32": 0, "f16": 1, "bf16": 2}[dt]])
    return [c[0] for c in cases]


def main():
    os.makedirs(OUT, exist_ok=True)
    T = {}
    g = gemm_cases(T)
    l = linear_cases(T)
    T["cases.gemm"] = ("U8", np.frombuffer(",".join(g).encode(), dtype=np.uint8))
    T["cases.linear"] = ("U8", np.frombuffer(",".join(l).encode(), dtype=np.uint8))
    save("gemm_cases.safetensors", T)
    T = {}
    c = conv_cases(T)
    T["cases.conv"] = ("U8", np.frombuffer(",".join(c).encode(), dtype=np.uint8))
    save("conv_cases.safetensors", T)


if __name__ == "__main__":
    main()
