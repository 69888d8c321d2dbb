"""Procedural training data for kiln-shapes: 64x64 RGB pictures of simple
shapes with a caption, generated on the fly from a seed (nothing is stored).

    sample(rng) -> (image uint8 [64, 64, 3], caption str, info dict)

Captions (every word is one token of the shipped tokenizer):
    "a red circle on a blue background"               single shape
    "a small yellow star on a green background"       size word: small|large|big
    "a purple ring"                                   background left unsaid
    "a white cross on a red and black background"     two-tone: top / bottom half
    "a yellow star above a green square on a black background"
        relation: above | below | to the left of | to the right of
    "a plain orange background"                       no shape

Colours are flat with a small jitter and have well separated hues (red ~0,
orange ~28, yellow ~56, green ~128, blue ~228, purple ~277 degrees) plus
white and black, so tests can check them with hue histograms: the background
on the image border, a shape's colour inside its region. `info` gives the
shape regions (centre, radius) for such checks.
"""

import numpy as np

SIZE = 64
SS = 3                      # supersampling for anti-aliased edges

COLORS = {
    "red":    (225, 25, 35),
    "orange": (255, 125, 0),
    "yellow": (245, 230, 30),
    "green":  (30, 170, 55),
    "blue":   (30, 70, 230),
    "purple": (145, 40, 205),
    "white":  (245, 245, 245),
    "black":  (15, 15, 15),
}
COLOR_NAMES = list(COLORS)
SHAPES = ["circle", "square", "triangle", "star", "ring", "cross", "diamond"]
RELATIONS = {               # word(s) -> (axis, sign of first shape's offset)
    "above": ("y", -1),
    "below": ("y", 1),
    "to the left of": ("x", -1),
    "to the right of": ("x", 1),
}
# every word a caption can contain (the tokenizer gives each one token)
WORDS = sorted(set(
    ["a", "an", "the", "on", "and", "of", "to", "background", "plain",
     "small", "large", "big", "left", "right", "above", "below", "with",
     "in", "picture", "image"] + COLOR_NAMES + SHAPES))

# pixel-centre coordinates of the supersampled grid
_g = (np.arange(SIZE * SS, dtype=np.float32) + 0.5) / SS
_Y, _X = np.meshgrid(_g, _g, indexing="ij")


def _star_mask(dx, dy, r):
    """5-pointed star (point up), even-odd point-in-polygon test."""
    ang = -np.pi / 2 + np.arange(10) * np.pi / 5
    rad = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
    px, py = rad * np.cos(ang), rad * np.sin(ang)
    inside = np.zeros(dx.shape, dtype=bool)
    j = 9
    for i in range(10):
        xi, yi, xj, yj = px[i], py[i], px[j], py[j]
        cond = (yi > dy) != (yj > dy)
        xcross = (xj - xi) * (dy - yi) / (yj - yi + 1e-12) + xi
        inside ^= cond & (dx < xcross)
        j = i
    return inside


def shape_mask(shape, cx, cy, r):
    """Coverage in [0, 1], float32 [SIZE, SIZE], of a shape centred at
    (cx, cy) with 'radius' r (half of its extent) in pixels."""
    dx, dy = _X - cx, _Y - cy
    ax, ay = np.abs(dx), np.abs(dy)
    if shape == "circle":
        m = dx * dx + dy * dy <= r * r
    elif shape == "square":
        s = r * 0.85
        m = (ax <= s) & (ay <= s)
    elif shape == "diamond":
        m = ax + ay <= r
    elif shape == "triangle":
        # equilateral, point up, centred on its bounding circle
        # vertices (0, -r), (+-0.866 r, 0.5 r): half-width grows by
        # tan(30 deg) = 0.577 per pixel down from the apex
        m = (dy <= r * 0.5) & (ax <= (dy + r) * 0.57735)
    elif shape == "ring":
        d = np.sqrt(dx * dx + dy * dy)
        m = (d <= r) & (d >= r * 0.55)
    elif shape == "cross":
        w = r * 0.33
        m = ((ax <= r) & (ay <= w)) | ((ax <= w) & (ay <= r))
    elif shape == "star":
        m = _star_mask(dx, dy, r)
    else:
        raise ValueError("unknown shape " + shape)
    return m.reshape(SIZE, SS, SIZE, SS).mean(axis=(1, 3)).astype(np.float32)


def _color(rng, name):
    c = np.array(COLORS[name], dtype=np.float32)
    return np.clip(c + rng.uniform(-8, 8, 3), 0, 255)


def _a(word):
    """'a' or 'an' followed by word."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def _paint(img, mask, color):
    img *= 1.0 - mask[..., None]
    img += mask[..., None] * color


def sample(rng):
    """One (image uint8 [64,64,3], caption, info) from a numpy Generator."""
    img = np.zeros((SIZE, SIZE, 3), dtype=np.float32)
    kind = rng.random()
    bg = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
    used = {bg}
    two_tone = None
    if kind < 0.03:                                   # plain background
        img[:] = _color(rng, bg)
        return (img.round().astype(np.uint8), "a plain %s background" % bg,
                {"background": bg, "shapes": []})
    if rng.random() < 0.1:
        two_tone = rng.choice([c for c in COLOR_NAMES if c != bg])
        used.add(two_tone)
        img[:SIZE // 2] = _color(rng, bg)
        img[SIZE // 2:] = _color(rng, two_tone)
    else:
        img[:] = _color(rng, bg)

    def pick_color():
        return rng.choice([c for c in COLOR_NAMES if c not in used])

    shapes = []
    if kind < 0.68:                                    # one shape
        shape = SHAPES[rng.integers(len(SHAPES))]
        col = pick_color()
        size_kind = rng.choice(["small", "medium", "large"], p=[0.3, 0.4, 0.3])
        r = {"small": rng.uniform(7, 10), "medium": rng.uniform(12, 17),
             "large": rng.uniform(19, 25)}[size_kind]
        cx = rng.uniform(r + 3, SIZE - r - 3)
        cy = rng.uniform(r + 3, SIZE - r - 3)
        # keep most shapes near the middle, as a photographer would
        cx = SIZE / 2 + (cx - SIZE / 2) * 0.6
        cy = SIZE / 2 + (cy - SIZE / 2) * 0.6
        _paint(img, shape_mask(shape, cx, cy, r), _color(rng, col))
        shapes.append({"shape": shape, "color": col, "cx": cx, "cy": cy, "r": r})
        size_word = {"small": "small ", "medium": "",
                     "large": rng.choice(["large ", "big "])}[size_kind]
        cap = _a("%s%s %s" % (size_word, col, shape))
    else:                                             # two shapes
        rel = list(RELATIONS)[rng.integers(len(RELATIONS))]
        axis, sign = RELATIONS[rel]
        s1, s2 = SHAPES[rng.integers(len(SHAPES))], SHAPES[rng.integers(len(SHAPES))]
        c1 = pick_color()
        used.add(c1)
        c2 = pick_color()
        r1, r2 = rng.uniform(8, 11), rng.uniform(8, 11)
        near, far = rng.uniform(13, 20), rng.uniform(44, 51)
        a1, a2 = (near, far) if sign < 0 else (far, near)
        o1, o2 = rng.uniform(18, 46), rng.uniform(18, 46)
        p1 = (o1, a1) if axis == "y" else (a1, o1)
        p2 = (o2, a2) if axis == "y" else (a2, o2)
        for s, c, (x, y), r in ((s1, c1, p1, r1), (s2, c2, p2, r2)):
            _paint(img, shape_mask(s, x, y, r), _color(rng, c))
            shapes.append({"shape": s, "color": c, "cx": x, "cy": y, "r": r})
        cap = "%s %s %s" % (_a(c1 + " " + s1), rel, _a(c2 + " " + s2))
    if two_tone is not None:
        cap += " on %s and %s background" % (_a(bg), two_tone)
    elif rng.random() < 0.8:
        cap += " on %s background" % _a(bg)
    return (img.round().astype(np.uint8), cap,
            {"background": bg, "background2": two_tone, "shapes": shapes})


def batch(rng, n):
    """n samples: float32 images [n, 3, 64, 64] in [-1, 1] and captions."""
    imgs, caps = [], []
    for _ in range(n):
        im, cap, _ = sample(rng)
        imgs.append(im)
        caps.append(cap)
    x = np.stack(imgs).astype(np.float32).transpose(0, 3, 1, 2) / 127.5 - 1.0
    return x, caps


if __name__ == "__main__":                           # write a preview sheet
    import sys
    from PIL import Image
    rng = np.random.default_rng(0)
    sheet = Image.new("RGB", (SIZE * 8, SIZE * 4))
    for i in range(32):
        im, cap, _ = sample(rng)
        print(i, cap)
        sheet.paste(Image.fromarray(im), ((i % 8) * SIZE, (i // 8) * SIZE))
    sheet.save(sys.argv[1] if len(sys.argv) > 1 else "/tmp/shapes.png")
