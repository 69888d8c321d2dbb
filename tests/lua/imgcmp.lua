-- Comparing a tiled result with the untiled one: PSNR and the seam check of the
-- tiling tests (test_tile.lua, test_vae_tiled.lua).
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

return M
