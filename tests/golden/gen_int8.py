#!/usr/bin/python3
"""Golden data for tests/test_int8.c: the W8A8 linear layer (kernels/cpu/gemm_int8.c)
reimplemented from its stated rule, in numpy.

Run from anywhere:  /usr/bin/python3 tests/golden/gen_int8.py
Writes tests/golden/int8/linear.safetensors (u64 LE header length, JSON header, raw data).

The rule (both operands, blocks of 32 along K): amax = max |v| of the block (float32),
d = amax / 127 (float32), q = rint(v * (127 / amax)) (float32 product, ties to even),
clipped to [-127, 127]; q = 0, d = 0 for an all-zero block. A q8_0 weight (ggml's block:
f16 d, 32 int8 q) keeps its own d and q. y[i, n] = sum_b d_a[i, b] d_w[n, b] S_b + bias[n],
S_b = sum over the block of q_a q_w (an exact integer); here in float64.

Per case <c>: "<c>.x" F32 [M, K]; "<c>.w16" F16 [N, K] (weights given as f16, quantized
by the kernel); "<c>.wq" U8 [N, K/32*34] (the same weights as q8_0 blocks, made here by
ggml's own rule: d = f16(amax / 127), q = round(v / d), ties away from zero); "<c>.b"
F32 [N]; "<c>.y16" / "<c>.yq" F32 [M, N] the expected outputs (computed in float64) for each weight form;
"<c>.mag16" / "<c>.magq" F32 [M, N]: sum_b |d_a d_w S_b| (the scale of the f32
summation's rounding); "<c>.yexact" F32 [M, N]: x w16^T + b computed in float64, no
quantization (the error the test bounds); "<c>.p" I64 [M, N, K]."""
import json
import os
import struct

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int8")
rng = np.random.default_rng(8)
# (name, M, N, K): edges (rows not a multiple of 4, columns not of 32), a zero block,
# and one outlier channel in x (the activations of DiTs have some)
CASES = [("edges", 37, 45, 96), ("square", 64, 64, 128), ("outlier", 8, 96, 160)]


def quant(v):
    """v float32 [..., K] -> q int32, d float32 [..., K/32] (the kernel's rule)"""
    b = v.reshape(*v.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(b).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((b * idv[..., None]).astype(np.float32)), -127, 127).astype(np.int64)
    return q, d


def q8_0(w):
    """ggml's quantize_row_q8_0_ref: d = f16(amax / 127), q = roundf(v * (1 / d))"""
    b = w.reshape(w.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(b).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    s = (b * idv[..., None]).astype(np.float32)
    q = np.clip(np.sign(s) * np.floor(np.abs(s) + 0.5), -128, 127).astype(np.int8)
    d16 = d.astype(np.float16)
    raw = np.zeros((w.shape[0], b.shape[1], 34), np.uint8)
    raw[:, :, 0:2] = d16.view(np.uint8).reshape(w.shape[0], b.shape[1], 2)
    raw[:, :, 2:] = q.view(np.uint8)
    return raw.reshape(w.shape[0], -1), q.astype(np.int64), d16.astype(np.float32)


def product(qa, da, qw, dw, bias):
    S = np.einsum("ibk,nbk->inb", qa, qw).astype(np.float64)
    t = da[:, None, :].astype(np.float64) * dw[None, :, :].astype(np.float64) * S
    return t.sum(-1) + bias[None, :].astype(np.float64), np.abs(t).sum(-1)


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for k, (dt, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    os.makedirs(OUT, exist_ok=True)
    t = {}
    for name, M, N, K in CASES:
        x = rng.standard_normal((M, K)).astype(np.float32)
        w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float16)
        bias = (rng.standard_normal(N) * 0.02).astype(np.float32)
        if name == "edges":
            x[3, 32:64] = 0  # an all-zero block
            w[5, :32] = 0
        if name == "outlier":
            x[:, 17] *= 40
        qa, da = quant(x)
        qw, dw = quant(w.astype(np.float32))
        y16, m16 = product(qa, da, qw, dw, bias)
        raw, qq, dq = q8_0(w.astype(np.float32))
        yq, mq = product(qa, da, qq.reshape(N, -1, 32), dq, bias)
        yexact = x.astype(np.float64) @ w.astype(np.float64).T + bias.astype(np.float64)
        t.update({name + ".x": ("F32", x), name + ".w16": ("F16", w), name + ".wq": ("U8", raw),
                  name + ".b": ("F32", bias), name + ".y16": ("F32", y16.astype(np.float32)), name + ".yq": ("F32", yq.astype(np.float32)),
                  name + ".mag16": ("F32", m16.astype(np.float32)), name + ".magq": ("F32", mq.astype(np.float32)), name + ".yexact": ("F32", yexact.astype(np.float32)),
                  name + ".p": ("I64", np.array([M, N, K], np.int64))})
        print("%s: M=%d N=%d K=%d, int8 vs exact max %.3e (of max |y| %.3e)" % (
            name, M, N, K, np.abs(y16 - yexact).max(), np.abs(yexact).max()))
    save(os.path.join(OUT, "linear.safetensors"), t)


if __name__ == "__main__":
    main()
