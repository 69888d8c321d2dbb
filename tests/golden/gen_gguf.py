#!/usr/bin/python3
"""Golden data for the low-bit weight formats, from an independent NumPy reading of
their definitions (ggml's block formats, the OCP fp8 formats) and a GGUF writer that
follows the GGUF specification; tests/test_gguf.c checks kiln against it.

Writes under tests/golden/gguf/:
- types.gguf    GGUF v3, general.alignment 64, metadata of several value types, one
                [4, 512] tensor per block type (quantized here by the reference
                quantizers) plus f32, f16 and bf16 tensors;
- v2.gguf       GGUF v2 with the default alignment (32);
- expected.safetensors  x.<type> (the f32 input), y.<type> (its decoding), and fp8
                tables: every code's value and the codes of chosen f32 inputs;
- fp8.safetensors  the 256 codes stored as F8_E4M3 and F8_E5M2 tensors.
Every float32 step rounds where the C definitions round (float32 scalars throughout).
Rerun: /usr/bin/python3 tests/golden/gen_gguf.py (from the repository root).
"""
import json
import os
import struct

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gguf")
F = np.float32


def f16r(x):
    """round a float32 to f16 (nearest even) and back"""
    return F(np.float16(F(x)))


def f16b(x):
    return np.array([np.float16(F(x))], dtype="<f2").tobytes()


def nearest_int(x):
    return int(np.rint(F(x)))


def roundf(v):
    """C's roundf: halves away from zero (in float64, where |v| + 0.5 is exact)"""
    a = np.abs(np.asarray(v, dtype=np.float64))
    return (np.sign(v) * np.floor(a + 0.5)).astype(np.int64)


# ---------------------------------------------------------------- fp8

def fp8_values(ebits, mbits, bias, fn):
    """value of each of the 256 codes; fn: e4m3fn (no inf, only S.1111.111 is nan)"""
    vals = np.zeros(256, dtype=np.float64)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e = (c >> mbits) & ((1 << ebits) - 1)
        m = c & ((1 << mbits) - 1)
        top = (1 << ebits) - 1
        if fn and e == top and m == (1 << mbits) - 1:
            v = np.nan
        elif not fn and e == top:
            v = np.inf if m == 0 else np.nan
        elif e == 0:
            v = m * 2.0 ** (1 - bias - mbits)
        else:
            v = (1 + m / 2 ** mbits) * 2.0 ** (e - bias)
        vals[c] = s * v
    return vals


E4M3 = fp8_values(4, 3, 7, True)
E5M2 = fp8_values(5, 2, 15, False)


def fp8_encode(x, vals, overflow_code):
    """nearest code, ties to the even code; past the largest finite value by half a
    step (or at a tie there, as the even neighbour is the overflow value) -> overflow"""
    pos = [(vals[c], c) for c in range(128) if np.isfinite(vals[c])]
    pos.sort()
    top, top_code = pos[-1]
    step = top - pos[-2][0]
    out = []
    for v in np.asarray(x, dtype=np.float64):
        sign = 0x80 if np.signbit(v) else 0
        a = abs(v)
        if np.isnan(a):
            out.append(sign | 0x7F)
            continue
        if a > top + step / 2 or (a == top + step / 2 and top_code & 1):
            out.append(sign | overflow_code)
            continue
        best = None
        for val, c in pos:
            d = abs(a - val)
            if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
                best = (d, c)
        out.append(sign | best[1])
    return np.array(out, dtype=np.uint8)


# ---------------------------------------------------------------- block formats
# decoders: block bytes -> float32 values, vectorized over blocks

def blocks(raw, size):
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, size)


def half(b, at):
    return b[:, at:at + 2].copy().view("<f2").astype(F)[:, 0:1]


def dec_q8_0(raw):
    b = blocks(raw, 34)
    return (b[:, 2:].view(np.int8).astype(F) * half(b, 0)).reshape(-1)


def dec_q4_0(raw):
    b = blocks(raw, 18)
    q = b[:, 2:]
    v = np.concatenate([(q & 15).astype(np.int32) - 8, (q >> 4).astype(np.int32) - 8], axis=1)
    return (v.astype(F) * half(b, 0)).reshape(-1)


def dec_q4_1(raw):
    b = blocks(raw, 20)
    q = b[:, 4:]
    v = np.concatenate([q & 15, q >> 4], axis=1)
    return (v.astype(F) * half(b, 0) + half(b, 2)).reshape(-1)


def fifth_bits(b, at):
    qh = b[:, at:at + 4].copy().view("<u4")[:, 0]
    return ((qh[:, None] >> np.arange(32, dtype=np.uint32)[None, :]) & 1).astype(np.int32)


def dec_q5_0(raw):
    b = blocks(raw, 22)
    q = b[:, 6:]
    v = np.concatenate([q & 15, q >> 4], axis=1).astype(np.int32) | (fifth_bits(b, 2) << 4)
    return ((v - 16).astype(F) * half(b, 0)).reshape(-1)


def dec_q5_1(raw):
    b = blocks(raw, 24)
    q = b[:, 8:]
    v = np.concatenate([q & 15, q >> 4], axis=1).astype(np.int32) | (fifth_bits(b, 4) << 4)
    return (v.astype(F) * half(b, 0) + half(b, 2)).reshape(-1)


def k_scales(sc):
    """the eight 6-bit (scale, min) pairs of q4_K / q5_K from their 12 bytes"""
    s, m = np.zeros((sc.shape[0], 8), np.int32), np.zeros((sc.shape[0], 8), np.int32)
    sc = sc.astype(np.int32)
    for j in range(8):
        if j < 4:
            s[:, j] = sc[:, j] & 63
            m[:, j] = sc[:, j + 4] & 63
        else:
            s[:, j] = (sc[:, j + 4] & 15) | ((sc[:, j - 4] >> 6) << 4)
            m[:, j] = (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4)
    return s, m


def dec_q4_k(raw):
    b = blocks(raw, 144)
    d, dmin = half(b, 0), half(b, 2)
    s, m = k_scales(b[:, 4:16])
    q = b[:, 16:]
    out = []
    for c in range(4):  # 64 values per chunk: low nibbles then high nibbles of 32 bytes
        qq = q[:, 32 * c:32 * c + 32]
        for half_i, vals in enumerate((qq & 15, qq >> 4)):
            j = 2 * c + half_i
            dj = d * s[:, j:j + 1].astype(F)
            mj = dmin * m[:, j:j + 1].astype(F)
            out.append(dj * vals.astype(F) - mj)
    return np.concatenate(out, axis=1).reshape(-1)


def dec_q5_k(raw):
    b = blocks(raw, 176)
    d, dmin = half(b, 0), half(b, 2)
    s, m = k_scales(b[:, 4:16])
    qh, ql = b[:, 16:48].astype(np.int32), b[:, 48:]
    out = []
    for c in range(4):
        qq = ql[:, 32 * c:32 * c + 32].astype(np.int32)
        for half_i, vals in enumerate((qq & 15, qq >> 4)):
            j = 2 * c + half_i
            hi = ((qh >> j) & 1) * 16
            dj = d * s[:, j:j + 1].astype(F)
            mj = dmin * m[:, j:j + 1].astype(F)
            out.append(dj * (vals + hi).astype(F) - mj)
    return np.concatenate(out, axis=1).reshape(-1)


def dec_q6_k(raw):
    b = blocks(raw, 210)
    ql, qh = b[:, :128].astype(np.int32), b[:, 128:192].astype(np.int32)
    sc = b[:, 192:208].view(np.int8).astype(F)
    d = half(b, 208)
    y = np.zeros((b.shape[0], 256), F)
    for n in range(2):
        L, H, S = ql[:, 64 * n:64 * n + 64], qh[:, 32 * n:32 * n + 32], sc[:, 8 * n:8 * n + 8]
        l = np.arange(32)
        q = [(L[:, l] & 15) | ((H >> 0) & 3) << 4, (L[:, l + 32] & 15) | ((H >> 2) & 3) << 4,
             (L[:, l] >> 4) | ((H >> 4) & 3) << 4, (L[:, l + 32] >> 4) | ((H >> 6) & 3) << 4]
        for k in range(4):
            scale = S[:, (l // 16) + 2 * k]
            y[:, 128 * n + 32 * k + l] = (d * scale) * (q[k] - 32).astype(F)
    return y.reshape(-1)


# reference quantizers (ggml's quantize_row_*_ref), one block at a time

def first_absmax(x):
    i = int(np.argmax(np.abs(x)))
    return F(abs(x[i])), F(x[i])


def enc_q8_0(x):
    amax = F(np.max(np.abs(x)))
    d = F(amax / F(127))
    idv = F(F(1) / d) if d != 0 else F(0)
    q = roundf((x * idv).astype(F)).astype(np.int8)
    return f16b(d) + q.tobytes()


def enc_q4_0(x):
    amax, mx = first_absmax(x)
    d = F(mx / F(-8))
    idv = F(F(1) / d) if d != 0 else F(0)
    v = np.trunc((x * idv).astype(F) + F(8.5)).astype(np.int64)
    v = np.minimum(15, v)
    return f16b(d) + (v[:16] | v[16:] << 4).astype(np.uint8).tobytes()


def enc_q4_1(x):
    mn, mx = F(np.min(x)), F(np.max(x))
    d = F(F(mx - mn) / F(15))
    idv = F(F(1) / d) if d != 0 else F(0)
    v = np.minimum(15, np.trunc(((x - mn).astype(F) * idv).astype(F) + F(0.5)).astype(np.int64))
    return f16b(d) + f16b(mn) + (v[:16] | v[16:] << 4).astype(np.uint8).tobytes()


def pack5(v):
    qh = 0
    for j in range(32):
        qh |= int((v[j] >> 4) & 1) << j
    return struct.pack("<I", qh), ((v[:16] & 15) | (v[16:] & 15) << 4).astype(np.uint8).tobytes()


def enc_q5_0(x):
    amax, mx = first_absmax(x)
    d = F(mx / F(-16))
    idv = F(F(1) / d) if d != 0 else F(0)
    v = np.minimum(31, np.trunc((x * idv).astype(F) + F(16.5)).astype(np.int64))
    qh, qs = pack5(v)
    return f16b(d) + qh + qs


def enc_q5_1(x):
    mn, mx = F(np.min(x)), F(np.max(x))
    d = F(F(mx - mn) / F(31))
    idv = F(F(1) / d) if d != 0 else F(0)
    v = np.trunc(((x - mn).astype(F) * idv).astype(F) + F(0.5)).astype(np.int64) & 255
    qh, qs = pack5(v)
    return f16b(d) + f16b(mn) + qh + qs


def qkx2(x, w, nmax, rmin, rdelta, nstep):
    """scale, -min and levels minimising the weighted squared error (make_qkx2_quants)"""
    n = len(x)
    mn, mx = F(x[0]), F(x[0])
    sum_w = F(w[0])
    sum_x = F(sum_w * x[0])
    for i in range(1, n):
        mn = min(mn, F(x[i]))
        mx = max(mx, F(x[i]))
        sum_w = F(sum_w + w[i])
        sum_x = F(sum_x + F(w[i] * x[i]))
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return F(0), F(-mn), [0] * n
    iscale = F(F(nmax) / F(mx - mn))
    scale = F(F(1) / iscale)
    L = []
    best = F(0)
    for i in range(n):
        l = max(0, min(nmax, nearest_int(F(iscale * F(x[i] - mn)))))
        L.append(l)
        diff = F(F(F(scale * F(l)) + mn) - x[i])
        best = F(best + F(w[i] * F(diff * diff)))
    for step in range(nstep + 1):
        iscale = F(F(F(F(rmin) + F(F(rdelta) * F(step))) + F(nmax)) / F(mx - mn))
        sl, sl2, sxl = F(0), F(0), F(0)
        aux = []
        for i in range(n):
            l = max(0, min(nmax, nearest_int(F(iscale * F(x[i] - mn)))))
            aux.append(l)
            wl = F(w[i] * F(l))
            sl = F(sl + wl)
            sl2 = F(sl2 + F(wl * F(l)))
            sxl = F(sxl + F(wl * x[i]))
        D = F(F(sum_w * sl2) - F(sl * sl))
        if D > 0:
            this_scale = F(F(F(sum_w * sxl) - F(sum_x * sl)) / D)
            this_min = F(F(F(sl2 * sum_x) - F(sl * sxl)) / D)
            if this_min > 0:
                this_min = F(0)
                this_scale = F(sxl / sl2)
            cur = F(0)
            for i in range(n):
                diff = F(F(F(this_scale * F(aux[i])) + this_min) - x[i])
                cur = F(cur + F(w[i] * F(diff * diff)))
            if cur < best:
                L, best, scale, mn = aux, cur, this_scale, this_min
    return scale, F(-mn), L


def enc_kx(x, nmax, rmin, rdelta, nstep):
    """shared part of q4_K / q5_K: (d, dmin, the 12 scale bytes, the 256 levels)"""
    scales, mins, L = [], [], []
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        s2 = F(0)
        for v in xs:
            s2 = F(s2 + F(v * v))
        av = F(np.sqrt(F(s2 / F(32))))
        w = [F(av + F(abs(v))) for v in xs]
        s, m, l = qkx2(xs, w, nmax, rmin, rdelta, nstep)
        scales.append(s)
        mins.append(m)
        L += list(l)
    max_scale = max([F(0)] + [s for s in scales])
    max_min = max([F(0)] + [m for m in mins])
    inv_s = F(F(63) / max_scale) if max_scale > 0 else F(0)
    inv_m = F(F(63) / max_min) if max_min > 0 else F(0)
    sc = [0] * 12
    for j in range(8):
        ls = min(63, nearest_int(F(inv_s * scales[j])) & 255)
        lm = min(63, nearest_int(F(inv_m * mins[j])) & 255)
        if j < 4:
            sc[j], sc[j + 4] = ls, lm
        else:
            sc[j + 4] = (ls & 15) | ((lm & 15) << 4)
            sc[j - 4] |= (ls >> 4) << 6
            sc[j] |= (lm >> 4) << 6
    d, dmin = f16r(F(max_scale / F(63))), f16r(F(max_min / F(63)))
    s6, m6 = k_scales(np.array([sc], dtype=np.uint8))
    for j in range(8):
        dd = F(d * F(s6[0, j]))
        if dd == 0:
            continue
        dm = F(dmin * F(m6[0, j]))
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, nearest_int(F(F(x[32 * j + i] + dm) / dd))))
    return d, dmin, bytes(sc), L


def enc_q4_k(x):
    d, dmin, sc, L = enc_kx(x, 15, -1.0, 0.1, 20)
    q = bytearray()
    for j in range(0, 256, 64):
        q += bytes(L[j + l] | (L[j + l + 32] << 4) for l in range(32))
    return f16b(d) + f16b(dmin) + sc + bytes(q)


def enc_q5_k(x):
    d, dmin, sc, L = enc_kx(x, 31, -0.5, 0.1, 15)
    qh, ql = [0] * 32, bytearray()
    for c, n in enumerate(range(0, 256, 64)):
        part = []
        for j in range(32):
            l1, l2 = L[n + j], L[n + j + 32]
            if l1 > 15:
                l1 -= 16
                qh[j] |= 1 << (2 * c)
            if l2 > 15:
                l2 -= 16
                qh[j] |= 2 << (2 * c)
            part.append(l1 | (l2 << 4))
        ql += bytes(part)
    return f16b(d) + f16b(dmin) + sc + bytes(qh) + bytes(ql)


def qx(x, nmax):
    """make_qx_quants with rmse_type 1 and no importance weights: (scale, levels + nmax)"""
    amax, mx = F(0), F(0)
    for v in x:
        if F(abs(v)) > amax:
            amax, mx = F(abs(v)), F(v)
    n = len(x)
    if amax < F(1e-15):
        return F(0), [0] * n
    iscale = F(F(-nmax) / mx)

    def sums(isc):
        slx, sl2, ls = F(0), F(0), []
        for v in x:
            l = max(-nmax, min(nmax - 1, nearest_int(F(isc * v))))
            ls.append(l + nmax)
            w = F(v * v)
            slx = F(slx + F(F(w * v) * F(l)))
            sl2 = F(sl2 + F(F(w * F(l)) * F(l)))
        return slx, sl2, ls

    sumlx, suml2, L = sums(iscale)
    scale = F(sumlx / suml2) if suml2 != 0 else F(0)
    best = F(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        isc = F(F(-F(F(nmax) + F(F(0.1) * F(step)))) / mx)
        slx, sl2, ls = sums(isc)
        if sl2 > 0 and F(slx * slx) > F(best * sl2):
            L, scale = ls, F(slx / sl2)
            best = F(scale * slx)
    return scale, L


def enc_q6_k(x):
    scales, L = [], []
    max_scale, max_abs = F(0), F(0)
    for ib in range(16):
        s, l = qx(x[16 * ib:16 * ib + 16], 32)
        scales.append(s)
        L += l
        if F(abs(s)) > max_abs:
            max_abs, max_scale = F(abs(s)), s
    if max_abs < F(1e-15):
        return bytes(210)
    iscale = F(F(-128) / max_scale)
    d = f16r(F(F(1) / iscale))
    sc = [min(127, nearest_int(F(iscale * s))) for s in scales]
    for j in range(16):
        dd = F(d * F(sc[j]))
        if dd == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, nearest_int(F(x[16 * j + i] / dd)))) + 32
    ql, qh = bytearray(), bytearray()
    for j in range(0, 256, 128):
        lo, hi = [0] * 64, [0] * 32
        for l in range(32):
            q1, q2, q3, q4 = L[j + l], L[j + l + 32], L[j + l + 64], L[j + l + 96]
            lo[l] = (q1 & 15) | ((q3 & 15) << 4)
            lo[l + 32] = (q2 & 15) | ((q4 & 15) << 4)
            hi[l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
        ql += bytes(lo)
        qh += bytes(hi)
    return bytes(ql) + bytes(qh) + np.array(sc, dtype=np.int8).tobytes() + f16b(d)


# name: (ggml type id, block elements, encoder, decoder)
TYPES = {
    "q8_0": (8, 32, enc_q8_0, dec_q8_0), "q4_0": (2, 32, enc_q4_0, dec_q4_0),
    "q4_1": (3, 32, enc_q4_1, dec_q4_1), "q5_0": (6, 32, enc_q5_0, dec_q5_0),
    "q5_1": (7, 32, enc_q5_1, dec_q5_1), "q4_k": (12, 256, enc_q4_k, dec_q4_k),
    "q5_k": (13, 256, enc_q5_k, dec_q5_k), "q6_k": (14, 256, enc_q6_k, dec_q6_k),
}


def quantize(x, name):
    _, blk, enc, _ = TYPES[name]
    flat = x.reshape(-1).astype(F)
    return b"".join(enc(flat[i:i + blk]) for i in range(0, flat.size, blk))


def test_input(rng, shape):
    """values with the awkward cases: an all-zero block, a constant block, positive-only
    and negative-only blocks, an outlier, tiny values, and plain normal noise"""
    x = rng.standard_normal(shape).astype(F)
    flat = x.reshape(-1)
    if flat.size < 2048:
        flat[5] = F(-3.0)
        return x
    flat[0:32] = 0
    flat[32:64] = F(0.75)
    flat[64:96] = np.abs(flat[64:96])
    flat[96:128] = -np.abs(flat[96:128])
    flat[200] = F(40.0)
    flat[256:288] *= F(1e-6)
    flat[512:768] = rng.uniform(-1, 3, 256).astype(F)
    flat[1024:1280] = 0
    return x


# ---------------------------------------------------------------- files

def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_file(path, version, kvs, tensors, alignment):
    """kvs: (key, type id, packed value bytes); tensors: (name, type id, ne list, raw)"""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, t, val in kvs:
        out += gguf_string(key) + struct.pack("<I", t) + val
    offset, datas = 0, []
    for name, t, ne, raw in tensors:
        out += gguf_string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        out += struct.pack("<IQ", t, offset)
        pad = -len(raw) % alignment
        datas.append(raw + bytes(pad))
        offset += len(raw) + pad
    out += bytes(-len(out) % alignment)
    out += b"".join(datas)
    with open(path, "wb") as f:
        f.write(out)
    print(path, len(out), "bytes")


def safetensors(path, arrays):
    names = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}
    header, blobs, off = {}, [], 0
    for k, (a, dt) in arrays.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": dt or names[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"generator": "tests/golden/gen_gguf.py"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    print(path, os.path.getsize(path), "bytes")


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(21)
    expected, tensors = {}, []
    for name, (tid, blk, enc, dec) in TYPES.items():
        x = test_input(rng, (4, 512))
        raw = quantize(x, name)
        y = dec(raw).reshape(4, 512)
        expected["x." + name] = (x, None)
        expected["y." + name] = (y.astype(F), None)
        tensors.append(("w." + name, tid, [512, 4], raw))
    plain = rng.standard_normal((3, 5)).astype(F)
    tensors.append(("w.f32", 0, [5, 3], plain.tobytes()))
    tensors.append(("w.f16", 1, [5, 3], plain.astype("<f2").tobytes()))
    bf = (plain.view("<u4") >> 16).astype("<u2")  # truncated to bf16: exact values below
    tensors.append(("w.bf16", 30, [5, 3], bf.tobytes()))
    expected["y.f32"] = (plain, None)
    expected["y.f16"] = (plain.astype(np.float16).astype(F), None)
    expected["y.bf16"] = ((bf.astype("<u4") << 16).view(F), None)
    tensors.append(("bias", 0, [7], np.arange(7, dtype=F).tobytes()))
    kvs = [
        ("general.architecture", 8, gguf_string("sd1")),
        ("general.alignment", 4, struct.pack("<I", 64)),
        ("general.name", 8, gguf_string("kiln golden")),
        ("test.f32", 6, struct.pack("<f", 0.5)),
        ("test.bool", 7, b"\x01"),
        ("test.i64", 11, struct.pack("<q", -5)),
        ("test.strings", 9, struct.pack("<IQ", 8, 2) + gguf_string("a") + gguf_string("bc")),
        ("test.ints", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", 1, 2, 3)),
    ]
    gguf_file(os.path.join(OUT, "types.gguf"), 3, kvs, tensors, 64)

    x8 = test_input(rng, (1, 32))
    gguf_file(os.path.join(OUT, "v2.gguf"), 2, [("general.architecture", 8, gguf_string("sdxl"))],
              [("v2.q8_0", 8, [32, 1], quantize(x8, "q8_0")), ("v2.f32", 0, [2], np.array([1, -2], F).tobytes())], 32)
    expected["x.v2"] = (x8, None)
    expected["y.v2"] = (dec_q8_0(quantize(x8, "q8_0")).reshape(1, 32), None)

    codes = np.arange(256, dtype=np.uint8)
    expected["f8.codes"] = (codes, None)
    expected["f8.e4m3fn"] = (E4M3.astype(F), None)
    expected["f8.e5m2"] = (E5M2.astype(F), None)
    # inputs: every code's value, the midpoints between neighbours (ties), just
    # above and below them, the overflow boundaries, nan, and random values
    fin4 = np.unique(np.abs(E4M3[np.isfinite(E4M3)]))
    fin5 = np.unique(np.abs(E5M2[np.isfinite(E5M2)]))
    mids = np.concatenate([(fin4[1:] + fin4[:-1]) / 2, (fin5[1:] + fin5[:-1]) / 2])
    ins = np.concatenate([fin4, fin5, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20),
                          [448, 460, 464, 465, 479, 480, 1e4, 57344, 61439, 61440, 65536, 1e6, np.inf, np.nan, 1e-30],
                          rng.standard_normal(200) * 10, rng.standard_normal(100) * 1e-3])
    ins = np.concatenate([ins, -ins]).astype(F)
    expected["f8.in"] = (ins, None)
    expected["f8.in_e4m3fn"] = (fp8_encode(ins.astype(np.float64), E4M3, 0x7F), None)
    expected["f8.in_e5m2"] = (fp8_encode(ins.astype(np.float64), E5M2, 0x7C), None)
    safetensors(os.path.join(OUT, "expected.safetensors"), expected)
    safetensors(os.path.join(OUT, "fp8.safetensors"), {"e4m3": (codes, "F8_E4M3"), "e5m2": (codes, "F8_E5M2")})


if __name__ == "__main__":
    main()
