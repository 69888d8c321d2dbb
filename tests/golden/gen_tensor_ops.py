#!/usr/bin/python3
"""Golden data for the tensor core's elementwise ops, broadcasting and reductions.

Run from the repository root:  /usr/bin/python3 tests/golden/gen_tensor_ops.py
Writes tests/golden/tensor_ops.safetensors (inputs and PyTorch's results), read by
tests/lua/tensor_ops_test.lua. The file is written by hand per the safetensors
spec (8-byte little-endian header length, JSON header, raw data)."""
import json, struct
import torch

torch.set_num_threads(2)
torch.manual_seed(1234)

def save(path, tensors):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        t = t.contiguous()
        dt = {torch.float32: "F32", torch.int64: "I64", torch.float16: "F16"}[t.dtype]
        raw = t.numpy().tobytes()
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw); off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h)
        for b in blobs: f.write(b)

a = torch.randn(2, 3, 4)
b = torch.randn(3, 1)
c = torch.randn(4)
pos = torch.rand(2, 3, 4) + 0.1
out = {"a": a, "b": b, "c": c, "pos": pos}
out["add_ab"] = a + b
out["sub_ab"] = a - b
out["mul_ac"] = a * c
out["div_ab"] = a / b
out["pow_pos_c"] = pos ** c
out["add_s"] = a + 2.5
out["rsub_s"] = 2.5 - a
out["rdiv_s"] = 2.0 / pos
out["pow_s"] = pos ** 1.7
out["neg"] = -a
out["exp"] = a.exp()
out["log"] = pos.log()
out["sqrt"] = pos.sqrt()
out["abs"] = a.abs()
out["tanh"] = a.tanh()
out["sigmoid"] = a.sigmoid()
out["clamp"] = a.clamp(-0.5, 0.7)
out["minimum_ab"] = torch.minimum(a, b)
out["maximum_ac"] = torch.maximum(a, c)
for d in range(3):
    out[f"sum_d{d+1}"] = a.sum(d)
    out[f"mean_d{d+1}"] = a.mean(d)
    out[f"max_d{d+1}"] = a.max(d).values
    out[f"min_d{d+1}"] = a.min(d).values
    out[f"var_d{d+1}"] = a.var(d)
out["sum_all"] = a.sum().reshape(1)
out["var_all"] = a.var().reshape(1)
out["matmul"] = torch.randn(2, 5, 3)
out["matmul_b"] = torch.randn(3, 4)
out["matmul_out"] = out["matmul"] @ out["matmul_b"]
out["permute_021"] = a.permute(0, 2, 1).contiguous()
out["softmax_d2"] = torch.softmax(a, 1)
out["cat_d2"] = torch.cat([a, a * 2], 1)
save("tests/golden/tensor_ops.safetensors", out)
print("wrote tests/golden/tensor_ops.safetensors with", len(out), "tensors")
