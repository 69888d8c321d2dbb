#!/usr/bin/python3
"""Writes tests/golden/randn.bin: torch.randn / torch.rand (float32, CPU) after
torch.manual_seed(seed), read by tests/test_rng.c. Run from the repository root:
    /usr/bin/python3 tests/golden/gen_randn.py
(Debian's torch 1.13; x86-64 with AVX2, where ATen's normal_ uses its AVX2 path.)

Format, all little-endian:
  "KRNGOLD1"                        8 bytes
  u32 n_records
  per record (one manual_seed, then a sequence of calls on the default generator):
    u64 seed, u32 n_calls
    per call: u32 kind (0 randn, 1 rand), u32 n, u32 n_head, u32 n_tail,
              u64 fnv1a64 of all n float32 values' bytes,
              n_head float32 (the first values), n_tail float32 (the last values)
Small calls store every value (n_head = n, n_tail = 0); big ones only 64 + 64.
"""
import struct
import sys

import torch

OUT = "tests/golden/randn.bin"
RANDN, RAND = 0, 1
KEEP = 64


def fnv1a64(data):
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def records():
    seeds = [0, 1, 42, 2**32 + 5, 123456789012]
    sizes = [1, 2, 7, 15, 16, 17, 31, 100, 4 * 8 * 8]
    for s in seeds:
        for n in sizes:
            yield s, [(RANDN, n)]
        for n in (1, 5, 16, 33):
            yield s, [(RAND, n)]
    yield 42, [(RANDN, 4 * 64 * 64)]
    yield 7, [(RANDN, 4 * 64 * 64 + 3)]
    # streams continued across calls (and the cached second Box-Muller value)
    yield 0, [(RANDN, 5), (RANDN, 20)]
    yield 1, [(RANDN, 3), (RANDN, 3), (RANDN, 1)]
    yield 2, [(RAND, 3), (RANDN, 1), (RAND, 2), (RANDN, 16), (RANDN, 2)]
    yield 3, [(RANDN, 16), (RANDN, 15), (RANDN, 17), (RAND, 7)]
    yield 123456789012, [(RANDN, 1), (RANDN, 700), (RANDN, 1)]


def main():
    torch.set_num_threads(2)
    recs = list(records())
    out = bytearray(b"KRNGOLD1")
    out += struct.pack("<I", len(recs))
    for seed, calls in recs:
        torch.manual_seed(seed)
        out += struct.pack("<QI", seed, len(calls))
        for kind, n in calls:
            t = torch.randn(n) if kind == RANDN else torch.rand(n)
            assert t.dtype == torch.float32 and t.is_contiguous()
            raw = t.numpy().astype("<f4").tobytes()
            if n <= 4 * KEEP:
                head, tail = raw, b""
            else:
                head, tail = raw[: 4 * KEEP], raw[-4 * KEEP:]
            out += struct.pack("<IIIIQ", kind, n, len(head) // 4, len(tail) // 4, fnv1a64(raw))
            out += head + tail
    with open(OUT, "wb") as f:
        f.write(out)
    print(f"wrote {OUT}: {len(recs)} records, {len(out)} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
