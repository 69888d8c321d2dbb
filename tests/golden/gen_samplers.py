#!/usr/bin/python3
"""Golden trajectories for kiln's samplers and schedules (scripts/kiln/sample.lua).

An independent NumPy implementation of the published k-diffusion sampling
algorithms (k_diffusion/sampling.py: sample_euler, sample_euler_ancestral,
sample_heun, sample_dpm_2, sample_dpm_2_ancestral, sample_lms (coefficients by
scipy.integrate.quad as k-diffusion computes them), sample_dpmpp_2s_ancestral,
sample_dpmpp_2m, sample_dpmpp_sde (noise from the injected source instead of a
Brownian tree), sample_lcm) and of ComfyUI's schedules, run on a toy nonlinear
denoiser with injected noise. Run from the repository root:

    /usr/bin/python3 tests/golden/gen_samplers.py

Writes tests/golden/samplers.safetensors, read by tests/lua/sample_test.lua.
"""
import json, math, struct
import numpy as np
from scipy import integrate

rng = np.random.default_rng(20261129)
SHAPE = (1, 4, 3, 5)
x0 = rng.standard_normal(SHAPE).astype(np.float32)
NOISE = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(64)]


def denoise(x, sigma):
    """Toy denoiser: a smooth nonlinear function of x and sigma (float64 math)."""
    x = x.astype(np.float64)
    return (0.8 * x / (1.0 + sigma * sigma) + 0.1 * np.tanh(x) * sigma / (1.0 + sigma)).astype(np.float32)


class Noise:
    def __init__(self): self.k = 0
    def __call__(self):
        n = NOISE[self.k]; self.k += 1
        return n


def to_d(x, sigma, den): return (x - den) / sigma


def anc(sf, st, eta=1.0):
    if not eta: return st, 0.0
    up = min(st, eta * math.sqrt(st ** 2 * (sf ** 2 - st ** 2) / sf ** 2))
    return math.sqrt(st ** 2 - up ** 2), up


def euler(x, s, noise):
    for i in range(len(s) - 1):
        den = denoise(x, s[i]); x = x + to_d(x, s[i], den) * (s[i + 1] - s[i])
    return x


def euler_ancestral(x, s, noise):
    for i in range(len(s) - 1):
        den = denoise(x, s[i]); down, up = anc(s[i], s[i + 1])
        x = x + to_d(x, s[i], den) * (down - s[i])
        if s[i + 1] > 0: x = x + noise() * up
    return x


def heun(x, s, noise):
    for i in range(len(s) - 1):
        den = denoise(x, s[i]); d = to_d(x, s[i], den); dt = s[i + 1] - s[i]
        if s[i + 1] == 0: x = x + d * dt
        else:
            x2 = x + d * dt; d2 = to_d(x2, s[i + 1], denoise(x2, s[i + 1]))
            x = x + (d + d2) / 2 * dt
    return x


def dpm_2(x, s, noise):
    for i in range(len(s) - 1):
        den = denoise(x, s[i]); d = to_d(x, s[i], den)
        if s[i + 1] == 0: x = x + d * (s[i + 1] - s[i])
        else:
            mid = math.exp(0.5 * (math.log(s[i]) + math.log(s[i + 1])))
            x2 = x + d * (mid - s[i]); d2 = to_d(x2, mid, denoise(x2, mid))
            x = x + d2 * (s[i + 1] - s[i])
    return x


def dpm_2_ancestral(x, s, noise):
    for i in range(len(s) - 1):
        den = denoise(x, s[i]); down, up = anc(s[i], s[i + 1]); d = to_d(x, s[i], den)
        if down == 0: x = x + d * (down - s[i])
        else:
            mid = math.exp(0.5 * (math.log(s[i]) + math.log(down)))
            x2 = x + d * (mid - s[i]); d2 = to_d(x2, mid, denoise(x2, mid))
            x = x + d2 * (down - s[i]); x = x + noise() * up
    return x


def lms_coeff(order, t, i, j):
    def fn(tau):
        p = 1.0
        for k in range(order):
            if j == k: continue
            p *= (tau - t[i - k]) / (t[i - j] - t[i - k])
        return p
    return integrate.quad(fn, t[i], t[i + 1], epsrel=1e-10)[0]


def lms(x, s, noise, order=4):
    ds = []
    for i in range(len(s) - 1):
        den = denoise(x, s[i]); ds.append(to_d(x, s[i], den))
        if len(ds) > order: ds.pop(0)
        cur = min(i + 1, order)
        coeffs = [lms_coeff(cur, s, i, j) for j in range(cur)]
        x = x + sum(c * d for c, d in zip(coeffs, reversed(ds)))
    return x


sfn = lambda t: math.exp(-t)
tfn = lambda sg: -math.log(sg)


def dpmpp_2s_ancestral(x, s, noise):
    for i in range(len(s) - 1):
        den = denoise(x, s[i]); down, up = anc(s[i], s[i + 1])
        if down == 0: x = x + to_d(x, s[i], den) * (down - s[i])
        else:
            t, tn = tfn(s[i]), tfn(down); h = tn - t; sm = t + 0.5 * h
            x2 = (sfn(sm) / sfn(t)) * x - math.expm1(-h * 0.5) * den
            den2 = denoise(x2, sfn(sm))
            x = (sfn(tn) / sfn(t)) * x - math.expm1(-h) * den2
        if s[i + 1] > 0: x = x + noise() * up
    return x


def dpmpp_2m(x, s, noise):
    old = None
    for i in range(len(s) - 1):
        den = denoise(x, s[i])
        if s[i + 1] == 0:
            x = den  # sigma_fn(inf)/sigma_fn(t) = 0, expm1(-inf) = -1
        else:
            t, tn = tfn(s[i]), tfn(s[i + 1]); h = tn - t
            if old is None: x = (sfn(tn) / sfn(t)) * x - math.expm1(-h) * den
            else:
                hl = t - tfn(s[i - 1]); r = hl / h
                dd = (1 + 1 / (2 * r)) * den - (1 / (2 * r)) * old
                x = (sfn(tn) / sfn(t)) * x - math.expm1(-h) * dd
        old = den
    return x


def dpmpp_sde(x, s, noise, r=0.5):
    for i in range(len(s) - 1):
        den = denoise(x, s[i])
        if s[i + 1] == 0: x = x + to_d(x, s[i], den) * (s[i + 1] - s[i])
        else:
            t, tn = tfn(s[i]), tfn(s[i + 1]); h = tn - t; sm = t + h * r; fac = 1 / (2 * r)
            sd, su = anc(sfn(t), sfn(sm)); s_ = tfn(sd)
            x2 = (sfn(s_) / sfn(t)) * x - math.expm1(t - s_) * den
            x2 = x2 + noise() * su
            den2 = denoise(x2, sfn(sm))
            sd, su = anc(sfn(t), sfn(tn)); tn_ = tfn(sd)
            dd = (1 - fac) * den + fac * den2
            x = (sfn(tn_) / sfn(t)) * x - math.expm1(t - tn_) * dd
            x = x + noise() * su
    return x


def lcm(x, s, noise):
    for i in range(len(s) - 1):
        x = denoise(x, s[i])
        if s[i + 1] > 0: x = x + noise() * s[i + 1]
    return x


# --- schedules (ComfyUI's, over SD's discrete model schedule) ---
betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=np.float64) ** 2
abar = np.cumprod(1.0 - betas)
SIGMAS = (((1 - abar) / abar) ** 0.5).astype(np.float32)
LOG = np.log(SIGMAS.astype(np.float64))


def timestep(sigma): return int(np.abs(math.log(sigma) - LOG).argmin())


def sigma_at(t):
    t = min(max(t, 0.0), 999.0); lo, hi = math.floor(t), math.ceil(t); w = t - lo
    return math.exp((1 - w) * LOG[lo] + w * LOG[hi])


def karras(n, smin, smax, rho=7.0):
    ramp = np.linspace(0, 1, n)
    return list((smax ** (1 / rho) + ramp * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho) + [0.0]


def exponential(n, smin, smax):
    return list(np.exp(np.linspace(math.log(smax), math.log(smin), n))) + [0.0]


def normal(n, sgm=False):
    start, end = timestep(float(SIGMAS[-1])), timestep(float(SIGMAS[0]))
    ts = np.linspace(start, end, n + 1)[:-1] if sgm else np.linspace(start, end, n)
    return [sigma_at(float(t)) for t in ts] + [0.0]


def simple(n):
    ss = len(SIGMAS) / n
    return [float(SIGMAS[-(1 + int(x * ss))]) for x in range(n)] + [0.0]


def ddim_uniform(n):
    ss = max(len(SIGMAS) // n, 1); out = []; x = 1
    while x < len(SIGMAS): out.append(float(SIGMAS[x])); x += ss
    return out[::-1] + [0.0]


def beta_sched(n, alpha=0.6, beta=0.6):
    # ComfyUI's beta_scheduler (arXiv:2407.12173) with scipy's beta quantiles
    import scipy.stats
    ts = np.rint(scipy.stats.beta.ppf(1 - np.linspace(0, 1, n, endpoint=False), alpha, beta) * (len(SIGMAS) - 1))
    out, last = [], -1
    for t in ts:
        if t != last:
            out.append(float(SIGMAS[int(t)]))
        last = t
    return out + [0.0]


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        raw = np.ascontiguousarray(t, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(np.shape(t)), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw); off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode(); h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h)
        for b in blobs: f.write(b)


out = {"x0": x0, "noise": np.stack(NOISE)}
smin, smax = float(SIGMAS[0]), float(SIGMAS[-1])
sched = {
    "karras": karras(10, smin, smax), "exponential": exponential(10, smin, smax),
    "normal": normal(10), "sgm_uniform": normal(10, True), "simple": simple(10),
    "ddim_uniform": ddim_uniform(10), "karras_custom": karras(7, 0.1, 10.0, 5.0),
    "beta": beta_sched(10), "beta_40": beta_sched(40), "beta_custom": beta_sched(25, 0.5, 0.7),
}
for k, v in sched.items(): out["sched_" + k] = np.array(v, dtype=np.float32)
# zero terminal SNR (Lin et al. 2024, Algorithm 1 on sqrt(abar)); abar_T = 0
# replaced by ComfyUI's 4.8973451890853435e-08 so that sigma_max is finite
sq = abar ** 0.5
sq = (sq - sq[-1]) * sq[0] / (sq[0] - sq[-1])
abar_z = sq ** 2
abar_z[-1] = 4.8973451890853435e-08
out["zsnr_sigmas"] = (((1 - abar_z) / abar_z) ** 0.5).astype(np.float32)
s = [float(v) for v in np.array(sched["karras"], dtype=np.float32)]
for name, fn in [("euler", euler), ("euler_ancestral", euler_ancestral), ("heun", heun), ("dpm_2", dpm_2),
                 ("dpm_2_ancestral", dpm_2_ancestral), ("lms", lms), ("dpmpp_2s_ancestral", dpmpp_2s_ancestral),
                 ("dpmpp_2m", dpmpp_2m), ("dpmpp_sde", dpmpp_sde), ("lcm", lcm)]:
    out["out_" + name] = fn(x0.astype(np.float32), s, Noise())
save("tests/golden/samplers.safetensors", out)
print("wrote tests/golden/samplers.safetensors:", ", ".join(sorted(out)))
