#!/usr/bin/python3
"""Writes the PNG files under tests/golden/png/ that tests/test_png.c reads back.

Pixels follow formulas that the C test repeats (W x H = 7 x 5):
  val8(x, y, c)  = (x*37 + y*91 + c*53 + 11) % 256
  val16(x, y, c) = (x*7919 + y*10477 + c*30011 + 12345) % 65536
  palette index  = (x + 2*y) % 4, PALETTE and PALETTE_ALPHA below
Files written by PIL (an independent writer) and by hand from the PNG
specification (16-bit colour, gAMA 1.0, 2-bit gray, Adam7 interlace, tRNS, text
chunks after IDAT), since PIL cannot write those.
Rerun: /usr/bin/python3 tests/golden/gen_png.py (from the repository root).
"""
import os
import struct
import zlib

from PIL import Image, PngImagePlugin

W, H = 7, 5
PALETTE = [(255, 0, 0), (0, 128, 255), (17, 34, 51), (250, 250, 250)]
PALETTE_ALPHA = [255, 0, 128, 64]
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "png")


def val8(x, y, c):
    return (x * 37 + y * 91 + c * 53 + 11) % 256


def val16(x, y, c):
    return (x * 7919 + y * 10477 + c * 30011 + 12345) % 65536


def chunk(kind, data):
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


def scanlines(rows):
    """rows: list of bytes (already packed); filter type 0 on each."""
    return b"".join(b"\x00" + r for r in rows)


def pack_row(samples, depth):
    if depth == 8:
        return bytes(samples)
    if depth == 16:
        return b"".join(struct.pack(">H", s) for s in samples)
    # sub-byte depths: pack MSB first, pad the last byte
    out, acc, nbits = bytearray(), 0, 0
    for s in samples:
        acc = (acc << depth) | s
        nbits += depth
        if nbits == 8:
            out.append(acc)
            acc, nbits = 0, 0
    if nbits:
        out.append(acc << (8 - nbits))
    return bytes(out)


def write_png(name, width, height, depth, color_type, channels, sample, extra_before=b"", extra_after=b"",
              interlace=False):
    """sample(x, y, c) gives each stored sample."""
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color_type, 0, 0, 1 if interlace else 0)

    def row(y, xs):
        return pack_row([sample(x, y, c) for x in xs for c in range(channels)], depth)

    if not interlace:
        raw = scanlines([row(y, range(width)) for y in range(height)])
    else:
        # Adam7: (x0, y0, dx, dy) per pass; empty passes contribute nothing
        raw = b""
        for x0, y0, dx, dy in [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
                               (0, 1, 1, 2)]:
            xs = list(range(x0, width, dx))
            ys = list(range(y0, height, dy))
            if xs and ys:
                raw += scanlines([row(y, xs) for y in ys])
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + extra_before + chunk(b"IDAT", zlib.compress(raw, 9)) +
            extra_after + chunk(b"IEND", b""))
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)


def pil_image(mode, channels):
    im = Image.new(mode, (W, H))
    px = im.load()
    for y in range(H):
        for x in range(W):
            v = tuple(val8(x, y, c) for c in range(channels))
            px[x, y] = v if channels > 1 else v[0]
    return im


def main():
    os.makedirs(OUT, exist_ok=True)
    # --- PIL ---
    for mode, ch in [("L", 1), ("LA", 2), ("RGB", 3), ("RGBA", 4)]:
        pil_image(mode, ch).save(os.path.join(OUT, "pil_%s.png" % mode.lower()))

    im = Image.new("P", (W, H))
    im.putpalette([v for rgb in PALETTE for v in rgb])
    px = im.load()
    for y in range(H):
        for x in range(W):
            px[x, y] = (x + 2 * y) % 4
    im.save(os.path.join(OUT, "pil_palette.png"))
    im.save(os.path.join(OUT, "pil_palette_trns.png"), transparency=bytes(PALETTE_ALPHA))

    im = Image.new("I;16", (W, H))
    px = im.load()
    for y in range(H):
        for x in range(W):
            px[x, y] = val16(x, y, 0)
    im.save(os.path.join(OUT, "pil_gray16.png"))

    info = PngImagePlugin.PngInfo()
    info.add_text("Title", "hello")                              # tEXt
    info.add_text("Author", "caf\u00e9")                         # tEXt, Latin-1 byte 0xE9
    info.add_text("Comment", "zipped " * 20, zip=True)           # zTXt
    info.add_itxt("Description", "caf\u00e9 \u2615", lang="fr")  # iTXt
    pil_image("RGB", 3).save(os.path.join(OUT, "pil_text.png"), pnginfo=info)

    # --- by hand ---
    write_png("hand_rgb16.png", W, H, 16, 2, 3, val16)
    write_png("hand_rgba16.png", W, H, 16, 6, 4, val16)
    write_png("hand_gray_a16.png", W, H, 16, 4, 2, val16)
    # gAMA 1.0 (100000): linear data; kiln reads the stored values
    write_png("hand_gamma1.png", W, H, 8, 0, 1, val8, extra_before=chunk(b"gAMA", struct.pack(">I", 100000)))
    write_png("hand_gray2.png", W, H, 2, 0, 1, lambda x, y, c: (x + y) % 4)
    write_png("hand_interlaced.png", W, H, 8, 2, 3, val8, interlace=True)
    write_png("hand_interlaced16.png", 9, 10, 16, 0, 1, val16, interlace=True)
    # gray with a tRNS colour key: samples equal to the key become transparent
    key = val8(0, 0, 0)
    write_png("hand_gray_trns.png", W, H, 8, 0, 1, val8, extra_before=chunk(b"tRNS", struct.pack(">H", key)))
    # text before and after IDAT
    write_png("hand_text_after.png", W, H, 8, 0, 1, val8,
              extra_before=chunk(b"tEXt", b"Before\x00first"),
              extra_after=chunk(b"tEXt", b"After\x00second") +
              chunk(b"iTXt", b"Utf\x00\x00\x00\x00\x00" + "\u00fc\u00f1\u00ef \U0001F600".encode("utf-8")))
    for name in sorted(os.listdir(OUT)):
        print(name, os.path.getsize(os.path.join(OUT, name)))


if __name__ == "__main__":
    main()
