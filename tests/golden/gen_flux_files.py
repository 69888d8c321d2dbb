#!/usr/bin/python3
"""Golden files for the Flux.1 layouts users have (tests/lua/test_flux_files.lua): one
tiny Flux.1 transformer (BFL's names, weights from a recipe the Lua test rebuilds with
seeded kiln.randn = torch.randn) written the way each published tool writes it, by
this generator's own implementation of each tool's published conversion:

- diffusers (FluxTransformer2DModel): the mapping of diffusers'
  convert_flux_transformer_checkpoint_to_diffusers (loaders/single_file_utils.py):
  fused qkv split into to_q / to_k / to_v (add_q_proj ... for the text stream),
  single blocks' linear1 into to_q / to_k / to_v / proj_mlp, linear2 -> proj_out,
  the final adaLN's (shift, scale) halves swapped into norm_out.linear's (scale,
  shift); config.json with num_attention_heads and axes_dims_rope. Written as one
  file ([schnell]: no guidance embedder) and as two shards ([dev]) with
  diffusion_pytorch_model.safetensors.index.json.
- fp8 e4m3fn ([schnell]: 2-D weights, round to nearest even; 1-D tensors f16) and ComfyUI's
  scaled fp8 (weight = code value * scale_weight, scale = max |w| / 448 per weight,
  the scaled_fp8 marker), under ComfyUI's model.diffusion_model. prefix.
- GGUF as city96's ComfyUI-GGUF tools/convert.py writes it (BFL's names without the
  prefix, general.architecture "flux"; 1-D tensors F32, the rest F16) then quantized as llama.cpp's quantizer does (a tensor whose rows do not split
  into the type's blocks falls back: Q4_K -> Q5_0, Q5_K -> Q5_1, then F16): F16,
  Q8_0, Q5_K, Q4_K, Q4_0. And ([schnell]) as stable-diffusion.cpp's convert writes it (names
  with model.diffusion_model., no metadata keys; Q8_0 where rows allow, 1-D F32).
  The GGUF writer and block quantizers are tests/golden/gen_gguf.py's (the GGUF
  specification, ggml's block formats).
And LoRAs for it in kohya's (lora_unet_double_blocks_0_img_attn_qkv.lora_down /
lora_up / alpha), diffusers / PEFT's (transformer.transformer_blocks.0.attn.to_q.lora_A /
lora_B: rows of the fused qkv), XLabs' (double_blocks.0.processor.qkv_lora1.down / up)
and ComfyUI's (diffusion_model.double_blocks... with lora_down / up or lora_A / B)
names, each with lora_<format>.merged.safetensors: the weights they touch merged by
the published arithmetic W[rows] + up @ down * alpha / rank (no alpha: 1), in f32.
The heads and rotary axes of a model this small are not BFL's defaults: the
safetensors and GGUF files say them as kiln.flux.heads / kiln.flux.axes_dim.

Run from the repository root:  /usr/bin/python3 tests/golden/gen_flux_files.py
Writes under tests/golden/flux_files/.
"""

import json
import math
import os
import struct
import sys

import numpy as np
import torch

torch.set_num_threads(2)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_gguf as G  # noqa: E402

OUT = os.path.join(HERE, "flux_files")
F = np.float32

HIDDEN, HEADS, AXES = 16, 1, (4, 6, 6)
DEPTH, DEPTH_SINGLE = 1, 1
CONTEXT, VEC, IN_CH = 32, 64, 64
MLP = HIDDEN * 4
META = {"kiln.flux.heads": str(HEADS), "kiln.flux.axes_dim": ",".join(str(a) for a in AXES)}


# ------------------------------------------------------------------ the model

def names_and_shapes():
    H, M = HIDDEN, MLP
    D = H // HEADS
    r = []

    def lin(p, o, i):
        r.append((p + ".weight", [o, i]))
        r.append((p + ".bias", [o]))

    lin("img_in", H, IN_CH)
    lin("txt_in", H, CONTEXT)
    for e, i in (("time_in", 256), ("vector_in", VEC), ("guidance_in", 256)):
        lin(e + ".in_layer", H, i)
        lin(e + ".out_layer", H, H)
    for b in range(DEPTH):
        for s in ("img", "txt"):
            p = "double_blocks.%d.%s_" % (b, s)
            lin(p + "mod.lin", 6 * H, H)
            lin(p + "attn.qkv", 3 * H, H)
            r.append((p + "attn.norm.query_norm.scale", [D]))
            r.append((p + "attn.norm.key_norm.scale", [D]))
            lin(p + "attn.proj", H, H)
            lin(p + "mlp.0", M, H)
            lin(p + "mlp.2", H, M)
    for b in range(DEPTH_SINGLE):
        p = "single_blocks.%d." % b
        lin(p + "linear1", 3 * H + M, H)
        lin(p + "linear2", H, H + M)
        r.append((p + "norm.query_norm.scale", [D]))
        r.append((p + "norm.key_norm.scale", [D]))
        lin(p + "modulation.lin", 3 * H, H)
    lin("final_layer.linear", IN_CH, H)
    lin("final_layer.adaLN_modulation.1", 2 * H, H)
    return r


def build_weights():
    w, recipe = {}, []
    for i, (name, shape) in enumerate(names_and_shapes()):
        seed = 5000 + i
        if name.endswith(".scale"):
            std, mean = 0.2, 1.0
        elif len(shape) == 1:
            std, mean = 0.1, 0.0
        else:
            std, mean = 1.0 / math.sqrt(shape[1]), 0.0
        std = float("%.9g" % std)
        torch.manual_seed(seed)
        w[name] = (torch.randn(shape) * std + mean).numpy().astype(F)
        recipe.append((name, "f32", shape, seed, std, mean))
    return w, recipe


# ------------------------------------------------------------------ writers

ST_DTYPE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}


def safetensors(path, arrays, meta=None):
    """arrays: name -> numpy array, or (array, safetensors dtype) for raw codes"""
    header, blobs, off = {}, [], 0
    for k in sorted(arrays):
        v = arrays[k]
        a, dt = v if isinstance(v, tuple) else (v, None)
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": dt or ST_DTYPE[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = dict(meta or {}, generator="tests/golden/gen_flux_files.py")
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    print(path, os.path.getsize(path), "bytes")


def f16(a):
    return a.astype(np.float16)


# ------------------------------------------------------------------ diffusers

def to_diffusers(w):
    """BFL names -> diffusers' FluxTransformer2DModel names, as diffusers' converter does"""
    H = HIDDEN
    d = {}
    top = {"img_in": "x_embedder", "txt_in": "context_embedder",
           "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
           "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
           "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
           "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
           "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
           "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
           "final_layer.linear": "proj_out"}
    for a, b in top.items():
        for s in (".weight", ".bias"):
            if a + s in w:
                d[b + s] = w[a + s]
    for i in range(DEPTH):
        src, dst = "double_blocks.%d." % i, "transformer_blocks.%d." % i
        ren = {"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
               "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
               "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
               "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2"}
        for a, b in ren.items():
            for s in (".weight", ".bias"):
                d[dst + b + s] = w[src + a + s]
        for s in (".weight", ".bias"):
            q, k, v = np.split(w[src + "img_attn.qkv" + s], 3, axis=0)
            d[dst + "attn.to_q" + s], d[dst + "attn.to_k" + s], d[dst + "attn.to_v" + s] = q, k, v
            q, k, v = np.split(w[src + "txt_attn.qkv" + s], 3, axis=0)
            d[dst + "attn.add_q_proj" + s], d[dst + "attn.add_k_proj" + s], d[dst + "attn.add_v_proj" + s] = q, k, v
        d[dst + "attn.norm_q.weight"] = w[src + "img_attn.norm.query_norm.scale"]
        d[dst + "attn.norm_k.weight"] = w[src + "img_attn.norm.key_norm.scale"]
        d[dst + "attn.norm_added_q.weight"] = w[src + "txt_attn.norm.query_norm.scale"]
        d[dst + "attn.norm_added_k.weight"] = w[src + "txt_attn.norm.key_norm.scale"]
    for i in range(DEPTH_SINGLE):
        src, dst = "single_blocks.%d." % i, "single_transformer_blocks.%d." % i
        for s in (".weight", ".bias"):
            d[dst + "norm.linear" + s] = w[src + "modulation.lin" + s]
            q, k, v, mlp = np.split(w[src + "linear1" + s], [H, 2 * H, 3 * H], axis=0)
            d[dst + "attn.to_q" + s], d[dst + "attn.to_k" + s], d[dst + "attn.to_v" + s] = q, k, v
            d[dst + "proj_mlp" + s] = mlp
            d[dst + "proj_out" + s] = w[src + "linear2" + s]
        d[dst + "attn.norm_q.weight"] = w[src + "norm.query_norm.scale"]
        d[dst + "attn.norm_k.weight"] = w[src + "norm.key_norm.scale"]
    for s in (".weight", ".bias"):
        shift, scale = np.split(w["final_layer.adaLN_modulation.1" + s], 2, axis=0)
        d["norm_out.linear" + s] = np.concatenate([scale, shift], axis=0)
    # every tensor once: the fused ones in 3 (qkv) or 4 (linear1) parts
    assert len(d) == len(w) + DEPTH * 8 + DEPTH_SINGLE * 6, (len(d), len(w))
    return d


def diffusers_config(guidance):
    return {"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.30.0",
            "attention_head_dim": HIDDEN // HEADS, "axes_dims_rope": list(AXES), "guidance_embeds": guidance,
            "in_channels": IN_CH, "joint_attention_dim": CONTEXT, "num_attention_heads": HEADS,
            "num_layers": DEPTH, "num_single_layers": DEPTH_SINGLE, "patch_size": 1,
            "pooled_projection_dim": VEC}


def write_diffusers(w, ws):
    """w: [dev] (sharded folder), ws: [schnell] (single-file folder)"""
    d = {k: f16(v) for k, v in to_diffusers(ws).items()}
    one = os.path.join(OUT, "diffusers", "transformer")
    os.makedirs(one, exist_ok=True)
    safetensors(os.path.join(one, "diffusion_pytorch_model.safetensors"), d)
    with open(os.path.join(one, "config.json"), "w") as f:
        json.dump(diffusers_config(False), f, indent=1)
    d = {k: f16(v) for k, v in to_diffusers(w).items()}
    # sharded: the single-stream block and the output layers in the second shard
    sh = os.path.join(OUT, "diffusers_sharded", "transformer")
    os.makedirs(sh, exist_ok=True)
    names = sorted(d)
    second = [k for k in names if k.startswith("single_transformer_blocks.") or k.startswith("proj_out")
              or k.startswith("norm_out")]
    first = [k for k in names if k not in second]
    files = ["diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors"]
    wmap = {}
    for fname, keys in zip(files, (first, second)):
        safetensors(os.path.join(sh, fname), {k: d[k] for k in keys})
        for k in keys:
            wmap[k] = fname
    with open(os.path.join(sh, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(v.nbytes for v in d.values())}, "weight_map": wmap}, f, indent=1)
    with open(os.path.join(sh, "config.json"), "w") as f:
        json.dump(diffusers_config(True), f, indent=1)


# ------------------------------------------------------------------ fp8

def fp8_codes(x):
    return G.fp8_encode(x.reshape(-1), G.E4M3, 0x7E).reshape(x.shape).astype(np.uint8)


def write_fp8(w, ws):
    """plain fp8: [schnell] (ws); scaled: [dev] (w)"""
    plain, scaled = {}, {}
    pre = "model.diffusion_model."
    for k, v in w.items():
        if k not in ws:
            pass
        elif v.ndim == 2:
            plain[pre + k] = (fp8_codes(v), "F8_E4M3")
        else:
            plain[pre + k] = f16(v)
        if v.ndim == 2:
            s = F(np.abs(v).max() / 448.0)
            scaled[pre + k] = (fp8_codes(v / s), "F8_E4M3")
            scaled[pre + k[:-len("weight")] + "scale_weight"] = np.array(s, dtype=F)
        else:
            scaled[pre + k] = f16(v)
    scaled[pre + "scaled_fp8"] = (np.zeros((0,), dtype=np.uint8), "F8_E4M3")
    safetensors(os.path.join(OUT, "comfy_fp8_e4m3fn.safetensors"), plain, META)
    safetensors(os.path.join(OUT, "comfy_fp8_scaled.safetensors"), scaled, META)


# ------------------------------------------------------------------ GGUF

GGUF_F32, GGUF_F16 = 0, 1
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def gguf_type(v, qtype):
    """city96's convert.py, then llama.cpp's quantizer's choice for one tensor. Its
    small-tensor rule (<= 1024 values stay F32) is left out: in a full-size Flux only
    the 1-D tensors are that small, and the tiny model's matrices should be quantized
    as a full-size model's are"""
    if v.ndim == 1:
        return "f32"
    t = qtype
    if t in ("f16", "f32"):
        return t
    if v.shape[-1] % G.TYPES[t][1] != 0:
        t = FALLBACK.get(t, t)
    if t not in G.TYPES or v.shape[-1] % G.TYPES[t][1] != 0:
        return "f16"
    return t


def gguf_raw(v, t):
    if t == "f32":
        return GGUF_F32, v.astype("<f4").tobytes()
    if t == "f16":
        return GGUF_F16, v.astype("<f2").tobytes()
    return G.TYPES[t][0], G.quantize(v, t)


def kv_str(k, s):
    return (k, 8, G.gguf_string(s))


def write_gguf(w, qtype, path, prefix="", arch=True):
    tensors, used = [], {}
    for k in sorted(w):
        v = w[k]
        t = gguf_type(v, qtype)
        tid, raw = gguf_raw(v, t)
        used[t] = used.get(t, 0) + 1
        tensors.append((prefix + k, tid, list(reversed(v.shape)), raw))
    kvs = []
    if arch:
        kvs = [kv_str("general.architecture", "flux"), ("general.quantization_version", 4, struct.pack("<I", 2))]
        kvs += [kv_str(k, v) for k, v in sorted(META.items())]
    else:
        # stable-diffusion.cpp writes no keys; the tiny model's heads and axes still
        # need saying (a full-size file has BFL's defaults)
        kvs = [kv_str(k, v) for k, v in sorted(META.items())]
    G.gguf_file(path, 3, kvs, tensors, 32)
    print("   types:", ", ".join("%s %d" % (k, n) for k, n in sorted(used.items())))


# ------------------------------------------------------------------ LoRA

def lora_pair(rng, out, inp, rank):
    down = (rng.standard_normal((rank, inp)) / math.sqrt(inp)).astype(F)
    up = (rng.standard_normal((out, rank)) * 0.1).astype(F)
    return down, up


def write_loras(w):
    """Each format's keys for a few modules, and the merged weights the published
    arithmetic gives: W[rows] + up @ down * alpha / rank (alpha absent: 1), in f32."""
    H, M = HIDDEN, MLP
    rng = np.random.default_rng(39)
    formats = {}
    # (key module, ending style, BFL tensor, first row, row count, rank, alpha)
    formats["kohya"] = [
        ("lora_unet_double_blocks_0_img_attn_qkv", "kohya", "double_blocks.0.img_attn.qkv", 0, 3 * H, 4, 2.0),
        ("lora_unet_single_blocks_0_linear1", "kohya", "single_blocks.0.linear1", 0, 3 * H + M, 4, 4.0),
        ("lora_unet_double_blocks_0_txt_mlp_0", "kohya", "double_blocks.0.txt_mlp.0", 0, M, 2, 1.0),
        ("lora_unet_final_layer_adaLN_modulation_1", "kohya", "final_layer.adaLN_modulation.1", 0, 2 * H, 2, None),
        ("lora_unet_double_blocks_7_img_attn_qkv", "kohya", None, 0, 3 * H, 2, 1.0),   # no such block
        # sd-scripts' split_qkv, as its state_dict saves it: the downs stacked [3r, in],
        # the ups block-diagonal [3H, 3r], alpha unchanged (consumers scale by alpha
        # over the stacked rank)
        ("lora_unet_double_blocks_0_txt_attn_qkv", "kohya-split", "double_blocks.0.txt_attn.qkv", 0, 3 * H, 2, 2.0),
    ]
    formats["peft"] = [
        ("transformer.transformer_blocks.0.attn.to_q", "peft", "double_blocks.0.img_attn.qkv", 0, H, 4, None),
        ("transformer.transformer_blocks.0.attn.to_k", "peft", "double_blocks.0.img_attn.qkv", H, H, 4, None),
        ("transformer.transformer_blocks.0.attn.add_v_proj", "peft", "double_blocks.0.txt_attn.qkv", 2 * H, H, 4,
         None),
        ("transformer.single_transformer_blocks.0.attn.to_v", "peft", "single_blocks.0.linear1", 2 * H, H, 2, None),
        ("transformer.single_transformer_blocks.0.proj_mlp", "peft", "single_blocks.0.linear1", 3 * H, M, 2, None),
        ("transformer.transformer_blocks.0.ff.net.0.proj", "peft", "double_blocks.0.img_mlp.0", 0, M, 2, None),
        ("transformer.single_transformer_blocks.0.proj_out", "peft", "single_blocks.0.linear2", 0, H, 2, None),
        # diffusers' norm_out.linear is BFL's final modulation with its halves swapped
        ("transformer.norm_out.linear", "peft-swap", "final_layer.adaLN_modulation.1", 0, 2 * H, 2, None),
    ]
    formats["xlabs"] = [
        ("double_blocks.0.processor.qkv_lora1", "xlabs", "double_blocks.0.img_attn.qkv", 0, 3 * H, 4, None),
        ("double_blocks.0.processor.proj_lora2", "xlabs", "double_blocks.0.txt_attn.proj", 0, H, 4, None),
        ("single_blocks.0.processor.qkv_lora", "xlabs", "single_blocks.0.linear1", 0, 3 * H, 4, None),
    ]
    formats["comfy"] = [
        ("diffusion_model.double_blocks.0.img_mod.lin", "kohya", "double_blocks.0.img_mod.lin", 0, 6 * H, 2, 1.0),
        ("diffusion_model.single_blocks.0.linear2", "peft", "single_blocks.0.linear2", 0, H, 2, None),
        ("diffusion_model.double_blocks.0.txt_attn.qkv", "peft", "double_blocks.0.txt_attn.qkv", 0, 3 * H, 2, None),
    ]
    ends = {"kohya": (".lora_down.weight", ".lora_up.weight"), "peft": (".lora_A.weight", ".lora_B.weight"),
            "xlabs": (".down.weight", ".up.weight")}
    for fmt_name, mods in formats.items():
        arrays, merged = {}, {}
        for key, style, target, first, count, rank, alpha in mods:
            inp = w[target + ".weight"].shape[1] if target else H
            if style == "kohya-split":
                parts = [lora_pair(rng, H, inp, rank) for _ in range(3)]
                down = np.concatenate([p[0] for p in parts], axis=0)
                up = np.zeros((3 * H, 3 * rank), dtype=F)
                for j, p in enumerate(parts):
                    up[j * H:(j + 1) * H, j * rank:(j + 1) * rank] = p[1]
                rank, style = 3 * rank, "kohya"
            else:
                down, up = lora_pair(rng, count, inp, rank)
            swap = style == "peft-swap"
            if swap:
                style = "peft"
            dn, un = ends[style]
            arrays[key + dn] = down
            arrays[key + un] = up
            if alpha is not None:
                arrays[key + ".alpha"] = np.array(alpha, dtype=F)
            if target is None:
                continue
            name = target + ".weight"
            m = merged.get(name, w[name].copy())
            scale = (alpha / rank) if alpha is not None else 1.0
            delta = (up.astype(np.float64) @ down.astype(np.float64)) * scale
            if swap:   # (scale, shift) rows -> BFL's (shift, scale)
                delta = np.concatenate([delta[count // 2:], delta[:count // 2]], axis=0)
            m[first:first + count] = (m[first:first + count].astype(np.float64) + delta).astype(F)
            merged[name] = m
        safetensors(os.path.join(OUT, "lora_%s.safetensors" % fmt_name), arrays)
        safetensors(os.path.join(OUT, "lora_%s.merged.safetensors" % fmt_name), merged)


# ------------------------------------------------------------------ main

def main():
    os.makedirs(OUT, exist_ok=True)
    w, recipe = build_weights()
    with open(os.path.join(OUT, "tiny.recipe"), "w") as f:
        f.write("# written by tests/golden/gen_flux_files.py: name, dtype, shape, seed, std, mean\n")
        f.write("# tensor = torch.manual_seed(seed); torch.randn(shape) * std + mean\n")
        for k, v in sorted(META.items()):
            f.write("@%s\t%s\n" % (k, v))
        for name, dt, shape, seed, std, mean in recipe:
            f.write("%s\t%s\t%s\t%d\t%.9g\t%.9g\n" % (name, dt, json.dumps(shape), seed, std, mean))
    ws = {k: v for k, v in w.items() if not k.startswith("guidance_in.")}
    write_diffusers(w, ws)
    write_fp8(w, ws)
    for q in ("f16", "q8_0", "q5_k", "q4_k", "q4_0"):
        write_gguf(w, q, os.path.join(OUT, "city96_%s.gguf" % q))
    write_gguf(ws, "q8_0", os.path.join(OUT, "sdcpp_q8_0.gguf"), prefix="model.diffusion_model.", arch=False)
    write_loras(w)


if __name__ == "__main__":
    main()
