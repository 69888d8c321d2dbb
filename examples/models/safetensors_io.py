"""Minimal .safetensors reader/writer (python3-safetensors is not installed).

Layout: 8-byte little-endian header length N, N bytes of JSON header
{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [b, e]}},
then the raw little-endian tensor data; offsets are relative to the end of
the header. The header is padded with spaces to a multiple of 8 bytes.
"""

import json
import struct

import numpy as np
import torch

_DT = {torch.float32: "F32", torch.float16: "F16", torch.int64: "I64",
       torch.int32: "I32", torch.uint8: "U8", torch.float64: "F64"}
_NP = {"F32": np.float32, "F16": np.float16, "I64": np.int64,
       "I32": np.int32, "U8": np.uint8, "F64": np.float64}


def save(path, tensors, metadata=None):
    """tensors: dict name -> torch tensor, written in dict order."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        raw = t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _DT[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def load(path):
    """-> (dict name -> torch tensor, metadata dict)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        arr = np.frombuffer(data[b:e], dtype=_NP[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out, meta
