#!/usr/bin/python3
"""Golden data for kiln.image.canny: small images and their Canny edge maps.

Run from the repository root:  /usr/bin/python3 tests/golden/gen_canny.py
Writes tests/golden/canny/canny.safetensors, read by tests/lua/test_image.lua.
The edge maps come from an independent NumPy (float32) implementation of the steps
of kornia.filters.canny, which ComfyUI's Canny node calls: grayscale (0.299, 0.587,
0.114), separable Gaussian blur (kernel 5, sigma 1, reflect padding, rows then
columns), Sobel by correlation with replicate padding, magnitude
sqrt(gx^2 + gy^2 + 1e-6), non-maximum suppression along round(atan2(gy, gx) / 45)
(the 3x3 difference kernels with zero padding: strictly greater than both
neighbours), double threshold (strict >), and kornia's hysteresis loop.
For each case it also stores `ambiguous`: pixels whose result hangs on a float tie
(two magnitudes along the gradient within a few ulps, a magnitude within a few ulps
of a threshold, or an angle within 1e-4 degrees of a rounding boundary), where an
implementation summing in another order may legitimately differ."""
import json, os, struct
import numpy as np

f32 = np.float32


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        raw = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def correlate_rows(x, k):  # x [H, W+len(k)-1] -> [H, W]
    w = x.shape[1] - len(k) + 1
    out = np.zeros((x.shape[0], w), f32)
    for i, v in enumerate(k):
        out = (out + x[:, i:i + w] * f32(v)).astype(f32)
    return out


def canny(img, low, high):
    """img [C, H, W] float32 -> (magnitude after NMS, edges, ambiguous) [H, W]."""
    if img.shape[0] == 3:
        grey = (f32(0.299) * img[0] + f32(0.587) * img[1]).astype(f32) + f32(0.114) * img[2]
    else:
        grey = img[0]
    grey = grey.astype(f32)
    h, w = grey.shape
    # Gaussian: kornia's get_gaussian_kernel1d, normalized in float32
    x = np.arange(5, dtype=f32) - f32(2)
    g = np.exp(-(x * x) / f32(2.0)).astype(f32)
    g = (g / g.sum(dtype=f32)).astype(f32)
    bx = correlate_rows(np.pad(grey, ((0, 0), (2, 2)), mode="reflect"), g)
    blurred = correlate_rows(np.pad(bx, ((2, 2), (0, 0)), mode="reflect").T, g).T
    # Sobel, replicate padding (numpy's "edge")
    p = np.pad(blurred, 1, mode="edge")
    sx = np.array([[-1, 0, 1], [-2, 0, 2], [-1, 0, 1]], f32)
    gx = np.zeros((h, w), f32)
    gy = np.zeros((h, w), f32)
    for dy in range(3):
        for dx in range(3):
            win = p[dy:dy + h, dx:dx + w]
            gx = (gx + sx[dy, dx] * win).astype(f32)
            gy = (gy + sx[dx, dy] * win).astype(f32)
    mag = np.sqrt((gx * gx + gy * gy).astype(f32) + f32(1e-6)).astype(f32)
    ang = np.degrees(np.arctan2(gy, gx)).astype(f32)
    q = np.round(ang / f32(45)).astype(f32)  # half to even, as torch.round
    pos = (q % 8).astype(np.int64)
    neg = ((q + 4) % 8).astype(np.int64)
    # kornia's NMS kernels: direction k compares with the neighbour at OFF[k]
    OFF = [(0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1), (-1, 0), (-1, 1)]
    pm = np.pad(mag, 1)
    nb = np.stack([pm[1 + dy:1 + dy + h, 1 + dx:1 + dx + w] for dy, dx in OFF])
    diff = (mag[None] - nb).astype(f32)
    yy, xx = np.mgrid[0:h, 0:w]
    dpos, dneg = diff[pos, yy, xx], diff[neg, yy, xx]
    is_max = np.minimum(dpos, dneg) > 0
    thin = (mag * is_max).astype(f32)
    # double threshold and kornia's hysteresis loop
    edges = ((thin > f32(low)) * f32(0.5) + (thin > f32(high)) * f32(0.5)).astype(f32)
    old = -np.ones_like(edges)
    hyst = None
    while (np.abs(old - edges) != 0).any():
        weak = (edges == 0.5).astype(f32)
        strong = (edges == 1).astype(f32)
        pe = np.pad(edges, 1)
        touch = np.zeros((h, w), bool)
        for dy, dx in OFF:
            touch |= pe[1 + dy:1 + dy + h, 1 + dx:1 + dx + w] == 1
        hyst = touch.astype(f32) * weak + strong
        old = edges.copy()
        edges = hyst + (hyst == 0) * weak * f32(0.5)
    edges = hyst
    # where a float tie decides
    ulp = np.spacing(mag) * 8
    near_tie = (np.abs(dpos) <= ulp) | (np.abs(dneg) <= ulp)
    near_thr = (np.abs(thin - f32(low)) <= ulp) | (np.abs(thin - f32(high)) <= ulp)
    frac = np.abs(ang / 45 - np.floor(ang / 45) - 0.5)
    near_ang = frac * 45 <= 1e-4
    # only where the magnitude can pass the low threshold does a tie matter
    amb = ((near_tie | near_ang) & (mag > f32(low) * f32(0.999)) | near_thr).astype(f32)
    return thin, edges.astype(f32), amb


def shapes(h, w):
    yy, xx = np.mgrid[0:h, 0:w].astype(f32)
    img = np.zeros((3, h, w), f32)
    img[2] = 0.2                                           # blue background
    circle = (yy - 15.3) ** 2 + (xx - 12.7) ** 2 < 8.2 ** 2
    img[0][circle] = 0.9                                   # red disc
    img[1][6:26, 24:36] = 0.8                              # green rectangle
    img[:, 27:30, 3:20] = 1.0                              # white bar
    return img


def gradient(h, w):
    yy, xx = np.mgrid[0:h, 0:w].astype(f32)
    ramp = (xx / f32(w - 1)) * f32(0.6) + (yy / f32(h - 1)) * f32(0.2)
    img = np.stack([ramp, ramp * f32(0.5), f32(1) - ramp]).astype(f32)
    img[:, :, 20:] += 0.3                                  # a step across the ramp
    return np.clip(img, 0, 1).astype(f32)


def noise(h, w, rng):
    return rng.random((3, h, w), dtype=f32)


def grey_blob(h, w, rng):
    yy, xx = np.mgrid[0:h, 0:w].astype(f32)
    img = 0.5 + 0.4 * np.sin(xx / f32(3.1)) * np.cos(yy / f32(4.3))
    img += rng.random((h, w), dtype=f32) * f32(0.05)
    return np.clip(img, 0, 1).astype(f32)[None]


def main():
    rng = np.random.default_rng(19)
    H, W = 32, 40
    images = {"shapes": shapes(H, W), "gradient": gradient(H, W), "noise": noise(H, W, rng),
              "grey": grey_blob(H, W, rng)}
    # (case, image, low, high); the names are read by tests/lua/test_image.lua
    cases = [
        ("shapes", "shapes", 0.4, 0.8),
        ("shapes_low", "shapes", 0.1, 0.3),
        ("gradient", "gradient", 0.2, 0.5),
        ("noise", "noise", 0.4, 0.8),
        ("noise_low", "noise", 0.1, 0.3),
        ("grey", "grey", 0.05, 0.15),
    ]
    out, meta = {}, []
    for name, img in images.items():
        out[name + ".input"] = img.astype(f32)[None]
    for name, src, low, high in cases:
        thin, edges, amb = canny(images[src].astype(f32), low, high)
        out[name + ".edges"] = edges[None, None]
        out[name + ".ambiguous"] = amb[None, None]
        out[name + ".thresholds"] = np.array([low, high], f32)
        meta.append("%s: %d edge pixels, %d ambiguous" % (name, int(edges.sum()), int(amb.sum())))
    os.makedirs("tests/golden/canny", exist_ok=True)
    save("tests/golden/canny/canny.safetensors", out)
    print("wrote tests/golden/canny/canny.safetensors;", "; ".join(meta))


main()
