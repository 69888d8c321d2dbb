-- kiln.repl: how the kiln program's REPL shows a result to a person (a tensor's
-- numbers, a table's contents, a checkpoint or model on one line; print() stays Lua's),
-- and kiln.show: a picture in the terminal (kitty, iTerm2, sixel) or a PNG file.
local kiln = require "kiln"

local M = {}

--- Bounds of what is shown; a session may change them (repl.limits.depth = 5).
M.limits = {
  depth = 4,       -- table nesting shown; deeper tables print as {...}
  items = 30,      -- entries shown per table
  string = 120,    -- characters of a string inside a table
  values = 200,    -- a tensor with at most this many elements shows them all
  edge = 3,        -- else this many at each end of every dimension
  width = 80,      -- rows of numbers wrap at this width
}

local fmt = string.format

-- ---------------------------------------------------------------- recognizing

local function mt_name(v)
  local mt = getmetatable(v)
  return type(mt) == "table" and rawget(mt, "__name") or nil
end

local function is_tensor(v) return type(v) == "userdata" and mt_name(v) == "kiln.Tensor" end
local function is_model(v) return type(v) == "userdata" and mt_name(v) == "kiln.Model" end

-- A checkpoint is what kiln.load_checkpoint returns: a family and its networks.
local function is_checkpoint(v)
  return type(v) == "table" and type(rawget(v, "family")) == "string"
    and (rawget(v, "unet") ~= nil or rawget(v, "clip") ~= nil or rawget(v, "vae") ~= nil)
end

local function bytes(n)
  if kiln.format_bytes then return kiln.format_bytes(n) end
  return fmt("%d B", n)
end

-- ---------------------------------------------------------------- tensors

local INTEGER_DTYPES = { i8 = true, u8 = true, i16 = true, i32 = true, i64 = true, bool = true }

local function numel(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

-- Number formatting shared by the values of one tensor (aligned columns).
local function number_format(vals, integer)
  local maxabs, minabs, all_int = 0, math.huge, true
  for _, v in ipairs(vals) do
    if v ~= v or v == math.huge or v == -math.huge then goto continue end
    local a = math.abs(v)
    if a > maxabs then maxabs = a end
    if a > 0 and a < minabs then minabs = a end
    if v ~= math.floor(v) then all_int = false end
    ::continue::
  end
  if integer or (all_int and maxabs < 1e9) then return "%.0f" end
  if maxabs >= 1e5 or (minabs < 1e-4 and minabs > 0) then return "%.4e" end
  return "%.4f"
end

local function format_number(v, f)
  if v ~= v then return "nan" end
  if v == math.huge then return "inf" end
  if v == -math.huge then return "-inf" end
  return fmt(f, v)
end

-- The elements to show: all of them, or the first and last `edge` of each long
-- dimension (a copy as small as what is shown). Returns a nested table and, per
-- dimension, whether it was cut.
local function shown_values(t, shape)
  local limits = M.limits
  local small, cut, owned = t, {}, {}
  if numel(shape) > limits.values then
    for d, n in ipairs(shape) do
      if n > 2 * limits.edge then
        local e = limits.edge
        local a, b = small:narrow(d, 1, e), small:narrow(d, n - e + 1, e)
        small = kiln.cat({ a, b }, d)
        owned[#owned + 1] = small
        cut[d] = true
      end
    end
  end
  local ok, vals = pcall(function() return small:table() end)
  for _, o in ipairs(owned) do pcall(o.free, o) end
  if not ok then return nil, cut, vals end
  return vals, cut
end

-- Renders nested values as rows like "[[1, 2], [3, 4]]", one row per line.
local function render(vals, cut, depth, ndim, f, indent, width, cellw)
  if depth == ndim then
    local cells = {}
    local e = M.limits.edge
    for i, v in ipairs(vals) do
      cells[#cells + 1] = ("%" .. cellw .. "s"):format(format_number(v, f))
      if cut[depth] and i == e then cells[#cells + 1] = "..." end
    end
    -- wrap a long row
    local lines, line = {}, ""
    for i, c in ipairs(cells) do
      local piece = c .. (i < #cells and "," or "")
      if #line > 0 and #indent + #line + 1 + #piece > width then
        lines[#lines + 1] = line
        line = piece
      else
        line = (#line > 0) and (line .. " " .. piece) or piece
      end
    end
    lines[#lines + 1] = line
    return "[" .. table.concat(lines, "\n" .. indent .. " ") .. "]"
  end
  local parts = {}
  local e = M.limits.edge
  for i, sub in ipairs(vals) do
    parts[#parts + 1] = render(sub, cut, depth + 1, ndim, f, indent .. " ", width, cellw)
    if cut[depth] and i == e then parts[#parts + 1] = "..." end
  end
  local sep = ",\n" .. ("\n"):rep(ndim - depth - 1) .. indent .. " "
  return "[" .. table.concat(parts, sep) .. "]"
end

local function flatten(v, out)
  if type(v) == "table" then
    for _, x in ipairs(v) do flatten(x, out) end
  else
    out[#out + 1] = v
  end
  return out
end

--- A tensor for people: its summary line, then its values (elided past
-- repl.limits.values elements), then min / max / mean when elided.
function M.format_tensor(t)
  local head = tostring(t)
  local ok, shape = pcall(function() return t.shape end)
  if not ok then return head end -- a freed tensor says so in its summary
  local dtype = t.dtype
  if #shape == 0 then
    local okv, v = pcall(t.item, t)
    return okv and (head .. "\n" .. tostring(v)) or head
  end
  local n = numel(shape)
  if n == 0 then return head .. "\n[]" end
  local vals, cut, err = shown_values(t, shape)
  if not vals then return head .. "\n(values not readable: " .. tostring(err) .. ")" end
  local flat = flatten(vals, {})
  local f = number_format(flat, INTEGER_DTYPES[dtype])
  local cellw = 1 -- right-aligned columns
  for _, v in ipairs(flat) do cellw = math.max(cellw, #format_number(v, f)) end
  local lines = { head, render(vals, cut, 1, #shape, f, "", M.limits.width, cellw) }
  if n > M.limits.values then
    local stats = {}
    for _, op in ipairs({ "min", "max", "mean" }) do
      local oks, v = pcall(t[op], t)
      if oks and type(v) == "number" then stats[#stats + 1] = op .. " " .. format_number(v, "%.6g") end
    end
    if #stats > 0 then lines[#lines + 1] = table.concat(stats, ", ") end
  end
  return table.concat(lines, "\n")
end

-- ---------------------------------------------------------------- models, checkpoints

-- "on cuda:0 (5.20 MiB)", "3/120 on cuda:0 (...)", "on host", "mapped" from a
-- model's stats, and the bytes of its weights in their files.
local function residency(store)
  local ok, s = pcall(function() return store:stats() end)
  if not ok or type(s) ~= "table" then return nil, 0 end
  local size = s.file_bytes or 0
  local n, dev, host = s.tensors or 0, s.device or 0, s.host or 0
  local target = s.target or "?"
  local on_device = s.device_bytes and (" (" .. bytes(s.device_bytes) .. ")") or ""
  if n > 0 and dev == n then return "on " .. target .. on_device, size end
  if dev > 0 then return fmt("%d/%d on %s%s", dev, n, target, on_device), size end
  if n > 0 and host == n then return "on host", size end
  if host > 0 then return fmt("%d/%d on host", host, n), size end
  return "mapped", size
end

--- A checkpoint on one line: family, file, bytes of its weights, where each
-- network is.
function M.format_checkpoint(c)
  local parts, total = {}, 0
  for _, name in ipairs({ "clip", "unet", "vae" }) do
    local net = rawget(c, name)
    if net ~= nil then
      local store = type(net) == "table" and rawget(net, "model") or net
      local state, size = residency(store)
      total = total + size
      parts[#parts + 1] = name .. " " .. (state or "?")
    end
  end
  local path = rawget(c, "path")
  local file = type(path) == "string" and (path:match("([^/]+)/*$") or path) or "?"
  return fmt("checkpoint(%s, %s, %s, %s)", c.family, file, bytes(total), table.concat(parts, ", "))
end

-- ---------------------------------------------------------------- tables

local KEYWORDS = {}
for w in ("and break do else elseif end false for function goto if in local nil not or repeat return then true until while"):gmatch("%a+") do
  KEYWORDS[w] = true
end

local function quote(s)
  local max = M.limits.string
  local cut = #s > max
  if cut then s = s:sub(1, max) end
  local q = fmt("%q", s):gsub("\\\n", "\\n"):gsub("\r", "\\r")
  return cut and (q .. "...") or q
end

local format_value

local function key_text(k)
  if type(k) == "string" and k:match("^[%a_][%w_]*$") and not KEYWORDS[k] then return k end
  if type(k) == "string" then return "[" .. quote(k) .. "]" end
  return "[" .. tostring(k) .. "]"
end

local function key_order(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return ta < tb end
  if ta == "number" or ta == "string" then return a < b end
  return tostring(a) < tostring(b)
end

local function format_table(t, depth, ancestors, indent)
  if ancestors[t] then return "<cycle>" end
  if depth > M.limits.depth then return "{...}" end
  ancestors[t] = true
  local items, n, shown, max = {}, 0, 0, M.limits.items
  local len = rawlen(t)
  for i = 1, len do
    n = n + 1
    if shown < max then
      items[#items + 1] = format_value(rawget(t, i), depth + 1, ancestors, indent .. "  ")
      shown = shown + 1
    end
  end
  local keys = {}
  for k in next, t do
    if not (math.type(k) == "integer" and k >= 1 and k <= len) then keys[#keys + 1] = k end
  end
  table.sort(keys, key_order)
  for _, k in ipairs(keys) do
    n = n + 1
    if shown < max then
      items[#items + 1] = key_text(k) .. " = " .. format_value(rawget(t, k), depth + 1, ancestors, indent .. "  ")
      shown = shown + 1
    end
  end
  ancestors[t] = nil
  if n > shown then items[#items + 1] = fmt("... (%d more)", n - shown) end
  if #items == 0 then return "{}" end
  local one = "{" .. table.concat(items, ", ") .. "}"
  if #one + #indent <= M.limits.width and not one:find("\n", 1, true) then return one end
  return "{\n" .. indent .. "  " .. table.concat(items, ",\n" .. indent .. "  ") .. "\n" .. indent .. "}"
end

format_value = function(v, depth, ancestors, indent)
  local tv = type(v)
  if tv == "string" then return quote(v) end
  if is_tensor(v) then
    -- inside a table: the summary only (the values would drown the table)
    return tostring(v)
  end
  if is_checkpoint(v) then return M.format_checkpoint(v) end
  if tv == "table" then
    local mt = getmetatable(v)
    if type(mt) == "table" and rawget(mt, "__tostring") then return tostring(v) end
    return format_table(v, depth, ancestors, indent)
  end
  return tostring(v)
end

--- A value for people, as the REPL shows a result (a string at the top is itself).
function M.format(v)
  if type(v) == "string" then return v end
  if is_tensor(v) then return M.format_tensor(v) end
  if is_model(v) then return tostring(v) end
  return format_value(v, 1, {}, "")
end

--- The REPL's printer: each value formatted, tab-separated, on stdout.
function M.print(...)
  local n = select("#", ...)
  local out = {}
  for i = 1, n do out[i] = M.format((select(i, ...))) end
  io.stdout:write(table.concat(out, "\t"), "\n")
  io.stdout:flush()
end

-- ---------------------------------------------------------------- kiln.show

local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

local function base64(s)
  local out = {}
  for i = 1, #s, 3 do
    local a, b, c = s:byte(i, i + 2)
    local n = (a << 16) | ((b or 0) << 8) | (c or 0)
    local q = {}
    for k = 3, 0, -1 do
      local idx = (n >> (6 * k)) & 63
      q[#q + 1] = B64:sub(idx + 1, idx + 1)
    end
    if not b then q[3], q[4] = "=", "="
    elseif not c then q[4] = "=" end
    out[#out + 1] = table.concat(q)
  end
  return table.concat(out)
end
M.base64 = base64

--- The protocol the terminal speaks, from its environment (env: a table or a
-- function name -> value; default os.getenv): "kitty", "iterm", "sixel" or "file".
-- KILN_SHOW (one of those names) overrides what the environment suggests.
function M.protocol(env)
  local get = type(env) == "function" and env
    or type(env) == "table" and function(k) return env[k] end
    or os.getenv
  local forced = get("KILN_SHOW")
  if forced == "kitty" or forced == "iterm" or forced == "sixel" or forced == "file" then return forced end
  local term, program = get("TERM") or "", get("TERM_PROGRAM") or ""
  if get("KITTY_WINDOW_ID") or term == "xterm-kitty" or program == "ghostty" then return "kitty" end
  if program == "iTerm.app" or get("LC_TERMINAL") == "iTerm2" or program == "WezTerm" then return "iterm" end
  if term:find("sixel", 1, true) or term == "mlterm" or term:match("^foot") or term == "yaft-256color"
    or program == "mlterm" or program == "contour" then
    return "sixel"
  end
  return "file"
end

-- The image as a tensor [1, C, H, W] (the first of a batch).
local function as_image(img)
  if not is_tensor(img) then error(("kiln.show: expected an image tensor, got %s"):format(type(img)), 3) end
  local s = img.shape
  if #s == 2 then return img:reshape({ 1, 1, s[1], s[2] }) end
  if #s == 3 then return img:reshape({ 1, s[1], s[2], s[3] }) end
  if #s == 4 then return s[1] == 1 and img or img:narrow(1, 1, 1) end
  error(("kiln.show: expected an image [1, C, H, W], got a tensor of shape [%s]"):format(table.concat(s, ", ")), 3)
end

local function temp_png(env)
  local get = type(env) == "function" and env or type(env) == "table" and function(k) return env[k] end or os.getenv
  local t = os.tmpname() -- creates the file: its name is ours
  os.remove(t)
  local dir = get("TMPDIR")
  if not dir or dir == "" then dir = t:match("^(.*)/[^/]*$") or "." end
  return (dir:gsub("/+$", "")) .. "/kiln-" .. t:match("([^/]*)$") .. ".png"
end

local function png_bytes(img)
  return kiln.encode_png(img)
end

--- The kitty graphics protocol's escape sequences for a PNG: base64 in chunks of
-- 4096, every chunk but the last marked m=1.
function M.kitty_sequence(png)
  local b64, parts = base64(png), {}
  local n = #b64
  for i = 1, math.max(n, 1), 4096 do
    local chunk = b64:sub(i, i + 4095)
    local more = (i + 4096 <= n) and 1 or 0
    local keys = (i == 1) and ("a=T,f=100,m=" .. more) or ("m=" .. more)
    parts[#parts + 1] = "\27_G" .. keys .. ";" .. chunk .. "\27\\"
  end
  return table.concat(parts) .. "\n"
end

--- iTerm2's inline image sequence for a PNG.
function M.iterm_sequence(png)
  return ("\27]1337;File=inline=1;size=%d;preserveAspectRatio=1:%s\7\n"):format(#png, base64(png))
end

--- A sixel picture: colors rounded to a 6x6x6 cube, six rows a band, runs compressed.
function M.sixel_sequence(img)
  local px = img:to("f32"):table()[1]
  local c, h, w = #px, #px[1], #px[1][1]
  local function level(v)
    v = v ~= v and 0 or math.max(0, math.min(1, v))
    return math.floor(v * 5 + 0.5)
  end
  local index = {} -- index[y][x] = palette entry 0..215
  for y = 1, h do
    local row = {}
    for x = 1, w do
      local r = level(px[1][y][x])
      local g = c >= 3 and level(px[2][y][x]) or r
      local b = c >= 3 and level(px[3][y][x]) or r
      row[x] = r * 36 + g * 6 + b
    end
    index[y] = row
  end
  local out = { ('\27Pq"1;1;%d;%d'):format(w, h) }
  for i = 0, 215 do
    local r, g, b = i // 36, (i // 6) % 6, i % 6
    out[#out + 1] = ("#%d;2;%d;%d;%d"):format(i, r * 20, g * 20, b * 20)
  end
  for y0 = 1, h, 6 do
    local used, order = {}, {}
    for y = y0, math.min(y0 + 5, h) do
      for x = 1, w do
        local k = index[y][x]
        if not used[k] then used[k] = true; order[#order + 1] = k end
      end
    end
    for n, k in ipairs(order) do
      local chars, run_char, run = {}, nil, 0
      local function flush()
        if run > 3 then chars[#chars + 1] = "!" .. run .. run_char
        elseif run > 0 then chars[#chars + 1] = run_char:rep(run) end
      end
      for x = 1, w do
        local bits = 0
        for dy = 0, 5 do
          local row = index[y0 + dy]
          if row and row[x] == k then bits = bits | (1 << dy) end
        end
        local ch = string.char(63 + bits)
        if ch == run_char then run = run + 1 else flush(); run_char, run = ch, 1 end
      end
      flush()
      out[#out + 1] = "#" .. k .. table.concat(chars) .. (n < #order and "$" or "")
    end
    out[#out + 1] = "-"
  end
  out[#out + 1] = "\27\\\n"
  return table.concat(out)
end

--- kiln.show(img [, opts]): shows an image tensor ([1, C, H, W], [C, H, W] or [H, W]
-- in [0, 1]) in the terminal, or writes it as a PNG in the temp folder and prints
-- the path. opts.protocol forces "kitty" | "iterm" | "sixel" | "file"; opts.env is
-- the environment to judge the terminal by (a table or a function); opts.out is
-- where to write (anything with :write, default io.stdout). Without opts.out and
-- with stdout not a terminal, the picture goes to a file. Returns the protocol used
-- and, for "file", the PNG's path.
function M.show(img, opts)
  opts = opts or {}
  local image = as_image(img)
  local out = opts.out or io.stdout
  local protocol = opts.protocol or M.protocol(opts.env)
  if not opts.out and not opts.protocol and not kiln.isatty("stdout") then protocol = "file" end
  if protocol == "kitty" then
    out:write(M.kitty_sequence(png_bytes(image)))
  elseif protocol == "iterm" then
    out:write(M.iterm_sequence(png_bytes(image)))
  elseif protocol == "sixel" then
    out:write(M.sixel_sequence(image))
  elseif protocol == "file" then
    local path = temp_png(opts.env)
    kiln.save_png(image, path)
    out:write(path, "\n")
    if out.flush then out:flush() end
    return protocol, path
  else
    error(("kiln.show: unknown protocol '%s' (expected kitty, iterm, sixel or file)"):format(tostring(protocol)), 2)
  end
  if out.flush then out:flush() end
  return protocol
end

return M
