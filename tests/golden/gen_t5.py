#!/usr/bin/python3
"""Golden data for kiln.t5 (tests/lua/test_t5.lua): a tiny T5 v1.1 encoder with random
weights, written in every file layout kiln reads, and the outputs of an independent
PyTorch implementation of T5 v1.1's encoder written here from the published definition
(Raffel et al. 2020; transformers' T5EncoderModel as the reference for its details):
token embedding, per block an RMS layer norm without mean (T5LayerNorm, eps 1e-6),
self-attention without biases and without the 1/sqrt(d) scaling of q.k plus a relative
position bias (32 buckets, max distance 128, bidirectional) that only the first block
holds and every block adds, a gated-GELU feed-forward (gelu_new(wi_0 x) * wi_1 x, then
wo), residuals, the final RMS norm. The reference runs in float64.

Config: d_model 32, 4 heads of d_kv 16 (inner 64 != d_model), d_ff 96, vocab 100,
3 blocks. The master weights are f16-representable so the f16 and f32 files hold the
same values. Writes under tests/golden/t5/:
- comfy.safetensors       ComfyUI's t5xxl_fp16 names (encoder.block.N..., shared.weight), f16
- bare.safetensors        the same without the encoder. prefix, heads in __metadata__ (num_heads)
- wrapped.safetensors     under text_encoders.t5xxl.transformer., only encoder.embed_tokens
- diffusers/text_encoder_2/  config.json, model.safetensors.index.json, two shards
- fp8.safetensors         t5xxl_fp8_e4m3fn: linear weights and the embedding in F8_E4M3
- fp8_scaled.safetensors  the _scaled variant: weight / scale_weight in F8_E4M3, scale_weight
                          (0-d f32) per linear weight, the scaled_fp8 marker key
- q8_0.gguf               llama.cpp's T5 names (token_embd, enc.blk.N.attn_q, ...), q8_0
                          where rows allow, general.architecture t5encoder
- expected.safetensors    ids.<case> (i64) and out.<variant>.<case> (f32) for the cases one
                          [1,1], short [1,7], batch [2,12], long [1,200] (relative distances
                          past max_distance), variants ref (f16 master), fp8, fp8s, q8_0 (each
                          from its own dequantised weights); buckets: the bucket of every
                          relative position -400..400 as transformers computes it (float32 log)
Rerun: /usr/bin/python3 tests/golden/gen_t5.py (from the repository root).
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_gguf  # noqa: E402  (its GGUF writer, q8_0 and fp8 codecs)

torch.set_num_threads(2)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "t5")
D, H, DKV, FF, VOCAB, NB = 32, 4, 16, 96, 100, 3
INNER = H * DKV
BUCKETS, MAXDIST = 32, 128


# ---------------------------------------------------------------- reference T5 v1.1 encoder

def bucket(rel, num_buckets=BUCKETS, max_distance=MAXDIST):
    """transformers' T5Attention._relative_position_bucket, bidirectional"""
    num_buckets //= 2
    ret = (rel > 0).to(torch.long) * num_buckets
    n = torch.abs(rel)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return ret + torch.where(is_small, n, large)


def rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def encode(W, ids):
    """W: canonical name -> float64 tensor; ids [B, n] -> last hidden state [B, n, D]"""
    B, n = ids.shape
    x = W["shared.weight"][ids]
    pos = torch.arange(n)
    rel = pos[None, :] - pos[:, None]  # memory - query
    bias = W["block.0.layer.0.SelfAttention.relative_attention_bias.weight"][bucket(rel)]  # [n, n, H]
    bias = bias.permute(2, 0, 1)[None]
    for i in range(NB):
        p = "block.%d.layer." % i
        h = rms(x, W[p + "0.layer_norm.weight"])
        q, k, v = (torch.matmul(h, W[p + "0.SelfAttention.%s.weight" % t].T).view(B, n, H, DKV).transpose(1, 2)
                   for t in "qkv")
        s = torch.matmul(q, k.transpose(2, 3)) + bias
        a = torch.matmul(torch.softmax(s, dim=-1), v).transpose(1, 2).reshape(B, n, INNER)
        x = x + torch.matmul(a, W[p + "0.SelfAttention.o.weight"].T)
        h = rms(x, W[p + "1.layer_norm.weight"])
        f = gelu_new(torch.matmul(h, W[p + "1.DenseReluDense.wi_0.weight"].T)) * \
            torch.matmul(h, W[p + "1.DenseReluDense.wi_1.weight"].T)
        x = x + torch.matmul(f, W[p + "1.DenseReluDense.wo.weight"].T)
    return rms(x, W["final_layer_norm.weight"])


# ---------------------------------------------------------------- weights

def shapes():
    s = {"shared.weight": (VOCAB, D), "final_layer_norm.weight": (D,)}
    for i in range(NB):
        p = "block.%d.layer." % i
        for t in "qkv":
            s[p + "0.SelfAttention.%s.weight" % t] = (INNER, D)
        s[p + "0.SelfAttention.o.weight"] = (D, INNER)
        s[p + "0.layer_norm.weight"] = (D,)
        s[p + "1.DenseReluDense.wi_0.weight"] = (FF, D)
        s[p + "1.DenseReluDense.wi_1.weight"] = (FF, D)
        s[p + "1.DenseReluDense.wo.weight"] = (D, FF)
        s[p + "1.layer_norm.weight"] = (D,)
    s["block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (BUCKETS, H)
    return s


def master(rng):
    W = {}
    for name, shp in shapes().items():
        if name.endswith("layer_norm.weight"):
            a = 1.0 + 0.2 * rng.standard_normal(shp)
        elif "relative_attention_bias" in name:
            a = 0.7 * rng.standard_normal(shp)
        elif name == "shared.weight":
            a = rng.standard_normal(shp)
        elif name.endswith(("q.weight", "k.weight")):
            # attention logits of a few units: a softmax that does not saturate keeps
            # the outputs' sensitivity to rounding low
            a = rng.standard_normal(shp) / math.sqrt(shp[1]) * 0.5
        else:
            a = rng.standard_normal(shp) / math.sqrt(shp[1]) * 1.3
        W[name] = a.astype(np.float16).astype(np.float32)
    return W


def is_linear(name):
    return name.endswith(("SelfAttention.q.weight", "SelfAttention.k.weight", "SelfAttention.v.weight",
                          "SelfAttention.o.weight", "wi_0.weight", "wi_1.weight", "wo.weight"))


# ---------------------------------------------------------------- writers

ST_NAMES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "F8_E4M3": np.uint8}


def safetensors(path, arrays, meta=None):
    """arrays: name -> (numpy array, safetensors dtype)"""
    header, blobs, off = {}, [], 0
    for k in sorted(arrays):
        a, dt = arrays[k]
        b = np.ascontiguousarray(a.astype(ST_NAMES[dt])).tobytes()
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = dict({"generator": "tests/golden/gen_t5.py"}, **(meta or {}))
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    print(path, os.path.getsize(path), "bytes")


def f16(W, rename):
    return {rename(k): (v, "F16") for k, v in W.items()}


def fp8_codes(x):
    return gen_gguf.fp8_encode(x.reshape(-1), gen_gguf.E4M3, 0x7E).reshape(x.shape)


def fp8_value(codes):
    return gen_gguf.E4M3[codes.reshape(-1)].reshape(codes.shape).astype(np.float32)


GGUF_NAMES = {
    "0.SelfAttention.q.weight": "attn_q.weight", "0.SelfAttention.k.weight": "attn_k.weight",
    "0.SelfAttention.v.weight": "attn_v.weight", "0.SelfAttention.o.weight": "attn_o.weight",
    "0.SelfAttention.relative_attention_bias.weight": "attn_rel_b.weight",
    "0.layer_norm.weight": "attn_norm.weight", "1.layer_norm.weight": "ffn_norm.weight",
    "1.DenseReluDense.wi_0.weight": "ffn_gate.weight", "1.DenseReluDense.wi_1.weight": "ffn_up.weight",
    "1.DenseReluDense.wo.weight": "ffn_down.weight",
}


def gguf_name(k):
    if k == "shared.weight":
        return "token_embd.weight"
    if k == "final_layer_norm.weight":
        return "enc.output_norm.weight"
    i, rest = k[len("block."):].split(".layer.", 1)
    return "enc.blk.%s.%s" % (i, GGUF_NAMES[rest])


def main():
    rng = np.random.default_rng(38)
    W = master(rng)
    enc = lambda k: "encoder." + k if k != "shared.weight" else k  # noqa: E731
    safetensors(os.path.join(OUT, "comfy.safetensors"), f16(W, enc))
    safetensors(os.path.join(OUT, "bare.safetensors"), f16(W, lambda k: k), {"num_heads": str(H)})
    wrap = "text_encoders.t5xxl.transformer."
    safetensors(os.path.join(OUT, "wrapped.safetensors"),
                f16(W, lambda k: wrap + ("encoder.embed_tokens.weight" if k == "shared.weight" else "encoder." + k)))
    # diffusers: two shards, an index naming them, transformers' config
    dd = os.path.join(OUT, "diffusers", "text_encoder_2")
    names = sorted(enc(k) for k in W)
    shard = {n: ("model-00001-of-00002.safetensors" if i % 2 == 0 else "model-00002-of-00002.safetensors")
             for i, n in enumerate(names)}
    byname = {enc(k): v for k, v in W.items()}
    for s in sorted(set(shard.values())):
        safetensors(os.path.join(dd, s), {n: (byname[n], "F16") for n in names if shard[n] == s})
    with open(os.path.join(dd, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": shard}, f, indent=1)
    with open(os.path.join(dd, "config.json"), "w") as f:
        json.dump({"architectures": ["T5EncoderModel"], "model_type": "t5", "d_model": D, "d_kv": DKV,
                   "d_ff": FF, "num_heads": H, "num_layers": NB, "vocab_size": VOCAB,
                   "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6,
                   "relative_attention_num_buckets": BUCKETS, "relative_attention_max_distance": MAXDIST}, f, indent=1)
    # fp8: the linear weights and the embedding as E4M3 codes
    W8, arrays = {}, {}
    for k, v in W.items():
        if is_linear(k) or k == "shared.weight":
            c = fp8_codes(v)
            W8[k] = fp8_value(c)
            arrays[enc(k)] = (c, "F8_E4M3")
        else:
            W8[k] = v
            arrays[enc(k)] = (v, "F16")
    safetensors(os.path.join(OUT, "fp8.safetensors"), arrays)
    # fp8 scaled (ComfyUI's scaled_fp8_ops): weight = code value * scale_weight
    W8s, arrays = {}, {}
    for k, v in W.items():
        if is_linear(k):
            s = np.float32(np.abs(v).max() / 448.0)
            c = fp8_codes(v / s)
            W8s[k] = (fp8_value(c) * s).astype(np.float32)
            arrays[enc(k)] = (c, "F8_E4M3")
            arrays[enc(k)[:-len("weight")] + "scale_weight"] = (np.array(s, dtype=np.float32), "F32")
        else:
            W8s[k] = v
            arrays[enc(k)] = (v, "F16")
    arrays["scaled_fp8"] = (np.zeros((0,), dtype=np.uint8), "F8_E4M3")
    safetensors(os.path.join(OUT, "fp8_scaled.safetensors"), arrays)
    # GGUF q8_0 (rows of 32): ggml's ne is the reversed numpy shape
    Wq, tensors = {}, []
    for k in sorted(W, key=gguf_name):
        v = W[k]
        if v.ndim == 2 and v.shape[1] % 32 == 0:
            raw = gen_gguf.quantize(v, "q8_0")
            Wq[k] = gen_gguf.dec_q8_0(raw).reshape(v.shape)
            tensors.append((gguf_name(k), 8, list(reversed(v.shape)), raw))
        else:
            Wq[k] = v
            tensors.append((gguf_name(k), 0, list(reversed(v.shape)), v.astype(np.float32).tobytes()))
    kvs = [("general.architecture", 8, gen_gguf.gguf_string("t5encoder")),
           ("t5encoder.attention.head_count", 4, struct.pack("<I", H)),
           ("t5encoder.block_count", 4, struct.pack("<I", NB))]
    gen_gguf.gguf_file(os.path.join(OUT, "q8_0.gguf"), 3, kvs, tensors, 32)

    cases = {"one": rng.integers(0, VOCAB, (1, 1)), "short": rng.integers(0, VOCAB, (1, 7)),
             "batch": rng.integers(0, VOCAB, (2, 12)), "long": rng.integers(0, VOCAB, (1, 200))}
    cases["short"][0, -1] = 1  # </s>
    exp = {}
    for name, ids in cases.items():
        exp["ids." + name] = (ids.astype(np.int64), "I64")
        for var, ws in (("ref", W), ("fp8", W8), ("fp8s", W8s), ("q8_0", Wq)):
            t = {k: torch.tensor(v, dtype=torch.float64) for k, v in ws.items()}
            y = encode(t, torch.tensor(ids, dtype=torch.long))
            exp["out.%s.%s" % (var, name)] = (y.numpy().astype(np.float32), "F32")
    exp["buckets"] = (bucket(torch.arange(-400, 401)).numpy().astype(np.int64), "I64")
    safetensors(os.path.join(OUT, "expected.safetensors"), exp)


if __name__ == "__main__":
    main()
