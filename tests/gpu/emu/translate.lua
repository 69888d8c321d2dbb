-- translate.lua - rewrites CUDA kernel launches for the CPU emulation:
--   name<T><<<grid, block, smem, stream>>>(args);
-- becomes
--   emu_launch(dim3(grid), dim3(block), smem, stream, [&] { name<T>(args); });
-- Usage: lua5.4 translate.lua IN.cu OUT.cpp
local src = assert(io.open(arg[1], "rb")):read("a")
local out, i = {}, 1
local function split_top(s) -- split at commas outside (), [], <>
  local parts, depth, cur = {}, 0, {}
  for c in s:gmatch(".") do
    if c:match("[%(%[<]") then depth = depth + 1 elseif c:match("[%)%]>]") then depth = depth - 1 end
    if c == "," and depth == 0 then parts[#parts + 1] = table.concat(cur); cur = {} else cur[#cur + 1] = c end
  end
  parts[#parts + 1] = table.concat(cur)
  return parts
end
while true do
  local j = src:find("<<<", i, true)
  if not j then out[#out + 1] = src:sub(i); break end
  local k, depth = j, 0 -- walk back over the kernel name and its template arguments
  while k > 1 do
    local c = src:sub(k - 1, k - 1)
    if c == ">" then depth = depth + 1
    elseif c == "<" then depth = depth - 1
    elseif depth == 0 and not c:match("[%w_:]") then break end
    k = k - 1
  end
  local name = src:sub(k, j - 1)
  local e = assert(src:find(">>>", j, true), "unterminated <<<")
  local cfg = split_top(src:sub(j + 3, e - 1))
  assert(src:sub(e + 3, e + 3) == "(", "launch without arguments")
  local p, d = e + 4, 1
  while d > 0 do
    local c = src:sub(p, p)
    if c == "(" then d = d + 1 elseif c == ")" then d = d - 1 end
    p = p + 1
  end
  local args = src:sub(e + 4, p - 2)
  for n = #cfg + 1, 4 do cfg[n] = "0" end
  out[#out + 1] = src:sub(i, k - 1)
  out[#out + 1] = ("emu_launch(dim3(%s), dim3(%s), %s, %s, [&] { %s(%s); })"):format(cfg[1], cfg[2], cfg[3], cfg[4], name, args)
  i = p
end
assert(io.open(arg[2], "wb")):write(table.concat(out))
