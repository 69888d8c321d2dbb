-- tests/lua/test_lora.lua - kiln.lora: the key mapping of every LoRA naming onto the
-- real SD 1.x / 2.x / XL tensor names ($KILN_SHARED/sd-keys: kohya, PEFT, ComfyUI and
-- the older diffusers spellings, OpenCLIP's packed q/k/v rows, the UNet name round trip
-- through checkpoint.diffusers_unet_map), the scales, the family and bad-input errors,
-- finding LoRAs by name; with the store's add_patch recorded by a stand-in where the
-- arithmetic is not the point, and the merged weights against PyTorch's (the goldens of
-- tests/golden/gen_lora.py) where they are there.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local lora = require("kiln.lora").mapping
local checkpoint = require "kiln.checkpoint"
local T = require "tiny_sd"
local test = H.test
local fmt = string.format

local SHARED = os.getenv("KILN_SHARED") or "../shared"

-- ---------------------------------------------------------------- helpers

local function read_keys(file)
  local path = SHARED .. "/sd-keys/" .. file
  local f = io.open(path, "r")
  if not f then H.skip(path .. " is absent (set KILN_SHARED to the shared folder)") end
  local list = {}
  for line in f:lines() do
    local name, shape = line:match("^([^\t]+)\t(.*)$")
    if name then list[#list + 1] = { name, T.parse_shape(shape) } end
  end
  f:close()
  return list
end

-- A stand-in weight store: add_patch records its calls.
local function fake_store(label)
  local s = { label = label, patches = {}, next_id = 0, removed = {} }
  function s.add_patch(self, target, spec)
    self.next_id = self.next_id + 1
    self.patches[self.next_id] = { target = target, spec = spec }
    return self.next_id
  end
  function s.remove_patch(self, id)
    self.removed[#self.removed + 1] = id
    self.patches[id] = nil
  end
  function s.count(self)
    local n = 0
    for _ in pairs(self.patches) do n = n + 1 end
    return n
  end
  return s
end

-- The parts of a family's key list: the UNet (original names) and the text encoders
-- ({prefix, layout}), as the checkpoint's layout code finds them.
local FAMILIES = {
  { file = "sd15.txt", family = "sd1", encoders = { { "cond_stage_model.transformer.", "hf", "l" } } },
  { file = "sd21.txt", family = "sd2", encoders = { { "cond_stage_model.model.", "openclip", "h" } } },
  { file = "sdxl.txt", family = "sdxl", encoders = {
    { "conditioner.embedders.0.transformer.", "hf", "l" }, { "conditioner.embedders.1.model.", "openclip", "g" } } },
}

local UNET = "model.diffusion_model."

local function sub(list, prefix)
  local r = {}
  for _, e in ipairs(list) do
    if e[1]:sub(1, #prefix) == prefix then r[#r + 1] = { e[1]:sub(#prefix + 1), e[2] } end
  end
  return r
end

-- index over a key list with stand-in stores
local function build_index(fam, list)
  local idx = {}
  local stores = { unet = fake_store("unet") }
  lora.index_unet(idx, { names = sub(list, UNET), resolve = function(n) return UNET .. n end, store = stores.unet })
  for i, e in ipairs(fam.encoders) do
    local kohya, peft = lora.clip_prefixes(i, #fam.encoders, e[3])
    stores[i] = fake_store("clip" .. i)
    lora.index_clip(idx, { names = sub(list, e[1]), resolve = function(n) return e[1] .. n end, store = stores[i],
      layout = e[2], kohya = kohya, peft = peft })
  end
  return idx, stores
end

-- A LoRA as a table of stand-in tensors (shape only; alpha with a value).
local function fake_src(tensors, values)
  return {
    shape = function(k) return tensors[k] end,
    tensor = function(k) return { shape = tensors[k], key = k } end,
    value = function(k) return values[k] end,
    set_delta = function(_, _, d) return d end,
  }
end

local function lora_factors(tensors, values, module, wshape, rank, alpha)
  if #wshape == 4 then
    tensors[module .. ".lora_down.weight"] = { rank, wshape[2], wshape[3], wshape[4] }
    tensors[module .. ".lora_up.weight"] = { wshape[1], rank, 1, 1 }
  else
    tensors[module .. ".lora_down.weight"] = { rank, wshape[2] }
    tensors[module .. ".lora_up.weight"] = { wshape[1], rank }
  end
  if alpha then
    tensors[module .. ".alpha"] = {}
    values[module .. ".alpha"] = alpha
  end
end

local function names_of(t)
  local r = {}
  for k in pairs(t) do r[#r + 1] = k end
  table.sort(r)
  return r
end

local function plan_of(tensors, values, idx, strengths)
  local modules, others = lora.group(names_of(tensors))
  return lora.plan(modules, others, idx, fake_src(tensors, values), strengths or { unet = 1, clip = 1 },
    function(msg) error(msg, 0) end)
end

-- every Linear / Conv weight of the UNet (2-D or 4-D), original relative names
local function unet_layers(list)
  local r = {}
  for _, e in ipairs(sub(list, UNET)) do
    if e[1]:match("%.weight$") and (#e[2] == 2 or #e[2] == 4) then r[#r + 1] = e end
  end
  return r
end

local function count_layers(list, prefix, pattern)
  local n = -1
  for _, e in ipairs(sub(list, prefix)) do
    local i = tonumber(e[1]:match(pattern))
    if i then n = math.max(n, i) end
  end
  return n + 1
end

local HF_LAYER = { "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2" }

-- The real tensor (and rows) an HF-named layer of encoder e lands on.
local function te_target(e, layer, mod, W)
  if e[2] == "hf" then
    return fmt("%stext_model.encoder.layers.%d.%s.weight", e[1], layer, mod)
  end
  local p = fmt("%stransformer.resblocks.%d.", e[1], layer)
  local rows = ({ ["self_attn.q_proj"] = 1, ["self_attn.k_proj"] = W + 1, ["self_attn.v_proj"] = 2 * W + 1 })[mod]
  if rows then return p .. "attn.in_proj_weight", rows end
  return p .. ({ ["self_attn.out_proj"] = "attn.out_proj.weight", ["mlp.fc1"] = "mlp.c_fc.weight",
    ["mlp.fc2"] = "mlp.c_proj.weight" })[mod]
end

-- ---------------------------------------------------------------- the key mapping

for _, fam in ipairs(FAMILIES) do
  test(fam.family .. ": every UNet tensor's diffusers name maps back through checkpoint.diffusers_unet_map", function()
    local list = sub(read_keys(fam.file), UNET)
    local d_shapes, want = {}, {}
    local shapes = {}
    for _, e in ipairs(list) do shapes[e[1]] = e[2] end
    local cfg = require("kiln.unet").config(shapes, { heads = 8 })
    for _, e in ipairs(list) do
      local d = lora.unet_to_diffusers(e[1], cfg.num_res_blocks)
      H.truthy(d, "no diffusers name for " .. e[1])
      H.truthy(not d_shapes[d], "two tensors map to " .. tostring(d))
      d_shapes[d] = e[2]
      want[e[1]] = d
    end
    local map = checkpoint.diffusers_unet_map(d_shapes)
    local n = 0
    for orig, d in pairs(want) do
      H.eq(map[orig], d, "round trip of " .. orig)
      n = n + 1
    end
    H.eq(n, #list)
  end)

  for _, style in ipairs({ "kohya", "kohya-sgm", "peft", "comfy", "diffusers-old" }) do
    test(fmt("%s: %s UNet keys of every Linear / Conv land on their weight", fam.family, style), function()
      local list = read_keys(fam.file)
      local idx, stores = build_index(fam, list)
      local shapes = {}
      for _, e in ipairs(sub(list, UNET)) do shapes[e[1]] = e[2] end
      local nrb = require("kiln.unet").config(shapes, { heads = 8 }).num_res_blocks
      local tensors, values, want = {}, {}, {}
      for _, e in ipairs(unet_layers(list)) do
        local orig = e[1]:gsub("%.weight$", "")
        local diff = lora.unet_to_diffusers(e[1], nrb):gsub("%.weight$", "")
        local key
        if style == "kohya" then key = "lora_unet_" .. diff:gsub("%.", "_")
        elseif style == "kohya-sgm" then key = "lora_unet_" .. orig:gsub("%.", "_")
        elseif style == "peft" then key = "unet." .. diff
        elseif style == "comfy" then key = "diffusion_model." .. orig
        else key = "unet." .. diff:gsub("%.to_([qkvo])", ".processor.to_%1"):gsub("%.to_out%.0$", ".to_out") end
        if style == "peft" then
          tensors[key .. ".lora_A.weight"] = { 4, e[2][2], e[2][3], e[2][4] }
          tensors[key .. ".lora_B.weight"] = { e[2][1], 4, #e[2] == 4 and 1 or nil, #e[2] == 4 and 1 or nil }
        elseif style == "diffusers-old" and key:match("processor") then
          tensors[key .. "_lora.down.weight"] = { 4, e[2][2] }
          tensors[key .. "_lora.up.weight"] = { e[2][1], 4 }
        elseif style == "diffusers-old" then
          tensors[key .. ".lora.down.weight"] = { 4, e[2][2], e[2][3], e[2][4] }
          tensors[key .. ".lora.up.weight"] = { e[2][1], 4, #e[2] == 4 and 1 or nil, #e[2] == 4 and 1 or nil }
        else
          lora_factors(tensors, values, key, e[2], 4, 2)
        end
        want[UNET .. e[1]] = (want[UNET .. e[1]] or 0) + 1
      end
      local plan, unmatched = plan_of(tensors, values, idx)
      H.eq(#unmatched, 0, "unmatched: " .. table.concat(unmatched, ", ", 1, math.min(3, #unmatched)))
      local got = {}
      for _, p in ipairs(plan) do
        H.truthy(p.store == stores.unet, "patch on a store other than the UNet's")
        got[p.target] = (got[p.target] or 0) + 1
        local s = p.spec
        local expect = (style == "kohya" or style == "kohya-sgm" or style == "comfy") and 0.5 or 1.0
        H.near(s.scale, expect, 1e-12, "scale of " .. p.key)
      end
      for name, n in pairs(want) do H.eq(got[name], n, name) end
      H.eq(#plan, #unet_layers(list))
    end)
  end

  for _, style in ipairs({ "kohya", "peft", "comfy" }) do
    test(fmt("%s: %s text-encoder keys land on their weight (OpenCLIP: q/k/v rows of in_proj)", fam.family, style),
      function()
        local list = read_keys(fam.file)
        local idx, stores = build_index(fam, list)
        local tensors, values, want = {}, {}, {}
        for i, e in ipairs(fam.encoders) do
          local layers = e[2] == "hf" and count_layers(list, e[1], "^text_model%.encoder%.layers%.(%d+)%.")
              or count_layers(list, e[1], "^transformer%.resblocks%.(%d+)%.")
          local W
          for _, t in ipairs(sub(list, e[1])) do
            if t[1] == "token_embedding.weight" or t[1] == "text_model.embeddings.token_embedding.weight" then W = t[2][2] end
          end
          local F = W * 4
          for l = 0, layers - 1 do
            for _, mod in ipairs(HF_LAYER) do
              local hf = fmt("text_model.encoder.layers.%d.%s", l, mod)
              local key
              if style == "kohya" then
                key = (#fam.encoders == 1 and "lora_te_" or ("lora_te" .. i .. "_")) .. hf:gsub("%.", "_")
              elseif style == "peft" then
                key = (i == 1 and "text_encoder." or "text_encoder_2.") .. hf
              else
                key = "text_encoders.clip_" .. e[3] .. ".transformer." .. hf
              end
              local out, inp = W, W
              if mod == "mlp.fc1" then out = F elseif mod == "mlp.fc2" then inp = F end
              lora_factors(tensors, values, key, { out, inp }, 2, style == "kohya" and 1 or nil)
              local target, rows = te_target(e, l, mod, W)
              want[key .. ".lora_up.weight"] = { store = stores[i], target = target, rows = rows }
            end
          end
        end
        local plan, unmatched = plan_of(tensors, values, idx)
        H.eq(#unmatched, 0, "unmatched: " .. table.concat(unmatched, ", ", 1, math.min(3, #unmatched)))
        local n = 0
        for _, p in ipairs(plan) do
          local w = want[p.key]
          H.truthy(w, "unexpected patch " .. p.key)
          H.eq(p.target, w.target, p.key)
          H.truthy(p.store == w.store, p.key .. ": wrong store")
          H.eq(p.spec.rows and p.spec.rows[1], w.rows, p.key .. " rows")
          if w.rows then H.eq(p.spec.rows[2], p.spec.up.shape[1], p.key .. " row count") end
          H.near(p.spec.scale, style == "kohya" and 0.5 or 1.0, 1e-12, p.key)
          n = n + 1
        end
        local total = 0
        for _ in pairs(want) do total = total + 1 end
        H.eq(n, total)
      end)
  end

  test(fam.family .. ": the family is told from the shapes of a LoRA for it", function()
    local list = read_keys(fam.file)
    local tensors, values = {}, {}
    for _, e in ipairs(unet_layers(list)) do
      if e[1]:match("attn2%.to_k%.weight$") then
        lora_factors(tensors, values, "diffusion_model." .. e[1]:gsub("%.weight$", ""), e[2], 4, 4)
      end
    end
    local e = fam.encoders[#fam.encoders]
    local W
    for _, t in ipairs(sub(list, e[1])) do
      if t[1]:match("token_embedding") then W = t[2][2] end
    end
    local prefix = #fam.encoders == 1 and "lora_te_" or "lora_te2_"
    lora_factors(tensors, values, prefix .. "text_model_encoder_layers_0_self_attn_q_proj", { W, W }, 4, 4)
    local modules = lora.group(names_of(tensors))
    local f, why = lora.family_of(modules, function(k) return tensors[k] end)
    H.eq(f, fam.family, why)
  end)
end

test("sd2: diff_b on a q_proj bias lands on rows of in_proj_bias; set_weight and diff on a norm", function()
  local fam = FAMILIES[2]
  local list = read_keys(fam.file)
  local idx, stores = build_index(fam, list)
  local tensors = {
    ["lora_te_text_model_encoder_layers_3_self_attn_v_proj.diff_b"] = { 1024 },
    ["lora_te_text_model_encoder_layers_3_self_attn_v_proj.diff"] = { 1024, 1024 },
    ["lora_te_text_model_final_layer_norm.w_norm"] = { 1024 },
    ["lora_unet_down_blocks_0_resnets_0_norm1.diff"] = { 320 },
    ["lora_unet_down_blocks_0_resnets_0_norm1.diff_b"] = { 320 },
  }
  local plan, unmatched = plan_of(tensors, {}, idx, { unet = 0.5, clip = 2 })
  H.eq(#unmatched, 0)
  local by = {}
  for _, p in ipairs(plan) do by[p.key] = p end
  local p = by["lora_te_text_model_encoder_layers_3_self_attn_v_proj.diff_b"]
  H.eq(p.target, "cond_stage_model.model.transformer.resblocks.3.attn.in_proj_bias")
  H.eq(p.spec.rows[1], 2049); H.eq(p.spec.rows[2], 1024); H.eq(p.spec.kind, "diff"); H.eq(p.spec.scale, 2)
  p = by["lora_te_text_model_encoder_layers_3_self_attn_v_proj.diff"]
  H.eq(p.target, "cond_stage_model.model.transformer.resblocks.3.attn.in_proj_weight")
  H.eq(by["lora_te_text_model_final_layer_norm.w_norm"].target, "cond_stage_model.model.ln_final.weight")
  H.eq(by["lora_unet_down_blocks_0_resnets_0_norm1.diff_b"].target, UNET .. "input_blocks.1.0.in_layers.0.bias")
  H.eq(by["lora_unet_down_blocks_0_resnets_0_norm1.diff"].spec.scale, 0.5)
  H.truthy(stores.unet)
end)

test("scales: LoRA alpha/rank (none: 1), LoHa alpha/rank, LoKr alpha/dim of the factored side, DoRA's strength",
  function()
    local fam = FAMILIES[1]
    local idx = build_index(fam, read_keys(fam.file))
    local m = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_"
    local tensors = {
      [m .. "q.lora_down.weight"] = { 8, 320 }, [m .. "q.lora_up.weight"] = { 320, 8 }, [m .. "q.alpha"] = {},
      [m .. "q.dora_scale"] = { 1, 320 },
      [m .. "k.hada_w1_a"] = { 320, 4 }, [m .. "k.hada_w1_b"] = { 4, 320 }, [m .. "k.hada_w2_a"] = { 320, 4 },
      [m .. "k.hada_w2_b"] = { 4, 320 }, [m .. "k.alpha"] = {},
      [m .. "v.lokr_w1"] = { 4, 4 }, [m .. "v.lokr_w2_a"] = { 80, 2 }, [m .. "v.lokr_w2_b"] = { 2, 80 },
      [m .. "v.alpha"] = {},
      [m .. "out_0.lokr_w1"] = { 4, 4 }, [m .. "out_0.lokr_w2"] = { 80, 80 }, [m .. "out_0.alpha"] = {},
    }
    local values = { [m .. "q.alpha"] = 4, [m .. "k.alpha"] = 2, [m .. "v.alpha"] = 3, [m .. "out_0.alpha"] = 3 }
    local plan, unmatched = plan_of(tensors, values, idx, { unet = 0.8, clip = 1 })
    H.eq(#unmatched, 0)
    local by = {}
    for _, p in ipairs(plan) do by[p.key] = p end
    local q = by[m .. "q.lora_up.weight"]
    H.near(q.spec.scale, 0.8 * 4 / 8, 1e-12); H.eq(q.spec.strength, 0.8); H.truthy(q.spec.dora_scale)
    H.near(by[m .. "k.hada_w1_a"].spec.scale, 0.8 * 2 / 4, 1e-12)
    H.eq(by[m .. "k.hada_w1_a"].spec.kind, "loha")
    H.near(by[m .. "v.lokr_w1"].spec.scale, 0.8 * 3 / 2, 1e-12)
    H.near(by[m .. "out_0.lokr_w1"].spec.scale, 0.8, 1e-12) -- no factored side: alpha unused
    H.eq(by[m .. "out_0.lokr_w1"].target, UNET .. "input_blocks.1.1.transformer_blocks.0.attn1.to_out.0.weight")
  end)

test("LoCon: 3x3 conv with lora_mid and conv-as-linear shapes check; a shape mismatch names key and shapes", function()
  local fam = FAMILIES[1]
  local idx = build_index(fam, read_keys(fam.file))
  local k = "lora_unet_down_blocks_0_resnets_0_conv1"
  local tensors = {
    [k .. ".lora_down.weight"] = { 4, 320, 1, 1 }, [k .. ".lora_mid.weight"] = { 4, 4, 3, 3 },
    [k .. ".lora_up.weight"] = { 320, 4, 1, 1 },
    ["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"] = { 4, 320 },
    ["lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight"] = { 320, 4 },
  }
  local plan, unmatched = plan_of(tensors, {}, idx)
  H.eq(#unmatched, 0); H.eq(#plan, 2)
  for _, p in ipairs(plan) do H.truthy(p.spec.kind == "lora") end
  tensors = {
    ["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"] = { 4, 640 },
    ["lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight"] = { 640, 4 },
  }
  H.raises(function() plan_of(tensors, {}, idx) end, "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight",
    "[640, 640]", "[320, 320, 1, 1]")
end)

test("unmatched keys are listed; an incomplete pair is unmatched; strength 0 adds nothing", function()
  local fam = FAMILIES[1]
  local idx = build_index(fam, read_keys(fam.file))
  local tensors = {
    ["lora_unet_nowhere_to_q.lora_down.weight"] = { 4, 320 }, ["lora_unet_nowhere_to_q.lora_up.weight"] = { 320, 4 },
    ["lora_unet_down_blocks_0_attentions_0_proj_out.lora_up.weight"] = { 320, 4 },
    ["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = { 4, 768 },
    ["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"] = { 3072, 4 },
  }
  local plan, unmatched = plan_of(tensors, {}, idx)
  H.eq(#plan, 1); H.eq(#unmatched, 3)
  H.eq(unmatched[1], "lora_unet_down_blocks_0_attentions_0_proj_out.lora_up.weight")
  plan = plan_of(tensors, {}, idx, { unet = 1, clip = 0 })
  H.eq(#plan, 0)
end)

test("split_key and the format names", function()
  local m, role, naming = lora.split_key("unet.down_blocks.0.attentions.0.proj_in.lora_B.weight")
  H.eq(m, "unet.down_blocks.0.attentions.0.proj_in"); H.eq(role, "up"); H.eq(naming, "peft")
  m, role = lora.split_key("unet.x.attn1.processor.to_out_lora.down.weight")
  H.eq(m, "unet.x.attn1.processor.to_out"); H.eq(role, "down")
  m, role = lora.split_key("lora_unet_a_b.lokr_w1_a")
  H.eq(m, "lora_unet_a_b"); H.eq(role, "lokr_w1_a")
  H.eq(lora.split_key("model.diffusion_model.out.2.weight"), nil)
end)

-- ---------------------------------------------------------------- with a checkpoint

local function save(name, tensors)
  local p = T.tmp(name)
  kiln.save_safetensors(p, tensors)
  return p
end

local function r(shape, seed) return kiln.randn(shape, { seed = seed }) * 0.1 end

-- the stores of a loaded checkpoint swapped for stand-ins that record the patches
local function with_fake_stores(ckpt)
  local stores = {}
  local w = rawget(ckpt.unet, "weights")
  stores.unet = fake_store("unet")
  w.store = stores.unet
  for i, e in ipairs(rawget(ckpt.clip, "encoders")) do
    stores[i] = fake_store("clip" .. i)
    e.enc.weights.store = stores[i]
  end
  return stores
end

local have_patch = (function()
  local ok, m = pcall(kiln.model, T.ckpt_file("sd1"))
  local has = ok and pcall(function() return m.add_patch end) and type(m.add_patch) == "function"
  if ok then m:close() end
  return has
end)()

test("sd1 tiny: ckpt:add_lora reads a kohya file, maps UNet and text encoder, h:remove takes the patches off",
  function()
    local ckpt <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
    local stores = with_fake_stores(ckpt)
    local path = save("kohya_sd1.safetensors", {
      -- the tiny UNet has attention at its second level only
      ["lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_down.weight"] = r({ 2, 64 }, 1),
      ["lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_up.weight"] = r({ 64, 2 }, 2),
      ["lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.alpha"] = kiln.tensor(1.0),
      ["lora_te_text_model_encoder_layers_1_mlp_fc2.lora_down.weight"] = r({ 2, 256 }, 3),
      ["lora_te_text_model_encoder_layers_1_mlp_fc2.lora_up.weight"] = r({ 64, 2 }, 4),
      ["lora_unet_not_a_layer.lora_down.weight"] = r({ 2, 4 }, 5),
      ["lora_unet_not_a_layer.lora_up.weight"] = r({ 4, 2 }, 6),
    })
    local ok, h = pcall(ckpt.add_lora, ckpt, path, { unet = 0.5, clip = 2 })
    H.truthy(ok, tostring(h))
    H.eq(h.patched, 2); H.eq(h.format, "kohya"); H.eq(h.name, "kohya_sd1"); H.eq(#h.unmatched, 2)
    H.eq(stores.unet:count(), 1); H.eq(stores[1]:count(), 1)
    local _, p = next(stores.unet.patches)
    H.eq(p.target, "model.diffusion_model.input_blocks.3.1.transformer_blocks.0.attn2.to_k.weight")
    H.near(p.spec.scale, 0.5 * 1 / 2, 1e-7)
    _, p = next(stores[1].patches)
    H.eq(p.target, "cond_stage_model.transformer.text_model.encoder.layers.1.mlp.fc2.weight")
    H.near(p.spec.scale, 2, 1e-12)
    H.eq(#rawget(ckpt, "loras_applied"), 1)
    h:remove()
    H.eq(stores.unet:count(), 0); H.eq(stores[1]:count(), 0)
    h:remove() -- idempotent
    H.eq(#rawget(ckpt, "loras_applied"), 0)
  end)

test("sdxl tiny: te1 / te2 (OpenCLIP rows) and sgm UNet names, PEFT spelling; inspect says sdxl", function()
  local ckpt <close> = kiln.load_checkpoint(T.ckpt_file("sdxl"))
  local stores = with_fake_stores(ckpt)
  local te2 = rawget(ckpt.clip, "encoders")[2].enc.config
  local W = te2.width
  local path = save("peft_sdxl.safetensors", {
    ["text_encoder_2.text_model.encoder.layers.0.self_attn.k_proj.lora_A.weight"] = r({ 2, W }, 1),
    ["text_encoder_2.text_model.encoder.layers.0.self_attn.k_proj.lora_B.weight"] = r({ W, 2 }, 2),
    ["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"] = r({ 2, 64 }, 3),
    ["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight"] = r({ 64, 2 }, 4),
  })
  local info = kiln.lora.inspect(path)
  H.eq(info.format, "peft"); H.eq(info.family, "sdxl"); H.eq(info.parts.clip, 2); H.eq(info.parts.unet, 0)
  H.eq(info.keys, 4)
  local h = ckpt:add_lora(path)
  H.eq(h.patched, 2); H.eq(#h.unmatched, 0)
  local _, p = next(stores[2].patches)
  H.truthy(p.target:match("^conditioner%.embedders%.1%.model%.transformer%.resblocks%.0%.attn%.in_proj_weight$"), p.target)
  H.eq(p.spec.rows[1], W + 1); H.eq(p.spec.rows[2], W)
  H.eq(stores[1]:count(), 1)
  h:remove()
end)

test("bad input: not a LoRA, a .pt file, another family's LoRA, a missing file", function()
  local ckpt <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  with_fake_stores(ckpt)
  local p = save("not_a_lora.safetensors", { ["model.diffusion_model.out.2.weight"] = r({ 4, 4 }, 1) })
  H.raises(function() ckpt:add_lora(p) end, "not a LoRA", "full checkpoint")
  H.raises(function() kiln.lora.inspect(p) end, "not a LoRA")
  p = save("emb.safetensors", { emb_params = r({ 2, 64 }, 1) })
  H.raises(function() ckpt:add_lora(p) end, "not a LoRA", "embedding")
  H.raises(function() ckpt:add_lora("x.pt") end, "x.pt", "pickle")
  H.raises(function() ckpt:add_lora(T.TMP .. "/missing.safetensors") end, "missing.safetensors")
  p = save("xl_on_sd1.safetensors", {
    ["lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"] = r({ 2, 1280 }, 1),
    ["lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight"] = r({ 1280, 2 }, 2),
  })
  H.raises(function() ckpt:add_lora(p) end, "an SDXL LoRA", "text encoder width 1280", "SD 1.x checkpoint")
  p = save("wrong_shape.safetensors", {
    ["lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"] = r({ 2, 32 }, 1),
    ["lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight"] = r({ 32, 2 }, 2),
  })
  H.raises(function() ckpt:add_lora(p) end, "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight",
    "[32, 32]", "[64, 64]")
  H.raises(function() ckpt:add_lora(p, { strength = 1 }) end, "unknown option 'strength'")
end)

test("load_checkpoint {loras, embeddings}: ckpt:find_lora searches the folder and its subfolders", function()
  local dir = T.TMP .. "/loras"
  assert(os.execute("mkdir -p '" .. dir .. "/style/deep'"))
  local a = dir .. "/style/deep/Ink.safetensors"
  kiln.save_safetensors(a, { ["x.lora_up.weight"] = kiln.zeros({ 1, 1 }) })
  local ckpt <close> = kiln.load_checkpoint(T.ckpt_file("sd1"), { loras = dir, embeddings = dir })
  H.eq(ckpt.lora_dir, dir); H.eq(ckpt.embedding_dir, dir)
  H.eq(ckpt:find_lora("Ink"), a)
  H.eq(ckpt:find_lora("Ink.safetensors"), a)
  H.raises(function() ckpt:find_lora("ink") end, "not found", dir)
  local plain <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  H.raises(function() plain:find_lora("Ink") end, "{loras = DIR}")
  H.raises(function() kiln.load_checkpoint(T.ckpt_file("sd1"), { loras = 1 }) end, "loras must be a folder")
  os.remove(a)
  os.remove(dir .. "/style/deep"); os.remove(dir .. "/style"); os.remove(dir)
end)

-- ---------------------------------------------------------------- the real stores

local TO_K = "down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k"
local TO_K_NAME = "model.diffusion_model.input_blocks.3.1.transformer_blocks.0.attn2.to_k.weight"

local function kohya_file(name, seed, alpha)
  local down, up = r({ 2, 64 }, seed), r({ 64, 2 }, seed + 1)
  local t = {
    ["lora_unet_" .. TO_K .. ".lora_down.weight"] = down, ["lora_unet_" .. TO_K .. ".lora_up.weight"] = up,
    ["lora_te_text_model_encoder_layers_0_self_attn_v_proj.lora_down.weight"] = r({ 2, 64 }, seed + 2),
    ["lora_te_text_model_encoder_layers_0_self_attn_v_proj.lora_up.weight"] = r({ 64, 2 }, seed + 3),
  }
  if alpha then t["lora_unet_" .. TO_K .. ".alpha"] = kiln.tensor(alpha):to("f16") end
  return save(name, t), up:matmul(down)
end

test("sd1 tiny, real store: merged = W + strength alpha/rank up down; stacking; strength 0; remove exact", function()
  if not have_patch then H.skip("this build's kiln.Model has no add_patch") end
  local ckpt <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local W0 = ckpt.unet:tensor(TO_K_NAME):clone()
  local p1, d1 = kohya_file("a.safetensors", 10, 1)
  local p2, d2 = kohya_file("b.safetensors", 20, nil)
  local h1 = ckpt:add_lora(p1, { unet = 0.7 })
  H.eq(h1.patched, 2)
  local want = W0 + d1 * (0.7 * 1 / 2)
  H.truthy(H.maxdiff(ckpt.unet:tensor(TO_K_NAME), want) < 1e-6, "one LoRA")
  local h2 = ckpt:add_lora(p2, { unet = -1.5, clip = 0 })
  H.eq(h2.patched, 1)
  want = W0 + d1 * 0.35 + d2 * -1.5
  H.truthy(H.maxdiff(ckpt.unet:tensor(TO_K_NAME), want) < 1e-6, "two stacked")
  local h0 = ckpt:add_lora(p1, { unet = 0, clip = 0 })
  H.eq(h0.patched, 0)
  h1:remove(); h2:remove(); h0:remove()
  H.eq(H.maxdiff(ckpt.unet:tensor(TO_K_NAME), W0), 0, "removed: the file's values")
  H.eq(ckpt.unet.model:patch_count(), 0)
  -- a LoRA outliving its checkpoint: removing it is a no-op, not an error
  local h3 = ckpt:add_lora(p1)
  ckpt:close()
  h3:remove()
end)

test("sd1 tiny, real store: low mode equals resident with a LoRA, before and after load", function()
  if not have_patch then H.skip("this build's kiln.Model has no add_patch") end
  local sim = false
  for _, d in ipairs(kiln.devices()) do sim = sim or d == "sim" end
  if not sim then H.skip("no sim device") end
  local ckpt <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local x, t, ctx = T.inputs(64)
  local p1 = kohya_file("c.safetensors", 30, 1)
  local before = ckpt.unet:forward(x, t, ctx)
  local prev = kiln.memory_mode("normal")
  local h = ckpt:add_lora(p1, { unet = 2 })
  ckpt.unet:load("sim")
  local resident = ckpt.unet:forward(x, t, ctx):to("cpu")
  ckpt.unet:unload()
  kiln.memory_mode("low")
  ckpt.unet:load("sim")
  local low = ckpt.unet:forward(x, t, ctx):to("cpu")
  H.truthy(H.maxdiff(low, resident) <= 1e-5, "low vs resident " .. H.maxdiff(low, resident))
  H.truthy(H.maxdiff(before, resident) > 1e-4, "the LoRA changes the output")
  h:remove()
  local after = ckpt.unet:forward(x, t, ctx):to("cpu")
  H.truthy(H.maxdiff(after, before) <= 1e-5, "removed in low mode " .. H.maxdiff(after, before))
  ckpt.unet:unload()
  kiln.memory_mode(prev or "normal")
end)

test("sd1 tiny as a diffusers folder: the same LoRA patches the same values", function()
  if not have_patch then H.skip("this build's kiln.Model has no add_patch") end
  local tensors = T.from_recipe("sd1")
  local dir = T.TMP .. "/dfolder"
  local unet_t, te_t = {}, {}
  for line in io.lines(T.GOLD .. "sd1.diffusers") do
    local orig, new = line:match("^([^\t#]+)\t(.*)$")
    if orig then
      local te = new:match("^text_encoder:(.*)$")
      if te then te_t[te] = tensors[orig]
      elseif orig:match("^model%.diffusion_model%.") then unet_t[new] = tensors[orig] end
    end
  end
  assert(os.execute("mkdir -p '" .. dir .. "/unet' '" .. dir .. "/text_encoder'"))
  local files = { dir .. "/unet/diffusion_pytorch_model.safetensors", dir .. "/text_encoder/model.safetensors" }
  kiln.save_safetensors(files[1], unet_t, { ["kiln.heads.unet"] = "2" })
  kiln.save_safetensors(files[2], te_t, {})
  local ok, err = pcall(function()
    local ckpt <close> = kiln.load_checkpoint(dir, { family = "sd1" })
    local single <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
    local p1 = kohya_file("d.safetensors", 40, 1)
    local h = ckpt:add_lora(p1)
    local hs = single:add_lora(p1)
    H.eq(h.patched, 2); H.eq(#h.unmatched, 0)
    local dname = "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight"
    H.eq(H.maxdiff(ckpt.unet:tensor(dname), single.unet:tensor(TO_K_NAME)), 0, "UNet weight")
    local te = "text_model.encoder.layers.0.self_attn.v_proj.weight"
    local a = rawget(ckpt.clip, "encoders")[1].enc.weights:tensor(te)
    local b = rawget(single.clip, "encoders")[1].enc.weights:tensor(te)
    H.eq(H.maxdiff(a, b), 0, "text encoder weight")
    h:remove(); hs:remove()
  end)
  for _, f in ipairs(files) do os.remove(f) end
  os.remove(dir .. "/unet"); os.remove(dir .. "/text_encoder"); os.remove(dir)
  if not ok then error(err, 0) end
end)

test("set_weight replaces a weight (as a difference from its value now); remove restores it", function()
  if not have_patch then H.skip("this build's kiln.Model has no add_patch") end
  local ckpt <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local name = "model.diffusion_model.input_blocks.3.1.proj_in.weight"
  local W0 = ckpt.unet:tensor(name):clone()
  local set = r({ 64, 64, 1, 1 }, 77)
  local h = ckpt:add_lora(save("set.safetensors", { ["lora_unet_down_blocks_1_attentions_0_proj_in.set_weight"] = set }))
  H.eq(h.patched, 1); H.eq(h.format, "lycoris-full")
  H.truthy(H.maxdiff(ckpt.unet:tensor(name), set) < 1e-6, "set")
  h:remove()
  H.eq(H.maxdiff(ckpt.unet:tensor(name), W0), 0)
end)

-- LCM-LoRA files are kohya-named LoRAs over every Linear and Conv of the UNet
-- (diffusers module names on SD 1.5 and on SDXL alike, time embedding and convs
-- included): such a layout loads whole.
for _, fam in ipairs({ "sd1", "sdxl" }) do
  test(fam .. " tiny: an LCM-LoRA layout (every UNet Linear / Conv, diffusers names) loads with no key left", function()
    if not have_patch then H.skip("this build's kiln.Model has no add_patch") end
    local ckpt <close> = kiln.load_checkpoint(T.ckpt_file(fam))
    local cfg = rawget(ckpt.unet, "config")
    local tensors, n = {}, 0
    for i, e in ipairs(require("kiln.unet").expected(cfg)) do
      local name, shape = e[1], e[2]
      if name:match("%.weight$") and (#shape == 2 or #shape == 4) then
        local key = "lora_unet_" .. lora.unet_to_diffusers(name, cfg.num_res_blocks):gsub("%.weight$", ""):gsub("%.", "_")
        local k4 = #shape == 4
        tensors[key .. ".lora_down.weight"] = r(k4 and { 2, shape[2], shape[3], shape[4] } or { 2, shape[2] }, i)
        tensors[key .. ".lora_up.weight"] = r(k4 and { shape[1], 2, 1, 1 } or { shape[1], 2 }, i + 1000)
        tensors[key .. ".alpha"] = kiln.tensor(8.0):to("f16")
        n = n + 1
      end
    end
    local info = kiln.lora.inspect(save("lcm_" .. fam .. ".safetensors", tensors))
    H.eq(info.format, "kohya"); H.eq(info.parts.unet, n)
    local h = ckpt:add_lora(T.TMP .. "/lcm_" .. fam .. ".safetensors")
    H.eq(#h.unmatched, 0); H.eq(h.patched, n)
    H.eq(ckpt.unet.model:patch_count(), n)
    h:remove()
  end)
end

-- ---------------------------------------------------------------- merged weights (goldens)

local GOLD = "tests/golden/lora/"

local function manifest()
  local f = io.open(GOLD .. "manifest.json", "r")
  if not f then H.skip(GOLD .. "manifest.json is absent (tests/golden/gen_lora.py writes it)") end
  local m = kiln.json.decode(f:read("a"))
  f:close()
  if not have_patch then H.skip("this build's kiln.Model has no add_patch") end
  return m
end

-- The store (UNet's or a text encoder's) that holds a checkpoint tensor.
local function store_of(ckpt, name)
  local m = ckpt.unet.model
  if m:has(name) then return m end
  for _, e in ipairs(rawget(ckpt.clip, "encoders")) do
    local s = e.enc.weights.store
    if s:has(name) then return s end
  end
  error("no part of the checkpoint holds " .. name)
end

local function value_of(ckpt, name) return store_of(ckpt, name):tensor(name):to("f32") end

local function sorted(list)
  local r = {}
  for i, v in ipairs(list) do r[i] = v end
  table.sort(r)
  return r
end

local ckpts = {}
local function golden_ckpt(name)
  if not ckpts[name] then ckpts[name] = kiln.load_checkpoint(T.ckpt_file(name)) end
  return ckpts[name]
end

-- merged weights within f32 rounding of PyTorch's (deltas summed in another order)
local function close_to(got, want, what)
  local d = H.maxdiff(got, want)
  local scale = math.max(1, want:abs():max())
  if d > 2e-5 * scale then error(fmt("%s: max difference %g", what, d), 2) end
end

test("golden: every format merges as PyTorch does, at each strength; patched / unmatched as the manifest says; " ..
  "remove gives the file's values back", function()
  local man = manifest()
  local n = 0
  for _, rec in ipairs(man.files) do
    local ckpt = golden_ckpt(rec.checkpoint)
    local path = GOLD .. rec.file
    local info = kiln.lora.inspect(path)
    H.eq(info.keys, rec.keys, rec.name .. " keys")
    if info.family then H.eq(info.family, rec.family, rec.name .. " family") end
    if #rec.unmatched == 0 then
      H.eq(info.parts.unet, rec.parts.unet, rec.name .. " unet modules")
      H.eq(info.parts.clip, rec.parts.clip, rec.name .. " clip modules")
    end
    for _, case in ipairs(rec.cases) do
      local base = {}
      for _, t in ipairs(case.tensors) do base[t] = value_of(ckpt, t):clone() end
      local h = ckpt:add_lora(path, { unet = case.unet, clip = case.clip })
      local what = fmt("%s at %g/%g", rec.name, case.unet, case.clip)
      H.eq(h.patched, rec.patched, what .. ": patched")
      H.eq(table.concat(h.unmatched, " "), table.concat(sorted(rec.unmatched), " "), what .. ": unmatched")
      local want = kiln.load_safetensors(GOLD .. case.expected)
      for _, t in ipairs(case.tensors) do
        close_to(value_of(ckpt, t), want[t]:reshape(value_of(ckpt, t).shape), what .. ": " .. t)
        n = n + 1
      end
      h:remove()
      for _, t in ipairs(case.tensors) do
        H.eq(H.maxdiff(value_of(ckpt, t), base[t]), 0, what .. ": removed: " .. t)
      end
    end
  end
  H.truthy(n > 0, "no tensors compared")
end)

test("golden: stacked LoRAs, and strength 0 changes nothing", function()
  local man = manifest()
  for _, st in ipairs(man.stacks) do
    local ckpt = golden_ckpt(st.checkpoint)
    local base = {}
    for _, t in ipairs(st.tensors) do base[t] = value_of(ckpt, t):clone() end
    local hs = {}
    for i, l in ipairs(st.loras) do hs[i] = ckpt:add_lora(GOLD .. l.file, { unet = l.unet, clip = l.clip }) end
    local want = kiln.load_safetensors(GOLD .. st.expected)
    for _, t in ipairs(st.tensors) do close_to(value_of(ckpt, t), want[t]:reshape(base[t].shape), "stack: " .. t) end
    local zero = ckpt:add_lora(GOLD .. st.loras[1].file, { unet = 0, clip = 0 })
    H.eq(zero.patched, 0)
    for _, t in ipairs(st.tensors) do close_to(value_of(ckpt, t), want[t]:reshape(base[t].shape), "stack + 0: " .. t) end
    zero:remove()
    for i = #hs, 1, -1 do hs[i]:remove() end
    for _, t in ipairs(st.tensors) do H.eq(H.maxdiff(value_of(ckpt, t), base[t]), 0, "stack removed: " .. t) end
  end
end)

test("golden: the networks' outputs with a merged LoRA (PyTorch), resident and in low mode", function()
  local man = manifest()
  local n = 0
  for _, rec in ipairs(man.files) do
    if rec.forward then
      local ckpt = golden_ckpt(rec.checkpoint)
      local G = kiln.load_safetensors(GOLD .. rec.forward)
      local h = ckpt:add_lora(GOLD .. rec.file)
      local x, t, ctx = T.inputs(64)
      local function window(ids)
        local r = {}
        for i, v in ipairs(ids) do r[i] = v end
        while #r < 77 do r[#r + 1] = 49407 end
        return r
      end
      local a = window({ 49406, 320, 1125, 539, 320, 2368, 49407 })
      local b = window({ 49406, 1000, 2000, 3000, 40000, 49000, 7, 11, 49407 })
      local enc = rawget(ckpt.clip, "encoders")[1].enc
      local d = H.maxdiff(enc:forward({ a, b }), G["clip.last"])
      H.truthy(d <= 1e-4, rec.name .. ": clip.last differs by " .. d)
      local prev = kiln.memory_mode("normal")
      local out = ckpt.unet:forward(x, t, ctx)
      d = H.maxdiff(out, G["unet.out"])
      H.truthy(d <= 1e-4, rec.name .. ": unet.out differs by " .. d)
      local sim = false
      for _, dv in ipairs(kiln.devices()) do sim = sim or dv == "sim" end
      if sim then
        ckpt.unet:load("sim")
        local res = ckpt.unet:forward(x, t, ctx):to("cpu")
        ckpt.unet:unload()
        kiln.memory_mode("low")
        ckpt.unet:load("sim")
        local low = ckpt.unet:forward(x, t, ctx):to("cpu")
        ckpt.unet:unload()
        d = H.maxdiff(low, res)
        H.truthy(d <= 1e-5, rec.name .. ": low mode vs resident " .. d)
      end
      kiln.memory_mode(prev or "normal")
      h:remove()
      n = n + 1
    end
  end
  if n == 0 then H.skip("the manifest names no forward golden") end
end)

for _, c in pairs(ckpts) do c:close() end
T.cleanup()
H.done()
