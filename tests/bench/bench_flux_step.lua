-- tests/bench/bench_flux_step.lua - one Flux.1 transformer evaluation (one sampling step)
-- on a full-size file inside a `sim` budget: the time, the device's peak
-- (kiln.mem.stats("sim").peak), the meta device's dry-run prediction of that peak for the
-- same call (kiln.dry_run, run first), the process's peak RSS, and the step's time against
-- its FLOPs divided by the bf16 GEMM rate measured just before it.
--
--   build/kiln tests/bench/bench_flux_step.lua --file PATH [--size 512] [--txt 512]
--       [--budget 2048] [--mode low] [--precision bf16] [--threads 2] [--no-dry] [--dry-only]
--       [--variant dev]
--
-- PATH: a file of tests/bench/flux_weights.lua (Q8_0 GGUF, fp8 or bf16 safetensors) or any
-- Flux checkpoint. The inputs are random: a [1, 16, size/8, size/8] latent ((size/16)^2
-- image tokens), --txt T5 states of width 4096, a pooled vector, t = 0.5, guidance 3.5.
-- Run under flock /tmp/kiln-bigmem.lock (the weights pass through the page cache) and,
-- for numbers to report, flock /tmp/kiln-bench.lock.
local kiln = require "kiln"
local util = require "kiln.util"
local fw = dofile("tests/bench/flux_weights.lua")

local o = util.parse_args(arg or {}, { file = "", size = 512, txt = 512, budget = 2048, mode = "low",
  precision = "bf16", threads = 2, no_dry = false, dry_only = false, variant = "dev" })
if o.file == "" then error("bench_flux_step: --file PATH is required", 0) end
local say = dofile("tests/bench/proc_stats.lua").say
local ss = dofile("tests/bench/sim_step.lua")

kiln.set_quiet(true)
kiln.set_threads(o.threads)
kiln.precision(o.precision)
local ck <close> = kiln.load_checkpoint(o.file, { variant = o.variant })
local cfg = ck.dit.config
local lat = o.size // 8
say("Flux step: %s (%s)", o.file, cfg.summary)
say("  %dx%d: %d image + %d text tokens; mode %s, sim budget %d MiB, precision %s, %d threads", o.size, o.size,
  (lat // 2) ^ 2, o.txt, o.mode, o.budget, o.precision, kiln.threads())

-- The inputs are made on the cpu, as the pipelines hand the network its latent.
local x = kiln.randn({ 1, cfg.latent_channels, lat, lat }, { seed = 1, device = "cpu" })
local ctx = kiln.randn({ 1, o.txt, cfg.context_dim }, { seed = 2, device = "cpu" })
local y = kiln.randn({ 1, cfg.vec_dim }, { seed = 3, device = "cpu" })
-- The network placed as the pipelines place it (in low mode: streamed block by block).
local function step()
  ck.dit:load("sim")
  local v = ck.dit:forward(x, 0.5, ctx, y, { guidance = 3.5 })
  v:free()
end

kiln.set_default_device("sim")
kiln.memory_mode(o.mode)
if not o.no_dry then
  ss.dry(step, ck.dit, o)
end

if o.dry_only then return end
local n_img = (lat // 2) ^ 2
local rate, g = fw.gemm_rate(n_img + o.txt, 5)
local flops = fw.step_flops(cfg, n_img, o.txt)
say("  bf16 GEMM [%d, 3072] x [3072, 3072]: %.1f ms = %.1f GFLOP/s; the step: %.2f TFLOP = %.1f s at that rate",
  n_img + o.txt, g * 1e3, rate / 1e9, flops / 1e12, flops / rate)
ss.measure(step, ck.dit, o, flops, rate)
