-- kiln.serve.a1111_api: AUTOMATIC1111's /sdapi/v1 on kiln serve: txt2img and img2img
-- (base64 PNGs in and out, masks, denoising strength, the hires fix fields) on
-- kiln.pipeline, the checkpoints of models/checkpoints (sd-models, options'
-- sd_model_checkpoint), progress with the current preview, interrupt. A1111's sampler
-- names ("DPM++ 2M Karras") are mapped to kiln's sampler and scheduler.
local kiln = require "kiln"
local lfs = require "lfs"
local pipeline = require "kiln.pipeline"
local serve = require "kiln.serve"
local H = require "kiln.serve.http"

local M = {}
local fmt = string.format
local route, refuse, array = serve.route, H.refuse, H.array
local null = kiln.json.null

local function mode_of(p) return lfs.attributes(p, "mode") end

-- ------------------------------------------------------------------ samplers

-- A1111's sampler names (without a schedule suffix) -> kiln's sampler
local SAMPLERS = {
  ["Euler a"] = "euler_ancestral", ["Euler"] = "euler", ["LMS"] = "lms", ["Heun"] = "heun",
  ["DPM2"] = "dpm_2", ["DPM2 a"] = "dpm_2_ancestral", ["DPM++ 2S a"] = "dpmpp_2s_ancestral",
  ["DPM++ 2M"] = "dpmpp_2m", ["DPM++ SDE"] = "dpmpp_sde", ["DPM++ 2M SDE"] = "dpmpp_2m_sde",
  ["DPM++ 3M SDE"] = "dpmpp_3m_sde", ["DDIM"] = "ddim", ["UniPC"] = "uni_pc", ["LCM"] = "lcm",
}
M.SAMPLERS = SAMPLERS
-- A1111's schedule names (the "scheduler" field of 1.9+, or a sampler name's suffix)
local SCHEDULES = {
  ["Automatic"] = false, ["Uniform"] = "normal", ["Karras"] = "karras", ["Exponential"] = "exponential",
  ["SGM Uniform"] = "sgm_uniform", ["Simple"] = "simple", ["Normal"] = "normal", ["DDIM"] = "ddim_uniform",
  ["Beta"] = "beta",
}
M.SCHEDULES = SCHEDULES

--- kiln's (sampler, scheduler) for A1111's sampler_name and scheduler; a 400 naming
-- the known names otherwise. kiln's own names are taken too.
function M.sampler_of(name, scheduler)
  name = name or "Euler a"
  local sched = nil
  if scheduler and scheduler ~= "" then
    if SCHEDULES[scheduler] == nil and not require("kiln.sample").scheduler_info(scheduler) then
      local known = {}
      for k in pairs(SCHEDULES) do known[#known + 1] = k end
      table.sort(known)
      refuse(400, "invalid_scheduler", fmt("scheduler '%s' is unknown (known: %s)", scheduler, table.concat(known, ", ")))
    end
    sched = SCHEDULES[scheduler]
    if sched == nil then sched = scheduler end
  end
  local base, suffix = name:match("^(.-) (%u%l+)$")
  if base and SCHEDULES[suffix] and SAMPLERS[base] then
    return SAMPLERS[base], sched or SCHEDULES[suffix]
  end
  if SAMPLERS[name] then return SAMPLERS[name], sched or "normal" end
  if require("kiln.sample").sampler_info(name) then return name, sched or "normal" end
  local known = {}
  for k in pairs(SAMPLERS) do known[#known + 1] = k end
  table.sort(known)
  refuse(400, "invalid_sampler", fmt("sampler '%s' is unknown (known: %s, each with ' Karras' or ' Exponential')",
    name, table.concat(known, ", ")))
end

-- ------------------------------------------------------------------ checkpoints

local EXT = { safetensors = true, ckpt = true, gguf = true, sft = true }

local function checkpoints(s)
  local dir = s.o.models .. "/checkpoints"
  local out = {}
  if mode_of(dir) == "directory" then
    for f in lfs.dir(dir) do
      local ext = f:match("%.([%w]+)$")
      if ext and EXT[ext:lower()] and mode_of(dir .. "/" .. f) == "file" then out[#out + 1] = f end
    end
  end
  table.sort(out)
  return out
end

local function title_of(f) return f end

-- the checkpoint the options name (A1111's titles: the file name, maybe with " [hash]")
local function find_checkpoint(s, name)
  local list = checkpoints(s)
  if not name then return list[1] end
  name = name:gsub(" %[%x+%]$", "")
  for _, f in ipairs(list) do
    if f == name or f:gsub("%.[^.]*$", "") == name then return f end
  end
end

local function current(s)
  local f = s.a1111.checkpoint or find_checkpoint(s)
  if not f then refuse(400, "no_checkpoint", "no checkpoint in " .. s.o.models .. "/checkpoints") end
  return f
end

local function open_current(s)
  local f = current(s)
  return s:checkpoint(s.o.models .. "/checkpoints/" .. f), f
end

-- ------------------------------------------------------------------ generation

local function num(v, what, default, integer)
  if v == nil or v == null then return default end
  if type(v) ~= "number" then refuse(400, "invalid_value", fmt("%s must be a number, got %s", what, type(v))) end
  if integer then
    local i = math.tointeger(v)
    if not i then refuse(400, "invalid_value", fmt("%s must be a whole number, got %s", what, tostring(v))) end
    return i
  end
  return v
end

local function str(v, what, default)
  if v == nil or v == null then return default end
  if type(v) ~= "string" then refuse(400, "invalid_value", fmt("%s must be a string, got %s", what, type(v))) end
  return v
end

-- The request's fields checked against the limits, as pipeline options.
local function options_of(s, b, img2img)
  local o = {
    prompt = str(b.prompt, "prompt", ""), negative = str(b.negative_prompt, "negative_prompt", ""),
    steps = num(b.steps, "steps", 20, true), cfg = num(b.cfg_scale, "cfg_scale", 7.0),
    width = num(b.width, "width", nil, true), height = num(b.height, "height", nil, true),
    batch = num(b.batch_size, "batch_size", 1, true), seed = num(b.seed, "seed", -1, true),
  }
  o.n_iter = num(b.n_iter, "n_iter", 1, true)
  o.sampler, o.scheduler = M.sampler_of(str(b.sampler_name, "sampler_name", nil) or str(b.sampler_index, "sampler_index", nil),
    str(b.scheduler, "scheduler", nil))
  if o.steps < 1 then refuse(400, "invalid_value", "steps must be at least 1") end
  if o.batch < 1 or o.n_iter < 1 then refuse(400, "invalid_value", "batch_size and n_iter must be at least 1") end
  s:check_limit("steps", o.steps, s.o.max_steps, "--max-steps")
  s:check_limit("batch_size", o.batch, s.o.max_batch, "--max-batch")
  s:check_limit("batch_size x n_iter", o.batch * o.n_iter, s.o.max_batch, "--max-batch")
  if o.width then s:check_limit("width", o.width, s.o.max_size, "--max-size") end
  if o.height then s:check_limit("height", o.height, s.o.max_size, "--max-size") end
  s:check_tokens(o.prompt)
  s:check_tokens(o.negative)
  if o.seed == -1 then o.seed = math.random(0, (1 << 32) - 1) end
  if img2img then
    o.denoise = num(b.denoising_strength, "denoising_strength", 0.75)
    if not (o.denoise >= 0 and o.denoise <= 1) then refuse(400, "invalid_value", "denoising_strength must be in [0, 1]") end
  elseif b.enable_hr then
    o.hr = { scale = num(b.hr_scale, "hr_scale", 2.0), denoise = num(b.denoising_strength, "denoising_strength", 0.7),
      steps = num(b.hr_second_pass_steps, "hr_second_pass_steps", 0, true), upscaler = str(b.hr_upscaler, "hr_upscaler", "Latent") }
    local w, h = o.width, o.height
    if b.hr_resize_x and b.hr_resize_x ~= 0 and w then o.hr.scale = num(b.hr_resize_x, "hr_resize_x") / w end
    if b.hr_resize_y and b.hr_resize_y ~= 0 and h and not (b.hr_resize_x and b.hr_resize_x ~= 0) then
      o.hr.scale = num(b.hr_resize_y, "hr_resize_y") / h
    end
    s:check_limit("width x hr_scale", math.floor((w or 512) * o.hr.scale), s.o.max_size, "--max-size")
    s:check_limit("height x hr_scale", math.floor((h or 512) * o.hr.scale), s.o.max_size, "--max-size")
  end
  return o
end

-- the first image of a request as a tensor [1, 3, H, W] (and the mask [1, 1, H, W])
local function init_image(s, b)
  local list = b.init_images
  if type(list) ~= "table" or type(list[1]) ~= "string" then
    refuse(400, "no_init_image", "img2img needs init_images: [base64 PNG]")
  end
  local http = require "kiln.serve_http"
  local bytes, err = http.b64decode(list[1])
  if not bytes then refuse(400, "invalid_image", "init_images[0]: " .. err) end
  local w, h = H.png_size(bytes)
  if w then
    s:check_limit("init image width", w, s.o.max_size, "--max-size")
    s:check_limit("init image height", h, s.o.max_size, "--max-size")
  end
  local t = H.load_png_bytes(bytes, "init_images[0]", s.o.temp)
  local img = t.shape[2] >= 3 and t:narrow(2, 1, 3):contiguous() or kiln.cat({ t, t, t }, 2)
  t:free()
  local mask
  if type(b.mask) == "string" and b.mask ~= "" then
    local mb, merr = http.b64decode(b.mask)
    if not mb then img:free(); refuse(400, "invalid_image", "mask: " .. merr) end
    local ok, m = pcall(H.load_png_bytes, mb, "mask", s.o.temp)
    if not ok then img:free(); error(m, 0) end
    mask = m:narrow(2, 1, 1):contiguous()
    m:free()
    if b.inpainting_mask_invert == 1 then local r = 1 - mask; mask:free(); mask = r end
    if mask.shape[3] ~= img.shape[3] or mask.shape[4] ~= img.shape[4] then
      img:free(); mask:free()
      refuse(400, "invalid_image", "the mask's size differs from the init image's")
    end
  end
  return img, mask
end

local function b64png(s, img, text)
  return require("kiln.serve_http").b64encode(H.png_bytes(img, text and { text = { parameters = text } } or nil))
end

-- one A1111 generation: the images as base64 PNGs and the info
local function generate(s, job)
  local b, o = job.body, job.opts
  local ckpt, name = open_current(s)
  local images, seeds, infotexts = {}, {}, {}
  local dev = kiln.default_device()
  for it = 1, o.n_iter do
    local seed = o.seed + (it - 1) * o.batch
    local po = { prompt = o.prompt, negative = o.negative, steps = o.steps, cfg = o.cfg, sampler = o.sampler,
      scheduler = o.scheduler, width = o.width, height = o.height, batch = o.batch, seed = seed, device = dev }
    local img, lat
    local t0 = kiln.time()
    if job.img2img then
      po.width, po.height = nil, nil
      po.denoise = o.denoise
      if job.mask then
        img = pipeline.inpaint(ckpt, job.image, job.mask, po)
      else
        img, lat = pipeline.img2img(ckpt, job.image, po)
      end
    elseif o.hr then
      po.scale, po.hires_denoise = o.hr.scale, o.hr.denoise
      po.hires_steps = o.hr.steps > 0 and o.hr.steps or nil
      po.upscale = o.hr.upscaler:match("^Latent %(nearest") and "latent-nearest" or "latent-bilinear"
      img, lat = pipeline.hires_fix(ckpt, po)
    else
      img, lat = pipeline.txt2img(ckpt, po)
    end
    job.ev.run_s = (job.ev.run_s or 0) + (kiln.time() - t0)  -- the bare pipeline's time (Server-Timing)
    if lat then lat:free() end
    local ok, err = pcall(function()
      po.width, po.height = img.shape[4], img.shape[3]
      for i = 1, img.shape[1] do
        local one = img.shape[1] == 1 and img or img:narrow(1, i, 1)
        local text = pipeline.parameters(setmetatable({ seed = seed + i - 1, batch = 1 }, { __index = po }), ckpt)
        images[#images + 1] = b64png(s, one, text)
        seeds[#seeds + 1] = seed + i - 1
        infotexts[#infotexts + 1] = text
        if one ~= img then one:free() end
      end
    end)
    img:free()
    if not ok then error(err, 0) end
  end
  job.result = { images = images, seeds = seeds, infotexts = infotexts, name = name }
end

local function params_echo(b)
  local p = {}
  for k, v in pairs(b) do
    if k ~= "init_images" and k ~= "mask" then p[k] = v end
  end
  if b.init_images then p.init_images = null end
  return p
end

local function finish(s, job, ok, err, cancelled)
  if job.image then job.image:free(); job.image = nil end
  if job.mask then job.mask:free(); job.mask = nil end
  if ok then
    local r, o = job.result, job.opts
    local info = { prompt = o.prompt, all_prompts = array(), negative_prompt = o.negative, seed = r.seeds[1],
      all_seeds = array(r.seeds), subseed = -1, all_subseeds = array(), width = o.width, height = o.height,
      sampler_name = job.body.sampler_name or "Euler a", cfg_scale = o.cfg, steps = o.steps, batch_size = o.batch,
      sd_model_name = r.name, denoising_strength = o.denoise, infotexts = array(r.infotexts),
      kiln_sampler = o.sampler, kiln_scheduler = o.scheduler }
    for i = 1, #r.images do info.all_prompts[i] = o.prompt end
    s:reply(job.ev, 200, { images = array(r.images), parameters = params_echo(job.body), info = kiln.json.encode(info) })
  elseif cancelled then
    -- A1111 answers an interrupted run with what it made; kiln's run made nothing whole
    s:reply(job.ev, 200, { images = array(), parameters = params_echo(job.body),
      info = kiln.json.encode({ interrupted = true }) })
  elseif H.is_refusal(err) then
    s:reply(job.ev, err.status, H.refusal_body(err))
  else
    local msg = tostring(err):match("^[^\n]*")
    -- the pipelines' argument checks ("... must be multiples of 8") are the request's
    -- mistake; an out-of-memory the server's state; anything else the server's fault
    local status = (type(err) == "table" and err.kind == "oom") and 507 or msg:match("must be") and 400 or 500
    s:reply(job.ev, status, { error = "RuntimeError", detail = msg, body = msg, errors = msg })
  end
  job.body, job.result = nil, nil
end

local function abandon(s, job)
  if job.image then job.image:free(); job.image = nil end
  if job.mask then job.mask:free(); job.mask = nil end
  s:reply(job.ev, 503, { error = "stopping", detail = "the server stopped before this request ran" })
end

local function progress(s, job, step, total)
  job.step, job.total = step, total
end

local function queue_generation(s, ev, img2img)
  local b = H.json_body(ev)
  local o = options_of(s, b, img2img)
  current(s)
  local job = { kind = "a1111", id = serve.uuid(), ev = ev, body = b, opts = o, img2img = img2img,
    run = generate, finish = finish, abandon = abandon, progress = progress }
  if img2img then job.image, job.mask = init_image(s, b) end
  local ok, err = pcall(s.enqueue, s, job)
  if not ok then abandon(s, job) ; error(err, 0) end
  s:status()
end

route("POST", "/sdapi/v1/txt2img", function(s, ev) queue_generation(s, ev, false) end)
route("POST", "/sdapi/v1/img2img", function(s, ev) queue_generation(s, ev, true) end)

route("GET", "/sdapi/v1/sd-models", function(s, ev)
  local out = array()
  for _, f in ipairs(checkpoints(s)) do
    out[#out + 1] = { title = title_of(f), model_name = (f:gsub("%.[^.]*$", "")), hash = null, sha256 = null,
      filename = s.o.models .. "/checkpoints/" .. f, config = null }
  end
  s:reply(ev, 200, out)
end)

route("GET", "/sdapi/v1/samplers", function(s, ev)
  local out = array()
  local names = {}
  for k in pairs(SAMPLERS) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    out[#out + 1] = { name = k, aliases = array({ SAMPLERS[k] }), options = {} }
    out[#out + 1] = { name = k .. " Karras", aliases = array({ SAMPLERS[k] .. "_karras" }), options = { scheduler = "karras" } }
  end
  s:reply(ev, 200, out)
end)

route("GET", "/sdapi/v1/schedulers", function(s, ev)
  local out = array()
  local names = {}
  for k in pairs(SCHEDULES) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    out[#out + 1] = { name = SCHEDULES[k] or "automatic", label = k, aliases = null, default_rho = -1, need_inner_model = false }
  end
  s:reply(ev, 200, out)
end)

route("GET", "/sdapi/v1/options", function(s, ev)
  local f = s.a1111.checkpoint or find_checkpoint(s)
  s:reply(ev, 200, { sd_model_checkpoint = f and title_of(f) or null, samples_format = "png",
    sd_checkpoint_hash = null, CLIP_stop_at_last_layers = 1 })
end)

route("POST", "/sdapi/v1/options", function(s, ev)
  local b = H.json_body(ev)
  if b.sd_model_checkpoint ~= nil then
    local f = type(b.sd_model_checkpoint) == "string" and find_checkpoint(s, b.sd_model_checkpoint)
    if not f then
      refuse(400, "invalid_checkpoint", fmt("sd_model_checkpoint '%s' is not in %s/checkpoints (GET /sdapi/v1/sd-models lists them)",
        tostring(b.sd_model_checkpoint), s.o.models))
    end
    -- the next generation opens it; the one before stays open while its weights are
    -- resident (the budget evicts them as the new one loads), then by --keep-checkpoints
    s.a1111.checkpoint = f
  end
  s:reply(ev, 200, null)
end)

route("GET", "/sdapi/v1/progress", function(s, ev)
  local q = H.query(ev.query)
  local job = s.running and s.running.kind == "a1111" and s.running or nil
  local img = null
  local step, total = 0, 0
  if s.running then
    step, total = s.running.step or 0, s.running.total or 0
    if q.skip_current_image ~= "true" then
      local png = s.srv:preview()
      if png then img = require("kiln.serve_http").b64encode(png) end
    end
  end
  local n = 0
  for _, j in ipairs(s.queue) do if j.kind == "a1111" then n = n + 1 end end
  s:reply(ev, 200, { progress = total > 0 and step / total or 0.0, eta_relative = 0.0,
    state = { skipped = false, interrupted = s.interrupt and true or false, job = job and job.id or "",
      job_count = n + (job and 1 or 0), job_timestamp = "0", job_no = 0, sampling_step = step, sampling_steps = total },
    current_image = img, textinfo = null })
end)

route("POST", "/sdapi/v1/interrupt", function(s, ev)
  if s.running then s.interrupt = true end
  s:reply(ev, 200, {})
end)

route("POST", "/sdapi/v1/skip", function(s, ev)
  if s.running then s.interrupt = true end
  s:reply(ev, 200, {})
end)

route("GET", "/sdapi/v1/memory", function(s, ev)
  local st = kiln.mem.stats(kiln.default_device())
  s:reply(ev, 200, { ram = {}, cuda = {}, kiln = st })
end)

return M
