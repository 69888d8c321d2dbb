#!/usr/bin/python3
"""Golden data for tests/test_int8.c: the W8A8 linear layer (kernels/cpu/gemm_int8.c)
reimplemented from its stated rule, in numpy.

Run from anywhere:  /usr/bin/python3 tests/golden/gen_int8.py
Writes tests/golden/int8/linear.safetensors (u64 LE header length, JSON header, raw data).

The rule (both operands, groups of G along K, G = the kernel's group length: GROUP, or
all of K rounded up to 4 when that is shorter; the last group takes what is left): amax =
max |v| of the group (float32), d = amax / 127 (float32), q = rint(v * (127 / amax))
(float32 product, ties to even), clipped to [-127, 127]; q = 0, d = 0 for an all-zero
group. A q8_0 weight (ggml's block: f16 d, 32 int8 q) is first dequantized (f32 d q) and
then quantized by the same rule. y[i, n] = sum_g d_a[i, g] d_w[n, g] S_g + bias[n], S_g =
sum over the group of q_a q_w (an exact integer); here in float64.

Per case <c>: "<c>.x" F32 [M, K]; "<c>.w16" F16 [N, K] (weights given as f16, quantized
by the kernel); "<c>.wq" U8 [N, K/32*34] (the same weights as q8_0 blocks, made here by
ggml's own rule: d = f16(amax / 127), q = round(v / d), ties away from zero; only where
K is a multiple of 32); "<c>.b" F32 [N]; "<c>.y16" / "<c>.yq" F32 [M, N] the expected
outputs (computed in float64) for each weight form; "<c>.mag16" / "<c>.magq" F32 [M, N]:
sum_g |d_a d_w S_g| (the scale of the f32 summation's rounding); "<c>.yexact" /
"<c>.yqexact" F32 [M, N]: x w^T + b in float64 without quantization, for the f16 weights
and for the q8_0 weights' dequantized values (the errors the test bounds); "<c>.p" I64
[M, N, K, G]."""
import json
import os
import struct

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int8")
rng = np.random.default_rng(8)
GROUP = 256  # the kernel's group length (gemm_int8.c's GROUP): 0 = all of K
# (name, M, N, K): edges (rows not a multiple of 4, columns not of 32), a zero group,
# one outlier channel in x (the activations of DiTs have some), K not a multiple of 4
# (f16 weights only), and a K of several groups when GROUP is set
CASES = [("edges", 37, 45, 96), ("square", 64, 64, 128), ("outlier", 8, 96, 160), ("oddk", 13, 40, 75),
         ("long", 9, 33, 608)]


def group_len(K):
    Kp = (K + 3) // 4 * 4
    return min(Kp, GROUP) if GROUP else Kp


def quant(v, G):
    """v float32 [R, K] -> q int64 [R, ng, G], d float32 [R, ng] (the kernel's rule), the
    last group padded with zeros"""
    R, K = v.shape
    ng = -(-K // G)
    b = np.zeros((R, ng * G), np.float32)
    b[:, :K] = v
    b = b.reshape(R, ng, G)
    amax = np.abs(b).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((b * idv[..., None]).astype(np.float32)), -127, 127).astype(np.int64)
    return q, d


def q8_0(w):
    """ggml's quantize_row_q8_0_ref: d = f16(amax / 127), q = roundf(v * (1 / d)); the
    blocks and their dequantized values (f32 d q)"""
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
    deq = (d16.astype(np.float32)[..., None] * q.astype(np.float32)).astype(np.float32)
    return raw.reshape(w.shape[0], -1), deq.reshape(w.shape[0], -1)


def product(qa, da, qw, dw, bias):
    S = np.einsum("igk,ngk->ing", qa, qw).astype(np.float64)
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
        G = group_len(K)
        x = rng.standard_normal((M, K)).astype(np.float32)
        w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float16)
        bias = (rng.standard_normal(N) * 0.02).astype(np.float32)
        if name == "edges":
            x[3, :] = 0  # an all-zero group (a row: the groups may be all of K)
            w[5, :] = 0
        if name == "outlier":
            x[:, 17] *= 40
        qa, da = quant(x, G)
        qw, dw = quant(w.astype(np.float32), G)
        y16, m16 = product(qa, da, qw, dw, bias)
        yexact = x.astype(np.float64) @ w.astype(np.float64).T + bias.astype(np.float64)
        t.update({name + ".x": ("F32", x), name + ".w16": ("F16", w), name + ".b": ("F32", bias),
                  name + ".y16": ("F32", y16.astype(np.float32)), name + ".mag16": ("F32", m16.astype(np.float32)),
                  name + ".yexact": ("F32", yexact.astype(np.float32)),
                  name + ".p": ("I64", np.array([M, N, K, G], np.int64))})
        line = "%s: M=%d N=%d K=%d G=%d, int8 vs exact max %.3e (of max |y| %.3e)" % (
            name, M, N, K, G, np.abs(y16 - yexact).max(), np.abs(yexact).max())
        if K % 32 == 0:
            raw, deq = q8_0(w.astype(np.float32))
            qq, dq = quant(deq, G)
            yq, mq = product(qa, da, qq, dq, bias)
            yqexact = x.astype(np.float64) @ deq.astype(np.float64).T + bias.astype(np.float64)
            t.update({name + ".wq": ("U8", raw), name + ".yq": ("F32", yq.astype(np.float32)),
                      name + ".magq": ("F32", mq.astype(np.float32)),
                      name + ".yqexact": ("F32", yqexact.astype(np.float32))})
            line += "; q8_0 requantized vs its own values %.3e" % np.abs(yq - yqexact).max()
        print(line)
    save(os.path.join(OUT, "linear.safetensors"), t)


if __name__ == "__main__":
    main()
