-- The VAE's tile = "auto" chooses its tile through the meta device: the candidate
-- tiles of its own lockstep tiled run (image-wide GroupNorm statistics) are dry-run at
-- the real size, and the largest whose predicted peak fits what the budget leaves is
-- taken. The chosen tile then fits the budget in the real run (no out-of-memory retry),
-- and the prediction is never under what the real run adds.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local test, truthy = H.test, H.truthy

local path = H.demo_model("vae auto tile")
H.need_devices("vae auto tile through meta", "sim", "meta")
kiln.set_quiet(true)
local tiling = require "kiln.tiling"
local MiB = 1024 * 1024

local function settle()
  collectgarbage(); collectgarbage()
  kiln.mem.empty_cache("sim")
end

-- the options tiling.decode hands auto_tile for this VAE
local function decode_opts(vae)
  return { scale = math.tointeger(vae.factor or vae.config.factor), unit = 1, cache = {}, key = "decode", tiled = true,
    tiled_x = function(zz, mo) return vae:_decode_tiles(zz, mo, nil) end }
end

test("decode: the tile is chosen by a dry run, fits the budget, and is never under-predicted", function()
  local ck <close> = kiln.load_checkpoint(path)
  local vae = ck.vae
  vae:load("sim")
  local z <close> = kiln.randn({ 1, 4, 48, 48 }, { seed = 3 }):to("sim")
  settle()
  local old = kiln.mem.stats("sim").budget
  local base = kiln.mem.stats("sim").allocated
  for _, room in ipairs({ 6 * MiB, 4.5 * MiB }) do
    local budget = math.floor(base + room)
    kiln.mem.set_budget("sim", budget)
    local ok, err = pcall(function()
      local f = decode_opts(vae)
      local t, m = tiling.auto_tile(function(x) return vae:_decode_untiled(x) end, z, f)
      truthy(m and m.method == "meta", "the tile was not chosen through meta: " .. tostring(m and m.method))
      truthy(t < 48, ("room %d: tile %d, untiled (the full decode should not fit)"):format(room, t))
      truthy(m.need <= 0.85 * room, ("room %d: chosen tile %d predicted at %d bytes"):format(room, t, m.need))
      -- the real run of that tile, measured on sim
      settle()
      local ooms = kiln.mem.stats("sim").ooms
      kiln.mem.reset_peak("sim")
      local img = vae:decode(z, { tile = t })
      local st = kiln.mem.stats("sim")
      img:free()
      local measured = st.peak - base
      print(("# room %.2f MiB: tile %d, predicted %d, measured %d bytes (x%.4f)"):format(room / MiB, t, m.need,
        measured, m.need / measured))
      truthy(st.ooms == ooms, "the chosen tile ran out of memory and was retried")
      truthy(st.peak_reserved <= budget, ("reserved %d over the budget %d"):format(st.peak_reserved, budget))
      truthy(m.need >= measured, ("predicted %d < measured %d bytes"):format(m.need, measured))
      -- and the public path picks the same way and fits
      settle()
      ooms = kiln.mem.stats("sim").ooms
      local img2 = vae:decode(z, { tile = "auto" })
      truthy(kiln.mem.stats("sim").ooms == ooms, "tile = \"auto\" ran out of memory")
      truthy(kiln.mem.stats("sim").peak_reserved <= budget, "tile = \"auto\" went over the budget")
      img2:free()
    end)
    kiln.mem.set_budget("sim", old)
    if not ok then error(err, 0) end
  end
  vae:unload()
  settle()
end)

test("encode: the tile is chosen by a dry run and fits the budget", function()
  local ck <close> = kiln.load_checkpoint(path)
  local vae = ck.vae
  vae:load("sim")
  local f = math.tointeger(vae.factor or vae.config.factor)
  local img <close> = kiln.rand({ 1, 3, 48 * f, 48 * f }, { seed = 4 }):to("sim")
  settle()
  local old = kiln.mem.stats("sim").budget
  local base = kiln.mem.stats("sim").allocated
  local budget = base + 4 * MiB
  kiln.mem.set_budget("sim", budget)
  local ok, err = pcall(function()
    local t, m = tiling.auto_tile(function(x) return vae:_encode_untiled(x) end, img, { scale = 1 / f, unit = f,
      cache = {}, key = "encode", tiled = true, tiled_x = function(xx, mo) return vae:_encode_tiles(xx, mo) end })
    truthy(m and m.method == "meta", "the tile was not chosen through meta")
    settle()
    local ooms = kiln.mem.stats("sim").ooms
    kiln.mem.reset_peak("sim")
    local z = vae:encode(img, { tile = t })
    local st = kiln.mem.stats("sim")
    z:free()
    print(("# encode: tile %d, predicted %d, measured %d bytes"):format(t, m.need, st.peak - base))
    truthy(st.ooms == ooms, "the chosen tile ran out of memory")
    truthy(st.peak_reserved <= budget, "over the budget")
    truthy(m.need >= st.peak - base, ("predicted %d < measured %d"):format(m.need, st.peak - base))
  end)
  kiln.mem.set_budget("sim", old)
  vae:unload()
  settle()
  if not ok then error(err, 0) end
end)

H.done()
