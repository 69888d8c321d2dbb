-- kiln.guidance: classifier-free guidance around a network's prediction, shared by the
-- UNet and the flow-matching denoisers of kiln.pipeline / kiln.flow:
-- u + (c - u) * cfg, cond and uncond in one batched call or two, temporaries freed.
local kiln = require "kiln"

local M = {}

--- predict(x, sigma, ctx, y, n) -> the network's denoised prediction for a batch of n.
-- Returns function(x, sigma) -> the guided prediction: cond's alone when cfg is 1;
-- else one call over the batch [uncond; cond] when `both` = {ctx = [uncond; cond], y =
-- [y_uncond; y_cond] or nil} is given, two calls otherwise. after(x, sigma, r, c), when
-- given, returns the final prediction from the guided one r (which it may free) and
-- the positive prediction c (SD 3's skip-layer guidance adds its term so).
function M.cfg(predict, cfg, cond, uncond, y_c, y_u, both, after)
  local function guided(u, c)
    local d = c - u
    local dg = d * cfg
    local r = u + dg
    d:free(); dg:free()
    return r
  end

  return function(x, sigma)
    local B = x.shape[1]
    if cfg == 1 then return predict(x, sigma, cond, y_c, B) end
    if both then
      local xx = kiln.cat({ x, x }, 1)
      local out = predict(xx, sigma, both.ctx, both.y, 2 * B)
      xx:free()
      local u, c = out:narrow(1, 1, B), out:narrow(1, B + 1, B)
      local r = guided(u, c)
      if after then r = after(x, sigma, r, c) end
      u:free(); c:free(); out:free()
      return r
    end
    local u = predict(x, sigma, uncond, y_u, B)
    local c = predict(x, sigma, cond, y_c, B)
    local r = guided(u, c)
    if after then r = after(x, sigma, r, c) end
    u:free(); c:free()
    return r
  end
end

return M
