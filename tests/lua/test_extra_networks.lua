-- test_extra_networks.lua - A1111's <lora:...> prompt syntax, the --lora option, the
-- "Lora hashes" field (the hash checked against FIPS 180-2's published SHA-256 of
-- "abc"), and that the pipelines remove a run's LoRAs again, also when it fails.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local kiln = require "kiln"
local en = require "kiln.extra_networks"
local pipeline = require "kiln.pipeline"
local test, eq, raises, truthy = H.test, H.eq, H.raises, H.truthy

test("prompt tags: taken out, strengths in A1111's order (te, then unet)", function()
  local p, l = en.parse("a cat <lora:detail:0.8>, <lora:style:0.5:1.2> on a mat <lora:x:unet=0.3:te=0>")
  eq(p, "a cat, on a mat")
  eq(#l, 3)
  eq(l[1].name, "detail"); eq(l[1].clip, 0.8); eq(l[1].unet, 0.8)
  eq(l[2].name, "style"); eq(l[2].clip, 0.5); eq(l[2].unet, 1.2)
  eq(l[3].name, "x"); eq(l[3].clip, 0); eq(l[3].unet, 0.3)
  local p2, l2 = en.parse("<lora:a>x <lora:a:0.5>")
  eq(p2, "x"); eq(#l2, 1); eq(l2[1].unet, 0.5) -- the last strengths of a name count
  local plain = "two  spaces, kept"
  eq((en.parse(plain)), plain) -- a prompt without tags is left exactly as it is
end)

test("bad tags and options are named", function()
  raises(function() en.parse("<lora:a:zz>") end, "prompt: <lora:a:zz>: the te strength 'zz' is not a number")
  raises(function() en.parse("<lora::1>") end, "no LoRA name")
  raises(function() en.parse("<lora:a:1:2:3>") end, "too many fields")
  raises(function() en.parse("<lora:a:foo=1>") end, "unknown field 'foo'")
  raises(function() en.parse_option("a:x") end, "--lora a:x: the te strength")
  local e = en.parse_option("detail:0.7")
  eq(e.name, "detail"); eq(e.unet, 0.7); eq(e.clip, 0.7)
end)

-- a safetensors file whose tensor data is the 3 bytes "abc"
local function abc_file()
  local path = os.tmpname()
  local header = '{"t":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}'
  local f = assert(io.open(path, "wb"))
  f:write(string.pack("<I8", #header), header, "abc")
  f:close()
  return path
end

test("Lora hashes: SHA-256 of the tensor data, 12 hex digits", function()
  local path = abc_file()
  -- FIPS 180-2, appendix B.1: SHA-256("abc") = ba7816bf 8f01cfea ...
  eq(en.lora_hash(path), "ba7816bf8f01")
  local ckpt = { find_lora = function(_, name)
    if name == "abc" then return path end
    error("no LoRA named '" .. name .. "' in the loras folder", 0)
  end }
  local text = pipeline.parameters({ prompt = "a cat <lora:abc:0.8>", steps = 2, cfg = 7 }, ckpt)
  truthy(text:find('Lora hashes: "abc: ba7816bf8f01"', 1, true), text)
  truthy(text:find("a cat <lora:abc:0.8>", 1, true), "the prompt keeps its tags, as A1111 writes it")
  local none = pipeline.parameters({ prompt = "a cat", steps = 2, cfg = 7 }, ckpt)
  truthy(not none:find("Lora hashes", 1, true), none)
  os.remove(path)
end)

test("a run's LoRAs are applied in order and removed after it, also on error", function()
  local log = {}
  local ckpt = {
    find_lora = function(_, name) return "/loras/" .. name .. ".safetensors" end,
    add_lora = function(_, path, o)
      if o.name == "bad" then error("not a LoRA: " .. path, 0) end
      log[#log + 1] = ("add %s %g %g"):format(path, o.unet, o.clip)
      return { remove = function() log[#log + 1] = "remove " .. o.name end }
    end,
  }
  do
    local _, list = en.of_run({ prompt = "x <lora:b:0.5>", lora = { "a:0.3" } })
    local h <close> = en.apply(ckpt, list)
    eq(#log, 2)
    eq(log[1], "add /loras/a.safetensors 0.3 0.3")
    eq(log[2], "add /loras/b.safetensors 0.5 0.5")
  end
  eq(log[3], "remove b"); eq(log[4], "remove a")
  log = {}
  local _, list = en.of_run({ prompt = "x <lora:a> <lora:bad>" })
  raises(function() local h <close> = en.apply(ckpt, list) end, "not a LoRA: /loras/bad.safetensors")
  eq(log[1], "add /loras/a.safetensors 1 1"); eq(log[2], "remove a") -- the first one came off again
end)

test("the demo pipeline runs unchanged when the prompt has no tags", function()
  local ckpt <close> = kiln.load_checkpoint("examples/models/kiln-shapes.safetensors")
  local img <close> = pipeline.txt2img(ckpt, { prompt = "a red circle", steps = 1, width = 32, height = 32, seed = 1 })
  eq(img.shape[3], 32)
end)

test("the planner's table lists the LoRAs in use (owner lora:NAME)", function()
  local T = require "tiny_sd"
  local ck <close> = kiln.load_checkpoint(T.ckpt_file("sd1"), { loras = "tests/golden/lora" })
  local h <close> = ck:add_lora(ck:find_lora("sd1_kohya"))
  local plan = require("kiln.planner").choose(ck, { width = 64, height = 64, device = "sim", steps = 1 })
  local text = table.concat(plan.lines, "\n")
  truthy(text:find("lora:sd1_kohya", 1, true), text)
  T.cleanup()
end)

H.done()
