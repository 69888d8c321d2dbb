-- kiln.serve.http: what the API modules of `kiln serve` share about HTTP: query
-- strings, multipart bodies, JSON answers and the refusal error (an error value that
-- becomes a 4xx answer with ComfyUI's error shape), plus the image checks that the
-- limits need (a PNG's size from its header, without decoding it).
local kiln = require "kiln"

local M = {}
local fmt = string.format

--- An empty JSON array (kiln.json writes an empty table as {}).
function M.array(t) return setmetatable(t or {}, { __jsontype = "array" }) end

local function unescape(s)
  s = s:gsub("+", " ")
  return (s:gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end))
end
M.unescape = unescape

--- The fields of a query string (or an x-www-form-urlencoded body) as name -> value.
function M.query(q)
  local t = {}
  for pair in (q or ""):gmatch("[^&]+") do
    local k, v = pair:match("^([^=]*)=(.*)$")
    if k then t[unescape(k)] = unescape(v) else t[unescape(pair)] = "" end
  end
  return t
end

--- A refusal: raised by a handler, answered as `status` with ComfyUI's error shape
-- {"error": {type, message, details, extra_info}, "node_errors": {...}}.
local Refusal = {}
Refusal.__index = Refusal
Refusal.__tostring = function(r) return fmt("%d %s: %s", r.status, r.type, r.message) end

function M.refuse(status, type_, message, details, node_errors)
  error(setmetatable({ status = status, type = type_, message = message, details = details or "",
    node_errors = node_errors }, Refusal), 0)
end

function M.is_refusal(e) return getmetatable(e) == Refusal end

--- The body of a refusal.
function M.refusal_body(r)
  return { error = { type = r.type, message = r.message, details = r.details or "", extra_info = {} },
    node_errors = r.node_errors or {} }
end

--- The JSON body of a request: a table, or a 400 naming what is wrong.
function M.json_body(ev)
  if ev.body == nil or ev.body == "" then M.refuse(400, "invalid_json", "the request has no body (a JSON object expected)") end
  local ok, v = pcall(kiln.json.decode, ev.body)
  if not ok then M.refuse(400, "invalid_json", "the body is not valid JSON: " .. tostring(v)) end
  if type(v) ~= "table" then M.refuse(400, "invalid_json", "the body must be a JSON object") end
  return v
end

--- The parts of a multipart/form-data body: name -> {value, filename, content_type}.
function M.multipart(ev)
  local ct = ev.content_type or ""
  local boundary = ct:match('boundary="([^"]+)"') or ct:match("boundary=([^;%s]+)")
  if not ct:lower():match("^multipart/form%-data") or not boundary then
    M.refuse(400, "invalid_form", "expected a multipart/form-data body with a boundary")
  end
  local body, parts = ev.body, {}
  local delim = "--" .. boundary
  local pos = body:find(delim, 1, true)
  if not pos then M.refuse(400, "invalid_form", "the multipart body has no boundary line") end
  pos = pos + #delim
  while true do
    if body:sub(pos, pos + 1) == "--" then break end
    local hstart = body:find("\r\n", pos, true)
    if not hstart then break end
    local hend = body:find("\r\n\r\n", hstart, true)
    if not hend then M.refuse(400, "invalid_form", "a multipart part has no end of headers") end
    local headers = body:sub(hstart + 2, hend - 1)
    local nxt = body:find("\r\n" .. delim, hend + 4, true)
    if not nxt then M.refuse(400, "invalid_form", "a multipart part is not closed by the boundary") end
    local value = body:sub(hend + 4, nxt - 1)
    local disp = headers:match("[Cc]ontent%-[Dd]isposition:%s*([^\r\n]*)") or ""
    local name = disp:match('name="([^"]*)"')
    if name then
      parts[name] = { value = value, filename = disp:match('filename="([^"]*)"'),
        content_type = headers:match("[Cc]ontent%-[Tt]ype:%s*([^\r\n]*)") }
    end
    pos = nxt + 2 + #delim
  end
  return parts
end

--- The width and height a PNG's header says, or nil when bytes are not a PNG.
function M.png_size(bytes)
  if #bytes < 24 or bytes:sub(1, 8) ~= "\137PNG\r\n\26\n" or bytes:sub(13, 16) ~= "IHDR" then return nil end
  return string.unpack(">I4I4", bytes, 17)
end

--- A picture's bytes as a tensor [1, C, H, W] (kiln.load_png through a temporary
-- file; the file is removed whatever happens). what: its name in messages.
function M.load_png_bytes(bytes, what, tmpdir)
  if not M.png_size(bytes) then M.refuse(400, "invalid_image", what .. " is not a PNG image (kiln reads PNG)") end
  local path = fmt("%s/kiln-serve-%d-%d.png", tmpdir, os.time(), math.random(1, 1 << 30))
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
  local ok, t = pcall(kiln.load_png, path)
  os.remove(path)
  if not ok then M.refuse(400, "invalid_image", what .. ": " .. tostring(t)) end
  return t
end

--- A picture [1, C, H, W] as PNG bytes (opts.text: its text chunks), made in memory.
function M.png_bytes(img, opts)
  return kiln.encode_png(img, opts)
end

--- The content type of a file name.
function M.content_type(name)
  local ext = (name:match("%.([%w]+)$") or ""):lower()
  return ({ png = "image/png", jpg = "image/jpeg", jpeg = "image/jpeg", webp = "image/webp", gif = "image/gif",
    json = "application/json", txt = "text/plain", html = "text/html; charset=utf-8" })[ext]
    or "application/octet-stream"
end

return M
