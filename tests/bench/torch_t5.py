#!/usr/bin/python3
"""PyTorch side of tests/bench/bench_t5.lua: T5 v1.1's encoder in f32 on the weights of
a file bench_t5.lua wrote, timed on the CPU.

Usage: /usr/bin/python3 tests/bench/torch_t5.py WEIGHTS IDS [options]
  WEIGHTS  a .safetensors file in ComfyUI's names (F32 / F16 / BF16 / F8_E4M3, with
           scale_weight where present) or a GGUF file in llama.cpp's names (F32, F16,
           Q8_0); every tensor is dequantised to f32 once, before timing
  IDS      a .safetensors file with "ids" (I64 [B, n])
  --heads H            default 64 (T5-XXL)
  --repeat N           timed runs (the best is reported), default 1
  --warmup N           untimed runs before them, default 0
  --threads N          torch.set_num_threads, default 2
  --out PATH           save the output (safetensors, key "out", f32)
Prints one JSON line: {"sec" (best), "times", "peak_rss" (bytes, ru_maxrss: weights in
f32 + the forward), "load_sec"}.

The network is written from T5 v1.1's definition as tests/golden/gen_t5.py's reference
(RMS norm, unscaled attention plus the first block's relative position bias, gated
GELU-tanh feed-forward), with explicit softmax(q k^T + bias) attention."""
import json
import math
import os
import resource
import struct
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "golden"))
import gen_gguf  # noqa: E402  (the q8_0 decoder and fp8 code table)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    base = 8 + n
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        raw = mm[base + a:base + b]
        dt, shape = v["dtype"], v["shape"]
        if dt == "F32":
            x = raw.view("<f4").astype(np.float32)
        elif dt == "F16":
            x = raw.view("<f2").astype(np.float32)
        elif dt == "BF16":
            x = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        elif dt == "F8_E4M3":
            x = gen_gguf.E4M3.astype(np.float32)[np.asarray(raw)]
        elif dt == "I64":
            x = raw.view("<i8").copy()
        else:
            raise SystemExit("%s: tensor %s has dtype %s" % (path, k, dt))
        out[k] = x.reshape(shape)
    return out


def read_gguf(path):
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    pos = [0]

    def take(fmt):
        s = struct.calcsize(fmt)
        v = struct.unpack(fmt, mm[pos[0]:pos[0] + s].tobytes())
        pos[0] += s
        return v

    def string():
        n, = take("<Q")
        s = mm[pos[0]:pos[0] + n].tobytes().decode()
        pos[0] += n
        return s

    sizes = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("<IQ")
            return [value(et) for _ in range(n)]
        return take(sizes[t])[0]

    magic, version, nt, nkv = take("<4sIQQ")
    meta = {}
    for _ in range(nkv):
        k = string()
        t, = take("<I")
        meta[k] = value(t)
    infos = []
    for _ in range(nt):
        name = string()
        nd, = take("<I")
        ne = take("<%dQ" % nd)
        t, off = take("<IQ")
        infos.append((name, list(ne), t, off))
    align = int(meta.get("general.alignment", 32))
    base = (pos[0] + align - 1) // align * align
    out = {}
    for name, ne, t, off in infos:
        n = int(np.prod(ne))
        shape = list(reversed(ne))
        if t == 0:
            x = mm[base + off:base + off + 4 * n].view("<f4").astype(np.float32)
        elif t == 1:
            x = mm[base + off:base + off + 2 * n].view("<f2").astype(np.float32)
        elif t == 8:
            x = gen_gguf.dec_q8_0(mm[base + off:base + off + n // 32 * 34].tobytes())
        else:
            raise SystemExit("%s: tensor %s has ggml type %d (f32, f16, q8_0 read here)" % (path, name, t))
        out[name] = x.reshape(shape)
    return out


GGUF = {"attn_q": "0.SelfAttention.q", "attn_k": "0.SelfAttention.k", "attn_v": "0.SelfAttention.v",
        "attn_o": "0.SelfAttention.o", "attn_rel_b": "0.SelfAttention.relative_attention_bias",
        "attn_norm": "0.layer_norm", "ffn_norm": "1.layer_norm", "ffn_gate": "1.DenseReluDense.wi_0",
        "ffn_up": "1.DenseReluDense.wi_1", "ffn_down": "1.DenseReluDense.wo"}


def canonical(raw):
    """file names -> transformers' names without "encoder.", scale_weight applied"""
    W = {}
    for k, v in raw.items():
        if k.startswith("enc.blk."):
            i, rest = k[len("enc.blk."):].split(".", 1)
            t, suffix = rest.split(".", 1)
            W["block.%s.layer.%s.%s" % (i, GGUF[t], suffix)] = v
        elif k == "token_embd.weight":
            W["shared.weight"] = v
        elif k == "enc.output_norm.weight":
            W["final_layer_norm.weight"] = v
        elif k.startswith("encoder."):
            W[k[len("encoder."):]] = v
        elif k == "shared.weight":
            W[k] = v
    for k in list(W):
        if k.endswith(".scale_weight"):
            w = k[:-len("scale_weight")] + "weight"
            W[w] = W[w] * np.float32(W.pop(k).reshape(-1)[0])
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in W.items()
            if not k.endswith("scale_input")}


def bucket(rel, num_buckets=32, max_distance=128):
    num_buckets //= 2
    ret = (rel > 0).to(torch.long) * num_buckets
    n = torch.abs(rel)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return ret + torch.where(n < max_exact, n, large)


def rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def encode(W, ids, H):
    B, n = ids.shape
    blocks = 1 + max(int(k.split(".")[1]) for k in W if k.startswith("block."))
    x = W["shared.weight"][ids]
    pos = torch.arange(n)
    bias = W["block.0.layer.0.SelfAttention.relative_attention_bias.weight"][bucket(pos[None, :] - pos[:, None])]
    bias = bias.permute(2, 0, 1)[None]
    inner = W["block.0.layer.0.SelfAttention.q.weight"].shape[0]
    dk = inner // H
    for i in range(blocks):
        p = "block.%d.layer." % i
        h = rms(x, W[p + "0.layer_norm.weight"])
        q, k, v = (torch.nn.functional.linear(h, W[p + "0.SelfAttention.%s.weight" % t]).view(B, n, H, dk)
                   .transpose(1, 2) for t in "qkv")
        a = torch.softmax(torch.matmul(q, k.transpose(2, 3)) + bias, dim=-1)
        o = torch.matmul(a, v).transpose(1, 2).reshape(B, n, inner)
        x = x + torch.nn.functional.linear(o, W[p + "0.SelfAttention.o.weight"])
        h = rms(x, W[p + "1.layer_norm.weight"])
        f = torch.nn.functional.gelu(torch.nn.functional.linear(h, W[p + "1.DenseReluDense.wi_0.weight"]),
                                     approximate="tanh") * \
            torch.nn.functional.linear(h, W[p + "1.DenseReluDense.wi_1.weight"])
        x = x + torch.nn.functional.linear(f, W[p + "1.DenseReluDense.wo.weight"])
    return rms(x, W["final_layer_norm.weight"])


def main():
    args = sys.argv[1:]
    if len(args) < 2:
        raise SystemExit(__doc__)
    path, ids_path = args[0], args[1]
    opt = {"--heads": 64, "--repeat": 1, "--warmup": 0, "--threads": 2, "--out": None}
    i = 2
    while i < len(args):
        opt[args[i]] = args[i + 1] if args[i] == "--out" else int(args[i + 1])
        i += 2
    torch.set_num_threads(opt["--threads"])
    t0 = time.time()
    with open(path, "rb") as f:
        magic = f.read(4)
    W = canonical(read_gguf(path) if magic == b"GGUF" else read_safetensors(path))
    ids = torch.from_numpy(read_safetensors(ids_path)["ids"])
    load = time.time() - t0
    with torch.no_grad():
        for _ in range(opt["--warmup"]):
            encode(W, ids, opt["--heads"])
        times = []
        for _ in range(opt["--repeat"]):
            t = time.time()
            y = encode(W, ids, opt["--heads"])
            times.append(time.time() - t)
    if opt["--out"]:
        b = y.numpy().astype(np.float32).tobytes()
        h = json.dumps({"out": {"dtype": "F32", "shape": list(y.shape), "data_offsets": [0, len(b)]}}).encode()
        h += b" " * (-len(h) % 8)
        with open(opt["--out"], "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + b)
    print(json.dumps({"sec": min(times), "times": times, "load_sec": load,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


if __name__ == "__main__":
    main()
