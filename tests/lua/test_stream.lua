-- Weights through the store in every memory mode, and low-mode weight streaming
-- (scripts/kiln/stream.lua) on the sim device with the tiny checkpoints of sd_test:
-- low-mode outputs equal high-mode ones, the device peak stays below the weights'
-- size, nothing is left on the device after a forward (also after an error), the
-- prefetch runs on the copy thread while a block computes (counters and a trace), and
-- a whole txt2img in low / none mode gives the high-mode image.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local T = require "tiny_sd"
local test, eq, truthy, raises = H.test, H.eq, H.truthy, H.raises

local MiB = 1024 * 1024
local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end

local function need_sim() if not has_sim then H.skip("no sim device") end end

local function reset()
  kiln.memory_mode("normal")
  if has_sim then
    kiln.mem.empty_cache("sim")
    kiln.mem.set_budget("sim", 8 * 1024 * MiB)
  end
  collectgarbage(); collectgarbage()
end

local function maxdiff(a, b)
  eq(table.concat(a.shape, ","), table.concat(b.shape, ","), "shape")
  return (a:to("cpu"):to("f32") - b:to("cpu"):to("f32")):abs():max()
end

-- Runs fn with the sim peak reset first; returns fn's result and the peak above what
-- was allocated before.
local function with_peak(fn)
  collectgarbage(); collectgarbage()
  local base = kiln.mem.stats("sim").allocated
  kiln.mem.reset_peak("sim")
  local r = fn()
  return r, kiln.mem.stats("sim").peak - base
end

local report = {}
if kiln.set_quiet then kiln.set_quiet(true) end -- no progress lines from the pipeline

test("UNet: low mode equals high mode, peak below the weights, nothing left on the device", function()
  need_sim(); reset()
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local x, t, ctx = T.inputs(64)
  kiln.memory_mode("high")
  collectgarbage(); collectgarbage()
  local sim0 = kiln.mem.stats("sim").allocated
  ck.unet:load("sim")
  local r_sim, high_peak = with_peak(function() return ck.unet:forward(x, t, ctx) end)
  local ref = r_sim:to("cpu")
  r_sim:free()
  local weights = ck.unet:bytes("sim")
  truthy(weights > 0, "high mode: the weights are on sim")
  ck.unet:unload()
  -- the forward freed every handle it was given: unload gives the memory back now
  eq(kiln.mem.stats("sim").allocated, sim0, "sim bytes after unload, without a GC")

  kiln.memory_mode("low")
  ck.unet:load("sim")
  eq(ck.unet:bytes("sim"), 0, "low mode: load keeps the weights on the host")
  eq(ck.unet.device, "sim", "low mode: sim is the streaming target")
  truthy(tostring(ck.unet):find("streamed to sim", 1, true), tostring(ck.unet))
  local before = ck.unet:stats()
  local out, low_peak = with_peak(function() return ck.unet:forward(x, t, ctx) end)
  eq(out.device, "sim")
  local d = maxdiff(out, ref)
  truthy(d <= 1e-5, "low vs high max difference " .. d)
  eq(ck.unet:bytes("sim"), 0, "no UNet bytes on sim after the forward")
  eq(ck.unet.residency.device, 0)
  eq(ck.unet.pinned, false, "pinned only while the forward runs")
  truthy(low_peak < weights, ("low-mode peak %d < weights %d"):format(low_peak, weights))
  -- high mode holds all the weights plus its activation peak
  high_peak = high_peak + weights
  local st = ck.unet:stats()
  local blocks = #ck.unet.streamer.blocks
  eq(blocks, 2 + #ck.unet.plan.input + 1 + #ck.unet.plan.output, "blocks: time_embed, input, middle, output, out")
  local copies = (st.fetches - before.fetches) + (st.prefetches - before.prefetches)
  eq(copies, st.tensors, "every tensor copied once per forward")
  truthy(st.prefetches - before.prefetches > 0, "prefetch copies")
  truthy(st.prefetch_thread ~= 0, "prefetch thread recorded")
  report[#report + 1] = ("unet: weights %d B, peak high %d B, low %d B (%.0f%%), %d fetched + %d prefetched (%d hits, %d waits)")
      :format(weights, high_peak, low_peak, 100 * low_peak / weights, st.fetches - before.fetches,
        st.prefetches - before.prefetches, st.prefetch_hits - before.prefetch_hits, st.prefetch_waits - before.prefetch_waits)
  out:free()
  ck.unet:unload()
  reset()
end)

test("VAE and CLIP: low mode equals high mode, nothing left on the device", function()
  need_sim(); reset()
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local z = kiln.randn({ 1, 4, 8, 8 }, { seed = 3 })
  local img = (kiln.randn({ 1, 3, 16, 16 }, { seed = 4 }) * 0.25 + 0.5):clamp(0, 1)
  local ids = { 49406, 320, 1125, 539, 320, 2368, 49407 }
  while #ids < 77 do ids[#ids + 1] = 49407 end
  local function run()
    ck.vae:load("sim"); ck.clip:load("sim")
    local enc = ck.clip.encoders[1].enc
    local r = {
      dec = ck.vae:decode(z):to("cpu"), enc = ck.vae:encode(img):to("cpu"),
      last = enc:forward(ids):to("cpu"), skip = enc:forward(ids, { layer = -2 }):to("cpu"),
      raw = enc:forward(ids, { layer = 1, final_norm = false }):to("cpu"),
    }
    return r
  end
  kiln.memory_mode("high")
  local ref = run()
  local vw, cw = ck.vae:bytes("sim"), ck.clip:bytes("sim")
  ck.vae:unload(); ck.clip:unload()
  kiln.memory_mode("low")
  local got, peak = with_peak(run)
  for k, v in pairs(ref) do
    local d = maxdiff(got[k], v)
    truthy(d <= 1e-5, k .. ": low vs high max difference " .. d)
  end
  eq(ck.vae:bytes("sim"), 0, "no VAE bytes on sim")
  eq(ck.clip:bytes("sim"), 0, "no CLIP bytes on sim (an unused prefetch is released too)")
  truthy(peak < vw + cw, ("peak %d < weights %d"):format(peak, vw + cw))
  -- the token embedding is read on the host: never copied to the device
  local st = ck.clip:stats()
  eq(st.fetches + st.prefetches < st.tensors * 3, true, "embeddings are not streamed")
  report[#report + 1] = ("vae+clip: weights %d B, low-mode peak %d B"):format(vw + cw, peak)
  -- an untiled decode that runs out of memory mid-pass retries in tiles, streamed
  ck.vae:load("sim")
  local big = kiln.randn({ 1, 4, 48, 48 }, { seed = 5 })
  collectgarbage(); collectgarbage()
  local ooms = kiln.mem.stats("sim").ooms
  kiln.mem.set_budget("sim", kiln.mem.stats("sim").allocated + 3 * MiB)
  local ok, out = pcall(ck.vae.decode, ck.vae, big)
  kiln.mem.set_budget("sim", 8 * 1024 * MiB)
  truthy(ok, "decode under 3 MiB in low mode: " .. tostring(out))
  truthy(kiln.mem.stats("sim").ooms > ooms, "the untiled attempt ran out of memory")
  eq(table.concat(out.shape, ","), "1,3,96,96")
  eq(ck.vae:bytes("sim"), 0, "no VAE bytes on sim after the tiled retry")
  eq(ck.vae.pinned, false)
  out:free()
  ck.vae:unload(); ck.clip:unload()
  reset()
end)

test("prefetch overlaps compute: copies on the copy thread inside block spans", function()
  need_sim(); reset()
  local dir = T.tmp("trace.json")
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local _, t, ctx = T.inputs(64)
  local x = kiln.randn({ 2, 4, 32, 32 }, { seed = 1 }) -- blocks long enough to see the overlap
  kiln.memory_mode("low")
  ck.unet:load("sim")
  ck.unet:forward(x, t, ctx):free() -- warm up the copy thread
  -- one traced forward: its block spans and prefetch copies, and how many copies ran
  -- inside a block
  local function traced()
    kiln.trace.start(dir)
    local out = ck.unet:forward(x, t, ctx)
    kiln.trace.stop()
    out:free()
    local blocks, copies = {}, {}
    for line in io.lines(dir) do
      local name, cat, ts, dur, tid = line:match('^{"name":"([^"]*)","cat":"(%a+)","ph":"X","ts":([%d%.]+),"dur":([%d%.]+),"pid":%d+,"tid":(%d+)')
      if name then
        local e = { name = name, t0 = tonumber(ts), t1 = tonumber(ts) + tonumber(dur), tid = tonumber(tid) }
        if cat == "span" and name:sub(1, 5) == "unet " then blocks[#blocks + 1] = e end
        if cat == "prefetch" then copies[#copies + 1] = e end
      end
    end
    eq(#blocks, #ck.unet.streamer.blocks, "one span per block")
    truthy(#copies > 0, "prefetch copies in the trace")
    local overlapping = 0
    for _, c in ipairs(copies) do
      truthy(c.tid ~= blocks[1].tid, "copies run on another thread than the blocks")
      for _, b in ipairs(blocks) do
        if c.t0 < b.t1 and c.t1 > b.t0 then overlapping = overlapping + 1; break end
      end
    end
    return blocks, copies, overlapping
  end
  -- a machine busy with other processes can keep the copy thread off the cores for a
  -- whole forward: up to ten forwards (copies that never overlap fail all ten)
  local blocks, copies, overlapping
  for _ = 1, 10 do
    blocks, copies, overlapping = traced()
    if overlapping > 0 then break end
  end
  ck.unet:unload()
  truthy(overlapping > 0, "no prefetch copy overlapped a block's compute")
  report[#report + 1] = ("trace: %d block spans, %d prefetch copies, %d during a block"):format(#blocks, #copies, overlapping)
  reset()
end)

test("an error inside a streamed forward leaves nothing on the device", function()
  need_sim(); reset()
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local x, t, ctx = T.inputs(64)
  kiln.memory_mode("low")
  ck.unet:load("sim")
  collectgarbage(); collectgarbage()
  local used = kiln.mem.stats("sim").allocated
  kiln.mem.set_budget("sim", used + 300 * 1024) -- room for a few blocks, not the activations of all
  local ok, err = pcall(ck.unet.forward, ck.unet, x, t, ctx)
  kiln.mem.set_budget("sim", 8 * 1024 * MiB)
  eq(ok, false, "the forward should run out of memory")
  eq(type(err) == "table" and err.kind, "oom", "typed OOM: " .. tostring(err))
  eq(ck.unet:bytes("sim"), 0, "streamed copies released")
  eq(ck.unet.pinned, false, "unpinned")
  -- and the next forward works
  local out = ck.unet:forward(x, t, ctx)
  eq(out.device, "sim")
  out:free()
  eq(ck.unet:bytes("sim"), 0)
  ck.unet:unload()
  reset()
end)

test("mode none runs from host memory on the cpu; normal mode pins a running model", function()
  need_sim(); reset()
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local x, t, ctx = T.inputs(64)
  kiln.memory_mode("high")
  ck.unet:load("sim")
  local ref = ck.unet:forward(x, t, ctx):to("cpu")
  ck.unet:unload()
  kiln.memory_mode("none")
  ck.unet:load("sim")
  eq(ck.unet:bytes("sim"), 0)
  truthy(ck.unet:bytes("cpu") > 0, "loaded to the cpu")
  local out = ck.unet:forward(x, t, ctx)
  eq(out.device, "cpu")
  truthy(maxdiff(out, ref) <= 1e-5, "none vs high")
  ck.unet:unload()
  -- normal mode: the activations of a decode under a small budget cannot evict the
  -- VAE's own weights (it is pinned while it runs): the decode retries in tiles
  kiln.memory_mode("normal")
  ck.vae:load("sim")
  local vb = ck.vae:bytes("sim")
  local z = kiln.randn({ 1, 4, 48, 48 }, { seed = 5 })
  collectgarbage(); collectgarbage()
  kiln.mem.set_budget("sim", kiln.mem.stats("sim").allocated + 3 * MiB)
  local ok, img = pcall(ck.vae.decode, ck.vae, z)
  kiln.mem.set_budget("sim", 8 * 1024 * MiB)
  truthy(ok, tostring(img))
  eq(ck.vae:bytes("sim"), vb, "the VAE stayed resident")
  eq(ck.vae.pinned, false)
  ck.vae:unload()
  reset()
end)

-- a whitespace tokenizer over a few CLIP ids (as sd_test's)
local WORDS = { a = 320, photo = 1125, of = 539, cat = 2368, red = 736 }
local fake_tok = {
  encode = function(_, s)
    local r = {}
    for w in s:gmatch("%S+") do r[#r + 1] = assert(WORDS[w], "fake tokenizer: unknown word " .. w) end
    return r
  end,
  bos = function() return 49406 end,
  eos = function() return 49407 end,
}

test("txt2img: low and none modes give the high-mode image; parts are models in the summary", function()
  need_sim(); reset()
  local pipeline = require "kiln.pipeline"
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  ck.clip.tokenizer = fake_tok
  local opts = { prompt = "a photo of a cat", negative = "red", steps = 2, seed = 7, width = 32, height = 32,
    device = "sim", batch_cfg = false }
  local imgs, peaks = {}, {}
  for _, mode in ipairs({ "high", "low", "none" }) do
    kiln.memory_mode(mode)
    imgs[mode], peaks[mode] = with_peak(function() return pipeline.txt2img(ck, opts) end)
    eq(ck.unet:bytes("sim") + ck.vae:bytes("sim") + ck.clip:bytes("sim"), 0, mode .. ": nothing left on sim")
  end
  for _, mode in ipairs({ "low", "none" }) do
    local d = maxdiff(imgs[mode], imgs.high)
    truthy(d <= 1e-5, mode .. " vs high max difference " .. d)
  end
  truthy(peaks.low < peaks.high, ("low peak %d < high peak %d"):format(peaks.low, peaks.high))
  eq(peaks.none, 0, "none: nothing on sim")
  local s = kiln.mem.summary()
  for _, part in ipairs({ "unet", "vae", "clip" }) do
    truthy(s:find("\n  " .. part .. " ", 1, true), part .. " in the summary:\n" .. s)
  end
  report[#report + 1] = ("txt2img 32x32: sim peak high %d B, low %d B"):format(peaks.high, peaks.low)
  reset()
end)

test("parts are kiln.Model stores over exactly the tensors their network reads", function()
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"))
  local unet = require "kiln.unet"
  eq(ck.unet.name, "unet"); eq(ck.vae.name, "vae"); eq(ck.clip.name, "clip")
  eq(#ck.unet.model, #unet.expected(ck.unet.config))
  eq(ck.unet:where("model.diffusion_model.out.2.weight"), "mapped")
  eq(ck.unet.foo, nil, "unknown fields are nil, not tensor lookups")
  eq(ck.clip.clip_skip, nil)
  raises(function() ck.unet:tensor("first_stage_model.decoder.conv_in.weight") end, "unet", "first_stage_model.decoder.conv_in.weight")
  -- the streaming plan covers every tensor once
  local seen, n = {}, 0
  for _, b in ipairs(ck.unet.streamer.blocks) do
    for _, name in ipairs(b.real) do
      truthy(not seen[name], "twice: " .. name)
      seen[name] = true
      n = n + 1
    end
  end
  eq(n, #ck.unet.model)
end)

print("# " .. table.concat(report, "\n# "))
reset()
T.cleanup()
H.done()
