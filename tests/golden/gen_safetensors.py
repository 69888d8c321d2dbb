#!/usr/bin/python3
"""Writes tests/golden/safetensors/ref.safetensors by hand, following the format
specification (u64 little-endian header length, JSON header padded with spaces,
data section) without the safetensors package, for tests/test_safetensors.c.

Deliberate details the C reader must cope with:
- json.dumps' default ensure_ascii escapes non-ASCII names as \\uXXXX (a surrogate
  pair for the emoji);
- header keys sorted by name while the data is laid out in another order;
- a 0-dim scalar and a zero-size tensor; every supported dtype; metadata.
Rerun: /usr/bin/python3 tests/golden/gen_safetensors.py (from the repository root).
"""
import json
import os
import struct

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safetensors", "ref.safetensors")


def bf16_bytes(values):
    # exact bf16 values: the upper half of their float32 bits
    f = np.asarray(values, dtype="<f4").view("<u4")
    return (f >> 16).astype("<u2").tobytes()


# (name, dtype, shape, bytes), in data order
tensors = [
    ("u8.vals", "U8", [5], np.array([0, 1, 127, 128, 255], dtype="u1").tobytes()),
    ("f32.mat", "F32", [2, 3], (np.arange(6, dtype="<f4") * 0.5 - 1.0).tobytes()),
    ("i64.vals", "I64", [2], np.array([-(2 ** 63), 42], dtype="<i8").tobytes()),
    ("f16.vals", "F16", [4], np.array([1.0, -2.0, 0.5, 65504.0], dtype="<f2").tobytes()),
    ("zero.size", "F32", [0, 3], b""),
    ("bf16.vals", "BF16", [2], bf16_bytes([1.5, -3.0])),
    ("i32.vals", "I32", [3], np.array([-1, 0, 2 ** 31 - 1], dtype="<i4").tobytes()),
    ("scalar", "F32", [], np.array(3.25, dtype="<f4").tobytes()),
    ("na\u00efve/\u00fc.weight", "F32", [1, 1, 2], np.array([7.0, -7.0], dtype="<f4").tobytes()),
    ("emoji\U0001F600", "U8", [1], b"\x2a"),
]

header = {"__metadata__": {"format": "pt", "note": 'h\u00e9llo "q" \\ \u2615'}}
data = b""
for name, dtype, shape, raw in tensors:
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
    data += raw

text = json.dumps(header, sort_keys=True).encode("ascii")
text += b" " * (-(8 + len(text)) % 8)
os.makedirs(os.path.dirname(OUT), exist_ok=True)
with open(OUT, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    f.write(data)
print(OUT, 8 + len(text) + len(data), "bytes")
