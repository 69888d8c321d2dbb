#!/usr/bin/python3
"""Golden data for SD 3.5 LoRAs (tests/lua/test_sd3_pipeline.lua): three LoRA files on
the tiny "medium" MMDiT of tests/golden/sd3/medium.recipe (gen_sd3.py), each in one
trainer's spelling, and the weights they give merged at strength 1, computed here as
W + up @ down * alpha / rank (PEFT files carry no alpha: alpha = rank), the q / k / v
rows of diffusers' names landing in the fused qkv as diffusers' converter splits it.

- kohya: lora_unet_joint_blocks_0_x_block_attn_qkv (all rows), lora_unet_joint_blocks_1_
  context_block_mlp_fc1, with alpha 2 at rank 4;
- peft: transformer.transformer_blocks.0.attn.to_k / add_v_proj (rows of the x / context
  qkv), transformer.transformer_blocks.1.ff.net.2 (lora_A / lora_B, rank 4);
- comfy: diffusion_model.joint_blocks.1.x_block.attn2.qkv and
  diffusion_model.joint_blocks.0.x_block.adaLN_modulation.1 (lora_up / lora_down,
  alpha 8 at rank 4).

Run from the repository root:  /usr/bin/python3 tests/golden/gen_sd3_lora.py
Writes tests/golden/sd3/lora_<format>.safetensors and lora_expected.safetensors: per
<format>.<tensor name> the merged weight's first and last 8 rows of the rows the LoRA
touches (16 rows: the file stays small), and <key>#rows = {first, end} (0-based,
end exclusive) of that range.
"""

import json
import os
import sys

import torch

torch.set_num_threads(2)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "examples", "models"))
import safetensors_io  # noqa: E402

OUT = os.path.join(HERE, "sd3")
H = 192      # the tiny medium's hidden width (3 blocks x 64)
RANK = 4


def weights():
    w = {}
    with open(os.path.join(OUT, "medium.recipe")) as f:
        for line in f:
            if line.startswith("#"):
                continue
            name, dt, shape, seed, std, mean = line.rstrip("\n").split("\t")
            torch.manual_seed(int(seed))
            w[name] = torch.randn(json.loads(shape)) * float(std) + float(mean)
    return w


def main():
    W = weights()
    g = torch.Generator().manual_seed(4040)
    out = {}

    def pair(o, i):
        down = torch.randn(RANK, i, generator=g) * 0.1
        up = torch.randn(o, RANK, generator=g) * 0.1
        return up, down

    ranges = {}

    def merge(fmt, name, rows, up, down, scale):
        key = fmt + "." + name
        cur = out.get(key, W[name].clone())
        d = up @ down * scale
        if rows is None:
            cur += d
        else:
            cur[rows[0]:rows[0] + rows[1]] += d
        out[key] = cur
        ranges[key] = (rows[0], rows[0] + rows[1]) if rows else (0, cur.shape[0])

    files = {"kohya": {}, "peft": {}, "comfy": {}}
    # kohya: alpha 2 at rank 4
    for mod in ("joint_blocks.0.x_block.attn.qkv", "joint_blocks.1.context_block.mlp.fc1"):
        o, i = W[mod + ".weight"].shape
        up, down = pair(o, i)
        k = "lora_unet_" + mod.replace(".", "_")
        files["kohya"][k + ".lora_down.weight"] = down
        files["kohya"][k + ".lora_up.weight"] = up
        files["kohya"][k + ".alpha"] = torch.tensor(2.0)
        merge("kohya", mod + ".weight", None, up, down, 2.0 / RANK)
    # PEFT: rows of the fused qkv
    for d, mod, rows in (("transformer_blocks.0.attn.to_k", "joint_blocks.0.x_block.attn.qkv", (H, H)),
                         ("transformer_blocks.0.attn.add_v_proj", "joint_blocks.0.context_block.attn.qkv",
                          (2 * H, H)),
                         ("transformer_blocks.1.ff.net.2", "joint_blocks.1.x_block.mlp.fc2", None)):
        o, i = W[mod + ".weight"].shape
        if rows:
            o = rows[1]
        up, down = pair(o, i)
        files["peft"]["transformer." + d + ".lora_A.weight"] = down
        files["peft"]["transformer." + d + ".lora_B.weight"] = up
        merge("peft", mod + ".weight", rows, up, down, 1.0)
    # ComfyUI: alpha 8 at rank 4
    for mod in ("joint_blocks.1.x_block.attn2.qkv", "joint_blocks.0.x_block.adaLN_modulation.1"):
        o, i = W[mod + ".weight"].shape
        up, down = pair(o, i)
        k = "diffusion_model." + mod
        files["comfy"][k + ".lora_down.weight"] = down
        files["comfy"][k + ".lora_up.weight"] = up
        files["comfy"][k + ".alpha"] = torch.tensor(8.0)
        merge("comfy", mod + ".weight", None, up, down, 8.0 / RANK)
    for fmt, t in files.items():
        safetensors_io.save(os.path.join(OUT, "lora_%s.safetensors" % fmt), t,
                            {"generator": "tests/golden/gen_sd3_lora.py"})
    small = {}
    for k, (a, b) in ranges.items():
        small[k] = torch.cat([out[k][a:a + 8], out[k][b - 8:b]], 0).contiguous()
        small[k + "#rows"] = torch.tensor([float(a), float(b)])
    out = small
    safetensors_io.save(os.path.join(OUT, "lora_expected.safetensors"), out,
                        {"generator": "tests/golden/gen_sd3_lora.py"})
    for k in sorted(out):
        print(k, tuple(out[k].shape))


if __name__ == "__main__":
    main()
