-- tests/bench/bench_sd3_step.lua - one SD 3.5 sampling step with CFG (the pipelines'
-- denoise function: the positive and the negative pass through the MMDiT, one after the
-- other in memory mode low, as one batch of 2 otherwise or with --batch-cfg) on a
-- full-size file inside a `sim` budget: the time, the device's peak
-- (kiln.mem.stats("sim").peak), the meta device's dry-run prediction of that peak for the
-- same call (kiln.dry_run, run first), the process's peak RSS, and the step's time against
-- its FLOPs divided by the bf16 GEMM rate measured just before it.
--
--   build/kiln tests/bench/bench_sd3_step.lua --file PATH [--size 1024] [--txt 154]
--       [--budget 3072] [--mode low] [--precision bf16] [--threads 2] [--cfg 4.5]
--       [--batch-cfg] [--no-dry] [--dry-only]
--
-- PATH: a file of tests/bench/sd3_weights.lua (f16, bf16 or fp8 safetensors) or any SD 3.5
-- checkpoint. The inputs are random: a [1, 16, size/8, size/8] latent ((size/16)^2 image
-- tokens), positive and negative contexts of --txt tokens of width 4096 (154: CLIP's 77
-- and T5's 77, the family's default), pooled vectors, sigma 0.5.
-- Run under flock /tmp/kiln-bigmem.lock (the weights pass through the page cache) and,
-- for numbers to report, flock /tmp/kiln-bench.lock.
local kiln = require "kiln"
local util = require "kiln.util"
local pipeline = require "kiln.pipeline"
local fw = dofile("tests/bench/flux_weights.lua")
local sw = dofile("tests/bench/sd3_weights.lua")

local o = util.parse_args(arg or {}, { file = "", size = 1024, txt = 154, budget = 3072, mode = "low",
  precision = "bf16", threads = 2, cfg = 4.5, batch_cfg = false, no_dry = false, dry_only = false })
if o.file == "" then error("bench_sd3_step: --file PATH is required", 0) end
local fmt = string.format
local say = dofile("tests/bench/proc_stats.lua").say
local ss = dofile("tests/bench/sim_step.lua")

kiln.set_quiet(true)
kiln.set_threads(o.threads)
kiln.precision(o.precision)
local ck <close> = kiln.load_checkpoint(o.file)
if ck.family ~= "sd3" then error(fmt("bench_sd3_step: %s is a %s checkpoint, not SD 3.5", o.file, ck.family), 0) end
local cfg = ck.dit.config
local lat = o.size // 8
local n_img = (lat // cfg.patch) ^ 2
say("SD 3.5 CFG step: %s (%s, %s)", o.file, ck.variant, cfg.summary)
local batch = o.batch_cfg or o.mode ~= "low"
say("  %dx%d: %d image + %d context tokens, cfg %.1f (%s); mode %s, sim budget %d MiB, precision %s, %d threads",
  o.size, o.size, n_img, o.txt, o.cfg, batch and "one batch of 2" or "two passes", o.mode, o.budget, o.precision,
  kiln.threads())

-- The inputs are made on the cpu, as the pipelines hand the network its latent.
local x = kiln.randn({ 1, cfg.in_channels, lat, lat }, { seed = 1, device = "cpu" })
local cond = kiln.randn({ 1, o.txt, cfg.context_dim }, { seed = 2, device = "cpu" })
local y_cond = kiln.randn({ 1, cfg.adm_dim }, { seed = 3, device = "cpu" })
local uncond = kiln.randn({ 1, o.txt, cfg.context_dim }, { seed = 4, device = "cpu" })
local y_uncond = kiln.randn({ 1, cfg.adm_dim }, { seed = 5, device = "cpu" })
-- The network placed as the pipelines place it (in low mode: streamed block by block).
local function step()
  ck.dit:load("sim")
  local denoise, close = pipeline.denoiser(ck, cond, uncond, o.cfg,
    { y_cond = y_cond, y_uncond = y_uncond, batch_cfg = batch })
  local d = denoise(x, 0.5)
  d:free()
  close()
end

kiln.set_default_device("sim")
kiln.memory_mode(o.mode)
if not o.no_dry then
  ss.dry(step, ck.dit, o)
end

if o.dry_only then return end
local rate, g = fw.gemm_rate(n_img + o.txt, 5, cfg.hidden)
local flops = 2 * sw.step_flops(cfg, n_img, o.txt)   -- the positive and the negative pass
say("  bf16 GEMM [%d, %d] x [%d, %d]: %.1f ms = %.1f GFLOP/s; the step (2 evaluations): %.2f TFLOP = %.1f s at " ..
  "that rate", n_img + o.txt, cfg.hidden, cfg.hidden, cfg.hidden, g * 1e3, rate / 1e9, flops / 1e12, flops / rate)
ss.measure(step, ck.dit, o, flops, rate)
