-- tests/bench/flux_weights.lua - random full-size Flux.1-shaped weight files written at
-- the disk's speed: every tensor's bytes are a slice of one small pool of random bytes
-- (taken at an offset that depends on the tensor), already in the file's encoding, so
-- nothing is generated, converted or held per tensor. Timing needs only valid, finite,
-- well-scaled values, not independent ones.
--
--   build/kiln tests/bench/flux_weights.lua --format q8_0|fp8|bf16 --out PATH
--       [--double 19] [--single 38] [--schnell]
--
-- q8_0: city96's GGUF layout (general.architecture flux, BFL names), 2-D tensors Q8_0,
-- 1-D tensors F32. fp8: a ComfyUI-style safetensors file, 2-D tensors F8_E4M3, 1-D
-- tensors BF16. bf16: all BF16. The values: tests/bench/pool_weights.lua.
-- As a module: local fw = dofile("tests/bench/flux_weights.lua"); fw.write(fmt, path, cfg);
-- fw.write_safetensors is pool_weights' (for other networks: tests/bench/bench_t5.lua --pool).
local kiln = require "kiln"
local util = require "kiln.util"
local flux = require "kiln.flux"

local pw = dofile("tests/bench/pool_weights.lua")

local M = {}
local fmt = string.format
M.write_safetensors = pw.write_safetensors

-- The Flux.1 [dev] ([schnell]: no guidance_in) configuration at full width.
function M.config(double, single, schnell)
  return { hidden = 3072, in_channels = 64, context_dim = 4096, vec_dim = 768, depth = double or 19,
    depth_single = single or 38, mlp_hidden = 12288, head_dim = 128, guidance = not schnell, qkv_bias = true,
    out_channels = 64 }
end

--- The FLOPs (2 per multiply-add) of one Flux evaluation over n_img image and n_txt text
-- tokens: the linear layers and the attention products of each block, the modulations,
-- the input and output projections. Returns the step's, one double block's and one
-- single block's.
function M.step_flops(cfg, n_img, n_txt)
  local H, Mh, L = cfg.hidden, cfg.mlp_hidden, n_img + n_txt
  local att = 4 * L * L * H
  local dbl = 2 * L * (3 * H * H + H * H + 2 * H * Mh) + att
  local sgl = 2 * L * ((3 * H + Mh) * H + (H + Mh) * H) + att
  local mod = 2 * (12 * H * H * cfg.depth + 3 * H * H * cfg.depth_single)
  local io = 2 * n_img * cfg.in_channels * H + 2 * n_txt * cfg.context_dim * H + 2 * n_img * H * cfg.out_channels
  return cfg.depth * dbl + cfg.depth_single * sgl + mod + io, dbl, sgl
end

--- The bf16 GEMM rate (FLOP/s): the best of `n` [rows, H] x [H, H] products (H 3072 unless
-- given), on the cpu whatever the default device (nothing left in a budgeted device's cache).
function M.gemm_rate(rows, n, H)
  H = H or 3072
  local x0 = kiln.randn({ rows, H }, { seed = 1, device = "cpu" })
  local w0 = kiln.randn({ H, H }, { seed = 2, device = "cpu" })
  local x, w = x0:to("bf16"), w0:to("bf16")
  x0:free(); w0:free()
  local best = math.huge
  for _ = 1, n or 5 do
    local t0 = kiln.time()
    kiln.nn.linear(x, w):free()
    best = math.min(best, kiln.time() - t0)
  end
  x:free(); w:free()
  return 2 * rows * H * H / best, best
end

--- Writes the file (through PATH.part, renamed when complete); returns bytes, seconds.
function M.write(format, path, cfg)
  local t0 = kiln.time()
  local list = flux.expected(cfg)
  local bytes
  local meta = { ["kiln.bench"] = "flux_weights" }
  if format == "q8_0" then
    bytes = pw.write_gguf(path, list, { architecture = "flux" })
  elseif format == "fp8" then bytes = pw.write_safetensors(path, list, { matrix = "F8_E4M3", meta = meta })
  elseif format == "bf16" then bytes = pw.write_safetensors(path, list, { matrix = "BF16", meta = meta })
  else error(fmt("flux_weights: --format must be q8_0, fp8 or bf16, not '%s'", tostring(format)), 2) end
  return bytes, kiln.time() - t0
end

if arg and arg[0] and arg[0]:match("flux_weights%.lua$") then
  local o = util.parse_args(arg, { format = "q8_0", out = "", double = 19, single = 38, schnell = false })
  if o.out == "" then error("flux_weights: --out PATH is required", 0) end
  local bytes, s = M.write(o.format, o.out, M.config(o.double, o.single, o.schnell))
  print(fmt("wrote %s: %.2f GB in %.1f s (%.2f s/GB)", o.out, bytes / 1e9, s, s / (bytes / 1e9)))
end

return M
