-- kiln.comfy.step_cache: the nodes that put a step cache (kiln.step_cache) on a MODEL:
-- kiln's own KilnStepCache (every policy), and the custom-node names workflows carry,
-- Comfy-WaveSpeed's ApplyFBCacheOnModel and ComfyUI-TeaCache's TeaCache, where their
-- inputs map onto kiln's. The MODEL value gets a `cache` field; the samplers run with it.
local registry = require "kiln.comfy.registry"
local V = require "kiln.comfy.values"
local step_cache = require "kiln.step_cache"

local M = {}
-- the node definitions, by name (registered at the end)
M.nodes = {}
local N = M.nodes
local fail = V.fail

local function kind_of(model) return model.ckpt and model.ckpt.dit and "flux" or "unet" end

-- a new MODEL value with the cache spec (nil: the model as it came)
local function with_cache(ctx, v, spec, who)
  if spec then
    local ok, err = pcall(step_cache.spec, spec, kind_of(v), who)
    if not ok then fail(ctx, (tostring(err):gsub("^[^:]*:%d+: ", ""))) end
  end
  local fields = {}
  for k, x in pairs(v) do fields[k] = x end
  fields.cache = spec
  fields.tensors, fields.res, fields.type = nil, nil, nil
  return ctx:value(v.type, fields, nil, v.res)
end

-- the percent range of the custom nodes: kiln's caches run over the whole schedule
local function whole_range(ctx, who, a, b, na, nb)
  if a ~= 0 or b ~= 1 then
    fail(ctx, ("%s: %s = %s, %s = %s: kiln caches over the whole schedule (0 and 1)"):format(who, na, tostring(a), nb,
      tostring(b)))
  end
end

N.KilnStepCache = {
  category = "kiln",
  description = "Reuses network work between sampler steps (First-Block Cache, TeaCache, DeepCache).",
  inputs = { { "model", "MODEL" }, { "mode", step_cache.MODES },
    { "threshold", "FLOAT", default = 0.0, min = 0.0, max = 100.0, step = 0.01,
      tooltip = "fbcache / teacache: 0 takes the mode's default for the model" },
    { "interval", "INT", default = 3, min = 1, max = 1000, tooltip = "deepcache: a full step every N steps" },
    { "branch", "INT", default = 0, min = 0, max = 100, tooltip = "deepcache: the skip branch kept (0 = shallowest)" },
    { "max_hits", "INT", default = -1, min = -1, max = 1000, tooltip = "consecutive reused steps at most (-1: any)" } },
  outputs = { "MODEL" },
  run = function(ctx, a)
    local spec = { mode = a.mode, max_hits = a.max_hits }
    if a.mode == "deepcache" then
      spec.interval, spec.branch = a.interval, a.branch
    elseif a.threshold > 0 then
      spec.threshold = a.threshold
    end
    return { with_cache(ctx, a.model, spec, "KilnStepCache") }
  end,
}

-- Comfy-WaveSpeed's node: threshold 0 or max_consecutive_cache_hits 0 leave the model as it is
N.ApplyFBCacheOnModel = {
  category = "wavespeed",
  inputs = { { "model", "MODEL" }, { "object_to_patch", "STRING", default = "diffusion_model" },
    { "residual_diff_threshold", "FLOAT", default = 0.0, min = 0.0, max = 1.0, step = 0.001 },
    { "start", "FLOAT", default = 0.0, min = 0.0, max = 1.0, step = 0.01 },
    { "end", "FLOAT", default = 1.0, min = 0.0, max = 1.0, step = 0.01 },
    { "max_consecutive_cache_hits", "INT", default = -1, min = -1 } },
  outputs = { "MODEL" },
  run = function(ctx, a)
    if a.object_to_patch ~= "diffusion_model" then
      fail(ctx, ("ApplyFBCacheOnModel: object_to_patch '%s': kiln caches the diffusion model only"):format(a.object_to_patch))
    end
    if a.residual_diff_threshold <= 0 or a.max_consecutive_cache_hits == 0 then
      return { with_cache(ctx, a.model, nil) }
    end
    whole_range(ctx, "ApplyFBCacheOnModel", a.start, a["end"], "start", "end")
    return { with_cache(ctx, a.model, { mode = "fbcache", threshold = a.residual_diff_threshold,
      max_hits = a.max_consecutive_cache_hits }, "ApplyFBCacheOnModel") }
  end,
}

-- ComfyUI-TeaCache's coefficients for the model types kiln runs
local TEA = {
  flux = step_cache.COEFFICIENTS.flux,
  ["flux-kontext"] = { -1.04655119e+03, 3.12563399e+02, -1.69500694e+01, 4.10995971e-01, 3.74537863e-02 },
}

N.TeaCache = {
  category = "TeaCache",
  inputs = { { "model", "MODEL" }, { "model_type", { "flux", "flux-kontext" } },
    { "rel_l1_thresh", "FLOAT", default = 0.4, min = 0.0, max = 10.0, step = 0.01 },
    { "start_percent", "FLOAT", default = 0.0, min = 0.0, max = 1.0, step = 0.01 },
    { "end_percent", "FLOAT", default = 1.0, min = 0.0, max = 1.0, step = 0.01 },
    { "cache_device", { "cuda", "cpu" } } },   -- kiln keeps the cache where the run computes
  outputs = { "MODEL" },
  run = function(ctx, a)
    if kind_of(a.model) ~= "flux" then
      fail(ctx, ("TeaCache: model_type '%s' but the model is a UNet (KilnStepCache runs TeaCache on UNets)"):format(a.model_type))
    end
    whole_range(ctx, "TeaCache", a.start_percent, a.end_percent, "start_percent", "end_percent")
    return { with_cache(ctx, a.model, { mode = "teacache", threshold = a.rel_l1_thresh,
      coefficients = TEA[a.model_type] }, "TeaCache") }
  end,
}

for name, def in pairs(N) do registry.add_node(name, def) end

return M
