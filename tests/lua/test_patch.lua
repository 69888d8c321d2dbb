-- Weight patches through the Lua API (model:add_patch / remove_patch / patch_count)
-- on a small model made here: patched values against a delta computed with kiln's
-- own ops, add then remove bit for bit (f32 and f16 stores), strength 0, stacking
-- and removal in any order, a resident sim model patched in place, low-mode
-- streaming equal to resident, the mapped view never handed out, no memory growth,
-- owner "lora", and errors naming the field and the tensor.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p '" .. dir .. "'"))

local function rnd(shape, seed, s) return kiln.randn(shape, { seed = seed }) * (s or 1) end

-- the weights: linear, conv 3x3, an f16 copy of the linear, a fused qkv, an i64
local W = {
  ["lin.w"] = rnd({ 6, 4 }, 1),
  ["conv.w"] = rnd({ 6, 4, 3, 3 }, 2),
  ["qkv.w"] = rnd({ 12, 4 }, 3),
  ["qkv.b"] = rnd({ 12 }, 4),
  ids = kiln.arange(8),
}
W["h.w"] = W["lin.w"]:to("f16")
local MODEL = dir .. "/small.safetensors"
kiln.save_safetensors(MODEL, W, {})
local FILE = kiln.load_safetensors(MODEL)

-- LoRA factors (rank 2) for lin.w, and a second one
local up, down = rnd({ 6, 2 }, 10, 0.5), rnd({ 2, 4 }, 11, 0.5)
local up2, down2 = rnd({ 6, 2 }, 12, 0.5), rnd({ 2, 4 }, 13, 0.5)

local function f32(t) return t:to("cpu"):to("f32") end
local function same(a, b, msg) eq(H.maxdiff(f32(a), f32(b)), 0, msg) end
local function close(a, b, tol, msg)
  local d = H.maxdiff(f32(a), f32(b))
  truthy(d <= (tol or 1e-5), (msg or "values") .. (": max difference %g"):format(d))
end
local function lora_ref(w, scale, u, d) return f32(w) + kiln.matmul(u, d) * scale end

test("lora on a mapped f32 tensor: model:tensor shows the patch, remove is exact", function()
  local m <close> = kiln.model(MODEL)
  eq(m:patch_count(), 0)
  eq(m:where("lin.w"), "mapped")
  local id = m:add_patch("lin.w", { kind = "lora", up = up, down = down, scale = 0.75 })
  truthy(math.type(id) == "integer" and id > 0)
  eq(m:patch_count("lin.w"), 1); eq(m:patch_count("conv.w"), 0); eq(m:patch_count(), 1)
  -- never the file's view: a host copy holds the patched values
  close(m:tensor("lin.w"), lora_ref(FILE["lin.w"], 0.75, up, down), 1e-5, "patched")
  eq(m:where("lin.w"), "host")
  m:remove_patch(id)
  eq(m:patch_count(), 0)
  eq(m:where("lin.w"), "mapped")
  same(m:tensor("lin.w"), FILE["lin.w"], "after remove")
  raises(function() m:remove_patch(id) end, "no patch with id")
end)

test("add then remove is bit-exact for f32 and f16 stores (loaded on cpu)", function()
  local m <close> = kiln.model(MODEL)
  m:load("cpu")
  for _, name in ipairs({ "lin.w", "h.w" }) do
    local before = m:tensor(name):clone()
    local id = m:add_patch(name, { kind = "lora", up = up, down = down, scale = 1.3 })
    truthy(H.maxdiff(f32(m:tensor(name)), f32(before)) > 0, name .. " changed")
    eq(m:tensor(name).dtype, before.dtype)
    m:remove_patch(id)
    same(m:tensor(name), before, name)
  end
  -- f16: the patch is added in f32 before the cast, as the contract says
  local id = m:add_patch("h.w", { kind = "lora", up = up, down = down, scale = 1.3 })
  same(m:tensor("h.w"), lora_ref(FILE["h.w"], 1.3, up, down):to("f16"), "f16 rounding of the f32 sum")
  m:remove_patch(id)
end)

test("scale 0 changes nothing", function()
  local m <close> = kiln.model(MODEL)
  m:load("cpu")
  m:add_patch("lin.w", { kind = "lora", up = up, down = down, scale = 0 })
  m:add_patch("h.w", { kind = "lora", up = up, down = down, scale = 0 })
  same(m:tensor("lin.w"), FILE["lin.w"])
  same(m:tensor("h.w"), FILE["h.w"])
end)

test("two patches stack and remove in any order", function()
  local m <close> = kiln.model(MODEL)
  m:load("cpu")
  local both = lora_ref(lora_ref(FILE["lin.w"], 0.5, up, down), -0.8, up2, down2)
  for _, order in ipairs({ { 1, 2 }, { 2, 1 } }) do
    local a = m:add_patch("lin.w", { kind = "lora", up = up, down = down, scale = 0.5 })
    local b = m:add_patch("lin.w", { kind = "lora", up = up2, down = down2, scale = -0.8 })
    eq(m:patch_count("lin.w"), 2)
    close(m:tensor("lin.w"), both, 1e-5, "stacked")
    local ids = { a, b }
    m:remove_patch(ids[order[1]])
    local left = order[1] == 1 and lora_ref(FILE["lin.w"], -0.8, up2, down2) or lora_ref(FILE["lin.w"], 0.5, up, down)
    close(m:tensor("lin.w"), left, 1e-5, "one left")
    m:remove_patch(ids[order[2]])
    same(m:tensor("lin.w"), FILE["lin.w"], "none left")
  end
end)

test("a resident sim model is patched in place (views see it), f16 load", function()
  local m <close> = kiln.model(MODEL)
  m:load("sim", { dtype = "f16" })
  local view = m:tensor("conv.w")
  eq(view.device, "sim"); eq(view.dtype, "f16")
  local before = f32(view)
  local cu, cd = rnd({ 6, 3 }, 20, 0.3), rnd({ 3, 4, 3, 3 }, 21, 0.3)
  local id = m:add_patch("conv.w", { kind = "lora", up = cu, down = cd, scale = 2 })
  local want = (f32(FILE["conv.w"]) + kiln.matmul(cu, cd:reshape({ 3, 36 })):reshape({ 6, 4, 3, 3 }) * 2):to("f16")
  same(view, want, "the view handed out before the patch")
  eq(m:where("conv.w"), "device")
  m:remove_patch(id)
  same(view, before, "removed")
end)

test("every device present: a resident copy patched, then back to the file's bits", function()
  for _, dev in ipairs(kiln.devices()) do
    if dev ~= "meta" then
      local m <close> = kiln.model(MODEL)
      m:load(dev, { dtype = "f16" })
      local id = m:add_patch("lin.w", { kind = "lora", up = up:to(dev), down = down:to(dev), scale = 0.5 })
      eq(m:tensor("lin.w").device, dev)
      same(m:tensor("lin.w"), lora_ref(FILE["lin.w"], 0.5, up, down):to("f16"), dev)
      m:remove_patch(id)
      same(m:tensor("lin.w"), FILE["lin.w"]:to("f16"), dev .. " removed")
      m:unload()
      m:load(dev) -- a new device copy built with no patch left
      same(m:tensor("lin.w"), FILE["lin.w"], dev .. " reloaded")
    end
  end
end)

test("memory mode low on sim streams the same tensors as resident", function()
  local prev = kiln.memory_mode()
  local names = { "lin.w", "conv.w", "h.w", "qkv.w" }
  local function patch(m)
    m:add_patch("lin.w", { kind = "lora", up = up, down = down, scale = 0.9 })
    m:add_patch("h.w", { kind = "lora", up = up2, down = down2, scale = 0.4 })
    m:add_patch("qkv.w", { kind = "lora", up = rnd({ 4, 2 }, 30), down = rnd({ 2, 4 }, 31), scale = 1, rows = { 5, 4 } })
  end
  local ok, err = pcall(function()
    kiln.memory_mode("normal")
    local r <close> = kiln.model(MODEL)
    r:load("sim", { dtype = "f16" })
    patch(r)
    local want = {}
    for _, n in ipairs(names) do want[n] = f32(r:tensor(n)) end
    kiln.memory_mode("low")
    local s <close> = kiln.model(MODEL)
    s:load("sim", { dtype = "f16" })
    patch(s)
    -- prefetch on the copy thread, then fetch
    s:prefetch(names)
    s:fetch(names)
    eq(s:stats().prefetches, #names, "copies built on the copy thread")
    for _, n in ipairs(names) do same(s:tensor(n), want[n], "streamed " .. n) end
    s:release(names)
    -- patch again while nothing is fetched: the next fetch builds with it
    local id = s:add_patch("conv.w", { kind = "diff", diff = rnd({ 6, 4, 3, 3 }, 40, 0.1), scale = 1 })
    s:fetch({ "conv.w" })
    same(s:tensor("conv.w"), (f32(FILE["conv.w"]) + rnd({ 6, 4, 3, 3 }, 40, 0.1)):to("f16"), "diff streamed")
    s:remove_patch(id) -- rebuilds the fetched copy in place
    same(s:tensor("conv.w"), FILE["conv.w"]:to("f16"), "removed while fetched")
    s:release({ "conv.w" })
    eq(s.residency.device, 0)
  end)
  kiln.memory_mode(prev)
  if not ok then error(err, 0) end
end)

test("a patch added while prefetches are in flight waits for them", function()
  local prev = kiln.memory_mode()
  local ok, err = pcall(function()
    kiln.memory_mode("low")
    local m <close> = kiln.model(MODEL)
    m:load("sim")
    for round = 1, 20 do
      m:prefetch({ "lin.w", "conv.w", "qkv.w" })
      local id = m:add_patch("lin.w", { kind = "lora", up = up, down = down, scale = round })
      m:fetch({ "lin.w" })
      close(m:tensor("lin.w"), lora_ref(FILE["lin.w"], round, up, down), 1e-4, "round " .. round)
      m:remove_patch(id)
      same(m:tensor("lin.w"), FILE["lin.w"], "round " .. round)
      m:release({ "lin.w", "conv.w", "qkv.w" })
    end
  end)
  kiln.memory_mode(prev)
  if not ok then error(err, 0) end
end)

test("rows: a q/k/v slice of a fused weight and bias", function()
  local m <close> = kiln.model(MODEL)
  m:load("cpu")
  local ku, kd = rnd({ 4, 2 }, 50), rnd({ 2, 4 }, 51)
  local id = m:add_patch("qkv.w", { kind = "lora", up = ku, down = kd, scale = 1, rows = { 5, 4 } })
  local db = rnd({ 4 }, 52)
  local id2 = m:add_patch("qkv.b", { kind = "diff", diff = db, rows = { 9, 4 } })
  local w, fw = f32(m:tensor("qkv.w")), f32(FILE["qkv.w"])
  same(w:narrow(1, 1, 4), fw:narrow(1, 1, 4), "q untouched")
  close(w:narrow(1, 5, 4), fw:narrow(1, 5, 4) + kiln.matmul(ku, kd), 1e-5, "k patched")
  same(w:narrow(1, 9, 4), fw:narrow(1, 9, 4), "v untouched")
  local b, fb = f32(m:tensor("qkv.b")), f32(FILE["qkv.b"])
  same(b:narrow(1, 1, 8), fb:narrow(1, 1, 8))
  close(b:narrow(1, 9, 4), fb:narrow(1, 9, 4) + db, 1e-6, "v bias")
  m:remove_patch(id); m:remove_patch(id2)
  same(m:tensor("qkv.w"), FILE["qkv.w"]); same(m:tensor("qkv.b"), FILE["qkv.b"])
end)

test("a linear LoRA on a 1x1 conv and the reverse (reshape by element count)", function()
  local C = { ["c1.w"] = rnd({ 6, 4, 1, 1 }, 60), ["l.w"] = rnd({ 6, 4 }, 61) }
  local path = dir .. "/c1.safetensors"
  kiln.save_safetensors(path, C, {})
  local m <close> = kiln.model(path)
  m:add_patch("c1.w", { kind = "lora", up = up, down = down, scale = 1 })
  close(m:tensor("c1.w"), (f32(C["c1.w"]):reshape({ 6, 4 }) + kiln.matmul(up, down)):reshape({ 6, 4, 1, 1 }))
  m:add_patch("l.w", { kind = "lora", up = up:reshape({ 6, 2, 1, 1 }), down = down:reshape({ 2, 4, 1, 1 }), scale = 1 })
  close(m:tensor("l.w"), f32(C["l.w"]) + kiln.matmul(up, down))
end)

test("no allocated bytes grow over add / remove cycles", function()
  local m <close> = kiln.model(MODEL)
  m:load("cpu")
  local id = m:add_patch("lin.w", { kind = "lora", up = up, down = down, scale = 1 })
  m:remove_patch(id)
  collectgarbage(); collectgarbage()
  local base = kiln.mem.stats("cpu").allocated
  for i = 1, 30 do
    local a = m:add_patch("lin.w", { kind = "lora", up = up, down = down, scale = i })
    local b = m:add_patch("h.w", { kind = "loha", w1a = up, w1b = down, w2a = up2, w2b = down2, scale = 0.1 })
    m:remove_patch(b); m:remove_patch(a)
  end
  collectgarbage(); collectgarbage()
  eq(kiln.mem.stats("cpu").allocated, base)
  -- and a mapped model given its patched view back to the file
  local n <close> = kiln.model(MODEL)
  local before = kiln.mem.stats("cpu").allocated
  local id2 = n:add_patch("lin.w", { kind = "lora", up = up, down = down, scale = 1 })
  local t = n:tensor("lin.w")
  truthy(kiln.mem.stats("cpu").allocated > before, "a host copy was made")
  n:remove_patch(id2)
  t:free()
  collectgarbage(); collectgarbage()
  eq(kiln.mem.stats("cpu").allocated, before)
end)

test("owner 'lora': the file's memory is accounted to lora:NAME", function()
  local l <close> = kiln.model(MODEL, { name = "detail", owner = "lora" })
  l:load("cpu")
  truthy(kiln.mem.summary():find("lora:detail", 1, true), "summary names lora:detail")
  raises(function() kiln.model(MODEL, { owner = "vae" }) end, "owner", "lora")
end)

test("errors name the field and the tensor", function()
  local m <close> = kiln.model(MODEL)
  raises(function() m:add_patch("lin.x", { kind = "lora", up = up, down = down }) end, "no tensor 'lin.x'", "lin.w")
  raises(function() m:add_patch("lin.w", { kind = "lorra", up = up, down = down }) end, "'kind'", "lin.w", "loha")
  raises(function() m:add_patch("lin.w", { up = up, down = down }) end, "'kind'")
  raises(function() m:add_patch("lin.w", { kind = "lora", up = up }) end, "'lin.w'", "'down'")
  raises(function() m:add_patch("lin.w", { kind = "lora", up = up, down = 3 }) end, "'down'", "tensor", "'lin.w'")
  raises(function() m:add_patch("lin.w", { kind = "lora", up = up, dwon = down }) end, "unknown spec field 'dwon'")
  raises(function() m:add_patch("lin.w", { kind = "lora", up = up, down = down, scale = "x" }) end, "'scale'")
  raises(function() m:add_patch("lin.w", { kind = "lora", up = rnd({ 6, 3 }, 1), down = down }) end,
    "'up' [6,3]", "'down' [2,4]", "rank")
  raises(function() m:add_patch("lin.w", { kind = "lora", up = rnd({ 5, 2 }, 1), down = down }) end,
    "[5,4]", "'lin.w' [6,4]")
  raises(function() m:add_patch("lin.w", { kind = "lora", up = up, down = down, rows = { 4, 4 } }) end,
    "rows 4..7", "'lin.w' [6,4]")
  raises(function() m:add_patch("lin.w", { kind = "lora", up = up, down = down, rows = { 0, 1 } }) end, "'rows'")
  raises(function() m:add_patch("ids", { kind = "diff", diff = kiln.zeros({ 8 }) }) end, "'ids'", "not a floating-point")
  raises(function() m:add_patch("lin.w", { kind = "diff", up = up }) end, "'up' is not a factor of a diff patch")
  raises(function() m:add_patch("lin.w", { kind = "lora", up = up, down = down, dora_scale = kiln.ones({ 6 }) }) end,
    "'dora_scale' [6]", "'lin.w' [6,4]")
  raises(function() m:patch_count("nope") end, "no tensor 'nope'")
  eq(m:patch_count(), 0)
  local freed = rnd({ 2, 4 }, 1)
  freed:free()
  raises(function() m:add_patch("lin.w", { kind = "lora", up = up, down = freed }) end, "freed")
end)

test("the store keeps its own references to the factors", function()
  local m <close> = kiln.model(MODEL)
  m:load("cpu")
  local u, d = up:clone(), down:clone()
  m:add_patch("lin.w", { kind = "lora", up = u, down = d, scale = 1 })
  u:free(); d:free()
  collectgarbage()
  m:unload()
  m:load("cpu") -- rebuilt from the file and the factors the patch still holds
  close(m:tensor("lin.w"), lora_ref(FILE["lin.w"], 1, up, down))
end)

-- ---------------------------------------------------------------- goldens
-- tests/golden/gen_lora.py merged each file with an independent implementation of the
-- published arithmetic; here every module of those files becomes one add_patch on the
-- tiny checkpoint (factors found by the suffixes the layouts use, scale = strength x
-- the manifest's alpha/rank), the listed tensors are compared, then removed exactly.

local GOLD = "tests/golden/lora/"
local function read_all(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

local FACTORS = {
  lora = { up = { ".lora_up.weight", ".lora_B.weight", ".lora.up.weight", "_lora.up.weight" },
           down = { ".lora_down.weight", ".lora_A.weight", ".lora.down.weight", "_lora.down.weight" },
           mid = { ".lora_mid.weight" } },
  loha = { w1a = { ".hada_w1_a" }, w1b = { ".hada_w1_b" }, w2a = { ".hada_w2_a" }, w2b = { ".hada_w2_b" },
           t1 = { ".hada_t1" }, t2 = { ".hada_t2" } },
  lokr = { w1 = { ".lokr_w1" }, w1a = { ".lokr_w1_a" }, w1b = { ".lokr_w1_b" }, w2 = { ".lokr_w2" },
           w2a = { ".lokr_w2_a" }, w2b = { ".lokr_w2_b" }, t2 = { ".lokr_t2" } },
}

-- The patches of one manifest entry (nil when a factor is not found by suffix).
local function module_specs(mod, lf, strength)
  local specs = {}
  for _, tgt in ipairs(mod.targets) do
    local spec = { kind = mod.kind, scale = strength * mod.scale }
    if mod.kind == "diff" then
      spec.diff = lf[mod.key .. (tgt.tensor:match("bias$") and ".diff_b" or ".diff")]
      if not spec.diff then return nil end
    else
      for field, suffixes in pairs(FACTORS[mod.kind]) do
        for _, suf in ipairs(suffixes) do
          if lf[mod.key .. suf] then spec[field] = lf[mod.key .. suf]; break end
        end
      end
      if mod.kind == "lora" and not (spec.up and spec.down) then return nil end
      if mod.kind == "loha" and not spec.w1a then return nil end
    end
    if mod.dora then
      spec.dora_scale = lf[mod.key .. ".dora_scale"]
      spec.strength = strength
    end
    if tgt.rows and tgt.rows ~= kiln.json.null then spec.rows = { tgt.rows[1], tgt.rows[2] } end
    specs[#specs + 1] = { target = tgt.tensor, spec = spec }
  end
  return specs
end

local manifest_text = read_all(GOLD .. "manifest.json")
if not manifest_text then
  test("goldens of tests/golden/gen_lora.py", function() H.skip("tests/golden/lora/manifest.json is missing") end)
else
  local T = require "tiny_sd"
  local manifest = kiln.json.decode(manifest_text)
  local seen = {}
  local function tol_for(want)
    local m = want:abs():max()
    m = type(m) == "number" and m or m:item()
    return 2e-5 * math.max(1, m)
  end
  for _, file in ipairs(manifest.files) do
    test("golden " .. file.name, function()
      local ckpt <close> = kiln.model(T.ckpt_file(file.checkpoint), { name = file.checkpoint })
      local lf = kiln.load_safetensors(GOLD .. file.file)
      for _, case in ipairs(file.cases) do
        local ids, used = {}, 0
        for _, mod in ipairs(file.modules) do
          local specs = module_specs(mod, lf, mod.part == "unet" and case.unet or case.clip)
          if specs then
            used = used + 1
            for _, p in ipairs(specs) do
              if ckpt:has(p.target) then
                ids[#ids + 1] = ckpt:add_patch(p.target, p.spec)
                seen[mod.kind .. (mod.dora and "+dora" or "") .. (p.spec.mid and "+cp" or "") ..
                  ((p.spec.t1 or p.spec.t2) and "+tucker" or "") .. (p.spec.rows and "+rows" or "")] = true
              end
            end
          end
        end
        if used == 0 then H.skip("no module found by the suffixes of layout " .. file.layout) end
        local want = kiln.load_safetensors(GOLD .. case.expected)
        local checked = 0
        for _, name in ipairs(case.tensors) do
          if ckpt:patch_count(name) > 0 then
            local got = f32(ckpt:tensor(name))
            local d = H.maxdiff(got, want[name])
            truthy(d <= tol_for(want[name]), ("%s at %g: %s differs by %g"):format(file.name, case.unet, name, d))
            checked = checked + 1
          end
        end
        truthy(checked > 0, "nothing compared")
        for _, id in ipairs(ids) do ckpt:remove_patch(id) end
        eq(ckpt:patch_count(), 0)
        local base = kiln.load_safetensors(T.ckpt_file(file.checkpoint))
        for _, name in ipairs(case.tensors) do same(ckpt:tensor(name), base[name], "removed " .. name) end
      end
    end)
  end
  test("golden stacks (two files, one tensor each, added in order)", function()
    for _, stack in ipairs(manifest.stacks) do
      local ckpt <close> = kiln.model(T.ckpt_file(stack.checkpoint))
      local entries = {}
      for _, f in ipairs(manifest.files) do entries[f.file] = f end
      for _, l in ipairs(stack.loras) do
        local lf = kiln.load_safetensors(GOLD .. l.file)
        for _, mod in ipairs(entries[l.file].modules) do
          for _, p in ipairs(module_specs(mod, lf, mod.part == "unet" and l.unet or l.clip) or {}) do
            ckpt:add_patch(p.target, p.spec)
          end
        end
      end
      local want = kiln.load_safetensors(GOLD .. stack.expected)
      for _, name in ipairs(stack.tensors) do
        eq(ckpt:patch_count(name), #stack.loras, name)
        local d = H.maxdiff(f32(ckpt:tensor(name)), want[name])
        truthy(d <= tol_for(want[name]), ("%s differs by %g"):format(name, d))
      end
    end
  end)
  test("goldens exercised every kind", function()
    for _, k in ipairs({ "lora", "lora+cp", "loha", "loha+tucker", "lokr", "lokr+tucker", "diff", "diff+rows",
      "lora+rows", "lora+dora", "loha+dora" }) do
      truthy(seen[k], "no golden module of kind " .. k .. " (seen: " .. (function()
        local l = {}
        for s in pairs(seen) do l[#l + 1] = s end
        table.sort(l)
        return table.concat(l, ", ")
      end)() .. ")")
    end
  end)
  T.cleanup()
end

os.execute("rm -rf '" .. dir .. "'")
H.done()
