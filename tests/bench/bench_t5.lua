-- tests/bench/bench_t5.lua - T5-XXL (Flux's / SD 3.5's text encoder) with random weights:
-- encoding `tokens` tokens with f16 weights in bf16 and f32 arithmetic against PyTorch
-- (tests/bench/torch_t5.py, f32, same threads, same weights), peak RSS; streamed block by
-- block in a `budget` MiB sim budget against resident on sim; q8_0 GGUF, fp8 and scaled
-- fp8 files against the f16 file's output, beside PyTorch's own error on those files'
-- dequantised weights.
--
--   build/kiln tests/bench/bench_t5.lua [--blocks 24] [--tokens 256] [--threads 2]
--       [--budget 1024] [--dir DIR] [--fresh] [--clean] [--no-torch] [--repeat 1]
--       [--warmup 1] [--only f16,stream,quant] [--pool]
--
-- The weights (T5-XXL's shapes: d_model 4096, 64 heads of 64, d_ff 10240, vocab 32128,
-- `blocks` blocks; ComfyUI's t5xxl_fp16 names) are written once into DIR (default
-- $TMPDIR/kiln-bench-t5, about 9.5 GB for 24 blocks, plus the q8_0, fp8 and scaled fp8
-- files made from it) and reused by later runs (--fresh rewrites, --clean removes them
-- at the end). PyTorch holds the weights in f32: about 19 GB of memory for 24 blocks
-- (--blocks 2 measures the same per-block ratios on a smaller machine). --pool writes the
-- f16 file at disk speed from tests/bench/flux_weights.lua's pool of random f16 values
-- (|w| < 2^-5, norms 1; for timing and memory, not for the error columns), in a file of
-- its own mark.
local kiln = require "kiln"
local util = require "kiln.util"
local rw = dofile("tests/bench/random_weights.lua")

local o = util.parse_args(arg or {}, { blocks = 24, tokens = 256, threads = 2, budget = 1024, dir = "",
  fresh = false, clean = false, no_torch = false, pool = false, ["repeat"] = 1, warmup = 1, only = "f16,stream,quant" })
local fmt = string.format
local MiB = 1024 * 1024
local ps = dofile("tests/bench/proc_stats.lua")
local say, rss_peak = ps.say, ps.rss_peak
local only = {}
for w in o.only:gmatch("[^,]+") do only[w] = true end

kiln.set_quiet(true)
kiln.set_threads(o.threads)
local D, HEADS, DKV, FF, VOCAB = 4096, 64, 64, 10240, 32128
local NB = math.tointeger(o.blocks)
local dir = o.dir ~= "" and o.dir or ((os.getenv("TMPDIR") or "/tmp") .. "/kiln-bench-t5")
os.execute("mkdir -p '" .. dir .. "'")
local function file(name) return fmt("%s/%s-%d.%s", dir, name, NB, name == "q8_0" and "gguf" or "safetensors") end
local F16, Q8, FP8, FP8S, IDS = file("f16"), file("q8_0"), file("fp8"), file("fp8_scaled"), dir .. "/ids.safetensors"

-- ---------------------------------------------------------------- weights

local LINEAR = { q = { DKV * HEADS, D }, k = { DKV * HEADS, D }, v = { DKV * HEADS, D }, o = { D, DKV * HEADS } }
local MARK = o.pool and "t5xxl-pool-f16-v1" or "t5xxl-random-f16-v2"

local function write_f16()
  local t0 = kiln.time()
  if o.pool then
    local list = { { "shared.weight", { VOCAB, D } } }
    for b = 0, NB - 1 do
      local p = fmt("encoder.block.%d.layer.", b)
      for _, n in ipairs({ "q", "k", "v", "o" }) do list[#list + 1] = { p .. "0.SelfAttention." .. n .. ".weight", LINEAR[n] } end
      if b == 0 then list[#list + 1] = { p .. "0.SelfAttention.relative_attention_bias.weight", { 32, HEADS } } end
      list[#list + 1] = { p .. "0.layer_norm.weight", { D } }
      list[#list + 1] = { p .. "1.DenseReluDense.wi_0.weight", { FF, D } }
      list[#list + 1] = { p .. "1.DenseReluDense.wi_1.weight", { FF, D } }
      list[#list + 1] = { p .. "1.DenseReluDense.wo.weight", { D, FF } }
      list[#list + 1] = { p .. "1.layer_norm.weight", { D } }
    end
    list[#list + 1] = { "encoder.final_layer_norm.weight", { D } }
    local fw = dofile("tests/bench/flux_weights.lua")
    local bytes = fw.write_safetensors(F16, list, { matrix = "F16", vector = "F16",
      meta = { ["kiln.bench"] = MARK, num_heads = tostring(HEADS) } })
    say("wrote %s: %.2f GB (%.1f s)", F16, bytes / 1e9, kiln.time() - t0)
    return
  end
  local t, i = {}, 0
  -- rw.tensor's std is 1/sqrt(fan_in); `scale` brings it to T5's own initialisation
  -- (transformers' T5PreTrainedModel._init_weights): q (d_model d_kv)^-1/2, the relative
  -- bias d_model^-1/2, the embedding 1, so attention logits are of order one
  local function add(name, shape, scale)
    i = i + 1
    local w = rw.tensor(name, shape, 5000 + i)
    if scale then
      local f = w:to("f32")
      w:free()
      local s = f * scale
      f:free()
      w = s:to("f16")
      s:free()
    end
    t[name] = w
  end
  add("shared.weight", { VOCAB, D }, math.sqrt(D))
  for b = 0, NB - 1 do
    local p = fmt("encoder.block.%d.layer.", b)
    for _, n in ipairs({ "q", "k", "v", "o" }) do
      add(p .. "0.SelfAttention." .. n .. ".weight", LINEAR[n], n == "q" and 1 / math.sqrt(DKV) or nil)
    end
    if b == 0 then add(p .. "0.SelfAttention.relative_attention_bias.weight", { 32, HEADS }, math.sqrt(HEADS / D)) end
    add(p .. "0.layer_norm.weight", { D })
    add(p .. "1.DenseReluDense.wi_0.weight", { FF, D })
    add(p .. "1.DenseReluDense.wi_1.weight", { FF, D })
    add(p .. "1.DenseReluDense.wo.weight", { D, FF })
    add(p .. "1.layer_norm.weight", { D })
  end
  add("encoder.final_layer_norm.weight", { D })
  kiln.save_safetensors(F16, t, { ["kiln.bench"] = MARK, num_heads = tostring(HEADS) })
  for _, v in pairs(t) do v:free() end
  collectgarbage()
  say("wrote %s (%.1f s)", F16, kiln.time() - t0)
end

local GG = { ["0.SelfAttention.q"] = "attn_q", ["0.SelfAttention.k"] = "attn_k", ["0.SelfAttention.v"] = "attn_v",
  ["0.SelfAttention.o"] = "attn_o", ["0.SelfAttention.relative_attention_bias"] = "attn_rel_b",
  ["0.layer_norm"] = "attn_norm", ["1.layer_norm"] = "ffn_norm", ["1.DenseReluDense.wi_0"] = "ffn_gate",
  ["1.DenseReluDense.wi_1"] = "ffn_up", ["1.DenseReluDense.wo"] = "ffn_down" }

local function is_linear(k) return k:match("SelfAttention%.[qkvo]%.weight$") or k:match("DenseReluDense%.w") end

local function write_derived(src)
  local t0 = kiln.time()
  if o.fresh or not io.open(Q8) then
    local g = {}
    for k, v in pairs(src) do
      local name
      if k == "shared.weight" then name = "token_embd.weight"
      elseif k == "encoder.final_layer_norm.weight" then name = "enc.output_norm.weight"
      else
        local b, rest = k:match("^encoder%.block%.(%d+)%.layer%.(.-)%.weight$")
        if b then name = fmt("enc.blk.%s.%s.weight", b, GG[rest]) end
      end
      if name then g[name] = v end
    end
    kiln.save_gguf(Q8, g, { type = "q8_0", metadata = { ["general.architecture"] = "t5encoder",
      ["t5encoder.attention.head_count"] = tostring(HEADS) } })
    say("wrote %s (%.1f s)", Q8, kiln.time() - t0)
  end
  for _, scaled in ipairs({ false, true }) do
    local path = scaled and FP8S or FP8
    if o.fresh or not io.open(path) then
      t0 = kiln.time()
      local out, made = {}, {}
      for k, v in pairs(src) do
        if k ~= "__metadata__" and (is_linear(k) or (k == "shared.weight" and not scaled)) then
          local w = v
          if scaled then
            local f = v:to("f32")
            -- the |w| temporary is freed here: the host has no budget whose pressure
            -- would collect it, and 24 blocks of them are 19 GB
            local a = f:abs()
            local s = a:max() / 448
            a:free()
            w = f * (1 / s)
            f:free()
            local st = kiln.tensor({ s }):reshape({})
            out[k:gsub("weight$", "scale_weight")] = st
            made[#made + 1] = st
            made[#made + 1] = w
          end
          local c = w:to("f8_e4m3fn")
          if scaled then w:free() end
          out[k] = c
          made[#made + 1] = c
        else
          out[k] = v
        end
      end
      if scaled then out.scaled_fp8 = kiln.empty({ 0 }, { dtype = "f8_e4m3fn" }) end
      kiln.save_safetensors(path, out)
      for _, v in ipairs(made) do v:free() end
      collectgarbage()
      say("wrote %s (%.1f s)", path, kiln.time() - t0)
    end
  end
end

-- the files are written by a first run of this script, which then runs it again for the
-- measurements (so that the peak RSS is the encoder's, not the writer's)
local wrote = false
if o.fresh or not rw.valid(F16, MARK) then write_f16(); wrote = true end
if only.quant and (o.fresh or wrote or not (io.open(Q8) and io.open(FP8) and io.open(FP8S))) then
  o.fresh = o.fresh or wrote -- a new f16 file: every derived one again; else the missing ones
  write_derived(kiln.load_safetensors(F16))
  wrote = true
end
if wrote then
  local args = {}
  for _, a in ipairs(arg) do if a ~= "--fresh" then args[#args + 1] = "'" .. a .. "'" end end
  local ok = os.execute(fmt("'%s' '%s' %s", arg[-1] or "build/kiln", arg[0], table.concat(args, " ")))
  os.exit(ok and 0 or 1)
end
do
  local ids = {}
  local r = kiln.rand({ o.tokens }, { seed = 77 })
  local rt = r:table()
  r:free()
  for i = 1, o.tokens do ids[i] = math.floor(rt[i] * (VOCAB - 2)) + 2 end
  ids[o.tokens] = 1 -- </s>
  local t = kiln.tensor({ ids }, { dtype = "i64" })
  kiln.save_safetensors(IDS, { ids = t })
  t:free()
end
local IDS_T = kiln.load_safetensors(IDS).ids

-- ---------------------------------------------------------------- runs

-- the best time of o.repeat forwards after o.warmup, and the last output
local function timed(enc, prec)
  local function fwd() return kiln.with_precision(prec, enc.forward, enc, IDS_T) end
  for _ = 1, o.warmup do fwd():free() end
  local best, y = math.huge, nil
  for _ = 1, o["repeat"] do
    if y then y:free() end
    local t0 = kiln.time()
    y = fwd()
    best = math.min(best, kiln.time() - t0)
  end
  return best, y
end

local function torch_run(path, out)
  if o.no_torch then return nil end
  local cmd = fmt("/usr/bin/python3 tests/bench/torch_t5.py '%s' '%s' --threads %d --repeat %d --warmup %d --out '%s'",
    path, IDS, o.threads, o["repeat"], o.warmup, out)
  local p = io.popen(cmd)
  local line = p:read("a")
  p:close()
  local ok, r = pcall(kiln.json.decode, line:match("{.*}") or "")
  if not ok then say("# PyTorch failed: %s", line) return nil end
  local y = kiln.load_safetensors(out).out
  return r, y
end

local function rel(a, b)
  local ac = a.device == "cpu" and a or a:to("cpu")
  return (ac - b):abs():max() / b:abs():max()
end

say("T5-XXL shapes, %d blocks, %d tokens, %d threads, cpu bf16: %s", NB, o.tokens, kiln.threads(),
  tostring(kiln.cpu_has_bf16()))
local ref32, torch_ref
if only.f16 or only.quant then
  local enc <close> = kiln.load_t5(F16)
  local t32, y32 = timed(enc, "f32")
  ref32 = y32
  local rss32 = rss_peak()
  local tb, yb = timed(enc, "bf16")
  local tr, ty = torch_run(F16, dir .. "/torch_f16.safetensors")
  torch_ref = ty
  say("%-34s %9s %9s %12s %12s", "f16 weights", "sec", "x torch", "peak RSS", "err vs torch")
  say("%-34s %9.2f %9s %12s %12.2e", "kiln f32", t32, tr and fmt("%.2f", t32 / tr.sec) or "-",
    kiln.format_bytes(rss32), ty and rel(y32, ty) or 0 / 0)
  say("%-34s %9.2f %9s %12s %12.2e", "kiln bf16", tb, tr and fmt("%.2f", tb / tr.sec) or "-",
    kiln.format_bytes(rss_peak()), ty and rel(yb, ty) or 0 / 0)
  if tr then say("%-34s %9.2f %9s %12s", "PyTorch f32 (weights in f32)", tr.sec, "1.00", kiln.format_bytes(tr.peak_rss)) end
  yb:free()
end

local has_sim = false
for _, d in ipairs(kiln.devices()) do has_sim = has_sim or d == "sim" end
if only.stream and has_sim then
  local enc <close> = kiln.load_t5(F16)
  kiln.memory_mode("high")
  local sim_budget = kiln.mem.stats("sim").budget
  kiln.mem.set_budget("sim", 0) -- resident: 24 blocks are over sim's default budget
  enc:load("sim")
  local tres, yres = timed(enc, "bf16")
  enc:unload()
  kiln.mem.empty_cache("sim")
  kiln.memory_mode("low")
  local budget = kiln.mem.stats("sim").reserved + o.budget * MiB
  kiln.mem.set_budget("sim", budget)
  kiln.mem.reset_peak("sim")
  enc:load("sim")
  local ok, tlow, ylow = pcall(timed, enc, "bf16")
  local st = kiln.mem.stats("sim")
  enc:unload()
  kiln.mem.set_budget("sim", sim_budget)
  kiln.memory_mode("normal")
  if not ok then error(tlow, 0) end
  say("%-34s %9.2f", "sim resident (high), bf16", tres)
  say("%-34s %9.2f %9s  peak %s of a %s budget, copied %s per forward, output diff %.1e",
    fmt("sim low, %d MiB budget", o.budget), tlow, fmt("%.2f x resident", tlow / tres),
    kiln.format_bytes(st.peak_reserved), kiln.format_bytes(budget),
    kiln.format_bytes(st.copied_in // (o.warmup + o["repeat"])), rel(ylow, yres:to("cpu")))
  yres:free(); ylow:free()
end

if only.quant then
  say("%-34s %14s %18s", "file (f32 arithmetic)", "kiln vs f16", "PyTorch vs its f16")
  for _, f in ipairs({ { "q8_0 GGUF", Q8 }, { "fp8 e4m3fn", FP8 }, { "fp8 e4m3fn scaled", FP8S } }) do
    local enc <close> = kiln.load_t5(f[2])
    local _, y = timed(enc, "f32")
    local _, ty = torch_run(f[2], dir .. "/torch_q.safetensors")
    say("%-34s %14.2e %18s", f[1], rel(y, ref32), (ty and torch_ref) and fmt("%.2e", rel(ty, torch_ref)) or "-")
    y:free()
  end
end

if o.clean then os.execute("rm -rf '" .. dir .. "'") end
