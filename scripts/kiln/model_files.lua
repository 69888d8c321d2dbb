-- kiln.model_files: the file plumbing every loader shares (checkpoints, their families,
-- LoRAs, ControlNets, TAESD, upscalers, embeddings): telling a safetensors file from a
-- GGUF or a pickle, reading headers, diffusers component folders and JSON configs,
-- checking a file's tensors against what a network expects, opening the weight store
-- over exactly those tensors, and finding a CLIP tokenizer beside a model. It knows no
-- model family (kiln.family does) and no network (the networks' modules do).
--
-- Errors name the loader the user called: functions take `who` ("kiln.load_taesd",
-- ...; default "kiln.load_checkpoint") and raise "WHO: 'path': message".
local kiln = require "kiln"
local lfs = require "lfs"
local util = require "kiln.util"

local M = {}
local fmt = string.format
local sorted_keys = util.sorted_keys

local function fail(who, path, msg) util.file_error(who or "kiln.load_checkpoint", path, msg) end

-- ---------------------------------------------------------------- paths and JSON

-- (symbolic links followed: lfs.attributes stats the target)
function M.file_exists(p) return lfs.attributes(p, "mode") == "file" end

function M.is_dir(p) return lfs.attributes(p, "mode") == "directory" end

function M.join(a, b) return a:sub(-1) == "/" and a .. b or a .. "/" .. b end

function M.dirname(p) return p:match("^(.*)/[^/]*$") or "." end

-- The names of the files in a folder, as a set (empty when it is not one).
function M.list_dir(dir)
  local names = {}
  if not M.is_dir(dir) then return names end
  for name in lfs.dir(dir) do
    if name ~= "." and name ~= ".." then names[name] = true end
  end
  return names
end

-- A JSON file's value (kiln.json, the runtime's strict parser), or nil when the
-- file is absent; a malformed file is an error naming it.
function M.read_json(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local text = f:read("a")
  f:close()
  local ok, v = pcall(kiln.json.decode, text)
  if not ok then error(fmt("%s: %s", path, tostring(v)), 0) end
  return v
end

-- A string / number field of a decoded JSON object (nil when absent, null or another type).
function M.json_string(t, k)
  local v = type(t) == "table" and t[k]
  return type(v) == "string" and v or nil
end

function M.json_number(t, k)
  local v = type(t) == "table" and t[k]
  return type(v) == "number" and v or nil
end

-- ---------------------------------------------------------------- formats

M.PICKLE_HELP = "kiln reads .safetensors only: a .ckpt/.pt/.pth/.bin file is a Python pickle, which " ..
    "can run arbitrary code when loaded, so kiln does not open it. Convert it once with PyTorch and " ..
    "safetensors:\n  python -c \"import torch, safetensors.torch as s; d = torch.load('IN.ckpt', " ..
    "map_location='cpu'); d = d.get('state_dict', d); s.save_file({k: v.contiguous() for k, v in " ..
    "d.items() if isinstance(v, torch.Tensor)}, 'OUT.safetensors')\""

-- Is this a pickle by its name (.ckpt, .pt, .pth, .bin)?
function M.is_pickle_name(path)
  return path:match("%.ckpt$") or path:match("%.pt$") or path:match("%.pth$") or path:match("%.bin$") or false
end

-- "gguf" | "safetensors" | "pickle" | nil (something else) from a file's first bytes;
-- an unreadable file is an error.
function M.sniff(path, who)
  local f, err = io.open(path, "rb")
  if not f then fail(who, nil, err) end
  local head = f:read(9) or ""
  f:close()
  if head:sub(1, 4) == "GGUF" then return "gguf" end
  -- safetensors: an 8-byte header length, then the JSON header's "{"
  if head:sub(9, 9) == "{" then return "safetensors" end
  if head:sub(1, 2) == "PK" or head:byte(1) == 0x80 then return "pickle" end
  return nil
end

-- path -> tensors (name -> mapped tensor), metadata (strings). A GGUF file (by its
-- magic) is read the same way. Pickles are refused with the conversion hint; errors
-- name the file.
function M.read(path, who)
  if M.is_pickle_name(path) then fail(who, path, M.PICKLE_HELP) end
  local kind = M.sniff(path, who)
  if kind == "gguf" then
    local ok, tensors, meta = pcall(kiln.load_gguf, path)
    if not ok then fail(who, path, "cannot read it as GGUF: " .. tostring(tensors)) end
    return tensors, meta or {}
  end
  if kind == "pickle" then
    fail(who, path, "this is a PyTorch pickle (zip) checkpoint, not safetensors. " .. M.PICKLE_HELP)
  end
  local ok, tensors, meta = pcall(kiln.load_safetensors, path)
  if not ok then fail(who, path, "cannot read it as safetensors: " .. tostring(tensors)) end
  return tensors, meta or {}
end

-- ---------------------------------------------------------------- name -> shape tables

function M.shapes_of(tensors)
  local s = {}
  for name, t in pairs(tensors) do s[name] = t.shape end
  return s
end

-- The names below prefix, with prefix removed.
function M.sub(shapes, prefix)
  local r = {}
  for name, s in pairs(shapes) do
    if name:sub(1, #prefix) == prefix then r[name:sub(#prefix + 1)] = s end
  end
  return r
end

function M.has_prefix(shapes, prefix)
  for name in pairs(shapes) do
    if name:sub(1, #prefix) == prefix then return true end
  end
  return false
end

function M.count(shapes)
  local n = 0
  for _ in pairs(shapes) do n = n + 1 end
  return n
end

-- Top-level prefixes of a name set, for "found ..." messages: "first_stage_model.* (248)".
function M.summarize(shapes, depth)
  local counts = {}
  for name in pairs(shapes) do
    local parts, p = {}, 0
    for seg in name:gmatch("[^%.]+") do
      p = p + 1
      parts[p] = seg
      if p == depth then break end
    end
    local key = table.concat(parts, ".", 1, math.min(#parts, depth))
    if #parts >= depth and name ~= key then key = key .. ".*" end
    counts[key] = (counts[key] or 0) + 1
  end
  local keys = sorted_keys(counts)
  local out = {}
  for i, k in ipairs(keys) do
    if i > 12 then out[#out + 1] = fmt("... and %d more", #keys - 12); break end
    out[#out + 1] = fmt("%s (%d)", k, counts[k])
  end
  local names = sorted_keys(shapes)
  local ex = {}
  for i = 1, math.min(3, #names) do ex[i] = names[i] end
  return table.concat(out, ", ") .. "; for example " .. table.concat(ex, ", ")
end

-- ---------------------------------------------------------------- sources

-- A source is what a part is built from: {path, paths, tensors, shapes, meta, prefix}
-- (and `map`, original name -> real name, for files in another naming).
function M.source(path, prefix, who)
  local tensors, meta = M.read(path, who)
  return { path = path, paths = { path }, tensors = tensors, shapes = M.shapes_of(tensors), meta = meta,
    prefix = prefix or "" }
end

-- Several files as one source (a sharded diffusers component).
function M.multi_source(paths, prefix, who)
  local tensors, meta = {}, {}
  for _, p in ipairs(paths) do
    local t, m = M.read(p, who)
    for k, v in pairs(t) do tensors[k] = v end
    for k, v in pairs(m) do meta[k] = v end
  end
  return { path = paths[1], paths = paths, tensors = tensors, shapes = M.shapes_of(tensors), meta = meta,
    prefix = prefix or "" }
end

-- A diffusers component folder's safetensors file(s), sharded or not (the index's
-- weight_map names the shards); nil when there are none, an error for pickles only.
function M.diffusers_files(dir, stem, who)
  local have = M.list_dir(dir)
  local join = M.join
  for _, name in ipairs({ stem .. ".safetensors", stem .. ".fp16.safetensors" }) do
    if have[name] and M.file_exists(join(dir, name)) then return { join(dir, name) } end
  end
  for _, idx in ipairs({ stem .. ".safetensors.index.json", stem .. ".safetensors.index.fp16.json" }) do
    local index = have[idx] and M.read_json(join(dir, idx))
    if index then
      local seen, files = {}, {}
      for _, file in pairs(type(index.weight_map) == "table" and index.weight_map or {}) do
        if type(file) == "string" and not seen[file] then seen[file] = true; files[#files + 1] = join(dir, file) end
      end
      table.sort(files)
      if #files > 0 then return files end
    end
  end
  for _, name in ipairs({ stem .. ".bin", stem .. ".fp16.bin", stem .. ".ckpt" }) do
    if have[name] then fail(who, join(dir, name), M.PICKLE_HELP) end
  end
  return nil
end

-- ---------------------------------------------------------------- validation

local function same_shape(want, got)
  if #want == #got then
    for i = 1, #want do if want[i] ~= got[i] then return false end end
    return true
  end
  -- a 1x1 convolution stored as a linear weight (diffusers VAE attention)
  if #want == 4 and #got == 2 and want[3] == 1 and want[4] == 1 then
    return want[1] == got[1] and want[2] == got[2]
  end
  return false
end

-- Checks every expected tensor ({name, shape} pairs, as a network's `expected` lists
-- them; resolve maps a name to the file's) against the file's shapes; raises one error
-- listing the problems (missing tensors and shape mismatches, with expected vs found).
function M.validate(path, what, expected, resolve, shapes, who)
  local problems = {}
  local shape_str = util.shape_str
  for _, e in ipairs(expected) do
    local real = resolve(e[1])
    local got = shapes[real]
    if not got then
      problems[#problems + 1] = fmt("missing tensor '%s' (expected shape %s)", real, shape_str(e[2]))
    elseif not same_shape(e[2], got) then
      problems[#problems + 1] = fmt("tensor '%s' has shape %s, expected %s", real, shape_str(got), shape_str(e[2]))
    end
  end
  if #problems > 0 then
    local n = #problems
    if n > 12 then
      for i = n, 13, -1 do problems[i] = nil end
      problems[13] = fmt("... and %d more", n - 12)
    end
    fail(who, path, fmt("the %s does not match the architecture its tensors describe (%d problem%s):\n  %s",
      what, n, n == 1 and "" or "s", table.concat(problems, "\n  ")))
  end
end

-- The file's names of a network's expected tensors.
function M.names_of(expected, resolve)
  local r = {}
  for i, e in ipairs(expected) do r[i] = resolve(e[1]) end
  return r
end

-- ---------------------------------------------------------------- weight stores

-- A kiln.Model over exactly the tensors a network reads: the real names are given as
-- the model's prefixes, so the parts of a single-file checkpoint are several models
-- over one file and a diffusers or override file contributes only what is used (not
-- position_ids, logit_scale, ...).
function M.open_store(paths, names, label, who)
  local ok, m = pcall(kiln.model, #paths == 1 and paths[1] or paths, { prefix = names, name = label })
  if not ok then fail(who, paths[1], fmt("cannot open the %s weights: %s", label, tostring(m))) end
  return m
end

-- ---------------------------------------------------------------- tokenizer

local function open_tokenizer(path, where, who)
  if not kiln.tokenizer then
    fail(who, nil, fmt("a tokenizer was given (%s) but this build has no kiln.tokenizer binding", path))
  end
  local ok, t = pcall(kiln.tokenizer, path)
  if not ok then fail(who, nil, fmt("cannot open the tokenizer %s%s: %s", path, where or "", tostring(t))) end
  return t
end

-- The folders a model file's companions (tokenizer) may sit in: its own, then, when
-- the path is a symbolic link, the folder of each file the link leads to (a model
-- folder of links to files kept elsewhere, the tokenizer beside the real file).
function M.beside_dirs(path)
  local dirname = M.dirname
  local dirs, seen = { dirname(path) }, {}
  seen[dirs[1]] = true
  local p = path
  for _ = 1, 40 do -- as the kernel's limit on nested links; a loop of links ends here
    local target = lfs.symlinkattributes(p, "target")
    if type(target) ~= "string" then break end
    p = target:sub(1, 1) == "/" and target or M.join(dirname(p), target)
    local d = dirname(p)
    if not seen[d] then
      seen[d] = true
      dirs[#dirs + 1] = d
    end
  end
  return dirs
end

-- The CLIP tokenizer of a model, first found of: opts.tokenizer; vocab.json +
-- merges.txt or bpe_simple_vocab_16e6.txt.gz in one of dir_candidates; the path in
-- $KILN_TOKENIZER; CLIP's vocabulary built into the library. Returns it and a line
-- saying which it is (also a "tokenizer" mark in kiln.mem.events and the trace).
local builtin_tok
function M.find_tokenizer(opts, dir_candidates, who)
  local join, exists = M.join, M.file_exists
  local function found(tok, why)
    local src = fmt("%s (%s)", tok.source and tok:source() or tostring(tok), why)
    if kiln.trace and kiln.trace.mark then kiln.trace.mark("tokenizer", src) end
    return tok, src
  end
  if opts.tokenizer then
    if type(opts.tokenizer) ~= "string" then return found(opts.tokenizer, "option tokenizer") end
    return found(open_tokenizer(opts.tokenizer, " (option tokenizer)", who), "option tokenizer")
  end
  if not kiln.tokenizer then return nil end
  for _, d in ipairs(dir_candidates) do
    if exists(join(d, "vocab.json")) and exists(join(d, "merges.txt")) then
      return found(open_tokenizer(d, nil, who), "beside the checkpoint")
    end
    if exists(join(d, "bpe_simple_vocab_16e6.txt.gz")) then
      return found(open_tokenizer(join(d, "bpe_simple_vocab_16e6.txt.gz"), nil, who), "beside the checkpoint")
    end
  end
  local env = os.getenv("KILN_TOKENIZER")
  if env and env ~= "" then
    return found(open_tokenizer(env, " (environment variable KILN_TOKENIZER)", who), "KILN_TOKENIZER")
  end
  -- one built-in tokenizer per Lua state, shared by its checkpoints (opening it
  -- inflates and parses the vocabulary); reopened if a script freed it
  if not (builtin_tok and pcall(builtin_tok.vocab_size, builtin_tok)) then builtin_tok = kiln.tokenizer() end
  return found(builtin_tok, "no tokenizer beside the checkpoint or named")
end

return M
