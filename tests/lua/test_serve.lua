-- `kiln serve` driven from outside: the server started as its own process on a free
-- loopback port with the demo model, and spoken to with tests/serve_client (plain
-- HTTP and an RFC 6455 WebSocket client written for the tests, no kiln code in it).
-- ComfyUI: a prompt's picture through /history and /view, the WebSocket sequence with
-- binary previews, validation errors in ComfyUI's shape, uploads, traversal refused,
-- interrupt, a client that disconnects mid-run; A1111: txt2img's base64 PNG,
-- img2img, sampler names, options; the token, the limits, nothing alive growing
-- between requests, SIGTERM during a run. The server runs under KILN_CHECK_LEAKS
-- (tests/run.sh sets it), so its exit status also says that it freed everything.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local lfs = require "lfs"
local test, eq, truthy = H.test, H.eq, H.truthy

local exe = arg and arg[-1]
local okh, http = pcall(require, "kiln.serve_http")
local client = exe and (exe:match("^(.*)/[^/]*$") or ".") .. "/tests/serve_client"
local why
if not exe then why = "no kiln program in arg[-1]"
elseif not okh then why = "this kiln program has no kiln.serve_http"
elseif not http.available then why = http.why
elseif not lfs.attributes(client, "mode") then why = client .. " is not built (make test builds it)" end
if why then
  test("serve: the server and its clients", function() H.skip(why) end)
  return
end

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("a")
  p:close()
  return out
end
local function sleep(s) os.execute("sleep " .. s) end
local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local d = f:read("a")
  f:close()
  return d
end
local function write(path, data)
  local f = assert(io.open(path, "wb"))
  f:write(data)
  f:close()
end

local TMP = os.tmpname()
os.remove(TMP)
assert(os.execute("mkdir -p " .. q(TMP .. "/models/checkpoints")))
local DEMO = lfs.currentdir() .. "/examples/models/kiln-shapes.safetensors"
-- a link, so that the demo model's tokenizer beside it is found
assert(os.execute(("ln -s %s %s"):format(q(DEMO), q(TMP .. "/models/checkpoints/demo.safetensors"))))

-- ------------------------------------------------------------------ servers

local servers = 0
local function start(extra, models)
  servers = servers + 1
  local dir = TMP .. "/srv" .. servers
  lfs.mkdir(dir)
  local s = { dir = dir, log = dir .. "/log", pidf = dir .. "/pid", rcf = dir .. "/rc", out = dir .. "/out" }
  write(dir .. "/run.sh", (os.getenv("KILN_SERVE_WRAP") or "") .. ("%s serve --models %s --output %s --port 0 %s >%s 2>&1 &\necho $! >%s\nwait $!\necho $? >%s\n")
    :format(q(exe), q(models or TMP .. "/models"), q(s.out), extra or "", q(s.log), q(s.pidf), q(s.rcf)))
  os.execute("sh " .. q(dir .. "/run.sh") .. " &")
  for _ = 1, 300 do
    local log = read(s.log) or ""
    local port = log:match("kiln serve: listening on http://127%.0%.0%.1:(%d+)")
    if port then
      s.port = tonumber(port)
      s.base = "http://127.0.0.1:" .. port
      s.pid = tonumber((read(s.pidf) or ""):match("%d+"))
      return s
    end
    if read(s.rcf) then error("the server exited: " .. log) end
    sleep(0.1)
  end
  error("the server did not say it listens: " .. (read(s.log) or ""))
end

-- waits for the server's exit; returns its status
local function wait_exit(s, seconds)
  for _ = 1, (seconds or 30) * 10 do
    local rc = read(s.rcf)
    if rc then return tonumber(rc:match("%d+")) end
    sleep(0.1)
  end
  error("the server did not exit")
end

local TOKEN = "test-token-123"
local AUTH = "Authorization: Bearer " .. TOKEN
local S = start("--token " .. q(TOKEN))

-- one request: status, body text, body as JSON (or nil)
local nreq = 0
local function request(method, path, body, opts)
  opts = opts or {}
  nreq = nreq + 1
  local cmd = { q(client), "http", method, q((opts.server or S).base .. path) }
  local headers = opts.headers or { AUTH }
  for _, h in ipairs(headers) do cmd[#cmd + 1] = "-H " .. q(h) end
  if body then
    local bf = ("%s/body%d"):format(TMP, nreq)
    write(bf, type(body) == "table" and kiln.json.encode(body) or body)
    cmd[#cmd + 1] = "-f " .. q(bf)
  end
  local outf = ("%s/answer%d"):format(TMP, nreq)
  cmd[#cmd + 1] = "-o " .. q(outf)
  local out = sh(table.concat(cmd, " "))
  local status = tonumber(out:match("STATUS (%d+)"))
  if not status then error("the client failed: " .. out) end
  local text = read(outf) or ""
  local ok, j = pcall(kiln.json.decode, text)
  return status, text, ok and j or nil
end

local function graph(o)
  o = o or {}
  return {
    ["4"] = { class_type = "CheckpointLoaderSimple", inputs = { ckpt_name = "demo.safetensors" } },
    -- 128 in EmptyLatentImage's units is the demo model's 64 pixels (its VAE's factor is 4)
    ["5"] = { class_type = "EmptyLatentImage", inputs = { width = o.width or 128, height = 128, batch_size = o.batch or 1 } },
    ["6"] = { class_type = "CLIPTextEncode", inputs = { text = o.text or "a red circle on a blue background", clip = { "4", 1 } } },
    ["7"] = { class_type = "CLIPTextEncode", inputs = { text = "", clip = { "4", 1 } } },
    ["3"] = { class_type = "KSampler", inputs = { seed = o.seed or 1, steps = o.steps or 4, cfg = 3, sampler_name = "euler",
      scheduler = "normal", denoise = 1, model = { "4", 0 }, positive = { "6", 0 }, negative = { "7", 0 },
      latent_image = { "5", 0 } } },
    ["8"] = { class_type = "VAEDecode", inputs = { samples = { "3", 0 }, vae = { "4", 2 } } },
    ["9"] = { class_type = "SaveImage", inputs = { filename_prefix = o.prefix or "serve", images = { "8", 0 } } },
  }
end

-- a WebSocket client as a pipe: lines as they come
local function ws_open(path, args)
  nreq = nreq + 1
  local cmd = ("%s ws %s -H %s %s"):format(q(client), q(S.base .. path), q(AUTH), args or "")
  return io.popen(cmd .. " 2>&1")
end

local function messages_of(lines)
  local msgs = {}
  for _, l in ipairs(lines) do
    local t = l:match("^TEXT (.*)$")
    if t then msgs[#msgs + 1] = kiln.json.decode(t)
    elseif l:match("^BINARY ") then
      local n, ty, fmt = l:match("^BINARY (%d+) (%d+) (%d+)")
      msgs[#msgs + 1] = { type = "binary", bytes = tonumber(n), kind = tonumber(ty), format = tonumber(fmt) }
    end
  end
  return msgs
end

local function png_wh(bytes)
  if not bytes or bytes:sub(1, 8) ~= "\137PNG\r\n\26\n" then return nil end
  return string.unpack(">I4I4", bytes, 17)
end

-- ------------------------------------------------------------------ tests

test("serve: --token: no token or a wrong one is 401, the right one passes", function()
  local st, _, j = request("GET", "/system_stats", nil, { headers = {} })
  eq(st, 401)
  eq(j.error.type, "unauthorized")
  st = request("GET", "/system_stats", nil, { headers = { "Authorization: Bearer wrong" } })
  eq(st, 401)
  st = request("GET", "/system_stats", nil, { headers = { "Authorization: Bearer " .. TOKEN .. "x" } })
  eq(st, 401)
  st = request("GET", "/system_stats")
  eq(st, 200)
  -- the WebSocket too
  local out = sh(("%s ws %s --timeout 10"):format(q(client), q(S.base .. "/ws?clientId=x")))
  truthy(out:match("HANDSHAKE HTTP/1.1 401"), out)
  out = sh(("%s ws %s --timeout 10 --until status"):format(q(client), q(S.base .. "/ws?clientId=x&token=" .. TOKEN)))
  truthy(out:match("OPEN") and out:match('"type":"status"'), out)
end)

local first_prompt
test("serve: ComfyUI prompt over the WebSocket: status, execution_start, executing per node, progress with "
  .. "binary PNG previews, executed, execution_success, executing null; /history and /view give the picture", function()
  local gf = TMP .. "/graph1.json"
  write(gf, kiln.json.encode({ prompt = graph({ prefix = "ws" }), client_id = "client-1" }))
  local prev = TMP .. "/preview.png"
  local p = ws_open("/ws?clientId=client-1", ("--post %s %s --until %s --preview %s"):format(q(S.base .. "/prompt"), q(gf),
    q('"node":null'), q(prev)))
  local lines = {}
  for l in p:lines() do lines[#lines + 1] = l end
  p:close()
  local posted = nil
  for _, l in ipairs(lines) do posted = posted or l:match("^POSTED 200 (.*)$") end
  truthy(posted, "the prompt was not accepted: " .. table.concat(lines, "\n"))
  local r = kiln.json.decode(posted)
  truthy(type(r.prompt_id) == "string" and r.prompt_id ~= "")
  eq(type(r.number), "number")
  first_prompt = r.prompt_id
  local msgs = messages_of(lines)
  eq(msgs[1].type, "status")
  eq(msgs[1].data.sid, "client-1")
  eq(msgs[1].data.status.exec_info.queue_remaining, 0)
  local order, seen = {}, {}
  local nodes, previews, progress = {}, 0, 0
  for i, m in ipairs(msgs) do
    if m.type ~= "status" and m.type ~= "binary" and m.type ~= "progress" then order[#order + 1] = m.type end
    seen[m.type] = seen[m.type] or i
    if m.type == "executing" and m.data.node ~= kiln.json.null then nodes[#nodes + 1] = m.data.node end
    if m.type == "binary" then
      previews = previews + 1
      eq(m.kind, 1, "preview frame type")
      eq(m.format, 2, "image type: PNG")
    end
    if m.type == "progress" then
      progress = progress + 1
      eq(m.data.max, 4)
      eq(m.data.node, "3")
      eq(m.data.prompt_id, r.prompt_id)
    end
  end
  eq(order[1], "execution_start")
  eq(order[2], "execution_cached")
  eq(table.concat(nodes, " "), "4 6 7 5 3 8 9", "executing per node, in the schedule's order")
  eq(progress, 4)
  truthy(previews >= 1, "no binary preview frame")
  truthy(seen.progress < seen.binary, "a preview follows its step's progress")
  eq(order[#order - 2], "executed")
  eq(order[#order - 1], "execution_success")
  local last = msgs[#msgs]
  eq(last.type, "executing")
  eq(last.data.node, kiln.json.null)
  eq(last.data.prompt_id, r.prompt_id)
  -- the preview frame's bytes are a PNG
  truthy(png_wh(read(prev)), "the preview frame does not hold a PNG")
  -- executed's output names the file; /history says the same; /view serves it
  local executed
  for _, m in ipairs(msgs) do if m.type == "executed" then executed = m.data end end
  eq(executed.node, "9")
  local st, _, h = request("GET", "/history/" .. r.prompt_id)
  eq(st, 200)
  local e = h[r.prompt_id]
  truthy(e, "no history entry")
  eq(e.status.status_str, "success")
  eq(e.status.completed, true)
  eq(e.prompt[2], r.prompt_id)
  local img = e.outputs["9"].images[1]
  eq(img.filename, executed.output.images[1].filename)
  eq(img.type, "output")
  local vst, bytes = request("GET", ("/view?filename=%s&subfolder=%s&type=output"):format(img.filename, img.subfolder))
  eq(vst, 200)
  local w, hh = png_wh(bytes)
  eq(w, 64)
  eq(hh, 64)
  -- the same picture as the file kiln wrote, which holds the prompt in its text chunk
  eq(bytes, read(S.out .. "/" .. img.filename))
  truthy(bytes:find("prompt", 1, true), "the PNG carries the API prompt")
end)

test("serve: /queue, /prompt, /object_info from the node registry, /system_stats with kiln's memory", function()
  local st, _, j = request("GET", "/queue")
  eq(st, 200)
  eq(#j.queue_running, 0)
  eq(#j.queue_pending, 0)
  st, _, j = request("GET", "/prompt")
  eq(j.exec_info.queue_remaining, 0)
  st, _, j = request("GET", "/object_info")
  eq(st, 200)
  local ks = j.KSampler
  truthy(ks, "KSampler in object_info")
  eq(ks.input.required.steps[1], "INT")
  eq(ks.input.required.steps[2].default, 20)
  eq(ks.input.required.model[1], "MODEL")
  truthy(#ks.input.required.sampler_name[1] > 3, "sampler combo")
  eq(ks.output[1], "LATENT")
  eq(j.SaveImage.output_node, true)
  local names = j.CheckpointLoaderSimple.input.required.ckpt_name[1]
  eq(names[1], "demo.safetensors")
  st, _, j = request("GET", "/system_stats")
  eq(j.devices[1].name, "cpu")
  truthy(j.kiln.devices.cpu.peak > 0, "the cpu's peak")
  -- what stays between requests is the checkpoint kept open (its weights' tensors)
  eq(#j.kiln.checkpoints_open, 1)
  truthy(j.kiln.live.models and j.kiln.live.tensors > 0, "the checkpoint's tensors")
end)

test("serve: the status page at / is HTML from the binary that polls the server's own endpoints", function()
  local st, page = request("GET", "/")
  eq(st, 200)
  truthy(page:find("<!doctype html>", 1, true) and page:find("<svg", 1, true), "an HTML page with the memory curves")
  for _, ep in ipairs({ "/queue", "/sdapi/v1/progress", "/system_stats", "/history" }) do
    truthy(page:find(ep, 1, true), "the page reads " .. ep)
  end
  st = request("GET", "/", nil, { headers = {} })
  eq(st, 401)
  st = request("GET", "/?token=" .. TOKEN, nil, { headers = {} })
  eq(st, 200)
end)

-- Debian's chromium, headless: the page's own JavaScript fetches the endpoints and builds
-- the DOM that --dump-dom prints after the virtual time budget (a few of its one-second
-- ticks). --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
local function chromium()
  for _, name in ipairs({ "chromium", "chromium-browser" }) do
    local p = sh("command -v " .. name):match("^(/%S+)")
    if p then return p end
  end
end

test("serve: the status page in headless Chromium shows the last run's picture and its memory curve", function()
  local browser = chromium()
  if not browser then H.skip("no chromium on PATH (Debian's chromium; make deps installs it)") end
  truthy(first_prompt, "a ComfyUI prompt ran")
  local _, _, h = request("GET", "/history?max_items=1")
  local id = next(h)
  local want
  for _, o in pairs(h[id].outputs) do want = want or (o.images or {})[1] end
  truthy(want, "the last prompt saved a picture")
  local dom = sh(("timeout 60 %s --headless=new --no-sandbox --disable-gpu --no-first-run --user-data-dir=%s "
    .. "--virtual-time-budget=2500 --dump-dom %s 2>/dev/null"):format(q(browser), q(TMP .. "/chromium"),
    q(S.base .. "/?token=" .. TOKEN)))
  truthy(dom:find('<h1>kiln serve</h1>', 1, true), "the page did not load: " .. dom:sub(1, 400))
  -- the picture: an <img> whose src is /view of the last run's file, decoded by the browser
  local img = dom:match('<img id="last"[^>]*>') or ""
  truthy(img:find('src="/view?filename=' .. want.filename, 1, true), "the last picture's <img>: " .. img)
  local caption = dom:match('<div id="lastname">([^<]*)</div>') or ""
  eq(caption, want.filename .. ", 64\u{d7}64", "the caption gives the size the browser decoded")
  -- the last run's memory: an SVG polyline of the cpu's bytes, not flat
  local run = dom:match('<svg id="runmem".-</svg>') or ""
  local pts = run:match('<polyline points="([^"]*)"[^>]*class="run" data%-device="cpu"')
  truthy(pts, "no memory curve of the last run: " .. run:sub(1, 300))
  local ys, n = {}, 0
  for _, y in pts:gmatch("([%d.]+),([%d.]+)") do n = n + 1; ys[tonumber(y)] = true end
  eq(n, 120, "points in the last run's curve")
  local distinct = 0
  for _ in pairs(ys) do distinct = distinct + 1 end
  truthy(distinct > 3, "the curve is flat: " .. pts:sub(1, 200))
  truthy(dom:match('<div id="runinfo">cpu: peak [%d.]+ MiB'), "the run's peak under the curve")
  -- the live curve: one point per tick the page made
  local live = (dom:match('<svg id="mem".-</svg>') or ""):match('<polyline points="([^"]*)"[^>]*class="live"') or ""
  local ticks = select(2, live:gsub(",", ","))
  truthy(ticks >= 2, "the live curve has points from several ticks: " .. live)
  truthy(dom:find('<div id="queue">0 running, 0 waiting', 1, true), "the queue")
end)

test("serve: malformed JSON, unknown nodes, wrong types, bad links are 400 in ComfyUI's error shape", function()
  local st, _, j = request("POST", "/prompt", '{"prompt": {bad json')
  eq(st, 400)
  eq(j.error.type, "invalid_json")
  truthy(j.node_errors, "node_errors present")
  st, _, j = request("POST", "/prompt", { prompt = { ["1"] = { class_type = "NoSuchNode", inputs = {} } } })
  eq(st, 400)
  eq(j.error.type, "invalid_prompt")
  truthy(j.error.message:find("NoSuchNode", 1, true), j.error.message)
  local g = graph()
  g["3"].inputs.steps = "four"
  st, _, j = request("POST", "/prompt", { prompt = g })
  eq(st, 400)
  eq(j.error.type, "prompt_outputs_failed_validation")
  eq(j.node_errors["3"].class_type, "KSampler")
  truthy(j.node_errors["3"].errors[1].message:find("steps", 1, true))
  g = graph()
  g["3"].inputs.positive = { "4", 0 }
  st, _, j = request("POST", "/prompt", { prompt = g })
  eq(st, 400)
  eq(j.node_errors["3"].errors[1].type, "return_type_mismatch")
  g = graph()
  g["9"] = nil
  st, _, j = request("POST", "/prompt", { prompt = g })
  eq(st, 400)
  eq(j.error.type, "prompt_no_outputs")
  st, _, j = request("POST", "/prompt", { client_id = "x" })
  eq(st, 400)
  st, _, j = request("GET", "/no/such/endpoint")
  eq(st, 404)
end)

test("serve: limits on body size, image size, batch, steps and prompt tokens are 4xx naming which", function()
  local st, _, j = request("POST", "/prompt", { prompt = graph({ steps = 5000 }) })
  eq(st, 400)
  eq(j.error.type, "limit_exceeded")
  truthy(j.error.message:find("--max-steps", 1, true), j.error.message)
  eq(j.node_errors["3"].class_type, "KSampler")
  st, _, j = request("POST", "/prompt", { prompt = graph({ width = 100000 }) })
  eq(st, 400)
  truthy(j.error.message:find("width", 1, true) and j.error.message:find("--max-size", 1, true), j.error.message)
  st, _, j = request("POST", "/prompt", { prompt = graph({ batch = 500 }) })
  eq(st, 400)
  truthy(j.error.message:find("--max-batch", 1, true), j.error.message)
  st, _, j = request("POST", "/prompt", { prompt = graph({ text = ("word "):rep(2000) }) })
  eq(st, 400)
  truthy(j.error.message:find("prompt tokens", 1, true) and j.error.message:find("--max-tokens", 1, true), j.error.message)
  st, _, j = request("POST", "/sdapi/v1/txt2img", { prompt = "x", steps = 999 })
  eq(st, 400)
  truthy(j.error.message:find("--max-steps", 1, true), j.error.message)
  st, _, j = request("POST", "/sdapi/v1/txt2img", { prompt = "x", batch_size = 99 })
  eq(st, 400)
  truthy(j.error.message:find("--max-batch", 1, true), j.error.message)
  -- the body: 64M by default; 65M is refused before Lua reads it
  local big = TMP .. "/big.json"
  local f = assert(io.open(big, "wb"))
  local chunk = ("x"):rep(1 << 20)
  for _ = 1, 65 do f:write(chunk) end
  f:close()
  local out = sh(("%s http POST %s -H %s -f %s"):format(q(client), q(S.base .. "/prompt"), q(AUTH), q(big)))
  os.remove(big)
  eq(tonumber(out:match("STATUS (%d+)")), 413)
  truthy(out:find("--max-body", 1, true), out)
end)

test("serve: /view refuses traversal ('..', absolute paths, links out of the folder, other types)", function()
  local st, _, j = request("GET", "/view?filename=../log&type=output")
  eq(st, 403)
  eq(j.error.type, "forbidden")
  st = request("GET", "/view?filename=passwd&subfolder=../../../../etc&type=output")
  eq(st, 403)
  st = request("GET", "/view?filename=%2Fetc%2Fpasswd&type=output")
  eq(st, 403)
  st = request("GET", "/view?filename=x.png&type=secret")
  eq(st, 400)
  assert(os.execute(("ln -s /etc/passwd %s"):format(q(S.out .. "/escape.png"))))
  st = request("GET", "/view?filename=escape.png&type=output")
  eq(st, 403)
  st = request("GET", "/view?filename=nothing.png&type=output")
  eq(st, 404)
end)

test("serve: /upload/image (multipart) into input/, viewable; a subfolder outside is refused", function()
  local png = read(DEMO:gsub("kiln%-shapes%.safetensors$", "../memory-picture.png"))
  truthy(png_wh(png), "a PNG to upload")
  local function form(fields, filename)
    local b = "kilnBoundary7MA4YWxk"
    local parts = {}
    for k, v in pairs(fields) do
      parts[#parts + 1] = ('--%s\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n'):format(b, k, v)
    end
    parts[#parts + 1] = ('--%s\r\nContent-Disposition: form-data; name="image"; filename="%s"\r\nContent-Type: image/png\r\n\r\n')
      :format(b, filename) .. png .. "\r\n"
    parts[#parts + 1] = "--" .. b .. "--\r\n"
    return table.concat(parts), "Content-Type: multipart/form-data; boundary=" .. b
  end
  local body, ct = form({ overwrite = "true" }, "up.png")
  local st, _, j = request("POST", "/upload/image", body, { headers = { AUTH, ct } })
  eq(st, 200)
  eq(j.name, "up.png")
  eq(j.type, "input")
  local vst, bytes = request("GET", "/view?filename=up.png&type=input")
  eq(vst, 200)
  eq(bytes, png)
  body, ct = form({ subfolder = "../../x" }, "up.png")
  st = request("POST", "/upload/image", body, { headers = { AUTH, ct } })
  eq(st, 403)
  -- a name with a path keeps its last part only
  body, ct = form({ overwrite = "true" }, "../../evil.png")
  st, _, j = request("POST", "/upload/image", body, { headers = { AUTH, ct } })
  eq(st, 200)
  eq(j.name, "evil.png")
  st = request("POST", "/upload/image", "not a form", { headers = { AUTH, "Content-Type: text/plain" } })
  eq(st, 400)
end)

local b64png
test("serve: A1111 txt2img gives a decodable base64 PNG with parameters and info; sampler names mapped", function()
  local st, text, j = request("POST", "/sdapi/v1/txt2img", { prompt = "a yellow star on a green background", steps = 4,
    seed = 7, cfg_scale = 3, sampler_name = "DPM++ 2M Karras", batch_size = 2 })
  eq(st, 200, text)
  eq(#j.images, 2)
  -- decoded by coreutils' base64, not by kiln
  local b64f, pngf = TMP .. "/img.b64", TMP .. "/img.png"
  write(b64f, j.images[1])
  truthy(os.execute(("base64 -d %s > %s"):format(q(b64f), q(pngf))), "base64 -d failed")
  local t = kiln.load_png(pngf)
  eq(t.shape[3], 64)
  eq(t.shape[4], 64)
  t:free()
  eq(j.parameters.prompt, "a yellow star on a green background")
  local info = kiln.json.decode(j.info)
  eq(info.seed, 7)
  eq(info.all_seeds[2], 8)
  eq(info.kiln_sampler, "dpmpp_2m")
  eq(info.kiln_scheduler, "karras")
  truthy(info.infotexts[1]:find("Steps: 4", 1, true), info.infotexts[1])
  b64png = j.images[1]
  st, _, j = request("POST", "/sdapi/v1/txt2img", { prompt = "x", sampler_name = "Nope" })
  eq(st, 400)
  truthy(j.error.message:find("DPM++ 2M", 1, true), j.error.message)
  st, _, j = request("POST", "/sdapi/v1/txt2img", "{not json")
  eq(st, 400)
  -- the pipeline's own argument check is the request's mistake, not the server's
  st, text = request("POST", "/sdapi/v1/txt2img", { prompt = "x", steps = 1, width = 66, height = 64 })
  eq(st, 400, text)
  truthy(text:find("multiple", 1, true), text)
end)

test("serve: A1111 img2img (base64 init image, mask, denoising_strength), hires fields, sd-models, options", function()
  truthy(b64png, "txt2img ran")
  local st, text, j = request("POST", "/sdapi/v1/img2img", { init_images = { "data:image/png;base64," .. b64png },
    prompt = "a red circle", steps = 4, denoising_strength = 0.5, seed = 1 })
  eq(st, 200, text)
  eq(#j.images, 1)
  eq(j.parameters.init_images, kiln.json.null)
  st, text, j = request("POST", "/sdapi/v1/txt2img", { prompt = "a red circle", steps = 2, seed = 1, width = 64, height = 64,
    enable_hr = true, hr_scale = 2, hr_second_pass_steps = 2, denoising_strength = 0.5 })
  eq(st, 200, text)
  local pf = TMP .. "/hr.png"
  write(TMP .. "/hr.b64", j.images[1])
  truthy(os.execute(("base64 -d %s > %s"):format(q(TMP .. "/hr.b64"), q(pf))))
  eq(png_wh(read(pf)), 128, "hires fix doubles the size")
  st, _, j = request("POST", "/sdapi/v1/img2img", { init_images = { "bm90IGEgcG5n" }, prompt = "x" })
  eq(st, 400)
  eq(j.error.type, "invalid_image")
  st, _, j = request("GET", "/sdapi/v1/sd-models")
  eq(j[1].title, "demo.safetensors")
  st, _, j = request("POST", "/sdapi/v1/options", { sd_model_checkpoint = "missing.safetensors" })
  eq(st, 400)
  st = request("POST", "/sdapi/v1/options", { sd_model_checkpoint = "demo" })
  eq(st, 200)
  st, _, j = request("GET", "/sdapi/v1/options")
  eq(j.sd_model_checkpoint, "demo.safetensors")
end)

local tensors_between
test("serve: /interrupt cancels the running graph cleanly: execution_interrupted, executing null, the next prompt runs", function()
  local gf = TMP .. "/graph_long.json"
  write(gf, kiln.json.encode({ prompt = graph({ steps = 200, prefix = "long" }), client_id = "client-2" }))
  local p = ws_open("/ws?clientId=client-2", ("--post %s %s --until %s --timeout 120"):format(q(S.base .. "/prompt"), q(gf),
    q('"node":null')))
  tensors_between = select(3, request("GET", "/system_stats")).kiln.live.tensors
  local lines, interrupted = {}, false
  for l in p:lines() do
    lines[#lines + 1] = l
    if not interrupted and l:match('"type":"progress"') then
      -- the A1111 progress sees the ComfyUI run too, with a preview by the second step
      local st = request("POST", "/interrupt", "")
      eq(st, 200)
      interrupted = true
    end
  end
  p:close()
  local msgs = messages_of(lines)
  local types = {}
  for _, m in ipairs(msgs) do types[#types + 1] = m.type end
  local all = table.concat(types, " ")
  truthy(all:find("execution_interrupted", 1, true), all)
  truthy(not all:find("execution_success", 1, true), all)
  local steps = 0
  for _, m in ipairs(msgs) do if m.type == "progress" then steps = steps + 1 end end
  truthy(steps < 200, "the run stopped early")
  eq(msgs[#msgs].data.node, kiln.json.null)
  local r = kiln.json.decode(lines[2]:match("^POSTED 200 (.*)$"))
  local _, _, h = request("GET", "/history/" .. r.prompt_id)
  eq(h[r.prompt_id].status.status_str, "error")
  -- the server goes on
  local st, _, j = request("GET", "/system_stats")
  eq(st, 200)
  truthy(j.kiln.live.tensors <= tensors_between, "the cancelled run left tensors alive")
  eq(j.kiln.queue_remaining, 0)
end)

test("serve: a client that disconnects mid-run costs nothing: the run finishes, the server goes on", function()
  local gf = TMP .. "/graph_dc.json"
  write(gf, kiln.json.encode({ prompt = graph({ steps = 8, prefix = "dc" }), client_id = "client-3" }))
  local out = sh(("%s ws %s -H %s --post %s %s --close-after %s --timeout 60"):format(q(client),
    q(S.base .. "/ws?clientId=client-3"), q(AUTH), q(S.base .. "/prompt"), q(gf), q('"type":"progress"')))
  truthy(out:find("DISCONNECTED", 1, true), out)
  local id = kiln.json.decode(out:match("POSTED 200 ([^\n]*)")).prompt_id
  local entry
  for _ = 1, 300 do
    local _, _, h = request("GET", "/history/" .. id)
    entry = h and h[id]
    if entry then break end
    sleep(0.1)
  end
  truthy(entry, "the run did not finish")
  eq(entry.status.status_str, "success")
  truthy(lfs.attributes(S.out .. "/" .. entry.outputs["9"].images[1].filename, "mode") == "file")
end)

test("serve: between requests nothing grows: no live tensor, the same checkpoints open, history bounded", function()
  local a
  for i = 1, 4 do
    if i == 2 then
      for _ = 1, 300 do
        local _, _, qj = request("GET", "/queue")
        if #qj.queue_running == 0 and #qj.queue_pending == 0 then break end
        sleep(0.1)
      end
      a = select(3, request("GET", "/system_stats"))
    end
    local st = request("POST", "/prompt", { prompt = graph({ seed = i, steps = 2, prefix = "mem" }) })
    eq(st, 200)
    st = request("POST", "/sdapi/v1/txt2img", { prompt = "a red circle", steps = 2, seed = i })
    eq(st, 200)
  end
  for _ = 1, 300 do
    local _, _, qj = request("GET", "/queue")
    if #qj.queue_running == 0 and #qj.queue_pending == 0 then break end
    sleep(0.1)
  end
  local _, _, b = request("GET", "/system_stats")
  eq(b.kiln.live.tensors, a.kiln.live.tensors, "tensors alive between requests")
  eq(#b.kiln.live.models, #a.kiln.live.models, "models open")
  eq(table.concat(b.kiln.checkpoints_open, ","), table.concat(a.kiln.checkpoints_open, ","))
  eq(b.kiln.devices.cpu.allocated, 0, "no bytes held on the cpu between requests")
end)

test("serve: on a device with a budget the models stay resident between requests (a second request copies "
  .. "no weights) and another checkpoint's load evicts them by the budget, not by a count", function()
  -- two checkpoints (two names of the demo file: two models to kiln) on sim with room
  -- for one checkpoint's weights and a run, not for two
  local models = TMP .. "/models_sim"
  assert(os.execute("mkdir -p " .. q(models .. "/checkpoints")))
  for _, n in ipairs({ "a", "b" }) do
    assert(os.execute(("ln -s %s %s"):format(q(DEMO), q(models .. "/checkpoints/" .. n .. ".safetensors"))))
  end
  local s3 = start("--device sim --vram 16M --quiet --keep-checkpoints 0", models)
  local weights = lfs.attributes(DEMO, "size")
  local function run(ck)
    local st, text = request("POST", "/sdapi/v1/options", { sd_model_checkpoint = ck }, { server = s3, headers = {} })
    eq(st, 200, text)
    st, text = request("POST", "/sdapi/v1/txt2img", { prompt = "a red circle", steps = 1, seed = 1 },
      { server = s3, headers = {} })
    eq(st, 200, text)
    local _, _, j = request("GET", "/system_stats", nil, { server = s3, headers = {} })
    local r = j.kiln.checkpoints_resident
    return j.kiln.last_run_memory.copied_in.sim, (r["a.safetensors"] or {}).sim or 0, (r["b.safetensors"] or {}).sim or 0
  end
  local copied, a, b = run("a")
  truthy(copied > 0.9 * weights, ("the first request copies a's weights: %d of %d bytes"):format(copied, weights))
  truthy(a > 0.9 * weights and b == 0, ("a resident: %d, b: %d"):format(a, b))
  copied, a = run("a")
  truthy(copied < 0.01 * weights, ("the second request copied %d bytes (weights %d)"):format(copied, weights))
  truthy(a > 0.9 * weights, "a still resident")
  -- b's weights and a's together are over the budget: loading b evicts a's
  copied, a, b = run("b")
  truthy(copied > 0.9 * weights, ("b's weights copied: %d"):format(copied))
  truthy(b > 0.9 * weights, "b resident")
  truthy(a < 0.5 * weights, ("the budget evicted a's weights: %d of %d bytes left"):format(a, weights))
  copied = run("b")
  truthy(copied < 0.01 * weights, ("b again copied %d bytes"):format(copied))
  -- with --keep-checkpoints 0 a checkpoint is closed once nothing of it is resident;
  -- a keeps some (its VAE fits beside b), so both stay open
  local _, _, j = request("GET", "/system_stats", nil, { server = s3, headers = {} })
  eq(#j.kiln.checkpoints_open, 2)
  eq(j.kiln.devices.sim.budget, 16 * 1024 * 1024)
  truthy(j.kiln.devices.sim.allocated <= j.kiln.devices.sim.budget, "within the budget")
  os.execute("kill -TERM " .. s3.pid)
  eq(wait_exit(s3), 0, read(s3.log))
end)

test("serve: SIGTERM ends the server cleanly (exit 0, no leak under KILN_CHECK_LEAKS)", function()
  local st = request("GET", "/queue")
  eq(st, 200)
  os.execute("kill -TERM " .. S.pid)
  eq(wait_exit(S), 0, read(S.log))
  truthy(read(S.log):find("kiln serve: stopped", 1, true), read(S.log))
end)

test("serve: SIGTERM during an A1111 run cancels it, answers the waiting request and exits 0", function()
  local s2 = start("--max-steps 1000")
  local out = TMP .. "/long.out"
  local bf = TMP .. "/long.json"
  write(bf, kiln.json.encode({ prompt = "a red circle", steps = 1000, seed = 2 }))
  os.execute(("%s http POST %s -f %s -o %s > %s 2>&1 &"):format(q(client), q(s2.base .. "/sdapi/v1/txt2img"), q(bf),
    q(out .. ".body"), q(out)))
  local step = 0
  for _ = 1, 300 do
    local _, _, j = request("GET", "/sdapi/v1/progress", nil, { server = s2, headers = {} })
    step = j and j.state.sampling_step or 0
    if step >= 2 then
      truthy(j.current_image ~= kiln.json.null, "a preview in /sdapi/v1/progress during the run")
      break
    end
    sleep(0.1)
  end
  truthy(step >= 2, "the run did not start")
  os.execute("kill -TERM " .. s2.pid)
  eq(wait_exit(s2), 0, read(s2.log))
  local text
  for _ = 1, 50 do
    text = read(out) or ""
    if text:match("STATUS") then break end
    sleep(0.1)
  end
  truthy(text:match("STATUS 200") or text:match("STATUS 503"), "the waiting request was answered: " .. text)
end)

if not os.getenv("KILN_SERVE_KEEP") then os.execute("rm -rf " .. q(TMP)) else print("kept " .. TMP) end
