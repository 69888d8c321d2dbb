#!/usr/bin/python3
"""Writes tests/golden/dtype.bin: dtype conversions as numpy / torch do them, read
by tests/test_dtype.c. Run from the repository root:
    /usr/bin/python3 tests/golden/gen_dtype.py

All little-endian. "KDTGOLD1", then sections, each: 4-byte tag, u32 count, data.
  "H2F " 256 x u64  f16 -> f32 (numpy), FNV-1a 64 of the 256 results of each block
                    of f16 bit patterns [256 b, 256 b + 255]
  "B2F " 256 x u64  bf16 -> f32 (torch), same blocking
  "H2B " 256 x u64  f16 -> bf16 (torch)
  "B2H " 256 x u64  bf16 -> f16 (torch)
  "F32 " n x u32    f32 input bits
  "F2H " n x u16    f32 -> f16 (numpy astype)
  "F2B " n x u16    f32 -> bf16 (torch .to)
  "F2I " m x i32    f32 -> i32 for the first m inputs  } kiln's rule: truncate toward
  "F2L " m x i64    f32 -> i64 for the first m inputs  } zero, saturate, nan -> 0
  "F2U " m x u8     f32 -> u8 for the first m inputs   } (torch leaves these undefined)
  "I64 " k x i64    integer inputs
  "L2F " k x u32    i64 -> f32 (torch)
  "L2H " k x u16    i64 -> f16 (torch)
  "L2B " k x u16    i64 -> bf16 (torch)
Nan results are hashed / compared by nan-ness only: hashes see every nan as the
canonical 0x7fc00000 (f32), 0x7e00 (f16), 0x7fc0 (bf16).
"""
import struct
import sys

import numpy as np
import torch

OUT = "tests/golden/dtype.bin"
N_RANDOM_BITS = 9000
N_INT = 2048


def fnv1a64(data):
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def canon_f32(bits):
    bits = bits.astype(np.uint32).copy()
    bits[(bits & 0x7FFFFFFF) > 0x7F800000] = 0x7FC00000
    return bits


def canon_f16(bits):
    bits = bits.astype(np.uint16).copy()
    bits[(bits & 0x7FFF) > 0x7C00] = 0x7E00
    return bits


def canon_bf16(bits):
    bits = bits.astype(np.uint16).copy()
    bits[(bits & 0x7FFF) > 0x7F80] = 0x7FC0
    return bits


def block_hashes(values):
    raw = values.astype(values.dtype.newbyteorder("<")).tobytes()
    step = len(raw) // 256
    return [fnv1a64(raw[i * step:(i + 1) * step]) for i in range(256)]


def f32_of(bits):
    return np.array(bits, dtype=np.uint32).view(np.float32)


def interesting_f32(rng):
    """Inputs where conversions are easy to get wrong, most interesting first."""
    v = []
    # specials: zeros, infinities, nans (quiet, signalling, negative, payloads)
    v += [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
          0x7F800001, 0x7FA00000, 0xFF800001, 0x7FFFFFFF, 0x7F802000, 0x7F800100]
    # f32 subnormals and normal boundaries
    v += [0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x00400000, 0x7F7FFFFF, 0xFF7FFFFF]
    ints = [0.0, 0.4, 0.5, 0.99, 1.0, 1.5, 2.5, -0.4, -0.5, -0.99, -1.0, -1.5, -2.5, 127.5, 128.0,
            254.99, 255.0, 255.49, 255.5, 255.99, 256.0, 256.5, -254.99, -255.5, -256.0,
            1e9, -1e9, 1e10, -1e10, 2147483520.0, 2147483648.0, -2147483648.0, -2147483904.0,
            4294967296.0, 16777217.0, 9.2233715e18, 9.223372e18, -9.223372e18, -9.2233715e18,
            1e19, -1e19, 1e30, -1e30, 3.4e38, -3.4e38]
    v += list(np.array(ints, dtype=np.float32).view(np.uint32))
    # f16 limits: max 65504, the overflow threshold 65520 and its neighbours
    for x in [65504.0, 65520.0, 65536.0, 65519.0, 65505.0, 65488.0, 65512.0, 65528.0, 2.0**-14,
              2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26, 2.0**-15, 6.1e-5, 1.0]:
        b = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
        for d in (-2, -1, 0, 1, 2):
            for s in (0, 0x80000000):
                v.append(((b + d) & 0x7FFFFFFF) | s)
    return v


def tie_f32(rng):
    """Round-to-nearest-even ties of f16 and bf16, and their neighbours."""
    v = []
    # f16 round-to-nearest-even ties: the midpoint between neighbouring f16 values
    # (exact in f32), and one f32 ulp either side; normals and subnormals
    h = np.concatenate([rng.integers(0, 0x7BFF, 500), rng.integers(0, 0x400, 150),
                        np.arange(0x3BF0, 0x3C10), np.arange(0x7BE0, 0x7BFF)]).astype(np.uint16)
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + 1).view(np.float16).astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32).view(np.uint32)
    sign = (rng.integers(0, 2, len(mid)) * 0x80000000).astype(np.uint32)
    for d in (0, -1, 1):
        v += list((mid.astype(np.int64) + d).astype(np.uint32) | sign)
    # bf16 ties: low 16 bits 0x8000 (+-1), odd and even bf16 lsb, near max and min
    top = np.concatenate([rng.integers(0, 0x7F80, 600), [0x7F7F, 0x7F7E, 0x0000, 0x0001, 0x007F, 0x0080]])
    for low in (0x8000, 0x7FFF, 0x8001, 0xFFFF):
        v += list(((top.astype(np.uint32) << 16) | low) | (rng.integers(0, 2, len(top)) * 0x80000000).astype(np.uint32))
    return v


def main():
    torch.set_num_threads(2)
    rng = np.random.default_rng(20240601)
    out = bytearray(b"KDTGOLD1")

    def section(tag, arr):
        nonlocal out
        assert len(tag) == 4
        arr = np.ascontiguousarray(arr)
        out += tag.encode() + struct.pack("<I", len(arr))
        out += arr.astype(arr.dtype.newbyteorder("<")).tobytes()

    all16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    h2f = all16.view(np.float16).astype(np.float32).view(np.uint32)
    b2f = torch.from_numpy(all16.view(np.int16).copy()).view(torch.bfloat16).to(torch.float32).numpy().view(np.uint32)
    h2b = torch.from_numpy(all16.view(np.float16).copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    b2h = torch.from_numpy(all16.view(np.int16).copy()).view(torch.bfloat16).to(torch.float16).numpy().view(np.uint16)
    section("H2F ", np.array(block_hashes(canon_f32(h2f)), dtype=np.uint64))
    section("B2F ", np.array(block_hashes(canon_f32(b2f)), dtype=np.uint64))
    section("H2B ", np.array(block_hashes(canon_bf16(h2b)), dtype=np.uint64))
    section("B2H ", np.array(block_hashes(canon_f16(b2h)), dtype=np.uint64))

    bits = interesting_f32(rng)
    assert len(bits) <= N_INT, len(bits)
    # fill the integer-checked part with values in integer range, then the ties,
    # random bits over the whole range, values in f16's range and f32 subnormals
    small = (rng.standard_normal(N_INT - len(bits)) * 10.0 ** rng.uniform(-2, 10, N_INT - len(bits)))
    bits += list(small.astype(np.float32).view(np.uint32))
    bits += tie_f32(rng)
    bits += list(rng.integers(0, 2**32, N_RANDOM_BITS, dtype=np.uint64).astype(np.uint32))
    bits += list((rng.integers(0x32000000, 0x47800000, 5000) |
                  (rng.integers(0, 2, 5000) << 31)).astype(np.uint32))
    bits += list((rng.integers(1, 0x800000, 1000) | (rng.integers(0, 2, 1000) << 31)).astype(np.uint32))
    bits = np.array(bits, dtype=np.uint32)
    x = bits.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        f2h = x.astype(np.float16).view(np.uint16)
    f2b = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    section("F32 ", bits)
    section("F2H ", f2h)
    section("F2B ", f2b)

    def to_int(f, lo, hi):
        if f != f:
            return 0
        if f == float("inf") or f >= hi + 1:
            return hi
        if f == float("-inf") or f <= lo - 1:
            return lo
        return max(lo, min(hi, int(f)))  # int() truncates toward zero

    xi = [float(f) for f in x[:N_INT]]
    section("F2I ", np.array([to_int(f, -2**31, 2**31 - 1) for f in xi], dtype=np.int32))
    section("F2L ", np.array([to_int(f, -2**63, 2**63 - 1) for f in xi], dtype=np.int64))
    section("F2U ", np.array([to_int(f, 0, 255) for f in xi], dtype=np.uint8))

    iv = [0, 1, -1, 255, 256, 2047, 2049, 65504, 65519, 65520, 65535, -65520, 16777217, -16777217,
          2**31 - 1, -2**31, 2**53 + 1, 2**60 + 2**52 + 2**36 + 1, -(2**60 + 2**52 + 2**36 + 1),
          2**60 + 2**36 + 1, 2**63 - 1, -2**63, 2**62 + 2**38 + 1]
    iv += [int(a) for a in rng.integers(-2**31, 2**31, 300)]
    iv += [int(a) for a in rng.integers(-2**63, 2**63 - 1, 300, dtype=np.int64)]
    iv += [int(a) * (1 << int(s)) + int(c) for a, s, c in
           zip(rng.integers(-255, 256, 300), rng.integers(0, 55, 300), rng.integers(-2, 3, 300))]
    t = torch.tensor(iv, dtype=torch.int64)
    section("I64 ", t.numpy())
    section("L2F ", t.to(torch.float32).numpy().view(np.uint32))
    section("L2H ", t.to(torch.float16).view(torch.int16).numpy().view(np.uint16))
    section("L2B ", t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))

    with open(OUT, "wb") as f:
        f.write(out)
    print(f"wrote {OUT}: {len(bits)} f32 inputs, {len(iv)} integers, {len(out)} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
