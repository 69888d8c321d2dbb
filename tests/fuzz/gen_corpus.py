#!/usr/bin/python3
"""gen_corpus.py - writes the binary seed inputs of tests/fuzz/corpus/ (safetensors
files, PNGs, gzip vocabularies): each tiny, each one valid example of a case the
parser handles. The text seeds (JSON, prompts, key lists) are written by hand.
Rerun from the repository root: /usr/bin/python3 tests/fuzz/gen_corpus.py"""
import gzip
import io
import json
import os
import struct
import zlib

import numpy as np
from PIL import Image, PngImagePlugin

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def put(name, filename, data):
    d = os.path.join(ROOT, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, filename), "wb") as f:
        f.write(data)


def safetensors(tensors, meta=None, pad=True):
    """tensors: list of (name, dtype, shape, bytes)"""
    header, blobs, at = {}, [], 0
    if meta is not None:
        header["__metadata__"] = meta
    for name, dt, shape, raw in tensors:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def seeds_safetensors():
    f32 = np.arange(6, dtype=np.float32).tobytes()
    f16 = np.arange(4, dtype=np.float16).tobytes()
    put("safetensors", "two.safetensors", safetensors(
        [("a.weight", "F32", [2, 3], f32), ("a.bias", "F16", [4], f16)], {"format": "pt"}))
    put("safetensors", "ints.safetensors", safetensors(
        [("ids", "I64", [1, 2], np.array([[0, 1]], dtype=np.int64).tobytes()),
         ("mask", "U8", [3], b"\x01\x00\x01"), ("bf", "BF16", [2], b"\x80\x3f\x00\x40")]))
    put("safetensors", "empty.safetensors", safetensors([("e", "F32", [0, 4], b"")]))
    put("safetensors", "scalar.safetensors", safetensors([("s", "I32", [], b"\x07\x00\x00\x00")], pad=False))


def png_bytes(img, **kw):
    b = io.BytesIO()
    img.save(b, format="PNG", **kw)
    return b.getvalue()


def seeds_png():
    rgb = Image.fromarray(np.arange(4 * 3 * 3, dtype=np.uint8).reshape(4, 3, 3), "RGB")
    info = PngImagePlugin.PngInfo()
    info.add_text("prompt", "a red circle")
    info.add_itxt("workflow", "caf\u00e9", zip=True)
    put("png", "rgb_text.png", png_bytes(rgb, pnginfo=info))
    put("png", "gray16.png", png_bytes(Image.fromarray(np.array([[0, 65535], [300, 4000]], dtype=np.uint16))))
    pal = rgb.convert("P", palette=Image.ADAPTIVE, colors=4)
    put("png", "palette_trns.png", png_bytes(pal, transparency=0))
    put("png", "interlaced_la.png", png_bytes(Image.new("LA", (5, 3), (10, 200)), optimize=False))
    put("png", "bits1.png", png_bytes(Image.new("1", (9, 2), 1)))
    rgba = Image.new("RGBA", (2, 2), (1, 2, 3, 4))
    put("png", "rgba.png", png_bytes(rgba))


def seeds_vocab():
    merges = "#version: 0.2\nh e\nl l\nhe ll\nhell o</w>\nc a\nca t</w>\n"
    # mode byte 0: CLIP's gzip text from memory; 1: vocab.json NUL merges.txt
    put("vocab", "clip_gz", b"\x00" + gzip.compress(("\"bpe_simple_vocab_16e6.txt" + merges[1:]).encode(), mtime=0))
    put("vocab", "clip_plain", b"\x00" + merges.encode())
    base = {}
    for i, b in enumerate(range(33, 127)):
        base[chr(b)] = i
    vocab = dict(base)
    for s in ["he", "ll", "hell", "hello</w>", "ca", "cat</w>", "<|startoftext|>", "<|endoftext|>"]:
        vocab[s] = len(vocab)
    put("vocab", "hf_pair", b"\x01" + json.dumps(vocab).encode() + b"\x00" + merges.encode())


if __name__ == "__main__":
    seeds_safetensors()
    seeds_png()
    seeds_vocab()
