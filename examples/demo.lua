-- examples/demo.lua - draws an image with plain tensor ops and writes a PNG.
-- (The text-to-image demo replaces this once the bundled model lands.)
--   kiln examples/demo.lua [--out PATH] [--size N]
local kiln = require "kiln"
local util = require "kiln.util"
local opts = util.parse_args(arg, { out = "kiln-demo.png", size = 256 })
local n = opts.size

-- coordinates in [-1, 1]
local xs = kiln.linspace(-1, 1, n):reshape({ 1, n })
local ys = kiln.linspace(-1, 1, n):reshape({ n, 1 })
local r2 = xs * xs + ys * ys                                    -- [n, n] by broadcasting
local ring = ((r2 - 0.5):abs() * -12):exp()                     -- a soft ring
local glow = (r2 * -3):exp()
local noise = kiln.rand({ n, n }, { seed = 7 }) * 0.08

local red   = (glow * 0.9 + ring * 0.4 + noise):clamp(0, 1)
local green = (ring * 0.8 + xs * 0.1 + 0.1):clamp(0, 1)
local blue  = ((ys + 1) * 0.35 + ring * 0.3):clamp(0, 1)
local img = kiln.cat({ red:reshape({ 1, 1, n, n }), green:reshape({ 1, 1, n, n }),
                       blue:reshape({ 1, 1, n, n }) }, 2)
kiln.save_png(img, opts.out, { text = { Software = "kiln " .. kiln.version } })
print(("wrote %s (%dx%d)"):format(opts.out, n, n))
print(kiln.mem.summary())
