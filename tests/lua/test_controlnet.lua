-- kiln.controlnet: a tiny SD 1.x ControlNet rebuilt from the recipe of
-- tests/golden/gen_controlnet.py (seeded kiln.randn = torch.randn) and compared with
-- that independent PyTorch ControlNet: the residuals for a batch-1 hint with batch 2,
-- the tiny SD 1.x UNet with them added (ControlledUnetModel), strength, the prefix-less
-- layout, the hyper-parameters of the real SD 1.5 / 2.1 key lists, and bad input; a
-- tiny SDXL ControlNet over the tiny SDXL UNet against the same generator.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local controlnet = require "kiln.controlnet"
local test, eq, raises = H.test, H.eq, H.raises

local T = require "tiny_sd"

local SHARED = os.getenv("KILN_SHARED") or "../shared"
local GOLD = "tests/golden/controlnet/"
local G = kiln.load_safetensors(GOLD .. "sd1.safetensors")
local TOL = 1e-4

local shape_of = H.shape_of

-- max |a - b| / max(1, max |b|), after checking shapes
local close = H.close_rel -- (a, b, tol, what)

local report = {}
local function note(name, err) report[#report + 1] = ("%s %.2g"):format(name, err) end

-- the recipe (relative to tiny_sd's golden folder) saved as a file, with or without
-- the control_model. prefix
local function cn_file(prefix)
  local t = T.build_recipe("../controlnet/sd1")
  local out = {}
  for k, v in pairs(t) do out[prefix .. k:gsub("^control_model%.", "")] = v end
  local p = T.tmp("cn" .. (prefix == "" and "-bare" or "") .. ".safetensors")
  kiln.save_safetensors(p, out, { ["kiln.heads.unet"] = "2" })
  return p
end

local CN = cn_file("control_model.")

test("controlnet: hyper-parameters and residual shapes (original layout, batch-1 hint)", function()
  local cn <close> = kiln.load_controlnet(CN)
  eq(cn.config.model_channels, 32)
  eq(cn.config.hint_channels, 3)
  eq(#cn.config.hint, 8)
  local x, t, ctx = T.inputs(64)
  local res = cn:forward(x, t, ctx, G.hint)
  eq(#res, 5, "input blocks + middle")
  for i, r in ipairs(res) do note("cn." .. (i - 1), close(r, G["cn." .. (i - 1)], TOL, "residual " .. (i - 1))) end
end)

test("controlnet: controlled UNet output (ControlledUnetModel)", function()
  local cn <close> = kiln.load_controlnet(CN)
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local x, t, ctx = T.inputs(64)
  local res = cn:forward(x, t, ctx, G.hint)
  note("unet.control", close(ck.unet:forward(x, t, ctx, nil, { control = res }), G["unet.control"], TOL, "unet"))
  raises(function() ck.unet:forward(x, t, ctx, nil, { control = { res[1] } }) end, "control has 1 residuals")
end)

test("controlnet: free_control hands the residuals to the UNet (freed at last use, also on error)", function()
  local cn <close> = kiln.load_controlnet(CN)
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local x, t, ctx = T.inputs(64)
  local dev = kiln.default_device()
  collectgarbage(); collectgarbage()
  local base = kiln.mem.stats(dev).allocated
  local res = cn:forward(x, t, ctx, G.hint)
  local out = ck.unet:forward(x, t, ctx, nil, { control = res, free_control = true })
  close(out, G["unet.control"], TOL, "unet")
  out:free()
  for i, r in ipairs(res) do eq(r, false, "residual " .. i .. " taken over") end
  local res2 = cn:forward(x, t, ctx, G.hint)
  local bad = kiln.zeros({ 2, 3, 8, 8 }) -- wrong channels
  raises(function() ck.unet:forward(bad, t, ctx, nil, { control = res2, free_control = true }) end)
  bad:free()
  for i, r in ipairs(res2) do eq(r, false, "residual " .. i .. " freed on error") end
  collectgarbage(); collectgarbage()
  eq(kiln.mem.stats(dev).allocated, base, "allocated bytes back to the baseline")
end)

test("controlnet: opts.cache keeps the encoded hint across calls, same residuals", function()
  local cn <close> = kiln.load_controlnet(CN)
  local x, t, ctx = T.inputs(64)
  local cache = {}
  local a = cn:forward(x, t, ctx, G.hint, { cache = cache })
  local guided = cache.guided
  H.truthy(guided ~= nil and cache.hint == G.hint, "the encoded hint is kept")
  local b = cn:forward(x, t, ctx, G.hint, { cache = cache })
  H.truthy(cache.guided == guided, "reused, not recomputed")
  for i, r in ipairs(a) do
    eq(H.maxdiff(r, b[i]), 0, "residual " .. i)
    close(r, G["cn." .. (i - 1)], TOL, "residual " .. (i - 1))
    r:free(); b[i]:free()
  end
  local other = G.hint * 0.5
  local c = cn:forward(x, t, ctx, other, { cache = cache })
  H.truthy(cache.hint == other and cache.guided ~= guided, "another hint replaces the cached one")
  for _, r in ipairs(c) do r:free() end
  controlnet.free_cache(cache)
  eq(cache.guided, nil)
  other:free()
end)

test("controlnet: strength scales the residuals; batch-2 hint = batch-1 hint", function()
  local cn <close> = kiln.load_controlnet(CN)
  local x, t, ctx = T.inputs(64)
  local h2 = kiln.cat({ G.hint, G.hint }, 1)
  local res = cn:forward(x, t, ctx, h2, { strength = 0.5 })
  for i, r in ipairs(res) do close(r, G["cn." .. (i - 1)] * 0.5, TOL, "half residual " .. (i - 1)) end
end)

test("controlnet: layout without the control_model. prefix", function()
  local cn <close> = kiln.load_controlnet(cn_file(""))
  local x, t, ctx = T.inputs(64)
  local res = cn:forward(x, t, ctx, G.hint)
  close(res[#res], G["cn." .. (#res - 1)], TOL, "middle residual")
end)

-- diffusers names: the UNet's from tests/golden/sd/sd1.diffusers, the ControlNet's own
local function diffusers_file()
  local names = {}
  for line in io.lines(T.GOLD .. "sd1.diffusers") do
    local o, d = line:match("^model%.diffusion_model%.(%S+)\t(%S+)$")
    if o then names[o] = d end
  end
  local t = T.build_recipe("../controlnet/sd1")
  local out = {}
  for k, v in pairs(t) do
    local o = k:gsub("^control_model%.", "")
    local d = names[o]
    local i, rest = o:match("^input_hint_block%.(%d+)%.(.*)$")
    if i then
      i = tonumber(i)
      d = i == 0 and "controlnet_cond_embedding.conv_in." .. rest
        or i == 14 and "controlnet_cond_embedding.conv_out." .. rest
        or ("controlnet_cond_embedding.blocks.%d.%s"):format(i // 2 - 1, rest)
    end
    i, rest = o:match("^zero_convs%.(%d+)%.0%.(.*)$")
    if i then d = ("controlnet_down_blocks.%s.%s"):format(i, rest) end
    rest = o:match("^middle_block_out%.0%.(.*)$")
    if rest then d = "controlnet_mid_block." .. rest end
    assert(d, "no diffusers name for " .. o)
    out[d] = v
  end
  local dir = T.tmp("cn-diffusers")
  assert(os.execute("mkdir -p '" .. dir .. "'"))
  local p = T.tmp("cn-diffusers/diffusion_pytorch_model.safetensors")
  kiln.save_safetensors(p, out, { ["kiln.heads.unet"] = "2" })
  return dir, p
end

test("controlnet: diffusers layout (folder)", function()
  local dir = diffusers_file()
  local cn <close> = kiln.load_controlnet(dir)
  local x, t, ctx = T.inputs(64)
  local res = cn:forward(x, t, ctx, G.hint)
  for i, r in ipairs(res) do note("diffusers.cn." .. (i - 1), close(r, G["cn." .. (i - 1)], TOL, "residual " .. (i - 1))) end
end)

test("controlnet: SDXL (label_emb, depth 2, head size 16) and its controlled UNet", function()
  local GX = kiln.load_safetensors(GOLD .. "sdxl.safetensors")
  local t = T.build_recipe("../controlnet/sdxl")
  local p = T.tmp("cn-sdxl.safetensors")
  kiln.save_safetensors(p, t, { ["kiln.head_dim.unet"] = "16" })
  for _, v in pairs(t) do v:free() end
  local cn <close> = kiln.load_controlnet(p)
  eq(cn.config.family, "sdxl")
  eq(cn.config.context_dim, 128)
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sdxl"))
  eq(ck.family, "sdxl")
  local x, tt, ctx = T.inputs(128)
  raises(function() cn:forward(x, tt, ctx, GX.hint) end, "needs y")
  local res = cn:forward(x, tt, ctx, GX.hint, GX.y)
  eq(#res, 5, "input blocks + middle")
  for i, r in ipairs(res) do note("sdxl.cn." .. (i - 1), close(r, GX["cn." .. (i - 1)], TOL, "residual " .. (i - 1))) end
  local out = ck.unet:forward(x, tt, ctx, GX.y, { control = res, free_control = true })
  note("sdxl.unet.control", close(out, GX["unet.control"], TOL, "unet"))
  out:free()
end)

-- a shape list of $KILN_SHARED/sd-keys as name -> shape
local function key_shapes(file)
  local f = io.open(SHARED .. "/sd-keys/" .. file)
  if not f then return nil end
  local s = {}
  for line in f:lines() do
    local n, sh = line:match("^(%S+)\t(%S.*)$")
    if n then s[n] = T.parse_shape(sh) end
  end
  f:close()
  return s
end

test("controlnet: hyper-parameters of the real SD 1.5 and 2.1 ControlNets", function()
  local s15, s21 = key_shapes("controlnet-sd15.txt"), key_shapes("controlnet-sd21.txt")
  if not s15 then H.skip("no " .. SHARED .. "/sd-keys") end
  local checkpoint = require "kiln.checkpoint"
  local c = controlnet.config(checkpoint.sub(s15, "control_model."), { heads = 8 })
  eq(c.model_channels, 320); eq(table.concat(c.channel_mult, ","), "1,2,4,4"); eq(c.context_dim, 768)
  local n = 0
  for _ in pairs(s15) do n = n + 1 end
  eq(#controlnet.expected(c), n, "every tensor of the SD 1.5 ControlNet is read")
  if s21 then
    local sub = checkpoint.sub(s21, "control_model.")
    local c2 = controlnet.config(sub, { head_dim = 64 })
    eq(c2.context_dim, 1024)
  end
end)

test("controlnet: bad input", function()
  local cn <close> = kiln.load_controlnet(CN)
  local x, t, ctx = T.inputs(64)
  raises(function() cn:forward(x, t, ctx, kiln.zeros({ 1, 3, 32, 32 })) end, "hint must be")
  local ck = T.ckpt_file("sd1")
  raises(function() kiln.load_controlnet(ck) end, "not a ControlNet")
  local flux = T.tmp("flux-cn.safetensors")
  kiln.save_safetensors(flux, { ["controlnet_x_embedder.weight"] = kiln.zeros({ 4, 4 }) })
  raises(function() kiln.load_controlnet(flux) end, "a Flux ControlNet", "SD 1.x, 2.x and SDXL")
end)

print("# max relative error: " .. table.concat(report, ", "))
T.cleanup()
H.done()
