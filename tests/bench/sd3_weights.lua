-- tests/bench/sd3_weights.lua - random full-size SD 3.5-shaped MMDiT files (Large, Medium)
-- written at the disk's speed by tests/bench/pool_weights.lua, in Stability AI's names
-- (the tensors kiln.mmdit.expected lists for the configuration, as the sd3.5 reference's
-- loader reads them), and the FLOPs of one evaluation.
--
--   build/kiln tests/bench/sd3_weights.lua --variant large|medium --format f16|bf16|fp8
--       --out PATH [--depth N] [--sparse]
--
-- Large: 38 joint blocks of width 2432 (38 heads of 64), position table 192x192.
-- Medium: 24 blocks of width 1536, position table 384x384, MMDiT-X's second attention in
-- blocks 0-12. Both: patch 2, 16 channels, context 4096, pooled 2048, MLP 4x, RMS q/k
-- norms, the last block's context stream pre_only. f16 / bf16: every tensor in that
-- dtype. fp8: ComfyUI-style, the linear weights F8_E4M3, the patch convolution and the
-- position table F16, vectors F16. Norm scales (ln_q / ln_k) are 1, biases 0.
-- --sparse: the header only, the data a hole (for bench_sd3_step.lua --dry-only).
-- As a module: local sw = dofile("tests/bench/sd3_weights.lua"); sw.write(fmt, path, sw.config("large")).
local kiln = require "kiln"
local util = require "kiln.util"
local mmdit = require "kiln.mmdit"
local pw = dofile("tests/bench/pool_weights.lua")

local M = {}
local fmt = string.format

--- The MMDiT configuration (kiln.mmdit.config's fields) of an SD 3.5 variant at full size;
-- depth: fewer blocks of the same widths.
function M.config(variant, depth)
  local c
  if variant == "large" then
    c = { hidden = 2432, depth = 38, pos_embed_max_size = 192, x_self_attn_layers = {} }
  elseif variant == "medium" then
    c = { hidden = 1536, depth = 24, pos_embed_max_size = 384, x_self_attn_layers = {} }
    for b = 0, 12 do c.x_self_attn_layers[#c.x_self_attn_layers + 1] = b end
  else
    error(fmt("sd3_weights: variant must be large or medium, not '%s'", tostring(variant)), 2)
  end
  c.depth = depth or c.depth
  c.variant = variant
  c.head_dim = mmdit.HEAD_DIM
  c.heads = c.hidden // c.head_dim
  c.patch, c.in_channels, c.out_channels = 2, 16, 16
  c.context_dim, c.adm_dim = 4096, 2048
  c.mlp_hidden = 4 * c.hidden
  c.qk_norm, c.qkv_bias, c.pre_only_last, c.split_qkv = true, true, true, false
  c.x_self_attn = {}
  for _, b in ipairs(c.x_self_attn_layers) do if b < c.depth then c.x_self_attn[b] = true end end
  return c
end

local function is_qk_norm(name) return name:match("%.ln_[qk]%.weight$") ~= nil end

--- Writes the file (through PATH.part, renamed when complete); returns bytes, seconds.
function M.write(format, path, cfg, sparse)
  local t0 = kiln.time()
  local list = mmdit.expected(cfg)
  local meta = { ["kiln.bench"] = "sd3_weights", ["kiln.variant"] = cfg.variant }
  local opts = { vector = "F16", ones = is_qk_norm, meta = meta, sparse = sparse }
  if format == "f16" then opts.matrix = "F16"
  elseif format == "bf16" then opts.matrix, opts.vector = "BF16", "BF16"
  elseif format == "fp8" then
    opts.matrix = "F8_E4M3"
    opts.dtype_of = function(_, shape) if #shape ~= 2 then return "F16" end end
  else error(fmt("sd3_weights: --format must be f16, bf16 or fp8, not '%s'", tostring(format)), 2) end
  local bytes = pw.write_safetensors(path, list, opts)
  return bytes, kiln.time() - t0
end

--- The FLOPs (2 per multiply-add) of one MMDiT evaluation of batch 1 over n_img image and
-- n_ctx context tokens: each joint block's linear layers per stream, its joint attention
-- (and MMDiT-X's image-only one), the modulations, the embedders and the final layer.
-- Returns the evaluation's and one (not pre_only, not MMDiT-X) joint block's.
function M.step_flops(cfg, n_img, n_ctx)
  local H, Mh, L = cfg.hidden, cfg.mlp_hidden, n_img + n_ctx
  local function stream(n) return 2 * n * (3 * H * H + H * H + 2 * H * Mh) end
  local joint = stream(n_img) + stream(n_ctx) + 4 * L * L * H + 2 * 12 * H * H
  local total = 0
  for b = 0, cfg.depth - 1 do
    local f = joint
    if b == cfg.depth - 1 and cfg.pre_only_last then f = f - stream(n_ctx) + 2 * n_ctx * 3 * H * H - 2 * 4 * H * H end
    if cfg.x_self_attn[b] then f = f + 2 * n_img * 4 * H * H + 4 * n_img * n_img * H + 2 * 3 * H * H end
    total = total + f
  end
  local p2 = cfg.patch * cfg.patch
  local io = 2 * n_img * cfg.in_channels * p2 * H + 2 * n_ctx * cfg.context_dim * H +
      2 * n_img * H * p2 * cfg.out_channels + 2 * (mmdit.TIME_DIM * H + cfg.adm_dim * H + 2 * H * H + 2 * H * H)
  return total + io, joint
end

if arg and arg[0] and arg[0]:match("sd3_weights%.lua$") then
  local o = util.parse_args(arg, { variant = "large", format = "f16", out = "", depth = 0, sparse = false })
  if o.out == "" then error("sd3_weights: --out PATH is required", 0) end
  local cfg = M.config(o.variant, o.depth > 0 and o.depth or nil)
  local bytes, s = M.write(o.format, o.out, cfg, o.sparse)
  print(fmt("wrote %s: %.2f GB in %.1f s (%.2f s/GB)", o.out, bytes / 1e9, s, s / (bytes / 1e9)))
end

return M
