#!/usr/bin/python3
"""Golden trajectories for kiln's samplers and schedules (scripts/kiln/sample.lua).

An independent NumPy implementation of the published k-diffusion sampling
algorithms (k_diffusion/sampling.py: sample_euler, sample_euler_ancestral,
sample_heun, sample_dpm_2, sample_dpm_2_ancestral, sample_lms (coefficients by
scipy.integrate.quad as k-diffusion computes them), sample_dpmpp_2s_ancestral,
sample_dpmpp_2m, sample_dpmpp_sde, sample_dpmpp_2m_sde, sample_dpmpp_3m_sde (noise
from the injected source instead of a Brownian tree), sample_lcm), of TCD's sampler
(its authors' ComfyUI node, sample_tcd), of diffusers' "trailing" timesteps, of ComfyUI's
UniPC (comfy/extra_samplers/uni_pc.py: sample_unipc, variants bh1 / bh2, on
VP-scaled x as there) and of ComfyUI's schedules, run on a toy nonlinear
denoiser with injected noise. And the Brownian noise of the SDE samplers as
ComfyUI draws it (k-diffusion's BrownianTreeNoiseSampler over torchsde's
BrownianTree: its BrownianInterval with halfway_tree, tol 1e-6, pool_size 24,
ported below over numpy's own SeedSequence and torch's own seeded randn, since
torchsde itself is not installed): the noise at a list of sigma pairs (bt_noise,
bt_pairs) and a DPM++ 2M SDE trajectory drawing it (out_dpmpp_2m_sde_bt, seed 42). Run from the repository root:

    /usr/bin/python3 tests/golden/gen_samplers.py [--only NAME,...]

--only recomputes just the named sampler outputs (out_NAME; "bt" the Brownian noise,
"few_step" TCD's outputs and the trailing schedules) and merges them into
the existing file, leaving every other entry's bytes as they are (for a Python
without SciPy, which the LMS coefficients and the beta schedule need).

Writes tests/golden/samplers.safetensors, read by tests/lua/test_sample.lua.
"""
import json, math, struct, sys
import numpy as np

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
    from scipy import integrate
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


def dpmpp_2m_sde(x, s, noise, eta=1.0):
    old, h_last, h = None, None, None
    for i in range(len(s) - 1):
        den = denoise(x, s[i])
        if s[i + 1] == 0: x = den
        else:
            t, sn = -math.log(s[i]), -math.log(s[i + 1]); h = sn - t; eh = eta * h
            x = s[i + 1] / s[i] * math.exp(-eh) * x + (-math.expm1(-h - eh)) * den
            if old is not None:
                r = h_last / h
                x = x + 0.5 * (-math.expm1(-h - eh)) * (1 / r) * (den - old)
            x = x + noise() * s[i + 1] * math.sqrt(-math.expm1(-2 * eh))
        old, h_last = den, h
    return x


def dpmpp_3m_sde(x, s, noise, eta=1.0):
    d1_, d2_, h, h1, h2 = None, None, None, None, None
    for i in range(len(s) - 1):
        den = denoise(x, s[i])
        if s[i + 1] == 0: x = den
        else:
            t, sn = -math.log(s[i]), -math.log(s[i + 1]); h = sn - t; he = h * (eta + 1)
            x = math.exp(-he) * x + (-math.expm1(-he)) * den
            if h2 is not None:
                r0, r1 = h1 / h, h2 / h
                a = (den - d1_) / r0; b = (d1_ - d2_) / r1
                d1 = a + (a - b) * r0 / (r0 + r1); d2 = (a - b) / (r0 + r1)
                phi2 = math.expm1(-he) / he + 1; phi3 = phi2 / he - 0.5
                x = x + phi2 * d1 - phi3 * d2
            elif h1 is not None:
                x = x + (math.expm1(-he) / he + 1) * (den - d1_) / (h1 / h)
            x = x + noise() * s[i + 1] * math.sqrt(-math.expm1(-2 * h * eta))
        d1_, d2_ = den, d1_
        h1, h2 = h, h1
    return x


# --- UniPC as ComfyUI runs it: VP marginals of sigma (SigmaConvert), an eps model
# made from the denoiser, data prediction, multistep with the corrector ---
def vp_alpha(sg): return math.exp(0.5 * math.log(1 / (sg * sg + 1)))
def vp_std(sg): return math.sqrt(1 - math.exp(2 * 0.5 * math.log(1 / (sg * sg + 1))))
def vp_lambda(sg): return math.log(vp_alpha(sg)) - 0.5 * math.log(1 - math.exp(2 * math.log(vp_alpha(sg))))


def unipc_model(xv, sg):  # data prediction of VP-scaled x through the eps model
    xin = xv * math.sqrt(sg * sg + 1)
    eps = (xin - denoise(xin, sg)) / sg
    return (xv - vp_std(sg) * eps) / vp_alpha(sg)


def unipc_update(variant, x, mlist, tlist, t, order, corrector):
    tp, m0 = tlist[-1], mlist[-1]
    h = vp_lambda(t) - vp_lambda(tp)
    rks, D1s = [], []
    for i in range(1, order):
        rk = (vp_lambda(tlist[-(i + 1)]) - vp_lambda(tp)) / h
        rks.append(rk); D1s.append((mlist[-(i + 1)] - m0) / rk)
    rks.append(1.0); rks = np.array(rks)
    hh = -h; h_phi_1 = math.expm1(hh); h_phi_k = h_phi_1 / hh - 1; fact = 1
    B_h = hh if variant == "bh1" else math.expm1(hh)
    R, b = [], []
    for i in range(1, order + 1):
        R.append(rks ** (i - 1)); b.append(h_phi_k * fact / B_h)
        fact *= i + 1; h_phi_k = h_phi_k / hh - 1 / fact
    R, b = np.stack(R), np.array(b)
    if D1s:
        rhos_p = np.array([0.5]) if order == 2 else np.linalg.solve(R[:-1, :-1], b[:-1])
    rhos_c = np.array([0.5]) if order == 1 else np.linalg.solve(R, b)
    at = vp_alpha(t)
    x_ = vp_std(t) / vp_std(tp) * x - at * h_phi_1 * m0
    pred = sum(r * d for r, d in zip(rhos_p, D1s)) if D1s else 0
    xt = x_ - at * B_h * pred
    mt = None
    if corrector:
        mt = unipc_model(xt, t)
        corr = sum(r * d for r, d in zip(rhos_c[:-1], D1s)) if D1s else 0
        xt = x_ - at * B_h * (corr + rhos_c[-1] * (mt - m0))
    return xt, mt


def unipc(x, s, noise, variant="bh1"):
    ts = list(s)
    if ts[-1] == 0: ts[-1] = 0.001
    steps = len(ts) - 1
    order = min(3, len(ts) - 2)
    x = x / math.sqrt(1 + ts[0] ** 2)
    for k in range(steps):
        if k == 0:
            ml, tl = [unipc_model(x, ts[0])], [ts[0]]
        elif k < order:
            x, mx = unipc_update(variant, x, ml, tl, ts[k], k, True)
            ml.append(mx); tl.append(ts[k])
        else:
            for st in range(k, k + 1 + (1 if k == steps - 1 else 0)):
                x, mx = unipc_update(variant, x, ml, tl, ts[st], min(order, steps + 1 - st), st != steps)
                for i in range(order - 1): tl[i], ml[i] = tl[i + 1], ml[i + 1]
                tl[-1] = ts[st]
                if st < steps: ml[-1] = mx
    return (x / vp_alpha(ts[-1])).astype(np.float32)


# --- torchsde's BrownianInterval (halfway_tree=True, tol=1e-6, pool_size=24,
# levy_area_approximation 'none'), the part BrownianTree uses ---
class TorchsdeInterval:
    def __init__(self, start, end, parent, is_left, top):
        self.start, self.end = top.round(start), top.round(end)
        self.parent, self.is_left, self.top, self.midway = parent, is_left, top, None

    def loc(self, ta, tb, out):
        if ta < self.start or tb > self.end: return self.parent.loc(ta, tb, out)
        if ta == self.start and tb == self.end: out.append(self); return
        if self.midway is None:
            if ta == self.start:
                self.split(tb); return self.left.loc(ta, tb, out)
            self.split(ta); return self.right.loc(ta, tb, out)
        if tb <= self.midway: return self.left.loc(ta, tb, out)
        if ta >= self.midway: return self.right.loc(ta, tb, out)
        self.left.loc(ta, self.midway, out); return self.right.loc(self.midway, tb, out)

    def split(self, midway):  # halfway tree: split at the middle, then descend
        self.split_exact(0.5 * (self.end + self.start))
        if midway > self.midway: self.right.split(midway)
        elif midway < self.midway: self.left.split(midway)

    def split_exact(self, midway):
        if self.midway is not None: return
        self.midway = self.top.round(midway)
        if self.parent is None: self.key, self.depth = 0, 0
        else: self.key, self.depth = 2 * self.parent.key + (0 if self.is_left else 1), self.parent.depth + 1
        gen = np.random.SeedSequence(entropy=self.top.entropy, spawn_key=(self.key, self.depth), pool_size=24)
        self.W_seed = gen.generate_state(4)[0]
        self.left = TorchsdeInterval(self.start, midway, self, True, self.top)
        self.right = TorchsdeInterval(midway, self.end, self, False, self.top)

    def increment(self):
        if self.parent is None: return self.top.W
        p = self.parent; W = p.increment()
        h_rec = 1 / (p.end - p.start); ld = p.midway - p.start; rd = p.end - p.midway
        left = ld * W * h_rec + math.sqrt(ld * rd * h_rec) * self.top.randn(p.W_seed)
        return left if self.is_left else W - left


class TorchsdeTree(TorchsdeInterval):
    def __init__(self, t0, t1, shape, entropy):
        import torch
        self.torch, self.shape, self.entropy = torch, shape, entropy
        self.round = lambda x: round(x, 6)
        t0, t1 = float(t0), float(t1)
        super().__init__(t0, t1, None, None, self)
        ws = np.random.SeedSequence(entropy=entropy, pool_size=24).generate_state(3)[0]
        self.W = self.randn(ws) * math.sqrt(t1 - t0)

    def randn(self, seed):
        g = self.torch.Generator().manual_seed(int(seed))
        return self.torch.randn(self.shape, generator=g)

    def __call__(self, ta, tb):
        ta, tb = min(max(float(ta), self.start), self.end), min(max(float(tb), self.start), self.end)
        if ta == tb: return self.torch.zeros(self.shape)
        out = []; self.loc(self.round(ta), self.round(tb), out)
        W = out[0].increment()
        for iv in out[1:]: W = W + iv.increment()
        return W


def comfy_brownian_noise(x, sigmas, seed):
    """k-diffusion's BrownianTreeNoiseSampler(x, sigma_min, sigma_max, seed) on float32 sigmas."""
    import torch
    sg = torch.tensor(sigmas, dtype=torch.float32)
    tree = TorchsdeTree(sg[sg > 0].min(), sg.max(), tuple(x.shape), seed)
    def noise(sigma, sigma_next):
        t0, t1 = torch.tensor(sigma, dtype=torch.float32), torch.tensor(sigma_next, dtype=torch.float32)
        a, b, sign = (t0, t1, 1) if t0 < t1 else (t1, t0, -1)
        return (tree(a, b) * sign / (t1 - t0).abs().sqrt()).numpy()
    return noise


def lcm(x, s, noise):
    for i in range(len(s) - 1):
        x = denoise(x, s[i])
        if s[i + 1] > 0: x = x + noise() * s[i + 1]
    return x


def tcd(x, s, noise, gamma=0.3):
    """TCD's sampler as its authors' ComfyUI node (ComfyUI-TCD, sample_tcd) computes it:
    alphas_cumprod as its ModelSamplingDiscreteDistilledTCD builds them (float64 betas,
    float32 cumprod), timesteps s = floor((1 - gamma) t) of the next sigma, the last 0;
    the arithmetic in float64, each step's x rounded to float32."""
    import torch
    b = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    ac = torch.cumprod(1.0 - b, dim=0, dtype=torch.float32).numpy().astype(np.float64)
    ts = [math.floor((1 - gamma) * timestep(v)) if v > 0 else 0 for v in s]
    ts[-1] = 0
    a = [float(ac[t]) for t in ts]
    for i in range(len(s) - 1):
        den = denoise(x, s[i]).astype(np.float64)
        eps = (x - den) / s[i]
        den = math.sqrt(a[i + 1]) * den + math.sqrt(1 - a[i + 1]) * eps
        x = den
        if gamma > 0 and s[i + 1] > 0:
            # clamped at 0: where the next sigma is the schedule's smallest (t = 0) the
            # published term is a rounding error's square root (NaN when negative)
            x = x / math.sqrt(a[i + 1]) + noise() * math.sqrt(max(0.0, s[i + 1] ** 2 + 1 - 1 / a[i + 1]))
        else:
            x = x * math.sqrt(s[i + 1] ** 2 + 1)
        x = x.astype(np.float32)
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


def trailing(n):
    # diffusers' EulerDiscreteScheduler, timestep_spacing="trailing"
    ts = np.round(np.arange(len(SIGMAS), 0, -len(SIGMAS) / n))[:n] - 1
    return [float(SIGMAS[int(t)]) for t in ts] + [0.0]


def few_step_goldens(s):
    """tcd at three gammas on the Karras schedule and on a 4-step sgm_uniform one, the
    trailing schedule at 4, 6, 16 steps (16: a half-way timestep that rounds to even)."""
    out = {"out_tcd": tcd(x0.astype(np.float32), s, Noise()),
           "out_tcd_g0": tcd(x0.astype(np.float32), s, Noise(), 0.0),
           "out_tcd_g7": tcd(x0.astype(np.float32), s, Noise(), 0.7)}
    s4 = [float(v) for v in np.array(normal(4, True), dtype=np.float32)]
    out["out_tcd_sgm4"] = tcd(x0.astype(np.float32), s4, Noise(), 0.3)
    for k, n in (("trailing", 4), ("trailing_6", 6), ("trailing_16", 16)):
        out["sched_" + k] = np.array(trailing(n), dtype=np.float32)
    return out


def load(path):
    with open(path, "rb") as f: b = f.read()
    n = struct.unpack("<Q", b[:8])[0]; header = json.loads(b[8:8 + n]); data = b[8 + n:]
    return {k: np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]], dtype=np.float32).reshape(v["shape"])
            for k, v in header.items()}


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


SAMPLERS = [("euler", euler), ("euler_ancestral", euler_ancestral), ("heun", heun), ("dpm_2", dpm_2),
            ("dpm_2_ancestral", dpm_2_ancestral), ("lms", lms), ("dpmpp_2s_ancestral", dpmpp_2s_ancestral),
            ("dpmpp_2m", dpmpp_2m), ("dpmpp_sde", dpmpp_sde), ("lcm", lcm),
            ("dpmpp_2m_sde", dpmpp_2m_sde), ("dpmpp_3m_sde", dpmpp_3m_sde), ("uni_pc", unipc),
            ("uni_pc_bh2", lambda x, s, noise: unipc(x, s, noise, "bh2"))]
PATH = "tests/golden/samplers.safetensors"


def brownian_goldens(s):
    import torch
    torch.set_num_threads(2)
    noise = comfy_brownian_noise(x0, s, 42)
    mids = [math.exp(-(-math.log(s[i]) + 0.5 * (math.log(s[i]) - math.log(s[i + 1])))) for i in range(len(s) - 2)]
    pairs = [(s[i], s[i + 1]) for i in range(len(s) - 2)] + [(s[i], mids[i]) for i in range(len(s) - 2)]
    pairs += [(s[5], s[2]), (s[0], s[-2]), (s[3], s[3])]
    pairs = [(float(np.float32(a)), float(np.float32(b))) for a, b in pairs]
    bt = {"bt_pairs": np.array(pairs, dtype=np.float32),
          "bt_noise": np.stack([noise(a, b) if a != b else np.zeros(SHAPE, np.float32) for a, b in pairs])}
    calls = comfy_brownian_noise(x0, s, 42)
    state = {"i": 0}
    def tree_noise():
        i = state["i"]; state["i"] += 1
        return calls(s[i], s[i + 1])
    bt["out_dpmpp_2m_sde_bt"] = dpmpp_2m_sde(x0.astype(np.float32), s, tree_noise)
    return bt
if "--only" in sys.argv:
    only = sys.argv[sys.argv.index("--only") + 1].split(",")
    out = load(PATH)
    assert np.array_equal(out["x0"], x0) and np.array_equal(out["noise"], np.stack(NOISE)), "inputs differ"
    s = [float(v) for v in out["sched_karras"]]
    for name, fn in SAMPLERS:
        if name in only: out["out_" + name] = fn(x0.astype(np.float32), s, Noise())
    if "bt" in only: out.update(brownian_goldens(s))
    if "few_step" in only: out.update(few_step_goldens(s))
    save(PATH, out)
    print("updated", PATH + ":", ", ".join(only))
    sys.exit(0)

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
for name, fn in SAMPLERS:
    out["out_" + name] = fn(x0.astype(np.float32), s, Noise())
out.update(brownian_goldens(s))
out.update(few_step_goldens(s))
save(PATH, out)
print("wrote", PATH + ":", ", ".join(sorted(out)))
