#!/usr/bin/python3
"""Golden skip decisions for kiln's step caches (scripts/kiln/step_cache.lua).

Each policy's published rule, reimplemented here in NumPy as its code reads, run on
recorded trajectories of the values it decides from (made here: a tensor per step that
drifts by a shrinking amount with a few jumps, as a network's first-block residual or
modulated input does over a sampling run):

- First-Block Cache as Comfy-WaveSpeed's first_block_cache.py (get_can_use_cache,
  are_two_tensors_similar): mean |prev - cur| / mean |prev| against the residual kept
  at the last step that ran in full (a reused step keeps the old one), never on the
  first step; its node's max_consecutive_cache_hits limit (validate_use_cache).
- TeaCache as ComfyUI-TeaCache's nodes.py (teacache_flux_forward): the relative L1
  distance of the modulated input to the previous step's (always updated), rescaled by
  poly1d(coefficients), its absolute value summed; reuse while the sum is under
  rel_l1_thresh, a full step resets it; the first step runs in full.
- DeepCache (Ma et al.): a full step every cache_interval steps, from the first.

Writes tests/golden/step_cache.safetensors (trajectories, per-step values and
decisions; 1 = reuse), read by tests/lua/test_step_cache.lua. Run from the
repository root:

    /usr/bin/python3 tests/golden/gen_step_cache.py
"""
import json, math, struct
import numpy as np

STEPS = 24
SHAPE = (2, 3, 4, 4)
FLUX = [4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01]


def trajectory(seed, drift, floor):
    r = np.random.default_rng(seed)
    cur = r.standard_normal(SHAPE)
    out = []
    for i in range(STEPS):
        scale = drift * math.exp(-i / 6.0) + floor + (0.15 if i % 7 == 3 else 0.0)
        cur = cur + scale * r.standard_normal(SHAPE)
        out.append(cur.astype(np.float32))
    return np.stack(out)


def rel_l1(prev, cur):
    prev, cur = prev.astype(np.float64), cur.astype(np.float64)
    return float(np.abs(prev - cur).mean() / np.abs(prev).mean())


def fbcache(traj, threshold, max_hits=-1):
    first, hits, dec, vals = None, 0, [], []
    for r in traj:
        if first is None:
            use, v = False, float("nan")
        else:
            v = rel_l1(first, r)
            use = v < threshold
            use = use and (max_hits < 0 or hits < max_hits)
            hits = hits + 1 if use else 0
        if not use:
            first = r
        dec.append(use); vals.append(v)
    return dec, vals


def poly1d(c, x):
    return sum(ci * x ** (len(c) - 1 - i) for i, ci in enumerate(c))


def teacache(traj, threshold, coefficients):
    prev, acc, dec, vals = None, 0.0, [], []
    for m in traj:
        if prev is None:
            calc, acc, v = True, 0.0, float("nan")
        else:
            v = rel_l1(prev, m)
            acc += abs(poly1d(coefficients, v))
            if acc < threshold:
                calc = False
            else:
                calc, acc = True, 0.0
        prev = m
        dec.append(not calc); vals.append(v)
    return dec, vals


def deepcache(interval):
    return [i % interval != 0 for i in range(STEPS)]


def save(path, tensors, meta):
    header, blobs, off = {"__metadata__": meta}, [], 0
    for name, t in tensors.items():
        raw = np.ascontiguousarray(t, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(np.shape(t)), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw); off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode(); h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h)
        for b in blobs: f.write(b)


fb_traj = trajectory(1, 0.5, 0.02)
tea_traj = trajectory(2, 0.3, 0.01)
out = {"traj_fb": fb_traj, "traj_tea": tea_traj}
cases = []
margin = math.inf
for thr, mh in ((0.05, -1), (0.1, -1), (0.2, -1), (0.2, 1)):
    d, v = fbcache(fb_traj, thr, mh)
    name = "fb_%g_%d" % (thr, mh)
    out["dec_" + name], out["val_" + name] = np.array(d, np.float32), np.array(v, np.float32)
    cases.append({"name": name, "mode": "fbcache", "threshold": thr, "max_hits": mh})
    margin = min([margin] + [abs(x - thr) / thr for x in v if not math.isnan(x)])
for thr, coef, tag in ((0.15, [1, 0], "id"), (0.4, [1, 0], "id"), (0.4, FLUX, "flux"), (0.8, FLUX, "flux")):
    d, v = teacache(tea_traj, thr, coef)
    name = "tea_%s_%g" % (tag, thr)
    out["dec_" + name], out["val_" + name] = np.array(d, np.float32), np.array(v, np.float32)
    cases.append({"name": name, "mode": "teacache", "threshold": thr, "coefficients": coef})
for iv in (2, 3, 5):
    name = "deep_%d" % iv
    out["dec_" + name] = np.array(deepcache(iv), np.float32)
    cases.append({"name": name, "mode": "deepcache", "interval": iv})
for c in cases:
    d = out["dec_" + c["name"]]
    assert 0 < d.sum() < STEPS, c["name"] + ": no mix of reuse and full steps"
print("fbcache: smallest relative distance of a value to its threshold %.2e" % margin)
save("tests/golden/step_cache.safetensors", out, {"cases": json.dumps(cases)})
print("wrote tests/golden/step_cache.safetensors:", ", ".join(c["name"] for c in cases))
