#!/usr/bin/python3
"""Writes runtime/data/t5_spiece.bin.gz, T5 v1.1's SentencePiece Unigram model in the
compact form libkiln compiles in (runtime/t5_tokenizer.c reads it), from the Hugging
Face tokenizer.json that ComfyUI ships (comfy/text_encoders/t5_tokenizer/tokenizer.json,
Apache-2.0, Google: runtime/data/LICENSE-T5). Python is not needed to build kiln: the
output is committed, and the Makefile compiles it in with gen_blob.lua.

Only SentencePiece's own 32,000 pieces are kept: the 100 <extra_id_N> tokens that
transformers appends are added tokens, not pieces of the model, and SentencePiece never
produces them. Types as in T5's spiece.model: <pad> and </s> CONTROL, <unk> UNKNOWN, the
rest NORMAL.

Layout (little-endian), gzip'd with no name and mtime 0 so reruns are byte-identical:
  "KT5V" u32 version=1 u32 n_pieces u32 charsmap_bytes
  n_pieces x { u8 type (1 normal, 2 unknown, 3 control), f32 score, u8 len, len bytes }
  charsmap_bytes of the normalizer's precompiled_charsmap (SentencePiece's own blob:
  u32 trie bytes, Darts double array, NUL-separated replacement strings)

Rerun: /usr/bin/python3 runtime/data/gen_t5_vocab.py [tokenizer.json] (from the
repository root; default: the file in a ComfyUI checkout or git mirror, see below).
"""
import base64
import gzip
import io
import json
import os
import struct
import subprocess
import sys

COMFY_PATH = "comfy/text_encoders/t5_tokenizer/tokenizer.json"
COMFY_MIRROR = "/work/.mirror/Comfy-Org+ComfyUI/repo"
OUT = "runtime/data/t5_spiece.bin.gz"
N_PIECES = 32000
NORMAL, UNKNOWN, CONTROL = 1, 2, 3


def read_tokenizer_json(path=None):
    if path:
        with open(path, "rb") as f:
            return json.load(f)
    return json.loads(subprocess.check_output(["git", "-C", COMFY_MIRROR, "show", "HEAD:" + COMFY_PATH]))


def model_of(tj):
    """(pieces [(bytes, score, type)], charsmap bytes) from a tokenizer.json."""
    m = tj["model"]
    assert m["type"] == "Unigram" and m["unk_id"] == 2 and not m.get("byte_fallback"), m["type"]
    vocab = m["vocab"][:N_PIECES]
    assert [p for p, _ in vocab[:3]] == ["<pad>", "</s>", "<unk>"]
    assert all(not p.startswith("<extra_id_") for p, _ in vocab)
    pieces = []
    for i, (p, s) in enumerate(vocab):
        t = CONTROL if i in (0, 1) else UNKNOWN if i == 2 else NORMAL
        pieces.append((p.encode("utf-8"), s, t))
    norms = tj["normalizer"]["normalizers"] if tj["normalizer"]["type"] == "Sequence" else [tj["normalizer"]]
    cm = [n for n in norms if n["type"] == "Precompiled"]
    assert len(cm) == 1
    return pieces, base64.b64decode(cm[0]["precompiled_charsmap"])


def pack(pieces, charsmap):
    out = io.BytesIO()
    out.write(b"KT5V" + struct.pack("<III", 1, len(pieces), len(charsmap)))
    for p, s, t in pieces:
        assert 0 < len(p) < 256
        out.write(struct.pack("<BfB", t, s, len(p)) + p)
    out.write(charsmap)
    return out.getvalue()


def unpack(data):
    assert data[:4] == b"KT5V"
    ver, n, ncm = struct.unpack_from("<III", data, 4)
    pos, pieces = 16, []
    for _ in range(n):
        t, = struct.unpack_from("<B", data, pos)
        s, = struct.unpack_from("<f", data, pos + 1)
        ln = data[pos + 5]
        pieces.append((data[pos + 6:pos + 6 + ln], s, t))
        pos += 6 + ln
    assert len(data) == pos + ncm
    return pieces, data[pos:]


def main():
    pieces, charsmap = model_of(read_tokenizer_json(sys.argv[1] if len(sys.argv) > 1 else None))
    raw = pack(pieces, charsmap)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as g:
        g.write(raw)
    with open(OUT, "wb") as f:
        f.write(buf.getvalue())
    print(f"{OUT}: {len(pieces)} pieces, charsmap {len(charsmap)} bytes, {len(raw)} -> {len(buf.getvalue())} bytes")


if __name__ == "__main__":
    main()
