/* fuzz_lora.h - what the two LoRA harnesses share: the key-matching half of
 * scripts/kiln/lora.lua (K) and a small SD 1.x-like index to plan against (original
 * and diffusers UNet names, a Hugging Face and an OpenCLIP text encoder), as Lua text
 * that a driver chunk starts with. */
#ifndef KILN_FUZZ_LORA_H
#define KILN_FUZZ_LORA_H

#include "fuzz_lua.h"

#define FUZZ_LORA_INDEX \
    "local K = require('kiln.lora').mapping\n" \
    "local function broken(why) error({ broken = why }, 0) end\n" \
    "local UNET = {\n" \
    "  {'input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight', {320, 768}},\n" \
    "  {'input_blocks.1.1.proj_in.weight', {320, 320, 1, 1}},\n" \
    "  {'input_blocks.1.0.in_layers.2.weight', {320, 320, 3, 3}},\n" \
    "  {'input_blocks.1.0.in_layers.2.bias', {320}},\n" \
    "  {'input_blocks.3.0.op.weight', {320, 320, 3, 3}},\n" \
    "  {'middle_block.1.transformer_blocks.0.attn1.to_q.weight', {1280, 1280}},\n" \
    "  {'middle_block.0.emb_layers.1.weight', {1280, 1280}},\n" \
    "  {'output_blocks.2.1.conv.weight', {1280, 1280, 3, 3}},\n" \
    "  {'output_blocks.5.1.transformer_blocks.0.ff.net.0.proj.weight', {5120, 640}},\n" \
    "  {'time_embed.0.weight', {1280, 320}},\n" \
    "  {'label_emb.0.0.weight', {1280, 2816}},\n" \
    "}\n" \
    "local HF = {\n" \
    "  {'text_model.encoder.layers.0.self_attn.q_proj.weight', {768, 768}},\n" \
    "  {'text_model.encoder.layers.0.mlp.fc1.weight', {3072, 768}},\n" \
    "  {'text_model.encoder.layers.0.mlp.fc1.bias', {3072}},\n" \
    "}\n" \
    "local OPENCLIP = {\n" \
    "  {'transformer.resblocks.0.attn.in_proj_weight', {3072, 1024}},\n" \
    "  {'transformer.resblocks.0.attn.in_proj_bias', {3072}},\n" \
    "  {'transformer.resblocks.0.mlp.c_fc.weight', {4096, 1024}},\n" \
    "  {'token_embedding.weight', {49408, 1024}},\n" \
    "}\n" \
    "local store = { add_patch = function() return 1 end, remove_patch = function() end }\n" \
    "local function resolve(n) return n end\n" \
    "local function build(unet, hf, oc)\n" \
    "  local idx = {}\n" \
    "  K.index_unet(idx, { names = unet, resolve = resolve, store = store })\n" \
    "  local k1, p1 = K.clip_prefixes(1, 2, 'l')\n" \
    "  K.index_clip(idx, { names = hf, resolve = resolve, store = store, layout = 'hf', kohya = k1, peft = p1 })\n" \
    "  local k2, p2 = K.clip_prefixes(2, 2, 'g')\n" \
    "  K.index_clip(idx, { names = oc, resolve = resolve, store = store, layout = 'openclip', kohya = k2, peft = p2 })\n" \
    "  return idx\n" \
    "end\n" \
    "local INDEX = build(UNET, HF, OPENCLIP)\n"

#endif
