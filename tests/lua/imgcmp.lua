-- Comparing a tiled result with the untiled one: PSNR and the seam check of the
-- tiling tests (test_tile.lua, test_vae_tiled.lua); the shift and the wrap-around seam
-- measure of the seamless tests (test_tileable.lua, test_taesd.lua, test_upscaler.lua).
local kiln = require "kiln"
local M = {}

-- PSNR of a against the reference b, with b's value range as the peak.
function M.psnr(a, b)
  assert(table.concat(a.shape, ",") == table.concat(b.shape, ","),
    ("shape %s vs %s"):format(table.concat(a.shape, ","), table.concat(b.shape, ",")))
  local d = a - b
  local sq = d * d
  local mse = sq:mean()
  d:free(); sq:free()
  local range = b:max() - b:min()
  if mse == 0 then return math.huge end
  return 10 * math.log(range * range / mse, 10)
end

-- Max |a - b| on output pixels next to an interior tile edge (the last pixel of a
-- tile and the first after it, on rows and columns, widened by one) and elsewhere.
-- plan: kiln.tile.plan of the tiled run.
function M.seam_check(a, b, plan)
  local edge_r, edge_c = {}, {}
  for _, t in ipairs(plan) do
    local o = t.output
    for _, r in ipairs({ o.y, o.y + o.h - 1 }) do edge_r[r] = true end
    for _, c in ipairs({ o.x, o.x + o.w - 1 }) do edge_c[c] = true end
  end
  edge_r[1], edge_r[plan.out_h], edge_c[1], edge_c[plan.out_w] = nil, nil, nil, nil
  local function widen(e, n)
    local w = {}
    for r in pairs(e) do
      for d = -1, 1 do if r + d >= 1 and r + d <= n then w[r + d] = true end end
    end
    return w
  end
  edge_r, edge_c = widen(edge_r, plan.out_h), widen(edge_c, plan.out_w)
  local dt = a - b
  local ad = dt:abs()
  local d = ad:table()
  dt:free(); ad:free()
  local border, inside = 0, 0
  for _, img in ipairs(d) do
    for _, ch in ipairs(img) do
      for r, row in ipairs(ch) do
        local er = edge_r[r]
        for c, v in ipairs(row) do
          if er or edge_c[c] then border = math.max(border, v) else inside = math.max(inside, v) end
        end
      end
    end
  end
  return border, inside
end

-- x rolled circularly by s along dim d (torch.roll): the shift of the seamless tests.
function M.roll(x, s, d)
  local n = x.shape[d]
  s = s % n
  if s == 0 then return x:contiguous() end
  local a, b = x:narrow(d, n - s + 1, s), x:narrow(d, 1, n - s)
  local r = kiln.cat({ a, b }, d)
  a:free(); b:free()
  return r
end

-- How strong the wrap-around seam of a tileable picture is: the mean abs difference of
-- the wrap-around pair (last and first row, d = 3, or column, d = 4) over the mean of the
-- interior neighbouring pairs (about 1: no seam).
function M.seam_ratio(img, d)
  local diffs, seam = M.neighbour_diffs(img, d)
  local sum = 0
  for _, v in ipairs(diffs) do sum = sum + v end
  return seam / (sum / #diffs)
end

-- The mean |difference| of each interior neighbouring pair along dim d (a list, pair j
-- = slices j and j + 1), and of the wrap-around pair (last, first).
function M.neighbour_diffs(img, d)
  local n = img.shape[d]
  local out = {}
  for j = 1, n - 1 do
    local a, b = img:narrow(d, j + 1, 1), img:narrow(d, j, 1)
    local e = a - b
    out[j] = e:abs():mean()
    a:free(); b:free(); e:free()
  end
  local a, b = img:narrow(d, n, 1), img:narrow(d, 1, 1)
  local e = a - b
  local seam = e:abs():mean()
  a:free(); b:free(); e:free()
  return out, seam
end

return M
